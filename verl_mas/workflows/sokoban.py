"""``sokoban-v0`` (tool -> planner) and ``sokoban-single-v0`` (planner only): push the boxes onto goals.

Game rules and rewards: :mod:`verl_mas.games.sokoban`. Action: a move list such as
``["U", "R", "R", "D"]`` (or up/down/left/right), applied in one turn.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from verl_mas.games import sokoban as sk
from verl_mas.games.common import draw_for_split, format_moves, parse_moves
from verl_mas.registry import register_workflow
from verl_mas.workflows.tool_planner import ToolPlannerWorkflow

__all__ = ["SokobanSingleWorkflow", "SokobanWorkflow"]


@register_workflow("sokoban-v0")
class SokobanWorkflow(ToolPlannerWorkflow):
    """Sokoban 6x6 with one box: the tool writes a solver, the planner commits the moves.

    Task: ``{"level": [6 rows of '#_OX*PS'], "optimal": n}``. Class attributes set the generated rooms.
    """

    game = "Sokoban"
    penalty = sk.UNPARSABLE
    room_size: ClassVar[int] = 6
    num_boxes: ClassVar[int] = 1
    example_task: ClassVar[Any] = {"level": ["#####", "#P_O#", "#_X_#", "#___#", "#####"], "optimal": 5}

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """A level made by reverse play and solved by BFS; the split is decided by the level's content."""
        level = draw_for_split(
            rng, split, lambda r: sk.generate_level(r, cls.room_size, cls.room_size, cls.num_boxes),
            lambda lv: repr(lv.to_task()),
        )
        return level.to_task()

    @classmethod
    def load(cls, task: dict[str, Any]) -> sk.SokobanLevel:
        return sk.SokobanLevel.from_task(task)

    def parse_action(self, level: sk.SokobanLevel, text: str) -> list[str] | None:
        return parse_moves(text, max_moves=4 * level.rows * level.cols)

    def format_action(self, action: list[str]) -> str:
        return format_moves(action)

    def rules(self, level: sk.SokobanLevel) -> str:
        return ("Symbols: '#' wall, '_' floor, 'O' goal, 'X' box, '*' box on a goal, 'P' you, 'S' you on a goal. "
                "Move U (row - 1), D (row + 1), L (column - 1) or R (column + 1); walking into a box pushes it if "
                "the cell behind it is free. Boxes cannot be pulled. Put every box on a goal in as few moves as "
                "possible.")

    def stdin_format(self, level: sk.SokobanLevel) -> str:
        return f"{level.rows} lines of {level.cols} symbols, exactly the room shown."

    def answer_format(self, level: sk.SokobanLevel) -> str:
        return 'a list of moves, e.g. ["U", "R", "R", "D"].'


@register_workflow("sokoban-single-v0")
class SokobanSingleWorkflow(SokobanWorkflow):
    """Single-agent baseline of ``sokoban-v0``: the planner alone, same rules and rewards."""

    roles = ("planner",)
