"""NKI kernel: SwiGLU with clamp and routing weight, then bf16 or fp8 (1×g power-of-two scales) cast.

Runs through the real NKI when it is importable and through the repository's NKI interpreter otherwise (see
``static_moe.nki.shim``). NKI >= 0.3 API only (destination-first ``nisa`` calls, ``nl.ndarray`` buffers);
the per-group scale is applied through a ``.broadcast`` view (NKI >= 0.5).

LNC = 2 (``kernel[2]``): the row tiles are split over the two logical cores (``nki_kernels/lnc.py``; core 0 the
first ⌈tiles / 2⌉, core 1 the rest). The tile shape (groups per partition, rows per tile) is chosen from all R
rows before the split, so every tile runs the same instructions as on one core and each core stores only its
own rows: bitwise the LNC = 1 result. With one tile (decode's few rows, usually) core 1 has nothing to do. The
split follows nki-library's ``core/subkernels/indexed_flatten.py`` (rows over ``nl.program_id``).
"""

from __future__ import annotations

import math

import numpy as np

from static_moe.activations import DEFAULT_ALPHA
from static_moe.nki.shim import nisa, nl

from .lnc import core_tiles

AMAX_FLOOR = 1e-4  # SPEC §1.1
FP8_E4M3_TRN2_MAX = 240.0  # Neuron float8_e4m3 (trn2 on-chip fp8)
FP8_E4M3FN_MAX = 448.0  # OCP float8_e4m3fn
# gelu_tanh's constants (SPEC §1.9): c = 2·sqrt(2/π) and the cubic coefficient, rounded to float32 on chip as
# static_moe.activations rounds them
GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")
MAX_PARTITION_COLS = 4096  # columns per partition (~18 B/column of SBUF: ~72 KiB per tile at most)


