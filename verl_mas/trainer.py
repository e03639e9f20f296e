"""The ``mas`` trainer mode: verl's synchronous PPO trainer with AT-GRPO groups, checks and per-role metrics.

Selected with ``trainer.v1.trainer_mode=mas`` (registered through ``register_trainer``). It changes one
step of verl's pipeline, the advantage computation:

1. fetch the ``mas_*`` fields the agent loop stored with every candidate;
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
row count (:mod:`verl_mas.minibatch`), stops a step in which an episode raised instead of training on the
rest, and hands the agent loops a client that gives every candidate its own request id.

With several policies (``mas.policies``, one model or one LoRA adapter per role) the trainer also builds
one actor/rollout stack per extra policy (:mod:`verl_mas.policies`), hands the agent loops a client that
routes each role to its policy's servers, splits every batch by policy for log-probs and updates, syncs
and sleeps every policy's rollout, and saves/loads every policy with the step (the first policy in
``actor/`` as verl does, the others in ``actor_<policy>/``). Metrics of a per-policy computation are
logged as ``policy/<name>/<metric>``; verl's own metric names carry the mean over policies.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
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

from verl_mas.advantage.at_grpo import SINGLETON_KEY
from verl_mas.advantage.groups import (
    MEMBER_SEP,
    group_ids,
    group_invariant_problems,
    group_key,
    group_stats,
)
from verl_mas.config import MAS_TRAINER_MARK, MasConfig, check_run_config
from verl_mas.minibatch import actor_dp_size, required_batch_multiple, update_mini_batch_size
from verl_mas.policies import PolicyRouterClient, PolicyStack, SessionRoutedClient

logger = logging.getLogger(__name__)

TRAINER_MODE = "mas"
_FIELDS = ("uid", "response_mask", "extra_fields")


class GroupPromptMismatchError(RuntimeError):
    """Members of an AT-GRPO group were sampled from different prompts."""


@register_trainer(TRAINER_MODE)
class MasTrainer(PPOTrainerSync):
    """verl's synchronous trainer with AT-GRPO grouping (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        # Every start-up problem (mas: block, algorithm, policy overrides, routing) is reported in one error.
        self.mas, self._policy_configs = check_run_config(config)
        prepare_verl_config(config, self.mas, self._policy_configs)
        self.stacks: dict[str, PolicyStack] = {}
        self._policy_keys: dict[str, list[str]] = {}
        self._resume_folder: str | None = None
        self._last_server_stats: dict[str, dict[str, int]] = {}
        self._sampled: dict[str, SampledPrompts] = {}
        super().__init__(config)

    # ---------------------------------------------------------------------------------------------
    # Several policies: set-up, routing, weight sync, checkpoints
    # ---------------------------------------------------------------------------------------------
    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        # Policies without resources of their own share verl's pool (one process per policy per GPU);
        # verl's default allows 3 colocated groups per bundle.
        needed = len(self.mas.policies) + 1
        if self.resource_pool_manager.max_colocate_count < needed:
            self.resource_pool_manager.max_colocate_count = needed
        for name in self.mas.policy_names[1:]:
            gpus = self.mas.policy_resources(name)
            if gpus is not None:  # created with verl's pools; its GPUs count in verl's availability check
                self.resource_pool_manager.resource_pool_spec[_pool_name(name)] = gpus

    def _setup(self) -> None:
        super()._setup()
        primary = self.mas.policy_names[0]
        self.stacks[primary] = PolicyStack(
            name=primary,
            worker_group=self.actor_rollout_wg,
            ref_worker_group=getattr(self, "ref_policy_wg", None),
            ref_in_actor=self.ref_in_actor,
            server_manager=self.llm_server_manager,
            checkpoint_manager=self.checkpoint_manager,
            pool=self._verl_pool_name(),
        )
        for name in self.mas.policy_names[1:]:
            self.stacks[name] = self._build_policy_stack(name, self._policy_configs[name])
        if self._resume_folder is not None:
            for name in self.mas.policy_names[1:]:
                self.stacks[name].worker_group.load_checkpoint(
                    local_path=os.path.join(self._resume_folder, f"actor_{name}"),
                    del_local_after_load=self.config.trainer.del_local_ckpt_after_load,
                )
                logger.info("policy %s resumed from %s", name, self._resume_folder)

    def _build_policy_stack(self, name: str, arr: Any) -> PolicyStack:
        """One more trainable model: worker group (on verl's pool, or its own with ``resources``), rollout
        replicas, weight sync."""
        import ray
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
        from verl.trainer.ppo.utils import Role
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.engine_workers import ActorRolloutRefWorker
        from verl.workers.rollout.llm_server import LLMServerManager

        lora_rank = arr.model.get("lora", {}).get("rank", 0) or arr.model.get("lora_rank", 0)
        ref_in_actor = lora_rank > 0 or arr.model.get("lora_adapter_path") is not None
        role = Role.ActorRolloutRef if self.use_reference_policy and not ref_in_actor else Role.ActorRollout
        pools = self.resource_pool_manager.resource_pool_dict
        pool_name = _pool_name(name) if _pool_name(name) in pools else self._verl_pool_name()
        pool = pools[pool_name]
        cls = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=arr, role=str(role))
        group = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=create_colocated_worker_cls(class_dict={str(role): cls}),
            device_name=self.config.trainer.device,
        )
        worker_group = group.spawn(prefix_set=[str(role)])[str(role)]
        worker_group.init_model()
        full = copy.deepcopy(self.config)
        with open_dict(full):
            full.actor_rollout_ref = arr
        server_manager = LLMServerManager.create(config=full, worker_group=worker_group, rollout_resource_pool=pool)
        engine_config = omega_conf_to_dataclass(arr.rollout.checkpoint_engine)
        engine_config.backend = "naive"
        checkpoint_manager = CheckpointEngineManager(
            config=engine_config, actor_wg=worker_group, replicas=server_manager.get_replicas()
        )
        checkpoint_manager.sleep_replicas()
        logger.info("policy %s: worker group, %d rollout replica(s) and weight sync ready", name,
                    len(server_manager.get_replicas()))
        return PolicyStack(
            name=name,
            worker_group=worker_group,
            ref_worker_group=worker_group if (self.use_reference_policy or ref_in_actor) else None,
            ref_in_actor=ref_in_actor,
            server_manager=server_manager,
            checkpoint_manager=checkpoint_manager,
            pool=pool_name,
        )

    def _verl_pool_name(self) -> str:
        """The resource pool of verl's own actor/rollout workers (the first policy's)."""
        return self.mapping[next(iter(self.role_worker_mapping))]

    def _extra_stacks(self) -> list[PolicyStack]:
        return [self.stacks[n] for n in self.mas.policy_names[1:] if n in self.stacks]

    def get_llm_client(self) -> Any:
        # One request id per candidate, routed by its (episode, role) session (policies.SessionRoutedClient).
        if not self.mas.multi_policy:
            return self.llm_server_manager.get_client(client_cls=SessionRoutedClient)
        return PolicyRouterClient({name: stack.server_manager.get_client(client_cls=SessionRoutedClient)
                                   for name, stack in self.stacks.items()})

    def on_init_end(self) -> None:
        super().on_init_end()
        for stack in self._extra_stacks():
            stack.checkpoint_manager.update_weights(self.global_steps)

    def on_sample_end(self) -> None:
        super().on_sample_end()
        for stack in self._extra_stacks():
            stack.checkpoint_manager.sleep_replicas()

    def on_step_end(self) -> None:
        from verl.utils.debug import marked_timer

        # As verl's sync trainer, for every policy: wake its replicas and push the new weights.
        with marked_timer("update_weights", self.timing_raw, color="red"):
            for stack in self.stacks.values():
                stack.checkpoint_manager.update_weights(self.global_steps)

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps > 0 and self.mas.multi_policy:
            trainer = self.config.trainer
            if trainer.resume_mode == "resume_path":
                folder = trainer.resume_from_path
            else:
                folder = os.path.join(trainer.default_local_dir, f"global_step_{self.global_steps}")
            self._resume_folder = folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
            missing = [n for n in self.mas.policy_names[1:]
                       if not os.path.isdir(os.path.join(self._resume_folder, f"actor_{n}"))]
            if missing:
                raise FileNotFoundError(
                    f"Resuming from {self._resume_folder}, but it holds no checkpoint for policies {missing} "
                    f"(folders actor_<policy>). The checkpoint was saved by a run with other mas.policies; resume "
                    "with the same policies, or start from scratch (trainer.resume_mode=disable)."
                )

    def _save_checkpoint(self) -> None:
        step_dir = f"global_step_{self.global_steps}"
        folder = os.path.join(self.config.trainer.default_local_dir, step_dir)
        remote = self.config.trainer.default_hdfs_dir
        keep = self.config.trainer.get("max_actor_ckpt_to_keep", None)
        for stack in self._extra_stacks():
            stack.worker_group.save_checkpoint(
                os.path.join(folder, f"actor_{stack.name}"),
                None if remote is None else os.path.join(remote, step_dir, f"actor_{stack.name}"),
                self.global_steps,
                max_ckpt_to_keep=keep,
            )
        # verl saves the first policy in actor/, the dataloader, and writes the "latest" marker last.
        super()._save_checkpoint()

    def _view(self, stack: PolicyStack) -> MasTrainer:
        """This trainer as seen by one policy: verl's per-batch methods called on the view use the
        policy's worker groups. Each view has its own copy of the config (the update adjusts the
        mini-batch size per call), so views of different policies can run in parallel threads."""
        view = copy.copy(self)
        view.config = copy.deepcopy(self.config)
        if stack.name != self.mas.policy_names[0]:
            # The policy's own actor/rollout/ref settings (ppo_epochs, ppo_mini_batch_size, the log-prob
            # temperature, ...), as its worker group was built with them.
            with open_dict(view.config):
                view.config.actor_rollout_ref = copy.deepcopy(self._policy_configs[stack.name])
        view.actor_rollout_wg = stack.worker_group
        view.ref_policy_wg = stack.ref_worker_group
        view.ref_in_actor = stack.ref_in_actor
        return view

    def _per_policy(self, batch: Any, metrics: dict, method: Any, phase: str) -> Any:
        """Run ``method(view, sub_batch, metrics)`` for every policy on its own rows; merge the metrics.

        Policies sharing a resource pool run one after another (they share the GPUs' memory); a policy on
        a pool of its own runs concurrently with them. ``mas/policies/<phase>_concurrency`` is the sum of
        the policies' durations over the wall time of the phase (1.0: sequential).
        """
        if not self.mas.multi_policy:
            return method(self, batch, metrics)
        import time
        from concurrent.futures import ThreadPoolExecutor

        lanes: dict[str, list[str]] = defaultdict(list)
        for name in self.mas.policy_names:
            if self._policy_keys.get(name):
                lanes[self.stacks[name].pool].append(name)
        per_policy: dict[str, dict] = {name: {} for lane in lanes.values() for name in lane}
        durations: dict[str, float] = {}

        def run_lane(names: list[str]) -> None:
            for name in names:
                sub = batch.select_keys(self._policy_keys[name])
                sub.extra_info = dict(batch.extra_info or {})
                start = time.perf_counter()
                method(self._view(self.stacks[name]), sub, per_policy[name])
                durations[name] = time.perf_counter() - start

        start = time.perf_counter()
        if len(lanes) == 1:
            run_lane(next(iter(lanes.values())))
        else:
            with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="mas-policy") as pool:
                for future in [pool.submit(run_lane, names) for names in lanes.values()]:
                    future.result()
        wall = time.perf_counter() - start
        for name, seconds in durations.items():
            per_policy[name][f"timing_s/policy_{phase}"] = seconds
        metrics.update(merge_policy_metrics(per_policy))
        metrics[f"mas/policies/{phase}_concurrency"] = sum(durations.values()) / wall if wall > 0 else 1.0
        return batch

    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> Any:
        if not self.mas.multi_policy:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        extras = _as_list(data["extra_fields"])
        by_policy: dict[str, list[str]] = defaultdict(list)
        for key, extra in zip(batch.keys, extras, strict=True):
            by_policy[str(extra["mas_policy"])].append(key)
        parts = []
        self._policy_keys = {}
        per_policy: dict[str, dict] = {}
        for name in self.mas.policy_names:
            if not by_policy.get(name):
                logger.warning("policy %s has no samples this step; it is not updated", name)
                continue
            sub = batch.select_keys(by_policy[name])
            out: dict = {}
            sub = super(MasTrainer, self._view(self.stacks[name]))._balance_batch(
                sub, out, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch
            )
            self._policy_keys[name] = list(sub.keys)
            per_policy[name] = out
            parts.append(sub)
        metrics.update(merge_policy_metrics(per_policy))
        merged = type(batch).concat(parts)
        merged.extra_info = dict(batch.extra_info or {})
        return merged

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        return self._per_policy(
            batch, metrics, lambda v, b, m: super(MasTrainer, v)._compute_old_log_prob(b, metrics=m), "old_log_prob"
        )

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        return self._per_policy(
            batch, metrics, lambda v, b, m: super(MasTrainer, v)._compute_ref_log_prob(b, metrics=m), "ref"
        )

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        result = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update(self._server_metrics())
        return result

    def _server_metrics(self) -> dict[str, float]:
        """Requests served and weight updates per policy since the last step (rollout backends with ``stats``)."""
        import ray

        if not self.mas.multi_policy:
            return {}
        out: dict[str, float] = {}
        for name, stack in self.stacks.items():
            totals = {"requests": 0, "weight_updates": 0}
            for replica in stack.server_manager.get_replicas():
                handle = getattr(replica, "_server_handle", None)
                if handle is None or not hasattr(handle, "stats"):
                    return {}
                for k, v in ray.get(handle.stats.remote()).items():
                    totals[k] += int(v)
            last = self._last_server_stats.get(name, {"requests": 0, "weight_updates": 0})
            out[f"policy/{name}/rollout/requests"] = float(totals["requests"] - last["requests"])
            out[f"policy/{name}/rollout/weight_updates"] = float(totals["weight_updates"] - last["weight_updates"])
            self._last_server_stats[name] = totals
        return out

    def _build_replay_buffer(self) -> Any:
        buffer = super()._build_replay_buffer()
        tune_replay_buffer(buffer, self.mas, self._sampled)
        return buffer

    # ------------------------------------------------------------------------------------------------
    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        """PPO update with mini-batches counted in tasks, as ``actor.ppo_mini_batch_size`` is everywhere in verl.

        verl sizes the update's mini-batches as ``ppo_mini_batch_size * rollout.n`` rows, which assumes one
        row per session. An episode yields a variable number of rows (roles x turns x K candidates), so the
        batch is padded to a multiple that splits into stock verl's ``ceil(train_batch_size /
        ppo_mini_batch_size)`` mini-batches of whole per-rank shares (:mod:`verl_mas.minibatch`), and the
        mini-batch size is set for the call to what verl's asserts accept for this batch.
        """
        return self._per_policy(batch, metrics, lambda v, b, m: v._update_policy_actor(b, m), "update_actor")

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

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(_FIELDS))
        extras: list[dict] = _as_list(data["extra_fields"])
        uids = [str(u) for u in _as_list(data["uid"])]
        episodes = [session_of(key) for key in batch.keys]
        response_mask = data["response_mask"]
        padding = np.array([bool(tag.get("is_padding", False)) for tag in batch.tags])
        groups = assign_groups(extras, uids, padding, self.mas, episodes=episodes)
        keys, rewards = groups.keys, groups.rewards

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

        sampled = self._sampled.get("train")
        expected = None if sampled is None else len(sampled.uids) * int(self.config.actor_rollout_ref.rollout.n)
        metrics.update(mas_metrics(extras, groups, padding, uids, episodes, expected_episodes=expected))
        return batch


