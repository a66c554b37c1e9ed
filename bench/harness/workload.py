"""Scaled-down workloads of the benchmarks: the real H, I, k and rows per expert, fewer local experts, and the
weights generated for them.
"""

from __future__ import annotations

from static_moe.testing.generators import make_weights

# Local experts kept per shape, so that the full `make bench` fits in memory and in 10 minutes on 2 threads
# (the seed baseline dequantizes every local expert on every call). H and I are never scaled. See
# ``static_moe.testing.generators.sliced_routing`` for how the kept experts are chosen so that rows per expert
# stay those of the real model.
LOCAL_EXPERTS = {"v4_flash": 4, "v3": 2, "qwen3_30b_a3b": 8}
QUICK_LOCAL_EXPERTS = 2


def local_experts_for(shape_key: str, quick: bool) -> int:
    """Local experts kept per rank for a shape (``LOCAL_EXPERTS``; 2 with --quick)."""
    return QUICK_LOCAL_EXPERTS if quick else LOCAL_EXPERTS[shape_key]


def bench_weights(num_local: int, hidden: int, inter: int, fmt: str, seed: int = 0, distinct: int = 2) -> dict:
    """``generators.make_weights`` for ``num_local`` experts, built from ``distinct`` drawn experts tiled along
    the expert dim (separate memory, repeated values) — drawing and quantizing hundreds of millions of weights
    would take most of the time budget. Timings are unaffected: every expert's bytes are still read from DRAM
    (cold calls), and kernels do not look at values."""
    w = make_weights(min(distinct, num_local), hidden, inter, fmt, seed=seed)
    reps = -(-num_local // w["w13"].shape[0])
    tile = lambda t: None if t is None else t.repeat(reps, *([1] * (t.dim() - 1)))[:num_local].contiguous()  # noqa: E731
    return {k: tile(v) for k, v in w.items()}
