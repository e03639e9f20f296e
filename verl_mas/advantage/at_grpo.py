"""The ``at_grpo`` advantage estimator: GRPO normalisation inside (task, role, turn) groups (Eq. 1 of the paper).

``A_c = (r_c - mean_g r) / (std_g r + eps)`` for every candidate c of group g, broadcast over the
candidate's response tokens. Rewards are immediate per (role, turn) (no return across turns), so the
score of a sample is the sum of its token-level rewards, which the agent loop places on the last token.

Explicit policies where plain GRPO is undefined (verl's built-in GRPO gives a singleton the raw reward
as its advantage):

- a group of one member has no baseline: advantage 0 (``singleton="zero"``, default), or its raw
  reward (``singleton="raw"``, verl's behaviour, for ablations);
- a group whose rewards are all equal carries no preference: advantage 0.

Members spanning several rows (classic trajectory-level GRPO, ``mas.grouping: trajectory``): an index
entry ``"<group>#<member>"`` says the row belongs to member (episode) ``<member>`` of group ``<group>``.
The statistics are then taken over members, not rows: each member's score is the mean of its rows'
scores (all equal when they carry the episode's outcome), the member's advantage is normalised over the
group's members and broadcast to every row of the member. Without this, an 8-row failed episode would
weigh four times as much as a 2-row success in the group's mean and standard deviation.

Singleton policy: ``algorithm.at_grpo_singleton`` (``zero``/``raw``); the ``mas`` trainer fills it from
``mas.singleton_advantage``.

Vectorised with ``bincount`` over dense group ids: no Python loop per group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_mas.advantage.groups import MEMBER_SEP, _codes

__all__ = [
    "ESTIMATOR_NAME",
    "MEMBER_SEP",
    "SINGLETON_KEY",
    "SINGLETON_POLICIES",
    "at_grpo_advantages",
    "compute_at_grpo_outcome_advantage",
]

#: Name under which the estimator is registered with verl (``algorithm.adv_estimator=at_grpo``).
ESTIMATOR_NAME = "at_grpo"
SINGLETON_POLICIES = ("zero", "raw")
#: Key of verl's algorithm config that selects the singleton policy (set by the mas trainer).
SINGLETON_KEY = "at_grpo_singleton"
EPSILON = 1e-6


def at_grpo_advantages(
    scores: torch.Tensor,
    ids: np.ndarray | torch.Tensor,
    *,
    members: np.ndarray | None = None,
    norm_by_std: bool = True,
    singleton: str = "zero",
    epsilon: float = EPSILON,
) -> torch.Tensor:
    """Per-sample advantages from per-sample scores and dense group ids.

    Args:
        scores: ``(bs,)`` scalar reward of each sample.
        ids: ``(bs,)`` dense int group ids (0..G-1), e.g. from :func:`verl_mas.advantage.groups.group_ids`.
        members: ``(bs,)`` dense int member ids (0..M-1), or None (every row is its own member). Rows of
            one member (one episode) count once in their group's statistics, with their mean score, and
            all receive the member's advantage. A member lies in exactly one group.
        norm_by_std: Divide by the group's (unbiased) standard deviation plus ``epsilon``, as GRPO;
            ``False`` gives the Dr.GRPO-style mean-centred advantage.
        singleton: ``"zero"`` or ``"raw"`` (see the module docstring).
        epsilon: Added to the standard deviation.

    Returns:
        ``(bs,)`` advantages, float32.
    """
    if members is not None:
        member = torch.as_tensor(np.asarray(members), dtype=torch.long)
        n_members = int(member.max()) + 1 if member.numel() else 0
        x = scores.detach().to(torch.float64)
        rows = torch.bincount(member, minlength=n_members).to(torch.float64)
        member_scores = torch.bincount(member, weights=x, minlength=n_members) / rows.clamp(min=1)
        member_group = torch.zeros(n_members, dtype=torch.long).scatter_(
            0, member, torch.as_tensor(np.asarray(ids), dtype=torch.long))
        adv = at_grpo_advantages(member_scores, member_group.numpy(), norm_by_std=norm_by_std, singleton=singleton,
                                 epsilon=epsilon)
        return adv[member]
    if singleton not in SINGLETON_POLICIES:
        raise ValueError(f"Unknown singleton policy {singleton!r}; expected one of {SINGLETON_POLICIES}.")
    x = scores.detach().to(torch.float64)
    g = torch.as_tensor(ids, dtype=torch.long, device=x.device)
    n_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.bincount(g, minlength=n_groups).to(torch.float64)
    mean = torch.bincount(g, weights=x, minlength=n_groups) / count.clamp(min=1)
    centred = x - mean[g]
    size = count[g]
    if norm_by_std:
        # Unbiased variance (as torch.std in verl's GRPO); two-pass for accuracy.
        var = torch.bincount(g, weights=centred * centred, minlength=n_groups) / (count - 1).clamp(min=1)
        adv = centred / (var.sqrt()[g] + epsilon)
    else:
        adv = centred
    # Zero-variance groups: centred is 0 only up to rounding (sum(x)/n need not equal x); make it exact
    # so float noise never becomes a training signal.
    hi = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, g, x, reduce="amax")
    lo = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, g, x, reduce="amin")
    adv = torch.where((hi - lo)[g] == 0, torch.zeros_like(adv), adv)
    single = size == 1
    adv = torch.where(single, x if singleton == "raw" else torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def _dense_ids(index: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Dense int group ids (and member ids, when entries read ``"<group>#<member>"``) from verl's ``index``."""
    arr = np.asarray(index)
    if arr.dtype.kind in "iu":
        codes, _ = _codes(arr.astype(np.int64))
        return codes, None
    if not any(isinstance(k, str) and MEMBER_SEP in k for k in arr.tolist()):  # the common case: no members
        codes, _ = _codes(arr)
        return codes, None
    keys = [str(k) for k in arr.tolist()]
    groups = [k.rpartition(MEMBER_SEP)[0] if MEMBER_SEP in k else k for k in keys]
    codes, _ = _codes(groups)
    members, _ = _codes(keys)
    return codes, members


