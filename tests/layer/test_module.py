"""StaticMoE: construction and validation, conversion (transformers 5.x fused / grouped / DTensor / HF experts),
the DeepSeek-style and fused-key loaders, the shared expert (gated too), dtype conversions, load_state_dict checks,
torch.export at S = 1; on two gloo ranks: three layers sharing one workspace with stable addresses,
torch.compile(fullgraph=True), collective construction and loading errors, a full model split over EP, close."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from static_moe import reference
from static_moe.formats import dequantize_activation, expand_block_scales, quantize_activation, quantize_weight
from static_moe.module import SharedExpert, StaticMoE
from static_moe.testing.distributed import expect_raises, gather_objects, run_ranks
from static_moe.testing.generators import FORMAT_PAIRS, gen, make_fp8_max_sensitive, make_routing
from static_moe.testing.numeric import assert_equal, assert_gemm_close

H, I, E, K, C = 256, 128, 8, 3, 8
IS = 256  # shared expert intermediate


# ----------------------------------------------------------------------------------------------------------------
# Sources and the reference
# ----------------------------------------------------------------------------------------------------------------
class Grouped(nn.Module):
    """Grouped SwiGLU experts as torchtitan-style code holds them: w1/w3 [L, I, H], w2 [L, H, I]."""

    def __init__(self, w1, w3, w2):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Parameter(w1), nn.Parameter(w3), nn.Parameter(w2)


class HFExpert(nn.Module):
    def __init__(self, hidden, inter, bias=False, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=bias, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=bias, device=device)


def float_experts(num, seed, inter=I):
    g = gen(seed)
    return (
        torch.randn(num, inter, H, generator=g) / H**0.5,
        torch.randn(num, inter, H, generator=g) / H**0.5,
        torch.randn(num, H, inter, generator=g) / inter**0.5,
    )


class Fused(nn.Module):
    """transformers 5.x fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I];
    ``flags`` set the attributes transformers' experts decorator adds (is_transposed, has_bias, ...)."""

    def __init__(self, w1, w3, w2, act=None, **flags):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.cat((w1, w3), dim=1))
        self.down_proj = nn.Parameter(w2)
        self.act_fn = act or nn.SiLU()
        for k, v in flags.items():
            setattr(self, k, v)


def hf_experts(w1, w3, w2) -> nn.ModuleList:
    out = nn.ModuleList()
    for e in range(w1.shape[0]):
        m = HFExpert(H, w1.shape[1])
        with torch.no_grad():
            m.gate_proj.weight.copy_(w1[e])
            m.up_proj.weight.copy_(w3[e])
            m.down_proj.weight.copy_(w2[e])
        out.append(m)
    return out


def quantized(w1, w3, w2, fmt):
    w13, w13_s = quantize_weight(torch.cat((w1, w3), dim=1), fmt)
    w2q, w2_s = quantize_weight(w2, fmt)
    return w13, w13_s, w2q, w2_s


def activations(hidden, act, group):
    """What the layer feeds its experts: bf16 as is, fp8 quantized per SPEC §1.1."""
    x = hidden.reshape(-1, H)
    return (x, None) if act == "bf16" else quantize_activation(x, group)


def reference_layer(hidden, idx, tw, experts, act, group, limit, shared=None, shared_limit=None, fp8_max=448.0):
    """Single-rank reference of a StaticMoE: experts = (w13, w13_s, w2, w2_s) of all E; shared likewise [1, ...];
    fp8_max: the layer's (240 for trn2 with fp8 activations)."""
    x, xs = activations(hidden, act, group)
    shared_out = None
    if shared is not None:
        sw13, sw13_s, sw2, sw2_s = shared
        sx, sxs = (x, xs) if sw13.dtype != torch.bfloat16 else (hidden.reshape(-1, H), None)
        t = x.shape[0]
        shared_out = reference.local_experts(
            sx,
            sxs,
            torch.zeros(t, 1, dtype=torch.int32),
            torch.ones(t, 1),
            sw13,
            sw13_s,
            sw2,
            sw2_s,
            0,
            shared_limit,
            fp8_max,
        )
    return reference.forward(x, xs, idx, tw, *experts[:2], *experts[2:], shared_out, E, C, limit, "", 0, 1, fp8_max)


def hidden_states(t, seed):
    return torch.randn(t, H, generator=gen(seed)).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# Construction and validation
# ----------------------------------------------------------------------------------------------------------------
def test_constructor_validation():
    bad = [
        (dict(device="meta"), ValueError, "meta device"),
        (dict(hidden_size=200), ValueError, "hidden must be a multiple of 128"),
        (dict(intermediate_size=96), ValueError, "intermediate must be a multiple of 128"),
        (dict(top_k=9), ValueError, r"topk \(9\) cannot exceed num_experts \(8\)"),
        (dict(capacity=0), ValueError, "capacity must be a positive integer"),
        (dict(weight_format="int4"), ValueError, "weight_format must be one of"),
        (dict(act_format="fp8", weight_format="bf16"), ValueError, "is not supported"),
        (dict(act_format="fp8", weight_format="fp8", act_group=64), ValueError, "act_group must be one of"),
        (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be None or a positive finite number"),
        (dict(swiglu_limit=math.inf), ValueError, "swiglu_limit"),
        (dict(swiglu_limit=1e39), ValueError, "finite and positive in float32"),
        (dict(swiglu_limit=True), ValueError, "swiglu_limit"),
        (dict(fp8_max=500.0), ValueError, r"fp8_max must be in \[2, 448\]"),
        (dict(fp8_max=0), ValueError, "fp8_max"),
        (dict(ep_size=2), ValueError, "ep_size=2 does not match the EP group's size"),
        (dict(ep_size=0), ValueError, "ep_size must be a positive integer"),
        (dict(shared_weight_format="fp8"), ValueError, "shared_weight_format / shared_gate were given without"),
        (dict(shared_intermediate_size=100), ValueError, "shared expert sizes must be multiples of 128"),
        (dict(shared_intermediate_size=IS, shared_weight_format="nf4"), ValueError, "shared weight_format"),
    ]
    base = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, capacity=C)
    for over, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            StaticMoE(**{**base, **over})
    with pytest.raises(ValueError, match="ep_group was given but torch.distributed is not initialised"):
        StaticMoE(**base, ep_group=object())


def test_forward_validation_and_close():
    layer = StaticMoE(H, I, E, K, C, act_format="fp8", weight_format="fp8")
    idx, tw = make_routing(4, K, E, seed=1)
    x = hidden_states(4, 1)
    assert layer(x.reshape(2, 2, H), idx, tw).shape == (2, 2, H)
    with pytest.raises(ValueError, match="9 tokens exceed the capacity of 8"):
        layer(hidden_states(9, 1), *make_routing(9, K, E, seed=1))
    with pytest.raises(ValueError, match=r"must be \[T=4, top_k=3\]"):
        layer(x, idx[:, :2], tw[:, :2])
    with pytest.raises(ValueError, match="hidden must be bf16, fp16 or fp32"):
        layer(x.double(), idx, tw)
    with pytest.raises(ValueError, match=r"hidden\[1\] must be float32 \[..., 2\]"):
        layer((torch.zeros(4, H, dtype=torch.float8_e4m3fn), torch.ones(4, 1)), idx, tw)
    with pytest.raises(ValueError, match=r"topk_idx must hold global expert ids in \[-1, 8\)"):
        layer(x, idx.masked_fill(idx == 0, 8), tw)
    with pytest.raises(TypeError, match="only with act_format='fp8'"):
        StaticMoE(H, I, E, K, C)((x, None), idx, tw)
    with pytest.raises(ValueError, match="hidden is on meta"):
        layer(x.to("meta"), idx, tw)
    moved = StaticMoE(H, I, E, K, C).to("meta")  # the workspace cannot follow a device move: refused, not ignored
    with pytest.raises(RuntimeError, match="built for cpu .* now on meta"):
        moved(x.to("meta"), idx.to("meta"), tw.to("meta"))
    # Pre-quantized activations give the same result as letting the layer quantize.
    assert_equal(layer(quantize_activation(x, 128), idx, tw), layer(x, idx, tw), "pre-quantized input")
    ws = layer.workspace
    layer.close()
    layer.close()
    assert layer.closed and ws.closed
    with pytest.raises(RuntimeError, match="closed"):
        layer(x, idx, tw)
    with pytest.raises(RuntimeError, match="closed"):
        layer.workspace  # noqa: B018  (the property access is what raises)


