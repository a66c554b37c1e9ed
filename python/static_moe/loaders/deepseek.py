"""StaticMoE.from_deepseek_state_dict's loader: a checkpoint's MoE block, reading only this rank's experts.

Keys (``StaticMoE.from_deepseek_state_dict`` documents them): per expert ``{prefix}experts.{e}.{w1|gate_proj}`` /
``{w3|up_proj}`` / ``{w2|down_proj}`` ``.weight`` with optional ``.weight_scale_inv`` / ``.scale`` /
``.weight_scale``, or fused ``{prefix}experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] with optional
``_scale_inv`` / ``_scale`` / ``_weight_scale``; a shared expert under ``shared_experts.`` (DeepSeek) or
``shared_expert.`` (Qwen2-MoE, gate ``shared_expert_gate.weight`` [1, H]). Each linear [N, K] is read in its
stored format (bf16 / fp16 / fp32; float8_e4m3fn with 128×128 block or 1×128 scales; fp4 e2m1 pairs with UE8M0
scales), converted to the layer's format (float weights quantized; quantized ones kept, never re-quantized to
another format) in EOI (SPEC §1.2), checked like ``set_expert_weights`` and stored prepared for the layer's device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats import WEIGHT_FP4_BLOCK, WEIGHT_FP8_BLOCK, as_uint8, expand_block_scales
from ..module import (
    _FLOAT_DTYPES,
    _WEIGHT_NAMES,
    _check_ep_size,
    _check_finite,
    _checked_gate,
    _checked_weights,
    _copy_checked,
    _materialized,
    _normalize_scale,
    _normalize_weight,
    _positive_int,
    _weight_shapes,
    ep_group_info,
)
from ..ops.quantize_weight import quantize_weight_fast
from .collective import collectively


def from_deepseek_state_dict(
    cls,
    state_dict: Mapping[str, torch.Tensor],
    *,
    top_k: int,
    capacity: int,
    num_experts: int,
    prefix: str = "",
    weight_format: str | None = None,
    shared_weight_format: str | None = None,
    ep_group=None,
    ep_size: int | None = None,
    **options,
):
    """``cls.from_deepseek_state_dict(...)`` (StaticMoE.from_deepseek_state_dict documents the arguments): a layer
    of class ``cls``."""
    size, rank, _ = ep_group_info(ep_group)
    stage = "StaticMoE.from_deepseek_state_dict"
    hidden_size = options.pop("hidden_size", None)

    def read():
        _check_ep_size(ep_size, size)
        _positive_int("num_experts", num_experts)
        if num_experts % size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({size})")
        num_local = num_experts // size
        experts = _read_checkpoint_experts(state_dict, prefix, rank * num_local, num_local)
        target = weight_format or _common_format([m["format"] for m in experts], "routed experts")
        shared, gate = _read_checkpoint_shared(state_dict, prefix)
        h, i = experts[0]["down"][0].shape[0], experts[0]["up"][0].shape[0]
        _check_hidden(state_dict, prefix, h, i, hidden_size)
        device = torch.device(options.get("device") or experts[0]["up"][0].device)
        converted = [_mlp_in_format(m, target, m["base"], device) for m in experts]
        stacked = {
            k: None if converted[0][k] is None else torch.stack([m[k] for m in converted]) for k in _WEIGHT_NAMES
        }
        routed = _checked_weights("routed", _weight_shapes(num_local, h, i, target), target, stacked)
        if shared is None:
            return h, i, target, routed, None, None, {}
        if options.get("shared_intermediate_size", 0) is None:
            raise ValueError(f"the state dict has {shared['base']}* keys but shared_intermediate_size=None was passed")
        s_fmt = shared_weight_format or (shared["format"] if weight_format is None else target)
        si = shared["up"][0].shape[0]
        m = _mlp_in_format(shared, s_fmt, shared["base"], device)
        s_checked = _checked_weights(
            "shared expert",
            _weight_shapes(1, h, si, s_fmt),
            s_fmt,
            {k: None if m[k] is None else m[k][None] for k in _WEIGHT_NAMES},
        )
        gate = None if gate is None else _checked_gate(f"{prefix}shared_expert_gate.weight", gate, h)
        extra = {"shared_intermediate_size": si, "shared_weight_format": s_fmt, "shared_gate": gate is not None}
        return h, i, target, routed, s_checked, gate, extra

    h, i, target, routed, s_checked, gate, extra = collectively(ep_group, size, stage, read)
    options.setdefault("device", routed["w13"].device)
    for k, v in extra.items():
        options.setdefault(k, v)
    if s_checked is None:
        options.setdefault("shared_weight_format", shared_weight_format)
    layer = cls(h, i, num_experts, top_k, capacity, weight_format=target, ep_group=ep_group, ep_size=ep_size, **options)

    def load():
        _copy_checked(layer, routed)
        if s_checked is not None:
            _copy_checked(layer.shared, s_checked)
            if gate is not None:
                layer.shared.set_gate(gate)

    collectively(ep_group, size, stage, load, cleanup=layer.close)
    return layer


_DS_NAMES = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
_DS_SCALE_SUFFIXES = ("weight_scale_inv", "scale", "weight_scale")
_FUSED_SCALE_SUFFIXES = ("_scale_inv", "_scale", "_weight_scale")


def _tensor_format(name: str, w: torch.Tensor, s: torch.Tensor | None) -> str:
    if w.dtype in _FLOAT_DTYPES:
        if s is not None:
            raise ValueError(f"{name}: a {w.dtype} weight must not have a scale")
        return "bf16"
    if w.dtype == torch.float8_e4m3fn:
        return "fp8"
    if w.dtype in (torch.uint8, torch.int8, torch.float4_e2m1fn_x2):
        return "fp4"
    raise TypeError(f"{name}: weight dtype {w.dtype} is not bf16/fp16/fp32, float8_e4m3fn or packed fp4")


def _checkpoint_tensor(sd: Mapping, key: str, dims: int) -> torch.Tensor:
    t = _materialized(key, sd[key])
    if t.dim() != dims:
        raise ValueError(f"{key} must be a {dims}-D tensor, got {t.dim()}-D {list(t.shape)}")
    return t


def _mlp_format(out: dict, base: str) -> dict:
    fmts = {_tensor_format(name, w, s) for w, s, name in (out[p] for p in _DS_NAMES)}
    if len(fmts) != 1:
        raise ValueError(f"{base}*: gate/up/down weights mix formats {sorted(fmts)}")
    return {**out, "format": fmts.pop(), "base": base}


def _read_deepseek_mlp(sd: Mapping[str, torch.Tensor], base: str) -> dict:
    """{"gate"|"up"|"down": (weight, scale or None, key stem), "format", "base"} of one SwiGLU MLP."""
    out = {}
    for part, names in _DS_NAMES.items():
        for n in names:
            if f"{base}{n}.weight" in sd:
                w = _checkpoint_tensor(sd, f"{base}{n}.weight", 2)
                s = next((f"{base}{n}.{x}" for x in _DS_SCALE_SUFFIXES if f"{base}{n}.{x}" in sd), None)
                s = None if s is None else _materialized(s, sd[s])
                out[part] = (w, s, f"{base}{n}")
                break
        else:
            raise KeyError(f"state dict has no {base}{{{'|'.join(names)}}}.weight")
    return _mlp_format(out, base)


def _read_fused_experts(sd: Mapping, base: str, first: int, count: int) -> list[dict]:
    """This rank's experts from transformers 5.x fused keys ``{base}gate_up_proj`` / ``{base}down_proj``."""
    tensors = {}
    for name in ("gate_up_proj", "down_proj"):
        key = f"{base}{name}"
        if key not in sd:
            raise KeyError(f"state dict has {base}gate_up_proj or {base}down_proj but not {key}")
        w = _checkpoint_tensor(sd, key, 3)
        s = next((key + x for x in _FUSED_SCALE_SUFFIXES if key + x in sd), None)
        s = None if s is None else _checkpoint_tensor(sd, s, 3)
        if w.shape[0] < first + count or (s is not None and s.shape[0] != w.shape[0]):
            raise ValueError(
                f"{key} holds {w.shape[0]} experts (scales: "
                f"{None if s is None else s.shape[0]}); this rank needs experts {first}…"
                f"{first + count - 1}"
            )
        tensors[name] = (w, s)
    (gu, gus), (d, ds) = tensors["gate_up_proj"], tensors["down_proj"]
    if gu.shape[1] % 2 or (gus is not None and gus.shape[1] % 2):
        raise ValueError(
            f"{base}gate_up_proj must stack gate rows then up rows [E, 2I, …], got {list(gu.shape)}"
            + ("" if gus is None else f" with scales {list(gus.shape)}")
        )
    out = []
    for e in range(first, first + count):
        half, s_half = gu.shape[1] // 2, None if gus is None else gus.shape[1] // 2
        stem = f"{base}gate_up_proj[{e}]"
        out.append(
            _mlp_format(
                {
                    "gate": (gu[e, :half], None if gus is None else gus[e, :s_half], f"{stem} gate rows"),
                    "up": (gu[e, half:], None if gus is None else gus[e, s_half:], f"{stem} up rows"),
                    "down": (d[e], None if ds is None else ds[e], f"{base}down_proj[{e}]"),
                },
                f"{base}[{e}]",
            )
        )
    return out


