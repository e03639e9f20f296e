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
