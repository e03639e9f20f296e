"""bench/bench_learning.py's verdicts: the paired comparisons the docs quote, the records they are read from, and
what the series still has to run.

The table in docs/algorithm.md says "above by more than the spread" from these functions; the expectations below
are worked out by hand from the definitions in the module (the paired difference per seed, its mean, the larger of
the two configurations' sample standard deviations across seeds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from test_bench_resume import bench


def _results(first: list[float], second: list[float], column: str = "greedy@end") -> dict:
    return {"at_grpo": {s: {column: v} for s, v in enumerate(first)},
            "traj_grpo": {s: {column: v} for s, v in enumerate(second)}}


def _only(results: dict) -> dict:
    (row,) = [c for c in bench.comparisons(results) if (c["first"], c["second"]) == ("at_grpo", "traj_grpo")]
    return row


def test_a_gap_on_every_seed_larger_than_the_spread_is_a_yes() -> None:
    row = _only(_results([1.0, 0.8, 0.9], [0.2, 0.4, 0.3]))
    assert row["seeds"] == [0, 1, 2]
    assert row["diffs"] == pytest.approx([0.8, 0.4, 0.6])
    assert row["mean"] == pytest.approx(0.6)
    assert row["spread"] == pytest.approx(0.1)  # stdev of (1.0, 0.8, 0.9) and of (0.2, 0.4, 0.3): both 0.1
    assert row["verdict"] == "yes"


def test_a_mean_gap_within_the_spread_or_one_seed_reversed_is_a_no() -> None:
    # +0.1 on every seed, but the first configuration's seeds spread by 0.4
    within = _only(_results([1.0, 0.2, 0.6], [0.9, 0.1, 0.5]))
    assert within["mean"] == pytest.approx(0.1) and within["spread"] == pytest.approx(0.4)
    assert within["verdict"] == "no"
    # a mean gap above the spread, but seed 1 goes the other way
    reversed_seed = _only(_results([0.9, 0.8, 0.9], [0.1, 0.85, 0.1]))
    assert reversed_seed["diffs"] == pytest.approx([0.8, -0.05, 0.8])
    assert reversed_seed["mean"] == pytest.approx(1.55 / 3)
    # the larger stdev: (0.1, 0.85, 0.1)'s sqrt(0.1875); (0.9, 0.8, 0.9)'s is 0.058
    assert reversed_seed["spread"] == pytest.approx(math.sqrt(0.1875))
    assert reversed_seed["mean"] > reversed_seed["spread"]
    assert reversed_seed["verdict"] == "no"


def test_fewer_than_three_paired_seeds_give_no_verdict_and_unpaired_seeds_are_left_out() -> None:
    results = _results([1.0, 0.9], [0.0, 0.1])
    results["traj_grpo"][5] = {"greedy@end": 0.0}  # no at_grpo run of seed 5: not paired
    row = _only(results)
    assert row["seeds"] == [0, 1]
    assert row["verdict"] == "2 seed(s): too few for a verdict"


def test_records_of_other_settings_are_counted_and_left_out_and_a_seed_recorded_again_keeps_its_last(
        tmp_path: Path) -> None:
    def rec(config: str, seed: int, value: float, settings: str = "aaa", steps: int = 200) -> str:
        return json.dumps({"workflow": "gridwalk-v0", "config": config, "seed": seed, "steps": steps, "k": 8,
                           "settings": settings, "figures": {"greedy@end": value}})

    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([rec("at_grpo", 0, 0.5), rec("at_grpo", 0, 0.75), rec("at_grpo", 1, 1.0, "bbb"),
                               rec("at_grpo", 2, 1.0, steps=40), ""]) + "\n")
    results, other = bench.read_results(path, "gridwalk-v0", 200, 8, "aaa")
    assert results == {"at_grpo": {0: {"greedy@end": 0.75}}}
    assert other == {"bbb": 1}  # seed 1's other settings; seed 2's 40 steps are another workflow length, not counted

    path.write_text(rec("at_grpo", 0, 0.5) + "\n{\"config\": \"at_grpo\"}\n")
    with pytest.raises(SystemExit, match=r"r.jsonl:2 is not a bench_learning record"):
        bench.read_results(path, "gridwalk-v0", 200, 8, "aaa")


def test_the_summary_of_an_earlier_series_is_asked_for_by_its_settings_fingerprint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A changed recipe or config group starts a new series; the tables the docs quote from the one before stay
    reproducible with ``--summary --settings <its fingerprint>``."""
    def rec(config: str, seed: int, value: float, settings: str) -> str:
        return json.dumps({"workflow": "gridwalk-v0", "config": config, "seed": seed, "steps": 200, "k": 8,
                           "settings": settings, "figures": {"greedy@end": value, "sampled@end": value}})

    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([rec("at_grpo", 0, 0.25, "old1"), rec("at_grpo", 1, 0.75, "old1"),
                               rec("at_grpo", 0, 1.0, "old2")]) + "\n")
    current = bench.settings_fingerprint(bench.WORKFLOWS["gridwalk-v0"]["recipe"])

    def main(*argv: str) -> str:
        monkeypatch.setattr("sys.argv", ["bench_learning.py", "--workflow", "gridwalk-v0", "--results", str(path),
                                         *argv])
        bench.main()
        return capsys.readouterr().out

    out = main("--summary", "--settings", "old1")
    assert f"recipe settings old1 (the recipe's current ones: {current}); r.jsonl has 2 records of these and, " \
           "left out, 1 of settings old2" in out
    assert "at_grpo (seeds [0, 1]): greedy@end 0.500 +- 0.354" in out  # mean and sample std of 0.25 and 0.75
    out = main("--summary")  # the current settings: none of these records
    assert f"recipe settings {current} (the recipe's current ones); r.jsonl has 0 records of these and, left out, " \
           "2 of settings old1, 1 of settings old2" in out
    with pytest.raises(SystemExit, match=r"--settings 0ld1: .* holds no gridwalk-v0 record of 200 steps and K=8 with "
                                         r"these settings; it holds these: old1 \(2\), old2 \(1\)"):
        main("--summary", "--settings", "0ld1")  # a mistyped fingerprint is not an empty series
    with pytest.raises(SystemExit) as refused:  # runs are made with the current settings only
        main("--settings", "old1")
    assert refused.value.code == 2 and "give them with --summary" in capsys.readouterr().err


