"""NKI kernel: per-expert masked GEMM with a shared A operand (SPEC §1.6), for both weight layouts.

    D[m, n] = bf16( Σ_k A[m, k] · B_e[n, k] )   on the rows m where row_mask[m] is set, exact zeros elsewhere

Formats (activation × weight): bf16 × {bf16, fp8, fp4} and fp8 × {fp8, fp4}; fp8 A has float32 scales per 1×g
(g ∈ {32, 128}), fp8 B per 1×128 along K, fp4 B is e2m1 with UE8M0 scales per 1×32 along K.

``weight_layout="eio"`` (the prepared, K-major layout of ``python/static_moe/layouts.py``) runs on the tile
functions of ``nki_kernels/expert_gemm_tiles.py``: weights DMA'd K-major straight onto the partitions as the stationary
operand (no on-chip weight transpose); trn2 feeds fp8 as native ``float8_e4m3`` (bytes prepared by
``reencode_fp8_for_trn2``) with one PSUM group per 128-wide K block and the weight scale applied on evacuation;
trn3 runs fp8 × fp4 and fp8 × fp8 (MX form) through ``nc_matmul_mx`` into fp32 PSUM; fp4 elsewhere is decoded to
bf16 with its per-32 scales folded in (exact). See that module's docstring for every path and the documented
construct behind each instruction.

``weight_layout="eoi"`` (nn.Linear ``[L, N, K]``, unprepared) keeps the decode design: every weight block is
decoded to bf16 (scale folded, exact for pow2 scales; arbitrary fp32 fp8 scales round to bf16, ≤ 2^-9 relative),
transposed on the TensorE in bf16 (8 per PSUM bank) and evacuated by ScalarE, then multiplied with the whole K in
one fp32 PSUM group. The decoders are the tile module's: e4m3fn byte → fp16 bits ``(b & 0x80) << 8 | (b & 0x7F)
<< 7`` (value × 2^-8), e2m1 nibble → float8_e4m3 byte ``(c & 8) << 4 | (c & 7) << 2`` (value × 2^-6), bit ops on
VectorE only and the disjoint fields joined by an exact integer add on GpSimd. It is correct on trn2 and trn3
and costs one transpose per 128×128 weight block: prepare weights (``layouts.prepare_weight``) for speed.

Rows: A is decoded once to ``A^T [k, K/128, R]`` bf16 (masked rows exact zeros before any arithmetic) and is the
moving operand; each row is its own column, summed over the same K blocks in the same order whatever the other
rows are (batch invariance). The output lands as ``D^T [n, R]`` per 128 features and is transposed back (bf16
TensorE transposes) into row tiles for the store.

Skip unrouted experts: ``skip_unrouted=True`` wraps all weight traffic in a runtime loop (``nl.fori_loop``, ISA
page; trip count ``min(Σ row_mask, 1)`` loaded by ``register_load`` from a plain (1, 1) SBUF tile) — an expert no
row selects reads no weight byte. ``skip_unrouted=False`` is the static variant.

LNC = 2 (``kernel[2]``): the output columns are split over the two logical cores (``nki_kernels/lnc.py``) in
whole weight slabs (EIO: ``plan.ncols`` columns; EOI: one DMA group of row blocks): core 0 the first ⌈slabs / 2⌉,
core 1 the rest, so each streams about half the expert's weights. Both cores build the same A operand (and the
same runtime-loop trip counts) from all rows; a slab's instructions depend only on its first column, so every
output column is computed as on one core, and each core stores only its own columns: bitwise the LNC = 1
result. With one slab, core 1 reads nothing and writes nothing. Splitting N over ``nl.program_id``, as
nki-library's ``core/mlp/mlp_cte/mlp_cte_sharding.py`` cuts its intermediate dimension into per-program
offsets.

Documented constructs used here beyond the tile module's list: ``nc_transpose`` of bf16 blocks into bf16 PSUM
(ISA ``nc_transpose``), ``register_load`` from a (1, 1) SBUF tile and ``fori_loop`` with a register bound (ISA
``register_load`` / ``nl.fori_loop``, NKI 0.6), ``tensor_copy_predicated`` (ISA), HBM ``.ap(scalar_offset=
<register>)`` for a runtime expert id (``deep-dives/nki-aps.rst``). Runtime loops need NKI >= 0.6; everything
else NKI >= 0.3.
"""

