"""static_moe in transformers 5.x models: replace_moe_blocks on tiny random configs of Qwen3-MoE, Qwen2-MoE (gated
shared expert), DeepSeek-V3 (grouped sigmoid router, shared experts), Mixtral and OLMoE. Block outputs and whole-model
logits against the unmodified model (bf16 weights), or against the model holding static_moe's dequantized weights
(fp8 / fp4); greedy generation; torch.compile(fullgraph=True) of a replaced block; EP over two gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

tf = pytest.importorskip(
    "transformers",
    minversion="5.0",
    reason="the transformers integration tests need transformers>=5 (pip install 'static_moe[transformers]')",
)

from static_moe.formats import dequantize_weight  # noqa: E402
from static_moe.integrations.transformers import FAMILIES, StaticMoEBlock, close_moe_blocks, replace_moe_blocks  # noqa: E402
from static_moe.module import StaticMoE  # noqa: E402
from static_moe.testing.distributed import run_ranks  # noqa: E402
from static_moe.testing.numeric import assert_equal, calc_diff  # noqa: E402

H, E, K, V = 256, 8, 2, 128
CAPACITY = 16
COMMON = dict(
    vocab_size=V,
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)


def tiny_config(family: str):
    """A two-layer random config with H = 256, E = 8 experts of I = 128, top-2, every layer sparse."""
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=True,
            head_dim=64,
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_experts=E,
            num_experts_per_tok=K,
            shared_expert_intermediate_size=128,
        )
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},
            intermediate_size=256,
            moe_intermediate_size=128,
            n_routed_experts=E,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=K,
            first_k_dense_replace=0,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=E, num_experts_per_tok=K)
    if family == "olmoe":  # norm_topk_prob False: unnormalised top-k softmax weights
        return tf.OlmoeConfig(**COMMON, intermediate_size=128, num_experts=E, num_experts_per_tok=K)
    raise KeyError(family)


FAMILY_NAMES = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "olmoe"]


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family)).to(torch.bfloat16).eval()
    for m in model.modules():  # DeepSeek's selection bias starts at zero: make it matter
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.05)
    return model


def moe_blocks(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, StaticMoEBlock)}


def dequantized_copy(original, replaced):
    """``original`` with every MoE block's experts (and shared expert) set to the replaced model's dequantized
    static_moe weights: what the static_moe model computes, in the unmodified transformers code."""
    ref = copy.deepcopy(original)
    with torch.no_grad():
        for name, block in moe_blocks(replaced).items():
            moe, hf = block.moe, ref.get_submodule(name)
            hf.experts.gate_up_proj.copy_(dequantize_weight(moe.w13.data, moe.w13_scale))
            hf.experts.down_proj.copy_(dequantize_weight(moe.w2.data, moe.w2_scale))
            if moe.shared is not None:
                shared = getattr(hf, "shared_expert", None) or hf.shared_experts
                w13 = dequantize_weight(moe.shared.w13.data, moe.shared.w13_scale)[0]
                i = w13.shape[0] // 2
                shared.gate_proj.weight.copy_(w13[:i])
                shared.up_proj.weight.copy_(w13[i:])
                shared.down_proj.weight.copy_(dequantize_weight(moe.shared.w2.data, moe.shared.w2_scale)[0])
    return ref


def hidden_like_model(seed: int, shape=(2, 4, H)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_blocks_and_logits_match_transformers(family):
    model = tiny_model(family)
    original = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1))
    replace_moe_blocks(model, capacity=CAPACITY)
    blocks = moe_blocks(model)
    assert len(blocks) == 2
    x = hidden_like_model(2)
    with torch.no_grad():
        for name, block in blocks.items():
            assert block.moe.num_local_experts == E and block.moe.weight_format == "bf16"
            ours, theirs = block(x), original.get_submodule(name)(x)
            assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
            assert calc_diff(ours, theirs) < 1e-4, f"{family} {name}: calc_diff {calc_diff(ours, theirs):.2e}"
        logits, ref = model(ids).logits, original(ids).logits
    assert calc_diff(logits, ref) < 1e-4, f"{family} logits: calc_diff {calc_diff(logits, ref):.2e}"
    assert close_moe_blocks(model) == 2


def _decisive_prompt(model, tokens: int, new: int) -> torch.Tensor:
    """A prompt whose greedy continuation never hinges on a near-tie: at each of the ``new`` steps the best logit
    leads the second by more than 2 bf16 ulps (a tie is ill-posed for greedy equality; its side is noise)."""
    for seed in range(20):
        ids = torch.randint(0, V, (1, tokens), generator=torch.Generator().manual_seed(100 + seed))
        out = model.generate(
            ids,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        top2 = torch.stack(out.scores)[:, 0].float().topk(2, dim=-1).values
        if bool((top2[:, 0] - top2[:, 1] > 2 * 2.0**-7 * top2[:, 0].abs()).all()):
            return ids
    raise AssertionError("no decisive prompt among 20 seeds: the tiny config's logits are too flat")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_greedy_generation_equal(family):
    model = tiny_model(family)
    with torch.no_grad():
        ids = _decisive_prompt(model, 4, 8)
        want = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        replace_moe_blocks(model, capacity=CAPACITY)
        got = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.shape == (1, 12)
    assert torch.equal(got, want), f"{family}: {got.tolist()} != {want.tolist()}"
    close_moe_blocks(model)


@pytest.mark.parametrize(
    "family,wfmt",
    [("qwen2_moe", "fp8"), ("deepseek_v3", "fp4"), ("mixtral", "fp4"), ("qwen3_moe", "fp8"), ("olmoe", "fp8")],
)
def test_quantized_matches_model_with_dequantized_weights(family, wfmt):
    model = tiny_model(family)
    original = copy.deepcopy(model)
    replace_moe_blocks(model, capacity=CAPACITY, weight_format=wfmt)
    ref = dequantized_copy(original, model)
    x = hidden_like_model(3)
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for name, block in moe_blocks(model).items():
            assert block.moe.weight_format == wfmt
            d = calc_diff(block(x), ref.get_submodule(name)(x))
            assert d < 1e-4, f"{family} {wfmt} {name}: calc_diff {d:.2e}"
        d = calc_diff(model(ids).logits, ref(ids).logits)
    assert d < 1e-4, f"{family} {wfmt} logits: calc_diff {d:.2e}"
    # The quantization is real: the unmodified bf16 model differs by more than the tolerance used above.
    with torch.no_grad():
        name, block = next(iter(moe_blocks(model).items()))
        assert calc_diff(block(x), original.get_submodule(name)(x)) > 1e-4
    close_moe_blocks(model)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_compiled_block_fullgraph_bitwise_equal(family):
    model = replace_moe_blocks(tiny_model(family), capacity=CAPACITY, weight_format="fp8", act_format="fp8")
    block = next(iter(moe_blocks(model).values()))
    x = hidden_like_model(5)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    assert_equal(compiled, eager, f"{family} compiled block")
    close_moe_blocks(model)


def test_model_dtype_conversions_keep_formats_and_outputs():
    """model.float() / .half() / .to(bf16) convert the router and the rest, never static_moe's weights or scales;
    the block then takes fp32 / fp16 hidden states and answers in their dtype."""
    model = replace_moe_blocks(tiny_model("qwen2_moe"), capacity=CAPACITY, weight_format="fp4")
    block = next(iter(moe_blocks(model).values()))
    before = {n: (p.dtype, p.detach().clone()) for n, p in block.moe.named_parameters()}
    x = hidden_like_model(6)
    with torch.no_grad():
        want = block(x)
        for convert, dtype in (
            (lambda m: m.float(), torch.float32),
            (lambda m: m.half(), torch.float16),
            (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        ):
            convert(model)
            assert block.gate.weight.dtype == dtype
            for n, p in block.moe.named_parameters():
                assert p.dtype == before[n][0], f"{n} became {p.dtype}"
                assert_equal(p.data, before[n][1], n)
            out = block(x.to(dtype))
            assert out.dtype == dtype
            assert calc_diff(out.float(), want.float()) < 1e-4, dtype
    close_moe_blocks(model)


def test_block_maps_the_no_expert_slot_to_minus_one():
    """An id equal to num_experts (transformers' "no expert here" slot) is skipped like −1; other ids and the router's
    weights reach StaticMoE unchanged."""

    class FixedRouter(torch.nn.Module):
        def __init__(self, ids, weights):
            super().__init__()
            self.ids, self.weights = ids, weights

        def forward(self, x):
            return torch.zeros(x.shape[0], E), self.weights, self.ids

    model = replace_moe_blocks(tiny_model("mixtral"), capacity=CAPACITY)
    moe = next(iter(moe_blocks(model).values())).moe
    ids = torch.tensor([[0, E], [E, 5], [3, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    block = StaticMoEBlock(FixedRouter(ids, weights), moe)
    x = hidden_like_model(7, (3, H))
    with torch.no_grad():
        assert_equal(block(x), moe(x, torch.where(ids == E, -1, ids), weights), "sentinel slots")
    close_moe_blocks(model)


def test_unknown_or_missing_moe_blocks_are_refused():
    model = tiny_model("olmoe")
    only_qwen = tuple(f for f in FAMILIES if f.block == "Qwen3MoeSparseMoeBlock")
    with pytest.raises(TypeError, match=r"unknown MoE block class\(es\): model.layers.0.mlp \(OlmoeSparseMoeBlock\)"):
        replace_moe_blocks(model, capacity=CAPACITY, families=only_qwen)
    assert not moe_blocks(model)  # nothing half-replaced
    with pytest.raises(ValueError, match="has no sparse-MoE block of a known family"):
        replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), capacity=CAPACITY)
    with pytest.raises(ValueError, match="Qwen2MoeSparseMoeBlock has a shared_expert: pass it as shared_expert="):
        StaticMoE.from_module(tiny_model("qwen2_moe").model.layers[0].mlp, top_k=K, capacity=CAPACITY)


# ----------------------------------------------------------------------------------------------------------------
# Expert parallelism: two gloo ranks, each given the full model, keep E/2 experts each
# ----------------------------------------------------------------------------------------------------------------
def _ep_worker(rank: int, size: int, families: list[str]) -> dict:
    import torch.distributed as dist

    diffs = {}
    for family in families:
        model = tiny_model(family)
        original = copy.deepcopy(model)
        full = {
            n: m.experts.gate_up_proj.detach().clone()
            for n, m in model.named_modules()
            if type(m).__name__ in {f.block for f in FAMILIES}
        }
        ids = torch.randint(0, V, (2, 3 + rank), generator=torch.Generator().manual_seed(20 + rank))
        replace_moe_blocks(model, capacity=CAPACITY, ep_group=dist.group.WORLD)
        local = E // size
        for name, block in moe_blocks(model).items():
            assert block.moe.num_local_experts == local and block.moe.expert_offset == rank * local
            assert_equal(block.moe.w13.data, full[name][rank * local : (rank + 1) * local], f"{name} rank {rank}")
        with torch.no_grad():  # the ranks pass different token counts (6 and 8): fine, T ≤ capacity
            diffs[family] = calc_diff(model(ids).logits, original(ids).logits)
        close_moe_blocks(model)
    return diffs


def test_expert_parallel_two_ranks():
    """Qwen2-MoE (gated shared expert) and DeepSeek-V3 (grouped sigmoid router) with S = 2: one spawn for both
    (process start-up and imports dominate the time)."""
    for rank, diffs in enumerate(run_ranks(_ep_worker, 2, ["qwen2_moe", "deepseek_v3"], timeout=120, pg_timeout=30)):
        for family, d in diffs.items():
            assert d < 1e-4, f"rank {rank} {family}: calc_diff {d:.2e}"


def test_replace_moe_blocks_prepares_for_the_target():
    """prepare_for= reaches every new layer (routed and shared experts held K-major); through the reference
    kernels the prepared model's logits are the unprepared model's, bit for bit (a pure permutation on trn3)."""
    from static_moe.testing.backends import cpu_kernels

    model = tiny_model("qwen2_moe")
    prepared = copy.deepcopy(model)
    replace_moe_blocks(model, capacity=CAPACITY, weight_format="fp8", act_format="fp8")
    replace_moe_blocks(prepared, capacity=CAPACITY, weight_format="fp8", act_format="fp8", prepare_for="trn3")
    for block in moe_blocks(prepared).values():
        assert block.moe.weight_layout == "eio" and block.moe.w13.dtype == torch.uint32
        assert block.moe.shared.weight_layout == "eio"
    ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), cpu_kernels("reference"):
        assert_equal(prepared(ids).logits, model(ids).logits, "trn3-prepared vs CPU model logits")
    close_moe_blocks(model)
    close_moe_blocks(prepared)
