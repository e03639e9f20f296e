"""The test doubles users rely on: ScriptedLLM, RandomLLM, run_workflow, check_workflow and the CLI."""

from __future__ import annotations

import ast
import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest

import verl_mas.testing
from verl_mas import GenerateRequest, InfraError, Workflow, user
from verl_mas.run import main as cli_main
from verl_mas.testing import (
    RandomLLM,
    ScriptedLLM,
    WorkflowCheckError,
    check_workflow,
    default_tokenizer,
    run_workflow,
)
from verl_mas.workflows.toy import AgreeWorkflow, WalkWorkflow


def _request(role="r", n=3, messages=(), seed=0):
    return GenerateRequest(
        role=role, prompt_ids=[1, 2], n=n, group_key=f"t|{role}|0", session_id="s", seed=seed, messages=tuple(messages)
    )


async def test_scripted_llm_cycles_per_role_replies_through_the_tokenizer():
    tok = default_tokenizer()
    llm = ScriptedLLM({"r": ["left", "right"], "q": "up"}, tokenizer=tok, logprob=-0.5)
    first = await llm.generate(_request("r"))
    second = await llm.generate(_request("r"))
    texts = [tok.decode(s.token_ids, skip_special_tokens=True) for s in first + second]
    assert texts == ["left", "right", "left", "right", "left", "right"]  # one cursor per role, across requests
    assert first[0].token_ids == tok.encode("left", add_special_tokens=False) + [tok.eos_token_id]
    assert first[0].logprobs == [-0.5] * len(first[0].token_ids)
    assert [tok.decode(s.token_ids, skip_special_tokens=True) for s in await llm.generate(_request("q", n=2))] == [
        "up",
        "up",
    ]
    with pytest.raises(ValueError, match="no replies for role 'x'"):
        await llm.generate(_request("x"))


async def test_scripted_llm_exception_reply_fails_that_sample_only():
    llm = ScriptedLLM({"r": ["ok", InfraError("503")]}, tokenizer=default_tokenizer())
    samples = await llm.generate(_request("r", n=2))
    assert samples[0].error is None and "503" in samples[1].error and samples[1].token_ids == []


@pytest.mark.parametrize("is_async", [False, True])
async def test_scripted_llm_callable_sees_role_and_messages(is_async):
    seen = []

    def reply(role, messages):
        seen.append((role, messages[-1]["content"]))
        return f"{role} heard {len(messages)}"

    async def areply(role, messages):
        await asyncio.sleep(0)
        return reply(role, messages)

    llm = ScriptedLLM(areply if is_async else reply, tokenizer=default_tokenizer())
    samples = await llm.generate(_request("r", n=2, messages=[user("hi")]))
    assert seen == [("r", "hi"), ("r", "hi")]  # once per candidate
    assert default_tokenizer().decode(samples[0].token_ids, skip_special_tokens=True) == "r heard 1"


async def test_random_llm_is_reproducible_per_request_seed():
    tok = default_tokenizer()
    a = await RandomLLM(7, tokenizer=tok).generate(_request(n=4, seed=11))
    b = await RandomLLM(7, tokenizer=tok).generate(_request(n=4, seed=11))
    c = await RandomLLM(7, tokenizer=tok).generate(_request(n=4, seed=12))
    assert [s.token_ids for s in a] == [s.token_ids for s in b] != [s.token_ids for s in c]
    special = set(tok.all_special_ids)
    for s in a:
        assert s.token_ids[-1] == tok.eos_token_id and not special & set(s.token_ids[:-1])
        assert len(s.logprobs) == len(s.token_ids)


def test_run_workflow_is_sync_and_refuses_a_running_loop():
    episode = run_workflow(
        "toy-walk-v0", {"start": 0, "goal": 1}, llm={"planner": "right", "mover": "right"}, branching=2
    )
    assert episode.terminated and episode.workflow_id == "toy-walk-v0"

    async def inside():
        run_workflow("toy-walk-v0")

    with pytest.raises(RuntimeError, match="arun_workflow"):
        asyncio.run(inside())


def test_same_seed_same_transcript():
    a = run_workflow(AgreeWorkflow, seed=5)
    b = run_workflow(AgreeWorkflow, seed=5)
    c = run_workflow(AgreeWorkflow, seed=6)
    assert a.transcript() == b.transcript() != c.transcript()


# --------------------------------------------------------------------------------------------------
# check_workflow: passes the toys, and catches each kind of broken workflow (negative controls).


