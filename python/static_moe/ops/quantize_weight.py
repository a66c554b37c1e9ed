"""quantize_weight: wrapper and fake kernel (SPEC §1.9).

The fake kernel runs the same C++ argument checks as the CPU kernel (csrc/checks/quantize_weight.h, through
``static_moe._C``), so a traced graph rejects bad inputs with the eager messages; under dynamic shapes (symbolic
sizes) it computes the output shapes only. The kernel is CPU-only: weights are quantized once, offline (on load);
the reference (static_moe.reference.quantize_weight, i.e. static_moe.formats) runs on any device.
"""

from __future__ import annotations

import torch

from .. import _C


def quantize_weight(w, weight_format):
    """Quantize expert weights ``w`` bf16 / float16 / float32 [..., N, K] (CPU) per SPEC §1.2.

    "fp8": returns (float8_e4m3fn [..., N, K], float32 scales [..., N, K/128]), power-of-two scales, fp8_max 448.
    "fp4": returns (uint8 [..., N, K/2] packed e2m1, element k in byte k//2 low nibble for even k; uint8 UE8M0
    scales [..., N, K/32]). Bitwise equal to ``static_moe.formats.quantize_weight_fp8`` / ``quantize_weight_fp4``;
    a block holding NaN or ±Inf raises ValueError naming ``w`` and the first such block, as they do. Same device
    as ``w`` (CPU); float16 input is widened to a float32 copy first, bf16 / float32 are read in place.
    """
    return torch.ops.static_moe.quantize_weight(w, weight_format)


@torch.library.register_fake("static_moe::quantize_weight")
def _quantize_weight_fake(w, weight_format):
    if not any(isinstance(s, torch.SymInt) for s in w.shape):
        _C.check_quantize_weight(w, weight_format)
    k = w.shape[-1]
    lead = tuple(w.shape[:-1])
    if weight_format == "fp4":
        return w.new_empty(lead + (k // 2,), dtype=torch.uint8), w.new_empty(lead + (k // 32,), dtype=torch.uint8)
    return w.new_empty(w.shape, dtype=torch.float8_e4m3fn), w.new_empty(lead + (k // 128,), dtype=torch.float32)
