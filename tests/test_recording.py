"""Episodes recorded for the viewer: exactly the candidates, rewards and outcome the episode had."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mas.errors import InfraError
from verl_mas.recording import SCHEMA, RecordSettings, episode_record, write_records
from verl_mas.testing import ScriptedLLM, default_tokenizer, run_workflow

TASK = {"message": ["red", "blue"]}


def _same_as_episode(record: dict, episode) -> None:
    """Every group and candidate of the record is the episode's, field by field."""
    assert [g["key"] for g in record["groups"]] == [g.key for g in episode.groups]
    for g, group in zip(record["groups"], episode.groups, strict=True):
        assert (g["role"], g["turn"], g["prompt_tokens"]) == (group.role, group.turn, len(group.prompt_ids))
        assert [c["index"] for c in g["candidates"]] == [c.index for c in group.all]
        for c, cand in zip(g["candidates"], group.all, strict=True):
            assert c["text"] == cand.text and c["committed"] == cand.committed
            assert c["parse_failed"] == cand.parse_failed and c["infra_error"] == cand.infra_error
            assert c["reward"] == (cand.reward if cand.infra_error is None else None)
            assert c["team_reward"] == cand.team_reward and c["local_reward"] == cand.local_reward


def test_a_scripted_relay_episode_is_recorded_as_it_ran_with_its_at_grpo_advantages() -> None:
    # K=2: the caller answers "red" then "zzz" (unparsable), the runner relays "red" then "zzz".
    tokenizer = default_tokenizer()
    llm = ScriptedLLM({"caller": ["red", "zzz"], "runner": ["red", "zzz"]}, tokenizer=tokenizer)
    episode = run_workflow("relay-v0", TASK, llm, branching=2, max_turns=1, tokenizer=tokenizer)
    record = json.loads(json.dumps(episode_record(episode, source="run", task=TASK, tokenizer=tokenizer)))
    assert record["schema"] == SCHEMA and record["task"] == TASK and record["roles"] == ["caller", "runner"]
    assert record["policies"] == {"caller": "default", "runner": "default"}
    _same_as_episode(record, episode)
    caller = record["groups"][0]
    assert [c["parse_failed"] for c in caller["candidates"]] == [False, True]
    assert [c["committed"] for c in caller["candidates"]] == [True, False]
    # The prompt is what the caller saw, chat template included: "caller red" rendered by the tokenizer.
    assert "caller red" in caller["prompt"] and "<|im_start|>" in caller["prompt"]
    # AT-GRPO within the (task, role, turn) group: rewards r1 > r2 -> +-(r1-r2)/2 / (|r1-r2|/sqrt 2) = +-1/sqrt 2.
    for group in record["groups"]:
        rewards = [c["reward"] for c in group["candidates"]]
        assert rewards[0] > rewards[1]
        assert [c["advantage"] for c in group["candidates"]] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)],
                                                                               abs=1e-5)
    # One turn of a two-word message: not delivered in full.
    assert record["outcome"] == {"success": 0.0, "terminated": False, "truncated": True, "aborted": False,
                                 "error": None, "context_overflow": False}
    assert record["metrics"]["mas/delivered"] == 0.5
    assert [g["zero_variance"] for g in record["groups"]] == [False, False]


def _trainer_advantages(episodes: list, mas) -> dict[tuple[int, str, int], float]:
    """The trainer's advantage of every row of ``episodes`` (the sessions of one task), by (session, node, index).

    As ``MasTrainer._compute_advantage``: the rows the mas agent loop returns (trainable candidates), grouped by
    ``assign_groups`` and normalised by the at_grpo estimator on float32 token-level scores.
    """
    import numpy as np
    import torch

    from verl_mas.advantage.at_grpo import compute_at_grpo_outcome_advantage
    from verl_mas.rows import CandidateRow, prompt_hash
    from verl_mas.trainer import assign_groups

    rows, sessions, where = [], [], []
    for s, episode in enumerate(episodes):
        for c in episode.trainable():
            rows.append(CandidateRow(
                workflow=episode.workflow_id, role=c.role, turn=c.turn, policy="default", reward=float(c.reward),
                team_reward=math.nan, local_reward=math.nan, committed=c.committed,
                prompt_hash=prompt_hash(c.prompt_ids), episode_index=len(where), episode_metrics=dict(episode.metrics)))
            sessions.append(f"{episode.task_uid}_{s}")
            where.append((s, c.group_key, c.index))
    groups = assign_groups(rows, [e.rpartition("_")[0] for e in sessions], np.zeros(len(rows), dtype=bool), mas,
                           episodes=sessions)
    scores = torch.tensor(groups.rewards, dtype=torch.float32)[:, None]
    adv, _ = compute_at_grpo_outcome_advantage(scores, torch.ones_like(scores), np.array(groups.keys, dtype=object),
                                               config={"norm_adv_by_std_in_grpo": True, "at_grpo_singleton": "zero"})
    return dict(zip(where, adv[:, 0].tolist(), strict=True))


