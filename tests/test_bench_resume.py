"""bench/bench_learning.py resumes a stopped run from its last checkpoint and stitches its metrics.

Its runs take hours on 2 cores; a machine taken back mid-run must not cost the run. The recipe here is a short
bash script that behaves as ``main_ppo`` does towards the benchmark (verl's file logger truncates
``metrics.jsonl`` at start; a checkpoint every ``trainer.save_freq`` steps and at the last, its step written to
``checkpoints/latest_checkpointed_iteration.txt`` last; training resumes after the latest one; the validation
before training only with ``trainer.val_before_train=true``), and can be told to fail after a given step, which
leaves the run folder as a stopped machine does, or to fail its first launches at start-up as a lost port race
does. That verl itself resumes so is checked by tests/test_main_ppo_policies.py (per-role models resumed on another
cluster). A machine handed back loses the ``--work`` folder too: the roles trained alone are kept beside the results
once finished, and a second machine trains only the role not kept and evaluates the two together.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_learning", REPO / "bench" / "bench_learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()

# Arguments as main_ppo reads them; every logged row names the launch ("part") that wrote it.
RECIPE = r"""#!/usr/bin/env bash
set -euo pipefail
run="$VERL_MAS_RUN_DIR"; mkdir -p "$run/checkpoints"
for a in "$@"; do case "$a" in
  trainer.total_training_steps=*) total="${a#*=}";; trainer.save_freq=*) every="${a#*=}";;
  trainer.val_before_train=*) val="${a#*=}";; trainer.resume_mode=*) mode="${a#*=}";; esac; done
[ "$mode" = auto ] || exit 3
marker="$run/checkpoints/latest_checkpointed_iteration.txt"
start=0; [ -f "$marker" ] && start=$(cat "$marker")
if [ "$val" = true ] && (( start > 0 )); then echo "a resumed run validated before training" >&2; exit 4; fi
part=$(cat "$run/launches" 2>/dev/null || echo 0); echo $((part + 1)) > "$run/launches"
: > "$run/metrics.jsonl"
if (( part < ${PORT_TAKEN_LAUNCHES:-0} )); then  # as torch's TCPStore fails when rank 0's probed port was taken
  echo "torch.distributed.DistNetworkError: port: 37499, code: -98, name: EADDRINUSE" >&2; exit 1; fi
if [ "$val" = true ]; then echo "{\"step\": $start, \"data\": {\"val\": 1, \"part\": $part}}" >> "$run/metrics.jsonl"; fi
for ((s = start + 1; s <= total; s++)); do
  echo "{\"step\": $s, \"data\": {\"part\": $part}}" >> "$run/metrics.jsonl"
  if (( s % every == 0 || s == total )); then echo $s > "$marker"; fi
  if [ -n "${FAIL_AFTER:-}" ] && (( s == FAIL_AFTER )); then echo "stopped at step $s" >&2; exit 1; fi
done
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.sh"
    path.write_text(RECIPE)
    return path


def _origin(rows: list[dict]) -> list[tuple[int, int]]:
    return [(int(r["step"]), int(r["part"])) for r in rows]


def test_a_stopped_run_resumes_from_its_last_checkpoint_and_its_metrics_are_stitched(
        recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "work" / "at_grpo-seed0"
    run_dir.parent.mkdir()
    # Stopped after step 7 (checkpoint at 4), then after step 10 (checkpoint at 8), then to the end (12).
    for fail_after in (7, 10):
        monkeypatch.setenv("FAIL_AFTER", str(fail_after))
        with pytest.raises(RuntimeError, match=f"resume it(.|\n)*stopped at step {fail_after}"):
            bench._run(recipe, run_dir, 0, 12, [], checkpoint_every=4)
    monkeypatch.delenv("FAIL_AFTER")
    rows, wall, resumed = bench._run(recipe, run_dir, 0, 12, [], checkpoint_every=4)
    # Steps 0-4 from the first launch, 5-8 from the second (its 9-10 ran past its last checkpoint), 9-12 from the
    # third; the validation before training only in the first.
    assert _origin(rows) == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1), (7, 1), (8, 1),
                             (9, 2), (10, 2), (11, 2), (12, 2)]
    assert [r.get("val") for r in rows] == [1] + [None] * 12
    assert resumed == [4, 8]
    parts = json.loads((run_dir / bench.PARTS).read_text())
    assert [(p["from_step"], p["metrics"]) for p in parts] == [
        (0, "metrics.part0.jsonl"), (4, "metrics.part1.jsonl"), (8, "metrics.jsonl")]
    assert all(p["wall_s"] >= 0 for p in parts) and wall == pytest.approx(sum(p["wall_s"] for p in parts))
    # Invoked again: finished, so nothing is launched and the same metrics come back.
    again = bench._run(recipe, run_dir, 0, 12, [], checkpoint_every=4)
    assert (run_dir / "launches").read_text().strip() == "3"
    assert _origin(again[0]) == _origin(rows) and again[2] == [4, 8]
    # Its folder is not taken for a run of other steps (its metrics would pass for that run's).
    with pytest.raises(RuntimeError, match=r"holds a run of \[12\] steps, not one of 8 steps"):
        bench._run(recipe, run_dir, 0, 8, [], checkpoint_every=4)


