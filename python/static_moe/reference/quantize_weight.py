"""Reference quantize_weight (SPEC §1.10): the Python quantizers of static_moe.formats, behind the op's signature."""

from __future__ import annotations

import torch

from ..formats import quantize_weight_fp4, quantize_weight_fp8


def quantize_weight(w: torch.Tensor, weight_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] (bf16 / float16 / float32, any device) → fp8 (float8_e4m3fn [..., N, K], float32
    [..., N, K/128]) or fp4 (uint8 [..., N, K/2], uint8 UE8M0 [..., N, K/32]); NaN / ±Inf raise ValueError."""
    if weight_format == "fp8":
        return quantize_weight_fp8(w)
    if weight_format == "fp4":
        return quantize_weight_fp4(w)
    raise ValueError(f'quantize_weight: weight_format must be "fp8" or "fp4", got "{weight_format}"')
