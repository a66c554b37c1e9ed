"""pack_rows / unpack_rows: wrappers and fake kernels (SPEC §1.8)."""

from __future__ import annotations

import torch

from ..reference.pack_rows import pack_layout, part_nbytes


def pack_rows(parts: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """Pack parts ``[T, ...]`` into uint8 ``[capacity, W]`` (16-byte aligned spans, padded rows 0xFF)."""
    return torch.ops.static_moe.pack_rows(list(parts), capacity)


def unpack_rows(packed: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, row_shape) -> torch.Tensor:
    """Copy one span of uint8 ``packed [R, W]`` out as ``dtype [R, *row_shape]``."""
    return torch.ops.static_moe.unpack_rows(packed, offset, nbytes, dtype, list(row_shape))


@torch.library.register_fake("static_moe::pack_rows")
def _pack_rows_fake(parts, capacity):
    _, width = pack_layout([part_nbytes(p) for p in parts])
    return parts[0].new_empty((capacity, width), dtype=torch.uint8)


@torch.library.register_fake("static_moe::unpack_rows")
def _unpack_rows_fake(packed, offset, nbytes, dtype, row_shape):
    return packed.new_empty((packed.shape[0], *row_shape), dtype=dtype)
