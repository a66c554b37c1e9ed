"""The packed row layout of SPEC §1.8: 16-byte aligned spans, padding rows 0xFF.

One packed row holds every part of one token side by side: part i's ``nbytes_i`` bytes (one row of a ``[T, ...]``
tensor) at columns ``[offset_i, offset_i + nbytes_i)``, each offset a multiple of ``ALIGN``; alignment gaps and the
rows past the tokens are ``PAD_BYTE``, so padded int32 ids read −1 and padded fp32 weights NaN. The pack_rows op
(ops/pack_rows.py and its kernels), the forward's unpack (ops/forward.py), the workspace's row width
(workspace.py) and the reference (reference/pack_rows.py) all take the layout from here.
"""

from __future__ import annotations

import math

import torch

ALIGN = 16
PAD_BYTE = 0xFF


def part_nbytes(part: torch.Tensor) -> int:
    """Bytes of one row of ``part`` [T, ...]."""
    return math.prod(part.shape[1:]) * part.element_size()


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``: the columns a part of that many bytes takes in a row."""
    return -(-nbytes // ALIGN) * ALIGN


def pack_layout(row_nbytes: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Spans ``(offset, nbytes)`` of each part and the total row width W; each part starts 16-byte aligned."""
    spans, width = [], 0
    for n in row_nbytes:
        spans.append((width, n))
        width += aligned(n)
    return spans, width
