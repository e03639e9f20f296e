"""Killable checks of model output: a pool of warm worker processes that runs each check under a hard deadline.

Checking a model's answer can take unbounded time on a hostile or unlucky input: math-verify/sympy
evaluating ``9^{9^{9^{9}}}`` never leaves the big-integer C call it starts, and that call holds the GIL.
In a thread, no ``asyncio.wait_for`` can stop it and the event loop that serves every concurrent episode
freezes. So a check that can be slow runs here instead, in a separate process killed at its deadline::

    from verl_mas.verify import CheckTimeout, run_check

    try:
        ok = await run_check(answers_match, pred, gold, timeout_s=10.0)
    except CheckTimeout:
        ok = False  # a reward decision: count it in a metric

Outcomes of :meth:`CheckPool.run`:

- the check returned: its value;
- it ran past ``timeout_s`` (counted from when a worker started it, not from when it was queued):
  :class:`CheckTimeout`; the worker is killed and a fresh one takes its place. A model output that
  is too expensive to check is a *reward decision* for the caller (typically "no match", counted);
- it raised: the same exception, re-raised here (a bug in the check function propagates, as a bug);
- its worker died (killed by the OOM killer or a signal, crashed in C): :class:`verl_mas.errors.InfraError`.
  A dead worker says nothing about the model's output, so it is never turned into a reward: raised
  inside a workflow it aborts the episode, whose unrewarded candidates are not trained on (as a
  :class:`~verl_mas.sandbox.SandboxError` does).

The pool (`pebble <https://pypi.org/project/Pebble/>`_'s ``ProcessPool``) is started on first use, once
per process (every Ray worker gets its own), and shut down at interpreter exit. Its workers are started
with ``forkserver`` (``spawn`` where that is missing), never forked from the caller: callers are
threaded Ray workers holding model state. Workers are reused across checks (no interpreter start per
check); before its first task every worker imports the modules of the functions the pool has run (and
calls their :data:`WARM_UP_HOOK`), so a replacement after a timeout is warm too. On Linux a worker is
killed when its parent, the forkserver, exits (``PR_SET_PDEATHSIG``), which it does when this process
dies: a stuck check never outlives a killed trainer.

Unlike a plain ``forkserver``/``spawn`` pool, the workers never import the caller's main module again, so
checks work from any entry point: a script without the ``if __name__ == "__main__":`` guard, ``python -``
fed on stdin, a notebook, a Ray worker. Hence functions must be picklable by reference from an importable
module (not ``__main__``: :meth:`CheckPool.run` refuses those at once), and their arguments and results
picklable without ``__main__`` too. ``VERL_MAS_CHECK_WORKERS`` sets the default pool's size.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import ctypes.util
import functools
import importlib
import logging
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.spawn
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from pebble import ProcessExpired, ProcessPool
from pebble.common.types import RemoteTraceback

from verl_mas.errors import InfraError

logger = logging.getLogger(__name__)

__all__ = ["WARM_UP_HOOK", "WORKERS_ENV", "CheckPool", "CheckTimeout", "check_pool", "default_workers", "run_check"]

T = TypeVar("T")

#: Environment variable with the size of the default pool (worker processes per Ray worker process).
WORKERS_ENV = "VERL_MAS_CHECK_WORKERS"

#: A module whose functions the pool runs may define ``def _warm_up_check_worker() -> None``: every worker
#: calls it after importing the module, before its first task, so that lazy imports and first-call setup
#: (math-verify builds its LaTeX parser on first use) never count against a check's deadline.
WARM_UP_HOOK = "_warm_up_check_worker"

#: Upper bound of the default pool size: checks are short, a pool only needs to absorb a few slow ones.
_MAX_DEFAULT_WORKERS = 4

_PR_SET_PDEATHSIG = 1


class CheckTimeout(Exception):
    """A check ran past its deadline; its worker process was killed and replaced.

    Attributes:
        function: The qualified name of the check function.
        timeout_s: The deadline it ran past.
    """

    def __init__(self, function: str, timeout_s: float) -> None:
        super().__init__(f"{function} ran past its {timeout_s} s deadline; its worker process was killed")
        self.function = function
        self.timeout_s = timeout_s


def default_workers() -> int:
    """The default pool size: ``$VERL_MAS_CHECK_WORKERS``, else ``min(4, usable CPUs)``.

    Raises:
        ValueError: When the variable is set to something other than an int >= 1.
    """
    raw = os.environ.get(WORKERS_ENV)
    if raw is None or not raw.strip():
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        return max(1, min(_MAX_DEFAULT_WORKERS, cpus))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{WORKERS_ENV} is {raw!r}; it must be an int >= 1 (the number of answer-checking worker processes "
            f"per process). Set it to e.g. 2, or unset it for the default min({_MAX_DEFAULT_WORKERS}, CPUs)."
        )
    return value


def _start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# ---------------------------------------------------------------------------------------------------
# Workers that do not import the caller's __main__.
#
# A forkserver/spawn child re-creates the parent's main module before it unpickles its process object:
# Popen._launch sends it the preparation data of multiprocessing.spawn.get_preparation_data, whose
# "init_main_from_path" (a script) or "init_main_from_name" (``python -m``) the child runs as __mp_main__.
# A script without the __main__ guard then runs its episodes again inside the worker, which dies
# starting processes while bootstrapping; ``python -`` sends the path "<stdin>", which does not exist. Either
# way every check fails with "All workers expired". set_forkserver_preload cannot help: the forkserver
# never imports __main__ itself (it filters the key out), each child does. So the workers of the pool get
# preparation data without those two keys: a Process subclass marks (thread-locally) the start of one of our
# workers, and a wrapper of get_preparation_data drops the keys only while that mark is set, so other users
# of multiprocessing in this process are unaffected. The wrapper depends only on Popen looking the function
# up as ``spawn.get_preparation_data`` at each start and on those two key names (so in CPython 3.10 to 3.13);
# overriding Popen._launch instead would copy private code of each Python version. If a later Python changes
# them, the child interpreters of tests/test_verify.py and tests/test_math_workflow.py abort again.

_starting_worker = threading.local()
_patch_lock = threading.Lock()
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


def _without_main(get_preparation_data: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    @functools.wraps(get_preparation_data)
    def wrapper(name: str) -> dict[str, Any]:
        data = get_preparation_data(name)
        if getattr(_starting_worker, "active", False):
            for key in _MAIN_KEYS:
                data.pop(key, None)
        return data

    wrapper._verl_mas_without_main = True  # type: ignore[attr-defined]
    return wrapper


def _install_without_main() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` once (idempotent, thread-safe)."""
    with _patch_lock:
        current = multiprocessing.spawn.get_preparation_data
        if not getattr(current, "_verl_mas_without_main", False):
            multiprocessing.spawn.get_preparation_data = _without_main(current)


