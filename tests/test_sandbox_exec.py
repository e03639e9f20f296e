"""Sandbox correctness: stdin/stdout programs, tracebacks, unicode, files, judging, compile checks, the
bounded pool, cancellation, the infrastructure-error contract, and honest reporting without isolation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import verl_mas.sandbox as sandbox
from verl_mas.sandbox import (
    PROTECTIONS,
    LocalSandbox,
    SandboxConfig,
    SandboxError,
    TestCase,
    check_compiles,
    run_tests,
)
from verl_mas.sandbox import local as local_backend

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the local sandbox backend is Linux-only")

# These tests check correctness, not isolation (test_sandbox_attacks / _isolation do, as root). Without root
# the default refuses to run (a protection is missing), so there they accept what the machine allows.
ANY_ISOLATION = {} if os.geteuid() == 0 else {"require_isolation": False}




@pytest.fixture(scope="module")
def work_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sandbox_staging")


@pytest.fixture(scope="module")
def box(work_root):
    sb = LocalSandbox(SandboxConfig(timeout_s=10, pool_size=4, work_root=str(work_root), **ANY_ISOLATION))
    yield sb
    sb.close()


@pytest.fixture
async def sb(box, work_root):
    yield box
    assert os.listdir(work_root) == []  # every staging directory was removed


SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


# ---------------------------------------------------------------------------------------------- programs
async def test_stdin_to_stdout(sb):
    r = await sb.run_python(SUM, stdin="2 40\n")
    assert (r.stdout, r.stderr, r.exit_code, r.killed_reason, r.timed_out) == ("42\n", "", 0, None, False)
    assert r.ok and r.cpu_s is not None and 0 < r.cpu_s < r.wall_s + 1


async def test_exception_gives_a_traceback_with_source_lines(sb):
    r = await sb.run_python("x = 1\ny = x / 0\n")
    assert r.exit_code == 1 and r.killed_reason is None and not r.ok
    assert 'File "/tmp/main.py", line 2, in <module>' in r.stderr
    assert "y = x / 0" in r.stderr and r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


async def test_syntax_error_is_a_result_not_an_exception(sb):
    r = await sb.run_python("def f(:\n    pass\n")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr and 'main.py", line 1' in r.stderr


async def test_exit_code_is_passed_through(sb):
    r = await sb.run_python("import sys\nprint('bye')\nsys.exit(3)\n")
    assert (r.exit_code, r.stdout, r.killed_reason) == (3, "bye\n", None)


async def test_unicode_round_trip_and_undecodable_bytes(sb):
    text = "héllo wörld ✓ 你好 🎉"
    r = await sb.run_python("s = input()\nprint(s.upper())\nprint(len(s))\n", stdin=text + "\n")
    # 5 (héllo) + 1 + 5 (wörld) + 1 + 1 (✓) + 1 + 2 (你好) + 1 + 1 (🎉) = 18 code points
    assert r.stdout == "HÉLLO WÖRLD ✓ 你好 🎉\n18\n"
    r = await sb.run_python("import sys\nsys.stdout.buffer.write(b'ok \\xff\\n')\n")
    assert r.stdout == "ok \ufffd\n"  # invalid UTF-8 is replaced, not an error


async def test_large_stdin_is_delivered_whole(sb):
    data = "0123456789abcdef" * (3 << 16)  # 16 B * 3 * 65536 = 3 MiB, far beyond a 64 KiB pipe buffer
    r = await sb.run_python("import sys, hashlib\nb = sys.stdin.buffer.read()\n"
                            "print(len(b), hashlib.sha256(b).hexdigest())\n", stdin=data)
    assert r.stdout == f"{3 << 20} {hashlib.sha256(data.encode()).hexdigest()}\n"


async def test_files_are_placed_next_to_the_program(sb):
    program = "print(open('data/in.txt').read().strip())\nprint(len(open('blob.bin', 'rb').read()))\n"
    r = await sb.run_python(program, files={"data/in.txt": "payload ✓\n", "blob.bin": bytes(range(256))})
    assert r.stdout == "payload ✓\n256\n"


async def test_run_tests_pass_rate_and_compare_modes(sb):
    # Buggy on negatives: abs() sneaks in, so test 3 (-1 + -2 = -3) prints 3.
    buggy = "a, b = map(int, input().split())\nprint(abs(a + b))\n"
    tests = [("1 2\n", "3\n"), TestCase("10 20\n", "30"), ("-1 -2\n", "-3\n")]
    report = await run_tests(buggy, tests, sandbox=sb)
    assert [t.verdict for t in report.results] == ["passed", "passed", "wrong_output"]
    assert (report.passed, report.total, report.pass_rate) == (2, 3, pytest.approx(2 / 3))
    assert report.results[2].actual == "3\n" and report.results[2].case.expected == "-3\n"
    # "30" vs printed "30\n": exact fails, normalized passes.
    exact = await run_tests(SUM, tests[:2], compare="exact", sandbox=sb)
    assert [t.passed for t in exact.results] == [True, False]
    spaced = "print(*input().split(), sep='\\n')\n"  # "1 2" printed one token per line
    tokens = await run_tests(spaced, [("1 2\n", "1 2\n")], compare="tokens", sandbox=sb)
    assert tokens.all_passed
    crash = await run_tests("raise SystemExit(2)\n", [("", "")], sandbox=sb)
    assert crash.results[0].verdict == "runtime_error"
    with pytest.raises(ValueError, match="tests is empty"):
        await run_tests(SUM, [], sandbox=sb)


async def test_check_compiles(sb):
    good = await check_compiles("def f(x):\n    return x + 1\n", sandbox=sb)
    assert good.ok and good.error is None
    bad = await check_compiles("def f(x):\n    return x +\n", sandbox=sb)
    assert not bad.ok and bad.error.startswith("SyntaxError") and "line 2" in bad.error
    # compiling never runs the code: a program that would hang still compiles at once
    assert (await check_compiles("while True:\n    pass\n", sandbox=sb, timeout_s=5)).ok


# ---------------------------------------------------------------------------------------------- pool
async def test_pool_bounds_concurrency_without_blocking_the_loop(work_root):
    small = LocalSandbox(SandboxConfig(pool_size=2, timeout_s=20, work_root=str(work_root), **ANY_ISOLATION))
    try:
        await small.start()
        program = "import time\nt0 = time.time()\ntime.sleep(1.0)\nprint(t0, time.time())\n"
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                await asyncio.sleep(0.01)
                ticks.append(time.time())  # the programs' clock: CLOCK_REALTIME, not namespaced

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*(small.run_python(program) for _ in range(6)))
        stop.set()
        await tick
        spans = [tuple(map(float, r.stdout.split())) for r in results]
        # At any program's start, count the programs running: never more than pool_size = 2.
        overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
        assert overlap <= 2
        # The loop kept running while programs ran: a run waited on inside the loop blocks it from a program's
        # start to its end, so no tick would fall inside any program's second of sleep. Counted per program, not as
        # a largest gap, so that one second of this process starved on a loaded machine (seen: 1.3 s) does not fail it.
        inside = sum(any(s < t < e for t in ticks) for s, e in spans)
        assert inside >= len(spans) // 2, f"ticks inside {inside} of {len(spans)} programs' runs"
    finally:
        small.close()


async def test_cancelled_run_is_killed_and_its_slot_reused(sb, work_root, procs_of):
    task = asyncio.create_task(sb.run_python("import time\ntime.sleep(60)\n"))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):  # the kill completes in the background
        if not sb._runs:
            break
        await asyncio.sleep(0.05)
    assert procs_of(sb.uids) == [] and os.listdir(work_root) == []
    assert (await sb.run_python("print('next')")).stdout == "next\n"


# ---------------------------------------------------------------------------------------------- failures
async def test_infrastructure_failure_raises_and_recovers(work_root, procs_of):
    fragile = LocalSandbox(SandboxConfig(timeout_s=30, pool_size=2, work_root=str(work_root), **ANY_ISOLATION))
    try:
        await fragile.start()
        task = asyncio.create_task(fragile.run_python("import time\ntime.sleep(20)\n"))
        await asyncio.sleep(1.0)
        os.kill(fragile.zygote_pid, signal.SIGKILL)  # the sandbox itself dies, not the program
        with pytest.raises(SandboxError, match="fork server exited"):
            await task
        for _ in range(100):  # its run dies with it (parent-death signals down the tree)
            if not procs_of(fragile.uids):
                break
            await asyncio.sleep(0.05)
        assert procs_of(fragile.uids) == []
        r = await fragile.run_python("print('back')")  # a new fork server is started
        assert r.stdout == "back\n"
    finally:
        fragile.close()
    assert os.listdir(work_root) == []


async def test_without_isolation_every_missing_protection_is_reported_once(work_root, caplog):
    bare = LocalSandbox(SandboxConfig(isolation="none", pool_size=1, work_root=str(work_root)))
    try:
        with caplog.at_level(logging.WARNING, logger="verl_mas.sandbox.local"):
            first = await bare.run_python("print('hi')")
            await bare.run_python("print('hi')")
            bare.close()
            await bare.run_python("print('hi')")  # restarted: same machine, same message, not repeated
        assert first.stdout == "hi\n"
        assert first.missing_isolation == PROTECTIONS
        warnings = [rec for rec in caplog.records if "UNAVAILABLE" in rec.getMessage()]
        assert len(warnings) == 1
        assert all(name in warnings[0].getMessage() for name in PROTECTIONS)
    finally:
        bare.close()


async def test_module_level_default_sandbox(work_root):
    try:
        cfg = sandbox.configure({"timeout_s": 5, "pool_size": 2, "work_root": str(work_root), **ANY_ISOLATION})
        r = await sandbox.run_python("print(input()[::-1])", "abc\n")
        assert r.stdout == "cba\n"
        assert sandbox.get_sandbox() is sandbox.get_sandbox(cfg)
        report = await run_tests(SUM, [("1 1\n", "2\n")])
        assert report.pass_rate == 1.0
    finally:
        await sandbox.get_sandbox(cfg).aclose()
        sandbox.configure(None)


# ---------------------------------------------------------------------------------------------- package tree
def _copy_helper(directory: Path) -> list[str]:
    """Copy the fork server's modules (it imports its siblings by path) into ``directory``."""
    directory.mkdir()
    names = sorted(f.name for f in local_backend._ZYGOTE.parent.glob("_*.py") if f.name != "__init__.py")
    for name in names:
        shutil.copy(local_backend._ZYGOTE.parent / name, directory / name)
    return names


