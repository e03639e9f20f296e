"""Sandboxed execution of model-written Python: one call (`run_python`) for every workflow.

    from verl_mas.sandbox import run_python, run_tests
    result = await run_python("print(int(input()) * 2)", stdin="21\\n")      # result.stdout == "42\\n"
    report = await run_tests(code, [("1 2\\n", "3\\n"), ("5 5\\n", "10\\n")])   # report.pass_rate

The program's own failures (syntax errors, exceptions, timeouts, limits) come back as `ExecResult`
values; a failure of the sandbox itself raises `SandboxError`. See docs/sandbox.md.
"""

from __future__ import annotations

from verl_mas.sandbox.backend import (
    SandboxBackend,
    configure,
    get_sandbox,
    register_backend,
    registered_backends,
    run_python,
)
from verl_mas.sandbox.config import ISOLATION_MODES, SandboxConfig
from verl_mas.sandbox.fusion import SandboxFusionBackend
from verl_mas.sandbox.judge import (
    COMPARE_MODES,
    CompileResult,
    TestCase,
    TestReport,
    TestResult,
    check_compiles,
    normalize_output,
    outputs_match,
    run_tests,
)
from verl_mas.sandbox.local import LocalSandbox
from verl_mas.sandbox.result import KILLED_REASONS, PROTECTIONS, ExecResult, SandboxError

__all__ = [
    "COMPARE_MODES",
    "ISOLATION_MODES",
    "KILLED_REASONS",
    "PROTECTIONS",
    "CompileResult",
    "ExecResult",
    "LocalSandbox",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxError",
    "SandboxFusionBackend",
    "TestCase",
    "TestReport",
    "TestResult",
    "check_compiles",
    "configure",
    "get_sandbox",
    "normalize_output",
    "outputs_match",
    "register_backend",
    "registered_backends",
    "run_python",
    "run_tests",
]
