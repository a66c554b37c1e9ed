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
writing into the workspace's buffers when a workspace for this (group, spec) is open (static_moe.workspace), into
temporaries otherwise. Every rank issues exactly one all-gather and one reduce-scatter whose shapes depend only
on the spec, whatever its tokens or routing (T = 0 included). Nothing in the body reads a tensor's values on the
host except the eager range check of ``topk_idx`` on CPU inputs (free there); device inputs are range-checked by
the Python wrapper :func:`forward` in eager mode only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.profiler import record_function

from .. import _C
from .. import workspace as _workspace
from ..formats import FP8_E4M3FN_MAX
from ..formats import weight_format as _weight_format
from ..reference.pack_rows import pack_layout, part_nbytes

_c10d = torch.ops._c10d_functional

# Labels of the forward's phases in torch.profiler traces (the demo sums them to report the collectives' share).
PHASES = ("pack", "all_gather", "unpack", "local_experts", "reduce_scatter", "combine")
PHASE_PREFIX = "static_moe.forward."


class ForwardDims(NamedTuple):
    tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    num_local: int  # L
    topk: int  # k
    act_format: str
    act_group: int  # 0 for bf16
    weight_format: str


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _symbolic(*tensors: torch.Tensor | None) -> bool:
    """Whether any size is symbolic (torch.compile with dynamic shapes): the C++ checks cannot read those."""
    return any(isinstance(s, torch.SymInt) for t in tensors if t is not None for s in t.shape)


def check_forward(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output,
                  num_experts: int, capacity: int, swiglu_limit, ep_rank: int, ep_size: int,
                  fp8_max: float = FP8_E4M3FN_MAX) -> ForwardDims:
    """Metadata-only checks of forward's arguments (SPEC §5), shared by the kernel and the fake.

    What forward hands on to local_experts — activation dtype, x_scale and the activation group, routing dtypes and
    shapes, weight formats and the format pair, weight and scale shapes and dtypes, H and I multiples of 128,
    swiglu_limit, fp8_max, and all of their devices — is checked by local_experts' own C++ check
    (csrc/checks/local_experts.h through ``_C.check_local_experts``, messages prefixed "forward:"), so each of
    those checks exists once, and it runs here, before the pack and the all-gather touch any buffer. Checked here:
    what is forward's own — positive H, I and k (the workspace is sized by them), T ≤ C, the EP topology and
    shared_output. Under symbolic sizes (torch.compile with dynamic shapes) the C++ check cannot read sizes and
    is left to the kernel, as in local_experts' fake.

    Raises ValueError / TypeError naming the argument, what was expected and what came. Reads no tensor values.
    """
    # --- topology first: ep_rank >= 0 makes this rank's expert offset ep_rank·L valid for the check below --------
    if not isinstance(ep_size, int) or ep_size <= 0:
        raise ValueError(f"forward: ep_size must be a positive int, got {ep_size!r}")
    if not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
        raise ValueError(f"forward: ep_rank must be in [0, ep_size={ep_size}), got {ep_rank!r}")
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"forward: capacity must be a positive int, got {capacity!r}")

    # --- everything local_experts will be given (its offset ep_rank·L >= 0 is checked above, so 0 stands in) ----
    if not _symbolic(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale):
        _C.check_local_experts(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, 0, swiglu_limit,
                               fp8_max, "forward")
    t, h = x.shape
    act = "fp8" if x.dtype == torch.float8_e4m3fn else "bf16"
    group = h // x_scale.shape[1] if act == "fp8" else 0
    num_local, inter, k = w13.shape[0], w13.shape[1] // 2, topk_idx.shape[1]

    # --- forward's own -----------------------------------------------------------------------------------------
    if h == 0:
        raise ValueError(f"forward: H (x.size(1)) must be a positive multiple of 128, got {h}")
    if inter == 0:
        raise ValueError(f"forward: I (w13.size(1) / 2) must be a positive multiple of 128, got {inter}")
    if k == 0:
        raise ValueError(f"forward: topk_idx must be [T={t}, k ≥ 1], got shape {_shape(topk_idx)}")
    if t > capacity:
        raise ValueError(f"forward: {t} tokens exceed the capacity of {capacity} (T ≤ C is required; "
                         "raise the capacity or split the batch)")
    if num_experts != num_local * ep_size:
        raise ValueError(f"forward: num_experts={num_experts} must equal local experts (w13.size(0)={num_local}) "
                         f"× ep_size={ep_size} = {num_local * ep_size}")
    if k > num_experts:
        raise ValueError(f"forward: top-k={k} exceeds num_experts={num_experts}")
    if shared_output is not None:
        if _shape(shared_output) != [t, h]:
            raise ValueError(f"forward: shared_output must be [T={t}, H={h}], got {_shape(shared_output)}")
        if shared_output.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"forward: shared_output must be float32, bfloat16 or float16, got {shared_output.dtype}")
        if shared_output.device != x.device:
            raise ValueError(f"forward: shared_output must be on the same device as x ({x.device}), got "
                             f"{shared_output.device}")
    return ForwardDims(t, h, inter, num_local, k, act, group, _weight_format(w13))


def workspace_spec(dims: ForwardDims, num_experts: int, capacity: int, ep_size: int,
                   device: torch.device) -> _workspace.WorkspaceSpec:
    """The workspace spec a call with these dimensions looks its buffers up under."""
    return _workspace.WorkspaceSpec(
        capacity=capacity, hidden=dims.hidden, intermediate=dims.intermediate, num_experts=num_experts,
        topk=dims.topk, ep_size=ep_size, act_format=dims.act_format, act_group=dims.act_group or 128,
        weight_format=dims.weight_format, device=str(device),
    )


