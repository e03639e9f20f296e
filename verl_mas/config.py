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

import math
import re
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

from verl_mas.advantage.groups import GROUPING_MODES
from verl_mas.episode import EpisodeConfig, EpisodeSettings

__all__ = ["MasConfig", "MasConfigError", "check_run_config"]

#: ``mas.sampling`` values: K candidates per node of one episode, or K independent episodes per task.
SAMPLINGS = ("tree", "parallel")
DEFAULT_POLICY = "default"
#: Blocks of verl's ``actor_rollout_ref`` a policy may override.
POLICY_BLOCKS = ("model", "actor", "rollout", "ref")
#: A policy's own placement (not part of actor_rollout_ref): ``resources: {n_gpus_per_node: N, nnodes: M}``.
POLICY_RESOURCES = "resources"
_POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,31}")
#: Settings a role may have under ``mas.roles.<role>``.
ROLE_KEYS = ("policy", "chat_template_kwargs")
#: Keys of ``actor_rollout_ref.rollout`` that one process reads for every policy (verl's agent-loop workers
#: size, sample and post-process every request with the first policy's values), so a policy cannot change them.
SHARED_ROLLOUT_KEYS = ("n", "prompt_length", "response_length", "max_model_len", "calculate_log_probs", "agent",
                       "multi_turn", "mode", "name", "full_determinism")
#: Rollout backends whose servers are named and weight-synced per policy (``rollout.custom.mas_policy``).
POLICY_AWARE_ROLLOUTS = ("hf",)
#: The paper's comparisons as Hydra overrides of a recipe (what each computes: docs/training.md, "Ablations").
#: The learning benchmark and the main_ppo tests run exactly these.
ABLATIONS: dict[str, tuple[str, ...]] = {
    "at_grpo": ("mas.sampling=tree", "mas.grouping=agent_turn", "mas.branching=4", "actor_rollout_ref.rollout.n=1"),
    "role_only_groups": ("mas.sampling=tree", "mas.grouping=agent", "mas.branching=4", "actor_rollout_ref.rollout.n=1"),
    "trajectory_grpo": ("mas.sampling=parallel", "mas.grouping=trajectory", "mas.branching=1",
                        "actor_rollout_ref.rollout.n=4"),
    "parallel_sampling": ("mas.sampling=parallel", "mas.grouping=agent_turn", "mas.branching=1",
                          "actor_rollout_ref.rollout.n=4"),
}


class MasConfigError(ValueError):
    """The ``mas:`` block is invalid; the message lists every problem with its fix."""


