"""The mas trainer's accounting of a step: every episode counted, raising episodes stop the run."""

from __future__ import annotations

import inspect
from collections import defaultdict

import numpy as np
import pytest

from verl_mas.advantage.groups import prompts_per_group
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
    """The members of verl's ReplayBuffer the mas trainer wraps (checked against verl below)."""

    def __init__(self) -> None:
        self.failure_keys: dict[str, set] = defaultdict(set)
        self.poll_interval = 2.0
        self.materialized: list[list[str]] = []
        self.synced = 0
        self.failing: dict[str, set] = {}  # what TransferQueue reports as failed at the next sync

    def _sync_metadata_from_transfer_queue(self) -> None:
        self.synced += 1
        self.failure_keys.clear()
        for partition, keys in self.failing.items():
            self.failure_keys[partition] |= keys

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict):
        self.materialized.append(list(selected_prompt_uids))
        return "batch"


def test_a_raising_episode_stops_the_step_at_once_and_every_sampled_task_is_recorded() -> None:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    # Pinned to verl 0.9.1: the wrapped methods and the failure bookkeeping exist with these names, and the
    # sampling loop refreshes the failure keys through the wrapped sync before it refills or selects anything.
    assert list(inspect.signature(ReplayBuffer._materialize_batch).parameters) == [
        "self", "partition_id", "selected_prompt_uids", "partition_snapshot"]
    assert list(inspect.signature(ReplayBuffer._sync_metadata_from_transfer_queue).parameters) == ["self"]
    assert "self.failure_keys" in inspect.getsource(ReplayBuffer.__init__)
    loop = inspect.getsource(ReplayBuffer.sample)
    assert loop.index("self._sync_metadata_from_transfer_queue()") < loop.index("self.refill_fn(")

    buffer, sampled = _Buffer(), {}
    tune_replay_buffer(buffer, MasConfig(replay_poll_interval_s=0.3), sampled)
    assert buffer.poll_interval == 0.3
    buffer._sync_metadata_from_transfer_queue()
    assert buffer._materialize_batch("train", ["u1", "u2"], {}) == "batch"
    assert sampled["train"] == SampledPrompts(uids=["u1", "u2"], failed=[])
    # A task of the validation partition fails: the next sync raises, naming it (no Ray job here, so no error
    # was recorded: the message points at the worker log), before verl could refill or select anything.
    buffer.failing = {"val": {"v2"}}
    with pytest.raises(RuntimeError, match=r"1 val task\(s\) raised in the mas agent loop:\n  task v2: \(no error "
                                           r"recorded: see the agent-loop worker log"):
        buffer._sync_metadata_from_transfer_queue()
    assert buffer.synced == 2 and buffer.materialized == [["u1", "u2"]]  # the failed batch never went on


def test_the_message_names_each_failed_task_with_its_episodes_own_error() -> None:
    from verl_mas.trainer import failed_tasks_message

    message = failed_tasks_message({"train": ["a", "b", "c", "d"]}, {"a": "LookupError: unknown workflow id 'x'"})
    assert message.startswith("4 train task(s) raised in the mas agent loop (first 3 below):\n"
                              "  task a: LookupError: unknown workflow id 'x'\n  task b: (no error recorded")
    assert "task d" not in message and "never a model mistake" in message


