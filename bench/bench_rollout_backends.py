"""Benchmark: the CPU quickstart on the ``hf`` rollout backend vs verl's own vLLM rollout (CPU build).

Both runs train the quickstart recipe (``recipes/at_grpo_cpu``, relay-v0, K=4, T=4) through verl's
``main_ppo`` for the same steps and batch, from the same tiny model (hidden 128: vLLM's CPU attention needs
head size >= 32, so both backends get that shape), ``hf`` in the main environment and ``vllm`` in the vLLM
one (``make vllm-env``). Printed per backend: start-up (process start to the end of step 1, minus step 1),
mean step time, generation time, generated tokens per second of generation (steps 2..N; step 1 warms up),
weight-sync time; then the vLLM / hf ratios.

What a CPU figure says: how the two serving stacks compare for tiny models on two shared cores, where a
request's cost is dominated by per-request overhead (scheduling, IPC between verl's server actor and vLLM's
engine process, Python) rather than by matrix multiplies. It says nothing about GPUs: there vLLM's paged
attention, continuous batching and CUDA graphs are what make it the serving engine of choice, and the
``hf`` backend is not meant to run at all.

Measured 2026-12-01 (2 shared cores, 5 steps, 508 samples of ~3 tokens a step): generation 431 tok/s on hf
vs 342 on vLLM (x0.79), step 10.7 s vs 12.2 s (x1.15), start-up 92 s vs 127 s, weight sync 27 vs 43 ms,
rollout-vs-actor gap ~3e-9 on both.

Usage (about 7 minutes on 2 cores):
    python bench/bench_rollout_backends.py --steps 5 [--vllm-python .venv-vllm/bin/python] [hydra overrides...]
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


def run(backend: str, python: str, steps: int, work: Path, overrides: list[str]) -> tuple[list[dict], float]:
    run_dir = work / backend
    subprocess.run([python, "-m", "verl_mas.tiny", "--out", str(run_dir / "model"), "--hidden-size", "128",
                    "--vocab-from", "relay-v0"], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=python, VERL_MAS_RUN_DIR=str(run_dir))
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(RECIPE), f"cpu_rollout={backend}", f"trainer.total_training_steps={steps}",
                           *overrides], env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if "timing_s/step" in m], wall


def summary(steps: list[dict], wall: float) -> dict[str, float]:
    later = steps[1:] or steps
    # mas/num_candidates is per episode; response_length/mean is per row of the batch.
    samples = [m["mas/num_candidates"] * m["mas/episodes"] for m in later]
    tokens = [m["response_length/mean"] * n for m, n in zip(later, samples)]
    return {
        "startup_s": wall - sum(m["timing_s/step"] for m in steps),
        "step_s": statistics.mean(m["timing_s/step"] for m in later),
        "gen_s": statistics.mean(m["timing_s/gen"] for m in later),
        "tokens_per_s": sum(tokens) / sum(m["timing_s/gen"] for m in later),
        "requests_per_step": statistics.mean(samples),
        "sync_s": statistics.mean(m["timing_s/update_weights"] for m in later),
        "gap": max(m["training/rollout_probs_diff_mean"] for m in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vllm-python", default=os.environ.get("VERL_MAS_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (e.g. data.max_response_length=16)")
    args = parser.parse_args()
    if not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"no vLLM environment at {args.vllm_python}: build it with `make vllm-env`.")
    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_backends_"))
    print(f"relay-v0 CPU quickstart, {args.steps} steps per backend {args.overrides or ''}; runs in {work}", flush=True)
    print(f"{'backend':>8} | {'start-up':>8} | {'step s':>7} | {'gen s':>6} | {'gen tok/s':>9} | {'samples/step':>12} | "
          f"{'sync s':>6} | {'max gap':>7}", flush=True)
    rows = {}
    for backend, python in (("hf", sys.executable), ("vllm", os.path.abspath(args.vllm_python))):
        r = rows[backend] = summary(*run(backend, python, args.steps, work, args.overrides))
        print(f"{backend:>8} | {r['startup_s']:>7.0f}s | {r['step_s']:>7.2f} | {r['gen_s']:>6.2f} | "
              f"{r['tokens_per_s']:>9.1f} | {r['requests_per_step']:>12.0f} | {r['sync_s']:>6.3f} | {r['gap']:>7.1e}",
              flush=True)
    hf, vl = rows["hf"], rows["vllm"]
    print(f"vllm / hf: generation throughput x{vl['tokens_per_s'] / hf['tokens_per_s']:.2f}, step time "
          f"x{vl['step_s'] / hf['step_s']:.2f}, start-up x{vl['startup_s'] / hf['startup_s']:.2f}")
    print("On two CPU cores with a tiny model, per-request overhead dominates both backends; this ratio does not "
          "predict GPU serving, where vLLM's batching and kernels are the point and the hf backend does not run.")


if __name__ == "__main__":
    main()
