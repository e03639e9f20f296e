"""What a rollout server served, for the trainer's per-policy and per-replica metrics (both CPU-runnable backends)."""

from __future__ import annotations

__all__ = ["REPLICA_FIELD", "RequestCounter"]

#: The field of a sample's ``extra_fields`` naming the replica (of its policy's rollout) that sampled it; the agent
#: loop keeps it on the row, and the trainer checks that one (episode, role) session stayed on one replica.
REPLICA_FIELD = "mas_replica"


class RequestCounter:
    """A rollout server's request counts since it started, and per adapter on a shared LoRA base."""

    def __init__(self) -> None:
        self.requests = 0
        self.by_adapter: dict[str, int] = {}

    def count(self, adapter: str | None) -> None:
        """One request served (``adapter``: the LoRA adapter it named, None for the server's one model)."""
        self.requests += 1
        if adapter is not None:
            self.by_adapter[adapter] = self.by_adapter.get(adapter, 0) + 1

    def stats(self) -> dict[str, int]:
        """``requests`` and ``requests:<adapter>`` since start."""
        return {"requests": self.requests, **{f"requests:{name}": n for name, n in self.by_adapter.items()}}
