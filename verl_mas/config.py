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
- per-role LoRA: every policy sets ``model: {lora_rank: r}`` on the same base model (one resident base and
  an adapter per policy, ``lora_base: shared``).

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
from verl_mas.settings import EpisodeConfig, EpisodeSettings

__all__ = ["ABLATIONS", "MAS_TRAINER_MARK", "ablation", "actor_rollout_ref_overrides", "MasConfig", "MasConfigError",
           "mas_trainer_selected"]

#: ``mas.sampling`` values: K candidates per node of one episode, or K independent episodes per task.
SAMPLINGS = ("tree", "parallel")
#: ``mas.trajectory_reward`` values (what a sample scores under ``grouping: trajectory``).
TRAJECTORY_REWARDS = ("return", "success")
#: ``mas.lora_base`` values (verl_mas.policies.adapters).
LORA_BASES = ("shared", "per_policy")
DEFAULT_POLICY = "default"
#: Blocks of verl's ``actor_rollout_ref`` a policy may override.
POLICY_BLOCKS = ("model", "actor", "rollout", "ref")
#: A policy's own placement (not part of actor_rollout_ref): ``resources: {n_gpus_per_node: N, nnodes: M}``.
POLICY_RESOURCES = "resources"
#: A policy that serves its roles but takes no optimiser step (not part of actor_rollout_ref): ``frozen: true``.
POLICY_FROZEN = "frozen"
#: A policy's settings of its own, next to its actor_rollout_ref overrides (:func:`actor_rollout_ref_overrides`).
POLICY_OWN_KEYS = (POLICY_RESOURCES, POLICY_FROZEN)
#: A policy name (it names Ray actors and checkpoint folders).
POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,31}")
#: Settings a role may have under ``mas.roles.<role>``.
ROLE_KEYS = ("policy", "chat_template_kwargs")
#: The paper's comparisons as Hydra overrides of a recipe (what each computes: docs/training.md, "Ablations").
#: The learning benchmark and the main_ppo tests run exactly these.
ABLATIONS: dict[str, tuple[str, ...]] = {
    "at_grpo": ("mas.sampling=tree", "mas.grouping=agent_turn", "mas.branching=4", "actor_rollout_ref.rollout.n=1"),
    "role_only_groups": ("mas.sampling=tree", "mas.grouping=agent", "mas.branching=4", "actor_rollout_ref.rollout.n=1"),
    "trajectory_grpo": ("mas.sampling=parallel", "mas.grouping=trajectory", "mas.trajectory_reward=return",
                        "mas.branching=1", "actor_rollout_ref.rollout.n=4"),
    "trajectory_grpo_success": ("mas.sampling=parallel", "mas.grouping=trajectory", "mas.trajectory_reward=success",
                                "mas.branching=1", "actor_rollout_ref.rollout.n=4"),
    "parallel_sampling": ("mas.sampling=parallel", "mas.grouping=agent_turn", "mas.branching=1",
                          "actor_rollout_ref.rollout.n=4"),
}



def ablation(name: str, k: int = 4) -> tuple[str, ...]:
    """:data:`ABLATIONS` ``[name]`` with ``K = k``: candidates per node (tree) or independent episodes per task
    (parallel), so that every configuration draws the same number of samples per task."""
    return tuple(o.replace("mas.branching=4", f"mas.branching={k}").replace("rollout.n=4", f"rollout.n={k}")
                 for o in ABLATIONS[name])


def actor_rollout_ref_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``mas.policies.<name>`` entry without the policy's own settings (:data:`POLICY_OWN_KEYS`): what it
    overrides of the recipe's ``actor_rollout_ref``."""
    return {k: v for k, v in (overrides or {}).items() if k not in POLICY_OWN_KEYS}


class MasConfigError(ValueError):
    """The ``mas:`` block is invalid; the message lists every problem with its fix."""


