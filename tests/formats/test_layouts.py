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
    return (
        torch.randint(0, 256, (L, n, k // 2), generator=g, dtype=torch.uint8),
        torch.randint(0, 255, (L, n, k // 32), generator=g, dtype=torch.uint8),
    )


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
    # Reported by to_eio at its index in the EOI scale the caller passed, not at the permuted EIO index.
    with pytest.raises(
        ValueError,
        match=r"^to_eio: the MX fp8 form needs power-of-two scales.*"
        r"scale\[0, 2, 1\] = 0.75",
    ):
        to_eio(w, s, mx=True)
    with pytest.raises(ValueError, match=r"^to_mx_fp8: .*scale\[0, 1, 2\] = 0.75"):
        to_mx_fp8(*to_eio(w, s))  # given EIO scales, the EIO index
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


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("fp8_2d", ValueError, "must be 3-D"),
        ("fp8_no_scale", ValueError, "needs its scale tensor of shape \\[1, 4, 2\\]"),
        ("fp8_bad_scale_shape", ValueError, "must have shape \\[1, 4, 2\\], got \\[1, 2, 4\\]"),
        ("fp8_bad_scale_dtype", TypeError, "must be torch.float32"),
        ("fp8_k", ValueError, "K=200, which must be a multiple of 128"),
        ("bf16_scale", ValueError, "bf16 w takes no scale"),
        ("fp4_k", ValueError, "multiple of 32"),
        ("mx_on_fp4", ValueError, "mx=True is the fp8 MX form"),
        ("int8", TypeError, "not an 'eoi' weight format"),
    ],
)
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
        "mx_on_fp4": (
            (torch.zeros(1, 4, 16, dtype=torch.uint8), torch.zeros(1, 4, 1, dtype=torch.uint8)),
            {"mx": True},
        ),
        "int8": ((torch.zeros(1, 4, 8, dtype=torch.int8), None), {}),
    }[case]
    with pytest.raises(exc, match=match):
        to_eio(*args, **kw)


def test_to_eoi_errors():
    with pytest.raises(
        ValueError,
        match=r"scale of fp4 w \[1, N=8, K=64\] under weight_layout='eio' must have "
        r"shape \[1, 2, 8\]",
    ):
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
    with pytest.raises(TypeError, match=r"trn2_blocks_to_reencode: w must be float8_e4m3fn, got torch.uint32"):
        trn2_blocks_to_reencode(w.view(torch.uint8).view(torch.uint32), "eio")  # the MX form has no such blocks
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
    units = {
        0x01: (1, 0),
        0x03: (3, 4),
        0x05: (5, 4),
        0x07: (7, 8),
        0x09: (9, 8),
        0x0B: (11, 12),
        0x0D: (13, 12),
        0x0F: (15, 16),
    }
    scale = np.broadcast_to(s.numpy().astype(np.float64)[..., None], cb.shape)
    sign = np.where(cb & 0x80, -1.0, 1.0)
    for c, (u_before, u_after) in units.items():
        at = moves[..., None] & ((cb & 0x7F) == c)
        assert np.array_equal(before[at], (sign * u_before * 2.0**-9 * scale)[at].astype(np.float32))
        assert np.array_equal(after[at], (sign * u_after * 2.0**-9 * scale)[at].astype(np.float32))
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
    assert np.array_equal(
        trn2_blocks_to_reencode(to_eio(w, s)[0], "eio").numpy(),
        trn2_blocks_to_reencode(w, "eoi").numpy().transpose(0, 2, 1),
    )


def test_reencode_errors():
    w = torch.full((1, 2, 128), 0x78, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="would overflow float32"):
        reencode_fp8_for_trn2(w, torch.full((1, 2, 1), 2.0**127))
    assert torch.equal(reencode_fp8_for_trn2(w, torch.full((1, 2, 1), 2.0**126))[1], torch.full((1, 2, 1), 2.0**127))
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
    # trn3 with bf16 activations keeps plain K-major fp8 even for pow2 scales (the MX form is decode-bound there).
    pw, ps, lay = prepare_weight(w, s, "trn3", "bf16")
    assert lay == "eio" and pw.dtype == torch.float8_e4m3fn and _same_bytes(pw, to_eio(w, s)[0])
    assert prepare_weight(w, s, "trn3", "fp8")[0].dtype == torch.uint32
    with pytest.raises(ValueError, match=r"prepare_weight: act_format must be one of \['bf16', 'fp8'\] or None"):
        prepare_weight(w, s, "trn3", "fp4")
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
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn3", act_format="bf16")
    assert out[0].dtype == torch.float8_e4m3fn and out[2].dtype == torch.float8_e4m3fn
    assert _same_bytes(out[0], to_eio(w13, s13)[0]) and _same_bytes(out[3], to_eio(w2, s2)[1])
    s2[1, 3, 0] = 1.5
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn3")
    assert out[0].dtype == torch.float8_e4m3fn and out[2].dtype == torch.float8_e4m3fn
    assert _same_bytes(out[0], to_eio(w13, s13)[0]) and _same_bytes(out[3], to_eio(w2, s2)[1])
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "trn2")
    want = to_eio(*reencode_fp8_for_trn2(w2, s2))
    assert _same_bytes(out[2], want[0]) and _same_bytes(out[3], want[1])
    out = layouts.prepare_expert_weights(w13, s13, w2, s2, "cuda")
    assert out[0] is w13 and out[4] == "eoi"


