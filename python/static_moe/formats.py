"""Number formats of SPEC §1.1–1.2: quantize and dequantize activations and expert weights, in pure torch.

Everything here runs on whatever device its inputs live on and is exact where the SPEC says so: power-of-two
scales come from the float's bits, e4m3fn casts are torch's round-to-nearest-even, and e2m1 rounding is done
with explicit tie-to-even thresholds (checked bit for bit against ml_dtypes in tests/formats/test_formats.py).

Layouts (all "EOI": [experts, out, in] as nn.Linear stores weights):
    fp8 weight  float8_e4m3fn [..., N, K]      scales float32 [..., N, K/128]
    fp4 weight  uint8 [..., N, K/2]            scales uint8 (UE8M0) [..., N, K/32]
                (element k in byte k//2, low nibble for even k; torch.float4_e2m1fn_x2 / float8_e8m0fnu
                are accepted and viewed as uint8)
"""

from __future__ import annotations

import math
from typing import Literal

import torch

FP8_E4M3FN_MAX = 448.0
FP8_E4M3_TRN2_MAX = 240.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
WEIGHT_FP8_BLOCK = 128
WEIGHT_FP4_BLOCK = 32

# e2m1 magnitudes by code 0..7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

WeightFormat = Literal["bf16", "fp8", "fp4"]
ActFormat = Literal["bf16", "fp8"]


# ----------------------------------------------------------------------------------------------------------------
# Scalar settings: the same rules and messages as csrc/checks/common.h (check_swiglu_limit, check_fp8_max)
# ----------------------------------------------------------------------------------------------------------------
FLOAT32_MAX = 3.4028234663852886e38
# fp8_max range. Below 2 the power-of-two scale of a large finite amax overflows: amax < 2^128, and
# round_up_pow2(amax / fp8_max) ≤ 2^127 for every finite amax exactly when fp8_max ≥ FLOAT32_MAX / 2^127 = 2 − 2^-23.
FP8_MAX_MIN = 2.0


def _prefix(op: str | None) -> str:
    return f"{op}: " if op else ""


