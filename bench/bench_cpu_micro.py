"""Micro-benchmark of the avx512bf16 expert GEMM's parts (bench/micro/fp4_gemv.cpp): which resource binds the
one-row, the 4-row and the 16/64-row GEMMs, each figure a ratio of two measurements taken in the same process.

Builds the torch-free driver with the project's kernels (g++, -O3, the default baseline-x86-64 build of
csrc/cpu/kernels/expert_gemm*.cpp, as setup.py compiles them) into build/micro/, runs it and prints what it measured
and the ratios docs/backends/cpu.md quotes:
  - one row: the fp4 decode rate alone (hot, per core, times the thread count) against the cold read-only stream on
    the same threads, and the kernel's cold weight GB/s (fp4 and fp8 weights) against that stream;
  - 4 / 16 / 64 rows: the kernel's hot GFLOP/s (one core, weights in L2) against the vdpbf16ps issue peak of one
    core, for fp4, fp8 and bf16 weights (bf16 weights: the same kernel without any decode).

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_cpu_micro.py [--reps 7] [--n 4096 --k 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness import native

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "bench" / "micro" / "fp4_gemv.cpp"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(out_dir: Path) -> Path:
    """Compile the driver (about 20 s on one core); returns the binary's path."""
    compiler = native.cxx("bench_cpu_micro")
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / "fp4_gemv"
    kernels = [str(p) for p in native.kernel_sources(ROOT / "csrc")]
    cmd = [compiler, *native.CXX_FLAGS, f"-I{ROOT / 'csrc'}", str(SOURCE), *kernels, "-o", str(binary)]
    subprocess.run(cmd, check=True)
    return binary


def run(binary: Path, n: int, k: int, reps: int, threads: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([str(binary), str(n), str(k), str(reps)], check=True, capture_output=True, text=True, env=env)
    rows = []
    for line in out.stdout.splitlines():
        name, t, m, value, unit = line.split()
        rows.append({"name": name, "threads": int(t), "rows": int(m), "value": float(value), "unit": unit})
    return rows


def ratios(rows: list[dict], threads: int) -> list[tuple[str, float]]:
    """The derived figures: (what, ratio)."""
    v = {(r["name"], r["threads"], r["rows"]): r["value"] for r in rows}
    out = []
    read = v.get(("read_cold", threads, 0))
    dec = v.get(("decode_hot", 1, 0))
    if read and dec:
        out.append(
            (
                f"one row: fp4 decode alone ({dec:.1f} GB/s per core, hot) × {threads} threads / cold read stream "
                f"({read:.1f} GB/s)",
                dec * threads / read,
            )
        )
    for fmt in ("fp4", "fp8"):
        got = v.get((f"kernel_{fmt}_cold", threads, 1))
        if read and got:
            out.append(
                (
                    f"one row: {fmt} kernel cold weight GB/s ({got:.1f}) / cold read stream, {threads} threads",
                    got / read,
                )
            )
    peak = v.get(("dpbf16_peak", 1, 0))
    for m in (4, 16, 64):
        for fmt in ("fp4", "fp8", "bf16w"):
            g = v.get((f"kernel_{fmt}_hot", 1, m))
            if peak and g:
                out.append(
                    (
                        f"{m} rows: {fmt} kernel hot ({g:.0f} GFLOP/s) / vdpbf16ps peak of one core ({peak:.0f})",
                        g / peak,
                    )
                )
    d1, d2 = v.get(("decode_hot_ns_per_unit", 1, 0)), v.get(("decode_v2_hot_ns_per_unit", 1, 0))
    if d1 and d2:
        out.append(
            ("decode alone: the kernel's one-block decode / the 64-weight candidate (v2), time per 32 weights", d1 / d2)
        )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=4096, help="weight rows of the expert (V4-Flash w13: 4096)")
    p.add_argument("--k", type=int, default=4096, help="K (V4-Flash hidden: 4096)")
    p.add_argument("--reps", type=int, default=7, help="runs per figure; the best is kept")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--json", default=None, help="write the measurements and ratios here")
    args = p.parse_args(argv)
    missing = {"avx512f", "avx512bw", "avx512_bf16", "avx512vbmi"} - cpu_flags()
    if missing:
        print(f"bench_cpu_micro: this CPU lacks {sorted(missing)}; the micro-benchmark times the avx512bf16 path only")
        return
    binary = build(ROOT / "build" / "micro")
    rows = run(binary, args.n, args.k, args.reps, args.threads)
    print(f"fp4_gemv N={args.n} K={args.k}, best of {args.reps}, up to {args.threads} threads:")
    for r in rows:
        print(f"  {r['name']:<38} threads={r['threads']} rows={r['rows']:<3} {r['value']:>9.4g} {r['unit']}")
    print("ratios (same process):")
    derived = ratios(rows, args.threads)
    for what, x in derived:
        print(f"  {what}: {x:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratios": derived}, indent=1))
        print(f"wrote {args.json}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
