"""Smoke test of the benchmark suite (bench/): the baselines compute the reference's maths on a tiny shape, the
bytes/FLOPs accounting follows the roofline rules, the scaled-down routing keeps real rows per expert, and the
harness's timer / table / JSON work end to end. Correctness only: nothing here asserts a timing."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from static_moe import reference
from static_moe.testing.generators import (
    FORMAT_PAIRS,
    MODEL_SHAPES,
    make_activations,
    make_routing,
    make_weights,
    sliced_routing,
)
from static_moe.testing.machine import MachineLimits
from static_moe.testing.numeric import calc_diff

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    """bench/harness/ (its modules as attributes of one namespace) and bench/baselines.py, imported from bench/'s
    folder as the scripts do (bench/ holds scripts, not a package)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        names = ("checks", "costs", "report", "routing", "timing")
        harness = SimpleNamespace(**{n: importlib.import_module(f"harness.{n}") for n in names})
        yield harness, importlib.import_module("baselines")
    finally:
        sys.path.remove(str(BENCH_DIR))


H_, I_, L_, R_, K_ = 256, 128, 4, 12, 3  # tiny: hidden, intermediate, local experts, rows, top-k


@pytest.mark.parametrize("act_fmt,w_fmt", FORMAT_PAIRS, ids=lambda v: str(v))
def test_baselines_match_reference(bench_modules, act_fmt, w_fmt):
    _, B = bench_modules
    w = make_weights(L_, H_, I_, w_fmt, seed=3)
    x, xs = make_activations(R_, H_, act_fmt, seed=4)
    idx, tw = make_routing(R_, K_, 2 * L_, seed=5, empty_frac=0.1, duplicate_frac=0.2)
    offset = L_  # the second of two ranks: ids 0 … L−1 belong to another rank
    args_w = (w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    ref = reference.local_experts(x, xs, idx, tw, *args_w, offset, 7.0)
    assert ref.abs().sum() > 0, "the routing must give this rank work, or the check proves nothing"
    seed = B.seed_dense_local_experts(x, xs, idx, tw, *args_w, offset, 7.0)
    assert calc_diff(seed, ref) <= B.CHECK_TOLERANCE["seed_dense"]
    for dt in (torch.float32, torch.bfloat16):
        got = B.TorchCached(*args_w, dtype=dt).local_experts(x, xs, idx, tw, offset, 7.0)
        assert calc_diff(got, ref) <= B.CHECK_TOLERANCE["torch_cached"], dt
    mask = torch.arange(R_) % 3 != 0
    ref_g = reference.expert_gemm(x, xs, w["w13"], w["w13_scale"], mask, 2)
    assert calc_diff(B.seed_dense_expert_gemm(x, xs, w["w13"], w["w13_scale"], mask, 2), ref_g) <= 1e-6
    got_g = B.TorchCached(w["w13"], w["w13_scale"], dtype=torch.bfloat16).expert_gemm(x, xs, mask, 2)
    assert calc_diff(got_g, ref_g) <= B.CHECK_TOLERANCE["torch_cached"]
    assert torch.all(got_g[~mask] == 0)
    if w_fmt == "fp4" and B.int4pack_unavailable_reason() is None:  # PyTorch's own 4-bit GEMM, re-quantized weights
        i4 = B.TorchInt4Pack(*args_w)
        assert calc_diff(i4.local_experts(x, xs, idx, tw, offset, 7.0), ref) <= B.CHECK_TOLERANCE["torch_int4pack"]
        got_i = i4.expert_gemm(x, xs, mask, 2)
        assert calc_diff(got_i, ref_g) <= B.CHECK_TOLERANCE["torch_int4pack"]
        assert torch.all(got_i[~mask] == 0)
    if w_fmt == "fp8":
        if B.scaled_mm_unavailable_reason() is not None:
            pytest.skip(B.scaled_mm_unavailable_reason())
        smm = B.TorchScaledMM(*args_w)
        assert calc_diff(smm.local_experts(x, xs, idx, tw, offset, 7.0), ref) <= B.CHECK_TOLERANCE["torch_scaled_mm"]
        got_s = smm.expert_gemm(x, xs, mask, 2)
        assert calc_diff(got_s, ref_g) <= B.CHECK_TOLERANCE["torch_scaled_mm"]
        assert torch.all(got_s[~mask] == 0)


def test_baseline_check_catches_wrong_maths(bench_modules):
    H, B = bench_modules
    w = make_weights(L_, H_, I_, "bf16", seed=3)
    x, _ = make_activations(R_, H_, "bf16", seed=4)
    idx, tw = make_routing(R_, K_, L_, seed=5)
    args_w = (w["w13"], None, w["w2"], None)
    ref = reference.local_experts(x, None, idx, tw, *args_w, 0, None)
    wrong = B.TorchCached(*args_w).local_experts(x, None, idx, tw.flip(1), 0, None)  # weights on the wrong slots
    with pytest.raises(AssertionError, match="torch_cached"):
        H.checks.check_baseline("torch_cached", wrong, ref, B.CHECK_TOLERANCE["torch_cached"], "smoke")


def test_cost_accounting(bench_modules):
    H, _ = bench_modules
    hid, inter = 4096, 2048
    # fp4: half a byte per weight plus one UE8M0 byte per 32; fp8: one byte plus a float32 per 128.
    assert H.costs.weight_bytes("fp4", 2 * inter, hid) == 2 * inter * hid // 2 + 2 * inter * hid // 32
    assert H.costs.weight_bytes("fp8", hid, inter) == hid * inter + 4 * hid * inter // 128
    assert H.costs.weight_bytes("bf16", hid, inter) == 2 * hid * inter
    c = H.costs.cost_expert_gemm("fp8", "fp4", rows_total=8, rows_active=5, n=2 * inter, k=hid)
    assert c.flops == 2 * 5 * 2 * inter * hid
    assert c.bytes == H.costs.weight_bytes("fp4", 2 * inter, hid) + 5 * hid + 4 * 5 * hid // 128 + 8 + 2 * 8 * 2 * inter
    idx = torch.tensor([[0, 3], [3, 3], [-1, 9], [1, 0]])  # local experts 0..3; a duplicate; a foreign id
    st = H.routing.routing_stats(idx, 0, 4)
    assert (st.rows_active, st.experts_touched, st.pairs) == (3, 3, 5)  # pairs: {0,3} {3} {} {1,0}
    le = H.costs.cost_local_experts("bf16", "bf16", 4, st.rows_active, 2, hid, inter, st.experts_touched, st.pairs)
    assert le.flops == 2 * 5 * 3 * hid * inter
    limits = MachineLimits(2, bandwidth=1e10, flops=1e11, triad_array_bytes=0, llc_bytes=0, matmul_n=0)
    roof = H.costs.roofline(H.costs.Cost(1e9, 1e9), limits, measured_s=0.2)
    assert roof["t_mem_s"] == pytest.approx(0.1) and roof["t_compute_s"] == pytest.approx(0.01)
    assert roof["bound"] == "memory" and roof["roofline_fraction"] == pytest.approx(0.5)
    # Weights (read_bytes) at the read-only stream's rate, the rest at the triad's; bf16 kernels against the bf16
    # peak.
    limits = MachineLimits(
        2,
        bandwidth=1e10,
        flops=1e11,
        triad_array_bytes=0,
        llc_bytes=0,
        matmul_n=0,
        bf16_flops=4e11,
        read_bandwidth=2e10,
    )
    roof = H.costs.roofline(H.costs.Cost(1e9, 4e10, read_bytes=8e8), limits, measured_s=0.1, bf16_dot=True)
    assert roof["t_mem_s"] == pytest.approx(0.04 + 0.02) and roof["t_compute_s"] == pytest.approx(0.1)
    assert (
        roof["bound"] == "compute" and roof["compute_peak"] == "bf16" and roof["roofline_fraction"] == pytest.approx(1)
    )
    assert H.costs.roofline(H.costs.Cost(1e9, 4e10), limits, 0.4)["t_compute_s"] == pytest.approx(0.4)  # fp32 peak


def test_sliced_routing_keeps_real_rows():
    shape = MODEL_SHAPES["v4_flash"]
    full = sliced_routing(shape, [16], shape.num_experts, seed=1)
    kept = sliced_routing(shape, [16], 8, seed=1)
    assert kept.touched_real == full.touched_real
    idx = kept.topk_idx[0].long()
    assert idx.min() >= -1 and idx.max() < 8
    # every kept expert has exactly as many rows as some real expert had, and it was a touched one
    real_counts = torch.bincount(full.topk_idx[0].long().flatten()[full.topk_idx[0].flatten() >= 0])
    kept_counts = torch.bincount(idx.flatten()[idx.flatten() >= 0], minlength=8)
    assert (kept_counts > 0).all()
    for c in kept_counts.tolist():
        assert c in real_counts.tolist()


def test_timer_table_json(bench_modules, tmp_path):
    H, _ = bench_modules
    calls = []
    timing, first = H.timing.time_fn(lambda: calls.append(1) or len(calls), warmup=1, repeat=5)
    assert first == 1 and len(timing.samples_s) == 5 and timing.median_s > 0
    op, out = H.timing.measure(lambda: (_ for _ in ()).throw(NotImplementedError("no kernel")))
    assert op == {"available": False, "reason": "NotImplementedError: no kernel"} and out is None
    limits = MachineLimits(2, 1e10, 1e11, 0, 0, 0)
    report = H.report.Report(limits)
    rec = {
        "bench": "local_experts",
        "shape": "v4_flash",
        "fmt": "fp8×fp4",
        "tokens": 4,
        "rows_per_expert": 1.0,
        "experts": "8/24",
        "op": {"available": True, "median_s": 1e-3},
        "baselines": {"torch_cached": {"median_s": 4e-3}, "torch_scaled_mm": {"available": False, "reason": "x"}},
    }
    rec.update(H.costs.roofline(H.costs.Cost(5e6, 1e8), limits, 1e-3))
    report.add(rec)
    assert rec["speedup"]["torch_cached"] == pytest.approx(4.0)
    table = report.table()
    assert "local_experts" in table and "4.00" in table and "n/a" in table
    doc = json.loads(report.write_json(tmp_path / "r.json").read_text())
    assert doc["records"][0]["speedup"]["torch_cached"] == pytest.approx(4.0)
    assert doc["machine"]["bandwidth"] == 1e10


def test_same_round_timing(bench_modules):
    """time_interleaved: every call once per round, in order, its first output returned; weight_stream reads every
    byte of its tensors (an int64 body and a uint8 tail); measure_with records a failing op and still times the
    rest."""
    H, _ = bench_modules
    order = []
    timed, outs = H.timing.time_interleaved({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2})
    assert outs == {"a": 1, "b": 2} and order == ["a", "b"] * 6
    assert len(timed["a"].samples_s) == 5 and timed["b"].median_s > 0
    x = torch.arange(21, dtype=torch.uint8)  # 16-byte int64 body + 5-byte tail
    y = torch.tensor([[1.5, -2.0]])
    body = int(x[:16].view(torch.int64).sum()) + int(x[16:].sum())
    assert H.timing.weight_stream([x, None, y])() == body + int(y.view(torch.int64).sum())
    x[20] += 1  # the tail counts
    assert H.timing.weight_stream([x])() == body + 1
    v = x[3:]  # a view at an odd offset: 5 head bytes, an aligned 8-byte body, a 5-byte tail
    before = H.timing.weight_stream([v])()
    for i in (0, 7, 17):  # one byte of each part changes the sum
        v[i] += 1
        assert H.timing.weight_stream([v])() != before
        v[i] -= 1
    op, out, paired, _ = H.timing.measure_with(
        lambda: (_ for _ in ()).throw(RuntimeError("no kernel")), {"s": lambda: 3}
    )
    assert op == {"available": False, "reason": "RuntimeError: no kernel"} and out is None and "median_s" in paired["s"]
    assert H.timing.stream_fraction(paired["s"], op) is None
    assert H.timing.stream_fraction({"median_s": 1.0}, {"available": True, "median_s": 2.0}) == 0.5


def test_int4pack_target_read_ceiling(bench_modules):
    """run_all's T = 1 line under the int4pack target: t_int4pack / t_stream (speed-up over int4pack / the op's
    fraction of the same-round stream), its minimum over the V4-Flash and V3 fp4 points at T = 1 only."""
    run_all = importlib.import_module("run_all")  # bench/ is on sys.path while bench_modules is up

    def rec(shape, tokens, speedup, fraction):
        return {
            "bench": "expert_gemm",
            "shape": shape,
            "fmt": "bf16×fp4 w13",
            "tokens": tokens,
            "weight": "fp4",
            "op": {"available": True, "median_s": 1e-3},
            "speedup": {"torch_int4pack": speedup},
            "weight_stream_fraction": fraction,
        }

    records = [
        rec("v4_flash", 1, 1.5, 0.75),  # int4pack 1.5× the op, the op at 0.75 of the stream: ceiling 2.0
        rec("v3", 1, 1.2, 0.8),  # ceiling 1.5: the minimum
        rec("v3", 4, 1.0, 0.9),  # T = 4: not a read-bound point, left out (ceiling 1.11)
        rec("qwen3_30b_a3b", 1, 1.0, 1.0),
    ]  # not a target shape (ceiling 1.0)
    report = SimpleNamespace(limits=MachineLimits(2, 1e10, 1e11, 0, 0, 0), records=records)
    rows = {r["what"].strip().split(":")[0]: r for r in run_all.same_round_targets(report)}
    ceiling = rows["the same at T=1"]
    assert ceiling["min"] == pytest.approx(1.5) and ceiling["at"] == "v3 bf16×fp4 w13 T=1"
    assert ceiling["target"] is None  # information: the bench never passes or fails it
    assert rows[next(k for k in rows if k.startswith("expert_gemm fp4 vs torch_int4pack"))]["min"] == 1.0


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: {family}
model\t\t: {model}
model name\t: Some CPU
flags\t\t: {flags}

processor\t: 1
vendor_id\t: OtherVendor
"""
AVX512BF16_FLAGS = "fpu avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512vbmi"


HOST_ID_CASES = [  # (vendor, family, model, flags, the id)
    ("GenuineIntel", 6, 207, AVX512BF16_FLAGS + " amx_bf16 amx_tile amx_int8", "intel-6-207-amx"),
    ("GenuineIntel", 6, 207, AVX512BF16_FLAGS, "intel-6-207-avx512bf16"),  # the same CPU with AMX hidden
    ("AuthenticAMD", 25, 17, AVX512BF16_FLAGS, "amd-25-17-avx512bf16"),
    ("AuthenticAMD", 23, 49, "avx2 fma f16c avx512f", "amd-23-49-avx2"),  # avx512f alone is not the avx512 level
    ("Weird Vendor!", 1, 2, "sse2", "weirdvendor-1-2-scalar"),
]


@pytest.mark.parametrize("vendor,family,model,flags,expected", HOST_ID_CASES, ids=[c[-1] for c in HOST_ID_CASES])
def test_host_id(bench_modules, vendor, family, model, flags, expected):
    """harness.hosts.host_id: vendor, family, model and the best CPU-kernel level of the first processor's flags,
    filesystem-safe."""
    hosts = importlib.import_module("harness.hosts")
    assert hosts.host_id(CPUINFO.format(vendor=vendor, family=family, model=model, flags=flags)) == expected


def _host_doc(host_id, cpu="CPU", int4=None, read=24.4e9):
    """A synthetic host summary in harness.hosts.host_summary's layout."""
    return {
        "host": {"id": host_id, "cpu": cpu, "threads": 2},
        "run": {"commit": "abc1234"},
        "machine": {"read_bandwidth": read, "bf16_flops": 1583e9},
        "summary": {
            "int4pack": int4 or {"1": [1.31, 1.56], "4": [1.25, 1.28], "16": None, "64": [1.1, 1.1]},
            "read_ceiling": [1.52, 1.84],
            "amx_int4pack": {"16": None, "64": None},
            "one_row_read": [0.77, 1.15],
            "bf16_matmul": [0.08, 0.2],
            "forward_in_step": None,
            "quantize_copy": {"fp8": [0.31, 0.42], "fp4": None},
        },
    }


def test_results_table_one_row_per_host(bench_modules, tmp_path):
    """harness.results_doc renders one row per host file (sorted by host id), and replaces only what lies between
    the markers of a document."""
    doc_mod = importlib.import_module("harness.results_doc")
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    (hosts / "intel-6-207-amx.json").write_text(json.dumps(_host_doc("intel-6-207-amx", cpu="Xeon")))
    (hosts / "amd-25-17-avx512bf16.json").write_text(
        json.dumps(_host_doc("amd-25-17-avx512bf16", cpu="EPYC", read=None))
    )
    (hosts / "notes.txt").write_text("not a host summary")
    table = doc_mod.render_results_table(doc_mod.host_files(hosts))
    lines = table.splitlines()
    assert len(lines) == 2 + 2  # header, rule, one row per host file
    assert lines[2].startswith("| `amd-25-17-avx512bf16` | EPYC | 2 | — | 1583 |")
    assert lines[3].startswith("| `intel-6-207-amx` | Xeon | 2 | 24.4 | 1583 | 1.31–1.56 / 1.25–1.28 / — / 1.10 |")
    assert "| 1.52–1.84 | — | 77–115 % | 8–20 % | — | 31–42 % / — | `abc1234` |" in lines[3]
    assert all(line.count("|") == len(doc_mod.COLUMNS) + 1 for line in lines)

    before, after = "# Benchmarks\n\nprose before\n", "\nprose after, kept byte for byte  \n"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"{before}{doc_mod.BEGIN}\n| stale | table |\n{doc_mod.END}{after}")
    doc_mod.update_results_doc(doc, hosts)
    text = doc.read_text()
    assert text == f"{before}{doc_mod.BEGIN}\n{table}\n{doc_mod.END}{after}"
    assert "stale" not in text
    doc_mod.update_results_doc(doc, hosts)
    assert doc.read_text() == text  # rendering again changes nothing
    for bad in (
        f"{before}{after}",
        f"{doc_mod.END}\n{doc_mod.BEGIN}\n",
        f"{doc_mod.BEGIN}{doc_mod.BEGIN}{doc_mod.END}",
    ):
        with pytest.raises(ValueError, match="results:begin"):
            doc_mod.replace_between_markers(bad, table)
    assert doc_mod.render_results_table([]).startswith("No host has a committed summary yet")


