"""The tool -> planner workflow shared by the game workflows (and its planner-only baseline).

Each turn (docs/algorithm.md §3):

1. **tool** sees the state and writes a Python program that reads the state from stdin and prints an
   action. Every candidate's program runs in the sandbox (:func:`verl_mas.sandbox.run_python`), the
   printed action is parsed and scored on a copy of the state: ``local_reward`` = the simulated
   reward of that action (no action -> the game's unparsable penalty and ``parse_failed``).
2. **planner** sees the state, the committed tool program, its output and the action parsed from it
   (same-turn conditioning), and answers with the final action: ``team_reward`` = the reward of its
   action (scored on a copy); only the committed planner action changes the real state.

The tool's ``team_reward`` is left at 0: the turn's team outcome only exists once the planner has
acted, after the tool's candidates are scored. The episode terminates when the game is solved
(``mas/success`` = 1.0) and is truncated after ``max_turns`` turns.

A program that crashes, times out or prints no parsable action is the model's mistake (a reward
decision); a failure of the sandbox itself (:class:`~verl_mas.sandbox.SandboxError`) propagates.
Subclasses supply the game (the pure logic of :mod:`verl_mas.games`) through the hooks at the end of
:class:`ToolPlannerWorkflow`: ``verl_mas.workflows.sudoku``, ``.sokoban`` and ``.plan_path``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from verl_mas.chat import system, user
from verl_mas.games.common import Step
from verl_mas.sandbox import run_python
from verl_mas.workflow import Workflow
from verl_mas.workflows.common import extract_code

logger = logging.getLogger(__name__)

__all__ = ["Proposal", "ToolPlannerWorkflow"]

TOOL_SYSTEM = (
    "You are the tool agent of a two-agent team playing {game}. You write a short Python 3 program "
    "(standard library only) that computes the action, e.g. with BFS or a search. {rules}\n"
    "The program reads the current state from standard input: {stdin}\n"
    "It must print the action: {answer}\n"
    "Reply with the program in one ```python code block."
)
PLANNER_SYSTEM = (
    "You are the planner of a team playing {game}. {rules}\nYour action is final and is applied to the "
    "game. Answer with the action: {answer} Put it at the end of your reply."
)
SINGLE_SYSTEM = "You are playing {game}. {rules}\nAnswer with the action: {answer} Put it at the end of your reply."


@dataclass(frozen=True)
class Proposal:
    """What a tool candidate's program proposed (kept in the candidate's ``info["proposal"]``)."""

    code: str | None
    """The extracted program, or None when the reply had no code block."""
    output: str
    """The program's stdout (truncated), or why there is none."""
    action: Any
    """The parsed action, or None."""


class ToolPlannerWorkflow(Workflow):
    """Base class of the game workflows; subclasses implement the game hooks below.

    Class attributes:
        game: The game's display name in prompts.
        tool_timeout_s: Wall-clock limit of one tool program (seconds).
        max_output_chars: How much of a program's stdout the planner is shown.
    """

    roles: ClassVar[tuple[str, ...]] = ("tool", "planner")
    game: ClassVar[str] = "a game"
    tool_timeout_s: ClassVar[float] = 5.0
    max_output_chars: ClassVar[int] = 1000

    async def run(self, task: dict[str, Any]) -> None:
        level = self.load(task)
        state = level.initial_state()
        if level.is_solved(state):
            self.terminate()
        tool_chat = [system(TOOL_SYSTEM.format(game=self.game, rules=self.rules(level), stdin=self.stdin_format(level),
                                               answer=self.answer_format(level)))]
        for turn in self.turns():
            board = level.render(state)
            where = f"Turn {turn + 1} of {self.max_turns}. Current state:\n{board}\n"
            note = ""
            if "tool" in self.roles:
                tools = await self.generate("tool", [*tool_chat, user(where + "Write the program.")])
                proposals = await asyncio.gather(*(self._propose(level, state, c.text) for c in tools))
                for c, p in zip(tools, proposals, strict=True):
                    c.info["proposal"] = p
                    c.parse_failed = p.action is None
                    c.local_reward = self.penalty if p.action is None else level.step(state, p.action).reward
                note = self._tool_note(tools.best().info["proposal"])
            system_text = PLANNER_SYSTEM if "tool" in self.roles else SINGLE_SYSTEM
            plans = await self.generate("planner", [
                system(system_text.format(game=self.game, rules=self.rules(level), answer=self.answer_format(level))),
                user(where + note + "Your action?"),
            ])
            for c in plans:
                action = self.parse_action(level, c.text)
                step: Step[Any] | None = None if action is None else level.step(state, action)  # on a copy
                c.parse_failed = action is None
                c.team_reward = self.penalty if step is None else step.reward
                c.info["step"] = step
            committed: Step[Any] | None = plans.best().info["step"]
            if committed is not None:  # commit: only the planner's best action changes the real state
                state = committed.state
            if level.is_solved(state):
                self.terminate()
        self.metrics["mas/success"] = float(level.is_solved(state))

    async def _propose(self, level: Any, state: Any, reply: str) -> Proposal:
        """Run the program in ``reply`` on the rendered state and parse the action it prints."""
        code = extract_code(reply)
        if code is None:
            return Proposal(None, "(no ```python code block in the reply)", None)
        result = await run_python(code, stdin=level.render(state) + "\n", timeout_s=self.tool_timeout_s)
        out = result.stdout[-self.max_output_chars :]
        if not result.ok:
            why = f"timed out after {self.tool_timeout_s:g}s" if result.timed_out else (
                f"killed ({result.killed_reason})" if result.killed_reason else f"exit code {result.exit_code}")
            err = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
            logger.debug("%s: tool program failed (%s); it proposes no action", self.game, why)
            return Proposal(code, f"{out}\n[program failed: {why}{': ' + err[0][:200] if err else ''}]", None)
        return Proposal(code, out, self.parse_action(level, result.stdout))

    def _tool_note(self, p: Proposal) -> str:
        code = p.code if p.code is not None else "(none)"
        action = self.format_action(p.action) if p.action is not None else "none (no valid action in the output)"
        return (f"The tool agent wrote this program:\n```python\n{code}\n```\nIts output:\n```\n{p.output.strip()}\n```\n"
                f"Action proposed by the tool: {action}\n")

    # ----------------------------------------------------------------------------------------------
    # Game hooks.

    #: Reward of an action that does not parse (or a tool program that proposes none).
    penalty: ClassVar[float] = -1.0

    @classmethod
    def load(cls, task: dict[str, Any]) -> Any:
        """The level object of ``task``: ``initial_state()``, ``is_solved(s)``, ``step(s, a)``, ``render(s)``."""
        raise NotImplementedError

    def parse_action(self, level: Any, text: str) -> Any:
        """The action written in ``text``, or None when malformed."""
        raise NotImplementedError

    def format_action(self, action: Any) -> str:
        """An action in the answer format."""
        raise NotImplementedError

    def rules(self, level: Any) -> str:
        """The rules and symbols, one short paragraph."""
        raise NotImplementedError

    def stdin_format(self, level: Any) -> str:
        """What the tool program reads from stdin."""
        raise NotImplementedError

    def answer_format(self, level: Any) -> str:
        """The action format, with an example."""
        raise NotImplementedError
