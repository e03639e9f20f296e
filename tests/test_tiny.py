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
