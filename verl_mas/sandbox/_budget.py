"""Time budget of one sandboxed run, kept by its init: the program's own time versus the machine's load.

Stdlib only: loaded by the fork server (``python -I -S -B``). The rule (docs/sandbox.md, "Time limits"),
measured from the fork of the program process, so namespace setup is never charged::

    charged = max(wall - run_queue_wait(main process), cpu(all processes of the run))

``wall - run_queue_wait`` is the time the main process ran or blocked by its own choice (sleeping, I/O,
waiting for its children); the time it was runnable but waiting for a CPU (``/proc/<pid>/schedstat``) is
the machine's load. The kernel adds a wait to ``run_delay`` only when the task next gets a CPU, so while
the main process is runnable a wait in progress is bounded from the samples and deducted too (`Meter`).
``cpu(all)`` keeps a program from hiding work in children or threads that starve its own main process.

``charged >= budget``: a timeout, the model's fault. The wall clock reaching the backstop first: the
machine starved the run (an infrastructure failure), unless the program changed its own scheduling (nice
value, policy or CPU affinity), which makes the starvation its own doing (a timeout).
"""

from __future__ import annotations

import os
import resource
import select
import signal
import time
from dataclasses import dataclass

__all__ = ["Meter", "Sample", "supervise"]

_TICK = os.sysconf("SC_CLK_TCK")
_MIN_SLEEP_S = 0.005  # shortest pause between two samples near the end of a budget (and 1% of the budget)


@dataclass(frozen=True)
class Sample:
    """The run's clocks at one moment, in seconds since the program process was forked."""

    wall_s: float
    wait_s: float
    """Time the main process spent runnable but waiting for a CPU: schedstat ``run_delay`` plus the bound on a
    wait still in progress."""
    cpu_s: float
    """CPU time of every process of the run that can be counted (see `Meter`)."""

    @property
    def charged_s(self) -> float:
        """Time charged against the budget: ``max(wall - wait, cpu)``."""
        return max(self.wall_s - self.wait_s, self.cpu_s)


def _stat_cpu(stat: bytes) -> float:
    """utime + stime + cutime + cstime (fields 14-17) of a ``/proc/<pid>/stat`` line, in seconds."""
    fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    return sum(int(x) for x in fields[11:15]) / _TICK


class Meter:
    """Reads the program's clocks.

    Args:
        start: ``time.monotonic()`` just before the program process was forked.
        stat_fd: The program's ``/proc/self/stat``, opened by the program before exec (so it is right
            whatever ``/proc`` this process sees).
        sched_fd: Its ``/proc/self/schedstat``, opened the same way.
        all_procs: This process is the init of the run's PID namespace and ``/proc`` is that namespace's:
            count the CPU of every process in it (plus those already reaped). Otherwise only the main
            process and the children it waited for are counted.
    """

    def __init__(self, start: float, stat_fd: int, sched_fd: int, all_procs: bool) -> None:
        self.start, self.stat_fd, self.sched_fd, self.all_procs = start, stat_fd, sched_fd, all_procs
        self._last = (start, -1)  # (time, exec ns) of the previous sample
        self._ran_after = start  # the main process surely ran at some moment after this time

    def sample(self) -> Sample:
        """Read the clocks now (the program may be a zombie, not yet reaped)."""
        now = time.monotonic()
        exec_ns, delay_ns = (int(x) for x in os.pread(self.sched_fd, 256, 0).split()[:2])
        stat = os.pread(self.stat_fd, 4096, 0)
        # A runnable task may be waiting for a CPU right now, a wait not yet in run_delay. It ran (its exec time
        # grew) at some moment after the previous sample's time, so that wait started after it at the earliest.
        if exec_ns > self._last[1]:
            self._ran_after = self._last[0]
        self._last = (now, exec_ns)
        runnable = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"R"
        wait = delay_ns / 1e9 + (now - self._ran_after if runnable else 0.0)
        wall = now - self.start
        if not self.all_procs:
            return Sample(wall, min(wait, wall), _stat_cpu(stat))
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # processes this init reaped already
        cpu = usage.ru_utime + usage.ru_stime
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":  # pid 1 is this init
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        cpu += _stat_cpu(f.read())
                except (OSError, ValueError):  # exited while we looked
                    pass
        return Sample(wall, min(wait, wall), cpu)


def _rescheduled(pid: int) -> bool:
    """The program runs with a scheduling policy, nice value or CPU affinity other than ours (it inherited
    ours at fork, so it changed them itself: starvation after that is its own doing)."""
    try:
        theirs = (os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid), os.sched_getaffinity(pid))
    except OSError:
        return False
    return theirs != (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0))


def _program_exited(program: int, reap_all: bool) -> bool:
    """Reap every exited child but the program without blocking; True when the program has exited (left
    unreaped, so its clocks can still be read)."""
    while True:
        try:
            info = os.waitid(os.P_ALL if reap_all else os.P_PID, 0 if reap_all else program,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        if info is None:
            return False
        if info.si_pid == program:
            return True
        os.waitpid(info.si_pid, 0)  # an orphan of the run (we are its PID namespace's init)


def supervise(program: int, meter: Meter, budget_s: float, backstop_s: float,
              reap_all: bool) -> tuple[int, resource.struct_rusage, str | None, Sample]:
    """Wait for the program, killing the run when its budget or the wall-clock backstop runs out.

    Args:
        program: Pid of the program process (a child of this process).
        meter: Its clocks.
        budget_s: ``timeout_s`` of the run.
        backstop_s: Wall-clock backstop of the run.
        reap_all: This process is the init of the run's PID namespace: reap orphans, and kill every
            process of the namespace at the end of the budget (otherwise only the program).

    Returns:
        ``(wait status, rusage of the program, verdict, sample)``: verdict ``None`` (ended on its own),
        ``"timeout"`` (budget used up, or starved after changing its own scheduling) or ``"starved"``
        (backstop reached with budget left); the sample is the one the verdict was made on, or the last.
    """
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)  # a child's exit ends the select below (no lost wake-up: self-pipe)
    rate = max(1, len(os.sched_getaffinity(0)))  # cpu(all) grows at most this fast, wall - wait at 1/s
    floor = max(_MIN_SLEEP_S, budget_s / 100)  # bounds the samples of a run on a many-core machine
    verdict: str | None = None
    decided: Sample | None = None
    while not _program_exited(program, reap_all):
        sample = meter.sample()
        pause: float | None = None  # after the kill: until the program's exit
        if verdict is None:
            if sample.charged_s >= budget_s:
                verdict = "timeout"
            elif sample.wall_s >= backstop_s:
                verdict = "timeout" if _rescheduled(program) else "starved"
            else:
                pause = max(floor, min(backstop_s - sample.wall_s, (budget_s - sample.charged_s) / rate))
            if verdict is not None:
                decided = sample
                try:
                    os.kill(-1 if reap_all else program, signal.SIGKILL)  # -1 from a namespace init: all of it
                except ProcessLookupError:
                    pass
        select.select([wake_r], [], [], pause)
        while True:
            try:
                if not os.read(wake_r, 4096):
                    break
            except BlockingIOError:
                break
    final = decided or meter.sample()
    _, status, usage = os.wait4(program, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    return status, usage, verdict, final
