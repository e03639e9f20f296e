"""The verl plugin: registered by verl's entry point in every process, loud when broken, inert unless selected.

Each scenario runs in a fresh interpreter (``subprocess``), because what is tested is what ``import verl``
does in a new process, and because the CPU platform must not leak into other tests.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest


# every scenario runs in a fresh interpreter (import verl: ~5 s each)
pytestmark = pytest.mark.slow

def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


REGISTRY_PROBE = """
    import json, sys
    import verl
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    print(json.dumps({
        "plugin_loaded": "verl_mas._plugin" in sys.modules,
        "platforms": sorted(PlatformRegistry.registered_names()),
        "rollout_replicas": sorted(RolloutReplicaRegistry._registry),
        "rollout_adapter": _ROLLOUT_REGISTRY.get(("hf", "async")),
        "vllm_adapter": _ROLLOUT_REGISTRY.get(("vllm", "async")),
        "estimator": __import__("verl.trainer.ppo.core_algos", fromlist=["x"]).ADV_ESTIMATOR_REGISTRY["at_grpo"].__module__,
        "agent_loop": __import__("verl.experimental.agent_loop.agent_loop", fromlist=["x"])._agent_loop_registry["mas"],
        "trainer": __import__("verl.trainer.ppo.v1", fromlist=["x"]).get_trainer_cls("mas").__module__,
    }))
"""


def test_entry_point_is_declared() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("verl_mas") == "verl_mas._plugin"


def test_import_verl_registers_the_plugin_in_a_fresh_interpreter() -> None:
    proc = _run(REGISTRY_PROBE)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["plugin_loaded"] is True
    assert "cpu" in state["platforms"]
    assert "hf" in state["rollout_replicas"]
    assert state["rollout_adapter"] == "verl_mas.backends.hf.adapter.HFServerAdapter"
    # verl's vllm entries point to verl_mas's policy-aware subclasses (imported only when a run selects vllm).
    assert "vllm" in state["rollout_replicas"]
    assert state["vllm_adapter"] == "verl_mas.backends.vllm.adapter.PolicyServerAdapter"
    assert state["estimator"] == "verl_mas.advantage.at_grpo"
    assert state["agent_loop"] == {"_target_": "verl_mas.agent_loop.MasAgentLoop"}
    assert state["trainer"] == "verl_mas.trainer"
    # Registration is silent when it works.
    assert "verl_mas failed to register" not in proc.stderr


def test_import_verl_registers_the_plugin_inside_a_ray_worker() -> None:
    # A Ray worker is a new process: verl's entry point must load the plugin there too (verl's Ray
    # workers import verl when they unpickle a verl class; here the task imports it explicitly).
    proc = _run(
        """
        import json, ray
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

        @ray.remote
        def probe():
            import os, sys
            before = "verl_mas._plugin" in sys.modules
            import verl
            from verl.workers.rollout.replica import RolloutReplicaRegistry
            return {"pid": os.getpid(), "before": before, "after": "verl_mas._plugin" in sys.modules,
                    "hf": "hf" in RolloutReplicaRegistry._registry}

        result = ray.get(probe.remote())
        import os
        result["driver_pid"] = os.getpid()
        print(json.dumps(result))
        ray.shutdown()
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["pid"] != result["driver_pid"]  # it really ran in another process
    assert result["before"] is False and result["after"] is True and result["hf"] is True


BREAK_CPU_PLATFORM = """
    import sys
    sys.modules["verl_mas.backends.cpu_platform"] = None  # any import of it now raises ImportError
"""


def test_a_broken_registration_logs_a_warning_with_the_fix() -> None:
    proc = _run(BREAK_CPU_PLATFORM + "    import verl\n    print('imported')\n")
    # verl swallows plugin errors, so the import itself succeeds...
    assert proc.returncode == 0, proc.stderr
    assert "imported" in proc.stdout
    # ...and our WARNING is the only trace: it names the failure and the fix.
    assert "verl_mas failed to register with verl" in proc.stderr
    assert "ModuleNotFoundError" in proc.stderr
    assert "VERL_USE_EXTERNAL_MODULES=verl_mas._plugin" in proc.stderr


def test_the_loud_fallback_raises_plugin_errors() -> None:
    proc = _run(BREAK_CPU_PLATFORM + "    import verl\n", VERL_USE_EXTERNAL_MODULES="verl_mas._plugin")
    assert proc.returncode != 0
    assert "ModuleNotFoundError" in proc.stderr


