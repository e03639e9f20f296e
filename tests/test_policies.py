"""Several policies (one model / one LoRA adapter per role): config, routing, metrics (fast tests).

The end-to-end runs through verl's main_ppo are in test_main_ppo_policies.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from verl_mas.config import MasConfig, MasConfigError
from verl_mas.policies import policy_configs, rollout_policy
from verl_mas.routing import PolicyRouterClient, RoleRouter

TWO = {"policies": {"caller": {}, "runner": {"model": {"path": "/models/b"}}},
       "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}}}


def test_policy_config_reports_every_problem_at_once() -> None:
    with pytest.raises(MasConfigError) as err:
        MasConfig.from_mapping({
            "policies": {"a": {}, "b": {"optim": {"lr": 1}}, "c": {}, "bad name": {}},
            "roles": {"x": {"policy": "a"}, "y": {"policy": "zz"}, "z": {"policy": "b", "lr": 3}},
        })
    message = str(err.value)
    for expected in (
        "mas.policies has the name 'bad name'",
        "mas.policies.b sets ['optim']",  # optim lives under actor:
        "mas.roles.y.policy is 'zz'",
        "mas.roles.z is {'policy': 'b', 'lr': 3}",
        "mas.policies ['b', 'c', 'bad name'] serve no role",
    ):
        assert expected in message, (expected, message)


def test_a_policy_may_have_a_resource_pool_of_its_own() -> None:
    mas = MasConfig.from_mapping({
        "policies": {"caller": {}, "runner": {"resources": {"n_gpus_per_node": 2, "nnodes": 2}}},
        "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}},
    })
    assert mas.policy_resources("caller") is None and mas.policy_resources("runner") == [2, 2]
    arr = OmegaConf.create({"model": {"path": "a"}, "actor": {}, "rollout": {"custom": None}, "ref": {}})
    assert "resources" not in policy_configs(arr, mas)["runner"]  # not part of actor_rollout_ref
    with pytest.raises(MasConfigError) as err:
        MasConfig.from_mapping({
            "policies": {"caller": {"resources": {"n_gpus_per_node": 1}}, "runner": {"resources": {"gpus": 1}},
                         "judge": {"resources": {"n_gpus_per_node": 0}}},
            "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}, "judge": {"policy": "judge"}},
        })
    message = str(err.value)
    assert "the first policy runs on verl's own pool" in message
    assert "mas.policies.runner.resources is {'gpus': 1}" in message
    assert "mas.policies.judge.resources is {'n_gpus_per_node': 0}" in message


def test_a_policy_may_be_frozen_while_another_trains() -> None:
    from verl_mas.policies.adapters import shared_base_plan

    mas = MasConfig.from_mapping({**TWO, "policies": {"caller": {}, "runner": {"frozen": True}}})
    assert mas.frozen_policies == ["runner"] and not mas.policy_frozen("caller")
    arr = OmegaConf.create({"model": {"path": "a"}, "actor": {}, "rollout": {"custom": None}, "ref": {}})
    assert "frozen" not in policy_configs(arr, mas)["runner"]  # not part of actor_rollout_ref
    # On a shared LoRA base the key is not an adapter override (which the plan would check against the first's).
    lora = MasConfig.from_mapping({**TWO, "policies": {"caller": {"model": {"lora_rank": 8}},
                                                      "runner": {"model": {"lora_rank": 8}, "frozen": True}}})
    assert lora.frozen_policies == ["runner"]
    assert shared_base_plan(lora, policy_configs(_lora_arr(), lora))[1] == []
    with pytest.raises(MasConfigError) as err:
        MasConfig.from_mapping({**TWO, "policies": {"caller": {"frozen": "yes"}, "runner": {}}})
    assert "mas.policies.caller.frozen is 'yes'; it must be true or false." in str(err.value)
    # Nothing left to train: every policy frozen, of several or of one.
    for policies in ({"caller": {"frozen": True}, "runner": {"frozen": True}}, {"default": {"frozen": True}}):
        block = {**TWO, "policies": policies} if len(policies) == 2 else {"policies": policies}
        with pytest.raises(MasConfigError, match="is frozen, so nothing would train"):
            MasConfig.from_mapping(block)


def test_routing_one_policy_serves_unlisted_roles_several_need_every_role() -> None:
    shared = RoleRouter.from_mas(MasConfig())
    assert shared.policy_of("anyone") == "default" and not shared.multi_policy
    assert shared.problems({"relay-v0": ("caller", "runner")}) == []
    two_block = MasConfig.from_mapping(TWO)
    two = RoleRouter.from_mas(two_block)
    assert two.multi_policy and two_block.policy_names == ["caller", "runner"]
    assert (two.policy_of("caller"), two.policy_of("runner")) == ("caller", "runner")
    with pytest.raises(MasConfigError, match="Role 'tool' is not routed"):
        two.policy_of("tool")
    problems = two.problems({"relay-v0": ("caller", "runner"), "plan-path-v0": ("tool", "planner")})
    assert problems == [
        "workflow 'plan-path-v0' has roles ['tool', 'planner'] that no policy serves: with several policies "
        "(['caller', 'runner']) every role needs mas.roles.<role>.policy."
    ]


def test_policy_configs_merge_overrides_check_keys_and_tag_rollouts() -> None:
    arr = OmegaConf.create({"model": {"path": "/models/a", "lora_rank": 0},
                            "actor": {"optim": {"lr": 3e-3, "weight_decay": 0.01}},
                            "rollout": {"name": "hf", "custom": None}, "ref": {}})
    mas = MasConfig.from_mapping({
        "policies": {"caller": {"actor": {"optim": {"lr": 1e-3}}},
                     "runner": {"model": {"path": "/models/b", "lora_rank": 8}}},
        "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}},
    })
    configs = policy_configs(arr, mas)
    assert configs["caller"].actor.optim.lr == 1e-3 and configs["caller"].model.path == "/models/a"
    assert configs["runner"].actor.optim.lr == 3e-3 and configs["runner"].model.path == "/models/b"
    assert configs["runner"].model.lora_rank == 8 and configs["runner"].actor.optim.weight_decay == 0.01
    # The first policy runs in verl's own stack; later ones name their rollout servers after themselves.
    assert rollout_policy(configs["caller"].rollout) is None and rollout_policy(configs["runner"].rollout) == "runner"
    assert arr.actor.optim.lr == 3e-3  # the recipe's block is not modified
    bad = MasConfig.from_mapping({
        "policies": {"caller": {"actor": {"optim": {"lrr": 1}}}, "runner": {"model": {"pth": "x"}}},
        "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}},
    })
    with pytest.raises(MasConfigError) as err:
        policy_configs(arr, bad)
    assert "mas.policies.caller.actor.optim.lrr: actor_rollout_ref.actor.optim.lrr does not exist" in str(err.value)
    assert "mas.policies.runner.model.pth: actor_rollout_ref.model.pth does not exist" in str(err.value)


def test_hf_server_names_are_distinct_per_policy() -> None:
    from verl_mas.backends.hf.server import server_actor_name

    assert server_actor_name(0, 0) == "hf_server_0_0"
    assert server_actor_name(0, 0, "runner") == "hf_server_0_0_runner" != server_actor_name(0, 0, "caller")


def test_merge_policy_metrics_prefixes_and_means() -> None:
    from verl_mas.policies.stacks import merge_policy_metrics

    merged = merge_policy_metrics({"a": {"actor/grad_norm": 1.0, "x": 2}, "b": {"actor/grad_norm": 3.0}})
    assert merged == {"policy/a/actor/grad_norm": 1.0, "policy/a/x": 2, "policy/b/actor/grad_norm": 3.0,
                      "actor/grad_norm": 2.0, "x": 2.0}
    # A step in which one policy of several computed: its name stays on the metric.
    assert merge_policy_metrics({"only": {"actor/grad_norm": 1.5}}) == {"policy/only/actor/grad_norm": 1.5,
                                                                       "actor/grad_norm": 1.5}


def test_routing_check_reads_the_workflows_named_by_the_data(tmp_path: Path) -> None:
    from verl_mas.data import write_dataset
    from verl_mas.routing import roles_of_workflows, workflows_in_data

    write_dataset("relay-v0", tmp_path, train=4, test=2, seed=0)
    config = OmegaConf.create({"data": {"train_files": str(tmp_path / "train.parquet"),
                                        "val_files": str(tmp_path / "test.parquet")}})
    assert workflows_in_data(config) == ["relay-v0"]
    roles = roles_of_workflows(workflows_in_data(config))
    assert RoleRouter.from_mas(MasConfig.from_mapping(TWO)).problems(roles) == []  # both relay roles routed
    half = MasConfig.from_mapping({"policies": {"caller": {}, "runner": {}},
                                   "roles": {"caller": {"policy": "caller"}, "planner": {"policy": "runner"}}})
    # relay-v0's runner has no route (the route of "planner", another workflow's role, serves no role here).
    assert RoleRouter.from_mas(half).problems(roles) == [
        "workflow 'relay-v0' has roles ['runner'] that no policy serves: with several policies (['caller', 'runner']) "
        "every role needs mas.roles.<role>.policy."]


class _RecordingClient:
    """Stands in for one policy's verl LLMServerClient: serves a real model, records what it served."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.config = OmegaConf.create({})
        self.prompts: list[list[int]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        from verl_mas.backends.hf.engine import settings_from_verl

        assert not kwargs, f"the router must not forward its own arguments to a verl client: {kwargs}"
        self.prompts.append(list(prompt_ids))
        settings = settings_from_verl(sampling_params, prompt_len=len(prompt_ids), response_length=4,
                                      prompt_length=512, max_model_len=600)
        result = await self.engine.generate(prompt_ids, settings)
        return TokenOutput(token_ids=result.token_ids, log_probs=result.log_probs, stop_reason="completed",
                           extra_fields={"global_steps": 1})


async def test_each_role_reaches_its_policys_model(tmp_path: Path) -> None:
    """Two tiny models of different sizes behind the router: every request of a role reaches its model,
    and the returned log-probs are that model's (they would not match the other model's)."""
    import torch
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from verl_mas.agent_loop import MasAgentLoop
    from verl_mas.backends.hf.engine import HFGenerationEngine
    from verl_mas.tiny import write_tiny

    small = write_tiny(tmp_path / "small", hidden_size=32, num_hidden_layers=1, seed=1)
    large = write_tiny(tmp_path / "large", hidden_size=64, num_hidden_layers=2, seed=2)
    engines = {"p": HFGenerationEngine.from_pretrained(str(small), seed=0),
               "m": HFGenerationEngine.from_pretrained(str(large), seed=0)}
    clients = {name: _RecordingClient(engine) for name, engine in engines.items()}
    router = PolicyRouterClient(clients)
    mas = {"branching": 2, "max_turns": 2, "policies": {"p": {}, "m": {}},
           "roles": {"planner": {"policy": "p"}, "mover": {"policy": "m"}}}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 4, "prompt_length": 512}},
                               "data": {"apply_chat_template_kwargs": {}}, "mas": mas,
                               "trainer": {"v1": {"trainer_mode": "mas"}}})
    loop = MasAgentLoop(trainer_config=DictConfigWrap(config), server_manager=router,
                        tokenizer=AutoTokenizer.from_pretrained(small), processor=None, dataset_cls=None,
                        data_config=DictConfigWrap(config.data))
    row = {"uid": "t", "session_id": 0, "index": 0,
           "extra_info": {"workflow": "toy-walk-v0", "task": json.dumps({"start": 0, "goal": 5}), "split": "train"}}
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    outputs = await loop.run(sampling, **row)
    # goal 5 is out of reach in 2 turns: 2 turns x K=2 requests per role, each to its own policy's model.
    assert len(clients["p"].prompts) == 4 and len(clients["m"].prompts) == 4
    by_role = {role: [o for o in outputs if o.extra_fields["mas_role"] == role] for role in ("planner", "mover")}
    assert {o.extra_fields["mas_policy"] for o in by_role["planner"]} == {"p"}
    assert {o.extra_fields["mas_policy"] for o in by_role["mover"]} == {"m"}
    assert sorted(map(tuple, clients["p"].prompts)) == sorted(tuple(o.prompt_ids) for o in by_role["planner"])
    # The log-probs of a mover sample are the large model's, not the small one's.
    out = by_role["mover"][0]
    ids = torch.tensor([out.prompt_ids + out.response_ids])
    n = len(out.prompt_ids)

    def logprobs(engine) -> torch.Tensor:
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0]
        return torch.log_softmax(logits[n - 1: n - 1 + len(out.response_ids)], -1).gather(
            1, torch.tensor(out.response_ids)[:, None])[:, 0]

    got = torch.tensor(out.response_logprobs)
    assert torch.allclose(got, logprobs(engines["m"]), atol=1e-5)
    assert not torch.allclose(got, logprobs(engines["p"]), atol=1e-2)  # negative control: the other model
    with pytest.raises(KeyError, match="asked for policy 'nope'"):
        await router.generate("r", prompt_ids=[1], sampling_params=sampling, policy="nope")
    assert np.isfinite(got.numpy()).all()


