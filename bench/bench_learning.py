"""Benchmark: learning on the CPU quickstart workflow, AT-GRPO vs trajectory-level GRPO vs parallel sampling.

Each configuration runs the same recipe (``recipes/at_grpo_cpu``) through verl's ``main_ppo`` for the same
number of steps, for several seeds, and the script prints the final team success rate and the first step
at which success reached the threshold (``-`` if never):

- ``at_grpo``: tree sampling (K candidates per (task, role, turn), best committed) + agent_turn groups;
- ``traj_grpo``: K independent episodes per task (rollout.n=K), every sample scored with its episode's
  team outcome, one group per task (classic GRPO);
- ``parallel``: K independent episodes per task with (task, role, turn) groups (the paper's ablation:
  after the first turn the K members of a group no longer share a prompt).

Caveat: the printed success is that of the *training* episodes. Under tree sampling every node commits
the best of K candidates, so its success is above single-sample accuracy; under parallel sampling each
episode is one sample. The fair comparison is single-sample test accuracy of the trained models
(``python -m verl_mas.evaluate --branching 1`` on merged checkpoints), which this script does not do yet.

Usage (about 10 minutes per run on 2 cores; 9 runs by default):
    python bench/bench_learning.py --steps 60 --seeds 0 1 2 [--workflow relay-v0] [--threshold 0.6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"

CONFIGS: dict[str, list[str]] = {
    "at_grpo": ["mas.sampling=tree", "mas.grouping=agent_turn", "mas.branching=4", "actor_rollout_ref.rollout.n=1"],
    "traj_grpo": ["mas.sampling=parallel", "mas.grouping=trajectory", "mas.branching=1", "actor_rollout_ref.rollout.n=4"],
    "parallel": ["mas.sampling=parallel", "mas.grouping=agent_turn", "mas.branching=1", "actor_rollout_ref.rollout.n=4"],
}


def run_one(name: str, seed: int, steps: int, workflow: str, work: Path) -> list[dict]:
    run_dir = work / f"{name}-seed{seed}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), WORKFLOW=workflow)
    overrides = [*CONFIGS[name], f"trainer.total_training_steps={steps}", f"actor_rollout_ref.actor.data_loader_seed={seed}",
                 f"data.seed={seed}", f"trainer.experiment_name={name}-seed{seed}"]
    proc = subprocess.run(["bash", str(RECIPE), *overrides], env=env, capture_output=True, text=True, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workflow", default="relay-v0")
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_learning_"))
    print(f"workflow {args.workflow}, {args.steps} steps, seeds {args.seeds}, threshold {args.threshold}; runs in {work}")
    print(f"{'config':>10} | {'seed':>4} | {'success@1':>9} | {'final':>6} | {'steps to thr':>12} | {'wall':>6}")
    for name in args.configs:
        finals = []
        for seed in args.seeds:
            start = time.perf_counter()
            metrics = run_one(name, seed, args.steps, args.workflow, work)
            success = [m["data"].get("mas/success_rate", float("nan")) for m in metrics]
            reached = next((m["step"] for m, s in zip(metrics, success) if s >= args.threshold), None)
            final = sum(success[-5:]) / len(success[-5:])  # mean of the last 5 steps: less noisy than one step
            finals.append(final)
            print(f"{name:>10} | {seed:>4} | {success[0]:>9.2f} | {final:>6.2f} | {reached if reached else '-':>12} | "
                  f"{time.perf_counter() - start:>5.0f}s")
        print(f"{name:>10} | mean | {'':>9} | {sum(finals) / len(finals):>6.2f} |")


if __name__ == "__main__":
    main()
