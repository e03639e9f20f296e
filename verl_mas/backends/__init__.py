"""CPU backends for verl: the ``cpu`` platform and the ``hf`` rollout backend (development and CI without GPUs)."""

from __future__ import annotations

__all__ = ["diagnostic_after"]


def diagnostic_after(value: str | None, env: str) -> int | None:
    """A rollout backend's diagnostic switch (frozen weights, swapped adapters), read from the environment variable
    ``env``: after how many weight syncs it takes effect (None: never). ``1``/``true``/``yes``: 0 (from the start);
    ``after:N``: N (the initial sync is the first), so one run has normal steps and then diagnostic ones; unset,
    empty or ``0``: None.

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
    raise ValueError(f"{env}={value!r}: use 1 (from the start) or after:N (after the first N weight syncs, the "
                     "initial one included); unset it for training.")
