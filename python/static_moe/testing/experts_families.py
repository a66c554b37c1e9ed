"""Every transformers family whose experts dispatch through the ExpertsInterface, run with eager experts and with
static_moe: the coverage table of docs/transformers.md.

``families()`` finds the experts classes in the installed transformers (modules whose source names
``@use_experts_implementation``, classes the decorator wrapped); ``tiny_model(family)`` builds a one-family random
model (2 layers, H = I = 128, 4 experts, top-2, vocabulary 128) from the family's own config class with the same
overrides for all; ``run_family(family)`` measures it. ``python -m static_moe.testing.experts_families`` prints
the markdown table. Needs transformers ≥ 5.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..formats import dequantize_weight
from ..integrations.transformers_experts import (
    UnsupportedExperts,
    close_static_moe,
    experts_modules,
    is_experts_class,
    static_moe_layer,
    use_static_moe,
)
from .numeric import calc_diff

VOCAB, PROMPT, STEPS = 128, 6, 4
# calc_diff bound of a match: bf16 static_moe against the eager model, fp8 against the eager model holding the
# dequantized weights (the bound of tests/integrations/test_transformers.py).
TOLERANCE = 1e-4
# The same small shapes for every family; a key is passed only when the family's config has it. Attention and
# MLA sizes keep every projection tiny; first_k_dense_replace / decoder_sparse_step / mlp_only_layers make every
# layer sparse.
OVERRIDES = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=128,
    expert_ffn_hidden_size=128,
    shared_expert_intermediate_size=128,
    ffn_hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_k=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=64,
    initializer_range=0.1,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=48,
    v_head_dim=64,
    n_shared_experts=1,
    num_shared_experts=1,
    zero_expert_num=0,
    num_layers=2,
    mlp_layer_types=["sparse", "sparse"],
    enable_moe_block=True,
    top_k_experts=2,
    num_dense_layers=0,
    num_experts_per_token=2,
    num_expert_group=1,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16,
    mamba_n_heads=4,
    mamba_d_state=16,
    mamba_chunk_size=16,
    linear_num_heads=2,
    linear_head_dim=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=32,
    tie_word_embeddings=False,
    use_cache=False,
)
# What the shared recipe cannot say, per family, and why.
FAMILY_OVERRIDES = {
    # Sparsemixer routes by thresholds on score gaps: a rounding-level difference in one layer's output can flip
    # the next layer's experts, so only a one-layer model compares the experts' arithmetic.
    "phimoe": dict(num_hidden_layers=1),
    # Its mrope sections are fixed for a 128-wide head.
    "glm4v_moe": dict(num_attention_heads=1, head_dim=128),
    "lfm2_moe": dict(layer_types=["full_attention", "full_attention"]),
    # Validators of the family's own config:
    "glm5_next": dict(qk_rope_head_dim=0),  # DSA layers have no RoPE
    "hy_v4_vl": dict(qk_rope_head_dim=64),  # the mrope sections sum to qk_rope_head_dim / 2
    "kolibri1_1": dict(index_num_heads=1),  # at most the query heads of one key head
    "zaya": dict(num_experts_per_tok=1),  # top-1 only
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[128, 128]),  # text and vision experts
    "ergo": dict(num_dense_blocks=0),
    "deepseek_v4": dict(mlp_layer_types=["moe", "moe"]),  # its names for a routed layer
}
# Keyword arguments a family's config takes at construction but does not keep under that name (so the filter on
# the config's own keys above would drop them).
FAMILY_INIT_ONLY = {
    # Its full-attention layers (the last layer is forced to one) default to global_head_dim = 512 with attention
    # scaling 1 on unit-weight RMS-normed q and k: logits up to 512, an almost one-hot softmax that turns one bf16
    # rounding of layer 0's outputs into calc_diff ~2e-4 of the hidden states (the eager model against itself with
    # 2^-9 noise on its experts' outputs), above the 1e-4 a match is measured at. The shared head_dim keeps it
    # resolvable, as for every other family.
    "diffusion_gemma": dict(global_head_dim=OVERRIDES["head_dim"]),
}
# Families whose eager code mixes float32 and bf16 tensors in a bf16 model: compared in float32 (static_moe takes
# bf16 activations, so its outputs are bf16-rounded).
FLOAT32_FAMILIES = {"inkling2", "inkling2_loop"}


@dataclass
class FamilyResult:
    """One family's row: ``status`` "match", "refused" or "skipped"; ``detail`` the calc_diffs or the message."""

    family: str
    experts: str
    status: str
    detail: str
    bf16_diff: float | None = None
    fp8_diff: float | None = None
    fp8_vs_bf16: float | None = None
    tokens_equal: bool | None = None
    # Set where the plain comparison missed TOLERANCE and the eager run's routing was replayed: how many replayed
    # (token, expert) selections the static_moe run's own router had not made (always > 0 when set; run_family).
    routing_flips: int | None = None


