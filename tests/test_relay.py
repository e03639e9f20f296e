"""relay-v0: reward oracles computed by hand, same-turn conditioning, termination, conformance, vocabulary."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from verl_mas import get_workflow
from verl_mas.testing import RandomLLM, ScriptedLLM, check_workflow, run_workflow
from verl_mas.workflows.relay import (
    ACTION_WORDS,
    MESSAGE_LENGTH,
    RelayChainWorkflow,
    RelayWorkflow,
    caller_local_reward,
    encode,
    parse_word,
    runner_rewards,
)

TASK = {"message": ["red", "blue"]}


def test_registered_as_a_builtin():
    assert get_workflow("relay-v0") is RelayWorkflow
    assert RelayWorkflow.roles == ("caller", "runner")
    assert get_workflow("relay-chain-v0") is RelayChainWorkflow
    assert RelayChainWorkflow.roles == ("caller", "courier", "runner")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("red", "red"), ("  Blue ", "blue"), ("gold red", "gold"), ("reddish", "red"), ("", None), ("caller", None),
     ("ared", None)],
)
def test_parse_word_takes_the_action_word_the_answer_begins_with(text, expected):
    assert parse_word(text) == expected


def test_reward_oracles():
    # caller: local = [word == target]
    assert caller_local_reward("red", "red") == 1.0
    assert caller_local_reward("gold", "red") == 0.0
    assert caller_local_reward(None, "red") == 0.0
    # runner (team, local): team = [word == target]; local = 0 (a faithful relay earns nothing by itself)
    assert runner_rewards("red", "red", "red") == (1.0, 0.0)  # faithful relay of a right call
    assert runner_rewards("gold", "gold", "red") == (0.0, 0.0)  # faithful relay of a wrong call
    assert runner_rewards("red", "gold", "red") == (1.0, 0.0)  # lucky: unfaithful but delivered
    assert runner_rewards("pink", None, "red") == (0.0, 0.0)  # caller said nothing usable
    assert runner_rewards(None, "red", "red") == (0.0, 0.0)


def test_episode_rewards_commits_and_same_turn_conditioning():
    llm = ScriptedLLM(
        {
            # turn 0 (target red): blue, red, junk, red | turn 1 (target blue): red x4 |
            # turn 2 (target blue): blue, gold, blue, junk
            "caller": ["blue", "red", "zzz", "red"] + ["red"] * 4 + ["blue", "gold", "blue", "zzz"],
            # turn 0 (heard red) | turn 1 (heard red) | turn 2 (heard blue)
            "runner": ["red", "blue", "", "gold"] + ["red", "gold", "red", "pink"] + ["blue", "blue", "red", "navy"],
        }
    )
    ep = run_workflow(RelayWorkflow, TASK, llm=llm, branching=4, max_turns=4)
    assert not ep.validate()
    (c0, r0), (c1, r1), (c2, r2) = ep.turns

    # Turn 0, target red. caller: [word == red] = 0, 1, 0 (unparsable), 1; first best = #1.
    assert [c.reward for c in c0.all] == [0.0, 1.0, 0.0, 1.0]
    assert [c.parse_failed for c in c0.all] == [False, False, True, False]
    assert c0.committed.index == 1
    # runner heard "red": red = alpha * 1 + 0 = 1.0; blue, empty, gold = 0.
    assert r0.messages[-1]["content"] == "runner red"  # same-turn conditioning on the committed call
    assert [c.reward for c in r0.all] == [1.0, 0.0, 0.0, 0.0]
    assert [c.team_reward for c in r0.all] == [1.0, 0.0, 0.0, 0.0]
    assert r0.committed.index == 0  # "red" delivered: the caller's next prompt names "blue"

    # Turn 1, target blue. The caller says red four times: all 0; #0 committed.
    assert c1.messages[-1]["content"] == "caller blue"
    assert [c.reward for c in c1.all] == [0.0] * 4
    # runner heard "red" (red, gold, red, pink): none is the target, so all 0, the faithful "red"s
    # included; the tie goes to the first candidate and nothing is delivered this turn.
    assert r1.messages[-1]["content"] == "runner red"
    assert [c.reward for c in r1.all] == [0.0] * 4
    assert r1.committed.index == 0

    # Turn 2, target blue: caller 1, 0, 1, 0 -> commits "blue"; runner blue, blue = 1.0; red, navy = 0.
    assert [c.reward for c in c2.all] == [1.0, 0.0, 1.0, 0.0]
    assert r2.messages[-1]["content"] == "runner blue"
    assert [c.reward for c in r2.all] == [1.0, 1.0, 0.0, 0.0]

    assert ep.terminated and not ep.truncated and ep.num_turns == 3
    assert (ep.metrics["mas/success"], ep.metrics["mas/delivered"]) == (1.0, 1.0)


def test_alpha_weights_only_the_team_part():
    ep = run_workflow(RelayWorkflow, TASK, llm={"caller": "red", "runner": "red"}, alpha=0.5, max_turns=1)
    caller, runner = ep.turns[0]
    assert [c.reward for c in caller.all] == [1.0] * 4  # the caller has no team part
    assert [c.reward for c in runner.all] == [0.5 * 1.0 + 0.0] * 4
    assert [c.local_reward for c in runner.all] == [0.0] * 4


def test_unusable_call_tells_the_runner_nothing_and_runs_out_of_turns():
    ep = run_workflow(RelayWorkflow, TASK, llm={"caller": "hello", "runner": "pink"}, max_turns=3)
    assert ep.truncated and not ep.terminated and ep.num_turns == 3
    for caller, runner in ep.turns:
        assert [c.reward for c in caller.all] == [0.0] * 4
        assert all(c.parse_failed for c in caller.all)
        assert runner.messages[-1]["content"] == "runner nothing"
        assert [c.reward for c in runner.all] == [0.0] * 4  # pink: neither heard nor the target
        assert not any(c.parse_failed for c in runner.all)
    assert (ep.metrics["mas/success"], ep.metrics["mas/delivered"]) == (0.0, 0.0)


def test_partial_delivery_is_reported():
    # The runner always says red: it delivers word 0 (red) on turn 0, never word 1 (blue).
    ep = run_workflow(RelayWorkflow, TASK, llm={"caller": "red", "runner": "red"}, max_turns=4)
    assert ep.truncated and (ep.metrics["mas/success"], ep.metrics["mas/delivered"]) == (0.0, 0.5)


def test_invalid_task_raises_naming_the_fix():
    with pytest.raises(Exception, match="ACTION_WORDS"):
        run_workflow(RelayWorkflow, {"message": ["red", "purple"]}, llm={"caller": "red", "runner": "red"})


def test_check_workflow_passes():
    check_workflow(RelayWorkflow, TASK)


def test_a_random_policy_succeeds_sometimes_and_groups_have_variance():
    episodes = [run_workflow(RelayWorkflow, TASK, llm=RandomLLM(seed), seed=seed) for seed in range(12)]
    success = [ep.metrics["mas/success"] for ep in episodes]
    assert 0.0 < sum(success) < len(success)
    varied = [len({c.reward for c in g.all}) > 1 for ep in episodes for g in ep.groups]
    assert sum(varied) > len(varied) / 4


def test_generate_task_is_deterministic_json_and_in_vocabulary():
    draw = RelayWorkflow.generate_task
    assert draw(random.Random(3), "train") == draw(random.Random(3), "train")
    rng = random.Random(0)
    tasks = [RelayWorkflow.generate_task(rng, "test") for _ in range(1000)]
    for task in tasks:
        assert json.loads(json.dumps(task)) == task
        assert len(task["message"]) == MESSAGE_LENGTH and set(task["message"]) <= set(ACTION_WORDS)
    assert len({json.dumps(t) for t in tasks}) == len(ACTION_WORDS) ** MESSAGE_LENGTH  # 1000 draws hit all 10 ** 2


def test_tailored_tokenizer_covers_every_prompt_and_answer():
    from verl_mas.tiny import build_tokenizer

    tok = build_tokenizer(vocab=RelayWorkflow.vocabulary)
    for word in ACTION_WORDS:
        assert len(tok.encode(word, add_special_tokens=False)) == 1  # an answer is one token
    ep = run_workflow(RelayWorkflow, TASK, llm={"caller": "zzz", "runner": "red"}, tokenizer=tok, max_turns=1)
    for g in ep.groups:  # "caller red", "runner nothing": every prompt word is one token, nothing lost
        content = g.messages[-1]["content"]
        assert tok.decode(tok.encode(content, add_special_tokens=False)) == content
        assert len(tok.encode(content, add_special_tokens=False)) == 2
        assert len(g.prompt_ids) <= 12


def test_held_out_relay_tasks_are_new_word_pairs_whose_every_prompt_occurs_in_training(tmp_path):
    """What the quickstart's held-out figure measures, and that the docs quoting it say so."""
    import pandas as pd

    from verl_mas.data import write_dataset

    train_file, test_file = write_dataset("relay-v0", tmp_path, train=64, test=16, seed=0)  # as run.sh writes them

    def messages(path):
        return [tuple(json.loads(info["task"])["message"]) if isinstance(info["task"], str) else tuple(info["task"]["message"])
                for info in pd.read_parquet(path)["extra_info"]]

    train, test = messages(train_file), messages(test_file)
    assert len(test) == 16 and not set(train) & set(test)  # no test word pair is a training task
    # A relay prompt is "caller <next word>" or "runner <committed word>": no history. Every word of a test
    # message is a word of some training message, and the runner's prompts range over the same words and
    # "nothing" in both splits, so every prompt a test episode can meet also occurs in training.
    assert {w for m in test for w in m} <= {w for m in train for w in m}
    repo = Path(__file__).resolve().parents[1]
    quoted = {"README.md": repo / "README.md", "recipe README": repo / "recipes" / "at_grpo_cpu" / "README.md",
              "recipe yaml": repo / "recipes" / "at_grpo_cpu" / "at_grpo_cpu.yaml"}
    for name, path in quoted.items():
        text = " ".join(path.read_text().split())
        assert "also occurs in training" in text.replace("# ", ""), f"{name} quotes held-out success without the caveat"