from __future__ import annotations

from dataclasses import replace

from static_moe.nki.shim import nisa, nl

from .expert_gemm_tiles import (  # noqa: F401  (re-exported: the tile API lives in expert_gemm_tiles)
    _M_1C1C1C1C,
    GROUP_PATH_MAX_ROWS,
    MOVING_MAX,
    TRANSPOSES_PER_BANK,
    P,
    WeightRing,
    _mask_tile,
    act_format,
    decode_e2m1_nibbles,
    decode_e4m3fn_pairs,
    fold_scales,
    gemm_block,
    load_act_operand,
    load_weight_slab,
    non_pow2_scale_count,
    rows_from_kmajor,
    weight_plan,
)
from .lnc import core_share

W_DMA_MIN_BYTES = 2048  # per partition: group weight row-blocks until a DMA moves at least this much
WEIGHT_LAYOUTS = ("eoi", "eio")


# ----------------------------------------------------------------------------------------------------------------
# Formats (compile-time: read from the dtypes)
# ----------------------------------------------------------------------------------------------------------------
def weight_format(b) -> str:
    """``"bf16"``, ``"fp8"`` (float8_e4m3fn) or ``"fp4"`` (uint8, two e2m1 per byte) for a weight tensor."""
    if b.dtype == nl.bfloat16:
        return "bf16"
    if b.dtype == nl.float8_e4m3fn:
        return "fp8"
    if b.dtype == nl.uint8:
        return "fp4"
    raise TypeError(f"weight dtype {b.dtype} is not bf16, float8_e4m3fn or uint8 (fp4)")


def weight_k(b, fmt: str) -> int:
    """The contraction length K of a weight ``[L, N, K]`` (``[L, N, K/2]`` for fp4)."""
    return b.shape[2] * (2 if fmt == "fp4" else 1)


