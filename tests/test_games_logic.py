"""Game logic of sudoku/sokoban/plan-path: oracle solvers, hand-computed rewards, generators, parsing, purity."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from verl_mas.games import plan_path as pp
from verl_mas.games import sokoban as sk
from verl_mas.games import sudoku as sd
from verl_mas.games.common import parse_moves, split_of
from verl_mas.workflows.common import extract_code

# ---------------------------------------------------------------------------------------------------
# Purity: verl_mas.games is game logic only, importing nothing of the workflow API.

WORKFLOW_API = ("verl_mas.workflow", "verl_mas.episode", "verl_mas.engine", "verl_mas.client", "verl_mas.chat",
                "verl_mas.registry", "verl_mas.workflows")

# Imports a module and every module below it in a fresh interpreter; prints them and the workflow-API modules
# loaded afterwards. verl_mas/__init__.py re-exports the public API (it imports verl_mas.workflow, .engine, ...),
# so importing any submodule the ordinary way loads all of it: an empty stand-in for the top-level package, on
# the same path, leaves in sys.modules only what the probed modules import themselves.
_PROBE = """
import importlib, importlib.util, json, pkgutil, sys, types
root = types.ModuleType("verl_mas")
root.__path__ = list(importlib.util.find_spec("verl_mas").submodule_search_locations)
sys.modules["verl_mas"] = root
name, api = sys.argv[1], sys.argv[2:]
module = importlib.import_module(name)
names = [name] + [m.name for m in pkgutil.walk_packages(getattr(module, "__path__", []), name + ".")]
for n in names:
    importlib.import_module(n)
loaded = sorted(m for m in sys.modules if any(m == a or m.startswith(a + ".") for a in api))
print(json.dumps({"imported": names, "api": loaded}))
"""


def workflow_api_imported_by(module: str) -> tuple[list[str], list[str]]:
    """``(modules imported, workflow-API modules loaded)`` for ``module`` and its submodules, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _PROBE, module, *WORKFLOW_API], capture_output=True, text=True,
                          check=True)
    found = json.loads(done.stdout)
    return found["imported"], found["api"]


def test_the_games_import_nothing_of_the_workflow_api() -> None:
    imported, api = workflow_api_imported_by("verl_mas.games")
    assert {"verl_mas.games.common", "verl_mas.games.plan_path", "verl_mas.games.sokoban",
            "verl_mas.games.sudoku"} <= set(imported)
    assert api == []
    # Negative control: a registered game workflow does import the workflow API, and the same probe says so.
    _, api = workflow_api_imported_by("verl_mas.workflows.sudoku")
    assert {"verl_mas.workflow", "verl_mas.registry", "verl_mas.workflows.tool_planner"} <= set(api)


# ---------------------------------------------------------------------------------------------------
# Parsing.


def test_parse_moves_formats_and_garbage() -> None:
    assert parse_moves('I go ["U", "r", "down", \'left\']', 10) == ["U", "R", "D", "L"]
    assert parse_moves("['R', 'D']\n", 10) == ["R", "D"]  # what print(list) writes
    assert parse_moves("U R R D", 10) == ["U", "R", "R", "D"]  # bare moves, as programs print
    assert parse_moves('first [1, 2] then ["L"]', 10) == ["L"]  # the last list is the answer
    # Negative controls: prose, empty list, unknown item, too many moves.
    assert parse_moves("go right then up", 10) is None
    assert parse_moves("[]", 10) is None
    assert parse_moves('["U", "X"]', 10) is None
    assert parse_moves('["U", "U", "U"]', 2) is None


def test_extract_code_takes_last_block() -> None:
    assert extract_code("a\n```python\nprint(1)\n```\nb\n```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(1)") is None
    assert extract_code("```python\n\n```") is None


def test_split_of_is_a_function_of_content() -> None:
    keys = [f"k{i}" for i in range(500)]
    test_share = sum(split_of(k) == "test" for k in keys) / len(keys)
    assert 0.1 < test_share < 0.3  # one bucket of 5 -> about 0.2
    assert all(split_of(k) == split_of(k) for k in keys[:20])


# ---------------------------------------------------------------------------------------------------
# Plan-Path. Example grid (start P=(0,0), goal G=(0,3), shortest 7):
#   P.#G
#   ..#.
#   ....
#   #...

PATH_TASK = {"grid": ["..#.", "..#.", "....", "#..."], "start": [0, 0], "goal": [0, 3], "shortest": 7}


