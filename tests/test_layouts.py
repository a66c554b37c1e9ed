"""Weight layouts (SPEC §1.2): static_moe.layouts' EOI ↔ EIO permutations and the trn2 re-encoding.

The expected layouts are computed here independently — numpy index arithmetic on the definitions of the table
(byte j of element [l, m, n] is the code of k = 4m + j, …) and ml_dtypes' e4m3fn casts for the halving —
never by calling the function under test in the other direction.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from static_moe import layouts
from static_moe.formats import dequantize_weight_fp4, dequantize_weight_fp8, ue8m0_to_float
from static_moe.layouts import (
    TRN2_INEXACT_CODES,
    as_eoi,
    from_mx_fp8,
    layout_format,
    logical_shape,
    prepare_weight,
    reencode_fp8_for_trn2,
    scales_are_pow2,
    to_eio,
    to_eoi,
    to_mx_fp8,
    trn2_blocks_to_reencode,
    weight_shapes,
)

E4M3 = ml_dtypes.float8_e4m3fn


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor, in its logical (row-major) order, as a flat uint8 array."""
    return layouts._view(t, torch.uint8, (-1,)).numpy()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bytes(a), _bytes(b))


def _random_fp8(g: torch.Generator, L: int, n: int, k: int, *, pow2: bool, allow_nan: bool = True, emax: int = 127):
    codes = torch.randint(0, 256, (L, n, k), generator=g, dtype=torch.uint8)
    if not allow_nan:
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)
    if pow2:
        s = torch.ldexp(torch.ones(L, n, k // 128), torch.randint(-127, emax + 1, (L, n, k // 128), generator=g))
    else:
        s = torch.rand(L, n, k // 128, generator=g) * 3 + 1e-3
    return codes.view(torch.float8_e4m3fn), s


def _random_fp4(g: torch.Generator, L: int, n: int, k: int):
    return (torch.randint(0, 256, (L, n, k // 2), generator=g, dtype=torch.uint8),
            torch.randint(0, 255, (L, n, k // 32), generator=g, dtype=torch.uint8))


dims = st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 3), st.integers(0, 2**31 - 1))


# ---------------------------------------------------------------------------------------------------------------
# Round trips, byte-exact
# ---------------------------------------------------------------------------------------------------------------
@settings(max_examples=25)
@given(dims)
def test_roundtrip_bf16(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    k = 32 * kb + 1  # bf16 has no block: any K
    w = torch.randint(-32768, 32768, (L, n, k), generator=g, dtype=torch.int16).view(torch.bfloat16)  # NaNs too
    w_eio, s_eio = to_eio(w)
    assert s_eio is None and w_eio.shape == (L, k, n) and w_eio.dtype == torch.bfloat16
    assert np.array_equal(w_eio.view(torch.int16).numpy(), w.view(torch.int16).numpy().transpose(0, 2, 1))
    back, s_back = to_eoi(w_eio)
    assert s_back is None and _same_bytes(back, w)


@settings(max_examples=25)
@given(dims)
def test_roundtrip_fp8(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    w, s = _random_fp8(g, L, n, 128 * kb, pow2=False)
    w_eio, s_eio = to_eio(w, s)
    assert w_eio.dtype == torch.float8_e4m3fn and w_eio.shape == (L, 128 * kb, n)
    assert s_eio.dtype == torch.float32 and s_eio.shape == (L, kb, n)
    assert np.array_equal(w_eio.view(torch.uint8).numpy(), w.view(torch.uint8).numpy().transpose(0, 2, 1))
    assert np.array_equal(s_eio.numpy(), s.numpy().transpose(0, 2, 1))
    back_w, back_s = to_eoi(w_eio, s_eio)
    assert _same_bytes(back_w, w) and _same_bytes(back_s, s)


@settings(max_examples=25)
@given(dims)
def test_roundtrip_fp8_mx(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    k = 128 * kb
    w, s = _random_fp8(g, L, n, k, pow2=True)
    w_mx, s_mx = to_eio(w, s, mx=True)
    assert w_mx.dtype == torch.uint32 and w_mx.shape == (L, k // 4, n)
    assert s_mx.dtype == torch.uint8 and s_mx.shape == (L, k // 32, n)
    # The definition: byte j (little-endian) of element [l, m, n] is the code of k = 4m + j.
    val = w_mx.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    codes = w.view(torch.uint8).numpy()
    for j in range(4):
        assert np.array_equal((val >> (8 * j)) & 0xFF, codes[:, :, j::4].transpose(0, 2, 1))
    # Each 128-block's 2^e is byte e + 127, repeated over its four 32-blocks.
    e = np.frexp(s.numpy())[1] - 1
    assert np.array_equal(s_mx.numpy(), np.repeat(e + 127, 4, axis=2).transpose(0, 2, 1))
    back_w, back_s = to_eoi(w_mx, s_mx)
    assert _same_bytes(back_w, w) and _same_bytes(back_s, s)


@settings(max_examples=25)
@given(dims)
def test_roundtrip_fp4(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    k = 32 * kb
    w, s = _random_fp4(g, L, n, k)
    w_eio, s_eio = to_eio(w, s)
    assert w_eio.dtype == torch.uint16 and w_eio.shape == (L, k // 4, n)
    assert s_eio.dtype == torch.uint8 and s_eio.shape == (L, k // 32, n)
    # Nibble j of element [l, m, n] is the e2m1 code of k = 4m + j (EOI: low nibble of byte k//2 for even k).
    val = w_eio.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    b = w.numpy()
    codes = np.stack((b & 0x0F, b >> 4), axis=-1).reshape(L, n, k)
    for j in range(4):
        assert np.array_equal((val >> (4 * j)) & 0xF, codes[:, :, j::4].transpose(0, 2, 1))
    assert np.array_equal(s_eio.numpy(), s.numpy().transpose(0, 2, 1))
    back_w, back_s = to_eoi(w_eio, s_eio)
    assert _same_bytes(back_w, w) and _same_bytes(back_s, s)
    # The dequantized matrix is the same whichever layout it went through.
    assert torch.equal(dequantize_weight_fp4(back_w, back_s), dequantize_weight_fp4(w, s))


def test_fp4_torch_dtypes_accepted_and_viewed():
    g = torch.Generator().manual_seed(1)
    w, s = _random_fp4(g, 2, 3, 64)
    a = to_eio(w.view(torch.float4_e2m1fn_x2), s.view(torch.float8_e8m0fnu))
    b = to_eio(w, s)
    assert _same_bytes(a[0], b[0]) and _same_bytes(a[1], b[1])


@settings(max_examples=20)
@given(dims)
def test_eio_to_eoi_to_eio_is_identity(d):
    """The other direction: any valid EIO tensor survives EOI and back, byte for byte."""
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    k = 128 * kb
    mx = torch.randint(0, 256, (L, k // 4, n, 4), generator=g, dtype=torch.uint8).view(torch.uint32)[..., 0]
    mx_s = torch.randint(0, 255, (L, kb, 1, n), generator=g, dtype=torch.uint8).expand(L, kb, 4, n)
    mx_s = mx_s.reshape(L, k // 32, n).contiguous()
    w, s = to_eoi(mx, mx_s)
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and scales_are_pow2(s)
    back = to_eio(w, s, mx=True)
    assert _same_bytes(back[0], mx.contiguous()) and _same_bytes(back[1], mx_s)
    p = torch.randint(0, 256, (L, k // 4, n, 2), generator=g, dtype=torch.uint8).view(torch.uint16)[..., 0]
    ps = torch.randint(0, 256, (L, k // 32, n), generator=g, dtype=torch.uint8)
    back = to_eio(*to_eoi(p, ps))
    assert _same_bytes(back[0], p.contiguous()) and _same_bytes(back[1], ps)


def test_shapes_and_formats_helpers():
    assert weight_shapes("fp8_mx", "eio", 2, 256, 512) == ((2, 128, 256), (2, 16, 256))
    assert weight_shapes("fp4", "eoi", 2, 256, 512) == ((2, 256, 256), (2, 256, 16))
    assert weight_shapes("bf16", "eio", 2, 256, 512) == ((2, 512, 256), None)
    w = torch.zeros(2, 128, 64, dtype=torch.uint32)
    assert layout_format(w, "eio") == "fp8_mx" and logical_shape(w, "eio") == (2, 64, 512)
    assert layout_format(torch.zeros(1, 2, 2, dtype=torch.uint16), "eio") == "fp4"
    with pytest.raises(TypeError, match="not an 'eoi' weight format"):
        layout_format(w, "eoi")
    with pytest.raises(TypeError, match="not an 'eio' weight format"):
        layout_format(torch.zeros(1, 2, 2, dtype=torch.uint8), "eio")
    with pytest.raises(ValueError, match="weight_layout must be 'eoi'"):
        as_eoi(w, None, "EIO")


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------
def test_mx_refuses_non_pow2_scales():
    g = torch.Generator().manual_seed(2)
    w, s = _random_fp8(g, 1, 4, 256, pow2=True)
    s[0, 2, 1] = 0.75
    with pytest.raises(ValueError, match=r"power-of-two scales.*scale\[0, 1, 2\] = 0.75"):
        to_eio(w, s, mx=True)
    s[0, 2, 1] = float("inf")
    with pytest.raises(ValueError, match="power-of-two"):
        to_mx_fp8(*to_eio(w, s))
    assert not scales_are_pow2(s)


def test_from_mx_refuses_unequal_quarter_scales_and_nan_byte():
    w = torch.zeros(1, 32, 8, dtype=torch.uint32)
    s = torch.full((1, 4, 8), 127, dtype=torch.uint8)
    s[0, 2, 5] = 126
    with pytest.raises(ValueError, match=r"four UE8M0 scales .* block \[l, k/128, n\] = \[0, 0, 5\]"):
        from_mx_fp8(w, s)
    s[0, 2, 5] = 127
    s[0, :, 3] = 255
    with pytest.raises(ValueError, match="NaN byte 255"):
        to_eoi(w, s)


@pytest.mark.parametrize("case, exc, match", [
    ("fp8_2d", ValueError, "must be 3-D"),
    ("fp8_no_scale", ValueError, "needs its scale tensor of shape \\[1, 4, 2\\]"),
    ("fp8_bad_scale_shape", ValueError, "must have shape \\[1, 4, 2\\], got \\[1, 2, 4\\]"),
    ("fp8_bad_scale_dtype", TypeError, "must be torch.float32"),
    ("fp8_k", ValueError, "K=200, which must be a multiple of 128"),
    ("bf16_scale", ValueError, "bf16 w takes no scale"),
    ("fp4_k", ValueError, "multiple of 32"),
    ("mx_on_fp4", ValueError, "mx=True is the fp8 MX form"),
    ("int8", TypeError, "not an 'eoi' weight format"),
])
def test_to_eio_errors(case, exc, match):
    fp8 = torch.zeros(1, 4, 256, dtype=torch.float8_e4m3fn)
    args, kw = {
        "fp8_2d": ((fp8[0], torch.ones(4, 2)), {}),
        "fp8_no_scale": ((fp8, None), {}),
        "fp8_bad_scale_shape": ((fp8, torch.ones(1, 2, 4)), {}),
        "fp8_bad_scale_dtype": ((fp8, torch.ones(1, 4, 2, dtype=torch.float64)), {}),
        "fp8_k": ((torch.zeros(1, 4, 200, dtype=torch.float8_e4m3fn), torch.ones(1, 4, 1)), {}),
        "bf16_scale": ((torch.zeros(1, 4, 8, dtype=torch.bfloat16), torch.ones(1, 4, 1)), {}),
        "fp4_k": ((torch.zeros(1, 4, 20, dtype=torch.uint8), torch.zeros(1, 4, 1, dtype=torch.uint8)), {}),
        "mx_on_fp4": ((torch.zeros(1, 4, 16, dtype=torch.uint8), torch.zeros(1, 4, 1, dtype=torch.uint8)),
                      {"mx": True}),
        "int8": ((torch.zeros(1, 4, 8, dtype=torch.int8), None), {}),
    }[case]
    with pytest.raises(exc, match=match):
        to_eio(*args, **kw)


def test_to_eoi_errors():
    with pytest.raises(ValueError, match=r"scale of fp4 w \[1, N=8, K=64\] under weight_layout='eio' must have "
                                         r"shape \[1, 2, 8\]"):
        to_eoi(torch.zeros(1, 16, 8, dtype=torch.uint16), torch.zeros(1, 8, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="not an 'eio' weight format"):
        to_eoi(torch.zeros(1, 16, 8, dtype=torch.uint8), torch.zeros(1, 2, 8, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# trn2 re-encoding
# ---------------------------------------------------------------------------------------------------------------
def _halve_ml_dtypes(code: int) -> int:
    """The e4m3fn code of (value of code) / 2, rounded to nearest-even, computed with ml_dtypes."""
    v = np.array([code], dtype=np.uint8).view(E4M3).astype(np.float32)
    return int((v / np.float32(2)).astype(E4M3).view(np.uint8)[0])


def test_inexact_code_table_is_what_halving_does():
    """TRN2_INEXACT_CODES is exactly the set of finite codes whose value changes when halved and rescaled by 2."""
    changed = {}
    for c in range(256):
        if (c & 0x7F) == 0x7F:
            continue
        h = _halve_ml_dtypes(c)
        v = np.array([c], dtype=np.uint8).view(E4M3).astype(np.float32)[0]
        hv = np.array([h], dtype=np.uint8).view(E4M3).astype(np.float32)[0]
        if hv * 2 != v:
            changed[c] = h
    expected = {**TRN2_INEXACT_CODES, **{c | 0x80: h | 0x80 for c, h in TRN2_INEXACT_CODES.items()}}
    assert changed == expected


@settings(max_examples=25)
@given(dims, st.sampled_from(["eoi", "eio"]))
def test_reencode_identity_without_exponent_15(d, layout):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x78, (L, n, 128 * kb), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7
    w = codes.view(torch.float8_e4m3fn)
    s = torch.rand(L, n, kb, generator=g) + 0.5
    if layout == "eio":
        w, s = to_eio(w, s)
    w2, s2 = reencode_fp8_for_trn2(w, s, layout)
    assert _same_bytes(w2, w) and _same_bytes(s2, s)
    assert not bool(trn2_blocks_to_reencode(w, layout).any())


@settings(max_examples=25)
@given(dims)
def test_reencode_moves_exactly_the_documented_codes(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    k = 128 * kb
    w, s = _random_fp8(g, L, n, k, pow2=False, allow_nan=False)
    # Make about half the blocks free of exponent-15 codes, and put every finite code somewhere in block 0.
    codes = w.view(torch.uint8).clone()
    keep = torch.rand(L, n, kb, generator=g) < 0.5
    clean = torch.where((codes & 0x7F) >= 0x78, codes & 0x87, codes)
    codes = torch.where(keep.repeat_interleave(128, dim=2), clean, codes)
    # Block [0, 0, 0]: every positive finite code (0x78..0x7E among them) and 0x81; block [0, 1, 0] the negatives.
    codes[0, 0, :128] = torch.tensor(list(range(0x7F)) + [0x81], dtype=torch.uint8)
    if n >= 2:
        codes[0, 1, :128] = torch.tensor(list(range(0x80, 0xFF)) + [0x01], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    w2, s2 = reencode_fp8_for_trn2(w, s)

    cb = codes.numpy().reshape(L, n, kb, 128)
    moves = ((cb & 0x7F) >= 0x78).any(axis=-1)
    assert np.array_equal(trn2_blocks_to_reencode(w).numpy(), moves)
    halve = np.array([_halve_ml_dtypes(c) if (c & 0x7F) != 0x7F else c for c in range(256)], dtype=np.uint8)
    want_codes = np.where(moves[..., None], halve[cb], cb).reshape(L, n, k)
    assert np.array_equal(w2.view(torch.uint8).numpy(), want_codes)
    assert np.array_equal(s2.numpy(), np.where(moves, s.numpy() * 2, s.numpy()))
    # No exponent-15 code is left, and a second pass changes nothing.
    assert not bool(((w2.view(torch.uint8) & 0x7F) >= 0x78).any())
    w3, s3 = reencode_fp8_for_trn2(w2, s2)
    assert _same_bytes(w3, w2) and _same_bytes(s3, s2)

    # Dequantized, the weight is the same except at the documented codes of moved blocks, which are off by
    # exactly one 2^-9 step in the documented direction.
    before = dequantize_weight_fp8(w, s).numpy().reshape(L, n, kb, 128).astype(np.float64)
    after = dequantize_weight_fp8(w2, s2).numpy().reshape(L, n, kb, 128).astype(np.float64)
    inexact = moves[..., None] & np.isin(cb & 0x7F, list(TRN2_INEXACT_CODES))
    assert np.array_equal(before[~inexact], after[~inexact])
    units = {0x01: (1, 0), 0x03: (3, 4), 0x05: (5, 4), 0x07: (7, 8), 0x09: (9, 8), 0x0B: (11, 12),
             0x0D: (13, 12), 0x0F: (15, 16)}
    scale = np.broadcast_to(s.numpy().astype(np.float64)[..., None], cb.shape)
    sign = np.where(cb & 0x80, -1.0, 1.0)
    for c, (u_before, u_after) in units.items():
        at = moves[..., None] & ((cb & 0x7F) == c)
        assert np.array_equal(before[at], (sign * u_before * 2.0 ** -9 * scale)[at].astype(np.float32))
        assert np.array_equal(after[at], (sign * u_after * 2.0 ** -9 * scale)[at].astype(np.float32))
    assert moves[0, 0, 0] and inexact[0, 0, 0].sum() == 9  # the eight positive ones and 0x81
    if n >= 2:
        assert moves[0, 1, 0] and inexact[0, 1, 0].sum() == 9


@settings(max_examples=15)
@given(dims)
def test_reencode_same_in_either_layout(d):
    L, n, kb, seed = d
    g = torch.Generator().manual_seed(seed)
    w, s = _random_fp8(g, L, n, 128 * kb, pow2=False, allow_nan=False)
    a = to_eio(*reencode_fp8_for_trn2(w, s, "eoi"))
    b = reencode_fp8_for_trn2(*to_eio(w, s), "eio")
    assert _same_bytes(a[0], b[0]) and _same_bytes(a[1], b[1])
    assert np.array_equal(trn2_blocks_to_reencode(to_eio(w, s)[0], "eio").numpy(),
                          trn2_blocks_to_reencode(w, "eoi").numpy().transpose(0, 2, 1))


def test_reencode_errors():
    w = torch.full((1, 2, 128), 0x78, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="would overflow float32"):
        reencode_fp8_for_trn2(w, torch.full((1, 2, 1), 2.0 ** 127))
    assert torch.equal(reencode_fp8_for_trn2(w, torch.full((1, 2, 1), 2.0 ** 126))[1], torch.full((1, 2, 1), 2.0**127))
    nan = w.view(torch.uint8).clone()
    nan[0, 1, 5] = 0xFF
    with pytest.raises(ValueError, match=r"NaN code .* blocked index \[0, 1, 0, 5\]"):
        reencode_fp8_for_trn2(nan.view(torch.float8_e4m3fn), torch.ones(1, 2, 1))
    with pytest.raises(TypeError, match="must be float8_e4m3fn"):
        reencode_fp8_for_trn2(torch.zeros(1, 2, 128, dtype=torch.bfloat16), torch.ones(1, 2, 1))
    with pytest.raises(ValueError, match="weight_layout must be"):
        reencode_fp8_for_trn2(w, torch.ones(1, 2, 1), "kio")
    with pytest.raises(ValueError, match=r"must have shape \[1, 2, 1\]"):
        reencode_fp8_for_trn2(w, torch.ones(1, 1, 2), "eoi")


# ---------------------------------------------------------------------------------------------------------------
# Preparing for a target
# ---------------------------------------------------------------------------------------------------------------
def test_prepare_weight_per_target():
    g = torch.Generator().manual_seed(5)
    w, s = _random_fp8(g, 2, 8, 256, pow2=True, allow_nan=False, emax=120)
    cw, cs, lay = prepare_weight(w, s, "cpu")
    assert lay == "eoi" and cw is w and cs is s
    tw, ts, lay = prepare_weight(w, s, "trn2")
    want = to_eio(*reencode_fp8_for_trn2(w, s))
    assert lay == "eio" and _same_bytes(tw, want[0]) and _same_bytes(ts, want[1])
    mw, ms, lay = prepare_weight(w, s, "trn3")
    assert lay == "eio" and mw.dtype == torch.uint32 and _same_bytes(to_eoi(mw, ms)[0], w)
    s_any = s.clone()
    s_any[0, 0, 0] = 0.3
    pw, ps, lay = prepare_weight(w, s_any, "trn3")
    assert lay == "eio" and pw.dtype == torch.float8_e4m3fn and _same_bytes(ps, s_any.transpose(1, 2).contiguous())
    f4, f4s = _random_fp4(g, 2, 8, 64)
    for target in ("trn2", "trn3"):
        q, qs, lay = prepare_weight(f4, f4s, target)
        assert lay == "eio" and q.dtype == torch.uint16 and _same_bytes(to_eoi(q, qs)[0], f4)
    b = torch.randn(2, 8, 16).to(torch.bfloat16)
    q, qs, lay = prepare_weight(b, None, "trn2")
    assert qs is None and lay == "eio" and torch.equal(q, b.transpose(1, 2))
    with pytest.raises(ValueError, match="target must be one of"):
        prepare_weight(b, None, "trn1")
    assert layouts.target_layout("cuda") == "eoi" and layouts.target_layout("trn3") == "eio"


def test_mx_dequantizes_like_fp8():
    """The UE8M0 bytes of the MX form are worth exactly the fp32 scales they came from."""
    g = torch.Generator().manual_seed(9)
    w, s = _random_fp8(g, 1, 4, 256, pow2=True, allow_nan=False)
    _, s_mx = to_eio(w, s, mx=True)
    assert torch.equal(ue8m0_to_float(s_mx[:, ::4]), s.transpose(1, 2))


def test_prepare_expert_weights_takes_mx_only_when_both_are_pow2():
    g = torch.Generator().manual_seed(11)
    w13, s13 = _random_fp8(g, 2, 256, 128, pow2=True, allow_nan=False, emax=120)
    w2, s2 = _random_fp8(g, 2, 128, 128, pow2=True, allow_nan=False, emax=120)
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn3")
    assert out[0].dtype == torch.uint32 and out[2].dtype == torch.uint32 and out[4] == "eio"
    s2[1, 3, 0] = 1.5
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn3")
    assert out[0].dtype == torch.float8_e4m3fn and out[2].dtype == torch.float8_e4m3fn
    assert _same_bytes(out[0], to_eio(w13, s13)[0]) and _same_bytes(out[3], to_eio(w2, s2)[1])
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn2")
    want = to_eio(*reencode_fp8_for_trn2(w2, s2))
    assert _same_bytes(out[2], want[0]) and _same_bytes(out[3], want[1])
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "cuda")
    assert out[0] is w13 and out[4] == "eoi"
