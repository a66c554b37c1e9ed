"""NKI kernel: the fused local-experts step (SPEC §1.7) — GEMM1 → swiglu-and-cast → GEMM2 → weighted fp32
accumulate, each expert over exactly the rows routed to it.

Per local expert e (global id expert_offset + e) and its C_e routed rows (the reference's ``rows``):

    h   = bf16(x[rows] · W13_eᵀ)                             [C_e, 2I]  (GEMM1, PSUM fp32 → bf16)
    z   = swiglu_and_cast(h, w_e[rows], limit, act format)    [C_e, I]   (SBUF; fp8 with x's group g)
    d   = bf16(z · W2_eᵀ)                                     [C_e, H]   (GEMM2)
    acc[rows] += d (fp32), experts in increasing local id     [R, H]

Routed-row compaction
---------------------
The TensorE, evacuation and swiglu work of an expert is proportional to its *routed* rows, not to the R gathered
rows: the kernel builds, on device, a work list of items (expert e, chunk c) of at most M rows each (``M =
chunk_rows_for(R, k, E)``, a power of two ≤ 128: twice the mean rows per expert, so an expert is one item in the
common case; at most 32 on the per-K-block fp8 path, whose evacuation grows with M), sorted by expert, and runs
one static item body per list entry:

1. Routing, per 128-row tile (rows on partitions, local experts along the free dim): ``hit[r, e]`` (row r names
   e), ``w_all[r, e]`` (slot-order sum of its weights, SPEC §1.3; padding slots never reach arithmetic).
2. On the TensorE, exact in fp32 PSUM (integers < 2^24): the expert row counts ``C_e = Σ_r hit[r, e]`` (ones ·
   hit) and each hit's rank in its expert, ``pos[r, e] = Σ_{r' < r} hit[r', e]`` (a strictly-triangular ones
   matrix · hit, plus the counts of the earlier tiles).
3. ``n_e = ⌈C_e / M⌉`` (int32 add and shift), ``base_e = Σ_{e' < e} n_e'`` (VectorE running sum along the free
   dim), N = Σ n_e items. A hit's slot in the flat item table is ``M·base_e + pos[r, e]`` (item base_e + ⌊pos/M⌋,
   row pos mod M), so one indirect DMA per top-k slot scatters ``(row id, w_all)`` of every row into the table
   (non-local slots get an out-of-range address and are skipped). Unfilled slots keep the pad row id R.
4. The expert of item i, ``#{e : base_e + n_e ≤ i}``, is computed with items on partitions and stored next to
   the table.
5. A runtime loop of N iterations (unrouted experts have no item: no weight byte read, no instruction issued;
   L never appears in a loop) with the item index in a (1, 1) SBUF counter. Per item: the expert id and the
   item's M (row, weight) pairs come in by DMA at that counter (``.ap(scalar_offset=<SBUF (1, 1)>)`` on HBM);
   the rows of x are gathered by an indirect DMA (``.ap(vector_offset=...)``, pad rows skipped); they are
   transposed on the TensorE into ``x^T [k, H/128, M]``, the moving operand of GEMM1 (weights stationary,
   ``nki_kernels/expert_gemm.py``); swiglu-and-cast runs on M row-tiles; GEMM2 gives ``d^T`` which is
   transposed to rows and added into ``acc`` in HBM by gather → VectorE add → scatter (fp32 ``acc[row] +
   float(d)``, exactly the reference's ``index_add_``). Items run in expert order, so every row's sum runs over
   its experts in increasing id, as the reference.

LNC = 2 (``kernel[2]``; the trn2 default): both logical cores build the same work list (each in its own
private HBM), core 0 runs items [0, ⌈N/2⌉) and core 1 items [⌈N/2⌉, N), so each streams about half the routed
experts' weights. Core 0 zeroes ``acc`` and adds its items as above; core 1 stores each item's d rows (bf16) to a
private staging buffer, and after a ``core_barrier`` (core 0 done) adds them in item order. Every row therefore
gets the same fp32 adds in the same order as on one core: the result is bitwise the LNC = 1 result, and no two
cores ever write the same ``acc`` rows at once (a token routed to experts on both cores).

Rows routed to no local expert (0xFF padding: id −1, NaN weight, NaN x) are never gathered: they stay the zeros
``acc`` was initialised with. A row's arithmetic depends only on its own column of each item (batch invariance).
An expert with more than M rows is split over several items, each streaming the expert's weights again (the
cost of skewed routing; uniform routing gives one item per routed expert).

``skip_unrouted=False`` is the static variant: the same tables with ``n_e = ⌈R / M⌉`` for every expert and a
Python-unrolled item list (every expert's weights are read; no runtime control flow).

Documented constructs used, and where they are documented or used publicly
--------------------------------------------------------------------------
- Triangular / ones matmuls for counts and ranks, fp32 operands: ISA ``nc_matmul`` (fp32 inputs, fp32 PSUM).
- ``nisa.iota`` (row ids, thresholds), ``tensor_scalar`` / ``tensor_tensor`` / ``tensor_reduce``: ISA stubs.
- Running sum along the free dim: ISA ``tensor_scalar_cumulative`` (pseudocode in the stub).
- int32 add and ``right_shift`` on VectorE (``tensor_scalar``): ISA bitvec ops (VectorE, immediate < 2^24).
- Scatter of the table entries: ``dma_copy`` to an HBM ``.ap(vector_offset=<SBUF (P, 1) int32>)`` view with
  ``oob_mode.skip``: APS deep-dive (indirect DMA) and ISA ``dma_copy``; nki-library's blockwise MoE spills its
  block rows so (``core/moe/moe_tkg/down_projection_mx_shard_I.py``, dst-side ``vector_offset``) and gathers
  token rows from HBM the same way, ``oob_mode.skip`` for −1 ids (``all_expert_mx_impl.py``).
- Runtime loop with a register trip count: LANG ``nl.fori_loop`` (NKI 0.6); the loop counter lives in a (1, 1)
  SBUF tile incremented by ``tensor_scalar``, as ``all_expert_mx_impl.py``'s dynamic-block loop does;
  ``register_load`` reads a plain (1, 1) SBUF tile (ISA ``register_load``), never an ``.ap`` view.
- Per-item table rows and the expert id: ``dma_copy`` from HBM ``.ap(scalar_offset=<SBUF (1, 1) tensor>)``
  (APS; ``all_expert_mx_impl.py`` loads its per-block indices so; ``selective_expert_impl.py`` addresses
  expert weights by an SBUF index through ``scalar_offset``). No SBUF ``.ap(scalar_offset=...)`` is used as a
  compute operand or register source, and no runtime loop is nested.
- Row scatter-add: gather the item's acc rows (``dma_copy`` from HBM ``.ap(vector_offset=...)``), add d on the
  VectorE (``tensor_tensor``, fp32), scatter them back (``dma_copy`` to the same indirect view), ACC_COLS
  columns at a time: nki-library's ``experimental/misc/scatter_add.py`` (gather-accumulate-scatter, unique
  indices per 128-row tile). An item's M rows are distinct tokens (a token that names an expert twice is one
  row with the summed weight). The DMA read-modify-write the ISA pages document (``dma_compute`` scatter RMW,
  ``dma_copy`` ``dst_rmw_op``) is not used: no public kernel accumulates into HBM that way, and it runs at half
  rate before NeuronCore-v4. RISK (unchanged): consecutive items' gathers must see the previous scatter of the
  same rows; both are DMAs on the same HBM tensor, which the compiler orders (not verified on a device).
- LNC = 2: ``nl.program_id(0)`` / ``nl.num_programs(0)`` split the items (LANG; nki-library's
  ``indexed_flatten.py`` shards rows over ``program_id`` so); ``nl.private_hbm`` for each core's work list and
  staging (LANG: "only visible to each individual kernel instance in the SPMD grid"); ``nisa.core_barrier`` on
  the shared ``acc`` (ISA ``core_barrier``: shared-HBM writes before it are visible after it); the item split
  uses int32 add and ``right_shift`` on a (1, 1) tile, the counts reach ``register_load`` as plain (1, 1) tiles.
- Runtime loop: ``nl.fori_loop`` with a register trip count is documented (LANG, NKI 0.6) but public kernels
  use ``nl.dynamic_range`` or ``while reg:`` (RISK, noted).
- TensorE transposes of bf16 (x, h, z, d) into bf16 PSUM: ISA ``nc_transpose``; fp32 is transposed only for
  the trn2 fp8 per-block weight scales (``expert_gemm_tiles``, instead of a ``dma_transpose`` at a runtime
  address, NKI-415).

Buffers: the per-item tiles are allocated once outside the runtime loop (static addresses, as runtime loops
require); the weight tiles inside ``load_weight_group`` are fresh per weight group, so consecutive groups'
DMAs overlap the previous group's matmuls (the overlap the cost model's estimate assumes).
"""

