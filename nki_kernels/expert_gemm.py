"""NKI kernel: per-expert masked GEMM with a shared A operand (SPEC §1.6), and the tile-level pieces that the
fused local-experts kernel (``nki_kernels/local_experts.py``) builds on.

    D[m, n] = bf16( Σ_k A[m, k] · B_e[n, k] )   on the rows m where row_mask[m] is set, exact zeros elsewhere

Formats (activation × weight): bf16 × {bf16, fp8, fp4} and fp8 × {fp8, fp4}; fp8 A has float32 scales per 1×g
(g ∈ {32, 128}), fp8 B per 1×128 along K, fp4 B is e2m1 (two per byte, low nibble = even k) with UE8M0 scales per
1×32 along K.

How each format reaches the TensorE on trn2 (NeuronCore-v3)
-----------------------------------------------------------
trn2 has no FP4 type and its fp8 is ``float8_e4m3`` (IEEE-style, max 240); OCP ``float8_e4m3fn`` bytes with
|x| > 240 (exponent field 15) read as inf/NaN there, and the compiler rejects e4m3fn on trn1/trn2. So every
quantized operand is *decoded* from its bytes with integer ops, never reinterpreted:

- e4m3fn byte b → fp16 bits ``(b & 0x80) << 8 | (b & 0x7F) << 7`` = the value × 2^-8, exactly, subnormals
  included (the e4m3fn and fp16 subnormal grids line up under this shift). Done four bytes per uint32 lane:
  six bit instructions per word (4 on VectorE, 2 ORs on GpSimd), giving the even-k and odd-k halves.
- e2m1 nibble c → float8_e4m3 byte ``(c & 7) << 2 | (c & 8) << 4`` = the value × 2^-6, exactly (a native trn2
  fp8 value), eight nibbles per uint32 lane, six bit instructions.
- The block scale (fp8: ``s · 2^8``; fp4: ``2^(b−127) · 2^6`` built from the UE8M0 byte with an integer shift)
  is folded in by one GpSimd multiply that writes the bf16 weight tile in natural k order. Every product is a
  ≤ 4-bit significand times a power of two, so the bf16 tile is exact (pow2 scales, as SPEC §1.1–1.2 produce;
  arbitrary float32 fp8 scales from foreign checkpoints are rounded to bf16 here, ≤ 2^-9 relative per weight).
- fp8 activations are decoded the same way, once per kernel (A is shared by all experts), to exact bf16.

The GEMM then runs in bf16 with fp32 PSUM accumulation over the whole K (scales are already in the operands).

On trn3 (NeuronCore-v4, ``nisa.get_nc_version() == gen4``) e4m3fn is a matmul input: fp8 weights skip the
decode and go to the TensorE as stored (transposed as bytes), each 128-wide K block its own PSUM group whose
weight scale is applied when VectorE evacuates it. fp4 keeps the decode (the MX matmul is not used yet).

Layout: weights stationary, tokens moving (as nki-library's decode MoE, core/moe/moe_tkg)
-------------------------------------------------------------------------------------------
The weights are stored as nn.Linear stores them, ``[N, K]`` ("EOI"), so a weight row-block DMAs contiguously onto
128 partitions as ``[n, K]`` but the TensorE contracts over the partition dim: every 128×128 weight block is
transposed on the TensorE (``nc_transpose``) into ``[k, n]`` and evacuated from PSUM by ScalarE. That holds for
either operand order. We keep the weight block as the *stationary* operand and stream the R gathered rows as
the *moving* one (``A^T [k, R]``): per 128×128 block the cost model charges ``R + 64`` TensorE cycles, against
``(512 + 64) / 4 = 144`` per block with tokens stationary and weights moving 512 columns at a time — cheaper for
every R < 80, the decode regime. At R = 128 it costs 192 vs 144 cycles per block, next to the 192 cycles of the
block's transpose either way, so the reverse order would save at most 1/8 of the TensorE time there (not
implemented: one code path). Weights stationary also keeps GEMM1's output ``h^T [n, R]`` in the layout GEMM2's
moving operand needs. The output lands as ``D^T [n, R]`` and is transposed back per 128-row tile for the store
(R·N elements, small next to the N·K weight).

Skip unrouted experts
---------------------
``skip_unrouted=True`` wraps all weight traffic in a runtime loop (``nl.fori_loop``) whose trip count is
``min(Σ row_mask, 1)``, loaded into a register on device: an expert that no row selects reads no weight byte and
issues no weight instruction; the output stays the zeros it was initialised to. ``skip_unrouted=False`` is the
static variant (no runtime control flow, always streams the weights).

Runtime loops need NKI >= 0.6 (``nl.fori_loop``); everything else is NKI >= 0.3.
"""

