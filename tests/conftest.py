"""Shared test fixtures: a deterministic seed per test id, a CUDA skip helper, and the hypothesis profile.

Every test starts with torch's global RNG seeded from its node id, so a failure reproduces alone
(``pytest tests/ops/test_x.py::test_y[case]``) and cases do not depend on run order. Hypothesis runs derandomized
(fixed example sequence per test) with no deadline; set ``STATIC_MOE_HYPOTHESIS_RANDOM=1`` to explore new examples.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from static_moe.testing.machine import cpu_isa_available

settings.register_profile(
    "static_moe",
    deadline=None,
    derandomize=os.environ.get("STATIC_MOE_HYPOTHESIS_RANDOM", "0") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("static_moe")


def _seed_of(nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little")


@pytest.fixture(autouse=True)
def _seed_from_test_id(request):
    torch.manual_seed(_seed_of(request.node.nodeid))


@pytest.fixture
def rng(request) -> torch.Generator:
    """A torch.Generator (CPU) seeded from the test id."""
    g = torch.Generator()
    g.manual_seed(_seed_of(request.node.nodeid))
    return g


@pytest.fixture
def cuda_device() -> torch.device:
    """torch.device("cuda"); skips the test where no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")
    return torch.device("cuda")


CPU_ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request, monkeypatch) -> str:
    """Runs the test once per instruction set of the SIMD CPU kernels (csrc/cpu/simd.h), forced through
    STATIC_MOE_CPU_ISA; skips a set this CPU lacks."""
    import static_moe  # noqa: F401  (registers the ops)

    if not cpu_isa_available(request.param):
        pytest.skip(f"this CPU lacks the {request.param} instruction set")
    monkeypatch.setenv("STATIC_MOE_CPU_ISA", request.param)
    return request.param
