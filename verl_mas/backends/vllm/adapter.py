"""verl's vLLM adapter in the trainer worker, per policy, with a weight sync that fails instead of hanging.

verl instantiates :class:`PolicyServerAdapter` (registered for ``(vllm, async)``) in every trainer worker
and streams the actor's weights through it after each step. Two things differ from verl's
``ServerAdapter``, which it subclasses:

- a tagged policy (``rollout.custom.mas_policy``) finds its own servers and weight socket (see
  :mod:`.replica`); an untagged config uses verl's;
- the full-weight sync (``wire_format="named_tensors"``) watches the vLLM side while it sends. verl's
  sender waits for each bucket's acknowledgement with a blocking receive and no timeout, and the vLLM
  workers acknowledge a bucket only after loading it, so a load that raises (a shape mismatch, a dropped
  parameter) left the trainer waiting forever. Here the rank holding the server handle polls and fails as
  soon as the server's load call fails, with the cause; every rank fails after
  :data:`~verl_mas.backends.vllm.WEIGHT_SYNC_TIMEOUT_ENV` seconds without a receiver or an acknowledgement.

The delta-weight path (``wire_format="delta_flush"``, CUDA IPC only) is verl's, unchanged.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
import zmq
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

from verl_mas.backends.vllm import PLUGIN_NAME, WEIGHT_SYNC_TIMEOUT_ENV, server_name_prefix, weight_socket_job
from verl_mas.policies.configs import rollout_policy

__all__ = ["PolicyServerAdapter", "WatchedWeightSender", "WeightSyncError"]

#: How often (ms) a waiting sender checks the vLLM side for a failure.
_POLL_MS = 200
#: How long (ms) an acknowledgement may trail the receiving call's return.
_ACK_GRACE_MS = 2000
_DEFAULT_TIMEOUT_S = 900.0


class WeightSyncError(RuntimeError):
    """The vLLM rollout did not take the actor's weights: training on would sample from stale weights."""


