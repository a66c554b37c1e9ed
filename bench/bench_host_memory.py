"""StaticMoE's CPU weights in huge pages (static_moe.host_memory) against the same layer in torch's memory.

Two layers with the same weights, one holding them in mappings advised for huge pages (the default), one in
torch's allocator (4 KiB pages unless the process sets THP_MEM_ALLOC_ENABLE=1), called alternately in one process
on the same inputs, each round timing each layer's median of ``--iters`` calls and each keeping its best round.
Prints the CPU times, the weight bytes streamed per CPU-second and time plain / advised (> 1: huge pages are
faster), and checks that both give the same bits. Shapes and routing as bench_vllm_peer (8 local experts, routing
uniform over them, so every call streams every expert it selects from DRAM).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_host_memory.py --rows 1 4 --formats bf16 fp8
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_vllm_peer import _median_cpu_s, _nbytes, layer_inputs, model_shapes, vllm_weights

from static_moe import StaticMoE, host_memory
from static_moe.formats import expand_block_scales
from static_moe.testing.generators import MODEL_SHAPES


def _weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    """StaticMoE's (w13, w13_scale, w2, w2_scale) in ``fmt`` for float w13 [E, 2I, H], w2 [E, H, I] (fp8: the
    peer bench's 128×128 block scales repeated to 1×128, as the vLLM plugin does), and one expert's bytes."""
    q13, s13, q2, s2 = vllm_weights(fmt, w13, w2)
    if fmt == "fp8":
        s13, s2 = expand_block_scales(s13, w13.shape[1]), expand_block_scales(s2, w2.shape[1])
    return (q13, s13, q2, s2), _nbytes(q13, s13, q2, s2)


def _layer(fmt, h, i, experts, k, cap, weights, advised: bool) -> StaticMoE:
    old = host_memory.MIN_ADVISED_BYTES
    if not advised:
        host_memory.MIN_ADVISED_BYTES = 1 << 62  # every tensor from torch's allocator
    try:
        moe = StaticMoE(h, i, experts, k, cap, weight_format=fmt)
    finally:
        host_memory.MIN_ADVISED_BYTES = old
    moe.set_expert_weights(*weights)
    return moe


def bench(name, dims, experts, rows, formats, iters, rounds) -> list[dict]:
    h, i, topk = dims
    k = min(topk, experts)
    w13, w2, _, inputs = layer_inputs(dims, experts, rows)
    out = []
    for fmt in formats:
        weights, per_expert = _weights(fmt, w13, w2)
        layers = {a: _layer(fmt, h, i, experts, k, max(rows), weights, a) for a in (True, False)}
        for t, (x, ids, wts) in inputs.items():
            same = torch.equal(layers[True](x, ids, wts), layers[False](x, ids, wts))
            best = {a: float("inf") for a in layers}
            for _ in range(rounds):
                for a, moe in layers.items():
                    best[a] = min(best[a], _median_cpu_s(lambda moe=moe: moe(x, ids, wts), iters)[1])
            streamed = per_expert * int(torch.unique(ids).numel())
            out.append(
                {"shape": name, "format": fmt, "rows": t, "advised_us": best[True] * 1e6,
                 "plain_us": best[False] * 1e6, "ratio": best[False] / best[True], "same_bits": same,
                 "gbps_advised": streamed / best[True] / 1e9, "gbps_plain": streamed / best[False] / 1e9,
                 "advised": host_memory.is_advised(layers[True].w13)}
            )  # fmt: skip
        for moe in layers.values():
            moe.close()
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3_30b_a3b", "v4_flash", "v3"], choices=sorted(MODEL_SHAPES))
    p.add_argument("--dims", nargs=3, type=int, metavar=("H", "I", "TOPK"), help="one custom shape instead")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, CPU time per call")
    results = []
    shapes = model_shapes(args)
    for name, dims in shapes.items():
        for r in bench(name, dims, args.experts, args.rows, args.formats, args.iters, args.rounds):
            results.append(r)
            print(
                f"{r['shape']:>14} {r['format']:>4} rows {r['rows']:3d}  huge pages {r['advised_us']:8.0f} us "
                f"{r['gbps_advised']:5.1f} GB/cpu-s  4 KiB pages {r['plain_us']:8.0f} us {r['gbps_plain']:5.1f} "
                f"GB/cpu-s  plain / huge {r['ratio']:5.2f}  same bits {r['same_bits']}"
                + ("" if r["advised"] else "  (no huge-page advice here: both in torch's memory)")
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
    return results


if __name__ == "__main__":
    main()