def _rows_not_in_their_policys_text(outputs, tokenizers) -> list[str]:
    """Rows whose prompt, decoded with their policy's tokenizer, is not their role's prompt text
    (relay-v0: "caller <word>", "runner <word>"), or whose ids are outside that tokenizer."""
    wrong = []
    for o in outputs:
        tok, role = tokenizers[o.extra_fields["mas_policy"]], o.extra_fields["mas_role"]
        ids = list(o.prompt_ids) + list(o.response_ids)
        if max(ids) >= len(tok) or f"{role} " not in tok.decode(o.prompt_ids, skip_special_tokens=True):
            wrong.append(f"{role} turn {o.extra_fields['mas_turn']}")
    return wrong


async def test_roles_served_by_models_with_different_vocabularies_render_and_decode_with_their_own(
        tmp_path: Path) -> None:
    """A team of two model families (the caller: a word-level vocabulary; the runner: byte-level BPE) in one
    episode: each role's prompts are rendered with its own policy's tokenizer and its rows hold its own
    model's token ids. Control: the same episode with every role on the caller's tokenizer (a role routed
    to the wrong tokenizer) is flagged by the same check."""
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from verl_mas.agent_loop import MasAgentLoop
    from verl_mas.backends.hf.engine import HFGenerationEngine
    from verl_mas.tiny import write_tiny
    from verl_mas.workflows.relay import RelayWorkflow

    words = write_tiny(tmp_path / "words", vocab=list(RelayWorkflow.vocabulary), seed=1)
    bpe = write_tiny(tmp_path / "bpe", hidden_size=32, num_hidden_layers=1, seed=2)
    tokenizers = {"caller": AutoTokenizer.from_pretrained(words), "runner": AutoTokenizer.from_pretrained(bpe)}
    assert len(tokenizers["caller"]) < len(tokenizers["runner"])
    clients = {"caller": _RecordingClient(HFGenerationEngine.from_pretrained(str(words), seed=0)),
               "runner": _RecordingClient(HFGenerationEngine.from_pretrained(str(bpe), seed=0))}
    mas = {"branching": 2, "max_turns": 2, "policies": {"caller": {}, "runner": {"model": {"path": str(bpe)}}},
           "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}}}
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(words)},
                                                     "rollout": {"response_length": 4, "prompt_length": 512}},
                               "data": {"apply_chat_template_kwargs": {}}, "mas": mas,
                               "trainer": {"v1": {"trainer_mode": "mas"}}})
    loop = MasAgentLoop(trainer_config=DictConfigWrap(config), server_manager=PolicyRouterClient(clients),
                        tokenizer=tokenizers["caller"], processor=None, dataset_cls=None,
                        data_config=DictConfigWrap(config.data))
    row = {"uid": "t", "session_id": 0, "index": 0,
           "extra_info": {"workflow": "relay-v0", "task": json.dumps({"message": ["red", "blue"]}), "split": "train"}}
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    outputs = await loop.run(sampling, **row)
    runner_rows = [o for o in outputs if o.extra_fields["mas_role"] == "runner"]
    assert runner_rows and len(outputs) > len(runner_rows)
    assert _rows_not_in_their_policys_text(outputs, tokenizers) == []
    # The runner's rows are BPE ids: some lie beyond the word-level vocabulary (the caller's model could not
    # embed them), and its server received exactly those prompts.
    assert max(max(o.prompt_ids) for o in runner_rows) >= len(tokenizers["caller"])
    assert sorted(map(tuple, clients["runner"].prompts)) == sorted(tuple(o.prompt_ids) for o in runner_rows)

    loop.role_tokenizers = tokenizers["caller"]  # miswired: the runner's prompts rendered with the caller's tokenizer
    miswired = await loop.run(sampling, **row)
    assert _rows_not_in_their_policys_text(miswired, tokenizers) == [
        f"runner turn {o.extra_fields['mas_turn']}" for o in miswired if o.extra_fields["mas_role"] == "runner"]


