"""Benchmark: how the cost of a CPU run grows with roles, policies and data-parallel ranks.

Each configuration runs the CPU quickstart recipe (``recipes/at_grpo_cpu``, the same tiny model, batch, K and
turns) through verl's ``main_ppo`` for the same steps: relay-v0 (2 roles) or relay-chain-v0 (3 roles), one shared
policy or one model per role (2 or 3 policies), on 1 or 2 data-parallel ranks (logical GPU slots; verl then
starts one rollout replica per rank and policy). While a run trains, a sampler reads the resident memory (RSS)
of every Ray process of the run every 0.5 s. Printed per configuration: the mean step time (steps 2..N; step 1
warms up), the time per token, the peak resident bytes summed over the run's processes and the largest single
process, the number of processes, and each figure's ratio to the first configuration (2 roles, 1 policy, 1 rank)
measured in the same invocation.

What a CPU figure says: the cost of more worker groups, rollout servers, weight syncs and gloo ranks as processes
that compete for the same 2 cores, and the memory each process holds (dominated by Python, torch and verl, not by
the 0.1M-parameter model). It does not predict GPU scaling: there a rank brings its own device, work per rank is
kernel-bound, and memory is the model's weights, optimiser state and KV cache per device, which grow with the
model, not with the process count.

Usage (3-4 minutes a configuration on 2 cores):
    python bench/bench_scale.py --steps 4 [--configs r2-p1-d1 r3-p3-d2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
WORKFLOWS = {2: "relay-v0", 3: "relay-chain-v0"}


def configs() -> dict[str, tuple[int, int, int]]:
    """``r<roles>-p<policies>-d<ranks>`` -> (roles, policies, ranks): one shared policy or one per role."""
    return {f"r{r}-p{p}-d{d}": (r, p, d) for r in (2, 3) for p in (1, r) for d in (1, 2)}


class RssSampler:
    """Peak resident bytes of a process tree's members, sampled in a thread (the sum over processes, and the
    largest one), and how many processes it had at most."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        self.root, self.period = root, period
        self.peak_total = self.peak_one = self.processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                tree = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sizes = []
            for proc in tree:
                try:
                    sizes.append(proc.memory_info().rss)
                except psutil.NoSuchProcess:  # exited between the listing and the read
                    continue
            self.peak_total = max(self.peak_total, sum(sizes))
            self.peak_one = max(self.peak_one, max(sizes, default=0))
            self.processes = max(self.processes, len(sizes))


def run(name: str, roles: int, policies: int, ranks: int, steps: int, work: Path) -> dict[str, float]:
    run_dir = work / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), WORKFLOW=WORKFLOWS[roles],
               RAY_TMPDIR=str(work / "ray"))
    overrides = [f"mas_policies={'shared' if policies == 1 else 'per_role_models'}",
                 f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
                 f"trainer.n_gpus_per_node={ranks}", f"ray_kwargs.ray_init.num_gpus={ranks}"]
    start = time.perf_counter()
    # Ray's head runs in this process tree (address: local), so every worker's memory is sampled.
    proc = subprocess.Popen(["bash", str(RECIPE), *overrides], env=env, cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    with RssSampler(proc.pid) as rss:
        _, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    metrics = [json.loads(line)["data"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_done = [m for m in metrics if "timing_s/step" in m]
    later = steps_done[1:] or steps_done
    return {"wall s": wall, "step s": statistics.fmean(m["timing_s/step"] for m in later),
            "ms/token": 1e3 * sum(m["timing_s/step"] for m in later) / sum(m["perf/total_num_tokens"] for m in later),
            "RSS GiB": rss.peak_total / 2**30, "max proc GiB": rss.peak_one / 2**30, "procs": float(rss.processes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=list(configs()), choices=list(configs()),
                        help="r<roles>-p<policies>-d<ranks>; the first is the baseline of the ratios")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_scale_"))
    print(f"CPU quickstart recipe, {args.steps} steps a configuration; runs in {work}", flush=True)
    columns = ("wall s", "step s", "ms/token", "RSS GiB", "max proc GiB", "procs")
    print(f"{'config':>9} | " + " | ".join(f"{c:>12}" for c in columns), flush=True)
    results: dict[str, dict[str, float]] = {}
    for name in args.configs:
        results[name] = run(name, *configs()[name], steps=args.steps, work=work)
        print(f"{name:>9} | " + " | ".join(f"{results[name][c]:>12.2f}" for c in columns), flush=True)
    base_name = args.configs[0]
    base = results[base_name]
    print(f"\nratios to {base_name}:")
    for name, figures in results.items():
        print(f"{name:>9} | " + " | ".join(f"{figures[c] / base[c]:>11.2f}x" for c in columns))


if __name__ == "__main__":
    main()