from __future__ import annotations

from static_moe.nki.shim import nisa, nl

from .expert_gemm import WEIGHT_LAYOUTS, block_times_rows, load_weight_group, rows_per_dma, weight_format, weight_k
from .expert_gemm_tiles import (
    MOVING_MAX,
    P,
    WeightRing,
    act_format,
    act_rows_into_operand,
    alloc_act_operand,
    fp8_rows_to_bf16,
    fp8_rows_to_mx,
    gemm_block,
    group_operand,
    load_weight_slab,
    rows_from_kmajor,
    weight_plan,
)
from .lnc import programs_and_rank, split
from .swiglu_and_cast import DEFAULT_ALPHA, swiglu_cast_tile

SWIGLU_COLS = 1024  # columns of I per swiglu tile call (bounds its fp32 scratch)
ACC_COLS = 1024  # columns of acc per gather → add → scatter (4 KiB fp32 per partition: a full-rate DMA payload)
MAX_CHUNK = P  # rows per work item: gathered rows land on partitions


def chunk_rows_for(rows: int, topk: int, num_experts: int, cap: int = MAX_CHUNK) -> int:
    """M, the rows per work item: the power of two ≥ twice ``⌈R·min(k, E)/E⌉`` — the mean rows per expert when
    the R gathered rows route top-k over E experts (E = the layer's global experts; with expert parallelism over S
    ranks of capacity C, R = S·C tokens do) — capped at ``cap`` (≤ 128) and at R rounded up to a power of two.

    Small M keeps the evacuations, transposes and swiglu of an item proportional to the routed rows; the TensorE
    charges max(M, 64) cycles per 128×128 block anyway, so M below 64 costs it nothing more. Twice the mean makes
    one item per routed expert the common case; an expert with more than M rows takes several items and streams
    its weights once per item (see :func:`chunk_cap` for the path where that is the better trade)."""
    mean = -(-rows * min(topk, num_experts) // num_experts)
    m = 1
    while m < 2 * mean and m < min(cap, MAX_CHUNK):
        m *= 2
    full = 1
    while full < rows:
        full *= 2
    return max(1, min(m, full, cap, MAX_CHUNK))


def chunk_cap(weight_path: str) -> int:
    """The :func:`chunk_rows_for` cap for a GEMM path (``expert_gemm_tiles.WeightPlan.path``; ``"eoi"`` for the
    unprepared decode path): 32 on the per-K-block fp8 path, 128 elsewhere.

    The per-K-block fp8 evacuation costs VectorE / GpSimd (ScalarE from 64 rows) time per evacuated column
    times K/128, so beyond a few tens of rows per expert it binds either way; a 64-row item for a 24-row expert
    then evacuates 40 pad columns for nothing, while two 32-row items cost one more weight stream, which the
    evacuation hides. Cost model (``bench/bench_nki_gemm.py``, V4-Flash, EP 8, T = 128, fp8 × fp8, 32 items):
    M = 128 → 30 %, M = 64 → 45 %, M = 32 → 50 % of the roofline; at small means the cap does not bind
    (M = 2 … 8 keeps one item per expert)."""
    return 32 if weight_path == "fp8_block" else MAX_CHUNK


def local_experts_kernel(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset,
    swiglu_limit=None,
    fp8_max=240.0,
    skip_unrouted=True,
    chunk_rows=None,
    weight_layout="eoi",
    num_experts=None,
    activation="silu",
    alpha=DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
):
    """Fused local experts (SPEC §1.7) on one NeuronCore, over each expert's routed rows only.

    Dimensions:
        R: gathered rows, H: hidden, I: intermediate, L: local experts, k: top-k slots, g: activation group,
        M: rows per work item, N: work items (Σ_e ⌈C_e / M⌉).

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
        skip_unrouted (bool): True: the runtime work list (unrouted experts cost nothing); False: the static
            variant (every expert, ⌈R / M⌉ items each, no runtime control flow).
        chunk_rows (int | None): M (a power of two ≤ 128); None: :func:`chunk_rows_for` with num_experts.
        num_experts (int | None): the layer's global expert count E (for the chunk policy only; None: L, i.e.
            every expert is local, as without expert parallelism).
        weight_layout (str): ``"eoi"`` (nn.Linear ``[L, N, K]``, the shapes above) or ``"eio"`` (prepared,
            K-major, ``python/static_moe/layouts.py``: w13 ``[L, H, 2I]`` bf16 / e4m3fn (trn2: re-encoded) with
            fp32 ``[L, H/128, 2I]`` scales, or x4-packed ``[L, H/4, 2I]`` uint32 (fp8 MX, trn3) / uint16 (fp4)
            with UE8M0 ``[L, H/32, 2I]``; w2 likewise with K = I, N = H).
        activation (str), alpha (float): the gated activation of SPEC §1.9 (``swiglu_and_cast``'s).
        w13_bias (nl.ndarray | None): [L, 2I] float32, HBM: ``h = bf16(x·W13ᵀ + b13)``.
        w2_bias (nl.ndarray | None): [L, H] float32, HBM: ``d = bf16(z·W2ᵀ + w·b2)`` with w the row's routing
            weight (one fp32 product). Both added in fp32 before the bf16 rounding (:class:`_BiasEpilogues`).

    Returns:
        acc (nl.ndarray): [R, H] float32 in shared HBM.

    Notes:
        - H, I multiples of 128; R any.
        - z uses x's activation group g (fp8) or is bf16 (bf16 x), as the reference.
        - HBM scratch: the item table (N_max·M·8 bytes), the item experts (4·N_max), and for fp8 x its
          decoded bf16 rows (2·R·H); per core at LNC = 2, and core 1's staged d rows (⌊N_max/2⌋·M·H·2).
        - SBUF per partition: the routing tiles (≈ 16·L bytes per 128 rows) and per item x 2H, x^T 2HM/128,
          h 4I, z^T 2IM/128, d 2H, acc 4·min(H, 1024) bytes + the weight group in flight.
        - Launch with ``kernel[1]`` or ``kernel[2]`` (LNC); the result is bitwise the same.

    Pseudocode:
        hit, w_all = routing(topk_idx, topk_weights)                   # [R, L]
        C = Σ_r hit; pos = exclusive prefix count of hit over rows      # TensorE, exact
        n = ceil(C / M); base = exclusive prefix sum of n; N = Σ n
        table[M·base_e + pos[r, e]] = (r, w_all[r, e])   for every hit (one scatter per top-k slot)
        expert_of[i] = #{e : base_e + n_e ≤ i}
        acc = 0
        for i in runtime range(N):                                      # items in expert order
            e = expert_of[i]; rows, w = table[i]                        # M rows (pad rows = R, skipped)
            xT = transpose(gather(x, rows))
            h = bf16(W13[e] · xT); z = swiglu_and_cast(h, w); d = bf16(W2[e] · z)
            acc[rows] += d                                              # gather → add → scatter
        LNC = 2: core 0 runs items [0, ⌈N/2⌉) as above; core 1 runs [⌈N/2⌉, N) storing d to a private stage,
        then, after core_barrier(acc), adds the staged d in item order (bitwise the LNC = 1 result)
    """
    assert weight_layout in WEIGHT_LAYOUTS, f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}"
    r, h = x.shape
    k = topk_idx.shape[1]
    n_local = w13.shape[0]
    fmt_x = act_format(x)
    if weight_layout == "eio":
        g1, g2 = _EioGemm(w13, w13_scale, fmt_x, "w13"), _EioGemm(w2, w2_scale, fmt_x, "w2")
        assert g1.k == h and g2.n == h, f"w13 must be EIO [L, H, 2I] and w2 [L, I, H] with H={h}"
        assert g1.n == 2 * g2.k, f"w13 has 2I={g1.n}, w2 has I={g2.k}"
    else:
        fmt_w = weight_format(w13)
        assert weight_k(w13, fmt_w) == h, f"w13 has K={weight_k(w13, fmt_w)}, x has H={h}"
        g1 = _EoiGemm(w13, w13_scale, fmt_w, h, w13.shape[1])
        g2 = _EoiGemm(w2, w2_scale, fmt_w, weight_k(w2, fmt_w), w2.shape[1])
        assert w2.shape[1] == h and 2 * g2.k == g1.n, "w2 must be [L, H, I] in w13's format"
    inter = g2.k
    assert h % P == 0 and inter % P == 0, f"H={h} and I={inter} must be multiples of {P}"
    if fmt_x == "fp8":
        group = h // x_scale.shape[1]
        e4m3fn_native = nisa.get_nc_version() == nisa.nc_version.gen4
        assert fp8_max <= 240.0 or e4m3fn_native, (
            f"fp8_max={fp8_max} needs float8_e4m3fn on chip (trn3); on trn2 quantize z with fp8_max <= 240"
        )
    else:
        group = None
    if chunk_rows is None:
        m = chunk_rows_for(r, k, num_experts or n_local, chunk_cap(g1.path))
    else:
        m = int(chunk_rows)
    if weight_layout == "eio":  # the plans again, now that the rows per GEMM call are known (group path ≤ 4 rows)
        g1, g2 = _EioGemm(w13, w13_scale, fmt_x, "w13", m), _EioGemm(w2, w2_scale, fmt_x, "w2", m)
    assert 1 <= m <= MAX_CHUNK and m & (m - 1) == 0, f"chunk_rows={m} must be a power of two in [1, {MAX_CHUNK}]"
    q_static = -(-r // m)  # items per expert in the static variant
    k_eff = min(k, n_local)
    if skip_unrouted:
        n_max = min(n_local * q_static, -(-r * k_eff // m) + min(n_local, r * k_eff))
    else:
        n_max = n_local * q_static

    programs, rank = programs_and_rank("local_experts")
    out = nl.ndarray((r, h), dtype=nl.float32, buffer=nl.shared_hbm, name="acc_out")
    tiles, ids = _routing_tiles(topk_idx, topk_weights, expert_offset, n_local, r)
    table, item_expert, n_items = _work_list(tiles, ids, r, n_local, m, n_max, skip_unrouted, q_static)
    x_rows = _x_rows_source(x, x_scale, tiles, r, h, g1.korder)
    if rank == 0:  # core 1 adds into acc only after the barrier, by when core 0 has zeroed and added its items
        _zero_rows(out, r, h)

    bufs = _ItemBuffers(m, h, inter, g1, g2, fmt_x, group)
    var = _BiasEpilogues(activation, alpha, w13_bias, w2_bias, table, m, h, inter)
    # LNC = 2: core 1 stages the d rows of its items (the later ones) and adds them after the barrier
    stage = None
    if rank == 1:
        stage = nl.ndarray((max(1, n_max // 2), m, h), dtype=nl.bfloat16, buffer=nl.private_hbm, name="item_d_stage")
    if skip_unrouted:
        first, count = _core_share(n_items, programs, rank)
        counter = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="item_counter")
        if first is None:
            nisa.memset(dst=counter, value=0)
        else:
            nisa.tensor_copy(dst=counter, src=first)
        slot = None
        if stage is not None:
            slot = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="stage_slot")
            nisa.memset(dst=slot, value=0)
        n_reg = nisa.register_alloc(0)
        nisa.register_load(n_reg, count)

        def body(_i):
            e_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="item_expert")
            nisa.dma_copy(
                dst=e_sb, src=item_expert.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=counter, indirect_dim=0)
            )
            meta = table.ap(pattern=[[2, m], [1, 2]], offset=0, scalar_offset=counter, indirect_dim=0)
            var.load(e_sb, counter)
            sink = None if slot is None else _stage_slot(stage, slot, m, h)
            _item(out, x_rows, meta, e_sb, bufs, g1, g2, h, inter, m, swiglu_limit, fp8_max, group, var, sink)
            nisa.tensor_scalar(dst=counter, data=counter, op0=nl.add, operand0=1)
            if slot is not None:
                nisa.tensor_scalar(dst=slot, data=slot, op0=nl.add, operand0=1)

        nl.fori_loop(0, n_reg, body)
    else:
        start, count = split(n_max, 1, programs, rank)  # core 0 the first ⌈N/2⌉ items, core 1 the rest
        mine = range(start, start + count)
        for j, i in enumerate(mine):
            var.load(i // q_static, i)
            sink = None if stage is None else stage[j]
            _item(
                out, x_rows, table[i], i // q_static, bufs, g1, g2, h, inter, m, swiglu_limit, fp8_max, group, var, sink
            )
    if programs == 2:
        nisa.core_barrier(data=out, cores=(0, 1))
        if rank == 1:
            _add_staged(
                out,
                table,
                stage,
                bufs,
                m,
                h,
                first if skip_unrouted else None,
                count if skip_unrouted else None,
                None if skip_unrouted else mine,
            )
    return out


# ----------------------------------------------------------------------------------------------------------------
# LNC = 2: the items split over the two logical cores
# ----------------------------------------------------------------------------------------------------------------
def _core_share(n_items, programs: int, rank: int):
    """(first item, item count) of this core as (1, 1) int32 SBUF tiles (first None: item 0). LNC = 1: all N
    items. LNC = 2: core 0 takes items [0, ⌈N/2⌉), core 1 [⌈N/2⌉, N) (int32 add and right shift on VectorE)."""
    if programs == 1:
        return None, n_items
    half_up = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="items_core0")
    nisa.tensor_scalar(dst=half_up, data=n_items, op0=nl.add, operand0=1.0)
    nisa.tensor_scalar(dst=half_up, data=half_up, op0=nl.right_shift, operand0=1)
    if rank == 0:
        return None, half_up
    half_down = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="items_core1")
    nisa.tensor_scalar(dst=half_down, data=n_items, op0=nl.right_shift, operand0=1)
    return half_up, half_down


def _stage_slot(stage, slot, m: int, h: int):
    """The staging rows [M, H] bf16 of core 1's item number ``slot`` (a (1, 1) SBUF counter)."""
    return stage.ap(pattern=[[h, m], [1, h]], offset=0, scalar_offset=slot, indirect_dim=0)


def _add_staged(out, table, stage, bufs, m: int, h: int, first, count, items):
    """Core 1, after the barrier: ``acc[rows] += d`` for its staged items, in item order — the same adds, in the
    same order, as one core makes, so the result is bitwise the LNC = 1 result. ``items``: the static variant's
    item list; else ``first`` / ``count`` (SBUF (1, 1)) drive a second, non-nested runtime loop."""
    if items is not None:
        for j, i in enumerate(items):
            _accumulate_staged(out, table[i], stage[j], bufs, m, h)
        return
    counter = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="staged_item")
    nisa.tensor_copy(dst=counter, src=first)
    slot = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="staged_slot")
    nisa.memset(dst=slot, value=0)
    n_reg = nisa.register_alloc(0)
    nisa.register_load(n_reg, count)

    def body(_i):
        meta = table.ap(pattern=[[2, m], [1, 2]], offset=0, scalar_offset=counter, indirect_dim=0)
        _accumulate_staged(out, meta, _stage_slot(stage, slot, m, h), bufs, m, h)
        nisa.tensor_scalar(dst=counter, data=counter, op0=nl.add, operand0=1)
        nisa.tensor_scalar(dst=slot, data=slot, op0=nl.add, operand0=1)

    nl.fori_loop(0, n_reg, body)


