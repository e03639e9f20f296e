"""verl's own CPU tests for the modules verl_mas touches still pass with verl_mas installed.

verl_mas registers a platform, a rollout backend, and (with the training issue) an advantage estimator,
an agent loop and a trainer mode through verl's plugin entry point, which loads in every ``import verl``.
These are verl's tests for those registries and their neighbours, run from the verl wheel as shipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: verl's CPU test files (shipped in the verl wheel's top-level ``tests`` package) per module verl_mas touches.
VERL_TEST_FILES = [
    # advantage estimators (register_adv_est, GRPO variants)
    "trainer/ppo/test_core_algos_on_cpu.py",
    "trainer/test_multi_trajectories_advantage_on_cpu.py",
    # agent loops (register, output schema, server contract)
    "experimental/agent_loop/test_agent_loop_extra_fields_schema_on_cpu.py",
    "experimental/agent_loop/test_audio_server_contract_on_cpu.py",
    "experimental/agent_loop/test_call_tool_on_cpu.py",
    "experimental/agent_loop/test_tool_call_id_on_cpu.py",
    # single controller: the colocated (fused) worker classes verl_mas's per-policy worker groups are built from.
    # (verl's other single-controller tests each start a Ray of their own for ~20-60 s: the @register dispatch modes
    # (test_decorator) run in every main_ppo run of this suite, at one and two ranks, with the plugin in every worker;
    # auto padding, parallel put and worker environment variables are Ray helpers verl_mas does not call.)
    "single_controller/test_fused_workers_on_cpu.py",
]


def _verl_tests_dir() -> Path:
    import verl

    tests_dir = Path(verl.__file__).resolve().parent.parent / "tests"
    if not (tests_dir / "trainer").is_dir():
        pytest.fail(
            f"verl's test files are not at {tests_dir}: the verl==0.9.1 wheel ships them as a top-level 'tests' "
            "package in site-packages. Reinstall verl from the wheel (pip install --force-reinstall verl==0.9.1)."
        )
    return tests_dir


@pytest.mark.slow
def test_verls_cpu_tests_pass_with_verl_mas_installed(tmp_path: Path) -> None:
    tests_dir = _verl_tests_dir()
    files = [str(tests_dir / f) for f in VERL_TEST_FILES]
    missing = [f for f in files if not Path(f).exists()]
    assert not missing, f"verl test files moved: {missing}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    # Run from a scratch dir with verl's own defaults (not this project's pytest settings).
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path), *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"\n[verl-own-cpu-tests] with verl_mas installed: {summary}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    # The plugin really was active in that run (not silently skipped).
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, verl; print('verl_mas._plugin' in sys.modules)"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert probe.stdout.strip().endswith("True"), probe.stderr