from __future__ import annotations

import math

from static_moe.nki.shim import nisa, nl

P = 128  # partitions
MOVING_MAX = 512  # gemm_moving_fmax on trn2: one PSUM bank of fp32
TRANSPOSES_PER_BANK = 8  # bf16 [128, 128] transposes per 2 KiB PSUM bank
W_DMA_MIN_BYTES = 2048  # per partition: group weight row-blocks until a DMA moves at least this much
FP4_FOLD_VECTOR_SHARE = 8  # 1/8 of the fp4 scale fold runs on VectorE, the rest on GpSimd

# int32 spellings of the uint32 bit masks (the same 32 bits; some toolchains want immediates in int32 range)
_M_7F007F00 = 0x7F007F00
_M_80008000 = 0x80008000 - (1 << 32)
_M_80808080 = 0x80808080 - (1 << 32)


# ----------------------------------------------------------------------------------------------------------------
# Formats (compile-time: read from the dtypes)
# ----------------------------------------------------------------------------------------------------------------
def act_format(a) -> str:
    """``"bf16"`` or ``"fp8"`` (float8_e4m3fn bytes) for an A / x tensor."""
    if a.dtype == nl.bfloat16:
        return "bf16"
    if a.dtype == nl.float8_e4m3fn or a.dtype == nl.uint8:
        return "fp8"
    raise TypeError(f"activation dtype {a.dtype} is not bf16 or float8_e4m3fn")


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
        v = v[e, row0:row0 + nblk * P, :]
        return v.reshape((nblk, P, c)).permute((1, 0, 2))
    return t.ap(pattern=[[c, P], [P * c, nblk], [1, c]], offset=row0 * c, scalar_offset=e, indirect_dim=0,
                dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Decoders (VectorE bit ops + GpSimd ORs); see the module docstring for the bit identities
# ----------------------------------------------------------------------------------------------------------------
def decode_e4m3fn_pairs(even, odd, tmp, words):
    """e4m3fn bytes → fp16 values × 2^-8, four bytes per uint32 lane.

    Args:
        even, odd: SBUF uint32 ``[p, F]`` outputs; viewed as fp16 ``[p, 2F]`` they hold the values of bytes
            0, 2 (even) and 1, 3 (odd) of each input word, i.e. k = 2j and k = 2j + 1.
        tmp: SBUF uint32 ``[p, F]`` scratch.
        words: SBUF uint32 ``[p, F]``, the e4m3fn bytes viewed four to a word.
    """
    nisa.tensor_scalar(dst=even, data=words, op0=nl.bitwise_and, operand0=0x007F007F, op1=nl.left_shift, operand1=7)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=0x00800080, op1=nl.left_shift, operand1=8)
    nisa.tensor_tensor(dst=even, data1=even, data2=tmp, op=nl.bitwise_or, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=odd, data=words, op0=nl.bitwise_and, operand0=_M_7F007F00, op1=nl.right_shift, operand1=1)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=_M_80008000)
    nisa.tensor_tensor(dst=odd, data1=odd, data2=tmp, op=nl.bitwise_or, engine=nisa.engine.gpsimd)