def _read_checkpoint_experts(sd: Mapping, prefix: str, first: int, count: int) -> list[dict]:
    """Experts ``first … first+count−1`` in per-expert or fused keys, with consistent shapes (named if not)."""
    base = f"{prefix}experts."
    if f"{base}gate_up_proj" in sd or f"{base}down_proj" in sd:
        experts = _read_fused_experts(sd, base, first, count)
    else:
        experts = [_read_deepseek_mlp(sd, f"{base}{e}.") for e in range(first, first + count)]
    for m in experts[1:]:
        for part in _DS_NAMES:
            (w, _, name), (w0, _, name0) = m[part], experts[0][part]
            if w.shape != w0.shape:
                raise ValueError(
                    f"{name} has shape {list(w.shape)} but {name0} has {list(w0.shape)}: every "
                    "expert must have the same shapes"
                )
    return experts


def _read_checkpoint_shared(sd: Mapping, prefix: str) -> tuple[dict | None, torch.Tensor | None]:
    """The shared expert (DeepSeek ``shared_experts.`` or Qwen2-MoE ``shared_expert.``) and its gate, if any."""
    gate_key = f"{prefix}shared_expert_gate.weight"
    gate = _materialized(gate_key, sd[gate_key]) if gate_key in sd else None
    for base in (f"{prefix}shared_experts.", f"{prefix}shared_expert."):
        if any(k.startswith(base) for k in sd):
            return _read_deepseek_mlp(sd, base), gate
    if gate is not None:
        raise KeyError(f"state dict has {gate_key} but no {prefix}shared_expert.* weights")
    return None, None