def test_stock_verl_is_unchanged_without_the_cpu_platform() -> None:
    proc = _run(
        """
        import json, os
        import verl
        from verl.utils import distributed, fsdp_utils
        from verl_mas.backends.cpu_platform import PlatformCPU
        print(json.dumps({
            "patched": getattr(distributed.initialize_global_process_group_ray, "_verl_mas_cpu", False)
            or getattr(fsdp_utils.CPUOffloadPolicy, "_verl_mas_cpu", False),
            "engine_device": os.environ.get("VERL_ENGINE_DEVICE"),
            "cpu_autodetected": PlatformCPU().is_platform_available(use_smi_check=True),
        }))
        """
    )
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state == {"patched": False, "engine_device": None, "cpu_autodetected": False}


def _run_cpu_rank(code: str, port_base: int) -> dict:
    """Run ``code`` as rank 0 of a one-process group on the CPU platform; its last stdout line is JSON."""
    proc = _run(
        code,
        VERL_PLATFORM="cpu",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port_base + os.getpid() % 1000),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_platform_runs_a_gloo_process_group_through_verls_own_initialiser() -> None:
    state = _run_cpu_rank(
        """
        import json, torch
        import verl
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device, get_device_id
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray(timeout_second=60)
        t = torch.ones(3, device=get_device_id())
        torch.distributed.all_reduce(t)
        free, total = get_torch_device().mem_get_info()
        print(json.dumps({"device": get_device_name(), "backend": get_nccl_backend(),
                          "sum": t.tolist(), "mem_ok": 0 < free <= total}))
        torch.distributed.destroy_process_group()
        """,
        port_base=29500,
    )
    assert state == {"device": "cpu", "backend": "gloo", "sum": [1.0, 1.0, 1.0], "mem_ok": True}


def test_cpu_platform_runs_verls_forward_only_fsdp2_offload_without_pinned_memory() -> None:
    """verl builds the reference model with FSDP2 ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an
    accelerator. On the CPU platform the engine's policy does not pin, and a sharded forward runs."""
    state = _run_cpu_rank(
        """
        import json, torch
        import verl
        from verl.utils.distributed import initialize_global_process_group_ray
        from verl.workers.engine.fsdp import transformer_impl
        from verl.utils.fsdp_utils import MixedPrecisionPolicy, fully_shard
        initialize_global_process_group_ray(timeout_second=60)
        policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)  # exactly what verl's engine asks for
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        expected = model(torch.ones(1, 4)).detach()
        fully_shard(model, offload_policy=policy, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        with torch.no_grad():
            got = model(torch.ones(1, 4))
        print(json.dumps({"pin_memory": policy.pin_memory, "max_diff": float((got - expected).abs().max())}))
        torch.distributed.destroy_process_group()
        """,
        port_base=30500,
    )
    assert state["pin_memory"] is False and state["max_diff"] < 1e-6


def test_verl_still_needs_the_cpu_overrides() -> None:
    """Pinned to verl 0.9.1: fails when verl changes what the CPU platform works around.

    If verl stops building ``cpu:gloo,{device}:{backend}`` or registers FSDP engines for ``cpu``, the
    overrides in verl_mas.backends.cpu_platform should be removed rather than kept by habit.
    """
    import verl
    from verl.utils import distributed
    from verl.workers.engine.base import EngineRegistry

    assert verl.__version__ == "0.9.1"
    original = getattr(distributed.initialize_global_process_group_ray, "__wrapped__", None) or (
        distributed.initialize_global_process_group_ray
    )
    assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in inspect.getsource(original)
    import verl.workers.engine  # noqa: F401  (registers the FSDP engines)

    fsdp2 = EngineRegistry._engines["language_model"]["fsdp2"]
    assert "cuda" in fsdp2 and "cpu" not in fsdp2
    from verl.workers.engine.fsdp import transformer_impl

    assert "CPUOffloadPolicy(pin_memory=True)" in inspect.getsource(transformer_impl)


@pytest.mark.parametrize("name", ["hf"])
def test_unknown_rollout_lists_the_available_ones(name: str) -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    with pytest.raises(ValueError, match=r"Available: \[.*'hf'"):
        RolloutReplicaRegistry.get("no-such-backend")
    assert RolloutReplicaRegistry.get(name).__name__ == "HFReplica"


#: Modules that import vLLM: importable only in the vLLM environment (tests/test_vllm_cpu.py imports them there).
VLLM_ONLY = {"verl_mas.backends.vllm.adapter", "verl_mas.backends.vllm.lora", "verl_mas.backends.vllm.replica"}