def test_only_a_full_run_replaces_the_committed_summary(bench_modules, tmp_path):
    """run_all writes the host summary to bench/results/hosts/ and re-renders docs/benchmarks.md only on a full run
    (what make bench runs); a partial run writes where --hosts-dir / --results-doc say, or nowhere."""
    run_all = importlib.import_module("run_all")
    doc_mod = importlib.import_module("harness.results_doc")

    def paths(*argv):
        return run_all._publish_paths(run_all.build_parser().parse_args([str(a) for a in argv]))

    committed = (doc_mod.HOSTS_DIR, doc_mod.DOC)
    assert paths() == committed
    assert paths("--shape", "all", "--tokens", 1, 4, 16, 64, 128) == committed
    for partial in (["--quick"], ["--only", "expert_gemm"], ["--shape", "v3"], ["--tokens", 1]):
        assert paths(*partial) == (None, None), partial
    assert paths("--quick", "--hosts-dir", tmp_path) == (tmp_path, None)
    assert paths("--quick", "--hosts-dir", tmp_path, "--results-doc", tmp_path / "b.md") == (
        tmp_path,
        tmp_path / "b.md",
    )
    assert paths("--table-only") == committed


def test_committed_results_table_is_rendered(bench_modules):
    """docs/benchmarks.md shows the table the committed host summaries give (run_all.py --table-only renders it)."""
    doc_mod = importlib.import_module("harness.results_doc")
    text = doc_mod.DOC.read_text()
    assert text == doc_mod.replace_between_markers(text, doc_mod.render_results_table(doc_mod.host_files()))


