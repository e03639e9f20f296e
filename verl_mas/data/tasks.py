"""The task dicts of the code and math workflows: their schemas, and the task sets written for this project.

Code task (``code-v0``, ``code-single-v0``)::

    {"id", "source", "question", "tests": [{"input", "output"}], "solution": str | None, "difficulty"}

Math task (``math-v0``, ``math-single-v0``)::

    {"id", "source", "problem", "answer"}

The workflows check their task with :func:`check_code_task` / :func:`check_math_task` at the start of an
episode. :func:`project_tasks` reads the 16-task sets shipped as package data (``verl_mas/data/*.jsonl``),
which the workflows' ``generate_task`` draws from; published datasets are read by :mod:`verl_mas.data.loaders`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

__all__ = ["check_code_task", "check_math_task", "project_tasks"]


# ---------------------------------------------------------------------------------------------------
# Task validation (the workflows call these at the start of an episode).


def check_code_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a code task and return it as a dict with ``solution`` defaulted to None.

    Raises:
        ValueError: Listing every problem (missing question, no golden tests, non-str test fields).
    """
    problems = []
    if not isinstance(task, Mapping):
        raise ValueError(f"code task is a {type(task).__name__}, not a dict; build tasks with verl_mas.data.loaders")
    if not isinstance(task.get("question"), str) or not task["question"].strip():
        problems.append("'question' must be a non-empty str (the problem statement)")
    tests = task.get("tests")
    if not isinstance(tests, list) or not tests:
        problems.append("'tests' must be a non-empty list of {'input': str, 'output': str} (the golden tests)")
    else:
        bad = [i for i, t in enumerate(tests) if not (isinstance(t, Mapping) and isinstance(t.get("input"), str)
                                                       and isinstance(t.get("output"), str))]
        if bad:
            problems.append(f"tests {bad[:5]} are not {{'input': str, 'output': str}}")
    if task.get("solution") is not None and not isinstance(task.get("solution"), str):
        problems.append("'solution' must be a str (the golden program) or null")
    if problems:
        raise ValueError(
            f"code task {task.get('id', '?')!r} is malformed: " + "; ".join(problems)
            + ". Load tasks with verl_mas.data.loaders.load_tasks, or follow the schema in the docstring of "
            "verl_mas.data.tasks."
        )
    return {**task, "solution": task.get("solution")}


def check_math_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a math task (``problem`` and ``answer`` non-empty str) and return it as a dict.

    Raises:
        ValueError: Listing every problem.
    """
    if not isinstance(task, Mapping):
        raise ValueError(f"math task is a {type(task).__name__}, not a dict; build tasks with verl_mas.data.loaders")
    problems = [f"{key!r} must be a non-empty str" for key in ("problem", "answer")
                if not isinstance(task.get(key), str) or not task[key].strip()]
    if problems:
        raise ValueError(
            f"math task {task.get('id', '?')!r} is malformed: " + "; ".join(problems)
            + ". Load tasks with verl_mas.data.loaders.load_tasks, or follow the schema in the docstring of "
            "verl_mas.data.tasks."
        )
    return dict(task)


def strip_math_delimiters(text: str) -> str:
    """A math answer without surrounding white space and ``$...$`` / ``$$...$$`` delimiters."""
    text = text.strip()
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


# ---------------------------------------------------------------------------------------------------
# The project-written task sets (package data).


@functools.lru_cache(maxsize=None)
def _project_tasks(kind: str) -> tuple[str, ...]:
    name = {"code": "code_tasks.jsonl", "math": "math_tasks.jsonl"}.get(kind)
    if name is None:
        raise ValueError(f"kind is {kind!r}; the project task sets are 'code' and 'math'")
    text = resources.files("verl_mas.data").joinpath(name).read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line.strip())


def project_tasks(kind: str) -> list[dict[str, Any]]:
    """The small task set written for this project (``verl_mas/data/<kind>_tasks.jsonl``).

    Args:
        kind: ``"code"`` (16 stdin/stdout problems with golden solutions and tests) or ``"math"``
            (16 short problems with answers).

    Returns:
        Fresh dicts (callers may mutate them).
    """
    return [json.loads(line) for line in _project_tasks(kind)]
