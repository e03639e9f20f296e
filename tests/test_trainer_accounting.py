"""The mas trainer's accounting of a step: every episode counted, raising episodes stop the run."""

from __future__ import annotations

import inspect
from collections import defaultdict

import numpy as np
import pytest

from verl_mas.config import MasConfig
from verl_mas.trainer import SampledPrompts, assign_groups, mas_metrics, tune_replay_buffer


def _rows(episode: str, *, success: float | None, aborted: bool, turns: int) -> list[tuple[str, dict]]:
    metrics = {"mas/aborted": float(aborted)}
    if success is not None:
        metrics["mas/success"] = success
    rows = []
    for t in range(turns):
        for k in range(2):
            rows.append((episode, {"mas_role": "r", "mas_turn": t, "mas_reward": float(k), "mas_prompt_hash": t,
                                   "mas_episode_index": len(rows), "mas_episode_metrics": metrics}))
    return rows


def test_rates_count_every_episode_of_the_step() -> None:
    # 4 tasks were sampled (rollout.n = 1): a success, a failure, an episode aborted after one turn (the
    # workflow never set mas/success) and one aborted before any sample (no row at all).
    rows = (_rows("a_0", success=1.0, aborted=False, turns=2) + _rows("b_0", success=0.0, aborted=False, turns=3)
            + _rows("c_0", success=None, aborted=True, turns=1))
    episodes = [e for e, _ in rows]
    extras = [x for _, x in rows]
    uids = [e.split("_")[0] for e in episodes]
    padding = np.zeros(len(rows), dtype=bool)
    groups = assign_groups(extras, uids, padding, MasConfig(branching=2), episodes=episodes)
    out = mas_metrics(extras, groups, padding, uids, episodes, expected_episodes=4)
    # success over all 4 episodes: 1/4 (dropping aborted ones would give 1/2, dropping c and d: 1/2);
    # over the two that ran to their end: 1/2. Aborted: c and d, 2/4.
    assert out["mas/success_rate"] == 0.25 and out["mas/success_rate_completed"] == 0.5
    assert out["mas/aborted"] == 0.5 and out["mas/episodes"] == 4.0 and out["mas/episodes_without_samples"] == 1.0
    # Without the replay buffer's count the rate is over the episodes seen (3): 1/3, never 1/2.
    assert mas_metrics(extras, groups, padding, uids, episodes)["mas/success_rate"] == pytest.approx(1 / 3)


class _Buffer:
    """The two members of verl's ReplayBuffer the mas trainer wraps (checked against verl below)."""

    def __init__(self) -> None:
        self.failure_keys: dict[str, set] = defaultdict(set)
        self.poll_interval = 2.0
        self.materialized: list[list[str]] = []

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict):
        self.materialized.append(list(selected_prompt_uids))
        return "batch"


def test_a_raising_episode_stops_the_step_and_every_sampled_task_is_recorded() -> None:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    # Pinned to verl 0.9.1: the wrapped method and the failure bookkeeping exist with these names.
    assert list(inspect.signature(ReplayBuffer._materialize_batch).parameters) == [
        "self", "partition_id", "selected_prompt_uids", "partition_snapshot"]
    assert "self.failure_keys" in inspect.getsource(ReplayBuffer.__init__)

    buffer, sampled = _Buffer(), {}
    tune_replay_buffer(buffer, MasConfig(replay_poll_interval_s=0.3), sampled)
    assert buffer.poll_interval == 0.3
    assert buffer._materialize_batch("train", ["u1", "u2"], {}) == "batch"
    assert sampled["train"] == SampledPrompts(uids=["u1", "u2"], failed=[])
    buffer.failure_keys["val"].add("v2")
    with pytest.raises(RuntimeError, match=r"1 of 2 val tasks raised in the mas agent loop \(task uids \['v2'\]\)"):
        buffer._materialize_batch("val", ["v1", "v2"], {})
    assert buffer.materialized == [["u1", "u2"]]  # the failed batch never reached training or validation
