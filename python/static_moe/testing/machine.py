"""The machine's own limits (docs/benchmarks.md), measured in the calling process: memory bandwidth from a STREAM-style
triad over arrays far beyond the last-level cache, compute from the best fp32 (and bf16) GFLOP/s of a large torch
matmul. Shared by the benchmarks (bench/harness.py) and the demo (static_moe.demo), so both report rooflines
against the same measurement.

Everything runs on the CPU with torch's current intra-op thread count (pin it first); tensors are torch CPU tensors.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def llc_bytes() -> int:
    """Size of the last-level cache in bytes (from sysfs; 32 MiB when it cannot be read)."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


@dataclass
class MachineLimits:
    """The machine's own limits, measured in this run on ``threads`` threads."""

    threads: int
    bandwidth: float  # bytes/s, STREAM triad (2 reads + 1 write counted, no write-allocate)
    flops: float  # FLOP/s, best fp32 torch matmul: the roofline's compute limit (docs/benchmarks.md)
    triad_array_bytes: int  # size of each of the three triad arrays
    llc_bytes: int
    matmul_n: int
    bf16_flops: float = 0.0  # FLOP/s, best bf16 torch matmul: what bf16 dot-product instructions reach (info)

    def best(self, other: "MachineLimits") -> "MachineLimits":
        """The higher of two measurements of each limit (contention from other processes only lowers them)."""
        return dataclasses.replace(self, bandwidth=max(self.bandwidth, other.bandwidth),
                                   flops=max(self.flops, other.flops), bf16_flops=max(self.bf16_flops, other.bf16_flops))


def measure_bandwidth(array_bytes: int, repeat: int = 5) -> float:
    """STREAM triad ``a = b + s·c`` over three float32 arrays of ``array_bytes`` each: best bytes/s (the three
    arrays' bytes counted)."""
    n = array_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # first touch: page faults are not bandwidth
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    return 3 * n * 4 / best


def measure_flops(n: int = 2048, repeat: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of an n×n×n torch matmul in ``dtype``."""
    x, y = torch.rand(n, n).to(dtype), torch.rand(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(x, y, out=out)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.mm(x, y, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure_machine(threads: int, *, quick: bool = False) -> MachineLimits:
    """Bandwidth and compute limits on the pinned thread count ``threads`` (recorded, not set). Triad arrays are
    ≥ 4× the LLC each (≥ 128 MiB; 16× LLC in all), so the triad streams from DRAM."""
    llc = llc_bytes()
    array_bytes = max(4 * llc, 128 << 20)
    n = 1024 if quick else 2048
    return MachineLimits(threads, measure_bandwidth(array_bytes), measure_flops(n), array_bytes, llc, n,
                         measure_flops(n, dtype=torch.bfloat16))
