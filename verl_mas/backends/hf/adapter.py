"""The ``hf`` backend's verl adapter: the rollout object in the hybrid trainer worker.

verl instantiates :class:`HFServerAdapter` from its dotted path (:data:`verl_mas.backends.hf.ADAPTER_PATH`)
in every trainer worker and, after each training step, streams the actor's weights through it; the first
rank of each replica sends them as full CPU tensors to the replica's server actor (:mod:`.server`), found
by its Ray actor name.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator, Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from verl_mas.backends.hf.server import server_actor_name
from verl_mas.policies.adapters import ADAPTER_SEP, ADAPTERS_KEY, tensors_by_adapter
from verl_mas.policies.configs import rollout_policy

logger = logging.getLogger(__name__)


def iter_full_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Materialise verl's per-tensor weight stream as plain CPU tensors (DTensors are gathered)."""
    for name, tensor in weights:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().to("cpu", copy=True)


class HFServerAdapter(BaseRollout):
    """verl's rollout object in the hybrid trainer worker for the ``hf`` backend.

    Every trainer rank consumes the weight stream (gathering sharded parameters is collective); the
    first rank of each replica sends the full tensors to its server actor.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        replica_world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % replica_world
        self._server: Any = None

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank, 0, rollout_policy(self.config)))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None  # weights and cache stay resident on the CPU

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"The hf rollout backend takes full weights (wire_format='named_tensors'), got {wire_format!r}. "
                "Use actor_rollout_ref.rollout.checkpoint_engine.backend=naive with rollout.name=hf."
            )
        peft_config = kwargs.get("peft_config")
        adapters = peft_config.get(ADAPTERS_KEY) if isinstance(peft_config, dict) else None
        if peft_config is not None and adapters is None:
            raise NotImplementedError(
                "The hf rollout backend serves merged weights or the adapters of a shared base "
                "(mas.lora_base=shared), but verl sent one unmerged LoRA adapter. Set "
                "actor_rollout_ref.model.lora.merge=True, or use vLLM for unmerged adapters."
            )
        tensors = list(iter_full_tensors(weights))
        if self.rollout_rank != 0:
            return
        start = time.perf_counter()
        if adapters is not None and tensors and ADAPTER_SEP in tensors[0][0]:
            by_adapter = tensors_by_adapter(tensors, adapters)
            loaded = await self._server_handle().update_adapters.remote(by_adapter, adapters, global_steps)
        else:  # full weights (or, on a shared base started without weights, the base once)
            loaded = await self._server_handle().update_weights.remote(tensors, global_steps)
        logger.debug("hf rollout replica %d: loaded %d tensors in %.3fs", self.replica_rank, loaded, time.perf_counter() - start)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError(
            "The hf rollout backend serves verl's async agent-loop mode only (token-in/token-out server)."
        )
