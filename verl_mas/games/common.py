"""Shared pieces of the game logic: move parsing, step results, cells and split assignment.

Everything here is pure (no prompts, no models, no I/O) so the games can be tested on their own.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "DELTAS",
    "SPLITS",
    "TEST_BUCKETS",
    "Step",
    "as_cell",
    "draw_for_split",
    "format_moves",
    "manhattan",
    "parse_moves",
    "split_of",
]

S = TypeVar("S")
T = TypeVar("T")

#: Move letter -> (row delta, column delta). Row 0 is the top row, so "U" decreases the row.
DELTAS: dict[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}

_ALIASES: dict[str, str] = {"u": "U", "d": "D", "l": "L", "r": "R", "up": "U", "down": "D", "left": "L", "right": "R"}
_LIST_RE = re.compile(r"\[([^\[\]]*)\]")
_ITEM_SPLIT_RE = re.compile(r"[\s,]+")

#: The two dataset splits ``generate_task`` accepts.
SPLITS = ("train", "test")

#: One content bucket in ``TEST_BUCKETS`` belongs to the test split, the others to training.
TEST_BUCKETS = 5


@dataclass(frozen=True)
class Step(Generic[S]):
    """The outcome of applying one action (a whole move list or grid) to a state.

    Attributes:
        state: The state after the action (the input state is never modified).
        reward: The summed reward of the action, as specified by the game.
        solved: Whether the state after the action is solved.
        valid: Moves (or cells) that were applied.
        invalid: Moves that were rejected (the state stayed where it was for them).
    """

    state: S
    reward: float
    solved: bool
    valid: int = 0
    invalid: int = 0


def manhattan(a: tuple[int, int], b: tuple[int, int]) -> int:
    """|dr| + |dc| between two cells."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def _move(token: str) -> str | None:
    return _ALIASES.get(token.strip().strip("'\"`").strip().lower())


def parse_moves(text: str, max_moves: int) -> list[str] | None:
    """Parse a move list such as ``["U", "R", "down"]`` into ``["U", "R", "D"]``; None when malformed.

    The last bracketed list in ``text`` is the answer (reasoning may come before it). Without any
    brackets, a text made only of move words (``"U R R D"``, ``"up, right"``) is accepted too, which
    is what programs usually print. Items are U/D/L/R or up/down/left/right, case-insensitive, quotes
    optional.

    Args:
        text: The model's answer or a program's output.
        max_moves: Lists longer than this are malformed (bounds the work and the penalties of one action).

    Returns:
        The move letters, or None for: no list, an empty list, an unknown item, or too many moves.
    """
    lists = _LIST_RE.findall(text)
    body = lists[-1] if lists else text
    items = [t for t in _ITEM_SPLIT_RE.split(body.strip()) if t]
    if not items or len(items) > max_moves:
        return None
    moves = [_move(t) for t in items]
    if any(m is None for m in moves):
        return None
    return [m for m in moves if m is not None]


def format_moves(moves: list[str]) -> str:
    """``["U", "R"]`` -> ``'["U", "R"]'``: the canonical answer format."""
    return "[" + ", ".join(f'"{m}"' for m in moves) + "]"


def split_of(key: str) -> str:
    """The split that owns a piece of content: ``"test"`` for one sha256 bucket of ``TEST_BUCKETS``.

    Deciding the split from the content itself (not from a seed) makes train and test disjoint by
    construction, whatever seeds or counts a dataset is drawn with.
    """
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % TEST_BUCKETS
    return "test" if bucket == 0 else "train"


def draw_for_split(
    rng: random.Random, split: str, draw: Callable[[random.Random], T], key: Callable[[T], str], *, max_tries: int = 1000
) -> T:
    """Draw with ``draw(rng)`` until the drawn item's ``key`` belongs to ``split`` (see :func:`split_of`).

    Raises:
        ValueError: For a split other than ``"train"``/``"test"``.
        RuntimeError: When ``max_tries`` draws all fell into the other split (a broken generator).
    """
    if split not in SPLITS:
        raise ValueError(f"split is {split!r}; it must be one of {SPLITS} (the dataset splits the data CLI writes)")
    for _ in range(max_tries):
        item = draw(rng)
        if split_of(key(item)) == split:
            return item
    raise RuntimeError(
        f"{max_tries} draws produced no {split} item; the generator seems to repeat one item. Check its use of rng."
    )


def as_cell(value: Any, where: str) -> tuple[int, int]:
    """A ``[row, col]`` pair from a task, as a tuple; raises ValueError naming ``where`` otherwise."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"{where} is {value!r}; it must be a [row, col] pair of ints")
    return int(value[0]), int(value[1])
