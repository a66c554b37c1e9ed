"""Smoke test of bench/bench_quantize_weight.py on a tiny shape: it runs, checks the op against the reference bit
for bit, and reports the fields docs and commit messages quote. Correctness only: nothing here asserts a timing."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def test_bench_quantize_weight_runs(capsys):
    sys.path.insert(0, str(BENCH_DIR))
    try:
        bench = importlib.import_module("bench_quantize_weight")
    finally:
        sys.path.remove(str(BENCH_DIR))
    recs = bench.run(experts=2, n=64, k=256, repeat=1)
    assert [r["fmt"] for r in recs] == ["bf16→fp8", "bf16→fp4"]
    for r in recs:
        assert r["op_s"] > 0 and r["copy_s"] > 0 and r["fraction_of_copy"] > 0 and r["speedup_vs_reference"] > 0
    assert "% of copy" in capsys.readouterr().out


def test_run_all_section_fills_the_common_table(capsys, monkeypatch):
    """run_all's quantize_weight section: one record per (shape, format) in the common table, bitwise parity with
    the reference, its bandwidth over a same-round copy's, and the ≥ 25 %-of-copy target line."""
    from static_moe.testing import generators
    from static_moe.testing.machine import MachineLimits

    # A tiny shape under a real key (the section reads H and I from MODEL_SHAPES; --quick keeps 2 experts).
    monkeypatch.setitem(generators.MODEL_SHAPES, "qwen3_30b_a3b", generators.ModelShape("tiny", 256, 128, 8, 2))
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("bench_quantize_weight")
    run_all = importlib.import_module("run_all")
    report = importlib.import_module("harness.report").Report(MachineLimits(2, 1e10, 1e11, 0, 0, 0))
    recs = bench.run_report(report, ["qwen3_30b_a3b"], [1], quick=True)
    assert [r["fmt"] for r in recs] == ["bf16→fp8", "bf16→fp4"]
    for r in recs:
        assert r["op"]["available"] and r["op"]["parity"] == "bitwise", r["op"]
        assert r["copy_fraction"] > 0 and r["bytes"] > 0 and r["bound"] == "memory"
        assert r["baselines"]["torch_ref"]["available"] is False
    table = report.table()
    assert "quantize_weight" in table and "bf16→fp4" in table
    rows = [t for t in run_all.same_round_targets(report) if t["what"].startswith("quantize_weight")]
    assert len(rows) == 1 and rows[0]["target"] == bench.COPY_TARGET
    assert rows[0]["min"] == min(r["copy_fraction"] for r in recs)
    assert "% of a plain copy's bandwidth" in capsys.readouterr().out
