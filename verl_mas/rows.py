"""The row contract between the ``mas`` agent loop and the ``mas`` trainer: what one trained candidate carries.

The agent loop returns one verl row (``AgentLoopOutput``) per trainable candidate. verl carries the tensors
(prompt, response, rollout log-probs) and, in ``extra_fields``, whatever else the loop attaches; the
trainer needs each candidate's own reward, its (role, turn) group, the policy that sampled it, a hash of
its prompt and its episode's metrics. :class:`CandidateRow` names these fields once: the loop writes
:meth:`CandidateRow.to_extra_fields`, the trainer reads :meth:`CandidateRow.from_extra_fields`, and a row
that lacks one of them (written by something else than the ``mas`` agent loop) is an error naming what is
missing. TransferQueue stores ``extra_fields`` flat, so each field travels as ``mas_<field>``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["FIELD_PREFIX", "CandidateRow", "prompt_hash", "rows_from_verl"]

#: Prefix of every contract field in a verl row's ``extra_fields``.
FIELD_PREFIX = "mas_"


def prompt_hash(prompt_ids: Sequence[int]) -> int:
    """A 63-bit hash of a prompt's token ids (the trainer compares them within each tree node)."""
    digest = hashlib.blake2b(json.dumps(list(prompt_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class CandidateRow:
    """One trained candidate, as the trainer sees it."""

    workflow: str
    """The workflow id of its episode."""
    role: str
    turn: int
    policy: str
    """The policy that sampled it (its log-probs and update belong to that policy)."""
    reward: float
    """Its own reward (verl copies the last row's ``reward_score`` onto every row of a run: this one is not)."""
    team_reward: float
    """The team part of ``reward`` (NaN when the workflow gave a plain reward)."""
    local_reward: float
    """The role-local part of ``reward`` (NaN when the workflow gave a plain reward)."""
    committed: bool
    """Whether it was the candidate its node committed (the episode continued from it)."""
    prompt_hash: int
    """:func:`prompt_hash` of its prompt ids: the members of a tree node must share it."""
    episode_index: int
    """Its position among its episode's rows (row 0 stands for the episode in episode-level metrics)."""
    episode_metrics: Mapping[str, float] = field(default_factory=dict)
    """The episode's metrics (``mas/success``, workflow metrics), the same on every row of the episode."""
    replica: int = -1
    """The rollout replica (of its policy) that sampled it, as the server said; -1 when the backend does not say."""

    def to_extra_fields(self) -> dict[str, Any]:
        """The row's fields as verl ``extra_fields`` entries (``mas_<field>``)."""
        out = {FIELD_PREFIX + f.name: getattr(self, f.name) for f in fields(self)}
        out[FIELD_PREFIX + "episode_metrics"] = dict(self.episode_metrics)
        return out

    @classmethod
    def from_extra_fields(cls, extra: Mapping[str, Any]) -> CandidateRow:
        """Read a row back from its ``extra_fields``.

        Raises:
            ValueError: The row lacks contract fields (it was not written by the ``mas`` agent loop).
        """
        names = [f.name for f in fields(cls)]
        missing = [FIELD_PREFIX + n for n in names if FIELD_PREFIX + n not in extra]
        if missing:
            raise ValueError(
                f"A training row lacks the fields {missing} that the mas trainer reads: it was not written by the "
                "mas agent loop (rows of other agent loops cannot be trained with trainer.v1.trainer_mode=mas). "
                "Write the data with `python -m verl_mas.data` (agent_name: mas), and run the same verl_mas "
                "version in every worker."
            )
        return cls(
            workflow=str(extra[FIELD_PREFIX + "workflow"]),
            role=str(extra[FIELD_PREFIX + "role"]),
            turn=int(extra[FIELD_PREFIX + "turn"]),
            policy=str(extra[FIELD_PREFIX + "policy"]),
            reward=float(extra[FIELD_PREFIX + "reward"]),
            team_reward=float(extra[FIELD_PREFIX + "team_reward"]),
            local_reward=float(extra[FIELD_PREFIX + "local_reward"]),
            committed=bool(extra[FIELD_PREFIX + "committed"]),
            prompt_hash=int(extra[FIELD_PREFIX + "prompt_hash"]),
            episode_index=int(extra[FIELD_PREFIX + "episode_index"]),
            episode_metrics=dict(extra[FIELD_PREFIX + "episode_metrics"] or {}),
            replica=int(extra[FIELD_PREFIX + "replica"]),
        )


def rows_from_verl(extra_fields: Any) -> list[CandidateRow]:
    """The rows of a batch from its ``extra_fields`` column as TransferQueue returns it (a NonTensorStack or a list)."""
    values = extra_fields.tolist() if hasattr(extra_fields, "tolist") else list(extra_fields)
    return [CandidateRow.from_extra_fields(e) for e in values]
