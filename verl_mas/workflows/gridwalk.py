"""``gridwalk-v0`` (scout -> walker) and ``gridwalk-single-v0`` (walker alone with both views): small Plan-Path
grids whose information is split between the roles, learnable by a tiny model on CPU.

Game rules, level generation and the split: :mod:`verl_mas.games.gridwalk`. Every prompt is one short user
message of words, one token each with the tailored tokenizer (:attr:`GridwalkWorkflow.vocabulary`):

- scout: ``"scout at 2 3 goal n2 e1 # . . # . . . #"``: the walker's cell, where the goal lies (2 rows up,
  1 column right) and the 8 cells around the walker row by row (``#`` a wall or off the grid, ``.`` floor);
- walker: ``"walker at 2 3 goal n2 e1 scout up"``: the same without the walls, and the move the scout
  proposed this turn (``nothing`` when the scout's answer was no move);
- single agent: ``"walker at 2 3 goal n2 e1 # . . # . . . #"``: what both roles see together.

Answers are one move word: ``up``, ``down``, ``left``, ``right``. Rewards (Plan-Path's, one move at a time):
the scout's ``local`` is the reward its proposal would earn on a copy of the state (the paper's tool reward);
the walker's ``team`` is the reward of its own move (its ``local`` is 0); the committed walker move is
applied. An unparsable answer earns Plan-Path's unparsable penalty and, committed, costs the walker a move
in place. The episode ends when the walker reaches the goal (``mas/success`` 1) or has used its budget of
moves (the shortest length: success means a shortest path).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from verl_mas.chat import user
from verl_mas.games import gridwalk as gw
from verl_mas.games import plan_path as pp
from verl_mas.games.common import draw_for_split, manhattan
from verl_mas.registry import register_workflow
from verl_mas.workflow import Workflow

__all__ = ["GridwalkSingleWorkflow", "GridwalkWorkflow", "possible_prompts", "prompt_overlap", "scout_prompt",
           "walker_prompt"]

#: What the walker hears when the scout's committed answer was no move.
NOTHING = "nothing"


def _where(level: pp.PathLevel, state: pp.PathState) -> str:
    vertical, horizontal = gw.goal_words(state.pos, level.goal)
    return f"at {state.pos[0]} {state.pos[1]} goal {vertical} {horizontal}"


def scout_prompt(level: pp.PathLevel, state: pp.PathState, role: str = "scout") -> str:
    """What the scout sees: the walker's cell, the goal's direction and the walls around the walker."""
    return f"{role} {_where(level, state)} {' '.join(gw.window(level, state.pos))}"


def walker_prompt(level: pp.PathLevel, state: pp.PathState, proposal: str | None) -> str:
    """What the walker sees: its cell, the goal's direction and the scout's proposal; no wall."""
    return f"walker {_where(level, state)} scout {gw.move_word(proposal) if proposal else NOTHING}"


def possible_prompts(task: dict[str, Any]) -> set[str]:
    """Every prompt any episode of ``task`` can render, whatever the models answer: for every floor cell the
    walker can stand on, the scout's, the single agent's and the walker's (after each proposal, or none)."""
    level = pp.PathLevel.from_task(task)
    prompts: set[str] = set()
    for r in range(level.rows):
        for c in range(level.cols):
            if level.is_free((r, c)):
                state = pp.PathState((r, c))
                prompts |= {scout_prompt(level, state), scout_prompt(level, state, role="walker"),
                            *(walker_prompt(level, state, m) for m in (None, *gw.MOVE_WORDS.values()))}
    return prompts


def prompt_overlap(train: list[dict[str, Any]], test: list[dict[str, Any]]) -> tuple[int, int, int]:
    """``(training prompts, held-out prompts, held-out prompts a training task can render)`` over every prompt
    each task can render (:func:`possible_prompts`). 0 shared by construction (the split is by goal cell)."""
    seen = set().union(*map(possible_prompts, train)) if train else set()
    held = set().union(*map(possible_prompts, test)) if test else set()
    return len(seen), len(held), len(seen & held)


def _reward(level: pp.PathLevel, state: pp.PathState, move: str | None) -> float:
    return level.step(state, [move]).reward if move else pp.UNPARSABLE


