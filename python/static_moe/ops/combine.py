"""combine: how the experts' fp32 sums of every rank reach the rank that owns the token (SPEC §0 step 3, SPEC §7).

Composable pieces the single ``forward`` op runs in its body (see ops/dispatch.py for why not ops of their own):

    fp32        reduce_scatter_sum(acc [S·C, H] fp32) ─▶ [C, H] fp32     (the sum order is the backend's)
    bf16        partial = bf16(acc), rounded once on the rank that computed it
                all_to_all_single(returned, partial), equal splits: block d of returned = rank d's partials of
                this rank's rows (all-gather dispatch: its C rows; all-to-all dispatch: the Cd slots it sent d)
                out[t] = Σ_{d = 0 … S−1} float(partial_d[t])        in fp32, in source-rank order
                        (a rank that served none of t's experts contributes +0, which changes no bit)

The bf16 combine is deterministic and bitwise defined, unlike a bf16 reduce-scatter whose summation order and
intermediate roundings belong to the collective library. It is the same function of the inputs with either
dispatch, so the all-to-all's output equals the all-gather + bf16 output bit for bit (SPEC §7).
"""

from __future__ import annotations

import torch

from .dispatch import all_to_all, log_collective

_c10d = torch.ops._c10d_functional


def reduce_scatter_fp32(acc: torch.Tensor, scattered: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """fp32 [C, H] ``scattered`` (in place): the sum over ranks of their ``acc`` [S·C, H] rows of this rank."""
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor_out(acc, "sum", size, group_name, out=scattered))
    log_collective("reduce_scatter", (size - 1) * scattered.numel() * scattered.element_size())
    return out


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """fp32 [C, H]: Σ_d float(partials[d]) over bf16 [S, C, H], in increasing d (the bf16 combine's order)."""
    out = partials[0].float()
    for d in range(1, partials.shape[0]):
        out = out + partials[d].float()
    return out


def exchange_partials(acc: torch.Tensor, partial: torch.Tensor, returned: torch.Tensor, pg) -> torch.Tensor:
    """bf16 [S·n, H] ``returned`` (in place): round ``acc`` [S·n, H] fp32 once into ``partial``, then swap blocks
    of n rows with every rank (block d goes to rank d)."""
    partial.copy_(acc)
    return all_to_all(returned, partial, pg, "combine_all_to_all")


def combine_bf16_gathered(acc: torch.Tensor, partial, returned, pg, size: int) -> torch.Tensor:
    """fp32 [C, H]: the bf16 combine after the all-gather dispatch (acc [S·C, H]: every rank's rows)."""
    got = exchange_partials(acc, partial, returned, pg)
    return sum_partials(got.view(size, -1, acc.shape[1]))


def combine_bf16_slotted(acc: torch.Tensor, partial, returned, pg, dest: torch.Tensor) -> torch.Tensor:
    """fp32 [C, H]: the bf16 combine after the all-to-all dispatch. acc [S·Cd, H] holds this rank's sums of the
    rows it received; ``dest`` int64 [C, S] (ops/dispatch.Slots) says where each of this rank's rows went (S·Cd:
    nowhere, contributing +0)."""
    got = exchange_partials(acc, partial, returned, pg)
    ext = torch.cat([got, torch.zeros(1, got.shape[1], dtype=got.dtype, device=got.device)])
    return sum_partials(ext[dest.t()])  # [S, C, H]
