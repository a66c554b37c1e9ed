"""expert_gemm gives a row the same bits whatever the number of rows beside it, for every row count up to two
blocks of rows: every tail of every ISA's row blocking (blocks of 4 or 6 rows, the one-row path) is exercised on
every weight format, on every CPU instruction set. With more rows than one block, avx512bf16 (fp4 and fp8 weights),
avx512 and avx2 (every weight format) take a decoded-panel path (blocks of 4 rows reading weights decoded once per
chunk) and fewer rows take the direct one, so the comparisons with the full 13 rows check that the two paths give
the same bits. fp8 weights run with
power-of-two scales, float ones and both side by side (avx512bf16's pow2 and fold paths, chosen per weight row).
A batch of 90 rows takes amx past one pass of its tiles (80 rows)."""

from __future__ import annotations

import pytest
import torch

import static_moe
from static_moe import reference
from static_moe.formats import quantize_activation
from static_moe.testing.generators import FP8_SCALE_KINDS, random_weight
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise

ROWS = 13  # > two blocks of 6 rows: every remainder mod 4 and mod 6 occurs among 1..ROWS
# fp8 weights with each kind of scales (fp8_scales_of_kind): on avx512bf16, rows of powers of two take the pow2
# path and the others the fold path, each row by its own scales, and "mixed" puts both in every block of weight rows.
CASES = [("bf16", "bf16", None), ("bf16", "fp4", None), ("fp8", "fp4", None)] + [
    (act, "fp8", kind) for act in ("bf16", "fp8") for kind in FP8_SCALE_KINDS
]


@pytest.mark.parametrize("act,wf,kind", CASES, ids=[f"{a}x{w}" + (f"_{c}" if c else "") for a, w, c in CASES])
def test_every_row_count_matches_the_full_batch(cpu_isa, act, wf, kind, rng):
    k, n = 256, 200  # N: not a multiple of any weight-row block, so column tails run too
    x = torch.randn(ROWS, k, generator=rng)
    a, a_s = (x.to(torch.bfloat16), None) if act == "bf16" else quantize_activation(x, 128, pow2_scale=True)
    b, b_s = random_weight(1, n, k, wf, rng, kind or "pow2")
    full = static_moe.expert_gemm(a, a_s, b, b_s, torch.ones(ROWS, dtype=torch.bool), 0)
    for m in range(1, ROWS):
        mask = torch.arange(ROWS) < m
        part = static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)
        assert_equal(part[:m], full[:m], f"{cpu_isa} {act}x{wf}: the first {m} rows")


@pytest.mark.parametrize(
    "wf,kind",
    [("fp4", None)] + [("fp8", c) for c in FP8_SCALE_KINDS],
    ids=["fp4"] + [f"fp8_{c}" for c in FP8_SCALE_KINDS],
)
def test_many_rows_match_each_row_alone(cpu_isa, wf, kind, rng):
    """27 rows (six blocks of 4 and a tail of 3 on the decoded-panel paths of avx512bf16, avx512 and avx2; the
    same blocks decoding in registers on scalar) over K = 1024 (two 512-k chunks): each row computed alone (the one-row path, which decodes in
    registers) gives the batch's bits. fp4: the UE8M0 bytes of about a tenth of the blocks are set to 0 or 1 (their
    weights below 2^-126), so chunks of the panel path take the slow (lifted) decode next to fast ones."""
    rows, n, k = 27, 40, 1024
    b, b_s = random_weight(1, n, k, wf, rng, kind or "pow2")
    x = torch.randn(rows, k, generator=rng).to(torch.bfloat16)
    if wf == "fp4":
        s = b_s.view(torch.uint8).clone()
        low = torch.rand(s.shape, generator=rng) < 0.1  # some blocks: bytes 0 / 1 (bf16-subnormal weights)
        s[low] = torch.randint(0, 2, (int(low.sum()),), generator=rng, dtype=torch.uint8)
        b_s = s
    full = static_moe.expert_gemm(x, None, b, b_s, torch.ones(rows, dtype=torch.bool), 0)
    assert float(full.float().abs().mean()) > 0.05, "the crafted input must keep the results of ordinary size"
    for r in range(rows):
        one = static_moe.expert_gemm(x[r : r + 1], None, b, b_s, torch.ones(1, dtype=torch.bool), 0)
        assert_equal(one[0], full[r], f"{cpu_isa} {wf}: row {r} alone")


