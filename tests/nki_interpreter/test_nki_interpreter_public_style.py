"""End to end: small kernels written the way public NKI kernels are (``import nki``, ``nki.language as nl``,
``nki.isa as nisa``, ``@nki.jit``, torch tensors in and out), run unmodified through the interpreter under
the public module names (``nki_interpreter.as_nki``) and compared with pure-torch references. Each exercises
a public-docs rule or instruction the interpreter models. (Written for this project; not copied from any public
kernel.)
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

from nki_interpreter import as_nki


@pytest.fixture()
def nki_api():
    with as_nki.installed():
        nki = importlib.import_module("nki")
        nl = importlib.import_module("nki.language")
        nisa = importlib.import_module("nki.isa")
        yield nki, nl, nisa
    assert "nki" not in sys.modules or not getattr(sys.modules["nki"], "__static_moe_interpreter__", False)


def test_router_top8_with_max8_and_find_index8(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def router_top8(logits):
        t, e = logits.shape
        x = nl.ndarray((t, e), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=logits)
        vals = nl.ndarray((t, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=vals, src=x)
        idx = nl.ndarray((t, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=x, vals=vals)
        idx_i = nl.ndarray((t, 8), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=idx_i, src=idx.view(nl.int32))
        out_v = nl.ndarray((t, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray((t, 8), dtype=nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_v, src=vals)
        nisa.dma_copy(dst=out_i, src=idx_i)
        return out_v, out_i

    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    v, i = router_top8(logits)
    ref = torch.topk(logits, 8, dim=1)
    torch.testing.assert_close(v, ref.values, rtol=0, atol=0)
    assert torch.equal(i.long(), ref.indices)


def test_rmsnorm_with_bn_stats_and_bn_aggr(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def rmsnorm(x, eps):
        t, h = x.shape
        xs = nl.ndarray((t, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=x)
        fmax = nl.tile_size.bn_stats_fmax
        n = h // fmax
        stats = nl.ndarray((t, 6 * n), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(n):
            nisa.bn_stats(dst=stats[:, 6 * j : 6 * (j + 1)], data=xs[:, fmax * j : fmax * (j + 1)])
        mv = nl.ndarray((t, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=stats)
        # mean(x²) = var + mean²
        ms = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=ms, data=mv[:, 0:1], op0=nl.multiply, operand0=mv[:, 0:1], op1=nl.add, operand1=mv[:, 1:2]
        )
        inv = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=inv, op=nl.rsqrt, data=ms, bias=eps)
        y = nl.ndarray((t, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=xs, op0=nl.multiply, operand0=inv)
        out = nl.ndarray((t, h), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=y)
        return out

    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(1)) * 3
    ref = x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rmsnorm(x, 1e-6), ref, rtol=1e-5, atol=1e-5)


def test_gather_rows_and_scatter_add_back_like_an_expert_combine(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def combine(hidden, token_ids, out):
        n, h = hidden.shape
        ids = nl.ndarray((n, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ids, src=token_ids)
        y = nl.ndarray((n, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=y, src=hidden)
        nisa.tensor_scalar(dst=y, data=y, op0=nl.multiply, operand0=0.5)
        rows = out.ap(pattern=[[h, n], [1, h]], offset=0, vector_offset=ids, indirect_dim=0)
        nisa.dma_compute(dst=rows, srcs=(rows, y), reduce_op=nl.add)

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 32, generator=g)
    ids = torch.tensor([[4], [0], [7], [2], [5], [1]], dtype=torch.int32)
    out = torch.randn(8, 32, generator=g)
    ref = out.index_add(0, ids[:, 0].long(), 0.5 * hidden)
    combine(hidden, ids, out)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_slot_positions_with_tensor_tensor_scan_and_nonzero_with_count(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def positions(mask):
        p, t = mask.shape
        m = nl.ndarray((p, t), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=m, src=mask)
        ones = nl.ndarray((p, t), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        csum = nl.ndarray((p, t), dtype=nl.float32, buffer=nl.sbuf)  # running count: r = r·1 + m
        nisa.tensor_tensor_scan(dst=csum, data0=ones, data1=m, initial=0.0, op0=nl.multiply, op1=nl.add)
        nz = nl.ndarray((p, t + 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=nz, value=0)
        nisa.nonzero_with_count(dst=nz, src=m, index_offset=0, padding_val=-1)
        out_c = nl.ndarray((p, t), dtype=nl.float32, buffer=nl.shared_hbm)
        out_n = nl.ndarray((p, t + 1), dtype=nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_c, src=csum)
        nisa.dma_copy(dst=out_n, src=nz)
        return [out_c, out_n]  # a list of outputs

    mask = (torch.rand(32, 24, generator=torch.Generator().manual_seed(3)) > 0.6).float()
    c, n = positions(mask)
    torch.testing.assert_close(c, torch.cumsum(mask, dim=1), rtol=0, atol=0)
    for p in (0, 16):  # the GpSimd cores' first partitions
        nz = torch.nonzero(mask[p]).flatten().int()
        assert int(n[p, -1]) == nz.numel()
        assert torch.equal(n[p, : nz.numel()], nz) and (n[p, nz.numel() : -1] == -1).all()


def test_quadrant_moves_and_stream_shuffle_broadcast(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def add_row_bias(x, bias_row, use_bias):
        t, h = x.shape
        xs = nl.ndarray((128, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs[96 : 96 + t, :], src=x)  # tokens parked in the last quadrant
        b1 = nl.ndarray((32, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=b1[0:1, :], src=bias_row)
        bb = nl.ndarray((32, h), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=bb, src=b1, shuffle_mask=[0] * 32)  # partition 0 → all 32
        y = nl.ndarray((32, h), dtype=nl.float32, buffer=nl.sbuf)
        if use_bias:
            # cross-quadrant read: rows 96..96+t into rows 0..t (n ≤ 32, starts 96 and 0)
            nisa.tensor_tensor(
                dst=y[0:t, :], data1=xs[96 : 96 + t, :], data2=bb[0:t, :], op=nl.add, engine=5
            )  # a raw engine number, as older kernels pass: warned, accepted
        else:
            nisa.tensor_copy(dst=y[0:t, :], src=xs[96 : 96 + t, :])
        out = nl.ndarray((t, h), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=y[0:t, :])
        return out

    g = torch.Generator().manual_seed(4)
    x, bias = torch.randn(20, 16, generator=g), torch.randn(1, 16, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.testing.assert_close(add_row_bias(x, bias, True), x + bias, rtol=0, atol=0)
    torch.testing.assert_close(add_row_bias(x, bias, False), x, rtol=0, atol=0)


def test_transpose_modes_agree_with_torch(nki_api):
    nki, nl, nisa = nki_api

    @nki.jit
    def transposes(x):
        p, f = x.shape
        xs = nl.ndarray((p, f), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=x)
        eye = nl.shared_identity_matrix(p, dtype=nl.bfloat16)
        ps = nl.ndarray((f, p), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=xs, moving=eye, is_transpose=True)
        a = nl.ndarray((f, p), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a, src=ps)
        b = nl.ndarray((f, p), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=b, src=x)
        oa = nl.ndarray((f, p), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        ob = nl.ndarray((f, p), dtype=nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=oa, src=a)
        nisa.dma_copy(dst=ob, src=b)
        return oa, ob

    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(5)).bfloat16()
    x[1, 2] = float("nan")
    a, b = transposes(x)
    assert torch.equal(a.view(torch.int16), x.T.contiguous().view(torch.int16))
    assert torch.equal(b.view(torch.int16), x.T.contiguous().view(torch.int16))


def test_config_objects_tolerate_missing_annotated_fields(nki_api):
    """Released nki-library kernels build their nl.NKIObject dataclasses without every annotated field
    (mlp_tkg_constants' MLPTKGConstantsDimensionSizes without remainderIFused): the field reads None."""
    from dataclasses import dataclass, field

    nl = nki_api[1]

    @dataclass
    class Dims(nl.NKIObject):
        rows: int
        tail: int
        extra: list = field(default_factory=list)

    d = Dims(rows=4)
    assert d.rows == 4 and d.tail is None and d.extra == []
    assert Dims(4, 2).tail == 2


def test_nki_dtype_module_and_legacy_neuronxcc_names(nki_api):
    """``from nki.dtype import float8_e4m3fn_x4`` and ``dtype: nki.dtype`` (nki-library), and the legacy
    ``neuronxcc.nki`` / ``neuronxcc.nki.typing`` imports of older public kernels, over the same interpreter."""
    nki, nl = nki_api[0], nki_api[1]
    dtypes = importlib.import_module("nki.dtype")
    assert dtypes.float8_e4m3fn_x4 is nl.float8_e4m3fn_x4 and dtypes.bfloat16 is nl.bfloat16
    assert nki.dtype is dtypes
    nt = importlib.import_module("neuronxcc.nki.typing")
    legacy = importlib.import_module("neuronxcc.nki")
    assert legacy.language is nl and nt.tensor[128, 512] is nt.tensor and nt.mutable_tensor is not nt.tensor

    def annotated(x: nt.tensor, dtype: nki.dtype = nl.bfloat16):  # annotations evaluate at def time
        return dtype

    assert annotated(None) is nl.bfloat16


def test_legacy_names_are_removed_after_the_block():
    with as_nki.installed():
        importlib.import_module("neuronxcc.nki.language")
    assert "neuronxcc" not in sys.modules and "nki.dtype" not in sys.modules
