"""Each policy's verl config: the recipe's ``actor_rollout_ref`` with the policy's overrides, and what a
policy may not change.

Every override key must exist in the recipe (a typo fails instead of being ignored); rollout settings that
verl's agent-loop workers read once for all policies must agree; several trainable policies need a
rollout backend whose servers are named and weight-synced per policy (:data:`ROLLOUT_POLICY_KEY`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from verl_mas.config import MasConfig, MasConfigError, actor_rollout_ref_overrides

__all__ = ["POLICY_AWARE_ROLLOUTS", "ROLLOUT_POLICY_KEY", "SHARED_ROLLOUT_KEYS", "policy_configs",
           "policy_configs_and_problems", "pool_memory_problems", "rollout_policy", "shared_rollout_problems"]

#: Keys of ``actor_rollout_ref.rollout`` that one process reads for every policy (verl's agent-loop workers
#: size, sample and post-process every request with the first policy's values), so a policy cannot change them.
SHARED_ROLLOUT_KEYS = ("n", "prompt_length", "response_length", "max_model_len", "calculate_log_probs", "agent",
                       "multi_turn", "mode", "name", "full_determinism")
#: Rollout backends whose servers are named and weight-synced per policy (``rollout.custom.mas_policy``): verl_mas's
#: ``hf`` backend and verl's ``vllm`` with verl_mas's subclasses (:mod:`verl_mas.backends.vllm`).
POLICY_AWARE_ROLLOUTS = ("hf", "vllm")

#: Key in ``actor_rollout_ref.rollout.custom`` naming the policy a rollout stack serves. Rollout backends
#: use it to give each policy's servers distinct names (``hf`` and ``vllm`` do).
ROLLOUT_POLICY_KEY = "mas_policy"


def rollout_policy(rollout_config: Any) -> str | None:
    """The policy a rollout config serves (None: the first policy, verl's own stack)."""
    if isinstance(rollout_config, Mapping):
        custom = rollout_config.get("custom")
    else:
        custom = getattr(rollout_config, "custom", None)
    if not custom:
        return None
    value = custom.get(ROLLOUT_POLICY_KEY) if hasattr(custom, "get") else None
    return str(value) if value else None


def policy_configs(actor_rollout_ref: Any, mas: MasConfig) -> dict[str, Any]:
    """Each policy's full ``actor_rollout_ref`` (an OmegaConf node): the recipe's with the policy's overrides.

    Every override key must exist in the recipe's ``actor_rollout_ref`` (so a typo fails instead of being
    ignored); all unknown keys are reported at once. Policies after the first are tagged in
    ``rollout.custom`` so their rollout servers get their own names.

    Raises:
        MasConfigError: An override names a key ``actor_rollout_ref`` does not have.
    """
    out, problems = policy_configs_and_problems(actor_rollout_ref, mas)
    if problems:
        raise MasConfigError(
            "Invalid mas.policies overrides:\n  - " + "\n  - ".join(problems)
        )
    return out


def policy_configs_and_problems(actor_rollout_ref: Any, mas: MasConfig) -> tuple[dict[str, Any], list[str]]:
    """:func:`policy_configs` without raising: the configs and every problem of the overrides."""
    from omegaconf import OmegaConf, open_dict

    if isinstance(actor_rollout_ref, dict):
        base = actor_rollout_ref
    else:
        base = OmegaConf.to_container(actor_rollout_ref, resolve=True)
    problems: list[str] = []
    out: dict[str, Any] = {}
    for i, (name, overrides) in enumerate(mas.policies.items()):
        if overrides is not None and not isinstance(overrides, Mapping):
            continue  # reported by MasConfig.problems()
        overrides = actor_rollout_ref_overrides(overrides)
        problems.extend(_unknown_keys(base, overrides, name))
        merged = OmegaConf.merge(OmegaConf.create(copy.deepcopy(base)), OmegaConf.create(overrides))
        if i > 0:
            with open_dict(merged):
                custom = dict(merged.rollout.get("custom") or {})
                custom[ROLLOUT_POLICY_KEY] = name
                merged.rollout.custom = custom
        out[name] = merged
    return out, problems


def _unknown_keys(base: Mapping[str, Any], overrides: Mapping[str, Any], policy: str, path: str = "") -> list[str]:
    out = []
    for key, value in overrides.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in base:
            out.append(
                f"mas.policies.{policy}.{dotted}: actor_rollout_ref.{dotted} does not exist. A policy overrides keys "
                "of the recipe's actor_rollout_ref; check the spelling against verl's ppo_trainer config (a key "
                "verl does not define must be added to the recipe with '+' first)."
            )
            continue
        if isinstance(value, Mapping) and isinstance(base[key], Mapping) and base[key]:
            out.extend(_unknown_keys(base[key], value, policy, dotted))
    return out


def shared_rollout_problems(configs: Mapping[str, Any], mas: MasConfig) -> list[str]:
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
        split = [name for name, c in configs.items() if (c.rollout.get("disaggregation", None) or {}).get("enabled")]
        if split:
            out.append(
                f"several trainable policies ({names}) with rollout.disaggregation.enabled=true (on {split}): verl "
                "0.9.1's prefill/decode replicas name their servers and weight channels without the policy, so a second "
                "policy's servers would collide with the first's and its weight sync would not find them. Turn "
                "disaggregation off, or train one shared policy with it."
            )
        backends = sorted({str(c.rollout.name) for c in configs.values()} - set(POLICY_AWARE_ROLLOUTS))
        if backends:
            out.append(
                f"several trainable policies ({names}) with actor_rollout_ref.rollout.name={backends[0]!r}: verl "
                f"0.9.1's {backends[0]} hybrid servers derive their actor names and weight channels from the replica "
                "rank inside one worker group, so a second policy's servers would collide with the first's (generation "
                "and weight sync reaching the wrong model). The policy-aware backends are "
                f"{list(POLICY_AWARE_ROLLOUTS)}; use one of them, or one shared policy on {backends[0]} (docs/policies.md)."
            )
    return out


def pool_memory_problems(configs: Mapping[str, Any], mas: MasConfig, *, one_engine: bool) -> list[str]:
    """Policies whose vLLM engines share the GPUs of verl's pool and together reserve more than every GPU has.

    On verl's pool every policy's rollout replica runs on the same GPUs as the others' (the worker group of each
    policy is colocated there, :mod:`verl_mas.policies.stacks`), and each vLLM engine reserves
    ``rollout.gpu_memory_utilization`` of the device at start-up (vLLM refuses to start when less is free) and holds
    its KV cache while the rollout runs, with every policy's engine awake at once. A sum above 1 cannot fit: the
    second engine fails only after the whole start-up. A policy with ``resources`` has a pool of its own and is
    not counted; ``one_engine``: a shared LoRA base, whose adapters are served by one engine. For GPU runs only
    (vLLM's CPU build sizes its KV cache in bytes).
    """
    if one_engine or not mas.multi_policy:
        return []
    shared = {name: c.rollout for name, c in configs.items()
              if mas.policy_resources(name) is None and str(c.rollout.get("name", None)) == "vllm"}
    fractions = {name: float(r.get("gpu_memory_utilization", None) or 0.0) for name, r in shared.items()}
    if len(fractions) < 2 or sum(fractions.values()) <= 1.0:
        return []
    share = round(0.9 / len(fractions), 2)
    return [
        f"policies {list(fractions)} share verl's resource pool, and each starts a vLLM engine on every one of its GPUs "
        f"reserving rollout.gpu_memory_utilization of the device: {fractions} sum to {sum(fractions.values()):.2f}, "
        "more than a GPU has, so the last engine to start would fail vLLM's free-memory check after the whole "
        f"start-up (and the actors' parameters need room too). Give each policy its share, e.g. "
        f"actor_rollout_ref.rollout.gpu_memory_utilization={share} (every policy inherits it) or "
        "mas.policies.<p>.rollout.gpu_memory_utilization per policy, or give a policy GPUs of its own with "
        "mas.policies.<p>.resources={n_gpus_per_node: N}."
    ]