def _finite(v: int | float) -> bool:
    """math.isfinite without its OverflowError: an int past float's range (10**400) is not finite."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def check_swiglu_limit(limit, op: str | None = None, name: str = "swiglu_limit") -> float | None:
    """None, or a positive number that stays finite and positive once rounded to float32 (the kernels' type).

    Returns the limit as a Python float (or None). Raises ValueError otherwise — 1e39 (inf in float32), 1e-50
    (0 in float32), NaN, ≤ 0 and non-numbers alike."""
    if limit is None:
        return None
    ok = isinstance(limit, (int, float)) and not isinstance(limit, bool) and _finite(limit) and limit > 0
    if ok:
        f32 = torch.tensor(float(limit), dtype=torch.float64).to(torch.float32).item()  # round-to-nearest, inf past
        ok = math.isfinite(f32) and f32 > 0
    if not ok:
        raise ValueError(
            f"{_prefix(op)}{name} must be None or a positive finite number, got {limit!r} (it must stay "
            f"finite and positive in float32, the kernels' type: at most {FLOAT32_MAX:.8g})"
        )
    return float(limit)


def check_fp8_max(fp8_max, op: str | None = None) -> float:
    """A number in [2, 448]: the range of an fp8 re-quantization (448 OCP e4m3fn, 240 trn2). Raises ValueError."""
    ok = (
        isinstance(fp8_max, (int, float))
        and not isinstance(fp8_max, bool)
        and _finite(fp8_max)
        and FP8_MAX_MIN <= fp8_max <= FP8_E4M3FN_MAX
    )
    if not ok:
        raise ValueError(
            f"{_prefix(op)}fp8_max must be in [2, 448] (448 for OCP e4m3fn, 240 for trn2 float8_e4m3; "
            f"below 2 the power-of-two scale of a large amax overflows to inf), got {fp8_max!r}"
        )
    return float(fp8_max)


# ----------------------------------------------------------------------------------------------------------------
# Non-finite inputs
# ----------------------------------------------------------------------------------------------------------------
def _values_readable(t: torch.Tensor) -> bool:
    """Whether t's values can be read on the host here without a device sync or a trace-time guess."""
    if torch.compiler.is_compiling() or t.device.type != "cpu":
        return False
    return not isinstance(t, torch._subclasses.FakeTensor) and not t.is_meta


def check_finite_blocks(v: torch.Tensor, what: str, name: str, block_dims: str) -> None:
    """Raise ValueError if the blocked float32 view ``v [..., nblocks, block]`` holds NaN or ±Inf, naming the tensor
    and the first bad block's index (``block_dims`` spells the index, e.g. "row, group")."""
    bad = ~torch.isfinite(v).all(dim=-1)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        count = int(bad.sum())
        raise ValueError(
            f"{what}: {name} holds NaN or Inf in {count} block(s); the first is block "
            f"[{block_dims}] = {list(first)}; quantizing it would give finite garbage"
        )


# ----------------------------------------------------------------------------------------------------------------
# Power-of-two (UE8M0) scales
# ----------------------------------------------------------------------------------------------------------------
def round_up_pow2(s: torch.Tensor) -> torch.Tensor:
    """Round positive normal float32 values up to the next power of two, exactly, from the bits.

    A value that already is a power of two is kept. Inputs must be positive, finite and normal (the callers
    floor amax at 1e-4, so scales are far from the subnormal range).
    """
    bits = s.float().contiguous().view(torch.int32)
    mantissa = bits & 0x7FFFFF
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + (mantissa != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def ue8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (uint8 or float8_e8m0fnu) → float32 2^(b − 127). Byte 0 gives 2^-127 (subnormal).

    Byte 255 is UE8M0's NaN and is rejected with ValueError (SPEC §1.2); the check reads the data (eager use)."""
    b = as_uint8(b)
    nan = b == 255
    if bool(nan.any()):
        first = nan.flatten().nonzero()[0].item()
        raise ValueError(f"UE8M0 scale holds the NaN byte 255 at flat index {first}; scale bytes must be 0..254")
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b.to(torch.int32) - 127)


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """View a one-byte tensor (uint8, float4_e2m1fn_x2, float8_e8m0fnu) as uint8 without copying."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a one-byte dtype (uint8, float4_e2m1fn_x2, float8_e8m0fnu), got {t.dtype}")
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# Activations: fp8 e4m3fn with 1×g power-of-two scales (SPEC §1.1)
# ----------------------------------------------------------------------------------------------------------------
def quantize_activation(
    x: torch.Tensor,
    group_size: int,
    fp8_max: float = FP8_E4M3FN_MAX,
    pow2_scale: bool = True,
    *,
    check_finite: bool | None = None,
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of ``x`` [R, K] to fp8 e4m3fn per 1×``group_size`` group.

    Returns ``(x_q float8_e4m3fn [R, K], x_s float32 [R, K/group_size])`` with value = ``x_q * x_s``.
    Computed in fp32: ``amax = max(max|v|, 1e-4)``, ``s = amax / fp8_max`` (rounded up to a power of two when
    ``pow2_scale``), ``q = e4m3fn(clamp(v / s, ±fp8_max))`` with round-to-nearest-even. fp8_max ∈ [2, 448].

    Non-finite values (docs/errors.md): with ``check_finite`` True a group holding NaN or ±Inf raises ValueError
    naming ``name``, the row and the group. None (the default) checks where the values can be read for free —
    CPU tensors outside torch.compile — and, elsewhere (device tensors: the check would be a host sync; traced
    graphs) gives the defined result of the maths, which every backend shares bit for bit: a NaN makes the
    group's scale −0.0 (its exponent carries into the sign bit), +Inf makes it +Inf; either way the scale is not
    a positive finite number, and forward rejects such an x_scale on every rank. False never checks (what the
    reference swiglu_and_cast uses, to mirror the kernels' bits on any input).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_activation: {name} must be 2-D [R, K], got shape {tuple(x.shape)}")
    rows, k = x.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"quantize_activation: K={k} must be a multiple of group_size={group_size}")
    check_fp8_max(fp8_max, "quantize_activation")
    v = x.float().reshape(rows, k // group_size, group_size)
    if check_finite or (check_finite is None and _values_readable(v)):
        check_finite_blocks(v, "quantize_activation", name, "row, group")
    amax = v.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    s = amax / fp8_max
    if pow2_scale:
        s = round_up_pow2(s)
    q = (v / s.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.reshape(rows, k), s


def dequantize_activation(x_q: torch.Tensor, x_s: torch.Tensor) -> torch.Tensor:
    """fp8 activations [R, K] with float32 scales [R, K/g] → float32 [R, K]."""
    g = x_q.shape[-1] // x_s.shape[-1]
    return x_q.float() * x_s.float().repeat_interleave(g, dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# e2m1 (fp4) codes
# ----------------------------------------------------------------------------------------------------------------
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float32 → e2m1 4-bit codes (uint8 0..15), round-to-nearest-even on the e2m1 grid, saturating at ±6,
    keeping the sign of zero (what ml_dtypes.float4_e2m1fn does from float32). NaN is not representable and
    must not be passed."""
    v = v.float()
    a = v.abs()
    # Thresholds between neighbouring grid points; at an exact midpoint the even code wins, hence `<=` on the
    # midpoints whose lower neighbour has an even code and `<` where the upper one does.
    code = torch.full_like(a, 7, dtype=torch.uint8)
    code = torch.where(a <= 5.0, 6, code)
    code = torch.where(a < 3.5, 5, code)
    code = torch.where(a <= 2.5, 4, code)
    code = torch.where(a < 1.75, 3, code)
    code = torch.where(a <= 1.25, 2, code)
    code = torch.where(a < 0.75, 1, code)
    code = torch.where(a <= 0.25, 0, code).to(torch.uint8)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 4-bit codes (uint8 0..15) → float32."""
    table = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes → [..., K/2] uint8; element k in byte k//2, low nibble for even k."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 (or float4_e2m1fn_x2) → [..., K] codes."""
    packed = as_uint8(packed)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------------------
# Weights (SPEC §1.2)
# ----------------------------------------------------------------------------------------------------------------
def _check_weight_finite(w: torch.Tensor, block: int, what: str, name: str) -> None:
    """Weights are quantized offline: always read them (a host sync on a device is fine here)."""
    if w.shape[-1] % block:
        raise ValueError(f"{what}: K={w.shape[-1]} must be a multiple of {block}")
    v = w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)
    dims = ", ".join([f"d{i}" for i in range(w.dim() - 2)] + ["n", f"k/{block}"])
    check_finite_blocks(v, what, name, dims)


