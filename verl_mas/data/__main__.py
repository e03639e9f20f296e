"""The data command line: ``python -m verl_mas.data <workflow-id> --out DIR --train N --test M --seed S``.

From a published file: ``... --source FILE --format F --split train|test [--start A --stop B] [--max-tests N|all]``
(``--max-tests`` caps golden tests of the training split only; the test split keeps all of them).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from verl_mas.data import DEFAULT_PATIENCE, TaskSpaceError, write_dataset
from verl_mas.workflows.loaders import add_max_tests_flag, load_tasks, max_train_tests_flag


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, write the two parquet files, print their paths; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m verl_mas.data",
        description="Write train.parquet and test.parquet (verl's RLHF format, one task per row, train and "
        "test disjoint by content) for a workflow that implements generate_task.",
    )
    parser.add_argument("workflow", help="workflow id, e.g. relay-v0, or 'package.module:Class'")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=None, help="number of training tasks (generated tasks)")
    parser.add_argument("--test", type=int, default=None, help="number of test tasks (generated tasks)")
    published = parser.add_argument_group(
        "published dataset files (code-v0, math-v0, ...): write one split from a local file instead of generating"
    )
    published.add_argument("--source", default=None, help="local .jsonl/.json/.parquet file in its published format")
    published.add_argument("--format", default=None, help="apps|codecontests|livecodebench|aime|olympiadbench|polaris")
    published.add_argument("--split", default=None, choices=("train", "test"), help="which split the file becomes")
    published.add_argument("--start", type=int, default=0, help="first record (file order)")
    published.add_argument("--stop", type=int, default=None, help="one past the last record")
    add_max_tests_flag(published)
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    parser.add_argument(
        "--patience", type=int, default=DEFAULT_PATIENCE,
        help="draws in a row without a new task before the task space counts as exhausted",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.source is not None:
        if args.format is None or args.split is None:
            parser.error("--source needs --format and --split (the paper's splits are index ranges: --start/--stop)")
        max_train_tests = max_train_tests_flag(parser, args)
        from pathlib import Path

        from verl_mas.data import write_split

        try:
            tasks = load_tasks(args.source, args.format, split=args.split, start=args.start, stop=args.stop,
                               max_train_tests=max_train_tests)
            path = write_split(args.workflow, tasks, Path(args.out) / f"{args.split}.parquet", args.split)
        except (LookupError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{len(tasks)} {args.split} tasks: {path}")
        return 0
    if "max_tests" in vars(args):
        parser.error("--max-tests applies to tasks loaded from a published file (--source); generated tasks carry "
                     "the tests their workflow's generate_task gives them. Drop --max-tests, or add "
                     "--source/--format/--split.")
    if args.train is None or args.test is None:
        parser.error("--train and --test are required (or --source FILE --format F --split S for a published file)")
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
