"""The CPU ops under two instruction sets (STATIC_MOE_CPU_ISA, csrc/cpu/simd.h), timed cold in the same rounds.

STATIC_MOE_CPU_ISA is read on every call, so one process can alternate two kernels on the same weights and rows
(harness.timing.time_interleaved): their ratio is the change, whatever the shared host does meanwhile. With each
point it times torch_int4pack (fp4 weights) and torch's bf16 matmul of the same shape in the same rounds, the
baselines of run_all's same-round targets. Points: expert_gemm w13 and local_experts of bench_expert_gemm /
bench_local_experts (the same weights, activations and routing).

    .venv/bin/python bench/bench_isa_ab.py                                   # avx512bf16 vs amx, V4-Flash
    .venv/bin/python bench/bench_isa_ab.py --isas avx512 avx512bf16 --shape v3 --tokens 1 16
"""

from __future__ import annotations

import argparse
import os

import baselines as B
import bench_expert_gemm as EG
import torch
from harness.timing import time_interleaved
from harness.workload import bench_weights, local_experts_for

from static_moe.testing.generators import MODEL_SHAPES, make_activations, sliced_routing


def _with_isa(isa: str, fn):
    def call():
        os.environ["STATIC_MOE_CPU_ISA"] = isa
        return fn()

    return call


def _report(what: str, timings: dict, isas: list[str], flops: float) -> None:
    med = {k: t.median_s for k, t in timings.items()}
    parts = [f"{k} {med[k] * 1e3:.3f} ms" for k in timings]
    parts.append(f"{isas[0]}/{isas[1]} {med[isas[0]] / med[isas[1]]:.2f}")
    if "torch_int4pack" in med:
        parts += [f"×int4 {isa} {med['torch_int4pack'] / med[isa]:.2f}" for isa in isas]
    if "bf16_matmul" in med:
        parts += [f"{isa} {flops / med[isa] / (flops / med['bf16_matmul']):.0%} of bf16 matmul" for isa in isas]
    print(f"  {what}: " + ", ".join(parts), flush=True)


def expert_gemm_points(shape_key: str, w_fmts: list[str], tokens: list[int], isas: list[str], rounds: int) -> None:
    shape = MODEL_SHAPES[shape_key]
    n, k = EG.GEMMS["w13"](shape)
    print(f"[expert_gemm] {shape.name} w13: N={n} K={k}", flush=True)
    for w_fmt in w_fmts:
        b, b_s = EG.expert_weight(n, k, w_fmt, seed=1)
        int4 = (
            B.TorchInt4Pack(b, b_s, None, None) if w_fmt == "fp4" and B.int4pack_unavailable_reason() is None else None
        )
        for t in tokens:
            a, a_s = make_activations(t, k, "bf16", EG.GROUP, seed=t)
            mask = torch.ones(t, dtype=torch.bool)
            fns = {
                isa: _with_isa(isa, lambda: torch.ops.static_moe.expert_gemm(a, a_s, b, b_s, mask, 0, "eoi"))
                for isa in isas
            }
            if int4 is not None:
                fns["torch_int4pack"] = lambda: int4.expert_gemm(a, a_s, mask, 0)
            wd = torch.randn(n, k).to(torch.bfloat16)
            fns["bf16_matmul"] = lambda: a @ wd.T
            timings, _ = time_interleaved(fns, repeat=rounds)
            os.environ.pop("STATIC_MOE_CPU_ISA", None)
            _report(f"expert_gemm {shape_key} bf16×{w_fmt} T={t}", timings, isas, 2.0 * t * n * k)


def local_experts_points(shape_key: str, w_fmts: list[str], tokens: list[int], isas: list[str], rounds: int) -> None:
    shape = MODEL_SHAPES[shape_key]
    num_local = local_experts_for(shape_key, False)
    print(f"[local_experts] {shape.name}: {num_local} local experts", flush=True)
    for w_fmt in w_fmts:
        w = bench_weights(num_local, shape.hidden, shape.intermediate, w_fmt, seed=1)
        args_w = (w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
        for t in tokens:
            routing = sliced_routing(shape, [t], num_local, seed=t)
            idx, tw = routing.topk_idx[0], routing.topk_weights[0]
            x, xs = make_activations(t, shape.hidden, "bf16", EG.GROUP, seed=t)
            op_args = (x, xs, idx, tw, *args_w, 0, None, 448.0)
            fns = {isa: _with_isa(isa, lambda: torch.ops.static_moe.local_experts(*op_args)) for isa in isas}
            timings, _ = time_interleaved(fns, repeat=rounds)
            os.environ.pop("STATIC_MOE_CPU_ISA", None)
            _report(f"local_experts {shape_key} bf16×{w_fmt} T={t}", timings, isas, 0.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--isas", nargs=2, default=["avx512bf16", "amx"], help="the two STATIC_MOE_CPU_ISA values")
    p.add_argument("--shape", default="v4_flash", choices=sorted(MODEL_SHAPES))
    p.add_argument("--weights", nargs="+", default=["fp4", "fp8", "bf16"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", choices=["expert_gemm", "local_experts"])
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.only != "local_experts":
        expert_gemm_points(args.shape, args.weights, args.tokens, args.isas, args.rounds)
    if args.only != "expert_gemm":
        local_experts_points(args.shape, args.weights, args.tokens, args.isas, args.rounds)


if __name__ == "__main__":
    main()
