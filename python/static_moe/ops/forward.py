"""forward: the expert-parallel static MoE step (SPEC §0), its checks, kernel and fake.

The op is one opaque node for torch.compile / torch.export (a CompositeExplicitAutograd kernel in Python plus a
fake), so a compiled decode step keeps it whole and no data-dependent shape escapes. Its body, per EP rank r of
S with T ≤ C tokens:

    send      = pack_rows([x, (x_scale,) topk_idx:int32, topk_weights:fp32], C)    uint8 [C, W]
    gathered  = all_gather(send)                                                    uint8 [S·C, W]   (S > 1)
    x, ...    = unpack_rows(gathered, span) for every part
    acc       = local_experts(x, ..., expert_offset = r·L, fp8_max)                 fp32  [S·C, H]
    scattered = reduce_scatter_sum(acc)                                             fp32  [C, H]     (S > 1)
    out       = bf16(scattered[:T] + shared_output)                                 bf16  [T, H]

Collectives are torch's functional collectives on the group name (``_c10d_functional.*_out`` + ``wait_tensor``),
writing into a workspace's buffers (static_moe.workspace; the raw op's first step on a group acquires one itself).
The reduce-scatter reads local_experts' result where it lies, except on a symmetric-memory workspace, where it
is first copied into the registered ``acc`` buffer.
Every rank issues exactly one all-gather and one reduce-scatter whose shapes depend only on the workspace,
whatever its tokens or routing (T = 0 included).

Errors are collective (S > 1, docs/errors.md "The rule"): a rank whose call raises anything before the all-gather
— a failed check (T > C, ids outside [−1, E) in their own dtype, a wrong shape or dtype, a UE8M0 byte 255 or
NaN in its weight scales, an x_scale that is not positive and finite, a configuration that differs from the
other ranks'), or any other exception, whatever its type — still takes part in the all-gather,
with a step header (ops/step_status.py) that says so in place of its tokens. Every rank reads the S headers
after the all-gather and reaches the same verdict: either the step goes on, or every rank raises (the failing
rank its own error, the others RuntimeError naming it; configurations that differ: ValueError everywhere) and
skips the reduce-scatter, so no collective is left half-issued and the next step works. The header read is the
step's one host read of device data: free on CPU, one small device→host copy (a stream sync) on CUDA; under
CUDA graph capture (or inside :func:`deferred_verdict`, on any device) it is skipped and a failed or overflowing
step's output is NaN instead.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple

import torch
from torch.profiler import record_function

from .. import _C
from .. import workspace as _workspace
from ..activations import DEFAULT_ALPHA
from ..formats import FP8_E4M3FN_MAX, as_uint8
from ..layouts import layout_format as _layout_format
from ..packed_layout import pack_layout, part_nbytes
from . import combine as _combine_ops
from . import dispatch as _dispatch
from . import step_status as _status

_c10d = torch.ops._c10d_functional
_INT32_MAX = 2**31 - 1

# Labels of the forward's phases in torch.profiler traces (the demo sums them to report the collectives' share).
PHASES = ("pack", "all_gather", "unpack", "local_experts", "reduce_scatter", "combine")
PHASE_PREFIX = "static_moe.forward."


def _phase(name: str):
    """The ``record_function`` range of phase ``name`` while a torch profiler runs, else nothing: a range is a
    dispatcher call in and one out even with no profiler to record it, a visible share of a one-row call."""
    if torch._C._autograd._profiler_enabled():
        return record_function(PHASE_PREFIX + name)
    return contextlib.nullcontext()


class ForwardDims(NamedTuple):
    tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    num_local: int  # L
    topk: int  # k
    act_format: str
    act_group: int  # 0 for bf16
    weight_format: str


class ForwardConfig(NamedTuple):
    """One call's settings that follow ``ep_size`` in the op's schema (csrc/ops.cpp), in its order and with its
    defaults: built once per call from the schema arguments and handed on whole. A tuple in the schema's order, so
    ``*config`` is the schema's tail, positionally (a keyword argument costs the dispatcher a name lookup).

    fp8_max: SPEC §1.5; weight_layout: "eoi" | "eio" (SPEC §1.2); activation, alpha, w13_bias, w2_bias: SPEC §1.9,
    handed on to local_experts (and its check), the biases this rank's float32 / bf16 [L, 2I] and [L, H] on the
    inputs' device; dispatch, combine, dispatch_capacity: SPEC §7. Holds what the caller passed, unchecked:
    :func:`schema_error` checks the types, :func:`check_forward` the values. Compared by identity: the biases are
    tensors, and two calls' configurations are compared through their workspace specs and step headers instead.
    """

    fp8_max: float = FP8_E4M3FN_MAX
    weight_layout: str = "eoi"
    activation: str = "silu"
    alpha: float = DEFAULT_ALPHA
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    dispatch: str = "all_gather"
    combine: str = "fp32"
    dispatch_capacity: int = 0

    __eq__ = object.__eq__  # a tuple's == would compare the bias tensors elementwise
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    @property
    def variant(self) -> tuple:
        """The SPEC §1.9 arguments (activation, alpha, w13_bias, w2_bias), in local_experts' schema order: they
        follow its weight_layout there, as they follow it here."""
        return self[2:6]

    @property
    def expert_biases(self) -> bool:
        """Whether the call carries SPEC §1.9 biases: the workspace manifest's ``expert_biases``."""
        return self.w13_bias is not None or self.w2_bias is not None


DEFAULT_CONFIG = ForwardConfig()


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _weight_format(w: torch.Tensor, weight_layout: str = "eoi") -> str:
    """The weight format ("bf16", "fp8", "fp4") of w13 in a layout; fp8 MX is fp8 (the same e4m3fn codes)."""
    fmt = _layout_format(w, weight_layout)
    return "fp8" if fmt == "fp8_mx" else fmt


