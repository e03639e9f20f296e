"""Helpers shared by the built-in workflows: reading fenced blocks out of replies, and per-episode memos.

- :func:`fenced_blocks` and :func:`extract_code`: the one reading of Markdown code fences in a model reply,
  used by every role that answers with a program (``code-v0``'s coder, ``math-v0``'s tool, the games'
  tool) and by ``code-v0``'s tester (```input / ```output blocks), so a reply parses the same everywhere.
- :class:`Memo` and :func:`settle_all`: run each distinct sandbox job (or answer check) once per episode,
  and let started jobs finish when the episode fails.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Memo", "extract_code", "fenced_blocks", "settle_all"]

# An opening fence, its info string (language tag first, anything after it ignored), the body, the closing fence.
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+\-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Language tags (lower case) of the blocks extract_code takes for Python; "" is an untagged block.
_CODE_LANGS = ("python", "python3", "py", "")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block of ``text`` as ``(language tag in lower case, body)``, in order.

    Fences are matched pairwise from the start, so the closing fence of one block is never read as the
    opening fence of the next: ``"```text\\nplan\\n```\\nthen\\n```python\\nprint(1)\\n```"`` gives
    ``[("text", "plan\\n"), ("python", "print(1)\\n")]``. Text after the tag (``"```python title=a.py"``) is ignored.
    """
    return [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]


def extract_code(text: str) -> str | None:
    """The last fenced code block tagged ``python``/``python3``/``py`` (any case) or untagged in ``text``, else None.

    ``"Here:\\n```python\\nprint(1)\\n```"`` -> ``"print(1)\\n"``. Blocks in other languages (```text, ```cpp)
    are skipped; an empty last block counts as no code.
    """
    blocks = [body for lang, body in fenced_blocks(text) if lang in _CODE_LANGS]
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(Generic[K, V]):
    """Per-episode memo of async results: identical candidates (frequent among K samples) run once.

    ``memo(key)`` starts ``fn(key)`` as a task the first time and returns that same task for every
    later call with an equal key.
    """

    def __init__(self, fn: Callable[[K], Awaitable[V]]) -> None:
        self._fn = fn
        self._tasks: dict[K, asyncio.Task[V]] = {}

    def __call__(self, key: K) -> asyncio.Task[V]:
        if key not in self._tasks:
            self._tasks[key] = asyncio.ensure_future(self._fn(key))
        return self._tasks[key]

    async def settle(self) -> None:
        """Wait for every started computation (results and errors discarded).

        Called when the episode fails: sandbox runs are left to finish rather than abandoned in flight
        (an abandoned run keeps its sandbox slot, and the sandbox bound to a finished event loop).
        """
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


async def settle_all(memos: Sequence[Memo[Any, Any]], body: Awaitable[None]) -> None:
    """Await ``body``; if it raises, let the memos' started runs finish before re-raising."""
    try:
        await body
    except Exception:
        for memo in memos:
            await memo.settle()
        raise
