"""``nki.isa`` for the interpreter: destination-first instructions on SBUF / PSUM / HBM tensors.

Every instruction checks the operand rules before it touches memory (partition dims, buffers, dtypes,
engine restrictions, matmul limits), computes like the hardware does (Vector/Scalar/GpSimd convert inputs to
fp32 and cast to ``dst.dtype``; bitvec ops work on raw integer bits; DMA between different dtypes converts
values through fp32, DMA between equal dtypes moves bytes) and records its cost.

Casting to ``dst.dtype``: floats round to nearest even (ml_dtypes); a finite value that would overflow an
fp8/bf16/fp16 destination is rejected (``cast-overflow``: clamp before casting — the hardware behaviour is
undocumented and the simulator's ml_dtypes cast gives inf/NaN); float → int rounds to nearest even and
saturates (NKI 0.6 semantics), NaN → 0.

Lanes: Vector/Scalar/GpSimd instructions map each partition of a source to one partition of the
destination, and may shift partitions within the documented limits (Trainium/Inferentia2 architecture guide,
"Accessing SBUF/PSUM tensors using compute engines" and "Cross-Partition Connectivity"): every operand spans
the same number of partitions n, and when the operands do not all start on the same partition, each start
partition must be legal for n — 0 when 64 < n ≤ 128; 0 or 64 when 32 < n ≤ 64 (cross-half); 0, 32, 64 or 96
when n ≤ 32 (cross-quadrant). Anything else is refused (``cross-partition``). Operands on the same lanes are
accepted at any start (placement is the allocator's job, per the same guide). A stricter rule (same start
partition always) would refuse kernels that run on trn2.

Enums: members of the nisa enums are expected; a raw integer that matches a documented enum value (the
aws-neuron-sdk isa stub numbers ``engine``, ``dge_mode``, ``oob_mode``, ``reduce_cmd``) is accepted with a
``DeprecationWarning``, since current public kernels still pass them (e.g. ``dge_mode=3``). Strings and
undocumented numbers are refused (``enum``).
"""

from __future__ import annotations

import enum
import functools
import math
import warnings

import numpy as np

from . import dtypes as dt
from . import ops as O
from .errors import NkiRuleError, check
from .registers import register_alloc, register_load, register_move, register_store  # noqa: F401
from .state import current
from .tensor import NkiTensor

PSUM_FRESH, PSUM_MM, PSUM_OTHER, PSUM_READ = 0, 1, 2, 3
SBUF_FREE_MAX, PSUM_FREE_MAX = 65536, 4096


# ------------------------------------------------------------------------------------------------------ enums
# Values: the numbering of the aws-neuron-sdk isa stub (``nki/api/nki/isa/__init__.py``), so a raw integer
# passed by an older kernel can be matched to its member (see _enum). matmul_perf_mode and dma_engine have no
# documented numbering: raw integers for them are refused.
class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class dma_engine(enum.Enum):
    """sendrecv's transfer engine: the shared DMA (default) or GpSimd's internal DMA (LNC=2 SBUF swaps)."""

    dma = "dma"
    gpsimd_dma = "gpsimd_dma"


@functools.total_ordering
class nc_version(enum.Enum):
    """NeuronCore version; ordered (``nisa.get_nc_version() >= nisa.nc_version.gen3``), as public kernels
    compare them."""

    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other):
        if not isinstance(other, nc_version):
            return NotImplemented
        return self.value < other.value


def get_nc_version() -> nc_version:
    return nc_version.gen4 if current().spec.name == "trn3" else nc_version.gen3


# Deprecated engine aliases (isa stub: ``nisa.vector_engine`` etc., kept for older kernels).
tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor,
    engine.vector,
    engine.scalar,
    engine.gpsimd,
    engine.unknown,
)

_NUMBERED = (engine, reduce_cmd, dge_mode, oob_mode)


def _enum(value, cls, what):
    """``value`` as a member of ``cls``: members pass; a raw int that is a documented value of ``cls`` is
    mapped to its member with a DeprecationWarning; anything else raises ``enum``."""
    if isinstance(value, cls):
        return value
    if cls in _NUMBERED and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        try:
            member = cls(int(value))
        except ValueError:
            member = None
        if member is not None:
            warnings.warn(
                f"{what}={int(value)}: pass nisa.{cls.__name__}.{member.name} (raw integers are "
                f"deprecated since NKI 0.3)",
                DeprecationWarning,
                stacklevel=3,
            )
            return member
    raise NkiRuleError(
        "enum",
        f"{what} must be nisa.{cls.__name__}.<member>, got {value!r} (strings and "
        f"undocumented integers are rejected since NKI 0.3)",
    )


class _Constants:
    """``nki.isa.constants``: the enum classes under the name the architecture guides use
    (``nisa.constants.engine.tensor``)."""

    def __init__(self, **enums):
        self.__dict__.update(enums)


constants = _Constants(
    engine=engine,
    reduce_cmd=reduce_cmd,
    dge_mode=dge_mode,
    oob_mode=oob_mode,
    matmul_perf_mode=matmul_perf_mode,
    dma_engine=dma_engine,
    nc_version=nc_version,
)


# ---------------------------------------------------------------------------------------------------- helpers
def _t(x, what: str, instr: str) -> NkiTensor:
    check(isinstance(x, NkiTensor), "operand", f"{instr}: {what} must be a tensor, got {type(x).__name__}")
    return x


def _onchip(x, what: str, instr: str, allow_psum: bool = True) -> NkiTensor:
    x = _t(x, what, instr)
    check(x.gather is None, "indirect-view", f"{instr}: {what} is an indirect view (DMA only)")
    check(
        not (x.dynamic and x._on_chip),
        "sbuf-indirect-operand",
        f"{instr}: {what} is an on-chip view with a runtime offset (.ap(scalar_offset=...)); compute engines "
        f"take static SBUF/PSUM access patterns only — the trn3 architecture guide lists engine-side SBUF "
        f"indirection as a NeuronCore-v4 hardware feature with no NKI API, and the access-pattern page "
        f"(deep-dives/nki-aps.rst) documents scalar_offset for DMA. Move runtime-indexed data with a DMA",
    )
    check(
        x._on_chip,
        "compute-operand-in-hbm",
        f"{instr}: {what} is in {x.buffer.name}; compute engines read and write SBUF/PSUM only (DMA it in)",
    )
    if not allow_psum:
        check(x.buffer.name == "sbuf", "operand-buffer", f"{instr}: {what} must be in SBUF, got {x.buffer.name}")
    lim = PSUM_FREE_MAX if x.buffer.name == "psum" else SBUF_FREE_MAX
    check(
        x._free_size <= lim,
        "free-size",
        f"{instr}: {what} has {x._free_size} elements per partition; at most {lim} from {x.buffer.name}",
    )
    return x


def _start_ok(start: int, n: int) -> bool:
    """The documented start-partition rule for an access spanning n partitions."""
    if n > 64:
        return start == 0
    if n > 32:
        return start in (0, 64)
    return start in (0, 32, 64, 96)


def _lanes(instr: str, dst: NkiTensor, **srcs) -> None:
    """Partition mapping of a Vector/Scalar/GpSimd instruction: the same partition count for dst and every
    tensor operand; different start partitions only within the documented cross-half / cross-quadrant
    limits (module docstring)."""
    tens = {"dst": dst, **{k: v for k, v in srcs.items() if isinstance(v, NkiTensor)}}
    for what, s in tens.items():
        check(
            s.shape[0] == dst.shape[0],
            "partition-mismatch",
            f"{instr}: {what} spans {s.shape[0]} partitions, dst spans {dst.shape[0]}",
        )
    starts = {what: s._pstart for what, s in tens.items()}
    if len(set(starts.values())) == 1:
        return
    n = dst.shape[0]
    for what, p in starts.items():
        check(
            _start_ok(p, n),
            "cross-partition",
            f"{instr}: operands start on partitions {starts} (n = {n}); moving data across partitions on a "
            f"compute engine needs every start partition to be {_legal_starts(n)} for {n} partitions "
            f"(arch guide: cross-half for ≤ 64, cross-quadrant for ≤ 32); {what} starts at {p}. Use "
            f"nc_transpose, nc_matmul, nc_stream_shuffle or a DMA otherwise",
        )


def _legal_starts(n: int) -> str:
    return "0" if n > 64 else ("0 or 64" if n > 32 else "0, 32, 64 or 96")


def _same_free(instr: str, dst: NkiTensor, **srcs) -> None:
    for what, s in srcs.items():
        check(
            s._free_size == dst._free_size,
            "shape-mismatch",
            f"{instr}: {what} has {s._free_size} elements per partition, dst has {dst._free_size} "
            f"(shapes {list(s.shape)} vs {list(dst.shape)})",
        )