def _symbolic(*tensors: torch.Tensor | None) -> bool:
    """Whether any size is symbolic (torch.compile with dynamic shapes): the C++ checks cannot read those."""
    return any(isinstance(s, torch.SymInt) for t in tensors if t is not None for s in t.shape)


def check_forward(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output,
    num_experts: int,
    capacity: int,
    swiglu_limit,
    ep_rank: int,
    ep_size: int,
    config: ForwardConfig = DEFAULT_CONFIG,
    sized: bool = False,
) -> ForwardDims:
    """Metadata-only checks of forward's arguments (SPEC §5), shared by the kernel and the fake; ``sized``: the
    caller knows every size is concrete (an eager kernel's inputs), so they are not looked through for symbols.

    What forward hands on to local_experts — activation dtype, x_scale and the activation group, routing dtypes and
    shapes, weight formats and the format pair, weight and scale shapes and dtypes, H and I multiples of 128,
    swiglu_limit, fp8_max, and all of their devices — is checked by local_experts' own C++ check
    (csrc/checks/local_experts.h through ``_C.check_local_experts``, messages prefixed "forward:"), so each of
    those checks exists once, and it runs here, before the pack and the all-gather touch any buffer. Checked here:
    what is forward's own — positive H, I and k (the workspace is sized by them), T ≤ C, the EP topology and
    shared_output. Under symbolic sizes (torch.compile with dynamic shapes) the C++ check cannot read sizes and
    is left to the kernel, as in local_experts' fake. ``config.weight_layout`` ("eoi" or the prepared "eio") says
    how w13 / w2 are laid out; local_experts' check validates it and the shapes it implies, and the SPEC §1.9
    ``config.variant`` handed on to local_experts; SPEC §7's dispatch settings are checked here.

    Raises ValueError / TypeError naming the argument, what was expected and what came. Reads no tensor values.
    """
    # --- topology first: ep_rank >= 0 makes this rank's expert offset ep_rank·L valid for the check below --------
    if not isinstance(ep_size, int) or ep_size <= 0:
        raise ValueError(f"forward: ep_size must be a positive int, got {ep_size!r}")
    if not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
        raise ValueError(f"forward: ep_rank must be in [0, ep_size={ep_size}), got {ep_rank!r}")
    if not isinstance(capacity, int) or capacity <= 0 or capacity > _INT32_MAX:
        raise ValueError(
            f"forward: capacity must be a positive int, at most 2^31 − 1 (the packed rows and the "
            f"step header count rows in int32), got {capacity!r}"
        )
    check_dispatch(config.dispatch, config.combine, config.dispatch_capacity, capacity)

    # --- everything local_experts will be given (its offset ep_rank·L >= 0 is checked above, so 0 stands in) ----
    if sized or not _symbolic(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale):
        _C.check_local_experts(
            x,
            x_scale,
            topk_idx,
            topk_weights,
            w13,
            w13_scale,
            w2,
            w2_scale,
            0,
            swiglu_limit,
            config.fp8_max,
            "forward",
            config.weight_layout,
            *config.variant,
        )
    t, h = x.shape
    act = "fp8" if x.dtype == torch.float8_e4m3fn else "bf16"
    group = h // x_scale.shape[1] if act == "fp8" else 0
    weight_layout = config.weight_layout
    n13 = w13.shape[2] if weight_layout == "eio" else w13.shape[1]
    num_local, inter, k = w13.shape[0], n13 // 2, topk_idx.shape[1]

    # --- forward's own -----------------------------------------------------------------------------------------
    if h == 0:
        raise ValueError(f"forward: H (x.size(1)) must be a positive multiple of 128, got {h}")
    if inter == 0:
        raise ValueError(
            f"forward: I (w13.size({2 if weight_layout == 'eio' else 1}) / 2) must be a positive "
            f"multiple of 128, got {inter}"
        )
    if k == 0:
        raise ValueError(f"forward: topk_idx must be [T={t}, k ≥ 1], got shape {_shape(topk_idx)}")
    if t > capacity:
        raise ValueError(
            f"forward: {t} tokens exceed the capacity of {capacity} (T ≤ C is required; "
            "raise the capacity or split the batch)"
        )
    if num_experts != num_local * ep_size:
        raise ValueError(
            f"forward: num_experts={num_experts} must equal local experts (w13.size(0)={num_local}) "
            f"× ep_size={ep_size} = {num_local * ep_size}"
        )
    if k > num_experts:
        raise ValueError(f"forward: top-k={k} exceeds num_experts={num_experts}")
    if shared_output is not None:
        if _shape(shared_output) != [t, h]:
            raise ValueError(f"forward: shared_output must be [T={t}, H={h}], got {_shape(shared_output)}")
        if shared_output.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"forward: shared_output must be float32, bfloat16 or float16, got {shared_output.dtype}")
        if shared_output.device != x.device:
            raise ValueError(
                f"forward: shared_output must be on the same device as x ({x.device}), got {shared_output.device}"
            )
    return ForwardDims(t, h, inter, num_local, k, act, group, _weight_format(w13, weight_layout))


def check_dispatch(dispatch, combine, dispatch_capacity, capacity: int) -> None:
    """SPEC §7's arguments: dispatch "all_gather" | "all_to_all", combine "fp32" | "bf16" ("all_to_all" needs
    "bf16"), dispatch_capacity 0 with "all_gather", in [1, capacity] with "all_to_all". ValueError naming them."""
    if dispatch not in _workspace.DISPATCHES:
        raise ValueError(f"forward: dispatch must be one of {_workspace.DISPATCHES}, got {dispatch!r}")
    if combine not in _workspace.COMBINES:
        raise ValueError(f"forward: combine must be one of {_workspace.COMBINES}, got {combine!r}")
    if not isinstance(dispatch_capacity, int) or isinstance(dispatch_capacity, bool):
        raise ValueError(f"forward: dispatch_capacity must be an int, got {dispatch_capacity!r}")
    if dispatch == "all_to_all":
        if combine != "bf16":
            raise ValueError("forward: dispatch='all_to_all' returns bf16 partials: it needs combine='bf16'")
        if not 1 <= dispatch_capacity <= capacity:
            raise ValueError(
                f"forward: dispatch_capacity must lie in [1, capacity={capacity}] with dispatch='all_to_all', "
                f"got {dispatch_capacity}"
            )
    elif dispatch_capacity != 0:
        raise ValueError(
            f"forward: dispatch_capacity must be 0 with dispatch='all_gather' (it sizes the all-to-all's "
            f"blocks), got {dispatch_capacity}"
        )


