"""static_moe through transformers' ExpertsInterface: the flags of ``@use_experts_implementation`` (transposed,
interleaved), the SwiGLU clamp, the refusals, conversion once per module, and on small experts classes built here;
tests/integrations/test_transformers_experts_families.py runs every family of the installed transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

tf = pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="the transformers integration tests need transformers>=5 (pip install 'static_moe[transformers]')",
)

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation  # noqa: E402

from static_moe.integrations.transformers import (  # noqa: E402
    EXPERTS_IMPLEMENTATION,
    UnsupportedExperts,
    close_static_moe,
    use_static_moe,
)
from static_moe.integrations.transformers_experts import (  # noqa: E402
    experts_swiglu_limit,
    is_experts_class,
    static_moe_layer,
)
from static_moe.testing.numeric import assert_equal, calc_diff  # noqa: E402
from static_moe.testing.tiny_qwen3_moe import tiny_qwen3_moe  # noqa: E402

H, I, E, K, T = 128, 128, 4, 2, 12


class _Config(tf.PretrainedConfig):
    model_type = "static_moe_test"

    def __init__(self, limit=None, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit
        self.num_experts_per_tok = K  # lets use_static_moe convert before the first call


def experts_class(
    *,
    is_concatenated=True,
    is_transposed=False,
    has_bias=False,
    has_gate=True,
    has_post_expert_norm=False,
    gate=None,
    act=nn.functional.silu,
):
    """A fused experts class like transformers' (eager forward: loop over experts) with the given decorator flags
    and ``_apply_gate`` (default: the decorator's act_fn(gate)·up on concatenated halves)."""

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            shape = (E, H, 2 * I) if is_transposed else (E, 2 * I, H)
            self.gate_up_proj = nn.Parameter(torch.randn(shape) * 0.1)
            self.down_proj = nn.Parameter(torch.randn((E, I, H) if is_transposed else (E, H, I)) * 0.1)
            self.act_fn = act
            self.limit = config.limit

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros(hidden_states.shape, dtype=torch.float32)
            for e in range(E):
                rows, slot = torch.where(top_k_index == e)
                gu, d = self.gate_up_proj[e], self.down_proj[e]
                x = hidden_states[rows].float()
                y = x @ gu.float() if is_transposed else x @ gu.float().T
                y = self._apply_gate(y)
                y = y @ d.float() if is_transposed else y @ d.float().T
                out.index_add_(0, rows, y * top_k_weights[rows, slot, None].float())
            return out.to(hidden_states.dtype)

    if gate is not None:
        Experts._apply_gate = gate
    Experts.__name__ = Experts.__qualname__ = "TestExperts"
    return use_experts_implementation(
        is_concatenated=is_concatenated,
        is_transposed=is_transposed,
        has_bias=has_bias,
        has_gate=has_gate,
        has_post_expert_norm=has_post_expert_norm,
    )(Experts)


def make(cls, limit=None, seed=0):
    torch.manual_seed(seed)
    config = _Config(limit=limit)
    config._experts_implementation = "eager"
    return nn.ModuleDict({"experts": cls(config)}).to(torch.bfloat16)


def routing(seed=1, t=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    return x, ids, w


def eager_and_static(model, *args, **kwargs):
    x, ids, w = routing()
    experts = model["experts"]
    with torch.no_grad():
        want = experts(x, ids, w)
        use_static_moe(model, **kwargs)
        assert experts.config._experts_implementation == EXPERTS_IMPLEMENTATION
        got = experts(x, ids, w)
    return got, want


def interleaved_gate(self, gate_up):
    return nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


def clamped_gate(self, gate_up):  # DeepSeek-V4's: gate clamped above only, up both ways, then SiLU
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


def clamped_after_act_gate(self, gate_up):  # Step-3.7 / Ling: the clamp after the activation
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)


def alpha_glu_gate(self, gate_up):  # gpt-oss's GLU, concatenated
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


def test_static_moe_is_registered_in_the_experts_interface():
    from static_moe.integrations.transformers_experts import static_moe_experts_forward

    assert ALL_EXPERTS_FUNCTIONS[EXPERTS_IMPLEMENTATION] is static_moe_experts_forward
    assert is_experts_class(experts_class()) and not is_experts_class(nn.Linear)


@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(is_transposed=True),
        dict(is_concatenated=False, gate=interleaved_gate),
        dict(is_concatenated=False, is_transposed=True, gate=interleaved_gate),
    ],
    ids=["concatenated", "transposed", "interleaved", "interleaved-transposed"],
)
def test_weight_layouts_match_eager(layout):
    got, want = eager_and_static(make(experts_class(**layout)))
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert calc_diff(got, want) < 1e-4, calc_diff(got, want)


