"""Attack corpus: hostile programs must be contained, reported, leave the host unaffected and leave nothing
behind (no process of the sandbox's uids, no file outside the run, no staging directory).

Needs root on Linux with namespaces (the CI machine); elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from verl_mas.sandbox import PROTECTIONS, LocalSandbox, SandboxConfig, run_tests

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="the attack corpus needs root on Linux (namespaces, unprivileged uids); CI runs it as root")

MAX_OUTPUT = 64 * 1024
MAX_PROCS = 16


def _code(src: str) -> str:
    return textwrap.dedent(src).lstrip("\n")




def _procs_with_marker(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


@pytest.fixture(scope="module")
def work_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandbox_staging")


@pytest.fixture(scope="module")
def box(work_root):
    # backstop_factor 10: the timeouts below are the programs' fault and must stay so on a shared machine.
    sb = LocalSandbox(SandboxConfig(timeout_s=5, pool_size=4, memory_mb=512, max_output_bytes=MAX_OUTPUT,
                                    max_procs=MAX_PROCS, work_root=str(work_root), require_isolation=True,
                                    backstop_factor=10.0))
    yield sb
    sb.close()


@pytest.fixture
async def sb(box, work_root, procs_of):
    """The shared sandbox; after each test: nothing of the sandbox is left running or on disk."""
    await box.start()
    assert dict(box.protections) == dict.fromkeys(PROTECTIONS, True)
    yield box
    assert procs_of(box.uids) == []
    assert os.listdir(work_root) == []


def _host_can_spawn() -> bool:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-I", "-S", "-c", "print('ok')"], capture_output=True, timeout=30)
    return out.stdout == b"ok\n" and time.monotonic() - t0 < 30


async def test_infinite_loop_is_killed_when_its_time_budget_is_used(sb):
    r = await sb.run_python("while True:\n    pass\n", timeout_s=1)
    assert r.timed_out and r.killed_reason == "timeout" and r.exit_code == -9
    # A loop that never sleeps is charged its CPU: killed once charged >= 1 s, i.e. after >= ~1 CPU-second
    # (rusage and /proc's 10 ms ticks differ slightly), and never before 1 s of wall clock.
    assert r.program_s >= 1 and r.cpu_s >= 0.9 and r.wall_s >= 1
    assert r.isolation == dict.fromkeys(PROTECTIONS, True)


async def test_fork_bomb_is_capped_and_torn_down(sb, procs_of):
    # Counting bomb: fork sleeping children until fork fails. RLIMIT_NPROC counts every process of the slot's
    # uid, and the slot is exclusive, so main (1) + children (n) <= MAX_PROCS: exactly MAX_PROCS - 1 = 15.
    counting = _code("""
        import os, time
        n = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
        print(n)
    """)
    r = await sb.run_python(counting)
    assert r.ok and r.stdout == f"{MAX_PROCS - 1}\n"
    assert procs_of(sb.uids) == []  # the 15 sleepers died with the run
    # Classic bomb: every process forks forever; the wall clock ends it and the PID namespace takes all.
    r = await sb.run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                            timeout_s=2)
    assert r.timed_out and r.killed_reason == "timeout"
    assert procs_of(sb.uids) == []
    assert _host_can_spawn()


async def test_memory_balloon_hits_the_address_space_limit(sb):
    r = await sb.run_python("x = bytearray(8 * 1024**3)\n", memory_mb=256)
    assert r.exit_code == 1 and r.killed_reason == "memory" and not r.timed_out
    assert r.stderr.rstrip().endswith("MemoryError")
    # Gradual growth: 32 MiB at a time stops below 256 MiB of address space.
    gradual = "chunks = []\nwhile True:\n    chunks.append(b'x' * (32 << 20))\n    print(len(chunks), flush=True)\n"
    r = await sb.run_python(gradual, memory_mb=256)
    assert r.killed_reason == "memory" and not r.timed_out
    assert 1 <= int(r.stdout.split()[-1]) < 256 // 32


async def test_huge_output_is_capped_and_the_run_killed(sb):
    r = await sb.run_python("while True:\n    print('x' * 999)\n")
    assert r.killed_reason == "output_limit" and not r.timed_out
    assert r.stdout_truncated and len(r.stdout) == MAX_OUTPUT and set(r.stdout) == {"x", "\n"}
    r = await sb.run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n")
    assert r.killed_reason == "output_limit" and r.stderr_truncated and len(r.stderr) == MAX_OUTPUT
    assert r.stdout == ""


async def test_deep_recursion(sb):
    r = await sb.run_python("def f(n):\n    return f(n + 1)\nf(0)\n")
    assert r.exit_code == 1 and r.killed_reason is None and "RecursionError" in r.stderr
    # With the guard removed, recursion through C (__repr__ -> repr) overflows the C stack: SIGSEGV.
    crash = _code("""
        import sys
        sys.setrecursionlimit(10**7)
        class A:
            def __repr__(self):
                return repr(A())
        repr(A())
    """)
    r = await sb.run_python(crash)
    assert r.exit_code == -11 and r.killed_reason == "signal:11"
    assert not Path("core").exists()


async def test_writes_outside_the_run_directory_are_denied(sb, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)  # permissions alone would let any uid write here; the read-only mount must not
    var_dir = Path(f"/var/tmp/verl_mas_attack_{uuid.uuid4().hex}")
    var_dir.mkdir(mode=0o777)
    var_dir.chmod(0o777)
    host_tmp = Path(f"/tmp/verl_mas_attack_{uuid.uuid4().hex}")
    targets = [outside / "pwned", var_dir / "pwned", Path("/etc/verl_mas_pwned"), Path(__file__).parent / "pwned"]
    try:
        program = _code(f"""
            import os
            for path in {[str(t) for t in targets]!r}:
                try:
                    with open(path, "w") as f:
                        f.write("pwned")
                    print("WROTE", path)
                except OSError as exc:
                    print("denied", exc.errno)
            with open({str(host_tmp)!r}, "w") as f:  # lands in the run's private /tmp
                f.write("private")
            print("own /tmp ok", sorted(os.listdir("/tmp")))
            try:
                os.chmod("/etc/passwd", 0o666)
                print("WROTE chmod")
            except OSError as exc:
                print("denied", exc.errno)
        """)
        r = await sb.run_python(program)
        assert r.ok, r.stderr
        # ENOENT (2): the test's tmp dir lives under the host /tmp, which the run's private /tmp hides.
        # EROFS (30): /var/tmp, /etc and the repo are on read-only mounts, and so is chmod of /etc/passwd.
        # A checkout under /tmp (as CI clones may be) is hidden like the tmp dir (ENOENT), and the top
        # directory of an interpreter under /tmp shows in the run's /tmp, bound back read-only.
        # (Symlinks on the way to it, e.g. a venv reached through /tmp/x/.venv -> /tmp/y/.venv, show too.)
        paths = (sys.prefix, sys.base_prefix, sys.executable, os.path.dirname(os.path.realpath(sys.executable)))
        in_tmp = [*paths, *(os.path.realpath(p) for p in paths)]
        interp_roots = {Path(p).parts[2] for p in in_tmp if p.startswith("/tmp/")}
        repo_errno = 2 if str(Path(__file__).resolve()).startswith("/tmp/") else 30
        assert r.stdout.splitlines() == ["denied 2", "denied 30", "denied 30", f"denied {repo_errno}",
                                         f"own /tmp ok {sorted(['main.py', host_tmp.name, *interp_roots])}",
                                         "denied 30"]
        for target in targets:
            assert not target.exists()
        assert not host_tmp.exists()
        assert os.listdir(outside) == [] and os.listdir(var_dir) == []
    finally:
        var_dir.rmdir()


async def test_parent_environment_is_not_readable(box, work_root, monkeypatch, procs_of):
    secret = f"tok_{uuid.uuid4().hex}"
    monkeypatch.setenv("VERL_MAS_TEST_SECRET", secret)
    assert os.environ["VERL_MAS_TEST_SECRET"] == secret  # positive control: the host has it
    fresh = LocalSandbox(box.config)  # its fork server starts after the secret was set
    try:
        program = _code(f"""
            import os
            print(dict(os.environ))
            print(sorted(e for e in os.listdir("/proc") if e.isdigit()))
            for pid in ("self", "1", {str(os.getpid())!r}):
                try:
                    print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
                except OSError as exc:
                    print(pid, "denied", exc.errno)
        """)
        r = await fresh.run_python(program)
        assert r.ok, r.stderr
        assert secret not in r.stdout + r.stderr
        assert "VERL_MAS_TEST_SECRET" not in r.stdout
        lines = r.stdout.splitlines()
        # Only the run's own PID namespace is visible: its init (1) and the program (2).
        assert lines[1] == "['1', '2']"
        assert lines[4] == f"{os.getpid()} denied 2"  # ENOENT: the host pid does not exist in there
        assert procs_of(fresh.uids) == []
    finally:
        fresh.close()


async def test_network_is_unreachable_even_on_loopback(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted: list[tuple] = []

    def accept_all():
        while True:
            try:
                conn, addr = server.accept()
            except OSError:
                return
            accepted.append(addr)
            conn.close()

    thread = threading.Thread(target=accept_all, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # positive control: the server is reachable from the host
        program = _code(f"""
            import socket
            for host in ("127.0.0.1", "8.8.8.8"):
                try:
                    socket.create_connection((host, {port}), timeout=2)
                    print("CONNECTED", host)
                except OSError as exc:
                    print("blocked", host, exc.errno)
            print([name for _, name in socket.if_nameindex()])
        """)
        r = await sb.run_python(program)
        assert r.ok, r.stderr
        # ENETUNREACH (101): the run's network namespace has only a loopback that is down.
        assert r.stdout.splitlines() == ["blocked 127.0.0.1 101", "blocked 8.8.8.8 101", "['lo']"]
        time.sleep(0.6)
        assert len(accepted) == 1  # only the control connection ever arrived
    finally:
        server.close()
        thread.join(timeout=5)


async def test_background_process_does_not_outlive_the_program(sb, procs_of):
    marker = f"verl_mas_daemon_{uuid.uuid4().hex}"
    program = _code(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()  # a daemon: new session, reparented away from the program
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
            os._exit(0)
        os.wait()
        print("parent exits")
    """)
    r = await sb.run_python(program)
    assert r.ok and r.stdout == "parent exits\n"
    assert _procs_with_marker(marker) == []
    assert procs_of(sb.uids) == []


async def test_reading_stdin_past_eof_does_not_hang(sb):
    program = "import sys\nprint(input())\nprint(repr(sys.stdin.read()))\nprint(input())\n"
    r = await sb.run_python(program, stdin="only line\n", timeout_s=3)
    assert not r.timed_out and r.exit_code == 1
    assert r.stdout == "only line\n''\n" and r.stderr.rstrip().endswith("EOFError: EOF when reading a line")


async def test_correct_output_then_hang_fails_as_timeout(sb):
    program = "import time\nprint(42, flush=True)\ntime.sleep(60)\n"
    r = await sb.run_python(program, timeout_s=1)
    assert r.timed_out and r.stdout == "42\n"
    report = await run_tests(program, [("", "42\n")], timeout_s=1, sandbox=sb)
    assert report.pass_rate == 0.0 and report.results[0].verdict == "timeout"
    assert report.results[0].actual == "42\n"  # the right answer was printed, and still does not count
