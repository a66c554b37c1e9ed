"""Bytes and FLOPs a call must move and do, and the roofline they give (docs/benchmarks.md).

A call must move ``bytes`` (the weights of the experts it touches, scales included; activations in; results out)
and do ``flops`` (2·rows·N·K per GEMM, rows actually routed). The weights (``read_bytes``, part of ``bytes``) are
only read, so their roof is the machine's read-only stream; the rest moves at the triad's rate:
``t_mem = read_bytes / read_bandwidth + (bytes − read_bytes) / triad_bandwidth``. The compute roof is the bf16
matmul peak where the kernel multiplies in bf16 (vdpbf16ps: ``static_moe.testing.machine.bf16_dot_products``),
the fp32 one otherwise: ``roofline_s = max(t_mem, flops / peak)``, ``roofline_fraction = roofline_s /
measured_s``. Elementwise ops (pack, unpack, swiglu_and_cast) are counted by bytes only: their FLOPs are not
matmul FLOPs and the matmul peak is not their limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from static_moe.testing.machine import MachineLimits

from .routing import RoutingStats


@dataclass
class Cost:
    """Bytes a call must move, of which ``read_bytes`` are only read (weights), and FLOPs it must do (matmul only)."""

    bytes: float
    flops: float = 0.0
    read_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops, self.read_bytes + other.read_bytes)


def weight_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of one expert's [N, K] weight in ``fmt``, scales included (SPEC §1.2)."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "fp8":
        return n * k + 4 * n * (k // 128)  # e4m3fn + float32 1×128 scales
    if fmt == "fp4":
        return n * k // 2 + n * (k // 32)  # e2m1 two per byte + UE8M0 1×32 scales
    raise ValueError(f"unknown weight format {fmt!r}")


def act_bytes(fmt: str, rows: int, k: int, group: int = 128) -> int:
    """Bytes of ``rows`` activation rows of width K: bf16, or fp8 with float32 1×group scales (SPEC §1.1)."""
    if fmt == "bf16":
        return 2 * rows * k
    if fmt == "fp8":
        return rows * k + 4 * rows * (k // group)
    raise ValueError(f"unknown activation format {fmt!r}")


def cost_expert_gemm(
    act_fmt: str, w_fmt: str, rows_total: int, rows_active: int, n: int, k: int, group: int = 128
) -> Cost:
    """One expert's weight, the active rows of A, the mask, and the whole bf16 [R, N] output (zeros too)."""
    w = weight_bytes(w_fmt, n, k)
    moved = w + act_bytes(act_fmt, rows_active, k, group) + rows_total + 2 * rows_total * n
    return Cost(moved, 2.0 * rows_active * n * k, w)


def cost_local_experts(
    act_fmt: str,
    w_fmt: str,
    rows_total: int,
    rows_active: int,
    topk: int,
    hidden: int,
    inter: int,
    experts_touched: int,
    pairs: int,
    group: int = 128,
) -> Cost:
    """Weights (w13 and w2, scales included) of the touched experts; the routed rows of x; the routing of every
    row; the fp32 [R, H] result. FLOPs: each (row, expert) pair does GEMM1 (2I×H) and GEMM2 (H×I)."""
    w = experts_touched * (weight_bytes(w_fmt, 2 * inter, hidden) + weight_bytes(w_fmt, hidden, inter))
    moved = w + act_bytes(act_fmt, rows_active, hidden, group) + rows_total * topk * 8 + 4 * rows_total * hidden
    return Cost(moved, 2.0 * pairs * (2 * inter * hidden + hidden * inter), w)


def cost_swiglu_and_cast(rows: int, inter: int, in_bytes: int, out_fmt: str, group: int) -> Cost:
    """gate_up [R, 2I] in, row weights in, the [R, I] result (and its scales) out. Bytes only."""
    out = act_bytes(out_fmt, rows, inter, group) if out_fmt == "fp8" else 2 * rows * inter
    return Cost(rows * 2 * inter * in_bytes + 4 * rows + out)


def cost_pack_rows(row_bytes: int, tokens: int, capacity: int, width: int) -> Cost:
    """The parts' bytes in, the whole [C, W] buffer out (padding included). Bytes only."""
    return Cost(tokens * row_bytes + capacity * width)


def cost_unpack_rows(rows: int, nbytes: int) -> Cost:
    """One span of every row in, the same bytes out. Bytes only."""
    return Cost(2 * rows * nbytes)


def cost_forward(
    act_fmt: str,
    w_fmt: str,
    tokens: int,
    capacity: int,
    ep_size: int,
    row_bytes: int,
    width: int,
    hidden: int,
    inter: int,
    topk: int,
    rank_stats: list[RoutingStats],
    group: int = 128,
    shared: bool = True,
) -> Cost:
    """The whole step summed over the S ranks sharing this machine (SPEC §0): per rank, pack (parts in, [C, W]
    out), the gathered [S·C, W] written, local experts over the S·C gathered rows (its touched experts'
    weights, routed rows, routing, fp32 acc out), the reduce-scatter's [S·C, H] fp32 in and [C, H] out, and the
    combine (scattered rows and shared output in, bf16 [T, H] out). Collective traffic between processes is not
    counted: it is timed on its own."""
    total = Cost(0.0)
    rows = ep_size * capacity
    for st in rank_stats:
        total += cost_pack_rows(row_bytes, tokens, capacity, width)
        total += Cost(rows * width)
        total += cost_local_experts(
            act_fmt, w_fmt, rows, st.rows_active, topk, hidden, inter, st.experts_touched, st.pairs, group
        )
        total += Cost(4 * rows * hidden + 4 * capacity * hidden)
        total += Cost(4 * tokens * hidden + (2 * tokens * hidden if shared else 0) + 2 * tokens * hidden)
    return total


def roofline(cost: Cost, limits: MachineLimits, measured_s: float | None, bf16_dot: bool = False) -> dict:
    """Both roofline terms, the bound that applies, and the fraction of the roofline ``measured_s`` reaches.

    bf16_dot: the kernel multiplies in bf16 (its compute roof is the bf16 matmul peak, else the fp32 one).
    ``roofline_fraction_bf16_peak`` is the fraction against the bf16 peak whatever the kernel uses."""
    t_mem = cost.read_bytes / limits.weight_bandwidth() + (cost.bytes - cost.read_bytes) / limits.bandwidth
    peak16 = max(limits.bf16_flops, limits.flops)
    t_flop = cost.flops / (peak16 if bf16_dot else limits.flops)
    t_roof = max(t_mem, t_flop)
    t_roof16 = max(t_mem, cost.flops / peak16)
    return {
        "bytes": cost.bytes,
        "read_bytes": cost.read_bytes,
        "flops": cost.flops,
        "compute_peak": "bf16" if bf16_dot else "fp32",
        "t_mem_s": t_mem,
        "t_compute_s": t_flop,
        "roofline_s": t_roof,
        "bound": "compute" if t_flop > t_mem else "memory",
        "roofline_fraction": (t_roof / measured_s) if measured_s else None,
        "roofline_fraction_bf16_peak": (t_roof16 / measured_s) if measured_s else None,
    }
