"""verl_mas: train teams of LLM roles with AT-GRPO on verl.

Importing this package is cheap (no torch, Ray or verl import): verl loads :mod:`verl_mas._plugin`
through its ``verl.plugins`` entry point in every process, and user code imports the public API below.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
