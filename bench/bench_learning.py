"""Benchmark: the paper's comparisons, measured on held-out tasks through verl's ``main_ppo`` on CPU.

Every configuration runs a CPU recipe for the same number of steps with the same samples per task and node,
for several seeds (the seed sets the tiny model's initialisation, the data order and the rollout's sampling):

- ``at_grpo``: tree sampling (K candidates per (task, role, turn), best committed) + agent_turn groups;
- ``traj_grpo``: K independent episodes per task, each role's return in an episode (its per-turn team and local
  rewards summed: the same reward signal AT-GRPO normalises per turn) normalised over the task's K episodes, one
  advantage per (episode, role) broadcast to its rows (classic GRPO with AT-GRPO's rewards);
- ``traj_grpo_success`` (not run by default): the same with the episode's binary team outcome as every row's score;
- ``parallel``: K independent episodes per task with (task, role, turn) groups (the paper's ablation: after the
  first turn the K members of a group no longer share a prompt: on gridwalk-v0 the walkers stand elsewhere);
- ``at_grpo_all_rows`` (not run by default): AT-GRPO with ``mas.drop_zero_variance=false``;
- ``together`` (gridwalk-v0): AT-GRPO with one model per role (``mas_policies=per_role_models``), both trained; its
  two trained models are also evaluated **swapped** between the roles (the paper's specialisation check);
- ``alone`` (gridwalk-v0): each role trained with its partner frozen at initialisation (the same per-role run with
  ``mas.policies.<partner>.frozen=true``: the partner serves its role and takes no optimiser step, so the trained
  role's samples, rewards and updates are as in ``together``), then the two trained roles combined: the scout of
  the scout's run with the walker of the walker's run;
- ``single`` (gridwalk-v0): ``gridwalk-single-v0`` (one walker that sees what both roles see) with GRPO (2K
  independent episodes per task, trajectory groups: the team's 2 roles x K samples per turn).

Held-out team success, before training and after the last step, one candidate per node: greedy and sampled at the
training temperature; on gridwalk-v0 also every 40 steps, and their mean over the validations after step 0 (``@all``:
how soon a configuration learns, which the end figure misses once two configurations reach the ceiling). Single-run
configurations read verl's validation (``acc_greedy``, ``acc/mean@4``); ``together``, ``swapped`` and ``alone`` are
measured with ``python -m verl_mas.evaluate`` on the same test split (greedy, and the mean of 4 sampled passes), from
the checkpoints of the last step (``together`` also has its run's validations).

Prints one line per run, then per configuration the mean +- std over seeds, and for each comparison the paired
difference per seed, its mean, and whether the first configuration is above the second by more than the spread
across seeds (the larger of the two std).

Every finished run is appended to ``bench/results/bench_learning.jsonl`` (``--results``) with its figures, wall time,
commit, date and a fingerprint of the recipe settings (:func:`settings_fingerprint`); a run recorded there for the
same workflow, configuration, seed, steps, K and settings is not run again
(``--rerun`` does), and the summary covers every recorded run, so the benchmark (hours on 2 cores) fills its table
over several invocations. ``--summary`` prints the summary alone, of the recipe's current settings or, given
``--settings FINGERPRINT``, of an earlier series (a changed recipe or config group ends a series; its tables stay
reproducible). The per-role runs of ``alone`` are recorded as
``scout alone`` / ``walker alone``: their own validation, i.e. that role trained beside a frozen partner. Each is
kept once finished, its transformers model, test split and record, in ``bench/results/models/<series>/`` (beside
``--results``; not with ``--rerun``), and a role kept there is not trained again: the two roles, hours each, can be
trained by invocations on different machines (a machine handed back loses its ``--work`` folder), the second of
which evaluates the combination.

Every run saves a checkpoint every 20 steps (``--checkpoint-every``). A run stopped part-way (the machine taken back,
the process killed) resumes from its last checkpoint when the benchmark is invoked again with the same ``--work``
folder (verl's ``trainer.resume_mode=auto``: weights, optimiser, data loader position; at an epoch boundary verl
restarts the data order); the steps it had run past that checkpoint are run again, and its metrics are stitched
from its parts. Its record names the steps it resumed from (``resumed_from``). A launch that fails at start-up
because a port was taken (two runs side by side race for ports) is made again from the last checkpoint at once
(:data:`PORT_RETRIES`). Runs of one seed are not bit-reproducible through ``main_ppo`` in any case: two unbroken
4-step runs of seed 0 already differ at step 1 (the scout's mean reward -0.068 and -0.083), so a resumed run is one
more sample of its seed's settings.

Usage::

    python bench/bench_learning.py                           # relay-v0: at_grpo traj_grpo parallel, 40 steps, 3 seeds
    python bench/bench_learning.py --workflow gridwalk-v0     # every comparison, 200 steps, 3 seeds
    python bench/bench_learning.py --workflow gridwalk-v0 --configs at_grpo parallel --seeds 0 --steps 50
    python bench/bench_learning.py --workflow gridwalk-v0 --summary [--markdown]   # the recorded runs, nothing run
    python bench/bench_learning.py --workflow gridwalk-v0 --summary --settings 15797d77176f  # a series by its settings
    python bench/bench_learning.py --workflow gridwalk-v0 --summary --plot docs/figures/gridwalk_learning.png
    python bench/bench_learning.py --workflow gridwalk-v0 --configs parallel --seeds 1 --work runs/bench_w1  # stop it,
    python bench/bench_learning.py --workflow gridwalk-v0 --configs parallel --seeds 1 --work runs/bench_w1  # resumed

Measured figures: ``recipes/at_grpo_cpu/README.md`` (relay-v0), ``docs/algorithm.md`` (gridwalk-v0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from verl_mas.config import ablation
from verl_mas.report import held_out, load_metrics

REPO = Path(__file__).resolve().parents[1]

#: Per workflow: its recipe, roles, the single-agent variant (if any), steps, held-out validations after step 0 (evenly
#: spaced, the last after the last step), K, turns and answer tokens.
WORKFLOWS = {
    "relay-v0": {"recipe": REPO / "recipes" / "at_grpo_cpu" / "run.sh", "roles": ("caller", "runner"),
                 "single": None, "steps": 40, "validations": 1, "k": 8, "turns": 4, "tokens": 3,
                 "configs": ("at_grpo", "traj_grpo", "parallel")},
    "gridwalk-v0": {"recipe": REPO / "recipes" / "gridwalk_cpu" / "run.sh", "roles": ("scout", "walker"),
                    "single": "gridwalk-single-v0", "steps": 200, "validations": 5, "k": 8, "turns": 6, "tokens": 1,
                    "configs": ("at_grpo", "traj_grpo", "parallel", "together", "alone", "single")},
}
#: bench name -> (verl_mas.config.ABLATIONS name, further overrides) for the single-run configurations.
ABLATION_CONFIGS = {
    "at_grpo": ("at_grpo", ()),
    "traj_grpo": ("trajectory_grpo", ()),
    "traj_grpo_success": ("trajectory_grpo_success", ()),
    "parallel": ("parallel_sampling", ()),
    "at_grpo_all_rows": ("at_grpo", ("mas.drop_zero_variance=false",)),
}
TEAM_CONFIGS = ("together", "alone", "single")
#: (first, second): the comparisons printed, first minus second per seed.
COMPARISONS = (("at_grpo", "traj_grpo"), ("at_grpo", "parallel"), ("at_grpo", "traj_grpo_success"),
               ("together", "alone"), ("together", "swapped"), ("at_grpo", "single"))
SAMPLED_PASSES = 4


#: Every run saves a checkpoint this often (``--checkpoint-every``; and at its last step); invoked again with the same
#: ``--work`` folder, the benchmark resumes a run stopped before its last step (a machine taken back, a session ended)
#: from there.
CHECKPOINT_EVERY = 20
#: A run folder's record of its parts: one entry per launch of main_ppo (``from_step``: the checkpoint it resumed
#: from, 0 for a fresh start; ``steps``: the run's; ``metrics``: the file verl's logger wrote; ``started``; ``wall_s``
#: once known).
PARTS = "bench_parts.json"
#: Launches of a run that failed because a port was taken (``EADDRINUSE``) are made again from its last checkpoint, up
#: to this many times: verl probes a free port for a worker group's rank 0 and binds it seconds later, and any process
#: on the machine (another run's Ray opening connections) can take it in between. An infrastructure failure, not a
#: result: the launch again trains from the checkpoint as a stopped machine's would.
PORT_RETRIES = 2


def _latest_checkpoint(run_dir: Path) -> int:
    """The step of the run's last complete checkpoint (verl writes the marker file last), 0 when it has none."""
    marker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(marker.read_text().strip()) if marker.exists() else 0