def workspace_spec(
    dims: ForwardDims,
    num_experts: int,
    capacity: int,
    ep_size: int,
    device: torch.device,
    swiglu_limit=None,
    config: ForwardConfig = DEFAULT_CONFIG,
) -> _workspace.WorkspaceSpec:
    """The workspace spec a call with these dimensions looks its buffers up under."""
    return _workspace.WorkspaceSpec(
        capacity=capacity,
        hidden=dims.hidden,
        intermediate=dims.intermediate,
        num_experts=num_experts,
        topk=dims.topk,
        ep_size=ep_size,
        act_format=dims.act_format,
        act_group=dims.act_group or 128,
        weight_format=dims.weight_format,
        device=str(device),
        swiglu_limit=swiglu_limit,
        fp8_max=config.fp8_max,
        dispatch=config.dispatch,
        combine=config.combine,
        dispatch_capacity=config.dispatch_capacity,
        activation=config.activation,
        alpha=config.alpha,
        expert_biases=config.expert_biases,
    )


def check_topk_range(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Eager-only value check (reads topk_idx on the host): ids must lie in [−1, num_experts)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(topk_idx))
    if lo < -1 or hi >= num_experts:
        raise ValueError(
            f"forward: topk_idx must hold global expert ids in [-1, {num_experts}) (−1 = empty slot), "
            f"got values in [{lo}, {hi}]"
        )


def check_scale_range(x_scale: torch.Tensor | None) -> None:
    """Eager-only value check (reads x_scale on the host): fp8 activation scales must be positive and finite (a NaN
    or Inf in the activation gives −0.0 or Inf when quantized on a device, docs/errors.md)."""
    if x_scale is None or x_scale.numel() == 0:
        return
    bad = ~(torch.isfinite(x_scale) & (x_scale > 0))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"forward: x_scale must hold positive finite scales, but x_scale[{row}, {col}] is not (NaN, "
            "Inf, 0 or negative: e.g. a NaN or Inf in the activation it was quantized from)"
        )


def _resolve_group(group_name: str, ep_size):
    """(process group, its size, this process's rank in it). A name that names no group raises ValueError here,
    locally: without a group there is no collective to keep in step (every rank normally shares the name)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        pg = _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"forward: group_name {group_name!r} names no process group (ep_size={ep_size})") from e
    return pg, dist.get_world_size(pg), dist.get_rank(pg)


def _check_topology(group_name: str, size: int, rank: int, ep_rank, ep_size) -> None:
    if size != ep_size or rank != ep_rank:
        raise ValueError(
            f"forward: group {group_name!r} has {size} ranks and this process is rank {rank} in it, "
            f"but ep_size={ep_size} and ep_rank={ep_rank} were passed"
        )


# Weight scales already checked for NaN, by tensor: id -> (weakref, (version, data_ptr, shape, dtype)). A layer
# passes the same tensors every step, so the scan runs once per weight load (a write through torch bumps the
# version); inference tensors carry no version counter and are scanned every step.
_CHECKED_SCALES: dict[int, tuple] = {}


def _scale_stamp(s: torch.Tensor):
    if s.is_inference():
        return None
    return s._version, s.data_ptr(), tuple(s.shape), s.dtype


def check_weight_scale_values(w13_scale, w2_scale, weight_format: str) -> None:
    """This rank's weight scales hold no NaN: no UE8M0 byte 255 (fp4), no NaN / Inf float32 scale (fp8).

    Run before the all-gather, so that a bad byte a kernel would meet after it (only in a routed expert, so on
    some steps only) fails the step on every rank instead. Reads values: a host sync on a device the first
    time a tensor is seen (skipped under CUDA graph capture: check before capturing)."""
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s is None or s.numel() == 0:
            continue
        stamp = _scale_stamp(s)
        seen = _CHECKED_SCALES.get(id(s))
        if stamp is not None and seen is not None and seen[0]() is s and seen[1] == stamp:
            continue
        if s.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            continue
        if weight_format == "fp4" or s.dtype in (torch.uint8, torch.float8_e8m0fnu):  # UE8M0 (fp4, fp8 MX)
            bad = as_uint8(s).reshape(-1) == 255
            what = "the UE8M0 NaN byte 255"
        else:
            bad = ~torch.isfinite(s.reshape(-1))
            what = "a NaN or Inf scale"
        if bool(bad.any()):
            i = int(bad.to(torch.int32).argmax())
            raise ValueError(
                f"forward: {name} holds {what} at flat index {i} (shape {list(s.shape)}); weight "
                "scales must be finite (UE8M0 bytes 0..254)"
            )
        if stamp is not None:
            key = id(s)
            _CHECKED_SCALES[key] = (weakref.ref(s, lambda _, k=key: _CHECKED_SCALES.pop(k, None)), stamp)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call where ``t`` already has it: a no-op ``.to`` still costs a dispatcher round
    trip (about 1.7 µs on CPU), a visible share of a one-row call."""
    return t if t.dtype == dtype else t.to(dtype)


def _packed_parts(x, x_scale, topk_idx, topk_weights) -> list[torch.Tensor]:
    parts = [x] if x_scale is None else [x, x_scale]
    return parts + [as_dtype(topk_idx, torch.int32), as_dtype(topk_weights, torch.float32)]


