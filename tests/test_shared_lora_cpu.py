"""One resident base, one LoRA adapter per policy: verl's real FSDP2 actor and the hf rollout, on the CPU.

The scenario (``tests/_lora_helpers.py``) runs once per module in a child interpreter (as
``tests/test_fsdp_actor_cpu.py``'s): ``SharedBaseLoraWorker(role="actor")`` from verl's ``ppo_trainer``
config with adapters ``caller`` (rank 4, alpha 8, lr 1e-3, verl's clip_grad 1.0) and ``runner`` (rank 2,
alpha 4, lr 2e-3, clip_grad 1e-9) on verl_mas's tiny model. Both adapters' B matrices are made non-zero first,
so misrouting changes numbers. ~30 s on 2 idle cores.

Hand-computed sizes: the tiny model (hidden 64, 4 heads of 16, 2 KV heads, MLP 256, 2 layers) has per layer
q 64x64, k 64x32, v 64x32, o 64x64, gate 64x256, up 64x256, down 256x64. A rank-r adapter on all of them
holds r x (128 + 96 + 96 + 128 + 320 + 320 + 320) = 1408 r parameters per layer, 2816 r in all: 11,264
floats at rank 4 and 5,632 at rank 2, i.e. 45,056 and 22,528 bytes in fp32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

HELPER = Path(__file__).with_name("_lora_helpers.py")
sys.path.insert(0, str(HELPER.parent))
from _fsdp_helpers import LR, run_scenario  # noqa: E402  (defines functions only)
from _lora_helpers import RUNNER_CLIP, RUNNER_LR  # noqa: E402

pytestmark = pytest.mark.slow

ADAPTER_FLOATS = {"caller": 2816 * 4, "runner": 2816 * 2}
#: Tensors of the base: per layer q, k, v (weight and bias each), o, gate, up, down and two RMS norms (12),
#: 2 layers, plus the embedding, the final norm and the LM head: 27. 7 adapted modules x (A, B) x 2 layers = 28
#: tensors per adapter.
BASE_TENSORS, LAYER_TENSORS, ADAPTER_TENSORS = 27, 24, 28
#: AdamW's epsilon (verl builds torch's AdamW with lr, betas and weight decay only).
ADAM_EPS = 1e-8
ADAPTER_BYTES = {p: 4 * n for p, n in ADAPTER_FLOATS.items()}
#: fp32 log-prob agreement between two correct computations of the same model (verl's packed FSDP forward,
#: transformers/peft one sequence at a time); the deliberate misroutings below differ by > 0.1.
CLOSE = 1e-5


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_scenario(HELPER, tmp_path_factory.mktemp("shared_lora"))
    print(f"\n[shared-lora] scenario {result['total_s']:.1f} s; " + json.dumps(
        {k: result[k] for k in ("caller_vs_runner", "rollout_gap", "rollout_gap_swapped", "sync_bytes", "peft_gap")}))
    return result


def _changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """What an update moved: the adapters whose checksum changed, and "base" if the base did."""
    moved = {p for p in before["adapters"] if before["adapters"][p] != after["adapters"][p]}
    return moved | ({"base"} if before["base"] != after["base"] else set())


def test_one_module_holds_the_base_once_and_an_adapter_and_optimiser_per_policy(scenario: dict[str, Any]) -> None:
    assert scenario["engine_class"] == "MultiAdapterFSDPEngineWithLMHead"  # verl's engine class, with the mixin
    assert scenario["optimizers"] == {"caller": "AdamW", "runner": "AdamW"}
    assert scenario["lrs"] == {"caller": 1e-3, "runner": 2e-3}  # the runner's actor.optim override
    start = scenario["report_start"]
    # Every LoRA B entry set non-zero (and A is random at creation): both adapters are fully non-zero.
    assert start["nonzero"] == ADAPTER_FLOATS
    # Resident parameters: the base once plus both adapters, nothing else.
    assert start["resident_param_bytes"] == scenario["base_param_bytes"] + sum(ADAPTER_BYTES.values())


def test_each_adapter_forwards_on_its_own_and_the_reference_is_the_bare_base(scenario: dict[str, Any]) -> None:
    assert scenario["ref_vs_base"] < CLOSE  # no_lora_adapter: every adapter disabled
    assert scenario["caller_vs_base"] > 0.1  # the adapters change the policy ...
    assert scenario["caller_vs_runner"] > 0.1  # ... each in its own way


def test_weight_sync_sends_each_adapters_tensors_and_nothing_of_the_base(scenario: dict[str, Any]) -> None:
    assert scenario["sync_names_without_policy"] == []
    assert scenario["sync_base_like_names"] == []
    assert scenario["sync_bytes"] == ADAPTER_BYTES
    assert sum(scenario["sync_bytes"].values()) < 0.15 * scenario["base_param_bytes"]


def test_the_rollout_serves_each_role_with_its_own_adapter(scenario: dict[str, Any]) -> None:
    # The hf rollout loaded from the sync stream reproduces the actor's log-probs per adapter ...
    assert all(gap < CLOSE for gap in scenario["rollout_gap"].values()), scenario["rollout_gap"]
    # ... and serving each role with the other's adapter is caught by the same comparison.
    assert all(gap > 0.1 for gap in scenario["rollout_gap_swapped"].values()), scenario["rollout_gap_swapped"]
    # A request that names no adapter is refused, not answered by the bare base.
    assert "shared LoRA base" in scenario["request_without_adapter"]


def test_an_update_moves_only_the_active_adapter(scenario: dict[str, Any]) -> None:
    start, after_caller, after_runner, misrouted = scenario["reports_updates"]
    assert _changed(start, after_caller) == {"caller"}
    assert after_caller["optimizer_steps"] == {"caller": 1, "runner": 0}
    assert _changed(after_caller, after_runner) == {"runner"}
    assert after_runner["optimizer_steps"] == {"caller": 1, "runner": 1}
    # Negative control: an update sent while the caller's adapter is active moves the caller, not the runner.
    assert _changed(after_runner, misrouted) == {"caller"}
    assert misrouted["base"] == start["base"]  # the base is bit-identical throughout


def test_each_adapter_is_saved_in_the_peft_format_and_resumes_exactly(scenario: dict[str, Any]) -> None:
    for policy in ("caller", "runner"):
        for name in ("adapter_config.json", "adapter_model.safetensors", "optim_world_size_1_rank_0.pt"):
            assert f"adapters/{policy}/{name}" in scenario["ckpt_files"]
    # peft.PeftModel.from_pretrained(base, adapters/<policy>) reproduces the actor with that adapter.
    assert scenario["peft_ranks"] == {"caller": 4, "runner": 2}
    assert all(gap < CLOSE for gap in scenario["peft_gap"].values()), scenario["peft_gap"]
    assert scenario["resumed_param_offload"]  # the resumed worker offloads its parameters between calls
    saved, resumed = scenario["report_saved"], scenario["report_resumed"]
    assert resumed["adapters"] == saved["adapters"] and resumed["base"] == saved["base"]
    assert resumed["optimizer_steps"] == saved["optimizer_steps"] == {"caller": 2, "runner": 1}
    # The same update on the original and on the resumed worker lands on the same weights, bit for bit
    # (the optimiser moments were restored, not only the step counts).
    continued, resumed_continued = scenario["report_continued"], scenario["report_resumed_continued"]
    assert _changed(saved, continued) == {"runner"}
    assert continued["adapters"] == resumed_continued["adapters"]
    assert continued["optimizer_steps"] == resumed_continued["optimizer_steps"] == {"caller": 2, "runner": 2}


def test_each_adapter_clips_its_gradient_with_its_own_clip_grad(scenario: dict[str, Any]) -> None:
    # AdamW's first step (weight decay 0) moves each entry by lr * g / (|g| + eps): m_hat = g and sqrt(v_hat) = |g|.
    step = scenario["update_max_step"]
    # Control: the caller keeps verl's clip_grad 1.0. Its gradient's largest entry is at least its norm over
    # sqrt(11,264) (~1e-2 for a norm of 1), so g >> eps and its largest entry moves by ~lr.
    assert 0.9 * LR < step["caller"] <= LR * (1 + 1e-4), step
    # The runner's clip_grad 1e-9 bounds its gradient's norm, so every |g| <= 1e-9 and no entry moves by more than
    # lr * 1e-9 / (1e-9 + 1e-8) = lr / 11 (1.8e-4); clipped at the caller's 1.0 instead it would move by ~lr (2e-3).
    bound = RUNNER_LR * RUNNER_CLIP / (RUNNER_CLIP + ADAM_EPS)
    assert 0 < step["runner"] <= bound * (1 + 1e-3), (step, bound)


def test_the_first_sync_gathers_the_base_one_tensor_at_a_time(scenario: dict[str, Any]) -> None:
    # The base (sent once, to a rollout started with load_format=dummy) is a generator: nothing is gathered
    # when the sync starts ...
    assert scenario["base_sync_is_generator"]
    assert scenario["base_sync_gathered_at_return"] == 0
    # ... and when the rollout holds the k-th tensor, k full tensors were gathered and none of the k - 1 it
    # dropped is still alive: one full tensor at a time, not the whole base.
    steps = scenario["base_sync_steps"]
    assert len(steps) == BASE_TENSORS
    assert steps == [[k + 1, 0] for k in range(BASE_TENSORS)], steps
    # It is the whole base as the model on disk holds it, names and values.
    assert sorted(scenario["base_sync_names"]) == scenario["base_model_names"]
    assert scenario["base_sync_max_diff"] == 0.0


def _converted(name: str) -> str:
    # verl's convert_weight_keys reverses the model's {"^transformer.h": "model.layers"}: module names back to
    # checkpoint names.
    return name.replace("model.layers.", "transformer.h.")


def test_the_sync_names_the_base_and_the_adapters_through_verls_key_conversion(scenario: dict[str, Any]) -> None:
    base, adapters = scenario["base_sync_names"], scenario["adapter_sync_names"]
    assert sum(n != _converted(n) for n in base) == LAYER_TENSORS
    assert sum(n != _converted(n) for n in adapters) == 2 * ADAPTER_TENSORS
    # With the key mapping declared on the model, the sync sends verl's checkpoint names ...
    assert scenario["base_sync_names_converted"] == [_converted(n) for n in base]
    assert scenario["adapter_sync_names_converted"] == [_converted(n) for n in adapters]
    # ... and a sync that bypasses the conversion (the module's own names) fails the same check.
    assert base != [_converted(n) for n in base] and adapters != [_converted(n) for n in adapters]
