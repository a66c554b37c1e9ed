"""NKI tile functions for expert GEMMs on the prepared, K-major ("EIO") weight layout — weights stationary,
tokens moving, no on-chip weight transpose.

    D^T[n, r] = bf16( Σ_k W[k, n] · A[r, k] )      (one 128-wide n block per call of :func:`gemm_block`)

Layouts (``python/static_moe/layouts.py``; format read from the dtype):

======== ================================= ====================================================================
format   EIO weight / scale                 how it reaches the TensorE (per target)
======== ================================= ====================================================================
bf16     bf16 ``[L, K, N]``                 stationary as DMA'd: ``[k, n]`` tiles, one PSUM group over all K
fp8      e4m3fn ``[L, K, N]``,              trn2: the bytes after ``reencode_fp8_for_trn2`` (every code has
         fp32 ``[L, K/128, N]``             exponent field ≤ 14) read as native ``float8_e4m3``; trn3: read as
                                            ``float8_e4m3fn``. Each 128-wide K block its own PSUM group; the
                                            weight scale ``s[kb, n]`` is applied on evacuation
fp8 MX   uint32 ``[L, K/4, N]``,            trn3 only. fp8 activations: ``nc_matmul_mx`` (MXFP8 × MXFP8, fp32
         UE8M0 ``[L, K/32, N]``             PSUM, one group over K). bf16 activations: decoded to bf16 (below)
fp4      uint16 ``[L, K/4, N]``,            trn3 + fp8 activations: ``nc_matmul_mx`` (MXFP8 moving × MXFP4
         UE8M0 ``[L, K/32, N]``             stationary, fp32 PSUM). Otherwise decoded to bf16 (below)
======== ================================= ====================================================================

"Decoded to bf16" (path ``quad_bf16``): a packed element ``[m, n]`` holds k = 4m … 4m+3, so the DMA puts m on
the partitions and each nibble / byte j forms its own ``[m, n]`` plane — the contraction of one matmul runs over
k = 512·mb + 4p + j (p the partition). The 1×32 UE8M0 scale of such a k is row ``16·mb + p // 8``, i.e. one
128-partition matmul spans 16 scale groups, so per-32 scales cannot be applied per PSUM group: they are folded
into the bf16 weight by one multiply (exact: an e2m1 / e4m3 value times a power of two; UE8M0 bytes ≤ 248 for
fp4, ≤ 240 for fp8 MX — larger ones overflow bf16 and are refused by the cast). The e2m1 → float8_e4m3 step is
pure bit work on VectorE (4 ``tensor_scalar`` per 32-bit word of 8 nibbles) plus two exact integer adds on
GpSimd; the fold runs ¾ on GpSimd, ¼ on VectorE. This path is decode-bound (about one VectorE cycle per weight,
see :data:`FOLD_VECTOR_PLANES`).

"Group path" (``quad_grp``, the same formats when a GEMM call has ≤ ``GROUP_PATH_MAX_ROWS`` moving rows, 4 for
fp4 and 8 for fp8 MX): no fold. The planes stay fp8 (e2m1 → float8_e4m3 bytes by the bit decode alone; fp8 MX bytes as they are) and the
moving operand holds 16 copies of each 512-row block, copy g zero outside the partitions of group g
(:func:`group_operand`), so one matmul of ``16·R`` moving columns (the 64-cycle minimum for R ≤ 4) puts
every 1×32 group's partial sum in its own PSUM columns; the evacuation multiplies them by the transposed group
scales and a GpSimd tree sums the K/32 groups (:func:`_grp_block`). Only the bit decode remains per weight
(0.5 VectorE cycle).

The activation (moving) operand is K-major ``aT [k, c, R]`` bf16 (exact: fp8 bytes decoded with bit ops, pow2
scale folded; non-pow2 fp32 activation scales round to bf16, ≤ 2^-9 relative per element), with block c holding
k = 128·c + p ("natural", for bf16 / fp8 weights) or k = 512·(c // 4) + 4p + c % 4 ("quad", for the decoded
packed weights); or, for the MX path, the activation bytes as ``float8_e4m3fn_x4 [m, K/512, R]`` (four k per
element, k = 512·mb + 4p + j) with E8M0 scales ``[128, K/512, R]`` in the ``nc_matmul_mx`` partition order
(exact for power-of-two activation scales, the only kind SPEC §1.1 produces; the E8M0 byte is the fp32 exponent
field).

Evacuation order (SPEC §1.6): ``Σ_kb s_w[n, kb] · Σ_{k∈kb} a_k·q_k`` with the activation scale already in
``a``: each 128-row K block's fp32 PSUM result is multiplied by its weight scale, the K blocks are summed in
fp32 in an order that depends only on K, and the sum is rounded once to bf16. Up to ``512 / R`` K blocks share
one PSUM bank (side by side, each its own accumulation group). Few rows (R < 64, decode): one VectorE
``tensor_tensor`` per bank (PSUM source × broadcast SBUF scale), then a fixed pairwise tree of fp32 adds on
GpSimd; many rows: ScalarE ``activation(copy, scale=s[:, kb])`` per group and one VectorE ``tensor_reduce``.
Masked rows are exact zeros before any engine sees them: a DMA gather skips them (bf16 rows, MX bytes) or their
fp8 scales are zeroed (bit-decoded bytes are always finite).

Every construct used, and where it is documented (aws-neuron-sdk ``nki/api/nki/isa`` pages unless noted):

- weights DMA'd K-major straight onto partitions, ≥ 512 B runs: ``dma_copy`` page; nki-library
  ``core/mlp/mlp_tkg/mlp_tkg_gate_up_projection.py`` (weight tile ``[H0, H1, I]`` by ``dma_copy``, stationary).
- runtime expert id in an HBM access pattern (``.ap(scalar_offset=<register>)`` on the HBM side of a DMA only):
  ``deep-dives/nki-aps.rst``; nki-library ``core/moe/moe_tkg/selective_expert_impl.py``.
- fp8 stationary × bf16 moving, fp32 PSUM: ``nc_matmul`` (inputs fp8 e4m3/e5m2, bf16, …; trn2 float8_e4m3);
  nki-library ``mlp_tkg_gate_up_projection.py`` (float8_e4m3 weight tiles against the io-dtype hidden).
- per-K-block PSUM groups side by side in one bank: ``nc_matmul`` (a matmul writes within one 2 KiB bank; the
  first write overwrites, ``accumulate=False``).
- evacuation with a broadcast scale / reduction: ``tensor_tensor`` (PSUM + SBUF input; arithmetic fp32 adds on
  GpSimd, SBUF only), ``activation`` with a ``(P, 1)`` scale (ScalarE reads PSUM), ``tensor_reduce`` (trailing
  free axis), ``.broadcast`` / ``.permute`` of free dims (``nki.language`` tensor views).
- masked rows by a gathering DMA: ``.ap(vector_offset=<(P, 1) int32 SBUF>)`` on the HBM side with
  ``oob_mode.skip`` (``dma_copy`` page, ``deep-dives/nki-aps.rst``), indices from ``iota``; ``memset`` on GpSimd.
- fp8 per-block weight scales (fp32, at a runtime expert address): ``dma_copy`` of the stored rows, then fp32
  TensorE transposes (``nc_transpose``, bit-exact, 2× a moving pass in transpose mode: T2 "Built-in Transpose
  Support") — what nki-library ``core/mlp/mlp_tkg/mlp_tkg_gate_up_projection.py`` does instead of a
  ``dma_transpose`` ("dynamic access not supported by dma_transpose (NKI-415)"); the ``dma_transpose`` API
  page allows only 2-byte dtypes on both of its DGE lowerings.
- fp8 activation words on the trn3 MX path (uint32, SBUF → SBUF, static addresses): ``dma_transpose``; trn2
  arch guide "DMA Transpose" (2- and 4-byte dtypes). RISK: the API page lists 2-byte dtypes for its hwdge and
  swdge lowerings; with ``dge_mode=unknown`` the compiler picks the lowering, and no public kernel transposes
  4-byte words this way.
- bf16 TensorE transposes into bf16 PSUM: ``nc_transpose``; nki-library ``moe_tkg`` (identity transposes).
  No fp8 TensorE transpose is used anywhere.
- bit ops only in ``tensor_scalar`` on VectorE ("must run on Vector Engine"), with immediates that are exact
  in float32 (≤ 24 significant bits) or a ``(P, 1)`` uint32 tile operand (``tensor_scalar``: operands "can be
  … tiles of shape (data.shape[0], 1)"); disjoint bit fields are combined with an exact integer
  ``tensor_tensor`` add on GpSimd (arithmetic, not bitwise).
- ``nc_matmul_mx`` with fp32 PSUM, x4 dtypes, scale tiles with 4 rows per 32-partition quadrant:
  ``nc_matmul_mx`` page, trn3 arch guide "Quad-MXFP8/MXFP4 Matmul"; nki-library
  ``core/mlp/mlp_tkg/gate_up_projection_mx_shard_H.py`` (one scale DMA per quadrant).
- multi-buffered weight slabs (a ring of ``WEIGHT_BUFS`` SBUF buffers, filled in turn): nki-library
  ``mlp_tkg_gate_up_projection.py`` (``weight_tiles`` ring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from static_moe.nki.shim import nisa, nl

P = 128  # partitions
MOVING_MAX = 512  # gemm_moving_fmax: one PSUM bank of fp32
PSUM_BANK_F32 = 512
MIN_RUN_BYTES = 512  # a weight slab's contiguous HBM run (DMA cost model: shorter runs cost as much)
WEIGHT_BUFS = 2  # weight slabs in flight (DMA of slab i+1 overlaps the matmuls of slab i)
FOLD_VECTOR_PLANES = 1  # of the 4 planes of a packed slab, how many VectorE folds (the rest: GpSimd)
TRANSPOSES_PER_BANK = 8  # bf16 [128, 128] TensorE transposes per 2 KiB PSUM bank
SCALAR_EVAC_MIN_ROWS = 64  # fp8_block: from this many rows on, ScalarE applies the K-block scales (see below)
EVAC_TILE_BYTES = 32 * 1024  # fp8_block, many rows: per-partition bytes of the one-reduction scaled tile
# quad_grp up to this many moving rows (16·R columns per matmul): fp4 keeps its bit decode, so its group path
# beats the fold only while 16·R ≤ 64 (the matmul minimum); fp8 MX has no decode and wins up to 8 rows
# (cost model, V4-Flash GEMM1 on trn3: 77.5 µs vs 86.7 µs at 8 rows)
GROUP_PATH_MAX_ROWS = {"fp4": 4, "fp8_mx": 8}
DECODE_SLAB_ELEMS = 4096  # packed elements per partition in one decoded slab (SBUF bound of the decode paths)
SLAB_BYTES = 16 * 1024  # per partition and ring buffer: how wide a slab may grow when K is small
FOLD_EXTRA_LOG2 = 6  # the packed decode folds 2^(b − 127 + 6): b = 0 stays a normal bf16 (fp8 MX evacuates × 2^-6)

# bit masks as exact-in-fp32 immediates (≤ 24 significant bits) or int32 spellings of the same 32 bits
_M_007F007F = 0x007F007F
_M_00800080 = 0x00800080
_M_7F007F00 = 0x7F007F00
_M_80008000 = 0x80008000 - (1 << 32)  # = -0x7FFF8000: 16 significant bits
_M_80808080 = 0x80808080 - (1 << 32)  # = -0x7F7F7F80: 24 significant bits
_M_1C1C1C1C = 0x1C1C1C1C  # 27 significant bits: passed as a (P, 1) tile, never as an immediate


# ----------------------------------------------------------------------------------------------------------------
# Plans (compile time)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightPlan:
    """How one EIO weight tensor is consumed (all compile-time).

    Attributes:
        fmt: "bf16", "fp8", "fp8_mx" or "fp4" (from the weight dtype).
        path: "bf16" (bf16 stationary), "fp8_block" (native fp8 stationary, per-K-block groups), "mx"
            (``nc_matmul_mx``), "quad_bf16" (packed weights decoded to bf16) or "quad_grp" (packed weights as
            fp8 planes, per-group PSUM columns).
        korder: activation operand the path needs: "natural", "quad" (bf16 aT), "quad_grp" (group-masked
            quad) or "mx" (x4 + E8M0).
        k, n: contraction length and output features.
        rows: HBM rows per expert of the weight tensor (K, or K/4 for the packed forms).
        ncols: output columns per weight slab (a multiple of 128 dividing N, ≥ 512 B contiguous per row).
    """

    fmt: str
    path: str
    korder: str
    k: int
    n: int
    rows: int
    ncols: int

    @property
    def kp(self) -> int:
        """K padded to whole 512-row blocks for the packed forms (the missing rows are zeros on chip)."""
        return self.k if self.fmt in ("bf16", "fp8") else -(-self.k // (4 * P)) * 4 * P

    @property
    def last_rows(self) -> int:
        """HBM rows in the last 128-row block (128 unless K is not a multiple of 512 for a packed form)."""
        return self.rows - P * (self.nrb - 1)

    @property
    def ngroups(self) -> int:
        """1×32 scale groups along K."""
        return self.kp // 32

    @property
    def nkc(self) -> int:
        """128-row contraction blocks per n block (matmuls per PSUM group for bf16 / quad; K/512 for mx)."""
        return self.kp // (4 * P) if self.path == "mx" else self.kp // P

    @property
    def nrb(self) -> int:
        """128-row blocks of the HBM weight rows (K/128, or ⌈K/512⌉ for the packed forms)."""
        return -(-self.rows // P)


def act_format(a) -> str:
    """``"bf16"`` or ``"fp8"`` (float8_e4m3fn bytes) for an A / x tensor."""
    if a.dtype == nl.bfloat16:
        return "bf16"
    if a.dtype == nl.float8_e4m3fn or a.dtype == nl.uint8:
        return "fp8"
    raise TypeError(f"activation dtype {a.dtype} is not bf16 or float8_e4m3fn")


def eio_format(w) -> str:
    """The format of an EIO weight from its dtype (layout contract): bf16, fp8, fp8_mx (uint32), fp4 (uint16)."""
    fmts = {nl.bfloat16: "bf16", nl.float8_e4m3fn: "fp8", nl.uint32: "fp8_mx", nl.uint16: "fp4"}
    for d, f in fmts.items():
        if w.dtype == d:
            return f
    raise TypeError(f"EIO weight dtype {w.dtype} is not bfloat16, float8_e4m3fn, uint32 (fp8 MX) or uint16 (fp4)")


def is_trn3() -> bool:
    """NeuronCore-v4 (``nisa.get_nc_version()``, isa page): e4m3fn matmul inputs and ``nc_matmul_mx``."""
    return nisa.get_nc_version() == nisa.nc_version.gen4


def _slab_cols(n: int, elem_bytes: int) -> int:
    """Columns per weight slab: the smallest multiple of 128 dividing N whose row run is ≥ MIN_RUN_BYTES."""
    want = max(P, -(-MIN_RUN_BYTES // elem_bytes))
    c = -(-want // P) * P
    while c < n and n % c:
        c += P
    return min(c, n)


def weight_plan(w, act_fmt: str, rows: int | None = None) -> WeightPlan:
    """The plan for an EIO weight ``w [L, rows, N]`` against activations of ``act_fmt`` on the current target.

    ``rows``: the moving rows per GEMM call, if known at trace time. Packed weights that would take the bf16
    decode (quad_bf16) take the group path (quad_grp) instead when ``rows ≤ GROUP_PATH_MAX_ROWS[fmt]``: no
    scale fold at all (see :func:`_grp_block`)."""
    n_rows = rows
    fmt = eio_format(w)
    rows, n = w.shape[1], w.shape[2]
    trn3 = is_trn3()
    if fmt == "bf16":
        path, korder, k, eb = "bf16", "natural", rows, 2
    elif fmt == "fp8":
        path, korder, k, eb = "fp8_block", "natural", rows, 1
    else:
        k, eb = 4 * rows, (4 if fmt == "fp8_mx" else 2)
        assert fmt == "fp4" or trn3, (
            "the fp8 MX weight form (uint32) exists on trn3 only; prepare trn2 weights "
            "with layouts.prepare_weight(..., 'trn2')"
        )
        if trn3 and act_fmt == "fp8":
            path, korder = "mx", "mx"
        elif n_rows is not None and n_rows <= GROUP_PATH_MAX_ROWS[fmt]:
            path, korder = "quad_grp", "quad_grp"
        else:
            path, korder = "quad_bf16", "quad"
    assert k % P == 0 and n % P == 0, f"K={k} and N={n} must be multiples of {P}"
    # packed forms: 512 columns per slab so the scale rows (1 byte per column) also move in ≥ 512 B runs — but
    # the decoding paths keep ≤ DECODE_SLAB_ELEMS packed elements per partition (their planes and bit-decode
    # temporaries take ~20 B per element: V3's K = 7168 gets 256 columns)
    ncols = _slab_cols(n, eb if fmt in ("bf16", "fp8") else 1)
    nrb = -(-rows // P)
    if path in ("quad_bf16", "quad_grp"):
        while ncols > P and nrb * ncols > DECODE_SLAB_ELEMS:
            ncols = _slab_cols_at_most(n, ncols - P)
    else:  # small K: widen the slab up to SLAB_BYTES per partition (fewer, larger DMAs; each has a fixed cost)
        ncols = max(ncols, _slab_cols_at_most(n, SLAB_BYTES // (nrb * eb)))
    return WeightPlan(fmt, path, korder, k, n, rows, ncols)


def _slab_cols_at_most(n: int, c: int) -> int:
    """The largest multiple of 128 that divides N and is ≤ c (at least 128)."""
    c = max(P, c // P * P)
    while n % c:
        c -= P
    return c


# ----------------------------------------------------------------------------------------------------------------
# HBM views (static expert: slicing; runtime expert: .ap(scalar_offset=<register>) on the HBM side of a DMA)
# ----------------------------------------------------------------------------------------------------------------
def _hbm_rows(t, e, row0: int, nblk: int, col0: int, ncols: int, dtype=None):
    """HBM view ``[P, nblk, ncols]`` of rows ``row0 + j·128 + p`` of expert ``e`` of ``t [L, R, C]``, columns
    ``col0 …``; ``dtype`` reinterprets the bytes (same itemsize)."""
    _, r, c = t.shape
    pattern = [[c, P], [P * c, nblk], [1, ncols]]
    if isinstance(e, int):
        return t.ap(pattern=pattern, offset=e * r * c + row0 * c + col0, dtype=dtype)
    return t.ap(pattern=pattern, offset=row0 * c + col0, scalar_offset=e, indirect_dim=0, dtype=dtype)


def _hbm_ap(t, e, pattern, offset: int, dtype=None):
    """A raw HBM access pattern inside expert ``e`` of ``t [L, R, C]`` (offset relative to the expert)."""
    _, r, c = t.shape
    if isinstance(e, int):
        return t.ap(pattern=pattern, offset=e * r * c + offset, dtype=dtype)
    return t.ap(pattern=pattern, offset=offset, scalar_offset=e, indirect_dim=0, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Weight slabs: [P, row blocks, ncols] straight from HBM, multi-buffered
# ----------------------------------------------------------------------------------------------------------------
class WeightRing:
    """``WEIGHT_BUFS`` SBUF buffers per weight plan, used in turn by :func:`load_weight_slab` (explicit
    multi-buffering: the DMA into buffer i+1 does not wait for the matmuls reading buffer i)."""

    def __init__(self, plan: WeightPlan, name: str = "w"):
        self.plan = plan
        raw_dtype = {"bf16": nl.bfloat16, "fp8": nl.uint8, "fp8_mx": nl.uint32, "fp4": nl.uint16}[plan.fmt]
        self.raw = [
            nl.ndarray((P, plan.nrb, plan.ncols), dtype=raw_dtype, buffer=nl.sbuf, name=f"{name}_slab{i}")
            for i in range(WEIGHT_BUFS)
        ]
        self.scale = []
        if plan.path == "fp8_block":
            assert plan.k // P <= P, f"K={plan.k}: at most 128 scale blocks (one per partition of the staging tile)"
            self.scale = [
                nl.ndarray((P, plan.ncols // P, plan.k // P), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_scale{i}")
                for i in range(WEIGHT_BUFS)
            ]
            # the scales as stored ([K/128 rows, ncols]) and the PSUM tile of their TensorE transposes
            self.scale_rows = nl.ndarray(
                (plan.k // P, plan.ncols), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_scale_rows"
            )
            self.scale_psum = nl.ndarray((P, plan.k // P), dtype=nl.float32, buffer=nl.psum, name=f"{name}_scale_t")
        elif plan.path == "quad_grp":  # transposed 2^(b - 121) per (n, group), bf16
            self.scale = [
                nl.ndarray(
                    (P, plan.ncols // P, plan.ngroups), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_grp_scale{i}"
                )
                for i in range(WEIGHT_BUFS)
            ]
        elif plan.path in ("mx", "quad_bf16"):
            self.scale = [
                nl.ndarray((P, plan.nrb, plan.ncols), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_e8m0_{i}")
                for i in range(WEIGHT_BUFS)
            ]
        self.turn = 0


@dataclass
class WeightSlab:
    """One loaded slab: columns ``[n0, n0 + ncols)`` of one expert, all K.

    Attributes:
        plan: the plan.
        n0: first column.
        stat: per path — bf16: bf16 ``[P, K/128, ncols]``; fp8_block: fp8 ``[P, K/128, ncols]`` (float8_e4m3 on
            trn2, float8_e4m3fn on trn3); mx: x4 ``[P, K/512, ncols]``; quad_bf16: list of 4 bf16 planes
            ``[P, K/512, ncols]`` (plane j holds k = 512·mb + 4p + j); quad_grp: the same 4 planes as fp8 views.
        scale: fp8_block: float32 ``[P(n), ncols/128, K/128]`` (``scale[p, j, kb] = s[kb, n0 + 128j + p]``);
            mx: uint8 E8M0 ``[P, K/512, ncols]`` in nc_matmul_mx order; quad_grp: bf16 ``[P(n), ncols/128, K/32]``
            group scales; else None.
    """

    plan: WeightPlan
    n0: int
    stat: object
    scale: object


def _mask_tile(value: int, name: str):
    """A (P, 1) uint32 tile holding a bit mask too wide for an fp32-exact immediate."""
    t = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf, name=name)
    nisa.memset(dst=t, value=value)
    return t


def load_weight_slab(ring: WeightRing, w, w_scale, e, n0: int) -> WeightSlab:
    """DMA columns ``[n0, n0 + ncols)`` of expert ``e`` of an EIO weight (and its scales) into the next ring
    buffer, K-major on the partitions, and decode it if the path needs it.

    Args:
        ring: the plan's :class:`WeightRing`.
        w: HBM EIO weight ``[L, rows, N]``; w_scale: its HBM scales (None for bf16).
        e: expert index (int, or a register for a runtime expert id).
        n0: first column, a multiple of ``plan.ncols``.

    Notes:
        One weight DMA per slab (``nrb · ncols · itemsize`` bytes per partition, runs of ≥ 512 B), plus one scale
        DMA (fp8: a DMA transpose; quad_bf16: rows replicated over the 8 partitions of each scale group; mx:
        one per 32-partition quadrant).
    """
    plan = ring.plan
    i = ring.turn
    ring.turn = (i + 1) % WEIGHT_BUFS
    raw = ring.raw[i]
    nrb, last = plan.nrb, plan.last_rows
    if last == P:
        nisa.dma_copy(dst=raw, src=_hbm_rows(w, e, 0, nrb, n0, plan.ncols, dtype=raw.dtype))
    else:  # packed K not a multiple of 512: the last block's missing rows are zeros (weight 0: adds nothing)
        nisa.memset(dst=raw[:, nrb - 1, :], value=0, engine=nisa.engine.gpsimd)
        if nrb > 1:
            nisa.dma_copy(dst=raw[:, : nrb - 1, :], src=_hbm_rows(w, e, 0, nrb - 1, n0, plan.ncols, dtype=raw.dtype))
        nisa.dma_copy(
            dst=raw[:last, nrb - 1, :],
            src=_hbm_ap(w, e, [[plan.n, last], [1, plan.ncols]], P * (nrb - 1) * plan.n + n0, dtype=raw.dtype),
        )
    if plan.path == "bf16":
        return WeightSlab(plan, n0, raw, None)
    if plan.path == "fp8_block":
        sc = ring.scale[i]
        nkb, g = plan.k // P, plan.ncols // P
        # s [L, K/128, N] -> [n, g, kb]: the rows [kb, ncols] by dma_copy (a runtime expert id is a dynamic
        # address, which dma_transpose does not take: NKI-415), then one TensorE transpose per 128 columns
        rows = ring.scale_rows
        nisa.dma_copy(dst=rows, src=_hbm_ap(w_scale, e, [[plan.n, nkb], [1, plan.ncols]], n0))
        for j in range(g):
            nisa.nc_transpose(dst=ring.scale_psum, data=rows[:, j * P : (j + 1) * P])
            nisa.tensor_copy(dst=sc[:, j, :], src=ring.scale_psum)
        fp8 = nl.float8_e4m3fn if is_trn3() else nl.float8_e4m3
        return WeightSlab(plan, n0, raw.view(fp8), sc)
    sc = ring.scale[i]
    nmb, n = plan.nrb, plan.n
    full = nmb if last == P else nmb - 1  # blocks with all 16 scale rows
    if last != P:
        nisa.memset(dst=sc[:, nmb - 1, :], value=0, engine=nisa.engine.gpsimd)
    if plan.path == "mx":
        # partition 32c + i of the scale tile holds UE8M0 row 16·mb + 4c + i (the group of data partitions
        # 32c + 8i … 32c + 8i + 7), columns n0 …; rows 4 … 31 of each quadrant are not read
        for c in range(4):
            if full:
                nisa.dma_copy(
                    dst=sc[32 * c : 32 * c + 4, :full, :],
                    src=_hbm_ap(w_scale, e, [[n, 4], [16 * n, full], [1, plan.ncols]], 4 * c * n + n0),
                )
            if full < nmb and 32 * c < last:
                nisa.dma_copy(
                    dst=sc[32 * c : 32 * c + 4, nmb - 1, :],
                    src=_hbm_ap(w_scale, e, [[n, 4], [1, plan.ncols]], (16 * full + 4 * c) * n + n0),
                )
        x4 = nl.float4_e2m1fn_x4 if plan.fmt == "fp4" else nl.float8_e4m3fn_x4
        return WeightSlab(plan, n0, raw.view(x4), sc)
    if plan.path == "quad_grp":
        return WeightSlab(plan, n0, _byte_planes(raw, plan), _grp_scales(ring.scale[i], w_scale, e, n0, plan))
    # quad_bf16: data partition p of block mb uses UE8M0 row 16·mb + p // 8: replicate each row over 8 partitions
    if full:
        nisa.dma_copy(
            dst=sc[:, :full, :], src=_hbm_ap(w_scale, e, [[n, 16], [0, 8], [16 * n, full], [1, plan.ncols]], n0)
        )
    if full < nmb:
        nisa.dma_copy(
            dst=sc[:last, nmb - 1, :],
            src=_hbm_ap(w_scale, e, [[n, last // 8], [0, 8], [1, plan.ncols]], 16 * full * n + n0),
        )
    return WeightSlab(plan, n0, _decode_quad(raw, sc, plan), None)


def _fold_scale_bf16(sc, plan: WeightPlan):
    """UE8M0 bytes ``b`` → bf16 ``2^(b − 127 + 6)``, built from the bits ``(b + 6) << 7`` (exact, normal for every
    b ≤ 248). fp4: the decoded e4m3 bytes carry 2^-6, so the product is the weight itself; fp8 MX: the product
    is the weight × 2^6, undone on evacuation (exact)."""
    p, nmb, nc = sc.shape
    bits = nl.ndarray((p, nmb, nc), dtype=nl.uint16, buffer=nl.sbuf, name="w_fold_bits")
    # b·128 + 6·128 in fp32 is exact (< 2^16) and lands as the uint16 bit pattern: one ScalarE op, off VectorE
    nisa.tensor_scalar(
        dst=bits,
        data=sc,
        op0=nl.multiply,
        operand0=128.0,
        op1=nl.add,
        operand1=float(FOLD_EXTRA_LOG2 * 128),
        engine=nisa.engine.scalar,
    )
    return bits.view(nl.bfloat16)


def _decode_quad(raw, sc, plan: WeightPlan):
    """Packed slab (fp4 uint16 / fp8 MX uint32 ``[P, nmb, ncols]``) → 4 bf16 planes ``[P, nmb, ncols]`` with the
    per-32 scales folded in (exact; see the module docstring)."""
    p, nmb, nc = raw.shape
    scale = _fold_scale_bf16(sc, plan)
    planes = [nl.ndarray((p, nmb, nc), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"w_plane{j}") for j in range(4)]
    srcs = _byte_planes(raw, plan)  # fp4: e4m3 bytes holding v·2^-6 (the fold scale carries the 2^6)
    for j in range(4):
        eng = nisa.engine.vector if j < FOLD_VECTOR_PLANES else nisa.engine.gpsimd
        nisa.tensor_tensor(dst=planes[j], data1=srcs[j], data2=scale, op=nl.multiply, engine=eng)
    return planes


def _byte_planes(raw, plan: WeightPlan):
    """Packed slab → 4 fp8 planes ``[P, nmb, ncols]`` (views; plane j holds k = 512·mb + 4p + j), unscaled:
    fp4 decoded to float8_e4m3 bytes holding v·2^-6 (exact bit work, no multiply), fp8 MX viewed as its e4m3fn
    bytes. The planes are strided views (every 2nd / 4th byte): the stationary operand reads them in place."""
    p, nmb, nc = raw.shape
    if plan.fmt == "fp8_mx":
        byt = raw.view(nl.float8_e4m3fn).reshape((p, nmb, nc, 4))
        return [byt[:, :, :, j] for j in range(4)]
    nw = nmb * nc // 2
    words = raw.reshape((p, nmb * nc)).view(nl.uint32)
    lo = nl.ndarray((p, nw), dtype=nl.uint32, buffer=nl.sbuf, name="w_lo")
    hi = nl.ndarray((p, nw), dtype=nl.uint32, buffer=nl.sbuf, name="w_hi")
    decode_e2m1_nibbles(lo, hi, words, _mask_tile(_M_1C1C1C1C, "m_1c"))
    lo8 = lo.view(nl.float8_e4m3).reshape((p, nmb, nc, 2))
    hi8 = hi.view(nl.float8_e4m3).reshape((p, nmb, nc, 2))
    return [lo8[:, :, :, 0], hi8[:, :, :, 0], lo8[:, :, :, 1], hi8[:, :, :, 1]]


def _grp_scales(dst, w_scale, e, n0: int, plan: WeightPlan):
    """``dst[n, jj, g] = 2^(b[g, n0 + 128·jj + n] − 121)`` (bf16; fp4 planes carry 2^-6, fp8 MX evacuation
    multiplies by 2^-6) from UE8M0 rows ``[K/32, N]``: the rows DMA'd as bf16 values (the DMA converts 0 … 255
    exactly), transposed per 128 × 128 on the TensorE (bf16 into bf16 PSUM), and the bits ``(b + x) · 128`` built
    by ScalarE straight from PSUM into uint16 (the bf16 pattern)."""
    ng, nc = plan.ngroups, plan.ncols
    x = FOLD_EXTRA_LOG2  # fp4: the planes carry 2^-6; fp8 MX: undone on evacuation (keeps b = 0 a normal bf16)
    bits = dst.view(nl.uint16)
    real = plan.k // 32  # groups that exist in HBM; the padded ones get byte 0 (their PSUM columns are 0)
    for g0 in range(0, ng, P):
        gk = min(P, ng - g0)
        rows = nl.ndarray((gk, nc), dtype=nl.bfloat16, buffer=nl.sbuf, name="grp_rows")
        have = max(0, min(gk, real - g0))
        if have < gk:
            nisa.memset(dst=rows, value=0.0, engine=nisa.engine.gpsimd)
        if have:
            nisa.dma_copy(dst=rows[:have, :], src=_hbm_ap(w_scale, e, [[plan.n, have], [1, nc]], g0 * plan.n + n0))
        for jj in range(nc // P):
            pt = nl.ndarray((P, gk), dtype=nl.bfloat16, buffer=nl.psum, name="grp_psum")
            nisa.nc_transpose(dst=pt, data=rows[:, jj * P : (jj + 1) * P])
            nisa.tensor_scalar(
                dst=bits[:, jj, g0 : g0 + gk],
                data=pt,
                op0=nl.multiply,
                operand0=128.0,
                op1=nl.add,
                operand1=float(x * 128),
                engine=nisa.engine.scalar,
            )
    return dst


def group_operand(op: ActOperand) -> ActOperand:
    """The quad_grp moving operand from a quad one: ``aG[p, c, g, r] = aT[p, c, r]`` if ``p // 8 == g`` else 0
    (g < 16: the 1×32 group within the 512-row block), so one matmul of ``16·R`` moving columns yields every
    group's partial sum separately. One VectorE multiply by a 0/1 indicator built with ``iota`` (once per
    operand, shared by all experts)."""
    _, nkc, r = op.aT.shape
    ind_i = nl.ndarray((P, 16), dtype=nl.int32, buffer=nl.sbuf, name="grp_ind_i")
    nisa.iota(dst=ind_i, pattern=[[-8, 16]], offset=0, channel_multiplier=1)  # p − 8g
    a0 = nl.ndarray((P, 16), dtype=nl.float32, buffer=nl.sbuf, name="grp_ge")
    nisa.tensor_scalar(dst=a0, data=ind_i, op0=nl.greater_equal, operand0=0.0)
    a1 = nl.ndarray((P, 16), dtype=nl.float32, buffer=nl.sbuf, name="grp_le")
    nisa.tensor_scalar(dst=a1, data=ind_i, op0=nl.less_equal, operand0=7.0)
    ind = nl.ndarray((P, 16), dtype=nl.bfloat16, buffer=nl.sbuf, name="grp_ind")
    nisa.tensor_tensor(dst=ind, data1=a0, data2=a1, op=nl.multiply)
    aG = nl.ndarray((P, nkc, 16, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="act_grp")
    for src, dst in ((op.aT, aG),) + (((op.aT_lo, None),) if op.aT_lo is not None else ()):
        if dst is None:
            dst = nl.ndarray((P, nkc, 16, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="act_grp_lo")
            lo = dst
        nisa.tensor_tensor(
            dst=dst,
            data1=src.reshape((P, nkc, 1, r)).broadcast(2, 16),
            data2=ind.reshape((P, 1, 16, 1)).broadcast(1, nkc).broadcast(3, r),
            op=nl.multiply,
        )
    return ActOperand("quad_grp", aG, None, None, r, lo if op.aT_lo is not None else None)


def _grp_block(dst, slab: WeightSlab, j: int, act, m0: int, mr: int):
    """quad_grp: ``dst[n, r] = bf16(Σ_g s[g, n] · Σ_{k∈g} q[k, n] · a[r, k])``. Per 512-row block mb the four
    planes accumulate into one PSUM group of ``16·mr`` columns (column block g = group 16·mb + g); up to 512
    columns share a bank; VectorE multiplies a bank by the transposed group scales, GpSimd sums the K/32 groups
    (fixed tree) and rounds once into dst."""
    plan = slab.plan
    nmb, ng = plan.nrb, plan.ngroups
    cols = slab_cols(j)
    mb_per_bank = max(1, PSUM_BANK_F32 // (16 * mr))
    scaled = nl.ndarray((P, ng, mr), dtype=nl.float32, buffer=nl.sbuf, name="grp_scaled")
    for b0 in range(0, nmb, mb_per_bank):
        nb = min(mb_per_bank, nmb - b0)
        ps = nl.ndarray((P, mb_per_bank, 16, mr), dtype=nl.float32, buffer=nl.psum, name="grp_psum")
        for q in range(nb):
            mb = b0 + q
            for jp in range(4):
                c = 4 * mb + jp
                nisa.nc_matmul(
                    dst=ps[:, q, :, :],
                    stationary=slab.stat[jp][:, mb, cols],
                    moving=act.aT[:, c, :, m0 : m0 + mr],
                    accumulate=jp != 0,
                )
                if act.aT_lo is not None:
                    nisa.nc_matmul(
                        dst=ps[:, q, :, :],
                        stationary=slab.stat[jp][:, mb, cols],
                        moving=act.aT_lo[:, c, :, m0 : m0 + mr],
                        accumulate=True,
                    )
        g0 = 16 * b0
        s = slab.scale[:, j, g0 : g0 + 16 * nb].reshape((P, 16 * nb, 1)).broadcast(2, mr)
        psv = ps[:, :nb, :, :].reshape((P, 16 * nb, mr))
        if plan.fmt == "fp4":
            nisa.tensor_tensor(dst=scaled[:, g0 : g0 + 16 * nb, :], data1=psv, data2=s, op=nl.multiply)
        else:  # fp8 MX: (psum · 2^-6) · scale, one instruction
            nisa.scalar_tensor_tensor(
                dst=scaled[:, g0 : g0 + 16 * nb, :],
                data=psv,
                op0=nl.multiply,
                operand0=float(2.0**-FOLD_EXTRA_LOG2),
                op1=nl.multiply,
                operand1=s,
            )
    tree_sum(dst, scaled)


def decode_e2m1_nibbles(lo, hi, words, m1c):
    """Packed e2m1 → float8_e4m3 bytes holding the value × 2^-6 (exact), eight nibbles per uint32 lane.

    e2m1 code c = s e1 e0 m → e4m3 byte ``s << 7 | (c & 7) << 2``: the exponent and mantissa bits keep their
    weights 2^-6 lower (subnormal 0.5 → e4m3 subnormal 2^-7), the sign moves to bit 7.

    Args:
        lo, hi: SBUF uint32 ``[p, F]`` outputs; byte b of ``lo`` (``hi``) is the e4m3 byte of the low (high)
            nibble of byte b of the input word.
        words: SBUF uint32 ``[p, F]``.
        m1c: SBUF uint32 ``(p, 1)`` tile holding 0x1C1C1C1C (27 significant bits: not an fp32-exact immediate).

    Notes:
        4 VectorE ``tensor_scalar`` (bit ops on VectorE only) and 2 GpSimd integer adds (the two fields are
        disjoint, so ``+`` is ``|``; GpSimd does no bitwise tensor_tensor).
    """
    p, f = words.shape
    sign = nl.ndarray((p, f), dtype=nl.uint32, buffer=nl.sbuf, name="w_sign")
    nisa.tensor_scalar(dst=lo, data=words, op0=nl.left_shift, operand0=2, op1=nl.bitwise_and, operand1=m1c)
    nisa.tensor_scalar(dst=sign, data=words, op0=nl.left_shift, operand0=4, op1=nl.bitwise_and, operand1=_M_80808080)
    nisa.tensor_tensor(dst=lo, data1=lo, data2=sign, op=nl.add, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=hi, data=words, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and, operand1=m1c)
    nisa.tensor_scalar(dst=sign, data=words, op0=nl.bitwise_and, operand0=_M_80808080)
    nisa.tensor_tensor(dst=hi, data1=hi, data2=sign, op=nl.add, engine=nisa.engine.gpsimd)


# ----------------------------------------------------------------------------------------------------------------
# GEMM of one 128-column block of a slab against the moving rows
# ----------------------------------------------------------------------------------------------------------------
def gemm_block(dst, slab: WeightSlab, j: int, act, r: int, out_engine=None):
    """``dst [P(n), R] = bf16(Σ_k W[k, n0 + 128j + n] · A[r, k])`` for column block j of a slab.

    Args:
        dst: SBUF bf16 (or float32) ``[P, R]``; R ≤ 512 per call is not required (split at 512 here).
        slab: what :func:`load_weight_slab` returned.
        j: column block within the slab (``0 ≤ j < ncols / 128``).
        act: the :class:`ActOperand` of ``plan.korder``.
        r: rows (columns of the moving operand) to compute.
        out_engine: engine of the PSUM → SBUF copy for the single-group paths (default VectorE).

    Notes:
        bf16 / quad_bf16 / mx: one PSUM group over all K, one copy out (the only rounding).
        fp8_block: each K block its own group, evacuated per bank with the weight scale (module docstring).
    """
    plan = slab.plan
    cols = slab_cols(j)
    eng = nisa.engine.vector if out_engine is None else out_engine
    for m0 in range(0, r, MOVING_MAX):
        mr = min(MOVING_MAX, r - m0)
        if plan.path == "fp8_block":
            _fp8_block_evac(dst[:, m0 : m0 + mr], slab, j, act, m0, mr)
            continue
        if plan.path == "quad_grp":
            _grp_block(dst[:, m0 : m0 + mr], slab, j, act, m0, mr)
            continue
        ps = nl.ndarray((P, mr), dtype=nl.float32, buffer=nl.psum, name="gemm_psum")
        if plan.path == "mx":
            for mb in range(plan.nkc):
                nisa.nc_matmul_mx(
                    dst=ps,
                    stationary=slab.stat[:, mb, cols],
                    moving=act.x4[:, mb, m0 : m0 + mr],
                    stationary_scale=slab.scale[:, mb, cols],
                    moving_scale=act.sc[:, mb, m0 : m0 + mr],
                    accumulate=mb != 0,
                )
        else:
            for c in range(plan.nkc):
                if plan.path == "bf16":
                    st = slab.stat[:, c, cols]
                else:  # quad: block c = (mb, plane)
                    st = slab.stat[c % 4][:, c // 4, cols]
                nisa.nc_matmul(dst=ps, stationary=st, moving=act.aT[:, c, m0 : m0 + mr], accumulate=c != 0)
                if act.aT_lo is not None:
                    nisa.nc_matmul(dst=ps, stationary=st, moving=act.aT_lo[:, c, m0 : m0 + mr], accumulate=True)
        if plan.path == "quad_bf16" and plan.fmt == "fp8_mx":
            nisa.tensor_scalar(
                dst=dst[:, m0 : m0 + mr], data=ps, op0=nl.multiply, operand0=float(2.0**-FOLD_EXTRA_LOG2), engine=eng
            )
        else:
            nisa.tensor_copy(dst=dst[:, m0 : m0 + mr], src=ps, engine=eng)


def slab_cols(j: int) -> slice:
    return slice(j * P, (j + 1) * P)


def _fp8_block_evac(dst, slab: WeightSlab, j: int, act, m0: int, mr: int):
    """Per-K-block PSUM groups, ``kb_per_bank = 512 // mr`` side by side in one bank, then
    ``dst = bf16(Σ_kb s[n, kb] · psum_kb)``.

    Few rows (mr < SCALAR_EVAC_MIN_ROWS, decode): one VectorE ``tensor_tensor`` per bank multiplies every group by
    its scale on the way out of PSUM into an fp32 SBUF tile ``[P, K/128, mr]``; GpSimd sums the K blocks by a
    fixed pairwise tree of fp32 adds (SBUF only), the last add rounding once into ``dst``. Instruction counts are
    what binds here, and the two engines split the work.
    Many rows: ScalarE applies each group's scale (``activation(copy, scale=s[:, kb])``, one input, per-partition
    scale), VectorE reduces each bank (``tensor_reduce``) and adds banks in increasing kb. Either way the work per
    128 columns is ∝ K/128 · R elements: for large R the evacuation binds (feed compacted rows).
    """
    plan = slab.plan
    nkb = plan.k // P
    per_bank = max(1, min(nkb, PSUM_BANK_F32 // mr))
    cols = slab_cols(j)
    few = mr < SCALAR_EVAC_MIN_ROWS
    whole = nkb * mr * 4 <= EVAC_TILE_BYTES  # every K block's scaled sums fit one SBUF tile: one reduction
    if few or whole:
        scaled = nl.ndarray((P, nkb, mr), dtype=nl.float32, buffer=nl.sbuf, name="fp8_scaled")
    if not (few or whole):
        acc = dst if dst.dtype == nl.float32 else nl.ndarray((P, mr), dtype=nl.float32, buffer=nl.sbuf, name="fp8_acc")
    for b0 in range(0, nkb, per_bank):
        nb = min(per_bank, nkb - b0)
        ps = nl.ndarray((P, per_bank, mr), dtype=nl.float32, buffer=nl.psum, name="fp8_kb_psum")
        for q in range(nb):
            kb = b0 + q
            nisa.nc_matmul(
                dst=ps[:, q, :], stationary=slab.stat[:, kb, cols], moving=act.aT[:, kb, m0 : m0 + mr], accumulate=False
            )
            if act.aT_lo is not None:
                nisa.nc_matmul(
                    dst=ps[:, q, :],
                    stationary=slab.stat[:, kb, cols],
                    moving=act.aT_lo[:, kb, m0 : m0 + mr],
                    accumulate=True,
                )
        if few:
            s = slab.scale[:, j, b0 : b0 + nb].reshape((P, nb, 1)).broadcast(2, mr)
            nisa.tensor_tensor(dst=scaled[:, b0 : b0 + nb, :], data1=ps[:, :nb, :], data2=s, op=nl.multiply)
            continue
        bank = (
            scaled[:, b0 : b0 + nb, :]
            if whole
            else nl.ndarray((P, nb, mr), dtype=nl.float32, buffer=nl.sbuf, name="fp8_bank")
        )
        for q in range(nb):
            nisa.activation(
                dst=bank[:, q, :], op=nl.copy, data=ps[:, q, :], scale=slab.scale[:, j, b0 + q : b0 + q + 1]
            )
        if whole:
            continue
        part = acc if b0 == 0 else nl.ndarray((P, mr), dtype=nl.float32, buffer=nl.sbuf, name="fp8_part")
        nisa.tensor_reduce(dst=part, op=nl.add, data=bank.permute((0, 2, 1)), axis=(2,))
        if b0:
            nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
    if few:
        tree_sum(dst, scaled)
        return
    if whole:  # reduce straight into dst: the one rounding
        nisa.tensor_reduce(dst=dst, op=nl.add, data=scaled.permute((0, 2, 1)), axis=(2,))
        return
    if acc is not dst:
        nisa.tensor_copy(dst=dst, src=acc, engine=nisa.engine.vector)  # the one bf16 rounding


def tree_sum(dst, x):
    """``dst[:, m] = Σ_i x[:, i, m]`` by a fixed pairwise tree of fp32 GpSimd adds (x, SBUF fp32 ``[p, n, m]``,
    is overwritten); the last add writes ``dst`` (any float dtype: one rounding). The order depends only on n."""
    n = x.shape[1]
    if n == 1:
        nisa.tensor_copy(dst=dst, src=x[:, 0, :], engine=nisa.engine.gpsimd)
        return
    while n > 2:
        h = n // 2
        nisa.tensor_tensor(
            dst=x[:, 0:h, :], data1=x[:, 0:h, :], data2=x[:, n - h : n, :], op=nl.add, engine=nisa.engine.gpsimd
        )
        n -= h
    nisa.tensor_tensor(dst=dst, data1=x[:, 0, :], data2=x[:, 1, :], op=nl.add, engine=nisa.engine.gpsimd)


# ----------------------------------------------------------------------------------------------------------------
# Activations (the moving operand), from row tiles in SBUF
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ActOperand:
    """The moving operand of a GEMM, K-major, shared by every expert.

    Attributes:
        korder: "natural", "quad" or "mx".
        aT: natural / quad: SBUF bf16 ``[P, K/128, R]`` (block c as in the module docstring); else None.
        x4: mx: SBUF float8_e4m3fn_x4 ``[P, K/512, R]``; else None.
        sc: mx: SBUF uint8 ``[P, K/512, R]`` E8M0 in nc_matmul_mx order; else None.
        r: rows.
        aT_lo: None, or (``split``) SBUF bf16 like aT holding ``bf16(a − aT)``: each matmul then runs twice into
            the same PSUM group, so an activation that bf16 cannot hold (fp8 byte × a non-power-of-two fp32
            scale) still enters with ~16 significant bits (the reference rounds ``q·s`` to fp32).
    """

    korder: str
    aT: object
    x4: object
    sc: object
    r: int
    aT_lo: object = None  # split operands: the bf16 remainder a − bf16(a), K-major like aT (or None)


def alloc_act_operand(korder: str, k: int, r: int, name: str = "act", split: bool = False) -> ActOperand:
    """Allocate the operand buffers for R rows (fill them with :func:`act_rows_into_operand`)."""
    if korder == "mx":
        x4 = nl.ndarray((P, k // (4 * P), r), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_x4")
        sc = nl.ndarray((P, k // (4 * P), r), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_e8m0")
        return ActOperand(korder, None, x4, sc, r)
    aT = nl.ndarray((P, k // P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_T")
    lo = nl.ndarray((P, k // P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_T_lo") if split else None
    return ActOperand(korder, aT, None, None, r, lo)


def load_act_rows(a, a_scale, r0: int, rt: int, mask=None, korder: str = "natural", split: bool = False):
    """Rows ``[r0, r0 + rt)`` of an HBM activation ``a [R, K]`` into SBUF, in the form
    :func:`act_rows_into_operand` takes, with rows whose mask is 0 made exact zeros before any arithmetic.

    Returns:
        natural / quad: SBUF bf16 ``[rt, K]`` (fp8 bytes decoded exactly, scale folded in, :func:`fp8_rows_to_bf16`);
        mx: ``(bytes uint8 [rt, K], e8m0 uint8 [rt, K/32])`` (:func:`fp8_rows_to_mx`).
    """
    k = a.shape[1]
    fmt = act_format(a)
    if fmt == "bf16":
        assert korder != "mx", "the MX path needs fp8 activations"
        return gather_rows(a, r0, rt, mask, nl.bfloat16, "a_rows")
    g = k // a_scale.shape[1]
    s_raw = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s")
    nisa.dma_copy(dst=s_raw, src=a_scale[r0 : r0 + rt, :])
    if korder == "mx":  # masked rows: zero bytes straight from the DMA; their scale bytes are replaced below
        raw = gather_rows(a, r0, rt, mask, nl.uint8, "a_bytes")
        return fp8_rows_to_mx(raw, s_raw, mask, bytes_masked=True)
    raw = nl.ndarray((rt, k), dtype=nl.uint8, buffer=nl.sbuf, name="a_bytes")
    nisa.dma_copy(dst=raw, src=a.view(nl.uint8)[r0 : r0 + rt, :])
    return fp8_rows_to_bf16(raw, s_raw, mask, split)


def gather_rows(a, r0: int, rt: int, mask, dtype, name: str):
    """Rows ``[r0, r0 + rt)`` of HBM ``a [R, K]`` (as ``dtype``, same itemsize) into SBUF ``[rt, K]``, with the
    rows whose mask is 0 exact zeros: the tile is zeroed on GpSimd and the DMA gathers only the selected rows
    (``vector_offset`` indices; a masked row's index is out of range and ``oob_mode.skip`` leaves it zero — isa
    ``dma_copy`` page, access-pattern page). Padding bytes never reach an engine; no VectorE work per element."""
    r, k = a.shape
    dst = nl.ndarray((rt, k), dtype=dtype, buffer=nl.sbuf, name=name)
    if mask is None:
        nisa.dma_copy(dst=dst, src=a.ap(pattern=[[k, rt], [1, k]], offset=r0 * k, dtype=dtype))
        return dst
    nisa.memset(dst=dst, value=0, engine=nisa.engine.gpsimd)
    idx = nl.ndarray((rt, 1), dtype=nl.int32, buffer=nl.sbuf, name=f"{name}_idx")
    nisa.iota(dst=idx, pattern=[[0, 1]], offset=r0, channel_multiplier=1)  # r0 + p
    off = nl.ndarray((rt, 1), dtype=nl.int32, buffer=nl.sbuf, name=f"{name}_oob")
    nisa.tensor_scalar(dst=off, data=mask, op0=nl.multiply, operand0=float(-r), op1=nl.add, operand1=float(r))
    nisa.tensor_tensor(dst=idx, data1=idx, data2=off, op=nl.add)  # masked rows: index ≥ R (skipped)
    nisa.dma_copy(
        dst=dst,
        src=a.ap(pattern=[[k, rt], [1, k]], offset=0, vector_offset=idx, indirect_dim=0, dtype=dtype),
        oob_mode=nisa.oob_mode.skip,
    )
    return dst


def non_pow2_scale_count(a_scale, mask_tiles, psum_cnt):
    """Accumulate into ``psum_cnt`` (PSUM float32 ``[1, 1]``) how many selected rows of ``a_scale`` (HBM float32
    ``[R, K/g]``) hold a scale that is not a power of two (non-zero mantissa bits; masked rows ignored). The MX
    path is exact only when this is 0 (the E8M0 byte keeps the exponent alone), so kernels branch on it at run
    time (two runtime loops of trip count 0 / 1; no nested loop).

    Per 128-row tile: a bitvec ``tensor_scalar`` (mantissa & 0x7FFFFF, VectorE), ``min(·, 1)``, a max over the
    free axis, × the row mask, and a TensorE row sum (``flagᵀ · 1``) into the PSUM counter."""
    r, ng = a_scale.shape
    for t, r0 in enumerate(range(0, r, P)):
        rt = min(P, r - r0)
        s = nl.ndarray((rt, ng), dtype=nl.float32, buffer=nl.sbuf, name="pow2_s")
        nisa.dma_copy(dst=s, src=a_scale[r0 : r0 + rt, :])
        mant = nl.ndarray((rt, ng), dtype=nl.int32, buffer=nl.sbuf, name="pow2_mant")
        nisa.tensor_scalar(dst=mant, data=s.view(nl.int32), op0=nl.bitwise_and, operand0=0x7FFFFF)
        bad = nl.ndarray((rt, ng), dtype=nl.float32, buffer=nl.sbuf, name="pow2_bad")
        nisa.tensor_scalar(dst=bad, data=mant, op0=nl.minimum, operand0=1.0)
        row = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="pow2_row")
        nisa.tensor_reduce(dst=row, op=nl.maximum, data=bad, axis=(1,))
        if mask_tiles is not None:
            mk = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="pow2_mask")
            nisa.tensor_copy(dst=mk, src=mask_tiles[t])
            nisa.tensor_tensor(dst=row, data1=row, data2=mk, op=nl.multiply)
        rb = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="pow2_row_bf16")
        nisa.tensor_copy(dst=rb, src=row)
        ones = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="pow2_ones")
        nisa.memset(dst=ones, value=1.0)
        nisa.nc_matmul(dst=psum_cnt, stationary=rb, moving=ones, accumulate=t != 0)


def fp8_rows_to_bf16(raw, s_raw, mask=None, split: bool = False):
    """fp8 rows in SBUF → bf16 values (exact for pow2 scales; other fp32 scales round once to bf16).

    Args:
        raw: SBUF uint8 ``[rt, K]`` (e4m3fn bytes); s_raw: SBUF float32 ``[rt, K/g]``; mask: SBUF uint8
            ``[rt, 1]`` or None (masked rows: scale 0, and the decoded bytes are always finite, so exact zeros).

    Returns:
        SBUF bf16 ``[rt, K]``; with ``split``, ``(hi, lo)``: ``hi = bf16(q·s)``, ``lo = bf16(q·s − hi)`` from the
        fp32 product the reference forms (for non-pow2 scales; see :class:`ActOperand`).
    """
    rt, k = raw.shape
    g = k // s_raw.shape[1]
    a_nat = nl.ndarray((rt, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_nat")
    scale = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s256")
    nisa.tensor_scalar(dst=scale, data=s_raw, op0=nl.multiply, operand0=256.0)
    if mask is not None:
        zs = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s_masked")
        nisa.memset(dst=zs, value=0.0)
        nisa.tensor_copy_predicated(dst=zs, src=scale, predicate=mask.broadcast(1, k // g))
        scale = zs
    even = nl.ndarray((rt, k // 4), dtype=nl.uint32, buffer=nl.sbuf, name="a_even")
    odd = nl.ndarray((rt, k // 4), dtype=nl.uint32, buffer=nl.sbuf, name="a_odd")
    decode_e4m3fn_pairs(even, odd, raw.view(nl.uint32))
    if not split:
        fold_scales(a_nat, even.view(nl.float16), odd.view(nl.float16), scale, g)
        return a_nat
    a32 = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="a_f32")
    fold_scales(a32, even.view(nl.float16), odd.view(nl.float16), scale, g)  # q·s rounded once to fp32
    nisa.tensor_copy(dst=a_nat, src=a32)
    lo = nl.ndarray((rt, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_lo")
    nisa.tensor_tensor(dst=lo, data1=a32, data2=a_nat, op=nl.subtract)
    return a_nat, lo


def fp8_rows_to_mx(raw, s_raw, mask=None, bytes_masked: bool = False):
    """fp8 rows in SBUF → the MX row form: ``(bytes uint8 [rt, K], E8M0 uint8 [rt, K/32])``.

    The E8M0 byte of a power-of-two float32 scale is its exponent field ``(bits >> 23) & 0xFF`` (exact; the MX
    path needs pow2 activation scales); a 1×128 scale serves its four 32-groups. Masked rows get zero bytes and
    scale byte 127 (2^0), so padding (NaN bytes / NaN scales) never reaches the TensorE (``bytes_masked``: the
    bytes are zero already, e.g. from :func:`gather_rows`).
    """
    rt, k = raw.shape
    g = k // s_raw.shape[1]
    e8 = nl.ndarray((rt, k // g), dtype=nl.int32, buffer=nl.sbuf, name="a_e8_i32")
    nisa.tensor_scalar(
        dst=e8, data=s_raw.view(nl.int32), op0=nl.right_shift, operand0=23, op1=nl.bitwise_and, operand1=0xFF
    )
    e8b = nl.ndarray((rt, k // 32), dtype=nl.uint8, buffer=nl.sbuf, name="a_e8")
    if g == 32:
        nisa.tensor_copy(dst=e8b, src=e8)
    else:  # one 1×128 scale for its four 32-groups
        nisa.tensor_copy(dst=e8b.reshape((rt, k // g, g // 32)), src=e8.reshape((rt, k // g, 1)).broadcast(2, g // 32))
    if mask is None:
        return raw, e8b
    zb = raw
    if not bytes_masked:
        zb = nl.ndarray((rt, k), dtype=nl.uint8, buffer=nl.sbuf, name="a_bytes_masked")
        nisa.memset(dst=zb, value=0)
        nisa.tensor_copy_predicated(dst=zb, src=raw, predicate=mask.broadcast(1, k))
    zs = nl.ndarray((rt, k // 32), dtype=nl.uint8, buffer=nl.sbuf, name="a_e8_masked")
    nisa.memset(dst=zs, value=127)
    nisa.tensor_copy_predicated(dst=zs, src=e8b, predicate=mask.broadcast(1, k // 32))
    return zb, zs


def _pad_cols(t, k: int, fill, name: str):
    """``t [rt, K']`` → ``[rt, k]`` with columns ``K' …`` = ``fill`` (K padded to whole 512 blocks)."""
    rt, k0 = t.shape
    if k0 == k:
        return t
    out = nl.ndarray((rt, k), dtype=t.dtype, buffer=nl.sbuf, name=name)
    nisa.memset(dst=out[:, k0:], value=fill, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=out[:, :k0], src=t, engine=nisa.engine.gpsimd)
    return out


def act_rows_into_operand(op: ActOperand, rows, r0: int):
    """Write row tile ``rows`` (what :func:`load_act_rows` returned, ``rt ≤ 128`` rows) into columns
    ``[r0, r0 + rt)`` of the operand.

    natural / quad: bf16 TensorE transposes into bf16 PSUM (8 per bank), VectorE evacuation. mx: the bytes as
    uint32 words DMA-transposed (4-byte dtype) into the x4 tile; the E8M0 bytes placed on partitions
    ``32c + i`` by four free-dim copies and a bf16 TensorE transpose (values 0 … 255 exact in bf16).
    """
    if op.korder == "mx":
        kp = op.x4.shape[1] * 4 * P
        raw, e8 = _pad_cols(rows[0], kp, 0, "a_bytes_pad"), _pad_cols(rows[1], kp // 32, 127, "a_e8_pad")
        rt, k = raw.shape
        nmb = k // (4 * P)
        words = raw.view(nl.uint32).reshape((rt, nmb, P))
        nisa.dma_transpose(dst=op.x4.view(nl.uint32)[:, :, r0 : r0 + rt], src=words)
        # row layout [rt, mb, 128 slots], slot 32c + i = group 16mb + 4c + i
        slots = nl.ndarray((rt, nmb, P), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_e8_slots")
        nisa.memset(dst=slots, value=0.0)
        e4 = e8.reshape((rt, nmb, 4, 4))
        for c in range(4):
            nisa.tensor_copy(dst=slots[:, :, 32 * c : 32 * c + 4], src=e4[:, :, c, :])
        for mb in range(nmb):
            pt = nl.ndarray((P, rt), dtype=nl.bfloat16, buffer=nl.psum, name="a_e8_psum")
            nisa.nc_transpose(dst=pt, data=slots[:, mb, :])
            nisa.tensor_copy(dst=op.sc[:, mb, r0 : r0 + rt], src=pt)
        return
    parts = rows if isinstance(rows, tuple) else (rows,)
    assert len(parts) == (2 if op.aT_lo is not None else 1), "split operands take (hi, lo) row pairs"
    kp = op.aT.shape[1] * P
    parts = tuple(_pad_cols(t, kp, 0.0, "a_pad") for t in parts)
    for a_nat, aT in zip(parts, (op.aT, op.aT_lo)):
        rt, k = a_nat.shape
        nkb = k // P
        if op.korder == "natural":
            blk = [a_nat[:, c * P : (c + 1) * P] for c in range(nkb)]
        else:
            q = a_nat.reshape((rt, k // (4 * P), P, 4))
            blk = [q[:, c // 4, :, c % 4] for c in range(nkb)]
        for g0 in range(0, nkb, TRANSPOSES_PER_BANK):
            g = min(TRANSPOSES_PER_BANK, nkb - g0)
            pt = nl.ndarray((P, TRANSPOSES_PER_BANK, P), dtype=nl.bfloat16, buffer=nl.psum, name="aT_psum")
            for i in range(g):
                nisa.nc_transpose(dst=pt[:, i, :rt], data=blk[g0 + i])
            nisa.tensor_copy(dst=aT[:, g0 : g0 + g, r0 : r0 + rt], src=pt[:, :g, :rt], engine=nisa.engine.vector)


def load_act_operand(
    korder: str, a, a_scale, mask_tiles=None, name: str = "act", split: bool = False, kp: int | None = None
) -> ActOperand:
    """All rows of an HBM activation ``a [R, K]`` as a moving operand (masked rows exact zeros).

    Args:
        korder: the plan's ``korder``.
        a: HBM bf16 / float8_e4m3fn ``[R, K]``; a_scale: HBM float32 ``[R, K/g]`` (fp8) or None.
        mask_tiles: None, or one SBUF uint8 ``[rt, 1]`` predicate per 128-row tile.
        kp: the plan's ``kp`` (K padded to whole 512 blocks for the packed forms; the padding is zeros).
    """
    r, k = a.shape
    if korder == "quad_grp":
        return group_operand(load_act_operand("quad", a, a_scale, mask_tiles, name, split, kp))
    split = split and act_format(a) == "fp8" and korder != "mx"
    op = alloc_act_operand(korder, k if kp is None else kp, r, name, split)
    for t, r0 in enumerate(range(0, r, P)):
        rt = min(P, r - r0)
        rows = load_act_rows(a, a_scale, r0, rt, None if mask_tiles is None else mask_tiles[t], korder, split)
        act_rows_into_operand(op, rows, r0)
    return op


# ----------------------------------------------------------------------------------------------------------------
# fp8 activation decode (bit ops on VectorE, exact integer adds on GpSimd)
# ----------------------------------------------------------------------------------------------------------------
def decode_e4m3fn_pairs(even, odd, words):
    """e4m3fn bytes → fp16 values × 2^-8, four bytes per uint32 lane (exact, subnormals included: the e4m3fn
    and fp16 grids line up under ``(b & 0x80) << 8 | (b & 0x7F) << 7``).

    Args:
        even, odd: SBUF uint32 ``[p, F]`` outputs; viewed as fp16 ``[p, 2F]`` they hold bytes 0, 2 (even k)
            and 1, 3 (odd k) of each word.
        words: SBUF uint32 ``[p, F]``.
    """
    p, f = words.shape
    tmp = nl.ndarray((p, f), dtype=nl.uint32, buffer=nl.sbuf, name="e4_sign")
    nisa.tensor_scalar(dst=even, data=words, op0=nl.bitwise_and, operand0=_M_007F007F, op1=nl.left_shift, operand1=7)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=_M_00800080, op1=nl.left_shift, operand1=8)
    nisa.tensor_tensor(dst=even, data1=even, data2=tmp, op=nl.add, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=odd, data=words, op0=nl.bitwise_and, operand0=_M_7F007F00, op1=nl.right_shift, operand1=1)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=_M_80008000)
    nisa.tensor_tensor(dst=odd, data1=odd, data2=tmp, op=nl.add, engine=nisa.engine.gpsimd)


def fold_scales(dst, even_vals, odd_vals, scale, block: int, vector_blocks: int = 0, pre_scale: float | None = None):
    """``dst[:, k] = value(k) · scale[:, k // block]`` in natural k order, from de-interleaved halves.

    Args:
        dst: SBUF bf16 ``[p, K]``.
        even_vals, odd_vals: SBUF ``[p, K/2]`` values of k = 2j and k = 2j + 1 (fp16 or float8_e4m3).
        scale: SBUF float32 ``[p, K/block]`` (including the decoder's 2^8 factor for fp8; see pre_scale).
        block: scale granularity along K (32 or 128).
        vector_blocks: leading scale blocks multiplied on VectorE (load balance); GpSimd does the rest.
        pre_scale: a power of two the values are multiplied by before the scale, ``(value · pre_scale) · scale``
            in fp32 (the fp4 decoder's 2^6, where folding it into the scale could overflow). One VectorE
            ``scalar_tensor_tensor`` per half (a Vector Engine instruction: the NKI ISA reference's page for
            ``nki.isa.scalar_tensor_tensor``); vector_blocks is unused then.
    """
    p, k = dst.shape[0], math.prod(dst.shape[1:])
    nb, half = k // block, block // 2
    d4 = dst.reshape((p, nb, half, 2))
    sb = scale.reshape((p, nb, 1)).broadcast(2, half)
    for j, vals in ((0, even_vals), (1, odd_vals)):
        v3 = vals.reshape((p, nb, half))
        if pre_scale is not None:
            nisa.scalar_tensor_tensor(
                dst=d4[:, :, :, j], data=v3, op0=nl.multiply, operand0=pre_scale, op1=nl.multiply, operand1=sb
            )
            continue
        for b0, b1, eng in ((0, vector_blocks, nisa.engine.vector), (vector_blocks, nb, nisa.engine.gpsimd)):
            if b1 > b0:
                nisa.tensor_tensor(
                    dst=d4[:, b0:b1, :, j], data1=v3[:, b0:b1, :], data2=sb[:, b0:b1, :], op=nl.multiply, engine=eng
                )


# ----------------------------------------------------------------------------------------------------------------
# Rows back from K-major blocks
# ----------------------------------------------------------------------------------------------------------------
def rows_from_kmajor(rows_tiles, src_T, col0: int, r: int, engine=None):
    """Transpose ``src_T [P(n), R]`` (bf16) back into row tiles: ``rows_tiles[t][m, col0 + n] = src_T[n, t·128 + m]``
    (bf16 TensorE transposes into bf16 PSUM; the copy out on ``engine``, default VectorE — ScalarE when VectorE
    evacuates the GEMM)."""
    eng = nisa.engine.vector if engine is None else engine
    for t, dst in enumerate(rows_tiles):
        r0 = t * P
        rt = min(P, r - r0)
        pt = nl.ndarray((rt, P), dtype=src_T.dtype, buffer=nl.psum, name="rows_psum")
        nisa.nc_transpose(dst=pt, data=src_T[:, r0 : r0 + rt])
        nisa.tensor_copy(dst=dst[:, col0 : col0 + P], src=pt, engine=eng)
