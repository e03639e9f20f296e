"""Sandbox pieces that need no sandboxed process: config validation, output comparison, the backend
registry, and request/response shaping of the SandboxFusion backend (against a stub HTTP server)."""

from __future__ import annotations

import base64
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import verl_mas.sandbox as sandbox
from verl_mas.sandbox import (
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxFusionBackend,
    normalize_output,
    outputs_match,
)
from verl_mas.sandbox.backend import check_run_args
from verl_mas.sandbox.result import infer_killed_reason


# ---------------------------------------------------------------------------------------------- config
def test_defaults_are_valid_and_pool_follows_cpus():
    import os

    cfg = SandboxConfig()
    assert cfg.pool_size == len(os.sched_getaffinity(0))
    assert cfg.python_flags == ("-I",)
    # cpu_s defaults to ceil(timeout_s) + 1: with timeout 10.0 -> 11; with 2.5 -> 4.
    assert cfg.resolved_cpu_s() == 11
    assert SandboxConfig(timeout_s=2.5).resolved_cpu_s() == 4


def test_validate_reports_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        SandboxConfig(pool_size=0, timeout_s=-1, memory_mb=8, python_flags=("-u",), isolation="weird",
                      python="relative/python")
    text = str(info.value)
    assert "6 problem(s)" in text
    for key in ("pool_size", "timeout_s", "memory_mb", "python_flags", "isolation", "python"):
        assert f"mas.sandbox.{key}" in text


def test_from_dict_turns_lists_into_tuples_and_rejects_unknown_keys():
    cfg = SandboxConfig.from_dict({"timeout_s": 3, "python_flags": ["-I", "-B"], "hidden_paths": ["/root"]})
    assert cfg.python_flags == ("-I", "-B") and cfg.hidden_paths == ("/root",)
    assert hash(cfg) == hash(SandboxConfig.from_dict({"timeout_s": 3, "python_flags": ["-I", "-B"],
                                                      "hidden_paths": ["/root"]}))
    with pytest.raises(ValueError, match=r"unknown key.*'timeout'"):
        SandboxConfig.from_dict({"timeout": 3})


def test_time_budget_backstop_and_cpu_limit():
    cfg = SandboxConfig(timeout_s=2.5)
    # Backstop: backstop_factor (default 3) x the run's budget: 3 x 2.5 = 7.5 s; a per-call budget of 4 s: 12 s.
    assert (cfg.backstop_s(), cfg.backstop_s(4.0)) == (7.5, 12.0)
    # RLIMIT_CPU follows the run's budget: ceil(4.0) + 1 = 5 (config default: ceil(2.5) + 1 = 4); a set cpu_s wins.
    assert (cfg.resolved_cpu_s(), cfg.resolved_cpu_s(4.0)) == (4, 5)
    assert SandboxConfig(cpu_s=7).resolved_cpu_s(100.0) == 7
    for bad in (1, 0.5, True, "3"):  # the backstop must leave the program at least its budget
        with pytest.raises(ValueError, match="backstop_factor"):
            SandboxConfig(backstop_factor=bad)


def test_isolation_is_required_unless_explicitly_given_up():
    assert SandboxConfig().requires_isolation()  # the default fails closed
    assert not SandboxConfig(require_isolation=False).requires_isolation()
    assert not SandboxConfig(isolation="none").requires_isolation()  # the explicit opt-out
    assert SandboxConfig.from_dict({"require_isolation": True}).requires_isolation()
    with pytest.raises(ValueError, match="require_isolation"):
        SandboxConfig(require_isolation="no")


def test_contradictions_and_remote_without_url_are_rejected():
    with pytest.raises(ValueError, match="contradict"):
        SandboxConfig(isolation="none", require_isolation=True)
    with pytest.raises(ValueError, match="url is unset"):
        SandboxConfig(backend="sandbox_fusion")
    with pytest.raises(ValueError, match="without -I"):
        SandboxConfig(python_flags=("-E",))
    SandboxConfig(python_flags=("-E", "-s"))  # the spelled-out equivalent of -I is accepted


def test_run_python_argument_checks():
    with pytest.raises(ValueError) as info:
        check_run_args("x", 5, 0, 8, {"/etc/passwd": "x", "../up": "x", "main.py": "x", "ok.txt": 3})
    text = str(info.value)
    assert "stdin is a int" in text and "timeout_s is 0" in text and "memory_mb is 8" in text
    assert "'/etc/passwd'" in text and "'../up'" in text and "'main.py'" in text and "files['ok.txt']" in text
    code, stdin, files = check_run_args("print(1)", "é", 1, 64, {"d/a.txt": "α", "b.bin": b"\x00"})
    assert (code, stdin, files) == (b"print(1)", "é".encode(), {"d/a.txt": "α".encode(), "b.bin": b"\x00"})


def test_sandboxes_in_one_process_get_disjoint_uids():
    from verl_mas.sandbox import LocalSandbox

    a = LocalSandbox(SandboxConfig(pool_size=3))
    b = LocalSandbox(SandboxConfig(pool_size=2))
    assert len(a.uids) == 3 and len(b.uids) == 2
    assert set(a.uids).isdisjoint(b.uids)
    assert min(a.uids) >= 65536


