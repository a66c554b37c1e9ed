"""Layer benchmark of torch.ops.static_moe.forward (SPEC §0) at EP size S = 1 and S = 2 over gloo, against
``torch_cached`` composed with the same collectives (docs/benchmarks.md), with the collectives timed on their own.

S processes share this machine: each rank runs ``threads // S`` threads (printed), so the S ranks together use
the pinned thread count the machine's limits were measured on, and the roofline counts the bytes and FLOPs of
all S ranks. A step's time is the slowest rank's: every timed call starts after a barrier, caches flushed, and
the per-sample maximum over ranks is taken before the median.

Each rank holds L local experts (scaled down as in bench_local_experts: the routing is drawn over the real
experts and S·L of the touched ones are kept, with their real rows), capacity C = T tokens per rank.

- ``op``: ``torch.ops.static_moe.forward`` with a workspace leased for its spec (the production path: buffers
  reused across calls).
- ``torch_cached``: pack (pure torch), ``_c10d_functional.all_gather_into_tensor``, unpack, the torch_cached
  local experts (fp32 or bf16 weights cached at load, the faster kept), ``reduce_scatter_tensor``, slice, add
  the shared expert's output, bf16.
- ``collectives``: the all-gather of the [C, W] packed rows and the reduce-scatter of the fp32 [S·C, H]
  accumulator alone, on the same group (the part of a step no kernel can speed up).
- phases: five more profiled calls of the op give each rank's median time per phase (pack, all_gather, unpack,
  local_experts, reduce_scatter, combine: the op's record_function ranges); ``collective_share`` is the
  collectives' part of a step (largest over ranks; it includes waiting for the slower rank). At S > 1 each rank
  also times its local_experts call on the same gathered rows and thread count alone, while the others wait at a
  barrier, and with every rank running its own at once outside the op, in wall and process-CPU time
  (``local_experts_in_step_vs_alone``, ``..._concurrent_vs_alone``, ``..._cpu_concurrent_vs_alone``,
  ``local_experts_cpu_share``; docs/benchmarks.md): a wall ratio > 1 with a CPU ratio ≈ 1 means the ranks do
  not slow each other's execution but the host gave them less CPU time at once than one alone (shared cores).

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_forward.py --shape v4_flash --tokens 1 16 --ep 2
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_forward.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import baselines as B
import torch
from harness.checks import check_baseline, check_op, check_point
from harness.cli import add_common_args, finish, parse_pairs, resolve_args, start
from harness.costs import Cost, cost_forward, roofline
from harness.report import Report, json_default, progress
from harness.routing import routing_stats
from harness.timing import flush_caches, measure, time_fastest_variant, time_fn
from harness.workload import bench_weights, local_experts_for

from static_moe.testing.generators import SlicedRouting, sliced_routing
from static_moe.testing.machine import bf16_dot_products
from static_moe.testing.profiling import quiet_stderr

BENCH = "forward"
DEFAULT_PAIRS = [("fp8", "fp4")]
EP_SIZES = (1, 2)
GROUP = 128


def run(
    report: Report,
    shapes: list[str],
    tokens: list[int],
    quick: bool,
    pairs: list[tuple[str, str]] = DEFAULT_PAIRS,
    ep_sizes: tuple[int, ...] = EP_SIZES,
    swiglu_limit: float | None = None,
) -> list[dict]:
    """Spawn S rank processes per EP size; append one record per (S, shape, pair, tokens) to ``report``."""
    import torch.multiprocessing as mp

    records = []
    for s in ep_sizes:
        cfg = {
            "shapes": shapes,
            "tokens": tokens,
            "quick": quick,
            "pairs": pairs,
            "ep_size": s,
            "threads": report.limits.threads,
            "swiglu_limit": swiglu_limit,
        }
        print(
            f"[{BENCH}] S={s}: {s} rank process(es) over gloo, {max(1, report.limits.threads // s)} thread(s) each",
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="static_moe_bench_") as tmp:
            out_path = Path(tmp) / "records.json"
            mp.spawn(_worker, args=(s, cfg, str(Path(tmp) / "store"), str(out_path)), nprocs=s, join=True)
            got = json.loads(out_path.read_text())
        for rec in got:
            cost = Cost(**rec.pop("cost"))
            rec.update(
                roofline(
                    cost,
                    report.limits,
                    rec["op"].get("median_s") if rec["op"]["available"] else None,
                    bf16_dot_products(rec["act"]),
                )
            )
            records.append(report.add(rec))
            progress(rec)
    return records


# ----------------------------------------------------------------------------------------------------------------
# Rank processes
# ----------------------------------------------------------------------------------------------------------------
def _worker(rank: int, s: int, cfg: dict, store_path: str, out_path: str) -> None:
    import torch.distributed as dist

    threads = max(1, cfg["threads"] // s)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=s, timeout=timedelta(seconds=600)
    )
    records = []
    try:
        for shape_key in cfg["shapes"]:
            records += _run_shape(rank, s, shape_key, cfg, threads)
    finally:
        if rank == 0:
            Path(out_path).write_text(json.dumps(records, default=json_default))
        dist.destroy_process_group()


def _rank_inputs(shape, act_fmt: str, tokens: int, rank: int, routing: SlicedRouting) -> dict:
    """Rank ``rank``'s tokens: x (+ x_scale), its routing, a bf16 shared-expert output; deterministic."""
    from static_moe.testing.generators import gen, make_activations

    x, xs = make_activations(tokens, shape.hidden, act_fmt, GROUP, seed=1000 * rank + tokens)
    shared = (torch.randn(tokens, shape.hidden, generator=gen(2000 * rank + tokens)) * 0.1).to(torch.bfloat16)
    return {
        "x": x,
        "x_scale": xs,
        "topk_idx": routing.topk_idx[rank],
        "topk_weights": routing.topk_weights[rank],
        "shared": shared,
    }


