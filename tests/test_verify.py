"""verl_mas.verify: checks of model output in killable worker processes, awaited without blocking the loop.

Functions run in the pool must be importable by the workers, so these tests send stdlib functions
(``os.getpid``, ``time.sleep``, ``exec`` of a snippet) rather than functions of this test module.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable
from typing import Any

import psutil
import pytest

from verl_mas.errors import InfraError
from verl_mas.verify import WORKERS_ENV, CheckPool, CheckTimeout, _imported, default_workers, run_check
from verl_mas.workflows.math_tool import answers_match

#: math-verify/sympy evaluate this power tower inside one C call that holds the GIL and practically never returns.
TOWER = "9^{9^{9^{9}}}"

#: Deadline used in these tests (short, to keep them fast; the workflows default to MATCH_TIMEOUT_S = 10 s).
DEADLINE_S = 1.5

#: Upper bound on the time a deadline takes to fire: pebble looks every 0.1 s and SIGTERM kills at once
#: (SIG_DFL); 3 s leaves room for a loaded 2-core machine.
SLACK_S = 3.0


@pytest.fixture
def pool():
    p = CheckPool(workers=1)
    yield p
    p.shutdown()


async def _max_tick_gap(work: Awaitable[Any]) -> tuple[Any, float]:
    """Await ``work`` while a ticker sleeps 10 ms at a time; return (outcome, longest gap between ticks).

    The outcome is the result, or the exception raised. A blocked event loop shows as a gap as long as the
    blockage; a responsive one as gaps of ~10 ms.
    """
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        outcome: Any = await asyncio.wait_for(work, 60)  # never hang the suite, whatever breaks
    except Exception as e:  # noqa: BLE001 - returned for the test to assert on
        outcome = e
    done.set()
    await tick
    return outcome, max(gaps)


async def test_pathological_answer_is_killed_at_the_deadline_while_the_loop_keeps_ticking(pool) -> None:
    # Starting the pool (forkserver, worker) happens off the loop too; then only the check itself is timed.
    _, start_gap = await _max_tick_gap(pool.run(os.getpid, timeout_s=30))
    assert start_gap < 0.5
    start = time.monotonic()
    outcome, gap = await _max_tick_gap(pool.run(answers_match, TOWER, "1", timeout_s=DEADLINE_S))
    elapsed = time.monotonic() - start
    assert isinstance(outcome, CheckTimeout), outcome
    assert outcome.timeout_s == DEADLINE_S and "answers_match ran past its 1.5 s deadline" in str(outcome)
    assert DEADLINE_S - 0.1 <= elapsed < DEADLINE_S + SLACK_S
    # The loop ticked throughout: 10 ms sleeps, never held for half of the 1.5 s the check ran (a thread holds it
    # for all of it: the control below). Half, not a fixed 0.5 s: a loaded machine delays ticks too.
    assert gap < 0.5 * DEADLINE_S


def _timed_pow() -> float:
    start = time.perf_counter()
    pow(7, 3_000_000)  # one C call that holds the GIL (~0.8 s on a 2024 laptop core)
    return time.perf_counter() - start


async def test_negative_control_the_same_kind_of_work_in_a_thread_stalls_the_loop() -> None:
    # What the workflow did before: a worker thread. Big-integer arithmetic holds the GIL for the whole
    # C call, so the loop cannot tick for about as long as the call runs, and no wait_for can fire.
    duration, gap = await _max_tick_gap(asyncio.to_thread(_timed_pow))
    assert duration > 0.2 and gap >= 0.5 * duration
    # Through the pool, the same work leaves the loop ticking.
    _, pool_gap = await _max_tick_gap(run_check(pow, 7, 3_000_000, timeout_s=60))
    assert pool_gap < max(0.5, 0.5 * duration)


@pytest.mark.parametrize(("pred", "gold"), [("1/2", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\frac{1}{2}", "1/2")])
async def test_equivalent_answers_still_match_through_the_default_pool(pred: str, gold: str) -> None:
    assert await run_check(answers_match, pred, gold, timeout_s=30) is True
    assert await run_check(answers_match, "1/3", gold, timeout_s=30) is False  # negative control


async def test_workers_are_reused_and_a_killed_worker_is_replaced_warm(pool) -> None:
    first = await pool.run(os.getpid, timeout_s=30)
    assert first != os.getpid()  # a separate process
    assert await pool.run(os.getpid, timeout_s=30) == first  # reused, not one process per check
    # colorsys: a stdlib module nothing here imports. A fresh worker does not have it (negative control);
    # once the pool has run one of its functions, a replacement worker imports it before its first task.
    assert await pool.run(_imported, "colorsys", timeout_s=30) is False
    assert await pool.run(__import__("colorsys").rgb_to_hsv, 1.0, 0.0, 0.0, timeout_s=30) == (0.0, 1.0, 1.0)
    # math_tool imports math-verify lazily; its warm-up hook (run before a worker's first task) imports it.
    assert await pool.run(_imported, "math_verify", timeout_s=30) is False
    assert await pool.run(answers_match, "1/2", "0.5", timeout_s=30) is True

    with pytest.raises(CheckTimeout):
        await pool.run(time.sleep, 60, timeout_s=0.5)
    second = await pool.run(os.getpid, timeout_s=30)
    assert second != first  # the timed-out worker was replaced
    assert await pool.run(_imported, "colorsys", timeout_s=30) is True  # warm: preloaded
    assert await pool.run(_imported, "math_verify", timeout_s=30) is True  # and math_tool's hook ran
    assert not _alive(first, wait_s=10.0)  # killed and reaped, not left running (or a zombie)


def _alive(pid: int, wait_s: float) -> bool:
    """Whether ``pid`` is still a live process (zombies count as dead) after waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            live = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            live = False
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.1)


