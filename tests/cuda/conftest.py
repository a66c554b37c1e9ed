"""The CPU emulator of the CUDA per-thread code, built once per session for every test that needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from static_moe.testing.cuda_emulation import build_emulator
from static_moe.testing.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = tmp_path_factory.mktemp("cuda_host") / "emulate"
    return build_emulator(nvcc, ROOT / "csrc", ROOT / "tests" / "cuda" / "host" / "emulate.cu", out)
