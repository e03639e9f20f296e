"""Tiny causal LMs and locally trained tokenizers, built without any model hub.

Tests, the CPU quickstart and users developing a workflow on a laptop need a real ``transformers`` model
and a real tokenizer with a chat template, but no weights can be downloaded. This module builds both,
deterministically and in seconds:

- a byte-level BPE tokenizer trained with the ``tokenizers`` library on a project-written corpus (it
  can encode any text), or a word-level tokenizer over a task-tailored vocabulary (``--vocab``), which
  makes RL from random initialisation feasible on CPU;
- a Qwen2-style causal LM (~0.2M parameters by default) initialised from a fixed seed.

Usage::

    python -m verl_mas.tiny --out /path/to/tiny-model
    python -m verl_mas.tiny --out DIR --vocab "up down left right done"
    python -m verl_mas.tiny --out DIR --vocab-from relay-v0   # a workflow's `vocabulary` (id or pkg.mod:Class)

A tailored tokenizer drops every character its words do not use, silently: built for a workflow, it is first
checked against the workflow's episodes (:mod:`verl_mas.testing.roundtrip`) and refused, naming the words,
when a prompt or an expected reply does not survive it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: this module is imported by tests and CLIs alike
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from verl_mas.workflow import Workflow

logger = logging.getLogger(__name__)

__all__ = [
    "CHAT_TEMPLATE",
    "COMPACT_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_model",
    "build_tokenizer",
    "build_workflow_tokenizer",
    "write_tiny",
]

#: Special tokens of the ChatML layout used by Qwen models. ``<|endoftext|>`` doubles as padding.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A ChatML chat template (the layout of Qwen2/Qwen3 instruct models, without tool or reasoning blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: The chat layout of a task-tailored tokenizer: each message's content on a line of its own, no role markers.
#: A tiny model trained from scratch on one task needs no chat structure, and every prompt position it must
#: learn to attend past slows learning: relay-v0's prompts are 3 tokens instead of ChatML's 10, and its
#: quickstart learns the task in about half the steps (``bench/bench_learnability.py --chat chatml``).
#: The answer's position follows a newline, never the prompt's last word, so a random model does not copy it.
COMPACT_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] + '\n' }}{% endfor %}"


def _default_corpus() -> list[str]:
    """A small project-written corpus covering chat, code, math and game vocabulary.

    It only has to give BPE enough frequent pairs to merge; the exact text is irrelevant as long as
    it is fixed (the tokenizer must be byte-for-byte reproducible).
    """
    words = (
        "the a an is are be to of and or not in on at for with by from as it this that you your we "
        "system user assistant tool planner coder tester reasoner role turn task answer final action "
        "up down left right move push box goal wall grid row column cell path start end step plan "
        "sudoku sokoban solve solution valid invalid error output input test pass fail code python "
        "def return if else elif for while in range print import from class self true false none "
        "len list dict set int str float min max sum sorted append pop queue visited neighbors "
        "answer boxed frac sqrt pi equal plus minus times divide number result therefore so we get"
    ).split()
    lines = [" ".join(words[i : i + 9]) for i in range(0, len(words), 9)]
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 30, 3) for b in range(0, 30, 7)]
    lines += [f"{a} * {b} = {a * b}" for a in range(1, 13) for b in range(1, 13, 5)]
    lines += [
        "def solve(grid):\n    for r in range(len(grid)):\n        print(grid[r])\n    return grid",
        "import sys\nfor line in sys.stdin:\n    print(int(line) * 2)",
        "while queue:\n    node = queue.pop(0)\n    if node == goal:\n        break",
        "Actions: [\"U\", \"D\", \"L\", \"R\"]\nThe final answer is \\boxed{42}.",
        "<|im_start|>user\nSolve the task.<|im_end|>\n<|im_start|>assistant\nOK.<|im_end|>",
    ]
    lines += ["0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "()[]{}<>=+-*/.,:;!?'\"#_"]
    return lines


def _qwen2_pre_tokenizer():  # the pre-tokenizer Qwen2Tokenizer rebuilds on load (transformers 5)
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(
    vocab: Sequence[str] | None = None, vocab_size: int = 512, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """Build a Qwen2 byte-level BPE tokenizer with a chat template, deterministically.

    transformers 5 always loads the tokenizer of a ``qwen2`` model as ``Qwen2Tokenizer`` (its vocab and
    merges with Qwen's own pre-tokenizer), so the BPE is trained with exactly that pre-tokenizer: the
    tokenizer returned here and the one ``AutoTokenizer.from_pretrained`` loads back are the same.

    Args:
        vocab: Optional task-tailored vocabulary. When given, the BPE alphabet is restricted to the bytes
            these words (and the chat template) use and merges are learnt until every word, with or
            without a leading space, is a single token: a vocabulary of a few dozen tokens in which
            valid actions are not drowned out. Text using other characters loses them.
        vocab_size: Target size of the general-purpose vocabulary (ignored with ``vocab``).
        chat_template: The chat template; default :data:`CHAT_TEMPLATE` (ChatML), or with ``vocab``
            :data:`COMPACT_CHAT_TEMPLATE` (each message's content on its own line).

    Returns:
        A ``Qwen2Tokenizer`` with ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"`` and a chat
        template, ready for ``save_pretrained``.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    if vocab is not None:
        words = list(dict.fromkeys(w for w in vocab if w))
        bad = [w for w in words if w in SPECIAL_TOKENS or any(c.isspace() for c in w)]
        if bad:
            raise ValueError(
                f"vocab entries {bad!r} contain whitespace or collide with the special tokens "
                f"{SPECIAL_TOKENS}. A tailored vocabulary holds single words; split them or drop them."
            )
        # Every word alone, after a space and after a newline; plus what the chat template writes.
        template = COMPACT_CHAT_TEMPLATE if chat_template is None else chat_template
        base = [*words, *(w for w in ("system", "user", "assistant") if w in template), "\n"]
        corpus = [f"{w} {w}\n{w}" for w in base]
        alphabet = sorted(set("".join(corpus)))
        mapped = pre_tokenizers.ByteLevel(use_regex=False).pre_tokenize_str("".join(alphabet))
        initial_alphabet = sorted({c for piece, _ in mapped for c in piece})  # the byte-level symbols
        target = len(SPECIAL_TOKENS) + 4 * sum(len(w) + 2 for w in base)  # room to merge every word fully
    else:
        template = CHAT_TEMPLATE if chat_template is None else chat_template
        corpus = _default_corpus()
        target = vocab_size
        initial_alphabet = pre_tokenizers.ByteLevel.alphabet()

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = _qwen2_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=initial_alphabet,
        limit_alphabet=len(initial_alphabet),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    model_state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_state["merges"]]

    tokenizer = Qwen2Tokenizer(
        vocab=model_state["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template
    return tokenizer


def _workflow_vocab(workflow: str | type[Workflow], vocab: Sequence[str] | None) -> list[str]:
    """``vocab`` followed by the words the workflow declares in its ``vocabulary`` class attribute."""
    from verl_mas.registry import get_workflow, workflow_name

    cls = get_workflow(workflow)
    declared = getattr(cls, "vocabulary", None)
    if not declared or isinstance(declared, str):
        what = "no `vocabulary`" if not declared else f"vocabulary = {declared!r:.60} (a string, not a tuple of words)"
        raise ValueError(
            f"workflow {workflow_name(cls)!r} declares {what}, so there is no tailored tokenizer to build for it. "
            "Declare `vocabulary = (...)` on the class, a tuple of every word its prompts and replies use; or pass "
            "the words with --vocab, or neither for the general byte-level tokenizer."
        )
    return [*(vocab or []), *declared]


def build_workflow_tokenizer(
    workflow: str | type[Workflow], vocab: Sequence[str] | None = None, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """The tailored tokenizer of a workflow's ``vocabulary`` (plus ``vocab``), checked against its episodes.

    A tailored tokenizer drops the characters its words do not use without a sound (``"nothing"`` missing
    from relay-v0's vocabulary turns ``"runner nothing"`` into ``"runner noting"``), so the workflow is played
    with it against a random LLM on its ``example_task`` and a few ``generate_task`` tasks, and every word of
    its prompts and of its ``example_replies`` must survive encode/decode
    (:func:`verl_mas.testing.roundtrip.tokenizer_problems`).

    Raises:
        ValueError: When the workflow declares no ``vocabulary``.
        WorkflowCheckError: Naming every word the tokenizer loses, where it occurs and the fix.
    """
    from verl_mas.registry import get_workflow, workflow_name
    from verl_mas.testing.conformance import WorkflowCheckError
    from verl_mas.testing.roundtrip import tokenizer_problems

    cls = get_workflow(workflow)
    tokenizer = build_tokenizer(_workflow_vocab(cls, vocab), chat_template=chat_template)
    problems = tokenizer_problems(cls, tokenizer)
    if problems:
        count = f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
        extra = " and the extra words" if vocab else ""
        raise WorkflowCheckError(
            f"the tokenizer built from {workflow_name(cls)}'s vocabulary{extra} does not carry the text its episodes "
            f"use ({count}):\n - " + "\n - ".join(problems)
        )
    return tokenizer


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> PreTrainedModel:
    """Build a randomly initialised Qwen2-style causal LM sized to ``tokenizer``.

    The defaults give about 0.2M parameters (with a 512-token vocabulary): small enough that verl's
    FSDP actor, the CPU rollout backend and PPO updates run in seconds on two CPU cores.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # A private generator would be cleaner, but transformers' init uses the global RNG; fork it so the
    # caller's RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def write_tiny(
    out: str | os.PathLike[str],
    *,
    vocab: Sequence[str] | None = None,
    workflow: str | type[Workflow] | None = None,
    seed: int = 0,
    chat_template: str | None = None,
    **model_kwargs: int,
) -> Path:
    """Write a tiny model and its tokenizer to ``out`` (a directory ``from_pretrained`` can load).

    ``workflow``: build the tokenizer from the workflow's ``vocabulary`` (after ``vocab``), checked against
    its episodes first (:func:`build_workflow_tokenizer`; nothing is written when the check fails).
    ``chat_template``: as :func:`build_tokenizer` (default: ChatML, or the compact layout with ``vocab``).
    Returns the output directory. Identical arguments give byte-identical files.
    """
    if workflow is None:
        tokenizer = build_tokenizer(vocab, chat_template=chat_template)
    else:
        tokenizer = build_workflow_tokenizer(workflow, vocab, chat_template=chat_template)
        vocab = _workflow_vocab(workflow, vocab)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    (out_dir / "verl_mas_tiny.json").write_text(
        json.dumps({"seed": seed, "vocab": list(vocab) if vocab is not None else None, "n_params": n_params}, indent=1)
    )
    logger.info("wrote tiny model (%d parameters, vocab %d) to %s", n_params, len(tokenizer), out_dir)
    return out_dir


def _split_vocab(values: Iterable[str]) -> list[str]:
    """Accept ``--vocab "a b c"``, ``--vocab a b c`` and ``--vocab @file.txt`` (one word per line)."""
    words: list[str] = []
    for value in values:
        if value.startswith("@"):
            words += Path(value[1:]).read_text().split()
        else:
            words += value.split()
    return words


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_mas.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory for the model and tokenizer")
    parser.add_argument(
        "--vocab", nargs="+", default=None,
        help="task-tailored word-level vocabulary (words, or @file with one word per line); "
        "default: a byte-level BPE tokenizer that encodes any text",
    )
    parser.add_argument(
        "--vocab-from", default=None, metavar="WORKFLOW",
        help="use the tailored vocabulary a workflow (an id or package.module:Class) declares in its `vocabulary` "
        "class attribute, after any --vocab words; refused, naming the words, when the workflow's prompts or "
        "`example_replies` use text the tokenizer cannot carry",
    )
    parser.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    vocab = _split_vocab(args.vocab) if args.vocab is not None else None
    if args.vocab_from is not None:
        from verl_mas.registry import get_workflow

        try:
            _workflow_vocab(get_workflow(args.vocab_from), None)
        except (LookupError, TypeError, ValueError) as e:  # unknown id (listing the ids), not a workflow, no vocabulary
            parser.error(str(e))
    from verl_mas.testing.conformance import WorkflowCheckError

    try:
        write_tiny(args.out, vocab=vocab, workflow=args.vocab_from, seed=args.seed, hidden_size=args.hidden_size,
                   num_hidden_layers=args.layers)
    except WorkflowCheckError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
