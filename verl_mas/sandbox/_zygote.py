"""Fork server that starts each sandboxed run in fresh Linux namespaces (stdlib only; runs as a script).

The host (`verl_mas.sandbox.local`) starts this file once per sandbox with ``python -I -S -B`` (``-B``: the
package tree is never written to) and talks to it over a ``SOCK_SEQPACKET`` socket: JSON messages, plus the
run's stdin/stdout/stderr descriptors passed with ``SCM_RIGHTS``. Forking this small single-threaded process
is far cheaper and safer than forking a training process that holds GBs of mappings and many threads.

It runs as a script (``-I -S``: the standard library and its sibling helper modules only, nothing of the
host's site-packages), so its server loop cannot lean on the package; that is why it is one module of
~400 lines.

Modules: this one is the server loop; `_runinit` is what runs inside each run; `_budget` keeps a run's
time budget; `_linux` wraps the system calls. Process tree of one run (root)::

    zygote ── B  root, init (pid 1) of the run's fresh PID namespace: unshares net/mount/ipc/uts, mounts,
              │  forks C, keeps its time budget, reaps orphans, reports C's wait status on a pipe
              └─ C  drops to the slot's uid, sets rlimits and no_new_privs, execs the interpreter

The zygote unshares CLONE_NEWPID only for its next child and setns()-es straight back, so no intermediate
process is needed. Killing B (SIGKILL) tears down the whole PID namespace: nothing the program started
survives, and the zygote reaps B only after every process in there is gone. Without root, a helper
process first enters a new user namespace (mapping only our own uid) and becomes B's parent.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import tempfile

if __package__:
    from verl_mas.sandbox import _linux as linux
    from verl_mas.sandbox import _runinit as runinit
else:  # run as a script by the host (python -I -S -B): make the sibling modules importable
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _linux as linux  # type: ignore[no-redef]
    import _runinit as runinit  # type: ignore[no-redef]

PROTECTIONS = ("network", "pid_namespace", "filesystem", "unprivileged_uid")  # as verl_mas.sandbox.result


class _Run:
    """Zygote-side state of one run."""

    __slots__ = ("alive_w", "eof", "id", "killed", "mode", "pid", "rep_r", "report", "slot", "status")

    def __init__(self, run_id: int, pid: int, mode: str, slot: int, rep_r: int, alive_w: int) -> None:
        self.id, self.pid, self.mode, self.slot = run_id, pid, mode, slot
        self.rep_r = rep_r  # B's report (C's wait status, or a setup error); EOF once B is gone
        self.alive_w = alive_w  # held open while the run lives: B checks it to detect a dead parent
        self.report = b""
        self.eof = False
        self.status: int | None = None  # wait status of the top process once reaped
        self.killed = False


class Zygote:
    """Serves run requests from one host process; see the module docstring for the process tree."""

    def __init__(self, cfg: dict, ctrl: socket.socket) -> None:
        self.cfg = cfg
        self.ctrl = ctrl
        self.pid = os.getpid()
        self.is_root = os.geteuid() == 0
        self.runs: dict[int, _Run] = {}  # run id -> run
        self.by_pid: dict[int, _Run] = {}  # top process pid -> run, until reaped
        self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if self.is_root else -1
        self.problems: list[str] = []
        self.masks: list[tuple[str, tuple[str, ...]]] = []
        self.tmp_exposed: tuple[str, ...] = ()  # interpreter trees under /tmp, which each run replaces
        self.links: tuple[tuple[str, str], ...] = ()  # symlinks to the interpreter that each run recreates
        self.plan = runinit.RunPlan(self.pid, cfg["uid_base"], (), nproc_per_userns=False)
        self.prot = dict.fromkeys(PROTECTIONS, False)
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.sel = selectors.DefaultSelector()

    # ------------------------------------------------------------------ startup
    def start(self) -> None:
        """Probe what this machine allows, then tell the host (``hello``)."""
        if self.cfg["isolation"] != "none":
            self._plan_paths()
            self._choose_protections()
        else:
            self.problems.append("isolation is 'none' in the config: no namespaces and no unprivileged uid.")
        if not self.is_root and not self.plan.nproc_per_userns:
            self.problems.append("max_procs is not enforced (needs a dedicated uid, or a user namespace on "
                                 "Linux >= 5.14)")
        self._send({"op": "hello", "pid": self.pid, "protections": self.prot, "problems": self.problems,
                    "mode": "root" if self.is_root else "userns"})

    def _plan_paths(self) -> None:
        """Decide which directories to mask with an empty tmpfs and which interpreter trees to re-expose."""
        probe = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
                 "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)), *sys.path]))")
        needed = set(json.loads(linux.capture([self.cfg["python"], *self.cfg["python_flags"], "-c", probe])))
        needed.add(self.cfg["python"])
        links: dict[str, str] = {}  # every symlink met on the way to what the interpreter needs
        trees: set[str] = set()
        for path in needed:
            if path and os.path.isabs(path) and os.path.exists(path):
                real = _resolve(path, links)
                trees.add(real if os.path.isdir(real) else os.path.dirname(real))
        exposed: list[str] = []
        for path in sorted(trees):
            if not any(path == e or path.startswith(e + "/") for e in exposed):
                exposed.append(path)
        # Each run mounts a private tmpfs on /tmp: an interpreter living under /tmp (a checkout or a virtual
        # environment there, as CI clones often are) must be bound back into it, read-only.
        self.tmp_exposed = tuple(e for e in exposed if e.startswith("/tmp/"))
        masks = {os.path.realpath(h) for h in self.cfg["hidden_paths"] if os.path.isdir(h)}
        if self.is_root:  # the slot uid is an "other": it needs o+x on every ancestor of what it runs
            for path in [*exposed, *links]:
                cur = ""
                for part in path.strip("/").split("/")[:-1]:
                    cur += "/" + part
                    if cur.startswith("/tmp/"):
                        break  # each run's /tmp is a fresh tmpfs whose directories are 0755
                    if not os.stat(cur).st_mode & stat.S_IXOTH:
                        masks.add(cur)
                        break
        for mask in sorted(masks):
            if any(mask == m or mask.startswith(m + "/") for m, _ in self.masks):
                continue  # already hidden by an enclosing mask
            if any(e == mask or mask.startswith(e + "/") for e in exposed):
                self.problems.append(f"hidden path {mask} holds the interpreter tree itself; it stays visible.")
                continue
            self.masks.append((mask, tuple(e for e in exposed if e.startswith(mask + "/"))))
        # A symlink on the interpreter's path (a venv at /tmp/x/.venv -> /tmp/y/.venv, bin/python -> python3)
        # that lies in a replaced directory, outside the trees bound back, is recreated in each run.
        replaced = ["/tmp", *(m for m, _ in self.masks)]
        self.links = tuple(sorted(
            (link, target) for link, target in links.items()
            if any(link.startswith(r + "/") for r in replaced)
            and not any(link.startswith(e + "/") for e in exposed)))

    def _choose_protections(self) -> None:
        """Probe protection sets, strongest first, with a real interpreter start; keep the first that works."""
        names = list(PROTECTIONS)
        if not self.is_root:
            names.remove("unprivileged_uid")
            self.problems.append(f"not running as root: programs run as this process's own uid {os.geteuid()}, "
                                 "not a dedicated one")
        first_error = None
        for size in range(len(names), -1, -1):
            for subset in itertools.combinations(names, size):
                prot = {name: name in subset for name in PROTECTIONS}
                # Since Linux 5.14 RLIMIT_NPROC counts per user namespace, so a run's own user namespace
                # makes max_procs a per-run limit; earlier it would count all of this user's processes.
                release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
                self.plan = runinit.RunPlan(self.pid, self.cfg["uid_base"], tuple(self.masks),
                                            not self.is_root and any(prot.values()) and release >= (5, 14),
                                            self.tmp_exposed, self.links)
                error = self._probe(prot)
                if error is None:
                    self.prot = prot
                    if first_error is not None:
                        self.problems.append(f"full isolation failed to start ({first_error}); using {prot}.")
                    return
                first_error = first_error or error
        self.problems.append(f"no protection set could start the interpreter ({first_error})")

    def _probe(self, prot: dict[str, bool]) -> str | None:
        staging = tempfile.mkdtemp(prefix="verl_mas_sbx_probe_")
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        fds = [os.dup(null), os.dup(null), os.dup(null)]
        os.close(null)
        run = {"id": -1, "slot": 0, "staging": staging, "env": {"PATH": "/usr/bin:/bin"},
               "argv": [self.cfg["python"], *self.cfg["python_flags"], "-c", "pass"],
               "limits": {"cpu_s": 30, "as_bytes": 1 << 30, "fsize_bytes": 1 << 20, "nproc": 16, "nofile": 64},
               "disk_bytes": 1 << 20, "budget_s": 30.0, "backstop_s": 120.0}
        try:
            rec = self._spawn(run, fds, prot)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            for fd in fds:
                os.close(fd)
        try:
            rec.report = linux.read_all(rec.rep_r)
            _, rec.status = os.waitpid(rec.pid, 0)
        finally:
            os.close(rec.rep_r)
            os.close(rec.alive_w)
            shutil.rmtree(staging)
        msg = self._exit_message(rec)
        if msg.get("error"):
            return msg["error"]
        if msg.get("status") != 0:
            return f"probe interpreter exited with wait status {msg.get('status')}"
        return None

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        """Handle run/kill requests until the host closes the socket, then kill every run and exit."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        self.sel.register(self.ctrl, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        gc.freeze()  # startup objects leave the collector's view: fewer pages touched (copied) after forks
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.ctrl:
                    if not self._on_ctrl():
                        for rec in list(self.runs.values()):
                            self._kill(rec, signal.SIGKILL)
                        return
                elif key.fileobj == self.wake_r:
                    while True:
                        try:
                            if not os.read(self.wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                    self._reap()
                else:
                    self._on_report(key.data)

    def _on_ctrl(self) -> bool:
        while True:
            try:
                data, fds = linux.recv_with_fds(self.ctrl)
            except BlockingIOError:
                return True
            if not data:
                return False
            msg = json.loads(data)
            if msg["op"] == "run":
                try:
                    rec = self._spawn(msg, fds, self.prot)
                except OSError as exc:
                    self._send({"op": "exit", "id": msg["id"], "error": f"the zygote could not fork: {exc}"})
                    continue
                finally:
                    for fd in fds:
                        os.close(fd)
                self.runs[rec.id] = rec
                self.by_pid[rec.pid] = rec
                self.sel.register(rec.rep_r, selectors.EVENT_READ, rec)
            elif msg["op"] == "kill":
                target = self.runs.get(msg["id"])
                if target is not None:
                    self._kill(target)

    def _on_report(self, rec: _Run) -> None:
        chunk = os.read(rec.rep_r, 65536)
        if chunk:
            rec.report += chunk
            return
        self.sel.unregister(rec.rep_r)
        os.close(rec.rep_r)
        rec.eof = True
        self._maybe_done(rec)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rec = self.by_pid.pop(pid, None)
            if rec is not None:
                rec.status = status
                self._maybe_done(rec)

    def _maybe_done(self, rec: _Run) -> None:
        """A run is over when its report pipe hit EOF and its top process was reaped: then tell the host."""
        if not rec.eof or rec.status is None:
            return
        if rec.mode == "plain":
            self._kill_leftovers(rec)
        os.close(rec.alive_w)
        del self.runs[rec.id]
        self._send(self._exit_message(rec))

    def _exit_message(self, rec: _Run) -> dict:
        msg = json.loads(rec.report) if rec.report else {}
        if not rec.report and not rec.killed:
            msg = {"error": f"run init died without a report (wait status {rec.status})"}
        msg.update(op="exit", id=rec.id, killed=rec.killed)
        return msg

    def _kill(self, rec: _Run, sig: int | None = None) -> None:
        """Kill a run: SIGKILL to its PID-namespace init takes every process of the run with it."""
        rec.killed = True
        if rec.status is not None:
            return
        if sig is None:
            sig = signal.SIGUSR1 if rec.mode == "helper" else signal.SIGKILL  # the helper kills its init
        os.kill(rec.pid, sig)
        if rec.mode == "plain":
            self._kill_leftovers(rec)

    def _kill_leftovers(self, rec: _Run) -> None:
        """Without a PID namespace: kill the run's session, then (with a dedicated uid) every process of it."""
        with contextlib.suppress(ProcessLookupError):  # the whole session may be gone already
            os.killpg(rec.pid, signal.SIGKILL)
        if not self.prot["unprivileged_uid"]:
            return
        uid = self.cfg["uid_base"] + rec.slot
        for _ in range(50):  # a fork loop may add processes while we sweep; RLIMIT_NPROC bounds it
            found = False
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        if os.stat(f"/proc/{entry}").st_uid == uid:
                            os.kill(int(entry), signal.SIGKILL)
                            found = True
                    except (FileNotFoundError, ProcessLookupError):
                        pass
            if not found:
                return

    def _send(self, msg: dict) -> None:
        self.ctrl.send(json.dumps(msg).encode())

    # ------------------------------------------------------------------ one run
    def _spawn(self, run: dict, fds: list[int], prot: dict[str, bool]) -> _Run:
        """Fork the run's top process. Root: it is the init of a new PID namespace (the zygote unshares
        CLONE_NEWPID for its next child only, then setns() back). Not root: a helper first enters a new user
        namespace (needed to create the others) and forks the init."""
        flags = linux.CLONE_NEWIPC | linux.CLONE_NEWUTS if any(prot[k] for k in PROTECTIONS[:3]) else 0
        flags |= (linux.CLONE_NEWNET if prot["network"] else 0) | (linux.CLONE_NEWNS if prot["filesystem"] else 0)
        mode = "plain"
        if prot["pid_namespace"]:
            mode = "init" if self.is_root else "helper"
        elif flags and not self.is_root:
            mode = "helper"
        rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
        alive_r, alive_w = os.pipe2(os.O_CLOEXEC)
        try:
            if mode == "init":
                linux.unshare(linux.CLONE_NEWPID)
                try:
                    pid = os.fork()
                finally:
                    if os.getpid() == self.pid:  # back to our own PID namespace for later children
                        linux.setns(self.pidns_fd, linux.CLONE_NEWPID)
            else:
                pid = os.fork()
        except BaseException:
            for fd in (rep_r, rep_w, alive_r, alive_w):
                os.close(fd)
            raise
        if pid == 0:
            code = 0
            try:
                keep = sorted({*fds, rep_w, alive_r})
                lo = 3
                for fd in keep:  # drop the server's descriptors (control socket, other runs' pipes)
                    os.closerange(lo, fd)
                    lo = fd + 1
                os.closerange(lo, 1 << 16)
                gc.disable()
                if mode == "helper":
                    runinit.run_helper(self.plan, run, fds, rep_w, alive_r, prot, flags)
                else:
                    runinit.run_init(self.plan, run, fds, rep_w, alive_r, prot, flags if mode == "init" else 0)
            except BaseException:  # noqa: BLE001 - last resort; the zygote reports a run without a report
                code = 1
            os._exit(code)
        os.close(rep_w)
        os.close(alive_r)
        return _Run(run["id"], pid, mode, run["slot"], rep_r, alive_w)


def _resolve(path: str, links: dict[str, str], depth: int = 0) -> str:
    """Real path of the absolute ``path`` (as ``os.path.realpath``), recording each symlink met on the way
    (its path, with every directory above it resolved, and its target as written) in ``links``."""
    if depth > 40:
        raise OSError(f"too many levels of symbolic links resolving {path}")
    cur = "/"
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            links[nxt] = target
            cur = _resolve(os.path.join(cur, target), links, depth + 1)
        else:
            cur = nxt
    return cur


def main() -> None:
    """Entry point: ``python -I -S -B _zygote.py CONFIG_JSON`` with the control socket inherited."""
    cfg = json.loads(sys.argv[1])
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["host_pid"]:
        sys.exit("verl_mas sandbox zygote: host process already gone")
    ctrl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=cfg["ctrl_fd"])
    zygote = Zygote(cfg, ctrl)
    zygote.start()
    zygote.serve()


if __name__ == "__main__":
    main()
