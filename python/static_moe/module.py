"""StaticMoE: the routed experts (and optional shared expert) of one MoE layer, as an nn.Module.

``StaticMoE(...)(hidden, topk_idx, topk_weights)`` runs ``torch.ops.static_moe.forward`` on this rank's local
experts with routing from any router. Construction is collective over the EP group (it acquires the layer's
workspace, shared with every layer of the same spec on the same group); ``close()`` gives it back.

Weights (parameters, ``requires_grad=False``), given and saved in layout "EOI" as nn.Linear stores them
(SPEC §1.2):

=============  ==============================  =====================================================
name           shape                           dtype
=============  ==============================  =====================================================
``w13``        [L, 2I, H]  (fp4: [L, 2I, H/2])  bf16 / float8_e4m3fn / uint8 (two e2m1 per byte)
``w13_scale``  [L, 2I, H/128] / [L, 2I, H/32]   float32 (fp8) / uint8 UE8M0 (fp4); absent for bf16
``w2``         [L, H, I]   (fp4: [L, H, I/2])   as w13
``w2_scale``   [L, H, I/128] / [L, H, I/32]     as w13_scale
=============  ==============================  =====================================================

Ways to fill them: :meth:`StaticMoE.from_module` (transformers 5.x fused ``gate_up_proj``/``down_proj``, grouped
``w1``/``w3``/``w2`` tensors, DTensor local shards included, or a list of MLPs; a shared expert and its gate),
:meth:`StaticMoE.from_deepseek_state_dict` (checkpoints: per-expert or fused keys; fp8 with 128×128 block scales,
fp4 e2m1 + UE8M0, bf16), :meth:`set_expert_weights`, or ``load_state_dict`` (validated like set_expert_weights).
The ``from_*`` constructors are collective over the EP group: an error on one rank raises on every rank. Their
bodies are the loaders of ``static_moe.loaders``, one module per source.

Prepared layout (SPEC §1.2): a layer holds its weights in the layout its device's kernels read — EOI (the table
above) on CPU and CUDA; for trn2 / trn3 the K-major EIO forms of
``static_moe.layouts`` (w13 [L, H, 2I], w2 [L, I, H]; fp4 uint16 [L, K/4, N]), with fp8 re-encoded for trn2
(``reencode_fp8_for_trn2``) and, on trn3, the MX form (uint32 + UE8M0) when every fp8 scale is a power of two
and the activations are fp8 (plain K-major fp8 for bf16 activations: static_moe.layouts.prepare_weight).
``prepare_for=`` ("cpu", "cuda", "trn2", "trn3") asks for a target explicitly, whatever the device (e.g. to
run the Neuron path on CPU tensors through the reference or the NKI interpreter); on a Neuron device (xla /
neuron / privateuseone) it is required ("trn2" or "trn3": the device does not tell them apart). Every loader
prepares the same way; ``weight_layout`` says the result, ``expert_weights()`` gives the weights back in EOI, and
``state_dict()`` always saves the EOI layout, so a state dict loads into a layer prepared for any device. On trn2
the saved fp8 weights are the re-encoded ones: the same values except at ``layouts.TRN2_INEXACT_CODES`` (those
blocks' codes halved and scales doubled; loading them again changes nothing).
``static_moe.integrations.transformers.replace_moe_blocks`` does the conversion for a whole transformers model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import host_memory
from . import workspace as _workspace
from .activations import DEFAULT_ALPHA, check_activation
from .expert_parallel import choose_dispatch
from .formats import (
    FP8_E4M3_TRN2_MAX,
    FP8_E4M3FN_MAX,
    WEIGHT_FP4_BLOCK,
    WEIGHT_FP8_BLOCK,
    dequantize_activation,
    quantize_activation,
)
from .layouts import check_target, prepare_expert_weights, target_layout, to_eoi
from .ops.forward import as_dtype, report_failure
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


def ep_group_info(ep_group, ep_size: int | None = None) -> tuple[int, int, str]:
    """(size, rank, name) of the EP group; None means a single rank, never WORLD by default.

    With several ranks initialised and no group, ``ep_size=1`` says so on purpose: a layer of this rank alone, with
    no collective (each tensor-parallel rank's slice of the experts, as in vLLM's TP). Without it the omission is
    refused, so that a forgotten group does not silently run every rank on its own."""
    if ep_group is not None:
        if not dist.is_initialized():
            raise ValueError("ep_group was given but torch.distributed is not initialised")
        return dist.get_world_size(ep_group), dist.get_rank(ep_group), ep_group.group_name
    if dist.is_initialized() and dist.get_world_size() > 1 and ep_size != 1:
        raise ValueError(
            "torch.distributed runs with several ranks: pass ep_group explicitly "
            "(dist.group.WORLD to spread the experts over every rank), or ep_size=1 for a layer of this rank alone"
        )
    return 1, 0, ""


def _check_ep_size(ep_size, group_size: int) -> None:
    """The optional ep_size argument must agree with the group (a single rank without a group)."""
    if ep_size is None:
        return
    _positive_int("ep_size", ep_size)
    if ep_size != group_size:
        raise ValueError(
            f"ep_size={ep_size} does not match the EP group's size ({group_size} rank"
            f"{'s' if group_size > 1 else ''}; no ep_group means one)"
        )


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
    if fmt == "fp8" and t.numel() and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name}: float8_e4m3fn bytes 0x7F/0xFF are NaN, not weights")
    return t


def _check_finite(name: str, t: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Refuse NaN/Inf in a float weight before it is quantized (a quantizer would turn it into finite garbage).
    For stacked weights [E, N, K] the message names the bad experts (``first``: global id of index 0)."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        where = ""
        if t.dim() == 3:
            bad = (~torch.isfinite(t)).flatten(1).any(dim=1).nonzero().flatten().add(first).tolist()
            where = f" (expert{'s' if len(bad) > 1 else ''} {bad[:8]}{' …' if len(bad) > 8 else ''})"
        raise ValueError(f"{name} has NaN or Inf values{where}: refusing to convert non-finite weights")
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
# Formats fixed at construction
# ----------------------------------------------------------------------------------------------------------------
class _FixedFormats(nn.Module):
    """A module whose parameter dtypes are its formats, fixed at construction.

    ``.to(torch.bfloat16)``, ``.half()``, ``.float()`` (and a whole model's ``.to(dtype)``) leave every parameter's
    dtype as it is: float8 weights and float32 scales count as floating in ``nn.Module._apply`` and would otherwise
    be converted into something the kernels refuse. Device moves still apply (StaticMoE then refuses, at its next
    forward, a move its workspace cannot follow).
    """

    # The device the weights are prepared for (SPEC §1.2 "prepared layout"): "cpu" / "cuda" keep nn.Linear's EOI,
    # "trn2" / "trn3" hold the K-major EIO forms of static_moe.layouts. Set before the weights are created.
    prepare_for: str = "cpu"
    # The activation format the weights are multiplied with ("bf16", "fp8", None: not known). It only chooses
    # trn3's fp8 form (static_moe.layouts.prepare_weight: plain K-major fp8 for bf16, MX for fp8 when pow2).
    prepare_act: str | None = None
    # Whether the load_state_dict under way was asked strict=True (set by our load_state_dict around nn.Module's).
    _strict_load: bool = False

    @property
    def weight_layout(self) -> str:
        """The layout the weights are held in and handed to the op: "eoi" (CPU, CUDA) or "eio" (Neuron)."""
        return target_layout(self.prepare_for)

    def expert_weights(self) -> dict:
        """The weights in EOI (nn.Linear) form, whatever layout they are held in: {"w13", "w13_scale", "w2",
        "w2_scale"} → tensor or None (bf16 has no scales). EOI-held weights are returned as they are (no copy);
        prepared ones are converted back exactly (new tensors). On trn2, fp8 blocks that were re-encoded at load
        come back re-encoded (static_moe.layouts.reencode_fp8_for_trn2: the same values except the documented
        smallest codes); on trn3, MX fp8 comes back as float8_e4m3fn with float32 power-of-two scales."""
        held = {n: getattr(self, n) for n in _WEIGHT_NAMES}
        if self.weight_layout == "eoi":
            return held
        w13, s13 = to_eoi(held["w13"].detach(), None if held["w13_scale"] is None else held["w13_scale"].detach())
        w2, s2 = to_eoi(held["w2"].detach(), None if held["w2_scale"] is None else held["w2_scale"].detach())
        return {"w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The saved layout is always EOI (nn.Linear's, SPEC §1.2), so a state dict loads into a layer prepared for
        # any device; prepared weights are converted back exactly (a copy per tensor while saving).
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight_layout != "eoi":
            for name, t in self.expert_weights().items():
                if t is not None:
                    destination[prefix + name] = t

    def _apply(self, fn, recurse=True):
        def device_part_only(t):
            out = fn(t)
            if isinstance(out, torch.Tensor) and out.dtype != t.dtype:
                out = t.to(device=out.device)
            return out

        return super()._apply(device_part_only, recurse)

    def _validated_state(self, state_dict, prefix: str, strict: bool) -> tuple[dict, list[str]]:
        """What ``load_state_dict`` copies into this module's own weights, validated exactly like set_weights, and
        which given weight keys it withholds; reads ``state_dict``, changes nothing.

        Returns ({state-dict key: tensor to copy, in the held layout}, [withheld keys]). Every given weight key is
        checked (dtype, shape, UE8M0 byte 255, NaN / Inf fp8 scale, NaN fp8 code), a partial set too (a prepared
        layer refuses one: its tensors are prepared together). With ``strict`` and some weight keys missing the
        given ones are withheld: nn.Module raises for the missing keys after copying, and a load that raises must
        have copied nothing. Raises ValueError / TypeError."""
        given = {n: state_dict.get(prefix + n) for n in _WEIGHT_NAMES}
        present = [n for n in _WEIGHT_NAMES if given[n] is not None]
        missing = [n for n in _WEIGHT_NAMES if given[n] is None and getattr(self, n) is not None]
        what = f"{type(self).__name__} state dict {prefix or '(root)'}"
        updates: dict = {}
        withheld: list[str] = []
        if present and not missing:
            checked = _checked_weights(what, self._weight_shapes(), self.weight_format, given)
            prepared = _prepared(self, checked)  # EOI in the state dict, the held layout in the module
            updates = {prefix + n: t for n, t in prepared.items() if t is not None}
        elif present and strict:
            withheld = [prefix + n for n in present]
        elif present and self.weight_layout == "eio":
            # The saved (EOI) tensors are prepared together (trn3's MX choice and trn2's re-encoding depend on
            # both weights and their scales), so one alone has no held form to copy into.
            raise ValueError(
                f"{what}: a prepared layer (prepare_for={self.prepare_for!r}) loads "
                f"w13/w13_scale/w2/w2_scale together; missing {[prefix + n for n in missing]}"
            )
        elif present:
            shapes = self._weight_shapes()
            updates = {prefix + n: _checked_weight(what, n, given[n], shapes, self.weight_format) for n in present}
        gate = state_dict.get(prefix + "gate_weight")
        if gate is not None and getattr(self, "gate_weight", None) is not None:
            updates[prefix + "gate_weight"] = _checked_gate(f"{prefix}gate_weight", gate, self.hidden_size)
        return updates, withheld

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, validated first: every weight key of this module and its submodules is checked, and
        with ``strict`` missing / unexpected keys are found, before anything is copied, so a load that raises
        leaves every tensor as it was. (Loaded through a parent module, each of these modules still validates
        every key before copying it, but the parent's other modules, and with ``strict`` and missing keys the
        given keys, may already have been copied when nn.Module raises.)"""
        modules = [(f"{name}." if name else "", m) for name, m in self.named_modules() if isinstance(m, _FixedFormats)]
        for prefix, m in modules:
            m._validated_state(state_dict, prefix, strict)
        if strict:
            expected = set(self.state_dict(keep_vars=True))
            missing = [k for k in expected if k not in state_dict]
            unexpected = [k for k in state_dict if k not in expected]
            msgs = []
            if missing:
                msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
            if unexpected:
                msgs.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
            if msgs:
                raise RuntimeError(
                    "Error(s) in loading state_dict for {}:\n\t{}".format(type(self).__name__, "\n\t".join(msgs))
                )
        for _, m in modules:  # nn.Module passes strict=True to every _load_from_state_dict: say what was asked
            m._strict_load = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            for _, m in modules:
                m._strict_load = False

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Validated like set_weights (the default copy_ would cast float32 into uint8 fp4 weights, bf16 into fp8
        # codes, and accept byte 255 or NaN scales): _validated_state.
        # nn.Module passes strict=True whatever the caller asked; _strict_load is what our load_state_dict was
        # asked (False when a parent module loads: a partial set is then validated and copied key by key).
        updates, withheld = self._validated_state(state_dict, prefix, self._strict_load)
        full = all(prefix + n in updates for n in _WEIGHT_NAMES if getattr(self, n) is not None)
        if full:
            _match_parameters(self, {n: updates.get(prefix + n) for n in _WEIGHT_NAMES})
        state_dict = {k: v for k, v in {**state_dict, **updates}.items() if k not in withheld}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for k in withheld:  # given, only not copied: nn.Module reports the keys that are really missing
            if k in missing_keys:
                missing_keys.remove(k)


# ----------------------------------------------------------------------------------------------------------------
# The shared expert: one SwiGLU MLP, run through the same op as the routed experts
# ----------------------------------------------------------------------------------------------------------------
class SharedExpert(_FixedFormats):
    """A SwiGLU MLP ``down(silu(gate(x)) · up(x))`` applied to every token, in bf16 / fp8 / fp4 weights.

    Stored as one expert in the routed layout (``w13 [1, 2I, H]``, ``w2 [1, H, I]`` + scales) and computed by
    ``torch.ops.static_moe.local_experts`` with every row routed to it at weight 1, so it has exactly the routed
    experts' numerics (SPEC §1.7) and every backend's kernels. Returns float32 [T, H]. ``fp8_max``: as
    :class:`StaticMoE`'s (240 on trn2), used with fp8 activations. ``prepare_for``: as StaticMoE's (required on a
    Neuron device); ``act_format``: the activation format it will be called with ("bf16", "fp8", None: not
    known), which only chooses trn3's fp8 form (plain K-major fp8 for bf16; static_moe.layouts.prepare_weight).

    ``gated=True`` adds Qwen2-MoE's per-token gate: the output is multiplied by ``sigmoid(x · gate_weightᵀ)``
    (``gate_weight`` float32 [1, H], computed in float32 from the float hidden states), still in float32, so the
    layer adds it to the routed sum before the one bf16 cast.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        weight_format: str = "bf16",
        swiglu_limit: float | None = None,
        fp8_max: float = FP8_E4M3FN_MAX,
        gated: bool = False,
        device=None,
        prepare_for: str | None = None,
        act_format: str | None = None,
    ):
        super().__init__()
        self.prepare_for = _resolve_target(prepare_for, torch.device("cpu") if device is None else torch.device(device))
        if act_format not in (None, "bf16", "fp8"):
            raise ValueError(f"shared act_format must be 'bf16', 'fp8' or None, got {act_format!r}")
        self.prepare_act = act_format
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.intermediate_size = _positive_int("shared intermediate_size", intermediate_size)
        if hidden_size % 128 or intermediate_size % 128:
            raise ValueError(
                f"shared expert sizes must be multiples of 128, got hidden {hidden_size}, "
                f"intermediate {intermediate_size}"
            )
        if weight_format not in _workspace.WEIGHT_FORMATS:
            raise ValueError(f"shared weight_format must be one of {_workspace.WEIGHT_FORMATS}, got {weight_format!r}")
        self.weight_format = weight_format
        self.swiglu_limit = _check_swiglu_limit("shared swiglu_limit", swiglu_limit)
        self.fp8_max = _check_fp8_max(fp8_max)
        _init_weights(self, 1, hidden_size, intermediate_size, weight_format, device)
        gate = torch.zeros(1, hidden_size, dtype=torch.float32, device=device) if gated else None
        self.register_parameter("gate_weight", None if gate is None else nn.Parameter(gate, requires_grad=False))

    def _weight_shapes(self) -> dict:
        return _weight_shapes(1, self.hidden_size, self.intermediate_size, self.weight_format)

    def set_weights(self, w13, w13_scale, w2, w2_scale) -> None:
        """Copy ``w13 [1, 2I, H]``, ``w2 [1, H, I]`` (+ scales) in this expert's format (checked)."""
        given = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
        _copy_checked(self, _checked_weights("shared expert", self._weight_shapes(), self.weight_format, given))

    def set_gate(self, weight) -> None:
        """Copy the gate's weight (float [1, H], finite; stored as float32). Only for ``gated=True``."""
        if self.gate_weight is None:
            raise ValueError("this shared expert has no gate (construct it with gated=True)")
        with torch.no_grad():
            self.gate_weight.copy_(_checked_gate("shared expert gate weight", weight, self.hidden_size))

    def forward(
        self, x: torch.Tensor, x_scale: torch.Tensor | None, gate_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, H] in the expert's activation format (+ x_scale); gate_input: float hidden states [T, H] (only
        for a gated expert). Returns float32 [T, H]."""
        t = x.shape[0]
        idx = torch.zeros((t, 1), dtype=torch.int32, device=x.device)
        weights = torch.ones((t, 1), dtype=torch.float32, device=x.device)
        out = torch.ops.static_moe.local_experts(
            x,
            x_scale,
            idx,
            weights,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            0,
            self.swiglu_limit,
            self.fp8_max,
            self.weight_layout,
        )
        if self.gate_weight is not None:
            if gate_input is None:
                raise ValueError("this shared expert is gated: pass gate_input, the float hidden states [T, H]")
            out = out * torch.sigmoid(nn.functional.linear(gate_input.float(), self.gate_weight))
        return out

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"weight_format={self.weight_format!r}, swiglu_limit={self.swiglu_limit}"
            + (", gated" if self.gate_weight is not None else "")
            + (f", prepare_for={self.prepare_for!r}" if self.weight_layout != "eoi" else "")
        )


_WEIGHT_NAMES = ("w13", "w13_scale", "w2", "w2_scale")


_NEURON_DEVICE_TYPES = ("xla", "neuron", "privateuseone")


def _resolve_target(prepare_for, device: torch.device) -> str:
    """The device kind weights are prepared for: ``prepare_for`` when given ("cpu", "cuda", "trn2", "trn3"),
    else from the device — CUDA is "cuda", CPU (and anything not Neuron) "cpu". A Neuron device (xla / neuron /
    privateuseone) needs ``prepare_for``: trn2 and trn3 hold different bytes (trn2 re-encodes fp8) and nothing
    here tells the two apart reliably on hardware (NEURON_PLATFORM_TARGET_OVERRIDE is a simulator setting, unset
    on a real device), so a wrong guess would silently hold the other generation's weights. Raises ValueError."""
    if prepare_for is not None:
        return check_target(prepare_for, "prepare_for")
    if device.type in _NEURON_DEVICE_TYPES:
        raise ValueError(
            f"prepare_for: weights on a Neuron device ({device}) must say which chip they are prepared "
            "for: pass prepare_for='trn2' (Trainium2) or prepare_for='trn3' (Trainium3); the two hold "
            "different bytes and the device does not tell them apart"
        )
    return "cuda" if device.type == "cuda" else "cpu"


def _prepared(module: nn.Module, checked: dict) -> dict:
    """Checked EOI weights → the form ``module`` holds (static_moe.layouts.prepare_expert_weights)."""
    w13, s13, w2, s2, _ = prepare_expert_weights(
        checked["w13"], checked["w13_scale"], checked["w2"], checked["w2_scale"], module.prepare_for, module.prepare_act
    )
    return {"w13": w13, "w13_scale": s13, "w2": w2, "w2_scale": s2}


def _match_parameters(module: nn.Module, prepared: dict) -> None:
    """Re-create the parameters whose dtype or shape the prepared form changes (on trn3 fp8 weights switch between
    the MX form and plain EIO fp8 with their scales), so that a copy of ``prepared`` into them is exact."""
    for name, t in prepared.items():
        p = getattr(module, name)
        if t is not None and p is not None and (p.dtype != t.dtype or p.shape != t.shape):
            # Filled with the new weights at once, so the module never holds a half-switched form.
            module._parameters[name] = nn.Parameter(t.detach().to(p.device, copy=True), requires_grad=False)


def _init_weights(module: nn.Module, num_local, hidden, inter, fmt, device) -> None:
    """Zero parameters in ``fmt`` (a layer computes zeros until weights are loaded), in the layout the module
    holds (``module.prepare_for`` must be set)."""
    eoi = {}
    for name, shape in _weight_shapes(num_local, hidden, inter, fmt).items():
        if shape is None:
            eoi[name] = None
            continue
        dtype = _SCALE_DTYPE[fmt] if name.endswith("_scale") else _WEIGHT_DTYPE[fmt]
        # On the CPU, in memory advised for huge pages: the weights stream from DRAM once per step (host_memory).
        t = host_memory.zeros(shape, dtype, device)
        if name.endswith("_scale") and fmt == "fp8":
            t.fill_(1.0)
        eoi[name] = t
    for name, t in _prepared(module, eoi).items():
        module.register_parameter(name, None if t is None else nn.Parameter(t.contiguous(), requires_grad=False))


def _checked_weights(what: str, shapes: dict, fmt: str, given: dict) -> dict:
    """``given`` ({"w13", "w13_scale", "w2", "w2_scale"} → tensor or None) checked against ``fmt`` and ``shapes``:
    dtypes (fp4/UE8M0 views become uint8), shapes, UE8M0 byte 255, non-finite fp8 scales, NaN fp8 bytes."""
    return {name: _checked_weight(what, name, given[name], shapes, fmt) for name in _WEIGHT_NAMES}


def _checked_weight(what: str, name: str, t, shapes: dict, fmt: str) -> torch.Tensor | None:
    """One of ``_checked_weights``' tensors, checked alone (a partial load_state_dict checks each key it copies)."""
    label = f"{what} {name}"
    if name.endswith("_scale"):
        t = None if t is None else _materialized(label, t)
        t = _normalize_scale(label, t, fmt)
    else:
        t = _normalize_weight(label, _materialized(label, t), fmt)
    if shapes[name] is not None and tuple(t.shape) != shapes[name]:
        raise ValueError(f"{label} must have shape {list(shapes[name])} ({fmt}), got {list(t.shape)}")
    return t


def _copy_checked(module: nn.Module, checked: dict) -> None:
    """Store checked EOI weights in the module, prepared for its device (the one path of every loader)."""
    prepared = _prepared(module, checked)
    _match_parameters(module, prepared)
    with torch.no_grad():
        for name, t in prepared.items():
            if t is not None:
                getattr(module, name).copy_(t)


def _checked_gate(name: str, weight, hidden: int) -> torch.Tensor:
    w = _materialized(name, weight)
    if w.dtype not in _FLOAT_DTYPES or tuple(w.shape) != (1, hidden):
        raise ValueError(
            f"{name} must be a float [1, {hidden}] tensor (one gate per token), got {w.dtype}{list(w.shape)}"
        )
    return _check_finite(name, w).float()


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------
class StaticMoE(_FixedFormats):
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
        activation, alpha: the routed experts' gated activation (SPEC §1.9): "silu" (default), "swiglu_oai"
            (gpt-oss, with ``alpha``) or "gelu_tanh". The shared expert stays SiLU.
        expert_biases: True for experts with biases (gpt-oss): float32 parameters ``w13_bias`` [L, 2I] and
            ``w2_bias`` [L, H] (zero until :meth:`set_expert_biases` or ``load_state_dict``; in the state dict).
        fp8_max: with act_format "fp8", the range of the experts' fp8 re-quantization of the SwiGLU output
            (SPEC §1.5, §1.7; shared expert included), in [2, 448]. 448 (default) is OCP float8_e4m3fn; use 240
            on Trainium2 (trn2), whose on-chip float8_e4m3 tops out at 240 — its kernels refuse 448 rather than
            change the numerics. Hidden states are still quantized with 448 (every backend decodes e4m3fn up to
            448). Unused with act_format "bf16".
        shared_intermediate_size: I of the shared expert, or None for no shared expert.
        shared_weight_format: its format (default: weight_format); shared_swiglu_limit: its clamp (default:
            swiglu_limit); shared_gate: True for a gated shared expert (Qwen2-MoE: ``sigmoid(x · g) ·
            shared(x)``, the gate in float32; see :class:`SharedExpert`).
        ep_group: the EP process group (None: a single rank; with several ranks initialised it must be given, or
            ep_size=1 passed for a layer of this rank alone).
        ep_size: optional check against the group's size; 1 without a group: this rank alone, on purpose.
        device: where weights and workspace live. Construction is collective over ep_group.
        prepare_for: the target the weights are prepared for (module doc, SPEC §1.2): None (default) follows
            ``device`` ("cpu"; "cuda"; a Neuron device needs it given: ValueError otherwise), or one of "cpu",
            "cuda" (EOI) and "trn2", "trn3" (EIO). The shared expert is prepared alike. "trn2" with act_format
            "fp8" needs fp8_max ≤ 240 (SPEC §6.1; ValueError at construction).
        dispatch: "all_gather" (default, SPEC §0), "all_to_all" (SPEC §7: each token only to the ranks owning
            one of its experts, in blocks of Cd rows) or "auto" (the all-to-all when its modelled traffic is the
            smaller, ``static_moe.expert_parallel.choose_dispatch``; decided at construction, the same on every
            rank). See docs/expert_parallel.md for when to pick which.
        combine: "fp32" (default: the fp32 reduce-scatter) or "bf16" (each rank's partial rounded once to bf16,
            summed in fp32 in source-rank order; needed by "all_to_all").
        dispatch_capacity: Cd for "all_to_all", in [1, capacity]; 0 (default) takes the 1 % overflow rule of
            ``expert_parallel.dispatch_capacity_for`` (uniform routing) — size it from your router with
            ``expert_parallel.dispatch_capacity_from_trace``. Ranks built with different dispatch, combine or Cd
            fail at construction with ValueError on every rank (the workspace manifest carries them).

    ``forward(hidden, topk_idx, topk_weights)``: hidden bf16 [..., H] (fp16 / fp32 are cast to bf16 first: the
    experts' activation format is bf16 or fp8), or, with act_format "fp8", a tuple ``(x_q float8_e4m3fn [..., H],
    x_s float32 [..., H/act_group])``; topk_idx int32/int64 [T, k] global ids or −1; topk_weights float32 / bf16
    (used as they are) or fp16 (cast to float32) [T, k]; T = hidden's rows ≤ capacity. Returns hidden's dtype
    (bf16 for the fp8 tuple) with hidden's leading shape; the result is rounded to bf16 once (SPEC §1.6) before
    any cast to fp16/fp32. Every rank of the EP group must call it each step (T = 0 is fine).

    Dtype conversions of the module (``.to(torch.bfloat16)``, ``.half()``, ``.float()``) keep every parameter's
    dtype: the formats are fixed at construction. Device moves are refused at the next forward (the workspace
    cannot follow); construct the layer on its device.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        capacity: int,
        *,
        weight_format: str = "bf16",
        act_format: str = "bf16",
        act_group: int = 128,
        swiglu_limit: float | None = None,
        shared_intermediate_size: int | None = None,
        shared_weight_format: str | None = None,
        shared_swiglu_limit: float | None | str = "same",
        ep_group=None,
        ep_size: int | None = None,
        device=None,
        fp8_max: float = FP8_E4M3FN_MAX,
        shared_gate: bool = False,
        prepare_for: str | None = None,
        activation: str = "silu",
        alpha: float = DEFAULT_ALPHA,
        expert_biases: bool = False,
        dispatch: str = "all_gather",
        combine: str = "fp32",
        dispatch_capacity: int = 0,
    ):
        super().__init__()
        self.ep_size, self.ep_rank, self.group_name = ep_group_info(ep_group, ep_size)
        self._closed = True  # until the workspace lease is held
        error = None
        try:
            _check_ep_size(ep_size, self.ep_size)
            self._configure(
                hidden_size,
                intermediate_size,
                num_experts,
                top_k,
                capacity,
                weight_format,
                act_format,
                act_group,
                swiglu_limit,
                shared_intermediate_size,
                shared_weight_format,
                shared_swiglu_limit,
                device,
                fp8_max,
                shared_gate,
                prepare_for,
                activation,
                alpha,
                expert_biases,
                dispatch,
                combine,
                dispatch_capacity,
            )
        except Exception as e:  # noqa: BLE001  (any failure, a bad device string or an allocation, reaches every rank)
            error = e
        if self.ep_size > 1:
            # Every rank learns whether any rank's arguments were rejected, so no rank waits alone below.
            _workspace.converge(ep_group, error, "StaticMoE construction")
        elif error is not None:
            raise error
        self._lease = _workspace.acquire(self.workspace_spec, ep_group)
        self._closed = False

    def _configure(
        self,
        hidden_size,
        intermediate_size,
        num_experts,
        top_k,
        capacity,
        weight_format,
        act_format,
        act_group,
        swiglu_limit,
        shared_intermediate_size,
        shared_weight_format,
        shared_swiglu_limit,
        device,
        fp8_max,
        shared_gate,
        prepare_for=None,
        activation="silu",
        alpha=DEFAULT_ALPHA,
        expert_biases=False,
        dispatch="all_gather",
        combine="fp32",
        dispatch_capacity=0,
    ):
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type == "meta":
            raise ValueError(
                "StaticMoE cannot live on the meta device: it owns a workspace of real buffers; "
                "build it on the target device and load weights"
            )
        self._device = device
        self.prepare_for = _resolve_target(prepare_for, device)
        self.swiglu_limit = _check_swiglu_limit("swiglu_limit", swiglu_limit)
        self.fp8_max = _check_fp8_max(fp8_max)
        self.activation = check_activation(activation, alpha, "StaticMoE")
        self.alpha = float(alpha)
        if self.prepare_for == "trn2" and act_format == "fp8" and self.fp8_max > FP8_E4M3_TRN2_MAX:
            # SPEC §6.1: refused here rather than at the first forward's NKI dispatch (same rule, same words).
            raise ValueError(
                f"fp8_max={self.fp8_max} needs OCP float8_e4m3fn on chip (trn3); trn2's on-chip fp8 "
                "(float8_e4m3) tops out at 240 — pass fp8_max=240 with prepare_for='trn2' "
                "(SPEC §6.1)"
            )
        if not isinstance(dispatch_capacity, int) or isinstance(dispatch_capacity, bool) or dispatch_capacity < 0:
            raise ValueError(f"dispatch_capacity must be an int ≥ 0 (0: the Cd rule), got {dispatch_capacity!r}")
        self.dispatch, self.dispatch_capacity = choose_dispatch(
            dispatch,
            combine,
            capacity=_positive_int("capacity", capacity),
            hidden=_positive_int("hidden_size", hidden_size),
            topk=_positive_int("top_k", top_k),
            num_experts=_positive_int("num_experts", num_experts),
            ep_size=self.ep_size,
            act_format=act_format,
            act_group=act_group,
            dispatch_capacity=dispatch_capacity,
        )
        if self.ep_size == 1:  # one rank: no collective; the combine alone sets the maths (SPEC §7)
            self.dispatch, self.dispatch_capacity = "all_gather", 0
        self.combine = combine
        # WorkspaceSpec checks sizes, divisibility, formats and the format pair (and dispatch, combine, Cd).
        self.workspace_spec = _workspace.WorkspaceSpec(
            capacity=capacity,
            hidden=hidden_size,
            intermediate=intermediate_size,
            num_experts=num_experts,
            topk=top_k,
            ep_size=self.ep_size,
            act_format=act_format,
            act_group=act_group,
            weight_format=weight_format,
            device=str(device),
            swiglu_limit=self.swiglu_limit,
            fp8_max=self.fp8_max,
            dispatch=self.dispatch,
            combine=self.combine,
            dispatch_capacity=self.dispatch_capacity,
            activation=self.activation,
            alpha=self.alpha,
            expert_biases=bool(expert_biases),
        )
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.capacity = num_experts, top_k, capacity
        self.num_local_experts = num_experts // self.ep_size
        self.weight_format, self.act_format = weight_format, act_format
        self.act_group = act_group if act_format == "fp8" else None
        self.prepare_act = act_format
        _init_weights(self, self.num_local_experts, hidden_size, intermediate_size, weight_format, device)
        # SPEC §1.9 biases: float32 parameters (zero until set_expert_biases or load_state_dict), or none.
        for name, n in (("w13_bias", 2 * intermediate_size), ("w2_bias", hidden_size)):
            t = torch.zeros(self.num_local_experts, n, dtype=torch.float32, device=device) if expert_biases else None
            self.register_parameter(name, None if t is None else nn.Parameter(t, requires_grad=False))
        if shared_intermediate_size is not None:
            limit = self.swiglu_limit if shared_swiglu_limit == "same" else shared_swiglu_limit
            self.shared = SharedExpert(
                hidden_size,
                shared_intermediate_size,
                weight_format=shared_weight_format or weight_format,
                swiglu_limit=limit,
                fp8_max=self.fp8_max,
                gated=bool(shared_gate),
                device=device,
                prepare_for=self.prepare_for,
                act_format=act_format,
            )
        else:
            if shared_weight_format is not None or shared_gate:
                raise ValueError("shared_weight_format / shared_gate were given without shared_intermediate_size")
            self.shared = None

    # --- weights -----------------------------------------------------------------------------------------------
    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first local expert."""
        return self.ep_rank * self.num_local_experts

    def _weight_shapes(self) -> dict:
        return _weight_shapes(self.num_local_experts, self.hidden_size, self.intermediate_size, self.weight_format)

    def set_expert_weights(self, w13, w13_scale, w2, w2_scale) -> None:
        """Copy this rank's routed expert weights (format, shapes and devices checked; see the module doc).

        Local to this rank (no collective). The ``from_*`` constructors run the same checks collectively."""
        given = {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}
        _copy_checked(self, _checked_weights("routed", self._weight_shapes(), self.weight_format, given))

    def set_expert_biases(self, w13_bias, w2_bias) -> None:
        """Copy this rank's expert biases (SPEC §1.9): float32 / bf16 ``w13_bias`` [L, 2I] (gate columns, then up
        columns, as w13's rows) and ``w2_bias`` [L, H], finite, on the layer's device; stored in float32. The
        layer must have been built with ``expert_biases=True`` (ValueError otherwise). Local to this rank."""
        if self.w13_bias is None:
            raise ValueError("set_expert_biases: this layer was built without expert_biases=True")
        checked = {}
        for name, t, n in (("w13_bias", w13_bias, 2 * self.intermediate_size), ("w2_bias", w2_bias, self.hidden_size)):
            t = _materialized(name, t)
            if t.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"set_expert_biases: {name} must be float32 or bfloat16, got {t.dtype}")
            if tuple(t.shape) != (self.num_local_experts, n):
                raise ValueError(
                    f"set_expert_biases: {name} must have shape {[self.num_local_experts, n]}, got {list(t.shape)}"
                )
            if t.device != self.w13_bias.device:
                raise ValueError(f"set_expert_biases: {name} must be on {self.w13_bias.device}, got {t.device}")
            checked[name] = _check_finite(f"set_expert_biases: {name}", t)
        with torch.no_grad():
            self.w13_bias.copy_(checked["w13_bias"])
            self.w2_bias.copy_(checked["w2_bias"])

    @classmethod
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
    ) -> StaticMoE:
        """Convert existing SwiGLU experts (float weights; quantized to ``weight_format`` on the way).

        ``module`` is one of
          (a) transformers 5.x fused experts: tensors ``gate_up_proj`` [N, 2I, H] (gate rows, then up rows) and
              ``down_proj`` [N, H, I], SiLU, no bias (a transposed, interleaved or biased variant raises);
          (b) grouped experts with tensors ``w1``, ``w3`` [N, I, H] and ``w2`` [N, H, I] (torchtitan style);
          (c) an iterable of MLP modules with ``gate_proj``/``up_proj``/``down_proj`` (transformers 4.x) or
              ``w1``/``w3``/``w2`` nn.Linear; entries other ranks own may be None;
          or a module whose ``experts`` is one of these (a block that also holds a shared expert must pass it as
          ``shared_expert``: nothing is dropped silently).
        Which experts this rank keeps: a DTensor (EP shard) holds this rank's own. A plain source of N experts is
        the whole model when ``num_experts`` = N (this rank keeps ep_rank·N/S … +N/S−1, S = ep_size) or this
        rank's own when ``num_experts`` = N·S; on one rank ``num_experts`` defaults to N, on several it is
        required (the count alone cannot tell which is meant).
        ``shared_expert``: optional SwiGLU MLP (gate/up/down_proj or w1/w3/w2 nn.Linear, no bias).
        ``shared_expert_gate``: optional nn.Linear(H, 1, bias=False) gating it (Qwen2-MoE); its sigmoid is taken in
        float32 and the gated output added before the bf16 cast. ``options`` go to the constructor (act_format,
        swiglu_limit, device, ...). Meta tensors and NaN/Inf weights are refused, naming the tensor.

        Collective over ``ep_group``: an error on any rank raises on every rank (the others name the failing rank)
        before any rank returns a layer, and no rank keeps a workspace lease.
        """
        # The loader imports this module's checks, so it is imported when called, not when this module loads.
        from .loaders.torch_modules import from_module

        return from_module(
            cls,
            module,
            top_k=top_k,
            capacity=capacity,
            num_experts=num_experts,
            weight_format=weight_format,
            shared_expert=shared_expert,
            shared_expert_gate=shared_expert_gate,
            ep_group=ep_group,
            ep_size=ep_size,
            **options,
        )

    @classmethod
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
    ) -> StaticMoE:
        """Build a layer from a checkpoint's MoE block (only this rank's experts are read).

        Routed experts, either per expert (DeepSeek / transformers 4.x hub keys)
        ``{prefix}experts.{e}.{w1|gate_proj}.weight`` / ``{w3|up_proj}`` / ``{w2|down_proj}`` with optional scales
        ``….weight_scale_inv`` / ``….scale`` / ``….weight_scale``, or fused (transformers 5.x)
        ``{prefix}experts.gate_up_proj`` [E, 2I, H] (gate rows then up rows) and ``{prefix}experts.down_proj``
        [E, H, I] with optional ``…_scale_inv`` / ``…_scale`` [E, N or ⌈N/128⌉, K/block]. A shared expert under
        ``{prefix}shared_experts.`` (DeepSeek) or ``{prefix}shared_expert.`` (Qwen2-MoE, with its gate
        ``{prefix}shared_expert_gate.weight`` [1, H]) is used when present. Per weight:
          * bf16 / fp16 / fp32: float weights; kept as bf16, or quantized when ``weight_format`` asks for fp8/fp4;
          * float8_e4m3fn with 128×128 block scales [⌈N/128⌉, K/128] (expanded to 1×128) or 1×128 scales
            [N, K/128], float scales; values are ``q · s``;
          * fp4: uint8 / int8 / float4_e2m1fn_x2 [N, K/2] with UE8M0 scales uint8 / float8_e8m0fnu [N, K/32]
            (byte 255 rejected).
        ``weight_format`` None keeps the checkpoint's format; a quantized checkpoint is never re-quantized to
        another format (ValueError). H is read from the experts' ``down_proj``; ``hidden_size=`` (optional) and the
        router's ``{prefix}gate.weight`` [E, H], when present, must agree with it (a checkpoint whose expert
        weights are all transposed has H and I swapped: ValueError). Collective over ``ep_group`` like
        :meth:`from_module`: a missing key, a bad shape or scale on any rank raises on every rank before any rank
        returns a layer.
        """
        from .loaders.deepseek import from_deepseek_state_dict  # imported when called, as in from_module

        return from_deepseek_state_dict(
            cls,
            state_dict,
            top_k=top_k,
            capacity=capacity,
            num_experts=num_experts,
            prefix=prefix,
            weight_format=weight_format,
            shared_weight_format=shared_weight_format,
            ep_group=ep_group,
            ep_size=ep_size,
            **options,
        )

    @classmethod
    def from_checkpoint(
        cls,
        path,
        *,
        family: str,
        layer: int,
        top_k: int,
        capacity: int,
        weight_format: str | None = None,
        prefix: str | None = None,
        ep_group=None,
        ep_size: int | None = None,
        progress: bool | None = None,
        **options,
    ) -> StaticMoE:
        """Build a layer from one MoE layer's routed experts in a safetensors checkpoint on disk (the
        ``model.safetensors.index.json`` + shards layout), reading only this rank's experts, lazily
        (``static_moe.loaders.checkpoint_experts.load_checkpoint_experts`` documents ``family``, ``layer``,
        ``weight_format``, ``prefix`` and ``progress``; docs/checkpoints.md the layouts). H, I and the number of
        experts come from the checkpoint; ``options`` go to the constructor, completed with what the family's experts
        compute (``loaders.checkpoint_experts.family_options``: gpt_oss gets its biases, ``activation="swiglu_oai"``
        and ``alpha`` / ``swiglu_limit`` from the checkpoint's config.json; deepseek_v4 its ``swiglu_limit``; an
        option contradicting them is a ValueError). Collective over ``ep_group`` like :meth:`from_module`."""
        from .loaders.checkpoint_experts import from_checkpoint  # imported when called, as in from_module

        return from_checkpoint(
            cls,
            path,
            family=family,
            layer=layer,
            top_k=top_k,
            capacity=capacity,
            weight_format=weight_format,
            prefix=prefix,
            ep_group=ep_group,
            ep_size=ep_size,
            progress=progress,
            **options,
        )

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

    # --- copies --------------------------------------------------------------------------------------------------
    # A layer holds a workspace lease, acquired collectively over its EP group: a copy would either share it (closing
    # the copy would give back the original's lease) or need a collective acquire of its own, which a copy made on
    # one rank cannot make. So a layer is not copied or pickled: construct another (collective) and load_state_dict.
    def _refuse_copy(self, what: str):
        raise TypeError(
            f"a StaticMoE layer cannot be {what}: it holds a workspace lease acquired collectively over "
            "its EP group; construct another layer on every rank and load_state_dict(layer.state_dict()) "
            "into it (state_dict() is also what to save)"
        )

    def __copy__(self):
        self._refuse_copy("copied")

    def __deepcopy__(self, memo):
        self._refuse_copy("deep-copied")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("pickled")

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
                raise ValueError(
                    f"hidden[1] must be float32 [..., {h // g}] (act_group {g}), got {x_s.dtype}{list(x_s.shape)}"
                )
            lead = x_q.shape[:-1]
            return x_q.reshape(-1, h), x_s.reshape(-1, h // g), lead, None
        if (
            not isinstance(hidden, torch.Tensor)
            or hidden.dtype not in _FLOAT_DTYPES
            or hidden.dim() < 1
            or hidden.shape[-1] != h
        ):
            got = f"{hidden.dtype}{list(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be bf16, fp16 or fp32 [..., {h}], got {got}")
        lead = hidden.shape[:-1]
        x = hidden if hidden.dim() == 2 else hidden.reshape(-1, h)
        x = as_dtype(x, torch.bfloat16)  # the experts' activation format is bf16 (or fp8 from bf16)
        if self.act_format == "fp8":
            x_q, x_s = quantize_activation(x, self.act_group)
            return x_q, x_s, lead, x
        return x, None, lead, x

    def _check_call(self, x: torch.Tensor, topk_idx, topk_weights) -> None:
        """The layer's own checks of a call's token count and routing shapes (the op repeats them collectively)."""
        t = x.shape[0]
        if t > self.capacity:
            raise ValueError(f"StaticMoE: {t} tokens exceed the capacity of {self.capacity}")
        if tuple(topk_idx.shape) != (t, self.top_k) or tuple(topk_weights.shape) != (t, self.top_k):
            raise ValueError(
                f"topk_idx and topk_weights must be [T={t}, top_k={self.top_k}], got "
                f"{list(topk_idx.shape)} and {list(topk_weights.shape)}"
            )

    def _prepare_call(self, hidden, topk_idx, topk_weights) -> tuple:
        """Everything a call does before the op: the layer's checks, the activations in the experts' format and
        the shared expert's output. (x, x_scale, topk_idx, topk_weights, leading shape, shared output or None)."""
        if isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float16:
            topk_weights = topk_weights.float()  # the op takes float32 / bf16 routing weights
        x, x_scale, lead, x_bf16 = self._activations(hidden)
        self._check_call(x, topk_idx, topk_weights)
        w13 = self._parameters["w13"]
        if w13.device != self._device:
            raise RuntimeError(
                f"this layer was built for {self._device} (its workspace lives there) but its weights "
                f"are now on {w13.device}; construct the layer on the target device instead "
                "of moving it"
            )
        if x.device != self._device:
            raise ValueError(f"hidden is on {x.device} but this layer's weights and workspace are on {self._device}")
        shared_out = None
        if self.shared is not None:
            need_float = self.shared.weight_format == "bf16" or self.shared.gate_weight is not None
            sx = None
            if need_float:
                sx = x_bf16 if x_bf16 is not None else dequantize_activation(x, x_scale).to(torch.bfloat16)
            gate_input = None
            if self.shared.gate_weight is not None:  # the gate sees the hidden states as given (fp32 stays fp32)
                gate_input = hidden.reshape(-1, self.hidden_size) if isinstance(hidden, torch.Tensor) else sx
            if self.shared.weight_format == "bf16":
                shared_out = self.shared(sx, None, gate_input)
            else:
                shared_out = self.shared(x, x_scale, gate_input)
        return x, x_scale, topk_idx, topk_weights, lead, shared_out

    def forward(self, hidden, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this StaticMoE layer is closed: its workspace lease was given back")
        try:
            x, x_scale, topk_idx, topk_weights, lead, shared_out = self._prepare_call(hidden, topk_idx, topk_weights)
        except Exception as e:  # noqa: BLE001
            if self.ep_size == 1:
                raise
            # One rank's failed call must not leave the others waiting in the all-gather: a collective step that
            # reports this error, so every rank raises (docs/errors.md).
            report_failure(e, self.group_name, self.ep_rank, self.ep_size)
        out_dtype = hidden.dtype if isinstance(hidden, torch.Tensor) else torch.bfloat16
        # The weights from the parameter dict, where nn.Module keeps them under these names for the layer's life
        # (it refuses to rebind them to anything but a Parameter or None): nn.Module.__getattr__, the fallback an
        # attribute access takes to find them, costs about half a µs each, a visible share of a one-row call.
        p = self._parameters
        out = _forward_op(
            x,
            x_scale,
            topk_idx,
            topk_weights,
            p["w13"],
            p["w13_scale"],
            p["w2"],
            p["w2_scale"],
            shared_out,
            num_experts=self.num_experts,
            capacity=self.capacity,
            swiglu_limit=self.swiglu_limit,
            group_name=self.group_name,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            fp8_max=self.fp8_max,
            weight_layout=self.weight_layout,
            activation=self.activation,
            alpha=self.alpha,
            w13_bias=p["w13_bias"],
            w2_bias=p["w2_bias"],
            dispatch=self.dispatch,
            combine=self.combine,
            dispatch_capacity=self.dispatch_capacity,
        )
        if len(lead) != 1:
            out = out.reshape(*lead, self.hidden_size)
        return as_dtype(out, out_dtype)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts} (local {self.num_local_experts} from {self.expert_offset}), "
            f"top_k={self.top_k}, capacity={self.capacity}, weight_format={self.weight_format!r}, "
            f"act_format={self.act_format!r}"
            + (f", act_group={self.act_group}" if self.act_group else "")
            + (f", fp8_max={self.fp8_max}" if self.act_group else "")
            + f", swiglu_limit={self.swiglu_limit}, ep={self.ep_rank}/{self.ep_size}"
            + (f", activation={self.activation!r}" if self.activation != "silu" else "")
            + (f", alpha={self.alpha}" if self.activation == "swiglu_oai" else "")
            + (", expert_biases=True" if self.w13_bias is not None else "")
            + (f", dispatch={self.dispatch!r}" if self.dispatch != "all_gather" else "")
            + (f", dispatch_capacity={self.dispatch_capacity}" if self.dispatch_capacity else "")
            + (f", combine={self.combine!r}" if self.combine != "fp32" else "")
            + (f", prepare_for={self.prepare_for!r}" if self.weight_layout != "eoi" else "")
        )