def _accumulate_staged(out, meta_src, d_src, bufs, m: int, h: int):
    nisa.dma_copy(dst=bufs.meta, src=meta_src)
    nisa.tensor_copy(dst=bufs.rid, src=bufs.meta[:, 0:1])
    nisa.dma_copy(dst=bufs.d_rows, src=d_src)
    _accumulate(out, bufs, m, h)


# ----------------------------------------------------------------------------------------------------------------
# Routing and the work list
# ----------------------------------------------------------------------------------------------------------------
class _RowTile:
    """Routing of one 128-row tile in row layout (rows on partitions, local experts along the free dim)."""

    def __init__(self, r0, rt, idx_f, w_all, hit, routed):
        self.r0, self.rt = r0, rt
        self.idx_f = idx_f  # SBUF float32 [rt, k]: the slot ids (exact: ids < 2^24)
        self.w_all = w_all  # SBUF float32 [rt, L]: Σ_j [idx[r, j] == off + e] · w[r, j], slot order
        self.hit = hit  # SBUF float32 [rt, L]: 1 where row r names local expert e, else 0
        self.routed = routed  # SBUF uint8 [rt, 1]: 1 where the row names any local expert


def _routing_tiles(topk_idx, topk_weights, expert_offset: int, n_local: int, r: int):
    """(:class:`_RowTile` per 128 rows, the SBUF float32 ``[min(R, 128), L]`` tile of the local experts' global
    ids). Padding rows (id −1, NaN weight) select, never multiply: the weights of invalid slots are replaced by 0
    with a predicated copy before any arithmetic."""
    k = topk_idx.shape[1]
    tiles = []
    ids = nl.ndarray((min(P, r), n_local), dtype=nl.float32, buffer=nl.sbuf, name="local_ids")
    nisa.iota(dst=ids, pattern=[[1, n_local]], offset=expert_offset)
    for r0 in range(0, r, P):
        rt = min(P, r - r0)
        idx = nl.ndarray((rt, k), dtype=nl.int32, buffer=nl.sbuf, name="topk_idx")
        nisa.dma_copy(dst=idx, src=topk_idx[r0 : r0 + rt, :])
        w_raw = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_w")
        nisa.dma_copy(dst=w_raw, src=topk_weights[r0 : r0 + rt, :])
        valid = nl.ndarray((rt, k), dtype=nl.uint8, buffer=nl.sbuf, name="slot_valid")
        nisa.tensor_scalar(dst=valid, data=idx, op0=nl.greater_equal, operand0=0.0)
        w = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_w_clean")
        nisa.memset(dst=w, value=0.0)
        nisa.tensor_copy_predicated(dst=w, src=w_raw, predicate=valid)
        idx_f = nl.ndarray((rt, k), dtype=nl.float32, buffer=nl.sbuf, name="topk_idx_f32")
        nisa.tensor_copy(dst=idx_f, src=idx)
        w_all = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="w_all")
        hits = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="hits")
        eq = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="slot_eq")
        for j in range(k):
            dst_eq = hits if j == 0 else eq
            nisa.tensor_scalar(dst=dst_eq, data=ids[:rt], op0=nl.equal, operand0=idx_f[:, j : j + 1])
            if j == 0:
                nisa.tensor_scalar(dst=w_all, data=hits, op0=nl.multiply, operand0=w[:, 0:1])
            else:
                nisa.scalar_tensor_tensor(
                    dst=w_all, data=eq, op0=nl.multiply, operand0=w[:, j : j + 1], op1=nl.add, operand1=w_all
                )
                nisa.tensor_tensor(dst=hits, data1=hits, data2=eq, op=nl.add)
        hit = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="hit01")
        nisa.tensor_scalar(dst=hit, data=hits, op0=nl.minimum, operand0=1.0)  # duplicates count once
        any_hit = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="any_hit")
        nisa.tensor_reduce(dst=any_hit, op=nl.maximum, data=hit, axis=(1,))
        routed = nl.ndarray((rt, 1), dtype=nl.uint8, buffer=nl.sbuf, name="routed")
        nisa.tensor_copy(dst=routed, src=any_hit)
        tiles.append(_RowTile(r0, rt, idx_f, w_all, hit, routed))
    return tiles, ids


