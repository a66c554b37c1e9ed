"""Edge cases shared by every backend's tests: one generator per op, the same inputs for the CPU kernels (at each
ISA level), the CUDA host emulation, the NKI interpreter and the reference.

Random inputs put their interesting values in the middle of the data at ordinary magnitudes, so a kernel that
skips the first element of a block, reads the wrong expert's weights or mishandles the smallest UE8M0 exponent
can pass them. Each case here puts a value that decides the result on purpose where such a bug would drop it:

- at the first and last element of K, of a scale block / activation group, of the rows, of the experts;
- at the format's extreme scales: UE8M0 bytes 0, 1, 253 and 254 (2^-127 … 2^127), fp32 subnormal inputs to the
  quantisers, groups whose amax is below the floor;
- rows routed to several experts whose fp32 sum gives a different result in every order but increasing local id
  (SPEC §1.7), with the routing slots in another order and empty experts at the first and last local index;
- experts no row selects, whose weights are 0xFF bytes (NaN): a kernel that reads them shows it.

Every case is a :class:`Case` whose ``args`` are the op's positional arguments in schema order (the reference's
signature), all CPU tensors; ``exact`` (when not None) is the output the SPEC gives bit for bit, which the
reference itself is checked against. ``tags`` holds "model" for cases at a real model's dims (the CPU kernels
and the reference run them; the emulators, one thread or one instruction at a time, take the small ones).
Deterministic: no global RNG is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats import pack_fp4, quantize_activation, quantize_weight
from .generators import MODEL_SHAPES, gen, make_activations, random_weight

SMALL = "small"
MODEL = "model"


@dataclass(frozen=True)
class Case:
    """One input of one op: ``args`` in schema order; ``exact`` the SPEC's bits where known; ``tags``."""

    id: str
    args: tuple
    exact: torch.Tensor | None = None
    tags: frozenset = field(default_factory=lambda: frozenset({SMALL}))


def _model(c: Case) -> Case:
    return Case(c.id, c.args, c.exact, frozenset({MODEL}))


def select(cases: list[Case], tag: str) -> list[Case]:
    """The cases carrying ``tag`` (SMALL or MODEL)."""
    return [c for c in cases if tag in c.tags]


def _poison_experts(b: torch.Tensor, b_s: torch.Tensor | None, keep: list[int]):
    """Copies of weights [L, N, K'] and scales where every expert but ``keep`` holds 0xFF bytes (NaN in bf16 and
    e4m3fn; NaN fp32 scales; fp4 scales stay finite — byte 255 is refused by the checks — at byte 254)."""
    b = b.clone()
    other = torch.tensor([e not in keep for e in range(b.shape[0])])
    b.view(torch.uint8)[other] = 0xFF
    if b_s is not None:
        b_s = b_s.clone()
        if b_s.dtype == torch.float32:
            b_s[other] = float("nan")
        else:
            b_s.view(torch.uint8)[other] = 254
    return b, b_s


def _act(x: torch.Tensor, act: str, group: int):
    if act == "bf16":
        return x.to(torch.bfloat16), None
    return quantize_activation(x, group)


# ---------------------------------------------------------------------------------------------------------------
# expert_gemm(a, a_scale, b, b_scale, row_mask, expert)
# ---------------------------------------------------------------------------------------------------------------
def expert_gemm_cases(act: str, wf: str, group: int = 128, seed: int = 0) -> list[Case]:
    """Cases for one (activation, weight format, activation group): K = 256 (two 128-blocks, eight 32-blocks) and
    N = 128 (the NKI kernel's tile) unless a model shape says otherwise, three experts."""
    g = gen(seed)
    n, k, num = 128, 256, 3
    cases = []

    # The deciding value at the first and at the last k: a row of A is small noise plus one large value there,
    # and B's rows are large at both ends. Dropping k = 0 or k = K−1 (or a block's first / last element) moves
    # the result far beyond the SPEC §2 bound.
    for where, kk in (("first", 0), ("last", k - 1), ("block_edges", None)):
        x = torch.randn(6, k, generator=g) * 2.0**-8
        if kk is None:  # the first and last element of every 32-block
            x[:, 0::32] = 1.0
            x[:, 31::32] = -1.0
        else:
            x[:, kk] = 1.0
        a, a_s = _act(x, act, group)
        w = torch.randn(num, n, k, generator=g) * 2.0**-6
        w[:, :, 0] = 1.0
        w[:, :, -1] = 0.75
        w[:, :, 31::32] = -0.5
        w[:, :, 32::32] = 0.5
        b, b_s = quantize_weight(w, wf)
        cases.append(Case(f"k_{where}", (a, a_s, b, b_s, torch.ones(6, dtype=torch.bool), 1)))

    # Only the first and the last row set (the others 0xFF padding), on the first and on the last expert (the
    # others poisoned): the row and expert loops must reach both ends and nothing else.
    a, a_s = make_activations(9, k, act, group, seed=seed + 1)
    a = a.clone()
    mask = torch.zeros(9, dtype=torch.bool)
    mask[[0, 8]] = True
    a.view(torch.uint8)[~mask] = 0xFF
    if a_s is not None:
        a_s = a_s.clone()
        a_s[~mask] = float("nan")
    b, b_s = random_weight(num, n, k, wf, g)
    for e in (0, num - 1):
        pb, pbs = _poison_experts(b, b_s, [e])
        cases.append(Case(f"rows_first_last_expert{e}", (a, a_s, pb, pbs, mask, e)))

    if wf == "fp4":
        cases += _fp4_extreme_scale_cases(act, group, g)
    if wf == "fp8" or act == "fp8":
        cases += _extreme_float_scale_cases(act, wf, group, g)

    # A real model's down projection (N = H, K = I), a few decode rows.
    shape = MODEL_SHAPES["qwen3_30b_a3b"]
    a, a_s = make_activations(5, shape.intermediate, act, group, seed=seed + 2)
    b, b_s = random_weight(1, shape.hidden, shape.intermediate, wf, g, fp8_scales="mixed" if wf == "fp8" else "pow2")
    cases.append(_model(Case(f"model_{shape.name}_down", (a, a_s, b, b_s, torch.ones(5, dtype=torch.bool), 0))))
    return cases


