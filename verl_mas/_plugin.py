"""What verl loads in every process through the ``verl.plugins`` entry point: verl_mas's registrations.

verl imports this module at the end of ``import verl`` in the driver, the TaskRunner and every Ray worker.
It only *registers* (a platform, a rollout backend, ...): nothing of stock verl is overridden unless a
config selects it (``VERL_PLATFORM=cpu``, ``actor_rollout_ref.rollout.name=hf``, ...). The one exception is
``rollout.name=vllm``, whose replica and adapter entries point to subclasses of verl's own
(:mod:`verl_mas.backends.vllm`): per-policy server names and weight sockets for tagged policies (an untagged
config keeps verl's), request/sync counters, and a weight sync that fails instead of hanging.

verl swallows plugin import errors at DEBUG level, after which a run fails much later with an unrelated
message ("Rollout hf with mode async not found"). So a failure here is logged as a WARNING naming the
cause and the fix before it propagates. ``VERL_USE_EXTERNAL_MODULES=verl_mas._plugin`` loads the same
module through verl's other mechanism, where errors are not swallowed.

Import order: when a program imports a verl_mas module before verl (``import verl_mas.policies``), the
first ``import verl`` runs inside that module, before its names exist, and this plugin cannot yet import
it. The registration is then *deferred*, and every verl_mas module that imports verl at its top ends with
:func:`complete`, which finishes it once the module is whole. Any import order registers everything (a
test imports each module first in a fresh interpreter).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("verl_mas")

#: The names registered in verl's registries, for diagnostics and tests.
REGISTERED: dict[str, list[str]] = {"platform": [], "rollout": [], "adv_estimator": [], "agent_loop": [], "trainer": []}
LOADED = False
#: True while the registration waits for a verl_mas module whose import is under way (see the docstring).
DEFERRED = False


def _register() -> None:
    # The CPU platform class registers itself with verl's PlatformRegistry on import; it is inert
    # unless VERL_PLATFORM=cpu, in which case install() also applies the CPU-only fixes.
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_mas.backends import cpu_platform

    cpu_platform.install()
    REGISTERED["platform"] = [cpu_platform.PLATFORM_NAME]

    # The hf rollout backend: lazy loaders, the module is imported only when selected.
    from verl_mas.backends.hf import ADAPTER_PATH, BACKEND_NAME, load_replica_class

    RolloutReplicaRegistry.register(BACKEND_NAME, load_replica_class)
    rollout_base._ROLLOUT_REGISTRY[(BACKEND_NAME, "async")] = ADAPTER_PATH

    # verl's vllm rollout, policy-aware (lazy too: vLLM is imported only when a run selects it).
    from verl_mas.backends import vllm as vllm_backend

    RolloutReplicaRegistry.register(vllm_backend.BACKEND_NAME, vllm_backend.load_replica_class)
    rollout_base._ROLLOUT_REGISTRY[(vllm_backend.BACKEND_NAME, "async")] = vllm_backend.ADAPTER_PATH
    REGISTERED["rollout"] = [BACKEND_NAME, vllm_backend.BACKEND_NAME]

    # The AT-GRPO advantage estimator (algorithm.adv_estimator=at_grpo).
    from verl_mas.advantage import at_grpo

    at_grpo.register()
    REGISTERED["adv_estimator"] = [at_grpo.ESTIMATOR_NAME]

    # The agent loop that runs workflow episodes (rows with the agent_name python -m verl_mas.data writes).
    # verl instantiates it from its dotted path, so the module is imported only in the agent-loop workers
    # that use it.
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from verl_mas.data import AGENT_NAME

    _agent_loop_registry[AGENT_NAME] = {"_target_": "verl_mas.agent_loop.MasAgentLoop"}
    REGISTERED["agent_loop"] = [AGENT_NAME]

    # The trainer mode (trainer.v1.trainer_mode=mas). When a program imports verl_mas.trainer before
    # verl, this runs while that module is still being imported (it imports verl first): the module's
    # own @register_trainer completes the registration once its import finishes.
    import verl_mas.trainer  # noqa: F401

    REGISTERED["trainer"] = ["mas"]


def _modules_under_way(caller: str | None = None) -> list[str]:
    """verl_mas modules (other than this one and ``caller``) whose import has started and not finished."""
    return sorted(
        name for name, module in list(sys.modules.items())
        if name.startswith("verl_mas.") and name not in (__name__, caller)
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
    )


def _warn(exc: BaseException) -> None:
    logger.warning(
        "verl_mas failed to register with verl (%s: %s), so verl_mas features (the cpu platform, the hf "
        "rollout backend, the at_grpo estimator, the mas trainer) are unavailable in this process. "
        "Fix the cause (is verl==0.9.1 installed next to verl_mas?) and re-run; for the full traceback set "
        "VERL_USE_EXTERNAL_MODULES=verl_mas._plugin, which makes verl raise plugin import errors.",
        type(exc).__name__,
        exc,
    )


def _attempt(caller: str | None = None) -> None:
    """Register; defer when a verl_mas module this needs is still being imported; warn and raise otherwise."""
    global LOADED, DEFERRED
    try:
        _register()
    except Exception as exc:  # re-raised below: verl would otherwise hide it at DEBUG level
        under_way = _modules_under_way(caller)
        if under_way:
            # A nested attempt (from a module finishing inside this one's imports) may have set LOADED before
            # this one failed: the registration is not whole until an attempt succeeds from the outside.
            LOADED, DEFERRED = False, True
            logger.debug("verl_mas registration deferred until %s finish importing (%s)", under_way, exc)
            return
        _warn(exc)
        raise
    LOADED, DEFERRED = True, False


def complete(caller: str) -> None:
    """Finish a deferred registration; called at the end of every verl_mas module that imports verl at its top.

    Args:
        caller: The calling module's ``__name__`` (it is whole by now, though Python still marks it as
            being imported).
    """
    if DEFERRED and not LOADED:
        _attempt(caller)


_attempt()
