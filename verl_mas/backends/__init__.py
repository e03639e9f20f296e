"""CPU backends for verl: the ``cpu`` platform and the ``hf`` rollout backend (development and CI without GPUs)."""
