"""expert_gemm gives a row the same bits whatever the number of rows beside it, for every row count up to two
blocks of rows: every tail of every ISA's row blocking (blocks of 4 or 6 rows, the one-row path) is exercised on
every weight format, on every CPU instruction set. On avx512bf16, fp4 and fp8 weights with more rows than one block
take the decoded-panel path (blocks of 4 rows reading weights decoded once per chunk) and fewer take the direct
one, so the comparisons with the full 13 rows check that the two paths give the same bits."""

from __future__ import annotations

import pytest
import torch

import static_moe
from static_moe.formats import quantize_activation, quantize_weight
from static_moe.testing.numeric import assert_equal

ROWS = 13  # > two blocks of 6 rows: every remainder mod 4 and mod 6 occurs among 1..ROWS
PAIRS = [("bf16", "bf16"), ("bf16", "fp4"), ("fp8", "fp4"), ("bf16", "fp8"), ("fp8", "fp8")]


@pytest.mark.parametrize("act,wf", PAIRS, ids=[f"{a}x{w}" for a, w in PAIRS])
def test_every_row_count_matches_the_full_batch(cpu_isa, act, wf, rng):
    k, n = 256, 200  # N: not a multiple of any weight-row block, so column tails run too
    x = torch.randn(ROWS, k, generator=rng)
    a, a_s = (x.to(torch.bfloat16), None) if act == "bf16" else quantize_activation(x, 128, pow2_scale=True)
    b, b_s = quantize_weight(torch.randn(1, n, k, generator=rng) / k**0.5, wf)
    full = static_moe.expert_gemm(a, a_s, b, b_s, torch.ones(ROWS, dtype=torch.bool), 0)
    for m in range(1, ROWS):
        mask = torch.arange(ROWS) < m
        part = static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)
        assert_equal(part[:m], full[:m], f"{cpu_isa} {act}x{wf}: the first {m} rows")


@pytest.mark.parametrize("wf", ["fp4", "fp8"])
def test_many_rows_match_each_row_alone(cpu_isa, wf, rng):
    """27 rows (six blocks of 4 and a tail of 3 on avx512bf16's decoded-panel path; 4 + 4 + 3 rows per block tail
    elsewhere) over K = 1024 (two 512-k chunks): each row computed alone (the one-row path, which decodes in
    registers) gives the batch's bits. fp4: the UE8M0 bytes of about a tenth of the blocks are set to 0 or 1 (their
    weights below 2^-126), so chunks of the panel path take the slow (lifted) decode next to fast ones."""
    rows, n, k = 27, 40, 1024
    b, b_s = quantize_weight(torch.randn(1, n, k, generator=rng) / k**0.5, wf)
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
