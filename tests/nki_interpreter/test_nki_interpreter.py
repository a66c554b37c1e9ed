"""The NKI interpreter: each rule it enforces has a small violating kernel that must be rejected with a
message naming the rule, next to a legal twin that runs; plus instruction semantics vs numpy and the cost
record. These tests use the interpreter directly (not the shim), so they run whether or not a real NKI exists.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import isa as nisa
from nki_interpreter import language as nl
from nki_interpreter import simulate
from nki_interpreter.testing import arr, load, out_of, rejects

F32 = np.float32


# ------------------------------------------------------------------------------------------ partitions
def test_partition_dim_at_most_128():
    def bad(x):
        nl.ndarray((129, 4), nl.float32, buffer=nl.sbuf)

    def good(x):
        return out_of(load(x))

    rejects("partition-dim", bad, arr(4, 4))
    np.testing.assert_array_equal(simulate(good)(arr(128, 4)), arr(128, 4))


def test_partition_dim_cannot_be_permuted_reshaped_or_strided():
    def permute(x):
        load(x).permute((1, 0))

    def reshape(x):
        load(x).reshape((64, 16))

    def strided(x):
        load(x)[0:128:2, :]

    for k in (permute, reshape, strided):
        rejects("partition-dim", k, arr(128, 8))


# ------------------------------------------------------------------------------------------ matmul
def _mm_kernel(k, m, n, dst_buf=nl.psum, dst_dtype=nl.float32, st_buf=nl.sbuf, dt=nl.bfloat16, dst_cols=None):
    def kern(a, b):
        st = nl.ndarray((k, m), dt, buffer=st_buf)
        mv = nl.ndarray((k, n), dt, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        nisa.memset(mv, 1.0)
        d = nl.ndarray((min(m, 128), dst_cols or n), dst_dtype, buffer=dst_buf)
        nisa.nc_matmul(dst=d[:, 0:n] if dst_cols else d, stationary=st, moving=mv)

    return kern


def test_matmul_limits():
    x = arr(1, 1)
    simulate(_mm_kernel(128, 128, 512))(x, x)
    e = rejects("matmul-limits", _mm_kernel(128, 129, 16), x, x)
    assert "gemm_stationary_fmax" in str(e)
    e = rejects("matmul-limits", _mm_kernel(128, 16, 513), x, x)
    assert "gemm_moving_fmax" in str(e)


def test_matmul_buffers_and_dst_dtype():
    x = arr(1, 1)
    rejects("matmul-dst-psum", _mm_kernel(8, 8, 8, dst_buf=nl.sbuf), x, x)
    rejects("matmul-operand-sbuf", _mm_kernel(8, 8, 8, st_buf=nl.psum, dt=nl.float32), x, x)
    rejects("matmul-dst-dtype", _mm_kernel(8, 8, 8, dst_dtype=nl.bfloat16), x, x)


def test_matmul_output_within_one_psum_bank():
    x = arr(1, 1)

    # [8, 1024] fp32 PSUM tile = 2 banks; columns 256..768 straddle the bank boundary at 512
    def straddle(a, b):
        st = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.sbuf)
        mv = nl.ndarray((8, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        nisa.memset(mv, 1.0)
        d = nl.ndarray((8, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d[:, 512:1024], stationary=st, moving=mv)  # second bank: fine
        nisa.nc_matmul(dst=d[:, 256:768], stationary=st, moving=mv)

    rejects("psum-bank", straddle, x, x)


def test_fp8_e4m3fn_matmul_is_trn3_only():
    x = arr(1, 1)
    k = _mm_kernel(16, 16, 16, dt=nl.float8_e4m3fn)
    e = rejects("fp8-e4m3fn-trn2", k, x, x)
    assert "trn3" in str(e)
    with interpreter.target("trn3"):
        simulate(k)(x, x)
    simulate(_mm_kernel(16, 16, 16, dt=nl.float8_e4m3))(x, x)  # Neuron e4m3 is fine on trn2


def test_matmul_accumulation_semantics():
    a, b = arr(128, 256, seed=1), arr(128, 64, seed=2)  # K = 256 in two 128-row blocks (K rows laid [2, 128])

    def kern(a, b):
        out = nl.ndarray((64, 64), nl.float32, buffer=nl.shared_hbm)
        ps = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        for kb in range(2):
            st = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
            mv = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=st, src=a[:, kb * 64 : (kb + 1) * 64])
            nisa.dma_copy(dst=mv, src=b)
            nisa.nc_matmul(dst=ps, stationary=st, moving=mv)  # accumulate=None: overwrite, then accumulate
        sb = nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        # a new accumulation group after the result was read: None overwrites again
        nisa.nc_matmul(dst=ps, stationary=st, moving=mv)
        sb2 = nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb2, src=ps)
        nisa.tensor_tensor(dst=sb, data1=sb, data2=sb2, op=nl.subtract)
        nisa.dma_copy(dst=out, src=sb)
        return out

    got = simulate(kern)(a, b)
    want = a[:, :64].T @ b  # (block0 + block1) - block1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_psum_accumulate_onto_memset_or_fresh_is_rejected():
    def after_memset(x):
        st = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.memset(ps, 0.0)
        nisa.nc_matmul(dst=ps, stationary=st, moving=st, accumulate=True)

    def fresh(x):
        st = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(st, 1.0)
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=st, moving=st, accumulate=True)

    rejects("psum-accumulate-after-memset", after_memset, arr(1, 1))
    rejects("psum-accumulate-uninitialized", fresh, arr(1, 1))


def test_double_row_fp8_contracts_256_rows():
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (128, 2, 16)).astype(ml_dtypes.float8_e4m3)
    b = rng.integers(-4, 5, (128, 2, 32)).astype(ml_dtypes.float8_e4m3)

    def kern(a, b):
        out = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        ps = nl.ndarray((16, 32), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=load(a), moving=load(b), perf_mode=nisa.matmul_perf_mode.double_row)
        sb = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        nisa.dma_copy(dst=out, src=sb)
        return out

    want = np.einsum("kjm,kjn->mn", a.astype(F32), b.astype(F32))
    np.testing.assert_array_equal(simulate(kern)(a, b), want)


# ------------------------------------------------------------------------------------------ capacity
def test_sbuf_capacity_counts_live_allocations():
    usable = 224 * 1024 - 16384 - 8  # trn2: 224 KiB physical less the runtime's reserved regions

    def too_much(x):
        a = nl.ndarray((128, 100 * 1024), nl.uint8, buffer=nl.sbuf)  # noqa: F841  (kept alive)
        b = nl.ndarray((128, usable - 100 * 1024 + 1), nl.uint8, buffer=nl.sbuf)  # noqa: F841

    def exactly_full(x):
        a = nl.ndarray((128, 100 * 1024), nl.uint8, buffer=nl.sbuf)  # noqa: F841
        b = nl.ndarray((128, usable - 100 * 1024), nl.uint8, buffer=nl.sbuf)  # noqa: F841

    def reuse(x):
        for _ in range(8):  # each tile dies when the name is rebound: at most two live at once
            t = nl.ndarray((128, 90 * 1024), nl.uint8, buffer=nl.sbuf)
            nisa.memset(t.view(nl.int32), 0)  # 23040 elements: within the 64K free-size limit

    e = rejects("sbuf-capacity", too_much, arr(1, 1))
    assert "212984" in str(e)
    simulate(exactly_full)(arr(1, 1))
    assert interpreter.last_run().sbuf_peak_bytes == usable
    simulate(reuse)(arr(1, 1))
    assert interpreter.last_run().sbuf_peak_bytes == 2 * 90 * 1024


def test_sbuf_usable_size_per_target():
    def one(x, nbytes):
        nl.ndarray((128, nbytes), nl.uint8, buffer=nl.sbuf)

    with interpreter.target("trn3"):
        simulate(one)(arr(1, 1), 256 * 1024 - 16392)
        rejects("sbuf-capacity", one, arr(1, 1), 256 * 1024 - 16391)
    simulate(one)(arr(1, 1), 212984)
    rejects("sbuf-capacity", one, arr(1, 1), 212985)


def test_psum_capacity_is_eight_banks():
    def nine(x):
        keep = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]  # noqa: F841

    def eight(x):
        keep = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]  # noqa: F841

    rejects("psum-capacity", nine, arr(1, 1))
    simulate(eight)(arr(1, 1))


# ------------------------------------------------------------------------------------------ dtypes / DMA
def test_no_fp4_dtype_on_trn2():
    def k(x):
        nl.ndarray((4, 4), nl.float4_e2m1fn_x4, buffer=nl.sbuf)

    assert "no FP4" in str(rejects("dtype-unsupported", k, arr(1, 1)))


def test_dma_between_dtypes_converts_values_and_byte_moves_need_matching_views():
    x = np.array([[1.5, -2.0, 300.0, 0.25]], F32)

    def convert(x):
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)  # fp32 -> int32: values, rounded to nearest even
        return out_of(t)

    def as_bytes(x):
        t = nl.ndarray((1, 16), nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.view(nl.uint8))  # matching uint8 views: a byte move
        return out_of(t)

    def mismatched(x):
        t = nl.ndarray((1, 4), nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)  # fp32 -> uint8 converts (saturates), it does not copy bytes
        return out_of(t)

    np.testing.assert_array_equal(simulate(convert)(x), [[2, -2, 300, 0]])
    np.testing.assert_array_equal(simulate(as_bytes)(x), x.view(np.uint8))
    np.testing.assert_array_equal(simulate(mismatched)(x), [[2, 0, 255, 0]])

    def hwdge(x):
        t = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.hwdge)

    rejects("dma-dtype", hwdge, x)


def test_e4m3_trn2_max_240_vs_e4m3fn_448():
    x = np.array([[192.0, 240.0, 288.0, 448.0]], F32)  # exact in e4m3fn; 288 and 448 overflow e4m3

    def to_e4m3(x):
        t = nl.ndarray((1, 4), nl.float8_e4m3, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)

    def to_e4m3fn(x):
        t = nl.ndarray((1, 4), nl.float8_e4m3fn, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        return out_of(t)

    assert "240" in str(rejects("cast-overflow", to_e4m3, x))
    np.testing.assert_array_equal(simulate(to_e4m3fn)(x).astype(F32), x)


def test_dma_cannot_touch_psum():
    def k(x):
        ps = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=ps, src=x)

    rejects("dma-psum", k, arr(4, 4))


def test_compute_operands_must_be_on_chip():
    def k(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=t, op=nl.exp, data=x)

    rejects("compute-operand-in-hbm", k, arr(4, 4))


def test_bitvec_ops_need_integers():
    def k(x):
        t = load(x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.right_shift, operand0=23)

    def ok(x):
        t = load(x).view(nl.int32)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.right_shift, operand0=23, op1=nl.bitwise_and, operand1=0xFF)
        return out_of(t)

    rejects("bitvec-dtype", k, arr(2, 4))
    x = np.array([[1.0, 2.0, 0.5, -4.0]], F32)
    np.testing.assert_array_equal(simulate(ok)(x), (x.view(np.int32) >> 23) & 0xFF)


def test_memset_value_must_suit_dtype():
    def bad(x):
        nisa.memset(nl.ndarray((2, 2), nl.uint8, buffer=nl.sbuf), -1)

    def good(x):
        t = nl.ndarray((2, 2), nl.uint8, buffer=nl.sbuf)
        nisa.memset(t, 255)
        return out_of(t)

    rejects("memset-value", bad, arr(1, 1))
    assert (simulate(good)(arr(1, 1)) == 255).all()


# ------------------------------------------------------------------------------------------ reductions
def test_reductions_only_over_trailing_free_axes():
    def axis0(x):
        t = load(x)
        nisa.tensor_reduce(dst=nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf), op=nl.add, data=t, axis=0)

    def middle(x):
        t = load(x).reshape((4, 2, 4))
        nisa.tensor_reduce(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf), op=nl.add, data=t, axis=1)

    def good(x):
        t = load(x).reshape((4, 2, 4))
        r = nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r, op=nl.maximum, data=t, axis=(2,))
        return out_of(r)

    x = arr(4, 8)
    rejects("reduce-partition-axis", axis0, x)
    rejects("reduce-trailing-axes", middle, x)
    np.testing.assert_array_equal(simulate(good)(x), x.reshape(4, 2, 4).max(axis=2))


# ------------------------------------------------------------------------------------------ cross-partition
def _shift(n, src0, dst0, engine=nisa.engine.vector):
    """tensor_copy of partitions [src0, src0 + n) onto [dst0, dst0 + n) of one tile."""

    def k(x):
        t = load(x)
        nisa.tensor_copy(dst=t[dst0 : dst0 + n, :], src=t[src0 : src0 + n, :], engine=engine)
        return out_of(t)

    return k


@pytest.mark.parametrize(
    "n, src0, dst0", [(32, 0, 96), (32, 96, 32), (1, 64, 0), (33, 0, 64), (64, 64, 0), (64, 0, 64)]
)
def test_cross_partition_within_documented_limits_is_accepted(n, src0, dst0):
    """Arch guide: cross-quadrant for n ≤ 32 (start 0/32/64/96), cross-half for 32 < n ≤ 64 (start 0/64)."""
    x = arr(128, 8)
    want = x.copy()
    want[dst0 : dst0 + n] = x[src0 : src0 + n]
    np.testing.assert_array_equal(simulate(_shift(n, src0, dst0))(x), want)


@pytest.mark.parametrize(
    "n, src0, dst0",
    [
        (32, 0, 16),  # n ≤ 32 but dst not on a quadrant start
        (32, 1, 32),  # src not on a quadrant start
        (33, 0, 32),  # 33 partitions: cross-half only (0/64), 32 is not legal
        (65, 0, 63),  # > 64 partitions: start must be 0 on both sides
        (64, 32, 64),  # 64 partitions starting at 32
    ],
)
def test_cross_partition_beyond_documented_limits_is_refused(n, src0, dst0):
    rejects("cross-partition", _shift(n, src0, dst0), arr(128, 8))


def test_cross_partition_rule_applies_to_every_operand_and_engine():
    def psum_rows(x):  # tensor_tensor reading PSUM rows 32..32+T into rows 0..T (a decode-kernel idiom)
        t = load(x)
        ps = nl.ndarray((128, 8), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=ps, src=t)
        o = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(o, 0.0)
        nisa.tensor_tensor(dst=o[0:5, :], data1=ps[32:37, :], data2=t[64:69, :], op=nl.add)
        return out_of(o)

    def bad_second_operand(x):
        t = load(x)
        nisa.tensor_tensor(dst=t[0:5, :], data1=t[32:37, :], data2=t[40:45, :], op=nl.add)

    x = arr(128, 8)
    got = simulate(psum_rows)(x)
    np.testing.assert_array_equal(got[0:5], x[32:37] + x[64:69])
    rejects("cross-partition", bad_second_operand, x)
    for eng in (nisa.engine.scalar, nisa.engine.gpsimd):
        rejects("cross-partition", _shift(32, 0, 16, eng), x)
        np.testing.assert_array_equal(simulate(_shift(32, 0, 32, eng))(x)[32:64], x[0:32])


def test_partition_broadcast_and_transpose_still_need_a_moving_instruction():
    def broadcast_partitions(x):
        load(x)[0:1, :].broadcast(0, 128)

    def transpose(x):
        t = load(x)
        ps = nl.ndarray((8, 128), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=t)
        sb = nl.ndarray((8, 128), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        return out_of(sb)

    x = arr(128, 8)
    rejects("cross-partition", broadcast_partitions, x)
    np.testing.assert_array_equal(simulate(transpose)(x), x.T)


# ------------------------------------------------------------------------------------------ poison
def test_new_memory_is_poisoned():
    def floats(x):
        t = nl.ndarray((2, 3), nl.float32, buffer=nl.sbuf)
        return out_of(t)

    def ints(x):
        t = nl.ndarray((2, 3), nl.int32, buffer=nl.sbuf)
        return out_of(t)

    def hbm_out(x):
        return nl.ndarray((2, 3), nl.bfloat16, buffer=nl.shared_hbm)  # never written

    assert np.isnan(simulate(floats)(arr(1, 1))).all()
    assert (simulate(ints)(arr(1, 1)).view(np.uint8) == 0xA5).all()
    assert np.isnan(simulate(hbm_out)(arr(1, 1)).astype(F32)).all()


# ------------------------------------------------------------------------------------------ kernel interface
def test_outputs_must_be_shared_hbm_and_args_tuples():
    def private(x):
        return nl.ndarray((2, 2), nl.float32, buffer=nl.hbm)

    def takes(xs):
        return None

    rejects("output-buffer", private, arr(1, 1))
    rejects("kernel-args", takes, [arr(1, 1)])


def test_instructions_take_enums_not_raw_values():
    def k(x):
        nisa.tensor_copy(dst=load(x), src=load(x), engine="vector")

    rejects("enum", k, arr(2, 2))


def test_gpsimd_cannot_access_psum_and_tensor_tensor_not_both_psum():
    def gpsimd(x):
        ps = nl.ndarray((2, 2), nl.float32, buffer=nl.psum)
        nisa.memset(ps, 0.0)
        nisa.tensor_copy(dst=load(x), src=ps, engine=nisa.engine.gpsimd)

    def both(x):
        ps = nl.ndarray((2, 2), nl.float32, buffer=nl.psum)
        nisa.memset(ps, 0.0)
        nisa.tensor_tensor(dst=load(x), data1=ps, data2=ps, op=nl.add)

    rejects("gpsimd-psum", gpsimd, arr(2, 2))
    rejects("psum-operands", both, arr(2, 2))


def test_out_of_range_index_and_incompatible_views():
    def index(x):
        load(x)[:, 3:9]

    def reshape(x):
        load(x)[:, 0:8:2].reshape((4, 2, 2))[:, :, 0:1].reshape((4, 2))  # ok: a strided view that still reshapes
        load(x)[:, 0:6].reshape((4, 3, 2)).permute((0, 2, 1)).reshape((4, 6))

    def view(x):
        load(x)[:, 0:8:2].view(nl.uint8)

    x = arr(4, 8)
    rejects("index", index, x[:, :4].copy())
    rejects("reshape", reshape, x)
    rejects("view", view, x)


# ------------------------------------------------------------------------------------------ semantics
def test_views_bitcast_and_ap_share_storage():
    x = arr(4, 8)

    def k(x):
        t = load(x)
        b = t.view(nl.uint8)  # [4, 32] bytes of the same storage
        assert b.shape == (4, 32)
        r = nl.ndarray((4, 8), nl.uint8, buffer=nl.sbuf)
        # bytes 4..7 of every row (element 1) through a raw access pattern on the byte storage
        nisa.tensor_copy(dst=r[:, 0:4], src=t.ap([[32, 4], [1, 4]], offset=4, dtype=nl.uint8))
        nisa.tensor_copy(dst=r[:, 4:8], src=b[:, 8:12])
        return out_of(r)

    got = simulate(k)(x)
    np.testing.assert_array_equal(got[:, 0:4].copy().view(F32)[:, 0], x[:, 1])
    np.testing.assert_array_equal(got[:, 4:8].copy().view(F32)[:, 0], x[:, 2])


def test_tensor_scalar_activation_and_reductions_match_numpy():
    x = arr(16, 32, seed=4)
    w = np.abs(arr(16, 1, seed=5)) + 0.5

    def k(x, w):
        t, wt = load(x), load(w)
        a = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=a, op=nl.silu, data=t, scale=wt, bias=0.25)
        b = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=b, data=a, op0=nl.minimum, operand0=1.0, op1=nl.maximum, operand1=-1.0)
        c = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=c, data=b, op0=nl.multiply, operand0=wt, op1=nl.add, operand1=t)
        red = nl.ndarray((16, 1), nl.float32, buffer=nl.sbuf)
        d = nl.ndarray((16, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d, data=c, op0=nl.abs, operand0=None, reduce_op=nl.maximum, reduce_res=red)
        o = nl.ndarray((16, 33), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o[:, 0:32], src=c)
        nisa.dma_copy(dst=o[:, 32:33], src=red)
        return o

    got = simulate(k)(x, w)
    v = x * w + 0.25
    a = v / (1 + np.exp(-v))
    c = np.clip(a, -1, 1) * w + x
    np.testing.assert_allclose(got[:, :32], c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[:, 32], np.abs(c).max(axis=1), rtol=1e-6)


def test_iota_predicated_copy_and_fp32_to_int_rounding():
    def k(x):
        idx = nl.ndarray((4, 6), nl.int32, buffer=nl.sbuf)
        nisa.iota(idx, [[1, 6]], offset=0, channel_multiplier=10)
        pred = nl.ndarray((4, 6), nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=pred, data=idx, op0=nl.greater_equal, operand0=12.0)
        out = nl.ndarray((4, 6), nl.int32, buffer=nl.sbuf)
        nisa.memset(out, -1)
        nisa.tensor_copy_predicated(dst=out, src=idx, predicate=pred)
        return out_of(out)

    want = np.arange(6)[None, :] + 10 * np.arange(4)[:, None]
    np.testing.assert_array_equal(simulate(k)(arr(1, 1)), np.where(want >= 12, want, -1))


def test_register_driven_loop_with_scalar_offset_skips_work():
    """What the skip-unrouted expert kernels (nki_kernels/expert_gemm.py, local_experts.py) rely on: a count
    loaded into a register bounds a device loop, and the loop index addresses HBM through .ap(scalar_offset=...)."""
    table = np.arange(5 * 4, dtype=F32).reshape(5, 4)  # 5 "experts" of 4 values
    count = np.array([[3]], np.int32)

    def k(table, count):
        out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(acc, 0.0)
        c = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=count)
        n = nisa.register_alloc()
        nisa.register_load(n, c)

        def body(i):
            row = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=table.ap([[4, 1], [1, 4]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)

        nl.fori_loop(0, n, body)
        nisa.dma_copy(dst=out, src=acc)
        return out

    np.testing.assert_array_equal(simulate(k)(table, count), table[:3].sum(axis=0, keepdims=True))
    cost = interpreter.last_run().cost
    assert cost.loop_iterations == 3 and cost.dma_count == 1 + 3 + 1  # the 2 skipped rows move no bytes


def test_cost_record_and_estimate():
    x = arr(128, 1024, dtype=ml_dtypes.bfloat16)

    def k(x):
        t = load(x)
        a = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=a, op=nl.exp, data=t)
        nisa.tensor_scalar(dst=t, data=a, op0=nl.multiply, operand0=2.0)
        return out_of(t)

    simulate(k)(x)
    cost = interpreter.last_run().cost
    assert cost.dma_count == 2 and cost.hbm_bytes == 2 * x.nbytes
    assert cost.instr_count["scalar"] == 1 and cost.instr_count["vector"] == 1
    assert cost.instr_elems["scalar"] == 1024
    est = interpreter.estimate(cost)
    model = interpreter.TRN2
    eff = model.run_efficiency(2048)  # 1024 bf16 per partition: the DMA bandwidth guide's "≥ 2 KiB", below 4 KiB
    assert est["dma_s"] == pytest.approx(2 * x.nbytes / (eff * model.dma_bandwidth) + model.dma_fixed)
    assert est["hbm_s"] == pytest.approx(2 * x.nbytes / model.hbm_bandwidth_per_core)
    assert est["scalar_s"] == pytest.approx((1024 + model.instr_fixed_cycles) / 1.2e9)
    assert est["time_s"] == max(est["dma_s"], est["hbm_s"], est["scalar_s"], est["vector_s"])
    assert model.hbm_roofline(cost.hbm_bytes) < est["time_s"]


def test_nl_load_store_and_tile_wrappers():
    x, y = arr(8, 16, seed=6), arr(8, 16, seed=7)

    def k(x, y):
        a, b = nl.load(x), nl.load(y, dtype=nl.bfloat16)
        s = nl.add(a, b)  # new SBUF tile (VectorE tensor_tensor)
        e = nl.exp(nl.multiply(s, 0.5))  # tensor_scalar, then ScalarE activation
        m = nl.max(e, axis=1)  # [8, 1] tensor_reduce over the free axis
        o = nl.ndarray((8, 17), nl.float32, buffer=nl.shared_hbm)
        nl.store(o[:, 0:16], e)
        nl.store(o[:, 16:17], m)
        return o

    got = simulate(k)(x, y)
    yb = y.astype(ml_dtypes.bfloat16).astype(F32)
    want = np.exp((x + yb) * 0.5)
    np.testing.assert_allclose(got[:, :16], want, rtol=1e-6)
    np.testing.assert_allclose(got[:, 16], want.max(axis=1), rtol=1e-6)


def test_e4m3fn_weights_beyond_240_decode_exactly_on_trn2():
    """What the GEMM kernels do with OCP fp8 weights on trn2: move the bytes, then convert (never
    reinterpret as float8_e4m3, whose encodings above 240 are inf/NaN)."""
    w = np.array([[448.0, -320.0, 240.0, 1.5, -0.0, 2.0**-9]], F32).astype(ml_dtypes.float8_e4m3fn)

    def k(w):
        raw = nl.ndarray((1, 6), nl.float8_e4m3fn, buffer=nl.sbuf)
        nisa.dma_copy(dst=raw, src=w)  # equal dtypes: a byte move
        dec = nl.ndarray((1, 6), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dec, src=raw)  # converting copy on VectorE
        via_dma = nl.ndarray((1, 6), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=via_dma, src=w)  # converting DMA
        wrong = nl.ndarray((1, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wrong, src=raw.view(nl.float8_e4m3))  # reinterpretation: 448 becomes NaN/inf
        o = nl.ndarray((3, 6), nl.float32, buffer=nl.shared_hbm)
        f = nl.ndarray((1, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=f, src=dec)
        nisa.dma_copy(dst=o[0:1, :], src=f)
        nisa.dma_copy(dst=o[1:2, :], src=via_dma)
        nisa.dma_copy(dst=o[2:3, :], src=wrong)
        return o

    got = simulate(k)(w)
    np.testing.assert_array_equal(got[0], w.astype(F32)[0])
    np.testing.assert_array_equal(got[1], w.astype(F32)[0])
    assert not np.isfinite(got[2, 0]) and not np.isfinite(got[2, 1])


def test_indirect_row_gather_with_oob_skip():
    table = arr(6, 4, seed=8)
    idx = np.array([[4], [0], [9], [2]], np.int32)  # 9 is out of range

    def k(table, idx):
        i = nl.load(idx)
        rows = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(rows, 0.0)
        nisa.dma_copy(
            dst=rows,
            src=table.ap([[4, 4], [1, 4]], offset=0, vector_offset=i, indirect_dim=0),
            oob_mode=nisa.oob_mode.skip,
        )
        return out_of(rows)

    got = simulate(k)(table, idx)
    np.testing.assert_array_equal(got[[0, 1, 3]], table[[4, 0, 2]])
    np.testing.assert_array_equal(got[2], 0.0)

    def strict(table, idx):
        i = nl.load(idx)
        rows = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=table.ap([[4, 4], [1, 4]], offset=0, vector_offset=i, indirect_dim=0))

    rejects("dma-oob", strict, table, idx)


def test_interpreter_internals_are_not_tensor_api():
    """Kernels must run unchanged through the real NKI, so non-NKI conveniences fail loudly here too."""

    def k(x):
        return load(x).free_size

    rejects("not-nki-api", k, arr(2, 2))