# ---- relay-chain-v0: three roles in sequence, the courier passes the word on encoded --------------------


def test_the_couriers_code_is_the_next_action_word_cyclically():
    assert [encode(w) for w in ("red", "blue", "lime", "navy")] == ["blue", "green", "navy", "red"]
    assert sorted(encode(w) for w in ACTION_WORDS) == sorted(ACTION_WORDS)  # a permutation: decodable


def test_chain_episode_rewards_each_role_on_what_it_saw_and_only_the_runner_delivers():
    llm = ScriptedLLM(
        {
            # turn 0 (target red): red, blue, red, junk -> commits red | turn 1 (target blue): blue x4
            "caller": ["red", "blue", "red", "zzz"] + ["blue"] * 4,
            # turn 0 heard red, its code is blue: red, blue, gold, blue -> commits blue (#1) |
            # turn 1 heard blue, code green: green, green, blue, zzz -> commits green (#0)
            "courier": ["red", "blue", "gold", "blue"] + ["green", "green", "blue", "zzz"],
            # turn 0 heard blue (the code of red): red delivers; blue (a faithful copy) does not |
            # turn 1 heard green: blue delivers
            "runner": ["blue", "red", "gold", "red"] + ["green", "pink", "blue", "blue"],
        }
    )
    ep = run_workflow(RelayChainWorkflow, TASK, llm=llm, branching=4, max_turns=4)
    assert not ep.validate()
    (c0, k0, r0), (c1, k1, r1) = ep.turns
    assert c0.messages[-1]["content"] == "caller red"
    assert [c.reward for c in c0.all] == [1.0, 0.0, 1.0, 0.0] and c0.committed.index == 0
    # The courier sees the caller's committed word (never the target) and is paid for its code.
    assert k0.messages[-1]["content"] == "courier red"
    assert [c.local_reward for c in k0.all] == [0.0, 1.0, 0.0, 1.0] and k0.committed.index == 1
    assert [c.reward for c in k0.all] == [0.0, 1.0, 0.0, 1.0]  # no team part before the runner acts
    # The runner sees the courier's committed word and is paid (team) for the target only.
    assert r0.messages[-1]["content"] == "runner blue"
    assert [c.team_reward for c in r0.all] == [0.0, 1.0, 0.0, 1.0] and r0.committed.index == 1
    assert [c.local_reward for c in r0.all] == [0.0] * 4
    assert c1.messages[-1]["content"] == "caller blue" and k1.messages[-1]["content"] == "courier blue"
    assert [c.reward for c in k1.all] == [1.0, 1.0, 0.0, 0.0]
    assert r1.messages[-1]["content"] == "runner green"
    assert [c.reward for c in r1.all] == [0.0, 0.0, 1.0, 1.0]
    assert ep.terminated and ep.num_turns == 2
    assert (ep.metrics["mas/success"], ep.metrics["mas/delivered"]) == (1.0, 1.0)


