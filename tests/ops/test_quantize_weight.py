"""quantize_weight: the CPU kernel vs the Python quantizers (static_moe.formats, the reference) bit for bit, on
every CPU instruction set, over random weights and the edge cases of the formats (zeros and signed zeros,
subnormals, amax exactly at a power of two, the largest and smallest scales, e2m1 / e4m3 rounding midpoints), the
non-finite refusal, and argument errors (SPEC §1.10, §5)."""

from __future__ import annotations

import math

import pytest
import torch

import static_moe  # noqa: F401  (registers the ops)
from static_moe import reference
from static_moe.ops import quantize_weight

FORMATS = ("fp8", "fp4")
IN_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _assert_bitwise(out, ref, what=""):
    (q, s), (rq, rs) = out, ref
    assert q.dtype == rq.dtype and s.dtype == rs.dtype, f"{what}: dtypes {q.dtype}/{s.dtype} vs {rq.dtype}/{rs.dtype}"
    assert q.shape == rq.shape and s.shape == rs.shape, f"{what}: shapes {q.shape}/{s.shape} vs {rq.shape}/{rs.shape}"
    qb, rqb = q.view(torch.uint8), rq.view(torch.uint8)
    bad_q = (qb != rqb).nonzero()
    assert bad_q.numel() == 0, f"{what}: {bad_q.shape[0]} weight bytes differ, first at {bad_q[0].tolist()}"
    sb = s.view(torch.int32) if s.dtype == torch.float32 else s
    rsb = rs.view(torch.int32) if rs.dtype == torch.float32 else rs
    bad_s = (sb != rsb).nonzero()
    assert bad_s.numel() == 0, f"{what}: {bad_s.shape[0]} scales differ, first at {bad_s[0].tolist()}"