async def test_the_helper_writes_no_bytecode_into_its_package(tmp_path, work_root, monkeypatch):
    helper = tmp_path / "helper"
    names = _copy_helper(helper)
    assert {"_zygote.py", "_runinit.py", "_linux.py"} <= set(names)
    monkeypatch.setattr(local_backend, "_ZYGOTE", helper / "_zygote.py")
    box = LocalSandbox(SandboxConfig(pool_size=1, require_isolation=False, work_root=str(work_root)))
    try:
        r = await box.run_python("print('ran')")
        # Positive control: the fork server really is the copy.
        assert str(helper / "_zygote.py").encode() in Path(f"/proc/{box.zygote_pid}/cmdline").read_bytes()
    finally:
        box.close()
    assert r.stdout == "ran\n"
    assert sorted(p.name for p in helper.rglob("*")) == names  # no __pycache__, no .pyc
    # Negative control: the same import without -B (as `python -I`, which ignores PYTHONDONTWRITEBYTECODE)
    # does write bytecode next to the modules, so the check above can see it.
    control = tmp_path / "control"
    _copy_helper(control)
    subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(control)!r}); "
                    "import _runinit"], check=True, env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert {p.name.split(".")[0] for p in (control / "__pycache__").glob("*.pyc")} >= {"_runinit", "_linux"}
