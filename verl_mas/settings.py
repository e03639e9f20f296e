"""Episode settings: what a recipe chooses for its episodes (K, T, alpha, tie-break, request timeout) and the
engine's full view of them, declared and validated once.

:class:`EpisodeSettings` holds the settings a recipe sets; the ``mas:`` block (:class:`verl_mas.config.MasConfig`)
extends it with the training settings, and :class:`EpisodeConfig` with what the serving side adds (chat-
template variables, the longest prompt the model can answer). One validator serves both, so a value the
engine would refuse is refused at start-up too, with its ``mas.`` key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EpisodeConfig", "EpisodeSettings", "TIE_BREAKS"]


#: ``tie_break`` values: which of several best candidates :meth:`Candidates.best` commits.
TIE_BREAKS = ("first", "random")


def _int_at_least_one(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class EpisodeSettings:
    """The settings of an episode a recipe chooses: declared and validated here once, shared by the engine's
    :class:`EpisodeConfig` and the ``mas:`` block (:class:`verl_mas.config.MasConfig`)."""

    branching: int = 4
    """K: candidates sampled per (task, role, turn) from one prompt (1 disables the tree; the paper: 4)."""
    max_turns: int = 4
    """T: the most turns an episode may use; an episode that runs out is truncated (the paper: 4)."""
    alpha: float = 1.0
    """Weight of the team reward: ``reward = alpha * team_reward + local_reward`` (the paper: 1)."""
    tie_break: str = "first"
    """Which of several best candidates ``best()`` commits: ``"first"`` or ``"random"`` (seeded)."""
    request_timeout_s: float | None = None
    """Per-group timeout of a model request; a timeout is an infrastructure failure (never a training
    sample). None: no timeout."""

    def setting_problems(self, prefix: str = "") -> list[str]:
        """Every problem with the settings above, each naming its key with ``prefix`` (e.g. ``"mas."``)."""
        out: list[str] = []
        if not _int_at_least_one(self.branching):
            out.append(f"{prefix}branching is {self.branching!r}; it must be an int >= 1 (K candidates per group; "
                       "the paper uses 4)")
        if not _int_at_least_one(self.max_turns):
            out.append(f"{prefix}max_turns is {self.max_turns!r}; it must be an int >= 1 (the paper uses 4)")
        if not _finite_number(self.alpha):
            out.append(f"{prefix}alpha is {self.alpha!r}; it must be a finite number (reward = alpha * team + local; "
                       "the paper uses 1.0)")
        if self.tie_break not in TIE_BREAKS:
            out.append(f"{prefix}tie_break is {self.tie_break!r}; choose one of {list(TIE_BREAKS)}")
        t = self.request_timeout_s
        if t is not None and (not _finite_number(t) or not t > 0):
            out.append(f"{prefix}request_timeout_s is {t!r}; it must be a positive number of seconds, or None")
        return out


@dataclass(frozen=True)
class EpisodeConfig(EpisodeSettings):
    """How episodes are sampled: the recipe's :class:`EpisodeSettings` plus what the serving side adds.
    Validated on construction; every problem is reported at once."""

    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Extra chat-template variables for every role's prompts, e.g. ``{"enable_thinking": False}`` for
    Qwen3's non-thinking mode (the agent loop passes verl's ``data.apply_chat_template_kwargs``)."""
    role_chat_template_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)
    """Per-role chat-template variables merged over ``chat_template_kwargs`` (``{role: {...}}``)."""
    max_prompt_tokens: int | None = None
    """The longest prompt the model can still answer (verl: the context length minus one token). A longer
    prompt ends the episode as a failure of the workflow (``mas/context_overflow``), before any request.
    None: no limit."""

    def __post_init__(self) -> None:
        self.validate()

    def problems(self) -> list[str]:
        """Every problem with this config (empty when valid)."""
        out = self.setting_problems()
        m = self.max_prompt_tokens
        if m is not None and not _int_at_least_one(m):
            out.append(f"max_prompt_tokens is {m!r}; it must be an int >= 1 or None")
        if not isinstance(self.chat_template_kwargs, Mapping):
            out.append(f"chat_template_kwargs is {type(self.chat_template_kwargs).__name__}; it must be a mapping")
        per_role = self.role_chat_template_kwargs
        if not isinstance(per_role, Mapping) or not all(isinstance(v, Mapping) for v in per_role.values()):
            out.append(f"role_chat_template_kwargs is {per_role!r}; it must map role names to mappings")
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` listing every problem, if any."""
        problems = self.problems()
        if problems:
            raise ValueError(f"invalid EpisodeConfig ({len(problems)} problems): " + "; ".join(problems) + ".")

    def chat_template_kwargs_for(self, role: str) -> dict[str, Any]:
        """The chat-template variables of ``role``'s prompts: the shared ones, then the role's own."""
        return {**self.chat_template_kwargs, **self.role_chat_template_kwargs.get(role, {})}
