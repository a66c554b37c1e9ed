"""Choosing the expert-parallel dispatch and combine (docs/expert_parallel.md, SPEC §7): the traffic formula, the
dispatch capacity Cd, and the "auto" choice.

Everything here is arithmetic on the step's static sizes (and, for :func:`dispatch_capacity_from_trace`, on a
routing trace the user recorded); nothing touches a device or a process group. Bytes are those one rank *sends
to other ranks* per layer and step, counted from the collectives' payloads: an all-gather of a ``[C, W]`` buffer
sends ``(S − 1)·C·W``; a reduce-scatter of ``[S·C, H]`` fp32 sends ``(S − 1)·C·4H``; an all-to-all of ``[S·n, w]``
equal blocks sends ``(S − 1)·n·w`` (the block for itself stays local). The forward's collectives move exactly
these payloads (tests/layer/test_expert_parallel.py counts them).

=====================  =========================================================================
dispatch, combine      bytes sent per rank per layer
=====================  =========================================================================
all_gather, fp32       ``(S − 1)·C·(W + 4H)``                        (today's step, SPEC §0)
all_gather, bf16       ``(S − 1)·C·(W + 2H)``
all_to_all, bf16       ``(S − 1)·Cd·(W + 16 + 2H)``                  (16: the source row id column)
=====================  =========================================================================

W is the forward's send row (packed parts + the 64-byte step header, ``WorkspaceSpec.row_width``).
"""

from __future__ import annotations

import math

import torch

from .packed_layout import aligned

DISPATCHES = ("all_gather", "all_to_all")
COMBINES = ("fp32", "bf16")
# Bytes of the all-to-all row's source row id column (one int32, padded to the 16-byte part alignment).
ROW_ID_NBYTES = 16
_HEADER_NBYTES = 64  # workspace.STEP_HEADER_NBYTES (not imported: workspace imports this module)


