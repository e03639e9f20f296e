"""pyproject.toml: package metadata that current setuptools reads without deprecation warnings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_license_is_an_spdx_expression_and_the_build_requires_a_setuptools_that_reads_it() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    meta = tomllib.loads(PYPROJECT.read_text())
    # PEP 639: a plain SPDX string; the `{ text = ... }` table is deprecated (setuptools warns at every build).
    assert meta["project"]["license"] == "Apache-2.0"
    # setuptools reads the string form from 77.0.0 on (an older one rejects it), so the build must require that.
    (setuptools,) = [r for r in map(Requirement, meta["build-system"]["requires"]) if r.name == "setuptools"]
    assert setuptools.specifier.contains("77.0.0") and not setuptools.specifier.contains("76.1"), setuptools


def test_setuptools_applies_the_metadata_without_a_license_warning() -> None:
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    assert [str(w.message)[:200] for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"
