"""pack_rows / unpack_rows NKI kernels vs the reference (SPEC §1.8, §2: bitwise equal).

Runs through ``static_moe.nki.shim.simulate``: the real NKI simulator when ``nki`` is importable, our
interpreter otherwise. Shapes come from hypothesis: ragged row counts (T not a multiple of 128), capacities
with tiles that are all padding, parts of every width class (below, at and above 16-byte alignment).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from static_moe.nki import shim
from static_moe.nki_kernels.pack_rows import pack_rows, unpack_rows
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.reference.pack_rows import pack_rows as ref_pack_rows
from static_moe.reference.pack_rows import unpack_rows as ref_unpack_rows
from static_moe.testing.numeric import assert_equal

PART_DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32, torch.uint8]


def _part(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(rows, cols, generator=g) * 4).to(dtype)
    hi = 256 if dtype == torch.uint8 else 1000
    lo = 0 if dtype == torch.uint8 else -1
    return torch.randint(lo, hi, (rows, cols), generator=g).to(dtype)


def _roundtrip(parts: tuple, capacity: int) -> None:
    packed = shim.simulate(pack_rows)(parts, capacity)
    ref = ref_pack_rows(list(parts), capacity)
    assert_equal(packed, ref, "pack_rows")
    spans, _ = pack_layout([part_nbytes(p) for p in parts])
    for i, (p, (off, n)) in enumerate(zip(parts, spans)):
        out = shim.simulate(unpack_rows)(packed, off, n, shim.nl_dtype(p.dtype), tuple(p.shape[1:]))
        assert_equal(out, ref_unpack_rows(packed, off, n, p.dtype, list(p.shape[1:])), f"unpack part {i}")
        assert_equal(out[: p.shape[0]], p, f"unpack part {i} valid rows")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 260),
    pad=st.integers(0, 200),
    cols=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from(PART_DTYPES), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_matches_reference(rows, pad, cols, dtypes, seed):
    g = torch.Generator().manual_seed(seed)
    parts = tuple(_part(rows, c, d, g) for c, d in zip(cols, dtypes))
    _roundtrip(parts, rows + pad)


def test_decode_layout_v4_flash_shape():
    """The layout forward uses: fp8 x [T, H], fp32 x_s [T, H/128], int32 ids [T, k], fp32 weights [T, k]."""
    g = torch.Generator().manual_seed(0)
    t, cap, h, k = 37, 128, 4096, 6
    x = (torch.randn(t, h, generator=g) * 3).to(torch.float8_e4m3fn)
    xs = torch.rand(t, h // 128, generator=g)
    ids = torch.randint(-1, 256, (t, k), generator=g, dtype=torch.int32)
    w = torch.rand(t, k, generator=g)
    _roundtrip((x, xs, ids, w), cap)


def test_multi_dim_part_and_padding_reads_as_minus_one_and_nan():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (3, 2, 3), generator=g, dtype=torch.int32)  # trailing shape (2, 3)
    w = torch.rand(3, 5, generator=g)
    packed = shim.simulate(pack_rows)((ids, w), 130)
    assert_equal(packed, ref_pack_rows([ids, w], 130))
    spans, _ = pack_layout([part_nbytes(ids), part_nbytes(w)])
    out_ids = shim.simulate(unpack_rows)(packed, spans[0][0], spans[0][1], shim.nl_dtype(torch.int32), (2, 3))
    out_w = shim.simulate(unpack_rows)(packed, spans[1][0], spans[1][1], shim.nl_dtype(torch.float32), (5,))
    assert out_ids.shape == (130, 2, 3)
    assert bool((out_ids[3:] == -1).all()) and bool(torch.isnan(out_w[3:]).all())


@pytest.mark.skipif(shim.real_nki_available(), reason="interpreter-specific cost check")
def test_pack_cost_is_one_wide_dma_per_row_tile():
    """Staging through SBUF: each 128-row tile leaves in one DMA of W bytes per partition."""
    import nki_interpreter as interpreter

    g = torch.Generator().manual_seed(2)
    x = _part(128, 4096, torch.float8_e4m3fn, g)
    ids = _part(128, 6, torch.int32, g)
    shim.simulate(pack_rows)((x, ids), 256)
    cost = interpreter.last_run().cost
    width = 4096 + 32
    wide = [d for d in cost.dmas if d.partition_bytes == width and d.hbm_bytes == 128 * width]
    assert len(wide) == 2, cost.summary()  # one valid tile and one padding tile, each a full [128, W] write
    assert cost.hbm_bytes == 2 * 128 * width + 128 * (4096 + 24)


@pytest.mark.skipif(
    not shim.real_nki_available(),
    reason="real nki (Neuron SDK >= 2.29) is not importable here; "
    "the interpreter runs these kernels in the tests above",
)
def test_real_nki_simulator_runs_pack_kernels(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    g = torch.Generator().manual_seed(3)
    _roundtrip((_part(5, 64, torch.float8_e4m3fn, g), _part(5, 6, torch.int32, g)), 130)
