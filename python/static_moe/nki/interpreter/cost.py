"""Cost accounting of an interpreted kernel run, and a first-order trn2 time model.

The interpreter records, per run: every DMA (bytes, whether each side is HBM, the contiguous runs on each
side and the bytes per partition of the on-chip side) and every compute instruction (engine, partitions,
elements per partition, dtypes). :class:`CostModel` turns a record into an estimated time on one NeuronCore.

Model (figures: ``/work/shared/docs/NKI_NOTES.md`` "Capacities" and the trn2 architecture guide,
aws-neuron-sdk ``nki/guides/architecture/trainium2_arch.rst``):

- DMA: 16 queues per core sharing ``dma_bandwidth = 368 GB/s``; each ``dma_copy`` has a fixed cost of
  ``dma_fixed = 1.3 µs``. Queues overlap, so the fixed costs of up to 16 DMAs run concurrently:
  ``t_dma = Σ bytes / 368 GB/s + ceil(n_dma / 16) · 1.3 µs``. Small contiguous runs cost extra: every
  contiguous run shorter than ``dma_min_efficient_run = 512 B`` is charged as if it were 512 B (DMA
  descriptors move whole bursts), so byte-scattered transfers show up.
- TensorE (2.4 GHz): one moving column per cycle for bf16/fp16/fp8 (fp8 at double rate only with
  ``perf_mode=double_row``, which contracts 256 rows in the same time); fp32 operands at 1/4 rate
  (20 vs 79 TFLOPS). ``t = (N + fixed) / 2.4 GHz`` per matmul / transpose.
- VectorE (0.96 GHz), ScalarE (1.2 GHz), GpSimd (1.2 GHz): one element per partition per cycle, i.e. the
  elements per partition of the instruction, plus a fixed ``instr_fixed_cycles = 64`` per instruction
  (ASSUMPTION: the docs give no figure; it reflects the usual ~60-cycle static overhead quoted for
  NeuronCore instructions, and it is why tiny instructions are not free). VectorE's bf16/fp16 performance
  mode (SBUF-only, contiguous) runs tensor_copy / tensor_scalar 4× and tensor_tensor 2× faster.
- Runtime-loop iterations cost ``loop_iteration_s = 0.1 µs`` each (ASSUMPTION: sequencer branch + register
  update; no figure in the docs).
- Engines and DMA queues run in parallel: ``estimate = max(engine times, t_dma)`` (perfect overlap — a lower
  bound on a well-pipelined kernel); ``serial = Σ`` of all of them is the no-overlap upper bound.

The HBM roofline for comparison is ``hbm_bytes / (2.9 TB/s / 8 cores)`` (chip bandwidth shared by 8 cores).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "sync")


@dataclass
class DmaRecord:
    nbytes: int
    hbm_bytes: int  # bytes read from or written to HBM
    runs: int  # contiguous runs (the larger of the two sides)
    min_run_bytes: int
    partition_bytes: int  # bytes per partition on the on-chip side (0 for HBM↔HBM)


@dataclass
class CostRecord:
    """What one kernel run did. Counters are filled by the interpreter as instructions execute."""

    dmas: list = field(default_factory=list)
    instr_count: dict = field(default_factory=lambda: defaultdict(int))  # engine -> instructions
    instr_elems: dict = field(default_factory=lambda: defaultdict(int))  # engine -> Σ elements per partition
    instr_cycles: dict = field(default_factory=lambda: defaultdict(float))  # engine -> model cycles (no fixed)
    by_name: dict = field(default_factory=lambda: defaultdict(int))  # "engine.instruction" -> count
    loop_iterations: int = 0
    matmul_flops: int = 0

    # --------------------------------------------------------------------------------------------- recording
    def instr(self, engine: str, name: str, partitions: int, elems_per_partition: int, cycles: float | None = None):
        self.instr_count[engine] += 1
        self.instr_elems[engine] += elems_per_partition
        self.instr_cycles[engine] += elems_per_partition if cycles is None else cycles
        self.by_name[f"{engine}.{name}"] += 1

    def dma(self, rec: DmaRecord) -> None:
        self.dmas.append(rec)

    def loop_iteration(self) -> None:
        self.loop_iterations += 1

    # ---------------------------------------------------------------------------------------------- totals
    @property
    def dma_bytes(self) -> int:
        return sum(d.nbytes for d in self.dmas)

    @property
    def hbm_bytes(self) -> int:
        return sum(d.hbm_bytes for d in self.dmas)

    @property
    def dma_count(self) -> int:
        return len(self.dmas)

    def small_dmas(self, min_partition_bytes: int = 2048) -> int:
        """DMAs whose on-chip side moves less than ``min_partition_bytes`` per partition."""
        return sum(1 for d in self.dmas if 0 < d.partition_bytes < min_partition_bytes)

    def summary(self) -> dict:
        return {
            "dma_count": self.dma_count,
            "dma_bytes": self.dma_bytes,
            "hbm_bytes": self.hbm_bytes,
            "small_dmas": self.small_dmas(),
            "instructions": dict(self.instr_count),
            "elements": dict(self.instr_elems),
            "by_name": dict(self.by_name),
            "loop_iterations": self.loop_iterations,
            "matmul_flops": self.matmul_flops,
        }

    def merged(self, other: "CostRecord") -> "CostRecord":
        out = CostRecord()
        for r in (self, other):
            out.dmas.extend(r.dmas)
            for k, v in r.instr_count.items():
                out.instr_count[k] += v
            for k, v in r.instr_elems.items():
                out.instr_elems[k] += v
            for k, v in r.instr_cycles.items():
                out.instr_cycles[k] += v
            for k, v in r.by_name.items():
                out.by_name[k] += v
            out.loop_iterations += r.loop_iterations
            out.matmul_flops += r.matmul_flops
        return out


@dataclass(frozen=True)
class CostModel:
    """trn2 (NeuronCore-v3) first-order timing; see the module docstring for the sources and assumptions."""

    dma_bandwidth: float = 368e9  # B/s per core (NKI_NOTES)
    dma_fixed: float = 1.3e-6  # s per dma_copy (NKI_NOTES)
    dma_queues: int = 16  # per core (NKI_NOTES)
    dma_min_efficient_run: int = 512  # B (ASSUMPTION)
    hbm_bandwidth_per_core: float = 2.9e12 / 8  # B/s (NKI_NOTES: 2.9 TB/s per chip, 8 cores)
    clock_hz: dict = field(default_factory=lambda: {
        "tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9, "sync": 1.2e9})
    instr_fixed_cycles: int = 64  # ASSUMPTION
    loop_iteration_s: float = 0.1e-6  # ASSUMPTION

    def dma_time(self, rec: CostRecord) -> float:
        if not rec.dmas:
            return 0.0
        eff = 0
        for d in rec.dmas:
            avg = d.nbytes / max(d.runs, 1)
            eff += d.nbytes if avg >= self.dma_min_efficient_run else d.runs * self.dma_min_efficient_run
        return eff / self.dma_bandwidth + math.ceil(len(rec.dmas) / self.dma_queues) * self.dma_fixed

    def engine_times(self, rec: CostRecord) -> dict:
        out = {}
        for e in ENGINES:
            n = rec.instr_count.get(e, 0)
            if n:
                out[e] = (rec.instr_cycles.get(e, 0.0) + n * self.instr_fixed_cycles) / self.clock_hz[e]
        return out

    def estimate(self, rec: CostRecord) -> dict:
        """``{"time_s", "serial_s", "dma_s", "<engine>_s"..., "loop_s", "bound"}`` for one run."""
        eng = self.engine_times(rec)
        dma = self.dma_time(rec)
        loop = rec.loop_iterations * self.loop_iteration_s
        parts = {**{f"{k}_s": v for k, v in eng.items()}, "dma_s": dma, "loop_s": loop}
        t = max([dma, loop, *eng.values()])
        bound = max(parts, key=parts.get)[:-2] if parts else "none"
        return {"time_s": t, "serial_s": sum(parts.values()), **parts, "bound": bound}

    def hbm_roofline(self, hbm_bytes: int) -> float:
        """Ideal time to move ``hbm_bytes`` at this core's share of HBM bandwidth."""
        return hbm_bytes / self.hbm_bandwidth_per_core


TRN2 = CostModel()


def estimate(rec: CostRecord, model: CostModel = TRN2) -> dict:
    return model.estimate(rec)