@dataclass(frozen=True)
class MasConfig(EpisodeSettings):
    """The ``mas:`` block: the episode settings (``branching``, ``max_turns``, ``alpha``, ``tie_break``,
    ``request_timeout_s``, declared once in :class:`verl_mas.settings.EpisodeSettings`) and the rest below."""

    grouping: str = "agent_turn"
    """Advantage groups: ``agent_turn`` (AT-GRPO: task, role, turn), ``agent`` (task, role) or
    ``trajectory`` (task: classic GRPO over whole episodes; use with ``sampling: parallel``)."""
    trajectory_reward: str = "return"
    """What a sample scores under ``grouping: trajectory`` (classic GRPO over whole episodes): ``return`` (default),
    its role's summed rewards over the episode (the same per-turn team and local rewards AT-GRPO normalises per
    turn, so the comparison with AT-GRPO isolates grouping and sampling from reward density), or ``success``, the
    episode's binary team outcome (``mas/success``) for every role. Groups are (task, role) with episodes as
    members either way: a role's return is its own, and under ``success`` every role of an episode scores alike."""
    sampling: str = "tree"
    """``tree``: K candidates per node, the best committed (AT-GRPO). ``parallel``: K independent episodes
    from the start state (set ``actor_rollout_ref.rollout.n`` to K; branching is forced to 1)."""
    singleton_advantage: str = "zero"
    """Advantage of a one-member group: ``zero`` (no baseline, no signal) or ``raw`` (its reward)."""
    check_group_prompts: bool = True
    """Check on every batch that all members of a group were sampled from one prompt (raise if not)."""
    drop_zero_variance: bool = True
    """(Default on: measured in ``recipes/at_grpo_cpu/README.md``.) Leave the rows of groups without signal (rewards all exactly equal, or one member under
    ``singleton_advantage: zero``) out of the step's log-probs and update: their advantage is exactly 0, so they
    carry no policy gradient but cost compute and, under token-mean loss aggregation, dilute the others. Whole
    groups are dropped (the kept groups' statistics are unchanged). verl's data metrics (``critic/*``,
    ``response_length/*``, ``perf/*``) and the ``mas/*`` metrics still describe every row; the metrics of
    verl's log-prob pass describe the kept rows only and are logged as ``mas/kept/<verl's name>``
    (``mas/kept/actor/entropy``, ``mas/kept/training/rollout_probs_diff_mean``); ``mas/drop/*`` counts what was
    dropped. The update takes fewer mini-batches of the size the whole batch's would have had
    (:func:`verl_mas.minibatch.dropped_rows_steps`); a policy none of whose groups has signal takes no optimiser
    step that step (``mas/drop/no_signal``). Refused at start-up with a KL loss, an entropy bonus or a KL penalty
    in the reward, which give dropped rows a gradient (:func:`verl_mas.startup.drop_problems`)."""
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
    servers and weight sync, on verl's pool or, with ``resources: {n_gpus_per_node: N}``, on its own.
    ``frozen: true`` keeps a policy at its initial weights while the others train (a fixed partner: the
    paper's roles trained alone): its roles act, its rows are grouped, scored and go through log-probs (its
    rollout-vs-actor gap and entropy are logged as any policy's), but it takes no optimiser step, so it logs
    no ``policy/<name>/actor/*`` update metrics; its weight sync and checkpoints go on unchanged. At least
    one policy must train."""
    per_role: Mapping[str, Any] | None = None
    """One policy per role of the data's workflows, without listing roles: ``{model: ..., actor: ...}``, the
    overrides every such policy gets (``{}``: the recipe's model, trained once per role). At start-up each role
    of every workflow the data names (in the workflows' role order) becomes a policy named after it, routed to
    it; ``mas.policies.<role>`` entries given as well are merged on top (a role's own model path or learning
    rate), ``mas.roles.<role>`` entries replace its route. Expanded by :func:`verl_mas.startup.expand_per_role`
    before anything reads ``policies`` or ``roles``."""
    lora_base: str = "shared"
    """When every policy is a LoRA adapter on one base model: ``shared`` (one worker group and one rollout hold
    the base once and every adapter; see :mod:`verl_mas.policies.adapters`) or ``per_policy`` (a stack per
    adapter, each with its own copy of the base)."""
    sandbox: Mapping[str, Any] = field(default_factory=dict)
    """Settings of the code sandbox (see ``verl_mas.sandbox``)."""
    val_branching: int = 1
    """K of validation episodes (rows whose ``extra_info.split`` is ``test``, as ``python -m verl_mas.data``
    writes them). 1 (default): every node commits its only sample, so verl's ``val-core/<source>/acc``
    is single-sample team success, comparable across sampling modes (training success under tree
    sampling includes best-of-K commits)."""
    val_greedy: bool = True
    """Validation also plays each task greedily (temperature 0, one candidate per node) and reports its team
    success as ``acc_greedy`` (``val-aux/<source>/acc_greedy/mean@n``) next to the sampled ``val-core/<source>/acc``
    (verl's ``val_kwargs``). Skipped when ``val_kwargs`` already decode greedily."""
    record: Mapping[str, Any] = field(default_factory=dict)
    """Episodes recorded for ``python -m verl_mas.view``: ``{dir: DIR, every_n_steps: N, episodes: M}`` (off
    unless ``dir`` is set; see :mod:`verl_mas.recording`)."""
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
        for name in ("check_group_prompts", "drop_zero_variance", "val_greedy"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"mas.{name} is {getattr(self, name)!r}; it must be true or false.")
        for name, value, allowed in (
            ("grouping", self.grouping, GROUPING_MODES),
            ("sampling", self.sampling, SAMPLINGS),
            ("singleton_advantage", self.singleton_advantage, SINGLETON_POLICIES),
            ("lora_base", self.lora_base, LORA_BASES),
            ("trajectory_reward", self.trajectory_reward, TRAJECTORY_REWARDS),
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
        from verl_mas.recording import RecordSettings

        out.extend(RecordSettings.parse(self.record)[1])
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
            if not isinstance(name, str) or not POLICY_NAME.fullmatch(name):
                out.append(
                    f"mas.policies has the name {name!r}; policy names start with a letter and use letters, digits "
                    "and '-' (at most 32 characters): they name Ray actors and checkpoint folders."
                )
            if overrides is None:
                continue
            if not isinstance(overrides, Mapping):
                out.append(f"mas.policies.{name} is {overrides!r}; it must be a mapping of actor_rollout_ref overrides.")
                continue
            unknown = sorted(set(overrides) - set(POLICY_BLOCKS) - set(POLICY_OWN_KEYS))
            if unknown:
                out.append(
                    f"mas.policies.{name} sets {unknown}; a policy overrides blocks of actor_rollout_ref "
                    f"{list(POLICY_BLOCKS)} (e.g. model: {{path: ...}}, actor: {{optim: {{lr: ...}}}}) and may "
                    f"set {POLICY_RESOURCES}: {{n_gpus_per_node: N}} for a resource pool of its own and "
                    f"{POLICY_FROZEN}: true to keep it at its initial weights."
                )
            out.extend(self._resource_problems(name, overrides.get(POLICY_RESOURCES)))
            if not isinstance(overrides.get(POLICY_FROZEN, False), bool):
                out.append(f"mas.policies.{name}.{POLICY_FROZEN} is {overrides[POLICY_FROZEN]!r}; it must be true or "
                           "false.")
        if self.policies and all(self.policy_frozen(name) for name in self.policies):
            out.append(
                f"every policy of mas.policies {list(self.policies)} is frozen, so nothing would train. Leave at "
                f"least one policy without {POLICY_FROZEN}: true; to measure fixed models, evaluate them instead "
                "(python -m verl_mas.evaluate, or trainer.val_only=true)."
            )
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

    def policy_frozen(self, name: str) -> bool:
        """Whether the policy takes no optimiser step (``mas.policies.<name>.frozen: true``)."""
        overrides = self.policies.get(name) if isinstance(self.policies, Mapping) else None
        return isinstance(overrides, Mapping) and overrides.get(POLICY_FROZEN, False) is True

    @property
    def frozen_policies(self) -> list[str]:
        """The policies that take no optimiser step, in declaration order."""
        return [name for name in self.policy_names if self.policy_frozen(name)]

    @property
    def policy_names(self) -> list[str]:
        """The declared policies in order; the first runs in verl's own actor/rollout stack."""
        return list(self.policies)

    @property
    def multi_policy(self) -> bool:
        return len(self.policies) > 1

    @property
    def record_settings(self) -> Any:
        """``mas.record`` parsed (:class:`verl_mas.recording.RecordSettings`)."""
        from verl_mas.recording import RecordSettings

        return RecordSettings.parse(self.record)[0]

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
