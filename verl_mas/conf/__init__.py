"""Hydra config groups the CPU recipes share (``hydra.searchpath: pkg://verl_mas.conf``).

``cpu_rollout``: which rollout serves a CPU run, ``hf`` (verl_mas's transformers backend, the default) or
``vllm`` (verl's own vLLM server on the CPU build of vLLM; ``make vllm-env``, see
:mod:`verl_mas.backends.vllm`). Pick one with ``cpu_rollout=vllm`` on the command line.

``on_cpu``: ``tiny`` runs a GPU recipe's settings on a CPU-only machine with a tiny model, swapping only
device-bound sizes and what only CUDA provides (flash-attention, bf16 autocast, NCCL, wandb); GPU recipes do
not list ``pkg://verl_mas.conf``, so add it: ``'hydra.searchpath=[pkg://verl.trainer.config,pkg://verl_mas.conf]'
+cpu_rollout=vllm +on_cpu=tiny``.
"""
