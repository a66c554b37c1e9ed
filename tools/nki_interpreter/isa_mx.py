"""trn3 (NeuronCore-v4) MX instructions: ``quantize_mx`` and ``nc_matmul_mx`` (isa stub; Trainium3
architecture guide, "Quad-MXFP8/MXFP4 Matmul Performance" and "MX data-type Quantization"). Not on trn2
(refused as ``target``).

Layouts (the guide's figures, in words):

- Data: an x4 element ``t[p, m]`` packs four values ``j = 0..3`` that lie along the contraction dim; the
  contraction runs over (partition p, j), so K = 4 · partitions (512 for 128 partitions). quantize_mx keeps the
  source layout: value j of ``dst[p, m]`` is ``src[p, 4m + j]``.
- Scale groups: 32 values = 8 partitions × the 4 packed values of one x4 element share one E8M0 scale (a uint8
  byte ``e``, value ``2^(e − 127)``, 0xFF = NaN). The scale of data partition ``p`` and column ``m`` sits at
  partition ``32·(p // 32) + (p % 32) // 8``, column m of the scale tile: each 32-partition quadrant keeps its
  4 scale rows at its start (rows 32c … 32c+3), the other 28 rows are unused.
- quantize_mx scale choice (OCP MX v1.0, the spec the stub cites): ``e = floor(log2(max |v|)) − emax + 127``
  with emax = 8 (e4m3fn) or 15 (e5m2); values are divided by ``2^(e − 127)``, clamped to the element's max
  normal (448 / 57344) and rounded to nearest even. ASSUMPTION (the stub does not say): an all-zero group gets
  ``e = 0`` and NaN inputs are not modelled (refused).
- nc_matmul_mx: ``dst[M, N] (+)= Σ_{p, j} st[p, m, j] · s_st(p, m) · mv[p, n, j] · s_mv(p, n)``, accumulated in
  fp32 (dst fp32 or bf16, rounded on write); MXFP8 × MXFP4 mixes are allowed. ASSUMPTION: the order of the
  hardware's internal accumulation is not documented; fp64 sums rounded once model it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import dtypes as dt
from .errors import NkiRuleError, check
from .isa import (
    PSUM_FRESH,
    PSUM_MM,
    PSUM_OTHER,
    NkiTensor,
    _elem_addrs,
    _f32,
    _onchip,
    _raw,
    _record,
    _tensor_cycles,
)
from .state import current

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float64)
_EMAX = {dt.float8_e4m3fn: 8, dt.float8_e5m2: 15}


def _target(instr: str) -> None:
    check(
        current().spec.mx,
        "target",
        f"nisa.{instr} is available only on NeuronCore-v4 (trn3); the target is {current().spec.name}",
    )


def decode_x4(t: NkiTensor) -> np.ndarray:
    """[P, F, 4] float64 values of an x4 tile (value j of each element last)."""
    raw = np.ascontiguousarray(_raw(t))
    if t.dtype == dt.float4_e2m1fn_x4:
        bits = raw.view(np.uint16).astype(np.int64)
        nib = np.stack([(bits >> (4 * j)) & 0xF for j in range(4)], axis=-1)
        mag = _E2M1[nib & 7]
        return np.where(nib & 8, -mag, mag)
    elem = dt.X4_ELEMENT[t.dtype]
    b = raw.view(np.uint8).reshape(raw.shape[0], -1, 4)
    return b.view(elem).astype(np.float64).reshape(raw.shape[0], -1, 4)


def _scale_rows(p: int) -> np.ndarray:
    return 32 * (np.arange(p) // 32) + (np.arange(p) % 32) // 8


def _scales(s: NkiTensor, p: int, cols: int, what: str, instr: str) -> np.ndarray:
    """[p, cols] float64 scale of each data partition and column, from an E8M0 (uint8) scale tile."""
    check(s.dtype == dt.uint8, "operand-dtype", f"{instr}: {what} must be uint8 (E8M0 bytes), got {dt.name(s.dtype)}")
    rows = _scale_rows(p)
    check(
        s.shape[0] > int(rows.max()),
        "shape-mismatch",
        f"{instr}: {what} needs {int(rows.max()) + 1} partitions for {p} data partitions (4 per quadrant)",
    )
    check(s._free_size == cols, "shape-mismatch", f"{instr}: {what} has {s._free_size} columns, data has {cols}")
    e = _raw(s).astype(np.int64)[rows]
    return np.where(e == 255, np.nan, np.exp2(e.astype(np.float64) - 127.0))


def quantize_mx(dst, src, dst_scale, name=None):
    """VectorE: bf16/fp16 ``src [P, F]`` → MXFP8 ``dst [P, F/4]`` (float8_e4m3fn_x4 / float8_e5m2_x4) and E8M0
    ``dst_scale`` (uint8) in the layout nc_matmul_mx consumes (module docstring). P a multiple of 32 (≤ 128),
    F a multiple of 4; all in SBUF."""
    instr = "quantize_mx"
    _target(instr)
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    x = _onchip(src, "src", instr, allow_psum=False)
    sc = _onchip(dst_scale, "dst_scale", instr, allow_psum=False)
    check(
        x.dtype in (dt.bfloat16, dt.float16),
        "operand-dtype",
        f"{instr}: src must be bf16 or fp16, got {dt.name(x.dtype)}",
    )
    check(
        dst.dtype in (dt.float8_e4m3fn_x4, dt.float8_e5m2_x4),
        "operand-dtype",
        f"{instr}: dst must be float8_e4m3fn_x4 or float8_e5m2_x4, got {dt.name(dst.dtype)}",
    )
    check(sc.dtype == dt.uint8, "operand-dtype", f"{instr}: dst_scale must be uint8, got {dt.name(sc.dtype)}")
    p, f = x.shape[0], x._free_size
    check(
        p % 32 == 0 and p <= 128, "shape-mismatch", f"{instr}: src partitions must be a multiple of 32, ≤ 128, got {p}"
    )
    check(f % 4 == 0, "shape-mismatch", f"{instr}: src free size must be a multiple of 4, got {f}")
    check(
        dst.shape[0] == p and dst._free_size == f // 4,
        "shape-mismatch",
        f"{instr}: dst must be [{p}, {f // 4}] x4 elements, got {list(dst.shape)}",
    )
    check(
        sc.shape[0] >= 32 * (p // 32 - 1) + 4 and sc._free_size == f // 4,
        "shape-mismatch",
        f"{instr}: dst_scale must cover 4 rows per quadrant and {f // 4} columns, got {list(sc.shape)}",
    )
    check(dst._pstart == x._pstart, "cross-partition", f"{instr}: dst and src must start on the same partition")
    v = _f32(x).astype(np.float64).reshape(p, f // 4, 4)
    check(bool(np.isfinite(v).all()), "operand", f"{instr}: non-finite inputs are not modelled")
    elem = dt.X4_ELEMENT[dst.dtype]
    amax = np.abs(v.reshape(p // 8, 8, f // 4, 4)).max(axis=(1, 3))  # [groups, cols]
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - _EMAX[elem] + 127, 0)
    e = np.clip(e, 0, 254).astype(np.int64)
    scale = np.exp2(np.repeat(e, 8, axis=0).astype(np.float64) - 127.0)[:, :, None]  # [p, cols, 1]
    top = float(ml_dtypes.finfo(elem).max)
    q = np.clip(v / scale, -top, top).astype(np.float32).astype(elem)
    dst._np().view(np.uint8)[...] = q.view(np.uint8).reshape(dst._np().view(np.uint8).shape)
    cur = _raw(sc).copy()
    rows = 32 * (np.arange(p // 8) // 4) + np.arange(p // 8) % 4
    cur[rows] = e.astype(np.uint8)
    sc._np()[...] = cur.reshape(sc.shape)
    _record("vector", instr, x, (x,), cycles=f / 4)  # "four input elements per partition per cycle" (T3)


def nc_matmul_mx(
    dst,
    stationary,
    moving,
    stationary_scale,
    moving_scale,
    tile_position=None,
    tile_size=None,
    accumulate=None,
    name=None,
):
    """TensorE MX matmul (module docstring). stationary [K_p, M] and moving [K_p, N] x4 tiles in SBUF (K_p a
    multiple of 32, ≤ 128; M even, ≤ 128; N ≤ 512 for an fp32 dst, ≤ 1024 for bf16), uint8 scale tiles in SBUF,
    dst [M, N] in PSUM (fp32 or bf16). ``accumulate`` as in nc_matmul. Runs at 4× the bf16 rate (T3): the
    512-deep contraction costs one moving pass."""
    instr = "nc_matmul_mx"
    _target(instr)
    for what, t in (
        ("stationary", stationary),
        ("moving", moving),
        ("stationary_scale", stationary_scale),
        ("moving_scale", moving_scale),
    ):
        _onchip(t, what, instr, allow_psum=False)
    dst = _onchip(dst, "dst", instr)
    check(dst.buffer.name == "psum", "matmul-dst-psum", f"{instr}: dst must be in PSUM")
    check(dst.dtype in (dt.float32, dt.bfloat16), "matmul-dst-dtype", f"{instr}: dst must be fp32 or bf16")
    st, mv = stationary, moving
    for what, t in (("stationary", st), ("moving", mv)):
        check(
            dt.is_x4(t.dtype),
            "matmul-dtype",
            f"{instr}: {what} must be float8_e5m2_x4, float8_e4m3fn_x4 or float4_e2m1fn_x4, got {dt.name(t.dtype)}",
        )
    kp, m, n = st.shape[0], st._free_size, mv._free_size
    check(
        mv.shape[0] == kp and kp % 32 == 0 and kp <= 128,
        "matmul-shape",
        f"{instr}: stationary and moving partitions must match, be a multiple of 32 and ≤ 128 ({kp}, {mv.shape[0]})",
    )
    check(st._pstart == mv._pstart, "cross-partition", f"{instr}: stationary and moving start on different partitions")
    check(m % 2 == 0 and m <= 128, "matmul-limits", f"{instr}: stationary free size must be even and ≤ 128, got {m}")
    nmax = 512 if dst.dtype == dt.float32 else 1024
    check(n <= nmax, "matmul-limits", f"{instr}: moving free size {n} > {nmax} for a {dt.name(dst.dtype)} dst")
    check(
        dst.shape[0] == m and dst._free_size == n,
        "matmul-shape",
        f"{instr}: dst must be [{m}, {n}], got {list(dst.shape)}",
    )
    if tile_position or tile_size:
        raise NkiRuleError("not-modelled", f"{instr}: row tiling (tile_position / tile_size) is not modelled")
    a = decode_x4(st) * _scales(stationary_scale, kp, m, "stationary_scale", instr)[:, :, None]
    b = decode_x4(mv) * _scales(moving_scale, kp, n, "moving_scale", instr)[:, :, None]
    prod = np.einsum("pmj,pnj->mn", a, b)
    state = dst.storage.psum_state
    idx = (_elem_addrs(dst) // 4).reshape(-1)
    cur = state[idx]
    acc = bool(np.all(cur == PSUM_MM)) if accumulate is None else bool(accumulate)
    if acc:
        check(
            not np.any(cur == PSUM_FRESH) and not np.any(cur == PSUM_OTHER),
            "psum-accumulate-uninitialized",
            f"{instr}: accumulating onto PSUM that no matmul wrote is undefined",
        )
        prod = _raw(dst).astype(np.float64) + prod
    dst._np()[...] = prod.astype(np.float32).astype(dst.dtype).reshape(dst.shape)
    state[idx] = PSUM_MM
    current().cost.instr("tensor", instr, m, n, _tensor_cycles(n, m, False))
    current().cost.matmul_flops += 2 * 4 * kp * m * n