def _fresh_start(parts: list[dict[str, Any]]) -> int:
    """The index of the last part that started from scratch."""
    return max(i for i, part in enumerate(parts) if part["from_step"] == 0)


def stitch(parts: list[dict[str, Any]], run_dir: Path) -> list[dict]:
    """The metrics of a run launched in ``parts``: from each part the steps after the checkpoint it resumed from up to
    the one the next part resumed from (the steps a stopped part ran past its last checkpoint were run again), step 0
    (the validation before training) from the first; one row per step, in step order. A part that started from step
    0 (stopped before the first checkpoint) is the run's start: the parts before it are left out."""
    parts = parts[_fresh_start(parts):]
    rows: list[dict] = []
    for i, part in enumerate(parts):
        upto = parts[i + 1]["from_step"] if i + 1 < len(parts) else float("inf")
        path = run_dir / part["metrics"]
        if not path.exists() or path.stat().st_size == 0:
            continue  # stopped before its first logged step
        rows += [row for row in load_metrics(path)
                 if (row["step"] > part["from_step"] or (i == 0 and row["step"] == 0)) and row["step"] <= upto]
    steps = [row["step"] for row in rows]
    if len(set(steps)) != len(steps) or steps != sorted(steps):
        raise RuntimeError(f"{run_dir}: the parts {parts} give steps {steps}, not one row per step in order")
    return rows