@pytest.mark.parametrize("workflow", [WalkWorkflow, "toy-agree-v0"])
def test_check_workflow_passes_the_toys(workflow):
    episode = check_workflow(workflow)
    assert episode.validate() == []


class _UsesGlobalRandom(Workflow):
    roles = ("solo",)

    async def run(self, task):
        for _ in self.turns():
            group = await self.generate("solo", [user(f"pick {random.random():.6f}")])  # not self.rng
            for c in group:
                c.reward = 0.0
            group.best()


class _ForgetsLastTurn(Workflow):
    roles = ("solo",)

    async def run(self, task):
        for turn in self.turns():
            group = await self.generate("solo", [user("go")])
            if turn < self.max_turns - 1:
                for c in group:
                    c.reward = 1.0


class _GhostRole(Workflow):
    roles = ("solo", "ghost")

    async def run(self, task):
        group = await self.generate("solo", [user("go")])
        for c in group:
            c.reward = 0.0


class _TampersWithPrompts(Workflow):
    """Deliberately breaks its group: one member's prompt ids no longer match the others'."""

    roles = ("solo",)

    async def run(self, task):
        group = await self.generate("solo", [user("go")])
        for c in group:
            c.reward = 0.0
        group[-1].prompt_ids.append(0)


class _Hangs(Workflow):
    roles = ("solo",)

    async def run(self, task):
        await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("workflow", "match"),
    [
        (_UsesGlobalRandom, "same seed gave two different episodes"),
        (_ForgetsLastTurn, "unrewarded candidates"),
        (_GhostRole, r"roles \['ghost'\] are declared but never generated"),
        (_TampersWithPrompts, "prompt ids differ from the group's"),
    ],
)
def test_check_workflow_catches_broken_workflows(workflow, match):
    with pytest.raises(WorkflowCheckError, match=match):
        check_workflow(workflow, {})


def test_check_workflow_times_out_a_hanging_workflow():
    with pytest.raises(WorkflowCheckError, match="did not finish within 0.05 s"):
        check_workflow(_Hangs, {}, seeds=(0,), timeout_s=0.05)


def test_check_workflow_rejects_invalid_classes():
    class NoRoles(Workflow):
        async def run(self, task):
            pass

    with pytest.raises(WorkflowCheckError, match="non-empty tuple"):
        check_workflow(NoRoles, {})


def test_check_workflow_reports_a_problem_once_naming_the_runs_it_occurred_in():
    # _ForgetsLastTurn fails identically on seeds 0, 1, 2 and the rerun of seed 0 (K=4: "4 unrewarded
    # candidates"), and differently with K=1 ("1 unrewarded candidates"): 2 distinct problems, not 5.
    with pytest.raises(WorkflowCheckError) as info:
        check_workflow(_ForgetsLastTurn, {})
    message = str(info.value)
    assert "(2 problems)" in message
    assert message.count("ended with 4 unrewarded candidates") == 1
    assert "4 of 5 runs (seed 0, K=4; seed 1, K=4; seed 2, K=4; seed 0, K=4 again): WorkflowError" in message
    assert message.count("ended with 1 unrewarded candidates") == 1
    assert "\n - seed 0, K=1: WorkflowError" in message  # one run: labelled as before
    # One problem is "1 problem".
    with pytest.raises(WorkflowCheckError, match=r"failed check_workflow \(1 problem\):") as info:
        check_workflow(_GhostRole, {})
    assert "problems" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# The tokenizer round trip: words that a (tailored) tokenizer cannot encode are reported by name.


class _Critic(Workflow):
    """The issue's example: reads "critic red nothing" and should answer "right" or "wrong"."""

    roles = ("critic",)
    example_task = {}
    vocabulary = ("critic", "red", "right")  # misses "nothing" (a prompt word) and "wrong" (a reply)
    example_replies = {"critic": ("right", "wrong")}

    async def run(self, task):
        for _ in self.turns():
            group = await self.generate("critic", [user("critic red nothing")])
            for c in group:
                c.reward = float(c.text.strip() == "wrong")
            group.best()


class _CriticWithEveryWord(_Critic):
    vocabulary = (*_Critic.vocabulary, "nothing", "wrong")


@pytest.fixture(scope="module")
def critic_tokenizer():
    from verl_mas.tiny import build_tokenizer

    return build_tokenizer(_Critic.vocabulary)


