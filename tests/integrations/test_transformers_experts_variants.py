"""gpt-oss and DeepSeek-V4 experts (transformers' own classes, tiny configs) through static_moe: gpt-oss's
interleaved, transposed gate_up with biases and its swiglu_oai GLU, DeepSeek-V4's clamped SiLU, and a GELU-tanh
experts class — through use_static_moe (StaticMoE) and through local_experts on the canonical weights, against
transformers' eager experts in float32 on the same (for fp8 / fp4: the dequantized) weights, SPEC §1.9's
calc_diff < 1e-4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

tf = pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="the transformers integration tests need transformers>=5 (pip install 'static_moe[transformers]')",
)

from transformers.integrations.moe import use_experts_implementation  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

import static_moe  # noqa: E402
from static_moe.formats import dequantize_weight, quantize_weight  # noqa: E402
from static_moe.integrations.transformers import close_static_moe, use_static_moe  # noqa: E402
from static_moe.integrations.transformers_experts import (  # noqa: E402
    ExpertsVariant,
    experts_variant,
    static_moe_layer,
)
from static_moe.testing.numeric import calc_diff  # noqa: E402

H, I, E, K, T = 128, 128, 4, 2, 10
TOL = 1e-4  # SPEC §1.9


def gpt_oss(seed=0):
    cfg = tf.GptOssConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=7.0
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    m = GptOssExperts(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1 if p.dim() == 3 else 0.5)  # biases large enough to matter
    return m.eval()


def deepseek_v4(seed=0):
    cfg = tf.DeepseekV4Config(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=0.3
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    m = DeepseekV4Experts(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m.eval()


def routing(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, ids, w


def _canonical(m):
    """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I], b2 [E, H]) in float32."""
    gu, d = m.gate_up_proj.detach().float(), m.down_proj.detach().float()
    if getattr(m, "is_transposed", False):
        gu, d = gu.transpose(1, 2), d.transpose(1, 2)
    b13 = getattr(m, "gate_up_proj_bias", None)
    b2 = getattr(m, "down_proj_bias", None)
    if not getattr(m, "is_concatenated", True):
        gu = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1)
        b13 = None if b13 is None else torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1)
    f = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
    return gu.contiguous(), d.contiguous(), f(b13), f(b2)


def _store_canonical(m, gu, d):
    """Write canonical float weights back into ``m`` in its own layout."""
    if not getattr(m, "is_concatenated", True):
        gu = torch.stack((gu[:, :I], gu[:, I:]), dim=2).reshape(gu.shape)
    if getattr(m, "is_transposed", False):
        gu, d = gu.transpose(1, 2), d.transpose(1, 2)
    with torch.no_grad():
        m.gate_up_proj.copy_(gu)
        m.down_proj.copy_(d)


def _eager(m, x, ids, w):
    with torch.no_grad():
        return m(x, ids, w).float()


def test_the_variants_are_recognised():
    assert experts_variant(gpt_oss()) == ExpertsVariant("swiglu_oai", 1.702, 7.0, True)
    assert experts_variant(deepseek_v4()) == ExpertsVariant("silu", 1.702, 0.3, False)


@pytest.mark.parametrize("weight_format", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_through_static_moe_matches_eager(family, weight_format):
    m = {"gpt_oss": gpt_oss, "deepseek_v4": deepseek_v4}[family]()
    x, ids, w = routing()
    ref_module = m
    if weight_format != "bf16":  # eager on the weights static_moe holds: quantized, dequantized
        gu, d, _, _ = _canonical(m)
        ref_module = {"gpt_oss": gpt_oss, "deepseek_v4": deepseek_v4}[family]()
        deq = [dequantize_weight(*quantize_weight(t, weight_format)) for t in (gu, d)]
        _store_canonical(ref_module, *deq)
    want = _eager(ref_module, x, ids, w)
    try:
        use_static_moe(m, weight_format=weight_format)
        with torch.no_grad():
            got = m(x.to(torch.bfloat16), ids, w).float()
        layer = static_moe_layer(m)
        assert layer.activation == ("swiglu_oai" if family == "gpt_oss" else "silu")
        assert (layer.w13_bias is not None) == (family == "gpt_oss")
    finally:
        close_static_moe(m)
    # x is rounded to bf16 on our side only: compare with eager on the same bf16 x as well.
    want_bf16x = _eager(ref_module, x.to(torch.bfloat16).float(), ids, w)
    assert calc_diff(got, want_bf16x) < TOL, calc_diff(got, want_bf16x)
    assert calc_diff(got, want) < TOL, calc_diff(got, want)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_local_experts_on_the_canonical_weights_matches_eager(family):
    m = {"gpt_oss": gpt_oss, "deepseek_v4": deepseek_v4}[family]()
    x, ids, w = routing()
    xb = x.to(torch.bfloat16)
    want = _eager(m, xb.float(), ids, w)
    gu, d, b13, b2 = _canonical(m)
    variant = experts_variant(m)
    got = static_moe.local_experts(
        xb, None, ids, w, gu.to(torch.bfloat16), None, d.to(torch.bfloat16), None, 0, variant.swiglu_limit,
        activation=variant.activation, alpha=variant.alpha, w13_bias=b13, w2_bias=b2,
    )  # fmt: skip
    # eager ran on the fp32 weights: round them to bf16 as static_moe holds them
    ref = {"gpt_oss": gpt_oss, "deepseek_v4": deepseek_v4}[family]()
    _store_canonical(ref, gu.to(torch.bfloat16).float(), d.to(torch.bfloat16).float())
    want = _eager(ref, xb.float(), ids, w)
    assert calc_diff(got, want) < TOL, calc_diff(got, want)
    if b13 is not None:  # the biases matter
        plain = static_moe.local_experts(
            xb, None, ids, w, gu.to(torch.bfloat16), None, d.to(torch.bfloat16), None, 0, variant.swiglu_limit,
            activation=variant.activation, alpha=variant.alpha,
        )  # fmt: skip
        assert calc_diff(plain, want) > 1e-3


class _GeluConfig(tf.PretrainedConfig):
    model_type = "static_moe_gelu_test"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_experts_per_tok = K


@use_experts_implementation
class GeluTanhExperts(nn.Module):
    """The Gemma-family shape: concatenated gate / up, ``ACT2FN["gelu_pytorch_tanh"](gate) · up``."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * 0.1)
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN["gelu_pytorch_tanh"]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for e in range(E):
            rows, slot = torch.where(top_k_index == e)
            y = hidden_states[rows].float() @ self.gate_up_proj[e].float().T
            g, u = y.chunk(2, dim=-1)
            y = (self.act_fn(g) * u) @ self.down_proj[e].float().T
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None].float())
        return out.to(hidden_states.dtype)


def test_gelu_tanh_experts_match_eager():
    cfg = _GeluConfig()
    cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    m = GeluTanhExperts(cfg).to(torch.bfloat16)
    assert experts_variant(m).activation == "gelu_tanh"
    x, ids, w = routing()
    xb = x.to(torch.bfloat16)
    want = _eager(m, xb, ids, w)
    try:
        use_static_moe(m)
        with torch.no_grad():
            got = m(xb, ids, w).float()
    finally:
        close_static_moe(m)
    assert calc_diff(got, want) < TOL, calc_diff(got, want)