class _Gridwalk(Workflow):
    #: Every word of every prompt and answer: the tiny model's tokenizer (``--vocab-from gridwalk-v0``).
    vocabulary: ClassVar[tuple[str, ...]] = (
        "scout", "walker", "at", "goal", NOTHING, gw.WALL, gw.FLOOR, *gw.MOVE_WORDS,
        *(str(i) for i in range(max(gw.SIZES))), *gw.offset_words(),
    )
    example_task: ClassVar[Any] = {
        "grid": ["#...", "....", ".#..", ".#.#"], "start": [2, 0], "goal": [0, 2], "shortest": 4,
    }

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """A gridwalk level (:func:`verl_mas.games.gridwalk.generate_level`); held-out levels have goal cells no
        training level has (:func:`~verl_mas.games.gridwalk.split_of_level`)."""
        return draw_for_split(rng, split, gw.generate_level, gw.split_key).to_task()

    @staticmethod
    def load(task: dict[str, Any]) -> pp.PathLevel:
        level = pp.PathLevel.from_task(task)
        problems = gw.level_problems(level)
        if problems:
            raise ValueError(f"gridwalk task {task!r} is not a gridwalk level: {'; '.join(problems)}. Build tasks "
                             "with GridwalkWorkflow.generate_task (python -m verl_mas.data gridwalk-v0).")
        return level

    async def _walk(self, level: pp.PathLevel, state: pp.PathState,
                    prompt: str) -> tuple[str | None, pp.PathState, bool]:
        """The walker's turn: K moves from ``prompt``, each with the reward it earns (team; local 0), the best
        committed. Returns the committed move (None: unparsable, a move spent in place), the state after it, and
        whether it bumped. Ends the episode at the goal or when the budget is spent."""
        walks = await self.generate("walker", [user(prompt)])
        for w in walks:
            move = gw.parse_move(w.text)
            w.parse_failed = move is None
            w.team_reward, w.local_reward = _reward(level, state, move), 0.0
        move = gw.parse_move(walks.best().text)
        step = level.step(state, [move]) if move else None
        state = step.state if step else pp.PathState(state.pos, state.moves_used + 1)
        if level.is_solved(state) or state.moves_used >= gw.budget(level):
            self.terminate()
        return move, state, step is None or step.invalid > 0

    def _finish(self, level: pp.PathLevel, state: pp.PathState, bumps: int, moves: int) -> None:
        self.metrics["mas/success"] = float(level.is_solved(state))
        self.metrics["mas/gridwalk/bumps"] = float(bumps)
        self.metrics["mas/gridwalk/distance_left"] = float(manhattan(state.pos, level.goal))
        self.metrics["mas/gridwalk/moves"] = float(moves)


@register_workflow("gridwalk-v0")
class GridwalkWorkflow(_Gridwalk):
    """A scout that sees the walls around the walker proposes a move; the walker, blind to walls, moves.

    Task: Plan-Path's JSON (``{"grid", "start", "goal", "shortest"}``) of a gridwalk level. Metrics:
    ``mas/success``, ``mas/gridwalk/{bumps,moves,distance_left}``, and ``mas/gridwalk/followed`` (the share
    of the walker's moves that are the scout's proposal) and ``mas/gridwalk/scout_good`` (the share of
    committed proposals that keep a shortest path).
    """

    roles = ("scout", "walker")

    async def run(self, task: dict[str, Any]) -> None:
        level = self.load(task)
        state, bumps, followed, good = level.initial_state(), 0, 0, 0
        for _ in self.turns():
            proposals = await self.generate("scout", [user(scout_prompt(level, state))])
            for c in proposals:
                move = gw.parse_move(c.text)
                c.parse_failed = move is None
                c.local_reward = _reward(level, state, move)
            proposal = gw.parse_move(proposals.best().text)
            good += proposal in gw.good_moves(level, state.pos)

            move, state, bumped = await self._walk(level, state, walker_prompt(level, state, proposal))
            followed += move is not None and move == proposal
            bumps += bumped
        self._finish(level, state, bumps, state.moves_used)
        self.metrics["mas/gridwalk/followed"] = followed / max(state.moves_used, 1)
        self.metrics["mas/gridwalk/scout_good"] = good / max(state.moves_used, 1)


@register_workflow("gridwalk-single-v0")
class GridwalkSingleWorkflow(_Gridwalk):
    """Single-agent baseline of ``gridwalk-v0``: one walker that sees what both roles see (walls and goal).

    Same levels, rewards, budget and metrics (without ``followed``/``scout_good``).
    """

    roles = ("walker",)

    async def run(self, task: dict[str, Any]) -> None:
        level = self.load(task)
        state, bumps = level.initial_state(), 0
        for _ in self.turns():
            _, state, bumped = await self._walk(level, state, scout_prompt(level, state, role="walker"))
            bumps += bumped
        self._finish(level, state, bumps, state.moves_used)
