"""Tensors of the interpreter: byte storages in SBUF / PSUM / HBM and strided views onto them.

A :class:`Storage` is one allocation: a flat ``uint8`` numpy buffer. On-chip storages are laid out as
``[partitions, bytes_per_partition]`` (the partition stride is the allocation's free size, as on the device);
HBM storages are plain byte arrays. An :class:`NkiTensor` is a view: dtype, shape, byte strides and a byte
offset into a storage — so slicing, ``reshape``, ``permute``, ``broadcast``, ``view(dtype)`` (bitcast) and
``ap`` (raw access pattern) move no data, and every write lands in the shared bytes like on the device.

New storage is poisoned: NaN for float dtypes, the byte pattern 0xA5 for integer dtypes, so a kernel that
reads memory it never wrote produces visibly wrong results.
"""

from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .errors import NkiRuleError, check
from .state import PMAX, current

POISON_BYTE = 0xA5

SBUF, PSUM, HBM, SHARED_HBM, PRIVATE_HBM = "sbuf", "psum", "hbm", "shared_hbm", "private_hbm"
ON_CHIP = (SBUF, PSUM)


class Buffer:
    """A memory location (``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    @property
    def on_chip(self) -> bool:
        return self.name in ON_CHIP

    @property
    def is_hbm(self) -> bool:
        return self.name in (HBM, SHARED_HBM, PRIVATE_HBM)


sbuf, psum, shared_hbm, private_hbm = Buffer(SBUF), Buffer(PSUM), Buffer(SHARED_HBM), Buffer(PRIVATE_HBM)
hbm = private_hbm  # nl.hbm is an alias of private_hbm
BUFFERS = {b.name: b for b in (sbuf, psum, shared_hbm, private_hbm)}
BUFFERS[HBM] = private_hbm


class Storage:
    """One allocation's bytes. ``partitions``/``pbytes`` describe the on-chip layout (HBM: 1 × nbytes)."""

    __slots__ = ("buffer", "data", "partitions", "pbytes", "shape", "dtype", "name", "psum_state", "__weakref__")

    def __init__(self, buffer: Buffer, shape: tuple[int, ...], dtype: np.dtype, name: str = ""):
        self.buffer, self.shape, self.dtype, self.name = buffer, shape, dtype, name
        nelem = math.prod(shape)
        if buffer.on_chip:
            self.partitions = shape[0]
            self.pbytes = math.prod(shape[1:]) * dtype.itemsize
        else:
            self.partitions = 1
            self.pbytes = nelem * dtype.itemsize
        self.data = np.empty(self.partitions * self.pbytes, dtype=np.uint8)
        # PSUM: per-element matmul accumulation state (see isa.nc_matmul), in 4-byte units.
        self.psum_state = np.zeros(self.partitions * self.pbytes // 4 + 1, np.uint8) if buffer.name == PSUM else None

    @property
    def nbytes(self) -> int:
        return self.data.size

    def poison(self, dtype: np.dtype) -> None:
        if dt.is_float(dtype) and self.data.size % dtype.itemsize == 0:
            self.data.view(dtype)[:] = np.nan
        else:
            self.data[:] = POISON_BYTE


def _normalize_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(s) for s in shape)
    check(all(s > 0 for s in shape), "shape", f"every dimension must be positive, got {shape}")
    return shape


def _check_x4_target(dtype) -> None:
    """The packed MX types exist for nc_matmul_mx / quantize_mx, which are NeuronCore-v4 only (isa stub)."""
    if dt.is_x4(dtype) and not current().spec.mx:
        raise NkiRuleError(
            "dtype-unsupported",
            f"nl.{dt.name(dtype)}: no FP4 datatype or MX instruction on "
            f"{current().spec.name} (the x4 packed types are for trn3's nc_matmul_mx); decode e2m1 "
            f"nibbles with integer ops",
        )


