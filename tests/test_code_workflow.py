"""code-v0 / code-single-v0: parsing, every reward term on golden cases, scripted episodes, conformance, data CLI."""

from __future__ import annotations

import asyncio

import pytest

from verl_mas.data.tasks import check_code_task, project_tasks
from verl_mas.registry import get_workflow
from verl_mas.sandbox import SandboxError, TestCase, run_tests
from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow
from verl_mas.workflows import code as code_mod
from verl_mas.workflows.code import (
    CodeScore,
    CodeSingleWorkflow,
    CodeWorkflow,
    TestsScore,
    parse_tests,
    score_code,
    score_tests,
)
from verl_mas.workflows.common import extract_code

SOLUTION = "a, b = map(int, input().split())\nprint(a + b)\n"
TASK = {
    "id": "sum-two",
    "source": "test",
    "question": "Read two integers a and b on one line. Print a + b.",
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "-5 5\n", "output": "0\n"},
        {"input": "10 10\n", "output": "20\n"},
        {"input": "0 7\n", "output": "7\n"},
    ],
    "solution": SOLUTION,
}
GOLDEN = [TestCase(t["input"], t["output"]) for t in TASK["tests"]]


def fence(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}```"


def reply_with_tests(*pairs: tuple[str, str]) -> str:
    return "Tests:\n" + "\n".join(f"```input\n{i}```\n```output\n{o}```" for i, o in pairs)


GOOD_CODE = "Read both, add.\n" + fence(SOLUTION)
BROKEN_CODE = fence("a, b = map(int, input().split()\nprint(a + b)\n")  # unclosed parenthesis: does not build
# Right when a + b < 5 ("1 2" -> 3, "-5 5" -> 0), wrong otherwise ("10 10", "0 7" print 0): passes half.
HALF_CODE = fence("a, b = map(int, input().split())\nprint(a + b if a + b < 5 else 0)\n")
CRASH_CODE = fence("raise SystemExit(input() and 3)\n")  # builds, exits 3 on every test
GOOD_TESTS = reply_with_tests(("1 2\n", "3\n"), ("4 4\n", "8\n"))
WRONG_TESTS = reply_with_tests(("1 2\n", "3\n"), ("4 4\n", "9\n"))  # the second expected output is wrong


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------------
# Parsing.


def test_extract_code_takes_the_last_python_block() -> None:
    text = "first\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"  # untagged blocks count as code
    # Negative controls: no fence, another language, an empty block.
    assert extract_code("print(1)") is None
    assert extract_code("```cpp\nint main(){}\n```") is None
    assert extract_code("```python\n\n```") is None


def test_parse_tests_pairs_inputs_with_outputs() -> None:
    tests = parse_tests(GOOD_TESTS)
    assert tests == [TestCase("1 2\n", "3\n"), TestCase("4 4\n", "8\n")]
    # Invalid: no test, an input without output, an output without input.
    assert parse_tests("no tests here") is None
    assert parse_tests("```input\n1\n```") is None
    assert parse_tests("```output\n1\n```\n```input\n1\n```\n```output\n1\n```") is None
    # More than the cap: the extra ones are dropped, the reply stays valid.
    many = reply_with_tests(*[(f"{i}\n", f"{i}\n") for i in range(12)])
    assert len(parse_tests(many)) == code_mod.MAX_GENERATED_TESTS


# ---------------------------------------------------------------------------------------------------
# Reward terms, golden cases.


def test_coder_score_golden_cases() -> None:
    # Correct: builds 1, runs 3/3, pass 4/4 -> local 0.1 + 0.1 + 0.8 = 1.0.
    good = run(score_code(SOLUTION, GOLDEN))
    assert good == CodeScore(builds=True, runs=1.0, pass_rate=1.0) and good.local == pytest.approx(1.0)
    # Does not build: nothing runs -> local 0.
    broken = run(score_code(extract_code(BROKEN_CODE), GOLDEN))
    assert broken == CodeScore(builds=False, runs=0.0, pass_rate=0.0) and broken.local == 0.0
    # Half: builds 1, runs 3/3 (exit 0 on the first three tests), pass 2/4 -> 0.1 + 0.1 + 0.8 * 0.5 = 0.6.
    half = run(score_code(extract_code(HALF_CODE), GOLDEN))
    assert half == CodeScore(builds=True, runs=1.0, pass_rate=0.5) and half.local == pytest.approx(0.6)
    # Crashes: builds 1, runs 0/3, pass 0 -> 0.1.
    crash = run(score_code(extract_code(CRASH_CODE), GOLDEN))
    assert crash == CodeScore(builds=True, runs=0.0, pass_rate=0.0) and crash.local == pytest.approx(0.1)
    assert run(score_code(None, GOLDEN)).local == 0.0


def test_tester_score_golden_cases() -> None:
    # Right tests: valid 1, golden solution passes 2/2 -> 0.2 + 0.8 = 1.0.
    good = run(score_tests(parse_tests(GOOD_TESTS), SOLUTION))
    assert good == TestsScore(valid=True, golden_pass_rate=1.0) and good.local == pytest.approx(1.0)
    # One wrong expected output: golden passes 1/2 -> 0.2 + 0.4 = 0.6.
    wrong = run(score_tests(parse_tests(WRONG_TESTS), SOLUTION))
    assert wrong == TestsScore(valid=True, golden_pass_rate=0.5) and wrong.local == pytest.approx(0.6)
    # An input the golden solution cannot read counts as a wrong test: 0.2 + 0.8 * 0 = 0.2.
    bad_input = run(score_tests(parse_tests(reply_with_tests(("x\n", "1\n"))), SOLUTION))
    assert bad_input.local == pytest.approx(0.2)
    # Invalid format -> 0.
    assert run(score_tests(parse_tests("3\n"), SOLUTION)).local == 0.0
    # No golden solution: only the format term, 0.2 * 1.
    unknown = run(score_tests(parse_tests(GOOD_TESTS), None))
    assert unknown == TestsScore(valid=True, golden_pass_rate=None) and unknown.local == pytest.approx(0.2)


# ---------------------------------------------------------------------------------------------------
# Scripted episodes.


def test_correct_program_and_tests_terminate_with_success() -> None:
    llm = ScriptedLLM({"coder": [GOOD_CODE, BROKEN_CODE], "tester": [GOOD_TESTS, WRONG_TESTS]})
    ep = run_workflow(CodeWorkflow, TASK, llm=llm, branching=2, max_turns=4)
    assert not ep.validate()
    coder, tester = ep.turns[0]
    # Coder: good = team 1 + local 1 = 2.0; broken = 0 + 0 = 0.
    assert [c.reward for c in coder.all] == pytest.approx([2.0, 0.0])
    assert [c.parse_failed for c in coder.all] == [False, False]  # broken code is a fence with bad code: parsed
    # Tester: team = committed program's pass rate 1.0 for both; local 1.0 and 0.6 -> 2.0, 1.6.
    assert [c.reward for c in tester.all] == pytest.approx([2.0, 1.6])
    assert coder.committed.index == 0 and tester.committed.index == 0
    # The committed program passes the committed tests: terminated in the first turn, success on golden tests.
    assert ep.terminated and ep.num_turns == 1
    assert ep.metrics["mas/success"] == 1.0 and ep.metrics["mas/code/agreed"] == 1.0


def test_wrong_tests_lead_to_a_second_turn_with_mismatches_shown() -> None:
    # K=2: turn 0 takes replies 0-1, turn 1 replies 2-3 of each role. The tester is wrong first, then right.
    llm = ScriptedLLM({"coder": [GOOD_CODE] * 4, "tester": [WRONG_TESTS, WRONG_TESTS, GOOD_TESTS, GOOD_TESTS]})
    ep = run_workflow(CodeWorkflow, TASK, llm=llm, branching=2, max_turns=4)
    assert ep.terminated and ep.num_turns == 2 and ep.metrics["mas/success"] == 1.0
    coder1, tester1 = ep.turns[1]
    last_coder = coder1.messages[-1]["content"]
    assert "4 4" in last_coder and "Tester's expected output:\n9" in last_coder and "Program's output:\n8" in last_coder
    last_tester = tester1.messages[-1]["content"]
    assert "print(a + b)" in last_tester and "Program's output:\n8" in last_tester
    # Turn 0 tester rewards: team 1 (the committed program passes the golden tests) + 0.6.
    assert [c.reward for c in ep.turns[0][1].all] == pytest.approx([1.6, 1.6])


def test_half_program_is_not_a_success() -> None:
    llm = ScriptedLLM({"coder": [HALF_CODE], "tester": ["no tests"]})
    ep = run_workflow(CodeWorkflow, TASK, llm=llm, branching=2, max_turns=2)
    assert ep.truncated and ep.metrics["mas/success"] == 0.0
    assert ep.metrics["mas/code/golden_pass_rate"] == 0.5
    # Coder: team 0.5 + local 0.6 = 1.1. Tester: team 0.5 + local 0 (invalid) = 0.5, parse failed.
    coder, tester = ep.turns[0]
    assert coder.rewards == pytest.approx([1.1, 1.1])
    assert tester.rewards == pytest.approx([0.5, 0.5]) and all(c.parse_failed for c in tester)


def test_task_without_solution_rewards_the_tester_format_only() -> None:
    task = {**TASK, "solution": None}
    ep = run_workflow(CodeWorkflow, task, llm=ScriptedLLM({"coder": GOOD_CODE, "tester": GOOD_TESTS}), branching=1)
    tester = ep.turns[0][1].all[0]
    assert tester.local_reward == pytest.approx(0.2) and tester.team_reward == 1.0
    assert ep.metrics["mas/code/has_solution"] == 0.0


def test_single_coder_baseline() -> None:
    ep = run_workflow(CodeSingleWorkflow, TASK, llm=ScriptedLLM({"coder": [HALF_CODE, GOOD_CODE]}), branching=2)
    assert ep.terminated and ep.num_turns == 1
    assert ep.turns[0][0].rewards == pytest.approx([1.1, 2.0]) and ep.metrics["mas/success"] == 1.0


def test_sandbox_failure_aborts_the_episode_and_is_never_a_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    async def dead(code: str, **kwargs: object) -> object:
        raise SandboxError("fork server died")

    monkeypatch.setattr(code_mod, "check_compiles", dead)
    episode = run_workflow(CodeWorkflow, TASK, llm=ScriptedLLM({"coder": GOOD_CODE, "tester": GOOD_TESTS}), branching=1)
    # An infrastructure failure: the episode is aborted, nothing unscored is trained on (never a zero reward).
    assert episode.aborted and "fork server died" in (episode.error or "")
    assert not any(c.trainable for c in episode.candidates)


def test_malformed_task_is_rejected_with_every_problem() -> None:
    with pytest.raises(ValueError, match="'question'.*'tests'"):
        check_code_task({"id": "x", "question": "", "tests": []})


# ---------------------------------------------------------------------------------------------------
# Conformance, registry, data.


@pytest.mark.parametrize("workflow_id", ["code-v0", "code-single-v0"])
def test_check_workflow(workflow_id: str) -> None:
    cls = get_workflow(workflow_id)
    assert cls in (CodeWorkflow, CodeSingleWorkflow)
    check_workflow(cls, TASK)


def test_project_tasks_golden_solutions_pass_their_tests() -> None:
    tasks = project_tasks("code")
    assert len(tasks) == 16 and len({t["id"] for t in tasks}) == 16

    async def rates() -> list[float]:
        reports = await asyncio.gather(
            *(run_tests(t["solution"], [(x["input"], x["output"]) for x in check_code_task(t)["tests"]]) for t in tasks)
        )
        return [r.pass_rate for r in reports]

    assert run(rates()) == [1.0] * 16


def test_data_cli_writes_disjoint_project_splits(tmp_path) -> None:  # noqa: ANN001
    from verl_mas.data import read_tasks
    from verl_mas.data.__main__ import main

    assert main(["code-v0", "--out", str(tmp_path), "--train", "12", "--test", "4", "--seed", "0"]) == 0
    train, test = read_tasks(tmp_path / "train.parquet"), read_tasks(tmp_path / "test.parquet")
    assert len(train) == 12 and len(test) == 4
    assert not {t["id"] for t in train} & {t["id"] for t in test}
    # Negative control: the set has 16 tasks, so 17 cannot be drawn.
    assert main(["code-v0", "--out", str(tmp_path / "x"), "--train", "13", "--test", "4", "--patience", "200"]) == 2
