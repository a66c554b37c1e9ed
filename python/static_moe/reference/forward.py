"""Reference forward (SPEC §0): the whole expert-parallel step, simulated in one process.

``forward_simulated`` runs S ranks' worth of inputs through the same maths as the distributed op — pack each
rank's tokens to C rows, concatenate the S packed buffers (the all-gather), run each rank's local experts over
all S·C gathered rows, sum the S fp32 accumulators (the reduce-scatter), keep each rank's first T rows, add the
shared expert output — and returns every rank's bf16 output. ``forward`` has the op's signature and covers S = 1.
"""

from __future__ import annotations

import torch

from ..activations import DEFAULT_ALPHA
from ..formats import FP8_E4M3FN_MAX, check_fp8_max, check_swiglu_limit
from .local_experts import local_experts
from .pack_rows import pack_layout, pack_rows, part_nbytes, unpack_rows


def _parts(x, x_scale, topk_idx, topk_weights):
    parts = [x] if x_scale is None else [x, x_scale.float()]
    return parts + [topk_idx.to(torch.int32), topk_weights.float()]


def forward_simulated(
    xs: list[torch.Tensor],
    x_scales: list[torch.Tensor | None],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    w13s: list[torch.Tensor],
    w13_scales: list[torch.Tensor | None],
    w2s: list[torch.Tensor],
    w2_scales: list[torch.Tensor | None],
    shared_outputs: list[torch.Tensor | None] | None,
    num_experts: int,
    capacity: int,
    swiglu_limit: float | None,
    fp8_max: float = FP8_E4M3FN_MAX,
    weight_layout: str = "eoi",
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
    w13_biases: list[torch.Tensor | None] | None = None,
    w2_biases: list[torch.Tensor | None] | None = None,
    combine: str = "fp32",
) -> list[torch.Tensor]:
    """Per-rank lists (index = EP rank) → per-rank bf16 outputs [T_r, H].

    Rank r holds x [T_r, H] (bf16 or fp8 + x_scale [T_r, H/g]), routing [T_r, k], and its local weights
    w13 [L, 2I, H], w2 [L, H, I] for global experts r·L … r·L+L−1 (L = num_experts / S); with
    ``weight_layout="eio"`` every rank's weights are in the prepared form of ``static_moe.layouts``.
    ``activation`` / ``alpha`` and each rank's ``w13_biases[r]`` [L, 2I] / ``w2_biases[r]`` [L, H]: SPEC §1.9.
    ``combine``: "fp32" sums the S fp32 partials (SPEC §0); "bf16" rounds each rank's partial once to bf16 and
    sums them in fp32 in rank order (SPEC §7). Either dispatch of SPEC §7 gives these outputs: the dispatch only
    decides which rows travel, not what any row computes.
    """
    if combine not in ("fp32", "bf16"):
        raise ValueError(f"forward: combine must be 'fp32' or 'bf16', got {combine!r}")
    check_swiglu_limit(swiglu_limit, "forward")
    if xs[0].dtype == torch.float8_e4m3fn:
        check_fp8_max(fp8_max, "forward")
    s = len(xs)
    num_local = num_experts // s
    for idx in topk_idxs:  # in the ids' own dtype, before _parts narrows them to int32 (2^32 + 1 must not become 1)
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise ValueError(
                f"forward: topk_idx must hold global expert ids in [-1, {num_experts}) (−1 = empty "
                f"slot), got values in [{int(idx.min())}, {int(idx.max())}]"
            )
    packed = [pack_rows(_parts(*a), capacity) for a in zip(xs, x_scales, topk_idxs, topk_weights)]
    gathered = torch.cat(packed, dim=0)  # [S·C, W]
    parts0 = _parts(xs[0], x_scales[0], topk_idxs[0], topk_weights[0])
    spans, _ = pack_layout([part_nbytes(p) for p in parts0])
    g_parts = [unpack_rows(gathered, off, n, p.dtype, list(p.shape[1:])) for (off, n), p in zip(spans, parts0)]
    g_x, g_xs = g_parts[0], (g_parts[1] if x_scales[0] is not None else None)
    g_idx, g_w = g_parts[-2], g_parts[-1]
    acc = None
    for r in range(s):
        a = local_experts(
            g_x,
            g_xs,
            g_idx,
            g_w,
            w13s[r],
            w13_scales[r],
            w2s[r],
            w2_scales[r],
            r * num_local,
            swiglu_limit,
            fp8_max,
            weight_layout,
            activation,
            alpha,
            None if w13_biases is None else w13_biases[r],
            None if w2_biases is None else w2_biases[r],
        )
        if combine == "bf16":
            a = a.to(torch.bfloat16).float()
        acc = a if acc is None else acc + a
    outs = []
    for r in range(s):
        t = xs[r].shape[0]
        o = acc[r * capacity : r * capacity + t]
        if shared_outputs is not None and shared_outputs[r] is not None:
            o = o + shared_outputs[r].float()
        outs.append(o.to(torch.bfloat16))
    return outs


def forward(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    shared_output: torch.Tensor | None,
    num_experts: int,
    capacity: int,
    swiglu_limit: float | None,
    group_name: str,
    ep_rank: int,
    ep_size: int,
    fp8_max: float = FP8_E4M3FN_MAX,
    weight_layout: str = "eoi",
    activation: str = "silu",
    alpha: float = DEFAULT_ALPHA,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    dispatch: str = "all_gather",
    combine: str = "fp32",
    dispatch_capacity: int = 0,
) -> torch.Tensor:
    """The op's signature at S = 1 (no collective): bf16 [T, H]. fp8_max: range of the fp8 re-quantization of the
    SwiGLU output with fp8 x (448 OCP e4m3fn; 240 on trn2), as in local_experts; weight_layout: "eoi" or the
    prepared "eio" (static_moe.layouts), as in local_experts; dispatch / combine / dispatch_capacity: SPEC §7 (at
    S = 1 only the combine matters: "bf16" rounds the one partial to bf16 before the shared output is added)."""
    if dispatch not in ("all_gather", "all_to_all"):
        raise ValueError(f"forward: dispatch must be 'all_gather' or 'all_to_all', got {dispatch!r}")
    if ep_size != 1:
        raise ValueError(f"reference forward runs S = 1 only (got ep_size={ep_size}); use forward_simulated")
    return forward_simulated(
        [x],
        [x_scale],
        [topk_idx],
        [topk_weights],
        [w13],
        [w13_scale],
        [w2],
        [w2_scale],
        [shared_output],
        num_experts,
        capacity,
        swiglu_limit,
        fp8_max,
        weight_layout,
        activation,
        alpha,
        [w13_bias],
        [w2_bias],
        combine,
    )[0]
