"""Pure logic of the built-in games (Sudoku, Sokoban, Plan-Path): levels, moves, rewards, solvers, generators.

Nothing here knows of prompts, models or the workflow API (importing it imports none of
:mod:`verl_mas.workflow`, :mod:`verl_mas.engine` and friends; tests/test_games_logic.py checks this), so
the games can be played, solved and tested on their own. The registered workflows that put models in
front of them live in :mod:`verl_mas.workflows.sudoku`, ``.sokoban`` and ``.plan_path`` (on top of
:mod:`verl_mas.workflows.tool_planner`). Rules and rewards are versioned with the workflow ids (``-v0``);
see docs/games.md.
"""
