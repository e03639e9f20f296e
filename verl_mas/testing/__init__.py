"""Test doubles for workflows: scripted and random LLMs, ``run_workflow`` and the ``check_workflow`` checker.

Everything here runs in-process on CPU with a real tokenizer (the project's tiny ChatML tokenizer by
default): no GPU, model, Ray or verl trainer. Typical use in a workflow's own tests::

    from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow

    episode = run_workflow(MyWorkflow, TASK, llm=ScriptedLLM({"solver": ["(3+5)*2"]}), branching=4)
    check_workflow(MyWorkflow, TASK)   # roles, rewards, one prompt per group, termination, seeds

Import from this package; its modules are layered, each importing only the ones before it:
:mod:`~verl_mas.testing.llms` (the test doubles and the default tokenizer), :mod:`~verl_mas.testing.runner`
(``run_workflow``), :mod:`~verl_mas.testing.roundtrip` (prompt and reply words a tokenizer does not give
back; ``python -m verl_mas.tiny --vocab-from`` runs it too) and :mod:`~verl_mas.testing.conformance`
(``check_workflow``, which plays episodes with the runner against :class:`RandomLLM`).
"""

from __future__ import annotations

from verl_mas.testing.conformance import WorkflowCheckError, acheck_workflow, check_workflow
from verl_mas.testing.llms import RandomLLM, ScriptedLLM, default_tokenizer
from verl_mas.testing.roundtrip import atokenizer_problems, tokenizer_problems
from verl_mas.testing.runner import arun_workflow, run_workflow

__all__ = [
    "RandomLLM",
    "ScriptedLLM",
    "WorkflowCheckError",
    "acheck_workflow",
    "arun_workflow",
    "atokenizer_problems",
    "check_workflow",
    "default_tokenizer",
    "run_workflow",
    "tokenizer_problems",
]
