"""pack_rows / unpack_rows: wrappers and fake kernels (SPEC §1.8).

The fake kernels run the same C++ argument checks as the CPU and CUDA kernels (csrc/checks/pack_rows.h, through
``static_moe._C``), so a traced graph rejects bad inputs with the eager messages. Under dynamic shapes (symbolic
sizes, which the C++ checks cannot read) they fall back to computing the output shape only.
"""

from __future__ import annotations

import torch

from .. import _C
from ..packed_layout import pack_layout, part_nbytes


def pack_rows(parts: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """Pack parts ``[T, ...]`` (any dtypes, one device, same T ≤ capacity) into uint8 ``[capacity, W]``.

    Part i occupies columns ``[offset_i, offset_i + nbytes_i)`` (16-byte aligned offsets, nbytes_i = bytes of one
    row); gaps and rows T … capacity−1 are 0xFF.
    """
    if len(parts) == 0:  # the dispatcher cannot route an empty tensor list to any backend: say what is wrong here
        raise ValueError("pack_rows: parts must hold at least one tensor [T, ...], got an empty list")
    return torch.ops.static_moe.pack_rows(list(parts), capacity)


def unpack_rows(packed: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, row_shape) -> torch.Tensor:
    """Copy one span of uint8 ``packed [R, W]`` out as a fresh ``dtype [R, *row_shape]`` tensor."""
    return torch.ops.static_moe.unpack_rows(packed, offset, nbytes, dtype, list(row_shape))


def _symbolic(*tensors: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for t in tensors for s in t.shape)


@torch.library.impl("static_moe::pack_rows", "CompositeExplicitAutograd")
def _pack_rows_no_backend(parts, capacity):
    # Reached only where no backend kernel is: an empty list (it has no device to dispatch on) or a device
    # static_moe has no kernels for. Without this the dispatcher's NotImplementedError would list its tables.
    if len(parts) == 0:
        raise ValueError("pack_rows: parts must hold at least one tensor [T, ...], got an empty list")
    raise NotImplementedError(f"pack_rows: no kernel for tensors on {parts[0].device} (CPU and CUDA have one)")


@torch.library.register_fake("static_moe::pack_rows")
def _pack_rows_fake(parts, capacity):
    if _symbolic(*parts) or isinstance(capacity, torch.SymInt):
        _, width = pack_layout([part_nbytes(p) for p in parts])
    else:
        width = _C.check_pack_rows(list(parts), capacity)
    return parts[0].new_empty((capacity, width), dtype=torch.uint8)


@torch.library.register_fake("static_moe::unpack_rows")
def _unpack_rows_fake(packed, offset, nbytes, dtype, row_shape):
    if not _symbolic(packed):
        _C.check_unpack_rows(packed, offset, nbytes, dtype, list(row_shape))
    return packed.new_empty((packed.shape[0], *row_shape), dtype=dtype)
