"""``code-v0`` (coder + tester, simultaneous) and ``code-single-v0`` (coder alone): stdin/stdout programming tasks.

Task (a JSON dict, see :func:`verl_mas.data.tasks.check_code_task`)::

    {"id": "sum-two", "source": "verl_mas", "question": "Read two integers ...",
     "tests": [{"input": "1 2\\n", "output": "3\\n"}, ...],      # golden tests (at least one)
     "solution": "a, b = map(int, input().split())\\nprint(a + b)\\n"}   # golden program, or null

Each turn the **coder** writes a program (one fenced ```python block) and the **tester** writes tests
(```input / ```output block pairs); both act on the same state (simultaneous). From the second turn on
each sees the other's committed artefact of the previous turn and the mismatches between the committed
program's outputs and the committed tests, and may revise its own.

Rewards (paper, §3 of docs/design; per candidate, immediate; ``reward = alpha * team + local``):

- coder: ``team = p`` (pass rate on the golden tests); ``local = 0.1 * builds + 0.1 * runs + 0.8 * p``
  where ``builds`` is 1 when the program compiles and ``runs`` is the fraction of the first (up to) 3
  golden tests on which it exits 0 within the limits (whatever it prints). ``p`` in the local term is
  the same golden pass rate, as in the paper's reference code.
- tester: ``team = p`` of the program the coder committed this turn (the team's outcome; identical
  for the K tester candidates, so it does not move their advantages); ``local = 0.2 * valid + 0.8 * g``
  where ``valid`` is 1 when the reply holds 1..:data:`MAX_GENERATED_TESTS` well-formed tests (every
  ```input block followed by an ```output block) and ``g`` is the pass rate of the task's golden solution
  on those tests. **A task without a golden solution** gives ``g = 0`` (so ``local = 0.2 * valid``) and
  reports ``mas/code/has_solution = 0``; load such tasks only knowingly.

The episode terminates when the committed program passes every committed generated test; success
(``mas/success``) is a golden pass rate of 1 for the last committed program. Unparsable replies get
the floor reward and ``parse_failed``. Programs run in :mod:`verl_mas.sandbox` (awaited, never on the
event loop). A timeout (the program used its own time budget) is the model's: verdict ``timeout``, scored
like any failed test. A :class:`~verl_mas.sandbox.SandboxError` (the sandbox failed, or machine load starved
a run) is an infrastructure failure and propagates.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl_mas.chat import Message, system, user
from verl_mas.data.tasks import check_code_task, project_tasks
from verl_mas.registry import register_workflow
from verl_mas.sandbox import TestCase, TestReport, check_compiles, outputs_match, run_python, run_tests
from verl_mas.workflow import Workflow
from verl_mas.workflows.common import Memo, extract_code, fenced_blocks, settle_all

__all__ = [
    "MAX_GENERATED_TESTS",
    "SMOKE_TESTS",
    "CodeScore",
    "CodeSingleWorkflow",
    "CodeWorkflow",
    "TestsScore",
    "parse_tests",
    "score_code",
    "score_tests",
]

#: Generated tests beyond this many in one tester reply are ignored (not counted, not run).
MAX_GENERATED_TESTS = 8

#: The "runs" smoke term uses the first this-many golden tests.
SMOKE_TESTS = 3

#: Characters of inputs/outputs quoted back to the roles in feedback messages.
_CLIP = 300

# ---------------------------------------------------------------------------------------------------
# Pure task logic: parsing replies (programs: :func:`verl_mas.workflows.common.extract_code`) and scoring
# programs and tests.


def parse_tests(text: str, max_tests: int = MAX_GENERATED_TESTS) -> list[TestCase] | None:
    """The tests of a tester reply: each ```input block followed by an ```output block.

    Returns:
        Up to ``max_tests`` tests in order, or None when the reply is not valid: no test at all, an
        ```input block without its ```output block, or an ```output block without an input before it.
        Other fenced blocks (e.g. explanations in ```text) are ignored.
    """
    tests: list[TestCase] = []
    pending: str | None = None
    for kind, body in fenced_blocks(text):
        if kind == "input":
            if pending is not None:
                return None
            pending = body
        elif kind == "output":
            if pending is None:
                return None
            tests.append(TestCase(pending, body))
            pending = None
    if pending is not None or not tests:
        return None
    return tests[:max_tests]


@dataclass(frozen=True)
class CodeScore:
    """How a program fared: ``builds`` (compiles), ``runs`` (smoke fraction) and golden ``pass_rate``."""

    builds: bool
    runs: float
    pass_rate: float

    @property
    def local(self) -> float:
        """The coder's local reward: ``0.1 * builds + 0.1 * runs + 0.8 * pass_rate``."""
        return 0.1 * self.builds + 0.1 * self.runs + 0.8 * self.pass_rate