def test_a_policy_whose_tokenizer_is_not_its_models_is_refused(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from verl_mas.routing import tokenizer_fit_problems
    from verl_mas.tiny import write_tiny

    tok = AutoTokenizer.from_pretrained(write_tiny(tmp_path / "bpe", hidden_size=32, num_hidden_layers=1))
    n = len(tok)
    assert tokenizer_fit_problems({"caller": tok, "runner": tok}, {"caller": n, "runner": n + 8}, padding=tok) == []
    # The runner's tokenizer has more tokens than its model's embedding rows: it is another model's tokenizer.
    assert tokenizer_fit_problems({"caller": tok, "runner": tok}, {"caller": n, "runner": 40}, padding=tok) == [
        f"policy 'runner': its tokenizer has {n} tokens but its model only 40 embedding rows, so the tokenizer is not "
        "the model's. Point the policy's model.tokenizer_path (or model.path) at the model's own tokenizer."]
    # verl pads the whole batch with the first policy's pad id: here one the caller's model cannot embed.
    problems = tokenizer_fit_problems({"caller": tok, "runner": tok}, {"caller": n, "runner": n + 8},
                                      padding=SimpleNamespace(pad_token_id=n + 2))
    assert len(problems) == 1 and problems[0].startswith(f"policy 'caller': verl pads every row of the batch with the "
                                                         f"first policy's pad token id {n + 2}, which is outside")


def _cpu_recipe(tmp_path: Path, *overrides: str):
    """verl's full config as main_ppo composes it for the CPU recipe (relay-v0 data in tmp_path)."""
    from hydra import compose, initialize_config_dir

    from verl_mas.data import write_dataset

    write_dataset("relay-v0", tmp_path, train=4, test=2, seed=0)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "at_grpo_cpu"
    with initialize_config_dir(config_dir=str(recipe), version_base=None):
        return compose(config_name="at_grpo_cpu", overrides=[
            "actor_rollout_ref.model.path=/models/tiny", f"data.train_files={tmp_path / 'train.parquet'}",
            f"data.val_files={tmp_path / 'test.parquet'}", *overrides])


def test_start_up_reports_every_problem_in_one_error(tmp_path: Path) -> None:
    from verl_mas.startup import check_run_config

    # A bad route, an unused policy, a misspelled nested override, an unrouted role (relay-v0's runner),
    # a NaN alpha and a rollout setting one process reads for all policies: one error names them all.
    # Policies and routes listed by hand (the caller's only): a route for a role relay-v0 does not have, too.
    cfg = _cpu_recipe(tmp_path, "~mas.policies.default", "+mas.policies.caller={}", "+mas.policies.runner={}",
                      "+mas.roles.caller.policy=caller",
                      "+mas.roles.judge.policy=nobody", "+mas.policies.spare={}",
                      "+mas.policies.runner.actor.optim.lrr=1e-3", "mas.alpha=nan",
                      "+mas.policies.runner.rollout.response_length=7")
    with pytest.raises(MasConfigError) as err:
        check_run_config(cfg)
    message = str(err.value)
    for expected in (
        "mas.roles.judge.policy is 'nobody'",
        "mas.policies ['runner', 'spare'] serve no role",  # the runner's role has no route
        "mas.policies.runner.actor.optim.lrr: actor_rollout_ref.actor.optim.lrr does not exist",
        "workflow 'relay-v0' has roles ['runner'] that no policy serves",
        "mas.alpha is nan",
        "mas.policies.runner.rollout.response_length is 7 but the first policy's is 3",
        "mas.roles names roles ['judge'] that no workflow of the data has (their roles: {'relay-v0': ['caller', "
        "'runner']})",
    ):
        assert expected in message, (expected, message)
    assert message.startswith("verl_mas cannot start: 7 problem(s)")
    # Control: the shipped per-role recipe passes.
    mas, configs = check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models"))
    assert list(configs) == mas.policy_names == ["caller", "runner"]


def test_several_trainable_policies_need_a_policy_aware_rollout_backend(tmp_path: Path) -> None:
    from verl_mas.startup import check_run_config

    # SGLang's hybrid servers are named and weight-synced by replica rank only: two policies would collide.
    cfg = _cpu_recipe(tmp_path, "mas_policies=per_role_models", "actor_rollout_ref.rollout.name=sglang")
    with pytest.raises(MasConfigError, match=r"several trainable policies \(\['caller', 'runner'\]\) with "
                                             r"actor_rollout_ref.rollout.name='sglang'"):
        check_run_config(cfg)
    check_run_config(_cpu_recipe(tmp_path, "actor_rollout_ref.rollout.name=sglang"))  # one shared policy: fine
    # vLLM and hf are policy-aware (verl_mas.backends.vllm, verl_mas.backends.hf).
    for backend in ("vllm", "hf"):
        mas, _ = check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models",
                                              f"actor_rollout_ref.rollout.name={backend}"))
        assert mas.multi_policy
    # verl's prefill/decode replicas (vLLM's too) name their servers without the policy: refused with several.
    split = "actor_rollout_ref.rollout.disaggregation.enabled=true"
    with pytest.raises(MasConfigError, match=r"rollout.disaggregation.enabled=true \(on \['caller', 'runner'\]\)"):
        check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models", "actor_rollout_ref.rollout.name=vllm",
                                     split))
    check_run_config(_cpu_recipe(tmp_path, "actor_rollout_ref.rollout.name=vllm", split))  # one shared policy: fine


