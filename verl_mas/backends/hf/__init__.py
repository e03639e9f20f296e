"""The ``hf`` rollout backend for verl: ``transformers`` generation behind verl's token-in/token-out contract.

Selected with ``actor_rollout_ref.rollout.name=hf``. The PyPI vLLM and SGLang wheels are CUDA-only, so
on a CPU machine (a laptop, CI) this backend stands in for them with the same contract verl's agent
loops use: ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput`` with the sampled tokens'
log-probs at the sampling temperature (and, an extension verl passes through, ``n`` samples of one prompt in one
request: :data:`SAMPLES_KWARG`), hybrid weight sync from the actor after every training step, and
the lifecycle calls verl makes on hybrid replicas. It is meant for tiny models; GPU users select vLLM or
SGLang as in stock verl.

The package is split by layer, each module importing only the ones above it in this list:

- this ``__init__``: the names a run selects and configures the backend with, and the loader verl's
  registries call (what :mod:`verl_mas._plugin` registers). Importing it imports no torch,
  transformers or Ray, so every process can register the backend and only the one that uses it pays;
- :mod:`.engine`: the generation engine (torch and transformers, no Ray, no verl): sampling settings,
  batched KV-cached decoding, weight loading. Testable on its own;
- :mod:`.server`: the Ray side: the per-replica server actor verl's agent loops call, and the
  ``RolloutReplica`` that launches it;
- :mod:`.adapter`: verl's rollout object in the trainer worker, which streams the actor's weights to
  its replica's server (the class :data:`ADAPTER_PATH` names).

Diagnostics: ``VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS=1`` (:data:`FREEZE_WEIGHTS_ENV`) makes the server
ignore weight updates (the rollout keeps the initial weights); ``=after:N`` loads the first N updates (the
initial sync is the first) and ignores the later ones, so one run has synced steps and then frozen ones. It
exists to prove that verl's rollout-vs-actor probability check detects a broken weight sync; never set it for
training.
"""

from __future__ import annotations

from typing import Any

#: ``actor_rollout_ref.rollout.name`` that selects the backend.
BACKEND_NAME = "hf"
#: Dotted path verl's rollout registry imports in the trainer worker.
ADAPTER_PATH = "verl_mas.backends.hf.adapter.HFServerAdapter"
#: Grouped sampling: the server's ``generate`` keyword asking for ``n`` samples of one prompt in one request (the mas
#: agent loop sends each AT-GRPO group this way on this backend: one Ray round trip per group instead of K) ...
SAMPLES_KWARG = "mas_samples"
#: ... and the field of the returned ``TokenOutput.extra_fields`` that holds the ``n`` samples (``TokenOutput`` each).
GROUP_FIELD = "mas_group"
#: Diagnostic switch: ignore weight updates (see the package docstring).
FREEZE_WEIGHTS_ENV = "VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS"


def load_replica_class() -> Any:
    """Loader for verl's ``RolloutReplicaRegistry``: imports the backend when a run selects it."""
    from verl_mas.backends.hf.server import HFReplica

    return HFReplica
