"""NKI kernel: the fused local-experts step (SPEC §1.7) — GEMM1 → swiglu-and-cast → GEMM2 → weighted fp32
accumulate, every intermediate on chip.

Per local expert e (global id expert_offset + e), over the R gathered rows:

    h   = bf16(x · W13_eᵀ)                                  [R, 2I]   (GEMM1, PSUM fp32 → bf16)
    z   = swiglu_and_cast(h, w_e, limit, act format)         [R, I]    (SBUF; fp8 with x's group g)
    d   = bf16(z · W2_eᵀ)                                    [R, H]    (GEMM2)
    acc += d (fp32), experts in increasing local id

Rows not routed to e carry routing weight w_e = 0, so z = 0 and d = 0 exactly: their contribution is exact zeros
whatever they hold, and a routed row's arithmetic does not depend on which other rows are present (each row is
its own column of the moving operand; batch invariance). Rows routed to no local expert (including 0xFF padding:
id −1, NaN weight) are zeroed in x before any arithmetic, so NaN cannot leak.

Layout (see ``nki_kernels/expert_gemm.py`` for the format decoders and why weights are stationary): x is decoded
once to ``x^T [k, H/128, R]`` bf16 and shared by every expert; GEMM1 produces ``h^T [n, R]`` per 128 output
features, transposed into row tiles ``h [rows, 2I]`` so swiglu-and-cast (the same tile code as
``nki_kernels/swiglu_and_cast.py``) quantizes along the free dim per row and group; ``z`` is dequantized exactly
(pow2 scales) to bf16 and transposed to ``z^T [i, I/128, R]``, the moving operand of GEMM2; ``d^T`` is rounded to
bf16 and added into ``acc^T [h, H/128, R]`` fp32 in SBUF, transposed to rows once at the end.

Skip unrouted experts (``skip_unrouted=True``): per-expert row counts are summed on the TensorE into a [1, L]
flag row; a runtime loop over the L experts loads each flag into a register and runs the expert's body in an
inner runtime loop of 0 or 1 iterations, with the expert id as a register: the weight DMAs address
``W[e]`` through ``.ap(scalar_offset=e)``. An expert no row selects issues one register load and reads no weight
byte. ``skip_unrouted=False`` is the static all-experts variant (a Python loop over L, unrolled at trace time).

Runtime loops need NKI >= 0.6 (``nl.fori_loop``); the static variant is NKI >= 0.3.
"""

from __future__ import annotations

from static_moe.nki.shim import nisa, nl

from .expert_gemm import (
    MOVING_MAX,
    P,
    act_format,
    block_times_rows,
    load_a_kmajor,
    load_weight_group,
    rows_from_kmajor,
    rows_per_dma,
    transpose_blocks,
    weight_format,
    weight_k,
)
from .swiglu_and_cast import swiglu_cast_tile

SBUF_ROW_BUDGET = 100 * 1024  # bytes per partition for the row-dependent buffers (x^T, acc^T, h, z^T)
SWIGLU_COLS = 1024  # columns of I per swiglu tile call (bounds its fp32 scratch)