def test_policies_whose_vllm_engines_share_a_gpu_must_fit_its_memory_together(tmp_path: Path, monkeypatch) -> None:
    from verl_mas.startup import check_run_config

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    gpu = ("trainer.device=cuda", "actor_rollout_ref.rollout.name=vllm")
    # Two policies on verl's pool, each a vLLM engine reserving 0.6 of every GPU (the GPU recipes' setting): refused.
    with pytest.raises(MasConfigError, match=r"policies \['caller', 'runner'\] share verl's resource pool.*"
                                             r"\{'caller': 0.6, 'runner': 0.6\} sum to 1.20.*"
                                             r"actor_rollout_ref.rollout.gpu_memory_utilization=0.45"):
        check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models", *gpu,
                                     "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"))
    # One policy's own share lowered so that the two fit: fine.
    check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models", *gpu,
                                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
                                 "+mas.policies.runner.rollout.gpu_memory_utilization=0.3"))
    # Controls, each at 0.6: the runner on a pool of its own; adapters on one shared base (one engine serves them
    # all); the CPU platform (vLLM's CPU build sizes its KV cache in bytes); one shared policy.
    for layout in (("mas_policies=per_role_models", "+mas.policies.runner.resources={n_gpus_per_node: 1}"),
                   ("mas_policies=per_role_lora",), ("mas_policies=per_role_models", "trainer.device=cpu"), ()):
        check_run_config(_cpu_recipe(tmp_path, *gpu, "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", *layout))


