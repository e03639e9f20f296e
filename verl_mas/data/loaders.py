"""Task loaders for the code and math workflows: published dataset files -> task dicts.

Nothing here downloads: every loader reads a local ``.jsonl``, ``.json`` or ``.parquet`` file in the
format its dataset is published in. Where to get the files and the splits the paper used are in
docs/code-and-math.md. The command line is ``python -m verl_mas.data <workflow> --source FILE --format F
--split S`` (:mod:`verl_mas.data.__main__`).

=================  ==========================================================================  ========
``format``         records (fields read)                                                       tasks
=================  ==========================================================================  ========
``apps``           ``problem_id, question, solutions`` (JSON list str), ``input_output`` (JSON  code
                   str with ``inputs``/``outputs``; call-based ``fn_name`` problems skipped),
                   ``difficulty``
``codecontests``   ``name, description, public_tests{input,output}, private_tests,             code
                   generated_tests, solutions{language,solution}`` (language 3 = Python 3)
``livecodebench``  ``question_id, question_content, public_test_cases`` (JSON),                code
                   ``private_test_cases`` (JSON, or the lite release's base64/zlib/pickle
                   encoding), ``starter_code``; ``functional`` (LeetCode) tests skipped
``aime``           ``id``, ``problem`` or ``question``, ``answer``                             math
``olympiadbench``  ``id, question, final_answer`` (list of str, ``$`` stripped)                math
``polaris``        ``problem, answer``                                                         math
=================  ==========================================================================  ========

The task dicts (code: ``question``, ``tests``, ``solution``, ...; math: ``problem``, ``answer``) are
described, and checked, in :mod:`verl_mas.data.tasks`.

Golden tests: a **test**-split code task keeps all of them (success means passing every one; a capped
test set would inflate accuracy). A **train**-split task keeps the first ``max_train_tests``
(:data:`DEFAULT_MAX_TESTS`, public tests first), since each is one sandbox run per candidate.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import pickle
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verl_mas.data.tasks import strip_math_delimiters

logger = logging.getLogger(__name__)

__all__ = [
    "CODE_FORMATS",
    "FORMATS",
    "DEFAULT_MAX_TESTS",
    "MATH_FORMATS",
    "SPLITS",
    "load_tasks",
    "read_records",
]

CODE_FORMATS = ("apps", "codecontests", "livecodebench")
MATH_FORMATS = ("aime", "olympiadbench", "polaris")
FORMATS = CODE_FORMATS + MATH_FORMATS

#: Default cap on golden tests kept per code task of the training split (CodeContests has hundreds; each
#: is one sandbox run). The test split is never capped.
DEFAULT_MAX_TESTS = 32

#: The splits a loaded file can become.
SPLITS = ("train", "test")

#: CodeContests' ``solutions.language`` code for Python 3.
_CC_PYTHON3 = 3

# ---------------------------------------------------------------------------------------------------
# Reading files.


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``) or ``.parquet`` file.

    Raises:
        ValueError: For another suffix, or a JSON file that holds no list of records.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        with p.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, Mapping) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{p} holds a {type(data).__name__}; expected a JSON list of records (or {{'data': [...]}})")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    raise ValueError(f"{p}: unsupported file type {suffix!r}; pass a .jsonl, .json or .parquet file")


def _json_field(value: Any) -> Any:
    """A field that datasets store either as JSON text or already decoded."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else None
    return value


def _text(value: Any) -> str:
    """A test input/output: str as is, a list of lines joined (some APPS records), else JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return "\n".join(value) + "\n"
    return json.dumps(value)


def _tests(inputs: Iterable[Any], outputs: Iterable[Any]) -> list[dict[str, str]]:
    return [{"input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Code formats.


def _apps(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    io_spec = _json_field(rec.get("input_output")) or {}
    if io_spec.get("fn_name") or not io_spec.get("inputs"):
        return None  # call-based (LeetCode-style) or test-less: not a stdin/stdout task
    solutions = _json_field(rec.get("solutions")) or []
    return {
        "id": f"apps-{rec['problem_id']}",
        "source": "apps",
        "question": rec["question"],
        "tests": _tests(io_spec["inputs"], io_spec["outputs"]),
        "solution": solutions[0] if solutions else None,
        "difficulty": rec.get("difficulty"),
    }


def _codecontests(rec: Mapping[str, Any], include_generated: bool) -> dict[str, Any] | None:
    tests: list[dict[str, str]] = []
    kinds = ("public_tests", "private_tests") + (("generated_tests",) if include_generated else ())
    for kind in kinds:
        block = rec.get(kind) or {}
        tests += _tests(block.get("input") or [], block.get("output") or [])
    if not tests:
        return None
    sols = rec.get("solutions") or {}
    python = [s for lang, s in zip(sols.get("language") or [], sols.get("solution") or [], strict=True)
              if lang == _CC_PYTHON3]
    difficulty = rec.get("difficulty")
    return {
        "id": f"codecontests-{rec['name']}",
        "source": "codecontests",
        "question": rec["description"],
        "tests": tests,
        "solution": python[0] if python else None,
        "difficulty": None if difficulty is None else str(difficulty),
    }


class _StrOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused (no code execution)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: LiveCodeBench private tests are a pickled str, nothing else"
        )


def _lcb_private(value: Any) -> Any:
    """LiveCodeBench private tests: JSON, or the lite release's base64(zlib(pickle(json str)))."""
    if not isinstance(value, str) or not value.strip():
        return value or []
    if value.lstrip().startswith("["):
        return json.loads(value)
    raw = _StrOnlyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
    return json.loads(raw) if isinstance(raw, str) else raw


