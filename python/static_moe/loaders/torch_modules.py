"""StaticMoE.from_module's loader: SwiGLU experts held by an nn.Module, as float weights quantized on the way.

Sources (``StaticMoE.from_module`` documents them): transformers 5.x fused experts (``gate_up_proj`` [N, 2I, H],
``down_proj`` [N, H, I]); grouped experts (``w1`` / ``w3`` [N, I, H], ``w2`` [N, H, I]); a list of MLPs with
``gate_proj`` / ``up_proj`` / ``down_proj`` or ``w1`` / ``w3`` / ``w2`` nn.Linear; a module whose ``experts`` is
one of these. DTensors give their local shard (an EP shard holds this rank's own experts). Weights stay on their
device; this rank's are read as float (checked finite), quantized to the layer's format
(``formats.quantize_weight``) and stored with ``set_expert_weights`` / ``SharedExpert.set_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..formats import quantize_weight
from ..module import (
    _FLOAT_DTYPES,
    _check_ep_size,
    _check_finite,
    _checked_gate,
    _materialized,
    _positive_int,
    ep_group_info,
)
from ..ops.quantize_weight import quantize_weight_fast
from .collective import collectively


def from_module(
    cls,
    module,
    *,
    top_k: int,
    capacity: int,
    num_experts: int | None = None,
    weight_format: str = "bf16",
    shared_expert: nn.Module | None = None,
    shared_expert_gate: nn.Module | None = None,
    ep_group=None,
    ep_size: int | None = None,
    **options,
):
    """``cls.from_module(...)`` (StaticMoE.from_module documents the arguments): a layer of class ``cls``."""
    size, rank, _ = ep_group_info(ep_group)
    stage = "StaticMoE.from_module"

    def read():
        _check_ep_size(ep_size, size)
        gate, up, down, total = _experts_from_module(module, num_experts, size, rank, shared_expert)
        if shared_expert is None and shared_expert_gate is not None:
            raise ValueError("shared_expert_gate was given without shared_expert")
        shared = None if shared_expert is None else _linears_of(shared_expert, "shared_expert")
        gate_w = None if shared_expert_gate is None else _gate_of(shared_expert_gate, gate.shape[2])
        if shared is not None and options.get("shared_intermediate_size", 0) is None:
            raise ValueError("shared_expert was given but shared_intermediate_size=None was passed")
        return gate, up, down, total, shared, gate_w

    gate, up, down, total, shared, gate_w = collectively(ep_group, size, stage, read)
    options.setdefault("device", gate.device)
    if shared is not None:
        options.setdefault("shared_intermediate_size", shared[0].shape[0])
        options.setdefault("shared_gate", gate_w is not None)
    layer = cls(
        gate.shape[2],
        gate.shape[1],
        total,
        top_k,
        capacity,
        weight_format=weight_format,
        ep_group=ep_group,
        ep_size=ep_size,
        **options,
    )

    def load():
        _load_float_experts(layer, gate, up, down)
        if shared is not None:
            _load_float_shared(layer, *shared)
            if gate_w is not None:
                layer.shared.set_gate(gate_w)
            elif layer.shared.gate_weight is not None:
                raise ValueError("shared_gate=True but no shared_expert_gate was given")

    collectively(ep_group, size, stage, load, cleanup=layer.close)
    return layer


def _load_float_experts(layer, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """This rank's float experts (gate / up [L, I, H], down [L, H, I]) quantized to the layer's weight_format and
    stored on the layer's device."""
    w13 = torch.cat((gate, up), dim=1)
    w13_q, w13_s = quantize_weight_fast(w13.to(layer.w13.device), layer.weight_format, name="w13")
    w2_q, w2_s = quantize_weight_fast(down.to(layer.w13.device), layer.weight_format, name="w2")
    layer.set_expert_weights(w13_q, w13_s, w2_q, w2_s)


def _load_float_shared(layer, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
    """The float shared expert (gate / up [I, H], down [H, I]) quantized to its own weight_format and stored."""
    w13 = torch.cat((gate, up), dim=0)[None]
    fmt = layer.shared.weight_format
    w13_q, w13_s = quantize_weight(w13.to(layer.w13.device), fmt)
    w2_q, w2_s = quantize_weight(down[None].to(layer.w13.device), fmt)
    layer.shared.set_weights(w13_q, w13_s, w2_q, w2_s)


def _float_weight(name: str, t, first: int = 0) -> torch.Tensor:
    """A float source weight, checked finite (``first``: global id of dim 0's first expert, for the message)."""
    t = _materialized(name, t)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a float weight (bf16/fp16/fp32) to convert, got {t.dtype}; "
            "quantized checkpoints load with StaticMoE.from_deepseek_state_dict"
        )
    return _check_finite(name, t.detach(), first)


