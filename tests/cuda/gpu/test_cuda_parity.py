"""Parity of the CUDA kernels with the reference ops (SPEC §2), plus what only a GPU can show: CUDA-graph capture
and replay, no host synchronization inside the ops, determinism and batch invariance on the device.

Skipped where no CUDA GPU is visible. Where one is visible but the extension was built without CUDA kernels the
tests skip too, unless STATIC_MOE_REQUIRE_CUDA=1 (bench/gpu_check.sh sets it), which makes that a failure.

STATIC_MOE_PARITY_DEVICE=cpu runs the same parity cases against the CPU backend instead: a self-check of this file
on machines without a GPU (the GPU-only tests still skip).

Run: ``python -m pytest -q tests/cuda/gpu/test_cuda_parity.py`` (bench/gpu_check.sh does, after building).
"""

from __future__ import annotations

import os

import pytest
import torch

import static_moe  # noqa: F401  (registers the ops)
from static_moe import formats, reference
from static_moe.testing.numeric import assert_equal, assert_gemm_close, assert_swiglu_close, fp8_step

OPS = ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts")
FORCED = os.environ.get("STATIC_MOE_PARITY_DEVICE")


def _device() -> torch.device:
    if FORCED:
        return torch.device(FORCED)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")
    missing = [op for op in OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"static_moe::{op}", "CUDA")]
    if missing:
        msg = f"static_moe._C was built without CUDA kernels for {missing} (rebuild against a CUDA torch)"
        if os.environ.get("STATIC_MOE_REQUIRE_CUDA") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return torch.device("cuda")


@pytest.fixture
def dev() -> torch.device:
    return _device()


@pytest.fixture
def cuda_only(dev) -> torch.device:
    if dev.type != "cuda":
        pytest.skip("CUDA-only behaviour")
    return dev


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Inputs (built on the CPU, moved to the device: the reference runs on the CPU copies)
# ---------------------------------------------------------------------------------------------------------------
def activations(rows, k, act, group, seed, scale=1.0):
    x = torch.randn(rows, k, generator=gen(seed)) * scale
    if act == "bf16":
        return x.to(torch.bfloat16), None
    return formats.quantize_activation(x, group)


def weights(experts, n, k, fmt, seed):
    w = torch.randn(experts, n, k, generator=gen(seed)) / k**0.5
    return formats.quantize_weight(w, fmt)


