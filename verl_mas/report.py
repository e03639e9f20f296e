"""Summarise a training run: a per-role table of the ``mas/*`` metrics and a PNG of reward and success per step.

Reads the JSON-lines file verl's ``file`` logger writes (``trainer.logger=[console,file]`` with
``VERL_FILE_LOGGER_PATH``)::

    python -m verl_mas.report runs/at_grpo_cpu/metrics.jsonl --plot runs/at_grpo_cpu/curves.png

When the run recorded episodes (``mas.record``, in ``episodes/`` next to the metrics file), the report also
writes the episode page (``python -m verl_mas.view``) next to them, ``episodes.html``, and names it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["load_metrics", "main", "plot", "role_table"]

_ROLE_REWARD = re.compile(r"^mas/([^/]+)/reward/mean$")


def load_metrics(path: str | Path) -> list[dict[str, float]]:
    """One dict per logged step (with ``step``), in step order."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append({"step": float(record["step"]), **record["data"]})
    if not rows:
        raise ValueError(f"{path} holds no metrics; was the run started with trainer.logger=[console,file]?")
    return sorted(rows, key=lambda r: r["step"])


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def roles_of(rows: list[dict[str, float]]) -> list[str]:
    return sorted({m.group(1) for row in rows for key in row if (m := _ROLE_REWARD.match(key))})


def role_table(rows: list[dict[str, float]], window: int = 10) -> str:
    """A plain-text table: each metric's mean over the first and the last ``window`` steps."""
    window = max(1, min(window, len(rows) // 2 or 1))
    first, last = rows[:window], rows[-window:]
    lines = [
        f"{len(rows)} steps; means over the first and last {window} steps",
        f"{'metric':<34} {'first':>8} {'last':>8} {'change':>8}",
    ]
    keys = ["mas/success_rate"]
    for role in roles_of(rows):
        keys += [f"mas/{role}/reward/mean", f"mas/{role}/turns", f"mas/{role}/parse_failures"]
    keys += ["mas/num_turns", "mas/group/zero_std_frac", "mas/infra_failures", "actor/grad_norm",
             "training/rollout_probs_diff_mean", "timing_s/step"]
    for key in keys:
        if not any(key in row for row in rows):
            continue
        a, b = _mean([r.get(key, float("nan")) for r in first]), _mean([r.get(key, float("nan")) for r in last])
        lines.append(f"{key:<34} {a:>8.3f} {b:>8.3f} {b - a:>+8.3f}")
    return "\n".join(lines)


def _smooth(values: list[float], k: int) -> list[float]:
    return [_mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def plot(rows: list[dict[str, float]], out: str | Path, smooth: int = 5) -> Path:
    """Write a PNG: per-role mean reward and team success rate per step (raw and a moving average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for role in roles_of(rows):
        values = [r.get(f"mas/{role}/reward/mean", float("nan")) for r in rows]
        (line,) = axes[0].plot(steps, values, alpha=0.3)
        axes[0].plot(steps, _smooth(values, smooth), color=line.get_color(), label=role)
    axes[0].set(title="reward per role", xlabel="training step", ylabel="mean candidate reward")
    axes[0].legend()
    success = [r.get("mas/success_rate", float("nan")) for r in rows]
    axes[1].plot(steps, success, alpha=0.3, color="tab:green")
    axes[1].plot(steps, _smooth(success, smooth), color="tab:green", label=f"moving average ({smooth} steps)")
    axes[1].set(title="team success rate", xlabel="training step", ylabel="mas/success_rate", ylim=(0, 1.05))
    axes[1].legend()
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_mas.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", help="metrics.jsonl written by verl's file logger")
    parser.add_argument("--plot", default=None, help="write a PNG of reward/success per role to this path")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at the start and the end")
    parser.add_argument("--view", default=None, help="where to write the page of recorded episodes (default: "
                        "episodes.html next to the metrics file, when the run recorded episodes)")
    args = parser.parse_args(argv)
    rows = load_metrics(args.metrics)
    print(role_table(rows, window=args.window))
    if args.plot:
        print(f"plot: {plot(rows, args.plot)}")
    recorded = Path(args.metrics).parent / "episodes"
    if any(recorded.glob("episodes*.jsonl")):
        from verl_mas.view import read_episodes, write_page

        episodes = read_episodes([recorded])
        page = write_page(episodes, Path(args.view) if args.view else recorded.parent / "episodes.html")
        print(f"episodes: {len(episodes)} recorded in {recorded}; open {page} in a browser")


if __name__ == "__main__":
    main()
