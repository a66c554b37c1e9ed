"""Fixtures of the vLLM tests."""

import importlib.util
import os

import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture
def load_bench():
    """``load_bench(name)``: the module bench/<name>.py, loaded from its file (bench/ is not a package)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH_DIR, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
