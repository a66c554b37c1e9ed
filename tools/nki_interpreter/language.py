"""``nki.language`` for the interpreter: dtypes, buffers, tensor creation, tile sizes, operators, the thin
``nl.*`` tile wrappers, and runtime loops. Names and signatures follow NKI 0.3–0.6."""

from __future__ import annotations

import numpy as np

from . import isa as _isa
from . import ops as _ops
from .dtypes import as_dtype as _as_dtype
from .dtypes import (  # noqa: F401
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import check
from .ops import *  # noqa: F401,F403  (nl.add, nl.silu, ...)
from .registers import dynamic_range, fori_loop, while_loop  # noqa: F401
from .state import PMAX, current
from .tensor import (  # noqa: F401
    Buffer,
    NkiTensor,
    allocate,
    ds,
    hbm,  # noqa: F401
    private_hbm,
    psum,
    sbuf,
    shared_hbm,
)

tensor = NkiTensor


class NKIObject:
    """``nl.NKIObject``: the base class public kernels derive their trace-time config objects (often
    dataclasses) from; such objects are plain Python values at trace time.

    Annotated fields without a default get the default ``None``: released nki-library kernels construct these
    dataclasses without every annotated field (``mlp_tkg_constants.MLPTKGConstantsDimensionSizes`` is built
    without ``remainderIFused``), so the real front end tolerates a missing field; a plain ``@dataclass`` would
    raise TypeError in ``__init__``. A field read before it is set reads ``None``."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("__annotations__", {}):
            if name not in cls.__dict__:
                setattr(cls, name, None)


# ------------------------------------------------------------------------------------------------ tile sizes
class _TileSize:
    """``nl.tile_size``: hardware tile limits of the current target.

    Audited against the ``nki.language.tile_size`` page (aws-neuron-sdk ``nki/api/nki.language.tile_size.rst``)
    and the NKI 0.4 release notes. Per attribute, the page's meaning and the value here:

    - ``pmax`` = 128: maximum partition dim of a tile.
    - ``gemm_stationary_fmax`` = 128, ``gemm_moving_fmax`` = 512: nc_matmul free-size limits (nc_matmul page).
    - ``bn_stats_fmax`` = 512: bn_stats free-size limit (bn_stats page).
    - ``psum_bank_fmax`` = 512 / ``psum_bank_fmax_bytes`` = 2048: one PSUM bank per partition, fp32 elements /
      bytes.
    - ``psum_fmax`` (deprecated 0.4) = 512: the page: "maximum free dimension per PSUM bank per partition, in
      FP32 elements ... despite the name, this does not represent the free-dim size per partition" (not the
      whole partition, 4096).
    - ``psum_num_banks`` = 8 (7 with ``NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true``): usable banks per partition.
    - ``sbuf_size_bytes``: "total SBUF capacity in bytes (all partitions combined)": 128 × 224 KiB on trn2.
    - ``sbuf_fmax_bytes``: "maximum free dimension of a tile on SBUF, in bytes" = the usable per-partition SBUF
      (212984 B on trn2, see :mod:`.state`); ``sbuf_fmax`` = the same in fp32 elements (bytes // 4).
    - ``total_available_sbuf_size`` (deprecated 0.4): "despite the name, this returns the usable SBUF capacity
      *per partition*" = ``sbuf_fmax_bytes`` (not the all-partition total).
    - ``psum_min_align`` = 4, ``sbuf_min_align`` = 1: "minimum byte alignment of the PSUM / SBUF free-dimension
      address". The page gives no number. ASSUMPTION: PSUM accumulates per 4-byte element (Trainium/Inferentia2
      guide, "Near-memory accumulation in PSUM": "read-accumulate-write to every 4B element"), SBUF is byte
      addressed (its address space is bytes, "SBUF memory address space" in the same guide).
    """

    pmax = PMAX
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def gemm_stationary_fmax(self):
        return current().spec.gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self):
        return current().spec.gemm_moving_fmax

    @property
    def psum_bank_fmax_bytes(self):
        return current().spec.psum_bank_bytes

    @property
    def psum_bank_fmax(self):
        return current().spec.psum_bank_bytes // 4

    @property
    def psum_fmax(self):  # deprecated 0.4: per *bank*, not per partition
        return self.psum_bank_fmax

    @property
    def psum_num_banks(self):
        return current().spec.psum_num_banks

    @property
    def sbuf_fmax_bytes(self):
        return current().spec.sbuf_bytes_per_partition

    @property
    def sbuf_fmax(self):
        return current().spec.sbuf_bytes_per_partition // 4

    @property
    def sbuf_size_bytes(self):
        return current().spec.sbuf_physical_bytes_per_partition * PMAX

    @property
    def total_available_sbuf_size(self):  # deprecated 0.4: per partition, usable
        return self.sbuf_fmax_bytes


tile_size = _TileSize()


# ----------------------------------------------------------------------------------------------- predicates
def is_sbuf(b) -> bool:
    return isinstance(b, Buffer) and b.name == "sbuf"


def is_psum(b) -> bool:
    return isinstance(b, Buffer) and b.name == "psum"


def is_hbm(b) -> bool:
    return isinstance(b, Buffer) and b.is_hbm


def is_on_chip(b) -> bool:
    return isinstance(b, Buffer) and b.on_chip


# --------------------------------------------------------------------------------------------- creation
def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """Allocate a tensor; its contents are undefined (poisoned: NaN floats, 0xA5 bytes for ints)."""
    return allocate(shape, dtype, buffer, name)


def _filled(shape, value, dtype, buffer, name):
    t = allocate(shape, dtype, buffer, name)
    if buffer.on_chip:
        v = int(value) if np.dtype(t.dtype).kind in "iu" else float(value)
        _isa.memset(t, v)
    else:
        check(
            False,
            "not-modelled",
            "nl.zeros/ones/full in HBM: the filling instruction is undocumented; fill an SBUF tile and dma_copy it",
        )
    return t


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return _filled(shape, fill_value, dtype, buffer, name)


def zeros_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_constant(constant, dtype=None) -> NkiTensor:
    """A constant embedded in the kernel, as a ``shared_hbm`` tensor: ``constant`` is a numpy array (any NKI
    dtype) or the path of a ``.npy`` file (language API: ``nl.shared_constant``). ``dtype`` converts it."""
    import os

    from .tensor import from_numpy

    if isinstance(constant, (str, os.PathLike)):
        check(
            str(constant).endswith(".npy"),
            "operand",
            f"nl.shared_constant: a path must name a .npy file, got {constant!r}",
        )
        constant = np.load(constant, allow_pickle=False)
    a = np.asarray(constant) if dtype is None else np.asarray(constant).astype(_as_dtype(dtype))
    return from_numpy(a, shared_hbm, "constant")


def shared_identity_matrix(n: int, dtype=uint8, dst=None) -> NkiTensor:
    """An n×n identity in SBUF (for transposes / partition broadcasts through the TensorE)."""
    t = dst if dst is not None else allocate((n, n), dtype, sbuf, "identity")
    tmp = allocate((n, n), float32, sbuf, "identity_tmp")
    _isa.iota(tmp, [[1, n]], offset=0, channel_multiplier=-1)  # column - partition
    _isa.tensor_scalar(tmp, tmp, _ops.equal, 0.0)
    _isa.tensor_copy(t, tmp)
    return t


# ------------------------------------------------------------------------------------------------ loops
def affine_range(start, stop=None, step=1):
    """Deprecated alias of ``range`` (the body is unrolled at trace time)."""
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = static_range = affine_range


def program_id(axis=0) -> int:
    """This logical core's rank (0 or 1 under ``kernel[2]``, LNC = 2; 0 otherwise)."""
    check(axis == 0, "lnc", f"nl.program_id: only axis 0 exists (LNC launches are 1-D), got {axis}")
    return current().program


