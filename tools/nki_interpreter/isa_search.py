"""Selection, search and gather instructions: ``affine_select``, ``range_select``, ``max8``,
``nc_find_index8``, ``nc_match_replace8``, ``nonzero_with_count``, ``nc_n_gather``, ``local_gather``,
``select_reduce`` and ``tensor_scalar_cumulative`` (the top-k and
token-skipping building blocks of public decode MoE kernels). Semantics and limits: the aws-neuron-sdk isa
stub (``nki/api/nki/isa/__init__.py``), one docstring per instruction below.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from . import ops as O
from .errors import NkiRuleError, check
from .isa import (
    NkiTensor,
    _accumulate,
    _cast,
    _check_op,
    _enum,
    _f32,
    _lanes,
    _onchip,
    _raw,
    _record,
    _reduce_op,
    _same_free,
    _store_raw,
    _store_values,
)
from .isa import reduce_cmd as RC
from .state import current

FP32_MIN = float(np.finfo(np.float32).min)
_CMP = ("equal", "less", "less_equal", "greater", "greater_equal")


def _affine(dst: NkiTensor, pattern, offset, channel_multiplier, instr: str) -> np.ndarray:
    """The iota-style affine values [P, F] (int64) of ``pattern`` (≤ 4 [step, num] pairs)."""
    pattern = [tuple(int(v) for v in p) for p in pattern]
    check(1 <= len(pattern) <= 4, instr, f"{instr}: pattern has {len(pattern)} dims; 1 to 4 allowed")
    n = int(np.prod([c for _, c in pattern]))
    check(n == dst._free_size, instr, f"{instr}: pattern covers {n} elements, dst has {dst._free_size} per partition")
    v = np.full((), int(offset), np.int64)
    for step, cnt in pattern:
        v = v[..., None] + np.arange(cnt, dtype=np.int64) * step
    lanes = np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    return v.reshape(1, -1) + lanes


def _select_into(
    dst: NkiTensor, src: NkiTensor, mask: np.ndarray, false_value: float, instr: str, overflow_to_inf: bool = False
) -> None:
    """dst = where(mask, src, false_value): selected elements bit-exact when the dtypes agree (through fp32
    otherwise), the false value cast to dst's dtype."""
    if src.dtype == dst.dtype:
        picked = _raw(src)
    else:
        picked = _cast(_f32(src), dst.dtype, instr)
    with np.errstate(over="ignore"):
        fill = (
            np.asarray(np.float32(false_value)).astype(dst.dtype)
            if overflow_to_inf
            else _cast(np.full((1, 1), false_value, np.float32), dst.dtype, instr)
        )
    _store_raw(dst, np.where(mask, picked, np.broadcast_to(fill, picked.shape).astype(dst.dtype)))


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=O.equal, offset=0, name=None):
    """GpSimd: ``dst = on_true_tile`` where ``cmp_op(offset + partition·channel_multiplier + Σ idx·step, 0)``,
    else the fp32 scalar ``on_false_value`` (e.g. a causal mask). dst and on_true_tile in SBUF."""
    instr = "affine_select"
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    t = _onchip(on_true_tile, "on_true_tile", instr, allow_psum=False)
    op = _check_op(cmp_op, instr, "cmp_op", ("arith",))
    _lanes(instr, dst, on_true_tile=t)
    _same_free(instr, dst, on_true_tile=t)
    check(
        isinstance(on_false_value, (int, float, np.integer, np.floating)),
        "operand",
        f"{instr}: on_false_value must be a compile-time float, got {on_false_value!r}",
    )
    aff = _affine(dst, pattern, offset, channel_multiplier, instr).astype(np.float64)
    mask = np.asarray(op.fn(aff, 0.0)) != 0
    _select_into(dst, t, mask, float(on_false_value), instr)
    _record("gpsimd", instr, dst, (t,))