def forward_kernel(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output,
    num_experts,
    capacity,
    swiglu_limit,
    group_name,
    ep_rank,
    ep_size,
    fp8_max=FP8_E4M3FN_MAX,
    weight_layout="eoi",
    activation="silu",
    alpha=DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
    dispatch="all_gather",
    combine="fp32",
    dispatch_capacity=0,
):
    config = ForwardConfig(
        fp8_max, weight_layout, activation, alpha, w13_bias, w2_bias, dispatch, combine, dispatch_capacity
    )
    inputs = (x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output)
    if _collective(group_name, ep_size):
        return _forward_collective(*inputs, num_experts, capacity, swiglu_limit, group_name, ep_rank, ep_size, config)
    dims = check_forward(*inputs, num_experts, capacity, swiglu_limit, ep_rank, ep_size, config, sized=True)
    check_weight_scale_values(w13_scale, w2_scale, dims.weight_format)  # the value checks of S > 1, same words
    if x.device.type == "cpu":
        check_topk_range(topk_idx, num_experts)  # free on the host; device inputs: see forward()
        check_scale_range(x_scale)
        # No dispatch, so no packed buffer: the experts read the T rows as given (as the unpacked rows: contiguous,
        # ids int32, weights float32), without the copies and the capacity's padding rows. The same bits: a row's
        # result does not depend on the rows beside it (batch invariance), and padding rows add nothing. Device
        # backends keep the capacity-shaped step their kernels were built and tested with.
        parts = [p.contiguous() for p in _packed_parts(x, x_scale, topk_idx, topk_weights)]
        rows_scale = parts[1] if x_scale is not None else None
        with _phase("local_experts"):
            acc = _local_experts(
                parts[0], rows_scale, parts[-2], parts[-1], w13, w13_scale, w2, w2_scale, 0, swiglu_limit, config
            )
        return _finish(acc, dims.tokens, shared_output, config)
    with _phase("pack"):
        parts = _packed_parts(x, x_scale, topk_idx, topk_weights)
        packed = torch.ops.static_moe.pack_rows(parts, capacity)
    acc = _local_step(
        packed,
        parts,
        x_scale is not None,
        w13,
        w13_scale,
        w2,
        w2_scale,
        0,
        swiglu_limit,
        config,
    )
    return _finish(acc, dims.tokens, shared_output, config)


def _finish(acc, tokens, shared_output, config: ForwardConfig) -> torch.Tensor:
    """The S = 1 step's output from its fp32 partial ``acc`` [≥ T, H]: bf16 [T, H]."""
    if config.combine == "bf16":  # SPEC §7: the one rank's partial, rounded once (S = 1: no collective either way)
        acc = acc.to(torch.bfloat16).float()
    return _combine(acc, tokens, shared_output)


# Registered by a call, not as a decorator: torch.library.impl's decorator returns None, which would leave
# ``forward_kernel`` None for the Neuron registrations (static_moe.nki.dispatch) that reuse it.
torch.library.impl("static_moe::forward", "CompositeExplicitAutograd")(forward_kernel)


def _collective(group_name: str, ep_size) -> bool:
    """Whether the call is a collective step: ep_size > 1, or a group_name that names a group of several ranks (a
    rank passing ep_size = 1 there is a topology mismatch its peers must hear of, not a private S = 1 step)."""
    if isinstance(ep_size, int) and ep_size > 1:
        return True
    if not group_name:
        return False
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return dist.get_world_size(_resolve_process_group(group_name)) > 1
    except Exception:  # noqa: BLE001  (no such group: the S = 1 step ignores the name)
        return False


def _local_step(
    gathered,
    parts,
    has_scale,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset,
    swiglu_limit,
    config: ForwardConfig,
) -> torch.Tensor:
    """unpack every part of the gathered rows, then local_experts: fp32 [rows, H]."""
    with _phase("unpack"):
        spans, _ = pack_layout([part_nbytes(p) for p in parts])
        g = [
            torch.ops.static_moe.unpack_rows(gathered, off, n, p.dtype, list(p.shape[1:]))
            for (off, n), p in zip(spans, parts)
        ]
        g_x, g_xs = g[0], (g[1] if has_scale else None)
        g_idx, g_w = g[-2], g[-1]
    with _phase("local_experts"):
        return _local_experts(g_x, g_xs, g_idx, g_w, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit, config)


def _local_experts(x, x_scale, idx, weights, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit, config):
    """local_experts over rows x [R, H] (+ x_scale), ids int32 / weights float32 [R, k]: fp32 [R, H]."""
    return torch.ops.static_moe.local_experts(
        x,
        x_scale,
        idx,
        weights,
        w13,
        w13_scale,
        w2,
        w2_scale,
        expert_offset,
        swiglu_limit,
        config.fp8_max,
        config.weight_layout,
        *config.variant,
    )


def _combine(scattered, tokens, shared_output):
    with _phase("combine"):
        out = scattered if scattered.shape[0] == tokens else scattered[:tokens]
        if shared_output is not None:
            out = out + as_dtype(shared_output, torch.float32)
        return out.to(torch.bfloat16)


