"""What a rollout server served, for the trainer's per-policy and per-replica metrics (both CPU-runnable backends)."""

from __future__ import annotations

__all__ = ["REPLICA_FIELD", "RequestCounter"]

#: The field of a sample's ``extra_fields`` naming the replica (of its policy's rollout) that sampled it; the agent
#: loop keeps it on the row, and the trainer checks that one (episode, role) session stayed on one replica.
REPLICA_FIELD = "mas_replica"


class RequestCounter:
    """A rollout server's request and sample counts since it started, and per adapter on a shared LoRA base."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {"requests": 0, "samples": 0}

    def count(self, adapter: str | None, samples: int = 1) -> None:
        """One request served, of ``samples`` samples (``adapter``: the LoRA adapter it named, None for the server's
        one model)."""
        keys = ("requests", "samples") if adapter is None else (
            "requests", "samples", f"requests:{adapter}", f"samples:{adapter}")
        for key in keys:
            self.totals[key] = self.totals.get(key, 0) + (1 if key.startswith("requests") else samples)

    def stats(self) -> dict[str, int]:
        """``requests`` and ``samples`` since start, and ``requests:<adapter>`` / ``samples:<adapter>``."""
        return dict(self.totals)
