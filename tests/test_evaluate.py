"""verl_mas.evaluate: success per dataset and metric means over a test split."""

from __future__ import annotations

import json
from pathlib import Path

from verl_mas.data import canonical_json, make_rows
from verl_mas.settings import EpisodeConfig
from verl_mas.evaluate import LocalModelClient, evaluate
from verl_mas.testing import ScriptedLLM, default_tokenizer


def _relay_rows() -> list[dict]:
    tasks = [canonical_json({"message": ["red", "blue"]}), canonical_json({"message": ["gold", "navy"]})]
    return make_rows("relay-v0", "test", tasks)


async def test_a_perfect_team_scores_one_and_a_silent_one_zero() -> None:
    tokenizer = default_tokenizer()

    def perfect(role: str, messages: list) -> str:
        # caller sees "caller <word>" and names it; runner sees "runner <word>" and relays it.
        return messages[-1]["content"].split()[-1]

    rows = _relay_rows()
    good = await evaluate(rows, client=ScriptedLLM(perfect, tokenizer=tokenizer), tokenizer=tokenizer,
                          config=EpisodeConfig(branching=1, max_turns=4))
    # Both tasks deliver both words in 2 turns: success 1.0 for relay-v0 and overall, 2 turns each.
    assert good["success_rate/relay-v0"] == good["success_rate"] == 1.0
    assert good["mas/num_turns"] == 2.0 and good["episodes"] == 2.0
    bad = await evaluate(rows, client=ScriptedLLM({"caller": ["zzz"], "runner": ["zzz"]}, tokenizer=tokenizer),
                         tokenizer=tokenizer, config=EpisodeConfig(branching=1, max_turns=4))
    assert bad["success_rate"] == 0.0 and bad["mas/truncated"] == 1.0


async def test_local_model_client_runs_episodes_with_a_tiny_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from verl_mas.tiny import write_tiny
    from verl_mas.workflows.relay import RelayWorkflow

    model_dir = write_tiny(tmp_path / "m", vocab=list(RelayWorkflow.vocabulary))
    client = LocalModelClient(str(model_dir), max_tokens=3)
    report = await evaluate(_relay_rows(), client=client, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                            config=EpisodeConfig(branching=2, max_turns=2))
    assert report["episodes"] == 2.0 and 0.0 <= report["success_rate"] <= 1.0
    assert {"mas/caller/reward/mean", "mas/runner/reward/mean"} <= set(report)
    json.dumps(report)  # a plain, serialisable report


async def test_role_routed_client_serves_each_role_with_its_own_model_and_swaps() -> None:
    from verl_mas.routing import RoleRoutedClient

    tokenizer = default_tokenizer()

    def perfect(role: str, messages: list) -> str:
        return messages[-1]["content"].split()[-1]

    good = ScriptedLLM(perfect, tokenizer=tokenizer)
    mute = ScriptedLLM({"caller": ["zzz"], "runner": ["zzz"]}, tokenizer=tokenizer)
    config = EpisodeConfig(branching=1, max_turns=4)
    both = await evaluate(_relay_rows(), client=RoleRoutedClient({"caller": good, "runner": good}),
                          tokenizer=tokenizer, config=config)
    # A mute runner breaks the relay whichever caller it has: which model serves which role matters.
    mute_runner = await evaluate(_relay_rows(), client=RoleRoutedClient({"caller": good}, default=mute),
                                 tokenizer=tokenizer, config=config)
    assert both["success_rate"] == 1.0 and mute_runner["success_rate"] == 0.0
    assert mute_runner["mas/caller/reward/mean"] > 0 and mute_runner["mas/runner/reward/mean"] == 0


