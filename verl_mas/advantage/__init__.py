"""AT-GRPO advantages: the ``at_grpo`` estimator for verl and the (task, role, turn) group keys."""

from verl_mas.advantage.groups import GROUPING_MODES, GroupStats, group_ids, group_key, group_stats, prompt_mismatches

__all__ = ["GROUPING_MODES", "GroupStats", "group_ids", "group_key", "group_stats", "prompt_mismatches"]
