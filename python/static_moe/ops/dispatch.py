"""dispatch: how the forward's packed rows reach the ranks whose experts serve them (SPEC §0 step 1, SPEC §7).

Composable pieces the single ``forward`` op runs in its body (so torch.compile / torch.export still see one node,
as vLLM's prepare/finalize split does inside its modular kernel, ``vllm/model_executor/layers/fused_moe/
modular_kernel.py``). Every shape follows from (C, Cd, S, formats), never from the routing:

    all_gather   send [C, W] ─ all_gather ─▶ gathered [S·C, W]                      (every row to every rank)
    all_to_all   mask  [C, S]   token t needs rank d (any of its ids is one of d's L experts)
                 slot  [C, S] = exclusive cumsum of mask over tokens                     (on the device)
                 blocks[S, Cd, W + 16]: row t in block d, slot slot[t, d], when slot < Cd; its source row id
                                 (int32, −1 for an empty slot) in the 16-byte column before the header;
                                 the step header in row 0 of every block, with this rank's overflow count
                 all_to_all_single(received, blocks), equal splits ─▶ received [S·Cd, W + 16]

A token goes once to each distinct rank that owns one of its experts. Rows past a block's Cd are not sent; the
count of such rows rides in the header's word 2 (``step_status``), so after the exchange every rank reads the same
S counts and reaches the same verdict with no extra collective (the forward then recomputes the step with the
all-gather, or under CUDA graph capture flags it and returns NaN: SPEC §7).

Collectives are counted (name, bytes sent to the other ranks) while :func:`count_collectives` is active, so
tests check the traffic formula of ``static_moe.expert_parallel`` against the payloads actually sent.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..expert_parallel import ROW_ID_NBYTES
from ..packed_layout import PAD_BYTE
from ..workspace import STEP_HEADER_NBYTES

_c10d = torch.ops._c10d_functional
_LOG: list | None = None


@contextlib.contextmanager
def count_collectives():
    """Collect ``(name, bytes this rank sent to the other ranks)`` for every collective the forward issues inside
    the block (a list, filled in place). For tests and benchmarks; not under torch.compile tracing."""
    global _LOG
    saved, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = saved


def log_collective(name: str, nbytes: int) -> None:
    if _LOG is not None:
        _LOG.append((name, int(nbytes)))


def all_gather(send: torch.Tensor, gathered: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """uint8 [S·C, W] ``gathered`` (written in place) = every rank's ``send`` [C, W] in rank order."""
    out = _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(send, size, group_name, out=gathered))
    log_collective("all_gather", (size - 1) * send.numel() * send.element_size())
    return out


def all_to_all(out: torch.Tensor, inp: torch.Tensor, pg, name: str) -> torch.Tensor:
    """``out`` [S·n, ...] (in place): block r of every rank's ``inp`` [S·n, ...] (equal splits), in rank order."""
    import torch.distributed as dist

    size = dist.get_world_size(pg)
    dist.all_to_all_single(out, inp, group=pg)
    log_collective(name, (size - 1) * (inp.numel() // size) * inp.element_size())
    return out


class Slots(NamedTuple):
    """Where this rank's C rows go with the all-to-all dispatch (all on the rows' device)."""

    source: torch.Tensor  # int64 [S·Cd]: the source row of each block slot, −1 where none
    dest: torch.Tensor  # int64 [C, S]: row t's slot index into [S·Cd], or S·Cd when it does not go to rank d
    overflow: torch.Tensor  # int32 [1]: rows that needed a slot past Cd


def slot_rows(topk_idx: torch.Tensor, capacity: int, num_experts: int, ep_size: int, dispatch_capacity: int) -> Slots:
    """Slot the T ≤ C rows of ``topk_idx [T, k]`` (global ids, −1 empty) into S blocks of Cd rows (module doc).

    Ids outside [0, E) select no rank here (the step header reports them and the step fails on every rank)."""
    s, cd, c = ep_size, dispatch_capacity, capacity
    num_local = num_experts // s
    dev = topk_idx.device
    idx = topk_idx.to(torch.int64)
    owner = torch.where((idx >= 0) & (idx < num_experts), idx // num_local, s)
    hit = torch.zeros(c, s + 1, dtype=torch.int64, device=dev)
    hit[: idx.shape[0]].scatter_(1, owner, 1)
    mask = hit[:, :s]  # [C, S] 0/1
    slot = torch.cumsum(mask, dim=0) - mask  # exclusive: rows before t that go to the same rank
    valid = (mask > 0) & (slot < cd)
    overflow = ((mask > 0) & ~valid).sum().to(torch.int32).reshape(1)
    trash = s * cd
    dest = torch.where(valid, torch.arange(s, device=dev) * cd + slot, trash)
    source = torch.full((trash + 1,), -1, dtype=torch.int64, device=dev)
    rows = torch.arange(c, device=dev).repeat_interleave(s)
    source.scatter_(0, dest.reshape(-1), rows)  # duplicates only land on the trash slot, dropped below
    return Slots(source[:trash], dest, overflow)


def fill_blocks(
    blocks: torch.Tensor,
    send: torch.Tensor,
    parts_width: int,
    dispatch_capacity: int,
    slots: Slots | None,
    header: torch.Tensor,
) -> None:
    """Fill the uint8 [S·Cd, W + 16] ``blocks`` from the forward's ``send`` [C, W] frame (parts, header columns).

    With ``slots`` (an OK call): each slot gets its source row's parts, or 0xFF; without (a failed call): every
    block gets the first Cd·W_parts bytes of send's data area (the error message written there). The source row id
    column holds the row (int32, −1 = 0xFF for an empty slot); ``header`` (int32 [16]) goes to row 0 of every
    block's header columns, the rows below it 0xFF."""
    pw, cd = parts_width, dispatch_capacity
    c = send.shape[0]
    blocks.fill_(PAD_BYTE)
    if slots is not None:
        ext = torch.cat([send[:, :pw], torch.full((1, pw), PAD_BYTE, dtype=torch.uint8, device=send.device)])
        src = torch.where(slots.source >= 0, slots.source, c)
        blocks[:, :pw] = ext[src]
        blocks[:, pw : pw + 4] = slots.source.to(torch.int32).view(torch.uint8).reshape(-1, 4)
    else:
        area = send[:, :pw].reshape(-1)[: cd * pw].reshape(cd, pw)
        blocks.view(-1, cd, blocks.shape[1])[:, :, :pw] = area
    hdr = pw + ROW_ID_NBYTES
    blocks[::cd, hdr : hdr + STEP_HEADER_NBYTES] = header.view(torch.uint8)


def block_headers(received: torch.Tensor, parts_width: int, dispatch_capacity: int) -> torch.Tensor:
    """int32 [S, 16] on received's device: row 0 of each sender's block, header columns."""
    hdr = parts_width + ROW_ID_NBYTES
    return received[::dispatch_capacity, hdr : hdr + STEP_HEADER_NBYTES].contiguous().view(torch.int32)
