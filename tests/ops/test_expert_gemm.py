"""expert_gemm: the registered kernel (CPU here) vs the reference on every format pair and every CPU instruction
set — the SPEC §2 bound and, as the CPU kernels claim, the reference's bits (assert_gemm_bitwise: ≥ 99 % equal, no
signed drift) — plus crafted inputs (extreme UE8M0 bytes with unflushed products), masked rows that are never read,
batch invariance (bitwise), opcheck, torch.compile, and argument errors (SPEC §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import static_moe
from static_moe import reference
from static_moe.formats import quantize_activation
from static_moe.testing.generators import FORMAT_PAIRS, FP8_SCALE_KINDS, as_padding, random_weight
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close, assert_rejected_untouched

PAIR_IDS = [f"{a}x{w}" for a, w in FORMAT_PAIRS]


def _activations(rows, k, act, group, gen, scale=1.0, pow2=True):
    x = torch.randn(rows, k, generator=gen) * scale
    if act == "bf16":
        return x.to(torch.bfloat16), None
    return quantize_activation(x, group, pow2_scale=pow2)


def _poison_other_experts(b, b_scale, keep):
    """Every expert but `keep` full of 0xFF bytes, NaN scales / the UE8M0 NaN byte: reading one would show."""
    b = b.clone()
    other = torch.arange(b.shape[0]) != keep
    b.view(torch.uint8)[other] = 0xFF
    if b_scale is not None:
        b_scale = b_scale.clone()
        if b_scale.dtype == torch.float32:
            b_scale[other] = float("nan")
        else:
            b_scale.view(torch.uint8)[other] = 0xFF
    return b, b_scale


@settings(max_examples=30)
@given(
    pair=st.sampled_from(FORMAT_PAIRS),
    group=st.sampled_from([32, 128]),
    rows=st.integers(0, 12),
    k=st.sampled_from([128, 256, 384, 640, 1024]),  # K > 512: more than one chunk of prepared scales
    n=st.sampled_from([32, 96, 128, 200, 256]),
    num_experts=st.integers(1, 4),
    mask_p=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    pow2=st.booleans(),
    fp8_scales=st.sampled_from(FP8_SCALE_KINDS),
    expert_pick=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
# Edge cases by name, outside the random budget: no rows; every row masked (NaN padding only); fp8 weights with K
# spanning two scale chunks; fp4 with g = 32 and K = 1024.
@example(
    pair=("bf16", "bf16"),
    group=128,
    rows=0,
    k=128,
    n=32,
    num_experts=1,
    mask_p=1.0,
    scale=1.0,
    pow2=True,
    fp8_scales="pow2",
    expert_pick=0,
    seed=0,
)
@example(
    pair=("fp8", "fp8"),
    group=32,
    rows=7,
    k=256,
    n=96,
    num_experts=3,
    mask_p=0.0,
    scale=1.0,
    pow2=True,
    fp8_scales="mixed",
    expert_pick=2,
    seed=1,
)
@example(
    pair=("fp8", "fp8"),
    group=128,
    rows=5,
    k=640,
    n=128,
    num_experts=2,
    mask_p=0.5,
    scale=30.0,
    pow2=False,
    fp8_scales="float",
    expert_pick=1,
    seed=2,
)
@example(
    pair=("bf16", "fp4"),
    group=32,
    rows=9,
    k=1024,
    n=200,
    num_experts=4,
    mask_p=0.9,
    scale=1e-3,
    pow2=True,
    fp8_scales="pow2",
    expert_pick=3,
    seed=3,
)
def test_matches_reference(
    cpu_isa, pair, group, rows, k, n, num_experts, mask_p, scale, pow2, fp8_scales, expert_pick, seed
):
    act, wf = pair
    gen = torch.Generator().manual_seed(seed)
    expert = expert_pick % num_experts
    a, a_s = _activations(rows, k, act, group, gen, scale, pow2)
    b, b_s = random_weight(num_experts, n, k, wf, gen, fp8_scales)
    mask = torch.rand(rows, generator=gen) < mask_p
    ref = reference.expert_gemm(a, a_s, b, b_s, mask, expert)
    a, a_s = as_padding(a, a_s, ~mask)
    b, b_s = _poison_other_experts(b, b_s, expert)
    out = static_moe.expert_gemm(a, a_s, b, b_s, mask, expert)
    what = f"{cpu_isa} {act}x{wf} g={group} R={rows} K={k} N={n} e={expert}/{num_experts} fp8 scales {fp8_scales}"
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n), what
    assert_gemm_bitwise(out, ref, what)
    assert bool((out.view(torch.int16)[~mask] == 0).all()), f"{what}: masked rows must be exact (+0) zeros"


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_invariance_across_column_chunkings(cpu_isa, pair, rng):
    # N=1600 × K=128: 24 rows on two threads run in 10 chunks (384, 256, 7 × 128, 64 columns), one row (below the
    # parallel threshold) and one thread in 6 (512, 512, 256, 128, 128, 64); a column lands in a different block of
    # weight rows in each. Bits must agree (csrc/cpu/column_chunks.h: the chunks follow the thread count).
    a, a_s, b, b_s, full = _full_batch(pair, 24, 1600, 128, 1, 0, rng)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = static_moe.expert_gemm(a, a_s, b, b_s, torch.ones(24, dtype=torch.bool), 0)
    finally:
        torch.set_num_threads(threads)
    assert_equal(single, full, "1 thread vs the default")
    for r in [0, 11, 23]:
        _assert_one_row_batch(a, a_s, b, b_s, 0, full, r)


def _full_batch(pair, rows, n, k, experts, expert, rng):
    """Random ``rows`` activations and ``experts`` weights [N, K] of the format pair, and expert_gemm over all rows."""
    act, wf = pair
    a, a_s = _activations(rows, k, act, 32, rng)
    b, b_s = random_weight(experts, n, k, wf, rng)
    return a, a_s, b, b_s, static_moe.expert_gemm(a, a_s, b, b_s, torch.ones(rows, dtype=torch.bool), expert)


def _assert_one_row_batch(a, a_s, b, b_s, expert, full, r):
    """Row r of ``a`` alone, as a 1-row batch, gives row r of ``full`` (the batch's result) bit for bit."""
    one = static_moe.expert_gemm(
        a[r : r + 1], None if a_s is None else a_s[r : r + 1], b, b_s, torch.ones(1, dtype=torch.bool), expert
    )
    assert_equal(one[0], full[r], f"row {r} as a 1-row batch")


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_batch_invariance(cpu_isa, pair, rng):
    # 24 rows × N=600 (5 column chunks of 128 for the threads; not a multiple of any column block) × K=384: the batch
    # runs threaded in blocks of several rows, single rows on one thread with the one-row blocking. Bits must agree.
    a, a_s, b, b_s, full = _full_batch(pair, 24, 600, 384, 2, 1, rng)
    for r in [0, 5, 23]:
        mask = torch.zeros(24, dtype=torch.bool)
        mask[r] = True
        alone = static_moe.expert_gemm(a, a_s, b, b_s, mask, 1)
        assert_equal(alone[r], full[r], f"row {r} alone")
        _assert_one_row_batch(a, a_s, b, b_s, 1, full, r)
    for subset in ([1, 2, 3], [0, 4, 8, 9, 10, 11, 20]):
        mask = torch.zeros(24, dtype=torch.bool)
        mask[subset] = True
        sub = static_moe.expert_gemm(a, a_s, b, b_s, mask, 1)
        assert_equal(sub[subset], full[subset], f"rows {subset}")


def test_batch_invariance_rows_of_both_operand_forms(cpu_isa, rng):
    # fp8 rows with power-of-two scales are exact in bf16 (the avx512bf16 dot-product path takes them), rows with
    # other scales are not (float32 path): one GEMM runs both, and each row must come out as when alone.
    x = torch.randn(10, 256, generator=rng)
    q2, s2 = quantize_activation(x, 128, pow2_scale=True)
    q1, s1 = quantize_activation(x, 128, pow2_scale=False)
    odd = torch.arange(10) % 2 == 1
    a = torch.where(odd[:, None], q1.view(torch.uint8), q2.view(torch.uint8)).view(torch.float8_e4m3fn)
    a_s = torch.where(odd[:, None], s1, s2)
    b, b_s = random_weight(1, 640, 256, "fp4", rng)
    full = static_moe.expert_gemm(a, a_s, b, b_s, torch.ones(10, dtype=torch.bool), 0)
    assert_gemm_bitwise(full, reference.expert_gemm(a, a_s, b, b_s, torch.ones(10, dtype=torch.bool), 0))
    for r in range(10):
        one = static_moe.expert_gemm(a[r : r + 1], a_s[r : r + 1], b, b_s, torch.ones(1, dtype=torch.bool), 0)
        assert_equal(one[0], full[r], f"row {r} alone")


def test_fp4_extreme_scale_bytes(cpu_isa, rng):
    # Scale bytes 0 and 1 (values below 2^-126, subnormal) and 253 (2^126): outside the range where the avx512bf16
    # path scales its bf16 table by an exponent add, so it builds the table in fp32 instead.
    from static_moe.formats import pack_fp4

    codes = torch.randint(0, 16, (1, 96, 256), generator=rng, dtype=torch.uint8)
    codes[:, 32:64] &= 0x9  # rows with byte 253: magnitudes 0 and 0.5 only, so 2^126-sized values stay finite
    s = torch.randint(118, 126, (1, 96, 8), generator=rng, dtype=torch.uint8)
    s[:, :32] = torch.randint(0, 2, (1, 32, 8), generator=rng, dtype=torch.uint8)
    s[:, 32:64] = 253
    b = pack_fp4(codes)
    a = torch.randn(3, 256, generator=rng).to(torch.bfloat16)
    tiny = (a.float() * 2.0**-120).to(torch.bfloat16)  # products with 2^126-sized weights stay moderate
    mask = torch.ones(3, dtype=torch.bool)
    for x, cols in ((a, slice(0, 32)), (a, slice(64, 96)), (tiny, slice(32, 64))):
        out = static_moe.expert_gemm(x, None, b, s, mask, 0)[:, cols]
        ref = reference.expert_gemm(x, None, b, s, mask, 0)[:, cols]
        assert not torch.isinf(ref.float()).any()
        if cols.start == 0:  # ~1e-38 values: only their (negligible) size is checked
            assert bool((out.float().abs() < 1e-30).all()) and bool((ref.float().abs() < 1e-30).all())
        else:  # loose bound only: some of tiny's values are bf16 subnormals, which avx512bf16's vdpbf16ps
            # reads as zero (DAZ); test_fp4_extreme_scale_bytes_bitwise keeps activations normal and asks for bits
            assert_gemm_close(out, ref, f"{cpu_isa} columns {cols}")


def _normal_magnitudes(rows, k, exponent, gen):
    """float32 [rows, k]: random signs times (1 + u)·2^exponent, u ∈ [0, 1): every value a normal number."""
    sign = torch.where(torch.rand(rows, k, generator=gen) < 0.5, -1.0, 1.0)
    return sign * (1 + torch.rand(rows, k, generator=gen)) * 2.0**exponent


# (scale byte, exponent of the activations): products of moderate size, nothing flushed, nothing infinite
EXTREME_BYTES = [(0, 100), (1, 100), (254, -120), (127, 0)]


@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize("byte,exponent", EXTREME_BYTES, ids=[f"byte{b}" for b, _ in EXTREME_BYTES])
def test_fp4_extreme_scale_bytes_bitwise(cpu_isa, act, byte, exponent, rng):
    """UE8M0 bytes 0 (2^-127), 1 (2^-126) and 254 (2^127) on every weight block, with activations scaled so that
    every product is a moderate normal number (2^100-sized against the subnormal weights, 2^-120-sized against
    the huge ones): nothing is flushed to zero or overflows, so every ISA must give the reference's bits (the
    decode of each byte is exact). Byte 254 gets codes of magnitude ≤ 1 (6·2^127 overflows fp32). fp8
    activations carry the magnitude in their (power-of-two, so exact) scale."""
    from static_moe.formats import pack_fp4

    n, k = 48, 256
    codes = torch.randint(0, 16, (1, n, k), generator=rng, dtype=torch.uint8)
    if byte == 254:
        codes = codes % 3 | (codes & 0x8)  # magnitudes 0, 0.5, 1 with either sign
    b, b_s = pack_fp4(codes), torch.full((1, n, k // 32), byte, dtype=torch.uint8)
    x = _normal_magnitudes(4, k, 0, rng)
    if act == "bf16":
        a, a_s = (x * 2.0**exponent).to(torch.bfloat16), None
    else:
        a, a_s = quantize_activation(x, 128)
        a_s = a_s * 2.0**exponent
    mask = torch.ones(4, dtype=torch.bool)
    out = static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)
    ref = reference.expert_gemm(a, a_s, b, b_s, mask, 0)
    r = ref.float().abs()
    assert bool(torch.isfinite(r).all()) and bool((r[r > 0] > 2.0**-60).all()) and (r > 0).float().mean() > 0.9, (
        "the crafted input must keep the result finite, normal and (bar chance cancellations) non-zero"
    )
    assert_gemm_bitwise(out, ref, f"{cpu_isa} {act} scale byte {byte}")


@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_fp4_low_scale_bytes_mixed_bitwise(cpu_isa, act, rng):
    """Ordinary fp4 weights with every UE8M0 byte lowered by d (their minimum, so bytes 0 and 1 sit next to normal
    bytes in the same 512-k chunk and the same block of weight rows; rows 9 and 10 are kept at bytes >= 2) and
    activations raised by 2^d: every product is the unshifted one, exactly, so every ISA must give the reference's
    bits (avx512bf16 decodes bytes 0 and 1 2^64 larger and scales their sums back; read as bf16 subnormals, those
    weights would be zero). Two chunks of K, 7 rows (a block of 6 and a tail); a row alone gives the batch's bits."""
    n, k = 40, 1024
    b, b_s = random_weight(1, n, k, "fp4", rng)
    s = b_s.view(torch.uint8)
    d = int(s.min())
    s = s - d
    s[:, 9:11] = s[:, 9:11].clamp(min=2)
    # Row 8 mixes both kinds whatever the draw: one block at byte 0, the next at a normal byte (>= 2).
    s[0, 8, 0] = 0
    s[0, 8, 1] = s[0, 8, 1].clamp(min=2)
    assert bool((s[0, 8] < 2).any()) and bool((s[0, 8] >= 2).any()) and bool((s[0, 9:11] >= 2).all())
    x = torch.randn(7, k, generator=rng)
    if act == "bf16":
        a, a_s = (x.to(torch.bfloat16).float() * 2.0**d).to(torch.bfloat16), None
    else:
        a, a_s = quantize_activation(x, 128)
        a_s = a_s * 2.0**d
    mask = torch.ones(7, dtype=torch.bool)
    out = static_moe.expert_gemm(a, a_s, b, s, mask, 0)
    ref = reference.expert_gemm(a, a_s, b, s, mask, 0)
    assert float(ref.float().abs().mean()) > 0.1, "the crafted input must keep the result of ordinary size"
    assert_gemm_bitwise(out, ref, f"{cpu_isa} {act} scale bytes lowered by {d}")
    for r in (0, 6):
        one = static_moe.expert_gemm(a[r : r + 1], None if a_s is None else a_s[r : r + 1], b, s, mask[:1], 0)
        assert_equal(one[0], out[r], f"{cpu_isa} {act} row {r} alone")


def test_fp4_dtype_views_and_strided_inputs(rng):
    a, _ = _activations(7, 256, "bf16", 128, rng)
    b, b_s = random_weight(3, 160, 256, "fp4", rng)
    mask = torch.tensor([1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    ref = reference.expert_gemm(a, None, b, b_s, mask, 2)
    views = static_moe.expert_gemm(a, None, b.view(torch.float4_e2m1fn_x2), b_s.view(torch.float8_e8m0fnu), mask, 2)
    assert_equal(views, static_moe.expert_gemm(a, None, b, b_s, mask, 2), "float4/e8m0 dtypes vs uint8")
    assert_gemm_bitwise(views, ref, "fp4 views")
    wide = torch.zeros(7, 512, dtype=torch.bfloat16)
    wide[:, 128:384] = a
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)  # same values, K not contiguous
    strided = static_moe.expert_gemm(wide[:, 128:384], None, b_t, b_s, mask, 2)
    assert_equal(strided, views, "strided a and b")


def test_large_k_and_n_threaded(rng):
    a, a_s = _activations(20, 1024, "fp8", 128, rng)
    b, b_s = random_weight(1, 512, 1024, "fp4", rng)
    mask = torch.rand(20, generator=rng) < 0.7
    assert_gemm_bitwise(static_moe.expert_gemm(a, a_s, b, b_s, mask, 0), reference.expert_gemm(a, a_s, b, b_s, mask, 0))


_G = torch.Generator().manual_seed(4321)


def _sample(act, wf, rows, group=128, n=128, k=256, experts=2, expert=1, mask=None):
    a, a_s = _activations(rows, k, act, group, _G)
    b, b_s = random_weight(experts, n, k, wf, _G)
    mask = torch.rand(rows, generator=_G) < 0.6 if mask is None else mask
    return (a, a_s, b, b_s, mask, expert)


SAMPLES = [
    _sample("bf16", "fp4", 6),
    _sample("fp8", "fp8", 5, group=32),
    _sample("bf16", "bf16", 3),
    _sample("fp8", "fp4", 0),
    _sample("bf16", "fp8", 4, mask=torch.ones(4, dtype=torch.bool)),
]


@pytest.mark.parametrize("args", SAMPLES, ids=["bf16xfp4", "fp8xfp8_g32", "bf16xbf16", "empty", "bf16xfp8"])
def test_opcheck(args):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in args):
        # torch's schema checker compares inputs with allclose, which float8 lacks on the CPU ("mul_cpu_reduced_float"
        # not implemented); the other checks run, and test_rejects / the parity tests see inputs stay unchanged.
        utils = utils[1:]
    torch.library.opcheck(torch.ops.static_moe.expert_gemm.default, args, test_utils=utils)


def test_compile_fullgraph_matches_eager(rng):
    a, a_s = _activations(9, 256, "fp8", 128, rng)
    b, b_s = random_weight(3, 128, 256, "fp4", rng)
    mask = torch.rand(9, generator=rng) < 0.5

    def f(a, a_s, b, b_s, mask):
        d0 = static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)
        d2 = static_moe.expert_gemm(a, a_s, b, b_s, ~mask, 2)
        return d0.float() + d2.float()

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(a, a_s, b, b_s, mask)
    assert_equal(got, f(a, a_s, b, b_s, mask))


# ---------------------------------------------------------------------------------------------------------------
# Argument errors: eager kernel and fake kernel (trace) give the same messages
# ---------------------------------------------------------------------------------------------------------------
def _a(r=4, k=256, dtype=torch.bfloat16):
    return torch.zeros(r, k, dtype=dtype)


def _b(l=2, n=64, k=256, dtype=torch.bfloat16):
    return torch.zeros(l, n, k, dtype=dtype)


_M4 = torch.ones(4, dtype=torch.bool)
_FP8 = torch.float8_e4m3fn
_S8 = torch.ones(2, 64, 2)  # fp8 weight scales for K = 256
_S4 = torch.full((2, 64, 8), 127, dtype=torch.uint8)  # fp4 weight scales for K = 256

BAD = [
    (
        (_a(dtype=torch.float32), None, _b(), None, _M4, 0),
        TypeError,
        r"a must have an activation dtype: torch\.bfloat16 \(bf16\) or torch\.float8_e4m3fn \(fp8\), got torch\.float32",
    ),
    ((_a(dtype=_FP8), None, _b(dtype=_FP8), _S8, _M4, 0), ValueError, r"a_scale is required when a is fp8"),
    (
        (_a(dtype=_FP8), torch.ones(4, 3), _b(dtype=_FP8), _S8, _M4, 0),
        ValueError,
        r"activation group a\.size\(1\) / a_scale\.size\(1\) must be 32 or 128",
    ),
    (
        (_a(dtype=_FP8), torch.ones(5, 2), _b(dtype=_FP8), _S8, _M4, 0),
        ValueError,
        r"a_scale\.size\(0\) must be R = a\.size\(0\) = 4, got 5",
    ),
    ((_a(), torch.ones(4, 2), _b(), None, _M4, 0), ValueError, r"a_scale must be None when a is bf16"),
    ((_a(k=96), None, _b(k=96), None, _M4, 0), ValueError, r"K = a\.size\(1\) must be a multiple of 128, got 96"),
    (
        (_a(), None, _b(k=384), None, _M4, 0),
        ValueError,
        r"b must have shape \[L, N, K\] = \[2, 64, 256\], got \[2, 64, 384\]",
    ),
    (
        (_a(dtype=_FP8), torch.ones(4, 2), _b(), None, _M4, 0),
        ValueError,
        r"unsupported format pair: a is fp8 and b is bf16",
    ),
    ((_a(), None, _b(dtype=torch.float16), None, _M4, 0), TypeError, r"b must have a weight dtype"),
    ((_a(), None, _b(dtype=_FP8), None, _M4, 0), ValueError, r"b_scale is required for fp8 b"),
    (
        (_a(), None, _b(dtype=_FP8), torch.ones(2, 64, 3), _M4, 0),
        ValueError,
        r"b_scale must have shape \[L, N, K/128\] = \[2, 64, 2\], got \[2, 64, 3\]",
    ),
    (
        (_a(), None, _b(k=128, dtype=torch.uint8), torch.ones(2, 64, 8), _M4, 0),
        TypeError,
        r"b_scale must have dtype torch\.uint8 or torch\.float8_e8m0fnu, got torch\.float32",
    ),
    (
        (_a(), None, _b(k=128, dtype=torch.uint8), _S4[:, :32], _M4, 0),
        ValueError,
        r"b_scale must have shape \[L, N, K/32\] = \[2, 64, 8\], got \[2, 32, 8\]",
    ),
    ((_a(), None, _b(), torch.ones(2, 64, 2), _M4, 0), ValueError, r"b_scale must be None for bf16 b"),
    (
        (_a(), None, _b(), None, torch.ones(4, dtype=torch.int32), 0),
        TypeError,
        r"row_mask must have dtype torch\.bool, got torch\.int32",
    ),
    (
        (_a(), None, _b(), None, torch.ones(5, dtype=torch.bool), 0),
        ValueError,
        r"row_mask must have shape \[R\] with R = a\.size\(0\) = \[4\], got \[5\]",
    ),
    ((_a(), None, _b(), None, _M4, 2), ValueError, r"expert must index b's experts, 0 <= expert < L = 2 .*got 2"),
    ((_a(), None, _b(), None, _M4, -1), ValueError, r"0 <= expert < L = 2 .*got -1"),
    (
        (_a(), None, _b(), None, torch.ones(4, dtype=torch.bool, device="meta"), 0),
        ValueError,
        r"row_mask must be on the same device as a \(cpu\), got meta",
    ),
]


@pytest.mark.parametrize("args,exc,msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_rejects(args, exc, msg):
    assert_rejected_untouched(static_moe.expert_gemm, args, exc, msg)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e8m0fnu])