def _elem_addrs(t: NkiTensor) -> np.ndarray:
    a = np.full((), t.boffset, np.int64)
    for n, s in zip(t.shape, t.bstrides):
        a = a[..., None] + np.arange(n, dtype=np.int64) * s
    return a


def _mark_psum_read(t: NkiTensor) -> None:
    st = t.storage.psum_state
    if st is not None:
        idx = (_elem_addrs(t) // 4).reshape(-1)
        sub = st[idx]
        st[idx] = np.where(sub == PSUM_MM, PSUM_READ, sub)


def _raw(t: NkiTensor) -> np.ndarray:
    """[P, F] array in t's own dtype (a copy)."""
    if t._on_chip:
        _mark_psum_read(t)
        return np.array(t._np()).reshape(t.shape[0], -1)
    return np.array(t._np()).reshape(1, -1)


def _f32(t: NkiTensor) -> np.ndarray:
    """[P, F] float32 values of t (what the engines compute on)."""
    check(
        not dt.is_x4(t.dtype),
        "dtype-x4",
        f"{dt.name(t.dtype)} is a packed MX container; compute engines read it only through nc_matmul_mx",
    )
    return _raw(t).astype(np.float32)


def _operand(x, instr: str, what: str, dst: NkiTensor, fp32_tile: bool, int_ok: bool = False):
    """A scalar or a (P, 1) tile operand → value broadcastable against [P, F] (float32, or int64 for bitvec)."""
    if x is None:
        return None
    if isinstance(x, NkiTensor):
        _onchip(x, what, instr)
        check(
            x._free_size == 1,
            "operand-shape",
            f"{instr}: {what} must be a scalar or a (P, 1) tile, got {list(x.shape)}",
        )
        _lanes(instr, dst, **{what: x})
        if int_ok:
            check(
                dt.is_int(x.dtype),
                "bitvec-dtype",
                f"{instr}: bitvec {what} must be an integer tile, got {dt.name(x.dtype)}",
            )
            return _raw(x).astype(np.int64)
        if fp32_tile:
            check(
                x.dtype == dt.float32, "operand-dtype", f"{instr}: tile {what} must be float32, got {dt.name(x.dtype)}"
            )
        return _f32(x)
    check(
        isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) or isinstance(x, bool),
        "operand",
        f"{instr}: {what} must be a compile-time number or a (P, 1) tile, got {x!r}",
    )
    _check_immediate(x, instr, what)
    if int_ok:
        check(float(x) == int(x), "bitvec-dtype", f"{instr}: bitvec {what} must be an integer, got {x!r}")
        return np.int64(int(x))
    return np.float32(x)


IMMEDIATE_BITS = 24  # significant bits of a float32: what a scalar operand field carries exactly


def _check_immediate(x, instr: str, what: str) -> None:
    """Integer immediates of ALU instructions must be exact in float32 (at most 24 significant bits, within the
    32-bit range): the isa pages give scalar operands as float32 ("operand0 and operand1 (if used) must be
    float32", tensor_scalar) and no wider encoding for bitvec immediates, so a wider constant (e.g. 0x07070707,
    27 bits) has no documented representation. Pass it as a (P, 1) integer tile instead. Float immediates are
    rounded to float32 as documented."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        return
    v = int(x)
    ok = -(1 << 31) <= v < (1 << 32) and int(np.float32(v)) == v
    check(
        ok,
        "immediate-range",
        f"{instr}: integer immediate {what}={v:#x} needs more than {IMMEDIATE_BITS} "
        f"significant bits (or lies outside 32 bits): scalar operands are float32 (isa tensor_scalar page), so it "
        f"has no exact encoding; pass it as a (P, 1) integer tile operand (memset a uint32 tile)",
    )


def _cast(values: np.ndarray, dtype: np.dtype, instr: str) -> np.ndarray:
    """Engine output (fp32 or exact ints) → dst dtype with the hardware's rounding rules."""
    check(
        not dt.is_x4(dtype),
        "dtype-x4",
        f"{instr}: {dt.name(dtype)} is a packed MX container; only quantize_mx, memset(0) and byte moves write it",
    )
    if dt.is_int(dtype):
        info = np.iinfo(dtype)
        if np.issubdtype(values.dtype, np.integer):
            return np.clip(values, info.min, info.max).astype(dtype)
        v = values.astype(np.float64)
        v = np.where(np.isnan(v), 0.0, np.rint(v))
        return np.clip(v, info.min, info.max).astype(dtype)
    v32 = values.astype(np.float32)
    if dtype == dt.float32:
        return v32
    out = v32.astype(dtype)
    if dtype != dt.float8_e8m0fnu:
        bad = np.isfinite(v32) & ~np.isfinite(out.astype(np.float32))
        if bad.any():
            i = np.flatnonzero(bad.reshape(-1))[0]
            raise NkiRuleError(
                "cast-overflow",
                f"{instr}: value {v32.reshape(-1)[i]!r} overflows "
                f"{dt.name(dtype)} (max {dt.max_finite(dtype)}); clamp before casting to a narrow "
                f"float",
            )
    return out


def _store_values(dst: NkiTensor, values: np.ndarray, instr: str = "write", exact_int=None, psum_state=PSUM_OTHER):
    if exact_int is not None:
        out = _cast(np.full(dst.shape, exact_int, np.int64), dst.dtype, instr)
    else:
        out = _cast(np.asarray(values), dst.dtype, instr)
    dst._np()[...] = out.reshape(dst.shape)
    _mark_psum_write(dst, psum_state)


def _store_raw(dst: NkiTensor, raw: np.ndarray, psum_state=PSUM_OTHER) -> None:
    """Bit-exact store of an array with dst's itemsize."""
    u = dt.unsigned_of_size(dst._itemsize)
    dst._np().view(u)[...] = np.ascontiguousarray(raw).view(u).reshape(dst.shape)
    _mark_psum_write(dst, psum_state)