# (UE8M0 byte at the first and last 32-block of every row, byte of the other blocks, exponent of the activations)
# products stay moderate normal numbers: 2^100-sized activations against 2^-127 weights, 2^-118 against 2^127
# (fp8 activations carry it in their scale, which stays a normal fp32 number).
FP4_EXTREME_BYTES = ((0, 1, 100), (1, 0, 100), (254, 253, -118), (253, 254, -118))


def _fp4_extreme_scale_cases(act: str, group: int, g: torch.Generator) -> list[Case]:
    n, k = 128, 256
    out = []
    for edge, inner, exponent in FP4_EXTREME_BYTES:
        codes = torch.randint(0, 16, (2, n, k), generator=g, dtype=torch.uint8)
        if max(edge, inner) >= 253:
            codes = codes % 3 | (codes & 0x8)  # magnitudes 0, 0.5, 1: 6·2^127 would overflow fp32
        s = torch.full((2, n, k // 32), inner, dtype=torch.uint8)
        s[:, :, 0] = edge
        s[:, :, -1] = edge
        x = torch.randn(4, k, generator=g).clamp(-3, 3)
        x = torch.where(x.abs() < 2.0**-4, torch.full_like(x, 0.5), x)  # normal after any scaling
        if act == "bf16":
            a, a_s = (x * 2.0**exponent).to(torch.bfloat16), None
        else:
            a, a_s = quantize_activation(x, group)
            a_s = a_s * 2.0**exponent  # powers of two: exact
        # the expert read is the last one: its blocks hold the extreme bytes; expert 0 is ordinary
        out.append(
            Case(f"fp4_scale_bytes_{edge}_{inner}", (a, a_s, pack_fp4(codes), s, torch.ones(4, dtype=torch.bool), 1))
        )
    return out


def _extreme_float_scale_cases(act: str, wf: str, group: int, g: torch.Generator) -> list[Case]:
    """fp32 scales far from 1 in the first and last block / group. Both fp8: weight scales 2^-100 / 2^-60
    against activation scales 2^100 / 2^60 (products of ordinary size from extreme exponents); one fp8 operand:
    its first and last block scaled up (2^40 / 2^20), so those blocks decide the result."""
    n, k = 128, 256
    a, a_s = make_activations(4, k, act, group)
    b, b_s = random_weight(1, n, k, wf, g)
    both = act == "fp8" and wf == "fp8"
    if wf == "fp8":
        b_s = b_s.clone()
        b_s[..., 0] *= 2.0**-100 if both else 2.0**40
        b_s[..., -1] *= 2.0**-60 if both else 2.0**20
    if act == "fp8":
        a_s = a_s.clone()
        a_s[:, 0] *= 2.0**100 if both else 2.0**40
        a_s[:, -1] *= 2.0**60 if both else 2.0**20
    return [Case("float_scales_first_last_block", (a, a_s, b, b_s, torch.ones(4, dtype=torch.bool), 0))]


# ---------------------------------------------------------------------------------------------------------------
# swiglu_and_cast(gate_up, row_weight, swiglu_limit, out_format, group_size, fp8_max, pow2_scale)
# ---------------------------------------------------------------------------------------------------------------
def swiglu_cases(out_format: str, group: int, fp8_max: float = 448.0, pow2: bool = True, seed: int = 0) -> list[Case]:
    """fp32 gate_up [R, 2I] with I = 256: the group's amax at its first / last element, subnormal fp32 values,
    groups below the amax floor, ±0, the largest exponents that stay finite, the first and last row."""
    g = gen(seed)
    rows, inter = 6, 256
    cases = []

    def case(name, gu, w, limit=None):
        cases.append(Case(name, (gu, w, limit, out_format, group, fp8_max, pow2)))

    for where in ("first", "last"):  # the amax of each group at one end, ten times the rest
        gu = torch.randn(rows, 2 * inter, generator=g) * 0.3
        col = torch.arange(0, inter, group) + (0 if where == "first" else group - 1)
        gu[:, col] = 6.0
        gu[:, inter + col] = -7.0
        case(f"amax_at_group_{where}", gu, torch.rand(rows, generator=g) + 0.5)

    # fp32 subnormals (and values at the amax floor 1e-4) reaching the quantiser: v = g·sigmoid(g)·u·w with
    # g ≈ 2, u tiny; one group of tiny values around a normal one, one all-subnormal group, ±0
    gu = torch.full((rows, 2 * inter), 2.0)
    gu[:, inter:] = torch.randn(rows, inter, generator=g) * 2.0**-140
    gu[:, inter : inter + 4] = torch.tensor([1e-4, -1e-4, 2.0**-126, -(2.0**-149)])
    gu[:, inter + group : inter + 2 * group] = torch.randn(rows, group, generator=g)  # a group of ordinary values
    gu[1, inter:] = 0.0
    gu[2, inter:] = -0.0
    case("subnormal_values", gu, torch.ones(rows))
    # the largest values that stay finite: |v| ≈ 2^120 (scale 2^112 at fp8_max 448), and the same in row weights
    gu = torch.randn(rows, 2 * inter, generator=g)
    gu[:, inter:] *= 2.0**100
    gu[0, inter] = 2.0**118
    gu[rows - 1, 2 * inter - 1] = -(2.0**118)
    w = torch.rand(rows, generator=g) + 0.5
    w[3] = 2.0**-100  # tiny routing weight: values near the floor
    case("extreme_exponents", gu, w)
    # only the first and the last row carry values, the rest weight 0 (padding rows of a gathered batch)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    w = torch.zeros(rows)
    w[0], w[-1] = 0.75, 1.5
    case("rows_first_last", gu, w, 5.0)
    return cases


# ---------------------------------------------------------------------------------------------------------------
# pack_rows(parts, capacity)
# ---------------------------------------------------------------------------------------------------------------
def pack_rows_cases(seed: int = 0) -> list[Case]:
    """Parts whose first and last byte of every row differ from the rest (0x00 / 0xFE next to random bytes), of
    widths just below, at and above the 16-byte alignment, at T = 0, 1, C−1 and C."""
    g = gen(seed)

    def part(rows, nbytes, dtype):
        raw = torch.randint(1, 0xFE, (rows, nbytes), generator=g, dtype=torch.uint8)
        raw[:, 0] = 0x00
        raw[:, -1] = 0xFE
        return raw.view(dtype)

    cases = []
    for t, cap in ((0, 3), (1, 1), (4, 5), (5, 5)):
        parts = [
            part(t, 15, torch.uint8),
            part(t, 16, torch.int32),
            part(t, 17, torch.uint8),
            part(t, 2, torch.bfloat16),
        ]
        cases.append(Case(f"t{t}_c{cap}", (parts, cap)))
    # a real model's row: fp8 x [H], fp32 scales [H/128], int32 ids [k], fp32 weights [k]
    shape = MODEL_SHAPES["v3"]
    parts = [
        part(3, shape.hidden, torch.float8_e4m3fn),
        part(3, 4 * shape.hidden // 128, torch.float32),
        part(3, 4 * shape.topk, torch.int32),
        part(3, 4 * shape.topk, torch.float32),
    ]
    cases.append(_model(Case(f"model_{shape.name}", (parts, 4))))
    return cases


# ---------------------------------------------------------------------------------------------------------------
# local_experts(x, x_scale, topk_idx, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, swiglu_limit,
#               fp8_max)
# ---------------------------------------------------------------------------------------------------------------
ORDER_VALUES = (2.0**25, 1.5, -(2.0**25))  # the outputs of the three middle local experts, in id order


def local_experts_cases(act: str, wf: str, group: int = 128, seed: int = 0) -> list[Case]:
    """Cases with H = I = 128 and five local experts (global ids 4 … 8)."""
    g = gen(seed)
    cases = [_summation_order_case(act, wf, group)]

    # Rows routed to the first and the last local expert only; the middle ones have no rows and poisoned weights.
    hidden = inter = 128
    num_local, offset = 5, 4
    x, x_s = make_activations(6, hidden, act, group, seed=seed + 3)
    w13, w13_s = random_weight(num_local, 2 * inter, hidden, wf, g)
    w2, w2_s = random_weight(num_local, hidden, inter, wf, g)
    w13, w13_s = _poison_experts(w13, w13_s, [0, num_local - 1])
    w2, w2_s = _poison_experts(w2, w2_s, [0, num_local - 1])
    first, last = offset, offset + num_local - 1
    idx = torch.tensor([[last, first], [first, -1], [-1, last], [last, 2], [first, last], [20, last]])
    wts = torch.softmax(torch.randn(6, 2, generator=g), dim=-1)
    cases.append(
        Case(
            "first_last_expert_only",
            (x, x_s, idx.to(torch.int32), wts, w13, w13_s, w2, w2_s, offset, 6.0, 448.0),
        )
    )
    return cases


def _summation_order_case(act: str, wf: str, group: int, rows: int = 3, hidden: int = 128, inter: int = 128) -> Case:
    """Five local experts; every row is routed (weight 1) to the middle three, whose outputs are exactly 2^25, 1.5
    and −2^25 in every column, in slots of another order; local experts 0 and 4 have no rows (weights poisoned).
    In fp32 the increasing order gives ``(2^25 + 1.5) − 2^25 = 0``; adding expert 1 last gives 1.5 and expert 0
    last gives 2, so the result tells the increasing order apart from every other. Exact in every format: x is
    1 at column 0; gate 32 (sigmoid(32) = 1 in fp32) and up 1/32 make z = 1; each w2 row holds one value."""
    x = torch.zeros(rows, hidden)
    x[:, 0] = 1.0
    w13 = torch.zeros(5, 2 * inter, hidden)
    w13[:, 0, 0] = 32.0
    w13[:, inter, 0] = 1.0 / 32
    w2 = torch.zeros(5, hidden, inter)
    for e, v in enumerate(ORDER_VALUES, start=1):
        w2[e, :, 0] = v
    x_q, x_s = _act(x, act, group)
    (a, a_s), (b, b_s) = quantize_weight(w13, wf), quantize_weight(w2, wf)
    a, a_s = _poison_experts(a, a_s, [1, 2, 3])
    b, b_s = _poison_experts(b, b_s, [1, 2, 3])
    offset = 10
    idx = torch.tensor([[12, 13, 11], [13, 11, 12], [11, 13, 12]], dtype=torch.int32)[:rows]
    args = (x_q, x_s, idx, torch.ones(rows, 3), a, a_s, b, b_s, offset, None, 448.0)
    return Case("summed_in_increasing_local_id", args, exact=torch.zeros(rows, hidden))


# ---------------------------------------------------------------------------------------------------------------
# The quantisers' inputs (formats.quantize_activation / quantize_weight)
# ---------------------------------------------------------------------------------------------------------------
def quantiser_inputs(k: int = 256, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """float32 [R, K] inputs: the amax at the first / last element of each 32-block, fp32 subnormals, the
    largest finite exponents, ±0, rounding midpoints of e4m3fn and e2m1 at every scale."""
    g = gen(seed)
    out = []
    for where, col in (("first", 0), ("last", 31)):
        x = torch.randn(4, k, generator=g)
        x[:, col::32] = 9.0 * torch.sign(torch.randn(4, k // 32, generator=g))
        out.append((f"amax_at_block_{where}", x))
    sub = torch.randn(4, k, generator=g) * 2.0**-135
    sub[:, 0] = 2.0**-149
    sub[:, -1] = -(2.0**-126)
    out.append(("subnormal", sub))
    # the largest amax whose fp4 grid stays finite: 2^126 (rounding 1.5·2^126 up to code 4 at scale 2^125 would
    # give 2^128, past float32)
    big = torch.randn(4, k, generator=g) * 2.0**120
    big[:, 0] = 2.0**126
    big[:, -1] = -(2.0**126)
    out.append(("largest_exponents", big))
    z = torch.zeros(4, k)
    z[1] = -0.0
    z[2, -1] = 1e-30
    z[3, 5] = 2.0**-149  # alone in its block: amax / 6 underflows float32, the scale byte is still 0 (2^-127)
    out.append(("zeros", z))
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 0.0078125 * 1.5]).repeat(k // 8 + 1)[:k]
    mid = mid * torch.exp2(torch.randint(-20, 20, (4, 1), generator=g).float())
    # every block's amax is 6·2^k exactly: the fp4 scale 2^k sits on the ceil(log2) boundary, code 6.0 exact
    mid[:, ::32] = 6.0 * torch.exp2(torch.ceil(torch.log2(mid.abs().amax(dim=1, keepdim=True))))
    out.append(("midpoints", mid))
    return out
