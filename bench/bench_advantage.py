"""Benchmark: at_grpo vs verl's grpo and grpo_vectorized advantage estimators (figures and ratios, one run).

Workload (performance-anchors.md): N rows, ~4 rows per group, string group keys, 8 response tokens.
at_grpo is timed from (task uid, role, turn) columns, i.e. including building the composite group ids,
and also from prebuilt composite string keys as verl's other estimators get them. A memory-bound pass
over the same rows (one multiply-add over the (N, 8) reward tensor) is the floor.

Usage: python bench/bench_advantage.py [--rows 100000 1000000] [--skip-grpo-above 200000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def _time(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--skip-grpo-above", type=int, default=2_000_000, help="verl's loop-based grpo is slow")
    args = parser.parse_args()

    import verl  # noqa: F401  (loads the plugin)
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_grpo_vectorized_outcome_advantage

    from verl_mas.advantage.at_grpo import at_grpo_advantages, compute_at_grpo_outcome_advantage
    from verl_mas.advantage.groups import group_ids, group_key

    print(f"{'rows':>9} | {'grpo':>8} | {'grpo_vec':>8} | {'at_grpo (cols)':>14} | {'at_grpo (keys)':>14} | {'floor':>7} | at/vec | at/floor")
    for n in args.rows:
        rng = np.random.default_rng(0)
        n_tasks = max(1, n // 8)
        task = rng.integers(0, n_tasks, n)
        role = rng.integers(0, 2, n)
        uids = np.array([f"task-{t:08d}" for t in task], dtype=object)
        roles = np.array(["tool", "planner"], dtype=object)[role]
        turns = np.zeros(n, dtype=np.int64)  # ~4 rows per (task, role) group
        keys = np.array([group_key(u, r, 0) for u, r in zip(uids, roles)], dtype=object)
        rewards = torch.zeros(n, 8)
        rewards[:, -1] = torch.rand(n)
        mask = torch.ones(n, 8)

        t_grpo = (
            _time(lambda: compute_grpo_outcome_advantage(rewards, mask, keys), repeat=1)
            if n <= args.skip_grpo_above
            else float("nan")
        )
        t_vec = _time(lambda: compute_grpo_vectorized_outcome_advantage(rewards, mask, keys))
        t_cols = _time(lambda: at_grpo_advantages(rewards.sum(-1), group_ids(uids, roles, turns)).unsqueeze(-1) * mask)
        t_keys = _time(lambda: compute_at_grpo_outcome_advantage(rewards, mask, index=keys, config=None))
        t_floor = _time(lambda: rewards.mul(mask).add_(mask))
        print(
            f"{n:>9} | {t_grpo:>7.3f}s | {t_vec:>7.3f}s | {t_cols:>13.3f}s | {t_keys:>13.3f}s | {t_floor:>6.4f}s"
            f" | {t_cols / t_vec:>6.2f} | {t_cols / t_floor:>7.0f}x"
        )
    print("anchors (2 cores): grpo 3.7 s / 42.8 s, grpo_vectorized 0.19 s / 2.1 s at 1e5 / 1e6 rows; target at/vec <= 1")


if __name__ == "__main__":
    main()