def _recorded(record: dict) -> dict[tuple[str, int], float | None]:
    return {(g["key"], c["index"]): c["advantage"] for g in record["groups"] for c in g["candidates"]}


def test_recorded_advantages_are_the_trainers_under_tree_sampling_and_null_where_groups_span_episodes() -> None:
    from verl_mas.config import MasConfig

    tokenizer = default_tokenizer()
    # Tree sampling, K=2, two turns: caller "red","red" then "blue","zzz"; the runner alike. Each role's rewards
    # are [1, 1] at turn 0 and [1, 0] at turn 1 (the message is delivered, so the episode ends after turn 1).
    llm = ScriptedLLM({"caller": ["red", "red", "blue", "zzz"], "runner": ["red", "red", "blue", "zzz"]},
                      tokenizer=tokenizer)
    episode = run_workflow("relay-v0", TASK, llm, branching=2, max_turns=2, tokenizer=tokenizer)
    for grouping, expected, zero in (
        # agent_turn: a node is a group; turn 0 ties (0 each), turn 1: +-(1/2) / (1/sqrt 2) = +-1/sqrt 2.
        ("agent_turn", [0.0, 0.0, 1 / math.sqrt(2), -1 / math.sqrt(2)], [True, True, False, False]),
        # agent: the role's four candidates [1, 1, 1, 0]: mean 3/4, unbiased std sqrt((3/16 + 9/16) / 3) = 1/2,
        # so +1/4 / (1/2) = 1/2 and -3/4 / (1/2) = -3/2; the tied turn-0 nodes carry signal in their role group.
        ("agent", [0.5, 0.5, 0.5, -1.5], [False, False, False, False]),
    ):
        record = episode_record(episode, source="train", task=TASK, grouping=grouping, sampling="tree")
        by_role = {role: [c["advantage"] for g in record["groups"] if g["role"] == role for c in g["candidates"]]
                   for role in ("caller", "runner")}
        assert by_role == {"caller": pytest.approx(expected, abs=1e-5), "runner": pytest.approx(expected, abs=1e-5)}
        assert [g["zero_variance"] for g in record["groups"]] == zero  # caller 0, runner 0, caller 1, runner 1
        # Exactly the trainer's numbers for the same rows (one episode per task under tree sampling).
        trainer = _trainer_advantages([episode], MasConfig(branching=2, max_turns=2, grouping=grouping))
        assert _recorded(record) == {(key, i): a for (_, key, i), a in trainer.items()}
        # A validation episode is never trained on: no advantage.
        val = episode_record(episode, source="val", task=TASK, grouping=grouping, sampling="tree")
        assert set(_recorded(val).values()) == {None} and {g["zero_variance"] for g in val["groups"]} == {None}

    # Parallel sampling: 4 episodes of one task, one candidate per node; the caller says red, zzz, red, zzz
    # (rewards 1, 0, 1, 0), the runner always red (delivers the one-word message: 1, 1, 1, 1).
    parallel = []
    for word in ("red", "zzz", "red", "zzz"):
        llm = ScriptedLLM({"caller": word, "runner": "red"}, tokenizer=tokenizer)
        parallel.append(run_workflow("relay-v0", {"message": ["red"]}, llm, branching=1, max_turns=1,
                                     tokenizer=tokenizer))
    trainer = _trainer_advantages(parallel, MasConfig(branching=1, max_turns=1, sampling="parallel"))
    # The trainer's caller group spans the 4 episodes: mean 1/2, unbiased std sqrt(1/3), so +-(1/2) * sqrt 3 = +-0.866.
    assert [trainer[(s, f"{parallel[s].task_uid}|caller|0", 0)] for s in range(4)] == pytest.approx(
        [math.sqrt(3) / 2, -math.sqrt(3) / 2] * 2, abs=1e-5)
    # One episode sees one member of each group (alone it would be a singleton: 0): null, and no zero-variance claim.
    for episode in parallel:
        for grouping in ("agent_turn", "agent", "trajectory"):
            record = episode_record(episode, source="train", task={"message": ["red"]}, grouping=grouping,
                                    sampling="parallel")
            assert set(_recorded(record).values()) == {None}
            assert {g["zero_variance"] for g in record["groups"]} == {None}
    with pytest.raises(ValueError, match=r"sampling='parallell'.*Pass the run's mas.grouping and mas.sampling"):
        episode_record(parallel[0], source="train", task=TASK, sampling="parallell")


