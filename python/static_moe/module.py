"""StaticMoE: the routed experts (and optional shared expert) of one MoE layer, as an nn.Module.

``StaticMoE(...)(hidden, topk_idx, topk_weights)`` runs ``torch.ops.static_moe.forward`` on this rank's local
experts with routing from any router. Construction is collective over the EP group (it acquires the layer's
workspace, shared with every layer of the same spec on the same group); ``close()`` gives it back.

Weights (parameters, ``requires_grad=False``; layout "EOI" as nn.Linear stores them, SPEC §1.2):

=============  ==============================  =====================================================
name           shape                           dtype
=============  ==============================  =====================================================
``w13``        [L, 2I, H]  (fp4: [L, 2I, H/2])  bf16 / float8_e4m3fn / uint8 (two e2m1 per byte)
``w13_scale``  [L, 2I, H/128] / [L, 2I, H/32]   float32 (fp8) / uint8 UE8M0 (fp4); absent for bf16
``w2``         [L, H, I]   (fp4: [L, H, I/2])   as w13
``w2_scale``   [L, H, I/128] / [L, H, I/32]     as w13_scale
=============  ==============================  =====================================================

Ways to fill them: :meth:`StaticMoE.from_module` (grouped ``w1``/``w3``/``w2`` tensors, DTensor local shards
included, or a list of HF-style experts), :meth:`StaticMoE.from_deepseek_state_dict` (DeepSeek-style
checkpoints: fp8 with 128×128 block scales, fp4 e2m1 + UE8M0, bf16), :meth:`set_expert_weights`, or
``load_state_dict`` of a state dict saved from a StaticMoE.
"""

from __future__ import annotations

import math
import struct
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import workspace as _workspace
from .formats import (
    FP8_E4M3FN_MAX,
    WEIGHT_FP4_BLOCK,
    WEIGHT_FP8_BLOCK,
    as_uint8,
    dequantize_activation,
    expand_block_scales,
    quantize_activation,
    quantize_weight,
)
from .ops.forward import forward as _forward_op

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------------------
def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_swiglu_limit(name: str, limit) -> float | None:
    """None, or a finite positive number that stays finite and positive as a float32 (the kernels' type); the one
    rule and message of every entry point (formats.check_swiglu_limit, csrc/checks/common.h)."""
    from .formats import check_swiglu_limit

    return check_swiglu_limit(limit, name=name)


def _check_fp8_max(fp8_max) -> float:
    """A number in [2, 448]: the range of the experts' fp8 re-quantization (448 OCP e4m3fn, 240 trn2); the one
    rule and message of every entry point (formats.check_fp8_max, csrc/checks/common.h)."""
    from .formats import check_fp8_max

    return check_fp8_max(fp8_max)


def _materialized(name: str, t) -> torch.Tensor:
    """A plain local tensor with real storage: DTensors give their local shard; meta tensors are refused."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (shape {list(t.shape)}): materialise and load the weights first")
    return t


def _group_info(ep_group) -> tuple[int, int, str]:
    """(size, rank, name) of the EP group; None means a single rank, never WORLD by default."""
    if ep_group is not None:
        if not dist.is_initialized():
            raise ValueError("ep_group was given but torch.distributed is not initialised")
        return dist.get_world_size(ep_group), dist.get_rank(ep_group), ep_group.group_name
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("torch.distributed runs with several ranks: pass ep_group explicitly "
                         "(dist.group.WORLD to spread the experts over every rank)")
    return 1, 0, ""


def _check_ep_size(ep_size, group_size: int) -> None:
    """The optional ep_size argument must agree with the group (a single rank without a group)."""
    if ep_size is None:
        return
    _positive_int("ep_size", ep_size)
    if ep_size != group_size:
        raise ValueError(f"ep_size={ep_size} does not match the EP group's size ({group_size} rank"
                         f"{'s' if group_size > 1 else ''}; no ep_group means one)")


def _resolve_ep(ep_group, ep_size) -> tuple[int, int, str]:
    size, rank, name = _group_info(ep_group)
    _check_ep_size(ep_size, size)
    return size, rank, name


def _weight_shapes(num_local: int, hidden: int, inter: int, fmt: str) -> dict[str, tuple | None]:
    pack = 2 if fmt == "fp4" else 1
    block = {"bf16": None, "fp8": WEIGHT_FP8_BLOCK, "fp4": WEIGHT_FP4_BLOCK}[fmt]
    return {
        "w13": (num_local, 2 * inter, hidden // pack),
        "w13_scale": None if block is None else (num_local, 2 * inter, hidden // block),
        "w2": (num_local, hidden, inter // pack),
        "w2_scale": None if block is None else (num_local, hidden, inter // block),
    }


_WEIGHT_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.uint8}
_SCALE_DTYPE = {"fp8": torch.float32, "fp4": torch.uint8}


def _normalize_weight(name: str, t: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp4 views (float4_e2m1fn_x2) become uint8; anything else must already be the format's dtype."""
    if fmt == "fp4" and t.dtype in (torch.float4_e2m1fn_x2, torch.int8):
        t = t.view(torch.uint8)
    if t.dtype != _WEIGHT_DTYPE[fmt]:
        raise TypeError(f"{name} must be {_WEIGHT_DTYPE[fmt]} for {fmt} weights, got {t.dtype}")
    return t