class _WatchedSocket:
    """The sender's ZMQ socket, whose ``send_pyobj`` and ``recv`` poll and call ``check`` between polls
    (a REQ socket's send blocks while no receiver is connected, its receive until the answer comes)."""

    def __init__(self, socket: Any, check: Callable[[float], None]) -> None:
        self._socket = socket
        self._check = check

    def _wait(self, event: int) -> None:
        started = time.monotonic()
        while not self._socket.poll(_POLL_MS, event):
            self._check(time.monotonic() - started)

    def send_pyobj(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        self._wait(zmq.POLLOUT)
        return self._socket.send_pyobj(obj, *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        self._wait(zmq.POLLIN)
        return self._socket.recv(*args, **kwargs)

    def ack_ready(self, timeout_ms: int) -> bool:
        return bool(self._socket.poll(timeout_ms, zmq.POLLIN))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


class WatchedWeightSender(BucketedWeightSender):
    """verl's bucketed sender, failing when the receiving call fails or no acknowledgement comes in time.

    Args:
        receiver: The Ray object ref of the server's load call (None on ranks without the server handle:
            they rely on the timeout, and on the first rank failing the whole worker group's call).
        describe: Names the sync in errors ("policy runner, replica 0, step 3").
        timeout_s: Seconds to wait for the receiver to connect, and for each acknowledgement.
    """

    def __init__(self, *, receiver: Any, describe: str, timeout_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.receiver = receiver
        self.describe = describe
        self.timeout_s = timeout_s

    def _init_socket(self) -> None:
        super()._init_socket()
        self.socket = _WatchedSocket(self.socket, self.check)

    def check(self, waited_s: float) -> None:
        """Raise :class:`WeightSyncError` if the receiving call ended or ``waited_s`` exceeds the timeout."""
        if self.receiver is not None and ray.wait([self.receiver], timeout=0)[0]:
            try:
                ray.get(self.receiver)
            except Exception as exc:
                raise WeightSyncError(_failure_message(self.describe, exc)) from exc
            # The workers acknowledge the last bucket just before their call returns: give the
            # acknowledgement a moment to arrive before calling it missing.
            if isinstance(self.socket, _WatchedSocket) and self.socket.ack_ready(_ACK_GRACE_MS):
                return
            raise WeightSyncError(
                f"Weight sync ({self.describe}): the vLLM server's load call returned before acknowledging every "
                "weight bucket, so part of the weights was never loaded. This is a verl/vLLM version mismatch; "
                "use the versions verl 0.9.1 pins (make vllm-env)."
            )
        if waited_s > self.timeout_s:
            raise WeightSyncError(
                f"Weight sync ({self.describe}): the vLLM workers neither took nor acknowledged the weights for "
                f"{waited_s:.0f} s. They are dead or stuck, and the rollout would sample from stale weights. Check the "
                "vLLM server's log "
                f"above; {WEIGHT_SYNC_TIMEOUT_ENV} sets the wait (now {self.timeout_s:.0f} s)."
            )


#: A traceback's exception lines ("AssertionError: ...", "ray.exceptions.RaySystemError: ...").
_EXCEPTION_LINE = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)): (.*)$")


def _cause(exc: BaseException) -> str:
    """The first exception a remote traceback names, and the last if another followed (a failing clean-up
    can replace the original error: verl's weight receiver raises BufferError when it closes its shared
    memory after a failed load)."""
    found = [m.group(0).strip() for m in map(_EXCEPTION_LINE.match, str(exc).splitlines()) if m]
    if not found:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return lines[-1] if lines else type(exc).__name__
    return found[0] if found[-1] == found[0] else f"{found[0]} (then: {found[-1]})"


def _failure_message(describe: str, exc: BaseException) -> str:
    cause = _cause(exc)
    fix = (
        "Check that the actor and the rollout load the same model (actor_rollout_ref.model.path, the policy's "
        "model.path override, rollout.dtype, LoRA settings)."
    )
    plugin = _cpu_plugin_problem()
    if plugin:
        fix = plugin
    elif "torch.Size([0])" in cause:
        fix = (
            "vLLM's CPU linear layers drop their weight tensors unless verl_mas's vLLM plugin is loaded in vLLM's "
            f"processes: install verl_mas into the vLLM environment (make vllm-env) and keep {PLUGIN_NAME!r} in "
            "VLLM_PLUGINS if that is set."
        )
    return (
        f"Weight sync ({describe}) failed in the vLLM workers: {cause}. The rollout would sample from stale "
        "weights, so the run stops. vLLM reports a worker's first error in the server's log above (a later "
        f"'Worker failed with error' can hide it). {fix}"
    )


def _cpu_plugin_problem() -> str | None:
    """Why verl_mas's vLLM plugin is kept out of vLLM's processes on the cpu platform, if it is."""
    from verl.utils.device import get_device_name

    allowed = os.environ.get("VLLM_PLUGINS")
    if get_device_name() != "cpu" or allowed is None or PLUGIN_NAME in allowed.split(","):
        return None
    return (
        f"VLLM_PLUGINS={allowed!r} keeps verl_mas's vLLM plugin ({PLUGIN_NAME!r}) out of vLLM's processes, and on the "
        "cpu platform vLLM's linear layers then drop their weight tensors ('into parameter (torch.Size([0]))'), so "
        f"no weight sync can load. Add {PLUGIN_NAME!r} to VLLM_PLUGINS or unset it."
    )


class PolicyServerAdapter(ServerAdapter):
    """verl's vLLM ``ServerAdapter`` with per-policy servers and sockets and a watched weight sync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = rollout_policy(self.config)
        if self.policy:
            job_id = ray.get_runtime_context().get_job_id()
            handle = self.zmq_handle.replace(f"-{job_id}-", f"-{weight_socket_job(job_id, self.policy)}-", 1)
            if handle == self.zmq_handle:
                raise RuntimeError(
                    f"verl's vLLM weight socket path {self.zmq_handle!r} does not contain the Ray job id {job_id!r}, "
                    f"so policy {self.policy!r} cannot get a socket of its own. verl_mas supports verl 0.9.1's path."
                )
            self.zmq_handle = handle
        self.weight_sync_timeout_s = float(os.environ.get(WEIGHT_SYNC_TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))

    def _get_server_name_prefix(self) -> str:
        return server_name_prefix(self.policy if hasattr(self, "policy") else rollout_policy(self.config))

    @torch.no_grad()
    async def update_weights(self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            return await super().update_weights(weights, global_steps=global_steps, wire_format=wire_format, **kwargs)
        # The server's load call runs while this rank sends; it returns once the last bucket is loaded.
        receiver = await self._execute_method("update_weights_from_ipc", non_block=True,
                                              kwargs={**kwargs, "use_shm": self.use_shm})
        describe = f"policy {self.policy or 'default'}, replica {self.replica_rank}, step {global_steps}"
        sender = WatchedWeightSender(
            receiver=receiver, describe=describe, timeout_s=self.weight_sync_timeout_s, zmq_handle=self.zmq_handle,
            bucket_size_mb=self.config.checkpoint_engine.update_weights_bucket_megabytes, use_shm=self.use_shm,
        )
        await sender.async_send_weights(weights)
        if receiver is not None:
            try:
                await receiver
            except Exception as exc:
                raise WeightSyncError(_failure_message(describe, exc)) from exc
        if self._has_server:
            await self.server_handle.clear_kv_cache.remote()
            if global_steps is not None:
                await self.server_handle.set_global_steps.remote(global_steps)


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
