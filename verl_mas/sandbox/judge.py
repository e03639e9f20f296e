"""Judging programs: run against (input, expected output) tests, compare outputs, check that code compiles."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_mas.sandbox.backend import SandboxBackend, get_sandbox
from verl_mas.sandbox.result import ExecResult

__all__ = ["COMPARE_MODES", "CompileResult", "TestCase", "TestReport", "TestResult", "check_compiles",
           "normalize_output", "outputs_match", "run_tests"]

COMPARE_MODES = ("exact", "normalized", "tokens")
"""``exact``: byte-for-byte equal text. ``normalized``: equal after `normalize_output` (the usual judge rule).
``tokens``: equal whitespace-separated tokens (ignores all spacing and line breaks)."""

VERDICTS = ("passed", "wrong_output", "runtime_error", "timeout", "killed")


def normalize_output(text: str) -> str:
    """Line endings to ``\\n``, trailing whitespace stripped per line, trailing blank lines dropped.

    Leading whitespace and blank lines inside the text are kept: they can be part of the answer.
    """
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def outputs_match(actual: str, expected: str, mode: str = "normalized") -> bool:
    """Compare a program's output with the expected one under ``mode`` (see ``COMPARE_MODES``).

    Raises:
        ValueError: Unknown ``mode``.
    """
    if mode == "exact":
        return actual == expected
    if mode == "normalized":
        return normalize_output(actual) == normalize_output(expected)
    if mode == "tokens":
        return actual.split() == expected.split()
    raise ValueError(f"compare mode is {mode!r}, not one of {COMPARE_MODES}; pick one of those.")


@dataclass(frozen=True)
class TestCase:
    """One judge test: what goes to stdin and what stdout must be."""

    __test__ = False  # not a pytest class

    input: str
    expected: str


@dataclass(frozen=True, eq=False)
class TestResult:
    """How a program fared on one `TestCase`."""

    __test__ = False

    case: TestCase
    passed: bool
    verdict: str
    """One of ``VERDICTS``: ``passed``, ``wrong_output`` (clean exit, wrong stdout), ``runtime_error`` (non-zero
    exit), ``timeout`` (its time budget), ``killed`` (another limit: memory, CPU, output size, signal)."""
    exec: ExecResult

    @property
    def actual(self) -> str:
        """What the program printed."""
        return self.exec.stdout


@dataclass(frozen=True, eq=False)
class TestReport:
    """Per-test results of one program plus the pass rate (the usual reward signal)."""

    __test__ = False

    results: tuple[TestResult, ...]

    @property
    def passed(self) -> int:
        """Number of tests passed."""
        return sum(r.passed for r in self.results)

    @property
    def total(self) -> int:
        """Number of tests run."""
        return len(self.results)

    @property
    def pass_rate(self) -> float:
        """``passed / total`` in [0, 1]."""
        return self.passed / self.total

    @property
    def all_passed(self) -> bool:
        """Every test passed."""
        return self.passed == self.total


def _verdict(result: ExecResult, expected: str, mode: str) -> str:
    if result.timed_out:
        return "timeout"
    if result.killed_reason is not None:
        return "killed"
    if result.exit_code != 0:
        return "runtime_error"
    return "passed" if outputs_match(result.stdout, expected, mode) else "wrong_output"


async def run_tests(code: str, tests: Sequence[TestCase | tuple[str, str]], *, compare: str = "normalized",
                    timeout_s: float | None = None, memory_mb: int | None = None,
                    files: Mapping[str, str | bytes] | None = None,
                    sandbox: SandboxBackend | None = None) -> TestReport:
    """Run ``code`` once per test (concurrently, bounded by the sandbox pool) and judge each output.

    A test passes when the program exits 0 within its limits and its stdout matches under ``compare``.
    A program that prints the right answer and then hangs fails with verdict ``timeout``.

    Args:
        code: Program source.
        tests: `TestCase` or ``(input, expected_output)`` pairs; at least one.
        compare: Output comparison, one of ``COMPARE_MODES``.
        timeout_s: Per-test time budget (default: the sandbox's; see ``SandboxConfig.timeout_s``).
        memory_mb: Per-test address-space limit (default: the sandbox's).
        files: Extra files for every run.
        sandbox: Backend to use (default: `get_sandbox()`).

    Returns:
        A `TestReport` with one `TestResult` per test, in order.

    Raises:
        ValueError: No tests, a malformed test, or an unknown ``compare`` mode.
        SandboxError: The sandbox itself failed, or machine load starved a run.
    """
    if compare not in COMPARE_MODES:
        raise ValueError(f"compare is {compare!r}, not one of {COMPARE_MODES}; pick one of those.")
    cases = []
    for i, t in enumerate(tests):
        if isinstance(t, TestCase):
            cases.append(t)
        elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            cases.append(TestCase(t[0], t[1]))
        else:
            raise ValueError(f"tests[{i}] is {t!r}; each test must be a TestCase or an (input, expected) pair "
                             "of strings.")
    if not cases:
        raise ValueError("tests is empty; a pass rate over zero tests is undefined. Pass at least one test.")
    box = sandbox or get_sandbox()
    execs = await asyncio.gather(*(box.run_python(code, c.input, timeout_s=timeout_s, memory_mb=memory_mb,
                                                  files=files) for c in cases))
    results = []
    for case, result in zip(cases, execs, strict=True):
        verdict = _verdict(result, case.expected, compare)
        results.append(TestResult(case=case, passed=verdict == "passed", verdict=verdict, exec=result))
    return TestReport(tuple(results))


@dataclass(frozen=True, eq=False)
class CompileResult:
    """Whether source compiles (parses and byte-compiles) as Python, without running it."""

    ok: bool
    error: str | None
    """The compiler's message (e.g. ``SyntaxError: ... (main.py, line 3)``), ``None`` when ``ok``."""
    exec: ExecResult


_COMPILE_CHECK = """\
import sys
src = open("candidate.py", "rb").read()
try:
    compile(src, "main.py", "exec", dont_inherit=True)
except (SyntaxError, ValueError) as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
"""


async def check_compiles(code: str, *, timeout_s: float | None = None,
                         sandbox: SandboxBackend | None = None) -> CompileResult:
    """Compile ``code`` inside the sandbox (the compiler itself can be driven into huge memory or time by
    adversarial source, so it does not run in this process). For "does it build" rewards.

    Args:
        code: Program source.
        timeout_s: Time budget of the check (default: the sandbox's).
        sandbox: Backend to use (default: `get_sandbox()`).

    Returns:
        `CompileResult`; a compiler crash or limit hit counts as not compiling.
    """
    box = sandbox or get_sandbox()
    result = await box.run_python(_COMPILE_CHECK, timeout_s=timeout_s, files={"candidate.py": code})
    if result.ok:
        return CompileResult(ok=True, error=None, exec=result)
    if result.killed_reason is not None:
        return CompileResult(ok=False, error=f"compile check stopped: {result.killed_reason}", exec=result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return CompileResult(ok=False, error=lines[-1] if lines else f"exit code {result.exit_code}", exec=result)
