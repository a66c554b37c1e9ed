"""Input generators shared by tests, benchmarks and the demo: real model shapes and builders for activations, routing
and expert weights in every format (SPEC §1), and the scaled-down routing (``sliced_routing``) that keeps a real
model's rows per expert with fewer experts. Deterministic from a seed; everything on the CPU unless ``device`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import quantize_activation, quantize_weight


@dataclass(frozen=True)
class ModelShape:
    """Per-layer MoE dims of a real model (decode)."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    topk: int


MODEL_SHAPES = {
    "v4_flash": ModelShape("DeepSeek-V4-Flash", 4096, 2048, 256, 6),
    "v3": ModelShape("DeepSeek-V3", 7168, 2048, 256, 8),
    "qwen3_30b_a3b": ModelShape("Qwen3-30B-A3B", 2048, 768, 128, 8),
}

# Activation × weight pairs the SPEC supports (§1.2), as (act_format, weight_format).
FORMAT_PAIRS = [("bf16", "bf16"), ("bf16", "fp8"), ("bf16", "fp4"), ("fp8", "fp8"), ("fp8", "fp4")]


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_weights(num_local: int, hidden: int, inter: int, fmt: str, seed: int = 0, device="cpu") -> dict:
    """Local expert weights ``w13 [L, 2I, H]``, ``w2 [L, H, I]`` in ``fmt`` (bf16 / fp8 / fp4) with their scales,
    drawn N(0, 1/fan_in) in fp32 and quantized with formats.quantize_weight."""
    g = gen(seed)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g) / inter**0.5
    w13_q, w13_s = quantize_weight(w13, fmt)
    w2_q, w2_s = quantize_weight(w2, fmt)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return {"w13": to(w13_q), "w13_scale": to(w13_s), "w2": to(w2_q), "w2_scale": to(w2_s)}


FP8_SCALE_KINDS = ("pow2", "float", "mixed")


