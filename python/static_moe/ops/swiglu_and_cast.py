"""swiglu_and_cast: wrapper and fake kernel (SPEC §1.4–1.5)."""

from __future__ import annotations

import torch


def swiglu_and_cast(gate_up, row_weight=None, swiglu_limit=None, out_format="fp8", group_size=128,
                    fp8_max=448.0, pow2_scale=True):
    """gate_up [R, 2I] → fp8 (float8_e4m3fn [R, I], float32 [R, I/group_size]) or bf16 ([R, I], float32 [R, 0])."""
    return torch.ops.static_moe.swiglu_and_cast(gate_up, row_weight, swiglu_limit, out_format, group_size,
                                                fp8_max, pow2_scale)


@torch.library.register_fake("static_moe::swiglu_and_cast")
def _swiglu_and_cast_fake(gate_up, row_weight, swiglu_limit, out_format="fp8", group_size=128, fp8_max=448.0,
                          pow2_scale=True):
    r, i = gate_up.shape[0], gate_up.shape[1] // 2
    if out_format == "bf16":
        return gate_up.new_empty((r, i), dtype=torch.bfloat16), gate_up.new_empty((r, 0), dtype=torch.float32)
    return (gate_up.new_empty((r, i), dtype=torch.float8_e4m3fn),
            gate_up.new_empty((r, i // group_size), dtype=torch.float32))