def test_a_chain_that_copies_instead_of_encoding_never_delivers():
    # Every role repeats what it hears (relay-v0's solution): the runner hears the target itself, not its code.
    ep = run_workflow(RelayChainWorkflow, TASK, llm={"caller": "red", "courier": "red", "runner": "red"}, max_turns=2)
    for caller, courier, runner in ep.turns:
        assert runner.messages[-1]["content"] == "runner red"
        assert [c.reward for c in courier.all] == [0.0] * 4  # red is not the code of red
    assert ep.turns[0][2].all[0].reward == 1.0  # turn 0's target is red: the runner's red delivers it by luck
    assert (ep.metrics["mas/success"], ep.metrics["mas/delivered"]) == (0.0, 0.5)


def test_chain_check_workflow_random_play_and_tokenizer():
    from verl_mas.tiny import build_tokenizer

    check_workflow(RelayChainWorkflow, TASK)
    episodes = [run_workflow(RelayChainWorkflow, TASK, llm=RandomLLM(seed), seed=seed) for seed in range(40)]
    assert 0 < sum(ep.metrics["mas/success"] for ep in episodes) < len(episodes)
    tok = build_tokenizer(vocab=RelayChainWorkflow.vocabulary)
    ep = run_workflow(RelayChainWorkflow, TASK, llm={"caller": "zzz", "courier": "navy", "runner": "red"},
                      tokenizer=tok, max_turns=1)
    assert [g.messages[-1]["content"] for g in ep.groups] == ["caller red", "courier nothing", "runner navy"]
    for g in ep.groups:
        content = g.messages[-1]["content"]
        assert tok.decode(tok.encode(content, add_special_tokens=False)) == content
        assert len(tok.encode(content, add_special_tokens=False)) == 2