def _run(recipe: Path, run_dir: Path, seed: int, steps: int, overrides: list[str], *,
         checkpoint_every: int = CHECKPOINT_EVERY, port_retries: int = PORT_RETRIES,
         **env_extra: str) -> tuple[list[dict], float, list[int]]:
    """Run ``recipe`` for ``steps`` steps in ``run_dir`` (resuming it from its last checkpoint when an earlier
    invocation was stopped, or a launch lost a port race (:data:`PORT_RETRIES`); not at all when one finished it): its
    metrics (:func:`stitch`), its wall time (the sum of its parts since its start, a stopped part's up to its last
    logged step) and the steps it was resumed from."""
    parts_file = run_dir / PARTS
    parts = json.loads(parts_file.read_text()) if parts_file.exists() else []
    start_step = _latest_checkpoint(run_dir)
    other = sorted({part["steps"] for part in parts} - {steps})
    if other or (start_step and not parts):
        raise RuntimeError(f"{run_dir} holds " + (f"a run of {other} steps" if other else
                           f"a checkpoint at step {start_step} that no earlier invocation of this benchmark made") +
                           f", not one of {steps} steps to resume: give this run a new --work folder")
    if parts and "wall_s" not in parts[-1]:  # the last launch was stopped: up to its last logged step
        logged = run_dir / parts[-1]["metrics"]
        parts[-1]["wall_s"] = max(0.0, logged.stat().st_mtime - parts[-1]["started"]) if logged.exists() else 0.0
    if start_step < steps:
        if parts:  # verl's logger truncates metrics.jsonl: keep the earlier part's aside
            parts[-1]["metrics"] = f"metrics.part{len(parts) - 1}.jsonl"
            if (run_dir / "metrics.jsonl").exists():
                (run_dir / "metrics.jsonl").rename(run_dir / parts[-1]["metrics"])
        env = {key: v for key, v in os.environ.items() if not key.startswith("VERL_")}
        env.update(PYTHON=sys.executable, VERL_MAS_RUN_DIR=str(run_dir), MODEL_SEED=str(seed), **env_extra)
        seeded = [f"trainer.val_before_train={str(start_step == 0).lower()}", f"data.seed={seed}",
                  f"actor_rollout_ref.actor.data_loader_seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
                  "mas.record.dir=null", f"trainer.total_training_steps={steps}",
                  f"trainer.save_freq={checkpoint_every or steps}", "trainer.resume_mode=auto"]
        parts.append({"from_step": start_step, "steps": steps, "metrics": "metrics.jsonl", "started": time.time()})
        run_dir.mkdir(parents=True, exist_ok=True)
        parts_file.write_text(json.dumps(parts))
        proc = subprocess.run(["bash", str(recipe), *seeded, *overrides], env=env, capture_output=True, text=True,
                              cwd=run_dir.parent)
        if proc.returncode != 0 and port_retries > 0 and "EADDRINUSE" in proc.stderr:
            print(f"{run_dir.name}: a port was taken while main_ppo started (EADDRINUSE); launching again from step "
                  f"{_latest_checkpoint(run_dir)} ({port_retries - 1} more tries)", flush=True)
            return _run(recipe, run_dir, seed, steps, overrides, checkpoint_every=checkpoint_every,
                        port_retries=port_retries - 1, **env_extra)
        if proc.returncode != 0:
            raise RuntimeError(f"{run_dir.name} failed (exit {proc.returncode}; run the benchmark again with --work "
                               f"{run_dir.parent} to resume it from its last checkpoint):\n{proc.stderr[-3000:]}")
        parts[-1]["wall_s"] = time.time() - parts[-1]["started"]
        parts_file.write_text(json.dumps(parts))
    used = parts[_fresh_start(parts):]
    return stitch(parts, run_dir), sum(part["wall_s"] for part in used), [part["from_step"] for part in used[1:]]


def validation(rows: list[dict]) -> dict[str, float]:
    """Held-out greedy/sampled success at every validation (``greedy@<step>``; the first and last also as ``@0`` and
    ``@end``), their mean over the validations after step 0 when there are several (``@all``: the area under the
    held-out curve, i.e. how soon a configuration learns, which the end figure misses once both reach the ceiling),
    and training success at the end."""
    series = held_out(rows)
    greedy = next((v for label, v in series.items() if label.endswith(" greedy")), None)
    sampled = next((v for label, v in series.items() if " sampled " in label), None)
    if greedy is None or sampled is None or len(greedy) < 2 or len(sampled) < 2:
        raise RuntimeError(f"the run logged held-out series {list(series)} with {[len(v) for v in series.values()]} "
                           "validations; it needs greedy and sampled success before and after training")
    steps = [r for r in rows if "mas/success_rate" in r]
    out = {"train end": statistics.fmean(r["mas/success_rate"] for r in steps[-5:]),
           "step s": statistics.fmean(r.get("timing_s/step", 0.0) for r in steps)}
    for name, points in (("greedy", greedy), ("sampled", sampled)):
        out.update({f"{name}@0": points[0][1], f"{name}@end": points[-1][1]})
        if len(points) > 2:
            out.update({f"{name}@{int(step)}": value for step, value in points[1:-1]})
            out[f"{name}@all"] = statistics.fmean(value for _, value in points[1:])
    return out