# ---------------------------------------------------------------------------------------------------------------
# The ops' weight_layout argument (SPEC §4): reference, checks, CPU refusal, fakes / graphs, NKI dispatch
# ---------------------------------------------------------------------------------------------------------------
import static_moe  # noqa: E402  (registers the ops)
from static_moe import _C, reference  # noqa: E402
from static_moe.nki import dispatch  # noqa: E402
from static_moe.testing.backends import cpu_kernels  # noqa: E402
from static_moe.testing.generators import make_activations, make_routing, make_weights  # noqa: E402
from static_moe.testing.numeric import assert_equal  # noqa: E402

LH, LI, LL = 256, 128, 3  # H, I, L of the op tests
# (activation format, weight format, prepared form): "mx" is fp8 weights in the MX form.
OP_CASES = [
    ("bf16", "bf16", "eio"),
    ("bf16", "fp8", "eio"),
    ("fp8", "fp8", "eio"),
    ("fp8", "fp8", "mx"),
    ("bf16", "fp4", "eio"),
    ("fp8", "fp4", "eio"),
]


def _eio_weights(w: dict, form: str) -> dict:
    a = to_eio(w["w13"], w["w13_scale"], mx=form == "mx")
    b = to_eio(w["w2"], w["w2_scale"], mx=form == "mx")
    return {"w13": a[0], "w13_scale": a[1], "w2": b[0], "w2_scale": b[1]}


def _le_args(x, xs, idx, tw, w, offset=0, limit=None, fp8_max=448.0):
    return (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], offset, limit, fp8_max)


@pytest.mark.parametrize("act,wfmt,form", OP_CASES, ids=[f"{a}x{w}-{f}" for a, w, f in OP_CASES])
def test_reference_ops_give_the_same_bits_in_either_layout(act, wfmt, form):
    w = make_weights(LL, LH, LI, wfmt, seed=3)
    we = _eio_weights(w, form)
    x, xs = make_activations(9, LH, act, 128, seed=4)
    idx, tw = make_routing(9, 2, 2 * LL, seed=5, empty_frac=0.2)
    eoi = reference.local_experts(*_le_args(x, xs, idx, tw, w, LL, 6.0))
    eio = reference.local_experts(*_le_args(x, xs, idx, tw, we, LL, 6.0), weight_layout="eio")
    assert eoi.abs().sum() > 0
    assert_equal(eio, eoi, f"local_experts {act}x{wfmt} {form}")
    mask = torch.rand(9, generator=torch.Generator().manual_seed(6)) < 0.7
    for e in range(LL):
        g_eoi = reference.expert_gemm(x, xs, w["w13"], w["w13_scale"], mask, e)
        g_eio = reference.expert_gemm(x, xs, we["w13"], we["w13_scale"], mask, e, "eio")
        assert_equal(g_eio, g_eoi, f"expert_gemm {act}x{wfmt} {form} expert {e}")
    idx, tw = make_routing(9, 2, LL, seed=6, empty_frac=0.2)
    f_eoi = reference.forward(
        x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], None, LL, 16, None, "", 0, 1
    )
    f_eio = reference.forward(
        x,
        xs,
        idx,
        tw,
        we["w13"],
        we["w13_scale"],
        we["w2"],
        we["w2_scale"],
        None,
        LL,
        16,
        None,
        "",
        0,
        1,
        weight_layout="eio",
    )
    assert f_eoi.abs().sum() > 0
    assert_equal(f_eio, f_eoi, f"forward {act}x{wfmt} {form}")


