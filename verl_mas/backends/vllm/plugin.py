"""verl_mas's vLLM general plugin: on the CPU platform, keep linear weights so that verl can sync into them.

vLLM calls :func:`register` in every one of its processes (entry point ``vllm.general_plugins: verl_mas``;
``VLLM_PLUGINS`` may restrict which plugins load). It must be idempotent: vLLM may load plugins more than
once per process.
"""

from __future__ import annotations

import logging
import os
from typing import Any

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
    if os.environ.get(FREEZE_WEIGHTS_ENV) == "1":
        _freeze_weight_updates()
        applied.append(f"{FREEZE_WEIGHTS_ENV}=1: weight syncs are received and ignored (diagnostic)")
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
    """Whether this process ignores weight updates (the ``FREEZE_WEIGHTS_ENV`` diagnostic is installed here)."""
    from verl.workers.rollout.vllm_rollout import utils

    return bool(getattr(utils.vLLMColocateWorkerExtension._update_weights, _MARK, False))


def _freeze_weight_updates() -> None:
    # The receiver still drains every bucket (the trainer's sender never blocks); nothing is loaded.
    from verl.workers.rollout.vllm_rollout import utils

    extension = utils.vLLMColocateWorkerExtension
    if getattr(extension._update_weights, _MARK, False):
        return

    def ignore_update(self: Any, weights: Any, peft_config: Any, base_sync_done: bool) -> None:
        logger.warning("%s=1: ignoring a weight update of %d tensors", FREEZE_WEIGHTS_ENV, len(weights))

    setattr(ignore_update, _MARK, True)
    extension._update_weights = ignore_update
