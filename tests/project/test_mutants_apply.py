"""The mutation table (tests/mutants.py, run by `make mutate`) still applies to the tree: every mutant's ``old``
text occurs exactly once in its file, its tests' files exist, and no two mutants share a name. A reformat or a
rename that silently invalidates a mutant fails here, in `make test`, not hours later in `make mutate`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _mutants():
    spec = importlib.util.spec_from_file_location("static_moe_mutants", REPO / "tests" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


def test_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies(m):
    text = (REPO / m.file).read_text()
    assert text.count(m.old) == 1, f"{m.file}: the old text occurs {text.count(m.old)} times"
    assert m.old != m.new
    test_files = [a.split("::")[0] for a in m.tests if a.startswith("tests/")]
    assert test_files, "a mutant names the test files that must kill it"
    assert all((REPO / f).exists() for f in test_files), test_files
