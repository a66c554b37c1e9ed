"""CUDA microbenchmark of static_moe on one GPU (docs/benchmarks.md): local_experts and expert_gemm against torch_cached
(and DeepGEMM's masked grouped GEMM when it is importable), at real decode shapes.

Figures are ratios measured in the same run: against the GPU's own limits (device-to-device copy bandwidth and
the bf16 matmul rate of torch, measured first), and against the baselines on the same inputs.

* static_moe ops are timed as CUDA-graph replays (they are graph-capturable), median of 5 timed batches.
* torch_cached: weights dequantized once to bf16 at load; per call the rows of each expert are gathered
  (index_select; the per-expert counts cost a host sync, as in any eager PyTorch MoE), F.linear, silu·up·w,
  F.linear, index_add_ into fp32. Timed eagerly with CUDA events.
* roofline: bytes = weights (+ scales) of the experts the call touches + activations in + fp32 out; flops =
  2·pairs·(2I·H + H·I); roofline_s = max(bytes / copy bandwidth, flops / bf16 matmul rate).
EP size 8 is assumed: L = E/8 local experts, R = 8·T gathered rows for T tokens per rank.

Usage: python bench/bench_cuda.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import static_moe  # noqa: E402,F401  (registers the ops)
from static_moe import formats  # noqa: E402
from static_moe.testing.generators import MODEL_SHAPES  # noqa: E402
from static_moe.testing.numeric import calc_diff  # noqa: E402

DEVICE = "cuda"
EP = 8
NATIVE = {"v4_flash": ("fp8", "fp4", 128), "v3": ("fp8", "fp8", 128), "qwen3_30b_a3b": ("bf16", "bf16", 0)}
ALL_PAIRS = [
    ("bf16", "bf16", 0),
    ("bf16", "fp8", 0),
    ("bf16", "fp4", 0),
    ("fp8", "fp8", 128),
    ("fp8", "fp4", 128),
    ("fp8", "fp4", 32),
]
REPEATS = 5


# ---------------------------------------------------------------------------------------------------------------
# Timing and machine limits
# ---------------------------------------------------------------------------------------------------------------
def time_eager(fn, iters: int) -> float:
    """Median seconds per call over REPEATS batches of `iters` calls (after a warm-up), CUDA events."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(samples)


