"""verl_mas's vLLM worker extensions: every weight sync returns the bytes it loaded; on a shared LoRA base
(``mas.lora_base: shared``) one server holds an adapter per policy.

:class:`SyncBytesWorkerExtension` is verl's worker extension whose weight-sync call
(``update_weights_from_ipc``) returns the bytes of the tensors the worker loaded; verl_mas's server
(:class:`verl_mas.backends.vllm.replica.PolicyVLLMHttpServer`) adds them up for ``mas/rollout/weight_bytes``, as
the ``hf`` server does. Counted where the tensors are loaded, so a sync sent but not loaded counts nothing.

verl 0.9.1's vLLM server holds one LoRA slot (``max_loras=1``, adapter id ``123``) and loads each sync into it.
For a shared base (:mod:`verl_mas.policies.adapters`) verl_mas's server (:class:`verl_mas.backends.vllm.replica.
PolicyVLLMHttpServer`) instead:

- starts vLLM with one slot per adapter (``max_loras`` = the number of policies, ``max_lora_rank`` the largest
  rank), and names :class:`MultiLoraWorkerExtension` as vLLM's worker extension;
- loads each sync (every adapter's tensors, named ``"<policy>:<peft key>"`` by the actor) as one LoRA
  request per policy, with the policy's own id (:func:`adapter_ids`) and peft config;
- serves each request with the LoRA request of the adapter it names (``adapter=<policy>``, added by the
  trainer's client), and refuses a request that names none or an adapter not loaded.

The worker extensions run in vLLM's worker processes (where verl_mas's vLLM plugin is loaded too).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_PATH, vLLMColocateWorkerExtension

from verl_mas.policies.adapters import ADAPTERS_KEY, tensors_by_adapter

logger = logging.getLogger(__name__)

__all__ = ["EXTENSION_PATH", "SYNC_BYTES_EXTENSION_PATH", "MultiLoraWorkerExtension", "SyncBytesWorkerExtension",
           "adapter_ids", "lora_request", "tensor_bytes"]

#: Dotted path of the shared LoRA base's worker extension (vLLM imports it in its worker processes).
EXTENSION_PATH = "verl_mas.backends.vllm.lora.MultiLoraWorkerExtension"
#: Dotted path of the worker extension of every other verl_mas vLLM server.
SYNC_BYTES_EXTENSION_PATH = "verl_mas.backends.vllm.lora.SyncBytesWorkerExtension"


def adapter_ids(adapters: dict[str, Any]) -> dict[str, int]:
    """vLLM LoRA ids of a shared base's adapters: 1, 2, ... in the policies' order (verl's one slot is 123)."""
    return {name: i + 1 for i, name in enumerate(adapters)}


def lora_request(policy: str, ids: dict[str, int]) -> Any:
    """The LoRA request serving ``policy``'s adapter (its tensors were loaded under its id by a sync)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=policy, lora_int_id=ids[policy], lora_path=VLLM_LORA_PATH)


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of ``tensors`` as sent (elements x element size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class SyncBytesWorkerExtension(vLLMColocateWorkerExtension):
    """verl's vLLM worker extension whose weight-sync call returns the bytes of the tensors this worker loaded.

    Counted where verl loads each bucket (``_update_weights``), after the load returned: a sync that fails
    counts nothing, and neither does a sync the diagnostic ``VERL_MAS_VLLM_FREEZE_WEIGHTS`` ignores.
    """

    _sync_bytes = 0  # bytes loaded by the weight sync in progress

    def update_weights_from_ipc(self, *args: Any, **kwargs: Any) -> int:
        self._sync_bytes = 0
        super().update_weights_from_ipc(*args, **kwargs)
        return self._sync_bytes

    def _update_weights(self, weights: Any, peft_config: dict, base_sync_done: bool) -> None:
        weights = weights if isinstance(weights, list) else list(weights)  # read twice: loaded, then counted
        super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
        self._count_loaded(t for _, t in weights)

    def _count_loaded(self, tensors: Iterable[Any]) -> None:
        from verl_mas.backends.vllm.plugin import weight_updates_frozen

        if not weight_updates_frozen():
            self._sync_bytes += tensor_bytes(tensors)


class MultiLoraWorkerExtension(SyncBytesWorkerExtension):
    """verl's vLLM worker extension loading every adapter of a shared base into its own LoRA slot."""

    def _update_weights(self, weights: Any, peft_config: dict, base_sync_done: bool) -> None:
        adapters = peft_config.get(ADAPTERS_KEY) if isinstance(peft_config, dict) else None
        if not (adapters and base_sync_done):  # the base (once, when vLLM started on dummy weights)
            return super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
        from verl_mas.backends.vllm.plugin import weight_updates_frozen

        if weight_updates_frozen():  # the freeze diagnostic holds for adapter syncs too
            logger.warning("ignoring an adapter sync of %s (weight updates frozen: diagnostic)", sorted(adapters))
            return None
        from verl.utils.vllm import TensorLoRARequest

        # Cloned out of the receiver's reused transfer buffer: add_lora keeps the tensors.
        by_policy = tensors_by_adapter(weights.items() if isinstance(weights, dict) else weights, adapters,
                                       prepare=lambda t: t.clone())
        ids = adapter_ids(adapters)
        for policy, tensors in by_policy.items():
            if not tensors:
                raise ValueError(f"adapter sync without tensors for policy {policy!r} (got {sorted(by_policy)})")
            self.remove_lora(ids[policy])
            self.add_lora(TensorLoRARequest(lora_name=policy, lora_int_id=ids[policy], lora_path=VLLM_LORA_PATH,
                                            peft_config=dict(adapters[policy]), lora_tensors=tensors))
        self._sync_bytes += tensor_bytes(t for tensors in by_policy.values() for t in tensors.values())
        logger.info("vLLM loaded adapters %s", {p: len(t) for p, t in by_policy.items()})


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
