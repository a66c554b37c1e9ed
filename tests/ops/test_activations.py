"""The activation variants and expert biases of SPEC §1.9 on the CPU kernels: swiglu_and_cast for every activation
against the reference (and the reference against float64), expert_gemm's bias and local_experts' activations and
biases against the reference on every format pair and CPU instruction set (assert_gemm_bitwise), the bias added
before the bf16 rounding, forward at S = 1, opcheck / torch.compile with the new arguments, and the argument errors
(ValueError / TypeError naming the argument, on every EP rank)."""

from __future__ import annotations

import math

import pytest
import torch

import static_moe
from static_moe import reference
from static_moe.reference.swiglu_and_cast import swiglu
from static_moe.testing.distributed import expect_raises, run_ranks
from static_moe.testing.generators import FORMAT_PAIRS, gen, make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_gemm_bitwise, assert_swiglu_close, calc_diff

ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")
PAIR_IDS = [f"{a}x{w}" for a, w in FORMAT_PAIRS]
H, I, L = 128, 256, 3


def _float64_activation(g, u, activation, alpha):
    g, u = g.double(), u.double()
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    if activation == "swiglu_oai":
        return (u + 1) * g * torch.sigmoid(alpha * g)
    # 0.5·(1 + tanh y) = σ(2y): float64's tanh form would cancel to 0 for large negative g
    return g * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)) * u


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("limit", [None, 7.0])
def test_reference_activation_matches_float64(activation, limit):
    gu = torch.randn(16, 2 * I, generator=gen(1)) * 6
    w = torch.rand(16, generator=gen(2))
    v = swiglu(gu, w, limit, activation, 1.702)
    g, u = gu[:, :I].double(), gu[:, I:].double()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    want = _float64_activation(g, u, activation, 1.702) * w.double()[:, None]
    err = (v.double() - want).abs()
    # + 1e-7·max: in the sigmoid's far tail float32's relative error grows with |argument| (exp's conditioning)
    assert bool((err <= 4e-6 * want.abs() + 1e-7 * want.abs().max()).all()), float((err / want.abs()).max())


def test_gelu_tanh_is_torchs_where_torchs_is_accurate():
    g = torch.linspace(-6, 6, 4001)
    ours = swiglu(torch.cat([g, torch.ones_like(g)])[None], None, None, "gelu_tanh", 1.702)[0]
    torchs = torch.nn.functional.gelu(g, approximate="tanh")
    assert float((ours - torchs).abs().max()) < 1e-6
    far = torch.tensor([-8.0, -9.0])  # torch's fp32 tanh form cancels to 0 here; the true value is tiny, negative
    tail = swiglu(torch.cat([far, torch.ones_like(far)])[None], None, None, "gelu_tanh", 1.702)[0]
    assert bool((torch.nn.functional.gelu(far, approximate="tanh") == 0).all())
    want = _float64_activation(far, torch.ones_like(far), "gelu_tanh", 1.702)
    assert bool((want < 0).all()) and float(((tail.double() - want) / want).abs().max()) < 1e-4


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("out_format,group", [("bf16", 128), ("fp8", 32), ("fp8", 128)])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_swiglu_and_cast_matches_reference(activation, out_format, group, limit, in_dtype):
    gu = (torch.randn(9, 2 * I, generator=gen(3)) * 5).to(in_dtype)
    w = torch.rand(9, generator=gen(4))
    w[2] = 0
    args = (gu, w, limit, out_format, group, 448.0, True)
    out = static_moe.swiglu_and_cast(*args, activation=activation, alpha=1.3)
    ref = reference.swiglu_and_cast(*args, activation=activation, alpha=1.3)
    assert_swiglu_close(out, ref, f"{activation} {out_format} g={group} limit={limit} {in_dtype}")
    if activation != "silu":  # the variant is not SiLU: the check above would catch a kernel that ignored it
        silu = reference.swiglu_and_cast(*args)
        assert not torch.equal(silu[0].float(), ref[0].float())


def test_swiglu_oai_reads_alpha():
    gu = torch.randn(4, 2 * I, generator=gen(5)).to(torch.bfloat16)
    a = static_moe.swiglu_and_cast(gu, None, None, "bf16", activation="swiglu_oai", alpha=1.702)[0]
    b = static_moe.swiglu_and_cast(gu, None, None, "bf16", activation="swiglu_oai", alpha=1.0)[0]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=PAIR_IDS)
