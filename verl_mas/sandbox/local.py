"""Local backend: runs model-written Python on this machine through the namespace fork server.

Why one module of ~570 lines: :class:`LocalSandbox` is the host side of one protocol with the fork server
(``_zygote.py``): starting it, the control channel, staging a run, reading its output, kills, time limits
and tear-down share one event-loop-bound state (the open runs, the channel, the slots). Split apart, each
piece would need the others' internals.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import IO

from verl_mas.sandbox.backend import MAIN_FILE, check_run_args
from verl_mas.sandbox.config import MAX_POOL_SIZE, SandboxConfig
from verl_mas.sandbox.result import PROTECTIONS, ExecResult, SandboxError, infer_killed_reason

__all__ = ["LocalSandbox"]

logger = logging.getLogger(__name__)

_ZYGOTE = Path(__file__).with_name("_zygote.py")
_MAIN = MAIN_FILE
_START_TIMEOUT_S = 120.0  # zygote start: one interpreter probe per protection set tried
_KILL_GRACE_S = 10.0  # after a kill request, how long the namespace may take to die before we call it lost
# Host-side limit of a run: its wall-clock backstop (kept inside the run, from the program's start) plus this
# much for staging and namespace setup. Reached only when the run's init itself cannot keep up (or is stuck).
_SETUP_GRACE_S = 30.0
_EOF_GRACE_S = 2.0  # after the exit report, how long to wait for the pipes to drain
_INLINE_STAGING_BYTES = 1 << 20  # larger inputs are written from a worker thread
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # One thread per numeric library: RLIMIT_NPROC counts threads, and the pool already fills the CPUs.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_warned: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()  # "loudly once" per process
_used_slots: set[int] = set()  # slots of this process's uid block held by live LocalSandbox instances


def _reserve_slots(count: int) -> int:
    """First slot of ``count`` consecutive free slots of this process's uid block."""
    for first in range(MAX_POOL_SIZE - count + 1):
        if _used_slots.isdisjoint(range(first, first + count)):
            _used_slots.update(range(first, first + count))
            return first
    raise SandboxError(
        f"No {count} free sandbox uids left: live LocalSandbox instances in this process already hold "
        f"{len(_used_slots)} of {MAX_POOL_SIZE}. Share one sandbox (get_sandbox) or close unused ones.")


def _release_slots(first: int, count: int) -> None:
    _used_slots.difference_update(range(first, first + count))


@dataclass(eq=False)
class _Run:
    """Host-side state of one in-flight run."""

    id: int
    slot: int
    cap: int
    done: asyncio.Future[dict]
    eof: asyncio.Future[None]
    fds: dict[str, int] = field(default_factory=dict)  # "stdout"/"stderr" -> read end still registered
    out: dict[str, bytearray] = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
    truncated: dict[str, bool] = field(default_factory=lambda: {"stdout": False, "stderr": False})
    reason: str | None = None
    kill_sent: bool = False
    submitted: bool = False
    staging: str | None = None


