"""The token-level LLM client protocol the episode engine calls, and its request/sample types.

The engine is backend-agnostic: it renders a prompt to token ids, asks a client for ``n`` samples of
that one prompt, and records the sampled ids and log-probs exactly as returned (token in, token out).
Implementations: the verl agent loop (against verl's ``server_manager.generate``), and the test doubles
:class:`verl_mas.testing.ScriptedLLM` and :class:`verl_mas.testing.RandomLLM`.

Failure contract:

- An infrastructure failure of the whole request: raise :class:`~verl_mas.errors.InfraError` (or
  ``TimeoutError`` / ``ConnectionError``). Every candidate of the group is then marked not trainable.
- An infrastructure failure of some samples only (a client that fans out ``n`` single requests): return
  a :class:`Sample` with ``error`` set in their place, e.g. through :func:`fan_out`.
- Anything else raised is a bug and stops the episode.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from verl_mas.errors import INFRA_EXCEPTIONS

__all__ = ["GenerateRequest", "LLMClient", "Sample", "fan_out", "start_now"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request for ``n`` samples of one prompt: one AT-GRPO group.

    Attributes:
        role: The role that acts; clients route it to the policy (model) that serves the role.
        prompt_ids: The rendered prompt, exactly as it must be sent to the model.
        n: Number of samples wanted (the branching factor K). All share ``prompt_ids``.
        group_key: The group identity ``(task uid, role, turn)`` built by :func:`verl_mas.group_key`.
        session_id: Stable for one (episode, role): a sticky-session key for prefix-cache affinity
            (verl's ``request_id``). Not unique per request.
        seed: A per-group seed derived from the episode seed and ``group_key``. Test doubles use it for
            reproducible text; real servers should ignore it (the K samples must differ).
        messages: The chat the prompt was rendered from. Test doubles and logging read it; real
            backends must use ``prompt_ids`` only.
    """

    role: str
    prompt_ids: list[int]
    n: int
    group_key: str
    session_id: str
    seed: int
    messages: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled response, token level.

    Attributes:
        token_ids: The sampled ids, exactly as the model produced them (including a final EOS if the
            server returns it). The engine never re-tokenizes them.
        logprobs: Rollout log-probs of ``token_ids`` (same length), or None if the server has none.
        stop_reason: The server's stop reason (verl: ``"completed"``, ``"aborted"``, or None).
        error: Set (to a description) when this sample was lost to an infrastructure failure; the
            candidate is then kept as not trainable. ``token_ids`` should be empty in that case.
        extra: Backend fields to carry into the training record (e.g. verl's ``global_steps``).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    stop_reason: str | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, error: str) -> Sample:
        """A placeholder for a sample lost to an infrastructure failure."""
        return cls(token_ids=[], logprobs=None, stop_reason="error", error=error)


@runtime_checkable
class LLMClient(Protocol):
    """What the episode engine needs from a model server: ``n`` token-level samples of one prompt."""

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        """Sample ``request.n`` responses to ``request.prompt_ids`` from the policy serving ``request.role``.

        Returns:
            Exactly ``request.n`` samples, in any order. Samples lost to infrastructure failures are
            returned with ``error`` set (see :func:`fan_out`).

        Raises:
            InfraError: (or ``TimeoutError`` / ``ConnectionError``) when the whole request failed.
        """
        ...


class _Started:
    """A coroutine already run to its first suspension; awaiting this continues it (``yield from`` by hand).

    The fallback for :func:`start_now` before Python 3.12's ``asyncio.eager_task_factory``.
    """

    __slots__ = ("_coro", "_pending", "_outcome")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._pending: Any = None
        self._outcome: tuple[bool, Any] | None = None
        try:
            self._pending = coro.send(None)  # runs synchronously until the first real suspension
        except StopIteration as stop:
            self._outcome = (True, stop.value)
        except (Exception, asyncio.CancelledError) as exc:  # delivered when awaited, as a task would
            self._outcome = (False, exc)

    def __await__(self) -> Generator[Any, Any, Any]:
        if self._outcome is not None:
            ok, value = self._outcome
            if ok:
                return value
            raise value
        coro, pending = self._coro, self._pending
        while True:
            try:
                sent = yield pending  # the future the coroutine waits on goes up to the task
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation and other throws go down to the coroutine
                try:
                    pending = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as stop:
                    return stop.value

    async def result(self) -> Any:
        return await self


def start_now(coro: Awaitable[T]) -> asyncio.Future[T]:
    """Start ``coro`` as a task that runs *now*, up to its first suspension (an eager task).

    ``asyncio.gather(*coros)`` only starts its tasks on the next turn of the event loop, after every
    other ready callback: when many episodes wake up together, every request they issue would be
    dispatched only after all of them have done their CPU work, and the episodes would stay in lockstep.
    Starting requests eagerly dispatches each one as soon as its episode is ready.
    """
    if not inspect.iscoroutine(coro):  # a future or other awaitable: already running, or cannot be stepped
        return asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    eager = getattr(asyncio, "eager_task_factory", None)  # Python >= 3.12
    if eager is not None:
        return eager(loop, coro)
    return loop.create_task(_Started(coro).result())


async def fan_out(n: int, generate_one: Callable[[int], Awaitable[Sample]]) -> list[Sample]:
    """Run ``n`` single-sample requests concurrently; infrastructure failures become failed samples.

    For backends without ``n > 1`` (verl's server manager): ``generate_one(i)`` issues one request.
    Every request is in flight at once (no cap) and is dispatched immediately (:func:`start_now`).
    Exceptions in
    :data:`~verl_mas.errors.INFRA_EXCEPTIONS` turn into :meth:`Sample.failed`; any other exception is
    re-raised after all requests have finished.

    Args:
        n: Number of samples.
        generate_one: Coroutine function producing sample ``i``.

    Returns:
        ``n`` samples, in order of ``i``.
    """
    results = await asyncio.gather(*(start_now(generate_one(i)) for i in range(n)), return_exceptions=True)
    samples: list[Sample] = []
    for result in results:
        if isinstance(result, INFRA_EXCEPTIONS):
            samples.append(Sample.failed(f"{type(result).__name__}: {result}"))
        elif isinstance(result, BaseException):
            raise result
        else:
            samples.append(result)
    return samples


def _all_finite(values: list[float]) -> bool:
    try:
        return math.isfinite(sum(values))  # any nan/inf makes the sum non-finite
    except TypeError:
        return False


def validate_samples(samples: object, request: GenerateRequest, client: object) -> list[str]:
    """Problems with what a client returned for ``request`` (empty when the contract holds)."""
    name = type(client).__name__
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        return [f"{name}.generate returned {type(samples).__name__}, not a list of verl_mas.Sample"]
    problems: list[str] = []
    if len(samples) != request.n:
        problems.append(f"{name}.generate returned {len(samples)} samples for n={request.n}")
    for i, s in enumerate(samples):
        if s.error is not None:
            continue
        # C-speed checks: this runs for every sample of every group.
        if not isinstance(s.token_ids, list) or not set(map(type, s.token_ids)) <= {int}:
            problems.append(f"sample {i}: token_ids must be a list of int, got {s.token_ids!r:.80}")
        elif s.logprobs is not None and (len(s.logprobs) != len(s.token_ids) or not _all_finite(s.logprobs)):
            problems.append(
                f"sample {i}: {len(s.logprobs)} log-probs for {len(s.token_ids)} tokens "
                "(need one finite log-prob per sampled token, or None)"
            )
    return problems
