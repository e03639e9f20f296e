"""One model per role and one LoRA adapter per role, end to end through verl's stock main_ppo on CPU.

The CPU quickstart recipe with ``mas_policies=per_role_models`` (relay-v0: roles caller and runner) or
``mas_policies=per_role_lora`` (relay-chain-v0: caller, courier and runner, at data-parallel 2 with two rollout
replicas). Two controls make the checks able to fail:

- ``mas.alpha=0`` leaves the runner with reward 0 on every sample (its reward is the team term only), so
  every runner group has zero variance and zero advantage: the runner's policy must not move at all
  (its weight decay is set to 0, so even AdamW's decoupled decay cannot move it), while the caller's
  (local reward: naming the right word) must;
- the two models differ in size (and in vocabulary: two model families in one team), so a request served
  by the wrong model, or weights synced into the wrong server, shows up as a large rollout-vs-actor
  log-prob gap for that policy. (That each role renders with its own tokenizer is checked on the agent
  loop's rows in tests/test_policies.py.)

With per-role LoRA the three adapters share one resident base (``mas.lora_base=shared``); that each request
reaches its own adapter is checked with two adapters non-zero and a swapped-adapter control in
tests/test_shared_lora_cpu.py, here end to end on the counts, the synced bytes and the checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
K, TASKS = 4, 8  # K: recipe_runs.relay_shape's
#: The paper's ablation the per-role-models run carries (one start-up, two claims): advantages normalised in
#: (task, role) groups across turns instead of AT-GRPO's (task, role, turn) (verl_mas.config.ABLATIONS). Routing,
#: syncs, checkpoints and the runner's control do not depend on the grouping; the groups are checked on its steps.
PER_ROLE_MODELS_ABLATION = "role_only_groups"
SAVE_HF = "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"
#: Data-parallel ranks (logical GPUs) of a policy on verl's pool: verl gives each rank one hf rollout replica.
DP = 2


def _run(run_dir: Path, shape: tuple[str, ...], *overrides: str, workflow: str = "relay-v0") -> list[dict]:
    """The quickstart recipe in the tests' shape (``recipe_runs.relay_shape``) on ``workflow``, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), WORKFLOW=workflow)
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