def _normalize_scale(name: str, s: torch.Tensor | None, fmt: str) -> torch.Tensor | None:
    if fmt == "bf16":
        if s is not None:
            raise ValueError(f"{name} must be None for bf16 weights, got {s.dtype}{list(s.shape)}")
        return None
    if s is None:
        raise ValueError(f"{name} is required for {fmt} weights, got None")
    if fmt == "fp4":
        if s.dtype in (torch.float8_e8m0fnu, torch.int8):
            s = s.view(torch.uint8)
        if s.dtype == torch.uint8 and bool((s == 255).any()):
            raise ValueError(f"{name}: UE8M0 byte 255 (NaN) is not a valid scale")
    if s.dtype != _SCALE_DTYPE[fmt]:
        raise TypeError(f"{name} must be {_SCALE_DTYPE[fmt]} for {fmt} weights, got {s.dtype}")
    if fmt == "fp8" and not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}: fp8 weight scales must be finite")
    return s


# ----------------------------------------------------------------------------------------------------------------
# The shared expert: one SwiGLU MLP, run through the same op as the routed experts
# ----------------------------------------------------------------------------------------------------------------
class SharedExpert(nn.Module):
    """A SwiGLU MLP ``down(silu(gate(x)) · up(x))`` applied to every token, in bf16 / fp8 / fp4 weights.

    Stored as one expert in the routed layout (``w13 [1, 2I, H]``, ``w2 [1, H, I]`` + scales) and computed by
    ``torch.ops.static_moe.local_experts`` with every row routed to it at weight 1, so it has exactly the routed
    experts' numerics (SPEC §1.7) and every backend's kernels. Returns float32 [T, H]. ``fp8_max``: as
    :class:`StaticMoE`'s (240 on trn2), used with fp8 activations.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, weight_format: str = "bf16",
                 swiglu_limit: float | None = None, fp8_max: float = FP8_E4M3FN_MAX, device=None):
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.intermediate_size = _positive_int("shared intermediate_size", intermediate_size)
        if hidden_size % 128 or intermediate_size % 128:
            raise ValueError(f"shared expert sizes must be multiples of 128, got hidden {hidden_size}, "
                             f"intermediate {intermediate_size}")
        if weight_format not in _workspace.WEIGHT_FORMATS:
            raise ValueError(f"shared weight_format must be one of {_workspace.WEIGHT_FORMATS}, got {weight_format!r}")
        self.weight_format = weight_format
        self.swiglu_limit = _check_swiglu_limit("shared swiglu_limit", swiglu_limit)
        self.fp8_max = _check_fp8_max(fp8_max)
        _init_weights(self, 1, hidden_size, intermediate_size, weight_format, device)

    def set_weights(self, w13, w13_scale, w2, w2_scale) -> None:
        """Copy ``w13 [1, 2I, H]``, ``w2 [1, H, I]`` (+ scales) in this expert's format (checked)."""
        _copy_weights(self, "shared expert", self.hidden_size, self.intermediate_size, 1, self.weight_format,
                      w13, w13_scale, w2, w2_scale)

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[0]
        idx = torch.zeros((t, 1), dtype=torch.int32, device=x.device)
        weights = torch.ones((t, 1), dtype=torch.float32, device=x.device)
        return torch.ops.static_moe.local_experts(x, x_scale, idx, weights, self.w13, self.w13_scale, self.w2,
                                                  self.w2_scale, 0, self.swiglu_limit, self.fp8_max)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"weight_format={self.weight_format!r}, swiglu_limit={self.swiglu_limit}")