def test_an_aborted_episode_keeps_its_infrastructure_failures_and_no_success() -> None:
    tokenizer = default_tokenizer()
    llm = ScriptedLLM({"caller": [InfraError("replica lost"), InfraError("replica lost")], "runner": "red"},
                      tokenizer=tokenizer)
    episode = run_workflow("relay-v0", TASK, llm, branching=2, max_turns=2, tokenizer=tokenizer)
    assert episode.aborted
    record = episode_record(episode, source="run", task=TASK, tokenizer=tokenizer)
    _same_as_episode(record, episode)
    assert record["outcome"]["aborted"] and record["outcome"]["success"] is None and record["outcome"]["error"]
    failed = [c for g in record["groups"] for c in g["candidates"]]
    assert failed and all("replica lost" in c["infra_error"] and c["reward"] is None and not c["trainable"]
                          for c in failed)


def test_run_and_evaluate_record_their_episodes(tmp_path: Path) -> None:
    import asyncio

    from verl_mas.data import write_dataset
    from verl_mas.evaluate import _read_rows, evaluate
    from verl_mas.settings import EpisodeConfig

    out = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "verl_mas.run", "relay-v0", "--llm", "scripted", "--reply",
                           "caller=red", "--reply", "runner=red", "--task", '{"message": ["red", "red"]}', "--branching", "2",
                           "--record", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["source"] == "run" and record["outcome"]["success"] == 1.0 and len(record["groups"]) == 4

    write_dataset("relay-v0", tmp_path / "data", train=0, test=3, seed=0)
    rows = _read_rows(str(tmp_path / "data" / "test.parquet"))
    tokenizer = default_tokenizer()
    records: list[dict] = []
    report = asyncio.run(evaluate(rows, client=ScriptedLLM({"caller": "zzz", "runner": "zzz"}, tokenizer=tokenizer),
                                  tokenizer=tokenizer, config=EpisodeConfig(branching=1, max_turns=2), records=records))
    assert report["episodes"] == 3.0 and len(records) == 3
    assert [r["task"] for r in records] == [json.loads(row["extra_info"]["task"]) for row in rows]
    assert all(r["outcome"]["success"] == 0.0 and r["source"] == "evaluate" for r in records)
    path = write_records(tmp_path / "eval" / "episodes.jsonl", records)
    assert len(path.read_text().splitlines()) == 3


def test_record_settings_are_validated_and_select_steps() -> None:
    assert not RecordSettings.parse(None)[0].enabled
    settings, problems = RecordSettings.parse({"dir": "runs/x/episodes", "every_n_steps": 10, "episodes": 2})
    assert problems == [] and [s for s in range(1, 31) if settings.records_step(s)] == [1, 10, 20, 30]
    _, problems = RecordSettings.parse({"dir": 3, "every_n_steps": 0, "episods": 2})
    assert problems == ["mas.record has unknown keys ['episods']; the keys are ['dir', 'every_n_steps', 'episodes'].",
                        "mas.record.every_n_steps is 0; it must be an integer >= 1.",
                        "mas.record.dir is 3; it must be a folder path (or null: recording off)."]
