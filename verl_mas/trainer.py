"""The ``mas`` trainer mode: one AT-GRPO step inside verl's synchronous PPO trainer.

Selected with ``trainer.v1.trainer_mode=mas`` (registered through ``register_trainer``). At start-up it
checks the whole run config in one pass and adapts verl's config (:mod:`verl_mas.startup`). In every
step it changes verl's advantage computation:

1. fetch the :class:`verl_mas.rows.CandidateRow` the agent loop stored with every candidate;
2. rebuild the token-level scores from each candidate's own reward (verl copies the last output's score
   onto the earlier outputs of a run) and build the group of every row from (task uid, role, turn), per
   ``mas.grouping``, in :mod:`verl_mas.advantage.groups`;
3. check, on the rows' own fields, what the grouping and sampling imply (one task, role and turn per
   group, one prompt per tree node, ...) and raise with the offending groups otherwise: a group mixing
   prompts has no meaningful baseline;
4. hand the group keys to verl's advantage path as the row index, so ``algorithm.adv_estimator=at_grpo``
   normalises inside them, then restore verl's row uids;
5. log ``mas/<role>/reward/mean``, ``mas/<role>/turns``, ``mas/success_rate`` (over every episode of the
   step), ``mas/group/*`` and the parse/infrastructure failure counts.

It also pads each batch so that verl's PPO update takes stock verl's number of mini-batches whatever the
row count (:mod:`verl_mas.minibatch`) and stops a step in which an episode raised instead of training on
the rest. Several policies (one model or one LoRA adapter per role) are the business of
:class:`verl_mas.policies.stacks.MultiPolicyTrainer`, mixed in: with one policy its hooks are verl's own.

Why one module of ~500 lines: the hooks, the group assignment, the per-step metrics and the zero-variance
drop (:func:`rows_to_drop`, :func:`kept_rows_metrics`) each decide which rows of one step count where; kept
together, the whole row accounting of a step reads top to bottom in one place.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import open_dict
from tensordict import NonTensorStack, TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_mas.advantage.groups import (
    MEMBER_SEP,
    group_ids,
    group_invariant_problems,
    group_key,
    group_stats,
    prompts_per_group,
    signal_rows,
)
from verl_mas.config import MasConfig
from verl_mas.error_log import create_error_log, recorded_errors
from verl_mas.minibatch import ROWS_BEFORE_DROP_TAG, actor_dp_size, required_batch_multiple, update_mini_batch_size
from verl_mas.policies.stacks import MultiPolicyTrainer
from verl_mas.rows import CandidateRow, rows_from_verl
from verl_mas.startup import check_run_config, prepare_verl_config

logger = logging.getLogger(__name__)

TRAINER_MODE = "mas"
_FIELDS = ("uid", "response_mask", "extra_fields")


class GroupPromptMismatchError(RuntimeError):
    """Members of an AT-GRPO group were sampled from different prompts."""


@register_trainer(TRAINER_MODE)
class MasTrainer(MultiPolicyTrainer, PPOTrainerSync):
    """verl's synchronous trainer with AT-GRPO grouping (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        # Every start-up problem (mas: block, algorithm, policy overrides, routing) is reported in one error.
        self.mas, self._policy_configs = check_run_config(config)
        prepare_verl_config(config, self.mas, self._policy_configs)
        self._sampled: dict[str, SampledPrompts] = {}
        self._trained: Any = None  # this step's rows that log-probs and the update run on (see _balance_batch)
        self._dropped_keys: list[str] = []
        self._error_log = create_error_log()  # the agent loops report episodes that raise (verl_mas.error_log)
        super().__init__(config)

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()
        tune_replay_buffer(buffer, self.mas, self._sampled)
        return buffer

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        """PPO update with mini-batches counted in tasks, as ``actor.ppo_mini_batch_size`` is everywhere in verl.

        verl sizes the update's mini-batches as ``ppo_mini_batch_size * rollout.n`` rows, which assumes one
        row per session. An episode yields a variable number of rows (roles x turns x K candidates), so the
        batch is padded to a multiple that splits into stock verl's ``ceil(train_batch_size /
        ppo_mini_batch_size)`` mini-batches of whole per-rank shares (:mod:`verl_mas.minibatch`), and the
        mini-batch size is set for the call to what verl's asserts accept for this batch.
        """
        trained = self._training_rows(batch)
        if trained is not None:  # a frozen policy (mas.policies.<p>.frozen) takes no optimiser step
            self._per_policy(trained, metrics, lambda v, b, m: v._update_policy_actor(b, m), "update_actor",
                             skip=self.mas.frozen_policies)
        return batch

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        # verl's _balance_batch pads each (policy's) batch to this multiple: with it the update below
        # takes stock verl's number of optimiser steps whatever the row count (verl_mas/minibatch.py).
        return required_batch_multiple(self.config, dp_size=dp_size, use_reference_policy=self.use_reference_policy)

    def _update_policy_actor(self, batch: Any, metrics: dict) -> Any:
        # (with several policies ``batch`` holds one policy's rows and ``self`` is that policy's view)
        actor = self.config.actor_rollout_ref.actor
        value = update_mini_batch_size(self.config, batch, dp_size=actor_dp_size(self.actor_rollout_wg))
        configured = actor.ppo_mini_batch_size
        with open_dict(self.config):
            actor.ppo_mini_batch_size = value
        try:
            return super()._update_actor(batch, metrics=metrics)
        finally:
            with open_dict(self.config):
                actor.ppo_mini_batch_size = configured

    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> Any:
        """The step's ``mas/*`` metrics over the whole rollout, then (``mas.drop_zero_variance``) the split into the
        rows that train and the rows without signal, before verl pads, balances and computes any log-prob.

        This is the first hook of verl's step after the rollout (and the colocated reward) with every row in
        hand. With the drop on, only the rows with signal (:func:`rows_to_drop`) are padded, balanced and handed
        to log-probs and the update (``self._trained``); the batch returned (and so the one verl computes its
        data metrics on, dumps and clears at the end of the step) still holds every row, so that
        ``critic/score``, ``response_length``, ``perf/total_num_tokens``, ... describe the whole rollout.
        """
        _, rows, episodes, padding, groups = self._batch_groups(batch, ("uid", "extra_fields"))
        sampled = self._sampled.get("train")
        expected = None if sampled is None else len(sampled.uids) * int(self.config.actor_rollout_ref.rollout.n)
        metrics.update(mas_metrics(rows, groups, padding, episodes, expected_episodes=expected))
        dropped, drop_metrics = rows_to_drop(groups, padding, self.mas, policies=[r.policy for r in rows])
        metrics.update(drop_metrics)
        self._trained, self._dropped_keys = batch, []
        if not self.mas.drop_zero_variance:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        keys = list(batch.keys)
        self._dropped_keys = [k for k, d in zip(keys, dropped, strict=True) if d]
        rest = batch.select_keys(self._dropped_keys)
        kept_rows = {k: r for k, r, d in zip(keys, rows, dropped, strict=True) if not d}
        if not kept_rows:  # no policy has signal: no log-prob, no optimiser step this step (mas/drop/no_signal)
            self._trained, self._policy_keys = None, {}
            rest.extra_info = dict(batch.extra_info or {})
            return rest
        trained = batch.select_keys(list(kept_rows))
        # The update takes fewer mini-batches of the size it would have had (verl_mas.minibatch.dropped_rows_steps);
        # each kept row carries its policy's row count before the drop (verl's padding copies a real row's tags).
        before = Counter(r.policy for r, pad in zip(rows, padding, strict=True) if not pad)
        for key, tag in zip(trained.keys, trained.tags, strict=True):
            tag[ROWS_BEFORE_DROP_TAG] = before[kept_rows[key].policy]
        trained.extra_info = dict(batch.extra_info or {})
        trained = super()._balance_batch(trained, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        self._trained = trained
        if not self._dropped_keys:
            return trained
        full = type(batch).concat([trained, rest])
        full.extra_info = dict(batch.extra_info or {})
        return full

    def _training_rows(self, batch: Any) -> Any:
        """The rows of ``batch`` that log-probs and the update run on: all of them, or (``mas.drop_zero_variance``)
        the balanced rows with signal; None when no row has signal this step."""
        if not self.mas.drop_zero_variance:
            return batch
        return self._trained

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        trained = self._training_rows(batch)
        if trained is not None:
            out: dict = {}
            super()._compute_old_log_prob(trained, metrics=out)
            metrics.update(kept_rows_metrics(out) if self.mas.drop_zero_variance else out)
        return batch

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        trained = self._training_rows(batch)
        if trained is not None:
            super()._compute_ref_log_prob(trained, metrics=metrics)
        return batch

    def _batch_groups(self, batch: Any, fields: Sequence[str]) -> tuple[Any, list[CandidateRow], list[str], np.ndarray,
                                                                          GroupAssignment]:
        """The batch's ``fields`` from TransferQueue (``uid`` and ``extra_fields`` among them), its rows, each row's
        episode, its padding mask and its checked AT-GRPO groups."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(fields))
        rows = rows_from_verl(data["extra_fields"])
        uids = [str(u) for u in _as_list(data["uid"])]
        episodes = [session_of(key) for key in batch.keys]
        padding = np.array([bool(tag.get("is_padding", False)) for tag in batch.tags])
        return data, rows, episodes, padding, assign_groups(rows, uids, padding, self.mas, episodes=episodes)

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        data, _, _, _, groups = self._batch_groups(batch, _FIELDS)
        uids = [str(u) for u in _as_list(data["uid"])]
        response_mask = data["response_mask"]
        keys, rewards = groups.keys, groups.rewards

        # Token-level scores of every row (verl's data metrics read them): each row's own reward on its last
        # response token.
        lengths = response_mask.offsets().diff().tolist()
        scores = [torch.zeros(n, dtype=torch.float32) for n in lengths]
        for row, n in enumerate(lengths):
            if n > 0:
                scores[row][n - 1] = float(rewards[row])
        fields = TensorDict(
            {
                "rm_scores": torch.nested.as_nested_tensor(scores, layout=torch.jagged),
                "uid": NonTensorStack(*keys),
            },
            batch_size=len(keys),
        )
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        try:
            trained = self._training_rows(batch)
            if trained is not None:
                super()._compute_advantage(trained, metrics=metrics)
            if self._dropped_keys:
                # Rows of groups without signal: the estimator's advantage is exactly 0 for each of them
                # (rows_to_drop keeps every row it could give another value), and so is the return.
                dropped = set(self._dropped_keys)
                zeros = [torch.zeros(n, dtype=torch.float32) for k, n in zip(batch.keys, lengths, strict=True)
                         if k in dropped]
                nested = torch.nested.as_nested_tensor(zeros, layout=torch.jagged)
                order = [k for k in batch.keys if k in dropped]
                tq.kv_batch_put(keys=order, partition_id=batch.partition_id,
                                fields=TensorDict({"advantages": nested, "returns": nested.clone()},
                                                  batch_size=len(order)))
        finally:
            restore = TensorDict({"uid": NonTensorStack(*uids)}, batch_size=len(uids))
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=restore)
        return batch


#: Where a metric of verl's log-prob pass is logged when ``mas.drop_zero_variance`` is on: it describes only the
#: rows that trained (log-probs are not computed for the others), so it does not take verl's name, which
#: describes the whole batch in stock verl.
KEPT_PREFIX = "mas/kept/"
_LOG_PROB_METRICS = ("actor/entropy", "training/rollout_probs_diff", "training/rollout_actor_probs_pearson_corr")


def kept_rows_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """verl's log-prob metrics (``actor/entropy``, ``training/rollout_probs_diff_*``, ..., also as
    ``policy/<name>/...``) renamed ``mas/kept/<verl's name>``; the others unchanged."""
    out = {}
    for key, value in metrics.items():
        name = key.split("/", 2)[2] if key.startswith("policy/") and key.count("/") >= 2 else key
        out[KEPT_PREFIX + key if name.startswith(_LOG_PROB_METRICS) else key] = value
    return out