def _rows_per_pass(h: int, i: int, r: int) -> int:
    """Rows processed per pass: as many 128-row tiles as the SBUF row budget holds (x^T 2H + acc^T 4H +
    h 4I + z^T 2I bytes per row and partition, /128 for the K-major ones), at most 512 (one PSUM bank)."""
    per_tile = (2 * h + 4 * h + 2 * i) + 4 * i  # per 128 rows, bytes per partition
    tiles = max(1, min(MOVING_MAX // P, SBUF_ROW_BUDGET // per_tile))
    return min(r, tiles * P)


def local_experts_kernel(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset,
                         swiglu_limit=None, fp8_max=240.0, skip_unrouted=True):
    """Fused local experts (SPEC §1.7) on one NeuronCore.

    Dimensions:
        R: gathered rows, H: hidden, I: intermediate, L: local experts, k: top-k slots, g: activation group.

    Args:
        x (nl.ndarray): [R, H] bf16 or float8_e4m3fn, HBM.
        x_scale (nl.ndarray): [R, H/g] float32, HBM (fp8 x), else None.
        topk_idx (nl.ndarray): [R, k] int32 global expert ids (−1 = empty slot), HBM.
        topk_weights (nl.ndarray): [R, k] float32, HBM.
        w13 (nl.ndarray): [L, 2I, H] bf16 / float8_e4m3fn, or [L, 2I, H/2] uint8 (fp4), HBM. Rows [0, I) gate,
            [I, 2I) up.
        w13_scale (nl.ndarray): [L, 2I, H/128] float32 (fp8), [L, 2I, H/32] uint8 UE8M0 (fp4), or None.
        w2 (nl.ndarray): [L, H, I] (fp4: [L, H, I/2]), HBM.  w2_scale: as w13_scale with K = I.
        expert_offset (int): global id of local expert 0.
        swiglu_limit (float | None): SwiGLU clamp (gate ≤ L, |up| ≤ L).
        fp8_max (float): fp8 range of z (fp8 x only): ≤ 240 on trn2; 448 needs e4m3fn on chip (trn3).
        skip_unrouted (bool): runtime skip of experts no row selects (True) or the static all-experts loop.

    Returns:
        acc (nl.ndarray): [R, H] float32 in shared HBM.

    Notes:
        - H, I multiples of 128; R any (passes of up to 512 rows that fit the SBUF row budget; weights are
          streamed once per pass).
        - z uses x's activation group g (fp8) or is bf16 (bf16 x), as the reference.
        - SBUF per partition: x^T 2HR/128 + acc^T 4HR/128 + h 4I + z^T 2IR/128 bytes + one decoded weight block.

    Pseudocode:
        w_all[r, e] = Σ_j [idx[r, j] == off + e] · w[r, j]      # slot order, padding-safe
        xT = transpose(routed_anywhere ? dequant(x) : 0)
        accT = 0
        for e in experts (runtime-skipped when unrouted):
            for nb in 2I/128:  hT[nb] = bf16(decode(W13[e, nb])ᵀ · xT)
            h = transpose(hT)                                   # rows on partitions
            z = dequant(swiglu_and_cast(h, w_all[:, e]))        # bf16, exact for pow2 scales
            zT = transpose(z)
            for hb in H/128:   accT[hb] += bf16(decode(W2[e, hb])ᵀ · zT)
        out = transpose(accT)
    """
    r, h = x.shape
    n_local = w13.shape[0]
    fmt_w = weight_format(w13)
    two_i = w13.shape[1]
    inter = two_i // 2
    assert weight_k(w13, fmt_w) == h, f"w13 has K={weight_k(w13, fmt_w)}, x has H={h}"
    assert w2.shape[1] == h and weight_k(w2, fmt_w) == inter, "w2 must be [L, H, I] in w13's format"
    assert h % P == 0 and inter % P == 0, f"H={h} and I={inter} must be multiples of {P}"
    if act_format(x) == "fp8":
        group = h // x_scale.shape[1]
        e4m3fn_native = nisa.get_nc_version() == nisa.nc_version.gen4
        assert fp8_max <= 240.0 or e4m3fn_native, (
            f"fp8_max={fp8_max} needs float8_e4m3fn on chip (trn3); on trn2 quantize z with fp8_max <= 240")
    else:
        group = None

    out = nl.ndarray((r, h), dtype=nl.float32, buffer=nl.shared_hbm, name="acc_out")
    rp = _rows_per_pass(h, inter, r)
    for r0 in range(0, r, rp):
        _rows_pass(out, x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset,
                   swiglu_limit, fp8_max, skip_unrouted, r0, min(rp, r - r0), n_local, fmt_w, inter, group)
    return out


def _routing(topk_idx, topk_weights, r0: int, rt: int, expert_offset: int, n_local: int):
    """Per-row routing of one 128-row tile, in row layout.

    Returns:
        w_all: SBUF float32 [rt, L], ``Σ_j [idx[r, j] == off + e] · w[r, j]`` summed in slot order (SPEC §1.3:
            duplicates add up); weights of empty (−1) slots are replaced by 0 before any arithmetic.
        hits: SBUF float32 [rt, L], the number of slots of row r that name local expert e.
        routed: SBUF uint8 [rt, 1], 1 where the row names any local expert.
    """
    k = topk_idx.shape[1]
    idx = nl.ndarray((rt, k), dtype=nl.int32, buffer=nl.sbuf, name="topk_idx")
    nisa.dma_copy(dst=idx, src=topk_idx[r0:r0 + rt, :])
    w_raw = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_w")
    nisa.dma_copy(dst=w_raw, src=topk_weights[r0:r0 + rt, :])
    # padding rows read as id −1 and weight NaN: select, never multiply, the weights of real slots
    valid = nl.ndarray((rt, k), dtype=nl.uint8, buffer=nl.sbuf, name="slot_valid")
    nisa.tensor_scalar(dst=valid, data=idx, op0=nl.greater_equal, operand0=0.0)
    w = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_w_clean")
    nisa.memset(dst=w, value=0.0)
    nisa.tensor_copy_predicated(dst=w, src=w_raw, predicate=valid)
    idx_f = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_idx_f32")
    nisa.tensor_copy(dst=idx_f, src=idx)  # exact: ids < 2^24
    ids = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="local_ids")
    nisa.iota(dst=ids, pattern=[[1, n_local]], offset=expert_offset)
    w_all = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="w_all")
    hits = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="hits")
    eq = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="slot_eq")
    for j in range(k):
        dst_eq = hits if j == 0 else eq
        nisa.tensor_scalar(dst=dst_eq, data=ids, op0=nl.equal, operand0=idx_f[:, j:j + 1])
        if j == 0:
            nisa.tensor_scalar(dst=w_all, data=hits, op0=nl.multiply, operand0=w[:, 0:1])
        else:
            nisa.scalar_tensor_tensor(dst=w_all, data=eq, op0=nl.multiply, operand0=w[:, j:j + 1], op1=nl.add,
                                      operand1=w_all)
            nisa.tensor_tensor(dst=hits, data1=hits, data2=eq, op=nl.add)
    any_hit = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="any_hit")
    nisa.tensor_reduce(dst=any_hit, op=nl.maximum, data=hits, axis=(1,))
    routed = nl.ndarray((rt, 1), dtype=nl.uint8, buffer=nl.sbuf, name="routed")
    nisa.tensor_copy(dst=routed, src=any_hit)
    return w_all, hits, routed


