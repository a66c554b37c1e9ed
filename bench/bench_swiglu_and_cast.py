"""Benchmark of torch.ops.static_moe.swiglu_and_cast (SPEC §1.4–1.5) against the pure-torch reference
(``torch_ref``), per output format: fp8 (1×128 power-of-two scales) and bf16.

Rows: the T·k (row, expert) pairs a rank at S = 1 pushes through its experts' SwiGLU; gate_up bf16 [T·k, 2I]
with a routing weight per row. Elementwise: the roofline is the bytes term alone. Warm calls.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_swiglu_and_cast.py --shape v4_flash --tokens 16
"""

from __future__ import annotations

import argparse

import torch
from harness.checks import check_op
from harness.cli import add_common_args, finish, resolve_args, start
from harness.costs import cost_swiglu_and_cast, roofline
from harness.report import Report, progress
from harness.timing import measure, time_fn, timing_dict

from static_moe import reference
from static_moe.testing.generators import MODEL_SHAPES, gen
from static_moe.testing.numeric import assert_swiglu_close

BENCH = "swiglu_and_cast"
GROUP = 128


def run(
    report: Report,
    shapes: list[str],
    tokens: list[int],
    quick: bool,
    out_formats: tuple[str, ...] = ("fp8", "bf16"),
    swiglu_limit: float | None = None,
) -> list[dict]:
    """Append one record per (shape, output format, tokens) to ``report``."""
    records = []
    for shape_key in shapes:
        shape = MODEL_SHAPES[shape_key]
        inter = shape.intermediate
        for out_fmt in out_formats:
            for t in tokens:
                rows = t * shape.topk
                g = gen(t)
                gate_up = (torch.randn(rows, 2 * inter, generator=g) * 2).to(torch.bfloat16)
                w = torch.rand(rows, generator=g)
                args = (gate_up, w, swiglu_limit, out_fmt, GROUP, 448.0, True)
                op, out = measure(lambda: torch.ops.static_moe.swiglu_and_cast(*args))
                timing, ref = time_fn(lambda: reference.swiglu_and_cast(*args))
                if out is not None:
                    what = f"swiglu_and_cast {shape_key} {out_fmt} T={t}"
                    op["parity"] = check_op(out, ref, lambda o, r: assert_swiglu_close(o, r, what))
                rec = {
                    "bench": BENCH,
                    "shape": shape_key,
                    "fmt": f"bf16→{out_fmt}",
                    "tokens": t,
                    "rows": rows,
                    "op": op,
                    "baselines": {"torch_ref": timing_dict(timing)},
                }
                rec.update(
                    roofline(cost_swiglu_and_cast(rows, inter, 2, out_fmt, GROUP), report.limits, op.get("median_s"))
                )
                records.append(report.add(rec))
                progress(rec)
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--out-format", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"])
    p.add_argument("--swiglu-limit", type=float, default=None)
    args = p.parse_args(argv)
    shapes, tokens = resolve_args(args)
    report = start(args, BENCH)
    run(report, shapes, tokens, args.quick, tuple(args.out_format), args.swiglu_limit)
    finish(report, args, BENCH, [BENCH])


if __name__ == "__main__":
    main()