def range_select(
    dst,
    on_true_tile,
    comp_op0,
    comp_op1,
    bound0,
    bound1,
    reduce_cmd=RC.reset_reduce,
    reduce_res=None,
    reduce_op=O.maximum,
    range_start=0,
    on_false_value=FP32_MIN,
    name=None,
):
    """VectorE (NeuronCore-v3+): keep ``on_true_tile[p, i]`` where ``comp_op0(range_start + i, bound0[p])``
    and ``comp_op1(range_start + i, bound1[p])`` (fp32 compares), else ``on_false_value`` (must be FP32_MIN;
    it becomes −inf in a narrower float dst, as the stub's numerical-stability note says), and max-reduce the
    result into the VectorE accumulators (``reduce_cmd``) and ``reduce_res``."""
    instr = "range_select"
    rc = RC
    dst = _onchip(dst, "dst", instr)
    t = _onchip(on_true_tile, "on_true_tile", instr)
    check(dt.is_float(t.dtype), "operand-dtype", f"{instr}: on_true_tile must be a float dtype, got {dt.name(t.dtype)}")
    ops = [_check_op(o, instr, w, ("arith",)) for o, w in ((comp_op0, "comp_op0"), (comp_op1, "comp_op1"))]
    check(all(o.name in _CMP for o in ops), "op", f"{instr}: comparisons must be one of {_CMP}")
    check(_reduce_op(reduce_op) is O.maximum, "op", f"{instr}: reduce_op must be nl.maximum (the only one supported)")
    check(
        on_false_value == FP32_MIN,
        "operand",
        f"{instr}: on_false_value must be FP32_MIN ({FP32_MIN}), got {on_false_value!r} (hardware constraint)",
    )
    check(isinstance(range_start, (int, np.integer)), "operand", f"{instr}: range_start must be a compile-time int")
    cmd = _enum(reduce_cmd, rc, "reduce_cmd")
    bounds = []
    for what, b in (("bound0", bound0), ("bound1", bound1)):
        b = _onchip(b, what, instr)
        check(
            b._free_size == 1 and b.dtype == dt.float32,
            "operand-shape",
            f"{instr}: {what} must be a (P, 1) float32 tile, got {dt.name(b.dtype)}{list(b.shape)}",
        )
        _lanes(instr, dst, **{what: b})
        bounds.append(_f32(b))
    _lanes(instr, dst, on_true_tile=t)
    _same_free(instr, dst, on_true_tile=t)
    idx = (int(range_start) + np.arange(t._free_size, dtype=np.float64))[None, :].astype(np.float32)
    mask = (np.asarray(ops[0].fn(idx, bounds[0])) != 0) & (np.asarray(ops[1].fn(idx, bounds[1])) != 0)
    _select_into(dst, t, mask, FP32_MIN, instr, overflow_to_inf=True)
    picked = np.where(mask, _f32(t), np.float32(FP32_MIN))
    if cmd != rc.idle:
        acc = _accumulate("vector", dst, picked.max(axis=1), "maximum", cmd, None)
        if reduce_res is not None:
            rr = _onchip(reduce_res, "reduce_res", instr)
            check(rr._free_size == 1, "operand-shape", f"{instr}: reduce_res must be (P, 1)")
            _lanes(instr, dst, reduce_res=rr)
            _store_values(rr, acc.reshape(-1, 1), instr)
    _record("vector", instr, dst, (t,))


def _top8_input(x: NkiTensor, instr: str) -> np.ndarray:
    check(
        8 <= x._free_size <= 16384, "free-size", f"{instr}: {x._free_size} elements per partition; 8 to 16384 allowed"
    )
    check(x.ndim <= 3, "shape", f"{instr}: data is at most 3-D, got {list(x.shape)}")
    return _f32(x)