# --- the collective step (S > 1) -----------------------------------------------------------------------------
def _call_config(
    x,
    x_scale,
    topk_idx,
    w13,
    num_experts,
    capacity,
    swiglu_limit,
    ep_size,
    config: ForwardConfig,
) -> dict:
    """What this rank's call says about the configuration every rank must share, read leniently from metadata (a
    field its arguments are too malformed to give is None); values as WorkspaceSpec spells them."""

    def dim(t, n, d):
        return t.shape[d] if isinstance(t, torch.Tensor) and t.dim() == n else None

    act = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}.get(getattr(x, "dtype", None))
    hidden = dim(x, 2, 1)
    group = 0 if act == "bf16" else None
    groups = dim(x_scale, 2, 1) if act == "fp8" else None
    if hidden and groups and hidden % groups == 0:
        group = hidden // groups
    two_i = dim(w13, 3, 2 if config.weight_layout == "eio" else 1)
    try:
        wfmt = _weight_format(w13, config.weight_layout)
    except (TypeError, AttributeError, ValueError):
        wfmt = None
    limit_ok = swiglu_limit is None or _finite_f32(swiglu_limit)
    return dict(
        capacity=capacity if isinstance(capacity, int) else None,
        hidden=hidden,
        intermediate=None if two_i is None else two_i // 2,
        num_experts=num_experts if isinstance(num_experts, int) else None,
        topk=dim(topk_idx, 2, 1),
        ep_size=ep_size,
        act_format=act,
        weight_format=wfmt,
        act_group=group,
        swiglu_limit=swiglu_limit if limit_ok else None,
        fp8_max=(float(config.fp8_max) if act == "fp8" and _finite_f32(config.fp8_max) else FP8_E4M3FN_MAX),
        dispatch=config.dispatch,
        combine=config.combine,
        dispatch_capacity=config.dispatch_capacity,
        activation=config.activation,
        alpha=float(config.alpha) if _finite_f32(config.alpha) else DEFAULT_ALPHA,
        expert_biases=config.expert_biases,
    )


def _finite_f32(v) -> bool:
    try:
        return bool(torch.isfinite(torch.tensor(float(v), dtype=torch.float64).to(torch.float32)))
    except (TypeError, ValueError):
        return False


def _spec_of(cfg: dict, device) -> _workspace.WorkspaceSpec | None:
    if any(
        cfg[k] is None
        for k in (
            "capacity",
            "hidden",
            "intermediate",
            "num_experts",
            "topk",
            "act_format",
            "weight_format",
            "act_group",
        )
    ):
        return None
    try:
        return _workspace.WorkspaceSpec(
            capacity=cfg["capacity"],
            hidden=cfg["hidden"],
            intermediate=cfg["intermediate"],
            num_experts=cfg["num_experts"],
            topk=cfg["topk"],
            ep_size=cfg["ep_size"],
            act_format=cfg["act_format"],
            act_group=cfg["act_group"] or 128,
            weight_format=cfg["weight_format"],
            device=str(device),
            swiglu_limit=cfg["swiglu_limit"],
            fp8_max=cfg["fp8_max"],
            dispatch=cfg["dispatch"],
            combine=cfg["combine"],
            dispatch_capacity=cfg["dispatch_capacity"],
            activation=cfg["activation"],
            alpha=cfg["alpha"],
            expert_biases=cfg["expert_biases"],
        )
    except (ValueError, TypeError):
        return None


def _first_step_on_group(pg, error: BaseException | None, spec) -> None:
    """The raw op's first step on a group that has no workspace (every rank is in that state alike): exchange
    errors, then acquire the op's own workspace — both collective, so ranks whose configurations differ get
    ValueError on every rank (the workspace manifests differ) before any buffer reaches a collective."""
    if error is None and spec is None:
        error = ValueError("forward: the call's configuration makes no valid workspace spec")
    _workspace.converge(pg, error, "forward", others_error=_status.others_error)
    _workspace.acquire_implicit(spec, pg)


# Open deferred_verdict() blocks in this process (a depth, so that blocks nest).
_DEFERRED = 0


@contextlib.contextmanager
def deferred_verdict():
    """Run the collective steps inside the block as under CUDA graph capture, on any device (CPU included).

    forward does this by itself when the stream of its inputs is capturing; this block forces the same code path
    where nothing captures, so that it runs and can be tested without a GPU: the S step headers are never read
    on the host (``step_status.device_verdict`` and ``device_overflow`` decide on the device), a step that some
    rank's header fails or whose all-to-all dispatch overflows returns NaN [T, H] on every rank instead of
    raising or recomputing, and the workspace's int32 [1] ``overflow`` flag (on the inputs' device) says whether
    the all-to-all overflowed. As at capture time, what is decided on the host still raises on its own rank only
    — a failed argument check, a step that needs another workspace than the group's current one — so run one
    eager step with the same shapes first and pass valid arguments. Not thread-safe: one process, one thread.
    """
    global _DEFERRED
    _DEFERRED += 1
    try:
        yield
    finally:
        _DEFERRED -= 1


def _capturing(t) -> bool:
    """Whether a step runs as under CUDA graph capture (the verdict stays on the device): inside
    :func:`deferred_verdict`, or while the current CUDA stream captures (t: a tensor of the step, whose device
    must be CUDA; None when the step has none, e.g. :func:`report_failure`)."""
    if _DEFERRED:
        return True
    if t is None:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _frame(ws, kind, error, cfg, x_scale, topk_idx, topk_weights, x, room: int) -> tuple:
    """Pack this rank's send buffer: its rows and a header with the value words (kind OK), or its error's message
    (an error kind, cut to ``room`` bytes: what one sender's block carries), or nothing (NEED_FRAME). Returns
    (kind, error, parts): a failure while packing an OK call becomes that call's error, so the step still reports
    it on every rank."""
    c, pw = ws.spec.capacity, ws.spec.parts_width
    if kind == _status.OK:
        try:
            parts = _packed_parts(x, x_scale, topk_idx, topk_weights)
            packed = torch.ops.static_moe.pack_rows(parts, c)
            header = _status.build_header(
                ws.send.device, kind, 0, _status.call_config_words(cfg, True), topk_idx, x_scale
            )
            _status.write_frame(ws.send, pw, header, packed)
            return kind, None, parts
        except Exception as e:  # noqa: BLE001  (reported like a failed check)
            kind, error = _status.error_kind(e), e
    message = b"" if kind == _status.NEED_FRAME else _status.message_bytes(_status.describe_error(error), room)
    header = _status.build_header(
        ws.send.device, kind, len(message), _status.call_config_words(cfg, kind == _status.NEED_FRAME), None, None
    )
    _status.write_frame(ws.send, pw, header, None, message)
    return kind, error, None


