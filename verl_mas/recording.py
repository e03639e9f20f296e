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

Advantages: a candidate's ``advantage`` is the one the trainer's ``at_grpo`` estimator gives it
(:func:`verl_mas.advantage.at_grpo.at_grpo_advantages` over the group :func:`verl_mas.trainer.assign_groups`
builds, with the run's normalisation and singleton policy), recorded only where the episode alone holds that
whole group, and null everywhere else (a number that is not the trainer's would be worse than none):

- ``sampling=tree`` (``rollout.n=1``: one episode per task) with ``grouping=agent_turn``: a group is one
  (task, role, turn) node of the episode, normalised over its trainable candidates;
- ``sampling=tree`` with ``grouping=agent``: a group is every trainable candidate of the role in the episode,
  all turns together (each keeps its own reward);
- ``sampling=parallel`` or ``grouping=trajectory`` (which start-up allows only with parallel sampling): a group
  spans the task's ``rollout.n`` episodes (the same (task, role, turn) in K independent episodes, or a role's
  score in each of the K episodes), which one episode cannot see: null;
- validation episodes (``source="val"``): never trained on, so the trainer computes no advantage: null.

Candidates lost to infrastructure failures are not trained on and have no advantage. Each group also records
``zero_variance``: true when the trainer's group of that node has several members whose rewards are all equal
(every member's advantage is exactly 0; under ``grouping=agent`` the group is the role's, so a node whose own
candidates tie is not marked unless the whole role ties), false when it has not, null where the advantages
are null. ``python -m verl_mas.view`` marks a node "zero variance" from this field alone.
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


def _trainer_groups(episode: Episode, *, source: str, grouping: str, sampling: str) -> dict[str, str] | None:
    """``{node key: trainer group}`` of the episode's nodes, or None where one episode does not hold its groups."""
    from verl_mas.advantage.groups import GROUPING_MODES
    from verl_mas.config import SAMPLINGS

    if grouping not in GROUPING_MODES or sampling not in SAMPLINGS:
        raise ValueError(
            f"episode_record got grouping={grouping!r}, sampling={sampling!r}; the modes are grouping in "
            f"{GROUPING_MODES} and sampling in {SAMPLINGS}. Pass the run's mas.grouping and mas.sampling.")
    if source == "val" or sampling == "parallel" or grouping == "trajectory":
        return None
    # Tree sampling runs one episode per task (rollout.n=1), so the task's groups are this episode's.
    return {g.key: g.role if grouping == "agent" else g.key for g in episode.groups}


def _advantages(episode: Episode, groups: Mapping[str, str], *, norm_by_std: bool,
                singleton: str) -> tuple[dict[tuple[str, int], float], dict[str, bool]]:
    """The trainer's advantage of every trainable candidate (by (node key, index)), and whether each trainer
    group has several members and equal rewards (by group)."""
    import numpy as np
    import torch

    from verl_mas.advantage.at_grpo import at_grpo_advantages

    # The rows the mas agent loop hands the trainer: the trainable candidates, each with its own reward.
    members = [c for g in episode.groups for c in g.all if c.trainable and c.reward is not None]
    flat: dict[str, bool] = {}
    if not members:
        return {}, flat
    names = [groups[c.group_key] for c in members]
    ids = np.unique(np.asarray(names, dtype=object), return_inverse=True)[1]
    # float32, as the trainer's token-level scores (the reward on a row's last response token).
    scores = torch.tensor([float(c.reward) for c in members], dtype=torch.float32)
    adv = at_grpo_advantages(scores, ids, norm_by_std=norm_by_std, singleton=singleton)
    for gid, name in enumerate(np.unique(np.asarray(names, dtype=object))):
        group = scores[torch.as_tensor(ids == gid)]
        # The estimator's zero-variance rule: several members, highest and lowest score exactly equal.
        flat[str(name)] = group.numel() > 1 and bool(group.max() == group.min())
    return {(c.group_key, c.index): float(a) for c, a in zip(members, adv.tolist(), strict=True)}, flat


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
    sampling: str = "tree",
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
        grouping, sampling, norm_by_std, singleton: The run's advantage settings (``mas.grouping``,
            ``mas.sampling``, ``algorithm.norm_adv_by_std_in_grpo``, ``mas.singleton_advantage``). They decide
            which advantages one episode determines (see the module docstring); the others are null.

    Raises:
        ValueError: ``grouping`` or ``sampling`` is not a mode of ``mas.grouping`` / ``mas.sampling``.
    """
    trainer_groups = _trainer_groups(episode, source=source, grouping=grouping, sampling=sampling)
    advantages, flat = ({}, {}) if trainer_groups is None else _advantages(
        episode, trainer_groups, norm_by_std=norm_by_std, singleton=singleton)
    groups = []
    for group in episode.groups:
        groups.append({
            "key": group.key,
            "role": group.role,
            "turn": int(group.turn),
            "prompt": _prompt_text(group, tokenizer),
            "prompt_tokens": len(group.prompt_ids),
            "zero_variance": None if trainer_groups is None else flat.get(trainer_groups[group.key], False),
            "candidates": [_candidate(c, advantages.get((group.key, c.index))) for c in group.all],
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
