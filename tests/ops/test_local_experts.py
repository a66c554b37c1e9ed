"""local_experts: the registered kernel (CPU here) vs the reference on every format pair and every CPU instruction
set, at the SPEC §2 bound and the reference's bits (assert_gemm_bitwise) — routing with empty slots, duplicate
ids, other ranks' ids, skew, and 0xFF padding rows that must not leak — plus crafted inputs for the expert
summation order and for fp8_max (240 vs 448), experts without rows that are never read, batch invariance
(bitwise), opcheck, torch.compile, and argument errors (SPEC §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import static_moe
from static_moe import reference
from static_moe.testing.generators import FORMAT_PAIRS, make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close, assert_rejected_untouched

PAIR_IDS = [f"{a}x{w}" for a, w in FORMAT_PAIRS]


def _args(x, x_s, idx, wts, w, offset, limit=None, fp8_max=448.0):
    return (x, x_s, idx, wts, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], offset, limit, fp8_max)


def _pad(x, x_s, idx, wts, capacity):
    """Rows T … C−1 as pack_rows leaves them: 0xFF in every byte (x NaN, scales NaN, ids −1, weights NaN)."""
    t = x.shape[0]

    def grow(v):
        out = torch.empty((capacity,) + tuple(v.shape[1:]), dtype=v.dtype)
        out.view(torch.uint8).fill_(0xFF)
        out[:t] = v
        return out

    return grow(x), None if x_s is None else grow(x_s), grow(idx), grow(wts)


def _poison_unrouted(w, routed):
    """Experts no row selects: weights full of 0xFF bytes, NaN scales / the UE8M0 NaN byte. Reading one would show."""
    w = dict(w)
    other = torch.tensor([e not in routed for e in range(w["w13"].shape[0])], dtype=torch.bool)
    for name in ("w13", "w2"):
        q = w[name].clone()
        q.view(torch.uint8)[other] = 0xFF
        w[name] = q
        s = w[name + "_scale"]
        if s is not None:
            s = s.clone()
            if s.dtype == torch.float32:
                s[other] = float("nan")
            else:
                s.view(torch.uint8)[other] = 0xFF
            w[name + "_scale"] = s
    return w


_LE_EDGE = dict(
    pair=("fp8", "fp4"),
    group=32,
    tokens=6,
    pad=0,
    hidden=256,
    inter=256,
    num_local=3,
    ep_size=2,
    topk=4,
    limit=7.0,
    empty_frac=0.0,
    duplicate_frac=0.0,
    skew=0.0,
    index_dtype=torch.int32,
    bf16_weights=False,
    fp8_max=448.0,
    rank_pick=1,
    seed=5,
)


def _edge(**over):
    return example(**{**_LE_EDGE, **over})


@settings(max_examples=25)
@given(
    pair=st.sampled_from(FORMAT_PAIRS),
    group=st.sampled_from([32, 128]),
    tokens=st.integers(0, 10),
    pad=st.integers(0, 3),
    hidden=st.sampled_from([128, 256, 640]),  # K of GEMM1; 640 > 512: a second chunk of prepared scales
    inter=st.sampled_from([128, 256, 384, 640]),  # K of GEMM2
    num_local=st.integers(1, 4),
    ep_size=st.integers(1, 3),
    topk=st.integers(1, 8),
    limit=st.sampled_from([None, 7.0, 0.5]),
    empty_frac=st.sampled_from([0.0, 0.3]),
    duplicate_frac=st.sampled_from([0.0, 0.4]),
    skew=st.sampled_from([0.0, 0.6]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    bf16_weights=st.booleans(),
    fp8_max=st.sampled_from([448.0, 240.0]),
    rank_pick=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
# Edge cases by name, outside the random budget: T = 0 (padding rows only), −1 slots, duplicate ids, 0xFF padding,
# every clamp value, both fp8_max values, int64 ids with bf16 weights, K > 512 on both GEMMs.
@_edge(tokens=0, pad=3)
@_edge(empty_frac=0.3, limit=None)
@_edge(duplicate_frac=0.4, limit=0.5, pair=("bf16", "fp8"))
@_edge(pad=3, fp8_max=240.0, pair=("fp8", "fp8"), group=128)
@_edge(index_dtype=torch.int64, bf16_weights=True, pair=("bf16", "bf16"), skew=0.6)
@_edge(hidden=640, inter=640, pair=("fp8", "fp8"), fp8_max=240.0, limit=0.5)
def test_matches_reference(
    cpu_isa,
    pair,
    group,
    tokens,
    pad,
    hidden,
    inter,
    num_local,
    ep_size,
    topk,
    limit,
    empty_frac,
    duplicate_frac,
    skew,
    index_dtype,
    bf16_weights,
    fp8_max,
    rank_pick,
    seed,
):
    act, wf = pair
    num_experts = num_local * ep_size
    topk = min(topk, num_experts)
    rank = rank_pick % ep_size
    offset = rank * num_local
    w = make_weights(num_local, hidden, inter, wf, seed=seed % 1000)
    x, x_s = make_activations(tokens, hidden, act, group, seed=seed)
    idx, wts = make_routing(
        tokens,
        topk,
        num_experts,
        seed=seed,
        empty_frac=empty_frac,
        skew=skew,
        duplicate_frac=duplicate_frac,
        index_dtype=index_dtype,
    )
    if bf16_weights:
        wts = wts.to(torch.bfloat16)
    ref = reference.local_experts(*_args(x, x_s, idx, wts, w, offset, limit, fp8_max))
    x, x_s, idx, wts = _pad(x, x_s, idx, wts, tokens + pad)
    routed = {int(i) - offset for i in idx.flatten().tolist() if offset <= i < offset + num_local}
    out = static_moe.local_experts(*_args(x, x_s, idx, wts, _poison_unrouted(w, routed), offset, limit, fp8_max))
    what = (
        f"{cpu_isa} {act}x{wf} g={group} T={tokens}+{pad} H={hidden} I={inter} L={num_local} S={ep_size} "
        f"r={rank} k={topk} limit={limit} fp8_max={fp8_max}"
    )
    assert out.dtype == torch.float32 and out.shape == (tokens + pad, hidden), what
    assert_gemm_bitwise(out[:tokens], ref, what)
    assert bool((out[tokens:] == 0).all()), f"{what}: padded rows must stay zero"


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_batch_invariance(cpu_isa, pair, rng):
    # 20 rows over 3 local experts (top-2 of 6, skewed to expert 0), H = 512 and I = 256 (two chunks each for the
    # threads): the batch runs in blocks of several rows per expert, single rows with the one-row blocking. Bits
    # must agree.
    act, wf = pair
    w = make_weights(3, 512, 256, wf, seed=1)
    x, x_s = make_activations(20, 512, act, 32, seed=2)
    idx, wts = make_routing(20, 2, 6, seed=3, skew=0.5)
    full = static_moe.local_experts(*_args(x, x_s, idx, wts, w, 0, 7.0))
    for r in [0, 7, 19]:
        one = static_moe.local_experts(
            *_args(x[r : r + 1], None if x_s is None else x_s[r : r + 1], idx[r : r + 1], wts[r : r + 1], w, 0, 7.0)
        )
        assert_equal(one[0], full[r], f"row {r} alone")
    sub = torch.tensor([2, 3, 11, 12, 13, 18])
    part = static_moe.local_experts(*_args(x[sub], None if x_s is None else x_s[sub], idx[sub], wts[sub], w, 0, 7.0))
    assert_equal(part, full[sub], "row subset")


@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_fp4_low_scale_bytes(cpu_isa, act):
    # w13's UE8M0 bytes lowered by d (their minimum: bytes 0 and 1 mixed with normal ones in every chunk) and x
    # raised by 2^d: GEMM1's products are exactly the unshifted ones, so the reference's bits on every ISA
    # (avx512bf16 must not read the weights of bytes 0 and 1, bf16 subnormals, as zero).
    w = make_weights(2, 640, 256, "fp4", seed=31)
    s = w["w13_scale"].view(torch.uint8)
    d = int(s.min())
    w = {**w, "w13_scale": (s - d).view(w["w13_scale"].dtype)}
    assert bool((w["w13_scale"].view(torch.uint8) < 2).float().mean() > 0.1)
    x, x_s = make_activations(7, 640, act, 32, seed=32)
    if act == "bf16":
        x = (x.float() * 2.0**d).to(torch.bfloat16)
    else:
        x_s = x_s * 2.0**d
    idx, wts = make_routing(7, 2, 2, seed=33)
    args = _args(x, x_s, idx, wts, w, 0, 7.0)
    ref = reference.local_experts(*args)
    assert float(ref.float().abs().mean()) > 1e-3, "the crafted input must keep the result of ordinary size"
    assert_gemm_bitwise(static_moe.local_experts(*args), ref, f"{cpu_isa} {act}xfp4 w13 bytes lowered by {d}")


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_several_column_chunks(cpu_isa, pair):
    # I = 384 and H = 768: several chunks of intermediate and hidden columns, handed to threads and prepared
    # piece by piece; 9 rows over 2 experts: row blocks of 4 and tails.
    act, wf = pair
    w = make_weights(2, 768, 384, wf, seed=21)
    x, x_s = make_activations(9, 768, act, 32, seed=22)
    idx, wts = make_routing(9, 2, 3, seed=23)
    args = _args(x, x_s, idx, wts, w, 0, 7.0)
    assert_gemm_bitwise(static_moe.local_experts(*args), reference.local_experts(*args), f"{cpu_isa} {act}x{wf}")


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_thread_count_does_not_change_bits(cpu_isa, pair):
    # H = 512 and I = 1024 are 2 hidden and 8 intermediate chunks of the default sizes; a team of more threads
    # than that gets smaller chunks (chunk_columns in csrc/cpu/local_experts.cpp): 3 threads 192-column hidden
    # chunks, 8 threads 64; 11 threads 96-column intermediate chunks, 16 threads 64 and 32 threads 32, where the
    # weight format and the x groups allow them (fp8 weights take z in pieces of 64 columns; fp8 x in groups of 128
    # keeps its 128-column chunks). Every team must give one thread's bits (the default chunks), and those are the
    # reference's within the GEMM bound (at K = 1024 the dot kernels' fp32 association shows in some bits).
    act, wf = pair
    w = make_weights(2, 512, 1024, wf, seed=41)
    idx, wts = make_routing(3, 2, 2, seed=43)
    threads = torch.get_num_threads()
    for group in (32, 128) if act == "fp8" else (128,):
        x, x_s = make_activations(3, 512, act, group, seed=42)
        args = _args(x, x_s, idx, wts, w, 0, 7.0)
        what = f"{cpu_isa} {act}x{wf}, x in groups of {group}"
        try:
            torch.set_num_threads(1)
            one = static_moe.local_experts(*args)
            for n in (2, 3, 8, 11, 16, 32):
                torch.set_num_threads(n)
                assert_equal(static_moe.local_experts(*args), one, f"{what}: {n} threads against one")
        finally:
            torch.set_num_threads(threads)
        assert_gemm_close(one, reference.local_experts(*args), what)


def test_routing_weights_duplicates_and_other_ranks(rng):
    # Row 0 names local expert 1 twice (weights add, in slot order), row 1 only other ranks' ids and -1,
    # row 2 a NaN weight on a slot of another rank (never read), row 3 nothing but -1.
    w = make_weights(2, 128, 128, "fp4", seed=5)
    x, _ = make_activations(4, 128, "bf16", seed=6)
    idx = torch.tensor([[3, 7, 3], [0, -1, 9], [2, 5, -1], [-1, -1, -1]], dtype=torch.int32)
    wts = torch.tensor([[0.25, 0.5, 0.125], [1.0, 1.0, 1.0], [0.5, float("nan"), 0.0], [1.0, 1.0, 1.0]])
    out = static_moe.local_experts(*_args(x, None, idx, wts, w, 2))
    assert_gemm_bitwise(out, reference.local_experts(*_args(x, None, idx, wts, w, 2)))
    assert bool((out[1] == 0).all()) and bool((out[3] == 0).all())
    merged = torch.tensor([[3, 7, -1]], dtype=torch.int32), torch.tensor([[0.375, 0.5, 0.0]])
    assert_equal(out[0], static_moe.local_experts(*_args(x[:1], None, *merged, w, 2))[0], "duplicate ids = summed")


def test_larger_shapes_threaded(rng):
    w = make_weights(4, 512, 256, "fp4", seed=7)
    x, x_s = make_activations(40, 512, "fp8", 128, seed=8)
    idx, wts = make_routing(40, 4, 8, seed=9, skew=0.3)
    args = _args(x, x_s, idx, wts, w, 4, 7.0)
    assert_gemm_bitwise(static_moe.local_experts(*args), reference.local_experts(*args))


_W = make_weights(2, 128, 128, "fp8", seed=11)
_W4 = make_weights(2, 256, 128, "fp4", seed=12)


def _sample(act, w, rows, group=128, offset=0, limit=None):
    x, x_s = make_activations(rows, w["w2"].shape[1], act, group, seed=rows)
    idx, wts = make_routing(rows, 2, 4, seed=rows, empty_frac=0.2)
    return _args(x, x_s, idx, wts, w, offset, limit)


SAMPLES = [
    _sample("bf16", _W4, 5),
    _sample("fp8", _W, 6, group=32, limit=7.0),
    _sample("bf16", _W, 3, offset=2),
    _sample("fp8", _W4, 0),
]


@pytest.mark.parametrize("args", SAMPLES, ids=["bf16xfp4", "fp8xfp8_g32", "bf16xfp8_offset", "empty"])
def test_opcheck(args):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in args):
        # torch's schema checker compares inputs with allclose, which float8 lacks on the CPU; the other checks
        # run, and test_rejects sees inputs stay unchanged.
        utils = utils[1:]
    torch.library.opcheck(torch.ops.static_moe.local_experts.default, args, test_utils=utils)


def test_compile_fullgraph_matches_eager():
    x, x_s = make_activations(7, 256, "fp8", 128, seed=1)
    idx, wts = make_routing(7, 2, 4, seed=2)

    def f(x, x_s, idx, wts, w13, w13_s, w2, w2_s):
        acc = static_moe.local_experts(x, x_s, idx, wts, w13, w13_s, w2, w2_s, 0, 7.0)
        acc = acc + static_moe.local_experts(x, x_s, idx, wts, w13, w13_s, w2, w2_s, 2, 7.0)
        return acc.to(torch.bfloat16)

    args = (x, x_s, idx, wts, _W4["w13"], _W4["w13_scale"], _W4["w2"], _W4["w2_scale"])
    torch._dynamo.reset()
    assert_equal(torch.compile(f, fullgraph=True)(*args), f(*args))


# ---------------------------------------------------------------------------------------------------------------
# Argument errors: eager kernel and fake kernel (trace) give the same messages
# ---------------------------------------------------------------------------------------------------------------
_WB = make_weights(2, 128, 128, "bf16", seed=13)
_X = torch.zeros(4, 128, dtype=torch.bfloat16)
_XQ, _XS = make_activations(4, 128, "fp8", 128, seed=14)
_IDX = torch.tensor([[0, 1], [1, -1], [3, 2], [-1, -1]], dtype=torch.int32)
_WTS = torch.full((4, 2), 0.5)


def _bad(**kw):
    a = dict(
        x=_X,
        x_scale=None,
        topk_idx=_IDX,
        topk_weights=_WTS,
        w13=_WB["w13"],
        w13_scale=None,
        w2=_WB["w2"],
        w2_scale=None,
        expert_offset=0,
        swiglu_limit=None,
        fp8_max=448.0,
    )
    a.update(kw)
    return tuple(a.values())


BAD = [
    (_bad(x=_X.float()), TypeError, r"x must have an activation dtype.*got torch\.float32"),
    (_bad(x=_XQ), ValueError, r"x_scale is required when x is fp8"),
    (_bad(x=_XQ, x_scale=_XS[:3]), ValueError, r"x_scale\.size\(0\) must be R = x\.size\(0\) = 4, got 3"),
    (
        _bad(x=torch.zeros(4, 96, dtype=torch.bfloat16)),
        ValueError,
        r"H = x\.size\(1\) must be a multiple of 128, got 96",
    ),
    (
        _bad(topk_idx=_IDX.float()),
        TypeError,
        r"topk_idx must have dtype torch\.int32 or torch\.int64, got torch\.float32",
    ),
    (_bad(topk_idx=_IDX[:3]), ValueError, r"topk_idx\.size\(0\) must be R = x\.size\(0\) = 4, got 3"),
    (
        _bad(topk_weights=_WTS[:, :1]),
        ValueError,
        r"topk_weights must have shape \[R, k\] like topk_idx = \[4, 2\], got \[4, 1\]",
    ),
    (_bad(topk_weights=_WTS.double()), TypeError, r"topk_weights must have dtype torch\.float32 or torch\.bfloat16"),
    (
        _bad(topk_idx=torch.tensor([[0, 1], [1, -2], [3, 2], [-1, -1]], dtype=torch.int32)),
        ValueError,
        r"topk_idx must hold global expert ids >= 0 or -1 \(empty slot\), got -2 at \[1, 1\]",
    ),
    (_bad(x=_XQ, x_scale=_XS, w13=_WB["w13"]), ValueError, r"unsupported format pair: x is fp8 and w13 is bf16"),
    (_bad(w13=_WB["w13"][:, :192]), ValueError, r"I = w13\.size\(1\) / 2 must be a multiple of 128, got 96"),
    (
        _bad(w13=_WB["w13"][:, :, :64]),
        ValueError,
        r"w13 must have shape \[L, N, K\] = \[2, 256, 128\], got \[2, 256, 64\]",
    ),
    (_bad(w2=_W["w2"], w2_scale=_W["w2_scale"]), ValueError, r"w2 must have the weight format of w13 \(bf16"),
    (_bad(w2=_WB["w2"][:1]), ValueError, r"w2 must have shape \[L, N, K\] = \[2, 128, 128\], got \[1, 128, 128\]"),
    (
        _bad(
            w13=_W4["w13"],
            w13_scale=_W4["w13_scale"][:, :, :2],
            w2=_W4["w2"],
            w2_scale=_W4["w2_scale"],
            x=torch.zeros(4, 256, dtype=torch.bfloat16),
        ),
        ValueError,
        r"w13_scale must have shape \[L, N, K/32\] = \[2, 256, 8\], got \[2, 256, 2\]",
    ),
    (
        _bad(w13=_W["w13"], w13_scale=_W["w13_scale"], w2=_W["w2"], w2_scale=None),
        ValueError,
        r"w2_scale is required for fp8 w2",
    ),
    (_bad(expert_offset=-1), ValueError, r"expert_offset \(global id of local expert 0\) must be >= 0, got -1"),
    (_bad(swiglu_limit=0.0), ValueError, r"swiglu_limit must be None or a positive finite number, got 0"),
    (
        _bad(
            x=_XQ,
            x_scale=_XS,
            w13=_W["w13"],
            w13_scale=_W["w13_scale"],
            w2=_W["w2"],
            w2_scale=_W["w2_scale"],
            fp8_max=500.0,
        ),
        ValueError,
        r"fp8_max must be in \[2, 448\]",
    ),
    (_bad(topk_idx=_IDX.to("meta")), ValueError, r"topk_idx must be on the same device as x \(cpu\), got meta"),
]


@pytest.mark.parametrize("args,exc,msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_rejects(args, exc, msg):
    assert_rejected_untouched(static_moe.local_experts, args, exc, msg)


@pytest.mark.parametrize("which", ["w13_scale", "w2_scale"])
def test_rejects_nan_scale_byte_of_a_routed_expert(which):
    w = dict(_W4)
    w[which] = w[which].clone()
    w[which][1, 3, 1] = 255
    x, _ = make_activations(2, 256, "bf16", seed=3)
    routed_1 = _args(x, None, torch.tensor([[1], [-1]]), torch.ones(2, 1), w, 0)
    with pytest.raises(ValueError, match=which + r" holds the UE8M0 NaN byte 255 in a routed expert"):
        static_moe.local_experts(*routed_1)
    routed_0 = _args(x, None, torch.tensor([[0], [-1]]), torch.ones(2, 1), w, 0)
    clean = _args(x, None, torch.tensor([[0], [-1]]), torch.ones(2, 1), _W4, 0)
    assert_equal(static_moe.local_experts(*routed_0), static_moe.local_experts(*clean), "expert 1 is not read")


def test_fake_kernel_rejects_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = [torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t for t in _bad()]
        out = torch.ops.static_moe.local_experts(*fake)
        assert out.shape == (4, 128) and out.dtype == torch.float32
        fake[8] = -3
        with pytest.raises(ValueError, match=r"expert_offset \(global id of local expert 0\) must be >= 0, got -3"):
            torch.ops.static_moe.local_experts(*fake)

    def f(x, idx, wts, w13, w2):
        return static_moe.local_experts(x, None, idx, wts, w13, None, w2, None, 0, None)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"w2 must have shape \[L, N, K\] = \[2, 128, 128\], got \[1, 128, 128\]"):
        torch.compile(f, fullgraph=True)(_X, _IDX, _WTS, _WB["w13"], _WB["w2"][:1])


# ---------------------------------------------------------------------------------------------------------------
# Crafted inputs: properties random inputs cannot see
# ---------------------------------------------------------------------------------------------------------------
def _summation_order_case(act, wf, rows=3, hidden=128, inter=128):
    """Every row is routed (weight 1) to local experts 0, 1, 2, whose outputs are exactly 2^25, 1.5 and −2^25 in
    every column. In fp32 the increasing order gives ``(2^25 + 1.5) − 2^25 = 0`` (2^25 + 1.5 rounds to 2^25);
    adding expert 1 last gives 1.5 and expert 0 last gives 2 (1.5 − 2^25 rounds to 2 − 2^25).
    Addition commutes, so these three results tell apart every order there is (SPEC §1.7: increasing local
    id). The values are exact in every format: x is 1 at column 0; gate 32 (sigmoid(32) = 1 in fp32) and up
    1/32 make z = 1; each w2 row holds one value."""
    x = torch.zeros(rows, hidden)
    x[:, 0] = 1.0
    w13 = torch.zeros(3, 2 * inter, hidden)
    w13[:, 0, 0] = 32.0
    w13[:, inter, 0] = 1.0 / 32
    w2 = torch.zeros(3, hidden, inter)
    for e, v in enumerate((2.0**25, 1.5, -(2.0**25))):
        w2[e, :, 0] = v
    from static_moe.formats import quantize_activation, quantize_weight

    x_q, x_s = (x.to(torch.bfloat16), None) if act == "bf16" else quantize_activation(x, 128)
    (a, a_s), (b, b_s) = quantize_weight(w13, wf), quantize_weight(w2, wf)
    w = {"w13": a, "w13_scale": a_s, "w2": b, "w2_scale": b_s}
    idx = torch.tensor([[2, 0, 1], [1, 2, 0], [0, 1, 2]], dtype=torch.int32)[:rows]  # slot order must not matter
    return _args(x_q, x_s, idx, torch.ones(rows, 3), w, 0)


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_experts_summed_in_increasing_local_id(cpu_isa, pair):
    args = _summation_order_case(*pair)
    ref = reference.local_experts(*args)
    assert bool((ref == 0).all()), "the crafted input must cancel in the reference order"
    assert_equal(static_moe.local_experts(*args), ref, f"{cpu_isa} {pair}: experts summed out of order")


@pytest.mark.parametrize("wf,group", [("fp8", 128), ("fp4", 32), ("fp4", 128)])
def test_fp8_max_240_reaches_the_requantization(cpu_isa, wf, group):
    """fp8_max = 240 (trn2) vs 448 on an input where they give different outputs beyond the SPEC §2 bound
    (make_fp8_max_sensitive): the kernel with each value matches the reference with the same value, bitwise
    up to the last-bit rule of assert_gemm_bitwise, on every ISA."""
    from static_moe.formats import quantize_activation, quantize_weight
    from static_moe.testing.generators import make_fp8_max_sensitive

    x, w13, w2, idx, tw = make_fp8_max_sensitive(6, 2, 256, 256, seed=3)
    x_q, x_s = quantize_activation(x, group)
    (a, a_s), (b, b_s) = quantize_weight(w13, wf), quantize_weight(w2, wf)
    w = {"w13": a, "w13_scale": a_s, "w2": b, "w2_scale": b_s}
    ref = {m: reference.local_experts(*_args(x_q, x_s, idx, tw, w, 0, None, m)) for m in (240.0, 448.0)}
    with pytest.raises(AssertionError):  # the input tells 240 from 448 apart
        assert_gemm_close(ref[240.0], ref[448.0])
    for m in (240.0, 448.0):
        out = static_moe.local_experts(*_args(x_q, x_s, idx, tw, w, 0, None, m))
        assert_gemm_bitwise(out, ref[m], f"{cpu_isa} fp8x{wf} g={group} fp8_max={m}")
