"""Helpers for tests of kernels run by the interpreter: a kernel that must be refused by a named rule, random host
arrays, and the HBM → SBUF → HBM moves a small test kernel needs."""

from __future__ import annotations

import numpy as np
import pytest

from . import NkiRuleError, simulate
from . import isa as nisa
from . import language as nl

F32 = np.float32


def rejects(rule: str, kernel, *args, **kwargs) -> NkiRuleError:
    """Run ``kernel`` in the interpreter and require that it is refused by ``rule`` (named in the message)."""
    with pytest.raises(NkiRuleError) as e:
        simulate(kernel)(*args, **kwargs)
    assert e.value.rule == rule, f"expected rule {rule}, got {e.value}"
    assert f"[{rule}]" in str(e.value)
    return e.value


def arr(*shape, dtype=F32, seed=0):
    """A standard-normal host array of ``shape`` in ``dtype``, reproducible from ``seed``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def load(src, dtype=None, buffer=nl.sbuf):
    """A copy of ``src`` (HBM) in ``buffer`` (SBUF by default), converted to ``dtype`` if given."""
    t = nl.ndarray(src.shape, dtype or src.dtype, buffer=buffer)
    nisa.dma_copy(dst=t, src=src)
    return t


def out_of(t):
    """A copy of on-chip ``t`` in shared HBM, where a kernel returns it from."""
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o
