"""Reference expert_gemm (SPEC §1.6): per-expert masked GEMM with a shared A operand."""

from __future__ import annotations

import torch

from ..activations import check_bias
from ..formats import dequantize_activation, dequantize_weight
from ..layouts import as_eoi, check_weight_layout


def dequantize_a(a: torch.Tensor, a_scale: torch.Tensor | None) -> torch.Tensor:
    """A operand (bf16, or fp8 with float32 [R, K/g] scales) → float32 [R, K]."""
    if a.dtype == torch.float8_e4m3fn:
        return dequantize_activation(a, a_scale)
    return a.float()


def expert_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    row_mask: torch.Tensor,
    expert: int,
    weight_layout: str = "eoi",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``D[m, n] = bf16(Σ_k A[m, k]·B_e[n, k] + bias[e, n])`` on dequantized values, fp32 accumulation, the bias
    (float32 / bf16 [L, N], optional) added in fp32 before the rounding (SPEC §1.9).

    a [R, K] bf16 / float8_e4m3fn (+ a_scale float32 [R, K/g]); b [L, N, K] bf16 / float8_e4m3fn (+ float32
    [L, N, K/128]) or uint8 [L, N, K/2] fp4 (+ UE8M0 uint8 [L, N, K/32]); row_mask bool [R].
    Returns bf16 [R, N], exact zeros on masked rows; masked rows are never read.

    ``weight_layout="eio"``: b / b_scale are the prepared K-major forms of ``static_moe.layouts``; expert
    ``expert``'s slice is brought back to EOI exactly (a byte permutation) and the maths is the same.
    """
    return expert_gemm_scaled_bias(a, a_scale, b, b_scale, row_mask, expert, weight_layout, bias, None)


def expert_gemm_scaled_bias(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    row_mask: torch.Tensor,
    expert: int,
    weight_layout: str,
    bias: torch.Tensor | None,
    bias_row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`expert_gemm` where row m adds ``bias_row_scale[m]·bias[e, n]`` (one fp32 product; float32 [R]) —
    local_experts' ``w·b2`` (SPEC §1.9) — or ``bias[e, n]`` when bias_row_scale is None."""
    n_out = b.shape[2] if check_weight_layout(weight_layout, "expert_gemm") == "eio" else b.shape[1]
    check_bias(bias, "expert_gemm", "bias", (b.shape[0], n_out), a)
    if weight_layout == "eio":
        if not 0 <= expert < b.shape[0]:
            raise ValueError(f"expert_gemm: expert={expert} is outside [0, {b.shape[0]})")
        sl = slice(expert, expert + 1)
        b, b_scale = as_eoi(b[sl], None if b_scale is None else b_scale[sl], "eio")
        bias = None if bias is None else bias[sl]
        expert = 0
    rows = row_mask.nonzero().squeeze(1)
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if rows.numel() == 0:
        return out
    a_rows = dequantize_a(a.index_select(0, rows), None if a_scale is None else a_scale.index_select(0, rows))
    w = dequantize_weight(b[expert], None if b_scale is None else b_scale[expert])
    d = a_rows @ w.T
    if bias is not None:
        be = bias[expert].float()[None, :]
        d = d + (be if bias_row_scale is None else bias_row_scale.float().index_select(0, rows)[:, None] * be)
    out[rows] = d.to(torch.bfloat16)
    return out