def curve(figures: dict[str, float], name: str, steps: int) -> list[tuple[int, float]]:
    """``(step, held-out success)`` at each validation a run's ``figures`` hold for ``name`` (greedy or sampled)."""
    points = {int(key.split("@")[1]): v for key, v in figures.items()
              if key.startswith(f"{name}@") and key.split("@")[1].isdigit()}
    points[steps] = figures[f"{name}@end"]
    return sorted(points.items())


def mean_curve(by_seed: dict[int, dict[str, float]], name: str,
               steps: int) -> tuple[dict[int, list[tuple[int, float]]], list[tuple[int, float]]]:
    """The held-out curves of ``name`` (greedy or sampled, :func:`curve`) of the seeds whose records hold a whole one
    (an ``@all`` figure), by seed, and the mean over them at each validation step (NaN at a step some of them lack)."""
    curves = {seed: curve(f, name, steps) for seed, f in sorted(by_seed.items()) if f"{name}@all" in f}
    points = sorted({step for c in curves.values() for step, _ in c})
    return curves, [(step, statistics.fmean(dict(c).get(step, float("nan")) for c in curves.values()))
                    for step in points]


def plot(results: dict[str, dict[int, dict[str, float]]], steps: int, out: Path, title: str) -> Path:
    """A PNG of held-out success over training, greedy and sampled side by side: per configuration the mean over its
    seeds (a thick line, its seeds thin behind it); a configuration measured after training only (``swapped``,
    ``alone``: evaluations of checkpoints) is a marker at the last step, at its mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3, strict=False))
    for ax, name in zip(axes, ("greedy", "sampled"), strict=True):
        for config, by_seed in results.items():
            curves, mean = mean_curve(by_seed, name, steps)
            if curves:
                for points in curves.values():
                    ax.plot(*zip(*points, strict=True), color=colours[config], alpha=0.25, linewidth=1)
                ax.plot(*zip(*mean, strict=True), "o-", color=colours[config], linewidth=2,
                        label=f"{config} (seeds {', '.join(map(str, curves))})")
            elif ends := [f[f"{name}@end"] for _, f in sorted(by_seed.items()) if f"{name}@end" in f]:
                ax.plot([steps], [statistics.fmean(ends)], "D", color=colours[config], markersize=8,
                        label=f"{config}, after training (seeds {', '.join(map(str, sorted(by_seed)))})")
        ax.set(title=f"held-out team success, {name}", xlabel="training step", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("success rate (one candidate per node)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def evaluate(test: Path, roles: dict[str, Path], spec: dict, work: Path) -> dict[str, float]:
    """Held-out success of the models ``roles`` names, by ``python -m verl_mas.evaluate``: greedy, and the mean of
    :data:`SAMPLED_PASSES` passes sampled at temperature 1."""
    def one(temperature: float, seed: int) -> float:
        out = work / f"eval-{time.monotonic_ns()}.json"
        cmd = [sys.executable, "-m", "verl_mas.evaluate", "--data", str(test), "--max-turns", str(spec["turns"]),
               "--max-tokens", str(spec["tokens"]), "--temperature", str(temperature), "--seed", str(seed),
               "--json", str(out), *(a for role, path in roles.items() for a in ("--role", f"{role}={path}"))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"evaluate {roles} failed:\n{proc.stderr[-3000:]}")
        return float(json.loads(out.read_text())["success_rate"])

    return {"greedy@end": one(0.0, 0),
            "sampled@end": statistics.fmean(one(1.0, s) for s in range(SAMPLED_PASSES))}


def _hf(run_dir: Path, steps: int, position: int, role: str) -> Path:
    """A per-role run's saved transformers model of ``role`` (``actor/`` for the first role, ``actor_<role>/``)."""
    folder = "actor" if position == 0 else f"actor_{role}"
    return run_dir / "checkpoints" / f"global_step_{steps}" / folder / "huggingface"


#: The kept run of a role trained alone: its transformers model, the test split it was validated on, its record.
KEPT_MODEL, KEPT_TEST, KEPT_RUN = "model", "test.parquet", "run.json"
#: What a kept run's record holds: the role's figures, its wall time and the steps it resumed from.
KEPT_RECORD = ("figures", "wall_s", "resumed_from")


def keep_run(kept: Path, model: Path, test: Path, run: dict[str, Any]) -> None:
    """Keep a finished per-role run of ``alone`` in ``kept``: the transformers model ``model`` (what ``python -m
    verl_mas.evaluate --role`` loads), its test split ``test`` and ``run`` (its record's figures, wall time and the
    steps it resumed from). Written aside and then renamed: a kept folder is whole or absent."""
    partial = kept.with_name(kept.name + ".partial")
    if partial.exists():  # an earlier keep stopped part-way
        shutil.rmtree(partial)
    shutil.copytree(model, partial / KEPT_MODEL)
    shutil.copy2(test, partial / KEPT_TEST)
    (partial / KEPT_RUN).write_text(json.dumps(run, indent=1) + "\n")
    if kept.exists():
        shutil.rmtree(kept)
    partial.rename(kept)


