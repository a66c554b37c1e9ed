"""This tree's CPU expert-GEMM kernels against another git revision's, timed alternately in one process.

On a shared host two separate runs of the same binary differ by 10-30 %; a kernel change worth 10 % cannot be seen
that way. bench/micro/kernel_ab.cpp links both builds (the other one compiled with -Dstatic_moe=static_moe_b, so
its symbols do not clash) and times them round after round on the same weights and activation rows, keeping each
one's best. Bf16 activation rows, fp4 / fp8 / bf16 weights at 1, 4, 16 and 64 rows, on the avx512bf16 path or the
one --isa names.

    .venv/bin/python bench/bench_kernel_ab.py --rev HEAD~1                   # one core, weights in L3 (N = K = 4096)
    .venv/bin/python bench/bench_kernel_ab.py --rev 213f471 --threads 2 --cold  # two cores, weights from DRAM
    .venv/bin/python bench/bench_kernel_ab.py --rev HEAD --n 64                # one core, weights in L2
    .venv/bin/python bench/bench_kernel_ab.py --rev HEAD --n 2048 --k 768 --stream  # a layer's stream of experts
    .venv/bin/python bench/bench_kernel_ab.py --rev HEAD --isa avx512          # the fp32-FMA path

The other revision must share this tree's ExpertWeight and OutRows layout (csrc/cpu/kernels/expert_gemm.h).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from harness import native

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "bench" / "micro"


def _export(rev: str, dest: Path) -> Path:
    """The csrc/ tree of `rev` under dest; returns its csrc folder."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = dest / sha
    if not (tree / "csrc").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as tmp:
            subprocess.run(["git", "-C", str(ROOT), "archive", sha, "csrc"], check=True, stdout=tmp)
            tmp.seek(0)
            with tarfile.open(fileobj=tmp) as tar:
                tar.extractall(tree, filter="data")
    return tree / "csrc"


def build(rev: str, out_dir: Path) -> Path:
    """Both builds into one binary (about a minute on two cores); returns its path."""
    cxx = native.cxx("bench_kernel_ab")
    flags = native.CXX_FLAGS
    other = _export(rev, out_dir / "src")
    objs = out_dir / f"obj_{other.parent.name}"
    objs.mkdir(parents=True, exist_ok=True)
    sources = [MICRO / "kernel_ab_entry.cpp", *native.kernel_sources(other)]
    jobs = []
    for src in sources:
        obj = objs / (src.stem + ".o")
        jobs.append(
            (
                obj,
                subprocess.Popen(
                    [cxx, *flags, "-Dstatic_moe=static_moe_b", f"-I{other}", "-c", str(src), "-o", str(obj)]
                ),
            )
        )
    for obj, proc in jobs:
        if proc.wait() != 0:
            raise SystemExit(f"bench_kernel_ab: compiling {obj.name} of {rev} failed")
    binary = out_dir / f"kernel_ab_{other.parent.name}"
    ours = [str(p) for p in native.kernel_sources(ROOT / "csrc")]
    subprocess.run(
        [
            cxx,
            *flags,
            f"-I{ROOT / 'csrc'}",
            str(MICRO / "kernel_ab.cpp"),
            *ours,
            *sorted(str(o) for o in objs.glob("*.o")),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rev", default="HEAD", help="the git revision to compare this tree with (default HEAD)")
    p.add_argument("--n", type=int, default=4096, help="weight rows (V4-Flash w13: 4096)")
    p.add_argument("--k", type=int, default=4096, help="K (V4-Flash hidden: 4096)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--cold",
        action="store_true",
        help="rewrite twice the L3 (at least 128 MiB) before every call: weights from DRAM",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="cycle each call through distinct experts filling 256 MiB, no flush: weights from DRAM as in a "
        "layer (a flush's dirty lines cost small GEMMs write-backs a layer does not pay)",
    )
    p.add_argument("--rounds", type=int, default=10, help="alternations; each build keeps its best")
    p.add_argument(
        "--isa",
        default="avx512bf16",
        choices=["avx512bf16", "amx", "avx512", "avx2", "scalar"],
        help="the kernel path both builds run (default avx512bf16)",
    )
    p.add_argument(
        "--weights",
        nargs="+",
        choices=["fp4", "fp8", "fp8p2", "bf16"],
        help="weight formats to time (default all; fp8: float32 scales, fp8p2: power-of-two ones)",
    )
    args = p.parse_args(argv)
    binary = build(args.rev, ROOT / "build" / "ab")
    out = subprocess.run(
        [
            str(binary),
            str(args.n),
            str(args.k),
            str(args.threads),
            str(2 if args.stream else int(args.cold)),
            str(args.rounds),
            args.isa,
            ",".join(args.weights or []),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    where = "streamed from DRAM (distinct experts)" if args.stream else "from DRAM" if args.cold else "warm"
    print(
        f"this tree (a) vs {args.rev} (b), {args.isa}: N={args.n} K={args.k}, {args.threads} thread(s), "
        f"weights {where}, best of {args.rounds} alternate rounds"
    )
    print(f"  {'weights':<8}{'rows':>5}{'a GFLOP/s':>12}{'b GFLOP/s':>12}{'time a / b':>12}")
    for line in out.stdout.splitlines():
        fmt, m, ga, gb, ratio = line.split()
        print(f"  {fmt:<8}{m:>5}{float(ga):>12.1f}{float(gb):>12.1f}{float(ratio):>12.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
