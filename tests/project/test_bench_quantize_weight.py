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