@pytest.mark.slow
def test_an_agent_loop_error_reaches_the_trainer_through_the_jobs_error_log() -> None:
    import asyncio

    import ray

    from verl_mas.error_log import create_error_log, record_error, recorded_errors

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        log = create_error_log()  # held, as the trainer holds it: an actor without a handle is collected  # noqa: F841

        @ray.remote(num_cpus=0)
        class Worker:  # stands in for verl's agent-loop worker (an async Ray actor of the same job)
            async def fail(self, uid: str) -> None:
                try:
                    raise LookupError(f"unknown workflow id 'mine-v0' (task {uid})")
                except LookupError as error:
                    await record_error(uid, error)

        worker = Worker.remote()
        ray.get([worker.fail.remote("u1"), worker.fail.remote("u3")])
        errors = recorded_errors(["u1", "u2", "u3"])
        assert sorted(errors) == ["u1", "u3"] and errors["u1"].startswith("LookupError: unknown workflow id 'mine-v0'")
        buffer, sampled = _Buffer(), {}
        tune_replay_buffer(buffer, MasConfig(), sampled)
        buffer.failing = {"train": {"u1"}}
        with pytest.raises(RuntimeError, match=r"task u1: LookupError: unknown workflow id 'mine-v0' \(task u1\)"):
            buffer._sync_metadata_from_transfer_queue()
        asyncio.run(record_error("u9", ValueError("outside the job")))  # the driver can report too
        assert "u9" in recorded_errors(["u9"])
    finally:
        ray.shutdown()
    # Outside a Ray job: nothing to report to, nothing recorded (no error of its own).
    asyncio.run(record_error("u1", ValueError("x")))
    assert recorded_errors(["u1"]) == {}


def _row(role: str, reward: float, *, committed: bool, team: float = float("nan"), local: float = float("nan"),
         index: int = 1, prompt: int = 0) -> CandidateRow:
    return CandidateRow(workflow="w", role=role, turn=0, policy="default", reward=reward, team_reward=team,
                        local_reward=local, committed=committed, prompt_hash=prompt,
                        episode_index=index, episode_metrics={"mas/success": 0.0})


def test_prompts_per_group_counts_the_states_a_groups_baseline_mixes() -> None:
    # Group 0 holds prompts 7, 7, 9 (two states), group 1 prompts 5, 5 (one): (2 + 1) / 2.
    assert prompts_per_group(np.array([0, 0, 0, 1, 1]), [7, 7, 9, 5, 5]) == 1.5
    assert prompts_per_group(np.array([0, 0, 1, 1]), [3, 3, 3, 3]) == 1.0  # one prompt in two groups: 1 in each
    assert prompts_per_group(np.array([], dtype=np.int64), []) == 0.0
    # In the step's metrics, over the real rows: K=2 independent episodes whose walkers stand apart at turn 0 of
    # role a (prompts 1 and 2), and role b's two members on one prompt; a padding row (verl copies a real row) with
    # a third prompt in role b's group does not count.
    rows = [_row("a", 1.0, committed=True, prompt=1, index=0), _row("a", 0.0, committed=True, prompt=2, index=0),
            _row("b", 0.5, committed=True, prompt=4), _row("b", 0.5, committed=True, prompt=4),
            _row("b", 0.5, committed=True, prompt=8)]
    padding = np.array([False, False, False, False, True])
    parallel = MasConfig(sampling="parallel", branching=1)
    groups = assign_groups(rows, ["t"] * 5, padding, parallel, episodes=["t_0", "t_1", "t_0", "t_1", "t_1"])
    out = mas_metrics(rows, groups, padding, ["t_0", "t_1", "t_0", "t_1", "t_1"])
    assert out["mas/group/count"] == 2 and out["mas/group/prompts_mean"] == 1.5


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


def test_a_session_sampled_on_two_replicas_is_counted_and_one_without_a_replica_is_not() -> None:
    """mas/rollout/sessions_split: (episode, role) sessions whose rows more than one replica sampled."""
    from dataclasses import replace

    base = _row("a", 0.0, committed=False)
    placed = [("e0", "a", 0), ("e0", "a", 0), ("e0", "b", 1), ("e0", "b", 1),  # two sessions, each on one replica
              ("e1", "a", 1), ("e1", "a", 0),  # one session split over replicas 1 and 0
              ("e1", "b", -1)]  # a backend that does not name its replica: left out
    rows = [replace(base, role=role, replica=replica) for _, role, replica in placed]
    padding = np.zeros(len(rows), dtype=bool)
    groups = assign_groups(rows, ["t"] * len(rows), padding, MasConfig(branching=2))
    out = mas_metrics(rows, groups, padding, [episode for episode, _, _ in placed])
    assert (out["mas/rollout/sessions"], out["mas/rollout/sessions_split"]) == (3.0, 1.0)
    # No row names a replica (a backend without the field): no such metric rather than a vacuous 0.
    unplaced = [replace(r, replica=-1) for r in rows]
    assert "mas/rollout/sessions_split" not in mas_metrics(unplaced, groups, padding, ["e"] * len(rows))


