"""The data command line: ``python -m verl_mas.data <workflow-id> --out DIR --train N --test M --seed S``.

From a published file: ``... --source FILE --format F --split train|test [--start A --stop B] [--max-tests N|all]
[--include-generated] [--require-solution]``, which writes ``DIR/<split>.parquet`` (``--max-tests`` caps golden
tests of the training split only; the test split keeps all of them). Formats: :mod:`verl_mas.data.loaders`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_mas.data import DEFAULT_PATIENCE, TaskSpaceError, write_dataset, write_split
from verl_mas.data.loaders import DEFAULT_MAX_TESTS, load_tasks


def _add_max_tests_flag(parser: Any) -> None:  # an ArgumentParser or argument group
    """Add ``--max-tests N|all``; read it back with :func:`_max_train_tests`."""

    def parse(text: str) -> int | None:
        if text.strip().lower() == "all":
            return None
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1 or 'all'")
        return int(text)

    parser.add_argument(
        "--max-tests", type=parse, default=argparse.SUPPRESS, metavar="N|all",
        help=f"--split train only: golden tests kept per code task, public first (default {DEFAULT_MAX_TESTS}; 'all': "
        "no cap). --split test always keeps every golden test, so that success means passing all of them",
    )


def _max_train_tests(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """The ``max_train_tests`` for parsed ``args``; a parser error when ``--max-tests`` comes with ``--split test``."""
    if "max_tests" not in vars(args):
        return DEFAULT_MAX_TESTS
    if args.split == "test":
        parser.error("--max-tests caps the golden tests of the training split only; test tasks keep every golden test "
                     "(a capped test set inflates accuracy). Drop --max-tests, or use --split train.")
    return args.max_tests


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
    _add_max_tests_flag(published)
    published.add_argument("--include-generated", action="store_true",
                           help="codecontests: also use generated_tests (the paper used public + private)")
    published.add_argument("--require-solution", action="store_true",
                           help="code: skip tasks without a golden solution (the tester's reward needs one)")
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
        max_train_tests = _max_train_tests(parser, args)
        try:
            tasks = load_tasks(args.source, args.format, split=args.split, start=args.start, stop=args.stop,
                               max_train_tests=max_train_tests, include_generated=args.include_generated,
                               require_solution=args.require_solution)
            path = write_split(args.workflow, tasks, Path(args.out) / f"{args.split}.parquet", args.split)
        except (LookupError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{len(tasks)} {args.split} tasks: {path}")
        return 0
    loader_flags = [flag for flag, given in (("--max-tests", "max_tests" in vars(args)),
                                             ("--include-generated", args.include_generated),
                                             ("--require-solution", args.require_solution)) if given]
    if loader_flags:
        parser.error(f"{', '.join(loader_flags)} applies to tasks loaded from a published file (--source); generated "
                     "tasks carry the tests their workflow's generate_task gives them. Drop "
                     f"{', '.join(loader_flags)}, or add --source/--format/--split.")
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
