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
def _show(metrics: list[dict], topic: str) -> None:
    for m in metrics:
        d = m["data"]
        print(
            f"[{topic}] step {m['step']}: rollout_probs_diff_mean={d['training/rollout_probs_diff_mean']:.2e} "
            f"grad_norm={d['actor/grad_norm']:.3f} score={d['critic/score/mean']:.3f} step_s={d['timing_s/step']:.1f}"
        )


#: Steps 1-2 sample from synced weights; from step 3 on the rollout ignores weight updates (the diagnostic's
#: second phase: it loads the initial sync and step 1's, then ignores step 2's), so step 3 samples from the weights
#: of step 2 while the actor has moved on: the first step a broken sync can show.
SYNCED_STEPS, STEPS = 2, 3


@pytest.fixture(scope="module")
def phased_run(tmp_path_factory: pytest.TempPathFactory, recipe_runs) -> list[dict]:
    """The recipe for 3 steps, its rollout frozen from step 3 on (``VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS=after:2``):
    one start-up for the synced run and its negative control. Its steps' metrics."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    proc, metrics = recipe_runs.run(RECIPE, run_dir, steps=STEPS,
                                    VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS=f"after:{SYNCED_STEPS}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print()
    _show(metrics, "main-ppo-grpo")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # The checkout stays clean: Hydra wrote into the run directory, not ./outputs.
    assert (run_dir / "hydra").is_dir() and not (REPO / "outputs").exists()
    return metrics


@pytest.mark.slow
def test_grpo_main_ppo_trains_on_cpu_with_synced_rollout(phased_run, recipe_runs) -> None:
    for m in phased_run:
        assert m["data"]["actor/grad_norm"] > 0
        # GRPO normalises within groups, so advantages are non-zero whenever rewards differ in a group.
        assert m["data"]["critic/advantages/max"] > 0
    assert recipe_runs.sync_problems(phased_run[:SYNCED_STEPS]) == []


@pytest.mark.slow
def test_broken_weight_sync_is_detected(phased_run, recipe_runs) -> None:
    # Negative control: once the rollout ignores weight updates, the check must fail at the first step it can
    # (the actor moved at step 2: grad_norm > 0 above) and at every later one.
    problems = recipe_runs.sync_problems(phased_run)
    assert [p.split(":")[0] for p in problems] == [f"step {s}" for s in range(SYNCED_STEPS + 1, STEPS + 1)], problems