def prepare_verl_config(config: Any, mas: MasConfig, policy_configs: dict[str, Any]) -> None:
    """What the ``mas`` trainer changes in verl's config before verl's trainer reads it (in place).

    - ``trainer.v1.trainer_mode`` reads ``sync``: verl compares it with the literal "sync" in several places
      (replay buffer, batch sizes) and this mode is synchronous; ``trainer.v1.mas_trainer`` marks the config
      so that the ``mas`` agent loop knows it runs under this trainer;
    - ``algorithm.at_grpo_singleton`` carries ``mas.singleton_advantage`` to the ``at_grpo`` estimator;
    - ``actor_rollout_ref`` becomes the first policy's (the recipe's with its overrides).
    """
    primary = mas.policy_names[0]
    with open_dict(config):
        config.trainer.v1.trainer_mode = "sync"
        config.trainer.v1[MAS_TRAINER_MARK] = True
        config.algorithm[SINGLETON_KEY] = mas.singleton_advantage
        if mas.policies[primary]:
            config.actor_rollout_ref = policy_configs[primary]


@dataclass(frozen=True)
class SampledPrompts:
    """The prompts (tasks) verl's replay buffer handed to one step, and those whose agent loop raised."""

    uids: list[str]
    failed: list[str]


def tune_replay_buffer(buffer: Any, mas: MasConfig, sampled: dict[str, SampledPrompts]) -> None:
    """Adapt verl's replay buffer to episodes: faster polling, and no episode lost without a trace.

    verl polls TransferQueue for finished episodes every 2 s; episodes of small workflows finish in well
    under a second, so the fixed 2 s dominated CPU step times: ``mas.replay_poll_interval_s`` replaces it.

    verl's sync trainer keeps a prompt whose agent loop raised as a "failure" group and trains on what is
    left (its rows are simply missing). An exception in the ``mas`` agent loop is a bug or a deterministic
    server error, never a model mistake, so the step stops here with the failed tasks named (the agent-loop
    worker's log has each traceback). The prompts of every batch are recorded in ``sampled`` (by
    partition), so that the trainer's rates count every episode, including those that left no sample.
    """
    if hasattr(buffer, "poll_interval"):
        buffer.poll_interval = mas.replay_poll_interval_s
    materialize = buffer._materialize_batch  # verl 0.9.1: (partition_id, selected_prompt_uids, snapshot)

    def recording(partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict) -> Any:
        failed = sorted(set(selected_prompt_uids) & set(buffer.failure_keys[partition_id]))
        sampled[partition_id] = SampledPrompts(uids=list(selected_prompt_uids), failed=failed)
        if failed:
            raise RuntimeError(
                f"{len(failed)} of {len(selected_prompt_uids)} {partition_id} tasks raised in the mas agent loop "
                f"(task uids {failed[:5]}{' ...' if len(failed) > 5 else ''}); the agent-loop worker log above has "
                "each traceback. A raising episode is a bug in a workflow or a deterministic rollout-server error "
                "(e.g. a request the server rejects), never a model mistake and never silently dropped: fix the "
                "cause. Infrastructure failures (a lost replica, a timeout) do not raise: they abort the episode "
                "and count in mas/aborted."
            )
        return materialize(partition_id, selected_prompt_uids, partition_snapshot)

    buffer._materialize_batch = recording


