"""Several trainable policies in one verl run: a stack per policy, and the trainer hooks that drive them.

A *policy* is a model (or adapter) that serves one or more roles. The first policy runs in verl's own
actor/rollout stack; every further policy gets a :class:`PolicyStack` built from the same verl pieces: an
``ActorRolloutRefWorker`` group (on verl's resource pool, or on its own with ``resources``), its rollout
replicas (``LLMServerManager``) and its weight sync (``CheckpointEngineManager``).

:class:`MultiPolicyTrainer` is the part of the ``mas`` trainer (:class:`verl_mas.trainer.MasTrainer`) that
knows about several policies. It overrides verl's trainer hooks to build the stacks, hand the agent loops
a client that routes each role to its policy's servers (:mod:`verl_mas.routing`), split every batch by
policy for balancing, log-probs and updates (:meth:`MultiPolicyTrainer._per_policy`, on a per-policy
*view* of the trainer), sync and sleep every policy's rollout, and save/load every policy with the step
(the first in ``actor/`` as verl does, the others in ``actor_<policy>/``). LoRA policies on one shared base
(:mod:`verl_mas.policies.adapters`) get no stack of their own: each is an adapter in the first policy's worker
group and rollout, activated before its log-probs and update; a frozen policy (``frozen: true``) is left out of
the update only. Metrics of a per-policy computation are logged as ``policy/<name>/<metric>``; verl's own names
carry the mean over policies. With one policy every hook is verl's own behaviour.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import transfer_queue as tq
from omegaconf import open_dict

from verl_mas.config import MasConfig
from verl_mas.policies.adapters import adapter_plan, lora_rank
from verl_mas.routing import PolicyRouterClient, SessionRoutedClient
from verl_mas.rows import rows_from_verl

logger = logging.getLogger(__name__)

__all__ = ["MultiPolicyTrainer", "PolicyStack", "merge_policy_metrics"]


@dataclass
class PolicyStack:
    """One policy's pieces in the trainer: its worker group, rollout servers and weight sync."""

    name: str
    worker_group: Any
    ref_worker_group: Any
    ref_in_actor: bool
    server_manager: Any
    checkpoint_manager: Any
    pool: str = "global_pool"  # the resource pool its workers and rollout replicas live on
    adapter: str | None = None  # on a shared LoRA base: its adapter in the first policy's worker group and rollout

    @property
    def shares_base(self) -> bool:
        return self.adapter is not None


