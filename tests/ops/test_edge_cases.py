"""The shared edge cases (static_moe.testing.cases) on the CPU kernels at every ISA level and on the reference.

The reference is held to the cases' exact results (where the SPEC gives the bits); each CPU kernel to the
reference's bits as every CPU op test holds it (assert_gemm_bitwise for the GEMMs, the SPEC §2 swiglu rule with
bitwise scales, bitwise for pack / unpack), and masked or unrouted rows to exact zeros. The same cases run on the
CUDA host emulation (tests/cuda/test_cuda_host_cases.py) and the NKI interpreter (tests/nki/test_nki_cases.py).
"""

from __future__ import annotations

import pytest
import torch

import static_moe
from static_moe import reference
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.testing import cases
from static_moe.testing.generators import FORMAT_PAIRS
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_swiglu_close

PAIRS_G = [(a, w, g) for a, w in FORMAT_PAIRS for g in ((128, 32) if a == "fp8" else (128,))]
PAIR_IDS = [f"{a}x{w}-g{g}" for a, w, g in PAIRS_G]
SWIGLU = [("fp8", 128, True), ("fp8", 32, True), ("fp8", 128, False), ("bf16", 128, True)]
SWIGLU_IDS = [f"{f}-g{g}-{'pow2' if p else 'float'}" for f, g, p in SWIGLU]


@pytest.mark.parametrize("act,wf,group", PAIRS_G, ids=PAIR_IDS)
def test_expert_gemm_cases(cpu_isa, act, wf, group):
    for c in cases.expert_gemm_cases(act, wf, group):
        a, a_s, b, b_s, mask, e = c.args
        ref = reference.expert_gemm(*c.args)
        assert bool(torch.isfinite(ref.float()).all()), f"{c.id}: the case must keep the reference finite"
        out = static_moe.expert_gemm(*c.args)
        assert_gemm_bitwise(out, ref, f"{cpu_isa} {act}x{wf} g{group} {c.id}")
        assert_equal(out[~mask], torch.zeros_like(out[~mask]), f"{c.id}: masked rows are exact zeros")


@pytest.mark.parametrize("out_format,group,pow2", SWIGLU, ids=SWIGLU_IDS)
def test_swiglu_cases(out_format, group, pow2):
    for c in cases.swiglu_cases(out_format, group, pow2=pow2):
        out = torch.ops.static_moe.swiglu_and_cast(*c.args)
        assert_swiglu_close(out, reference.swiglu_and_cast(*c.args), f"{out_format} g{group} {c.id}")


def test_pack_rows_cases():
    for c in cases.pack_rows_cases():
        parts, cap = c.args
        packed = torch.ops.static_moe.pack_rows(parts, cap)
        assert_equal(packed, reference.pack_rows(list(parts), cap), f"pack {c.id}")
        spans, _ = pack_layout([part_nbytes(p) for p in parts])
        for i, (p, (off, n)) in enumerate(zip(parts, spans)):
            got = torch.ops.static_moe.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:]))
            want = reference.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:]))
            assert_equal(got.view(torch.uint8), want.view(torch.uint8), f"unpack {c.id} part {i}")
            assert_equal(got[: p.shape[0]].view(torch.uint8), p.view(torch.uint8), f"round trip {c.id} part {i}")


@pytest.mark.parametrize("act,wf,group", PAIRS_G, ids=PAIR_IDS)
def test_local_experts_cases(cpu_isa, act, wf, group):
    for c in cases.local_experts_cases(act, wf, group):
        ref = reference.local_experts(*c.args)
        if c.exact is not None:
            assert_equal(ref, c.exact, f"reference {c.id}")
        out = static_moe.local_experts(*c.args)
        what = f"{cpu_isa} {act}x{wf} g{group} {c.id}"
        assert_gemm_bitwise(out, ref, what)
        if c.exact is not None:
            assert_equal(out, c.exact, what)
        idx = c.args[2].long()
        offset, num_local = c.args[8], c.args[4].shape[0]
        unrouted = ~((idx >= offset) & (idx < offset + num_local)).any(dim=1)
        assert_equal(out[unrouted], torch.zeros_like(out[unrouted]), f"{what}: rows with no local expert")


def test_reference_quantisers_on_edge_inputs():
    """The quantisers on the shared edge inputs: every fp8 / fp4 value decodes to within half a step of the input
    (ties to even), the scale is the smallest power of two that fits the block's amax, and ±0 keep their sign."""
    from static_moe import formats

    for name, x in cases.quantiser_inputs():
        q, s = formats.quantize_activation(x, 32)
        deq = formats.dequantize_activation(q, s)
        amax = x.abs().reshape(x.shape[0], -1, 32).amax(-1).clamp_min(formats.AMAX_FLOOR)
        assert bool((s >= amax / 448).all()) and bool((s / 2 < amax / 448).all()), f"{name}: fp8 scale not minimal"
        step = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-6 * s.repeat_interleave(32, 1))))) / 8
        assert bool(((deq - x).abs() <= step / 2 * 1.0000001).all()), f"{name}: fp8 value off by more than half a step"
        assert bool((torch.signbit(deq) == torch.signbit(x))[x == 0].all()), f"{name}: the sign of zero is lost"
        qw, sw = formats.quantize_weight(x[None], "fp4")
        deq4 = formats.dequantize_weight(qw, sw)[0]
        blk = formats.ue8m0_to_float(sw[0]).repeat_interleave(32, 1)
        amax_b = x.abs().reshape(x.shape[0], -1, 32).amax(-1).double()
        exp = torch.ceil(torch.log2(amax_b / 6)).clamp(-127, 127).nan_to_num(-127)  # log2(0) = -inf -> -127
        assert_equal(sw[0], (exp + 127).to(torch.uint8), f"{name}: fp4 scale bytes")
        amax4 = amax_b.float().repeat_interleave(32, 1)
        assert bool((amax4 <= 6 * blk).all()), f"{name}: an fp4 block's amax past 6·scale"
        assert bool(((deq4 - x).abs() <= blk).all()), f"{name}: fp4 value off by more than one step"