def _is_silu(act) -> bool:
    return act is nn.functional.silu or isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _check_activation(owner, what: str) -> None:
    act = getattr(owner, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise ValueError(
            f"{what} uses the activation {type(act).__name__}: StaticMoE computes SwiGLU (SiLU-gated) experts only"
        )


def _linears_of(expert, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) of a SwiGLU MLP with HF (gate/up/down_proj) or DeepSeek (w1/w3/w2)
    names."""
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        mods = [getattr(expert, n, None) for n in names]
        if all(m is not None for m in mods):
            _check_activation(expert, what)
            if any(getattr(m, "bias", None) is not None for m in mods):
                raise ValueError(f"{what}: biased projections are not supported (SwiGLU experts have no bias)")
            ws = [_float_weight(f"{what}.{n}.weight", getattr(m, "weight", m)) for n, m in zip(names, mods)]
            gate, up, down = ws
            if gate.dim() != 2 or up.shape != gate.shape or tuple(down.shape) != (gate.shape[1], gate.shape[0]):
                raise ValueError(
                    f"{what}: expected gate/up [I, H] and down [H, I], got {list(gate.shape)}, "
                    f"{list(up.shape)}, {list(down.shape)}"
                )
            if len({gate.device, up.device, down.device}) != 1:
                raise ValueError(f"{what}: gate, up and down weights must share one device")
            return gate, up, down
    raise TypeError(
        f"{what} must have gate_proj/up_proj/down_proj or w1/w3/w2 projections, got {type(expert).__name__}"
    )


def _gate_of(gate, hidden: int) -> torch.Tensor:
    """The weight [1, H] of a shared expert's gate (nn.Linear(H, 1, bias=False) or a tensor)."""
    if getattr(gate, "bias", None) is not None:
        raise ValueError("shared_expert_gate: a biased gate is not supported")
    return _checked_gate("shared_expert_gate.weight", getattr(gate, "weight", gate), hidden)


def _local_range(n: int, num_experts: int | None, size: int, rank: int, is_shard: bool, what: str):
    """(first, count, global E): which of the ``n`` given experts this rank keeps (see from_module)."""
    if is_shard:
        if num_experts is not None and num_experts != n * size:
            raise ValueError(
                f"{what} is an EP shard of {n} experts on each of {size} ranks ({n * size} in all), "
                f"but num_experts={num_experts} was passed"
            )
        return 0, n, n * size
    if num_experts is None:
        if size == 1:
            return 0, n, n
        split = f"each rank then keeps {n // size}" if n % size == 0 else f"{n} does not split over {size} ranks"
        raise ValueError(
            f"{what} holds {n} experts and the EP group has {size} ranks: pass num_experts={n} if "
            f"they are all the model's experts ({split}), or num_experts={n * size} if they are "
            "this rank's own"
        )
    _positive_int("num_experts", num_experts)
    if n == num_experts:
        if num_experts % size:
            raise ValueError(
                f"{what}: num_experts={num_experts} experts do not split over ep_size={size} ranks; "
                f"pick an ep_size that divides {num_experts}"
            )
        count = num_experts // size
        return rank * count, count, num_experts
    if n * size == num_experts:
        return 0, n, num_experts
    mine = f"this rank's {num_experts // size}" if num_experts % size == 0 else "a share (it does not divide)"
    raise ValueError(
        f"{what} holds {n} experts, but num_experts={num_experts} over ep_size={size} needs all "
        f"{num_experts} (the whole model) or {mine}"
    )


def _fused_tensors(module):
    """(gate_up_proj, down_proj) of transformers 5.x fused experts, or None for another kind of source."""
    gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(_maybe_local(gu), torch.Tensor) and isinstance(_maybe_local(d), torch.Tensor)):
        return None
    name = type(module).__name__
    for flag, bad, why in (
        ("is_transposed", True, "transposed [E, H, 2I] weights"),
        ("is_concatenated", False, "interleaved gate/up rows"),
        ("has_gate", False, "experts without a gate projection"),
        ("has_bias", True, "biased projections"),
    ):
        if getattr(module, flag, not bad) == bad:
            raise ValueError(f"{name}: {why} cannot be represented (StaticMoE takes gate rows then up rows, no bias)")
    for b in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(module, b, None) is not None:
            raise ValueError(f"{name}.{b}: biased projections cannot be represented")
    _check_activation(module, name)
    return gu, d


