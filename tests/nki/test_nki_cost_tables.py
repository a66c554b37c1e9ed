"""The MBU tables of docs/backends/nki.md ("Estimated time") against the cost model they come from.

Checked: every cell parses (``bench/nki_cost_tables.parse_tables``); no figure exceeds its chip's ceiling, derived
from tools/nki_interpreter/cost.py's constants (a DMA-bound kernel moves its bytes at most at the DMA engines'
peak, so MBU ≤ min(1, DMA peak / HBM share): trn2 100 %, trn3 528 / 587.5 = 89.9 %), and the doc states those
ceilings; a cell is bold iff its figure is ≥ 60; the tables cover every (model, pair, target) row at both LNCs;
and the bench recomputes the Qwen3-30B-A3B bf16 × bf16 trn2 EP 8 T = 1 cells (three interpreter runs each).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from static_moe.nki import shim

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "backends" / "nki.md"


@pytest.fixture(scope="module")
def bench():
    """bench/ on sys.path (the scripts import ``harness`` from there): the table module and the bench."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_nki_gemm
        import nki_cost_tables

        yield nki_cost_tables, bench_nki_gemm
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def rows(bench):
    tables, _ = bench
    out = tables.parse_tables(DOC.read_text())
    assert out, f"no MBU table (header {tables.HEAD!r}) in {DOC}"
    return out


def _ceiling(target: str) -> float:
    """MBU ceiling in %, from the cost model: HBM time ≥ ideal bytes / HBM share, DMA time ≥ bytes / DMA peak."""
    import nki_interpreter as interpreter

    m = interpreter.model_for(target)
    return 100 * min(1.0, m.dma_bandwidth / m.hbm_bandwidth_per_core)


def test_ceilings_are_the_documented_ones():
    assert _ceiling("trn2") == 100.0
    assert f"{_ceiling('trn3'):.1f}" == "89.9"
    text = " ".join(DOC.read_text().split())  # prose wraps lines
    assert "100 % on trn2" in text and f"{_ceiling('trn3'):.1f} % on trn3" in text


def test_no_figure_exceeds_its_chip_ceiling(rows):
    for r in rows:
        ceiling = _ceiling(r["target"])
        for point, c in r["cells"].items():
            # figures are rounded down (nki_cost_tables.figure): f stands for a value in [f, f + 1)
            assert c["figure"] <= ceiling, (r["model"], r["pair"], r["target"], r["lnc"], point, c)


def test_bold_iff_at_least_60(rows, bench):
    tables, _ = bench
    for r in rows:
        for point, c in r["cells"].items():
            assert c["bold"] == (c["figure"] >= tables.GOAL), (r["model"], r["pair"], r["target"], point, c)


def test_tables_cover_every_row(rows, bench):
    """The three models for each tabulated (pair, target), at LNC = 1 and 2; the bound is a cost component."""
    tables, b = bench
    keys = {(r["model"], r["pair"], r["target"], r["lnc"]) for r in rows}
    assert len(keys) == len(rows), "a row appears twice"
    for pair, target in (("bf16×bf16", "trn2"), ("fp8×fp8", "trn2"), ("fp8×fp8", "trn3")):
        for lnc in (1, 2):
            for model in tables.MODELS:
                assert (model, pair, target, lnc) in keys, (model, pair, target, lnc)
    components = {c[:-2] for c in b.COMPONENTS}
    assert all(c["bound"] in components for r in rows for c in r["cells"].values())


@pytest.mark.skipif(shim.real_nki_available(), reason="the figures come from the interpreter's cost model")
@pytest.mark.parametrize("lnc", [1, 2])
def test_bench_recomputes_a_cell(rows, bench, lnc):
    """Qwen3-30B-A3B, bf16 × bf16, trn2, EP 8, T = 1 (R = 8 rows, 16 local experts): the bench's figure and
    bound are the table's."""
    tables, b = bench
    shape, ep, t, target = b.MODEL_SHAPES["qwen3_30b_a3b"], 8, 1, "trn2"
    with b.interpreter.target(target):
        rec = b.measure_local_experts(
            shape, "bf16", "bf16", ep * t, b.chunk_for(shape, "bf16", "bf16", target, ep * t), lnc
        )
    got = b.row_local_experts(shape, "bf16", "bf16", t, ep, rec, target)
    (row,) = [
        r
        for r in rows
        if (r["model"], r["pair"], r["target"], r["lnc"]) == (tables.MODELS[2], "bf16×bf16", target, lnc)
    ]
    want = row["cells"][(ep, t)]
    assert got["lnc"] == lnc
    assert (tables.figure(got["fraction"]), got["bound"]) == (want["figure"], want["bound"])