def allocate(shape, dtype, buffer: Buffer, name: str = "") -> NkiTensor:
    """``nl.ndarray``: a fresh, poisoned allocation, counted against the on-chip budget."""
    dtype = dt.as_dtype(dtype)
    _check_x4_target(dtype)
    check(
        isinstance(buffer, Buffer),
        "buffer",
        f"buffer must be nl.sbuf / nl.psum / nl.hbm / nl.shared_hbm, "
        f"got {buffer!r} (strings are rejected since NKI 0.3)",
    )
    shape = _normalize_shape(shape)
    if buffer.on_chip:
        check(len(shape) >= 2 or True, "shape", "")
        check(
            shape[0] <= PMAX,
            "partition-dim",
            f"{buffer.name} tensor {name or ''} has partition dim (dim 0) {shape[0]} > {PMAX}: dim 0 of an "
            f"on-chip tensor is the partition dim",
        )
    ctx = current()
    if buffer.name == SHARED_HBM and ctx.lnc is not None:
        # LNC = 2: shared_hbm is one memory for both logical cores; the k-th shared allocation of each core
        # is the same tensor (SPMD kernels allocate their outputs in the same program order)
        return ctx.lnc.shared_allocation(ctx.program, shape, dtype, name)
    st = Storage(buffer, shape, dtype, name)
    st.poison(dtype)
    if buffer.on_chip:
        ctx.memory.allocate(st, buffer.name, st.pbytes, name)
    return NkiTensor._full(st, dtype, shape)


def from_numpy(a: np.ndarray, buffer: Buffer = shared_hbm, name: str = "") -> NkiTensor:
    """An HBM tensor holding a copy of numpy array ``a`` (any NKI dtype)."""
    a = np.ascontiguousarray(a)
    dtype = dt.as_dtype(a.dtype)
    shape = a.shape if a.ndim else (1,)
    st = Storage(buffer, tuple(int(s) for s in shape) or (1,), dtype, name)
    if a.size:
        st.data[:] = a.reshape(-1).view(np.uint8)
    return NkiTensor._full(st, dtype, st.shape)


def _row_major_strides(shape, itemsize) -> tuple[int, ...]:
    out, acc = [], itemsize
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class ds:
    """``nl.ds(start, size)``: a slice of ``size`` elements from ``start``."""

    def __init__(self, start: int, size: int):
        self.start, self.size = int(start), int(size)

    def as_slice(self) -> slice:
        return slice(self.start, self.start + self.size)


