"""One-row bf16 GEMV: vLLM's CPU panel weight layout against static_moe's kernel (bench/micro/panel_gemv.cpp).

At one activation row both kernels stream the weights once; vLLM's "vec" kernel reads them as [N/16, K, 16] panels
(one contiguous run per 16 output columns), static_moe's avx512bf16 kernel as [N, K] rows, 4 at a time. This builds
the torch-free driver with the project's kernels into build/micro/ and prints, per shape, the weight GB/s of a plain
read stream, of static_moe's kernel, of panel GEMVs over 1, 2 and 4 panels at a time and of static_moe's own one-row
arithmetic over its weights stored in blocks of 4 rows interleaved by 32-k unit (one stream; bitwise the kernel's
result, checked), cold, one thread, and the ratios to the kernel (docs/vllm.md quotes them). The panel kernels sum in another order than static_moe's (their
results are checked to bf16 rounding), so they measure the layout, not a drop-in replacement.

    .venv/bin/python bench/bench_panel_gemv.py [--shapes 2048x768 1536x2048 4096x4096] [--reps 9] [--huge-pages]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench_cpu_micro import cpu_flags
from harness import native

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "bench" / "micro" / "panel_gemv.cpp"


def build(out_dir: Path) -> Path:
    """Compile the driver with the project's kernels (about 20 s on one core); returns the binary's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / "panel_gemv"
    kernels = [str(p) for p in native.kernel_sources(ROOT / "csrc")]
    cmd = [native.cxx("bench_panel_gemv"), *native.CXX_FLAGS, f"-I{ROOT / 'csrc'}", str(SOURCE), *kernels]
    subprocess.run([*cmd, "-o", str(binary)], check=True)
    return binary


def measure(binary: Path, n: int, k: int, reps: int, huge_pages: bool = False) -> dict[str, float]:
    """{contender: weight GB/s} for one [n, k] expert matrix; huge_pages: glibc's malloc advises its large blocks
    for transparent huge pages (GLIBC_TUNABLES glibc.malloc.hugetlb=1, glibc >= 2.35), as StaticMoE's weights are
    (static_moe.host_memory)."""
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1") if huge_pages else None
    cmd = [str(binary), str(n), str(k), str(reps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return {name: float(value) for name, _, _, value, _ in (line.split() for line in out.stdout.splitlines())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=["2048x768", "1536x2048", "4096x4096"], help="NxK of the weight")
    p.add_argument("--reps", type=int, default=9, help="alternating rounds; each contender keeps its best")
    p.add_argument("--huge-pages", action="store_true", help="weights in transparent huge pages (glibc tunable)")
    args = p.parse_args(argv)
    missing = {"avx512f", "avx512bw", "avx512_bf16"} - cpu_flags()
    if missing:
        print(f"bench_panel_gemv: this CPU lacks {sorted(missing)}; the panel kernels need AVX-512 BF16")
        return
    binary = build(ROOT / "build" / "micro")
    pages = "huge pages" if args.huge_pages else "4 KiB pages"
    print(f"one-row bf16 GEMV, weights cold in {pages}, one thread, best of {args.reps} alternating rounds (GB/s)")
    names = ("read", "kernel", "panel1", "panel2", "panel4", "rows4")
    print(f"  {'N x K':>11}" + "".join(f"{c:>8}" for c in names) + "  panel1 / kernel  rows4 / kernel")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        g = measure(binary, n, k, args.reps, args.huge_pages)
        cells = "".join(f"{g[c]:>8.1f}" for c in names)
        print(f"  {shape:>11}{cells}  {g['panel1'] / g['kernel']:>15.2f}  {g['rows4'] / g['kernel']:>14.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
