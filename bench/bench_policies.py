"""Benchmark: step time of the CPU quickstart with one shared model vs one model (or LoRA adapter) per role.

Each configuration runs the CPU recipe (``recipes/at_grpo_cpu``, relay-v0, the same tiny model for every
policy) through verl's ``main_ppo`` for the same steps and batch; the script prints, per configuration,
the start-up time (process start to the first step's end minus that step), the mean step time and the
time per token (steps 2..N; step 1 warms up), and the ratios to the shared model.

"Equal total tokens": the batch, K, T and response length are the same, so every configuration samples
and trains on the same number of sequences of the same lengths (``perf/total_num_tokens`` is printed;
it differs only by what the policies sample).

What the CPU figure means: the cost of a second worker group, rollout server and weight sync, and of
running log-probs and the update once per policy on half the rows, on a 2-core machine where every
process competes for the same cores. It does not predict the GPU overhead (+4-14 % wall time published
for separate models on shared GPUs): there, per-policy work is kernel-bound and the second model's
memory and context switches matter, not Python and process overheads.

Usage (about 3-4 minutes per run on 2 cores):
    python bench/bench_policies.py --steps 6 [--configs shared per_role_models per_role_lora per_role_lora_stacks]
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

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
CONFIGS = {
    "shared": ["mas_policies=shared"],
    "per_role_models": ["mas_policies=per_role_models"],
    "per_role_lora": ["mas_policies=per_role_lora"],  # one resident base, an adapter per role (mas.lora_base=shared)
    "per_role_lora_stacks": ["mas_policies=per_role_lora", "mas.lora_base=per_policy",  # a stack per adapter
                             "mas.per_role.model.lora.merge=true"],
}


def run(name: str, steps: int, work: Path) -> tuple[list[dict], float]:
    run_dir = work / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir))
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(RECIPE), *CONFIGS[name], f"trainer.total_training_steps={steps}"],
                          env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if "timing_s/step" in m], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_policies_"))
    print(f"relay-v0 CPU recipe, {args.steps} steps each; runs in {work}", flush=True)
    print(f"{'config':>16} | {'wall':>6} | {'start-up':>8} | {'step s':>7} | {'ms/token':>8} | {'tokens/step':>11} | "
          f"{'update s':>8} | {'sync s':>6}", flush=True)
    rows = {}
    for name in args.configs:
        steps, wall = run(name, args.steps, work)
        later = steps[1:] or steps
        step_s = statistics.mean(m["timing_s/step"] for m in later)
        tokens = statistics.mean(m["perf/total_num_tokens"] for m in later)
        per_token = 1e3 * sum(m["timing_s/step"] for m in later) / sum(m["perf/total_num_tokens"] for m in later)
        startup = wall - sum(m["timing_s/step"] for m in steps)
        rows[name] = (step_s, per_token, startup)
        print(f"{name:>16} | {wall:>5.0f}s | {startup:>7.0f}s | {step_s:>7.2f} | {per_token:>8.3f} | {tokens:>11.0f} | "
              f"{statistics.mean(m['timing_s/update_actor'] for m in later):>8.2f} | "
              f"{statistics.mean(m['timing_s/update_weights'] for m in later):>6.2f}", flush=True)
    if "shared" in rows:
        base = rows["shared"]
        for name, (step_s, per_token, startup) in rows.items():
            if name != "shared":
                print(f"{name} / shared: step time x{step_s / base[0]:.2f}, time per token x{per_token / base[1]:.2f}, "
                      f"start-up x{startup / base[2]:.2f}")


if __name__ == "__main__":
    main()
