"""Plan-Path game logic (rules v0): grid generation, BFS, the state, moves and their rewards.

A grid of ``rows x cols`` cells, ``#`` walls and ``.`` floor. The walker starts on ``start`` and must
reach ``goal`` moving U/D/L/R; every grid is generated with the goal reachable (BFS) and its shortest
path length known.

Rewards of one action (a move list), applied to a copy of the state (docs/algorithm.md §3):

- per move: -0.01 if valid; -0.10 if invalid (a wall or the border: the walker stays put);
- potential shaping ``0.99 * phi(s') - phi(s)`` with ``phi = -Manhattan(position, goal)``, where ``s``
  and ``s'`` are the states before and after the *whole action*. Deliberate (v0): applied once per
  action, not per move. Per move, a back-and-forth pair at distance d would earn
  ``-0.02 + (0.01 d - 0.99) + (0.01 d + 1) = 0.02 d - 0.01 > 0``, so a long oscillating plan would out-earn
  reaching the goal; per action, the shaping depends only on where the action ends;
- +1.0 on reaching the goal, and +0.5 more if the moves attempted in the whole episode (invalid ones
  included) equal the shortest length, i.e. the walker took a shortest path without a bump.

Moves after the goal is reached are ignored. An unparsable action costs :data:`UNPARSABLE` (one
invalid move).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from verl_mas.games.common import DELTAS, Step, as_cell, manhattan

__all__ = [
    "GAMMA",
    "GOAL_BONUS",
    "INVALID_MOVE",
    "SHORTEST_BONUS",
    "UNPARSABLE",
    "VALID_MOVE",
    "PathLevel",
    "PathState",
    "generate_level",
    "shortest_path",
]

VALID_MOVE = -0.01
INVALID_MOVE = -0.10
GAMMA = 0.99
GOAL_BONUS = 1.0
SHORTEST_BONUS = 0.5
#: Reward of an action that does not parse (counts as one invalid move).
UNPARSABLE = INVALID_MOVE

Cell = tuple[int, int]


@dataclass(frozen=True)
class PathState:
    """Where the walker is and how many moves it attempted so far (for the shortest-path bonus)."""

    pos: Cell
    moves_used: int = 0


@dataclass(frozen=True)
class PathLevel:
    """A Plan-Path grid: walls, start, goal and the shortest path length from start to goal."""

    rows: int
    cols: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell
    shortest: int

    # -- task (JSON) round trip -----------------------------------------------------------------------

    def to_task(self) -> dict[str, Any]:
        """The JSON task: ``{"grid": [".#..", ...], "start": [r, c], "goal": [r, c], "shortest": n}``."""
        grid = ["".join("#" if (r, c) in self.walls else "." for c in range(self.cols)) for r in range(self.rows)]
        return {"grid": grid, "start": list(self.start), "goal": list(self.goal), "shortest": self.shortest}

    @classmethod
    def from_task(cls, task: dict[str, Any]) -> PathLevel:
        """Parse and check a task; raises ValueError listing every problem (with the fix)."""
        problems: list[str] = []
        grid = task.get("grid")
        if not (isinstance(grid, list) and grid and all(isinstance(r, str) for r in grid)):
            raise ValueError(f"plan-path task grid is {grid!r:.80}; it must be a non-empty list of strings of '#' and '.'")
        rows, cols = len(grid), len(grid[0])
        if any(len(r) != cols or set(r) - {"#", "."} for r in grid):
            problems.append("grid rows must all have the same length and contain only '#' and '.'")
        walls = frozenset((r, c) for r in range(rows) for c in range(cols) if grid[r][c] == "#")
        start, goal = as_cell(task.get("start"), "start"), as_cell(task.get("goal"), "goal")
        for name, cell in (("start", start), ("goal", goal)):
            if not (0 <= cell[0] < rows and 0 <= cell[1] < cols) or cell in walls:
                problems.append(f"{name} {list(cell)} is not a floor cell of the {rows}x{cols} grid")
        shortest = task.get("shortest")
        if not problems:
            path = shortest_path(rows, cols, walls, start, goal)
            if path is None:
                problems.append("the goal is not reachable from the start")
            elif shortest != len(path):
                problems.append(f"shortest is {shortest!r} but BFS finds {len(path)}")
        if problems:
            raise ValueError(
                f"invalid plan-path task: {'; '.join(problems)}. Build tasks with PathLevel.to_task() "
                "or PlanPathWorkflow.generate_task."
            )
        return cls(rows, cols, walls, start, goal, int(shortest))  # type: ignore[arg-type]

    # -- rules ---------------------------------------------------------------------------------------

    def initial_state(self) -> PathState:
        """The walker on ``start``, no move used."""
        return PathState(self.start)

    def is_free(self, cell: Cell) -> bool:
        """Inside the grid and not a wall."""
        return 0 <= cell[0] < self.rows and 0 <= cell[1] < self.cols and cell not in self.walls

    def phi(self, cell: Cell) -> float:
        """The shaping potential: minus the Manhattan distance to the goal."""
        return -float(manhattan(cell, self.goal))

    def is_solved(self, state: PathState) -> bool:
        """The walker stands on the goal."""
        return state.pos == self.goal

    def step(self, state: PathState, moves: list[str]) -> Step[PathState]:
        """Apply ``moves`` to a copy of ``state`` and reward them (see the module docstring)."""
        pos, used, valid, invalid = state.pos, state.moves_used, 0, 0
        reward = 0.0
        for move in moves:
            if pos == self.goal:
                break  # moves after reaching the goal are ignored
            used += 1
            dr, dc = DELTAS[move]
            nxt = (pos[0] + dr, pos[1] + dc)
            if self.is_free(nxt):
                pos, valid, reward = nxt, valid + 1, reward + VALID_MOVE
            else:
                invalid, reward = invalid + 1, reward + INVALID_MOVE
        reward += GAMMA * self.phi(pos) - self.phi(state.pos)
        if pos == self.goal and state.pos != self.goal:  # reached during this action
            reward += GOAL_BONUS + (SHORTEST_BONUS if used == self.shortest else 0.0)
        return Step(PathState(pos, used), reward, pos == self.goal, valid, invalid)

    def render(self, state: PathState) -> str:
        """Rows of ``#`` wall, ``.`` floor, ``P`` the walker, ``G`` the goal (``P`` wins when on the goal)."""
        out = []
        for r in range(self.rows):
            row = []
            for c in range(self.cols):
                cell = (r, c)
                row.append("P" if cell == state.pos else "G" if cell == self.goal else "#" if cell in self.walls else ".")
            out.append("".join(row))
        return "\n".join(out)


