"""The mas agent loop and the trainer's grouping, on real episodes sampled from the tiny model.

The agent loop is verl's class instantiated as verl does (trainer config, tokenizer, a server client); the
server is the hf backend's real generation engine behind verl's ``TokenOutput`` contract, in process.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_mas.backends.hf.engine import HFGenerationEngine, settings_from_verl
from verl_mas.config import MasConfig, MasConfigError
from verl_mas.rows import CandidateRow
from verl_mas.trainer import assign_groups


class EngineServerClient:
    """verl's LLM server client contract (``generate(request_id, prompt_ids=, sampling_params=)``) over the engine."""

    def __init__(self, engine: HFGenerationEngine) -> None:
        self.engine = engine
        self.calls = 0
        self.requests: list[tuple[str, list[int], dict]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        self.requests.append((request_id, list(prompt_ids), dict(sampling_params)))
        settings = settings_from_verl(
            sampling_params, prompt_len=len(prompt_ids), response_length=6, prompt_length=512, max_model_len=600
        )
        result = await self.engine.generate(prompt_ids, settings)
        return TokenOutput(token_ids=result.token_ids, log_probs=result.log_probs, stop_reason="completed",
                           extra_fields={"global_steps": 3})


def _make_loop(tiny_model_dir: Path, mas_block: dict, *, rollout: dict | None = None, chat_kwargs: dict | None = None,
               trainer_mode: str = "mas", client=None, tokenizer=None, actor_rollout_ref: dict | None = None):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from verl_mas.agent_loop import MasAgentLoop

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {**(actor_rollout_ref or {}),
                                  "rollout": {"response_length": 6, "prompt_length": 512, **(rollout or {})}},
            "data": {"apply_chat_template_kwargs": dict(chat_kwargs or {})},
            "trainer": {"v1": {"trainer_mode": trainer_mode}},
            "mas": mas_block,
        }
    )
    engine = HFGenerationEngine.from_pretrained(str(tiny_model_dir), seed=0)
    client = EngineServerClient(engine) if client is None else client
    loop = MasAgentLoop(
        trainer_config=DictConfigWrap(config),
        server_manager=client,
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir) if tokenizer is None else tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
    )
    return loop, client, engine


def _assert_logprobs_are_the_models(engine: HFGenerationEngine, out) -> None:
    """``out``'s rollout log-probs are its sampled tokens' log-probs under the model (one full forward pass)."""
    ids = torch.tensor([out.prompt_ids + out.response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    n = len(out.prompt_ids)
    ref = torch.log_softmax(logits[n - 1 : n - 1 + len(out.response_ids)], -1).gather(
        1, torch.tensor(out.response_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.response_logprobs), ref, atol=1e-5)


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _row(uid: str, task: dict, split: str = "train") -> dict:
    return {"uid": uid, "session_id": 0, "index": 0,
            "extra_info": {"workflow": "toy-walk-v0", "task": json.dumps(task), "index": 0, "split": split}}


async def test_one_output_per_candidate_with_consistent_masks_logprobs_and_groups(tiny_model_dir: Path) -> None:
    loop, client, engine = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2})
    outputs = await loop.run(dict(SAMPLING), **_row("taskA", {"start": 0, "goal": 5}))
    # goal 5 is unreachable in 2 turns: 2 turns x 2 roles x K=3 = 12 candidates, 12 requests, 12 outputs.
    assert client.calls == 12 and len(outputs) == 12
    groups: dict[str, list] = {}
    for out in outputs:
        extra = out.extra_fields
        assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs) <= 6
        assert set(out.response_mask) == {1}
        row = CandidateRow.from_extra_fields(extra)
        assert row.reward == out.reward_score
        assert extra["min_global_steps"] == extra["max_global_steps"] == 3
        groups.setdefault(f"taskA|{row.role}|{row.turn}", []).append(out)
    assert sorted(groups) == ["taskA|mover|0", "taskA|mover|1", "taskA|planner|0", "taskA|planner|1"]
    for members in groups.values():
        assert len(members) == 3
        # one prompt per group, by construction and by hash
        assert all(m.prompt_ids == members[0].prompt_ids for m in members)
        assert len({m.extra_fields["mas_prompt_hash"] for m in members}) == 1
        assert sum(m.extra_fields["mas_committed"] for m in members) == 1
    # The rollout log-probs are the sampled tokens' log-probs under the model (one full forward pass).
    _assert_logprobs_are_the_models(engine, outputs[0])
    # Every output carries the same field names (verl's multi-output schema comes from the first one).
    assert len({tuple(sorted(o.extra_fields)) for o in outputs}) == 1


