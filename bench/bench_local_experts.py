"""Benchmark of torch.ops.static_moe.local_experts (the fused step 2, SPEC §1.7) per weight format, against
seed_dense, torch_cached, (fp8 weights) torch_scaled_mm and (fp4 weights) torch_int4pack on the same inputs (docs/benchmarks.md).

One EP rank at S = 1: the T tokens are the gathered rows. The number of local experts is scaled down (H, I, k
are not; see static_moe.testing.generators.sliced_routing): the kept experts keep their real rows, so rows per expert match the
full model, and the table prints experts run / experts the real routing touches.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_local_experts.py --shape v4_flash --tokens 1 16
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_local_experts.py --quick
"""

from __future__ import annotations

import argparse

import baselines as B
import torch
from harness.checks import check_baseline, check_op, check_point
from harness.cli import add_common_args, finish, parse_pairs, resolve_args, start
from harness.costs import cost_local_experts, roofline
from harness.report import Report, progress
from harness.routing import routing_stats
from harness.timing import (
    measure_with,
    stream_fraction,
    time_baseline,
    time_fastest_variant,
    time_fn,
    timing_dict,
    weight_stream,
)
from harness.workload import bench_weights, local_experts_for

from static_moe import reference
from static_moe.testing.generators import MODEL_SHAPES, make_activations, sliced_routing
from static_moe.testing.machine import bf16_dot_products
from static_moe.testing.numeric import assert_gemm_close, calc_diff

BENCH = "local_experts"
# One pair per weight format by default: bf16 weights with bf16 activations, quantized weights with fp8 ones.
DEFAULT_PAIRS = [("bf16", "bf16"), ("fp8", "fp8"), ("fp8", "fp4")]
GROUP = 128  # fp8 activation group