def test_profile_reads_perf_output():
    """bench_profile.py's readers on perf's own text: samples kept only inside the calls' windows and sorted by
    place and thread, annotate lines sorted by instruction class (AT&T operands: sources first)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        P = importlib.import_module("bench_profile")
    finally:
        sys.path.remove(str(BENCH_DIR))
    so = "(/x/python/static_moe/_C.cpython-311-x86_64-linux-gnu.so)"
    script = "\n".join(
        [
            f"   100/100 10.000100000:   7f01 static_moe::cpu::(anonymous namespace)::dot_panel_fp4<4> {so}",
            "   100/102 10.000200000:   7f02 [unknown] (/x/torch/lib/libgomp.so.1)",
            f"   100/100 10.000300000:   7f03 (anonymous namespace)::swiglu_rows {so}",
            "   100/100 10.000400000:   7f04 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)",
            "   100/102 11.500000000:   7f05 [unknown] (/x/torch/lib/libgomp.so.1)",  # between the calls
            "   100/100 12.000100000:   7f06 memset ([kernel.kallsyms])",
            "   200/200 10.000500000:   7f07 dot_block (/x/_C.so)",  # another process, outside its own call
        ]
    )
    samples = P.parse_script(script)
    assert [s[1] for s in samples] == [True, False, True, True, False, True, True]
    assert samples[0][3] == "_C.cpython-311-x86_64-linux-gnu.so" and samples[-1][0] == 200
    kept = P.in_windows(samples, {100: [(10.0, 10.001), (12.0, 12.001)], 200: [(10.002, 10.003)]})
    assert len(kept) == 5 and all(s[2] != 11.5 and s[0] == 100 for s in kept)
    assert P.places(kept) == {
        "expert-GEMM kernels": (1, 0),
        "static_moe, other": (1, 0),
        "OpenMP runtime": (0, 1),
        "torch": (0, 0),
        "Python": (1, 0),
        "OS": (1, 0),
        "other": (0, 0),
    }
    annotate = "\n".join(
        [
            " Percent |	Source code & Disassembly of _C.so for cpu-clock (467 samples, percent: local period)",
            "         : 3     Disassembly of section .text:",
            "    4.00 :   2d3ba:  vdpbf16ps %zmm4,%zmm0,%zmm7",
            "    3.00 :   2cfe2:  vbroadcasti32x4 (%rsi,%rax,1),%zmm0",
            "    2.00 :   2d054:  vpmultishiftqb %zmm0,%zmm24,%zmm0",
            "    1.00 :   2d066:  vmovdqa64 %zmm0,0x600(%rsp,%rax,1)",
            "    0.50 :   2d070:  vfmadd231ps %zmm1,%zmm2,%zmm3",
            "    0.25 :   2d080:  add    $0x20,%r10",
            "    0.00 :   2d090:  vpermw (%r14,%r8,1),%zmm0,%zmm0",
            "    1.50 :   2d0a0:  tdpbf16ps %tmm2,%tmm0,%tmm3",  # the amx kernel's products, tile loads and stores
            "    0.75 :   2d0a5:  tileloadd (%rdi,%r11,1),%tmm1",
            "    0.125 :   2d0ab:  tilestored %tmm3,(%rdx,%rcx,1)",
        ]
    )
    rows = P.parse_annotate(annotate)
    assert len(rows) == 9  # lines without samples are left out
    assert P.classes(rows) == {
        "vdpbf16ps / tdpbf16ps": 5.5,
        "decode": 2.0,
        "load": 3.75,
        "store": 1.125,
        "fold (vfmadd)": 0.5,
        "prefetch": 0.0,
        "other": 0.25,
    }
    assert (
        P.place_of(
            "_C.cpython-311-x86_64-linux-gnu.so",
            "static_moe::cpu::(anonymous namespace)::tile_blocks<(static_moe::cpu::WeightFormat)2, false>",
        )
        == "expert-GEMM kernels"
    )


def test_profile_end_to_end(tmp_path):
    """bench_profile.py on a small point, where this host lets perf sample its own processes: the calls' windows
    and perf's clock line up (samples are found inside the calls) and most of them are in the GEMM kernels. Weights
    hot: after a cache flush (twice the L3: 960 MiB on one host) torch's and Python's code and data come from DRAM
    too, which on a host with slow cold reads took two thirds of a cold call of this small GEMM, and 0.5 s held
    only five cold calls."""
    import subprocess

    probe = (
        subprocess.run(
            ["perf", "record", "-q", "-e", "cpu-clock", "-o", str(tmp_path / "p.data"), "--", "true"],
            capture_output=True,
            text=True,
        )
        if shutil.which("perf")
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip("perf cannot sample here" + ("" if probe is None else f": {probe.stderr.strip()[:200]}"))
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_profile.py"),
            "expert_gemm",
            "--shape",
            "qwen3_30b_a3b",
            "--tokens",
            "4",
            "--seconds",
            "0.5",
            "--threads",
            "1",
            "--hot",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    kernel = re.search(r"expert-GEMM kernels\s+([0-9.]+) %", out.stdout)
    assert kernel and float(kernel[1]) > 50, out.stdout
    assert "by instruction class" in out.stdout, out.stdout


def test_host_memory_bench_runs_both_memories(bench_modules):
    """bench_host_memory on one small shape: both layers run, give the same bits, and the advised one is in huge-page
    memory wherever this kernel takes the advice."""
    from static_moe import host_memory

    mod = importlib.import_module("bench_host_memory")
    (r,) = mod.main(["--dims", "2048", "256", "2", "--rows", "2", "--formats", "bf16", "--iters", "1", "--rounds", "1"])
    assert r["same_bits"] and r["advised_us"] > 0 and r["plain_us"] > 0
    assert r["advised"] == host_memory.advice_available()
