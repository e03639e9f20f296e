"""The test doubles: :class:`ScriptedLLM` (replies from a script), :class:`RandomLLM` (random text) and the tokenizer.

Both are :class:`~verl_mas.client.LLMClient` implementations that encode their replies with a real
tokenizer (the project's tiny ChatML tokenizer, :func:`default_tokenizer`, unless told otherwise) and
record every request, so a test can assert on what a workflow asked for.
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

