"""Sokoban game logic (rules v0): levels by reverse play, a BFS solver, the state, moves and rewards.

A walled room (default 6x6, one box). The player moves U/D/L/R and pushes a box by walking into it
when the cell behind the box is free; boxes cannot be pulled. Solved when every box is on a goal.

Symbols (tasks, prompts and the tool's stdin): ``#`` wall, ``_`` floor, ``O`` goal, ``X`` box,
``*`` box on a goal, ``P`` player, ``S`` player on a goal.

Rewards of one action (a move list), applied to a copy of the state (docs/algorithm.md §3):

- per move: -0.01 if valid, -0.05 if invalid (into a wall, or pushing a box into a wall or a box);
- +1.0 for each push of a box onto a goal, -0.5 for each push of a box off a goal;
- shaping on the box-to-goal distance, once per action (as Plan-Path, for the same reason):
  ``0.1 * (D(s) - D(s'))`` where ``D`` sums, over boxes, the Manhattan distance to the nearest goal
  (deliberate v0 choice: weight 0.1 so the spec's event rewards dominate; undiscounted, so an action
  that moves no box earns no shaping);
- +10 on solving. Moves after the level is solved are ignored.

With several boxes, pushing one box on and off a goal repeatedly nets +0.5 per cycle (the spec's
asymmetric +1.0/-0.5); with the default single box the first push onto the goal solves the level, so
this cannot happen. An unparsable action costs :data:`UNPARSABLE` (one invalid move).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from verl_mas.games.common import DELTAS, Step, manhattan

__all__ = [
    "BOX_OFF_GOAL",
    "BOX_ON_GOAL",
    "INVALID_MOVE",
    "SHAPING",
    "SOLVED_BONUS",
    "UNPARSABLE",
    "VALID_MOVE",
    "SokobanLevel",
    "SokobanState",
    "generate_level",
    "solve",
]

VALID_MOVE = -0.01
INVALID_MOVE = -0.05
BOX_ON_GOAL = 1.0
BOX_OFF_GOAL = -0.5
SHAPING = 0.1
SOLVED_BONUS = 10.0
UNPARSABLE = INVALID_MOVE

Cell = tuple[int, int]


@dataclass(frozen=True)
class SokobanState:
    """The player's cell and the boxes' cells."""

    player: Cell
    boxes: frozenset[Cell]


@dataclass(frozen=True)
class SokobanLevel:
    """The static part of a level (walls, goals, size), its start state and its optimal move count."""

    rows: int
    cols: int
    walls: frozenset[Cell]
    goals: frozenset[Cell]
    start: SokobanState
    optimal: int

    def to_task(self) -> dict[str, Any]:
        """The JSON task: ``{"level": ["######", "#_PX_#", ...], "optimal": n}``."""
        return {"level": self.render(self.start).split("\n"), "optimal": self.optimal}

    @classmethod
    def from_task(cls, task: dict[str, Any]) -> SokobanLevel:
        """Parse and check a task (solvable, optimal length right); raises ValueError naming the problem."""
        rows_ = task.get("level")
        if not (isinstance(rows_, list) and rows_ and all(isinstance(r, str) for r in rows_)):
            raise ValueError(f"sokoban task level is {rows_!r:.80}; it must be a non-empty list of strings")
        rows, cols = len(rows_), len(rows_[0])
        walls, goals, boxes, players = set(), set(), set(), []
        for r, line in enumerate(rows_):
            if len(line) != cols or set(line) - set("#_OX*PS"):
                raise ValueError(f"sokoban level row {r} is {line!r}; rows need equal length and symbols from '#_OX*PS'")
            for c, ch in enumerate(line):
                cell = (r, c)
                walls.update([cell] if ch == "#" else [])
                goals.update([cell] if ch in "O*S" else [])
                boxes.update([cell] if ch in "X*" else [])
                players.extend([cell] if ch in "PS" else [])
        if len(players) != 1 or not boxes or len(boxes) != len(goals):
            raise ValueError(
                f"sokoban level {rows_!r} has {len(players)} players, {len(boxes)} boxes and {len(goals)} goals; "
                "it needs one player and as many goals as boxes (at least one)."
            )
        level = cls(rows, cols, frozenset(walls), frozenset(goals), SokobanState(players[0], frozenset(boxes)), 0)
        plan = solve(level, level.start)
        if plan is None or task.get("optimal") != len(plan):
            raise ValueError(
                f"sokoban task optimal is {task.get('optimal')!r} but the solver finds "
                f"{'no solution' if plan is None else len(plan)}; build tasks with SokobanWorkflow.generate_task"
            )
        return cls(rows, cols, level.walls, level.goals, level.start, len(plan))

    # -- rules ---------------------------------------------------------------------------------------

    def initial_state(self) -> SokobanState:
        """The level's start state."""
        return self.start

    def is_floor(self, cell: Cell) -> bool:
        """Inside the room and not a wall."""
        return 0 <= cell[0] < self.rows and 0 <= cell[1] < self.cols and cell not in self.walls

    def is_solved(self, state: SokobanState) -> bool:
        """Every box is on a goal."""
        return state.boxes <= self.goals

    def box_distance(self, boxes: frozenset[Cell]) -> int:
        """D: the sum over boxes of the Manhattan distance to the nearest goal."""
        return sum(min(manhattan(b, g) for g in self.goals) for b in boxes)

    def move(self, state: SokobanState, move: str) -> SokobanState | None:
        """The state after one move, or None when the move is invalid (blocked)."""
        dr, dc = DELTAS[move]
        nxt = (state.player[0] + dr, state.player[1] + dc)
        if not self.is_floor(nxt):
            return None
        if nxt not in state.boxes:
            return SokobanState(nxt, state.boxes)
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if not self.is_floor(beyond) or beyond in state.boxes:
            return None
        return SokobanState(nxt, (state.boxes - {nxt}) | {beyond})

    def step(self, state: SokobanState, moves: list[str]) -> Step[SokobanState]:
        """Apply ``moves`` to a copy of ``state`` and reward them (see the module docstring)."""
        cur, reward, valid, invalid = state, 0.0, 0, 0
        for move in moves:
            if self.is_solved(cur):
                break  # moves after solving are ignored
            nxt = self.move(cur, move)
            if nxt is None:
                invalid, reward = invalid + 1, reward + INVALID_MOVE
                continue
            valid, reward = valid + 1, reward + VALID_MOVE
            for box in nxt.boxes - cur.boxes:  # at most one box moves per move
                reward += BOX_ON_GOAL if box in self.goals else 0.0
            for box in cur.boxes - nxt.boxes:
                reward += BOX_OFF_GOAL if box in self.goals else 0.0
            cur = nxt
        reward += SHAPING * (self.box_distance(state.boxes) - self.box_distance(cur.boxes))
        if self.is_solved(cur) and not self.is_solved(state):
            reward += SOLVED_BONUS
        return Step(cur, reward, self.is_solved(cur), valid, invalid)

    def render(self, state: SokobanState) -> str:
        """Rows of the symbols listed in the module docstring."""
        out = []
        for r in range(self.rows):
            row = []
            for c in range(self.cols):
                cell, goal = (r, c), (r, c) in self.goals
                if cell in self.walls:
                    row.append("#")
                elif cell == state.player:
                    row.append("S" if goal else "P")
                elif cell in state.boxes:
                    row.append("*" if goal else "X")
                else:
                    row.append("O" if goal else "_")
            out.append("".join(row))
        return "\n".join(out)


