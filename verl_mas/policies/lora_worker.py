"""verl's actor worker holding one base model and one LoRA adapter per policy (``mas.lora_base: shared``).

:class:`SharedBaseLoraWorker` is verl's ``ActorRolloutRefWorker`` with its actor's ``TrainingWorker`` swapped
for :class:`MultiAdapterTrainingWorker` (verl's ``actor_worker_cls`` hook), whose FSDP engine gets the
:class:`MultiAdapterEngine` mixin before the model is built. The mixin, over verl's own engine:

- creates one adapter per policy on the one base, before FSDP wraps the model: verl creates the first
  policy's (peft's ``"default"``), the mixin adds the others with the same target modules and each
  policy's rank and alpha;
- builds one optimiser and one learning-rate schedule per adapter, over that adapter's parameters only
  (each policy's ``actor.optim`` overrides applied), so an update moves one adapter and nothing else;
- :meth:`MultiAdapterEngine.mas_activate` makes a policy's adapter the one that forwards, and its optimiser,
  schedule and optimiser config (``clip_grad``, read by verl's ``optimizer_step``) the ones verl's update
  uses; the trainer calls it (``mas_set_adapter``) before every per-policy log-prob and update. verl's
  reference log-probs run with every adapter disabled: the base;
- streams, for the rollout's weight sync, every adapter's tensors (``"<policy>:<peft key>"``) and nothing of
  the base; the base is sent once, only when the rollout started without weights (``load_format: dummy``),
  one full tensor at a time (:func:`base_tensors`). Both go through verl's key conversion;
- saves, next to verl's checkpoint of the whole module, each adapter in the PEFT format
  (``adapters/<policy>/``: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
  ``peft.PeftModel.from_pretrained`` onto the base) with its optimiser and schedule state, and loads them back.

The rest (loss, micro-batching, FSDP, offload) is verl's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from verl_mas.policies.adapters import ADAPTERS_KEY, FIRST_ADAPTER, adapter_tensor_name

logger = logging.getLogger(__name__)

__all__ = ["ADAPTERS_DIR", "MultiAdapterEngine", "MultiAdapterTrainingWorker", "SharedBaseLoraWorker", "base_tensors"]

#: Folder, inside an actor checkpoint, of the per-adapter PEFT exports and optimiser states.
ADAPTERS_DIR = "adapters"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach()


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    # As verl's own sync: the shard goes to the device first (it may be offloaded to the CPU), then the
    # ranks gather the full tensor there.
    if isinstance(tensor, DTensor):
        from verl.utils.device import get_device_id

        return tensor.to(get_device_id(), non_blocking=True).full_tensor()
    return tensor.detach()


def base_tensors(state: Mapping[str, torch.Tensor], model: Any, model_type: str | None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors for a rollout started without weights, gathered one at a time on demand.

    Each name goes through what verl's own weight sync applies: peft's wrapper names stripped and the adapters'
    tensors left out (``normalize_peft_param_name``), the model's checkpoint key mapping reversed
    (``convert_weight_keys``: the rollout loads checkpoint names), and fused MoE experts split into per-expert
    tensors (``unfuse_moe_params``). A tensor is moved to the device and gathered only when the consumer asks
    for the next one, so a rank holds one full base tensor at a time instead of the whole base (an 8B model
    is ~32 GB in fp32).

    Args:
        state: The peft module's state dict; under FSDP2 references to each rank's shards (nothing gathered).
        model: The peft model whose key mapping ``convert_weight_keys`` reads.
        model_type: ``hf_config.model_type`` (``unfuse_moe_params`` keeps GPT-OSS experts packed).
    """
    from verl.utils.fsdp_utils import normalize_peft_param_name
    from verl.utils.model import convert_weight_keys
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    named = convert_weight_keys(normalize_peft_param_name(dict(state)), model)  # renames only: still shards
    return unfuse_moe_params(((name, _gathered(t)) for name, t in named.items()), model_type)


