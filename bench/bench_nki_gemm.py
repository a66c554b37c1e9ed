"""Estimated time and HBM-roofline fraction of the fused NKI local-experts kernel (and, on request, the expert
GEMM) at decode shapes: DeepSeek-V4-Flash, DeepSeek-V3, Qwen3-30B-A3B; T = 1, 16, 128 tokens per rank; expert
parallelism EP = 1 and 8; trn2 for every format pair, trn3 for the fp8 × fp8 and fp8 × fp4 targets.

No device is needed: the kernels run through the repository's NKI interpreter (tools/nki_interpreter), whose cost
record the cost model (``nki_interpreter.cost.CostModel``: figures and assumptions in its docstring) turns into an
estimated time on one NeuronCore (the trn2 figures; trn3 rows run the trn3 target's instructions under the same
figures).
``ideal`` is the time to move the bytes the op must move at one core's share of HBM bandwidth (2.9 TB/s / 8):
the weights (scales included) of the experts some row selects, x of the rows routed here, every row's routing
and fp32 result. ``fraction = ideal / estimate``. Model numbers, not measurements.

Layer (``layer_routing``): EP ranks × T tokens routed top-k over the model's E experts (uniform); rank 0 owns
L = E/EP experts and gathers R = EP·T rows (capacity T per source rank): the tokens that name a local expert,
then padding rows. The kernel runs on weights prepared for the target (``layouts.prepare_weight``, ``layout_for``)
with M = ``chunk_rows_for(R, k, E, chunk_cap(path))`` rows per work item (``chunk_for``: as the kernel picks it).

LNC (``--lnc 1,2``): ``local_experts`` launched as ``kernel[1]`` or ``kernel[2]`` (two logical cores: core 0
runs items [0, ⌈N/2⌉), core 1 the rest and, after a ``core_barrier``, adds its staged rows).
``CostModel.estimate_programs`` times an LNC = 2 launch as the sum over the stretches between barriers of the
slower core's estimate, and ``fraction`` is then the ideal bytes over the time and over **two** cores' HBM
share (725 GB/s on trn2): the MBU of the logical core, whose ceiling per chip is the one-core ceiling.

Extrapolation: a full layer has 16–256 local experts; interpreting each takes seconds, so the cost is measured
at the real H, I and R on 1- and 2-expert layers and extrapolated per core and per stretch between barriers in
the cost model's additive features (engine seconds, DMA data seconds and count, hardware-DGE count, loop
iterations, HBM bytes; ``harness.nki_extrapolate``): ``k10 + (L−1)(k20 − k10) + n·(k11 − k10)`` with n the
core's work items of the full layer's routing (N = Σ_e ⌈C_e / M⌉; at LNC = 2 core 1's from a two-item run, see
``extrapolate``) — exact where the instruction stream is affine in L (the routing and work-list setup) and in
n (every item runs the same static body), as the model's non-linear terms (DMA fixed cost per 16 queued DMAs,
DGE per 2 instances) are applied to the combined counts. Not affine: the work-list table's size N_max (a min
over L·⌈R/M⌉ and the routing bound; filled and searched 128 items at a time), so a layer with N_max > 128 runs
⌈N_max/128⌉ − 1 table chunks more than extrapolated (Qwen3-30B-A3B EP 1 T = 128 run directly: +4·10⁻⁵ of the
time). ``--check`` runs a 4-expert, 3-item layer directly and prints the largest feature error.

    .venv/bin/python bench/bench_nki_gemm.py [--models v4_flash,v3,qwen3_30b_a3b] [--tokens 1,16,128]
                                             [--ep 1,8] [--pairs bf16xbf16,...] [--targets trn2,trn3]
                                             [--kernels local_experts,expert_gemm] [--lnc 1,2] [--check]
                                             [--json bench/results/nki_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the NKI interpreter: a development tool, not in the installed package
sys.path.insert(0, str(ROOT / "bench"))  # harness/, also when imported from a test

from harness import nki_extrapolate as nx  # noqa: E402

import nki_interpreter as interpreter  # noqa: E402
from static_moe.formats import quantize_weight  # noqa: E402
from static_moe.layouts import prepare_weight  # noqa: E402
from static_moe.nki import shim  # noqa: E402
from static_moe.nki_kernels.expert_gemm import expert_gemm_kernel  # noqa: E402
from static_moe.nki_kernels.local_experts import chunk_cap, chunk_rows_for, local_experts_kernel  # noqa: E402
from static_moe.testing.generators import FORMAT_PAIRS, MODEL_SHAPES, make_activations, make_routing  # noqa: E402

TOKENS = (1, 16, 128)  # per rank
EPS = (1, 8)
GROUP = 128
FP8_MAX = 240.0  # trn2 on-chip fp8
LIMIT = 7.0
COMPONENTS = interpreter.cost.COMPONENTS  # tensor/vector/scalar/gpsimd/sync engines, dma, dge, loop


# ------------------------------------------------------------------------------------------------- helpers
def _weights(num_local, n, k, fmt, seed=0):
    """Random weights in ``fmt``; fp4 as uint8 bytes (the kernel's dtype)."""
    g = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(num_local, n, k, generator=g) / k**0.5, fmt)


