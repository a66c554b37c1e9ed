"""Cost accounting of an interpreted kernel run, and a first-order trn2 time model.

The interpreter records, per run: every DMA (bytes, whether each side is HBM, the contiguous runs on each
side, the bytes per partition of the on-chip side, whether it needed descriptor generation at run time, and
its throughput efficiency) and every compute instruction (engine, partitions, elements per partition, model
cycles). :class:`CostModel` turns a record into an estimated time on one NeuronCore-v3.

Sources (aws-neuron-sdk, folder ``nki/``): the Trainium/Inferentia2 architecture guide
(``guides/architecture/trainium_inferentia2_arch.rst``, "TA2"), the Trainium2 guide
(``guides/architecture/trainium2_arch.rst``, "T2") and the isa stub (``api/nki/isa/__init__.py``).
Constants, with their source; ASSUMPTION where the docs give no figure:

- Clocks: TensorE 2.4 GHz, VectorE 0.96 GHz, ScalarE 1.2 GHz, GpSimd 1.2 GHz (T2, "Compute Engine
  Specifications"). SyncE (register instructions) 1.2 GHz: ASSUMPTION (not in the table).
- TensorE, per nc_matmul (isa._tensor_cycles): MultiplyMoving issue interval ``max(N, 64)`` cycles
  (TA2 Tensor Engine "Performance Consideration": ``max(N, MM_INIT_LATENCY)``, 64 cycles on v2 —
  ASSUMPTION that v3 keeps it); fp32 operands 4× (same section), 2× in transpose mode (T2 "Built-in Transpose
  Support"); fp8 at 2× only with ``double_row``, which contracts 256 rows in the time of 128 (T2 "Double FP8
  Matmul Performance"); fast LoadStationary = 1/4 of a MultiplyMoving of the same free size, in the
  background (TA2), so it binds only when M/4 > max(N, 64).
- VectorE / ScalarE (isa._vector_cycles): ~N cycles for one input tile, ~2N for two (TA2 Vector Engine "Cost
  Model"; ScalarE reads at most one tensor, TA2 Scalar Engine); VectorE performance mode 4× / 2× only in the
  cases T2 "Vector Engine Performance Mode" lists. GpSimd: 32 bits per partition per cycle (TA2 "Connectivity
  between GpSimdE and SBUF"), so N·itemsize/4 cycles per input.
- Fixed cost per Vector/Scalar/GpSimd instruction: ``instr_fixed_cycles = 60``: TA2 "Tensor access overhead":
  "a static overhead approximately 60 cycles" per tensor access request (the Vector cost model adds 100 for
  back-to-back dependent tiny instructions; 60 is the figure for independent ones). ASSUMPTION: not hidden.
- DMA: 16 queues per core (TA2 "Data movement between HBM and SBUF"; T2 "16x DMA engines"), sharing
  ``dma_bandwidth = 368 GB/s`` and a fixed ``dma_fixed = 1.3 µs`` per dma_copy, of which 16 run concurrently.
  ASSUMPTION for both figures: TA2 gives 27 GiB/s per engine (16 × 27 GiB/s = 464 GB/s peak) and "move 4 KiB
  or more per partition" but no per-transfer latency; 368 GB/s is ~80 % of that peak. Contiguous runs shorter
  than ``dma_min_efficient_run = 512 B`` are charged as 512 B (ASSUMPTION: descriptors move whole bursts; TA2
  only says small DMA buffers carry overhead).
  DMA transposes run at 90 % (HBM→SBUF) or 50 % (SBUF→SBUF) of DMA throughput (T2 "DMA Transpose").
- DGE: a DMA whose address is dynamic (``.ap(scalar_offset=...)`` / ``vector_offset``) or that asks for
  ``dge_mode=hwdge/swdge`` needs descriptor generation at run time: ``dge_fixed = 0.6 µs`` each (T2
  "Descriptor Generation Engine": "each DGE-based DMA instruction takes about 600 ns"), over
  ``dge_instances = 2`` instances per core (same section), reported as the ``dge`` component.
- Runtime-loop iterations: ``loop_iteration_s = 0.1 µs`` each (ASSUMPTION: sequencer branch + register
  update; no figure in the docs).

Overlap: engines, DMA queues and DGE run in parallel, so the **overlapped estimate** is
``time_s = max(component times)`` — a lower bound reached only by a perfectly pipelined kernel — and the
**serial bound** ``serial_s = Σ components`` the no-overlap upper bound; ``bound`` names the component that
binds the overlapped estimate. The HBM roofline for comparison is ``hbm_bytes / (2.9 TB/s / 8 cores)``
(T2 gives "3TB/s" per device; 2.9 TB/s is the figure the project's benchmarks use; 8 cores share it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "sync")
COMPONENTS = tuple(f"{e}_s" for e in ENGINES) + ("dma_s", "dge_s", "loop_s")


@dataclass
class DmaRecord:
    nbytes: int
    hbm_bytes: int  # bytes read from or written to HBM
    runs: int  # contiguous runs (the larger of the two sides)
    min_run_bytes: int
    partition_bytes: int  # bytes per partition on the on-chip side (0 for HBM↔HBM)
    dge: bool = False  # descriptors generated at run time (dynamic address / explicit DGE mode)
    efficiency: float = 1.0  # fraction of DMA throughput (DMA transposes: 0.9 / 0.5)


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
        c = elems_per_partition if cycles is None else cycles
        self.instr_count[engine] += 1
        self.instr_elems[engine] += elems_per_partition
        self.instr_cycles[engine] += c
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

    def merged(self, other: CostRecord) -> CostRecord:
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
    """trn2 (NeuronCore-v3) first-order timing; see the module docstring for every constant's source."""

    dma_bandwidth: float = 368e9  # B/s per core (ASSUMPTION, module docstring)
    dma_fixed: float = 1.3e-6  # s per dma_copy (ASSUMPTION, module docstring)
    dma_queues: int = 16  # per core (TA2, T2)
    dma_min_efficient_run: int = 512  # B (ASSUMPTION)
    dge_fixed: float = 0.6e-6  # s per runtime-descriptor DMA (T2 "Descriptor Generation Engine")
    dge_instances: int = 2  # per core (T2)
    hbm_bandwidth_per_core: float = 2.9e12 / 8  # B/s (2.9 TB/s per chip, 8 cores)
    clock_hz: dict = field(
        default_factory=lambda: {"tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9, "sync": 1.2e9}
    )
    instr_fixed_cycles: int = 60  # TA2 "Tensor access overhead"
    loop_iteration_s: float = 0.1e-6  # ASSUMPTION

    def dma_time(self, rec: CostRecord) -> float:
        if not rec.dmas:
            return 0.0
        eff = 0.0
        for d in rec.dmas:
            avg = d.nbytes / max(d.runs, 1)
            moved = d.nbytes if avg >= self.dma_min_efficient_run else d.runs * self.dma_min_efficient_run
            eff += moved / d.efficiency
        return eff / self.dma_bandwidth + math.ceil(len(rec.dmas) / self.dma_queues) * self.dma_fixed

    def dge_time(self, rec: CostRecord) -> float:
        n = sum(1 for d in rec.dmas if d.dge)
        return math.ceil(n / self.dge_instances) * self.dge_fixed

    def engine_times(self, rec: CostRecord) -> dict:
        out = {}
        for e in ENGINES:
            n = rec.instr_count.get(e, 0)
            if n:
                # TensorE's fixed cost is in its cycles (the max(N, 64) issue interval).
                fixed = 0 if e == "tensor" else self.instr_fixed_cycles
                out[e] = (rec.instr_cycles.get(e, 0.0) + n * fixed) / self.clock_hz[e]
        return out

    def estimate(self, rec: CostRecord) -> dict:
        """``{"time_s", "serial_s", "bound", "<engine>_s"..., "dma_s", "dge_s", "loop_s"}`` for one run:
        the overlapped estimate, the serial bound and the binding component (module docstring)."""
        eng = self.engine_times(rec)
        parts = {
            **{f"{k}_s": v for k, v in eng.items()},
            "dma_s": self.dma_time(rec),
            "dge_s": self.dge_time(rec),
            "loop_s": rec.loop_iterations * self.loop_iteration_s,
        }
        t = max(parts.values())
        bound = max(parts, key=parts.get)[:-2] if t > 0 else "none"
        return {"time_s": t, "serial_s": sum(parts.values()), **parts, "bound": bound}

    def hbm_roofline(self, hbm_bytes: int) -> float:
        """Ideal time to move ``hbm_bytes`` at this core's share of HBM bandwidth."""
        return hbm_bytes / self.hbm_bandwidth_per_core


TRN2 = CostModel()


def estimate(rec: CostRecord, model: CostModel = TRN2) -> dict:
    return model.estimate(rec)