async def test_validation_rows_run_single_sample_episodes_and_report_success_as_acc(tiny_model_dir: Path) -> None:
    loop, client, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2})
    # A test-split row (verl's validation set as python -m verl_mas.data writes it): mas.val_branching=1,
    # so 2 turns x 2 roles x 1 candidate = 4 requests (a training row of the same task makes 12, above), and
    # as many again for the greedy episode of the same task (mas.val_greedy, on by default).
    outputs = await loop.run(dict(SAMPLING), **_row("taskV", {"start": 0, "goal": 5}, split="test"))
    assert client.calls == 8 and len(outputs) == 4
    assert [r[2]["temperature"] for r in client.requests] == [1.0] * 4 + [0] * 4
    assert all(o.extra_fields["mas_committed"] for o in outputs)
    # goal 5 is unreachable in 2 turns: the team fails, and verl's validation reads acc from reward_extra_info.
    assert {tuple(o.extra_fields["reward_extra_info"].items()) for o in outputs} == {(("acc", 0.0), ("acc_greedy", 0.0))}
    loop3, client3, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2, "val_branching": 2})
    assert len(await loop3.run(dict(SAMPLING), **_row("taskV", {"start": 0, "goal": 5}, split="test"))) == 8
    assert client3.calls == 8 + 4  # the greedy episode takes one candidate per node whatever val_branching
    # Off, or validation already greedy (val_kwargs.do_sample=false): one episode, no acc_greedy.
    for block, params in (({"val_greedy": False}, SAMPLING), ({}, {**SAMPLING, "temperature": 0})):
        loop4, client4, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2, **block})
        outputs = await loop4.run(dict(params), **_row("taskV", {"start": 0, "goal": 5}, split="test"))
        assert client4.calls == 4 and set(outputs[0].extra_fields["reward_extra_info"]) == {"acc"}
    # Training rows never play a greedy episode.
    loop5, client5, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2})
    await loop5.run(dict(SAMPLING), **_row("taskT", {"start": 0, "goal": 5}))
    assert client5.calls == 12


class _GreedyKnowsTheWay:
    """verl's server-client contract: answers 'right' when decoding greedily, 'left' when sampling."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        ids = self.tokenizer.encode("right" if sampling_params["temperature"] == 0 else "left", add_special_tokens=False)
        return TokenOutput(token_ids=ids + [self.tokenizer.eos_token_id], log_probs=[-0.1] * (len(ids) + 1),
                           stop_reason="completed", extra_fields={"global_steps": 3})


async def test_acc_greedy_is_the_greedy_episode_success_and_acc_the_sampled_one(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loop, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, client=_GreedyKnowsTheWay(tokenizer))
    outputs = await loop.run(dict(SAMPLING), **_row("taskG", {"start": 0, "goal": 1}, split="test"))
    # The sampled episode walks left (fails: its rows are the outputs), the greedy one reaches the goal.
    assert {tuple(o.extra_fields["reward_extra_info"].items()) for o in outputs} == {(("acc", 0.0), ("acc_greedy", 1.0))}


# The mas: blocks of the policy layouts (toy-walk's roles: planner, mover); under a shared LoRA base the policies
# are adapters of one base model (mas.lora_base: shared, the default).
_LAYOUTS = {
    "one policy": ({}, None),
    "several policies": ({"policies": {"p": {}, "m": {}},
                          "roles": {"planner": {"policy": "p"}, "mover": {"policy": "m"}}}, None),
    "shared LoRA base": ({"policies": {"a": {"model": {"lora_rank": 4}}, "b": {"model": {"lora_rank": 4}}},
                          "roles": {"planner": {"policy": "a"}, "mover": {"policy": "b"}}},
                         {"model": {"lora_rank": 0}}),
}


async def test_val_kwargs_do_sample_false_decodes_greedily_in_every_policy_layout(tiny_model_dir: Path) -> None:
    # verl's V1 agent loop hands validation val_kwargs' temperature (1.0 here) and ignores do_sample; the mas agent
    # loop reads do_sample for every policy, so the same val_kwargs mean the same decoding in every layout.
    for layout, (block, arr) in _LAYOUTS.items():
        arr = {**(arr or {}), "model": {"path": str(tiny_model_dir), **(arr or {}).get("model", {})}}
        for do_sample, temperatures, keys in (
            # greedy: one episode at temperature 0 (2 turns x 2 roles x 1 candidate), no separate greedy episode
            (False, [0] * 4, {"acc"}),
            # control: sampled at val_kwargs' temperature, then the greedy episode (mas.val_greedy)
            (True, [1.0] * 4 + [0] * 4, {"acc", "acc_greedy"}),
        ):
            val_kwargs = {"n": 1, "do_sample": do_sample, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
            loop, client, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2, **block},
                                         rollout={"val_kwargs": val_kwargs}, actor_rollout_ref=arr)
            outputs = await loop.run(dict(SAMPLING), **_row("taskS", {"start": 0, "goal": 5}, split="test"))
            sent = [(r[2]["temperature"], r[2]["top_p"], r[2]["top_k"]) for r in client.requests]
            assert sent == [(t, 1.0, -1) for t in temperatures], (layout, do_sample)
            assert set(outputs[0].extra_fields["reward_extra_info"]) == keys, (layout, do_sample)


class _CountingGreedyClient(_GreedyKnowsTheWay):
    """:class:`_GreedyKnowsTheWay` that records the temperature of every request."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.temperatures: list[float] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        self.temperatures.append(sampling_params["temperature"])
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


