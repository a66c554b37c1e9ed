"""local_experts: wrapper and fake kernel (SPEC §1.7).

The fake kernel runs the same C++ argument checks as the CPU and CUDA kernels (csrc/checks/local_experts.h,
through ``static_moe._C``), so a traced graph rejects bad inputs with the eager messages; under dynamic shapes
(symbolic sizes) it computes the output shape only. Routing ids are values: only the eager kernels check them.
"""

from __future__ import annotations

import torch

from .. import _C
from ..activations import DEFAULT_ALPHA
from ..layouts import logical_shape


def local_experts(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset: int,
    swiglu_limit=None,
    fp8_max: float = 448.0,
    weight_layout: str = "eoi",
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
) -> torch.Tensor:
    """The fused step 2 of the forward: the weighted sum of this rank's experts' SwiGLU MLPs over the rows routed
    to them, ``acc[rows_e] += bf16(GEMM2(swiglu_and_cast(bf16(GEMM1(x, W13_e)), w_e), W2_e))`` in increasing e.

    x bf16 / float8_e4m3fn [R, H] (+ x_scale float32 [R, H/g]); topk_idx int32 / int64 [R, k] global ids or −1;
    topk_weights float32 / bf16 [R, k]; w13 [L, 2I, H], w2 [L, H, I] in one weight format (+ scales); local
    expert e has global id expert_offset + e. Returns float32 [R, H] (zero on rows routed to no local expert).

    ``weight_layout="eio"``: w13 / w2 (and scales) are the prepared K-major forms of ``static_moe.layouts``
    (w13 [L, H, 2I], w2 [L, I, H]; fp8 MX uint32 / fp4 uint16 [L, H/4, 2I], [L, I/4, H]), both of one dtype;
    the reference and the NKI kernels take them, the CPU and CUDA kernels refuse them (ValueError).

    ``activation`` / ``alpha`` (SPEC §1.9: "silu", "swiglu_oai", "gelu_tanh") and the biases ``w13_bias``
    float32 / bf16 [L, 2I], ``w2_bias`` [L, H]: ``h = bf16(x·W13ᵀ + b13)``, ``d = bf16(z·W2ᵀ + w·b2)``.
    """
    return torch.ops.static_moe.local_experts(
        x,
        x_scale,
        topk_idx,
        topk_weights,
        w13,
        w13_scale,
        w2,
        w2_scale,
        expert_offset,
        swiglu_limit,
        fp8_max,
        weight_layout,
        activation=activation,
        alpha=alpha,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


@torch.library.register_fake("static_moe::local_experts")
def _local_experts_fake(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset,
    swiglu_limit,
    fp8_max=448.0,
    weight_layout="eoi",
    activation="silu",
    alpha=DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
):
    optional = (x_scale, w13_scale, w2_scale, w13_bias, w2_bias)
    tensors = [x, topk_idx, topk_weights, w13, w2] + [t for t in optional if t is not None]
    if not any(isinstance(s, torch.SymInt) for t in tensors for s in t.shape) and not isinstance(
        expert_offset, torch.SymInt
    ):
        _C.check_local_experts(
            x,
            x_scale,
            topk_idx,
            topk_weights,
            w13,
            w13_scale,
            w2,
            w2_scale,
            expert_offset,
            swiglu_limit,
            fp8_max,
            weight_layout=weight_layout,
            activation=activation,
            alpha=alpha,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
        )
    h = logical_shape(w2, weight_layout)[1]  # H = N of w2 in either layout
    return x.new_empty((x.shape[0], h), dtype=torch.float32)
