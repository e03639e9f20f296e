"""The ``mas`` trainer mode: verl's synchronous PPO trainer with AT-GRPO groups, checks and per-role metrics.

Selected with ``trainer.v1.trainer_mode=mas`` (registered through ``register_trainer``). It changes one
step of verl's pipeline, the advantage computation:

1. fetch the ``mas_*`` fields the agent loop stored with every candidate;
2. rebuild the token-level scores from each candidate's own reward (verl copies the last output's score
   onto the earlier outputs of a run) and build the group of every row from (task uid, role, turn), per
   ``mas.grouping``, in :mod:`verl_mas.advantage.groups`;
3. check that every member of a group was sampled from one prompt (by prompt hash) and raise with the
   offending groups otherwise: a group mixing prompts has no meaningful baseline;
4. hand the group keys to verl's advantage path as the row index, so ``algorithm.adv_estimator=at_grpo``
   normalises inside them, then restore verl's row uids;
5. log ``mas/<role>/reward/mean``, ``mas/<role>/turns``, ``mas/success_rate``, ``mas/group/*`` and the
   parse/infrastructure failure counts.

The routing table (role -> policy) holds one policy today; the trainer is written against it so that
one model per role can split the batch by policy later.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import open_dict
from tensordict import NonTensorStack, TensorDict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_mas.advantage.at_grpo import ESTIMATOR_NAME
from verl_mas.advantage.groups import group_ids, group_key, group_stats, prompt_mismatches
from verl_mas.config import MasConfig

logger = logging.getLogger(__name__)

TRAINER_MODE = "mas"
_FIELDS = ("uid", "response_mask", "extra_fields")


class GroupPromptMismatchError(RuntimeError):
    """Members of an AT-GRPO group were sampled from different prompts."""


@register_trainer(TRAINER_MODE)
class MasTrainer(PPOTrainerSync):
    """verl's synchronous trainer with AT-GRPO grouping (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        self.mas = MasConfig.from_verl_config(config)
        self._check_algorithm(config)
        # verl compares trainer_mode with the literal "sync" in several places (replay buffer, batch
        # sizes); this mode is synchronous, so it presents itself as "sync" to the base class.
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()
        # verl's replay buffer polls TransferQueue for finished episodes every 2 s; episodes of small
        # workflows finish in well under a second, so the fixed 2 s dominated CPU step times.
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = self.mas.replay_poll_interval_s
        return buffer

    def _check_algorithm(self, config: Any) -> None:
        problems = []
        estimator = config.algorithm.adv_estimator
        if estimator != ESTIMATOR_NAME:
            problems.append(
                f"algorithm.adv_estimator is {estimator!r}, but trainer.v1.trainer_mode=mas builds AT-GRPO groups "
                f"for the {ESTIMATOR_NAME!r} estimator. Set algorithm.adv_estimator={ESTIMATOR_NAME}."
            )
        n = int(config.actor_rollout_ref.rollout.n)
        if self.mas.sampling == "tree" and n != 1:
            problems.append(
                f"actor_rollout_ref.rollout.n is {n}, but mas.sampling=tree samples K={self.mas.branching} candidates "
                "inside each episode; extra sessions would be independent episodes. Set rollout.n=1."
            )
        if self.mas.sampling == "parallel" and n < 2:
            problems.append(
                "mas.sampling=parallel draws K independent episodes per task through verl's rollout.n; set "
                "actor_rollout_ref.rollout.n=K (e.g. 4)."
            )
        if problems:
            raise ValueError("The mas trainer cannot start:\n  - " + "\n  - ".join(problems))

    # ------------------------------------------------------------------------------------------------
    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        """PPO update with mini-batches counted in tasks, as ``actor.ppo_mini_batch_size`` is everywhere in verl.

        verl sizes the update's mini-batches as ``ppo_mini_batch_size * rollout.n`` rows, which assumes one
        row per session. An episode yields a variable number of rows (roles x turns x K candidates), so
        the mini-batch is the rows of ``ppo_mini_batch_size`` tasks: ``train_batch_size /
        ppo_mini_batch_size`` optimiser steps per training step, as in stock verl.
        """
        actor = self.config.actor_rollout_ref.actor
        n = int(self.config.actor_rollout_ref.rollout.n)
        num_mini_batches = max(1, int(self.config.data.train_batch_size) // int(actor.ppo_mini_batch_size))
        world = int(self.config.trainer.n_gpus_per_node) * int(self.config.trainer.nnodes)
        rows = len(batch.keys) // num_mini_batches
        rows -= rows % (world * n)  # every data-parallel rank gets whole mini-batches
        configured = actor.ppo_mini_batch_size
        with open_dict(self.config):
            actor.ppo_mini_batch_size = max(world, rows // n)
        try:
            return super()._update_actor(batch, metrics=metrics)
        finally:
            with open_dict(self.config):
                actor.ppo_mini_batch_size = configured

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(_FIELDS))
        extras: list[dict] = _as_list(data["extra_fields"])
        uids = [str(u) for u in _as_list(data["uid"])]
        response_mask = data["response_mask"]
        padding = np.array([bool(tag.get("is_padding", False)) for tag in batch.tags])
        groups = assign_groups(extras, uids, padding, self.mas)
        keys, ids, rewards, roles, turns = groups.keys, groups.ids, groups.rewards, groups.roles, groups.turns

        # Token-level scores: each row's own reward on its last response token.
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
            batch = super()._compute_advantage(batch, metrics=metrics)
        finally:
            restore = TensorDict({"uid": NonTensorStack(*uids)}, batch_size=len(uids))
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=restore)

        metrics.update(self._mas_metrics(extras, roles, turns, rewards, ids, padding, uids))
        return batch

    def _mas_metrics(
        self,
        extras: list[dict],
        roles: list[str],
        turns: np.ndarray,
        rewards: np.ndarray,
        ids: np.ndarray,
        padding: np.ndarray,
        uids: list[str],
    ) -> dict[str, float]:
        real = ~padding
        out = group_stats(ids[real], rewards[real]).as_metrics()
        by_role: dict[str, list[float]] = defaultdict(list)
        role_turns: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
        parse_failures = 0
        episodes: list[dict[str, float]] = []
        for i in np.flatnonzero(real):
            e = extras[i]
            by_role[roles[i]].append(float(rewards[i]))
            role_turns[roles[i]][uids[i]].add(int(turns[i]))
            parse_failures += bool(e.get("mas_parse_failed", False))
            if int(e.get("mas_episode_index", -1)) == 0:
                episodes.append(e.get("mas_episode_metrics") or {})
        for role, values in sorted(by_role.items()):
            out[f"mas/{role}/reward/mean"] = float(np.mean(values))
            out[f"mas/{role}/turns"] = float(np.mean([len(t) for t in role_turns[role].values()]))
        out["mas/parse_failures"] = float(parse_failures)
        # Episode-level metrics reported by the workflows and the engine, averaged over episodes.
        sums: dict[str, list[float]] = defaultdict(list)
        for ep in episodes:
            for k, v in ep.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    sums[k].append(float(v))
        for k, values in sums.items():
            if k.endswith("_failures"):
                out[k] = float(np.sum(values))  # counts over the batch
            else:
                out[k] = float(np.mean(values))
        if "mas/success" in sums:
            out["mas/success_rate"] = float(np.mean(sums["mas/success"]))
        out["mas/episodes"] = float(len(episodes))
        return out