async def test_a_crashed_worker_is_an_infra_error_not_a_verdict_and_the_pool_recovers(pool) -> None:
    with pytest.raises(InfraError, match=r"died with exit code 3 .*not a verdict on the model's output"):
        await pool.run(exec, "import os; os._exit(3)", timeout_s=30)
    assert isinstance(await pool.run(os.getpid, timeout_s=30), int)  # a new worker took over


async def test_exceptions_of_the_check_are_reraised_as_is(pool) -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        await pool.run(int, "x", timeout_s=30)
    # The check's own TimeoutError is its exception, not the pool's deadline.
    with pytest.raises(TimeoutError, match="its own") as e:
        await pool.run(exec, "raise TimeoutError('its own')", timeout_s=30)
    assert not isinstance(e.value, CheckTimeout)


async def test_cancelling_the_await_kills_the_running_check(pool) -> None:
    first = await pool.run(os.getpid, timeout_s=30)
    task = asyncio.ensure_future(pool.run(time.sleep, 60, timeout_s=120))
    await asyncio.sleep(0.5)  # let the worker start it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    start = time.monotonic()
    assert await pool.run(os.getpid, timeout_s=30) != first  # replaced, not waiting out the 60 s sleep
    assert time.monotonic() - start < 10


async def test_bad_arguments_are_rejected(pool, monkeypatch) -> None:
    with pytest.raises(ValueError, match="timeout_s is 0"):
        await pool.run(os.getpid, timeout_s=0)
    with pytest.raises(ValueError, match="start_method is 'fork'.*copy the caller's"):
        CheckPool(start_method="fork")
    with pytest.raises(ValueError, match="workers is 0"):
        CheckPool(workers=0)
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers() == 3
    monkeypatch.setenv(WORKERS_ENV, "none")
    with pytest.raises(ValueError, match=f"{WORKERS_ENV} is 'none'; it must be an int >= 1"):
        default_workers()
    monkeypatch.delenv(WORKERS_ENV)
    assert 1 <= default_workers() <= 4
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await pool.run(os.getpid, timeout_s=30)