def test_the_row_contract_round_trips_and_a_foreign_row_is_named() -> None:
    row = _row("a", 1.0, committed=True, team=1.0, local=0.25)
    extra = row.to_extra_fields()
    assert all(key.startswith("mas_") for key in extra) and len(extra) == 12
    assert CandidateRow.from_extra_fields({**extra, "global_steps": 3}) == row
    # A row another agent loop wrote (verl's own fields only) or one missing a field is refused by name.
    with pytest.raises(ValueError, match=r"lacks the fields \['mas_workflow', 'mas_role'"):
        CandidateRow.from_extra_fields({"global_steps": 3})
    del extra["mas_prompt_hash"]
    with pytest.raises(ValueError, match=r"lacks the fields \['mas_prompt_hash'\]"):
        CandidateRow.from_extra_fields(extra)


def _grow(role: str, turn: int, reward: float, *, success: float = 0.0, prompt: int = 0) -> CandidateRow:
    return CandidateRow(workflow="w", role=role, turn=turn, policy="default", reward=reward, team_reward=float("nan"),
                        local_reward=float("nan"), committed=False, prompt_hash=prompt, episode_index=0,
                        episode_metrics={"mas/success": success})


def test_zero_variance_drop_keeps_every_group_with_variance_and_drops_exactly_the_others() -> None:
    from verl_mas.trainer import rows_to_drop

    # (task, role, turn) groups of a hand-built batch (rows interleaved, as verl's batches are):
    #   t1|a|0: rewards 1, 0, 0      -> variance: kept
    #   t1|b|0: rewards 0, 0, 0      -> flat: dropped
    #   t2|a|0: rewards 0.5, 0.5     -> flat (not zero, equal): dropped
    #   t2|a|1: rewards 0.3, 0.3+1e-6 -> variance (above the 1e-8 tolerance): kept
    #   t3|a|0: one member           -> no baseline: dropped (singleton_advantage zero), kept (raw)
    # plus a padding row, which is never dropped here (verl's own rows; the trainer adds padding later).
    spec = [("t1", "a", 0, 1.0), ("t2", "a", 0, 0.5), ("t1", "b", 0, 0.0), ("t1", "a", 0, 0.0), ("t2", "a", 1, 0.3),
            ("t3", "a", 0, 1.0), ("t1", "b", 0, 0.0), ("t2", "a", 0, 0.5), ("t1", "a", 0, 0.0), ("t1", "b", 0, 0.0),
            ("t2", "a", 1, 0.3 + 1e-6), ("t1", "a", 0, 1.0)]
    rows = [_grow(role, turn, reward) for _, role, turn, reward in spec]
    uids = [uid for uid, *_ in spec]
    padding = np.zeros(len(spec), dtype=bool)
    padding[-1] = True
    groups = assign_groups(rows, uids, padding, MasConfig(branching=3))
    expected = [False, True, True, False, False, True, True, True, False, True, False, False]
    dropped, metrics = rows_to_drop(groups, padding, MasConfig(branching=3, drop_zero_variance=True))
    assert dropped.tolist() == expected
    assert metrics == {"mas/drop/rows": 6.0, "mas/drop/groups": 3.0, "mas/drop/row_frac": 6 / 11,
                       "mas/drop/rows_kept": 5.0, "mas/drop/no_signal": 0.0}
    raw, _ = rows_to_drop(groups, padding, MasConfig(branching=3, drop_zero_variance=True, singleton_advantage="raw"))
    assert raw.tolist() == [e and i != 5 for i, e in enumerate(expected)]
    # Negative control: a filter on the row's own reward (drop the zero-reward rows) instead of its group's
    # spread would keep the flat 0.5 group and drop members of the kept groups; the expectation catches it.
    assert [r.reward == 0.0 for r in rows] != expected

    # Nothing with signal: every row leaves (no log-prob, no optimiser step: Adam would still move the weights
    # on zero gradients through its momentum), and the step says so.
    flat = [_grow("a", 0, 0.0), _grow("a", 0, 0.0)]
    none, metrics = rows_to_drop(assign_groups(flat, ["t", "t"], np.zeros(2, dtype=bool), MasConfig(branching=2)),
                                 np.zeros(2, dtype=bool), MasConfig(branching=2, drop_zero_variance=True))
    assert none.tolist() == [True, True] and metrics["mas/drop/no_signal"] == 1.0 and metrics["mas/drop/rows"] == 2
    assert metrics["mas/drop/rows_kept"] == 0
    # Per policy: a policy none of whose groups has signal loses all its rows (it takes no step), the other
    # policy keeps exactly its groups with signal. "q" serves t2|a|0 (flat) and t3 (singleton), "p" the rest.
    all_flat_q = ["q" if uid == "t2" and turn == 0 or uid == "t3" else "p" for uid, _, turn, _ in spec]
    kept_q, metrics = rows_to_drop(groups, padding, MasConfig(branching=3, drop_zero_variance=True), policies=all_flat_q)
    assert kept_q.tolist() == expected and not any(p == "q" and not d for p, d, pad in
                                                    zip(all_flat_q, kept_q, padding) if not pad)
    assert metrics["mas/drop/no_signal"] == 1.0
    # Negative control: with the old rule (a policy without signal keeps its rows) q's rows would stay.
    assert [e and all_flat_q[i] == "p" for i, e in enumerate(expected)] != kept_q.tolist()