def time_graph(fn, iters: int) -> float:
    """fn captured once in a CUDA graph (after a warm-up on a side stream), replays timed like time_eager."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_eager(g.replay, iters)


def measure_gpu() -> dict:
    n = 1 << 28  # 1 GiB of bytes per buffer
    a = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    copy_s = time_eager(lambda: b.copy_(a), 10)
    a = b = None  # free the buffers before the matmul's (a `del` would leave the lambda's names unbound)
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE)
    mm_s = time_eager(lambda: x @ y, 5)
    x = y = None
    torch.cuda.empty_cache()
    return {"copy_GBps": 2 * n / copy_s / 1e9, "bf16_TFLOPs": 2 * m**3 / mm_s / 1e12}


# ---------------------------------------------------------------------------------------------------------------
# Inputs (on the GPU)
# ---------------------------------------------------------------------------------------------------------------
def make_case(shape, act, wf, group, tokens, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    L, H, I, E, k = shape.num_experts // EP, shape.hidden, shape.intermediate, shape.num_experts, shape.topk
    R = EP * tokens
    x = torch.randn(R, H, device=DEVICE, generator=g)
    if act == "fp8":
        x, x_s = formats.quantize_activation(x, group)
    else:
        x, x_s = x.to(torch.bfloat16), None
    idx = torch.rand(R, E, device=DEVICE, generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(R, k, device=DEVICE, generator=g), dim=-1)
    w13 = torch.randn(L, 2 * I, H, device=DEVICE, generator=g) / H**0.5
    w2 = torch.randn(L, H, I, device=DEVICE, generator=g) / I**0.5
    w13_q, w13_s = formats.quantize_weight(w13, wf)
    w2_q, w2_s = formats.quantize_weight(w2, wf)
    del w13, w2
    return dict(x=x, x_s=x_s, idx=idx, w=w, w13=w13_q, w13_s=w13_s, w2=w2_q, w2_s=w2_s, L=L, H=H, I=I, R=R)


def weight_bytes_per_expert(c) -> int:
    t = [c["w13"], c["w13_s"], c["w2"], c["w2_s"]]
    return sum(v[0].numel() * v.element_size() for v in t if v is not None)


class TorchCachedCuda:
    """torch_cached on the GPU: bf16 weights dequantized once; eager per-expert gather / F.linear / index_add_."""

    def __init__(self, c):
        self.w13 = formats.dequantize_weight(c["w13"], c["w13_s"]).to(torch.bfloat16)
        self.w2 = formats.dequantize_weight(c["w2"], c["w2_s"]).to(torch.bfloat16)

    def local_experts(self, x, x_s, idx, w, offset=0):
        xb = (formats.dequantize_activation(x, x_s) if x_s is not None else x.float()).to(torch.bfloat16)
        L, inter = self.w13.shape[0], self.w13.shape[1] // 2
        local = idx.long() - offset
        ok = (local >= 0) & (local < L)
        counts = torch.bincount(local[ok], minlength=L).tolist()  # host sync
        acc = torch.zeros(x.shape[0], self.w2.shape[1], dtype=torch.float32, device=x.device)
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, slots = torch.nonzero(local == e, as_tuple=True)
            gu = F.linear(xb.index_select(0, rows), self.w13[e])
            z = F.silu(gu[:, :inter]) * gu[:, inter:] * w[rows, slots].to(torch.bfloat16)[:, None]
            acc.index_add_(0, rows, F.linear(z, self.w2[e]).float())
        return acc

    def expert_gemm(self, a, a_s, mask, expert):
        rows = mask.nonzero().squeeze(1)
        ab = (formats.dequantize_activation(a, a_s) if a_s is not None else a.float()).to(torch.bfloat16)
        out = torch.zeros(a.shape[0], self.w13.shape[1], dtype=torch.bfloat16, device=a.device)
        out.index_copy_(0, rows, F.linear(ab.index_select(0, rows), self.w13[expert]))
        return out


# ---------------------------------------------------------------------------------------------------------------
# DeepGEMM (optional)
# ---------------------------------------------------------------------------------------------------------------
def deep_gemm_masked():
    """The masked grouped fp8 GEMM of DeepGEMM if importable: (callable, None) or (None, why not)."""
    try:
        import deep_gemm  # type: ignore
    except Exception as e:  # noqa: BLE001  (any import failure means: not available here)
        return None, f"not importable ({type(e).__name__}: {e})"
    for name in ("fp8_m_grouped_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"):
        fn = getattr(deep_gemm, name, None)
        if fn is not None:
            return fn, None
    return None, "importable, but no masked grouped fp8 GEMM entry point found"


def bench_deep_gemm(fn, m_rows, n, k, experts=8):
    """DeepGEMM masked grouped fp8 x fp8 (1x128 activation scales, 128x128 weight block scales) with m_rows rows
    per expert, all `experts` experts active. Returns seconds per call."""
    a = torch.randn(experts, max(m_rows, 128), k, device=DEVICE).to(torch.float8_e4m3fn)
    a_s = torch.ones(experts, a.shape[1], k // 128, device=DEVICE)
    b = torch.randn(experts, n, k, device=DEVICE).to(torch.float8_e4m3fn)
    b_s = torch.ones(experts, n // 128, k // 128, device=DEVICE)
    out = torch.empty(experts, a.shape[1], n, dtype=torch.bfloat16, device=DEVICE)
    masked_m = torch.full((experts,), m_rows, dtype=torch.int32, device=DEVICE)
    return time_eager(lambda: fn((a, a_s), (b, b_s), out, masked_m, m_rows), 20)


# ---------------------------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------------------------
def bench_local_experts(model, act, wf, group, tokens, limits, check=True):
    shape = MODEL_SHAPES[model]
    c = make_case(shape, act, wf, group, tokens)
    args = (c["x"], c["x_s"], c["idx"], c["w"], c["w13"], c["w13_s"], c["w2"], c["w2_s"])
    op = lambda: torch.ops.static_moe.local_experts(*args, 0, None, 448.0)  # noqa: E731
    out = op()
    local = c["idx"].long()
    routed = (local >= 0) & (local < c["L"])
    pairs = int(routed.sum())
    experts = int(torch.unique(local[routed]).numel())
    op_s = time_graph(op, 20)
    base = TorchCachedCuda(c)
    base_fn = lambda: base.local_experts(c["x"], c["x_s"], c["idx"], c["w"])  # noqa: E731
    diff = calc_diff(out, base_fn()) if check else float("nan")
    base_s = time_eager(base_fn, 5)
    H, I, R = c["H"], c["I"], c["R"]
    bytes_ = experts * weight_bytes_per_expert(c) + c["x"].numel() * c["x"].element_size() + R * H * 4
    flops = 2 * pairs * (2 * I * H + H * I)
    t_bytes, t_flops = bytes_ / (limits["copy_GBps"] * 1e9), flops / (limits["bf16_TFLOPs"] * 1e12)
    return dict(
        op="local_experts",
        model=model,
        fmt=f"{act}x{wf}" + (f"/g{group}" if group else ""),
        tokens=tokens,
        rows=R,
        pairs=pairs,
        experts=experts,
        op_us=op_s * 1e6,
        torch_cached_us=base_s * 1e6,
        speedup=base_s / op_s,
        GBps=bytes_ / op_s / 1e9,
        roofline=max(t_bytes, t_flops) / op_s,
        bound="bytes" if t_bytes >= t_flops else "flops",
        calc_diff_vs_torch_cached=diff,
    )


def bench_expert_gemm(act, wf, group, m_rows, limits, n=4096, k=4096, rows=256):
    """One expert's w13 at V4-Flash shapes ([2I, H] = [4096, 4096]); m_rows of `rows` gathered rows active."""
    g = torch.Generator(device=DEVICE).manual_seed(m_rows)
    x = torch.randn(rows, k, device=DEVICE, generator=g)
    a, a_s = formats.quantize_activation(x, group) if act == "fp8" else (x.to(torch.bfloat16), None)
    b, b_s = formats.quantize_weight(torch.randn(1, n, k, device=DEVICE, generator=g) / k**0.5, wf)
    mask = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    mask[torch.randperm(rows, device=DEVICE, generator=g)[:m_rows]] = True
    op = lambda: torch.ops.static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)  # noqa: E731
    op_s = time_graph(op, 50)
    base = TorchCachedCuda(dict(w13=b, w13_s=b_s, w2=b, w2_s=b_s))
    base_s = time_eager(lambda: base.expert_gemm(a, a_s, mask, 0), 20)
    wbytes = b.numel() * b.element_size() + (0 if b_s is None else b_s.numel() * b_s.element_size())
    bytes_ = wbytes + m_rows * k * a.element_size() + rows * n * 2
    flops = 2 * m_rows * n * k
    t_bytes, t_flops = bytes_ / (limits["copy_GBps"] * 1e9), flops / (limits["bf16_TFLOPs"] * 1e12)
    return dict(
        op="expert_gemm",
        model="v4_flash w13",
        fmt=f"{act}x{wf}" + (f"/g{group}" if group else ""),
        tokens=m_rows,
        rows=rows,
        pairs=m_rows,
        experts=1,
        op_us=op_s * 1e6,
        torch_cached_us=base_s * 1e6,
        speedup=base_s / op_s,
        GBps=bytes_ / op_s / 1e9,
        roofline=max(t_bytes, t_flops) / op_s,
        bound="bytes" if t_bytes >= t_flops else "flops",
        calc_diff_vs_torch_cached=float("nan"),
    )