def test_per_policy_settings_reach_the_policys_trainer_view_and_sampling(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from verl_mas.agent_loop import MasAgentLoop
    from verl_mas.startup import check_run_config
    from verl_mas.policies.stacks import PolicyStack
    from verl_mas.trainer import MasTrainer

    cfg = _cpu_recipe(tmp_path, "mas_policies=per_role_models", "+mas.policies.runner.actor.ppo_epochs=3",
                      "+mas.policies.runner.actor.ppo_mini_batch_size=4", "+mas.policies.runner.rollout.temperature=0.5",
                      "+mas.policies.runner.rollout.val_kwargs.temperature=0.25")
    mas, configs = check_run_config(cfg)
    # The trainer's per-policy view (what verl's _update_actor / _compute_old_log_prob read) carries the
    # policy's own settings; the first policy keeps the recipe's.
    trainer = MasTrainer.__new__(MasTrainer)
    trainer.config, trainer.mas, trainer._policy_configs = cfg, mas, configs
    runner = trainer._view(PolicyStack("runner", None, None, False, None, None))
    caller = trainer._view(PolicyStack("caller", None, None, False, None, None))
    assert (runner.config.actor_rollout_ref.actor.ppo_epochs, runner.config.actor_rollout_ref.actor.ppo_mini_batch_size,
            runner.config.actor_rollout_ref.rollout.temperature) == (3, 4, 0.5)
    assert (caller.config.actor_rollout_ref.actor.ppo_epochs, caller.config.actor_rollout_ref.actor.ppo_mini_batch_size,
            caller.config.actor_rollout_ref.rollout.temperature) == (1, 2, 1.0)  # the recipe's
    # The agent loop samples each role at its policy's temperature (training) or val_kwargs (validation).
    loop = MasAgentLoop.__new__(MasAgentLoop)
    loop.config, loop.mas_config = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), mas
    loop.policy_configs = policy_configs(loop.config.actor_rollout_ref, mas)  # what __init__ computes
    assert loop._policy_sampling(validate=False)["runner"]["temperature"] == 0.5
    assert loop._policy_sampling(validate=False)["caller"]["temperature"] == 1.0
    assert loop._policy_sampling(validate=True)["runner"]["temperature"] == 0.25


@pytest.mark.slow
def test_candidates_route_by_session_through_verls_load_balancer_with_ids_of_their_own() -> None:
    """verl's real client and load balancer (Ray actors) under rollout.full_determinism, four servers."""
    import asyncio

    import ray
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    from verl_mas.routing import SessionRoutedClient, candidate_request_id, routing_key

    @ray.remote
    class Server:
        def __init__(self, name: str) -> None:
            self.name, self.ids = name, []

        def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs):
            from verl.workers.rollout.replica import TokenOutput

            self.ids.append(request_id)
            return TokenOutput(token_ids=[1], log_probs=[0.0], stop_reason="completed", extra_fields={"global_steps": 0})

        def take(self) -> tuple[str, list[str]]:
            """The ids served since the last call."""
            ids, self.ids = self.ids, []
            return self.name, ids

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"full_determinism": True, "name": "hf"}}})
        # One set of servers for both clients (each actor is a process that imports verl: ~10 s of CPU); a
        # balancer of its own for each, so that no session is pinned by the other client's requests.
        servers = {f"s{i}": Server.remote(f"s{i}") for i in range(4)}

        def served(client_cls) -> dict[str, set[str]]:
            balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers=servers, full_determinism=True)
            client = client_cls(config=config, load_balancer_handle=balancer)
            ids = [candidate_request_id(f"task{t}|role|7", turn, k) for t in range(2) for turn in range(3)
                   for k in range(4)]

            async def all_requests():
                await asyncio.gather(*(client.generate(i, prompt_ids=[5], sampling_params={}) for i in ids))

            asyncio.run(all_requests())
            taken = ray.get([s.take.remote() for s in servers.values()])
            assert sorted(i for _, got in taken for i in got) == sorted(ids)
            out: dict[str, set[str]] = {}
            for name, got in taken:
                for request_id in got:
                    out.setdefault(routing_key(request_id), set()).add(name)
            return out

        # Every candidate and turn of a session reaches one server; each request reached it with its own id.
        assert all(len(names) == 1 for names in served(SessionRoutedClient).values())
        # Negative control: verl's stock client routes on the whole id, scattering one session's candidates.
        assert any(len(names) > 1 for names in served(LLMServerClient).values())
    finally:
        ray.shutdown()


def _lora_arr(**rollout: object) -> object:
    return OmegaConf.create({
        "model": {"path": "/models/base", "lora_rank": 0, "lora_alpha": 16, "lora": {"merge": False},
                  "lora_adapter_path": None, "use_remove_padding": True},
        "actor": {"optim": {"lr": 1e-6, "weight_decay": 0.01}, "clip_ratio": 0.2, "ppo_epochs": 1, "strategy": "fsdp2"},
        "rollout": {"name": "hf", "custom": None, "temperature": 1.0,
                    "checkpoint_engine": {"backend": "naive"}, **rollout},
        "ref": {},
    })


def _lora_mas(**extra: object) -> MasConfig:
    runner = {"model": {"lora_rank": 4, "lora_alpha": 8}, "actor": {"optim": {"lr": 2e-3}}}
    for block, values in extra.pop("runner", {}).items():
        runner[block] = {**runner.get(block, {}), **values}
    return MasConfig.from_mapping({
        "policies": {"caller": {"model": {"lora_rank": 8}}, "runner": runner},
        "roles": {"caller": {"policy": "caller"}, "runner": {"policy": "runner"}}, **extra,
    })


