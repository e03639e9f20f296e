"""Pure logic of the built-in games (Sudoku, Sokoban, Plan-Path) and their shared tool -> planner workflow.

The game modules (:mod:`.sudoku`, :mod:`.sokoban`, :mod:`.plan_path`) know nothing of prompts or
models; the registered workflows live in :mod:`verl_mas.workflows.sudoku`, ``.sokoban`` and
``.plan_path``. Rules and rewards are versioned with the workflow ids (``-v0``); see docs/games.md.
"""
