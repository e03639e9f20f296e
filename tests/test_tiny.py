"""verl_mas.tiny: deterministic tiny models and tokenizers that survive a save/load round trip."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from verl_mas.tiny import build_tokenizer, write_tiny


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = write_tiny(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)
    # A different seed changes the weights (and only the weights and the metadata that records the seed).
    other = _digest(write_tiny(tmp_path / "seed1", seed=1))
    changed = {name for name in other if other[name] != _digest(tiny_model_dir)[name]}
    assert changed == {"model.safetensors", "verl_mas_tiny.json"}


def test_model_is_a_small_qwen2_with_a_chat_tokenizer(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    # Tied embedding 512 x 64 = 32,768. Per layer: q 64x64+64 = 4,160; k and v 64x32+32 = 2,080 each;
    # o 64x64 = 4,096; MLP 3 x 64x256 = 49,152; two norms 128 -> 61,696. Two layers 123,392, final norm 64.
    assert n_params == 32_768 + 2 * 61_696 + 64 == 156_224
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_saved_tokenizer_loads_back_identically(tiny_model_dir: Path) -> None:
    # transformers 5 rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer from vocab + merges; the BPE is
    # trained with that exact pre-tokenizer, so what verl loads equals what was built.
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    built = build_tokenizer()
    text = "def solve(grid):\n    return [r for r in grid]  # 12 + 30 = 42, \\boxed{42} üñí"
    assert loaded(text).input_ids == built(text).input_ids
    assert loaded.decode(loaded(text).input_ids) == text


def test_tailored_vocabulary_makes_each_word_one_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    words = ["up", "down", "left", "right", "done"]
    tok = AutoTokenizer.from_pretrained(write_tiny(tmp_path / "w", vocab=words))
    assert len(tok) < 100  # tens of tokens, not hundreds
    ids = tok("up down left\nright done").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["up", "Ġdown", "Ġleft", "Ċ", "right", "Ġdone"]
    # Its chat layout: each message's content on its own line, no role markers (the saved template loads back),
    # so a prompt is its words and a newline: the answer never starts right after the prompt's last word.
    chat = [{"role": "system", "content": "up"}, {"role": "user", "content": "left right"}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.convert_ids_to_tokens(rendered) == ["up", "Ċ", "left", "Ġright", "Ċ"]
    general = AutoTokenizer.from_pretrained(write_tiny(tmp_path / "g"))
    assert general.apply_chat_template(chat[1:], add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nleft right<|im_end|>\n<|im_start|>assistant\n")


def test_tailored_vocabulary_rejects_multiword_entries() -> None:
    with pytest.raises(ValueError, match="whitespace"):
        build_tokenizer(["go left"])


# --------------------------------------------------------------------------------------------------
# A tokenizer built for a workflow is checked against the workflow's prompts and replies before anything
# is written.


def _register_critic(monkeypatch: pytest.MonkeyPatch) -> type:
    from verl_mas import Workflow, register_workflow, registry, user

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the test registers an id

    @register_workflow("critic-test-v0")
    class Critic(Workflow):
        """The issue's example: reads "critic red nothing" and should answer "right" or "wrong"."""

        roles = ("critic",)
        example_task: dict = {}
        vocabulary = ("critic", "red", "right")  # misses "nothing" (a prompt word) and "wrong" (a reply)
        example_replies = {"critic": ("right", "wrong")}

        async def run(self, task: dict) -> None:
            for _ in self.turns():
                group = await self.generate("critic", [user("critic red nothing")])
                for c in group:
                    c.reward = float(c.text.strip() == "wrong")
                group.best()

    return Critic


def test_vocab_from_refuses_a_vocabulary_that_loses_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from verl_mas.tiny import main

    _register_critic(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "m"), "--vocab-from", "critic-test-v0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # The alphabet is c r i t e d g h (space, newline): "nothing" -> "thig", "wrong" -> "rg".
    assert "'nothing' becomes 'thig'" in err and "the prompts of role 'critic'" in err
    assert "'wrong' becomes 'rg'" in err and "the example replies of role 'critic'" in err
    assert not (tmp_path / "m").exists()  # refused before writing anything
    # Control: the same workflow with the missing words added on the command line builds.
    main(["--out", str(tmp_path / "ok"), "--vocab-from", "critic-test-v0", "--vocab", "nothing", "wrong"])
    assert (tmp_path / "ok" / "config.json").is_file()


def test_write_tiny_for_a_workflow_checks_its_episodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    from verl_mas.testing import WorkflowCheckError
    from verl_mas.workflows.relay import RelayWorkflow

    critic = _register_critic(monkeypatch)
    with pytest.raises(WorkflowCheckError, match="'nothing' becomes 'thig'"):
        write_tiny(tmp_path / "critic", workflow=critic)
    assert not (tmp_path / "critic").exists()
    # Control: relay-v0 passes with its own vocabulary, and gets the tokenizer `vocab=` builds from it.
    out = write_tiny(tmp_path / "relay", workflow="relay-v0")
    built = build_tokenizer(RelayWorkflow.vocabulary)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == built.get_vocab()