def test_set_expert_weights_checks():
    layer = StaticMoE(H, I, E, K, C, weight_format="fp4")
    w13, w13_s, w2, w2_s = quantized(*float_experts(E, 0), "fp4")
    layer.set_expert_weights(w13.view(torch.float4_e2m1fn_x2), w13_s.view(torch.float8_e8m0fnu), w2, w2_s)
    assert_equal(layer.w13, w13, "fp4 view accepted as uint8")
    with pytest.raises(ValueError, match=r"routed w2 must have shape \[8, 256, 64\]"):
        layer.set_expert_weights(w13, w13_s, w2[:, :, :32], w2_s)
    with pytest.raises(ValueError, match="UE8M0 byte 255"):
        layer.set_expert_weights(w13, torch.full_like(w13_s, 255), w2, w2_s)
    with pytest.raises(TypeError, match="must be torch.uint8 for fp4"):
        layer.set_expert_weights(w13.float(), w13_s, w2, w2_s)
    with pytest.raises(ValueError, match="meta tensor"):
        layer.set_expert_weights(w13.to("meta"), w13_s, w2, w2_s)
    with pytest.raises(ValueError, match="w2_scale is required"):
        layer.set_expert_weights(w13, w13_s, w2, None)


# ----------------------------------------------------------------------------------------------------------------
# Conversion, loading, the shared expert
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS, ids=[f"{a}x{w}" for a, w in FORMAT_PAIRS])
def test_from_module_grouped_and_hf_match_reference(act, wfmt):
    w1, w3, w2 = float_experts(E, seed=5)
    sw1, sw3, sw2 = (t[0] for t in float_experts(1, seed=6, inter=IS))
    shared_src = HFExpert(H, IS)
    with torch.no_grad():
        shared_src.gate_proj.weight.copy_(sw1)
        shared_src.up_proj.weight.copy_(sw3)
        shared_src.down_proj.weight.copy_(sw2)
    group = 32 if wfmt == "fp4" else 128
    kw = dict(top_k=K, capacity=C, weight_format=wfmt, act_format=act, act_group=group, swiglu_limit=7.0)
    grouped = StaticMoE.from_module(Grouped(w1, w3, w2), shared_expert=shared_src, **kw)
    hf = StaticMoE.from_module(hf_experts(w1, w3, w2), shared_expert=shared_src, **kw)
    experts = quantized(w1, w3, w2, wfmt)
    shared = quantized(sw1[None], sw3[None], sw2[None], wfmt)
    for name, want in zip(("w13", "w13_scale", "w2", "w2_scale"), experts):
        for layer in (grouped, hf):
            got = getattr(layer, name)
            assert (got is None) == (want is None)
            if want is not None:
                assert_equal(got.data, want, f"{name} ({wfmt})")
    assert grouped.shared.weight_format == wfmt
    x = hidden_states(C, 7)
    idx, tw = make_routing(C, K, E, seed=8, empty_frac=0.2, duplicate_frac=0.2)
    out = grouped(x, idx, tw)
    assert_equal(hf(x, idx, tw), out, "HF list vs grouped")
    ref = reference_layer(x, idx, tw, experts, act, group, 7.0, shared, 7.0)
    assert_gemm_close(out, ref, f"from_module {act}x{wfmt}")


def test_bf16_shared_expert_with_fp8_activations():
    """fp8 × bf16 is not a pair, so a bf16 shared expert runs on the bf16 hidden states (dequantized from
    (x_q, x_s) when the caller passes fp8)."""
    w1, w3, w2 = float_experts(E, seed=15)
    sw = [t[:1] for t in float_experts(1, seed=16, inter=IS)]
    layer = StaticMoE.from_module(
        Grouped(w1, w3, w2),
        top_k=K,
        capacity=C,
        weight_format="fp4",
        act_format="fp8",
        shared_weight_format="bf16",
        shared_expert=hf_experts(*sw)[0],
    )
    assert layer.shared.weight_format == "bf16" and layer.shared.w13.dtype == torch.bfloat16
    x = hidden_states(6, 17)
    idx, tw = make_routing(6, K, E, seed=18, empty_frac=0.2)
    experts = quantized(w1, w3, w2, "fp4")
    shared = quantized(*sw, "bf16")
    assert_gemm_close(layer(x, idx, tw), reference_layer(x, idx, tw, experts, "fp8", 128, None, shared), "bf16 hidden")
    x_q, x_s = quantize_activation(x, 128)
    x_deq = dequantize_activation(x_q, x_s).to(torch.bfloat16)
    ref = reference_layer(
        x_deq, idx, tw, experts, "fp8", 128, None, shared
    )  # re-quantizing x_deq gives the same values
    assert_gemm_close(layer((x_q, x_s), idx, tw), ref, "pre-quantized input")


def test_fp8_max_for_trn2_reaches_routed_and_shared_experts():
    """StaticMoE(fp8_max=240) (what trn2 needs) passes it to the forward and to the shared expert: on an input where
    fp8_max changes the result (make_fp8_max_sensitive), each matches the reference run with its fp8_max."""
    t = 5
    x, w13, w2, idx, tw = make_fp8_max_sensitive(t, E, H, I, seed=23)
    _, sw13, sw2, _, _ = make_fp8_max_sensitive(t, 1, H, IS, seed=24)
    experts = (*quantize_weight(w13, "fp8"), *quantize_weight(w2, "fp8"))
    shared = (*quantize_weight(sw13, "fp4"), *quantize_weight(sw2, "fp4"))
    x_q, x_s = quantize_activation(x, 128)
    ones = torch.ones(t, 1)
    outs, shared_outs = {}, {}
    for m in (448.0, 240.0):
        layer = StaticMoE(
            H,
            I,
            E,
            K,
            C,
            weight_format="fp8",
            act_format="fp8",
            shared_intermediate_size=IS,
            shared_weight_format="fp4",
            fp8_max=m,
        )
        assert layer.fp8_max == m and layer.shared.fp8_max == m
        layer.set_expert_weights(*experts)
        layer.shared.set_weights(*shared)
        shared_outs[m] = layer.shared(x_q, x_s)
        ref_shared = reference.local_experts(x_q, x_s, idx, ones, *shared, 0, None, m)
        assert_gemm_close(shared_outs[m], ref_shared, f"shared expert fp8_max={m}")
        full_idx = torch.cat((idx, torch.full((t, K - 1), -1, dtype=torch.int32)), dim=1)
        full_tw = torch.cat((tw, torch.zeros(t, K - 1)), dim=1)
        outs[m] = layer(x.to(torch.bfloat16), full_idx, full_tw)
        ref = reference.forward(x_q, x_s, full_idx, full_tw, *experts, ref_shared, E, C, None, "", 0, 1, m)
        assert_gemm_close(outs[m], ref, f"layer fp8_max={m}")
        layer.close()
    with pytest.raises(AssertionError):  # the checks above tell 240 from 448 apart on this input
        assert_gemm_close(shared_outs[240.0], shared_outs[448.0], "shared 240 vs 448")
    with pytest.raises(AssertionError):
        assert_gemm_close(outs[240.0], outs[448.0], "240 vs 448")


def test_from_module_rejections():
    w1, w3, w2 = float_experts(E, seed=1)
    with pytest.raises(ValueError, match="meta tensor"):
        StaticMoE.from_module(Grouped(w1.to("meta"), w3, w2), top_k=K, capacity=C)
    with pytest.raises(ValueError, match=r"w1/w3 \[L, I, H\] and w2 \[L, H, I\]"):
        StaticMoE.from_module(Grouped(w1, w3, w2.transpose(1, 2)), top_k=K, capacity=C)
    with pytest.raises(TypeError, match="must be a float weight"):
        StaticMoE.from_module(Grouped(w1.to(torch.float8_e4m3fn), w3, w2), top_k=K, capacity=C)
    with pytest.raises(ValueError, match=r"source w1 holds 8 experts, but num_experts=16 over ep_size=1 needs all 16"):
        StaticMoE.from_module(Grouped(w1, w3, w2), top_k=K, capacity=C, num_experts=16)
    experts = hf_experts(w1, w3, w2)
    with pytest.raises(ValueError, match="the experts list holds 6 experts, but num_experts=8"):
        StaticMoE.from_module(experts[:6], top_k=K, capacity=C, num_experts=E)
    with pytest.raises(ValueError, match="biased projections"):
        StaticMoE.from_module([HFExpert(H, I, bias=True) for _ in range(E)], top_k=K, capacity=C)
    with pytest.raises(ValueError, match="meta tensor"):
        StaticMoE.from_module([HFExpert(H, I, device="meta") for _ in range(E)], top_k=K, capacity=C)
    with pytest.raises(ValueError, match=r"expert 3 \(owned by this rank\) is None"):
        StaticMoE.from_module([*experts[:3], None, *experts[4:]], top_k=K, capacity=C, num_experts=E)
    with pytest.raises(TypeError, match="gate_proj/up_proj/down_proj or w1/w3/w2"):
        StaticMoE.from_module([nn.Linear(H, I) for _ in range(E)], top_k=K, capacity=C)
    with pytest.raises(TypeError, match="grouped experts"):
        StaticMoE.from_module(nn.Linear(H, I), top_k=K, capacity=C)


