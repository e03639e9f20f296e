"""The verl agent loop ``mas``: runs one workflow episode per dataset row and returns one output per candidate.

verl's AgentLoopWorker instantiates this class for rows whose ``agent_name`` is ``"mas"`` (rows written by
``python -m verl_mas.data``). Each run:

1. reads the workflow id and the task from the row's ``extra_info`` (``workflow``, ``task`` as JSON);
2. runs the episode engine (:func:`verl_mas.run_episode`) with a client that sends every request to
   verl's LLM server client, token ids in and out, one request of K samples per group on the ``hf`` backend
   (K concurrent single-sample requests on the others), one sticky routing key per (episode, role);
3. returns one :class:`AgentLoopOutput` per *trainable* candidate (infrastructure failures are dropped,
   never trained on), with the sampled ids, their rollout log-probs, and a :class:`verl_mas.rows.CandidateRow`
   in ``extra_fields`` (role, turn, policy, rewards, the committed flag, a prompt hash the ``mas`` trainer checks).

verl copies the last output's ``reward_score`` onto the earlier outputs of a run, so each candidate's own
reward travels in its row; the ``mas`` trainer rebuilds the token-level scores from it. For the same
reason the loop refuses to run under any trainer mode but ``mas``. Each role's requests go to its
policy's servers through :class:`verl_mas.routing.RoleRoutedClient`.

Validation rows (``extra_info.split == "test"``) play ``mas.val_branching`` candidates per node, each policy
sampled with its ``val_kwargs`` (greedy where ``val_kwargs.do_sample`` is false, with one policy as with several:
:meth:`MasAgentLoop._policy_sampling`), and with ``mas.val_greedy`` the task's greedy episode, played once per task
and reported by each of its ``val_kwargs.n`` sessions as ``acc_greedy`` (:func:`_shared_greedy_success`).

Failures: a rollout server that is gone (a lost actor, a timeout) is an infrastructure failure (the
candidate is dropped, and an episode left without candidates is aborted); a server that *raises* on a
request does so deterministically (a bad request) and stops the run. A prompt the model cannot answer any
more (longer than the context allows) is the workflow's own outcome: the episode ends as a failure. An
episode that raises is reported to the trainer (:mod:`verl_mas.error_log`), which stops the run with it.

Why one module of ~470 lines: everything verl's agent-loop worker calls for a row is here (the row's
workflow and task, each policy's sampling in training and validation, the episode, the greedy validation
episode, the rows verl receives), so the contract with verl's worker reads in one place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.v1.agent_loop_tq import apply_greedy_sampling_params
from verl.workers.config import SamplingConfig

from verl_mas.backends.counters import REPLICA_FIELD
from verl_mas.backends.hf import BACKEND_NAME as HF_BACKEND
from verl_mas.backends.hf import GROUP_FIELD, SAMPLES_KWARG
from verl_mas.client import GenerateRequest, Sample, fan_out
from verl_mas.config import MasConfig, MasConfigError, mas_trainer_selected
from verl_mas.engine import run_episode
from verl_mas.episode import GROUP_KEY_SEP, Candidate, Episode
from verl_mas.error_log import record_error
from verl_mas.errors import InfraError
from verl_mas.routing import RoleRoutedClient, RoleRouter, candidate_request_id
from verl_mas.rows import CandidateRow, prompt_hash

logger = logging.getLogger(__name__)


#: verl's defaults for a ``val_kwargs`` block that leaves a key out (its ``SamplingConfig``).
VAL_DO_SAMPLE_DEFAULT: bool = SamplingConfig.do_sample
VAL_SESSIONS_DEFAULT: int = SamplingConfig.n


def episode_seed(uid: str, session_id: int) -> int:
    digest = hashlib.blake2b(f"{uid}|{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 31) - 1)


#: Per worker process (verl instantiates an agent loop per episode): the policies' tokenizers, and how many
#: episodes were recorded per (folder, source, step) for ``mas.record``.
_POLICY_TOKENIZERS: dict[tuple[Any, ...], dict[str, Any]] = {}
_RECORDED: dict[tuple[str, str, int], int] = {}


def _weight_versions(candidates: Any) -> list[int]:
    """The weight version (verl's ``global_steps`` at the last sync) each candidate's server sampled it with."""
    return [int(c.extra.get("global_steps", 0) or 0) for c in candidates]


class RolloutServerError(RuntimeError):
    """A rollout server raised on a request: deterministic (the same request fails again), so the run stops."""


def _team_success(episode: Episode) -> float | None:
    """The episode's ``mas/success`` (None if the workflow reports none); an aborted episode is a failure of the
    team (verl also counts a session without rows as acc 0)."""
    if "mas/success" not in episode.metrics:
        return None
    return 0.0 if episode.aborted else float(episode.metrics["mas/success"])


@dataclasses.dataclass
class _SharedGreedy:
    """The greedy episode of one validation task, played once, and how many of its sessions have yet to read it."""

    success: asyncio.Future[float | None]
    unread: int


#: Per worker process: the greedy episode of each validation task in flight, by task uid (verl runs every session
#: of a task in one agent-loop worker, and gives each validation row a fresh uid).
_GREEDY: dict[str, _SharedGreedy] = {}


async def _shared_greedy_success(uid: str, sessions: int,
                                 play: Callable[[], Awaitable[float | None]]) -> float | None:
    """The team success of task ``uid``'s greedy episode: played by the first of its ``sessions`` validation
    sessions to ask, read by all of them.

    Each of the task's ``val_kwargs.n`` sessions reports the same ``acc_greedy``, so verl's per-task
    ``acc_greedy/mean@n`` is the greedy episode's success, and the greedy episode, deterministic in the task, costs
    one episode per task instead of one per session. The entry leaves when its last session has read it (a session
    that raised before asking stops the run, leaving one small entry; sessions beyond ``sessions``, e.g. a row with
    its own ``__rollout_n__``, play the episode again). A greedy episode that raises raises in every session that
    reads it.
    """
    loop = asyncio.get_running_loop()
    entry = _GREEDY.get(uid)
    if entry is None or entry.success.get_loop() is not loop:  # another event loop's entry: never this run's
        entry = _GREEDY[uid] = _SharedGreedy(asyncio.ensure_future(play()), max(1, sessions))
    entry.unread -= 1
    if entry.unread <= 0:
        del _GREEDY[uid]
    # shield: a session cancelled while waiting does not cancel the episode its siblings read.
    return await asyncio.shield(entry.success)


def _is_greedy(params: Mapping[str, Any]) -> bool:
    return float(params.get("temperature", 1.0)) <= 0.0


def _greedy(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with verl's greedy decoding (its ``apply_greedy_sampling_params``: temperature 0, no top-k/p)."""
    out = dict(params)
    apply_greedy_sampling_params(out)
    return out


def _is_infra_cause(cause: BaseException | None) -> bool:
    """Whether an exception raised inside a rollout server is the infrastructure's (transient), not the request's."""
    import torch

    transient = (InfraError, TimeoutError, ConnectionError, MemoryError, torch.OutOfMemoryError)
    return isinstance(cause, transient)


class VerlServerClient:
    """:class:`verl_mas.LLMClient` over verl's LLM server client (``server_manager`` of an agent loop).

    verl's server contract is one sample per request. On such backends a group of K is K concurrent requests of
    the same prompt ids, each with its own request id routed by the (episode, role) session
    (:func:`verl_mas.routing.candidate_request_id`). On the ``hf`` backend (``grouped``) a group is one request
    for K samples (:data:`verl_mas.backends.hf.SAMPLES_KWARG`, passed through by verl's client), decoded in one
    batch: one Ray round trip per group instead of K (``bench/bench_rollout_requests.py``). A lost server (Ray
    actor errors, timeouts, a server out of memory) is an infrastructure failure: its candidates are dropped. A
    server that raises on the request (e.g. verl's "leaves no room to generate") raises :class:`RolloutServerError`.

    Args:
        server_manager: verl's client (with several policies a :class:`verl_mas.routing.PolicyRouterClient`).
        sampling_params: verl's sampling parameters, with the policy's own settings over them.
        policy: The policy whose servers answer (None: verl's single stack).
        grouped: Whether those servers answer a request for K samples (the ``hf`` backend).
    """

    def __init__(self, server_manager: Any, sampling_params: Mapping[str, Any], policy: str | None = None,
                 grouped: bool = False) -> None:
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params)
        self.policy = policy
        self.grouped = grouped

    async def _request(self, request: GenerateRequest, request_id: str, **kwargs: Any) -> Any:
        """One request to the policy's servers; Ray's errors mapped onto the failure contract."""
        import ray

        routing = {"policy": self.policy} if self.policy is not None else {}
        try:
            return await self.server_manager.generate(
                request_id=request_id, prompt_ids=list(request.prompt_ids), sampling_params=dict(self.sampling_params),
                **routing, **kwargs,
            )
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if _is_infra_cause(cause):
                raise InfraError(f"rollout server failed for group {request.group_key}: {exc}") from exc
            raise RolloutServerError(
                f"the rollout server raised {type(cause).__name__ if cause else 'an error'} on a request of group "
                f"{request.group_key} ({len(request.prompt_ids)} prompt tokens): {cause or exc}. A server that "
                "rejects a request rejects it again; this is a configuration or workflow bug, not a model "
                "mistake or a transient failure (check rollout.prompt_length/response_length/max_model_len)."
            ) from exc
        except ray.exceptions.RayError as exc:  # the actor or its node is gone, the object lost, ...
            raise InfraError(f"rollout server failed for group {request.group_key}: {exc}") from exc

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        turn = int(request.group_key.rpartition(GROUP_KEY_SEP)[2])
        if not self.grouped:
            async def one(i: int) -> Sample:
                return _sample(await self._request(request, candidate_request_id(request.session_id, turn, i)))

            return await fan_out(request.n, one)
        # One request for the group, under its first candidate's id (the session part routes it).
        out = await self._request(request, candidate_request_id(request.session_id, turn, 0),
                                  **({SAMPLES_KWARG: request.n} if request.n > 1 else {}))
        if request.n == 1:
            return [_sample(out)]
        fields = dict(out.extra_fields or {})
        group = fields.pop(GROUP_FIELD, None)
        if not isinstance(group, list) or len(group) != request.n:
            raise RolloutServerError(
                f"asked the rollout server for {request.n} samples of group {request.group_key} in one request "
                f"({SAMPLES_KWARG}) and got {len(group) if isinstance(group, list) else 'no'} in "
                f"extra_fields[{GROUP_FIELD!r}]. Only rollout.name={HF_BACKEND!r} answers such requests."
            )
        # verl's client stamped its fields (min/max_global_steps) on the request's output: every sample shares them.
        return [_sample(o, shared=fields) for o in group]


