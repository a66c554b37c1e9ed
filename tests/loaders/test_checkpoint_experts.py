"""load_checkpoint_experts on tiny checkpoints written in each family's exact layout (static_moe.testing.checkpoints):
this rank's experts only, bit for bit where the formats match (DeepSeek-V3/V4 fp8 block scales expanded exactly,
DeepSeek-V4 fp4 and gpt-oss MXFP4 bytes kept, nibble order checked against transformers' own MXFP4 decoder), float
checkpoints quantized on load like the reference quantizers, and errors naming the tensor and its file."""

from __future__ import annotations

import contextlib
import json
import logging
import os

import pytest
import torch

import static_moe
from static_moe import reference
from static_moe.formats import dequantize_weight_fp4, expand_block_scales
from static_moe.loaders.checkpoint_experts import load_checkpoint_experts
from static_moe.testing.checkpoints import deepseek_v3_experts, deepseek_v4_experts, gpt_oss_experts, write_sharded

H, I, E = 256, 128, 4


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_deepseek_v3_fp8_block_scales_exact(tmp_path, ep_rank):
    t = deepseek_v3_experts(3, E, H, I, "fp8")
    got = load_checkpoint_experts(
        write_sharded(tmp_path, t, 3), family="deepseek_v3", layer=3, ep_rank=ep_rank, ep_size=2
    )
    assert (got.weight_format, got.num_experts, got.expert_offset) == ("fp8", E, 2 * ep_rank)
    assert (got.hidden_size, got.intermediate_size) == (H, I)
    for local in range(2):
        base = f"model.layers.3.mlp.experts.{2 * ep_rank + local}."
        w13 = torch.cat((t[base + "gate_proj.weight"], t[base + "up_proj.weight"]))
        s13 = torch.cat(
            (
                expand_block_scales(t[base + "gate_proj.weight_scale_inv"], I),
                expand_block_scales(t[base + "up_proj.weight_scale_inv"], I),
            )
        )
        assert _bytes_equal(got.w13[local], w13) and _bytes_equal(got.w13_scale[local], s13)
        assert _bytes_equal(got.w2[local], t[base + "down_proj.weight"])
        assert _bytes_equal(got.w2_scale[local], expand_block_scales(t[base + "down_proj.weight_scale_inv"], H))


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_deepseek_v4_experts_bit_exact(tmp_path, fmt):
    t = deepseek_v4_experts(0, E, H, I, fmt)
    got = load_checkpoint_experts(write_sharded(tmp_path, t), family="deepseek_v4", layer=0, ep_rank=1, ep_size=4)
    assert got.weight_format == fmt and got.expert_offset == 1 and got.w13.shape[0] == 1
    base = "layers.0.ffn.experts.1."
    w13 = torch.cat((t[base + "w1.weight"], t[base + "w3.weight"]))
    assert _bytes_equal(got.w13[0], w13) and _bytes_equal(got.w2[0], t[base + "w2.weight"])
    if fmt == "fp4":
        s13 = torch.cat((t[base + "w1.scale"], t[base + "w3.scale"]))
        assert _bytes_equal(got.w13_scale[0], s13) and _bytes_equal(got.w2_scale[0], t[base + "w2.scale"])
    else:  # UE8M0 128×128 blocks → exact float32 powers of two, 1×128
        sb = t[base + "w2.scale"].view(torch.uint8).to(torch.int32)
        want = torch.ldexp(torch.ones(sb.shape), sb - 127).repeat_interleave(128, dim=0)[:H]
        assert torch.equal(got.w2_scale[0], want)