def test_rejects_nan_scale_byte_of_the_expert_it_reads(dtype, rng):
    a, _ = _activations(4, 256, "bf16", 128, rng)
    b, b_s = random_weight(3, 64, 256, "fp4", rng)
    b_s[2, 17, 5] = 255
    b_s = b_s.view(dtype)
    with pytest.raises(ValueError, match=r"b_scale of expert 2 holds the UE8M0 NaN byte 255"):
        static_moe.expert_gemm(a, None, b, b_s, _M4, 2)
    # Expert 1's bytes are fine: an expert that is not computed is not read.
    assert_gemm_bitwise(
        static_moe.expert_gemm(a, None, b, b_s, _M4, 1),
        reference.expert_gemm(a, None, b, b_s.view(torch.uint8), _M4, 1),
    )


def test_rejects_unknown_forced_isa(monkeypatch):
    monkeypatch.setenv("STATIC_MOE_CPU_ISA", "avx9000")
    with pytest.raises(
        ValueError, match=r"STATIC_MOE_CPU_ISA must be one of scalar, avx2, avx512, avx512bf16, amx, auto"
    ):
        static_moe.expert_gemm(_a(), None, _b(), None, _M4, 0)


def test_fake_kernel_rejects_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"0 <= expert < L = 2 .*got 5"):
            torch.ops.static_moe.expert_gemm(_a(), None, _b(), None, torch.ones(4, dtype=torch.bool), 5)
        out = torch.ops.static_moe.expert_gemm(_a(), None, _b(), None, torch.ones(4, dtype=torch.bool), 1)
        assert out.shape == (4, 64) and out.dtype == torch.bfloat16

    def f(a, b, mask):
        return static_moe.expert_gemm(a, None, b, None, mask, 0)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"K = a\.size\(1\) must be a multiple of 128, got 96"):
        torch.compile(f, fullgraph=True)(_a(k=96), _b(k=96), _M4)
