"""Gridwalk game logic (rules v0): small Plan-Path grids split between a role that sees and a role that moves.

A CPU-sized member of the paper's planning family (Plan-Path), built so that a tiny model can learn it from
scratch and so that the paper's comparisons mean something on it:

- **The state changes every turn.** One move per turn; every prompt is rendered from the walker's current
  cell, so K independent episodes of one task reach different cells after their first moves (parallel
  sampling's (task, role, turn) groups then mix states), while tree sampling keeps one prompt per group.
- **The roles need each other.** The *scout* sees the walls around the walker (the 3x3 window) and where
  the goal is, and proposes a move; it cannot move. The *walker* moves but sees no wall: only where the
  goal is and the scout's proposal. Every task is drawn so that a walker heading for the goal without
  seeing walls is blocked (both the rows-first and the columns-first straight path hit a wall), so a
  walker alone fails; and so that the window and the goal's direction are enough to play perfectly: every
  free move towards the goal, from every cell such moves reach, keeps a shortest path open
  (:func:`locally_solvable`), so a scout that only ever proposes a free move towards the goal walks a
  shortest path.
- **A move budget.** The walker has :func:`budget` moves (the shortest length plus :data:`MOVE_SLACK`);
  success is reaching the goal within it, i.e. by a shortest path (Plan-Path's +0.5 bonus condition). A
  bump costs the episode, so a walker guessing around walls fails where a guided one succeeds.
- **Held-out prompts are new.** Every prompt names the walker's cell and the goal's offset, so it fixes the
  goal's cell. The split of a task is decided by its goal cell (one bucket in
  :data:`~verl_mas.games.common.TEST_BUCKETS`): no held-out episode, at any turn, can render a prompt that
  a training episode renders (``verl_mas.workflows.gridwalk.prompt_overlap`` counts it for a dataset).

Rewards are Plan-Path's (:class:`verl_mas.games.plan_path.PathLevel`, docs/games.md) applied to one move at
a time: -0.01 a valid move, -0.10 a bump (the walker stays), shaping ``0.99 * phi(s') - phi(s)`` with
``phi = -Manhattan(cell, goal)``, +1.0 on reaching the goal and +0.5 more when the moves used equal the
shortest length. With one move per action the paper's per-move and our per-action readings agree.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from verl_mas.games.common import DELTAS, manhattan, split_of
from verl_mas.games.plan_path import PathLevel, PathState, shortest_path

__all__ = [
    "MAX_SHORTEST",
    "MIN_SHORTEST",
    "MOVE_WORDS",
    "SIZES",
    "WALL_RATIO",
    "MOVE_SLACK",
    "blind_walk_blocked",
    "budget",
    "blind_walker",
    "generate_level",
    "good_moves",
    "goal_words",
    "level_problems",
    "locally_solvable",
    "move_word",
    "offset_words",
    "parse_move",
    "play",
    "scripted_scout",
    "split_key",
    "split_of_level",
    "window",
]

#: Grid sizes drawn (square grids, rows = columns).
SIZES: tuple[int, ...] = (4, 5, 6)
#: Fraction of cells that are walls.
WALL_RATIO = 0.25
#: Shortest path lengths drawn (moves; one move per turn, so ``mas.max_turns`` must leave room for them).
MIN_SHORTEST, MAX_SHORTEST = 2, 6

#: Moves the walker has beyond the shortest length (0: success means a shortest path, no bump).
MOVE_SLACK = 0

#: The moves, one word (and one token of the tailored tokenizer) each -> the game's move letters.
MOVE_WORDS: dict[str, str] = {"up": "U", "down": "D", "left": "L", "right": "R"}
_LETTER_WORDS = {letter: word for word, letter in MOVE_WORDS.items()}

#: Cell words of the scout's window: a wall (or outside the grid) and a floor cell.
WALL, FLOOR = "#", "."

#: The 8 cells around the walker, row by row (row delta, column delta), as the scout's prompt lists them.
WINDOW: tuple[tuple[int, int], ...] = tuple((dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0))

Cell = tuple[int, int]


def parse_move(text: str) -> str | None:
    """The move letter of the move word ``text`` begins with (case and leading whitespace ignored), else None.

    ``"up"``, ``" Up"`` and ``"up down"`` parse as ``"U"``: one move per turn, extra words ignored (as relay-v0
    reads its one word: a tiny model's correct first token followed by a stray one still moves).
    """
    head = text.lstrip().lower()
    for word, letter in MOVE_WORDS.items():
        if head.startswith(word):
            return letter
    return None


def move_word(letter: str) -> str:
    """``"U"`` -> ``"up"``."""
    return _LETTER_WORDS[letter]


def goal_words(cell: Cell, goal: Cell) -> tuple[str, str]:
    """Where the goal lies from ``cell``, one word per axis: ``("n2", "e1")`` = 2 rows up, 1 column right.

    ``n``/``s`` (rows up/down) and ``w``/``e`` (columns left/right) with the distance; ``ns0`` and ``ew0`` when
    the goal is on the same row / column.
    """
    dr, dc = goal[0] - cell[0], goal[1] - cell[1]
    vertical = "ns0" if dr == 0 else f"{'n' if dr < 0 else 's'}{abs(dr)}"
    horizontal = "ew0" if dc == 0 else f"{'w' if dc < 0 else 'e'}{abs(dc)}"
    return vertical, horizontal


def offset_words(max_size: int = max(SIZES)) -> tuple[str, ...]:
    """Every word :func:`goal_words` can return on grids up to ``max_size`` cells a side."""
    far = range(1, max_size)
    return ("ns0", "ew0", *(f"{d}{k}" for d in "nswe" for k in far))


def window(level: PathLevel, cell: Cell) -> tuple[str, ...]:
    """The 8 cells around ``cell`` in :data:`WINDOW` order: :data:`WALL` (a wall or off the grid) or :data:`FLOOR`."""
    return tuple(FLOOR if level.is_free((cell[0] + dr, cell[1] + dc)) else WALL for dr, dc in WINDOW)


def _straight_path(start: Cell, goal: Cell, rows_first: bool) -> list[Cell]:
    """The cells an L-shaped walk from ``start`` to ``goal`` enters (rows first or columns first)."""
    cells, (r, c) = [], start
    axes = ("r", "c") if rows_first else ("c", "r")
    for axis in axes:
        target = goal[0] if axis == "r" else goal[1]
        while (r if axis == "r" else c) != target:
            step = 1 if target > (r if axis == "r" else c) else -1
            r, c = (r + step, c) if axis == "r" else (r, c + step)
            cells.append((r, c))
    return cells


def blind_walk_blocked(level: PathLevel) -> bool:
    """Whether a walker that cannot see walls, heading straight for the goal, hits a wall on both L-shaped paths.

    Such a walker (rows first, or columns first) reaches a wall and stays put: with no wall in its prompt it
    has no reason to do anything else. Every generated level blocks both.
    """
    return all(any(not level.is_free(cell) for cell in _straight_path(level.start, level.goal, rows_first))
               for rows_first in (True, False))


def locally_solvable(level: PathLevel) -> bool:
    """Whether every cell reachable from the start by free moves towards the goal has such a move (or is the goal).

    Then any sequence of free moves towards the goal is a shortest path, and the scout's window (the walls
    next to the walker) with the goal's direction is all a perfect player needs.
    """
    seen, stack = {level.start}, [level.start]
    while stack:
        cell = stack.pop()
        if cell == level.goal:
            continue
        moves = good_moves(level, cell)
        if not moves:
            return False
        for n in ((cell[0] + DELTAS[m][0], cell[1] + DELTAS[m][1]) for m in moves):
            if n not in seen:
                seen.add(n)
                stack.append(n)
    return True


def budget(level: PathLevel) -> int:
    """The walker's moves: the shortest length plus :data:`MOVE_SLACK`."""
    return level.shortest + MOVE_SLACK


