"""What a routing asks of one rank's local experts: routed rows, touched experts, (row, expert) pairs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingStats:
    """What a routing asks of one rank's local experts [offset, offset + L)."""

    rows_active: int  # rows routed to at least one local expert
    experts_touched: int  # local experts at least one row selects
    pairs: int  # distinct (row, local expert) pairs = GEMM rows summed over experts


def routing_stats(topk_idx: torch.Tensor, expert_offset: int, num_local: int) -> RoutingStats:
    """Count rows, touched experts and (row, expert) pairs of ``topk_idx`` [R, k] for one rank."""
    local = topk_idx.long() - expert_offset
    ok = (local >= 0) & (local < num_local)
    onehot = torch.zeros(topk_idx.shape[0], num_local + 1, dtype=torch.bool)
    onehot.scatter_(1, torch.where(ok, local, torch.full_like(local, num_local)), True)
    hit = onehot[:, :num_local]
    return RoutingStats(int(hit.any(1).sum()), int(hit.any(0).sum()), int(hit.sum()))
