"""expert_gemm decodes every fp8 e4m3fn weight code exactly as the reference on every CPU instruction set: the two
NaN codes (0x7F, 0xFF) give NaN, subnormals and ±0 their exact values, with any float32 block scale, on the
fold path and (powers of two) on avx512bf16's pow2 path, through the panel and the one- and few-row kernels.

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
from static_moe.formats import quantize_activation, quantize_weight_fp4, quantize_weight_fp8
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
# On avx512bf16 a weight row whose scales are all powers of two in [2^-117, 2^119] takes the pow2 path (the scale
# in the decoded weights' exponents): 2^-117 (the subnormal codes land on the bf16 normal floor) and 2^119 (448 ·
# 2^119 is finite) are its edges, 2^-118 just outside (fold path). Above 2^119 codes of 256 and up overflow to inf.
SCALES = [(1.0, 1.0), (0.25, 2.0**-20), (0.3, 1.7), (2.0**40, 3.0e-5), (2.0**-117, 2.0**119), (2.0**-118, 2.0**-118)]


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


POW2_SCALES = [sc for sc in SCALES if all(torch.tensor(sc).frexp().mantissa.eq(0.5))]


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("scales", POW2_SCALES, ids=[f"s{a:g}_{b:g}" for a, b in POW2_SCALES])
def test_every_fp8_weight_code_through_the_few_row_paths(cpu_isa, scales, rows):
    """The same codes through the one-row and few-row kernels (the test above runs K rows: avx512bf16's panel).
    Every activation is 1.0, so each output sums K equal products e4m3fn(n)·s: with a power-of-two s every partial
    sum is exact (or overflows, as in the reference), so the reference's bits hold in any order — NaN rows NaN,
    ±0 rows zero, the subnormal codes times 2^-117 the bf16 normal floor."""
    b, b_scale = _all_code_weights(scales)
    a = torch.ones(rows, K, dtype=torch.bfloat16)
    mask = torch.ones(rows, dtype=torch.bool)
    ref = reference.expert_gemm(a, None, b, b_scale, mask, 0)
    out = torch.ops.static_moe.expert_gemm(a, None, b, b_scale, mask, 0)
    assert ref.float().isnan().all(0).nonzero().squeeze(1).tolist() == [0x7F, 0xFF], "the reference's NaN codes"
    assert_equal(out, ref, f"{cpu_isa}, {rows} rows of ones, weight scales {scales}")


def _identity_weight(wf: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 0 = the K × K identity in weight format wf, "fp4" or "fp8" (1.0 is exact in both)."""
    eye = torch.eye(K, dtype=torch.float32).unsqueeze(0)
    return quantize_weight_fp8(eye) if wf == "fp8" else quantize_weight_fp4(eye)


# Per activation group, in turn: powers of two (exact bf16 products with every e4m3fn value: the bf16 activation
# rows of avx512bf16 and amx, 2^-117 their lower edge) and, in the last row, 0.3 (the float32 rows).
ACT_SCALES = [(1.0, 2.0**-3, 2.0**5, 2.0**-117), (2.0**-100, 2.0**60, 0.5, 4.0), (0.3, 1.0, 1.0, 1.0)]


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("wf", ["fp4", "fp8"])  # fp8 activations pair with fp4 and fp8 weights (SPEC §1.6)
def test_every_fp8_activation_code_matches_reference(cpu_isa, wf, group):
    """Activation column c holds code c, weights are the identity, so output n is bf16(e4m3fn(n) · s) for the
    scale s of column n's group: each code's value and each column's place in the lane layout the activation rows
    are prepared in (the fp4 nibble order, the fp8 byte unpack order), bitwise. The NaN codes
    (0x7F, 0xFF) sit in a row of their own, which is NaN everywhere (NaN · 0), as in the reference; the other rows
    hold 0 there."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes.clone()
    finite[[0x7F, 0xFF]] = 0
    rows = torch.stack([finite] * len(ACT_SCALES) + [codes])
    a = rows.view(torch.float8_e4m3fn)
    groups = K // group
    per_row = [[sc[g * len(sc) // groups] for g in range(groups)] for sc in ACT_SCALES + [ACT_SCALES[0]]]
    a_scale = torch.tensor(per_row, dtype=torch.float32)
    b, b_scale = _identity_weight(wf)
    mask = torch.ones(len(rows), dtype=torch.bool)
    ref = reference.expert_gemm(a, a_scale, b, b_scale, mask, 0)
    out = torch.ops.static_moe.expert_gemm(a, a_scale, b, b_scale, mask, 0)
    assert ref[-1].float().isnan().all() and not ref[:-1].float().isnan().any(), "the reference's NaN row"
    assert ref[:-1].float().ne(0).sum() > 200 * len(ACT_SCALES), "the crafted outputs must be mostly non-zero"
    assert_equal(out, ref, f"{cpu_isa}, {wf} weights, activation group {group}")
