"""Weight layouts of SPEC §1.2: today's "EOI" (nn.Linear, ``[L, N, K]``) and the prepared, K-major "EIO".

Everything here is a pure byte permutation of the EOI tensors (no re-quantization, exactly reversible), except
:func:`reencode_fp8_for_trn2`, a separate value-level step, and the MX fp8 form, which needs power-of-two
scales. All functions run in pure torch on whatever device their inputs live on (the permutations are copies;
nothing reads values on the host except the checks that say so).

For a weight of EOI shape ``[L, N, K]`` (w13: N = 2I, K = H; w2: N = H, K = I):

============  ===========================================  ====================================================
format        EOI (``weight_layout="eoi"``)                EIO (``weight_layout="eio"``)
============  ===========================================  ====================================================
bf16          bfloat16 ``[L, N, K]``                        bfloat16 ``[L, K, N]`` (= ``w.transpose(1, 2)``)
fp8           float8_e4m3fn ``[L, N, K]``,                  float8_e4m3fn ``[L, K, N]``,
              float32 scales ``[L, N, K/128]``              float32 scales ``[L, K/128, N]``
fp8 MX        as fp8 (power-of-two scales only)             uint32 ``[L, K/4, N]``: byte j (little-endian) of
                                                            element ``[l, m, n]`` is the code of k = 4m + j;
                                                            UE8M0 uint8 ``[L, K/32, N]``: each 128-block's scale
                                                            2^e as byte e + 127, repeated for its four 32-blocks
fp4           uint8 ``[L, N, K/2]`` (low nibble = even k),  uint16 ``[L, K/4, N]``: nibble j (bits 4j..4j+3) of
              UE8M0 uint8 ``[L, N, K/32]``                  element ``[l, m, n]`` is the e2m1 code of k = 4m + j;
                                                            UE8M0 uint8 ``[L, K/32, N]``
============  ===========================================  ====================================================

Under "eio" the format is read from the dtype: bfloat16 → bf16, float8_e4m3fn → fp8 (float32 scales),
uint32 → fp8 MX (UE8M0 scales), uint16 → fp4. Scales stay in natural k-block order; a kernel that wants the
``nc_matmul_mx`` scale partition order places them with its DMA (Neuron docs, ``nki.isa.nc_matmul_mx``).

Why K-major: the decode MoE kernels that run on Trainium (aws-neuron nki-library ``core/moe/moe_tkg``,
``core/mlp/mlp_tkg``) keep weights K-major in HBM, so a K tile of 128 rows lands on the 128 SBUF partitions as
the TensorE's stationary operand with no on-chip transpose. The x4 packing (uint16 for e2m1, uint32 for e4m3)
is the packed form ``nc_matmul_mx`` reads: four consecutive K of one column in one element.

Byte order: the packed forms are defined little-endian (byte / nibble 0 is the least significant); they are
built here by viewing bytes, which needs a little-endian host (x86, Arm as run by torch) and is checked.
"""

from __future__ import annotations

import sys
from typing import Literal

import torch

from .formats import WEIGHT_FP4_BLOCK, WEIGHT_FP8_BLOCK, as_uint8, ue8m0_to_float

WeightLayout = Literal["eoi", "eio"]
WEIGHT_LAYOUTS = ("eoi", "eio")
# Formats as a layout sees them; "fp8_mx" exists only under "eio".
LayoutFormat = Literal["bf16", "fp8", "fp8_mx", "fp4"]
Target = Literal["cpu", "cuda", "trn2", "trn3"]
TARGETS = ("cpu", "cuda", "trn2", "trn3")

MX_BLOCK = 32  # UE8M0 scale block of nc_matmul_mx, along K
PACK = 4  # K values per packed EIO element (fp4 uint16, fp8 MX uint32)

# e4m3fn: bits 3..6 are the exponent field; a code with exponent field 15 (|q| ≥ 256, or NaN) has
# (code & 0x7F) in 0x78..0x7F. 0x7F / 0xFF are NaN.
_E4M3_EXP15_LO = 0x78
_E4M3_NAN = 0x7F

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("static_moe.layouts builds the packed EIO forms by viewing bytes and needs a little-endian host")


