"""Reference pack_rows / unpack_rows (SPEC §1.8): pure torch, the executable spec of packing rows by the layout of
static_moe.packed_layout and copying spans back out."""

from __future__ import annotations

import math

import torch

# The layout itself (spans, alignment, padding byte) is production code; the reference packs by it.
from ..packed_layout import ALIGN, PAD_BYTE, aligned, pack_layout, part_nbytes

__all__ = ["ALIGN", "PAD_BYTE", "aligned", "pack_layout", "part_nbytes", "pack_rows", "unpack_rows"]


def pack_rows(parts: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """Pack parts ``[T, ...]`` (any dtypes) into uint8 ``[capacity, W]``.

    Part i's bytes sit at columns ``[offset_i, offset_i + nbytes_i)``; alignment gaps and rows T … capacity−1
    are 0xFF, so padded int32 ids read −1 and padded fp32 weights NaN.
    """
    t = parts[0].shape[0]
    spans, width = pack_layout([part_nbytes(p) for p in parts])
    out = torch.full((capacity, width), PAD_BYTE, dtype=torch.uint8, device=parts[0].device)
    for p, (off, n) in zip(parts, spans):
        if n and t:
            out[:t, off : off + n] = p.contiguous().view(torch.uint8).reshape(t, n)
    return out


def unpack_rows(
    packed: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, row_shape: list[int]
) -> torch.Tensor:
    """Copy the span ``[offset, offset + nbytes)`` of every row of uint8 ``packed`` [R, W] out as
    ``dtype [R, *row_shape]``."""
    if dtype == torch.bool or dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        raise TypeError(
            f"unpack_rows: dtype {dtype} cannot be unpacked from raw bytes (bool and quantized dtypes "
            "are refused): unpack uint8 and convert"
        )
    width = packed.shape[1]
    if not (0 <= offset <= width and 0 <= nbytes <= width - offset):
        end = offset + nbytes if offset + nbytes < 2**63 else "(overflows int64)"
        raise ValueError(
            f"unpack_rows: the span [offset, offset + nbytes) = [{offset}, {end}) must lie inside the "
            f"packed row width W = packed.size(1) = {width} (offset = {offset}, nbytes = {nbytes})"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(row_shape) * itemsize != nbytes:
        raise ValueError(
            f"unpack_rows: nbytes must equal prod(row_shape) * itemsize = prod({list(row_shape)}) * "
            f"{itemsize} = {math.prod(row_shape) * itemsize} for {dtype}, got {nbytes}"
        )
    rows = packed.shape[0]
    if nbytes == 0:  # a [R, 0] byte view cannot be reinterpreted as a wider dtype
        return torch.empty((rows, *row_shape), dtype=dtype, device=packed.device)
    span = packed[:, offset : offset + nbytes].contiguous()
    return span.view(dtype).reshape(rows, *row_shape).clone()
