"""The data command line: ``python -m verl_mas.data <workflow-id> --out DIR --train N --test M --seed S``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from verl_mas.data import DEFAULT_PATIENCE, TaskSpaceError, write_dataset


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, write the two parquet files, print their paths; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m verl_mas.data",
        description="Write train.parquet and test.parquet (verl's RLHF format, one task per row, train and "
        "test disjoint by content) for a workflow that implements generate_task.",
    )
    parser.add_argument("workflow", help="workflow id, e.g. relay-v0, or 'package.module:Class'")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, required=True, help="number of training tasks")
    parser.add_argument("--test", type=int, required=True, help="number of test tasks")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    parser.add_argument(
        "--patience", type=int, default=DEFAULT_PATIENCE,
        help="draws in a row without a new task before the task space counts as exhausted",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        train_path, test_path = write_dataset(
            args.workflow, args.out, args.train, args.test, args.seed, patience=args.patience
        )
    except (TaskSpaceError, TypeError, LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.train} train tasks: {train_path}")
    print(f"{args.test} test tasks: {test_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