def _col_chunks(n: int):
    """[(c0, c)] column chunks of at most one PSUM bank (512 fp32) — the moving free size limit."""
    return [(c0, min(MOVING_MAX, n - c0)) for c0 in range(0, n, MOVING_MAX)]


def _work_list(tiles, ids, r: int, n_local: int, m: int, n_max: int, skip_unrouted: bool, q_static: int):
    """The item table, each item's expert and the item count (see the module docstring, steps 2–4).

    Returns:
        table: HBM float32 [N_max, M, 2]: per item its M (row id, routing weight) pairs; pad rows have id R and
            weight 0.
        item_expert: HBM int32 [N_max, 1] (runtime variant) or None.
        n_items: SBUF int32 (1, 1) holding N (runtime variant) or None.
    """
    log2m = m.bit_length() - 1
    # ---- counts C_e = Σ_r hit[r, e] (TensorE, fp32 exact)
    ones_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="ones_col")
    nisa.memset(dst=ones_col, value=1.0)
    cnt_ps = nl.ndarray((1, n_local), dtype=nl.float32, buffer=nl.psum, name="expert_rows")
    for t, tl in enumerate(tiles):
        for c0, c in _col_chunks(n_local):
            nisa.nc_matmul(
                dst=cnt_ps[:, c0 : c0 + c],
                stationary=ones_col[: tl.rt],
                moving=tl.hit[:, c0 : c0 + c],
                accumulate=t != 0,
            )
    # ---- n_e = ⌈C_e / M⌉ (int32: (C + M − 1) >> log2 M); static variant: ⌈R / M⌉ for every expert
    n_f = nl.ndarray((1, n_local), dtype=nl.float32, buffer=nl.sbuf, name="expert_items")
    if skip_unrouted:
        n_i = nl.ndarray((1, n_local), dtype=nl.int32, buffer=nl.sbuf, name="expert_items_i32")
        nisa.tensor_copy(dst=n_i, src=cnt_ps)  # exact: integers < 2^24
        nisa.tensor_scalar(dst=n_i, data=n_i, op0=nl.add, operand0=float(m - 1))
        nisa.tensor_scalar(dst=n_i, data=n_i, op0=nl.right_shift, operand0=log2m)
        nisa.tensor_copy(dst=n_f, src=n_i)
    else:
        nisa.memset(dst=n_f, value=float(q_static))
    # ---- end_e = Σ_{e' ≤ e} n_e' (running sum), M·base_e = M·(end_e − n_e)
    end = nl.ndarray((1, n_local), dtype=nl.float32, buffer=nl.sbuf, name="expert_end")
    nisa.tensor_scalar_cumulative(dst=end, src=n_f, op0=nl.multiply, op1=nl.add, imm0=1.0)
    mbase = nl.ndarray((1, n_local), dtype=nl.float32, buffer=nl.sbuf, name="expert_mbase")
    nisa.tensor_tensor(dst=mbase, data1=end, data2=n_f, op=nl.subtract)
    nisa.tensor_scalar(dst=mbase, data=mbase, op0=nl.multiply, operand0=float(m))

    # ---- the table, pre-filled with (R, 0): pad rows that every gather / scatter skips
    table = nl.ndarray((n_max, m, 2), dtype=nl.float32, buffer=nl.private_hbm, name="item_table")
    for i0 in range(0, n_max, P):
        ni = min(P, n_max - i0)
        fill = nl.ndarray((ni, m, 2), dtype=nl.float32, buffer=nl.sbuf, name="table_fill")
        nisa.memset(dst=fill, value=float(r))
        nisa.memset(dst=fill[:, :, 1], value=0.0)
        nisa.dma_copy(dst=table[i0 : i0 + ni], src=fill)
    flat = table.reshape((n_max * m, 2))
    big = float(n_max * m)  # an address past the table: the DMA skips it

    ones_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf, name="ones_row")
    nisa.memset(dst=ones_row, value=1.0)
    ones_sq = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf, name="ones_square")
    nisa.memset(dst=ones_sq, value=1.0)
    tri = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf, name="strict_upper")
    nisa.iota(dst=tri, pattern=[[1, P]], offset=0, channel_multiplier=-1)  # tri[r', r] = r − r'
    nisa.tensor_scalar(dst=tri, data=tri, op0=nl.greater, operand0=0.0)  # 1 where r' < r
    k = tiles[0].idx_f.shape[1]
    for t, tl in enumerate(tiles):
        rt = tl.rt
        # addr[r, e] = M·base_e + Σ_{earlier tiles} hit + Σ_{r' < r in this tile} hit   (PSUM fp32, exact)
        addr = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="hit_addr")
        for c0, c in _col_chunks(n_local):
            ps = nl.ndarray((rt, c), dtype=nl.float32, buffer=nl.psum, name="hit_addr_psum")
            nisa.nc_matmul(dst=ps, stationary=ones_row[:, :rt], moving=mbase[:, c0 : c0 + c], accumulate=False)
            for t2 in range(t):
                prev = tiles[t2]
                nisa.nc_matmul(
                    dst=ps, stationary=ones_sq[: prev.rt, :rt], moving=prev.hit[:, c0 : c0 + c], accumulate=True
                )
            nisa.nc_matmul(dst=ps, stationary=tri[:rt, :rt], moving=tl.hit[:, c0 : c0 + c], accumulate=True)
            nisa.tensor_copy(dst=addr[:, c0 : c0 + c], src=ps)
        # one scatter per top-k slot j: (row id, w_all[r, e_j]) to addr[r, e_j]; non-local slots → past the end
        rowid = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="row_id")
        nisa.iota(dst=rowid, pattern=[[0, 1]], offset=tl.r0, channel_multiplier=1)
        for j in range(k):
            eq = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="slot_onehot")
            nisa.tensor_scalar(dst=eq, data=ids[:rt], op0=nl.equal, operand0=tl.idx_f[:, j : j + 1])
            prod = nl.ndarray((rt, n_local), dtype=nl.float32, buffer=nl.sbuf, name="slot_prod")
            a_j = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="slot_addr")
            nisa.tensor_tensor(dst=prod, data1=eq, data2=addr, op=nl.multiply)
            nisa.tensor_reduce(dst=a_j, op=nl.add, data=prod, axis=(1,))  # one nonzero term: exact
            any_j = nl.ndarray((rt, 1), dtype=nl.float32, buffer=nl.sbuf, name="slot_local")
            nisa.tensor_reduce(dst=any_j, op=nl.add, data=eq, axis=(1,))
            # a_j += (1 − any_j) · big   (non-local slot: out of range)
            nisa.scalar_tensor_tensor(dst=a_j, data=any_j, op0=nl.multiply, operand0=-big, op1=nl.add, operand1=a_j)
            nisa.tensor_scalar(dst=a_j, data=a_j, op0=nl.add, operand0=big)
            a_i = nl.ndarray((rt, 1), dtype=nl.int32, buffer=nl.sbuf, name="slot_addr_i32")
            nisa.tensor_copy(dst=a_i, src=a_j)
            val = nl.ndarray((rt, 2), dtype=nl.float32, buffer=nl.sbuf, name="slot_entry")
            nisa.tensor_copy(dst=val[:, 0:1], src=rowid)
            nisa.tensor_tensor(dst=prod, data1=eq, data2=tl.w_all, op=nl.multiply)
            nisa.tensor_reduce(dst=val[:, 1:2], op=nl.add, data=prod, axis=(1,))
            nisa.dma_copy(
                dst=flat.ap(pattern=[[2, rt], [1, 2]], offset=0, vector_offset=a_i, indirect_dim=0),
                src=val,
                oob_mode=nisa.oob_mode.skip,
            )
    if not skip_unrouted:
        return table, None, None

    # ---- expert of item i = #{e : end_e ≤ i}, items on partitions (i = i0 + p)
    item_expert = nl.ndarray((n_max, 1), dtype=nl.int32, buffer=nl.private_hbm, name="item_expert_tab")
    for i0 in range(0, n_max, P):
        ni = min(P, n_max - i0)
        end_bc = nl.ndarray((ni, n_local), dtype=nl.float32, buffer=nl.sbuf, name="end_bcast")
        for c0, c in _col_chunks(n_local):
            ps = nl.ndarray((ni, c), dtype=nl.float32, buffer=nl.psum, name="end_bcast_psum")
            nisa.nc_matmul(dst=ps, stationary=ones_row[:, :ni], moving=end[:, c0 : c0 + c], accumulate=False)
            nisa.tensor_copy(dst=end_bc[:, c0 : c0 + c], src=ps)
        item = nl.ndarray((ni, 1), dtype=nl.float32, buffer=nl.sbuf, name="item_index")
        nisa.iota(dst=item, pattern=[[0, 1]], offset=i0, channel_multiplier=1)
        before = nl.ndarray((ni, n_local), dtype=nl.float32, buffer=nl.sbuf, name="expert_before")
        nisa.tensor_scalar(dst=before, data=end_bc, op0=nl.less_equal, operand0=item)
        e_f = nl.ndarray((ni, 1), dtype=nl.float32, buffer=nl.sbuf, name="item_expert_f32")
        nisa.tensor_reduce(dst=e_f, op=nl.add, data=before, axis=(1,))
        e_i = nl.ndarray((ni, 1), dtype=nl.int32, buffer=nl.sbuf, name="item_expert_i32")
        nisa.tensor_copy(dst=e_i, src=e_f)
        nisa.dma_copy(dst=item_expert[i0 : i0 + ni, :], src=e_i)
    # ---- N = end_{L−1} (the caller loads its share into a register)
    n_items = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="n_items")
    nisa.tensor_copy(dst=n_items, src=end[:, n_local - 1 : n_local])
    return table, item_expert, n_items


