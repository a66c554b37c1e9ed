"""Reference local_experts (SPEC §1.7): the fused step 2 of the forward, in the SPEC's reference order."""

from __future__ import annotations

import torch

from ..activations import DEFAULT_ALPHA, check_activation, check_bias
from ..formats import FP8_E4M3FN_MAX, check_fp8_max, check_swiglu_limit
from ..layouts import as_eoi, check_weight_layout
from .expert_gemm import expert_gemm, expert_gemm_scaled_bias
from .swiglu_and_cast import swiglu_and_cast


def routed_weight(topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_id: int) -> torch.Tensor:
    """float32 [R]: the sum, in slot order, of each row's top-k weights whose id is ``expert_id`` (0 elsewhere).

    Slots that do not name the expert contribute nothing, so NaN weights in padded rows cannot leak. Compared in
    int64: an int32 tensor compared with a Python int would wrap the int at 2^32."""
    hit = topk_idx.to(torch.int64) == expert_id
    w = topk_weights.float()
    acc = torch.zeros(topk_idx.shape[0], dtype=torch.float32, device=topk_idx.device)
    for j in range(topk_idx.shape[1]):
        acc = acc + torch.where(hit[:, j], w[:, j], torch.zeros_like(acc))
    return acc


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype)  # "torch.uint32", as the C++ checks print it


def local_experts(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    expert_offset: int,
    swiglu_limit: float | None,
    fp8_max: float = FP8_E4M3FN_MAX,
    weight_layout: str = "eoi",
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the L local experts (global ids expert_offset … expert_offset+L−1) over the rows routed to them.

    x [R, H] bf16 or float8_e4m3fn (+ x_scale float32 [R, H/g]); topk_idx int32/int64 [R, k] (−1 = empty);
    topk_weights float32/bf16 [R, k]; w13 [L, 2I, H], w2 [L, H, I] in one weight format. Returns float32 [R, H]:
    ``acc[rows_e] += bf16(GEMM2(swiglu_and_cast(bf16(GEMM1(x, W13_e)), w_e), W2_e))``, experts in increasing id.

    ``weight_layout="eio"``: the weights are the prepared K-major forms of ``static_moe.layouts`` (w13
    [L, H, 2I], w2 [L, I, H], packed forms [L, K/4, N]); they are brought back to EOI exactly (a byte
    permutation) and the maths is the same, so prepared and unprepared weights give the same bits.

    ``activation`` / ``alpha`` choose the gated activation and ``w13_bias`` float32 / bf16 [L, 2I], ``w2_bias``
    [L, H] the biases of SPEC §1.9: ``h = bf16(x·W13ᵀ + b13)``, ``d = bf16(z·W2ᵀ + w·b2)``.
    """
    check_weight_layout(weight_layout, "local_experts")
    if weight_layout == "eio" and w2.dtype != w13.dtype:
        # The kernels' rule (csrc/checks/local_experts.h): one prepared form for both weights — MX (uint32) and
        # plain fp8 are one format but different kernel inputs, so a mix is refused, not converted.
        raise TypeError(
            f"local_experts: under weight_layout='eio' w2 must have the dtype of w13 ({_dtype(w13)}), got {_dtype(w2)}"
        )
    w13, w13_scale = as_eoi(w13, w13_scale, weight_layout)
    w2, w2_scale = as_eoi(w2, w2_scale, weight_layout)
    check_swiglu_limit(swiglu_limit, "local_experts")
    check_activation(activation, alpha, "local_experts")
    check_bias(w13_bias, "local_experts", "w13_bias", (w13.shape[0], w13.shape[1]), x)
    check_bias(w2_bias, "local_experts", "w2_bias", (w2.shape[0], w2.shape[1]), x)
    fp8_act = x.dtype == torch.float8_e4m3fn
    if fp8_act:
        check_fp8_max(fp8_max, "local_experts")
    r = x.shape[0]
    num_local = w13.shape[0]
    group = x.shape[1] // x_scale.shape[1] if fp8_act else 128
    acc = torch.zeros((r, w2.shape[1]), dtype=torch.float32, device=x.device)
    for e in range(num_local):
        w_e = routed_weight(topk_idx, topk_weights, expert_offset + e)
        hit = (topk_idx.to(torch.int64) == expert_offset + e).any(dim=1)
        rows = hit.nonzero().squeeze(1)
        if rows.numel() == 0:
            continue  # no row selects this expert: no work, no weight reads
        xs = None if x_scale is None else x_scale.index_select(0, rows)
        sub_mask = torch.ones(rows.numel(), dtype=torch.bool, device=x.device)
        h = expert_gemm(x.index_select(0, rows), xs, w13, w13_scale, sub_mask, e, bias=w13_bias)
        w_rows = w_e.index_select(0, rows)
        fmt = "fp8" if fp8_act else "bf16"
        z, z_s = swiglu_and_cast(h, w_rows, swiglu_limit, fmt, group, fp8_max, True, activation, alpha)
        d = expert_gemm_scaled_bias(z, z_s if fp8_act else None, w2, w2_scale, sub_mask, e, "eoi", w2_bias, w_rows)
        acc.index_add_(0, rows, d.float())
    return acc
