"""Test doubles for workflows: scripted and random LLMs, ``run_workflow`` and the ``check_workflow`` checker.

Everything here runs in-process on CPU with a real tokenizer (the project's tiny ChatML tokenizer by
default): no GPU, model, Ray or verl trainer. Typical use in a workflow's own tests::

    from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow

    episode = run_workflow(MyWorkflow, TASK, llm=ScriptedLLM({"solver": ["(3+5)*2"]}), branching=4)
    check_workflow(MyWorkflow, TASK)   # roles, rewards, one prompt per group, termination, seeds
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from verl_mas.chat import Message
from verl_mas.client import GenerateRequest, Sample, fan_out
from verl_mas.conformance import WorkflowCheckError, acheck_workflow, check_workflow, run_sync
from verl_mas.engine import run_episode
from verl_mas.episode import Episode, EpisodeConfig
from verl_mas.registry import get_workflow
from verl_mas.workflow import Workflow

__all__ = [
    "RandomLLM",
    "ScriptedLLM",
    "WorkflowCheckError",
    "acheck_workflow",
    "arun_workflow",
    "check_workflow",
    "default_tokenizer",
    "run_workflow",
]

Reply = str | BaseException
#: Per-role replies (a list cycled through, or one string), or a callable ``(role, messages) -> str``.
Script = Mapping[str, Sequence[Reply] | Reply] | Callable[[str, list[Message]], str | Awaitable[str]]


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The project's tiny byte-level BPE tokenizer with a ChatML template (built once, ~3 s)."""
    from verl_mas.tiny import build_tokenizer

    return build_tokenizer()


class _CountingClient:
    """In-flight bookkeeping and optional latency shared by the test doubles."""

    tokenizer: Any

    def __init__(self, tokenizer: Any, latency_s: float) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s is {latency_s}; it must be >= 0 seconds")
        self.tokenizer = tokenizer
        self.latency_s = latency_s
        self.requests: list[GenerateRequest] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.num_samples = 0

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{type(self).__name__} has no tokenizer. run_workflow() binds one; when calling run_episode() "
                f"yourself, pass {type(self).__name__}(..., tokenizer=tok)."
            )
        return self.tokenizer

    async def _timed(self, make: Callable[[], Awaitable[Sample]]) -> Sample:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            sample = await make()
            self.num_samples += 1
            return sample
        finally:
            self.in_flight -= 1


class ScriptedLLM(_CountingClient):
    """An :class:`~verl_mas.client.LLMClient` that answers from a script, through a real tokenizer.

    Args:
        script: Either per-role replies, ``{"solver": ["(3+5)*2", "7"], "verifier": "yes"}``, where each
            candidate of a role takes the role's next reply (cycling; a reply may be an exception such as
            ``InfraError("down")`` to simulate an infrastructure failure of that candidate); or a
            callable ``(role, messages) -> str`` (sync or async), called once per candidate.
        tokenizer: Encodes the replies (``run_workflow`` binds its tokenizer when this is None).
        latency_s: Simulated latency of every sample request; all are in flight concurrently.
        logprob: The log-prob reported for every token.

    Each reply is encoded without special tokens and followed by the EOS id, as a server returns it.
    ``requests`` records every request; ``peak_in_flight`` the most concurrent sample requests.
    """

    def __init__(self, script: Script, *, tokenizer: Any = None, latency_s: float = 0.0, logprob: float = 0.0) -> None:
        super().__init__(tokenizer, latency_s)
        if isinstance(script, Mapping):
            bad = [
                r
                for r, v in script.items()
                if not isinstance(v, (str, BaseException, Sequence))
                or (not isinstance(v, (str, BaseException)) and not all(isinstance(x, (str, BaseException)) for x in v))
            ]
            empty = [r for r, v in script.items() if not isinstance(v, (str, BaseException)) and len(v) == 0]
            if bad or empty:
                raise ValueError(
                    f"ScriptedLLM script for roles {bad + empty} must be a reply string or a non-empty list of "
                    "replies (str, or an exception instance to simulate an infrastructure failure)."
                )
            self._replies: dict[str, list[Reply]] | None = {
                r: [v] if isinstance(v, (str, BaseException)) else list(v) for r, v in script.items()
            }
            self._fn = None
        elif callable(script):
            self._replies, self._fn = None, script
        else:
            raise TypeError(f"ScriptedLLM takes a dict of replies per role or a callable, not {type(script).__name__}")
        self.logprob = float(logprob)
        self._cursor: dict[str, int] = {}

    def _next_reply(self, role: str) -> Reply:
        assert self._replies is not None
        if role not in self._replies:
            raise ValueError(
                f"ScriptedLLM has no replies for role {role!r}; scripted roles: {sorted(self._replies)}. "
                "Add the role to the script."
            )
        i = self._cursor.get(role, 0)
        self._cursor[role] = i + 1
        replies = self._replies[role]
        return replies[i % len(replies)]

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        """Answer ``request.n`` candidates from the script."""
        tokenizer = self._require_tokenizer()
        self.requests.append(request)
        # Replies are assigned now, in candidate order, so the script does not depend on scheduling.
        planned = [self._next_reply(request.role) for _ in range(request.n)] if self._replies is not None else None

        async def reply(i: int) -> Sample:
            text: Any
            if planned is not None:
                text = planned[i]
            else:
                assert self._fn is not None
                text = self._fn(request.role, [dict(m) for m in request.messages])
                if inspect.isawaitable(text):
                    text = await text
            if isinstance(text, BaseException):
                raise text
            if not isinstance(text, str):
                raise TypeError(f"a ScriptedLLM reply must be a str, got {type(text).__name__}: {text!r:.60}")
            ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
            return Sample(token_ids=ids, logprobs=[self.logprob] * len(ids), stop_reason="completed")

        return await fan_out(request.n, lambda i: self._timed(lambda: reply(i)))


