"""The NKI interpreter's float → integer conversion on ties and edges: round to nearest, ties to even,
saturating to the destination's range, NaN → 0 (NKI 0.6 semantics, the rule the interpreter's isa module
states). 0.5, 2.5 and −1.5 are where ties-to-even differs from rounding half up (1, 3, −1), half away from zero
(1, 3, −2) and truncation (0, 2, −1); 1.5 alone cannot tell them apart. Checked on each path that converts:
DMA between dtypes, tensor_copy (VectorE) and an activation copy (ScalarE)."""

from __future__ import annotations

import numpy as np
import pytest

from nki_interpreter import isa as nisa
from nki_interpreter import language as nl
from nki_interpreter import simulate

TIES = np.array([[0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 4.5]], np.float32)
TIES_RNE = [[0, 2, 2, 4, 0, -2, -2, 4]]
EDGES = np.array([[300.0, -7.0, 254.5, 255.5, float("nan"), 0.49999997, 1e10, -0.0]], np.float32)
EDGES_UINT8 = [[255, 0, 254, 255, 0, 0, 255, 0]]


def _dma(dtype):
    def kernel(x):
        t = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    return kernel


def _on_chip(dtype, how):
    def kernel(x):
        f = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=f, src=x)
        t = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        if how == "tensor_copy":
            nisa.tensor_copy(dst=t, src=f)
        else:
            nisa.activation(dst=t, op=nl.copy, data=f)
        o = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    return kernel


PATHS = {"dma": _dma, "tensor_copy": lambda d: _on_chip(d, "tensor_copy"), "activation": lambda d: _on_chip(d, "act")}


@pytest.mark.parametrize("path", list(PATHS))
def test_float_to_int32_ties_round_to_even(path):
    got = simulate(PATHS[path](nl.int32))(TIES)
    np.testing.assert_array_equal(got, TIES_RNE, err_msg=f"{path}: ties must round to even")


@pytest.mark.parametrize("path", list(PATHS))
def test_float_to_uint8_saturates_and_nan_is_zero(path):
    got = simulate(PATHS[path](nl.uint8))(EDGES)
    np.testing.assert_array_equal(got, EDGES_UINT8, err_msg=f"{path}: saturate to [0, 255], NaN → 0")


def test_float_to_int8_ties_and_saturation():
    x = np.array([[-128.5, 127.5, -0.5, 0.5, -200.0, 126.5, -127.5, 2.5]], np.float32)
    np.testing.assert_array_equal(simulate(_dma(nl.int8))(x), [[-128, 127, 0, 0, -128, 126, -128, 2]])