async def test_the_greedy_episode_is_played_once_per_task_and_read_by_every_session(tiny_model_dir: Path) -> None:
    import asyncio

    from transformers import AutoTokenizer
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    from verl_mas import agent_loop

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = _CountingGreedyClient(tokenizer)  # verl's server client, shared by every session of the worker
    val_kwargs = {"n": 4, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    # Two tasks, four validation sessions each, all in flight together as verl's worker runs them (an agent loop
    # per session). Greedy walks right, sampling walks left: a walk that reaches its goal ends after turn 0
    # (2 requests: planner, mover), one that does not plays 2 turns x 2 roles x K=1 = 4 requests. Goal 1: greedy
    # 2, sampled 4; goal -1: greedy 4, sampled 2.
    tasks = {"taskUp": {"start": 0, "goal": 1}, "taskDown": {"start": 0, "goal": -1}}
    sessions = []
    for uid, task in tasks.items():
        for session in range(4):
            loop, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2},
                                    rollout={"val_kwargs": val_kwargs}, client=client, tokenizer=tokenizer)
            sessions.append((uid, loop.run(dict(SAMPLING), **{**_row(uid, task, split="test"), "session_id": session})))
    results = await asyncio.gather(*(run for _, run in sessions))
    # One greedy episode per task: 2 + 4 greedy requests (one per session would be 4 x 2 + 4 x 4 = 24); sampled
    # 4 x 4 + 4 x 2 = 24.
    assert client.temperatures.count(0) == 2 + 4 and client.temperatures.count(1.0) == 24
    assert len(client.temperatures) == 30
    assert agent_loop._GREEDY == {}  # every session read its task's entry, which then left
    # Every session reports its task's greedy success; goal -1 is left of the start, where sampling walks.
    infos = [outputs[-1].extra_fields["reward_extra_info"] for outputs in results]  # verl reads a session's last row
    assert [(uid, info) for (uid, _), info in zip(sessions, infos, strict=True)] == (
        [("taskUp", {"acc": 0.0, "acc_greedy": 1.0})] * 4 + [("taskDown", {"acc": 1.0, "acc_greedy": 0.0})] * 4)
    # verl's validation metrics from them: acc_greedy/mean@4 is each task's greedy success, averaged over tasks.
    metrics = process_validation_metrics(["walk"] * 8, [uid for uid, _ in sessions],
                                         {key: [info[key] for info in infos] for key in ("acc", "acc_greedy")})
    assert metrics["walk"]["acc_greedy"]["mean@4"] == 0.5 and metrics["walk"]["acc"]["mean@4"] == 0.5


async def test_grouping_passes_on_real_rows_and_a_broken_key_is_caught(tiny_model_dir: Path) -> None:
    from verl_mas.advantage.groups import group_invariant_problems

    loop, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2})
    rows = []
    for uid, task in (("t1", {"start": 0, "goal": 3}), ("t2", {"start": 1, "goal": -3})):
        for out in await loop.run(dict(SAMPLING), **_row(uid, task)):
            rows.append((uid, out.extra_fields))
    random.Random(0).shuffle(rows)  # batches interleave tasks, roles and turns
    uids = [u for u, _ in rows]
    extras = [CandidateRow.from_extra_fields(e) for _, e in rows]
    mas = MasConfig(branching=2, max_turns=2)
    groups = assign_groups(extras, uids, np.zeros(len(rows), dtype=bool), mas)
    # 2 tasks x 2 turns x 2 roles = 8 groups of K=2 (both goals are out of reach in 2 turns).
    assert len(set(groups.ids.tolist())) == 8
    assert np.bincount(groups.ids).tolist() == [2] * 8
    # Negative control: the reference implementation's index arithmetic (row // K) on a shuffled batch
    # puts rows of different tasks, roles or turns together; the check, which reads the rows' own fields,
    # names the groups.
    broken_ids = np.arange(len(rows)) // 2
    problems = group_invariant_problems(
        broken_ids, groups.keys, grouping="agent_turn", sampling="tree", task_uids=uids, episodes=uids,
        roles=[e.role for e in extras], turns=[e.turn for e in extras],
        prompt_hashes=[e.prompt_hash for e in extras])
    assert problems and all(re.search(r"group\(s\) mix (tasks|roles|turns)", p) for p in problems)
    # Padding rows never join a real group.
    padding = np.zeros(len(rows), dtype=bool)
    padding[0] = True
    padded = assign_groups(extras, uids, padding, mas)
    assert np.sum(padded.ids == padded.ids[0]) == 1


