"""The ``hf`` backend's Ray side: the per-replica server actor verl's agent loops call, and its replica.

:class:`HFReplica` is what verl's ``RolloutReplicaRegistry`` returns for ``rollout.name=hf``; it
launches one :class:`HFRolloutServer` actor per replica, next to the trainer worker that syncs weights
into it (hybrid mode). The server wraps a :class:`~verl_mas.backends.hf.engine.HFGenerationEngine` and
answers verl's server contract:

- ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput(token_ids, log_probs,
  stop_reason, extra_fields={"global_steps": int})``; with ``mas_samples=n`` (:data:`SAMPLES_KWARG`, which
  verl's server client passes through) one request returns ``n`` samples of the prompt, decoded in one batch,
  in ``extra_fields["mas_group"]`` (:data:`GROUP_FIELD`);
- ``update_weights``, called by the worker-side adapter (:mod:`.adapter`) with the actor's full weights
  after every training step;
- the lifecycle no-ops verl calls on hybrid replicas (``wake_up``, ``sleep``, ``clear_kv_cache``,
  ``abort_all_requests``, ...).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from verl_mas.backends import diagnostic_after
from verl_mas.backends.counters import REPLICA_FIELD, RequestCounter
from verl_mas.backends.hf import BACKEND_NAME, FREEZE_WEIGHTS_ENV, GROUP_FIELD
from verl_mas.backends.hf.engine import HFGenerationEngine, settings_from_verl
from verl_mas.policies.adapters import rollout_adapters
from verl_mas.policies.configs import rollout_policy

logger = logging.getLogger(__name__)


def server_actor_name(replica_rank: int, node_rank: int = 0, policy: str | None = None) -> str:
    """The Ray actor name of a replica's server; the worker-side adapter finds its server by it.

    Replica ranks restart at 0 in every worker group, so with several trainable policies (one stack
    each) the policy name, from ``rollout.custom.mas_policy``, keeps the names apart.
    """
    suffix = f"_{policy}" if policy else ""
    return f"{BACKEND_NAME}_server_{replica_rank}_{node_rank}{suffix}"


class HFRolloutServer:
    """The per-replica server actor (wrapped with ``ray.remote`` by :class:`HFReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, node_rank: int = 0) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps = 0
        self.counter = RequestCounter()
        path = getattr(model_config, "local_path", None) or model_config.path
        # Several rollout servers share the machine's cores with the trainer: keep each one small.
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        seed = int(getattr(self.config, "seed", 0) or 0) + replica_rank
        self.engine = HFGenerationEngine.from_pretrained(
            path, seed=seed, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
        # A shared LoRA base (mas.lora_base=shared): every request names its adapter; the first sync creates them.
        self.engine.expects_adapters = rollout_adapters(config) is not None
        self.engine.freeze_after = diagnostic_after(os.environ.get(FREEZE_WEIGHTS_ENV), FREEZE_WEIGHTS_ENV)
        if self.engine.freeze_after is not None:
            logger.warning(
                "%s is set: rollout replica %d will IGNORE weight updates after the first %d and keep sampling from "
                "the weights it has. This is a diagnostic for the weight-sync check; unset it for training.",
                FREEZE_WEIGHTS_ENV,
                replica_rank,
                self.engine.freeze_after,
            )
        self.max_model_len = int(self.config.max_model_len or (self.config.prompt_length + self.config.response_length))

    def get_server_address(self) -> tuple[str, int]:
        # Not an HTTP server: verl uses the address only as a key for its load balancer.
        return f"{BACKEND_NAME}-replica-{self.replica_rank}", self.node_rank

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        adapter: str | None = None,
        mas_samples: int = 1,
        **kwargs: Any,
    ) -> Any:
        if isinstance(mas_samples, bool) or not isinstance(mas_samples, int) or mas_samples < 1:
            raise ValueError(f"mas_samples={mas_samples!r}: a request asks for a positive number of samples.")
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError(
                "The hf CPU rollout backend serves text-only models; multimodal inputs need vLLM or SGLang "
                "(actor_rollout_ref.rollout.name=vllm|sglang)."
            )
        settings = settings_from_verl(
            sampling_params,
            prompt_len=len(prompt_ids),
            response_length=self.config.response_length,
            prompt_length=self.config.prompt_length,
            max_model_len=self.max_model_len,
            default_ignore_eos=bool(getattr(self.config, "ignore_eos", False)),
        )
        ids = [int(t) for t in prompt_ids]
        # The n samples queue together, so the engine decodes them in one batch (with whatever else is queued).
        results = await asyncio.gather(*(self.engine.generate(ids, settings, adapter=adapter) for _ in range(mas_samples)))
        self.counter.count(adapter, samples=mas_samples)
        served = {"global_steps": int(self.global_steps), REPLICA_FIELD: int(self.replica_rank)}
        outputs = [
            TokenOutput(token_ids=r.token_ids, log_probs=r.log_probs if settings.want_logprobs else None,
                        stop_reason=r.stop_reason, extra_fields=dict(served))
            for r in results
        ]
        if mas_samples == 1:
            return outputs[0]
        # verl's client reads the first sample's fields (global_steps); the group rides along beside them.
        head = outputs[0]
        return TokenOutput(token_ids=head.token_ids, log_probs=head.log_probs, stop_reason=head.stop_reason,
                           extra_fields={**served, GROUP_FIELD: outputs})

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], global_steps: int | None = None) -> int:
        loaded = await asyncio.get_running_loop().run_in_executor(
            self.engine._executor, self.engine.load_weights, named_tensors
        )
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return loaded

    async def update_adapters(self, tensors: dict[str, dict[str, torch.Tensor]], configs: dict[str, dict[str, Any]],
                              global_steps: int | None = None) -> int:
        """Load every adapter of a shared LoRA base (:meth:`HFGenerationEngine.load_adapters`)."""
        loaded = await asyncio.get_running_loop().run_in_executor(
            self.engine._executor, self.engine.load_adapters, tensors, configs
        )
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return loaded

    def weight_update_count(self) -> int:
        return self.engine.num_weight_updates

    def stats(self) -> dict[str, int]:
        """Counters since start: requests and samples served (per adapter on a shared LoRA base:
        ``requests:<adapter>``, ``samples:<adapter>``), weight updates loaded and their bytes; the trainer logs
        them per policy and replica."""
        return {**self.counter.stats(), "weight_updates": int(self.engine.num_weight_updates),
                "weight_bytes": int(self.engine.weight_bytes_loaded)}

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    # ---- lifecycle hooks verl calls on hybrid replicas: nothing to free on the CPU ----
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None  # no cache survives a request

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # Requests are short and served FIFO; nothing is partially generated between steps.
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """A rollout replica served by one :class:`HFRolloutServer` (tensor parallel size 1, one node)."""

    async def launch_servers(self) -> None:
        if self.world_size != 1 or self.nnodes != 1:
            raise ValueError(
                f"The hf rollout backend serves one model copy per replica (world size {self.world_size} "
                "requested). Set actor_rollout_ref.rollout.tensor_model_parallel_size=1 "
                "(and data/pipeline parallel sizes 1)."
            )
        options: dict[str, Any] = {
            "name": server_actor_name(self.replica_rank, 0, rollout_policy(self.config)) + self.name_suffix,
            "max_concurrency": self.max_concurrency,
            "num_cpus": 0,  # logical CPU slots stay with verl's workers and TransferQueue
        }
        if self.workers:  # hybrid: run next to the trainer worker that syncs weights into it
            node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        server = (
            ray.remote(HFRolloutServer)
            .options(**options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank, node_rank=0)
        )
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"

    def rollout_worker_use_gpu(self) -> bool:
        return False