def run(
    report: Report,
    shapes: list[str],
    tokens: list[int],
    quick: bool,
    pairs: list[tuple[str, str]] = DEFAULT_PAIRS,
    swiglu_limit: float | None = None,
) -> list[dict]:
    """Append one record per (shape, pair, tokens) to ``report``."""
    records = []
    smm_reason = B.scaled_mm_unavailable_reason()
    int4_reason = B.int4pack_unavailable_reason()
    t_check = check_point(tokens)
    for shape_key in shapes:
        shape = MODEL_SHAPES[shape_key]
        hid, inter = shape.hidden, shape.intermediate
        num_local = local_experts_for(shape_key, quick)
        print(
            f"[{BENCH}] {shape.name}: H={hid} I={inter} k={shape.topk}; local experts scaled to {num_local} of "
            f"{shape.num_experts} (EP 1), rows per expert kept real",
            flush=True,
        )
        for w_fmt in dict.fromkeys(w for _, w in pairs):
            w = bench_weights(num_local, hid, inter, w_fmt, seed=1)
            args_w = (w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
            cached = {dt: B.TorchCached(*args_w, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
            smm = B.TorchScaledMM(*args_w) if (w_fmt == "fp8" and smm_reason is None) else None
            int4 = B.TorchInt4Pack(*args_w) if (w_fmt == "fp4" and int4_reason is None) else None
            for act_fmt in [a for a, wf in pairs if wf == w_fmt]:
                for t in tokens:
                    routing = sliced_routing(shape, [t], num_local, seed=t)
                    idx, tw = routing.topk_idx[0], routing.topk_weights[0]
                    x, xs = make_activations(t, hid, act_fmt, GROUP, seed=t)
                    stats = routing_stats(idx, 0, num_local)
                    rec = _measure_point(
                        shape_key,
                        act_fmt,
                        w_fmt,
                        t,
                        x,
                        xs,
                        idx,
                        tw,
                        args_w,
                        cached,
                        smm,
                        smm_reason,
                        int4,
                        int4_reason,
                        swiglu_limit,
                        check=(t == t_check),
                    )
                    cost = cost_local_experts(
                        act_fmt,
                        w_fmt,
                        t,
                        stats.rows_active,
                        shape.topk,
                        hid,
                        inter,
                        stats.experts_touched,
                        stats.pairs,
                        GROUP,
                    )
                    rec.update(roofline(cost, report.limits, rec["op"].get("median_s"), bf16_dot_products(act_fmt)))
                    rec.update(
                        rows=t,
                        rows_active=stats.rows_active,
                        pairs=stats.pairs,
                        experts_touched=stats.experts_touched,
                        experts_real=routing.touched_real,
                        experts=f"{stats.experts_touched}/{routing.touched_real}",
                        rows_per_expert=stats.pairs / max(stats.experts_touched, 1),
                        local_experts=num_local,
                        local_experts_real=shape.num_experts,
                    )
                    records.append(report.add(rec))
                    progress(rec)
            del cached, smm, int4, w
    return records


def _measure_point(
    shape_key, act_fmt, w_fmt, t, x, xs, idx, tw, args_w, cached, smm, smm_reason, int4, int4_reason, limit, check
):
    op_args = (x, xs, idx, tw, *args_w, 0, limit, 448.0)
    # The op, a read-only stream over the weight bytes of the experts it runs and (fp4) torch_int4pack in the same
    # rounds (harness.timing.time_interleaved): the targets compare them.
    num_local = args_w[0].shape[0]
    touched = sorted({int(e) for e in idx.flatten().tolist() if 0 <= int(e) < num_local})
    companions = {"weight_stream": weight_stream([wt[e] for wt in args_w if wt is not None for e in touched])}
    if w_fmt == "fp4" and int4 is not None:
        companions["torch_int4pack"] = lambda: int4.local_experts(x, xs, idx, tw, 0, limit)
    op, out, paired, paired_outs = measure_with(lambda: torch.ops.static_moe.local_experts(*op_args), companions)
    stream = paired.pop("weight_stream")
    base = {}
    timing, seed_out = time_fn(lambda: B.seed_dense_local_experts(*op_args), cold=True)
    base["seed_dense"] = timing_dict(timing)
    outs = {"seed_dense": seed_out}
    base["torch_cached"], outs["torch_cached"] = time_fastest_variant(
        cached, lambda c: c.local_experts(x, xs, idx, tw, 0, limit), cold=True
    )
    if w_fmt == "fp8":
        time_baseline(
            base,
            outs,
            "torch_scaled_mm",
            smm,
            smm_reason,
            lambda m: m.local_experts(x, xs, idx, tw, 0, limit),
            cold=True,
        )
    if w_fmt == "fp4":
        if int4 is None:
            base["torch_int4pack"] = {"available": False, "reason": int4_reason}
        else:
            base["torch_int4pack"], outs["torch_int4pack"] = paired["torch_int4pack"], paired_outs["torch_int4pack"]
    what = f"{BENCH} {shape_key} {act_fmt}x{w_fmt} T={t}"
    if check:  # once per configuration: every baseline (and the op) against the reference
        ref = reference.local_experts(*op_args)
        for name, o in outs.items():
            base[name]["calc_diff_vs_reference"] = check_baseline(name, o, ref, B.CHECK_TOLERANCE[name], what)
        op["parity"] = check_op(out, ref, lambda o, r: assert_gemm_close(o, r, what))
    if out is not None:  # free cross-check at every point: the outputs are the warm-up calls'
        for name, o in outs.items():
            base[name]["calc_diff_vs_op"] = calc_diff(o, out)
    return {
        "bench": BENCH,
        "shape": shape_key,
        "fmt": f"{act_fmt}×{w_fmt}",
        "act": act_fmt,
        "weight": w_fmt,
        "tokens": t,
        "op": op,
        "baselines": base,
        "weight_stream": stream,
        "weight_stream_fraction": stream_fraction(stream, op),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        help="act×weight pairs as actxweight, e.g. fp8xfp4, or 'all' (default: bf16xbf16 fp8xfp8 fp8xfp4)",
    )
    p.add_argument("--swiglu-limit", type=float, default=None)
    args = p.parse_args(argv)
    shapes, tokens = resolve_args(args)
    report = start(args, BENCH)
    run(report, shapes, tokens, args.quick, parse_pairs(args.pairs, DEFAULT_PAIRS), args.swiglu_limit)
    finish(report, args, BENCH, [BENCH])


if __name__ == "__main__":
    main()
