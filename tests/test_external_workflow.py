"""A workflow written outside verl_mas, installed as docs/writing-a-workflow.md says, trained through main_ppo.

``tests/fixtures/trio_pkg`` is a package of its own (three roles: proposer, critic, reviser) that publishes
``trio-v0`` in the ``verl_mas.workflows`` entry-point group. It is installed into a folder on PYTHONPATH (a
fresh machine would ``pip install -e .``; the test must not change the suite's own environment), and the CPU
recipe trains it for one step with one shared model and with ``mas_policies=per_role_models`` unchanged: the
agent-loop workers, which import nothing of the test, resolve the workflow by its entry point.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "at_grpo_cpu" / "run.sh"
ROLES = ("proposer", "critic", "reviser")
K, TASKS, TURNS = 4, 4, 2


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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared", "per_role_models"])
def test_a_three_role_workflow_from_its_own_package_trains_through_main_ppo(installed: Path, tmp_path: Path,
                                                                          layout: str, recipe_runs) -> None:
    run_dir = tmp_path / "run"
    proc, metrics = recipe_runs.run(
        RECIPE, run_dir, *recipe_runs.relay_shape, f"mas_policies={layout}", f"data.train_batch_size={TASKS}",
        f"mas.max_turns={TURNS}", steps=1, WORKFLOW="trio-v0", TRAIN_TASKS="16", TEST_TASKS="4",
        PYTHONPATH=str(installed),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    (m,) = metrics
    d = m["data"]
    turns = {role: d[f"mas/{role}/turns"] for role in ROLES}
    print(f"[external-workflow] {layout}: success={d['mas/success_rate']:.2f} turns={turns} "
          f"groups={d['mas/group/count']:.0f} gap={recipe_runs.gap(d):.1e}" if layout == "shared" else
          f"[external-workflow] {layout}: success={d['mas/success_rate']:.2f} turns={turns} " + " ".join(
              f"{p}: requests={d[f'policy/{p}/rollout/requests']:.0f} gap={recipe_runs.gap(d, p):.1e}" for p in ROLES))
    # Every role acted, in (task, role, turn) groups of K: the workflow ran in the agent-loop workers.
    assert d["mas/group/size_mean"] == K and d["mas/episodes"] == TASKS
    assert all(1 <= turns[role] <= TURNS for role in ROLES)
    assert d["mas/infra_failures"] == 0.0
    if layout == "shared":
        assert recipe_runs.gap(d) < 1e-6
        return
    # One model per role, none listed by hand: each role's requests reached its own policy's server (K per
    # task and turn the role acted in), and each policy's rollout samples from its own actor.
    for role in ROLES:
        assert d[f"policy/{role}/rollout/requests"] == round(K * TASKS * turns[role]), role
        assert recipe_runs.gap(d, role) < 1e-6, role
