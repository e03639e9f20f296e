"""The exception types of the workflow API: who is at fault decides how a failure is handled.

- :class:`WorkflowError`: a bug in workflow code (or a broken contract such as an unrewarded
  candidate). It stops the episode and names the workflow, role and turn.
- :class:`InfraError`: the serving infrastructure failed (server error, dead replica, timeout). The
  affected candidates are kept in the record as *not trainable* and counted; they are never trained on
  with a made-up reward.
- :class:`LLMClientError`: an :class:`~verl_mas.client.LLMClient` broke its contract (wrong number of
  samples, log-probs that do not match the tokens). A bug in the client, raised as is.

A model mistake (unparsable output, failing code) is none of these: it is a reward decision. So is a
prompt that outgrows the model's context (:class:`ContextOverflowError`): the episode ends as a failure.
"""

from __future__ import annotations

import asyncio

__all__ = ["INFRA_EXCEPTIONS", "ContextOverflowError", "InfraError", "LLMClientError", "WorkflowError"]


class WorkflowError(RuntimeError):
    """Workflow code raised, or broke the workflow contract; the message names workflow, role and turn."""


class InfraError(RuntimeError):
    """The infrastructure failed: LLM serving (server error, lost replica, timeout) or code execution
    (:class:`verl_mas.sandbox.SandboxError`).

    Raised by workflow code (e.g. from the sandbox), it aborts the episode without training on the
    unrewarded candidates. Clients raise it (or return a :class:`~verl_mas.client.Sample` with ``error`` set) so that the
    engine marks the affected candidates as not trainable instead of crashing or training on them.
    """


class ContextOverflowError(Exception):
    """The next prompt does not fit the model's context: raised by ``generate()``, it ends the episode.

    The episode ends truncated, as a failure (``mas/success`` 0, ``mas/context_overflow`` 1); the
    groups sampled before stay trainable. Workflow code must let it propagate (do not catch it).
    """


class LLMClientError(RuntimeError):
    """An LLM client returned something that violates the :class:`~verl_mas.client.LLMClient` contract."""


#: Exceptions from an LLM client that count as infrastructure failures. Anything else a client raises
#: is a bug and propagates (wrapped in :class:`LLMClientError`). ``asyncio.TimeoutError`` is listed
#: separately because it is not the builtin ``TimeoutError`` on Python 3.10.
INFRA_EXCEPTIONS: tuple[type[BaseException], ...] = (InfraError, TimeoutError, asyncio.TimeoutError, ConnectionError)
