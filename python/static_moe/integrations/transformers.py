"""Swap static_moe in for the sparse-MoE blocks of a Hugging Face transformers (5.x) model.

``replace_moe_blocks(model, capacity=...)`` finds every MoE block of a known family (by module class, see
:data:`FAMILIES`), converts its routed experts, shared expert and shared-expert gate into one :class:`StaticMoE`
and puts a :class:`StaticMoEBlock` in its place, which keeps the model's own router. docs/transformers.md
explains the routing conventions, dtypes and expert parallelism.

Importing this module also registers "static_moe" in transformers' ExpertsInterface and offers
:func:`use_static_moe` (``transformers_experts``): the seam that keeps each block's own code and reaches every
family whose experts class is decorated with ``@use_experts_implementation``.

Requires the optional dependency ``transformers`` (``pip install static_moe[transformers]``); importing this
module without it raises ImportError naming the extra.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from ..module import StaticMoE

try:
    import transformers as _transformers  # noqa: F401  (only to fail early, with the extra's name)
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "static_moe.integrations.transformers needs transformers>=5: pip install 'static_moe[transformers]'"
    ) from e

from .transformers_experts import (  # noqa: E402,F401  (registers "static_moe" in the ExpertsInterface)
    EXPERTS_IMPLEMENTATION,
    UnsupportedExperts,
    close_static_moe,
    experts_modules,
    use_static_moe,
)


@dataclass(frozen=True)
class MoEFamily:
    """Where one transformers model family keeps the parts of its sparse-MoE block.

    ``router`` names the block's router: called on hidden states [T, H] it returns ``(router_logits, weights
    [T, k], expert ids [T, k])`` (transformers 5.x) with ``top_k`` and ``num_experts`` attributes. ``experts``
    names the fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]). ``shared_expert`` /
    ``shared_expert_gate`` name an always-on SwiGLU MLP and its per-token sigmoid gate, when the family has them.
    ``returns_router_logits``: the block's forward returns ``(hidden, router_logits)`` instead of ``hidden``.
    """

    module: str
    block: str
    router: str = "gate"
    experts: str = "experts"
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    returns_router_logits: bool = False


_MODELS = "transformers.models."
FAMILIES: tuple[MoEFamily, ...] = (
    MoEFamily(_MODELS + "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    MoEFamily(
        _MODELS + "qwen2_moe.modeling_qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
    ),
    MoEFamily(_MODELS + "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", shared_expert="shared_experts"),
    MoEFamily(_MODELS + "mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    MoEFamily(_MODELS + "olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
)

# Attributes that would carry maths of a block the family entry does not know about: refused, never dropped.
_SHARED_ATTRS = ("shared_expert", "shared_experts", "shared_expert_gate")


def family_table(families=FAMILIES) -> dict[type, MoEFamily]:
    """{block class: family} for the families whose transformers module imports (others are skipped)."""
    table = {}
    for f in families:
        try:
            cls = getattr(importlib.import_module(f.module), f.block)
        except (ImportError, AttributeError):
            continue
        table[cls] = f
    return table


class StaticMoEBlock(nn.Module):
    """A sparse-MoE block with static_moe experts: the model's router, unchanged, then :class:`StaticMoE`.

    ``forward(hidden_states [..., H])`` (bf16 / fp16 / fp32): the router gives ``(logits, weights, ids)``; ids
    equal to ``num_experts`` (transformers' "no expert here" slot, used by its own expert parallelism) become
    −1; StaticMoE returns the hidden states' dtype and shape. All T = numel / H rows go in one call, so
    T ≤ capacity (batch × prompt length during prefill).
    """

    def __init__(
        self, router: nn.Module, moe: StaticMoE, *, returns_router_logits: bool = False, jitter_noise: float = 0.0
    ):
        super().__init__()
        self.gate = router
        self.moe = moe
        self.returns_router_logits = returns_router_logits
        self.jitter_noise = jitter_noise

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:
            raise RuntimeError(
                "StaticMoEBlock is for inference: the model's router jitter noise (training only) "
                "is not applied; call model.eval()"
            )
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits, weights, ids = self.gate(flat)
        ids = torch.where(ids == self.moe.num_experts, torch.full_like(ids, -1), ids)
        out = self.moe(flat, ids, weights).reshape(hidden_states.shape)
        return (out, logits) if self.returns_router_logits else out


def _looks_like_moe(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module) and (
        isinstance(getattr(module, "gate", None), nn.Module) or isinstance(getattr(module, "router", None), nn.Module)
    )


def _convert(block: nn.Module, family: MoEFamily, capacity, weight_format, act_format, ep_group, options):
    router, experts = getattr(block, family.router), getattr(block, family.experts)
    for attr in _SHARED_ATTRS:
        if getattr(block, attr, None) is not None and attr not in (family.shared_expert, family.shared_expert_gate):
            raise ValueError(
                f"{type(block).__name__}.{attr} is not in its MoEFamily entry; add it there rather than drop it"
            )
    shared = getattr(block, family.shared_expert) if family.shared_expert else None
    gate = getattr(block, family.shared_expert_gate) if family.shared_expert_gate else None
    num_experts = getattr(router, "num_experts", None) or experts.num_experts
    moe = StaticMoE.from_module(
        experts,
        top_k=router.top_k,
        capacity=capacity,
        num_experts=num_experts,
        weight_format=weight_format,
        act_format=act_format,
        shared_expert=shared,
        shared_expert_gate=gate,
        ep_group=ep_group,
        **options,
    )
    return StaticMoEBlock(
        router,
        moe,
        returns_router_logits=family.returns_router_logits,
        jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
    )


def replace_moe_blocks(
    model: nn.Module,
    *,
    capacity: int,
    weight_format: str = "bf16",
    act_format: str = "bf16",
    ep_group=None,
    families=FAMILIES,
    **options,
) -> nn.Module:
    """Replace every sparse-MoE block of ``model`` in place with a :class:`StaticMoEBlock`; returns ``model``.

    Args:
        capacity: C, the most tokens one block call passes per rank (batch × sequence length of a forward).
        weight_format / act_format: the routed experts' formats (SPEC §1.2 pairs); the shared expert follows
            ``weight_format`` unless ``shared_weight_format`` is given.
        ep_group: the EP process group. Every rank passes the same full model; each keeps its E/S experts
            (collective: every rank must call this, with the same model).
        families: the :class:`MoEFamily` entries to recognise (default :data:`FAMILIES`).
        options: passed to :meth:`StaticMoE.from_module` (act_group, swiglu_limit, fp8_max, shared_weight_format,
            device, prepare_for, ...). Each new layer prepares its weights for its device like any StaticMoE (the
            K-major layout of SPEC §1.2 for trn2 / trn3; ``prepare_for=`` chooses explicitly and is required on
            a Neuron device).

    Raises TypeError when the model has an MoE-looking block of an unknown family (nothing is replaced then),
    ValueError when it has no MoE block at all, and whatever :meth:`StaticMoE.from_module` raises for experts it
    cannot represent.
    """
    table = family_table(families)
    found, unknown = [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix, _, _ in found):
            continue  # inside a block already found
        if type(module) in table:
            found.append((name, module, table[type(module)]))
        elif _looks_like_moe(module) and not isinstance(module, StaticMoEBlock):
            unknown.append(f"{name} ({type(module).__name__})")
    if unknown:
        known = sorted(f.block for f in table.values())
        raise TypeError(
            f"unknown MoE block class(es): {', '.join(unknown)}; known: {known}. Add a MoEFamily for "
            "it (replace_moe_blocks(..., families=FAMILIES + (MoEFamily(...),)))"
        )
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no sparse-MoE block of a known family "
            f"({sorted(f.block for f in table.values())})"
        )
    for name, block, family in found:
        new = _convert(block, family, capacity, weight_format, act_format, ep_group, dict(options))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def close_moe_blocks(model: nn.Module) -> int:
    """Give back the workspace leases of every StaticMoE in ``model`` (see StaticMoE.close); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, StaticMoE) and not m.closed]
    for m in layers:
        m.close()
    return len(layers)
