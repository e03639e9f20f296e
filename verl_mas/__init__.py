"""verl_mas: train teams of LLM roles with AT-GRPO on verl.

Importing this package is cheap (no torch, Ray or verl import): verl loads :mod:`verl_mas._plugin`
through its ``verl.plugins`` entry point in every process, and user code imports the public API below.
Test doubles live in :mod:`verl_mas.testing`.
"""

from __future__ import annotations

from verl_mas.chat import Message, assistant, render_prompt, system, user
from verl_mas.client import GenerateRequest, LLMClient, Sample, fan_out
from verl_mas.engine import run_episode
from verl_mas.episode import Candidate, Candidates, Episode, group_key
from verl_mas.settings import EpisodeConfig
from verl_mas.errors import ContextOverflowError, InfraError, LLMClientError, WorkflowError
from verl_mas.registry import get_workflow, register_workflow, registered_workflows
from verl_mas.workflow import Workflow

__version__ = "0.1.0.dev0"

__all__ = [
    "Candidate",
    "Candidates",
    "ContextOverflowError",
    "Episode",
    "EpisodeConfig",
    "GenerateRequest",
    "InfraError",
    "LLMClient",
    "LLMClientError",
    "Message",
    "Sample",
    "Workflow",
    "WorkflowError",
    "__version__",
    "assistant",
    "fan_out",
    "get_workflow",
    "group_key",
    "register_workflow",
    "registered_workflows",
    "render_prompt",
    "run_episode",
    "system",
    "user",
]
