"""``sudoku-v0`` / ``sudoku-9x9-v0`` (tool -> planner) and ``sudoku-single-v0`` (planner only).

Game rules and rewards: :mod:`verl_mas.games.sudoku`. Action: the grid, one row of digits
per line (``0`` = leave empty), e.g. for 4x4::

    1234
    3412
    2143
    4321
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from verl_mas.games import sudoku as sd
from verl_mas.games.common import draw_for_split
from verl_mas.registry import register_workflow
from verl_mas.workflows.tool_planner import ToolPlannerWorkflow

__all__ = ["Sudoku9Workflow", "SudokuSingleWorkflow", "SudokuWorkflow"]


@register_workflow("sudoku-v0")
class SudokuWorkflow(ToolPlannerWorkflow):
    """Sudoku (4x4 tasks generated; any 4x4 or 9x9 task runs): the tool writes a solver, the planner commits a grid.

    Task: ``{"size": 4, "puzzle": ["0020", ...], "solution": ["3124", ...]}``. Train and test puzzles
    come from disjoint sets of *solution grids* (:func:`~verl_mas.games.common.split_of`), so
    no test puzzle shares its solution with a training puzzle.
    """

    game = "Sudoku"
    penalty = sd.INVALID
    grid_size: ClassVar[int] = 4
    example_task: ClassVar[Any] = {"size": 4, "puzzle": ["0020", "2010", "1300", "0200"],
                                   "solution": ["3124", "2413", "1342", "4231"]}

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """A puzzle with a unique solution, from the split that owns its solution grid."""
        puzzle = draw_for_split(rng, split, lambda r: sd.generate_puzzle(r, cls.grid_size),
                                lambda p: "".join(sd.rows_of(p.solution)))
        return puzzle.to_task()

    @classmethod
    def load(cls, task: dict[str, Any]) -> sd.SudokuPuzzle:
        return sd.SudokuPuzzle.from_task(task)

    def parse_action(self, level: sd.SudokuPuzzle, text: str) -> sd.Grid | None:
        return sd.parse_grid(text, level.n)

    def format_action(self, action: sd.Grid) -> str:
        return "\n" + "\n".join(sd.rows_of(action))

    def rules(self, level: sd.SudokuPuzzle) -> str:
        n, b = level.n, sd.box_size(level.n)
        return (f"Fill the {n}x{n} grid ('0' = empty) so that every row, every column and every {b}x{b} box holds "
                f"the digits 1-{n} once. Never change a given digit.")

    def stdin_format(self, level: sd.SudokuPuzzle) -> str:
        return f"{level.n} lines of {level.n} digits, exactly the grid shown."

    def answer_format(self, level: sd.SudokuPuzzle) -> str:
        example = "\n".join(["1234", "3412", "2143", "4321"]) if level.n == 4 else "9 lines of 9 digits"
        return f"the whole grid, one line of {level.n} digits per row ('0' for a cell left empty), e.g.\n{example}\n"


@register_workflow("sudoku-9x9-v0")
class Sudoku9Workflow(SudokuWorkflow):
    """``sudoku-v0`` whose task generator draws 9x9 puzzles (same rules, rewards and roles)."""

    grid_size = 9


@register_workflow("sudoku-single-v0")
class SudokuSingleWorkflow(SudokuWorkflow):
    """Single-agent baseline of ``sudoku-v0``: the planner alone, same rules and rewards."""

    roles = ("planner",)
