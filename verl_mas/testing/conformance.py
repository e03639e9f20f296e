"""``check_workflow``: the conformance checker users run in their CI, as Gymnasium's ``check_env``.

It plays a workflow against a random-text LLM and checks the workflow contract: declared roles used
consistently, every candidate rewarded with a finite float, one prompt per group, termination within
``max_turns``, reproducibility from the seed, chats continued with sampled token ids, and prompt and reply
words that survive the tokenizer (:mod:`verl_mas.testing.roundtrip`). Import it from :mod:`verl_mas.testing`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from verl_mas.episode import Episode
from verl_mas.errors import LLMClientError, WorkflowError
from verl_mas.registry import get_workflow, workflow_name
from verl_mas.testing.llms import RandomLLM, default_tokenizer
from verl_mas.testing.roundtrip import lost_text_problems
from verl_mas.testing.runner import arun_workflow, run_sync
from verl_mas.workflow import Workflow, validate_workflow_class

__all__ = ["WorkflowCheckError", "acheck_workflow", "check_workflow"]


class WorkflowCheckError(AssertionError):
    """A workflow broke the workflow contract; the message lists every problem found."""


def _signature(ep: Episode) -> list[Any]:
    rows: list[Any] = [
        (
            g.key,
            g.prompt_ids,
            [
                (
                    c.index,
                    c.response_ids,
                    c.reward,
                    c.team_reward,
                    c.local_reward,
                    c.committed,
                    c.trainable,
                    c.parse_failed,
                )
                for c in g.all
            ],
        )
        for g in ep.groups
    ]
    rows.append(("outcome", ep.terminated, ep.truncated, ep.aborted, sorted(ep.metrics.items())))
    return rows


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for x, y in zip(a, b, strict=False):
        if x != y:
            return f"first difference at {x[0]!r}"
    return f"{len(a)} vs {len(b)} groups"


def _contains(haystack: list[int], needle: list[int]) -> bool:
    m = len(needle)
    return any(haystack[i : i + m] == needle for i in range(len(haystack) - m + 1))


def _token_drift(ep: Episode, tokenizer: Any) -> list[str]:
    """Committed answers that reappear as text, but not as their sampled ids, in the same role's later prompts.

    Only answers whose text was new (absent from their own prompt) are checked, so an answer that merely
    repeats a word of the prompt is not mistaken for a re-encoded one.
    """
    special = set(tokenizer.all_special_ids)
    problems = []
    for c in ep.committed_branch:
        ids = list(c.response_ids)
        while ids and ids[-1] in special:
            ids.pop()
        text = c.text.strip()
        if len(ids) < 2 or len(text) < 2:
            continue
        own_prompt = tokenizer.decode(c.prompt_ids, skip_special_tokens=False)
        if text in own_prompt:  # the answer quotes its prompt; seeing it again later proves nothing
            continue
        for g in ep.groups:
            if g.role != c.role or g.turn <= c.turn or _contains(g.prompt_ids, ids):
                continue
            if text in tokenizer.decode(g.prompt_ids, skip_special_tokens=False):
                problems.append(
                    f"the committed answer of {c.group_key!r} ({text!r:.40}) reappears in the prompt of {g.key!r} as "
                    "text but its sampled token ids do not: it was decoded and re-encoded, so the model is trained on "
                    "tokens it did not condition on. Continue chats with candidate.as_message() (pass "
                    "check_token_drift=False if quoting the answer as text is intended)."
                )
                break
    return problems


def _once_each(found: dict[str, list[str]], runs: int) -> list[str]:
    """``{problem: labels of the runs it occurred in}`` as one line per problem, naming its runs."""
    return [
        f"{labels[0]}: {problem}" if len(labels) == 1
        else f"{len(labels)} of {runs} runs ({'; '.join(labels)}): {problem}"
        for problem, labels in found.items()
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


async def acheck_workflow(
    workflow: str | type[Workflow],
    task: Any = None,
    *,
    branching: int = 4,
    max_turns: int = 4,
    seeds: Sequence[int] = (0, 1, 2),
    tokenizer: Any = None,
    require_all_roles: bool = True,
    check_token_drift: bool = True,
    timeout_s: float = 60.0,
    replies: Mapping[str, Sequence[str] | str] | None = None,
) -> Episode:
    """Async :func:`check_workflow`."""
    name = getattr(workflow, "__qualname__", workflow)
    try:
        cls = get_workflow(workflow)
    except (LookupError, TypeError, ImportError) as e:
        raise WorkflowCheckError(f"{name}: {e}") from e
    problems = validate_workflow_class(cls)
    if problems:
        raise WorkflowCheckError(f"{name} failed check_workflow: " + "; ".join(problems))
    name = workflow_name(cls)
    if task is None and cls.example_task is None:
        raise WorkflowCheckError(f"{name}: pass a task (the class has no example_task)")
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    tokenizer = default_tokenizer() if tokenizer is None else tokenizer
    runs = [(s, branching) for s in seeds] + [(seeds[0], branching), (seeds[0], 1)]  # rerun: determinism; K=1
    results: list[Episode | None] = []
    # A broken workflow usually breaks the same way on every run: each problem is listed once, with its runs.
    found: dict[str, list[str]] = {}
    for i, (seed, k) in enumerate(runs):
        label = f"seed {seed}, K={k}" + (" again" if i == len(seeds) else "")
        try:
            ep = await asyncio.wait_for(
                arun_workflow(
                    cls,
                    task,
                    RandomLLM(seed, tokenizer=tokenizer),
                    branching=k,
                    max_turns=max_turns,
                    seed=seed,
                    tokenizer=tokenizer,
                ),
                timeout_s,
            )
        except (WorkflowError, LLMClientError) as e:
            found.setdefault(f"{type(e).__name__}: {e}", []).append(label)
            results.append(None)
            continue
        except asyncio.TimeoutError:
            timed_out = (
                f"the episode did not finish within {timeout_s} s (does run() wait on something "
                "that never happens, or loop without generating?)"
            )
            found.setdefault(timed_out, []).append(label)
            results.append(None)
            continue
        results.append(ep)
        run_problems = list(ep.validate())
        if ep.aborted:
            run_problems.append(f"aborted by an infrastructure failure with a fault-free LLM: {ep.error}")
        if check_token_drift:
            run_problems += _token_drift(ep, tokenizer)
        for p in dict.fromkeys(run_problems):
            found.setdefault(p, []).append(label)
    problems += _once_each(found, len(runs))
    first, rerun = results[0], results[len(seeds)]
    episodes = [ep for ep in results if ep is not None]
    if first is not None and rerun is not None and _signature(first) != _signature(rerun):
        where = _first_difference(_signature(first), _signature(rerun))
        problems.append(
            f"seed {seeds[0]}: the same seed gave two different episodes ({where}). "
            "Use self.rng for randomness (not the global random module) and keep no state across episodes on the class."
        )
    used = {g.role for ep in episodes for g in ep.groups}
    unused = [r for r in cls.roles if r not in used]
    if require_all_roles and episodes and unused:
        problems.append(
            f"roles {unused} are declared but never generated in {len(episodes)} episodes; remove them from "
            "`roles` or pass a task where they act (require_all_roles=False to allow it)"
        )
    problems += lost_text_problems(cls, tokenizer, episodes, replies)
    if problems:
        raise WorkflowCheckError(
            f"{name} failed check_workflow ({_count(len(problems), 'problem')}):\n - " + "\n - ".join(problems)
        )
    assert first is not None
    return first


def check_workflow(
    workflow: str | type[Workflow],
    task: Any = None,
    *,
    branching: int = 4,
    max_turns: int = 4,
    seeds: Sequence[int] = (0, 1, 2),
    tokenizer: Any = None,
    require_all_roles: bool = True,
    check_token_drift: bool = True,
    timeout_s: float = 60.0,
    replies: Mapping[str, Sequence[str] | str] | None = None,
) -> Episode:
    """Check that a workflow keeps the workflow contract; run it in your CI, like Gymnasium's ``check_env``.

    Plays episodes against :class:`RandomLLM` (random text) for each of ``seeds``, once more with the
    first seed, and once with ``branching=1``, then checks: the class declares valid roles and an
    ``async def run``; every candidate gets a finite float reward; only declared roles generate, each at
    most once per turn, and every declared role acts (``require_all_roles``); every group has K
    members sharing identical prompt token ids and the right group key; at most one commit per group;
    the episode ends within ``max_turns``, terminated or truncated; metrics are finite floats; the same
    seed gives the same episode; committed answers continue chats as their sampled ids
    (``check_token_drift``); every word of the prompts, of the class's ``vocabulary`` and of the replies
    each role is expected to give (``replies``, default the class's ``example_replies``) survives
    ``tokenizer``'s encode/decode round trip (a tailored tokenizer silently drops characters its vocabulary
    lacks). A problem found on several runs is listed once, naming the runs.

    Args:
        workflow: Class, id, or ``"package.module:Class"``.
        task: The task to play; default the class's ``example_task``.
        branching, max_turns: K and T of the episodes.
        seeds: One episode per seed (the first is played twice, and once more with K=1).
        tokenizer: The tokenizer your model uses (default :func:`default_tokenizer`, which encodes any text).
        require_all_roles: Every declared role must generate at least once.
        check_token_drift: Check that chats are continued with sampled ids, not re-encoded text.
        timeout_s: The most one episode may take.
        replies: ``{role: (reply, ...)}``: what each role is expected to say (e.g. the replies your tests
            script); each word must survive the tokenizer. Default: the class's ``example_replies``.

    Returns:
        The episode of the first seed (for further assertions).

    Raises:
        WorkflowCheckError: Listing every problem found.
    """
    return run_sync(
        "check_workflow()",
        "await verl_mas.testing.acheck_workflow(...)",
        acheck_workflow(
            workflow,
            task,
            branching=branching,
            max_turns=max_turns,
            seeds=seeds,
            tokenizer=tokenizer,
            require_all_roles=require_all_roles,
            check_token_drift=check_token_drift,
            timeout_s=timeout_s,
            replies=replies,
        )
    )