def max8(dst, src, name=None):
    """VectorE: the 8 largest values of each partition (8 to 16384 elements, up to 3-D), descending, in fp32,
    cast to dst.dtype; dst is [P, 8]."""
    instr = "max8"
    dst, x = _onchip(dst, "dst", instr), _onchip(src, "src", instr)
    _lanes(instr, dst, src=x)
    check(dst._free_size == 8, "shape-mismatch", f"{instr}: dst must be [P, 8], got {list(dst.shape)}")
    v = _top8_input(x, instr)
    _store_values(dst, -np.sort(-v, axis=1, kind="stable")[:, :8], instr)
    _record("vector", instr, dst, (x,), cycles=x._free_size)


def _find_first(v: np.ndarray, vals: np.ndarray, instr: str) -> np.ndarray:
    """[P, 8] index of the first not-yet-taken occurrence of each value (repeated values take successive
    occurrences, so max8 followed by match_replace8 removes duplicates one by one)."""
    out = np.zeros(vals.shape, np.int64)
    for p in range(v.shape[0]):
        taken = np.zeros(v.shape[1], bool)
        for j, val in enumerate(vals[p]):
            hits = np.flatnonzero((v[p] == val) & ~taken)
            check(
                hits.size > 0,
                "value-not-found",
                f"{instr}: partition {p} has no (further) element equal to "
                f"{val!r}; the result is undefined on hardware",
            )
            out[p, j] = hits[0]
            taken[hits[0]] = True
    return out


def _vals8(vals, dst: NkiTensor, instr: str) -> np.ndarray:
    vals = _onchip(vals, "vals", instr)
    check(vals._free_size == 8, "shape-mismatch", f"{instr}: vals holds 8 values per partition, got {list(vals.shape)}")
    _lanes(instr, dst, vals=vals)
    return _f32(vals)


def nc_find_index8(dst, data, vals, name=None):
    """VectorE: per partition, the index (from 0) of the first occurrence in ``data`` of each of the 8
    ``vals``; dst [P, 8] uint16 or uint32. A value absent from data is undefined on hardware: refused."""
    instr = "nc_find_index8"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    check(dst.dtype in (dt.uint16, dt.uint32), "operand-dtype", f"{instr}: dst must be uint16 or uint32")
    check(dst._free_size == 8, "shape-mismatch", f"{instr}: dst must be [P, 8], got {list(dst.shape)}")
    _lanes(instr, dst, data=x)
    v, want = _top8_input(x, instr), _vals8(vals, dst, instr)
    dst._np()[...] = _find_first(v, want, instr).astype(dst.dtype).reshape(dst.shape)
    _record("vector", instr, dst, (x,), cycles=x._free_size)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """VectorE: ``dst = data`` with the first occurrence of each of the 8 ``vals`` replaced by ``imm``; the
    indices go to ``dst_idx`` when given (iterated top-k: max8 → match_replace8 with −inf)."""
    instr = "nc_match_replace8"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    _lanes(instr, dst, data=x)
    _same_free(instr, dst, data=x)
    check(isinstance(imm, (int, float, np.integer, np.floating)), "operand", f"{instr}: imm must be a number")
    v, want = _top8_input(x, instr), _vals8(vals, dst, instr)
    idx = _find_first(v, want, instr)
    out = v.copy()
    np.put_along_axis(out, idx, np.float32(imm), axis=1)
    _store_values(dst, out, instr)
    if dst_idx is not None:
        di = _onchip(dst_idx, "dst_idx", instr)
        check(
            di._free_size == 8 and dt.is_int(di.dtype),
            "shape-mismatch",
            f"{instr}: dst_idx must be an integer [P, 8] tile, got {dt.name(di.dtype)}{list(di.shape)}",
        )
        _lanes(instr, dst, dst_idx=di)
        di._np()[...] = idx.astype(di.dtype).reshape(di.shape)
    _record("vector", instr, dst, (x,))


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """GpSimd (NeuronCore-v3+): on partitions 0, 16, …, 112 only (each GpSimd core's first partition), write
    the indices (+ index_offset) of src's nonzero elements, then padding_val, then their count in the extra
    last element. src: SBUF float32/int32 [P, T]; dst: SBUF int32 [P, T + 1]; other partitions untouched."""
    instr = "nonzero_with_count"
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    x = _onchip(src, "src", instr, allow_psum=False)
    check(current().spec.name != "trn1", "target", f"{instr} needs NeuronCore-v3 or newer")
    check(
        x.dtype in (dt.float32, dt.int32),
        "operand-dtype",
        f"{instr}: src must be float32 or int32, got {dt.name(x.dtype)}",
    )
    check(dst.dtype == dt.int32, "operand-dtype", f"{instr}: dst must be int32, got {dt.name(dst.dtype)}")
    check(
        dst._free_size == x._free_size + 1,
        "shape-mismatch",
        f"{instr}: dst needs {x._free_size + 1} elements per partition (src's plus the count), got {dst._free_size}",
    )
    for what, v in (("index_offset", index_offset), ("padding_val", padding_val)):
        check(
            isinstance(v, (int, np.integer)) and -(2**31) <= int(v) < 2**31,
            "operand",
            f"{instr}: {what} must be an int32, got {v!r}",
        )
    _lanes(instr, dst, src=x)
    vals, out = _raw(x), _raw(dst).copy()
    for p in range(dst.shape[0]):
        if (dst._pstart + p) % 16:
            continue
        nz = np.flatnonzero(vals[p] != 0)
        row = np.full(x._free_size + 1, int(padding_val), np.int64)
        row[: nz.size] = nz + int(index_offset)
        row[-1] = nz.size
        out[p] = row.astype(np.int32)
    _store_raw(dst, out)
    _record("gpsimd", instr, dst, (x,))


