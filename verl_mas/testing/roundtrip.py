"""The tokenizer round trip: words of a workflow's prompts and replies that a tokenizer does not give back.

A tailored tokenizer (``python -m verl_mas.tiny --vocab-from WORKFLOW``, built from the workflow's
``vocabulary``) encodes only the characters its words use and drops every other one without a sound:
with ``"nothing"`` missing from relay-v0's vocabulary, the prompt ``"runner nothing"`` reaches the model as
``"runner noting"``, and a role whose right answer is ``"wrong"`` can never say it. Here that is a
reported problem naming the word: :func:`lost_text_problems` checks the prompts of played episodes, the
workflow's ``vocabulary`` and the replies each role is expected to give (``example_replies``);
:func:`tokenizer_problems` plays the episodes first (``python -m verl_mas.tiny`` runs it before writing a
model). ``check_workflow(..., tokenizer=tok)`` runs the same check on its own episodes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from verl_mas.episode import Episode
from verl_mas.errors import LLMClientError, WorkflowError
from verl_mas.registry import get_workflow, workflow_name
from verl_mas.testing.llms import RandomLLM
from verl_mas.testing.runner import arun_workflow, run_sync
from verl_mas.workflow import Workflow

__all__ = [
    "atokenizer_problems",
    "lost_text_problems",
    "lost_words",
    "roundtrip",
    "tokenizer_problems",
]

#: Tasks ``tokenizer_problems`` draws with ``generate_task`` from each split, besides ``example_task``.
DRAWN_TASKS_PER_SPLIT = 2


def roundtrip(tokenizer: Any, text: str) -> str:
    """``decode(encode(text))``: what a model reading or writing ``text`` through ``tokenizer`` sees."""
    # No clean-up of spaces: it is decode's cosmetic, not what the model reads (some tokenizers default to it).
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def lost_words(tokenizer: Any, text: str) -> list[tuple[str, str]]:
    """``(word, what it becomes)`` for each distinct word of ``text`` that does not survive the round trip.

    Words are split on whitespace. When every word survives but the text does not (whitespace the
    tokenizer cannot encode, such as a tab for a tailored tokenizer), the whole text is the one entry.
    Empty when ``text`` survives.
    """
    back = roundtrip(tokenizer, text)
    if back == text:
        return []
    lost = [(word, roundtrip(tokenizer, word)) for word in dict.fromkeys(text.split())]
    return [(word, b) for word, b in lost if b != word] or [(text, back)]


def _vocab_from_spec(cls: type[Workflow]) -> str:
    """What ``python -m verl_mas.tiny --vocab-from`` takes for ``cls``: its id, else ``module:Class``."""
    return cls.__dict__.get("workflow_id") or f"{cls.__module__}:{cls.__qualname__}"


def _declared(
    cls: type[Workflow], replies: Mapping[str, Any] | None
) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """``(problems, vocabulary, replies per role)`` as the class declares them (``replies`` overrides its own)."""
    name = workflow_name(cls)
    problems: list[str] = []
    vocabulary = getattr(cls, "vocabulary", None)
    if vocabulary is None:
        words: list[str] = []
    elif isinstance(vocabulary, str) or not all(isinstance(w, str) for w in vocabulary):
        problems.append(
            f"{name}.vocabulary is {vocabulary!r:.80}; it must be a tuple of words (str), e.g. ('red', 'blue', "
            "'caller'), the words every prompt and reply uses."
        )
        words = []
    else:
        words = list(vocabulary)
    if replies is None:
        replies = getattr(cls, "example_replies", None)
    per_role: dict[str, list[str]] = {}
    if replies is not None:
        if not isinstance(replies, Mapping):
            problems.append(
                f"the example replies of {name} are {replies!r:.80}; give a dict role -> replies, e.g. "
                "{'critic': ('right', 'wrong')}."
            )
            replies = {}
        for role, said in replies.items():
            said = [said] if isinstance(said, str) else said
            if role not in cls.roles:
                problems.append(
                    f"the example replies name role {role!r}, which {name} does not declare; its roles are "
                    f"{list(cls.roles)}. Fix the role name."
                )
            elif not isinstance(said, Sequence) or not all(isinstance(s, str) for s in said):
                problems.append(f"the example replies of role {role!r} are {said!r:.80}; give a str or a tuple of str.")
            else:
                per_role[role] = list(said)
    return problems, words, per_role


def _prompt_texts(episodes: Iterable[Episode]) -> dict[str, list[str]]:
    """``{role: distinct texts of its prompts' messages}``, skipping messages carrying sampled ids (spliced in)."""
    texts: dict[str, dict[str, None]] = {}
    for ep in episodes:
        for g in ep.groups:
            for message in g.messages:
                content = message.get("content")
                if "token_ids" not in message and isinstance(content, str):
                    texts.setdefault(g.role, {})[content] = None
    return {role: list(found) for role, found in texts.items()}


def lost_text_problems(
    workflow: type[Workflow], tokenizer: Any, episodes: Iterable[Episode], replies: Mapping[str, Any] | None = None
) -> list[str]:
    """One problem per word that does not survive ``tokenizer``'s encode/decode round trip, naming where it occurs.

    Checked: every text message of the episodes' prompts (assistant messages built with
    ``candidate.as_message()`` are spliced in as their sampled ids and are skipped), every word of the
    workflow's ``vocabulary`` and every reply each role is expected to give: ``replies``, default the
    class's ``example_replies`` (``{role: (reply, ...)}``).

    A prompt word that holds a sampled reply's own lost word is not held against the workflow: random
    ids can decode to text that no encoding gives back (a lone byte of a two-byte character decodes to
    U+FFFD), and a workflow quoting such a reply is not at fault.
    """
    cls = workflow
    name = workflow_name(cls)
    problems, vocabulary, per_role = _declared(cls, replies)
    episodes = list(episodes)
    from_replies = {w for ep in episodes for g in ep.groups for c in g.all for w, _ in lost_words(tokenizer, c.text)}
    # word -> (what it becomes, {place: an example text}), in the order first seen.
    lost: dict[str, tuple[str, dict[str, str]]] = {}

    def check(place: str, text: str, *, quoted_replies: set[str] | None = None) -> None:
        for word, back in lost_words(tokenizer, text):
            if not quoted_replies or not any(r in word or word in r for r in quoted_replies):
                lost.setdefault(word, (back, {}))[1].setdefault(place, text)

    for role, texts in _prompt_texts(episodes).items():
        for text in texts:
            check(f"the prompts of role {role!r}", text, quoted_replies=from_replies)
    for role, said in per_role.items():
        for text in said:
            check(f"the example replies of role {role!r}", text)
    for word in vocabulary:
        check(f"{cls.__qualname__}.vocabulary", word)

    spec = _vocab_from_spec(cls)
    rebuild = f"`python -m verl_mas.tiny --out DIR --vocab-from {spec}`"
    for word, (back, places) in lost.items():
        where = " and in ".join(p if text == word else f"{p} (e.g. {text!r:.60})" for p, text in places.items())
        if any(c.isspace() for c in word):  # every word survived, the whitespace between them did not
            fix = (
                "use only spaces and newlines between words (a tailored tokenizer encodes no other whitespace), or "
                "a tokenizer that encodes this text"
            )
        elif word in vocabulary:
            fix = (
                f"{word!r} is in {cls.__qualname__}.vocabulary, so this tokenizer was not built from it: rebuild "
                f"the tokenizer with {rebuild}"
            )
        elif getattr(cls, "vocabulary", None) is not None:
            fix = (
                f"add {word!r} to {cls.__qualname__}.vocabulary and rebuild the tokenizer with {rebuild} (a tailored "
                "tokenizer encodes only the characters of its vocabulary's words), or change the text"
            )
        else:
            fix = (
                f"use a tokenizer that encodes this text ({name} declares no vocabulary; verl_mas.tiny's default "
                f"byte-level tokenizer encodes any text), or declare {cls.__qualname__}.vocabulary with every word of "
                f"its prompts and replies and build the tokenizer from it with {rebuild}"
            )
        problems.append(
            f"{word!r} becomes {back!r} through the tokenizer (decode(encode(text)) != text), so the model can "
            f"neither read nor say it; it occurs in {where}. Fix: {fix}."
        )
    return problems


def _drawn_tasks(cls: type[Workflow]) -> list[Any]:
    """``example_task`` and a few tasks of each split drawn with ``generate_task`` (when implemented), distinct."""
    tasks = [] if cls.example_task is None else [cls.example_task]
    if getattr(cls.generate_task, "__func__", None) is not getattr(Workflow.generate_task, "__func__", None):
        rng = random.Random(0)
        tasks += [cls.generate_task(rng, split) for split in ("train", "test") for _ in range(DRAWN_TASKS_PER_SPLIT)]
    distinct: list[Any] = []
    for task in tasks:
        if task not in distinct:
            distinct.append(task)
    return distinct


async def atokenizer_problems(
    workflow: str | type[Workflow],
    tokenizer: Any,
    tasks: Sequence[Any] | None = None,
    *,
    replies: Mapping[str, Any] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    branching: int = 4,
    max_turns: int = 4,
    timeout_s: float = 60.0,
) -> list[str]:
    """Async :func:`tokenizer_problems`."""
    cls = get_workflow(workflow)
    tasks = _drawn_tasks(cls) if tasks is None else list(tasks)
    problems: list[str] = []
    if not tasks:
        problems.append(
            f"{workflow_name(cls)} has no example_task and no generate_task, so no episode shows its prompts; set "
            "example_task (or pass tasks) to have them checked."
        )
    episodes: list[Episode] = []
    for i, task in enumerate(tasks):
        for seed in seeds:
            label = f"task {i} ({task!r:.60}), seed {seed}"
            try:
                episodes.append(
                    await asyncio.wait_for(
                        arun_workflow(cls, task, RandomLLM(seed, tokenizer=tokenizer), branching=branching,
                                      max_turns=max_turns, seed=seed, tokenizer=tokenizer),
                        timeout_s,
                    )
                )
            except (WorkflowError, LLMClientError) as e:  # reported: the check cannot vouch for unplayed prompts
                problems.append(f"{label}: the episode could not be played, so its prompts went unchecked: "
                                f"{type(e).__name__}: {e}")
            except asyncio.TimeoutError:
                problems.append(f"{label}: the episode did not finish within {timeout_s} s, so its prompts went "
                                "unchecked (check_workflow on the workflow says more)")
    return problems + lost_text_problems(cls, tokenizer, episodes, replies)


def tokenizer_problems(
    workflow: str | type[Workflow],
    tokenizer: Any,
    tasks: Sequence[Any] | None = None,
    *,
    replies: Mapping[str, Any] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    branching: int = 4,
    max_turns: int = 4,
    timeout_s: float = 60.0,
) -> list[str]:
    """Play ``workflow`` against :class:`RandomLLM` with ``tokenizer`` and list the words the tokenizer loses.

    Args:
        workflow: Class, id, or ``"package.module:Class"``.
        tokenizer: The tokenizer to check (e.g. a tailored one from ``verl_mas.tiny.build_tokenizer``).
        tasks: Tasks to play; default the class's ``example_task`` and :data:`DRAWN_TASKS_PER_SPLIT` tasks
            of each split drawn with ``generate_task`` (when the class implements it).
        replies: ``{role: (reply, ...)}`` each role is expected to give; default the class's ``example_replies``.
        seeds, branching, max_turns, timeout_s: As :func:`verl_mas.testing.check_workflow`.

    Returns:
        Problems as :func:`lost_text_problems` words them, plus the episodes that could not be played; empty
        when every prompt, vocabulary word and expected reply survives the tokenizer.

    Raises:
        RuntimeError: When called from a running event loop; ``await atokenizer_problems(...)`` there.
    """
    return run_sync(
        "tokenizer_problems()",
        "await verl_mas.testing.atokenizer_problems(...)",
        atokenizer_problems(workflow, tokenizer, tasks, replies=replies, seeds=seeds, branching=branching,
                            max_turns=max_turns, timeout_s=timeout_s),
    )