def _row_bytes(fmt: str, k: int) -> int:
    return {"bf16": 2 * k, "fp8": k, "fp4": k // 2}[fmt]


def rows_per_dma(fmt: str, k: int, nblocks: int) -> int:
    """How many 128-row weight blocks one DMA loads: enough for ``W_DMA_MIN_BYTES`` per partition, dividing
    ``nblocks``."""
    c = max(1, -(-W_DMA_MIN_BYTES // _row_bytes(fmt, k)))
    while nblocks % c:
        c -= 1
    return c


# ----------------------------------------------------------------------------------------------------------------
# HBM views
# ----------------------------------------------------------------------------------------------------------------
def expert_rows(t, e, row0: int, nblk: int, dtype=None):
    """HBM view ``[P, nblk, C]`` of rows ``row0 + j·128 + p`` of expert ``e`` of ``t [L, N, C]``.

    ``e`` is a Python int (static) or a register (runtime expert id: an ``.ap`` with ``scalar_offset``, so the
    DMA reads only that expert's bytes). ``dtype`` reinterprets the bytes (e.g. e4m3fn → uint8) so the DMA moves
    bytes instead of converting values.
    """
    _, _, c = t.shape
    if isinstance(e, int):
        v = t if dtype is None else t.view(dtype)
        v = v[e, row0 : row0 + nblk * P, :]
        return v.reshape((nblk, P, c)).permute((1, 0, 2))
    return t.ap(pattern=[[c, P], [P * c, nblk], [1, c]], offset=row0 * c, scalar_offset=e, indirect_dim=0, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Decoders: shared with the EIO tiles (nki_kernels/expert_gemm_tiles.py): bit ops on VectorE, exact integer adds on
# GpSimd, immediates exact in fp32
# ----------------------------------------------------------------------------------------------------------------
def decode_e2m1_pairs(lo, hi, words):
    """Packed e2m1 → float8_e4m3 bytes holding the value × 2^-6; byte b of ``lo`` / ``hi`` decodes the low / high
    nibble of byte b of each uint32 word (see :func:`expert_gemm_tiles.decode_e2m1_nibbles`)."""
    decode_e2m1_nibbles(lo, hi, words, _mask_tile(_M_1C1C1C1C, "m_1c"))


def ue8m0_to_scale(dst_i32, ue8m0):
    """UE8M0 bytes b → float32 ``2^(b − 127)`` (returned as ``dst_i32.view(float32)``), exact for every b ≤ 254.

    Built from the bits in one instruction: ``max(b · 2^23, 2^22)`` in fp32 arithmetic (exact: integers below
    2^31 with few significant bits), stored as int32 — b ≥ 1 gives the exponent field b, and b = 0 the subnormal
    bits 0x00400000 (2^-127), as SPEC §1.2 decodes it.
    """
    nisa.tensor_scalar(
        dst=dst_i32, data=ue8m0, op0=nl.multiply, operand0=float(1 << 23), op1=nl.maximum, operand1=float(1 << 22)
    )
    return dst_i32.view(nl.float32)


# ----------------------------------------------------------------------------------------------------------------
# EOI weights: HBM row blocks → decoded bf16 → K-major (transposed in bf16) tiles
# ----------------------------------------------------------------------------------------------------------------
def load_weight_blocks(w_nat, b, b_scale, e, row0: int, nblk: int, fmt: str, k: int):
    """Load ``nblk`` 128-row blocks of expert ``e`` (EOI) and decode them to bf16 in natural layout.

    Args:
        w_nat: SBUF bf16 ``[P, nblk, K]`` output; ``w_nat[p, j, k] = B_e[row0 + j·128 + p, k]`` (dequantized).
        b: HBM weights ``[L, N, K]`` bf16 / float8_e4m3fn, or uint8 ``[L, N, K/2]`` (fp4).
        b_scale: HBM float32 ``[L, N, K/128]`` (fp8), uint8 ``[L, N, K/32]`` (fp4), or None (bf16).
        e: expert index (int or register).

    Notes:
        One DMA for the weights and one for the scales. Engines: VectorE (bit ops), GpSimd (integer adds and
        the scale fold).
    """
    if fmt == "bf16":
        nisa.dma_copy(dst=w_nat, src=expert_rows(b, e, row0, nblk))
        return
    kb = _row_bytes(fmt, k)
    raw = nl.ndarray((P, nblk, kb), dtype=nl.uint8, buffer=nl.sbuf, name="w_raw")
    nisa.dma_copy(dst=raw, src=expert_rows(b, e, row0, nblk, dtype=nl.uint8))
    words = raw.reshape((P, nblk * kb)).view(nl.uint32)
    nw = nblk * kb // 4
    even = nl.ndarray((P, nw), dtype=nl.uint32, buffer=nl.sbuf, name="w_even")
    odd = nl.ndarray((P, nw), dtype=nl.uint32, buffer=nl.sbuf, name="w_odd")
    if fmt == "fp8":
        nsc = k // 128
        s_raw = nl.ndarray((P, nblk, nsc), dtype=nl.float32, buffer=nl.sbuf, name="w_s")
        nisa.dma_copy(dst=s_raw, src=expert_rows(b_scale, e, row0, nblk))
        scale = nl.ndarray((P, nblk * nsc), dtype=nl.float32, buffer=nl.sbuf, name="w_s256")
        nisa.tensor_scalar(dst=scale, data=s_raw.reshape((P, nblk * nsc)), op0=nl.multiply, operand0=256.0)
        decode_e4m3fn_pairs(even, odd, words)
        fold_scales(w_nat.reshape((P, nblk * k)), even.view(nl.float16), odd.view(nl.float16), scale, 128)
    else:  # fp4
        nsc = k // 32
        s_raw = nl.ndarray((P, nblk, nsc), dtype=nl.uint8, buffer=nl.sbuf, name="w_e8")
        nisa.dma_copy(dst=s_raw, src=expert_rows(b_scale, e, row0, nblk))
        s_i32 = nl.ndarray((P, nblk * nsc), dtype=nl.int32, buffer=nl.sbuf, name="w_s_bits")
        decode_e2m1_pairs(even, odd, words)
        # the decoder's 2^-6 is undone on the values (value·2^-6·2^6, exact in fp32), not folded into the scale:
        # 2^(b − 127 + 6) overflows float32 for bytes 249 … 254, where the weight itself is finite
        scale = ue8m0_to_scale(s_i32, s_raw.reshape((P, nblk * nsc)))
        fold_scales(
            w_nat.reshape((P, nblk * k)),
            even.view(nl.float8_e4m3),
            odd.view(nl.float8_e4m3),
            scale,
            32,
            pre_scale=64.0,
        )


def transpose_blocks(dst_kmajor, src, ncols: int, nkb: int, evac_engines=None):
    """``dst_kmajor[:, kb, :ncols] = src[:ncols, kb·128:(kb+1)·128]^T`` for kb < nkb, on the TensorE (bf16).

    Args:
        dst_kmajor: SBUF bf16 ``[P, nkb, ncols]`` (k on partitions).
        src: SBUF bf16 ``[ncols, nkb·128]`` (rows on partitions), ncols ≤ 128.
        evac_engines: engines that copy PSUM → SBUF, used in turn per PSUM bank (default ScalarE).
    """
    assert src.dtype == nl.bfloat16, "TensorE transposes here are bf16 into bf16 PSUM (never fp8)"
    engines = (nisa.engine.scalar,) if evac_engines is None else tuple(evac_engines)
    for i, g0 in enumerate(range(0, nkb, TRANSPOSES_PER_BANK)):
        g = min(TRANSPOSES_PER_BANK, nkb - g0)
        pt = nl.ndarray((P, TRANSPOSES_PER_BANK, P), dtype=src.dtype, buffer=nl.psum, name="t_psum")
        for j in range(g):
            kb = g0 + j
            nisa.nc_transpose(dst=pt[:, j, :ncols], data=src[:ncols, kb * P : (kb + 1) * P])
        nisa.tensor_copy(
            dst=dst_kmajor[:, g0 : g0 + g, :ncols], src=pt[:, :g, :ncols], engine=engines[i % len(engines)]
        )


def weight_evac_engines(fmt: str):
    """PSUM-evacuation engines for transposed weight blocks of a format (see transpose_blocks)."""
    return (nisa.engine.scalar, nisa.engine.vector) if fmt == "bf16" else (nisa.engine.scalar,)


def load_weight_group(b, b_scale, e, row0: int, nblk: int, fmt: str, k: int):
    """Load ``nblk`` 128-row EOI weight blocks of expert ``e``, decoded: SBUF bf16 ``[P, nblk, K]``."""
    w = nl.ndarray((P, nblk, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="w_nat")
    load_weight_blocks(w, b, b_scale, e, row0, nblk, fmt, k)
    return w


def block_times_rows(dst, group, j: int, aT, fmt: str, k: int, r: int):
    """``dst [P(n), R] = bf16(W_j · Aᵀ)`` for block j of a loaded EOI group: bf16 transpose, GEMM, one rounding.

    Args:
        dst: SBUF bf16 ``[P, R]``.
        group: what :func:`load_weight_group` returned.
        aT: SBUF bf16 ``[P(k), K/128, R]`` (natural k order).
    """
    nkb = k // P
    wT = nl.ndarray((P, nkb, P), dtype=nl.bfloat16, buffer=nl.sbuf, name="wT")
    transpose_blocks(wT, group[:, j, :], P, nkb, weight_evac_engines(fmt))
    o_ps = nl.ndarray((P, r), dtype=nl.float32, buffer=nl.psum, name="o_psum")
    gemm_ws(o_ps, wT, aT, nkb, r)
    nisa.tensor_copy(dst=dst, src=o_ps, engine=nisa.engine.vector)  # the one bf16 rounding


def load_row_mask_tiles(row_mask, r: int):
    """``row_mask`` HBM ``[R]`` (bool stored as uint8) → SBUF uint8 ``[rt, 1]`` tiles of 128 rows."""
    tiles = []
    m2 = row_mask.reshape((r, 1))
    for r0 in range(0, r, P):
        rt = min(P, r - r0)
        t = nl.ndarray((rt, 1), dtype=nl.uint8, buffer=nl.sbuf, name="row_mask")
        nisa.dma_copy(dst=t, src=m2[r0 : r0 + rt, :])
        tiles.append(t)
    return tiles


def gemm_ws(out_psum, wT, aT, nkb: int, r: int):
    """``out_psum[n, m] = Σ_k wT[k, ·, n] · aT[k, ·, m]``: weights stationary, rows moving (≤ 512 per matmul).

    Args:
        out_psum: PSUM float32 ``[P, R]``.  wT: SBUF bf16 ``[P(k), nkb, P(n)]``.  aT: SBUF bf16 ``[P(k), nkb, R]``.
    """
    for m0 in range(0, r, MOVING_MAX):
        mr = min(MOVING_MAX, r - m0)
        for kb in range(nkb):
            nisa.nc_matmul(
                dst=out_psum[:, m0 : m0 + mr],
                stationary=wT[:, kb, :],
                moving=aT[:, kb, m0 : m0 + mr],
                accumulate=kb != 0,
            )


def _row_count(mask_tiles, name: str):
    """PSUM float32 ``(1, 1)``: ``Σ_m mask[m]``, a cross-partition sum on the TensorE (``mask^T · 1``), exact."""
    cnt = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum, name=name)
    for t, mask in enumerate(mask_tiles):
        rt = mask.shape[0]
        mf = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="mask_bf16")
        nisa.tensor_copy(dst=mf, src=mask)
        ones = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="ones")
        nisa.memset(dst=ones, value=1.0)
        nisa.nc_matmul(dst=cnt, stationary=mf, moving=ones, accumulate=t != 0)
    return cnt


def any_row_register(mask_tiles):
    """A register holding ``min(Σ_m mask[m], 1)``: the trip count of a skip-if-unrouted runtime loop.

    The row count is a cross-partition sum on the TensorE (``mask^T · 1``), clamped, stored to a (1, 1) SBUF tile
    and loaded with ``register_load`` (a plain tile: no indirection).
    """
    cnt = _row_count(mask_tiles, "row_count")
    flag = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="any_row")
    nisa.tensor_scalar(dst=flag, data=cnt, op0=nl.minimum, operand0=1.0)
    reg = nisa.register_alloc(0)
    nisa.register_load(reg, flag)
    return reg


def _mx_trips(a_scale, masks, skip_unrouted: bool):
    """Registers ``(mx, fallback)``: trip counts (0 or 1) of the MX body (every selected row's activation scales
    are powers of two) and of the bf16-decode fallback (some are not); both 0 for an unrouted expert under
    ``skip_unrouted``. Computed on chip from plain (1, 1) tiles (no indirection)."""
    bad = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum, name="non_pow2_rows")
    non_pow2_scale_count(a_scale, masks, bad)
    fb = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf, name="fallback_f")
    nisa.tensor_scalar(dst=fb, data=bad, op0=nl.minimum, operand0=1.0)  # 1 if any non-pow2 scale
    mx = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf, name="mx_f")
    nisa.tensor_scalar(dst=mx, data=fb, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
    if skip_unrouted:
        cnt = _row_count(masks, "row_count_mx")
        anyr = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf, name="any_row_f")
        nisa.tensor_scalar(dst=anyr, data=cnt, op0=nl.minimum, operand0=1.0)
        for f in (fb, mx):
            nisa.tensor_tensor(dst=f, data1=f, data2=anyr, op=nl.multiply)
    regs = []
    for f in (mx, fb):
        fi = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="trip")
        nisa.tensor_copy(dst=fi, src=f)
        reg = nisa.register_alloc(0)
        nisa.register_load(reg, fi)
        regs.append(reg)
    return regs