def test_swiglu_clamp_is_deepseek_v4s():
    """A limit small enough to clamp most gate and up values: static_moe's swiglu_limit is the same clamp (gate
    above only, up both ways, before SiLU), and it matters (the unclamped result differs)."""
    cls = experts_class(gate=clamped_gate)
    model = make(cls, limit=0.05)
    assert experts_swiglu_limit(model["experts"]) == 0.05
    got, want = eager_and_static(model)
    assert static_moe_layer(model["experts"]).swiglu_limit == 0.05
    assert calc_diff(got, want) < 1e-4, calc_diff(got, want)
    unclamped = make(experts_class(), limit=None)
    with torch.no_grad():
        assert calc_diff(unclamped["experts"](*routing()), want) > 1e-2


def test_alpha_glu_and_a_bias_flag_without_biases_now_run():
    """gpt-oss's GLU (swiglu_oai, SPEC §1.9) is recognised; has_bias=True with no bias tensors means zero biases."""
    for cls in (experts_class(gate=alpha_glu_gate), experts_class(has_bias=True)):
        got, want = eager_and_static(make(cls, limit=0.5))
        assert calc_diff(got, want) < 1e-4, calc_diff(got, want)


def test_deepseek_v4_experts_take_their_limit():
    cfg = tf.DeepseekV4Config(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, swiglu_limit=0.05
    )
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    experts = DeepseekV4Experts(cfg)
    assert experts_swiglu_limit(experts) == 0.05


@pytest.mark.parametrize(
    "flags,variant",
    [
        (dict(has_gate=False), "has_gate=False"),
        (dict(has_post_expert_norm=True), "has_post_expert_norm=True"),
        (dict(act=nn.functional.gelu), "gate _default_apply_gate with act_fn gelu is not an activation the kernels"),
        (
            dict(gate=clamped_after_act_gate),
            "gate clamped_after_act_gate with act_fn silu is not an activation the kernels",
        ),
    ],
    ids=["no-gate", "post-norm", "gelu-erf", "clamp-after-act"],
)
def test_unsupported_variants_are_refused_before_conversion(flags, variant):
    model = make(experts_class(**flags), limit=0.5)
    with pytest.raises(
        UnsupportedExperts,
        match=f"^TestExperts: static_moe cannot run these experts: {variant}.* "
        r"\(in experts\)$",
    ):
        use_static_moe(model)
    assert static_moe_layer(model["experts"]) is None
    assert model["experts"].config._experts_implementation == "eager"  # the model is left as it was


