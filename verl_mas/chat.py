"""Chat messages and prompt rendering that splices sampled token ids in unchanged (token in, token out).

Messages are plain dicts, as chat templates expect: ``{"role": ..., "content": ...}``. An assistant
message built from a sampled candidate (``candidate.as_message()``) also carries ``"token_ids"``: the
ids the model actually sampled. Decoding those ids and encoding the text again is not the identity
(``"a"`` + ``"b"`` sampled as two tokens re-encodes as one ``"ab"`` token), so a prompt that continues
the chat must contain the sampled ids themselves. :func:`render_prompt` renders the chat template with
a unique placeholder in place of each such message's content, encodes the text around the placeholders
and splices the stored ids in.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Message", "assistant", "render_prompt", "system", "user"]

#: A chat message: ``{"role": str, "content": str}``, optionally with ``"token_ids": list[int]``.
Message = dict[str, Any]

logger = logging.getLogger(__name__)

# A placeholder no real text contains; the index says which message it stands for.
_PLACEHOLDER = "\x00verl_mas:{}:6f1c\x00"
_PLACEHOLDER_RE = re.compile("\x00verl_mas:(\\d+):6f1c\x00")


def system(content: str) -> Message:
    """A system message."""
    return {"role": "system", "content": content}


def user(content: str) -> Message:
    """A user message."""
    return {"role": "user", "content": content}


def assistant(content: str, token_ids: Sequence[int] | None = None) -> Message:
    """An assistant message; with ``token_ids`` the prompt contains exactly those ids for it.

    Prefer ``candidate.as_message()``, which fills both from a sampled candidate.
    """
    message: Message = {"role": "assistant", "content": content}
    if token_ids is not None:
        message["token_ids"] = list(token_ids)
    return message


class _PieceEncoder:
    """Encodes rendered chat text piece by piece, split at special tokens, with a cache of pieces.

    Fast tokenizers cut text at special tokens before normalising and pre-tokenizing, so the pieces
    between special tokens encode independently; a chat re-renders the same system prompt and history
    every turn, so most pieces are cache hits. The first renders are checked against a plain
    ``encode`` of the whole text; on any difference (e.g. special tokens that strip adjacent
    whitespace) the cache is switched off for that tokenizer.
    """

    VERIFY_FIRST = 16
    MAX_PIECES = 16384

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", ()) if t}, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, specials)) + ")").split if specials else None
        self.cache: dict[str, list[int]] = {}
        self.checks_left = self.VERIFY_FIRST
        self.enabled = self.split is not None

    def encode(self, text: str) -> list[int]:
        encode = self.tokenizer.encode
        if not self.enabled:
            return list(encode(text, add_special_tokens=False))
        assert self.split is not None
        ids: list[int] = []
        cache = self.cache
        for piece in self.split(text):
            if not piece:
                continue
            cached = cache.get(piece)
            if cached is None:
                if len(cache) >= self.MAX_PIECES:
                    cache.clear()
                cached = cache[piece] = list(encode(piece, add_special_tokens=False))
            ids.extend(cached)
        if self.checks_left:
            self.checks_left -= 1
            whole = list(encode(text, add_special_tokens=False))
            if whole != ids:
                logger.debug("piecewise encoding differs for %s; encoding whole prompts", type(self.tokenizer).__name__)
                self.enabled, self.cache = False, {}
                return whole
        return ids


_encoders: weakref.WeakKeyDictionary[Any, _PieceEncoder] = weakref.WeakKeyDictionary()


def _encoder(tokenizer: Any) -> _PieceEncoder:
    try:
        enc = _encoders.get(tokenizer)
        if enc is None:
            enc = _encoders[tokenizer] = _PieceEncoder(tokenizer)
        return enc
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return _PieceEncoder(tokenizer)


def _check_messages(messages: object) -> list[str]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        return [f"messages must be a list of message dicts, got {type(messages).__name__}"]
    if not messages:
        return ["messages is empty; a prompt needs at least one message"]
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            problems.append(f"messages[{i}] is a {type(m).__name__}, not a dict")
            continue
        if not isinstance(m.get("role"), str):
            problems.append(f"messages[{i}] has no string 'role'")
        if not isinstance(m.get("content"), str):
            problems.append(f"messages[{i}]['content'] is {type(m.get('content')).__name__}, not str")
        ids = m.get("token_ids")
        if ids is not None and (not isinstance(ids, Sequence) or not all(isinstance(t, int) for t in ids)):
            problems.append(f"messages[{i}]['token_ids'] must be a list of int")
    return problems


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and return the prompt token ids.

    Messages carrying ``"token_ids"`` contribute exactly those ids (in place of their content). When
    those ids end with a special token (the sampled EOS, e.g. ``<|im_end|>``) and the template writes
    the same token right after the content, the template's copy is dropped so it is not doubled.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: The chat.
        add_generation_prompt: Append the assistant header (the model answers next).
        chat_template_kwargs: Extra variables for the template (e.g. ``enable_thinking=False``).

    Returns:
        The prompt token ids.

    Raises:
        ValueError: When messages are malformed, or the template does not render a token-carrying
            message's content exactly once and in order (then its ids cannot be spliced in).
    """
    problems = _check_messages(messages)
    if problems:
        raise ValueError(
            "cannot render the prompt: " + "; ".join(problems) + ". A chat is a list of "
            "{'role': str, 'content': str} dicts; build them with verl_mas.chat.system/user/assistant "
            "or candidate.as_message()."
        )
    spliced: dict[int, list[int]] = {}
    plain: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        base = {k: v for k, v in m.items() if k != "token_ids"}
        if m.get("token_ids") is None:
            plain.append(base)
            continue
        spliced[i] = list(m["token_ids"])
        plain.append(base | {"content": _PLACEHOLDER.format(i)})
    text = tokenizer.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=add_generation_prompt, **dict(chat_template_kwargs or {})
    )
    encode = _encoder(tokenizer).encode
    if not spliced:
        return encode(text)

    found = [int(mt.group(1)) for mt in _PLACEHOLDER_RE.finditer(text)]
    if found != sorted(spliced):
        raise ValueError(
            f"the chat template rendered the token-carrying messages {sorted(spliced)} as {found}: each "
            "must appear exactly once, in order, for its sampled ids to be spliced in unchanged. This "
            "template rewrites or drops assistant history (some strip reasoning from earlier turns); pass "
            "those messages without 'token_ids' (accepting re-tokenization) or use a template that "
            "renders assistant content verbatim."
        )
    segments = _PLACEHOLDER_RE.split(text)  # [text, idx, text, idx, ..., text]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    ids: list[int] = encode(segments[0]) if segments[0] else []
    for k in range(1, len(segments), 2):
        stored = spliced[int(segments[k])]
        after = segments[k + 1]
        if stored and stored[-1] in special:
            # The sampled EOS already closes the message; drop the template's own copy of it.
            token = tokenizer.convert_ids_to_tokens(stored[-1])
            if isinstance(token, str) and after.startswith(token):
                after = after[len(token) :]
        ids.extend(stored)
        if after:
            ids.extend(encode(after))
    return ids
