"""local_experts: wrapper and fake kernel (SPEC §1.7)."""

from __future__ import annotations

import torch


def local_experts(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset: int,
                  swiglu_limit=None, fp8_max: float = 448.0) -> torch.Tensor:
    """float32 [R, H]: the weighted sum of the local experts' SwiGLU MLPs over the rows routed to them."""
    return torch.ops.static_moe.local_experts(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale,
                                              expert_offset, swiglu_limit, fp8_max)


@torch.library.register_fake("static_moe::local_experts")
def _local_experts_fake(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset,
                        swiglu_limit, fp8_max=448.0):
    return x.new_empty((x.shape[0], w2.shape[1]), dtype=torch.float32)