def _rank_weights(num_local: int, shape, w_fmt: str, rank: int) -> dict:
    return bench_weights(num_local, shape.hidden, shape.intermediate, w_fmt, seed=10 + rank)


def _run_shape(rank: int, s: int, shape_key: str, cfg: dict, threads: int) -> list[dict]:
    from static_moe.testing.generators import MODEL_SHAPES

    shape = MODEL_SHAPES[shape_key]
    # The op rejects top-k > num_experts (= S·L), so keep at least ceil(k / S) experts per rank.
    num_local = max(local_experts_for(shape_key, cfg["quick"]), -(-shape.topk // s))
    pairs = [tuple(p) for p in cfg["pairs"]]
    t_check = check_point(cfg["tokens"])
    records = []
    if rank == 0:
        print(
            f"[{BENCH}] S={s} {shape.name}: H={shape.hidden} I={shape.intermediate} k={shape.topk}; local "
            f"experts scaled to {num_local} per rank ({s * num_local} of {shape.num_experts} kept)",
            flush=True,
        )
    for w_fmt in dict.fromkeys(w for _, w in pairs):
        w = _rank_weights(num_local, shape, w_fmt, rank)
        cached = {
            dt: B.TorchCached(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], dtype=dt)
            for dt in (torch.float32, torch.bfloat16)
        }
        for act_fmt in [a for a, wf in pairs if wf == w_fmt]:
            for t in cfg["tokens"]:
                rec = _measure_step(
                    rank,
                    s,
                    shape_key,
                    shape,
                    num_local,
                    act_fmt,
                    w_fmt,
                    t,
                    w,
                    cached,
                    cfg["swiglu_limit"],
                    check=(t == t_check),
                )
                if rank == 0:
                    rec["threads_per_rank"] = threads
                    records.append(rec)
        del cached, w
    return records


def _measure_step(rank, s, shape_key, shape, num_local, act_fmt, w_fmt, t, w, cached, limit, check) -> dict:
    import torch.distributed as dist

    from static_moe import reference
    from static_moe.reference.pack_rows import pack_layout, part_nbytes

    fc = torch.ops._c10d_functional
    group = dist.group.WORLD
    gname = group.group_name
    num_experts = s * num_local
    cap = t
    routing = sliced_routing(shape, [t] * s, num_experts, seed=t)
    inp = _rank_inputs(shape, act_fmt, t, rank, routing)
    x, xs, idx, tw, shared = inp["x"], inp["x_scale"], inp["topk_idx"], inp["topk_weights"], inp["shared"]
    parts = [x] + ([xs] if xs is not None else []) + [idx.to(torch.int32), tw.float()]
    spans, width = pack_layout([part_nbytes(p) for p in parts])

    def barrier():
        dist.barrier(group)

    def slowest(samples: list[float]) -> list[float]:
        v = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
        return v.tolist()

    timer = {"cold": True, "before": barrier, "reduce": slowest}

    # --- the op, on a leased workspace -----------------------------------------------------------------------
    op_args = (
        x,
        xs,
        idx,
        tw,
        w["w13"],
        w["w13_scale"],
        w["w2"],
        w["w2_scale"],
        shared,
        num_experts,
        cap,
        limit,
        gname,
        rank,
        s,
    )
    lease, ws_note = _lease_workspace(op_args, group)
    try:
        op, out = measure(lambda: torch.ops.static_moe.forward(*op_args), **timer)
        phases = _phases(lambda: torch.ops.static_moe.forward(*op_args), barrier) if op["available"] else None
    finally:
        if lease is not None:
            lease.close()
    op["workspace"] = ws_note

    # --- torch_cached composed with the same collectives -------------------------------------------------------
    def cached_step(c: B.TorchCached) -> torch.Tensor:
        send = reference.pack_rows(parts, cap)
        gathered = fc.wait_tensor(fc.all_gather_into_tensor(send, s, gname)) if s > 1 else send
        g = [reference.unpack_rows(gathered, off, n, p.dtype, list(p.shape[1:])) for (off, n), p in zip(spans, parts)]
        acc = c.local_experts(g[0], g[1] if xs is not None else None, g[-2], g[-1], rank * num_local, limit)
        scattered = fc.wait_tensor(fc.reduce_scatter_tensor(acc, "sum", s, gname)) if s > 1 else acc
        return (scattered[:t] + shared.float()).to(torch.bfloat16)

    cached_entry, cached_out = time_fastest_variant(cached, cached_step, **timer)
    base = {"torch_cached": cached_entry}

    # --- the collectives alone ---------------------------------------------------------------------------------
    coll = None
    if s > 1:
        send_buf = torch.full((cap, width), 0xFF, dtype=torch.uint8)
        acc_buf = torch.zeros(s * cap, shape.hidden)

        def collectives():
            fc.wait_tensor(fc.all_gather_into_tensor(send_buf, s, gname))
            return fc.wait_tensor(fc.reduce_scatter_tensor(acc_buf, "sum", s, gname))

        coll, _ = time_fn(collectives, **timer)

    # --- this rank's local experts on the same gathered rows: alone (every other rank waits at a barrier) and
    # with every rank running its own at once, as in a step; wall time and this thread's CPU time ------------------
    alone = None
    if s > 1 and phases is not None:
        gathered = fc.wait_tensor(fc.all_gather_into_tensor(reference.pack_rows(parts, cap), s, gname))
        g = [reference.unpack_rows(gathered, off, n, p.dtype, list(p.shape[1:])) for (off, n), p in zip(spans, parts)]
        le_args = (
            g[0],
            g[1] if xs is not None else None,
            g[-2],
            g[-1],
            w["w13"],
            w["w13_scale"],
            w["w2"],
            w["w2_scale"],
            rank * num_local,
            limit,
            448.0,
        )
        alone = _alone_and_concurrent(lambda: torch.ops.static_moe.local_experts(*le_args), rank, s, barrier)
    if phases is not None:
        per_rank = [None] * s
        dist.all_gather_object(per_rank, (phases, alone), group=group)
        op["phases_s"] = [ph for ph, _ in per_rank]
        if s > 1:
            for key in ALONE_KEYS:
                op[f"local_experts_{key}"] = [a[key] for _, a in per_rank]

    # --- once per configuration: every rank's outputs against the reference ------------------------------------
    if check:
        outs = [None] * s
        dist.all_gather_object(outs, (out, cached_out), group=group)
        if rank == 0:
            _check_against_reference(
                op, base, outs, shape, shape_key, s, num_local, act_fmt, w_fmt, t, routing, num_experts, cap, limit
            )
        dist.barrier(group)

    if rank != 0:
        return {}
    gathered_idx = torch.cat(routing.topk_idx)  # C = T: no padded rows
    stats = [routing_stats(gathered_idx, r * num_local, num_local) for r in range(s)]
    row_bytes = sum(part_nbytes(p) for p in parts)
    cost = cost_forward(
        act_fmt, w_fmt, t, cap, s, row_bytes, width, shape.hidden, shape.intermediate, shape.topk, stats, GROUP
    )
    touched = sum(st.experts_touched for st in stats)
    pairs = sum(st.pairs for st in stats)
    rec = {
        "bench": BENCH,
        "ep_size": s,
        "shape": shape_key,
        "fmt": f"{act_fmt}×{w_fmt}",
        "act": act_fmt,
        "weight": w_fmt,
        "tokens": t,
        "capacity": cap,
        "rows": s * cap,
        "op": op,
        "baselines": base,
        "cost": {"bytes": cost.bytes, "flops": cost.flops, "read_bytes": cost.read_bytes},
        "pairs": pairs,
        "experts_touched": touched,
        "experts_real": routing.touched_real,
        "experts": f"{touched}/{routing.touched_real}",
        "rows_per_expert": pairs / max(touched, 1),
        "local_experts": num_local,
        "local_experts_real": shape.num_experts // s,
    }
    if coll is not None:
        rec.update(collective_s=coll.median_s, collective_samples_s=coll.samples_s)
    if "phases_s" in op:
        # The collectives' share of a step, from the op's own phases (their time includes waiting for the slower
        # rank), the largest over ranks; and a rank's local experts inside the step against the same call alone.
        rec["collective_share"] = max(
            (ph["all_gather"] + ph["reduce_scatter"]) / max(sum(ph.values()), 1e-12) for ph in op["phases_s"]
        )
        if "local_experts_alone_s" in op:
            alone_s, conc_s = op["local_experts_alone_s"], op["local_experts_concurrent_s"]
            rec["local_experts_in_step_vs_alone"] = max(
                ph["local_experts"] / a for ph, a in zip(op["phases_s"], alone_s) if a
            )
            # The same ratio with no op around the call: both ranks' local_experts at once, against alone. When it
            # matches the in-step ratio, the op adds nothing; the ranks slow each other by running at the same time.
            rec["local_experts_concurrent_vs_alone"] = max(c / a for c, a in zip(conc_s, alone_s) if a)
            # The rank's CPU seconds per call, concurrent against alone: ≈ 1 when neither rank slows the other's
            # execution (shared caches or bandwidth would raise it); the wall ratio above it is then CPU time the
            # host did not give the rank (cpu_share: CPU seconds / (wall seconds × threads), lowest over ranks).
            rec["local_experts_cpu_concurrent_vs_alone"] = max(
                c / a for c, a in zip(op["local_experts_concurrent_cpu_s"], op["local_experts_alone_cpu_s"]) if a
            )
            rec["local_experts_cpu_share"] = {
                k: min(
                    c / (wl * torch.get_num_threads())
                    for c, wl in zip(op[f"local_experts_{k}_cpu_s"], op[f"local_experts_{k}_s"])
                    if wl
                )
                for k in ("alone", "concurrent")
            }
            if rank == 0:
                print(
                    f"[{BENCH}] S={s} {shape_key} {act_fmt}×{w_fmt} T={t}: local_experts in step / alone "
                    f"×{rec['local_experts_in_step_vs_alone']:.2f}, both ranks at once / alone (wall) "
                    f"×{rec['local_experts_concurrent_vs_alone']:.2f}, (CPU time) "
                    f"×{rec['local_experts_cpu_concurrent_vs_alone']:.2f}; CPU share alone "
                    f"{rec['local_experts_cpu_share']['alone']:.0%}, at once "
                    f"{rec['local_experts_cpu_share']['concurrent']:.0%}",
                    flush=True,
                )
    return rec


ALONE_KEYS = ("alone_s", "alone_cpu_s", "concurrent_s", "concurrent_cpu_s")


def _alone_and_concurrent(call, rank: int, s: int, barrier, repeat: int = 5) -> dict[str, float]:
    """Median wall and process-CPU seconds of ``call``, cold: (a) alone, each rank in turn while the others wait
    in a gloo barrier (gloo does not busy-poll, so the waiting ranks leave the cores to it), and (b) concurrent,
    every rank at once after one barrier, as inside a step. Process CPU time counts the OpenMP workers too (and their spinning,
    if any); the gloo threads add next to nothing while no collective runs."""
    import statistics
    import time

    call()  # warm-up
    got = {k: [] for k in ALONE_KEYS}

    def timed(key: str) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        call()
        got[key + "_s"].append(time.perf_counter() - t0)
        got[key + "_cpu_s"].append(time.process_time() - c0)

    for _ in range(repeat):
        for r in range(s):
            if r == rank:
                flush_caches()
            barrier()
            if r == rank:
                timed("alone")
        barrier()
        flush_caches()
        barrier()
        timed("concurrent")
    barrier()
    return {k: statistics.median(v) for k, v in got.items()}


PROFILED_CALLS = 5  # forward calls profiled per point for the phase breakdown (after the timed ones)


def _phases(call, barrier, n: int = PROFILED_CALLS) -> dict[str, float]:
    """Median seconds per call of each phase of forward on this rank (the op's record_function ranges), over
    ``n`` cold calls each after a barrier, as the timed ones (the median, like every other figure here, so that
    the in-step local_experts compares with the same call timed alone)."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    from static_moe.ops.forward import PHASE_PREFIX, PHASES

    got = {p: [0.0] * n for p in PHASES}
    prof = profile(activities=[ProfilerActivity.CPU])
    with quiet_stderr():  # the profiler's C++ side prints a line at every start and stop
        prof.start()
    for _ in range(n):
        flush_caches()
        barrier()
        call()
    with quiet_stderr():
        prof.stop()
    seen = {p: 0 for p in PHASES}
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        if ev.name.startswith(PHASE_PREFIX):
            ph = ev.name[len(PHASE_PREFIX) :]
            if ph in got and seen[ph] < n:  # one range per phase per call, in call order
                got[ph][seen[ph]] = ev.time_range.elapsed_us() * 1e-6
                seen[ph] += 1
    return {p: statistics.median(v) for p, v in got.items()}


def _lease_workspace(op_args, group):
    """A workspace lease for the op's spec (collective when S > 1), or None and why not."""
    s = op_args[-1]
    if s == 1:
        return None, "none needed (S = 1)"
    try:
        from static_moe import workspace
        from static_moe.ops.forward import check_forward, workspace_spec

        dims = check_forward(*op_args[:12], op_args[13], op_args[14])
        spec = workspace_spec(dims, op_args[9], op_args[10], s, op_args[0].device, swiglu_limit=op_args[11])
        return workspace.acquire(spec, group), "leased"
    except Exception as e:  # noqa: BLE001  the op still runs on temporaries; say so in the record
        return None, f"none ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def _check_against_reference(
    op, base, outs, shape, shape_key, s, num_local, act_fmt, w_fmt, t, routing, num_experts, cap, limit
) -> None:
    """On rank 0: rebuild every rank's inputs and weights, run reference.forward_simulated, compare."""
    from static_moe import reference
    from static_moe.testing.numeric import assert_gemm_close

    ins = [_rank_inputs(shape, act_fmt, t, r, routing) for r in range(s)]
    ws = [_rank_weights(num_local, shape, w_fmt, r) for r in range(s)]
    refs = reference.forward_simulated(
        [i["x"] for i in ins],
        [i["x_scale"] for i in ins],
        [i["topk_idx"] for i in ins],
        [i["topk_weights"] for i in ins],
        [w["w13"] for w in ws],
        [w["w13_scale"] for w in ws],
        [w["w2"] for w in ws],
        [w["w2_scale"] for w in ws],
        [i["shared"] for i in ins],
        num_experts,
        cap,
        limit,
    )
    what = f"{BENCH} S={s} {shape_key} {act_fmt}x{w_fmt} T={t}"
    ref = torch.cat(refs)
    cached = torch.cat([o[1] for o in outs])
    base["torch_cached"]["calc_diff_vs_reference"] = check_baseline(
        "torch_cached", cached, ref, B.CHECK_TOLERANCE["torch_cached"], what
    )
    if op["available"]:
        got = torch.cat([o[0] for o in outs])
        op["parity"] = check_op(got, ref, lambda o, r: assert_gemm_close(o, r, what))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(p)
    p.add_argument("--pairs", nargs="+", default=None, help="act×weight pairs as actxweight (default: fp8xfp4)")
    p.add_argument("--ep", type=int, nargs="+", default=list(EP_SIZES), help="EP sizes (default: 1 2)")
    p.add_argument("--swiglu-limit", type=float, default=None)
    args = p.parse_args(argv)
    shapes, tokens = resolve_args(args)
    report = start(args, BENCH)
    run(report, shapes, tokens, args.quick, parse_pairs(args.pairs, DEFAULT_PAIRS), tuple(args.ep), args.swiglu_limit)
    finish(report, args, BENCH, [BENCH])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
