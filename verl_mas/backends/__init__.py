"""CPU backends for verl: the ``cpu`` platform and the ``hf`` rollout backend (development and CI without GPUs)."""

from __future__ import annotations

__all__ = ["freeze_after"]


def freeze_after(value: str | None, env: str) -> int | None:
    """A rollout backend's freeze diagnostic, read from the environment variable ``env``: how many weight
    syncs load before the rest are ignored (None: all load). ``1``/``true``/``yes``: 0; ``after:N``: N (the
    initial sync is the first); unset, empty or ``0``: None.

    Raises:
        ValueError: For any other value (a typo would otherwise leave the diagnostic silently off).
    """
    text = (value or "").strip().lower()
    if text in ("", "0", "false", "no"):
        return None
    if text in ("1", "true", "yes"):
        return 0
    if text.startswith("after:") and text[len("after:"):].isdigit():
        return int(text[len("after:"):])
    raise ValueError(f"{env}={value!r}: use 1 (ignore every weight update) or after:N (load the first N, the "
                     "initial sync included, and ignore the rest); unset it for training.")
