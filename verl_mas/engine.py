"""The episode engine: runs one workflow episode with tree-structured sampling against an LLM client.

At every (task, role, turn) the acting role draws K candidates from one prompt (one client request with
``n=K``), the workflow rewards each on a clone of its state and commits the best; the episode continues
from the committed candidate (docs/algorithm.md §2). :func:`run_episode` is the one entry point shared by
:func:`verl_mas.testing.run_workflow` and the verl agent loop. It holds no global state and no
concurrency cap: many episodes run concurrently on one event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from verl_mas.chat import render_prompt
from verl_mas.client import GenerateRequest, LLMClient, Sample, validate_samples
from verl_mas.episode import GROUP_KEY_SEP, Candidate, Candidates, Episode, group_key
from verl_mas.settings import EpisodeConfig
from verl_mas.errors import INFRA_EXCEPTIONS, ContextOverflowError, InfraError, LLMClientError, WorkflowError
from verl_mas.registry import get_workflow, workflow_name
from verl_mas.workflow import Workflow

__all__ = ["EpisodeRuntime", "run_episode"]

logger = logging.getLogger(__name__)


def _derive_seed(seed: int, key: str) -> int:
    # Stable across processes (Python's hash() of str is salted per process).
    return int.from_bytes(hashlib.blake2b(f"{seed}{GROUP_KEY_SEP}{key}".encode(), digest_size=8).digest(), "little")


class EpisodeRuntime:
    """The engine side of one episode: what a :class:`~verl_mas.Workflow` instance talks to."""

    def __init__(
        self,
        *,
        workflow_name: str,
        roles: tuple[str, ...],
        task_uid: str,
        client: LLMClient,
        tokenizer: Any,
        config: EpisodeConfig,
        seed: int,
    ) -> None:
        self.workflow_name = workflow_name
        self.roles = roles
        self.task_uid = task_uid
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.seed = seed
        self.rng = random.Random(seed)
        self.tie_rng = random.Random(f"{seed}{GROUP_KEY_SEP}tie-break")  # separate: ties must not shift self.rng
        self.metrics: dict[str, float] = {}
        self.turn = 0
        self.terminated = False
        self.ran_out_of_turns = False
        self.last_role: str | None = None
        self.groups: list[Candidates] = []
        self.infra_failures = 0
        self._acted: set[tuple[str, int]] = set()
        self._order: dict[str, int] = {}

    def where(self) -> str:
        """``workflow 'x', role 'r', turn t`` for error messages."""
        role = f"role {self.last_role!r}" if self.last_role is not None else "before any generate()"
        return f"workflow {self.workflow_name!r}, {role}, turn {self.turn}"

    def _tokenizer_for(self, role: str) -> Any:
        return self.tokenizer[role] if isinstance(self.tokenizer, Mapping) else self.tokenizer

    async def generate(self, role: str, messages: Sequence[Mapping[str, Any]]) -> Candidates:
        """Sample one group for ``role`` at the current turn (see :meth:`verl_mas.Workflow.generate`)."""
        turn = self.turn
        if role not in self.roles:
            raise WorkflowError(
                f"workflow {self.workflow_name!r}, turn {turn}: generate() was called for role {role!r}, which is "
                f"not declared. Declared roles: {self.roles}. Roles select policies and name metrics; add it "
                "to the class's `roles` tuple or fix the name."
            )
        if (role, turn) in self._acted:
            raise WorkflowError(
                f"workflow {self.workflow_name!r}: role {role!r} generated twice in turn {turn}. A group is "
                "(task, role, turn), so a role acts at most once per turn; advance turns with "
                "`for turn in self.turns():` (a second action of the same role is a new turn)."
            )
        self._acted.add((role, turn))
        self.last_role = role
        key = group_key(self.task_uid, role, turn)
        self._order[key] = len(self._order)
        tokenizer = self._tokenizer_for(role)
        prompt_ids = render_prompt(tokenizer, messages, chat_template_kwargs=self.config.chat_template_kwargs_for(role))
        limit = self.config.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            # The workflow's own outcome (its chat grew too long), not an infrastructure failure.
            raise ContextOverflowError(
                f"the prompt of {role!r} at turn {turn} has {len(prompt_ids)} tokens; the model can answer prompts "
                f"of at most {limit} (rollout.max_model_len or prompt_length + response_length, minus one)"
            )
        n = self.config.branching
        request = GenerateRequest(
            role=role,
            prompt_ids=prompt_ids,
            n=n,
            group_key=key,
            session_id=f"{self.task_uid}{GROUP_KEY_SEP}{role}{GROUP_KEY_SEP}{self.seed}",
            seed=_derive_seed(self.seed, key),
            messages=tuple(dict(m) for m in messages),
        )
        samples = await self._request(request)
        members = [self._candidate(request, i, s, tokenizer) for i, s in enumerate(samples)]
        group = Candidates(
            role=role,
            turn=turn,
            key=key,
            prompt_ids=prompt_ids,
            messages=request.messages,
            members=members,
            tie_break=self.config.tie_break,
            tie_rng=self.tie_rng,
            workflow_name=self.workflow_name,
        )
        self.groups.append(group)
        failed = group.failed
        self.infra_failures += len(failed)
        if failed:
            logger.warning(
                "%s: %d of %d candidates of %s lost to infrastructure failures: %s",
                self.workflow_name,
                len(failed),
                n,
                key,
                failed[0].infra_error,
            )
        if not len(group):
            raise InfraError(f"all {n} candidates of group {key!r} failed: {failed[0].infra_error}")
        return group

    async def _request(self, request: GenerateRequest) -> list[Sample]:
        client = self.client
        try:
            timeout = self.config.request_timeout_s
            if timeout is None:
                samples = await client.generate(request)
            elif hasattr(asyncio, "timeout"):  # Python >= 3.11: no extra task, the request starts now
                async with asyncio.timeout(timeout):
                    samples = await client.generate(request)
            else:
                samples = await asyncio.wait_for(client.generate(request), timeout)
        except INFRA_EXCEPTIONS as e:
            return [Sample.failed(f"{type(e).__name__}: {e}".rstrip(": "))] * request.n
        except Exception as e:
            raise LLMClientError(
                f"LLM client {type(client).__name__} raised {type(e).__name__} for group {request.group_key!r}: {e}. "
                "Clients raise verl_mas.InfraError (or TimeoutError/ConnectionError) for infrastructure failures, "
                "which the engine records as untrainable candidates; anything else is a bug in the client."
            ) from e
        problems = validate_samples(samples, request, client)
        if problems:
            raise LLMClientError(
                f"LLM client {type(client).__name__} broke the LLMClient contract for group {request.group_key!r}: "
                + "; ".join(problems)
                + ". It must return exactly n verl_mas.Sample objects with one log-prob per token."
            )
        return samples

    def _candidate(self, request: GenerateRequest, index: int, sample: Sample, tokenizer: Any) -> Candidate:
        failed = sample.error is not None
        return Candidate(
            role=request.role,
            turn=self.turn,
            index=index,
            group_key=request.group_key,
            prompt_ids=list(request.prompt_ids),
            response_ids=[] if failed else list(sample.token_ids),
            logprobs=None if failed or sample.logprobs is None else list(sample.logprobs),
            text="" if failed else tokenizer.decode(sample.token_ids, skip_special_tokens=True),
            stop_reason=sample.stop_reason,
            trainable=not failed,
            infra_error=sample.error,
            extra=dict(sample.extra),
            alpha=float(self.config.alpha),
        )

    def finish(self, *, aborted: bool, error: str | None, context_overflow: bool = False) -> Episode:
        """Check rewards and metrics, add the engine's metrics and build the :class:`Episode`."""
        groups = sorted(self.groups, key=lambda g: self._order[g.key])
        unrewarded = [(g.key, c.index) for g in groups for c in g if c.reward is None]
        if unrewarded and not aborted and not context_overflow:
            raise WorkflowError(
                f"workflow {self.workflow_name!r} ended with {len(unrewarded)} unrewarded candidates "
                f"(group, index): {unrewarded[:8]}{' ...' if len(unrewarded) > 8 else ''}. Every sampled candidate "
                "is a training sample and needs a finite reward; set candidate.reward (or team_reward/local_reward) "
                "on every candidate of every group, including the last turn's and unparsable ones."
            )
        incomplete = 0
        for g in groups:
            for c in g:
                if c.reward is None:  # aborted mid-turn: no reward to train on
                    c.trainable = False
                    incomplete += 1
        bad = {
            k: v
            for k, v in self.metrics.items()
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        }
        if bad:
            raise WorkflowError(
                f"workflow {self.workflow_name!r} reported metrics that are not finite numbers: {bad!r}. "
                "self.metrics holds floats only (they are averaged across episodes); convert or drop them."
            )
        truncated = (self.ran_out_of_turns and not self.terminated or context_overflow) and not aborted
        terminated = not truncated and not aborted
        metrics = {k: float(v) for k, v in self.metrics.items()}
        if context_overflow:
            metrics["mas/success"] = 0.0  # the workflow did not reach its goal within the model's context
        metrics.update(self._engine_metrics(groups, terminated, truncated, aborted, incomplete))
        metrics["mas/context_overflow"] = float(context_overflow)
        return Episode(
            workflow_id=self.workflow_name,
            task_uid=self.task_uid,
            seed=self.seed,
            roles=self.roles,
            config=self.config,
            groups=groups,
            terminated=terminated,
            truncated=truncated,
            aborted=aborted,
            error=error,
            metrics=metrics,
            context_overflow=context_overflow,
        )

    def _engine_metrics(
        self, groups: list[Candidates], terminated: bool, truncated: bool, aborted: bool, incomplete: int
    ) -> dict[str, float]:
        trainable = [c for g in groups for c in g.all if c.trainable]
        out = {
            "mas/num_turns": float(1 + max((g.turn for g in groups), default=-1)),
            "mas/terminated": float(terminated),
            "mas/truncated": float(truncated),
            "mas/aborted": float(aborted),
            "mas/num_candidates": float(sum(len(g.all) for g in groups)),
            "mas/infra_failures": float(self.infra_failures),
            "mas/incomplete": float(incomplete),
            "mas/parse_failures": float(sum(c.parse_failed for c in trainable)),
        }
        for role in self.roles:
            mine = [c for c in trainable if c.role == role]
            out[f"mas/{role}/parse_failures"] = float(sum(c.parse_failed for c in mine))
            if mine:
                out[f"mas/{role}/reward/mean"] = sum(c.reward for c in mine) / len(mine)  # type: ignore[misc]
        return out


