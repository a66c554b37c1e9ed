"""Tiny checkpoints written in the exact on-disk layouts the loaders read (static_moe.loaders.checkpoint_experts):
the families' key names, dtypes and shapes, sharded with a ``model.safetensors.index.json`` as models ship them.

``write_sharded(dir, tensors, shards)`` writes any dict of tensors that way; the ``*_experts`` builders return the
tensors of one MoE layer (random values, each format's real encoding) keyed as the family names them.
"""

from __future__ import annotations

import json
import os

import torch

from ..formats import quantize_weight_fp4


def write_sharded(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], shards: int = 2) -> str:
    """Write ``tensors`` round-robin over ``shards`` files ``model-0000i-of-0000n.safetensors`` plus the index
    (``{"metadata": {"total_size"}, "weight_map"}``); returns the directory."""
    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts: list[dict] = [{} for _ in range(shards)]
    weight_map = {}
    for j, (k, t) in enumerate(tensors.items()):
        parts[j % shards][k] = t.contiguous()
        weight_map[k] = names[j % shards]
    for name, part in zip(names, parts):
        save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return directory


def _block_quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's 128×128 blocks: e4m3fn [N, K] and float32 scales [⌈N/128⌉, K/128] (scale = amax / 448)."""
    n, k = w.shape
    nb = -(-n // 128)
    pad = torch.zeros(nb * 128, k)
    pad[:n] = w
    blocks = pad.reshape(nb, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = amax / 448.0
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).reshape(nb * 128, k)[:n].to(torch.float8_e4m3fn)
    return q, s


def deepseek_v3_experts(layer: int, e: int, h: int, i: int, fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``model.layers.{layer}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (+ ``weight_scale_inv`` for "fp8"), or
    bf16 weights for "bf16" (the Qwen2/3-MoE layout too)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for x in range(e):
        for name, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = torch.randn(n, k, generator=g) * 0.02
            key = f"model.layers.{layer}.mlp.experts.{x}.{name}"
            if fmt == "fp8":
                out[f"{key}.weight"], out[f"{key}.weight_scale_inv"] = _block_quantize_fp8(w)
            else:
                out[f"{key}.weight"] = w.to(torch.bfloat16)
    return out


def deepseek_v4_experts(layer: int, e: int, h: int, i: int, fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``layers.{layer}.ffn.experts.{e}.{w1,w3,w2}.weight`` + ``.scale``: "fp4" int8 [N, K/2] with
    float8_e8m0fnu [N, K/32]; "fp8" float8_e4m3fn with float8_e8m0fnu 128×128 block scales."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for x in range(e):
        for name, (n, k) in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            w = torch.randn(n, k, generator=g) * 0.02
            key = f"layers.{layer}.ffn.experts.{x}.{name}"
            if fmt == "fp4":
                q, s = quantize_weight_fp4(w)
                out[f"{key}.weight"], out[f"{key}.scale"] = q.view(torch.int8), s.view(torch.float8_e8m0fnu)
            else:
                # power-of-two 128×128 block scales, as V4 ships them in UE8M0
                q1, _ = _block_quantize_fp8(w)
                nb = -(-n // 128)
                sb = torch.randint(118, 124, (nb, k // 128), generator=g, dtype=torch.uint8)
                out[f"{key}.weight"], out[f"{key}.scale"] = q1, sb.view(torch.float8_e8m0fnu)
    return out


def gpt_oss_experts(layer: int, e: int, h: int, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """gpt-oss MXFP4: ``model.layers.{layer}.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales,bias}``; blocks
    uint8 [E, N, K/32, 16] (two e2m1 per byte, low nibble first), E8M0 scales uint8 [E, N, K/32], bf16 biases;
    gate_up rows interleaved (even gate, odd up)."""
    g = torch.Generator().manual_seed(seed)
    base = f"model.layers.{layer}.mlp.experts."
    out = {}
    for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
        q, s = quantize_weight_fp4(torch.randn(e, n, k, generator=g) * torch.rand(e, n, 1, generator=g) * 0.1)
        out[f"{base}{name}_blocks"] = q.reshape(e, n, k // 32, 16)
        out[f"{base}{name}_scales"] = s
        out[f"{base}{name}_bias"] = (torch.randn(e, n, generator=g) * 0.01).to(torch.bfloat16)
    return out
