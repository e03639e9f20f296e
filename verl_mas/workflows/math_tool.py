"""``math-v0`` (reasoner + tool, simultaneous) and ``math-single-v0`` (reasoner alone): math problems with a checked answer.

Task (a JSON dict, see :func:`verl_mas.data.tasks.check_math_task`)::

    {"id": "add-fractions", "source": "verl_mas", "problem": "Compute 1/3 + 1/6.", "answer": "\\\\frac{1}{2}"}

Each turn the **reasoner** solves step by step and puts its final answer in ``\\boxed{...}``, while the
**tool** writes a Python program (one ```python block) that prints the answer; the program runs in
:mod:`verl_mas.sandbox` and its answer is the last non-empty line it prints. Both act on the same state
(simultaneous). From the second turn on each sees the other's previous solution and answer.

Rewards (paper; per candidate, immediate; ``reward = alpha * team + local``; ``match`` is whether the
candidate's own answer equals the task's answer, see :func:`answers_match`):

- reasoner: ``team = match``; ``local = 0.2 * format + 0.8 * match`` (``format``: a non-empty ``\\boxed{}``).
- tool: ``team = match``; ``local = 0.1 * builds + 0.1 * executes + 0.8 * match`` (``builds``: the program
  compiles; ``executes``: it exits 0 within the sandbox limits).

The episode terminates when the committed answers of the two roles agree; success (``mas/success``) is
whether the reasoner's last committed answer is correct.

Answer checks run in a worker process of :mod:`verl_mas.verify`, killed after ``match_timeout_s``
(class attribute, default :data:`MATCH_TIMEOUT_S`): some answers (``9^{9^{9^{9}}}``) keep sympy computing
practically forever inside one C call that holds the GIL, which no thread timeout can interrupt. A check that runs
past the deadline is no match, counted in ``mas/math/match_timeouts``; a worker that dies (OOM, signal)
raises :class:`verl_mas.errors.InfraError` and aborts the episode, since it says nothing about the answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import re
from typing import Any

from verl_mas.chat import Message, system, user
from verl_mas.data.tasks import check_math_task, project_tasks, strip_math_delimiters
from verl_mas.registry import register_workflow
from verl_mas.sandbox import check_compiles, run_python
from verl_mas.verify import CheckTimeout, run_check
from verl_mas.workflow import Workflow
from verl_mas.workflows.common import Memo, extract_code, settle_all

logger = logging.getLogger(__name__)

__all__ = [
    "MATCH_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "NUMERIC_ABS_TOL",
    "MathSingleWorkflow",
    "MathWorkflow",
    "answers_match",
    "extract_boxed",
    "printed_answer",
]

#: Numeric answers match when ``|pred - gold| <= max(NUMERIC_ABS_TOL, 1e-9 * |gold|)``.
NUMERIC_ABS_TOL = 1e-6

#: Longer answers are not parsed (they do not match): bounds the symbolic work per comparison.
MAX_ANSWER_CHARS = 200

#: A comparison that runs longer is killed and counts as no match (counted in ``mas/math/match_timeouts``).
MATCH_TIMEOUT_S = 10.0

# ---------------------------------------------------------------------------------------------------
# Pure task logic: extracting and comparing answers.


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; else None.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``. An empty or unclosed box gives None.
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                inner = text[starts[-1] : i].strip()
                return inner or None
        i += 1
    return None


def printed_answer(stdout: str) -> str | None:
    """The tool program's answer: the last non-empty line it printed, stripped; None if it printed nothing."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[Any, ...]:
    """math-verify's parse of an answer: as the content of a ``\\boxed{}`` (LaTeX), else as a plain expression."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # parsing_timeout=None: math-verify's timeout uses signal.alarm, a Python handler that cannot interrupt
    # a C call holding the GIL (a huge power); the workflows run this in a process killed at a deadline instead.
    found = parse("\\boxed{" + text + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if not found:
        found = parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
    return tuple(found)


def _numeric(text: str, parsed: tuple[Any, ...]) -> float | None:
    """The real value of a numeric answer (a float literal such as ``1e-07``, or a closed-form number)."""
    if _FLOAT_RE.fullmatch(text):
        value = float(text)
        return value if math.isfinite(value) else None
    import sympy

    head = parsed[0] if parsed else None
    if not isinstance(head, sympy.Expr) or not head.is_number:
        return None
    try:
        z = complex(head.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return None  # not a finite complex number (zoo, nan, ...): not numeric
    if abs(z.imag) > 1e-12 or not math.isfinite(z.real):
        return None
    return z.real


def answers_match(pred: str | None, gold: str) -> bool:
    """Whether answer ``pred`` equals ``gold``, decided by the ``math-verify`` package.

    Both are parsed with ``math_verify.parse`` (as LaTeX, so ``\\frac{1}{2}``, ``1/2`` and ``0.5`` all
    parse; surrounding ``$`` dropped). When both are numbers they match within
    ``max(NUMERIC_ABS_TOL, 1e-9 * |gold|)``; otherwise ``math_verify.verify(gold, pred)`` decides
    (expressions, sets, intervals, equations such as ``x = 3`` vs ``3``). An answer math-verify cannot
    parse at all (e.g. ``Yes``) matches only the identical string (whitespace ignored).

    Blocking and unbounded: ``answers_match("9^{9^{9^{9}}}", "1")`` never returns in practice, holding the GIL.
    Call it through :func:`verl_mas.verify.run_check` (a killable process), as the workflows do.
    """
    if pred is None:
        return False
    p, g = strip_math_delimiters(pred), strip_math_delimiters(gold)
    if not p or not g or len(p) > MAX_ANSWER_CHARS:
        return False
    pp, gp = _parse(p), _parse(g)
    pn, gn = _numeric(p, pp), _numeric(g, gp)
    if pn is not None and gn is not None:
        return abs(pn - gn) <= max(NUMERIC_ABS_TOL, 1e-9 * abs(gn))
    if not pp or not gp:
        return "".join(p.split()) == "".join(g.split())
    from math_verify import verify

    return bool(verify(list(gp), list(pp), timeout_seconds=None))


def _warm_up_check_worker() -> None:
    """Called by each :mod:`verl_mas.verify` worker before its first check: imports sympy and math-verify and
    builds math-verify's LaTeX parser (~0.5 s), which would otherwise count against a check's deadline."""
    answers_match("\\frac{1}{2}", "0.5")


# ---------------------------------------------------------------------------------------------------
# Workflows.

REASONER_PROMPT = (
    "You solve math problems. Reason step by step, then give the final answer in \\boxed{}, "
    "e.g. \\boxed{\\frac{1}{2}}."
)
TOOL_PROMPT = (
    "You solve math problems by writing Python. Give one complete program in one ```python code block; it "
    "must print only the final answer (as its last line). Only the standard library is available."
)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 15] + "...(truncated)"


class _MathBase(Workflow):
    """Shared answer checking for the math workflows."""

    #: Seconds an answer check may run before its worker process is killed (the answer then does not match).
    match_timeout_s: float = MATCH_TIMEOUT_S

    example_task: Any = {"id": "add-fractions", "source": "verl_mas",
                         "problem": "Compute 1/3 + 1/6. Give the answer as a reduced fraction.", "answer": "\\frac{1}{2}"}

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """One task of the project-written set (``verl_mas/data/math_tasks.jsonl``), both splits.

        The set has 16 tasks; ``python -m verl_mas.data`` keeps train and test disjoint, so ask for at
        most 16 in all. Real datasets: :mod:`verl_mas.data.loaders`.
        """
        return rng.choice(project_tasks("math"))

    def _setup(self) -> None:
        self._matches: Memo[tuple[str | None, str], bool] = Memo(self._check)
        self.metrics["mas/math/match_timeouts"] = 0.0

    async def _check(self, key: tuple[str | None, str]) -> bool:
        pred, gold = key
        if pred is None:
            return False
        try:
            # A dead worker raises InfraError (the episode aborts): an infrastructure failure is never a reward.
            return await run_check(answers_match, pred, gold, timeout_s=self.match_timeout_s)
        except CheckTimeout:
            logger.warning("answer comparison ran over %s s and was killed; counted as no match: %.80r vs %.80r",
                           self.match_timeout_s, pred, gold)
            self.metrics["mas/math/match_timeouts"] += 1.0
            return False

    def _match(self, pred: str | None, gold: str) -> asyncio.Task[bool]:
        """Memoised :func:`answers_match` in a killable worker process (past ``match_timeout_s``: no match)."""
        return self._matches((pred, gold))

    async def _score_reasoners(self, candidates: Any, gold: str) -> None:
        """Reward every reasoner candidate; each keeps its boxed answer (or None) in ``info["answer"]``."""
        answers = [extract_boxed(c.text) for c in candidates]
        matches = await asyncio.gather(*(self._match(a, gold) for a in answers))
        for c, a, m in zip(candidates, answers, matches, strict=True):
            c.parse_failed = a is None
            c.team_reward = float(m)
            c.local_reward = 0.2 * (a is not None) + 0.8 * m
            c.info["answer"] = a


@register_workflow("math-v0")
class MathWorkflow(_MathBase):
    """A reasoner and a tool-writing role solve a math problem until their answers agree.

    See the module docstring for the rewards, termination and success.
    """

    roles = ("reasoner", "tool")

    async def run(self, task: dict[str, Any]) -> None:
        t = check_math_task(task)
        self._setup()
        runs: Memo[str, tuple[bool, bool, str | None, str]] = Memo(self._execute)
        await settle_all([runs, self._matches], self._play(t, runs))

    async def _play(self, t: dict[str, Any], runs: Memo[str, tuple[bool, bool, str | None, str]]) -> None:
        gold = t["answer"]
        reasoner_chat: list[Message] = [system(REASONER_PROMPT), user(f"Problem:\n{t['problem']}")]
        tool_chat: list[Message] = [system(TOOL_PROMPT), user(f"Problem:\n{t['problem']}")]
        said: str | None = None
        agreed = False
        for _ in self.turns():
            reasoners, tools = await asyncio.gather(
                self.generate("reasoner", reasoner_chat), self.generate("tool", tool_chat)
            )
            codes = [extract_code(c.text) for c in tools]
            _, executed = await asyncio.gather(
                self._score_reasoners(reasoners, gold),
                asyncio.gather(*(runs(code) if code is not None else _no_run() for code in codes)),
            )
            tool_matches = await asyncio.gather(*(self._match(ans, gold) for _, _, ans, _ in executed))
            for c, code, (builds, ok, printed, detail), m in zip(tools, codes, executed, tool_matches, strict=True):
                c.parse_failed = code is None
                c.team_reward = float(m)
                c.local_reward = 0.1 * builds + 0.1 * ok + 0.8 * m
                c.info.update(code=code, printed=printed, detail=detail)
            reasoner, tool = reasoners.best(), tools.best()
            said = reasoner.info["answer"]
            code, printed, detail = tool.info["code"], tool.info["printed"], tool.info["detail"]
            agreed = said is not None and printed is not None and await self._match(printed, said)
            if agreed:
                break
            reasoner_chat += [reasoner.as_message(), user(self._reasoner_feedback(code, printed, detail, said))]
            tool_chat += [tool.as_message(), user(self._tool_feedback(reasoner.text, said, printed))]
        correct = await self._match(said, gold)
        self.metrics["mas/success"] = float(correct)
        self.metrics["mas/math/agreed"] = float(agreed)

    @staticmethod
    async def _execute(code: str) -> tuple[bool, bool, str | None, str]:
        """``(builds, executes, printed answer, what happened)`` for a tool program."""
        built = await check_compiles(code)
        if not built.ok:
            return False, False, None, f"it does not compile: {built.error}"
        result = await run_python(code)
        if not result.ok:
            lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
            why = result.killed_reason or (lines[-1] if lines else f"exit code {result.exit_code}")
            return True, False, None, f"it failed: {_clip(why, 300)}"
        answer = printed_answer(result.stdout)
        return True, True, answer, f"it printed: {_clip(answer or '(nothing)', 300)}"

    @staticmethod
    def _reasoner_feedback(code: str | None, printed: str | None, detail: str, said: str | None) -> str:
        if code is None:
            tool = "The tool agent gave no program."
        else:
            tool = f"The tool agent's program:\n```python\n{_clip(code, 3000)}```\n{detail.capitalize()}."
        mine = f"Your answer was {said}." if said is not None else "Your reply had no \\boxed{} answer."
        return (f"{tool}\n{mine} The answers do not agree. Check both solutions, then give your final answer "
                "in \\boxed{}.")

    @staticmethod
    def _tool_feedback(solution: str, said: str | None, printed: str | None) -> str:
        theirs = f"Its answer: {said}." if said is not None else "It gave no \\boxed{} answer."
        mine = f"Your program's answer was {printed}." if printed is not None else "Your program printed no answer."
        return (f"The reasoner's solution:\n{_clip(solution, 3000)}\n{theirs}\n{mine} The answers do not agree. Check "
                "both, then give a corrected program in one ```python block that prints only the final answer.")


async def _no_run() -> tuple[bool, bool, str | None, str]:
    return False, False, None, "no program"


@register_workflow("math-single-v0")
class MathSingleWorkflow(_MathBase):
    """Single-role baseline: the reasoner alone, one turn, rewarded as the reasoner of ``math-v0``.

    With no second role there is no answer to agree with, so the episode ends (terminated) after the
    first turn, as the paper's single-agent baseline.
    """

    roles = ("reasoner",)

    async def run(self, task: dict[str, Any]) -> None:
        t = check_math_task(task)
        self._setup()
        said: str | None = None
        for _ in self.turns():
            reasoners = await self.generate("reasoner", [system(REASONER_PROMPT), user(f"Problem:\n{t['problem']}")])
            await self._score_reasoners(reasoners, t["answer"])
            said = reasoners.best().info["answer"]
            break
        self.metrics["mas/success"] = float(await self._match(said, t["answer"]))
