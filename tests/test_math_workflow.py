"""math-v0 / math-single-v0: answer extraction and checking, every reward term, scripted episodes, conformance, data."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from verl_mas.data.tasks import check_math_task, project_tasks
from verl_mas.registry import get_workflow
from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow
from verl_mas.workflows.math_tool import (
    MAX_ANSWER_CHARS,
    MathSingleWorkflow,
    MathWorkflow,
    answers_match,
    extract_boxed,
    printed_answer,
)

TASK = {"id": "half", "source": "test", "problem": "Compute 1/3 + 1/6.", "answer": "\\frac{1}{2}"}


def program(code: str) -> str:
    return f"Let me compute it.\n```python\n{code}```"


TOOL_RIGHT = program("from fractions import Fraction\nprint(Fraction(1, 3) + Fraction(1, 6))\n")  # prints 1/2
TOOL_CRASH = program("print(1 / 0)\n")  # builds, ZeroDivisionError
TOOL_BROKEN = program("print(1 / 2\n")  # does not build
TOOL_WRONG = program("print(3)\n")


def test_extract_boxed() -> None:
    assert extract_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{ {2} + 3 }") == "{2} + 3"  # the last box, nested braces
    # Negative controls: no box, an empty box, an unclosed box.
    assert extract_boxed("the answer is 3") is None
    assert extract_boxed("\\boxed{ }") is None
    assert extract_boxed("\\boxed{1") is None


def test_printed_answer_is_the_last_line() -> None:
    assert printed_answer("working...\n0.5\n\n") == "0.5"
    assert printed_answer("  \n") is None


@pytest.mark.parametrize(
    "pred", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac{1}{2}", "$0.5$", "0.50", "0.5000001", "5e-01"]
)
def test_equivalent_forms_match(pred: str) -> None:
    assert answers_match(pred, "\\frac{1}{2}")
    assert answers_match(pred, "0.5")


@pytest.mark.parametrize("pred", ["0.50001", "1/3", "2", "-\\frac{1}{2}", "", None, "x" * (MAX_ANSWER_CHARS + 1)])
def test_different_answers_do_not_match(pred: str | None) -> None:
    assert not answers_match(pred, "\\frac{1}{2}")


def test_symbolic_and_numeric_answers() -> None:
    assert answers_match("1.4142135623730951", "\\sqrt{2}")  # numeric vs closed form, |diff| < 1e-6
    assert not answers_match("1.4142", "\\sqrt{2}")  # |diff| = 1.4e-5 > 1e-6
    assert answers_match("x = 3", "3")
    assert answers_match("\\{1, 2\\}", "\\{2, 1\\}")
    assert answers_match("1001", "1001") and not answers_match("1000", "1001")


def test_rewards_of_every_term_and_agreement() -> None:
    llm = ScriptedLLM(
        {
            "reasoner": ["\\boxed{\\frac{1}{2}}", "so \\boxed{0.5}", "1/2 (no box)", "\\boxed{3}"],
            "tool": [TOOL_RIGHT, TOOL_CRASH, TOOL_BROKEN, TOOL_WRONG],
        }
    )
    ep = run_workflow(MathWorkflow, TASK, llm=llm, branching=4)
    assert not ep.validate()
    reasoner, tool = ep.turns[0]
    # Reasoner: right = team 1 + 0.2 + 0.8 = 2.0 (both forms); no box = 0; boxed wrong = 0 + 0.2 = 0.2.
    assert reasoner.rewards == pytest.approx([2.0, 2.0, 0.0, 0.2])
    assert [c.parse_failed for c in reasoner] == [False, False, True, False]
    # Tool: right = 1 + 0.1 + 0.1 + 0.8 = 2.0; crash = builds only, 0.1; does not build = 0; wrong = 0.2.
    assert tool.rewards == pytest.approx([2.0, 0.1, 0.0, 0.2])
    # The committed answers (1/2 and "1/2" printed) agree: terminated, and the reasoner is right.
    assert ep.terminated and ep.num_turns == 1
    assert ep.metrics["mas/success"] == 1.0 and ep.metrics["mas/math/agreed"] == 1.0


def test_disagreement_shows_each_role_the_others_work() -> None:
    # K=1: turn t uses reply t. Turn 0: reasoner says 3, tool prints 1/2 -> no agreement.
    # Turn 1: the reasoner corrects itself to 0.5 -> agreement with the tool's 1/2.
    llm = ScriptedLLM({"reasoner": ["I think \\boxed{3}", "Right, \\boxed{0.5}"], "tool": [TOOL_RIGHT]})
    ep = run_workflow(MathWorkflow, TASK, llm=llm, branching=1, max_turns=4)
    assert ep.terminated and ep.num_turns == 2 and ep.metrics["mas/success"] == 1.0
    reasoner1, tool1 = ep.turns[1]
    seen_by_reasoner = reasoner1.messages[-1]["content"]
    assert "Fraction(1, 3)" in seen_by_reasoner and "It printed: 1/2" in seen_by_reasoner
    assert "Your answer was 3" in seen_by_reasoner
    seen_by_tool = tool1.messages[-1]["content"]
    assert "I think \\boxed{3}" in seen_by_tool and "Its answer: 3." in seen_by_tool


def test_wrong_reasoner_is_not_a_success_even_when_the_tool_is_right() -> None:
    ep = run_workflow(MathWorkflow, TASK, llm=ScriptedLLM({"reasoner": "\\boxed{3}", "tool": TOOL_RIGHT}),
                      branching=1, max_turns=2)
    assert ep.truncated and ep.metrics["mas/success"] == 0.0 and ep.metrics["mas/math/agreed"] == 0.0


def test_single_reasoner_baseline() -> None:
    ep = run_workflow(MathSingleWorkflow, TASK, llm=ScriptedLLM({"reasoner": ["\\boxed{3}", "\\boxed{0.5}"]}),
                      branching=2)
    assert ep.terminated and ep.num_turns == 1
    assert ep.turns[0][0].rewards == pytest.approx([0.2, 2.0]) and ep.metrics["mas/success"] == 1.0


def test_malformed_task_is_rejected() -> None:
    with pytest.raises(ValueError, match="'problem'.*'answer'"):
        check_math_task({"id": "x", "problem": "", "answer": None})


@pytest.mark.parametrize("workflow_id", ["math-v0", "math-single-v0"])
def test_check_workflow(workflow_id: str) -> None:
    cls = get_workflow(workflow_id)
    assert cls in (MathWorkflow, MathSingleWorkflow)
    check_workflow(cls, TASK)


def test_project_tasks_are_valid() -> None:
    tasks = project_tasks("math")
    assert len(tasks) == 16 and len({t["id"] for t in tasks}) == 16
    for t in tasks:
        check_math_task(t)
        assert answers_match(t["answer"], t["answer"])


def test_data_cli_writes_disjoint_project_splits(tmp_path) -> None:  # noqa: ANN001
    from verl_mas.data import read_tasks
    from verl_mas.data.__main__ import main

    assert main(["math-v0", "--out", str(tmp_path), "--train", "10", "--test", "6", "--seed", "1"]) == 0
    train, test = read_tasks(tmp_path / "train.parquet"), read_tasks(tmp_path / "test.parquet")
    assert len(train) == 10 and len(test) == 6 and not {t["id"] for t in train} & {t["id"] for t in test}


def test_an_answer_too_expensive_to_check_is_no_match_and_the_episode_finishes(tmp_path) -> None:
    """A reasoner answering ``9^{9^{9^{9}}}`` once froze the worker: sympy evaluates the tower in one C call
    that holds the GIL and practically never returns, so the thread-based 10 s limit never fired. Now the
    check runs in a process that is killed at the deadline.

    Run in a fresh interpreter with a time limit, so a regression fails here instead of hanging the suite.
    """
    script = textwrap.dedent(
        """
        import json, sys
        from verl_mas.testing import ScriptedLLM, run_workflow
        from verl_mas.workflows.math_tool import MathWorkflow

        if __name__ == "__main__":
            MathWorkflow.match_timeout_s = 1.5  # the deadline per check (default 10 s), short to keep this fast
            task, tool = json.loads(sys.argv[1]), sys.argv[2]
            llm = ScriptedLLM({"reasoner": "so \\\\boxed{9^{9^{9^{9}}}}", "tool": tool})
            ep = run_workflow(MathWorkflow, task, llm=llm, branching=1, max_turns=1)
            reasoner, tool = ep.turns[0]
            print(json.dumps({"metrics": ep.metrics, "reasoner": reasoner.rewards, "tool": tool.rewards,
                              "truncated": ep.truncated, "problems": ep.validate()}))
        """
    )
    path = tmp_path / "tower.py"
    path.write_text(script)
    try:
        done = subprocess.run([sys.executable, str(path), json.dumps(TASK), TOOL_RIGHT], capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the episode did not finish within {e.timeout} s: an answer check blocked it")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Two checks time out: the reasoner's answer vs the gold 1/2, and the agreement check of the tool's
    # printed 1/2 against the reasoner's tower (the last check, the reasoner's answer vs gold, is memoised).
    assert out["metrics"]["mas/math/match_timeouts"] == 2.0
    # Reasoner: boxed, no match: 0 + 0.2 * 1 + 0.8 * 0 = 0.2. Tool: right: 1 + 0.1 + 0.1 + 0.8 = 2.0.
    assert out["reasoner"] == pytest.approx([0.2]) and out["tool"] == pytest.approx([2.0])
    assert out["metrics"]["mas/success"] == 0.0 and out["metrics"]["mas/math/agreed"] == 0.0
    assert out["truncated"] and not out["problems"]


#: A user's script with no ``if __name__ == "__main__":`` guard: module-level code runs a math-v0 episode.
UNGUARDED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from verl_mas.testing import ScriptedLLM, run_workflow

    print("the script body ran")
    task, tool = json.loads(sys.argv[1]), sys.argv[2]
    llm = ScriptedLLM({"reasoner": "so \\\\boxed{1/2}", "tool": tool})
    ep = run_workflow("math-v0", task, llm=llm, branching=1, max_turns=1)
    reasoner, tool = ep.turns[0]
    print(json.dumps({"aborted": ep.aborted, "error": ep.error, "metrics": ep.metrics,
                      "reasoner": reasoner.rewards, "tool": tool.rewards}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["stdin", "file"])
def test_a_math_episode_runs_from_a_script_without_a_main_guard(entry: str, tmp_path) -> None:  # noqa: ANN001
    """``python - <<EOF`` (stdin) or ``python script.py`` with no ``__main__`` guard: the answer checks run in
    worker processes, which used to import the main module again, so the worker re-ran the script (or, for
    stdin, failed to find the file ``<stdin>``) and died: every episode aborted with "the answer-checking
    pool broke ... All workers expired". The workers no longer import the caller's ``__main__``.
    """
    args = [json.dumps(TASK), TOOL_RIGHT]
    if entry == "stdin":
        command, stdin = [sys.executable, "-", *args], UNGUARDED_SCRIPT
    else:
        path = tmp_path / "unguarded.py"
        path.write_text(UNGUARDED_SCRIPT)
        command, stdin = [sys.executable, str(path), *args], None
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the {entry} script did not finish within {e.timeout} s")
    assert done.returncode == 0, done.stderr[-3000:]
    # Once, by the interpreter itself: a worker that re-ran the script would print it again (stdout is inherited).
    assert done.stdout.count("the script body ran") == 1, done.stdout[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["aborted"], out["error"]
    # Both right, so the answers agree and the episode ends after turn 0 with success.
    # Reasoner: team 1 + (0.2 * format 1 + 0.8 * match 1) = 2.0. Tool: 1 + (0.1 + 0.1 + 0.8) = 2.0.
    assert out["reasoner"] == pytest.approx([2.0]) and out["tool"] == pytest.approx([2.0])
    assert out["metrics"]["mas/success"] == 1.0 and out["metrics"]["mas/math/agreed"] == 1.0
