"""Benchmark of torch.ops.static_moe.expert_gemm (SPEC §1.6) per activation × weight format pair, against
seed_dense, torch_cached, (fp8 weights) torch_scaled_mm and (fp4 weights) torch_int4pack on the same inputs (docs/benchmarks.md).

One expert's GEMM over T gathered rows, all routed to it (rows per expert = T): the gate/up GEMM
(N = 2I, K = H) and, with --gemm both, the down GEMM (N = H, K = I). Every call is cold (caches flushed), so the
expert's weight streams from DRAM as in a decode step. fp8 weights have power-of-two 1×128 scales, as
quantize_weight gives (the CPU kernel's pow2 path); --fp8-scales float times the fold path that float scales take.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_expert_gemm.py --shape v4_flash --pairs fp8xfp4 --tokens 1 16
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_expert_gemm.py --quick
"""

from __future__ import annotations

import argparse
import os

import baselines as B
import torch
from harness.checks import check_baseline, check_op, check_point
from harness.cli import add_common_args, finish, parse_pairs, resolve_args, start
from harness.costs import cost_expert_gemm, roofline
from harness.report import Report, progress
from harness.timing import (
    bf16_matmul,
    measure_with,
    stream_fraction,
    time_baseline,
    time_fastest_variant,
    time_fn,
    timing_dict,
    weight_stream,
)

from static_moe import reference
from static_moe.testing.generators import FORMAT_PAIRS, MODEL_SHAPES, gen, make_activations, random_weight
from static_moe.testing.machine import bf16_dot_products
from static_moe.testing.numeric import assert_gemm_close, calc_diff

BENCH = "expert_gemm"
GROUP = 128  # fp8 activation group
GEMMS = {"w13": lambda s: (2 * s.intermediate, s.hidden), "w2": lambda s: (s.hidden, s.intermediate)}
PEAK_MIN_TOKENS = 16  # from here a point is compute-bound and is timed with the bf16 matmul (run_all's target)


