"""LNC = 2: two logical NeuronCores over one shared HBM, each with its own SBUF / PSUM (``kernel[2]``).

The runtime runs the kernel body once per core, in two threads (as ``nki.simulate(k[2])`` does, per the
simulator guide); :class:`LncGroup` is what they share: the ``shared_hbm`` allocations (the k-th allocation of
each core is the same tensor), a barrier, and the mailbox of :func:`sendrecv`. Both instructions are
NeuronCore-v3+ and LNC-only (isa stub); ranks are 0 or 1.

- ``sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine)``: every core sends its SBUF ``src``
  to ``send_to_rank`` and receives ``recv_from_rank``'s ``src`` into its ``dst`` (same dtype, shape and
  layout). Operations with the same ``pipe_id`` complete together: modelled as a rendezvous of both cores.
  ``dma_engine.gpsimd_dma`` limits the data per partition to 1024 / 512 / 256 bytes for 32 / 16 / 8-bit types.
- ``core_barrier(data, cores=(0, 1))``: both cores reach it before either goes on (shared-HBM writes before
  it are visible after it).

A core that never reaches the rendezvous its peer waits at makes the peer fail with ``lnc-deadlock`` after
``TIMEOUT_S`` seconds instead of hanging.

Between two barriers the cores are unordered, so both writing the same ``shared_hbm`` bytes there is a data race
(the ISA ``dma_copy`` page: accesses to the same offset are a hazard). Every DMA write into shared HBM is
recorded per core and per stretch between barriers; an overlap is refused with ``lnc-race`` at the next barrier
or at the end of the run — e.g. both cores accumulating into the same output rows.
"""

from __future__ import annotations

import threading

import numpy as np

from . import dtypes as dt
from .errors import NkiRuleError, check
from .state import current

TIMEOUT_S = 30.0