def report_failure(error: BaseException, group_name: str, ep_rank: int, ep_size: int):
    """Run a collective step on the group that reports ``error`` as this rank's: every rank raises (this one
    ``error``), exactly as for a failed check of the op. For a caller whose own checks failed before it could
    call the op (StaticMoE.forward, the wrapper's argument checks), so that its peers are not left waiting."""
    return _forward_collective(
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        group_name,
        ep_rank,
        ep_size,
        preset_error=error,
    )


def _forward_collective(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output,
    num_experts,
    capacity,
    swiglu_limit,
    group_name,
    ep_rank,
    ep_size,
    config: ForwardConfig = DEFAULT_CONFIG,
    retry: bool = True,
    preset_error: BaseException | None = None,
):
    pg, size, rank = _resolve_group(group_name, ep_size)
    # From here to the all-gather every exception, whatever its type, is this rank's verdict to report, never a
    # local raise: its peers are about to wait in the all-gather (docs/errors.md, "the rule").
    error, dims, cfg, spec = preset_error, None, None, None
    capturing = _capturing(x)
    if error is not None and capturing:
        raise error  # as a failed check below: a graph being captured runs nothing now, no step to keep in step
    if error is None:
        try:
            _check_topology(group_name, size, rank, ep_rank, ep_size)
            inputs = (x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output)
            dims = check_forward(*inputs, num_experts, capacity, swiglu_limit, ep_rank, ep_size, config, sized=True)
            check_weight_scale_values(w13_scale, w2_scale, dims.weight_format)
            cfg = _call_config(x, x_scale, topk_idx, w13, num_experts, capacity, swiglu_limit, size, config)
            spec = _spec_of(cfg, x.device)
        except Exception as e:  # noqa: BLE001
            if capturing:
                raise  # a graph being captured runs nothing now: there is no step to keep in step
            error = e
    ws = _workspace.current_frame(group_name)
    if ws is None:  # the group's first step (every rank alike): agree on a workspace first
        _first_step_on_group(pg, error, spec)
        ws = _workspace.current_frame(group_name)
    kind = _status.OK if error is None else _status.error_kind(error)
    if error is None and (spec is None or _workspace.frame_key(spec) != _workspace.frame_key(ws.spec)):
        kind = _status.NEED_FRAME  # fine, but not the current workspace's shapes: ask every rank to switch
    if kind == _status.NEED_FRAME and capturing:
        raise RuntimeError(
            "forward: this step's shapes need another workspace than the group's current one, which "
            "cannot be switched during CUDA graph capture: run one eager step with them first"
        )
    c, pw = ws.spec.capacity, ws.spec.parts_width
    # The step runs the group's current workspace's dispatch and combine (the same on every rank); a call that
    # asks for others is NEED_FRAME above, and the verdict switches every rank alike.
    slotted = ws.spec.dispatch == "all_to_all"
    block = ws.spec.dispatch_capacity if slotted else c  # rows of one sender's block in the dispatched buffer

    with _phase("pack"):
        kind, error, parts = _frame(ws, kind, error, cfg, x_scale, topk_idx, topk_weights, x, block * pw)

    slots = None
    if slotted:
        with _phase("all_to_all"):
            header = ws.send[0, pw:].view(torch.int32).clone()
            if kind == _status.OK:
                slots = _dispatch.slot_rows(topk_idx, c, num_experts, size, block)
                header[2:3] = slots.overflow  # word 2 of an OK header: rows this rank could not slot
            _dispatch.fill_blocks(ws.blocks, ws.send, pw, block, slots, header)
            rows = _dispatch.all_to_all(ws.received, ws.blocks, pg, "dispatch_all_to_all")
        headers = _dispatch.block_headers(rows, pw, block)
    else:
        with _phase("all_gather"):
            rows = _dispatch.all_gather(ws.send, ws.gathered, size, group_name)
        headers = _status.gathered_headers(rows, c, pw)

    poison = None
    overflowed = False
    if _capturing(headers):
        poison = _status.device_verdict(headers)
        if slotted:
            flag = _status.device_overflow(headers)
            ws.overflow.copy_(flag.to(torch.int32).reshape(1))
            poison = poison | flag
    else:
        host = headers.cpu().tolist()  # the step's one host read (a stream sync on CUDA)
        verdict = _status.decide(host, _status.read_messages(rows, host, block, pw))
        _status.raise_verdict(verdict, rank, size, error)
        if verdict.need_frame:  # every rank's call is fine and needs other shapes: switch, on every rank alike
            target = _workspace.find_frame(group_name, spec)
            if target is None:
                target = _workspace.acquire_implicit(spec, pg)
            _workspace.set_current_frame(group_name, target)
            if not retry:
                raise RuntimeError("forward: internal error: no workspace fits the step after acquiring one")
            return _forward_collective(
                x,
                x_scale,
                topk_idx,
                topk_weights,
                w13,
                w13_scale,
                w2,
                w2_scale,
                shared_output,
                num_experts,
                capacity,
                swiglu_limit,
                group_name,
                ep_rank,
                ep_size,
                config,
                retry=False,
            )
        if slotted:
            overflowed = bool(_status.overflow_ranks(host))
            ws.overflow.fill_(int(overflowed))

    if overflowed:
        # SPEC §7: some sender had more rows for a rank than Cd. Every rank read the same S counts, so every rank
        # recomputes the step here with the all-gather dispatch (its send frame is still in ws.send) and the same
        # bf16 combine: the exact result, bitwise what a large enough Cd would have given.
        with _phase("all_gather"):
            rows = _dispatch.all_gather(ws.send, ws.gathered, size, group_name)
        slotted, slots = False, None
        partial_buf = returned_buf = None
    else:
        partial_buf, returned_buf = (ws.partial, ws.returned) if ws.spec.combine == "bf16" else (None, None)

    kernel_error = None
    nrows = rows.shape[0]
    try:
        acc = _local_step(
            rows[:, :pw],
            parts,
            x_scale is not None,
            w13,
            w13_scale,
            w2,
            w2_scale,
            ep_rank * dims.num_local,
            swiglu_limit,
            config,
        )
    except Exception as e:  # noqa: BLE001
        # Expected only for what is checked inside local_experts rather than before the all-gather: on CPU / CUDA
        # weight_layout="eio" is refused here (after pack and all-gather, the error prefixed "local_experts: ").
        # The other ranks are already on their way to the combine: take part with NaN, so their outputs show it,
        # then raise.
        kernel_error = e
        acc = torch.full((nrows, dims.hidden), float("nan"), dtype=torch.float32, device=x.device)

    if ws.spec.combine == "fp32":
        with _phase("reduce_scatter"):
            # On symmetric memory the reduce-scatter's input must be the registered buffer, so local_experts'
            # result is copied there (until local_experts can write into a given buffer). Elsewhere (gloo, plain
            # NCCL) any tensor will do and the copy — S·C·H fp32, 7.3 MB at V3 T = 128 — would only lengthen the
            # step.
            if ws.symmetric:
                acc = ws.acc.copy_(acc)
            summed = _combine_ops.reduce_scatter_fp32(acc, ws.scattered, size, group_name)
    else:
        with _phase("combine_all_to_all"):
            if partial_buf is None:  # the recomputation after an overflow: bf16 [S·C, H] temporaries
                partial_buf = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
                returned_buf = torch.empty_like(partial_buf)
            if slotted:
                summed = _combine_ops.combine_bf16_slotted(acc, partial_buf, returned_buf, pg, slots.dest)
            else:
                summed = _combine_ops.combine_bf16_gathered(acc, partial_buf, returned_buf, pg, size)
    if kernel_error is not None:
        raise kernel_error
    out = _combine(summed, dims.tokens, shared_output)
    if poison is not None:
        out = torch.where(poison, torch.full_like(out, float("nan")), out)
    return out