def _bias_epilogue(bias, expert: int, row_mask, r: int, n: int):
    """The SPEC §1.9 bias epilogue of :func:`expert_gemm_kernel`: ``epilogue(dst [P, R] bf16, sum [P, R] fp32,
    n0)`` writes ``bf16(sum + bias[expert, n0 + p])`` on masked-in rows and +0 on the others (features on
    partitions, rows along the free dim).

    Loaded once: the expert's bias as ``[P, N/128]`` columns (element ``[p, c]`` = bias[e, 128c + p]) and the row
    mask broadcast to every partition (``[P, R]`` uint8, a stride-0 partition step in the HBM access pattern). The
    add is a ``tensor_scalar`` with a (P, 1) operand on the fp32 sum, rounding once to bf16; a
    ``tensor_copy_predicated`` on the mask then writes those rows over zeros, so a non-finite bias never reaches a masked row (a product with the
    mask would turn 0 · inf into NaN). Documented constructs: ``dma_copy`` from an HBM ``.ap(pattern, offset)``
    view (``deep-dives/nki-aps.rst``), ``tensor_scalar``, ``tensor_copy_predicated`` (ISA pages)."""
    cols = nl.ndarray((P, n // P), dtype=nl.float32, buffer=nl.sbuf, name="bias_cols")
    nisa.dma_copy(dst=cols, src=bias.ap(pattern=[[1, P], [P, n // P]], offset=int(expert) * n))
    mask = nl.ndarray((P, r), dtype=nl.uint8, buffer=nl.sbuf, name="row_mask_bcast")
    nisa.dma_copy(dst=mask, src=row_mask.ap(pattern=[[0, P], [1, r]], offset=0))

    def epilogue(dst, acc, n0: int):
        c = n0 // P
        biased = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="o_biased")
        nisa.tensor_scalar(dst=biased, data=acc, op0=nl.add, operand0=cols[:, c : c + 1])  # the one rounding
        nisa.memset(dst=dst, value=0.0)
        nisa.tensor_copy_predicated(dst=dst, src=biased, predicate=mask)

    return epilogue


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------
def _check_eio(a, b, k: int, n: int):
    plan = weight_plan(b, act_format(a), rows=a.shape[0])
    assert plan.k == k, f"A has K={k}, B has K={plan.k}"
    return plan


def expert_gemm_kernel(a, a_scale, b, b_scale, row_mask, expert, skip_unrouted=True, weight_layout="eoi", bias=None):
    """Per-expert masked GEMM with a shared A (SPEC §1.6), either weight layout.

    Dimensions:
        R: rows of A (the gathered tokens), K: contraction (hidden or intermediate), N: output features,
        L: local experts, g: activation scale group (32 or 128).

    Args:
        a (nl.ndarray): [R, K] in HBM, bf16 or float8_e4m3fn — the shared A operand.
        a_scale (nl.ndarray): [R, K/g] float32 in HBM for fp8 A, else None.
        b (nl.ndarray): the weights in HBM. "eoi": [L, N, K] bf16 / float8_e4m3fn, or [L, N, K/2] uint8 (fp4).
            "eio": [L, K, N] bf16 / float8_e4m3fn (trn2: re-encoded), [L, K/4, N] uint32 (fp8 MX, trn3) or
            [L, K/4, N] uint16 (fp4).
        b_scale (nl.ndarray): "eoi": [L, N, K/128] float32 (fp8) or [L, N, K/32] uint8 UE8M0 (fp4); "eio":
            [L, K/128, N] float32 (fp8) or [L, K/32, N] uint8 (fp8 MX, fp4); None for bf16.
        row_mask (nl.ndarray): [R] bool (uint8) in HBM — the rows this expert serves.
        expert (int): local expert index (compile-time constant).
        skip_unrouted (bool): True: weights are read inside a runtime loop that runs only if some row is set.
        weight_layout (str): "eoi" or "eio".
        bias (nl.ndarray | None): [L, N] float32 in HBM (SPEC §1.9): ``bf16(Σ_k A·B_e + bias[e])``, added in fp32
            before the one rounding; masked rows stay zero (:func:`_bias_epilogue`).

    Returns:
        out (nl.ndarray): [R, N] bf16 in shared HBM; ``bf16(Σ_k A·B_e (+ bias[e]))`` on masked-in rows, ±0
        elsewhere.

    Notes:
        - K and N multiples of 128 (the packed "eio" forms pad K to whole 512 blocks with zeros on chip); R any
          (row tiles of 128, moving chunks of 512).
        - LNC = 2: core 0 computes and stores the first ⌈slabs / 2⌉ weight slabs' columns, core 1 the others
          (module doc); with a single slab core 1 does nothing.
        - "eio" fp8 × fp8 MX and fp8 × fp4 on trn3 run ``nc_matmul_mx`` when every selected row's activation
          scales are powers of two (SPEC §1.1 produces only those; the E8M0 byte is the exponent field); if any
          is not, a second runtime loop runs the same weights through the exact bf16 decode instead, with the
          activations as a bf16 pair (hi + lo, two matmuls per block: ~16 significant bits) — decided on chip.
        - Elsewhere fp8 activations enter as bf16 ``q·s``: exact for power-of-two scales; other fp32 scales round
          to bf16 (≤ 2^-9 relative per element).
        - Constructs: every instruction form used is listed with its doc page / public kernel in this module's
          docstring and in ``nki_kernels/expert_gemm_tiles.py``'s; the interpreter refuses the undocumented ones
          (docs/backends/nki_interpreter.md, rules sbuf-indirect-operand, gpsimd-bitvec, immediate-range,
          fp8-transpose).

    Pseudocode:
        aT = Kmajor(mask ? dequant(A) : 0)                           # once (x4 + E8M0 for the MX path)
        out_rows = 0
        for _ in fori_loop(0, min(Σ mask, 1)):                      # (skip variant)
            for each weight slab / group of expert e of this core:  # EIO: K-major DMA; EOI: decode + transpose
                for nb in its 128-column blocks:
                    oT[n, m] = bf16(Σ_k W[k, n] · aT[k, m])          # PSUM fp32 (per-block scales on evacuation)
                    out_rows[:, nb] = transpose(oT)
        store(out_rows)
    """
    assert weight_layout in WEIGHT_LAYOUTS, f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}"
    r, k = a.shape
    if weight_layout == "eio":
        plan = _check_eio(a, b, k, b.shape[2])
        n = plan.n
    else:
        fmt_b = weight_format(b)
        n = b.shape[1]
        check_k = weight_k(b, fmt_b)
        assert check_k == k, f"A has K={k}, B has K={check_k}"
        assert k % P == 0 and n % P == 0, f"K={k} and N={n} must be multiples of {P}"
        plan = None

    out = nl.ndarray((r, n), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="out")
    # this core's output columns: whole slabs (EIO) or DMA groups of row blocks (EOI), see the module doc
    unit = plan.ncols if plan is not None else rows_per_dma(fmt_b, k, n // P) * P
    c0, nc = core_share(n, unit, "expert_gemm")
    if nc == 0:  # LNC = 2 with a single slab: core 0 computes every column
        return out
    masks = load_row_mask_tiles(row_mask, r)
    act = load_act_operand(
        plan.korder if plan is not None else "natural", a, a_scale, masks, kp=None if plan is None else plan.kp
    )

    epilogue = None if bias is None else _bias_epilogue(bias, expert, row_mask, r, n)
    out_rows = []
    for r0 in range(0, r, P):
        t = nl.ndarray((min(P, r - r0), nc), dtype=nl.bfloat16, buffer=nl.sbuf, name="out_rows")
        if skip_unrouted:
            nisa.memset(dst=t, value=0.0, engine=nisa.engine.gpsimd)  # what an unrouted expert returns
        out_rows.append(t)

    def body_eio(plan=plan, act=act):
        ring = WeightRing(plan)
        for n0 in range(c0, c0 + nc, plan.ncols):
            slab = load_weight_slab(ring, b, b_scale, expert, n0)
            for j in range(plan.ncols // P):
                o_bf = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="o_bf16")
                # fp8_block / quad_grp evacuate on VectorE + GpSimd: the row copies go to ScalarE; the other
                # paths evacuate on ScalarE and copy rows on VectorE
                vec_evac = plan.path in ("fp8_block", "quad_grp")
                if epilogue is None:
                    gemm_block(o_bf, slab, j, act, r, out_engine=nisa.engine.scalar)
                else:
                    o_f = nl.ndarray((P, r), dtype=nl.float32, buffer=nl.sbuf, name="o_sum")
                    gemm_block(o_f, slab, j, act, r, out_engine=nisa.engine.scalar)
                    epilogue(o_bf, o_f, n0 + j * P)
                rows_from_kmajor(out_rows, o_bf, n0 - c0 + j * P, r, nisa.engine.scalar if vec_evac else None)
            slab = None  # the decoded planes of a slab die here, before the next slab is decoded

    def body_eoi():
        grp = rows_per_dma(fmt_b, k, n // P)
        for g0 in range(c0 // P, (c0 + nc) // P, grp):
            group = load_weight_group(b, b_scale, expert, g0 * P, grp, fmt_b, k)
            for j in range(grp):
                o_bf = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="o_bf16")
                if epilogue is None:
                    block_times_rows(o_bf, group, j, act.aT, fmt_b, k, r)
                else:
                    o_f = nl.ndarray((P, r), dtype=nl.float32, buffer=nl.sbuf, name="o_sum")
                    block_times_rows(o_f, group, j, act.aT, fmt_b, k, r)
                    epilogue(o_bf, o_f, (g0 + j) * P)
                rows_from_kmajor(out_rows, o_bf, (g0 + j) * P - c0, r)

    body = body_eio if plan is not None else body_eoi
    if plan is not None and plan.path == "mx":
        # the MX path is exact for power-of-two activation scales only (the E8M0 byte is the exponent field);
        # any other scale on a selected row runs the weights through the exact bf16 decode instead
        trips = _mx_trips(a_scale, masks, skip_unrouted)
        nl.fori_loop(0, trips[0], lambda _i: body())
        grp = r <= GROUP_PATH_MAX_ROWS[plan.fmt]
        plan_q = replace(plan, path="quad_grp" if grp else "quad_bf16", korder="quad_grp" if grp else "quad")

        def body_quad(_i):
            body_eio(plan_q, load_act_operand(plan_q.korder, a, a_scale, masks, name="act_q", split=True, kp=plan_q.kp))

        nl.fori_loop(0, trips[1], body_quad)
    elif skip_unrouted:
        nl.fori_loop(0, any_row_register(masks), lambda _i: body())
    else:
        body()

    for t, rows in enumerate(out_rows):
        nisa.dma_copy(dst=out[t * P : t * P + rows.shape[0], c0 : c0 + nc], src=rows)
    return out
