"""The user-facing ``Workflow`` base class: a multi-role task written as one ``async def run``.

A workflow instance lives for one episode. It prompts roles with :meth:`Workflow.generate` (K candidates
from one prompt), rewards every candidate, commits one with ``candidates.best()`` and continues from the
committed state. The engine (:func:`verl_mas.run_episode`) records every candidate as a training sample.

Example::

    @register_workflow("countdown-v0")
    class CountdownWorkflow(Workflow):
        roles = ("solver", "verifier")

        async def run(self, task):
            chat = [user(f"Reach {task['target']} using {task['nums']}.")]
            for turn in self.turns():
                proposals = await self.generate("solver", chat)
                for p in proposals:
                    p.reward = score(p.text, task)
                best = proposals.best()
                ...
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from verl_mas.engine import EpisodeRuntime
    from verl_mas.episode import Candidates
    from verl_mas.settings import EpisodeConfig

__all__ = ["Workflow", "validate_workflow_class"]

T = TypeVar("T")

#: Role names: an identifier-like word (they appear in group keys and metric names).
ROLE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")

_executor: ThreadPoolExecutor | None = None


def _blocking_executor() -> ThreadPoolExecutor:
    # A dedicated pool, larger than asyncio's default (min(32, cpus + 4)): blocking work in workflows is
    # mostly waiting on subprocesses, and a small pool would become the global cap we must not have.
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=max(64, 4 * (os.cpu_count() or 1)), thread_name_prefix="verl_mas")
    return _executor


class Workflow:
    """Base class of multi-role workflows. Subclass it, declare ``roles`` and implement :meth:`run`.

    The engine creates one instance per episode. Inside :meth:`run` (and ``__init__``) these are set:
    ``max_turns``, ``branching`` (K), ``rng`` (a ``random.Random`` seeded per episode: use it, never the
    global ``random``, so that the same seed gives the same episode), ``metrics`` (a dict of floats
    reported with the episode), ``turn`` (the current turn) and ``task_uid``.

    Turns: iterate ``for turn in self.turns():``. Each role may generate at most once per turn; roles
    acting in the same turn either act in sequence (a later role sees what earlier ones committed) or
    simultaneously (``asyncio.gather`` of their ``generate`` calls). Leaving the loop early (``break``,
    ``return`` or :meth:`terminate`) ends the episode as *terminated*; running out of turns marks it
    *truncated*.

    Class attributes:
        roles: The roles this workflow prompts, in acting order, e.g. ``("tool", "planner")``.
        workflow_id: Set by :func:`verl_mas.register_workflow`.
        example_task: Optional task used by ``python -m verl_mas.run`` and ``check_workflow`` defaults.

    Optional class hook: :meth:`generate_task` draws dataset tasks for ``python -m verl_mas.data``.
    """

    roles: ClassVar[tuple[str, ...]] = ()
    workflow_id: ClassVar[str | None] = None
    example_task: ClassVar[Any] = None

    _runtime: EpisodeRuntime | None = None

    async def run(self, task: Any) -> None:
        """Play one episode of ``task``: generate, reward every candidate, commit, continue."""
        raise NotImplementedError(f"{type(self).__name__} must implement `async def run(self, task)`")

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """Draw one task for a dataset; optional, used by ``python -m verl_mas.data``.

        Override it to let the data CLI write train/test parquet files for this workflow. Use only
        ``rng`` (seeded by the CLI) so datasets are reproducible. The CLI deduplicates tasks by their
        canonical JSON and keeps the test tasks out of the training set, so returning a task twice is fine.

        Args:
            rng: The random generator to draw with.
            split: ``"train"`` or ``"test"``, for workflows that draw the splits from different pools.

        Returns:
            A JSON-serialisable dict (str keys; str, int, float, bool, None, list and dict values), the
            payload later handed to :meth:`run`.
        """
        raise NotImplementedError(
            f"{cls.__qualname__} does not implement `generate_task`, so no dataset can be generated for it. "
            "Define `@classmethod def generate_task(cls, rng, split) -> dict` returning one JSON task."
        )

    # ----------------------------------------------------------------------------------------------
    # Engine-provided API.

    @property
    def _rt(self) -> EpisodeRuntime:
        if self._runtime is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to an episode. Workflows are created by the engine; "
                "run one with verl_mas.testing.run_workflow(...) or verl_mas.run_episode(...)."
            )
        return self._runtime

    @property
    def config(self) -> EpisodeConfig:
        """The episode configuration (branching, max_turns, alpha, tie_break, ...)."""
        return self._rt.config

    @property
    def max_turns(self) -> int:
        """T: the most turns this episode may use."""
        return self._rt.config.max_turns

    @property
    def branching(self) -> int:
        """K: candidates sampled per (role, turn) from one prompt."""
        return self._rt.config.branching

    @property
    def rng(self) -> random.Random:
        """A random generator seeded per episode; the only randomness a workflow should use."""
        return self._rt.rng

    @property
    def metrics(self) -> dict[str, float]:
        """Episode metrics (floats) reported with the episode; names like ``mas/<role>/...``."""
        return self._rt.metrics

    @property
    def turn(self) -> int:
        """The current 0-based turn (advanced by :meth:`turns`)."""
        return self._rt.turn

    @property
    def task_uid(self) -> str:
        """The stable id of this episode's task (the first part of every group key)."""
        return self._rt.task_uid

    def turns(self) -> Iterator[int]:
        """Iterate over the turns ``0 .. max_turns - 1``, setting :attr:`turn`.

        Stops early after :meth:`terminate`. Running to the end marks the episode truncated.
        """
        rt = self._rt
        for t in range(rt.config.max_turns):
            if rt.terminated:
                return
            rt.turn = t
            yield t
        if not rt.terminated:
            rt.ran_out_of_turns = True

    def terminate(self) -> None:
        """Mark the episode as terminated (the task reached a terminal state); :meth:`turns` stops."""
        self._rt.terminated = True

    async def generate(self, role: str, messages: Sequence[Mapping[str, Any]]) -> Candidates:
        """Sample K candidates for ``role`` from one prompt rendered from ``messages``.

        The prompt is rendered with the tokenizer's chat template; messages from
        ``candidate.as_message()`` contribute their sampled token ids unchanged. The K requests are in
        flight concurrently.

        Args:
            role: One of :attr:`roles`; it selects the policy serving the request.
            messages: The chat for this role (its system prompt included: it belongs to the workflow).

        Returns:
            The group of candidates. Iterating it yields the candidates the model produced; set a
            reward on each, then call ``best()`` to commit one.

        Raises:
            WorkflowError: For an undeclared role, or a role generating twice in one turn.
            InfraError: When every candidate of the group was lost to infrastructure failures (the
                engine then ends the episode as aborted; earlier complete groups stay trainable).
        """
        return await self._rt.generate(role, messages)

    async def run_blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run blocking or CPU-heavy ``fn(*args, **kwargs)`` in a worker thread, off the event loop.

        Use it for running code, solvers and anything slow: the event loop serves every concurrent
        episode, so blocking it stalls all of them.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_blocking_executor(), functools.partial(fn, *args, **kwargs))


def validate_workflow_class(cls: object) -> list[str]:
    """Problems that make ``cls`` unusable as a workflow (empty when it is valid)."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        return [f"{name} is not a subclass of verl_mas.Workflow"]
    problems: list[str] = []
    roles = cls.roles
    if not isinstance(roles, tuple) or not roles:
        problems.append(
            f"{name}.roles is {roles!r}; declare a non-empty tuple of role names, e.g. roles = ('tool', 'planner')"
        )
    else:
        bad = [r for r in roles if not isinstance(r, str) or not ROLE_RE.match(r)]
        if bad:
            problems.append(f"{name}.roles has invalid names {bad!r}; role names match {ROLE_RE.pattern}")
        dupes = sorted({r for r in roles if roles.count(r) > 1}, key=str)
        if dupes:
            problems.append(f"{name}.roles lists {dupes!r} more than once")
    if cls.run is Workflow.run:
        problems.append(f"{name} does not implement `async def run(self, task)`")
    elif not inspect.iscoroutinefunction(cls.run):
        problems.append(f"{name}.run is not a coroutine function; declare it `async def run(self, task)`")
    return problems