@contextlib.contextmanager
def _ray_cluster(nodes: int):
    """A Ray cluster of ``nodes`` nodes of one logical GPU each (tests/_ray_cluster.py) whose raylets know nothing
    of verl_mas's CPU settings (no ``VERL_PLATFORM``: the recipe must carry them to every worker in Ray's runtime
    environment); yields its address, then shuts it down. Its session lives in a short temporary folder: Ray's
    socket paths must fit in 107 bytes."""
    temp_dir = tempfile.mkdtemp(prefix="vm-ray-")
    # RAY_TMPDIR: the head advertises its address (for a bare ray.init() to join) under Ray's temp folder; in a folder
    # of its own, no other test's Ray started meanwhile on this machine joins this cluster by mistake.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")} | {"RAY_TMPDIR": temp_dir}
    (Path(temp_dir) / "ray").mkdir()  # Ray's folder under RAY_TMPDIR, for the sessions and the address
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_ray_cluster.py")),
                             str(Path(temp_dir) / "ray"), str(nodes)],  # its workers start in its folder
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=temp_dir)
    try:
        address = proc.stdout.readline().strip()
        assert address, f"the {nodes}-node cluster did not start (exit {proc.poll()})"
        yield address
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _placement(address: str) -> list[dict]:
    """Where the last job's resource pools, rollout servers and worker processes were, from Ray's control store
    (it keeps the records of finished jobs): ``{kind, policy, name, nodes}`` each. A policy's workers run in its
    pool's placement groups (named ``mas_policy_<name>...``; verl's own pool, one group per node, is the first
    policy's); a server names its policy (``hf_server_..._<policy>``); the worker processes of both policies are
    one entry (``policy: both``)."""
    code = """
import json, sys, ray
from ray._private.state import state
ray.init(address=sys.argv[1], log_to_driver=False)
groups = [{"name": g["name"], "nodes": sorted(set(g["bundles_to_node_id"].values()))}
          for g in ray.util.placement_group_table().values()]
actors = [{"class": a["ActorClassName"], "name": a["Name"], "nodes": [a["Address"]["NodeID"]]}
          for a in state.actor_table(None).values()]
print(json.dumps({"groups": groups, "actors": actors}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    proc = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    placed = [{"kind": "resource pool", "name": g["name"], "nodes": g["nodes"],
               "policy": "runner" if g["name"].startswith("mas_policy_runner") else "caller"} for g in found["groups"]]
    placed += [{"kind": "rollout server", "name": a["name"], "nodes": a["nodes"],
                "policy": "runner" if a["name"].endswith("_runner") else "caller"}
               for a in found["actors"] if (a["name"] or "").startswith("hf_server_")]
    workers = sorted({n for a in found["actors"] if a["class"].endswith("WorkerDict") for n in a["nodes"]})
    return placed + [{"kind": "workers", "name": "WorkerDict", "nodes": workers, "policy": "both"}]


@pytest.mark.slow
def test_per_role_models_of_different_sizes_train_at_two_ranks_each_route_sync_and_resume_across_four_nodes(
        tmp_path: Path, recipe_runs) -> None:
    """mas_policies=per_role_models: the caller on verl's pool, the runner, a model of another size and family, on a
    resource pool of its own, each at data-parallel 2 (two ranks, one hf rollout replica each). Two steps on a local
    Ray, then a resume on a four-node Ray cluster: the caller over two nodes (``trainer.nnodes=2``, one rank and one
    replica a node), the runner over the two others (its ``resources: {nnodes: 2}``). The run also carries the
    role-only-groups ablation (:data:`PER_ROLE_MODELS_ABLATION`)."""
    from verl_mas.config import ablation
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
    policies = [*ablation(PER_ROLE_MODELS_ABLATION, K), "mas_policies=per_role_models",
                f"+mas.policies.runner.model.path={runner_model}",
                "+mas.policies.runner.actor={optim: {weight_decay: 0.0}}",
                f"+mas.policies.runner.resources={{n_gpus_per_node: {DP}}}"]
    metrics = _run(run_dir, recipe_runs.relay_shape, *policies, f"trainer.n_gpus_per_node={DP}",
                   f"ray_kwargs.ray_init.num_gpus={2 * DP}", "trainer.total_training_steps=2", "trainer.save_freq=2",
                   SAVE_HF, "trainer.test_freq=2", f"trainer.validation_data_dir={run_dir / 'val1'}")
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        d = m["data"]
        print(f"[per-role-models] step {m['step']}: " + " ".join(
            f"{p}: probs_diff={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests={d[f'policy/{p}/rollout/requests']:.0f} "
            f"syncs={d[f'policy/{p}/rollout/weight_updates']:.0f}" for p in ("caller", "runner"))
            + " replicas' requests: " + ", ".join(p + " " + "+".join(
                f"{d[f'policy/{p}/rollout/replica{r}/requests']:.0f}" for r in range(DP)) for p in ("caller", "runner"))
            + f" sessions={d['mas/rollout/sessions']:.0f} split={d['mas/rollout/sessions_split']:.0f}")
        _check_per_role_models_step(d, m["step"], replicas=DP, syncs_at_start=2.0)
    assert max(m["data"]["policy/caller/actor/grad_norm"] for m in steps) > 0

    # Parameters (transformers copies saved with the step-2 checkpoint, gathered from the caller's two shards): the
    # caller moved, the runner — all samples at zero advantage — is bit-for-bit the larger model it started from.
    ckpt = run_dir / "checkpoints" / "global_step_2"
    caller_before, caller_after = _weights(run_dir / "model"), _weights(ckpt / "actor" / "huggingface")
    runner_before, runner_after = _weights(runner_model), _weights(ckpt / "actor_runner" / "huggingface")
    if "lm_head.weight" in caller_after.keys() - caller_before.keys():
        # Gathered from two shards, the tied lm_head is written as a tensor of its own: it must be the embedding.
        assert torch.equal(caller_after.pop("lm_head.weight"), caller_after["model.embed_tokens.weight"])
    assert caller_after.keys() == caller_before.keys() and runner_after.keys() == runner_before.keys()
    assert runner_after["model.embed_tokens.weight"].shape[1] == 128  # the runner's worker group trained the big model
    moved = [k for k in caller_before if not torch.equal(caller_before[k], caller_after[k])]
    assert len(moved) > len(caller_before) // 2, moved
    assert all(torch.equal(runner_before[k], runner_after[k]) for k in runner_before)
    print(f"[per-role-models] caller tensors changed: {len(moved)}/{len(caller_before)}; runner tensors changed: 0/"
          f"{len(runner_before)}")

    # Kill and resume on a four-node Ray cluster (one logical GPU a node): verl's pool over two nodes of one GPU
    # (trainer.nnodes=2) holds the caller's two ranks, the runner's pool over two nodes of one GPU its two; each rank
    # loads the shard the same rank wrote on the local Ray. A placement group of one GPU a node can only go to a node
    # of its own: the two policies share no node. A new main_ppo process continues at step 3 from the step-2
    # checkpoint of every policy: greedy validation before the resumed step reproduces the validation after step 2
    # exactly (same weights in every server), and every policy's optimiser continues its count on every rank (Adam's
    # step is 3 in the step-3 checkpoint; a policy restarted from scratch would have 1).
    spread = [*policies[:-1], "+mas.policies.runner.resources={nnodes: 2, n_gpus_per_node: 1}"]
    with _ray_cluster(nodes=4) as address:
        resumed = _run(run_dir, recipe_runs.relay_shape, *spread, "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                       "trainer.total_training_steps=3", "trainer.val_before_train=True", "trainer.test_freq=3",
                       f"trainer.validation_data_dir={run_dir / 'val2'}", "trainer.save_freq=3",
                       f"ray_kwargs.ray_init.address={address}")
        placed = _placement(address)
    # From Ray: each policy's pool (a placement group a node) and its two rollout servers on two nodes of its own, one
    # server on each; worker processes on all four.
    nodes = {policy: {n for a in placed if a["policy"] == policy for n in a["nodes"]} for policy in ("caller", "runner")}
    kinds = {policy: sorted({a["kind"] for a in placed if a["policy"] == policy}) for policy in nodes}
    print("[per-role-models] four Ray nodes: " + "; ".join(f"{a['kind']} {a['name']} ({a['policy']}) on "
                                                           f"{[n[:8] for n in a['nodes']]}" for a in placed))
    assert kinds == {"caller": ["resource pool", "rollout server"], "runner": ["resource pool", "rollout server"]}, placed
    assert len(nodes["caller"]) == 2 and len(nodes["runner"]) == 2 and not nodes["caller"] & nodes["runner"], placed
    for policy in nodes:
        servers = [a["nodes"][0] for a in placed if a["policy"] == policy and a["kind"] == "rollout server"]
        assert sorted(servers) == sorted(nodes[policy]), (policy, placed)
    assert set(next(a["nodes"] for a in placed if a["kind"] == "workers")) == nodes["caller"] | nodes["runner"]
    new = resumed  # verl's file logger starts metrics.jsonl afresh in every process
    assert [m["step"] for m in new if "mas/success_rate" in m["data"]] == [3]
    step3 = next(m["data"] for m in new if m["step"] == 3 and "mas/success_rate" in m["data"])
    # A fresh rollout: each replica's initial sync, then the one of the step
    _check_per_role_models_step(step3, 3, replicas=DP, syncs_at_start=2.0)
    # Sum of the two policies' update times over the phase's wall time: 1.0 or less if they ran one after the other,
    # more if they overlapped (a pool each).
    for phase, d in (("one node", steps[-1]["data"]), ("four nodes", step3)):
        assert d["mas/policies/update_actor_concurrency"] > 1.0, phase
    print(f"[per-role-models] concurrency of the two policies' updates on pools of their own: one node "
          f"{steps[-1]['data']['mas/policies/update_actor_concurrency']:.2f}, four nodes "
          f"{step3['mas/policies/update_actor_concurrency']:.2f}")
    after_step2 = _val_outputs(run_dir / "val1" / "2.jsonl")
    assert _val_outputs(run_dir / "val2" / "2.jsonl") == after_step2
    for policy, ranks in (("actor", DP), ("actor_runner", DP)):
        for step, expected in ((2, 2.0), (3, 3.0)):  # one optimiser step per training step (one mini-batch)
            for rank in range(ranks):
                optim = torch.load(run_dir / "checkpoints" / f"global_step_{step}" / policy
                                   / f"optim_world_size_{ranks}_rank_{rank}.pt", weights_only=False)
                assert {float(v["step"]) for v in optim["state"].values()} == {expected}, (policy, step, rank)
    print(f"[per-role-models] resume: {len(after_step2)} greedy validation outputs identical before/after the restart")


def _check_per_role_models_step(d: dict, step: int, *, replicas: int, syncs_at_start: float) -> None:
    """One step of the per-role-models run (relay-v0, ``mas.alpha=0``): each policy's rollout log-probs are its own
    actor's (requests reached the right model, one policy's sync did not land in the other's servers); every
    replica of a policy takes exactly one sync of that policy a step (``syncs_at_start`` in a run's first step:
    the initial sync too); each policy's (episode, role) sessions each stay on one of its ``replicas`` replicas and
    spread over all of them; the runner, at zero advantage, gets a zero gradient."""
    for policy in ("caller", "runner"):
        assert d[f"policy/{policy}/training/rollout_probs_diff_mean"] < 1e-6, (policy, step)
        syncs = syncs_at_start if step in (1, 3) else 1.0
        assert d[f"policy/{policy}/rollout/weight_updates"] == replicas * syncs, (policy, step)
        if replicas > 1:
            assert [d[f"policy/{policy}/rollout/replica{r}/weight_updates"] for r in range(replicas)] == \
                [syncs] * replicas, (policy, step)
            assert all(d[f"policy/{policy}/rollout/replica{r}/requests"] > 0 for r in range(replicas)), (policy, step)
    if step == 1:  # no validation in it: K samples per turn the role acted in, on its policy's servers only, in one
        for role in ("caller", "runner"):  # request (the hf backend samples a group in one)
            assert d[f"policy/{role}/rollout/samples"] == round(K * TASKS * d[f"mas/{role}/turns"]), (role, step)
            assert d[f"policy/{role}/rollout/requests"] == round(TASKS * d[f"mas/{role}/turns"]), (role, step)
    assert (d["mas/rollout/sessions"], d["mas/rollout/sessions_split"]) == (2 * TASKS, 0.0), step
    # Role-only groups (the ablation this run carries): one group per (task, role), holding the role's K candidates
    # of every turn it acted in; AT-GRPO's would be one per (task, role, turn) of K each.
    turns = d["mas/caller/turns"] + d["mas/runner/turns"]  # per task
    assert d["mas/group/count"] == 2 * TASKS and abs(d["mas/group/size_mean"] - K * turns / 2) < 1e-6, step
    assert d["mas/runner/reward/mean"] == 0.0  # alpha=0: the runner's control condition
    assert d["policy/runner/actor/grad_norm"] == 0.0


#: The three-role team of relay-chain-v0: each role has its own LoRA adapter on the one resident base.
CHAIN = ("caller", "courier", "runner")


@pytest.mark.slow
def test_three_lora_adapters_on_one_base_train_at_two_ranks_with_two_replicas_sync_adapters_only_and_resume(
        tmp_path: Path, recipe_runs) -> None:
    """mas_policies=per_role_lora (mas.lora_base=shared) on relay-chain-v0's three roles, at data-parallel 2: one
    worker group of two ranks holds the base once and the three adapters (rank 8, all linear layers of the tiny
    model: 2816 x 8 = 22,528 floats, 90,112 bytes each); verl starts one hf rollout replica per rank. The agent
    loop's requests name their role's adapter and stay on one replica per (episode, role) session; every sync
    reaches both replicas and sends adapter tensors only; both ranks write their shards and resume from them.

    ``mas.alpha=0``: the runner's reward is its team term only, so its every group is flat and its adapter must not
    move, while the caller's and the courier's (local rewards) move whenever they have signal."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_bytes = 2816 * 8 * 4
    run_dir = tmp_path / "run"
    lora = ("mas_policies=per_role_lora", "+mas.policies.runner.actor.optim.weight_decay=0.0",
            f"trainer.n_gpus_per_node={DP}", f"ray_kwargs.ray_init.num_gpus={DP}")
    metrics = _run(run_dir, recipe_runs.relay_shape, *lora, "trainer.total_training_steps=2", "trainer.save_freq=2",
                   SAVE_HF, workflow="relay-chain-v0")
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == [1, 2]
    base = _weights(run_dir / "model")
    # What a base sync sends: the model's state dict, the tied lm_head (stored once in the file) included.
    base_bytes = sum(t.numel() * t.element_size()
                     for t in AutoModelForCausalLM.from_pretrained(run_dir / "model").state_dict().values())
    for m in steps:
        d = m["data"]
        print(f"[per-role-lora] step {m['step']} (dp={DP}): " + " ".join(
            f"{p}: probs_diff={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests="
            + "+".join(f"{d[f'policy/{p}/rollout/replica{r}/requests']:.0f}" for r in range(DP)) for p in CHAIN)
            + f" sessions={d['mas/rollout/sessions']:.0f} split={d['mas/rollout/sessions_split']:.0f}"
            f" synced bytes={d['mas/rollout/weight_bytes']:.0f}")
        # Base + adapter in the actor vs the rollout's base + the same adapter: equal up to float rounding.
        for policy in CHAIN:
            assert d[f"policy/{policy}/training/rollout_probs_diff_mean"] < 1e-4
        assert d["policy/runner/actor/grad_norm"] == 0.0  # alpha=0: the runner's control condition
        # Every (episode, role) session (tree sampling: one episode per task, every role acts from turn 0) stayed
        # on one replica, and the sessions spread over both replicas of the one rollout.
        assert (d["mas/rollout/sessions"], d["mas/rollout/sessions_split"]) == (TASKS * len(CHAIN), 0.0)
        for policy in CHAIN:
            assert all(d[f"policy/{policy}/rollout/replica{r}/requests"] > 0 for r in range(DP))
        if m["step"] == 1:
            # The rollout served each role's K samples per turn, in one request, under that role's adapter.
            for role in CHAIN:
                assert d[f"policy/{role}/rollout/samples"] == round(K * TASKS * d[f"mas/{role}/turns"])
                assert d[f"policy/{role}/rollout/requests"] == round(TASKS * d[f"mas/{role}/turns"])
            # Before step 1, on each replica: verl's first sync sends the base once (the rollout started from dummy
            # weights) and the three adapters, then the sync at the start of training the adapters again.
            assert d["mas/rollout/weight_bytes"] == DP * (base_bytes + 2 * len(CHAIN) * adapter_bytes)
        else:  # after a step: on each replica, the adapters' tensors and nothing of the base
            assert d["mas/rollout/weight_bytes"] == DP * len(CHAIN) * adapter_bytes
            for policy in CHAIN:
                assert [d[f"policy/{policy}/rollout/replica{r}/weight_updates"] for r in range(DP)] == [1.0] * DP
    # The caller's and the courier's signal is chance: a random tiny model names the right word in ~1 % of samples
    # (one token of 82), so 128 samples of a role's step may hold none. At least one of them had some (each misses
    # both steps with ~5 % odds), and a policy's adapter moved exactly when it had.
    moved = {p: max(m["data"][f"policy/{p}/actor/grad_norm"] for m in steps) > 0 for p in ("caller", "courier")}
    assert any(moved.values()), moved

    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    # One checkpoint for all policies (one module), each adapter also on its own in the PEFT format.
    assert not any((run_dir / "checkpoints" / "global_step_2" / f"actor_{p}").exists() for p in CHAIN)
    saved = _weights(ckpt / "huggingface")  # peft layout: base_layer + lora_A/lora_B of every adapter
    frozen = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
              for k, v in saved.items() if "lora_" not in k}
    # Gathered from two shards, the tied lm_head is written as a tensor of its own (one rank writes both as one):
    # it must still be the embedding.
    assert torch.equal(frozen.pop("lm_head.weight"), base["model.embed_tokens.weight"])
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)  # base untouched
    adapters = {p: load_file(str(ckpt / "adapters" / p / "adapter_model.safetensors")) for p in CHAIN}
    assert {p: sum(t.numel() * t.element_size() for t in a.values()) for p, a in adapters.items()} == {
        p: adapter_bytes for p in CHAIN}
    # B starts at zero: the runner's adapter (zero advantage) is still zero, the caller's and the courier's are not.
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters["runner"].items() if "lora_B" in k)
    for policy in ("caller", "courier"):
        assert (sum(int(torch.count_nonzero(v)) for k, v in adapters[policy].items() if "lora_B" in k) > 0) == \
            moved[policy], policy
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run_dir / "model"),
                                           str(ckpt / "adapters" / "caller"))
    assert peft_model.peft_config["default"].r == 8

    # Kill and resume: every adapter's optimiser continues its count on both ranks (one mini-batch a step: Adam's
    # step is 2 in the step-2 checkpoint; an adapter restarted from scratch would have 1). The resumed step drops
    # the zero-variance groups (mas.drop_zero_variance): a policy without signal takes no optimiser step at all
    # (Adam would still move it on zero gradients through its momentum): its count stays 2 and it logs no update
    # metrics that step, while a policy with signal goes to 3. The runner (alpha=0: every group flat) never has any.
    # The resumed step samples K=16 a group (one optimiser step a training step still), so that the caller or the
    # courier has signal in it but for odds of ~1e-5 (with K=4, both had none in ~5 % of runs).
    resumed = _run(run_dir, recipe_runs.relay_shape, *lora, "trainer.total_training_steps=3", "trainer.save_freq=3",
                   "mas.drop_zero_variance=true", "mas.branching=16", workflow="relay-chain-v0")
    assert [m["step"] for m in resumed if "mas/success_rate" in m["data"]] == [3]
    step3 = next(m["data"] for m in resumed if "mas/success_rate" in m["data"])
    # A fresh rollout of two replicas: the base once on each
    assert step3["mas/rollout/weight_bytes"] == DP * (base_bytes + 2 * len(CHAIN) * adapter_bytes)
    updated = [p for p in CHAIN if f"policy/{p}/actor/grad_norm" in step3]
    assert updated and "runner" not in updated and step3["mas/drop/no_signal"] == len(CHAIN) - len(updated)
    assert all(recipe_runs.gap(step3, p) < 1e-4 for p in updated) and step3["policy/runner/rollout/requests"] > 0
    for policy in CHAIN:
        assert (policy in updated) == any(k.startswith(f"policy/{policy}/actor/") for k in step3)
        for step, expected in ((2, 2.0), (3, 3.0 if policy in updated else 2.0)):
            for rank in range(DP):
                optim = torch.load(run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "adapters" / policy
                                   / f"optim_world_size_{DP}_rank_{rank}.pt", weights_only=False)["optimizer"]
                assert {float(v["step"]) for v in optim["state"].values()} == {expected}, (policy, step, rank)
    print(f"[per-role-lora] base {base_bytes} bytes resident once on {DP} ranks; {len(CHAIN) * adapter_bytes} adapter "
          f"bytes synced to each of {DP} replicas a step; across the restart optimiser steps 2 -> 3 on both ranks for "
          f"{', '.join(updated)} (signal at step 3), 2 -> 2 for the others")
