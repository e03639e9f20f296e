"""Models vLLM's CPU attention can serve: the start-up check (verl_mas.backends.vllm.support) and the CPU recipes'
tiny model for ``cpu_rollout=vllm``. Runs in the main environment: nothing here imports vLLM.

vLLM 0.24's CPU attention has kernels for head sizes 32, 64, 80, ... only and finds out at the engine's first
request ("Unsupported CPU attention configuration: head_dim=16"); the run then died minutes later with an
``EngineDeadError``. verl_mas.tiny's models have 4 heads, so head size = hidden size / 4: the default (hidden 64)
is 16, hidden 128 is 32.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_mas.backends.vllm.support import CPU_ATTENTION_HEAD_SIZES, cpu_attention_problems, head_size
from verl_mas.config import MasConfig
from verl_mas.policies import policy_configs_and_problems
from verl_mas.tiny import write_tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny models by head size: hidden 64 / 4 heads = 16 (refused), hidden 128 / 4 heads = 32 (served)."""
    root = tmp_path_factory.mktemp("heads")
    return {16: write_tiny(root / "h16", hidden_size=64, num_hidden_layers=1),
            32: write_tiny(root / "h32", hidden_size=128, num_hidden_layers=1)}


@pytest.fixture(autouse=True)
def _no_platform_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERL_PLATFORM", raising=False)  # each test says which device it runs on


def _run(model: Path | str, *, rollout: str = "vllm", device: str = "cpu",
         policies: dict | None = None) -> tuple[object, dict]:
    """A run config shaped like verl's (the keys the check reads) and each policy's actor_rollout_ref, formed as
    verl_mas's start-up forms them."""
    policies = policies or {"default": {}}
    config = OmegaConf.create({
        "trainer": {"device": device},
        "actor_rollout_ref": {"model": {"path": str(model)}, "rollout": {"name": rollout}},
        "mas": {"policies": policies, "roles": {name: {"policy": name} for name in policies}},
    })
    mas, problems = MasConfig.parse(config.mas)
    configs, override_problems = policy_configs_and_problems(config.actor_rollout_ref, mas)
    assert problems == override_problems == []
    return config, configs


def test_a_model_whose_head_size_vllms_cpu_attention_refuses_is_named_with_the_fix(models: dict[int, Path]) -> None:
    config, configs = _run(models[16])
    problems = cpu_attention_problems(config, configs)
    assert problems == cpu_attention_problems(config)  # the same without the per-policy configs
    assert len(problems) == 1
    message = problems[0]
    for part in (f"actor_rollout_ref.model.path (policy 'default') is '{models[16]}'",  # what
                 "attention head size 16",
                 "head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only",  # why
                 "'Unsupported CPU attention configuration: head_dim=16'",
                 "python -m verl_mas.tiny --out DIR --hidden-size 128", "cpu_rollout=hf"):  # fix
        assert part in message, (part, message)
    # Control: head size 32 is served.
    assert cpu_attention_problems(*_run(models[32])) == []