def test_what_is_still_to_run_goes_by_the_last_record_a_configuration_writes() -> None:
    recorded = {"at_grpo": {0: {}, 1: {}, 2: {}}, "parallel": {1: {}},
                "together": {0: {}, 1: {}}, "swapped": {0: {}},  # seed 1 stopped after together, before swapped
                "scout alone": {0: {}}, "walker alone": {0: {}}}  # seed 0's two runs, not yet combined
    todo = bench.still_to_run(recorded, ["at_grpo", "parallel", "together", "alone", "single"], [0, 1, 2])
    assert todo == {"parallel": [0, 2], "together": [1, 2], "alone": [0, 1, 2], "single": [0, 1, 2]}


def test_the_curves_average_the_seeds_at_each_validation_and_the_plot_draws_them(tmp_path: Path) -> None:
    """The mean curve the Markdown table and the plot show: per validation step, the mean over the seeds whose record
    holds a whole curve (an ``@all`` figure); evaluations after training only (``swapped``) have none."""
    def run(at_40: float, end: float) -> dict:
        return {"greedy@0": 0.0, "greedy@40": at_40, "greedy@end": end, "greedy@all": (at_40 + end) / 2,
                "sampled@0": 0.0, "sampled@40": at_40 / 2, "sampled@end": end, "sampled@all": (at_40 / 2 + end) / 2}

    results = {"at_grpo": {0: run(0.5, 1.0), 1: run(0.25, 0.75), 2: {"greedy@end": 0.0, "sampled@end": 0.0}},
               "swapped": {0: {"greedy@end": 0.0, "sampled@end": 0.25}}}
    # Seed 2 has no curve: left out of the mean (0.5 and 0.25 at step 40 -> 0.375; 1.0 and 0.75 at 80 -> 0.875).
    greedy = {0: [(0, 0.0), (40, 0.5), (80, 1.0)], 1: [(0, 0.0), (40, 0.25), (80, 0.75)]}
    assert bench.mean_curve(results["at_grpo"], "greedy", 80) == (greedy, [(0, 0.0), (40, 0.375), (80, 0.875)])
    sampled = {0: [(0, 0.0), (40, 0.25), (80, 1.0)], 1: [(0, 0.0), (40, 0.125), (80, 0.75)]}
    assert bench.mean_curve(results["at_grpo"], "sampled", 80) == (sampled, [(0, 0.0), (40, 0.1875), (80, 0.875)])
    assert bench.mean_curve(results["swapped"], "greedy", 80) == ({}, [])
    assert "0.00 / 0.38 / 0.88 (steps 0, 40, 80; seeds 0, 1)" in bench.markdown(results, 80)
    out = bench.plot(results, 80, tmp_path / "figures" / "curves.png", "a test series")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_run_reported_again_with_the_same_figures_is_not_recorded_twice(tmp_path: Path) -> None:
    """``alone``'s scout run finished, then the machine was taken back during the walker's: invoked again, the
    benchmark reports the scout's run from its files (the same figures), which the results file already holds."""
    path = tmp_path / "r.jsonl"
    scout = {"workflow": "gridwalk-v0", "config": "scout alone", "seed": 0, "steps": 200, "k": 8, "settings": "aaa",
             "figures": {"greedy@end": 0.1, "sampled@end": 0.0625, "greedy@all": 1 / 3}}
    assert bench.append_record(path, {}, scout)
    recorded, _ = bench.read_results(path, "gridwalk-v0", 200, 8, "aaa")  # the next invocation reads the file
    assert not bench.append_record(path, recorded, dict(scout))
    # Another seed, or the same seed with other figures (a --rerun), is a new record.
    assert bench.append_record(path, recorded, {**scout, "seed": 1})
    assert bench.append_record(path, recorded, {**scout, "figures": {"greedy@end": 0.2, "sampled@end": 0.0}})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["seed"], r["figures"]["greedy@end"]) for r in lines] == [(0, 0.1), (1, 0.1), (0, 0.2)]
