"""Dispatch of the ``torch.ops.static_moe`` ops to the NKI kernels.

Three paths, each taken only where it can run (:func:`status` says which and why not):

1. **Neuron device.** Where torch-neuronx is importable, tensors live on its device: the XLA device
   (``torch_xla``, dispatch key ``XLA``) or the native ``neuron`` device (``PrivateUse1`` renamed ``neuron``).
   :func:`register_neuron_kernels` registers, for each such key, all six ops: ``pack_rows``, ``unpack_rows``,
   ``swiglu_and_cast``, ``expert_gemm`` and ``local_experts`` launch their kernel through ``nki.jit`` on the
   op's device tensors, and ``forward`` is its composite body (ops/forward.py), which calls those. ``import
   static_moe`` calls it; it is a no-op (returns ``[]``) where neither backend is importable. The op's argument
   checks run first (SPEC §5). The repository's test device (``tools/neuron_test_device.py``, a PrivateUse1
   ``neuron`` device on CPU memory) registers the same functions with ``keys=["PrivateUse1"]``, its ``jit`` being
   the interpreter's, so the tests run this path.
2. **Real NKI without a device.** :func:`expert_gemm` / :func:`local_experts` on CPU tensors run the kernel
   through ``nki.simulate`` (the target is forced to trn2 unless ``NEURON_PLATFORM_TARGET_OVERRIDE`` says
   otherwise: off-device the simulator would default to trn3).
3. **Neither.** The same calls run through the repository's NKI interpreter (``nki_interpreter``, a
   development tool in ``tools/`` that the wheel does not ship), bound by ``static_moe.nki.shim``.

The shim, and through it the kernels and the interpreter, are imported on first use, not by ``import
static_moe``: :func:`register_neuron_kernels` reaches the shim only where torch-neuronx is importable.

Argument normalisation, shared by the three paths (the kernels take only NKI dtypes): fp4 weights
(``float4_e2m1fn_x2``) and UE8M0 scales (``float8_e8m0fnu``) are viewed as uint8, ``topk_idx`` is narrowed to
int32 (ids are < 2^31 by construction), ``topk_weights`` widened to float32. trn2 quantizes z with
``fp8_max <= 240`` (its on-chip fp8 is ``float8_e4m3``); asking for 448 there is an error, not a silent change
of numerics (trn3, with native e4m3fn, accepts it).

LNC: every kernel launches as ``kernel[platform_lnc()]`` (:func:`platform_lnc`; the trn2 default is 2), on all three
paths: on a device every kernel of a model must be compiled for the runtime's LNC (Neuron compiler error
NCC_EVRF066). Each kernel splits its static work over ``nl.program_id`` (``nki_kernels/lnc.py``) so that the
LNC = 2 result is bitwise the LNC = 1 result.

Weight layout: the ops' trailing ``weight_layout`` ("eoi", or the prepared K-major "eio" of
``static_moe.layouts``) reaches both kernels as the keyword argument ``weight_layout=``.
"""

from __future__ import annotations

import os

import torch

from ..activations import DEFAULT_ALPHA

_OPS = ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts", "forward")
_registered: list[str] = []


