"""verl_mas.evaluate: success per dataset and metric means over a test split."""

from __future__ import annotations

import json
from pathlib import Path

from verl_mas.data import canonical_json, make_rows
from verl_mas.episode import EpisodeConfig
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