def decode_e2m1_pairs(lo, hi, tmp, words):
    """Packed e2m1 → float8_e4m3 bytes holding the value × 2^-6, eight nibbles per uint32 lane.

    Args:
        lo, hi: SBUF uint32 ``[p, F]`` outputs; viewed as float8_e4m3 ``[p, 4F]`` they hold the low nibbles
            (k = 2j) and the high nibbles (k = 2j + 1) of the input bytes, in byte order.
        tmp: SBUF uint32 ``[p, F]`` scratch.
        words: SBUF uint32 ``[p, F]``, the packed bytes viewed four to a word.
    """
    nisa.tensor_scalar(dst=lo, data=words, op0=nl.bitwise_and, operand0=0x07070707, op1=nl.left_shift, operand1=2)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=0x08080808, op1=nl.left_shift, operand1=4)
    nisa.tensor_tensor(dst=lo, data1=lo, data2=tmp, op=nl.bitwise_or, engine=nisa.engine.gpsimd)
    nisa.tensor_scalar(dst=hi, data=words, op0=nl.right_shift, operand0=2, op1=nl.bitwise_and, operand1=0x1C1C1C1C)
    nisa.tensor_scalar(dst=tmp, data=words, op0=nl.bitwise_and, operand0=_M_80808080)
    nisa.tensor_tensor(dst=hi, data1=hi, data2=tmp, op=nl.bitwise_or, engine=nisa.engine.gpsimd)


def fold_scales(dst, even_vals, odd_vals, scale, block: int, vector_blocks: int = 0):
    """``dst[:, k] = value(k) · scale[:, k // block]`` in natural k order, from de-interleaved halves.

    Args:
        dst: SBUF bf16 ``[p, K]`` (K may be the flattened free dims of several row blocks).
        even_vals, odd_vals: SBUF ``[p, K/2]`` values of k = 2j and k = 2j + 1 (fp16 or float8_e4m3).
        scale: SBUF float32 ``[p, K/block]`` (already including the decoder's 2^8 / 2^6 factor).
        block: scale granularity along K (32 or 128).
        vector_blocks: how many leading scale blocks VectorE multiplies (load balance); GpSimd does the rest.
    """
    p, k = dst.shape[0], math.prod(dst.shape[1:])
    nb, half = k // block, block // 2
    d4 = dst.reshape((p, nb, half, 2))
    sb = scale.reshape((p, nb, 1)).broadcast(2, half)
    for j, vals in ((0, even_vals), (1, odd_vals)):
        v3 = vals.reshape((p, nb, half))
        for b0, b1, eng in ((0, vector_blocks, nisa.engine.vector), (vector_blocks, nb, nisa.engine.gpsimd)):
            if b1 > b0:
                nisa.tensor_tensor(dst=d4[:, b0:b1, :, j], data1=v3[:, b0:b1, :], data2=sb[:, b0:b1, :],
                                   op=nl.multiply, engine=eng)


def ue8m0_to_scale(dst_i32, ue8m0, extra_log2: int):
    """UE8M0 bytes b → float32 ``2^(b − 127 + extra_log2)`` (returned as ``dst_i32.view(float32)``).

    Built from the bits: ``(b + extra_log2) << 23``. Exact for ``1 − extra_log2 ≤ b ≤ 254 − extra_log2``
    (with extra_log2 = 6: b ≤ 248, scales up to 2^121; byte 0 and 2^-127 stay normal floats).
    """
    nisa.tensor_scalar(dst=dst_i32, data=ue8m0, op0=nl.add, operand0=float(extra_log2))
    nisa.tensor_scalar(dst=dst_i32, data=dst_i32, op0=nl.left_shift, operand0=23)
    return dst_i32.view(nl.float32)