def solve(level: SokobanLevel, state: SokobanState, max_states: int = 200_000) -> list[str] | None:
    """A shortest move list solving ``level`` from ``state`` (BFS over (player, boxes)), or None.

    Raises:
        RuntimeError: When more than ``max_states`` states are explored (a level too large for BFS).
    """
    prev: dict[SokobanState, tuple[SokobanState, str] | None] = {state: None}
    queue = deque([state])
    while queue:
        cur = queue.popleft()
        if level.is_solved(cur):
            moves: list[str] = []
            while (link := prev[cur]) is not None:
                cur, move = link
                moves.append(move)
            return moves[::-1]
        for move in DELTAS:
            nxt = level.move(cur, move)
            if nxt is not None and nxt not in prev:
                prev[nxt] = (cur, move)
                queue.append(nxt)
        if len(prev) > max_states:
            raise RuntimeError(f"sokoban BFS explored over {max_states} states; use a smaller room or fewer boxes")
    return None


def _room(rng: random.Random, rows: int, cols: int, inner_walls: int) -> tuple[frozenset[Cell], list[Cell]]:
    """Border walls plus ``inner_walls`` random interior walls that keep the floor connected."""
    border = {(r, c) for r in range(rows) for c in range(cols) if r in (0, rows - 1) or c in (0, cols - 1)}
    interior = [(r, c) for r in range(1, rows - 1) for c in range(1, cols - 1)]
    while True:
        extra = set(rng.sample(interior, inner_walls))
        floor = [c for c in interior if c not in extra]
        seen, todo = {floor[0]}, [floor[0]]
        while todo:
            r, c = todo.pop()
            for dr, dc in DELTAS.values():
                n = (r + dr, c + dc)
                if n in floor and n not in seen:
                    seen.add(n)
                    todo.append(n)
        if len(seen) == len(floor):
            return frozenset(border | extra), floor


def generate_level(
    rng: random.Random, rows: int = 6, cols: int = 6, boxes: int = 1, inner_walls: int = 2, reverse_steps: int = 30,
    min_moves: int = 4,
) -> SokobanLevel:
    """A solvable level made by reverse play, with its optimal solution length from the solver.

    Boxes start on the goals; the player then walks ``reverse_steps`` random steps backwards, pulling
    an adjacent box along when it steps away from one (with probability 1/2). Every pull undoes a
    legal push, so the resulting state is solvable; the BFS solver confirms it and measures the optimal
    length. Levels that end with a box still on its goal, or that solve in fewer than ``min_moves``
    moves, are redrawn.
    """
    if rows < 4 or cols < 4 or boxes < 1:
        raise ValueError(f"rows={rows}, cols={cols}, boxes={boxes}: a room needs rows, cols >= 4 and at least one box")
    while True:
        walls, floor = _room(rng, rows, cols, inner_walls)
        if len(floor) < boxes + 2:
            continue
        picked = rng.sample(floor, boxes + 1)
        goals, player = frozenset(picked[:boxes]), picked[boxes]
        box_set = set(goals)
        for _ in range(reverse_steps):
            move = rng.choice("UDLR")
            dr, dc = DELTAS[move]
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in walls or nxt in box_set:
                continue
            behind = (player[0] - dr, player[1] - dc)
            if behind in box_set and rng.random() < 0.5:
                box_set.remove(behind)
                box_set.add(player)
            player = nxt
        start = SokobanState(player, frozenset(box_set))
        if start.boxes & goals:
            continue
        level = SokobanLevel(rows, cols, walls, goals, start, 0)
        plan = solve(level, start)
        if plan is None:  # cannot happen by construction; the solver is the check
            raise RuntimeError(f"reverse play produced an unsolvable level:\n{level.render(start)}")
        if len(plan) < min_moves:
            continue
        return SokobanLevel(rows, cols, walls, goals, start, len(plan))
