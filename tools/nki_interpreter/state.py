"""Interpreter state: the hardware target, its on-chip limits, and the context of the kernel being run
(live SBUF/PSUM allocations, the cost record, engine accumulators).

Target: ``trn2`` (NeuronCore-v3) by default; ``trn3`` (NeuronCore-v4) via :func:`set_target`, the
:func:`target` context manager, or the environment variable ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the same
variable the real NKI uses; ``gen3`` = trn2, ``gen4`` = trn3).

Capacities (per NeuronCore, 128 partitions):
- SBUF: the trn2 architecture guide (aws-neuron-sdk ``nki/guides/architecture/trainium2_arch.rst``,
  "NeuronCore-v3 Compute Engine Updates") gives 28 MiB = 128 × 224 KiB physical; trn3 has 128 × 256 KiB.
  Kernels may allocate the *usable* part, ``nl.tile_size.sbuf_fmax_bytes`` (page ``nki.language.tile_size``:
  "usable SBUF free dimension per partition, in bytes"). The page names the attribute but not its value; the
  value is the physical size less the runtime's reserved regions, which nki-library spells out as
  ``224 * 1024 - 16384 - 8`` (dynamic-DMA scratch and eval-accelerator reserve): **212984 B on trn2**,
  **245752 B on trn3** (256 KiB − 16392). Public trn2 kernels allocate up to that (their own budgets
  subtract a few hundred bytes more for an identity tile), so a lower budget (192 KiB, say) would refuse
  hardware-proven kernels.
- PSUM: 2 MiB = 128 × 16 KiB, 8 banks of 2 KiB (512 fp32) per partition (trn2 guide; the Trainium/Inferentia2
  guide, "Near-memory accumulation in PSUM"). ``nl.tile_size.psum_num_banks`` is 7 when the environment sets
  ``NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true`` (tile_size page). PSUM allocations are counted in whole banks
  (each allocation starts on a bank boundary) and a matmul output must lie inside one bank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import dataclass, field

from .errors import NkiRuleError

KiB = 1024
PMAX = 128


@dataclass(frozen=True)
class TargetSpec:
    name: str
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int = 16 * KiB
    psum_bank_bytes: int = 2 * KiB
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    sbuf_physical_bytes_per_partition: int = 224 * KiB
    fp8_e4m3fn_matmul: bool = False  # OCP e4m3fn as a matmul input: trn3 only
    scalar_bias_ok: bool = True  # activation(bias=<python scalar>): trn2 and later
    mx: bool = False  # nc_matmul_mx / quantize_mx and the x4 packed dtypes: NeuronCore-v4 only

    @property
    def psum_num_banks(self) -> int:
        banks = self.psum_bytes_per_partition // self.psum_bank_bytes
        # tile_size page: one bank is set aside when DMA transposes are lowered to PE transposes
        if os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true":
            banks -= 1
        return banks


# Reserved SBUF per partition (nki-library's MAX_AVAILABLE_SBUF_SIZE arithmetic): dynamic-DMA scratch + 8 B.
SBUF_RESERVED_BYTES = 16384 + 8

TARGETS = {
    "trn2": TargetSpec("trn2", sbuf_bytes_per_partition=224 * KiB - SBUF_RESERVED_BYTES),
    # trn3 (NeuronCore-v4): 256 KiB physical per partition; e4m3fn is a legal matmul input; MX matmul.
    "trn3": TargetSpec(
        "trn3",
        sbuf_bytes_per_partition=256 * KiB - SBUF_RESERVED_BYTES,
        sbuf_physical_bytes_per_partition=256 * KiB,
        fp8_e4m3fn_matmul=True,
        mx=True,
    ),
}
_ALIASES = {"trn2": "trn2", "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}

_target_name = _ALIASES.get(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower(), "trn2")


def set_target(name: str) -> None:
    """Select the hardware the interpreter checks against: ``"trn2"`` (default) or ``"trn3"``."""
    global _target_name
    if name.lower() not in _ALIASES:
        raise ValueError(f"unknown NKI target {name!r}; expected one of {sorted(_ALIASES)}")
    _target_name = _ALIASES[name.lower()]


def get_target() -> TargetSpec:
    return TARGETS[_target_name]


@contextlib.contextmanager
def target(name: str):
    """``with target("trn3"): ...`` — run kernels against another target, then restore the previous one."""
    global _target_name
    old = _target_name
    set_target(name)
    try:
        yield get_target()
    finally:
        _target_name = old


# ----------------------------------------------------------------------------------------------------------------
# On-chip memory accounting
# ----------------------------------------------------------------------------------------------------------------
class MemoryTracker:
    """Bytes per partition held by live SBUF and PSUM allocations of one kernel run.

    An allocation lives as long as some tensor (or view) refers to its storage — Python's reference counting
    stands in for the compiler's liveness analysis. Allocation fails with ``sbuf-capacity`` /
    ``psum-capacity`` when the live total per partition would exceed the target's budget.
    """

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.sbuf_live = 0
        self.psum_banks_live = 0
        self.sbuf_peak = 0
        self.psum_banks_peak = 0
        self._next = 0
        self._live: dict[int, tuple[str, int, str]] = {}

    def allocate(self, storage, buffer: str, bytes_per_partition: int, name: str) -> None:
        if buffer == "sbuf":
            budget = self.spec.sbuf_bytes_per_partition
            if self.sbuf_live + bytes_per_partition > budget:
                raise NkiRuleError(
                    "sbuf-capacity",
                    f"allocating {name or 'a tensor'} ({bytes_per_partition} B/partition) needs "
                    f"{self.sbuf_live + bytes_per_partition} B/partition of SBUF with the live allocations; "
                    f"the {self.spec.name} budget is {budget} B/partition. Live: {self._describe('sbuf')}",
                )
            self.sbuf_live += bytes_per_partition
            self.sbuf_peak = max(self.sbuf_peak, self.sbuf_live)
            amount = bytes_per_partition
        elif buffer == "psum":
            banks = -(-bytes_per_partition // self.spec.psum_bank_bytes)
            if self.psum_banks_live + banks > self.spec.psum_num_banks:
                raise NkiRuleError(
                    "psum-capacity",
                    f"allocating {name or 'a PSUM tensor'} ({bytes_per_partition} B/partition = {banks} bank(s) "
                    f"of {self.spec.psum_bank_bytes} B) with {self.psum_banks_live} of "
                    f"{self.spec.psum_num_banks} PSUM banks live. Live: {self._describe('psum')}",
                )
            self.psum_banks_live += banks
            self.psum_banks_peak = max(self.psum_banks_peak, self.psum_banks_live)
            amount = banks
        else:
            return
        key = self._next
        self._next += 1
        self._live[key] = (buffer, amount, name)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        buffer, amount, _ = self._live.pop(key, (None, 0, ""))
        if buffer == "sbuf":
            self.sbuf_live -= amount
        elif buffer == "psum":
            self.psum_banks_live -= amount

    def _describe(self, buffer: str) -> str:
        items = [f"{n or '?'}:{a}" for b, a, n in self._live.values() if b == buffer]
        return ", ".join(items[:12]) + (" …" if len(items) > 12 else "") if items else "none"


# ----------------------------------------------------------------------------------------------------------------
# The context of one kernel run
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class RunContext:
    spec: TargetSpec
    memory: MemoryTracker
    cost: object
    # Per-lane reduction accumulators of VectorE (tensor_scalar_reduce) and ScalarE (activation reduce).
    accumulators: dict = field(default_factory=dict)
    loop_depth: int = 0
    # runtime loops (fori_loop / while_loop) open now, and the deepest nesting seen in this run (RunInfo reports
    # it: public kernels never nest runtime loops, and our kernels' tests hold them to depth 1)
    runtime_loops: int = 0
    runtime_loop_depth_max: int = 0
    # LNC: this logical core's rank, the number of cores, and what the cores share (None with LNC = 1)
    program: int = 0
    programs: int = 1
    lnc: object = None


class _Stack(threading.local):
    """Run contexts per thread: under LNC = 2 each logical core runs in its own thread with its own SBUF,
    PSUM, accumulators and cost record."""

    def __init__(self):
        self.items: list[RunContext] = []
        self.outside = None  # the context used outside any run (rebuilt when the target changes)


_stack = _Stack()


def current() -> RunContext:
    """The context of the kernel being run; outside a run, a fresh default one (so tensors can be made in
    tests and REPLs without a kernel)."""
    items = _stack.items
    if not items or (items[-1] is _stack.outside and items[-1].spec is not get_target()):
        from .cost import CostRecord

        spec = get_target()
        if items:
            items.pop()
        _stack.outside = RunContext(spec, MemoryTracker(spec), CostRecord())
        items.append(_stack.outside)
    return items[-1]


@contextlib.contextmanager
def run_context(spec: TargetSpec | None = None, program: int = 0, programs: int = 1, lnc=None):
    from .cost import CostRecord

    spec = spec or get_target()
    ctx = RunContext(spec, MemoryTracker(spec), CostRecord(), program=program, programs=programs, lnc=lnc)
    _stack.items.append(ctx)
    try:
        yield ctx
    finally:
        _stack.items.remove(ctx)
