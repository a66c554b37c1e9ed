"""Tiny random MoE checkpoints on disk (Qwen3-MoE, gpt-oss, DeepSeek-V3), for end-to-end tests of a serving
engine (vLLM) without a download.

:func:`write_qwen3_moe` writes a Hugging Face model folder: ``config.json`` (``Qwen3MoeForCausalLM``), one
``model.safetensors`` with the hub's per-expert key names (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``
…, as the published Qwen3-MoE checkpoints name them), and a word-level tokenizer built here from a fixed
vocabulary (``tokenizer.json`` + ``tokenizer_config.json``, read by ``PreTrainedTokenizerFast``).

``weights="fp8"`` stores the routed experts' projections as float8_e4m3fn with 128×128 block scales
``weight_scale_inv`` [⌈N/128⌉, K/128] float32 and a ``quantization_config`` (``quant_method: fp8``,
``weight_block_size: [128, 128]``, the DeepSeek-V3 / Qwen3-FP8 form); every other linear layer stays bf16 and is
listed in ``modules_to_not_convert``. The scales are powers of two, so ``q · s`` is exact in bf16:
``weights="fp8-dequantized"`` writes the same model with those products as bf16 expert weights, the reference
an fp8 run is compared with. Two more fp8 forms, each with its "-dequantized" twin: ``"fp8-tensor"``
(``quant_method: fp8`` without blocks, AutoFP8's form: a ``weight_scale`` per expert weight and a static
``input_scale``) and ``"fp8-ct"`` (a compressed-tensors ``quantization_config``: layer 0's experts with a
``weight_scale`` per output channel, layer 1's in 128×128 blocks).

:func:`write_gpt_oss` writes a ``GptOssForCausalLM`` folder the same way, with the hub's gpt-oss key names: the
experts fused per layer (``mlp.experts.gate_up_proj`` with gate / up interleaved, biases), in bf16 or in the
published MXFP4 form (``gate_up_proj_blocks`` / ``_scales``, ``quant_method: mxfp4``), at an H and I (160, 192)
that are multiples of 32 but not of 128, as gpt-oss's 2880 is.

:func:`write_deepseek_v3` writes a ``DeepseekV3ForCausalLM`` folder: MLA attention, a dense first layer, MoE layers
with V3's routing configuration (sigmoid, ``noaux_tc`` correction bias, grouped top-k, routed scaling) and a
shared expert, in bf16 or with fp8 experts as "fp8" above.

:func:`write_qwen3_moe_config` writes only a Qwen3-MoE's config and tokenizer, at any sizes, for vLLM's
``load_format="dummy"`` (random weights vLLM draws itself): bench/bench_vllm_engine.py times real model sizes so.

Needs ``safetensors`` and ``tokenizers`` (both come with transformers).
"""

from __future__ import annotations

import json
import os

import torch

# Sizes: H and the experts' I are multiples of 128 (static_moe's kernels and the fp8 128×128 blocks).
HIDDEN = 128
MOE_INTERMEDIATE = 128
NUM_EXPERTS = 8
TOP_K = 2
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
WORDS = 200  # tokenizer words; the vocabulary adds the special tokens and is padded to a multiple of 64
VOCAB = 256
SPECIAL = ("<pad>", "<unk>", "<eos>")


def _words() -> list[str]:
    return [f"w{i}" for i in range(WORDS)]


def _shared_config() -> dict:
    """What both tiny models' configs hold alike: the vocabulary and special ids of the one tokenizer
    (_write_tokenizer), the attention's shape and depth, the length, the dtype."""
    return {
        "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": SPECIAL.index("<eos>"),
        "pad_token_id": SPECIAL.index("<pad>"),
    }


def _config(weights: str, layers: int = LAYERS) -> dict:
    """The Qwen3-MoE's config.json; ``layers``: how many layers the fp8 forms' lists of unquantized modules name."""
    cfg = _shared_config() | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
    }
    skip = ["lm_head"]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        skip += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [f"{p}.mlp.gate"]
    if weights == "fp8":
        cfg["quantization_config"] = _fp8_quantization(skip)
    elif weights == "fp8-tensor":  # AutoFP8's form: one scale per weight, static activation scales
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "modules_to_not_convert": skip,
        }
    elif weights == "fp8-ct":
        cfg["quantization_config"] = _compressed_tensors_fp8()
    return cfg