def _report_meta_call(inputs: tuple, group_name, ep_rank, ep_size) -> None:
    """A collective call that reached the fake with real meta tensors (not a trace: the dispatcher sends any call
    with a meta argument here) would return shapes on this rank only: report it in a collective step instead.
    ``inputs``: the schema's first nine arguments (x … shared_output)."""
    from torch._subclasses.fake_tensor import FakeTensor

    names = [name for name, _ in _SCHEMA_TENSORS[: len(inputs)]]
    meta = [
        n for n, t in zip(names, inputs) if isinstance(t, torch.Tensor) and t.is_meta and not isinstance(t, FakeTensor)
    ]
    if meta and not torch.compiler.is_compiling():
        report_failure(
            ValueError(f"forward: {', '.join(meta)} on the meta device: a step needs real tensors, all on one device"),
            group_name,
            ep_rank if isinstance(ep_rank, int) else 0,
            ep_size,
        )


@torch.library.register_fake("static_moe::forward")
def _forward_fake(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output,
    num_experts,
    capacity,
    swiglu_limit,
    group_name,
    ep_rank,
    ep_size,
    fp8_max=FP8_E4M3FN_MAX,
    weight_layout="eoi",
    activation="silu",
    alpha=DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
    dispatch="all_gather",
    combine="fp32",
    dispatch_capacity=0,
):
    config = ForwardConfig(
        fp8_max, weight_layout, activation, alpha, w13_bias, w2_bias, dispatch, combine, dispatch_capacity
    )
    inputs = (x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output)
    if _collective(group_name, ep_size):
        _report_meta_call(inputs, group_name, ep_rank, ep_size)
    try:
        dims = check_forward(*inputs, num_experts, capacity, swiglu_limit, ep_rank, ep_size, config)
    except Exception:  # noqa: BLE001
        # A collective step: the kernel reports this error on every rank at run time. Raising here, at trace time
        # on this rank only, would leave the others' compiled steps waiting in the all-gather. The shape given
        # back is never produced: the step raises.
        if not _collective(group_name, ep_size):
            raise
        return x.new_empty((x.shape[0] if x.dim() else 0, x.shape[-1] if x.dim() else 0), dtype=torch.bfloat16)
    return x.new_empty((dims.tokens, dims.hidden), dtype=torch.bfloat16)


_SCHEMA_TENSORS = (
    ("x", False),
    ("x_scale", True),
    ("topk_idx", False),
    ("topk_weights", False),
    ("w13", False),
    ("w13_scale", True),
    ("w2", False),
    ("w2_scale", True),
    ("shared_output", True),
    ("w13_bias", True),
    ("w2_bias", True),
)
_INT64 = (-(2**63), 2**63 - 1)