def _check_hidden(state_dict, prefix: str, h: int, i: int, hidden_size) -> None:
    """H as read from the experts' down_proj [H, I] must be the model's: ``hidden_size`` when given, and the
    router's ``{prefix}gate.weight`` [E, H] when the checkpoint has it. Shapes alone cannot tell a checkpoint whose
    every expert weight is transposed from one with H and I swapped; these two can."""
    router = state_dict.get(f"{prefix}gate.weight")
    for what, want in (
        (
            f"{prefix}gate.weight (the router, [E, H])",
            router.shape[-1] if hasattr(router, "shape") and len(router.shape) == 2 else None,
        ),
        ("hidden_size", hidden_size),
    ):
        if want is not None and want != h:
            raise ValueError(
                f"{what} gives H = {want}, but the experts' down_proj gives H = {h} (and up_proj I = "
                f"{i}): are the expert weights transposed? Checkpoint linears are [out, in] "
                "(nn.Linear's weight)"
            )


def _common_format(fmts: list[str], what: str) -> str:
    if len(set(fmts)) != 1:
        raise ValueError(f"{what} mix weight formats {sorted(set(fmts))}")
    return fmts[0]


def _linear_in_format(w: torch.Tensor, s: torch.Tensor | None, src: str, target: str, name: str, device):
    """One checkpoint linear [N, K] → (weight, scale) in ``target`` (SPEC §1.2 layouts)."""
    w = w.to(device)
    s = None if s is None else s.to(device)
    n = w.shape[0]
    if src == "bf16":
        if target == "bf16":
            return _check_finite(name, w).to(torch.bfloat16), None
        return quantize_weight_fast(_check_finite(name, w), target, name=name)
    if src != target:
        raise ValueError(
            f"{name}: the checkpoint stores {src} weights; converting them to {target} would quantize "
            f"twice. Load them as {src} (weight_format=None) or dequantize them first."
        )
    if s is None:
        raise ValueError(f"{name}: {src} weights need a scale tensor (weight_scale_inv / scale)")
    if src == "fp8":
        k = w.shape[1]
        if k % WEIGHT_FP8_BLOCK:
            raise ValueError(f"{name}: K={k} must be a multiple of {WEIGHT_FP8_BLOCK} for fp8 weights")
        if s.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} scale: fp8 weight scales must be float32 (bf16/fp16 are widened), got {s.dtype}")
        kb = k // WEIGHT_FP8_BLOCK
        s = s.float()
        if tuple(s.shape) == (-(-n // WEIGHT_FP8_BLOCK), kb):
            s = expand_block_scales(s, n)  # 128×128 blocks → 1×128
        elif tuple(s.shape) != (n, kb):
            raise ValueError(
                f"{name}: fp8 scales must be 128×128 blocks [{-(-n // 128)}, {kb}] or 1×128 "
                f"[{n}, {kb}], got {list(s.shape)}"
            )
        return _normalize_weight(name, w, "fp8"), _normalize_scale(f"{name} scale", s.contiguous(), "fp8")
    w = as_uint8(w) if w.dtype != torch.int8 else w.view(torch.uint8)
    k = 2 * w.shape[1]
    s = _normalize_scale(f"{name} scale", s, "fp4")
    if tuple(s.shape) != (n, k // WEIGHT_FP4_BLOCK):
        raise ValueError(
            f"{name}: fp4 UE8M0 scales must be [{n}, {k // WEIGHT_FP4_BLOCK}] (1×32 along K), got {list(s.shape)}"
        )
    return w, s


def _mlp_in_format(m: dict, target: str, base: str, device) -> dict:
    """A checkpoint MLP → {"w13", "w13_scale", "w2", "w2_scale"} for one expert in ``target``."""
    conv = {
        part: _linear_in_format(m[part][0], m[part][1], m["format"], target, m[part][2], device)
        for part in ("gate", "up", "down")
    }
    (g, gs), (u, us), (d, ds) = conv["gate"], conv["up"], conv["down"]
    if g.shape != u.shape:
        raise ValueError(f"{base}: gate {list(g.shape)} and up {list(u.shape)} differ")
    return {
        "w13": torch.cat((g, u), dim=0),
        "w13_scale": None if gs is None else torch.cat((gs, us), dim=0),
        "w2": d,
        "w2_scale": ds,
    }