def expert_weight(
    n: int, k: int, fmt: str, seed: int, fp8_scales: str = "pow2"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One expert's weight [1, N, K] in ``fmt`` (+ scales), drawn N(0, 1/K). fp8: scales of the kind ``fp8_scales``
    (fp8_scales_of_kind: "pow2", as quantize_weight gives, or "float", as DeepSeek-V3's scale_inv)."""
    return random_weight(1, n, k, fmt, gen(seed), fp8_scales)


def run(
    report: Report,
    shapes: list[str],
    tokens: list[int],
    quick: bool,
    pairs: list[tuple[str, str]] | None = None,
    gemms: tuple[str, ...] = ("w13",),
    fp8_scales: str = "pow2",
    isa: str | None = None,
) -> list[dict]:
    """Append one record per (shape, gemm, pair, tokens) to ``report``. isa: the op forced to that CPU instruction
    set (STATIC_MOE_CPU_ISA, read by every call; the baselines are torch's), a series of its own."""
    pairs = pairs or list(FORMAT_PAIRS)
    if not tokens or not shapes:  # e.g. a --quick run has no compute-bound point for the extra series
        return []
    saved = os.environ.get("STATIC_MOE_CPU_ISA")
    if isa is not None:
        os.environ["STATIC_MOE_CPU_ISA"] = isa
    try:
        return _run(report, shapes, tokens, pairs, gemms, fp8_scales, isa)
    finally:
        if saved is None:
            os.environ.pop("STATIC_MOE_CPU_ISA", None)
        else:
            os.environ["STATIC_MOE_CPU_ISA"] = saved


def _run(report, shapes, tokens, pairs, gemms, fp8_scales, isa) -> list[dict]:
    records = []
    smm_reason = B.scaled_mm_unavailable_reason()
    int4_reason = B.int4pack_unavailable_reason()
    t_check = check_point(tokens)
    for shape_key in shapes:
        shape = MODEL_SHAPES[shape_key]
        for gemm in gemms:
            n, k = GEMMS[gemm](shape)
            print(f"[{BENCH}] {shape.name} {gemm}: N={n} K={k}", flush=True)
            for w_fmt in dict.fromkeys(w for _, w in pairs):
                b, b_s = expert_weight(n, k, w_fmt, seed=2, fp8_scales=fp8_scales)
                cached = {dt: B.TorchCached(b, b_s, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
                smm = B.TorchScaledMM(b, b_s) if (w_fmt == "fp8" and smm_reason is None) else None
                int4 = B.TorchInt4Pack(b, b_s) if (w_fmt == "fp4" and int4_reason is None) else None
                for act_fmt in [a for a, wf in pairs if wf == w_fmt]:
                    for t in tokens:
                        a, a_s = make_activations(t, k, act_fmt, GROUP, seed=t)
                        mask = torch.ones(t, dtype=torch.bool)
                        rec = _measure_point(
                            shape_key,
                            gemm,
                            act_fmt,
                            w_fmt,
                            t,
                            a,
                            a_s,
                            b,
                            b_s,
                            mask,
                            cached,
                            smm,
                            smm_reason,
                            int4,
                            int4_reason,
                            check=(t == t_check),
                        )
                        cost = cost_expert_gemm(act_fmt, w_fmt, t, t, n, k, GROUP)
                        rec.update(roofline(cost, report.limits, rec["op"].get("median_s"), bf16_dot_products(act_fmt)))
                        mm = rec.get("bf16_matmul")
                        if mm and rec["op"].get("median_s"):  # the op's FLOP/s over the matmul's, same rounds
                            rec["bf16_matmul_fraction"] = (cost.flops / rec["op"]["median_s"]) / (
                                mm["flops"] / mm["median_s"]
                            )
                        rec.update(rows=t, rows_active=t, rows_per_expert=float(t), experts="1/1", n=n, k=k)
                        if w_fmt == "fp8":
                            rec["fp8_scales"] = fp8_scales
                            if fp8_scales != "pow2":
                                rec["fmt"] += f", {fp8_scales} scales"  # a series of its own in tables and plots
                        if isa is not None:
                            rec["isa"] = isa
                            rec["fmt"] += f", {isa}"
                        records.append(report.add(rec))
                        progress(rec)
                del cached, smm, int4, b, b_s
    return records


def _measure_point(
    shape_key, gemm, act_fmt, w_fmt, t, a, a_s, b, b_s, mask, cached, smm, smm_reason, int4, int4_reason, check
):
    op_args = (a, a_s, b, b_s, mask, 0)
    # The op, a read-only stream over its weight bytes and (fp4) torch_int4pack in the same rounds: the T = 1
    # bandwidth target and the int4pack target are ratios between them (harness.timing.time_interleaved).
    companions = {"weight_stream": weight_stream([b, b_s])}
    if w_fmt == "fp4" and int4 is not None:
        companions["torch_int4pack"] = lambda: int4.expert_gemm(a, a_s, mask, 0)
    # Compute-bound points (the 16+ row target): torch's bf16 matmul, the peak the target names, in the same rounds.
    peak_flops = 0.0
    if t >= PEAK_MIN_TOKENS and w_fmt in ("fp4", "fp8") and bf16_dot_products(act_fmt):
        companions["bf16_matmul"], peak_flops = bf16_matmul()
    op, out, paired, paired_outs = measure_with(lambda: torch.ops.static_moe.expert_gemm(*op_args), companions)
    stream = paired.pop("weight_stream")
    peak = paired.pop("bf16_matmul", None)
    base, outs = {}, {}
    timing, outs["seed_dense"] = time_fn(lambda: B.seed_dense_expert_gemm(*op_args), cold=True)
    base["seed_dense"] = timing_dict(timing)
    base["torch_cached"], outs["torch_cached"] = time_fastest_variant(
        cached, lambda c: c.expert_gemm(a, a_s, mask, 0), cold=True
    )
    if w_fmt == "fp8":
        time_baseline(
            base, outs, "torch_scaled_mm", smm, smm_reason, lambda m: m.expert_gemm(a, a_s, mask, 0), cold=True
        )
    if w_fmt == "fp4":
        if int4 is None:
            base["torch_int4pack"] = {"available": False, "reason": int4_reason}
        else:
            base["torch_int4pack"], outs["torch_int4pack"] = paired["torch_int4pack"], paired_outs["torch_int4pack"]
    what = f"{BENCH} {shape_key} {gemm} {act_fmt}x{w_fmt} T={t}"
    if check:
        ref = reference.expert_gemm(*op_args)
        for name, o in outs.items():
            base[name]["calc_diff_vs_reference"] = check_baseline(name, o, ref, B.CHECK_TOLERANCE[name], what)
        op["parity"] = check_op(out, ref, lambda o, r: assert_gemm_close(o, r, what))
    if out is not None:
        for name, o in outs.items():
            base[name]["calc_diff_vs_op"] = calc_diff(o, out)
    return {
        "bench": BENCH,
        "shape": shape_key,
        "gemm": gemm,
        "fmt": f"{act_fmt}×{w_fmt} {gemm}",
        "act": act_fmt,
        "weight": w_fmt,
        "tokens": t,
        "op": op,
        "baselines": base,
        "weight_stream": stream,
        "weight_stream_fraction": stream_fraction(stream, op),
        **({"bf16_matmul": {**peak, "flops": peak_flops}} if peak else {}),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument(
        "--pairs", nargs="+", default=None, help="act×weight pairs as actxweight, e.g. fp8xfp4 (default: all)"
    )
    p.add_argument("--gemm", choices=["w13", "w2", "both"], default="w13", help="gate/up (w13), down (w2) or both")
    p.add_argument(
        "--fp8-scales",
        choices=["pow2", "float"],
        default="pow2",
        help="fp8 weight scales: powers of two (default; the CPU kernel's pow2 path) or float (fold path)",
    )
    args = p.parse_args(argv)
    shapes, tokens = resolve_args(args)
    report = start(args, BENCH)
    gemms = ("w13", "w2") if args.gemm == "both" else (args.gemm,)
    run(report, shapes, tokens, args.quick, parse_pairs(args.pairs, list(FORMAT_PAIRS)), gemms, args.fp8_scales)
    finish(report, args, BENCH, [BENCH])


if __name__ == "__main__":
    main()