# ----------------------------------------------------------------------------------------------------------------
# The two GEMMs of an item, per weight layout
# ----------------------------------------------------------------------------------------------------------------
class _EioGemm:
    """A GEMM on prepared (EIO) weights through ``nki_kernels/expert_gemm_tiles.py``: K-major weight slabs DMA'd as the
    stationary operand into a ring of ``WEIGHT_BUFS`` buffers (allocated once, outside the runtime loop: the
    DMA of slab i+1 overlaps the matmuls of slab i, also across items)."""

    def __init__(self, w, w_scale, act_fmt: str, name: str, rows: int | None = None):
        self.w, self.w_scale = w, w_scale
        self.plan = weight_plan(w, act_fmt, rows)
        self.k, self.n, self.korder, self.path = self.plan.k, self.plan.n, self.plan.korder, self.plan.path
        self.kp = self.plan.kp  # the operand's K: padded to whole 512 blocks for the packed forms (zeros)
        self.ring = None
        self.name = name

    def alloc(self):
        self.ring = WeightRing(self.plan, self.name)

    def blocks(self, e, op, m: int, epilogue=None):
        """Yield ``(n0, dT [P, M] bf16)`` per 128 output features: ``bf16(Σ_k W_e[k, n0 + n] · rows[k, :M])``, or
        with ``epilogue(dT, fp32 sum, n0)`` the rounding of the sum plus a bias (:class:`_BiasEpilogues`)."""
        plan = self.plan
        for n0 in range(0, plan.n, plan.ncols):
            slab = load_weight_slab(self.ring, self.w, self.w_scale, e, n0)
            for j in range(plan.ncols // P):
                dT = nl.ndarray((P, m), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{self.name}_dT")
                if epilogue is None:
                    gemm_block(dT, slab, j, op, m, out_engine=nisa.engine.scalar)
                else:
                    acc = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.sbuf, name=f"{self.name}_sum")
                    gemm_block(acc, slab, j, op, m, out_engine=nisa.engine.scalar)
                    epilogue(dT, acc, n0 + j * P)
                yield n0 + j * P, dT
            # drop this slab's decoded planes before the next one is decoded (the raw ring buffers stay): two
            # decoded packed slabs do not fit next to V3's rows (H = 7168)
            del slab


class _EoiGemm:
    """A GEMM on nn.Linear (EOI) weights through ``nki_kernels/expert_gemm.py``'s decode path: weight row blocks
    decoded to bf16 and transposed on the TensorE (correct everywhere; prepare the weights for speed)."""

    korder = "natural"
    path = "eoi"

    def __init__(self, w, w_scale, fmt: str, k: int, n: int):
        self.w, self.w_scale, self.fmt, self.k, self.n = w, w_scale, fmt, k, n
        self.kp = k

    def alloc(self):
        pass

    def blocks(self, e, op, m: int, epilogue=None):
        nnb = self.n // P
        grp = rows_per_dma(self.fmt, self.k, nnb)
        for g0 in range(0, nnb, grp):
            group = load_weight_group(self.w, self.w_scale, e, g0 * P, grp, self.fmt, self.k)
            for j in range(grp):
                dT = nl.ndarray((P, m), dtype=nl.bfloat16, buffer=nl.sbuf, name="eoi_dT")
                if epilogue is None:
                    block_times_rows(dT, group, j, op.aT, self.fmt, self.k, m)
                else:  # the fp32 sum (an exact copy out of PSUM), then the bias and the one rounding
                    acc = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.sbuf, name="eoi_sum")
                    block_times_rows(acc, group, j, op.aT, self.fmt, self.k, m)
                    epilogue(dT, acc, (g0 + j) * P)
                yield (g0 + j) * P, dT


