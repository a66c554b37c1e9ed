"""The workspace manager (SPEC §3): owner of the buffers at both ends of the forward's two collectives.

A workspace holds, for one :class:`WorkspaceSpec` on one EP group, four buffers (S = ep_size, C = capacity,
W = packed row width, H = hidden):

=============  ==================  =======  ====================================================================
buffer         shape               dtype    role
=============  ==================  =======  ====================================================================
``send``       [C, W]              uint8    this rank's packed rows: input of the all-gather
``gathered``   [S·C, W]            uint8    every rank's packed rows: output of the all-gather
``acc``        [S·C, H]            float32  this rank's expert sums over all gathered rows: reduce-scatter input
``scattered``  [C, H]              float32  the summed rows this rank owns: reduce-scatter output
=============  ==================  =======  ====================================================================

and, with the bf16 combine or the all-to-all dispatch of SPEC §7 (Cd = dispatch capacity), also

=============  ==================  =======  ====================================================================
``partial``    [S·C or S·Cd, H]    bf16     this rank's expert sums rounded once: combine all-to-all input
``returned``   [S·C or S·Cd, H]    bf16     every rank's partials of this rank's rows: its output
``blocks``     [S·Cd, W + 16]      uint8    rows slotted per receiving rank (with the source row id): input
``received``   [S·Cd, W + 16]      uint8    the rows this rank's experts serve: output of the dispatch
``overflow``   [1]                 int32    the last all-to-all step's overflow flag (device-side)
=============  ==================  =======  ====================================================================

where W is the bytes of one packed row plus the 64-byte step header (``STEP_HEADER_NBYTES``: every rank's status
and configuration, read by every rank after the all-gather — ops/step_status.py, docs/errors.md), so a workspace
takes ``(S + 1)·C·(W + 4·H)`` bytes (:func:`memory_plan` gives the figure without allocating).
At S = 1 the forward runs no collective and the workspace owns nothing.

Lifecycle:

* :func:`acquire` is collective over the EP group. Every rank all-gathers its manifest (protocol version, the
  spec's fields, group membership, whether it already holds that workspace) before anything is allocated; any
  difference raises ValueError on every rank, naming the fields and the ranks. Allocation failures on any rank
  roll back every rank's partial allocation and raise on every rank, so no rank is left waiting in a later
  collective. The manager stays usable afterwards.
* Layers with the same spec on the same group membership share one workspace: each :func:`acquire` returns a
  new :class:`WorkspaceLease`; the last lease to close frees the buffers. ``close()`` is idempotent; touching a
  closed lease or a freed workspace raises RuntimeError.
* Buffers are allocated once and never reallocated, so their addresses are stable across calls (what CUDA
  graph capture and symmetric-memory rendezvous need). On CUDA, when torch's symmetric memory works on every
  rank, the buffers come from it and are rendezvoused on the group; elsewhere they are ordinary tensors.
* ``torch.ops.static_moe.forward`` sends through the group's *current* workspace (:func:`current_frame`, no
  collective), which every rank of the group holds alike because it only changes collectively (an acquire,
  or a step on which every rank asks for another one), so every rank's all-gather has the same shape whatever
  its own call says. When the group has no workspace at all (the raw op called without a layer), its first
  step acquires one itself (:func:`acquire_implicit`, collective like any acquire: ranks whose configurations
  differ get ValueError on every rank before any buffer reaches a collective); such workspaces live until
  :func:`release_implicit`. Acquire and close workspaces on every rank of a group alike, in the same order.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .activations import DEFAULT_ALPHA, check_activation
from .expert_parallel import COMBINES, DISPATCHES, ROW_ID_NBYTES
from .formats import FP8_E4M3FN_MAX, check_fp8_max, check_swiglu_limit
from .packed_layout import aligned

# 2: packed rows carry the step header; the manifest carries swiglu_limit and fp8_max. 3: the manifest carries the
# dispatch, the combine and the dispatch capacity Cd (SPEC §7). 4: the manifest carries the activation, alpha and
# whether the experts have biases (SPEC §1.9).
PROTOCOL_VERSION = 4

# Bytes at the end of every packed row that the forward reserves for its step header (its layout:
# ops/step_status.py). Fixed by the protocol, so every rank's row width agrees whatever its inputs.
STEP_HEADER_NBYTES = 64

ACT_FORMATS = ("bf16", "fp8")
WEIGHT_FORMATS = ("bf16", "fp8", "fp4")
ACT_GROUPS = (32, 128)
# SPEC §1.2: activation × weight pairs with a defined maths.
SUPPORTED_PAIRS = frozenset({("bf16", "bf16"), ("bf16", "fp8"), ("bf16", "fp4"), ("fp8", "fp8"), ("fp8", "fp4")})

BUFFER_NAMES = ("send", "gathered", "acc", "scattered", "partial", "returned", "blocks", "received", "overflow")


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class WorkspaceSpec:
    """Everything that fixes a workspace's buffers (SPEC §3): two layers with equal specs can share one.

    Attributes:
        capacity: C, the most tokens a rank sends per step (T ≤ C).
        hidden: H (multiple of 128).
        intermediate: I (multiple of 128).
        num_experts: E, global expert count (multiple of ep_size).
        topk: k, routing slots per token.
        ep_size: S, the EP group size.
        act_format: "bf16" or "fp8" (activations as sent).
        act_group: fp8 activation scale group g ∈ {32, 128}; normalised to 0 for bf16 activations.
        weight_format: "bf16", "fp8" or "fp4" (does not change the buffers, but ranks must agree on it).
        device: where the buffers live, as ``str(torch.device)``: "cpu", "cuda:0", ...
        swiglu_limit: the SwiGLU clamp (None: no clamp). Changes the maths, not the buffers: in the manifest so
            that ranks which disagree fail at creation.
        fp8_max: the fp8 re-quantization range in [2, 448] (normalised to 448 for bf16 activations, which do
            not use it). Same reason.
        dispatch: "all_gather" (SPEC §0) or "all_to_all" (the capacity all-to-all of SPEC §7).
        combine: "fp32" (the reduce-scatter of SPEC §0) or "bf16" (SPEC §7); "all_to_all" needs "bf16".
        dispatch_capacity: Cd, the most rows one rank sends to one rank with "all_to_all", in [1, C]; 0 with
            "all_gather" (normalised to 0 there).
        activation: the gated activation of SPEC §1.9 ("silu", "swiglu_oai", "gelu_tanh"). Changes the maths,
            not the buffers: in the manifest so that ranks which disagree fail at creation.
        alpha: α of "swiglu_oai" (positive, finite in float32; normalised to the default for the other
            activations, which do not read it). Same reason.
        expert_biases: whether the experts carry the SPEC §1.9 biases. Same reason.
    """

    capacity: int
    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    ep_size: int
    act_format: str = "bf16"
    act_group: int = 128
    weight_format: str = "bf16"
    device: str = "cpu"
    swiglu_limit: float | None = None
    fp8_max: float = FP8_E4M3FN_MAX
    dispatch: str = "all_gather"
    combine: str = "fp32"
    dispatch_capacity: int = 0
    activation: str = "silu"
    alpha: float = DEFAULT_ALPHA
    expert_biases: bool = False

    def __post_init__(self):
        for name in ("capacity", "hidden", "intermediate", "num_experts", "topk", "ep_size"):
            _positive_int(name, getattr(self, name))
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % 128:
                v = getattr(self, name)
                raise ValueError(
                    f"{name} must be a multiple of 128, got {v}: pad it with zeros to {-(-v // 128) * 128} (zero "
                    "x columns and weight rows / columns, zero bias entries; drop the padded output columns) — "
                    "exact, see SPEC §1.2 'Sizes'"
                )
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.ep_size})")
        if self.topk > self.num_experts:
            raise ValueError(f"topk ({self.topk}) cannot exceed num_experts ({self.num_experts})")
        if self.act_format not in ACT_FORMATS:
            raise ValueError(f"act_format must be one of {ACT_FORMATS}, got {self.act_format!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if (self.act_format, self.weight_format) not in SUPPORTED_PAIRS:
            raise ValueError(
                f"activation format {self.act_format!r} with weight format {self.weight_format!r} is not supported; "
                f"supported pairs (activation, weight): {sorted(SUPPORTED_PAIRS)}"
            )
        if self.act_format == "fp8":
            if self.act_group not in ACT_GROUPS:
                raise ValueError(f"act_group must be one of {ACT_GROUPS} for fp8 activations, got {self.act_group!r}")
            if self.hidden % self.act_group:
                raise ValueError(f"hidden ({self.hidden}) must be a multiple of act_group ({self.act_group})")
        else:
            object.__setattr__(self, "act_group", 0)
        try:
            device = str(torch.device(self.device))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must name a torch device, got {self.device!r}") from e
        if device == "meta":
            raise ValueError("device must be a real device, not 'meta': a workspace allocates its buffers")
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "swiglu_limit", check_swiglu_limit(self.swiglu_limit))
        fp8_max = check_fp8_max(self.fp8_max) if self.act_format == "fp8" else FP8_E4M3FN_MAX
        object.__setattr__(self, "fp8_max", fp8_max)
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {self.combine!r}")
        cd = self.dispatch_capacity
        if not isinstance(cd, int) or isinstance(cd, bool):
            raise ValueError(f"dispatch_capacity must be an int, got {cd!r}")
        if self.dispatch == "all_to_all":
            if self.combine != "bf16":
                raise ValueError("dispatch='all_to_all' returns bf16 partials: it needs combine='bf16'")
            if not 1 <= cd <= self.capacity:
                raise ValueError(
                    f"dispatch_capacity must lie in [1, capacity={self.capacity}] with dispatch='all_to_all', got {cd}"
                )
        else:
            object.__setattr__(self, "dispatch_capacity", 0)
        check_activation(self.activation, self.alpha, "WorkspaceSpec")
        object.__setattr__(self, "alpha", float(self.alpha) if self.activation == "swiglu_oai" else DEFAULT_ALPHA)
        if not isinstance(self.expert_biases, bool):
            raise ValueError(f"expert_biases must be a bool, got {self.expert_biases!r}")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def part_row_nbytes(self) -> list[int]:
        """Bytes per row of each packed part: x, (x_scale,) topk_idx as int32, topk_weights as float32."""
        x = [self.hidden * (2 if self.act_format == "bf16" else 1)]
        scale = [] if self.act_format == "bf16" else [4 * (self.hidden // self.act_group)]
        return x + scale + [4 * self.topk, 4 * self.topk]

    @property
    def parts_width(self) -> int:
        """Bytes of the packed parts of one row, every part starting 16-byte aligned (SPEC §1.8): pack_rows' W."""
        return sum(aligned(n) for n in self.part_row_nbytes())

    @property
    def row_width(self) -> int:
        """W: bytes of one row the forward sends: the packed parts, then the 64-byte step header."""
        return self.parts_width + STEP_HEADER_NBYTES

    @property
    def block_width(self) -> int:
        """Bytes of one row the all-to-all sends: the packed parts, the source row id column, the step header."""
        return self.parts_width + ROW_ID_NBYTES + STEP_HEADER_NBYTES

    def fields(self) -> tuple[tuple[str, object], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class BufferPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """The buffers a workspace for ``spec`` owns, with their byte counts (nothing allocated)."""

    spec: WorkspaceSpec
    buffers: tuple[BufferPlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def nbytes(self, name: str) -> int:
        return next(b.nbytes for b in self.buffers if b.name == name)

    def __str__(self) -> str:
        lines = [f"workspace for {self.spec}: {self.total_bytes} bytes ({self.total_bytes / 2**20:.2f} MiB)"]
        lines += [f"  {b.name:<10} {str(list(b.shape)):<16} {str(b.dtype):<14} {b.nbytes} B" for b in self.buffers]
        return "\n".join(lines)


def memory_plan(spec: WorkspaceSpec) -> MemoryPlan:
    """Shapes and bytes of every buffer of a workspace for ``spec``, without allocating.

    Total = (S + 1)·C·(W + 4·H) bytes for S > 1, 0 for S = 1, with the all-gather and the fp32 combine; the
    bf16 combine adds its two bf16 ``[S·C, H]`` buffers (``partial``, ``returned``: 4·S·C·H bytes); the all-to-all
    keeps the all-gather's buffers (its exact recomputation after an overflow, SPEC §7) and adds ``blocks`` and
    ``received`` (uint8 ``[S·Cd, W + 16]``), ``partial`` and ``returned`` (bf16 ``[S·Cd, H]``) and the int32
    ``overflow`` flag. Temporaries the forward allocates per call (the unpacked rows, the expert kernels' own
    scratch, the slot table) come from the caching allocator and are not counted.
    """
    s, c, w, h = spec.ep_size, spec.capacity, spec.row_width, spec.hidden
    if s == 1:
        return MemoryPlan(spec, ())
    bufs = [
        BufferPlan("send", (c, w), torch.uint8),
        BufferPlan("gathered", (s * c, w), torch.uint8),
        BufferPlan("acc", (s * c, h), torch.float32),
        BufferPlan("scattered", (c, h), torch.float32),
    ]
    if spec.dispatch == "all_to_all":
        cd, bw = spec.dispatch_capacity, spec.block_width
        bufs += [
            BufferPlan("blocks", (s * cd, bw), torch.uint8),
            BufferPlan("received", (s * cd, bw), torch.uint8),
            BufferPlan("partial", (s * cd, h), torch.bfloat16),
            BufferPlan("returned", (s * cd, h), torch.bfloat16),
            BufferPlan("overflow", (1,), torch.int32),
        ]
    elif spec.combine == "bf16":
        bufs += [
            BufferPlan("partial", (s * c, h), torch.bfloat16),
            BufferPlan("returned", (s * c, h), torch.bfloat16),
        ]
    return MemoryPlan(spec, tuple(bufs))


# ----------------------------------------------------------------------------------------------------------------
# Workspaces and leases
# ----------------------------------------------------------------------------------------------------------------
class Workspace:
    """The buffers for one (group membership, spec). Obtain one through :func:`acquire`; never construct it.

    Buffer properties raise RuntimeError once the last lease has closed and the buffers are freed.
    """

    def __init__(
        self,
        manager: WorkspaceManager,
        key,
        spec: WorkspaceSpec,
        group_names: set[str],
        buffers: dict[str, torch.Tensor],
        symmetric: bool,
    ):
        self._manager = manager
        self.key = key
        self.spec = spec
        self.group_names = group_names
        self.symmetric = symmetric
        self._buffers = buffers
        self._leases = 0
        self._closed = False
        self.implicit = False  # acquired by the forward op itself (acquire_implicit), not by a layer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_leases(self) -> int:
        return self._leases

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"workspace for {self.spec} is closed: its buffers were freed when its last lease "
                "closed; acquire a new one"
            )

    def buffer(self, name: str) -> torch.Tensor:
        self._check_open()
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyError(f"workspace has no buffer {name!r} (has {sorted(self._buffers)})") from None

    send = property(lambda self: self.buffer("send"), doc="uint8 [C, W]: all-gather input")
    gathered = property(lambda self: self.buffer("gathered"), doc="uint8 [S·C, W]: all-gather output")
    acc = property(lambda self: self.buffer("acc"), doc="float32 [S·C, H]: reduce-scatter input")
    scattered = property(lambda self: self.buffer("scattered"), doc="float32 [C, H]: reduce-scatter output")
    partial = property(lambda self: self.buffer("partial"), doc="bf16 [S·C or S·Cd, H]: bf16 combine input")
    returned = property(lambda self: self.buffer("returned"), doc="bf16 [S·C or S·Cd, H]: bf16 combine output")
    blocks = property(lambda self: self.buffer("blocks"), doc="uint8 [S·Cd, W + 16]: all-to-all dispatch input")
    received = property(lambda self: self.buffer("received"), doc="uint8 [S·Cd, W + 16]: all-to-all output")
    overflow = property(
        lambda self: self.buffer("overflow"),
        doc="int32 [1]: 1 when the group's last all-to-all step overflowed (its output is then exact in eager "
        "mode, NaN under CUDA graph capture), else 0 (SPEC §7)",
    )

    def data_ptrs(self) -> dict[str, int]:
        """Address of every buffer (stable for the workspace's life)."""
        self._check_open()
        return {n: self.buffer(n).data_ptr() for n in self._buffers}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._leases} lease(s)"
        return f"Workspace({self.spec}, {self.nbytes()} B, {state}, symmetric={self.symmetric})"