@dataclass(frozen=True)
class MasConfig(EpisodeSettings):
    """The ``mas:`` block: the episode settings (``branching``, ``max_turns``, ``alpha``, ``tie_break``,
    ``request_timeout_s``, declared once in :class:`verl_mas.episode.EpisodeSettings`) and the rest below."""

    grouping: str = "agent_turn"
    """Advantage groups: ``agent_turn`` (AT-GRPO: task, role, turn), ``agent`` (task, role) or
    ``trajectory`` (task: classic GRPO over whole episodes; use with ``sampling: parallel``)."""
    sampling: str = "tree"
    """``tree``: K candidates per node, the best committed (AT-GRPO). ``parallel``: K independent episodes
    from the start state (set ``actor_rollout_ref.rollout.n`` to K; branching is forced to 1)."""
    singleton_advantage: str = "zero"
    """Advantage of a one-member group: ``zero`` (no baseline, no signal) or ``raw`` (its reward)."""
    check_group_prompts: bool = True
    """Check on every batch that all members of a group were sampled from one prompt (raise if not)."""
    workflow: str | None = None
    """Workflow id for rows that do not name one (rows from ``python -m verl_mas.data`` always do)."""
    roles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-role settings: ``{role: {policy: <name in policies>, chat_template_kwargs: {...}}}``. With one
    policy unlisted roles use it; with several, every role of the workflow must be listed.
    ``chat_template_kwargs`` are merged over verl's ``data.apply_chat_template_kwargs`` for that role's
    prompts (e.g. ``{enable_thinking: true}`` for a reasoner while the other roles keep Qwen3's
    non-thinking mode)."""
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
    replay_poll_interval_s: float = 0.2
    """How often the trainer checks whether the step's episodes have finished (verl's default: 2 s)."""
    _check: InitVar[bool] = True
    """False builds the block without raising (:func:`check_run_config` collects its problems with the rest)."""

    def __post_init__(self, _check: bool) -> None:
        if _check:
            problems = self.problems()
            if problems:
                raise MasConfigError("Invalid mas: config block:\n  - " + "\n  - ".join(problems))

    def problems(self) -> list[str]:
        from verl_mas.advantage.at_grpo import SINGLETON_POLICIES  # torch: only where a block is validated

        out = self.setting_problems(prefix="mas.")  # branching, max_turns, alpha, tie_break, request_timeout_s
        if isinstance(self.val_branching, bool) or not isinstance(self.val_branching, int) or self.val_branching < 1:
            out.append(f"mas.val_branching is {self.val_branching!r}; it must be an integer >= 1 (1: single-sample).")
        poll = self.replay_poll_interval_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not math.isfinite(poll) or poll <= 0:
            out.append(f"mas.replay_poll_interval_s is {self.replay_poll_interval_s!r}; it must be > 0 seconds.")
        if not isinstance(self.check_group_prompts, bool):
            out.append(f"mas.check_group_prompts is {self.check_group_prompts!r}; it must be true or false.")
        for name, value, allowed in (
            ("grouping", self.grouping, GROUPING_MODES),
            ("sampling", self.sampling, SAMPLINGS),
            ("singleton_advantage", self.singleton_advantage, SINGLETON_POLICIES),
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
        if not isinstance(self.roles, Mapping):
            return out + [f"mas.roles is {self.roles!r}; it must map role names to {{policy: <name>}}."]
        for role, settings in self.roles.items():
            settings = settings or {}
            if not isinstance(settings, Mapping) or set(settings) - set(ROLE_KEYS):
                out.append(f"mas.roles.{role} is {settings!r}; the per-role settings are {list(ROLE_KEYS)} "
                           "(policy: <name>, chat_template_kwargs: {...}).")
                continue
            kwargs = settings.get("chat_template_kwargs")
            if kwargs is not None and not isinstance(kwargs, Mapping):
                out.append(f"mas.roles.{role}.chat_template_kwargs is {kwargs!r}; it must be a mapping, e.g. "
                           "{enable_thinking: false}.")
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
            missing = [r for r in roles
                       if not isinstance(self.roles.get(r), Mapping) or self.roles[r].get("policy") is None]
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

    def episode_config_for(
        self,
        *,
        validate: bool,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> EpisodeConfig:
        """The engine's view of this block for training or validation episodes.

        Args:
            validate: Validation episodes sample ``val_branching`` candidates per node.
            chat_template_kwargs: verl's ``data.apply_chat_template_kwargs`` (e.g. ``{enable_thinking:
                false}`` for Qwen3's non-thinking mode), used for every role's prompts; a role's own
                ``mas.roles.<role>.chat_template_kwargs`` are merged over them.
            max_prompt_tokens: The longest prompt the rollout can answer (a longer one ends the episode).
        """
        settings = {f.name: getattr(self, f.name) for f in fields(EpisodeSettings)}
        return EpisodeConfig(
            **{**settings, "branching": self.val_branching if validate else self.branching},
            chat_template_kwargs=dict(chat_template_kwargs or {}),
            role_chat_template_kwargs={
                role: dict(settings["chat_template_kwargs"])
                for role, settings in self.roles.items()
                if settings and settings.get("chat_template_kwargs")
            },
            max_prompt_tokens=max_prompt_tokens,
        )

    @classmethod
    def from_mapping(cls, block: Mapping[str, Any] | None) -> MasConfig:
        """Build from the recipe's ``mas:`` block (a dict or an OmegaConf node); unknown keys are errors.

        Raises:
            MasConfigError: listing every problem of the block.
        """
        mas, problems = cls.parse(block)
        if problems:
            raise MasConfigError("Invalid mas: config block:\n  - " + "\n  - ".join(problems))
        return mas

    @classmethod
    def parse(cls, block: Mapping[str, Any] | None) -> tuple[MasConfig, list[str]]:
        """The block (unknown keys left out) and every problem with it, without raising."""
        if block is None:
            return cls(), []
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(block, DictConfig):
                block = OmegaConf.to_container(block, resolve=True)  # type: ignore[assignment]
        except ImportError:  # plain dicts only
            pass
        if not isinstance(block, Mapping):
            return cls(), [f"the mas: block is {block!r}; it must be a mapping of settings (see docs/training.md)."]
        data = dict(block)
        known = {f.name for f in fields(cls)}
        problems = []
        unknown = sorted(set(data) - known)
        if unknown:
            problems.append(
                f"Unknown keys in the mas: config block: {unknown}. Known keys: {sorted(known)}. Check the spelling (keys "
                "are validated so that a typo cannot silently fall back to a default)."
            )
        mas = cls(**{k: v for k, v in data.items() if k in known}, _check=False)
        return mas, problems + mas.problems()

    @classmethod
    def from_verl_config(cls, config: Any) -> MasConfig:
        """Read ``config.mas`` from verl's full config (absent: defaults)."""
        block = config.get("mas", None) if hasattr(config, "get") else getattr(config, "mas", None)
        return cls.from_mapping(block)



