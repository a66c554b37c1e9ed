"""StaticMoE.from_checkpoint on a tiny gpt-oss MXFP4 checkpoint in the real layout (static_moe.testing.checkpoints)
with its config.json: biases, ``activation="swiglu_oai"`` and alpha / limit from the config (SPEC §1.9), on one
rank and sliced over two EP ranks; the output matches transformers' eager GptOssExperts computed in float32 on the
dequantized weights (transformers' own MXFP4 decoder) within SPEC §1.9's calc_diff 1e-4."""

from __future__ import annotations

import logging

import pytest
import torch

import static_moe
from static_moe.testing.checkpoints import gpt_oss_experts, write_sharded
from static_moe.testing.distributed import run_ranks
from static_moe.testing.numeric import calc_diff

H, I, E, K, T = 128, 128, 4, 2, 6
# Small enough that the clamp and alpha both change the result (the defaults are 7.0 and 1.702).
ALPHA, LIMIT = 1.5, 0.75
TOLERANCE = 1e-4  # SPEC §1.9


def _checkpoint(path) -> str:
    """Two shards + index + a config.json written by transformers' GptOssConfig (its real key names)."""
    config = pytest.importorskip("transformers").GptOssConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, num_hidden_layers=2
    )
    config.swiglu_alpha, config.swiglu_limit = ALPHA, LIMIT
    write_sharded(path, gpt_oss_experts(1, E, H, I, seed=3))
    config.save_pretrained(path)
    return str(path)


def _inputs(rank: int = 0):
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    return x, idx, w


def _eager(path, x, idx, w, **config_overrides) -> torch.Tensor:
    """transformers' GptOssExperts in float32 holding the checkpoint's dequantized weights and its biases, built
    from its config.json (with ``config_overrides``)."""
    from transformers import GptOssConfig
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    t = gpt_oss_experts(1, E, H, I, seed=3)
    base = "model.layers.1.mlp.experts."
    config = GptOssConfig.from_pretrained(path, **config_overrides)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config).float()
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            dq = convert_moe_packed_tensors(t[base + name + "_blocks"], t[base + name + "_scales"], dtype=torch.float32)
            getattr(experts, name).copy_(dq)
            getattr(experts, name + "_bias").copy_(t[base + name + "_bias"].float())
        return experts(x.float(), idx, w)


def test_gpt_oss_checkpoint_matches_transformers(tmp_path, caplog):
    path = _checkpoint(tmp_path)
    x, idx, w = _inputs()
    with caplog.at_level(logging.INFO, logger="static_moe"):
        layer = static_moe.StaticMoE.from_checkpoint(path, family="gpt_oss", layer=1, top_k=K, capacity=8)
    try:
        assert (layer.activation, layer.alpha, layer.swiglu_limit) == ("swiglu_oai", ALPHA, LIMIT)
        assert layer.w13_bias is not None and bool(layer.w13_bias.abs().gt(0).any())
        assert any(
            "swiglu_limit = 0.75 (swiglu_limit in the checkpoint's config.json)" in r.getMessage()
            for r in caplog.records
        )
        with torch.no_grad():
            got = layer(x, idx, w).float()
        want = _eager(path, x, idx, w)
        assert calc_diff(got, want) < TOLERANCE, calc_diff(got, want)
        # The clamp and alpha matter here: the default gpt-oss activation is far from this output.
        other = _eager(path, x, idx, w, swiglu_alpha=1.702, swiglu_limit=7.0)
        assert calc_diff(got, other) > 100 * TOLERANCE
    finally:
        layer.close()


def test_gpt_oss_options_contradicting_the_checkpoint_refused(tmp_path):
    path = _checkpoint(tmp_path)
    for options, message in (
        (dict(activation="silu"), r"activation: gpt_oss experts need activation='swiglu_oai'"),
        (dict(expert_biases=False), r"expert_biases: gpt_oss experts need expert_biases=True"),
        (dict(swiglu_limit=7.0), r"swiglu_limit=7.0 contradicts swiglu_limit=0.75 in the checkpoint's config.json"),
        (dict(alpha=1.702), r"alpha=1.702 contradicts swiglu_alpha=1.5"),
    ):
        with pytest.raises(ValueError, match=message):
            static_moe.StaticMoE.from_checkpoint(path, family="gpt_oss", layer=1, top_k=K, capacity=8, **options)
    # Matching values are accepted.
    static_moe.StaticMoE.from_checkpoint(
        path, family="gpt_oss", layer=1, top_k=K, capacity=8, swiglu_limit=LIMIT, alpha=ALPHA
    ).close()


def _ep_worker(rank: int, size: int, path: str) -> float:
    import torch.distributed as dist

    layer = static_moe.StaticMoE.from_checkpoint(
        path, family="gpt_oss", layer=1, top_k=K, capacity=8, ep_group=dist.group.WORLD
    )
    try:
        assert layer.num_local_experts == E // size and layer.expert_offset == rank * E // size
        x, idx, w = _inputs(rank)  # each rank its own tokens
        with torch.no_grad():
            got = layer(x, idx, w).float()
        return calc_diff(got, _eager(path, x, idx, w))
    finally:
        layer.close()


def test_gpt_oss_checkpoint_expert_parallel_two_ranks(tmp_path):
    """Each of S = 2 ranks reads only its two experts (and their biases); every rank's tokens still match."""
    path = _checkpoint(tmp_path)
    for rank, diff in enumerate(run_ranks(_ep_worker, 2, path, timeout=120, pg_timeout=30)):
        assert diff < TOLERANCE, f"rank {rank}: calc_diff {diff:.2e}"
