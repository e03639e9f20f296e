"""The game workflows end to end: conformance, scripted tool -> planner episodes through the real sandbox,
model-code failures as rewards, sandbox failures propagating, and disjoint train/test datasets."""

from __future__ import annotations

import random
from typing import Any

import pytest

from verl_mas.games import sudoku as sd
from verl_mas.registry import get_workflow
from verl_mas.sandbox import SandboxError
from verl_mas.testing import ScriptedLLM, check_workflow, run_workflow
from verl_mas.workflows.plan_path import PlanPathWorkflow
from verl_mas.workflows.sokoban import SokobanWorkflow
from verl_mas.workflows.sudoku import SudokuWorkflow

GAME_IDS = [
    "sudoku-v0", "sudoku-9x9-v0", "sudoku-single-v0",
    "sokoban-v0", "sokoban-single-v0",
    "plan-path-v0", "plan-path-single-v0",
]

# Tool programs a competent tool role would write (they run in the real sandbox).
PATH_BFS = """
import sys
from collections import deque
g = [l.rstrip("\\n") for l in sys.stdin if l.strip()]
R, C = len(g), len(g[0])
s = next((r, c) for r in range(R) for c in range(C) if g[r][c] == "P")
t = next((r, c) for r in range(R) for c in range(C) if g[r][c] == "G")
prev = {s: None}
q = deque([s])
while q:
    u = q.popleft()
    if u == t:
        break
    for m, (dr, dc) in {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}.items():
        v = (u[0] + dr, u[1] + dc)
        if 0 <= v[0] < R and 0 <= v[1] < C and g[v[0]][v[1]] != "#" and v not in prev:
            prev[v] = (u, m)
            q.append(v)
path, u = [], t
while prev[u]:
    u, m = prev[u]
    path.append(m)
print(path[::-1])
"""

SOKOBAN_BFS = """
import sys
from collections import deque
g = [l.rstrip("\\n") for l in sys.stdin if l.strip()]
cells = {(r, c): ch for r, row in enumerate(g) for c, ch in enumerate(row)}
walls = {p for p, ch in cells.items() if ch == "#"}
goals = {p for p, ch in cells.items() if ch in "O*S"}
boxes = frozenset(p for p, ch in cells.items() if ch in "X*")
player = next(p for p, ch in cells.items() if ch in "PS")
start = (player, boxes)
prev = {start: None}
q = deque([start])
while q:
    st = q.popleft()
    if st[1] <= goals:
        break
    (pr, pc), bs = st
    for m, (dr, dc) in {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}.items():
        n = (pr + dr, pc + dc)
        if n in walls:
            continue
        nb = bs
        if n in bs:
            b2 = (n[0] + dr, n[1] + dc)
            if b2 in walls or b2 in bs:
                continue
            nb = (bs - {n}) | {b2}
        nxt = (n, nb)
        if nxt not in prev:
            prev[nxt] = (st, m)
            q.append(nxt)
moves = []
while prev[st]:
    st, m = prev[st]
    moves.append(m)
print(" ".join(reversed(moves)))
"""

SUDOKU_SOLVER = """
import sys
g = [[int(ch) for ch in l.strip()] for l in sys.stdin if l.strip()]
n = len(g)
b = int(n ** 0.5)
def ok(r, c, v):
    if v in g[r] or any(g[i][c] == v for i in range(n)):
        return False
    br, bc = r - r % b, c - c % b
    return all(g[br + i][bc + j] != v for i in range(b) for j in range(b))
def solve():
    for r in range(n):
        for c in range(n):
            if g[r][c] == 0:
                for v in range(1, n + 1):
                    if ok(r, c, v):
                        g[r][c] = v
                        if solve():
                            return True
                        g[r][c] = 0
                return False
    return True
solve()
print("\\n".join("".join(map(str, row)) for row in g))
"""


def fenced(code: str) -> str:
    return f"Here is the program.\n```python\n{code}```\n"


def copy_tool_answer(tool_code: str) -> Any:
    """A script: the tool writes ``tool_code``; the planner repeats the action the tool proposed."""

    def script(role: str, messages: list[dict[str, Any]]) -> str:
        if role == "tool":
            return fenced(tool_code)
        text = messages[-1]["content"]
        return text.split("Action proposed by the tool:")[1].split("Your action?")[0].strip()

    return script


# ---------------------------------------------------------------------------------------------------
# Conformance (random text: workflows must survive garbage).


@pytest.mark.parametrize("workflow_id", GAME_IDS)
def test_check_workflow(workflow_id: str) -> None:
    cls = get_workflow(workflow_id)
    task = cls.generate_task(random.Random(0), "train")
    check_workflow(cls, task)