def level_problems(level: PathLevel) -> list[str]:
    """Why ``level`` is not a gridwalk level (empty when it is): size, path length, local solvability, blind walker."""
    problems = []
    if level.rows != level.cols or level.rows not in SIZES:
        problems.append(f"the grid is {level.rows}x{level.cols}; gridwalk grids are square, {SIZES} cells a side")
    if not MIN_SHORTEST <= level.shortest <= MAX_SHORTEST:
        problems.append(f"the shortest path has {level.shortest} moves; gridwalk draws {MIN_SHORTEST}..{MAX_SHORTEST}")
    if level.shortest != manhattan(level.start, level.goal):
        problems.append(f"the shortest path ({level.shortest}) is longer than the Manhattan distance "
                        f"({manhattan(level.start, level.goal)}): it has to move away from the goal")
    elif not locally_solvable(level):
        problems.append("a free move towards the goal leads into a dead end: the scout's window is not enough")
    if not blind_walk_blocked(level):
        problems.append("a walker blind to walls reaches the goal on a straight L-shaped path: the scout is not needed")
    return problems


def generate_level(rng: random.Random, sizes: Iterable[int] = SIZES, wall_ratio: float = WALL_RATIO) -> PathLevel:
    """A random gridwalk level: see the module docstring; redrawn until :func:`level_problems` is empty."""
    sizes = tuple(sizes)
    while True:
        n = rng.choice(sizes)
        cells = [(r, c) for r in range(n) for c in range(n)]
        walls = frozenset(rng.sample(cells, round(wall_ratio * n * n)))
        start, goal = rng.sample([c for c in cells if c not in walls], 2)
        if not MIN_SHORTEST <= manhattan(start, goal) <= MAX_SHORTEST:
            continue
        path = shortest_path(n, n, walls, start, goal)
        if path is None:
            continue
        level = PathLevel(n, n, walls, start, goal, len(path))
        if not level_problems(level):
            return level


