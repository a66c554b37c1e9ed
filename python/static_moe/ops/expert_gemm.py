"""expert_gemm: wrapper and fake kernel (SPEC §1.6).

The fake kernel runs the same C++ argument checks as the CPU and CUDA kernels (csrc/checks/expert_gemm.h, through
``static_moe._C``), so a traced graph rejects bad inputs with the eager messages; under dynamic shapes (symbolic
sizes) it computes the output shape only.
"""

from __future__ import annotations

import torch

from .. import _C
from ..layouts import logical_shape


def expert_gemm(a, a_scale, b, b_scale, row_mask, expert: int, weight_layout: str = "eoi", bias=None) -> torch.Tensor:
    """Per-expert masked GEMM with a shared A: ``D[m, n] = bf16(Σ_k A[m, k]·B_e[n, k])`` on the rows where
    ``row_mask`` is set, exact zeros elsewhere (masked rows are never read).

    a bf16 / float8_e4m3fn [R, K] (+ a_scale float32 [R, K/g], g ∈ {32, 128}); b [L, N, K] bf16 / float8_e4m3fn
    (+ b_scale float32 [L, N, K/128]) or fp4 uint8 / float4_e2m1fn_x2 [L, N, K/2] (+ UE8M0 uint8 / float8_e8m0fnu
    [L, N, K/32]); row_mask bool [R]; 0 ≤ expert < L. Returns bf16 [R, N] on a's device.

    ``weight_layout="eio"``: b and b_scale are the prepared K-major forms of ``static_moe.layouts`` (bf16 / fp8
    ``[L, K, N]``, fp8 MX uint32 / fp4 uint16 ``[L, K/4, N]``, scales ``[L, K/blk, N]``); the reference and the
    NKI kernels take them, the CPU and CUDA kernels refuse them (ValueError).

    ``bias`` float32 / bf16 [L, N] (optional): ``D = bf16(Σ_k A·B_e + bias[e])``, added in fp32 before the
    rounding (SPEC §1.9).
    """
    return torch.ops.static_moe.expert_gemm(a, a_scale, b, b_scale, row_mask, expert, weight_layout, bias=bias)


@torch.library.register_fake("static_moe::expert_gemm")
def _expert_gemm_fake(a, a_scale, b, b_scale, row_mask, expert, weight_layout="eoi", bias=None):
    tensors = [a, b, row_mask] + [t for t in (a_scale, b_scale, bias) if t is not None]
    if not any(isinstance(s, torch.SymInt) for t in tensors for s in t.shape) and not isinstance(expert, torch.SymInt):
        _C.check_expert_gemm(a, a_scale, b, b_scale, row_mask, expert, weight_layout, bias)
    n = logical_shape(b, weight_layout)[1]  # N: b is [L, N, K] ("eoi") or [L, K, N] / [L, K/4, N] ("eio")
    return a.new_empty((a.shape[0], n), dtype=torch.bfloat16)