class LncGroup:
    """State shared by the logical cores of one ``kernel[2]`` launch."""

    def __init__(self, programs: int, timeout_s: float | None = None):
        self.programs, self.timeout_s = programs, TIMEOUT_S if timeout_s is None else timeout_s
        self.barrier = threading.Barrier(programs, timeout=timeout_s)
        self.lock = threading.Lock()
        self.mailbox: dict = {}
        self.shared: list = []  # the shared_hbm allocations, in allocation order
        self.counts = [0] * programs
        self.segment = [0] * programs  # barriers each core has passed
        self.writes: dict = {}  # (segment, program) -> {id(storage): (storage, written-byte mask)}

    def record_write(self, program: int, t) -> None:
        """Mark the shared-HBM bytes DMA destination ``t`` wrote (in-bounds rows only: skipped rows write nothing)."""
        st = t.storage
        inner = np.zeros(1, np.int64)
        for n, stride in zip(t.shape[1:], t.bstrides[1:]):
            inner = (inner[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
        if t.gather is not None:
            gather, _, nrows, idx = t.gather
            bases = np.array([g for g, k in zip(gather, idx) if 0 <= k < nrows], np.int64)
        else:
            bases = t.boffset + np.arange(t.shape[0] if t.shape else 1, dtype=np.int64) * (
                t.bstrides[0] if t.shape else 0
            )
        offs = (bases[:, None] + inner[None, :]).reshape(-1)
        offs = (offs[:, None] + np.arange(t._itemsize, dtype=np.int64)).reshape(-1)
        offs = offs[(offs >= 0) & (offs < st.nbytes)]
        with self.lock:
            d = self.writes.setdefault((self.segment[program], program), {})
            if id(st) not in d:
                d[id(st)] = (st, np.zeros(st.nbytes, bool))
            d[id(st)][1][offs] = True

    def check_races(self, segment: int) -> None:
        with self.lock:
            a, b = self.writes.get((segment, 0), {}), self.writes.get((segment, 1), {})
            for k in a.keys() & b.keys():
                both = np.flatnonzero(a[k][1] & b[k][1])
                check(
                    both.size == 0,
                    "lnc-race",
                    f"both logical cores write bytes {int(both[0]) if both.size else 0}… ({both.size} bytes) of "
                    f"shared_hbm tensor {a[k][0].name or ''} between the same barriers: unordered writes of the "
                    f"same bytes are a data race (order them with core_barrier, or split the bytes)",
                )

    def shared_allocation(self, program: int, shape, dtype, name: str):
        from .tensor import NkiTensor, Storage, shared_hbm

        with self.lock:
            k = self.counts[program]
            self.counts[program] += 1
            if k == len(self.shared):
                st = Storage(shared_hbm, shape, dtype, name)
                st.poison(dtype)
                self.shared.append(st)
            st = self.shared[k]
        check(
            st.shape == tuple(shape) and st.dtype == dtype,
            "lnc-shared",
            f"shared_hbm allocation #{k} is {dt.name(st.dtype)}{list(st.shape)} on one core and "
            f"{dt.name(dtype)}{list(shape)} on the other; both cores must allocate shared tensors alike",
        )
        return NkiTensor._full(st, dtype, st.shape)

    def wait(self, what: str) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise NkiRuleError(
                "lnc-deadlock",
                f"{what}: the other logical core did not reach the matching "
                f"{what} within {self.timeout_s:g} s (or failed)",
            ) from None


def _group(instr: str) -> LncGroup:
    ctx = current()
    check(ctx.lnc is not None, "lnc", f"nisa.{instr} needs an LNC = 2 launch (kernel[2])")
    check(ctx.spec.name != "trn1", "target", f"nisa.{instr} needs NeuronCore-v3 or newer")
    return ctx.lnc


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    from .isa import _enum, _record_dma, _store_raw
    from .isa import dma_engine as dma_engine_cls
    from .tensor import NkiTensor

    instr = "sendrecv"
    g = _group(instr)
    ctx = current()
    engine = _enum(dma_engine_cls.dma if dma_engine is None else dma_engine, dma_engine_cls, "dma_engine")
    for what, t in (("src", src), ("dst", dst)):
        check(
            isinstance(t, NkiTensor) and t.buffer.name == "sbuf",
            "operand-buffer",
            f"{instr}: {what} must be an SBUF tile",
        )
    check(
        src.dtype == dst.dtype and src.shape == dst.shape,
        "shape-mismatch",
        f"{instr}: src and dst need the same dtype and shape, got {dt.name(src.dtype)}{list(src.shape)} and "
        f"{dt.name(dst.dtype)}{list(dst.shape)}",
    )
    for what, r in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        check(r in range(g.programs), "lnc", f"{instr}: {what} must be 0 or 1, got {r!r}")
    if engine == dma_engine_cls.gpsimd_dma:
        limit = {4: 1024, 2: 512, 1: 256}[src._itemsize]
        check(
            src._free_size * src._itemsize <= limit,
            "free-size",
            f"{instr}: gpsimd_dma moves at most {limit} bytes per partition of a {8 * src._itemsize}-bit type",
        )
    with g.lock:
        g.mailbox[(ctx.program, send_to_rank, pipe_id)] = np.array(src._np())
    g.wait(instr)
    with g.lock:
        got = g.mailbox.pop((recv_from_rank, ctx.program, pipe_id), None)
    check(
        got is not None, "lnc", f"{instr}: core {recv_from_rank} sent nothing to core {ctx.program} on pipe {pipe_id}"
    )
    _store_raw(dst, got)
    g.wait(instr)
    _record_dma(src, dst, dge=False)


def core_barrier(data, cores=(0, 1), engine=None, name=None):
    from .tensor import NkiTensor

    instr = "core_barrier"
    g = _group(instr)
    check(tuple(cores) == (0, 1), "lnc", f"{instr}: only cores=(0, 1) is supported, got {cores!r}")
    check(
        isinstance(data, NkiTensor) and data.buffer.name == "shared_hbm",
        "operand-buffer",
        f"{instr}: data must be a shared_hbm tensor (what both cores synchronise on)",
    )
    g.wait(instr)
    ctx = current()
    g.check_races(g.segment[ctx.program])
    g.segment[ctx.program] += 1
    ctx.cost.instr("gpsimd", instr, 1, 1)
    ctx.cost.mark()
