"""Whole tiny models under ``experts_implementation="static_moe"``: DeepSeek-V4 and gpt-oss generate the same
greedy tokens as with their eager experts (bf16, switched with ``set_experts_implementation`` alone), and
``torch.compile(fullgraph=True)`` captures a model whose experts run through static_moe in one graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="the transformers integration tests need transformers>=5 (pip install 'static_moe[transformers]')",
)


from static_moe.integrations.transformers_experts import (  # noqa: E402
    EXPERTS_IMPLEMENTATION,
    close_static_moe,
    static_moe_layer,
    use_static_moe,
)
from static_moe.testing.experts_families import VOCAB, families, tiny_model  # noqa: E402
from static_moe.testing.numeric import calc_diff  # noqa: E402
from static_moe.testing.tiny_qwen3_moe import tiny_qwen3_moe  # noqa: E402

STEPS = 4
DECISIVE = 4 * 2.0**-7  # a top-1 lead of four bf16 steps (relative): no rounding flips it


@pytest.mark.parametrize("family", ["deepseek_v4", "gpt_oss"])
def test_generate_same_tokens_as_eager(family):
    """The experts interface alone (``set_experts_implementation("static_moe")``: bf16, converted at the first
    call) generates what the eager experts generate, with the KV cache, as a user would call it. The prompt is one
    where every eager step's top-1 leads the top-2 by more than DECISIVE of its logit (asserted): at a near-tie
    the chosen side is bf16 rounding noise (this model's prompt seed 1 ties exactly at its first step)."""
    model, lm = tiny_model(family, families()[family][0])
    assert lm
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    greedy = dict(
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        want = model.generate(ids, **greedy)
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        got = model.generate(ids, **greedy)
    try:
        for step, logits in enumerate(want.logits):
            top = logits[0].float().topk(2).values
            assert top[0] - top[1] > DECISIVE * top[0].abs(), f"eager step {step} is a near-tie: pick another prompt"
        layers = [static_moe_layer(m) for m in model.modules() if static_moe_layer(m) is not None]
        assert len(layers) == model.config.num_hidden_layers and all(x.weight_format == "bf16" for x in layers)
        if family == "gpt_oss":
            assert all(x.activation == "swiglu_oai" and x.w13_bias is not None for x in layers)
        assert want.sequences.shape[1] == ids.shape[1] + STEPS
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    finally:
        close_static_moe(model)


def test_compile_fullgraph():
    """One graph for the whole forward (no break at the experts: the converted layer is looked up without the
    eager path's data-pointer check), the same bits as the uncompiled static_moe model. aot_eager traces the
    static_moe op through its fake kernel as inductor does, without inductor's minutes of code generation."""
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(ids, use_cache=False).logits
            use_static_moe(model)
            ours = model(ids, use_cache=False).logits
            compiled = torch.compile(lambda i: model(i, use_cache=False).logits, fullgraph=True, backend="aot_eager")
            got = compiled(ids)
        assert torch.equal(got, ours)
        assert calc_diff(got, eager) < 1e-4
    finally:
        close_static_moe(model)
        torch._dynamo.reset()


def test_compile_before_conversion_is_refused():
    """A model switched with set_experts_implementation alone converts at its first eager call; compiled before
    that, the experts raise a message saying what to do (a conversion is not graph code)."""
    model = tiny_qwen3_moe(num_hidden_layers=1, initializer_range=0.02)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda i: model(i, use_cache=False).logits, fullgraph=True, backend="eager")
        with torch.no_grad(), pytest.raises(Exception, match="must already be converted"):
            compiled(torch.zeros(1, 3, dtype=torch.long))
    finally:
        close_static_moe(model)
        torch._dynamo.reset()
