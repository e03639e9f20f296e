"""Several policies in one verl run: per-policy configs, the generation router, and the policy stacks.

A *policy* is a model that serves one or more roles (``mas.policies`` / ``mas.roles.<role>.policy``).
The first policy runs in verl's own actor/rollout stack (``actor_rollout_ref`` with its overrides); every
further policy gets a stack of its own built from the same verl pieces: an ``ActorRolloutRefWorker``
group (on verl's resource pool, or on its own with ``resources``), its rollout replicas
(``LLMServerManager``) and its weight sync (``CheckpointEngineManager``). The agent loop sends each role's requests to its policy through
:class:`PolicyRouterClient`; the ``mas`` trainer splits every batch by policy.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient

from verl_mas.config import POLICY_RESOURCES, MasConfig, MasConfigError

__all__ = ["PolicyRouterClient", "PolicyStack", "ROLLOUT_POLICY_KEY", "SessionRoutedClient", "candidate_request_id",
           "policy_configs"]

#: Key in ``actor_rollout_ref.rollout.custom`` naming the policy a rollout stack serves. Rollout backends
#: use it to give each policy's servers distinct names (the ``hf`` backend does).
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
        overrides = {k: v for k, v in (overrides or {}).items() if k != POLICY_RESOURCES}
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


#: Separates the session (routing key) from the candidate in a request id: ``"<session>#<turn>.<candidate>"``.
CANDIDATE_SEP = "#"


def candidate_request_id(session_id: str, turn: int, candidate: int) -> str:
    """The request id of one candidate: its own id, whose session part routes it (see :class:`SessionRoutedClient`)."""
    return f"{session_id}{CANDIDATE_SEP}{turn}.{candidate}"


def routing_key(request_id: str) -> str:
    """The session part of a candidate's request id (the whole id when it has no candidate part)."""
    return request_id.partition(CANDIDATE_SEP)[0]


class SessionRoutedClient(LLMServerClient):
    """verl's LLM server client with one request id per candidate, routed by the candidate's session.

    The ``mas`` agent loop sends the K concurrent candidates of a group as K requests with ids
    ``"<session>#<turn>.<i>"`` (session = one episode and role). verl's load balancer routes on the
    session part only, so every candidate and every turn of one (episode, role) reaches one server
    (prefix-cache affinity, sticky or by hash under ``rollout.full_determinism``), while the server sees a
    distinct, deterministic id per candidate: verl forwards the caller's id unchanged under
    ``full_determinism``, where K requests sharing one id would collide in the engine.
    """

    async def _acquire_server(self, request_id: str, **extra: Any) -> Any:
        return await super()._acquire_server(routing_key(request_id), **extra)

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        super()._release_server(server_id, request_id=None if request_id is None else routing_key(request_id))


class PolicyRouterClient(LLMServerClient):
    """verl's LLM server client for several policies: ``generate(..., policy=name)`` reaches that policy's servers.

    verl hands one client to its agent-loop workers (``server_manager`` of every agent loop); with several
    policies the ``mas`` trainer hands this one, which holds one verl client per policy. Requests without
    ``policy`` go to the first policy, so verl's own agent loops keep working.
    """

    def __init__(self, clients: Mapping[str, LLMServerClient]) -> None:  # noqa: D107 (no super().__init__)
        if not clients:
            raise ValueError("PolicyRouterClient needs at least one policy client")
        self.clients = dict(clients)
        self.default_policy = next(iter(self.clients))
        first = self.clients[self.default_policy]
        # verl reads these attributes of its client (config for request ids, tokenizer for tracing).
        self.config = first.config
        self._load_balancer = getattr(first, "_load_balancer", None)
        self._lb_require_acquire_fields = None
        self._lb_require_release_fields = None

    async def generate(self, request_id: str, *, policy: str | None = None, **kwargs: Any) -> Any:
        name = policy or self.default_policy
        client = self.clients.get(name)
        if client is None:
            raise KeyError(
                f"generate() asked for policy {name!r}, but this run serves {list(self.clients)}. The agent loop "
                "routes roles with mas.roles.<role>.policy; check that it names a declared policy."
            )
        return await client.generate(request_id, **kwargs)


@dataclass
class PolicyStack:
    """One policy's pieces in the trainer: its config, worker group, rollout servers and weight sync."""

    name: str
    worker_group: Any
    ref_worker_group: Any
    ref_in_actor: bool
    server_manager: Any
    checkpoint_manager: Any
    pool: str = "global_pool"  # the resource pool its workers and rollout replicas live on


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
