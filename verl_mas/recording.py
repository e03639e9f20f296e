"""Episodes recorded for viewing: one JSON line per episode, everything :mod:`verl_mas.view` draws.

A record holds the task, the outcome and metrics, and per (role, turn) group the prompt the role saw
(decoded from the prompt ids, chat template included) and its K candidates: text, total/team/local reward,
the advantage where an episode alone determines it, committed, parse failure, infrastructure failure.
The schema is :data:`SCHEMA`; ``python -m verl_mas.view`` refuses records of another.

Who records:

- training, with ``mas.record: {dir: DIR, every_n_steps: N, episodes: M}`` (off unless ``dir`` is set): the
  ``mas`` agent loop writes up to M episodes per agent-loop worker of step 1 and every N-th step, training
  and validation, to ``DIR/episodes_<source>_step<step>_<pid>.jsonl``. The step is the training step that
  sampled the episode (the rollout's weight version + 1), or for validation the step after which it ran
  (as verl logs it; 0 before training);
- ``python -m verl_mas.run ... --record FILE`` and ``python -m verl_mas.evaluate ... --record FILE``.

Advantages: with ``grouping=agent_turn`` a group is one (task, role, turn) node, so the record computes the
AT-GRPO advantage the trainer computes (:func:`verl_mas.advantage.at_grpo.at_grpo_advantages`, the same
normalisation and singleton policy). Under role or trajectory grouping an advantage depends on the whole
batch and is recorded as null.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_mas.episode import Candidate, Candidates, Episode

__all__ = ["SCHEMA", "RecordSettings", "episode_record", "write_records"]

#: The record format ``python -m verl_mas.view`` reads.
SCHEMA = "verl_mas.episode/1"
RECORD_KEYS = ("dir", "every_n_steps", "episodes")


def _number(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _group_advantages(group: Candidates, *, norm_by_std: bool, singleton: str) -> dict[int, float]:
    """AT-GRPO advantages of a group's trainable candidates (index -> advantage), as the trainer computes them."""
    import torch

    from verl_mas.advantage.at_grpo import at_grpo_advantages

    members = [c for c in group.all if c.trainable and c.reward is not None]
    if not members:
        return {}
    scores = torch.tensor([float(c.reward) for c in members], dtype=torch.float32)
    adv = at_grpo_advantages(scores, torch.zeros(len(members), dtype=torch.long), norm_by_std=norm_by_std,
                             singleton=singleton)
    return {c.index: float(a) for c, a in zip(members, adv.tolist())}


def _candidate(c: Candidate, advantage: float | None) -> dict[str, Any]:
    return {
        "index": int(c.index),
        "text": c.text,
        "reward": _number(c.reward) if c.infra_error is None else None,
        "team_reward": _number(c.team_reward),
        "local_reward": _number(c.local_reward),
        "advantage": advantage,
        "committed": bool(c.committed),
        "parse_failed": bool(c.parse_failed),
        "infra_error": c.infra_error,
        "trainable": bool(c.trainable),
        "response_tokens": len(c.response_ids),
        "stop_reason": c.stop_reason,
    }


def _prompt_text(group: Candidates, tokenizer: Any) -> str:
    tok = tokenizer[group.role] if isinstance(tokenizer, Mapping) else tokenizer
    if tok is not None:
        return tok.decode(list(group.prompt_ids), skip_special_tokens=False)
    return "\n\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in group.messages)


def episode_record(
    episode: Episode,
    *,
    source: str,
    task: Any,
    step: int | None = None,
    tokenizer: Any = None,
    policies: Mapping[str, str] | None = None,
    grouping: str = "agent_turn",
    norm_by_std: bool = True,
    singleton: str = "zero",
) -> dict[str, Any]:
    """The viewing record of one episode (JSON-serialisable).

    Args:
        episode: The episode as the engine returned it.
        source: ``"train"``, ``"val"``, ``"run"`` or ``"evaluate"``.
        task: The task payload the episode ran on.
        step: The training step that sampled it (None outside training).
        tokenizer: Decodes each group's prompt ids (one tokenizer, or ``{role: tokenizer}``); None: the
            prompt is shown as its chat messages.
        policies: ``{role: policy}`` (None: every role ``"default"``).
        grouping, norm_by_std, singleton: The run's advantage settings (``mas.grouping``,
            ``algorithm.norm_adv_by_std_in_grpo``, ``mas.singleton_advantage``).
    """
    groups = []
    for group in episode.groups:
        advantages = (_group_advantages(group, norm_by_std=norm_by_std, singleton=singleton)
                      if grouping == "agent_turn" else {})
        groups.append({
            "key": group.key,
            "role": group.role,
            "turn": int(group.turn),
            "prompt": _prompt_text(group, tokenizer),
            "prompt_tokens": len(group.prompt_ids),
            "candidates": [_candidate(c, advantages.get(c.index)) for c in group.all],
        })
    success = episode.metrics.get("mas/success")
    return {
        "schema": SCHEMA,
        "source": source,
        "step": step,
        "workflow": episode.workflow_id,
        "task_uid": episode.task_uid,
        "seed": int(episode.seed),
        "task": task,
        "roles": list(episode.roles),
        "policies": {role: (policies or {}).get(role, "default") for role in episode.roles},
        "outcome": {
            "success": None if episode.aborted or success is None else float(success),
            "terminated": bool(episode.terminated),
            "truncated": bool(episode.truncated),
            "aborted": bool(episode.aborted),
            "error": episode.error,
            "context_overflow": bool(episode.context_overflow),
        },
        "metrics": {k: float(v) for k, v in episode.metrics.items() if math.isfinite(float(v))},
        "groups": groups,
    }


_lock = threading.Lock()


def write_records(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> Path:
    """Append records to a JSON-lines file (created with its folder)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with _lock, out.open("a", encoding="utf-8") as f:
        f.write(lines)
    return out


@dataclass(frozen=True)
class RecordSettings:
    """``mas.record``: where and how many training episodes are recorded (off unless ``dir`` is set)."""

    dir: str | None = None
    every_n_steps: int = 10
    episodes: int = 4

    @classmethod
    def parse(cls, block: Mapping[str, Any] | None) -> tuple[RecordSettings, list[str]]:
        """The settings and every problem of the block (``mas.record``)."""
        if not block:
            return cls(), []
        if not isinstance(block, Mapping):
            return cls(), [f"mas.record is {block!r}; it must be a mapping with keys {list(RECORD_KEYS)}."]
        problems = []
        unknown = sorted(set(block) - set(RECORD_KEYS))
        if unknown:
            problems.append(f"mas.record has unknown keys {unknown}; the keys are {list(RECORD_KEYS)}.")
        for key in ("every_n_steps", "episodes"):
            value = block.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"mas.record.{key} is {value!r}; it must be an integer >= 1.")
        directory = block.get("dir")
        if directory is not None and not isinstance(directory, str | os.PathLike):
            problems.append(f"mas.record.dir is {directory!r}; it must be a folder path (or null: recording off).")
        if problems:
            return cls(), problems
        return cls(dir=None if directory is None else str(directory), every_n_steps=int(block.get("every_n_steps", 10)),
                   episodes=int(block.get("episodes", 4))), []

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def records_step(self, step: int) -> bool:
        """Step 1 (before any update) and every ``every_n_steps``-th step."""
        return self.enabled and (step == 1 or step % self.every_n_steps == 0)

    def path(self, source: str, step: int) -> Path:
        assert self.dir is not None
        return Path(self.dir) / f"episodes_{source}_step{step:06d}_{os.getpid()}.jsonl"
