"""The CUDA kernels' activation variants and bias epilogue (SPEC §1.9), checked on the CPU through the emulator of
tests/cuda/host/emulate.cu (the kernels' own __host__ __device__ row and epilogue code): swiglu_and_cast for every
activation, expert_gemm's bias in mask mode, and the local_experts pipeline with swiglu_oai / gelu_tanh and both
biases (GEMM2's bias times each pair's routing weight), against the reference ops at SPEC §2 tolerances."""

from __future__ import annotations

import pytest
import torch

from static_moe import formats, reference
from static_moe.testing.cuda_emulation import fromfile, run, tofile, write_meta
from static_moe.testing.generators import make_activations
from static_moe.testing.numeric import assert_equal, assert_gemm_close, assert_swiglu_close, calc_diff
from static_moe.testing.toolchain import find_nvcc

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")

ACT = {"silu": 0, "swiglu_oai": 1, "gelu_tanh": 2}
WFMT = {"bf16": 0, "fp8": 1, "fp4": 2}


@pytest.mark.parametrize("activation", ["swiglu_oai", "gelu_tanh"])
@pytest.mark.parametrize("out_format,group", [("fp8", 32), ("bf16", 128)])
def test_swiglu_variant_rows_match_reference(emulator, tmp_path, activation, out_format, group):
    g = torch.Generator().manual_seed(11)
    rows, inter, limit, alpha = 6, 256, 7.0, 1.702
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    w = torch.rand(rows, generator=g)
    write_meta(
        tmp_path, rows=rows, inter=inter, out_fp8=int(out_format == "fp8"), has_limit=1, limit=limit, has_weight=1,
        pow2=1, group=group, fp8_max=448.0, act=ACT[activation], alpha=alpha,
    )  # fmt: skip
    tofile(tmp_path, "gate_up.bin", gu)
    tofile(tmp_path, "weight.bin", w)
    run(emulator, "swiglu", tmp_path)
    ref = reference.swiglu_and_cast(gu, w, limit, out_format, group, 448.0, True, activation, alpha)
    if out_format == "fp8":
        q = fromfile(tmp_path, "q.bin", torch.float8_e4m3fn, (rows, inter))
        s = fromfile(tmp_path, "s.bin", torch.float32, (rows, inter // group))
    else:
        q, s = fromfile(tmp_path, "q.bin", torch.bfloat16, (rows, inter)), torch.empty(rows, 0)
    assert_swiglu_close((q, s), ref, f"swiglu {activation} {out_format}")
    silu = reference.swiglu_and_cast(gu, w, limit, out_format, group, 448.0, True)
    assert not torch.equal(silu[0].float(), q.float())


@pytest.mark.parametrize("act,wf,group", [("bf16", "bf16", 0), ("fp8", "fp4", 32)])
def test_gemm_bias_epilogue(emulator, tmp_path, act, wf, group):
    g = torch.Generator().manual_seed(12)
    rows, n, k, experts, expert = 37, 72, 128, 3, 2  # a partial n tile: the bias is read for real columns only
    a, a_s = make_activations(rows, k, act, group or 128, seed=13)
    b, b_s = formats.quantize_weight(torch.randn(experts, n, k, generator=g) / k**0.5, wf)
    bias = torch.randn(experts, n, generator=g)
    mask = torch.rand(rows, generator=g) < 0.7
    write_meta(tmp_path, rows=rows, k=k, n=n, experts=experts, expert=expert, group=group, wfmt=WFMT[wf], fp8_mma=0,
               has_bias=1)  # fmt: skip
    tofile(tmp_path, "a.bin", a)
    tofile(tmp_path, "a_scale.bin", a_s)
    tofile(tmp_path, "b.bin", formats.as_uint8(b) if wf == "fp4" else b)
    tofile(tmp_path, "b_scale.bin", None if b_s is None else (formats.as_uint8(b_s) if wf == "fp4" else b_s))
    tofile(tmp_path, "mask.bin", mask.to(torch.uint8))
    tofile(tmp_path, "bias.bin", bias)
    run(emulator, "gemm", tmp_path)
    out = fromfile(tmp_path, "d.bin", torch.bfloat16, (rows, n))
    ref = reference.expert_gemm(a, a_s, b, b_s, mask, expert, bias=bias)
    assert_gemm_close(out.float(), ref.float(), f"{act}x{wf} bias")
    assert_equal(out[~mask], torch.zeros_like(out[~mask]), "masked rows stay exact zeros (no bias)")


@pytest.mark.parametrize(
    "act,wf,group,activation", [("bf16", "bf16", 0, "swiglu_oai"), ("fp8", "fp8", 128, "gelu_tanh"),
                                ("bf16", "fp4", 0, "swiglu_oai")]
)  # fmt: skip
def test_local_experts_variants_pipeline(emulator, tmp_path, act, wf, group, activation):
    g = torch.Generator().manual_seed(14)
    rows, hidden, inter, num_local, num_experts, topk, offset = 40, 128, 128, 3, 9, 3, 3
    x, x_s = make_activations(rows, hidden, act, group or 128, seed=15)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(rows)]).to(torch.int32)
    idx[:36][torch.rand(36, topk, generator=g) < 0.5] = offset + 1  # a hot expert: two 32-row tiles
    idx[3, 1] = idx[3, 0]
    wts = torch.softmax(torch.randn(rows, topk, generator=g), dim=-1)
    w13_q, w13_s = formats.quantize_weight(torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5, wf)
    w2_q, w2_s = formats.quantize_weight(torch.randn(num_local, hidden, inter, generator=g) / inter**0.5, wf)
    b13 = torch.randn(num_local, 2 * inter, generator=g) * 0.5
    b2 = torch.randn(num_local, hidden, generator=g) * 0.5
    limit, alpha = 7.0, 1.702
    write_meta(
        tmp_path, rows=rows, topk=topk, offset=offset, num_local=num_local, hidden=hidden, inter=inter, group=group,
        wfmt=WFMT[wf], idx_int64=0, weights_bf16=0, has_limit=1, limit=limit, fp8_max=448.0, fp8_mma=0,
        act=ACT[activation], alpha=alpha, has_bias=1,
    )  # fmt: skip
    tofile(tmp_path, "x.bin", x)
    tofile(tmp_path, "x_scale.bin", x_s)
    tofile(tmp_path, "idx.bin", idx)
    tofile(tmp_path, "weights.bin", wts)
    for name, t in (("w13", w13_q), ("w13_scale", w13_s), ("w2", w2_q), ("w2_scale", w2_s)):
        tofile(tmp_path, f"{name}.bin", None if t is None else formats.as_uint8(t) if t.element_size() == 1 else t)
    tofile(tmp_path, "w13_bias.bin", b13)
    tofile(tmp_path, "w2_bias.bin", b2)
    run(emulator, "local_experts", tmp_path)
    out = fromfile(tmp_path, "out.bin", torch.float32, (rows, hidden))
    args = (x, x_s, idx, wts, w13_q, w13_s, w2_q, w2_s, offset, limit, 448.0, "eoi")
    ref = reference.local_experts(*args, activation, alpha, b13, b2)
    assert_gemm_close(out, ref, f"local_experts {act}x{wf} {activation} + biases")
    assert calc_diff(out, reference.local_experts(*args, activation, alpha)) > 1e-3, "the biases must show"
