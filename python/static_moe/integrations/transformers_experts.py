"""static_moe as a transformers experts implementation: ``experts_implementation="static_moe"``.

transformers 5.x routes the forward of every experts class decorated with ``@use_experts_implementation``
through ``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]``: the function gets the experts module and
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` and returns [T, H] in the hidden states'
dtype. Everything around the experts — the router, shared experts, norms, zero experts, the combine rule — stays
the model's own code. Importing this module (``static_moe.integrations.transformers`` does) registers
:data:`EXPERTS_IMPLEMENTATION` there.

Two ways in:

* ``use_static_moe(model, weight_format=..., act_format=..., capacity=...)`` checks every experts module of the
  model, converts each one's weights once into a :class:`StaticMoE` and switches the model to "static_moe". A
  variant the kernels do not compute raises :class:`UnsupportedExperts` here, before anything is converted.
  With ``ep_group=group`` (collective) each rank converts and keeps only its E/S experts and each call splits the
  tokens over the ranks (docs/transformers.md, "Expert parallelism through the experts interface").
* ``from_pretrained(..., experts_implementation="static_moe")`` or ``model.set_experts_implementation(
  "static_moe")``: bf16 weights and activations; transformers offers no per-module hook when the implementation
  is chosen, so each experts module is checked and converted at its first call (the refusal comes then).

The converted layer is cached on the experts module (outside its parameters and state dict) and rebuilt only
when the module's weights are replaced or modified in place; :func:`close_static_moe` gives the layers back.
docs/transformers.md lists which families match and which are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from .. import workspace as _workspace
from ..activations import DEFAULT_ALPHA, gated
from ..loaders.collective import collectively
from ..module import StaticMoE, ep_group_info

try:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
except ImportError as e:  # pragma: no cover - exercised only without the extra or with transformers 4.x
    raise ImportError(
        "static_moe.integrations.transformers needs transformers>=5: pip install 'static_moe[transformers]'"
    ) from e

EXPERTS_IMPLEMENTATION = "static_moe"
# Rows per StaticMoE call when use_static_moe is not given a capacity: larger calls (a prefill) run in chunks.
DEFAULT_CAPACITY = 128

# The per-module state lives in the experts module's __dict__ (an _ExpertsState), so it is neither a submodule nor
# a parameter: the model's state dict, save_pretrained and .to(dtype) never see it.
_STATE = "_static_moe_state"
# Module attributes that may hold the clamp of a clamped SwiGLU (DeepSeek-V4 ``limit``, GLM / HunYuan
# ``swiglu_limit``).
_LIMIT_ATTRS = ("limit", "swiglu_limit")
# Module attributes that may hold the alpha of gpt-oss's GLU (gpt-oss ``alpha``, MiniMax-M3 ``swiglu_alpha``).
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")
_BIAS_ATTRS = ("gate_up_proj_bias", "down_proj_bias")


class UnsupportedExperts(ValueError):
    """An experts module whose computation static_moe's kernels do not implement; the message names its class
    and the variant."""


@dataclass(frozen=True)
class ExpertsOptions:
    """How an experts module is converted: the formats (SPEC §1.2 pairs), the rows per call and the options
    passed on to :class:`StaticMoE` (act_group, fp8_max, device, prepare_for, ...)."""

    weight_format: str = "bf16"
    act_format: str = "bf16"
    capacity: int | None = None
    options: dict = field(default_factory=dict)
    # The EP process group (None: one rank). Not compared: two groups of the same ranks are the same options.
    ep_group: object = field(default=None, compare=False)


class _ExpertsState:
    """One experts module's options, converted layer and the key of the weights it was converted from.

    A deep copy or a pickle keeps the options and drops the layer (its workspace lease is this module's own): the
    copy converts its own weights at its first call."""

    def __init__(self, options: ExpertsOptions | None = None):
        self.options = options or ExpertsOptions()
        self.layer: StaticMoE | None = None
        self.source: tuple | None = None
        # With an EP group: the model's experts count E, recorded before this rank's slice is all the module holds.
        self.num_experts: int | None = None

    def close(self) -> bool:
        layer, self.layer, self.source = self.layer, None, None
        if layer is not None and not layer.closed:
            layer.close()
            return True
        return False

    def __deepcopy__(self, memo):
        copy = _ExpertsState(self.options)
        copy.num_experts = self.num_experts
        return copy

    def __getstate__(self):
        # A process group cannot be pickled: the copy runs on one rank.
        opts = self.options
        if opts.ep_group is not None:
            opts = ExpertsOptions(opts.weight_format, opts.act_format, opts.capacity, dict(opts.options))
        return {"options": opts, "layer": None, "source": None}


def _state(module) -> _ExpertsState:
    state = module.__dict__.get(_STATE)
    if state is None:
        state = module.__dict__[_STATE] = _ExpertsState()
    return state


def is_experts_class(cls: type) -> bool:
    """True for a class decorated with ``@use_experts_implementation``, or a subclass of one (whose own forward may
    call the decorated one): a class of its MRO defines the decorator's dispatching wrapper (from
    transformers.integrations.moe) as its forward."""
    wrapper_file = use_experts_implementation.__code__.co_filename
    for klass in getattr(cls, "__mro__", ()):
        forward = klass.__dict__.get("forward")
        code = getattr(forward, "__code__", None)
        if getattr(forward, "__wrapped__", None) is not None and code is not None and code.co_filename == wrapper_file:
            return True
    return False


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of ``model`` that dispatches through the ExpertsInterface."""
    return [(name, m) for name, m in model.named_modules() if is_experts_class(type(m))]


