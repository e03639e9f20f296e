"""Workflow ids: ``register_workflow`` and lookup by id, by ``"package.module:Class"`` or by entry point.

Ids are kebab-case and versioned (``sudoku-v0``); bump the version when rules or rewards change. Lookup
order for an id: workflows registered in this process, the built-in table
(:data:`verl_mas.workflows.BUILTIN_WORKFLOWS`, imported lazily), then the ``verl_mas.workflows``
entry-point group of installed packages. Import errors are never swallowed.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from verl_mas.workflow import Workflow, validate_workflow_class

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["ENTRY_POINT_GROUP", "get_workflow", "register_workflow", "registered_workflows", "workflow_name"]

W = TypeVar("W", bound=type[Workflow])

#: Entry-point group through which other packages publish workflows: ``name = "pkg.module:Class"``,
#: where the name is the workflow id.
ENTRY_POINT_GROUP = "verl_mas.workflows"

_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*-v[0-9]+$")

_REGISTRY: dict[str, type[Workflow]] = {}


def _check_id(workflow_id: object) -> None:
    if not isinstance(workflow_id, str) or not _ID_RE.match(workflow_id):
        raise ValueError(
            f"workflow id {workflow_id!r} is not a versioned kebab-case id. Ids name a task and the version "
            "of its rules and rewards, so runs stay comparable; use e.g. 'plan-path-v0'."
        )


def _add(workflow_id: str, cls: type[Workflow]) -> None:
    problems = validate_workflow_class(cls)
    if problems:
        raise TypeError(f"cannot register workflow {workflow_id!r}: " + "; ".join(problems) + ".")
    existing = _REGISTRY.get(workflow_id)
    if existing is not None and (existing.__module__, existing.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"workflow id {workflow_id!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
            f"refusing to rebind it to {cls.__module__}.{cls.__qualname__}. Ids must name one workflow; "
            "bump the version (e.g. '-v1') or pick another id."
        )
    if cls.__dict__.get("workflow_id") not in (None, workflow_id):
        raise ValueError(
            f"{cls.__qualname__} is registered as {cls.__dict__['workflow_id']!r} and cannot also be "
            f"{workflow_id!r}; one class, one id. Subclass it to register a variant."
        )
    cls.workflow_id = workflow_id
    _REGISTRY[workflow_id] = cls


def register_workflow(workflow_id: str) -> Callable[[W], W]:
    """Class decorator registering a :class:`~verl_mas.Workflow` under a versioned id.

    Args:
        workflow_id: Kebab-case id ending in a version, e.g. ``"sudoku-v0"``.

    Raises:
        ValueError: For a malformed id, or an id already bound to another class.
        TypeError: When the class is not a valid workflow (roles, ``async def run``).
    """
    _check_id(workflow_id)

    def decorate(cls: W) -> W:
        _add(workflow_id, cls)
        return cls

    return decorate


def _builtin_table() -> dict[str, str]:
    from verl_mas.workflows import BUILTIN_WORKFLOWS

    return dict(BUILTIN_WORKFLOWS)


def _entry_points() -> dict[str, EntryPoint]:
    import importlib.metadata  # lazily: it is slow to import and only needed for lookups

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def workflow_name(cls: type[Workflow]) -> str:
    """The id ``cls`` itself was registered under, else its qualified name (a subclass does not inherit an id)."""
    return cls.__dict__.get("workflow_id") or cls.__qualname__


def portable_spec(cls: type[Workflow]) -> str:
    """How a process that imported nothing of the caller's code names ``cls``: its id when that resolves
    anywhere (a built-in, or published in the entry-point group), else ``"package.module:Class"``.

    Data files name their workflow with this, so that verl's agent-loop workers (Ray workers that never import
    the launching script) find it. A class no other process can import (defined in ``__main__`` or inside a
    function) keeps its id: the data serves in-process use, and a training run refuses it at start-up
    (:func:`verl_mas.startup.workflow_problems`).
    """
    name = workflow_name(cls)
    if name in _builtin_table() or name in _entry_points():
        return name
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return name
    return f"{cls.__module__}:{cls.__qualname__}"


def registered_workflows() -> list[str]:
    """Every workflow id this process can resolve: registered, built in, or published by entry point."""
    return sorted(set(_REGISTRY) | set(_builtin_table()) | set(_entry_points()))


def _import_target(spec: str, *, source: str) -> object:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import workflow {spec!r} ({source}): {e}. Fix the module path or install it.") from e
    if not attr:
        return module
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{module_name!r} has no attribute {attr!r} ({source}); fix the 'module:Class' spec.")
        obj = getattr(obj, part)
    return obj


def _resolve_loaded(workflow_id: str, loaded: object, source: str) -> type[Workflow]:
    if isinstance(loaded, type):
        if workflow_id not in _REGISTRY:
            _add(workflow_id, loaded)  # an undecorated class published under this id
        elif _REGISTRY[workflow_id] is not loaded:
            raise ValueError(
                f"{source} maps {workflow_id!r} to {loaded!r}, but it is registered to {_REGISTRY[workflow_id]!r}"
            )
    if workflow_id not in _REGISTRY:
        raise LookupError(
            f"{source} for {workflow_id!r} loaded {loaded!r} but no workflow was registered under that id; "
            f"point it at the class or decorate the class with @register_workflow({workflow_id!r})."
        )
    return _REGISTRY[workflow_id]


def get_workflow(spec: str | type[Workflow]) -> type[Workflow]:
    """Resolve a workflow class from an id, a ``"package.module:Class"`` path, or the class itself.

    Raises:
        LookupError: For an unknown id; the message lists every id that exists.
        ImportError: When the module behind a lazy spec or entry point fails to import (never swallowed).
        TypeError: When the target is not a valid workflow class.
    """
    if isinstance(spec, type):
        problems = validate_workflow_class(spec)
        if problems:
            raise TypeError("; ".join(problems) + ".")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a workflow is given by id, 'module:Class' or class, not {type(spec).__name__}")
    if ":" in spec:
        target = _import_target(spec, source="lazy spec")
        problems = validate_workflow_class(target)
        if problems:
            raise TypeError(f"{spec!r}: " + "; ".join(problems) + ".")
        return target  # type: ignore[return-value]
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    builtin = _builtin_table()
    if spec in builtin:
        return _resolve_loaded(spec, _import_target(builtin[spec], source="built-in"), "the built-in table")
    entry_points = _entry_points()
    if spec in entry_points:
        ep = entry_points[spec]
        try:
            loaded = ep.load()
        except ImportError as e:
            raise ImportError(f"entry point {ENTRY_POINT_GROUP}:{spec} = {ep.value!r} failed to import: {e}") from e
        return _resolve_loaded(spec, loaded, f"entry point {ENTRY_POINT_GROUP}:{spec}")
    raise LookupError(
        f"unknown workflow id {spec!r}. Registered ids: {registered_workflows()}. Register it with "
        f"@register_workflow({spec!r}), publish it in the {ENTRY_POINT_GROUP!r} entry-point group, or pass "
        "'package.module:Class'."
    )
