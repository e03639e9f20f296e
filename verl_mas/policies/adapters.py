"""One resident base model, one LoRA adapter per role-policy (``mas.lora_base: shared``, the default).

When every policy of a run is a LoRA adapter (``model.lora_rank > 0``) on the same base model, the policies
share one verl worker group and one set of rollout servers instead of a stack each:

- the actor holds the base once and one adapter per policy, all created before FSDP wraps the model; each
  adapter has its own optimiser and learning-rate schedule, an update on a policy's rows activates that
  policy's adapter only, and the reference policy is the base with every adapter disabled
  (:mod:`verl_mas.policies.lora_worker`);
- the rollout holds the base once and every adapter; each request names its adapter, and the weight sync
  after a step sends adapter tensors only (:mod:`verl_mas.backends.hf`).

This module decides, from the config alone, whether a run shares its base and what each adapter is. The
plan travels to the worker group and to the rollout servers in ``actor_rollout_ref.rollout.custom`` under
:data:`ADAPTERS_KEY`: ``{policy: {"rank": r, "alpha": a, "optim": {...}}}`` (``optim``: the keys of
``actor.optim`` that differ from the first policy's), the first policy first (peft names its adapter ``"default"``, :data:`FIRST_ADAPTER`).

What a policy on a shared base may set differently from the others (:data:`SHARED_BASE_OVERRIDES`) is what
the one worker group can apply per adapter or what the trainer reads per policy; anything else (a loss
setting, micro-batch sizes, the model's dtype) is read once by the worker group for every adapter, so it must
be the same for every policy; a policy that sets it differently is refused at start-up, with
``mas.lora_base=per_policy`` (a stack per adapter, one base copy each) as the fix. A key under an allowed
prefix that nothing applies per adapter (:data:`REFUSED_PER_ADAPTER`: Megatron's ``model.lora.rank`` /
``alpha``, ``actor.optim.total_training_steps`` and ``_target_``) is refused whatever its value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from verl_mas.config import LORA_BASES, POLICY_RESOURCES, actor_rollout_ref_overrides

__all__ = ["ADAPTER_SEP", "ADAPTERS_KEY", "FIRST_ADAPTER", "LORA_BASES", "REFUSED_PER_ADAPTER", "SHARED_BASE_OVERRIDES",
           "adapter_plan", "adapter_tensor_name", "lora_rank", "rollout_adapters", "shared_base_plan",
           "split_adapter_tensor_name", "tensors_by_adapter"]

#: Key of ``actor_rollout_ref.rollout.custom`` holding the adapters of a shared base (see the module docstring).
ADAPTERS_KEY = "mas_adapters"
#: Separates a policy from a peft key in the names of the synced adapter tensors (``"<policy>:<peft key>"``).
ADAPTER_SEP = ":"
#: peft's name of the adapter verl creates (the first policy's).
FIRST_ADAPTER = "default"
#: Dotted keys of a policy's overrides that a shared base honours per adapter (a prefix covers its sub-keys;
#: docs/policies.md, "What a policy may set", says where verl reads each one and how it gets there per adapter).
SHARED_BASE_OVERRIDES = (
    "model.path",            # must name the same base (checked)
    "model.lora_rank", "model.lora_alpha",  # verl's FSDP engine builds the first adapter, verl_mas the others
    "actor.optim",           # each adapter has its own optimiser, schedule and optimiser config (except below)
    "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.shuffle", "actor.data_loader_seed",  # sent per update
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.val_kwargs",  # sampled per request
)
#: Keys under an allowed prefix that nothing applies per adapter: key -> (why, fix).
REFUSED_PER_ADAPTER = {
    "model.lora.rank": ("belongs to the Megatron engine's LoRA block; verl's FSDP engine builds each adapter from "
                        "model.lora_rank", "Set model.lora_rank instead"),
    "model.lora.alpha": ("belongs to the Megatron engine's LoRA block; verl's FSDP engine builds each adapter from "
                         "model.lora_alpha", "Set model.lora_alpha instead"),
    "actor.optim.total_training_steps": ("is set by verl's trainer at run time, once for the one worker group of "
                                         "every adapter", "Drop it; trainer.total_training_steps sets it for every "
                                                          "policy"),
    "actor.optim._target_": ("names the optimiser config class of the one worker group",
                             "Drop it and set actor.optim.optimizer / optimizer_impl per policy, or set "
                             "mas.lora_base=per_policy (a stack per adapter, each with its own copy of the base)"),
}
#: Rollout backends that serve several adapters of one resident base.
SHARED_BASE_ROLLOUTS = ("hf", "vllm")


def adapter_tensor_name(policy: str, key: str) -> str:
    return f"{policy}{ADAPTER_SEP}{key}"


def split_adapter_tensor_name(name: str) -> tuple[str, str]:
    policy, sep, key = name.partition(ADAPTER_SEP)
    if not sep:
        raise ValueError(f"{name!r} is not an adapter tensor name ('<policy>{ADAPTER_SEP}<peft key>')")
    return policy, key


def tensors_by_adapter(named: Iterable[tuple[str, Any]], adapters: Iterable[str],
                       prepare: Callable[[Any], Any] = lambda t: t) -> dict[str, dict[str, Any]]:
    """A sync's ``"<policy>:<peft key>"`` tensors grouped by policy (``{policy: {peft key: prepare(tensor)}}``).

    Raises:
        ValueError: a tensor names a policy that is not one of ``adapters``.
    """
    out: dict[str, dict[str, Any]] = {name: {} for name in adapters}
    for name, tensor in named:
        policy, key = split_adapter_tensor_name(name)
        if policy not in out:
            raise ValueError(f"adapter sync sent {name!r}, but the adapters of this base are {sorted(out)}")
        out[policy][key] = prepare(tensor)
    return out


def lora_rank(model: Any) -> int:
    """A policy's LoRA rank as verl reads it (``model.lora.rank``, else ``model.lora_rank``; 0: no LoRA)."""
    lora = model.get("lora", None) or {}
    rank = int(lora.get("rank", 0) or 0)
    return rank if rank > 0 else int(model.get("lora_rank", 0) or 0)


