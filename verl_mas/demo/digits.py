"""A one-role GRPO smoke task for the CPU stack: answer with digits; the reward is the digit fraction.

It exercises stock verl (``main_ppo``, the GRPO estimator, a custom reward function) on the tiny model
with the ``cpu`` platform and the ``hf`` rollout backend. The reward is dense (a random policy scores
about 0.1-0.4), so a learning signal exists from the first step.

Usage::

    python -m verl_mas.demo.digits --out DIR [--train 64 --test 16 --seed 0]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "verl_mas/digits"

_SUBJECTS = ("apples", "boxes", "steps", "cells", "moves", "tests", "rows", "paths")


def make_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """Rows in verl's RLHF dataset format (chat prompt, data source, reward model block)."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        subject = rng.choice(_SUBJECTS)
        prompt = f"Count the {subject}: {a} and {b}. Reply with digits only."
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt}],
                "ability": "digits",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any) -> float:
    """Fraction of the response's non-space characters that are digits (0 for an empty response)."""
    chars = [c for c in solution_str if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isdigit() for c in chars) / len(chars)


def write_dataset(out: str | Path, *, train: int = 64, test: int = 16, seed: int = 0) -> tuple[Path, Path]:
    import pandas as pd

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", train), ("test", test)):
        path = out_dir / f"{split}.parquet"
        pd.DataFrame(make_rows(n, seed, split)).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_mas.demo.digits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = write_dataset(args.out, train=args.train, test=args.test, seed=args.seed)
    print(f"wrote {train} and {test}")


if __name__ == "__main__":
    main()