@pytest.mark.parametrize("wf,kind", [("bf16", None), ("fp4", None), ("fp8", "float")], ids=["bf16", "fp4", "fp8"])
def test_rows_past_one_tile_pass(cpu_isa, wf, kind, rng):
    """90 rows over N = 40 weight rows (blocks of 16, 16 and 8 on amx): amx runs a first pass over five groups of 16
    rows and a second over one group of 10, other ISAs many row blocks. The batch matches the reference, and rows at
    the groups' and passes' edges give the batch's bits alone."""
    rows, n, k = 90, 40, 256
    b, b_s = random_weight(1, n, k, wf, rng, kind or "pow2")
    x = torch.randn(rows, k, generator=rng).to(torch.bfloat16)
    mask = torch.ones(rows, dtype=torch.bool)
    full = static_moe.expert_gemm(x, None, b, b_s, mask, 0)
    assert_gemm_bitwise(full, reference.expert_gemm(x, None, b, b_s, mask, 0), f"{cpu_isa} {wf}: 90 rows")
    for r in (0, 15, 16, 63, 79, 80, 89):
        one = static_moe.expert_gemm(x[r : r + 1], None, b, b_s, torch.ones(1, dtype=torch.bool), 0)
        assert_equal(one[0], full[r], f"{cpu_isa} {wf}: row {r} alone")


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("act,wf,kind", CASES, ids=[f"{a}x{w}" + (f"_{c}" if c else "") for a, w, c in CASES])
def test_each_weight_row_alone_matches_its_block(cpu_isa, act, wf, kind, rows, bias, rng):
    """A weight row computed alone (N = 1: the narrowest block) gives the bits it gets among 24 (blocks of 2-8
    weight rows, and the panels' 6): the horizontal sum, the bias and the bf16 rounding of a column never depend on
    the columns beside it, which a kernel that sums or rounds several outputs at once must keep. Rows 1 (the
    one-row path), 5 (one block) and 16 (several blocks, or the panel); with bf16 activations the first row
    (3e38 everywhere) overflows to inf in some columns and the second holds a NaN, so the rounding's special cases
    run too."""
    n, k = 24, 256
    x = torch.randn(rows, k, generator=rng)
    if act == "bf16":  # fp8 activations refuse inf and NaN (quantize_activation)
        x[0] = 3e38  # sums that overflow in fp32 in some columns
        if rows > 1:
            x[1, 7] = float("nan")
    a, a_s = (x.to(torch.bfloat16), None) if act == "bf16" else quantize_activation(x, 128, pow2_scale=True)
    b, b_s = random_weight(1, n, k, wf, rng, kind or "pow2")
    bias_t = torch.randn(1, n, generator=rng) if bias else None
    mask = torch.ones(rows, dtype=torch.bool)
    full = static_moe.expert_gemm(a, a_s, b, b_s, mask, 0, bias=bias_t)
    for j in range(n):
        one = static_moe.expert_gemm(
            a, a_s, b[:, j : j + 1], None if b_s is None else b_s[:, j : j + 1], mask, 0,
            bias=None if bias_t is None else bias_t[:, j : j + 1],
        )  # fmt: skip
        column = full[:, j : j + 1].clone(memory_format=torch.contiguous_format)
        assert_equal(one, column, f"{cpu_isa} {act}x{wf} {rows} rows: weight row {j} alone")


def test_fp8_weight_rows_take_their_own_path(cpu_isa, rng):
    """Each fp8 weight row's own scales choose its path (avx512bf16: powers of two the pow2 path, one running sum
    over K; others the fold path, a sum per 128-k block), never its neighbours': alone (blocks of 4 weight rows)
    and among 13 rows (the panels: 6 weight rows, or 3 on the fold) a row gets the same bits. The weights make
    the two orders differ: 2^24 in column 0, 0.5 in every column of the second block, −2^24 in column 256 (the
    same lane as column 0), so the pow2 path loses that lane's 0.5s against 2^24 and the fold path keeps them (60
    against 64 with rows of ones). The second block's scale is 1 (pow2 rows) or 1.5 (fold rows), at random row by
    row."""
    n, k, rows = 40, 384, 13
    codes = torch.zeros(1, n, k, dtype=torch.uint8)
    codes[..., 0], codes[..., 128:256], codes[..., 256] = 0x78, 0x30, 0xF8  # 256, 0.5, −256
    fold = torch.rand(n, generator=rng) < 0.5
    b_s = torch.tensor([2.0**16, 1.0, 2.0**16]).repeat(1, n, 1)
    b_s[0, fold, 1] = 1.5
    b = codes.view(torch.float8_e4m3fn)
    x = torch.ones(rows, k, dtype=torch.bfloat16)
    full = static_moe.expert_gemm(x, None, b, b_s, torch.ones(rows, dtype=torch.bool), 0)
    one = static_moe.expert_gemm(x[:1], None, b, b_s, torch.ones(1, dtype=torch.bool), 0)
    for r in range(rows):
        assert_equal(full[r], one[0], f"{cpu_isa}: row {r} of 13 against the row alone")
    if cpu_isa == "avx512bf16":  # the crafted order dependence is really there: the two paths differ on it
        per_half = one[0].float() / torch.where(fold, 1.5, 1.0)
        assert per_half[~fold].eq(60).all() and per_half[fold].eq(64).all(), per_half.tolist()