def test_check_workflow_names_the_words_a_tailored_tokenizer_loses(critic_tokenizer):
    # The tokenizer's alphabet is the characters of its words plus space and newline: c r i t e d g h.
    # Every other character is dropped: "nothing" -> t h i g -> "thig"; "wrong" -> r g -> "rg".
    assert critic_tokenizer.decode(critic_tokenizer.encode("critic red nothing")) == "critic red thig"
    with pytest.raises(WorkflowCheckError) as info:
        check_workflow(_Critic, tokenizer=critic_tokenizer)
    message = str(info.value)
    assert "(2 problems)" in message
    assert "'nothing' becomes 'thig'" in message
    assert "the prompts of role 'critic' (e.g. 'critic red nothing')" in message
    assert "'wrong' becomes 'rg'" in message and "the example replies of role 'critic'" in message
    assert "add 'nothing' to _Critic.vocabulary" in message and "add 'wrong' to _Critic.vocabulary" in message
    assert "'critic' becomes" not in message and "'red' becomes" not in message  # words that survive
    # Controls: the same workflow passes with a tokenizer that has every word, and with the default
    # byte-level tokenizer (which encodes any text): the problems above are the tokenizer's.
    from verl_mas.tiny import build_tokenizer

    check_workflow(_CriticWithEveryWord, tokenizer=build_tokenizer(_CriticWithEveryWord.vocabulary))
    check_workflow(_Critic)


def test_check_workflow_with_relays_own_tokenizer_passes_and_without_a_word_names_it():
    from verl_mas.tiny import build_tokenizer
    from verl_mas.workflows.relay import RelayWorkflow

    check_workflow(RelayWorkflow, tokenizer=build_tokenizer(RelayWorkflow.vocabulary))  # control
    short = build_tokenizer([w for w in RelayWorkflow.vocabulary if w != "nothing"])  # "h" leaves the alphabet
    with pytest.raises(WorkflowCheckError) as info:
        check_workflow(RelayWorkflow, tokenizer=short)
    message = str(info.value)
    # The runner hears "runner nothing" when the caller's word was unparsable; "nothing" loses its "h".
    assert "'nothing' becomes 'noting'" in message and "the prompts of role 'runner'" in message
    assert "RelayWorkflow.vocabulary" in message and "rebuild the tokenizer" in message
    assert "relay-v0" in message  # the --vocab-from id


class _Quoter(Workflow):
    """The listener hears what the speaker committed, quoted as text, after its own words."""

    roles = ("speaker", "listener")
    example_task = {}
    vocabulary = ("café", "speaker", "listener", "heard")  # "é": two bytes, so lone bytes decode to U+FFFD

    async def run(self, task):
        for _ in self.turns():
            said = await self.generate("speaker", [user("speaker café")])
            for c in said:
                c.reward = float(c.text.strip() == "café")
            heard = await self.generate("listener", [user(f"listener heard {said.best().text.strip()}")])
            for c in heard:
                c.reward = 0.0
            heard.best()


def test_check_workflow_does_not_blame_the_workflow_for_text_a_reply_brought_into_a_prompt():
    from verl_mas.testing.roundtrip import roundtrip
    from verl_mas.tiny import build_tokenizer

    tok = build_tokenizer(_Quoter.vocabulary)
    # A random reply can end inside the two bytes of "é" and decode to U+FFFD, which this tokenizer cannot
    # encode: such a reply does not survive, and neither does a prompt quoting it.
    assert roundtrip(tok, "caf\ufffd") == "caf"
    episode = check_workflow(_Quoter, tokenizer=tok)
    quoted = [g.messages[-1]["content"] for g in episode.groups if g.role == "listener"]
    assert any("\ufffd" in text for text in quoted), quoted  # the case this test is about did occur
    # Negative control: the workflow's own text is still held against it.
    # Without "listener" the alphabet is c a f é s p e k r h d: l-i-s-t-e-n-e-r keeps s, e, e, r.
    with pytest.raises(WorkflowCheckError, match="'listener' becomes 'seer'"):
        check_workflow(_Quoter, tokenizer=build_tokenizer(["café", "speaker", "heard"]))


def test_lost_words_names_words_and_falls_back_to_the_text(critic_tokenizer):
    from verl_mas.testing.roundtrip import lost_words

    assert lost_words(critic_tokenizer, "critic red") == []
    assert lost_words(critic_tokenizer, "red nothing wrong nothing") == [("nothing", "thig"), ("wrong", "rg")]
    # Every word survives but the tab between them does not: the whole text is named.
    assert lost_words(critic_tokenizer, "red\tred") == [("red\tred", "redred")]


# --------------------------------------------------------------------------------------------------
# The CLI.