def kept_run(kept: Path) -> dict[str, Any] | None:
    """A run kept by :func:`keep_run` (its ``run`` with ``model`` and ``test``, the paths to load), None when
    ``kept`` holds none."""
    if not (kept / KEPT_RUN).exists():
        return None
    run = json.loads((kept / KEPT_RUN).read_text())
    missing = [name for name in (KEPT_MODEL, KEPT_TEST) if not (kept / name).exists()]
    if missing or not set(KEPT_RECORD) <= run.keys():
        raise RuntimeError(f"{kept} is a kept run without {missing or ', '.join(KEPT_RECORD)}: remove "
                           "the folder, and the role is trained again")
    return {**run, "model": kept / KEPT_MODEL, "test": kept / KEPT_TEST}


def run_seed(workflow: str, configs: list[str], seed: int, steps: int, k: int, work: Path,
             report, checkpoint_every: int = CHECKPOINT_EVERY, kept: Path | None = None) -> None:
    """Run ``configs`` for ``seed`` in ``work``; every figure goes to ``report(name, seed, figures, wall_s, resumed)``
    (``resumed``: the steps a run was resumed from, see :func:`_run`). With ``kept`` (a folder of the series), each
    finished per-role run of ``alone`` is kept there (:func:`keep_run`) and a role kept there is not trained again:
    its two roles (hours each) can be trained by different invocations on different machines, and the combination
    evaluated by the second."""
    spec = WORKFLOWS[workflow]
    recipe, roles = spec["recipe"], spec["roles"]
    every = steps // spec["validations"] if steps % spec["validations"] == 0 else steps
    base = [f"trainer.test_freq={every}"]
    save = ["mas_policies=per_role_models",  # the transformers models too: python -m verl_mas.evaluate loads them
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]

    def run(run_name: str, overrides: list[str], workflow_id: str = workflow) -> tuple[list[dict], float, list[int]]:
        return _run(recipe, work / run_name, seed, steps, [*base, *overrides, f"trainer.experiment_name={run_name}"],
                    checkpoint_every=checkpoint_every, WORKFLOW=workflow_id)

    for name in configs:
        if name in ABLATION_CONFIGS:
            ablation_name, extra = ABLATION_CONFIGS[name]
            rows, wall, resumed = run(f"{name}-seed{seed}", [*ablation(ablation_name, k), *extra])
            report(name, seed, validation(rows), wall, resumed)
        elif name == "together":
            run_dir = work / f"together-seed{seed}"
            rows, wall, resumed = run(run_dir.name, [*ablation("at_grpo", k), *save])
            models = {role: _hf(run_dir, steps, i, role) for i, role in enumerate(roles)}
            test = run_dir / "data" / "test.parquet"
            report("together", seed, {**validation(rows), **evaluate(test, models, spec, work)}, wall, resumed)
            swapped = dict(zip(roles, reversed(list(models.values())), strict=True))
            report("swapped", seed, evaluate(test, swapped, spec, work), 0.0, resumed)
        elif name == "alone":
            models, wall, resumed = {}, 0.0, []
            for i, role in enumerate(roles):
                run_name = f"alone-{role}-seed{seed}"
                done = kept_run(kept / run_name) if kept is not None else None
                if done is None:
                    frozen = [f"+mas.policies.{other}.frozen=true" for other in roles if other != role]
                    rows, w, r = run(run_name, [*ablation("at_grpo", k), *save, *frozen])
                    done = {"figures": validation(rows), "wall_s": w, "resumed_from": r,
                            "model": _hf(work / run_name, steps, i, role),
                            "test": work / run_name / "data" / "test.parquet"}
                    if kept is not None:
                        keep_run(kept / run_name, done["model"], done["test"], {key: done[key] for key in KEPT_RECORD})
                else:
                    print(f"{role + ' alone':>14} | {seed:>4} | trained earlier, kept in {kept / run_name}", flush=True)
                # Reported again when kept: recorded once (append_record), restored if the results lost it.
                report(f"{role} alone", seed, done["figures"], done["wall_s"], done["resumed_from"])
                models[role], wall, resumed = done["model"], wall + done["wall_s"], resumed + done["resumed_from"]
                if i == 0:  # every run of the recipe writes the same test split (its data seed is fixed)
                    test = done["test"]
            report("alone", seed, evaluate(test, models, spec, work), wall, resumed)
        elif name == "single":
            if not spec["single"]:
                raise SystemExit(f"{workflow} has no single-agent variant")
            # GRPO on one agent: 2K independent episodes per task (the team samples K per role and turn).
            rows, wall, resumed = run(f"single-seed{seed}", ablation("trajectory_grpo", 2 * k), spec["single"])
            report("single", seed, validation(rows), wall, resumed)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