def test_registered_ids_and_roles() -> None:
    assert get_workflow("sudoku-v0") is SudokuWorkflow
    for wid in GAME_IDS:
        assert get_workflow(wid).roles == (("planner",) if "single" in wid else ("tool", "planner"))


# ---------------------------------------------------------------------------------------------------
# Scripted episodes: a correct tool program, copied by the planner -> solved in one turn.


@pytest.mark.parametrize(
    ("cls", "code", "expected"),
    [
        # plan-path example: 7 moves -0.07, shaping +3, goal +1, shortest +0.5 (tests/test_games_logic.py).
        (PlanPathWorkflow, PATH_BFS, 4.43),
        # sokoban example: 5 moves -0.05, box on goal +1, shaping 0.1 * 2, solved +10.
        (SokobanWorkflow, SOKOBAN_BFS, 11.15),
        # sudoku example: solved +1, progress 0.5 * (1 - 0).
        (SudokuWorkflow, SUDOKU_SOLVER, 1.5),
    ],
)
def test_scripted_tool_and_planner_solve(cls: type, code: str, expected: float) -> None:
    ep = run_workflow(cls, cls.example_task, llm=ScriptedLLM(copy_tool_answer(code)), branching=2)
    assert not ep.validate()
    assert ep.metrics["mas/success"] == 1.0
    assert ep.terminated and ep.num_turns == 1
    tool, planner = ep.turns[0]
    assert [c.local_reward for c in tool.all] == pytest.approx([expected] * 2)
    assert all(c.team_reward is None for c in tool.all)
    assert [c.team_reward for c in planner.all] == pytest.approx([expected] * 2)
    assert not any(c.parse_failed for c in ep.candidates)
    # Same-turn conditioning: the planner's prompt holds the tool's committed program.
    assert "from collections import deque" in planner.messages[-1]["content"] or cls is SudokuWorkflow


def test_scripted_generated_sudoku_9x9_and_sokoban() -> None:
    task = get_workflow("sudoku-9x9-v0").generate_task(random.Random(1), "test")
    ep = run_workflow("sudoku-9x9-v0", task, llm=ScriptedLLM(copy_tool_answer(SUDOKU_SOLVER)), branching=1)
    assert ep.metrics["mas/success"] == 1.0
    task = SokobanWorkflow.generate_task(random.Random(2), "train")
    ep = run_workflow(SokobanWorkflow, task, llm=ScriptedLLM(copy_tool_answer(SOKOBAN_BFS)), branching=1)
    assert ep.metrics["mas/success"] == 1.0


def test_only_the_planner_moves_the_state() -> None:
    # The tool proposes the full shortest path, the planner commits only ["R"].
    def script(role: str, messages: list[dict[str, Any]]) -> str:
        return fenced(PATH_BFS) if role == "tool" else '["R"]'

    ep = run_workflow(PlanPathWorkflow, PlanPathWorkflow.example_task, llm=ScriptedLLM(script), branching=2, max_turns=2)
    assert ep.truncated and ep.metrics["mas/success"] == 0.0
    (tool0, plan0), (tool1, _plan1) = ep.turns
    assert tool0.committed.local_reward == pytest.approx(4.43)  # scored on a copy: the state did not move
    # Planner ["R"]: -0.01 + 0.99 * -2 - (-3) = 1.01.
    assert plan0.committed.team_reward == pytest.approx(1.01)
    assert "P#G" in tool1.messages[-1]["content"]  # turn 1 sees the walker on (0,1): row ".P#G"
    # Turn 1 tool: 6 moves from (0,1), 7 in the episode == shortest: -0.06 + (0 - (-2)) + 1 + 0.5 = 3.44.
    assert tool1.committed.local_reward == pytest.approx(3.44)


# A reply that explains its plan in a ```text block before the program. The games' former fence regex took the closing
# fence of the text block for an opening one and ran the prose between the blocks ("The program:") as the tool's
# program; code-v0's regex took the program. Every role now reads programs with verl_mas.workflows.common.extract_code.
EXPLAINED = f"Plan:\n```text\nBFS from P to G\n```\nThe program:\n```python\n{PATH_BFS}```\n"