def test_cli_prints_a_scripted_episode(capsys):
    assert (
        cli_main(
            [
                "toy-walk-v0",
                "--llm",
                "scripted",
                "--reply",
                "planner=right",
                "--reply",
                "mover=right",
                "--branching",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "turn 1" in out and "committed branch:" in out and "terminated after 2 turns" in out
    assert "* #0  reward +1.750 (team +1.000; local +0.750)" in out  # turn 1 mover reaches the goal


def test_cli_random_and_errors(capsys):
    assert cli_main(["toy-agree-v0", "--llm", "random", "--seed", "1", "--max-turns", "2"]) == 0
    assert "episode toy-agree-v0" in capsys.readouterr().out
    assert cli_main(["nope-v0"]) == 2
    assert "toy-walk-v0" in capsys.readouterr().err  # lists what exists
    assert cli_main(["toy-walk-v0", "--llm", "scripted"]) == 2
    assert "--reply" in capsys.readouterr().err
    assert cli_main(["--list"]) == 0
    assert "toy-agree-v0" in capsys.readouterr().out


def test_cli_loads_a_saved_tokenizer(tmp_path, capsys):
    default_tokenizer().save_pretrained(tmp_path)
    argv = ["toy-walk-v0", "--tokenizer", str(tmp_path), "--task", '{"start": 0, "goal": -1}', "--llm", "scripted"]
    assert cli_main([*argv, "--reply", "planner=left", "--reply", "mover=left", "--branching", "1"]) == 0
    assert "terminated after 1 turns" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# The package's layering: llms <- runner <- conformance, with no import cycle (one used to be dodged
# by a function-level import).


def _submodule_imports(package_dir: Path, package: str) -> dict[str, set[str]]:
    """For each module of ``package``, the package's modules it imports anywhere (function bodies too).

    ``"__init__"`` stands for the package itself, which a module imports with ``from package import NAME``
    (its ``__init__`` imports every submodule, so that closes a cycle).
    """
    modules = {path.stem for path in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for module in modules:
        targets: set[str] = set()
        for node in ast.walk(ast.parse((package_dir / f"{module}.py").read_text())):
            if isinstance(node, ast.Import):
                imported = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level <= 1:
                base = (node.module or "") if node.level == 0 else ".".join(filter(None, [package, node.module]))
                imported = [(base, [alias.name for alias in node.names])]
            else:
                continue
            for name, names in imported:
                if name == package:
                    subs = [n for n in names if n in modules]
                    targets.update(subs if subs and len(subs) == len(names) else ["__init__", *subs])
                elif name.startswith(package + "."):
                    targets.add(name[len(package) + 1 :].split(".")[0])
        graph[module] = targets - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other, directly or through others."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return seen

    reachable = {module: reach(module) for module in graph}
    return sorted({tuple(sorted((a, b))) for a in graph for b in reachable[a] if b != a and a in reachable.get(b, ())})


def test_the_cycle_checker_finds_cycles_it_is_meant_to_catch(tmp_path: Path) -> None:
    """Negative control: a synthetic package with the cycles this guards against, and a clean twin."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.low import f\nfrom pkg.high import g\n")
    (pkg / "low.py").write_text("def f():\n    from pkg.high import g  # hidden in a function\n    return g\n")
    (pkg / "high.py").write_text("from .low import f\n\ndef g():\n    return f\n")
    assert _cycles(_submodule_imports(pkg, "pkg")) == [("high", "low")]
    (pkg / "low.py").write_text("def f():\n    from pkg import g  # through the package's public face\n    return g\n")
    assert ("__init__", "low") in _cycles(_submodule_imports(pkg, "pkg"))
    (pkg / "low.py").write_text("def f():\n    return 1\n")
    assert _cycles(_submodule_imports(pkg, "pkg")) == []
    assert _submodule_imports(pkg, "pkg") == {"__init__": {"low", "high"}, "low": set(), "high": {"low"}}


def test_the_testing_package_has_no_import_cycle() -> None:
    package_dir = Path(verl_mas.testing.__file__).parent
    graph = _submodule_imports(package_dir, "verl_mas.testing")
    assert {"llms", "runner", "conformance"} <= set(graph)
    assert _cycles(graph) == [], graph
    # And each module imports on its own in a fresh interpreter (a top-level cycle would fail here).
    for module in ["verl_mas.testing", *(f"verl_mas.testing.{m}" for m in sorted(graph) if m != "__init__")]:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        assert proc.returncode == 0, f"import {module}: {proc.stderr[-2000:]}"
