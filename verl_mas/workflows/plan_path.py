"""``plan-path-v0`` (tool -> planner) and ``plan-path-single-v0`` (planner only): walk a grid to its goal.

Game rules and rewards: :mod:`verl_mas.games.plan_path`. Action: a move list such as
``["U", "R", "R", "D"]`` (or up/down/left/right), applied in one turn.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from verl_mas.games import plan_path as pp
from verl_mas.games.common import draw_for_split, format_moves, parse_moves
from verl_mas.registry import register_workflow
from verl_mas.workflows.tool_planner import ToolPlannerWorkflow

__all__ = ["PlanPathSingleWorkflow", "PlanPathWorkflow"]


@register_workflow("plan-path-v0")
class PlanPathWorkflow(ToolPlannerWorkflow):
    """Plan-Path 10x10 (obstacle ratio 0.22): the tool writes a path finder, the planner commits the moves.

    Task: ``{"grid": [10 rows of '#'/'.'], "start": [r, c], "goal": [r, c], "shortest": n}``.
    """

    game = "Plan-Path"
    penalty = pp.UNPARSABLE
    example_task: ClassVar[Any] = {
        "grid": ["..#.", "..#.", "....", "#..."],
        "start": [0, 0],
        "goal": [0, 3],
        "shortest": 7,
    }

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """A 10x10 grid with obstacle ratio 0.22 and a reachable goal; the split is decided by its content."""
        level = draw_for_split(rng, split, pp.generate_level, lambda lv: repr(lv.to_task()))
        return level.to_task()

    @classmethod
    def load(cls, task: dict[str, Any]) -> pp.PathLevel:
        return pp.PathLevel.from_task(task)

    def parse_action(self, level: pp.PathLevel, text: str) -> list[str] | None:
        return parse_moves(text, max_moves=4 * level.rows * level.cols)

    def format_action(self, action: list[str]) -> str:
        return format_moves(action)

    def rules(self, level: pp.PathLevel) -> str:
        return (f"The {level.rows}x{level.cols} grid has '#' walls and '.' floor; 'P' is you and 'G' the goal. Move "
                "U (row - 1), D (row + 1), L (column - 1) or R (column + 1) to reach G by a shortest path; moves "
                "into walls or off the grid fail.")

    def stdin_format(self, level: pp.PathLevel) -> str:
        return f"{level.rows} lines of {level.cols} characters, exactly the grid shown."

    def answer_format(self, level: pp.PathLevel) -> str:
        return 'a list of moves, e.g. ["U", "R", "R", "D"].'


@register_workflow("plan-path-single-v0")
class PlanPathSingleWorkflow(PlanPathWorkflow):
    """Single-agent baseline of ``plan-path-v0``: the planner alone, same rules and rewards."""

    roles = ("planner",)
