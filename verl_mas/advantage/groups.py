"""AT-GRPO group keys: the one place where (task uid, role, turn) becomes a group, and group diagnostics.

The reference implementation built groups by index arithmetic (``env_idx // K``) and merged different
tasks into one group. Here a group is always derived from stable ids, never from positions in a batch,
and the trainer checks on real batches that every member of a group was sampled from one prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from verl_mas.episode import GROUP_KEY_SEP
from verl_mas.episode import group_key as _episode_group_key

#: Separates a group from its member (episode) in a key; the at_grpo estimator reads it (see at_grpo.py).
MEMBER_SEP = "#"

__all__ = [
    "GROUPING_MODES",
    "MEMBER_SEP",
    "group_invariant_problems",
    "GroupStats",
    "group_ids",
    "group_key",
    "group_stats",
    "prompt_mismatches",
    "prompts_per_group",
    "signal_rows",
]

#: Grouping modes: AT-GRPO's (task, role, turn); role only; classic GRPO over whole episodes.
GROUPING_MODES = ("agent_turn", "agent", "trajectory")


def group_key(task_uid: str, role: str, turn: int, grouping: str = "agent_turn", episode: str = "0") -> str:
    """The printable group key of a candidate under a grouping mode, e.g. ``"3f2a...|planner|1"``.

    ``agent_turn`` is the engine's own key (:func:`verl_mas.episode.group_key`); ``agent`` drops the turn;
    ``trajectory`` is (task, role) with the episode as the member: ``"3f2a...|planner#2"`` (the ``at_grpo``
    estimator takes its statistics over the role's episodes, one advantage per (episode, role) broadcast to its
    rows).

    Args:
        task_uid: verl's uid of the dataset row (one task; shared by the K candidates of every node).
        role: The acting role.
        turn: The 0-based turn.
        grouping: ``agent_turn`` (AT-GRPO: task, role, turn), ``agent`` (task, role) or ``trajectory``
            (task, role; members are episodes).
        episode: The episode of the task (verl's session id; ``rollout.n`` episodes per task).
    """
    for name, value in (("task uid", task_uid), ("role", role)):
        if GROUP_KEY_SEP in value or MEMBER_SEP in value:
            raise ValueError(
                f"The {name} {value!r} contains {GROUP_KEY_SEP!r} or {MEMBER_SEP!r}, which separate the parts of "
                f"AT-GRPO group keys. Rename it without them."
            )
    if grouping == "agent_turn":
        return _episode_group_key(task_uid, role, int(turn))
    if grouping == "agent":
        return f"{task_uid}{GROUP_KEY_SEP}{role}"
    if grouping == "trajectory":
        return f"{task_uid}{GROUP_KEY_SEP}{role}{MEMBER_SEP}{episode}"
    raise ValueError(f"Unknown grouping {grouping!r}; expected one of {GROUPING_MODES}.")


def _codes(values: Sequence[object] | np.ndarray) -> tuple[np.ndarray, int]:
    """Dense integer codes of hashable values (hash-based, like ``pandas.factorize``)."""
    import pandas as pd

    codes, uniques = pd.factorize(np.asarray(values, dtype=object), use_na_sentinel=False)
    return codes.astype(np.int64, copy=False), len(uniques)


def group_ids(
    task_uids: Sequence[str] | np.ndarray,
    roles: Sequence[str] | np.ndarray | None = None,
    turns: Sequence[int] | np.ndarray | None = None,
    grouping: str = "agent_turn",
) -> np.ndarray:
    """Dense int64 group ids for a batch, equal iff :func:`group_key` is equal (vectorised).

    Combining per-column codes avoids building one Python string per row, which dominates the cost
    at 10^6 rows.
    """
    if grouping not in GROUPING_MODES:
        raise ValueError(f"Unknown grouping {grouping!r}; expected one of {GROUPING_MODES}.")
    ids, _ = _codes(task_uids)
    if grouping == "trajectory":
        return ids
    if roles is None or (grouping == "agent_turn" and turns is None):
        raise ValueError(f"grouping={grouping!r} needs the role{' and turn' if grouping == 'agent_turn' else ''} of every row.")
    role_codes, n_roles = _codes(roles)
    combined = ids * n_roles + role_codes
    if grouping == "agent_turn":
        turn_arr = np.asarray(turns, dtype=np.int64)
        if turn_arr.size and turn_arr.min() < 0:
            raise ValueError("Turns are 0-based and non-negative; got a negative turn.")
        combined = combined * (int(turn_arr.max(initial=0)) + 1) + turn_arr
    dense, _ = _codes(combined)
    return dense


@dataclass(frozen=True)
class GroupStats:
    """Shape of the groups of one batch (logged as ``mas/group/*``)."""

    num_groups: int
    size_mean: float
    singleton_frac: float  # fraction of groups with one member (no baseline: advantage 0)
    zero_std_frac: float  # fraction of multi-member groups whose rewards are all equal (advantage 0)

    def as_metrics(self, prefix: str = "mas/group/") -> dict[str, float]:
        return {
            f"{prefix}count": float(self.num_groups),
            f"{prefix}size_mean": self.size_mean,
            f"{prefix}singleton_frac": self.singleton_frac,
            f"{prefix}zero_std_frac": self.zero_std_frac,
        }


def _size_and_flat(ids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per dense group id: its member count, and whether its scores are all exactly equal.

    Exact, as the ``at_grpo`` estimator's zero-variance rule (it zeroes a group's advantages iff its highest and
    lowest scores are equal): a group whose rewards differ by 1e-9 still gets non-zero advantages there
    (``(r - mean) / (std + eps)``), so it counts as having signal here too.
    """
    n = int(ids.max()) + 1
    size = np.bincount(ids, minlength=n)
    hi = np.full(n, -np.inf)
    lo = np.full(n, np.inf)
    np.maximum.at(hi, ids, scores)
    np.minimum.at(lo, ids, scores)
    return size, hi - lo == 0


def group_stats(ids: np.ndarray, scores: np.ndarray) -> GroupStats:
    """Group counts, mean size, singleton and zero-variance fractions for dense ``ids``."""
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.asarray(scores, dtype=np.float64)
    if ids.size == 0:
        return GroupStats(0, 0.0, 0.0, 0.0)
    size, flat = _size_and_flat(ids, scores)
    present = size > 0
    multi = size > 1
    zero_std = multi & flat
    groups = int(present.sum())
    return GroupStats(
        num_groups=groups,
        size_mean=float(size[present].mean()),
        singleton_frac=float((size == 1).sum() / groups),
        zero_std_frac=float(zero_std.sum() / max(1, int(multi.sum()))),
    )


def signal_rows(
    ids: np.ndarray,
    scores: np.ndarray,
    *,
    members: Sequence[object] | None = None,
    keep_singletons: bool = False,
) -> np.ndarray:
    """``(bs,)`` bool: the rows whose group-normalised advantage can be non-zero.

    A group whose scores are all exactly equal (as :func:`group_stats` counts ``zero_std_frac``) gives
    every member advantage exactly 0, and so does a one-member group unless ``keep_singletons`` (the estimator's
    ``singleton_advantage: raw`` gives it its score). Such rows carry no policy gradient; the others are kept
    with their whole group, so each kept group's mean and std are those of the full batch.

    Args:
        ids: ``(bs,)`` dense group ids.
        scores: ``(bs,)`` each row's score.
        members: Each row's member of its group (``grouping: trajectory``: its episode, whose rows share one
            outcome); default: every row is a member of its own.
        keep_singletons: Keep one-member groups (``singleton_advantage: raw``).
    """
    ids = np.asarray(ids, dtype=np.int64)
    scores = np.asarray(scores, dtype=np.float64)
    if ids.size == 0:
        return np.zeros(0, dtype=bool)
    size, flat = _size_and_flat(ids, scores)
    if members is not None:  # members per group, not rows
        pairs = {(int(g), m) for g, m in zip(ids, members, strict=True)}
        size = np.bincount(np.fromiter((g for g, _ in pairs), dtype=np.int64, count=len(pairs)), minlength=size.size)
    keep = (size > 1) & ~flat
    if keep_singletons:
        keep |= size == 1
    return keep[ids]


def prompt_mismatches(ids: np.ndarray, prompt_hashes: Sequence[object] | np.ndarray, limit: int = 5) -> list[int]:
    """Group ids whose members do not all share one prompt (by prompt hash); at most ``limit`` of them.

    Every AT-GRPO group must hold K samples of ONE prompt, or its mean is not a baseline for any of them.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return []
    hash_codes, _ = _codes(prompt_hashes)
    n = int(ids.max()) + 1
    first = np.full(n, -1, dtype=np.int64)
    # The first prompt seen in each group (reverse assignment keeps the earliest index's value).
    first[ids[::-1]] = hash_codes[::-1]
    bad = np.unique(ids[hash_codes != first[ids]])
    return bad[:limit].tolist()


def prompts_per_group(ids: np.ndarray, prompt_hashes: Sequence[object] | np.ndarray) -> float:
    """The mean over groups of how many different prompts (by prompt hash) their members were sampled from.

    1.0 when every group shares one prompt (tree sampling with (task, role, turn) groups, and the first turn of
    independent episodes); above 1 where a group's members saw different states (independent episodes after they
    diverge, or a group spanning turns), whose mean then mixes the states it is a baseline for.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return 0.0
    hash_codes, _ = _codes(prompt_hashes)
    pairs = np.unique(np.stack([ids, hash_codes]), axis=1)  # each (group, prompt) once
    return float(pairs.shape[1] / np.unique(ids).size)


def group_invariant_problems(
    ids: np.ndarray,
    keys: Sequence[str],
    *,
    grouping: str,
    sampling: str,
    task_uids: Sequence[str],
    episodes: Sequence[str],
    roles: Sequence[str],
    turns: Sequence[int] | np.ndarray,
    prompt_hashes: Sequence[int] | None,
    check_prompts: bool = True,
    limit: int = 3,
) -> list[str]:
    """What each grouping and sampling mode implies about a batch, checked on the rows' own fields.

    The group ids are built from keys; these checks read the rows' task, episode, role, turn and prompt
    fields independently, so a key built wrongly (index arithmetic, a dropped field) is caught:

    - every grouping: a group holds one task;
    - ``agent_turn`` and ``agent``: one role per group; ``agent_turn``: one turn per group;
    - ``tree`` sampling: the candidates of a node (task, episode, role, turn) were drawn from one prompt
      (under ``agent_turn`` a node is a group; under ``agent`` a group spans the turns of its role);
    - ``parallel`` sampling: a node holds one candidate (K independent episodes, one sample each), so a
      group never counts one episode twice;
    - ``trajectory``: one role per group, and a member (an episode's rows of one role) lies in one group.

    Returns:
        One message per violated invariant, naming up to ``limit`` offending groups with their rows.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return []
    out: list[str] = []

    def report(bad_ids: list[int], what: str, values: Sequence[object], by: np.ndarray | None = None) -> None:
        if not bad_ids:
            return
        by = ids if by is None else by
        examples = []
        for gid in bad_ids[:limit]:
            rows = np.flatnonzero(by == gid).tolist()
            shown = rows[:8]
            where = keys[rows[0]] if by is ids else f"node of row {rows[0]} (group {keys[rows[0]]!r})"
            examples.append(f"{where!r}: rows {shown} have {what} {[values[r] for r in shown]}")
        out.append(f"{len(bad_ids)} group(s) mix {what}s, which mas.grouping={grouping} with "
                   f"mas.sampling={sampling} rules out: " + "; ".join(examples))

    report(prompt_mismatches(ids, task_uids, limit=limit), "task", task_uids)
    report(prompt_mismatches(ids, roles, limit=limit), "role", roles)
    if grouping == "agent_turn":
        report(prompt_mismatches(ids, list(map(int, turns)), limit=limit), "turn", list(map(int, turns)))
    node, _ = _codes([f"{u}{GROUP_KEY_SEP}{e}{GROUP_KEY_SEP}{r}{GROUP_KEY_SEP}{int(t)}"
                      for u, e, r, t in zip(task_uids, episodes, roles, turns, strict=True)])
    if sampling == "tree" and check_prompts and prompt_hashes is not None:
        report(prompt_mismatches(node, prompt_hashes, limit=limit), "prompt hash", list(prompt_hashes), by=node)
    if sampling == "parallel":
        sizes = np.bincount(node)
        crowded = np.flatnonzero(sizes > 1)[:limit].tolist()
        if crowded:
            rows = [np.flatnonzero(node == n).tolist() for n in crowded]
            out.append(
                f"{int((sizes > 1).sum())} node(s) (task, episode, role, turn) hold several candidates, but "
                "mas.sampling=parallel draws one candidate per node (mas.branching=1): rows "
                + "; ".join(str(r[:8]) for r in rows)
            )
    if grouping == "trajectory":
        member, _ = _codes([f"{u}{GROUP_KEY_SEP}{r}{MEMBER_SEP}{e}"
                            for u, e, r in zip(task_uids, episodes, roles, strict=True)])
        spread = prompt_mismatches(member, ids.tolist(), limit=limit)
        if spread:
            rows = [np.flatnonzero(member == m).tolist()[:8] for m in spread]
            out.append(f"{len(spread)} episode(s) lie in several groups, but mas.grouping=trajectory gives each "
                       f"episode one advantage per role in its (task, role) group: rows {'; '.join(map(str, rows))}")
    return out
