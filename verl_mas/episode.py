"""Episode records: candidates, their groups, the episode, and the group key (settings: :mod:`verl_mas.settings`).

Every candidate the engine samples is a training sample, so the record keeps all of them: role, turn,
group key, prompt ids, response ids, rollout log-probs, reward (and its team/local parts), and the
``committed`` / ``trainable`` / ``parse_failed`` flags. The group key is built in exactly one place,
:func:`group_key`, from stable ids, never from positions in a batch (docs/algorithm.md §5, pitfall 1).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from verl_mas.errors import WorkflowError
from verl_mas.settings import EpisodeConfig

__all__ = ["GROUP_KEY_SEP", "Candidate", "Candidates", "Episode", "group_key"]

#: Separator of the parts of a group key; task uids and role names may not contain it.
GROUP_KEY_SEP = "|"


def group_key(task_uid: str, role: str, turn: int) -> str:
    """The identity of an AT-GRPO group: ``(task uid, role, turn)`` as one string, e.g. ``"t7|planner|2"``.

    All K candidates of one group share one prompt; advantages are normalised within a group.
    """
    return f"{task_uid}{GROUP_KEY_SEP}{role}{GROUP_KEY_SEP}{turn}"


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{what} must be a finite float, got {value!r}. Rewards train the policy; an unparsable or "
            "failed action gets a low finite reward (and candidate.parse_failed = True), never NaN or None."
        )
    return float(value)


@dataclass(eq=False)
class Candidate:
    """One of the K samples of a group, and its training record.

    Set a reward on every candidate: either ``reward`` directly, or ``team_reward`` and/or
    ``local_reward``, which mix as ``reward = alpha * team_reward + local_reward`` (a missing part
    counts as 0). Mark unparsable outputs with ``parse_failed = True`` (a metric counts them).

    ``info`` is the workflow's own per-candidate data: store what scoring computed (the parsed answer,
    the extracted program, its execution result or score) on each candidate, and read it back from the
    one :meth:`Candidates.best` commits (``group.best().info["score"]``) instead of mapping the committed
    candidate back to a position or keeping a side dict. The engine and the trainer never read it and it
    is not part of the training batch; ``extra`` is the backend's (what the server returned with the sample).
    """

    role: str
    turn: int
    index: int
    """Position in the group (0 .. K-1)."""
    group_key: str
    prompt_ids: list[int]
    response_ids: list[int]
    """The sampled ids exactly as the server returned them (never re-tokenized)."""
    logprobs: list[float] | None
    """Rollout log-probs of ``response_ids`` (None if the backend returned none)."""
    text: str
    """``response_ids`` decoded, special tokens skipped."""
    stop_reason: str | None = None
    trainable: bool = True
    """False when the sample was lost to an infrastructure failure (or left unrewarded by an aborted episode)."""
    infra_error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    """The workflow's per-candidate data (see the class docstring); starts empty, never read by the engine."""
    parse_failed: bool = False
    committed: bool = False
    alpha: float = field(default=1.0, repr=False)
    _reward: float | None = field(default=None, repr=False)
    _team: float | None = field(default=None, repr=False)
    _local: float | None = field(default=None, repr=False)

    @property
    def reward(self) -> float | None:
        """The training reward: set directly, or ``alpha * team_reward + local_reward``; None if unset."""
        if self._reward is not None:
            return self._reward
        if self._team is None and self._local is None:
            return None
        return self.alpha * (self._team or 0.0) + (self._local or 0.0)

    @reward.setter
    def reward(self, value: float) -> None:
        if self._team is not None or self._local is not None:
            raise ValueError(
                f"candidate {self.index} of {self.group_key!r} already has team_reward/local_reward; setting "
                "reward as well would contradict reward = alpha * team + local. Set one or the other."
            )
        self._reward = _finite(value, f"reward of candidate {self.index} of {self.group_key!r}")

    @property
    def team_reward(self) -> float | None:
        """The task-level part of the reward (weighted by ``alpha``)."""
        return self._team

    @team_reward.setter
    def team_reward(self, value: float) -> None:
        self._check_no_direct_reward()
        self._team = _finite(value, f"team_reward of candidate {self.index} of {self.group_key!r}")

    @property
    def local_reward(self) -> float | None:
        """The role-specific part of the reward."""
        return self._local

    @local_reward.setter
    def local_reward(self, value: float) -> None:
        self._check_no_direct_reward()
        self._local = _finite(value, f"local_reward of candidate {self.index} of {self.group_key!r}")

    def _check_no_direct_reward(self) -> None:
        if self._reward is not None:
            raise ValueError(
                f"candidate {self.index} of {self.group_key!r} already has a reward set directly; use either "
                "reward or team_reward/local_reward, not both."
            )

    def as_message(self) -> dict[str, Any]:
        """This candidate as an assistant message that carries its sampled token ids.

        Appending it to a chat continues the conversation with exactly the sampled ids (no
        decode/re-encode drift).
        """
        if self.infra_error is not None:
            raise ValueError(
                f"candidate {self.index} of {self.group_key!r} failed ({self.infra_error}); it has no response"
            )
        return {"role": "assistant", "content": self.text, "token_ids": list(self.response_ids)}