def test_expert_gemm_bias(cpu_isa, pair):
    act, wf = pair
    bias_dtype = torch.bfloat16 if wf == "fp4" else torch.float32  # both dtypes, over the pairs
    w = make_weights(L, H, I, wf, seed=6)
    a, a_s = make_activations(10, H, act, 32, seed=7)
    mask = torch.ones(10, dtype=torch.bool)
    mask[[1, 6]] = False
    bias = (torch.randn(L, 2 * I, generator=gen(8))).to(bias_dtype)
    args = (a, a_s, w["w13"], w["w13_scale"], mask, 1)
    out = static_moe.expert_gemm(*args, bias=bias)
    ref = reference.expert_gemm(*args, bias=bias)
    assert_gemm_bitwise(out, ref, f"{cpu_isa} {act}x{wf} bias {bias_dtype}")
    assert bool((out[~mask] == 0).all())
    # Added before the rounding: rounding twice (bf16(bf16(acc) + b)) gives other bits on many outputs.
    twice = (reference.expert_gemm(*args).float() + bias[1].float()).to(torch.bfloat16)
    twice[~mask] = 0
    assert int((twice != out).sum()) > out.numel() // 20


def _variant_case(pair, seed, bias_dtype=torch.float32, tokens=7):
    act, wf = pair
    w = make_weights(L, H, I, wf, seed=seed)
    x, x_s = make_activations(tokens, H, act, 32, seed=seed + 1)
    idx, wts = make_routing(tokens, 2, 2 * L, seed=seed + 2, duplicate_frac=0.3, empty_frac=0.2)
    b13 = (torch.randn(L, 2 * I, generator=gen(seed + 3)) * 0.5).to(bias_dtype)
    b2 = (torch.randn(L, H, generator=gen(seed + 4)) * 0.5).to(bias_dtype)
    args = (x, x_s, idx, wts, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], L)
    return args, b13, b2


# Every pair runs gpt-oss's variant; the others rotate over the pairs.
_OTHER = [("gelu_tanh", None, True), ("silu", 7.0, True), ("gelu_tanh", 7.0, False)]
LE_CASES = [(p, ("swiglu_oai", 7.0, True)) for p in FORMAT_PAIRS] + [
    (p, _OTHER[i % len(_OTHER)]) for i, p in enumerate(FORMAT_PAIRS)
]
_REFS: dict = {}  # (pair, variant) -> (reference output, the plain SiLU reference): shared by the ISAs


@pytest.mark.parametrize(
    "pair,variant", LE_CASES, ids=[f"{a}x{w}-{v[0]}-{v[1]}-{'bias' if v[2] else 'nobias'}" for (a, w), v in LE_CASES]
)
def test_local_experts_variants_match_reference(cpu_isa, pair, variant):
    activation, limit, biases = variant
    args, b13, b2 = _variant_case(pair, seed=11, bias_dtype=torch.bfloat16 if pair[1] == "fp4" else torch.float32)
    kw = dict(activation=activation, alpha=1.702, w13_bias=b13 if biases else None, w2_bias=b2 if biases else None)
    out = static_moe.local_experts(*args, limit, 448.0, "eoi", **kw)
    if (pair, variant) not in _REFS:
        _REFS[pair, variant] = (
            reference.local_experts(*args, limit, 448.0, "eoi", **kw),
            reference.local_experts(*args, limit),
        )
    ref, plain = _REFS[pair, variant]
    assert_gemm_bitwise(out, ref, f"{cpu_isa} {pair} {activation} limit={limit} biases={biases}")
    assert calc_diff(out, plain) > 1e-3, "the variant must change the result"


def test_local_experts_w2_bias_is_weighted_by_the_routing_weight():
    # One expert, bias only on w2, zero weights: the output is exactly bf16(w·b2) on each routed row.
    w = make_weights(1, H, I, "bf16", seed=12)
    w = {k: (torch.zeros_like(v) if v is not None else None) for k, v in w.items()}
    x, _ = make_activations(3, H, "bf16", seed=13)
    idx = torch.tensor([[0], [0], [-1]], dtype=torch.int32)
    wts = torch.tensor([[0.25], [0.75], [1.0]])
    b2 = torch.randn(1, H, generator=gen(14))
    out = static_moe.local_experts(
        x, None, idx, wts, w["w13"], None, w["w2"], None, 0, None, w2_bias=b2, w13_bias=torch.zeros(1, 2 * I)
    )
    want = (wts[:2] * b2).to(torch.bfloat16).float()
    assert torch.equal(out[:2], want)
    assert bool((out[2] == 0).all())


