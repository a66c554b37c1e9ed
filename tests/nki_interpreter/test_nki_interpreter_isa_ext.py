"""The NKI interpreter's less common instructions and modes (transpose-mode and tiled matmuls, DMA transposes and
dma_compute, the search / scan / select / stream instructions, MX on trn3, LNC = 2), each against numpy built from
the isa stub's own description (aws-neuron-sdk ``nki/api/nki/isa/__init__.py``) and with its documented limits
refused.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import NkiRuleError, simulate
from nki_interpreter import isa as nisa
from nki_interpreter import language as nl
from nki_interpreter.testing import arr, load, out_of, rejects

F32 = np.float32


def identity(n, dtype=nl.bfloat16):
    return nl.shared_identity_matrix(n, dtype=dtype)


# ------------------------------------------------------------------------------------ nc_matmul transpose
def test_matmul_transpose_mode_is_bit_exact_including_nan_and_inf():
    """nc_matmul page: is_transpose=True (NeuronCore-v3+) transposes bit-exactly, NaN/Inf included."""

    def k(x):
        t = load(x)
        ps = nl.ndarray((x.shape[1], x.shape[0]), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=identity(x.shape[0]), is_transpose=True)
        sb = nl.ndarray(ps.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        return out_of(sb)

    x = arr(64, 32).astype(ml_dtypes.bfloat16)
    x[3, 5], x[7, 1] = np.nan, np.inf
    got = simulate(k)(x)
    np.testing.assert_array_equal(got.view(np.uint16), x.T.view(np.uint16))


def test_matmul_transpose_of_fp8_on_trn2_writes_16_bit_elements_with_a_zero_top_byte():
    """trn2 guide note: an fp8 transpose produces 16-bit PSUM elements, upper 8 bits zero."""

    def k(x):
        t = load(x)
        ps = nl.ndarray((x.shape[1], x.shape[0]), nl.uint16, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=identity(x.shape[0]), is_transpose=True)
        sb = nl.ndarray(ps.shape, nl.uint16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        return out_of(sb)

    def same_dtype(x):
        t = load(x)
        ps = nl.ndarray((x.shape[1], x.shape[0]), nl.float8_e4m3, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=identity(x.shape[0]), is_transpose=True)

    x = (arr(16, 8) * 4).astype(ml_dtypes.float8_e4m3)
    np.testing.assert_array_equal(simulate(k)(x), x.T.view(np.uint8).astype(np.uint16))
    rejects("dtype-mismatch", same_dtype, x)


def test_matmul_transpose_needs_an_identity_moving_operand_and_no_double_row():
    def not_identity(x):
        t = load(x)
        ones = nl.ndarray((x.shape[0], x.shape[0]), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(ones, 1.0)
        ps = nl.ndarray((x.shape[1], x.shape[0]), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=t, moving=ones, is_transpose=True)

    rejects("matmul-transpose", not_identity, arr(8, 4).astype(ml_dtypes.bfloat16))


def test_matmul_tiling_limits_follow_the_nc_matmul_page():
    def mm(k, m, pos, size, perf=nisa.matmul_perf_mode.none):
        def kern(x):
            shape = (k, 2, m) if perf == nisa.matmul_perf_mode.double_row else (k, m)
            st = nl.ndarray(shape, nl.float8_e4m3, buffer=nl.sbuf)
            mv = nl.ndarray(shape[:-1] + (8,), nl.float8_e4m3, buffer=nl.sbuf)
            nisa.memset(st, 1.0)
            nisa.memset(mv, 1.0)
            d = nl.ndarray((m, 8), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=d, stationary=st, moving=mv, tile_position=pos, tile_size=size, perf_mode=perf)
            o = nl.ndarray((m, 8), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=d)
            return out_of(o)

        return kern

    one = np.ones((1, 1), F32)
    np.testing.assert_array_equal(simulate(mm(64, 32, (64, 0), (64, 128)))(one), np.full((32, 8), 64.0))
    np.testing.assert_array_equal(simulate(mm(32, 32, (96, 32), (32, 32)))(one), np.full((32, 8), 32.0))
    rejects("matmul-limits", mm(65, 32, (64, 0), (64, 128)), one)  # K beyond the row tile
    rejects("matmul-tiling", mm(32, 32, (16, 0), (32, 128)), one)  # start not a multiple of the size
    rejects("matmul-tiling", mm(32, 32, (0, 0), (48, 128)), one)
    rejects("matmul-tiling", mm(32, 32, (0, 0), ()), one)  # both or neither
    # double_row: row tiling allowed, column tiling refused (trn2 guide)
    simulate(mm(64, 32, (0, 0), (64, 128), nisa.matmul_perf_mode.double_row))(one)
    rejects("matmul-double-row", mm(64, 32, (0, 0), (64, 64), nisa.matmul_perf_mode.double_row), one)


# ------------------------------------------------------------------------------------ dma_transpose
def test_dma_transpose_2d_3d_4d_from_hbm_and_sbuf():
    """dma_transpose page: 2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0), dst in SBUF."""

    def k(x, from_sbuf):
        src = load(x) if from_sbuf else x
        axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[x.ndim]
        d = nl.ndarray(tuple(x.shape[a] for a in axes), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=src, axes=axes)
        return out_of(d)

    for shape in ((16, 128), (4, 3, 8), (8, 2, 3, 4)):
        x = arr(*shape).astype(ml_dtypes.bfloat16)
        axes = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}[x.ndim]
        np.testing.assert_array_equal(simulate(k)(x, False).view(np.uint16), np.transpose(x, axes).view(np.uint16))
    x = arr(32, 16)
    np.testing.assert_array_equal(simulate(k)(x, True), x.T)
    rec = interpreter.last_run().cost
    assert rec.dmas[-2].efficiency == 0.5  # SBUF→SBUF transpose at half DMA throughput (trn2 guide)


def test_dma_transpose_limits():
    def one_byte(x):
        d = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x)

    def hwdge_shape(x):
        d = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x, dge_mode=nisa.dge_mode.hwdge)

    def raw_hwdge(x):  # dge_mode=2 is hwdge in the stub's numbering: warned, then the same hwdge rules
        d = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x, dge_mode=2)

    rejects("dma-transpose-dtype", one_byte, np.zeros((4, 4), np.uint8))
    with pytest.warns(DeprecationWarning):
        rejects("dma-transpose-shape", raw_hwdge, np.zeros((8, 128), ml_dtypes.bfloat16))
    rejects("dma-transpose-shape", hwdge_shape, np.zeros((8, 128), ml_dtypes.bfloat16))  # needs 16 rows
    simulate(hwdge_shape)(np.zeros((16, 128), ml_dtypes.bfloat16))


def test_dma_transpose_refuses_a_runtime_address_nki_415():
    """A register (scalar_offset) address on a dma_transpose is refused, as the compiler does (NKI-415, quoted by
    nki-library's mlp_tkg_gate_up_projection.py); the same rows by dma_copy at that address are fine."""

    def k(x, transpose):
        e = nisa.register_alloc(1)
        src = x.ap(pattern=[[16, 16], [1, 16]], offset=0, scalar_offset=e, indirect_dim=0)
        if transpose:
            d = nl.ndarray((16, 16), x.dtype, buffer=nl.sbuf)
            nisa.dma_transpose(dst=d, src=src)
        else:
            d = nl.ndarray((16, 16), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=d, src=src)

    x = np.zeros((2, 16, 16), ml_dtypes.bfloat16)
    rejects("dma-transpose-dynamic", k, x, True)
    simulate(k)(x, False)


def test_dma_transpose_indirect_gathers_rows_then_transposes():
    """dma_transpose page: gathered = src[indices.T.flatten()[:rows]]; dst = gathered.T."""

    def k(src, idx_h):
        idx = load(idx_h)
        d = nl.ndarray((src.shape[1], 16), src.dtype, buffer=nl.sbuf)
        view = src.ap(pattern=[[src.shape[1], 16], [1, src.shape[1]]], vector_offset=idx, indirect_dim=0)
        nisa.dma_transpose(dst=d, src=view, axes=(1, 0))
        return out_of(d)

    src = arr(40, 8).astype(ml_dtypes.bfloat16)
    idx = np.random.default_rng(1).permutation(40)[:16].astype(np.uint32).reshape(16, 1)
    got = simulate(k)(src, idx)
    np.testing.assert_array_equal(got.view(np.uint16), src[idx[:, 0]].T.view(np.uint16))
    assert interpreter.last_run().cost.dmas[-2].dge


# ------------------------------------------------------------------------------------ nonzero_with_count
def test_nonzero_with_count_follows_the_documented_example_on_gpsimd_core_partitions():
    """isa stub example: [0, 1, 1, 0, 0, 1, 0, 0], index_offset 16 → [17, 18, 21, -1 ×5, 3]; only partitions
    0, 16, …, 112 are written."""

    def k(x):
        s = load(x)
        d = nl.ndarray((32, 9), nl.int32, buffer=nl.sbuf)
        nisa.memset(d, 7)
        nisa.nonzero_with_count(dst=d, src=s, index_offset=16, padding_val=-1)
        return out_of(d)

    x = np.zeros((32, 8), F32)
    x[0] = [0, 1, 1, 0, 0, 1, 0, 0]
    x[16] = [1, 0, 0, 0, 0, 0, 0, 2]
    x[5] = 1  # not a GpSimd core's first partition: ignored, its row untouched
    got = simulate(k)(x)
    np.testing.assert_array_equal(got[0], [17, 18, 21, -1, -1, -1, -1, -1, 3])
    np.testing.assert_array_equal(got[16], [16, 23, -1, -1, -1, -1, -1, -1, 2])
    assert (got[5] == 7).all() and (got[1:16] == 7).all()


def test_nonzero_with_count_limits():
    def wrong_dst(x):
        nisa.nonzero_with_count(dst=nl.ndarray((16, 8), nl.int32, buffer=nl.sbuf), src=load(x))

    rejects("shape-mismatch", wrong_dst, np.zeros((16, 8), F32))


# ------------------------------------------------------------------------------------ tensor_tensor_scan
def test_tensor_tensor_scan_matches_the_stub_pseudocode():
    """r[0] = op1(op0(d0[0], initial), d1[0]); r[i] = op1(op0(d0[i], r[i-1]), d1[i]) — e.g. a decayed cumsum
    r = d0·r + d1 (multiply, add)."""

    def k(a, b, init):
        d = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=d, data0=load(a), data1=load(b), initial=load(init), op0=nl.multiply, op1=nl.add)
        return out_of(d)

    def reversed_ops(a, b):
        d = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(
            dst=d,
            data0=load(a),
            data1=load(b),
            initial=1.0,
            op0=nl.subtract,
            op1=nl.subtract,
            reverse0=True,
            reverse1=True,
        )
        return out_of(d)

    a, b, init = arr(4, 16, seed=1), arr(4, 16, seed=2), arr(4, 1, seed=3)
    want = np.empty_like(a)
    r = init[:, 0].astype(np.float64)
    for i in range(16):
        r = a[:, i] * r + b[:, i]
        want[:, i] = r
    np.testing.assert_allclose(simulate(k)(a, b, init), want, rtol=1e-5, atol=1e-6)
    want2, r = np.empty_like(a), np.ones(4)
    for i in range(16):
        r = b[:, i] - (r - a[:, i])  # reverse0: prev - d0; reverse1: d1 - (...)
        want2[:, i] = r
    np.testing.assert_allclose(simulate(reversed_ops)(a, b), want2, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ affine / range select
def test_affine_select_builds_a_causal_mask():
    """affine_select page: predicate = cmp_op(offset + p·channel_multiplier + Σ idx·step, 0)."""

    def k(x):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        # keep column j of row p where p - j >= 0
        nisa.affine_select(
            dst=d,
            pattern=[[-1, x.shape[1]]],
            channel_multiplier=1,
            on_true_tile=load(x),
            on_false_value=-9999.0,
            cmp_op=nl.greater_equal,
        )
        return out_of(d)

    x = arr(8, 8)
    np.testing.assert_array_equal(simulate(k)(x), np.where(np.tril(np.ones((8, 8), bool)), x, F32(-9999.0)))


def test_range_select_keeps_a_window_and_reduces_its_max():
    """range_select page: mask = op0(range_start + i, bound0) & op1(range_start + i, bound1); the rest gets
    FP32_MIN; reduce_res = max of the result."""
    FP32_MIN = float(np.finfo(np.float32).min)

    def k(x, lo, hi):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.range_select(
            dst=d,
            on_true_tile=load(x),
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=load(lo),
            bound1=load(hi),
            reduce_res=m,
            range_start=10,
            on_false_value=FP32_MIN,
        )
        return out_of(d), out_of(m)

    def bf16_dst(x, lo, hi):
        d = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.range_select(
            dst=d,
            on_true_tile=load(x),
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=load(lo),
            bound1=load(hi),
            range_start=10,
            on_false_value=FP32_MIN,
        )
        return out_of(d)

    x = arr(4, 12)
    lo = np.array([[10], [12], [15], [30]], F32)
    hi = np.array([[14], [22], [16], [40]], F32)
    idx = 10 + np.arange(12)
    mask = (idx[None] >= lo) & (idx[None] < hi)
    d, m = simulate(k)(x, lo, hi)
    np.testing.assert_array_equal(d, np.where(mask, x, F32(FP32_MIN)))
    np.testing.assert_array_equal(m[:, 0], np.where(mask, x, F32(FP32_MIN)).max(axis=1))
    got = simulate(bf16_dst)(x, lo, hi).astype(F32)
    assert np.isneginf(got[~mask]).all()  # the stub: FP32_MIN becomes -inf in a narrower dst


# ------------------------------------------------------------------------------------ bn_stats / bn_aggr
def test_bn_stats_then_bn_aggr_give_mean_and_variance_over_several_tiles():
    def k(x):
        t = load(x)
        st = nl.ndarray((x.shape[0], 12), nl.float32, buffer=nl.sbuf)
        for j in range(2):  # two 512-element tiles, one bn_aggr (the stub's recipe)
            nisa.bn_stats(dst=st[:, 6 * j : 6 * j + 6], data=t[:, 512 * j : 512 * (j + 1)])
        mv = nl.ndarray((x.shape[0], 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=st)
        return out_of(st), out_of(mv)

    def too_wide(x):
        nisa.bn_stats(dst=nl.ndarray((x.shape[0], 6), nl.float32, buffer=nl.sbuf), data=load(x))

    x = arr(8, 1024) * 3 + 1
    st, mv = simulate(k)(x)
    even = x[:, 0:512:2]
    np.testing.assert_allclose(st[:, 0], 256)
    np.testing.assert_allclose(st[:, 1], even.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(st[:, 2], even.var(axis=1) * 256, rtol=1e-4)
    np.testing.assert_allclose(mv[:, 0], x.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mv[:, 1], x.var(axis=1), rtol=1e-4)
    rejects("free-size", too_wide, arr(8, 513))


# ------------------------------------------------------------------------------------ max8 family
def test_max8_find_index8_match_replace8_iterate_a_top_k():
    def k(x):
        t = load(x)
        v1 = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=v1, src=t)
        i1 = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=i1, data=t, vals=v1)
        rest = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        i2 = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=rest, data=t, vals=v1, imm=float("-inf"), dst_idx=i2)
        v2 = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=v2, src=rest)
        return out_of(v1), out_of(i1), out_of(i2), out_of(v2)

    x = arr(4, 64)
    x[1, 10] = x[1, 20]  # a duplicate: the two copies take successive indices
    v1, i1, i2, v2 = simulate(k)(x)
    order = np.argsort(-x, axis=1, kind="stable")
    np.testing.assert_array_equal(v1, np.take_along_axis(x, order[:, :8], axis=1))
    np.testing.assert_array_equal(v2, np.take_along_axis(x, order[:, 8:16], axis=1))
    np.testing.assert_array_equal(np.sort(i2, axis=1), np.sort(order[:, :8], axis=1))
    np.testing.assert_array_equal(np.take_along_axis(x, i1.astype(np.int64), axis=1), v1)


