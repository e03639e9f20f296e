"""Names of the ``hf`` rollout backend, importable without importing the backend (Ray, transformers)."""

from __future__ import annotations

from typing import Any

#: ``actor_rollout_ref.rollout.name`` that selects the backend.
BACKEND_NAME = "hf"
#: Dotted path verl's rollout registry imports in the trainer worker.
ADAPTER_PATH = "verl_mas.backends.hf_rollout.HFServerAdapter"


def load_replica_class() -> Any:
    """Loader for verl's ``RolloutReplicaRegistry``: imports the backend when a run selects it."""
    from verl_mas.backends.hf_rollout import HFReplica

    return HFReplica