def test_mas_config_reports_every_problem_and_unknown_keys() -> None:
    with pytest.raises(MasConfigError) as err:
        MasConfig(branching=0, max_turns=-1, grouping="turn", sampling="parallel", roles={"tester": {"policy": "coder"}})
    message = str(err.value)
    for expected in ("mas.branching is 0", "mas.max_turns is -1", "mas.grouping is 'turn'",
                     "mas.roles.tester.policy is 'coder'", "set mas.branching=1"):
        assert expected in message, expected
    with pytest.raises(MasConfigError, match=r"Unknown keys in the mas: config block: \['brnaching'\]"):
        MasConfig.from_mapping({"brnaching": 4})
    cfg = MasConfig.from_mapping({"branching": 2, "alpha": 0.5})
    assert (cfg.episode_config.branching, cfg.episode_config.alpha) == (2, 0.5)


def test_mas_config_validates_the_sandbox_block_with_the_rest() -> None:
    with pytest.raises(MasConfigError) as err:
        MasConfig(branching=0, sandbox={"timeout_s": 2, "bogus": 1})
    assert "mas.branching is 0" in str(err.value) and "unknown key(s) ['bogus']" in str(err.value)
    assert MasConfig(sandbox={"timeout_s": 2}).sandbox == {"timeout_s": 2}


async def test_an_episode_that_outgrows_the_context_ends_as_a_failure(tiny_model_dir: Path) -> None:
    # toy-walk prompts of this tokenizer (measured): planner 78 tokens at turn 0 and 135 at turn 1, mover 97.
    # max_model_len 120 leaves room for prompts of at most 119 tokens: turn 0 runs, the planner's turn-1
    # prompt does not fit, so the episode ends there, before any request for it.
    loop, client, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, rollout={"max_model_len": 120})
    outputs = await loop.run(dict(SAMPLING), **_row("taskO", {"start": 0, "goal": 5}))
    assert client.calls == 4 and len(outputs) == 4  # 2 roles x K=2 at turn 0, nothing at turn 1
    assert {(o.extra_fields["mas_role"], o.extra_fields["mas_turn"]) for o in outputs} == {("planner", 0), ("mover", 0)}
    metrics = outputs[0].extra_fields["mas_episode_metrics"]
    assert metrics["mas/context_overflow"] == 1.0 and metrics["mas/success"] == 0.0
    assert metrics["mas/truncated"] == 1.0 and metrics["mas/aborted"] == 0.0
    assert outputs[0].extra_fields["reward_extra_info"] == {"acc": 0.0}
    # Control: with room for the turn-1 prompt the same episode plays both turns.
    loop2, client2, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, rollout={"max_model_len": 137})
    outputs2 = await loop2.run(dict(SAMPLING), **_row("taskO", {"start": 0, "goal": 5}))
    assert client2.calls == 8 and outputs2[0].extra_fields["mas_episode_metrics"]["mas/context_overflow"] == 0.0