NO_CODE = CodeScore(builds=False, runs=0.0, pass_rate=0.0)


async def score_code(code: str | None, golden: Sequence[TestCase]) -> CodeScore:
    """Compile ``code`` and run it on the golden tests in the sandbox.

    A program that does not compile is not run (``runs = pass_rate = 0``). ``runs`` is the fraction of
    the first :data:`SMOKE_TESTS` golden tests on which it exits 0 within the limits.

    Raises:
        SandboxError: The sandbox itself failed (an infrastructure failure, not a model mistake).
    """
    if code is None:
        return NO_CODE
    built = await check_compiles(code)
    if not built.ok:
        return NO_CODE
    report = await run_tests(code, list(golden))
    smoke = report.results[:SMOKE_TESTS]
    return CodeScore(builds=True, runs=sum(r.exec.ok for r in smoke) / len(smoke), pass_rate=report.pass_rate)


@dataclass(frozen=True)
class TestsScore:
    """A tester reply's score: ``valid`` format and ``golden_pass_rate`` (None without a golden solution)."""

    __test__ = False  # not a pytest class

    valid: bool
    golden_pass_rate: float | None

    @property
    def local(self) -> float:
        """The tester's local reward: ``0.2 * valid + 0.8 * golden_pass_rate`` (0 for a missing rate)."""
        return 0.2 * self.valid + 0.8 * (self.golden_pass_rate or 0.0)


async def _golden_output(solution: str, stdin: str) -> str | None:
    result = await run_python(solution, stdin=stdin)
    return result.stdout if result.ok else None


async def score_tests(
    tests: list[TestCase] | None,
    solution: str | None,
    golden_output: Callable[[str], Awaitable[str | None]] | None = None,
) -> TestsScore:
    """Score generated tests: valid format, and the golden solution's pass rate on them.

    A generated test passes when the golden solution exits 0 on its input and prints its expected
    output (normalized comparison); an input on which the golden solution fails counts as a wrong test.

    Args:
        tests: The parsed tests (None for an invalid reply).
        solution: The task's golden program, or None (then ``golden_pass_rate`` is None).
        golden_output: ``stdin -> golden stdout or None``; defaults to running ``solution`` (pass a memo
            to run each distinct input once per episode).
    """
    if tests is None:
        return TestsScore(valid=False, golden_pass_rate=None if solution is None else 0.0)
    if solution is None:
        return TestsScore(valid=True, golden_pass_rate=None)
    run = golden_output or (lambda stdin: _golden_output(solution, stdin))
    outputs = await asyncio.gather(*(run(t.input) for t in tests))
    passed = sum(out is not None and outputs_match(out, t.expected) for out, t in zip(outputs, tests, strict=True))
    return TestsScore(valid=True, golden_pass_rate=passed / len(tests))


def _clip(text: str, width: int = _CLIP) -> str:
    return text if len(text) <= width else text[: width - 15] + "...(truncated)"


