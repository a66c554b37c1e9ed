"""vLLM-CPU's fused MoE as a peer: the routed experts of one layer through vLLM's own CPU kernel
(``vllm._custom_ops.cpu_fused_moe`` on weights prepacked by ``cpu_prepack_moe_weight``, the path vLLM's
``CPUUnquantizedExperts`` runs: "vec" on every x86 CPU, "amx" where the CPU has AMX tiles) and through
``StaticMoE`` (``torch.ops.static_moe.forward``), bf16 weights and activations, same inputs, same thread count,
timed interleaved in one run. Prints vLLM's time / static_moe's (> 1: static_moe is faster) and calc_diff.

Needs the vLLM venv (``make venv-vllm``):

    OMP_NUM_THREADS=2 .venv-vllm/bin/python bench/bench_vllm_peer.py --rows 1 4 16 64

Shapes (static_moe.testing.generators.MODEL_SHAPES): DeepSeek-V3 (H 7168, I 2048, top-8), DeepSeek-V4-Flash
(H 4096, I 2048, top-6) and Qwen3-30B-A3B (H 2048, I 768, top-8), each with ``--experts`` local experts (a
slice of the model's, to fit the host's memory; routing is uniform over them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from static_moe import StaticMoE
from static_moe.testing.generators import MODEL_SHAPES


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum()).clamp_min(1e-30))


def _median_s(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_shape(name: str, experts: int, rows: list[int], iters: int, isas: list[str]) -> list[dict]:
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    shape = MODEL_SHAPES[name]
    h, i, k = shape.hidden, shape.intermediate, min(shape.topk, experts)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * i, h, generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(experts, h, i, generator=g) * i**-0.5).bfloat16()
    moe = StaticMoE(h, i, experts, k, max(rows), weight_format="bf16")
    moe.set_expert_weights(w13, None, w2, None)
    packed = {isa: (cpu_prepack_moe_weight(w13, isa), cpu_prepack_moe_weight(w2, isa)) for isa in isas}
    out = []
    for t in rows:
        x = torch.randn(t, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        wts = torch.rand(t, k, generator=g).float()
        wts = wts / wts.sum(-1, keepdim=True)
        ours = lambda: moe(x, ids, wts)
        res = {"shape": name, "rows": t, "experts": experts, "top_k": k}
        want = ours()
        for isa, (p13, p2) in packed.items():
            y = torch.empty(t, h, dtype=torch.bfloat16)
            theirs = lambda: cpu_fused_moe(y, x, p13, p2, None, None, wts, ids, "silu", isa, False)
            theirs()
            res[f"diff_{isa}"] = calc_diff(y.float(), want.float())
            # Interleaved: each round times vLLM then static_moe, so drift in the host hits both.
            tv, to = [], []
            for _ in range(3):
                tv.append(_median_s(theirs, iters))
                to.append(_median_s(ours, iters))
            res[f"vllm_{isa}_us"] = min(tv) * 1e6
            res[f"static_moe_{isa}_us"] = min(to) * 1e6  # static_moe's time in the rounds interleaved with this isa
            res[f"ratio_{isa}"] = res[f"vllm_{isa}_us"] / res[f"static_moe_{isa}_us"]
        out.append(res)
    moe.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3_30b_a3b", "v4_flash", "v3"], choices=sorted(MODEL_SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--experts", type=int, default=8, help="local experts per layer (a slice of the model's)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    isas = ["vec"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])
    print(f"threads {torch.get_num_threads()}, vLLM isas {isas}")
    for name in args.shapes:
        for r in bench_shape(name, args.experts, args.rows, args.iters, isas):
            cols = "  ".join(
                f"{isa}: vLLM {r[f'vllm_{isa}_us']:8.0f} us / static_moe {r[f'static_moe_{isa}_us']:8.0f} us "
                f"= {r[f'ratio_{isa}']:.2f}  diff {r[f'diff_{isa}']:.1e}"
                for isa in isas
            )
            print(f"{r['shape']:>14} rows {r['rows']:3d}  {cols}")


if __name__ == "__main__":
    main()