def test_lora_policies_on_one_base_share_it_with_an_adapter_each() -> None:
    from verl_mas.policies.adapters import shared_base_plan

    mas = _lora_mas()
    assert mas.lora_base == "shared"
    plan, problems = shared_base_plan(mas, policy_configs(_lora_arr(), mas))
    assert problems == []
    # Ranks may differ per role; each adapter carries its own optimiser overrides (first policy first).
    assert plan == {"caller": {"rank": 8, "alpha": 16, "optim": {}},
                    "runner": {"rank": 4, "alpha": 8, "optim": {"lr": 2e-3}}}
    assert list(plan) == ["caller", "runner"]
    # A key only the first policy overrides: the others keep the recipe's value, not the first's.
    first_only = MasConfig.from_mapping({**TWO, "policies": {
        "caller": {"model": {"lora_rank": 8}, "actor": {"optim": {"lr": 1e-2}}}, "runner": {"model": {"lora_rank": 8}}}})
    plan = shared_base_plan(first_only, policy_configs(_lora_arr(), first_only))[0]
    assert plan["caller"]["optim"] == {} and plan["runner"]["optim"] == {"lr": 1e-6}
    # Not shared: mas.lora_base=per_policy, full models, a LoRA policy next to a full model, one policy.
    per_policy = _lora_mas(lora_base="per_policy")
    assert shared_base_plan(per_policy, policy_configs(_lora_arr(), per_policy)) == (None, [])
    mixed = MasConfig.from_mapping({**TWO, "policies": {"caller": {}, "runner": {"model": {"lora_rank": 8}}}})
    assert shared_base_plan(mixed, policy_configs(_lora_arr(), mixed)) == (None, [])
    one = MasConfig.from_mapping({"policies": {"default": {"model": {"lora_rank": 8}}}})
    assert shared_base_plan(one, policy_configs(_lora_arr(), one)) == (None, [])
    with pytest.raises(MasConfigError, match="mas.lora_base is 'both'"):
        _lora_mas(lora_base="both")


def test_a_shared_base_refuses_what_one_worker_group_cannot_do_per_adapter() -> None:
    from verl_mas.policies.adapters import shared_base_plan

    mas = _lora_mas(runner={"model": {"path": "/models/other", "lora": {"merge": True}},
                            "actor": {"clip_ratio": 0.3, "ppo_epochs": 2}})
    arr = _lora_arr(name="sglang", checkpoint_engine={"backend": "nccl"})
    arr.actor.strategy = "fsdp"
    plan, problems = shared_base_plan(mas, policy_configs(arr, mas))
    text = "\n".join(problems)
    assert "mas.policies.runner.actor.clip_ratio is 0.3 but caller's is 0.2" in text  # a loss setting: shared
    assert "mas.policies.runner.actor.ppo_epochs" not in text  # sent with each policy's update: allowed
    assert "mas.policies.runner.model.path is '/models/other'" in text
    assert "rollout.name=sglang" in text and "checkpoint_engine.backend=nccl" in text
    assert "actor.strategy=fsdp: a shared base gives each adapter an optimiser" in text
    assert all("mas.lora_base=per_policy" in p for p in problems if "peft names" not in p)
    # The same key set to the same value everywhere is fine: the worker group reads one value.
    same = _lora_mas(runner={"actor": {"clip_ratio": 0.2}})
    assert shared_base_plan(same, policy_configs(_lora_arr(), same))[1] == []
    assert "mas.policies.runner.model.lora.merge is True but caller's is False" in text
    first_merged = MasConfig.from_mapping({**TWO, "policies": {"caller": {"model": {"lora_rank": 8}},
                                                                "runner": {"model": {"lora_rank": 8}}}})
    arr = _lora_arr()
    arr.model.lora.merge = True
    problems = shared_base_plan(first_merged, policy_configs(arr, first_merged))[1]
    assert any(p.startswith("actor_rollout_ref.model.lora.merge=true merges one adapter") for p in problems)


def test_each_adapter_of_a_shared_base_gets_the_rank_and_alpha_verls_fsdp_engine_reads(tmp_path: Path) -> None:
    from verl_mas.policies.adapters import adapter_plan
    from verl_mas.startup import check_run_config

    # verl's config holds the Megatron engine's LoRA block (model.lora: rank 0, alpha 32) next to the keys verl's
    # FSDP engine builds an adapter from (model.lora_rank, model.lora_alpha). The recipe group gives the caller
    # rank 8 / alpha 16 (verl builds its adapter from them); the runner sets rank 2 / alpha 4, which must reach
    # its adapter, not the Megatron block's alpha 32.
    _, configs = check_run_config(_cpu_recipe(
        tmp_path, "mas_policies=per_role_lora", "+mas.policies.runner.model.lora_rank=2",
        "+mas.policies.runner.model.lora_alpha=4", "+mas.policies.runner.actor.optim.clip_grad=0.5"))
    plan = adapter_plan(configs)
    assert configs["caller"].model.lora.alpha == 32  # the block is there, and is not what the adapters use
    assert {p: (spec["rank"], spec["alpha"]) for p, spec in plan.items()} == {"caller": (8, 16), "runner": (2, 4)}
    # The runner's optimiser keys travel with its adapter (its clip_grad reaches verl's optimizer_step when the
    # runner is active: tests/test_shared_lora_cpu.py); both policies set lr 1e-2, so only clip_grad differs.
    assert plan["runner"]["optim"] == {"clip_grad": 0.5} and plan["caller"]["optim"] == {}


@pytest.mark.parametrize(("override", "why", "instead"), [
    ("+mas.policies.runner.model.lora.rank=2", "verl's FSDP engine builds each adapter from model.lora_rank",
     "+mas.policies.runner.model.lora_rank=2"),
    ("+mas.policies.runner.model.lora.alpha=4", "verl's FSDP engine builds each adapter from model.lora_alpha",
     "+mas.policies.runner.model.lora_alpha=4"),
    ("+mas.policies.runner.actor.optim.total_training_steps=10", "is set by verl's trainer at run time",
     "trainer.total_training_steps=10"),
    ("+mas.policies.runner.actor.optim._target_=verl.workers.config.optimizer.FSDPOptimizerConfig",
     "names the optimiser config class of the one worker group", "+mas.policies.runner.actor.optim.optimizer=Adam"),
    ("+mas.policies.runner.actor.optim._target_=verl.workers.config.optimizer.FSDPOptimizerConfig",
     "set mas.lora_base=per_policy", "mas.lora_base=per_policy"),
])
def test_a_shared_base_refuses_an_adapter_key_that_nothing_applies_per_adapter(tmp_path: Path, override: str,
                                                                               why: str, instead: str) -> None:
    from verl_mas.startup import check_run_config

    key = override.split("=")[0].lstrip("+")
    with pytest.raises(MasConfigError) as err:
        check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_lora", override))
    message = str(err.value)
    assert message.startswith("verl_mas cannot start: 1 problem(s)"), message
    assert f"{key} is " in message and "nothing applies it per adapter" in message and why in message, message
    # Control: what the message says to do instead starts.
    check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_lora", instead))


