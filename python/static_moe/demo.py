"""The main job (``make demo``): one DeepSeek-V4-Flash-shaped MoE layer, expert-parallel over 2 gloo ranks.

    OMP_NUM_THREADS=2 python -m static_moe.demo [--experts 16] [--tokens 16] [--steps 5]

Each rank builds a :class:`static_moe.StaticMoE` (hidden 4096, intermediate 2048, top-6, FP4 e2m1 routed
experts with UE8M0 1×32 scales, fp8 activations with 1×128 scales, an fp8 shared expert of intermediate 2048),
runs decode steps of ``--tokens`` tokens per rank, and prints:

* parity: every rank's output against ``reference.forward_simulated`` (SPEC §2 tolerance), "parity OK" or not;
* per-step latency (median over steps of the slowest rank; every step starts after a barrier);
* the collectives' share of a step (all-gather + reduce-scatter, from the op's torch.profiler ranges);
* bytes of expert weights touched per step, and the roofline fraction (docs/benchmarks.md): per rank,
  ``max(weight bytes / read bandwidth + other bytes / triad bandwidth, flops / peak)`` over the measured step,
  with the read-only stream (weights are only read), the STREAM triad and the matmul peak of the units the
  kernels use (bf16 where they multiply with vdpbf16ps, as here on AVX512_BF16 CPUs: fp8 activations with
  power-of-two scales; else fp32) measured here (``static_moe.testing.machine``, as the benchmarks do), on both
  ranks at once, with the same thread count, before and after the steps (the better of the two is taken).

Scale: the real model has 256 routed experts. Routing is drawn over all 256 (top-6, per token); only
``--experts`` of the experts those tokens touch are kept (global ids 0 … E−1, E/2 per rank), each with exactly
its real rows, and slots routed to the others become −1 (experts of ranks not simulated). So rows per expert,
hence weight traffic per row and compute intensity, are those of the full model at this batch; only the
number of experts computed shrinks, and the scale is printed (``static_moe.testing.generators.sliced_routing``,
as the benchmarks scale their shapes).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

import torch

from .testing.distributed import gather_objects
from .testing.generators import MODEL_SHAPES, sliced_routing
from .testing.machine import bf16_dot_products, measure_bandwidth, measure_flops, measure_read_bandwidth
from .testing.profiling import quiet_stderr

REAL = MODEL_SHAPES["v4_flash"]  # hidden 4096, intermediate 2048, 256 routed experts, top-6
ACT_GROUP = 128
LIMIT = 10.0
# Machine limits (docs/benchmarks.md), measured on every rank at once: STREAM triad over 3 float32 arrays of this many
# bytes each (far beyond the LLC), a read-only sum over one array of 3× that, matmuls of this size.
TRIAD_ARRAY_BYTES = 256 << 20
MATMUL_N = 1536


# ----------------------------------------------------------------------------------------------------------------
# Inputs (deterministic on every rank)
# ----------------------------------------------------------------------------------------------------------------
def random_fp4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP4 weights [n, k]: uniform e2m1 codes (both signs) packed two per byte, and UE8M0 1×32 scales
    of 2^e or 2^(e+1), e chosen so that the weights' RMS is about 1/sqrt(k) (a fan-in initialisation). Made
    directly in the format, which is much faster here than quantizing float weights."""
    from .formats import pack_fp4

    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    e2m1_rms = 2.93  # RMS of the 8 e2m1 magnitudes 0 … 6 drawn uniformly
    e = round(math.log2(k**-0.5 / e2m1_rms)) - 1
    scales = (127 + e + torch.randint(0, 2, (n, k // 32), generator=g)).to(torch.uint8)
    return pack_fp4(codes), scales


def expert_weights(global_ids, seed: int) -> dict:
    """FP4 weights of the given global experts, each from its own seed (so any rank can rebuild any)."""
    from .testing.generators import gen

    h, i = REAL.hidden, REAL.intermediate
    parts = {"w13": [], "w13_scale": [], "w2": [], "w2_scale": []}
    for e in global_ids:
        g = gen(seed * 1000 + e)
        w13, w13_s = random_fp4(2 * i, h, g)
        w2, w2_s = random_fp4(h, i, g)
        for name, t in zip(parts, (w13, w13_s, w2, w2_s)):
            parts[name].append(t)
    return {n: torch.stack(v) for n, v in parts.items()}


def shared_weights(seed: int) -> dict:
    from .formats import quantize_weight_fp8
    from .testing.generators import gen

    h, i = REAL.hidden, REAL.intermediate
    g = gen(seed * 1000 + 999)
    w13, w13_s = quantize_weight_fp8(torch.randn(1, 2 * i, h, generator=g) / h**0.5)
    w2, w2_s = quantize_weight_fp8(torch.randn(1, h, i, generator=g) / i**0.5)
    return {"w13": w13, "w13_scale": w13_s, "w2": w2, "w2_scale": w2_s}


def hidden_states(tokens: int, rank: int, seed: int) -> torch.Tensor:
    from .testing.generators import gen

    return torch.randn(tokens, REAL.hidden, generator=gen(seed * 31 + rank)).to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------------------------


def _say(rank: int, t0: float, msg: str) -> None:
    if rank == 0:
        print(f"[demo +{time.perf_counter() - t0:4.0f} s] {msg}", flush=True)


def rank_main(rank: int, size: int, cfg: dict) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    # The demo checks its own output against the executable spec, so it imports the reference; no production
    # module does (tests/project/test_package_boundaries.py).
    from . import reference
    from .module import StaticMoE
    from .ops.forward import PHASE_PREFIX, PHASES
    from .testing.numeric import assert_gemm_close, calc_diff

    world = dist.group.WORLD
    e, t, cap, seed = cfg["experts"], cfg["tokens"], cfg["capacity"], cfg["seed"]
    h, inter, k = REAL.hidden, REAL.intermediate, REAL.topk
    num_local = e // size
    mine = list(range(rank * num_local, (rank + 1) * num_local))
    t0 = time.perf_counter()

    # --- the layer ----------------------------------------------------------------------------------------------
    _say(rank, t0, f"building {num_local} FP4 experts per rank and an fp8 shared expert ...")
    w = expert_weights(mine, seed)
    sw = shared_weights(seed)
    layer = StaticMoE(
        h,
        inter,
        e,
        k,
        cap,
        weight_format="fp4",
        act_format="fp8",
        act_group=ACT_GROUP,
        swiglu_limit=LIMIT,
        shared_intermediate_size=inter,
        shared_weight_format="fp8",
        ep_group=world,
    )
    layer.set_expert_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    layer.shared.set_weights(sw["w13"], sw["w13_scale"], sw["w2"], sw["w2_scale"])

    # --- machine limits, both ranks at once (again after the steps: the best of the two is the limit, since other
    #     jobs on a shared machine only ever lower a measurement) ---------------------------------------------------
    def machine_limits():
        dist.barrier()
        bw = measure_bandwidth(TRIAD_ARRAY_BYTES)
        dist.barrier()
        read_bw = measure_read_bandwidth(3 * TRIAD_ARRAY_BYTES)
        dist.barrier()
        dtype = torch.bfloat16 if bf16_dot_products("fp8") else torch.float32  # the units the kernels use
        return bw, read_bw, measure_flops(MATMUL_N, dtype=dtype)

    _say(rank, t0, "measuring bandwidth (STREAM triad, read-only sum) and the matmul peak on both ranks at once ...")
    limits = [machine_limits()]

    # --- steps --------------------------------------------------------------------------------------------------
    steps = []
    for s in range(cfg["warmup"] + cfg["steps"]):
        routing = sliced_routing(REAL, [t] * size, e, seed=seed + 100 * s)
        steps.append(
            (hidden_states(t, rank, seed + 100 * s), routing.topk_idx[rank], routing.topk_weights[rank], routing)
        )
    _say(rank, t0, f"running {cfg['warmup']} warm-up + {cfg['steps']} timed steps of {t} tokens per rank ...")
    outs, timed = [], []
    ws_ptrs = layer.workspace.data_ptrs()

    def step(x, idx, tw):
        dist.barrier()
        t1 = time.perf_counter()
        outs.append(layer(x, idx, tw))
        return time.perf_counter() - t1

    for x, idx, tw, _ in steps[: cfg["warmup"]]:
        step(x, idx, tw)
    prof = profile(activities=[ProfilerActivity.CPU])  # the op's phases are record_function ranges
    with quiet_stderr():
        prof.start()
    for x, idx, tw, _ in steps[cfg["warmup"] :]:
        timed.append(step(x, idx, tw))
    with quiet_stderr():
        prof.stop()
    assert layer.workspace.data_ptrs() == ws_ptrs, "workspace buffers moved"
    limits.append(machine_limits())
    bandwidth, read_bandwidth, peak = (max(lim[i] for lim in limits) for i in range(3))
    phase_s = {p: 0.0 for p in PHASES}
    for ev in prof.key_averages():
        if ev.key.startswith(PHASE_PREFIX):
            phase_s[ev.key[len(PHASE_PREFIX) :]] += ev.cpu_time_total * 1e-6 / len(timed)

    # --- bytes and FLOPs of this rank's step (docs/benchmarks.md roofline) -------------------------------------------
    per_expert = sum(w[n][0].numel() * w[n].element_size() for n in w)
    shared_bytes = sum(v.numel() * v.element_size() for v in sw.values())
    costs = []
    for _, _, _, routing in steps[cfg["warmup"] :]:
        gathered_idx = torch.cat(routing.topk_idx).long()
        rows = [int((gathered_idx == g).any(dim=1).sum()) for g in mine]
        touched = sum(r > 0 for r in rows)
        weight_bytes = touched * per_expert + shared_bytes
        act_bytes = size * cap * (h + 4 * h // ACT_GROUP + 8 * k) + 4 * size * cap * h + 2 * t * h
        flops = sum(2 * r * 3 * h * inter for r in rows) + 2 * t * 3 * h * inter
        costs.append((touched, weight_bytes, weight_bytes + act_bytes, flops, sum(rows), routing.touched_real))

    rank_report = {
        "times": timed,
        "phase_s": phase_s,
        "bandwidth": bandwidth,
        "read_bandwidth": read_bandwidth,
        "peak": peak,
        "costs": costs,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weights_bytes": num_local * per_expert + shared_bytes,
        "workspace_bytes": layer.workspace.nbytes(),
    }

    # --- parity: rank 0 rebuilds every rank's experts and runs the single-process reference ---------------------
    _say(rank, t0, "checking parity against reference.forward_simulated (rank 0 rebuilds every expert) ...")
    parity_steps = [0, len(steps) - 1]
    gathered = gather_objects([outs[s] for s in parity_steps])
    if rank == 0:
        from .formats import quantize_activation

        all_w = [w if r == 0 else expert_weights(range(r * num_local, (r + 1) * num_local), seed) for r in range(size)]
        checks = []
        for j, s in enumerate(parity_steps):
            _, _, _, routing = steps[s]
            xs = [quantize_activation(hidden_states(t, r, seed + 100 * s), ACT_GROUP) for r in range(size)]
            shared_out = [
                reference.local_experts(
                    xq,
                    xsc,
                    torch.zeros(t, 1, dtype=torch.int32),
                    torch.ones(t, 1),
                    sw["w13"],
                    sw["w13_scale"],
                    sw["w2"],
                    sw["w2_scale"],
                    0,
                    LIMIT,
                )
                for xq, xsc in xs
            ]
            refs = reference.forward_simulated(
                [a for a, _ in xs],
                [b for _, b in xs],
                routing.topk_idx,
                routing.topk_weights,
                [a["w13"] for a in all_w],
                [a["w13_scale"] for a in all_w],
                [a["w2"] for a in all_w],
                [a["w2_scale"] for a in all_w],
                shared_out,
                e,
                cap,
                LIMIT,
            )
            for r in range(size):
                out = gathered[r][j]
                try:
                    assert_gemm_close(out, refs[r], f"step {s} rank {r}")
                    ok, why = True, ""
                except AssertionError as err:
                    ok, why = False, str(err)
                checks.append((s, r, calc_diff(out, refs[r]), ok, why))
        rank_report["parity"] = checks
        _say(rank, t0, "parity checked")
    dist.barrier()
    layer.close()
    return rank_report


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def report(cfg: dict, ranks: list[dict], threads: int) -> bool:
    from .workspace import WorkspaceSpec, memory_plan

    size, e, t = cfg["ranks"], cfg["experts"], cfg["tokens"]
    n = len(ranks[0]["times"])
    step_s = [max(r["times"][i] for r in ranks) for i in range(n)]
    median = statistics.median(step_s)
    print()
    print(
        f"DeepSeek-V4-Flash-shaped MoE layer: hidden {REAL.hidden}, intermediate {REAL.intermediate}, "
        f"top-{REAL.topk}; FP4 (e2m1 + UE8M0 1x32) routed experts, fp8 activations (1x{ACT_GROUP}), fp8 shared "
        f"expert, swiglu_limit {LIMIT}"
    )
    touched_real = [c[5] for c in ranks[0]["costs"]]
    print(
        f"scale: {e} of the model's {REAL.num_experts} routed experts kept ({e // size} per rank, 1/"
        f"{REAL.num_experts // e} of the model); the {t * size} tokens of a step touch "
        f"{statistics.median(touched_real):.0f} real experts (median), {e} of them are computed with their real "
        "rows, slots of the others are empty"
    )
    print(
        f"EP size {size} over gloo on this machine, {threads} thread(s) per rank; tokens per rank T = {t}, "
        f"capacity C = {cfg['capacity']}; {n} timed steps after {cfg['warmup']} warm-up"
    )
    spec = WorkspaceSpec(
        capacity=cfg["capacity"],
        hidden=REAL.hidden,
        intermediate=REAL.intermediate,
        num_experts=e,
        topk=REAL.topk,
        ep_size=size,
        act_format="fp8",
        act_group=ACT_GROUP,
        weight_format="fp4",
    )
    print(
        f"memory per rank: expert + shared weights {_fmt_bytes(ranks[0]['weights_bytes'])}, workspace "
        f"{_fmt_bytes(memory_plan(spec).total_bytes)} (= (S+1)·C·(W+4H), W = {spec.row_width}), peak RSS "
        f"{_fmt_bytes(max(r['maxrss'] for r in ranks))}"
    )

    parity = ranks[0]["parity"]
    ok = all(c[3] for c in parity)
    worst = max(c[2] for c in parity)
    print()
    print(
        f"parity vs reference.forward_simulated ({len(parity)} rank outputs, SPEC §2: calc_diff < 1e-5 and "
        f"elementwise bound): {'parity OK' if ok else 'parity FAILED'}; worst calc_diff {worst:.2e}"
    )
    for s, r, _diff, good, why in parity:
        if not good:
            print(f"  step {s} rank {r}: {why}")

    print()
    print(
        f"per-step latency (slowest rank, median of {n}): {median * 1e3:.1f} ms  "
        f"[min {min(step_s) * 1e3:.1f}, max {max(step_s) * 1e3:.1f}]"
    )
    print("phases of torch.ops.static_moe.forward per step (ms, mean per rank):")
    phases = {p: statistics.mean(r["phase_s"][p] for r in ranks) for p in ranks[0]["phase_s"]}
    rank_step = statistics.mean(statistics.median(r["times"]) for r in ranks)
    print(
        "  "
        + "  ".join(f"{p} {v * 1e3:.2f}" for p, v in phases.items())
        + f"  | outside the op (quantize, shared expert) {(rank_step - sum(phases.values())) * 1e3:.2f}"
    )
    coll = phases["all_gather"] + phases["reduce_scatter"]
    print(
        f"collectives' share of a step: {coll / rank_step:.1%} (all-gather {phases['all_gather'] * 1e3:.2f} ms + "
        f"reduce-scatter {phases['reduce_scatter'] * 1e3:.2f} ms, waiting for the slower rank included)"
    )

    print()
    touched = [sum(r["costs"][i][0] for r in ranks) for i in range(n)]
    wbytes = [sum(r["costs"][i][1] for r in ranks) for i in range(n)]
    rows = [sum(r["costs"][i][4] for r in ranks) for i in range(n)]
    print(
        f"expert weights touched per step (all ranks): {_fmt_bytes(statistics.median(wbytes))} "
        f"({statistics.median(touched):.0f} of {e} routed experts, {statistics.median(rows):.0f} expert-rows, "
        f"plus the shared expert on each rank)"
    )
    fractions, bounds = [], []
    for i in range(n):
        per_rank = []
        for r in ranks:
            _, weight_bytes, nbytes, flops, _, _ = r["costs"][i]
            tb = weight_bytes / max(r["read_bandwidth"], r["bandwidth"]) + (nbytes - weight_bytes) / r["bandwidth"]
            tf = flops / r["peak"]
            per_rank.append((max(tb, tf), tb, tf))
        slowest = max(per_rank)
        bounds.append(slowest)
        fractions.append(slowest[0] / step_s[i])
    bw = statistics.mean(r["bandwidth"] for r in ranks)
    rbw = statistics.mean(r["read_bandwidth"] for r in ranks)
    pk = statistics.mean(r["peak"] for r in ranks)
    b = bounds[len(bounds) // 2]
    units = "bf16" if bf16_dot_products("fp8") else "fp32"
    print(
        f"machine limits per rank (both ranks running): read-only bandwidth {rbw / 1e9:.1f} GB/s (the weights' "
        f"roof), STREAM triad {bw / 1e9:.1f} GB/s (activations, results), {units} matmul peak {pk / 1e9:.1f} "
        f"GFLOP/s (the kernels multiply in {units})"
    )
    print(
        f"roofline per step: memory term {b[1] * 1e3:.2f} ms, compute term {b[2] * 1e3:.2f} ms "
        f"({'compute' if b[2] > b[1] else 'memory'}-bound); roofline fraction {statistics.median(fractions):.1%}"
    )
    print("(a CPU without FP4 units also pays for decoding e2m1 nibbles, which the roofline does not count)")
    if statistics.median(fractions) > 1:
        print(
            f"(above 100 %: the step beat the {units} matmul ceiling measured in this run — the kernels' SIMD can "
            f"outrun torch's matmul on one thread, or other jobs loaded the machine while it was measured)"
        )
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m static_moe.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16, help="routed experts kept (global; divisible by --ranks)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank per step")
    p.add_argument("--capacity", type=int, default=None, help="capacity C (default: --tokens)")
    p.add_argument("--ranks", type=int, default=2, help="EP size (gloo processes)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before every rank is stopped")
    args = p.parse_args(argv)
    cfg = vars(args)
    cfg["capacity"] = cfg["capacity"] or args.tokens
    if args.experts % args.ranks or not REAL.topk <= args.experts <= REAL.num_experts:
        p.error(f"--experts must divide by --ranks and lie in [{REAL.topk}, {REAL.num_experts}]")
    if args.tokens > cfg["capacity"]:
        p.error("--tokens must not exceed --capacity")
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "2")) // args.ranks)

    from .demo import rank_main as rank_fn  # by its package name, so spawned ranks can import it
    from .testing.distributed import run_ranks

    t0 = time.perf_counter()
    print(
        f"[demo] {args.ranks} gloo ranks, {threads} thread(s) each; {args.experts} routed experts of "
        f"{REAL.num_experts}",
        flush=True,
    )
    ranks = run_ranks(rank_fn, args.ranks, cfg, timeout=args.timeout, pg_timeout=args.timeout, threads=threads)
    ok = report(cfg, ranks, threads)
    print(f"\n[demo] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
