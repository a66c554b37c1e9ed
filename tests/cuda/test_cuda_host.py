"""The CUDA kernels' arithmetic, checked on the CPU (no GPU needed, only nvcc).

csrc/cuda/numerics.cuh, swiglu_and_cast.cuh and the fragment / scale / epilogue code of expert_gemm.cuh are
__host__ __device__. tests/cuda/host/emulate.cu runs them thread by thread on the CPU, with cp.async replaced by
copies and mma.sync by an emulation written from the PTX fragment layouts (independent of the kernel code), and
these tests compare the results with the reference ops at SPEC §2 tolerances — bit for bit for the conversions.
What this cannot see: the GPU-only glue (pipeline waits, block scans, the route kernel); tests/cuda/gpu/ covers those.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from static_moe import formats, reference
from static_moe.testing.cuda_emulation import fromfile, run, tofile, write_meta
from static_moe.testing.generators import make_activations
from static_moe.testing.numeric import assert_equal, assert_gemm_close, assert_swiglu_close
from static_moe.testing.toolchain import find_nvcc

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")


# ---------------------------------------------------------------------------------------------------------------
# Conversions, bit for bit
# ---------------------------------------------------------------------------------------------------------------
def test_conversions_bitwise(emulator, tmp_path):
    g = torch.Generator().manual_seed(0)
    sweep = torch.cat(
        [
            torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 10, (20000,), generator=g).float()),
            torch.linspace(-448, 448, 9001),
            # e4m3 rounding midpoints and their neighbours
            (torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:126] * 1.0625),
            torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1e-30]),
        ]
    ).float()
    tofile(tmp_path, "f32_in.bin", sweep)
    run(emulator, "numerics", tmp_path)

    codes = torch.arange(256, dtype=torch.uint8)
    # e4m3fn -> bf16: exact; NaN codes (0x7F, 0xFF) only need to stay NaN.
    got = fromfile(tmp_path, "e4m3_bf16.bin", torch.bfloat16, (256,))
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.isnan(got[nan]).all()
    assert_equal(got[~nan], want[~nan], "e4m3 -> bf16")

    # e2m1 -> bf16, all 16 codes, -0 included.
    got = fromfile(tmp_path, "e2m1_bf16.bin", torch.bfloat16, (16,))
    assert_equal(got, formats.e2m1_decode(torch.arange(16, dtype=torch.uint8)).to(torch.bfloat16), "e2m1 -> bf16")

    # packed bytes -> bf16 pairs: element 0 is the low nibble.
    got = fromfile(tmp_path, "fp4_bf16.bin", torch.bfloat16, (256, 2))
    want = formats.e2m1_decode(formats.unpack_fp4(codes[:, None]))  # [256, 2]
    assert_equal(got, want.to(torch.bfloat16), "fp4 bytes -> bf16")

    # packed words -> e4m3 bytes holding value * 2^-6, in element order.
    got = fromfile(tmp_path, "fp4_e4m3.bin", torch.uint8, (256, 8))
    words = torch.stack([(codes.int() + i) % 256 for i in range(4)], dim=1).to(torch.uint8)  # [256, 4] bytes
    vals = formats.e2m1_decode(formats.unpack_fp4(words))  # [256, 8]
    assert_equal(
        got.view(torch.float8_e4m3fn).view(torch.uint8),
        (vals / 64).to(torch.float8_e4m3fn).view(torch.uint8),
        "fp4 -> e4m3 * 2^-6",
    )

    got = fromfile(tmp_path, "ue8m0.bin", torch.float32, (256,))
    assert_equal(got[:255], formats.ue8m0_to_float(codes[:255]), "ue8m0")  # 255 (NaN) is rejected upstream

    n = sweep.numel()
    assert_equal(
        fromfile(tmp_path, "f32_e4m3.bin", torch.uint8, (n,)),
        sweep.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8),
        "float -> e4m3fn",
    )
    assert_equal(fromfile(tmp_path, "f32_bf16.bin", torch.bfloat16, (n,)), sweep.to(torch.bfloat16), "float -> bf16")
    assert_equal(
        fromfile(tmp_path, "f32_pow2.bin", torch.float32, (n,))[sweep > 1e-30],
        formats.round_up_pow2(sweep[sweep > 1e-30]),
        "round_up_pow2",
    )


# ---------------------------------------------------------------------------------------------------------------
# Expert GEMM: the kernel's per-thread code over whole tiles
# ---------------------------------------------------------------------------------------------------------------
WFMT = {"bf16": 0, "fp8": 1, "fp4": 2}
CASES = [  # (act, weight, group, fp8_mma)
    ("bf16", "bf16", 0, False),
    ("bf16", "fp8", 0, False),
    ("bf16", "fp4", 0, False),
    ("fp8", "fp8", 128, True),
    ("fp8", "fp8", 32, True),
    ("fp8", "fp8", 128, False),
    ("fp8", "fp8", 32, False),
    ("fp8", "fp4", 128, True),
    ("fp8", "fp4", 32, True),
    ("fp8", "fp4", 128, False),
    ("fp8", "fp4", 32, False),
]


def gemm_case(
    emulator, tmp: Path, act, wf, group, fp8_mma, rows, n, k, mask, experts=3, expert=1, seed=0, poison_masked=True
):
    a, a_s = make_activations(rows, k, act, group or 128, seed=seed)
    w = torch.randn(experts, n, k, generator=torch.Generator().manual_seed(seed + 1)) / k**0.5
    b, b_s = formats.quantize_weight(w, wf)
    if poison_masked:  # masked rows are never read: fill them with NaN / 0xFF, which must not leak
        a = a.clone()
        a.view(torch.uint8)[~mask] = 0xFF
        if a_s is not None:
            a_s = a_s.clone()
            a_s[~mask] = float("nan")
    write_meta(
        tmp, rows=rows, k=k, n=n, experts=experts, expert=expert, group=group, wfmt=WFMT[wf], fp8_mma=int(fp8_mma)
    )
    tofile(tmp, "a.bin", a)
    tofile(tmp, "a_scale.bin", a_s)
    tofile(tmp, "b.bin", formats.as_uint8(b) if wf == "fp4" else b)
    tofile(tmp, "b_scale.bin", None if b_s is None else (formats.as_uint8(b_s) if wf == "fp4" else b_s))
    tofile(tmp, "mask.bin", mask.to(torch.uint8))
    run(emulator, "gemm", tmp)
    out = fromfile(tmp, "d.bin", torch.bfloat16, (rows, n))
    ref = reference.expert_gemm(a, a_s, b, b_s, mask, expert)
    return out, ref


@pytest.mark.parametrize(
    "act,wf,group,fp8_mma", CASES, ids=[f"{a}x{w}-g{g}-{'e4m3mma' if m else 'bf16mma'}" for a, w, g, m in CASES]
)
def test_gemm_tiles_match_reference(emulator, tmp_path, act, wf, group, fp8_mma):
    rows, n, k = 45, 128, 256  # two m tiles (the second partial), two n tiles, two k stages
    mask = torch.rand(rows, generator=torch.Generator().manual_seed(1)) < 0.8
    out, ref = gemm_case(emulator, tmp_path, act, wf, group, fp8_mma, rows, n, k, mask)
    assert_gemm_close(out.float(), ref.float(), f"{act}x{wf}")
    assert_equal(out[~mask], torch.zeros_like(out[~mask]), "masked rows are exact zeros")


@pytest.mark.parametrize("act,wf,group,fp8_mma", [("fp8", "fp4", 32, True), ("bf16", "fp8", 0, False)])
def test_gemm_partial_n_tile(emulator, tmp_path, act, wf, group, fp8_mma):
    rows, n, k = 9, 72, 128  # N not a multiple of the 64-wide tile: guarded weight rows and stores
    mask = torch.ones(rows, dtype=torch.bool)
    out, ref = gemm_case(emulator, tmp_path, act, wf, group, fp8_mma, rows, n, k, mask, poison_masked=False)
    assert_gemm_close(out.float(), ref.float(), f"{act}x{wf} N=72")


@pytest.mark.parametrize("act,wf,group,fp8_mma", [("fp8", "fp4", 128, True), ("bf16", "fp4", 0, False)])
def test_gemm_batch_invariance(emulator, tmp_path, act, wf, group, fp8_mma):
    """A row's bits do not depend on which other rows share its tile."""
    rows, n, k = 40, 64, 256
    full = torch.ones(rows, dtype=torch.bool)
    out_all, _ = gemm_case(emulator, tmp_path, act, wf, group, fp8_mma, rows, n, k, full)
    for r in (0, 17, 39):
        alone = torch.zeros(rows, dtype=torch.bool)
        alone[r] = True
        out_one, _ = gemm_case(emulator, tmp_path, act, wf, group, fp8_mma, rows, n, k, alone, poison_masked=False)
        assert_equal(out_one[r], out_all[r], f"row {r} alone vs with all rows")