class _RaisingClient:
    """A verl server client whose server fails the way Ray reports it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls = 0

    async def generate(self, request_id: str, **kwargs):
        self.calls += 1
        raise self.error


async def test_a_server_that_rejects_a_request_stops_the_run_a_lost_one_aborts_the_episode(tiny_model_dir: Path) -> None:
    import ray

    from verl_mas.agent_loop import RolloutServerError
    from verl_mas.errors import LLMClientError

    rejected = ray.exceptions.RayTaskError(
        function_name="generate", traceback_str="Traceback ...",
        cause=ValueError("Prompt length (600) leaves no room to generate within the model's maximum context length"))
    loop, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, client=_RaisingClient(rejected))
    with pytest.raises(LLMClientError) as err:
        await loop.run(dict(SAMPLING), **_row("taskE", {"start": 0, "goal": 5}))
    assert isinstance(err.value.__cause__, RolloutServerError) and "leaves no room" in str(err.value)
    # A lost replica (actor died) is an infrastructure failure: the episode aborts, nothing is trained on.
    lost = ray.exceptions.ActorDiedError()
    loop2, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, client=_RaisingClient(lost))
    assert await loop2.run(dict(SAMPLING), **_row("taskE", {"start": 0, "goal": 5})) == []
    # A server out of memory while serving is transient too.
    oom = ray.exceptions.RayTaskError(function_name="generate", traceback_str="...", cause=torch.OutOfMemoryError("x"))
    loop3, _, _ = _make_loop(tiny_model_dir, {"branching": 2, "max_turns": 2}, client=_RaisingClient(oom))
    assert await loop3.run(dict(SAMPLING), **_row("taskE", {"start": 0, "goal": 5})) == []


def test_the_agent_loop_refuses_to_run_under_another_trainer(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer_mode='sync'.*Set trainer.v1.trainer_mode=mas"):
        _make_loop(tiny_model_dir, {}, trainer_mode="sync")
    # Under the mas trainer verl's config reads trainer_mode=sync plus the trainer's mark.
    from omegaconf import OmegaConf

    from verl_mas.config import MAS_TRAINER_MARK, mas_trainer_selected

    assert mas_trainer_selected(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "sync", MAS_TRAINER_MARK: True}}}))
    assert not mas_trainer_selected(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "sync"}}}))


async def test_each_candidate_has_its_own_request_id_routed_by_its_session(tiny_model_dir: Path) -> None:
    from verl_mas.routing import routing_key

    loop, client, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2})
    await loop.run(dict(SAMPLING), **_row("taskR", {"start": 0, "goal": 5}))
    ids = [r[0] for r in client.requests]
    assert len(ids) == 12 and len(set(ids)) == 12  # distinct per candidate (verl forwards them under full_determinism)
    sessions = {routing_key(i) for i in ids}
    # One routing key per (episode, role): every candidate and turn of a role reaches one server.
    assert len(sessions) == 2 and all(s.startswith("taskR|") for s in sessions)
    assert sorted(i for i in ids if "|planner|" in i)[:3] == [f"{routing_key(ids[0])}#0.{k}" for k in range(3)]


class ServerClient:
    """verl's LLM server client contract over the hf backend's real server class, in process: ``**kwargs`` pass
    through to the server, and verl's client fields (min/max global steps) are stamped on what it returns.
    ``keep`` cuts every group to its first ``keep`` samples (a server breaking the grouped contract)."""

    def __init__(self, tiny_model_dir: Path, keep: int | None = None) -> None:
        from verl.workers.config import RolloutConfig

        from verl_mas.backends.hf.server import HFRolloutServer

        class ModelConfig:
            path = local_path = str(tiny_model_dir)
            trust_remote_code = False

        config = RolloutConfig(name="hf", prompt_length=512, response_length=6, tensor_model_parallel_size=1)
        self.server = HFRolloutServer(config, ModelConfig(), replica_rank=1)
        self.server.global_steps = 3
        self.keep = keep
        self.requests: list[tuple[str, dict]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        self.requests.append((request_id, dict(kwargs)))
        out = await self.server.generate(prompt_ids, sampling_params, request_id, **kwargs)
        if self.keep is not None and "mas_group" in out.extra_fields:
            out.extra_fields["mas_group"] = out.extra_fields["mas_group"][: self.keep]
        out.extra_fields.setdefault("min_global_steps", out.extra_fields["global_steps"])
        out.extra_fields.setdefault("max_global_steps", out.extra_fields["global_steps"])
        return out


async def test_on_the_hf_backend_a_group_is_one_request_of_k_samples(tiny_model_dir: Path) -> None:
    from verl_mas.agent_loop import RolloutServerError
    from verl_mas.errors import LLMClientError
    from verl_mas.routing import routing_key

    client = ServerClient(tiny_model_dir)
    loop, _, engine = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2}, rollout={"name": "hf"}, client=client)
    outputs = await loop.run(dict(SAMPLING), **_row("taskG", {"start": 0, "goal": 5}))
    # goal 5 is unreachable in 2 turns: 2 turns x 2 roles = 4 groups, each one request for 3 samples -> 12 outputs.
    assert [kw for _, kw in client.requests] == [{"mas_samples": 3}] * 4 and len(outputs) == 12
    assert client.server.counter.stats() == {"requests": 4, "samples": 12}
    ids = [i for i, _ in client.requests]
    assert all(i == f"{routing_key(i)}#{turn}.0" for i, turn in zip(ids, (0, 0, 1, 1)))
    groups: dict[tuple[str, int], list] = {}
    for out in outputs:
        row = CandidateRow.from_extra_fields(out.extra_fields)
        groups.setdefault((row.role, row.turn), []).append(out)
        # Each sample keeps its own and the request's fields (verl's schema comes from the first output).
        assert out.extra_fields["min_global_steps"] == out.extra_fields["max_global_steps"] == 3
        assert out.extra_fields["mas_replica"] == 1 and "mas_group" not in out.extra_fields
    assert len({tuple(sorted(o.extra_fields)) for o in outputs}) == 1
    assert sorted(len(m) for m in groups.values()) == [3] * 4
    assert all(sum(m.extra_fields["mas_committed"] for m in members) == 1 for members in groups.values())
    # Every sample's log-probs are its own tokens' under the model (the samples were not mixed up in the group).
    for out in outputs:
        _assert_logprobs_are_the_models(engine, out)
    # Negative control: a server that answers a group with fewer samples than asked stops the run (not a model mistake).
    short, _, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2}, rollout={"name": "hf"},
                             client=ServerClient(tiny_model_dir, keep=2))
    with pytest.raises(LLMClientError) as err:
        await short.run(dict(SAMPLING), **_row("taskG", {"start": 0, "goal": 5}))
    assert isinstance(err.value.__cause__, RolloutServerError) and "got 2" in str(err.value)
    # Without a backend name (or on vLLM), the group is K single-sample requests, as verl's contract has it.
    fanned = ServerClient(tiny_model_dir)
    plain, _, _ = _make_loop(tiny_model_dir, {"branching": 3, "max_turns": 2}, client=fanned)
    assert len(await plain.run(dict(SAMPLING), **_row("taskG", {"start": 0, "goal": 5}))) == 12
    assert [kw for _, kw in fanned.requests] == [{}] * 12


async def test_chat_template_kwargs_reach_every_prompt_with_per_role_overrides(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    # A chat template that reacts to enable_thinking as Qwen3's does: an empty think block after the
    # generation prompt when thinking is off.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = tokenizer.chat_template + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}")

    async def prompts(chat_kwargs: dict, roles: dict) -> dict[str, str]:
        loop, client, _ = _make_loop(tiny_model_dir, {"branching": 1, "max_turns": 1, "roles": roles},
                                     chat_kwargs=chat_kwargs, tokenizer=tokenizer)
        outputs = await loop.run(dict(SAMPLING), **_row("taskC", {"start": 0, "goal": 5}))
        return {o.extra_fields["mas_role"]: tokenizer.decode(o.prompt_ids) for o in outputs}

    off = await prompts({"enable_thinking": False}, {})
    assert all(text.endswith("<think>\n\n</think>\n\n") for text in off.values())
    plain = await prompts({}, {})  # control: without the kwarg the template adds nothing
    assert not any("<think>" in text for text in plain.values())
    mixed = await prompts({"enable_thinking": False}, {"mover": {"chat_template_kwargs": {"enable_thinking": True}}})
    assert mixed["planner"].endswith("</think>\n\n") and "<think>" not in mixed["mover"]


async def test_every_key_of_the_mas_block_has_an_effect(tiny_model_dir: Path) -> None:
    """Each key of the mas: block set to a non-default value changes what the code does (a key that is
    validated but never read would fail here; a new key must add its observation)."""
    from dataclasses import fields

    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from verl_mas import run_episode, sandbox
    from verl_mas.advantage.at_grpo import compute_at_grpo_outcome_advantage
    from verl_mas.testing import ScriptedLLM
    from verl_mas.startup import prepare_verl_config
    from verl_mas.trainer import GroupPromptMismatchError, tune_replay_buffer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    walk = {"start": 0, "goal": 5}

    async def loop_rows(block: dict, row: dict | None = None) -> list:
        loop, _, _ = _make_loop(tiny_model_dir, {"max_turns": 2, **block})
        return await loop.run(dict(SAMPLING), **(row or _row("tk", walk)))

    async def episode(block: dict, llm=None, task=walk, seed=0):
        mas = MasConfig.from_mapping({"max_turns": 2, **block})
        return await run_episode("toy-walk-v0", task, client=llm or ScriptedLLM({"planner": "right", "mover": "right"},
                                 tokenizer=tokenizer), tokenizer=tokenizer, config=mas.episode_config, seed=seed)

    def groups_of(block: dict, rows: list, tamper: bool = False):
        extras = [dict(o.extra_fields) for o in rows]
        if tamper:
            extras[0]["mas_prompt_hash"] += 1
        return assign_groups([CandidateRow.from_extra_fields(e) for e in extras], ["tk"] * len(rows), np.zeros(len(rows), dtype=bool), MasConfig.from_mapping(block))

    tree_rows = await loop_rows({"branching": 2})

    async def branching() -> None:  # K candidates per (role, turn): 2 turns x 2 roles x K
        assert len(await loop_rows({"branching": 3})) == 12 and len(tree_rows) == 8

    async def max_turns() -> None:
        assert {o.extra_fields["mas_turn"] for o in await loop_rows({"max_turns": 1})} == {0}

    async def alpha() -> None:  # the mover reaches goal 1: team 1, local 0.75 -> reward alpha * 1 + 0.75
        movers = [c for c in (await episode({"alpha": 0.5}, task={"start": 0, "goal": 1})).candidates
                  if c.role == "mover"]
        assert movers[0].team_reward == 1.0 and movers[0].reward == 0.5 + movers[0].local_reward

    async def grouping() -> None:  # (task, role) instead of (task, role, turn): 2 groups instead of 4
        assert len(set(groups_of({"grouping": "agent"}, tree_rows).ids)) == 2
        assert len(set(groups_of({}, tree_rows).ids)) == 4

    async def sampling() -> None:  # parallel sampling draws one candidate per node: a K=2 tree is refused
        with pytest.raises(GroupPromptMismatchError, match="hold several candidates"):
            groups_of({"sampling": "parallel", "branching": 1}, tree_rows)

    async def tie_break() -> None:  # all candidates tie; "first" commits #0, "random" (seeded) varies
        def committed(ep) -> set[int]:
            return {c.index for c in ep.committed_branch}
        assert committed(await episode({})) == {0}
        picks = set().union(*[committed(await episode({"tie_break": "random"}, seed=s)) for s in range(4)])
        assert picks != {0}

    async def singleton_advantage() -> None:  # the trainer hands it to the at_grpo estimator
        cfg = OmegaConf.create({"trainer": {"v1": {"trainer_mode": "mas"}}, "algorithm": {}})
        mas = MasConfig(singleton_advantage="raw")
        prepare_verl_config(cfg, mas, {})
        rewards, mask = torch.tensor([[2.0]]), torch.ones(1, 1)
        adv, _ = compute_at_grpo_outcome_advantage(rewards, mask, np.array(["u|r|0"], dtype=object), config=cfg.algorithm)
        assert adv.item() == 2.0  # "zero" (default) would give 0
        assert cfg.trainer.v1.trainer_mode == "sync" and cfg.trainer.v1.mas_trainer

    async def check_group_prompts() -> None:  # a node whose candidates report two prompts: raise, or not
        with pytest.raises(GroupPromptMismatchError, match="prompt hash"):
            groups_of({"branching": 2}, tree_rows, tamper=True)
        groups_of({"branching": 2, "check_group_prompts": False}, tree_rows, tamper=True)

    async def workflow() -> None:  # rows that name no workflow use mas.workflow
        row = _row("tk", walk)
        del row["extra_info"]["workflow"]
        with pytest.raises(ValueError, match="names no workflow"):
            await loop_rows({}, row)
        assert len(await loop_rows({"workflow": "toy-walk-v0", "branching": 1}, row)) == 4

    async def roles_and_policies() -> None:  # each role's rows carry (and its requests reach) its policy
        rows = await loop_rows({"branching": 1, "policies": {"p": {}, "m": {}},
                                "roles": {"planner": {"policy": "p"}, "mover": {"policy": "m"}}})
        assert {(o.extra_fields["mas_role"], o.extra_fields["mas_policy"]) for o in rows} == {
            ("planner", "p"), ("mover", "m")}

    async def sandbox_block() -> None:  # the agent loop configures the sandbox every workflow runs code in
        try:
            _make_loop(tiny_model_dir, {"sandbox": {"timeout_s": 3}})
            assert sandbox.backend._as_config(None).timeout_s == 3
        finally:
            sandbox.configure(None)

    async def val_branching() -> None:  # validation rows: K = val_branching
        assert len(await loop_rows({"branching": 1, "val_branching": 3}, _row("tk", walk, split="test"))) == 12

    async def request_timeout_s() -> None:  # a request slower than the timeout is an infrastructure failure
        slow = ScriptedLLM({"planner": "right", "mover": "right"}, tokenizer=tokenizer, latency_s=0.5)
        assert (await episode({"request_timeout_s": 0.05}, llm=slow)).aborted
        assert not (await episode({}, llm=slow)).aborted

    async def replay_poll_interval_s() -> None:
        class Buffer:
            poll_interval = 2.0
            failure_keys: dict = {}

            def _sync_metadata_from_transfer_queue(self):
                return None

            def _materialize_batch(self, *args):
                return None

        buffer = Buffer()
        tune_replay_buffer(buffer, MasConfig(replay_poll_interval_s=0.05), {})
        assert buffer.poll_interval == 0.05

    async def record() -> None:  # the agent loop writes sampled episodes for python -m verl_mas.view
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            block = {"branching": 2, "record": {"dir": folder, "every_n_steps": 2, "episodes": 1}}
            for _ in range(2):  # the server reports weight version 3: step 4 is recorded, one episode per worker
                await loop_rows(block)
            files = sorted(Path(folder).glob("episodes_train_step000004_*.jsonl"))
            assert len(files) == 1 and len(files[0].read_text().splitlines()) == 1
            assert json.loads(files[0].read_text())["step"] == 4

    async def val_greedy() -> None:  # validation also plays the task greedily: acc_greedy next to acc
        for block, keys in (({}, {"acc", "acc_greedy"}), ({"val_greedy": False}, {"acc"})):
            rows = await loop_rows({"branching": 1, **block}, _row("tk", walk, split="test"))
            assert set(rows[0].extra_fields["reward_extra_info"]) == keys

    async def drop_zero_variance() -> None:  # the trainer leaves the rows of flat groups out of the update
        from verl_mas.trainer import rows_to_drop

        groups = groups_of({"branching": 2}, tree_rows)  # goal 5 out of reach: every walk group's rewards...
        flat = [len(set(groups.rewards[groups.ids == g].tolist())) == 1 for g in groups.ids]
        padding = np.zeros(len(tree_rows), dtype=bool)
        dropped, metrics = rows_to_drop(groups, padding, MasConfig(branching=2, drop_zero_variance=True))
        assert dropped.tolist() == flat and metrics
        off = MasConfig(branching=2, drop_zero_variance=False)
        assert rows_to_drop(groups, padding, off)[0].tolist() == [False] * len(flat)
        assert MasConfig().drop_zero_variance  # on by default (the measured setting, recipes/at_grpo_cpu/README.md)

    async def trajectory_reward() -> None:  # trajectory GRPO: a role's return, or the team outcome, per row

        rows = [CandidateRow(workflow="w", role="r", turn=t, policy="default", reward=0.25, team_reward=float("nan"),
                             local_reward=float("nan"), committed=True, prompt_hash=t, episode_index=t,
                             episode_metrics={"mas/success": 1.0}) for t in range(2)]
        block = {"grouping": "trajectory", "sampling": "parallel", "branching": 1}
        scores = [assign_groups(rows, ["u", "u"], np.zeros(2, dtype=bool), MasConfig.from_mapping({**block, **extra}),
                                episodes=["u_0", "u_0"]).rewards.tolist() for extra in ({}, {"trajectory_reward": "success"})]
        assert scores == [[0.5, 0.5], [1.0, 1.0]]

    async def per_role() -> None:  # every role of the data's workflows gets a policy of its own
        from verl_mas.startup import expand_per_role

        cfg = OmegaConf.create({"mas": {"per_role": {"actor": {"optim": {"lr": 1e-3}}}, "workflow": "toy-walk-v0"},
                                "data": {}})
        assert expand_per_role(cfg, ["toy-walk-v0"]) == []
        assert list(cfg.mas.policies) == ["planner", "mover"] and cfg.mas.roles.mover.policy == "mover"
        assert MasConfig.from_verl_config(cfg).multi_policy

    async def lora_base() -> None:  # LoRA policies on one base share it (an adapter each) or get a stack each
        from verl_mas.policies import policy_configs
        from verl_mas.policies.adapters import shared_base_plan

        arr = OmegaConf.create({"model": {"path": "/m", "lora_rank": 0, "lora": {"merge": False}},
                                "actor": {}, "rollout": {"name": "hf", "custom": None}, "ref": {}})
        lora = {"policies": {"a": {"model": {"lora_rank": 4}}, "b": {"model": {"lora_rank": 4}}},
                "roles": {"x": {"policy": "a"}, "y": {"policy": "b"}}}
        plans = [shared_base_plan(mas, policy_configs(arr, mas))[0]
                 for mas in (MasConfig.from_mapping(lora), MasConfig.from_mapping({**lora, "lora_base": "per_policy"}))]
        assert list(plans[0]) == ["a", "b"] and plans[1] is None

    observations = {
        "record": record, "val_greedy": val_greedy, "lora_base": lora_base, "drop_zero_variance": drop_zero_variance,
        "branching": branching, "max_turns": max_turns, "alpha": alpha, "grouping": grouping, "sampling": sampling,
        "tie_break": tie_break, "singleton_advantage": singleton_advantage, "check_group_prompts": check_group_prompts,
        "workflow": workflow, "roles": roles_and_policies, "policies": roles_and_policies, "sandbox": sandbox_block,
        "val_branching": val_branching, "request_timeout_s": request_timeout_s,
        "replay_poll_interval_s": replay_poll_interval_s, "trajectory_reward": trajectory_reward,
        "per_role": per_role,
    }
    assert set(observations) == {f.name for f in fields(MasConfig)}
    for observe in dict.fromkeys(observations.values()):
        await observe()


def test_episode_settings_have_one_validator_for_the_engine_and_the_mas_block() -> None:
    from verl_mas.settings import EpisodeConfig, EpisodeSettings

    # Before, mas.alpha=nan passed the mas: block's validator and failed later in EpisodeConfig, inside a
    # rollout worker. Now both report the same problems, the block's prefixed with "mas.".
    bad = {"branching": 0, "max_turns": True, "alpha": float("nan"), "tie_break": "best", "request_timeout_s": 0}
    engine = EpisodeSettings(**bad).setting_problems()
    assert len(engine) == 5
    _, block = MasConfig.parse(bad)
    assert block == ["mas." + p for p in engine]
    with pytest.raises(ValueError, match="5 problems"):
        EpisodeConfig(**bad)
    # The block hands every episode setting to the engine without listing them again.
    mas = MasConfig(branching=3, max_turns=2, alpha=0.5, tie_break="random", request_timeout_s=7.0, val_branching=1)
    train, val = mas.episode_config_for(validate=False), mas.episode_config_for(validate=True)
    assert (train.branching, train.max_turns, train.alpha, train.tie_break, train.request_timeout_s) == (3, 2, 0.5,
                                                                                                       "random", 7.0)
    assert val.branching == 1 and val.alpha == 0.5