def test_forward_s1_takes_the_variants():
    pair = ("bf16", "fp8")
    args, b13, b2 = _variant_case(pair, seed=21)
    x, x_s, _, _, w13, w13_s, w2, w2_s, _ = args
    idx, wts = make_routing(x.shape[0], 2, L, seed=22, empty_frac=0.2)
    kw = dict(activation="swiglu_oai", alpha=1.702, w13_bias=b13, w2_bias=b2)
    out = static_moe.forward(x, x_s, idx, wts, w13, w13_s, w2, w2_s, num_experts=L, capacity=8, swiglu_limit=7.0, **kw)
    ref = reference.forward(x, x_s, idx, wts, w13, w13_s, w2, w2_s, None, L, 8, 7.0, "", 0, 1, **kw)
    assert calc_diff(out, ref) < 1e-5


def test_opcheck_and_compile_with_the_variants():
    args, b13, b2 = _variant_case(("bf16", "bf16"), seed=31)
    kw = dict(activation="swiglu_oai", alpha=1.5, w13_bias=b13, w2_bias=b2)
    torch.library.opcheck(torch.ops.static_moe.local_experts.default, (*args, 7.0, 448.0, "eoi"), kw)
    mask = torch.ones(args[0].shape[0], dtype=torch.bool)
    torch.library.opcheck(
        torch.ops.static_moe.expert_gemm.default, (args[0], None, args[4], None, mask, 0, "eoi"), {"bias": b13}
    )
    gu = torch.randn(5, 2 * I, generator=gen(32)).to(torch.bfloat16)
    torch.library.opcheck(
        torch.ops.static_moe.swiglu_and_cast.default, (gu, None, None, "bf16"), {"activation": "gelu_tanh"}
    )

    def f(*a):
        return static_moe.local_experts(*a, 7.0, **kw)

    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(*args)
    assert torch.equal(eager, compiled)
    ep = torch.export.export(_LocalExperts(kw), args[:8])
    assert torch.equal(ep.module()(*args[:8]), eager)


class _LocalExperts(torch.nn.Module):
    def __init__(self, kw):
        super().__init__()
        self.kw = kw

    def forward(self, x, x_s, idx, wts, w13, w13_s, w2, w2_s):
        return static_moe.local_experts(x, x_s, idx, wts, w13, w13_s, w2, w2_s, L, 7.0, **self.kw)


def _bad(args, b13, b2):
    """(keyword overrides, exception, message fragment) for local_experts and forward."""
    return [
        (dict(activation="relu"), ValueError, "activation must be"),
        (dict(alpha=0.0), ValueError, "alpha must be"),
        (dict(alpha=float("inf")), ValueError, "alpha must be"),
        (dict(alpha=float("nan")), ValueError, "alpha must be"),
        (dict(alpha=1e39), ValueError, "alpha must be"),
        (dict(w13_bias=b13[:, :-1]), ValueError, "w13_bias"),
        (dict(w2_bias=b2[:-1]), ValueError, "w2_bias"),
        (dict(w13_bias=b13.half()), TypeError, "w13_bias"),
        (dict(w2_bias=b2.to(torch.int32)), TypeError, "w2_bias"),
        (dict(w2_bias=b2.to("meta")), ValueError, "w2_bias"),
    ]


def test_bad_arguments_are_refused_naming_them():
    args, b13, b2 = _variant_case(("bf16", "bf16"), seed=41)
    for over, exc, msg in _bad(args, b13, b2):
        kw = dict(w13_bias=b13, w2_bias=b2) | over
        for fn in (static_moe.local_experts, reference.local_experts):
            with pytest.raises(exc, match=msg):
                fn(*args, None, **kw)
    mask = torch.ones(args[0].shape[0], dtype=torch.bool)
    with pytest.raises(ValueError, match="bias"):
        static_moe.expert_gemm(args[0], None, args[4], None, mask, 0, bias=b13[:, :8])
    with pytest.raises(TypeError, match="bias"):
        static_moe.expert_gemm(args[0], None, args[4], None, mask, 0, bias=b13.double())
    gu = torch.randn(2, 2 * I).to(torch.bfloat16)
    with pytest.raises(ValueError, match="activation must be"):
        static_moe.swiglu_and_cast(gu, None, None, "bf16", activation="gelu")
    with pytest.raises(ValueError, match="alpha must be"):
        static_moe.swiglu_and_cast(gu, None, None, "bf16", activation="swiglu_oai", alpha=-1.0)