def _experts_from_module(module, num_experts, size, rank, shared_expert=None):
    """This rank's experts as float (gate [L, I, H], up [L, I, H], down [L, H, I]) and the global count E."""
    fused = _fused_tensors(module)
    if fused is not None:
        is_shard = hasattr(fused[0], "to_local")
        gu, d = _materialized("experts.gate_up_proj", fused[0]), _materialized("experts.down_proj", fused[1])
        if (
            gu.dim() != 3
            or d.dim() != 3
            or gu.shape[1] % 2
            or tuple(d.shape) != (gu.shape[0], gu.shape[2], gu.shape[1] // 2)
        ):
            raise ValueError(
                f"fused experts need gate_up_proj [E, 2I, H] and down_proj [E, H, I], got "
                f"{list(gu.shape)} and {list(d.shape)}"
            )
        first, count, total = _local_range(gu.shape[0], num_experts, size, rank, is_shard, "experts.gate_up_proj")
        gu = _float_weight("experts.gate_up_proj", gu[first : first + count], first)
        d = _float_weight("experts.down_proj", d[first : first + count], first)
        if gu.device != d.device:
            raise ValueError("experts.gate_up_proj and experts.down_proj must share one device")
        i = gu.shape[1] // 2
        return gu[:, :i], gu[:, i:], d, total
    if (
        all(hasattr(module, n) for n in ("w1", "w2", "w3"))
        and isinstance(_maybe_local(module.w1), torch.Tensor)
        and _maybe_local(module.w1).dim() == 3
    ):
        is_shard = hasattr(module.w1, "to_local")
        ts = {n: _materialized(f"source {n}", getattr(module, n)) for n in ("w1", "w3", "w2")}
        g = ts["w1"]
        if ts["w3"].shape != g.shape or tuple(ts["w2"].shape) != (g.shape[0], g.shape[2], g.shape[1]):
            raise ValueError(
                f"source expects w1/w3 [L, I, H] and w2 [L, H, I], got {list(g.shape)}, "
                f"{list(ts['w3'].shape)}, {list(ts['w2'].shape)}"
            )
        first, count, total = _local_range(g.shape[0], num_experts, size, rank, is_shard, "source w1")
        gate, up, down = (_float_weight(f"source {n}", ts[n][first : first + count], first) for n in ("w1", "w3", "w2"))
        if len({gate.device, up.device, down.device}) != 1:
            raise ValueError("source w1, w3 and w2 must share one device")
        return gate, up, down, total
    inner = getattr(module, "experts", None)
    if isinstance(inner, nn.Module) and inner is not module:
        for attr in ("shared_expert", "shared_experts"):
            if shared_expert is None and getattr(module, attr, None) is not None:
                raise ValueError(
                    f"{type(module).__name__} has a {attr}: pass it as shared_expert= (and its "
                    "shared_expert_gate=, if any), or pass module.experts; it would be dropped"
                )
        return _experts_from_module(inner, num_experts, size, rank, shared_expert)
    if isinstance(module, nn.Module) and not isinstance(module, (nn.ModuleList, nn.Sequential)):
        raise TypeError(
            f"module must be fused experts (gate_up_proj/down_proj), grouped experts (w1/w3/w2 "
            f"tensors) or a list of SwiGLU MLPs, got {type(module).__name__}"
        )
    if not isinstance(module, Iterable):
        raise TypeError(f"module must be grouped experts or a list of experts, got {type(module).__name__}")
    experts = list(module)
    if not experts:
        raise ValueError("the experts list is empty")
    first, count, total = _local_range(len(experts), num_experts, size, rank, False, "the experts list")
    mats = []
    for j, e in enumerate(experts[first : first + count]):
        if e is None:
            raise ValueError(f"expert {first + j} (owned by this rank) is None")
        mats.append(_linears_of(e, f"experts[{first + j}]"))
    for j, m in enumerate(mats):
        if m[0].shape != mats[0][0].shape or m[0].device != mats[0][0].device:
            raise ValueError(
                f"experts[{first + j}] has gate {list(m[0].shape)} on {m[0].device}, but "
                f"experts[{first}] has {list(mats[0][0].shape)} on {mats[0][0].device}: every "
                "expert must have the same shapes and device"
            )
    return (*(torch.stack([m[i] for m in mats]) for i in range(3)), total)


def _maybe_local(t):
    return t.to_local() if hasattr(t, "to_local") else t
