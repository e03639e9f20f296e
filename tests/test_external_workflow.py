"""A workflow written outside verl_mas, installed as docs/writing-a-workflow.md says, trained through main_ppo.

``tests/fixtures/trio_pkg`` is a package of its own (three roles: proposer, critic, reviser) that publishes
``trio-v0`` in the ``verl_mas.workflows`` entry-point group. It is installed into a folder on PYTHONPATH (a
fresh machine would ``pip install -e .``; the test must not change the suite's own environment), and the CPU
recipe trains it for one step with ``mas_policies=per_role_lora`` unchanged (an adapter per role on one resident
base, each role's own policy, none listed by hand): the start-up and the agent-loop workers, which import nothing of
the test, resolve the workflow and its roles by its entry point. (The shared model is the recipe's default and
resolves the workflow the same way; per-role models, a worker group and server each, cost a start-up of ~5 min for
three roles here, and tests/test_main_ppo_policies.py runs that layout with two.)

The run also carries one of the paper's ablations (verl_mas.config.ABLATIONS), trajectory-level GRPO, and a
frozen policy (``mas.policies.<p>.frozen``: the reviser's adapter serves its role and never steps, as the partner
of a role trained alone in bench/bench_learning.py): one main_ppo start-up serves the three claims, each test
asserts one of them. (Role-only groups ride on the per-role-models run of tests/test_main_ppo_policies.py,
parallel sampling on gridwalk's run in tests/test_main_ppo_at_grpo.py.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_mas.config import ablation

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
ROLES = ("proposer", "critic", "reviser")
K, TASKS, TURNS = 4, 4, 2
#: The run: its policy layout, and the ablation it also carries.
RUNS = {"per_role_lora": "trajectory_grpo"}
#: The policy the run keeps frozen. The frozen policy is left out of the update per policy in the trainer
#: (MasTrainer._update_actor), the same for every layout; the benchmark's roles trained alone use per-role models.
FROZEN = "reviser"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture package built and installed into a folder of its own (the source copied first: building
    writes into the source tree)."""
    work = tmp_path_factory.mktemp("trio")
    source = shutil.copytree(REPO / "tests" / "fixtures" / "trio_pkg", work / "src")
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(source)], check=True, capture_output=True, text=True, timeout=300)
    return site


@pytest.fixture(scope="module", params=list(RUNS))
def trio_run(request: pytest.FixtureRequest, installed: Path, tmp_path_factory: pytest.TempPathFactory,
             recipe_runs) -> tuple[str, dict, Path]:
    """One step of trio-v0 through main_ppo in a layout, with that layout's ablation and the FROZEN policy:
    (layout, step metrics, run folder). An entropy term gives every trained adapter a gradient whatever the rewards
    (the control of the frozen one); the step is checkpointed."""
    layout = request.param
    run_dir = tmp_path_factory.mktemp(f"trio-{layout}") / "run"
    proc, metrics = recipe_runs.run(
        RECIPE, run_dir, *recipe_runs.relay_shape, f"mas_policies={layout}", f"data.train_batch_size={TASKS}",
        f"mas.max_turns={TURNS}", *ablation(RUNS[layout], K), f"+mas.policies.{FROZEN}.frozen=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.save_freq=1", steps=1, WORKFLOW="trio-v0",
        TRAIN_TASKS="16", TEST_TASKS="4", PYTHONPATH=str(installed),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    (m,) = metrics
    d = m["data"]
    turns = {role: d[f"mas/{role}/turns"] for role in ROLES}
    print(f"[external-workflow] {layout} ({RUNS[layout]}): success={d['mas/success_rate']:.2f} turns={turns} "
          f"groups={d['mas/group/count']:.0f} size={d['mas/group/size_mean']:.2f} episodes={d['mas/episodes']:.0f} "
          + " ".join(f"{p}: requests={d[f'policy/{p}/rollout/requests']:.0f} gap={recipe_runs.gap(d, p):.1e}"
                     for p in ROLES))
    return layout, d, run_dir


def test_a_three_role_workflow_from_its_own_package_trains_through_main_ppo(trio_run, recipe_runs) -> None:
    layout, d, _ = trio_run
    turns = {role: d[f"mas/{role}/turns"] for role in ROLES}
    # Every role acted and every episode was counted: the workflow ran in the agent-loop workers.
    assert all(1 <= turns[role] <= TURNS for role in ROLES)
    assert d["mas/infra_failures"] == 0.0
    # One adapter per role, none listed by hand: each role's requests were served with its own policy's adapter
    # (one per episode and turn the role acted in: K independent episodes per task), and each policy's rollout
    # samples from its own actor.
    assert d["mas/episodes"] == K * TASKS
    for role in ROLES:
        assert d[f"policy/{role}/rollout/requests"] == round(K * TASKS * turns[role]), role
        assert recipe_runs.gap(d, role) < 1e-6, role


def test_each_ablation_groups_as_documented_through_main_ppo(trio_run) -> None:
    """docs/training.md, "Ablations": what each grouping puts together, on verl's batch."""
    layout, d, _ = trio_run
    assert RUNS[layout] == "trajectory_grpo"
    # One group per (task, role) holding the role's rows of the task's K independent episodes (rows counted here;
    # the estimator takes its statistics over the episodes, each scored by the role's return).
    assert d["mas/group/count"] == len(ROLES) * TASKS
    assert d["mas/group/singleton_frac"] == 0.0


def test_a_frozen_policy_serves_its_role_and_takes_no_step(trio_run) -> None:
    """docs/policies.md (``frozen: true``, under "What a policy is"): the reviser acted and went through log-probs
    (its rollout-vs-actor gap is checked with the others' above) but took no optimiser step; the two trained adapters
    did."""
    from safetensors.torch import load_file

    _, d, run_dir = trio_run
    trained = [role for role in ROLES if role != FROZEN]
    logged = {role: {k.removeprefix(f"policy/{role}/") for k in d if k.startswith(f"policy/{role}/")} for role in ROLES}
    # Log-probs ran for every policy; the update (verl's update metrics, the per-policy phase timing) for the
    # trained ones only.
    of_log_probs = {"actor/entropy", "training/rollout_probs_diff_mean", "timing_s/policy_old_log_prob"}
    of_update = {"actor/grad_norm", "actor/pg_loss", "actor/lr", "timing_s/policy_update_actor"}
    assert d[f"mas/{FROZEN}/turns"] >= 1 and of_log_probs <= logged[FROZEN]
    assert all(of_log_probs | of_update <= logged[role] for role in trained)
    assert not of_update & logged[FROZEN], of_update & logged[FROZEN]
    # peft starts B at zero: after the step the frozen adapter's B is still all zero, while the entropy term moved
    # each trained adapter's B (the control: a frozen flag the update ignored would move the reviser's too).
    ckpt = run_dir / "checkpoints" / "global_step_1" / "actor" / "adapters"
    nonzero = {role: sum(int(torch.count_nonzero(v)) for k, v in
                         load_file(str(ckpt / role / "adapter_model.safetensors")).items() if "lora_B" in k)
               for role in ROLES}
    print(f"[external-workflow] frozen {FROZEN}: non-zero lora_B entries after the step {nonzero}")
    assert nonzero[FROZEN] == 0 and all(nonzero[role] > 0 for role in trained), nonzero
