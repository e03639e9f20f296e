"""gridwalk-v0: game logic against a BFS oracle, hand-computed rewards, the information split, held-out prompts."""

from __future__ import annotations

import json
import random
from collections import deque

import pytest

from verl_mas.data import draw_splits
from verl_mas.games import gridwalk as gw
from verl_mas.games import plan_path as pp
from verl_mas.games.common import DELTAS, manhattan, split_of
from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow
from verl_mas.tiny import build_workflow_tokenizer
from verl_mas.workflows.gridwalk import (GridwalkSingleWorkflow, GridwalkWorkflow, possible_prompts, prompt_overlap,
                                         scout_prompt, walker_prompt)

# row 0  # . G .      start P (2, 0), goal G (0, 2): 4 moves, the Manhattan distance.
# row 1  . . . .      Straight up from P: (0, 0) is a wall; straight right: (2, 1) is a wall.
# row 2  P # . .      Closer free moves: P -> U; (1, 0) -> R; (1, 1) -> U or R; then R / U onto G.
# row 3  . # . #
TASK = GridwalkWorkflow.example_task
LEVEL = pp.PathLevel.from_task(TASK)


def bfs_distances(level: pp.PathLevel) -> dict[tuple[int, int], int]:
    """Oracle: moves from every reachable cell to the goal."""
    dist, queue = {level.goal: 0}, deque([level.goal])
    while queue:
        cell = queue.popleft()
        for dr, dc in DELTAS.values():
            n = (cell[0] + dr, cell[1] + dc)
            if level.is_free(n) and n not in dist:
                dist[n] = dist[cell] + 1
                queue.append(n)
    return dist


def test_the_example_level_by_hand() -> None:
    assert gw.level_problems(LEVEL) == [] and LEVEL.shortest == 4
    assert gw.blind_walk_blocked(LEVEL) and gw.locally_solvable(LEVEL)
    assert gw.good_moves(LEVEL, (2, 0)) == ["U"]
    assert gw.good_moves(LEVEL, (1, 0)) == ["R"]
    assert gw.good_moves(LEVEL, (1, 1)) == ["U", "R"]
    assert gw.good_moves(LEVEL, (0, 1)) == ["R"] and gw.good_moves(LEVEL, (1, 2)) == ["U"]
    # the window of (2, 0), row by row: (1,-1) off, (1,0) ., (1,1) . | (2,-1) off, (2,1) # |
    # (3,-1) off, (3,0) ., (3,1) #
    assert gw.window(LEVEL, (2, 0)) == ("#", ".", ".", "#", "#", "#", ".", "#")
    assert gw.goal_words((2, 0), (0, 2)) == ("n2", "e2") and gw.goal_words((0, 2), (0, 2)) == ("ns0", "ew0")
    assert gw.goal_words((0, 3), (2, 0)) == ("s2", "w3")


def test_rewards_per_move_by_hand() -> None:
    state = LEVEL.initial_state()  # distance 4
    # up: valid -0.01, shaping 0.99 * -3 - (-4) = 1.03
    assert LEVEL.step(state, ["U"]).reward == pytest.approx(1.02)
    # right: a wall, the walker stays: -0.10 + 0.99 * -4 + 4 = -0.06
    bump = LEVEL.step(state, ["R"])
    assert bump.reward == pytest.approx(-0.06) and bump.state.pos == (2, 0) and bump.invalid == 1
    # down, away from the goal: -0.01 + 0.99 * -5 + 4 = -0.96
    assert LEVEL.step(state, ["D"]).reward == pytest.approx(-0.96)
    # the 4th move onto the goal after 3 good ones: -0.01 + 0 + 1 + goal 1.0 + shortest bonus 0.5
    last = pp.PathState((0, 1), moves_used=3)
    assert LEVEL.step(last, ["R"]).reward == pytest.approx(2.49)
    # the same move after a bump (5 moves used): no shortest bonus
    assert LEVEL.step(pp.PathState((0, 1), moves_used=4), ["R"]).reward == pytest.approx(1.99)