def schema_error(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output,
    num_experts,
    capacity,
    swiglu_limit,
    group_name,
    ep_rank,
    ep_size,
    config: ForwardConfig = DEFAULT_CONFIG,
) -> Exception | None:
    """The error the op's schema would raise for these arguments (before the op's body, on one rank), as
    TypeError / ValueError naming the argument, or None when the schema accepts them."""
    given = dict(
        x=x,
        x_scale=x_scale,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        w13=w13,
        w13_scale=w13_scale,
        w2=w2,
        w2_scale=w2_scale,
        shared_output=shared_output,
        w13_bias=config.w13_bias,
        w2_bias=config.w2_bias,
    )
    for name, optional in _SCHEMA_TENSORS:
        t = given[name]
        if not (isinstance(t, torch.Tensor) or (optional and t is None)):
            return TypeError(
                f"forward: {name} must be a tensor{' or None' if optional else ''}, got {type(t).__name__}"
            )
    for name, v in (
        ("num_experts", num_experts),
        ("capacity", capacity),
        ("ep_rank", ep_rank),
        ("ep_size", ep_size),
        ("dispatch_capacity", config.dispatch_capacity),
    ):
        if not isinstance(v, int) or isinstance(v, bool):
            return ValueError(f"forward: {name} must be a positive int, got {v!r}")
        if not _INT64[0] <= v <= _INT64[1]:
            return ValueError(f"forward: {name} must fit in int64, got {v!r}")
    for name, v, optional in (
        ("swiglu_limit", swiglu_limit, True),
        ("fp8_max", config.fp8_max, False),
        ("alpha", config.alpha, False),
    ):
        if optional and v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return TypeError(f"forward: {name} must be a number{' or None' if optional else ''}, got {v!r}")
        try:
            float(v)
        except OverflowError:
            return ValueError(
                f"forward: {name} must be None or a positive finite number, got {v!r} (it overflows a float)"
            )
    for name, v in (
        ("group_name", group_name),
        ("weight_layout", config.weight_layout),
        ("activation", config.activation),
        ("dispatch", config.dispatch),
        ("combine", config.combine),
    ):
        if not isinstance(v, str):
            return TypeError(f"forward: {name} must be a str, got {type(v).__name__}")
    return None


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def forward(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    shared_output=None,
    *,
    num_experts: int,
    capacity: int,
    swiglu_limit=None,
    group_name: str = "",
    ep_rank: int = 0,
    ep_size: int = 1,
    fp8_max: float = FP8_E4M3FN_MAX,
    weight_layout: str = "eoi",
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
    w13_bias=None,
    w2_bias=None,
    dispatch: str = "all_gather",
    combine: str = "fp32",
    dispatch_capacity: int = 0,
) -> torch.Tensor:
    """bf16 [T, H]: the routed experts of one MoE layer over this rank's T ≤ capacity tokens (SPEC §0).

    Args:
        x: bf16 [T, H], or float8_e4m3fn [T, H] with ``x_scale`` float32 [T, H/g], g ∈ {32, 128}.
        topk_idx: int32/int64 [T, k], global expert ids in [0, num_experts) or −1 (empty slot).
        topk_weights: float32/bf16 [T, k].
        w13, w2: this rank's L = num_experts / ep_size experts, [L, 2I, H] and [L, H, I] (bf16 / fp8 with
            float32 1×128 scales / fp4 uint8 [.., K/2] with UE8M0 1×32 scales), global ids ep_rank·L … +L−1.
        shared_output: optional [T, H] added in fp32 before the bf16 cast.
        group_name: the EP process group's name (``group.group_name``); unused when ep_size = 1.
        fp8_max: with fp8 x, the range of the experts' fp8 re-quantization of the SwiGLU output (SPEC §1.5,
            §1.7), in [2, 448]: 448 for OCP float8_e4m3fn; use 240 on Trainium2, whose on-chip float8_e4m3 tops
            out there (its NKI kernel refuses 448 rather than change the numerics). x itself may hold e4m3fn
            values up to 448 either way. Ignored with bf16 x.
        weight_layout: "eoi" (nn.Linear [L, N, K], above) or "eio", the prepared K-major forms of
            ``static_moe.layouts`` (SPEC §1.2: w13 [L, H, 2I], w2 [L, I, H]; fp8 MX uint32 / fp4 uint16
            [L, K/4, N]). The reference and the NKI kernels take both; the CPU and CUDA kernels only "eoi".
        activation, alpha: the experts' gated activation (SPEC §1.9): "silu", "swiglu_oai" (gpt-oss, with
            ``alpha``) or "gelu_tanh".
        w13_bias, w2_bias: optional float32 / bf16 biases of this rank's experts, [L, 2I] and [L, H], added in
            fp32 before each GEMM's bf16 rounding (SPEC §1.9).
        dispatch, combine, dispatch_capacity: SPEC §7. "all_gather" + "fp32" (default) is SPEC §0's step;
            combine "bf16" rounds each rank's partial sums once to bf16 and sums them in fp32 in source-rank
            order; dispatch "all_to_all" (needs "bf16") sends each token only to the ranks that own one of its
            experts, in blocks of ``dispatch_capacity`` = Cd ∈ [1, capacity] rows per rank pair (0 with
            "all_gather"); a step where some block would need more is recomputed exactly with the all-gather on
            every rank (under CUDA graph capture: NaN output and the workspace's ``overflow`` flag set).
            ``static_moe.expert_parallel`` models their traffic and sizes Cd.

    All tensors live on one device. Collective over the EP group when ep_size > 1: every rank must call it, and
    an error on any rank raises on every rank (docs/errors.md). With ep_size = 1 and device inputs in eager mode
    (not under torch.compile or CUDA graph capture) ``topk_idx`` and ``x_scale`` are range-checked first; with
    ep_size > 1 the op checks them itself, in the step header, on every device.
    """
    config = ForwardConfig(
        fp8_max, weight_layout, activation, alpha, w13_bias, w2_bias, dispatch, combine, dispatch_capacity
    )
    inputs = (x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output)
    if _collective(group_name, ep_size):
        error = schema_error(*inputs, num_experts, capacity, swiglu_limit, group_name, ep_rank, ep_size, config)
        if error is not None:
            # The op's schema would refuse these arguments before its body runs, on this rank only: report them
            # in a collective step instead, so every rank raises.
            report_failure(error, group_name, ep_rank if isinstance(ep_rank, int) else 0, ep_size)
    elif ep_size == 1 and x.device.type != "cpu" and not _tracing():
        check_topk_range(topk_idx, num_experts)  # a host sync: eager only
        check_scale_range(x_scale)
    return torch.ops.static_moe.forward(
        *inputs, num_experts, capacity, swiglu_limit, group_name, ep_rank, ep_size, *config
    )
