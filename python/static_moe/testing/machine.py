"""The machine's own limits (docs/benchmarks.md), measured in the calling process: memory bandwidth from a STREAM-style
triad over arrays far beyond the last-level cache (reads and writes: the roof for activations and results), the
read-only bandwidth from a reduction over one such array (the roof for weights, which a kernel only streams in),
compute from the best fp32 (and bf16) GFLOP/s of a large torch matmul. Shared by the benchmarks (bench/harness/)
and the demo (static_moe.demo), so both report rooflines against the same measurement.

Everything runs on the CPU with torch's current intra-op thread count (pin it first); tensors are torch CPU tensors.
"""

from __future__ import annotations

import dataclasses
import math
import os
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
    bf16_flops: float = 0.0  # FLOP/s, best bf16 torch matmul: the compute limit of kernels using bf16 dot products
    read_bandwidth: float = 0.0  # bytes/s, read-only stream (a sum over read_array_bytes): the limit for weights
    read_array_bytes: int = 0

    def best(self, other: MachineLimits) -> MachineLimits:
        """The higher of two measurements of each limit (contention from other processes only lowers them)."""
        return dataclasses.replace(
            self,
            bandwidth=max(self.bandwidth, other.bandwidth),
            flops=max(self.flops, other.flops),
            bf16_flops=max(self.bf16_flops, other.bf16_flops),
            read_bandwidth=max(self.read_bandwidth, other.read_bandwidth),
        )

    def weight_bandwidth(self) -> float:
        """The roof for bytes that are only read (weights): the read-only stream, never below the triad (a stream
        that only reads cannot be slower than one that also writes; a lower figure means the sum did not keep
        enough reads in flight, and would make the roof too easy to reach)."""
        return max(self.read_bandwidth, self.bandwidth)


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


def measure_read_bandwidth(array_bytes: int, repeat: int = 5) -> float:
    """Read-only stream: ``torch.sum`` over one float32 array of ``array_bytes`` (far beyond the LLC, so every
    byte comes from DRAM; the sum's adds cost far less than the bytes): best bytes/s, the array's bytes counted.
    This is what a kernel that streams weights in and writes little can reach, unlike a copy or triad whose
    writes (and write-allocate reads) share the memory bus."""
    x = torch.rand(array_bytes // 4)
    x.sum()  # first touch done by rand; one warm call for the reduction's own buffers
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def bf16_dot_products(act_fmt: str, pow2_scale: bool = True) -> bool:
    """Whether the CPU kernels multiply rows of ``act_fmt`` activations with bf16 dot products (vdpbf16ps, or AMX
    tiles) here, so that their compute roof is the bf16 matmul peak: the avx512bf16 or amx instruction set
    (csrc/cpu/simd.h: AVX-512 F/BW/DQ/VL + BF16 + VBMI, not forced lower by STATIC_MOE_CPU_ISA) and rows exact in
    bf16 (bf16 activations, or fp8 with power-of-two scales). Any weight format."""
    forced = os.environ.get("STATIC_MOE_CPU_ISA", "")
    if forced not in ("", "auto", "avx512bf16", "amx"):
        return False
    try:
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    except OSError:
        return False
    need = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512vbmi"}
    return need <= set(flags) and (act_fmt == "bf16" or (act_fmt == "fp8" and pow2_scale))


def cpu_isa_available(isa: str) -> bool:
    """Whether the CPU kernels accept ``STATIC_MOE_CPU_ISA=isa`` here (csrc/cpu/simd.h refuses a set this CPU, or
    the OS, lacks): one tiny expert_gemm call under it."""
    import static_moe  # noqa: F401  (registers the ops)

    old = os.environ.get("STATIC_MOE_CPU_ISA")
    os.environ["STATIC_MOE_CPU_ISA"] = isa
    try:
        torch.ops.static_moe.expert_gemm(
            torch.zeros(1, 128, dtype=torch.bfloat16),
            None,
            torch.zeros(1, 16, 128, dtype=torch.bfloat16),
            None,
            torch.ones(1, dtype=torch.bool),
            0,
        )
        return True
    except ValueError as e:
        if "lacks" in str(e):
            return False
        raise
    finally:
        if old is None:
            del os.environ["STATIC_MOE_CPU_ISA"]
        else:
            os.environ["STATIC_MOE_CPU_ISA"] = old


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
    ≥ 4× the LLC each (≥ 128 MiB; 16× LLC in all), so the triad streams from DRAM; the read-only array is 3× one
    triad array (the same bytes per measurement)."""
    llc = llc_bytes()
    array_bytes = max(4 * llc, 128 << 20)
    n = 1024 if quick else 2048
    return MachineLimits(
        threads,
        measure_bandwidth(array_bytes),
        measure_flops(n),
        array_bytes,
        llc,
        n,
        measure_flops(n, dtype=torch.bfloat16),
        measure_read_bandwidth(3 * array_bytes),
        3 * array_bytes,
    )