def row_width(hidden: int, topk: int, act_format: str = "fp8", act_group: int = 128) -> int:
    """W: bytes of one row the all-gather sends — x, (x_scale,) ids int32, weights fp32, each 16-byte aligned,
    then the step header (the same figure as ``WorkspaceSpec.row_width``)."""
    parts = [hidden * (1 if act_format == "fp8" else 2)]
    if act_format == "fp8":
        parts.append(4 * (hidden // act_group))
    parts += [4 * topk, 4 * topk]
    return sum(aligned(n) for n in parts) + _HEADER_NBYTES


def traffic_bytes(
    dispatch: str,
    combine: str,
    *,
    capacity: int,
    hidden: int,
    topk: int,
    ep_size: int,
    act_format: str = "fp8",
    act_group: int = 128,
    dispatch_capacity: int = 0,
) -> int:
    """Bytes one rank sends to the others per layer and step (module table). ``dispatch_capacity`` (Cd) is used
    by "all_to_all" only."""
    s, c, h = ep_size, capacity, hidden
    w = row_width(hidden, topk, act_format, act_group)
    if dispatch == "all_gather":
        return (s - 1) * c * (w + (4 if combine == "fp32" else 2) * h)
    if dispatch == "all_to_all":
        if combine != "bf16":
            raise ValueError("dispatch='all_to_all' returns bf16 partials: it needs combine='bf16'")
        return (s - 1) * dispatch_capacity * (w + ROW_ID_NBYTES + 2 * h)
    raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")


def deepep_low_latency_bytes(
    *, capacity: int, hidden: int, topk: int, ep_size: int, act_format: str = "fp8", act_group: int = 128
) -> float:
    """Expected bytes a rank sends with per-expert messages (DeepEP's low-latency mode), uniform routing: each of
    the C·k (token, expert) pairs whose expert lives on another rank (a fraction (S − 1)/S) sends the token's
    activation and scales once and receives its bf16 expert output back (2H)."""
    x = hidden * (1 if act_format == "fp8" else 2) + (4 * (hidden // act_group) if act_format == "fp8" else 0)
    return capacity * topk * (ep_size - 1) / ep_size * (x + 2 * hidden)


# ----------------------------------------------------------------------------------------------------------------
# Cd: how many rows one sender may put in one receiver's block
# ----------------------------------------------------------------------------------------------------------------
def rank_hit_probability(num_experts: int, topk: int, ep_size: int) -> float:
    """P(a token routed to k distinct experts, uniformly at random, has one on a given rank):
    1 − C(E − L, k) / C(E, k), L = E / S."""
    e, k, loc = num_experts, topk, num_experts // ep_size
    return 1.0 - math.comb(e - loc, k) / math.comb(e, k)


def _binomial_tail(n: int, p: float, m: int) -> float:
    """P(X > m), X ~ Binomial(n, p), summed exactly in float64 from the top (no scipy)."""
    if m >= n:
        return 0.0
    return min(1.0, sum(math.comb(n, j) * p**j * (1.0 - p) ** (n - j) for j in range(m + 1, n + 1)))


def step_overflow_probability(
    capacity: int, dispatch_capacity: int, *, num_experts: int, topk: int, ep_size: int
) -> float:
    """P(a step overflows) when every rank sends C tokens routed uniformly at random: any of the S·S
    (sender, receiver) blocks gets more than Cd rows (blocks treated as independent; a union bound above)."""
    tail = _binomial_tail(capacity, rank_hit_probability(num_experts, topk, ep_size), dispatch_capacity)
    return 1.0 - (1.0 - tail) ** (ep_size * ep_size)


def dispatch_capacity_for(
    capacity: int, *, num_experts: int, topk: int, ep_size: int, overflow_rate: float = 0.01
) -> int:
    """The Cd rule of docs/expert_parallel.md: the smallest Cd ≤ C whose modelled step overflow probability
    (uniform routing, :func:`step_overflow_probability`) is at most ``overflow_rate``. For a real router use
    :func:`dispatch_capacity_from_trace`: routers are not uniform."""
    if not 0.0 < overflow_rate < 1.0:
        raise ValueError(f"overflow_rate must lie in (0, 1), got {overflow_rate!r}")
    for cd in range(1, capacity + 1):
        if step_overflow_probability(capacity, cd, num_experts=num_experts, topk=topk, ep_size=ep_size) <= (
            overflow_rate
        ):
            return cd
    return capacity


def rank_loads(topk_idx: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """int64 [..., S]: for each batch of ``topk_idx [..., T, k]`` (global ids, −1 empty), how many of its T
    tokens go to each rank (a token counts once per rank that owns any of its experts)."""
    loc = num_experts // ep_size
    idx = topk_idx.to(torch.int64)
    owner = torch.where(idx >= 0, idx // loc, ep_size)  # ep_size: an empty slot, dropped below
    hit = torch.zeros(*idx.shape[:-1], ep_size + 1, dtype=torch.bool)
    hit.scatter_(-1, owner, True)
    return hit[..., :ep_size].sum(dim=-2)


def dispatch_capacity_from_trace(
    routing_trace, *, num_experts: int, ep_size: int, capacity: int, quantile: float = 0.99
) -> int:
    """Cd from a recorded routing trace: the ``quantile`` of the busiest block per sender batch.

    Args:
        routing_trace: int [N, T, k] (or a list of [T, k] tensors, T ≤ capacity each): N batches of global expert
            ids as one rank's router gave them (−1 empty), on any device (read on the host).
        quantile: in (0, 1]. With q = 1 − r, a batch like the trace's overflows some block with probability
            about r per sender; a step overflows when any of its S senders does (about S·r at most), and an
            overflowing step is recomputed exactly (SPEC §7), so r trades traffic for recomputation.

    Returns the int Cd in [1, capacity].
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must lie in (0, 1], got {quantile!r}")
    if isinstance(routing_trace, (list, tuple)):
        if not routing_trace:
            raise ValueError("routing_trace is empty")
        loads = torch.stack([rank_loads(t.cpu(), num_experts, ep_size) for t in routing_trace])
    else:
        if routing_trace.dim() != 3 or routing_trace.shape[0] == 0:
            raise ValueError(f"routing_trace must be [N ≥ 1, T, k], got shape {list(routing_trace.shape)}")
        loads = rank_loads(routing_trace.cpu(), num_experts, ep_size)
    busiest = loads.max(dim=-1).values.double()
    cd = int(math.ceil(float(torch.quantile(busiest, quantile))))
    return max(1, min(capacity, cd))


def choose_dispatch(
    dispatch: str,
    combine: str,
    *,
    capacity: int,
    hidden: int,
    topk: int,
    num_experts: int,
    ep_size: int,
    act_format: str = "fp8",
    act_group: int = 128,
    dispatch_capacity: int = 0,
) -> tuple[str, int]:
    """(dispatch, Cd) for a layer: "auto" picks the all-to-all when its modelled traffic (with ``dispatch_capacity``,
    or the 1 % Cd rule when 0) is below the all-gather's with the same combine; the all-to-all needs the bf16
    combine, so "auto" with "fp32" is the all-gather. Cd is 0 for the all-gather."""
    if dispatch not in DISPATCHES + ("auto",):
        raise ValueError(f"dispatch must be 'auto', 'all_gather' or 'all_to_all', got {dispatch!r}")
    if combine not in COMBINES:
        raise ValueError(f"combine must be 'fp32' or 'bf16', got {combine!r}")
    if dispatch == "all_to_all" and combine != "bf16":
        raise ValueError("dispatch='all_to_all' returns bf16 partials: it needs combine='bf16'")
    if dispatch == "all_gather" or (dispatch == "auto" and (ep_size == 1 or combine != "bf16")):
        return "all_gather", 0
    if num_experts % ep_size or topk > num_experts:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size}) and ≥ topk ({topk})")
    cd = dispatch_capacity or dispatch_capacity_for(capacity, num_experts=num_experts, topk=topk, ep_size=ep_size)
    if dispatch == "auto":
        sizes = dict(capacity=capacity, hidden=hidden, topk=topk, ep_size=ep_size, act_format=act_format)
        a2a = traffic_bytes("all_to_all", "bf16", act_group=act_group, dispatch_capacity=cd, **sizes)
        ag = traffic_bytes("all_gather", "bf16", act_group=act_group, **sizes)
        dispatch = "all_to_all" if a2a < ag else "all_gather"
    return dispatch, (cd if dispatch == "all_to_all" else 0)
