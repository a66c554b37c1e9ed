"""A tiny random Qwen3-MoE in transformers (CPU, bf16, eval mode) for the integration tests: H = 128, E = 4 experts
of I = 128, top-2, two layers, vocabulary 128. Needs transformers (imported when called)."""

from __future__ import annotations

import torch

TINY_QWEN3_MOE = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    initializer_range=0.1,
)


def tiny_qwen3_moe_config(**overrides):
    """``transformers.Qwen3MoeConfig`` of :data:`TINY_QWEN3_MOE`, with ``overrides`` applied."""
    import transformers

    return transformers.Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def tiny_qwen3_moe(seed: int = 0, **overrides):
    """The model of :func:`tiny_qwen3_moe_config` (``overrides``), initialised from ``torch.manual_seed(seed)`` — the
    same weights in every process — in bf16, eval mode, eager experts."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_qwen3_moe_config(**overrides)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
