"""What a sandboxed run returns (`ExecResult`) and the exception for infrastructure failures."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from verl_mas.errors import InfraError

__all__ = ["KILLED_REASONS", "PROTECTIONS", "ExecResult", "SandboxError", "infer_killed_reason"]

PROTECTIONS = ("network", "pid_namespace", "filesystem", "unprivileged_uid")
"""Keys of `ExecResult.isolation`:

- ``network``: own network namespace with no interface up (no loopback, no host, no internet).
- ``pid_namespace``: own PID namespace; every process of the run dies with it and host processes are invisible.
- ``filesystem``: own mount namespace: read-only root, a private size-limited tmpfs as working directory
  (``/tmp``), private ``/dev/shm``, fresh ``/proc``, ``hidden_paths`` masked.
- ``unprivileged_uid``: runs as a dedicated unprivileged uid (per pool slot) with no capabilities, so
  file permissions apply and ``max_procs`` (RLIMIT_NPROC) is enforced.

Resource limits (CPU, address space, file size, open files), the scrubbed environment, ``-I`` and the
time budget apply in every mode and are not listed.
"""

KILLED_REASONS = ("timeout", "output_limit", "cpu", "memory", "file_size")
"""Values of `ExecResult.killed_reason`, besides ``None`` (ran to completion) and ``signal:<n>``:

- ``timeout``: the program's own time exceeded ``timeout_s`` (see `ExecResult.program_s`); the sandbox killed
  the whole run (``timed_out`` is true). A run starved by machine load raises `SandboxError` instead.
- ``output_limit``: stdout or stderr exceeded ``max_output_bytes``; the sandbox killed the run.
- ``cpu``: the process exhausted its CPU-seconds limit (RLIMIT_CPU) and the kernel killed it.
- ``memory``: an allocation hit the address-space limit (the program died of ``MemoryError``).
- ``file_size``: a write exceeded ``max_file_mb`` (SIGXFSZ).
- ``signal:<n>``: died of signal n for another reason (e.g. ``signal:11`` for a C-stack overflow).
"""


class SandboxError(InfraError):
    """The sandbox itself failed (could not start, lost a run); never raised for the model's own mistakes.

    Syntax errors, exceptions, wrong output and timeouts of the model's code are `ExecResult` values; a run
    that machine load kept from using its time budget (the wall-clock backstop) raises this.
    An infrastructure failure: raised inside a workflow it aborts the episode, whose unrewarded
    candidates are never trained on (the groups completed before it stay trainable).
    """


@dataclass(frozen=True, eq=False)
class ExecResult:
    """Outcome of one sandboxed run."""

    stdout: str
    """Captured standard output (UTF-8, undecodable bytes replaced), at most ``max_output_bytes``."""
    stderr: str
    """Captured standard error (tracebacks land here), at most ``max_output_bytes``."""
    exit_code: int | None
    """Exit status; negative ``-n`` when killed by signal n (as ``subprocess``); ``None`` if unknown (remote)."""
    timed_out: bool
    """True when the program used up its time budget (``timeout_s``) and was killed: the model's fault."""
    killed_reason: str | None
    """Why the run was cut short (see ``KILLED_REASONS``), ``None`` when it ended on its own."""
    wall_s: float
    """Seconds from submission to the end of the run (namespace setup and interpreter start included)."""
    cpu_s: float | None = None
    """User + system CPU seconds of the program (and the children it waited for); ``None`` when unknown
    (the run was killed before it could be measured, or the backend does not say)."""
    program_s: float | None = None
    """Time charged against ``timeout_s``: ``max(wall - run-queue wait of the main process, CPU of all the
    run's processes)`` from the program's start; ``None`` when unknown (killed by the host, or remote)."""
    stdout_truncated: bool = False
    """True when stdout hit ``max_output_bytes`` (the rest was discarded)."""
    stderr_truncated: bool = False
    """True when stderr hit ``max_output_bytes``."""
    isolation: Mapping[str, bool] = field(default_factory=lambda: MappingProxyType({}))
    """Which protections applied to this run (keys: ``PROTECTIONS``)."""

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited with status 0."""
        return self.exit_code == 0 and self.killed_reason is None

    @property
    def missing_isolation(self) -> tuple[str, ...]:
        """Protections that did not apply to this run (empty when fully isolated)."""
        return tuple(name for name in PROTECTIONS if not self.isolation.get(name, False))


def infer_killed_reason(exit_code: int, cpu_s: float | None, cpu_limit: int, stderr: str) -> str | None:
    """Name the limit that ended a run the sandbox did not kill itself (see ``KILLED_REASONS``).

    Args:
        exit_code: Exit status, ``-n`` for death by signal n.
        cpu_s: CPU seconds used, ``None`` if unknown.
        cpu_limit: The RLIMIT_CPU soft limit in seconds.
        stderr: Captured standard error (``MemoryError`` is recognised on its last line).
    """
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_s >= cpu_limit - 0.05):
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "file_size"
        return f"signal:{sig}"
    if exit_code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        if lines and lines[-1].startswith("MemoryError"):
            return "memory"
    return None
