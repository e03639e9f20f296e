"""The at_grpo estimator and its group keys, against hand-computed values (derivations in comments)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from verl_mas.advantage import group_ids, group_key, group_stats, prompt_mismatches
from verl_mas.advantage.at_grpo import at_grpo_advantages, compute_at_grpo_outcome_advantage


def _rewards_on_last_token(scores: list[float], lengths: list[int], width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """token_level_rewards / response_mask as verl builds them: the reward sits on the last response token."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def test_one_group_with_std_normalisation() -> None:
    # Group {1, 2, 3}: mean 2, unbiased std sqrt(((1-2)^2 + 0 + (3-2)^2) / 2) = 1 -> A = (r - 2) / (1 + 1e-6).
    adv = at_grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), np.array([0, 0, 0]))
    expected = torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-6)
    assert torch.allclose(adv, expected, atol=1e-7)


def test_std_off_gives_mean_centred_advantages() -> None:
    # Same group without std: A = r - mean = (-1, 0, 1); a second group {10, 14}: mean 12 -> (-2, +2).
    adv = at_grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 10.0, 14.0]), np.array([0, 0, 0, 1, 1]), norm_by_std=False)
    assert adv.tolist() == [-1.0, 0.0, 1.0, -2.0, 2.0]


def test_singleton_and_zero_variance_groups() -> None:
    # ids: group 0 = {0.7, 0.7} (zero variance) -> 0, 0; group 1 = {5.0} (singleton) -> 0 by default,
    # the raw reward 5.0 with singleton="raw" (verl's GRPO behaviour); group 2 = {0, 1}: mean 0.5,
    # std sqrt((0.25 + 0.25) / 1) = 0.7071 -> -0.5/0.7071 = -0.7071, +0.7071.
    scores = torch.tensor([0.7, 0.7, 5.0, 0.0, 1.0])
    ids = np.array([0, 0, 1, 2, 2])
    adv = at_grpo_advantages(scores, ids)
    h = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, 0.0, -h, h]), atol=1e-6)
    assert at_grpo_advantages(scores, ids, singleton="raw")[2].item() == 5.0
    # A zero-variance group whose mean is inexact in floating point (0.1 * 3 / 3 != 0.1) is still exactly 0.
    assert at_grpo_advantages(torch.tensor([0.1, 0.1, 0.1]), np.array([0, 0, 0])).tolist() == [0.0, 0.0, 0.0]
    stats = group_stats(ids, scores.numpy())
    # 3 groups, sizes 2/1/2 -> mean 5/3; 1 singleton of 3; 1 zero-variance of the 2 multi-member groups.
    assert (stats.num_groups, stats.singleton_frac, stats.zero_std_frac) == (3, 1 / 3, 0.5)
    assert stats.size_mean == pytest.approx(5 / 3)


def test_interleaved_roles_and_turns_never_mix() -> None:
    # One task "t1", K=2, roles tool/planner, turns 0/1, rows deliberately interleaved. Each (role, turn)
    # group has 2 members with rewards (a, b) -> advantages (-s, +s) with s = |a - b| / 2 / (std + eps)
    # and std = |a - b| / sqrt(2), i.e. +-1/sqrt(2) ~ 0.7071 for any a != b.
    uids = ["t1"] * 8
    roles = ["tool", "planner", "tool", "planner", "tool", "planner", "tool", "planner"]
    turns = [0, 0, 1, 1, 0, 0, 1, 1]
    scores = [0.0, 10.0, 3.0, -1.0, 1.0, 20.0, 5.0, -3.0]
    # Pairs: tool/0 = rows 0,4 (0, 1); planner/0 = 1,5 (10, 20); tool/1 = 2,6 (3, 5); planner/1 = 3,7 (-1, -3).
    ids = group_ids(uids, roles, turns)
    assert len(set(ids.tolist())) == 4
    for a, b in [(0, 4), (1, 5), (2, 6), (3, 7)]:
        assert ids[a] == ids[b]
    rewards, mask = _rewards_on_last_token(scores, [1, 2, 3, 4, 4, 3, 2, 1])
    adv, ret = compute_at_grpo_outcome_advantage(rewards, mask, index=ids, config={"norm_adv_by_std_in_grpo": True})
    per_row = [adv[i, 0].item() for i in range(8)]
    expected = [-1, -1, -1, 1, 1, 1, 1, -1]  # sign of (own reward - partner's reward)
    for got, sign in zip(per_row, expected):
        assert got == pytest.approx(sign / math.sqrt(2), rel=1e-5)
    # Advantages are broadcast over each row's response tokens only.
    assert torch.equal(adv != 0, mask.bool())
    assert torch.equal(adv, ret)


