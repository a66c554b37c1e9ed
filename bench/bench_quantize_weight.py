"""Benchmark of torch.ops.static_moe.quantize_weight (SPEC §1.10) against a plain copy of the same bytes and the
pure-torch reference quantizers (static_moe.formats), per weight format.

Input: bf16 expert weights [E, N, K] (a 30B-A3B-class layer by default: 32 experts of 2048 × 768). The op reads
2 bytes per weight and writes 1 (fp8) or 0.5 (fp4) plus scales; the copy (``torch.Tensor.clone``) reads and
writes 2. Reported: each one's time, its bytes moved per second, and the op's bandwidth as a fraction of the
copy's (the goal is ≥ 25 %). Warm calls; threads as OMP_NUM_THREADS / torch.set_num_threads say.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_quantize_weight.py --experts 32 --n 2048 --k 768

Inside ``bench/run_all.py`` (``--only quantize_weight``, part of ``make bench``) :func:`run_report` times the same
op on each model shape's local experts' w13 [L, 2I, H] (L as the other benches scale it), cold, in the same
rounds as the copy, into the common table (``fmt`` "bf16→fp8" / "bf16→fp4"; no T: weights do not depend on the
tokens; ``roof%``: the op's bytes over the machine's triad bandwidth) and prints the ≥ 25 %-of-copy target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import static_moe  # noqa: F401  (registers the ops)
from static_moe import reference


def _time(fn, repeat: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _moved(w: torch.Tensor, outs) -> int:
    return w.numel() * w.element_size() + sum(t.numel() * t.element_size() for t in outs)


def run(experts: int, n: int, k: int, repeat: int, formats=("fp8", "fp4"), with_reference: bool = True) -> list[dict]:
    w = (torch.randn(experts, n, k) * 0.02).to(torch.bfloat16)
    t_copy = _time(lambda: w.clone(), repeat)
    copy_bw = 2 * w.numel() * w.element_size() / t_copy
    records = []
    for fmt in formats:
        outs = torch.ops.static_moe.quantize_weight(w, fmt)
        ref = reference.quantize_weight(w, fmt) if with_reference else None
        if ref is not None:
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip((outs[0], outs[1].view(torch.uint8)), (ref[0], ref[1].view(torch.uint8)))
            )
            if not same:
                raise SystemExit(f"quantize_weight {fmt}: not bitwise equal to the reference")
        t_op = _time(lambda: torch.ops.static_moe.quantize_weight(w, fmt), repeat)
        t_ref = _time(lambda: reference.quantize_weight(w, fmt), max(1, repeat // 5)) if with_reference else None
        bw = _moved(w, outs) / t_op
        rec = {
            "bench": "quantize_weight",
            "fmt": f"bf16→{fmt}",
            "shape": [experts, n, k],
            "threads": torch.get_num_threads(),
            "op_s": t_op,
            "copy_s": t_copy,
            "reference_s": t_ref,
            "op_GBps": bw / 1e9,
            "copy_GBps": copy_bw / 1e9,
            "fraction_of_copy": bw / copy_bw,
            "speedup_vs_reference": None if t_ref is None else t_ref / t_op,
        }
        records.append(rec)
        ref_txt = "" if t_ref is None else f"   reference {t_ref * 1e3:9.2f} ms ({t_ref / t_op:5.1f}x slower)"
        print(
            f"quantize_weight bf16→{fmt} [{experts}, {n}, {k}] threads={rec['threads']}: op {t_op * 1e3:8.2f} ms "
            f"{bw / 1e9:6.2f} GB/s   copy {t_copy * 1e3:8.2f} ms {copy_bw / 1e9:6.2f} GB/s   "
            f"= {100 * bw / copy_bw:5.1f} % of copy{ref_txt}"
        )
    return records


BENCH = "quantize_weight"
COPY_TARGET = 0.25  # the op's bytes per second over a plain copy's of the same input


def run_report(report, shapes: list[str], tokens: list[int], quick: bool, formats=("fp8", "fp4")) -> list[dict]:
    """Append one record per (shape, format) to a bench/harness Report (run_all's common table): the op on the
    shape's local experts' bf16 w13 [L, 2I, H], cold, timed in the same rounds as ``w.clone()`` (the copy
    baseline, ``copy_fraction``: op bytes/s over copy bytes/s); bitwise checked against the reference quantizer
    on the first expert (the whole reference is seconds per expert: its time is this script's, run alone).
    ``tokens`` is unused (the weights do not depend on it)."""
    from harness.costs import Cost, roofline
    from harness.report import progress
    from harness.timing import measure_with
    from harness.workload import local_experts_for

    from static_moe.testing.generators import MODEL_SHAPES

    del tokens
    records = []
    for shape_key in shapes:
        shape = MODEL_SHAPES[shape_key]
        num_local = local_experts_for(shape_key, quick)
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(num_local, 2 * shape.intermediate, shape.hidden, generator=g) * 0.02).to(torch.bfloat16)
        copy_bytes = 2 * w.numel() * w.element_size()
        for fmt in formats:
            op, out, base, _ = measure_with(
                lambda: torch.ops.static_moe.quantize_weight(w, fmt), {"copy": lambda: w.clone()}
            )
            if out is not None:
                q, sc = reference.quantize_weight(w[:1], fmt)
                same = torch.equal(out[0][:1].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                    out[1][:1].view(torch.uint8), sc.view(torch.uint8)
                )
                op["parity"] = "bitwise" if same else "MISMATCH"
            moved = w.numel() * w.element_size() + (
                0 if out is None else sum(t.numel() * t.element_size() for t in out)
            )
            rec = {
                "bench": BENCH,
                "shape": shape_key,
                "fmt": f"bf16→{fmt}",
                "weight": fmt,
                "tokens": "",
                "experts": f"{num_local}/{shape.num_experts}",
                "op": op,
                "baselines": {
                    "torch_ref": {
                        "available": False,
                        "reason": "the Python quantizers take seconds per expert: bench/bench_quantize_weight.py "
                        "times them on their own",
                    }
                },
                "copy": base["copy"],
                "copy_fraction": (moved / op["median_s"]) / (copy_bytes / base["copy"]["median_s"])
                if op.get("median_s")
                else None,
            }
            rec.update(roofline(Cost(moved, 0.0), report.limits, op.get("median_s")))
            records.append(report.add(rec))
            progress(rec)
            if rec["copy_fraction"] is not None:
                print(f"    {100 * rec['copy_fraction']:.0f}% of a plain copy's bandwidth", flush=True)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=768)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--formats", nargs="+", choices=["fp8", "fp4"], default=["fp8", "fp4"])
    p.add_argument("--no-reference", action="store_true", help="skip timing the (slow) Python quantizers")
    p.add_argument("--json", help="write the records here")
    args = p.parse_args(argv)
    recs = run(args.experts, args.n, args.k, args.repeat, tuple(args.formats), not args.no_reference)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=2)


if __name__ == "__main__":
    main()
