"""The mas trainer's accounting of a step: every episode counted, raising episodes stop the run."""

from __future__ import annotations

import inspect
from collections import defaultdict

import numpy as np
import pytest

from verl_mas.config import MasConfig
from verl_mas.rows import CandidateRow
from verl_mas.trainer import SampledPrompts, assign_groups, mas_metrics, tune_replay_buffer


def _rows(episode: str, *, success: float | None, aborted: bool, turns: int) -> list[tuple[str, CandidateRow]]:
    metrics = {"mas/aborted": float(aborted)}
    if success is not None:
        metrics["mas/success"] = success
    rows = []
    for t in range(turns):
        for k in range(2):
            rows.append((episode, CandidateRow(
                workflow="w", role="r", turn=t, policy="default", reward=float(k), team_reward=float("nan"),
                local_reward=float("nan"), committed=k == 0, prompt_hash=t,
                episode_index=len(rows), episode_metrics=metrics)))
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
    out = mas_metrics(extras, groups, padding, episodes, expected_episodes=4)
    # success over all 4 episodes: 1/4 (dropping aborted ones would give 1/2, dropping c and d: 1/2);
    # over the two that ran to their end: 1/2. Aborted: c and d, 2/4.
    assert out["mas/success_rate"] == 0.25 and out["mas/success_rate_completed"] == 0.5
    assert out["mas/aborted"] == 0.5 and out["mas/episodes"] == 4.0 and out["mas/episodes_without_samples"] == 1.0
    # Without the replay buffer's count the rate is over the episodes seen (3): 1/3, never 1/2.
    assert mas_metrics(extras, groups, padding, episodes)["mas/success_rate"] == pytest.approx(1 / 3)


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


def _row(role: str, reward: float, *, committed: bool, team: float = float("nan"), local: float = float("nan"),
         index: int = 1) -> CandidateRow:
    return CandidateRow(workflow="w", role=role, turn=0, policy="default", reward=reward, team_reward=team,
                        local_reward=local, committed=committed, prompt_hash=0,
                        episode_index=index, episode_metrics={"mas/success": 0.0})


def test_per_role_metrics_split_the_reward_and_follow_the_committed_candidates() -> None:
    rows = [_row("a", 1.0, committed=True, team=1.0, local=0.0, index=0), _row("a", 0.0, committed=False, team=0.0,
            local=0.0), _row("b", 0.5, committed=True)]
    padding = np.zeros(3, dtype=bool)
    groups = assign_groups(rows, ["t"] * 3, padding, MasConfig(branching=2))
    out = mas_metrics(rows, groups, padding, ["t_0"] * 3)
    assert (out["mas/a/reward/mean"], out["mas/a/committed_reward/mean"]) == (0.5, 1.0)
    assert (out["mas/a/team_reward/mean"], out["mas/a/local_reward/mean"]) == (0.5, 0.0)
    # A plain reward (no team/local split) has no part metrics; its committed reward is its reward.
    assert (out["mas/b/reward/mean"], out["mas/b/committed_reward/mean"]) == (0.5, 0.5)
    assert "mas/b/team_reward/mean" not in out and "mas/b/local_reward/mean" not in out


def test_the_row_contract_round_trips_and_a_foreign_row_is_named() -> None:
    row = _row("a", 1.0, committed=True, team=1.0, local=0.25)
    extra = row.to_extra_fields()
    assert all(key.startswith("mas_") for key in extra) and len(extra) == 11
    assert CandidateRow.from_extra_fields({**extra, "global_steps": 3}) == row
    # A row another agent loop wrote (verl's own fields only) or one missing a field is refused by name.
    with pytest.raises(ValueError, match=r"lacks the fields \['mas_workflow', 'mas_role'"):
        CandidateRow.from_extra_fields({"global_steps": 3})
    del extra["mas_prompt_hash"]
    with pytest.raises(ValueError, match=r"lacks the fields \['mas_prompt_hash'\]"):
        CandidateRow.from_extra_fields(extra)