def test_a_clamp_after_the_activation_is_refused_when_set():
    """Step-3.7 clamps SiLU(gate), not gate: the same as the kernels without a limit, refused with one."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

    def experts(limits):
        cfg = tf.Step3p7TextConfig(
            hidden_size=H,
            moe_intermediate_size=I,
            n_routed_experts=E,
            num_experts_per_tok=K,
            num_hidden_layers=1,
            swiglu_limits=limits,
        )
        return Step3p7Experts(cfg, 0)

    assert experts_swiglu_limit(experts([0.0])) is None
    with pytest.raises(
        UnsupportedExperts,
        match="Step3p7Experts: .*gate Step3p7Experts._apply_gate with act_fn SiLUActivation is not an activation",
    ):
        experts_swiglu_limit(experts([7.0]))


def test_set_experts_implementation_alone_is_bf16_and_refuses_at_the_first_call():
    model = make(experts_class())
    x, ids, w = routing()
    experts = model["experts"]
    with torch.no_grad():
        want = experts(x, ids, w)
        experts.config._experts_implementation = EXPERTS_IMPLEMENTATION
        got = experts(x, ids, w)
    layer = static_moe_layer(experts)
    assert layer.weight_format == "bf16" and layer.act_format == "bf16"
    assert calc_diff(got, want) < 1e-4
    assert close_static_moe(model) == 1
    refused = make(experts_class(has_gate=False))["experts"]
    refused.config._experts_implementation = EXPERTS_IMPLEMENTATION
    with torch.no_grad(), pytest.raises(UnsupportedExperts, match="TestExperts: .*has_gate=False"):
        refused(x, ids, w)


def test_weights_are_converted_once_and_again_only_when_they_change():
    model = make(experts_class())
    experts = model["experts"]
    x, ids, w = routing()
    with torch.no_grad():
        use_static_moe(model, weight_format="fp8")
        layer = static_moe_layer(experts)
        assert layer is not None and layer.weight_format == "fp8"
        first = experts(x, ids, w)
        assert static_moe_layer(experts) is layer  # converted by use_static_moe, reused by every call
        assert_equal(experts(x, ids, w), first, "second call")
        assert static_moe_layer(experts) is layer
        experts.down_proj.mul_(2)  # in place: the next call converts again
        second = experts(x, ids, w)
    assert static_moe_layer(experts) is not layer and layer.closed
    assert static_moe_layer(experts).weight_format == "fp8"
    assert calc_diff(second, 2 * first.float()) < 1e-4
    assert set(model.state_dict()) == {"experts.gate_up_proj", "experts.down_proj"}  # nothing of ours saved
    twin = copy.deepcopy(model)  # a copy converts its own weights at its first call
    assert static_moe_layer(twin["experts"]) is None
    with torch.no_grad():
        assert_equal(twin["experts"](x, ids, w), second, "deep copy")
    assert close_static_moe(model) == 1 and close_static_moe(twin) == 1 and close_static_moe(model) == 0


def test_calls_beyond_the_capacity_run_in_chunks_and_no_expert_slots_are_skipped():
    model = make(experts_class())
    experts = model["experts"]
    x, ids, w = routing(t=40)
    ids[3, 1] = E  # transformers' "no expert in this slot"
    with torch.no_grad():
        w_skip = w.clone()
        w_skip[3, 1] = 0
        use_static_moe(model, capacity=16)
        chunked = experts(x, ids, w)
        use_static_moe(model, capacity=64)
        whole = experts(x, ids, w)
        ids_ok = ids.clone()
        ids_ok[3, 1] = 0
        skipped = experts(x, ids_ok, w_skip)
    assert_equal(chunked, whole, "chunked vs one call")
    assert calc_diff(whole, skipped) < 1e-6
    close_static_moe(model)


def test_fp8_weights_and_activations_quantize():
    got, want = eager_and_static(make(experts_class()), weight_format="fp8", act_format="fp8")
    assert 1e-6 < calc_diff(got, want) < 1e-2


def test_ep_group_without_distributed_and_training_are_refused_clearly():
    """(use_static_moe with an EP group of two ranks: test_transformers_experts_ep.py.)"""
    model = make(experts_class())
    with pytest.raises(ValueError, match="ep_group was given but torch.distributed is not initialised"):
        use_static_moe(model, ep_group=object())
    assert static_moe_layer(model["experts"]) is None
    use_static_moe(model)
    x, ids, w = routing()
    with pytest.raises(RuntimeError, match="inference-only"):
        model["experts"](x.requires_grad_(), ids, w)
    with pytest.raises(ValueError, match="no experts module"):
        use_static_moe(nn.Linear(2, 2))
    close_static_moe(model)


def test_from_pretrained_with_the_static_moe_implementation(tmp_path):
    """``experts_implementation="static_moe"`` passes transformers' own check and runs bf16 experts, converted at
    the first call from the loaded weights; ``set_experts_implementation("eager")`` switches back."""
    tiny_qwen3_moe(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K).save_pretrained(
        tmp_path
    )
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=EXPERTS_IMPLEMENTATION).eval()
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids).logits
        layers = [static_moe_layer(m.mlp.experts) for m in model.model.layers]
        assert all(layer is not None and layer.weight_format == "bf16" for layer in layers)
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    assert calc_diff(ours, eager) < 1e-4, calc_diff(ours, eager)
    assert close_static_moe(model) == 2
