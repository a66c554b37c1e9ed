"""`make bench`: every static_moe benchmark on the docs/benchmarks.md shapes (DeepSeek-V4-Flash, DeepSeek-V3,
Qwen3-30B-A3B; tokens per rank 1, 4, 16, 64, 128), with the machine's limits measured once in the same run.

Prints one table per benchmark (median time, collective time, bytes, FLOPs, both roofline terms, the bound,
roofline fraction, speed-ups over seed_dense / torch_cached / torch_scaled_mm / torch_int4pack / the pure-torch
reference), the performance targets with the measured figures, and writes bench/results/bench.json plus
<bench>_roofline.png / <bench>_speedup.png. Sized to finish in under 10 minutes on 2 threads: the number of local
experts is scaled per shape (printed; H and I are never scaled).

A full run (every benchmark, shape and default token count; not --quick) also writes the host's summary,
bench/results/hosts/<host-id>.json (committed; harness.hosts), and renders docs/benchmarks.md's results table from
every summary there (harness.results_doc). A partial run writes them only where --hosts-dir says.

    OMP_NUM_THREADS=2 .venv/bin/python bench/run_all.py            # what `make bench` runs
    OMP_NUM_THREADS=2 .venv/bin/python bench/run_all.py --quick    # a tiny smoke run
    OMP_NUM_THREADS=2 .venv/bin/python bench/run_all.py --only local_experts --shape v4_flash
    .venv/bin/python bench/run_all.py --table-only                  # re-render the table from the committed summaries
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import bench_expert_gemm
import bench_forward
import bench_local_experts
import bench_pack_rows
import bench_quantize_weight
import bench_swiglu_and_cast
from harness.cli import DEFAULT_TOKENS, add_common_args, resolve_args, start
from harness.hosts import HOSTS_DIR, host_summary, this_host, write_host_json
from harness.report import Report
from harness.results_doc import DOC, update_results_doc
from harness.workload import local_experts_for

from static_moe.testing.generators import FORMAT_PAIRS, MODEL_SHAPES
from static_moe.testing.machine import cpu_isa_available, measure_machine

SECTIONS = ("pack_rows", "swiglu_and_cast", "expert_gemm", "local_experts", "forward", "quantize_weight")
PLOTTED = {
    "pack_rows": ["pack_rows", "unpack_rows"],
    "swiglu_and_cast": ["swiglu_and_cast"],
    "expert_gemm": ["expert_gemm"],
    "local_experts": ["local_experts"],
    "forward": ["forward"],
    "quantize_weight": ["quantize_weight"],
}
# Benches in the table but not plotted: their points do not depend on the tokens per rank (the plots' x axis).
UNPLOTTED = {"quantize_weight"}

# The roofline targets: roofline fraction and speed-up over torch_cached, on V4-Flash shapes, tokens per rank 1–16.
TARGET_SHAPE = "v4_flash"
TARGET_TOKENS = (1, 4, 16)
ROOFLINE_TARGETS = [  # (bench, weight format, min roofline fraction, min speed-up vs torch_cached)
    ("expert_gemm", "fp4", 0.60, 4.0),
    ("local_experts", "fp4", 0.60, 4.0),
    ("expert_gemm", "fp8", 0.50, 2.0),
    ("local_experts", "fp8", 0.50, 2.0),
]
FORWARD_TARGET = 3.0  # forward at S = 2 vs torch_cached composed with the same collectives


def run_section(name: str, report: Report, shapes, tokens, quick: bool) -> None:
    if name == "pack_rows":
        bench_pack_rows.run(report, shapes, tokens, quick)
    elif name == "swiglu_and_cast":
        bench_swiglu_and_cast.run(report, shapes, tokens, quick)
    elif name == "expert_gemm":
        bench_expert_gemm.run(report, shapes, tokens, quick)
        # fp8 weights with float scales (DeepSeek-V3's scale_inv): the CPU kernel's fold path, at the compute-bound
        # points where it differs from the pow2 path the pass above times
        bench_expert_gemm.run(
            report,
            shapes,
            [t for t in tokens if t >= BF16_PEAK_MIN_TOKENS],
            quick,
            [p for p in FORMAT_PAIRS if p[1] == "fp8"],
            fp8_scales="float",
        )
        # The opt-in AMX kernel (STATIC_MOE_CPU_ISA=amx, csrc/cpu/kernels/expert_gemm_amx.cpp) where this host has
        # it, at compute-bound points: a series of its own beside the default path's, its own target lines.
        if cpu_isa_available("amx"):
            amx_shapes = [sh for sh in shapes if sh in INT4_SHAPES]
            amx_tokens = [t for t in tokens if t in AMX_TOKENS]
            bench_expert_gemm.run(report, amx_shapes, amx_tokens, quick, AMX_PAIRS, isa="amx")
            bench_expert_gemm.run(
                report,
                amx_shapes,
                amx_tokens,
                quick,
                [p for p in AMX_PAIRS if p[1] == "fp8"],
                fp8_scales="float",
                isa="amx",
            )
    elif name == "local_experts":
        bench_local_experts.run(report, shapes, tokens, quick)
    elif name == "forward":
        bench_forward.run(report, shapes, tokens, quick)
    elif name == "quantize_weight":
        bench_quantize_weight.run_report(report, shapes, tokens, quick)


def roofline_targets(report: Report) -> list[dict]:
    """The roofline targets against what this run measured (a report, never an assertion)."""
    out = []
    for bench, w_fmt, min_frac, min_speedup in ROOFLINE_TARGETS:
        recs = [
            r
            for r in report.records
            if r["bench"] == bench
            and r.get("weight") == w_fmt
            and r.get("isa") is None
            and r.get("shape") == TARGET_SHAPE
            and r["tokens"] in TARGET_TOKENS
            and r["op"].get("available")
        ]
        if not recs:
            continue
        worst_frac = min(recs, key=lambda r: r["roofline_fraction"] or 0.0)
        worst_sp = min(recs, key=lambda r: r["speedup"].get("torch_cached") or 0.0)
        out.append(
            {
                "what": f"{bench} {w_fmt} weights, {MODEL_SHAPES[TARGET_SHAPE].name}, T 1–16",
                "roofline_fraction_min": worst_frac["roofline_fraction"],
                "at_roofline": _at(worst_frac),
                "roofline_fraction_bf16_peak_min": min(r["roofline_fraction_bf16_peak"] or 0.0 for r in recs),
                "roofline_target": min_frac,
                "speedup_cached_min": worst_sp["speedup"].get("torch_cached"),
                "at_speedup": _at(worst_sp),
                "speedup_target": min_speedup,
            }
        )
    recs = [
        r
        for r in report.records
        if r["bench"] == "forward"
        and r.get("ep_size") == 2
        and r["op"].get("available")
        and r["speedup"].get("torch_cached")
    ]
    if recs:
        worst = min(recs, key=lambda r: r["speedup"]["torch_cached"])
        out.append(
            {
                "what": "forward S=2 vs torch_cached composed, every shape and T",
                "speedup_cached_min": worst["speedup"]["torch_cached"],
                "at_speedup": _at(worst),
                "speedup_target": FORWARD_TARGET,
            }
        )
    return out


# The same-round targets: PyTorch's own 4-bit GEMM (the int4pack target), the read-only bandwidth at one row, the bf16
# peak at 16+ rows; each a ratio of calls timed in the same rounds (harness.timing.time_interleaved), so the load a
# shared host puts on one block of samples and not on the next does not skew it.
INT4_SHAPES, INT4_TOKENS, INT4_TARGET = ("v4_flash", "v3"), (1, 4, 16, 64), 2.0
READ_BW_TARGET = 0.70  # one row per expert: weight bytes / time vs the read-only stream
BF16_PEAK_TARGET = 0.50  # 16+ rows: FLOP/s vs the bf16 matmul peak
BF16_PEAK_MIN_TOKENS = bench_expert_gemm.PEAK_MIN_TOKENS  # the points timed with the bf16 matmul
AMX_TOKENS = (16, 64)  # the opt-in amx series: where tiles pay (at one row per expert they lose, see cpu.md)
AMX_PAIRS = [("bf16", "fp4"), ("bf16", "fp8")]


def same_round_targets(report: Report) -> list[dict]:
    """The same-round targets against what this run measured (a report, never an assertion). Each row: what, the
    measured minimum, where it was, the target."""
    lim = report.limits
    every = [r for r in report.records if r["op"].get("available") and r["op"].get("median_s")]
    ok = [r for r in every if r.get("isa") is None]  # the default path; forced-isa series have lines of their own
    out = []

    def add(what, recs, value, target, unit):
        if recs:
            worst = min(recs, key=value)
            out.append({"what": what, "min": value(worst), "at": _at(worst), "target": target, "unit": unit})

    int4 = [r for r in ok if _int4_point(r)]
    add(
        "expert_gemm fp4 vs torch_int4pack (aten._weight_int4pack_mm_for_cpu), V4-Flash and V3, T 1/4/16/64",
        int4,
        lambda r: r["speedup"]["torch_int4pack"],
        INT4_TARGET,
        "×",
    )
    # At one row both ops are bound by reading their weights, so the most a kernel can gain on int4pack there is
    # int4pack's time over a plain read of the kernel's own bytes, timed in the same rounds
    # (speedup / weight_stream_fraction = t_int4pack / t_stream): below 2, the 2× target asks the kernel to read
    # faster than torch.sum reads the same bytes.
    add(
        "  the same at T=1: t_int4pack / t_stream, the ×int4pack of a kernel reading its weights at the same-round "
        "stream's rate (information; below 2× the target is past a plain read)",
        [r for r in int4 if r["tokens"] == 1 and r.get("weight_stream_fraction")],
        lambda r: r["speedup"]["torch_int4pack"] / r["weight_stream_fraction"],
        None,
        "×",
    )
    add(
        "local_experts fp4 vs torch_int4pack (information)",
        [r for r in ok if r["bench"] == "local_experts" and r["speedup"].get("torch_int4pack")],
        lambda r: r["speedup"]["torch_int4pack"],
        None,
        "×",
    )
    one_row = [r for r in ok if _one_row(r)]
    add(
        "one row per expert (expert_gemm T=1, local_experts at 1 row/expert): a read-only stream over the same weight "
        "bytes, timed in the same rounds, vs the op",
        one_row,
        lambda r: r["weight_stream_fraction"],
        READ_BW_TARGET,
        "%",
    )
    if lim.read_bandwidth:
        add(
            f"  the same, weight bytes / time vs the run's best read-only stream ({lim.read_bandwidth / 1e9:.1f} GB/s, "
            "measured at the start and end of the run)",
            [r for r in ok if r["bench"] == "expert_gemm" and r["tokens"] == 1 and r.get("read_bytes")],
            lambda r: r["read_bytes"] / r["op"]["median_s"] / lim.read_bandwidth,
            None,
            "%",
        )
    peak_recs = [r for r in ok if r["bench"] == "expert_gemm" and r.get("bf16_matmul_fraction")]
    add(
        f"expert_gemm T>={BF16_PEAK_MIN_TOKENS}, fp4/fp8 weights (fp8: power-of-two scales), bf16 or pow2 fp8 "
        "activations: FLOP/s vs torch's bf16 matmul timed in the same rounds",
        [r for r in peak_recs if r.get("fp8_scales", "pow2") == "pow2"],
        lambda r: r["bf16_matmul_fraction"],
        BF16_PEAK_TARGET,
        "%",
    )
    add(
        "  the same, fp8 weights with float scales (the fold path)",
        [r for r in peak_recs if r.get("fp8_scales") == "float"],
        lambda r: r["bf16_matmul_fraction"],
        BF16_PEAK_TARGET,
        "%",
    )
    amx = [r for r in every if r.get("isa") == "amx" and r.get("bf16_matmul_fraction")]
    add(
        "  the same, the opt-in amx kernel (STATIC_MOE_CPU_ISA=amx), fp4 and pow2-scaled fp8 weights (information)",
        [r for r in amx if r.get("fp8_scales", "pow2") == "pow2"],
        lambda r: r["bf16_matmul_fraction"],
        None,
        "%",
    )
    add(
        "  the same, the amx kernel, fp8 weights with float scales (information)",
        [r for r in amx if r.get("fp8_scales") == "float"],
        lambda r: r["bf16_matmul_fraction"],
        None,
        "%",
    )
    add(
        "  the amx kernel's fp4 expert_gemm vs torch_int4pack, T 16/64 (information)",
        [r for r in every if r.get("isa") == "amx" and r["speedup"].get("torch_int4pack")],
        lambda r: r["speedup"]["torch_int4pack"],
        None,
        "×",
    )
    if lim.bf16_flops:
        add(
            f"  the same, vs the run's best bf16 matmul ({lim.bf16_flops / 1e9:.0f} GFLOP/s, measured at the start and "
            "end of the run)",
            [
                r
                for r in ok
                if r["bench"] == "expert_gemm"
                and r["tokens"] >= BF16_PEAK_MIN_TOKENS
                and r.get("weight") in ("fp4", "fp8")
                and r.get("compute_peak") == "bf16"
            ],
            lambda r: r["flops"] / r["op"]["median_s"] / lim.bf16_flops,
            None,
            "%",
        )
    add(
        "quantize_weight (bf16 → fp8 / fp4 weights, SPEC §1.10): bytes moved per second vs a plain copy of the same "
        "input (w.clone()), timed in the same rounds",
        [r for r in ok if r["bench"] == "quantize_weight" and r.get("copy_fraction")],
        lambda r: r["copy_fraction"],
        bench_quantize_weight.COPY_TARGET,
        "%",
    )
    fwd2 = [r for r in ok if r["bench"] == "forward" and r.get("ep_size") == 2]
    add(
        "forward S=2: collectives' share of a step, from the op's phases (information)",
        [r for r in fwd2 if r.get("collective_share") is not None],
        lambda r: -r["collective_share"],
        None,
        "-%",
    )  # min of the negation: the largest share
    add(
        "forward S=2: a rank's local experts in the step vs alone, same threads (≤ 1: not slowed by the other rank)",
        [r for r in fwd2 if r.get("local_experts_in_step_vs_alone")],
        lambda r: -r["local_experts_in_step_vs_alone"],
        None,
        "-×",
    )
    return out


def _int4_point(r: dict) -> bool:
    """A point of the int4pack target: expert_gemm, fp4 weights, V4-Flash or V3, T 1/4/16/64, int4pack timed."""
    return (
        r["bench"] == "expert_gemm"
        and r.get("weight") == "fp4"
        and r["shape"] in INT4_SHAPES
        and r["tokens"] in INT4_TOKENS
        and bool(r["speedup"].get("torch_int4pack"))
    )


def _one_row(r: dict) -> bool:
    """A point at one row per expert with its same-round read-only stream: expert_gemm at T = 1, local_experts at
    ≤ 1 row per expert."""
    return bool(r.get("weight_stream_fraction")) and (
        (r["bench"] == "expert_gemm" and r["tokens"] == 1)
        or (r["bench"] == "local_experts" and r.get("rows_per_expert", 2.0) <= 1.0)
    )


def _span(values) -> list[float] | None:
    values = list(values)
    return [min(values), max(values)] if values else None


def summary_ranges(report: Report) -> dict:
    """Per column of docs/benchmarks.md's results table, [min, max] over the V4-Flash and V3 points of this run (None
    where it has none): the host summary's figures (harness.hosts).

    int4pack: expert_gemm fp4 ×torch_int4pack per T, the default kernel; read_ceiling: at T = 1, t_int4pack /
    t_stream, what a kernel reading its weights at the same-round stream's rate would get against int4pack;
    amx_int4pack: the opt-in amx kernel's ×torch_int4pack per T; one_row_read: the op's fraction of a same-round
    read-only stream over its own weight bytes at one row per expert; bf16_matmul: expert_gemm FLOP/s over torch's
    bf16 matmul in the same rounds at 16+ rows, fp4 and power-of-two-scaled fp8 weights; forward_in_step: a rank's
    local experts inside the S = 2 step against the same call alone, every shape; quantize_copy: per weight format,
    quantize_weight's bytes per second over a plain copy's of the same input, every shape."""
    every = [r for r in report.records if r["op"].get("available") and r["op"].get("median_s")]
    ok = [r for r in every if r.get("isa") is None]
    shapes = [r for r in ok if r.get("shape") in INT4_SHAPES]
    int4 = [r for r in ok if _int4_point(r)]
    amx = [
        r
        for r in every
        if r.get("isa") == "amx" and r.get("shape") in INT4_SHAPES and r["speedup"].get("torch_int4pack")
    ]
    return {
        "shapes": list(INT4_SHAPES),
        "int4pack": {
            str(t): _span(r["speedup"]["torch_int4pack"] for r in int4 if r["tokens"] == t) for t in INT4_TOKENS
        },
        "read_ceiling": _span(
            r["speedup"]["torch_int4pack"] / r["weight_stream_fraction"]
            for r in int4
            if r["tokens"] == 1 and r.get("weight_stream_fraction")
        ),
        "amx_int4pack": {
            str(t): _span(r["speedup"]["torch_int4pack"] for r in amx if r["tokens"] == t) for t in AMX_TOKENS
        },
        "one_row_read": _span(r["weight_stream_fraction"] for r in shapes if _one_row(r)),
        "bf16_matmul": _span(
            r["bf16_matmul_fraction"]
            for r in shapes
            if r["bench"] == "expert_gemm" and r.get("bf16_matmul_fraction") and r.get("fp8_scales", "pow2") == "pow2"
        ),
        "forward_in_step": _span(
            r["local_experts_in_step_vs_alone"]
            for r in ok
            if r["bench"] == "forward" and r.get("ep_size") == 2 and r.get("local_experts_in_step_vs_alone")
        ),
        "quantize_copy": {
            f: _span(
                r["copy_fraction"]
                for r in ok
                if r["bench"] == "quantize_weight" and r.get("weight") == f and r.get("copy_fraction")
            )
            for f in ("fp8", "fp4")
        },
    }


def print_same_round_targets(rows: list[dict]) -> None:
    if not rows:
        return
    print(
        "\nTargets against torch_int4pack, the read-only stream, the bf16 matmul and a plain copy (measured minimum over the "
        "points named, ratios of calls timed in the same rounds of this run):"
    )
    for t in rows:
        v = t["min"]
        shown = {
            "×": f"{v:.2f}×",
            "%": f"{100 * v:.0f}%",
            "-%": f"{-100 * v:.0f}% (largest)",
            "-×": f"{-v:.2f}× (largest)",
        }[t["unit"]]
        if t["target"] is None:
            verdict = ""
        else:
            goal = f"{t['target']:.0f}×" if t["unit"] == "×" else f"{100 * t['target']:.0f}%"
            verdict = f" (target ≥ {goal}: {'met' if v >= t['target'] else 'NOT met'})"
        print(f"  {t['what']}: {shown}{verdict}, worst at {t['at']}")


def _at(r: dict) -> str:
    return f"{r.get('shape')} {r.get('fmt')}" + (f" T={r['tokens']}" if r["tokens"] != "" else "")


def print_roofline_targets(rows: list[dict]) -> None:
    if not rows:
        return
    print(
        "\nTargets for the roofline fraction and the speed-up over torch_cached (measured minimum over the points "
        "named):"
    )
    for t in rows:
        parts = []
        if "roofline_fraction_min" in t:
            f = t["roofline_fraction_min"] or 0.0
            parts.append(
                f"roofline {100 * f:.1f}% (target ≥ {100 * t['roofline_target']:.0f}%: "
                f"{'met' if f >= t['roofline_target'] else 'NOT met'}, worst at {t['at_roofline']}; "
                f"{100 * t['roofline_fraction_bf16_peak_min']:.1f}% with the bf16 matmul peak)"
            )
        sp = t["speedup_cached_min"] or 0.0
        parts.append(
            f"×torch_cached {sp:.2f} (target ≥ {t['speedup_target']:.0f}×: "
            f"{'met' if sp >= t['speedup_target'] else 'NOT met'}, worst at {t['at_speedup']})"
        )
        print(f"  {t['what']}: " + "; ".join(parts))


def _publish_paths(args) -> tuple[Path | None, Path | None]:
    """Where this run's host summary goes and which markdown file's results table it re-renders (None: nowhere).
    Only a full run — what `make bench` runs — replaces the committed summary of its host kind by default."""
    full = (
        not args.quick
        and list(args.only) == list(SECTIONS)
        and args.shape in (None, ["all"])
        and args.tokens in (None, list(DEFAULT_TOKENS))
    )
    hosts_dir = args.hosts_dir or (HOSTS_DIR if full or args.table_only else None)
    default_dir = hosts_dir is not None and hosts_dir.resolve() == HOSTS_DIR.resolve()
    return hosts_dir, args.results_doc or (DOC if default_dir else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="benchmarks to run")
    p.add_argument(
        "--hosts-dir",
        type=Path,
        default=None,
        help=f"write the host's summary <host-id>.json here (default: {HOSTS_DIR.relative_to(DOC.parents[1])} "
        "on a full run, nowhere on a partial one)",
    )
    p.add_argument(
        "--results-doc",
        type=Path,
        default=None,
        help=f"render the results table of this markdown file from every summary in the hosts dir (default: "
        f"{DOC.relative_to(DOC.parents[1])} when the summary goes to the default hosts dir)",
    )
    p.add_argument(
        "--table-only",
        action="store_true",
        help="only re-render the results table from the summaries already there, and exit",
    )
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    hosts_dir, results_doc = _publish_paths(args)
    if args.table_only:
        print(f"updated {update_results_doc(results_doc or DOC, hosts_dir or HOSTS_DIR)}")
        return
    shapes, tokens = resolve_args(args)
    t_start = time.perf_counter()
    report = start(args, "run_all")
    report.meta["host"] = this_host()
    scale = {s: (local_experts_for(s, args.quick), MODEL_SHAPES[s].num_experts) for s in shapes}
    report.meta.update(shapes=shapes, tokens=tokens, local_experts_scale=scale)
    print(
        "scale: local experts kept per rank (H, I, k unscaled): "
        + ", ".join(f"{MODEL_SHAPES[s].name} {kept} of {full}" for s, (kept, full) in scale.items())
        + "; forward keeps at least ceil(k / S)",
        flush=True,
    )
    elapsed = {}
    for name in args.only:
        t0 = time.perf_counter()
        run_section(name, report, shapes, tokens, args.quick)
        elapsed[name] = time.perf_counter() - t0
        print(f"[{name}] {elapsed[name]:.0f} s", flush=True)
    report.meta["elapsed_s"] = elapsed
    report.refresh_limits(measure_machine(report.limits.threads, quick=args.quick))  # best of start and end

    print()
    print(report.header())
    print(
        "scale: "
        + ", ".join(f"{MODEL_SHAPES[s].name}: {kept}/{full} local experts" for s, (kept, full) in scale.items())
    )
    for name in args.only:
        recs = [r for r in report.records if r["bench"] in PLOTTED[name]]
        if recs:
            print()
            print(report.table(recs))
    notes = report.notes()
    if notes:
        print("unavailable:\n" + notes)
    rows = roofline_targets(report)
    report.meta["roofline_targets"] = rows
    print_roofline_targets(rows)
    rows2 = same_round_targets(report)
    report.meta["same_round_targets"] = rows2
    print_same_round_targets(rows2)
    path = report.write_json(Path(args.out) / "bench.json")
    print(f"\nwrote {path}")
    if hosts_dir is None:
        print("a partial run: no host summary written (--hosts-dir DIR writes one)")
    else:
        summary = host_summary(
            report, report.meta["host"], {"roofline": rows, "same_round": rows2}, summary_ranges(report)
        )
        print(f"wrote {write_host_json(summary, hosts_dir)}")
        if results_doc is not None:
            print(f"updated {update_results_doc(results_doc, hosts_dir)} (results table)")
    if not args.no_plots:
        for name in args.only:
            for bench in PLOTTED[name]:
                if bench in UNPLOTTED:
                    continue
                for png in report.plot(Path(args.out), bench):
                    print(f"wrote {png}")
    print(f"total {time.perf_counter() - t_start:.0f} s on {report.limits.threads} threads")


if __name__ == "__main__":
    main()