def test_cpu_kernels_refuse_eio_and_check_its_shapes_first():
    w = make_weights(LL, LH, LI, "fp8", seed=7)
    we = _eio_weights(w, "eio")
    x, xs = make_activations(4, LH, "fp8", 128, seed=8)
    idx, tw = make_routing(4, 2, LL, seed=9)
    refuse = r"weight_layout='eio' \(prepared, K-major weights\) is not supported by the CPU kernels"
    # The message names the three ways out, each of which exists.
    ways = (
        r"build the layer with StaticMoE\(prepare_for=\"cpu\"\), convert prepared tensors back exactly with "
        r"static_moe.layouts.to_eoi, or \(tests, CPU\) run the prepared bytes through the reference with "
        r"static_moe.testing.backends.cpu_kernels\(\"reference\"\)"
    )
    with pytest.raises(ValueError, match=refuse + r".*; " + ways):
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, we), "eio")
    assert callable(layouts.to_eoi) and callable(cpu_kernels)
    with pytest.raises(ValueError, match="local_experts: " + refuse):
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, we), "eio")
    with pytest.raises(ValueError, match="expert_gemm: " + refuse):
        torch.ops.static_moe.expert_gemm(x, xs, we["w13"], we["w13_scale"], torch.ones(4, dtype=torch.bool), 0, "eio")
    with pytest.raises(ValueError, match=r"local_experts: " + refuse):
        static_moe.forward(
            x,
            xs,
            idx,
            tw,
            we["w13"],
            we["w13_scale"],
            we["w2"],
            we["w2_scale"],
            num_experts=LL,
            capacity=4,
            weight_layout="eio",
        )
    # An EOI tensor passed as "eio" fails the EIO shape check, naming the expected prepared shape.
    with pytest.raises(
        ValueError,
        match=r"local_experts: w13_scale must have shape \[L, K/128, N\] \(weight_layout="
        r"'eio'\) = \[3, 2, 256\], got \[3, 256, 2\]",
    ):
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, w), "eio")
    with pytest.raises(ValueError, match="weight_layout must be 'eoi' .* or 'eio' .*, got 'kio'"):
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, w), "kio")
    with pytest.raises(ValueError, match="weight_layout must be 'eoi'"):
        reference.local_experts(*_le_args(x, xs, idx, tw, w), weight_layout="EOI")
    # "eoi" passed explicitly is today's op.
    assert_equal(
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, w), "eoi"),
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, w)),
        "explicit eoi",
    )
    # A prepared dtype passed without weight_layout='eio' says so.
    for packed in (we["w13"].view(torch.uint8).view(torch.uint32), we["w13"].view(torch.uint8).view(torch.uint16)):
        with pytest.raises(
            TypeError,
            match=r"expert_gemm: b must have a weight dtype: .* got torch.uint(32|16) "
            r"\(a prepared dtype: pass weight_layout='eio'\)",
        ):
            torch.ops.static_moe.expert_gemm(x, xs, packed, we["w13_scale"], torch.ones(4, dtype=torch.bool), 0)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        (
            "mixed",
            TypeError,
            r"under weight_layout='eio' w2 must have the dtype of w13 \(torch.uint32\), got "
            r"torch.float8_e4m3fn",
        ),
        ("mx_scale_dtype", TypeError, r"w13_scale must have dtype torch.uint8 or torch.float8_e8m0fnu"),
        ("fp4_shape", ValueError, r"w2 must have shape \[L, K/4, N\] \(weight_layout='eio'\) = \[3, 32, 256\]"),
        ("uint8", TypeError, r"must have a weight dtype of weight_layout='eio': .* got torch.uint8"),
    ],
)
def test_eio_checks(case, exc, match):
    x, xs = make_activations(4, LH, "fp8", 128, seed=8)
    idx, tw = make_routing(4, 2, LL, seed=9)
    w8 = make_weights(LL, LH, LI, "fp8", seed=7)
    mx, plain = _eio_weights(w8, "mx"), _eio_weights(w8, "eio")
    f4 = _eio_weights(make_weights(LL, LH, LI, "fp4", seed=7), "eio")
    w = {
        "mixed": {**mx, "w2": plain["w2"], "w2_scale": plain["w2_scale"]},
        "mx_scale_dtype": {**mx, "w13_scale": mx["w13_scale"].float()},
        "fp4_shape": {**f4, "w2": f4["w2"][:, :16]},
        "uint8": {**f4, "w13": f4["w13"].view(torch.uint8)},
    }[case]
    with pytest.raises(exc, match=match):
        _C.check_local_experts(*_le_args(x, xs, idx, tw, w), weight_layout="eio")
    with pytest.raises(exc, match=match):
        torch.ops.static_moe.local_experts(*_le_args(x, xs, idx, tw, w), "eio")
    if case == "mixed":  # the reference keeps the kernels' rule (it could convert each back, but must not)
        with pytest.raises(exc, match=r"^local_experts: " + match):
            reference.local_experts(*_le_args(x, xs, idx, tw, w), weight_layout="eio")


