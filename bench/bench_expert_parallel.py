"""Expert-parallel dispatch and combine (SPEC §7, docs/expert_parallel.md): the modelled traffic table and, as
information only, gloo step times of the three combinations on this machine.

The table is ``static_moe.expert_parallel``'s formula: bytes one rank sends per layer for the all-gather with the
fp32 and the bf16 combine, the capacity all-to-all with Cd from the 1 % rule (or ``--overflow-rate``), and
DeepEP's low-latency per-expert messages, for S = 2 … 256. ``--gloo`` also runs ``torch.ops.static_moe.forward``
on S gloo ranks of this host with every combination (a tiny shape by default) and prints the median step time
(the slowest rank's, after a barrier) and the bytes each step's collectives carried. gloo on one host is not the
network the table is about: the times say that the paths run, not how they compare on NVLink / EFA.

    .venv/bin/python bench/bench_expert_parallel.py                       # the table (DeepSeek-V3 shape)
    .venv/bin/python bench/bench_expert_parallel.py --gloo --ep 2 4       # plus gloo timings
    .venv/bin/python bench/bench_expert_parallel.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from static_moe import expert_parallel as ep

V3 = dict(hidden=7168, topk=8, num_experts=256, act_format="fp8", act_group=128)


def traffic_rows(
    sizes, capacities, *, hidden, topk, num_experts, act_format, act_group, overflow_rate=0.01
) -> list[dict]:
    """One dict per (S, C): bytes per rank per layer of each path, Cd and its modelled step overflow rate."""
    rows = []
    shape = dict(hidden=hidden, topk=topk, act_format=act_format, act_group=act_group)
    for s in sizes:
        for c in capacities:
            cd = ep.dispatch_capacity_for(c, num_experts=num_experts, topk=topk, ep_size=s, overflow_rate=overflow_rate)
            today = ep.traffic_bytes("all_gather", "fp32", capacity=c, ep_size=s, **shape)
            bf16 = ep.traffic_bytes("all_gather", "bf16", capacity=c, ep_size=s, **shape)
            a2a = ep.traffic_bytes("all_to_all", "bf16", capacity=c, ep_size=s, dispatch_capacity=cd, **shape)
            deepep = ep.deepep_low_latency_bytes(capacity=c, ep_size=s, **shape)
            rows.append(
                dict(
                    S=s,
                    C=c,
                    all_gather_fp32=today,
                    all_gather_bf16=bf16,
                    Cd=cd,
                    step_overflow=ep.step_overflow_probability(c, cd, num_experts=num_experts, topk=topk, ep_size=s),
                    all_to_all_bf16=a2a,
                    deepep_ll=deepep,
                )
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'S':>4} {'C':>4} {'today MB':>10} {'bf16 MB':>9} {'%':>6} {'Cd':>4} {'P(ovf)':>7} "
        f"{'a2a MB':>8} {'%':>6} {'DeepEP MB':>10} {'a2a/DeepEP':>10}"
    )
    for r in rows:
        t = r["all_gather_fp32"]
        print(
            f"{r['S']:>4} {r['C']:>4} {t / 1e6:>10.1f} {r['all_gather_bf16'] / 1e6:>9.1f} "
            f"{r['all_gather_bf16'] / t:>6.1%} {r['Cd']:>4} {r['step_overflow']:>7.2%} "
            f"{r['all_to_all_bf16'] / 1e6:>8.1f} {r['all_to_all_bf16'] / t:>6.1%} {r['deepep_ll'] / 1e6:>10.1f} "
            f"{r['all_to_all_bf16'] / r['deepep_ll']:>9.2f}×"
        )


def _gloo_worker(rank: int, size: int, shape: dict, iters: int) -> dict:
    import torch.distributed as dist

    from static_moe.ops.dispatch import count_collectives
    from static_moe.testing.generators import make_activations, make_routing, make_weights

    h, i, k, c, e = shape["hidden"], shape["inter"], shape["topk"], shape["capacity"], shape["experts"]
    w = make_weights(e // size, h, i, "fp8", seed=rank)
    x, xs = make_activations(c, h, "fp8", seed=10 + rank)
    idx, tw = make_routing(c, k, e, seed=20 + rank)
    cd = ep.dispatch_capacity_for(c, num_experts=e, topk=k, ep_size=size)
    out = {}
    for dispatch, combine, cap in (("all_gather", "fp32", 0), ("all_gather", "bf16", 0), ("all_to_all", "bf16", cd)):

        def step():
            return torch.ops.static_moe.forward(
                x,
                xs,
                idx,
                tw,
                w["w13"],
                w["w13_scale"],
                w["w2"],
                w["w2_scale"],
                None,
                e,
                c,
                None,
                dist.group.WORLD.group_name,
                rank,
                size,
                dispatch=dispatch,
                combine=combine,
                dispatch_capacity=cap,
            )

        step()  # workspace, warm-up
        with count_collectives() as log:
            step()
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[f"{dispatch}+{combine}"] = dict(times=times, bytes=sum(b for _, b in log), Cd=cap)
    return out


def gloo_timings(sizes, shape: dict, iters: int) -> list[dict]:
    from static_moe.testing.distributed import run_ranks

    rows = []
    for s in sizes:
        per_rank = run_ranks(_gloo_worker, s, shape, iters, timeout=600)
        for name in per_rank[0]:
            slowest = [max(r[name]["times"][j] for r in per_rank) for j in range(iters)]
            rows.append(
                dict(
                    S=s,
                    path=name,
                    Cd=per_rank[0][name]["Cd"],
                    median_ms=1e3 * statistics.median(slowest),
                    bytes_sent=per_rank[0][name]["bytes"],
                )
            )
            print(
                f"S={s:<3} {name:<18} Cd={rows[-1]['Cd']:<4} median {rows[-1]['median_ms']:8.2f} ms  "
                f"sent {rows[-1]['bytes_sent']:>10} B per rank"
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--capacities", type=int, nargs="+", default=[64, 128])
    p.add_argument("--overflow-rate", type=float, default=0.01)
    p.add_argument("--gloo", action="store_true", help="also time the three paths on gloo ranks of this host")
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="gloo EP sizes")
    p.add_argument("--gloo-shape", default="256,256,4,16,8", help="H,I,k,C,experts-per-rank for --gloo")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    rows = traffic_rows(a.sizes, a.capacities, overflow_rate=a.overflow_rate, **V3)
    print("DeepSeek-V3 (H 7168, k 8, 256 experts), fp8 activations + 1x128 scales; bytes sent per rank per layer")
    print_table(rows)
    result = dict(traffic=rows)
    if a.gloo:
        hh, ii, kk, cc, per = (int(v) for v in a.gloo_shape.split(","))
        print("\ngloo on this host (information only, not the target network):")
        result["gloo"] = [
            r
            for s in a.ep
            for r in gloo_timings([s], dict(hidden=hh, inter=ii, topk=kk, capacity=cc, experts=per * s), a.iters)
        ]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
