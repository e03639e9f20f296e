"""Shared fixtures: tiny models built locally (no hub) once per test session."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

# Ray and verl write to the home directory and /tmp unless told otherwise; keep test runs out of the
# checkout and quiet about Ray's usage stats.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~0.16M-parameter Qwen2 model with the byte-level BPE tokenizer, written by verl_mas.tiny."""
    from verl_mas.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def procs_of():
    """``procs_of(uids)``: pids of live processes owned by any of ``uids`` (a sandbox's slot uids)."""

    def live(uids: range) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid in uids:
                        found.append(int(entry))
                except FileNotFoundError:  # the process exited while we looked
                    pass
        return found

    return live


# ---- figures: tests print measured numbers as "[topic] ..." lines; the summary repeats them ----------
_FIGURE = re.compile(r"^\[[a-z0-9][a-z0-9-]*\] ")
_figures: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _figures.extend(line for line in report.capstdout.splitlines() if _FIGURE.match(line))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _figures:
        terminalreporter.section("figures measured by the tests")
        for line in _figures:
            terminalreporter.write_line(line)