@dataclass(frozen=True)
class GroupAssignment:
    """The AT-GRPO group of every row of a batch, and the score each row is normalised with."""

    keys: list[str]
    ids: np.ndarray  # (bs,) dense int group ids
    rewards: np.ndarray  # (bs,) float64
    roles: list[str]
    turns: np.ndarray  # (bs,) int64


def assign_groups(extras: list[dict], uids: list[str], padding: np.ndarray, mas: MasConfig) -> GroupAssignment:
    """Group rows by (task uid, role, turn) per ``mas.grouping`` and check one prompt per group.

    Args:
        extras: Each row's ``extra_fields`` as the ``mas`` agent loop wrote them.
        uids: Each row's verl uid (the dataset row, i.e. the task).
        padding: ``(bs,)`` True for rows verl added as padding; each becomes its own (singleton) group.
        mas: The ``mas:`` block.

    Raises:
        GroupPromptMismatchError: A group holds rows sampled from different prompts (tree sampling).
    """
    roles = [e["mas_role"] for e in extras]
    turns = np.array([int(e["mas_turn"]) for e in extras], dtype=np.int64)
    if mas.grouping == "trajectory":
        rewards = np.array([_episode_outcome(e) for e in extras], dtype=np.float64)
    else:
        rewards = np.array([float(e["mas_reward"]) for e in extras], dtype=np.float64)
    keys = [
        f"padding|{i}" if padding[i] else group_key(uids[i], roles[i], int(turns[i]), mas.grouping)
        for i in range(len(uids))
    ]
    ids = group_ids(keys, grouping="trajectory")  # keys are already composite: group by the whole key
    if mas.check_group_prompts and mas.sampling == "tree":
        check_group_prompts(ids, keys, [int(e["mas_prompt_hash"]) for e in extras])
    return GroupAssignment(keys, ids, rewards, roles, turns)


def check_group_prompts(ids: np.ndarray, keys: list[str], hashes: list[int]) -> None:
    """Raise :class:`GroupPromptMismatchError` naming the groups whose rows have different prompt hashes."""
    bad = prompt_mismatches(ids, hashes)
    if not bad:
        return
    examples = []
    for gid in bad:
        rows = np.flatnonzero(ids == gid).tolist()
        examples.append(f"group {keys[rows[0]]!r}: rows {rows} have prompt hashes {[hashes[r] for r in rows]}")
    raise GroupPromptMismatchError(
        "AT-GRPO groups mix different prompts, so their mean reward is not a baseline for any member:\n  "
        + "\n  ".join(examples)
        + "\nEvery (task, role, turn) group must hold the K candidates of ONE prompt. This is a bug in how "
        "group keys were built (or a workflow that generates twice for one role in a turn); "
        "set mas.check_group_prompts=false only to debug it."
    )


def _as_list(values: Any) -> list:
    """Rows of a non-tensor field fetched from TransferQueue (a NonTensorStack or a plain sequence)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _episode_outcome(extra: dict) -> float:
    """The whole-episode reward used by ``grouping: trajectory`` (classic GRPO): the team outcome."""
    metrics = extra.get("mas_episode_metrics") or {}
    if "mas/success" not in metrics:
        raise ValueError(
            f"mas.grouping=trajectory scores every sample with its episode's outcome, but workflow "
            f"{extra.get('mas_workflow')!r} reports no 'mas/success' metric. Set self.metrics['mas/success'] in "
            "the workflow, or use mas.grouping=agent_turn."
        )
    return float(metrics["mas/success"])