# ----------------------------------------------------------------------------------------------------------------
# Rows in and out
# ----------------------------------------------------------------------------------------------------------------
def _x_rows_source(x, x_scale, tiles, r: int, h: int, korder: str):
    """The HBM rows items gather from. bf16 x, and fp8 x on the MX path (its bytes and scales are gathered as
    they are): x itself. fp8 x otherwise: decoded once to bf16 (exact for pow2 scales; rows routed nowhere
    zeroed through their scales, so 0xFF padding never becomes a value) in a private HBM scratch."""
    if act_format(x) == "bf16" or korder == "mx":
        return x, x_scale
    g = h // x_scale.shape[1]
    xs = nl.ndarray((r, h), dtype=nl.bfloat16, buffer=nl.private_hbm, name="x_bf16_rows")
    for tl in tiles:
        r0, rt = tl.r0, tl.rt
        raw = nl.ndarray((rt, h), dtype=nl.uint8, buffer=nl.sbuf, name="x_bytes")
        nisa.dma_copy(dst=raw, src=x.view(nl.uint8)[r0 : r0 + rt, :])
        s_raw = nl.ndarray((rt, h // g), dtype=nl.float32, buffer=nl.sbuf, name="x_s")
        nisa.dma_copy(dst=s_raw, src=x_scale[r0 : r0 + rt, :])
        nisa.dma_copy(dst=xs[r0 : r0 + rt, :], src=fp8_rows_to_bf16(raw, s_raw, tl.routed))
    return xs, None


def _zero_rows(out, r: int, h: int):
    """acc = 0: what rows no local expert selects return."""
    z = nl.ndarray((min(P, r), h), dtype=nl.float32, buffer=nl.sbuf, name="acc_zero")
    nisa.memset(dst=z, value=0.0)
    for r0 in range(0, r, P):
        rt = min(P, r - r0)
        nisa.dma_copy(dst=out[r0 : r0 + rt, :], src=z[:rt])


def _gather(dst, src, rid, m: int):
    """``dst[p] = src[rid[p]]`` for p < M (an HBM row gather, ``.ap(vector_offset=...)``); pad rows (id R) are
    out of range and skipped, so dst keeps what it held there."""
    c = src.shape[1]
    nisa.dma_copy(
        dst=dst,
        src=src.ap(pattern=[[c, m], [1, c]], offset=0, vector_offset=rid, indirect_dim=0),
        oob_mode=nisa.oob_mode.skip,
    )


class _ItemBuffers:
    """Per-item SBUF tiles, allocated once: a runtime loop body reuses the same addresses every iteration. Tiles
    that a gather fills are zeroed first, so pad rows (skipped by the gather) only ever hold zeros or finite
    values of earlier rows (x or d) — their columns are computed, never stored."""

    def __init__(self, m: int, h: int, inter: int, g1, g2, fmt_x: str, group):
        self.meta = nl.ndarray((m, 2), dtype=nl.float32, buffer=nl.sbuf, name="item_meta")
        self.rid = nl.ndarray((m, 1), dtype=nl.int32, buffer=nl.sbuf, name="item_rows")
        # the gathered x rows and the d rows share one [M, H] tile: x is dead once GEMM1's operand is built, d is
        # born after GEMM2 (saves 2H bytes per partition, which V3's packed-weight slabs need)
        self.d_rows = nl.ndarray((m, h), dtype=nl.bfloat16, buffer=nl.sbuf, name="item_x_d")
        nisa.memset(dst=self.d_rows, value=0.0)
        if g1.korder == "mx":
            self.x_raw = self.d_rows.view(nl.uint8)[:, :h]
            self.x_s = nl.ndarray((m, h // group), dtype=nl.float32, buffer=nl.sbuf, name="item_x_scale")
            nisa.memset(dst=self.x_s, value=0.0)
        else:
            self.xg = self.d_rows
        # the group path's operand is built per item from a quad one (expert_gemm_tiles.group_operand)
        # K of each operand is the plan's kp: act_rows_into_operand zero-pads the rows up to it (I = 768 with
        # packed weights: 1024)
        self.op1 = alloc_act_operand(_fill_korder(g1.korder), g1.kp, m, "item_x_op")
        self.op2 = alloc_act_operand(_fill_korder(g2.korder), g2.kp, m, "item_z_op")
        self.h_rows = nl.ndarray((m, 2 * inter), dtype=nl.bfloat16, buffer=nl.sbuf, name="item_h")
        # the acc rows of the accumulate (zeroed once: pad rows, skipped by the gather, then hold finite values)
        self.acc = nl.ndarray((m, min(ACC_COLS, h)), dtype=nl.float32, buffer=nl.sbuf, name="item_acc")
        nisa.memset(dst=self.acc, value=0.0)
        if g2.korder == "mx":
            self.zq = nl.ndarray((m, inter), dtype=nl.uint8, buffer=nl.sbuf, name="item_z_bytes")
            self.zs = nl.ndarray((m, inter // group), dtype=nl.float32, buffer=nl.sbuf, name="item_z_scale")
        else:
            self.z = nl.ndarray((m, inter), dtype=nl.bfloat16, buffer=nl.sbuf, name="item_z")
        g1.alloc()
        g2.alloc()


def _fill_korder(korder: str) -> str:
    return "quad" if korder == "quad_grp" else korder


def _operand(op, korder: str):
    """The operand a GEMM takes: the filled one, or its group-masked form on the quad_grp path."""
    return group_operand(op) if korder == "quad_grp" else op


def _item(out, x_rows, meta_src, e, bufs, g1, g2, h, inter, m, swiglu_limit, fp8_max, group, var, stage=None):
    """One work item: M rows of expert e (an int, or a (1, 1) SBUF int32 tile loaded at run time). ``stage``:
    None adds d into ``out``; else an HBM [M, H] bf16 view that d is stored to (LNC = 2, core 1)."""
    nisa.dma_copy(dst=bufs.meta, src=meta_src)
    nisa.tensor_copy(dst=bufs.rid, src=bufs.meta[:, 0:1])  # exact: row ids < 2^24
    # ---- x rows → the K-major moving operand of GEMM1
    x_src, x_src_scale = x_rows
    if g1.korder == "mx":
        _gather(bufs.x_raw, x_src.view(nl.uint8), bufs.rid, m)
        _gather(bufs.x_s, x_src_scale, bufs.rid, m)
        act_rows_into_operand(bufs.op1, fp8_rows_to_mx(bufs.x_raw, bufs.x_s), 0)
    else:
        _gather(bufs.xg, x_src, bufs.rid, m)
        act_rows_into_operand(bufs.op1, bufs.xg, 0)
    # ---- GEMM1: h^T blocks → rows h [M, 2I] bf16 (h = bf16(GEMM1))
    for n0, hT in g1.blocks(e, _operand(bufs.op1, g1.korder), m, var.gemm1):
        rows_from_kmajor([bufs.h_rows], hT, n0, m)
    # ---- swiglu-and-cast (rows on partitions: groups along the free dim) → the moving operand of GEMM2
    fp8 = group is not None
    cols = min(inter, SWIGLU_COLS)
    w_e = bufs.meta[:, 1:2]
    hr = bufs.h_rows
    for c0 in range(0, inter, cols):
        c = min(cols, inter - c0)
        res = swiglu_cast_tile(
            hr[:, c0 : c0 + c],
            hr[:, inter + c0 : inter + c0 + c],
            w_e,
            swiglu_limit,
            "fp8" if fp8 else "bf16",
            group if fp8 else 128,
            fp8_max,
            var.activation,
            var.alpha,
        )
        if not fp8:
            nisa.tensor_copy(dst=bufs.z[:, c0 : c0 + c], src=res)
            continue
        q, s = res
        gc = c // group
        if g2.korder == "mx":  # the bytes as they are (e4m3 and e4m3fn codes agree below 256) + pow2 scales
            nisa.tensor_copy(dst=bufs.zq[:, c0 : c0 + c], src=q.view(nl.uint8))
            nisa.tensor_copy(dst=bufs.zs[:, c0 // group : c0 // group + gc], src=s)
        else:  # dequantize exactly: q has ≤ 4 significant bits, s is a power of two
            nisa.tensor_tensor(
                dst=bufs.z[:, c0 : c0 + c].reshape((m, gc, group)),
                data1=q.reshape((m, gc, group)),
                data2=s.reshape((m, gc, 1)).broadcast(2, group),
                op=nl.multiply,
            )
    if g2.korder == "mx":
        act_rows_into_operand(bufs.op2, fp8_rows_to_mx(bufs.zq, bufs.zs), 0)
    else:
        act_rows_into_operand(bufs.op2, bufs.z, 0)
    # ---- GEMM2: d^T blocks → rows d [M, H] bf16 (d = bf16(GEMM2))
    for n0, dT in g2.blocks(e, _operand(bufs.op2, g2.korder), m, var.gemm2):
        rows_from_kmajor([bufs.d_rows], dT, n0, m)
    if stage is not None:
        nisa.dma_copy(dst=stage, src=bufs.d_rows)
        return
    _accumulate(out, bufs, m, h)


def _accumulate(out, bufs, m: int, h: int):
    """``acc[rows] += d`` for the item in ``bufs`` (rid, d_rows), ACC_COLS columns at a time: gather the acc rows
    (indirect DMA), add d on the VectorE in fp32 (``fp32(acc) + float(d)``, the reference's ``index_add_``
    rounding), scatter them back — nki-library's ``experimental/misc/scatter_add.py`` pattern. The rows of an
    item are distinct tokens, so the scatter writes each row once; pad rows (id R) are skipped both ways."""
    for c0 in range(0, h, ACC_COLS):
        c = min(ACC_COLS, h - c0)
        acc_rows = out.ap(pattern=[[h, m], [1, c]], offset=c0, vector_offset=bufs.rid, indirect_dim=0)
        nisa.dma_copy(dst=bufs.acc[:, :c], src=acc_rows, oob_mode=nisa.oob_mode.skip)
        nisa.tensor_tensor(dst=bufs.acc[:, :c], data1=bufs.acc[:, :c], data2=bufs.d_rows[:, c0 : c0 + c], op=nl.add)
        nisa.dma_copy(dst=acc_rows, src=bufs.acc[:, :c], oob_mode=nisa.oob_mode.skip)


class _BiasEpilogues:
    """The SPEC §1.9 variants of an item: the activation (handed to ``swiglu_cast_tile``) and the bias epilogues
    of the two GEMMs, each adding in fp32 to the GEMM's fp32 sum before the one bf16 rounding (features on
    partitions, the item's M rows along the free dim):

    - GEMM1: ``hT[n, m] = bf16(sum[n, m] + b13[e, n])`` — ScalarE ``activation(copy, bias=<(P, 1) column>)``;
    - GEMM2: ``dT[n, m] = bf16(sum[n, m] + w[m] · b2[e, n])`` — ScalarE ``activation(copy, data=w_bcast,
      scale=<(P, 1) b2 column>)`` then a GpSimd ``tensor_tensor`` add: one fp32 product and one fp32 add per
      element, as the reference's ``bias_row_scale · bias`` then ``+``. (VectorE binds the item: its swiglu and
      evacuations; ScalarE and GpSimd have room.)

    Per item, the expert's biases come in by one contiguous DMA each, as rows ``[N/128, 128]`` (a runtime e
    through ``.ap(scalar_offset=<SBUF (1, 1)>)``, as the weights are addressed), and one TensorE transpose turns
    them into the ``[128, N/128]`` columns the epilogues read (element ``[p, c]`` = bias[e, 128c + p]; fp32
    transposes are bit-exact, as for the trn2 weight scales in ``expert_gemm_tiles``). The item's M routing
    weights come from the HBM item table as one ``[1, M]`` row and are broadcast to every partition by a K = 1
    matmul with a ones row (``1 · w`` in fp32 PSUM: exact), so a NaN weight stays in its own column. Pad rows
    have weight 0 and are never stored. (Per-element DMAs — a column pattern, or a stride-0 partition step —
    cost one descriptor per element: +12 % on a DMA-bound bf16 item in the cost model, against +1 % this way.)

    Documented constructs: ``activation`` with (P, 1) tile ``scale`` / ``bias`` (ISA ``nki.isa.activation``:
    "the element of scale/bias within each partition is broadcasted"), ``tensor_tensor`` with ``engine=``,
    ``nc_transpose`` and ``nc_matmul`` with fp32 operands (ISA pages), ``dma_copy`` from an HBM ``.ap(pattern,
    offset, scalar_offset)`` view (``deep-dives/nki-aps.rst``; nki-library's ``selective_expert_impl.py``
    addresses per-expert tensors by an SBUF index so)."""

    def __init__(self, activation, alpha, w13_bias, w2_bias, table, m: int, h: int, inter: int):
        self.activation, self.alpha = activation, float(alpha)
        self.table, self.m = table, m
        self.biases = []  # (HBM [L, N], SBUF rows [N/128, 128], SBUF columns [128, N/128])
        self.b13 = self.b2 = self.w_bc = None
        for hbm, n, name in ((w13_bias, 2 * inter, "b13"), (w2_bias, h, "b2")):
            if hbm is None:
                continue
            assert tuple(hbm.shape)[1:] == (n,), f"{name} must be [L, {n}]"
            assert n // P <= P, f"{name}: N = {n} is over {P * P}"
            rows = nl.ndarray((n // P, P), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_rows")
            cols = nl.ndarray((P, n // P), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_cols")
            self.biases.append((hbm, rows, cols))
            setattr(self, name, cols)
        if w2_bias is not None:
            self.w_row = nl.ndarray((1, m), dtype=nl.float32, buffer=nl.sbuf, name="item_w_row")
            self.ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf, name="bias_ones_row")
            nisa.memset(dst=self.ones, value=1.0)
            self.w_bc = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.sbuf, name="item_w_bcast")
        self.gemm1 = self._gemm1 if w13_bias is not None else None
        self.gemm2 = self._gemm2 if w2_bias is not None else None

    def load(self, e, item):
        """Expert e's bias columns and item ``item``'s routing weights (ints, or (1, 1) SBUF int32 tiles)."""
        for hbm, rows, cols in self.biases:
            n = hbm.shape[1]
            pat = [[P, n // P], [1, P]]
            if isinstance(e, int):
                src = hbm.ap(pattern=pat, offset=e * n)
            else:
                src = hbm.ap(pattern=pat, offset=0, scalar_offset=e, indirect_dim=0)
            nisa.dma_copy(dst=rows, src=src)
            ps = nl.ndarray((P, n // P), dtype=nl.float32, buffer=nl.psum, name="bias_cols_psum")
            nisa.nc_transpose(dst=ps, data=rows)
            nisa.tensor_copy(dst=cols, src=ps)
        if self.w_bc is not None:
            m = self.m
            pat = [[1, 1], [2, m]]
            if isinstance(item, int):
                src = self.table.ap(pattern=pat, offset=item * 2 * m + 1)
            else:
                src = self.table.ap(pattern=pat, offset=1, scalar_offset=item, indirect_dim=0)
            nisa.dma_copy(dst=self.w_row, src=src)
            ps = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.psum, name="item_w_bcast_psum")
            nisa.nc_matmul(dst=ps, stationary=self.ones, moving=self.w_row, accumulate=False)
            nisa.tensor_copy(dst=self.w_bc, src=ps)

    def _gemm1(self, dT, acc, n0: int):
        # ScalarE's affine stage: copy(sum · 1 + b13) in fp32, one rounding to bf16 (VectorE binds the item)
        c = n0 // P
        nisa.activation(dst=dT, op=nl.copy, data=acc, bias=self.b13[:, c : c + 1])

    def _gemm2(self, dT, acc, n0: int):
        # w · b2 on ScalarE (the (P, 1) column as the scale: one fp32 product), + sum on GpSimd, one rounding
        c = n0 // P
        wb = nl.ndarray(tuple(self.w_bc.shape), dtype=nl.float32, buffer=nl.sbuf, name="item_w_b2")
        nisa.activation(dst=wb, op=nl.copy, data=self.w_bc, scale=self.b2[:, c : c + 1])
        nisa.tensor_tensor(dst=dT, data1=acc, data2=wb, op=nl.add, engine=nisa.engine.gpsimd)
