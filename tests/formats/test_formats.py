"""Number formats (SPEC §1.1–1.2): static_moe.formats vs ml_dtypes / numpy, bit for bit.

The expected values are computed here independently (numpy float32 arithmetic and ml_dtypes casts), never by
calling the function under test.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from static_moe import formats
from static_moe.formats import (
    dequantize_weight,
    dequantize_weight_fp4,
    dequantize_weight_fp8,
    e2m1_decode,
    e2m1_encode,
    expand_block_scales,
    pack_fp4,
    quantize_activation,
    quantize_weight_fp4,
    quantize_weight_fp8,
    ue8m0_to_float,
    unpack_fp4,
    weight_format,
)

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def _bits32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _torch_fp8_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _e4m3_grid() -> np.ndarray:
    """All finite non-negative e4m3fn values, ascending (codes 0x00 … 0x7E)."""
    return np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)


def _with_neighbours(x: np.ndarray) -> np.ndarray:
    """x, the next float32 above and below each, and their negatives."""
    x = x.astype(np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    down = np.nextafter(x, np.float32(-np.inf))
    both = np.concatenate([x, up, down])
    return np.concatenate([both, -both]).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# fp8 e4m3fn
# ---------------------------------------------------------------------------------------------------------------
def test_e4m3fn_decode_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    ours = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    theirs = codes.view(E4M3).astype(np.float32)
    nan = np.isnan(theirs)
    assert nan.sum() == 2 and set(codes[nan]) == {0x7F, 0xFF}
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(_bits32(ours[~nan]), _bits32(theirs[~nan]))  # -0 (code 0x80) included


def test_e4m3fn_encode_codes_ties_and_neighbours():
    grid = _e4m3_grid()
    mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)  # exact ties (4 mantissa bits)
    assert np.array_equal(mid.astype(np.float64), (grid[:-1].astype(np.float64) + grid[1:]) / 2)
    x = _with_neighbours(np.concatenate([grid, mid, [0.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11]]))
    x = x[np.abs(x) <= 448]  # beyond 448 ml_dtypes gives NaN, torch saturates; quantize clamps first anyway
    theirs = x.astype(E4M3).view(np.uint8)
    # torch's cast (what formats.quantize_* use) and the C++ kernels' own cast (cpu/kernels/cast.h, exposed as
    # _C._cast_e4m3fn), each against ml_dtypes
    from static_moe import _C

    for name, cast in (("torch", lambda t: t.to(torch.float8_e4m3fn)), ("kernel", _C._cast_e4m3fn)):
        ours = _torch_fp8_bytes(cast(torch.from_numpy(x)))
        assert np.array_equal(ours, theirs), f"{name} cast: {int((ours != theirs).sum())} codes differ"
        # ties go to the even code: 1.0625 (between 1.0 = 0x38 and 1.125 = 0x39) rounds to 0x38
        ties = _torch_fp8_bytes(cast(torch.tensor([1.0625, 1.1875, -0.0, 2.0**-10, 3 * 2.0**-10])))
        assert ties.tolist() == [0x38, 0x3A, 0x80, 0x00, 0x02], f"{name} cast ties"


def test_kernel_bf16_cast_matches_ml_dtypes(rng):
    """The C++ kernels' float32 → bf16 cast (GEMM outputs, SwiGLU bf16 out) vs ml_dtypes: ties to even, on every
    midpoint pattern and random floats (NaN excluded: ml_dtypes keeps payloads, the kernels give 0xFFFF)."""
    from static_moe import _C

    bits = torch.randint(0, 2**31 - 1, (1 << 16,), generator=rng, dtype=torch.int64)
    ties = (torch.arange(0, 1 << 15, dtype=torch.int64) << 16) | 0x8000  # exactly halfway between two bf16
    u = torch.cat([bits, ties, ties + 1, ties - 1]).to(torch.int32)
    x = torch.cat([u.view(torch.float32), -u.view(torch.float32)])
    x = x[~torch.isnan(x)]
    theirs = x.numpy().astype(ml_dtypes.bfloat16).view(np.uint16)
    ours = _C._cast_bf16(x).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs), f"{int((ours != theirs).sum())} bf16 values differ"


def _quantize_activation_np(x: np.ndarray, g: int, fp8_max: float, pow2: bool):
    """SPEC §1.1 written directly in numpy float32 + ml_dtypes."""
    r, k = x.shape
    v = x.astype(np.float32).reshape(r, k // g, g)
    amax = np.maximum(np.abs(v).max(axis=-1), np.float32(1e-4)).astype(np.float32)
    s = (amax / np.float32(fp8_max)).astype(np.float32)
    if pow2:
        m, e = np.frexp(s)  # s = m·2^e, m in [0.5, 1)
        s = np.where(m == 0.5, s, np.ldexp(np.float32(1.0), e)).astype(np.float32)
    q = np.clip(v / s[..., None], -np.float32(fp8_max), np.float32(fp8_max)).astype(np.float32)
    return q.astype(E4M3).view(np.uint8).reshape(r, k), s


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_activation_matches_numpy(group, fp8_max, pow2, rng):
    x = torch.randn(6, 512, generator=rng) * torch.logspace(-6, 3, 6).unsqueeze(1)
    x[0, :group] = 0.0  # zero block → floor scale
    x[1, :group] = -0.0  # −0 kept
    x[2, : 2 * group] *= 1e-6  # below the amax floor
    x[3, 5] = 7 * 2.0**10  # amax/448 an exact power of two (no round-up)
    q, s = quantize_activation(x, group, fp8_max, pow2)
    eq, es = _quantize_activation_np(x.numpy(), group, fp8_max, pow2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert np.array_equal(_torch_fp8_bytes(q), eq)
    assert np.array_equal(_bits32(s.numpy()), _bits32(es))
    # saturation: never NaN, never beyond fp8_max
    qf = q.float()
    assert not torch.isnan(qf).any() and qf.abs().max() <= fp8_max
    # zero blocks: all +0 / −0 with the floor scale
    assert torch.all(q[0, :group].view(torch.uint8) == 0x00) and torch.all(q[1, :group].view(torch.uint8) == 0x80)
    floor = 1e-4 / fp8_max
    expect_floor = 2.0 ** math.ceil(math.log2(np.float32(np.float32(1e-4) / np.float32(fp8_max)))) if pow2 else floor
    assert s[0, 0].item() == pytest.approx(expect_floor, rel=1e-6)


def test_quantize_activation_saturates_without_pow2():
    # amax / (amax / 448) can exceed 448 by an ulp in float32; the clamp keeps it at 448, never NaN.
    x = torch.tensor([[3.0000002] + [0.1] * 31, [-1234.567] + [1.0] * 31])
    q, s = quantize_activation(x, 32, 448.0, pow2_scale=False)
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 448.0]


# ---------------------------------------------------------------------------------------------------------------
# fp4 e2m1
# ---------------------------------------------------------------------------------------------------------------
def test_e2m1_decode_all_16_codes():
    codes = np.arange(16, dtype=np.uint8)
    theirs = codes.view(E2M1).astype(np.float32)
    ours = e2m1_decode(torch.from_numpy(codes.copy())).numpy()
    assert np.array_equal(_bits32(ours), _bits32(theirs))  # includes −0 at code 8
    assert ours[:8].tolist() == list(formats.E2M1_VALUES)


def test_e2m1_encode_ties_saturation_and_signed_zero():
    grid = np.array(formats.E2M1_VALUES, dtype=np.float32)
    mid = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    x = _with_neighbours(np.concatenate([grid, mid, [6.5, 7.0, 100.0, 1e30, 1e-30, 0.1]]))
    ours = e2m1_encode(torch.from_numpy(x)).numpy()
    theirs = x.astype(E2M1).view(np.uint8) & 0x0F
    assert np.array_equal(ours, theirs)
    # spot checks of the rule itself: ties to even, saturation, −0
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -9.0, -0.0, -0.1])
    assert e2m1_encode(t).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 15, 8, 8]


def test_fp4_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x8F]]  # element k in byte k//2, low nibble for even k
    assert torch.equal(unpack_fp4(packed), codes)


def _quantize_weight_fp4_np(w: np.ndarray):
    """SPEC §1.2 fp4 rule in numpy: per 32-block s = 2^clamp(ceil(log2(amax/6)), −127, 127), q = e2m1(w / s)."""
    n, k = w.shape
    v = w.astype(np.float32).reshape(n, k // 32, 32)
    amax = np.abs(v).max(axis=-1)
    e = np.empty(amax.shape, dtype=np.int64)
    for idx, a in np.ndenumerate(amax):
        y = float(np.float32(a) / np.float32(6.0))
        if a == 0:
            e[idx] = -127
        else:
            m, ex = math.frexp(y)
            e[idx] = min(max(ex - 1 if m == 0.5 else ex, -127), 127)
    s = np.ldexp(np.float32(1.0), e).astype(np.float32)
    codes = (v / s[..., None]).astype(np.float32).astype(E2M1).view(np.uint8).reshape(n, k) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def test_quantize_weight_fp4_matches_numpy(rng):
    w = torch.randn(5, 256, generator=rng) * torch.logspace(-30, 3, 5).unsqueeze(1)
    w[0, :32] = 0.0  # zero block: scale byte 0, codes 0
    w[1, 32:64] = -0.0  # −0 block: sign kept (code 8)
    w[2, :32] = torch.linspace(-6.0, 6.0, 32) * 4  # amax = 6·2^2 exactly: no round-up
    w[3, 64:96] = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 0.25, 0.75, 1.75] * 4) * 2.0**-3  # ties, scaled
    q, s = quantize_weight_fp4(w)
    eq, es = _quantize_weight_fp4_np(w.numpy())
    assert q.dtype == torch.uint8 and s.dtype == torch.uint8 and q.shape == (5, 128) and s.shape == (5, 8)
    assert np.array_equal(q.numpy(), eq)
    assert np.array_equal(s.numpy(), es)
    assert s[0, 0] == 0 and torch.all(q[0, :16] == 0)
    assert torch.all(q[1, 16:32] == 0x88)
    assert s[2, 0] == 127 + 2


def test_dequantize_weight_fp4_matches_numpy(rng):
    q = torch.randint(0, 256, (3, 4, 64), dtype=torch.uint8, generator=rng)
    s = torch.randint(0, 255, (3, 4, 4), dtype=torch.uint8, generator=rng)
    qn, sn = q.numpy(), s.numpy()
    codes = np.stack([qn & 0x0F, qn >> 4], axis=-1).reshape(3, 4, 128)
    vals = codes.astype(np.uint8).view(E2M1).astype(np.float64)
    expect = vals * np.repeat(np.ldexp(1.0, sn.astype(np.int64) - 127), 32, axis=-1)
    ours = dequantize_weight_fp4(q, s)
    assert ours.dtype == torch.float32
    with np.errstate(over="ignore"):  # 6·2^127 overflows float32 to inf, in both
        expect32 = expect.astype(np.float32)
    assert np.array_equal(ours.numpy(), expect32)


def test_ue8m0_nan_byte_rejected():
    q = torch.zeros(2, 16, dtype=torch.uint8)
    s = torch.full((2, 1), 127, dtype=torch.uint8)
    s[1, 0] = 255
    with pytest.raises(ValueError, match=r"NaN byte 255 at flat index 1"):
        dequantize_weight_fp4(q, s)
    with pytest.raises(ValueError, match="255"):
        ue8m0_to_float(s.view(torch.float8_e8m0fnu))
    assert ue8m0_to_float(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-127, 1.0, 2.0**127]


def test_fp4_views_accepted(rng):
    w = torch.randn(2, 8, 64, generator=rng)
    q, s = quantize_weight_fp4(w)
    qv, sv = q.view(torch.float4_e2m1fn_x2), s.view(torch.float8_e8m0fnu)
    assert weight_format(qv) == "fp4" and weight_format(q) == "fp4"
    assert torch.equal(dequantize_weight(qv, sv), dequantize_weight(q, s))
    # UE8M0 decode agrees with torch's own float8_e8m0fnu decode for every non-NaN byte
    b = torch.arange(255, dtype=torch.uint8)
    assert torch.equal(ue8m0_to_float(b.view(torch.float8_e8m0fnu)), b.view(torch.float8_e8m0fnu).float())
    with pytest.raises(TypeError, match="weight dtype"):
        weight_format(torch.zeros(2, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------------------------
# fp8 weights and 128×128 block scales
# ---------------------------------------------------------------------------------------------------------------
def test_quantize_weight_fp8_is_per_row_128_blocks(rng):
    w = torch.randn(3, 16, 384, generator=rng)
    q, s = quantize_weight_fp8(w)
    assert q.shape == w.shape and s.shape == (3, 16, 3) and s.dtype == torch.float32
    eq, es = _quantize_activation_np(w.reshape(-1, 384).numpy(), 128, 448.0, True)
    assert np.array_equal(_torch_fp8_bytes(q).reshape(-1, 384), eq)
    assert np.array_equal(_bits32(s.reshape(-1, 3).numpy()), _bits32(es))
    expect = q.float().numpy() * np.repeat(s.numpy(), 128, axis=-1)
    assert np.array_equal(dequantize_weight_fp8(q, s).numpy(), expect)


def test_block_scale_expansion(rng):
    n, k = 200, 256  # N not a multiple of 128: the last block row is partial
    q = (torch.randn(2, n, k, generator=rng) * 50).to(torch.float8_e4m3fn)
    bs = torch.rand(2, math.ceil(n / 128), k // 128, generator=rng) + 0.5
    s = expand_block_scales(bs, n)
    assert s.shape == (2, n, k // 128)
    for e in range(2):
        for row in range(n):
            assert torch.equal(s[e, row], bs[e, row // 128])
    deq = dequantize_weight_fp8(q, s).numpy()
    qn, bn = q.float().numpy(), bs.numpy()
    ni, ki = np.meshgrid(np.arange(n) // 128, np.arange(k) // 128, indexing="ij")
    assert np.array_equal(deq, qn * bn[:, ni, ki])
