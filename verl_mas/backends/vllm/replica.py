"""verl's vLLM replica and server, with a name and a weight socket of their own for every tagged policy.

:class:`PolicyVLLMReplica` is what verl's ``RolloutReplicaRegistry`` returns for ``rollout.name=vllm`` once
verl_mas is loaded. For a config without ``rollout.custom.mas_policy`` (a single-policy run, or the first
policy of several) it launches verl's server under verl's names; a tagged policy's servers are named
``vllm_<policy>_server_<replica>_<node>`` and listen for weights on a socket path of their own
(:func:`verl_mas.backends.vllm.weight_socket_job`), which the policy's worker-side adapter
(:mod:`.adapter`) derives the same way. Every server counts the requests it served, the weight syncs it loaded
and their bytes (``stats``; each vLLM worker reports the bytes it loaded, :mod:`.lora`).
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from typing import Any, Callable

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_mas.backends import diagnostic_after
from verl_mas.backends.counters import REPLICA_FIELD, RequestCounter
from verl_mas.backends.vllm import SWAP_ADAPTERS_ENV, server_name_prefix, weight_socket_job
from verl_mas.policies.adapters import rollout_adapters
from verl_mas.policies.configs import rollout_policy

__all__ = ["PolicyVLLMHttpServer", "PolicyVLLMReplica", "sync_bytes"]

logger = logging.getLogger(__name__)

#: The environment variable verl's server sets and its vLLM workers read to name their weight socket.
_JOB_ENV = "VERL_RAY_JOB_ID"
#: The collective call that loads one weight sync in verl's vLLM workers.
_WEIGHT_SYNC_RPC = "update_weights_from_ipc"


#: The adapter the current request names (a shared LoRA base); read by :class:`_AdapterEngine`.
_REQUEST_ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("mas_adapter", default=None)


class _AdapterEngine:
    """vLLM's engine client as verl's server calls it, each ``generate`` with the LoRA request of the adapter
    the current request names (verl's server would pass its single slot's)."""

    def __init__(self, engine: Any, ids: dict[str, int], swap: Callable[[], bool] = lambda: False) -> None:
        self._engine, self._ids, self._swap = engine, ids, swap
        # SWAP_ADAPTERS_ENV (diagnostic): while swap() holds, each policy is served with the next policy's adapter.
        names = list(ids)
        self._next = {p: names[(i + 1) % len(names)] for i, p in enumerate(names)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, lora_request: Any = None, **kwargs: Any) -> Any:
        from verl_mas.backends.vllm.lora import lora_request as adapter_request

        adapter = _REQUEST_ADAPTER.get()
        return self._engine.generate(*args, lora_request=adapter_request(self._next[adapter] if self._swap() else adapter, self._ids), **kwargs)


def sync_bytes(answers: Any) -> int:
    """The bytes one weight sync loaded: the sum of the vLLM workers' answers to ``update_weights_from_ipc``.

    Raises:
        TypeError: an answer is not a byte count: the workers do not run verl_mas's worker extension.
    """
    counts = isinstance(answers, list) and answers and all(type(a) is int for a in answers)
    if not counts:
        raise TypeError(
            f"The vLLM workers answered a weight sync with {answers!r}, not a list of the bytes each loaded. "
            "verl_mas's server starts vLLM with its own worker extension (verl_mas.backends.vllm.lora), whose "
            "weight-sync call returns them; a server that names another extension must subclass "
            "SyncBytesWorkerExtension."
        )
    return sum(answers)


class PolicyVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server actor, counting requests and weight syncs, on a tagged policy's own weight socket; on
    a shared LoRA base, one LoRA slot per policy and each request served by the adapter it names
    (:mod:`verl_mas.backends.vllm.lora`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = rollout_policy(self.config)
        # Read by the vLLM worker processes the server starts (launch_server), so set before they exist.
        os.environ[_JOB_ENV] = weight_socket_job(os.environ[_JOB_ENV], self.policy)
        self.counter = RequestCounter()
        self.weight_updates = 0
        self.weight_bytes = 0  # bytes loaded by the weight syncs, summed over this server's vLLM workers
        self.adapters = rollout_adapters(self.config)  # None unless a shared LoRA base
        self._loaded_adapters: set[int] = set()

    def _get_worker_extension_cls(self) -> str:
        # Subclasses of verl's extension whose weight-sync call returns the bytes it loaded.
        from verl_mas.backends.vllm.lora import EXTENSION_PATH, SYNC_BYTES_EXTENSION_PATH

        return EXTENSION_PATH if self.adapters else SYNC_BYTES_EXTENSION_PATH

    async def run_server(self, args: Any) -> None:
        if self.adapters:
            from verl.workers.rollout.vllm_rollout.utils import get_vllm_max_lora_rank

            args.max_loras = len(self.adapters)
            args.max_lora_rank = get_vllm_max_lora_rank(max(int(a["rank"]) for a in self.adapters.values()))
        await super().run_server(args)
        if self.adapters:
            from verl_mas.backends.vllm.lora import adapter_ids

            swap_after = diagnostic_after(os.environ.get(SWAP_ADAPTERS_ENV), SWAP_ADAPTERS_ENV)
            if swap_after is not None:
                logger.warning("%s is set: after %d weight syncs every request is served with ANOTHER policy's adapter "
                               "(a diagnostic for the per-policy rollout-vs-actor check); unset it for training.",
                               SWAP_ADAPTERS_ENV, swap_after)
            self.engine = _AdapterEngine(self.engine, adapter_ids(self.adapters),
                                         swap=lambda: swap_after is not None and self.weight_updates > swap_after)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, *args: Any,
                       adapter: str | None = None, **kwargs: Any) -> Any:
        if self.adapters:
            await self._check_adapter(adapter)
        elif adapter is not None:
            raise ValueError(f"A request asked for adapter {adapter!r}, but this vLLM server serves one model "
                             "(adapters of one base come with mas.lora_base=shared).")
        token = _REQUEST_ADAPTER.set(adapter)
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        finally:
            _REQUEST_ADAPTER.reset(token)
        self.counter.count(adapter)
        out.extra_fields[REPLICA_FIELD] = int(self.replica_rank)
        return out

    async def _check_adapter(self, adapter: str | None) -> None:
        from verl_mas.backends.vllm.lora import adapter_ids

        ids = adapter_ids(self.adapters)
        if adapter is None or adapter not in ids:
            raise ValueError(
                f"This vLLM server serves a shared LoRA base with adapters {list(ids)}; a request must name one "
                f"(adapter=<policy>), got {adapter!r}. The mas agent loop names each role's adapter."
            )
        if ids[adapter] not in self._loaded_adapters:
            self._loaded_adapters = set(await self.engine.list_loras())
            if ids[adapter] not in self._loaded_adapters:
                raise ValueError(f"adapter {adapter!r} (LoRA id {ids[adapter]}) is not loaded in vLLM yet; the trainer "
                                 "syncs every adapter before the first rollout.")

    async def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> Any:
        if method != _WEIGHT_SYNC_RPC:
            return await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
        # verl's collective_rpc drops the workers' answers; each worker answers a sync with the bytes it loaded.
        answers = await self.engine.collective_rpc(method=method, timeout=timeout, args=args, kwargs=kwargs)
        self.weight_updates += 1
        self.weight_bytes += sync_bytes(answers)

    def stats(self) -> dict[str, int]:
        """Counters since start: requests served, one sample each (``requests``, ``samples``; per adapter on a shared
        LoRA base ``requests:<adapter>``, ``samples:<adapter>``),
        weight syncs loaded and their bytes (summed over the server's vLLM workers: with tensor
        parallelism each worker loads the full tensors); the trainer logs them per policy and replica."""
        return {**self.counter.stats(), "weight_updates": int(self.weight_updates),
                "weight_bytes": int(self.weight_bytes)}

    def weight_socket_job(self) -> str:
        """The job part of this server's weight socket path (tests compare it with the adapter's)."""
        return os.environ[_JOB_ENV]


class PolicyVLLMReplica(vLLMReplica):
    """verl's vLLM replica, launching :class:`PolicyVLLMHttpServer` under the policy's server names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(PolicyVLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return server_name_prefix(rollout_policy(self.config))


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