def test_find_index8_of_an_absent_value_is_refused():
    def k(x):
        vals = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(vals, 123.0)
        nisa.nc_find_index8(dst=nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf), data=load(x), vals=vals)

    rejects("value-not-found", k, arr(2, 16))


# ------------------------------------------------------------------------------------ stream shuffle
def test_stream_shuffle_broadcasts_and_permutes_within_quadrants():
    """nc_stream_shuffle page: out[32q + i] = src[32q + mask[i]], 255 keeps; start partitions per the
    active-partition count."""

    def k(x, mask, dst0):
        s = load(x)
        d = nl.ndarray((128, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.memset(d, 0.0)
        n = x.shape[0]
        nisa.nc_stream_shuffle(dst=d[dst0 : dst0 + n, :], src=s, shuffle_mask=mask)
        return out_of(d)

    x = arr(64, 4)
    rev = tuple(range(31, -1, -1))  # kernel arguments are tuples (NKI 0.3)
    got = simulate(k)(x, rev, 64)
    want = np.zeros((128, 4), F32)
    want[64:96], want[96:128] = x[0:32][::-1], x[32:64][::-1]
    np.testing.assert_array_equal(got, want)
    keep = (0,) * 16 + (255,) * 16  # broadcast partition 0 to the first 16 of each quadrant, keep the rest
    got = simulate(k)(x[0:32], keep, 32)
    assert (got[32:48] == x[0]).all() and (got[48:64] == 0).all()
    rejects("cross-partition", k, x, rev, 32)  # 64 active partitions may start at 0 or 64 only


# ------------------------------------------------------------------------------------ nc_n_gather
def test_nc_n_gather_gathers_within_each_partition():
    def k(x, idx):
        d = nl.ndarray(idx.shape, x.dtype, buffer=nl.sbuf)
        nisa.nc_n_gather(dst=d, data=load(x), indices=load(idx))
        return out_of(d)

    x = arr(8, 4, 5)
    idx = np.random.default_rng(2).integers(0, 20, (8, 7)).astype(np.uint32)
    np.testing.assert_array_equal(simulate(k)(x, idx), np.take_along_axis(x.reshape(8, 20), idx.astype(int), 1))
    rejects("index", k, x, np.full((8, 2), 20, np.uint32))


# ------------------------------------------------------------------------------------ select / cumulative
def test_select_reduce_selects_and_keeps_the_running_max():
    """isa stub: result = where(pred, on_true, on_false); reduce_res = max of result (reset_reduce)."""

    def k(x, p):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        m = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(
            dst=d,
            predicate=load(p),
            on_true=load(x),
            on_false=-5.0,
            reduce_res=m,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        return out_of(d), out_of(m)

    x, p = arr(4, 10), (np.random.default_rng(12).random((4, 10)) > 0.5).astype(np.uint8)
    d, m = simulate(k)(x, p)
    want = np.where(p != 0, x, F32(-5.0))
    np.testing.assert_array_equal(d, want)
    np.testing.assert_array_equal(m[:, 0], want.max(axis=1))


def test_tensor_scalar_cumulative_follows_the_stub_pseudocode():
    """reg = identity (reset_reduce) or imm1 (load_reduce); reg = op1(op0(x[i], imm0), reg); dst[i] = reg."""

    def k(x, cmd):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(
            dst=d, src=load(x), op0=nl.multiply, op1=nl.add, imm0=2.0, imm1=100.0, reduce_cmd=cmd
        )
        return out_of(d)

    def running_max(x):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_cumulative(dst=d, src=load(x), op0=nl.add, op1=nl.maximum, imm0=0.0)
        return out_of(d)

    x = arr(3, 9)
    np.testing.assert_allclose(
        simulate(k)(x, nisa.reduce_cmd.reset_reduce), np.cumsum(2 * x, axis=1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(simulate(k)(x, nisa.reduce_cmd.load_reduce), 100 + np.cumsum(2 * x, axis=1), rtol=1e-5)
    np.testing.assert_array_equal(simulate(running_max)(x), np.maximum.accumulate(x, axis=1))


def test_nl_where_picks_x_where_the_condition_holds():
    def k(x, y, c):
        a = nl.where(load(c), load(x), load(y))
        b = nl.where(load(c), load(x), 0.0)
        d = nl.where(load(c), 7.0, load(y))
        return out_of(a), out_of(b), out_of(d)

    x, y = arr(4, 6, seed=1), arr(4, 6, seed=2)
    c = (np.random.default_rng(13).random((4, 6)) > 0.5).astype(np.uint8)
    a, b, d = simulate(k)(x, y, c)
    np.testing.assert_array_equal(a, np.where(c != 0, x, y))
    np.testing.assert_array_equal(b, np.where(c != 0, x, 0))
    np.testing.assert_array_equal(d, np.where(c != 0, F32(7), y))


# ------------------------------------------------------------------------------------ local_gather
def test_local_gather_shares_indices_across_each_gpsimd_core_partitions():
    """The stub's example semantics: per 16-partition core, indices flattened column-major, each partition
    gathers num_elem_per_idx contiguous elements of its own free dim at every index."""

    def k(src, idx_h, nv):
        d = nl.ndarray((src.shape[0], nv * 4), src.dtype, buffer=nl.sbuf)
        nisa.local_gather(dst=d, src_buffer=load(src), index=load(idx_h), num_elem_per_idx=4, num_valid_indices=nv)
        return out_of(d)

    rng = np.random.default_rng(11)
    src = arr(32, 64, 4)
    rows = np.concatenate([rng.integers(0, 64, (16, 3)), rng.integers(0, 64, (16, 3))]).astype(np.uint16)
    got = simulate(k)(src, (rows * 4).astype(np.uint16), 40)  # the hardware index is in elements
    for c in range(2):
        sl = slice(16 * c, 16 * c + 16)
        want = np.take(src[sl], rows[sl].flatten(order="F")[:40], axis=1)
        np.testing.assert_array_equal(got[sl], want.reshape(16, -1))
    rejects("index", k, src, np.full((32, 3), 255, np.uint16), 8)


# ------------------------------------------------------------------------------------ dma_compute
def test_dma_compute_adds_sources_and_scatter_adds_rows():
    """dma_compute page: dst = Σ srcs (fp32); scatter RMW dst(HBM)[idx] += src(SBUF) with unique indices."""

    def add3(a, b, c):
        d = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_compute(dst=d, srcs=(a, b, c), reduce_op=nl.add)
        return out_of(d)

    def scatter_add(table, idx_h, upd):
        idx = load(idx_h)
        rows = table.ap(pattern=[[table.shape[1], idx_h.shape[0]], [1, table.shape[1]]], vector_offset=idx)
        nisa.dma_compute(dst=rows, srcs=(rows, load(upd)), reduce_op=nl.add)

    a, b, c = arr(4, 6, seed=1), arr(4, 6, seed=2), arr(4, 6, seed=3)
    np.testing.assert_allclose(simulate(add3)(a, b, c), a + b + c, rtol=1e-6)
    table, upd = arr(10, 6, seed=4), arr(3, 6, seed=5)
    idx = np.array([[7], [2], [9]], np.uint32)
    want = table.copy()
    want[idx[:, 0]] += upd
    simulate(scatter_add)(table, idx, upd)
    np.testing.assert_allclose(table, want, rtol=1e-6)
    rejects("dma-indices", scatter_add, arr(10, 6), np.array([[1], [1], [3]], np.uint32), upd)


# ------------------------------------------------------------------------------------ scalar_tensor_tensor
def test_scalar_tensor_tensor_accepts_a_dtype_that_agrees_with_dst():
    def k(x, dtype):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        t = load(x)
        nisa.scalar_tensor_tensor(dst=d, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=t, dtype=dtype)
        return out_of(d)

    x = arr(4, 4)
    np.testing.assert_array_equal(simulate(k)(x, nl.float32), 3 * x)
    rejects("dtype-mismatch", k, x, nl.bfloat16)


# ------------------------------------------------------------------------------------ trn3 MX
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _quantize_kernel(x):
    p, f = x.shape
    t = load(x)
    q = nl.ndarray((p, f // 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    s = nl.ndarray((p, f // 4), nl.uint8, buffer=nl.sbuf)
    nisa.memset(s, 0)
    nisa.quantize_mx(dst=q, src=t, dst_scale=s)
    return out_of(q.view(nl.uint8)), out_of(s)


def _ocp_quantize(x):
    """OCP MX v1.0 in numpy: per 8-partition × 4-value group, e = floor(log2 amax) - 8 + 127 (e4m3fn)."""
    p, f = x.shape
    g = np.abs(x.astype(np.float64)).reshape(p // 8, 8, f // 4, 4).max(axis=(1, 3))
    e = (np.floor(np.log2(g)) - 8 + 127).astype(np.int64)
    scale = np.exp2(np.repeat(e, 8, axis=0) - 127.0).repeat(4, axis=1)
    q = np.clip(x.astype(np.float64) / scale, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, e, scale


def test_quantize_mx_follows_the_ocp_scale_rule_and_the_quadrant_scale_layout():
    x = (arr(64, 16, seed=7) * 5).astype(ml_dtypes.bfloat16)
    with interpreter.target("trn3"):
        qb, s = simulate(_quantize_kernel)(x)
    q_want, e_want, scale = _ocp_quantize(x)
    np.testing.assert_array_equal(qb, q_want.view(np.uint8))
    rows = [0, 1, 2, 3, 32, 33, 34, 35]  # group g of quadrant c sits on partition 32c + g
    np.testing.assert_array_equal(s[rows], e_want)
    assert (np.delete(s, rows, axis=0) == 0).all()
    deq = qb.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    assert np.abs(deq - x.astype(np.float64)).max() <= 0.125 * np.abs(x.astype(np.float64)).max()


def test_nc_matmul_mx_of_mxfp8_and_mxfp4_matches_the_dequantized_product():
    kp, m, n = 64, 6, 8

    def k(a, b, w4, w4_scale):
        qa = nl.ndarray((kp, m), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        sa = nl.ndarray((kp, m), nl.uint8, buffer=nl.sbuf)
        qb = nl.ndarray((kp, n), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        sb = nl.ndarray((kp, n), nl.uint8, buffer=nl.sbuf)
        nisa.quantize_mx(dst=qa, src=load(a), dst_scale=sa)
        nisa.quantize_mx(dst=qb, src=load(b), dst_scale=sb)
        d8 = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=d8, stationary=qa, moving=qb, stationary_scale=sa, moving_scale=sb)
        w = load(w4).view(nl.float4_e2m1fn_x4)  # the fp4 bytes as x4 containers: a view, no data moved
        d4 = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=d4, stationary=w, moving=qb, stationary_scale=load(w4_scale), moving_scale=sb)
        o8, o4 = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf), nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o8, src=d8)
        nisa.tensor_copy(dst=o4, src=d4)
        return out_of(o8), out_of(o4)

    rng = np.random.default_rng(8)
    a = arr(kp, 4 * m, seed=9).astype(ml_dtypes.bfloat16)
    b = arr(kp, 4 * n, seed=10).astype(ml_dtypes.bfloat16)
    codes = rng.integers(0, 16, (kp, m, 4))
    w4 = (codes << (4 * np.arange(4))).sum(axis=-1).astype(np.uint16)
    exps = rng.integers(124, 131, (kp // 8, m))
    w4_scale = np.zeros((kp, m), np.uint8)
    w4_scale[[0, 1, 2, 3, 32, 33, 34, 35]] = exps
    with interpreter.target("trn3"):
        o8, o4 = simulate(k)(a, b, w4, w4_scale)
    qa, _, sa = _ocp_quantize(a)
    qb, _, sb = _ocp_quantize(b)
    da = (qa.astype(np.float64) * sa).reshape(kp, m, 4)
    db = (qb.astype(np.float64) * sb).reshape(kp, n, 4)
    np.testing.assert_allclose(o8, np.einsum("pmj,pnj->mn", da, db), rtol=1e-6, atol=1e-6)
    exact = a.astype(np.float64).reshape(kp, m, 4)
    ref = np.einsum("pmj,pnj->mn", exact, b.astype(np.float64).reshape(kp, n, 4))
    assert np.abs(o8 - ref).max() < 0.1 * np.abs(ref).max()  # MXFP8 quantization error, loosely
    w = np.where(codes & 8, -E2M1[codes & 7], E2M1[codes & 7]) * np.exp2(np.repeat(exps, 8, axis=0) - 127.0)[..., None]
    np.testing.assert_allclose(o4, np.einsum("pmj,pnj->mn", w, db), rtol=1e-6, atol=1e-6)


def test_mx_is_trn3_only_and_x4_types_refuse_arithmetic():
    x = np.ones((32, 8), ml_dtypes.bfloat16)
    rejects("dtype-unsupported", _quantize_kernel, x)  # on trn2 the x4 types themselves do not exist
    rejects("target", lambda x: nisa.nc_matmul_mx(None, None, None, None, None), x)

    def arith(x):
        q = nl.ndarray((32, 2), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.memset(q, 0)
        nisa.tensor_scalar(dst=q, data=q, op0=nl.add, operand0=1.0)

    def memset_one(x):
        nisa.memset(nl.ndarray((32, 2), nl.float8_e4m3fn_x4, buffer=nl.sbuf), 1)

    with interpreter.target("trn3"):
        rejects("dtype-x4", arith, x)
        rejects("memset-value", memset_one, x)


# ------------------------------------------------------------------------------------ LNC = 2
def test_lnc2_cores_split_a_shared_output_and_meet_at_a_barrier():
    """core_barrier page: each core writes half of a shared_hbm tensor, then both read all of it."""

    def k(x):
        p, f = x.shape
        half = p // 2
        r = nl.program_id(0)
        assert nl.num_programs() == 2
        out = nl.ndarray((p, f), nl.float32, buffer=nl.shared_hbm)
        both = nl.ndarray((p, f), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((half, f), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r * half : (r + 1) * half, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(10 * (r + 1)))
        nisa.dma_copy(dst=out[r * half : (r + 1) * half, :], src=t)
        nisa.core_barrier(data=out, cores=(0, 1))
        whole = nl.ndarray((p, f), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=whole, src=out)  # after the barrier each core sees the other's half
        if r == 1:
            nisa.dma_copy(dst=both, src=whole)
        return out, both

    x = arr(8, 4)
    kern = interpreter.jit(k)[2]
    out, both = kern(x)
    want = np.concatenate([x[:4] + 10, x[4:] + 20])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(both, want)
    assert len(interpreter.last_run().programs) == 2


def test_lnc2_sendrecv_exchanges_tiles_and_each_core_has_its_own_sbuf():
    def k(x):
        r = nl.program_id()
        big = nl.ndarray((128, 200 * 1024), nl.uint8, buffer=nl.sbuf)  # noqa: F841  (fits each core's SBUF)
        mine = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[4 * r : 4 * r + 4, :])
        theirs = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - r, recv_from_rank=1 - r, pipe_id=0)
        out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[4 * r : 4 * r + 4, :], src=theirs)
        return out

    x = arr(8, 8)
    got = interpreter.jit(k)[2](x)
    np.testing.assert_array_equal(got, np.concatenate([x[4:], x[:4]]))


def test_lnc2_private_hbm_is_per_core_and_runtime_oob_rows_are_skipped():
    """LNC = 2 with private_hbm (nki.language page: "only visible to each individual kernel instance in the SPMD
    grid") and runtime-addressed DMA writes whose start is out of bounds (ISA dma_copy: dynamic addresses are
    checked at run time, ``oob_mode.skip`` skips): the pattern of nki-library's ``indexed_flatten`` (each core
    scatters its rows' blocks into a private buffer, a row a core does not own gets offset -1000000, the cores
    combine by sendrecv + max). Written for this project, not copied."""
    invalid = -1000000

    def k(x, offsets):
        e, f = x.shape
        r = nl.program_id(0)
        part = nl.ndarray((2 * e, f), nl.float32, buffer=nl.private_hbm)  # one per core
        fill = nl.ndarray((2 * e, f), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=fill, value=-1.0)
        nisa.dma_copy(dst=part, src=fill)
        off = nl.ndarray((1, e), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=off, value=invalid)
        mine = (e + 1) // 2 if r == 0 else e // 2  # core 0 owns rows [0, ⌈e/2⌉), core 1 the rest
        first = 0 if r == 0 else (e + 1) // 2
        if mine:
            nisa.dma_copy(dst=off[:, :mine], src=offsets.reshape((1, e))[:, first : first + mine])
        for j in range((e + 1) // 2):  # both cores run the same trip count; core 1's extra row is skipped
            o = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=o, src=off[:, j : j + 1])
            row = nl.ndarray((1, f), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=x[min(first + j, e - 1) : min(first + j, e - 1) + 1, :])
            dst = part.ap(pattern=[[f, 1], [1, f]], offset=0, scalar_offset=o, indirect_dim=0)
            nisa.dma_copy(dst=dst, src=row, oob_mode=nisa.oob_mode.skip)
        got = nl.ndarray((2 * e, f), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=got, src=part)
        other = nl.ndarray((2 * e, f), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=got, dst=other, send_to_rank=1 - r, recv_from_rank=1 - r, pipe_id=0)
        nisa.tensor_tensor(dst=got, data1=got, data2=other, op=nl.maximum)
        out = nl.ndarray((2 * e, f), nl.float32, buffer=nl.shared_hbm)
        if r == 0:
            nisa.dma_copy(dst=out, src=got)
        return out

    x = np.abs(arr(3, 4)) + 1.0
    offsets = np.array([5, 0, 2], np.int32)
    got = interpreter.jit(k)[2](x, offsets)
    want = np.full((6, 4), -1.0, F32)
    want[offsets] = x
    np.testing.assert_array_equal(got, want)


def test_a_runtime_address_out_of_bounds_is_a_dma_error_unless_skipped():
    """The same out-of-bounds runtime address with the default ``oob_mode.error`` is refused when the DMA runs;
    the view alone is no error (the check runs with the DMA, read or write), and a row only partly inside is not
    modelled."""

    def k(x, where, mode):
        o = load(where)
        t = load(x)
        h = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=h, src=t)
        view = h.ap(pattern=[[4, 1], [1, 4]], offset=0, scalar_offset=o, indirect_dim=0)
        if mode == "dma":
            nisa.dma_copy(dst=view, src=t[0:1, :])
        elif mode == "partial":
            half = h.ap(pattern=[[4, 1], [1, 4]], offset=2, scalar_offset=o, indirect_dim=0)
            nisa.dma_copy(dst=half, src=t[0:1, :], oob_mode=nisa.oob_mode.skip)
        else:
            nisa.dma_copy(dst=t[0:1, :], src=view)
        return h

    x = arr(4, 4)
    for off, mode in ((4, "dma"), (-1, "dma"), (7, "read"), (3, "partial")):
        rejects("dma-oob", k, x, np.array([[off]], np.int32), mode)


def test_lnc2_both_cores_accumulating_into_the_same_rows_is_a_race():
    """Both cores scatter-add (dma_compute RMW) into the same shared rows with no barrier between: a data race
    (``lnc-race``); with a core_barrier between the two cores' adds it runs, and the sum is exact."""

    def k(x, ordered):
        r = nl.program_id(0)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = load(x)
        if r == 0:
            nisa.dma_copy(dst=out, src=t)
        nisa.core_barrier(data=out, cores=(0, 1))
        rows = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=rows, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        view = out.ap(pattern=[[x.shape[1], 2], [1, x.shape[1]]], offset=0, vector_offset=rows, indirect_dim=0)
        if ordered and r == 1:
            nisa.core_barrier(data=out, cores=(0, 1))
        nisa.dma_compute(dst=view, srcs=[view, t[0:2, :]], reduce_op=nl.add)
        if ordered and r == 0:
            nisa.core_barrier(data=out, cores=(0, 1))
        return out

    x = arr(4, 8)
    with pytest.raises(NkiRuleError) as e:
        interpreter.jit(k)[2](x, False)
    assert e.value.rule == "lnc-race"
    got = interpreter.jit(k)[2](x, True)
    want = x.copy()
    want[:2] = (x[:2] + x[:2]) + x[:2]
    np.testing.assert_array_equal(got, want)


def test_lnc2_cost_is_the_slower_core_between_barriers():
    """profile of an LNC = 2 run: Σ over the stretches between barriers of the slower core's estimate; MBU over
    two cores' HBM bandwidth."""
    from nki_interpreter.cost import TRN2

    def k(x):
        r = nl.program_id(0)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = load(x)
        for _ in range(4 if r == 0 else 1):  # core 0 is slower before the barrier
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.core_barrier(data=out, cores=(0, 1))
        for _ in range(3 if r == 1 else 0):  # core 1 alone after it
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        if r == 1:
            nisa.dma_copy(dst=out, src=t)
        return out

    x = arr(128, 512)
    _, rep = interpreter.profile(interpreter.jit(k)[2], x, ideal_hbm_bytes=x.nbytes)
    c0, c1 = interpreter.last_run().programs
    s0, s1 = c0.segments(), c1.segments()
    assert len(s0) == len(s1) == 2
    want = sum(max(TRN2.estimate(a)["time_s"], TRN2.estimate(b)["time_s"]) for a, b in zip(s0, s1))
    assert rep["time_s"] == pytest.approx(want) and rep["programs"] == 2
    assert rep["time_s"] < TRN2.estimate(c0)["time_s"] + TRN2.estimate(c1)["time_s"]
    assert rep["roofline_fraction"] == pytest.approx(TRN2.hbm_roofline(x.nbytes) / 2 / rep["time_s"])


def test_lnc2_a_missing_peer_fails_instead_of_hanging(monkeypatch):
    from nki_interpreter import isa_lnc

    monkeypatch.setattr(isa_lnc, "TIMEOUT_S", 0.5)

    def k(x):
        t = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        if nl.program_id() == 0:  # core 1 never sends: core 0 must not wait forever
            nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with pytest.raises(NkiRuleError) as e:
        interpreter.jit(k)[2](np.ones((1, 1), F32))
    assert e.value.rule == "lnc-deadlock"


def test_lnc_instructions_need_an_lnc2_launch_and_lnc_is_1_or_2():
    rejects("lnc", lambda x: nisa.core_barrier(x, (0, 1)), np.ones((1, 1), F32))
    with pytest.raises(NkiRuleError) as e:
        interpreter.jit(lambda x: None)[3]
    assert e.value.rule == "lnc"
