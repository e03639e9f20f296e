"""``python -m verl_mas.run``: play one episode of a workflow and print it as a readable transcript.

Examples::

    python -m verl_mas.run toy-walk-v0 --llm random --seed 3
    python -m verl_mas.run toy-walk-v0 --llm scripted --reply planner=right --reply mover=right
    python -m verl_mas.run my_pkg.flows:MyWorkflow --task '{"a": 3, "b": 4}' --branching 2 --max-turns 3
    python -m verl_mas.run --list
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parse_replies(items: Sequence[str]) -> dict[str, list[str]]:
    replies: dict[str, list[str]] = {}
    for item in items:
        role, sep, text = item.partition("=")
        if not sep or not role:
            raise ValueError(f"--reply {item!r} is not ROLE=TEXT, e.g. --reply planner=right")
        replies.setdefault(role, []).append(text)
    return replies


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m verl_mas.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("workflow", nargs="?", help="workflow id (e.g. toy-walk-v0) or package.module:Class")
    parser.add_argument("--list", action="store_true", help="list the workflow ids that resolve, then exit")
    parser.add_argument(
        "--llm",
        choices=("random", "scripted"),
        default="random",
        help="random text, or the replies given with --reply (default: random)",
    )
    parser.add_argument(
        "--reply",
        action="append",
        default=[],
        metavar="ROLE=TEXT",
        help="a scripted reply for ROLE; repeat it (also per role) to cycle through several",
    )
    parser.add_argument("--task", help="the task as JSON (default: the workflow's example_task)")
    parser.add_argument("--branching", type=int, default=4, help="K candidates per group (default 4)")
    parser.add_argument("--max-turns", type=int, default=4, help="T turns at most (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1.0, help="team-reward weight (default 1)")
    parser.add_argument("--tie-break", choices=("first", "random"), default="first")
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: the tiny built-in tokenizer)")
    parser.add_argument("--record", metavar="FILE", help="also append the episode to FILE (JSON lines) for "
                        "python -m verl_mas.view")
    args = parser.parse_args(argv)

    from verl_mas.settings import EpisodeConfig
    from verl_mas.registry import get_workflow, registered_workflows
    from verl_mas.testing import ScriptedLLM, run_workflow

    if args.list:
        print("\n".join(registered_workflows()))
        return 0
    if not args.workflow:
        parser.error("give a workflow id (see --list)")
    try:
        EpisodeConfig(branching=args.branching, max_turns=args.max_turns, alpha=args.alpha, tie_break=args.tie_break)
        cls = get_workflow(args.workflow)
        task = json.loads(args.task) if args.task is not None else None
        if task is None and cls.example_task is None:
            raise ValueError(f"{args.workflow} has no example_task; pass --task JSON")
        if args.llm == "scripted":
            replies = _parse_replies(args.reply)
            if not replies:
                raise ValueError("--llm scripted needs replies: --reply ROLE=TEXT (one or more per role)")
            llm: object = ScriptedLLM(replies)
        else:
            llm = "random"
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (LookupError, ValueError, TypeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    episode = run_workflow(
        cls,
        task,
        llm,
        branching=args.branching,
        max_turns=args.max_turns,
        seed=args.seed,
        alpha=args.alpha,
        tie_break=args.tie_break,
        tokenizer=tokenizer,
    )
    print(episode.transcript())
    if args.record:
        from verl_mas.recording import episode_record, write_records
        from verl_mas.testing import default_tokenizer

        record = episode_record(episode, source="run", task=task if task is not None else cls.example_task,
                                tokenizer=tokenizer or default_tokenizer())
        print(f"recorded to {write_records(args.record, [record])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