#: Where finished runs are kept (one JSON line each), so that the benchmark, hours long on 2 cores, fills its table
#: across several invocations: a run already recorded for the same (workflow, configuration, seed, steps, K, recipe
#: settings) is not run again, and the summary is computed from every recorded run of those settings.
RESULTS = REPO / "bench" / "results" / "bench_learning.jsonl"
#: Seeds a comparison needs before it says whether one configuration is above the other (the issue's: >= 3).
MIN_SEEDS = 3
#: The folder beside the results file where the per-role runs of ``alone`` are kept (:func:`keep_run`), a folder per
#: series (workflow, steps, K, settings): ~0.5 MB a role on gridwalk-v0, committed with the records, so that the
#: combination is evaluated when the second role has trained, whichever machine trained the first.
KEPT = "models"
#: What a configuration writes to the results file: its own record, and for ``together``/``alone`` the evaluations
#: made from its checkpoints (the last name decides whether the configuration still has to run).
RECORDS = {"together": ("together", "swapped"), "alone": ("scout alone", "walker alone", "alone")}


def still_to_run(recorded: dict[str, dict[int, dict[str, float]]], configs: list[str],
                 seeds: list[int]) -> dict[str, list[int]]:
    """Per configuration of ``configs``, the seeds of ``seeds`` it has no record for (for ``together`` and ``alone``
    the last record their run writes, :data:`RECORDS`: one stopped before it runs again)."""
    out = {}
    for config in configs:
        last = RECORDS.get(config, (config,))[-1]
        missing = [seed for seed in seeds if seed not in recorded.get(last, {})]
        if missing:
            out[config] = missing
    return out


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked code or recipe files differ from it (not the recorded results,
    which the runs of a series append to while the next ones start)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "verl_mas", "recipes", "bench",
                            ":(exclude)bench/results"], cwd=REPO)
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.returncode else "")