def num_programs(axes=0) -> int:
    return current().programs


def program_ndim() -> int:
    return 1 if current().programs > 1 else 0


def device_print(print_prefix, tensor):
    print(print_prefix, np.asarray(tensor._np()))


class no_reorder:
    def __enter__(self):
        current().loop_depth += 1000
        return self

    def __exit__(self, *exc):
        current().loop_depth -= 1000
        return False


# ------------------------------------------------------------------------------------------- tile wrappers
def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """HBM → a new SBUF tile (optionally converting the dtype)."""
    check(isinstance(src, NkiTensor) and src.buffer.is_hbm, "operand", "nl.load reads an HBM tensor")
    shape = src.shape if len(src.shape) >= 2 else (src.shape[0], 1)
    check(
        shape[0] <= PMAX, "partition-dim", f"nl.load of {list(src.shape)}: dim 0 becomes the partition dim (≤ {PMAX})"
    )
    t = allocate(shape, dtype if dtype is not None else src.dtype, sbuf, "load")
    _isa.dma_copy(t, src)
    return t


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """SBUF tile → HBM (PSUM is not accepted)."""
    check(isinstance(dst, NkiTensor) and dst.buffer.is_hbm, "operand", "nl.store writes an HBM tensor")
    check(
        isinstance(value, NkiTensor) and value.buffer.name == "sbuf",
        "operand-buffer",
        "nl.store takes an SBUF tile (evacuate PSUM first)",
    )
    _isa.dma_copy(dst, value)


