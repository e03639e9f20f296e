"""The data CLI: verl's row contract, JSON task round trip, determinism, train/test disjoint by content."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from verl_mas import Workflow, register_workflow
from verl_mas import registry as registry_module
from verl_mas.data import TaskSpaceError, canonical_json, draw_splits, read_tasks, write_dataset

COLUMNS = ["data_source", "agent_name", "prompt", "extra_info", "reward_model"]


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the workflow registry, so test workflows do not leak into other tests."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


@pytest.fixture
def coin(registry):
    """A workflow whose task space has exactly two tasks: the negative control for disjointness."""

    @register_workflow("coin-v0")
    class CoinWorkflow(Workflow):
        roles = ("flipper",)

        @classmethod
        def generate_task(cls, rng, split):
            return {"side": rng.choice(["heads", "tails"])}

        async def run(self, task):
            raise NotImplementedError  # never played here

    return CoinWorkflow


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_rows_follow_the_verl_contract(tmp_path):
    train_path, test_path = write_dataset("relay-v0", tmp_path, train=6, test=3, seed=0)
    assert (train_path, test_path) == (tmp_path / "train.parquet", tmp_path / "test.parquet")
    for path, split, n in ((train_path, "train", 6), (test_path, "test", 3)):
        assert pq.read_schema(path).names == COLUMNS
        rows = _rows(path)
        assert len(rows) == n
        for i, row in enumerate(rows):
            assert row["data_source"] == "relay-v0"
            assert row["agent_name"] == "mas"
            assert row["reward_model"] == {"style": "rule", "ground_truth": ""}
            (message,) = row["prompt"]
            assert message["role"] == "user" and "relay-v0" in message["content"]
            info = row["extra_info"]
            assert set(info) == {"index", "split", "workflow", "task"}
            assert (info["index"], info["split"], info["workflow"]) == (i, split, "relay-v0")
            task = json.loads(info["task"])
            assert canonical_json(task) == info["task"]  # stored canonically
            assert task["message"][0] in message["content"]  # the summary shows the task
        assert read_tasks(path) == [json.loads(r["extra_info"]["task"]) for r in rows]


def test_read_tasks_round_trips_what_the_generator_drew(tmp_path):
    splits = draw_splits("relay-v0", train=5, test=4, seed=7)
    train_path, test_path = write_dataset("relay-v0", tmp_path, train=5, test=4, seed=7)
    assert read_tasks(train_path) == [json.loads(t) for t in splits["train"]]
    assert read_tasks(test_path) == [json.loads(t) for t in splits["test"]]
    assert all(isinstance(t, dict) and isinstance(t["message"], list) for t in read_tasks(train_path))


def test_same_seed_same_files_other_seed_other_tasks(tmp_path):
    a = write_dataset("relay-v0", tmp_path / "a", train=20, test=8, seed=1)
    b = write_dataset("relay-v0", tmp_path / "b", train=20, test=8, seed=1)
    c = write_dataset("relay-v0", tmp_path / "c", train=20, test=8, seed=2)
    for pa_, pb in zip(a, b, strict=True):
        assert pa_.read_bytes() == pb.read_bytes()
    assert read_tasks(a[0]) != read_tasks(c[0])
    # The test split depends on (id, seed) only: asking for more training tasks leaves it unchanged.
    d = write_dataset("relay-v0", tmp_path / "d", train=40, test=8, seed=1)
    assert read_tasks(d[1]) == read_tasks(a[1])


def test_train_and_test_are_disjoint_by_content(tmp_path):
    # 64 + 16 of relay-v0's 100 tasks: random draws collide often, so this exercises the dedupe.
    train_path, test_path = write_dataset("relay-v0", tmp_path, train=64, test=16, seed=0)
    train = [canonical_json(t) for t in read_tasks(train_path)]
    test = [canonical_json(t) for t in read_tasks(test_path)]
    assert len(set(train)) == 64 and len(set(test)) == 16  # no duplicates within a split either
    assert not set(train) & set(test)


def test_negative_control_naive_seeding_overlaps_the_cli_does_not(coin, tmp_path):
    # Naive scheme: test from seed 0, train from seed 1, no dedupe. Random(0) draws tails first and
    # Random(1) draws heads, heads, tails: the naive test task reappears in the naive training set.
    naive_test_rng, naive_train_rng = random.Random(0), random.Random(1)
    naive_test = {canonical_json(coin.generate_task(naive_test_rng, "test"))}
    naive_train = {canonical_json(coin.generate_task(naive_train_rng, "train")) for _ in range(3)}
    assert naive_train & naive_test == {'{"side":"tails"}'}
    # The CLI, asked for the same sizes, refuses (see the next test); asked for what fits, it splits the
    # two tasks between the splits.
    with pytest.raises(TaskSpaceError):
        write_dataset("coin-v0", tmp_path / "naive", train=3, test=1, seed=0, patience=50)
    train_path, test_path = write_dataset("coin-v0", tmp_path, train=1, test=1, seed=0)
    (train,), (test,) = read_tasks(train_path), read_tasks(test_path)
    assert {train["side"], test["side"]} == {"heads", "tails"}


def test_too_small_a_task_space_fails_loudly_and_writes_nothing(coin, tmp_path):
    with pytest.raises(TaskSpaceError, match=r"coin-v0: found only 1 distinct train tasks of the 2 requested") as e:
        write_dataset("coin-v0", tmp_path / "out", train=2, test=1, seed=0, patience=50)
    assert "--train/--test" in str(e.value) and "generate_task" in str(e.value)  # what, why and fix
    with pytest.raises(TaskSpaceError, match="found only 2 distinct test tasks of the 3"):
        write_dataset("coin-v0", tmp_path / "out", train=0, test=3, seed=0, patience=50)
    assert not (tmp_path / "out").exists()


def test_workflow_without_generator_names_the_workflow_and_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"'toy-walk-v0'.*no task generator.*def generate_task"):
        write_dataset("toy-walk-v0", tmp_path, train=1, test=1)


def test_non_json_tasks_are_rejected(registry, tmp_path):
    @register_workflow("tuple-task-v0")
    class TupleTask(Workflow):
        roles = ("solo",)

        @classmethod
        def generate_task(cls, rng, split):
            return {"pair": (1, rng.randint(0, 9))}  # a tuple reads back from JSON as a list

        async def run(self, task):
            raise NotImplementedError

    with pytest.raises(TypeError, match="JSON round trip"):
        write_dataset("tuple-task-v0", tmp_path, train=1, test=1)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        canonical_json({"x": {1, 2}})
    with pytest.raises(TypeError, match="must return a dict"):
        canonical_json(["red"])


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError, match="train is -1"):
        draw_splits("relay-v0", train=-1, test=1)


def test_command_line(tmp_path):
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "verl_mas.data", "relay-v0", "--out", str(out), "--train", "8", "--test", "4"]
    done = subprocess.run([*cmd, "--seed", "3"], capture_output=True, text=True, check=True)
    assert "8 train tasks" in done.stdout and "4 test tasks" in done.stdout
    assert len(read_tasks(out / "train.parquet")) == 8 and len(read_tasks(out / "test.parquet")) == 4
    assert read_tasks(out / "test.parquet") == [json.loads(t) for t in draw_splits("relay-v0", 8, 4, seed=3)["test"]]

    failed = subprocess.run(
        [sys.executable, "-m", "verl_mas.data", "relay-v0", "--out", str(tmp_path / "x"), "--train", "95", "--test",
         "10", "--patience", "200"],
        capture_output=True, text=True,
    )
    assert failed.returncode == 2
    assert "error: relay-v0: found only" in failed.stderr and "too small" in failed.stderr


def test_verl_rlhf_dataset_loads_the_rows(tmp_path):
    # The real consumer: verl's RLHFDataset must accept the files and pass agent_name and extra_info through.
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from verl_mas.testing import default_tokenizer

    train_path, _ = write_dataset("relay-v0", tmp_path, train=4, test=2, seed=0)
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 256, "return_raw_chat": True})
    dataset = RLHFDataset(data_files=[str(train_path)], tokenizer=default_tokenizer(), config=config)
    assert len(dataset) == 4
    item = dataset[2]
    assert item["agent_name"] == "mas" and item["data_source"] == "relay-v0"
    assert json.loads(item["extra_info"]["task"]) == read_tasks(train_path)[2]


def _many_tests_file(tmp_path):
    """One CodeContests record with 40 golden tests: 5 public and 35 private (input i, output 2i)."""
    public, private = list(range(5)), list(range(5, 40))
    rec = {"name": "9_Z. Many", "description": "Print 2n.", "difficulty": 1,
           "public_tests": {"input": [f"{i}\n" for i in public], "output": [f"{2 * i}\n" for i in public]},
           "private_tests": {"input": [f"{i}\n" for i in private], "output": [f"{2 * i}\n" for i in private]},
           "solutions": {"language": [3], "solution": ["print(2 * int(input()))\n"]}}
    path = tmp_path / "many.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize(
    ("flags", "tests"),
    [
        (["--split", "test"], 40),  # the test split keeps every golden test
        (["--split", "train"], 32),  # training: the default cap, DEFAULT_MAX_TESTS = 32 (public 0-4, private 5-31)
        (["--split", "train", "--max-tests", "8"], 8),  # the flag changes the cap
        (["--split", "train", "--max-tests", "all"], 40),
    ],
)
def test_published_file_golden_tests_per_split(tmp_path, flags, tests):
    from verl_mas.data.__main__ import main

    src = _many_tests_file(tmp_path)
    assert main(["code-v0", "--out", str(tmp_path / "out"), "--source", str(src), "--format", "codecontests",
                 *flags]) == 0
    split = flags[1]
    (task,) = read_tasks(tmp_path / "out" / f"{split}.parquet")
    assert [t["input"] for t in task["tests"]] == [f"{i}\n" for i in range(tests)]  # public first, in order


def test_max_tests_is_refused_where_it_would_cap_a_test_split_or_do_nothing(tmp_path, capsys):
    from verl_mas.data.__main__ import main

    src = _many_tests_file(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["code-v0", "--out", str(tmp_path), "--source", str(src), "--format", "codecontests", "--split", "test",
              "--max-tests", "8"])
    assert e.value.code == 2
    assert "--max-tests caps the golden tests of the training split only" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # generated tasks: the flag would do nothing
        main(["code-v0", "--out", str(tmp_path), "--train", "2", "--test", "2", "--max-tests", "8"])
    assert "--max-tests applies to tasks loaded from a published file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["code-v0", "--out", str(tmp_path), "--source", str(src), "--format", "codecontests", "--split",
              "train", "--max-tests", "0"])
    assert "'0' is not an int >= 1 or 'all'" in capsys.readouterr().err
    assert not (tmp_path / "test.parquet").exists() and not (tmp_path / "train.parquet").exists()
