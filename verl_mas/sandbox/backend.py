"""Backend contract (`SandboxBackend`), the backend registry, and the process-wide default sandbox."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any, Protocol, runtime_checkable

from verl_mas.sandbox.config import SandboxConfig
from verl_mas.sandbox.result import ExecResult

__all__ = ["MAIN_FILE", "SandboxBackend", "check_run_args", "configure", "get_sandbox", "register_backend",
           "registered_backends", "run_python"]

logger = logging.getLogger(__name__)

MAIN_FILE = "main.py"
"""Name the program gets in its working directory (tracebacks show it)."""


@runtime_checkable
class SandboxBackend(Protocol):
    """What every backend provides; workflows only ever call `run_python` (directly or via `run_tests`)."""

    config: SandboxConfig

    async def run_python(self, code: str, stdin: str | bytes = "", *, timeout_s: float | None = None,
                         memory_mb: int | None = None,
                         files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        """Run ``code`` with ``stdin``; the program's failures are results, infrastructure failures raise
        `SandboxError`."""
        ...

    async def aclose(self) -> None:
        """Release processes and connections."""
        ...


def check_run_args(code: str, stdin: str | bytes, timeout_s: float, memory_mb: int,
                files: Mapping[str, str | bytes] | None) -> tuple[bytes, bytes, dict[str, bytes]]:
    """Validate `SandboxBackend.run_python` arguments (all problems at once); returns them as bytes.

    Returns:
        ``(code, stdin, files)`` with every text UTF-8 encoded and file paths normalised.

    Raises:
        ValueError: Every bad argument, each with what was passed and what is expected.
    """
    problems = []
    if not isinstance(code, str):
        problems.append(f"code is a {type(code).__name__}; pass the program source as str.")
    if not isinstance(stdin, (str, bytes)):
        problems.append(f"stdin is a {type(stdin).__name__}; pass str or bytes.")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        problems.append(f"timeout_s is {timeout_s!r}; it must be a positive number of seconds.")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 64:
        problems.append(f"memory_mb is {memory_mb!r}; it must be an int >= 64 (the interpreter needs ~30 MB).")
    out_files: dict[str, bytes] = {}
    for name, content in (files or {}).items():
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts or name.strip("/") == MAIN_FILE:
            problems.append(f"files key {name!r} must be a relative path without '..' and not {MAIN_FILE!r} "
                            "(the program itself).")
        elif not isinstance(content, (str, bytes)):
            problems.append(f"files[{name!r}] is a {type(content).__name__}; pass str or bytes.")
        else:
            out_files[str(PurePosixPath(*parts))] = content.encode() if isinstance(content, str) else content
    if problems:
        raise ValueError("Invalid run_python arguments:\n- " + "\n- ".join(problems))
    return code.encode(), stdin.encode() if isinstance(stdin, str) else stdin, out_files


BackendFactory = Callable[[SandboxConfig], SandboxBackend]
_BACKENDS: dict[str, BackendFactory] = {}
_cache: dict[SandboxConfig, SandboxBackend] = {}
_default_config: SandboxConfig | None = None


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator registering a backend factory under ``name`` (the value of ``mas.sandbox.backend``).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def wrap(factory: BackendFactory) -> BackendFactory:
        if name in _BACKENDS and _BACKENDS[name] is not factory:
            raise ValueError(f"Sandbox backend {name!r} is already registered ({_BACKENDS[name]!r}). "
                             "Backend names are global; pick another name.")
        _BACKENDS[name] = factory
        return factory

    return wrap


def registered_backends() -> tuple[str, ...]:
    """Names accepted by ``mas.sandbox.backend``."""
    _register_builtins()
    return tuple(sorted(_BACKENDS))


def _register_builtins() -> None:
    if "local" not in _BACKENDS:
        from verl_mas.sandbox.fusion import SandboxFusionBackend
        from verl_mas.sandbox.local import LocalSandbox

        register_backend("local")(LocalSandbox)
        register_backend("sandbox_fusion")(SandboxFusionBackend)


def _as_config(config: SandboxConfig | Mapping[str, Any] | None) -> SandboxConfig:
    if config is None:
        return _default_config or SandboxConfig()
    if isinstance(config, SandboxConfig):
        return config
    return SandboxConfig.from_dict(config)


def configure(config: SandboxConfig | Mapping[str, Any] | None) -> SandboxConfig:
    """Set the config `get_sandbox()` / `run_python()` use by default (the ``mas.sandbox`` block).

    Args:
        config: A `SandboxConfig`, a plain mapping, or ``None`` to go back to the defaults.

    Returns:
        The validated config now in force.
    """
    global _default_config
    _default_config = None if config is None else _as_config(config)
    return _default_config or SandboxConfig()


def get_sandbox(config: SandboxConfig | Mapping[str, Any] | None = None) -> SandboxBackend:
    """The shared backend for ``config`` (default: the one set by `configure`); one per distinct config.

    Raises:
        ValueError: Invalid config, or an unknown backend name.
    """
    cfg = _as_config(config)
    backend = _cache.get(cfg)
    if backend is None:
        _register_builtins()
        factory = _BACKENDS.get(cfg.backend)
        if factory is None:
            raise ValueError(f"mas.sandbox.backend is {cfg.backend!r}, which is not registered. Registered: "
                             f"{sorted(_BACKENDS)}; fix the name or register it with @register_backend.")
        backend = _cache[cfg] = factory(cfg)
    return backend


async def run_python(code: str, stdin: str | bytes = "", *, timeout_s: float | None = None,
                     memory_mb: int | None = None, files: Mapping[str, str | bytes] | None = None,
                     config: SandboxConfig | Mapping[str, Any] | None = None) -> ExecResult:
    """Run ``code`` in the shared sandbox; the one call the games, math and code workflows need.

    Args:
        code: Program source (run as ``main.py`` with ``python -I``).
        stdin: Standard input; reading past it gives EOF.
        timeout_s: Time budget, the program's own time (default ``mas.sandbox.timeout_s``).
        memory_mb: Address-space limit (default ``mas.sandbox.memory_mb``).
        files: Extra files next to the program, by relative path.
        config: Use this config's sandbox instead of the default one.

    Returns:
        The `ExecResult`; see `SandboxBackend.run_python` for the error contract.
    """
    return await get_sandbox(config).run_python(code, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                                                files=files)


@atexit.register
def _close_all() -> None:
    for backend in list(_cache.values()):
        close = getattr(backend, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - interpreter exit: log and keep closing the others
                logger.exception("Closing sandbox backend %r at exit failed", backend)
    _cache.clear()