def _weight_bytes(n, k, fmt) -> int:
    """Bytes of one expert's [N, K] weight with its scales."""
    return {"bf16": 2 * n * k, "fp8": n * k + n * (k // 128) * 4, "fp4": n * k // 2 + n * (k // 32)}[fmt]


def _act_bytes(rows, k, fmt) -> int:
    return rows * k * 2 if fmt == "bf16" else rows * k + rows * (k // GROUP) * 4


def _profile(kernel, *args, lnc: int = 1, **kwargs) -> dict:
    """Run through the interpreter at ``lnc`` logical cores: the launch's features (``[core][segment]``,
    ``harness.nki_extrapolate``) under its target's cost model, and the SBUF peak."""
    interpreter.simulate(shim.jit(kernel)[lnc] if lnc != 1 else kernel)(*args, **kwargs)
    info = interpreter.last_run()
    model = interpreter.model_for(info.target)
    return {"launch": nx.launch_features(model, info.programs), "sbuf_peak_bytes": info.sbuf_peak_bytes}


def _combine(terms) -> dict:
    """Σ coeff · record over ``(coeff, record)`` pairs: the launches' features combine exactly
    (``nx.combine``); the SBUF peak is the largest."""
    return {
        "launch": nx.combine([(c, r["launch"]) for c, r in terms]),
        "sbuf_peak_bytes": max(r["sbuf_peak_bytes"] for _, r in terms),
    }


def _finish(rec: dict, ideal_bytes: int, target: str = "trn2") -> dict:
    """Overlapped estimate, serial bound and binding component of the launch (``CostModel.estimate_programs``
    from features); ``fraction`` is the MBU (``CostModel.mbu``): the ideal bytes over the estimate, at the HBM
    bandwidth of the launch's cores (LNC = 2: two cores' share)."""
    model = interpreter.model_for(target)
    est = nx.estimate(model, rec["launch"])
    ideal = model.hbm_roofline(ideal_bytes) / est["programs"]
    return {
        **{c: est[c] for c in COMPONENTS},
        "time_s": est["time_s"],
        "serial_s": est["serial_s"],
        "bound": est["bound"],
        "lnc": est["programs"],
        "segments_s": est["segments_s"],
        "hbm_bytes": est["hbm_bytes"],
        "sbuf_peak_bytes": rec["sbuf_peak_bytes"],
        "ideal_bytes": ideal_bytes,
        "ideal_s": ideal,
        "fraction": model.mbu(ideal_bytes, est["time_s"], est["programs"]),
    }


# --------------------------------------------------------------------------------------------- expert_gemm
def _gemm_dims(shape, which):
    return (shape.hidden, 2 * shape.intermediate) if which == "gemm1" else (shape.intermediate, shape.hidden)


def _gemm_mask(shape, tokens):
    """The rows of a uniform top-k routing that pick expert 0 (at least one: the routed case)."""
    idx, _ = make_routing(tokens, shape.topk, shape.num_experts, seed=2)
    mask = (idx == 0).any(dim=1)
    mask[0] = True
    return mask


def measure_expert_gemm(shape, act, wfmt, tokens, which: str) -> dict:
    """Cost records of GEMM1 (K = H, N = 2I) or GEMM2 (K = I, N = H) of one expert over T gathered rows:
    routed with the skip variant, unrouted with the static one (reads the weights anyway) and with skip."""
    k, n = _gemm_dims(shape, which)
    b, b_s = _weights(1, n, k, wfmt)
    a, a_s = make_activations(tokens, k, act, group=GROUP, seed=1)
    none = torch.zeros(tokens, dtype=torch.bool)
    return {
        (variant, routed): _profile(expert_gemm_kernel, a, a_s, b, b_s, msk, 0, skip)
        for variant, routed, msk, skip in (
            ("skip", True, _gemm_mask(shape, tokens), True),
            ("static", False, none, False),
            ("skip", False, none, True),
        )
    }


def rows_expert_gemm(shape, act, wfmt, tokens, which: str, recs: dict) -> list[dict]:
    k, n = _gemm_dims(shape, which)
    m = int(_gemm_mask(shape, tokens).sum())
    fixed = tokens + tokens * n * 2  # the mask in, every row of D out
    rows = []
    for (variant, routed), rec in recs.items():
        ideal = fixed + (_act_bytes(m, k, act) + _weight_bytes(n, k, wfmt) if routed else 0)
        rows.append(
            {
                "kernel": f"expert_gemm[{which}]",
                "variant": variant,
                "routed": f"{m if routed else 0} rows",
                "shape": f"K={k} N={n}",
                **_finish(rec, ideal),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------- local_experts
def layer_routing(shape, tokens: int, ep: int, seed: int = 0):
    """The gathered rows of rank 0 of an EP group of ``ep`` ranks, T tokens per rank.

    ``ep·T`` tokens are routed top-k over the model's E experts (``make_routing``); rank 0 owns the local experts
    [0, E/ep). Its gathered buffer has R = ep·T rows (capacity T per source rank): the tokens that name a local
    expert first, then padding rows (every slot −1). Returns ``(idx [R, k] int32, weights [R, k] float32,
    L, real rows, per-expert row counts [L])``.
    """
    n_local = shape.num_experts // ep
    idx, tw = make_routing(ep * tokens, shape.topk, shape.num_experts, seed=seed)
    here = ((idx >= 0) & (idx < n_local)).any(dim=1)
    r = ep * tokens
    g_idx = torch.full((r, shape.topk), -1, dtype=torch.int32)
    g_w = torch.zeros(r, shape.topk)
    n = int(here.sum())
    g_idx[:n], g_w[:n] = idx[here], tw[here]
    counts = torch.stack([((g_idx == e).any(dim=1)).sum() for e in range(n_local)])
    return g_idx, g_w, n_local, n, counts


def _le_args(shape, act, wfmt, rows, num_local, routed_local: list[int], seed=0, target=None):
    """Inputs of a ``num_local``-expert layer over ``rows`` gathered rows whose slots select exactly the local
    experts ``routed_local`` (one row each, in slot order); weights prepared for ``target`` (EIO) if given."""
    h, i = shape.hidden, shape.intermediate
    w13, s13 = _weights(num_local, 2 * i, h, wfmt, seed)
    w2, s2 = _weights(num_local, h, i, wfmt, seed + 1)
    if target is not None and layout_for(shape, wfmt, target) == "eio":
        w13, s13 = _prepare(w13, s13, shape, wfmt, target)
        w2, s2 = _prepare(w2, s2, shape, wfmt, target)
    x, xs = make_activations(rows, h, act, group=GROUP, seed=seed + 2)
    idx = torch.full((rows, shape.topk), -1, dtype=torch.int32)
    for j, e in enumerate(routed_local):  # row j % R, slot j // R picks local expert e
        idx[j % rows, (j // rows) % shape.topk] = e
    tw = torch.full((rows, shape.topk), 1.0 / shape.topk)
    return (x, xs, idx, tw, w13, s13, w2, s2, 0, LIMIT, FP8_MAX)


def layout_for(shape, wfmt, target) -> str:
    """The weight layout the kernel runs at: always prepared ("eio"; the packed forms zero-pad K to whole
    512 blocks on chip, so Qwen3-30B-A3B's I = 768 prepares too)."""
    return "eio"


def weight_path(shape, act, wfmt, target) -> str:
    """The GEMM path (``expert_gemm_tiles.WeightPlan.path``, or "eoi") the weights take, for the chunk policy
    (``chunk_cap``)."""
    if layout_for(shape, wfmt, target) == "eoi":
        return "eoi"
    if wfmt == "fp8" and target != "trn3":
        return "fp8_block"
    if wfmt == "bf16":
        return "bf16"
    return "mx" if (target == "trn3" and act == "fp8") else "quad_bf16"


def chunk_for(shape, act, wfmt, target, rows) -> int:
    """M as the kernel picks it for this layer (``num_experts`` = the model's E)."""
    return chunk_rows_for(rows, shape.topk, shape.num_experts, chunk_cap(weight_path(shape, act, wfmt, target)))


def _prepare(w, s, shape, wfmt, target):
    """``layouts.prepare_weight`` for the target (fp8 activations: MX on trn3 for power-of-two scales)."""
    w, s, _ = prepare_weight(w, s, target)
    return w, s


def _le_ideal(shape, act, wfmt, rows, real_rows, n_routed) -> int:
    """Bytes the op must move: the routed local experts' weights, x of the rows routed here, every row's
    routing, the fp32 result of every row."""
    h, i, k = shape.hidden, shape.intermediate, shape.topk
    per_expert = _weight_bytes(2 * i, h, wfmt) + _weight_bytes(h, i, wfmt)
    return n_routed * per_expert + _act_bytes(real_rows, h, act) + rows * k * 8 + rows * h * 4


def measure_local_experts(shape, act, wfmt, rows, chunk_rows: int, lnc: int = 1) -> dict:
    """Records of 1- and 2-expert layers at the real H, I and R, launched at ``lnc`` logical cores (see the
    module docstring): ``k10`` / ``k20`` with no routed expert, ``k11`` with one routed expert (one row, hence one
    item: core 0's), and at LNC = 2 ``k22``, two experts with one item each (core 1 runs the second); weights
    prepared for the current target (``layout_for``)."""
    target = "trn3" if nisa_target_is_trn3() else "trn2"
    kw = {"skip_unrouted": True, "chunk_rows": chunk_rows, "weight_layout": layout_for(shape, wfmt, target)}
    run = lambda L, routed: _profile(  # noqa: E731
        local_experts_kernel,
        *_le_args(shape, act, wfmt, rows, L, routed, target=target),
        lnc=lnc,
        **kw,
    )
    recs = {"k10": run(1, []), "k20": run(2, []), "k11": run(1, [0])}
    if lnc == 2:
        recs["k22"] = run(2, [0, 1])
    return recs


def nisa_target_is_trn3() -> bool:
    return shim.nisa.get_nc_version() == shim.nisa.nc_version.gen4


def extrapolate(r: dict, n_local: int, n_items: int) -> dict:
    """The record of an ``n_local``-expert layer with ``n_items`` work items from :func:`measure_local_experts`'s.

    Per core, the launch is affine in L (routing, work list) and in the core's own items (each runs the same
    static body): core 0 = ``k10 + (L−1)(k20 − k10) + n0·(k11 − k10)``; at LNC = 2 core 0 runs n0 = ⌈N/2⌉ items
    and core 1 n1 = ⌊N/2⌋, ``+ n1·(k22 − k20)`` on its base (k22's core 1 ran exactly one item). Per segment
    between barriers, in features (``nx.combine``: exact)."""
    base = [(1, r["k10"]), (n_local - 1, r["k20"]), (-(n_local - 1), r["k10"])]
    if "k22" not in r:
        return _combine([*base, (n_items, r["k11"]), (-n_items, r["k10"])])
    n0, n1 = -(-n_items // 2), n_items // 2
    core0 = _combine([*base, (n0, r["k11"]), (-n0, r["k10"])])
    core1 = _combine([*base, (n1, r["k22"]), (-n1, r["k20"])])
    return {"launch": [core0["launch"][0], core1["launch"][1]], "sbuf_peak_bytes": core0["sbuf_peak_bytes"]}


def row_local_experts(shape, act, wfmt, tokens, ep, r: dict, target: str, seed=0) -> dict:
    """The full layer (L = E/ep local experts, R = ep·T rows), extrapolated from the 1-/2-expert records
    (:func:`extrapolate`), n = Σ_e ⌈C_e / M⌉ work items."""
    idx, _, n_local, real, counts = layer_routing(shape, tokens, ep, seed)
    rows = ep * tokens
    n_routed = int((counts > 0).sum())
    m = chunk_for(shape, act, wfmt, target, rows)
    n = int(sum(-(-int(c) // m) for c in counts))
    ideal = _le_ideal(shape, act, wfmt, rows, real, n_routed)
    return {
        "kernel": "local_experts",
        "ep": ep,
        "rows": rows,
        "chunk_rows": m,
        "items": n,
        "items_per_core": [n] if "k22" not in r else [-(-n // 2), n // 2],
        "shape": f"H={shape.hidden} I={shape.intermediate} L={n_local}",
        "routed": f"{n_routed}/{n_local} experts",
        **_finish(extrapolate(r, n_local, n), ideal, target),
    }


def check_extrapolation(shape, act, wfmt, rows=16, lnc=1, target="trn2") -> str:
    """Measured vs extrapolated: a 4-expert layer with 3 routed experts (one item each: LNC = 2 puts two on
    core 0 and one on core 1), from the 1-/2-expert runs; the largest relative error over every core's,
    segment's and feature's value."""
    m = chunk_for(shape, act, wfmt, target, rows)
    with interpreter.target(target):
        r = measure_local_experts(shape, act, wfmt, rows, m, lnc)
        meas = _profile(
            local_experts_kernel,
            *_le_args(shape, act, wfmt, rows, 4, [0, 1, 3], target=target),
            lnc=lnc,
            skip_unrouted=True,
            chunk_rows=m,
            weight_layout=layout_for(shape, wfmt, target),
        )
    pred = extrapolate(r, 4, 3)
    err = max(
        abs(p[k] - q[k]) / max(abs(q[k]), 1e-12)
        for pc, qc in zip(pred["launch"], meas["launch"])
        for p, q in zip(pc, qc)
        for k in nx.FEATURES
        if q[k] or p[k]
    )
    model = interpreter.model_for(target)
    t_p, t_m = nx.estimate(model, pred["launch"])["time_s"], nx.estimate(model, meas["launch"])["time_s"]
    return (
        f"  LNC={lnc} {target}, 4 experts, 3 routed, R={rows}: measured {t_m * 1e6:9.2f} µs, extrapolated "
        f"{t_p * 1e6:9.2f} µs ({(t_p - t_m) / t_m:+.2%}), max feature error {err:.2e}"
    )


# ------------------------------------------------------------------------------------------------- targets
GOAL = 0.60  # MBU at every point (docs/backends/nki.md "Targets"; AWS's guides call 60 %+ good in practice)


def targets_summary(rows: list[dict]) -> str:
    """Per LNC, target and format pair measured: how many points reach :data:`GOAL`, the range, and the worst
    point with its binding component."""
    lines = [f"targets (MBU ≥ {GOAL:.0%} at every model, T and EP measured):"]
    groups = {}
    for r in rows:
        if r["kernel"] == "local_experts":
            groups.setdefault((r["lnc"], r["target"], r["pair"]), []).append(r)
    for (lnc, tgt, pair), sel in groups.items():
        worst = min(sel, key=lambda r: r["fraction"])
        met = sum(r["fraction"] >= GOAL for r in sel)
        lines.append(
            f"  LNC={lnc} {tgt} {pair}: {met} of {len(sel)}, {worst['fraction']:.1%}–"
            f"{max(r['fraction'] for r in sel):.1%}; worst {worst['model']} T={worst['tokens']} EP={worst['ep']}, "
            f"bound {worst['bound']}, {worst['time_s'] * 1e6:.1f} µs vs ideal {worst['ideal_s'] * 1e6:.1f} µs"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def table(rows: list[dict]) -> str:
    """expert_gemm rows (variants) and local_experts rows."""
    head = (
        f"{'model':<14} {'kernel':<19} {'act×w':<10} {'tgt':<4} {'LNC':>3} {'T':>4} {'EP':>2} {'R':>5} {'M':>4} "
        f"{'items':>5} {'touched':<16} {'est µs':>9} {'serial µs':>10} {'bound':>6} "
        f"{'ideal µs':>9} {'fraction':>8} {'HBM MiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        t = f"{'~' if r.get('interpolated') else ''}{r['tokens']}"
        lines.append(
            f"{r['model']:<14} {r['kernel']:<19} {r['pair']:<10} {r['target']:<4} {r['lnc']:>3} {t:>4} "
            f"{r.get('ep', 1):>2} "
            f"{r.get('rows', r['tokens']):>5} {r.get('chunk_rows', ''):>4} {r.get('items', ''):>5} "
            f"{r['routed']:<16} {r['time_s'] * 1e6:>9.1f} {r['serial_s'] * 1e6:>10.1f} "
            f"{r['bound']:>6} {r['ideal_s'] * 1e6:>9.1f} {r['fraction']:>8.1%} "
            f"{r['hbm_bytes'] / 2**20:>8.2f}"
        )
    return "\n".join(lines)


def _local_experts_rows(models, pairs, targets, tokens, eps, lncs, t0) -> list[dict]:
    rows = []
    for lnc in lncs:
        rows += _local_experts_rows_at(models, pairs, targets, tokens, eps, lnc, t0)
    return rows


def _local_experts_rows_at(models, pairs, targets, tokens, eps, lnc, t0) -> list[dict]:
    rows = []
    for key in models:
        shape = MODEL_SHAPES[key]
        for act, wfmt in pairs:
            for tgt in targets:
                if tgt == "trn3" and (act, wfmt) not in (("fp8", "fp8"), ("fp8", "fp4")):
                    continue  # the trn3 targets; the other pairs run the trn2 code there
                for ep in eps:
                    for t in tokens:
                        n_rows = ep * t
                        with interpreter.target(tgt):
                            rec = measure_local_experts(
                                shape, act, wfmt, n_rows, chunk_for(shape, act, wfmt, tgt, n_rows), lnc
                            )
                        row = row_local_experts(shape, act, wfmt, t, ep, rec, tgt)
                        model = shape.name.replace("DeepSeek-", "")
                        row.update(
                            model=model, pair=f"{act}×{wfmt}", tokens=t, target=tgt, layout=layout_for(shape, wfmt, tgt)
                        )
                        rows.append(row)
                        print(table([row]).split("\n", 2)[2], f"   [{time.time() - t0:.0f}s]", flush=True)
    return rows


def _expert_gemm_rows(models, pairs, tokens, measured, t0) -> list[dict]:
    rows = []
    for key in models:
        shape = MODEL_SHAPES[key]
        for act, wfmt in pairs:
            meas = {t: {w: measure_expert_gemm(shape, act, wfmt, t, w) for w in ("gemm1", "gemm2")} for t in measured}
            for t in tokens:
                if t in meas:
                    recs, mark = meas[t], False
                else:
                    lo = max(m for m in measured if m < t)
                    hi = min(m for m in measured if m > t)
                    recs = {k: _interp(meas[lo][k], meas[hi][k], lo, hi, t) for k in meas[lo]}
                    mark = True
                for which in ("gemm1", "gemm2"):
                    for r in rows_expert_gemm(shape, act, wfmt, t, which, recs[which]):
                        r.update(
                            model=shape.name.replace("DeepSeek-", ""),
                            pair=f"{act}×{wfmt}",
                            tokens=t,
                            interpolated=mark,
                            target="trn2",
                        )
                        rows.append(r)
                        print(table([r]).split("\n", 2)[2], f"   [{time.time() - t0:.0f}s]", flush=True)
    return rows


def _interp(recs_lo: dict, recs_hi: dict, t_lo: int, t_hi: int, t: int) -> dict:
    """Per-component affine interpolation in T of two measured sets of records (same keys)."""
    f = (t - t_lo) / (t_hi - t_lo)
    return {key: _combine([(1 - f, recs_lo[key]), (f, recs_hi[key])]) for key in recs_lo}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="v4_flash,v3,qwen3_30b_a3b")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per rank")
    ap.add_argument("--ep", default=",".join(map(str, EPS)), help="expert-parallel group sizes")
    ap.add_argument("--pairs", default=",".join(f"{a}x{w}" for a, w in FORMAT_PAIRS))
    ap.add_argument("--targets", default="trn2,trn3", help="trn3 runs the trn3 target pairs (fp8×fp8, fp8×fp4)")
    ap.add_argument("--kernels", default="local_experts", help="local_experts and/or expert_gemm (EP 1)")
    ap.add_argument(
        "--lnc",
        default="1",
        help="logical cores local_experts launches at: 1 and/or 2 (MBU over the launch's cores' HBM share)",
    )
    ap.add_argument("--check", action="store_true", help="verify the extrapolation on a 4-expert layer")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "nki_gemm.json")
    args = ap.parse_args(argv)
    if shim.real_nki_available():
        print(
            "a real nki is importable: run with STATIC_MOE_NKI=interpreter (the estimates come from the "
            "interpreter's cost model)",
            file=sys.stderr,
        )
        return 1
    models = args.models.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    eps = [int(e) for e in args.ep.split(",")]
    pairs = [tuple(p.split("x")) for p in args.pairs.split(",")]
    targets = args.targets.split(",")
    kernels = args.kernels.split(",")
    lncs = [int(n) for n in args.lnc.split(",")]
    m = interpreter.TRN2
    print(
        f"NKI local experts — estimated time on one NeuronCore (interpreter cost model: "
        f"DMA {m.dma_bandwidth / 1e9:.0f} GB/s + {m.dma_fixed * 1e6:.1f} µs per DMA over {m.dma_queues} queues, "
        f"+{m.dge_fixed * 1e6:.1f} µs per runtime-descriptor (DGE) DMA over {m.dge_instances} DGEs; TensorE "
        f"max(N, 64) cycles per matmul at 2.4 GHz; VectorE 0.96 GHz (2N for two-input ops), ScalarE/GpSimd "
        f"1.2 GHz (GpSimd 32 bit/partition/cycle), {m.instr_fixed_cycles} cycles per instruction) vs the ideal "
        f"HBM time at {m.hbm_bandwidth_per_core / 1e9:.0f} GB/s per core (trn3 rows: the same model, run on the "
        f"trn3 target's instructions). 'est' = overlapped estimate (max of engines, DMA, DGE, loop), "
        f"'serial' = their sum, 'bound' = the binding one; M = rows per work item, items = Σ_e ⌈C_e/M⌉. "
        f"LNC = 2 rows: two cores, Σ over the stretches between barriers of the slower core's estimate, the "
        f"fraction over both cores' HBM share. "
        f"fp8 activations with 1×{GROUP} scales, fp8_max {FP8_MAX:g}, swiglu limit {LIMIT:g}.",
        flush=True,
    )
    t0 = time.time()
    if args.check:
        print(f"extrapolation check ({models[0]} dims, {pairs[0][0]}×{pairs[0][1]}):")
        for lnc in lncs:
            for tgt in targets:
                print(check_extrapolation(MODEL_SHAPES[models[0]], *pairs[0], lnc=lnc, target=tgt), flush=True)
    rows = []
    if "expert_gemm" in kernels:
        rows += _expert_gemm_rows(models, pairs, tokens, sorted({min(tokens), max(tokens)}), t0)
    if "local_experts" in kernels:
        rows += _local_experts_rows(models, pairs, targets, tokens, eps, lncs, t0)
    print()
    print(table(rows))
    print()
    print(targets_summary(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