def _compressed_tensors_fp8() -> dict:
    """A compressed-tensors ``quantization_config`` (llm-compressor's float-quantized form) with the experts of
    layer 0 in its FP8_DYNAMIC scheme (a scale per output channel, activations per token, dynamic) and those of
    layer 1 in FP8_BLOCK (128×128 weight blocks, activations per group of 128, dynamic); nothing else quantized."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}

    def experts(layer: int) -> list[str]:
        return [f"re:.*layers\\.{layer}\\.mlp\\.experts\\.\\d+\\..*_proj$"]

    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "channel": {
                "targets": experts(0),
                "weights": weights | {"strategy": "channel"},
                "input_activations": acts | {"strategy": "token"},
            },
            "block": {
                "targets": experts(1),
                "weights": weights | {"strategy": "block", "block_structure": [128, 128]},
                "input_activations": acts | {"strategy": "group", "group_size": 128},
            },
        },
        "ignore": ["lm_head"],
    }


def _fp8_quantization(skip: list[str]) -> dict:
    """DeepSeek-V3's / Qwen3-FP8's ``quantization_config`` (e4m3, 128×128 block scales), ``skip`` left bf16."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": skip,
    }


def block_fp8(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float32 → (float8_e4m3fn [..., N, K], power-of-two scales float32 [..., N/128, K/128]), a
    checkpoint's 128×128 block form with q · s ≈ w (:func:`fp8_scaled`: random powers of two, so neighbouring
    blocks' scales mostly differ)."""
    return fp8_scaled(w, g, (128, 128))


def _embeddings(rnd, h: int) -> dict[str, torch.Tensor]:
    """The token embedding, final norm and LM head of a model of hidden size h, drawn by ``rnd`` in this order."""
    return {
        "model.embed_tokens.weight": rnd(VOCAB, h, std=1.0),
        "model.norm.weight": 1 + rnd(h, std=0.1),
        "lm_head.weight": rnd(VOCAB, h, std=0.5),
    }


def _layer_norms(rnd, p: str, h: int) -> dict[str, torch.Tensor]:
    """Layer ``p``'s two RMSNorm weights, drawn by ``rnd`` in this order."""
    return {
        f"{p}.input_layernorm.weight": 1 + rnd(h, std=0.1),
        f"{p}.post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
    }


def _tensors(weights: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g) * std

    t = _embeddings(rnd, HIDDEN)
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        t |= _layer_norms(rnd, p, HIDDEN)
        t[f"{p}.self_attn.q_proj.weight"] = rnd(q_dim, HIDDEN, std=HIDDEN**-0.5)
        t[f"{p}.self_attn.k_proj.weight"] = rnd(kv_dim, HIDDEN, std=HIDDEN**-0.5)
        t[f"{p}.self_attn.v_proj.weight"] = rnd(kv_dim, HIDDEN, std=HIDDEN**-0.5)
        t[f"{p}.self_attn.o_proj.weight"] = rnd(HIDDEN, q_dim, std=q_dim**-0.5)
        t[f"{p}.self_attn.q_norm.weight"] = 1 + rnd(HEAD_DIM, std=0.1)
        t[f"{p}.self_attn.k_norm.weight"] = 1 + rnd(HEAD_DIM, std=0.1)
        t[f"{p}.mlp.gate.weight"] = rnd(NUM_EXPERTS, HIDDEN, std=1.0)
        for e in range(NUM_EXPERTS):
            form = weights
            if weights.startswith("fp8-ct"):  # layer 0 per channel, layer 1 in blocks (_compressed_tensors_fp8)
                form = weights.replace("fp8-ct", "fp8-channel" if layer == 0 else "fp8-ct-block")
            t |= _gated_mlp(rnd, g, f"{p}.mlp.experts.{e}", HIDDEN, MOE_INTERMEDIATE, form)
    return _stored(t, torch.float16 if weights == "fp16" else torch.bfloat16)


def _gated_mlp(rnd, g, p: str, h: int, i: int, weights: str = "bf16") -> dict[str, torch.Tensor]:
    """One gated MLP's ``{p}.gate_proj`` / ``up_proj`` [i, h] and ``down_proj`` [h, i] weights (the hub's per-expert
    names), drawn by ``rnd`` in this order, stored as ``weights`` says, each fp8 form's power-of-two scales drawn by
    ``g`` after each weight (:func:`fp8_scaled`): "fp8" e4m3 with 128×128 block scales ``weight_scale_inv``;
    "fp8-ct-block" the same under compressed-tensors' name ``weight_scale``; "fp8-tensor" e4m3 with one
    ``weight_scale`` [] and a static activation scale ``input_scale`` []; "fp8-channel" e4m3 with a ``weight_scale``
    [N, 1] per output row; "<form>-dequantized" each form's exact bf16 values q · s; anything else as drawn."""
    form = weights.removesuffix("-dequantized")
    t = {}
    for name, shape, fan_in in (("gate_proj", (i, h), h), ("up_proj", (i, h), h), ("down_proj", (h, i), i)):
        w = rnd(*shape, std=2.0 * fan_in**-0.5)
        if form in FP8_FORMS:
            q, s = fp8_scaled(w, g, FP8_FORMS[form])
            if form == weights:
                t[f"{p}.{name}.weight"] = q
                t[f"{p}.{name}.{'weight_scale_inv' if form == 'fp8' else 'weight_scale'}"] = s
                if form == "fp8-tensor":
                    t[f"{p}.{name}.input_scale"] = torch.tensor(2.0**-6)
                continue
            w = q.float() * _expanded(s, w.shape)
        t[f"{p}.{name}.weight"] = w
    return t


# The fp8 forms of _gated_mlp, each with the shape of its scales' block (rows, columns; 0: the whole extent).
FP8_FORMS = {"fp8": (128, 128), "fp8-ct-block": (128, 128), "fp8-tensor": (0, 0), "fp8-channel": (1, 0)}


def fp8_scaled(w: torch.Tensor, g: torch.Generator, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float32 → (float8_e4m3fn [..., N, K], power-of-two scales float32) with q · s ≈ w, one scale
    per ``block`` (rows, columns; 0 for the whole extent): (128, 128) [..., N/128, K/128]; (1, 0) [..., N, 1] (per
    output channel); (0, 0) [...] (per tensor). Each scale is a random power of two (2^-9 … 2^-6, drawn by ``g``),
    so the dequantized values are exact in bf16."""
    *lead, n, k = w.shape
    s = torch.exp2(torch.randint(-9, -5, (*lead, n // (block[0] or n), k // (block[1] or k)), generator=g).float())
    q = (w / _expanded(s, w.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s.reshape(lead) if block == (0, 0) else s


def _expanded(s: torch.Tensor, shape) -> torch.Tensor:
    """Scales ``s`` ([..., N/bn, K/bk], or [...] for one per tensor) repeated over the weight ``shape``
    [..., N, K] they scale."""
    s = s.reshape(*shape[:-2], 1, 1) if s.dim() == len(shape) - 2 else s
    return s.repeat_interleave(shape[-2] // s.shape[-2], -2).repeat_interleave(shape[-1] // s.shape[-1], -1)


def _stored(t: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors as written: e4m3 weights and float32 scales and correction biases as they are, the rest ``dtype``."""
    return {
        k: (v if v.dtype == torch.float8_e4m3fn or k.endswith(_FLOAT32) else v.to(dtype)).contiguous()
        for k, v in t.items()
    }


# stored float32, as the published checkpoints store them
_FLOAT32 = ("_scale_inv", "weight_scale", "input_scale", "e_score_correction_bias")


def _write_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(_words()))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "eos_token": "<eos>",
                "model_max_length": 512,
            },
            f,
        )