def _expert_flags(hits_tiles, n_local: int):
    """SBUF int32 [1, L]: ``min(Σ_rows hits[:, e], 1)`` — 1 for experts some row selects (TensorE row sum)."""
    cnt = nl.ndarray((1, n_local), dtype=nl.float32, buffer=nl.psum, name="expert_rows")
    for t, hits in enumerate(hits_tiles):
        rt = hits.shape[0]
        ones = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="ones_col")
        nisa.memset(dst=ones, value=1.0)
        for c0 in range(0, n_local, MOVING_MAX):
            c = min(MOVING_MAX, n_local - c0)
            nisa.nc_matmul(dst=cnt[:, c0:c0 + c], stationary=ones, moving=hits[:, c0:c0 + c], accumulate=t != 0)
    flags = nl.ndarray((1, n_local), dtype=nl.int32, buffer=nl.sbuf, name="expert_flags")
    nisa.tensor_scalar(dst=flags, data=cnt, op0=nl.minimum, operand0=1.0)
    return flags


def _column(t, e):
    """Column e of an SBUF [p, L] tile as a (p, 1) view; e static or a register."""
    if isinstance(e, int):
        return t[:, e:e + 1]
    return t.ap(pattern=[[t.shape[1], t.shape[0]], [1, 1]], offset=0, scalar_offset=e, indirect_dim=1)