def test_flat_means_exactly_what_the_estimator_zeroes() -> None:
    import torch

    from verl_mas.advantage.at_grpo import at_grpo_advantages
    from verl_mas.advantage.groups import group_stats, signal_rows
    from verl_mas.trainer import rows_to_drop

    # Rewards 0.3 and 0.3 + 1e-9: the estimator's (r - mean) / (std + 1e-6) gives them -+0.0007, not 0, so the
    # group has signal; the drop and mas/group/zero_std_frac must agree (a tolerance of 1e-8 called it flat).
    # Hand: centred -+5e-10, unbiased std sqrt(2 * 2.5e-19) = 7.07e-10, adv = -+5e-10 / (7.07e-10 + 1e-6).
    rows = [_grow("a", 0, 0.3), _grow("a", 0, 0.3 + 1e-9), _grow("b", 0, 0.5), _grow("b", 0, 0.5)]
    groups = assign_groups(rows, ["t"] * 4, np.zeros(4, dtype=bool), MasConfig(branching=2))
    adv = at_grpo_advantages(torch.tensor(groups.rewards), groups.ids).tolist()
    assert adv[0] == pytest.approx(-5e-10 / (7.0710678e-10 + 1e-6), rel=1e-3) and adv[2:] == [0.0, 0.0]
    dropped, _ = rows_to_drop(groups, np.zeros(4, dtype=bool), MasConfig(branching=2, drop_zero_variance=True))
    assert dropped.tolist() == [False, False, True, True]
    assert group_stats(groups.ids, groups.rewards).zero_std_frac == 0.5
    # Property over random batches with ties and near-ties: a row the drop calls signal-free has advantage
    # exactly 0 in the estimator, and every row with a non-zero advantage is kept.
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 6, size=24)
        scores = rng.choice([0.0, 1.0, 0.3, 0.3 + 1e-9, 0.3 + 1e-12], size=24)
        keep = signal_rows(ids, scores)
        a = at_grpo_advantages(torch.tensor(scores), ids).numpy()
        assert (a[~keep] == 0).all() and keep[a != 0].all()