def write_qwen3_moe(folder: str, *, weights: str = "bf16", seed: int = 0) -> str:
    """Write the tiny model into ``folder`` (created); returns ``folder``.

    ``weights``: "bf16"; "fp16" (every weight float16, ``torch_dtype`` float16); "fp8" (routed experts fp8 with
    128×128 power-of-two block scales, the rest bf16); "fp8-tensor" (``quant_method: fp8`` without blocks, AutoFP8's
    form: a power-of-two scale per expert weight and a static activation scale); "fp8-ct" (compressed-tensors:
    layer 0's experts with a scale per output channel, layer 1's in 128×128 blocks); each fp8 form with
    "-dequantized" (the same model, its experts' ``q · s`` stored as bf16, exact). The same ``seed`` gives the same
    model for a form and its dequantization."""
    forms = ("bf16", "fp16", "fp8", "fp8-tensor", "fp8-ct")
    if weights.removesuffix("-dequantized") not in forms or weights in ("bf16-dequantized", "fp16-dequantized"):
        raise ValueError(f"weights must be one of {forms}, an fp8 one with '-dequantized', got {weights!r}")
    cfg = _config(weights)
    if weights == "fp16":
        cfg["torch_dtype"] = "float16"
    return _write(folder, cfg, _tensors(weights, seed))