def _why(result: Any) -> str:
    """What a program did on one test: its output, or why it produced none."""
    ex = result.exec
    if result.verdict in ("passed", "wrong_output"):
        return _clip(ex.stdout) or "(nothing)"
    if result.verdict == "runtime_error":
        lines = [ln for ln in ex.stderr.splitlines() if ln.strip()]
        return f"(runtime error: {_clip(lines[-1]) if lines else f'exit code {ex.exit_code}'})"
    return f"(stopped: {ex.killed_reason})"


def format_tests(tests: Sequence[TestCase]) -> str:
    """Tests as the tester writes them (```input / ```output pairs)."""
    return "\n".join(f"```input\n{_clip(t.input)}```\n```output\n{_clip(t.expected)}```" for t in tests)


def format_mismatches(report: TestReport | None) -> str:
    """The failed generated tests of the committed program, one paragraph each ("" when none failed)."""
    if report is None:
        return ""
    parts = [
        f"Input:\n{_clip(r.case.input)}\nTester's expected output:\n{_clip(r.case.expected)}\nProgram's output:\n{_why(r)}"
        for r in report.results
        if not r.passed
    ]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# Workflows.

CODER_PROMPT = (
    "You write Python 3 programs that read standard input with input() and write standard output with "
    "print(). Think briefly, then give the complete program in one ```python code block."
)
TESTER_PROMPT = (
    "You write unit tests for a programming problem: test inputs and the exact outputs a correct program "
    f"prints for them. Think briefly, then give 1 to {MAX_GENERATED_TESTS} tests, each as an ```input code "
    "block followed by an ```output code block."
)


def _problem(question: str) -> str:
    return f"Problem:\n{question}"


class _CodeBase(Workflow):
    """Shared per-episode scoring for the code workflows."""

    example_task: Any = {
        "id": "sum-two",
        "source": "verl_mas",
        "question": "Read two integers a and b on one line, separated by a space. Print a + b.",
        "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "-5 5\n", "output": "0\n"}],
        "solution": "a, b = map(int, input().split())\nprint(a + b)\n",
    }

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """One task of the project-written set (``verl_mas/data/code_tasks.jsonl``), both splits.

        ``python -m verl_mas.data`` keeps train and test disjoint; the set has 16 tasks, so ask for at
        most 16 in all (e.g. ``--train 12 --test 4``). Real datasets: :mod:`verl_mas.data.loaders`.
        """
        return rng.choice(project_tasks("code"))

    async def _score_coders(self, candidates: Any, golden: list[TestCase], memo: Memo[Any, CodeScore]) -> None:
        """Reward every coder candidate, keeping its program and score in ``info["code"]`` and ``info["score"]``."""
        codes = [extract_code(c.text) for c in candidates]
        scores = await asyncio.gather(*(memo(code) for code in codes))
        for c, code, s in zip(candidates, codes, scores, strict=True):
            c.parse_failed = code is None
            c.team_reward = s.pass_rate
            c.local_reward = s.local
            c.info.update(code=code, score=s)