class LocalSandbox:
    """Runs Python programs in isolated, resource-limited processes on this machine.

    One small fork-server process (the zygote) is started lazily and builds a fresh set of namespaces per
    run; see ``docs/sandbox.md``. At most ``config.pool_size`` runs execute at once; further calls wait
    (back-pressure) without blocking the event loop. Safe to share between many episodes of one event
    loop; it rebinds when used from a new loop (e.g. one ``asyncio.run`` after another) while idle.

    Args:
        config: Limits and isolation settings; defaults to ``SandboxConfig()``.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        # Each instance owns distinct slots of this process's uid block: RLIMIT_NPROC counts per uid, so two
        # sandboxes sharing a uid would share their runs' process budgets.
        first = _reserve_slots(self.config.pool_size)
        weakref.finalize(self, _release_slots, first, self.config.pool_size)
        self.uid_base = self.config.resolved_uid_base() + first
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._errlog: IO[bytes] | None = None
        self._hello: dict | None = None
        self._hello_fut: asyncio.Future[dict] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self._start_lock: asyncio.Lock | None = None
        self._free_slots: list[int] = []
        self._runs: dict[int, _Run] = {}
        self._ids = itertools.count()
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ public
    @property
    def protections(self) -> Mapping[str, bool]:
        """Protections in force (keys: ``PROTECTIONS``); empty before the first run or `start`."""
        return MappingProxyType(dict(self._hello["protections"])) if self._hello else MappingProxyType({})

    @property
    def uids(self) -> range:
        """The unprivileged uids this sandbox runs programs as (one per pool slot, unique in this process)."""
        return range(self.uid_base, self.uid_base + self.config.pool_size)

    @property
    def zygote_pid(self) -> int | None:
        """Pid of the fork server, ``None`` when not started."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    async def start(self) -> None:
        """Start the fork server now (otherwise the first run does) and report missing protections.

        Raises:
            SandboxError: The fork server could not start, or a protection is missing and
                ``require_isolation`` is not false (the default refuses: fail closed).
        """
        self._bind_loop()
        if self._alive():
            return
        assert self._start_lock is not None
        async with self._start_lock:
            if not self._alive():
                await self._start_zygote()

    async def run_python(self, code: str, stdin: str | bytes = "", *, timeout_s: float | None = None,
                         memory_mb: int | None = None,
                         files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        """Run ``code`` as ``main.py`` with ``python -I`` in a fresh sandbox.

        Args:
            code: Program source.
            stdin: Data on standard input (``str`` is UTF-8 encoded); reading past it gives EOF.
            timeout_s: Time budget (the program's own time, see ``SandboxConfig.timeout_s``); defaults to
                ``config.timeout_s``. The wall-clock backstop is ``config.backstop_factor`` times it.
            memory_mb: Address-space limit; defaults to ``config.memory_mb``.
            files: Extra files placed next to ``main.py`` (relative paths; ``str`` is UTF-8 encoded).

        Returns:
            The run's `ExecResult`; the program's own failures (syntax errors, exceptions, timeouts,
            limits) are results, never exceptions.

        Raises:
            ValueError: Bad arguments (e.g. an absolute path in ``files``).
            SandboxError: The sandbox itself failed (fork server gone, run setup failed), or machine load
                starved the run (wall-clock backstop reached with its budget unused).
        """
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        memory = self.config.memory_mb if memory_mb is None else memory_mb
        payload = check_run_args(code, stdin, timeout, memory, files)
        await self.start()
        assert self._sem is not None
        await self._sem.acquire()
        run = _Run(next(self._ids), self._free_slots.pop(), self.config.max_output_bytes,
                   self._bound_loop().create_future(), self._bound_loop().create_future())
        self._runs[run.id] = run
        deferred = False
        try:
            t0 = time.monotonic()
            await self._submit(run, payload, memory, timeout)
            limit = self.config.backstop_s(timeout) + _SETUP_GRACE_S
            try:
                msg = await asyncio.wait_for(asyncio.shield(run.done), limit)
            except TimeoutError:
                self._kill(run)
                await self._await_exit(run)
                raise SandboxError(
                    f"Sandbox run {run.id} did not end within {limit:.0f}s of wall clock (its backstop "
                    f"{self.config.backstop_s(timeout):g}s + {_SETUP_GRACE_S:g}s for setup), so the run's own "
                    "supervisor could not keep up: the machine is overloaded or the sandbox is stuck, which says "
                    "nothing about the program. Reduce the machine's load (mas.sandbox.pool_size) and check the "
                    "fork server's log.") from None
            wall = time.monotonic() - t0
            try:
                await asyncio.wait_for(asyncio.shield(run.eof), _EOF_GRACE_S)
            except TimeoutError:
                logger.warning("Sandbox run %d: output pipes still open %.1fs after exit; closing them.",
                               run.id, _EOF_GRACE_S)
            return self._result(run, msg, wall, timeout)
        except asyncio.CancelledError:
            if run.submitted and not run.done.done():  # keep the slot (its uid) until the run is dead
                self._kill(run)
                deferred = True
                task = asyncio.ensure_future(self._finish_later(run))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise
        finally:
            if not deferred:
                self._finish(run)

    async def aclose(self) -> None:
        """Stop the fork server (it kills any run still going) and wait for it to exit."""
        self._close_channel(SandboxError("sandbox closed"))
        await asyncio.to_thread(self._reap_zygote)

    def close(self) -> None:
        """Synchronous `aclose` (for atexit, fixtures, and code outside the event loop)."""
        self._teardown("sandbox closed")

    # ------------------------------------------------------------------ zygote lifecycle
    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise SandboxError("LocalSandbox used before start(); this is a bug in verl_mas.sandbox.")
        return self._loop

    def _alive(self) -> bool:
        return self._proc is not None and self._sock is not None and self._hello is not None \
            and self._proc.poll() is None

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._runs:
            raise SandboxError(
                f"LocalSandbox is in use by another event loop with {len(self._runs)} run(s) in flight. "
                "A sandbox serves one loop at a time; create one LocalSandbox per loop/thread.")
        if self._loop is not None and not self._loop.is_closed() and self._sock is not None:
            self._bound_loop().remove_reader(self._sock.fileno())
        self._loop = loop
        self._sem = asyncio.Semaphore(self.config.pool_size)
        self._start_lock = asyncio.Lock()
        self._free_slots = list(range(self.config.pool_size))
        if self._sock is not None:
            loop.add_reader(self._sock.fileno(), self._on_ctrl)

    async def _start_zygote(self) -> None:
        if self._proc is not None:
            logger.warning("Sandbox fork server (pid %s) is gone; starting a new one.", self._proc.pid)
            self._teardown("restarting")
        cfg = self.config
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zcfg = {"ctrl_fd": child.fileno(), "host_pid": os.getpid(), "python": cfg.python,
                "python_flags": list(cfg.python_flags), "uid_base": self.uid_base,
                "hidden_paths": list(cfg.hidden_paths), "isolation": cfg.isolation}
        errlog = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the fork server; closed in _reap_zygote
        try:
            # Popen (vfork) rather than an asyncio subprocess: the zygote must outlive any one event loop.
            self._proc = subprocess.Popen(
                # -B: -I ignores PYTHONDONTWRITEBYTECODE, and the helper modules live in the installed package.
                [sys.executable, "-I", "-S", "-B", str(_ZYGOTE), json.dumps(zcfg)], pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errlog,
                env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
        except OSError as exc:
            parent.close()
            errlog.close()
            raise SandboxError(f"Could not start the sandbox fork server ({exc}). Check that {sys.executable} "
                               "can run and that /proc is mounted.") from exc
        finally:
            child.close()
        parent.setblocking(False)
        self._sock, self._errlog = parent, errlog
        self._hello_fut = self._bound_loop().create_future()
        self._bound_loop().add_reader(parent.fileno(), self._on_ctrl)
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello_fut), _START_TIMEOUT_S)
        except (TimeoutError, SandboxError) as exc:
            detail = self._zygote_stderr()
            self._teardown("start failed")
            raise SandboxError(f"The sandbox fork server did not start ({exc}). Its stderr:\n{detail}") from exc
        self._hello = hello
        missing = tuple(k for k in PROTECTIONS if not hello["protections"].get(k))
        if not missing:
            logger.info("Sandbox fork server pid %d ready, full isolation, uids %d..%d.", hello["pid"],
                        self.uids.start, self.uids.stop - 1)
            return
        what = (f"Sandbox protections UNAVAILABLE on this machine: {', '.join(missing)}. Why: "
                f"{' | '.join(p.rstrip('.') for p in hello['problems']) or 'unknown'}.")
        if cfg.requires_isolation():
            self._teardown("isolation required")
            raise SandboxError(
                f"{what} The sandbox refuses to run model-written code without them (it could write host files "
                "and read what this user can). Fix the cause above (run as root on Linux with user, mount, PID "
                "and network namespaces allowed; an interpreter every uid can reach; see docs/sandbox.md), or "
                "accept less isolation explicitly: mas.sandbox.require_isolation: false (use what this machine "
                "allows) or mas.sandbox.isolation: none (no namespaces; debugging only).")
        if (missing, tuple(hello["problems"])) not in _warned:
            _warned.add((missing, tuple(hello["problems"])))
            logger.warning("%s Model-written code runs with less isolation, as configured (require_isolation: "
                           "false or isolation: none). Remove that setting to refuse instead.", what)

    def _zygote_stderr(self) -> str:
        if self._errlog is None:
            return ""
        self._errlog.seek(0)
        return self._errlog.read()[-4000:].decode(errors="replace")

    def _teardown(self, why: str) -> None:
        """Close the socket (the zygote kills its runs and exits), reap it, fail whatever is pending."""
        self._close_channel(SandboxError(f"sandbox fork server stopped ({why})"))
        self._reap_zygote()

    def _reap_zygote(self) -> None:
        """Wait for the fork server to exit after its socket closed (blocking, at most ~5 s)."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("Sandbox fork server %d ignored its closed socket; killing it.", self._proc.pid)
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._errlog is not None:
            self._errlog.close()
            self._errlog = None

    def _close_channel(self, error: SandboxError) -> None:
        """Drop the control socket and fail every waiter with ``error``."""
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._bound_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self._hello = None
        if self._hello_fut is not None and not self._hello_fut.done():
            self._hello_fut.set_exception(error)
        for run in self._runs.values():
            if not run.done.done():
                run.done.set_exception(error)

    def _on_ctrl(self) -> None:
        """Reader callback on the control socket: dispatch ``hello`` and ``exit`` messages."""
        while self._sock is not None:
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as exc:
                logger.error("Sandbox control socket failed: %s", exc)
                data = b""
            if not data:  # the fork server is gone; the next run starts a new one
                detail = self._zygote_stderr()
                logger.error("Sandbox fork server exited unexpectedly. Its stderr:\n%s", detail)
                self._close_channel(SandboxError(f"sandbox fork server exited unexpectedly: {detail[-500:]}"))
                return
            msg = json.loads(data)
            if msg["op"] == "hello":
                if self._hello_fut is not None and not self._hello_fut.done():
                    self._hello_fut.set_result(msg)
                continue
            run = self._runs.get(msg["id"])
            if run is not None and not run.done.done():
                run.done.set_result(msg)

    # ------------------------------------------------------------------ one run
    async def _submit(self, run: _Run, payload: tuple[bytes, bytes, dict[str, bytes]], memory_mb: int,
                      timeout_s: float) -> None:
        code, stdin, files = payload
        cfg = self.config
        try:
            run.staging = tempfile.mkdtemp(prefix="verl_mas_sbx_", dir=cfg.work_root)
        except OSError as exc:
            raise SandboxError(f"Could not create a staging directory in {cfg.work_root or tempfile.gettempdir()} "
                               f"({exc}). Check free space and permissions, or set mas.sandbox.work_root.") from exc
        size = len(code) + len(stdin) + sum(len(c) for c in files.values())
        send_fds: list[int] = []
        try:
            try:
                if size > _INLINE_STAGING_BYTES:  # big inputs: write them without stalling the event loop
                    send_fds.append(await asyncio.to_thread(_stage, run.staging, code, stdin, files))
                else:
                    send_fds.append(_stage(run.staging, code, stdin, files))
            except OSError as exc:
                raise SandboxError(f"Could not stage the program in {run.staging} ({exc}). Check free space "
                                   "and permissions of mas.sandbox.work_root.") from exc
            for stream in ("stdout", "stderr"):
                r, w = os.pipe2(os.O_CLOEXEC)
                os.set_blocking(r, False)  # only our end: the program's writes must block, not fail
                run.fds[stream] = r
                send_fds.append(w)
            for stream, fd in run.fds.items():
                self._bound_loop().add_reader(fd, self._on_output, run, stream)
            limits = {"cpu_s": cfg.resolved_cpu_s(timeout_s), "as_bytes": memory_mb << 20,
                      "fsize_bytes": cfg.max_file_mb << 20, "nproc": cfg.max_procs, "nofile": cfg.max_open_files}
            msg = {"op": "run", "id": run.id, "slot": run.slot, "staging": run.staging, "env": _ENV,
                   "argv": [cfg.python, *cfg.python_flags, _MAIN], "limits": limits,
                   "disk_bytes": cfg.disk_mb << 20, "budget_s": timeout_s, "backstop_s": cfg.backstop_s(timeout_s)}
            await self._send(msg, send_fds)
            run.submitted = True
        finally:
            for fd in send_fds:
                os.close(fd)  # the zygote holds its own copies now

    async def _send(self, msg: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(msg).encode()
        while True:
            if self._sock is None:
                raise SandboxError("sandbox fork server is not running (it exited; see the error log above)")
            try:
                if fds:
                    socket.send_fds(self._sock, [data], fds)
                else:
                    self._sock.send(data)
                return
            except BlockingIOError:
                ready = self._bound_loop().create_future()
                self._bound_loop().add_writer(self._sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    if self._sock is not None:
                        self._bound_loop().remove_writer(self._sock.fileno())
            except OSError as exc:
                raise SandboxError(f"could not reach the sandbox fork server: {exc}") from exc

    def _kill(self, run: _Run) -> None:
        if run.kill_sent or run.done.done():
            return
        run.kill_sent = True
        task = asyncio.ensure_future(self._send({"op": "kill", "id": run.id}))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _await_exit(self, run: _Run) -> dict:
        try:
            return await asyncio.wait_for(asyncio.shield(run.done), _KILL_GRACE_S)
        except TimeoutError as exc:
            raise SandboxError(f"sandbox run {run.id} did not die within {_KILL_GRACE_S}s of being killed; "
                               "the fork server may be stuck (see its log).") from exc

    def _on_output(self, run: _Run, stream: str) -> None:
        fd = run.fds.get(stream)
        if fd is None:
            return
        buf = run.out[stream]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                self._stop_reading(run, stream)
                return
            room = run.cap - len(buf)
            if len(chunk) > room:
                buf += chunk[:room]
                run.truncated[stream] = True
                run.reason = run.reason or "output_limit"
                self._stop_reading(run, stream)
                self._kill(run)
                return
            buf += chunk

    def _stop_reading(self, run: _Run, stream: str) -> None:
        fd = run.fds.pop(stream, None)
        if fd is None:
            return
        self._bound_loop().remove_reader(fd)
        os.close(fd)
        if not run.fds and not run.eof.done():
            run.eof.set_result(None)

    async def _finish_later(self, run: _Run) -> None:
        try:
            await self._await_exit(run)
        except SandboxError as exc:
            logger.error("While cancelling: %s", exc)
        finally:
            self._finish(run)

    def _finish(self, run: _Run) -> None:
        """Release everything a run held: pipes, staging dir, slot (uid) and pool permit."""
        for stream in list(run.fds):
            self._stop_reading(run, stream)
        if run.staging is not None:
            _remove_tree(run.staging)
        self._runs.pop(run.id, None)
        if run.submitted and not run.done.done():  # gave up on a live run: its uid must not be reused
            logger.error("Sandbox slot %d retired (its run %d may still be alive): the pool shrinks by one "
                         "until this LocalSandbox is rebuilt.", run.slot, run.id)
            return  # its permit is not released either, so no caller ever waits for a slot that is gone
        self._free_slots.append(run.slot)
        if self._sem is not None:
            self._sem.release()

    def _result(self, run: _Run, msg: dict, wall: float, timeout_s: float) -> ExecResult:
        if msg.get("error"):
            raise SandboxError(f"The sandbox failed to run the program (not the program's fault): {msg['error']}")
        if msg.get("verdict") == "starved":
            raise SandboxError(
                f"Sandbox run {run.id} starved by machine load, not the program's fault: after {msg['wall_s']:.1f}s "
                f"of wall clock (the backstop, mas.sandbox.backstop_factor {self.config.backstop_factor:g} x "
                f"timeout_s {timeout_s:g}s) it had been charged only {msg['program_s']:.2f}s of its {timeout_s:g}s "
                f"budget, and its main process had waited {msg['wait_s']:.1f}s for a CPU. Lower the machine's "
                "load (mas.sandbox.pool_size, other jobs) or raise mas.sandbox.backstop_factor.")
        status = msg.get("status")
        if status is None:  # killed on our request before B could report
            exit_code = -signal.SIGKILL
        elif os.WIFSIGNALED(status):
            exit_code = -os.WTERMSIG(status)
        else:
            exit_code = os.WEXITSTATUS(status)
        cpu = msg.get("cpu_s")
        stdout = run.out["stdout"].decode("utf-8", errors="replace")
        stderr = run.out["stderr"].decode("utf-8", errors="replace")
        timed_out = run.reason is None and msg.get("verdict") == "timeout"
        reason = run.reason or ("timeout" if timed_out else None) or infer_killed_reason(
            exit_code, cpu, self.config.resolved_cpu_s(timeout_s), stderr)
        return ExecResult(stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out,
                          killed_reason=reason, wall_s=wall, cpu_s=cpu, program_s=msg.get("program_s"),
                          stdout_truncated=run.truncated["stdout"], stderr_truncated=run.truncated["stderr"],
                          isolation=self.protections)


def _remove_tree(path: str) -> None:
    """Remove a staging directory; a program running without a private /tmp may have left it unwritable."""

    def make_writable_and_retry(func: object, failed: str, _exc: object) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
        func(failed)  # type: ignore[operator]

    try:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    except OSError as exc:  # logged, not raised: the run's result is valid, only a temp dir leaks
        logger.error("Could not remove sandbox staging directory %s: %s. Remove it by hand.", path, exc)


def _stage(staging: str, code: bytes, stdin: bytes, files: dict[str, bytes]) -> int:
    """Write the program and its files into ``staging``; returns a read-only descriptor over ``stdin``."""
    for name, content in [(_MAIN, code), *files.items()]:
        path = os.path.join(staging, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
    return _stdin_fd(stdin)


def _stdin_fd(data: bytes) -> int:
    """A read-only descriptor over ``data`` (a memfd): no pipe to feed, EOF right after the data."""
    memfd = os.memfd_create("verl_mas_stdin", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(memfd, view):]
        return os.open(f"/proc/self/fd/{memfd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(memfd)