def test_plan_path_optimal_plan_reward_and_maximality() -> None:
    level = pp.PathLevel.from_task(PATH_TASK)
    s0 = level.initial_state()
    plan = pp.shortest_path(level.rows, level.cols, level.walls, level.start, level.goal)
    assert plan is not None and len(plan) == 7
    step = level.step(s0, plan)
    # 7 valid moves: -0.07; shaping 0.99 * phi(goal) - phi(start) = 0 - (-3) = 3; goal +1; shortest +0.5.
    assert step.solved and step.reward == pytest.approx(-0.07 + 3 + 1 + 0.5)  # 4.43
    # No move list of length <= 8 earns more; those that tie start with a shortest path.
    best = max(
        (level.step(s0, list(ms)) for n in range(1, 9) for ms in itertools.product("UDLR", repeat=n)),
        key=lambda s: s.reward,
    )
    assert best.reward == pytest.approx(4.43)
    assert best.state.moves_used == 7


def test_plan_path_invalid_moves_hand_computed() -> None:
    level = pp.PathLevel.from_task(PATH_TASK)
    step = level.step(level.initial_state(), ["U", "L", "R", "R"])
    # U: off the grid -0.10; L: off the grid -0.10; R: (0,1) valid -0.01; R: (0,2) wall -0.10.
    # Ends on (0,1), distance 2: shaping 0.99 * -2 - (-3) = 1.02. Total -0.31 + 1.02 = 0.71.
    assert step.reward == pytest.approx(0.71)
    assert (step.valid, step.invalid, step.state.pos, step.state.moves_used) == (1, 3, (0, 1), 4)
    assert not step.solved
    # Moving away: D (1,0), D (2,0) valid -0.02; L off -0.10; distance 5: 0.99 * -5 + 3 = -1.95. Total -2.07.
    assert level.step(level.initial_state(), ["D", "D", "L"]).reward == pytest.approx(-2.07)


def test_plan_path_shortest_bonus_exactly_when_shortest() -> None:
    level = pp.PathLevel.from_task(PATH_TASK)
    s0 = level.initial_state()
    # Shortest path split over two turns: first 3 moves, then 4; the bonus still applies (7 moves used).
    first = level.step(s0, ["R", "D", "D"])  # (0,1) (1,1) (2,1); distance to (0,3): 2 + 2 = 4
    # 3 valid -0.03; shaping 0.99 * -4 - (-3) = -0.96 (the walk detours around the wall). Total -0.99.
    assert first.reward == pytest.approx(-0.99)
    second = level.step(first.state, ["R", "R", "U", "U"])
    # 4 valid -0.04; shaping 0 - (-4) = 4; goal +1; 7 moves in the episode == shortest: +0.5. Total 5.46.
    assert second.solved and second.reward == pytest.approx(5.46)
    # A 9-move detour reaches the goal without the bonus: -0.09 + 3 + 1 = 3.91.
    detour = level.step(s0, ["D", "R", "U", "D", "D", "R", "R", "U", "U"])
    assert detour.solved and detour.reward == pytest.approx(3.91)
    # A bump into the border makes the episode's path 8 moves: -0.10 - 0.07 + 3 + 1 = 3.83, no bonus.
    bumped = level.step(s0, ["U", "R", "D", "D", "R", "R", "U", "U"])
    assert bumped.solved and bumped.reward == pytest.approx(3.83)


def test_plan_path_generated_grids_reachable_with_known_shortest() -> None:
    rng = random.Random(7)
    for _ in range(40):
        level = pp.generate_level(rng)
        assert (level.rows, level.cols, len(level.walls)) == (10, 10, 22)  # round(0.22 * 100)
        level = pp.PathLevel.from_task(level.to_task())  # re-checks reachability and the shortest length
        plan = pp.shortest_path(level.rows, level.cols, level.walls, level.start, level.goal)
        assert plan is not None and len(plan) == level.shortest >= 1
        step = level.step(level.initial_state(), plan)
        d = abs(level.start[0] - level.goal[0]) + abs(level.start[1] - level.goal[1])
        assert step.solved and step.reward == pytest.approx(-0.01 * len(plan) + d + 1.5)
        # Step off the path and back first: 2 more valid moves (-0.02), same shaping, no +0.5.
        back = {"U": "D", "D": "U", "L": "R", "R": "L"}[plan[0]]
        longer = level.step(level.initial_state(), [plan[0], back, *plan])
        assert longer.solved and longer.reward == pytest.approx(step.reward - 0.52)


def test_plan_path_rejects_bad_task() -> None:
    with pytest.raises(ValueError, match="shortest is 6 but BFS finds 7"):
        pp.PathLevel.from_task({**PATH_TASK, "shortest": 6})
    with pytest.raises(ValueError, match="not reachable"):
        pp.PathLevel.from_task({"grid": [".#."], "start": [0, 0], "goal": [0, 2], "shortest": 2})


