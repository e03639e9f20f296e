"""verl's stock ``main_ppo`` (GRPO) end to end on CPU with the cpu platform and the hf rollout backend.

The run uses the recipe users run (``recipes/grpo_cpu_smoke/run.sh``), reads verl's own per-step metrics
from its file logger, and checks that the rollout samples from the weights being trained: verl's
``training/rollout_probs_diff_mean`` (mean |p_rollout - p_actor| over response tokens) stays at float
noise when weights are synced every step, and grows by orders of magnitude when the sync is broken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_cpu_smoke" / "run.sh"
STEPS = 3
#: fp32 actor vs fp32 rollout on identical weights differ by ~1e-9 per token (float noise); one PPO step
#: at lr 1e-3 without sync moves probabilities by ~1e-4. 1e-6 sits between them with margin both ways.
SYNC_TOLERANCE = 1e-6


def rollout_sync_problems(metrics: list[dict], tolerance: float = SYNC_TOLERANCE) -> list[str]:
    """Steps whose rollout-vs-actor probability gap says the rollout did not sample from the actor."""
    return [
        f"step {m['step']}: training/rollout_probs_diff_mean={m['data']['training/rollout_probs_diff_mean']:.3e} > {tolerance:.0e}"
        for m in metrics
        if m["data"]["training/rollout_probs_diff_mean"] > tolerance
    ]


def run_recipe(run_dir: Path, *overrides: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    full_env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), **env)
    proc = subprocess.run(
        ["bash", str(RECIPE), f"trainer.total_training_steps={STEPS}", *overrides],
        cwd=run_dir.parent,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    metrics_file = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return proc, metrics


def _show(metrics: list[dict], topic: str) -> None:
    for m in metrics:
        d = m["data"]
        print(
            f"[{topic}] step {m['step']}: rollout_probs_diff_mean={d['training/rollout_probs_diff_mean']:.2e} "
            f"grad_norm={d['actor/grad_norm']:.3f} score={d['critic/score/mean']:.3f} step_s={d['timing_s/step']:.1f}"
        )


@pytest.mark.slow
def test_grpo_main_ppo_trains_on_cpu_with_synced_rollout(tmp_path: Path) -> None:
    proc, metrics = run_recipe(tmp_path / "synced")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print()
    _show(metrics, "main-ppo-grpo-synced")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["data"]["actor/grad_norm"] > 0
        # GRPO normalises within groups, so advantages are non-zero whenever rewards differ in a group.
        assert m["data"]["critic/advantages/max"] > 0
    assert rollout_sync_problems(metrics) == []
    # The checkout stays clean: Hydra wrote into the run directory, not ./outputs.
    assert (tmp_path / "synced" / "hydra").is_dir()
    assert not (REPO / "outputs").exists()


@pytest.mark.slow
def test_broken_weight_sync_is_detected(tmp_path: Path) -> None:
    # Negative control: the same run with the rollout ignoring weight updates must fail the check.
    proc, metrics = run_recipe(tmp_path / "frozen", VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print()
    _show(metrics, "main-ppo-grpo-frozen-rollout")
    problems = rollout_sync_problems(metrics)
    # Step 1 samples before any update, so actor and rollout still agree; every later step must be flagged.
    assert [p.split(":")[0] for p in problems] == [f"step {s}" for s in range(2, STEPS + 1)], problems