def families() -> dict[str, list[type]]:
    """{family (transformers.models subpackage): [experts classes]} of the installed transformers."""
    import transformers.models as models

    root = Path(models.__file__).parent
    out: dict[str, list[type]] = {}
    for info in sorted(pkgutil.iter_modules([str(root)]), key=lambda i: i.name):
        for path in sorted((root / info.name).glob("modeling_*.py")):
            if "@use_experts_implementation" not in path.read_text():
                continue
            mod = importlib.import_module(f"transformers.models.{info.name}.{path.stem}")
            classes = [
                c
                for _, c in inspect.getmembers(mod, inspect.isclass)
                if c.__module__ == mod.__name__ and is_experts_class(c)
            ]
            if classes:
                out.setdefault(info.name, []).extend(classes)
    return out


def _model_class(family: str, experts: type):
    """The family's text causal LM (or, failing that, its text / base model) in the experts' modeling module."""
    from transformers import PreTrainedModel

    mod = importlib.import_module(experts.__module__)
    classes = [
        c
        for _, c in inspect.getmembers(mod, inspect.isclass)
        if c.__module__ == mod.__name__
        and issubclass(c, PreTrainedModel)
        and getattr(c, "config_class", None) is not None
    ]

    def rank(c):
        name = c.__name__
        text = not getattr(c.config_class, "sub_configs", None)
        return (
            not text,
            not name.endswith("ForCausalLM"),
            not name.endswith("TextModel"),
            not name.endswith("Model"),
            name,
        )

    candidates = sorted((c for c in classes if c.__name__.endswith(("ForCausalLM", "Model"))), key=rank)
    if not candidates:
        raise LookupError(f"no model class in {mod.__name__}")
    return candidates[0]


def tiny_model(family: str, experts: type, seed: int = 0):
    """(model in bf16 eval mode with eager experts, has_lm_head)."""
    cls = _model_class(family, experts)
    cfg_cls = cls.config_class
    known = cfg_cls().to_dict()
    overrides = dict(OVERRIDES)
    if "kv_lora_rank" in known:  # multi-head latent attention: head sizes come from the MLA dims
        if known.get("head_dim") == known.get("qk_rope_head_dim"):  # head_dim names the RoPE part
            overrides["head_dim"] = overrides["qk_rope_head_dim"]
        else:
            overrides.pop("head_dim")
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    overrides.update(FAMILY_OVERRIDES.get(family, {}))
    cfg = cfg_cls(**{k: v for k, v in overrides.items() if k in known}, **FAMILY_INIT_ONLY.get(family, {}))
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    dtype = torch.float32 if family in FLOAT32_FAMILIES else torch.bfloat16
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        for m in model.modules():  # selection biases start at zero: make them matter
            if hasattr(m, "e_score_correction_bias") and isinstance(m.e_score_correction_bias, torch.Tensor):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.05)
            if is_experts_class(type(m)):  # the families' init may leave the experts at zero or at std 0.02
                for t in m.parameters(recurse=False):
                    if t.dim() == 3:
                        t.normal_(0, 0.1)
    return model, cls.__name__.endswith("ForCausalLM")


def _outputs(model, ids, lm: bool) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False)
    return (out.logits if lm else out.last_hidden_state).float()


def _greedy(model, ids, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy continuation by full recomputation (no cache), and each step's top-1 − top-2 logit margin."""
    margins = []
    for _ in range(steps):
        last = _outputs(model, ids, True)[:, -1]
        top2 = last.topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min() / top2[:, 0].abs().max().clamp_min(1e-30)))
        ids = torch.cat((ids, last.argmax(-1, keepdim=True)), dim=1)
    return ids, margins


