"""The public API surface and the docs example: what users import and copy must work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import verl_mas
from verl_mas import registry as registry_module

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-workflow.md"


def test_public_names_exist_and_are_listed():
    assert verl_mas.__all__ == sorted(verl_mas.__all__)
    for name in verl_mas.__all__:
        assert hasattr(verl_mas, name), name
    for name in (
        "Workflow",
        "Candidates",
        "Candidate",
        "Episode",
        "WorkflowError",
        "register_workflow",
        "get_workflow",
    ):
        assert name in verl_mas.__all__


def test_importing_the_package_and_its_test_doubles_stays_cheap():
    code = (
        "import sys, verl_mas, verl_mas.testing, verl_mas.workflows.toy, verl_mas.run\n"
        "heavy = [m for m in ('torch', 'transformers', 'verl', 'ray', 'tokenizers') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_docs_example_runs_and_passes_check_workflow(monkeypatch, capsys):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))  # the example registers an id
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2, "the doc has the workflow block and the test block"
    namespace: dict = {"__name__": "docs_writing_a_workflow"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)  # includes check_workflow(...)
    assert "outcome: terminated after 1 turns" in capsys.readouterr().out
    assert verl_mas.get_workflow("sum-check-v0") is namespace["SumCheckWorkflow"]


def test_the_ablation_table_lists_the_settings_the_benchmark_and_tests_run() -> None:
    from verl_mas.config import ABLATIONS

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    for name, overrides in ABLATIONS.items():
        assert f"| `{' '.join(overrides)}` |" in text, name