def test_cli_role_swap_with_two_tiny_models(tmp_path: Path, capsys) -> None:
    import pytest

    from verl_mas.data import write_dataset
    from verl_mas.evaluate import main
    from verl_mas.tiny import write_tiny
    from verl_mas.workflows.relay import RelayWorkflow

    vocab = list(RelayWorkflow.vocabulary)
    a = write_tiny(tmp_path / "a", vocab=vocab, hidden_size=32, num_hidden_layers=1, seed=1)
    b = write_tiny(tmp_path / "b", vocab=vocab, hidden_size=64, num_hidden_layers=2, seed=2)
    write_dataset("relay-v0", tmp_path / "data", train=0, test=4, seed=0)
    out = tmp_path / "report.json"
    main(["--data", str(tmp_path / "data" / "test.parquet"), "--role", f"caller={b}", "--role", f"runner={a}",
          "--max-tokens", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out.split()
    assert report["episodes"] == 4.0 and printed[:6] == ["role", "caller", str(b), "role", "runner", str(a)]
    with pytest.raises(SystemExit, match="use ROLE=MODEL_DIR.*given twice"):
        main(["--data", "x.parquet", "--role", "caller", "--role", f"r={a}", "--role", f"r={b}"])
    # Models of different vocabularies in one team: each role renders and decodes with its own tokenizer.
    other = write_tiny(tmp_path / "other", hidden_size=32, num_hidden_layers=1)  # generic BPE vocabulary
    main(["--data", str(tmp_path / "data" / "test.parquet"), "--model", str(a), "--role", f"runner={other}",
          "--max-tokens", "3", "--json", str(out), "--record", str(tmp_path / "episodes.jsonl")])
    assert json.loads(out.read_text())["episodes"] == 4.0
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["source"] for r in records} == {"evaluate"}
    assert records[0]["policies"] == {"caller": str(a), "runner": str(other)}
    # A model directory whose tokenizer is not its model's (more tokens than embedding rows) is refused.
    import shutil

    mismatched = tmp_path / "mismatched"
    shutil.copytree(a, mismatched)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(other / name, mismatched / name)
    with pytest.raises(SystemExit, match=r"'.*mismatched': its tokenizer has \d+ tokens but its model only \d+ embedding"):
        main(["--data", "x.parquet", "--model", str(a), "--role", f"runner={mismatched}"])
    # The router training uses checks the data's workflows before any episode: relay-v0's runner has no model.
    with pytest.raises(SystemExit, match=r"relay-v0' has roles \['runner'\] that no policy serves.*--role <role>=MODEL"):
        main(["--data", str(tmp_path / "data" / "test.parquet"), "--role", f"caller={b}", "--max-tokens", "3"])


async def test_an_aborted_episode_counts_as_a_failure_next_to_an_abort_rate() -> None:
    from verl_mas.errors import InfraError

    tokenizer = default_tokenizer()

    def perfect_but_first_task_lost(role: str, messages: list):
        word = messages[-1]["content"].split()[-1]
        if word in ("red", "blue"):  # the first task's server is gone: every candidate fails
            raise InfraError("replica lost")
        return word

    report = await evaluate(_relay_rows(), client=ScriptedLLM(perfect_but_first_task_lost, tokenizer=tokenizer),
                            tokenizer=tokenizer, config=EpisodeConfig(branching=1, max_turns=4))
    # Task 2 succeeds, task 1 aborts: success 1/2 over both (not 1/1 over the completed one), aborted 1/2.
    assert report["success_rate"] == 0.5 and report["aborted_rate"] == 0.5 and report["episodes"] == 2.0


def test_a_lora_adapter_directory_serves_a_role_merged_onto_its_base(tmp_path: Path, capsys) -> None:
    import pytest
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl_mas.data import write_dataset
    from verl_mas.evaluate import main, model_source
    from verl_mas.tiny import write_tiny
    from verl_mas.workflows.relay import RelayWorkflow

    base = write_tiny(tmp_path / "base", vocab=list(RelayWorkflow.vocabulary))
    # A non-zero adapter (peft's init_lora_weights=False draws B at random), saved as a shared base saves one.
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert model_source(str(tmp_path / "adapter"), None) == (str(base), str(tmp_path / "adapter"))
    assert model_source(str(base), None) == (str(base), None)
    served = LocalModelClient(str(base), adapter=str(tmp_path / "adapter"))
    prompt = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=prompt).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=prompt).logits
        got = served.engine.model(input_ids=prompt).logits
    assert (got - expected).abs().max() < 1e-5 < (plain - expected).abs().max()  # the adapter, merged in
    write_dataset("relay-v0", tmp_path / "data", train=0, test=2, seed=0)
    out = tmp_path / "report.json"
    main(["--data", str(tmp_path / "data" / "test.parquet"), "--model", str(base),
          "--role", f"runner={tmp_path / 'adapter'}", "--max-tokens", "3", "--json", str(out)])
    assert json.loads(out.read_text())["episodes"] == 2.0
    with pytest.raises(SystemExit, match="is a LoRA adapter whose base model .* pass the base it was trained on"):
        model_source(str(tmp_path / "adapter"), str(tmp_path / "nowhere"))


def test_help_comes_before_verl_is_imported() -> None:
    """`--help` prints the usage and nothing else: verl (imported for a run) warns a dozen times at import."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "verl_mas.evaluate", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m verl_mas.evaluate"), proc.stdout[:500]
    assert proc.stderr == ""  # verl's "No supported accelerator", "... engine is not available" go to stderr
    assert "WARNING" not in proc.stdout and "Warning" not in proc.stdout