def test_gpt_oss_mxfp4_bit_exact_against_transformers(tmp_path):
    """The real layout: blocks [E, 2I, H/32, 16], scales [E, 2I, H/32], interleaved gate/up, biases. Our fp4
    dequantized equals transformers' MXFP4 decoder on the same bytes, value for value (nibble order, de-interleave,
    E8M0 bias 127)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    t = gpt_oss_experts(1, E, H, I)
    got = load_checkpoint_experts(write_sharded(tmp_path, t), family="gpt_oss", layer=1, ep_rank=1, ep_size=2)
    base = "model.layers.1.mlp.experts."
    # transformers: gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]); down_proj [E, I, H]
    gu = mxfp4.convert_moe_packed_tensors(
        t[base + "gate_up_proj_blocks"], t[base + "gate_up_proj_scales"], dtype=torch.float32
    )
    dn = mxfp4.convert_moe_packed_tensors(
        t[base + "down_proj_blocks"], t[base + "down_proj_scales"], dtype=torch.float32
    )
    for local in range(2):
        e = 2 + local
        ours13 = dequantize_weight_fp4(got.w13[local], got.w13_scale[local])  # [2I, H]
        assert torch.equal(ours13[:I], gu[e][:, 0::2].t()) and torch.equal(ours13[I:], gu[e][:, 1::2].t())
        assert torch.equal(dequantize_weight_fp4(got.w2[local], got.w2_scale[local]), dn[e].t())
        b = t[base + "gate_up_proj_bias"][e]
        assert torch.equal(got.w13_bias[local], torch.cat((b[0::2], b[1::2])))
        assert torch.equal(got.w2_bias[local], t[base + "down_proj_bias"][e])


@pytest.mark.parametrize("fmt", [None, "fp8", "fp4"])
def test_bf16_checkpoint_kept_or_quantized_on_load(tmp_path, fmt, caplog):
    t = deepseek_v3_experts(0, E, H, I, "bf16")
    with caplog.at_level(logging.INFO, logger="static_moe"):
        got = load_checkpoint_experts(
            write_sharded(tmp_path, t), family="qwen3_moe", layer=0, ep_rank=1, ep_size=2, weight_format=fmt
        )
    assert any("loaded experts 2…3 of 4" in r.getMessage() for r in caplog.records)
    w13 = torch.stack(
        [
            torch.cat(
                (
                    t[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                    t[f"model.layers.0.mlp.experts.{e}.up_proj.weight"],
                )
            )
            for e in (2, 3)
        ]
    )
    w2 = torch.stack([t[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in (2, 3)])
    if fmt is None:
        assert got.weight_format == "bf16" and torch.equal(got.w13, w13) and torch.equal(got.w2, w2)
        return
    for ours, (q, s) in (
        ((got.w13, got.w13_scale), reference.quantize_weight(w13, fmt)),
        ((got.w2, got.w2_scale), reference.quantize_weight(w2, fmt)),
    ):
        assert _bytes_equal(ours[0], q) and _bytes_equal(ours[1], s)


def test_from_checkpoint_builds_a_working_layer(tmp_path):
    t = deepseek_v4_experts(0, E, H, I, "fp4")
    path = write_sharded(tmp_path, t)
    layer = static_moe.StaticMoE.from_checkpoint(path, family="deepseek_v4", layer=0, top_k=2, capacity=4)
    try:
        ref = load_checkpoint_experts(path, family="deepseek_v4", layer=0)
        assert layer.weight_format == "fp4" and layer.num_experts == E
        for k, v in ref.expert_weights().items():
            assert _bytes_equal(layer.expert_weights()[k], v), k
        x = torch.randn(3, H).to(torch.bfloat16)
        idx = torch.tensor([[0, 1], [2, 3], [1, 3]])
        out = layer(x, idx, torch.full((3, 2), 0.5))
        assert out.shape == (3, H) and bool(torch.isfinite(out.float()).all())
    finally:
        layer.close()


# ----------------------------------------------------------------------------------------------------------------
# Errors name the tensor and the file
# ----------------------------------------------------------------------------------------------------------------
def _shard_of(path, key):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][key]


def test_missing_tensor_named(tmp_path):
    t = deepseek_v3_experts(0, E, H, I, "fp8")
    del t["model.layers.0.mlp.experts.3.up_proj.weight"]
    path = write_sharded(tmp_path, t)
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight.*index\.json"):
        load_checkpoint_experts(path, family="deepseek_v3", layer=0, ep_rank=1, ep_size=2)


def test_index_entry_whose_shard_lacks_the_tensor(tmp_path):
    t = deepseek_v3_experts(0, E, H, I, "bf16")
    path = write_sharded(tmp_path, t)
    idx = os.path.join(path, "model.safetensors.index.json")
    with open(idx) as f:
        j = json.load(f)
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    other = next(v for v in j["weight_map"].values() if v != j["weight_map"][key])
    j["weight_map"][key] = other
    with open(idx, "w") as f:
        json.dump(j, f)
    with pytest.raises(KeyError, match=rf"{key}.*{other}"):
        load_checkpoint_experts(path, family="qwen3_moe", layer=0)


def test_extra_tensor_named(tmp_path):
    t = deepseek_v3_experts(0, E, H, I, "bf16")
    t["model.layers.0.mlp.experts.2.gate_proj.bias"] = torch.zeros(I, dtype=torch.bfloat16)
    path = write_sharded(tmp_path, t)
    shard = _shard_of(path, "model.layers.0.mlp.experts.2.gate_proj.bias")
    with pytest.raises(ValueError, match=rf"experts\.2\.gate_proj\.bias in .*{shard}: not an expert tensor"):
        load_checkpoint_experts(path, family="qwen3_moe", layer=0)


def test_misshapen_tensor_named(tmp_path):
    t = deepseek_v4_experts(0, E, H, I, "fp4")
    key = "layers.0.ffn.experts.1.w3.weight"
    t[key] = t[key][:, :-16].contiguous()
    path = write_sharded(tmp_path, t)
    with pytest.raises(ValueError, match=rf"{key} in .*{_shard_of(path, key)}: .*must have shape \[128, 128\]"):
        load_checkpoint_experts(path, family="deepseek_v4", layer=0)


def test_wrong_dtype_named(tmp_path):
    t = deepseek_v3_experts(0, E, H, I, "fp8")
    key = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
    t[key] = t[key].to(torch.bfloat16)
    path = write_sharded(tmp_path, t)
    with pytest.raises(TypeError, match=rf"{key} in .*{_shard_of(path, key)}: .*must have dtype"):
        load_checkpoint_experts(path, family="deepseek_v3", layer=0, ep_rank=1, ep_size=2)


def test_requantizing_refused_and_nan_named(tmp_path):
    t = deepseek_v3_experts(0, E, H, I, "fp8")
    with pytest.raises(ValueError, match="would quantize twice"):
        load_checkpoint_experts(write_sharded(tmp_path / "a", t), family="deepseek_v3", layer=0, weight_format="fp4")
    b = deepseek_v3_experts(0, E, H, I, "bf16")
    key = "model.layers.0.mlp.experts.0.up_proj.weight"
    b[key][5, 7] = float("nan")
    path = write_sharded(tmp_path / "b", b)
    with pytest.raises(ValueError, match=rf"{key} in .*{_shard_of(path, key)}: quantize_weight: w holds NaN"):
        load_checkpoint_experts(path, family="qwen3_moe", layer=0, weight_format="fp8")


@contextlib.contextmanager
def _closing(layer):
    try:
        yield layer
    finally:
        layer.close()


def test_deepseek_v4_limit_from_config(tmp_path):
    """DeepSeek-V4's swiglu_limit comes from the config.json beside the checkpoint (DeepseekV4Config's field),
    transformers' default 10.0 without one, the caller's when the config has none; a contradiction is refused."""
    path = write_sharded(tmp_path, deepseek_v4_experts(0, E, H, I, "fp4"))
    build = lambda **kw: static_moe.StaticMoE.from_checkpoint(  # noqa: E731
        path, family="deepseek_v4", layer=0, top_k=2, capacity=4, **kw
    )
    with _closing(build()) as layer:
        assert layer.swiglu_limit == 10.0
    with _closing(build(swiglu_limit=5.0)) as layer:
        assert layer.swiglu_limit == 5.0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "deepseek_v4", "swiglu_limit": 3.0}, f)
    with _closing(build()) as layer:
        assert layer.swiglu_limit == 3.0
    with pytest.raises(ValueError, match=r"swiglu_limit=5\.0 contradicts swiglu_limit=3\.0 in the checkpoint's"):
        build(swiglu_limit=5.0)