def test_only_vllm_on_the_cpu_platform_is_checked(models: dict[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_attention_problems(*_run(models[16], rollout="hf")) == []  # the hf rollout serves any head size
    assert cpu_attention_problems(*_run(models[16], device="cuda")) == []  # GPU attention kernels are not these
    # VERL_PLATFORM=cpu selects the CPU platform whatever trainer.device says.
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert len(cpu_attention_problems(*_run(models[16], device="cuda"))) == 1


def test_every_policys_model_is_checked_once_naming_the_key_that_sets_it(models: dict[int, Path]) -> None:
    # One model per role, the runner's of its own (mas.policies.runner.model.path): only it is refused.
    config, configs = _run(models[32], policies={"caller": {}, "runner": {"model": {"path": str(models[16])}}})
    problems = cpu_attention_problems(config, configs)
    assert len(problems) == 1 and problems[0].startswith(
        f"mas.policies.runner.model.path (policy 'runner') is '{models[16]}', a model with attention head size 16")
    # Both policies on the recipe's model: one message for the model, naming the key and both policies.
    config, configs = _run(models[16], policies={"caller": {}, "runner": {}})
    problems = cpu_attention_problems(config, configs)
    assert len(problems) == 1 and problems[0].startswith(
        f"actor_rollout_ref.model.path (policies 'caller', 'runner') is '{models[16]}', a model with attention head")
    # The runner's path set to the recipe's model (as per_role_models.yaml did): both keys named, once.
    same = {"caller": {}, "runner": {"model": {"path": "${actor_rollout_ref.model.path}"}}}
    config, configs = _run(models[16], policies=same)
    problems = cpu_attention_problems(config, configs)
    assert len(problems) == 1 and problems[0].startswith(
        "actor_rollout_ref.model.path (policy 'caller') and mas.policies.runner.model.path (policy 'runner') is ")
    # Control: both policies on a model vLLM serves.
    assert cpu_attention_problems(*_run(models[32], policies=same)) == []


def test_the_head_size_is_read_as_vllm_reads_it(models: dict[int, Path], tmp_path: Path) -> None:
    assert head_size(json.loads((models[16] / "config.json").read_text())) == 64 // 4 == 16
    assert head_size(json.loads((models[32] / "config.json").read_text())) == 128 // 4 == 32
    # An explicit head_dim wins over hidden_size / heads (Qwen3, Gemma: 1024 / 16 = 64 but head_dim 128).
    assert head_size({"hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}) == 128
    assert head_size({"hidden_size": 1024, "num_attention_heads": 16, "head_dim": None}) == 64
    # A multimodal model's language model sizes the attention.
    assert head_size({"hidden_size": 4096, "text_config": {"hidden_size": 64, "num_attention_heads": 4}}) == 16
    # Multi-head latent attention sizes its heads otherwise: not judged here.
    assert head_size({"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 512}) is None
    # A config.json with head_dim 32 on the 16-wide shape is served; the check reads the file, not the shape.
    edited = tmp_path / "edited"
    edited.mkdir()
    cfg = json.loads((models[16] / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, "head_dim": 32}))
    assert cpu_attention_problems(*_run(edited)) == []
    assert 16 not in CPU_ATTENTION_HEAD_SIZES and 32 in CPU_ATTENTION_HEAD_SIZES
    # A hub id has no local config.json: not checked (verl downloads it; vLLM then judges it).
    assert cpu_attention_problems(*_run("Qwen/Qwen2.5-0.5B-Instruct")) == []


#: Stands in for python in a recipe: runs everything but verl's trainer, whose arguments it records.
STUB = """#!/usr/bin/env bash
if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then printf '%s\\n' "$@" > "$VERL_MAS_RUN_DIR/main_ppo_args"
  printf '%s' "${{VLLM_CPU_OMP_THREADS_BIND-unset}}" > "$VERL_MAS_RUN_DIR/main_ppo_thread_binding"; exit 0; fi
exec {python} "$@"
"""


def _recipe_model(recipe: str, run_dir: Path, stub: Path, *overrides: str) -> Path:
    """The model path a CPU recipe hands verl's trainer for ``overrides`` (the trainer itself is not run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(PYTHON=str(stub), VERL_MAS_RUN_DIR=str(run_dir), TRAIN_TASKS="2", TEST_TASKS="1")
    proc = subprocess.run(["bash", str(REPO / "recipes" / recipe / "run.sh"), *overrides], cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    args = (run_dir / "main_ppo_args").read_text().splitlines()
    return Path(next(a for a in args if a.startswith("actor_rollout_ref.model.path=")).split("=", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["at_grpo_cpu", "grpo_cpu_smoke"])
def test_the_cpu_recipes_build_a_model_the_selected_rollout_serves(recipe: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's command (``run.sh cpu_rollout=vllm``) gets a model vLLM's CPU attention serves, also in a run
    directory where an hf run left its model (head size 16), and with one model per role; at tensor parallel 2 the
    thread binding vLLM needs on a machine of one NUMA node."""
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    run_dir = tmp_path / "run"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # checked below
    hf_model = _recipe_model(recipe, run_dir, stub)
    per_role = ("mas_policies=per_role_models",) if recipe == "at_grpo_cpu" else ()  # as a new user tried it
    vllm_model = _recipe_model(recipe, run_dir, stub, "cpu_rollout=vllm", *per_role)
    sizes = [head_size(json.loads((p / "config.json").read_text())) for p in (hf_model, vllm_model)]
    assert sizes == [16, 32]  # hf keeps the measured quickstart model
    assert hf_model == run_dir / "model" and vllm_model == run_dir / "model-h128"  # a directory per shape
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    # per_role_models.yaml: the runner's model is the recipe's
    policies = {"caller": {}, "runner": {"model": {"path": "${actor_rollout_ref.model.path}"}}} if per_role else None
    assert cpu_attention_problems(*_run(vllm_model, policies=policies)) == []
    # Negative control: the hf model left in the run directory would have been refused for vLLM.
    assert len(cpu_attention_problems(*_run(hf_model, policies=policies))) == 1
    # Hydra's other spellings of the choice select the same model.
    for override in ("+cpu_rollout=vllm", "actor_rollout_ref.rollout.name=vllm"):
        assert _recipe_model(recipe, run_dir, stub, override) == vllm_model
    # vLLM's thread binding (recipes/cpu_common.sh): left to vLLM at tensor parallel 1 (the call above), to the OS
    # at tensor parallel 2 (vLLM would refuse two TP workers on a machine of one NUMA node), a user's own kept.
    binding = run_dir / "main_ppo_thread_binding"
    assert binding.read_text() == "unset"
    tp2 = ("cpu_rollout=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert _recipe_model(recipe, run_dir, stub, *tp2) == vllm_model and binding.read_text() == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert _recipe_model(recipe, run_dir, stub, *tp2) == vllm_model and binding.read_text() == "0|1"
