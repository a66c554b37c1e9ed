"""The SPEC §1.9 variants on the NKI kernels: the activations of ``swiglu_and_cast`` (``swiglu_oai`` with its
alpha, ``gelu_tanh``) and the bias epilogues of ``expert_gemm`` and of the fused ``local_experts``, against the
reference ops at the SPEC §2 tolerances (the interpreter is held to the reference's bits but for rare last-bit
differences, as in test_nki_local_experts.py), plus the Neuron dispatch path with a variant.

Runs through ``static_moe.nki.dispatch`` on CPU tensors (real NKI simulator when importable, else the
interpreter), or straight through the interpreter for the kernel keywords (weight_layout="eio", the target).
"""

from __future__ import annotations

import pytest
import torch

from static_moe import reference
from static_moe.layouts import prepare_weight, to_eoi
from static_moe.nki import dispatch, shim
from static_moe.nki_kernels.swiglu_and_cast import swiglu_and_cast
from static_moe.reference.swiglu_and_cast import swiglu_and_cast as ref_swiglu_and_cast
from static_moe.testing.generators import FORMAT_PAIRS, make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_gemm_bitwise, assert_gemm_close, assert_swiglu_close

assert_kernel_close = assert_gemm_close if shim.real_nki_available() else assert_gemm_bitwise
interpreter_only = pytest.mark.skipif(shim.real_nki_available(), reason="uses the interpreter's target switch")
TRN2_FP8_MAX = 240.0
ALPHA = 1.25  # not gpt-oss's default: a kernel that ignored alpha would fail


# Below this gate gelu_tanh's sigmoid argument y = c·(g + 0.044715·g³) passes −88.7, where the reference's float32
# σ(y) = 1/(1 + exp(−y)) overflows exp and returns 0 while the interpreter evaluates σ in float64 and returns the
# subnormal true value (< 2^-126): that tail is test_gelu_tanh_far_tail_is_zero_or_subnormal's.
GELU_NORMAL_FLOOR = -9.75


