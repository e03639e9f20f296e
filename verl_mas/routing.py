"""Routing: which policy serves each role, and how each candidate's request reaches that policy's servers.

One router serves training and evaluation:

- :class:`RoleRouter` maps a role to the policy that serves it. In training it is read from the ``mas:``
  block (``mas.roles.<role>.policy``; with one policy every role uses it), in ``python -m verl_mas.evaluate``
  from ``--role ROLE=MODEL`` and ``--model``. :meth:`RoleRouter.problems` lists, before a run starts, every
  role of the data's workflows that no policy would serve.
- :class:`RoleRoutedClient` is the :class:`verl_mas.LLMClient` that sends each role's requests to its
  policy's client (the ``mas`` agent loop's verl-server clients, or evaluation's local models).
- :meth:`RoleRouter.tokenizers` gives each role its policy's tokenizer, so that a team of models with
  different vocabularies renders each role's prompts and decodes its answers with that role's own model's
  tokenizer (:class:`RoleTokenizers`; :func:`tokenizer_fit_problems` checks the fit before a run).
- At verl's level, the agent-loop workers hold one verl client; with several policies the ``mas`` trainer
  hands them a :class:`PolicyRouterClient` (``generate(..., policy=name)`` reaches that policy's servers),
  and every policy's client is a :class:`SessionRoutedClient`: each candidate has a request id of its own
  (:func:`candidate_request_id`), routed to a server by its (episode, role) session.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient

from verl_mas.client import GenerateRequest, LLMClient, Sample
from verl_mas.config import MasConfig, MasConfigError

__all__ = [
    "CANDIDATE_SEP",
    "PolicyRouterClient",
    "RoleRoutedClient",
    "RoleRouter",
    "RoleTokenizers",
    "SessionRoutedClient",
    "candidate_request_id",
    "roles_of_workflows",
    "routing_key",
    "tokenizer_fit_problems",
    "workflows_in_data",
]

#: How a training run routes a role (``{role}`` is filled in).
MAS_ROUTE = "mas.roles.{role}.policy"


class RoleRouter:
    """Which policy serves each role: an explicit route, else the default policy, else an error.

    Args:
        routes: ``{role: policy}`` for the roles routed explicitly.
        policies: Every policy, in order.
        default: The policy of roles without a route (None: every role needs one).
        route: How a user routes a role, for error messages (``{role}`` is filled in).
    """

    def __init__(self, routes: Mapping[str, str], policies: Sequence[str], *, default: str | None,
                 route: str = MAS_ROUTE) -> None:
        self.routes = {str(role): str(policy) for role, policy in routes.items()}
        self.policies = list(policies)
        self.default = default
        self.route = route
        unknown = sorted({p for p in self.routes.values() if p not in self.policies}
                         | ({default} - set(self.policies) if default is not None else set()))
        if unknown:
            raise MasConfigError(f"RoleRouter routes to {unknown}, which are not among the policies {self.policies}.")

    @classmethod
    def from_mas(cls, mas: MasConfig) -> RoleRouter:
        """The router of a training run: ``mas.roles.<role>.policy``; with one policy, that policy for every role.

        Routes to undeclared policies are left out (the block's own validation reports them).
        """
        routes = {role: settings["policy"] for role, settings in mas.roles.items()
                  if isinstance(settings, Mapping) and settings.get("policy") in mas.policies}
        names = mas.policy_names
        return cls(routes, names, default=names[0] if len(names) == 1 else None)

    @property
    def multi_policy(self) -> bool:
        return len(self.policies) > 1

    def policy_of(self, role: str) -> str:
        """The policy that serves ``role``.

        Raises:
            MasConfigError: ``role`` has no route and there is no default policy.
        """
        policy = self.routes.get(role, self.default)
        if policy is None:
            raise MasConfigError(
                f"Role {role!r} is not routed to a policy: the policies are {self.policies} and none is named for "
                f"{role!r}. Route it with {self.route.format(role=role)}."
            )
        return policy

    def problems(self, roles_by_workflow: Mapping[str, Sequence[str]]) -> list[str]:
        """Every role of the given workflows that no policy serves, one problem per workflow."""
        if self.default is not None:
            return []
        out = []
        for workflow_id, roles in sorted(roles_by_workflow.items()):
            missing = [r for r in roles if r not in self.routes]
            if missing:
                out.append(
                    f"workflow {workflow_id!r} has roles {missing} that no policy serves: with several policies "
                    f"({self.policies}) every role needs {self.route.format(role='<role>')}."
                )
        return out

    def tokenizers(self, by_policy: Mapping[str, Any]) -> Any:
        """What :func:`verl_mas.run_episode` takes as ``tokenizer``: the one tokenizer when every policy uses
        the same object, else a :class:`RoleTokenizers` mapping each role to its policy's tokenizer."""
        missing = [p for p in self.policies if p not in by_policy]
        if missing:
            raise ValueError(f"RoleRouter.tokenizers: no tokenizer for policies {missing} (have {list(by_policy)}).")
        distinct = {id(by_policy[p]) for p in self.policies}
        return by_policy[self.policies[0]] if len(distinct) == 1 else RoleTokenizers(self, by_policy)


class RoleTokenizers(Mapping):
    """``{role: tokenizer}`` as the episode engine reads it: the tokenizer of the policy serving the role.

    A role without a route (and no default policy) is missing, so the engine names it before the episode.
    """

    def __init__(self, router: RoleRouter, by_policy: Mapping[str, Any]) -> None:
        self.router = router
        self.by_policy = dict(by_policy)

    def __getitem__(self, role: str) -> Any:
        try:
            return self.by_policy[self.router.policy_of(role)]
        except MasConfigError as exc:
            raise KeyError(role) from exc

    def __iter__(self) -> Any:
        return iter(self.router.routes)

    def __len__(self) -> int:
        return len(self.router.routes)


def tokenizer_fit_problems(by_policy: Mapping[str, Any], vocab_sizes: Mapping[str, int], padding: Any = None) -> list[str]:
    """Problems of a team whose policies' tokenizers differ, before any prompt is rendered.

    Args:
        by_policy: ``{policy: tokenizer}``.
        vocab_sizes: ``{policy: the embedding rows of its model}`` (``config.vocab_size``).
        padding: The tokenizer verl pads every row of the batch with in training (the first policy's): its pad
            id lands in the masked positions of every policy's rows, so it must be a valid id for every model.
            None: no batch (evaluation).
    """
    out = []
    pad_id = None if padding is None else (padding.pad_token_id if padding.pad_token_id is not None else 0)
    for policy, tokenizer in by_policy.items():
        size = int(vocab_sizes[policy])
        if len(tokenizer) > size:
            out.append(
                f"policy {policy!r}: its tokenizer has {len(tokenizer)} tokens but its model only {size} embedding rows, "
                "so the tokenizer is not the model's. Point the policy's model.tokenizer_path (or model.path) at the "
                "model's own tokenizer."
            )
        if pad_id is not None and pad_id >= size:
            out.append(
                f"policy {policy!r}: verl pads every row of the batch with the first policy's pad token id {pad_id}, "
                f"which is outside this model's {size} embedding rows. List first a policy whose pad id every model "
                "can embed (e.g. the one with the smallest vocabulary)."
            )
    return out


#: The policy name of :class:`RoleRoutedClient`'s ``default`` client.
DEFAULT_CLIENT = "<default>"


class RoleRoutedClient:
    """:class:`verl_mas.LLMClient` that serves each role with its policy's client.

    Args:
        by_role: ``{role: client}`` (each role its own client; evaluation's ``--role ROLE=MODEL``).
        default: The client of every role not in ``by_role``.

    :meth:`from_router` builds one from a :class:`RoleRouter` and a client per policy, as the ``mas``
    agent loop does.
    """

    def __init__(self, by_role: Mapping[str, LLMClient], default: LLMClient | None = None) -> None:
        clients: dict[str, LLMClient] = dict(by_role)  # one policy per role, named after it
        if default is not None:
            clients[DEFAULT_CLIENT] = default
        router = RoleRouter({role: role for role in by_role}, list(clients),
                            default=DEFAULT_CLIENT if default is not None else None,
                            route="an entry for {role!r} in by_role, or a default client")
        self._setup(router, clients)

    @classmethod
    def from_router(cls, router: RoleRouter, clients: Mapping[str, LLMClient]) -> RoleRoutedClient:
        """A client per policy of ``router`` (each policy must have one)."""
        missing = [p for p in router.policies if p not in clients]
        if missing:
            raise ValueError(f"RoleRoutedClient.from_router: no client for policies {missing} (have {list(clients)}).")
        out = cls.__new__(cls)
        out._setup(router, clients)
        return out

    def _setup(self, router: RoleRouter, clients: Mapping[str, LLMClient]) -> None:
        self.router = router
        self.clients = dict(clients)

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        return await self.clients[self.router.policy_of(request.role)].generate(request)


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


def roles_of_workflows(workflow_ids: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The roles of each workflow (for :meth:`RoleRouter.problems`)."""
    from verl_mas.registry import get_workflow

    return {w: tuple(get_workflow(w).roles) for w in sorted(set(workflow_ids))}


# ---------------------------------------------------------------------------------------------------------
# verl's level: request ids, session affinity, several policies behind one verl client
# ---------------------------------------------------------------------------------------------------------

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
    ``"<session>#<turn>.<i>"`` (session = one episode and role; on the ``hf`` backend one request of K samples
    under the first id). verl's load balancer routes on the session part only, so every candidate and every
    turn of one (episode, role) reaches one server (prefix-cache affinity, sticky or by hash under
    ``rollout.full_determinism``), while the server sees a distinct, deterministic id per candidate: verl
    forwards the caller's id unchanged under ``full_determinism``, where K requests sharing one id would
    collide in the engine.
    """

    async def _acquire_server(self, request_id: str, **extra: Any) -> Any:
        return await super()._acquire_server(routing_key(request_id), **extra)

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        super()._release_server(server_id, request_id=None if request_id is None else routing_key(request_id))


class PolicyRouterClient(LLMServerClient):
    """verl's LLM server client for several policies: ``generate(..., policy=name)`` reaches that policy's servers.

    verl hands one client to its agent-loop workers (``server_manager`` of every agent loop); with several
    policies the ``mas`` trainer hands this one, which holds one verl client per policy. Requests without
    ``policy`` go to the first policy, so verl's own agent loops keep working. With a shared LoRA base
    (``adapters``: policy -> adapter) the requests carry ``adapter=<its adapter>`` to the one rollout.
    """

    def __init__(self, clients: Mapping[str, LLMServerClient],
                 adapters: Mapping[str, str] | None = None) -> None:  # noqa: D107 (no super().__init__)
        if not clients:
            raise ValueError("PolicyRouterClient needs at least one policy client")
        self.clients = dict(clients)
        # A shared LoRA base: every policy's client is the one rollout's, and each request names its adapter.
        self.adapters = dict(adapters or {})
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
        if name in self.adapters:
            kwargs["adapter"] = self.adapters[name]
        return await client.generate(request_id, **kwargs)


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
