"""Loaders on project-written fixtures that mimic each published schema (tests/fixtures/)."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from verl_mas.data.loaders import load_tasks, read_records
from verl_mas.data.tasks import check_code_task, check_math_task

FIX = Path(__file__).parent / "fixtures"


def test_apps_stdin_tasks_and_skips() -> None:
    tasks = load_tasks(FIX / "apps.jsonl", "apps", split="train")
    # Record 1 is call-based (fn_name): skipped. Record 2 stores lines as lists: joined.
    assert [t["id"] for t in tasks] == ["apps-0", "apps-2"]
    first, second = tasks
    assert first["tests"] == [{"input": "1 2\n", "output": "3\n"}, {"input": "3 4\n", "output": "7\n"}]
    assert first["solution"].startswith("a, b = map(int")  # the first published solution is the golden one
    assert first["difficulty"] == "introductory"
    assert second["tests"] == [{"input": "ab\n", "output": "ab\nab\n"}] and second["solution"] is None
    for t in tasks:
        check_code_task(t)
    # The paper's index ranges: start/stop slice records in file order.
    assert [t["id"] for t in load_tasks(FIX / "apps.jsonl", "apps", split="train", start=2)] == ["apps-2"]
    assert load_tasks(FIX / "apps.jsonl", "apps", split="train", require_solution=True)[0]["id"] == "apps-0"
    assert len(load_tasks(FIX / "apps.jsonl", "apps", split="train", require_solution=True)) == 1


def test_codecontests_public_and_private_tests_python3_solution(tmp_path: Path) -> None:
    tasks = load_tasks(FIX / "codecontests.jsonl", "codecontests", split="train")
    assert [t["id"] for t in tasks] == ["codecontests-1_A. Double", "codecontests-2_B. Echo"]  # 3_C has no tests
    double = tasks[0]
    # Public first, then private; generated tests only on request.
    assert [x["input"] for x in double["tests"]] == ["1\n", "5\n", "0\n"]
    assert double["solution"] == "print(2 * int(input()))\n"  # language 3 (Python 3), not C++ (2) or Python 2 (1)
    assert tasks[1]["solution"] is None
    with_generated = load_tasks(FIX / "codecontests.jsonl", "codecontests", split="train", include_generated=True)[0]
    assert [x["input"] for x in with_generated["tests"]] == ["1\n", "5\n", "0\n", "7\n"]
    assert len(load_tasks(FIX / "codecontests.jsonl", "codecontests", split="train", max_train_tests=2)[0]["tests"]) == 2
    # The published files are parquet: the same records read back identically.
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train-00000-of-00039.parquet"
    pq.write_table(pa.Table.from_pylist(read_records(FIX / "codecontests.jsonl")), path)
    assert load_tasks(path, "codecontests", split="train") == tasks


def test_livecodebench_stdin_tasks_with_encoded_private_tests() -> None:
    tasks = load_tasks(FIX / "livecodebench.jsonl", "livecodebench", split="train")
    # The LeetCode-style (functional) record is skipped.
    assert [t["id"] for t in tasks] == ["livecodebench-abc001_a", "livecodebench-cf2_b"]
    # Public tests, then the private ones (base64/zlib/pickle in the lite release, plain JSON otherwise).
    assert tasks[0]["tests"] == [{"input": "3\n", "output": "9\n"}, {"input": "4\n", "output": "16\n"}]
    assert tasks[1]["tests"] == [{"input": "2\n", "output": "8\n"}, {"input": "3\n", "output": "27\n"}]
    assert all(t["solution"] is None for t in tasks)


def test_livecodebench_refuses_pickles_that_reference_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("pwned",))

    rec = json.loads((FIX / "livecodebench.jsonl").read_text().splitlines()[0])
    rec["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    path = tmp_path / "evil.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="record 0 is not a valid 'livecodebench' record.*refusing to load builtins.print"):
        load_tasks(path, "livecodebench", split="train")


@pytest.mark.parametrize(
    ("name", "fmt", "expected"),
    [
        ("aime24.jsonl", "aime", [("aime-60", "24"), ("aime-61", "1001")]),
        ("aime25.jsonl", "aime", [("aime-I-1", "243"), ("aime-I-2", "144")]),  # `question`, int answer
        ("olympiadbench.jsonl", "olympiadbench", [("olympiadbench-2231", "\\frac{1}{2}"), ("olympiadbench-2232", "2, -2")]),
        ("polaris.jsonl", "polaris", [("polaris-0", "2"), ("polaris-1", "\\frac{3}{4}")]),  # empty answer skipped
    ],
)
def test_math_formats(name: str, fmt: str, expected: list[tuple[str, str]]) -> None:
    tasks = load_tasks(FIX / name, fmt, split="train")
    assert [(t["id"], t["answer"]) for t in tasks] == expected
    for t in tasks:
        check_math_task(t)
        assert t["source"] == fmt and t["problem"]


def test_errors_name_what_and_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format is 'mbpp'"):
        load_tasks(FIX / "apps.jsonl", "mbpp", split="train")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_tasks(tmp_path / "x.csv", "apps", split="train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"name": "x", "public_tests": {"input": ["1\n"], "output": ["1\n"]}}) + "\n")  # no description
    with pytest.raises(ValueError, match="record 0 is not a valid 'codecontests' record"):
        load_tasks(bad, "codecontests", split="train")


def test_data_cli_writes_rows_the_data_module_reads(tmp_path: Path) -> None:
    from verl_mas.data import read_tasks
    from verl_mas.data.__main__ import main

    assert main(["code-v0", "--format", "apps", "--source", str(FIX / "apps.jsonl"),
                 "--split", "test", "--out", str(tmp_path), "--stop", "1"]) == 0
    assert [t["id"] for t in read_tasks(tmp_path / "test.parquet")] == ["apps-0"]


def test_data_cli_passes_the_loader_flags(tmp_path: Path) -> None:
    """--include-generated and --require-solution (once only on the removed loaders CLI) reach load_tasks."""
    from verl_mas.data import read_tasks
    from verl_mas.data.__main__ import main

    def written(fmt: str, *flags: str) -> list[dict]:
        out = tmp_path / "-".join((fmt, *flags))
        assert main(["code-v0", "--source", str(FIX / f"{fmt}.jsonl"), "--format", fmt, "--split", "train",
                     "--out", str(out), *flags]) == 0
        return read_tasks(out / "train.parquet")

    def inputs(*flags: str) -> list[str]:
        return [x["input"] for x in written("codecontests", *flags)[0]["tests"]]

    assert inputs() == ["1\n", "5\n", "0\n"]
    assert inputs("--include-generated") == ["1\n", "5\n", "0\n", "7\n"]
    assert [t["id"] for t in written("apps")] == ["apps-0", "apps-2"]
    assert [t["id"] for t in written("apps", "--require-solution")] == ["apps-0"]
    # Negative control: generated tasks have no loader, so the flags would do nothing there; they are refused.
    with pytest.raises(SystemExit):
        main(["code-v0", "--out", str(tmp_path / "gen"), "--train", "2", "--test", "2", "--require-solution"])
    assert not (tmp_path / "gen").exists()


@pytest.mark.parametrize("name", ["code", "math"])
def test_recipe_composes_with_paper_settings(name: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from verl_mas.config import MasConfig

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    with initialize_config_dir(config_dir=str(recipes / name), version_base=None):
        cfg = compose(config_name=name, overrides=["actor_rollout_ref.model.path=/models/Qwen3-1.7B"])
    mas = MasConfig.from_mapping(cfg.mas)
    assert (mas.branching, mas.max_turns, mas.alpha, mas.grouping, mas.sampling) == (4, 4, 1.0, "agent_turn", "tree")
    assert cfg.algorithm.adv_estimator == "at_grpo" and cfg.trainer.v1.trainer_mode == "mas"
    assert cfg.data.train_batch_size == 128 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.n == 1 and rollout.calculate_log_probs and rollout.temperature == 1.0
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz
    # Qwen3 in non-thinking mode, as in the paper: verl's own key, which the mas agent loop renders prompts with.
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    from verl_mas.startup import check_run_config

    check_run_config(cfg)  # the trainer's start-up checks pass (they raise listing every problem)
    assert cfg.actor_rollout_ref.model.path == "/models/Qwen3-1.7B"
    # Negative control: the same block with a broken value is rejected by the validator.
    broken = {**OmegaConf.to_container(cfg.mas), "branching": 0}
    with pytest.raises(ValueError):
        MasConfig.from_mapping(broken)
    run_sh = (recipes / name / "run.sh").read_text()
    assert run_sh.count('"$PYTHON" -m verl.trainer.main_ppo') == 1 and run_sh.rstrip().endswith('"$@"')


def test_data_cli_writes_a_split_from_a_published_file(tmp_path) -> None:
    """`python -m verl_mas.data code-v0 --source FILE --format apps --split test` (the common CLI)."""
    from pathlib import Path

    from verl_mas.data import read_tasks
    from verl_mas.data.__main__ import main as data_main

    fixture = Path(__file__).parent / "fixtures" / "apps.jsonl"
    assert data_main(["code-v0", "--out", str(tmp_path), "--source", str(fixture), "--format", "apps",
                      "--split", "test"]) == 0
    tasks = read_tasks(tmp_path / "test.parquet")
    # The fixture has 3 records, one of them call-based (unusable for stdin/stdout programs): 2 tasks.
    assert len(tasks) == 2 and all(t["tests"] for t in tasks)
    # An empty range is an error, not an empty split.
    assert data_main(["code-v0", "--out", str(tmp_path / "e"), "--source", str(fixture), "--format", "apps",
                      "--split", "train", "--start", "5"]) == 2


def _many_tests_file(tmp_path: Path) -> Path:
    """One CodeContests record with 40 golden tests (5 public, 35 private; input i, output 2i) and one APPS record."""
    public, private = list(range(5)), list(range(5, 40))
    cc = {"name": "9_Z. Many", "description": "Print 2n.", "difficulty": 1,
          "public_tests": {"input": [f"{i}\n" for i in public], "output": [f"{2 * i}\n" for i in public]},
          "private_tests": {"input": [f"{i}\n" for i in private], "output": [f"{2 * i}\n" for i in private]},
          "generated_tests": {"input": [], "output": []},
          "solutions": {"language": [3], "solution": ["print(2 * int(input()))\n"]}}
    path = tmp_path / "many.jsonl"
    path.write_text(json.dumps(cc) + "\n")
    return path


def test_the_test_split_keeps_every_golden_test_training_is_capped(tmp_path: Path) -> None:
    path = _many_tests_file(tmp_path)
    everything = [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(40)]  # public 0-4, then private 5-39
    (test_task,) = load_tasks(path, "codecontests", split="test")
    assert test_task["tests"] == everything  # all 40: success on the test split means passing all of them
    # Training keeps the first DEFAULT_MAX_TESTS = 32 (the 5 public, then private 5-31), or the cap asked for.
    assert load_tasks(path, "codecontests", split="train")[0]["tests"] == everything[:32]
    assert load_tasks(path, "codecontests", split="train", max_train_tests=10)[0]["tests"] == everything[:10]
    assert load_tasks(path, "codecontests", split="train", max_train_tests=None)[0]["tests"] == everything
    # The cap is a training setting: the test split ignores it.
    assert load_tasks(path, "codecontests", split="test", max_train_tests=10)[0]["tests"] == everything


def test_apps_test_split_is_not_capped_either(tmp_path: Path) -> None:
    lines = [f"{i}\n" for i in range(33)]
    rec = {"problem_id": 7, "question": "Print n.", "solutions": json.dumps(["print(input())"]), "difficulty": "x",
           "input_output": json.dumps({"inputs": lines, "outputs": lines})}
    path = tmp_path / "apps.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    assert len(load_tasks(path, "apps", split="test")[0]["tests"]) == 33
    assert len(load_tasks(path, "apps", split="train")[0]["tests"]) == 32  # 33 > DEFAULT_MAX_TESTS


def test_split_and_cap_are_validated_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"format is 'mbpp'.*; split is 'eval'.*; max_train_tests is 0"):
        load_tasks(FIX / "apps.jsonl", "mbpp", split="eval", max_train_tests=0)
    with pytest.raises(TypeError, match="split"):  # no silent default: the caller says what the tasks are for
        load_tasks(FIX / "apps.jsonl", "apps")  # type: ignore[call-arg]
