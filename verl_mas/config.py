"""The typed ``mas:`` config block of a verl_mas recipe, validated once with every problem reported together.

A recipe adds this block next to verl's own (``algorithm``, ``actor_rollout_ref``, ...)::

    mas:
      branching: 4            # K candidates per (task, role, turn)
      max_turns: 4            # T
      alpha: 1.0              # reward = alpha * team + local
      grouping: agent_turn    # agent_turn | agent | trajectory
      sampling: tree          # tree | parallel
      roles: {}               # role -> {policy: name}; may be empty with one policy
      policies: {default: {}} # name -> overrides of actor_rollout_ref (one entry: a shared model)

Three levels, by config alone (see docs/policies.md):

- shared: one policy (the default) serves every role;
- per-role models: ``policies: {caller: {}, runner: {model: {path: ...}}}`` and every role routed;
- per-role LoRA: every policy sets ``model: {lora_rank: r}`` on the same base model.

The agent loop (in verl's agent-loop workers) and the ``mas`` trainer (in verl's TaskRunner) both read it
from verl's config, so both see the same validated values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from verl_mas.episode import EpisodeConfig

__all__ = ["MasConfig", "MasConfigError"]

GROUPINGS = ("agent_turn", "agent", "trajectory")
SAMPLINGS = ("tree", "parallel")
SINGLETONS = ("zero", "raw")
DEFAULT_POLICY = "default"
#: Blocks of verl's ``actor_rollout_ref`` a policy may override.
POLICY_BLOCKS = ("model", "actor", "rollout", "ref")
#: A policy's own placement (not part of actor_rollout_ref): ``resources: {n_gpus_per_node: N, nnodes: M}``.
POLICY_RESOURCES = "resources"
_POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,31}")


class MasConfigError(ValueError):
    """The ``mas:`` block is invalid; the message lists every problem with its fix."""


@dataclass(frozen=True)
class MasConfig:
    """The ``mas:`` block."""

    branching: int = 4
    """K: candidates sampled from one prompt at every (task, role, turn) (tree sampling)."""
    max_turns: int = 4
    """T: the most turns an episode may take; an episode that runs out is truncated."""
    alpha: float = 1.0
    """Weight of the team reward in ``reward = alpha * team + local``."""
    grouping: str = "agent_turn"
    """Advantage groups: ``agent_turn`` (AT-GRPO: task, role, turn), ``agent`` (task, role) or
    ``trajectory`` (task: classic GRPO over whole episodes; use with ``sampling: parallel``)."""
    sampling: str = "tree"
    """``tree``: K candidates per node, the best committed (AT-GRPO). ``parallel``: K independent episodes
    from the start state (set ``actor_rollout_ref.rollout.n`` to K; branching is forced to 1)."""
    tie_break: str = "first"
    """Which of several best candidates is committed: ``first`` or ``random`` (seeded)."""
    singleton_advantage: str = "zero"
    """Advantage of a one-member group: ``zero`` (no baseline, no signal) or ``raw`` (its reward)."""
    check_group_prompts: bool = True
    """Check on every batch that all members of a group were sampled from one prompt (raise if not)."""
    workflow: str | None = None
    """Workflow id for rows that do not name one (rows from ``python -m verl_mas.data`` always do)."""
    roles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-role settings: ``{role: {policy: <name in policies>}}``. With one policy unlisted roles use it;
    with several, every role of the workflow must be listed."""
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {DEFAULT_POLICY: {}})
    """The models that serve roles: ``{name: overrides}``, each override a partial ``actor_rollout_ref``
    (``model``, ``actor``, ``rollout``, ``ref`` blocks) applied on top of the recipe's. The first policy
    runs in verl's own actor/rollout stack; every further one gets its own worker group, rollout
    servers and weight sync, on verl's pool or, with ``resources: {n_gpus_per_node: N}``, on its own."""
    sandbox: Mapping[str, Any] = field(default_factory=dict)
    """Settings of the code sandbox (see ``verl_mas.sandbox``)."""
    val_branching: int = 1
    """K of validation episodes (rows whose ``extra_info.split`` is ``test``, as ``python -m verl_mas.data``
    writes them). 1 (default): every node commits its only sample, so verl's ``val-core/<source>/acc``
    is single-sample team success, comparable across sampling modes (training success under tree
    sampling includes best-of-K commits)."""
    request_timeout_s: float | None = None
    """Per-group timeout of a model request (an infrastructure failure, never a training sample)."""
    replay_poll_interval_s: float = 0.2
    """How often the trainer checks whether the step's episodes have finished (verl's default: 2 s)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise MasConfigError("Invalid mas: config block:\n  - " + "\n  - ".join(problems))

    def problems(self) -> list[str]:
        out: list[str] = []
        if not isinstance(self.branching, int) or self.branching < 1:
            out.append(f"mas.branching is {self.branching!r}; it must be an integer >= 1 (the paper uses 4).")
        if not isinstance(self.val_branching, int) or self.val_branching < 1:
            out.append(f"mas.val_branching is {self.val_branching!r}; it must be an integer >= 1 (1: single-sample).")
        if not self.replay_poll_interval_s > 0:
            out.append(f"mas.replay_poll_interval_s is {self.replay_poll_interval_s!r}; it must be > 0 seconds.")
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            out.append(f"mas.max_turns is {self.max_turns!r}; it must be an integer >= 1 (the paper uses 4).")
        for name, value, allowed in (
            ("grouping", self.grouping, GROUPINGS),
            ("sampling", self.sampling, SAMPLINGS),
            ("tie_break", self.tie_break, ("first", "random")),
            ("singleton_advantage", self.singleton_advantage, SINGLETONS),
        ):
            if value not in allowed:
                out.append(f"mas.{name} is {value!r}; use one of {list(allowed)}.")
        if self.sampling == "parallel" and self.branching != 1:
            out.append(
                f"mas.sampling is 'parallel' but mas.branching is {self.branching}: parallel sampling draws K "
                "independent episodes (actor_rollout_ref.rollout.n=K) with one candidate per node; set "
                "mas.branching=1."
            )
        out.extend(self._policy_problems())
        if self.sandbox:
            from verl_mas.sandbox import SandboxConfig

            try:
                SandboxConfig.from_dict(dict(self.sandbox))
            except ValueError as exc:  # reported with the other problems, not swallowed
                out.append(f"mas.sandbox: {exc}")
        return out

    def _policy_problems(self) -> list[str]:
        out: list[str] = []
        if not isinstance(self.policies, Mapping) or not self.policies:
            return [f"mas.policies is {self.policies!r}; declare at least one policy, e.g. {{default: {{}}}}."]
        for name, overrides in self.policies.items():
            if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
                out.append(
                    f"mas.policies has the name {name!r}; policy names start with a letter and use letters, digits "
                    "and '-' (at most 32 characters): they name Ray actors and checkpoint folders."
                )
            if overrides is None:
                continue
            if not isinstance(overrides, Mapping):
                out.append(f"mas.policies.{name} is {overrides!r}; it must be a mapping of actor_rollout_ref overrides.")
                continue
            unknown = sorted(set(overrides) - set(POLICY_BLOCKS) - {POLICY_RESOURCES})
            if unknown:
                out.append(
                    f"mas.policies.{name} sets {unknown}; a policy overrides blocks of actor_rollout_ref "
                    f"{list(POLICY_BLOCKS)} (e.g. model: {{path: ...}}, actor: {{optim: {{lr: ...}}}}) and may "
                    f"set {POLICY_RESOURCES}: {{n_gpus_per_node: N}} for a resource pool of its own."
                )
            out.extend(self._resource_problems(name, overrides.get(POLICY_RESOURCES)))
        used = set()
        for role, settings in self.roles.items():
            settings = settings or {}
            if not isinstance(settings, Mapping) or set(settings) - {"policy"}:
                out.append(f"mas.roles.{role} is {settings!r}; the only per-role setting is policy: <name>.")
                continue
            policy = settings.get("policy")
            if policy is None and len(self.policies) == 1:
                policy = next(iter(self.policies))
            used.add(policy)
            if policy not in self.policies:
                out.append(
                    f"mas.roles.{role}.policy is {policy!r}, which is not one of mas.policies {list(self.policies)}. "
                    "Every role must be served by a declared policy; add it under mas.policies or fix the name."
                )
        if len(self.policies) > 1:
            unused = [p for p in self.policies if p not in used]
            if unused:
                out.append(
                    f"mas.policies {unused} serve no role. With several policies every policy must be routed: set "
                    "mas.roles.<role>.policy for the roles it should serve, or remove it."
                )
        return out

    def _resource_problems(self, name: str, resources: Any) -> list[str]:
        if resources is None:
            return []
        if name == next(iter(self.policies)):
            return [
                f"mas.policies.{name}.resources is set, but the first policy runs on verl's own pool "
                "(trainer.n_gpus_per_node x trainer.nnodes). Give a pool of its own only to further policies, "
                "or list another policy first."
            ]
        if not isinstance(resources, Mapping) or set(resources) - {"n_gpus_per_node", "nnodes"}:
            return [f"mas.policies.{name}.resources is {resources!r}; use {{n_gpus_per_node: N, nnodes: M}}."]
        bad = [k for k in ("n_gpus_per_node", "nnodes") if k in resources
               and (not isinstance(resources[k], int) or resources[k] < 1)]
        if "n_gpus_per_node" not in resources or bad:
            return [f"mas.policies.{name}.resources is {dict(resources)!r}; n_gpus_per_node (required) and nnodes "
                    "(default 1) must be integers >= 1."]
        return []

    def policy_resources(self, name: str) -> list[int] | None:
        """GPUs per node of the policy's own resource pool, or None when it shares verl's pool."""
        resources = (self.policies.get(name) or {}).get(POLICY_RESOURCES)
        if not resources:
            return None
        return [int(resources["n_gpus_per_node"])] * int(resources.get("nnodes", 1))

    @property
    def policy_names(self) -> list[str]:
        """The declared policies in order; the first runs in verl's own actor/rollout stack."""
        return list(self.policies)

    @property
    def multi_policy(self) -> bool:
        return len(self.policies) > 1

    def policy_of(self, role: str) -> str:
        """The policy that serves ``role``.

        Raises:
            MasConfigError: Several policies are declared and ``role`` is not routed to one.
        """
        settings = self.roles.get(role) or {}
        policy = settings.get("policy")
        if policy is not None:
            return str(policy)
        if len(self.policies) == 1:
            return next(iter(self.policies))
        raise MasConfigError(
            f"Role {role!r} is not routed to a policy: mas.policies declares {list(self.policies)} and "
            f"mas.roles has no entry for {role!r}. Add mas.roles.{role}.policy=<one of them>."
        )

    def routing_problems(self, roles_by_workflow: Mapping[str, tuple[str, ...]]) -> list[str]:
        """Problems routing the roles of the given workflows (all unrouted roles, reported together)."""
        if len(self.policies) == 1:
            return []
        out = []
        for workflow_id, roles in sorted(roles_by_workflow.items()):
            missing = [r for r in roles if (self.roles.get(r) or {}).get("policy") is None]
            if missing:
                out.append(
                    f"workflow {workflow_id!r} has roles {missing} that no policy serves: with several policies "
                    f"({list(self.policies)}) every role needs mas.roles.<role>.policy."
                )
        return out

    @property
    def episode_config(self) -> EpisodeConfig:
        """The engine's view of this block (training episodes)."""
        return self.episode_config_for(validate=False)

    def episode_config_for(self, *, validate: bool) -> EpisodeConfig:
        """The engine's view of this block for training or validation episodes."""
        return EpisodeConfig(
            branching=self.val_branching if validate else self.branching,
            max_turns=self.max_turns,
            alpha=float(self.alpha),
            tie_break=self.tie_break,
            request_timeout_s=self.request_timeout_s,
        )

    @classmethod
    def from_mapping(cls, block: Mapping[str, Any] | None) -> MasConfig:
        """Build from the recipe's ``mas:`` block (a dict or an OmegaConf node); unknown keys are errors."""
        if block is None:
            return cls()
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(block, DictConfig):
                block = OmegaConf.to_container(block, resolve=True)  # type: ignore[assignment]
        except ImportError:  # plain dicts only
            pass
        data = dict(block)  # type: ignore[arg-type]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MasConfigError(
                f"Unknown keys in the mas: config block: {unknown}. Known keys: {sorted(known)}. "
                "Check the spelling (keys are validated so that a typo cannot silently fall back to a default)."
            )
        return cls(**data)

    @classmethod
    def from_verl_config(cls, config: Any) -> MasConfig:
        """Read ``config.mas`` from verl's full config (absent: defaults)."""
        block = config.get("mas", None) if hasattr(config, "get") else getattr(config, "mas", None)
        return cls.from_mapping(block)
