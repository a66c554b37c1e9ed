"""The NKI interpreter against the public NKI semantics: indirect access-pattern offsets,
``nl.tile_size`` values, the SBUF budget per target, truthiness, list/tuple outputs and raw enum integers.
Each case is built from the documentation's own description (cited per test); rules that were stricter than
the hardware are tested on both sides of their boundary.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import NkiRuleError, simulate
from nki_interpreter import isa as nisa
from nki_interpreter import language as nl
from nki_interpreter.testing import rejects

F32 = np.float32


def sbuf_scalar(value: int):
    """A (1, 1) int32 SBUF tile holding ``value`` (a runtime scalar offset)."""
    t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.iota(t, [[0, 1]], offset=value)
    return t


# ------------------------------------------------------------------------------------ §1 indirect offsets
def test_scalar_offset_scales_by_the_reshaped_view_not_the_allocation():
    """deep-dives/nki-aps: a = arange(32).reshape(4, 8); a.reshape((2, 16)).ap([[16, 1], [1, 16]], 0,
    scalar_offset=1, indirect_dim=0) starts at element 16 (one row of the (2, 16) view), not 8."""

    def k(a):
        v = a.reshape((2, 16)).ap(pattern=[[16, 1], [1, 16]], offset=0, scalar_offset=sbuf_scalar(1), indirect_dim=0)
        t = nl.ndarray((1, 16), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v)
        o = nl.ndarray((1, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    a = np.arange(32, dtype=F32).reshape(4, 8)
    got = simulate(k)(a)
    assert got[0, 0] == 16.0
    np.testing.assert_array_equal(got[0], np.arange(16, 32, dtype=F32))


def test_scalar_offset_on_an_inner_dim_of_a_reshaped_view():
    """indirect_dim=1 of a (2, 4, 4) view of a (4, 8) array: one step is prod(shape[2:]) = 4 elements."""

    def k(a):
        reg = nisa.register_alloc(3)
        v = a.reshape((2, 4, 4)).ap(pattern=[[4, 1], [1, 4]], offset=0, scalar_offset=reg, indirect_dim=1)
        t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v)
        o = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    a = np.arange(32, dtype=F32).reshape(4, 8)
    np.testing.assert_array_equal(simulate(k)(a)[0], np.arange(12, 16, dtype=F32))


def test_vector_offset_scatter_into_a_flattened_hbm_view():
    """dma_copy page, indirect scatter: rows of the tensor .ap is called on — here x.reshape((T*E, 1)), rows
    of one element — so flat index 31 of a (4, 8) output is in range (it was refused as row 31 of 4)."""
    flat_idx = np.array([[3], [10], [17], [31]], np.int32)
    vals = np.array([[1.0], [2.0], [3.0], [4.0]], F32)

    def k(idx_h, val_h, out):
        idx = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=idx_h)
        v = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=v, src=val_h)
        dst = out.reshape((32, 1)).ap(pattern=[[1, 4], [1, 1]], offset=0, vector_offset=idx, indirect_dim=0)
        nisa.dma_copy(dst=dst, src=v)

    out = np.zeros((4, 8), F32)
    simulate(k)(flat_idx, vals, out)
    want = np.zeros(32, F32)
    want[flat_idx[:, 0]] = vals[:, 0]
    np.testing.assert_array_equal(out.reshape(-1), want)


def test_vector_offset_rows_out_of_the_view_are_still_refused():
    def k(idx_h, out):
        idx = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=idx_h)
        v = nl.ndarray((2, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(v, 1.0)
        nisa.dma_copy(dst=out.reshape((32, 1)).ap(pattern=[[1, 2], [1, 1]], vector_offset=idx), src=v)

    rejects("dma-oob", k, np.array([[0], [32]], np.int32), np.zeros((4, 8), F32))


# ------------------------------------------------------------------------------------ §1 tile_size
TRN2_TILE_SIZE = {
    "pmax": 128,
    "gemm_stationary_fmax": 128,
    "gemm_moving_fmax": 512,
    "bn_stats_fmax": 512,
    "psum_bank_fmax": 512,
    "psum_bank_fmax_bytes": 2048,
    "psum_fmax": 512,
    "psum_num_banks": 8,
    "sbuf_size_bytes": 128 * 224 * 1024,
    "sbuf_fmax_bytes": 212984,
    "sbuf_fmax": 212984 // 4,
    "total_available_sbuf_size": 212984,
    "psum_min_align": 4,
    "sbuf_min_align": 1,
}


@pytest.mark.parametrize("attr", sorted(TRN2_TILE_SIZE))
def test_tile_size_values_on_trn2(attr):
    """nki.language.tile_size page: psum_fmax is per *bank* (fp32 elements), total_available_sbuf_size is the
    usable SBUF *per partition*; sbuf_size_bytes is the all-partition total."""
    assert getattr(nl.tile_size, attr) == TRN2_TILE_SIZE[attr]


def test_tile_size_values_on_trn3_and_psum_banks_with_pe_transposes(monkeypatch):
    with interpreter.target("trn3"):
        assert nl.tile_size.sbuf_fmax_bytes == nl.tile_size.total_available_sbuf_size == 256 * 1024 - 16392
        assert nl.tile_size.sbuf_size_bytes == 128 * 256 * 1024
        assert nl.tile_size.psum_fmax == 512
    monkeypatch.setenv("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "true")
    assert nl.tile_size.psum_num_banks == 7


# ------------------------------------------------------------------------------------ §2 truthiness
def test_a_tensor_is_truthy_but_its_values_are_not_readable_at_trace_time():
    def optional_bias(x, bias):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        if bias:  # an object: truthy, as in Python and the real front end
            b = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=b, src=bias)
            nisa.tensor_tensor(dst=t, data1=t, data2=b, op=nl.add)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    def reads_a_value(x):
        t = nl.ndarray(x.shape, nl.int32, buffer=nl.sbuf)
        return range(int(t))

    def compares(x):
        return x < 0

    x = np.ones((2, 3), F32)
    np.testing.assert_array_equal(simulate(optional_bias)(x, x), 2 * x)
    np.testing.assert_array_equal(simulate(optional_bias)(x, None), x)
    rejects("python-on-tensor", reads_a_value, x)
    rejects("python-on-tensor", compares, x)


# ------------------------------------------------------------------------------------ §2 outputs
def _two_outputs(as_list: bool):
    def k(x):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        a = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        b = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=a, src=t)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=b, src=t)
        return [a, b] if as_list else (a, b)

    return k


@pytest.mark.parametrize("as_list", [True, False])
def test_kernels_may_return_a_list_or_tuple_of_shared_hbm_tensors(as_list):
    x = np.arange(6, dtype=F32).reshape(2, 3)
    got = simulate(_two_outputs(as_list))(x)
    assert isinstance(got, list if as_list else tuple)
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_array_equal(got[1], 2 * x)


def test_a_list_output_with_a_private_hbm_tensor_is_refused():
    def k(x):
        return [nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm), nl.ndarray((2, 2), nl.float32, buffer=nl.hbm)]

    rejects("output-buffer", k, np.ones((1, 1), F32))


# ------------------------------------------------------------------------------------ §2 enums
def test_raw_documented_enum_integers_are_accepted_with_a_warning():
    """isa stub numbering: dge_mode.none = 3, engine.vector = 5, oob_mode.skip = 1, reduce_cmd.reset_reduce = 3."""

    def k(x):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, dge_mode=3, oob_mode=0)
        u = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t, engine=5)
        s = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(
            dst=u, data=u, op0=nl.multiply, operand0=1.0, reduce_op=nl.add, reduce_res=s, reduce_cmd=3
        )
        o = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=s)
        return o

    x = np.arange(6, dtype=F32).reshape(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = simulate(k)(x)
    np.testing.assert_array_equal(got[:, 0], x.sum(axis=1))
    msgs = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("dge_mode.none" in m for m in msgs) and any("engine.vector" in m for m in msgs)
    assert interpreter.last_run().cost.by_name["vector.tensor_copy"] == 1


@pytest.mark.parametrize("kwargs", [{"engine": 7}, {"engine": "vector"}, {"engine": True}])
def test_undocumented_enum_values_and_strings_are_refused(kwargs):
    def k(x):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_copy(dst=t, src=t, **kwargs)

    rejects("enum", k, np.ones((2, 2), F32))


def test_perf_mode_has_no_documented_numbering_so_integers_are_refused():
    def k(x):
        a = nl.ndarray((128, 2, 4), nl.float8_e4m3, buffer=nl.sbuf)
        nisa.memset(a, 1.0)
        d = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=a, moving=a, perf_mode=1)

    rejects("enum", k, np.ones((1, 1), F32))


# ------------------------------------------------------------------------------------ names
def test_public_names_exist():
    assert nisa.nc_version.gen4 > nisa.nc_version.gen3 >= nisa.nc_version.gen3 > nisa.nc_version.gen2
    assert nisa.get_nc_version() >= nisa.nc_version.gen3
    assert nisa.constants.engine.tensor is nisa.engine.tensor
    assert nisa.vector_engine is nisa.engine.vector and nisa.gpsimd_engine is nisa.engine.gpsimd
    assert {m.name for m in nisa.dma_engine} == {"dma", "gpsimd_dma"}
    assert nl.bool == nl.bool_

    class Cfg(nl.NKIObject):
        pass

    assert isinstance(Cfg(), nl.NKIObject)


def test_shared_constant_from_an_array_and_a_npy_file(tmp_path):
    table = np.arange(12, dtype=F32).reshape(3, 4)
    path = tmp_path / "table.npy"
    np.save(path, table)

    def k(x, src):
        c = nl.shared_constant(table if src == "array" else str(path))
        t = nl.ndarray((3, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=c)
        o = nl.ndarray((3, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    for src in ("array", "npy"):
        np.testing.assert_array_equal(simulate(k)(np.ones((1, 1), F32), src), table)
    with pytest.raises(NkiRuleError):
        simulate(lambda x: nl.shared_constant(str(tmp_path / "table.txt")))(np.ones((1, 1), F32))