def fp8_scales_of_kind(b_scale: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """fp8 weight scales float32 [..., N, K/128] (powers of two, as quantize_weight gives) recast as ``kind``:
    "pow2" unchanged; "float" each times a factor in (1.01, 1.99), never a power of two (DeepSeek-V3's float
    scale_inv); "mixed" row by row at random: half unchanged, a quarter float, a quarter powers of two but for
    one float block. The CPU avx512bf16 kernel takes a weight row with only powers of two (in range) by its pow2
    path, any other by its fold path; "mixed" puts both kinds of row side by side, so that however the kernel
    groups weight rows (blocks of 3 or 4, by row count) some groups hold one kind and others both."""
    if kind == "pow2":
        return b_scale
    factor = 1.01 + 0.98 * torch.rand(b_scale.shape, generator=g)
    if kind == "float":
        return b_scale * factor
    if kind != "mixed":
        raise ValueError(f"fp8_scales_of_kind: kind must be one of {FP8_SCALE_KINDS}, got {kind!r}")
    row_kind = torch.multinomial(torch.tensor([2.0, 1.0, 1.0]), b_scale.shape[-2], replacement=True, generator=g)
    # row_kind 0: pow2, 1: float, 2: pow2 but for one float block
    one_block = torch.zeros(b_scale.shape, dtype=torch.bool)
    one_block[..., b_scale.shape[-1] // 2] = True
    use = (row_kind == 1).unsqueeze(-1) | ((row_kind == 2).unsqueeze(-1) & one_block)
    return torch.where(use, b_scale * factor, b_scale)


def random_weight(
    num_experts: int, n: int, k: int, fmt: str, g: torch.Generator, fp8_scales: str = "pow2"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert weights [E, N, K] drawn N(0, 1/K) from ``g`` in ``fmt`` with their scales (formats.quantize_weight);
    fp8 scales then recast as ``fp8_scales`` (fp8_scales_of_kind, from the same generator)."""
    b, b_s = quantize_weight(torch.randn(num_experts, n, k, generator=g) / k**0.5, fmt)
    return (b, fp8_scales_of_kind(b_s, fp8_scales, g)) if fmt == "fp8" else (b, b_s)


def make_activations(
    rows: int, hidden: int, act_fmt: str, group: int = 128, seed: int = 0, device="cpu", scale: float = 1.0
):
    """``(x, x_scale)``: bf16 [R, H] with x_scale None, or fp8 e4m3fn [R, H] with float32 [R, H/group]."""
    x = torch.randn(rows, hidden, generator=gen(seed)) * scale
    if act_fmt == "bf16":
        return x.to(torch.bfloat16).to(device), None
    q, s = quantize_activation(x, group)
    return q.to(device), s.to(device)


def make_routing(
    rows: int,
    topk: int,
    num_experts: int,
    seed: int = 0,
    *,
    empty_frac: float = 0.0,
    skew: float = 0.0,
    duplicate_frac: float = 0.0,
    index_dtype=torch.int32,
    device="cpu",
):
    """``(topk_idx [R, k], topk_weights float32 [R, k])`` with distinct ids per row unless ``duplicate_frac``.

    skew ∈ [0, 1]: the probability that a slot is routed to expert 0 (hot expert); empty_frac: probability of a
    −1 slot; duplicate_frac: probability that slot j > 0 repeats slot 0's id."""
    g = gen(seed)
    idx = (
        torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(rows)])
        if rows
        else torch.zeros(0, topk, dtype=torch.long)
    )
    if skew > 0:
        idx = torch.where(torch.rand(idx.shape, generator=g) < skew, torch.zeros_like(idx), idx)
    if duplicate_frac > 0 and topk > 1:
        dup = torch.rand(idx.shape, generator=g) < duplicate_frac
        dup[:, 0] = False
        idx = torch.where(dup, idx[:, :1].expand_as(idx), idx)
    if empty_frac > 0:
        idx = torch.where(torch.rand(idx.shape, generator=g) < empty_frac, torch.full_like(idx, -1), idx)
    w = torch.softmax(torch.randn(rows, topk, generator=g), dim=-1)
    return idx.to(index_dtype).to(device), w.float().to(device)


@dataclass
class SlicedRouting:
    """Routing of each rank's tokens, relabelled so that only ``kept`` experts exist (ids 0 … kept−1).

    The routing is drawn over the model's real E experts (top-k, distinct ids per row); the experts the
    tokens touch are counted (``touched_real``), ``kept`` of them — picked at random among the touched ones,
    untouched ones only if fewer were touched — become global ids 0 … kept−1, and every other slot becomes −1
    (an expert on a rank that is not simulated). Each kept expert keeps exactly its real rows, so rows per
    expert and the compute intensity are those of the full model; only the number of experts shrinks (by
    ``touched_real / touched_kept``, printed as the scale by the benchmarks and the demo)."""

    topk_idx: list[torch.Tensor]  # per rank, int32 [T, k]
    topk_weights: list[torch.Tensor]  # per rank, float32 [T, k]
    kept: int
    touched_real: int
    num_experts_real: int


def sliced_routing(shape: ModelShape, tokens: list[int], kept: int, seed: int = 0) -> SlicedRouting:
    """``tokens[r]`` tokens on each rank r, routed over the real ``shape.num_experts``; keep ``kept`` experts."""
    e = shape.num_experts
    idxs, ws = [], []
    for r, t in enumerate(tokens):
        i, w = make_routing(t, shape.topk, e, seed=seed + 7919 * r)
        idxs.append(i.long())
        ws.append(w)
    all_idx = torch.cat(idxs).flatten() if idxs else torch.zeros(0, dtype=torch.long)
    touched = torch.unique(all_idx[all_idx >= 0])
    g = gen(seed + 1)
    untouched = torch.tensor(sorted(set(range(e)) - set(touched.tolist())), dtype=torch.long)
    order = torch.cat(
        [
            touched[torch.randperm(touched.numel(), generator=g)],
            untouched[torch.randperm(untouched.numel(), generator=g)],
        ]
    )
    relabel = torch.full((e,), -1, dtype=torch.long)
    relabel[order[:kept]] = torch.randperm(kept, generator=g)  # spread the touched experts over the ranks
    out = [torch.where(i >= 0, relabel[i.clamp_min(0)], i).to(torch.int32) for i in idxs]
    return SlicedRouting(out, ws, kept, int(touched.numel()), e)


def make_fp8_max_sensitive(rows: int, num_local: int, hidden: int, inter: int, seed: int = 0):
    """``(x float32 [R, H], w13 float32 [L, 2I, H], w2 float32 [L, H, I], topk_idx int32 [R, 1], topk_weights
    float32 [R, 1])``: a local_experts / forward input whose output depends on fp8_max (the range of the fp8
    re-quantization of the SwiGLU output, SPEC §1.5, §1.7: 240 on trn2, 448 OCP e4m3fn).

    With power-of-two scales, fp8_max only matters for a group of z whose largest value is re-quantized above 240
    at 448 (then 240 doubles the group's scale) and only through z's small values, which lose a bit when halved
    into e4m3fn subnormals. So: every row of x is 1 at column 0 (0 elsewhere) and is routed to local expert 0
    alone (weight in [0.5, 1)); expert 0's gate/up columns 0 give, for every 32 columns of z, one large value
    (silu(8)·w ≈ 4…8, above 240 after quantizing at 448) and 31 values of about 2^-10 … 2^-16 of it; w2 reads
    only the small ones, one per output column (exact products). Other experts are zero. Quantize x with
    ``quantize_activation(x, g)`` (g = 32 or 128, exact) and the weights with ``quantize_weight`` (exact in
    every format: each [N, K] row holds one power of two)."""
    g = gen(seed)
    x = torch.zeros(rows, hidden)
    x[:, 0] = 1.0
    w13 = torch.zeros(num_local, 2 * inter, hidden)
    w2 = torch.zeros(num_local, hidden, inter)
    j = torch.arange(inter)
    big = j % 32 == 0
    w13[0, :inter, 0] = torch.where(big, 8.0, 2.0 ** -(j % 3).float())  # gate: silu(8), silu(1 / 0.5 / 0.25)
    w13[0, inter:, 0] = torch.where(big, 1.0, 2.0 ** -(10 + j % 6).float())  # up
    small = j[~big]
    w2[0, torch.arange(hidden), small[torch.arange(hidden) % small.numel()]] = 1.0
    idx = torch.zeros(rows, 1, dtype=torch.int32)
    tw = 0.5 + 0.5 * torch.rand(rows, 1, generator=g)
    return x, w13, w2, idx, tw


def poisoned_swiglu_input(where: str, value: float, rows=5, inter=256, seed=0):
    """(poisoned gate_up float32 [R, 2I], row_weight [R], clean gate_up, clean row_weight): row 1 gets ``value`` at
    gate/up column 37 or as its routing weight; row 3 at column 200 (another group for g = 32 and 128)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inter, generator=g)
    w = torch.rand(rows, generator=g)
    bad_gu, bad_w = gate_up.clone(), w.clone()
    for r, c in ((1, 37), (3, 200)):
        if where == "weight":
            bad_w[r] = value
        else:
            bad_gu[r, c + (inter if where == "up" else 0)] = value
    return bad_gu, bad_w, gate_up, w


def as_padding(a: torch.Tensor, a_scale: torch.Tensor | None, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of activations A ``[R, K]`` and their scales ``[R, K/g]`` (or None) whose ``rows`` (a bool mask or
    an index over R) hold what a gathered buffer's padding rows hold (SPEC §1.8): 0xFF in every byte, which is NaN
    in bf16, e4m3fn and fp32. A kernel that reads such a row where it must not shows it in its output."""
    a = a.clone()
    a.view(torch.uint8)[rows] = 0xFF
    if a_scale is not None:
        a_scale = a_scale.clone()
        a_scale.view(torch.uint8)[rows] = 0xFF
    return a, a_scale