def test_grouping_modes_and_the_broken_key_control() -> None:
    uids = ["a", "a", "a", "a", "b", "b"]
    roles = ["x", "x", "y", "y", "x", "x"]
    turns = [0, 1, 0, 1, 0, 0]
    assert len(set(group_ids(uids, roles, turns).tolist())) == 5
    assert len(set(group_ids(uids, roles, grouping="agent").tolist())) == 3
    assert len(set(group_ids(uids, grouping="trajectory").tolist())) == 2
    # group_ids agrees with the printable key
    keys = [group_key(u, r, t) for u, r, t in zip(uids, roles, turns)]
    assert group_ids(keys, grouping="trajectory").tolist() == group_ids(uids, roles, turns).tolist()
    assert keys[0] == "a|x|0"
    with pytest.raises(ValueError, match=r"contains '\|'"):
        group_key("a|b", "x", 0)


def test_prompt_check_catches_a_group_mixing_two_prompts() -> None:
    ids = np.array([0, 0, 1, 1, 2, 2])
    good = ["p", "p", "q", "q", "r", "r"]
    assert prompt_mismatches(ids, good) == []
    # Negative control: a broken key that lumps rows of two prompts into group 1 is caught and named.
    broken = ["p", "p", "q", "z", "r", "r"]
    assert prompt_mismatches(ids, broken) == [1]


def test_string_keys_through_verl_registry_match_int_ids() -> None:
    import verl  # noqa: F401  (loads the plugin, which registers at_grpo)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn("at_grpo")
    assert fn is compute_at_grpo_outcome_advantage
    rewards, mask = _rewards_on_last_token([1.0, 3.0, 2.0, 2.0], [2, 2, 2, 2])
    keys = np.array(["u|p|0", "u|p|0", "u|q|0", "u|q|0"], dtype=object)
    adv_keys, _ = fn(token_level_rewards=rewards, response_mask=mask, index=keys, config=None)
    adv_ids, _ = fn(token_level_rewards=rewards, response_mask=mask, index=np.array([7, 7, 9, 9]), config=None)
    assert torch.equal(adv_keys, adv_ids)
    # {1, 3}: +-1/sqrt(2); {2, 2}: zero variance -> 0.
    assert adv_keys[:, 0].tolist() == pytest.approx([-(2**-0.5), 2**-0.5, 0.0, 0.0], rel=1e-5)


def test_matches_verls_grpo_on_plain_groups() -> None:
    """On groups with >= 2 members and no ties, at_grpo equals verl's vectorised GRPO."""
    from verl.trainer.ppo.core_algos import compute_grpo_vectorized_outcome_advantage

    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(40, generator=gen)
    index = np.repeat(np.arange(10), 4).astype(object)
    rewards, mask = _rewards_on_last_token(scores.tolist(), [3] * 40)
    ours, _ = compute_at_grpo_outcome_advantage(rewards, mask, index=index, config=None)
    theirs, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, index=index)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_trajectory_grpo_normalises_over_episodes_not_rows() -> None:
    # Task t, two episodes: a 2-row success (outcome 1) and an 8-row failure (outcome 0). Over episodes:
    # mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071 -> +0.5/0.7071 = +0.7071 on each row of the
    # success, -0.7071 on each row of the failure. Over rows (the old behaviour): mean 0.2, std 0.4216
    # -> +1.897 / -0.474, so the long failed episode would weigh four times as much as the short success.
    rewards, mask = _rewards_on_last_token([1.0] * 2 + [0.0] * 8, [1] * 10, width=1)
    index = np.array([group_key("t", "r", 0, "trajectory", episode="0")] * 2
                     + [group_key("t", "r", 0, "trajectory", episode="1")] * 8, dtype=object)
    assert index[0] == "t|r#0"
    adv, _ = compute_at_grpo_outcome_advantage(rewards, mask, index=index, config=None)
    h = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([h] * 2 + [-h] * 8, rel=1e-6)
    rows, _ = compute_at_grpo_outcome_advantage(rewards, mask, index=np.array(["t"] * 10, dtype=object), config=None)
    assert rows[0, 0].item() == pytest.approx(1.897, abs=1e-3) and rows[2, 0].item() == pytest.approx(-0.474, abs=1e-3)
    # One episode alone in its task is a singleton group: zero advantage (no baseline), "raw" on request.
    single = np.array(["u#0"] * 3, dtype=object)
    r3, m3 = _rewards_on_last_token([1.0] * 3, [1] * 3, width=1)
    assert compute_at_grpo_outcome_advantage(r3, m3, index=single, config=None)[0].abs().sum() == 0
    raw, _ = compute_at_grpo_outcome_advantage(r3, m3, index=single, config={"at_grpo_singleton": "raw"})
    assert raw[:, 0].tolist() == [1.0, 1.0, 1.0]


