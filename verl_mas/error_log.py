"""Episodes that raised: reported by the agent-loop workers, read by the ``mas`` trainer to stop the run.

An exception in the ``mas`` agent loop is a bug in a workflow (or a deterministic server error), never a
model mistake. verl's agent-loop worker logs its traceback and marks the task ``failure`` in TransferQueue;
its replay buffer then resamples other tasks or stops with a message about refilling failed groups, and the
cause is a few hundred lines up in a worker's log. So the agent loop also records the error here, under the
task's uid, before verl sees it, and the trainer (:func:`verl_mas.trainer.tune_replay_buffer`) stops the step
as soon as a task of it failed, with each task's own error in the message.

The log is a named Ray actor of the job (:data:`ACTOR_NAME`), created by the trainer at start-up. Outside a
Ray job (unit tests, ``python -m verl_mas.run``) there is none: :func:`record_error` does nothing and
:func:`recorded_errors` returns nothing, and the trainer's message then points at the worker logs.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ACTOR_NAME", "create_error_log", "describe", "record_error", "recorded_errors"]

#: The name of the job's error log actor.
ACTOR_NAME = "verl_mas_episode_errors"
#: Characters of a traceback kept per task (the head of the message and its last frames matter most).
MAX_CHARS = 4000


class _ErrorLog:
    """uid -> the first error reported for that task (later sessions of the task usually repeat it)."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}

    def add(self, uid: str, text: str) -> None:
        self.errors.setdefault(uid, text)

    def get(self, uids: list[str]) -> dict[str, str]:
        return {uid: self.errors[uid] for uid in uids if uid in self.errors}


def create_error_log() -> Any:
    """The job's error log actor (created once; later calls return the same one). Hold the handle: Ray collects an
    actor without one, named or not."""
    import ray

    return ray.remote(num_cpus=0)(_ErrorLog).options(name=ACTOR_NAME, get_if_exists=True).remote()


def _actor() -> Any:
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(ACTOR_NAME)
    except ValueError:  # no trainer created it: a worker used outside the mas trainer
        return None


def describe(error: BaseException) -> str:
    """The error as the run's message shows it: type, message and traceback (the last ``MAX_CHARS`` characters)."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    head = f"{type(error).__name__}: {error}"
    return head if len(text) <= len(head) else f"{head}\n{text[-MAX_CHARS:]}"


async def record_error(uid: str, error: BaseException) -> None:
    """Report that the episode of task ``uid`` raised ``error`` (awaited, so the report lands before verl marks
    the task failed)."""
    actor = _actor()
    if actor is not None:
        await actor.add.remote(uid, describe(error))


def recorded_errors(uids: Iterable[str]) -> dict[str, str]:
    """The errors recorded for ``uids`` (those that have one)."""
    actor = _actor()
    if actor is None:
        return {}
    import ray

    return ray.get(actor.get.remote(list(uids)))