def _routing_of(args: tuple, kwargs: dict) -> list:
    """[top_k_index, top_k_weights] of an experts call: the ExpertsInterface signature (hidden_states,
    top_k_index, top_k_weights), positional or by keyword."""
    names = ("top_k_index", "top_k_weights")
    return [args[1 + i] if len(args) > 1 + i else kwargs[n] for i, n in enumerate(names)]


def _outputs_with_routing(model, ids, lm: bool, replay: list | None = None):
    """``_outputs`` with a pre-hook on every experts module.

    ``replay`` None: returns (outputs, routing), routing the list of each experts call's (top_k_index,
    top_k_weights), in call order. Else replay is such a list (of the same model on the same ids): each call's
    routing is replaced by replay's, and (outputs, flips) is returned, flips the number of replayed (token, expert)
    selections the run's own router did not make (per token as sets: transformers' routers may return them
    unsorted)."""
    calls: list = []
    flips = 0

    def hook(module, args, kwargs):
        nonlocal flips
        idx, w = _routing_of(args, kwargs)
        if replay is None:
            calls.append((idx.clone(), w.clone()))
            return None
        want_idx, want_w = replay[len(calls)]
        calls.append(None)
        flips += int((want_idx[..., :, None] != idx[..., None, :]).all(-1).sum())  # replayed ids the run lacks
        args, kwargs = list(args), dict(kwargs)
        for i, (name, value) in enumerate((("top_k_index", want_idx), ("top_k_weights", want_w))):
            if len(args) > 1 + i:
                args[1 + i] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in experts_modules(model)]
    try:
        out = _outputs(model, ids, lm)
    finally:
        for h in handles:
            h.remove()
    if replay is not None and len(calls) != len(replay):
        raise RuntimeError(f"routing replay: {len(calls)} experts calls against {len(replay)} recorded")
    return out, (calls if replay is None else flips)


def rounding_sensitivity(model, ids, lm: bool, seed: int = 5) -> float:
    """calc_diff between the model's outputs and the same model's with each experts module's output multiplied by
    (1 + 2^-9·N(0, 1)), one bf16 rounding's size: how far rounding noise in the experts alone moves this model,
    the floor under any comparison of two correct implementations that round differently."""
    g = torch.Generator().manual_seed(seed)

    def noisy(module, args, out):
        return out * (1 + 2.0**-9 * torch.randn(out.shape, generator=g)).to(out.dtype)

    with torch.no_grad():
        clean = _outputs(model, ids, lm)
        hooks = [m.register_forward_hook(noisy) for _, m in experts_modules(model)]
        try:
            return calc_diff(_outputs(model, ids, lm), clean)
        finally:
            for h in hooks:
                h.remove()