def _mark_psum_write(dst: NkiTensor, state: int) -> None:
    st = dst.storage.psum_state
    if st is not None:
        st[(_elem_addrs(dst) // 4).reshape(-1)] = state


def _engine(e, default: str, allowed: tuple, instr: str, tensors=()) -> str:
    e = _enum(e, engine, "engine")
    name = default if e == engine.unknown else e.name
    check(name in allowed, "engine", f"{instr} cannot run on the {name} engine (allowed: {', '.join(allowed)})")
    if name == "gpsimd":
        check(
            all(not (isinstance(t, NkiTensor) and t.buffer.name == "psum") for t in tensors),
            "gpsimd-psum",
            f"{instr}: GpSimd cannot access PSUM",
        )
    return name


_TWO_INPUT = ("tensor_tensor", "scalar_tensor_tensor", "tensor_tensor_scan", "tensor_copy_predicated")


def _vector_cycles(instr: str, eng: str, dst: NkiTensor, srcs) -> float:
    """Model cycles per partition of a Vector/Scalar/GpSimd instruction (no fixed overhead; see cost.py).

    - VectorE / ScalarE: one element per lane per cycle for one input tile, ~2N for two input tiles
      (Trainium/Inferentia2 guide, Vector Engine "Cost Model"; ScalarE reads at most one tensor).
    - VectorE performance mode (trn2 guide, "Vector Engine Performance Mode"): tensor_copy / tensor_scalar
      4× when every tensor is in SBUF, bf16/fp16, with a contiguous innermost free dim; 2× when bf16/fp16 and
      either not contiguous or one side in PSUM; tensor_tensor 2× when both inputs are in SBUF and every tensor
      is bf16/fp16. Nothing else gets a fast mode.
    - GpSimd: 32 bits per partition per cycle (the guide's "Connectivity between GpSimdE and SBUF": up to
      32-bit per partition per cycle), so N·itemsize/4 per input tile.
    """
    f = dst._free_size
    tens_in = [s for s in srcs if isinstance(s, NkiTensor) and s._free_size > 1]
    n_in = 2 if instr in _TWO_INPUT else 1
    if eng == "gpsimd":
        width = max([t._itemsize for t in [dst] + tens_in])
        return n_in * f * width / 4
    if eng != "vector":
        return f
    half = (dt.bfloat16, dt.float16)
    tens = [dst] + tens_in
    if all(t.dtype in half for t in tens):
        in_sbuf = [t.buffer.name == "sbuf" for t in tens]
        if instr in ("tensor_copy", "tensor_scalar"):
            contiguous = all(t.bstrides[-1] == t._itemsize for t in tens)
            if all(in_sbuf):
                return f / (4 if contiguous else 2)
            if contiguous and sum(not x for x in in_sbuf) == 1:
                return f / 2
        if instr == "tensor_tensor" and all(t.buffer.name == "sbuf" for t in tens_in):
            return 2 * f / 2
    return n_in * f


def _record(eng: str, instr: str, dst: NkiTensor, srcs=(), cycles=None):
    c = _vector_cycles(instr, eng, dst, srcs) if cycles is None else cycles
    current().cost.instr(eng, instr, dst.shape[0], dst._free_size, c)


def _check_op(op, instr: str, what: str, kinds) -> O.Op:
    check(isinstance(op, O.Op), "op", f"{instr}: {what} must be an nl operator (e.g. nl.add), got {op!r}")
    check(op.kinds & set(kinds), "op", f"{instr}: nl.{op.name} cannot be used as {what} (needs {'/'.join(kinds)})")
    if op.name in O._TRN3_ONLY:
        check(current().spec.name == "trn3", "target", f"{instr}: nl.{op.name} exists on trn3 only")
    return op


def _apply_arith(op: O.Op, a, b, reverse: bool):
    """One fp32 ALU stage: ``a op b`` (or ``b op a`` when reversed); unary ops ignore b."""
    with np.errstate(all="ignore"):
        if "unary" in op.kinds and "arith" not in op.kinds:
            r = op.fn(np.asarray(a, np.float64))
        else:
            x, y = (b, a) if reverse else (a, b)
            r = op.fn(np.asarray(x, np.float64), np.asarray(y, np.float64))
    return np.asarray(r, np.float64).astype(np.float32)


def _apply_bitvec(op: O.Op, a: np.ndarray, b, a_dtype: np.dtype, reverse: bool):
    """Integer bit ops on the raw bits of a_dtype; logical right shift."""
    u = dt.unsigned_of_size(a_dtype.itemsize)
    bits = 8 * a_dtype.itemsize
    mask = (1 << bits) - 1
    ua = (np.asarray(a, np.int64) & mask).astype(np.uint64)
    if op.name == "invert":
        r = (~ua) & np.uint64(mask)
    else:
        ub = (np.asarray(b, np.int64) & mask).astype(np.uint64)
        x, y = (ub, ua) if reverse else (ua, ub)
        if op.name in ("left_shift", "right_shift"):
            check(bool(np.all(y < bits)), "bitvec-shift", f"shift amount must be < {bits} for {bits}-bit data")
            r = (x << y) if op.name == "left_shift" else (x >> y)
        else:
            r = op.fn(x, y)
        r = r & np.uint64(mask)
    # back to a_dtype's bit pattern, as int64 values of that dtype
    return r.astype(u).view(a_dtype).astype(np.int64)


def _store_bitvec(dst: NkiTensor, vals: np.ndarray, instr: str) -> None:
    """Bitvec results keep their bits: written modulo 2^bits of dst (no saturation)."""
    u = dt.unsigned_of_size(dst._itemsize)
    out = (np.asarray(vals, np.int64) & ((1 << (8 * dst._itemsize)) - 1)).astype(u).view(dst.dtype)
    dst._np()[...] = out.reshape(dst.shape)
    _mark_psum_write(dst, PSUM_OTHER)


# ------------------------------------------------------------------------------------------------ DMA
def _runs(t: NkiTensor) -> tuple[int, int]:
    """(number of contiguous byte runs, bytes per run) of a view."""
    run = t._itemsize
    for size, stride in zip(reversed(t.shape), reversed(t.bstrides)):
        if size == 1:
            continue
        if stride == run:
            run *= size
        else:
            break
    total = t.size * t._itemsize
    return max(total // run, 1), run


def _indirect_rows(t: NkiTensor, oob) -> list:
    """[(row_index_in_view, ndarray of the row or None if skipped)] for an indirect view."""
    gather, row_bytes, nrows, idx = t.gather
    rows = []
    for i, (off, k) in enumerate(zip(gather, idx)):
        if not 0 <= k < nrows:
            check(
                oob == oob_mode.skip,
                "dma-oob",
                f"dma_copy: indirect index {int(k)} out of range [0, {nrows}) "
                f"(pass oob_mode=nisa.oob_mode.skip to skip it)",
            )
            rows.append((i, None))
            continue
        rows.append((i, np.ndarray(t.shape[1:], t.dtype, buffer=t.storage.data, offset=off, strides=t.bstrides[1:])))
    return rows


def dma_copy(
    dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown, name=None
):
    """``dst = src`` over DMA (HBM↔SBUF, HBM↔HBM, SBUF↔SBUF). Equal dtypes move bytes; different dtypes
    convert values through fp32 (not a bitcast). Only the total element counts must match."""
    instr = "dma_copy"
    dst, src = _t(dst, "dst", instr), _t(src, "src", instr)
    oob_mode = _enum(oob_mode, globals()["oob_mode"], "oob_mode")
    dge_mode = _enum(dge_mode, globals()["dge_mode"], "dge_mode")
    engine = _enum(engine, globals()["engine"], "engine")
    check(priority is None or current().spec.name == "trn3", "target", "dma_copy priority= is trn3-only")
    for what, t in (("dst", dst), ("src", src)):
        check(
            t.buffer.name != "psum",
            "dma-psum",
            f"dma_copy: {what} is in PSUM; DMA cannot access PSUM (evacuate "
            f"it to SBUF with tensor_copy / activation first)",
        )
    if dst.dtype != src.dtype:
        check(
            not (dt.is_x4(src.dtype) or dt.is_x4(dst.dtype)),
            "dtype-x4",
            f"dma_copy: no dtype conversion to or from the packed MX types ({dt.name(src.dtype)} -> "
            f"{dt.name(dst.dtype)}); view both sides alike for a byte move",
        )
        check(
            dge_mode != globals()["dge_mode"].hwdge,
            "dma-dtype",
            f"dma_copy with dge_mode=hwdge needs equal dtypes, got {dt.name(src.dtype)} -> {dt.name(dst.dtype)}",
        )
    if src.runtime_oob or dst.runtime_oob:
        _copy_runtime_oob(dst, src, oob_mode, instr)
    elif src.gather is None and dst.gather is None:
        check(
            src.size == dst.size,
            "dma-shape",
            f"dma_copy: src has {src.size} elements {list(src.shape)}, dst has {dst.size} {list(dst.shape)}",
        )
        raw = np.array(src._np()).reshape(-1)
        if src.dtype == dst.dtype:
            _store_raw(dst, raw)
        else:
            _store_values(dst, raw.astype(np.float32), instr)
    elif src.gather is not None:
        check(dst.gather is None, "dma-shape", "dma_copy: both sides indirect")
        check(src.size == dst.size, "dma-shape", f"dma_copy: indirect src {list(src.shape)} vs dst {list(dst.shape)}")
        drows = np.array(dst._np()).reshape(src.shape[0], -1)  # skipped rows keep their bytes
        for i, row in _indirect_rows(src, oob_mode):
            if row is None:
                continue
            if src.dtype == dst.dtype:
                u = dt.unsigned_of_size(dst._itemsize)
                drows.view(u)[i] = np.array(row).view(u).reshape(-1)
            else:
                drows[i] = _cast(np.array(row).astype(np.float32).reshape(-1), dst.dtype, instr)
        _store_raw(dst, drows)
    else:
        check(src.size == dst.size, "dma-shape", f"dma_copy: src {list(src.shape)} vs indirect dst {list(dst.shape)}")
        srows = np.array(src._np()).reshape(dst.shape[0], -1)
        for i, row in _indirect_rows(dst, oob_mode):
            if row is None:
                continue
            if src.dtype == dst.dtype:
                u = dt.unsigned_of_size(dst._itemsize)
                row.view(u)[...] = srows[i].view(u).reshape(row.shape)
            else:
                row[...] = _cast(srows[i].astype(np.float32), dst.dtype, instr).reshape(row.shape)
    dge = src.dynamic or dst.dynamic or dge_mode in (globals()["dge_mode"].hwdge, globals()["dge_mode"].swdge)
    _record_dma(src, dst, dge=dge)


def _runtime_rows(t: NkiTensor, oob) -> list:
    """[(row, ndarray of the row or None if skipped)] per dim-0 row of a view whose runtime start address leaves
    its allocation (``NkiTensor.runtime_oob``). ASSUMPTION: ``oob_mode.skip`` skips whole rows of the access
    pattern's outermost dim (nki-library's ``indexed_flatten_torch.py`` reference skips whole blocks so); a row
    only partly outside the allocation is refused as not modelled."""
    rest = list(zip(t.shape[1:], t.bstrides[1:]))
    lo_r = sum(min(0, (n - 1) * s) for n, s in rest)
    hi_r = sum(max(0, (n - 1) * s) for n, s in rest) + t._itemsize
    nbytes = t.storage.nbytes
    rows = []
    for i in range(t.shape[0]):
        base = t.boffset + i * t.bstrides[0]
        lo, hi = base + lo_r, base + hi_r
        if lo >= 0 and hi <= nbytes:
            rows.append(
                (i, np.ndarray(t.shape[1:], t.dtype, buffer=t.storage.data, offset=base, strides=t.bstrides[1:]))
            )
            continue
        check(
            oob == oob_mode.skip,
            "dma-oob",
            f"dma_copy: row {i} of {t.name or t.buffer.name} at its runtime address touches bytes [{lo}, {hi}) of a "
            f"{nbytes}-byte allocation (pass oob_mode=nisa.oob_mode.skip to skip it)",
        )
        check(
            hi <= 0 or lo >= nbytes,
            "dma-oob",
            f"dma_copy: row {i} of {t.name or t.buffer.name} is partly out of bounds (bytes [{lo}, {hi}) of "
            f"{nbytes}); skipping part of a row is not modelled",
        )
        rows.append((i, None))
    return rows


def _copy_runtime_oob(dst: NkiTensor, src: NkiTensor, oob, instr: str) -> None:
    """``dma_copy`` where one side is a runtime-addressed HBM view leaving its allocation: its in-bounds rows
    move, the others are skipped (or refused with ``oob_mode.error``)."""
    check(
        not (src.runtime_oob and dst.runtime_oob) and src.gather is None and dst.gather is None,
        "dma-shape",
        f"{instr}: only one side may be a runtime-addressed view that leaves its allocation, and not indirect",
    )
    check(src.size == dst.size, "dma-shape", f"{instr}: src {list(src.shape)} vs dst {list(dst.shape)}")
    u = dt.unsigned_of_size(dst._itemsize)
    if dst.runtime_oob:
        srows = np.array(src._np()).reshape(dst.shape[0], -1)
        for i, row in _runtime_rows(dst, oob):
            if row is None:
                continue
            if src.dtype == dst.dtype:
                row.view(u)[...] = srows[i].view(u).reshape(row.shape)
            else:
                row[...] = _cast(srows[i].astype(np.float32), dst.dtype, instr).reshape(row.shape)
        return
    drows = np.array(dst._np()).reshape(src.shape[0], -1)  # skipped rows keep their bytes
    for i, row in _runtime_rows(src, oob):
        if row is None:
            continue
        if src.dtype == dst.dtype:
            drows.view(u)[i] = np.array(row).view(u).reshape(-1)
        else:
            drows[i] = _cast(np.array(row).astype(np.float32).reshape(-1), dst.dtype, instr)
    _store_raw(dst, drows)


def _record_dma(src: NkiTensor, dst: NkiTensor, dge: bool, efficiency: float = 1.0, rmw: bool = False) -> None:
    """The cost record of one DMA from src to dst (bytes, HBM side, contiguous runs, partitions and bytes per
    partition of the on-chip side, indirect or not; ``rmw``: it accumulates into dst, which is read too)."""
    sb, db = src.size * src._itemsize, dst.size * dst._itemsize
    hbm = (sb if src.buffer.is_hbm else 0) + (db if dst.buffer.is_hbm else 0)
    (rs, runs_s), (rd, runs_d) = _runs(src), _runs(dst)
    if src.gather is not None:
        rs, runs_s = src.shape[0], math.prod(src.shape[1:]) * src._itemsize
    if dst.gather is not None:
        rd, runs_d = dst.shape[0], math.prod(dst.shape[1:]) * dst._itemsize
    ctx = current()
    if ctx.lnc is not None and dst.buffer.name == "shared_hbm":
        ctx.lnc.record_write(ctx.program, dst)
    chip = [t for t in (src, dst) if t._on_chip]
    pbytes = min(t._free_size * t._itemsize for t in chip) if chip else 0
    parts = min(t.shape[0] for t in chip) if chip else 0
    from .cost import DmaRecord

    current().cost.dma(
        DmaRecord(
            max(sb, db),
            hbm,
            max(rs, rd),
            min(runs_s, runs_d),
            pbytes,
            dge=dge,
            efficiency=efficiency,
            partitions=parts,
            indirect=src.gather is not None or dst.gather is not None,
            rmw=rmw,
            rmw_hbm_read=db if rmw and dst.buffer.is_hbm else 0,
        )
    )


# ---------------------------------------------------------------------------------------------- copies / fills
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """On-chip copy; bit-exact for equal dtypes, converting through fp32 otherwise."""
    instr = "tensor_copy"
    dst, src = _onchip(dst, "dst", instr), _onchip(src, "src", instr)
    eng = _engine(engine, "vector", ("vector", "scalar", "gpsimd"), instr, (dst, src))
    _lanes(instr, dst, src=src)
    _same_free(instr, dst, src=src)
    if src.dtype == dst.dtype:
        _store_raw(dst, _raw(src))
    else:
        _store_values(dst, _f32(src), instr)
    _record(eng, instr, dst, (src,))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill an on-chip tensor with a compile-time constant that suits its dtype."""
    instr = "memset"
    dst = _onchip(dst, "dst", instr)
    eng = _engine(engine, "vector", ("vector", "gpsimd"), instr, (dst,))
    check(
        isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool),
        "memset-value",
        f"memset value must be a compile-time number, got {value!r}",
    )
    if dt.is_x4(dst.dtype):
        check(
            value == 0,
            "memset-value",
            f"memset of the x4 packed type {dt.name(dst.dtype)} accepts only value=0 (isa stub), got {value!r}",
        )
        _store_raw(dst, np.zeros(dst.shape, dst.dtype))
    elif dt.is_int(dst.dtype):
        info = np.iinfo(dst.dtype)
        check(
            float(value) == int(value) and isinstance(value, (int, np.integer)),
            "memset-value",
            f"memset of {dt.name(dst.dtype)} needs an int literal, got {value!r}",
        )
        check(
            info.min <= int(value) <= info.max,
            "memset-value",
            f"memset value {value} does not fit {dt.name(dst.dtype)} [{info.min}, {info.max}] (e.g. 255 for uint8)",
        )
        _store_values(dst, None, instr, exact_int=int(value))
    else:
        _store_values(dst, np.full(dst.shape, value, np.float32), instr)
    _record(eng, instr, dst)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """GpSimd: ``offset + partition·channel_multiplier + Σ idx_k·step_k``, in int32, cast to dst.dtype."""
    instr = "iota"
    dst = _onchip(dst, "dst", instr, allow_psum=False)
    pattern = [tuple(int(v) for v in p) for p in pattern]
    check(1 <= len(pattern) <= 4, "iota", f"iota pattern has {len(pattern)} dims; 1 to 4 allowed")
    check(
        math.prod(c for _, c in pattern) == dst._free_size,
        "iota",
        f"iota pattern covers {math.prod(c for _, c in pattern)} elements, dst has {dst._free_size} per partition",
    )
    v = np.full((), int(offset), np.int64)
    for step, cnt in pattern:
        v = v[..., None] + np.arange(cnt, dtype=np.int64) * step
    vals = v.reshape(1, -1) + np.arange(dst.shape[0], dtype=np.int64)[:, None] * int(channel_multiplier)
    vals = vals.astype(np.int32).astype(np.int64)
    if dt.is_int(dst.dtype):
        dst._np()[...] = _cast(vals, dst.dtype, instr).reshape(dst.shape)
    else:
        _store_values(dst, vals.astype(np.float32), instr)
    _record("gpsimd", instr, dst)


# ----------------------------------------------------------------------------------------------- elementwise
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """Elementwise ``data1 op data2`` (Vector, or GpSimd for arithmetic); bitvec ops on raw integer bits, VectorE
    only (``gpsimd-bitvec``)."""
    instr = "tensor_tensor"
    dst, a, b = _onchip(dst, "dst", instr), _onchip(data1, "data1", instr), _onchip(data2, "data2", instr)
    op = _check_op(op, instr, "op", ("arith", "bitvec"))
    check(
        not (a.buffer.name == "psum" and b.buffer.name == "psum"),
        "psum-operands",
        f"{instr}: data1 and data2 cannot both be in PSUM",
    )
    _lanes(instr, dst, data1=a, data2=b)
    _same_free(instr, dst, data1=a, data2=b)
    any_psum = any(t.buffer.name == "psum" for t in (dst, a, b))
    if op.is_bitvec:
        check(
            _enum(engine, globals()["engine"], "engine") != globals()["engine"].gpsimd,
            "gpsimd-bitvec",
            f"{instr}: bitvec nl.{op.name} on GpSimd is not documented (the isa pages give bitvec semantics for "
            f"the Vector Engine: tensor_scalar 'must run on Vector Engine', and no public kernel runs bitwise "
            f"tensor_tensor on GpSimd); run it on VectorE, or use an exact integer nl.add on GpSimd when the bit "
            f"fields are disjoint",
        )
        check(
            all(dt.is_int(t.dtype) for t in (dst, a, b)),
            "bitvec-dtype",
            f"{instr}: bitvec nl.{op.name} needs integer dtypes, got {dt.name(a.dtype)}, {dt.name(b.dtype)} -> "
            f"{dt.name(dst.dtype)}",
        )
        eng = _engine(engine, "vector", ("vector",), instr, (dst, a, b))
        _store_bitvec(dst, _apply_bitvec(op, _raw(a).astype(np.int64), _raw(b).astype(np.int64), a.dtype, False), instr)
    else:
        int32s = (dt.int32, dt.uint32)
        exact = all(t.dtype in int32s for t in (dst, a, b)) and op.name in (
            "add",
            "subtract",
            "multiply",
            "maximum",
            "minimum",
        )
        eng = _engine(
            engine, "vector" if (any_psum or not exact) else "gpsimd", ("vector", "gpsimd"), instr, (dst, a, b)
        )
        if exact:
            r = op.fn(_raw(a).astype(np.int64), _raw(b).astype(np.int64))
            _store_values(dst, np.asarray(r, np.int64), instr)
        else:
            _store_values(dst, _apply_arith(op, _f32(a), _f32(b), False), instr)
    _record(eng, instr, dst, (a, b))


def tensor_scalar(
    dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=engine.unknown, name=None
):
    """``(data op0 operand0) op1 operand1`` with scalar or (P, 1) operands broadcast along the free dims."""
    instr = "tensor_scalar"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    op0 = _check_op(op0, instr, "op0", ("arith", "bitvec", "unary"))
    if op1 is not None:
        op1 = _check_op(op1, instr, "op1", ("arith", "bitvec", "unary"))
        check(
            op0.is_bitvec == op1.is_bitvec,
            "op",
            f"{instr}: op0 and op1 must both be bitvec or both arithmetic (nl.{op0.name}, nl.{op1.name})",
        )
    _lanes(instr, dst, data=x)
    _same_free(instr, dst, data=x)
    if op0.is_bitvec:
        eng = _engine(engine, "vector", ("vector",), instr, (dst, x))
        check(
            dt.is_int(x.dtype) and dt.is_int(dst.dtype),
            "bitvec-dtype",
            f"{instr}: bitvec ops need integer data and dst (no casting), got {dt.name(x.dtype)} -> "
            f"{dt.name(dst.dtype)}; view float bits with .view(nl.int32)",
        )
        v0 = _operand(operand0, instr, "operand0", dst, False, int_ok=True) if "bitvec_unary" not in op0.kinds else 0
        r = _apply_bitvec(op0, _raw(x).astype(np.int64), v0, x.dtype, reverse0)
        if op1 is not None:
            v1 = (
                _operand(operand1, instr, "operand1", dst, False, int_ok=True) if "bitvec_unary" not in op1.kinds else 0
            )
            r = _apply_bitvec(op1, r, v1, x.dtype, reverse1)
        _store_bitvec(dst, r, instr)
    else:
        eng = _engine(engine, "vector", ("vector", "scalar", "gpsimd"), instr, (dst, x, operand0, operand1))
        if eng == "scalar" and current().spec.name == "trn2":
            pair = (op0.name, op1.name if op1 is not None else None)
            check(
                pair in (("multiply", "add"), ("multiply", None), ("add", None)),
                "engine",
                f"{instr} on ScalarE (trn2) supports (multiply, add), (multiply,) and (add,) only, got {pair}",
            )
        if eng == "gpsimd":
            check(op0.name == "rsqrt", "engine", f"{instr}: engine=gpsimd is only for rsqrt")
        unary0 = "unary" in op0.kinds and "arith" not in op0.kinds
        check(not unary0 or operand0 in (None, 0), "operand", f"{instr}: unary nl.{op0.name} takes operand0=None")
        v0 = None if unary0 else _operand(operand0, instr, "operand0", dst, True)
        r = _apply_arith(op0, _f32(x), v0, reverse0)
        if op1 is not None:
            unary1 = "unary" in op1.kinds and "arith" not in op1.kinds
            v1 = None if unary1 else _operand(operand1, instr, "operand1", dst, True)
            r = _apply_arith(op1, r, v1, reverse1)
        _store_values(dst, r, instr)
    _record(eng, instr, dst, (x,))


def scalar_tensor_tensor(
    dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, dtype=None, name=None
):
    """VectorE ``(data op0 operand0) op1 operand1``; operand0 scalar or (P, 1), operand1 a full tile.

    ``dtype=``: not in the current isa stub (whose signature ends at ``reverse1``), but passed by kernels
    written for front ends where it named the output dtype. Since NKI 0.3 the output dtype is ``dst.dtype``,
    so ``dtype`` is accepted when it agrees with dst and refused (``dtype-mismatch``) when it contradicts it.
    """
    instr = "scalar_tensor_tensor"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    if dtype is not None:
        check(
            dt.as_dtype(dtype) == dst.dtype,
            "dtype-mismatch",
            f"{instr}: dtype={dt.name(dt.as_dtype(dtype))} contradicts dst.dtype {dt.name(dst.dtype)} (the "
            f"output dtype is dst's)",
        )
    t1 = _onchip(operand1, "operand1", instr)
    op0 = _check_op(op0, instr, "op0", ("arith",))
    op1 = _check_op(op1, instr, "op1", ("arith",))
    check(
        not (x.buffer.name == "psum" and t1.buffer.name == "psum"),
        "psum-operands",
        f"{instr}: data and operand1 cannot both be in PSUM",
    )
    _lanes(instr, dst, data=x, operand1=t1)
    _same_free(instr, dst, data=x, operand1=t1)
    v0 = _operand(operand0, instr, "operand0", dst, True)
    r = _apply_arith(op0, _f32(x), v0, reverse0)
    r = _apply_arith(op1, r, _f32(t1), reverse1)
    _store_values(dst, r, instr)
    _record("vector", instr, dst, (x, t1))


def reciprocal(dst, data, name=None):
    """VectorE 1/x in fp32."""
    instr = "reciprocal"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    _lanes(instr, dst, data=x)
    _same_free(instr, dst, data=x)
    with np.errstate(divide="ignore"):
        _store_values(dst, (np.float32(1.0) / _f32(x)).astype(np.float32), instr)
    _record("vector", instr, dst, (x,))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """VectorE: ``dst = src`` where the predicate is non-zero (zero with reverse_pred); elsewhere unchanged."""
    instr = "tensor_copy_predicated"
    dst, pred = _onchip(dst, "dst", instr), _onchip(predicate, "predicate", instr)
    check(
        dt.is_int(pred.dtype) and pred.dtype.kind == "u",
        "predicate-dtype",
        f"{instr}: predicate must be uint8/16/32, got {dt.name(pred.dtype)}",
    )
    _lanes(instr, dst, predicate=pred)
    _same_free(instr, dst, predicate=pred)
    mask = _raw(pred) != 0
    if reverse_pred:
        mask = ~mask
    cur = _raw(dst)
    if isinstance(src, NkiTensor):
        s = _onchip(src, "src", instr)
        check(
            s.dtype == dst.dtype,
            "dtype-mismatch",
            f"{instr}: src and dst share a dtype, got {dt.name(s.dtype)} and {dt.name(dst.dtype)}",
        )
        check(
            not (s.buffer.name == "psum" and pred.buffer.name == "psum"),
            "psum-operands",
            f"{instr}: src and predicate cannot both be in PSUM",
        )
        _lanes(instr, dst, src=s)
        _same_free(instr, dst, src=s)
        new = _raw(s)
    else:
        new = _cast(np.full(cur.shape, src, np.float64), dst.dtype, instr)
    _store_raw(dst, np.where(mask, new, cur))
    _record("vector", instr, dst, (pred,))


# ------------------------------------------------------------------------------------------------ reductions
def _reduce(op: O.Op, v: np.ndarray, axis, instr: str) -> np.ndarray:
    if op.is_bitvec:
        return np.bitwise_and.reduce(v, axis=axis) if op.name == "bitwise_and" else op.fn.reduce(v, axis=axis)
    fn = {
        "add": np.add,
        "subtract": np.add,
        "multiply": np.multiply,
        "maximum": np.maximum,
        "minimum": np.minimum,
        "logical_and": np.logical_and,
        "logical_or": np.logical_or,
        "logical_xor": np.logical_xor,
    }.get(op.name)
    check(fn is not None, "op", f"{instr}: nl.{op.name} is not a reduction op")
    with np.errstate(all="ignore"):
        r = fn.reduce(v.astype(np.float64), axis=axis)
    return np.asarray(r, np.float64).astype(np.float32)


def _reduce_op(op):
    return getattr(op, "_reduce_op", op)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """VectorE reduction over trailing free axes of data (never the partition axis)."""
    instr = "tensor_reduce"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    op = _check_op(_reduce_op(op), instr, "op", ("arith", "bitvec"))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(a + x.ndim if a < 0 else a for a in axes))
    check(
        0 not in axes,
        "reduce-partition-axis",
        f"{instr}: axis 0 is the partition dim; reductions run over free axes only (use a matmul with ones, "
        f"nc_transpose or tensor_partition_reduce to reduce across partitions)",
    )
    check(
        len(axes) > 0 and axes == tuple(range(x.ndim - len(axes), x.ndim)),
        "reduce-trailing-axes",
        f"{instr}: axis={axes} must be the trailing free axes of a {x.ndim}-D tensor (e.g. ({x.ndim - 1},))",
    )
    _lanes(instr, dst, data=x)
    kept = math.prod(x.shape[1 : x.ndim - len(axes)])
    check(
        dst._free_size == kept,
        "shape-mismatch",
        f"{instr}: reducing {list(x.shape)} over {axes} leaves {kept} elements per partition; dst has {dst._free_size}",
    )
    if op.is_bitvec:
        check(
            dt.is_int(x.dtype) and dt.is_int(dst.dtype) and not negate,
            "bitvec-dtype",
            f"{instr}: bitvec reduction needs integer data/dst and no negate",
        )
        v = _raw(x).astype(np.int64).reshape(x.shape[0], kept, -1)
        _store_bitvec(dst, _reduce(op, v, 2, instr), instr)
    else:
        v = _f32(x).reshape(x.shape[0], kept, -1)
        r = _reduce(op, v, 2, instr)
        _store_values(dst, -r if negate else r, instr)
    _record("vector", instr, dst, (x,), cycles=x._free_size)


def _accumulate(eng: str, dst: NkiTensor, part: np.ndarray, op_name: str, cmd: reduce_cmd, init):
    """Per-lane accumulators of an engine (128 lanes), driven by reduce_cmd. Returns the [P] accumulator."""
    acc_all = current().accumulators.setdefault(eng, np.zeros(128, np.float32))
    lanes = slice(dst._pstart, dst._pstart + dst.shape[0])
    ident = {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}[op_name]
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        acc_all[lanes] = ident
    elif cmd == reduce_cmd.load_reduce:
        acc_all[lanes] = init
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce, reduce_cmd.load_reduce):
        fn = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum}[op_name]
        acc_all[lanes] = fn(acc_all[lanes], part).astype(np.float32)
    return acc_all[lanes].copy()


def tensor_scalar_reduce(
    dst,
    data,
    op0,
    operand0,
    reduce_op,
    reduce_res=None,
    reverse0=False,
    reduce_cmd=reduce_cmd.reset_reduce,
    reduce_init=None,
    reduce_res_negate=False,
    name=None,
):
    """VectorE: ``dst = data op0 operand0`` and a reduction of the result over all free dims into reduce_res."""
    instr = "tensor_scalar_reduce"
    rc = globals()["reduce_cmd"]
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    op0 = _check_op(op0, instr, "op0", ("arith", "unary"))
    rop = _check_op(_reduce_op(reduce_op), instr, "reduce_op", ("arith",))
    check(
        rop.name in ("add", "multiply", "maximum", "minimum"),
        "op",
        f"{instr}: reduce_op must be add / multiply / maximum / minimum, got nl.{rop.name}",
    )
    reduce_cmd = _enum(reduce_cmd, rc, "reduce_cmd")
    check(not reverse0, "not-supported", f"{instr}: reverse0 is not supported by the hardware yet")
    _lanes(instr, dst, data=x)
    _same_free(instr, dst, data=x)
    unary = "unary" in op0.kinds and "arith" not in op0.kinds
    v0 = None if unary else _operand(operand0, instr, "operand0", dst, True)
    r = _apply_arith(op0, _f32(x), v0, False)
    _store_values(dst, r, instr)
    part = _reduce(rop, r, 1, instr)
    init = None
    if reduce_cmd == rc.load_reduce:
        check(
            isinstance(reduce_init, NkiTensor) and reduce_init.dtype == dt.float32,
            "operand",
            f"{instr}: load_reduce needs reduce_init, a (P, 1) float32 tile",
        )
        init = _f32(reduce_init).reshape(-1)
    acc = _accumulate("vector", dst, part, rop.name, reduce_cmd, init)
    if reduce_res is not None:
        rr = _onchip(reduce_res, "reduce_res", instr)
        check(rr._free_size == 1, "operand-shape", f"{instr}: reduce_res must be (P, 1), got {list(rr.shape)}")
        _lanes(instr, dst, reduce_res=rr)
        _store_values(rr, (-acc if reduce_res_negate else acc).reshape(-1, 1), instr)
    _record("vector", instr, dst, (x,))


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd reduction across partitions: data [P, F] (SBUF) → dst [1, F]."""
    instr = "tensor_partition_reduce"
    dst, x = _onchip(dst, "dst", instr, allow_psum=False), _onchip(data, "data", instr, allow_psum=False)
    op = _check_op(_reduce_op(op), instr, "op", ("arith", "bitvec"))
    check(
        op.name in ("add", "maximum", "bitwise_or", "bitwise_and"),
        "op",
        f"{instr}: op must be add / maximum / bitwise_or / bitwise_and, got nl.{op.name}",
    )
    check(
        dst.shape[0] == 1 and dst._free_size == x._free_size,
        "shape-mismatch",
        f"{instr}: dst must be [1, F] with F = {x._free_size}, got {list(dst.shape)}",
    )
    if op.is_bitvec:
        _store_bitvec(dst, _reduce(op, _raw(x).astype(np.int64), 0, instr).reshape(1, -1), instr)
    else:
        _store_values(dst, _reduce(op, _f32(x), 0, instr).reshape(1, -1), instr)
    _record("gpsimd", instr, dst, (x,), cycles=x._free_size * max(1, x.shape[0] // 16))


# ------------------------------------------------------------------------------------------------ ScalarE
def activation(
    dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None
):
    """ScalarE ``op(data * scale + bias)`` in fp32, cast to dst.dtype; optional add-reduction along free dims.

    The bias is always added (0 when absent), as the hardware's affine stage does, so ``copy`` of −0 gives +0:
    a kernel that must keep the sign of zero scales on VectorE (``tensor_scalar``) instead.
    """
    instr = "activation"
    rc = globals()["reduce_cmd"]
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    op = _check_op(op, instr, "op", ("act",))
    _lanes(instr, dst, data=x)
    _same_free(instr, dst, data=x)
    if isinstance(scale, NkiTensor):
        s = _operand(scale, instr, "scale", dst, True)
    else:
        check(
            isinstance(scale, (int, float, np.integer, np.floating)),
            "operand",
            f"{instr}: scale must be a number or a (P, 1) float32 tile",
        )
        s = np.float32(scale)
    if bias is None:
        b = np.float32(0.0)
    elif isinstance(bias, NkiTensor):
        _onchip(bias, "bias", instr)
        check(bias._free_size == 1, "operand-shape", f"{instr}: bias must be (P, 1), got {list(bias.shape)}")
        _lanes(instr, dst, bias=bias)
        b = _f32(bias)
    else:
        check(current().spec.scalar_bias_ok, "target", f"{instr}: a scalar bias needs trn2 or later")
        b = np.float32(bias)
    v = (_f32(x) * s).astype(np.float32)
    v = (v + b).astype(np.float32)
    with np.errstate(all="ignore"):
        r = np.asarray(op.fn(v.astype(np.float64)), np.float64)
    if op.act_range is not None:
        lo, hi = op.act_range
        a = np.abs(v) if op.name in ("reciprocal",) else v
        r = np.where((a >= lo) & (a <= hi), r, np.nan)  # outside the documented range the output is invalid
    r = r.astype(np.float32)
    _store_values(dst, r, instr)
    reduce_cmd = _enum(reduce_cmd, rc, "reduce_cmd")
    if reduce_op is not None or reduce_res is not None:
        check(
            reduce_op is not None and _reduce_op(reduce_op) is O.add,
            "op",
            f"{instr}: the activation reduction must be reduce_op=nl.add",
        )
        cmd = rc.reset_reduce if reduce_cmd == rc.idle else reduce_cmd
        acc = _accumulate("scalar", dst, _reduce(O.add, r, 1, instr), "add", cmd, None)
        if reduce_res is not None:
            rr = _onchip(reduce_res, "reduce_res", instr)
            check(rr._free_size == 1, "operand-shape", f"{instr}: reduce_res must be (P, 1)")
            _lanes(instr, dst, reduce_res=rr)
            _store_values(rr, acc.reshape(-1, 1), instr)
    elif reduce_cmd != rc.idle:
        _accumulate("scalar", dst, _reduce(O.add, r, 1, instr), "add", reduce_cmd, None)
    _record("scalar", instr, dst, (x,))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """Legacy fused form of activation + add-reduction."""
    activation(
        dst,
        op,
        data,
        bias=bias,
        scale=scale,
        reduce_op=reduce_op,
        reduce_res=reduce_res,
        reduce_cmd=reduce_cmd.reset_reduce,
    )


# ------------------------------------------------------------------------------------------------ TensorE
_MATMUL_IN = (dt.float8_e4m3, dt.float8_e5m2, dt.bfloat16, dt.float16, dt.float32, dt.float8_e4m3fn)


def nc_matmul(
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    tile_position=(),
    tile_size=(),
    perf_mode=matmul_perf_mode.none,
    name=None,
):
    """TensorE ``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]``; K on the partition dim of both operands.

    PSUM accumulation: ``accumulate=False`` overwrites, ``True`` adds (only onto PSUM a matmul wrote),
    ``None`` lets "the compiler" decide: it overwrites unless the destination holds a matmul result that no
    other engine has read yet, in which case it accumulates (a K loop into one PSUM tile).
    """
    instr = "nc_matmul"
    spec = current().spec
    dst = _t(dst, "dst", instr)
    st, mv = _t(stationary, "stationary", instr), _t(moving, "moving", instr)
    check(dst.buffer.name == "psum", "matmul-dst-psum", f"{instr}: dst must be in PSUM, got {dst.buffer.name}")
    for what, t in (("stationary", st), ("moving", mv)):
        check(t.buffer.name == "sbuf", "matmul-operand-sbuf", f"{instr}: {what} must be in SBUF, got {t.buffer.name}")
        _onchip(t, what, instr)
        check(
            t.dtype in _MATMUL_IN,
            "matmul-dtype",
            f"{instr}: {what} dtype {dt.name(t.dtype)} is not a matmul input (fp8 e4m3/e5m2, bf16, fp16, fp32)",
        )
        check(
            t.dtype != dt.float8_e4m3fn or spec.fp8_e4m3fn_matmul,
            "fp8-e4m3fn-trn2",
            f"{instr}: {what} is float8_e4m3fn (OCP), a matmul input on trn3 only; on trn2 decode it (values "
            f"up to 448) to bf16, or requantize to float8_e4m3 (max 240)",
        )
    _onchip(dst, "dst", instr)
    check(
        (st.dtype == dt.float32) == (mv.dtype == dt.float32),
        "matmul-dtype",
        f"{instr}: fp32 operands must pair with fp32 (got {dt.name(st.dtype)} x {dt.name(mv.dtype)})",
    )
    perf_mode = _enum(perf_mode, matmul_perf_mode, "perf_mode")
    if is_transpose:
        return _matmul_transpose(dst, st, mv, perf_mode, accumulate, spec)
    check(accumulate in (None, True, False), "operand", f"{instr}: accumulate must be None, True or False")
    check(
        st.shape[0] == mv.shape[0],
        "matmul-shape",
        f"{instr}: contraction (partition) dims differ: stationary {st.shape[0]}, moving {mv.shape[0]}",
    )
    check(
        st._pstart == mv._pstart,
        "cross-partition",
        f"{instr}: stationary starts at partition {st._pstart}, moving at {mv._pstart}",
    )
    k = st.shape[0]
    check(k <= 128, "matmul-limits", f"{instr}: contraction K={k} > 128")
    row_size, col_size = _matmul_tiling(tile_position, tile_size, instr)
    check(k <= row_size, "matmul-limits", f"{instr}: contraction K={k} > the row tile size {row_size}")
    double = perf_mode == matmul_perf_mode.double_row
    if double:
        check(
            st.dtype in (dt.float8_e4m3, dt.float8_e5m2) and mv.dtype in (dt.float8_e4m3, dt.float8_e5m2),
            "matmul-double-row",
            f"{instr}: perf_mode=double_row needs fp8 (e4m3/e5m2) operands",
        )
        check(
            st.ndim == 3 and mv.ndim == 3 and st.shape[1] == 2 and mv.shape[1] == 2,
            "matmul-double-row",
            f"{instr}: double_row operands are [K, 2, M] and [K, 2, N], got {list(st.shape)}, {list(mv.shape)}",
        )
        check(
            col_size == 128,
            "matmul-double-row",
            f"{instr}: double_row cannot combine with column tiling (tile_size column {col_size})",
        )
        m, n = st.shape[2], mv.shape[2]
    else:
        m, n = st._free_size, mv._free_size
    check(
        m <= min(spec.gemm_stationary_fmax, col_size),
        "matmul-limits",
        f"{instr}: stationary free size M={m} > {min(spec.gemm_stationary_fmax, col_size)} (gemm_stationary_fmax"
        f" / the column tile size)",
    )
    check(
        n <= spec.gemm_moving_fmax,
        "matmul-limits",
        f"{instr}: moving free size N={n} > {spec.gemm_moving_fmax} (gemm_moving_fmax)",
    )
    check(
        dst.shape[0] == m and dst._free_size == n,
        "matmul-shape",
        f"{instr}: dst must be [M={m}, N={n}], got {list(dst.shape)}",
    )
    check(
        dst.dtype == dt.float32 or spec.name != "trn2",
        "matmul-dst-dtype",
        f"{instr}: the PSUM destination must be float32 on trn2, got {dt.name(dst.dtype)}",
    )
    bank = spec.psum_bank_bytes
    addrs = _elem_addrs(dst)
    fo = addrs % dst.storage.pbytes
    check(
        int(fo.min()) // bank == int(fo.max()) // bank,
        "psum-bank",
        f"{instr}: the output spans PSUM bytes [{int(fo.min())}, {int(fo.max()) + dst._itemsize}) of a partition, "
        f"crossing a {bank}-byte bank boundary; a matmul writes within one bank (N ≤ 512 fp32)",
    )
    # compute
    a = _f32(st).astype(np.float64)
    b = _f32(mv).astype(np.float64)
    if double:
        a = a.reshape(k, 2, m).transpose(1, 0, 2).reshape(2 * k, m)
        b = b.reshape(k, 2, n).transpose(1, 0, 2).reshape(2 * k, n)
    prod = (a.T @ b).astype(np.float32)
    state = dst.storage.psum_state
    idx = (addrs // 4).reshape(-1)
    cur_state = state[idx]
    if accumulate is None:
        acc = bool(np.all(cur_state == PSUM_MM))
    else:
        acc = accumulate
    if acc:
        check(
            not np.any(cur_state == PSUM_FRESH),
            "psum-accumulate-uninitialized",
            f"{instr}: accumulate=True onto PSUM that no matmul has written (undefined on hardware)",
        )
        check(
            not np.any(cur_state == PSUM_OTHER),
            "psum-accumulate-after-memset",
            f"{instr}: accumulating onto PSUM written by memset/tensor_copy/another engine is undefined on "
            f"{spec.name}; start the accumulation group with accumulate=False (overwrite)",
        )
        prod = (_raw(dst).astype(np.float32) + prod).astype(np.float32)
    dst._np()[...] = prod.astype(dst.dtype).reshape(dst.shape)
    state[idx] = PSUM_MM
    fp32 = st.dtype == dt.float32 or mv.dtype == dt.float32
    current().cost.instr("tensor", instr, m, n, _tensor_cycles(n, m, fp32))
    current().cost.matmul_flops += 2 * k * (2 if double else 1) * m * n


def _matmul_tiling(tile_position, tile_size, instr: str) -> tuple[int, int]:
    """(row_size, column_size) of TensorE tiling mode (nc_matmul page, "Tiling mode"): both tuples set or
    neither (then the full 128 × 128 array); sizes 32, 64 or 128 (32 from NeuronCore-v3); each start a multiple
    of its size with the tile inside the array. The page's parameter lines say start_column must be 0 and
    column_size 128, its body describes column tiling: the body is followed (the more specific text). Tiled
    matmuls compute like untiled ones here; their parallelism is not in the cost model."""
    if not tile_position and not tile_size:
        return 128, 128
    check(
        bool(tile_position) and bool(tile_size) and len(tile_position) == 2 and len(tile_size) == 2,
        "matmul-tiling",
        f"{instr}: tile_position and tile_size must both be (row, column) pairs, got {tile_position!r}, {tile_size!r}",
    )
    (r0, c0), (rs, cs) = (int(v) for v in tile_position), (int(v) for v in tile_size)
    for what, start, size in (("row", r0, rs), ("column", c0, cs)):
        check(size in (32, 64, 128), "matmul-tiling", f"{instr}: {what} tile size must be 32, 64 or 128, got {size}")
        check(
            start % size == 0 and 0 <= start and start + size <= 128,
            "matmul-tiling",
            f"{instr}: {what} start {start} must be a multiple of the {what} size {size} inside the 128 array",
        )
    return rs, cs


def _tensor_cycles(n: int, m: int, fp32: bool, transpose: bool = False) -> float:
    """TensorE cycles of one nc_matmul (Trainium/Inferentia2 guide, Tensor Engine "Performance Consideration"):
    the MultiplyMoving issue interval is ``max(N, 64)`` (MM_INIT_LATENCY = 64 cycles), 4× for fp32 inputs
    (2× in transpose mode, trn2 guide "Built-in Transpose Support"); the LoadStationary of the M stationary
    columns runs in the background and a fast LoadStationary costs 1/4 of a MultiplyMoving of the same free
    size, so it binds only when M/4 exceeds the moving pass. ASSUMPTION: the NeuronCore-v2 figure of 64
    cycles holds on v3 (the trn2 guide gives no other)."""
    rate = (2 if transpose else 4) if fp32 else 1
    return max(max(n, 64) * rate, m / 4 * rate)


def _matmul_transpose(dst, st, mv, perf_mode, accumulate, spec):
    """``nc_matmul(is_transpose=True)``: TensorE's bit-exact transpose mode (NeuronCore-v3+; nc_matmul page,
    "Transpose mode"; trn2 guide "Built-in Transpose Support"). ``stationary`` [K, M] is the tile to transpose
    and ``moving`` the [K, K] identity; ``dst`` [M, K] in PSUM gets stationary's bits, NaN/Inf included.
    dst has stationary's dtype (the nc_transpose rule), except that on trn2 an fp8 input lands in 16-bit PSUM
    elements whose upper byte is zero (trn2 guide note), so dst is then a 2-byte dtype. Cannot combine with
    double_row (trn2 guide) or accumulate=True (a transpose overwrites)."""
    instr = "nc_matmul(is_transpose)"
    check(spec.name != "trn1", "target", f"{instr}: transpose mode needs NeuronCore-v3 or newer")
    check(
        perf_mode == matmul_perf_mode.none,
        "matmul-double-row",
        f"{instr}: double_row cannot combine with transpose mode",
    )
    check(accumulate is not True, "operand", f"{instr}: a transpose overwrites PSUM; accumulate=True is undefined")
    k, m = st.shape[0], st._free_size
    check(
        mv.shape[0] == k and mv._free_size == k,
        "matmul-shape",
        f"{instr}: moving must be the [{k}, {k}] identity, got {list(mv.shape)}",
    )
    eye = _f32(mv)
    check(
        bool(np.array_equal(eye, np.eye(k, dtype=np.float32))),
        "matmul-transpose",
        f"{instr}: moving is not an identity matrix (transpose mode multiplies by it bit-exactly only then)",
    )
    check(m <= 128 and k <= 128, "transpose-limits", f"{instr}: data is {k}x{m}, at most 128x128")
    check(
        dst.shape[0] == m and dst._free_size == k,
        "shape-mismatch",
        f"{instr}: stationary [{k}, {m}] transposes to [{m}, {k}], dst is {list(dst.shape)}",
    )
    raw = _raw(st).T.copy()
    if st._itemsize == 1 and spec.name == "trn2":
        check(
            dst._itemsize == 2,
            "dtype-mismatch",
            f"{instr}: on trn2 an fp8 transpose writes 16-bit PSUM "
            f"elements (upper byte zero); dst must be a 2-byte dtype, got {dt.name(dst.dtype)}",
        )
        _store_raw(dst, raw.view(np.uint8).astype(np.uint16), psum_state=PSUM_OTHER)
    else:
        check(
            st._itemsize != 1,
            "fp8-transpose",
            f"{instr}: a TensorE transpose of 1-byte data ({dt.name(st.dtype)}) into 1-byte PSUM is documented "
            f"for no NeuronCore version (only NeuronCore-v3's 16-bit PSUM form, trn2 architecture guide); "
            f"transpose it as bf16 or as 2-/4-byte words (dma_transpose)",
        )
        check(
            dst.dtype == st.dtype,
            "dtype-mismatch",
            f"{instr}: dst dtype {dt.name(dst.dtype)} must equal the stationary dtype {dt.name(st.dtype)}",
        )
        _store_raw(dst, raw, psum_state=PSUM_OTHER)
    fp32 = st._itemsize == 4
    current().cost.instr("tensor", "nc_matmul", m, k, _tensor_cycles(k, m, fp32, transpose=True))


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Partition ↔ free transpose (bit-exact). TensorE: ≤ 128×128, SBUF → PSUM. VectorE: ≤ 32×32."""
    instr = "nc_transpose"
    dst, x = _onchip(dst, "dst", instr), _onchip(data, "data", instr)
    default = "tensor" if (x.buffer.name == "sbuf" and dst.buffer.name == "psum") else "vector"
    eng = _engine(engine, default, ("tensor", "vector"), instr)
    check(
        dst.dtype == x.dtype,
        "dtype-mismatch",
        f"{instr}: dst dtype {dt.name(dst.dtype)} must equal data dtype {dt.name(x.dtype)}",
    )
    p, f = x.shape[0], x._free_size
    check(
        not (eng == "tensor" and x._itemsize == 1),
        "fp8-transpose",
        f"{instr}: a TensorE transpose of 1-byte data ({dt.name(x.dtype)}) into 1-byte PSUM is not documented: on "
        f"NeuronCore-v3 an fp8 transpose writes 16-bit PSUM elements (trn2 architecture guide, 'Built-in "
        f"Transpose Support'), and no public kernel transposes fp8 into fp8 PSUM. Load the data K-major (DMA) "
        f"or transpose it as bf16 / as 2- or 4-byte words (dma_transpose)",
    )
    lim = 128 if eng == "tensor" else 32
    check(p <= lim and f <= lim, "transpose-limits", f"{instr} on {eng}: data is {p}x{f}, at most {lim}x{lim}")
    if eng == "tensor":
        check(
            x.buffer.name == "sbuf" and dst.buffer.name == "psum",
            "operand-buffer",
            f"{instr} on TensorE reads SBUF and writes PSUM",
        )
    check(
        dst.shape[0] == f and dst._free_size == p,
        "shape-mismatch",
        f"{instr}: data [{p}, {f}] transposes to [{f}, {p}], dst is {list(dst.shape)}",
    )
    _store_raw(dst, _raw(x).T.copy(), psum_state=PSUM_OTHER)
    if eng == "tensor":  # the transpose mode of TensorE: a moving pass over the P-column identity
        current().cost.instr("tensor", instr, f, p, _tensor_cycles(p, f, x._itemsize == 4, transpose=True))
    else:
        _record(eng, instr, dst, (x,), cycles=p)


# ---------------------------------------------------------------------------------------------- more ISA
# The DMA, LNC, search, stream and MX instructions, one module per family; imported last because they use the
# helpers above.
from .isa_dma import dma_compute, dma_transpose  # noqa: E402,F401
from .isa_lnc import core_barrier, sendrecv  # noqa: E402,F401
from .isa_mx import nc_matmul_mx, quantize_mx  # noqa: E402,F401
from .isa_search import (  # noqa: E402,F401
    affine_select,
    local_gather,
    max8,
    nc_find_index8,
    nc_match_replace8,
    nc_n_gather,
    nonzero_with_count,
    range_select,
    select_reduce,
    tensor_scalar_cumulative,
)
from .isa_stream import bn_aggr, bn_stats, nc_stream_shuffle, tensor_tensor_scan  # noqa: E402,F401


def _unmodelled(name):
    def f(*a, **k):
        raise NkiRuleError("not-modelled", f"nisa.{name} is not implemented by the interpreter")

    f.__name__ = name
    return f


activate2 = _unmodelled("activate2 (trn3)")
exponential = _unmodelled("exponential (trn3)")
sequence_bounds = _unmodelled("sequence_bounds")
rng = _unmodelled("rng")
dropout = _unmodelled("dropout")