def _fields(rows: list[tuple[str, str, str, int, int]]) -> dict:
    """rows of (task, episode, role, turn, prompt hash) -> keyword arguments of group_invariant_problems."""
    return {"task_uids": [r[0] for r in rows], "episodes": [r[1] for r in rows], "roles": [r[2] for r in rows],
            "turns": [r[3] for r in rows], "prompt_hashes": [r[4] for r in rows]}


def test_each_grouping_checks_what_it_implies_and_catches_broken_keys() -> None:
    from verl_mas.advantage.groups import group_invariant_problems

    # Tree sampling, one episode of task a: K=2 candidates per (role, turn) node, one prompt per node.
    tree = [("a", "e0", "x", 0, 10), ("a", "e0", "x", 0, 10), ("a", "e0", "x", 1, 11), ("a", "e0", "x", 1, 11),
            ("a", "e0", "y", 0, 12), ("a", "e0", "y", 0, 12)]
    f = _fields(tree)
    for grouping in ("agent_turn", "agent"):
        keys = [group_key(u, r, t, grouping) for u, r, t in zip(f["task_uids"], f["roles"], f["turns"])]
        ids = group_ids(keys, grouping="trajectory")
        # agent groups span turns (two prompts in group a|x): valid, because each node has one prompt.
        assert group_invariant_problems(ids, keys, grouping=grouping, sampling="tree", **f) == [], grouping
    # Negative controls, each caught by the rows' own fields whatever the key says:
    keys = [group_key(u, r, t) for u, r, t in zip(f["task_uids"], f["roles"], f["turns"])]
    lumped = np.array([0, 0, 0, 0, 1, 1])  # index arithmetic putting turns 0 and 1 of role x together
    (message,) = group_invariant_problems(lumped, keys, grouping="agent_turn", sampling="tree", **f)
    assert "mix turns" in message and "[0, 0, 1, 1]" in message
    roles_mixed = np.array([0, 0, 1, 1, 1, 1])  # role x turn 1 and role y turn 0 in one group
    problems = group_invariant_problems(roles_mixed, keys, grouping="agent", sampling="tree", **f)
    assert len(problems) == 1 and "mix roles" in problems[0]
    bad_prompt = dict(f, prompt_hashes=[10, 99, 11, 11, 12, 12])  # a node whose candidates saw two prompts
    ids = group_ids(keys, grouping="trajectory")
    (message,) = group_invariant_problems(ids, keys, grouping="agent_turn", sampling="tree", **bad_prompt)
    assert "prompt hash" in message and "[10, 99]" in message
    assert group_invariant_problems(ids, keys, grouping="agent_turn", sampling="tree", check_prompts=False,
                                    **bad_prompt) == []
    two_tasks = dict(f, task_uids=["a", "b", "a", "a", "a", "a"])
    assert any("mix tasks" in p for p in group_invariant_problems(
        ids, keys, grouping="agent_turn", sampling="tree", **two_tasks))


def test_parallel_and_trajectory_groups_check_their_definitions() -> None:
    from verl_mas.advantage.groups import group_invariant_problems

    # Parallel sampling: 3 independent episodes of task a, one candidate per node, prompts differ (each
    # episode has its own history) -- the (task, role, turn) group of parallel + agent_turn holds one
    # candidate of each episode.
    par = [("a", f"e{e}", "x", t, 100 * e + t) for e in range(3) for t in range(2)]
    f = _fields(par)
    keys = [group_key(u, r, t) for u, r, t in zip(f["task_uids"], f["roles"], f["turns"])]
    ids = group_ids(keys, grouping="trajectory")
    assert np.bincount(ids).tolist() == [3, 3]
    assert group_invariant_problems(ids, keys, grouping="agent_turn", sampling="parallel", **f) == []
    # Negative control: an episode with two candidates at one node is not parallel sampling.
    twice = _fields(par + [("a", "e0", "x", 0, 0)])
    keys2 = keys + [group_key("a", "x", 0)]
    (message,) = group_invariant_problems(group_ids(keys2, grouping="trajectory"), keys2, grouping="agent_turn",
                                          sampling="parallel", **twice)
    assert "hold several candidates" in message
    # Trajectory: the group is the task, each episode a member of exactly one group.
    tkeys = [group_key(u, r, t, "trajectory", episode=e) for u, e, r, t in
             zip(f["task_uids"], f["episodes"], f["roles"], f["turns"])]
    tids = group_ids([k.rpartition("#")[0] for k in tkeys], grouping="trajectory")
    assert set(tids.tolist()) == {0}
    assert group_invariant_problems(tids, tkeys, grouping="trajectory", sampling="parallel", **f) == []
    split = np.array([0, 1, 0, 0, 0, 0])  # episode e0's two rows in two groups
    assert any("lie in several groups" in p for p in group_invariant_problems(split, tkeys, grouping="trajectory",
                                                                  sampling="parallel", **f))