# ----------------------------------------------------------------------------------------------------------------
# Weights: HBM row blocks → decoded bf16 → K-major (transposed) tiles
# ----------------------------------------------------------------------------------------------------------------
def load_weight_blocks(w_nat, b, b_scale, e, row0: int, nblk: int, fmt: str, k: int):
    """Load ``nblk`` 128-row blocks of expert ``e`` and decode them to bf16 in natural layout.

    Dimensions:
        K: contraction length; c = nblk row blocks.

    Args:
        w_nat: SBUF bf16 ``[P, nblk, K]`` output; ``w_nat[p, j, k] = B_e[row0 + j·128 + p, k]`` (dequantized).
        b: HBM weights ``[L, N, K]`` bf16 / float8_e4m3fn, or uint8 ``[L, N, K/2]`` (fp4).
        b_scale: HBM float32 ``[L, N, K/128]`` (fp8), uint8 ``[L, N, K/32]`` (fp4), or None (bf16).
        e: expert index (int or register).

    Notes:
        One DMA for the weights (≥ 2 KiB per partition where the shape allows) and one for the scales.
        Engines: VectorE (bit ops), GpSimd (ORs and the scale fold).

    Pseudocode:
        raw = dma(B[e, rows])                       # bytes, no conversion
        even, odd = decode(raw)                     # value × 2^-8 (fp8) or × 2^-6 (fp4)
        w_nat[:, k] = (even | odd)[k] · scale[k // block]
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
    tmp = nl.ndarray((P, nw), dtype=nl.uint32, buffer=nl.sbuf, name="w_tmp")
    if fmt == "fp8":
        nsc = k // 128
        s_raw = nl.ndarray((P, nblk, nsc), dtype=nl.float32, buffer=nl.sbuf, name="w_s")
        nisa.dma_copy(dst=s_raw, src=expert_rows(b_scale, e, row0, nblk))
        scale = nl.ndarray((P, nblk * nsc), dtype=nl.float32, buffer=nl.sbuf, name="w_s256")
        nisa.tensor_scalar(dst=scale, data=s_raw.reshape((P, nblk * nsc)), op0=nl.multiply, operand0=256.0)
        decode_e4m3fn_pairs(even, odd, tmp, words)
        fold_scales(w_nat.reshape((P, nblk * k)), even.view(nl.float16), odd.view(nl.float16), scale, 128)
    else:  # fp4
        nsc = k // 32
        s_raw = nl.ndarray((P, nblk, nsc), dtype=nl.uint8, buffer=nl.sbuf, name="w_e8")
        nisa.dma_copy(dst=s_raw, src=expert_rows(b_scale, e, row0, nblk))
        s_i32 = nl.ndarray((P, nblk * nsc), dtype=nl.int32, buffer=nl.sbuf, name="w_s_bits")
        scale = ue8m0_to_scale(s_i32, s_raw.reshape((P, nblk * nsc)), 6)
        decode_e2m1_pairs(even, odd, tmp, words)
        # VectorE has half the bit work of the fp8 case: it takes 1/8 of the fold (cost-model balance)
        fold_scales(w_nat.reshape((P, nblk * k)), even.view(nl.float8_e4m3), odd.view(nl.float8_e4m3), scale, 32,
                    vector_blocks=nblk * nsc // FP4_FOLD_VECTOR_SHARE)


def transpose_blocks(dst_kmajor, src, ncols: int, nkb: int, evac_engines=None):
    """``dst_kmajor[:, kb, :ncols] = src[:ncols, kb·128:(kb+1)·128]^T`` for kb < nkb, on the TensorE.

    Args:
        dst_kmajor: SBUF bf16 ``[P, nkb, ncols]`` (k on partitions).
        src: SBUF bf16 ``[ncols, nkb·128]`` (rows on partitions), ncols ≤ 128.
        evac_engines: engines that copy PSUM → SBUF, used in turn per PSUM bank (default ScalarE only:
            VectorE and GpSimd are the decoders'; bf16 weights, which need no decoding, share it with VectorE).

    Notes:
        Eight 128×128 transposes share one 2 KiB PSUM bank and one evacuation instruction.
    """
    engines = (nisa.engine.scalar,) if evac_engines is None else tuple(evac_engines)
    for i, g0 in enumerate(range(0, nkb, TRANSPOSES_PER_BANK)):
        g = min(TRANSPOSES_PER_BANK, nkb - g0)
        pt = nl.ndarray((P, TRANSPOSES_PER_BANK, P), dtype=src.dtype, buffer=nl.psum, name="t_psum")
        for j in range(g):
            kb = g0 + j
            nisa.nc_transpose(dst=pt[:, j, :ncols], data=src[:ncols, kb * P:(kb + 1) * P])
        nisa.tensor_copy(dst=dst_kmajor[:, g0:g0 + g, :ncols], src=pt[:, :g, :ncols], engine=engines[i % len(engines)])


def weight_evac_engines(fmt: str):
    """PSUM-evacuation engines for transposed weight blocks of a format (see transpose_blocks)."""
    return (nisa.engine.scalar, nisa.engine.vector) if fmt == "bf16" else (nisa.engine.scalar,)


def native_fp8_weights(fmt: str) -> bool:
    """Whether fp8 weights reach the TensorE as stored: OCP e4m3fn is a matmul input on trn3 (NeuronCore-v4);
    trn2 decodes them (module docstring)."""
    return fmt == "fp8" and nisa.get_nc_version() == nisa.nc_version.gen4


def load_weight_group(b, b_scale, e, row0: int, nblk: int, fmt: str, k: int):
    """Load ``nblk`` 128-row weight blocks of expert ``e`` for :func:`block_times_rows`.

    Returns:
        ``(w, None)`` with w SBUF bf16 ``[P, nblk, K]`` decoded (scales folded in), or on trn3 for fp8 weights
        ``(w, w_s)``: the e4m3fn bytes as stored ``[P, nblk, K]`` and their float32 scales ``[P, nblk, K/128]``.
    """
    if native_fp8_weights(fmt):
        w = nl.ndarray((P, nblk, k), dtype=nl.float8_e4m3fn, buffer=nl.sbuf, name="w_e4m3fn")
        nisa.dma_copy(dst=w, src=expert_rows(b, e, row0, nblk))
        w_s = nl.ndarray((P, nblk, k // 128), dtype=nl.float32, buffer=nl.sbuf, name="w_s")
        nisa.dma_copy(dst=w_s, src=expert_rows(b_scale, e, row0, nblk))
        return w, w_s
    w = nl.ndarray((P, nblk, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="w_nat")
    load_weight_blocks(w, b, b_scale, e, row0, nblk, fmt, k)
    return w, None


def block_times_rows(dst, group, j: int, aT, fmt: str, k: int, r: int):
    """``dst [P(n), R] = bf16(W_j · Aᵀ)`` for block j of a loaded group: transpose, GEMM, one bf16 rounding.

    Args:
        dst: SBUF bf16 ``[P, R]``.
        group: what :func:`load_weight_group` returned.
        aT: SBUF bf16 ``[P(k), K/128, R]``.

    Notes:
        Decoded weights (scales folded in) accumulate the whole K in one PSUM group. Native fp8 weights (trn3)
        cannot: each 128-wide K block is its own PSUM group, evacuated by VectorE with its weight scale
        ``s[n, kb]`` as the per-partition operand (weights stationary puts n on partitions) into an fp32 SBUF sum.
    """
    w, w_s = group
    nkb = k // P
    wT = nl.ndarray((P, nkb, P), dtype=w.dtype, buffer=nl.sbuf, name="wT")
    transpose_blocks(wT, w[:, j, :], P, nkb, weight_evac_engines(fmt))
    if w_s is None:
        o_ps = nl.ndarray((P, r), dtype=nl.float32, buffer=nl.psum, name="o_psum")
        gemm_ws(o_ps, wT, aT, nkb, r)
        nisa.tensor_copy(dst=dst, src=o_ps, engine=nisa.engine.vector)  # the one bf16 rounding
        return
    acc = nl.ndarray((P, r), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
    for m0 in range(0, r, MOVING_MAX):
        mr = min(MOVING_MAX, r - m0)
        a_m = acc[:, m0:m0 + mr]
        for kb in range(nkb):
            ps = nl.ndarray((P, mr), dtype=nl.float32, buffer=nl.psum, name="o_kb_psum")
            nisa.nc_matmul(dst=ps, stationary=wT[:, kb, :], moving=aT[:, kb, m0:m0 + mr], accumulate=False)
            scale = w_s[:, j, kb:kb + 1]
            if kb == 0:
                nisa.tensor_scalar(dst=a_m, data=ps, op0=nl.multiply, operand0=scale)
            else:
                nisa.scalar_tensor_tensor(dst=a_m, data=ps, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=a_m)
    nisa.tensor_copy(dst=dst, src=acc, engine=nisa.engine.vector)  # the one bf16 rounding


# ----------------------------------------------------------------------------------------------------------------
# A: HBM rows → masked, decoded, K-major bf16 (shared by all experts)
# ----------------------------------------------------------------------------------------------------------------
def load_a_kmajor(aT, a, a_scale, mask_tiles):
    """``aT[k, kb, m] = A[m, kb·128 + k]`` in bf16 (exact), with rows whose mask is 0 set to exact zeros.

    Dimensions:
        R: rows of A (any; processed in tiles of 128), K: contraction length.

    Args:
        aT: SBUF bf16 ``[P, K/128, R]`` output (k on partitions, rows along the free dim: the moving operand).
        a: HBM ``[R, K]`` bf16 or float8_e4m3fn.
        a_scale: HBM float32 ``[R, K/g]`` (fp8) or None.
        mask_tiles: list of SBUF uint8 ``[rt, 1]`` row predicates, one per 128-row tile.

    Notes:
        Masked rows (NaN / 0xFF padding) are replaced by zeros *before* any arithmetic touches them: bf16 rows
        by a predicated copy onto a zeroed tile; fp8 rows by zeroing their scales (the decoded bytes are always
        finite, so ``finite · 0 = 0``).

    Pseudocode:
        for each 128-row tile:
            a_nat = mask ? dequant(A[rows]) : 0         # [rt, K] bf16
            aT[:, :, rows] = transpose(a_nat)           # 128×rt blocks on the TensorE
    """
    r, k = a.shape
    fmt = act_format(a)
    for t, mask in enumerate(mask_tiles):
        r0 = t * P
        rt = mask.shape[0]
        a_nat = nl.ndarray((rt, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_nat")
        if fmt == "bf16":
            a_raw = nl.ndarray((rt, k), dtype=nl.bfloat16, buffer=nl.sbuf, name="a_raw")
            nisa.dma_copy(dst=a_raw, src=a[r0:r0 + rt, :])
            nisa.memset(dst=a_nat, value=0.0)
            nisa.tensor_copy_predicated(dst=a_nat, src=a_raw, predicate=mask.broadcast(1, k))
        else:
            g = k // a_scale.shape[1]
            raw = nl.ndarray((rt, k), dtype=nl.uint8, buffer=nl.sbuf, name="a_bytes")
            nisa.dma_copy(dst=raw, src=a.view(nl.uint8)[r0:r0 + rt, :])
            s_raw = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s")
            nisa.dma_copy(dst=s_raw, src=a_scale[r0:r0 + rt, :])
            s256 = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s256")
            nisa.tensor_scalar(dst=s256, data=s_raw, op0=nl.multiply, operand0=256.0)
            scale = nl.ndarray((rt, k // g), dtype=nl.float32, buffer=nl.sbuf, name="a_s_masked")
            nisa.memset(dst=scale, value=0.0)
            nisa.tensor_copy_predicated(dst=scale, src=s256, predicate=mask.broadcast(1, k // g))
            even = nl.ndarray((rt, k // 4), dtype=nl.uint32, buffer=nl.sbuf, name="a_even")
            odd = nl.ndarray((rt, k // 4), dtype=nl.uint32, buffer=nl.sbuf, name="a_odd")
            tmp = nl.ndarray((rt, k // 4), dtype=nl.uint32, buffer=nl.sbuf, name="a_tmp")
            decode_e4m3fn_pairs(even, odd, tmp, raw.view(nl.uint32))
            fold_scales(a_nat, even.view(nl.float16), odd.view(nl.float16), scale, g)
        transpose_blocks(aT[:, :, r0:r0 + rt], a_nat, rt, k // P, (nisa.engine.vector,))


def load_row_mask_tiles(row_mask, r: int):
    """``row_mask`` HBM ``[R]`` (bool stored as uint8) → SBUF uint8 ``[rt, 1]`` tiles of 128 rows."""
    tiles = []
    m2 = row_mask.reshape((r, 1))
    for r0 in range(0, r, P):
        rt = min(P, r - r0)
        t = nl.ndarray((rt, 1), dtype=nl.uint8, buffer=nl.sbuf, name="row_mask")
        nisa.dma_copy(dst=t, src=m2[r0:r0 + rt, :])
        tiles.append(t)
    return tiles


# ----------------------------------------------------------------------------------------------------------------
# GEMM core and output
# ----------------------------------------------------------------------------------------------------------------
def gemm_ws(out_psum, wT, aT, nkb: int, r: int):
    """``out_psum[n, m] = Σ_k wT[k, ·, n] · aT[k, ·, m]``: weights stationary, rows moving (≤ 512 per matmul).

    Args:
        out_psum: PSUM float32 ``[P, R]`` (R ≤ 512 per bank; larger R is split at bank boundaries).
        wT: SBUF bf16 ``[P(k), nkb, P(n)]``.  aT: SBUF bf16 ``[P(k), nkb, R]``.
    """
    for m0 in range(0, r, MOVING_MAX):
        mr = min(MOVING_MAX, r - m0)
        for kb in range(nkb):
            nisa.nc_matmul(dst=out_psum[:, m0:m0 + mr], stationary=wT[:, kb, :], moving=aT[:, kb, m0:m0 + mr],
                           accumulate=kb != 0)


def rows_from_kmajor(rows_tiles, src_T, col0: int, r: int):
    """Transpose ``src_T [P(n), R]`` (bf16) back into row tiles: ``rows_tiles[t][m, col0 + n] = src_T[n, t·128 + m]``.

    Args:
        rows_tiles: list of SBUF tiles ``[rt, C]`` (rows on partitions), same dtype as src_T.
        src_T: SBUF ``[P, R]``.
    """
    for t, dst in enumerate(rows_tiles):
        r0 = t * P
        rt = min(P, r - r0)
        pt = nl.ndarray((rt, P), dtype=src_T.dtype, buffer=nl.psum, name="rows_psum")
        nisa.nc_transpose(dst=pt, data=src_T[:, r0:r0 + rt])
        nisa.tensor_copy(dst=dst[:, col0:col0 + P], src=pt, engine=nisa.engine.vector)


def any_row_register(mask_tiles):
    """A register holding ``min(Σ_m mask[m], 1)``: the trip count of a skip-if-unrouted runtime loop.

    The row count is a cross-partition sum, done on the TensorE (``mask^T · 1``), then clamped and loaded.
    """
    cnt = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.psum, name="row_count")
    for t, mask in enumerate(mask_tiles):
        rt = mask.shape[0]
        mf = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="mask_bf16")
        nisa.tensor_copy(dst=mf, src=mask)
        ones = nl.ndarray((rt, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="ones")
        nisa.memset(dst=ones, value=1.0)
        nisa.nc_matmul(dst=cnt, stationary=mf, moving=ones, accumulate=t != 0)
    flag = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="any_row")
    nisa.tensor_scalar(dst=flag, data=cnt, op0=nl.minimum, operand0=1.0)
    reg = nisa.register_alloc(0)
    nisa.register_load(reg, flag)
    return reg


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------
def expert_gemm_kernel(a, a_scale, b, b_scale, row_mask, expert, skip_unrouted=True):
    """Per-expert masked GEMM with a shared A (SPEC §1.6), trn2 decode formats.

    Dimensions:
        R: rows of A (the gathered tokens), K: contraction (hidden or intermediate), N: output features,
        L: local experts, g: activation scale group (32 or 128).

    Args:
        a (nl.ndarray): [R, K] in HBM, bf16 or float8_e4m3fn — the shared A operand.
        a_scale (nl.ndarray): [R, K/g] float32 in HBM for fp8 A, else None.
        b (nl.ndarray): [L, N, K] bf16 / float8_e4m3fn, or [L, N, K/2] uint8 (fp4 e2m1 pairs) in HBM.
        b_scale (nl.ndarray): [L, N, K/128] float32 (fp8) or [L, N, K/32] uint8 UE8M0 (fp4) in HBM; None for
            bf16.
        row_mask (nl.ndarray): [R] bool (uint8) in HBM — the rows this expert serves.
        expert (int): local expert index (compile-time constant).
        skip_unrouted (bool): True: weights are read inside a runtime loop that runs only if some row is set;
            False: static variant.

    Returns:
        out (nl.ndarray): [R, N] bf16 in shared HBM; ``bf16(Σ_k A·B_e)`` on masked-in rows, exact zeros elsewhere.

    Notes:
        - K and N multiples of 128; R any (row tiles of 128, moving chunks of 512).
        - A row's sum runs over the same K blocks in the same order whatever the other rows are (batch
          invariance); rows are independent columns of the moving operand.
        - SBUF: A^T takes 2·K·R/128 bytes per partition; one weight block ~7·K bytes.

    Pseudocode:
        aT = transpose(mask ? dequant(A) : 0)                        # [k, kb, R] bf16, once
        out_rows = 0
        for _ in fori_loop(0, min(Σ mask, 1)):                      # (skip variant)
            for nb in range(N / 128):
                wT = transpose(decode(B[e, nb·128 : nb·128+128, :])) # [k, kb, 128] bf16
                o[n, m] = Σ_kb wT[:, kb, n]ᵀ · aT[:, kb, m]           # PSUM fp32
                out_rows[:, nb·128 : ...] = transpose(bf16(o))
        store(out_rows)
    """
    r, k = a.shape
    fmt_b = weight_format(b)
    n = b.shape[1]
    check_k = weight_k(b, fmt_b)
    assert check_k == k, f"A has K={k}, B has K={check_k}"
    assert k % P == 0 and n % P == 0, f"K={k} and N={n} must be multiples of {P}"
    nkb, nnb = k // P, n // P

    out = nl.ndarray((r, n), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="out")
    masks = load_row_mask_tiles(row_mask, r)

    aT = nl.ndarray((P, nkb, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="aT")
    load_a_kmajor(aT, a, a_scale, masks)

    out_rows = []
    for r0 in range(0, r, P):
        t = nl.ndarray((min(P, r - r0), n), dtype=nl.bfloat16, buffer=nl.sbuf, name="out_rows")
        if skip_unrouted:
            nisa.memset(dst=t, value=0.0)  # what an unrouted expert returns
        out_rows.append(t)

    def body(_i=None):
        grp = rows_per_dma(fmt_b, k, nnb)
        for g0 in range(0, nnb, grp):
            group = load_weight_group(b, b_scale, expert, g0 * P, grp, fmt_b, k)
            for j in range(grp):
                o_bf = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="o_bf16")
                block_times_rows(o_bf, group, j, aT, fmt_b, k, r)
                rows_from_kmajor(out_rows, o_bf, (g0 + j) * P, r)

    if skip_unrouted:
        nl.fori_loop(0, any_row_register(masks), body)
    else:
        body()

    for t, rows in enumerate(out_rows):
        nisa.dma_copy(dst=out[t * P:t * P + rows.shape[0], :], src=rows)
    return out
