"""``relay-v0``: the CPU quickstart workflow, a caller and a runner relaying a message word by word.

Designed to be learnt by a tiny randomly initialised model (``verl_mas.tiny`` with
:attr:`RelayWorkflow.vocabulary`) in minutes on two CPU cores, while keeping what makes AT-GRPO
different from single-agent GRPO: two roles in sequence, the second conditioned on what the first
committed in the same turn, per-role local rewards plus a shared team reward, several turns.

The task is a message of :data:`MESSAGE_LENGTH` action words. Each turn, the **caller** sees the next
word still to deliver and names a word; the **runner** sees only the word the caller committed (never
the message) and names a word. The word is delivered when the runner names it; the episode terminates
when the whole message is delivered, and is truncated after ``max_turns`` turns (default 4, so one
turn may be missed). Each prompt is one short user message (``"caller red"``, ``"runner red"``): three
tokens with the tailored tokenizer (its compact chat layout, ``verl_mas.tiny.COMPACT_CHAT_TEMPLATE``: the
words and a newline).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from verl_mas.chat import user
from verl_mas.registry import register_workflow, workflow_name
from verl_mas.workflow import Workflow

__all__ = [
    "ACTION_WORDS",
    "MESSAGE_LENGTH",
    "NOTHING",
    "RelayChainWorkflow",
    "RelayWorkflow",
    "caller_local_reward",
    "encode",
    "parse_word",
    "runner_rewards",
]

# ---------------------------------------------------------------------------------------------------
# Pure task logic.

#: The words roles may answer with (one token each with the tailored tokenizer).
ACTION_WORDS: tuple[str, ...] = ("red", "blue", "green", "gold", "pink", "gray", "teal", "plum", "lime", "navy")

#: Words per message: 10 ** 2 = 100 distinct tasks, enough for disjoint train (64) and test (16) sets.
MESSAGE_LENGTH = 2

#: What the runner is told when the caller's committed answer was not an action word.
NOTHING = "nothing"


def parse_word(text: str) -> str | None:
    """The action word ``text`` begins with (case and leading whitespace ignored), else None.

    ``"red"``, ``" Red"``, ``"red blue"`` and ``"reddish"`` all parse as ``"red"`` (no action word is a
    prefix of another). Lenient on purpose: a tiny model samples 1-3 tokens, and a correct first token
    followed by a stray piece of a word should still count, or the reward would mostly measure whether
    the model stopped in time.
    """
    head = text.lstrip().lower()
    for word in ACTION_WORDS:
        if head.startswith(word):
            return word
    return None


def caller_local_reward(word: str | None, target: str) -> float:
    """``[word == target]``: 1.0 for naming the word to deliver, else 0.0 (unparsable answers included)."""
    return float(word is not None and word == target)


def encode(word: str) -> str:
    """relay-chain-v0's code: the action word after ``word`` in :data:`ACTION_WORDS` (``"navy"`` -> ``"red"``)."""
    return ACTION_WORDS[(ACTION_WORDS.index(word) + 1) % len(ACTION_WORDS)]


def runner_rewards(word: str | None, heard: str | None, target: str) -> tuple[float, float]:
    """``(team, local)`` of a runner answer: ``team = [word == target]``, ``local = 0``.

    Args:
        word: The runner's parsed word (None: unparsable).
        heard: The word the caller committed this turn (None: the caller's answer was unparsable). It
            does not enter the reward; see the class docstring for why a faithful relay earns nothing
            by itself.
        target: The word to deliver this turn.
    """
    return float(word is not None and word == target), 0.0


# ---------------------------------------------------------------------------------------------------
# Workflow.


