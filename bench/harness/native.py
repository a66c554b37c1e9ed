"""Building the C++ micro-benchmark drivers (bench/micro/): the compiler, the flags and the expert-GEMM kernel
sources they link, shared by bench_cpu_micro.py and bench_kernel_ab.py so that both time the same build."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# No -march: each kernel source picks its instruction set with #pragma GCC target, as the extension's build does.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]


def cxx(who: str) -> str:
    """$CXX or g++; SystemExit naming ``who`` where there is none."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise SystemExit(f"{who}: no C++ compiler ({compiler})")
    return compiler


def kernel_sources(csrc: Path) -> list[Path]:
    """The expert-GEMM kernel sources (one per ISA) under a csrc/ folder, sorted."""
    return sorted((csrc / "cpu" / "kernels").glob("expert_gemm*.cpp"))