def _config_value(config: Any, key: str, default: Any) -> Any:
    """Read ``key`` from verl's algorithm config (a ``BaseConfig`` or a DictConfig; both have ``get``)."""
    return default if config is None else config.get(key, default)


def compute_at_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    config: Any = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl estimator entry point (``algorithm.adv_estimator=at_grpo``).

    Args:
        token_level_rewards: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``.
        index: ``(bs,)`` group key of each row. The ``mas`` trainer puts the AT-GRPO key (task uid, role,
            turn) here; with stock verl trainers it is the row uid, i.e. plain GRPO groups.
        config: verl's algorithm config: ``norm_adv_by_std_in_grpo`` (default True) and, optionally,
            ``at_grpo_singleton`` (``zero``/``raw``; the ``mas`` trainer sets it from
            ``mas.singleton_advantage``).

    Returns:
        ``(advantages, returns)``, both ``(bs, response_length)``, masked by ``response_mask``.
    """
    norm_by_std = bool(_config_value(config, "norm_adv_by_std_in_grpo", True))
    singleton = str(_config_value(config, SINGLETON_KEY, "zero"))
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids, members = _dense_ids(index)
        adv = at_grpo_advantages(scores, ids, members=members, norm_by_std=norm_by_std, singleton=singleton)
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


def register() -> None:
    """Register the estimator with verl (idempotent)."""
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    if ADV_ESTIMATOR_REGISTRY.get(ESTIMATOR_NAME) is not compute_at_grpo_outcome_advantage:
        register_adv_est(ESTIMATOR_NAME)(compute_at_grpo_outcome_advantage)