def check_topk_range(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Eager-only value check (reads topk_idx on the host): ids must lie in [−1, num_experts)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(topk_idx))
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"forward: topk_idx must hold global expert ids in [-1, {num_experts}) (−1 = empty slot), "
                         f"got values in [{lo}, {hi}]")


def _resolve_group(group_name: str, ep_rank: int, ep_size: int):
    from torch.distributed.distributed_c10d import _resolve_process_group

    import torch.distributed as dist

    try:
        pg = _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"forward: group_name {group_name!r} names no process group (ep_size={ep_size})") from e
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if size != ep_size or rank != ep_rank:
        raise ValueError(f"forward: group {group_name!r} has {size} ranks and this process is rank {rank} in it, "
                         f"but ep_size={ep_size} and ep_rank={ep_rank} were passed")


def _packed_parts(x, x_scale, topk_idx, topk_weights) -> list[torch.Tensor]:
    parts = [x] if x_scale is None else [x, x_scale]
    return parts + [topk_idx.to(torch.int32), topk_weights.to(torch.float32)]


@torch.library.impl("static_moe::forward", "CompositeExplicitAutograd")
def _forward_kernel(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output,
                    num_experts, capacity, swiglu_limit, group_name, ep_rank, ep_size, fp8_max=FP8_E4M3FN_MAX):
    dims = check_forward(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output,
                         num_experts, capacity, swiglu_limit, ep_rank, ep_size, fp8_max)
    if x.device.type == "cpu":
        check_topk_range(topk_idx, num_experts)  # free on the host; device inputs: see forward()
    s, c = ep_size, capacity
    ws = None
    if s > 1:
        _resolve_group(group_name, ep_rank, ep_size)
        ws = _workspace.find(group_name, workspace_spec(dims, num_experts, capacity, ep_size, x.device))

    with record_function(PHASE_PREFIX + "pack"):
        parts = _packed_parts(x, x_scale, topk_idx, topk_weights)
        packed = torch.ops.static_moe.pack_rows(parts, c)
        send = packed if ws is None else ws.send.copy_(packed)

    if s > 1:
        with record_function(PHASE_PREFIX + "all_gather"):
            gathered = send.new_empty((s * c, send.shape[1])) if ws is None else ws.gathered
            gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(send, s, group_name, out=gathered))
    else:
        gathered = send

    with record_function(PHASE_PREFIX + "unpack"):
        spans, _ = pack_layout([part_nbytes(p) for p in parts])
        g = [torch.ops.static_moe.unpack_rows(gathered, off, n, p.dtype, list(p.shape[1:]))
             for (off, n), p in zip(spans, parts)]
        g_x, g_xs = g[0], (g[1] if x_scale is not None else None)
        g_idx, g_w = g[-2], g[-1]

    with record_function(PHASE_PREFIX + "local_experts"):
        acc = torch.ops.static_moe.local_experts(g_x, g_xs, g_idx, g_w, w13, w13_scale, w2, w2_scale,
                                                 ep_rank * dims.num_local, swiglu_limit, fp8_max)

    if s > 1:
        with record_function(PHASE_PREFIX + "reduce_scatter"):
            if ws is not None:
                # The reduce-scatter reads from the workspace so that, on symmetric memory, its input is
                # registered memory. (The copy goes away once local_experts can write into a given buffer.)
                acc = ws.acc.copy_(acc)
            scattered = acc.new_empty((c, dims.hidden)) if ws is None else ws.scattered
            scattered = _c10d.wait_tensor(_c10d.reduce_scatter_tensor_out(acc, "sum", s, group_name, out=scattered))
    else:
        scattered = acc

    with record_function(PHASE_PREFIX + "combine"):
        out = scattered[: dims.tokens]
        if shared_output is not None:
            out = out + shared_output.float()
        return out.to(torch.bfloat16)


@torch.library.register_fake("static_moe::forward")
def _forward_fake(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output,
                  num_experts, capacity, swiglu_limit, group_name, ep_rank, ep_size, fp8_max=FP8_E4M3FN_MAX):
    dims = check_forward(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output,
                         num_experts, capacity, swiglu_limit, ep_rank, ep_size, fp8_max)
    return x.new_empty((dims.tokens, dims.hidden), dtype=torch.bfloat16)


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def forward(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, shared_output=None, *,
            num_experts: int, capacity: int, swiglu_limit=None, group_name: str = "", ep_rank: int = 0,
            ep_size: int = 1, fp8_max: float = FP8_E4M3FN_MAX) -> torch.Tensor:
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
            §1.7), in (0, 448]: 448 for OCP float8_e4m3fn; use 240 on Trainium2, whose on-chip float8_e4m3 tops
            out there (its NKI kernel refuses 448 rather than change the numerics). x itself may hold e4m3fn
            values up to 448 either way. Ignored with bf16 x.

    All tensors live on one device. Collective over the EP group when ep_size > 1: every rank must call it.
    In eager mode (not under torch.compile or CUDA graph capture) ``topk_idx`` is range-checked first.
    """
    if not _tracing() and x.device.type != "cpu":
        check_topk_range(topk_idx, num_experts)  # a host sync: eager only
    return torch.ops.static_moe.forward(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale,
                                        shared_output, num_experts, capacity, swiglu_limit, group_name, ep_rank,
                                        ep_size, fp8_max)