# ---------------------------------------------------------------------------------------------------
# Sokoban. Example level (player (1,1), box (2,2), goal (1,3)):
#   #####
#   #P_O#
#   #_X_#
#   #___#
#   #####

SOKOBAN_TASK = {"level": ["#####", "#P_O#", "#_X_#", "#___#", "#####"], "optimal": 5}


def test_sokoban_optimal_plan_reward_and_maximality() -> None:
    level = sk.SokobanLevel.from_task(SOKOBAN_TASK)
    s0 = level.initial_state()
    plan = sk.solve(level, s0)
    assert plan == ["D", "R", "D", "R", "U"]
    step = level.step(s0, plan)
    # 5 valid moves -0.05; box onto goal +1; shaping 0.1 * (2 - 0) = 0.2; solved +10. Total 11.15.
    assert step.solved and step.reward == pytest.approx(11.15)
    rewards = [level.step(s0, list(ms)).reward for n in range(1, 8) for ms in itertools.product("UDLR", repeat=n)]
    assert max(rewards) == pytest.approx(11.15)


def test_sokoban_invalid_moves_hand_computed() -> None:
    level = sk.SokobanLevel.from_task(SOKOBAN_TASK)
    s0 = level.initial_state()
    # U wall -0.05; L wall -0.05; R (1,2) -0.01; R (1,3) onto the goal cell, no box -0.01; R wall -0.05.
    step = level.step(s0, ["U", "L", "R", "R", "R"])
    assert step.reward == pytest.approx(-0.17)
    assert (step.valid, step.invalid, step.state.player, step.state.boxes) == (2, 3, (1, 3), s0.boxes)
    # D -0.01; R pushes the box to (2,3) -0.01; R, R push it into the wall: invalid -0.05 each.
    # Box distance 2 -> 1: shaping +0.1. Total -0.12 + 0.1 = -0.02.
    pushed = level.step(s0, ["D", "R", "R", "R"])
    assert pushed.reward == pytest.approx(-0.02)
    assert pushed.state.boxes == frozenset({(2, 3)}) and not pushed.solved


def test_sokoban_box_off_goal_penalty() -> None:
    # Corridor #P*_XO#: box on goal (1,2), box (1,4), goal (1,5). Built directly (it is unsolvable).
    walls = frozenset({(r, c) for r in (0, 2) for c in range(7)} | {(1, 0), (1, 6)})
    level = sk.SokobanLevel(3, 7, walls, frozenset({(1, 2), (1, 5)}), sk.SokobanState((1, 1), frozenset({(1, 2), (1, 4)})), 0)
    step = level.step(level.initial_state(), ["R", "R"])
    # R pushes the box off its goal: -0.01 - 0.5; R would push it into the other box: -0.05.
    # D = 0 + 1 before, 1 + 1 after: shaping 0.1 * (1 - 2) = -0.1. Total -0.66.
    assert step.reward == pytest.approx(-0.66)
    assert step.state.boxes == frozenset({(1, 3), (1, 4)})


def test_sokoban_generated_levels_are_solvable() -> None:
    rng = random.Random(3)
    for _ in range(40):
        level = sk.generate_level(rng)
        assert (level.rows, level.cols, len(level.start.boxes)) == (6, 6, 1)
        assert not (level.start.boxes & level.goals) and level.start.player not in level.walls
        level = sk.SokobanLevel.from_task(level.to_task())  # re-solves and checks "optimal"
        plan = sk.solve(level, level.initial_state())
        assert plan is not None and len(plan) == level.optimal >= 4
        step = level.step(level.initial_state(), plan)
        d0 = level.box_distance(level.start.boxes)
        assert step.solved and step.reward == pytest.approx(-0.01 * len(plan) + 1.0 + 0.1 * d0 + 10.0)


def test_sokoban_two_boxes_generate_and_solve() -> None:
    level = sk.generate_level(random.Random(0), rows=7, cols=7, boxes=2)
    plan = sk.solve(level, level.initial_state())
    assert plan is not None and level.step(level.initial_state(), plan).solved


def test_sokoban_rejects_wrong_optimal() -> None:
    with pytest.raises(ValueError, match="optimal is 4 but the solver finds 5"):
        sk.SokobanLevel.from_task({**SOKOBAN_TASK, "optimal": 4})


# ---------------------------------------------------------------------------------------------------
# Sudoku. Example (6 clues, E = 10 empty cells):
#   0020      3124
#   2010  ->  2413
#   1300      1342
#   0200      4231

SUDOKU_TASK = {"size": 4, "puzzle": ["0020", "2010", "1300", "0200"], "solution": ["3124", "2413", "1342", "4231"]}