def _new_like(x: NkiTensor, dtype, shape=None) -> NkiTensor:
    return allocate(shape or x.shape, dtype if dtype is not None else x.dtype, sbuf, "")


def _binary_wrapper(op, x, y, dtype=None):
    if isinstance(y, NkiTensor) and isinstance(x, NkiTensor):
        check(
            x.shape == y.shape,
            "shape-mismatch",
            f"nl.{op.name}: binary wrappers do not broadcast ({list(x.shape)} vs {list(y.shape)})",
        )
        out = _new_like(x, dtype)
        _isa.tensor_tensor(out, x, y, op)
    elif isinstance(x, NkiTensor):
        out = _new_like(x, dtype)
        _isa.tensor_scalar(out, x, op, y)
    else:
        out = _new_like(y, dtype)
        _isa.tensor_scalar(out, y, op, x, reverse0=True)
    return out


def _unary_wrapper(op, x, dtype=None):
    out = _new_like(x, dtype)
    if op.is_bitvec:
        _isa.tensor_scalar(out, x, op, None)
    elif op is _ops.reciprocal:
        _isa.reciprocal(out, x)
    elif op is _ops.copy:
        _isa.tensor_copy(out, x)
    else:
        _isa.activation(out, op, x)
    return out


for _op in _ops.ALL.values():
    _op.wrapper = _unary_wrapper if ("act" in _op.kinds or "bitvec_unary" in _op.kinds) else _binary_wrapper
del _op


def _reduction(op):
    def f(x: NkiTensor, axis, dtype=None, keepdims=False):
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        axes = tuple(sorted(a + x.ndim if a < 0 else a for a in axes))
        shape = (
            tuple(1 if i in axes else s for i, s in enumerate(x.shape))
            if keepdims
            else tuple(s for i, s in enumerate(x.shape) if i not in axes)
        )
        if len(shape) < 2:
            shape = (x.shape[0], 1)
        out = allocate(shape, dtype if dtype is not None else x.dtype, sbuf, "")
        _isa.tensor_reduce(out, op, x, axes)
        return out

    f._reduce_op = op
    f.__name__ = op.name
    return f


sum = _reduction(_ops.add)  # noqa: A001
max = _reduction(_ops.maximum)  # noqa: A001
min = _reduction(_ops.minimum)  # noqa: A001
prod = _reduction(_ops.multiply)


def where(condition, x, y, dtype=None):
    """``nl.where``: a new SBUF tile holding ``x`` where ``condition`` is non-zero and ``y`` elsewhere (tiles of
    one shape, or one of them a scalar), in ``dtype`` (default: the tile operand's). Lowered to a tensor_copy
    and a tensor_copy_predicated, so condition is a uint8/16/32 tile (that instruction's predicate rule)."""
    check(isinstance(condition, NkiTensor), "operand", "nl.where: condition must be a tile")
    base, other, pick_other_where = (x, y, "zero") if isinstance(x, NkiTensor) else (y, x, "nonzero")
    check(isinstance(base, NkiTensor), "operand", "nl.where: x or y must be a tile")
    out = allocate(base.shape, dtype if dtype is not None else base.dtype, sbuf, "where")
    _isa.tensor_copy(out, base)
    if isinstance(other, NkiTensor) and other.dtype != out.dtype:
        conv = allocate(other.shape, out.dtype, sbuf, "where_other")
        _isa.tensor_copy(conv, other)
        other = conv
    _isa.tensor_copy_predicated(out, other, condition, reverse_pred=pick_other_where == "zero")
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x=False) -> NkiTensor:
    check(transpose_x, "not-supported", "nl.matmul works only with transpose_x=True (x is [K, M])")
    out = allocate((x._free_size, y._free_size), float32, psum, "matmul")
    _isa.nc_matmul(out, x, y)
    return out


def transpose(x: NkiTensor, dtype=None) -> NkiTensor:
    out = allocate((x._free_size, x.shape[0]), x.dtype, psum, "transpose")
    _isa.nc_transpose(out, x)
    return out


# nl.bool: the public alias of nl.bool_ (defined last so the builtin stays usable in this module's code)
bool = bool_  # noqa: A001