def write_qwen3_moe_config(folder: str, *, weights: str = "bf16", **sizes: int) -> str:
    """A Qwen3-MoE folder without weights: only ``config.json`` and the tokenizer, in ``folder`` (created); returns
    ``folder``. vLLM starts it with ``load_format="dummy"``, drawing every weight itself (uniform in ±1e-3), so a
    model's real sizes can be timed without writing GBs. ``sizes`` replace the tiny model's config entries
    (``hidden_size``, ``moe_intermediate_size``, ``num_experts``, ``num_experts_per_tok``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` ≥ the
    tokenizer's 256); ``weights`` "bf16" or "fp8" (:func:`write_qwen3_moe`'s fp8 form: the routed experts in
    128×128 blocks, every other linear layer bf16)."""
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"weights must be 'bf16' or 'fp8', got {weights!r}")
    unknown = set(sizes) - set(_config("bf16"))
    if unknown:
        raise ValueError(f"not config entries of the Qwen3-MoE: {sorted(unknown)}")
    return _write(folder, _config(weights, sizes.get("num_hidden_layers", LAYERS)) | sizes)


# gpt-oss: one sliding-window and one full-attention layer, biased attention with sinks, a biased router and
# biased experts whose gate_up rows interleave gate and up (even / odd), SwiGLU-OAI (alpha 1.702, limit 7). Its H
# and I are multiples of 32 (the MX block), not of 128, as gpt-oss's 2880 is not.
GPT_OSS_HIDDEN = 160
GPT_OSS_INTERMEDIATE = 192  # 96 per rank under two tensor-parallel ranks: vLLM's vec kernel needs I / tp % 32 == 0
GPT_OSS_EXPERTS = 8
GPT_OSS_TOP_K = 2