def shortest_path(rows: int, cols: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> list[str] | None:
    """A shortest move list from ``start`` to ``goal`` by BFS (U, D, L, R expansion order), or None."""
    prev: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves: list[str] = []
            while (link := prev[cell]) is not None:
                cell, move = link
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in DELTAS.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in walls and nxt not in prev:
                prev[nxt] = (cell, move)
                queue.append(nxt)
    return None


def generate_level(rng: random.Random, rows: int = 10, cols: int = 10, obstacle_ratio: float = 0.22) -> PathLevel:
    """A random grid with ``round(obstacle_ratio * rows * cols)`` walls and a reachable goal != start.

    Redraws until BFS connects a random start to a random goal (most draws succeed at ratio 0.22).
    """
    if rows < 1 or cols < 2 or not 0.0 <= obstacle_ratio < 1.0:
        raise ValueError(f"rows={rows}, cols={cols}, obstacle_ratio={obstacle_ratio}: need rows >= 1, cols >= 2, 0 <= ratio < 1")
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    n_walls = min(round(obstacle_ratio * rows * cols), rows * cols - 2)
    while True:
        walls = frozenset(rng.sample(cells, n_walls))
        free = [c for c in cells if c not in walls]
        start, goal = rng.sample(free, 2)
        path = shortest_path(rows, cols, walls, start, goal)
        if path is not None:
            return PathLevel(rows, cols, walls, start, goal, len(path))
