"""The shared edge cases (static_moe.testing.cases) on the NKI kernels through ``static_moe.nki.dispatch`` /
``shim.simulate`` (our interpreter, or the real NKI simulator where importable), against the reference run with
the kernel's fp8_max (240: trn2's on-chip fp8) and the cases' exact results. The same inputs the CPU kernels and
the CUDA host emulation get (tests/ops/test_edge_cases.py, tests/cuda/test_cuda_host_cases.py); small cases only."""

from __future__ import annotations

import pytest
import torch

from static_moe import layouts, reference
from static_moe.nki import dispatch, shim
from static_moe.nki_kernels.pack_rows import pack_rows, unpack_rows
from static_moe.nki_kernels.swiglu_and_cast import swiglu_and_cast
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.testing import cases
from static_moe.testing.generators import FORMAT_PAIRS
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close, assert_swiglu_close

# As in the other NKI tests: our interpreter gives the reference's bits but for rare last bits; the real simulator
# (PE-array order, hardware activation tables) the SPEC §2 bound.
assert_kernel_close = assert_gemm_close if shim.real_nki_available() else assert_gemm_bitwise
TRN2_FP8_MAX = 240.0
PAIRS_G = [(a, w, g) for a, w in FORMAT_PAIRS for g in ((128, 32) if a == "fp8" else (128,))]
PAIR_IDS = [f"{a}x{w}-g{g}" for a, w, g in PAIRS_G]


@pytest.mark.parametrize("act,wf,group", PAIRS_G, ids=PAIR_IDS)
def test_expert_gemm_cases(act, wf, group):
    for c in cases.select(cases.expert_gemm_cases(act, wf, group), cases.SMALL):
        mask = c.args[4]
        out = dispatch.expert_gemm(*c.args)
        assert_kernel_close(out, reference.expert_gemm(*c.args), f"{act}x{wf} g{group} {c.id}")
        assert_equal(out[~mask], torch.zeros_like(out[~mask]), f"{c.id}: masked rows are exact zeros")


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="prepared (eio) fp4 weights: the packed decode folds 2^(b - 121) into a bf16 scale, which overflows for "
    "UE8M0 bytes 249 ... 254 (cases fp4_scale_bytes_254_253 / _253_254); the eoi path scales the values by 2^6 "
    "instead. Kept until fixed (strict: a fix makes it fail, and the mark must go)",
)
@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_expert_gemm_prepared_fp4_largest_scale_bytes(act):
    for c in cases.expert_gemm_cases(act, "fp4", 128):
        if not c.id.startswith("fp4_scale_bytes_25"):
            continue
        a, a_s, b, b_s, mask, e = c.args
        pb, pbs, lay = layouts.prepare_weight(b, b_s, "trn2")
        out = dispatch.expert_gemm(a, a_s, pb, pbs, mask, e, weight_layout=lay)
        assert_kernel_close(out, reference.expert_gemm(*c.args), f"{act}xfp4 {lay} {c.id}")


@pytest.mark.parametrize("out_format,group", [("fp8", 128), ("fp8", 32), ("bf16", 128)])
def test_swiglu_cases(out_format, group):
    for c in cases.swiglu_cases(out_format, group, fp8_max=TRN2_FP8_MAX):
        gu, w, limit, fmt, g, fp8_max, pow2 = c.args
        out = shim.simulate(swiglu_and_cast)(
            gu, w, swiglu_limit=limit, out_format=fmt, group_size=g, fp8_max=fp8_max, pow2_scale=pow2
        )
        if out_format == "bf16":
            out = (out, torch.empty(gu.shape[0], 0))
        assert_swiglu_close(out, reference.swiglu_and_cast(*c.args), f"{out_format} g{group} {c.id}")


def test_pack_rows_cases():
    for c in cases.select(cases.pack_rows_cases(), cases.SMALL):
        parts, cap = c.args
        if parts[0].shape[0] == 0:
            continue  # the kernel takes T >= 1 (forward packs T = 0 as all padding without it)
        packed = shim.simulate(pack_rows)(tuple(parts), cap)
        assert_equal(packed, reference.pack_rows(list(parts), cap), f"pack {c.id}")
        spans, _ = pack_layout([part_nbytes(p) for p in parts])
        for i, (p, (off, n)) in enumerate(zip(parts, spans)):
            got = shim.simulate(unpack_rows)(packed, off, n, shim.nl_dtype(p.dtype), tuple(p.shape[1:]))
            want = reference.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:]))
            assert_equal(got.view(torch.uint8), want.view(torch.uint8), f"unpack {c.id} part {i}")


@pytest.mark.parametrize("act,wf,group", PAIRS_G, ids=PAIR_IDS)
def test_local_experts_cases(act, wf, group):
    for c in cases.local_experts_cases(act, wf, group):
        args = c.args[:-1] + (TRN2_FP8_MAX,)
        out = dispatch.local_experts(*args)
        what = f"{act}x{wf} g{group} {c.id}"
        if c.exact is not None:
            assert_equal(out, c.exact, what)
        assert_kernel_close(out, reference.local_experts(*args), what)