def dequantized_copy(model):
    """A deep copy of ``model`` (converted with use_static_moe) whose experts hold static_moe's dequantized weights,
    in each class's own layout, and run eagerly: what static_moe computes, in transformers' code."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for (_, m), (_, r) in zip(experts_modules(model), experts_modules(ref)):
            w = static_moe_layer(m).expert_weights()
            gu = dequantize_weight(w["w13"], w["w13_scale"]).to(r.gate_up_proj.dtype)
            d = dequantize_weight(w["w2"], w["w2_scale"]).to(r.down_proj.dtype)
            if not getattr(r, "is_concatenated", True):
                i = gu.shape[1] // 2
                gu = torch.stack((gu[:, :i], gu[:, i:]), dim=2).reshape(gu.shape)
            if getattr(r, "is_transposed", False):
                gu, d = gu.transpose(1, 2), d.transpose(1, 2)
            r.gate_up_proj.copy_(gu)
            r.down_proj.copy_(d)
    _set_eager(ref)
    return ref


def _set_eager(model) -> None:
    model.set_experts_implementation("eager")
    for _, m in experts_modules(model):
        m.config._experts_implementation_internal = "eager"


def run_family(family: str, experts: list[type], *, fp8: bool = True) -> FamilyResult:
    """Build the family's tiny model; run it eagerly and through use_static_moe (bf16, then fp8 weights)."""
    names = ", ".join(c.__name__ for c in experts)
    try:
        model, lm = tiny_model(family, experts[0])
    except Exception as e:  # a config this generic recipe cannot build: reported, not hidden
        return FamilyResult(
            family, names, "skipped", f"tiny config not buildable: {type(e).__name__}: {str(e).splitlines()[0][:400]}"
        )
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            ref, routing = _outputs_with_routing(model, ids, lm)
            want, margins = _greedy(model, ids, STEPS) if lm else (None, [])
    except Exception as e:
        return FamilyResult(
            family,
            names,
            "skipped",
            f"tiny model does not run eagerly: {type(e).__name__}: {str(e).splitlines()[0][:400]}",
        )
    if not experts_modules(model):
        return FamilyResult(
            family, names, "skipped", f"{type(model).__name__} builds no experts module with these overrides"
        )
    try:
        use_static_moe(model)
    except UnsupportedExperts as e:
        return FamilyResult(family, names, "refused", str(e))
    try:
        with torch.no_grad():
            got = _outputs(model, ids, lm)
            bf16 = calc_diff(got, ref)
            flips = plain = None
            if bf16 >= TOLERANCE:
                # A top-k near-tie in the tiny model's router flips with one bf16 rounding of an earlier layer's
                # experts (the eager model against itself with 2^-9 noise on its experts' outputs moves as far),
                # and the host's own bf16 matmuls decide which side the eager run lands on. Routing is the
                # model's, not static_moe's: the eager run's ids and weights are replayed, and the replay counts
                # only where a selection really flipped, so a miss with no flip stays a miss.
                got_replayed, n = _outputs_with_routing(model, ids, lm, routing)
                if n:
                    flips, plain, bf16 = n, bf16, calc_diff(got_replayed, ref)
            equal = None
            if lm:
                seq, _ = _greedy(model, ids, STEPS)
                # Compared up to the first near-tie of the eager run (a tie's side is rounding noise).
                decisive = next((i for i, m in enumerate(margins) if m <= 2 * 2.0**-7), STEPS)
                equal = bool(torch.equal(seq[:, : PROMPT + decisive], want[:, : PROMPT + decisive]))
            fp8_diff = fp8_vs_bf16 = None
            if fp8:
                use_static_moe(model, weight_format="fp8")
                got8 = _outputs(model, ids, lm)
                reference = dequantized_copy(model)
                fp8_diff = calc_diff(got8, _outputs(reference, ids, lm))
                fp8_vs_bf16 = calc_diff(got8, ref)
    finally:
        close_static_moe(model)
    detail = f"calc_diff {bf16:.1e}" + (f", fp8 {fp8_diff:.1e} (vs bf16 model {fp8_vs_bf16:.1e})" if fp8 else "")
    if flips:
        detail += f"; eager routing replayed: {flips} top-k selection(s) had flipped ({plain:.1e} without)"
    within = bf16 < TOLERANCE and equal is not False and (fp8_diff is None or fp8_diff < TOLERANCE)
    status = "match" if within else "mismatch"
    return FamilyResult(family, names, status, detail, bf16, fp8_diff, fp8_vs_bf16, equal, flips)


def _number(v: float | None) -> str:
    return "—" if v is None else f"{v:.1e}"


def markdown_table(results: list[FamilyResult]) -> str:
    rows = [
        "| family | experts class | result | bf16 calc_diff | greedy tokens | fp8 vs dequantized | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tokens = "—" if r.tokens_equal is None else ("equal" if r.tokens_equal else "DIFFER")
        detail = (
            ""
            if r.status == "match" and not r.routing_flips
            else re.sub(r" \(in [^)]*\)", "", r.detail).replace("|", "\\|")
        )
        rows.append(
            f"| {r.family} | `{r.experts}` | {r.status} | {_number(r.bf16_diff)} | {tokens} | "
            f"{_number(r.fp8_diff)} | {detail} |"
        )
    return "\n".join(rows)


def main() -> None:
    torch.set_num_threads(1)
    results = [run_family(f, cs) for f, cs in families().items()]
    print(markdown_table(results))


if __name__ == "__main__":
    main()
