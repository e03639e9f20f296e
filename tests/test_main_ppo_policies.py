"""One model per role and one LoRA adapter per role, end to end through verl's stock main_ppo on CPU.

The CPU quickstart recipe (relay-v0: roles caller and runner) with ``mas_policies=per_role_models`` or
``mas_policies=per_role_lora``. Two controls make the checks able to fail:

- ``mas.alpha=0`` leaves the runner with reward 0 on every sample (its reward is the team term only), so
  every runner group has zero variance and zero advantage: the runner's policy must not move at all
  (its weight decay is set to 0, so even AdamW's decoupled decay cannot move it), while the caller's
  (local reward: naming the right word) must;
- the two models differ in size (and in vocabulary: two model families in one team), so a request served
  by the wrong model, or weights synced into the wrong server, shows up as a large rollout-vs-actor
  log-prob gap for that policy. (That each role renders with its own tokenizer is checked on the agent
  loop's rows in tests/test_policies.py.)

With per-role LoRA the two adapters share one resident base (``mas.lora_base=shared``); that each request
reaches its own adapter is checked with both adapters non-zero and a swapped-adapter control in
tests/test_shared_lora_cpu.py, here end to end on the counts, the synced bytes and the checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
K, TASKS = 4, 8  # K: recipe_runs.relay_shape's
SAVE_HF = "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"


def _run(run_dir: Path, shape: tuple[str, ...], *overrides: str) -> list[dict]:
    """The quickstart recipe in the tests' shape (``recipe_runs.relay_shape``), then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir))
    proc = subprocess.run(
        ["bash", str(RECIPE), *shape, f"data.train_batch_size={TASKS}", "mas.alpha=0", *overrides],
        cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _val_outputs(path: Path) -> list[tuple[str, str]]:
    """The (prompt, response) pairs of a validation dump, sorted (verl orders them by fresh random uids)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((r["input"], r["output"]) for r in rows)


@pytest.mark.slow
def test_per_role_models_of_different_sizes_train_route_sync_save_and_resume(tmp_path: Path, recipe_runs) -> None:
    from verl_mas.tiny import write_tiny

    run_dir = tmp_path / "run"
    # The caller gets the recipe's tiny model (hidden 64, 2 layers, the relay's word-level vocabulary, 100
    # tokens); the runner a larger one of another family (hidden 128, 3 layers, byte-level BPE, 512 tokens):
    # each policy renders, samples and trains on its own tokenizer's ids.
    runner_model = write_tiny(tmp_path / "runner_model", hidden_size=128, num_hidden_layers=3, seed=7)
    # The caller's model as run.sh writes it, but with ChatML prompts (10 tokens): after 2 steps from random
    # weights the compact layout's 3-token prompts leave near-tied greedy logits, and the exact comparison of
    # validation outputs across the resume below would hinge on float noise of the batch shape.
    from verl_mas.tiny import CHAT_TEMPLATE
    from verl_mas.workflows.relay import RelayWorkflow

    write_tiny(run_dir / "model", vocab=list(RelayWorkflow.vocabulary), chat_template=CHAT_TEMPLATE)
    policies = ["mas_policies=per_role_models", f"+mas.policies.runner.model.path={runner_model}",
                "+mas.policies.runner.actor={optim: {weight_decay: 0.0}}"]
    metrics = _run(run_dir, recipe_runs.relay_shape, *policies, "trainer.total_training_steps=2", "trainer.save_freq=2", SAVE_HF,
                   "trainer.test_freq=2", f"trainer.validation_data_dir={run_dir / 'val1'}")
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        d = m["data"]
        print(f"[per-role-models] step {m['step']}: " + " ".join(
            f"{p}: probs_diff={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests={d[f'policy/{p}/rollout/requests']:.0f} "
            f"syncs={d[f'policy/{p}/rollout/weight_updates']:.0f}" for p in ("caller", "runner")))
        for policy, role in (("caller", "caller"), ("runner", "runner")):
            # Each policy's rollout log-probs are its own actor's: requests reached the right model and
            # the weight sync of one policy did not land in the other's server.
            assert d[f"policy/{policy}/training/rollout_probs_diff_mean"] < 1e-6
            # Every update of a policy's server is its own policy's sync: one per step (plus the initial one).
            assert d[f"policy/{policy}/rollout/weight_updates"] == (2.0 if m["step"] == 1 else 1.0)
            # Step 1 (no validation in it): K requests per turn the role acted in, on its policy's server only.
            if m["step"] == 1:
                assert d[f"policy/{policy}/rollout/requests"] == round(K * TASKS * d[f"mas/{role}/turns"])
        assert d["mas/runner/reward/mean"] == 0.0  # alpha=0: the runner's control condition
        assert d["policy/runner/actor/grad_norm"] == 0.0
    assert max(m["data"]["policy/caller/actor/grad_norm"] for m in steps) > 0

    # Parameters (transformers copies saved with the step-2 checkpoint): the caller moved, the runner —
    # all samples at zero advantage — is bit-for-bit the larger model it started from.
    ckpt = run_dir / "checkpoints" / "global_step_2"
    caller_before, caller_after = _weights(run_dir / "model"), _weights(ckpt / "actor" / "huggingface")
    runner_before, runner_after = _weights(runner_model), _weights(ckpt / "actor_runner" / "huggingface")
    assert caller_after.keys() == caller_before.keys() and runner_after.keys() == runner_before.keys()
    assert runner_after["model.embed_tokens.weight"].shape[1] == 128  # the runner's worker group trained the big model
    moved = [k for k in caller_before if not torch.equal(caller_before[k], caller_after[k])]
    assert len(moved) > len(caller_before) // 2, moved
    assert all(torch.equal(runner_before[k], runner_after[k]) for k in runner_before)
    print(f"[per-role-models] caller tensors changed: {len(moved)}/{len(caller_before)}; runner tensors changed: 0/"
          f"{len(runner_before)}")

    # Kill and resume: a new main_ppo process continues at step 3 from the step-2 checkpoint of every
    # policy: greedy validation before the resumed step reproduces the validation after step 2 exactly
    # (same weights in both policies' servers), and every policy's optimiser continues its count (Adam's
    # step is 3 in the step-3 checkpoint; a policy restarted from scratch would have 1).
    # The resumed run also moves the runner to a resource pool of its own (a second logical GPU), where
    # its log-probs and update run concurrently with the caller's.
    resumed = _run(run_dir, recipe_runs.relay_shape, *policies, "trainer.total_training_steps=3", "trainer.val_before_train=True",
                   "trainer.test_freq=3", f"trainer.validation_data_dir={run_dir / 'val2'}", "trainer.save_freq=3",
                   "+mas.policies.runner.resources={n_gpus_per_node: 1}", "ray_kwargs.ray_init.num_gpus=2")
    new = resumed  # verl's file logger starts metrics.jsonl afresh in every process
    assert [m["step"] for m in new if "mas/success_rate" in m["data"]] == [3]
    step3 = next(m["data"] for m in new if m["step"] == 3 and "mas/success_rate" in m["data"])
    assert step3["policy/caller/training/rollout_probs_diff_mean"] < 1e-6
    assert step3["policy/runner/training/rollout_probs_diff_mean"] < 1e-6
    # Sum of the two policies' update times over the phase's wall time: 1.0 or less if they ran one after
    # the other, more if they overlapped (split pools).
    assert step3["mas/policies/update_actor_concurrency"] > 1.0
    assert steps[-1]["data"]["mas/policies/update_actor_concurrency"] <= 1.0  # shared pool: one at a time
    print(f"[per-role-models] concurrency of the two policies' updates: shared pool "
          f"{steps[-1]['data']['mas/policies/update_actor_concurrency']:.2f}, split pools "
          f"{step3['mas/policies/update_actor_concurrency']:.2f}")
    after_step2 = _val_outputs(run_dir / "val1" / "2.jsonl")
    assert _val_outputs(run_dir / "val2" / "2.jsonl") == after_step2
    for policy in ("actor", "actor_runner"):
        for step, expected in ((2, 2.0), (3, 3.0)):  # one optimiser step per training step (one mini-batch)
            optim = torch.load(run_dir / "checkpoints" / f"global_step_{step}" / policy / "optim_world_size_1_rank_0.pt",
                               weights_only=False)
            assert {float(v["step"]) for v in optim["state"].values()} == {expected}, (policy, step)
    print(f"[per-role-models] resume: {len(after_step2)} greedy validation outputs identical before/after the restart")


@pytest.mark.slow
def test_per_role_lora_trains_each_adapter_on_one_resident_base_syncs_adapters_only_and_resumes(
        tmp_path: Path, recipe_runs) -> None:
    """mas_policies=per_role_lora (mas.lora_base=shared): one worker group and one hf rollout hold the base
    once and both adapters (rank 8, all linear layers of the relay's tiny model: 2816 x 8 = 22,528 floats,
    90,112 bytes each). The agent loop's requests name their role's adapter; the sync sends adapter tensors."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_bytes = 2816 * 8 * 4
    run_dir = tmp_path / "run"
    lora = ("mas_policies=per_role_lora", "+mas.policies.runner.actor.optim.weight_decay=0.0")
    metrics = _run(run_dir, recipe_runs.relay_shape, *lora, "trainer.total_training_steps=2", "trainer.save_freq=2",
                   SAVE_HF)
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == [1, 2]
    base = _weights(run_dir / "model")
    # What a base sync sends: the model's state dict, the tied lm_head (stored once in the file) included.
    base_bytes = sum(t.numel() * t.element_size()
                     for t in AutoModelForCausalLM.from_pretrained(run_dir / "model").state_dict().values())
    for m in steps:
        d = m["data"]
        print(f"[per-role-lora] step {m['step']}: " + " ".join(
            f"{p}: probs_diff={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests={d[f'policy/{p}/rollout/requests']:.0f}"
            for p in ("caller", "runner")) + f" synced bytes={d['mas/rollout/weight_bytes']:.0f}")
        # Base + adapter in the actor vs the rollout's base + the same adapter: equal up to float rounding.
        assert d["policy/caller/training/rollout_probs_diff_mean"] < 1e-4
        assert d["policy/runner/training/rollout_probs_diff_mean"] < 1e-4
        assert d["policy/runner/actor/grad_norm"] == 0.0  # alpha=0: the runner's control condition
        if m["step"] == 1:
            # The one rollout served each role's K requests per turn under that role's adapter.
            for role in ("caller", "runner"):
                assert d[f"policy/{role}/rollout/requests"] == round(K * TASKS * d[f"mas/{role}/turns"])
            # Before step 1: verl's first sync sends the base once (the rollout started from dummy weights) and
            # both adapters, then the sync at the start of training both adapters again.
            assert d["mas/rollout/weight_bytes"] == base_bytes + 2 * 2 * adapter_bytes
        else:  # after a step: the two adapters' tensors, nothing of the base
            assert d["mas/rollout/weight_bytes"] == 2 * adapter_bytes
            assert d["policy/caller/rollout/weight_updates"] == d["policy/runner/rollout/weight_updates"] == 1.0
    assert max(m["data"]["policy/caller/actor/grad_norm"] for m in steps) > 0

    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    # One checkpoint for both policies (one module), each adapter also on its own in the PEFT format.
    assert not (run_dir / "checkpoints" / "global_step_2" / "actor_runner").exists()
    saved = _weights(ckpt / "huggingface")  # peft layout: base_layer + lora_A/lora_B of every adapter
    frozen = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
              for k, v in saved.items() if "lora_" not in k}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)  # base untouched
    adapters = {p: load_file(str(ckpt / "adapters" / p / "adapter_model.safetensors")) for p in ("caller", "runner")}
    assert {p: sum(t.numel() * t.element_size() for t in a.values()) for p, a in adapters.items()} == {
        "caller": adapter_bytes, "runner": adapter_bytes}
    # B starts at zero: the runner's adapter (zero advantage) is still zero, the caller's is not.
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters["runner"].items() if "lora_B" in k)
    assert sum(int(torch.count_nonzero(v)) for k, v in adapters["caller"].items() if "lora_B" in k) > 0
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "model"),
                                           str(ckpt / "adapters" / "caller"))
    assert peft_model.peft_config["default"].r == 8

    # Kill and resume: every adapter's optimiser continues its count (one mini-batch a step: Adam's step is
    # 2 in the step-2 checkpoint; an adapter restarted from scratch would have 1). The resumed step drops the
    # zero-variance groups (mas.drop_zero_variance): the runner (alpha=0: every group flat) has no signal, so
    # it takes no optimiser step at all (Adam would still move it on zero gradients through its momentum):
    # its count stays 2 while the caller's goes to 3, and it logs no update metrics that step.
    resumed = _run(run_dir, recipe_runs.relay_shape, *lora, "trainer.total_training_steps=3", "trainer.save_freq=3",
                   "mas.drop_zero_variance=true")
    assert [m["step"] for m in resumed if "mas/success_rate" in m["data"]] == [3]
    step3 = next(m["data"] for m in resumed if "mas/success_rate" in m["data"])
    assert step3["mas/rollout/weight_bytes"] == base_bytes + 2 * 2 * adapter_bytes  # a fresh rollout: base once
    assert recipe_runs.gap(step3, "caller") < 1e-4
    assert step3["mas/drop/no_signal"] == 1.0 and step3["policy/runner/rollout/requests"] > 0
    assert "policy/caller/actor/grad_norm" in step3 and not any(k.startswith("policy/runner/actor/") for k in step3)
    for policy, steps_after in (("caller", 3.0), ("runner", 2.0)):
        for step, expected in ((2, 2.0), (3, steps_after)):
            optim = torch.load(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "adapters" / policy
                               / "optim_world_size_1_rank_0.pt", weights_only=False)["optimizer"]
            assert {float(v["step"]) for v in optim["state"].values()} == {expected}, (policy, step)
    print(f"[per-role-lora] base {base_bytes} bytes resident once; {2 * adapter_bytes} adapter bytes synced a step; "
          "optimiser steps 2 -> 3 for the caller across the restart, 2 -> 2 for the runner without signal")
