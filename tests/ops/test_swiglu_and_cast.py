"""swiglu_and_cast: the registered kernel (CPU here) vs the reference at SPEC §2 tolerances, the kernel's exact
casts vs torch's, batch invariance, opcheck, torch.compile, and argument errors (SPEC §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import static_moe
from static_moe import _C, reference
from static_moe.reference.swiglu_and_cast import floor_scale
from static_moe.testing.numeric import assert_equal, assert_swiglu_close


def _inputs(rows, inter, in_dtype, scale, weights, gen):
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * scale).to(in_dtype)
    if weights == "none":
        w = None
    else:
        w = torch.rand(rows, generator=gen)
        if weights == "with_zeros":
            w[torch.rand(rows, generator=gen) < 0.3] = 0.0
    return gate_up, w


@settings(max_examples=60)
@given(
    rows=st.integers(0, 33),
    inter=st.sampled_from([128, 256, 384]),
    group=st.sampled_from([32, 128]),
    limit=st.sampled_from([None, 7.0, 0.75]),
    weights=st.sampled_from(["none", "random", "with_zeros"]),
    fp8_max=st.sampled_from([448.0, 240.0]),
    pow2=st.booleans(),
    out_format=st.sampled_from(["fp8", "bf16"]),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    scale=st.sampled_from([1e-3, 1.0, 6.0, 200.0]),
    seed=st.integers(0, 2**31 - 1),
)
# Edge cases by name, outside the random budget: no rows; each clamp value with each fp8_max; weight-0 rows (the
# padding rows of a gathered batch); values far above the clamp. Non-finite inputs: test_nonfinite_values_*.
@example(
    rows=0,
    inter=128,
    group=128,
    limit=None,
    weights="none",
    fp8_max=448.0,
    pow2=True,
    out_format="fp8",
    in_dtype=torch.float32,
    scale=1.0,
    seed=0,
)
@example(
    rows=9,
    inter=256,
    group=32,
    limit=None,
    weights="with_zeros",
    fp8_max=240.0,
    pow2=True,
    out_format="fp8",
    in_dtype=torch.bfloat16,
    scale=6.0,
    seed=1,
)
@example(
    rows=9,
    inter=256,
    group=32,
    limit=7.0,
    weights="random",
    fp8_max=240.0,
    pow2=True,
    out_format="fp8",
    in_dtype=torch.bfloat16,
    scale=200.0,
    seed=2,
)
@example(
    rows=9,
    inter=384,
    group=128,
    limit=0.75,
    weights="with_zeros",
    fp8_max=448.0,
    pow2=False,
    out_format="fp8",
    in_dtype=torch.float32,
    scale=6.0,
    seed=3,
)
@example(
    rows=9,
    inter=128,
    group=128,
    limit=7.0,
    weights="random",
    fp8_max=448.0,
    pow2=True,
    out_format="bf16",
    in_dtype=torch.float32,
    scale=200.0,
    seed=4,
)
@example(
    rows=9,
    inter=128,
    group=32,
    limit=0.75,
    weights="none",
    fp8_max=240.0,
    pow2=False,
    out_format="fp8",
    in_dtype=torch.bfloat16,
    scale=200.0,
    seed=5,
)
def test_matches_reference(rows, inter, group, limit, weights, fp8_max, pow2, out_format, in_dtype, scale, seed):
    gate_up, w = _inputs(rows, inter, in_dtype, scale, weights, torch.Generator().manual_seed(seed))
    args = (gate_up, w, limit, out_format, group, fp8_max, pow2)
    out = static_moe.swiglu_and_cast(*args)
    ref = reference.swiglu_and_cast(*args)
    what = f"rows={rows} I={inter} g={group} limit={limit} {weights} max={fp8_max} pow2={pow2} {out_format}"
    # float scales: SPEC §6.2 (torch's CPU sigmoid changes its last bits with the tensor's length)
    assert_swiglu_close(out, ref, what, float_scales=out_format == "fp8" and not pow2)
    if out_format == "fp8" and w is not None:
        zero = w == 0  # weight 0: q = ±0 everywhere and the floor scale (SPEC §1.5)
        q_bytes = out[0].view(torch.uint8)[zero]
        assert bool(((q_bytes == 0x00) | (q_bytes == 0x80)).all())
        assert bool((out[1][zero] == floor_scale(fp8_max, pow2)).all())


def test_large_rows_threaded_and_strided_input(rng):
    big = torch.randn(300, 2 * 512 + 64, generator=rng).to(torch.bfloat16)
    gate_up = big[:, 32 : 32 + 1024]  # row stride 1088, unit column stride
    w = torch.rand(300, generator=rng)
    out = static_moe.swiglu_and_cast(gate_up, w, 7.0, "fp8", 128, 448.0, True)
    assert_swiglu_close(out, reference.swiglu_and_cast(gate_up, w, 7.0, "fp8", 128, 448.0, True))
    contiguous = static_moe.swiglu_and_cast(gate_up.contiguous(), w, 7.0, "fp8", 128, 448.0, True)
    assert_equal(out[0], contiguous[0])
    assert_equal(out[1], contiguous[1])


@pytest.mark.parametrize("out_format", ["fp8", "bf16"])
@pytest.mark.parametrize("pow2", [True, False])
def test_batch_invariance(out_format, pow2, rng):
    # 96 × 512 outputs: above the OpenMP threshold, so the batch runs threaded while single rows do not.
    gate_up = torch.randn(96, 1024, generator=rng) * 4
    w = torch.rand(96, generator=rng)
    q, s = static_moe.swiglu_and_cast(gate_up, w, 6.0, out_format, 32, 448.0, pow2)
    for r in [0, 1, 47, 95]:
        q1, s1 = static_moe.swiglu_and_cast(
            gate_up[r : r + 1].clone(), w[r : r + 1].clone(), 6.0, out_format, 32, 448.0, pow2
        )
        assert_equal(q1, q[r : r + 1], f"row {r} alone")
        assert_equal(s1, s[r : r + 1], f"row {r} alone (scales)")
    sub = torch.tensor([5, 17, 60])
    qs, ss = static_moe.swiglu_and_cast(gate_up[sub], w[sub], 6.0, out_format, 32, 448.0, pow2)
    assert_equal(qs, q[sub], "row subset")
    assert_equal(ss, s[sub], "row subset (scales)")


def _float_sweep(gen) -> torch.Tensor:
    """Random float32 bit patterns (every class: NaN, inf, subnormal, ±0) plus a dense walk over the fp8 range."""
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int64, generator=gen).to(torch.int32)
    dense = torch.arange(0x38000000, 0x44000000, 61, dtype=torch.int64).to(torch.int32)  # 2^-15 … 512
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            -float("nan"),
            448.0,
            464.0,
            464.00003,
            480.0,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-10,
            2.0**-6,
            1.0625,
        ]
    )
    return torch.cat([bits.view(torch.float32), dense.view(torch.float32), -dense.view(torch.float32), special])


def test_exact_fp8_cast_matches_torch(rng):
    x = _float_sweep(rng)
    assert_equal(_C._cast_e4m3fn(x), x.to(torch.float8_e4m3fn), "float32 -> e4m3fn")


def test_exact_bf16_cast_matches_torch(rng):
    x = _float_sweep(rng)
    assert_equal(_C._cast_bf16(x), x.to(torch.bfloat16), "float32 -> bf16")


_G = torch.Generator().manual_seed(1234)
SAMPLES = [
    (torch.randn(6, 256, generator=_G), torch.rand(6, generator=_G), 7.0, "fp8", 128, 448.0, True),
    (torch.randn(6, 256, generator=_G).to(torch.bfloat16), None, None, "fp8", 32, 240.0, False),
    (torch.randn(6, 256, generator=_G), torch.rand(6, generator=_G), None, "bf16", 128, 448.0, True),
    (torch.randn(0, 256, generator=_G), None, 3.0, "fp8", 128, 448.0, True),
]


@pytest.mark.parametrize("args", SAMPLES, ids=["fp8", "fp8_g32_nopow2", "bf16", "empty"])
def test_opcheck(args):
    torch.library.opcheck(torch.ops.static_moe.swiglu_and_cast.default, args)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dynamic, rng):
    gate_up = torch.randn(12, 512, generator=rng)
    w = torch.rand(12, generator=rng)

    def f(gu, w):
        q, s = static_moe.swiglu_and_cast(gu, w, 7.0, "fp8", 128, 448.0, True)
        b, _ = static_moe.swiglu_and_cast(gu, None, None, "bf16")
        return q, s, b

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, dynamic=dynamic)(gate_up, w)
    for a, b in zip(got, f(gate_up, w)):
        assert_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Argument errors: eager kernel and fake kernel (trace) give the same messages
# ---------------------------------------------------------------------------------------------------------------
def _gu(r=4, two_i=256, dtype=torch.float32, device="cpu"):
    return torch.zeros(r, two_i, dtype=dtype, device=device)


BAD = [
    (
        (_gu(dtype=torch.int32), None, None, "fp8", 128, 448.0, True),
        TypeError,
        r"gate_up must have dtype torch\.bfloat16 or torch\.float32, got torch\.int32",
    ),
    ((torch.zeros(256), None, None, "fp8", 128, 448.0, True), ValueError, r"gate_up must be 2-D \[R, 2I\], got 1-D"),
    (
        (_gu(two_i=258), None, None, "fp8", 128, 448.0, True),
        ValueError,
        r"I = gate_up\.size\(1\) / 2 must be a multiple of group_size = 128, got I = 129",
    ),
    ((_gu(two_i=257), None, None, "bf16", 128, 448.0, True), ValueError, r"gate_up\.size\(1\) = 2I must be even"),
    (
        (_gu(two_i=192), None, None, "fp8", 128, 448.0, True),
        ValueError,
        r"must be a multiple of group_size = 128, got I = 96",
    ),
    ((_gu(), None, None, "fp8", 64, 448.0, True), ValueError, r"group_size must be 32 or 128, got 64"),
    ((_gu(), None, None, "fp8", 128, 500.0, True), ValueError, r"fp8_max must be in \[2, 448\].*got 500"),
    ((_gu(), None, None, "fp8", 128, 0.0, True), ValueError, r"fp8_max must be in \[2, 448\]"),
    ((_gu(), None, None, "fp4", 128, 448.0, True), ValueError, r"out_format must be \"fp8\" or \"bf16\", got \"fp4\""),
    (
        (_gu(), torch.zeros(5), None, "fp8", 128, 448.0, True),
        ValueError,
        r"row_weight must have shape \[R\] with R = gate_up\.size\(0\) = \[4\], got \[5\]",
    ),
    (
        (_gu(), torch.zeros(4, dtype=torch.int64), None, "fp8", 128, 448.0, True),
        TypeError,
        r"row_weight must have dtype torch\.float32 or torch\.bfloat16, got torch\.int64",
    ),
    (
        (_gu(), None, -1.0, "fp8", 128, 448.0, True),
        ValueError,
        r"swiglu_limit must be None or a positive finite number, got -1",
    ),
    ((_gu(), None, float("nan"), "fp8", 128, 448.0, True), ValueError, r"swiglu_limit must be None or a positive"),
    (
        (_gu(), torch.zeros(4, device="meta"), None, "fp8", 128, 448.0, True),
        ValueError,
        r"row_weight must be on the same device as gate_up \(cpu\), got meta",
    ),
]


@pytest.mark.parametrize("args,exc,msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_rejects(args, exc, msg):
    before = args[0].clone() if args[0].device.type == "cpu" else None
    with pytest.raises(exc, match=msg):
        static_moe.swiglu_and_cast(*args)
    if before is not None:
        assert_equal(args[0], before, "gate_up untouched")


def test_fake_kernel_rejects_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"group_size must be 32 or 128, got 64"):
            torch.ops.static_moe.swiglu_and_cast(torch.empty(4, 256), None, None, "fp8", 64, 448.0, True)
        q, s = torch.ops.static_moe.swiglu_and_cast(torch.empty(4, 256), None, None, "fp8", 32, 448.0, True)
        assert q.shape == (4, 128) and q.dtype == torch.float8_e4m3fn and s.shape == (4, 4)

    def f(gu):
        return static_moe.swiglu_and_cast(gu, None, None, "fp8", 128, 448.0, True)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"must be a multiple of group_size = 128, got I = 96"):
        torch.compile(f, fullgraph=True)(torch.zeros(4, 192))


# ---------------------------------------------------------------------------------------------------------------
# Non-finite inputs (SPEC §1.5): they propagate, confined to their group; never finite garbage
# ---------------------------------------------------------------------------------------------------------------
NONFINITE = [
    ("gate", float("nan")),
    ("up", float("nan")),
    ("weight", float("nan")),
    ("gate", -float("inf")),
    ("gate", float("inf")),
    ("up", float("inf")),
    ("up", -float("inf")),
]


@pytest.mark.parametrize("where,value", NONFINITE, ids=[f"{w}={v}" for w, v in NONFINITE])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("out_format,pow2", [("fp8", True), ("fp8", False), ("bf16", True)])
def test_nonfinite_values_stay_in_their_group(where, value, limit, out_format, pow2):
    from static_moe.reference.swiglu_and_cast import swiglu
    from static_moe.testing.generators import poisoned_swiglu_input
    from static_moe.testing.numeric import assert_nonfinite_confined

    bad_gu, bad_w, gu, w = poisoned_swiglu_input(where, value)
    nonfinite = ~torch.isfinite(swiglu(bad_gu, bad_w, limit))
    touched = swiglu(bad_gu, bad_w, limit) != swiglu(gu, w, limit)  # NaN != x: poisoned positions included
    for group in (32, 128):
        args = (limit, out_format, group, 448.0, pow2)
        what = f"{where}={value} limit={limit} {out_format} g={group} pow2={pow2}"
        for name, op in (("kernel", static_moe.swiglu_and_cast), ("reference", reference.swiglu_and_cast)):
            assert_nonfinite_confined(op(bad_gu, bad_w, *args), op(gu, w, *args), touched, nonfinite, f"{name} {what}")
