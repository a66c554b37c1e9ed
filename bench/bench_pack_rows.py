"""Benchmark of torch.ops.static_moe.pack_rows / unpack_rows (SPEC §1.8) against the pure-torch reference
(``torch_ref``: what a PyTorch user writes — byte views, a 0xFF-filled buffer, slice copies).

pack: a rank's T tokens — activations (bf16, or fp8 + float32 1×128 scales), int32 top-k ids, fp32 top-k
weights — into [C, W] bytes with C = T. unpack: the activation span out of the gathered [S·C, W] buffer of
S = 2 ranks. Elementwise: the roofline is the bytes term alone. Warm calls (the parts were just produced).

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_pack_rows.py --shape v3 --tokens 1 128
"""

from __future__ import annotations

import argparse

import torch
from harness.checks import check_op
from harness.cli import add_common_args, finish, resolve_args, start
from harness.costs import cost_pack_rows, cost_unpack_rows, roofline
from harness.report import Report, progress
from harness.timing import measure, time_fn, timing_dict

from static_moe import reference
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.testing.generators import MODEL_SHAPES, make_activations, make_routing
from static_moe.testing.numeric import assert_equal

BENCH_PACK, BENCH_UNPACK = "pack_rows", "unpack_rows"
GROUP = 128
GATHER_RANKS = 2  # the unpack benchmark reads the gathered buffer of this many ranks


def run(
    report: Report, shapes: list[str], tokens: list[int], quick: bool, act_formats: tuple[str, ...] = ("bf16", "fp8")
) -> list[dict]:
    """Append a pack and an unpack record per (shape, activation format, tokens) to ``report``."""
    records = []
    for shape_key in shapes:
        shape = MODEL_SHAPES[shape_key]
        for act_fmt in act_formats:
            for t in tokens:
                x, xs = make_activations(t, shape.hidden, act_fmt, GROUP, seed=t)
                idx, w = make_routing(t, shape.topk, shape.num_experts, seed=t)
                parts = [x] + ([xs] if xs is not None else []) + [idx, w]
                spans, width = pack_layout([part_nbytes(p) for p in parts])
                row_bytes = sum(part_nbytes(p) for p in parts)

                op, out = measure(lambda: torch.ops.static_moe.pack_rows(parts, t))
                timing, ref = time_fn(lambda: reference.pack_rows(parts, t))
                if out is not None:
                    op["parity"] = _bitwise(out, ref, f"pack_rows {shape_key} {act_fmt} T={t}")
                rec = {
                    "bench": BENCH_PACK,
                    "shape": shape_key,
                    "fmt": act_fmt,
                    "act": act_fmt,
                    "tokens": t,
                    "rows": t,
                    "op": op,
                    "baselines": {"torch_ref": timing_dict(timing)},
                }
                rec.update(roofline(cost_pack_rows(row_bytes, t, t, width), report.limits, op.get("median_s")))
                records.append(report.add(rec))
                progress(rec)

                gathered = ref.repeat(GATHER_RANKS, 1)  # [S·C, W]: what the all-gather hands every rank
                off, nbytes = spans[0]
                uargs = (gathered, off, nbytes, x.dtype, [shape.hidden])
                op, out = measure(lambda: torch.ops.static_moe.unpack_rows(*uargs))
                timing, ref_u = time_fn(lambda: reference.unpack_rows(*uargs))
                if out is not None:
                    op["parity"] = _bitwise(out, ref_u, f"unpack_rows {shape_key} {act_fmt} T={t}")
                rows = GATHER_RANKS * t
                rec = {
                    "bench": BENCH_UNPACK,
                    "shape": shape_key,
                    "fmt": act_fmt,
                    "act": act_fmt,
                    "tokens": t,
                    "rows": rows,
                    "op": op,
                    "baselines": {"torch_ref": timing_dict(timing)},
                }
                rec.update(roofline(cost_unpack_rows(rows, nbytes), report.limits, op.get("median_s")))
                records.append(report.add(rec))
                progress(rec)
    return records


def _bitwise(out: torch.Tensor, ref: torch.Tensor, what: str) -> str:
    return check_op(out, ref, lambda o, r: assert_equal(o, r, what))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--act", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"], help="activation formats")
    args = p.parse_args(argv)
    shapes, tokens = resolve_args(args)
    report = start(args, BENCH_PACK)
    run(report, shapes, tokens, args.quick, tuple(args.act))
    finish(report, args, BENCH_PACK, [BENCH_PACK, BENCH_UNPACK])


if __name__ == "__main__":
    main()
