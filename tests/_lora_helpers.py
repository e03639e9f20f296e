"""Drives verl's real FSDP2 actor holding one base and two LoRA adapters (verl_mas's shared base) on the CPU.

Used by ``tests/test_shared_lora_cpu.py`` through ``_fsdp_helpers.run_scenario`` (a child interpreter with
``VERL_PLATFORM=cpu`` and a one-rank torchrun-style environment). Nothing of verl is mocked: the worker is
``verl_mas.policies.lora_worker.SharedBaseLoraWorker(role="actor")`` built from verl's own ``ppo_trainer``
config, called as verl's trainer calls it. The rollout side is verl_mas's ``hf`` engine
(``HFGenerationEngine.load_adapters``) fed with the actor's weight-sync stream.

Adapters: ``caller`` rank 4 (alpha 8, verl's "default" adapter, verl's ``clip_grad`` 1.0) and ``runner``
rank 2 (alpha 4, its own learning rate and ``clip_grad`` 1e-9). Both adapters' B matrices are set to non-zero
values before anything is checked, so a request or an update reaching the wrong adapter changes the numbers.

Writes ``WORKDIR/result.json``, the tiny model under ``WORKDIR/tiny`` and checkpoints under ``WORKDIR/ckpt``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from _fsdp_helpers import ADVANTAGES, FixedBatch, actor_overrides, scenario_main

RANKS = {"caller": 4, "runner": 2}
ALPHAS = {"caller": 8, "runner": 4}
RUNNER_LR = 2e-3
#: The runner's gradient-norm bound (the caller keeps verl's actor.optim.clip_grad, 1.0).
RUNNER_CLIP = 1e-9
#: A checkpoint key mapping as transformers models declared it (``_checkpoint_conversion_mapping``: checkpoint
#: pattern -> module name), which verl's ``convert_weight_keys`` reverses for the rollout.
CONVERSION = {"^transformer.h": "model.layers"}


def _scenario(workdir: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch
    import verl  # noqa: F401  (loads the verl_mas plugin: the cpu platform)
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_mas.backends.hf.engine import HFGenerationEngine
    from verl_mas.policies.adapters import ADAPTERS_KEY, tensors_by_adapter
    from verl_mas.policies.lora_worker import ADAPTERS_DIR, SharedBaseLoraWorker
    from verl_mas.tiny import write_tiny

    model_path = write_tiny(workdir / "tiny")
    plan = {p: {"rank": RANKS[p], "alpha": ALPHAS[p], "optim": {}} for p in RANKS}
    plan["runner"]["optim"] = {"lr": RUNNER_LR, "clip_grad": RUNNER_CLIP}

    def build(param_offload: bool = False) -> SharedBaseLoraWorker:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=[
                *actor_overrides(str(model_path), use_remove_padding=True),
                f"actor_rollout_ref.actor.fsdp_config.param_offload={param_offload}",
                f"actor_rollout_ref.model.lora_rank={RANKS['caller']}",
                f"actor_rollout_ref.model.lora_alpha={ALPHAS['caller']}",
                "actor_rollout_ref.model.target_modules=all-linear",
            ])
        with open_dict(cfg):
            cfg.actor_rollout_ref.rollout.custom = {ADAPTERS_KEY: plan}
        worker = SharedBaseLoraWorker(config=cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        return worker

    actor = build()
    engine = actor.actor.engine
    module = engine.module
    batch = FixedBatch(module.config.vocab_size)
    out: dict[str, Any] = {"engine_class": type(engine).__name__,
                           "optimizers": {p: type(o).__name__ for p, o in engine._mas_optimizers.items()},
                           "lrs": {p: o.param_groups[0]["lr"] for p, o in engine._mas_optimizers.items()}}

    # Both adapters away from zero (B = 0 at creation would hide any misrouting).
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(local.shape, generator=gen) * 0.05)
    out["report_start"] = actor.mas_adapter_report()

    # ---- log-probs per adapter, and the reference (every adapter disabled) against the bare base
    log_probs = {}
    for policy in RANKS:
        actor.mas_set_adapter(policy)
        log_probs[policy] = batch.verl_log_probs(actor)
    ref = batch.verl_log_probs(actor, no_lora_adapter=True)
    base_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    base = batch.hf_log_probs(base_model)
    out["ref_vs_base"] = (ref - base).abs().max().item()
    out["caller_vs_runner"] = (log_probs["caller"] - log_probs["runner"]).abs().max().item()
    out["caller_vs_base"] = (log_probs["caller"] - base).abs().max().item()

    # ---- the rollout side: the weight-sync stream into the hf engine, served per adapter
    tensors, peft_config = engine.get_per_tensor_param(base_sync_done=True)
    tensors = list(tensors)
    out["sync_names_without_policy"] = [n for n, _ in tensors if ":" not in n]
    by_adapter = tensors_by_adapter(tensors, RANKS, prepare=lambda t: t.detach().cpu())
    out["sync_bytes"] = {p: sum(t.numel() * t.element_size() for t in d.values()) for p, d in by_adapter.items()}
    out["sync_base_like_names"] = [n for n, _ in tensors if "lora_" not in n]
    out["base_param_bytes"] = sum(p.numel() * p.element_size() for p in base_model.parameters())
    configs = peft_config[ADAPTERS_KEY]

    def rollout_gap(tensors_by_adapter: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
        rollout = HFGenerationEngine.from_pretrained(str(model_path))
        rollout.expects_adapters = True
        rollout.load_adapters(tensors_by_adapter, configs)
        gaps = {}
        for policy in RANKS:
            rollout.model.set_adapter(policy)
            gaps[policy] = (batch.hf_log_probs(rollout.model) - log_probs[policy]).abs().max().item()
        return gaps

    out["rollout_gap"] = rollout_gap(by_adapter)
    # Negative control: each role's requests served by the other adapter (ids swapped in the rollout).
    rollout = HFGenerationEngine.from_pretrained(str(model_path))
    rollout.load_adapters(by_adapter, configs)
    rollout.model.set_adapter("runner")
    swapped = {"caller": (batch.hf_log_probs(rollout.model) - log_probs["caller"]).abs().max().item()}
    rollout.model.set_adapter("caller")
    swapped["runner"] = (batch.hf_log_probs(rollout.model) - log_probs["runner"]).abs().max().item()
    out["rollout_gap_swapped"] = swapped
    try:
        rollout.expects_adapters = True
        rollout.generate_sync([5, 6, 7], _greedy(4))
        out["request_without_adapter"] = "served"
    except ValueError as exc:
        out["request_without_adapter"] = str(exc)

    # ---- the first sync of a rollout started without weights: the base, through verl's key conversion
    out.update(_base_sync(engine, base_model))

    # ---- updates: each activates one adapter; only it (and its optimiser) may move
    reports = [actor.mas_adapter_report()]
    out["update_max_step"] = {}
    for policy in ("caller", "runner"):
        actor.mas_set_adapter(policy)
        before = _adapter_params(module, engine._peft_name(policy))
        batch.update(actor, ADVANTAGES)
        after = _adapter_params(module, engine._peft_name(policy))
        out["update_max_step"][policy] = max((after[n] - before[n]).abs().max().item() for n in before)
        reports.append(actor.mas_adapter_report())
    out["reports_updates"] = reports
    # Negative control: an update while the caller's adapter is active, meant for the runner
    actor.mas_set_adapter("caller")
    batch.update(actor, ADVANTAGES)
    reports.append(actor.mas_adapter_report())

    # ---- checkpoint: each adapter in the PEFT format, reproducing the actor's log-probs per adapter
    ckpt = workdir / "ckpt"
    actor.save_checkpoint(str(ckpt), global_step=3)
    after_save = {}
    for policy in RANKS:
        actor.mas_set_adapter(policy)
        after_save[policy] = batch.verl_log_probs(actor)
    peft_gap = {}
    peft_ranks = {}
    for policy in RANKS:
        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(fresh, str(ckpt / ADAPTERS_DIR / policy)).eval()
        peft_ranks[policy] = int(peft_model.peft_config["default"].r)
        peft_gap[policy] = (batch.hf_log_probs(peft_model) - after_save[policy]).abs().max().item()
    out["peft_gap"], out["peft_ranks"] = peft_gap, peft_ranks
    out["ckpt_files"] = sorted(str(p.relative_to(ckpt)) for p in (ckpt / ADAPTERS_DIR).rglob("*") if p.is_file())

    # ---- resume: a fresh worker loads the checkpoint; the next update matches the original's exactly. It offloads
    # its parameters between calls (param_offload, the optimiser resident): the adapters' optimiser states load with
    # the module staged on the device, as verl's own (on the CPU platform the device is the host).
    resumed = build(param_offload=True)
    out["resumed_param_offload"] = bool(resumed.actor.engine._is_offload_param)
    resumed.load_checkpoint(str(ckpt))
    out["report_saved"] = actor.mas_adapter_report()
    out["report_resumed"] = resumed.mas_adapter_report()
    for worker in (actor, resumed):
        worker.mas_set_adapter("runner")
        batch.update(worker, ADVANTAGES)
    out["report_continued"] = actor.mas_adapter_report()
    out["report_resumed_continued"] = resumed.mas_adapter_report()
    out["total_s"] = time.perf_counter() - t_start
    return out


def _adapter_params(module: Any, peft_name: str) -> dict[str, Any]:
    """Full copies of one adapter's parameters (``...lora_A.<peft name>.weight``)."""
    return {n: p.detach().full_tensor().clone() for n, p in module.named_parameters() if f".{peft_name}." in n}