def test_sudoku_solution_reward_and_termination() -> None:
    puzzle = sd.SudokuPuzzle.from_task(SUDOKU_TASK)
    step = puzzle.step(puzzle.initial_state(), puzzle.solution)
    # solved +1.0; phi 0 -> 1 (10 correct of 10): 0.5 * 1 = 0.5. Total 1.5.
    assert step.solved and step.reward == pytest.approx(1.5)
    assert puzzle.is_solved(step.state)


def test_sudoku_valid_grid_that_contradicts_a_clue_is_not_solved() -> None:
    puzzle = sd.SudokuPuzzle.from_task(SUDOKU_TASK)
    # Swap digits 1 <-> 2 in the solution: still a valid grid, but clue (0,2) = 2 becomes 1.
    swapped = tuple(tuple({1: 2, 2: 1}.get(v, v) for v in row) for row in puzzle.solution)
    assert sd.is_valid_complete(swapped)  # control: the rules alone accept it
    assert not puzzle.is_solved(swapped)
    step = puzzle.step(puzzle.initial_state(), swapped)
    assert step.reward == sd.INVALID == -1.0 and step.state == puzzle.puzzle and not step.solved
    # The example grid of the prompt is valid too, and does not solve this puzzle (docs/algorithm.md §5, pitfall 5).
    example = sd.grid_from_rows(["1234", "3412", "2143", "4321"])
    assert sd.is_valid_complete(example) and not puzzle.is_solved(example)


def test_sudoku_partial_and_conflicting_grids_hand_computed() -> None:
    puzzle = sd.SudokuPuzzle.from_task(SUDOKU_TASK)
    # Fill (0,0)=3 and (0,1)=1 (correct) and (3,0)=1 (wrong; the solution has 4): phi = (2 - 1) / 10.
    partial = sd.grid_from_rows(["3120", "2010", "1300", "1200"])
    step = puzzle.step(puzzle.initial_state(), partial)
    assert step.reward == pytest.approx(0.5 * 0.1) and not step.solved
    # Then the full solution: solved +1.0, phi 0.1 -> 1.0: 0.5 * 0.9 = 0.45.
    assert puzzle.step(step.state, puzzle.solution).reward == pytest.approx(1.45)
    # Complete, keeps the clues, breaks the rules (row 3 = 4,2,3,3... ): not solved.
    broken = sd.grid_from_rows(["3124", "2413", "1342", "4233"])
    assert puzzle.keeps_clues(broken) and not puzzle.is_solved(broken)
    # 9 correct, 1 wrong: phi = 8 / 10; 0.5 * 0.8 = 0.4.
    assert puzzle.step(puzzle.initial_state(), broken).reward == pytest.approx(0.4)


def test_sudoku_parse_grid() -> None:
    assert sd.parse_grid("Answer:\n3124\n2413\n1342\n4231", 4) == sd.grid_from_rows(SUDOKU_TASK["solution"])
    assert sd.parse_grid("[[3,1,2,4],[2,4,1,3],[1,3,4,2],[4,2,3,1]]", 4) == sd.grid_from_rows(SUDOKU_TASK["solution"])
    assert sd.parse_grid("3 1 | 2 4\n2 4 | 1 3\n1 3 | 4 2\n4 2 | 3 1", 4) is not None
    assert sd.parse_grid("3124\n2413\n1342", 4) is None  # three rows
    assert sd.parse_grid("3124\n2413\n1342\n4251", 4) is None  # 5 > n
    assert sd.parse_grid("the year 2024 was fine", 4) is None


@pytest.mark.parametrize(("n", "count"), [(4, 30), (9, 2)])
def test_sudoku_generated_puzzles_have_unique_solutions(n: int, count: int) -> None:
    rng = random.Random(11)
    for _ in range(count):
        p = sd.generate_puzzle(rng, n)
        assert sd.count_solutions(p.puzzle) == 1
        assert p.is_solved(p.solution) and sd.solve(p.puzzle) == p.solution
        assert sum(v == 0 for row in p.puzzle for v in row) >= (6 if n == 4 else 30)
        sd.SudokuPuzzle.from_task(p.to_task())  # round trip re-checks uniqueness


def test_sudoku_rejects_ambiguous_or_wrong_tasks() -> None:
    with pytest.raises(ValueError, match="unique"):
        sd.SudokuPuzzle.from_task({**SUDOKU_TASK, "puzzle": ["0000", "0000", "0000", "0000"]})
    with pytest.raises(ValueError, match="keeps every clue"):
        sd.SudokuPuzzle.from_task({**SUDOKU_TASK, "solution": ["1234", "3412", "2143", "4321"]})