@dataclass(frozen=True)
class SampledPrompts:
    """The prompts (tasks) verl's replay buffer handed to one step, and those whose agent loop raised."""

    uids: list[str]
    failed: list[str]


def tune_replay_buffer(buffer: Any, mas: MasConfig, sampled: dict[str, SampledPrompts]) -> None:
    """Adapt verl's replay buffer to episodes: faster polling, and no episode lost without a trace.

    verl polls TransferQueue for finished episodes every 2 s; episodes of small workflows finish in well
    under a second, so the fixed 2 s dominated CPU step times: ``mas.replay_poll_interval_s`` replaces it.

    verl's sync trainer treats a task whose agent loop raised as a "failure" group: it samples other tasks
    in its place, or stops with a message about refilling failed groups when none is left. An exception in
    the ``mas`` agent loop is a bug or a deterministic server error, never a model mistake, so the step stops
    as soon as the buffer sees a failed task, naming each failed task with its episode's own error
    (:mod:`verl_mas.error_log`). The prompts of every batch are recorded in ``sampled`` (by partition), so
    that the trainer's rates count every episode, including those that left no sample.
    """
    if hasattr(buffer, "poll_interval"):
        buffer.poll_interval = mas.replay_poll_interval_s
    sync = buffer._sync_metadata_from_transfer_queue  # verl 0.9.1: refreshes pending/finished/failure keys
    materialize = buffer._materialize_batch  # verl 0.9.1: (partition_id, selected_prompt_uids, snapshot)

    def checked_sync(*args: Any, **kwargs: Any) -> Any:
        out = sync(*args, **kwargs)
        failed = {p: sorted(keys) for p, keys in buffer.failure_keys.items() if keys}
        if failed:
            raise EpisodeRaisedError(failed_tasks_message(failed, recorded_errors(u for keys in failed.values()
                                                                                   for u in keys)))
        return out

    def recording(partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict) -> Any:
        failed = sorted(set(selected_prompt_uids) & set(buffer.failure_keys[partition_id]))
        sampled[partition_id] = SampledPrompts(uids=list(selected_prompt_uids), failed=failed)
        if failed:  # (checked_sync raises first; kept for a buffer whose sync is not the one wrapped)
            raise EpisodeRaisedError(failed_tasks_message({partition_id: failed}, recorded_errors(failed)))
        return materialize(partition_id, selected_prompt_uids, partition_snapshot)

    buffer._sync_metadata_from_transfer_queue = checked_sync
    buffer._materialize_batch = recording