class WorkspaceLease:
    """One layer's hold on a shared workspace. ``close()`` is idempotent; the last lease frees the buffers."""

    def __init__(self, workspace: Workspace):
        self._workspace: Workspace | None = workspace
        workspace._leases += 1
        # A lease dropped without close() still gives its count back (local only: freeing is not collective).
        self._finalizer = weakref.finalize(self, workspace._manager._release, workspace)

    @property
    def closed(self) -> bool:
        return self._workspace is None

    @property
    def workspace(self) -> Workspace:
        if self._workspace is None:
            raise RuntimeError("this workspace lease is closed; acquire a new one")
        return self._workspace

    def close(self) -> None:
        if self._workspace is None:
            return
        self._workspace = None
        self._finalizer()  # runs _release exactly once

    def __enter__(self) -> WorkspaceLease:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return "WorkspaceLease(closed)" if self._workspace is None else f"WorkspaceLease({self._workspace!r})"


Allocator = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]


def plain_allocator(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Ordinary tensors from the caching allocator."""
    return torch.empty(shape, dtype=dtype, device=device)


def _symmetric_allocator(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    return symm_mem.empty(*shape, dtype=dtype, device=device)


def group_membership(group) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order (what identifies an EP group across processes)."""
    return tuple(dist.get_process_group_ranks(group))


def _describe_differences(manifests: list[dict], keys: list[str]) -> list[str]:
    out = []
    for key in keys:
        values = [m[key] for m in manifests]
        if all(v == values[0] for v in values):
            continue
        by_value: dict = {}
        for rank, v in enumerate(values):
            by_value.setdefault(repr(v), []).append(rank)
        out.append(f"{key}: " + "; ".join(f"{v} on ranks {r}" for v, r in by_value.items()))
    return out


def converge(group, local_error: BaseException | None, stage: str, others_error=None) -> None:
    """Collective over ``group``: if any rank reports an error, raise on every rank (never leave a rank waiting).

    The failing rank re-raises its own exception; the others raise an exception of the same type when it is a
    ValueError or TypeError, RuntimeError otherwise, naming the failing ranks and their messages — or
    ``others_error(failed)`` when given, with ``failed`` = {rank: (exception type name, message)}.
    """
    size = dist.get_world_size(group)
    payload = None if local_error is None else (type(local_error).__name__, str(local_error))
    reports: list = [None] * size
    dist.all_gather_object(reports, payload, group=group)
    failed = {r: p for r, p in enumerate(reports) if p is not None}
    if not failed:
        return
    if local_error is not None:
        raise local_error
    if others_error is not None:
        raise others_error(failed)
    kinds = {p[0] for p in failed.values()}
    cls = ValueError if kinds == {"ValueError"} else TypeError if kinds == {"TypeError"} else RuntimeError
    detail = "; ".join(f"rank {r}: {k}: {m}" for r, (k, m) in failed.items())
    raise cls(f"{stage} failed on group rank(s) {sorted(failed)}: {detail}")


class WorkspaceManager:
    """Process-wide registry of workspaces keyed by (group membership, spec).

    Args:
        allocator: makes one buffer, ``allocator(name, shape, dtype, device) -> Tensor``. None picks symmetric
            memory on CUDA where torch supports it, plain tensors elsewhere. Tests inject a failing one.
    """

    def __init__(self, allocator: Allocator | None = None):
        self._allocator = allocator
        self._lock = threading.Lock()
        self._by_key: dict = {}
        self._by_name: dict = {}
        self._current: dict = {}  # group name -> the workspace its next forward step uses

    # --- lookup (the op's path: no collective) ---------------------------------------------------------------
    def find(self, group_name: str, spec: WorkspaceSpec) -> Workspace | None:
        """The open workspace for ``spec`` acquired on the group called ``group_name``, if any."""
        return self._by_name.get((group_name, spec))

    def workspaces(self) -> list[Workspace]:
        return list(self._by_key.values())

    def on_group(self, group_name: str) -> list[Workspace]:
        """Open workspaces acquired on the group called ``group_name``, oldest first."""
        with self._lock:
            return [ws for (name, _), ws in self._by_name.items() if name == group_name]

    def find_frame(self, group_name: str, spec: WorkspaceSpec) -> Workspace | None:
        """Buffers of the right shapes for a forward step with ``spec`` on ``group_name``, if any (no collective).

        Any workspace whose buffers have the step's shapes (capacity, row width, H, ep_size, device: the bytes do
        not care about the rest, e.g. a layer's workspace spec that leaves swiglu_limit at its default): a
        layer's before one the op acquired itself, then the one for exactly ``spec``."""
        same = [w for w in self.on_group(group_name) if frame_key(w.spec) == frame_key(spec)]
        same.sort(key=lambda w: (w.implicit, w.spec != spec))
        return same[0] if same else None

    def current_frame(self, group_name: str) -> Workspace | None:
        """The workspace whose buffers the group's next forward step uses (no collective).

        Every rank of a group holds the same one, because it changes only collectively: an acquire on the group
        makes its workspace current, and a step whose every rank's configuration fits another one switches to it
        (ops/forward.py). When the current one has been closed, the most recently acquired open one on the group
        takes its place (None when there is none): the same choice on every rank, provided ranks close their
        workspaces alike."""
        with self._lock:
            ws = self._current.get(group_name)
            if ws is None or ws.closed:
                cands = [w for (name, _), w in self._by_name.items() if name == group_name]
                ws = cands[-1] if cands else None
                self._current[group_name] = ws
            return ws

    def set_current_frame(self, group_name: str, ws: Workspace) -> None:
        with self._lock:
            self._current[group_name] = ws

    # --- creation (collective) -------------------------------------------------------------------------------
    def acquire(self, spec: WorkspaceSpec, group=None) -> WorkspaceLease:
        """A lease on the workspace for ``spec`` on ``group``; collective over the group when ep_size > 1.

        Every rank of ``group`` must call this with its own spec, in the same order relative to other
        collectives. Differing manifests raise ValueError on every rank; an allocation failure on any rank rolls
        back and raises on every rank.
        """
        if not isinstance(spec, WorkspaceSpec):
            raise TypeError(f"spec must be a WorkspaceSpec, got {type(spec).__name__}")
        if spec.ep_size == 1:
            return self._acquire_local(spec, (), "")
        if group is None or not dist.is_initialized():
            raise ValueError(f"ep_size={spec.ep_size} needs an initialised process group; got group={group!r}")
        membership = group_membership(group)
        key = (membership, spec)
        manifest = {
            "protocol": PROTOCOL_VERSION,
            **dict(spec.fields()),
            "membership": membership,
            "holds workspace": key in self._by_key,
        }
        manifests: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(manifests, manifest, group=group)
        keys = list(manifest)
        diffs = _describe_differences(manifests, keys)
        if diffs:
            raise ValueError(
                "static_moe workspace manifests differ across the EP group (group ranks "
                f"{list(range(len(manifests)))}): " + " | ".join(diffs)
            )
        if len(membership) != spec.ep_size:
            raise ValueError(f"ep_size={spec.ep_size} but the process group has {len(membership)} ranks")
        if key in self._by_key:
            ws = self._by_key[key]
            self._index_name(ws, group.group_name)
            self.set_current_frame(group.group_name, ws)
            return WorkspaceLease(ws)

        buffers, symmetric, error = self._allocate(spec)
        # Every rank learns whether every rank allocated (and with which kind of memory) before anyone goes on.
        status: list = [None] * len(membership)
        dist.all_gather_object(
            status, (None if error is None else f"{type(error).__name__}: {error}", symmetric), group=group
        )
        failed = [r for r, (e, _) in enumerate(status) if e is not None]
        if failed:
            buffers.clear()  # roll back this rank's allocation too
            if error is not None:
                raise error
            raise RuntimeError(
                "static_moe workspace allocation failed on group rank(s) "
                f"{failed}: " + "; ".join(status[r][0] for r in failed) + "; nothing kept"
            )
        symmetric = all(s for _, s in status)
        if symmetric:
            from torch.distributed import _symmetric_memory as symm_mem

            for t in buffers.values():
                symm_mem.rendezvous(t, group.group_name)
        ws = self._register(key, spec, group.group_name, buffers, symmetric)
        self.set_current_frame(group.group_name, ws)  # collective, so the same on every rank
        return WorkspaceLease(ws)

    def _acquire_local(self, spec, membership, group_name) -> WorkspaceLease:
        key = (membership, spec)
        with self._lock:
            ws = self._by_key.get(key)
        if ws is None:
            buffers, symmetric, error = self._allocate(spec)
            if error is not None:
                raise error
            ws = self._register(key, spec, group_name, buffers, False)
        return WorkspaceLease(ws)

    def _allocate(self, spec: WorkspaceSpec):
        """(buffers, symmetric, error): all of the plan's buffers, or none of them and the error.

        With the default allocator on CUDA, symmetric memory is tried first; if torch cannot provide it on this
        rank, plain tensors are used instead (the status exchange then keeps every rank on plain tensors)."""
        device = torch.device(spec.device)
        if self._allocator is not None:
            buffers, error = self._allocate_with(self._allocator, spec, device)
            return buffers, False, error
        if device.type == "cuda" and _symmetric_memory_importable():
            buffers, error = self._allocate_with(_symmetric_allocator, spec, device)
            if error is None:
                return buffers, True, None
        buffers, error = self._allocate_with(plain_allocator, spec, device)
        return buffers, False, error

    @staticmethod
    def _allocate_with(allocator: Allocator, spec: WorkspaceSpec, device: torch.device):
        buffers: dict[str, torch.Tensor] = {}
        try:
            for b in memory_plan(spec).buffers:
                t = allocator(b.name, b.shape, b.dtype, device)
                buffers[b.name] = t
                if tuple(t.shape) != b.shape or t.dtype != b.dtype or t.device != device:
                    raise RuntimeError(
                        f"allocator returned {t.dtype}{list(t.shape)} on {t.device} for buffer "
                        f"{b.name!r}, expected {b.dtype}{list(b.shape)} on {device}"
                    )
        except Exception as e:  # noqa: BLE001  (any allocation failure rolls back; the caller re-raises)
            buffers.clear()
            # The error's traceback keeps this frame, and with it ``t``, alive for as long as the caller holds
            # the error (it raises it, converge() reports it): drop the last buffer here, or it outlives the
            # rollback.
            t = None  # noqa: F841
            return buffers, e
        return buffers, None

    def _register(self, key, spec, group_name, buffers, symmetric) -> Workspace:
        ws = Workspace(self, key, spec, set(), buffers, symmetric)
        with self._lock:
            self._by_key[key] = ws
        self._index_name(ws, group_name)
        return ws

    def _index_name(self, ws: Workspace, group_name: str) -> None:
        with self._lock:
            ws.group_names.add(group_name)
            self._by_name[(group_name, ws.spec)] = ws

    def _release(self, ws: Workspace) -> None:
        """One lease gone; the last one frees the buffers and forgets the workspace."""
        with self._lock:
            ws._leases -= 1
            if ws._leases > 0:
                return
            ws._closed = True
            ws._buffers.clear()
            if self._by_key.get(ws.key) is ws:
                del self._by_key[ws.key]
            for name in ws.group_names:
                if self._by_name.get((name, ws.spec)) is ws:
                    del self._by_name[(name, ws.spec)]


def frame_key(spec: WorkspaceSpec) -> tuple:
    """What fixes the shapes of a workspace's buffers: two specs with equal keys can use each other's."""
    return (
        spec.capacity,
        spec.row_width,
        spec.hidden,
        spec.ep_size,
        spec.device,
        spec.dispatch,
        spec.combine,
        spec.dispatch_capacity,
    )


def _symmetric_memory_importable() -> bool:
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


_DEFAULT = WorkspaceManager()


def default_manager() -> WorkspaceManager:
    """The manager the forward op looks workspaces up in."""
    return _DEFAULT


def acquire(spec: WorkspaceSpec, group=None) -> WorkspaceLease:
    """:meth:`WorkspaceManager.acquire` on the default manager (collective when ``spec.ep_size > 1``)."""
    return _DEFAULT.acquire(spec, group)


def find(group_name: str, spec: WorkspaceSpec) -> Workspace | None:
    """:meth:`WorkspaceManager.find` on the default manager."""
    return _DEFAULT.find(group_name, spec)


def find_frame(group_name: str, spec: WorkspaceSpec) -> Workspace | None:
    """:meth:`WorkspaceManager.find_frame` on the default manager."""
    return _DEFAULT.find_frame(group_name, spec)


def current_frame(group_name: str) -> Workspace | None:
    """:meth:`WorkspaceManager.current_frame` on the default manager."""
    return _DEFAULT.current_frame(group_name)


def set_current_frame(group_name: str, ws: Workspace) -> None:
    """:meth:`WorkspaceManager.set_current_frame` on the default manager."""
    _DEFAULT.set_current_frame(group_name, ws)


_IMPLICIT: list[WorkspaceLease] = []


def acquire_implicit(spec: WorkspaceSpec, group) -> Workspace:
    """The forward op's own workspace for ``spec`` on ``group`` (collective): kept until :func:`release_implicit`."""
    lease = _DEFAULT.acquire(spec, group)
    lease.workspace.implicit = True
    _IMPLICIT.append(lease)
    return lease.workspace


def release_implicit() -> None:
    """Close every lease the forward op took itself. Local, like closing any lease: call it on every rank of the
    groups alike (a rank that keeps a workspace its peers dropped would send through it while they acquire
    anew); the next raw step on a group without workspaces acquires one again."""
    while _IMPLICIT:
        _IMPLICIT.pop().close()