@pytest.mark.parametrize("act,wfmt,form", OP_CASES[2:4] + OP_CASES[5:], ids=["fp8xfp8", "fp8xmx", "fp8xfp4"])
def test_eio_opcheck_and_graphs(act, wfmt, form):
    """The new argument is graph-safe like the others: opcheck of the "eio" schema (with the reference as the CPU
    kernel, since the C++ one refuses it), the fake kernel's shapes, and a torch.compile(fullgraph) graph."""
    w = _eio_weights(make_weights(2, LH, LI, wfmt, seed=13), form)
    x, xs = make_activations(5, LH, act, 128, seed=14)
    idx, tw = make_routing(5, 2, 2, seed=15, empty_frac=0.2)
    args = (*_le_args(x, xs, idx, tw, w, 0, 7.0), "eio")
    mask = torch.tensor([True, False, True, True, False])
    g_args = (x, xs, w["w13"], w["w13_scale"], mask, 1, "eio")
    # float8 inputs: torch's schema check compares inputs with allclose, which float8 lacks on the CPU.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with cpu_kernels("reference"):
        torch.library.opcheck(torch.ops.static_moe.local_experts.default, args, test_utils=utils)
        torch.library.opcheck(torch.ops.static_moe.expert_gemm.default, g_args, test_utils=utils)
        eager = torch.ops.static_moe.local_experts(*args)

        def f(*a):
            return static_moe.local_experts(*a[:-1], weight_layout="eio").to(torch.bfloat16)

        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="eager")(*args)
        assert_equal(compiled, eager.to(torch.bfloat16), "compiled eio local_experts")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.static_moe.local_experts(*args)
        g = torch.ops.static_moe.expert_gemm(*g_args)
    assert tuple(out.shape) == (5, LH) and tuple(g.shape) == (5, 2 * LI)
    # The C++ kernel is back once the block is left.
    with pytest.raises(ValueError, match="not supported by the CPU kernels"):
        torch.ops.static_moe.local_experts(*args)


def test_nki_dispatch_passes_the_layout_as_a_keyword(monkeypatch):
    seen = []

    def fake_kernel(name):
        def k(*args, **kwargs):
            seen.append((name, kwargs.get("weight_layout")))
            return torch.zeros(args[0].shape[0], 1)

        return k

    monkeypatch.setattr(dispatch, "_kernels", lambda: {n: fake_kernel(n) for n in ("expert_gemm", "local_experts")})
    from static_moe.nki import shim

    monkeypatch.setattr(shim, "simulate", lambda kernel: kernel)  # call the recording kernel directly
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")  # a plain launch (kernel[2] would wrap it in nki.jit)
    w = make_weights(2, LH, LI, "fp8", seed=1)
    we = _eio_weights(w, "eio")
    x, xs = make_activations(3, LH, "fp8", 128, seed=2)
    idx, tw = make_routing(3, 2, 2, seed=3)
    import nki_interpreter as interpreter

    with interpreter.target("trn3"):  # plain EIO fp8 bytes need no trn2 re-encoding there
        dispatch.local_experts(*_le_args(x, xs, idx, tw, w, 0, None, 240.0))
        dispatch.local_experts(*_le_args(x, xs, idx, tw, we, 0, None, 240.0), weight_layout="eio")
        dispatch.expert_gemm(x, xs, we["w13"], we["w13_scale"], torch.ones(3, dtype=torch.bool), 1, "eio")
    assert seen == [("local_experts", "eoi"), ("local_experts", "eio"), ("expert_gemm", "eio")]
    with pytest.raises(ValueError, match=r"w2 must have shape \[L, K, N\] \(weight_layout='eio'\) = \[2, 128, 256\]"):
        dispatch.local_experts(*_le_args(x, xs, idx, tw, {**we, "w2": w["w2"]}, 0, None, 240.0), weight_layout="eio")


