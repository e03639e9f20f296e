"""verl's stock ``main_ppo`` (GRPO) end to end on CPU with the cpu platform and the hf rollout backend.

The run uses the recipe users run (``recipes/grpo_cpu_smoke/run.sh``), reads verl's own per-step metrics
from its file logger, and checks that the rollout samples from the weights being trained: verl's
``training/rollout_probs_diff_mean`` (mean |p_rollout - p_actor| over response tokens) stays at float
noise when weights are synced every step, and grows by orders of magnitude when the sync is broken.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_cpu_smoke" / "run.sh"
STEPS = 2  # step 2 samples after an update: the first step a broken sync can show


def _show(metrics: list[dict], topic: str) -> None:
    for m in metrics:
        d = m["data"]
        print(
            f"[{topic}] step {m['step']}: rollout_probs_diff_mean={d['training/rollout_probs_diff_mean']:.2e} "
            f"grad_norm={d['actor/grad_norm']:.3f} score={d['critic/score/mean']:.3f} step_s={d['timing_s/step']:.1f}"
        )


@pytest.mark.slow
def test_grpo_main_ppo_trains_on_cpu_with_synced_rollout(tmp_path: Path, recipe_runs) -> None:
    proc, metrics = recipe_runs.run(RECIPE, tmp_path / "synced", steps=STEPS)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print()
    _show(metrics, "main-ppo-grpo-synced")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["data"]["actor/grad_norm"] > 0
        # GRPO normalises within groups, so advantages are non-zero whenever rewards differ in a group.
        assert m["data"]["critic/advantages/max"] > 0
    assert recipe_runs.sync_problems(metrics) == []
    # The checkout stays clean: Hydra wrote into the run directory, not ./outputs.
    assert (tmp_path / "synced" / "hydra").is_dir()
    assert not (REPO / "outputs").exists()


@pytest.mark.slow
def test_broken_weight_sync_is_detected(tmp_path: Path, recipe_runs) -> None:
    # Negative control: the same run with the rollout ignoring weight updates must fail the check.
    proc, metrics = recipe_runs.run(RECIPE, tmp_path / "frozen", steps=STEPS, VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS="1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print()
    _show(metrics, "main-ppo-grpo-frozen-rollout")
    problems = recipe_runs.sync_problems(metrics)
    # Step 1 samples before any update, so actor and rollout still agree; every later step must be flagged.
    assert [p.split(":")[0] for p in problems] == [f"step {s}" for s in range(2, STEPS + 1)], problems