async def test_a_function_of_the_main_module_is_refused_at_once(pool) -> None:
    # The workers do not import __main__, so they could not unpickle such a function: refused before it is sent.
    def check() -> int:
        return 1

    check.__module__ = "__main__"  # what a function defined in a script, on stdin or in a notebook has
    with pytest.raises(ValueError, match=r"check is defined in the main module .* Move it into an importable module"):
        await pool.run(check, timeout_s=30)
    assert isinstance(await pool.run(os.getpid, timeout_s=30), int)  # negative control: an importable function runs


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_do_not_import_the_callers_main_module(start_method: str) -> None:
    # A script on stdin (`python -`), no __main__ guard. A worker that re-created the main module would look for
    # the file "<stdin>" and die before its first task (every check: "All workers expired"), or, for a script
    # file, run the script's module-level code again.
    script = textwrap.dedent(
        f"""
        import asyncio, json, os
        from verl_mas.verify import CheckPool

        print("the script body ran")
        pool = CheckPool(workers=1, start_method={start_method!r})
        pid = asyncio.run(pool.run(os.getpid, timeout_s=30))
        print(json.dumps({{"worker": pid, "script": os.getpid()}}))
        """
    )
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("the script body ran") == 1, done.stdout[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["worker"] != out["script"]  # the check ran, in a worker process


def test_the_pool_shuts_down_at_interpreter_exit(tmp_path) -> None:
    # A fresh interpreter uses the default pool, leaves a check stuck in a worker and exits: it must exit
    # promptly (no hang) and leave no worker behind.
    script = textwrap.dedent(
        """
        import asyncio, json, multiprocessing.forkserver, os, time
        from verl_mas.verify import check_pool, run_check

        async def main():
            pids = {await run_check(os.getpid, timeout_s=30) for _ in range(8)}
            check_pool()._get().schedule(time.sleep, args=(600,))  # a check still running at exit
            await asyncio.sleep(0.5)
            print(json.dumps({"workers": sorted(pids),
                              "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid}))

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    path = tmp_path / "uses_pool.py"
    path.write_text(script)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 30
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["workers"] and os.getpid() not in info["workers"]
    for pid in info["workers"]:
        assert not _alive(pid, wait_s=10.0), f"check worker {pid} outlived its interpreter"
    assert not _alive(info["forkserver"], wait_s=10.0)


def test_a_crashed_check_worker_aborts_a_math_episode_instead_of_scoring_no_match(monkeypatch) -> None:
    # The math workflow's checks really crash their worker here (os._exit in the pool). A silent "no match"
    # would train the reasoner on reward 0.2 for a right answer; an aborted episode is never trained on.
    from verl_mas.testing import ScriptedLLM, run_workflow
    from verl_mas.workflows import math_tool

    async def crashing_check(fn, *args, timeout_s):  # noqa: ANN001, ANN202
        return await run_check(exec, "import os; os._exit(3)", timeout_s=timeout_s)

    monkeypatch.setattr(math_tool, "run_check", crashing_check)
    task = {"id": "half", "source": "test", "problem": "Compute 1/3 + 1/6.", "answer": "\\frac{1}{2}"}
    ep = run_workflow(math_tool.MathSingleWorkflow, task, llm=ScriptedLLM({"reasoner": "\\boxed{1/2}"}), branching=1)
    assert ep.aborted and "InfraError" in ep.error and "died with exit code 3" in ep.error
    # Negative control: the real check scores the same reply as a match.
    monkeypatch.undo()
    ok = run_workflow(math_tool.MathSingleWorkflow, task, llm=ScriptedLLM({"reasoner": "\\boxed{1/2}"}), branching=1)
    assert not ok.aborted and ok.turns[0][0].rewards == pytest.approx([2.0])