def quantize_weight_fp8(w: torch.Tensor, *, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] → (float8_e4m3fn [..., N, K], float32 scales [..., N, K/128]); pow2 scales, fp8_max 448.

    NaN or ±Inf anywhere raises ValueError naming ``name`` and the first bad 1×128 block (its scale would
    otherwise be −0.0 or inf, and the block finite garbage or NaN)."""
    _check_weight_finite(w, WEIGHT_FP8_BLOCK, "quantize_weight_fp8", name)
    lead = w.shape[:-1]
    q, s = quantize_activation(w.reshape(-1, w.shape[-1]), WEIGHT_FP8_BLOCK, check_finite=False)
    return q.reshape(w.shape), s.reshape(*lead, -1)


def dequantize_weight_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [..., N, K] with float32 [..., N, K/128] → float32 [..., N, K]."""
    return q.float() * s.float().repeat_interleave(WEIGHT_FP8_BLOCK, dim=-1)


def expand_block_scales(block_s: torch.Tensor, n: int, rows: int = WEIGHT_FP8_BLOCK) -> torch.Tensor:
    """Checkpoint block scales [..., ceil(N/rows), C] (128×128 blocks: C = K/128) → one scale per row
    [..., N, C] float32 (a repeat along N)."""
    return block_s.float().repeat_interleave(rows, dim=-2)[..., :n, :].contiguous()