def test_a_reply_parses_the_same_for_the_games_tool_and_the_coder() -> None:
    import re

    from verl_mas.workflows.code import CodeSingleWorkflow
    from verl_mas.workflows.common import extract_code

    assert extract_code(EXPLAINED) == PATH_BFS
    # Control: what the games' tool used to extract from the same reply.
    old_games_fence = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
    assert old_games_fence.findall(EXPLAINED) == ["The program:\n"]

    llm = ScriptedLLM({"tool": EXPLAINED, "planner": '["R"]'})
    tool = run_workflow(PlanPathWorkflow, PlanPathWorkflow.example_task, llm=llm, branching=1, max_turns=1).turns[0][0]
    coder_ep = run_workflow(CodeSingleWorkflow, CodeSingleWorkflow.example_task, llm=ScriptedLLM({"coder": EXPLAINED}),
                            branching=1)
    coder = coder_ep.turns[0][0]
    assert tool.committed.info["proposal"].code == coder.committed.info["code"] == PATH_BFS
    assert not tool.committed.parse_failed and not coder.committed.parse_failed
    assert tool.committed.local_reward == pytest.approx(4.43)  # the program ran: the shortest path (see above)


# ---------------------------------------------------------------------------------------------------
# Failures: the model's are rewards, the sandbox's propagate.


class FastTimeoutPath(PlanPathWorkflow):
    tool_timeout_s = 2.0  # generous: a loaded machine must not turn the crash case into a timeout


def test_failing_tool_programs_are_parse_failures() -> None:
    tool_replies = [fenced("1/0\n"), fenced("while True:\n    pass\n"), "no code at all", fenced("print('hello')\n")]
    llm = ScriptedLLM({"tool": tool_replies, "planner": "garbage"})
    ep = run_workflow(FastTimeoutPath, PlanPathWorkflow.example_task, llm=llm, branching=4, max_turns=1)
    tool, planner = ep.turns[0]
    assert [c.parse_failed for c in tool.all] == [True] * 4
    assert [c.local_reward for c in tool.all] == [-0.10] * 4  # plan-path's unparsable penalty
    assert [c.team_reward for c in planner.all] == [-0.10] * 4 and all(c.parse_failed for c in planner.all)
    note = planner.messages[-1]["content"]
    assert "ZeroDivisionError" in note and "none (no valid action" in note  # the committed (first) program's crash


def test_sandbox_failure_aborts_the_episode_and_is_never_a_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise SandboxError("fork server died")

    monkeypatch.setattr("verl_mas.workflows.tool_planner.run_python", broken)
    llm = ScriptedLLM({"tool": fenced("print(1)\n"), "planner": '["R"]'})
    episode = run_workflow(PlanPathWorkflow, PlanPathWorkflow.example_task, llm=llm, branching=2)
    # An infrastructure failure: the episode is aborted and the unscored tool group is not trainable.
    assert episode.aborted and "fork server died" in (episode.error or "")
    assert not any(c.trainable for c in episode.candidates)


def test_bad_task_raises_with_fix() -> None:
    with pytest.raises(Exception, match="unique solution"):
        run_workflow(SudokuWorkflow, {"size": 4, "puzzle": ["0000"] * 4, "solution": SudokuWorkflow.example_task["solution"]})


# ---------------------------------------------------------------------------------------------------
# Datasets: train and test are disjoint by content.


@pytest.mark.parametrize("workflow_id", ["sudoku-v0", "sokoban-v0", "plan-path-v0"])
def test_train_and_test_disjoint(workflow_id: str, tmp_path: Any) -> None:
    from verl_mas.data import canonical_json, read_tasks, write_dataset

    train_path, test_path = write_dataset(workflow_id, tmp_path, train=60, test=20, seed=0)
    train, test = read_tasks(train_path), read_tasks(test_path)
    assert len(train) == 60 and len(test) == 20
    # Compare contents (sudoku: the solution grid, a stronger key than the puzzle), never seeds.
    key = (lambda t: "".join(t["solution"])) if workflow_id.startswith("sudoku") else canonical_json
    assert not {key(t) for t in train} & {key(t) for t in test}  # sudoku: not even a shared solution grid
    cls = get_workflow(workflow_id)
    cls.load(test[0])  # tasks read back are valid
    # The generator itself never hands a test puzzle to training, whatever the seed.
    rng = random.Random(123)
    drawn = {key(cls.generate_task(rng, "train")) for _ in range(200)}
    assert not drawn & {key(t) for t in test}


def test_generate_task_rejects_unknown_split() -> None:
    with pytest.raises(ValueError, match="split is 'val'"):
        SudokuWorkflow.generate_task(random.Random(0), "val")


def test_sudoku_generator_is_seeded() -> None:
    a = SudokuWorkflow.generate_task(random.Random(5), "train")
    b = SudokuWorkflow.generate_task(random.Random(5), "train")
    assert a == b and sd.count_solutions(sd.grid_from_rows(a["puzzle"])) == 1