# ---------------------------------------------------------------------------------------------- normalisation
def _u8(t):
    """fp4 weights (float4_e2m1fn_x2) and UE8M0 scales (float8_e8m0fnu) as the uint8 bytes the kernels take."""
    if t is not None and t.dtype in (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    return t


def _f32(bias):
    """A SPEC §1.9 bias as the contiguous float32 the kernels take (bf16 widens exactly)."""
    return bias.to(torch.float32).contiguous()


def _check(name: str, *args, **kwargs) -> None:
    """Run the op's shared argument checks (csrc/checks, exposed as ``static_moe._C.check_<op>``) when built."""
    from .. import _C

    fn = getattr(_C, f"check_{name}", None)
    if fn is not None:
        fn(*args, **kwargs)


def _layout_flags(weight_layout: str) -> dict:
    """The kernels' ``weight_layout=`` keyword (checked: "eoi" or "eio")."""
    from ..layouts import check_weight_layout

    return {"weight_layout": check_weight_layout(weight_layout)}


def expert_gemm_args(a, a_scale, b, b_scale, row_mask, expert):
    """Kernel arguments of ``expert_gemm_kernel`` from the op's arguments."""
    if not 0 <= int(expert) < b.shape[0]:
        raise ValueError(f"expert_gemm: expert={expert} is outside [0, {b.shape[0]}) (b has {b.shape[0]} experts)")
    return (a, a_scale, _u8(b), _u8(b_scale), row_mask.to(torch.bool), int(expert))


def local_experts_args(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset,
    swiglu_limit,
    fp8_max,
    e4m3fn_native: bool,
):
    """Kernel arguments of ``local_experts_kernel`` from the op's arguments."""
    if x.dtype == torch.float8_e4m3fn and fp8_max > 240.0 and not e4m3fn_native:
        raise ValueError(
            f"local_experts: fp8_max={fp8_max} needs OCP float8_e4m3fn on chip (trn3); trn2's on-chip fp8 "
            "(float8_e4m3) tops out at 240 — pass fp8_max=240 on trn2 (SPEC §1.1)"
        )
    return (
        x,
        x_scale,
        topk_idx.to(torch.int32),
        topk_weights.to(torch.float32),
        _u8(w13),
        _u8(w13_scale),
        _u8(w2),
        _u8(w2_scale),
        int(expert_offset),
        None if swiglu_limit is None else float(swiglu_limit),
        float(fp8_max),
    )


def check_mx_activation_scales(x, x_scale, topk_idx, w13, expert_offset, weight_layout, e4m3fn_native: bool):
    """The trn3 MX path of the fused kernel (prepared fp4 / MX fp8 weights, fp8 x) feeds x's scales to
    ``nc_matmul_mx`` as E8M0 bytes, which hold powers of two only: refuse, rather than truncate, a routed row whose
    scale is not one (rows routed to no local expert, e.g. 0xFF padding, are not read). ``expert_gemm``'s kernel
    checks this on chip and falls back to an exact path; the fused kernel does not, so the check is here. It reads
    the values, so it runs only for host tensors (interpreter / simulator); on a Neuron device the scales must
    be powers of two, as ``quantize_activation`` and ``StaticMoE`` make them (SPEC §1.1)."""
    if not (
        weight_layout == "eio"
        and e4m3fn_native
        and x.dtype == torch.float8_e4m3fn
        and w13.dtype in (torch.uint16, torch.uint32)
        and x_scale is not None
    ) or _on_neuron(x):
        return
    from ..layouts import pow2_exponents

    local = (topk_idx >= expert_offset) & (topk_idx < expert_offset + w13.shape[0])
    rows = local.any(dim=1)
    bad = ~pow2_exponents(x_scale[rows])[0]  # E8M0 holds 2^e only: negative, zero, non-finite scales refused too
    if bool(bad.any()):
        r = int(rows.nonzero()[bad.any(dim=1).nonzero()[0, 0], 0])
        raise ValueError(
            f"local_experts: x_scale[{r}] holds a scale that is not a power of two, and the trn3 MX path "
            "(prepared fp4 / MX fp8 weights with fp8 x) takes E8M0 scales only; quantize x with power-of-two "
            "scales (static_moe.formats.quantize_activation's default) or prepare the weights without MX "
            "(layouts.prepare_weight(..., act_format='bf16') keeps plain fp8) (SPEC §1.1)"
        )


def check_trn2_fp8_bytes(op: str, weights, weight_layout, e4m3fn_native: bool):
    """On trn2 the prepared ("eio") fp8 bytes are read as IEEE ``float8_e4m3``, whose exponent field 15 is inf /
    NaN: they must be the output of ``layouts.reencode_fp8_for_trn2`` (``prepare_weight(..., "trn2")`` does it).
    Refuse bytes that still hold |q| >= 256 instead of returning NaN. Reads the values, so host tensors only."""
    if weight_layout != "eio" or e4m3fn_native:
        return
    from ..layouts import trn2_blocks_to_reencode

    for name, w in weights:
        if w.dtype == torch.float8_e4m3fn and not _on_neuron(w) and bool(trn2_blocks_to_reencode(w, "eio").any()):
            raise ValueError(
                f"{op}: {name} holds float8_e4m3fn codes with |q| >= 256, which trn2's float8_e4m3 reads as inf/NaN; "
                "prepare the weights for trn2 with static_moe.layouts.prepare_weight(w, s, 'trn2') (or "
                "reencode_fp8_for_trn2), as StaticMoE(prepare_for='trn2') does"
            )


# ----------------------------------------------------------------------------------------------- launching
def _shim():
    """``static_moe.nki.shim``, imported on first use (it binds the real nki or the interpreter; ImportError with
    what to install where neither is importable)."""
    from . import shim

    return shim


def _kernels():
    from ..nki_kernels.expert_gemm import expert_gemm_kernel
    from ..nki_kernels.local_experts import local_experts_kernel
    from ..nki_kernels.pack_rows import pack_rows as pack_rows_kernel
    from ..nki_kernels.pack_rows import unpack_rows as unpack_rows_kernel
    from ..nki_kernels.swiglu_and_cast import swiglu_and_cast as swiglu_and_cast_kernel

    return {
        "expert_gemm": expert_gemm_kernel,
        "local_experts": local_experts_kernel,
        "pack_rows": pack_rows_kernel,
        "unpack_rows": unpack_rows_kernel,
        "swiglu_and_cast": swiglu_and_cast_kernel,
    }


def _on_neuron(t: torch.Tensor) -> bool:
    return t.device.type in ("xla", "neuron", "privateuseone")


# Kernels that split their work over ``nl.program_id`` and so launch at the platform's LNC (:func:`platform_lnc`):
# all five (pack / unpack and swiglu by rows, expert_gemm by output columns, local_experts by work items).
_LNC_KERNELS = ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts")


def platform_lnc() -> int:
    """The logical-NeuronCore degree kernels launch with: ``NEURON_LOGICAL_NC_CONFIG`` when set (the runtime's
    setting, which compiled code must match: Neuron compiler error NCC_EVRF066), else the compiler's default —
    LNC = 2 on trn2 and later, 1 on trn1 (NCC_EARG001: trn1 supports only 1). Off a device the target is the
    simulator's (``NEURON_PLATFORM_TARGET_OVERRIDE``, trn2 by default here) or the interpreter's."""
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env:
        if env not in ("1", "2"):
            raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {env!r}")
        return int(env)
    shim = _shim()
    if shim.real_nki_available():
        target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower()
    else:
        target = shim.interpreter.get_target().name
    return 1 if target in ("trn1", "gen2") else 2


def _launch(name: str, args: tuple, device: bool, **flags):
    kernel = _kernels()[name]
    shim = _shim()
    if shim.real_nki_available() and not device:
        os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    # kernel[lnc]: the launch-grid form of the LNC docs and the NKI simulator (nki.simulate(kernel[2]))
    lnc = platform_lnc() if name in _LNC_KERNELS else 1
    launch = shim.jit(kernel)[lnc] if lnc != 1 else shim.jit(kernel)
    if device:
        return launch(*args, **flags)
    return shim.simulate(launch if lnc != 1 else kernel)(*args, **flags)


def _e4m3fn_native() -> bool:
    """Whether the target has OCP e4m3fn on chip (trn3 / NeuronCore-v4)."""
    shim = _shim()
    if shim.real_nki_available():
        return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2").lower() in ("trn3", "gen4")
    return shim.interpreter.get_target().name == "trn3"


def _byte_rows(t):
    """A part [T, ...] as the uint8 [T, bytes per row] it packs to (a free view of a contiguous tensor)."""
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


def pack_rows(parts, capacity):
    """``torch.ops.static_moe.pack_rows`` through the NKI kernel (nki_kernels/pack_rows.py): uint8 [C, W] on the
    parts' device. Every part goes to the kernel as its uint8 bytes [T, row bytes] (the kernel copies bytes
    anyway, and so takes dtypes NKI lacks, such as int64). T = 0 (a rank without tokens) is all padding: the
    kernel needs T ≥ 1, so the 0xFF buffer is made by a fill on the device instead."""
    from ..packed_layout import PAD_BYTE

    parts = list(parts)
    if not parts:
        raise ValueError("pack_rows: parts must hold at least one tensor [T, ...], got an empty list")
    from .. import _C

    width = _C.check_pack_rows(parts, capacity)
    if parts[0].shape[0] == 0:
        return torch.full((capacity, width), PAD_BYTE, dtype=torch.uint8, device=parts[0].device)
    byte_parts = tuple(_byte_rows(p) for p in parts)
    return _launch("pack_rows", (byte_parts, int(capacity)), _on_neuron(parts[0]))


def unpack_rows(packed, offset, nbytes, dtype, row_shape):
    """``torch.ops.static_moe.unpack_rows`` through the NKI kernel: ``dtype [R, *row_shape]`` on packed's device.
    The kernel copies the span as bytes into an NKI tensor of ``dtype`` where NKI has that dtype; other dtypes
    (int64, float64, fp4 / e8m0 pairs) and R = 0 come back as the uint8 span viewed as ``dtype`` on the device."""
    from .. import _C

    _C.check_unpack_rows(packed, offset, nbytes, dtype, list(row_shape))
    rows, row_shape = packed.shape[0], tuple(int(d) for d in row_shape)
    shim = _shim()
    try:
        nl_dtype = shim.nl_dtype(dtype)
    except ValueError:
        nl_dtype = None
    if nl_dtype is not None and rows > 0 and nbytes > 0 and row_shape:
        return _launch("unpack_rows", (packed, int(offset), int(nbytes), nl_dtype, row_shape), _on_neuron(packed))
    if rows > 0 and nbytes > 0:
        span = _launch(
            "unpack_rows", (packed, int(offset), int(nbytes), shim.nl.uint8, (int(nbytes),)), _on_neuron(packed)
        )
    else:
        span = packed[:, offset : offset + nbytes].clone()
    return span.view(dtype).reshape(rows, *row_shape)


def swiglu_and_cast(
    gate_up,
    row_weight,
    swiglu_limit,
    out_format="fp8",
    group_size=128,
    fp8_max=448.0,
    pow2_scale=True,
    activation="silu",
    alpha=DEFAULT_ALPHA,
):
    """``torch.ops.static_moe.swiglu_and_cast`` through the NKI kernel (nki_kernels/swiglu_and_cast.py). Returns
    (q, s) on gate_up's device: fp8 (float8_e4m3fn [R, I], float32 [R, I/g]) or bf16 (bf16 [R, I], float32
    [R, 0]: NKI tensors have no zero-sized dim, so the empty scale is made here). fp8_max > 240 needs native
    e4m3fn (trn3), as for local_experts. ``activation`` and ``alpha`` (SPEC §1.9) reach the kernel as keywords.
    """
    from .. import _C

    _C.check_swiglu_and_cast(
        gate_up, row_weight, swiglu_limit, out_format, group_size, fp8_max, pow2_scale, activation, alpha
    )
    if out_format == "fp8" and fp8_max > 240.0 and not _e4m3fn_native():
        raise ValueError(
            f"swiglu_and_cast: fp8_max={fp8_max} needs OCP float8_e4m3fn on chip (trn3); trn2's on-chip fp8 "
            "(float8_e4m3) tops out at 240 — pass fp8_max=240 on trn2 (SPEC §1.1)"
        )
    rows = gate_up.shape[0]
    inter = gate_up.shape[1] // 2
    if rows == 0:
        if out_format == "bf16":
            return gate_up.new_empty((0, inter), dtype=torch.bfloat16), gate_up.new_empty((0, 0), dtype=torch.float32)
        groups = inter // group_size
        return (
            gate_up.new_empty((0, inter), dtype=torch.float8_e4m3fn),
            gate_up.new_empty((0, groups), dtype=torch.float32),
        )
    weight = None if row_weight is None else row_weight.to(torch.float32)
    out = _launch(
        "swiglu_and_cast",
        (gate_up, weight),
        _on_neuron(gate_up),
        swiglu_limit=None if swiglu_limit is None else float(swiglu_limit),
        out_format=out_format,
        group_size=int(group_size),
        fp8_max=float(fp8_max),
        pow2_scale=bool(pow2_scale),
        activation=activation,
        alpha=float(alpha),
    )
    if out_format == "bf16":
        return out, gate_up.new_empty((rows, 0), dtype=torch.float32)
    return tuple(out)


def expert_gemm(
    a, a_scale, b, b_scale, row_mask, expert, weight_layout="eoi", bias=None, *, skip_unrouted: bool = True
):
    """``torch.ops.static_moe.expert_gemm`` through the NKI kernel: on the Neuron device when the tensors live
    there, else through the simulator / interpreter. Returns bf16 [R, N] on the inputs' device.
    ``weight_layout``: "eoi" or "eio" (static_moe.layouts), handed to the kernel as a keyword (module doc).
    ``bias`` (SPEC §1.9, float32 or bf16 ``[L, N]``) reaches the kernel as float32 (bf16 widens exactly)."""
    _check("expert_gemm", a, a_scale, b, b_scale, row_mask, expert, weight_layout=weight_layout, bias=bias)
    args = expert_gemm_args(a, a_scale, b, b_scale, row_mask, expert)
    check_trn2_fp8_bytes("expert_gemm", (("b", b[int(expert) : int(expert) + 1]),), weight_layout, _e4m3fn_native())
    flags = _layout_flags(weight_layout)
    if bias is not None:
        flags["bias"] = _f32(bias)
    return _launch("expert_gemm", args, _on_neuron(a), skip_unrouted=skip_unrouted, **flags)


def local_experts(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset,
    swiglu_limit=None,
    fp8_max=448.0,
    weight_layout="eoi",
    activation="silu",
    alpha=DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
    *,
    skip_unrouted: bool = True,
):
    """``torch.ops.static_moe.local_experts`` through the fused NKI kernel (device, or simulator / interpreter).
    Returns float32 [R, H]. ``weight_layout``: "eoi" or "eio", handed to the kernel as a keyword (module doc).
    The SPEC §1.9 variants (``activation`` / ``alpha``, the biases as float32) reach the kernel as keywords."""
    _check(
        "local_experts",
        x,
        x_scale,
        topk_idx,
        topk_weights,
        w13,
        w13_scale,
        w2,
        w2_scale,
        expert_offset,
        swiglu_limit,
        fp8_max,
        weight_layout=weight_layout,
        activation=activation,
        alpha=alpha,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )
    native = _e4m3fn_native()
    check_mx_activation_scales(x, x_scale, topk_idx, w13, expert_offset, weight_layout, native)
    check_trn2_fp8_bytes("local_experts", (("w13", w13), ("w2", w2)), weight_layout, native)
    args = local_experts_args(
        x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit, fp8_max, native
    )
    flags = _layout_flags(weight_layout)
    if activation != "silu":
        flags.update(activation=activation, alpha=float(alpha))
    for name, bias in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if bias is not None:
            flags[name] = _f32(bias)
    return _launch("local_experts", args, _on_neuron(x), skip_unrouted=skip_unrouted, **flags)


# ------------------------------------------------------------------------------------------- registration
def neuron_dispatch_keys() -> tuple[list[str], str]:
    """``(keys, why)``: the dispatch keys of an importable Neuron backend, or ``[]`` and the reason there is none."""
    keys, why = [], []
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as e:
        return [], f"torch-neuronx is not importable ({e}); no Neuron device backend"
    try:
        import torch_xla  # noqa: F401

        keys.append("XLA")
    except ImportError as e:
        why.append(f"torch_xla not importable ({e})")
    if torch._C._get_privateuse1_backend_name() == "neuron":
        keys.append("PrivateUse1")
    else:
        why.append("no native 'neuron' (PrivateUse1) device")
    try:
        real = _shim().real_nki_available()
    except ImportError:
        real = False
    if not real:
        return [], "torch-neuronx is importable but the real nki (nki.jit) is not"
    return keys, "; ".join(why)


def _implementations() -> dict:
    from ..ops.forward import forward_kernel

    return {
        "pack_rows": pack_rows,
        "unpack_rows": unpack_rows,
        "swiglu_and_cast": swiglu_and_cast,
        "expert_gemm": expert_gemm,
        "local_experts": local_experts,
        "forward": forward_kernel,
    }


def register_neuron_kernels(keys=None) -> list[str]:
    """Register the Neuron-device implementations of all six ``static_moe`` ops (module doc, path 1) for each
    dispatch key in ``keys`` (default: :func:`neuron_dispatch_keys`, ``[]`` without a Neuron backend; the test
    device passes ``["PrivateUse1"]``). Idempotent per key; returns every key registered so far."""
    if keys is None:
        keys, _ = neuron_dispatch_keys()
    impls = _implementations() if keys else {}
    for key in keys:
        if key in _registered:
            continue
        if key not in ("XLA", "PrivateUse1"):
            raise ValueError(f"register_neuron_kernels: keys must be 'XLA' or 'PrivateUse1', got {key!r}")
        for op in _OPS:
            torch.library.impl(f"static_moe::{op}", key)(impls[op])
        _registered.append(key)
    return list(_registered)


def status() -> dict:
    """Which of the three paths is available here, with the reason for each that is not."""
    keys, why = neuron_dispatch_keys()
    try:
        backend, shim_error = _shim().BACKEND, None
    except ImportError as e:  # neither a real nki nor the repository's interpreter
        backend, shim_error = None, str(e)
    return {
        "device": keys or None,
        "device_why_not": None if keys else why,
        "simulator": "nki.simulate" if backend == "nki" else None,
        "simulator_why_not": None
        if backend == "nki"
        else "the real nki (nki.jit/nki.simulate, Neuron's package index) is not importable here",
        "interpreter": backend == "interpreter",
        "interpreter_why_not": None
        if backend == "interpreter"
        else (shim_error or "a real nki is importable (STATIC_MOE_NKI=interpreter forces the interpreter)"),
    }
