"""What runs inside one sandboxed run before the interpreter: namespaces, mounts, limits, privilege drop.

Stdlib only, executed in processes forked from the fork server (`_zygote`). Each function ends its process
(``os._exit`` or ``execve``); a failure is written to the report pipe and reaches the host as `SandboxError`.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import time
import traceback
from dataclasses import dataclass

if __package__:
    from verl_mas.sandbox import _budget as budget
    from verl_mas.sandbox import _linux as linux
else:  # loaded by the fork-server script (python -I -S -B), which puts this directory on sys.path
    import _budget as budget  # type: ignore[no-redef]
    import _linux as linux  # type: ignore[no-redef]

__all__ = ["RunPlan", "run_helper", "run_init"]


@dataclass(frozen=True)
class RunPlan:
    """What the fork server decided at startup and every run reuses."""

    zygote_pid: int
    uid_base: int
    masks: tuple[tuple[str, tuple[str, ...]], ...]
    """(hidden directory, interpreter trees re-exposed read-only inside it)."""
    nproc_per_userns: bool
    """Apply RLIMIT_NPROC without a dedicated uid (a run's own user namespace on Linux >= 5.14)."""
    tmp_exposed: tuple[str, ...] = ()
    """Interpreter trees under ``/tmp``, bound back read-only into each run's private ``/tmp``."""
    links: tuple[tuple[str, str], ...] = ()
    """(path, target) of symlinks on the way to the interpreter that lie in a directory each run replaces
    (``/tmp``, a mask) outside the trees bound back: recreated there, so the interpreter path resolves."""


def run_helper(plan: RunPlan, run: dict, fds: list[int], rep_w: int, alive_r: int, prot: dict[str, bool],
               flags: int) -> None:
    """Non-root only: enter a user namespace that maps our own uid, create the other namespaces, fork
    the run's init and wait for it. SIGUSR1 (the host's kill) kills the init, hence the whole run."""
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != plan.zygote_pid:
        return
    uid, gid = os.geteuid(), os.getegid()
    linux.unshare(flags | linux.CLONE_NEWUSER | (linux.CLONE_NEWPID if prot["pid_namespace"] else 0))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
            f.write(text)
    state = {"init": 0}

    def kill_init(*_: object) -> None:
        if state["init"]:
            os.kill(state["init"], signal.SIGKILL)

    signal.signal(signal.SIGUSR1, kill_init)
    init = os.fork()
    if init == 0:
        run_init(plan, run, fds, rep_w, alive_r, prot, 0)  # never returns
    state["init"] = init
    for fd in (*fds, rep_w, alive_r):
        os.close(fd)
    os.waitpid(init, 0)


def run_init(plan: RunPlan, run: dict, fds: list[int], rep_w: int, alive_r: int, prot: dict[str, bool],
             unshare_flags: int) -> None:
    """The run's init ("B", pid 1 of its PID namespace): set up, fork the program, reap, report.

    Writes one JSON report to ``rep_w``: ``{"status": wait status, "cpu_s": ..., "verdict": ..., ...}`` of the
    program (see `budget.supervise`), or ``{"error": ...}`` when the sandbox could not start it. Never returns.
    """
    report: dict = {}
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([alive_r], [], [], 0)[0]:  # readable only at EOF: our parent already died
            os._exit(0)
        os.close(alive_r)
        for sig in (signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        if unshare_flags:
            linux.unshare(unshare_flags)
        uid = plan.uid_base + run["slot"] if prot["unprivileged_uid"] else None
        if not prot["pid_namespace"]:
            os.setsid()  # then the fork server can at least kill the run's session
        if prot["filesystem"]:
            setup_fs(plan, run, uid, prot)
            workdir = "/tmp"
        else:
            workdir = run["staging"]
            if uid is not None:
                for root, dirs, files in os.walk(workdir):
                    for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                        os.lchown(name, uid, uid)
        err_r, err_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        start = time.monotonic()
        program = os.fork()
        if program == 0:
            err_r.close()
            exec_program(plan, run, fds, err_w, uid, workdir)  # never returns
        err_w.close()
        for fd in fds:
            os.close(fd)
        clocks, exec_error = _receive_clocks(err_r)
        if exec_error or len(clocks) != 2:
            while True:  # as pid 1 we also reap orphans; the program's status is the one that counts
                pid, status, usage = os.wait4(-1 if prot["pid_namespace"] else program, 0)
                if pid == program:
                    break
            report = {"error": f"could not start the interpreter: {exec_error or 'no clocks received'}"}
        else:
            meter = budget.Meter(start, clocks[0], clocks[1], prot["pid_namespace"] and prot["filesystem"])
            status, usage, verdict, sample = budget.supervise(program, meter, run["budget_s"], run["backstop_s"],
                                                              prot["pid_namespace"])
            report = {"status": status, "cpu_s": usage.ru_utime + usage.ru_stime, "verdict": verdict,
                      "program_s": sample.charged_s, "wall_s": sample.wall_s, "wait_s": sample.wait_s}
    except BaseException:  # noqa: BLE001 - reported to the host as an infrastructure failure
        report = {"error": "run setup: " + traceback.format_exc()}
    finally:
        os.write(rep_w, json.dumps(report).encode())
        os._exit(0)


def _receive_clocks(sock: socket.socket) -> tuple[list[int], str]:
    """The program's clock descriptors (``/proc/self/stat``, ``schedstat``) and any error text it sent
    before exec; returns at exec (the socket is close-on-exec) or when the process ends."""
    clocks: list[int] = []
    errors: list[bytes] = []
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 65536, 2)
        if not data and not fds:
            sock.close()
            return clocks, b"".join(errors).decode(errors="replace")
        if fds:
            clocks.extend(fds)
        else:
            errors.append(data)


def _make_links(links: tuple[tuple[str, str], ...], root: str) -> None:
    """Recreate the planned symlinks that lie under ``root`` (a fresh tmpfs of this run)."""
    for path, target in links:
        if path.startswith(root + "/"):
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            os.symlink(target, path)


def setup_fs(plan: RunPlan, run: dict, uid: int | None, prot: dict[str, bool]) -> None:
    """In the run's mount namespace: read-only root, hidden paths masked, private tmpfs ``/tmp`` (the working
    directory, holding a copy of the staged files) and ``/dev/shm``, and a ``/proc`` of the run's PIDs."""
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)  # nothing below propagates to the host
    staging_fd = os.open(run["staging"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    expose_fds = {e: os.open(e, os.O_PATH) for _, exposed in plan.masks for e in exposed}
    tmp_fds = {e: os.open(e, os.O_PATH) for e in plan.tmp_exposed}
    linux.make_readonly("/", recursive=True)
    for mask, exposed in plan.masks:
        linux.mount("tmpfs", mask, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=64k,mode=0755")
        for e in exposed:
            os.makedirs(e, mode=0o755, exist_ok=True)
            linux.mount(f"/proc/self/fd/{expose_fds[e]}", e, None, linux.MS_BIND | linux.MS_REC)
            linux.make_readonly(e, recursive=True)
        _make_links(plan.links, mask)
        linux.make_readonly(mask, recursive=False)
    for fd in expose_fds.values():
        os.close(fd)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={run['disk_bytes']},mode=0700{owner}")
    linux.copy_tree(staging_fd, "/tmp", uid)
    os.close(staging_fd)
    for e, fd in tmp_fds.items():
        os.makedirs(e, mode=0o755, exist_ok=True)
        linux.mount(f"/proc/self/fd/{fd}", e, None, linux.MS_BIND | linux.MS_REC)
        linux.make_readonly(e, recursive=True)
        os.close(fd)
    _make_links(plan.links, "/tmp")
    if os.path.isdir("/dev/shm"):
        linux.mount("tmpfs", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"size={run['disk_bytes']},mode=1777")
    if prot["pid_namespace"]:
        linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)


def exec_program(plan: RunPlan, run: dict, fds: list[int], err_sock: socket.socket, uid: int | None,
                 workdir: str) -> None:
    """The program ("C"): hand its clocks to the init, limits, no_new_privs, drop to the slot uid, stdio,
    then execve the interpreter."""
    err_w = err_sock.fileno()
    try:
        clocks = [os.open(f"/proc/self/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in ("stat", "schedstat")]
        socket.send_fds(err_sock, [b"clocks"], clocks)
        for fd in clocks:
            os.close(fd)
        lim = run["limits"]
        os.chdir(workdir)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["as_bytes"], lim["as_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["fsize_bytes"], lim["fsize_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["nofile"], lim["nofile"]))
        if uid is not None or plan.nproc_per_userns:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # from root: drops every capability
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)  # ignored dispositions would survive exec
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.execve(run["argv"][0], run["argv"], run["env"])
    except BaseException as exc:  # noqa: BLE001 - the init reports it as an infrastructure failure
        os.write(err_w, f"{type(exc).__name__}: {exc}".encode())
    os._exit(127)
