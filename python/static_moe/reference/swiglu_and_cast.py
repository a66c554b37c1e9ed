"""Reference swiglu_and_cast (SPEC §1.4–1.5)."""

from __future__ import annotations

import torch

from ..activations import DEFAULT_ALPHA, check_activation, gated
from ..formats import AMAX_FLOOR, FP8_E4M3FN_MAX, check_fp8_max, check_swiglu_limit, quantize_activation, round_up_pow2


def swiglu(
    gate_up: torch.Tensor,
    row_weight: torch.Tensor | None,
    swiglu_limit: float | None,
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
) -> torch.Tensor:
    """``act(g, u)·w`` in float32 for gate_up [R, 2I] → [R, I] (SPEC §1.9; silu: ``g·sigmoid(g)·u·w``); the clamp
    is upper-only on g, both sides on u, before the activation."""
    gu = gate_up.float()
    i = gu.shape[1] // 2
    g, u = gu[:, :i], gu[:, i:]
    if swiglu_limit is not None:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    v = gated(g, u, activation, alpha)
    if row_weight is not None:
        v = v * row_weight.float()[:, None]
    return v


def swiglu_and_cast(
    gate_up: torch.Tensor,
    row_weight: torch.Tensor | None,
    swiglu_limit: float | None,
    out_format: str = "fp8",
    group_size: int = 128,
    fp8_max: float = FP8_E4M3FN_MAX,
    pow2_scale: bool = True,
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up bf16/fp32 [R, 2I], row_weight float32 [R] or None → ``("fp8")`` (float8_e4m3fn [R, I],
    float32 [R, I/group_size]) or ``("bf16")`` (bf16 [R, I], float32 [R, 0]); activation / alpha: SPEC §1.9."""
    check_activation(activation, alpha, "swiglu_and_cast")
    check_swiglu_limit(swiglu_limit, "swiglu_and_cast")
    if out_format == "fp8":
        check_fp8_max(fp8_max, "swiglu_and_cast")
    v = swiglu(gate_up, row_weight, swiglu_limit, activation, alpha)
    if out_format == "bf16":
        return v.to(torch.bfloat16), v.new_empty((v.shape[0], 0))
    # NaN / Inf in v give the kernels' bits (scale −0.0 or inf), never an error: this mirrors the kernels.
    return quantize_activation(v, group_size, fp8_max, pow2_scale, check_finite=False)


def floor_scale(fp8_max: float, pow2_scale: bool) -> float:
    """The scale of an all-zero group: ``1e-4 / fp8_max``, rounded up to a power of two with pow2_scale."""
    s = torch.tensor([AMAX_FLOOR], dtype=torch.float32) / fp8_max
    if pow2_scale:
        s = round_up_pow2(s)
    return float(s)