def _dotted(overrides: Mapping[str, Any], path: str = "") -> list[str]:
    out = []
    for key, value in overrides.items():
        dotted = f"{path}.{key}" if path else str(key)
        if isinstance(value, Mapping) and value:
            out.extend(_dotted(value, dotted))
        else:
            out.append(dotted)
    return out


def _select(config: Any, dotted: str) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, dotted)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _allowed(dotted: str) -> bool:
    return dotted not in REFUSED_PER_ADAPTER and any(dotted == k or dotted.startswith(k + ".")
                                                     for k in SHARED_BASE_OVERRIDES)


def shared_base_plan(mas: Any, configs: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]] | None, list[str]]:
    """The adapters of a shared base, or None when the run does not share one; and every problem.

    A run shares its base when it has several policies, every one of them is a LoRA adapter, and
    ``mas.lora_base`` is ``shared`` (the default). Per-role full models, a mix of LoRA and full models, and
    ``mas.lora_base=per_policy`` keep a stack per policy.

    Args:
        mas: The ``mas:`` block (:class:`verl_mas.config.MasConfig`).
        configs: Each policy's full ``actor_rollout_ref`` (:func:`verl_mas.policies.policy_configs`).
    """
    names = list(configs)
    if len(names) < 2 or mas.lora_base != "shared" or not all(lora_rank(configs[n].model) > 0 for n in names):
        return None, []
    fix = "or set mas.lora_base=per_policy (a stack per adapter, each with its own copy of the base)"
    problems: list[str] = []
    first = configs[names[0]]
    for name in names:
        cfg = configs[name]
        overrides = actor_rollout_ref_overrides(mas.policies.get(name))
        for dotted in _dotted(overrides):
            value, first_value = _select(cfg, dotted), _select(first, dotted)
            if dotted in REFUSED_PER_ADAPTER:
                why, remedy = REFUSED_PER_ADAPTER[dotted]
                problems.append(
                    f"mas.policies.{name}.{dotted} is {value!r}, but on mas.lora_base=shared nothing applies it per "
                    f"adapter: actor_rollout_ref.{dotted} {why}. {remedy}."
                )
            elif not _allowed(dotted) and value != first_value:
                problems.append(
                    f"mas.policies.{name}.{dotted} is {value!r} but {names[0]}'s is {first_value!r}: the policies of "
                    f"mas.lora_base=shared are adapters in one worker group, which reads actor_rollout_ref.{dotted} "
                    f"once for every adapter. Give every policy the same value, {fix}. Set per adapter: "
                    f"{', '.join(SHARED_BASE_OVERRIDES[1:])}."
                )
        if (mas.policies.get(name) or {}).get(POLICY_RESOURCES):
            problems.append(f"mas.policies.{name}.{POLICY_RESOURCES}: the adapters of a shared base live in one worker "
                            f"group on verl's pool; drop {POLICY_RESOURCES}, {fix}.")
        if str(cfg.model.path) != str(first.model.path):
            problems.append(
                f"mas.policies.{name}.model.path is {cfg.model.path!r} but {names[0]}'s is {first.model.path!r}: "
                f"mas.lora_base=shared holds one base model for every adapter. Use one base, {fix}."
            )
        if cfg.model.get("lora_adapter_path", None):
            problems.append(f"mas.policies.{name}.model.lora_adapter_path: a shared base creates every adapter "
                            f"fresh (loading pretrained adapters per policy is not there yet); drop it, {fix}.")
        if name == FIRST_ADAPTER and name != names[0]:
            problems.append(f"mas.policies.{name}: peft names the first policy's adapter {FIRST_ADAPTER!r}; list the "
                            f"policy named {FIRST_ADAPTER!r} first or rename it.")
    megatron_rank = int((first.model.get("lora", None) or {}).get("rank", 0) or 0)
    if megatron_rank > 0 and megatron_rank != int(first.model.get("lora_rank", 0) or 0):
        problems.append(
            f"actor_rollout_ref.model.lora.rank={megatron_rank} but model.lora_rank="
            f"{first.model.get('lora_rank', 0)}: on mas.lora_base=shared verl's FSDP engine builds the adapters from "
            f"model.lora_rank and model.lora_alpha (model.lora.rank belongs to the Megatron engine), so it would "
            f"build no adapter. Set model.lora_rank={megatron_rank}."
        )
    if bool((first.model.get("lora", None) or {}).get("merge", False)):
        problems.append(
            "actor_rollout_ref.model.lora.merge=true merges one adapter into the served weights, but a shared base "
            f"serves every role's adapter unmerged. Set model.lora.merge=false, {fix}."
        )
    backend = str(first.rollout.name)
    if backend not in SHARED_BASE_ROLLOUTS:
        problems.append(
            f"actor_rollout_ref.rollout.name={backend}: serving several adapters of one resident base is built for "
            f"{list(SHARED_BASE_ROLLOUTS)}. Use one of them, {fix}."
        )
    strategy = str((first.get("actor", None) or {}).get("strategy", "fsdp2"))
    if strategy != "fsdp2":
        problems.append(
            f"actor_rollout_ref.actor.strategy={strategy}: a shared base gives each adapter an optimiser over its own "
            "parameters, which needs FSDP2's per-parameter sharding (FSDP1 flattens them together). Set "
            f"actor.strategy=fsdp2, {fix}."
        )
    engine = first.rollout.get("checkpoint_engine", None) or {}
    if str(engine.get("backend", "naive")) != "naive":
        problems.append(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={engine.get('backend')}: a shared base syncs its "
            "adapters through verl's colocated (naive) weight update. Set it to naive, " + fix + "."
        )
    # Each adapter's optimiser: the first policy's (verl's actor.optim) with what this policy resolves to
    # differently (the recipe's value where only the first policy overrides a key). The step count of the
    # schedule is set by verl at run time on the first policy's config and is shared. Rank and alpha are the
    # keys verl's FSDP engine builds the first adapter from (model.lora_rank, model.lora_alpha).
    first_optim = _select(first, "actor.optim") or {}
    plan = {
        name: {
            "rank": int(configs[name].model.get("lora_rank", 0) or 0),
            "alpha": int(configs[name].model.get("lora_alpha", 16)),
            "optim": {k: v for k, v in (_select(configs[name], "actor.optim") or {}).items()
                      if k not in ("_target_", "total_training_steps") and first_optim.get(k) != v},
        }
        for name in names
    }
    return plan, problems


def rollout_adapters(rollout_config: Any) -> dict[str, dict[str, Any]] | None:
    """The adapters a rollout config serves on one base (None: a plain or merged model)."""
    custom = rollout_config.get("custom") if isinstance(rollout_config, Mapping) else getattr(rollout_config, "custom", None)
    if not custom or not hasattr(custom, "get"):
        return None
    adapters = custom.get(ADAPTERS_KEY)
    return {str(k): dict(v) for k, v in adapters.items()} if adapters else None


def adapter_plan(configs: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The adapters recorded in the first policy's config (after :func:`verl_mas.startup.prepare_verl_config`)."""
    first = next(iter(configs.values()), None)
    return None if first is None else rollout_adapters(first.rollout)