def _view(t: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Reinterpret a tensor's bytes (row-major) as ``dtype`` of ``shape``. Through a flat copy-free reshape because
    ``Tensor.view(dtype)`` between element sizes needs stride 1 on the last dim, which a "contiguous" tensor with
    size-1 dims need not have (a one-element tensor keeps any stride through reshape, hence the clone)."""
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(dtype).reshape(shape)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in row-major order with row-major strides. ``contiguous()`` alone may keep a permuted stride on a
    size-1 dim (e.g. scales [L, N, 1] of a transpose), which byte views and kernels that read strides trip on."""
    t = t.contiguous()
    want, acc = [], 1
    for size in reversed(t.shape):
        want.append(acc)
        acc *= max(size, 1)
    return t if tuple(reversed(want)) == t.stride() else t.clone(memory_format=torch.contiguous_format)


def _prefix(op: str | None) -> str:
    return f"{op}: " if op else ""


def check_weight_layout(weight_layout, op: str | None = None) -> str:
    """``"eoi"`` or ``"eio"``; anything else raises ValueError naming the op and the value."""
    if not isinstance(weight_layout, str) or weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(
            f"{_prefix(op)}weight_layout must be 'eoi' (nn.Linear [L, N, K]) or 'eio' (prepared, "
            f"K-major), got {weight_layout!r}"
        )
    return weight_layout


def layout_format(w: torch.Tensor, weight_layout: str = "eoi") -> LayoutFormat:
    """The format of a weight tensor under a layout, from its dtype (SPEC §1.2, §4).

    "eoi": bfloat16 → "bf16", float8_e4m3fn → "fp8", uint8 / float4_e2m1fn_x2 → "fp4".
    "eio": bfloat16 → "bf16", float8_e4m3fn → "fp8", uint32 → "fp8_mx", uint16 → "fp4".
    Raises TypeError for any other dtype, naming what the layout expects."""
    check_weight_layout(weight_layout)
    d = w.dtype
    if d == torch.bfloat16:
        return "bf16"
    if d == torch.float8_e4m3fn:
        return "fp8"
    if weight_layout == "eoi":
        if d in (torch.uint8, torch.float4_e2m1fn_x2):
            return "fp4"
        raise TypeError(
            f"weight dtype {d} is not an 'eoi' weight format: expected bfloat16 (bf16), float8_e4m3fn "
            "(fp8), or uint8 / float4_e2m1fn_x2 (fp4)"
        )
    if d == torch.uint32:
        return "fp8_mx"
    if d == torch.uint16:
        return "fp4"
    raise TypeError(
        f"weight dtype {d} is not an 'eio' weight format: expected bfloat16 (bf16), float8_e4m3fn "
        "(fp8, float32 scales), uint32 (fp8 MX, UE8M0 scales) or uint16 (fp4)"
    )


def weight_shapes(
    fmt: LayoutFormat, weight_layout: str, num_experts: int, n: int, k: int
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(weight shape, scale shape or None)`` of an ``[L, N, K]`` matrix in a format and layout (the table above)."""
    check_weight_layout(weight_layout)
    L = num_experts
    if weight_layout == "eoi":
        table = {
            "bf16": ((L, n, k), None),
            "fp8": ((L, n, k), (L, n, k // WEIGHT_FP8_BLOCK)),
            "fp4": ((L, n, k // 2), (L, n, k // WEIGHT_FP4_BLOCK)),
        }
    else:
        table = {
            "bf16": ((L, k, n), None),
            "fp8": ((L, k, n), (L, k // WEIGHT_FP8_BLOCK, n)),
            "fp8_mx": ((L, k // PACK, n), (L, k // MX_BLOCK, n)),
            "fp4": ((L, k // PACK, n), (L, k // WEIGHT_FP4_BLOCK, n)),
        }
    if fmt not in table:
        raise ValueError(f"format {fmt!r} has no {weight_layout!r} layout (expected one of {sorted(table)})")
    return table[fmt]


def logical_shape(w: torch.Tensor, weight_layout: str = "eoi") -> tuple[int, int, int]:
    """``(L, N, K)`` of the matrix a 3-D weight tensor holds, under a layout (K counts values, not bytes)."""
    check_weight_layout(weight_layout)
    if w.dim() != 3:
        raise ValueError(f"weight must be 3-D, got shape {tuple(w.shape)}")
    fmt = layout_format(w, weight_layout)
    L, a, b = w.shape
    if weight_layout == "eoi":
        return (L, a, 2 * b) if fmt == "fp4" else (L, a, b)
    return (L, b, PACK * a) if fmt in ("fp4", "fp8_mx") else (L, b, a)


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def _check_pair(
    w: torch.Tensor, s: torch.Tensor | None, fmt: LayoutFormat, weight_layout: str, what: str, name: str
) -> tuple[int, int, int]:
    """Shape / dtype / device checks of one weight and its scale; returns (L, N, K)."""
    if w.dim() != 3:
        raise ValueError(f"{what}: {name} must be 3-D (weight_layout={weight_layout!r}), got shape {tuple(w.shape)}")
    L, n, k = logical_shape(w, weight_layout)
    block = {"bf16": 1, "fp8": WEIGHT_FP8_BLOCK, "fp8_mx": WEIGHT_FP8_BLOCK, "fp4": WEIGHT_FP4_BLOCK}[fmt]
    if k % block:
        raise ValueError(f"{what}: {name} has K={k}, which must be a multiple of {block} for {fmt}")
    _, s_shape = weight_shapes(fmt, weight_layout, L, n, k)
    if s_shape is None:
        if s is not None:
            raise ValueError(f"{what}: bf16 {name} takes no scale, got a {s.dtype} tensor of shape {tuple(s.shape)}")
        return L, n, k
    if s is None:
        raise ValueError(f"{what}: {fmt} {name} needs its scale tensor of shape {list(s_shape)}")
    want = torch.float32 if fmt == "fp8" else torch.uint8
    ok_dtype = s.dtype == want or (want == torch.uint8 and s.dtype == torch.float8_e8m0fnu)
    if not ok_dtype:
        raise TypeError(
            f"{what}: the scale of {fmt} {name} must be {want}"
            f"{' (or float8_e8m0fnu)' if want == torch.uint8 else ''}, got {s.dtype}"
        )
    if tuple(s.shape) != s_shape:
        raise ValueError(
            f"{what}: the scale of {fmt} {name} [{L}, N={n}, K={k}] under weight_layout="
            f"{weight_layout!r} must have shape {list(s_shape)}, got {list(s.shape)}"
        )
    if s.device != w.device:
        raise ValueError(f"{what}: {name} is on {w.device} but its scale is on {s.device}")
    return L, n, k


def pow2_exponents(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 scales → (ok, e): ``ok`` where the scale is 2^e with e in [−127, 127] (a UE8M0 byte e + 127 holds it
    exactly), ``e`` the exponent (meaningful where ok). The one rule of :func:`scales_are_pow2`, the MX form and
    the NKI dispatch's check of MX activation scales."""
    mant, exp = torch.frexp(s)
    e = exp - 1
    return (mant == 0.5) & (e >= -127) & (e <= 127), e


def scales_are_pow2(s: torch.Tensor) -> bool:
    """Whether every float32 scale is a power of two 2^e with e in [−127, 127] (so a UE8M0 byte e + 127 holds it
    exactly). Reads the values (a host sync on a device)."""
    if s.dtype != torch.float32:
        raise TypeError(f"scales_are_pow2: expected float32 scales, got {s.dtype}")
    return bool(pow2_exponents(s)[0].all())


def _pow2_to_ue8m0(s: torch.Tensor, what: str) -> torch.Tensor:
    """float32 powers of two → UE8M0 bytes; anything else raises ValueError with the first offending index of
    ``s`` as given (so a caller checks the tensor the user passed, in its layout)."""
    ok, e = pow2_exponents(s)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        raise ValueError(
            f"{what}: the MX fp8 form needs power-of-two scales 2^e, e in [-127, 127] (a UE8M0 byte); "
            f"scale{bad} = {s[tuple(bad)].item()!r} is not one. Keep the plain fp8 'eio' form "
            f"(to_eio(w, s), mx=False) for arbitrary float32 scales"
        )
    return (e + 127).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# EOI → EIO
# ----------------------------------------------------------------------------------------------------------------
def to_eio(
    w: torch.Tensor, s: torch.Tensor | None = None, *, mx: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """EOI weight ``w`` (and its scale ``s``) → the EIO form (contiguous, same device; table in the module doc).

    ``w``: bfloat16 ``[L, N, K]`` (``s`` None), float8_e4m3fn ``[L, N, K]`` with float32 ``s [L, N, K/128]``,
    or fp4 uint8 / float4_e2m1fn_x2 ``[L, N, K/2]`` with UE8M0 uint8 / float8_e8m0fnu ``s [L, N, K/32]``.
    ``mx=True`` (fp8 only) gives the MX form: uint32 ``[L, K/4, N]`` and UE8M0 ``[L, K/32, N]``; it needs
    power-of-two scales and raises ValueError otherwise. Returns ``(w_eio, s_eio)``; :func:`to_eoi` inverts it
    byte for byte. Shape or dtype errors raise ValueError / TypeError naming the tensor."""
    what = "to_eio"
    fmt = layout_format(w, "eoi")
    _check_pair(w, s, fmt, "eoi", what, "w")
    if mx and fmt != "fp8":
        raise ValueError(f"{what}: mx=True is the fp8 MX form and needs a float8_e4m3fn weight, got {fmt} ({w.dtype})")
    if fmt == "bf16":
        return _dense(w.transpose(1, 2)), None
    if fmt == "fp8":
        if mx:
            _pow2_to_ue8m0(s, what)  # a non-pow2 scale is reported at its index in the EOI s the caller passed
        w_eio, s_eio = _dense(w.transpose(1, 2)), _dense(s.transpose(1, 2))
        return to_mx_fp8(w_eio, s_eio) if mx else (w_eio, s_eio)
    # fp4: bytes 2m, 2m+1 of a row hold k = 4m..4m+3 in nibble order, so a little-endian uint16 of that byte pair is
    # the packed element; moving byte pairs is all it takes.
    L, n, half_k = w.shape
    pairs = _dense(as_uint8(w).reshape(L, n, half_k // 2, 2).transpose(1, 2))  # [L, K/4, N, 2]
    return _view(pairs, torch.uint16, (L, half_k // 2, n)), _dense(as_uint8(s).transpose(1, 2))


def to_mx_fp8(w_eio: torch.Tensor, s_eio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EIO fp8 (float8_e4m3fn ``[L, K, N]``, float32 ``[L, K/128, N]``) → EIO fp8 MX (uint32 ``[L, K/4, N]``,
    UE8M0 uint8 ``[L, K/32, N]``). Scales must be powers of two (ValueError otherwise); exact."""
    what = "to_mx_fp8"
    if layout_format(w_eio, "eio") != "fp8":
        raise TypeError(f"{what}: expected an 'eio' float8_e4m3fn weight, got {w_eio.dtype}")
    L, n, k = _check_pair(w_eio, s_eio, "fp8", "eio", what, "w")
    b = _dense(w_eio.view(torch.uint8).reshape(L, k // PACK, PACK, n).transpose(2, 3))  # [L, K/4, N, 4]
    w_mx = _view(b, torch.uint32, (L, k // PACK, n))
    s_mx = _pow2_to_ue8m0(s_eio, what).repeat_interleave(WEIGHT_FP8_BLOCK // MX_BLOCK, dim=1)
    return w_mx, s_mx


# ----------------------------------------------------------------------------------------------------------------
# EIO → EOI
# ----------------------------------------------------------------------------------------------------------------
def from_mx_fp8(w_mx: torch.Tensor, s_mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EIO fp8 MX → EIO fp8 (float8_e4m3fn ``[L, K, N]``, float32 ``[L, K/128, N]``); inverse of :func:`to_mx_fp8`.

    The four UE8M0 bytes of each 128-block must agree (the form holds one scale per 128 K) and none may be the
    NaN byte 255: ValueError otherwise."""
    what = "from_mx_fp8"
    if layout_format(w_mx, "eio") != "fp8_mx":
        raise TypeError(f"{what}: expected an 'eio' uint32 (fp8 MX) weight, got {w_mx.dtype}")
    L, n, k = _check_pair(w_mx, s_mx, "fp8_mx", "eio", what, "w")
    sb = as_uint8(s_mx).reshape(L, k // WEIGHT_FP8_BLOCK, WEIGHT_FP8_BLOCK // MX_BLOCK, n)
    if not bool((sb == sb[:, :, :1]).all()):
        bad = (sb != sb[:, :, :1]).nonzero()[0].tolist()
        raise ValueError(
            f"{what}: the four UE8M0 scales of each 128-block must be equal (one fp8 scale per 128 K); "
            f"block [l, k/128, n] = {[bad[0], bad[1], bad[3]]} differs"
        )
    s = _dense(ue8m0_to_float(sb[:, :, 0]))
    b = _view(w_mx, torch.uint8, (L, k // PACK, n, PACK)).transpose(2, 3)  # [L, K/4, 4, N]
    return _dense(b.reshape(L, k, n)).view(torch.float8_e4m3fn), s


def to_eoi(w: torch.Tensor, s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """EIO weight (and scale) → EOI, the exact inverse of :func:`to_eio` (format from the dtype).

    bfloat16 ``[L, K, N]`` → ``[L, N, K]``; float8_e4m3fn ``[L, K, N]`` + float32 ``[L, K/128, N]`` →
    ``[L, N, K]`` + ``[L, N, K/128]``; uint32 (MX) ``[L, K/4, N]`` + UE8M0 ``[L, K/32, N]`` → float8_e4m3fn
    ``[L, N, K]`` + float32 powers of two ``[L, N, K/128]``; uint16 ``[L, K/4, N]`` + UE8M0 ``[L, K/32, N]`` →
    uint8 ``[L, N, K/2]`` + uint8 ``[L, N, K/32]``. Contiguous, same device."""
    what = "to_eoi"
    fmt = layout_format(w, "eio")
    _check_pair(w, s, fmt, "eio", what, "w")
    if fmt == "bf16":
        return _dense(w.transpose(1, 2)), None
    if fmt == "fp8_mx":
        w, s = from_mx_fp8(w, s)
        fmt = "fp8"
    if fmt == "fp8":
        return _dense(w.transpose(1, 2)), _dense(s.transpose(1, 2))
    L, quarter_k, n = w.shape
    pairs = _view(w, torch.uint8, (L, quarter_k, n, 2)).transpose(1, 2)  # [L, N, K/4, 2]
    return _dense(pairs.reshape(L, n, 2 * quarter_k)), _dense(as_uint8(s).transpose(1, 2))


def as_eoi(
    w: torch.Tensor, s: torch.Tensor | None, weight_layout: str = "eoi"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the reference ops use: the weight and scale in EOI form, whatever the layout they came in.

    ``"eoi"`` returns the tensors themselves (no copy); ``"eio"`` converts back exactly (:func:`to_eoi`)."""
    if check_weight_layout(weight_layout) == "eoi":
        return w, s
    return to_eoi(w, s)


# ----------------------------------------------------------------------------------------------------------------
# trn2 re-encoding
# ----------------------------------------------------------------------------------------------------------------
# Codes whose value changes when their block is re-encoded: odd mantissa with exponent field 0 (subnormal) or 1,
# i.e. (code & 0x7F) in this set, each mapping to the code listed (the sign bit is kept).
TRN2_INEXACT_CODES = {0x01: 0x00, 0x03: 0x02, 0x05: 0x02, 0x07: 0x04, 0x09: 0x04, 0x0B: 0x06, 0x0D: 0x06, 0x0F: 0x08}


def reencode_fp8_for_trn2(
    w: torch.Tensor, s: torch.Tensor, weight_layout: str = "eoi"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-encode fp8 weights so every code is finite in trn2's float8_e4m3 (max 240); either layout.

    ``w`` float8_e4m3fn and ``s`` float32 in the given layout ("eoi": ``[L, N, K]`` and ``[L, N, K/128]``;
    "eio": ``[L, K, N]`` and ``[L, K/128, N]``). Returns new tensors of the same shapes, dtypes and layout.

    trn2's on-chip fp8 is IEEE-style: exponent field 15 is Inf / NaN there, while e4m3fn uses it for
    256 … 448. Exactly the 1×128 K blocks (one output row n, 128 consecutive k) holding a code with
    ``(code & 0x7F)`` in 0x78 … 0x7E (|q| ≥ 256) move: every code of such a block is halved — its value q becomes
    q / 2 rounded to nearest-even on the e4m3fn grid — and the block's scale doubles. Every other block is
    byte-identical, and re-encoding a re-encoded weight changes nothing.

    In a moved block the product q·s is unchanged for every code except the odd mantissas of exponent field 0
    and 1 (q / 2 falls between two subnormals and rounds half to even), whose code (sign kept) moves as
    :data:`TRN2_INEXACT_CODES` lists:

        0x01 → 0x00, 0x03 → 0x02, 0x05 → 0x02, 0x07 → 0x04, 0x09 → 0x04, 0x0B → 0x06, 0x0D → 0x06, 0x0F → 0x08
        (and the same with bit 7 set: 0x81 → 0x80 = −0, …)

    i.e. magnitudes (in units of 2^-9) 1, 3, 5, 7, 9, 11, 13, 15 become 0, 4, 4, 8, 8, 12, 12, 16 after the
    scale's doubling: an error of one 2^-9 step, at most 2^-9·s, on codes of magnitude < 2^-5.

    Raises ValueError for a NaN code (0x7F / 0xFF: no weight quantizer makes one), for a scale that would double
    to infinity, and TypeError / ValueError for wrong dtypes / shapes. The result is again a valid fp8 weight in
    the same layout, so the reference computes on it with no special case.
    """
    what = "reencode_fp8_for_trn2"
    check_weight_layout(weight_layout, what)
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{what}: w must be float8_e4m3fn, got {w.dtype}")
    _check_pair(w, s, "fp8", weight_layout, what, "w")
    codes, blk_dim = _fp8_blocks(w, weight_layout)
    s_b = s.unsqueeze(blk_dim)  # the scale broadcast against the block's 128 codes
    mag = codes & 0x7F
    if bool((mag == _E4M3_NAN).any()):
        bad = (mag == _E4M3_NAN).nonzero()[0].tolist()
        raise ValueError(f"{what}: w holds a NaN code (0x7F / 0xFF) at blocked index {bad}; fp8 weights must be finite")
    moves = (mag >= _E4M3_EXP15_LO).any(dim=blk_dim, keepdim=True)  # one flag per block
    doubled = s_b * 2
    if bool((moves & ~torch.isfinite(doubled)).any()):
        raise ValueError(
            f"{what}: a block that must be re-encoded has a scale of 2^127 or more; doubling it would overflow float32"
        )
    # q / 2 is exact in float32 and the e4m3fn cast rounds to nearest-even, which is the documented rounding.
    halved = (codes.view(torch.float8_e4m3fn).float() * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    new_codes = torch.where(moves, halved, codes)
    new_s = torch.where(moves, doubled, s_b).squeeze(blk_dim)
    return _dense(new_codes.reshape(w.shape)).view(torch.float8_e4m3fn), _dense(new_s)


def _fp8_blocks(w: torch.Tensor, weight_layout: str) -> tuple[torch.Tensor, int]:
    """A float8_e4m3fn weight's codes (uint8 view) with the 128 codes of each 1×128 K block on one axis, and that
    axis: "eoi" ``[L, N, K/128, 128]`` (axis 3), "eio" ``[L, K/128, 128, N]`` (axis 2). Removing the axis gives
    the scale tensor's shape in that layout."""
    L, n, k = logical_shape(w, weight_layout)
    nb = k // WEIGHT_FP8_BLOCK
    if weight_layout == "eoi":
        return w.view(torch.uint8).reshape(L, n, nb, WEIGHT_FP8_BLOCK), 3
    return w.view(torch.uint8).reshape(L, nb, WEIGHT_FP8_BLOCK, n), 2


def trn2_blocks_to_reencode(w: torch.Tensor, weight_layout: str = "eoi") -> torch.Tensor:
    """bool per 1×128 block (shape of the scale tensor in that layout): whether :func:`reencode_fp8_for_trn2`
    moves it, i.e. whether it holds a code of exponent field 15. ``w``: float8_e4m3fn (TypeError otherwise: the
    packed MX form and the other formats have no such blocks)."""
    what = "trn2_blocks_to_reencode"
    check_weight_layout(weight_layout, what)
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{what}: w must be float8_e4m3fn, got {w.dtype}")
    codes, blk_dim = _fp8_blocks(w, weight_layout)
    return ((codes & 0x7F) >= _E4M3_EXP15_LO).any(dim=blk_dim)


# ----------------------------------------------------------------------------------------------------------------
# Preparing for a device
# ----------------------------------------------------------------------------------------------------------------
def check_target(target, op: str | None = None) -> str:
    """One of ``"cpu"``, ``"cuda"``, ``"trn2"``, ``"trn3"``; ValueError otherwise."""
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"{_prefix(op)}target must be one of {list(TARGETS)}, got {target!r}")
    return target


def target_layout(target: str) -> str:
    """The layout weights are prepared in for a target: "eoi" on CPU / CUDA (their kernels read nn.Linear rows),
    "eio" on Neuron (trn2, trn3)."""
    return "eoi" if check_target(target) in ("cpu", "cuda") else "eio"


ACT_FORMATS = ("bf16", "fp8")


def _mx_for(act_format: str | None, op: str) -> bool:
    """Whether trn3 may take the fp8 MX form for activations in ``act_format`` (scales permitting).

    bf16 activations against fp8 weights: no. nc_matmul_mx wants both operands MX, so bf16 × MX-fp8 decodes the
    weight on chip, and above 8 rows that decode bounds the GEMM (about 56 % of the roofline in the NKI GEMM
    author's cost model, against about 94 % for the plain K-major fp8 form the PE reads as it is). fp8
    activations, or None (not known), keep the MX form."""
    if act_format is not None and act_format not in ACT_FORMATS:
        raise ValueError(f"{op}: act_format must be one of {list(ACT_FORMATS)} or None, got {act_format!r}")
    return act_format != "bf16"


def prepare_weight(
    w: torch.Tensor, s: torch.Tensor | None, target: str, act_format: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """An EOI weight (and scale) prepared for a target; returns ``(w, s, weight_layout)``.

    - "cpu" / "cuda": unchanged, "eoi" (the tensors themselves, fp4 / UE8M0 viewed as uint8).
    - "trn2": "eio"; fp8 is first re-encoded (:func:`reencode_fp8_for_trn2`), bf16 / fp4 are only permuted.
    - "trn3": "eio"; fp8 with every scale a power of two takes the MX form (uint32 + UE8M0) unless
      ``act_format`` is "bf16"; fp8 with arbitrary scales, or for bf16 activations, the plain fp8 form (not
      re-encoded: trn3 reads e4m3fn); bf16 / fp4 are only permuted.

    ``act_format``: the activation format the weight will be multiplied with ("bf16", "fp8", or None: not known,
    as "fp8"); it only chooses trn3's fp8 form (see :func:`_mx_for`).
    """
    check_target(target, "prepare_weight")
    mx_ok = _mx_for(act_format, "prepare_weight")
    fmt = layout_format(w, "eoi")
    if target in ("cpu", "cuda"):
        return (as_uint8(w) if fmt == "fp4" else w), (as_uint8(s) if fmt == "fp4" else s), "eoi"
    if fmt == "fp8":
        if target == "trn2":
            w, s = reencode_fp8_for_trn2(w, s, "eoi")
            return *to_eio(w, s), "eio"
        return *to_eio(w, s, mx=mx_ok and scales_are_pow2(s)), "eio"
    return *to_eio(w, s), "eio"


def prepare_expert_weights(
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    target: str,
    act_format: str | None = None,
):
    """A layer's EOI ``w13 [L, 2I, H]`` / ``w2 [L, H, I]`` (and scales) prepared together for a target.

    Returns ``(w13, w13_scale, w2, w2_scale, weight_layout)``. As :func:`prepare_weight` (``act_format`` too:
    the layer's activation format; GEMM2's input is then the SwiGLU output in that same format), except that on
    trn3 the fp8 MX form is taken only when the scales of *both* are powers of two (the ops want one form for
    both), else both stay plain EIO fp8."""
    check_target(target, "prepare_expert_weights")
    mx_ok = _mx_for(act_format, "prepare_expert_weights")
    if target == "trn3" and layout_format(w13, "eoi") == "fp8" and layout_format(w2, "eoi") == "fp8":
        mx = mx_ok and scales_are_pow2(w13_scale) and scales_are_pow2(w2_scale)
        a, b = to_eio(w13, w13_scale, mx=mx), to_eio(w2, w2_scale, mx=mx)
        return a[0], a[1], b[0], b[1], "eio"
    a, b = prepare_weight(w13, w13_scale, target, act_format), prepare_weight(w2, w2_scale, target, act_format)
    return a[0], a[1], b[0], b[1], a[2]
