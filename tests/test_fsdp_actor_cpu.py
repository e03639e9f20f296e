"""verl's real FSDP2 actor on the CPU platform: log-probs match transformers, and PPO moves them the right way.

Run: ``.venv/bin/python -m pytest tests/test_fsdp_actor_cpu.py -q -s -p no:cacheprovider`` (``-s`` shows
the measured numbers).

The scenario (``tests/_fsdp_helpers.py``) runs once per module in a child interpreter with
``VERL_PLATFORM=cpu`` and a one-rank torchrun-style environment, so neither those variables nor verl's
global gloo process group leak into other tests. In it, ``ActorRolloutRefWorker(role="actor")`` is built
from verl's own ``ppo_trainer`` config (strategy ``fsdp2``, full fp32, sdpa attention) and called the way
verl's trainer calls it: ``compute_log_prob`` / ``update_actor`` on no-padding TensorDicts. The batch is
4 sequences with prompt lengths (5, 8, 3, 6) and response lengths (6, 4, 3, 3): 16 response tokens.
The scenario takes ~25 s on 2 idle cores (import verl ~6 s, two actor builds ~5 s, the rest is
forward/backward passes).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

HELPER = Path(__file__).with_name("_fsdp_helpers.py")
sys.path.insert(0, str(HELPER.parent))
from _fsdp_helpers import run_scenario  # noqa: E402  (the scenario script; importing it defines functions only)

# the scenario runs verl's FSDP2 engine in a child interpreter
pytestmark = pytest.mark.slow

#: What the scenario must have used, for the hand-computed expectations below.
PROMPT_LENS = [5, 8, 3, 6]
RESPONSE_LENS = [6, 4, 3, 3]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0]
LR = 1e-3
BETA1, BETA2 = 0.9, 0.999
VOCAB_SIZE = 512  # verl_mas.tiny's default byte-level BPE vocabulary

#: verl's token-mean PPO loss at the first step of an update, where pi_theta == pi_old so every ratio is
#: exactly 1 and nothing is clipped: loss = -sum_i A_i * L_i / sum_i L_i over response tokens
#: = -(1*6 + 1*4 - 1*3 - 1*3) / (6 + 4 + 3 + 3) = -4 / 16.
EXPECTED_PG_LOSS = -sum(a * n for a, n in zip(ADVANTAGES, RESPONSE_LENS, strict=True)) / sum(RESPONSE_LENS)
assert EXPECTED_PG_LOSS == -0.25

#: AdamW's step size on the signal update. It is the optimizer's 2nd step: the zero-advantage control ran
#: first and made a step with gradient 0 (m1 = v1 = 0). With gradient g at step 2 (grad clipping only
#: rescales g, which Adam is invariant to): m2 = (1-b1) g, v2 = (1-b2) g^2, bias-corrected
#: m2 / (1-b1^2) = g / (1+b1) and v2 / (1-b2^2) = g^2 / (1+b2), so every element with |g| >> eps moves by
#: lr * sqrt(1+b2) / (1+b1) = 1e-3 * sqrt(1.999) / 1.9 = 7.4414e-4 (weight decay is 0 in the scenario).
EXPECTED_MAX_PARAM_STEP = LR * math.sqrt(1 + BETA2) / (1 + BETA1)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = run_scenario(HELPER, tmp_path_factory.mktemp("fsdp_actor_cpu"))
    config = result["config"]
    # The expectations above are derived for exactly this batch and optimizer: fail loudly if they drift.
    assert list(config["prompt_lens"]) == PROMPT_LENS
    assert list(config["response_lens"]) == RESPONSE_LENS
    assert config["lr"] == LR and list(config["betas"]) == [BETA1, BETA2]
    assert result["ppo_update"]["advantages"] == ADVANTAGES
    print(f"\n[fsdp-actor-cpu] scenario timings (s): {json.dumps(result['timings'])}")
    return result


def test_actor_is_verls_fsdp2_engine_in_fp32_on_cpu(scenario: dict[str, Any]) -> None:
    engine = scenario["engine"]
    print(f"\n[fsdp-actor-cpu] engine: {json.dumps(engine)}")
    # Fails if the verl_mas plugin did not select the cpu platform (verl falls back to cuda/nccl), or if
    # verl picked FSDP1 / another engine instead of FSDP2 (fully_shard wraps the model class as FSDP<cls>).
    assert engine["device"] == "cpu"
    assert engine["process_group_backend"] == "cpu:gloo"
    assert engine["world_size"] == 1
    assert engine["engine_class"] == "FSDPEngineWithLMHead"
    assert engine["strategy"] == "fsdp2"
    assert engine["module_class"] == "FSDPQwen2ForCausalLM"
    assert engine["optimizer"] == "AdamW"
    # Fails if verl ignored actor.fsdp_config.mixed_precision (its default is bf16 params + bf16 autocast,
    # which would make the 1e-5 parity below meaningless or impossible).
    assert engine["param_dtypes"] == ["torch.float32"]
    assert engine["autocast_dtype"] == "torch.float32"
    assert engine["model_dtype"] == "fp32"
    assert engine["mixed_precision"] == {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def test_log_probs_match_plain_transformers(scenario: dict[str, Any]) -> None:
    parity = scenario["parity"]
    print(
        "\n[fsdp-actor-cpu] log-prob parity vs transformers over "
        f"{parity['n_response_tokens']} response tokens: max|diff| = {parity['max_abs_diff']:.3e} (T=1, packed "
        f"inputs), {parity['max_abs_diff_alt_temperature']:.3e} (T={parity['alt_temperature']}), "
        f"{parity['max_abs_diff_padded_inputs']:.3e} (T=1, use_remove_padding=false); reference mean log-prob "
        f"{parity['mean_log_prob']:.4f} (-ln {VOCAB_SIZE} = {-math.log(VOCAB_SIZE):.4f})"
    )
    # The reference is sane: a random-init model (init std 0.02, RMS-normed hidden of size 64, tied
    # embeddings) has logits with std ~0.16, so every log-prob is -ln V plus a deviation of ~0.16
    # (|deviation| < 1 is > 6 sigma). Fails if the reference gathered the wrong thing (raw logits ~0,
    # probabilities, or positions off the sequence).
    assert parity["vocab_size"] == VOCAB_SIZE
    for row, n in zip(parity["hf_log_probs"], RESPONSE_LENS, strict=True):
        assert all(abs(lp + math.log(VOCAB_SIZE)) < 1.0 for lp in row[:n]), row
        assert all(lp == 0.0 for lp in row[n:])  # padding stays masked
    # The check itself: verl's FSDP2 forward (sequences packed into one row, sdpa attention, its own
    # shift-by-one and gather of response tokens, its temperature scaling) equals plain transformers
    # run one unpadded sequence at a time. Fails on an off-by-one in the response slice, a padding or
    # position-id mistake, attention leaking across packed sequences, a temperature applied on one side
    # only, or low-precision (bf16) compute: all of these give differences >= 1e-3, fp32 reordering ~1e-6.
    assert parity["max_abs_diff"] < 1e-5
    assert parity["max_abs_diff_alt_temperature"] < 1e-5
    assert parity["max_abs_diff_padded_inputs"] < 1e-5


def test_zero_advantage_update_changes_nothing(scenario: dict[str, Any]) -> None:
    """Negative control: the same update with every advantage 0 must leave the policy exactly as it was."""
    control = scenario["control_update"]
    metrics = control["metrics"]
    print(
        f"\n[fsdp-actor-cpu] zero-advantage update: pg_loss={metrics['actor/pg_loss']}, "
        f"grad_norm={metrics['grad_norm']}, seq log-prob deltas={control['seq_log_prob_delta']}, "
        f"max|dparam|={max(control['param_max_abs_delta'].values()):.3e}"
    )
    # Hand-computed: loss = -sum(0 * ratio) = 0, so the gradient is exactly 0; AdamW with m = v = 0
    # and weight decay 0 then moves nothing. Fails if update_actor optimises anything other than the
    # advantage-weighted objective (e.g. a stray KL/entropy term, or advantages taken from another field).
    assert metrics["actor/pg_loss"] == [0.0]
    assert metrics["grad_norm"] == [0.0]
    assert all(delta == 0.0 for delta in control["param_max_abs_delta"].values())
    # Same parameters, same deterministic CPU forward: the log-probs are reproduced (to fp32 noise).
    assert all(abs(delta) <= 1e-6 for delta in control["seq_log_prob_delta"])


def test_ppo_update_moves_log_probs_in_advantage_direction(scenario: dict[str, Any]) -> None:
    update = scenario["ppo_update"]
    metrics = update["metrics"]
    deltas = update["seq_log_prob_delta"]
    param_deltas = update["param_max_abs_delta"]
    print(
        f"\n[fsdp-actor-cpu] PPO update with advantages {update['advantages']}: pg_loss={metrics['actor/pg_loss']} "
        f"(hand: {EXPECTED_PG_LOSS}), grad_norm={metrics['grad_norm']}, summed log-prob per sequence "
        f"{[round(x, 4) for x in update['seq_log_prob_before']]} -> "
        f"{[round(x, 4) for x in update['seq_log_prob_after']]}, deltas {[round(x, 4) for x in deltas]}; "
        f"max|dparam|={max(param_deltas.values()):.4e} (hand: {EXPECTED_MAX_PARAM_STEP:.4e}) over "
        f"{len(param_deltas)} tensors"
    )
    # The loss verl computed equals the hand-computed first-step PPO loss (ratio 1, no clipping). Fails
    # if advantages or the response mask reach ppo_loss misaligned or mis-normalised (a different token
    # count, sign or weighting changes -0.25).
    assert metrics["actor/pg_loss"][0] == pytest.approx(EXPECTED_PG_LOSS, abs=1e-6)
    assert metrics["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)]
    assert metrics["actor/pg_clipfrac"] == [0.0]
    assert metrics["grad_norm"][0] > 0.0

    # Parameters changed, by the hand-computed AdamW step. Fails if the optimizer did not step, if the
    # update was skipped (non-finite grad norm), or if verl used another lr/betas than configured.
    assert all(delta > 0.0 for delta in param_deltas.values()), param_deltas
    assert max(param_deltas.values()) == pytest.approx(EXPECTED_MAX_PARAM_STEP, rel=1e-2)

    # The point of PPO: sequences with positive advantage become more likely, negative ones less likely.
    # Measured deltas are ~+1.7, +1.1, -1.1, -0.9 nats; 0.1 leaves a wide margin for cross-sequence
    # gradient interference while still failing on a sign flip or an update that does nothing.
    for advantage, delta in zip(ADVANTAGES, deltas, strict=True):
        assert delta * advantage > 0.1, (advantage, delta)
