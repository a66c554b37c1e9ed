"""The interpreter refuses the constructs no NKI document describes — one rule per construct, each
with a violating kernel that must fail naming the rule and the documented twin that runs:

- ``sbuf-indirect-operand``: an SBUF ``.ap(scalar_offset=<register>)`` view as a compute operand or as the
  source of ``register_load`` (trn3 architecture guide: engine-side SBUF indirection has no NKI API; the
  access-pattern page documents ``scalar_offset`` for DMA);
- ``gpsimd-bitvec``: a bitwise ``tensor_tensor`` on GpSimd (isa pages: bitvec semantics on the Vector Engine);
- ``immediate-range``: an integer ALU immediate that float32 cannot hold exactly (> 24 significant bits);
- ``fp8-transpose``: a TensorE transpose of fp8 into fp8 PSUM (trn2 guide: fp8 transposes write 16-bit PSUM).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import isa as nisa
from nki_interpreter import language as nl
from nki_interpreter import simulate
from nki_interpreter.testing import load, out_of, rejects


# ----------------------------------------------------------------------------------- sbuf-indirect-operand
def test_sbuf_view_with_a_register_offset_is_no_compute_operand():
    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)

    def bad(x):
        t = load(x)
        reg = nisa.register_alloc(1)
        col = t.ap(pattern=[[8, 2], [1, 1]], offset=0, scalar_offset=reg, indirect_dim=1)
        o = nl.ndarray((2, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=col)
        return out_of(o)

    def good(x):  # the documented form: the runtime offset on the HBM side of a DMA
        reg = nisa.register_alloc(1)
        o = nl.ndarray((2, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=o, src=x.ap(pattern=[[8, 2], [1, 1]], offset=0, scalar_offset=reg, indirect_dim=1))
        return out_of(o)

    e = rejects("sbuf-indirect-operand", bad, x)
    assert "tensor_copy" in str(e) and "DMA" in str(e)
    np.testing.assert_array_equal(simulate(good)(x), x[:, 1:2])


def test_sbuf_view_with_a_register_offset_is_no_register_source():
    flags = np.array([[0, 1, 1]], dtype=np.int32)

    def bad(f):
        t = load(f)
        e = nisa.register_alloc(2)
        r = nisa.register_alloc(0)
        nisa.register_load(r, t.ap(pattern=[[3, 1], [1, 1]], offset=0, scalar_offset=e, indirect_dim=1))

    def good(f):  # a static one-element tile
        t = load(f)
        r = nisa.register_alloc(0)
        nisa.register_load(r, t[0:1, 2:3])
        o = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.register_store(o, r)
        return out_of(o)

    rejects("sbuf-indirect-operand", bad, flags)
    np.testing.assert_array_equal(simulate(good)(flags), [[1]])


# ----------------------------------------------------------------------------------------- gpsimd-bitvec
def test_bitwise_tensor_tensor_runs_on_vector_engine_only():
    a = np.arange(128 * 4, dtype=np.uint32).reshape(128, 4)
    b = (a * 7 + 3).astype(np.uint32)

    def k(a, b, eng):
        x, y = load(a), load(b)
        o = nl.ndarray(a.shape, nl.uint32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=x, data2=y, op=nl.bitwise_or, engine=eng)
        return out_of(o)

    e = rejects("gpsimd-bitvec", k, a, b, nisa.engine.gpsimd)
    assert "VectorE" in str(e)
    np.testing.assert_array_equal(simulate(k)(a, b, nisa.engine.vector), a | b)

    def add_disjoint(a, b):  # the documented GpSimd alternative for disjoint fields: an exact integer add
        x, y = load(a), load(b)
        lo = nl.ndarray(a.shape, nl.uint32, buffer=nl.sbuf)
        hi = nl.ndarray(a.shape, nl.uint32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lo, data=x, op0=nl.bitwise_and, operand0=0xFFFF)
        nisa.tensor_scalar(dst=hi, data=y, op0=nl.left_shift, operand0=16)
        o = nl.ndarray(a.shape, nl.uint32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=lo, data2=hi, op=nl.add, engine=nisa.engine.gpsimd)
        return out_of(o)

    np.testing.assert_array_equal(simulate(add_disjoint)(a, b), (a & 0xFFFF) | ((b << 16) & 0xFFFFFFFF))


# --------------------------------------------------------------------------------------- immediate-range
@pytest.mark.parametrize(
    "imm,ok",
    [
        (0x7F7F7F80, True),  # 24 significant bits
        (0x80808080 - (1 << 32), True),  # int32 spelling, 24 bits
        (0x00FFFFFF, True),
        (0x01FFFFFF, False),  # 24 vs 25 bits
        (0x07070707, False),
        (0x1C1C1C1C, False),
        (1 << 32, False),
    ],
)
def test_integer_immediates_must_be_exact_in_float32(imm, ok):
    x = np.arange(128 * 2, dtype=np.uint32).reshape(128, 2) * np.uint32(0x01010101)

    def k(x):
        t = load(x)
        o = nl.ndarray(x.shape, nl.uint32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=t, op0=nl.bitwise_and, operand0=imm)
        return out_of(o)

    if ok:
        np.testing.assert_array_equal(simulate(k)(x), x & np.uint32(imm & 0xFFFFFFFF))
    else:
        e = rejects("immediate-range", k, x)
        assert "(P, 1)" in str(e)


def test_a_wide_mask_passes_as_a_tile_operand():
    x = np.arange(128 * 2, dtype=np.uint32).reshape(128, 2) * np.uint32(0x01010101)

    def k(x):
        t = load(x)
        m = nl.ndarray((128, 1), nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=0x07070707)
        o = nl.ndarray(x.shape, nl.uint32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=t, op0=nl.bitwise_and, operand0=m)
        return out_of(o)

    np.testing.assert_array_equal(simulate(k)(x), x & np.uint32(0x07070707))


def test_float_immediates_round_to_float32_as_documented():
    x = np.ones((4, 2), np.float32)

    def k(x):
        t = load(x)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=t, op0=nl.multiply, operand0=0.1)
        return out_of(o)

    np.testing.assert_array_equal(simulate(k)(x), np.full((4, 2), np.float32(0.1)))


# ------------------------------------------------------------------------------------------ fp8-transpose
@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3, np.uint8])
def test_tensor_engine_transpose_of_fp8_into_fp8_psum_is_refused(dtype):
    x = np.arange(32 * 16, dtype=np.uint8).reshape(32, 16) % 100

    def bad(x):
        t = load(x.view(dtype) if dtype is not np.uint8 else x)
        p = nl.ndarray((16, 32), t.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=t)

    def good(x):  # bf16 TensorE transpose (values 0..99 exact)
        t = load(x)
        b = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=t)
        p = nl.ndarray((16, 32), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=b)
        o = nl.ndarray((16, 32), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        return out_of(o)

    e = rejects("fp8-transpose", bad, x)
    assert "16-bit PSUM" in str(e)
    np.testing.assert_array_equal(simulate(good)(x).astype(np.float32), x.T.astype(np.float32))


def test_trn3_matmul_transpose_mode_of_fp8_is_refused():
    x = np.arange(32 * 16, dtype=np.uint8).reshape(32, 16) % 100

    def bad(x):
        t8 = load(x).view(nl.float8_e4m3fn)
        eye = nl.ndarray((32, 32), nl.float8_e4m3fn, buffer=nl.sbuf)
        ident = nl.shared_constant(np.eye(32, dtype=ml_dtypes.float8_e4m3fn))
        nisa.dma_copy(dst=eye, src=ident)
        p = nl.ndarray((16, 32), nl.float8_e4m3fn, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=t8, moving=eye, is_transpose=True)

    with interpreter.target("trn3"):
        rejects("fp8-transpose", bad, x)


def test_runtime_loop_nesting_is_recorded():
    """Nested runtime loops are not refused (no doc page forbids them), but public kernels never nest them and
    ours do not either: the run records the deepest nesting, which the kernel tests hold to 1."""

    def kernel(x, nest):
        t = load(x)

        def inner(_i):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)

        if nest:
            nl.fori_loop(0, 2, lambda _j: nl.fori_loop(0, 3, inner))
        else:
            nl.fori_loop(0, 6, inner)
        return out_of(t)

    x = np.zeros((4, 8), np.float32)
    for nest, depth in ((False, 1), (True, 2)):
        out = simulate(kernel)(x, nest)
        assert np.asarray(out).max() == 6.0
        assert interpreter.last_run().runtime_loop_depth == depth
