"""Concurrency: many episodes on one loop, K requests in flight together, blocking work off the loop, no cap."""

from __future__ import annotations

import asyncio
import threading

import pytest

from verl_mas import EpisodeConfig, InfraError, Sample, Workflow, fan_out, run_episode, user
from verl_mas.client import start_now
from verl_mas.testing import ScriptedLLM, default_tokenizer
from verl_mas.workflows.toy import WalkWorkflow


async def test_many_episodes_and_all_candidates_are_in_flight_at_once():
    # 64 episodes start together; each first asks the planner for K=4 samples, and every sample request
    # sleeps 50 ms, so with no cap all 64 x 4 = 256 requests are in flight at the same time.
    tok = default_tokenizer()
    llm = ScriptedLLM({"planner": ["right"], "mover": ["right"]}, tokenizer=tok, latency_s=0.05)
    config = EpisodeConfig(branching=4, max_turns=4)
    episodes = await asyncio.gather(
        *(
            run_episode(
                WalkWorkflow,
                {"start": 0, "goal": 1},
                client=llm,
                tokenizer=tok,
                config=config,
                seed=i,
                task_uid=f"t{i}",
            )
            for i in range(64)
        )
    )
    assert llm.peak_in_flight == 256
    assert all(ep.terminated and ep.num_turns == 1 for ep in episodes)
    assert len({g.key for ep in episodes for g in ep.groups}) == 64 * 2  # groups never merge across tasks


async def test_one_group_requests_its_k_candidates_concurrently():
    tok = default_tokenizer()
    llm = ScriptedLLM({"planner": ["right"], "mover": ["right"]}, tokenizer=tok, latency_s=0.02)
    await run_episode(
        WalkWorkflow, {"start": 0, "goal": 1}, client=llm, tokenizer=tok, config=EpisodeConfig(branching=6, max_turns=1)
    )
    assert llm.peak_in_flight == 6


class _Blocking(Workflow):
    """Runs blocking work that can only finish if the event loop keeps running meanwhile."""

    roles = ("solo",)
    done: threading.Event
    barrier: threading.Barrier

    async def run(self, task):
        group = await self.generate("solo", [user("go")])
        # Waits for an event that a coroutine on the loop sets, then for all 16 episodes' threads:
        # a blocked loop, or a pool of fewer than 16 threads (asyncio's default on 2 cores is 6), times out.
        ok = await self.run_blocking(lambda: task["done"].wait(5) and task["barrier"].wait(5) is not None)
        for c in group:
            c.reward = float(ok)
        self.metrics["ok"] = float(ok)


async def test_blocking_work_runs_off_the_event_loop_without_a_small_cap():
    tok = default_tokenizer()
    done, barrier = threading.Event(), threading.Barrier(16)
    llm = ScriptedLLM({"solo": ["x"]}, tokenizer=tok)

    async def release():
        await asyncio.sleep(0.05)
        done.set()

    task = {"done": done, "barrier": barrier}
    *episodes, _ = await asyncio.gather(
        *(
            run_episode(
                _Blocking,
                task,
                client=llm,
                tokenizer=tok,
                config=EpisodeConfig(branching=2, max_turns=1),
                task_uid=f"t{i}",
            )
            for i in range(16)
        ),
        release(),
    )
    assert [ep.metrics["ok"] for ep in episodes] == [1.0] * 16


# --------------------------------------------------------------------------------------------------
# fan_out / start_now: requests are dispatched at once, failures are sorted into infra vs bugs.


async def test_fan_out_dispatches_every_request_before_it_first_waits():
    started, finished = [], []

    async def one(i):
        started.append(i)
        try:
            await asyncio.sleep(0.01)
            if i == 1:
                raise InfraError("HTTP 502")
            return Sample(token_ids=[i])
        finally:
            finished.append(i)

    future = start_now(fan_out(3, one))
    # No await yet: an eager start has already issued all three requests (a plain gather would not have).
    assert started == [0, 1, 2]
    samples = await future
    assert [s.token_ids for s in samples] == [[0], [], [2]]
    assert samples[1].error == "InfraError: HTTP 502" and samples[0].error is None
    assert sorted(finished) == [0, 1, 2]


async def test_fan_out_reraises_bugs_and_propagates_cancellation():
    async def buggy(i):
        if i == 0:
            raise KeyError("bug")  # raised synchronously, before any await: still delivered on await
        return Sample(token_ids=[i])  # finishes without ever suspending

    with pytest.raises(KeyError, match="bug"):
        await fan_out(2, buggy)

    cleaned = []

    async def slow(i):
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(i)

    future = start_now(fan_out(2, slow))
    await asyncio.sleep(0)
    future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await future
    assert sorted(cleaned) == [0, 1]
