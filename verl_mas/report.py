"""Summarise a training run: held-out team success, a per-role table of the ``mas/*`` metrics and a PNG per step.

The table opens with held-out team success, first and last validation: verl's validation on the test split
(``trainer.val_before_train`` / ``trainer.test_freq``), one candidate per node (``mas.val_branching=1``),
greedy (``val-aux/<source>/acc_greedy``, ``mas.val_greedy``) and sampled with ``val_kwargs``
(``val-core/<source>/acc``). Training success (``mas/success_rate``) follows it: those episodes commit the best
of K candidates at every node, so it is above what one sample achieves.

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

__all__ = ["held_out", "held_out_table", "load_metrics", "main", "plot", "role_table"]

_ROLE_REWARD = re.compile(r"^mas/([^/]+)/reward/mean$")
#: verl's validation metrics of the mas agent loop's team success: acc (sampled, val_kwargs) and acc_greedy.
_HELD_OUT = re.compile(r"^val-(?:core|aux)/(?P<source>[^/]+)/(?P<var>acc|acc_greedy)/mean@(?P<n>\d+)$")


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


def held_out(rows: list[dict[str, float]]) -> dict[str, list[tuple[float, float]]]:
    """Held-out team success per series (``"<source> greedy"``, ``"<source> sampled (mean@n)"``): ``(step, value)``
    at every validation, in step order; greedy series first."""
    series: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for row in rows:
        for key, value in row.items():
            m = _HELD_OUT.match(key)
            if m is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            greedy = m["var"] == "acc_greedy"
            label = f"{m['source']} greedy" if greedy else f"{m['source']} sampled (mean@{m['n']})"
            series.setdefault((0 if greedy else 1, label), []).append((row["step"], float(value)))
    return {label: points for (_, label), points in sorted(series.items())}


def held_out_table(rows: list[dict[str, float]]) -> str:
    """Held-out team success, first and last validation of the run (or why there is none)."""
    series = held_out(rows)
    if not series:
        return ("held-out team success: none logged (the run validated nothing: set trainer.val_before_train=true "
                "and trainer.test_freq=N with data.val_files on the test split)")
    lines = ["held-out team success (validation on the test split, one candidate per node)",
             f"{'series':<34} {'first':>8} {'last':>8} {'change':>8}  steps"]
    for label, points in series.items():
        (s0, v0), (s1, v1) = points[0], points[-1]
        lines.append(f"{label:<34} {v0:>8.3f} {v1:>8.3f} {v1 - v0:>+8.3f}  {s0:g} -> {s1:g}")
    return "\n".join(lines)


def role_table(rows: list[dict[str, float]], window: int = 10) -> str:
    """A plain-text table: held-out success (:func:`held_out_table`), then each training metric's mean over the
    first and the last ``window`` training steps."""
    held = held_out_table(rows)
    rows = [r for r in rows if any(k.startswith("mas/") for k in r)]  # training steps (step 0: validation only)
    if not rows:
        return held + "\n(no training steps logged)"
    window = max(1, min(window, len(rows) // 2 or 1))
    first, last = rows[:window], rows[-window:]
    lines = [
        held,
        "",
        f"training ({len(rows)} steps; means over the first and last {window} steps; training episodes commit the "
        "best of K at every node)",
        f"{'metric':<34} {'first':>8} {'last':>8} {'change':>8}",
    ]
    keys = ["mas/success_rate"]
    for role in roles_of(rows):
        keys += [f"mas/{role}/reward/mean", f"mas/{role}/turns", f"mas/{role}/parse_failures"]
    keys += ["mas/num_turns", "mas/group/zero_std_frac", "mas/drop/row_frac", "mas/infra_failures", "actor/grad_norm",
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
    """Write a PNG: per-role mean reward per step, and team success: training (raw and a moving average) with
    held-out greedy and sampled success at every validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if any(k.startswith("mas/") for k in r)]  # training steps (not step 0's validation)
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for role in roles_of(train):
        values = [r.get(f"mas/{role}/reward/mean", float("nan")) for r in train]
        (line,) = axes[0].plot(steps, values, alpha=0.3)
        axes[0].plot(steps, _smooth(values, smooth), color=line.get_color(), label=role)
    axes[0].set(title="reward per role", xlabel="training step", ylabel="mean candidate reward")
    axes[0].legend()
    success = [r.get("mas/success_rate", float("nan")) for r in train]
    axes[1].plot(steps, success, alpha=0.3, color="tab:green")
    axes[1].plot(steps, _smooth(success, smooth), color="tab:green",
                 label=f"training, best of K per node ({smooth}-step average)")
    for (label, points), style in zip(held_out(rows).items(), ("o-", "s--", "^-", "v--"), strict=False):
        axes[1].plot([p[0] for p in points], [p[1] for p in points], style, label=f"held-out {label}")
    axes[1].set(title="team success", xlabel="training step", ylabel="success rate", ylim=(0, 1.05))
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
