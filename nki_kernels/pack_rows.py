"""NKI kernels: pack token rows of several tensors into one uint8 buffer (SPEC §1.8) and unpack a span.

Runs through the real NKI when it is importable and through the repository's NKI interpreter otherwise (see
``static_moe.nki.shim``). NKI >= 0.3 API only. All data moves as bytes: both sides of every DMA are viewed as
uint8 (a DMA between different dtypes would convert values, not copy bits).

LNC = 2 (``kernel[2]``): both kernels split their rows over the two logical cores (``nki_kernels/lnc.py``):
``pack_rows`` by 128-row tiles (core 0 the first ⌈tiles / 2⌉, core 1 the rest), ``unpack_rows`` by rows (core 0
the first ⌈R / 2⌉). Each core writes only its own rows of the shared output and copies every byte of them
exactly as one core does, so the result is bitwise the LNC = 1 result; with a single tile (or R = 1) core 1
writes nothing. The split follows nki-library's ``core/subkernels/indexed_flatten.py`` (rows over
``nl.program_id``, ⌈·/2⌉ to core 0).
"""

from __future__ import annotations

import math

from static_moe.nki.shim import nisa, nl
from static_moe.packed_layout import ALIGN, PAD_BYTE, pack_layout

from .lnc import core_share, core_tiles

# 0xFF in every byte, written 4 bytes at a time: W is a multiple of 16, so the uint8 tile views as int32 and the
# memset touches a quarter of the elements (VectorE cost is per element).
PAD_WORD = -1 if PAD_BYTE == 0xFF else None
assert PAD_WORD is not None and ALIGN % 4 == 0


def _byte_rows(t):
    """HBM tensor [T, ...] viewed as uint8 [T, bytes per row] (a free reshape + bitcast of HBM)."""
    rows = t.shape[0]
    flat = t.reshape((rows, math.prod(t.shape[1:]))) if len(t.shape) != 2 else t
    return flat.view(nl.uint8)


def pack_rows(parts, capacity):
    """Pack ``parts`` (rows 0 … T−1 of each) into uint8 [capacity, W]; everything else is 0xFF.

    Dimensions:
        T: valid rows (tokens), 1 <= T <= capacity; the same for every part.
        C: capacity (rows of the packed buffer).
        W: packed row width: sum over parts of their row bytes rounded up to 16.

    Args:
        parts (HBM): tuple of tensors [T, ...] of any dtypes (e.g. fp8 x [T, H], float32 x_s [T, H/g],
            int32 topk_idx [T, k], float32 topk_weights [T, k]).
        capacity (constant): C.

    Returns:
        packed (HBM, shared): uint8 [C, W]. Part i's bytes sit at columns [offset_i, offset_i + nbytes_i) of
        rows < T (offset_i 16-byte aligned); alignment gaps and rows T … C−1 are 0xFF, so padded int32 ids read
        −1 and padded fp32 weights NaN.

    Notes:
        - Rows are staged through SBUF 128 at a time: a [128, W] uint8 tile is memset to 0xFF (as int32 −1,
          W/4 elements per partition) once per tile,
          each part's span is DMA'd into it, and the tile leaves in one DMA of W bytes per partition over all
          partitions (W >= 2 KiB for real model shapes), so the HBM write is one large contiguous transfer.
        - Tiles made only of padding rows reuse one 0xFF tile.
        - SBUF use: 2 × W bytes per partition (one staging tile, one fill tile).
        - LNC = 2: core 0 packs the first ⌈C / 128 / 2⌉ row tiles, core 1 the others (module doc).

    Pseudocode:
        for each 128-row tile [r0, r0 + p) of this core:
            if r0 >= T: dma(packed[r0:r0+p], fill)            # all padding
            else:
                tile = memset(0xFF); for each part: dma(tile[0:v, span], part[r0:r0+v] as bytes)
                dma(packed[r0:r0+p], tile)                    # v = valid rows in the tile
    """
    assert isinstance(parts, tuple) and len(parts) >= 1, "parts must be a non-empty tuple of HBM tensors"
    rows = parts[0].shape[0]
    assert all(p.shape[0] == rows for p in parts), "every part must have the same row count T"
    assert 1 <= rows <= capacity, f"need 1 <= T={rows} <= capacity={capacity}"
    byte_parts = tuple(_byte_rows(p) for p in parts)
    spans, width = pack_layout([b.shape[1] for b in byte_parts])
    packed = nl.ndarray((capacity, width), dtype=nl.uint8, buffer=nl.shared_hbm, name="packed")
    pmax = nl.tile_size.pmax
    fill = None
    for r0 in core_tiles(capacity, pmax, "pack_rows"):
        p = min(pmax, capacity - r0)
        if r0 >= rows:
            # ---- a tile of padding rows only
            if fill is None:
                fill = nl.ndarray((pmax, width), dtype=nl.uint8, buffer=nl.sbuf, name="fill")
                nisa.memset(dst=fill.view(nl.int32), value=PAD_WORD)
            nisa.dma_copy(dst=packed[r0 : r0 + p, :], src=fill[0:p, :])
            continue
        # ---- a tile with valid rows: 0xFF background, then every part's span
        valid = min(p, rows - r0)
        tile = nl.ndarray((pmax, width), dtype=nl.uint8, buffer=nl.sbuf, name="stage")
        nisa.memset(dst=tile[0:p, :].view(nl.int32), value=PAD_WORD)
        for b, (off, n) in zip(byte_parts, spans):
            nisa.dma_copy(dst=tile[0:valid, off : off + n], src=b[r0 : r0 + valid, :])
        nisa.dma_copy(dst=packed[r0 : r0 + p, :], src=tile[0:p, :])
    return packed


