"""Remote backend: runs code on a SandboxFusion service (the HTTP sandbox verl already integrates)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from verl_mas.sandbox.backend import check_run_args
from verl_mas.sandbox.config import SandboxConfig
from verl_mas.sandbox.result import ExecResult, SandboxError

__all__ = ["SandboxFusionBackend"]

logger = logging.getLogger(__name__)

_HTTP_SLACK_S = 30.0  # on top of the run's own timeout: queueing and transfer at the service


class SandboxFusionBackend:
    """Sends each run to SandboxFusion's ``/run_code`` endpoint (``mas.sandbox.url``).

    Isolation is the service's: `ExecResult.isolation` is empty because nothing is verified from here.
    Time limits are the service's too: its ``TimeLimitExceeded`` is reported as a timeout (it cannot tell
    machine load from the program's own time, unlike the local backend).
    Concurrency is bounded by ``config.pool_size`` requests in flight.

    Args:
        config: Must have ``backend: sandbox_fusion`` and ``url`` set.
    """

    def __init__(self, config: SandboxConfig) -> None:
        if not config.url:
            raise ValueError("SandboxFusionBackend needs mas.sandbox.url (e.g. http://HOST:8080/run_code).")
        self.config = config
        self.url: str = config.url
        self._sem = asyncio.Semaphore(config.pool_size)
        self._loop: asyncio.AbstractEventLoop | None = None

    def build_request(self, code: str, stdin: str | bytes = "", *, timeout_s: float | None = None,
                      memory_mb: int | None = None, files: Mapping[str, str | bytes] | None = None) -> dict[str, Any]:
        """The JSON body SandboxFusion expects for one Python run."""
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        encoded = {name: base64.b64encode(c.encode() if isinstance(c, str) else c).decode()
                   for name, c in (files or {}).items()}
        return {"code": code, "stdin": stdin.decode() if isinstance(stdin, bytes) else stdin,
                "language": "python", "compile_timeout": math.ceil(timeout), "run_timeout": math.ceil(timeout),
                "memory_limit_MB": self.config.memory_mb if memory_mb is None else memory_mb,
                "files": encoded, "fetch_files": []}

    def parse_response(self, payload: Mapping[str, Any], wall_s: float) -> ExecResult:
        """Turn SandboxFusion's reply into an `ExecResult`.

        Raises:
            SandboxError: The service reported its own failure (``status: SandboxError``) or no run result.
        """
        if payload.get("status") == "SandboxError":
            raise SandboxError(f"SandboxFusion failed (not the program's fault): {payload.get('message')!r}")
        run = payload.get("run_result")
        if not isinstance(run, Mapping):
            raise SandboxError(f"SandboxFusion returned no run_result: {json.dumps(payload)[:500]}")
        timed_out = run.get("status") == "TimeLimitExceeded"
        code = run.get("return_code")
        limit = self.config.max_output_bytes
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        return ExecResult(stdout=stdout[:limit], stderr=stderr[:limit], exit_code=code if isinstance(code, int)
                          else None, timed_out=timed_out, killed_reason="timeout" if timed_out else None,
                          wall_s=wall_s, cpu_s=None,
                          stdout_truncated=len(stdout) > limit, stderr_truncated=len(stderr) > limit,
                          isolation=MappingProxyType({}))

    async def run_python(self, code: str, stdin: str | bytes = "", *, timeout_s: float | None = None,
                         memory_mb: int | None = None,
                         files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        """Run ``code`` remotely; see `SandboxBackend.run_python`."""
        check_run_args(code, stdin, self.config.timeout_s if timeout_s is None else timeout_s,
                       self.config.memory_mb if memory_mb is None else memory_mb, files)
        body = self.build_request(code, stdin, timeout_s=timeout_s, memory_mb=memory_mb, files=files)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._sem = loop, asyncio.Semaphore(self.config.pool_size)
        async with self._sem:
            t0 = time.monotonic()
            payload = await asyncio.to_thread(self._post, body, body["run_timeout"] + _HTTP_SLACK_S)
            return self.parse_response(payload, time.monotonic() - t0)

    def _post(self, body: dict[str, Any], timeout: float) -> Mapping[str, Any]:
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - configured URL
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            raise SandboxError(f"SandboxFusion at {self.url} unreachable or replied garbage ({exc}); "
                               "check mas.sandbox.url and that the service is up.") from exc

    async def aclose(self) -> None:
        """Nothing to release (one HTTP request per run)."""