# ----------------------------------------------------------------------------------------------------------------
# Which experts the kernels compute
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertsVariant:
    """What an experts module computes, in the kernels' terms (SPEC §1.9): the gated activation, its alpha, the
    clamp (None: none) and whether the projections carry biases."""

    activation: str = "silu"
    alpha: float = DEFAULT_ALPHA
    swiglu_limit: float | None = None
    biases: bool = False


def _clamped_gate(gate: torch.Tensor, up: torch.Tensor, limit: float | None, activation: str, alpha: float):
    """The kernels' activation (SPEC §1.4 clamp, then §1.9 ``activation``) in float32, unweighted."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gated(gate, up, activation, alpha)


def _number_attrs(module, attrs) -> list[float]:
    out = []
    for attr in attrs:
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and float(v) not in out:
            out.append(float(v))
    return out


def _limit_candidates(module) -> list[float]:
    return _number_attrs(module, _LIMIT_ATTRS)


def _gate_variant(module, inter: int, concatenated: bool) -> tuple[ExpertsVariant | None, str]:
    """Which kernel activation ``module._apply_gate`` is: (variant without biases, "") or (None, why not).

    The gate is probed, not read: gate and up values spanning ±4·max(L, 8) for every candidate limit L (the
    module's ``limit`` / ``swiglu_limit``, and none), packed in the module's own layout (concatenated halves or
    interleaved columns), in float32. It matches when its output equals one of the kernels' activations (SiLU,
    gpt-oss's swiglu_oai with the module's ``alpha`` / ``swiglu_alpha``, GELU-tanh; SPEC §1.9) with one candidate
    clamp to float32 rounding — so a clamp after the activation (Step-3.7, Ling), a softcap or another activation
    is refused, whatever the code looks like."""
    limits = _limit_candidates(module)
    span = 4.0 * max([8.0, *limits])
    rows = 16
    g = torch.linspace(-span, span, rows * inter, dtype=torch.float32).reshape(rows, inter)
    u = g.flatten()[torch.randperm(rows * inter, generator=torch.Generator().manual_seed(0))].reshape(rows, inter)
    packed = torch.cat((g, u), dim=1) if concatenated else torch.stack((g, u), dim=2).reshape(rows, 2 * inter)
    device = _experts_weights(module)[0].device
    try:
        with torch.no_grad():
            got = module._apply_gate(packed.to(device)).float().cpu()
    except Exception as e:  # any failure of a foreign gate on the probe means: not recognised
        return None, f"it fails on a float32 probe ({type(e).__name__}: {e})"
    if tuple(got.shape) != (rows, inter):
        return None, f"it maps [R, 2I] to {list(got.shape)}, not [R, I]"
    candidates = [("silu", DEFAULT_ALPHA), ("gelu_tanh", DEFAULT_ALPHA)]
    candidates += [("swiglu_oai", a) for a in (_number_attrs(module, _ALPHA_ATTRS) or [DEFAULT_ALPHA])]
    best = None
    for activation, alpha in candidates:
        for limit in (None, *limits):
            want = _clamped_gate(g, u, limit, activation, alpha)
            err = float((got - want).abs().max() / want.abs().max())
            if err <= 1e-5:
                return ExpertsVariant(activation, alpha, limit), ""
            best = err if best is None else min(best, err)
    return None, (
        f"its output differs from every gated activation the kernels compute (SiLU, swiglu_oai, GELU-tanh) by at "
        f"least {best:.1e} (relative), with or without the clamp"
    )


def _experts_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(d, torch.Tensor) and gu.dim() == 3 and d.dim() == 3):
        raise UnsupportedExperts(f"{type(module).__name__}: expected 3-D gate_up_proj and down_proj tensors")
    return gu, d


def _has_bias(module) -> bool:
    return bool(getattr(module, "has_bias", False)) or any(getattr(module, b, None) is not None for b in _BIAS_ATTRS)


def experts_variant(module) -> ExpertsVariant:
    """The kernels' activation, alpha, clamp and biases for this experts module, or UnsupportedExperts naming the
    class and every variant the kernels do not compute (no gate projection, a post-expert norm, a gate other than
    the kernels' activations, biases of an unexpected shape)."""
    name = type(module).__name__
    variants = []
    if not getattr(module, "has_gate", True):
        variants.append("has_gate=False (up → activation → down, no gate projection)")
    if getattr(module, "has_post_expert_norm", False):
        variants.append("has_post_expert_norm=True (a norm after each expert's down projection)")
    found = ExpertsVariant()
    if getattr(module, "has_gate", True):  # the gate is probed even next to another variant: every one is named
        gu, _ = _experts_weights(module)
        transposed = getattr(module, "is_transposed", False)
        inter = (gu.shape[2] if transposed else gu.shape[1]) // 2
        got, detail = _gate_variant(module, inter, getattr(module, "is_concatenated", True))
        if got is None:
            act = getattr(module, "act_fn", None)
            gate = getattr(type(module)._apply_gate, "__qualname__", "_apply_gate")
            act_name = getattr(act, "__name__", type(act).__name__)
            variants.append(
                f"gate {gate}"
                + (f" with act_fn {act_name}" if act is not None else "")
                + f" is not an activation the kernels compute: {detail}"
            )
        else:
            found = got
    if _has_bias(module):
        try:
            _biases(module)
            found = ExpertsVariant(found.activation, found.alpha, found.swiglu_limit, True)
        except UnsupportedExperts as e:
            variants.append(str(e))
    if variants:
        raise UnsupportedExperts(f"{name}: static_moe cannot run these experts: {'; '.join(variants)}")
    return found


def experts_swiglu_limit(module) -> float | None:
    """The kernels' ``swiglu_limit`` for this experts module (None: no clamp); UnsupportedExperts as
    :func:`experts_variant`."""
    return experts_variant(module).swiglu_limit


def _biases(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's biases in the canonical order: gate_up [E, 2I] (gate columns, then up columns) and down
    [E, H], float32 (a missing one is zero)."""
    gu, d = _experts_weights(module)
    transposed = getattr(module, "is_transposed", False)
    e = gu.shape[0]
    two_i = gu.shape[2] if transposed else gu.shape[1]
    h = d.shape[2] if transposed else d.shape[1]
    out = []
    for attr, n in zip(_BIAS_ATTRS, (two_i, h)):
        b = getattr(module, attr, None)
        if b is None:
            b = torch.zeros(e, n)
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (e, n):
            got = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise UnsupportedExperts(f"has_bias=True with {attr} {got}, not [E, {n}] (one bias per expert output)")
        out.append(b.detach().float())
    b13, b2 = out
    if not getattr(module, "is_concatenated", True):  # columns g0, u0, g1, u1, ...
        b13 = torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1)
    return b13.contiguous(), b2.contiguous()


class _CanonicalExperts:
    """A view of an experts module's weights in StaticMoE.from_module's fused layout: gate_up_proj [E, 2I, H]
    (gate rows, then up rows) and down_proj [E, H, I] — or of experts ``first … first + count − 1`` only (an EP
    rank's slice: nothing of the other experts is copied). Transposed weights are transposed back and interleaved
    gate/up rows permuted (a copy of the float weights, dropped after conversion)."""

    def __init__(self, module, first: int = 0, count: int | None = None):
        gu, d = _experts_weights(module)
        count = gu.shape[0] - first if count is None else count
        gu, d = gu.detach()[first : first + count], d.detach()[first : first + count]
        if getattr(module, "is_transposed", False):  # [E, H, 2I] and [E, I, H]
            gu, d = gu.transpose(1, 2), d.transpose(1, 2)
        if not getattr(module, "is_concatenated", True):  # rows g0, u0, g1, u1, ...
            gu = torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1)
        self.gate_up_proj, self.down_proj = gu.contiguous(), d.contiguous()


def _source_key(module) -> tuple:
    """Identifies the weights a layer was converted from: replaced or modified in place, the key changes."""
    tensors = [*_experts_weights(module), *(getattr(module, b, None) for b in _BIAS_ATTRS)]
    return tuple((t.data_ptr(), t._version) for t in tensors if isinstance(t, torch.Tensor))


def _ep_slice(module, opts: ExpertsOptions) -> tuple[int, int, int, int]:
    """(first, count, E, S): which experts of the module's tensors this rank converts. With an EP group of S ranks
    the module holds either all E experts (this rank takes ``rank·E/S … +E/S − 1``) or, once released
    (:func:`_release_other_experts`), only this rank's E/S; E is ``num_experts`` recorded at ``use_static_moe``."""
    n = _experts_weights(module)[0].shape[0]
    if opts.ep_group is None:
        return 0, n, n, 1
    size, rank = dist.get_world_size(opts.ep_group), dist.get_rank(opts.ep_group)
    total = _state(module).num_experts or n
    if total % size:
        raise ValueError(
            f"{type(module).__name__}: its {total} experts do not split over the EP group's {size} ranks "
            f"(ep_group: pick a group whose size divides {total})"
        )
    local = total // size
    if n == total:
        return rank * local, local, total, size
    if n == local:
        return 0, local, total, size
    raise ValueError(
        f"{type(module).__name__}: holds {n} experts; with ep_group of {size} ranks it must hold all {total} "
        f"or this rank's {local}"
    )


def _convert(module, top_k: int) -> StaticMoE:
    """The experts module's weights converted once into a StaticMoE layer with its options: all experts on one
    rank, this rank's slice with an EP group (collective over it)."""
    variant = experts_variant(module)
    opts = _state(module).options
    first, count, total, _ = _ep_slice(module, opts)
    src = _CanonicalExperts(module, first, count)
    ep = {} if opts.ep_group is None else {"num_experts": total, "ep_group": opts.ep_group}
    try:
        layer = StaticMoE.from_module(
            src,
            top_k=top_k,
            capacity=opts.capacity or DEFAULT_CAPACITY,
            weight_format=opts.weight_format,
            act_format=opts.act_format,
            swiglu_limit=variant.swiglu_limit,
            activation=variant.activation,
            alpha=variant.alpha,
            expert_biases=variant.biases,
            **ep,
            **opts.options,
        )
        if variant.biases:
            try:
                b13, b2 = (b[first : first + count] for b in _biases(module))
                layer.set_expert_biases(b13.to(layer.w13_bias.device), b2.to(layer.w2_bias.device))
            except BaseException:
                layer.close()
                raise
        return layer
    except (ValueError, TypeError) as e:
        raise UnsupportedExperts(f"{type(module).__name__}: static_moe cannot run these experts: {e}") from e


def _layer(module, top_k: int, release: bool = True) -> StaticMoE:
    """The module's cached layer, converted at the first call and again only when its weights changed.

    Under ``torch.compile`` the layer converted before compiling (by ``use_static_moe``, or the first eager call)
    is used as it is: the weights' identity check compares data pointers, which a graph cannot hold, and a
    conversion is not graph code. Change the weights of a compiled model, then call it once eagerly (or call
    ``use_static_moe`` again) before compiling again."""
    state = _state(module)
    if torch.compiler.is_compiling():
        if state.layer is None or state.layer.closed or state.layer.top_k != top_k:
            raise RuntimeError(
                f"{type(module).__name__}: under torch.compile the static_moe experts must already be converted "
                "(use_static_moe(model), or one call of the model before compiling it)"
            )
        return state.layer
    key = _source_key(module)
    if state.layer is not None and not state.layer.closed and state.source == key and state.layer.top_k == top_k:
        return state.layer
    state.close()
    state.layer = _convert(module, top_k)
    if release and state.layer.ep_size > 1:
        _release_other_experts(module, state.layer)
    state.source = _source_key(module)
    return state.layer


def _release_other_experts(module, layer: StaticMoE) -> None:
    """With an EP group: the module's ``gate_up_proj``, ``down_proj`` (and biases) become new parameters holding
    only this rank's experts (a copy of the slice, in the module's own layout and dtype), so the tensors of the
    whole model's experts are no longer referenced by the module and are freed when nothing else holds them. The
    cached layer's source key is taken again after this (the tensors changed)."""
    first, local = layer.expert_offset, layer.num_local_experts
    state = _state(module)
    state.num_experts = state.num_experts or layer.num_experts
    for name in ("gate_up_proj", "down_proj", *_BIAS_ATTRS):
        t = getattr(module, name, None)
        if not isinstance(t, torch.Tensor) or t.shape[0] == local:
            continue
        kept = t.detach()[first : first + local].clone()
        if isinstance(t, nn.Parameter):
            setattr(module, name, nn.Parameter(kept, requires_grad=t.requires_grad))
        else:
            setattr(module, name, kept)


def static_moe_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The "static_moe" experts function: ``hidden_states`` [T, H] (bf16 / fp16 / fp32), ``top_k_index`` [T, k]
    global expert ids (ids ≥ E, transformers' "no expert in this slot", contribute nothing), ``top_k_weights``
    [T, k]. Returns [T, H] in the hidden states' dtype (rounded to bf16 once, SPEC §1.6). Calls with more rows
    than the capacity run in capacity-sized chunks (tokens are independent on one rank)."""
    if hidden_states.requires_grad:
        raise RuntimeError(
            f"{type(self).__name__}: the static_moe experts are inference-only (no backward); run "
            "under torch.no_grad() / torch.inference_mode(), or use another experts_implementation "
            "to train"
        )
    k, h = top_k_index.shape[-1], hidden_states.shape[-1]
    layer = _layer(self, k)
    x = hidden_states.reshape(-1, h)
    ids = top_k_index.reshape(-1, k)
    ids = torch.where((ids >= layer.num_experts) | (ids < 0), torch.full_like(ids, -1), ids)
    weights = top_k_weights.reshape(-1, k)
    if layer.ep_size > 1:
        return _ep_forward(layer, x, ids, weights).reshape(hidden_states.shape)
    return _chunked(layer, x, ids, weights).reshape(hidden_states.shape)


def _chunked(layer: StaticMoE, x, ids, weights) -> torch.Tensor:
    c = layer.capacity
    outs = [layer(x[s : s + c], ids[s : s + c], weights[s : s + c]) for s in range(0, x.shape[0], c)]
    return outs[0] if len(outs) == 1 else torch.cat(outs) if outs else torch.zeros_like(x)


def _ep_forward(layer: StaticMoE, x, ids, weights) -> torch.Tensor:
    """Every rank of the EP group holds the same T tokens (transformers' replicated run). T is padded to a multiple
    of S with empty rows (id −1, weight 0); rank r runs rows ``r·T'/S … +T'/S − 1`` (T' the padded count) through
    the layer — dispatch to the experts' ranks and combine back, in capacity-sized chunks, the same number on every
    rank — and the per-rank outputs are all-gathered back to [T, H] with a functional collective (graph code, so
    ``torch.compile(fullgraph=True)`` traces it)."""
    t, size, rank = x.shape[0], layer.ep_size, layer.ep_rank
    if t == 0:  # every rank has no tokens: nothing to dispatch, nothing to gather
        return torch.zeros_like(x)
    share = -(-t // size)
    pad = share * size - t
    if pad:
        x = nn.functional.pad(x, (0, 0, 0, pad))
        ids = nn.functional.pad(ids, (0, 0, 0, pad), value=-1)
        weights = nn.functional.pad(weights, (0, 0, 0, pad))
    mine = slice(rank * share, (rank + 1) * share)
    out = _chunked(layer, x[mine], ids[mine], weights[mine]).contiguous()
    gathered = funcol.all_gather_single(out, 0, layer.group_name)
    return gathered[:t] if pad else gathered


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, static_moe_experts_forward)


# ----------------------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------------------
def _top_k_of(module) -> int | None:
    """top_k from the experts' config (``num_experts_per_tok``), to convert before the first call; None: wait for
    it (the first call's top_k_index says)."""
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None


def use_static_moe(
    model: nn.Module,
    *,
    weight_format: str = "bf16",
    act_format: str = "bf16",
    capacity: int | None = None,
    ep_group=None,
    **options,
) -> nn.Module:
    """Run every experts module of ``model`` through static_moe; returns ``model``.

    Args:
        weight_format / act_format: the experts' formats (SPEC §1.2 pairs); float weights are quantized once,
            here.
        capacity: rows per StaticMoE call (default :data:`DEFAULT_CAPACITY`); larger calls run in chunks.
        ep_group: the EP process group (None: one rank). Collective: every rank of the group calls
            ``use_static_moe`` on the same model with the same options and then runs every forward on the same
            inputs (transformers' replicated run). Each rank converts only its E/S experts (ids ``rank·E/S …
            +E/S − 1``), then the experts module's ``gate_up_proj`` / ``down_proj`` (and biases) are replaced by
            copies of that slice, so the whole model's expert tensors are freed unless the caller holds them.
            Each call splits the T tokens over the ranks (T padded to a multiple of S), runs the EP layer
            (dispatch + combine) on the rank's share and all-gathers the outputs back to [T, H]. E not divisible
            by S, a refused module on any rank, or ranks that disagree (modules, shapes, dtypes, options): a
            ValueError on every rank, before anything is converted.
        options: passed to :class:`StaticMoE` (act_group, fp8_max, device, prepare_for, ...).

    Every experts module is checked before any is converted: unsupported ones raise :class:`UnsupportedExperts`
    naming each class, its variants and the modules, and the model is left as it was.
    Then each module's weights are converted (weights loaded later are picked up at the next call) and the model
    is switched to ``experts_implementation="static_moe"``. :func:`close_static_moe` gives the layers back.
    """
    size, _, _ = ep_group_info(ep_group) if ep_group is not None else (1, 0, "")

    def check():
        found = experts_modules(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no experts module that dispatches through transformers' "
                "ExpertsInterface (classes decorated with @use_experts_implementation)"
            )
        refused: dict[str, list[str]] = {}  # message → the modules it applies to
        for name, m in found:
            try:
                experts_variant(m)
            except UnsupportedExperts as e:
                refused.setdefault(str(e), []).append(name or "(the model)")
        if refused:
            raise UnsupportedExperts("; ".join(f"{msg} (in {', '.join(names)})" for msg, names in refused.items()))
        sliced = [name for name, m in found if _num_experts(m) != _experts_weights(m)[0].shape[0]]
        if sliced and size == 1:
            raise ValueError(
                f"ep_group: {', '.join(sliced)} hold only their EP rank's experts (converted with an ep_group "
                "before): pass the same ep_group again"
            )
        uneven = [f"{name} ({n})" for name, m in found if (n := _num_experts(m)) % size]
        if uneven:
            raise ValueError(
                f"ep_group: the EP group's {size} ranks do not split the experts of {', '.join(uneven)} (each rank "
                f"must hold E/{size} experts; pick a group whose size divides the experts count)"
            )
        return found

    if size > 1:
        found = collectively(ep_group, size, "use_static_moe", check, others_error=_others_value_error)
        _check_ranks_agree(found, (weight_format, act_format, capacity, options), ep_group, size)
    else:
        found = check()
    opts = ExpertsOptions(weight_format, act_format, capacity, dict(options), ep_group=ep_group)
    previous = {name: m.__dict__.get(_STATE) for name, m in found}
    counts = {name: _num_experts(m) for name, m in found}
    try:
        for name, m in found:
            m.__dict__[_STATE] = _ExpertsState(opts)
            m.__dict__[_STATE].num_experts = counts[name]
            k = _top_k_of(m)
            if k is not None:
                _layer(m, k, release=False)  # the other experts are released once every module has converted
    except BaseException:
        for name, m in found:
            if (state := m.__dict__.pop(_STATE, None)) is not None:  # the modules before the failing one
                state.close()
            if previous[name] is not None:
                m.__dict__[_STATE] = previous[name]
        raise
    for old in previous.values():
        if old is not None:
            old.close()
    for _, m in found:
        state = m.__dict__[_STATE]
        if state.layer is not None and state.layer.ep_size > 1:
            _release_other_experts(m, state.layer)
            state.source = _source_key(m)
    _switch(model, found)
    return model


def _num_experts(module) -> int:
    """The experts count E of the module's weights (the leading dim of ``gate_up_proj``)."""
    state = module.__dict__.get(_STATE)
    known = None if state is None else state.num_experts
    return known or _experts_weights(module)[0].shape[0]


def _others_value_error(failed: dict) -> Exception:
    """What the ranks whose own check passed raise when another rank's failed (``workspace.converge``): a
    ValueError naming the failing ranks (UnsupportedExperts is one), RuntimeError for any other exception."""
    kinds = {k for k, _ in failed.values()}
    cls = ValueError if kinds <= {"ValueError", UnsupportedExperts.__name__} else RuntimeError
    detail = "; ".join(f"rank {r}: {k}: {m}" for r, (k, m) in failed.items())
    return cls(f"use_static_moe failed on group rank(s) {sorted(failed)}: {detail}")


def _check_ranks_agree(found, options, ep_group, size: int) -> None:
    """Collective: every rank of the EP group holds the same experts modules (names, classes, weight shapes and
    dtypes) and passed the same options; otherwise ValueError on every rank naming what differs (every rank reads
    the same gathered descriptions, so all reach the same verdict)."""
    weight_format, act_format, capacity, opts = options
    mine = {
        "experts modules": [
            (name, type(m).__name__, *((tuple(t.shape), str(t.dtype)) for t in _experts_weights(m)))
            for name, m in found
        ],
        "weight_format": weight_format,
        "act_format": act_format,
        "capacity": capacity,
        "options": repr(sorted(opts.items())),
    }
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=ep_group)
    differ = _workspace._describe_differences(everyone, list(mine))
    if differ:
        raise ValueError(
            "use_static_moe: ranks of ep_group disagree (every rank must pass the same model and "
            "options): " + "; ".join(differ)
        )


def _switch(model: nn.Module, found) -> None:
    """Sets "static_moe" on the model (and its sub-models) and on every experts module's own config, which is what
    the dispatching wrapper reads."""
    if callable(getattr(model, "set_experts_implementation", None)):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    for _, m in found:
        if m.config._experts_implementation != EXPERTS_IMPLEMENTATION:
            m.config._experts_implementation_internal = EXPERTS_IMPLEMENTATION


def close_static_moe(model: nn.Module) -> int:
    """Give back the workspace leases of the layers ``use_static_moe`` (or a first call) converted; returns how
    many. The options stay: a later call through "static_moe" converts the weights again."""
    return sum(state.close() for _, m in experts_modules(model) if (state := m.__dict__.get(_STATE)) is not None)


def static_moe_layer(module) -> StaticMoE | None:
    """The StaticMoE layer an experts module currently runs on (None before its first conversion)."""
    state = module.__dict__.get(_STATE)
    return None if state is None else state.layer


__all__ = [
    "ALL_EXPERTS_FUNCTIONS",
    "DEFAULT_CAPACITY",
    "EXPERTS_IMPLEMENTATION",
    "ExpertsOptions",
    "ExpertsVariant",
    "UnsupportedExperts",
    "close_static_moe",
    "experts_modules",
    "experts_swiglu_limit",
    "experts_variant",
    "is_experts_class",
    "static_moe_experts_forward",
    "static_moe_layer",
    "use_static_moe",
]