def unpack_rows(packed, offset, nbytes, dtype, row_shape):
    """Copy the span [offset, offset + nbytes) of every packed row out as ``dtype [R, *row_shape]``.

    Dimensions:
        R: rows of the packed buffer (e.g. S·C gathered rows).
        W: packed row width.

    Args:
        packed (HBM): uint8 [R, W].
        offset (constant): byte offset of the span (16-byte aligned by the pack layout).
        nbytes (constant): bytes per row of the span; equals prod(row_shape) · itemsize(dtype).
        dtype (constant): nl dtype of the unpacked part.
        row_shape (constant): tuple, the trailing shape of the part.

    Returns:
        out (HBM, shared): dtype [R, *row_shape], bit-identical to the packed bytes.

    Notes:
        - One HBM→HBM DMA of R rows × nbytes, both sides viewed as uint8: no SBUF round trip (the span is
          consumed from HBM by the next kernel anyway), and one DMA's fixed cost instead of one per tile.
        - LNC = 2: one such DMA per core, core 0 rows [0, ⌈R/2⌉), core 1 the rest (module doc).

    Pseudocode:
        r0, n = this core's rows
        dma(out as uint8 [r0:r0+n, nbytes], packed[r0:r0+n, offset:offset + nbytes])
    """
    rows, width = packed.shape
    row_shape = tuple(row_shape)
    out = nl.ndarray((rows,) + row_shape, dtype=dtype, buffer=nl.shared_hbm, name="unpacked")
    out_bytes = _byte_rows(out)
    assert out_bytes.shape[1] == nbytes, (
        f"nbytes={nbytes} does not match row_shape {row_shape} of the given dtype ({out_bytes.shape[1]} bytes)"
    )
    assert 0 <= offset and offset + nbytes <= width, f"span [{offset}, {offset + nbytes}) outside W={width}"
    r0, nr = core_share(rows, 1, "unpack_rows")
    if nr:
        nisa.dma_copy(dst=out_bytes[r0 : r0 + nr, :], src=packed[r0 : r0 + nr, offset : offset + nbytes])
    return out