class MultiPolicyTrainer:
    """Mixin of verl's ``PPOTrainerSync`` hooks for several policies (see the module docstring).

    The class that mixes it in sets ``self.mas`` (the ``mas:`` block) and ``self._policy_configs`` (each
    policy's ``actor_rollout_ref``) before verl's ``__init__`` runs.
    """

    mas: MasConfig
    _policy_configs: dict[str, Any]

    def __init__(self, config: Any) -> None:
        self.stacks: dict[str, PolicyStack] = {}
        self._policy_keys: dict[str, list[str]] = {}
        self._resume_folder: str | None = None
        self._last_server_stats: dict[str, dict[str, Any]] = {}
        # One resident base, one LoRA adapter per policy (mas.lora_base=shared): None, or policy -> adapter spec.
        self._adapters = adapter_plan(self._policy_configs) if self.mas.multi_policy else None
        super().__init__(config)  # type: ignore[call-arg]  (verl's trainer, next in the MRO)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        if self._adapters:
            import ray

            from verl_mas.policies.lora_worker import SharedBaseLoraWorker

            # verl's own actor/rollout role, its worker class holding every adapter (verl's separate-async
            # trainer swaps its worker class the same way).
            for role in list(self.role_worker_mapping):
                if str(role).startswith("actor"):
                    self.role_worker_mapping[role] = ray.remote(SharedBaseLoraWorker)
            return
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
            adapter=primary if self._adapters else None,
        )
        for name in self.mas.policy_names[1:]:
            if self._adapters:  # an adapter in the first policy's worker group and rollout
                self.stacks[name] = dataclasses.replace(self.stacks[primary], name=name, adapter=name)
            else:
                self.stacks[name] = self._build_policy_stack(name, self._policy_configs[name])
        if self._resume_folder is not None and not self._adapters:  # a shared base resumes every adapter itself
            for name in self.mas.policy_names[1:]:
                self.stacks[name].worker_group.load_checkpoint(
                    local_path=os.path.join(self._resume_folder, f"actor_{name}"),
                    del_local_after_load=self.config.trainer.del_local_ckpt_after_load,
                )
                logger.info("policy %s resumed from %s", name, self._resume_folder)
        for name in self.mas.frozen_policies:
            logger.info("policy %s is frozen: it serves its roles and takes no optimiser step", name)

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

        ref_in_actor = lora_rank(arr.model) > 0 or arr.model.get("lora_adapter_path") is not None
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
        """The stacks built for further policies (not the adapters of a shared base, which use the first's)."""
        return [self.stacks[n] for n in self.mas.policy_names[1:] if n in self.stacks and not self.stacks[n].shares_base]

    def get_llm_client(self) -> Any:
        # One request id per candidate, routed by its (episode, role) session (policies.SessionRoutedClient).
        if not self.mas.multi_policy:
            return self.llm_server_manager.get_client(client_cls=SessionRoutedClient)
        if self._adapters:  # one rollout; each request names its policy's adapter
            client = self.llm_server_manager.get_client(client_cls=SessionRoutedClient)
            return PolicyRouterClient(dict.fromkeys(self.mas.policy_names, client),
                                      adapters={name: name for name in self.mas.policy_names})
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
            for stack in [self.stacks[self.mas.policy_names[0]], *self._extra_stacks()]:
                stack.checkpoint_manager.update_weights(self.global_steps)

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()
        if self.global_steps > 0 and self.mas.multi_policy and not self._adapters:
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

    def _view(self, stack: PolicyStack) -> Any:
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

    def _per_policy(self, batch: Any, metrics: dict, method: Any, phase: str, skip: Collection[str] = ()) -> Any:
        """Run ``method(view, sub_batch, metrics)`` for every policy not in ``skip`` on its rows; merge the metrics.

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
            if self._policy_keys.get(name) and name not in skip:
                lanes[self.stacks[name].pool].append(name)
        per_policy: dict[str, dict] = {name: {} for lane in lanes.values() for name in lane}
        durations: dict[str, float] = {}

        def run_lane(names: list[str]) -> None:
            for name in names:
                sub = batch.select_keys(self._policy_keys[name])
                sub.extra_info = dict(batch.extra_info or {})
                start = time.perf_counter()
                if self.stacks[name].shares_base:  # its adapter forwards, its optimiser steps
                    self.stacks[name].worker_group.mas_set_adapter(self.stacks[name].adapter)
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
        rows = rows_from_verl(data["extra_fields"])
        by_policy: dict[str, list[str]] = defaultdict(list)
        for key, row in zip(batch.keys, rows, strict=True):
            by_policy[row.policy].append(key)
        parts = []
        self._policy_keys = {}
        per_policy: dict[str, dict] = {}
        for name in self.mas.policy_names:
            if not by_policy.get(name):
                logger.warning("policy %s has no samples this step; it is not updated", name)
                continue
            sub = batch.select_keys(by_policy[name])
            out: dict = {}
            sub = super(MultiPolicyTrainer, self._view(self.stacks[name]))._balance_batch(
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
            batch, metrics, lambda v, b, m: super(MultiPolicyTrainer, v)._compute_old_log_prob(b, metrics=m), "old_log_prob"
        )

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        return self._per_policy(
            batch, metrics, lambda v, b, m: super(MultiPolicyTrainer, v)._compute_ref_log_prob(b, metrics=m), "ref"
        )

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> Any:
        result = super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update(self._server_metrics())
        return result

    def _server_metrics(self) -> dict[str, float]:
        """What each policy's rollout replicas did since the last step, for rollout backends with ``stats``
        (``policy/<name>/rollout/...`` with several policies, ``mas/rollout/...`` with one): ``requests``,
        ``samples`` (one request of the hf backend carries a whole group) and ``weight_updates`` summed over the
        replicas, and per replica as ``replica<i>/...`` when there are several;
        and the bytes the weight syncs loaded (``mas/rollout/weight_bytes``)."""
        import ray

        out: dict[str, float] = {}
        weight_bytes, reads = 0.0, {}  # the adapters of a shared base read one rollout's replicas once
        for name, stack in self.stacks.items():
            first_read = id(stack.server_manager) not in reads
            if first_read:
                replicas = []
                for replica in stack.server_manager.get_replicas():
                    handle = getattr(replica, "_server_handle", None)
                    if handle is None or not hasattr(handle, "stats"):
                        return {}
                    replicas.append(ray.get(handle.stats.remote()))
                reads[id(stack.server_manager)] = replicas
            replicas = reads[id(stack.server_manager)]
            # On a shared base the one rollout counts each adapter's requests and samples.
            suffix = f":{stack.adapter}" if stack.shares_base else ""
            now = {"requests": [int(r.get("requests" + suffix, 0)) for r in replicas],
                   "samples": [int(r.get("samples" + suffix, 0)) for r in replicas],
                   "weight_updates": [int(r["weight_updates"]) for r in replicas]}
            last = self._last_server_stats.get(name, {k: [0] * len(replicas) for k in now})
            prefix = f"policy/{name}/rollout" if self.mas.multi_policy else "mas/rollout"
            for counter, values in now.items():
                deltas = [n - n0 for n, n0 in zip(values, last[counter], strict=True)]
                out[f"{prefix}/{counter}"] = float(sum(deltas))
                if len(replicas) > 1:
                    out.update({f"{prefix}/replica{i}/{counter}": float(d) for i, d in enumerate(deltas)})
            total_bytes = sum(int(r["weight_bytes"]) for r in replicas)
            if first_read:
                weight_bytes += total_bytes - last.get("weight_bytes", 0)
            self._last_server_stats[name] = {**now, "weight_bytes": total_bytes}
        out["mas/rollout/weight_bytes"] = weight_bytes
        return out


def merge_policy_metrics(per_policy: dict[str, dict]) -> dict[str, float]:
    """``policy/<name>/<metric>`` for every policy's metrics, and verl's name with the mean over policies.

    Called in runs with several policies only; a step in which one of them computed (the others had no row
    with signal, ``mas.drop_zero_variance``) still names it, so a policy's series never changes name.
    """
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


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