class NkiTensor:
    """A view onto a storage. Shapes and strides follow NKI: dim 0 of an on-chip tensor is the partition dim.

    Attributes: ``shape``, ``dtype``, ``buffer``, ``ndim``, ``size``, ``name``, ``strides`` / ``offset`` (in
    elements of ``dtype``, like NKI; the interpreter keeps them in bytes internally so bitcast views can start
    at any byte).
    """

    __slots__ = ("storage", "dtype", "shape", "bstrides", "boffset", "gather", "dynamic", "runtime_oob")

    def __init__(
        self, storage: Storage, dtype: np.dtype, shape, bstrides, boffset: int, gather=None, dynamic: bool = False
    ):
        self.storage, self.dtype = storage, dtype
        # dynamic: the start address comes from a runtime value (.ap(scalar_offset=...)); a DMA on it needs
        # descriptor generation at run time (the cost model's DGE component).
        self.dynamic = bool(dynamic or gather is not None)
        self.shape, self.bstrides, self.boffset = tuple(shape), tuple(bstrides), int(boffset)
        # gather: per-index byte offsets of dim 0 for an indirect (vector_offset) access pattern, or None.
        self.gather = gather
        # runtime_oob: an HBM view at a runtime start address (``.ap(scalar_offset=...)``) that leaves its
        # allocation; only a DMA may take it, whose ``oob_mode`` decides (see :meth:`_check_bounds`).
        self.runtime_oob = False
        self._check_bounds()

    @classmethod
    def _full(cls, st: Storage, dtype: np.dtype, shape) -> NkiTensor:
        if st.buffer.on_chip:
            bstr = (st.pbytes,) + _row_major_strides(shape[1:], dtype.itemsize)
        else:
            bstr = _row_major_strides(shape, dtype.itemsize)
        return cls(st, dtype, shape, bstr, 0)

    # -------------------------------------------------------------------------------------------- properties
    @property
    def buffer(self) -> Buffer:
        return self.storage.buffer

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def _itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(s // self._itemsize for s in self.bstrides)

    @property
    def offset(self) -> int:
        return self.boffset // self._itemsize

    @property
    def _on_chip(self) -> bool:
        return self.storage.buffer.on_chip

    @property
    def _pstart(self) -> int:
        """First partition of an on-chip view."""
        return self.boffset // self.storage.pbytes if self.storage.pbytes else 0

    @property
    def _foffset(self) -> int:
        """Byte offset of the view's first element inside its partition (on-chip)."""
        return self.boffset % self.storage.pbytes if self.storage.pbytes else 0

    @property
    def _free_size(self) -> int:
        """Elements per partition (on-chip: all dims but 0)."""
        return math.prod(self.shape[1:]) if self.ndim > 1 else 1

    def __repr__(self) -> str:
        return (
            f"NkiTensor({self.buffer.name}, {dt.name(self.dtype)}{list(self.shape)}, name={self.name!r}, "
            f"offset={self.boffset}B, strides={self.bstrides}B)"
        )

    _NOT_NKI = {
        "free_size": "math.prod(t.shape[1:])",
        "partition_start": "the slice you took",
        "itemsize": "a dtype table",
        "on_chip": "nl.is_on_chip(t.buffer)",
        "numpy": "nl.store / dma_copy to a shared_hbm output",
    }

    def __getattr__(self, name):
        # Kernels must run unchanged through the real NKI: interpreter internals are underscored, and the
        # attributes one might reach for by habit get a pointer to the NKI way.
        if name in NkiTensor._NOT_NKI:
            raise NkiRuleError(
                "not-nki-api",
                f"NkiTensor.{name} is not part of the NKI tensor API (shape, strides, "
                f"offset, dtype, buffer, ndim, size, name); use {NkiTensor._NOT_NKI[name]}",
            )
        raise AttributeError(f"NkiTensor has no attribute {name!r}")

    def __bool__(self):
        # A tensor is a Python object at trace time, and the real front end treats it like one: ``if t:`` is
        # true (public kernels write ``if bias:`` for an optional tensor argument). What the docs refuse is
        # reading a tensor's *values* at trace time (language guide: the body is a metaprogram; only nisa.*
        # instructions and runtime loops reach the device) — comparisons, arithmetic and ``int(t)`` raise below.
        return True

    def __int__(self):
        raise NkiRuleError(
            "python-on-tensor",
            "a tensor's values are not known at trace time; load them into a "
            "register (nisa.register_load) for runtime control",
        )

    __float__ = __index__ = __int__

    def __setitem__(self, key, value):
        raise NkiRuleError(
            "tensor-assignment",
            "NKI >= 0.3 tensors are written only by instructions "
            "(nisa.*, nl.store, nl.load); item assignment is not part of the language",
        )

    def __len__(self):
        return self.shape[0]

    # ---------------------------------------------------------------------------------------------- checks
    def _check_bounds(self) -> None:
        if self.gather is not None or any(s == 0 for s in self.shape):
            return
        lo = self.boffset + sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.bstrides))
        hi = self.boffset + sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.bstrides)) + self._itemsize
        if self.dynamic and not self._on_chip and not (lo >= 0 and hi <= self.storage.nbytes):
            # Decision (docs win): a runtime start address is checked when the DMA runs, not when the view is
            # made. The ISA ``dma_copy`` page: with software or hardware DGE "the src and dst tensors can have a
            # dynamic start address ... out-of-bound address checking is turned on automatically during
            # execution", an error by default, skipped with ``oob_mode=oob_mode.skip`` (``nki.isa.oob_mode``:
            # "silently skip the runtime out-of-bounds access"). nki-library's ``indexed_flatten`` (LNC = 2)
            # relies on it: rows a core does not own get offset -1000000 and their writes are skipped.
            self.runtime_oob = True
            return
        check(
            lo >= 0 and hi <= self.storage.nbytes,
            "out-of-bounds",
            f"view {dt.name(self.dtype)}{list(self.shape)} of {self.name or self.buffer.name} touches bytes "
            f"[{lo}, {hi}) of a {self.storage.nbytes}-byte allocation",
        )
        if self._on_chip and self.ndim >= 1:
            pb = self.storage.pbytes
            check(
                self.bstrides[0] == pb or self.shape[0] == 1,
                "partition-dim",
                f"dim 0 of an on-chip view must step one partition ({pb} B); got stride {self.bstrides[0]} B "
                f"(a strided or permuted partition dim is not addressable)",
            )
            # the free-dim part of the pattern must stay inside one partition
            flo = self._foffset + sum(min(0, (n - 1) * s) for n, s in zip(self.shape[1:], self.bstrides[1:]))
            fhi = self._foffset + sum(max(0, (n - 1) * s) for n, s in zip(self.shape[1:], self.bstrides[1:]))
            check(
                flo >= 0 and fhi + self._itemsize <= pb,
                "out-of-bounds",
                f"free-dim pattern of view {list(self.shape)} leaves its partition ({pb} B per partition)",
            )
            check(
                self._pstart + self.shape[0] <= self.storage.partitions,
                "out-of-bounds",
                f"partitions [{self._pstart}, {self._pstart + self.shape[0]}) of a "
                f"{self.storage.partitions}-partition tensor",
            )

    def _derive(self, shape, bstrides, boffset, dtype=None) -> NkiTensor:
        check(self.gather is None, "indirect-view", "an indirect (vector_offset) view cannot be re-viewed")
        return NkiTensor(
            self.storage, dtype if dtype is not None else self.dtype, shape, bstrides, boffset, dynamic=self.dynamic
        )

    # ------------------------------------------------------------------------------------------ data access
    def _np(self) -> np.ndarray:
        """A live numpy view of the elements (writes go to the storage). Interpreter-internal."""
        if self.gather is not None:
            raise NkiRuleError("indirect-view", "indirect views are only usable as dma_copy operands")
        if self.runtime_oob:
            raise NkiRuleError(
                "dma-oob",
                f"view {dt.name(self.dtype)}{list(self.shape)} of {self.name or self.buffer.name} at a runtime "
                f"address leaves its {self.storage.nbytes}-byte allocation: only dma_copy with "
                f"oob_mode=nisa.oob_mode.skip may take it (the runtime check skips its out-of-bounds rows)",
            )
        return np.ndarray(self.shape, self.dtype, buffer=self.storage.data, offset=self.boffset, strides=self.bstrides)

    # ---------------------------------------------------------------------------------------------- indexing
    def __getitem__(self, key) -> NkiTensor:
        if not isinstance(key, tuple):
            key = (key,)
        n_ell = sum(k is Ellipsis for k in key)
        check(n_ell <= 1, "index", "at most one ... in an index")
        if n_ell:
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1 :]
        check(len(key) <= self.ndim, "index", f"{len(key)} indices for a {self.ndim}-D tensor {list(self.shape)}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, off, dropped = [], [], self.boffset, []
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.bstrides)):
            if isinstance(k, ds):
                k = k.as_slice()
            if isinstance(k, (int, np.integer)):
                k = int(k)
                if k < 0:
                    k += n
                check(0 <= k < n, "index", f"index {k} out of range for dim {d} of size {n}")
                off += k * s
                if self._on_chip and d == 0:
                    shape.append(1)
                    strides.append(s)
                else:
                    dropped.append(len(shape))
                    shape.append(1)
                    strides.append(s)
            elif isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                check(step >= 1, "index", f"slice step must be >= 1, got {step}")
                start = 0 if start is None else int(start)
                stop = n if stop is None else int(stop)
                start = start + n if start < 0 else start
                stop = stop + n if stop < 0 else stop
                check(
                    0 <= start < stop <= n,
                    "index",
                    f"slice [{start}:{stop}] is empty or out of range for dim {d} of size {n}",
                )
                if self._on_chip and d == 0:
                    check(
                        step == 1,
                        "partition-dim",
                        "the partition dim (dim 0) of an on-chip tensor can only be sliced with step 1",
                    )
                off += start * s
                shape.append(-(-(stop - start) // step))
                strides.append(s * step)
            else:
                raise NkiRuleError(
                    "index",
                    f"unsupported index {k!r} (ints, slices, nl.ds and ... only; use "
                    f".ap(scalar_offset=...) for runtime offsets)",
                )
        # An int drops its dim, except on-chip dim 0, and except where that would leave fewer than 2 dims
        # on chip.
        if dropped:
            keep_min = 2 if self._on_chip else 0
            drop = list(dropped)
            while drop and len(shape) - len(drop) < keep_min:
                drop.pop()
            shape = [x for i, x in enumerate(shape) if i not in drop]
            strides = [x for i, x in enumerate(strides) if i not in drop]
            if not shape:
                shape, strides = [1], [self._itemsize]
        return self._derive(shape, strides, off)

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> NkiTensor:
        check(
            isinstance(index, (int, np.integer)),
            "select",
            "only static (int) select is supported by the interpreter; use .ap(scalar_offset=...) for runtime offsets",
        )
        check(not (self._on_chip and dim == 0), "partition-dim", "select cannot remove dim 0 of an on-chip tensor")
        n = self.shape[dim]
        index = int(index) + (n if index < 0 else 0)
        check(0 <= index < n, "index", f"select index {index} out of range for dim {dim} of size {n}")
        shape = self.shape[:dim] + self.shape[dim + 1 :]
        strides = self.bstrides[:dim] + self.bstrides[dim + 1 :]
        return self._derive(shape or (1,), strides or (self._itemsize,), self.boffset + index * self.bstrides[dim])

    # ------------------------------------------------------------------------------------------- reshaping
    def reshape(self, shape) -> NkiTensor:
        shape = _normalize_shape(shape)
        check(
            math.prod(shape) == self.size,
            "reshape",
            f"reshape {list(self.shape)} -> {list(shape)} changes the element count",
        )
        if self._on_chip:
            check(
                shape[0] == self.shape[0],
                "partition-dim",
                f"reshape of an on-chip tensor must keep dim 0 (the partition dim): {list(self.shape)} -> "
                f"{list(shape)}",
            )
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), self.shape, self.bstrides)
        probe = probe.view()
        try:
            probe.shape = shape
        except AttributeError as e:
            raise NkiRuleError(
                "reshape",
                f"reshape {list(self.shape)} -> {list(shape)} is incompatible with the "
                f"view's layout (strides {self.bstrides} B); it would need a copy",
            ) from e
        return self._derive(shape, probe.strides, self.boffset)

    def reshape_dim(self, dim: int, shape) -> NkiTensor:
        check(not (self._on_chip and dim == 0), "partition-dim", "reshape_dim cannot touch dim 0 on chip")
        return self.reshape(self.shape[:dim] + tuple(shape) + self.shape[dim + 1 :])

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        check(not (self._on_chip and start_dim == 0), "partition-dim", "flatten_dims cannot touch dim 0 on chip")
        n = math.prod(self.shape[start_dim : end_dim + 1])
        return self.reshape(self.shape[:start_dim] + (n,) + self.shape[end_dim + 1 :])

    def expand_dim(self, dim: int) -> NkiTensor:
        check(not (self._on_chip and dim == 0), "partition-dim", "expand_dim cannot insert before dim 0 on chip")
        return self._derive(
            self.shape[:dim] + (1,) + self.shape[dim:],
            self.bstrides[:dim] + (self._itemsize,) + self.bstrides[dim:],
            self.boffset,
        )

    def squeeze_dim(self, dim: int) -> NkiTensor:
        check(not (self._on_chip and dim == 0), "partition-dim", "squeeze_dim cannot remove dim 0 on chip")
        check(self.shape[dim] == 1, "reshape", f"squeeze_dim({dim}) of a dim of size {self.shape[dim]}")
        return self._derive(
            self.shape[:dim] + self.shape[dim + 1 :], self.bstrides[:dim] + self.bstrides[dim + 1 :], self.boffset
        )

    def permute(self, dims) -> NkiTensor:
        dims = tuple(int(d) for d in dims)
        check(sorted(dims) == list(range(self.ndim)), "permute", f"{dims} is not a permutation of {self.ndim} dims")
        check(
            not self._on_chip or dims[0] == 0,
            "partition-dim",
            "permute of an on-chip tensor must keep dim 0 first (moving data across partitions needs a "
            "transpose instruction)",
        )
        return self._derive([self.shape[d] for d in dims], [self.bstrides[d] for d in dims], self.boffset)

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        check(
            not (self._on_chip and dim == 0),
            "cross-partition",
            "broadcast along dim 0 of an on-chip tensor would copy across partitions; use a matmul with "
            "ones, nc_stream_shuffle or a DMA",
        )
        check(self.shape[dim] == 1, "broadcast", f"broadcast dim {dim} has size {self.shape[dim]}, expected 1")
        shape = list(self.shape)
        strides = list(self.bstrides)
        shape[dim], strides[dim] = int(size), 0
        return self._derive(shape, strides, self.boffset)

    def broadcast_to(self, shape) -> NkiTensor:
        shape = _normalize_shape(shape)
        check(len(shape) == self.ndim, "broadcast", f"broadcast_to {list(shape)} from {list(self.shape)}")
        t = self
        for d, (a, b) in enumerate(zip(self.shape, shape)):
            if a != b:
                t = t.broadcast(d, b)
        return t

    def view(self, dtype) -> NkiTensor:
        """Bitcast: reinterpret the bytes; the contiguous last dim is rescaled by the itemsize ratio."""
        dtype = dt.as_dtype(dtype)
        _check_x4_target(dtype)
        old, new = self._itemsize, dtype.itemsize
        if old == new:
            return self._derive(self.shape, self.bstrides, self.boffset, dtype)
        check(
            self.bstrides[-1] == old or self.shape[-1] == 1,
            "view",
            f"view({dt.name(dtype)}) needs a contiguous last dim; stride is {self.bstrides[-1]} B",
        )
        nbytes = self.shape[-1] * old
        check(
            nbytes % new == 0,
            "view",
            f"view({dt.name(dtype)}): last dim of {self.shape[-1]} × {old} B is not a multiple of {new} B",
        )
        check(not (self._on_chip and self.ndim == 1), "partition-dim", "view() would rescale the partition dim")
        shape = self.shape[:-1] + (nbytes // new,)
        strides = self.bstrides[:-1] + (new,)
        return self._derive(shape, strides, self.boffset, dtype)

    reinterpret_cast = view

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Raw access pattern ``[[step, count], ...]`` (elements, outermost first) on this tensor's storage.

        ``offset`` (elements) is relative to the storage start (None keeps this view's offset). On chip, the
        first pair is the partition pair and its step must equal the storage's free size in elements.
        ``scalar_offset`` (a register or a (1, 1) SBUF tensor) adds ``value · prod(self.shape[indirect_dim+1:])``
        elements; ``vector_offset`` ((P, 1) SBUF indices, HBM tensor) gathers or scatters rows of
        ``prod(self.shape[1:])`` elements, checked against ``self.shape[0]`` rows.

        Decision (docs win): the indirect unit is the shape of the tensor ``.ap`` is called on — a reshaped view
        included — not of the underlying allocation. The nki.isa ``dma_copy`` page's indirect examples index
        the tensor they call ``.ap`` on (``data.ap(pattern=[[F, P], [1, F]], vector_offset=idx)`` with rows of
        ``data.shape[1]`` elements), and the access-pattern deep dive (``deep-dives/nki-aps``) gives, for
        ``a = arange(32).reshape(4, 8)``, ``a.reshape((2, 16)).ap([[16, 1], [1, 16]], 0, scalar_offset=[[1]],
        indirect_dim=0)`` starting at element 16. Until this fix the interpreter used the allocation's shape
        (8 elements a step there) and refused scatters into ``x.reshape((T * E,))`` views as out of range.
        """
        dtype = dt.as_dtype(dtype) if dtype is not None else self.dtype
        isz = dtype.itemsize
        check(
            scalar_offset is None or vector_offset is None,
            "ap",
            "scalar_offset and vector_offset are mutually exclusive",
        )
        pattern = [tuple(int(x) for x in p) for p in pattern]
        check(all(len(p) == 2 and p[1] >= 1 for p in pattern), "ap", f"pattern must be [[step, count], ...]: {pattern}")
        if offset is None:
            check(self.boffset % isz == 0, "ap", "view offset is not a multiple of the ap dtype size")
            boff = self.boffset
        else:
            boff = int(offset) * isz
        st = self.storage
        if scalar_offset is not None:
            from .registers import scalar_value

            v = scalar_value(scalar_offset)
            check(0 <= indirect_dim < self.ndim, "ap", f"indirect_dim={indirect_dim} for a {self.ndim}-D tensor")
            unit = math.prod(self.shape[indirect_dim + 1 :]) * self._itemsize
            boff += v * unit
        shape = [c for _, c in pattern]
        bstr = [s * isz for s, _ in pattern]
        if st.buffer.on_chip:
            check(
                pattern[0][0] * isz == st.pbytes or pattern[0][1] == 1,
                "ap",
                f"on-chip access pattern: the first pair is the partition pair and its step must be the free "
                f"size of the allocation ({st.pbytes // isz} elements of {dt.name(dtype)}), got {pattern[0][0]}",
            )
            bstr[0] = st.pbytes
        if vector_offset is not None:
            check(
                indirect_dim == 0 and not st.buffer.on_chip,
                "ap",
                "vector_offset addresses rows (indirect_dim=0) of an HBM tensor only",
            )
            # (P, N) index tiles are read partition-first ("flat_indices = indices.T.flatten()", dma_transpose
            # page); for the usual (P, 1) that is plain row order.
            idx = np.asarray(vector_offset._np()).reshape(vector_offset.shape[0], -1).T.reshape(-1).astype(np.int64)
            check(len(idx) >= shape[0], "ap", f"vector_offset has {len(idx)} indices for {shape[0]} rows")
            idx = idx[: shape[0]]
            row = math.prod(self.shape[1:]) * self._itemsize
            gather = [boff + int(i) * row for i in idx]
            return NkiTensor(st, dtype, shape, bstr, boff, gather=(gather, row, self.shape[0], idx))
        return NkiTensor(st, dtype, shape, bstr, boff, dynamic=scalar_offset is not None or self.dynamic)

    # ---------------------------------------------------------------------------------------------- queries
    def is_contiguous(self) -> bool:
        exp = _row_major_strides(self.shape, self._itemsize)
        return all(a == b or n == 1 for a, b, n in zip(self.bstrides, exp, self.shape))

    def get_pattern(self) -> list[list[int]]:
        return [[s // self._itemsize, n] for s, n in zip(self.bstrides, self.shape)]

    def is_indirect(self) -> bool:
        return self.gather is not None

    # Arithmetic on tensors is not part of NKI >= 0.3 (use nl.* or nisa.*): fail loudly.
    def _no_arith(self, *_):
        raise NkiRuleError(
            "python-on-tensor", "Python operators on tensors are not NKI; use nl.add / nisa.* instructions"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = _no_arith
    __lt__ = __le__ = __gt__ = __ge__ = _no_arith