def test_level_problems_name_what_is_wrong() -> None:
    open_grid = pp.PathLevel.from_task({"grid": ["....", "....", "....", "...."], "start": [3, 0], "goal": [0, 3],
                                         "shortest": 6})
    assert any("blind to walls" in p for p in gw.level_problems(open_grid))
    # From (2, 0) up and up again reach (0, 0), whose only move towards the goal, right, is a wall: a pocket,
    # though a shortest path exists (right first).
    pocket = pp.PathLevel.from_task({"grid": [".#..", "....", "....", "...."], "start": [2, 0], "goal": [0, 3],
                                     "shortest": 5})
    assert not gw.locally_solvable(pocket)
    assert any("dead end" in p for p in gw.level_problems(pocket))
    small = pp.PathLevel.from_task({"grid": ["...", "...", "..."], "start": [2, 0], "goal": [0, 2], "shortest": 4})
    assert any("3x3" in p for p in gw.level_problems(small))  # size 3 is not drawn
    detour = pp.PathLevel.from_task({"grid": ["....", "###.", "....", "...."], "start": [2, 0], "goal": [0, 0],
                                     "shortest": 8})
    assert any("longer than the Manhattan" in p for p in gw.level_problems(detour))


def test_generated_levels_against_a_bfs_oracle() -> None:
    rng = random.Random(7)
    for _ in range(300):
        level = gw.generate_level(rng)
        dist = bfs_distances(level)
        assert level.shortest == dist[level.start] == manhattan(level.start, level.goal)
        assert gw.MIN_SHORTEST <= level.shortest <= gw.MAX_SHORTEST and level.rows == level.cols in gw.SIZES
        # From the start, following good moves only (any of them, at every cell): each is a shortest-path move by
        # the oracle and none strands the walker. The window and the goal's direction suffice.
        frontier, seen = [level.start], {level.start}
        while frontier:
            cell = frontier.pop()
            if cell == level.goal:
                continue
            moves = gw.good_moves(level, cell)
            assert moves and dist[cell] == manhattan(cell, level.goal)
            for m in moves:
                nxt = (cell[0] + DELTAS[m][0], cell[1] + DELTAS[m][1])
                assert dist[nxt] == dist[cell] - 1
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert gw.play(level, gw.scripted_scout)  # a scout that sees only its window solves every level
        # Walking straight at the goal (rows first, or columns first) hits a wall: the walker stays put forever.
        for first in ("rows", "cols"):
            def straight(lv: pp.PathLevel, st: pp.PathState, first: str = first) -> str:
                dr, dc = lv.goal[0] - st.pos[0], lv.goal[1] - st.pos[1]
                vertical, horizontal = ("D" if dr > 0 else "U"), ("R" if dc > 0 else "L")
                return (vertical if dr else horizontal) if first == "rows" else (horizontal if dc else vertical)
            assert not gw.play(level, straight)


def test_a_random_walker_heading_for_the_goal_blind_mostly_fails() -> None:
    rng = random.Random(0)
    levels = [gw.generate_level(rng) for _ in range(400)]
    blind = sum(gw.play(lv, gw.blind_walker(random.Random(1))) for lv in levels) / len(levels)
    assert 0.1 < blind < 0.4, blind  # measured 0.28: success needs a shortest path, a bump costs it


def test_each_role_sees_only_its_part() -> None:
    state = LEVEL.initial_state()
    assert scout_prompt(LEVEL, state) == "scout at 2 0 goal n2 e2 # . . # # # . #"
    assert walker_prompt(LEVEL, state, "U") == "walker at 2 0 goal n2 e2 scout up"
    assert walker_prompt(LEVEL, state, None) == "walker at 2 0 goal n2 e2 scout nothing"
    for task in map(json.loads, draw_splits("gridwalk-v0", 20, 5, seed=1)["train"]):
        for prompt in possible_prompts(task):
            words = prompt.split()
            cells = [w for w in words if w in (gw.WALL, gw.FLOOR)]
            if words[0] == "walker" and words[-2] == "scout":  # the team's walker: no wall, no floor
                assert cells == [], prompt
            else:  # the scout and the single agent: the 8 cells of the window, no proposal
                assert len(cells) == 8 and not set(gw.MOVE_WORDS) & set(words), prompt


