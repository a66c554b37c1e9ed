"""Cost of the SPEC §1.9 variants in local_experts: gpt-oss's swiglu_oai with both biases against the plain SiLU
path, and gelu_tanh without biases, on the same weights, rows and routing, in one run (docs/benchmarks.md).

The variants add per output element one multiply-add (the bias, GEMM epilogues) and a few flops per SwiGLU element;
everything else — the weight stream, which dominates decode — is the same, so the goal is a ratio ≤ 1.10 at 1 and
16 rows. Calls are interleaved (plain, variant, plain, variant, …) so drift hits both alike; the table gives the
median time of each and the median of the per-pair ratios.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_expert_variants.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_expert_variants.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import static_moe
from static_moe.activations import DEFAULT_ALPHA
from static_moe.testing.generators import make_activations, make_routing, make_weights

# gpt-oss-20b's expert shape (H = I = 2880, top-4 of 32) rounded up to the multiple of 128 the ops need.
HIDDEN, INTER, TOPK, NUM_EXPERTS = 2944, 2944, 4, 32
VARIANTS = {
    "silu": dict(activation="silu", biases=False),
    "swiglu_oai+bias": dict(activation="swiglu_oai", biases=True),
    "gelu_tanh": dict(activation="gelu_tanh", biases=False),
}


def _call(args, limit, variant, b13, b2):
    return static_moe.local_experts(
        *args,
        limit,
        activation=variant["activation"],
        alpha=DEFAULT_ALPHA,
        w13_bias=b13 if variant["biases"] else None,
        w2_bias=b2 if variant["biases"] else None,
    )


def measure(pair, rows, num_local, repeats, seed=0) -> dict[str, dict]:
    act, wf = pair
    w = make_weights(num_local, HIDDEN, INTER, wf, seed=seed)
    x, xs = make_activations(rows, HIDDEN, act, 128, seed=seed + 1)
    # every routed id is one of this rank's num_local experts, as when the model's experts are spread over ranks
    idx, tw = make_routing(rows, TOPK, num_local, seed=seed + 2)
    b13 = torch.randn(num_local, 2 * INTER) * 0.1
    b2 = torch.randn(num_local, HIDDEN) * 0.1
    args = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], 0)
    for v in VARIANTS.values():  # warm-up: pages, OpenMP team, caches of the routing
        _call(args, 7.0, v, b13, b2)
    times = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, v in VARIANTS.items():
            t0 = time.perf_counter()
            _call(args, 7.0, v, b13, b2)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name in VARIANTS:
        ratios = [a / b for a, b in zip(times[name], times["silu"])]
        out[name] = dict(median_ms=1e3 * statistics.median(times[name]), ratio=statistics.median(ratios))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--pairs", nargs="+", default=["fp8xfp8", "bf16xfp4", "bf16xbf16"], help="act x weight formats")
    p.add_argument("--local-experts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--quick", action="store_true", help="2 local experts, 9 repeats")
    a = p.parse_args()
    num_local, repeats = (2, 9) if a.quick else (a.local_experts, a.repeats)
    print(
        f"local_experts variants: H={HIDDEN} I={INTER} top-{TOPK}, {num_local} local experts, {repeats} interleaved "
        f"repeats, {torch.get_num_threads()} threads"
    )
    print(
        f"| pair | rows | {' | '.join(f'{n} ms' for n in VARIANTS)} | {' | '.join(f'{n} / silu' for n in VARIANTS if n != 'silu')} |"
    )
    print("|" + " --- |" * (2 + 2 * len(VARIANTS) - 1))
    for pair in a.pairs:
        act, wf = pair.split("x")
        for rows in a.rows:
            r = measure((act, wf), rows, num_local, repeats)
            ms = " | ".join(f"{r[n]['median_ms']:.2f}" for n in VARIANTS)
            ratios = " | ".join(f"{r[n]['ratio']:.3f}" for n in VARIANTS if n != "silu")
            print(f"| {act} x {wf} | {rows} | {ms} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
