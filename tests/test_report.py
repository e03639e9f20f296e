"""verl_mas.report: the per-role table and the plot of a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from verl_mas.report import load_metrics, plot, role_table


def _write(path: Path) -> Path:
    lines = []
    for step in range(1, 5):
        data = {"mas/success_rate": 0.25 * (step - 1), "mas/caller/reward/mean": 0.1 * step,
                "mas/runner/reward/mean": 1.0, "timing_s/step": 2.0}
        lines.append(json.dumps({"step": step, "data": data}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_table_compares_first_and_last_window(tmp_path: Path) -> None:
    rows = load_metrics(_write(tmp_path / "m.jsonl"))
    table = role_table(rows, window=2)
    # success: first two steps (0, 0.25) -> 0.125; last two (0.5, 0.75) -> 0.625; change +0.5.
    assert "mas/success_rate                      0.125    0.625   +0.500" in table
    # caller reward: (0.1 + 0.2) / 2 = 0.15 -> (0.3 + 0.4) / 2 = 0.35.
    assert "mas/caller/reward/mean                0.150    0.350   +0.200" in table
    assert "mas/runner/reward/mean" in table and "4 steps" in table


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = plot(load_metrics(_write(tmp_path / "m.jsonl")), tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_writes_the_episode_page_when_the_run_recorded_episodes(tmp_path: Path, capsys) -> None:
    import json

    from verl_mas.recording import episode_record, write_records
    from verl_mas.report import main
    from verl_mas.testing import ScriptedLLM, default_tokenizer, run_workflow

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"mas/success_rate": 0.5}}) + "\n")
    main([str(run / "metrics.jsonl")])
    assert "episodes:" not in capsys.readouterr().out and not (run / "episodes.html").exists()  # none recorded
    tokenizer = default_tokenizer()
    task = {"message": ["red", "blue"]}
    episode = run_workflow("relay-v0", task, ScriptedLLM({"caller": "red", "runner": "red"}, tokenizer=tokenizer),
                           branching=2, max_turns=2, tokenizer=tokenizer)
    write_records(run / "episodes" / "episodes_train_step000001_1.jsonl",
                  [episode_record(episode, source="train", task=task, step=1, tokenizer=tokenizer)] * 3)
    main([str(run / "metrics.jsonl")])
    out = capsys.readouterr().out
    assert f"episodes: 3 recorded in {run / 'episodes'}; open {run / 'episodes.html'} in a browser" in out
    import re

    page = (run / "episodes.html").read_text()
    embedded = re.search(r'<script type="application/json" id="episodes">(.*?)</script>', page, re.S).group(1)
    assert [e["task_uid"] for e in json.loads(embedded)] == [episode.task_uid] * 3
