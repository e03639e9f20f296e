"""Workflows shipped with verl_mas, resolved lazily by id (importing this package imports none of them).

Add a built-in workflow by decorating its class with ``@register_workflow("name-v0")`` in a module of
this package and adding ``"name-v0": "verl_mas.workflows.<module>:<Class>"`` to the table below.
"""

from __future__ import annotations

__all__ = ["BUILTIN_WORKFLOWS"]

#: Built-in workflow ids and where their classes live ("module:Class"), imported on first lookup.
BUILTIN_WORKFLOWS: dict[str, str] = {
    "toy-walk-v0": "verl_mas.workflows.toy:WalkWorkflow",
    "toy-agree-v0": "verl_mas.workflows.toy:AgreeWorkflow",
    "relay-v0": "verl_mas.workflows.relay:RelayWorkflow",
    "relay-chain-v0": "verl_mas.workflows.relay:RelayChainWorkflow",
    "sudoku-v0": "verl_mas.workflows.sudoku:SudokuWorkflow",
    "sudoku-9x9-v0": "verl_mas.workflows.sudoku:Sudoku9Workflow",
    "sudoku-single-v0": "verl_mas.workflows.sudoku:SudokuSingleWorkflow",
    "sokoban-v0": "verl_mas.workflows.sokoban:SokobanWorkflow",
    "sokoban-single-v0": "verl_mas.workflows.sokoban:SokobanSingleWorkflow",
    "plan-path-v0": "verl_mas.workflows.plan_path:PlanPathWorkflow",
    "plan-path-single-v0": "verl_mas.workflows.plan_path:PlanPathSingleWorkflow",
    "gridwalk-v0": "verl_mas.workflows.gridwalk:GridwalkWorkflow",
    "gridwalk-single-v0": "verl_mas.workflows.gridwalk:GridwalkSingleWorkflow",
    "code-v0": "verl_mas.workflows.code:CodeWorkflow",
    "code-single-v0": "verl_mas.workflows.code:CodeSingleWorkflow",
    "math-v0": "verl_mas.workflows.math_tool:MathWorkflow",
    "math-single-v0": "verl_mas.workflows.math_tool:MathSingleWorkflow",
}