def _gpt_oss_config(weights: str) -> dict:
    cfg = _shared_config() | {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": GPT_OSS_HIDDEN,
        "intermediate_size": GPT_OSS_INTERMEDIATE,
        "num_local_experts": GPT_OSS_EXPERTS,
        "num_experts_per_tok": GPT_OSS_TOP_K,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"][:LAYERS],
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        "attention_bias": True,
    }
    if weights == "mxfp4":
        skip = ["lm_head", "model.embed_tokens"]
        for layer in range(LAYERS):
            skip += [f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp.router"]
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": skip}
    return cfg


def _gpt_oss_tensors(weights: str, seed: int) -> dict[str, torch.Tensor]:
    from ..formats import dequantize_weight_fp4, quantize_weight_fp4

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g) * std

    h, i, e = GPT_OSS_HIDDEN, GPT_OSS_INTERMEDIATE, GPT_OSS_EXPERTS
    t = _embeddings(rnd, h)
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        t |= _layer_norms(rnd, p, h)
        for name, (n, k) in (
            ("q_proj", (q_dim, h)),
            ("k_proj", (kv_dim, h)),
            ("v_proj", (kv_dim, h)),
            ("o_proj", (h, q_dim)),
        ):
            t[f"{p}.self_attn.{name}.weight"] = rnd(n, k, std=k**-0.5)
            t[f"{p}.self_attn.{name}.bias"] = rnd(n, std=0.02)
        t[f"{p}.self_attn.sinks"] = rnd(HEADS, std=1.0)
        t[f"{p}.mlp.router.weight"] = rnd(e, h, std=1.0)
        t[f"{p}.mlp.router.bias"] = rnd(e, std=0.1)
        pe = f"{p}.mlp.experts"
        # [E, N, K] per projection, N the output (gate_up: rows 2j gate j, 2j + 1 up j); the hub's bf16 form stores
        # them transposed ([E, K, N]), the MXFP4 form as blocks [E, N, K/32, 16] and E8M0 scales [E, N, K/32].
        for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            w = rnd(e, n, k, std=k**-0.5)
            bias = rnd(e, n, std=0.05)
            if weights in ("mxfp4", "mxfp4-dequantized"):
                q, s = quantize_weight_fp4(w)
                if weights == "mxfp4":
                    t[f"{pe}.{name}_blocks"] = q.reshape(e, n, k // 32, 16)
                    t[f"{pe}.{name}_scales"] = s
                    t[f"{pe}.{name}_bias"] = bias
                    continue
                w = dequantize_weight_fp4(q, s)  # e2m1 · 2^e: exact in bf16
            t[f"{pe}.{name}"] = w.transpose(1, 2)
            t[f"{pe}.{name}_bias"] = bias
    return {k: (v if v.dtype == torch.uint8 else v.to(torch.bfloat16)).contiguous() for k, v in t.items()}


def write_gpt_oss(folder: str, *, weights: str = "bf16", seed: int = 0) -> str:
    """Write a tiny random gpt-oss (``GptOssForCausalLM``) into ``folder`` (created); returns ``folder``.

    ``weights``: "bf16" (the hub's bf16 form: ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate / up interleaved
    along 2I, ``down_proj`` [E, I, H], biases ``gate_up_proj_bias`` [E, 2I] / ``down_proj_bias`` [E, H]); "mxfp4"
    (the published checkpoints' form: ``gate_up_proj_blocks`` [E, 2I, H/32, 16] uint8, two e2m1 per byte, low
    nibble first, ``gate_up_proj_scales`` [E, 2I, H/32] E8M0 bytes, and ``quantization_config`` ``mxfp4``);
    "mxfp4-dequantized" (the "mxfp4" model with its experts' values stored as bf16: exact). The same ``seed``
    gives the same model for every ``weights``."""
    if weights not in ("bf16", "mxfp4", "mxfp4-dequantized"):
        raise ValueError(f"weights must be 'bf16', 'mxfp4' or 'mxfp4-dequantized', got {weights!r}")
    return _write(folder, _gpt_oss_config(weights), _gpt_oss_tensors(weights, seed))


# DeepSeek-V3: multi-head latent attention (vLLM's CPU MLA kernel takes only V3's latent width, kv_lora_rank 512 +
# rope 64), a dense first layer, then MoE layers routed as V3 routes (sigmoid scores, a correction bias for the
# choice only, the top 2 of 4 expert groups, renormalised, scaled by routed_scaling_factor) with one shared expert.
DEEPSEEK_LAYERS = 3  # the first dense (first_k_dense_replace), two MoE layers
DEEPSEEK_EXPERTS = 8
DEEPSEEK_TOP_K = 2
DEEPSEEK_GROUPS, DEEPSEEK_TOPK_GROUPS = 4, 2
DEEPSEEK_MLA = {
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
}
_DEEPSEEK_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _deepseek_v3_config(weights: str) -> dict:
    cfg = (
        _shared_config()
        | DEEPSEEK_MLA
        | {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_hidden_layers": DEEPSEEK_LAYERS,
            "num_key_value_heads": HEADS,
            "head_dim": DEEPSEEK_MLA["qk_rope_head_dim"],
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "moe_intermediate_size": MOE_INTERMEDIATE,
            "n_routed_experts": DEEPSEEK_EXPERTS,
            "n_shared_experts": 1,
            "num_experts_per_tok": DEEPSEEK_TOP_K,
            "n_group": DEEPSEEK_GROUPS,
            "topk_group": DEEPSEEK_TOPK_GROUPS,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
        }
    )
    if weights == "fp8":  # the routed experts only; everything else stays bf16
        skip = ["lm_head"]
        for layer in range(DEEPSEEK_LAYERS):
            p = f"model.layers.{layer}"
            skip += [f"{p}.self_attn.{n}" for n in _DEEPSEEK_ATTENTION]
            mlp = f"{p}.mlp" if layer == 0 else f"{p}.mlp.shared_experts"  # the dense MLP, or the shared expert
            skip += [f"{mlp}.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
            skip += [f"{p}.mlp.gate"] if layer else []
        cfg["quantization_config"] = _fp8_quantization(skip)
    return cfg


def _deepseek_v3_tensors(weights: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g) * std

    h, m = HIDDEN, DEEPSEEK_MLA
    qk_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    t = _embeddings(rnd, h)
    for layer in range(DEEPSEEK_LAYERS):
        p = f"model.layers.{layer}"
        t |= _layer_norms(rnd, p, h)
        a = f"{p}.self_attn"
        t[f"{a}.q_a_proj.weight"] = rnd(m["q_lora_rank"], h, std=h**-0.5)
        t[f"{a}.q_a_layernorm.weight"] = 1 + rnd(m["q_lora_rank"], std=0.1)
        t[f"{a}.q_b_proj.weight"] = rnd(HEADS * qk_head, m["q_lora_rank"], std=m["q_lora_rank"] ** -0.5)
        t[f"{a}.kv_a_proj_with_mqa.weight"] = rnd(m["kv_lora_rank"] + m["qk_rope_head_dim"], h, std=h**-0.5)
        t[f"{a}.kv_a_layernorm.weight"] = 1 + rnd(m["kv_lora_rank"], std=0.1)
        kv_b = HEADS * (m["qk_nope_head_dim"] + m["v_head_dim"])
        t[f"{a}.kv_b_proj.weight"] = rnd(kv_b, m["kv_lora_rank"], std=m["kv_lora_rank"] ** -0.5)
        t[f"{a}.o_proj.weight"] = rnd(h, HEADS * m["v_head_dim"], std=(HEADS * m["v_head_dim"]) ** -0.5)
        if layer == 0:
            t |= _gated_mlp(rnd, g, f"{p}.mlp", h, 2 * h)
            continue
        t[f"{p}.mlp.gate.weight"] = rnd(DEEPSEEK_EXPERTS, h, std=1.0)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = rnd(DEEPSEEK_EXPERTS, std=0.5)
        for e in range(DEEPSEEK_EXPERTS):
            t |= _gated_mlp(rnd, g, f"{p}.mlp.experts.{e}", h, MOE_INTERMEDIATE, weights)
        t |= _gated_mlp(rnd, g, f"{p}.mlp.shared_experts", h, MOE_INTERMEDIATE)
    return _stored(t, torch.bfloat16)


def write_deepseek_v3(folder: str, *, weights: str = "bf16", seed: int = 0) -> str:
    """Write a tiny random DeepSeek-V3 (``DeepseekV3ForCausalLM``) into ``folder`` (created); returns ``folder``.

    The hub's key names: MLA (``self_attn.q_a_proj`` … ``kv_b_proj``), a dense ``mlp`` in layer 0, then
    ``mlp.gate.weight`` with its float32 ``e_score_correction_bias``, ``mlp.experts.{e}.*_proj`` and
    ``mlp.shared_experts.*_proj``. ``weights``: "bf16"; "fp8" (the routed experts as e4m3 with power-of-two 128×128
    block scales, DeepSeek-V3's ``quantization_config``, the rest bf16); "fp8-dequantized" (the same model with the
    experts' ``q · s`` as bf16: exact). The same ``seed`` gives the same model for every ``weights``."""
    if weights not in ("bf16", "fp8", "fp8-dequantized"):
        raise ValueError(f"weights must be 'bf16', 'fp8' or 'fp8-dequantized', got {weights!r}")
    return _write(folder, _deepseek_v3_config(weights), _deepseek_v3_tensors(weights, seed))


def _write(folder: str, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """A model folder: ``config.json``, one ``model.safetensors`` (none where ``tensors`` is None: a folder for
    vLLM's dummy weights) and the tokenizer; returns ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if tensors is not None:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(folder)
    return folder


def prompts() -> list[str]:
    """A handful of prompts in the tokenizer's vocabulary."""
    w = _words()
    return [" ".join(w[i] for i in idx) for idx in ((1, 2, 3), (10, 20, 30, 40, 50), (7,), (150, 3, 99, 12))]