def _sample(out: Any, shared: Mapping[str, Any] | None = None) -> Sample:
    """A verl ``TokenOutput`` as a :class:`Sample` (``shared``: the request's fields, under the sample's own)."""
    if out.stop_reason == "aborted":
        return Sample.failed("the rollout server aborted the request")
    return Sample(
        token_ids=list(out.token_ids),
        logprobs=list(out.log_probs) if out.log_probs is not None else None,
        stop_reason=out.stop_reason,
        extra={**(shared or {}), **(out.extra_fields or {})},
    )


class MasAgentLoop(AgentLoopBase):
    """verl agent loop running a verl_mas workflow episode (registered as ``mas``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not mas_trainer_selected(self.config):
            mode = (self.config.get("trainer", None) or {}).get("v1", {}).get("trainer_mode", None)
            raise ValueError(
                f"The mas agent loop runs under trainer.v1.trainer_mode={mode!r}, but only the mas trainer mode "
                "trains its outputs correctly: one episode yields one row per candidate, each with its own reward "
                "and (task, role, turn) group, and verl's other trainers copy the last row's reward onto every row "
                "(at_grpo advantages become 0, grpo broadcasts one raw reward). Set trainer.v1.trainer_mode=mas "
                "(with algorithm.adv_estimator=at_grpo), as recipes/at_grpo_cpu does."
            )
        self.mas_config = MasConfig.from_verl_config(self.config)
        self.router = RoleRouter.from_mas(self.mas_config)
        self.policy_configs: dict[str, Any] = {}
        if self.mas_config.multi_policy:
            from verl_mas.policies import policy_configs

            self.policy_configs = policy_configs(self.config.actor_rollout_ref, self.mas_config)
        # Each role renders its prompts and decodes its answers with its own policy's tokenizer.
        self.role_tokenizers = self.router.tokenizers(self._policy_tokenizers())
        self.record_settings = self.mas_config.record_settings
        if self.mas_config.sandbox:
            # Workflows run model-written code through verl_mas.sandbox.run_python(): configure it from mas.sandbox.
            from verl_mas import sandbox

            sandbox.configure(self.mas_config.sandbox)
        self.response_length = int(self.rollout_config.response_length)
        # The longest prompt verl's servers can answer: they need at least one token of room.
        max_model_len = self.rollout_config.get("max_model_len", None) or (
            int(self.rollout_config.prompt_length) + self.response_length)
        self.max_prompt_tokens = int(max_model_len) - 1

    def _policy_tokenizers(self) -> dict[str, Any]:
        """``{policy: tokenizer}``: verl's (the first policy's) for every policy whose tokenizer is the same
        file, the policy's own otherwise (loaded the way verl loads the first; checked to fit its model)."""
        if not self.policy_configs:
            return {name: self.tokenizer for name in self.router.policies}

        def source(arr: Any) -> str | None:
            model = arr.get("model", None) or {}
            return model.get("tokenizer_path", None) or model.get("path", None)

        names = list(self.policy_configs)
        first = source(self.policy_configs[names[0]])
        if all(source(arr) == first for arr in self.policy_configs.values()):
            return {name: self.tokenizer for name in names}
        # verl builds an agent loop per episode: load the policies' tokenizers once per worker process.
        key = (id(self.tokenizer),
               tuple((name, source(arr), str(arr.model.path)) for name, arr in self.policy_configs.items()))
        if key not in _POLICY_TOKENIZERS:
            _POLICY_TOKENIZERS[key] = self._load_policy_tokenizers(first, source)
        return _POLICY_TOKENIZERS[key]

    def _load_policy_tokenizers(self, first: str | None, source: Any) -> dict[str, Any]:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from verl_mas.routing import tokenizer_fit_problems

        loaded: dict[str, Any] = {first: self.tokenizer}
        out, sizes = {}, {}
        for name, arr in self.policy_configs.items():
            # verl's HFModelConfig: the policy's tokenizer and model config, loaded as verl loads the first's.
            model = omega_conf_to_dataclass(arr.model, dataclass_type=HFModelConfig)
            loaded.setdefault(source(arr), model.tokenizer)
            out[name] = loaded[source(arr)]
            sizes[name] = int(model.hf_config.vocab_size)
        problems = tokenizer_fit_problems(out, sizes, padding=self.tokenizer)
        if problems:
            raise MasConfigError("The policies' tokenizers do not fit their models:\n  - " + "\n  - ".join(problems))
        return out

    def _policy_rollouts(self) -> dict[str, Any]:
        """Each policy's rollout config: its own with several policies (shared LoRA base or not), verl's with one."""
        if self.policy_configs:
            return {name: arr.rollout for name, arr in self.policy_configs.items()}
        return {name: self.rollout_config for name in self.router.policies}

    def _policy_sampling(self, validate: bool) -> dict[str, dict[str, Any]]:
        """Each policy's own sampling settings: its rollout's temperature/top_p/top_k, or in validation its
        ``val_kwargs``', greedy (verl's ``apply_greedy_sampling_params``) where ``val_kwargs.do_sample`` is false.

        One path for every policy layout. verl's V1 agent loop hands validation ``val_kwargs``' temperature, top-p
        and top-k but ignores ``do_sample``, so reading ``do_sample`` here is what makes ``do_sample=false`` at a
        temperature above 0 decode greedily with one policy as with several. A ``val_kwargs`` without
        ``do_sample`` takes verl's default (its ``SamplingConfig``: sample).
        """
        out = {}
        for name, rollout in self._policy_rollouts().items():
            source = (rollout.get("val_kwargs", None) or {}) if validate else rollout
            out[name] = {k: source[k] for k in ("temperature", "top_p", "top_k") if k in source}
            if validate and not source.get("do_sample", VAL_DO_SAMPLE_DEFAULT):
                apply_greedy_sampling_params(out[name])
        return out

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        try:
            return await self._run(sampling_params, **kwargs)
        except Exception as error:
            # A bug or a deterministic server error, never a model mistake: the trainer stops the step with it
            # (verl_mas.error_log); verl's worker logs the traceback and marks the task failed.
            await record_error(str(kwargs.get("uid")), error)
            raise

    async def _run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        workflow_id, task = self._workflow_and_task(kwargs)
        uid = str(kwargs["uid"])
        session_id = int(kwargs.get("session_id", 0))
        if not sampling_params.get("logprobs"):
            raise ValueError(
                "The mas agent loop trains on the rollout log-probs of every candidate, but the rollout does not "
                "return them. Set actor_rollout_ref.rollout.calculate_log_probs=True."
            )
        # verl does not tell an agent loop whether it runs a validation step; validation rows carry the
        # split python -m verl_mas.data wrote into extra_info.
        validate = (kwargs.get("extra_info") or {}).get("split") == "test"
        # Each role's requests reach its policy's servers, sampled with the policy's own settings over verl's.
        own = self._policy_sampling(validate)
        params = {name: {**sampling_params, **own.get(name, {})} for name in self.router.policies}
        config = self.mas_config.episode_config_for(
            validate=validate, chat_template_kwargs=self.apply_chat_template_kwargs,
            max_prompt_tokens=self.max_prompt_tokens,
        )
        episode = await self._play(workflow_id, task, params, config, seed=episode_seed(uid, session_id), uid=uid)
        self._record(episode, task, validate)
        extra_info = {}
        if validate and self.mas_config.val_greedy and not all(_is_greedy(p) for p in params.values()):
            # The same task played greedily (one candidate per node): its team success is ``acc_greedy``
            # (verl logs it as val-aux/<source>/acc_greedy/mean@n next to the sampled val-core acc).
            greedy = {name: _greedy(p) for name, p in params.items()}
            one = dataclasses.replace(config, branching=1)

            async def play() -> float | None:
                # Seeded as the task's first session: the one greedy episode of the task, whichever session plays it.
                return _team_success(await self._play(workflow_id, task, greedy, one, seed=episode_seed(uid, 0),
                                                      uid=uid))

            extra_info["acc_greedy"] = await _shared_greedy_success(uid, self._val_sessions(), play)
        if episode.aborted:
            logger.warning("episode of %s for row %s aborted: %s", workflow_id, uid, episode.error)
            if self.mas_config.grouping == "trajectory":
                # Trajectory-level GRPO scores every row with the episode's outcome, which an infrastructure
                # failure left unknown: none of its rows is trained on (the trainer counts it as aborted).
                return []
        return self._outputs(episode, workflow_id, extra_info)

    def _val_sessions(self) -> int:
        """Validation sessions per task (verl's ``val_kwargs.n``; one setting for every policy)."""
        val_kwargs = self.rollout_config.get("val_kwargs", None) or {}
        return int(val_kwargs.get("n", VAL_SESSIONS_DEFAULT))

    async def _play(self, workflow_id: str, task: Any, params: Mapping[str, Mapping[str, Any]], config: Any, *,
                    seed: int, uid: str) -> Episode:
        """One episode, each role's requests sent to its policy's servers with that policy's ``params``."""
        rollouts = self._policy_rollouts()
        client = RoleRoutedClient.from_router(self.router, {
            name: VerlServerClient(self.server_manager, params[name], policy=name if self.router.multi_policy else None,
                                   grouped=rollouts[name].get("name", None) == HF_BACKEND)
            for name in self.router.policies
        })
        return await run_episode(workflow_id, task, client=client, tokenizer=self.role_tokenizers, config=config,
                                 seed=seed, task_uid=uid)

    def _record(self, episode: Episode, task: Any, validate: bool) -> None:
        """Write the episode for ``python -m verl_mas.view`` if ``mas.record`` asks for this step (and budget is left)."""
        settings = self.record_settings
        if not settings.enabled:
            return
        versions = _weight_versions(c for c in episode.candidates if c.infra_error is None)
        # The server reports the weight version it sampled with (the number of updates applied): training step
        # t samples with version t - 1; the validation after step t (logged at step t) with version t.
        step = max(versions, default=0) + (0 if validate else 1)
        source = "val" if validate else "train"
        key = (str(settings.dir), source, step)
        if not settings.records_step(step) or _RECORDED.get(key, 0) >= settings.episodes:
            return
        _RECORDED[key] = _RECORDED.get(key, 0) + 1
        from verl_mas.recording import episode_record, write_records

        algorithm = self.config.get("algorithm", None) or {}
        record = episode_record(
            episode, source=source, task=task, step=step, tokenizer=self.role_tokenizers,
            policies={role: self.router.policy_of(role) for role in episode.roles},
            grouping=self.mas_config.grouping, sampling=self.mas_config.sampling,
            norm_by_std=bool(algorithm.get("norm_adv_by_std_in_grpo", True)),
            singleton=self.mas_config.singleton_advantage,
        )
        write_records(settings.path(source, step), [record])

    def _workflow_and_task(self, row: Mapping[str, Any]) -> tuple[str, Any]:
        extra = row.get("extra_info") or {}
        workflow_id = extra.get("workflow") or self.mas_config.workflow
        if not workflow_id:
            raise ValueError(
                f"Dataset row {row.get('index')!r} names no workflow: extra_info has no 'workflow' and mas.workflow "
                "is unset. Write the data with `python -m verl_mas.data <workflow-id> ...` or set mas.workflow."
            )
        if "task" not in extra:
            raise ValueError(
                f"Dataset row {row.get('index')!r} has no extra_info.task (the task payload as JSON). Write the "
                "data with `python -m verl_mas.data <workflow-id> ...`."
            )
        task = extra["task"]
        return str(workflow_id), json.loads(task) if isinstance(task, str) else task

    def _outputs(self, episode: Episode, workflow_id: str, extra_info: Mapping[str, float] | None = None
                 ) -> list[AgentLoopOutput]:
        trainable = [c for c in episode.candidates if c.trainable]
        steps = _weight_versions(trainable) or [0]
        episode_metrics = {k: float(v) for k, v in episode.metrics.items()}
        # verl's validation reports reward_extra_info per data source; "acc" becomes val-core/<source>/acc.
        success = _team_success(episode)
        reward_extra_info = {} if success is None else {"acc": success}
        reward_extra_info.update({k: v for k, v in (extra_info or {}).items() if v is not None})
        outputs = []
        for i, cand in enumerate(trainable):
            outputs.append(
                self._output(cand, i, episode, workflow_id, episode_metrics, reward_extra_info, min(steps), max(steps))
            )
        return outputs

    def _output(
        self,
        cand: Candidate,
        index: int,
        episode: Episode,
        workflow_id: str,
        episode_metrics: dict[str, float],
        reward_extra_info: dict[str, float],
        min_steps: int,
        max_steps: int,
    ) -> AgentLoopOutput:
        response = list(cand.response_ids)[: self.response_length]
        logprobs = list(cand.logprobs)[: self.response_length] if cand.logprobs is not None else None
        if logprobs is None or len(logprobs) != len(response):
            raise ValueError(
                f"Candidate {cand.group_key}#{cand.index} has {0 if logprobs is None else len(logprobs)} rollout "
                f"log-probs for {len(response)} response tokens. The rollout server must return one log-prob per "
                "sampled token (actor_rollout_ref.rollout.calculate_log_probs=True)."
            )
        reward = float(cand.reward)  # the engine guarantees a finite reward on every trainable candidate
        row = CandidateRow(
            workflow=workflow_id,
            role=cand.role,
            turn=int(cand.turn),
            policy=self.router.policy_of(cand.role),
            reward=reward,
            team_reward=float("nan") if cand.team_reward is None else float(cand.team_reward),
            local_reward=float("nan") if cand.local_reward is None else float(cand.local_reward),
            committed=bool(cand.committed),
            prompt_hash=prompt_hash(cand.prompt_ids),
            episode_index=index,
            episode_metrics=episode_metrics,
            replica=int(cand.extra.get(REPLICA_FIELD, -1)),
        )
        extra = {
            **row.to_extra_fields(),
            # verl's own fields: validation's per-source metrics and the weight versions that sampled the row.
            "reward_extra_info": dict(reward_extra_info),
            "global_steps": max_steps,
            "min_global_steps": min_steps,
            "max_global_steps": max_steps,
        }
        return AgentLoopOutput(
            prompt_ids=list(cand.prompt_ids),
            response_ids=response,
            response_mask=[1] * len(response),
            response_logprobs=logprobs,
            reward_score=reward,
            num_turns=int(episode.num_turns),
            metrics=AgentLoopMetrics(),
            extra_fields=extra,
        )