@register_workflow("code-v0")
class CodeWorkflow(_CodeBase):
    """A coder writes a program while a tester writes tests; they revise against each other's work.

    See the module docstring for the rewards, termination and success.
    """

    roles = ("coder", "tester")

    async def run(self, task: dict[str, Any]) -> None:
        t = check_code_task(task)
        golden = [TestCase(x["input"], x["output"]) for x in t["tests"]]
        solution: str | None = t["solution"]
        code_memo: Memo[Any, CodeScore] = Memo(lambda code: score_code(code, golden))
        golden_memo: Memo[str, str | None] = Memo(lambda stdin: _golden_output(solution or "", stdin))
        tests_memo: Memo[Any, TestsScore] = Memo(
            lambda text: score_tests(parse_tests(text), solution, golden_memo)
        )
        await settle_all([code_memo, tests_memo, golden_memo],
                         self._play(t, golden, solution, code_memo, tests_memo))

    async def _play(self, t: dict[str, Any], golden: list[TestCase], solution: str | None,
                    code_memo: Memo[Any, CodeScore], tests_memo: Memo[Any, TestsScore]) -> None:
        coder_chat: list[Message] = [system(CODER_PROMPT), user(_problem(t["question"]))]
        tester_chat: list[Message] = [system(TESTER_PROMPT), user(_problem(t["question"]))]
        pass_rate, agreed = 0.0, False
        for _ in self.turns():
            # Simultaneous: both act on the same state (the artefacts committed last turn).
            coders, testers = await asyncio.gather(self.generate("coder", coder_chat), self.generate("tester", tester_chat))
            _, test_scores = await asyncio.gather(
                self._score_coders(coders, golden, code_memo),
                asyncio.gather(*(tests_memo(c.text) for c in testers)),
            )
            coder = coders.best()
            code, pass_rate = coder.info["code"], coder.info["score"].pass_rate
            for c, s in zip(testers, test_scores, strict=True):
                c.parse_failed = not s.valid
                c.team_reward = pass_rate  # the team's outcome this turn: the committed program's golden pass rate
                c.local_reward = s.local
            tester = testers.best()
            tests = parse_tests(tester.text)

            # The interaction: the committed program on the committed tests.
            report = await run_tests(code, tests) if code is not None and tests is not None else None
            agreed = report is not None and report.all_passed
            if agreed:
                break
            coder_chat += [coder.as_message(), user(self._coder_feedback(tests, report))]
            tester_chat += [tester.as_message(), user(self._tester_feedback(code, report))]
        self.metrics["mas/success"] = float(pass_rate == 1.0)
        self.metrics["mas/code/golden_pass_rate"] = pass_rate
        self.metrics["mas/code/agreed"] = float(agreed)
        self.metrics["mas/code/has_solution"] = float(solution is not None)

    @staticmethod
    def _coder_feedback(tests: list[TestCase] | None, report: TestReport | None) -> str:
        if tests is None:
            return "The tester gave no valid tests this time. Check your program yourself and reply with the complete program in one ```python block."
        head = f"The tester's tests:\n{format_tests(tests)}\n\n"
        if report is None:
            return head + "Your reply had no ```python code block. Reply with the complete program in one ```python block."
        return head + (
            f"Your program failed these tests:\n\n{format_mismatches(report)}\n\n"
            "A test may itself be wrong. If your program is right, give it again; otherwise fix it. "
            "Reply with the complete program in one ```python block."
        )

    @staticmethod
    def _tester_feedback(code: str | None, report: TestReport | None) -> str:
        if code is None:
            return "The coder gave no program this time. Check your tests yourself and give them again in the same format."
        head = f"The coder's program:\n```python\n{_clip(code, 3000)}```\n\n"
        if report is None:
            return head + "Your reply had no valid tests (each ```input block must be followed by an ```output block). Give your tests again."
        return head + (
            f"The program disagrees with these tests of yours:\n\n{format_mismatches(report)}\n\n"
            "The program may be wrong, or your expected output may be. Fix the tests that are wrong and keep the "
            "right ones; give all tests again in the same format."
        )


@register_workflow("code-single-v0")
class CodeSingleWorkflow(_CodeBase):
    """Single-role baseline: the coder alone, one turn, rewarded as the coder of ``code-v0``.

    With no tester there is nothing to revise against (the golden tests are the reward, never shown),
    so the episode ends (terminated) after the first turn, as the paper's single-agent baseline.
    """

    roles = ("coder",)

    async def run(self, task: dict[str, Any]) -> None:
        t = check_code_task(task)
        golden = [TestCase(x["input"], x["output"]) for x in t["tests"]]
        memo: Memo[Any, CodeScore] = Memo(lambda code: score_code(code, golden))
        pass_rate = 0.0
        for _ in self.turns():
            coders = await self.generate("coder", [system(CODER_PROMPT), user(_problem(t["question"]))])
            await settle_all([memo], self._score_coders(coders, golden, memo))
            pass_rate = coders.best().info["score"].pass_rate
            break
        self.metrics["mas/success"] = float(pass_rate == 1.0)
        self.metrics["mas/code/golden_pass_rate"] = pass_rate
