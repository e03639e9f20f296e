"""Sudoku game logic (rules v0): puzzles with a unique solution, a solver, the state, actions, rewards.

An ``n x n`` grid (n = 4 as in the paper, or 9) with ``b x b`` boxes (b = sqrt(n)); ``0`` is an empty
cell. A grid is **solved** when it is complete, keeps every clue of the puzzle, and every row, column
and box holds 1..n once (docs/algorithm.md §5, pitfall 5: a valid grid that changes a clue is not a solution).

An action is a grid of the same shape (``0`` = leave the cell empty). Rewards of one action, applied to
a copy of the state (deliberate v0 choices):

- an action that changes a clue (or does not parse) is rejected: the state is unchanged and the
  reward is :data:`INVALID` = -1.0, the floor of every other outcome (see below);
- otherwise the grid becomes the action's grid and the reward is
  ``1.0 * [solved] + 0.5 * (phi(s') - phi(s))``, where ``phi = (correct - wrong) / E`` over the ``E``
  non-clue cells (correct/wrong against the unique solution; empty cells count 0). ``phi`` lies in
  [-1, 1], so an accepted action earns at least -1.0 and submitting the solution is the best action.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from verl_mas.games.common import Step

__all__ = [
    "INVALID",
    "PROGRESS_WEIGHT",
    "SOLVED_BONUS",
    "Grid",
    "SudokuPuzzle",
    "count_solutions",
    "generate_puzzle",
    "grid_from_rows",
    "is_valid_complete",
    "parse_grid",
    "solve",
]

SOLVED_BONUS = 1.0
PROGRESS_WEIGHT = 0.5
INVALID = -1.0
#: Default number of emptied cells per size (fewer when uniqueness stops the removal earlier).
DEFAULT_HOLES = {4: 10, 9: 50}

Grid = tuple[tuple[int, ...], ...]
_ROW_STRIP = str.maketrans("", "", " \t,|[]'\"")


def box_size(n: int) -> int:
    """b with b * b == n; raises ValueError for sizes that are not perfect squares >= 4."""
    b = math.isqrt(n)
    if b < 2 or b * b != n:
        raise ValueError(f"sudoku size {n} is not a perfect square >= 4; use 4 or 9")
    return b


def grid_from_rows(rows: list[str]) -> Grid:
    """``["1020", ...]`` -> a grid of ints (``0`` or ``.`` empty). Raises ValueError for a bad shape."""
    n = len(rows)
    if any(len(r) != n or set(r) - set(".0123456789") for r in rows):
        raise ValueError(f"sudoku rows {rows!r} must be {n} strings of {n} digits each ('0' or '.' for empty)")
    return tuple(tuple(0 if ch == "." else int(ch) for ch in r) for r in rows)


def rows_of(grid: Grid) -> list[str]:
    """A grid as rows of digits (``0`` empty), the task and stdin format."""
    return ["".join(str(v) for v in row) for row in grid]


def parse_grid(text: str, n: int) -> Grid | None:
    """The last ``n`` grid rows written in ``text``, or None.

    A line is a row when, without spaces, commas, ``|``, brackets and quotes, it is ``n`` cells from
    ``0-9`` or ``.`` (``"1 2 | 3 4"``, ``"[1, 2, 3, 4],"``); a line of ``n * n`` cells is a whole grid
    (``[[1,2,3,4],[3,4,1,2],...]`` on one line). Values above ``n`` make the grid malformed.
    """
    rows: list[str] = []
    for line in text.splitlines():
        cells = line.translate(_ROW_STRIP)
        if not cells or set(cells) - set(".0123456789"):
            continue
        if len(cells) == n:
            rows.append(cells)
        elif len(cells) == n * n:
            rows.extend(cells[i : i + n] for i in range(0, n * n, n))
    if len(rows) < n:
        return None
    grid = grid_from_rows(rows[-n:])
    if any(v > n for row in grid for v in row):
        return None
    return grid


def _units(n: int) -> list[list[tuple[int, int]]]:
    b = box_size(n)
    units = [[(r, c) for c in range(n)] for r in range(n)] + [[(r, c) for r in range(n)] for c in range(n)]
    units += [[(br + i, bc + j) for i in range(b) for j in range(b)] for br in range(0, n, b) for bc in range(0, n, b)]
    return units


def is_valid_complete(grid: Grid) -> bool:
    """Every row, column and box holds 1..n exactly once (clues are not considered here)."""
    n = len(grid)
    want = set(range(1, n + 1))
    return all({grid[r][c] for r, c in unit} == want for unit in _units(n))


def _solutions(grid: Grid, limit: int, rng: random.Random | None = None) -> list[Grid]:
    """Up to ``limit`` solutions by backtracking on the most constrained cell (bit masks)."""
    n, b = len(grid), box_size(len(grid))
    full = (1 << (n + 1)) - 2  # bits 1..n
    cells = [list(row) for row in grid]
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    for r in range(n):
        for c in range(n):
            v = cells[r][c]
            if v:
                bit, k = 1 << v, (r // b) * b + c // b
                if rows[r] & bit or cols[c] & bit or boxes[k] & bit:
                    return []  # the givens already conflict
                rows[r] |= bit
                cols[c] |= bit
                boxes[k] |= bit
    found: list[Grid] = []

    def search() -> None:
        best, best_opts = None, 0
        for r in range(n):
            for c in range(n):
                if not cells[r][c]:
                    opts = full & ~(rows[r] | cols[c] | boxes[(r // b) * b + c // b])
                    if best is None or opts.bit_count() < best_opts.bit_count():
                        best, best_opts = (r, c), opts
                        if opts.bit_count() <= 1:
                            break
            if best is not None and best_opts.bit_count() <= 1:
                break
        if best is None:
            found.append(tuple(tuple(row) for row in cells))
            return
        r, c = best
        k = (r // b) * b + c // b
        values = [v for v in range(1, n + 1) if best_opts >> v & 1]
        if rng is not None:
            rng.shuffle(values)
        for v in values:
            bit = 1 << v
            cells[r][c] = v
            rows[r] |= bit
            cols[c] |= bit
            boxes[k] |= bit
            search()
            cells[r][c] = 0
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[k] &= ~bit
            if len(found) >= limit:
                return

    search()
    return found


def solve(grid: Grid) -> Grid | None:
    """One solution of ``grid`` (0 = empty), or None."""
    sols = _solutions(grid, 1)
    return sols[0] if sols else None


def count_solutions(grid: Grid, limit: int = 2) -> int:
    """The number of solutions, counting no further than ``limit`` (2 suffices to test uniqueness)."""
    return len(_solutions(grid, limit))


@dataclass(frozen=True)
class SudokuPuzzle:
    """A puzzle (clues, ``0`` empty) and its unique solution."""

    puzzle: Grid
    solution: Grid

    @property
    def n(self) -> int:
        """Grid size."""
        return len(self.puzzle)

    def to_task(self) -> dict[str, Any]:
        """The JSON task: ``{"size": 4, "puzzle": ["1000", ...], "solution": ["1234", ...]}``."""
        return {"size": self.n, "puzzle": rows_of(self.puzzle), "solution": rows_of(self.solution)}

    @classmethod
    def from_task(cls, task: dict[str, Any]) -> SudokuPuzzle:
        """Parse and check a task: the solution is valid, keeps the clues and is unique."""
        try:
            puzzle, solution = grid_from_rows(task["puzzle"]), grid_from_rows(task["solution"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"sudoku task {task!r:.120} needs 'puzzle' and 'solution' lists of digit rows") from e
        problems = []
        if len(puzzle) != len(solution) or task.get("size", len(puzzle)) != len(puzzle):
            problems.append("size, puzzle and solution disagree on the grid size")
        elif not cls(puzzle, solution).is_solved(solution):
            problems.append("the solution is not a valid grid that keeps every clue")
        elif count_solutions(puzzle) != 1:
            problems.append("the puzzle does not have a unique solution")
        if problems:
            raise ValueError(f"invalid sudoku task: {'; '.join(problems)}. Build tasks with SudokuWorkflow.generate_task")
        return cls(puzzle, solution)

    # -- rules ---------------------------------------------------------------------------------------

    def initial_state(self) -> Grid:
        """The puzzle itself."""
        return self.puzzle

    def keeps_clues(self, grid: Grid) -> bool:
        """Every clue cell of the puzzle holds its clue in ``grid``."""
        n = self.n
        return all(grid[r][c] == v for r in range(n) for c in range(n) if (v := self.puzzle[r][c]))

    def is_solved(self, grid: Grid) -> bool:
        """Complete, keeps every clue, and every row, column and box holds 1..n once."""
        return len(grid) == self.n and self.keeps_clues(grid) and is_valid_complete(grid)

    def phi(self, grid: Grid) -> float:
        """(correct - wrong) / E over the E non-clue cells."""
        n, score, empty = self.n, 0, 0
        for r in range(n):
            for c in range(n):
                if self.puzzle[r][c]:
                    continue
                empty += 1
                v = grid[r][c]
                score += 0 if not v else 1 if v == self.solution[r][c] else -1
        return score / empty if empty else 0.0

    def step(self, state: Grid, action: Grid) -> Step[Grid]:
        """Apply ``action`` (a full or partial grid) to a copy of ``state``; see the module docstring."""
        if len(action) != self.n or not self.keeps_clues(action):
            return Step(state, INVALID, self.is_solved(state), valid=0, invalid=1)
        solved = self.is_solved(action)
        reward = SOLVED_BONUS * solved + PROGRESS_WEIGHT * (self.phi(action) - self.phi(state))
        return Step(action, reward, solved, valid=1, invalid=0)

    def render(self, state: Grid) -> str:
        """Rows of digits, ``0`` for empty."""
        return "\n".join(rows_of(state))


def _random_solution(rng: random.Random, n: int) -> Grid:
    sol = _solutions(tuple((0,) * n for _ in range(n)), 1, rng)
    return sol[0]


def generate_puzzle(rng: random.Random, n: int = 4, holes: int | None = None) -> SudokuPuzzle:
    """A random puzzle with a unique solution: a random full grid, then cells emptied in random order.

    A cell is emptied only when the puzzle keeps a unique solution (checked by the solver), up to
    ``holes`` empty cells (default :data:`DEFAULT_HOLES`).
    """
    box_size(n)
    target = DEFAULT_HOLES.get(n, n * n // 2) if holes is None else holes
    solution = _random_solution(rng, n)
    grid = [list(row) for row in solution]
    order = [(r, c) for r in range(n) for c in range(n)]
    rng.shuffle(order)
    emptied = 0
    for r, c in order:
        if emptied >= target:
            break
        keep, grid[r][c] = grid[r][c], 0
        if count_solutions(tuple(tuple(row) for row in grid)) == 1:
            emptied += 1
        else:
            grid[r][c] = keep
    return SudokuPuzzle(tuple(tuple(row) for row in grid), solution)