def _expert_body(e, xT, accT, w_all_tiles, w13, w13_scale, w2, w2_scale, fmt_w, h, inter, r, swiglu_limit,
                 fp8_max, group):
    """One expert (static int or register e): GEMM1 → swiglu-and-cast → GEMM2 → acc^T += bf16(d^T)."""
    nkb_i = inter // P
    # ---- GEMM1: h^T blocks → row tiles h [rt, 2I] bf16
    h_rows = [nl.ndarray((min(P, r - r0), 2 * inter), dtype=nl.bfloat16, buffer=nl.sbuf, name="h_rows")
              for r0 in range(0, r, P)]
    n_blocks = 2 * inter // P
    grp = rows_per_dma(fmt_w, h, n_blocks)
    for g0 in range(0, n_blocks, grp):
        w13_tiles = load_weight_group(w13, w13_scale, e, g0 * P, grp, fmt_w, h)
        for j in range(grp):
            hT = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="hT")
            block_times_rows(hT, w13_tiles, j, xT, fmt_w, h, r)  # h = bf16(GEMM1)
            rows_from_kmajor(h_rows, hT, (g0 + j) * P, r)
    # ---- swiglu-and-cast per row tile (rows on partitions: groups along the free dim), z → z^T bf16
    zT = nl.ndarray((P, nkb_i, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="zT")
    fp8 = group is not None
    cols = min(inter, SWIGLU_COLS)
    for t, hr in enumerate(h_rows):
        rt = hr.shape[0]
        w_e = _column(w_all_tiles[t], e)
        z = nl.ndarray((rt, inter), dtype=nl.bfloat16, buffer=nl.sbuf, name="z_rows")
        for c0 in range(0, inter, cols):
            c = min(cols, inter - c0)
            res = swiglu_cast_tile(hr[:, c0:c0 + c], hr[:, inter + c0:inter + c0 + c], w_e, swiglu_limit,
                                   "fp8" if fp8 else "bf16", group if fp8 else 128, fp8_max)
            if fp8:
                q, s = res  # dequantize exactly: q has ≤ 4 significant bits, s is a power of two
                gc = c // group
                nisa.tensor_tensor(dst=z[:, c0:c0 + c].reshape((rt, gc, group)), data1=q.reshape((rt, gc, group)),
                                   data2=s.reshape((rt, gc, 1)).broadcast(2, group), op=nl.multiply)
            else:
                nisa.tensor_copy(dst=z[:, c0:c0 + c], src=res)
        transpose_blocks(zT[:, :, t * P:t * P + rt], z, rt, nkb_i, (nisa.engine.vector,))
    # ---- GEMM2: acc^T[hb] += bf16(W2[e, hb] · z)
    n_blocks2 = h // P
    grp2 = rows_per_dma(fmt_w, inter, n_blocks2)
    for g0 in range(0, n_blocks2, grp2):
        w2_tiles = load_weight_group(w2, w2_scale, e, g0 * P, grp2, fmt_w, inter)
        for j in range(grp2):
            hb = g0 + j
            d_bf = nl.ndarray((P, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="dT")
            block_times_rows(d_bf, w2_tiles, j, zT, fmt_w, inter, r)  # d = bf16(GEMM2)
            nisa.tensor_tensor(dst=accT[:, hb, :], data1=accT[:, hb, :], data2=d_bf, op=nl.add)


def _rows_pass(out, x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset,
               swiglu_limit, fp8_max, skip_unrouted, r0, r, n_local, fmt_w, inter, group):
    """Everything for rows [r0, r0 + r) (r ≤ 512)."""
    h = x.shape[1]
    nkb_h = h // P
    # ---- routing (row layout), per 128-row tile
    w_all_tiles, hits_tiles, routed_tiles = [], [], []
    for t0 in range(0, r, P):
        w_all, hits, routed = _routing(topk_idx, topk_weights, r0 + t0, min(P, r - t0), expert_offset, n_local)
        w_all_tiles.append(w_all)
        hits_tiles.append(hits)
        routed_tiles.append(routed)
    # ---- x^T (shared by all experts), rows routed nowhere zeroed
    xs = x[r0:r0 + r, :]
    xss = None if x_scale is None else x_scale[r0:r0 + r, :]
    xT = nl.ndarray((P, nkb_h, r), dtype=nl.bfloat16, buffer=nl.sbuf, name="xT")
    load_a_kmajor(xT, xs, xss, routed_tiles)
    accT = nl.ndarray((P, nkb_h, r), dtype=nl.float32, buffer=nl.sbuf, name="accT")
    nisa.memset(dst=accT, value=0.0)

    def body(e):
        _expert_body(e, xT, accT, w_all_tiles, w13, w13_scale, w2, w2_scale, fmt_w, h, inter, r, swiglu_limit,
                     fp8_max, group)

    if skip_unrouted:
        flags = _expert_flags(hits_tiles, n_local)

        def outer(e):
            f = nisa.register_alloc(0)
            nisa.register_load(f, _column(flags, e))
            nl.fori_loop(0, f, lambda _i: body(e))

        nl.fori_loop(0, n_local, outer)
    else:
        for e in range(n_local):
            body(e)

    # ---- acc^T → rows (fp32 TensorE transposes, bit-exact) → HBM
    for t0 in range(0, r, P):
        rt = min(P, r - t0)
        rows = nl.ndarray((rt, h), dtype=nl.float32, buffer=nl.sbuf, name="acc_rows")
        for hb0 in range(0, nkb_h, 4):
            nb = min(4, nkb_h - hb0)
            pt = nl.ndarray((rt, 4, P), dtype=nl.float32, buffer=nl.psum, name="acc_psum")
            for j in range(nb):
                nisa.nc_transpose(dst=pt[:, j, :], data=accT[:, hb0 + j, t0:t0 + rt])
            nisa.tensor_copy(dst=rows[:, hb0 * P:(hb0 + nb) * P], src=pt[:, :nb, :], engine=nisa.engine.vector)
        nisa.dma_copy(dst=out[r0 + t0:r0 + t0 + rt, :], src=rows)