def test_a_recipe_lora_rank_in_the_megatron_block_is_refused_on_a_shared_base(tmp_path: Path) -> None:
    from verl_mas.startup import check_run_config

    # model.lora.rank=8 with model.lora_rank=0 on every policy: verl's FSDP engine would build no adapter at all.
    cfg = _cpu_recipe(tmp_path, "mas_policies=per_role_lora", "actor_rollout_ref.model.lora.rank=8",
                      "+mas.policies.caller.model.lora_rank=0", "+mas.policies.runner.model.lora_rank=0")
    with pytest.raises(MasConfigError, match=r"actor_rollout_ref.model.lora.rank=8 but model.lora_rank=0: .* Set "
                                             r"model.lora_rank=8"):
        check_run_config(cfg)


def test_a_shared_bases_first_sync_names_the_base_as_verls_sync_does() -> None:
    import types

    import torch

    from verl_mas.policies.lora_worker import base_tensors

    # A peft state dict: q_proj with an adapter, a MoE layer of 2 experts packed as transformers 5 stores them
    # (gate_up: (experts, 2 x intermediate 2, hidden 3), down: (experts, hidden 3, intermediate 2)), the LM head.
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    down = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    q, head = torch.ones(3, 3), torch.zeros(5, 3)
    state = {
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": q,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(1, 3),
        "base_model.model.model.layers.0.mlp.experts.gate_up_proj": gate_up,
        "base_model.model.model.layers.0.mlp.experts.down_proj": down,
        "base_model.model.lm_head.weight": head,
    }
    # The model declares a checkpoint key mapping (checkpoint "transformer.h" -> module "model.layers"); verl's
    # convert_weight_keys reverses it, then unfuse_moe_params splits the experts (gate = first half of gate_up).
    mapped = types.SimpleNamespace(_checkpoint_conversion_mapping={"^transformer.h": "model.layers"})
    got = dict(base_tensors(state, mapped, "qwen3_moe"))
    expected = {
        "transformer.h.0.self_attn.q_proj.weight": q,
        **{f"transformer.h.0.mlp.experts.{e}.gate_proj.weight": gate_up[e, :2] for e in (0, 1)},
        **{f"transformer.h.0.mlp.experts.{e}.up_proj.weight": gate_up[e, 2:] for e in (0, 1)},
        **{f"transformer.h.0.mlp.experts.{e}.down_proj.weight": down[e] for e in (0, 1)},
        "lm_head.weight": head,
    }
    assert sorted(got) == sorted(expected)  # the adapter's tensor is not part of the base
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    # Controls: without a mapping the module's names stay; GPT-OSS keeps its experts packed (verl's rule).
    plain = dict(base_tensors(state, types.SimpleNamespace(), "gpt_oss"))
    assert sorted(plain) == ["lm_head.weight", "model.layers.0.mlp.experts.down_proj",
                             "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"]


async def _route(client: PolicyRouterClient, policy: str) -> dict:
    return await client.generate("s#1.0", policy=policy, prompt_ids=[1], sampling_params={})


def test_a_shared_base_client_names_each_policys_adapter() -> None:
    import asyncio

    class Recorder:
        config = None
        calls: list = []

        async def generate(self, request_id: str, **kwargs: object) -> dict:
            self.calls.append(kwargs.get("adapter"))
            return kwargs

    one = Recorder()
    client = PolicyRouterClient({"caller": one, "runner": one}, adapters={"caller": "caller", "runner": "runner"})
    assert asyncio.run(_route(client, "runner"))["adapter"] == "runner"
    assert asyncio.run(_route(client, "caller"))["adapter"] == "caller"
    plain = PolicyRouterClient({"caller": Recorder(), "runner": Recorder()})  # a stack per policy: no adapter
    assert "adapter" not in asyncio.run(_route(plain, "runner"))
    assert one.calls[:2] == ["runner", "caller"]


def test_dropping_rows_is_refused_where_dropped_rows_have_a_gradient(tmp_path: Path) -> None:
    from verl_mas.startup import check_run_config

    # A dropped row has advantage 0 but a KL-loss and an entropy term: per policy, the runner's KL loss and the
    # caller's entropy bonus are named, with the fix; the KL penalty in the reward once for the run.
    cfg = _cpu_recipe(tmp_path, "mas_policies=per_role_models", "mas.drop_zero_variance=true",
                      "+mas.policies.runner.actor.use_kl_loss=true", "+mas.policies.caller.actor.entropy_coeff=0.01",
                      "algorithm.use_kl_in_reward=true")
    with pytest.raises(MasConfigError) as err:
        check_run_config(cfg)
    message = str(err.value)
    assert message.startswith("verl_mas cannot start: 3 problem(s)"), message
    assert "policy 'caller': mas.drop_zero_variance" in message and "actor.entropy_coeff=0.01" in message
    assert "policy 'runner': mas.drop_zero_variance" in message and "actor.use_kl_loss=true" in message
    assert "algorithm.use_kl_in_reward=true" in message and "Set mas.drop_zero_variance=false" in message
    # One shared policy with a KL loss: refused as well; the same settings without the drop start.
    with pytest.raises(MasConfigError, match="policy 'default': mas.drop_zero_variance"):
        check_run_config(_cpu_recipe(tmp_path, "actor_rollout_ref.actor.use_kl_loss=true"))
    check_run_config(_cpu_recipe(tmp_path, "actor_rollout_ref.actor.use_kl_loss=true", "mas.drop_zero_variance=false"))
    check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models", "mas.drop_zero_variance=false",
                                 "+mas.policies.runner.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"))


