"""Workflow ids: registration, lookup by id / lazy path / entry point, and errors that list what exists."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pytest

from verl_mas import Workflow, get_workflow, register_workflow, registered_workflows
from verl_mas import registry as registry_module
from verl_mas.workflows.toy import WalkWorkflow


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Tests register ids; give each a copy of the registry so the global one is left untouched."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


class _Ok(Workflow):
    roles = ("solo",)

    async def run(self, task):
        pass


def test_register_and_get_by_id():
    @register_workflow("unit-ok-v0")
    class Ok(_Ok):
        pass

    assert get_workflow("unit-ok-v0") is Ok
    assert Ok.workflow_id == "unit-ok-v0"
    assert "unit-ok-v0" in registered_workflows()


def test_builtin_ids_resolve_lazily_even_from_an_empty_registry(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", {})
    assert get_workflow("toy-walk-v0") is WalkWorkflow
    assert {"toy-walk-v0", "toy-agree-v0"} <= set(registered_workflows())


def test_lazy_module_class_spec():
    assert get_workflow("verl_mas.workflows.toy:WalkWorkflow") is WalkWorkflow
    with pytest.raises(ImportError, match="no_such_module"):
        get_workflow("no_such_module:Thing")
    with pytest.raises(LookupError, match="has no attribute 'Nope'"):
        get_workflow("verl_mas.workflows.toy:Nope")


def _fake_entry_points(monkeypatch, mapping):
    eps = [
        importlib.metadata.EntryPoint(name, value, registry_module.ENTRY_POINT_GROUP) for name, value in mapping.items()
    ]
    real = importlib.metadata.entry_points

    def fake(**kwargs):
        if kwargs.get("group") == registry_module.ENTRY_POINT_GROUP:
            return eps
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)


def test_entry_point_group(monkeypatch, tmp_path):
    (tmp_path / "ext_flows.py").write_text(
        textwrap.dedent("""
        from verl_mas import Workflow

        class External(Workflow):   # not decorated: the entry point's name is its id
            roles = ("a", "b")

            async def run(self, task):
                pass
    """)
    )
    (tmp_path / "broken_flows.py").write_text("import does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, {"ext-flow-v0": "ext_flows:External", "broken-flow-v0": "broken_flows:X"})

    cls = get_workflow("ext-flow-v0")
    assert cls.__name__ == "External" and cls.workflow_id == "ext-flow-v0"
    assert {"ext-flow-v0", "broken-flow-v0"} <= set(registered_workflows())
    # Import errors of published workflows are never swallowed (docs/algorithm.md §5, pitfall 11).
    with pytest.raises(ImportError, match="broken-flow-v0.*does_not_exist"):
        get_workflow("broken-flow-v0")


def test_unknown_id_lists_the_registered_ids():
    with pytest.raises(LookupError) as info:
        get_workflow("sudokku-v0")
    message = str(info.value)
    assert "'sudokku-v0'" in message and "toy-walk-v0" in message and "register_workflow" in message


def test_id_and_class_validation():
    with pytest.raises(ValueError, match="versioned kebab-case"):
        register_workflow("Bad_Name")
    with pytest.raises(ValueError, match="versioned kebab-case"):
        register_workflow("no-version")

    register_workflow("unit-dup-v0")(_Ok)

    class Other(_Ok):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_workflow("unit-dup-v0")(Other)

    class Invalid(Workflow):
        roles = ["a", "a"]  # a list, and a duplicate

        def run(self, task):  # not async
            pass

    with pytest.raises(TypeError) as info:
        register_workflow("unit-invalid-v0")(Invalid)
    assert "non-empty tuple" in str(info.value) and "not a coroutine function" in str(info.value)

    class Duplicated(Workflow):
        roles = ("a", "a", "b|c")

        async def run(self, task):
            pass

    with pytest.raises(TypeError) as info:
        register_workflow("unit-dupes-v0")(Duplicated)
    assert "more than once" in str(info.value) and "invalid names ['b|c']" in str(info.value)


def test_a_subclass_does_not_inherit_the_id():
    from verl_mas.registry import workflow_name

    class Variant(WalkWorkflow):
        pass

    assert workflow_name(WalkWorkflow) == "toy-walk-v0"
    assert workflow_name(Variant).endswith("Variant")