def _blocks_per_partition(rows: int, n_groups: int, group_size: int) -> int:
    """m: scale groups per partition. The smallest divisor of G that keeps the row-major tile count
    (ceil(R / 128)) — so few rows still spread over many partitions — and at most MAX_PARTITION_COLS columns."""
    tiles = -(-rows // 128)
    for m in range(1, n_groups + 1):
        if n_groups % m == 0 and -(-rows * (n_groups // m) // 128) <= tiles and m * group_size <= MAX_PARTITION_COLS:
            return m
    return max(m for m in range(1, n_groups + 1) if n_groups % m == 0 and m * group_size <= MAX_PARTITION_COLS)


def swiglu_and_cast(
    gate_up,
    row_weight=None,
    swiglu_limit=None,
    out_format="fp8",
    group_size=128,
    fp8_max=FP8_E4M3_TRN2_MAX,
    pow2_scale=True,
    activation="silu",
    alpha=DEFAULT_ALPHA,
):
    """SwiGLU with clamp and per-row routing weight, then a cast to bf16 or to fp8 with 1×g scales.

    Dimensions:
        R: rows (gathered tokens), any count >= 1.
        I: intermediate size; gate_up holds 2I columns (gate half, then up half).
        G: I / group_size scale groups per row (bf16 mode: blocks of up to 128 columns).
        m: groups per partition; B = G / m column blocks per row. A partition holds one (row, block) pair,
           so a tile is [rows_per_tile · B partitions, m · g columns] with rows_per_tile = 128 // B.

    Args:
        gate_up (HBM): [R, 2I] bfloat16 or float32, the GEMM1 output.
        row_weight (HBM): [R] float32 routing weight per row, or None (weight 1).
        swiglu_limit (constant): float or None. Clamp gate from above and up on both sides at the limit.
        out_format (constant): "fp8" or "bf16".
        group_size (constant): g in {32, 128}; I % g == 0 (fp8 only).
        fp8_max (constant): 240.0 on trn2 (on-chip ``float8_e4m3``); 448.0 needs native e4m3fn (trn3).
        pow2_scale (constant): must be True: scales are powers of two (UE8M0), built exactly from bits.
        activation (constant): the gated activation of SPEC §1.9: "silu" (``g·σ(g)·u``), "swiglu_oai"
            (``(u + 1)·(g·σ(α·g))``) or "gelu_tanh" (``g·σ(c·(g + ((0.044715·g)·g)·g))·u``, c = 2√(2/π)); the
            clamp is the same for every activation.
        alpha (constant): α of "swiglu_oai" (positive, finite in float32; unused by the others).

    Returns:
        "fp8": (q, s) — q float8_e4m3fn [R, I] (HBM, shared), s float32 [R, G] (HBM, shared).
        "bf16": out bfloat16 [R, I] (HBM, shared). (The op's empty [R, 0] scale is made by the caller:
        NKI tensors cannot have a zero-sized dim.)

    Notes:
        - Layout: decode has few rows, and the engines are lane-parallel over partitions, so a row-per-partition
          layout would leave most lanes idle and make every instruction I columns long. Each row is cut into
          B blocks of m·g columns and every (row, block) pair gets a partition; m is the smallest divisor of G
          that keeps ceil(R/128) tiles (R = 1, I = 2048, g = 128: 16 partitions × 128 columns instead of
          1 × 2048). The HBM↔SBUF DMAs stay one per tile and operand, because the tile's row-major order equals
          HBM's (a DMA only needs equal element counts).
        - Math in fp32 on chip, in the reference's order: ``v = ((silu(g) · u) · w)``; the SPEC §1.9 variants
          in theirs (:func:`_gated_into`). Still one pass: the variants add on-chip instructions, no HBM traffic.
        - The scale of a group is ``s = 2^ceil(log2(max(amax, 1e-4) / fp8_max))``, computed exactly from the
          bits of amax: the ISA has no correctly rounded divide, but for a normal amax = 1.f·2^e and
          fp8_max = 1.m·2^k, ``round_up_pow2(fl(amax / fp8_max)) = 2^(e - k + [f > m])`` — the same bits the
          reference gets. ``1/s`` is built the same way, so ``v · (1/s)`` equals the reference's ``v / s``, and
          ``|v / s| <= fp8_max`` holds exactly, so the reference's clamp is a no-op and is skipped.
        - With fp8_max <= 240 the quantized values are cast to trn2's ``float8_e4m3`` and written as bytes:
          for |x| <= 240 its encoding equals OCP ``float8_e4m3fn``, so the output is valid e4m3fn.
        - Rows of weight 0 give q = ±0 and the floor scale, as the reference does.
        - Hardware silu is a piecewise approximation: compare with SPEC §2's fp8 tolerance.
        - pow2_scale=False is rejected: a bit-exact fp32 division by fp8_max is not available on chip.
        - LNC = 2: core 0 runs the first ⌈tiles / 2⌉ row tiles, core 1 the others (module doc).

    Pseudocode:
        for each tile of rows_per_tile rows of this core (partition p = (row, block), m groups of g columns each):
            g = load(gate block); u = load(up block); w = row weight repeated over the row's blocks
            g = min(g, L); u = clamp(u, -L, L)                # if swiglu_limit
            v = act(g, u) * w                                 # fp32; silu(g)·u by default
            bf16: store(out, bf16(v)); continue
            amax[p, j] = max(max_k |v[p, j, k]|, 1e-4)          # j < m groups, k < g
            s = pow2 scale from amax bits; inv = 1/s from bits
            q = fp8(v * inv); store(q, s)
    """
    rows, two_i = gate_up.shape
    inter = two_i // 2
    assert two_i == 2 * inter, f"gate_up must have an even column count, got {two_i}"
    assert out_format in ("fp8", "bf16"), f"out_format must be 'fp8' or 'bf16', got {out_format!r}"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    fp8 = out_format == "fp8"
    if fp8:
        assert pow2_scale, "the NKI kernel supports pow2_scale=True only (bit-exact scales need power-of-two)"
        assert inter % group_size == 0, f"I={inter} must be a multiple of group_size={group_size}"
        e4m3fn_native = nisa.get_nc_version() == nisa.nc_version.gen4  # trn3: OCP e4m3fn on chip
        assert fp8_max <= FP8_E4M3_TRN2_MAX or (fp8_max <= FP8_E4M3FN_MAX and e4m3fn_native), (
            f"fp8_max={fp8_max} needs float8_e4m3fn on chip (trn3); trn2's float8_e4m3 tops out at 240"
        )
        block = group_size
    else:
        block = next(c for c in (128, 64, 32, 16, 8, 4, 2, 1) if inter % c == 0)  # column block, no scales
    n_groups = inter // block
    m = _blocks_per_partition(rows, n_groups, block)
    bpr = n_groups // m  # column blocks (partitions) per row
    assert bpr <= nl.tile_size.pmax, f"I={inter} is too wide: {bpr} blocks of {m * block} columns per row"
    cols = m * block  # columns per partition
    rows_per_tile = nl.tile_size.pmax // bpr
    if fp8:
        q_out = nl.ndarray((rows, inter), dtype=nl.float8_e4m3fn, buffer=nl.shared_hbm, name="q")
        s_out = nl.ndarray((rows, n_groups), dtype=nl.float32, buffer=nl.shared_hbm, name="s")
    else:
        out = nl.ndarray((rows, inter), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="out")
    pmax = nl.tile_size.pmax

    for r0 in core_tiles(rows, rows_per_tile, "swiglu_and_cast"):
        nr = min(rows_per_tile, rows - r0)
        p = nr * bpr
        # ---- load: partition (r, b) holds columns [b·cols, (b+1)·cols) of row r, for gate and for up
        gu = nl.ndarray((pmax, 2, cols), dtype=gate_up.dtype, buffer=nl.sbuf, name="gu")
        nisa.dma_copy(dst=gu[0:p, 0, :], src=gate_up[r0 : r0 + nr, 0:inter])
        nisa.dma_copy(dst=gu[0:p, 1, :], src=gate_up[r0 : r0 + nr, inter:two_i])
        g_in, u_in = gu[0:p, 0, :], gu[0:p, 1, :]
        if row_weight is not None:
            # w[r] repeated over the row's B partitions: a stride-0 HBM access pattern
            w = nl.ndarray((pmax, 1), dtype=nl.float32, buffer=nl.sbuf, name="w")
            nisa.dma_copy(dst=w[0:p, :], src=row_weight.ap(pattern=[[1, nr], [0, bpr]], offset=r0))
        res = swiglu_cast_tile(
            g_in,
            u_in,
            w[0:p, :] if row_weight is not None else None,
            swiglu_limit,
            out_format,
            group_size,
            fp8_max,
            activation,
            alpha,
        )
        if not fp8:
            nisa.dma_copy(dst=out[r0 : r0 + nr, :], src=res)
            continue
        q, s_t = res
        # ---- store: fp8 as bytes (e4m3 == e4m3fn encoding for |x| <= 240), scales as fp32
        nisa.dma_copy(dst=q_out[r0 : r0 + nr, :].view(nl.uint8), src=q.view(nl.uint8))
        nisa.dma_copy(dst=s_out[r0 : r0 + nr, :], src=s_t)
    if fp8:
        return q_out, s_out
    return out


def swiglu_cast_tile(
    g_in, u_in, w, swiglu_limit, out_format, group_size, fp8_max, activation="silu", alpha=DEFAULT_ALPHA
):
    """The on-chip body of :func:`swiglu_and_cast` for one tile, SBUF in and SBUF out — shared with the fused
    local-experts kernel (``nki_kernels/local_experts.py``), whose GEMM1 output never leaves the chip.

    Args:
        g_in, u_in: SBUF [p, cols] bfloat16 or float32 gate and up values (p ≤ 128 partitions).
        w: SBUF (p, 1) float32 routing weight per partition, or None.
        swiglu_limit, out_format, group_size, fp8_max, activation, alpha: as :func:`swiglu_and_cast`; for fp8,
            cols is a multiple of group_size and each partition's groups are consecutive columns.

    Returns:
        "bf16": SBUF bfloat16 [p, cols].
        "fp8": (q, s) — SBUF [p, cols] ``float8_e4m3`` (fp8_max <= 240; ``float8_e4m3fn`` above, trn3) and SBUF
        float32 [p, cols / group_size] power-of-two scales.
    """
    p, cols = g_in.shape[0], math.prod(g_in.shape[1:])
    fp8 = out_format == "fp8"
    av = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf, name="a")
    bv = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf, name="b")
    # ---- clamp: gate from above only, up on both sides
    if swiglu_limit is not None:
        lim = float(swiglu_limit)
        nisa.tensor_scalar(dst=av, data=g_in, op0=nl.minimum, operand0=lim)
        nisa.tensor_scalar(dst=bv, data=u_in, op0=nl.minimum, operand0=lim, op1=nl.maximum, operand1=-lim)
        g_in, u_in = av, bv
    # ---- v = act(g, u) · w  (fp32, reference order); bf16 mode writes the last product as bf16
    u_in = _gated_into(av, g_in, u_in, bv, p, cols, activation, alpha)
    if fp8:
        v = av
    else:
        v = nl.ndarray((p, cols), dtype=nl.bfloat16, buffer=nl.sbuf, name="v_bf16")
    if w is not None:
        nisa.tensor_tensor(dst=av, data1=av, data2=u_in, op=nl.multiply)
        nisa.tensor_scalar(dst=v, data=av, op0=nl.multiply, operand0=w)
    else:
        nisa.tensor_tensor(dst=v, data1=av, data2=u_in, op=nl.multiply)
    if not fp8:
        return v
    chip_fp8 = nl.float8_e4m3 if fp8_max <= FP8_E4M3_TRN2_MAX else nl.float8_e4m3fn
    # fp8_max = 1.m · 2^k: its biased exponent and mantissa bits, for the exact scale (see swiglu_and_cast Notes)
    max_bits = int(np.array(fp8_max, dtype=np.float32).view(np.int32))
    max_exp, max_mant = (max_bits >> 23) & 0xFF, max_bits & 0x7FFFFF
    m = cols // group_size
    # ---- per-group amax (ScalarE |v|, VectorE max over each group of g columns), floored at 1e-4
    nisa.activation(dst=bv, op=nl.abs, data=av)
    amax = nl.ndarray((p, m), dtype=nl.float32, buffer=nl.sbuf, name="amax")
    am = amax[0:p, :]
    nisa.tensor_reduce(dst=am, op=nl.maximum, data=bv.reshape((p, m, group_size)), axis=(2,))
    nisa.tensor_scalar(dst=am, data=am, op0=nl.maximum, operand0=AMAX_FLOOR)
    # ---- exact power-of-two scale and its inverse from the bits of amax (see swiglu_and_cast Notes)
    bits = am.view(nl.int32)
    expo = nl.ndarray((p, m), dtype=nl.int32, buffer=nl.sbuf, name="expo")
    ex = expo[0:p, :]
    nisa.tensor_scalar(dst=ex, data=bits, op0=nl.right_shift, operand0=23, op1=nl.bitwise_and, operand1=0xFF)
    bump = nl.ndarray((p, m), dtype=nl.int32, buffer=nl.sbuf, name="bump")
    bu = bump[0:p, :]
    nisa.tensor_scalar(dst=bu, data=bits, op0=nl.bitwise_and, operand0=0x7FFFFF)
    # [mantissa(amax) > mantissa(fp8_max)] + 127 - exponent(fp8_max); exact in fp32 (< 2^24)
    nisa.tensor_scalar(
        dst=bu, data=bu, op0=nl.greater, operand0=float(max_mant), op1=nl.add, operand1=float(127 - max_exp)
    )
    nisa.tensor_tensor(dst=ex, data1=ex, data2=bu, op=nl.add)  # biased exponent of s
    s_t = nl.ndarray((p, m), dtype=nl.float32, buffer=nl.sbuf, name="scale")
    nisa.tensor_scalar(dst=s_t[0:p, :].view(nl.int32), data=ex, op0=nl.left_shift, operand0=23)
    nisa.tensor_scalar(dst=bu, data=ex, op0=nl.subtract, operand0=254.0, reverse0=True)  # exponent of 1/s
    inv = nl.ndarray((p, m), dtype=nl.float32, buffer=nl.sbuf, name="inv_scale")
    nisa.tensor_scalar(dst=inv[0:p, :].view(nl.int32), data=bu, op0=nl.left_shift, operand0=23)
    # A NaN / inf amax has exponent 255, which the bit arithmetic above turns into a finite 2^121-sized scale
    # (finite garbage). s += amax · 0 (0 for a finite amax, NaN otherwise) keeps s exact and makes the whole
    # group dequantize to NaN, as the reference's does (SPEC §1.5, non-finite values).
    poison = nl.ndarray((p, m), dtype=nl.float32, buffer=nl.sbuf, name="nan_poison")
    nisa.tensor_scalar(dst=poison[0:p, :], data=am, op0=nl.multiply, operand0=0.0)
    nisa.tensor_tensor(dst=s_t[0:p, :], data1=s_t[0:p, :], data2=poison[0:p, :], op=nl.add)
    # ---- q = fp8(v / s): exact power-of-two scaling, |v / s| <= fp8_max by construction
    q = nl.ndarray((p, cols), dtype=chip_fp8, buffer=nl.sbuf, name="q")
    if m == 1:
        # VectorE multiply keeps the sign of zero (ScalarE's ``data·scale + bias`` would turn −0 into +0)
        nisa.tensor_scalar(dst=q[0:p, :], data=av, op0=nl.multiply, operand0=inv[0:p, :])
    else:
        inv3 = inv[0:p, :].reshape((p, m, 1)).broadcast(2, group_size)
        nisa.tensor_tensor(
            dst=q[0:p, :].reshape((p, m, group_size)), data1=av.reshape((p, m, group_size)), data2=inv3, op=nl.multiply
        )
    return q, s_t


def _gated_into(av, g_in, u_in, bv, p, cols, activation, alpha):
    """The SPEC §1.9 gate factor into ``av`` (SBUF fp32 [p, cols]); returns the up operand ``u'`` it multiplies, so
    that ``act(g, u) = av · u'`` bit for bit as ``static_moe.activations.gated`` computes it (float32, same order;
    the products commute exactly):

    - "silu": ``av = silu(g)``, ``u' = u``;
    - "swiglu_oai": ``av = g · σ(α·g)``, ``u' = u + 1`` (written into ``bv``);
    - "gelu_tanh": ``av = g · σ(c · (g + ((0.044715·g)·g)·g))``, ``u' = u``, with ``c·y`` as the activation's scale.

    Engines: VectorE binds the fused local-experts item (its swiglu and evacuations), ScalarE and GpSimd have
    room, so the extra work goes there: ``u + 1`` and ``0.044715·g`` are ScalarE's affine stage (``copy(u·1 + 1)``,
    ``copy(g·0.044715)``: one fp32 operation each), the rest of the gelu cubic runs on GpSimd (fp32 arithmetic, as ``expert_gemm_tiles.tree_sum``'s adds); VectorE does one
    product more than "silu". ``g_in`` may be ``av`` and ``u_in`` may be ``bv`` (the clamped halves).
    Documented constructs: ``nisa.activation`` with ``op=nl.sigmoid`` / ``nl.copy``, a compile-time ``scale`` and a
    scalar ``bias`` (``f(data·scale + bias)`` in fp32, ISA page ``nki.isa.activation``; ``nki.language.sigmoid``),
    ``tensor_scalar`` / ``tensor_tensor`` with ``engine=`` (ISA pages)."""
    if activation == "silu":
        nisa.activation(dst=av, op=nl.silu, data=g_in)
        return u_in
    sig = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf, name="act_sigmoid")
    if activation == "swiglu_oai":
        nisa.activation(dst=sig, op=nl.sigmoid, data=g_in, scale=float(alpha))  # σ(fl(α·g))
        nisa.tensor_tensor(dst=av, data1=g_in, data2=sig, op=nl.multiply)
        nisa.activation(dst=bv, op=nl.copy, data=u_in, bias=1.0)  # u·1 + 1 = u + 1
        return bv
    # gelu_tanh: y = 0.044715·g (ScalarE), y = y·g, y = y·g, y = g + y (GpSimd), σ(c·y) (ScalarE)
    gp = nisa.engine.gpsimd
    nisa.activation(dst=sig, op=nl.copy, data=g_in, scale=GELU_TANH_CUBIC)  # g·0.044715 on ScalarE
    nisa.tensor_tensor(dst=sig, data1=sig, data2=g_in, op=nl.multiply, engine=gp)
    nisa.tensor_tensor(dst=sig, data1=sig, data2=g_in, op=nl.multiply, engine=gp)
    nisa.tensor_tensor(dst=sig, data1=g_in, data2=sig, op=nl.add, engine=gp)
    nisa.activation(dst=sig, op=nl.sigmoid, data=sig, scale=GELU_TANH_SCALE)
    nisa.tensor_tensor(dst=av, data1=g_in, data2=sig, op=nl.multiply)
    return u_in