def test_trajectory_grpo_scores_each_role_with_its_return_or_the_team_outcome() -> None:
    # Two episodes of task u (parallel sampling, one candidate per node), roles a and b, two turns each:
    #   episode 0: a's rewards 0.5, 1.0 (return 1.5), b's 0.0, 0.2 (0.2); success 1
    #   episode 1: a's rewards 0.0, 0.5 (return 0.5), b's 0.2, 0.0 (0.2); success 0
    spec = [(0, "a", 0, 0.5), (0, "a", 1, 1.0), (0, "b", 0, 0.0), (0, "b", 1, 0.2),
            (1, "a", 0, 0.0), (1, "a", 1, 0.5), (1, "b", 0, 0.2), (1, "b", 1, 0.0)]
    rows = [_grow(role, turn, reward, success=1.0 - ep, prompt=10 * ep + turn) for ep, role, turn, reward in spec]
    episodes = [f"u_{ep}" for ep, *_ in spec]
    padding = np.zeros(len(spec), dtype=bool)
    mas = dict(grouping="trajectory", sampling="parallel", branching=1)
    ret = assign_groups(rows, ["u"] * 8, padding, MasConfig(**mas), episodes=episodes)
    assert ret.rewards.tolist() == pytest.approx([1.5, 1.5, 0.2, 0.2, 0.5, 0.5, 0.2, 0.2])
    # Groups are (task, role): a's two episodes, b's two episodes.
    assert len(set(ret.ids.tolist())) == 2 and ret.ids[0] == ret.ids[4] != ret.ids[2] == ret.ids[6]
    success = assign_groups(rows, ["u"] * 8, padding, MasConfig(**mas, trajectory_reward="success"), episodes=episodes)
    assert success.rewards.tolist() == [1.0] * 4 + [0.0] * 4
    # Under return, b's group is flat (0.2 both times: dropped), a's has signal; under success both have signal.
    from verl_mas.trainer import rows_to_drop

    dropped, _ = rows_to_drop(ret, padding, MasConfig(**mas, drop_zero_variance=True))
    assert dropped.tolist() == [False, False, True, True, False, False, True, True]
    dropped, _ = rows_to_drop(success, padding, MasConfig(**mas, trajectory_reward="success", drop_zero_variance=True))
    assert not dropped.any()


def test_zero_variance_drop_under_trajectory_grouping_counts_episodes_not_rows() -> None:
    from verl_mas.trainer import rows_to_drop

    # Classic GRPO (trajectory groups, parallel sampling): every row scores its episode's outcome.
    # Task u1: episodes 0 (success) and 1 (failure) -> kept; u2: both fail -> dropped; u3: one episode of
    # three rows -> one member, no baseline: dropped (zero), kept (raw), though its rows are three.
    spec = [("u1", 0, 1.0), ("u1", 0, 1.0), ("u1", 1, 0.0), ("u2", 0, 0.0), ("u2", 1, 0.0), ("u3", 0, 1.0),
            ("u3", 0, 1.0), ("u3", 0, 1.0)]
    rows = [_grow("a", turn, 0.0, success=success, prompt=turn) for turn, (_, _, success) in enumerate(spec)]
    uids = [u for u, *_ in spec]
    episodes = [f"{u}_{e}" for u, e, _ in spec]
    padding = np.zeros(len(spec), dtype=bool)
    mas = dict(grouping="trajectory", sampling="parallel", branching=1, trajectory_reward="success")
    groups = assign_groups(rows, uids, padding, MasConfig(**mas), episodes=episodes)
    dropped, _ = rows_to_drop(groups, padding, MasConfig(**mas, drop_zero_variance=True))
    assert dropped.tolist() == [False, False, False, True, True, True, True, True]
    raw, _ = rows_to_drop(groups, padding, MasConfig(**mas, drop_zero_variance=True, singleton_advantage="raw"))
    assert raw.tolist() == [False, False, False, True, True, False, False, False]
