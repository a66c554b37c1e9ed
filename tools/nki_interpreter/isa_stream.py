"""VectorE instructions that stream along the free dim or across a quadrant: ``tensor_tensor_scan``,
``bn_stats`` / ``bn_aggr`` and ``nc_stream_shuffle``. Semantics and limits: the aws-neuron-sdk isa stub
(``nki/api/nki/isa/__init__.py``), one docstring per instruction below.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .errors import check
from .isa import (
    NkiTensor,
    _apply_arith,
    _check_op,
    _f32,
    _lanes,
    _onchip,
    _raw,
    _record,
    _same_free,
    _store_raw,
    _store_values,
)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """VectorE scan along the (flattened) free dim, per partition, in fp32:
    ``r[0] = op1(op0(data0[0], initial), data1[0])``, ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])``.
    ``reverse0`` makes data0 the rhs of op0, ``reverse1`` makes data1 the lhs of op1. ``initial``: an fp32
    compile-time scalar or a (P, 1) tile. data0 and data1 not both in PSUM. Cost ~2N (two inputs)."""
    instr = "tensor_tensor_scan"
    dst, a, b = _onchip(dst, "dst", instr), _onchip(data0, "data0", instr), _onchip(data1, "data1", instr)
    op0 = _check_op(op0, instr, "op0", ("arith",))
    op1 = _check_op(op1, instr, "op1", ("arith",))
    check(
        not (a.buffer.name == "psum" and b.buffer.name == "psum"),
        "psum-operands",
        f"{instr}: data0 and data1 cannot both be in PSUM",
    )
    _lanes(instr, dst, data0=a, data1=b)
    _same_free(instr, dst, data0=a, data1=b)
    if isinstance(initial, NkiTensor):
        _onchip(initial, "initial", instr)
        check(initial._free_size == 1, "operand-shape", f"{instr}: initial must be a scalar or a (P, 1) tile")
        _lanes(instr, dst, initial=initial)
        carry = _f32(initial).reshape(-1)
    else:
        check(
            isinstance(initial, (int, float, np.integer, np.floating)),
            "operand",
            f"{instr}: initial must be a compile-time number or a (P, 1) tile, got {initial!r}",
        )
        carry = np.full(dst.shape[0], np.float32(initial), np.float32)
    va, vb = _f32(a), _f32(b)
    out = np.empty_like(va)
    for i in range(va.shape[1]):
        t = _apply_arith(op0, carry, va[:, i], reverse=not reverse0)  # data0 is the lhs unless reversed
        carry = _apply_arith(op1, t, vb[:, i], reverse=reverse1)
        out[:, i] = carry
    _store_values(dst, out, instr)
    _record("vector", instr, dst, (a, b))


def bn_stats(dst, data, name=None):
    """VectorE per-partition statistics of ``data`` (≤ ``nl.tile_size.bn_stats_fmax`` = 512 elements per
    partition), in fp32: six values per partition — count, mean, variance·count of the even-indexed elements,
    then the same of the odd-indexed ones. Feed one or more of them to :func:`bn_aggr`."""
    instr = "bn_stats"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    _lanes(instr, dst, data=x)
    check(
        x._free_size <= 512,
        "free-size",
        f"{instr}: data has {x._free_size} elements per partition; at most 512 (nl.tile_size.bn_stats_fmax)",
    )
    check(
        dst._free_size == 6, "shape-mismatch", f"{instr}: dst holds 6 statistics per partition, got {list(dst.shape)}"
    )
    v = _f32(x).astype(np.float64)
    cols = []
    for part in (v[:, 0::2], v[:, 1::2]):
        n = part.shape[1]
        mean = part.mean(axis=1) if n else np.zeros(v.shape[0])
        m2 = ((part - mean[:, None]) ** 2).sum(axis=1) if n else np.zeros(v.shape[0])
        cols += [np.full(v.shape[0], float(n)), mean, m2]
    _store_values(dst, np.stack(cols, axis=1).astype(np.float32), instr)
    _record("vector", instr, dst, (x,), cycles=x._free_size)


def bn_aggr(dst, data, name=None):
    """VectorE: combine ``(count, mean, variance·count)`` triples (bn_stats outputs, so the elements per
    partition are a multiple of 3) into the mean and the (population) variance of all counted elements."""
    instr = "bn_aggr"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    _lanes(instr, dst, data=x)
    check(
        x._free_size % 3 == 0,
        "shape-mismatch",
        f"{instr}: data holds (count, mean, variance·count) triples; "
        f"{x._free_size} elements per partition is not a multiple of 3",
    )
    check(dst._free_size == 2, "shape-mismatch", f"{instr}: dst holds mean and variance, got {list(dst.shape)}")
    t = _f32(x).astype(np.float64).reshape(x.shape[0], -1, 3)
    cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    total = cnt.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    mu = (cnt * mean).sum(axis=1) / safe
    var = (m2 + cnt * (mean - mu[:, None]) ** 2).sum(axis=1) / safe
    _store_values(dst, np.stack([mu, var], axis=1).astype(np.float32), instr)
    _record("vector", instr, dst, (x,), cycles=x._free_size)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """VectorE cross-partition move within each 32-partition quadrant: output partition ``32q + i`` copies
    source partition ``32q + shuffle_mask[i]`` (255 leaves it unmodified); the same 32-entry mask applies to
    every quadrant. Bit-exact (dst.dtype == src.dtype), same elements per partition, in place allowed.
    Start partitions: with ``n = ceil(max(src, dst partitions) / 32) · 32`` active partitions, each start must
    be 0 (n = 96, 128), 0 or 64 (n = 64), or 0/32/64/96 (n = 32)."""
    instr = "nc_stream_shuffle"
    dst, s = _onchip(dst, "dst", instr), _onchip(src, "src", instr)
    mask = [int(m) for m in shuffle_mask]
    check(len(mask) == 32, "shuffle-mask", f"{instr}: shuffle_mask has {len(mask)} entries, expected 32")
    check(
        all(0 <= m < 32 or m == 255 for m in mask),
        "shuffle-mask",
        f"{instr}: shuffle_mask entries are source partitions 0..31 within the quadrant or 255 (keep)",
    )
    check(
        dst.dtype == s.dtype,
        "dtype-mismatch",
        f"{instr}: dst dtype {dt.name(dst.dtype)} must equal src dtype {dt.name(s.dtype)}",
    )
    _same_free(instr, dst, src=s)
    active = -(-max(s.shape[0], dst.shape[0]) // 32) * 32
    legal = (0,) if active > 64 else ((0, 64) if active > 32 else (0, 32, 64, 96))
    for what, t in (("src", s), ("dst", dst)):
        check(
            t._pstart in legal,
            "cross-partition",
            f"{instr}: {what} starts at partition {t._pstart}; with "
            f"{active} active partitions the start must be one of {legal}",
        )
    src_rows, cur = _raw(s), _raw(dst)
    out = cur.copy()
    for q in range(active // 32):
        for i, m in enumerate(mask):
            di, si = 32 * q + i, 32 * q + m
            if m == 255 or di >= dst.shape[0]:
                continue
            check(
                si < s.shape[0],
                "shuffle-mask",
                f"{instr}: output partition {di} reads source partition {si}, but src spans {s.shape[0]} partitions",
            )
            out[di] = src_rows[si]
    _store_raw(dst, out)
    _record("vector", instr, dst, (s,))