def test_held_out_levels_render_no_prompt_training_levels_render() -> None:
    splits = draw_splits("gridwalk-v0", 64, 16, seed=0)
    train, test = ([json.loads(t) for t in splits[s]] for s in ("train", "test"))
    n_train, n_test, shared = prompt_overlap(train, test)
    assert n_train > 1000 and n_test > 200 and shared == 0
    assert not {tuple(t["goal"]) for t in train} & {tuple(t["goal"]) for t in test}
    # Control: the same levels split by their content (as Plan-Path's are) share prompts.
    levels = train + test
    by_content = [[t for t in levels if split_of(repr(t)) == s] for s in ("train", "test")]
    assert prompt_overlap(*by_content)[2] > 0


def _guided(role: str, messages: list) -> str:
    """A scout proposing the first good move (it reads the window), a walker doing what the scout proposed."""
    words = messages[-1]["content"].split()
    if role == "walker":
        return words[-1]
    return gw.move_word(gw.scripted_scout(LEVEL, pp.PathState((int(words[2]), int(words[3])))))


def test_a_guided_walker_walks_a_shortest_path() -> None:
    ep = run_workflow(GridwalkWorkflow, TASK, llm=ScriptedLLM(_guided), branching=2, max_turns=8)
    assert not ep.validate()
    assert ep.terminated and ep.num_turns == 4
    assert ep.metrics["mas/success"] == 1.0 and ep.metrics["mas/gridwalk/followed"] == 1.0
    assert ep.metrics["mas/gridwalk/scout_good"] == 1.0 and ep.metrics["mas/gridwalk/bumps"] == 0.0
    (s0, w0), *_, (s3, w3) = ep.turns
    assert [c.local_reward for c in s0.all] == [c.reward for c in s0.all] == [pytest.approx(1.02)] * 2  # no team part
    assert [c.team_reward for c in w0.all] == [pytest.approx(1.02)] * 2
    assert w0.messages[-1]["content"].endswith("scout up")
    assert [c.reward for c in w3.all] == [pytest.approx(2.49)] * 2


def test_a_walker_ignoring_the_scout_bumps_and_runs_out_of_moves() -> None:
    script = ScriptedLLM({"scout": ["up", "right", "zzz"], "walker": ["up", "up", "down", "xyz"]})
    ep = run_workflow(GridwalkWorkflow, TASK, llm=script, branching=4, max_turns=8)
    assert not ep.validate()
    (s0, w0), (s1, w1), *_ = ep.turns
    # scout at P: up 1.02, right (wall) -0.06, zzz unparsable -0.10, up 1.02 -> the first up is committed
    assert [c.local_reward for c in s0.all] == [pytest.approx(r) for r in (1.02, -0.06, -0.10, 1.02)]
    assert [c.parse_failed for c in s0.all] == [False, False, True, False]
    # walker: up 1.02, up 1.02, down -0.96, xyz -0.10; up committed -> (1, 0); then up is a wall
    assert [c.team_reward for c in w0.all] == [pytest.approx(r) for r in (1.02, 1.02, -0.96, -0.10)]
    assert w1.messages[-1]["content"].startswith("walker at 1 0 goal n1 e2 scout")
    # From (1, 0) up is a wall: up -0.10 + 0.99 * -3 + 3 = -0.07 beats down (-0.97) and xyz (-0.10): three bumps
    assert [c.team_reward for c in w1.all] == [pytest.approx(r) for r in (-0.07, -0.07, -0.97, -0.10)]
    assert ep.terminated and ep.num_turns == gw.budget(LEVEL) == 4
    assert (ep.metrics["mas/success"], ep.metrics["mas/gridwalk/bumps"]) == (0.0, 3.0)


@pytest.mark.parametrize("cls", [GridwalkWorkflow, GridwalkSingleWorkflow])
def test_check_workflow_with_the_tailored_tokenizer(cls: type) -> None:
    check_workflow(cls, max_turns=8, tokenizer=build_workflow_tokenizer(cls))


def test_the_single_agent_sees_both_parts_and_plays_alone() -> None:
    def single(role: str, messages: list) -> str:
        r, c = map(int, messages[-1]["content"].split()[2:4])
        return gw.move_word(gw.scripted_scout(LEVEL, pp.PathState((r, c))))

    ep = run_workflow(GridwalkSingleWorkflow, TASK, llm=ScriptedLLM(single), branching=2, max_turns=8)
    assert [g.role for turn in ep.turns for g in turn] == ["walker"] * 4
    assert ep.turns[0][0].messages[-1]["content"] == "walker at 2 0 goal n2 e2 # . . # # # . #"
    assert ep.metrics["mas/success"] == 1.0