def _livecodebench(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    cases = list(_json_field(rec.get("public_test_cases")) or []) + list(_lcb_private(rec.get("private_test_cases")))
    if not cases or any(c.get("testtype", "stdin") != "stdin" for c in cases):
        return None  # functional (LeetCode) problems call a method; only stdin/stdout tasks are supported
    return {
        "id": f"livecodebench-{rec['question_id']}",
        "source": "livecodebench",
        "question": rec["question_content"],
        "tests": [{"input": c["input"], "output": c["output"]} for c in cases],
        "solution": None,  # LiveCodeBench publishes no reference solutions
        "difficulty": rec.get("difficulty"),
    }


# ---------------------------------------------------------------------------------------------------
# Math formats.


def _math(rec: Mapping[str, Any], fmt: str, index: int) -> dict[str, Any] | None:
    problem = rec.get("problem") if rec.get("problem") is not None else rec.get("question")
    answer = rec.get("answer") if rec.get("answer") is not None else rec.get("final_answer")
    if isinstance(answer, list):
        answer = ", ".join(strip_math_delimiters(str(a)) for a in answer)
    if problem is None or answer is None or not str(answer).strip():
        return None
    rid = rec.get("id", rec.get("ID", index))
    return {"id": f"{fmt}-{rid}", "source": fmt, "problem": str(problem), "answer": strip_math_delimiters(str(answer))}


def load_tasks(
    path: str | Path,
    format: str,
    *,
    split: str,
    start: int = 0,
    stop: int | None = None,
    max_train_tests: int | None = DEFAULT_MAX_TESTS,
    include_generated: bool = False,
    require_solution: bool = False,
) -> list[dict[str, Any]]:
    """Read a published dataset file into task dicts for ``code-v0``/``code-single-v0`` or ``math-v0``/``math-single-v0``.

    Records that are not usable (call-based APPS problems, LeetCode-style LiveCodeBench problems,
    records without tests or answer) are skipped and counted in one INFO log line.

    Args:
        path: A ``.jsonl``, ``.json`` or ``.parquet`` file in the dataset's published format.
        format: One of :data:`FORMATS`.
        split: ``"train"`` or ``"test"``: what the tasks are for. Test tasks keep every golden test.
        start: First record (file order) to use, e.g. 500 for the paper's APPS training range.
        stop: One past the last record to use (None: to the end), e.g. 4500.
        max_train_tests: ``split="train"`` only: keep at most this many golden tests per code task, public
            tests first (None: all). Ignored for ``split="test"``, which keeps all of them.
        include_generated: CodeContests: also use ``generated_tests`` (the paper used public + private).
        require_solution: Code: skip tasks without a golden solution (the tester's ``0.8 * g`` term
            needs one).

    Returns:
        Task dicts (the schemas of :mod:`verl_mas.data.tasks`), in file order.

    Raises:
        ValueError: Unknown ``format`` or ``split``, a ``max_train_tests`` below 1, an unsupported file type,
            or a record missing a required field (named with its index).
    """
    problems = []
    if format not in FORMATS:
        problems.append(f"format is {format!r}; it must be one of {FORMATS}")
    if split not in SPLITS:
        problems.append(f"split is {split!r}; it must be one of {SPLITS} (test tasks keep every golden test)")
    if max_train_tests is not None and (isinstance(max_train_tests, bool) or not isinstance(max_train_tests, int)
                                        or max_train_tests < 1):
        problems.append(f"max_train_tests is {max_train_tests!r}; it must be an int >= 1, or None to keep all tests")
    if problems:
        raise ValueError("; ".join(problems))
    cap = max_train_tests if split == "train" else None
    capped = 0
    records = read_records(path)[start:stop]
    tasks: list[dict[str, Any]] = []
    for i, rec in enumerate(records, start=start):
        try:
            if format == "apps":
                task = _apps(rec)
            elif format == "codecontests":
                task = _codecontests(rec, include_generated)
            elif format == "livecodebench":
                task = _livecodebench(rec)
            else:
                task = _math(rec, format, i)
        except (KeyError, TypeError, ValueError, zlib.error, pickle.UnpicklingError) as e:
            raise ValueError(
                f"{path} record {i} is not a valid {format!r} record ({type(e).__name__}: {e}). Check that the file is "
                f"the published {format} format (fields in verl_mas.data.loaders' docstring)."
            ) from e
        if task is None:
            continue
        if format in CODE_FORMATS:
            if require_solution and task["solution"] is None:
                continue
            if cap is not None and len(task["tests"]) > cap:
                task["tests"] = task["tests"][:cap]
                capped += 1
        tasks.append(task)
    skipped = len(records) - len(tasks)
    if skipped:
        logger.info("%s: loaded %d %s tasks, skipped %d unusable records", path, len(tasks), format, skipped)
    if capped:
        logger.info("%s: kept the first %d golden tests of %d %s training tasks (max_train_tests)", path, cap, capped,
                    format)
    return tasks
