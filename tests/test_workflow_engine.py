"""Semantics of the episode engine: conditioning, commits, simultaneous roles, rewards, failures, groups.

Expected rewards are derived by hand from the toy workflows' documented rules (verl_mas/workflows/toy.py):
- WalkWorkflow planner: local = 1 if the plan points toward the goal, else 0.
- WalkWorkflow mover: team = 1 if the move reaches the goal; local = 0.5*[move == plan]
  + 0.25*(|goal - pos| - |goal - new_pos|); reward = alpha*team + local. Unparsable: step 0.
- AgreeWorkflow: local = 0.5 for a valid word; team = 1 if it equals the other role's last committed word.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from verl_mas import (
    Candidate,
    EpisodeConfig,
    GenerateRequest,
    InfraError,
    LLMClientError,
    Sample,
    Workflow,
    WorkflowError,
    group_key,
    system,
    user,
)
from verl_mas.testing import ScriptedLLM, arun_workflow, default_tokenizer
from verl_mas.workflows.toy import AgreeWorkflow, WalkWorkflow


def _decoded_prompt(req: GenerateRequest) -> str:
    return default_tokenizer().decode(req.prompt_ids)


def _requests(llm: ScriptedLLM, role: str) -> list[GenerateRequest]:
    return [r for r in llm.requests if r.role == role]


# --------------------------------------------------------------------------------------------------
# Same-turn conditioning and commit-don't-collapse.


async def test_later_role_sees_what_the_earlier_role_committed_this_turn():
    # Planner candidates: "left" (reward 0: the goal 2 is to the right of 0), "right" (1), "up" (0, unparsable),
    # "right" (1). best() commits index 1, the first of the two ties, so the mover must read "right", not "left".
    llm = ScriptedLLM({"planner": ["left", "right", "up", "right"], "mover": ["right"]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=4)

    planner0 = episode.turns[0][0]
    assert planner0.rewards == [0.0, 1.0, 0.0, 1.0]
    assert planner0.committed.index == 1
    mover_req = _requests(llm, "mover")[0]
    assert "The planner says: right." in mover_req.messages[-1]["content"]
    assert "The planner says: right." in _decoded_prompt(mover_req)  # the ids sent to the model, not just the text


async def test_only_the_committed_candidate_changes_the_state_and_later_roles_are_scored_against_it():
    # Turn 0, pos 0, goal 2, plan "right" (+1). Mover candidates on clones of pos:
    #   "left"  -> new -1: team 0, local 0.5*0 + 0.25*(2-3) = -0.25
    #   "left"  -> -0.25
    #   "right" -> new 1:  team 0, local 0.5 + 0.25*(2-1) = 0.75   <- best, committed
    #   "stay"  -> unparsable, new 0: team 0, local 0 + 0 = 0.0
    # Had the engine applied candidate 0 (or every candidate), turn 1 would start at -1 (or elsewhere).
    # Turn 1, pos 1: "left" -> new 0: 0.25*(1-2) = -0.25; "right" -> new 2 = goal: team 1 + 0.75 = 1.75.
    llm = ScriptedLLM({"planner": ["right"], "mover": ["left", "left", "right", "stay"]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=4)

    movers = [g for g in episode.groups if g.role == "mover"]
    assert movers[0].rewards == [-0.25, -0.25, 0.75, 0.0]
    assert movers[0].committed.index == 2
    assert "You are at 1;" in _requests(llm, "mover")[1].messages[-1]["content"]
    assert movers[1].rewards == [-0.25, -0.25, 1.75, 0.0]
    # The later role's rewards differ within every group (docs/algorithm.md §5, pitfall 2: identical rewards,
    # zero advantage).
    assert all(len(set(g.rewards)) > 1 for g in movers)
    assert episode.terminated and not episode.truncated and episode.num_turns == 2
    assert [c.committed for c in movers[0].all] == [False, False, True, False]
    assert movers[0].all[3].parse_failed and episode.metrics["mas/mover/parse_failures"] == 2.0


async def test_simultaneous_roles_act_on_the_same_state():
    # Turn 0 (nothing committed yet, so every team reward is 0):
    #   alice red/blue/purple/red -> [0.5, 0.5, 0, 0.5], commit "red";
    #   bob blue/blue/red/x -> [0.5, 0.5, 0.5, 0], commit "blue".
    # Turn 1 (alice's last "red", bob's last "blue"):
    #   alice: red .5, blue 1+.5, purple 0, red .5 -> commit "blue";
    #   bob: blue .5, blue .5, red 1+.5, x 0 -> commit "red".
    # They swap forever, so the episode is truncated after max_turns = 3.
    llm = ScriptedLLM({"alice": ["red", "blue", "purple", "red"], "bob": ["blue", "blue", "red", "x"]}, latency_s=0.02)
    episode = await arun_workflow(AgreeWorkflow, {"words": ["red", "green", "blue"]}, llm, branching=4, max_turns=3)

    t0, t1 = episode.turns[0], episode.turns[1]
    assert [g.role for g in t0] == ["alice", "bob"]
    assert [g.rewards for g in t0] == [[0.5, 0.5, 0.0, 0.5], [0.5, 0.5, 0.5, 0.0]]
    assert [g.rewards for g in t1] == [[0.5, 1.5, 0.0, 0.5], [0.5, 0.5, 1.5, 0.0]]
    assert [g.committed.text for g in t1] == ["blue", "red"]
    # Same state: in turn 1 each prompt holds the other's turn-0 word, never its turn-1 word.
    assert "bob said: blue" in t1[0].messages[-1]["content"] and "alice said: red" in t1[1].messages[-1]["content"]
    # Both groups of a turn were in flight together: 2 groups x K=4 sample requests.
    assert llm.peak_in_flight == 8
    assert episode.truncated and not episode.terminated and episode.num_turns == 3


# --------------------------------------------------------------------------------------------------
# Rewards.


@pytest.mark.parametrize(("alpha", "expected"), [(1.0, 1.75), (0.5, 1.25), (0.0, 0.75)])
async def test_reward_mixes_team_and_local_with_alpha(alpha, expected):
    # Turn 1 mover "right" reaches the goal: team 1, local 0.75 -> alpha * 1 + 0.75.
    llm = ScriptedLLM({"planner": ["right"], "mover": ["right"]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=2, alpha=alpha)
    winner = episode.turns[1][1].committed
    assert (winner.team_reward, winner.local_reward) == (1.0, 0.75)
    assert winner.reward == pytest.approx(expected)


def _candidate(alpha: float = 1.0) -> Candidate:
    return Candidate(
        role="r",
        turn=0,
        index=0,
        group_key="t|r|0",
        prompt_ids=[1],
        response_ids=[2],
        logprobs=[0.0],
        text="x",
        alpha=alpha,
    )


def test_candidate_reward_rules():
    c = _candidate(alpha=2.0)
    assert c.reward is None
    c.local_reward = 0.25
    assert c.reward == 0.25  # a missing team part counts as 0
    c.team_reward = 1
    assert c.reward == 2.25 and isinstance(c.team_reward, float)
    with pytest.raises(ValueError, match="either reward or team_reward/local_reward|would contradict"):
        c.reward = 1.0
    d = _candidate()
    d.reward = 3
    with pytest.raises(ValueError, match="not both"):
        d.team_reward = 1.0
    for bad in (math.nan, math.inf, None, "1", True):
        with pytest.raises(ValueError, match="finite float"):
            _candidate().reward = bad


class _ConstantWorkflow(Workflow):
    """Every candidate gets the same reward: best() must break ties."""

    roles = ("solo",)

    async def run(self, task):
        group = await self.generate("solo", [user("say anything")])
        for c in group:
            c.reward = 1.0
        group.best()


async def test_tie_break_first_and_seeded_random():
    first = await arun_workflow(_ConstantWorkflow, {}, ScriptedLLM({"solo": ["a"]}), branching=4)
    assert first.groups[0].committed.index == 0

    async def chosen(seed):
        ep = await arun_workflow(
            _ConstantWorkflow, {}, ScriptedLLM({"solo": ["a"]}), branching=4, seed=seed, tie_break="random"
        )
        return ep.groups[0].committed.index

    picks = [await chosen(s) for s in range(12)]
    assert picks == [await chosen(s) for s in range(12)]  # seeded: reproducible
    assert len(set(picks)) > 1  # and actually random across seeds


class _InfoWorkflow(Workflow):
    """The solver's candidates keep their parsed number in ``info``; the reader is told the committed one's."""

    roles = ("solver", "reader")

    async def run(self, task):
        solvers = await self.generate("solver", [user("Say a number.")])
        for c in solvers:
            value = int(c.text) if c.text.strip().isdigit() else None
            c.info["value"] = value
            c.reward = float(value or 0)
        readers = await self.generate("reader", [user(f"The solver said {solvers.best().info['value']}.")])
        for c in readers:
            c.reward = 0.0


async def test_info_set_while_scoring_is_read_back_from_the_committed_candidate():
    llm = ScriptedLLM({"solver": ["3", "7", "x", "5"], "reader": ["ok"]})
    episode = await arun_workflow(_InfoWorkflow, {}, llm, branching=4)
    solvers, readers = episode.groups
    assert solvers.committed.index == 1 and solvers.committed.info == {"value": 7}
    assert episode.committed_branch[0].info["value"] == 7  # the episode record keeps it
    assert "The solver said 7." in _requests(llm, "reader")[0].messages[-1]["content"]
    # Control: every candidate keeps its own data, and a candidate the workflow stored nothing on has an empty dict.
    assert [c.info for c in solvers.all] == [{"value": 3}, {"value": 7}, {"value": None}, {"value": 5}]
    assert all(c.info == {} for c in readers.all)
    assert len({id(c.info) for c in episode.candidates}) == len(episode.candidates)  # no dict shared


# --------------------------------------------------------------------------------------------------
# Failures: model mistakes, infrastructure, workflow bugs, client bugs.


async def test_partial_infrastructure_failure_marks_candidates_untrainable_and_counts_them():
    llm = ScriptedLLM({"planner": ["right"], "mover": ["right", InfraError("HTTP 503"), "left", "right"]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=4)

    mover0 = episode.turns[0][1]
    assert len(mover0.all) == 4 and len(mover0) == 3  # iteration skips the lost candidate
    lost = mover0.all[1]
    assert (lost.trainable, lost.response_ids, lost.reward) == (False, [], None)
    assert "HTTP 503" in lost.infra_error
    assert episode.metrics["mas/infra_failures"] == 2.0  # one per mover group, 2 turns
    assert not episode.aborted and episode.terminated
    assert len(episode.trainable()) == 16 - 2
    assert "NOT TRAINABLE" in episode.transcript()


async def test_a_group_lost_entirely_aborts_the_episode_and_keeps_completed_groups():
    llm = ScriptedLLM({"planner": ["right"], "mover": [InfraError("replica died")]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=4)

    assert episode.aborted and not episode.terminated and not episode.truncated
    assert "replica died" in episode.error
    assert [c.role for c in episode.trainable()] == ["planner"] * 4  # the completed planner group
    assert all(not c.trainable for c in episode.turns[0][1].all)
    assert episode.metrics["mas/infra_failures"] == 4.0 and episode.metrics["mas/aborted"] == 1.0
    assert episode.validate() == []


class _Hang:
    tokenizer = None

    async def generate(self, request):
        await asyncio.sleep(3600)


async def test_request_timeout_is_an_infrastructure_failure():
    episode = await arun_workflow(_ConstantWorkflow, {}, _Hang(), branching=2, request_timeout_s=0.05)
    assert episode.aborted and "TimeoutError" in episode.error
    assert all(not c.trainable and "TimeoutError" in c.infra_error for c in episode.candidates)


class _BuggyClient:
    def __init__(self, result):
        self.result = result

    async def generate(self, request):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (ValueError("oops"), "raised ValueError"),
        ([Sample(token_ids=[5, 2])], "returned 1 samples for n=2"),
        ([Sample(token_ids=[5, 2], logprobs=[0.0])] * 2, "1 log-probs for 2 tokens"),
        ([Sample(token_ids=[5, 2], logprobs=[0.0, math.nan])] * 2, "finite log-prob"),
    ],
)
async def test_client_contract_violations_raise_llm_client_error(result, match):
    with pytest.raises(LLMClientError, match=match):
        await arun_workflow(_ConstantWorkflow, {}, _BuggyClient(result), branching=2)


async def test_workflow_bug_raises_workflow_error_naming_workflow_role_and_turn():
    class Broken(Workflow):
        roles = ("planner", "mover")

        async def run(self, task):
            for turn in self.turns():
                plans = await self.generate("planner", [user("plan")])
                for p in plans:
                    p.reward = 0.0
                plans.best()
                if turn == 1:
                    return 1 / 0

    with pytest.raises(WorkflowError) as info:
        await arun_workflow(Broken, {}, ScriptedLLM({"planner": ["x"]}), branching=2)
    message = str(info.value)
    assert "Broken" in message and "role 'planner'" in message and "turn 1" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


async def test_unrewarded_candidates_raise_with_what_why_fix():
    class Forgetful(Workflow):
        roles = ("solo",)

        async def run(self, task):
            group = await self.generate("solo", [user("hi")])
            group[0].reward = 1.0  # candidates 1 and 2 left unrewarded
            group.best()

    with pytest.raises(WorkflowError, match=r"candidates \[1, 2\] have no reward.*set candidate.reward"):
        await arun_workflow(Forgetful, {}, ScriptedLLM({"solo": ["a"]}), branching=3)

    class NeverRewards(Workflow):
        roles = ("solo",)

        async def run(self, task):
            await self.generate("solo", [user("hi")])

    with pytest.raises(WorkflowError, match="2 unrewarded candidates.*needs a finite reward"):
        await arun_workflow(NeverRewards, {}, ScriptedLLM({"solo": ["a"]}), branching=2)


async def test_role_misuse_raises():
    class Twice(Workflow):
        roles = ("solo",)

        async def run(self, task):
            for _ in range(2):  # no self.turns(): both calls land in turn 0
                g = await self.generate("solo", [user("hi")])
                for c in g:
                    c.reward = 0.0

    with pytest.raises(WorkflowError, match="generated twice in turn 0.*self.turns"):
        await arun_workflow(Twice, {}, ScriptedLLM({"solo": ["a"]}), branching=2)

    class Undeclared(Workflow):
        roles = ("solo",)

        async def run(self, task):
            await self.generate("ghost", [user("hi")])

    with pytest.raises(WorkflowError, match=r"role 'ghost'.*Declared roles: \('solo',\)"):
        await arun_workflow(Undeclared, {}, ScriptedLLM({"ghost": ["a"]}), branching=2)


async def test_non_float_metric_raises():
    class BadMetric(_ConstantWorkflow):
        async def run(self, task):
            await super().run(task)
            self.metrics["mas/oops"] = "high"

    with pytest.raises(WorkflowError, match="not finite numbers"):
        await arun_workflow(BadMetric, {}, ScriptedLLM({"solo": ["a"]}), branching=2)


# --------------------------------------------------------------------------------------------------
# Episode records: groups, termination, branching=1.


async def test_groups_share_one_prompt_and_a_stable_key():
    llm = ScriptedLLM({"planner": ["right", "left"], "mover": ["right", "left"]})
    episode = await arun_workflow(WalkWorkflow, {"start": 0, "goal": 2}, llm, branching=4, task_uid="t42")
    assert [g.key for g in episode.groups] == [group_key("t42", r, t) for t in (0, 1) for r in ("planner", "mover")]
    for group, request in zip(episode.groups, llm.requests, strict=True):
        assert request.group_key == group.key and request.n == 4
        assert all(c.prompt_ids == request.prompt_ids for c in group.all)  # identical prompt ids per group
        assert [c.index for c in group.all] == [0, 1, 2, 3]
    # One group per (role, turn): turn 1's planner prompt is longer (history), so groups differ across turns.
    assert episode.groups[0].prompt_ids != episode.groups[2].prompt_ids
    assert episode.validate() == []


async def test_terminated_and_truncated():
    reach = await arun_workflow(
        WalkWorkflow, {"start": 0, "goal": 2}, ScriptedLLM({"planner": ["right"], "mover": ["right"]})
    )
    assert (reach.terminated, reach.truncated, reach.num_turns) == (True, False, 2)
    far = await arun_workflow(
        WalkWorkflow, {"start": 0, "goal": 9}, ScriptedLLM({"planner": ["right"], "mover": ["right"]}), max_turns=3
    )
    assert (far.terminated, far.truncated, far.num_turns) == (False, True, 3)
    assert far.metrics["mas/success"] == 0.0 and far.metrics["mas/truncated"] == 1.0


async def test_branching_one():
    episode = await arun_workflow(
        WalkWorkflow, {"start": 0, "goal": 1}, ScriptedLLM({"planner": ["right"], "mover": ["right"]}), branching=1
    )
    assert [len(g.all) for g in episode.groups] == [1, 1]
    assert all(c.committed for c in episode.candidates) and episode.terminated


def test_config_reports_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        EpisodeConfig(branching=0, max_turns=0, alpha=math.nan, tie_break="best", request_timeout_s=-1)
    message = str(info.value)
    assert "5 problems" in message
    for part in ("branching is 0", "max_turns is 0", "alpha is nan", "tie_break is 'best'", "request_timeout_s is -1"):
        assert part in message


async def test_system_prompt_belongs_to_the_workflow():
    class Prompted(_ConstantWorkflow):
        async def run(self, task):
            g = await self.generate("solo", [system("You are the solo role."), user("go")])
            for c in g:
                c.reward = 0.0

    llm = ScriptedLLM({"solo": ["a"]})
    await arun_workflow(Prompted, {}, llm, branching=1)
    text = _decoded_prompt(llm.requests[0])
    expected = "<|im_start|>system\nYou are the solo role.<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"


def test_a_sandbox_failure_inside_a_workflow_aborts_the_episode_without_training_on_it() -> None:
    """An infrastructure failure raised by workflow code (the sandbox) is not blamed on the workflow."""
    from verl_mas.sandbox import SandboxError
    from verl_mas.testing import ScriptedLLM, run_workflow

    class Runner(Workflow):
        roles = ("coder",)

        async def run(self, task: dict) -> None:
            for turn in self.turns():
                group = await self.generate("coder", [{"role": "user", "content": f"code, turn {turn}"}])
                if turn == 1:
                    # Scoring this group needs the sandbox, which fails: nothing of it can be rewarded.
                    raise SandboxError("the fork server died")
                for c in group:
                    c.reward = 1.0
                group.best()

    episode = run_workflow(Runner, {}, llm=ScriptedLLM({"coder": ["print(1)"]}), branching=2, max_turns=2)
    assert episode.aborted and "fork server died" in (episode.error or "")
    # The group completed before the failure is kept and trainable; the unrewarded one is not.
    trainable = [c for c in episode.candidates if c.trainable]
    assert len(trainable) == 2 and all(c.reward == 1.0 for c in trainable)