class EpisodeRaisedError(RuntimeError):
    """An episode raised in the ``mas`` agent loop: the run stops with its error."""


def failed_tasks_message(failed: Mapping[str, Sequence[str]], errors: Mapping[str, str], limit: int = 3) -> str:
    """What + why + fix for tasks whose agent loop raised, each with its episode's error when recorded."""
    lines = []
    for partition, uids in sorted(failed.items()):
        shown = list(uids)[:limit]
        lines.append(f"{len(uids)} {partition} task(s) raised in the mas agent loop"
                     + (f" (first {limit} below)" if len(uids) > limit else "") + ":")
        for uid in shown:
            error = errors.get(uid)
            text = error if error else "(no error recorded: see the agent-loop worker log above for its traceback)"
            lines.append(f"  task {uid}: " + text.replace("\n", "\n    "))
    return (
        "\n".join(lines) + "\nAn episode that raises is a bug in a workflow or a deterministic rollout-server error "
        "(e.g. a request the server rejects), never a model mistake, and is never silently left out: fix the cause "
        "above. Infrastructure failures (a lost replica, a timeout) do not raise: they abort the episode and count "
        "in mas/aborted."
    )


def rows_to_drop(groups: GroupAssignment, padding: np.ndarray, mas: MasConfig,
                 policies: Sequence[str] | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """``mas.drop_zero_variance``: the ``(bs,)`` mask of rows to leave out of log-probs and the update, and
    ``mas/drop/*`` metrics.

    The rows of groups whose advantage is exactly 0 for every member
    (:func:`verl_mas.advantage.groups.signal_rows`; whole groups, so every kept group's baseline is unchanged).
    A policy none of whose groups has signal keeps no row: it takes no optimiser step this step (Adam's
    momentum would move its weights on zero gradients) and needs no log-prob; ``mas/drop/no_signal`` counts
    such policies. With the setting off: nothing, and no metrics.

    Args:
        policies: Each row's policy (default: one policy).
    """
    if not mas.drop_zero_variance:
        return np.zeros(len(padding), dtype=bool), {}
    real = ~padding
    members = None
    if mas.grouping == "trajectory":  # a member is an episode, whose rows (of one role) share one score
        members = [key.rpartition(MEMBER_SEP)[2] if MEMBER_SEP in key else key for key in groups.keys]
    keep = signal_rows(groups.ids, groups.rewards, members=members,
                       keep_singletons=mas.singleton_advantage == "raw") | padding
    dropped = real & ~keep
    owners = np.array(["" for _ in padding] if policies is None else list(policies), dtype=object)
    no_signal = sum(not (keep & real & (owners == p)).any() for p in sorted(set(owners[real].tolist())))
    return dropped, {
        "mas/drop/rows": float(dropped.sum()),
        "mas/drop/groups": float(len(set(groups.ids[dropped].tolist()))),
        "mas/drop/row_frac": float(dropped.sum() / max(1, int(real.sum()))),
        "mas/drop/rows_kept": float((real & ~dropped).sum()),
        "mas/drop/no_signal": float(no_signal),
    }


def session_of(key: str) -> str:
    """The episode of a TransferQueue row key ``{uid}_{session}_{index}``: ``"{uid}_{session}"``."""
    parts = key.rsplit("_", 2)
    return f"{parts[0]}_{parts[1]}" if len(parts) == 3 else key


def mas_metrics(
    rows: Sequence[CandidateRow],
    groups: GroupAssignment,
    padding: np.ndarray,
    episodes: list[str],
    *,
    expected_episodes: int | None = None,
) -> dict[str, float]:
    """Per-role, group and episode metrics of one training batch.

    Rates are over every episode of the step (``expected_episodes``: tasks x rollout.n, from the replay
    buffer) and not only over those whose rows reached the batch: an episode aborted before any sample
    (an infrastructure failure in its first group) leaves no row, and is counted as aborted and as not
    successful (``mas/episodes_without_samples`` counts them). ``mas/success_rate`` counts an aborted
    episode as a failure; ``mas/success_rate_completed`` is the rate over episodes that ran to their end.
    ``mas/rollout/sessions_split`` counts the (episode, role) sessions whose rows more than one rollout replica
    sampled (0 while verl's load balancer keeps each session on its server).
    """
    roles, turns, rewards, ids = groups.roles, groups.turns, groups.rewards, groups.ids
    real = ~padding
    out = group_stats(ids[real], rewards[real]).as_metrics()
    out["mas/group/prompts_mean"] = prompts_per_group(ids[real], [rows[i].prompt_hash for i in np.flatnonzero(real)])
    # Every row's score, as verl's critic/score/mean reads it (before any row is dropped from the update).
    out["mas/reward/mean"] = float(rewards[real].mean()) if real.any() else 0.0
    by_role: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    role_turns: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    per_episode: dict[str, Mapping[str, float]] = {}
    for i in np.flatnonzero(real):
        row = rows[i]
        values = by_role[roles[i]]
        values["reward"].append(float(rewards[i]))
        if row.committed:
            values["committed_reward"].append(float(rewards[i]))
        for part, value in (("team_reward", row.team_reward), ("local_reward", row.local_reward)):
            if math.isfinite(value):  # NaN: the workflow gave a plain reward
                values[part].append(value)
        role_turns[roles[i]][episodes[i]].add(int(turns[i]))
        if row.episode_index == 0:
            per_episode[episodes[i]] = row.episode_metrics
    for role, values in sorted(by_role.items()):
        for name, series in values.items():
            out[f"mas/{role}/{name}/mean"] = float(np.mean(series))
        out[f"mas/{role}/turns"] = float(np.mean([len(t) for t in role_turns[role].values()]))
    # Episode-level metrics reported by the workflows and the engine, averaged over episodes with samples.
    sums: dict[str, list[float]] = defaultdict(list)
    for ep in per_episode.values():
        for k, v in ep.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                sums[k].append(float(v))
    for k, values in sums.items():
        if k.endswith("_failures"):
            out[k] = float(np.sum(values))  # counts over the batch
        else:
            out[k] = float(np.mean(values))
    # Session affinity: the K candidates and the turns of one (episode, role) belong on one replica of its policy
    # (its prefix cache); backends that name the replica that sampled a row let this be checked on every step.
    replicas_of: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i in np.flatnonzero(real):
        if rows[i].replica >= 0:
            replicas_of[(episodes[i], rows[i].role)].add(rows[i].replica)
    if replicas_of:
        out["mas/rollout/sessions"] = float(len(replicas_of))
        out["mas/rollout/sessions_split"] = float(sum(len(r) > 1 for r in replicas_of.values()))
    seen = len(per_episode)
    total = max(seen, expected_episodes or 0)
    missing = total - seen
    aborted = sum(bool(ep.get("mas/aborted", 0.0)) for ep in per_episode.values())
    out["mas/episodes"] = float(total)
    out["mas/episodes_without_samples"] = float(missing)
    out["mas/aborted"] = (aborted + missing) / total if total else 0.0
    out["mas/context_overflow"] = (
        sum(float(ep.get("mas/context_overflow", 0.0)) for ep in per_episode.values()) / total if total else 0.0)
    if "mas/success" in sums:
        # Aborted episodes (with or without samples) count as failures: dropping them would bias the rate
        # upward, since long (mostly failing) episodes are the likeliest to hit a timeout or a lost replica.
        successes = sum(float(ep.get("mas/success", 0.0)) for ep in per_episode.values()
                        if not ep.get("mas/aborted", 0.0))
        completed = [float(ep.get("mas/success", 0.0)) for ep in per_episode.values() if not ep.get("mas/aborted", 0.0)]
        out["mas/success_rate"] = successes / total
        out["mas/success_rate_completed"] = float(np.mean(completed)) if completed else 0.0
    return out


@dataclass(frozen=True)
class GroupAssignment:
    """The AT-GRPO group of every row of a batch, and the score each row is normalised with."""

    keys: list[str]
    ids: np.ndarray  # (bs,) dense int group ids
    rewards: np.ndarray  # (bs,) float64
    roles: list[str]
    turns: np.ndarray  # (bs,) int64


def assign_groups(
    rows: Sequence[CandidateRow], uids: list[str], padding: np.ndarray, mas: MasConfig, *,
    episodes: list[str] | None = None,
) -> GroupAssignment:
    """Group rows per ``mas.grouping`` and check every invariant that grouping and ``mas.sampling`` imply.

    - ``agent_turn`` (AT-GRPO): (task, role, turn); with tree sampling the K members share one prompt.
    - ``agent``: (task, role) across turns; each row keeps its own (role, turn) reward.
    - ``trajectory`` (classic GRPO, with parallel sampling): (task, role) over episodes; every row scores its
      role's return in the episode (``mas.trajectory_reward: return``, the sum of the role's rewards) or the
      episode's outcome (``success``: ``mas/success``); the estimator normalises over the *episodes* (one
      advantage per episode and role, broadcast to its rows), not over rows.

    Args:
        rows: Each row's contract fields, as the ``mas`` agent loop wrote them.
        uids: Each row's verl uid (the dataset row, i.e. the task).
        padding: ``(bs,)`` True for rows verl added as padding; each becomes its own (singleton) group.
        mas: The ``mas:`` block.
        episodes: Each row's episode (``{uid}_{session}``); default: one episode per task.

    Raises:
        GroupPromptMismatchError: A batch breaks what its grouping and sampling imply (rows of different
            prompts in one tree node, several roles or turns in one group, ...).
    """
    episodes = list(uids) if episodes is None else list(episodes)
    roles = [r.role for r in rows]
    turns = np.array([r.turn for r in rows], dtype=np.int64)
    if mas.grouping == "trajectory" and mas.trajectory_reward == "success":
        rewards = np.array([_episode_outcome(r) for r in rows], dtype=np.float64)
    elif mas.grouping == "trajectory":  # the role's return: its rewards summed over the episode
        returns: dict[tuple[str, str], float] = defaultdict(float)
        for i, r in enumerate(rows):
            if not padding[i]:
                returns[(episodes[i], r.role)] += float(r.reward)
        rewards = np.array([returns.get((episodes[i], r.role), float(r.reward)) for i, r in enumerate(rows)],
                           dtype=np.float64)
    else:
        rewards = np.array([r.reward for r in rows], dtype=np.float64)
    keys = [
        f"padding|{i}" if padding[i]
        else group_key(uids[i], roles[i], int(turns[i]), mas.grouping, episode=episodes[i].rpartition("_")[2])
        for i in range(len(uids))
    ]
    # The group of a key (for trajectory keys "<task>|<role>#<episode>": the task and role, as the estimator reads them).
    ids = group_ids([k.rpartition(MEMBER_SEP)[0] if MEMBER_SEP in k else k for k in keys], grouping="trajectory")
    real = np.flatnonzero(~padding)
    problems = group_invariant_problems(
        ids[real], [keys[i] for i in real], grouping=mas.grouping, sampling=mas.sampling,
        task_uids=[uids[i] for i in real], episodes=[episodes[i] for i in real], roles=[roles[i] for i in real],
        turns=turns[real], prompt_hashes=[rows[i].prompt_hash for i in real],
        check_prompts=mas.check_group_prompts,
    )
    if problems:
        raise GroupPromptMismatchError(
            "The batch breaks the invariants of its AT-GRPO groups, so a group's mean reward is not a baseline "
            "for its members:\n  - " + "\n  - ".join(problems) + "\nThis is a bug in how group keys were built "
            "(or a workflow that generates twice for one role in a turn). Row numbers count the batch's "
            "non-padding rows. Set mas.check_group_prompts=false only to debug a prompt mismatch."
        )
    return GroupAssignment(keys, ids, rewards, roles, turns)


def _as_list(values: Any) -> list:
    """Rows of a non-tensor field fetched from TransferQueue (a NonTensorStack or a plain sequence)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _episode_outcome(row: CandidateRow) -> float:
    """The whole-episode reward used by ``grouping: trajectory`` with ``trajectory_reward: success``: the team outcome."""
    if "mas/success" not in row.episode_metrics:
        raise ValueError(
            f"mas.grouping=trajectory with mas.trajectory_reward=success scores every sample with its episode's "
            f"outcome, but workflow {row.workflow!r} reports no 'mas/success' metric. Set "
            "self.metrics['mas/success'] in the workflow, or use mas.trajectory_reward=return."
        )
    return float(row.episode_metrics["mas/success"])


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