def routing(rows, topk, num_experts, seed, idx_dtype=torch.int32, w_dtype=torch.float32, hot=None, pad_rows=0):
    g = gen(seed)
    idx = (
        torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(rows)])
        if rows
        else torch.zeros(0, topk, dtype=torch.long)
    )
    if rows:
        if hot is not None:  # skew: half the slots of most rows go to one expert (several 32-row tiles)
            idx[torch.rand(idx.shape, generator=g) < 0.5] = hot
        if topk > 1:
            idx[0, 1] = idx[0, 0]  # duplicate id: weights summed
        idx[rows // 2, -1] = -1  # empty slot
    w = torch.softmax(torch.randn(rows, topk, generator=g), dim=-1)
    if pad_rows:  # padded rows as pack_rows leaves them: 0xFF bytes = id -1, weight NaN
        idx[-pad_rows:] = -1
        w[-pad_rows:] = float("nan")
    return idx.to(idx_dtype), w.to(w_dtype)


FORMAT_CASES = [  # (activation, weight, group)
    ("bf16", "bf16", 0),
    ("bf16", "fp8", 0),
    ("bf16", "fp4", 0),
    ("fp8", "fp8", 128),
    ("fp8", "fp8", 32),
    ("fp8", "fp4", 128),
    ("fp8", "fp4", 32),
]
FORMAT_IDS = [f"{a}x{w}" + (f"-g{g}" if g else "") for a, w, g in FORMAT_CASES]


# ---------------------------------------------------------------------------------------------------------------
# pack_rows / unpack_rows: bitwise
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,capacity", [(0, 4), (5, 8), (8, 8), (37, 64)])
def test_pack_unpack_bitwise(dev, t, capacity):
    g = gen(t)
    x_q, x_s = formats.quantize_activation(torch.randn(t, 256, generator=g), 128)
    idx = torch.randint(-1, 64, (t, 6), generator=g, dtype=torch.int32)
    w = torch.rand(t, 6, generator=g)
    odd = torch.randint(0, 255, (t, 5), generator=g, dtype=torch.uint8)  # 5-byte rows: unaligned tail
    parts = [x_q, x_s, idx, w, odd]
    out = torch.ops.static_moe.pack_rows([p.to(dev) for p in parts], capacity)
    ref = reference.pack_rows(parts, capacity)
    assert_equal(out.cpu(), ref, "pack_rows")
    from static_moe.reference.pack_rows import pack_layout, part_nbytes

    spans, _ = pack_layout([part_nbytes(p) for p in parts])
    for (off, n), p in zip(spans, parts):
        got = torch.ops.static_moe.unpack_rows(out, off, n, p.dtype, list(p.shape[1:]))
        assert_equal(got.cpu(), reference.unpack_rows(ref, off, n, p.dtype, list(p.shape[1:])), f"unpack @{off}")
    # unaligned spans and a strided (sliced) packed buffer take the slower copy paths
    got = torch.ops.static_moe.unpack_rows(out[:, 3:], 2, 7, torch.uint8, [7])
    assert_equal(got.cpu(), reference.unpack_rows(ref[:, 3:], 2, 7, torch.uint8, [7]), "unpack unaligned")


# ---------------------------------------------------------------------------------------------------------------
# swiglu_and_cast: SPEC §2 (bf16 within 1 ulp; fp8 scales bitwise, values within a step, >= 99.9 % bytes equal)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_format,group", [("fp8", 128), ("fp8", 32), ("bf16", 128)])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("weight", ["f32", "bf16", None])
def test_swiglu_and_cast_parity(dev, out_format, group, in_dtype, limit, weight):
    g = gen(11)
    rows, inter = 67, 512
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(in_dtype)
    gu[3] = 0  # all-zero row: floor scale
    w = None
    if weight is not None:
        w = torch.rand(rows, generator=g)
        w[5] = 0  # weight 0: zeros, floor scale
        w = w.to(torch.float32 if weight == "f32" else torch.bfloat16)
    for fp8_max, pow2 in ((448.0, True), (240.0, True), (448.0, False)):
        out = torch.ops.static_moe.swiglu_and_cast(
            gu.to(dev), None if w is None else w.to(dev), limit, out_format, group, fp8_max, pow2
        )
        out = (out[0].cpu(), out[1].cpu())
        ref = reference.swiglu_and_cast(gu, w, limit, out_format, group, fp8_max, pow2)
        what = f"swiglu {out_format} max={fp8_max} pow2={pow2}"
        if out_format == "fp8" and not pow2:
            assert_close_no_pow2(out, ref, what)
        else:
            assert_swiglu_close(out, ref, what)


def assert_close_no_pow2(out, ref, what):
    """fp8 out without power-of-two scales: the scale is amax / fp8_max itself and inherits the last-bit rounding
    of silu, which differs between any two exp implementations (GPU expf vs torch's CPU sigmoid), so scales are held
    to 2^-20 relative instead of bitwise; values within one fp8 step; >= 99.9 % bytes equal (the rule the CPU
    kernel's tests apply, tests/ops/test_swiglu_and_cast.py)."""
    (q, s), (rq, rs) = out, ref
    assert q.dtype == rq.dtype and q.shape == rq.shape and s.shape == rs.shape, what
    assert bool(((s - rs).abs() <= 2.0**-20 * rs.abs()).all()), f"{what}: scales differ beyond 2^-20 relative"
    g = q.shape[1] // s.shape[1]
    sc, rsc = s.repeat_interleave(g, dim=1), rs.repeat_interleave(g, dim=1)
    err = (q.float() * sc - rq.float() * rsc).abs()
    assert bool((err <= fp8_step(rq.float()) * rsc * (1 + 2.0**-19)).all()), f"{what}: values beyond one fp8 step"
    same = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
    assert same >= 0.999, f"{what}: only {same:.4%} of fp8 bytes equal"


# ---------------------------------------------------------------------------------------------------------------
# expert_gemm: SPEC §2 (calc_diff < 1e-5, elementwise bound), masked rows exact zeros and never read
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,wf,group", FORMAT_CASES, ids=FORMAT_IDS)
@pytest.mark.parametrize(
    "rows,n,k,p_active",
    [(1, 128, 128, 1.0), (7, 256, 512, 0.7), (100, 192, 256, 0.5), (33, 128, 384, 0.0), (70, 128, 256, 1.0)],
)
def test_expert_gemm_parity(dev, act, wf, group, rows, n, k, p_active):
    g = gen(rows * 1000 + n + k)
    a, a_s = activations(rows, k, act, group or 128, seed=rows + k)
    b, b_s = weights(3, n, k, wf, seed=n + k)
    mask = torch.rand(rows, generator=g) < p_active
    a = a.clone()
    a.view(torch.uint8)[~mask] = 0xFF  # masked rows: NaN / 0xFF padding must not leak
    if a_s is not None:
        a_s = a_s.clone()
        a_s[~mask] = float("nan")
    for expert in (0, 2):
        out = torch.ops.static_moe.expert_gemm(
            a.to(dev),
            None if a_s is None else a_s.to(dev),
            b.to(dev),
            None if b_s is None else b_s.to(dev),
            mask.to(dev),
            expert,
        ).cpu()
        ref = reference.expert_gemm(a, a_s, b, b_s, mask, expert)
        assert_gemm_close(out.float(), ref.float(), f"expert_gemm {act}x{wf} e{expert}")
        assert_equal(out[~mask], torch.zeros_like(out[~mask]), "masked rows")


def test_expert_gemm_fp4_dtype_views(dev):
    """torch.float4_e2m1fn_x2 weights and torch.float8_e8m0fnu scales are the same bytes as uint8."""
    a, a_s = activations(9, 256, "fp8", 32, seed=1)
    b, b_s = weights(2, 128, 256, "fp4", seed=2)
    mask = torch.ones(9, dtype=torch.bool)
    out_u8 = torch.ops.static_moe.expert_gemm(a.to(dev), a_s.to(dev), b.to(dev), b_s.to(dev), mask.to(dev), 1)
    out_x2 = torch.ops.static_moe.expert_gemm(
        a.to(dev),
        a_s.to(dev),
        b.view(torch.float4_e2m1fn_x2).to(dev),
        b_s.view(torch.float8_e8m0fnu).to(dev),
        mask.to(dev),
        1,
    )
    assert_equal(out_x2.cpu(), out_u8.cpu(), "dtype views")


# ---------------------------------------------------------------------------------------------------------------
# local_experts: SPEC §2 against the reference order
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,wf,group", FORMAT_CASES, ids=FORMAT_IDS)
@pytest.mark.parametrize("idx_dtype,w_dtype", [(torch.int32, torch.float32), (torch.int64, torch.bfloat16)])
def test_local_experts_parity(dev, act, wf, group, idx_dtype, w_dtype):
    rows, hidden, inter, num_local, num_experts, topk, offset = 96, 256, 256, 6, 24, 6, 6
    x, x_s = activations(rows, hidden, act, group or 128, seed=3)
    idx, w = routing(rows, topk, num_experts, seed=4, idx_dtype=idx_dtype, w_dtype=w_dtype, hot=offset + 2, pad_rows=8)
    if x_s is not None:
        x_s[-8:] = float("nan")
    w13, w13_s = weights(num_local, 2 * inter, hidden, wf, seed=5)
    w2, w2_s = weights(num_local, hidden, inter, wf, seed=6)
    for limit in (None, 3.0):
        args = (x, x_s, idx, w, w13, w13_s, w2, w2_s)
        out = torch.ops.static_moe.local_experts(
            *[None if t is None else t.to(dev) for t in args], offset, limit, 448.0
        ).cpu()
        ref = reference.local_experts(*args, offset, limit, 448.0)
        assert_gemm_close(out, ref, f"local_experts {act}x{wf} limit={limit}")
        assert_equal(out[-8:], torch.zeros_like(out[-8:]), "padded rows are exact zeros")


def test_local_experts_model_shape(dev):
    """One DeepSeek-V4-Flash-shaped call (H 4096, I 2048, fp8 activations x fp4 experts, top-6), 8 local experts."""
    rows, hidden, inter, num_local, num_experts, topk = 128, 4096, 2048, 8, 64, 6
    x, x_s = activations(rows, hidden, "fp8", 128, seed=21)
    idx, w = routing(rows, topk, num_experts, seed=22)
    w13, w13_s = weights(num_local, 2 * inter, hidden, "fp4", seed=23)
    w2, w2_s = weights(num_local, hidden, inter, "fp4", seed=24)
    args = (x, x_s, idx, w, w13, w13_s, w2, w2_s)
    out = torch.ops.static_moe.local_experts(*[t.to(dev) for t in args], 0, None, 448.0).cpu()
    ref = reference.local_experts(*args, 0, None, 448.0)
    assert_gemm_close(out, ref, "local_experts V4-Flash shape")


def test_local_experts_no_local_rows(dev):
    """Rows that route to no local expert (other ranks' experts, -1) give exact zeros; no expert is run."""
    x, _ = activations(10, 128, "bf16", 128, seed=1)
    idx = torch.full((10, 4), -1, dtype=torch.int32)
    idx[:, 0] = 50  # another rank's expert
    w = torch.rand(10, 4)
    w13, _ = weights(2, 256, 128, "bf16", seed=2)
    w2, _ = weights(2, 128, 128, "bf16", seed=3)
    out = torch.ops.static_moe.local_experts(
        x.to(dev), None, idx.to(dev), w.to(dev), w13.to(dev), None, w2.to(dev), None, 0, None, 448.0
    )
    assert_equal(out.cpu(), torch.zeros(10, 128), "no local rows")


# ---------------------------------------------------------------------------------------------------------------
# Determinism and batch invariance (bitwise)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,wf,group", [("fp8", "fp4", 128), ("bf16", "fp8", 0), ("fp8", "fp8", 32)])
def test_local_experts_deterministic_and_batch_invariant(dev, act, wf, group):
    rows, hidden, inter, num_local, topk = 64, 256, 128, 4, 4
    x, x_s = activations(rows, hidden, act, group or 128, seed=31)
    idx, w = routing(rows, topk, num_local, seed=32, hot=1)
    w13, w13_s = weights(num_local, 2 * inter, hidden, wf, seed=33)
    w2, w2_s = weights(num_local, hidden, inter, wf, seed=34)
    on = lambda t: None if t is None else t.to(dev)  # noqa: E731
    run = lambda i, ww: torch.ops.static_moe.local_experts(
        on(x),
        on(x_s),
        on(i),
        on(ww),
        on(w13),
        on(w13_s),  # noqa: E731
        on(w2),
        on(w2_s),
        0,
        None,
        448.0,
    ).cpu()
    full = run(idx, w)
    assert_equal(run(idx, w), full, "two identical calls")
    for r in (0, 17, 63):
        alone_idx = torch.full_like(idx, -1)
        alone_idx[r] = idx[r]
        assert_equal(run(alone_idx, w)[r], full[r], f"row {r} alone vs in the batch")


def test_expert_gemm_batch_invariant(dev):
    a, a_s = activations(80, 512, "fp8", 128, seed=41)
    b, b_s = weights(2, 256, 512, "fp4", seed=42)
    on = lambda t: t.to(dev)  # noqa: E731
    full = torch.ops.static_moe.expert_gemm(on(a), on(a_s), on(b), on(b_s), on(torch.ones(80, dtype=torch.bool)), 1)
    for r in (0, 40, 79):
        m = torch.zeros(80, dtype=torch.bool)
        m[r] = True
        one = torch.ops.static_moe.expert_gemm(on(a), on(a_s), on(b), on(b_s), on(m), 1)
        assert_equal(one[r].cpu(), full[r].cpu(), f"row {r}")


# ---------------------------------------------------------------------------------------------------------------
# GPU only: graph capture / replay, no host sync, device checks
# ---------------------------------------------------------------------------------------------------------------
def test_ops_do_not_synchronize(cuda_only):
    """torch's sync debug mode raises on any device-to-host synchronization inside the ops."""
    dev = cuda_only
    x, x_s = activations(32, 256, "fp8", 128, seed=51)
    idx, w = routing(32, 4, 8, seed=52)
    w13, w13_s = weights(4, 256, 256, "fp4", seed=53)
    w2, w2_s = weights(4, 256, 128, "fp4", seed=54)
    t = [v.to(dev) for v in (x, x_s, idx, w, w13, w13_s, w2, w2_s)]
    mask = (torch.arange(32) % 3 == 0).to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.static_moe.local_experts(*t, 0, 5.0, 448.0)
        torch.ops.static_moe.expert_gemm(t[0], t[1], t[4], t[5], mask, 2)
        q, s = torch.ops.static_moe.swiglu_and_cast(
            torch.randn(16, 256, device=dev), None, None, "fp8", 128, 448.0, True
        )
        packed = torch.ops.static_moe.pack_rows([q, s], 32)
        torch.ops.static_moe.unpack_rows(packed, 0, 128, torch.float8_e4m3fn, [128])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_graph_capture_and_replay(cuda_only):
    """local_experts and expert_gemm captured once replay correctly on new inputs written into the same buffers."""
    dev = cuda_only
    rows, hidden, inter, num_local, topk = 48, 256, 128, 4, 4
    x, x_s = activations(rows, hidden, "fp8", 128, seed=61)
    idx, w = routing(rows, topk, num_local, seed=62)
    w13, w13_s = weights(num_local, 2 * inter, hidden, "fp4", seed=63)
    w2, w2_s = weights(num_local, hidden, inter, "fp4", seed=64)
    sx, sxs, sidx, sw = (v.to(dev) for v in (x, x_s, idx, w))
    W = [v.to(dev) for v in (w13, w13_s, w2, w2_s)]
    mask = torch.ones(rows, dtype=torch.bool, device=dev)

    def step():
        return (
            torch.ops.static_moe.local_experts(sx, sxs, sidx, sw, *W, 0, None, 448.0),
            torch.ops.static_moe.expert_gemm(sx, sxs, W[0], W[1], mask, 1),
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph (first-use allocations, kernel attributes)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_le, out_eg = step()

    for seed in (65, 66):  # new routing and activations, same buffers
        x2, x2_s = activations(rows, hidden, "fp8", 128, seed=seed)
        idx2, w2_ = routing(rows, topk, num_local, seed=seed + 10, hot=seed % num_local)
        mask2 = torch.rand(rows, generator=gen(seed)) < 0.5
        sx.copy_(x2.to(dev))
        sxs.copy_(x2_s.to(dev))
        sidx.copy_(idx2.to(dev))
        sw.copy_(w2_.to(dev))
        mask.copy_(mask2.to(dev))
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.ops.static_moe.local_experts(sx, sxs, sidx, sw, *W, 0, None, 448.0)
        assert_equal(out_le.cpu(), eager.cpu(), "local_experts replay vs eager")
        ref = reference.expert_gemm(x2, x2_s, w13, w13_s, mask2, 1)
        assert_gemm_close(out_eg.cpu().float(), ref.float(), "expert_gemm replay vs reference")
        assert_equal(out_eg.cpu()[~mask2], torch.zeros_like(out_eg.cpu()[~mask2]), "replay masked rows")


def test_mixed_devices_rejected(cuda_only):
    a, _ = activations(4, 128, "bf16", 128, seed=1)
    b, _ = weights(1, 128, 128, "bf16", seed=2)
    with pytest.raises(ValueError, match="device"):
        torch.ops.static_moe.expert_gemm(
            a.to(cuda_only), None, b, None, torch.ones(4, dtype=torch.bool).to(cuda_only), 0
        )
