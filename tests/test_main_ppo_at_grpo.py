"""AT-GRPO end to end through verl's stock main_ppo on CPU: the CPU quickstart recipe for a few steps (the first
test at data-parallel 2: two ranks, two hf rollout replicas).

Runs ``recipes/at_grpo_cpu/run.sh`` (relay-v0, tiny model with the workflow's vocabulary, the mas agent
loop, the at_grpo estimator and the mas trainer mode) and reads verl's per-step metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mas.config import ABLATIONS

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
STEPS = 3
#: Data-parallel ranks: the one policy's actor on two ranks, verl's hf rollout as two replicas (one per rank).
DP = 2


@pytest.mark.slow
def test_at_grpo_trains_a_two_role_workflow_through_main_ppo(tmp_path: Path, recipe_runs) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir))
    # The quickstart's settings (K=8, mas.drop_zero_variance, 2-task mini-batches) on 8 tasks a step, validated
    # after the last step only, at data-parallel 2.
    proc = subprocess.run(
        ["bash", str(RECIPE), f"trainer.total_training_steps={STEPS}", "data.train_batch_size=8",
         f"trainer.n_gpus_per_node={DP}", f"ray_kwargs.ray_init.num_gpus={DP}",
         "trainer.val_before_train=false", f"trainer.test_freq={STEPS}", f"mas.record.every_n_steps={STEPS}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    # What run.sh sets for a small machine keeps two floods out of the log (each repeated in every process or
    # every TransferQueue call: hundreds of lines of a `make demo` were these).
    out = proc.stdout + proc.stderr
    print(f"[main-ppo-at-grpo] run.sh printed {len(out.splitlines())} lines for {STEPS} steps")
    assert "should not exceed total physical CPU cores" not in out and "engine is not available" not in out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    dropped_steps = 0
    for m in metrics:
        d = m["data"]
        print(
            f"[main-ppo-at-grpo] step {m['step']}: success={d['mas/success_rate']:.3f} "
            f"caller_reward={d['mas/caller/reward/mean']:.3f} runner_reward={d['mas/runner/reward/mean']:.3f} "
            f"groups={d['mas/group/count']:.0f} size={d['mas/group/size_mean']:.2f} "
            f"zero_std={d['mas/group/zero_std_frac']:.2f} adv=[{d['critic/advantages/min']:.2f}, "
            f"{d['critic/advantages/max']:.2f}] grad_norm={d.get('actor/grad_norm', float('nan')):.3f} "
            f"rollout_probs_diff={recipe_runs.gap(d):.1e} step_s={d['timing_s/step']:.1f} "
            f"dropped={d['mas/drop/rows']:.0f}/{d['mas/drop/rows'] + d['mas/drop/rows_kept']:.0f} rows "
            f"score_mean={d['critic/score/mean']:.3f} tokens={d['perf/total_num_tokens']} "
            f"replica requests={'+'.join(str(round(d[f'mas/rollout/replica{r}/requests'])) for r in range(DP))} "
            f"sessions={d['mas/rollout/sessions']:.0f} split={d['mas/rollout/sessions_split']:.0f} "
            f"rank tokens={d['global_seqlen/min']:.0f}..{d['global_seqlen/max']:.0f}"
        )
        # Per-role and group metrics are logged every step.
        for key in ("mas/caller/reward/mean", "mas/runner/reward/mean", "mas/caller/turns", "mas/success_rate",
                    "mas/group/size_mean", "mas/group/zero_std_frac", "mas/group/singleton_frac", "mas/infra_failures"):
            assert key in d, key
        # Tree sampling with K=8 and no infrastructure failure: every (task, role, turn) group has 8 members
        # (the one-prompt-per-group check ran on this batch, or the step would have raised), sampled from 1 prompt.
        assert d["mas/group/size_mean"] == 8.0 and d["mas/group/singleton_frac"] == 0.0
        assert d["mas/group/prompts_mean"] == 1.0
        # The zero-variance groups left verl's log-probs and update, not its data metrics: critic/score/mean is
        # the mean reward of every row (mas/reward/mean, computed before the drop; it was the kept rows' mean,
        # 0.138 against 0.03-0.05, when the drop removed rows from verl's batch), and perf/total_num_tokens
        # counts every row (3 prompt tokens and 1-3 response tokens each, plus at most 7 padding rows that
        # round the kept rows to whole mini-batches of whole per-rank shares: 4 mini-batches of a multiple of 2
        # rows, verl_mas.minibatch.batch_multiple_for), not only the kept ones.
        rows, kept = d["mas/drop/rows"], d["mas/drop/rows_kept"]
        flat = round(d["mas/group/zero_std_frac"] * d["mas/group/count"])
        assert rows == 8 * flat and kept + rows == 8 * d["mas/group/count"]
        assert abs(d["critic/score/mean"] - d["mas/reward/mean"]) < 1e-6
        assert 4 * (kept + rows) <= d["perf/total_num_tokens"] <= 6 * (kept + rows + 7)
        # Two replicas: every (episode, role) session (8 tasks x 2 roles) on one of them, both used, and every
        # replica takes every sync (step 1: the one after start-up and the one before the step).
        assert (d["mas/rollout/sessions"], d["mas/rollout/sessions_split"]) == (16, 0.0)
        assert all(d[f"mas/rollout/replica{r}/requests"] > 0 for r in range(DP))
        assert [d[f"mas/rollout/replica{r}/weight_updates"] for r in range(DP)] == [2.0 if m["step"] == 1 else 1.0] * DP
        assert d["mas/infra_failures"] == 0.0
        assert d["mas/episodes"] == 8.0
        # Metrics of verl's log-prob pass describe only the rows that trained: named so, never verl's names.
        assert not {"actor/entropy", "training/rollout_probs_diff_mean"} & set(d)
        assert "mas/kept/actor/entropy" in d
        # The rollout samples from the weights being trained.
        assert d["mas/kept/training/rollout_probs_diff_mean"] < 1e-6
        if rows:
            dropped_steps += 1
    assert dropped_steps > 0  # the drop happened, so the checks above compared two different row sets
    # The bytes the rollout's two replicas loaded (one policy logs them too): the relay tiny model's state dict
    # (hidden 64, 2 layers, vocabulary 82; 27 tensors, the tied lm_head among them) holds 133,952 fp32 values =
    # 535,808 bytes a sync and replica; the sync after start-up and the one before step 1, then one a step.
    assert [m["data"]["mas/rollout/weight_bytes"] for m in metrics] == [DP * 2 * 535_808, DP * 535_808, DP * 535_808]
    # Validation after the last step: single-sample (mas.val_branching=1) episodes on the 16 test tasks, 4 sampled
    # at the training temperature (val_kwargs) and one greedy per task, read by its 4 sessions (mas.val_greedy), reported by verl from
    # the agent loop's reward_extra_info as val-core/<source>/acc/mean@4 and val-aux/<source>/acc_greedy/mean@4.
    last = metrics[-1]["data"]
    val = {k: last[k] for k in ("val-core/relay-v0/acc/mean@4", "val-aux/relay-v0/acc_greedy/mean@4")}
    print(f"[main-ppo-at-grpo] validation after step {STEPS}: {val}")
    assert all(0.0 <= v <= 1.0 for v in val.values())
    assert not any(k.startswith("val-") for m in metrics[:-1] for k in m["data"])
    # Episodes recorded for the viewer (mas.record): 4 of steps 1 and 3, 4 of the validation after step 3.
    files = sorted(p.name.rsplit("_", 1)[0] for p in (run_dir / "episodes").glob("episodes_*.jsonl"))
    assert files == ["episodes_train_step000001", "episodes_train_step000003", "episodes_val_step000003"]
    for path in (run_dir / "episodes").glob("episodes_*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        validation = "_val_" in path.name
        assert len(records) == 4 and {r["step"] for r in records} == {int(path.name.split("step")[1][:6])}
        for g in (g for r in records for g in r["groups"]):
            assert len(g["candidates"]) == (1 if validation else 8) and sum(c["committed"] for c in g["candidates"]) == 1
            if not validation:  # AT-GRPO advantages within the node: centred, zero when the rewards tie
                advantages = [c["advantage"] for c in g["candidates"]]
                assert abs(sum(advantages)) < 1e-5
                assert (len({c["reward"] for c in g["candidates"]}) == 1) == (set(advantages) == {0.0})
    # Across the run some groups have reward variance, so advantages are non-zero and the policy moves.
    assert max(m["data"]["critic/advantages/max"] for m in metrics) > 0
    assert min(m["data"]["critic/advantages/min"] for m in metrics) < 0
    assert max(m["data"].get("actor/grad_norm", 0.0) for m in metrics) > 0


# at_grpo: the test above; role_only_groups rides on the per-role-models run (tests/test_main_ppo_policies.py),
# trajectory_grpo on the external workflow's run (tests/test_external_workflow.py): one start-up, two claims each;
# trajectory_grpo_success scores rows with the outcome instead of the role's return, which differs from
# trajectory_grpo only in assign_groups (tests/test_trainer_accounting.py).
ELSEWHERE = {"at_grpo", "role_only_groups", "trajectory_grpo", "trajectory_grpo_success"}


def _module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_documented_ablation_runs_through_main_ppo_somewhere() -> None:
    carried = {*_module("test_external_workflow").RUNS.values(),
               _module("test_main_ppo_policies").PER_ROLE_MODELS_ABLATION}
    assert set(ABLATIONS) - ELSEWHERE == {"parallel_sampling"}
    assert carried == ELSEWHERE - {"at_grpo", "trajectory_grpo_success"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ABLATIONS) - ELSEWHERE))
def test_every_documented_ablation_runs_through_main_ppo(tmp_path: Path, name: str, recipe_runs) -> None:
    """The ablation on gridwalk-v0 (its recipe, recipes/gridwalk_cpu: the paper's comparisons are measured on it),
    which is also gridwalk's run through main_ppo: a step of its episodes, metrics and the recipe's settings."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), TRAIN_TASKS="16", TEST_TASKS="4")
    tasks = 4
    proc = subprocess.run(
        ["bash", str(REPO / "recipes" / "gridwalk_cpu" / "run.sh"), "trainer.total_training_steps=1",
         f"data.train_batch_size={tasks}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "trainer.val_before_train=false", "trainer.test_freq=-1",
         # every row through log-probs: a step whose groups are all flat still checks the rollout-vs-actor gap
         "mas.drop_zero_variance=false", *ABLATIONS[name]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    (m,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    d = m["data"]
    print(f"[main-ppo-ablation] {name} on gridwalk-v0: groups={d['mas/group/count']:.0f} "
          f"size={d['mas/group/size_mean']:.2f} singletons={d['mas/group/singleton_frac']:.2f} "
          f"zero_std={d['mas/group/zero_std_frac']:.2f} prompts={d['mas/group/prompts_mean']:.2f} "
          f"episodes={d['mas/episodes']:.0f} "
          f"success={d['mas/success_rate']:.3f} moves={d['mas/gridwalk/moves']:.2f} "
          f"bumps={d['mas/gridwalk/bumps']:.2f} "
          f"rollout_probs_diff={recipe_runs.gap(d):.1e}")
    assert recipe_runs.gap(d) < 1e-6 and d["mas/infra_failures"] == 0.0
    # (task, role, turn) groups of the 4 episodes' single candidates: never more than 4 members.
    assert d["mas/episodes"] == 4 * tasks and 1.0 <= d["mas/group/size_mean"] <= 4.0
    # The episodes diverge: from the scouts' first proposals on (the walker reads its scout's; after the first moves
    # the walkers stand in different cells) a (task, role, turn) group holds members of different prompts, so its
    # mean mixes states (the tree's groups never do: 1.0 in the AT-GRPO run). At turn 0 the scouts' group shares
    # the level's prompt, so the mean stays below the group size.
    assert 1.0 < d["mas/group/prompts_mean"] < d["mas/group/size_mean"]
    # gridwalk's episodes: one move a turn, the scout and the walker each acting once a turn, within the budget
    # (2-6 moves); a random tiny model rarely walks a shortest path.
    assert 2.0 <= d["mas/gridwalk/moves"] <= 6.0
    assert d["mas/scout/turns"] == d["mas/walker/turns"] == d["mas/gridwalk/moves"]
    assert 0.0 <= d["mas/gridwalk/followed"] <= 1.0 and d["mas/gridwalk/bumps"] <= d["mas/gridwalk/moves"]
    # One token an answer (data.max_response_length=1 in the recipe).
    assert d["response_length/max"] == 1.0
