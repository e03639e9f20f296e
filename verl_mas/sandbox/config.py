"""Sandbox configuration: the validated `mas.sandbox` block (limits, pool size, backend, isolation)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ISOLATION_MODES", "SandboxConfig"]

ISOLATION_MODES = ("auto", "none")
"""``auto``: every protection (namespaces, unprivileged uid), and the sandbox refuses to run when the machine
allows less (unless ``require_isolation: false``); ``none``: resource limits, scrubbed environment and
process-group kill only (an explicit opt-out for debugging; logged loudly)."""

# The per-process uid block is `uid_base + (pid % _PID_SPAN) * MAX_POOL_SIZE + slot`; these bounds keep it
# below 2**31 so no tool that treats uids as signed ints misbehaves.
MAX_POOL_SIZE = 256
_PID_SPAN = 4_194_304  # PID_MAX_LIMIT on 64-bit Linux
_DEFAULT_UID_BASE = 1_000_000_000
_MAX_UID = 2**31 - 2


def _default_pool_size() -> int:
    """CPUs this process may run on (affinity-aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and wiring of the code-execution sandbox; built from the ``mas.sandbox`` config block.

    Every problem is reported at once, each as what + why + fix (``ValueError``).
    """

    backend: str = "local"
    """Which backend runs code: ``local`` (this machine, namespaces) or ``sandbox_fusion`` (remote HTTP)."""
    pool_size: int = field(default_factory=_default_pool_size)
    """Runs executing at once per process; further submissions wait (back-pressure). Default: CPU count."""
    timeout_s: float = 10.0
    """Time budget of one run, in seconds of the program's own time: ``max(wall - run-queue wait of the main
    process, CPU of all its processes)`` from the program's start, so machine load and namespace setup are not
    charged (docs/sandbox.md, "Time limits"). Exceeding it kills the run: ``timed_out``, the model's fault."""
    backstop_factor: float = 3.0
    """Wall-clock backstop of a run: ``backstop_factor * timeout_s`` from the program's start. A run that reaches
    it with its budget unused was starved by the machine: `SandboxError` (an infrastructure failure, never a
    reward), unless the program lowered its own scheduling priority (then it is a timeout)."""
    cpu_s: int | None = None
    """CPU-seconds limit per process (RLIMIT_CPU), a kernel-enforced backstop under ``timeout_s``; ``None`` means
    ``ceil(timeout_s) + 1`` of each run."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS); allocations beyond it raise ``MemoryError``."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout and on stderr (each); a run that exceeds it is killed (``output_limit``)."""
    max_procs: int = 64
    """Processes + threads the run may hold at once (RLIMIT_NPROC on its dedicated uid)."""
    max_open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_file_mb: int = 16
    """Largest file a run may write (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Size of the run's private working directory (a tmpfs mounted at ``/tmp`` inside the sandbox)."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter that runs the model's code."""
    python_flags: tuple[str, ...] = ("-I",)
    """Interpreter flags; must isolate from the environment: ``-I``, or both ``-E`` and ``-s``."""
    isolation: str = "auto"
    """``auto`` or ``none`` (see ``ISOLATION_MODES``)."""
    require_isolation: bool | None = None
    """Refuse to run (``SandboxError``) when a protection is unavailable. ``None`` (default): required unless
    ``isolation`` is ``none``, i.e. fail closed; ``false``: run with what the machine allows and log a WARNING."""
    hidden_paths: tuple[str, ...] = ("/root", "/home", "/run")
    """Directories replaced by an empty read-only tmpfs inside the sandbox (the interpreter stays visible)."""
    uid_base: int | None = None
    """First uid of this process's block of unprivileged uids (one per pool slot); ``None``: derived from pid."""
    work_root: str | None = None
    """Where per-run staging directories are created and removed; ``None``: the system temp dir."""
    url: str | None = None
    """Endpoint of a remote service (``sandbox_fusion``: e.g. ``http://host:8080/run_code``)."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError(
                f"Invalid mas.sandbox config ({len(problems)} problem(s)):\n- " + "\n- ".join(problems))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SandboxConfig:
        """Build from a plain mapping (the ``mas.sandbox`` block); lists become tuples, unknown keys fail.

        Args:
            data: Mapping of field name to value; ``None`` or empty gives the defaults.

        Raises:
            ValueError: Unknown keys or invalid values, all listed at once.
        """
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"mas.sandbox has unknown key(s) {unknown}. Only these keys exist: {sorted(known)}; "
                "fix the spelling or remove them.")
        for key in ("python_flags", "hidden_paths"):
            if key in data and isinstance(data[key], (list, tuple)):
                data[key] = tuple(data[key])
        return cls(**data)

    def resolved_cpu_s(self, timeout_s: float | None = None) -> int:
        """RLIMIT_CPU applied to a run with budget ``timeout_s`` (default: the config's): ``cpu_s`` or
        ``ceil(timeout_s) + 1``."""
        if self.cpu_s is not None:
            return self.cpu_s
        return math.ceil(self.timeout_s if timeout_s is None else timeout_s) + 1

    def backstop_s(self, timeout_s: float | None = None) -> float:
        """Wall-clock backstop of a run with budget ``timeout_s`` (default: the config's)."""
        return self.backstop_factor * (self.timeout_s if timeout_s is None else timeout_s)

    def requires_isolation(self) -> bool:
        """Whether a missing protection stops the sandbox (``require_isolation``, resolved)."""
        if self.require_isolation is None:
            return self.isolation != "none"
        return self.require_isolation

    def resolved_uid_base(self) -> int:
        """First uid of this process's block: one uid per pool slot, distinct between live processes."""
        base = _DEFAULT_UID_BASE if self.uid_base is None else self.uid_base
        return base + (os.getpid() % _PID_SPAN) * MAX_POOL_SIZE

    # ------------------------------------------------------------------ validation
    def _problems(self) -> list[str]:
        p: list[str] = []

        def positive(name: str, value: Any, kind: type | tuple[type, ...] = int) -> None:
            is_number = isinstance(value, kind) and not isinstance(value, bool)
            if not is_number or value <= 0:
                p.append(f"mas.sandbox.{name} is {value!r}; it must be a positive number. Fix the value or "
                         "remove the key to get the default.")

        if not isinstance(self.backend, str) or not self.backend:
            p.append(f"mas.sandbox.backend is {self.backend!r}; it must name a backend such as 'local'.")
        positive("pool_size", self.pool_size)
        if isinstance(self.pool_size, int) and self.pool_size > MAX_POOL_SIZE:
            p.append(f"mas.sandbox.pool_size is {self.pool_size}, above {MAX_POOL_SIZE}: each slot owns one uid "
                     f"of a {MAX_POOL_SIZE}-uid block. Lower it (the default is the CPU count).")
        positive("timeout_s", self.timeout_s, (int, float))
        factor = self.backstop_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            p.append(f"mas.sandbox.backstop_factor is {factor!r}; it must be a number > 1 (the wall-clock "
                     "backstop is backstop_factor * timeout_s, and a program needs at least its budget). Use 3.")
        if self.cpu_s is not None:
            positive("cpu_s", self.cpu_s)
        for name in ("memory_mb", "max_output_bytes", "max_procs", "max_open_files", "max_file_mb", "disk_mb"):
            positive(name, getattr(self, name))
        if isinstance(self.memory_mb, int) and not isinstance(self.memory_mb, bool) and 0 < self.memory_mb < 64:
            p.append(f"mas.sandbox.memory_mb is {self.memory_mb}; the interpreter alone needs ~30 MB of address "
                     "space, so runs would fail at start. Use at least 64.")
        if isinstance(self.max_open_files, int) and 0 < self.max_open_files < 16:
            p.append(f"mas.sandbox.max_open_files is {self.max_open_files}; Python needs ~10 descriptors to "
                     "start. Use at least 16.")
        if self.isolation not in ISOLATION_MODES:
            p.append(f"mas.sandbox.isolation is {self.isolation!r}, not one of {ISOLATION_MODES}. Use 'auto'.")
        if self.require_isolation is not None and not isinstance(self.require_isolation, bool):
            p.append(f"mas.sandbox.require_isolation is {self.require_isolation!r}; it must be true, false or "
                     "unset (unset: required unless isolation is 'none').")
        elif self.isolation == "none" and self.require_isolation:
            p.append("mas.sandbox.isolation is 'none' while require_isolation is true; the two contradict. "
                     "Set isolation: auto, or require_isolation: false.")
        if not isinstance(self.python_flags, tuple) or not all(isinstance(f, str) for f in self.python_flags):
            p.append(f"mas.sandbox.python_flags is {self.python_flags!r}; it must be a list of strings.")
        elif "-I" not in self.python_flags and not {"-E", "-s"} <= set(self.python_flags):
            p.append(f"mas.sandbox.python_flags is {list(self.python_flags)}; without -I (or both -E and -s) "
                     "the interpreter reads PYTHON* variables and the user site. Add '-I'.")
        if self.backend == "local":
            if not isinstance(self.python, str) or not os.path.isabs(self.python):
                p.append(f"mas.sandbox.python is {self.python!r}; it must be an absolute path to an interpreter "
                         "(e.g. sys.executable).")
            elif not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
                p.append(f"mas.sandbox.python is {self.python!r}, which is not an executable file on this "
                         "machine. Point it at an existing interpreter.")
        if not isinstance(self.hidden_paths, tuple) or not all(
                isinstance(h, str) and os.path.isabs(h) and os.path.normpath(h) != "/" for h in self.hidden_paths):
            p.append(f"mas.sandbox.hidden_paths is {self.hidden_paths!r}; it must list absolute directories "
                     "other than '/'.")
        if self.uid_base is not None:
            valid_int = isinstance(self.uid_base, int) and not isinstance(self.uid_base, bool)
            if not valid_int or self.uid_base < 65536 or self.uid_base + _PID_SPAN * MAX_POOL_SIZE > _MAX_UID:
                p.append(f"mas.sandbox.uid_base is {self.uid_base!r}; it must be an int >= 65536 with "
                         f"uid_base + {_PID_SPAN * MAX_POOL_SIZE} <= {_MAX_UID} so sandbox uids never collide "
                         "with real users. Leave it unset.")
        if self.work_root is not None and not os.path.isdir(self.work_root):
            p.append(f"mas.sandbox.work_root is {self.work_root!r}, which is not a directory. Create it or unset it.")
        if self.backend == "sandbox_fusion" and not self.url:
            p.append("mas.sandbox.backend is 'sandbox_fusion' but mas.sandbox.url is unset; a remote backend "
                     "needs its endpoint. Set url: http://HOST:PORT/run_code.")
        return p
