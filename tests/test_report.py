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


def _write_with_validation(path: Path) -> Path:
    # verl logs the validation before training at step 0 (a row of its own) and a later one with its step's metrics.
    val = {0: (0.0625, 0.0), 2: (0.25, 0.5), 4: (0.5625, 0.875)}
    lines = []
    for step in range(0, 5):
        data = {} if step == 0 else {"mas/success_rate": 0.25 * step, "mas/caller/reward/mean": 0.5}
        if step in val:
            data["val-core/relay-v0/acc/mean@4"], data["val-aux/relay-v0/acc_greedy/mean@4"] = val[step]
            data["val-aux/relay-v0/acc/std@4"] = 0.1  # another statistic of verl's: not a success series
        lines.append(json.dumps({"step": step, "data": data}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_held_out_success_opens_the_table_first_and_last_validation(tmp_path: Path) -> None:
    from verl_mas.report import held_out

    rows = load_metrics(_write_with_validation(tmp_path / "m.jsonl"))
    assert held_out(rows) == {"relay-v0 greedy": [(0.0, 0.0), (2.0, 0.5), (4.0, 0.875)],
                              "relay-v0 sampled (mean@4)": [(0.0, 0.0625), (2.0, 0.25), (4.0, 0.5625)]}
    lines = role_table(rows, window=2).splitlines()
    assert lines[0].startswith("held-out team success")
    assert lines[2] == "relay-v0 greedy                       0.000    0.875   +0.875  0 -> 4"
    assert lines[3] == "relay-v0 sampled (mean@4)             0.062    0.562   +0.500  0 -> 4"
    # The training part counts training steps only (step 0 holds validation alone): 4 steps, windows of 2.
    assert "training (4 steps; means over the first and last 2 steps" in lines[5]
    assert "mas/success_rate                      0.375    0.875   +0.500" in "\n".join(lines)
    # A run without validation says so instead of leaving the line out.
    assert role_table(load_metrics(_write(tmp_path / "n.jsonl"))).startswith("held-out team success: none logged")
    assert plot(rows, tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