class Candidates(Sequence[Candidate]):
    """The K candidates of one group (one role, one turn, one prompt).

    Iterating (and indexing) yields the candidates the model produced; candidates lost to
    infrastructure failures are in :attr:`failed` and :attr:`all` only. Every candidate is kept as a
    training sample; :meth:`best` commits one.
    """

    def __init__(
        self,
        *,
        role: str,
        turn: int,
        key: str,
        prompt_ids: list[int],
        messages: tuple[Mapping[str, Any], ...],
        members: list[Candidate],
        tie_break: str,
        tie_rng: random.Random,
        workflow_name: str,
    ) -> None:
        self.role = role
        self.turn = turn
        self.key = key
        self.prompt_ids = prompt_ids
        self.messages = messages
        self.all: list[Candidate] = members
        self._usable = [c for c in members if c.infra_error is None]
        self._tie_break = tie_break
        self._tie_rng = tie_rng
        self._workflow_name = workflow_name

    @overload
    def __getitem__(self, i: int) -> Candidate: ...
    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...
    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        return self._usable[i]

    def __len__(self) -> int:
        return len(self._usable)

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._usable)

    def __repr__(self) -> str:
        return f"Candidates({self.key!r}, {len(self._usable)}/{len(self.all)} usable, rewards={self.rewards})"

    @property
    def failed(self) -> list[Candidate]:
        """Candidates lost to infrastructure failures (not trainable)."""
        return [c for c in self.all if c.infra_error is not None]

    @property
    def rewards(self) -> list[float | None]:
        """Rewards of the usable candidates, in order."""
        return [c.reward for c in self._usable]

    @property
    def committed(self) -> Candidate | None:
        """The committed candidate, once :meth:`best` was called."""
        return next((c for c in self.all if c.committed), None)

    def best(self) -> Candidate:
        """Commit the highest-reward candidate and return it; the episode continues from it.

        Ties go to the first candidate, or to a seeded random one with ``tie_break="random"``.
        Calling it again returns the same candidate.

        Raises:
            WorkflowError: When a candidate has no reward yet.
        """
        done = self.committed
        if done is not None:
            return done
        missing = [c.index for c in self._usable if c.reward is None]
        if missing:
            raise WorkflowError(
                f"workflow {self._workflow_name!r}, role {self.role!r}, turn {self.turn}: best() was called on group "
                f"{self.key!r} but candidates {missing} have no reward. Every candidate is a training sample and is "
                "ranked by its reward; set candidate.reward (or team_reward/local_reward) on every candidate "
                "before best(), including unparsable ones (low reward + parse_failed = True)."
            )
        if not self._usable:  # generate() raises InfraError before a workflow can get here
            raise WorkflowError(f"group {self.key!r} has no usable candidate to commit")
        top = max(c.reward for c in self._usable)  # type: ignore[type-var]
        ties = [c for c in self._usable if c.reward == top]
        chosen = ties[0] if self._tie_break == "first" or len(ties) == 1 else self._tie_rng.choice(ties)
        chosen.committed = True
        return chosen


def _short(text: str, width: int = 60) -> str:
    r = repr(text)
    return r if len(r) <= width else r[: width - 4] + "...'"