def session_of(key: str) -> str:
    """The episode of a TransferQueue row key ``{uid}_{session}_{index}``: ``"{uid}_{session}"``."""
    parts = key.rsplit("_", 2)
    return f"{parts[0]}_{parts[1]}" if len(parts) == 3 else key


def mas_metrics(
    extras: list[dict],
    groups: GroupAssignment,
    padding: np.ndarray,
    uids: list[str],
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
    """
    roles, turns, rewards, ids = groups.roles, groups.turns, groups.rewards, groups.ids
    real = ~padding
    out = group_stats(ids[real], rewards[real]).as_metrics()
    by_role: dict[str, list[float]] = defaultdict(list)
    role_turns: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    parse_failures = 0
    per_episode: dict[str, dict[str, float]] = {}
    for i in np.flatnonzero(real):
        e = extras[i]
        by_role[roles[i]].append(float(rewards[i]))
        role_turns[roles[i]][episodes[i]].add(int(turns[i]))
        parse_failures += bool(e.get("mas_parse_failed", False))
        if int(e.get("mas_episode_index", -1)) == 0:
            per_episode[episodes[i]] = e.get("mas_episode_metrics") or {}
    for role, values in sorted(by_role.items()):
        out[f"mas/{role}/reward/mean"] = float(np.mean(values))
        out[f"mas/{role}/turns"] = float(np.mean([len(t) for t in role_turns[role].values()]))
    out["mas/parse_failures"] = float(parse_failures)
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
    extras: list[dict], uids: list[str], padding: np.ndarray, mas: MasConfig, *, episodes: list[str] | None = None
) -> GroupAssignment:
    """Group rows per ``mas.grouping`` and check every invariant that grouping and ``mas.sampling`` imply.

    - ``agent_turn`` (AT-GRPO): (task, role, turn); with tree sampling the K members share one prompt.
    - ``agent``: (task, role) across turns; each row keeps its own (role, turn) reward.
    - ``trajectory`` (classic GRPO, with parallel sampling): every row scores its episode's outcome
      (``mas/success``); the estimator normalises over the task's *episodes* (one advantage per
      episode, broadcast to its rows), not over rows.

    Args:
        extras: Each row's ``extra_fields`` as the ``mas`` agent loop wrote them.
        uids: Each row's verl uid (the dataset row, i.e. the task).
        padding: ``(bs,)`` True for rows verl added as padding; each becomes its own (singleton) group.
        mas: The ``mas:`` block.
        episodes: Each row's episode (``{uid}_{session}``); default: one episode per task.

    Raises:
        GroupPromptMismatchError: A batch breaks what its grouping and sampling imply (rows of different
            prompts in one tree node, several roles or turns in one group, ...).
    """
    episodes = list(uids) if episodes is None else list(episodes)
    roles = [e["mas_role"] for e in extras]
    turns = np.array([int(e["mas_turn"]) for e in extras], dtype=np.int64)
    if mas.grouping == "trajectory":
        rewards = np.array([_episode_outcome(e) for e in extras], dtype=np.float64)
    else:
        rewards = np.array([float(e["mas_reward"]) for e in extras], dtype=np.float64)
    keys = [
        f"padding|{i}" if padding[i]
        else group_key(uids[i], roles[i], int(turns[i]), mas.grouping, episode=episodes[i].rpartition("_")[2])
        for i in range(len(uids))
    ]
    # The group of a key (for trajectory keys "<task>#<episode>": the task, as the estimator reads them).
    ids = group_ids([k.rpartition(MEMBER_SEP)[0] if MEMBER_SEP in k else k for k in keys], grouping="trajectory")
    real = np.flatnonzero(~padding)
    problems = group_invariant_problems(
        ids[real], [keys[i] for i in real], grouping=mas.grouping, sampling=mas.sampling,
        task_uids=[uids[i] for i in real], episodes=[episodes[i] for i in real], roles=[roles[i] for i in real],
        turns=turns[real], prompt_hashes=[int(extras[i]["mas_prompt_hash"]) for i in real],
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


def merge_policy_metrics(per_policy: dict[str, dict]) -> dict[str, float]:
    """``policy/<name>/<metric>`` for every policy's metrics, and verl's name with the mean over policies.

    With one policy the metrics pass through unchanged.
    """
    if len(per_policy) == 1:
        return dict(next(iter(per_policy.values())))
    out: dict[str, Any] = {}
    pooled: dict[str, list[float]] = defaultdict(list)
    for name, metrics in per_policy.items():
        for key, value in metrics.items():
            out[f"policy/{name}/{key}"] = value
            if isinstance(value, (int, float, np.floating, np.integer)):
                pooled[key].append(float(value))
    for key, values in pooled.items():
        out[key] = float(np.mean(values))
    return out


def _pool_name(policy: str) -> str:
    """The resource pool of a policy with ``resources`` of its own."""
    return f"mas_policy_{policy}"


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


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
