"""Property tests of the quantisers and the packed layout with edge-biased strategies (hypothesis): values drawn
mostly from the formats' edges — ±0, fp32 subnormals, the amax floor, the largest finite exponents, the
rounding midpoints of e4m3fn and e2m1 — placed mostly at the first and last element of a block, and part widths
just below, at and above the 16-byte alignment with T at 0, 1, C−1 and C.

Expected values are computed independently (numpy float32 arithmetic, frexp and ml_dtypes casts), the C++ kernels
against the reference ops. Derandomized with few examples (tests/conftest.py's profile): a fixed, cheap set in CI.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import static_moe  # noqa: F401  (registers the ops)
from static_moe import formats, reference
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.testing.numeric import assert_equal, assert_swiglu_close

F32_MAX = float(np.finfo(np.float32).max)
EDGES = [
    0.0,
    -0.0,
    2.0**-149,
    -(2.0**-149),
    2.0**-127,
    2.0**-126,
    -(2.0**-126),
    1e-4,
    2.0**-14,
    0.25,
    0.75,
    1.25,
    1.75,
    2.5,
    3.5,
    5.0,
    6.0,
    1.0625,
    240.0,
    448.0,
    464.0,
    2.0**120,
    -(2.0**126),
    3.0e38,
    -F32_MAX,
]
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
subnormal = st.floats(min_value=-(2.0**-126), max_value=2.0**-126, width=32)
edge_value = st.one_of(st.sampled_from(EDGES), subnormal, f32, st.sampled_from(EDGES).map(lambda v: -v))


@st.composite
def blocks(draw, block: int, nblocks: int = 2, rows: int = 2) -> np.ndarray:
    """float32 [rows, nblocks·block]: a background at one random scale, edge values at the first / last element
    of blocks (mostly) or anywhere."""
    scale = draw(st.sampled_from([0.0, 2.0**-140, 2.0**-30, 1.0, 2.0**60, 2.0**120]))
    seed = draw(st.integers(0, 2**16))
    x = (np.random.default_rng(seed).standard_normal((rows, nblocks * block)) * scale).astype(np.float32)
    for _ in range(draw(st.integers(1, 6))):
        r = draw(st.integers(0, rows - 1))
        b = draw(st.integers(0, nblocks - 1))
        pos = draw(st.one_of(st.sampled_from([0, block - 1]), st.integers(0, block - 1)))
        x[r, b * block + pos] = np.float32(draw(edge_value))
    return x


def _pow2_at_least(y: float) -> float:
    """The smallest power of two >= y > 0 (exact, from frexp)."""
    m, e = math.frexp(float(y))
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


@settings(max_examples=40)
@given(x=blocks(32, nblocks=3), fp8_max=st.sampled_from([448.0, 240.0]))
def test_quantize_activation_matches_an_independent_model(x, fp8_max):
    q, s = formats.quantize_activation(torch.from_numpy(x), 32, fp8_max)
    v = x.reshape(x.shape[0], -1, 32)
    amax = np.maximum(np.abs(v).max(-1), np.float32(formats.AMAX_FLOOR))
    want_s = np.vectorize(lambda a: _pow2_at_least(np.float32(a) / np.float32(fp8_max)))(amax).astype(np.float32)
    assert_equal(s, torch.from_numpy(want_s), "scales")
    scaled = np.clip(v / want_s[..., None], -fp8_max, fp8_max).astype(np.float32)
    want_q = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(x.shape)
    assert_equal(q.view(torch.uint8), torch.from_numpy(want_q), "e4m3fn bytes")


@settings(max_examples=40)
@given(x=blocks(32, nblocks=3))
def test_quantize_weight_fp4_matches_an_independent_model(x):
    q, s = formats.quantize_weight(torch.from_numpy(x), "fp4")
    v = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(-1)
    exps = np.zeros(amax.shape, dtype=np.int32)
    for i in np.ndindex(amax.shape):
        if amax[i] == 0:
            exps[i] = -127
        else:
            # the SPEC's ceil(log2(amax / 6)) on the exact quotient (float64 holds it to far below a power of two)
            exps[i] = min(max(int(math.log2(_pow2_at_least(float(amax[i]) / 6.0))), -127), 127)
    assert_equal(s, torch.from_numpy((exps + 127).astype(np.uint8)), "UE8M0 bytes")
    scale = np.ldexp(np.float32(1), exps).astype(np.float32)
    codes = (v / scale[..., None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert_equal(formats.unpack_fp4(q), torch.from_numpy(codes.reshape(x.shape).astype(np.uint8)), "e2m1 codes")


@settings(max_examples=30)
@given(
    gu=blocks(128, nblocks=4, rows=3),
    w=st.lists(
        st.one_of(st.sampled_from([0.0, 2.0**-100, 1.0, 2.0**20]), st.floats(0, 4, width=32)), min_size=3, max_size=3
    ),
    group=st.sampled_from([32, 128]),
    out_format=st.sampled_from(["fp8", "bf16"]),
    pow2=st.booleans(),
)
def test_swiglu_kernel_quantiser_matches_reference(gu, w, group, out_format, pow2):
    """The CPU kernel's fp8 re-quantisation on edge values vs the reference (finite SwiGLU values only: the
    non-finite contract has its own tests)."""
    gate_up = torch.from_numpy(gu)
    weight = torch.tensor(w, dtype=torch.float32)
    if not bool(torch.isfinite(_swiglu(gate_up, weight)).all()):
        return
    args = (gate_up, weight, None, out_format, group, 448.0, pow2)
    out = torch.ops.static_moe.swiglu_and_cast(*args)
    assert_swiglu_close(out, reference.swiglu_and_cast(*args), f"{out_format} g{group}")


def _swiglu(gate_up, weight):
    from static_moe.reference.swiglu_and_cast import swiglu

    return swiglu(gate_up, weight, None)


WIDTHS = [0, 1, 2, 15, 16, 17, 31, 32, 33, 64]


@settings(max_examples=30)
@given(
    widths=st.lists(st.sampled_from(WIDTHS) | st.integers(1, 80), min_size=1, max_size=5),
    capacity=st.integers(1, 9),
    where=st.sampled_from(["empty", "one", "below_full", "full", "any"]),
    seed=st.integers(0, 2**16),
)
def test_packed_layout_matches_reference(widths, capacity, where, seed):
    t = {"empty": 0, "one": 1, "below_full": capacity - 1, "full": capacity}.get(where, seed % (capacity + 1))
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in widths:
        raw = torch.randint(0, 256, (t, n), generator=g, dtype=torch.uint8)
        if n:
            raw[:, 0], raw[:, -1] = 0x00, 0xFE  # the first and last byte of each part differ from the padding
        parts.append(raw)
    spans, width = pack_layout([part_nbytes(p) for p in parts])
    assert all(off % 16 == 0 for off, _ in spans) and width % 16 == 0
    assert width == sum(n + (-n) % 16 for n in widths), "a part takes more than its bytes rounded up to 16"
    assert [off for off, _ in spans] == [sum(m + (-m) % 16 for m in widths[:i]) for i in range(len(widths))]
    assert all(b[0] >= a[0] + a[1] for a, b in zip(spans, spans[1:])), "spans overlap"
    packed = torch.ops.static_moe.pack_rows(parts, capacity)
    assert_equal(packed, reference.pack_rows(parts, capacity), "pack")
    for p, (off, n) in zip(parts, spans):
        got = torch.ops.static_moe.unpack_rows(packed, off, n, torch.uint8, [n])
        assert_equal(got, reference.unpack_rows(packed, off, n, torch.uint8, [n]), "unpack")
        assert_equal(got[:t], p, "round trip")
        assert bool((got[t:] == 0xFF).all()), "rows past T are padding"
