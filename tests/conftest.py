"""Shared fixtures: tiny models built locally (no hub) once per test session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# Ray and verl write to the home directory and /tmp unless told otherwise; keep test runs out of the
# checkout and quiet about Ray's usage stats.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The tests' helper modules (tests/_*.py) import as top-level modules (pytest's importlib mode adds no test folder).
sys.path.insert(0, str(Path(__file__).parent))


# ---- recipe runs through verl's main_ppo (run.sh with overrides), and the rollout-vs-actor check ----
#: fp32 actor vs fp32 rollout on identical weights differ by ~1e-9 per token (float noise); one PPO step
#: at lr 1e-3 without sync moves probabilities by ~1e-4. 1e-6 sits between them with margin both ways.
SYNC_TOLERANCE = 1e-6


#: The quickstart recipe (recipes/at_grpo_cpu) sized as the tests that use it as a fixture assert on it: K=4,
#: one PPO mini-batch of 8 tasks, rows in batch order, no validation unless the test asks for it (then one
#: greedy episode per task), every row trained (no zero-variance drop). The recipe's own settings (K=8, 2-task
#: mini-batches, shuffled rows, the drop, sampled and greedy validation every 10 steps) are what `make demo`
#: learns with; tests/test_main_ppo_at_grpo.py runs them.
#: A test's own overrides come after these (Hydra: the last value of a key wins).
RELAY_TEST_SHAPE = (
    "mas.branching=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.shuffle=false",
    "trainer.val_before_train=false", "trainer.test_freq=-1", "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=false", "mas.val_greedy=false",
    # Every row through log-probs and update: each policy logs its rollout-vs-actor gap every step, and a role
    # held at zero advantage is a control that still takes its (zero-gradient) steps.
    "mas.drop_zero_variance=false",
)


def rollout_gap(data: dict, policy: str | None = None) -> float:
    """A step's rollout-vs-actor gap (of one policy): verl's ``training/rollout_probs_diff_mean``, which the mas
    trainer logs as ``mas/kept/training/rollout_probs_diff_mean`` when ``mas.drop_zero_variance`` leaves rows
    without signal out of the log-probs (it describes the kept rows only)."""
    name = "training/rollout_probs_diff_mean" if policy is None else f"policy/{policy}/training/rollout_probs_diff_mean"
    for key in (name, f"mas/kept/{name}"):
        if key in data:
            return data[key]
    raise AssertionError(
        f"no {name} at this step: no row of {'the run' if policy is None else policy} went through log-probs "
        f"(mas/drop/no_signal={data.get('mas/drop/no_signal')}); run the check with mas.drop_zero_variance=false")


def rollout_sync_problems(metrics: list[dict], tolerance: float = SYNC_TOLERANCE) -> list[str]:
    """Steps whose rollout-vs-actor probability gap says the rollout did not sample from the actor."""
    return [
        f"step {m['step']}: training/rollout_probs_diff_mean={rollout_gap(m['data']):.3e} > {tolerance:.0e}"
        for m in metrics
        if rollout_gap(m["data"]) > tolerance
    ]


def run_recipe(recipe: Path, run_dir: Path, *overrides: str, steps: int, python: str = sys.executable,
               **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Run a recipe's run.sh with ``python`` for ``steps`` steps; its process and verl's per-step metrics."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    full_env.update(PYTHON=python, VERL_MAS_RUN_DIR=str(run_dir), **env)
    proc = subprocess.run(
        ["bash", str(recipe), f"trainer.total_training_steps={steps}", *overrides],
        cwd=run_dir.parent,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    metrics_file = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return proc, metrics


@pytest.fixture(scope="session")
def recipe_runs() -> SimpleNamespace:
    """``run(recipe, run_dir, *overrides, steps=, python=, **env)``, ``sync_problems(metrics)``,
    ``gap(step_data, policy=None)`` (:func:`rollout_gap`) and ``relay_shape`` (:data:`RELAY_TEST_SHAPE`)."""
    return SimpleNamespace(run=run_recipe, sync_problems=rollout_sync_problems, gap=rollout_gap,
                           relay_shape=RELAY_TEST_SHAPE)


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


def _cost_tier(item: pytest.Item) -> int:
    """0: a main_ppo run on vLLM (2-5 min), 1: another main_ppo run (1-4 min), 2: another slow test, 3: the rest."""
    if "recipe_runs" in getattr(item, "fixturenames", ()):
        return 0 if item.path.name == "test_vllm_cpu.py" else 1
    return 2 if item.get_closest_marker("slow") else 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, each tier in collection order: make test's two pytest-xdist workers take the
    modules in the order of their first test (--dist loadscope --no-loadscope-reorder), and the many short
    ones fill in at the end instead of one long run finishing alone."""
    items.sort(key=_cost_tier)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _figures.extend(line for line in report.capstdout.splitlines() if _FIGURE.match(line))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _figures:
        terminalreporter.section("figures measured by the tests")
        for line in _figures:
            terminalreporter.write_line(line)