def test_every_layout_resolves_the_datas_workflows_at_start_up(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_mas.data import make_rows
    from verl_mas.startup import check_run_config

    check_run_config(_cpu_recipe(tmp_path))  # control: relay-v0 resolves
    # One shared policy (the layout that never resolved the data's workflows) and one model per role: the
    # validation file names a workflow registered only in a module no worker imports.
    for layout in ((), ("mas_policies=per_role_models",)):
        cfg = _cpu_recipe(tmp_path, *layout)  # (writes relay-v0 data)
        pq.write_table(pa.Table.from_pylist(make_rows("mine-v0", "test", ['{"x":1}'])), tmp_path / "test.parquet")
        with pytest.raises(MasConfigError) as err:
            check_run_config(cfg)
        message = str(err.value)
        assert "the data names workflow 'mine-v0', which this process cannot resolve (unknown workflow id" in message
        assert "entry-point group" in message and "'package.module:Class'" in message


def test_the_data_names_a_workflow_the_way_any_process_resolves_it(tmp_path: Path) -> None:
    from verl_mas.registry import portable_spec
    from verl_mas.workflows.relay import RelayWorkflow
    from verl_mas.workflows.toy import WalkWorkflow as ToyWalkWorkflow

    assert portable_spec(RelayWorkflow) == "relay-v0"  # built in: its id resolves everywhere

    class Local(ToyWalkWorkflow):  # no other process can import it: it keeps its name, and start-up refuses it
        workflow_id = "local-walk-v0"

    assert portable_spec(Local) == "local-walk-v0"
    # A class of an importable module that is not built in (a user's package): its module path.
    from verl_mas.testing import conformance

    fake = type("UserFlow", (ToyWalkWorkflow,), {"__module__": conformance.__name__, "workflow_id": "user-flow-v0"})
    assert portable_spec(fake) == "verl_mas.testing.conformance:UserFlow"


@pytest.mark.slow
def test_main_ppo_stops_before_ray_when_the_data_names_an_unknown_workflow(tmp_path: Path, tiny_model_dir: Path) -> None:
    import os
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_mas.data import make_rows

    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(make_rows("mine-v0", split, ['{"x":1}'])), tmp_path / f"{split}.parquet")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "at_grpo_cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "RAY_ADDRESS"))}
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(recipe), "--config-name", "at_grpo_cpu",
         f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
         f"data.val_files={tmp_path / 'test.parquet'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, env={**env, "VERL_PLATFORM": "cpu"}, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "the data names workflow 'mine-v0', which this process cannot resolve" in out, out[-3000:]
    # Hydra's callback raised in main_ppo's own process: verl never initialised Ray.
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out


def test_per_role_layouts_give_every_role_of_any_workflow_its_own_policy(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_mas import Workflow, register_workflow
    from verl_mas.data import make_rows
    from verl_mas.startup import check_run_config

    @register_workflow("trio-test-v0")
    class Trio(Workflow):  # three roles acting in sequence (resolvable in this process only)
        roles = ("proposer", "critic", "reviser")

        async def run(self, task):
            for role in self.roles:
                (await self.generate(role, [{"role": "user", "content": role}])).best()

    # relay-v0 (the recipe's data): caller and runner, in the workflow's role order, each routed to itself.
    mas, configs = check_run_config(_cpu_recipe(tmp_path, "mas_policies=per_role_models"))
    assert list(configs) == mas.policy_names == ["caller", "runner"]
    assert {r: s["policy"] for r, s in mas.roles.items()} == {"caller": "caller", "runner": "runner"}
    # The same group file for a three-role workflow; a role's own override merges over the expansion.
    for layout, extra in (("per_role_models", ("+mas.policies.critic.actor.optim.lr=5e-4",)),
                          ("per_role_lora", ())):
        cfg = _cpu_recipe(tmp_path, f"mas_policies={layout}", *extra)
        for split in ("train", "test"):
            pq.write_table(pa.Table.from_pylist(make_rows("trio-test-v0", split, ['{"x":1}'])),
                           tmp_path / f"{split}.parquet")
        mas, configs = check_run_config(cfg)
        assert mas.policy_names == ["proposer", "critic", "reviser"], layout
        assert {r: s["policy"] for r, s in mas.roles.items()} == {r: r for r in Trio.roles}
        assert "per_role" not in cfg.mas  # expanded in place: the agent loops read policies and roles
        if layout == "per_role_lora":
            assert {p: c.model.lora_rank for p, c in configs.items()} == {r: 8 for r in Trio.roles}
        else:
            assert [configs[p].actor.optim.lr for p in mas.policy_names] == [3e-3, 5e-4, 3e-3]
    # A role name that cannot name a policy: what, why, fix.
    with pytest.raises(MasConfigError, match=r"mas.per_role must be|roles \['tool_user'\] are not policy names"):
        @register_workflow("snake-test-v0")
        class Snake(Trio):
            roles = ("tool_user",)

        cfg = _cpu_recipe(tmp_path, "mas_policies=per_role_models")
        for split in ("train", "test"):
            pq.write_table(pa.Table.from_pylist(make_rows("snake-test-v0", split, ['{"x":1}'])),
                           tmp_path / f"{split}.parquet")
        check_run_config(cfg)


def test_start_up_names_vocabulary_words_a_policys_tokenizer_loses(tmp_path: Path) -> None:
    from verl_mas.startup import check_run_config
    from verl_mas.tiny import write_tiny
    from verl_mas.workflows.relay import RelayWorkflow

    # The caller's model has relay-v0's tailored tokenizer (control: nothing lost); the runner's lacks "nothing"
    # and "navy", which relay prompts and replies use.
    good = write_tiny(tmp_path / "good", vocab=list(RelayWorkflow.vocabulary))
    short = write_tiny(tmp_path / "short", vocab=[w for w in RelayWorkflow.vocabulary if w not in ("nothing", "navy")])
    check_run_config(_cpu_recipe(tmp_path, f"actor_rollout_ref.model.path={good}"))
    cfg = _cpu_recipe(tmp_path, f"actor_rollout_ref.model.path={good}", "mas_policies=per_role_models",
                      f"+mas.policies.runner.model.path={short}")
    with pytest.raises(MasConfigError) as err:
        check_run_config(cfg)
    message = str(err.value)
    assert message.startswith("verl_mas cannot start: 1 problem(s)") and "policy 'runner': its tokenizer" in message
    assert "loses words of the vocabulary of workflow 'relay-v0' ('navy' becomes 'nay'" in message and "'nothing' becomes" in message
    assert "--vocab-from relay-v0" in message