def settings_fingerprint(recipe: Path) -> str:
    """A hash of what a run's settings come from: every file but the READMEs of the workflow's recipe folder, of the
    CPU recipe it wraps (``recipes/at_grpo_cpu``), ``recipes/cpu_common.sh`` and verl_mas's config groups
    (``verl_mas/conf``). Runs of other settings (a changed learning rate, ...) are another series: never skipped
    for, nor summarised with, these. Code changes are not in it; each record names its commit for those."""
    files = {recipe.parent, REPO / "recipes" / "at_grpo_cpu", REPO / "verl_mas" / "conf"}
    paths = sorted({f for folder in files for f in folder.rglob("*")
                    if f.is_file() and f.suffix != ".md" and "__pycache__" not in f.parts}
                   | {REPO / "recipes" / "cpu_common.sh"})
    digest = hashlib.sha256()
    for f in paths:
        digest.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def read_results(path: Path, workflow: str, steps: int, k: int,
                 settings: str) -> tuple[dict[str, dict[int, dict[str, float]]], dict[str, int]]:
    """``{record name: {seed: figures}}`` of the runs recorded in ``path`` for ``workflow`` at ``steps`` and ``k`` with
    the settings fingerprint ``settings`` (a seed recorded twice keeps its last record), and how many records of
    the same workflow, steps and K were left out, per other settings fingerprint (the earlier series)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    other: dict[str, int] = {}
    if not path.exists():
        return out, other
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = (rec["workflow"], int(rec["steps"]), int(rec["k"]))
            name, seed, figures, recorded = rec["config"], int(rec["seed"]), dict(rec["figures"]), rec["settings"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{number} is not a bench_learning record ({exc!r}): fix or remove that "
                             "line") from exc
        if key == (workflow, steps, k):
            if recorded == settings:
                out.setdefault(name, {})[seed] = figures
            else:
                other[recorded] = other.get(recorded, 0) + 1
    return out, other


def append_record(path: Path, recorded: dict[str, dict[int, dict[str, float]]], record: dict[str, Any]) -> bool:
    """Append ``record`` to the results file ``path`` and to ``recorded`` (:func:`read_results`), unless ``recorded``
    holds its figures for its configuration and seed already: a finished run of a configuration that was stopped
    part-way (``alone``'s first role) is taken as it was when the configuration resumes, not recorded twice."""
    name, seed, figures = record["config"], record["seed"], record["figures"]
    if recorded.get(name, {}).get(seed) == figures:
        return False
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    recorded.setdefault(name, {})[seed] = figures
    return True


def comparisons(results: dict[str, dict[int, dict[str, float]]]) -> list[dict[str, Any]]:
    """The paper's comparisons (:data:`COMPARISONS`) over the seeds both configurations have, per held-out column:
    the paired differences, their mean, the spread across seeds (the larger std of the two) and whether the first
    is above the second on every seed by a mean larger than that spread (``verdict``: yes/no from :data:`MIN_SEEDS`
    seeds on)."""
    out = []
    for first, second in COMPARISONS:
        both = sorted(set(results.get(first, {})) & set(results.get(second, {})))
        for column in ("greedy@end", "sampled@end", "greedy@all", "sampled@all"):
            seeds = [s for s in both if column in results[first][s] and column in results[second][s]]
            if not seeds:
                continue
            a = [results[first][s][column] for s in seeds]
            b = [results[second][s][column] for s in seeds]
            diffs = [x - y for x, y in zip(a, b, strict=True)]
            spread = max(_mean_std(a)[1], _mean_std(b)[1])
            mean = statistics.fmean(diffs)
            out.append({"first": first, "second": second, "column": column, "seeds": seeds, "diffs": diffs,
                        "mean": mean, "spread": spread,
                        "verdict": ("yes" if mean > spread and min(diffs) > 0 else "no") if len(seeds) >= MIN_SEEDS
                        else f"{len(seeds)} seed(s): too few for a verdict"})
    return out


def summary(results: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = ["held-out success after training (@end) and its mean over the validations after step 0 (@all), "
             "mean +- std over the recorded seeds:"]
    for name, by_seed in results.items():
        parts = []
        for c in ("greedy@end", "sampled@end", "greedy@all", "sampled@all"):
            seeds = [seed for seed, f in sorted(by_seed.items()) if c in f]
            if seeds:
                m, sd = _mean_std([by_seed[seed][c] for seed in seeds])
                parts.append(f"{c} {m:.3f} +- {sd:.3f}" + ("" if len(seeds) == len(by_seed) else f" (seeds {seeds})"))
        lines.append(f"{name:>14} (seeds {sorted(by_seed)}): " + ", ".join(parts))
    for c in comparisons(results):
        lines.append(f"{c['first']} - {c['second']} ({c['column']}): per seed (seeds {c['seeds']}) "
                     + " ".join(f"{d:+.3f}" for d in c["diffs"])
                     + f"; mean {c['mean']:+.3f}; spread across seeds {c['spread']:.3f}; above by more than the "
                     f"spread: {c['verdict']}")
    return "\n".join(lines)


def markdown(results: dict[str, dict[int, dict[str, float]]], steps: int) -> str:
    """The recorded runs as two Markdown tables (per configuration; per comparison), for docs/algorithm.md."""
    def cell(values: list[float]) -> str:
        mean, std = _mean_std(values)
        return f"{mean:.2f} +- {std:.2f} ({', '.join(f'{v:.2f}' for v in values)})"

    def over_training(by_seed: dict[int, dict[str, float]]) -> str:
        """Mean held-out greedy success over the seeds with the whole curve, at each validation step."""
        curves, mean = mean_curve(by_seed, "greedy", steps)
        if not curves:
            return "-"
        return " / ".join(f"{m:.2f}" for _, m in mean) + f" (steps {', '.join(str(s) for s, _ in mean)}; seeds " \
            f"{', '.join(map(str, curves))})"

    lines = ["| configuration | seeds | held-out greedy after | held-out sampled after | held-out greedy over training "
             "| training success, last 5 steps |",
             "|---|---|---|---|---|---|"]
    for name, by_seed in results.items():
        seeds = sorted(by_seed)
        train = [by_seed[s]["train end"] for s in seeds if "train end" in by_seed[s]]
        lines.append(f"| {name} | {', '.join(map(str, seeds))} | {cell([by_seed[s]['greedy@end'] for s in seeds])} | "
                     f"{cell([by_seed[s]['sampled@end'] for s in seeds])} | {over_training(by_seed)} | "
                     f"{cell(train) if train else '-'} |")
    lines += ["", "| comparison | held-out | per seed | mean | spread | above by more than the spread |",
              "|---|---|---|---|---|---|"]
    for c in comparisons(results):
        kind, when = c["column"].split("@")
        label = kind + (", mean over validations" if when == "all" else ", after")
        lines.append(f"| {c['first']} - {c['second']} | {label} (seeds {', '.join(map(str, c['seeds']))}) | "
                     + ", ".join(f"{d:+.2f}" for d in c["diffs"])
                     + f" | {c['mean']:+.2f} | {c['spread']:.2f} | {c['verdict']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflow", default="relay-v0", choices=list(WORKFLOWS))
    parser.add_argument("--steps", type=int, default=None, help="default: the workflow's (relay-v0 40, gridwalk-v0 200)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=None, choices=[*ABLATION_CONFIGS, *TEAM_CONFIGS],
                        help="default: the workflow's")
    parser.add_argument("--k", type=int, default=None, help="samples per task and node (default: the workflow's, 8)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="JSON lines of finished runs: appended to, skipped when recorded, summarised (default: "
                             "bench/results/bench_learning.jsonl)")
    parser.add_argument("--rerun", action="store_true", help="run configurations already recorded again")
    parser.add_argument("--summary", action="store_true", help="only print the summary of the recorded runs")
    parser.add_argument("--markdown", action="store_true", help="with --summary: as Markdown tables")
    parser.add_argument("--plot", type=Path, default=None,
                        help="with --summary: also write a PNG of held-out success over training per configuration")
    parser.add_argument("--settings", default=None, metavar="FINGERPRINT",
                        help="with --summary: the series of these recipe settings (a fingerprint the records name, "
                             "e.g. one the docs quote) instead of the recipe's current ones")
    parser.add_argument("--work", type=Path, default=None,
                        help="the folder the runs are made in (default: a new temporary one); given the folder of an "
                             "earlier invocation that was stopped, its runs resume from their last checkpoint (every "
                             "--checkpoint-every steps) and a finished run that was not recorded is not run again")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                        help=f"steps between a run's checkpoints (default {CHECKPOINT_EVERY}; 0: at the last step only)")
    args = parser.parse_args()
    if (args.plot or args.markdown or args.settings) and not args.summary:
        parser.error("--plot, --markdown and --settings describe the recorded runs: give them with --summary (runs "
                     "are made with the recipe's current settings)")
    spec = WORKFLOWS[args.workflow]
    steps, k, configs = args.steps or spec["steps"], args.k or spec["k"], args.configs or list(spec["configs"])
    current = settings_fingerprint(spec["recipe"])
    settings = args.settings or current
    recorded, other = read_results(args.results, args.workflow, steps, k, settings)
    if args.settings and not recorded:
        raise SystemExit(f"--settings {args.settings}: {args.results} holds no {args.workflow} record of {steps} steps "
                         f"and K={k} with these settings; it holds these: "
                         + (", ".join(f"{fp} ({n})" for fp, n in other.items()) or "none"))
    series = (f"{args.workflow}, {steps} steps, K={k}, recipe settings {settings}"
              + (" (the recipe's current ones)" if settings == current else f" (the recipe's current ones: {current})")
              + f"; {args.results.name} has {sum(map(len, recorded.values()))} records of these"
              + (" and, left out, " + ", ".join(f"{n} of settings {fp}" for fp, n in other.items()) if other else ""))
    todo = still_to_run(recorded, configs, args.seeds) if not args.rerun else {c: list(args.seeds) for c in configs}
    if args.summary:
        print(series)
        print(markdown(recorded, steps) if args.markdown else summary(recorded))
        if args.plot:
            title = f"{args.workflow}, {steps} steps, K={k}, recipe settings {settings}"
            print(f"plot: {plot(recorded, steps, args.plot, title)}")
        print("\nnot recorded yet (seeds " + ", ".join(map(str, args.seeds)) + "): "
              + ("; ".join(f"{c} {', '.join(map(str, s))}" for c, s in todo.items()) or "none"))
        return

    if args.work is not None and args.rerun and args.work.exists() and any(args.work.iterdir()):
        raise SystemExit(f"--rerun runs the configurations again from scratch, but --work {args.work} holds earlier "
                         "runs, which would be resumed or taken as they are: give --rerun a new --work folder")
    work = args.work.resolve() if args.work is not None else Path(tempfile.mkdtemp(prefix="verl_mas_bench_learning_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{series}. Seeds {args.seeds}, runs in {work}", flush=True)
    if args.workflow == "gridwalk-v0":
        from verl_mas.data import draw_splits
        from verl_mas.workflows.gridwalk import prompt_overlap

        splits = draw_splits(args.workflow, 256, 64, seed=0)  # what the recipe writes (TRAIN_TASKS, TEST_TASKS)
        n_train, n_test, shared = prompt_overlap(*([json.loads(t) for t in splits[s]] for s in ("train", "test")))
        print(f"held-out prompts: {n_test} a held-out level can render, {n_train} a training level can; shared: "
              f"{shared}", flush=True)
    columns = ("greedy@0", "greedy@end", "sampled@0", "sampled@end", "train end", "step s")
    print(f"{'config':>14} | {'seed':>4} | " + " | ".join(f"{c:>11}" for c in columns) + " |   wall", flush=True)
    commit = _commit()
    args.results.parent.mkdir(parents=True, exist_ok=True)
    # Beside the results, per series: the roles trained alone (--rerun trains them again and keeps none).
    kept = None if args.rerun else args.results.parent / KEPT / f"{args.workflow}-{steps}steps-k{k}-{settings}"

    def report(name: str, seed: int, figures: dict[str, float], wall: float, resumed: list[int]) -> None:
        cells = " | ".join(f"{figures[c]:>11.3f}" if c in figures else f"{'-':>11}" for c in columns)
        print(f"{name:>14} | {seed:>4} | {cells} | {wall:>5.0f}s" + (f" (resumed at {resumed})" if resumed else ""),
              flush=True)
        record = {"workflow": args.workflow, "config": name, "seed": seed, "steps": steps, "k": k,
                  "settings": settings, "figures": figures, "wall_s": round(wall, 1), "commit": commit,
                  "date": time.strftime("%Y-%m-%d", time.gmtime())}
        if resumed:  # its sampling and data order after each of these steps are not an unbroken run's
            record["resumed_from"] = resumed
        append_record(args.results, recorded, record)

    for seed in args.seeds:
        for c in configs:
            if seed not in todo.get(c, ()):
                print(f"{c:>14} | {seed:>4} | recorded in {args.results.name}", flush=True)
        if runs := [c for c in configs if seed in todo.get(c, ())]:
            run_seed(args.workflow, runs, seed, steps, k, work, report, args.checkpoint_every, kept)
    print()
    print(summary(recorded))


if __name__ == "__main__":
    main()