# ---------------------------------------------------------------------------------------------- results
def test_killed_reason_inference():
    # cpu limit 5 s: SIGXCPU (24) is the soft limit; SIGKILL after >= 5 s of CPU is the hard limit.
    assert infer_killed_reason(-24, 5.0, 5, "") == "cpu"
    assert infer_killed_reason(-9, 5.01, 5, "") == "cpu"
    assert infer_killed_reason(-9, None, 5, "") == "signal:9"
    assert infer_killed_reason(-25, 0.1, 5, "") == "file_size"
    assert infer_killed_reason(-11, 0.1, 5, "") == "signal:11"
    assert infer_killed_reason(1, 0.1, 5, "Traceback ...\n  x = bytearray(n)\nMemoryError\n") == "memory"
    assert infer_killed_reason(1, 0.1, 5, "Traceback ...\nValueError: MemoryError mentioned\n") is None
    assert infer_killed_reason(0, 0.1, 5, "MemoryError") is None


def test_exec_result_reports_missing_isolation():
    r = ExecResult(stdout="", stderr="", exit_code=0, timed_out=False, killed_reason=None, wall_s=0.1,
                   isolation={"network": True, "pid_namespace": False, "filesystem": True})
    assert r.ok
    assert r.missing_isolation == ("pid_namespace", "unprivileged_uid")


# ---------------------------------------------------------------------------------------------- judge
@pytest.mark.parametrize(("actual", "expected", "exact", "normalized", "tokens"), [
    ("3\n", "3\n", True, True, True),
    ("3", "3\n", False, True, True),  # missing final newline
    ("3  \r\n\n\n", "3\n", False, True, True),  # trailing spaces, CRLF, trailing blank lines
    ("1 2\n3\n", "1 2 3\n", False, False, True),  # same tokens, different line breaks
    (" 3\n", "3\n", False, False, True),  # leading space is part of the answer
    ("1\n\n2\n", "1\n2\n", False, False, True),  # inner blank line is kept
    ("4\n", "3\n", False, False, False),
])
def test_output_comparison_modes(actual, expected, exact, normalized, tokens):
    assert outputs_match(actual, expected, "exact") is exact
    assert outputs_match(actual, expected, "normalized") is normalized
    assert outputs_match(actual, expected, "tokens") is tokens


def test_normalize_output_and_unknown_mode():
    assert normalize_output("a \t\r\nb\r\n\r\n  \n") == "a\nb"
    assert normalize_output("") == ""
    with pytest.raises(ValueError, match="not one of"):
        outputs_match("a", "a", "fuzzy")


# ---------------------------------------------------------------------------------------------- registry
def test_registry_lists_builtins_and_rejects_unknown_backend():
    assert {"local", "sandbox_fusion"} <= set(sandbox.registered_backends())
    with pytest.raises(ValueError, match="not registered"):
        sandbox.get_sandbox({"backend": "nope"})
    with pytest.raises(ValueError, match="already registered"):
        sandbox.register_backend("local")(lambda cfg: None)


def test_get_sandbox_caches_per_config():
    cfg = SandboxConfig(backend="sandbox_fusion", url="http://127.0.0.1:9/run_code")
    a = sandbox.get_sandbox(cfg)
    assert isinstance(a, SandboxFusionBackend) and isinstance(a, sandbox.SandboxBackend)
    assert sandbox.get_sandbox({"backend": "sandbox_fusion", "url": "http://127.0.0.1:9/run_code"}) is a


# ---------------------------------------------------------------------------------------------- SandboxFusion
class _Stub(BaseHTTPRequestHandler):
    reply: dict = {}
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "body": body})
        data = json.dumps(type(self).reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def fusion_stub():
    _Stub.seen = []
    server = HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


async def test_fusion_request_and_response_round_trip(fusion_stub):
    _Stub.reply = {"status": "Success", "message": "", "compile_result": None,
                   "run_result": {"status": "Finished", "execution_time": 0.02, "return_code": 0,
                                  "stdout": "42\n", "stderr": ""}}
    backend = SandboxFusionBackend(SandboxConfig(backend="sandbox_fusion", url=fusion_stub, memory_mb=256))
    result = await backend.run_python("print(input())", "42\n", timeout_s=2.5, files={"d.txt": "hé"})
    (req,) = _Stub.seen
    assert req["path"] == "/run_code"
    assert req["body"] == {"code": "print(input())", "stdin": "42\n", "language": "python",
                           "compile_timeout": math.ceil(2.5), "run_timeout": 3, "memory_limit_MB": 256,
                           "files": {"d.txt": base64.b64encode("hé".encode()).decode()}, "fetch_files": []}
    assert (result.stdout, result.exit_code, result.timed_out, result.killed_reason) == ("42\n", 0, False, None)
    assert result.missing_isolation == sandbox.PROTECTIONS  # nothing verified locally


async def test_fusion_timeout_and_service_errors(fusion_stub):
    backend = SandboxFusionBackend(SandboxConfig(backend="sandbox_fusion", url=fusion_stub))
    _Stub.reply = {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "return_code": None,
                                                      "stdout": "partial", "stderr": ""}}
    result = await backend.run_python("while True: pass")
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    _Stub.reply = {"status": "SandboxError", "message": "runner crashed"}
    with pytest.raises(SandboxError, match="runner crashed"):
        await backend.run_python("print(1)")
    dead = SandboxFusionBackend(SandboxConfig(backend="sandbox_fusion", url="http://127.0.0.1:9/run_code"))
    with pytest.raises(SandboxError, match="unreachable"):
        await dead.run_python("print(1)")


def test_public_api_is_exported():
    for name in sandbox.__all__:
        assert hasattr(sandbox, name), name
