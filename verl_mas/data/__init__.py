"""Task datasets for workflows: draw tasks with ``Workflow.generate_task`` and write verl's parquet files.

``python -m verl_mas.data <workflow-id> --out DIR --train N --test M --seed S`` writes
``DIR/train.parquet`` and ``DIR/test.parquet`` in verl's RLHF dataset format, one task per row:

=================  ================================================================================
``data_source``    the workflow id
``agent_name``     ``"mas"``: selects the verl_mas agent loop
``prompt``         ``[{"role": "user", "content": <short task summary>}]`` (verl requires a prompt;
                   the agent loop ignores it)
``extra_info``     ``{"index": i, "split": "train"|"test", "workflow": <id>, "task": <canonical JSON>}``;
                   the workflow is named so that any process resolves it: its id when built in or published
                   by entry point, else ``"package.module:Class"`` (:func:`verl_mas.registry.portable_spec`)
``reward_model``   ``{"style": "rule", "ground_truth": ""}`` (verl convention; unused)
=================  ================================================================================

Tasks are deduplicated by their canonical JSON (sorted keys, no spaces). The test split is drawn first;
the training split then skips every test task, so the two are disjoint **by content**, not only by
seed. Both depend only on (workflow id, seed, sizes). When the generator cannot produce enough distinct
tasks, writing fails with an error naming the numbers instead of silently returning fewer or overlapping
tasks.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_mas.registry import get_workflow, portable_spec, workflow_name
from verl_mas.workflow import Workflow

logger = logging.getLogger(__name__)

__all__ = [
    "AGENT_NAME",
    "DEFAULT_PATIENCE",
    "TaskSpaceError",
    "canonical_json",
    "draw_splits",
    "make_rows",
    "read_tasks",
    "write_dataset",
]

#: The ``agent_name`` of every row: the name the verl_mas agent loop is registered under.
AGENT_NAME = "mas"

#: Consecutive draws that yield no new task before the generator is declared exhausted.
DEFAULT_PATIENCE = 2000

#: The longest task summary written to the ``prompt`` column (the agent loop does not read it).
_SUMMARY_CHARS = 200

_SPLITS = ("train", "test")


class TaskSpaceError(ValueError):
    """A workflow's ``generate_task`` cannot supply the requested number of distinct tasks."""


def canonical_json(task: Any, *, where: str = "task") -> str:
    """The canonical JSON text of ``task`` (sorted keys, compact), the identity used to deduplicate.

    Raises:
        TypeError: When ``task`` is not a dict of plain JSON values (tuples, sets, NaN, non-str keys and
            other objects are rejected, because they would not read back as the same task).
    """
    if not isinstance(task, dict):
        raise TypeError(
            f"{where} is a {type(task).__name__} ({task!r:.80}); generate_task must return a dict, "
            "the payload handed to Workflow.run."
        )
    try:
        text = json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{where} {task!r:.120} is not JSON-serialisable ({e}). Tasks are stored as JSON in the parquet "
            "files; return only str, int, float, bool, None, list and dict values (str keys)."
        ) from e
    if json.loads(text) != task:
        raise TypeError(
            f"{where} {task!r:.120} does not survive a JSON round trip (it reads back as {text:.120}): a tuple, "
            "non-str key or similar changes type. Use lists and str keys so the workflow sees the task it was given."
        )
    return text


def _generator(cls: type[Workflow]) -> Callable[[random.Random, str], Any]:
    if getattr(cls.generate_task, "__func__", None) is Workflow.generate_task.__func__:
        raise TypeError(
            f"workflow {workflow_name(cls)!r} ({cls.__module__}.{cls.__qualname__}) has no task generator, so no "
            "dataset can be drawn for it. Define `@classmethod def generate_task(cls, rng: random.Random, "
            "split: str) -> dict` on the class, returning one JSON-serialisable task drawn with `rng`."
        )
    return cls.generate_task


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is {value!r}; it must be an int >= 0 (the number of tasks in that split)")
    return value


def _draw(
    generate: Callable[[random.Random, str], Any],
    rng: random.Random,
    split: str,
    count: int,
    exclude: set[str],
    *,
    name: str,
    patience: int,
    other: str,
) -> list[str]:
    """Draw ``count`` distinct canonical tasks not in ``exclude``; give up after ``patience`` fruitless draws."""
    found: list[str] = []
    seen: set[str] = set()
    misses = draws = excluded = 0
    while len(found) < count:
        draws += 1
        text = canonical_json(generate(rng, split), where=f"{name}.generate_task(rng, {split!r}) draw {draws}")
        if text in exclude:
            excluded += 1
            misses += 1
        elif text in seen:
            misses += 1
        else:
            seen.add(text)
            found.append(text)
            misses = 0
        if misses >= patience:
            raise TaskSpaceError(
                f"{name}: found only {len(found)} distinct {split} tasks of the {count} requested after {draws} draws "
                f"({patience} draws in a row gave nothing new"
                f"{f'; {excluded} draws repeated a {other} task' if exclude else ''}). The "
                f"generator's task space looks too small for the request: {split} tasks must be distinct from each "
                f"other{' and from the ' + other + ' split' if exclude else ''}, or train and test would overlap. "
                f"Ask for fewer tasks (--train/--test), or widen {name}.generate_task."
            )
    return found