def test_outputs_have_row_major_strides():
    """Single-block scales ([L, N, 1]) and one-column weights keep no permuted stride (byte views need none)."""
    g = torch.Generator().manual_seed(21)
    w, s = _random_fp8(g, 2, 1, 128, pow2=True, emax=100, allow_nan=False)
    outs = [
        *to_eio(w, s),
        *to_eoi(*to_eio(w, s)),
        *to_eio(w, s, mx=True),
        *to_eoi(*to_eio(w, s, mx=True)),
        *reencode_fp8_for_trn2(*to_eio(w, s), "eio"),
        *to_eoi(*to_eio(*_random_fp4(g, 2, 1, 32))),
    ]
    for t in outs:
        want = torch.empty(t.shape, dtype=t.dtype).stride()
        assert t.stride() == want, (t.shape, t.stride())


def _forward_inputs(act, wfmt, form, seed, num_local=LL, ranks=1):
    w = make_weights(num_local, LH, LI, wfmt, seed=seed)
    x, xs = make_activations(5, LH, act, 128, seed=seed + 1)
    idx, tw = make_routing(5, 2, num_local * ranks, seed=seed + 2, empty_frac=0.2)
    return x, xs, idx, tw, w, _eio_weights(w, form)


@pytest.mark.parametrize("act,wfmt,form", [("fp8", "fp8", "mx"), ("bf16", "fp4", "eio")], ids=["fp8xmx", "bf16xfp4"])
def test_forward_op_takes_the_layout_at_s1(act, wfmt, form):
    x, xs, idx, tw, w, we = _forward_inputs(act, wfmt, form, seed=31)

    def call(ws, layout):
        return static_moe.forward(
            x,
            xs,
            idx,
            tw,
            ws["w13"],
            ws["w13_scale"],
            ws["w2"],
            ws["w2_scale"],
            num_experts=LL,
            capacity=8,
            swiglu_limit=7.0,
            weight_layout=layout,
        )

    with cpu_kernels("reference"):
        eoi, eio = call(w, "eoi"), call(we, "eio")
        args = (
            x,
            xs,
            idx,
            tw,
            we["w13"],
            we["w13_scale"],
            we["w2"],
            we["w2_scale"],
            None,
            LL,
            8,
            7.0,
            "",
            0,
            1,
            448.0,
            "eio",
        )
        torch.library.opcheck(torch.ops.static_moe.forward.default, args, test_utils=("test_faketensor",))

        class Step(torch.nn.Module):
            def forward(self, *a):
                return torch.ops.static_moe.forward(*a)

        ep = torch.export.export(Step(), args)
        node = next(n for n in ep.graph.nodes if n.target is torch.ops.static_moe.forward.default)
        assert node.args[-1] == "eio", node.args  # the layout is a constant of the graph, like fp8_max
        assert_equal(ep.module()(*args), eio, "exported eio forward")
    assert eoi.abs().sum() > 0
    assert_equal(eio, eoi, f"forward {act}x{wfmt} {form} vs eoi")