def _start_without_main(popen: Callable[[Any], Any], process_obj: Any) -> Any:
    previous = getattr(_starting_worker, "active", False)
    _starting_worker.active = True
    try:
        return popen(process_obj)
    finally:
        _starting_worker.active = previous


class _SpawnWorker(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _start_without_main(multiprocessing.context.SpawnProcess._Popen, process_obj)


class _SpawnContext(multiprocessing.context.SpawnContext):
    Process = _SpawnWorker


if sys.platform != "win32":  # multiprocessing has no forkserver on Windows

    class _ForkServerWorker(multiprocessing.context.ForkServerProcess):
        @staticmethod
        def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
            return _start_without_main(multiprocessing.context.ForkServerProcess._Popen, process_obj)

    class _ForkServerContext(multiprocessing.context.ForkServerContext):
        Process = _ForkServerWorker


def _context(start_method: str) -> multiprocessing.context.BaseContext:
    """A multiprocessing context for ``start_method`` whose processes do not import the caller's ``__main__``."""
    _install_without_main()
    return _ForkServerContext() if start_method == "forkserver" else _SpawnContext()


def _worker_init(modules: list[str]) -> None:
    """Runs in each worker before its first task: die with the parent, die at once on SIGTERM, warm up."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the worker still exits when its task pipe closes
            pass
    # pebble installs a Python SIGTERM handler, which cannot run while a check holds the GIL in a C call:
    # the pool would then wait 3 s before SIGKILL on every timeout. The default action kills at once; it
    # is safe because pebble kills a worker only while holding the task-channel lock the worker could hold.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in modules:
        try:
            module = importlib.import_module(name)
            warm_up = getattr(module, WARM_UP_HOOK, None)
            if callable(warm_up):
                warm_up()
        except Exception:  # noqa: BLE001 - the task itself will import it and raise the real error
            logger.warning("check worker could not preload %s", name, exc_info=True)


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported in the calling process (tests ask a worker this)."""
    return name in sys.modules


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class CheckPool:
    """Worker processes that run blocking checks with a hard deadline, awaited without blocking the event loop.

    Args:
        workers: Worker processes (None: :func:`default_workers`).
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``; never ``"fork"``, which
            copies the caller's threads' locks and its (large) memory.

    Thread-safe; one pool serves any number of event loops. Started on the first :meth:`run`.
    """

    def __init__(self, workers: int | None = None, *, start_method: str | None = None) -> None:
        n = default_workers() if workers is None else workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"workers is {workers!r}; it must be an int >= 1 (worker processes), or None for the default"
            )
        method = start_method or _start_method()
        if method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method is {method!r}; use 'forkserver' or 'spawn'. 'fork' would copy the caller's "
                "threads' locks and memory into every worker."
            )
        self.workers = n
        self.start_method = method
        # The modules of the functions run so far. pebble pickles the initializer's arguments when it starts
        # a worker, so a worker started later (a replacement) preloads every module appended before.
        self._modules: list[str] = []
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self._pid = os.getpid()
        self._closed = False
        atexit.register(self.shutdown)

    def _ready(self) -> ProcessPool | None:
        """The running pool, or None when it must be (re)started first (never blocks)."""
        pool = self._pool
        if self._closed or pool is None or self._pid != os.getpid() or not pool.active:
            return None
        return pool

    def _get(self) -> ProcessPool:
        """The running pool, started (or restarted) if needed. Blocks while the workers start: call it in a thread."""
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    "this CheckPool was shut down; create a new one (or use verl_mas.verify.check_pool())"
                )
            if self._pool is not None and (self._pid != os.getpid() or not self._pool.active):
                # Forked into a child (the pool's threads did not come along), or the pool broke: start over.
                if self._pid == os.getpid():
                    self._stop(self._pool)
                self._pool = None
            if self._pool is None:
                pool = ProcessPool(
                    max_workers=self.workers,
                    initializer=_worker_init,
                    initargs=(self._modules,),
                    context=_context(self.start_method),
                )
                pool.active  # noqa: B018 - reading it starts the pool (forkserver, workers): slow the first time
                self._pool, self._pid = pool, os.getpid()
            return self._pool

    async def run(self, fn: Callable[..., T], /, *args: Any, timeout_s: float) -> T:
        """``fn(*args)`` in a worker process, killed after ``timeout_s`` seconds of running.

        Awaiting never blocks the event loop. Cancelling the awaiting task kills the worker running it.

        Raises:
            ValueError: ``fn`` is defined in ``__main__`` (workers do not import it), or ``timeout_s`` is not > 0.
            CheckTimeout: ``fn`` ran longer than ``timeout_s``.
            InfraError: The worker process died (or the pool broke) before ``fn`` returned.
            Exception: Whatever ``fn`` raised, as is.
        """
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise ValueError(f"timeout_s is {timeout_s!r}; it must be a finite number of seconds > 0")
        module = getattr(fn, "__module__", None)
        name = _qualname(fn)
        if module in ("__main__", "__mp_main__"):
            raise ValueError(
                f"{name} is defined in the main module (the script, stdin or notebook being run), which the "
                "check workers do not import (so that scripts without an `if __name__ == '__main__':` guard work), "
                "so a worker could not find it. Move it into an importable module (a .py file on sys.path) and "
                "import it from there."
            )
        with self._lock:
            if isinstance(module, str) and module not in self._modules:
                self._modules.append(module)
        # Starting the pool waits for the forkserver and the workers (up to seconds in a Ray worker, whose
        # forkserver imports ray): done in a thread so that the event loop keeps running meanwhile.
        pool = self._ready() or await asyncio.to_thread(self._get)
        try:
            future = pool.schedule(fn, args=args, timeout=timeout_s)
        except RuntimeError as e:  # pebble: "The Pool is not active" / "Unexpected error within the Pool"
            raise InfraError(f"the answer-checking pool could not take {name}: {e}. Retry the episode.") from e
        try:
            return await asyncio.wrap_future(future)
        except Exception:
            if not future.done() or future.cancelled():
                raise
            # Classify the original exception: asyncio replaces a TimeoutError by a fresh one without its cause.
            error = future.exception()
            if error is None:
                raise
        if isinstance(error, concurrent.futures.TimeoutError) and not isinstance(error.__cause__, RemoteTraceback):
            raise CheckTimeout(name, float(timeout_s)) from None  # pebble's deadline (fn's own would have a cause)
        if isinstance(error, ProcessExpired):
            raise InfraError(
                f"the worker process (pid {error.pid}) running {name} died with exit code {error.exitcode} before "
                "it returned (killed by a signal or the OOM killer, or a crash in C code). That is an infrastructure "
                "failure, not a verdict on the model's output, so the episode is aborted rather than rewarded. If it "
                "recurs, check the memory limit of the rollout workers."
            ) from error
        if isinstance(error, BrokenProcessPool):
            raise InfraError(
                f"the answer-checking pool broke while running {name} ({error}). Retry the episode."
            ) from error
        raise error  # fn's own exception (its remote traceback is chained as the cause)

    @staticmethod
    def _stop(pool: ProcessPool) -> None:
        pool.stop()
        pool.join()

    def shutdown(self) -> None:
        """Kill the workers and stop the pool's threads (idempotent; also runs at interpreter exit)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        atexit.unregister(self.shutdown)
        if pool is not None and self._pid == os.getpid():
            self._stop(pool)


_default: CheckPool | None = None
_default_lock = threading.Lock()


def check_pool() -> CheckPool:
    """The process-wide pool (:func:`default_workers` workers), created on first use."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = CheckPool()
        return _default


async def run_check(fn: Callable[..., T], /, *args: Any, timeout_s: float) -> T:
    """``await check_pool().run(fn, *args, timeout_s=timeout_s)``: see :meth:`CheckPool.run`."""
    return await check_pool().run(fn, *args, timeout_s=timeout_s)