def test_from_module_fused_transformers_experts():
    """5.x fused experts give the same layer as grouped ones; variants StaticMoE cannot represent are named."""
    w1, w3, w2 = float_experts(E, seed=31)
    kw = dict(top_k=K, capacity=C, weight_format="fp8", act_format="fp8")
    fused, grouped = StaticMoE.from_module(Fused(w1, w3, w2), **kw), StaticMoE.from_module(Grouped(w1, w3, w2), **kw)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert_equal(getattr(fused, name).data, getattr(grouped, name).data, f"fused {name}")
    x = hidden_states(6, 32)
    idx, tw = make_routing(6, K, E, seed=33, empty_frac=0.2)
    assert_equal(fused(x, idx, tw), grouped(x, idx, tw), "fused vs grouped")
    bad = [
        (dict(is_transposed=True), "transposed"),
        (dict(is_concatenated=False), "interleaved gate/up rows"),
        (dict(has_bias=True), "biased projections"),
        (dict(gate_up_proj_bias=torch.zeros(E, 2 * I)), "bias"),
        (dict(has_gate=False), "without a gate projection"),
        (dict(act=nn.GELU()), "activation GELU"),
    ]
    for flags, msg in bad:
        with pytest.raises(ValueError, match=msg):
            StaticMoE.from_module(Fused(w1, w3, w2, **flags), **kw)
    with pytest.raises(ValueError, match=r"gate_up_proj \[E, 2I, H\] and down_proj \[E, H, I\]"):
        StaticMoE.from_module(Fused(w1, w3, w2.transpose(1, 2)), **kw)


def test_expert_split_errors_say_what_to_pass():
    """Which experts a rank keeps (from_module's rule), and the messages when the counts do not fit."""
    from static_moe.loaders.torch_modules import _local_range

    assert _local_range(8, 8, 2, 1, False, "x") == (4, 4, 8)  # the whole model: rank 1 keeps 4…7
    assert _local_range(4, 8, 2, 1, False, "x") == (0, 4, 8)  # this rank's own
    assert _local_range(4, None, 2, 1, True, "x") == (0, 4, 8)  # a DTensor shard
    with pytest.raises(ValueError, match="do not split over ep_size=3 ranks; pick an ep_size that divides 8"):
        _local_range(8, 8, 3, 0, False, "x")
    with pytest.raises(
        ValueError,
        match=r"pass num_experts=6 if they are all the model's experts \(6 does not "
        r"split over 4 ranks\), or num_experts=24",
    ):
        _local_range(6, None, 4, 0, False, "x")
    with pytest.raises(ValueError, match="x holds 3 experts, but num_experts=8 over ep_size=2 needs all 8"):
        _local_range(3, 8, 2, 0, False, "x")
    with pytest.raises(ValueError, match="EP shard of 4 experts on each of 2 ranks .* num_experts=16"):
        _local_range(4, 16, 2, 0, True, "x")


def test_non_finite_weights_are_named():
    w1, w3, w2 = float_experts(E, seed=34)
    nan = w1.clone()
    nan[5, 3, 7] = math.nan
    with pytest.raises(ValueError, match=r"experts.gate_up_proj has NaN or Inf values \(expert \[5\]\)"):
        StaticMoE.from_module(Fused(nan, w3, w2), top_k=K, capacity=C, weight_format="fp4", act_format="fp8")
    inf = w2.clone()
    inf[2, 0, 0] = math.inf
    with pytest.raises(ValueError, match=r"experts\[2\].down_proj.weight has NaN or Inf"):
        StaticMoE.from_module(hf_experts(w1, w3, inf), top_k=K, capacity=C, weight_format="fp8")
    shared = hf_experts(*(t[:1] for t in float_experts(1, 35, IS)))[0]
    gate = nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        gate.weight[0, 4] = math.nan
    with pytest.raises(ValueError, match="shared_expert_gate.weight has NaN or Inf"):
        StaticMoE.from_module(Grouped(w1, w3, w2), top_k=K, capacity=C, shared_expert=shared, shared_expert_gate=gate)


def test_gated_shared_expert_matches_reference():
    """Qwen2-MoE's sigmoid(x·g)·shared(x): the gate in float32 from the hidden states, added before the bf16 cast;
    a biased or wider gate is refused, and without the gate the result differs (it was dropped silently before)."""
    w1, w3, w2 = float_experts(E, seed=36)
    sw = [t[:1] for t in float_experts(1, seed=37, inter=IS)]
    gate = nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(1, H, generator=gen(38)) / H**0.5)
    kw = dict(top_k=K, capacity=C, weight_format="fp4", act_format="fp8", shared_expert=hf_experts(*sw)[0])
    layer = StaticMoE.from_module(Grouped(w1, w3, w2), shared_expert_gate=gate, **kw)
    assert layer.shared.gate_weight.dtype == torch.float32
    x = hidden_states(7, 39)
    idx, tw = make_routing(7, K, E, seed=40, empty_frac=0.2)
    xq, xs = activations(x, "fp8", 128)
    shared = quantized(*sw, "fp4")
    t = x.shape[0]
    shared_out = reference.local_experts(
        xq, xs, torch.zeros(t, 1, dtype=torch.int32), torch.ones(t, 1), *shared, 0, None
    ) * torch.sigmoid(x.float() @ gate.weight.detach().T)
    ref = reference.forward(xq, xs, idx, tw, *quantized(w1, w3, w2, "fp4"), shared_out, E, C, None, "", 0, 1)
    out = layer(x, idx, tw)
    assert_gemm_close(out, ref, "gated shared expert")
    ungated = StaticMoE.from_module(Grouped(w1, w3, w2), **kw)
    with pytest.raises(AssertionError):
        assert_gemm_close(ungated(x, idx, tw), ref, "ungated")
    copy = StaticMoE(
        H, I, E, K, C, weight_format="fp4", act_format="fp8", shared_intermediate_size=IS, shared_gate=True
    )
    copy.load_state_dict(layer.state_dict())
    assert_equal(copy(x, idx, tw), out, "gated shared expert state_dict round trip")
    with pytest.raises(ValueError, match="a biased gate"):
        StaticMoE.from_module(Grouped(w1, w3, w2), shared_expert_gate=nn.Linear(H, 1), **kw)
    with pytest.raises(ValueError, match=r"must be a float \[1, 256\] tensor"):
        StaticMoE.from_module(Grouped(w1, w3, w2), shared_expert_gate=nn.Linear(H, 2, bias=False), **kw)
    with pytest.raises(ValueError, match="shared_expert_gate was given without shared_expert"):
        StaticMoE.from_module(Grouped(w1, w3, w2), top_k=K, capacity=C, shared_expert_gate=gate)
    for m in (layer, ungated, copy):
        m.close()