def test_a_run_stopped_before_its_first_checkpoint_starts_again_with_its_validation(
        recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "single-seed1"
    monkeypatch.setenv("FAIL_AFTER", "3")
    with pytest.raises(RuntimeError):
        bench._run(recipe, run_dir, 1, 8, [], checkpoint_every=4)
    monkeypatch.delenv("FAIL_AFTER")
    rows, _, resumed = bench._run(recipe, run_dir, 1, 8, [], checkpoint_every=4)
    assert _origin(rows) == [(s, 1) for s in range(9)] and rows[0]["val"] == 1
    assert resumed == []  # a new start, not a resumption


def test_stitching_refuses_parts_that_do_not_give_one_row_per_step(tmp_path: Path) -> None:
    for name, steps in (("a.jsonl", range(0, 9)), ("b.jsonl", range(9, 12)), ("c.jsonl", range(5, 12))):
        (tmp_path / name).write_text("".join(json.dumps({"step": s, "data": {}}) + "\n" for s in steps))
    good = [{"from_step": 0, "metrics": "a.jsonl"}, {"from_step": 8, "metrics": "b.jsonl"}]
    assert [r["step"] for r in bench.stitch(good, tmp_path)] == list(range(12))
    # A later part that claims to resume from an earlier step than the one before it (a broken marker).
    backwards = [{"from_step": 0, "metrics": "a.jsonl"}, {"from_step": 8, "metrics": "b.jsonl"},
                 {"from_step": 4, "metrics": "c.jsonl"}]
    with pytest.raises(RuntimeError, match="not one row per step in order"):
        bench.stitch(backwards, tmp_path)


def test_a_launch_that_lost_a_port_race_is_made_again_from_the_last_checkpoint_and_other_failures_are_not(
        recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "parallel-seed1"
    # Stopped after step 6 (checkpoint at 4); invoked again, its next two launches fail at start-up with EADDRINUSE:
    # launched a third time from step 4 without being invoked again.
    monkeypatch.setenv("FAIL_AFTER", "6")
    with pytest.raises(RuntimeError, match="stopped at step 6"):  # not a port race: not launched again
        bench._run(recipe, run_dir, 1, 8, [], checkpoint_every=4)
    assert (run_dir / "launches").read_text().strip() == "1"
    monkeypatch.delenv("FAIL_AFTER")
    monkeypatch.setenv("PORT_TAKEN_LAUNCHES", "3")  # launches 1 and 2 (counted from 0) fail
    rows, _, resumed = bench._run(recipe, run_dir, 1, 8, [], checkpoint_every=4)
    assert (run_dir / "launches").read_text().strip() == "4"
    assert _origin(rows) == [(s, 0) for s in range(5)] + [(s, 3) for s in range(5, 9)]
    assert resumed == [4, 4, 4]  # the two failed launches are parts that logged nothing
    assert capsys.readouterr().out.count("(EADDRINUSE); launching again from step 4") == 2
    # More lost races than PORT_RETRIES: the run stops and says how to resume it.
    other = tmp_path / "parallel-seed2"
    monkeypatch.setenv("PORT_TAKEN_LAUNCHES", str(bench.PORT_RETRIES + 1))
    with pytest.raises(RuntimeError, match=r"resume it(.|\n)*EADDRINUSE"):
        bench._run(recipe, other, 2, 8, [], checkpoint_every=4)
    assert (other / "launches").read_text().strip() == str(bench.PORT_RETRIES + 1)


# A per-role run as the benchmark's ``alone`` sees it: held-out success before and after, training success, the
# test split, and at the last step a transformers model per policy (``actor/`` the first role's, ``actor_<role>``)
# whose file names the run and the folder. Fails at start-up when its run folder is $FAIL_RUN.
PER_ROLE_RECIPE = r"""#!/usr/bin/env bash
exec "$PYTHON" - "$@" <<'PY'
import json, os, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
run = Path(os.environ["VERL_MAS_RUN_DIR"])
if run.name == os.environ.get("FAIL_RUN"):
    sys.exit(f"{run.name}: stopped")
total = int(args["trainer.total_training_steps"])
(run / "data").mkdir(parents=True, exist_ok=True)
(run / "data" / "test.parquet").write_text("the test split")
val = lambda v: {"val-aux/gw/acc_greedy/mean@4": v, "val-core/gw/acc/mean@4": v / 2}
rows = [{"step": 0, "data": val(0.0)}] + [{"step": s, "data": {"mas/success_rate": s / total, "timing_s/step": 2.0}}
                                          for s in range(1, total + 1)]
rows[-1]["data"].update(val(0.5 if "scout" in run.name else 0.25))  # the last step's validation, in its row
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
for folder in ("actor", "actor_walker"):
    hf = run / "checkpoints" / f"global_step_{total}" / folder / "huggingface"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_text(f"{run.name}:{folder}")
(run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(total))
PY
"""


def test_a_role_trained_alone_is_kept_and_the_next_invocation_on_another_machine_trains_only_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "per_role.sh"
    recipe.write_text(PER_ROLE_RECIPE)
    monkeypatch.setitem(bench.WORKFLOWS, "gw", {"recipe": recipe, "roles": ("scout", "walker"), "steps": 4,
                                                "validations": 1, "turns": 2, "tokens": 1})
    evaluated, reports = [], []
    monkeypatch.setattr(bench, "evaluate", lambda test, models, spec, work: evaluated.append(
        (test.read_text(), {role: (path / "model.safetensors").read_text() for role, path in models.items()}))
        or {"greedy@end": 0.75, "sampled@end": 0.5})
    kept = tmp_path / "results" / "models" / "gw-4steps-k2-abc"

    def invoke(work: Path) -> None:
        bench.run_seed("gw", ["alone"], 0, 4, 2, work, lambda *record: reports.append(record), 2, kept)

    # The first machine trains the scout and is taken back while the walker trains.
    monkeypatch.setenv("FAIL_RUN", "alone-walker-seed0")
    with pytest.raises(RuntimeError, match="alone-walker-seed0 failed"):
        invoke(tmp_path / "machine1")
    # train end: the mean of the last 5 steps' success, here all 4: (1 + 2 + 3 + 4) / 16.
    scout = {"greedy@0": 0.0, "greedy@end": 0.5, "sampled@0": 0.0, "sampled@end": 0.25, "train end": 0.625,
             "step s": 2.0}
    assert [(name, seed, figures, resumed) for name, seed, figures, _, resumed in reports] == [
        ("scout alone", 0, scout, [])]
    scout_wall = reports[0][3]
    assert sorted(p.name for p in kept.iterdir()) == ["alone-scout-seed0"]  # nothing of the walker's run
    assert (kept / "alone-scout-seed0" / "model" / "model.safetensors").read_text() == "alone-scout-seed0:actor"
    assert (kept / "alone-scout-seed0" / "test.parquet").read_text() == "the test split"
    assert json.loads((kept / "alone-scout-seed0" / "run.json").read_text()) == {
        "figures": scout, "wall_s": scout_wall, "resumed_from": []}

    # Another machine, its --work folder empty: the scout is taken as kept, the walker trained, the two combined.
    monkeypatch.delenv("FAIL_RUN")
    reports.clear()
    invoke(tmp_path / "machine2")
    assert not (tmp_path / "machine2" / "alone-scout-seed0").exists()
    assert evaluated == [("the test split", {"scout": "alone-scout-seed0:actor",
                                             "walker": "alone-walker-seed0:actor_walker"})]
    (name, _, figures, wall, _), (walker_name, _, walker, walker_wall, _), (combined, _, team, team_wall, _) = reports
    assert (name, figures, wall) == ("scout alone", scout, scout_wall)  # again, as recorded: append_record skips it
    assert (walker_name, walker["greedy@end"], combined, team) == ("walker alone", 0.25, "alone",
                                                                  {"greedy@end": 0.75, "sampled@end": 0.5})
    assert team_wall == pytest.approx(scout_wall + walker_wall)
    assert sorted(p.name for p in kept.iterdir()) == ["alone-scout-seed0", "alone-walker-seed0"]

    # A kept folder that lost its model is refused, not trained around or evaluated without it.
    (kept / "alone-walker-seed0" / "model" / "model.safetensors").unlink()
    (kept / "alone-walker-seed0" / "model").rmdir()
    with pytest.raises(RuntimeError, match="alone-walker-seed0 is a kept run without \\['model'\\]: remove"):
        invoke(tmp_path / "machine3")
