"""Benchmark: held-out learning on the CPU quickstart, AT-GRPO vs trajectory-level GRPO vs parallel sampling.

Every configuration runs the quickstart recipe (``recipes/at_grpo_cpu``, its settings as ``make demo`` runs
them) through verl's ``main_ppo`` for the same number of steps, with the same number of samples per task
(K candidates per node, or K independent episodes per task; :func:`verl_mas.config.ablation`), for several
seeds (the seed sets the tiny model's initialisation, the data order and the rollout's sampling):

- ``at_grpo``: tree sampling (K candidates per (task, role, turn), best committed) + agent_turn groups;
- ``traj_grpo``: K independent episodes per task, each role's return in an episode (its per-turn team and local
  rewards summed: the same reward signal AT-GRPO normalises per turn) normalised over the task's K episodes, one
  advantage per (episode, role) broadcast to its rows (classic GRPO with AT-GRPO's rewards);
- ``traj_grpo_success`` (not run by default): the same with the episode's binary team outcome as every row's
  score (``mas.trajectory_reward=success``): sparser than AT-GRPO's rewards, so a gap to it mixes reward
  density with grouping;
- ``parallel``: K independent episodes per task with (task, role, turn) groups (the paper's ablation: after
  the first turn the K members of a group no longer share a prompt);
- ``at_grpo_all_rows`` (not run by default): AT-GRPO with ``mas.drop_zero_variance=false``, every row through
  the log-probs and the update: the measurement behind the recipe's default (mean step time and its parts are
  printed per run).

What is compared is held-out team success: verl's validation on the test tasks before training and after
the last step, one candidate per node (``mas.val_branching=1``), greedy (``acc_greedy``) and sampled at the
training temperature (``val-core/<source>/acc/mean@n``; the recipe's ``val_kwargs``). Training success (the
mean of the last 5 steps) is printed too, but it is not comparable across configurations: tree sampling
commits the best of K at every node, parallel sampling commits its only sample.

The script prints one line per run, then per configuration the mean +- std (over seeds) of held-out greedy
and sampled success after training, and for each baseline the paired difference (AT-GRPO minus the
baseline, same seed) per seed, their mean, and whether AT-GRPO is above the baseline by more than the spread
across seeds (the larger of the two configurations' std).

Usage (a run takes about as long as ``make demo``: 9 runs by default, seeds in the outer loop)::

    python bench/bench_learning.py [--steps 40] [--seeds 0 1 2] [--configs at_grpo traj_grpo parallel] [--k 8]

Measured figures: ``recipes/at_grpo_cpu/README.md`` ("Held-out comparison").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_mas.config import ablation
from verl_mas.report import held_out, load_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"

#: bench name -> (verl_mas.config.ABLATIONS name, further overrides). ``at_grpo_all_rows`` is AT-GRPO with
#: ``mas.drop_zero_variance=false``: every row, zero-variance groups included, goes through log-probs and update.
CONFIGS = {
    "at_grpo": ("at_grpo", ()),
    "traj_grpo": ("trajectory_grpo", ()),
    "traj_grpo_success": ("trajectory_grpo_success", ()),
    "parallel": ("parallel_sampling", ()),
    "at_grpo_all_rows": ("at_grpo", ("mas.drop_zero_variance=false",)),
}
DEFAULT_CONFIGS = ("at_grpo", "traj_grpo", "parallel")


def run_one(name: str, seed: int, steps: int, k: int, work: Path) -> tuple[list[dict], float]:
    run_dir = work / f"{name}-seed{seed}"
    env = {key: v for key, v in os.environ.items() if not key.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), MODEL_SEED=str(seed))
    ablation_name, extra = CONFIGS[name]
    overrides = [*ablation(ablation_name, k), *extra, f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
                 "trainer.val_before_train=true", f"data.seed={seed}", f"actor_rollout_ref.actor.data_loader_seed={seed}",
                 f"actor_rollout_ref.rollout.seed={seed}", f"trainer.experiment_name={name}-seed{seed}",
                 "mas.record.dir=null"]
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(RECIPE), *overrides], env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return load_metrics(run_dir / "metrics.jsonl"), time.perf_counter() - start


def summary(rows: list[dict]) -> dict[str, float]:
    """Held-out greedy/sampled success at the first and last validation, and training success at the end."""
    series = held_out(rows)
    greedy = next((v for label, v in series.items() if label.endswith(" greedy")), None)
    sampled = next((v for label, v in series.items() if " sampled " in label), None)
    if greedy is None or sampled is None or len(greedy) < 2 or len(sampled) < 2:
        raise RuntimeError(f"the run logged held-out series {list(series)} with {[len(v) for v in series.values()]} "
                           "validations; it needs greedy and sampled success before and after training")
    steps = [r for r in rows if "mas/success_rate" in r]
    train = [r["mas/success_rate"] for r in steps]
    return {"greedy@0": greedy[0][1], "greedy@end": greedy[-1][1], "sampled@0": sampled[0][1],
            "sampled@end": sampled[-1][1], "train end": statistics.fmean(train[-5:]),
            **{f"{phase} s": statistics.fmean(r.get(f"timing_s/{phase}", 0.0) for r in steps)
               for phase in ("step", "gen", "old_log_prob", "update_actor")}}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--k", type=int, default=8, help="samples per task and node (the quickstart's mas.branching)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_learning_"))
    print(f"quickstart recipe, {args.steps} steps, K={args.k}, seeds {args.seeds}; runs in {work}", flush=True)
    columns = ("greedy@0", "greedy@end", "sampled@0", "sampled@end", "train end", "step s", "gen s", "old_log_prob s",
               "update_actor s")
    print(f"{'config':>10} | {'seed':>4} | " + " | ".join(f"{c:>11}" for c in columns) + " |   wall", flush=True)
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in args.configs}
    for seed in args.seeds:
        for name in args.configs:
            rows, wall = run_one(name, seed, args.steps, args.k, work)
            results[name][seed] = figures = summary(rows)
            print(f"{name:>10} | {seed:>4} | " + " | ".join(f"{figures[c]:>11.3f}" for c in columns)
                  + f" | {wall:>5.0f}s", flush=True)
    print("\nheld-out success after training, mean +- std over seeds:")
    for name, by_seed in results.items():
        parts = [f"{c} {m:.3f} +- {s:.3f}" for c in ("greedy@end", "sampled@end", "train end", "step s")
                 for m, s in [_mean_std([f[c] for f in by_seed.values()])]]
        print(f"{name:>10} ({len(by_seed)} seeds): " + ", ".join(parts))
    base = results.get("at_grpo", {})
    for name, by_seed in results.items():
        if name == "at_grpo" or not base:
            continue
        seeds = sorted(set(base) & set(by_seed))
        for column in ("greedy@end", "sampled@end"):
            diffs = [base[s][column] - by_seed[s][column] for s in seeds]
            spread = max(_mean_std([base[s][column] for s in seeds])[1], _mean_std([by_seed[s][column] for s in seeds])[1])
            mean = statistics.fmean(diffs)
            verdict = "yes" if mean > spread and min(diffs) > 0 else "no"
            print(f"at_grpo - {name} ({column}): per seed " + " ".join(f"{d:+.3f}" for d in diffs)
                  + f"; mean {mean:+.3f}; spread across seeds {spread:.3f}; above by more than the spread: {verdict}")
    (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