#: Set by the ``mas`` trainer in ``trainer.v1`` (which then reads ``trainer_mode: sync`` for verl's own checks):
#: the ``mas`` agent loop refuses to run without it.
MAS_TRAINER_MARK = "mas_trainer"


def mas_trainer_selected(config: Any) -> bool:
    """Whether verl's config runs the ``mas`` trainer mode (before or after the trainer has started)."""
    trainer = config.get("trainer", None) if hasattr(config, "get") else None
    v1 = (trainer.get("v1", None) if trainer is not None else None) or {}
    return v1.get("trainer_mode", None) == "mas" or bool(v1.get(MAS_TRAINER_MARK, False))


def check_run_config(config: Any) -> tuple[MasConfig, dict[str, Any]]:
    """Every start-up problem of a verl_mas run, collected in one pass and raised once.

    Checks the ``mas:`` block, the algorithm and sampling settings it implies, every policy's overrides
    (unknown keys, keys one process reads for all policies, rollout backends that cannot serve several
    policies) and the routing of every role of every workflow in the data.

    Args:
        config: verl's full config (``algorithm``, ``actor_rollout_ref``, ``data``, ``mas``, ...).

    Returns:
        The ``mas:`` block and each policy's full ``actor_rollout_ref``.

    Raises:
        MasConfigError: listing every problem, each with its fix.
    """
    from verl_mas.advantage.at_grpo import ESTIMATOR_NAME, SINGLETON_KEY
    from verl_mas.policies import policy_configs_and_problems

    block = config.get("mas", None) if hasattr(config, "get") else None
    mas, problems = MasConfig.parse(block)
    algorithm = config.algorithm
    estimator = algorithm.adv_estimator
    if estimator != ESTIMATOR_NAME:
        problems.append(
            f"algorithm.adv_estimator is {estimator!r}, but trainer.v1.trainer_mode=mas builds AT-GRPO groups "
            f"for the {ESTIMATOR_NAME!r} estimator. Set algorithm.adv_estimator={ESTIMATOR_NAME}."
        )
    chosen = algorithm.get(SINGLETON_KEY, None)
    if chosen is not None and chosen != mas.singleton_advantage:
        problems.append(
            f"algorithm.{SINGLETON_KEY} is {chosen!r} but mas.singleton_advantage is {mas.singleton_advantage!r}; "
            f"the mas trainer sets algorithm.{SINGLETON_KEY} from mas.singleton_advantage. Set only the latter."
        )
    n = int(config.actor_rollout_ref.rollout.n)
    if mas.sampling == "tree" and n != 1:
        problems.append(
            f"actor_rollout_ref.rollout.n is {n}, but mas.sampling=tree samples K={mas.branching} candidates "
            "inside each episode; extra sessions would be independent episodes. Set rollout.n=1."
        )
    if mas.sampling == "parallel" and n < 2:
        problems.append(
            "mas.sampling=parallel draws K independent episodes per task through verl's rollout.n; set "
            "actor_rollout_ref.rollout.n=K (e.g. 4)."
        )
    if mas.grouping == "trajectory" and mas.sampling != "parallel":
        problems.append(
            "mas.grouping=trajectory normalises each episode's outcome over the task's episodes, but "
            f"mas.sampling={mas.sampling} runs one episode per task, so every group would be a singleton "
            "(no signal). Use mas.sampling=parallel mas.branching=1 actor_rollout_ref.rollout.n=K."
        )
    configs: dict[str, Any] = {}
    if isinstance(mas.policies, Mapping) and mas.policies:
        configs, override_problems = policy_configs_and_problems(config.actor_rollout_ref, mas)
        problems.extend(override_problems)
        if configs:
            problems.extend(_shared_rollout_problems(configs, mas))
    if mas.multi_policy and isinstance(mas.roles, Mapping):
        problems.extend(mas.routing_problems(_roles_of_workflows(config, mas)))
    if problems:
        raise MasConfigError(
            f"verl_mas cannot start: {len(problems)} problem(s) in the config:\n  - " + "\n  - ".join(problems)
        )
    return mas, configs


