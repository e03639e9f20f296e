"""verl's vLLM replica and server, with a name and a weight socket of their own for every tagged policy.

:class:`PolicyVLLMReplica` is what verl's ``RolloutReplicaRegistry`` returns for ``rollout.name=vllm`` once
verl_mas is loaded. For a config without ``rollout.custom.mas_policy`` (a single-policy run, or the first
policy of several) it launches verl's server under verl's names; a tagged policy's servers are named
``vllm_<policy>_server_<replica>_<node>`` and listen for weights on a socket path of their own
(:func:`verl_mas.backends.vllm.weight_socket_job`), which the policy's worker-side adapter
(:mod:`.adapter`) derives the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_mas.backends.vllm import server_name_prefix, weight_socket_job
from verl_mas.policies.configs import rollout_policy

__all__ = ["PolicyVLLMHttpServer", "PolicyVLLMReplica"]

#: The environment variable verl's server sets and its vLLM workers read to name their weight socket.
_JOB_ENV = "VERL_RAY_JOB_ID"
#: The collective call that loads one weight sync in verl's vLLM workers.
_WEIGHT_SYNC_RPC = "update_weights_from_ipc"


class PolicyVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server actor, counting requests and weight syncs, on a tagged policy's own weight socket."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = rollout_policy(self.config)
        # Read by the vLLM worker processes the server starts (launch_server), so set before they exist.
        os.environ[_JOB_ENV] = weight_socket_job(os.environ[_JOB_ENV], self.policy)
        self.requests_served = 0
        self.weight_updates = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await super().generate(*args, **kwargs)
        self.requests_served += 1
        return out

    async def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        out = await super().collective_rpc(method, *args, **kwargs)
        if method == _WEIGHT_SYNC_RPC:
            self.weight_updates += 1
        return out

    def stats(self) -> dict[str, int]:
        """Counters since start: requests served and weight syncs loaded (the trainer logs them per policy)."""
        return {"requests": int(self.requests_served), "weight_updates": int(self.weight_updates)}

    def weight_socket_job(self) -> str:
        """The job part of this server's weight socket path (tests compare it with the adapter's)."""
        return os.environ[_JOB_ENV]


class PolicyVLLMReplica(vLLMReplica):
    """verl's vLLM replica, launching :class:`PolicyVLLMHttpServer` under the policy's server names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(PolicyVLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return server_name_prefix(rollout_policy(self.config))


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
