"""verl_mas's vLLM general plugin: on the CPU platform, keep linear weights so that verl can sync into them.

vLLM calls :func:`register` in every one of its processes (entry point ``vllm.general_plugins: verl_mas``;
``VLLM_PLUGINS`` may restrict which plugins load). It must be idempotent: vLLM may load plugins more than
once per process.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from verl_mas.backends import diagnostic_after
from verl_mas.backends.vllm import FREEZE_WEIGHTS_ENV

logger = logging.getLogger(__name__)

__all__ = ["apply", "register", "weight_updates_frozen"]

#: Attribute marking a function this module installed (so a second registration changes nothing).
_MARK = "_verl_mas_vllm_plugin"


def register() -> None:
    """The entry point vLLM calls: :func:`apply` for the platform vLLM runs on."""
    from vllm.platforms import current_platform

    applied = apply(cpu=current_platform.is_cpu())
    if applied:
        logger.info("verl_mas vLLM plugin: %s", ", ".join(applied))


def apply(*, cpu: bool) -> list[str]:
    """Install the adjustments for this platform; return their names (empty on GPU platforms, no diagnostic)."""
    applied = []
    if cpu:
        _keep_cpu_linear_weights()
        applied.append("CPU linear layers keep their weight tensors (verl syncs weights into them)")
    after = diagnostic_after(os.environ.get(FREEZE_WEIGHTS_ENV), FREEZE_WEIGHTS_ENV)
    if after is not None:
        _freeze_weight_updates(after)
        applied.append(f"{FREEZE_WEIGHTS_ENV}: weight syncs after the first {after} are received and ignored "
                       "(diagnostic)")
    return applied


def _keep_cpu_linear_weights() -> None:
    # vLLM 0.24's UnquantizedLinearMethod.process_weights_after_loading imports this function when it runs
    # and calls it with remove_weight=True, replacing layer.weight by an empty tensor after packing it.
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _MARK, False):
        return

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _MARK, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def weight_updates_frozen() -> bool:
    """Whether this process ignores the weight sync in progress (the ``FREEZE_WEIGHTS_ENV`` diagnostic, installed
    here: with ``after:N``, every sync after the first N)."""
    from verl.workers.rollout.vllm_rollout import utils

    after = getattr(utils.vLLMColocateWorkerExtension._update_weights, _MARK, None)
    return after is not None and _syncs_started > after


#: Weight syncs this process has started receiving (counted only while the freeze diagnostic is installed).
_syncs_started = 0


def _freeze_weight_updates(after: int) -> None:
    # Syncs are counted where verl's worker extension starts receiving one (update_weights_from_ipc, one call per
    # sync, any number of buckets); the receiver still drains every bucket of an ignored sync (the trainer's sender
    # never blocks), it loads none of them.
    from verl.workers.rollout.vllm_rollout import utils

    extension = utils.vLLMColocateWorkerExtension
    if getattr(extension._update_weights, _MARK, None) is not None:
        return
    receive, load = extension.update_weights_from_ipc, extension._update_weights

    def counting_receive(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _syncs_started
        _syncs_started += 1
        return receive(self, *args, **kwargs)

    def load_unless_frozen(self: Any, weights: Any, peft_config: Any, base_sync_done: bool) -> None:
        if weight_updates_frozen():
            logger.warning("%s: ignoring a bucket of weight sync %d (the first %d load)", FREEZE_WEIGHTS_ENV,
                           _syncs_started, after)
            return None
        return load(self, weights, peft_config=peft_config, base_sync_done=base_sync_done)

    setattr(load_unless_frozen, _MARK, after)
    extension.update_weights_from_ipc = counting_receive
    extension._update_weights = load_unless_frozen