async def run_episode(
    workflow: str | type[Workflow],
    task: Any,
    *,
    client: LLMClient,
    tokenizer: Any,
    config: EpisodeConfig | None = None,
    seed: int = 0,
    task_uid: str = "task0",
) -> Episode:
    """Run one episode of ``workflow`` on ``task`` and return its record.

    Args:
        workflow: A workflow class, id (``"sudoku-v0"``) or ``"package.module:Class"``.
        task: The task payload handed to ``Workflow.run``.
        client: Samples K candidates per group (:class:`~verl_mas.client.LLMClient`).
        tokenizer: The Hugging Face tokenizer whose chat template renders prompts, or a mapping
            role -> tokenizer when roles are served by models with different tokenizers.
        config: Branching, turns, reward mixing, tie-break; defaults to :class:`EpisodeConfig()`.
        seed: Seeds ``Workflow.rng``, tie-breaks and the per-group request seeds.
        task_uid: Stable id of the task; the first part of every group key. May not contain ``"|"``.

    Returns:
        The :class:`Episode`. An infrastructure failure that leaves a group without any candidate
        ends the episode early with ``aborted=True``: the groups completed before remain trainable. A
        prompt longer than ``config.max_prompt_tokens`` ends it truncated with ``context_overflow=True``
        (a failure: ``mas/success`` 0).

    Raises:
        WorkflowError: When workflow code raises (chained; the message names workflow, role and turn),
            or a candidate is left unrewarded.
        LLMClientError: When the client breaks its contract.
    """
    cls = get_workflow(workflow)
    config = EpisodeConfig() if config is None else config
    name = workflow_name(cls)
    if not isinstance(task_uid, str) or not task_uid or GROUP_KEY_SEP in task_uid:
        raise ValueError(
            f"task_uid {task_uid!r} must be a non-empty string without {GROUP_KEY_SEP!r}: it is the first part of "
            "every group key (task uid, role, turn). Use the dataset's stable task id."
        )
    if isinstance(tokenizer, Mapping):
        missing = [r for r in cls.roles if r not in tokenizer]
        if missing:
            raise ValueError(
                f"the tokenizer mapping has no entry for roles {missing}; give one tokenizer per role of {name!r}"
            )
    runtime = EpisodeRuntime(
        workflow_name=name,
        roles=cls.roles,
        task_uid=task_uid,
        client=client,
        tokenizer=tokenizer,
        config=config,
        seed=seed,
    )
    aborted, overflow, error = False, False, None
    instance = cls.__new__(cls)
    instance._runtime = runtime  # attached before __init__, so a custom __init__ may use self.rng
    try:
        instance.__init__()  # type: ignore[misc]
        await instance.run(task)
    except ContextOverflowError as e:
        overflow, error = True, f"{type(e).__name__}: {e}"
        logger.info("%s (task %s): episode ended out of context: %s", name, task_uid, e)
    except InfraError as e:
        aborted, error = True, f"{type(e).__name__}: {e}"
        logger.warning("%s (task %s): episode aborted by an infrastructure failure: %s", name, task_uid, e)
    except (WorkflowError, LLMClientError):
        raise
    except Exception as e:
        raise WorkflowError(
            f"{runtime.where()}: the workflow raised {type(e).__name__}: {e}. This is a bug in the workflow code, "
            "not a model mistake: a model mistake (unparsable output, failing code) must become a low reward "
            "with candidate.parse_failed = True. See the chained traceback."
        ) from e
    return runtime.finish(aborted=aborted, error=error, context_overflow=overflow)