def nc_n_gather(dst, data, indices, name=None):
    """GpSimd: per partition, ``dst[p] = data[p].flatten()[indices[p].flatten()]`` (bit-exact). All in SBUF;
    indices uint32 in ``[0, elements per partition of data)``; dst has data's dtype and indices' count."""
    instr = "nc_n_gather"
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    x = _onchip(data, "data", instr, allow_psum=False)
    ix = _onchip(indices, "indices", instr, allow_psum=False)
    check(ix.dtype == dt.uint32, "operand-dtype", f"{instr}: indices must be uint32, got {dt.name(ix.dtype)}")
    check(dst.dtype == x.dtype, "dtype-mismatch", f"{instr}: dst dtype must equal data's ({dt.name(x.dtype)})")
    _lanes(instr, dst, data=x, indices=ix)
    _same_free(instr, dst, indices=ix)
    idx = _raw(ix).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= x._free_size):
        raise NkiRuleError(
            "index", f"{instr}: indices must lie in [0, {x._free_size}), got [{int(idx.min())}, {int(idx.max())}]"
        )
    _store_raw(dst, np.take_along_axis(_raw(x), idx, axis=1))
    _record("gpsimd", instr, dst, (x, ix))


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd gather within each partition, with indices shared by the 16 partitions of each GpSimd core
    (isa stub, and the numpy semantics of its example test ``nki/test/test_nki_isa_local_gather.py``): for
    core c, ``idx = index[16c:16c+16].flatten(order="F")[:num_valid_indices]``; every partition p of that
    core gets, for each i in idx, the ``num_elem_per_idx`` contiguous elements of its own flattened free dim
    starting at element i. No dtype cast (dst.dtype == src dtype); index uint16; partitions a multiple of 16;
    num_elem_per_idx in 1, 2, 4, 8, 16, 32; at most 4096 indices per core. Out-of-range reads are undefined
    on hardware: refused."""
    instr = "local_gather"
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    x = _onchip(src_buffer, "src_buffer", instr, allow_psum=False)
    ix = _onchip(index, "index", instr, allow_psum=False)
    check(ix.dtype == dt.uint16, "operand-dtype", f"{instr}: index must be uint16, got {dt.name(ix.dtype)}")
    check(dst.dtype == x.dtype, "dtype-mismatch", f"{instr}: no dtype cast; dst must be {dt.name(x.dtype)}")
    p = x.shape[0]
    check(
        ix.shape[0] == p and p % 16 == 0,
        "shape-mismatch",
        f"{instr}: src_buffer and index need the same partition count, a multiple of 16 ({p}, {ix.shape[0]})",
    )
    ne = int(num_elem_per_idx)
    check(ne in (1, 2, 4, 8, 16, 32), "operand", f"{instr}: num_elem_per_idx must be 1, 2, 4, 8, 16 or 32")
    per_core = 16 * ix._free_size
    nv = per_core if num_valid_indices is None else int(num_valid_indices)
    check(
        0 < nv <= per_core and nv <= 4096,
        "operand",
        f"{instr}: num_valid_indices must be in [1, min({per_core}, 4096)], got {nv}",
    )
    check(
        dst.shape[0] == p and dst._free_size == nv * ne,
        "shape-mismatch",
        f"{instr}: dst needs [{p}, {nv * ne}] elements ({nv} indices × {ne}), got {list(dst.shape)}",
    )
    _lanes(instr, dst, src_buffer=x, index=ix)
    src, idx_all = _raw(x), _raw(ix).astype(np.int64)
    out = np.empty((p, nv * ne), src.dtype)
    for c in range(p // 16):
        idx = idx_all[16 * c : 16 * c + 16].flatten(order="F")[:nv]
        if idx.size and (idx.min() < 0 or idx.max() + ne > src.shape[1]):
            raise NkiRuleError(
                "index",
                f"{instr}: core {c} reads elements up to {int(idx.max()) + ne} of a {src.shape[1]}-element partition",
            )
        cols = (idx[:, None] + np.arange(ne)).reshape(-1)
        out[16 * c : 16 * c + 16] = src[16 * c : 16 * c + 16][:, cols]
    _store_raw(dst, out)
    _record("gpsimd", instr, dst, (x,))


def _accumulated_result(instr, dst, part, op_name, cmd, init, reduce_res):
    """Feed ``part`` [P] into the VectorE accumulators under ``cmd`` and read them out into reduce_res."""
    acc = _accumulate("vector", dst, part, op_name, cmd, init)
    if reduce_res is not None:
        rr = _onchip(reduce_res, "reduce_res", instr)
        check(rr._free_size == 1, "operand-shape", f"{instr}: reduce_res must be (P, 1), got {list(rr.shape)}")
        _lanes(instr, dst, reduce_res=rr)
        _store_values(rr, acc.reshape(-1, 1), instr)


def select_reduce(
    dst,
    predicate,
    on_true,
    on_false,
    reduce_res=None,
    reduce_cmd=RC.idle,
    reduce_op=O.maximum,
    reverse_pred=False,
    name=None,
):
    """VectorE ``dst = where(predicate (or not, reverse_pred), on_true, on_false)`` with an optional max into
    the VectorE accumulators (isa stub): predicate int8/uint8/int16/uint16; on_true any dtype but
    tfloat32/int32/uint32; on_false an fp32 scalar or a (P, 1) tile; on_true and predicate not both in PSUM."""
    instr = "select_reduce"
    dst, pred, t = (
        _onchip(dst, "dst", instr),
        _onchip(predicate, "predicate", instr),
        _onchip(on_true, "on_true", instr),
    )
    check(
        pred.dtype in (dt.int8, dt.uint8, dt.int16, dt.uint16),
        "predicate-dtype",
        f"{instr}: predicate must be int8/uint8/int16/uint16, got {dt.name(pred.dtype)}",
    )
    check(t.dtype not in (dt.int32, dt.uint32), "operand-dtype", f"{instr}: on_true cannot be int32/uint32")
    check(
        not (t.buffer.name == "psum" and pred.buffer.name == "psum"),
        "psum-operands",
        f"{instr}: on_true and predicate cannot both be in PSUM",
    )
    check(_reduce_op(reduce_op) is O.maximum, "op", f"{instr}: reduce_op must be nl.maximum")
    cmd = _enum(reduce_cmd, RC, "reduce_cmd")
    _lanes(instr, dst, predicate=pred, on_true=t)
    _same_free(instr, dst, predicate=pred, on_true=t)
    if isinstance(on_false, NkiTensor):
        f = _onchip(on_false, "on_false", instr)
        check(f._free_size == 1, "operand-shape", f"{instr}: on_false must be a scalar or a (P, 1) tile")
        _lanes(instr, dst, on_false=f)
        fv = _f32(f)
    else:
        check(
            isinstance(on_false, (int, float, np.integer, np.floating)),
            "operand",
            f"{instr}: on_false must be an fp32 scalar or a (P, 1) tile, got {on_false!r}",
        )
        fv = np.float32(on_false)
    mask = _raw(pred) != 0
    if reverse_pred:
        mask = ~mask
    res = np.where(mask, _f32(t), fv).astype(np.float32)
    _store_values(dst, res, instr)
    if cmd != RC.idle or reduce_res is not None:
        _accumulated_result(
            instr, dst, res.max(axis=1), "maximum", RC.reset_reduce if cmd == RC.idle else cmd, None, reduce_res
        )
    _record("vector", instr, dst, (pred, t))


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=RC.reset_reduce, name=None):
    """VectorE running reduction along the free dim (isa stub pseudocode): ``reg`` starts from op1's identity
    (reset_reduce), the accumulators' current value (reduce) or ``imm1`` (load_reduce); then for each element
    ``reg = op1(op0(src[i], imm0), reg)`` and ``dst[i] = reg``. op1 ∈ add, subtract, multiply, maximum,
    minimum; imm0 / imm1 fp32 scalars or (P, 1) tiles; no int32/uint32 data."""
    instr = "tensor_scalar_cumulative"
    dst, x = _onchip(dst, "dst", instr), _onchip(src, "src", instr)
    op0 = _check_op(op0, instr, "op0", ("arith", "unary"))
    op1 = _check_op(op1, instr, "op1", ("arith",))
    check(
        op1.name in ("add", "subtract", "multiply", "maximum", "minimum"),
        "op",
        f"{instr}: op1 must be add / subtract / multiply / maximum / minimum, got nl.{op1.name}",
    )
    for what, t in (("src", x), ("dst", dst)):
        check(
            t.dtype not in (dt.int32, dt.uint32),
            "operand-dtype",
            f"{instr}: {what} cannot be int32/uint32 (ISA limitation)",
        )
    cmd = _enum(reduce_cmd, RC, "reduce_cmd")
    check(
        cmd in (RC.reset_reduce, RC.reduce, RC.load_reduce),
        "operand",
        f"{instr}: reduce_cmd must be reset_reduce, reduce or load_reduce",
    )
    _lanes(instr, dst, src=x)
    _same_free(instr, dst, src=x)
    from .isa import _apply_arith, _operand

    unary = "unary" in op0.kinds and "arith" not in op0.kinds
    v0 = None if unary else _operand(imm0, instr, "imm0", dst, True)
    t = _apply_arith(op0, _f32(x), v0, False)
    ident = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}[op1.name]
    acc = current().accumulators.setdefault("vector", np.zeros(128, np.float32))
    lanes = slice(dst._pstart, dst._pstart + dst.shape[0])
    if cmd == RC.reset_reduce:
        reg = np.full(dst.shape[0], ident, np.float32)
    elif cmd == RC.load_reduce:
        check(imm1 is not None, "operand", f"{instr}: load_reduce needs imm1")
        reg = np.broadcast_to(_operand(imm1, instr, "imm1", dst, True), (dst.shape[0], 1)).reshape(-1).copy()
    else:
        reg = acc[lanes].copy()
    out = np.empty_like(t)
    for i in range(t.shape[1]):
        reg = _apply_arith(op1, t[:, i], reg, False)
        out[:, i] = reg
    acc[lanes] = reg
    _store_values(dst, out, instr)
    _record("vector", instr, dst, (x,))