def _init_weights(module: nn.Module, num_local, hidden, inter, fmt, device) -> None:
    """Zero parameters in ``fmt`` (a layer computes zeros until weights are loaded)."""
    for name, shape in _weight_shapes(num_local, hidden, inter, fmt).items():
        if shape is None:
            module.register_parameter(name, None)
            continue
        dtype = _SCALE_DTYPE[fmt] if name.endswith("_scale") else _WEIGHT_DTYPE[fmt]
        t = torch.zeros(shape, dtype=dtype, device=device)
        if name.endswith("_scale") and fmt == "fp8":
            t.fill_(1.0)
        module.register_parameter(name, nn.Parameter(t, requires_grad=False))


def _copy_weights(module: nn.Module, what: str, hidden, inter, num_local, fmt, w13, w13_scale, w2, w2_scale):
    shapes = _weight_shapes(num_local, hidden, inter, fmt)
    given = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
    checked = {}
    for name, t in given.items():
        label = f"{what} {name}"
        if name.endswith("_scale"):
            t = None if t is None else _materialized(label, t)
            t = _normalize_scale(label, t, fmt)
        else:
            t = _normalize_weight(label, _materialized(label, t), fmt)
        if shapes[name] is not None and tuple(t.shape) != shapes[name]:
            raise ValueError(f"{label} must have shape {list(shapes[name])} ({fmt}), got {list(t.shape)}")
        checked[name] = t
    with torch.no_grad():
        for name, t in checked.items():
            if t is not None:
                getattr(module, name).copy_(t)


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------
class StaticMoE(nn.Module):
    """Expert-parallel static-shape MoE layer (routed experts + optional shared expert) for decode.

    Args:
        hidden_size: H (multiple of 128).
        intermediate_size: I of each routed expert (multiple of 128).
        num_experts: E, global routed experts; this rank owns L = E / ep_size, global ids ep_rank·L … +L−1.
        top_k: routing slots per token (k ≤ E).
        capacity: C, the most tokens a rank passes per call; every collective is sized by it.
        weight_format: "bf16", "fp8" or "fp4" for the routed experts.
        act_format: "bf16" or "fp8": what the experts consume; bf16 hidden states are quantized per SPEC §1.1
            with ``act_group`` (32 or 128) when "fp8".
        swiglu_limit: optional SwiGLU clamp (SPEC §1.4).
        fp8_max: with act_format "fp8", the range of the experts' fp8 re-quantization of the SwiGLU output
            (SPEC §1.5, §1.7; shared expert included), in (0, 448]. 448 (default) is OCP float8_e4m3fn; use 240
            on Trainium2 (trn2), whose on-chip float8_e4m3 tops out at 240 — its kernels refuse 448 rather than
            change the numerics. Hidden states are still quantized with 448 (every backend decodes e4m3fn up to
            448). Unused with act_format "bf16".
        shared_intermediate_size: I of the shared expert, or None for no shared expert.
        shared_weight_format: its format (default: weight_format); shared_swiglu_limit: its clamp (default:
            swiglu_limit).
        ep_group: the EP process group (None: a single rank; with several ranks initialised it must be given).
        ep_size: optional check against the group's size.
        device: where weights and workspace live. Construction is collective over ep_group.

    ``forward(hidden, topk_idx, topk_weights)``: hidden bf16 [..., H] (or, with act_format "fp8", a tuple
    ``(x_q float8_e4m3fn [..., H], x_s float32 [..., H/act_group])``), topk_idx int32/int64 [T, k] global ids or
    −1, topk_weights float32/bf16 [T, k], T = hidden's rows ≤ capacity. Returns bf16 with hidden's leading
    shape. Every rank of the EP group must call it each step (T = 0 is fine).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, capacity: int, *,
                 weight_format: str = "bf16", act_format: str = "bf16", act_group: int = 128,
                 swiglu_limit: float | None = None, shared_intermediate_size: int | None = None,
                 shared_weight_format: str | None = None, shared_swiglu_limit: float | None | str = "same",
                 ep_group=None, ep_size: int | None = None, device=None, fp8_max: float = FP8_E4M3FN_MAX):
        super().__init__()
        self.ep_size, self.ep_rank, self.group_name = _group_info(ep_group)
        self._closed = True  # until the workspace lease is held
        error = None
        try:
            _check_ep_size(ep_size, self.ep_size)
            self._configure(hidden_size, intermediate_size, num_experts, top_k, capacity, weight_format,
                            act_format, act_group, swiglu_limit, shared_intermediate_size, shared_weight_format,
                            shared_swiglu_limit, device, fp8_max)
        except (ValueError, TypeError) as e:
            error = e
        if self.ep_size > 1:
            # Every rank learns whether any rank's arguments were rejected, so no rank waits alone below.
            _workspace.converge(ep_group, error, "StaticMoE construction")
        elif error is not None:
            raise error
        self._lease = _workspace.acquire(self.workspace_spec, ep_group)
        self._closed = False

    def _configure(self, hidden_size, intermediate_size, num_experts, top_k, capacity, weight_format, act_format,
                   act_group, swiglu_limit, shared_intermediate_size, shared_weight_format, shared_swiglu_limit,
                   device, fp8_max):
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type == "meta":
            raise ValueError("StaticMoE cannot live on the meta device: it owns a workspace of real buffers; "
                             "build it on the target device and load weights")
        self._device = device
        self.swiglu_limit = _check_swiglu_limit("swiglu_limit", swiglu_limit)
        self.fp8_max = _check_fp8_max(fp8_max)
        # WorkspaceSpec checks sizes, divisibility, formats and the format pair.
        self.workspace_spec = _workspace.WorkspaceSpec(
            capacity=capacity, hidden=hidden_size, intermediate=intermediate_size, num_experts=num_experts,
            topk=top_k, ep_size=self.ep_size, act_format=act_format, act_group=act_group,
            weight_format=weight_format, device=str(device))
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.capacity = num_experts, top_k, capacity
        self.num_local_experts = num_experts // self.ep_size
        self.weight_format, self.act_format = weight_format, act_format
        self.act_group = act_group if act_format == "fp8" else None
        _init_weights(self, self.num_local_experts, hidden_size, intermediate_size, weight_format, device)
        if shared_intermediate_size is not None:
            limit = self.swiglu_limit if shared_swiglu_limit == "same" else shared_swiglu_limit
            self.shared = SharedExpert(hidden_size, shared_intermediate_size,
                                       weight_format=shared_weight_format or weight_format, swiglu_limit=limit,
                                       fp8_max=self.fp8_max, device=device)
        else:
            if shared_weight_format is not None:
                raise ValueError("shared_weight_format was given without shared_intermediate_size")
            self.shared = None

    # --- weights -----------------------------------------------------------------------------------------------
    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first local expert."""
        return self.ep_rank * self.num_local_experts

    def set_expert_weights(self, w13, w13_scale, w2, w2_scale) -> None:
        """Copy this rank's routed expert weights (format, shapes and devices checked; see the module doc)."""
        _copy_weights(self, "routed", self.hidden_size, self.intermediate_size, self.num_local_experts,
                      self.weight_format, w13, w13_scale, w2, w2_scale)

    @classmethod
    def from_module(cls, module, *, top_k: int, capacity: int, num_experts: int | None = None,
                    weight_format: str = "bf16", shared_expert: nn.Module | None = None, ep_group=None,
                    ep_size: int | None = None, **options) -> "StaticMoE":
        """Convert existing SwiGLU experts (float weights; quantized to ``weight_format`` on the way).

        ``module`` is either
          (a) grouped experts with tensors ``w1``, ``w3`` [L, I, H] and ``w2`` [L, H, I] (DTensor EP shards give
              their local shard; they are this rank's L experts), or
          (b) HF-style experts: an iterable of modules with ``gate_proj``/``up_proj``/``down_proj`` nn.Linear
              (or a module whose ``experts`` is one). A list of all E experts (entries of other ranks may be
              None) gives this rank experts ep_rank·L … +L−1; a list of L is this rank's own.
        ``shared_expert``: optional module with ``gate_proj``/``up_proj``/``down_proj`` (or ``w1``/``w3``/``w2``)
        nn.Linear. ``options`` are passed to the constructor (act_format, swiglu_limit, device, ...).
        Meta tensors are refused. Optimizer state and gradients are not carried over.
        """
        size, rank, _ = _resolve_ep(ep_group, ep_size)
        gate, up, down = _experts_from_module(module, num_experts, size, rank)
        h, i, num_local = gate.shape[2], gate.shape[1], gate.shape[0]
        if num_experts is None:
            num_experts = num_local * size
        options.setdefault("device", gate.device)
        shared = None
        if shared_expert is not None:
            shared = _linears_of(shared_expert, "shared_expert")
            options.setdefault("shared_intermediate_size", shared[0].shape[0])
        layer = cls(h, i, num_experts, top_k, capacity, weight_format=weight_format, ep_group=ep_group,
                    ep_size=ep_size, **options)
        layer._load_float_experts(gate, up, down)
        if shared is not None:
            if layer.shared is None:
                raise ValueError("shared_expert was given but shared_intermediate_size=None was passed")
            layer._load_float_shared(*shared)
        return layer

    def _load_float_experts(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        w13 = torch.cat((gate, up), dim=1)
        w13_q, w13_s = quantize_weight(w13.to(self.w13.device), self.weight_format)
        w2_q, w2_s = quantize_weight(down.to(self.w13.device), self.weight_format)
        self.set_expert_weights(w13_q, w13_s, w2_q, w2_s)

    def _load_float_shared(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        w13 = torch.cat((gate, up), dim=0)[None]
        fmt = self.shared.weight_format
        w13_q, w13_s = quantize_weight(w13.to(self.w13.device), fmt)
        w2_q, w2_s = quantize_weight(down[None].to(self.w13.device), fmt)
        self.shared.set_weights(w13_q, w13_s, w2_q, w2_s)

    @classmethod
    def from_deepseek_state_dict(cls, state_dict: Mapping[str, torch.Tensor], *, top_k: int, capacity: int,
                                 num_experts: int, prefix: str = "", weight_format: str | None = None,
                                 shared_weight_format: str | None = None, ep_group=None,
                                 ep_size: int | None = None, **options) -> "StaticMoE":
        """Build a layer from a DeepSeek-style checkpoint's MoE block (only this rank's experts are read).

        Keys ``{prefix}experts.{e}.{w1|gate_proj}.weight`` / ``{w3|up_proj}`` / ``{w2|down_proj}`` with optional
        scales ``….weight_scale_inv`` / ``….scale`` / ``….weight_scale``, and the same under
        ``{prefix}shared_experts.`` for a shared expert (used when present). Per weight:
          * bf16 / fp16 / fp32: float weights; kept as bf16, or quantized when ``weight_format`` asks for fp8/fp4;
          * float8_e4m3fn with 128×128 block scales [⌈N/128⌉, K/128] (expanded to 1×128) or 1×128 scales
            [N, K/128]; values are ``q · s``;
          * fp4: uint8 / int8 / float4_e2m1fn_x2 [N, K/2] with UE8M0 scales uint8 / float8_e8m0fnu [N, K/32]
            (byte 255 rejected).
        ``weight_format`` None keeps the checkpoint's format; a quantized checkpoint is never re-quantized to
        another format (ValueError).
        """
        size, rank, _ = _resolve_ep(ep_group, ep_size)
        _positive_int("num_experts", num_experts)
        if num_experts % size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({size})")
        num_local = num_experts // size
        experts = [_read_deepseek_mlp(state_dict, f"{prefix}experts.{rank * num_local + e}.")
                   for e in range(num_local)]
        fmt = _common_format([m["format"] for m in experts], "routed experts")
        target = weight_format or fmt
        shared_key = f"{prefix}shared_experts."
        shared = None
        if any(k.startswith(shared_key) for k in state_dict):
            shared = _read_deepseek_mlp(state_dict, shared_key)
            options.setdefault("shared_intermediate_size", shared["up"][0].shape[0])
            shared_weight_format = shared_weight_format or (shared["format"] if weight_format is None else target)
        h = experts[0]["down"][0].shape[0]
        i = experts[0]["up"][0].shape[0]
        options.setdefault("device", experts[0]["up"][0].device)
        layer = cls(h, i, num_experts, top_k, capacity, weight_format=target, ep_group=ep_group, ep_size=ep_size,
                    shared_weight_format=shared_weight_format, **options)
        w = [_mlp_in_format(m, target, f"{prefix}experts.{rank * num_local + e}.", layer.w13.device)
             for e, m in enumerate(experts)]
        stack = lambda key: None if w[0][key] is None else torch.stack([m[key] for m in w])  # noqa: E731
        layer.set_expert_weights(stack("w13"), stack("w13_scale"), stack("w2"), stack("w2_scale"))
        if shared is not None:
            if layer.shared is None:
                raise ValueError(f"the state dict has {shared_key}* keys but shared_intermediate_size=None was passed")
            m = _mlp_in_format(shared, layer.shared.weight_format, shared_key, layer.w13.device)
            lift = lambda t: None if t is None else t[None]  # noqa: E731
            layer.shared.set_weights(lift(m["w13"]), lift(m["w13_scale"]), lift(m["w2"]), lift(m["w2_scale"]))
        return layer

    # --- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def workspace(self) -> _workspace.Workspace:
        """The (shared) workspace this layer holds a lease on; RuntimeError after close()."""
        if self._closed:
            raise RuntimeError("this StaticMoE layer is closed: its workspace lease was given back")
        return self._lease.workspace

    def memory_plan(self) -> _workspace.MemoryPlan:
        return _workspace.memory_plan(self.workspace_spec)

    def close(self) -> None:
        """Give the workspace lease back (idempotent); the last layer on a workspace frees its buffers."""
        if not self._closed:
            self._closed = True
            self._lease.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- compute -----------------------------------------------------------------------------------------------
    def _activations(self, hidden):
        """(x [T, H] in the experts' format, x_scale or None, leading shape, bf16 view for a bf16 shared expert)."""
        h = self.hidden_size
        if isinstance(hidden, (tuple, list)):
            if self.act_format != "fp8" or len(hidden) != 2:
                raise TypeError("hidden may be a tuple (x_q, x_s) only with act_format='fp8'")
            x_q, x_s = hidden
            if x_q.dtype != torch.float8_e4m3fn or x_q.shape[-1] != h:
                raise ValueError(f"hidden[0] must be float8_e4m3fn [..., {h}], got {x_q.dtype}{list(x_q.shape)}")
            g = self.act_group
            if x_s.dtype != torch.float32 or tuple(x_s.shape) != (*x_q.shape[:-1], h // g):
                raise ValueError(f"hidden[1] must be float32 [..., {h // g}] (act_group {g}), "
                                 f"got {x_s.dtype}{list(x_s.shape)}")
            lead = x_q.shape[:-1]
            return x_q.reshape(-1, h), x_s.reshape(-1, h // g), lead, None
        if not isinstance(hidden, torch.Tensor) or hidden.dtype != torch.bfloat16 or hidden.dim() < 1 \
                or hidden.shape[-1] != h:
            got = f"{hidden.dtype}{list(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be bf16 [..., {h}], got {got}")
        lead = hidden.shape[:-1]
        x = hidden.reshape(-1, h)
        if self.act_format == "fp8":
            x_q, x_s = quantize_activation(x, self.act_group)
            return x_q, x_s, lead, x
        return x, None, lead, x

    def forward(self, hidden, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this StaticMoE layer is closed: its workspace lease was given back")
        x, x_scale, lead, x_bf16 = self._activations(hidden)
        t = x.shape[0]
        if t > self.capacity:
            raise ValueError(f"StaticMoE: {t} tokens exceed the capacity of {self.capacity}")
        if tuple(topk_idx.shape) != (t, self.top_k) or tuple(topk_weights.shape) != (t, self.top_k):
            raise ValueError(f"topk_idx and topk_weights must be [T={t}, top_k={self.top_k}], got "
                             f"{list(topk_idx.shape)} and {list(topk_weights.shape)}")
        if self.w13.device != self._device:
            raise RuntimeError(f"this layer was built for {self._device} (its workspace lives there) but its weights "
                               f"are now on {self.w13.device}; construct the layer on the target device instead "
                               "of moving it")
        if x.device != self._device:
            raise ValueError(f"hidden is on {x.device} but this layer's weights and workspace are on {self._device}")
        shared_out = None
        if self.shared is not None:
            if self.shared.weight_format == "bf16":
                sx = x_bf16 if x_bf16 is not None else dequantize_activation(x, x_scale).to(torch.bfloat16)
                shared_out = self.shared(sx, None)
            else:
                shared_out = self.shared(x, x_scale)
        out = _forward_op(x, x_scale, topk_idx, topk_weights, self.w13, self.w13_scale, self.w2, self.w2_scale,
                          shared_out, num_experts=self.num_experts, capacity=self.capacity,
                          swiglu_limit=self.swiglu_limit, group_name=self.group_name, ep_rank=self.ep_rank,
                          ep_size=self.ep_size, fp8_max=self.fp8_max)
        return out.reshape(*lead, self.hidden_size)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts} (local {self.num_local_experts} from {self.expert_offset}), "
                f"top_k={self.top_k}, capacity={self.capacity}, weight_format={self.weight_format!r}, "
                f"act_format={self.act_format!r}" + (f", act_group={self.act_group}" if self.act_group else "")
                + (f", fp8_max={self.fp8_max}" if self.act_group else "")
                + f", swiglu_limit={self.swiglu_limit}, ep={self.ep_rank}/{self.ep_size}")


# ----------------------------------------------------------------------------------------------------------------
# Conversion helpers
# ----------------------------------------------------------------------------------------------------------------
def _float_weight(name: str, t) -> torch.Tensor:
    t = _materialized(name, t)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float weight (bf16/fp16/fp32) to convert, got {t.dtype}; "
                        "quantized checkpoints load with StaticMoE.from_deepseek_state_dict")
    return t.detach()


def _linears_of(expert, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) of a SwiGLU MLP with HF (gate/up/down_proj) or DeepSeek (w1/w3/w2)
    names."""
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        mods = [getattr(expert, n, None) for n in names]
        if all(m is not None for m in mods):
            ws = [_float_weight(f"{what}.{n}.weight", getattr(m, "weight", m)) for n, m in zip(names, mods)]
            gate, up, down = ws
            if gate.dim() != 2 or up.shape != gate.shape or tuple(down.shape) != (gate.shape[1], gate.shape[0]):
                raise ValueError(f"{what}: expected gate/up [I, H] and down [H, I], got {list(gate.shape)}, "
                                 f"{list(up.shape)}, {list(down.shape)}")
            if len({gate.device, up.device, down.device}) != 1:
                raise ValueError(f"{what}: gate, up and down weights must share one device")
            if any(getattr(m, "bias", None) is not None for m in mods):
                raise ValueError(f"{what}: biased projections are not supported (SwiGLU experts have no bias)")
            return gate, up, down
    raise TypeError(f"{what} must have gate_proj/up_proj/down_proj or w1/w3/w2 projections, "
                    f"got {type(expert).__name__}")


def _experts_from_module(module, num_experts, size, rank):
    """This rank's experts as float (gate [L, I, H], up [L, I, H], down [L, H, I])."""
    if all(hasattr(module, n) for n in ("w1", "w2", "w3")) and isinstance(
            _maybe_local(getattr(module, "w1")), torch.Tensor) and _maybe_local(getattr(module, "w1")).dim() == 3:
        gate, up, down = (_float_weight(f"source {n}", getattr(module, n)) for n in ("w1", "w3", "w2"))
        if up.shape != gate.shape or tuple(down.shape) != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(f"source expects w1/w3 [L, I, H] and w2 [L, H, I], got {list(gate.shape)}, "
                             f"{list(up.shape)}, {list(down.shape)}")
        if len({gate.device, up.device, down.device}) != 1:
            raise ValueError("source w1, w3 and w2 must share one device")
        if num_experts is not None and num_experts != gate.shape[0] * size:
            raise ValueError(f"source holds {gate.shape[0]} local experts, but num_experts={num_experts} over "
                             f"ep_size={size} needs {num_experts // size if num_experts % size == 0 else '?'}")
        return gate, up, down
    experts = getattr(module, "experts", module)
    if isinstance(experts, nn.Module) and not isinstance(experts, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"module must be grouped experts (w1/w3/w2 tensors) or a list of HF-style experts, "
                        f"got {type(module).__name__}")
    if not isinstance(experts, Iterable):
        raise TypeError(f"module must be grouped experts or a list of experts, got {type(module).__name__}")
    experts = list(experts)
    n = len(experts)
    if n == 0:
        raise ValueError("the experts list is empty")
    if num_experts is None or n == num_experts // size and n != num_experts:
        local = experts  # this rank's own
        if num_experts is not None and n * size != num_experts:
            raise ValueError(f"{n} experts given; num_experts={num_experts} over ep_size={size}")
        first = 0
    elif n == num_experts:
        if num_experts % size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({size})")
        num_local = num_experts // size
        first = rank * num_local
        local = experts[first: first + num_local]
    else:
        raise ValueError(f"{n} experts given: expected all num_experts={num_experts} (global order) or this "
                         f"rank's {num_experts // size if num_experts % size == 0 else '?'}")
    mats = []
    for j, e in enumerate(local):
        if e is None:
            raise ValueError(f"expert {first + j} (owned by this rank) is None")
        mats.append(_linears_of(e, f"experts[{first + j}]"))
    shapes = {tuple(m[0].shape) for m in mats}
    if len(shapes) != 1 or len({m[0].device for m in mats}) != 1:
        raise ValueError("every expert must have the same shapes and device")
    return tuple(torch.stack([m[i] for m in mats]) for i in range(3))


def _maybe_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


_DS_NAMES = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
_DS_SCALE_SUFFIXES = ("weight_scale_inv", "scale", "weight_scale")


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


def _read_deepseek_mlp(sd: Mapping[str, torch.Tensor], base: str) -> dict:
    """{"gate"|"up"|"down": (weight, scale or None), "format": ...} of one SwiGLU MLP in a checkpoint."""
    out = {}
    for part, names in _DS_NAMES.items():
        for n in names:
            if f"{base}{n}.weight" in sd:
                w = _materialized(f"{base}{n}.weight", sd[f"{base}{n}.weight"])
                s = next((sd[f"{base}{n}.{x}"] for x in _DS_SCALE_SUFFIXES if f"{base}{n}.{x}" in sd), None)
                s = None if s is None else _materialized(f"{base}{n} scale", s)
                out[part] = (w, s, f"{base}{n}")
                break
        else:
            raise KeyError(f"state dict has no {base}{{{'|'.join(names)}}}.weight")
    fmts = {_tensor_format(name, w, s) for w, s, name in out.values()}
    if len(fmts) != 1:
        raise ValueError(f"{base}*: gate/up/down weights mix formats {sorted(fmts)}")
    out["format"] = fmts.pop()
    return out


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
        return quantize_weight(w.float(), target) if target != "bf16" else (w.to(torch.bfloat16), None)
    if src != target:
        raise ValueError(f"{name}: the checkpoint stores {src} weights; converting them to {target} would quantize "
                         f"twice. Load them as {src} (weight_format=None) or dequantize them first.")
    if s is None:
        raise ValueError(f"{name}: {src} weights need a scale tensor (weight_scale_inv / scale)")
    if src == "fp8":
        k = w.shape[1]
        if k % WEIGHT_FP8_BLOCK:
            raise ValueError(f"{name}: K={k} must be a multiple of {WEIGHT_FP8_BLOCK} for fp8 weights")
        kb = k // WEIGHT_FP8_BLOCK
        if s.dtype != torch.float32 and s.dtype in _FLOAT_DTYPES:
            s = s.float()
        if tuple(s.shape) == (-(-n // WEIGHT_FP8_BLOCK), kb):
            s = expand_block_scales(s, n)  # 128×128 blocks → 1×128
        elif tuple(s.shape) != (n, kb):
            raise ValueError(f"{name}: fp8 scales must be 128×128 blocks [{-(-n // 128)}, {kb}] or 1×128 "
                             f"[{n}, {kb}], got {list(s.shape)}")
        return w, _normalize_scale(f"{name} scale", s.contiguous(), "fp8")
    w = as_uint8(w) if w.dtype != torch.int8 else w.view(torch.uint8)
    k = 2 * w.shape[1]
    s = _normalize_scale(f"{name} scale", s, "fp4")
    if tuple(s.shape) != (n, k // WEIGHT_FP4_BLOCK):
        raise ValueError(f"{name}: fp4 UE8M0 scales must be [{n}, {k // WEIGHT_FP4_BLOCK}] (1×32 along K), "
                         f"got {list(s.shape)}")
    return w, s


def _mlp_in_format(m: dict, target: str, base: str, device) -> dict:
    """A checkpoint MLP → {"w13", "w13_scale", "w2", "w2_scale"} for one expert in ``target``."""
    conv = {part: _linear_in_format(m[part][0], m[part][1], m["format"], target, m[part][2], device)
            for part in ("gate", "up", "down")}
    (g, gs), (u, us), (d, ds) = conv["gate"], conv["up"], conv["down"]
    if g.shape != u.shape:
        raise ValueError(f"{base}: gate {list(g.shape)} and up {list(u.shape)} differ")
    return {"w13": torch.cat((g, u), dim=0), "w13_scale": None if gs is None else torch.cat((gs, us), dim=0),
            "w2": d, "w2_scale": ds}