def _eio_forward_worker(rank: int, size: int) -> dict:
    """Two gloo ranks, each with its own experts in the MX form, under the reference kernels: the collective
    forward (its checks, step header and config) takes the prepared layout like the unprepared one."""
    x, xs, idx, tw, w, we = _forward_inputs("fp8", "fp8", "mx", seed=41 + rank, num_local=2, ranks=size)
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    out = {}
    with cpu_kernels("reference"):
        for layout, ws in (("eoi", w), ("eio", we)):
            out[layout] = static_moe.forward(
                x,
                xs,
                idx,
                tw,
                ws["w13"],
                ws["w13_scale"],
                ws["w2"],
                ws["w2_scale"],
                num_experts=2 * size,
                capacity=8,
                group_name=group,
                ep_rank=rank,
                ep_size=size,
                weight_layout=layout,
            )
        try:  # a wrong EIO shape on rank 1 only fails the step on both ranks
            bad = we["w2"][:, :-1] if rank == 1 else we["w2"]
            static_moe.forward(
                x,
                xs,
                idx,
                tw,
                we["w13"],
                we["w13_scale"],
                bad,
                we["w2_scale"],
                num_experts=2 * size,
                capacity=8,
                group_name=group,
                ep_rank=rank,
                ep_size=size,
                weight_layout="eio",
            )
            out["error"] = None
        except (ValueError, RuntimeError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
    return {
        "same": bool(torch.equal(out["eoi"].view(torch.int16), out["eio"].view(torch.int16))),
        "nonzero": bool(out["eoi"].abs().sum() > 0),
        "error": out["error"],
    }


def test_collective_forward_takes_the_layout_on_two_ranks():
    from static_moe.testing.distributed import run_ranks

    results = run_ranks(_eio_forward_worker, 2, timeout=150)
    assert all(r["same"] and r["nonzero"] for r in results), results
    assert "w2 must have shape [L, K/4, N] (weight_layout='eio')" in results[1]["error"], results
    assert results[0]["error"].startswith("RuntimeError: forward: rank 1 failed"), results


@pytest.mark.parametrize("target,wfmt", [("trn2", "fp8"), ("trn2", "fp4"), ("trn3", "fp8"), ("trn3", "bf16")])
def test_nki_takes_the_prepared_bytes_like_the_reference(target, wfmt):
    """Parity of the prepared bytes (static_moe.layouts.prepare_expert_weights) through the NKI kernels (our
    interpreter, on the target) and the reference, within SPEC §2, and NKI prepared vs NKI unprepared."""
    import nki_interpreter as interpreter
    from static_moe.layouts import prepare_expert_weights
    from static_moe.testing.numeric import assert_gemm_close

    act = "bf16" if wfmt == "bf16" else "fp8"
    w = make_weights(2, LH, LI, wfmt, seed=51)
    p13, p13s, p2, p2s, layout = prepare_expert_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], target)
    wp = {"w13": p13, "w13_scale": p13s, "w2": p2, "w2_scale": p2s}
    x, xs = make_activations(6, LH, act, 128, seed=52)
    idx, tw = make_routing(6, 2, 2, seed=53, empty_frac=0.2)
    args = _le_args(x, xs, idx, tw, wp, 0, 7.0, 240.0)
    with interpreter.target(target):
        nki_prep = dispatch.local_experts(*args, weight_layout=layout)
        nki_plain = dispatch.local_experts(*_le_args(x, xs, idx, tw, w, 0, 7.0, 240.0))
    ref = reference.local_experts(*args, weight_layout=layout)
    assert_gemm_close(nki_prep, ref, f"NKI {target} {wfmt} prepared vs reference")
    assert_gemm_close(nki_prep, nki_plain, f"NKI {target} {wfmt} prepared vs unprepared")


@pytest.mark.parametrize("weight_layout, dim", [("eoi", 1), ("eio", 2)])
def test_forward_names_the_w13_dim_that_gives_i(weight_layout, dim):
    """forward's own check of I names the w13 dimension I is read from in each layout."""
    x, _ = make_activations(4, LH, "bf16", 128, seed=1)
    idx, tw = make_routing(4, 2, 2, seed=2)
    w13, w2 = torch.zeros(2, 0, LH, dtype=torch.bfloat16), torch.zeros(2, LH, 0, dtype=torch.bfloat16)
    if weight_layout == "eio":
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    with pytest.raises(
        ValueError,
        match=rf"^forward: I \(w13.size\({dim}\) / 2\) must be a positive multiple of "
        r"128, got 0$",
    ):
        static_moe.forward(
            x, None, idx, tw, w13, None, w2, None, num_experts=2, capacity=4, weight_layout=weight_layout
        )