def quantize_weight_fp4(w: torch.Tensor, *, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] → (uint8 [..., N, K/2] packed e2m1, uint8 UE8M0 scales [..., N, K/32]).

    Per 32-block: ``s = 2^clamp(ceil(log2(amax / 6)), −127, 127)`` (amax = 0 gives byte 0), ``q = e2m1(w / s)``.
    ceil(log2(y)) is taken exactly from frexp, not from a floating log2. NaN or ±Inf anywhere raises ValueError
    naming ``name`` and the first bad 1×32 block (e2m1 has neither: the block would become code 6.0 at 2^0).
    """
    k = w.shape[-1]
    if k % WEIGHT_FP4_BLOCK:
        raise ValueError(f"quantize_weight_fp4: K={k} must be a multiple of {WEIGHT_FP4_BLOCK}")
    _check_weight_finite(w, WEIGHT_FP4_BLOCK, "quantize_weight_fp4", name)
    v = w.float().reshape(*w.shape[:-1], k // WEIGHT_FP4_BLOCK, WEIGHT_FP4_BLOCK)
    amax = v.abs().amax(dim=-1)
    y = amax / E2M1_MAX
    mant, exp = torch.frexp(y)  # y = mant · 2^exp, mant in [0.5, 1)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)
    # y == 0: an all-zero block, or an amax below 3·2^-149 whose quotient underflows float32; either way the
    # SPEC's clamp gives -127 (frexp(0) would give exponent 0, byte 127).
    e = torch.where(y == 0, torch.full_like(exp, -127), ceil_log2.clamp(-127, 127))
    scale_byte = (e + 127).to(torch.uint8)
    s = torch.ldexp(torch.ones_like(y), e)
    codes = e2m1_encode(v / s.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), scale_byte


def dequantize_weight_fp4(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] with UE8M0 [..., N, K/32] → float32 [..., N, K]."""
    vals = e2m1_decode(unpack_fp4(q))
    return vals * ue8m0_to_float(s).repeat_interleave(WEIGHT_FP4_BLOCK, dim=-1)


def weight_format(w: torch.Tensor) -> WeightFormat:
    """The weight format named by a weight tensor's dtype (SPEC §4)."""
    if w.dtype == torch.bfloat16:
        return "bf16"
    if w.dtype == torch.float8_e4m3fn:
        return "fp8"
    if w.dtype in (torch.uint8, torch.float4_e2m1fn_x2):
        return "fp4"
    raise TypeError(
        f"weight dtype {w.dtype} is not a weight format: expected bfloat16 (bf16), float8_e4m3fn (fp8), "
        "or uint8 / float4_e2m1fn_x2 (fp4)"
    )


def dequantize_weight(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """Any weight format → float32, same leading dims, full K."""
    fmt = weight_format(w)
    if fmt == "bf16":
        return w.float()
    if s is None:
        raise ValueError(f"{fmt} weights need a scale tensor")
    if fmt == "fp8":
        return dequantize_weight_fp8(w, s)
    return dequantize_weight_fp4(w, s)


def quantize_weight(w: torch.Tensor, fmt: WeightFormat, *, name: str = "w") -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16/fp32 weights [..., N, K] → the given format (bf16 returns scale None; fp8 / fp4 reject NaN / Inf)."""
    if fmt == "bf16":
        return w.to(torch.bfloat16), None
    if fmt == "fp8":
        return quantize_weight_fp8(w, name=name)
    if fmt == "fp4":
        return quantize_weight_fp4(w, name=name)
    raise ValueError(f"unknown weight format {fmt!r}: expected 'bf16', 'fp8' or 'fp4'")
