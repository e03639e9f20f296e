"""Hydra config groups the CPU recipes share (``hydra.searchpath: pkg://verl_mas.conf``).

``cpu_rollout``: which rollout serves a CPU run, ``hf`` (verl_mas's transformers backend, the default) or
``vllm`` (verl's own vLLM server on the CPU build of vLLM; ``make vllm-env``, see
:mod:`verl_mas.backends.vllm`). Pick one with ``cpu_rollout=vllm`` on the command line.
"""
