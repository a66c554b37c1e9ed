"""expert_gemm: wrapper and fake kernel (SPEC §1.6)."""

from __future__ import annotations

import torch


def expert_gemm(a, a_scale, b, b_scale, row_mask, expert: int) -> torch.Tensor:
    """bf16 [R, N] = A [R, K] · B[expert] [N, K]ᵀ on the rows where ``row_mask`` is set; zeros elsewhere."""
    return torch.ops.static_moe.expert_gemm(a, a_scale, b, b_scale, row_mask, expert)


@torch.library.register_fake("static_moe::expert_gemm")
def _expert_gemm_fake(a, a_scale, b, b_scale, row_mask, expert):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)