def _every_module() -> list[str]:
    import importlib.util
    import pkgutil

    import verl_mas

    skip = VLLM_ONLY if importlib.util.find_spec("vllm") is None else set()
    return sorted(m.name for m in pkgutil.walk_packages(verl_mas.__path__, "verl_mas.")
                  if not m.name.endswith("__main__") and m.name not in skip)


#: Runs every probe of the import-order test in a fork of one interpreter that has loaded the third-party libraries
#: verl imports (torch, tensordict, transformers, Ray: ~7 of the ~10 s an ``import verl`` takes here) and nothing of
#: verl or verl_mas, whose import order is what the probes vary. Two probes at a time; argv: the modules (JSON), the
#: probe's code after the module's import, a folder for each probe's exit status and output.
FORKED_PROBES = r"""
import json, os, sys, traceback
import numpy, omegaconf, ray, tensordict, torch, transformers
early = sorted(m for m in sys.modules if m.split(".")[0] in ("verl", "verl_mas"))
if early:
    raise SystemExit(f"the probes' parent imported {early}: each probe must import them itself")
modules, probe, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
running = {}

def reap():
    pid, status = os.wait()
    with open(os.path.join(out, f"{running.pop(pid)}.rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))

for i, module in enumerate(modules):
    while len(running) >= 2:
        reap()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(out, f"{i}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = 0
        try:
            exec(compile(f"import sys\nimport {module}\nif 'verl' not in sys.modules:\n    print('no-verl')\n"
                         f"    raise SystemExit(0)\n" + probe, f"<probe {module}>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    running[pid] = i
while running:
    reap()
"""


@pytest.mark.slow
def test_any_import_order_registers_everything(tmp_path) -> None:
    """Each verl_mas module imported first, then verl, in a new process: every registration is there.

    Before verl_mas._plugin deferred its registration, `import verl_mas.policies` first lost the mas trainer
    (a circular import inside verl's plugin loading) and `import verl_mas.backends.cpu_platform` first lost
    every registration, silently. A module whose import does not pull verl in cannot be caught half-imported
    by verl's plugin loading, so its probe stops there (the plain `import verl` case is tested above). Each probe
    is a fork of a process that holds the third-party libraries verl imports but neither verl nor verl_mas
    (FORKED_PROBES): the import order of those two is the same as in a fresh interpreter."""
    modules = _every_module()
    assert {"verl_mas.policies", "verl_mas.trainer", "verl_mas.backends.cpu_platform"} <= set(modules)
    out = tmp_path / "probes"
    out.mkdir()
    parent = _run(FORKED_PROBES, json.dumps(modules), textwrap.dedent(REGISTRY_PROBE), str(out))
    assert parent.returncode == 0, parent.stderr[-3000:]
    results = [(module, subprocess.CompletedProcess(
        module, int((out / f"{i}.rc").read_text()), (out / f"{i}.out").read_text(),
        (out / f"{i}.err").read_text())) for i, module in enumerate(modules)]
    expected = {"plugin_loaded": True, "rollout_adapter": "verl_mas.backends.hf.adapter.HFServerAdapter",
                "vllm_adapter": "verl_mas.backends.vllm.adapter.PolicyServerAdapter",
                "estimator": "verl_mas.advantage.at_grpo", "agent_loop": {"_target_": "verl_mas.agent_loop.MasAgentLoop"},
                "trainer": "verl_mas.trainer"}
    broken = {}
    pulled_verl = 0
    for module, proc in results:
        if proc.returncode != 0:
            broken[module] = proc.stderr[-600:]
            continue
        if proc.stdout.strip().endswith("no-verl"):
            continue
        pulled_verl += 1
        state = json.loads(proc.stdout.strip().splitlines()[-1])
        wrong = {k: state[k] for k, v in expected.items() if state[k] != v}
        if "cpu" not in state["platforms"] or "hf" not in state["rollout_replicas"]:
            wrong["platforms/rollouts"] = (state["platforms"], state["rollout_replicas"])
        if wrong or "verl_mas failed to register" in proc.stderr:
            broken[module] = wrong or proc.stderr[-600:]
    print(f"[plugin] {len(modules)} modules imported first ({pulled_verl} import verl themselves): "
          f"{len(modules) - len(broken)} register everything")
    assert pulled_verl >= 5  # the probe reached the modules that matter (policies, trainer, cpu_platform, ...)
    assert not broken, broken