def _base_sync(engine: Any, base_model: Any) -> dict[str, Any]:
    """What the first sync (``base_sync_done=False``) sends and when it gathers each full tensor.

    ``DTensor.full_tensor`` is counted (restored afterwards): the sync gathers a base tensor when the rollout
    reads it, so after receiving k tensors k have been gathered and none of the k - 1 earlier ones is still
    alive (the rollout dropped them). Then the same sync with :data:`CONVERSION` declared on the model.
    """
    import gc
    import inspect
    import weakref

    from torch.distributed.tensor import DTensor

    gathered = [0]
    full_tensor = DTensor.full_tensor

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        gathered[0] += 1
        return full_tensor(self, *args, **kwargs)

    reference = base_model.state_dict()
    out: dict[str, Any] = {}
    DTensor.full_tensor = counting
    try:
        stream, _ = engine.get_per_tensor_param(base_sync_done=False)
        out["base_sync_is_generator"] = inspect.isgenerator(stream)
        out["base_sync_gathered_at_return"] = gathered[0]
        steps, earlier, names, worst = [], [], [], 0.0
        for name, tensor in stream:
            gc.collect()
            steps.append([gathered[0], sum(ref() is not None for ref in earlier)])
            names.append(name)
            if name in reference:
                worst = max(worst, (tensor - reference[name]).abs().max().item())
            earlier.append(weakref.ref(tensor))
            del tensor
        out["base_sync_steps"], out["base_sync_names"], out["base_sync_max_diff"] = steps, names, worst
    finally:
        DTensor.full_tensor = full_tensor
    out["base_model_names"] = sorted(reference)
    out["adapter_sync_names"] = [n for n, _ in engine.get_per_tensor_param(base_sync_done=True)[0]]
    hf_model = engine._peft_model().base_model.model
    hf_model._checkpoint_conversion_mapping = CONVERSION
    try:
        out["base_sync_names_converted"] = [n for n, _ in engine.get_per_tensor_param(base_sync_done=False)[0]]
        out["adapter_sync_names_converted"] = [n for n, _ in engine.get_per_tensor_param(base_sync_done=True)[0]]
    finally:
        del hf_model._checkpoint_conversion_mapping
    return out


def _greedy(max_tokens: int) -> Any:
    from verl_mas.backends.hf.engine import SamplingSettings

    return SamplingSettings(max_tokens=max_tokens, temperature=0.0)


if __name__ == "__main__":
    sys.exit(scenario_main(_scenario, sys.argv))
