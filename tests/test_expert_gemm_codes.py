"""expert_gemm decodes every fp8 e4m3fn weight code exactly as the reference on every CPU instruction set: the two
NaN codes (0x7F, 0xFF) give NaN, subnormals and ±0 their exact values, with any float32 block scale.

Each weight row n holds code n in every column and each activation row is one-hot (1.0 at one column), so every
output is bf16(e4m3fn(n) · s) (plus exact zeros): a sum with no rounding, hence bitwise the same on every lane
count, and every lane position of the decode is exercised. The products with zero make a NaN weight row NaN
everywhere, as in the reference.
"""

from __future__ import annotations

import pytest
import torch

import static_moe  # noqa: F401  (registers the ops)
from static_moe import reference
from static_moe.formats import quantize_activation
from static_moe.testing.numeric import assert_equal

K = 256  # two fp8 weight blocks, several units of every ISA's lane layout


def _all_code_weights(scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """b [1, 256, K] float8_e4m3fn with row n = code n; b_scale [1, 256, K/128] float32, block j = scales[j]."""
    codes = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, K).contiguous()
    b = codes.view(torch.float8_e4m3fn).unsqueeze(0)
    b_scale = torch.tensor(scales, dtype=torch.float32).expand(1, 256, 2).contiguous()
    return b, b_scale


def _one_hot_rows() -> torch.Tensor:
    """float32 [K, K] identity: row i is 1.0 at column i (every column of both weight blocks)."""
    return torch.eye(K, dtype=torch.float32)


# Powers of two put fp8 weight rows on the exact-bf16 paths where an ISA has them (2^-20: the e4m3fn subnormals
# times it are still normal bf16 numbers; 2^40: large but finite products); 0.3, 1.7 and 3e-5 are not powers of
# two, so q·s is rounded once in fp32, as the reference.
SCALES = [(1.0, 1.0), (0.25, 2.0**-20), (0.3, 1.7), (2.0**40, 3.0e-5)]


@pytest.mark.parametrize("scales", SCALES, ids=[f"s{a:g}_{b:g}" for a, b in SCALES])
@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_every_fp8_weight_code_matches_reference(cpu_isa, act, scales):
    b, b_scale = _all_code_weights(scales)
    x = _one_hot_rows()
    if act == "bf16":
        a, a_scale = x.to(torch.bfloat16), None
    else:
        a, a_scale = quantize_activation(x, 128, pow2_scale=True)
    mask = torch.ones(K, dtype=torch.bool)
    ref = reference.expert_gemm(a, a_scale, b, b_scale, mask, 0)
    out = torch.ops.static_moe.expert_gemm(a, a_scale, b, b_scale, mask, 0)
    nan_rows = ref.float().isnan().all(0)
    assert nan_rows.nonzero().squeeze(1).tolist() == [0x7F, 0xFF], "the reference's NaN codes"
    assert_equal(out, ref, f"{cpu_isa}, {act} activations, weight scales {scales}")