def _gate_up(rows, inter, seed, in_dtype=torch.bfloat16, activation="silu"):
    """Gate and up values over the ranges where the activations differ (|g| up to ~16: the clamp, the sigmoid
    tails), with two routing weights of 0 (padding) and one row of large values."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4.0
    gu[1] *= 4.0
    if activation == "gelu_tanh":
        gu[:, :inter].clamp_(min=GELU_NORMAL_FLOOR)
    w = torch.rand(rows, generator=g)
    w[[0, rows - 1]] = 0.0
    return gu.to(in_dtype), w


@pytest.mark.parametrize("activation", ["swiglu_oai", "gelu_tanh"])
@pytest.mark.parametrize("out_format,group", [("bf16", 128), ("fp8", 32), ("fp8", 128)])
@pytest.mark.parametrize("limit", [None, 7.0])
def test_swiglu_and_cast_variants_match_reference(activation, out_format, group, limit):
    in_dtype = torch.bfloat16 if group == 128 else torch.float32
    gu, w = _gate_up(37, 256, seed=3 + group, in_dtype=in_dtype, activation=activation)
    out = shim.simulate(swiglu_and_cast)(
        gu,
        w,
        swiglu_limit=limit,
        out_format=out_format,
        group_size=group,
        fp8_max=TRN2_FP8_MAX,
        pow2_scale=True,
        activation=activation,
        alpha=ALPHA,
    )
    if out_format == "bf16":
        out = (out, torch.empty(gu.shape[0], 0))
    ref = ref_swiglu_and_cast(gu, w, limit, out_format, group, TRN2_FP8_MAX, True, activation, ALPHA)
    assert_swiglu_close(out, ref, f"{activation} {out_format} g={group} limit={limit}")
    # the variant is computed, not SiLU's: the two differ on these inputs
    silu = ref_swiglu_and_cast(gu, w, limit, out_format, group, TRN2_FP8_MAX, True)
    assert not torch.equal(out[0].view(torch.uint8), silu[0].view(torch.uint8))


def test_gelu_tanh_far_tail_is_zero_or_subnormal():
    """Gates far below GELU_NORMAL_FLOOR: the reference returns ±0, the interpreter the subnormal true value of the
    same sign; both are below the smallest normal float32, so bf16 out is 0 or subnormal on both sides."""
    g = torch.linspace(-40.0, -10.5, 128)
    gu = torch.cat([g, torch.full_like(g, 3.0)])[None].repeat(2, 1)
    out = shim.simulate(swiglu_and_cast)(
        gu, None, swiglu_limit=None, out_format="bf16", group_size=128, fp8_max=TRN2_FP8_MAX, activation="gelu_tanh"
    )
    ref = ref_swiglu_and_cast(gu, None, None, "bf16", 128, TRN2_FP8_MAX, True, "gelu_tanh")[0]
    tiny = torch.finfo(torch.float32).tiny
    assert bool((out.float().abs() < tiny).all()) and bool((ref.float().abs() < tiny).all())
    assert bool((out.float() <= 0).all()), "gelu of a negative gate times a positive up is never positive"


def test_swiglu_and_cast_dispatch_takes_the_variants():
    gu, w = _gate_up(9, 128, seed=5, activation="gelu_tanh")
    for activation in ("swiglu_oai", "gelu_tanh"):
        out = dispatch.swiglu_and_cast(gu, w, 7.0, "bf16", 128, TRN2_FP8_MAX, True, activation, ALPHA)
        ref = ref_swiglu_and_cast(gu, w, 7.0, "bf16", 128, TRN2_FP8_MAX, True, activation, ALPHA)
        assert_swiglu_close(out, ref, f"dispatch {activation}")
    with pytest.raises(ValueError, match="alpha must be"):
        dispatch.swiglu_and_cast(gu, w, 7.0, "bf16", 128, TRN2_FP8_MAX, True, "swiglu_oai", 0.0)
    with pytest.raises(ValueError, match="activation must be"):
        dispatch.swiglu_and_cast(gu, w, 7.0, "bf16", 128, TRN2_FP8_MAX, True, "relu", ALPHA)


def _biases(num_local, hidden, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_local, 2 * inter, generator=g) * 2).to(dtype), torch.randn(
        num_local, hidden, generator=g
    ).to(dtype)


def _experts_case(act, wfmt, rows=21, hidden=128, inter=256, num_local=3, seed=11):
    w = make_weights(num_local, hidden, inter, wfmt, seed=seed)
    group = 32 if act == "fp8" else 128
    x, xs = make_activations(rows, hidden, act, group=group, seed=seed + 1, scale=2.0)
    idx, tw = make_routing(rows, 2, num_local + 2, seed=seed + 2, empty_frac=0.2, duplicate_frac=0.2)
    return (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], 1)


# each variant with each format pair the NKI kernels take (SPEC §1.2); biases float32 and bf16, each alone too
VARIANTS = [
    ("swiglu_oai", True, True, torch.float32),
    ("gelu_tanh", False, True, torch.bfloat16),
    ("silu", True, False, torch.float32),
]


@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS, ids=[f"{a}x{w}" for a, w in FORMAT_PAIRS])
@pytest.mark.parametrize(
    "activation,b13_on,b2_on,bias_dtype", VARIANTS, ids=[f"{v[0]}-b13{v[1]:d}-b2{v[2]:d}" for v in VARIANTS]
)
def test_local_experts_variants_match_reference(act, wfmt, activation, b13_on, b2_on, bias_dtype):
    args = _experts_case(act, wfmt, seed=11 + len(activation))
    b13, b2 = _biases(3, 128, 256, seed=5, dtype=bias_dtype)
    kw = dict(activation=activation, alpha=ALPHA, w13_bias=b13 if b13_on else None, w2_bias=b2 if b2_on else None)
    ref = reference.local_experts(*args, 7.0, TRN2_FP8_MAX, **kw)
    plain = reference.local_experts(*args, 7.0, TRN2_FP8_MAX)
    assert not torch.equal(ref, plain)
    for skip in (True, False) if (act, wfmt) == ("bf16", "bf16") else (True,):  # the static variant once
        out = dispatch.local_experts(*args, 7.0, TRN2_FP8_MAX, skip_unrouted=skip, **kw)
        assert_kernel_close(out, ref, f"{act}x{wfmt} {activation} b13={b13_on} b2={b2_on} skip={skip}")
    routed = ((args[2] >= 1) & (args[2] < 4)).any(dim=1)
    assert bool((out[~routed] == 0).all()), "rows routed to no local expert stay exact zeros"


@interpreter_only
@pytest.mark.parametrize("act,wfmt,target", [("bf16", "fp8", "trn2"), ("fp8", "fp4", "trn3"), ("bf16", "fp4", "trn2")])
def test_local_experts_variants_on_prepared_weights(act, wfmt, target):
    """The epilogues on the prepared (EIO) paths, several items per expert (chunk_rows=4) and one."""
    import nki_interpreter as interpreter
    from static_moe.nki_kernels.local_experts import local_experts_kernel

    args = _experts_case(act, wfmt, rows=19, seed=29)
    x, xs, idx, tw, w13, s13, w2, s2, off = args
    w13p, s13p, _ = prepare_weight(w13, s13, target)
    w2p, s2p, _ = prepare_weight(w2, s2, target)
    rargs = (x, xs, idx, tw, *to_eoi(w13p, s13p), *to_eoi(w2p, s2p), off)
    b13, b2 = _biases(3, 128, 256, seed=7)
    kw = dict(activation="swiglu_oai", alpha=ALPHA, w13_bias=b13, w2_bias=b2)
    ref = reference.local_experts(*rargs, 7.0, TRN2_FP8_MAX, **kw)
    for m in (None, 4):
        with interpreter.target(target):
            out = interpreter.simulate(local_experts_kernel)(
                x, xs, idx.to(torch.int32), tw, w13p, s13p, w2p, s2p, off, 7.0, TRN2_FP8_MAX,
                weight_layout="eio", chunk_rows=m, **kw,
            )  # fmt: skip
        assert_kernel_close(out, ref, f"{act}x{wfmt} eio {target} chunk_rows={m}")


@pytest.mark.parametrize("act,wfmt", [("bf16", "bf16"), ("fp8", "fp4")])
def test_expert_gemm_bias_matches_reference_and_keeps_masked_rows_zero(act, wfmt):
    rows, k, n = 13, 256, 384
    w = make_weights(2, k, n // 2, wfmt, seed=3)  # w13 is [L, 2·(n/2), k]
    a, a_s = make_activations(rows, k, act, group=128, seed=4, scale=2.0)
    mask = torch.rand(rows, generator=torch.Generator().manual_seed(5)) < 0.6
    bias = torch.randn(2, n, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    bias[1, 7] = float("nan")  # a NaN bias reaches the expert's selected rows only
    for e in (0, 1):
        out = dispatch.expert_gemm(a, a_s, w["w13"], w["w13_scale"], mask, e, "eoi", bias)
        ref = reference.expert_gemm(a, a_s, w["w13"], w["w13_scale"], mask, e, bias=bias)
        assert bool((out[~mask] == 0).all()), "masked rows stay exact zeros, bias or not"
        finite = torch.ones(n, dtype=torch.bool)
        finite[7] = e == 0
        assert bool(out[mask][:, ~finite].isnan().all())
        assert_kernel_close(out[:, finite], ref[:, finite], f"expert_gemm {act}x{wfmt} bias e={e}")


@interpreter_only
def test_expert_gemm_bias_on_prepared_weights():
    import nki_interpreter as interpreter
    from static_moe.nki_kernels.expert_gemm import expert_gemm_kernel

    rows, k, n = 9, 256, 256
    w = make_weights(2, k, n // 2, "fp8", seed=8)
    a, _ = make_activations(rows, k, "bf16", seed=9, scale=2.0)
    mask = torch.rand(rows, generator=torch.Generator().manual_seed(10)) < 0.6
    bias = torch.randn(2, n, generator=torch.Generator().manual_seed(11))
    bp, bsp, _ = prepare_weight(w["w13"], w["w13_scale"], "trn2")
    ref = reference.expert_gemm(a, None, *to_eoi(bp, bsp), mask, 1, bias=bias)
    with interpreter.target("trn2"):
        out = interpreter.simulate(expert_gemm_kernel)(a, None, bp, bsp, mask, 1, weight_layout="eio", bias=bias)
    assert_kernel_close(out, ref, "expert_gemm eio bias")
    assert bool((out[~mask] == 0).all())


@pytest.mark.skipif(shim.real_nki_available(), reason="the test device launches through the interpreter")
def test_forward_with_a_variant_on_the_neuron_device():
    """``torch.ops.static_moe.forward`` at S = 1 on ``neuron`` tensors (tools/neuron_test_device.py) with gpt-oss's
    variant: the dispatch hands activation, alpha and the biases to the fused NKI kernel."""
    import neuron_test_device as neuron

    neuron.install()
    hidden, inter, e, k, c, t = 128, 128, 4, 2, 4, 3
    w = make_weights(e, hidden, inter, "bf16", seed=7)
    x, xs = make_activations(t, hidden, "bf16", seed=8, scale=2.0)
    idx, tw = make_routing(t, k, e, seed=9)
    b13, b2 = _biases(e, hidden, inter, seed=10)
    args = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], None, e, c, 7.0, "", 0, 1)
    ref = reference.forward(*args, TRN2_FP8_MAX, "eoi", "swiglu_oai", ALPHA, b13, b2)
    seen = []
    launch = dispatch._launch

    def spy(name, kargs, device, **flags):
        seen.append((name, sorted(flags)))
        return launch(name, kargs, device, **flags)

    dargs = tuple(None if a is None or isinstance(a, (int, float, str)) else neuron.to_device(a) for a in args)
    dargs = tuple(a if d is None else d for a, d in zip(args, dargs))
    try:
        dispatch._launch = spy
        out = torch.ops.static_moe.forward(
            *dargs, TRN2_FP8_MAX, "eoi", "swiglu_oai", ALPHA, neuron.to_device(b13), neuron.to_device(b2)
        )
    finally:
        dispatch._launch = launch
    assert out.device.type == "neuron" and out.shape == (t, hidden)
    flags = dict(seen)["local_experts"]
    assert {"activation", "alpha", "w13_bias", "w2_bias"} <= set(flags), flags
    assert_kernel_close(out.cpu(), ref, "forward on neuron, swiglu_oai + biases")
