"""swiglu_and_cast: wrapper and fake kernel (SPEC §1.4–1.5).

The fake kernel runs the same C++ argument checks as the CPU and CUDA kernels (csrc/checks/swiglu_and_cast.h,
through ``static_moe._C``), so a traced graph rejects bad inputs with the eager messages; under dynamic shapes
(symbolic sizes) it computes the output shapes only.
"""

from __future__ import annotations

import torch

from .. import _C
from ..activations import DEFAULT_ALPHA


def swiglu_and_cast(
    gate_up,
    row_weight=None,
    swiglu_limit=None,
    out_format="fp8",
    group_size=128,
    fp8_max=448.0,
    pow2_scale=True,
    activation="silu",
    alpha=DEFAULT_ALPHA,
):
    """SwiGLU with clamp and routing weight, then a cast.

    gate_up bf16/float32 [R, 2I] (gate half, then up half); row_weight float32 [R] or None; ``v = g·σ(g)·u·w``
    with ``g = min(g, limit)``, ``u = clamp(u, ±limit)``. Returns for "fp8" (float8_e4m3fn [R, I], float32
    [R, I/group_size]) quantized per 1×group_size with amax/fp8_max scales (power of two with pow2_scale), and for
    "bf16" (bf16 [R, I], float32 [R, 0]). Same device as gate_up. ``activation`` ("silu", "swiglu_oai" with
    ``alpha``, "gelu_tanh") replaces ``g·σ(g)·u`` by the SPEC §1.9 function, in the same single pass.
    """
    return torch.ops.static_moe.swiglu_and_cast(
        gate_up,
        row_weight,
        swiglu_limit,
        out_format,
        group_size,
        fp8_max,
        pow2_scale,
        activation=activation,
        alpha=alpha,
    )


@torch.library.register_fake("static_moe::swiglu_and_cast")
def _swiglu_and_cast_fake(
    gate_up,
    row_weight,
    swiglu_limit,
    out_format="fp8",
    group_size=128,
    fp8_max=448.0,
    pow2_scale=True,
    activation="silu",
    alpha=DEFAULT_ALPHA,
):
    tensors = [gate_up] + ([row_weight] if row_weight is not None else [])
    if not any(isinstance(s, torch.SymInt) for t in tensors for s in t.shape):
        _C.check_swiglu_and_cast(
            gate_up, row_weight, swiglu_limit, out_format, group_size, fp8_max, pow2_scale, activation, alpha
        )
    r, i = gate_up.shape[0], gate_up.shape[1] // 2
    if out_format == "bf16":
        return gate_up.new_empty((r, i), dtype=torch.bfloat16), gate_up.new_empty((r, 0), dtype=torch.float32)
    return (
        gate_up.new_empty((r, i), dtype=torch.float8_e4m3fn),
        gate_up.new_empty((r, i // group_size), dtype=torch.float32),
    )