@dataclass
class Episode:
    """The record of one episode: every group (all K candidates each) and how the episode ended.

    ``terminated``: the workflow ended it (task solved/agreed, or it stopped early). ``truncated``: it ran
    out of ``max_turns``, or out of context (``context_overflow``: the next prompt did not fit the model;
    a failure of the workflow, ``mas/success`` 0). ``aborted``: an infrastructure failure ended it (see
    ``error``); the groups completed before it remain trainable.
    """

    workflow_id: str
    task_uid: str
    seed: int
    roles: tuple[str, ...]
    config: EpisodeConfig
    groups: list[Candidates]
    terminated: bool
    truncated: bool
    aborted: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    context_overflow: bool = False

    @property
    def num_turns(self) -> int:
        """Turns used: one more than the last turn in which any role generated."""
        return 1 + max((g.turn for g in self.groups), default=-1)

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate of every group, in the order the groups were requested."""
        return [c for g in self.groups for c in g.all]

    @property
    def turns(self) -> list[list[Candidates]]:
        """Groups by turn: ``episode.turns[t]`` lists the groups of turn ``t``, in request order."""
        out: list[list[Candidates]] = [[] for _ in range(self.num_turns)]
        for g in self.groups:
            out[g.turn].append(g)
        return out

    @property
    def committed_branch(self) -> list[Candidate]:
        """The committed candidates, in request order: the path the episode actually took."""
        return [g.committed for g in self.groups if g.committed is not None]

    def trainable(self) -> list[Candidate]:
        """The candidates to train on (excludes infrastructure failures)."""
        return [c for c in self.candidates if c.trainable]

    def validate(self) -> list[str]:
        """Check the record's invariants; returns every violation (empty when the record is sound)."""
        problems: list[str] = []
        K, T = self.config.branching, self.config.max_turns
        seen: set[str] = set()
        for g in self.groups:
            where = f"group {g.key!r}"
            if g.key != group_key(self.task_uid, g.role, g.turn):
                problems.append(f"{where}: key is not group_key({self.task_uid!r}, {g.role!r}, {g.turn})")
            if g.key in seen:
                problems.append(f"{where}: appears twice (a role generated twice in one turn)")
            seen.add(g.key)
            if g.role not in self.roles:
                problems.append(f"{where}: role {g.role!r} is not one of the declared roles {self.roles}")
            if not 0 <= g.turn < T:
                problems.append(f"{where}: turn {g.turn} is outside 0..{T - 1} (max_turns={T})")
            if len(g.all) != K:
                problems.append(f"{where}: has {len(g.all)} candidates, expected branching={K}")
            if sum(c.committed for c in g.all) > 1:
                problems.append(f"{where}: more than one candidate is committed")
            for c in g.all:
                who = f"{where} candidate {c.index}"
                if (c.group_key, c.role, c.turn) != (g.key, g.role, g.turn):
                    problems.append(f"{who}: its (group_key, role, turn) differ from its group's")
                if c.prompt_ids != g.prompt_ids:
                    problems.append(
                        f"{who}: prompt ids differ from the group's; every member of a group must share one prompt"
                    )
                if c.committed and not c.trainable:
                    problems.append(f"{who}: committed but not trainable")
                if not c.trainable:
                    if c.infra_error is None and not self.aborted:
                        problems.append(f"{who}: not trainable without an infrastructure failure")
                    continue
                r = c.reward
                if not isinstance(r, float) or not math.isfinite(r):
                    problems.append(f"{who}: reward {r!r} is not a finite float")
                if c.logprobs is not None and len(c.logprobs) != len(c.response_ids):
                    problems.append(f"{who}: {len(c.logprobs)} log-probs for {len(c.response_ids)} response ids")
        if not self.aborted and self.terminated == self.truncated:
            problems.append(f"terminated={self.terminated} and truncated={self.truncated}: exactly one must hold")
        for k, v in self.metrics.items():
            if not isinstance(k, str) or not isinstance(v, float) or not math.isfinite(v):
                problems.append(f"metric {k!r} = {v!r} is not a finite float")
        return problems

    def transcript(self) -> str:
        """A readable account: roles, turns, every candidate with its reward, and the committed branch."""
        cfg = self.config
        lines = [
            f"episode {self.workflow_id} | task {self.task_uid} | seed {self.seed} | "
            f"K={cfg.branching} T={cfg.max_turns} alpha={cfg.alpha} | roles {', '.join(self.roles)}"
        ]
        for t, groups in enumerate(self.turns):
            lines.append(f"turn {t}")
            for g in groups:
                last = g.messages[-1] if g.messages else {}
                lines.append(
                    f"  {g.role}  [{g.key}]  prompt {len(g.prompt_ids)} tokens; last {last.get('role', '?')} "
                    f"message: {_short(str(last.get('content', '')), 70)}"
                )
                for c in g.all:
                    mark = "*" if c.committed else " "
                    if c.infra_error is not None:
                        lines.append(f"    {mark} #{c.index}  NOT TRAINABLE (infrastructure): {c.infra_error}")
                        continue
                    r = "unrewarded" if c.reward is None else f"{c.reward:+.3f}"
                    parts = []
                    if c.team_reward is not None:
                        parts.append(f"team {c.team_reward:+.3f}")
                    if c.local_reward is not None:
                        parts.append(f"local {c.local_reward:+.3f}")
                    if c.parse_failed:
                        parts.append("parse failed")
                    if not c.trainable:
                        parts.append("not trainable")
                    detail = f" ({'; '.join(parts)})" if parts else ""
                    lines.append(
                        f"    {mark} #{c.index}  reward {r}{detail}  {len(c.response_ids)} tok  {_short(c.text)}"
                    )
        lines.append("committed branch:")
        for c in self.committed_branch:
            lines.append(f"  turn {c.turn}  {c.role}: {_short(c.text)}  (reward {c.reward:+.3f})")
        if self.aborted:
            outcome = f"aborted after {self.num_turns} turns: {self.error}"
        elif self.context_overflow:
            outcome = f"out of context after {self.num_turns} turns: {self.error}"
        else:
            outcome = f"{'terminated' if self.terminated else 'truncated'} after {self.num_turns} turns"
        lines.append(f"outcome: {outcome}")
        if self.metrics:
            lines.append("metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(self.metrics.items())))
        return "\n".join(lines)