# ---------------------------------------------------------------------------------------------------------------
# swiglu_and_cast: the kernel's row code
# ---------------------------------------------------------------------------------------------------------------
# pow2_scale only affects fp8 output, so bf16 runs once (pow2=True) instead of generating a skipped case.
@pytest.mark.parametrize(
    "out_format,group,pow2",
    [("fp8", 128, True), ("fp8", 128, False), ("fp8", 32, True), ("fp8", 32, False), ("bf16", 128, True)],
)
@pytest.mark.parametrize("limit", [None, 3.0])
def test_swiglu_rows_match_reference(emulator, tmp_path, out_format, group, limit, pow2):
    g = torch.Generator().manual_seed(3)
    rows, inter = 7, 256
    gu = torch.randn(rows, 2 * inter, generator=g) * 3
    gu[2] = 0.0  # an all-zero row: floor scale
    w = torch.rand(rows, generator=g)
    w[4] = 0.0  # weight 0: zeros and the floor scale
    write_meta(
        tmp_path,
        rows=rows,
        inter=inter,
        out_fp8=int(out_format == "fp8"),
        has_limit=int(limit is not None),
        limit=limit or 0.0,
        has_weight=1,
        pow2=int(pow2),
        group=group,
        fp8_max=448.0,
    )
    tofile(tmp_path, "gate_up.bin", gu)
    tofile(tmp_path, "weight.bin", w)
    run(emulator, "swiglu", tmp_path)
    ref = reference.swiglu_and_cast(gu, w, limit, out_format, group, 448.0, pow2)
    if out_format == "fp8":
        q = fromfile(tmp_path, "q.bin", torch.float8_e4m3fn, (rows, inter))
        s = fromfile(tmp_path, "s.bin", torch.float32, (rows, inter // group))
    else:
        q = fromfile(tmp_path, "q.bin", torch.bfloat16, (rows, inter))
        s = torch.empty(rows, 0)
    assert_swiglu_close((q, s), ref, f"swiglu {out_format} g{group}")


# ---------------------------------------------------------------------------------------------------------------
# local_experts: route, GEMM1, swiglu, GEMM2 and combine over the workspace, wired as the launcher wires them
# ---------------------------------------------------------------------------------------------------------------
LE_CASES = [  # (act, weight, group, fp8_mma, index dtype, weight dtype)
    ("bf16", "bf16", 0, False, torch.int32, torch.float32),
    ("bf16", "fp8", 0, False, torch.int64, torch.bfloat16),
    ("bf16", "fp4", 0, False, torch.int32, torch.float32),
    ("fp8", "fp8", 128, True, torch.int32, torch.float32),
    ("fp8", "fp4", 32, True, torch.int64, torch.float32),
    ("fp8", "fp4", 128, False, torch.int32, torch.bfloat16),
]


@pytest.mark.parametrize(
    "act,wf,group,fp8_mma,idx_dtype,w_dtype",
    LE_CASES,
    ids=[f"{c[0]}x{c[1]}-g{c[2]}-{'e4m3mma' if c[3] else 'bf16mma'}" for c in LE_CASES],
)
def test_local_experts_pipeline_matches_reference(emulator, tmp_path, act, wf, group, fp8_mma, idx_dtype, w_dtype):
    g = torch.Generator().manual_seed(7)
    rows, hidden, inter, num_local, num_experts, topk, offset = 48, 128, 128, 4, 12, 4, 4
    x, x_s = make_activations(rows, hidden, act, group or 128, seed=5)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(rows)])
    idx[:40][torch.rand(40, topk, generator=g) < 0.5] = offset + 1  # a hot expert: more than one 32-row tile
    idx[3, 1] = idx[3, 0]  # a duplicate id in a row: weights summed
    idx[5, 2] = -1  # an empty slot
    wts = torch.softmax(torch.randn(rows, topk, generator=g), dim=-1)
    idx[-4:] = -1  # padded rows: ids -1 (0xFF bytes), weights NaN — must select nothing
    wts[-4:] = float("nan")
    if x_s is not None:
        x_s[-4:] = float("nan")
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter**0.5
    w13_q, w13_s = formats.quantize_weight(w13, wf)
    w2_q, w2_s = formats.quantize_weight(w2, wf)
    idx, wts = idx.to(idx_dtype), wts.to(w_dtype)
    limit = 4.0
    write_meta(
        tmp_path,
        rows=rows,
        topk=topk,
        offset=offset,
        num_local=num_local,
        hidden=hidden,
        inter=inter,
        group=group,
        wfmt=WFMT[wf],
        idx_int64=int(idx_dtype == torch.int64),
        weights_bf16=int(w_dtype == torch.bfloat16),
        has_limit=1,
        limit=limit,
        fp8_max=448.0,
        fp8_mma=int(fp8_mma),
    )
    tofile(tmp_path, "x.bin", x)
    tofile(tmp_path, "x_scale.bin", x_s)
    tofile(tmp_path, "idx.bin", idx)
    tofile(tmp_path, "weights.bin", wts)
    for name, t in (("w13", w13_q), ("w13_scale", w13_s), ("w2", w2_q), ("w2_scale", w2_s)):
        tofile(tmp_path, f"{name}.bin", None if t is None else formats.as_uint8(t) if t.element_size() == 1 else t)
    run(emulator, "local_experts", tmp_path)
    out = fromfile(tmp_path, "out.bin", torch.float32, (rows, hidden))
    ref = reference.local_experts(x, x_s, idx, wts, w13_q, w13_s, w2_q, w2_s, offset, limit, 448.0)
    assert_gemm_close(out, ref, f"local_experts {act}x{wf}")
    assert_equal(out[-4:], torch.zeros_like(out[-4:]), "padded rows are exact zeros")