def _shared_rollout_problems(configs: Mapping[str, Any], mas: MasConfig) -> list[str]:
    """Per-policy rollout settings that verl reads once for all policies, and backends that are not policy-aware."""
    out: list[str] = []
    names = list(configs)
    first = configs[names[0]].rollout
    for name in names[1:]:
        rollout = configs[name].rollout
        for key in SHARED_ROLLOUT_KEYS:
            if rollout.get(key, None) != first.get(key, None):
                out.append(
                    f"mas.policies.{name}.rollout.{key} is {rollout.get(key, None)!r} but the first policy's is "
                    f"{first.get(key, None)!r}: verl's agent-loop workers size, sample and post-process every "
                    f"request with one actor_rollout_ref.rollout.{key}, so a policy cannot change it. Set it in "
                    "actor_rollout_ref.rollout for every policy."
                )
        val_n = (rollout.get("val_kwargs", None) or {}).get("n", None)
        if val_n != (first.get("val_kwargs", None) or {}).get("n", None):
            out.append(
                f"mas.policies.{name}.rollout.val_kwargs.n is {val_n!r}: validation sessions per task are one "
                "setting for all policies. Set actor_rollout_ref.rollout.val_kwargs.n instead."
            )
    if mas.multi_policy:
        backends = sorted({str(c.rollout.name) for c in configs.values()} - set(POLICY_AWARE_ROLLOUTS))
        if backends:
            out.append(
                f"several trainable policies ({names}) with actor_rollout_ref.rollout.name={backends[0]!r}: verl "
                "0.9.1's vLLM/SGLang hybrid servers derive their actor names and weight-sync sockets from the "
                "replica rank inside one worker group, so a second policy's servers collide with the first's "
                "(generation and weight sync reach the wrong model). Only the policy-aware backends "
                f"{list(POLICY_AWARE_ROLLOUTS)} can serve several policies today; use one shared policy on "
                f"{backends[0]}, or rollout.name=hf (docs/policies.md)."
            )
    return out


def _roles_of_workflows(config: Any, mas: MasConfig) -> dict[str, tuple[str, ...]]:
    """The roles of every workflow named by the train/validation rows (or mas.workflow)."""
    from verl_mas.registry import get_workflow

    return {w: tuple(get_workflow(w).roles)
            for w in workflows_in_data(config) or ([mas.workflow] if mas.workflow else [])}


def workflows_in_data(config: Any) -> list[str]:
    """Workflow ids named by the rows of the train and validation parquet files (``extra_info.workflow``)."""
    import os

    import pyarrow.parquet as pq

    found: set[str] = set()
    for key in ("train_files", "val_files"):
        files = config.data.get(key)
        if not files:
            continue
        for path in [files] if isinstance(files, str) else list(files):
            if not os.path.exists(path):
                continue  # verl reports missing data files itself
            table = pq.read_table(path, columns=["extra_info"])
            for info in table.column("extra_info").to_pylist():
                if info and info.get("workflow"):
                    found.add(str(info["workflow"]))
    return sorted(found)