def print_table(rows):
    cols = [
        ("op", 13),
        ("model", 14),
        ("fmt", 14),
        ("tokens", 6),
        ("rows", 5),
        ("pairs", 5),
        ("experts", 7),
        ("op_us", 9),
        ("torch_cached_us", 15),
        ("speedup", 7),
        ("GBps", 7),
        ("roofline", 8),
        ("bound", 5),
    ]
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    for r in rows:
        cells = []
        for c, w in cols:
            v = r[c]
            if c == "roofline":
                cells.append(f"{100 * v:>{w - 1}.1f}%")
            elif isinstance(v, float):
                cells.append(f"{v:>{w}.1f}" if c != "speedup" else f"{v:>{w - 1}.2f}x")
            else:
                cells.append(f"{v!s:>{w}}")
        print(" ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (the GPU check's default)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "bench_cuda.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device visible", file=sys.stderr)
        return 2
    if not torch._C._dispatch_has_kernel_for_dispatch_key("static_moe::local_experts", "CUDA"):
        print("bench_cuda: static_moe._C has no CUDA kernels (build against a CUDA torch)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    prop = torch.cuda.get_device_properties(0)
    t0 = time.time()
    limits = measure_gpu()
    print(
        f"device: {prop.name} (sm_{prop.major}{prop.minor}, {prop.multi_processor_count} SMs), torch {torch.__version__}"
    )
    print(
        f"measured: copy {limits['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {limits['bf16_TFLOPs']:.0f} TFLOP/s"
    )
    print(f"EP size {EP} assumed: L = E/{EP} local experts, rows = {EP} x tokens per rank\n")

    tokens = (1, 16, 128) if args.quick else (1, 4, 16, 64, 128)
    results = []
    for model, (act, wf, group) in NATIVE.items():
        for t in tokens:
            results.append(bench_local_experts(model, act, wf, group, t, limits))
            torch.cuda.empty_cache()
    for act, wf, group in ALL_PAIRS:
        if (act, wf, group) != NATIVE["v4_flash"]:
            results.append(bench_local_experts("v4_flash", act, wf, group, 16, limits))
            torch.cuda.empty_cache()
    for act, wf, group in (
        ALL_PAIRS if not args.quick else [("fp8", "fp4", 128), ("fp8", "fp8", 128), ("bf16", "bf16", 0)]
    ):
        for m in (1, 32, 128) if args.quick else (1, 8, 32, 128):
            results.append(bench_expert_gemm(act, wf, group, m, limits))
            torch.cuda.empty_cache()
    print_table(results)
    bad = [r for r in results if r["op"] == "local_experts" and not r["calc_diff_vs_torch_cached"] < 5e-3]
    for r in bad:
        print(
            f"SANITY FAILURE: {r['model']} {r['fmt']} T={r['tokens']}: calc_diff vs torch_cached "
            f"{r['calc_diff_vs_torch_cached']:.3g} >= 5e-3",
            file=sys.stderr,
        )

    fn, why = deep_gemm_masked()
    deep = {}
    if fn is None:
        print(f"\nDeepGEMM masked grouped GEMM: skipped, {why}")
    else:
        for m in (1, 32, 128):
            try:
                s = bench_deep_gemm(fn, m, 4096, 4096)
                deep[m] = s * 1e6
                print(f"DeepGEMM fp8 masked grouped, 8 experts x {m} rows, N=K=4096: {s * 1e6:.1f} us")
            except Exception as e:  # noqa: BLE001  (report, do not fail the check on a third-party API change)
                print(f"DeepGEMM call failed ({type(e).__name__}: {e}); not compared")
                break
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "device": prop.name,
                "torch": torch.__version__,
                "limits": limits,
                "results": results,
                "deep_gemm_us": deep,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.json} ({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
