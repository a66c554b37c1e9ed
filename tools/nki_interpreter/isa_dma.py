"""DMA instructions beyond ``dma_copy``: ``dma_transpose`` and ``dma_compute``. Semantics and limits: the
aws-neuron-sdk isa stub (``nki/api/nki/isa/__init__.py``) and the Trainium2 architecture guide ("DMA
Transpose"); one docstring per instruction below.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from . import ops as O
from .errors import check
from .isa import NkiTensor, _cast, _enum, _indirect_rows, _record_dma, _reduce_op, _store_raw, _t
from .isa import dge_mode as DGE
from .isa import oob_mode as OOB

_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def _values(t: NkiTensor, oob) -> np.ndarray:
    """The elements of a (possibly indirect) view in its logical shape (a copy); skipped rows are zero."""
    if t.gather is None:
        return np.array(t._np())
    out = np.zeros(t.shape, t.dtype)
    for i, row in _indirect_rows(t, oob):
        if row is not None:
            out[i] = row
    return out


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=DGE.unknown, oob_mode=OOB.error, name=None):
    """Transpose over DMA into SBUF: 2-D ``(1, 0)``, 3-D ``(2, 1, 0)``, 4-D ``(3, 1, 2, 0)``; ``dst[...] =
    src.transpose(axes)``, bit-exact for 2- and 4-byte dtypes (trn2 guide), src in HBM or SBUF, dtypes equal.
    No runtime (``scalar_offset`` register) address on either side: the compiler refuses it (NKI-415, quoted in
    nki-library ``mlp_tkg_gate_up_projection.py``, which loads with ``dma_copy`` and transposes on TensorE).
    ``dge_mode=hwdge`` adds: ``src.shape[0] == 16``, ``src.shape[-1] % 128 == 0``, 2-byte dtype. An indirect
    src (``.ap(vector_offset=...)``, HBM) gathers rows first (software DGE): 2-byte dtype, last dim ≤ 128,
    rows a multiple of 16. Throughput: 90 % (HBM→SBUF) / 50 % (SBUF→SBUF) of a copy (trn2 guide)."""
    instr = "dma_transpose"
    dst, src = _t(dst, "dst", instr), _t(src, "src", instr)
    mode = _enum(dge_mode, DGE, "dge_mode")
    oob = _enum(oob_mode, OOB, "oob_mode")
    check(dst.buffer.name == "sbuf", "operand-buffer", f"{instr}: dst must be in SBUF, got {dst.buffer.name}")
    check(src.buffer.name != "psum", "dma-psum", f"{instr}: src must be in HBM or SBUF, got PSUM")
    check(
        dst.dtype == src.dtype,
        "dtype-mismatch",
        f"{instr}: src.dtype == dst.dtype is required ({dt.name(src.dtype)} vs {dt.name(dst.dtype)})",
    )
    check(
        src._itemsize in (2, 4),
        "dma-transpose-dtype",
        f"{instr}: DMA transpose is bit-accurate for 2- and 4-byte dtypes only, got {dt.name(src.dtype)}",
    )
    check(src.ndim in _AXES, "dma-transpose-shape", f"{instr}: src must be 2- to 4-D, got {list(src.shape)}")
    want = _AXES[src.ndim]
    axes = want if axes is None else tuple(int(a) for a in axes)
    check(axes == want, "dma-transpose-shape", f"{instr}: axes for a {src.ndim}-D tile must be {want}, got {axes}")
    check(priority is None, "target", f"{instr}: priority= is NeuronCore-v4 only")
    check(
        not any(t.dynamic and t.gather is None for t in (src, dst)),  # indirect (vector_offset) views: below
        "dma-transpose-dynamic",
        f"{instr}: a runtime (register) address is not supported by dma_transpose (NKI-415; nki-library "
        f"mlp_tkg_gate_up_projection.py): dma_copy the rows, then transpose them on TensorE (nc_transpose)",
    )
    indirect = src.gather is not None
    if indirect:
        check(
            mode in (DGE.unknown, DGE.swdge),
            "dge-mode",
            f"{instr}: an indirect transpose runs on software DGE (dge_mode unknown or swdge)",
        )
        check(
            src.buffer.is_hbm and src._itemsize == 2 and src.shape[-1] <= 128 and src.shape[0] % 16 == 0,
            "dma-transpose-shape",
            f"{instr}: indirect transpose needs an HBM src of a 2-byte dtype, last dim "
            f"≤ 128 and rows a multiple of 16; got {dt.name(src.dtype)}{list(src.shape)}",
        )
    else:
        check(
            mode in (DGE.unknown, DGE.hwdge), "dge-mode", f"{instr}: a direct transpose takes dge_mode unknown or hwdge"
        )
        if mode == DGE.hwdge:
            check(
                src.shape[0] == 16 and src.shape[-1] % 128 == 0 and src._itemsize == 2,
                "dma-transpose-shape",
                f"{instr}: hwdge transpose needs src.shape[0] == 16, src.shape[-1] % 128 == 0 and a 2-byte "
                f"dtype; got {dt.name(src.dtype)}{list(src.shape)}",
            )
    vals = np.transpose(_values(src, oob), axes)
    check(
        tuple(dst.shape) == vals.shape,
        "shape-mismatch",
        f"{instr}: src {list(src.shape)} transposes to {list(vals.shape)}, dst is {list(dst.shape)}",
    )
    _store_raw(dst, np.ascontiguousarray(vals))
    _record_dma(
        src, dst, dge=indirect or src.dynamic or mode != DGE.unknown, efficiency=0.9 if src.buffer.is_hbm else 0.5
    )


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=OOB.error, name=None):
    """DMA-engine arithmetic: ``dst = srcs[0] + srcs[1] + …`` in fp32, cast to dst.dtype (``reduce_op`` must be
    nl.add, every scale 1.0, at most 16 sources, equal element counts). With an indirect (vector_offset) HBM
    operand it is a read-modify-write of exactly two sources: scatter ``dst(HBM)[idx] += src(SBUF)`` (one
    source is dst itself) or gather ``dst(SBUF) += src(HBM)[idx]`` (one source is dst). Indices must be
    unique (``unique_indices=True``; duplicates are undefined on hardware and refused here)."""
    instr = "dma_compute"
    dst = _t(dst, "dst", instr)
    srcs = list(srcs)
    oob = _enum(oob_mode, OOB, "oob_mode")
    check(_reduce_op(reduce_op) is O.add, "op", f"{instr}: reduce_op must be nl.add (the only one supported)")
    check(1 <= len(srcs) <= 16, "operand", f"{instr}: 1 to 16 source tensors, got {len(srcs)}")
    check(
        scales is None or all(float(s) == 1.0 for s in scales),
        "operand",
        f"{instr}: every scale must be 1.0 (or scales=None), got {scales}",
    )
    check(
        scales is None or len(scales) == len(srcs),
        "operand",
        f"{instr}: {len(scales or [])} scales for {len(srcs)} sources",
    )
    srcs = [_t(s, f"srcs[{i}]", instr) for i, s in enumerate(srcs)]
    for t in [dst] + srcs:
        check(t.buffer.name != "psum", "dma-psum", f"{instr}: DMA cannot access PSUM")
        check(t.size == dst.size, "dma-shape", f"{instr}: every tensor needs {dst.size} elements, one has {t.size}")
    indirect = [t for t in [dst] + srcs if t.gather is not None]
    if not indirect:
        acc = sum(np.array(s._np()).astype(np.float32).reshape(-1) for s in srcs)
        dst._np()[...] = _cast(np.asarray(acc, np.float32), dst.dtype, instr).reshape(dst.shape)
    else:
        check(
            len(srcs) == 2 and unique_indices,
            "operand",
            f"{instr}: read-modify-write needs exactly 2 sources and unique_indices=True",
        )
        gather, row_bytes, nrows, idx = indirect[0].gather
        valid = idx[(idx >= 0) & (idx < nrows)]
        check(
            len(np.unique(valid)) == len(valid),
            "dma-indices",
            f"{instr}: duplicate indices in a read-modify-write (non-unique indices are not supported)",
        )
        if dst.gather is not None:  # scatter: dst(HBM)[idx] += src(SBUF)
            other = [s for s in srcs if not (s.gather is not None and s.gather[0] == dst.gather[0])]
            check(
                len(other) == 1 and other[0].buffer.name == "sbuf",
                "operand",
                f"{instr}: scatter RMW needs srcs = (dst's indirect view, an SBUF tensor)",
            )
            add = np.array(other[0]._np()).astype(np.float32).reshape(dst.shape[0], -1)
            for i, row in _indirect_rows(dst, oob):
                if row is not None:
                    row[...] = _cast(np.array(row).astype(np.float32).reshape(-1) + add[i], dst.dtype, instr).reshape(
                        row.shape
                    )
        else:  # gather: dst(SBUF) += src(HBM)[idx]
            hb = indirect[0]
            mine = [s for s in srcs if s is not hb]
            check(
                dst.buffer.name == "sbuf"
                and len(mine) == 1
                and mine[0].storage is dst.storage
                and mine[0].boffset == dst.boffset,
                "operand",
                f"{instr}: gather RMW needs dst in SBUF and srcs = (dst, an indirect HBM view)",
            )
            cur = np.array(dst._np()).astype(np.float32).reshape(dst.shape[0], -1)
            got = _values(hb, oob).astype(np.float32).reshape(dst.shape[0], -1)
            if oob == OOB.skip:
                inb = ((idx >= 0) & (idx < nrows))[:, None]
                got = np.where(inb, got, 0.0)
            dst._np()[...] = _cast(cur + got, dst.dtype, instr).reshape(dst.shape)
    rmw = any(s.storage is dst.storage for s in srcs)  # dst is read back: a read-modify-write
    for s in srcs:
        if s.storage is not dst.storage:
            _record_dma(s, dst, dge=bool(indirect) or s.dynamic or dst.dynamic, rmw=rmw)