class MultiAdapterEngine:
    """Mixin over verl's FSDP engine class: one LoRA adapter per policy on one base (module docstring).

    ``mas_adapters`` (policy -> ``{"rank", "alpha", "optim"}``, first policy first) is set on the instance
    before verl's ``initialize`` builds the model.
    """

    mas_adapters: dict[str, dict[str, Any]]

    # ---- names ----
    @property
    def mas_policies(self) -> list[str]:
        return list(self.mas_adapters)

    def _peft_name(self, policy: str) -> str:
        return FIRST_ADAPTER if policy == self.mas_policies[0] else policy

    def _peft_model(self) -> Any:
        return getattr(self.module, "_fsdp_wrapped_module", self.module)

    # ---- building (called by verl's _build_model_optimizer) ----
    def _build_lora_module(self, module: Any) -> Any:
        module = super()._build_lora_module(module)  # verl: the first policy's adapter, named "default"
        first = module.peft_config[FIRST_ADAPTER]
        for policy in self.mas_policies[1:]:
            spec = self.mas_adapters[policy]
            config = dataclasses.replace(first, r=int(spec["rank"]), lora_alpha=int(spec["alpha"]))
            module.add_adapter(policy, config)
        base_dtype = next((p.dtype for n, p in module.named_parameters() if "lora_" not in n), None)
        for name, param in module.named_parameters():
            if "lora_" in name:
                param.requires_grad_(True)  # every adapter trainable; peft leaves only the active one so
                if base_dtype is not None and param.dtype != base_dtype:
                    param.data = param.data.to(base_dtype)  # FSDP: one dtype per parameter group
        module.set_adapter(FIRST_ADAPTER)
        self._restore_requires_grad(module)
        return module

    @staticmethod
    def _restore_requires_grad(module: Any) -> None:
        # peft's set_adapter freezes the inactive adapters; keep all of them trainable (their gradients stay
        # None while they do not forward, and each has its own optimiser).
        for name, param in module.named_parameters():
            if "lora_" in name and not param.requires_grad:
                param.requires_grad_(True)

    def _adapter_parameters(self, module: Any) -> dict[str, list[torch.nn.Parameter]]:
        by_peft = {self._peft_name(p): p for p in self.mas_policies}
        groups: dict[str, list[torch.nn.Parameter]] = {p: [] for p in self.mas_policies}
        stray = []
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            parts = name.split(".")
            owner = next((by_peft[parts[i + 1]] for i, part in enumerate(parts[:-1])
                          if part.startswith("lora_") and parts[i + 1] in by_peft), None)
            if owner is None:
                stray.append(name)
            else:
                groups[owner].append(param)
        empty = [p for p, params in groups.items() if not params]
        if stray or empty:
            raise RuntimeError(
                f"The shared LoRA base found trainable parameters outside the adapters ({stray[:3]}) or adapters "
                f"without parameters ({empty}). Every trainable parameter must belong to one policy's adapter "
                "(no modules_to_save); check actor_rollout_ref.model.target_modules."
            )
        return groups

    def _build_optimizer(self, module: Any) -> Any:
        from verl.workers.config.optimizer import build_optimizer

        self._mas_optim_configs = {
            p: dataclasses.replace(self.optimizer_config, **dict(self.mas_adapters[p].get("optim") or {}))
            for p in self.mas_policies
        }
        self._mas_optimizers = {p: build_optimizer(params, self._mas_optim_configs[p])
                                for p, params in self._adapter_parameters(module).items()}
        self.mas_active = self.mas_policies[0]
        return self._mas_optimizers[self.mas_active]

    def _build_lr_scheduler(self, optimizer: Any) -> Any:
        configured = self.optimizer_config
        self._mas_schedulers = {}
        try:
            for policy, opt in self._mas_optimizers.items():
                object.__setattr__(self, "optimizer_config", self._mas_optim_configs[policy])
                self._mas_schedulers[policy] = super()._build_lr_scheduler(opt)
        finally:
            object.__setattr__(self, "optimizer_config", configured)
        return self._mas_schedulers[self.mas_active]

    # ---- the active adapter ----
    def mas_activate(self, policy: str) -> None:
        """Forward with ``policy``'s adapter; verl's optimiser step, schedule and optimiser config are that
        adapter's (``optimizer_step`` clips the gradients with ``optimizer_config.clip_grad``)."""
        if policy not in self.mas_adapters:
            raise KeyError(f"policy {policy!r} has no adapter on this shared base (adapters: {self.mas_policies})")
        model = self._peft_model()
        model.set_adapter(self._peft_name(policy))
        self._restore_requires_grad(model)
        self.optimizer = self._mas_optimizers[policy]
        self.lr_scheduler = self._mas_schedulers[policy]
        self.optimizer_config = self._mas_optim_configs[policy]
        self.mas_active = policy

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        super().to(device=device, model=model, optimizer=False, grad=grad)
        if not optimizer or self.engine_config.forward_only:
            return
        from verl.utils.fsdp_utils import load_fsdp_optimizer, offload_fsdp_optimizer

        for opt in self._mas_optimizers.values():
            if device == "cpu":
                offload_fsdp_optimizer(opt)
            else:
                load_fsdp_optimizer(opt, device)

    # ---- weight sync ----
    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any) -> Any:
        """Every adapter's tensors as ``("<policy>:<peft key>", tensor)``; the base only when not yet synced.

        Returns verl's pair ``(tensors, peft_config)``; ``peft_config`` is ``{ADAPTERS_KEY: {policy: peft
        config dict}}``, which the rollout uses to create the adapters on its copy of the base. The base
        (``base_sync_done=False``) is a generator gathering one tensor at a time (:func:`base_tensors`); the
        adapters are small and gathered here. Adapter keys go through verl's ``convert_weight_keys`` as verl's
        own LoRA sync sends them.
        """
        from peft.utils.save_and_load import get_peft_model_state_dict
        from verl.utils.model import convert_weight_keys

        model = self._peft_model()
        configs = {p: model.peft_config[self._peft_name(p)].to_dict() for p in self.mas_policies}
        for config in configs.values():  # sets (target modules) as lists: the rollout rebuilds LoraConfigs from them
            for key, value in list(config.items()):
                if isinstance(value, set):
                    config[key] = sorted(value)
        if not base_sync_done:  # the rollout started without weights: the base, once (adapters follow)
            # FSDP2's state dict refers to the shards (offloaded or not); each is gathered when it is read.
            state = self.module.state_dict()
            return base_tensors(state, model, self.model_config.hf_config.model_type), {ADAPTERS_KEY: configs}
        with self._module_on_device():
            state = self.module.state_dict()
            tensors = [  # adapters are small: gathered here, while the module is staged
                (adapter_tensor_name(policy, key), _full(t))
                for policy in self.mas_policies
                for key, t in convert_weight_keys(
                    get_peft_model_state_dict(model, state_dict=state, adapter_name=self._peft_name(policy)),
                    model).items()
            ]
        return iter(tensors), {ADAPTERS_KEY: configs}

    @contextlib.contextmanager
    def _module_on_device(self) -> Iterator[None]:
        """The module on the device for the block, as verl stages it for its own reads and loads: with
        ``param_offload`` it lives on the host between calls (verl moves it there with a non-blocking copy)."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

        staged = self._is_offload_param and not self._uses_fsdp2_cpu_offload_policy
        if staged:
            load_fsdp_model_to_gpu(self.module)
        try:
            yield
        finally:
            if staged:
                offload_fsdp_model_to_cpu(self.module)

    # ---- checkpoints ----
    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs: Any) -> None:
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)
        from peft.utils.save_and_load import get_peft_model_state_dict
        from safetensors.torch import save_file

        manager = self.checkpoint_manager
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        model = self._peft_model()
        # verl's save has offloaded the module again (a non-blocking copy to the host): read the adapters with it
        # staged on the device, as verl's own save reads, so that no shard is read mid-copy.
        with self._module_on_device():
            state = self.module.state_dict()  # collective under FSDP: every rank gathers
            for policy in self.mas_policies:
                folder = os.path.join(local_path, ADAPTERS_DIR, policy)
                os.makedirs(folder, exist_ok=True)
                peft_name = self._peft_name(policy)
                tensors = {k: _full(v).cpu().contiguous() for k, v in
                           get_peft_model_state_dict(model, state_dict=state, adapter_name=peft_name).items()}
                if rank == 0 and manager.should_save_model:
                    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
                    config = model.peft_config[peft_name]
                    config.save_pretrained(folder)
                    with open(os.path.join(folder, "mas_adapter.json"), "w") as f:
                        json.dump({"policy": policy, "global_step": int(global_step), "rank": int(config.r),
                                   "lora_alpha": int(config.lora_alpha)}, f, indent=2)
                if manager.should_save_optimizer or manager.should_save_extra:
                    torch.save({"optimizer": self._mas_optimizers[policy].state_dict(),
                                "lr_scheduler": self._mas_schedulers[policy].state_dict()},
                               os.path.join(folder, f"optim_world_size_{world}_rank_{rank}.pt"))
        torch.distributed.barrier()

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **kwargs: Any) -> None:
        super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)  # the module: every adapter
        manager = self.checkpoint_manager
        if not (manager.should_load_optimizer or manager.should_load_extra):
            return
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        missing = [p for p in self.mas_policies if not os.path.isfile(
            os.path.join(local_path, ADAPTERS_DIR, p, f"optim_world_size_{world}_rank_{rank}.pt"))]
        if missing:
            raise FileNotFoundError(
                f"{local_path} holds no optimiser state for adapters {missing} ({ADAPTERS_DIR}/<policy>/). It was "
                "saved by a run with other mas.policies or world size; resume with the same ones, or start fresh "
                "(trainer.resume_mode=disable)."
            )
        from verl.utils.fsdp_utils import offload_fsdp_optimizer

        # torch's load_state_dict puts each optimiser state beside its parameter: load with the module on the device,
        # as verl loads its own optimiser (its load has offloaded the module again), so that with param_offload and
        # a resident optimiser the states are on the device when the update runs; then offload them as verl does.
        with self._module_on_device():
            for policy in self.mas_policies:
                state = torch.load(os.path.join(local_path, ADAPTERS_DIR, policy,
                                                f"optim_world_size_{world}_rank_{rank}.pt"), weights_only=False)
                if manager.should_load_optimizer:
                    self._mas_optimizers[policy].load_state_dict(state["optimizer"])
                if manager.should_load_extra:
                    self._mas_schedulers[policy].load_state_dict(state["lr_scheduler"])
        if self._is_offload_optimizer and manager.should_load_optimizer:
            for opt in self._mas_optimizers.values():
                offload_fsdp_optimizer(opt)
        self.mas_activate(self.mas_active)

    # ---- diagnostics (tests, benchmarks) ----
    def mas_adapter_report(self) -> dict[str, Any]:
        """Checksums of the base and of each adapter, each adapter's optimiser step count, the resident
        parameter bytes and the active adapter."""
        model = self._peft_model()
        base = torch.zeros((), dtype=torch.float64)
        per: dict[str, torch.Tensor] = {p: torch.zeros((), dtype=torch.float64) for p in self.mas_policies}
        nonzero = dict.fromkeys(self.mas_policies, 0)
        resident = 0
        by_peft = {self._peft_name(p): p for p in self.mas_policies}
        for name, param in model.named_parameters():
            full = _full(param).double()
            resident += param.numel() * param.element_size()
            weighted = (full.flatten() * torch.arange(1, full.numel() + 1, dtype=torch.float64).sin()).sum()
            owner = next((by_peft[s] for s in name.split(".") if s in by_peft), None) if "lora_" in name else None
            if owner is None:
                base += weighted
            else:
                per[owner] += weighted
                nonzero[owner] += int(torch.count_nonzero(full))
        steps = {}
        for policy, opt in self._mas_optimizers.items():
            counts = [int(s["step"]) for s in opt.state.values() if "step" in s]
            steps[policy] = max(counts) if counts else 0
        return {"base": float(base), "adapters": {p: float(v) for p, v in per.items()}, "nonzero": nonzero,
                "optimizer_steps": steps, "resident_param_bytes": int(resident), "active": self.mas_active}


@functools.cache
def _with_adapters(engine_cls: type) -> type:
    return type(f"MultiAdapter{engine_cls.__name__}", (MultiAdapterEngine, engine_cls), {})


class MultiAdapterTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` whose engine holds one adapter per policy (:class:`MultiAdapterEngine`).

    verl creates the engine in ``__init__`` and builds its model in ``reset``; in between, the engine
    instance becomes an instance of its class with the mixin (same state, nothing built yet).
    """

    def __init__(self, config: Any, adapters: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__(config)
        if not getattr(self.engine, "_is_lora", False):
            raise ValueError("A shared LoRA base needs actor_rollout_ref.model.lora_rank > 0 on the first policy.")
        self.engine.__class__ = _with_adapters(type(self.engine))
        self.engine.mas_adapters = {str(p): dict(spec) for p, spec in adapters.items()}


class SharedBaseLoraWorker(ActorRolloutRefWorker):
    """verl's actor/rollout worker of a shared LoRA base (module docstring); the adapters come from
    ``actor_rollout_ref.rollout.custom.mas_adapters`` (:mod:`verl_mas.policies.adapters`)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from omegaconf import OmegaConf

        custom = self.config.rollout.get("custom", None) or {}
        adapters = custom.get(ADAPTERS_KEY, None)
        if not adapters:
            raise ValueError(
                f"SharedBaseLoraWorker needs actor_rollout_ref.rollout.custom.{ADAPTERS_KEY} (the mas trainer sets it "
                "when every policy is a LoRA adapter on one base)."
            )
        plain = OmegaConf.to_container(adapters, resolve=True) if OmegaConf.is_config(adapters) else adapters
        self.actor_worker_cls = functools.partial(MultiAdapterTrainingWorker, adapters=plain)
        super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mas_set_adapter(self, policy: str) -> None:
        self.actor.engine.mas_activate(policy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mas_adapter_report(self) -> dict[str, Any]:
        return self.actor.engine.mas_adapter_report()


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
