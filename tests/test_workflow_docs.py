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
    assert len(blocks) == 3, "the doc has the workflow block, the test block and the tokenizer check block"
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


README = DOC.parents[1] / "README.md"
PACKAGE = Path(verl_mas.__file__).parent


def _layout_entries(readme: str) -> list[str]:
    """The package entries the README's layout block lists (``  name.py`` / ``  name/`` lines under verl_mas/)."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    return re.findall(r"^  (\S+?)/?\s{2,}", block, flags=re.M)


def _package_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in ("__init__.py", "py.typed", "__pycache__")
                  and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())))


def test_readme_layout_matches_the_package(tmp_path: Path) -> None:
    listed = sorted(e.removesuffix("/") for e in _layout_entries(README.read_text()))
    actual = sorted(n.removesuffix(".py") if n.endswith(".py") else n for n in _package_entries(PACKAGE))
    assert [e.removesuffix(".py") for e in listed] == actual
    # Negative control: a module the README does not list is caught.
    (tmp_path / "pkg").mkdir()
    for name in ("a.py", "b.py", "__init__.py"):
        (tmp_path / "pkg" / name).write_text("")
    assert _package_entries(tmp_path / "pkg") == ["a.py", "b.py"]
    assert _layout_entries("## Layout\n```\nverl_mas/\n  a.py      the a\n  sub/      a package\n```\n") == ["a.py", "sub"]


def test_a_module_over_400_lines_says_why() -> None:
    import ast

    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 420 and "Why" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(PACKAGE)} ({text.count(chr(10))} lines)")
    assert not long, f"modules over ~400 lines whose docstring does not say why: {long}"
