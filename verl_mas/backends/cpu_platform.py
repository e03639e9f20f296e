"""The ``cpu`` platform for verl: device ``cpu``, collectives over ``gloo``, selected with ``VERL_PLATFORM=cpu``.

verl 0.9.1 ships CUDA, NPU and ROCm platforms only and, with no accelerator present, falls back to
"nvidia" (device ``cuda``, backend ``nccl``). Registering this platform lets verl's real trainer, FSDP2
engine, Ray single controller and agent loops run on a CPU-only machine: for developing workflows on a
laptop and for CI. Nothing changes for a user who does not set ``VERL_PLATFORM=cpu``.

Three small pieces beyond the platform class itself, each pinned to verl 0.9.1 and covered by a test
that fails when verl changes under it:

- a device-module shim answering the ``torch.cuda``-style calls verl makes (``empty_cache``,
  ``mem_get_info``, RNG state, streams, ...) for the CPU;
- the process-group backend: verl builds ``f"cpu:gloo,{device}:{backend}"``, which for device ``cpu``
  is ``cpu:gloo,cpu:gloo`` and is rejected by torch ("Duplicate device type cpu"); the CPU platform
  makes verl's default ``cpu:gloo``;
- engine lookup: verl registers its FSDP/FSDP2 engines for ``cuda`` and ``npu`` only, although FSDP2
  runs on CPU parameters; the platform sets verl's ``VERL_ENGINE_DEVICE`` override to find them;
- FSDP2's CPU offload policy: verl's engine builds forward-only models (the reference policy) with
  ``CPUOffloadPolicy(pin_memory=True)``, and pinning memory needs an accelerator; on the CPU platform the
  policy never pins (the parameters already live in host memory).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import psutil
import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

logger = logging.getLogger(__name__)

#: The value of ``VERL_PLATFORM`` that selects this platform.
PLATFORM_NAME = "cpu"


def cpu_platform_selected() -> bool:
    """Whether this process runs verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


class _CPUStream:
    """A stand-in for a device stream: CPU work is synchronous, so streams are ordering no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CPUEvent:
        return event or _CPUEvent()

    def __enter__(self) -> _CPUStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _CPUEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CPUDeviceModule(ModuleType):
    """The ``torch.<device>``-style module verl calls through ``get_torch_device()`` on the CPU.

    Memory figures come from psutil (host RAM), RNG state from torch's CPU generator; cache and
    stream operations are no-ops because CPU tensors are freed eagerly and run synchronously.
    Anything else is looked up on ``torch.cpu``.
    """

    Stream = _CPUStream
    Event = _CPUEvent

    def __init__(self) -> None:
        super().__init__("verl_mas.backends.cpu_platform.device")

    # ---- device selection (there is one CPU "device") ----
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> str:
        # As torch.cpu.current_device(): verl passes this to .to(...)/device=..., where 0 means cuda:0.
        return "cpu"

    def set_device(self, device: Any) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def synchronize(self, device: Any = None) -> None:
        pass

    # ---- streams ----
    def current_stream(self, device: Any = None) -> _CPUStream:
        return _CPUStream()

    def stream(self, stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    # ---- memory ----
    def empty_cache(self) -> None:
        pass

    def ipc_collect(self) -> None:
        pass

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        pass

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self, device: Any = None) -> int:
        return int(psutil.Process().memory_info().rss)

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    # ---- RNG ----
    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only machines (device ``cpu``, collective backend ``gloo``).

    Never auto-detected: it is used only when ``VERL_PLATFORM=cpu`` is set, so installing verl_mas
    changes nothing on GPU machines.
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Auto-detection must never pick the CPU over a real accelerator: opt-in only.
        return cpu_platform_selected()

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this to .to(...) and device=...; the integer 0 would mean cuda:0.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the logical GPU slots it hands out; nothing reads it on CPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # verl's resource pools ask Ray for "GPU" bundles; on CPU they are logical slots
        # (ray_init.num_gpus=N), one per trainer rank.
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# --------------------------------------------------------------------------------------------------
# Process-group backend: verl 0.9.1 builds f"cpu:gloo,{device}:{backend}", invalid for device "cpu".
# --------------------------------------------------------------------------------------------------

#: The backend string torch accepts for a CPU-only process group.
CPU_PROCESS_GROUP_BACKEND = "cpu:gloo"


def _patch_process_group_backend() -> None:
    """Make verl's process-group helpers default to ``cpu:gloo`` on the CPU platform.

    Must run before ``verl.workers.engine_workers`` binds the helper by name, i.e. at plugin load
    (``import verl``). The wrappers change nothing unless the platform's device is ``cpu``.
    """
    from verl.utils import distributed

    if getattr(distributed.initialize_global_process_group_ray, "_verl_mas_cpu", False):
        return
    original_ray = distributed.initialize_global_process_group_ray

    @functools.wraps(original_ray)
    def initialize_global_process_group_ray(timeout_second: int | None = None, backend: str | None = None) -> Any:
        if backend is None and _device_is_cpu():
            backend = CPU_PROCESS_GROUP_BACKEND
        return original_ray(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._verl_mas_cpu = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray

    original_plain = distributed.initialize_global_process_group

    @functools.wraps(original_plain)
    def initialize_global_process_group(timeout_second: int = 36000) -> Any:
        if not _device_is_cpu():
            return original_plain(timeout_second=timeout_second)
        # verl's version hard-codes the invalid backend string; the rest of its body is mirrored here.
        from datetime import timedelta

        torch.distributed.init_process_group(
            backend=CPU_PROCESS_GROUP_BACKEND,
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    distributed.initialize_global_process_group = initialize_global_process_group


def _device_is_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


# --------------------------------------------------------------------------------------------------
# Engines: verl registers FSDP/FSDP2 for devices cuda and npu only; FSDP2 itself runs on CPU parameters.
# --------------------------------------------------------------------------------------------------

#: verl's documented override of the device used to look engines up in ``EngineRegistry``. The CPU
#: platform points it at the ``cuda`` registrations (the FSDP engines), which then run on the device
#: the platform reports (``cpu``). Importing verl's engine package from the plugin instead would pull
#: the whole training stack into every process at ``import verl``.
ENGINE_DEVICE_ENV = "VERL_ENGINE_DEVICE"

_installed = SimpleNamespace(done=False)


def _patch_cpu_offload_policy() -> None:
    """Make verl's FSDP2 ``CPUOffloadPolicy`` unpinned (``pin_memory`` needs an accelerator).

    Must run before ``verl.workers.engine.fsdp.transformer_impl`` binds the name from
    ``verl.utils.fsdp_utils``, i.e. at plugin load, like the process-group patch.
    """
    from verl.utils import fsdp_utils

    original = fsdp_utils.CPUOffloadPolicy
    if original is None or getattr(original, "_verl_mas_cpu", False):
        return

    class UnpinnedCPUOffloadPolicy(original):  # type: ignore[misc, valid-type]
        """FSDP2's CPU offload policy without pinned memory (the CPU platform has no accelerator)."""

        _verl_mas_cpu = True

        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    fsdp_utils.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def install() -> None:
    """Activate the CPU pieces in this process when ``VERL_PLATFORM=cpu`` (idempotent).

    The platform class is registered whenever this module is imported (it is inert unless selected).
    The backend-string fix and the engine lookup only change on the CPU platform.
    """
    if _installed.done or not cpu_platform_selected():
        return
    _patch_process_group_backend()
    _patch_cpu_offload_policy()
    os.environ.setdefault(ENGINE_DEVICE_ENV, "cuda")
    _installed.done = True


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)
