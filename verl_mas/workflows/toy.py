"""Two tiny example workflows for docs, tests and the CLI; they teach the API, not a skill.

- ``toy-walk-v0`` (:class:`WalkWorkflow`): sequential roles. A planner names a direction on a number
  line, then a mover, who sees the plan committed in the same turn, moves. The planner's chat continues
  across turns with its own committed answers (token ids spliced in unchanged).
- ``toy-agree-v0`` (:class:`AgreeWorkflow`): simultaneous roles. Alice and Bob each name a word at the
  same time; each is rewarded for naming what the other said last turn, and the episode ends when they
  agree.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl_mas.chat import system, user
from verl_mas.registry import register_workflow
from verl_mas.workflow import Workflow

__all__ = ["AgreeWorkflow", "WalkWorkflow", "parse_move", "parse_word"]

# ---------------------------------------------------------------------------------------------------
# Pure task logic.

MOVES: dict[str, int] = {"left": -1, "right": 1}


def parse_move(text: str) -> int | None:
    """``"left"`` -> -1, ``"right"`` -> +1 (case and surrounding space ignored), anything else -> None."""
    return MOVES.get(text.strip().lower())


def parse_word(text: str, words: list[str]) -> str | None:
    """The word if ``text`` is exactly one of ``words`` (case and surrounding space ignored), else None."""
    word = text.strip().lower()
    return word if word in words else None


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


# ---------------------------------------------------------------------------------------------------
# Workflows.


@register_workflow("toy-walk-v0")
class WalkWorkflow(Workflow):
    """Planner then mover on a number line; reach ``task["goal"]`` from ``task["start"]``.

    Rewards (per turn, immediate; scored on a copy of the position, only the committed move applies):

    - planner: ``local = 1`` if its direction points toward the goal, else 0.
    - mover: ``team = 1`` if its move reaches the goal; ``local = 0.5 * [move == committed plan]
      + 0.25 * (distance before - distance after)``; ``reward = alpha * team + local``.

    Unparsable answers get the floor reward of their role and ``parse_failed``.
    """

    roles = ("planner", "mover")
    example_task = {"start": 0, "goal": 2}

    PLANNER_PROMPT = "You plan moves on a number line. Answer with one word: left or right."
    MOVER_PROMPT = "You move on a number line. Answer with one word: left or right."

    async def run(self, task: dict[str, Any]) -> None:
        pos, goal = int(task["start"]), int(task["goal"])
        planner_chat = [system(self.PLANNER_PROMPT), user(f"You are at {pos}; the goal is {goal}. Which way?")]
        if pos == goal:
            self.terminate()
        for _ in self.turns():
            plans = await self.generate("planner", planner_chat)
            for p in plans:
                step = parse_move(p.text)
                p.parse_failed = step is None
                p.local_reward = 1.0 if step == _sign(goal - pos) else 0.0
            plan = plans.best()
            plan_step = parse_move(plan.text)

            # Same-turn conditioning: the mover's prompt holds the plan committed a moment ago.
            said = plan.text.strip() if plan_step is not None else "(nothing useful)"
            moves = await self.generate(
                "mover",
                [
                    system(self.MOVER_PROMPT),
                    user(f"You are at {pos}; the goal is {goal}. The planner says: {said}. Your move?"),
                ],
            )
            for m in moves:
                step = parse_move(m.text)
                m.parse_failed = step is None
                new_pos = pos + (step or 0)  # a clone of the state: `pos` only changes on commit
                m.team_reward = 1.0 if new_pos == goal else 0.0
                m.local_reward = 0.5 * (step is not None and step == plan_step) + 0.25 * (
                    abs(goal - pos) - abs(goal - new_pos)
                )
            move = moves.best()
            pos += parse_move(move.text) or 0  # commit: only the best move changes the real state

            planner_chat += [
                plan.as_message(),
                user(f"The mover answered {move.text.strip()!r}. You are at {pos}. Which way?"),
            ]
            if pos == goal:
                self.terminate()
        self.metrics["mas/success"] = float(pos == goal)


@register_workflow("toy-agree-v0")
class AgreeWorkflow(Workflow):
    """Alice and Bob name words simultaneously until they name the same one.

    Rewards (both roles, scored against the same state, the words committed last turn):
    ``local = 0.5`` for a valid word; ``team = 1`` if the word equals what the other role committed
    last turn; ``reward = alpha * team + local``.
    """

    roles = ("alice", "bob")
    example_task = {"words": ["red", "green", "blue"]}

    async def run(self, task: dict[str, Any]) -> None:
        words = [w.lower() for w in task["words"]]
        last: dict[str, str | None] = {"alice": None, "bob": None}
        other = {"alice": "bob", "bob": "alice"}

        def chat(role: str) -> list[dict[str, Any]]:
            heard = last[other[role]] or "nothing yet"
            return [
                system(f"You are {role}. Answer with one word from: {', '.join(words)}."),
                user(f"Last turn {other[role]} said: {heard}. Try to say the same word as {other[role]}."),
            ]

        for _ in self.turns():
            # Simultaneous: both roles act on the same state; neither sees the other's new word.
            groups = await asyncio.gather(*(self.generate(role, chat(role)) for role in self.roles))
            for role, group in zip(self.roles, groups, strict=True):
                for c in group:
                    word = parse_word(c.text, words)
                    c.parse_failed = word is None
                    c.local_reward = 0.5 if word is not None else 0.0
                    c.team_reward = 1.0 if word is not None and word == last[other[role]] else 0.0
            for role, group in zip(self.roles, groups, strict=True):
                last[role] = parse_word(group.best().text, words)
            if last["alice"] is not None and last["alice"] == last["bob"]:
                self.terminate()
        self.metrics["mas/success"] = float(last["alice"] is not None and last["alice"] == last["bob"])