def test_dtype_conversions_keep_formats_and_io_dtypes():
    """.to(bf16) / .half() / .float() leave fp8/fp4 weights and scales (and the fp32 gate) as they are; fp16 / fp32
    hidden states and fp16 routing weights are accepted and the output comes back in the hidden states' dtype,
    equal to the bf16 path rounded once."""
    w1, w3, w2 = float_experts(E, seed=41)
    shared = hf_experts(*(t[:1] for t in float_experts(1, 42, IS)))[0]
    layer = StaticMoE.from_module(
        Grouped(w1, w3, w2),
        top_k=K,
        capacity=C,
        weight_format="fp8",
        act_format="fp8",
        shared_expert=shared,
        shared_weight_format="fp4",
        shared_expert_gate=nn.Linear(H, 1, bias=False),
    )
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    x = hidden_states(5, 43)
    idx, tw = make_routing(5, K, E, seed=44, empty_frac=0.2)
    want = layer(x, idx, tw)
    for convert in (
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.to("cpu", torch.float16),
    ):
        assert convert(layer) is layer
        for n, p in layer.named_parameters():
            assert_equal(p.data, before[n], f"{n} after a dtype conversion")
        assert_equal(layer(x, idx, tw), want, "after a dtype conversion")
    for dtype in (torch.float16, torch.float32):
        out = layer(x.to(dtype), idx, tw.to(torch.float16))
        assert out.dtype == dtype
        assert_equal(out, layer(x, idx, tw.to(torch.float16).float()).to(dtype), f"{dtype} hidden")
    assert (
        layer((torch.zeros(5, H, dtype=torch.float8_e4m3fn), torch.ones(5, H // 128)), idx, tw).dtype == torch.bfloat16
    )
    layer.close()


def test_load_state_dict_validates_like_set_expert_weights():
    layer = StaticMoE(H, I, E, K, C, weight_format="fp4", act_format="fp8")
    w13, w13_s, w2, w2_s = quantized(*float_experts(E, 45), "fp4")
    good = {
        "w13": w13.view(torch.float4_e2m1fn_x2),
        "w13_scale": w13_s.view(torch.float8_e8m0fnu),
        "w2": w2,
        "w2_scale": w2_s,
    }
    layer.load_state_dict(good)
    assert_equal(layer.w13.data, w13, "fp4 view loaded as uint8")
    cases = [
        ({"w13_scale": torch.full_like(w13_s, 255)}, ValueError, "UE8M0 byte 255"),
        ({"w13": w13.float()}, TypeError, "must be torch.uint8 for fp4"),
        ({"w2": w2[:, :, :32]}, ValueError, r"w2 must have shape \[8, 256, 64\]"),
    ]
    for over, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            layer.load_state_dict({**good, **over})
        assert_equal(layer.w13.data, w13, "a refused state dict leaves the weights")
    fp8 = StaticMoE(H, I, E, K, C, weight_format="fp8", act_format="fp8")
    q13, s13, q2, s2 = quantized(*float_experts(E, 46), "fp8")
    with pytest.raises(ValueError, match="fp8 weight scales must be finite"):
        fp8.load_state_dict({"w13": q13, "w13_scale": s13.masked_fill(s13 > 0, math.nan), "w2": q2, "w2_scale": s2})
    nan_bytes = q13.view(torch.uint8).clone()
    nan_bytes[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="bytes 0x7F/0xFF are NaN"):
        fp8.set_expert_weights(nan_bytes.view(torch.float8_e4m3fn), s13, q2, s2)
    layer.close()
    fp8.close()


def _deepseek_checkpoint(fmt: str, prefix: str, style: str, experts=range(E), seed=0, shared=True) -> dict:
    """A DeepSeek-style MoE block: per-expert w1/w3/w2 (or gate/up/down_proj) in ``fmt`` with the checkpoint's
    own scale layouts: fp8 with random (not power-of-two) 128×128 block scales, fp4 as float4_e2m1fn_x2 with
    float8_e8m0fnu scales, bf16 plain."""
    names = {"v4": ("w1", "w3", "w2", "scale"), "v3": ("gate_proj", "up_proj", "down_proj", "weight_scale_inv")}
    n1, n3, n2, scale_name = names[style]
    g = gen(seed)
    sd = {}

    def put(base, w):
        n, k = w.shape
        if fmt == "bf16":
            sd[base + ".weight"] = w.to(torch.bfloat16)
        elif fmt == "fp8":
            block = torch.rand(n // 128, k // 128, generator=g) * 0.01 + 0.001
            q = (w / expand_block_scales(block, n).repeat_interleave(128, dim=1)).clamp(-448, 448)
            sd[base + ".weight"] = q.to(torch.float8_e4m3fn)
            sd[f"{base}.{scale_name}"] = block
        else:
            q, s = quantize_weight(w, "fp4")
            sd[base + ".weight"] = q.view(torch.float4_e2m1fn_x2)
            sd[f"{base}.{scale_name}"] = s.view(torch.float8_e8m0fnu)

    for e in experts:
        w1, w3, w2 = (t[0] for t in float_experts(1, seed=100 + e))
        put(f"{prefix}experts.{e}.{n1}", w1)
        put(f"{prefix}experts.{e}.{n3}", w3)
        put(f"{prefix}experts.{e}.{n2}", w2)
    if shared:
        w1, w3, w2 = (t[0] for t in float_experts(1, seed=99, inter=IS))
        put(f"{prefix}shared_experts.{n1}", w1)
        put(f"{prefix}shared_experts.{n3}", w3)
        put(f"{prefix}shared_experts.{n2}", w2)
    sd[f"{prefix}gate.weight"] = torch.zeros(E, H)  # the router: not ours, ignored
    return sd


def _expected_from_checkpoint(sd, prefix, style, fmt, target, experts, base="experts.{e}."):
    """The (w13, w13_s, w2, w2_s) a loader must produce, derived independently from the raw checkpoint."""
    n1, n3, n2, sname = {
        "v4": ("w1", "w3", "w2", "scale"),
        "v3": ("gate_proj", "up_proj", "down_proj", "weight_scale_inv"),
    }[style]
    out = []
    for e in experts:
        b = prefix + base.format(e=e)
        ws = [sd[f"{b}{n}.weight"] for n in (n1, n3, n2)]
        ss = [sd.get(f"{b}{n}.{sname}") for n in (n1, n3, n2)]
        if fmt == "bf16":
            w13, w13_s = quantize_weight(torch.cat(ws[:2]).float(), target)
            w2, w2_s = quantize_weight(ws[2].float(), target)
        elif fmt == "fp8":
            w13, w2 = torch.cat(ws[:2]), ws[2]
            w13_s = torch.cat([s.repeat_interleave(128, dim=0) for s in ss[:2]])
            w2_s = ss[2].repeat_interleave(128, dim=0)
        else:
            w13, w2 = torch.cat(ws[:2]).view(torch.uint8), ws[2].view(torch.uint8)
            w13_s, w2_s = torch.cat(ss[:2]).view(torch.uint8), ss[2].view(torch.uint8)
        out.append((w13, w13_s, w2, w2_s))
    return tuple(None if out[0][i] is None else torch.stack([o[i] for o in out]) for i in range(4))


@pytest.mark.parametrize(
    "fmt,target,act,style",
    [
        ("fp8", None, "fp8", "v3"),
        ("fp4", None, "fp8", "v4"),
        ("bf16", None, "bf16", "v4"),
        ("bf16", "fp4", "fp8", "v3"),
        ("bf16", "fp8", "bf16", "v4"),
    ],
)
def test_deepseek_loader(fmt, target, act, style):
    prefix = "model.layers.3.mlp."
    sd = _deepseek_checkpoint(fmt, prefix, style)
    layer = StaticMoE.from_deepseek_state_dict(
        sd, prefix=prefix, num_experts=E, top_k=K, capacity=C, weight_format=target, act_format=act, swiglu_limit=10.0
    )
    want_fmt = target or fmt
    assert layer.weight_format == want_fmt and layer.shared is not None and layer.shared.weight_format == want_fmt
    experts = _expected_from_checkpoint(sd, prefix, style, fmt, want_fmt, range(E))
    shared = _expected_from_checkpoint(sd, prefix, style, fmt, want_fmt, [0], base="shared_experts.")
    for name, want in zip(("w13", "w13_scale", "w2", "w2_scale"), experts):
        if want is not None:
            assert_equal(getattr(layer, name).data, want, f"{name} from a {fmt} checkpoint")
    x = hidden_states(6, 3)
    idx, tw = make_routing(6, K, E, seed=4, empty_frac=0.1)
    ref = reference_layer(x, idx, tw, experts, act, 128, 10.0, shared, 10.0)
    assert_gemm_close(layer(x, idx, tw), ref, f"deepseek {fmt}->{want_fmt}")


def test_deepseek_loader_rejections():
    sd = _deepseek_checkpoint("fp8", "", "v4", shared=False)
    with pytest.raises(ValueError, match="would quantize twice"):
        StaticMoE.from_deepseek_state_dict(
            sd, num_experts=E, top_k=K, capacity=C, weight_format="fp4", act_format="fp8"
        )
    with pytest.raises(KeyError, match=r"experts\.5\.\{w2\|down_proj\}\.weight"):
        StaticMoE.from_deepseek_state_dict(
            {k: v for k, v in sd.items() if k != "experts.5.w2.weight"},
            num_experts=E,
            top_k=K,
            capacity=C,
            act_format="fp8",
        )
    with pytest.raises(ValueError, match="scales must be 128×128 blocks"):
        bad = dict(sd)
        bad["experts.0.w1.scale"] = torch.ones(3, 2)
        StaticMoE.from_deepseek_state_dict(bad, num_experts=E, top_k=K, capacity=C, act_format="fp8")
    with pytest.raises(ValueError, match="need a scale tensor"):
        StaticMoE.from_deepseek_state_dict(
            {k: v for k, v in sd.items() if k != "experts.2.w3.scale"},
            num_experts=E,
            top_k=K,
            capacity=C,
            act_format="fp8",
        )
    fp4 = _deepseek_checkpoint("fp4", "", "v4", shared=False)
    fp4["experts.1.w2.scale"] = torch.full_like(fp4["experts.1.w2.scale"].view(torch.uint8), 255)
    with pytest.raises(ValueError, match="UE8M0 byte 255"):
        StaticMoE.from_deepseek_state_dict(fp4, num_experts=E, top_k=K, capacity=C, act_format="fp8")
    meta = {k: v.to("meta") for k, v in sd.items()}
    with pytest.raises(ValueError, match="meta tensor"):
        StaticMoE.from_deepseek_state_dict(meta, num_experts=E, top_k=K, capacity=C, act_format="fp8")


def test_deepseek_loader_messages():
    """A 0-D weight, experts of different shapes and integer fp8 scales each give an error naming the key."""
    sd = _deepseek_checkpoint("fp8", "", "v4", shared=False)
    with pytest.raises(ValueError, match=r"experts.3.w1.weight must be a 2-D tensor, got 0-D \[\]"):
        StaticMoE.from_deepseek_state_dict(
            {**sd, "experts.3.w1.weight": torch.tensor(1.0)}, num_experts=E, top_k=K, capacity=C, act_format="fp8"
        )
    bf16 = _deepseek_checkpoint("bf16", "", "v3", shared=False)
    bf16["experts.6.up_proj.weight"] = bf16["experts.6.up_proj.weight"][:, :128]
    with pytest.raises(
        ValueError,
        match=r"experts.6.up_proj has shape \[128, 128\] but experts.0.up_proj has "
        r"\[128, 256\]",
    ):
        StaticMoE.from_deepseek_state_dict(bf16, num_experts=E, top_k=K, capacity=C)
    with pytest.raises(TypeError, match=r"experts.4.w2 scale: fp8 weight scales must be float32.*torch.int32"):
        StaticMoE.from_deepseek_state_dict(
            {**sd, "experts.4.w2.scale": sd["experts.4.w2.scale"].to(torch.int32)},
            num_experts=E,
            top_k=K,
            capacity=C,
            act_format="fp8",
        )
    nan_bytes = sd["experts.1.w3.weight"].view(torch.uint8).clone()
    nan_bytes[5, 9] = 0xFF
    with pytest.raises(ValueError, match="experts.1.w3: float8_e4m3fn bytes 0x7F/0xFF are NaN"):
        StaticMoE.from_deepseek_state_dict(
            {**sd, "experts.1.w3.weight": nan_bytes.view(torch.float8_e4m3fn)},
            num_experts=E,
            top_k=K,
            capacity=C,
            act_format="fp8",
        )
    floats = _deepseek_checkpoint("bf16", "", "v4", shared=False)
    floats["experts.2.w3.weight"] = floats["experts.2.w3.weight"].clone()
    floats["experts.2.w3.weight"][0, 0] = math.inf
    with pytest.raises(ValueError, match="experts.2.w3 has NaN or Inf values"):
        StaticMoE.from_deepseek_state_dict(
            floats, num_experts=E, top_k=K, capacity=C, weight_format="fp4", act_format="fp8"
        )


def _fused_checkpoint(fmt: str, prefix: str) -> tuple[dict, dict]:
    """transformers 5.x keys (experts.gate_up_proj / down_proj) holding the experts of the per-expert DeepSeek
    checkpoint (fp8: 128×128 block scales as ``…_scale_inv``), plus a Qwen2-MoE gated shared expert."""
    per = _deepseek_checkpoint(fmt, prefix, "v3", shared=False)
    base = prefix + "experts."

    def stack(name, suffix):
        return torch.stack([per[f"{base}{e}.{name}.{suffix}"] for e in range(E)])

    sd = {
        f"{base}gate_up_proj": torch.cat((stack("gate_proj", "weight"), stack("up_proj", "weight")), dim=1),
        f"{base}down_proj": stack("down_proj", "weight"),
    }
    if fmt == "fp8":
        sd[f"{base}gate_up_proj_scale_inv"] = torch.cat(
            (stack("gate_proj", "weight_scale_inv"), stack("up_proj", "weight_scale_inv")), dim=1
        )
        sd[f"{base}down_proj_scale_inv"] = stack("down_proj", "weight_scale_inv")
    w1, w3, w2 = (t[0] for t in float_experts(1, seed=98, inter=IS))
    for n, w in (("gate_proj", w1), ("up_proj", w3), ("down_proj", w2)):
        sd[f"{prefix}shared_expert.{n}.weight"] = w.to(torch.bfloat16)
    sd[f"{prefix}shared_expert_gate.weight"] = (torch.randn(1, H, generator=gen(97)) / H**0.5).to(torch.bfloat16)
    return sd, per


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_loader_reads_fused_transformers_keys(fmt):
    prefix = "model.layers.1.mlp."
    sd, per = _fused_checkpoint(fmt, prefix)
    act = "fp8" if fmt == "fp8" else "bf16"
    layer = StaticMoE.from_deepseek_state_dict(
        sd, prefix=prefix, num_experts=E, top_k=K, capacity=C, act_format=act, shared_weight_format="bf16"
    )
    want = _expected_from_checkpoint(per, prefix, "v3", fmt, fmt, range(E))
    for name, w in zip(("w13", "w13_scale", "w2", "w2_scale"), want):
        if w is not None:
            assert_equal(getattr(layer, name).data, w, f"fused {fmt} {name}")
    assert layer.shared is not None and layer.shared.gate_weight is not None
    assert_equal(layer.shared.gate_weight.data, sd[prefix + "shared_expert_gate.weight"].float(), "gate weight")
    with pytest.raises(KeyError, match=r"experts.gate_up_proj or .*experts.down_proj but not .*experts.down_proj"):
        StaticMoE.from_deepseek_state_dict(
            {k: v for k, v in sd.items() if not k.endswith("experts.down_proj")},
            prefix=prefix,
            num_experts=E,
            top_k=K,
            capacity=C,
            act_format=act,
        )
    layer.close()


def test_state_dict_round_trip_and_export_s1():
    w1, w3, w2 = float_experts(E, seed=11)
    layer = StaticMoE.from_module(
        Grouped(w1, w3, w2),
        top_k=K,
        capacity=C,
        weight_format="fp4",
        act_format="fp8",
        shared_expert=hf_experts(*(t[:1] for t in float_experts(1, 12, IS)))[0],
    )
    copy = StaticMoE(H, I, E, K, C, weight_format="fp4", act_format="fp8", shared_intermediate_size=IS)
    copy.load_state_dict(layer.state_dict())
    x = hidden_states(5, 13)
    idx, tw = make_routing(5, K, E, seed=14, empty_frac=0.2)
    eager = layer(x, idx, tw)
    assert_equal(copy(x, idx, tw), eager, "state_dict round trip")
    ep = torch.export.export(layer, (x, idx, tw))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.static_moe.forward.default in targets and torch.ops.static_moe.local_experts.default in targets
    assert_equal(ep.module()(x, idx, tw), eager, "exported StaticMoE")


# ----------------------------------------------------------------------------------------------------------------
# Prepared layouts (SPEC §1.2): prepare_for="trn2" / "trn3" on CPU tensors, run through the reference
# ----------------------------------------------------------------------------------------------------------------
from static_moe.layouts import reencode_fp8_for_trn2, to_eoi  # noqa: E402
from static_moe.testing.backends import cpu_kernels  # noqa: E402

_HELD_DTYPE = {
    ("trn2", "fp8"): torch.float8_e4m3fn,
    ("trn3", "fp8"): torch.uint32,
    ("trn2", "fp4"): torch.uint16,
    ("trn3", "fp4"): torch.uint16,
    ("trn2", "bf16"): torch.bfloat16,
    ("trn3", "bf16"): torch.bfloat16,
}


def _layer_pair(target, act, wfmt, seed):
    """(CPU layer, layer prepared for target) from the same float experts and shared expert; both with fp8_max
    240 for trn2 (SPEC §6.1), 448 otherwise."""
    w1, w3, w2 = float_experts(E, seed=seed)
    shared_src = hf_experts(*(t[:1] for t in float_experts(1, seed + 1, IS)))[0]
    kw = dict(
        top_k=K,
        capacity=C,
        weight_format=wfmt,
        act_format=act,
        swiglu_limit=7.0,
        shared_expert=shared_src,
        fp8_max=_FP8_MAX[target],
    )
    return (
        StaticMoE.from_module(Grouped(w1, w3, w2), **kw),
        StaticMoE.from_module(Grouped(w1, w3, w2), prepare_for=target, **kw),
    )


_FP8_MAX = {"trn2": 240.0, "trn3": 448.0}


def _held_eoi(layer):
    w = layer.expert_weights()
    return tuple(w[n] for n in ("w13", "w13_scale", "w2", "w2_scale"))


def _trn2_reencoded(w13, s13, w2, s2):
    return (*reencode_fp8_for_trn2(w13, s13), *reencode_fp8_for_trn2(w2, s2))


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS, ids=[f"{a}x{w}" for a, w in FORMAT_PAIRS])
def test_prepared_layer_holds_eio_and_matches_the_reference(target, act, wfmt):
    cpu, prep = _layer_pair(target, act, wfmt, seed=61)
    assert (cpu.weight_layout, cpu.prepare_for) == ("eoi", "cpu")
    assert (prep.weight_layout, prep.prepare_for) == ("eio", target)
    # trn3 takes the MX form for fp8 activations only; bf16 activations keep plain K-major fp8 (layouts._mx_for).
    want_dtype = torch.float8_e4m3fn if (target, act, wfmt) == ("trn3", "bf16", "fp8") else _HELD_DTYPE[(target, wfmt)]
    assert prep.w13.dtype == want_dtype and prep.w2.dtype == want_dtype and prep.shared.w13.dtype == want_dtype
    assert prep.shared.weight_layout == "eio" and f"prepare_for='{target}'" in repr(prep)
    cpu_w, cpu_shared = _held_eoi(cpu), _held_eoi(cpu.shared)
    if (target, wfmt) == ("trn2", "fp8"):
        # The held weights are the re-encoded bytes, and no code of exponent field 15 is left.
        want, want_shared = _trn2_reencoded(*cpu_w), _trn2_reencoded(*cpu_shared)
        assert int((prep.w13.view(torch.uint8) & 0x7F).max()) < 0x78
    else:
        want, want_shared = cpu_w, cpu_shared
    # The shared expert's held weights are checked against the CPU layer's, like the routed experts' (not
    # against themselves), so the reference below computes from weights known independently of prep.
    for got, w, name in zip(
        _held_eoi(prep) + _held_eoi(prep.shared), want + want_shared, ("w13", "w13_scale", "w2", "w2_scale") * 2
    ):
        assert (got is None) == (w is None)
        if w is not None:
            assert_equal(got, w, f"{target} {wfmt} {name} back in EOI")
    x = hidden_states(C, 62)
    idx, tw = make_routing(C, K, E, seed=63, empty_frac=0.2)
    with pytest.raises(ValueError, match="not supported by the CPU kernels"):
        prep(x, idx, tw)  # the C++ CPU kernels take "eoi" only
    with cpu_kernels("reference"):
        out = prep(x, idx, tw)
        base = cpu(x, idx, tw)
    ref = reference_layer(x, idx, tw, want, act, 128, 7.0, want_shared, 7.0, _FP8_MAX[target])
    assert_equal(out, ref, f"{target} {act}x{wfmt}: the reference of the held weights")
    if want is cpu_w:
        assert_equal(out, base, f"{target} {act}x{wfmt}: a pure permutation changes no bit")
    else:
        assert_gemm_close(out, base, f"{target} {act}x{wfmt}: re-encoded vs original weights")
    cpu.close()
    prep.close()


def test_prepared_state_dict_is_eoi_and_round_trips():
    cpu, prep = _layer_pair("trn2", "fp8", "fp8", seed=71)
    sd = prep.state_dict()
    assert sd["w13"].dtype == torch.float8_e4m3fn and tuple(sd["w13"].shape) == (E, 2 * I, H)
    # trn2 saves the re-encoded weights (module doc, SPEC §1.2), not the bytes it was given: equal to
    # reencode_fp8_for_trn2 of the CPU layer's, which differ from them (every block holding |q| >= 256 moved).
    saved = tuple(sd[p + n] for p in ("", "shared.") for n in ("w13", "w13_scale", "w2", "w2_scale"))
    for got, want, name in zip(
        saved,
        _trn2_reencoded(*_held_eoi(cpu)) + _trn2_reencoded(*_held_eoi(cpu.shared)),
        ("w13", "w13_scale", "w2", "w2_scale") * 2,
    ):
        assert_equal(got, want, f"trn2 saved {name} is the re-encoded one")
    assert not torch.equal(sd["w13"].view(torch.uint8), cpu.w13.data.view(torch.uint8))
    assert tuple(sd["w2_scale"].shape) == (E, H, I // 128) and tuple(sd["shared.w13"].shape) == (1, 2 * IS, H)
    again = StaticMoE(
        H,
        I,
        E,
        K,
        C,
        weight_format="fp8",
        act_format="fp8",
        swiglu_limit=7.0,
        shared_intermediate_size=IS,
        prepare_for="trn2",
        fp8_max=240.0,
    )
    again.load_state_dict(sd)
    for name in ("w13", "w13_scale", "w2", "w2_scale", "shared.w13", "shared.w2_scale"):
        assert_equal(again.get_parameter(name).data, prep.get_parameter(name).data, f"trn2 round trip {name}")
    plain = StaticMoE(
        H, I, E, K, C, weight_format="fp8", act_format="fp8", swiglu_limit=7.0, shared_intermediate_size=IS
    )
    plain.load_state_dict(sd)  # an EOI state dict loads into a layer on any device
    for got, want in zip(_held_eoi(plain), _held_eoi(prep)):
        assert_equal(got, want, "trn2 state dict into a CPU layer")
    # trn3: the held form follows the scales (MX for powers of two, plain EIO fp8 otherwise), both ways.
    mx = StaticMoE(H, I, E, K, C, weight_format="fp8", act_format="fp8", prepare_for="trn3")
    assert mx.w13.dtype == torch.uint32 and mx.w13_scale.dtype == torch.uint8
    w13, s13, w2, s2 = _held_eoi(cpu)
    odd = {"w13": w13, "w13_scale": s13 * 1.5, "w2": w2, "w2_scale": s2}
    mx.load_state_dict(odd, strict=False)
    assert mx.w13.dtype == torch.float8_e4m3fn and mx.w13_scale.dtype == torch.float32
    assert_equal(to_eoi(mx.w13.data, mx.w13_scale.data)[1], s13 * 1.5, "trn3 plain fp8 scales")
    mx.set_expert_weights(w13, s13, w2, s2)
    assert mx.w13.dtype == torch.uint32 and mx.w2_scale.dtype == torch.uint8
    assert_equal(_held_eoi(mx)[0], w13, "trn3 MX back in EOI")
    for layer in (cpu, prep, again, plain, mx):
        layer.close()


def test_prepared_loaders_and_prepare_for_validation():
    sd = _deepseek_checkpoint("fp8", "", "v3", shared=False)  # random (not power-of-two) block scales
    layer = StaticMoE.from_deepseek_state_dict(
        sd, num_experts=E, top_k=K, capacity=C, act_format="fp8", prepare_for="trn3"
    )
    assert layer.weight_layout == "eio" and layer.w13.dtype == torch.float8_e4m3fn  # not MX: scales not pow2
    for got, want in zip(_held_eoi(layer), _expected_from_checkpoint(sd, "", "v3", "fp8", "fp8", range(E))):
        assert_equal(got, want, "trn3 checkpoint back in EOI")
    layer.close()
    with pytest.raises(
        ValueError,
        match=r"prepare_for: target must be one of \['cpu', 'cuda', 'trn2', 'trn3'\], "
        "got 'trn1'",
    ):
        StaticMoE(H, I, E, K, C, prepare_for="trn1")
    auto = StaticMoE(H, I, E, K, C, weight_format="fp4")
    assert (auto.prepare_for, auto.weight_layout) == ("cpu", "eoi") and auto.w13.dtype == torch.uint8
    auto.close()
    # A Neuron device does not say whether it is trn2 or trn3 (their prepared bytes differ): prepare_for is needed.
    for cls_args in ((StaticMoE, (H, I, E, K, C)), (SharedExpert, (H, IS))):
        with pytest.raises(
            ValueError,
            match=r"Neuron device \(xla\) must say which chip .* prepare_for='trn2' "
            r"\(Trainium2\) or prepare_for='trn3'",
        ):
            cls_args[0](*cls_args[1], device="xla")
    # trn2 with fp8 activations needs fp8_max <= 240 (SPEC §6.1), refused at construction, not at the first forward.
    with pytest.raises(
        ValueError,
        match=r"fp8_max=448.0 needs OCP float8_e4m3fn on chip \(trn3\); .* pass "
        r"fp8_max=240 with prepare_for='trn2'",
    ):
        StaticMoE(H, I, E, K, C, weight_format="fp8", act_format="fp8", prepare_for="trn2")
    for ok in (dict(act_format="bf16", prepare_for="trn2"), dict(act_format="fp8", prepare_for="trn3")):
        StaticMoE(H, I, E, K, C, weight_format="fp8", **ok).close()  # 448 is fine with bf16 x, or on trn3


def test_prepared_layer_refuses_a_partial_state_dict():
    # The saved tensors are prepared together (trn3's MX choice reads both scales), so a prepared layer refuses
    # one alone with a message saying so, not torch's size mismatch against the held EIO shapes.
    cpu = StaticMoE(H, I, E, K, C, weight_format="fp8")
    w = _held_eoi(cpu)
    for target in ("trn2", "trn3"):
        layer = StaticMoE(H, I, E, K, C, weight_format="fp8", prepare_for=target)
        before = [t.clone() for t in _held_eoi(layer)]
        with pytest.raises(
            ValueError,
            match=r"a prepared layer \(prepare_for='" + target + r"'\) loads "
            r"w13/w13_scale/w2/w2_scale together; missing \['w2', 'w2_scale'\]",
        ):
            layer.load_state_dict({"w13": w[0], "w13_scale": w[1]}, strict=False)
        for got, old in zip(_held_eoi(layer), before):
            assert_equal(got, old, f"{target}: a refused load leaves the weights")
        layer.load_state_dict({}, strict=False)  # nothing of the weights given: nothing to prepare, no error
        layer.close()
    cpu.load_state_dict({"w13": w[0], "w13_scale": w[1]}, strict=False)  # EOI held: a partial copy is fine
    cpu.close()


# ----------------------------------------------------------------------------------------------------------------
# Two gloo ranks
# ----------------------------------------------------------------------------------------------------------------


def _layers_worker(rank: int, size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.group.WORLD
    num_local = E // size
    report = {}
    act, wfmt = "fp8", "fp4"

    # Three layers, same spec, different weights: one shared workspace.
    layers, full = [], []
    for layer_id in range(3):
        w1, w3, w2 = float_experts(E, seed=40 + layer_id)  # the same global experts on every rank
        full.append(quantized(w1, w3, w2, wfmt))
        mine = slice(rank * num_local, (rank + 1) * num_local)
        layers.append(
            StaticMoE.from_module(
                Grouped(w1[mine], w3[mine], w2[mine]),
                top_k=K,
                capacity=C,
                num_experts=E,
                weight_format=wfmt,
                act_format=act,
                swiglu_limit=7.0,
                ep_group=world,
            )
        )
    ws = layers[0].workspace
    assert all(layer.workspace is ws for layer in layers) and ws.num_leases == 3
    ptrs = ws.data_ptrs()
    tokens = [5, C][rank]

    def chain(step, fn=None):
        x = hidden_states(tokens, 50 + step * 2 + rank)
        for layer_id, layer in enumerate(layers):
            idx, tw = make_routing(tokens, K, E, seed=60 + 10 * step + layer_id + 3 * rank, empty_frac=0.2)
            y = layer(x, idx, tw) if fn is None else fn(layer_id, x, idx, tw)
            # Check against the single-process reference on every rank's actual inputs of this layer.
            inputs = gather_objects((x, idx, tw))
            xq = [activations(a[0], act, 128) for a in inputs]
            w = full[layer_id]
            refs = reference.forward_simulated(
                [q[0] for q in xq],
                [q[1] for q in xq],
                [a[1] for a in inputs],
                [a[2] for a in inputs],
                [w[0][r * num_local : (r + 1) * num_local] for r in range(size)],
                [w[1][r * num_local : (r + 1) * num_local] for r in range(size)],
                [w[2][r * num_local : (r + 1) * num_local] for r in range(size)],
                [w[3][r * num_local : (r + 1) * num_local] for r in range(size)],
                None,
                E,
                C,
                7.0,
            )
            assert_gemm_close(y, refs[rank], f"layer {layer_id} step {step} rank {rank}")
            x = y
        return x

    eager = [chain(0), chain(1)]
    assert ws.data_ptrs() == ptrs, "workspace buffers moved across calls"
    report["three layers"] = True

    # torch.compile(fullgraph=True) of the stack: no graph break, same bits, same buffers.
    compiled = [torch.compile(layer, fullgraph=True, backend="aot_eager") for layer in layers]
    again = chain(0, fn=lambda i, x, idx, tw: compiled[i](x, idx, tw))
    assert_equal(again, eager[0], "compiled stack vs eager")
    assert ws.data_ptrs() == ptrs
    report["compile"] = True

    # A different capacity is a different workspace; closing: the last of the three frees the shared one.
    other = StaticMoE(H, I, E, K, 2 * C, weight_format=wfmt, act_format=act, ep_group=world)
    assert other.workspace is not ws
    layers[0].close()
    layers[1].close()
    layers[1].close()
    assert not ws.closed
    assert layers[2](hidden_states(tokens, 1), *make_routing(tokens, K, E, seed=2)).shape == (tokens, H)
    layers[2].close()
    assert ws.closed and not other.workspace.closed
    expect_raises(RuntimeError, lambda: layers[0](hidden_states(2, 1), *make_routing(2, K, E, seed=2)), "closed")
    other.close()
    report["close"] = True

    # Construction is collective: differing specs and a bad argument on one rank both fail on every rank.
    t0 = time.monotonic()
    expect_raises(
        ValueError, lambda: StaticMoE(H, I, E, K, C + rank, ep_group=world), "capacity: 8 on ranks [0]; 9 on ranks [1]"
    )
    expect_raises(
        ValueError,
        lambda: StaticMoE(H if rank == 0 else 200, I, E, K, C, ep_group=world),
        "construction failed on group rank(s) [1]" if rank == 0 else "hidden must be a multiple of 128",
    )
    expect_raises(ValueError, lambda: StaticMoE(H, I, E, K, C, ep_group=world, ep_size=4), "ep_size=4 does not match")
    report["collective errors"] = time.monotonic() - t0

    # DTensor EP shards, and a global HF expert list: each rank keeps its own experts by global id.
    w1, w3, w2 = float_experts(E, seed=70)
    mesh = init_device_mesh("cpu", (size,))
    dt = Grouped(*(distribute_tensor(t, mesh, [Shard(0)]) for t in (w1, w3, w2)))
    from_dt = StaticMoE.from_module(dt, top_k=K, capacity=C, num_experts=E, weight_format="fp8", ep_group=world)
    hf_list = list(hf_experts(w1, w3, w2))
    for e in range(E):  # entries of the other rank may be absent
        if not rank * num_local <= e < (rank + 1) * num_local:
            hf_list[e] = None
    from_hf = StaticMoE.from_module(hf_list, top_k=K, capacity=C, num_experts=E, weight_format="fp8", ep_group=world)
    mine = slice(rank * num_local, (rank + 1) * num_local)
    want = quantized(w1[mine], w3[mine], w2[mine], "fp8")
    for layer in (from_dt, from_hf):
        assert_equal(layer.w13.data, want[0], "w13 of this rank")
        assert_equal(layer.w2_scale.data, want[3], "w2 scales of this rank")
        assert layer.expert_offset == rank * num_local
    # The DeepSeek loader reads only this rank's experts.
    sd = _deepseek_checkpoint("fp8", "", "v4", experts=range(rank * num_local, (rank + 1) * num_local), shared=False)
    loaded = StaticMoE.from_deepseek_state_dict(
        sd, num_experts=E, top_k=K, capacity=C, act_format="fp8", ep_group=world
    )
    assert loaded.num_local_experts == num_local and loaded.expert_offset == rank * num_local
    want = _expected_from_checkpoint(sd, "", "v4", "fp8", "fp8", range(rank * num_local, (rank + 1) * num_local))
    for name, w in zip(("w13", "w13_scale", "w2", "w2_scale"), want):
        assert_equal(getattr(loaded, name).data, w, f"loaded {name} of rank {rank}")
    for layer in (from_dt, from_hf, loaded):
        layer.close()
    report["conversion"] = True
    return report


def _rank_local_worker(rank, size):
    """A layer of this rank alone among several ranks: refused without ep_group or ep_size, served with ep_size=1.
    Rank 0 calls it twice and rank 1 once, which a layer waiting on a collective would not survive."""
    expect_raises(ValueError, lambda: StaticMoE(H, I, E, K, C), "pass ep_group explicitly", "ep_size=1")
    layer = StaticMoE(H, I, E, K, C, ep_size=1)
    assert (layer.ep_size, layer.ep_rank, layer.group_name) == (1, 0, "")
    w13, w13_s, w2, w2_s = quantized(*float_experts(E, seed=90 + rank), "bf16")
    layer.set_expert_weights(w13, w13_s, w2, w2_s)
    outs = []
    for step in range(2 if rank == 0 else 1):
        tokens = 3 + step + rank
        out = layer(hidden_states(tokens, 100 * rank + step), *make_routing(tokens, K, E, seed=rank + step))
        outs.append(out.view(torch.int16).numpy().copy())  # by value: a shared tensor outlives no worker
    layer.close()
    return outs


def test_rank_local_layer_among_several_ranks():
    """StaticMoE(..., ep_size=1) with no group while torch.distributed runs two ranks: each rank's layer computes
    its own experts alone (a tensor-parallel rank's slice, as the vLLM plugin builds them), bit for bit the layer
    built in a process without torch.distributed."""
    for rank, outs in enumerate(run_ranks(_rank_local_worker, 2, timeout=120, pg_timeout=30)):
        alone = StaticMoE(H, I, E, K, C)
        alone.set_expert_weights(*quantized(*float_experts(E, seed=90 + rank), "bf16"))
        for step, out in enumerate(outs):
            tokens = 3 + step + rank
            want = alone(hidden_states(tokens, 100 * rank + step), *make_routing(tokens, K, E, seed=rank + step))
            assert_equal(torch.from_numpy(out).view(torch.bfloat16), want, f"rank {rank} call {step}")
        alone.close()


def test_layers_on_two_ranks():
    reports = run_ranks(_layers_worker, 2, timeout=150, pg_timeout=30)
    for r in reports:
        assert r["three layers"] and r["compile"] and r["close"] and r["conversion"]
        assert r["collective errors"] < 20


def _collective_loading_worker(rank: int, size: int) -> dict:
    """A full model on S ranks keeps E/S experts per rank; an error on one rank fails every rank, and no rank keeps
    a workspace lease; the next load then works."""
    import torch.distributed as dist

    from static_moe import workspace as _workspace

    world = dist.group.WORLD
    num_local = E // size
    mine = slice(rank * num_local, (rank + 1) * num_local)
    workspaces = lambda: len(_workspace.default_manager().workspaces())  # noqa: E731
    report = {}
    w1, w3, w2 = float_experts(E, seed=80)
    expect_raises(
        ValueError,
        lambda: StaticMoE.from_module(Fused(w1, w3, w2), top_k=K, capacity=C, ep_group=world),
        "holds 8 experts and the EP group has 2 ranks: pass num_experts=8 if they are all the model's",
    )
    layer = StaticMoE.from_module(
        Fused(w1, w3, w2), top_k=K, capacity=C, num_experts=E, weight_format="fp8", act_format="fp8", ep_group=world
    )
    want = quantized(w1[mine], w3[mine], w2[mine], "fp8")
    assert layer.num_local_experts == num_local and layer.expert_offset == rank * num_local
    for name, w in zip(("w13", "w13_scale", "w2", "w2_scale"), want):
        assert_equal(getattr(layer, name).data, w, f"{name} of rank {rank} from the full model")
    tokens = [4, 7][rank]
    x = hidden_states(tokens, 81 + rank)
    idx, tw = make_routing(tokens, K, E, seed=83 + rank, empty_frac=0.1)
    y = layer(x, idx, tw)
    inputs = gather_objects((x, idx, tw))
    xq = [activations(a[0], "fp8", 128) for a in inputs]
    full = quantized(w1, w3, w2, "fp8")
    shards = [[w[r * num_local : (r + 1) * num_local] for r in range(size)] for w in full]
    refs = reference.forward_simulated(
        [q[0] for q in xq],
        [q[1] for q in xq],
        [a[1] for a in inputs],
        [a[2] for a in inputs],
        *shards,
        None,
        E,
        C,
        None,
    )
    assert_gemm_close(y, refs[rank], f"full model over EP, rank {rank}")
    layer.close()
    report["full model"] = True

    base = workspaces()
    t0 = time.monotonic()
    sd = _deepseek_checkpoint("fp8", "", "v4", experts=range(rank * num_local, (rank + 1) * num_local), shared=False)
    load = lambda d, **kw: StaticMoE.from_deepseek_state_dict(
        d,
        num_experts=E,
        top_k=K,
        capacity=C,  # noqa: E731
        act_format="fp8",
        ep_group=world,
        **kw,
    )
    stage = "StaticMoE.from_deepseek_state_dict failed on group rank(s)"
    missing = {k: v for k, v in sd.items() if k != f"experts.{rank * num_local + 1}.w2.weight"} if rank == 1 else sd
    expect_raises(
        KeyError if rank == 1 else RuntimeError,
        lambda: load(missing),
        *(["w2|down_proj}.weight"] if rank == 1 else [f"{stage} [1]", "KeyError"]),
    )
    nan = dict(sd)
    if rank == 0:
        nan["experts.2.w1.scale"] = torch.full_like(sd["experts.2.w1.scale"], math.nan)
    expect_raises(ValueError, lambda: load(nan), "fp8 weight scales must be finite" if rank == 0 else f"{stage} [0]")
    bad = Grouped(w1[mine], w3[mine], w2[mine].transpose(1, 2) if rank == 1 else w2[mine])
    expect_raises(
        ValueError,
        lambda: StaticMoE.from_module(bad, top_k=K, capacity=C, num_experts=E, ep_group=world),
        "w1/w3 [L, I, H] and w2 [L, H, I]" if rank == 1 else "from_module failed on group rank(s) [1]",
    )
    # A failure after construction (here: rank 1 asks for a gate it was not given): every rank closes its layer.
    shared = hf_experts(*(t[:1] for t in float_experts(1, 84, IS)))[0]
    expect_raises(
        ValueError,
        lambda: StaticMoE.from_module(
            Grouped(w1[mine], w3[mine], w2[mine]),
            top_k=K,
            capacity=C,
            num_experts=E,
            ep_group=world,
            shared_expert=shared,
            shared_gate=rank == 1,
        ),
        "shared_gate=True but no shared_expert_gate" if rank == 1 else "failed on group rank(s) [1]",
    )
    expect_raises(
        ValueError,
        lambda: StaticMoE.from_module(
            Grouped(w1[mine], w3[mine], w2[mine]), top_k=K, capacity=C, num_experts=E, ep_group=world, ep_size=2 + rank
        ),
        "ep_size=3 does not match" if rank == 1 else "from_module failed on group rank(s) [1]",
    )
    report["errors took"] = time.monotonic() - t0
    report["leases kept"] = workspaces() - base
    again = load(sd)
    want = _expected_from_checkpoint(sd, "", "v4", "fp8", "fp8", range(rank * num_local, (rank + 1) * num_local))
    for name, w in zip(("w13", "w13_scale", "w2", "w2_scale"), want):
        assert_equal(getattr(again, name).data, w, f"{name} after the failed loads")
    again.close()
    report["next load"] = True
    return report


def test_collective_loading_on_two_ranks():
    for r in run_ranks(_collective_loading_worker, 2, timeout=120, pg_timeout=30):
        assert r["full model"] and r["next load"]
        assert r["leases kept"] == 0
        assert r["errors took"] < 20
