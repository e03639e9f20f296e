"""The hf CPU rollout backend: token-in/token-out, correct log-probs, weight sync, concurrent requests."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from verl_mas.backends.hf.engine import HFGenerationEngine, SamplingSettings, settings_from_verl

PROMPTS = [
    [1, 20, 30, 40, 50],
    [1, 99, 98, 97],
    [1, 5, 6, 7, 8, 9, 10, 11],
    [1, 300],
    [1, 42, 42, 42, 42],
    [1, 7, 77, 177, 277, 377],
    [1, 400, 401],
    [1, 123, 234, 345, 456, 56, 67],
]


def test_the_backend_names_import_without_torch_transformers_or_ray() -> None:
    """verl_mas._plugin imports the package in every process: only a process that runs the backend pays for it."""
    heavy = "('torch', 'transformers', 'ray', 'verl')"
    code = f"import sys, verl_mas.backends.hf\nprint([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_registered_paths_resolve_to_the_backend_classes() -> None:
    from verl.workers.rollout.base import BaseRollout
    from verl.workers.rollout.replica import RolloutReplica

    from verl_mas.backends import hf

    module, _, name = hf.ADAPTER_PATH.rpartition(".")
    adapter = getattr(importlib.import_module(module), name)
    assert adapter.__name__ == "HFServerAdapter" and issubclass(adapter, BaseRollout)
    replica = hf.load_replica_class()
    assert replica.__name__ == "HFReplica" and issubclass(replica, RolloutReplica)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFGenerationEngine:
    return HFGenerationEngine.from_pretrained(str(tiny_model_dir), seed=0)


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Log-probs of ``response`` given ``prompt`` from ONE full forward pass (no KV cache), as verl's actor does."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    # Position p predicts token p + 1: the response tokens are predicted by positions len(prompt)-1 ...
    pred = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    return torch.log_softmax(pred, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_sampled_logprobs_match_a_full_forward_pass_at_the_sampling_temperature(engine: HFGenerationEngine) -> None:
    settings = SamplingSettings(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True)
    worst = 0.0
    for prompt in PROMPTS[:4]:
        result = engine.generate_sync(prompt, settings)
        assert len(result.token_ids) == len(result.log_probs) == 12
        ref = _reference_logprobs(engine.model, prompt, result.token_ids, temperature=0.7)
        worst = max(worst, max(abs(a - b) for a, b in zip(result.log_probs, ref)))
    print(f"\n[hf-rollout] max |log-prob(KV-cached sampling) - log-prob(full forward)| = {worst:.2e}")
    assert worst < 1e-5
    # Negative control: the same log-probs are NOT the temperature-1 ones, so the check above can fail.
    result = engine.generate_sync(PROMPTS[0], settings)
    at_t1 = _reference_logprobs(engine.model, PROMPTS[0], result.token_ids, temperature=1.0)
    assert max(abs(a - b) for a, b in zip(result.log_probs, at_t1)) > 1e-3


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: HFGenerationEngine) -> None:
    a = engine.generate_sync(PROMPTS[2], SamplingSettings(max_tokens=16, seed=7, ignore_eos=True))
    b = engine.generate_sync(PROMPTS[2], SamplingSettings(max_tokens=16, seed=7, ignore_eos=True))
    c = engine.generate_sync(PROMPTS[2], SamplingSettings(max_tokens=16, seed=8, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.log_probs == b.log_probs
    assert a.token_ids != c.token_ids  # 16 draws from a ~uniform 512-way distribution: a collision is ~impossible


def test_generation_stops_at_eos_unless_ignored(engine: HFGenerationEngine) -> None:
    greedy = SamplingSettings(max_tokens=8, temperature=0.0, ignore_eos=True)
    full = engine.generate_sync(PROMPTS[1], greedy).token_ids
    assert len(full) == 8
    # Declare the third greedy token an end-of-sequence token: the response must stop right after its
    # first occurrence (inclusive), with the same tokens before it.
    stop_token = full[2]
    expected = full[: full.index(stop_token) + 1]
    stopping = HFGenerationEngine(engine.model, [stop_token])
    assert stopping.generate_sync(PROMPTS[1], SamplingSettings(max_tokens=8, temperature=0.0)).token_ids == expected
    assert stopping.generate_sync(PROMPTS[1], greedy).token_ids == full


def test_max_tokens_follow_verls_vllm_length_rules() -> None:
    # No explicit max_tokens: min(response_length, prompt_length + response_length - prompt_len).
    s = settings_from_verl({}, prompt_len=10, response_length=16, prompt_length=64, max_model_len=80)
    assert s.max_tokens == 16  # min(16, 64 + 16 - 10 = 70)
    # A prompt that overran prompt_length (multi-turn): capped by the remaining budget 64 + 16 - 75 = 5.
    s = settings_from_verl({}, prompt_len=75, response_length=16, prompt_length=64, max_model_len=80)
    assert s.max_tokens == 5
    # An explicit max_tokens is honoured but clamped to the context left: 80 - 70 = 10.
    s = settings_from_verl({"max_tokens": 50}, prompt_len=70, response_length=16, prompt_length=64, max_model_len=80)
    assert s.max_tokens == 10
    with pytest.raises(ValueError, match="no room to generate"):
        settings_from_verl({}, prompt_len=80, response_length=16, prompt_length=64, max_model_len=80)
    s = settings_from_verl(
        {"temperature": 0.5, "top_k": None, "top_p": None, "logprobs": False},
        prompt_len=3, response_length=4, prompt_length=8, max_model_len=12,
    )
    assert (s.temperature, s.top_k, s.top_p, s.want_logprobs) == (0.5, -1, 1.0, False)


def test_weight_updates_change_generation_and_unknown_names_fail(tiny_model_dir: Path) -> None:
    engine = HFGenerationEngine.from_pretrained(str(tiny_model_dir))
    greedy = SamplingSettings(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.generate_sync(PROMPTS[0], greedy)
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in engine.model.state_dict().items() if "mlp" in k}
    assert engine.load_weights(perturbed.items()) == len(perturbed)
    after = engine.generate_sync(PROMPTS[0], greedy)
    assert after.log_probs != before.log_probs
    with pytest.raises(ValueError, match="does not have"):
        engine.load_weights([("model.not_a_layer.weight", torch.zeros(1))])
    # The diagnostic switch (the negative control of the sync check) loads the updates it allows, then really
    # freezes the rollout: after:N counts the updates loaded so far (1 here).
    engine.freeze_after = engine.num_weight_updates + 1
    again = {k: v + 0.5 * torch.randn_like(v) for k, v in perturbed.items()}
    assert engine.load_weights(again.items()) == len(again) and engine.frozen
    moved = engine.generate_sync(PROMPTS[0], greedy)
    assert moved.log_probs != after.log_probs
    assert engine.load_weights([(k, torch.zeros_like(v)) for k, v in perturbed.items()]) == 0
    assert engine.generate_sync(PROMPTS[0], greedy).log_probs == moved.log_probs


def test_the_freeze_diagnostic_reads_every_setting_and_refuses_a_typo() -> None:
    from verl_mas.backends import diagnostic_after
    from verl_mas.backends.vllm import FREEZE_WEIGHTS_ENV as VLLM_FREEZE

    env = "VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS"
    assert [diagnostic_after(v, env) for v in (None, "", "0", "1", "yes", "after:2", " AFTER:10 ")] == [None, None, None,
                                                                                                     0, 0, 2, 10]
    with pytest.raises(ValueError, match=f"{env}='after2'.*after:N"):
        diagnostic_after("after2", env)
    with pytest.raises(ValueError, match=f"{VLLM_FREEZE}='after:-1'"):
        diagnostic_after("after:-1", VLLM_FREEZE)


async def test_concurrent_requests_get_exactly_their_sequential_answers(engine: HFGenerationEngine) -> None:
    greedy = SamplingSettings(max_tokens=10, temperature=0.0, ignore_eos=True)
    sequential = [engine.generate_sync(p, greedy) for p in PROMPTS]
    # 4 concurrent copies of every prompt, interleaved: they are decoded as left-padded batches.
    concurrent = await asyncio.gather(*[engine.generate(p, greedy) for _ in range(4) for p in PROMPTS])
    worst = 0.0
    for i, result in enumerate(concurrent):
        expected = sequential[i % len(PROMPTS)]
        assert result.token_ids == expected.token_ids
        # Batched matmuls round differently from single-row ones: equal to float rounding, not bitwise.
        worst = max(worst, max(abs(a - b) for a, b in zip(result.log_probs, expected.log_probs)))
    print(f"\n[hf-rollout] 32 concurrent greedy requests (largest batch {engine.largest_batch}): tokens identical to "
          f"sequential calls, max |log-prob diff| = {worst:.1e}")
    assert worst < 1e-5
    assert engine.largest_batch > 1  # they really were batched
    # The prompts lead to different answers: a server mixing requests up could not pass this.
    assert len({tuple(r.token_ids) for r in sequential}) == len(PROMPTS)


async def test_batched_sampling_keeps_per_request_settings_and_seeds(engine: HFGenerationEngine) -> None:
    seeded = [SamplingSettings(max_tokens=6, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    mixed = [*seeded, SamplingSettings(max_tokens=2, temperature=0.0, ignore_eos=True)]
    alone = [engine.generate_sync(PROMPTS[i], st) for i, st in enumerate(mixed)]
    together = await asyncio.gather(*[engine.generate(PROMPTS[i], st) for i, st in enumerate(mixed)])
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == [6, 6, 6, 2]  # each row stops at its own max_tokens


@pytest.mark.slow  # starts Ray in a child interpreter
def test_server_actor_under_concurrent_ray_requests(tiny_model_dir: Path) -> None:
    """The Ray server actor verl talks to: 32 concurrent generate calls vs one-at-a-time calls, and one request for
    3 samples; every sample names the replica that served it, and the counters the trainer logs per replica count
    every request and sample."""
    code = f"""
        import asyncio, json, ray
        import verl  # loads the plugin
        from verl.workers.config import RolloutConfig
        from verl_mas.backends.hf.server import HFRolloutServer

        class ModelConfig:
            path = local_path = {str(tiny_model_dir)!r}
            trust_remote_code = False

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        config = RolloutConfig(name="hf", prompt_length=32, response_length=8, tensor_model_parallel_size=1)
        server = ray.remote(HFRolloutServer).options(max_concurrency=64).remote(config, ModelConfig(), 3)
        prompts = {PROMPTS!r}
        params = dict(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
        one_by_one = [ray.get(server.generate.remote(p, dict(params), f"seq-{{i}}")) for i, p in enumerate(prompts)]

        async def burst():
            refs = [server.generate.remote(p, dict(params), f"c-{{k}}-{{i}}") for k in range(4) for i, p in enumerate(prompts)]
            return await asyncio.gather(*refs)

        together = asyncio.run(burst())
        # One request for 3 samples of a prompt (the mas agent loop's group): greedy, so each is the prompt's answer.
        head = ray.get(server.generate.remote(prompts[0], dict(params), "group", mas_samples=3))
        group = head.extra_fields.get("mas_group", [])
        grouped = [len(group), all(g.token_ids == one_by_one[0].token_ids for g in group),
                   head.token_ids == one_by_one[0].token_ids, sorted({{g.extra_fields["mas_replica"] for g in group}})]
        try:
            ray.get(server.generate.remote(prompts[0], dict(params), "none", mas_samples=0))
            refused = ""
        except ray.exceptions.RayTaskError as exc:
            refused = str(exc.cause)
        ok = all(t.token_ids == one_by_one[j % len(prompts)].token_ids and
                 max(abs(a - b) for a, b in zip(t.log_probs, one_by_one[j % len(prompts)].log_probs)) < 1e-5
                 for j, t in enumerate(together))
        print(json.dumps({{"ok": ok, "n": len(together), "stats": ray.get(server.stats.remote()),
                          "replicas": sorted({{t.extra_fields["mas_replica"] for t in together + one_by_one}}),
                          "steps": [t.extra_fields["global_steps"] for t in together[:2]],
                          "lens": sorted({{len(t.token_ids) for t in together}}), "stop": together[0].stop_reason,
                          "grouped": grouped, "refused": refused}}))
        ray.shutdown()
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Greedy, no EOS in 8 tokens from a random model is likely but not certain: lengths are 1..8.
    assert result["ok"] is True and result["n"] == 32
    assert result["steps"] == [0, 0] and result["stop"] == "completed"
    assert max(result["lens"]) <= 8
    assert result["grouped"] == [3, True, True, [3]]
    assert "mas_samples=0" in result["refused"]
    # The 5 passes over the prompts, one sample each, then one request of 3 samples (the refused one counts nothing).
    assert result["stats"] == {"requests": len(PROMPTS) * 5 + 1, "samples": len(PROMPTS) * 5 + 3,
                               "weight_updates": 0, "weight_bytes": 0}
    assert result["replicas"] == [3]  # the replica rank the server was started with