def draw_splits(
    workflow: str | type[Workflow],
    train: int,
    test: int,
    seed: int = 0,
    *,
    patience: int = DEFAULT_PATIENCE,
) -> dict[str, list[str]]:
    """Draw disjoint train and test tasks (as canonical JSON) for ``workflow``.

    The test split is drawn first from its own seeded stream; the training split is drawn from another
    and skips every test task.

    Args:
        workflow: Workflow id, ``"module:Class"`` or class; it must implement ``generate_task``.
        train: Number of training tasks. test: Number of test tasks. seed: Seeds both streams.
        patience: Draws in a row without a new task after which the task space counts as exhausted.

    Returns:
        ``{"train": [...], "test": [...]}``: canonical JSON texts, in draw order.

    Raises:
        TypeError: For a workflow without ``generate_task``, or a task that is not plain JSON.
        TaskSpaceError: When the generator cannot supply enough distinct tasks.
    """
    cls = get_workflow(workflow)
    name = workflow_name(cls)
    generate = _generator(cls)
    train, test = _check_count("train", train), _check_count("test", test)
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience is {patience!r}; it must be an int >= 1")
    # One stream per split, keyed by id and seed: changing --train does not change the test set.
    test_rng = random.Random(f"verl_mas.data|{name}|{seed}|test")
    train_rng = random.Random(f"verl_mas.data|{name}|{seed}|train")
    test_tasks = _draw(generate, test_rng, "test", test, set(), name=name, patience=patience, other="test")
    train_tasks = _draw(
        generate, train_rng, "train", train, set(test_tasks), name=name, patience=patience, other="test"
    )
    return {"train": train_tasks, "test": test_tasks}


def _summary(name: str, task_json: str) -> str:
    text = f"{name} task {task_json}"
    return text if len(text) <= _SUMMARY_CHARS else text[: _SUMMARY_CHARS - 3] + "..."


def make_rows(workflow_id: str, split: str, tasks: list[str], spec: str | None = None) -> list[dict[str, Any]]:
    """Rows of verl's RLHF dataset format for canonical JSON ``tasks`` (see the module docstring).

    Args:
        spec: What ``extra_info.workflow`` names (default ``workflow_id``): a spec every process resolves
            (:func:`verl_mas.registry.portable_spec`).
    """
    if split not in _SPLITS:
        raise ValueError(f"split is {split!r}; it must be one of {_SPLITS}")
    return [
        {
            "data_source": workflow_id,
            "agent_name": AGENT_NAME,
            "prompt": [{"role": "user", "content": _summary(workflow_id, task)}],
            "extra_info": {"index": i, "split": split, "workflow": spec or workflow_id, "task": task},
            "reward_model": {"style": "rule", "ground_truth": ""},
        }
        for i, task in enumerate(tasks)
    ]


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # An explicit schema: an empty split still gets typed columns, and the types never depend on the data.
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    info = pa.struct([("index", pa.int64()), ("split", pa.string()), ("workflow", pa.string()), ("task", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("agent_name", pa.string()),
            ("prompt", pa.list_(message)),
            ("extra_info", info),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # never leave a half-written file under the final name


def write_dataset(
    workflow_id: str,
    out: str | os.PathLike[str],
    train: int,
    test: int,
    seed: int = 0,
    *,
    patience: int = DEFAULT_PATIENCE,
) -> tuple[Path, Path]:
    """Write ``out/train.parquet`` and ``out/test.parquet`` for ``workflow_id``.

    Args:
        workflow_id: A registered workflow id (or ``"module:Class"``) whose class implements
            ``generate_task``.
        out: Output directory (created if missing).
        train: Training tasks. test: Test tasks. seed: Dataset seed (same seed, same files).
        patience: See :func:`draw_splits`.

    Returns:
        ``(train_path, test_path)``.

    Raises:
        TypeError: For a workflow without ``generate_task``, or a task that is not plain JSON.
        TaskSpaceError: When the generator cannot supply ``train + test`` distinct tasks. Nothing is
            written then.
    """
    cls = get_workflow(workflow_id)
    name = workflow_name(cls)
    spec = portable_spec(cls)  # what verl's agent-loop workers can resolve: the id, or "package.module:Class"
    splits = draw_splits(cls, train, test, seed, patience=patience)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: out_dir / f"{split}.parquet" for split in _SPLITS}
    for split in _SPLITS:
        _write_parquet(make_rows(name, split, splits[split], spec=spec), paths[split])
    logger.info("wrote %d train and %d test tasks of %s to %s", train, test, name, out_dir)
    return paths["train"], paths["test"]


def write_split(workflow_id: str, tasks: list[Any], path: str | os.PathLike[str], split: str) -> Path:
    """Write given ``tasks`` (e.g. loaded from a published dataset file) as one split's parquet file.

    The split boundaries are the caller's (e.g. the paper's index ranges); nothing is drawn or deduplicated.

    Raises:
        ValueError: When ``tasks`` is empty (a wrong file, format or range should not yield an empty split).
    """
    if not tasks:
        raise ValueError(f"no tasks to write to {path}; check the source file, its format and the record range")
    rows = make_rows(workflow_id, split, [canonical_json(t, where=f"task {i}") for i, t in enumerate(tasks)])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_parquet(rows, out)
    logger.info("wrote %d %s tasks of %s to %s", len(tasks), split, workflow_id, out)
    return out


def read_tasks(parquet_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The tasks of a parquet file written by :func:`write_dataset`, in row order.

    Raises:
        ValueError: When the file lacks the ``extra_info.task`` column of the verl_mas row contract.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(parquet_path, columns=["extra_info"])
    tasks = []
    for i, info in enumerate(table.column("extra_info").to_pylist()):
        if not isinstance(info, dict) or not isinstance(info.get("task"), str):
            raise ValueError(
                f"{parquet_path} row {i}: extra_info is {info!r:.120}, without a JSON 'task' string. verl_mas reads "
                "tasks from extra_info.task; write datasets with `python -m verl_mas.data` (write_dataset)."
            )
        tasks.append(json.loads(info["task"]))
    return tasks