@register_workflow("relay-v0")
class RelayWorkflow(Workflow):
    """A caller names the next word of a message; the runner, seeing only the caller's word, delivers it.

    Task: ``{"message": ["red", "blue"]}`` (:data:`MESSAGE_LENGTH` words from :data:`ACTION_WORDS`).

    Per turn (rewards immediate, every candidate scored on a copy of the state; only the committed
    runner word can deliver):

    - caller, prompt ``"caller <next word>"``: ``local = [word == next word]``.
      Its team part is 0: the team outcome of the turn only exists once the runner has acted, after
      the caller's candidates are scored; the caller's credit for it is its local reward.
    - runner, prompt ``"runner <caller's committed word>"`` (or ``"runner nothing"``):
      ``team = [word == next word]``, ``local = 0``, ``reward = alpha * team + local``.

    Two reward terms that look natural are left out on purpose; with either, the shared tiny model
    collapsed to answering one fixed word everywhere within 20-40 steps (every group then has zero
    variance and learning stops; see ``bench/bench_learnability.py``):

    - a format bonus for answering with *some* action word: GRPO normalises rewards within a group,
      so in a group where no candidate is right the bonus is as strong as the task reward, and it
      rewards whichever word the model already prefers;
    - a runner reward for relaying the caller's word faithfully, even when that word is wrong: the
      caller's committed wrong word is the model's own favourite word, so rewarding the runner for
      repeating it reinforces that word for every prompt (rich get richer). Rewarding the runner only
      for delivering the target is unbiased, because targets are uniform.

    The episode terminates once every word is delivered (``mas/success = 1``); ``mas/delivered`` is
    the fraction of the message delivered.
    """

    roles = ("caller", "runner")
    example_task: ClassVar[Any] = {"message": ["red", "blue"]}

    #: Every word of every prompt and answer: build the tiny model's tokenizer from it,
    #: ``write_tiny(out, vocab=RelayWorkflow.vocabulary)``.
    vocabulary: ClassVar[tuple[str, ...]] = (*ACTION_WORDS, "caller", "runner", NOTHING)

    @classmethod
    def generate_task(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """A message of :data:`MESSAGE_LENGTH` uniformly drawn action words (repeats allowed); same for both splits."""
        return {"message": [rng.choice(ACTION_WORDS) for _ in range(MESSAGE_LENGTH)]}

    async def run(self, task: dict[str, Any]) -> None:
        message = list(task["message"])
        bad = [w for w in message if w not in ACTION_WORDS]
        if not message or bad:
            raise ValueError(
                f"{workflow_name(type(self))} task {task!r} has words {bad!r} outside ACTION_WORDS {ACTION_WORDS} "
                "(or is empty). "
                "A message is a non-empty list of action words; build tasks with RelayWorkflow.generate_task."
            )
        delivered = 0
        for _ in self.turns():
            target = message[delivered]
            heard: str | None = target  # the first role sees the word to deliver itself
            for position, role in enumerate(self.roles):
                # Same-turn conditioning: each later role's prompt holds the word committed a moment ago.
                nodes = await self.generate(role, [user(f"{role} {heard or NOTHING}")])
                last = position == len(self.roles) - 1
                for c in nodes:
                    word = parse_word(c.text)
                    c.parse_failed = word is None
                    if last:
                        c.team_reward, c.local_reward = runner_rewards(word, heard, target)
                    else:
                        c.local_reward = caller_local_reward(word, self.expected_word(role, target))
                heard = parse_word(nodes.best().text)
            if heard == target:  # commit: only the last role's best word can deliver
                delivered += 1
                if delivered == len(message):
                    self.terminate()
        self.metrics["mas/success"] = float(delivered == len(message))
        self.metrics["mas/delivered"] = delivered / len(message)

    def expected_word(self, role: str, target: str) -> str:
        """The word a role before the last one is rewarded for naming when ``target`` is to be delivered: the
        target itself (relay-v0's caller)."""
        return target


@register_workflow("relay-chain-v0")
class RelayChainWorkflow(RelayWorkflow):
    """relay-v0 with three roles in sequence, each seeing only what the one before it committed this turn.

    The **caller** sees the next word to deliver and names it (``local = [word == target]``); the **courier**
    sees the caller's committed word and passes it on *encoded*: the word after it in :data:`ACTION_WORDS`
    (cyclically; ``local = [word == encode(target)]``); the **runner** sees the courier's committed word and
    delivers (``team = [word == target]``, ``local = 0``, as relay-v0's runner). The code makes the three jobs
    different mappings (identity, +1, -1), so a policy trained in one role is of no use in another (the role-swap
    check means something) and a shared model must condition on the role's name. Neither later role sees the
    target; only the runner's committed word delivers. Same tasks, turns and metrics as relay-v0.
    """

    roles = ("caller", "courier", "runner")
    vocabulary: ClassVar[tuple[str, ...]] = (*ACTION_WORDS, "caller", "courier", "runner", NOTHING)

    def expected_word(self, role: str, target: str) -> str:
        """The caller names the target; the courier its code, :func:`encode`."""
        return encode(target) if role == "courier" else target
