"""pack_rows / unpack_rows: the registered kernel (CPU here) vs the reference, bitwise (SPEC §1.8, §2), plus
opcheck, torch.compile, and argument errors (SPEC §5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import static_moe
from static_moe import reference
from static_moe.packed_layout import pack_layout, part_nbytes
from static_moe.testing.numeric import assert_equal

DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64, torch.uint8, torch.int16]


def _random_part(rows: int, row_shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as dtype (NaN payloads and all), shape [rows, *row_shape]."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for d in row_shape:
        n *= d
    if n == 0:
        return torch.empty((rows, *row_shape), dtype=dtype)
    raw = torch.randint(0, 256, (rows, n * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(rows, *row_shape)


part_spec = st.tuples(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 9), min_size=0, max_size=2).map(tuple),
)


@settings(max_examples=40)
@given(
    specs=st.lists(part_spec, min_size=1, max_size=4),
    capacity=st.integers(0, 12),
    rows_pick=st.integers(0, 12),
    seed=st.integers(0, 2**31 - 1),
)
# Edge cases by name, outside the random budget: C = 0; T = 0 (padding only); T = C with widths that are multiples
# of 16 (no gap anywhere); zero-width parts between others; the forward's fp8 row (x, scales, ids, weights).
@example(specs=[(torch.float32, (4,))], capacity=0, rows_pick=0, seed=0)
@example(specs=[(torch.int32, (3,)), (torch.float32, (3,))], capacity=5, rows_pick=0, seed=1)
@example(specs=[(torch.bfloat16, (8,)), (torch.int64, (2,)), (torch.uint8, (16,))], capacity=7, rows_pick=7, seed=2)
@example(specs=[(torch.int16, (3,)), (torch.float32, (0,)), (torch.uint8, (1,))], capacity=4, rows_pick=3, seed=3)
@example(
    specs=[(torch.float8_e4m3fn, (9, 9)), (torch.float32, (2,)), (torch.int32, (6,)), (torch.float32, (6,))],
    capacity=12,
    rows_pick=12,
    seed=4,
)
def test_pack_unpack_match_reference(specs, capacity, rows_pick, seed):
    rows = rows_pick % (capacity + 1)
    gen = torch.Generator().manual_seed(seed)
    parts = [_random_part(rows, shape, dtype, gen) for dtype, shape in specs]
    packed = static_moe.pack_rows(parts, capacity)
    assert_equal(packed, reference.pack_rows(parts, capacity), "pack_rows")
    spans, width = pack_layout([part_nbytes(p) for p in parts])
    assert packed.shape == (capacity, width) and all(off % 16 == 0 for off, _ in spans)
    assert bool((packed[rows:] == 0xFF).all()), "padded rows must be 0xFF"
    for p, (off, n) in zip(parts, spans):
        out = static_moe.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:]))
        assert_equal(out, reference.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:])), "unpack_rows")
        assert_equal(out[:rows], p, "round trip")


def test_large_pack_uses_threads_and_matches(rng):
    # capacity·W above the OpenMP threshold (64 KiB)
    x = _random_part(300, (1024,), torch.float8_e4m3fn, rng)
    s = _random_part(300, (8,), torch.float32, rng)
    idx = _random_part(300, (6,), torch.int32, rng)
    w = _random_part(300, (6,), torch.float32, rng)
    parts = [x, s, idx, w]
    packed = static_moe.pack_rows(parts, 512)
    assert_equal(packed, reference.pack_rows(parts, 512))
    spans, _ = pack_layout([part_nbytes(p) for p in parts])
    for p, (off, n) in zip(parts, spans):
        assert_equal(static_moe.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:]))[:300], p)


def test_unpack_from_strided_views(rng):
    packed = torch.randint(0, 256, (10, 96), dtype=torch.uint8, generator=rng)
    wide = torch.randint(0, 256, (10, 160), dtype=torch.uint8, generator=rng)
    wide[:, 32:128] = packed
    view = wide[:, 32:128]  # row stride 160, unit column stride
    col_strided = packed.t().contiguous().t()  # column stride != 1
    for src in (view, col_strided, packed[3:7]):
        out = static_moe.unpack_rows(src, 16, 32, torch.float32, [2, 4])
        assert_equal(out, reference.unpack_rows(src.contiguous(), 16, 32, torch.float32, [2, 4]))


def test_unpack_returns_fresh_tensor():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    out = static_moe.unpack_rows(packed, 0, 16, torch.uint8, [16])
    out.fill_(7)
    assert bool((packed == 0).all())
    assert out.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()


def test_zero_width_and_zero_capacity():
    empty = torch.zeros(0, 0, dtype=torch.float32)
    assert static_moe.pack_rows([empty], 0).shape == (0, 0)
    p = static_moe.pack_rows([torch.zeros(2, 0), torch.ones(2, 3, dtype=torch.int16)], 3)
    assert_equal(p, reference.pack_rows([torch.zeros(2, 0), torch.ones(2, 3, dtype=torch.int16)], 3))
    assert static_moe.unpack_rows(p, 0, 0, torch.float32, [0]).shape == (3, 0)


def _samples():
    """Finite values (opcheck compares outputs without equal_nan), padded rows aside."""
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(5, 32, generator=g).to(torch.bfloat16),
        torch.randint(-1, 8, (5, 3), dtype=torch.int32),
        torch.rand(5, 3, generator=g),
    ]
    return parts, static_moe.pack_rows(parts, 8)


def test_opcheck():
    parts, packed = _samples()
    torch.library.opcheck(torch.ops.static_moe.pack_rows.default, (parts, 8))
    torch.library.opcheck(torch.ops.static_moe.pack_rows.default, ([parts[1][:0]], 4))
    torch.library.opcheck(torch.ops.static_moe.unpack_rows.default, (packed, 64, 12, torch.int32, [3]))
    torch.library.opcheck(torch.ops.static_moe.unpack_rows.default, (packed[:5], 0, 64, torch.bfloat16, [2, 16]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dynamic):
    """dynamic=True traces symbolic sizes: the fake kernel then computes shapes without the C++ checks."""
    parts, _ = _samples()

    def f(x, idx, w):
        packed = static_moe.pack_rows([x, idx, w], 8)
        return (
            packed,
            static_moe.unpack_rows(packed, 64, 12, torch.int32, [3]),
            static_moe.unpack_rows(packed, 80, 12, torch.float32, [3]),
        )

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, dynamic=dynamic)(*parts)
    for a, b in zip(got, f(*parts)):
        assert_equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# Argument errors: eager kernel and fake kernel (trace) give the same messages
# ---------------------------------------------------------------------------------------------------------------
BAD_PACK = [
    (lambda: ([torch.zeros(9, 4)], 8), ValueError, r"T = 9 rows \(parts\[0\]\.size\(0\)\) exceed capacity = 8"),
    (
        lambda: ([torch.zeros(5, 4), torch.zeros(4, 2)], 8),
        ValueError,
        r"parts\[1\]\.size\(0\) must be T = parts\[0\]\.size\(0\) = 5, got 4",
    ),
    (lambda: ([], 8), ValueError, r"parts must hold at least one tensor"),
    (lambda: ([torch.zeros(())], 8), ValueError, r"parts\[0\] must be at least 1-D"),
    (lambda: ([torch.zeros(2, 4)], -1), ValueError, r"capacity must be >= 0, got -1"),
    (
        lambda: ([torch.zeros(2, 4), torch.zeros(2, 4, device="meta")], 8),
        ValueError,
        r"parts\[1\] must be on the same device as parts\[0\] \(cpu\), got meta",
    ),
]


@pytest.mark.parametrize("make,exc,msg", BAD_PACK)
def test_pack_rows_rejects(make, exc, msg):
    parts, capacity = make()
    before = [p.clone() for p in parts if p.device.type == "cpu"]
    with pytest.raises(exc, match=msg):
        static_moe.pack_rows(parts, capacity)
    assert all(torch.equal(a, b) for a, b in zip(before, [p for p in parts if p.device.type == "cpu"]))


BAD_UNPACK = [
    (
        lambda: (torch.zeros(4, 32), 0, 8, torch.int32, [2]),
        TypeError,
        r"packed must have dtype torch\.uint8, got torch\.float32",
    ),
    (
        lambda: (torch.zeros(32, dtype=torch.uint8), 0, 8, torch.int32, [2]),
        ValueError,
        r"packed must be 2-D \[R, W\], got 1-D",
    ),
    (
        lambda: (torch.zeros(4, 32, dtype=torch.uint8), 16, 32, torch.int32, [8]),
        ValueError,
        r"span \[offset, offset \+ nbytes\) = \[16, 48\) must lie inside the packed row width W = packed\.size\(1\) = 32",
    ),
    (lambda: (torch.zeros(4, 32, dtype=torch.uint8), -16, 8, torch.int32, [2]), ValueError, r"must lie inside"),
    (
        lambda: (torch.zeros(4, 32, dtype=torch.uint8), 0, 12, torch.float32, [2]),
        ValueError,
        r"nbytes must equal prod\(row_shape\) \* itemsize = prod\(\[2\]\) \* 4 = 8 for torch\.float32, got 12",
    ),
    (
        lambda: (torch.zeros(4, 32, dtype=torch.uint8), 0, 8, torch.int32, [-2]),
        ValueError,
        r"row_shape must be non-negative",
    ),
]


@pytest.mark.parametrize("make,exc,msg", BAD_UNPACK)
def test_unpack_rows_rejects(make, exc, msg):
    args = make()
    with pytest.raises(exc, match=msg):
        static_moe.unpack_rows(*args)


def test_fake_kernels_reject_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"T = 9 rows .* exceed capacity = 8"):
            torch.ops.static_moe.pack_rows([torch.empty(9, 4)], 8)
        with pytest.raises(ValueError, match=r"nbytes must equal"):
            torch.ops.static_moe.unpack_rows(torch.empty(4, 32, dtype=torch.uint8), 0, 12, torch.float32, [2])
        ok = torch.ops.static_moe.pack_rows([torch.empty(3, 5), torch.empty(3, 2, dtype=torch.int32)], 8)
        assert ok.shape == (8, 48) and ok.dtype == torch.uint8

    def f(x):
        return static_moe.pack_rows([x], 8)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"T = 9 rows .* exceed capacity = 8"):
        torch.compile(f, fullgraph=True)(torch.zeros(9, 4))


def test_full_capacity_with_no_alignment_gaps_threaded(rng):
    """T = C (no padding rows) and parts whose widths are multiples of 16 (no alignment gap, no trailing gap), on
    the threaded path (C·W ≥ 64 KiB): every byte of the packed buffer belongs to a part, so a copy one byte too
    long or short, or a row written by the wrong thread, shows as a byte that differs — and the copy of the last
    part of the last row ends exactly at the end of the buffer (AddressSanitizer catches one byte more; see
    `make asan`)."""
    capacity = 40
    parts = [
        _random_part(capacity, (1024,), torch.bfloat16, rng),
        _random_part(capacity, (16,), torch.float32, rng),
        _random_part(capacity, (4,), torch.int32, rng),
        _random_part(capacity, (4,), torch.float32, rng),
    ]
    spans, width = pack_layout([part_nbytes(p) for p in parts])
    assert width == sum(n for _, n in spans) and capacity * width >= 1 << 16, "no gaps, threaded"
    packed = static_moe.pack_rows(parts, capacity)
    assert_equal(packed, torch.cat([p.reshape(capacity, -1).view(torch.uint8) for p in parts], dim=1), "pack_rows")
    for p, (off, n) in zip(parts, spans):
        assert_equal(static_moe.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:])), p, "unpack_rows")
    # unpack straight from the end of a buffer: the last span's last row ends at the buffer's last byte
    tail = packed[:, spans[-1][0] :]
    assert_equal(static_moe.unpack_rows(tail, 0, spans[-1][1], torch.float32, [4]), parts[-1], "unpack at the end")