def split_key(level: PathLevel) -> str:
    """The content that decides a level's split (:func:`~verl_mas.games.common.split_of`): its goal's cell."""
    return f"gridwalk goal {level.goal[0]} {level.goal[1]}"


def split_of_level(level: PathLevel) -> str:
    """``"train"`` or ``"test"``, decided by the goal's cell: a held-out goal cell is never a training goal."""
    return split_of(split_key(level))


def good_moves(level: PathLevel, cell: Cell) -> list[str]:
    """The moves (letters, U D L R order) from ``cell`` to a free cell closer to the goal: on a gridwalk level,
    exactly the moves that keep a shortest path."""
    near = manhattan(cell, level.goal)
    return [m for m, (dr, dc) in DELTAS.items()
            if level.is_free(n := (cell[0] + dr, cell[1] + dc)) and manhattan(n, level.goal) < near]


def scripted_scout(level: PathLevel, state: PathState) -> str:
    """A scout that uses only what the scout's prompt shows: the first of :func:`good_moves` (U D L R order)."""
    moves = good_moves(level, state.pos)
    return moves[0] if moves else "U"


def blind_walker(rng: random.Random):
    """A walker that sees what the walker's prompt shows without the scout: a random move towards the goal."""
    def policy(level: PathLevel, state: PathState) -> str:
        dr, dc = level.goal[0] - state.pos[0], level.goal[1] - state.pos[1]
        return rng.choice([m for m, d in (("D" if dr > 0 else "U", dr), ("R" if dc > 0 else "L", dc)) if d])
    return policy


def play(level: PathLevel, policy: Callable[[PathLevel, PathState], str]) -> bool:
    """Whether ``policy(level, state) -> move letter`` reaches the goal within the level's :func:`budget`."""
    state = level.initial_state()
    for _ in range(budget(level)):
        step = level.step(state, [policy(level, state)])
        state = step.state
        if step.solved:
            return True
    return False


