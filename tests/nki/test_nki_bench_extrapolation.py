"""bench/bench_nki_gemm.py's cost extrapolation (bench/harness/nki_extrapolate.py) on a tiny layer.

The NKI cost tables of docs/backends/nki.md come from 1- and 2-expert runs of ``local_experts`` extrapolated to
the full layer. Checked here: that the features-based estimate is ``CostModel.estimate_programs`` (the model
in tools/nki_interpreter/cost.py, so the two cannot drift apart), at LNC = 1 and 2 on both targets; and that
the extrapolation of a 4-expert, 3-item layer equals the layer run directly, feature by feature, on each core
and each stretch between barriers. Interpreter runs at H = 256, I = 128: seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from static_moe.nki import shim

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = pytest.mark.skipif(shim.real_nki_available(), reason="costs come from the interpreter's record")

# Tiny model: H, I multiples of 128; 16 global experts top-4, so M = chunk_rows_for(R, 4, 16) stays small.
TINY = SimpleNamespace(name="tiny", hidden=256, intermediate=128, topk=4, num_experts=16)


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_nki_gemm

        yield bench_nki_gemm
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("act,wfmt", [("bf16", "bf16"), ("fp8", "fp8")])
def test_features_estimate_is_the_cost_model(bench, lnc, target, act, wfmt):
    """``nx.estimate(launch_features(records))`` equals ``CostModel.estimate_programs(records)``."""
    from harness import nki_extrapolate as nx

    import nki_interpreter as interpreter

    rows = 8
    m = bench.chunk_for(TINY, act, wfmt, target, rows)
    with interpreter.target(target):
        args = bench._le_args(TINY, act, wfmt, rows, 3, [0, 2, 2], target=target)
        launch = shim.jit(bench.local_experts_kernel)[lnc] if lnc == 2 else bench.local_experts_kernel
        interpreter.simulate(launch)(*args, skip_unrouted=True, chunk_rows=m, weight_layout="eio")
    info = interpreter.last_run()
    model = interpreter.model_for(target)
    assert len(info.programs) == lnc
    want = model.estimate_programs(info.programs)
    got = nx.estimate(model, nx.launch_features(model, info.programs))
    assert got["programs"] == want["programs"] == lnc
    assert got["bound"] == want["bound"]
    for key in ("time_s", "serial_s", *nx.COMPONENTS):
        assert got[key] == pytest.approx(want.get(key, 0.0), rel=1e-12, abs=1e-15), key
    assert got["hbm_bytes"] == sum(r.hbm_bytes for r in info.programs)
    if lnc == 2:  # the barrier cuts each core's record in two
        assert len(got["segments_s"]) == 2 and want["time_s"] > max(got["segments_s"][0])


@pytest.mark.parametrize("lnc", [1, 2])
def test_extrapolation_equals_direct_run(bench, lnc):
    """A 4-expert layer with 3 one-item experts (LNC = 2: 2 items on core 0, 1 on core 1), extrapolated from the
    1-/2-expert runs, equals that layer run directly in every feature of every core and segment."""
    from harness import nki_extrapolate as nx

    act, wfmt, rows, target = "fp8", "fp8", 8, "trn2"
    m = bench.chunk_for(TINY, act, wfmt, target, rows)
    with bench.interpreter.target(target):
        rec = bench.measure_local_experts(TINY, act, wfmt, rows, m, lnc)
        direct = bench._profile(
            bench.local_experts_kernel,
            *bench._le_args(TINY, act, wfmt, rows, 4, [0, 1, 3], target=target),
            lnc=lnc,
            skip_unrouted=True,
            chunk_rows=m,
            weight_layout="eio",
        )
    pred = bench.extrapolate(rec, 4, 3)["launch"]
    assert len(pred) == len(direct["launch"]) == lnc
    for core_p, core_d in zip(pred, direct["launch"]):
        assert len(core_p) == len(core_d)
        for seg_p, seg_d in zip(core_p, core_d):
            for k in nx.FEATURES:
                assert seg_p[k] == pytest.approx(seg_d[k], rel=1e-12, abs=1e-15), k
    assert direct["launch"][0][0]["dma_count"] > 0