class RandomLLM(_CountingClient):
    """An LLM client that answers random text, reproducibly: the random policy of ``check_workflow``.

    Each candidate is 1..``max_tokens`` uniformly random non-special tokens, or, with probability
    ``echo_prob``, one to three words taken from the prompt's messages (so that workflows whose
    answers are words of their prompt also see valid answers), followed by EOS. The text depends only
    on ``seed``, the request's seed (episode seed and group key) and the candidate index, never on
    scheduling. Log-probs are those of the uniform distribution over the vocabulary.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        tokenizer: Any = None,
        max_tokens: int = 8,
        echo_prob: float = 0.5,
        latency_s: float = 0.0,
    ) -> None:
        super().__init__(tokenizer, latency_s)
        self.seed = seed
        self.max_tokens = max_tokens
        self.echo_prob = echo_prob
        self._vocab: list[int] | None = None

    def _vocabulary(self, tokenizer: Any) -> list[int]:
        if self._vocab is None:
            special = set(tokenizer.all_special_ids)
            self._vocab = [i for i in range(len(tokenizer)) if i not in special]
        return self._vocab

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        """Answer ``request.n`` random candidates."""
        tokenizer = self._require_tokenizer()
        self.requests.append(request)
        vocab = self._vocabulary(tokenizer)
        logprob = -math.log(len(vocab))
        words = re.findall(r"[A-Za-z0-9]+", " ".join(str(m.get("content", "")) for m in request.messages))

        async def reply(i: int) -> Sample:
            rng = random.Random(f"{self.seed}|{request.seed}|{i}")
            if words and rng.random() < self.echo_prob:
                ids = list(
                    tokenizer.encode(
                        " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))), add_special_tokens=False
                    )
                )
            else:
                ids = [rng.choice(vocab) for _ in range(rng.randint(1, self.max_tokens))]
            ids.append(tokenizer.eos_token_id)
            return Sample(token_ids=ids, logprobs=[logprob] * len(ids), stop_reason="completed")

        return await fan_out(request.n, lambda i: self._timed(lambda: reply(i)))


def _make_client(llm: Any, seed: int, tokenizer: Any) -> Any:
    if llm is None or llm == "random":
        return RandomLLM(seed, tokenizer=tokenizer)
    if isinstance(llm, str):
        raise ValueError(
            f"llm={llm!r}: pass 'random', a ScriptedLLM (or its script: a dict or callable), or an LLMClient"
        )
    if hasattr(llm, "generate") and callable(llm.generate):
        if getattr(llm, "tokenizer", False) is None:
            llm.tokenizer = tokenizer
        return llm
    if isinstance(llm, Mapping) or callable(llm):
        return ScriptedLLM(llm, tokenizer=tokenizer)
    raise TypeError(
        f"llm must be 'random', a script, a ScriptedLLM/RandomLLM or an LLMClient, not {type(llm).__name__}"
    )


async def arun_workflow(
    workflow: str | type[Workflow],
    task: Any = None,
    llm: Any = None,
    *,
    branching: int = 4,
    max_turns: int = 4,
    seed: int = 0,
    alpha: float = 1.0,
    tie_break: str = "first",
    request_timeout_s: float | None = None,
    tokenizer: Any = None,
    task_uid: str = "task0",
) -> Episode:
    """Async :func:`run_workflow`, for use inside a running event loop (async tests)."""
    cls = get_workflow(workflow)
    if task is None:
        task = cls.example_task
        if task is None:
            raise ValueError(f"no task given and {cls.__qualname__}.example_task is None; pass a task")
    tokenizer = default_tokenizer() if tokenizer is None else tokenizer
    config = EpisodeConfig(
        branching=branching, max_turns=max_turns, alpha=alpha, tie_break=tie_break, request_timeout_s=request_timeout_s
    )
    client = _make_client(llm, seed, tokenizer)
    return await run_episode(cls, task, client=client, tokenizer=tokenizer, config=config, seed=seed, task_uid=task_uid)


def run_workflow(
    workflow: str | type[Workflow],
    task: Any = None,
    llm: Any = None,
    *,
    branching: int = 4,
    max_turns: int = 4,
    seed: int = 0,
    alpha: float = 1.0,
    tie_break: str = "first",
    request_timeout_s: float | None = None,
    tokenizer: Any = None,
    task_uid: str = "task0",
) -> Episode:
    """Run one episode in-process (no Ray, no verl trainer) and return its :class:`~verl_mas.Episode`.

    Args:
        workflow: Class, id, or ``"package.module:Class"``.
        task: The task; defaults to the class's ``example_task``.
        llm: ``"random"`` (default), a :class:`ScriptedLLM`, a script (dict or callable, wrapped in a
            ScriptedLLM), or any :class:`~verl_mas.client.LLMClient`.
        branching: K. max_turns: T. seed: episode seed. alpha: team-reward weight.
        tie_break: ``"first"`` or ``"random"``.
        request_timeout_s: Per-request timeout (an infrastructure failure when hit).
        tokenizer: Defaults to :func:`default_tokenizer`.
        task_uid: Task id used in group keys.

    Raises:
        RuntimeError: When called from a running event loop; ``await arun_workflow(...)`` there.
    """
    return run_sync(
        "run_workflow()",
        "await verl_mas.testing.arun_workflow(...)",
        arun_workflow(
            workflow,
            task,
            llm,
            branching=branching,
            max_turns=max_turns,
            seed=seed,
            alpha=alpha,
            tie_break=tie_break,
            request_timeout_s=request_timeout_s,
            tokenizer=tokenizer,
            task_uid=task_uid,
        )
    )
