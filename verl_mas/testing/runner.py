"""``run_workflow``: one episode in-process against a test double or any LLM client (no Ray, no verl trainer).

Also :func:`run_sync`, which the synchronous twins of the async helpers here and in
:mod:`verl_mas.testing.conformance` share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from verl_mas.engine import run_episode
from verl_mas.episode import Episode
from verl_mas.settings import EpisodeConfig
from verl_mas.registry import get_workflow
from verl_mas.testing.llms import RandomLLM, ScriptedLLM, default_tokenizer
from verl_mas.workflow import Workflow

T = TypeVar("T")


def run_sync(what: str, instead: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code (the sync twins of the async test helpers).

    Raises:
        RuntimeError: When called from a running event loop, where ``instead`` must be awaited.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()  # never started: close it so Python does not warn that it was never awaited
    raise RuntimeError(f"{what} cannot run inside a running event loop (e.g. an async test); use `{instead}` there.")


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
