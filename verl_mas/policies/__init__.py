"""Policies: the models (or adapters) that serve the roles of a run, one or several.

A policy serves one or more roles (``mas.policies``, routed by ``mas.roles.<role>.policy``; which role
reaches which policy is :mod:`verl_mas.routing`'s business). Three levels, by config alone
(docs/policies.md): one shared policy, one model per role, one LoRA adapter per role.

- :mod:`verl_mas.policies.configs`: each policy's verl ``actor_rollout_ref`` (the recipe's with the
  policy's overrides) and what a policy may not change; light, imported here.
- :mod:`verl_mas.policies.stacks`: a verl actor/rollout stack per further policy and the trainer hooks that
  drive them (imports verl's trainer pieces; imported by :mod:`verl_mas.trainer`).
- :mod:`verl_mas.policies.adapters`: whether LoRA policies share one resident base (``mas.lora_base``) and
  what each adapter is; light. :mod:`verl_mas.policies.lora_worker`: verl's actor worker holding that base
  once and an adapter and optimiser per policy (imports verl's workers).
"""

from __future__ import annotations

from verl_mas.policies.configs import (
    POLICY_AWARE_ROLLOUTS,
    ROLLOUT_POLICY_KEY,
    SHARED_ROLLOUT_KEYS,
    policy_configs,
    policy_configs_and_problems,
    pool_memory_problems,
    rollout_policy,
    shared_rollout_problems,
)

__all__ = [
    "POLICY_AWARE_ROLLOUTS",
    "ROLLOUT_POLICY_KEY",
    "SHARED_ROLLOUT_KEYS",
    "policy_configs",
    "policy_configs_and_problems",
    "pool_memory_problems",
    "rollout_policy",
    "shared_rollout_problems",
]
