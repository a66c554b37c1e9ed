"""Estimated trn2 time of the NKI kernels at decode shapes, next to the ideal HBM-bandwidth time.

No Neuron device is needed: each kernel runs through the repository's NKI interpreter (tools/nki_interpreter),
which records its DMAs and instructions; ``nki_interpreter.cost.CostModel`` (figures and assumptions in its
docstring) turns the record into an estimated time on one NeuronCore-v3. ``ideal`` is the time to move the bytes
the op must move (inputs read once, outputs written once) at one core's share of HBM bandwidth (2.9 TB/s / 8);
``fraction = ideal / estimate``. These are model numbers, not measurements.

    .venv/bin/python bench/bench_nki_kernels.py [--shape v4_flash] [--json bench/results/nki_kernels.json]

Shapes (DeepSeek-V4-Flash by default): hidden 4096, intermediate 2048, top-6, fp8 activations with 1×128
scales. pack_rows packs T tokens into capacity C = 128 rows; unpack_rows reads a span of S·C = 128 gathered
rows; swiglu_and_cast runs over R gathered rows (bf16 gate_up [R, 2I]) with trn2's fp8_max = 240.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the NKI interpreter: a development tool, not in the installed package

import nki_interpreter as interpreter  # noqa: E402
from static_moe.nki import shim  # noqa: E402
from static_moe.nki_kernels.pack_rows import pack_rows, unpack_rows  # noqa: E402
from static_moe.nki_kernels.swiglu_and_cast import swiglu_and_cast  # noqa: E402
from static_moe.reference.pack_rows import pack_layout, part_nbytes  # noqa: E402
from static_moe.testing.generators import MODEL_SHAPES  # noqa: E402

TOKENS = (1, 4, 16, 64, 128)
SWIGLU_ROWS = (1, 4, 16, 64, 128, 512)
CAPACITY = 128
GROUP = 128


def _pack_parts(shape, tokens: int, g: torch.Generator) -> tuple:
    h, k = shape.hidden, shape.topk
    return (
        (torch.randn(tokens, h, generator=g) * 3).to(torch.float8_e4m3fn),
        torch.rand(tokens, h // GROUP, generator=g),
        torch.randint(0, shape.num_experts, (tokens, k), generator=g, dtype=torch.int32),
        torch.rand(tokens, k, generator=g),
    )


def run(shape_key: str) -> list[dict]:
    shape = MODEL_SHAPES[shape_key]
    g = torch.Generator().manual_seed(0)
    rows = []
    # ---- pack_rows: read T rows of every part, write C rows of W bytes
    for t in TOKENS:
        parts = _pack_parts(shape, t, g)
        nbytes = [part_nbytes(p) for p in parts]
        _, width = pack_layout(nbytes)
        ideal = t * sum(nbytes) + CAPACITY * width
        _, rep = interpreter.profile(pack_rows, parts, CAPACITY, ideal_hbm_bytes=ideal)
        rows.append({"kernel": "pack_rows", "shape": f"T={t} C={CAPACITY} W={width}", **rep})
    # ---- unpack_rows: the activation span and the ids span of S·C gathered rows
    parts = _pack_parts(shape, CAPACITY, g)
    packed = shim.simulate(pack_rows)(parts, CAPACITY)
    spans, width = pack_layout([part_nbytes(p) for p in parts])
    for name, p, (off, n) in (("x", parts[0], spans[0]), ("topk_idx", parts[2], spans[2])):
        ideal = 2 * CAPACITY * n
        _, rep = interpreter.profile(
            unpack_rows, packed, off, n, shim.nl_dtype(p.dtype), tuple(p.shape[1:]), ideal_hbm_bytes=ideal
        )
        rows.append({"kernel": f"unpack_rows[{name}]", "shape": f"R={CAPACITY} span={n}B", **rep})
    # ---- swiglu_and_cast: bf16 gate_up [R, 2I] → fp8 [R, I] + fp32 scales, or bf16 [R, I]
    inter = shape.intermediate
    for r in SWIGLU_ROWS:
        gate_up = torch.randn(r, 2 * inter, generator=g).bfloat16()
        w = torch.rand(r, generator=g)
        for fmt in ("fp8", "bf16"):
            out_bytes = r * inter + r * (inter // GROUP) * 4 if fmt == "fp8" else r * inter * 2
            ideal = gate_up.numel() * 2 + w.numel() * 4 + out_bytes
            _, rep = interpreter.profile(
                swiglu_and_cast,
                gate_up,
                w,
                swiglu_limit=7.0,
                out_format=fmt,
                group_size=GROUP,
                fp8_max=240.0,
                ideal_hbm_bytes=ideal,
            )
            rows.append({"kernel": f"swiglu_and_cast[{fmt}]", "shape": f"R={r} I={inter}", **rep})
    return rows


def table(rows: list[dict]) -> str:
    head = (
        f"{'kernel':<22} {'shape':<22} {'est µs':>8} {'serial':>8} {'bound':>7} {'ideal µs':>9} "
        f"{'fraction':>8} {'DMAs':>5} {'small':>5} {'HBM KiB':>9} {'vec':>4} {'act':>4} {'SBUF KiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kernel']:<22} {r['shape']:<22} {r['time_s'] * 1e6:>8.2f} "
            f"{r['serial_s'] * 1e6:>8.2f} {r['bound']:>7} {r['ideal_s'] * 1e6:>9.2f} "
            f"{r['roofline_fraction']:>8.1%} {r['dma_count']:>5} "
            f"{r['small_dmas']:>5} "
            f"{r['hbm_bytes'] / 1024:>9.1f} {r['instructions'].get('vector', 0):>4} "
            f"{r['instructions'].get('scalar', 0):>4} {r['sbuf_peak_bytes'] / 1024:>8.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="v4_flash", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "nki_kernels.json")
    args = ap.parse_args(argv)
    if shim.real_nki_available():
        print(
            "note: a real nki is importable; these estimates still come from the interpreter's cost model "
            "(run with STATIC_MOE_NKI=interpreter)",
            file=sys.stderr,
        )
        return 1
    rows = run(args.shape)
    m = interpreter.TRN2
    print(
        f"NKI kernels at {MODEL_SHAPES[args.shape].name} decode shapes — estimated trn2 time (one NeuronCore-v3, "
        f"cost model: DMA {m.dma_bandwidth / 1e9:.0f} GB/s + {m.dma_fixed * 1e6:.1f} µs per DMA over "
        f"{m.dma_queues} queues, +{m.dge_fixed * 1e6:.1f} µs per DGE DMA; engines {m.instr_fixed_cycles} "
        f"cycles/instr + N (one input) / 2N (two inputs) cycles, GpSimd 32 bit/partition/cycle) vs the ideal HBM "
        f"time at {m.hbm_bandwidth_per_core / 1e9:.0f} GB/s per core. 'est' = overlapped (max of "
        f"engines/DMA/DGE), 'serial' = their sum, µs"
    )
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    keep = (
        "kernel",
        "shape",
        "time_s",
        "serial_s",
        "bound",
        "dma_s",
        "dge_s",
        "vector_s",
        "scalar_s",
        "gpsimd_s",
        "tensor_s",
        "ideal_s",
        "ideal_hbm_bytes",
        "roofline_fraction",
        "dma_count",
        "small_dmas",
        "hbm_bytes",
        "instructions",
        "sbuf_peak_bytes",
    )
    args.json.write_text(json.dumps([{k: r[k] for k in keep if k in r} for r in rows], indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