def _edge_rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of K values that each hit one edge of the quantizers, in the input dtype."""
    f32 = torch.finfo(torch.float32)
    fin = torch.finfo(dtype)
    rows = [
        torch.zeros(k),
        -torch.zeros(k),  # signed zeros: e2m1 keeps the sign (code 8), e4m3 too
        torch.full((k,), fin.smallest_normal),
        torch.full((k,), fin.smallest_normal / 4),  # subnormal in the input dtype
        torch.full((k,), fin.max),  # the largest scale
        torch.full((k,), -fin.max),
        torch.full((k,), 6.0),  # amax / 6 exactly a power of two: the scale is kept, not rounded up
        torch.full((k,), 448.0),
        torch.full((k,), 1e-4),  # the fp8 amax floor
        torch.full((k,), 5e-5),  # below the floor
        torch.linspace(-6.5, 6.5, k),  # every e2m1 midpoint region at scale 1
        torch.linspace(-464.0, 464.0, k),  # e4m3 saturation boundary
        torch.arange(k, dtype=torch.float32) * 0.25 - 4.0,  # e2m1 ties (0.25, 0.75, 1.25 ...) at exact multiples
    ]
    if dtype == torch.float32:
        rows += [
            torch.full((k,), f32.smallest_normal * 2**-23),  # the smallest subnormal: amax / 6 rounds to 0
            torch.full((k,), f32.smallest_normal * 3 * 2**-23),
            torch.full((k,), f32.smallest_normal * 5 * 2**-23),
            torch.full((k,), f32.smallest_normal * 0.75),  # amax / 6 in (2^-127, 2^-126): exponent -126
            torch.full((k,), f32.smallest_normal * 3),  # 2^-126 · 3 / 6 = 2^-127: exactly the smallest scale
        ]
    m = torch.stack(rows)
    # Mix in one large value per block in some rows so blocks differ in scale inside a row.
    lo, hi = math.log10(fin.smallest_normal) + 2, math.log10(fin.max) - 2
    mixed = (torch.randn(4, k, dtype=torch.float64) * torch.logspace(lo, hi, 4, dtype=torch.float64)[:, None]).float()
    return torch.cat((m, mixed)).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_bitwise_random_and_edges(cpu_isa, fmt, dtype, rng):
    """Random weights over many magnitudes, 3-D (experts) and 2-D, plus every edge row: equal to the reference
    bit for bit on this instruction set."""
    for shape, spread in (((3, 40, 256), 1.0), ((17, 384), 1e-3), ((2, 5, 128), 300.0)):
        w = (torch.randn(*shape, generator=rng) * spread * torch.rand(*shape[:-1], 1, generator=rng) * 4).to(dtype)
        _assert_bitwise(quantize_weight(w, fmt), reference.quantize_weight(w, fmt), f"{fmt} {shape} x{spread}")
    e = _edge_rows(256, dtype)
    _assert_bitwise(quantize_weight(e, fmt), reference.quantize_weight(e, fmt), f"{fmt} edge rows")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bf16_value(fmt):
    """Every finite bf16 bit pattern once, in blocks whose amax sweeps the whole exponent range (blocks of values
    in sorted bit order, so scales go from the smallest to the largest)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    w = bits[torch.isfinite(bits.float())]
    block = 128 if fmt == "fp8" else 32
    w = w[: w.numel() // block * block].reshape(-1, 2 * block)[: (w.numel() // (2 * block))]
    _assert_bitwise(quantize_weight(w, fmt), reference.quantize_weight(w, fmt), f"{fmt} all bf16")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused_naming_the_block(fmt, bad):
    """NaN / ±Inf raise ValueError naming w, the count of bad blocks and the first one's index, as the reference
    does (same index)."""
    w = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    w[1, 3, 200] = bad
    w[1, 5, 7] = bad
    block = 128 if fmt == "fp8" else 32
    first = [1, 3, 200 // block]
    with pytest.raises(ValueError, match=r"quantize_weight: w holds NaN or Inf in 2 block\(s\)") as e:
        quantize_weight(w, fmt)
    assert f"= {first}" in str(e.value)
    with pytest.raises(ValueError, match=r"holds NaN or Inf in 2 block\(s\)") as r:
        reference.quantize_weight(w, fmt)
    assert f"= {first}" in str(r.value)


def test_parallel_matches_serial_and_threads(monkeypatch):
    """Many rows (the OpenMP path) give the same bits as the reference and as one thread."""
    w = torch.randn(4, 256, 512, dtype=torch.bfloat16)
    for fmt in FORMATS:
        many = quantize_weight(w, fmt)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one = quantize_weight(w, fmt)
        finally:
            torch.set_num_threads(old)
        _assert_bitwise(many, one, f"{fmt} threads")
        _assert_bitwise(many, reference.quantize_weight(w, fmt), f"{fmt} parallel")


def test_non_contiguous_and_empty():
    w = torch.randn(256, 64, dtype=torch.bfloat16).t()  # [64, 256] with a column stride
    for fmt in FORMATS:
        _assert_bitwise(quantize_weight(w, fmt), reference.quantize_weight(w.contiguous(), fmt), f"{fmt} strided")
        q, s = quantize_weight(torch.empty(0, 3, 128), fmt)
        assert q.shape[:2] == (0, 3) and s.shape[:2] == (0, 3)


@pytest.mark.parametrize(
    "args, exc, msg",
    [
        ((torch.randn(4, 96), "fp8"), ValueError, r"w.size\(-1\) = K must be a multiple of 128"),
        ((torch.randn(4, 48), "fp4"), ValueError, r"multiple of 32"),
        ((torch.randn(128), "fp8"), ValueError, r"w must have at least 2 dims"),
        ((torch.randn(4, 128), "bf16"), ValueError, r'weight_format must be "fp8" or "fp4"'),
        ((torch.randn(4, 128).double(), "fp8"), TypeError, r"w must have dtype"),
        ((torch.zeros(4, 128, dtype=torch.uint8), "fp4"), TypeError, r"w must have dtype"),
    ],
)
def test_rejects(args, exc, msg):
    with pytest.raises(exc, match=msg):
        quantize_weight(*args)
    # the fake kernel runs the same checks (traced graphs reject the same inputs)
    with pytest.raises(exc, match=msg), torch._subclasses.FakeTensorMode() as mode:
        quantize_weight(mode.from_tensor(args[0]), args[1])


def test_compiles_fullgraph():
    w = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    f = torch.compile(lambda t: quantize_weight(t, "fp4"), fullgraph=True, backend="eager")
    _assert_bitwise(f(w), reference.quantize_weight(w, "fp4"), "compiled")


def test_quantize_weight_fast_is_the_reference_with_progress_and_log(capsys, caplog):
    """The loaders' entry point: the reference's bits and errors, a progress bar when asked, a log record."""
    from static_moe.ops.quantize_weight import quantize_weight_fast

    w = torch.randn(3, 64, 256, dtype=torch.bfloat16)
    for fmt in ("bf16", *FORMATS):
        got, want = quantize_weight_fast(w, fmt, name="w13"), static_moe.formats.quantize_weight(w, fmt, name="w13")
        if fmt == "bf16":
            assert torch.equal(got[0], want[0]) and got[1] is None
        else:
            _assert_bitwise(got, want, f"fast {fmt}")
    with caplog.at_level("DEBUG", logger="static_moe"):
        quantize_weight_fast(w[0], "fp4", name="shared", progress=True)
    assert "static_moe: quantizing shared to fp4" in capsys.readouterr().err
    assert any("quantized shared [64, 256] to fp4" in r.getMessage() for r in caplog.records)
    w[2, 5, 7] = float("nan")
    with pytest.raises(
        ValueError, match=r"quantize_weight_fp8: w13 holds NaN or Inf in 1 block\(s\); .* = \[2, 5, 0\]"
    ):
        quantize_weight_fast(w, "fp8", name="w13")