def _bad_on_rank_one_worker(rank: int, size: int) -> list[str]:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    w = make_weights(L, H, I, "bf16", seed=rank)
    x, _ = make_activations(3, H, "bf16", seed=50 + rank)
    idx, wts = make_routing(3, 2, L * size, seed=60 + rank)
    b13, b2 = torch.zeros(L, 2 * I), torch.zeros(L, H)
    good = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    cases = [
        (dict(activation="relu"), ValueError, "activation"),
        (dict(w2_bias=b2[:, :64]), ValueError, "w2_bias"),
        (dict(w13_bias=b13.half()), TypeError, "w13_bias"),
        (dict(alpha=-2.0), ValueError, "alpha"),
    ]

    def call(kw):
        return static_moe.forward(
            x, None, idx, wts, w["w13"], None, w["w2"], None, num_experts=L * size, capacity=4,
            group_name=group, ep_rank=rank, ep_size=size, **kw,
        )  # fmt: skip

    first = call(good)
    messages = []
    for over, exc, needle in cases:
        kw = good | (over if rank == 1 else {})
        if rank == 1:
            messages.append(expect_raises(exc, lambda kw=kw: call(kw), needle))
        else:
            messages.append(expect_raises(RuntimeError, lambda kw=kw: call(kw), "rank 1", needle))
    assert torch.equal(call(good), first)
    return messages


def test_bad_variant_arguments_raise_on_every_rank():
    run_ranks(_bad_on_rank_one_worker, 2, timeout=150)


def test_static_moe_takes_the_variants_and_saves_the_biases():
    w = make_weights(4, H, I, "bf16", seed=71)
    b13, b2 = torch.randn(4, 2 * I, generator=gen(72)), torch.randn(4, H, generator=gen(73))
    kw = dict(activation="swiglu_oai", alpha=1.702, swiglu_limit=7.0, expert_biases=True)
    layer = static_moe.StaticMoE(H, I, 4, 2, 8, **kw)
    layer.set_expert_weights(w["w13"], None, w["w2"], None)
    layer.set_expert_biases(b13, b2.to(torch.bfloat16))
    x, _ = make_activations(5, H, "bf16", seed=74)
    idx, wts = make_routing(5, 2, 4, seed=75)
    out = layer(x, idx, wts)
    ref = reference.forward(
        x, None, idx, wts, w["w13"], None, w["w2"], None, None, 4, 8, 7.0, "", 0, 1,
        activation="swiglu_oai", w13_bias=b13, w2_bias=b2.to(torch.bfloat16).float(),
    )  # fmt: skip
    assert calc_diff(out, ref) < 1e-5
    state = layer.state_dict()
    assert torch.equal(state["w13_bias"], b13)
    other = static_moe.StaticMoE(H, I, 4, 2, 8, **kw)
    other.load_state_dict(state)
    assert torch.equal(other(x, idx, wts), out)
    plain = static_moe.StaticMoE(H, I, 4, 2, 8)
    assert "w13_bias" not in plain.state_dict()
    with pytest.raises(ValueError, match="expert_biases=True"):
        plain.set_expert_biases(b13, b2)
    with pytest.raises(ValueError, match="w2_bias"):
        layer.set_expert_biases(b13, b2[:, :8])
    for m in (layer, other, plain):
        m.close()


def test_nki_dispatch_checks_the_variants_naming_them():
    """The NKI kernels compute the variants (tests/nki/test_nki_variants.py); the dispatch still runs the shared
    checks first, so a bad alpha or bias is the same ValueError naming the argument as on the other backends."""
    from static_moe.nki import dispatch

    args, b13, b2 = _variant_case(("bf16", "bf16"), seed=81)
    with pytest.raises(ValueError, match="alpha must be"):
        dispatch.local_experts(*args, None, 448.0, "eoi", "swiglu_oai", -1.0)
    with pytest.raises(ValueError, match="activation must be"):
        dispatch.local_experts(*args, None, 448.0, "eoi", "gelu")
    with pytest.raises(ValueError, match="w2_bias"):
        dispatch.local_experts(*args, None, 448.0, "eoi", "silu", 1.702, None, b2[:, :8])
    mask = torch.ones(args[0].shape[0], dtype=torch.bool)
    with pytest.raises(ValueError, match="bias"):
        dispatch.expert_gemm(args[0], None, args[4], None, mask, 0, "eoi", b13[:, :8])
