"""Estimated trn2 time and HBM-roofline fraction of the NKI expert GEMM and fused local-experts kernels at
decode shapes (DeepSeek-V4-Flash, DeepSeek-V3, Qwen3-30B-A3B; 1–128 tokens per NeuronCore, EP = 1).

No device is needed: the kernels run through static_moe's NKI interpreter, whose cost record the cost model
(``static_moe.nki.interpreter.cost.CostModel``: figures and assumptions in its docstring) turns into an estimated
time on one NeuronCore-v3. ``ideal`` is the time to move the bytes the op must move at one core's share of HBM
bandwidth (2.9 TB/s / 8): the weights (scales included) of the experts that some row selects, the activations
in, the routing, the result out. ``fraction = ideal / estimate``. Model numbers, not measurements.

Variants: ``skip`` (runtime loop: unrouted experts read no weights) and ``static`` (all experts, no runtime
control). Routing: ``make_routing(T, k, E)`` (uniform top-k), so T tokens touch ~min(E, T·k) experts.

Extrapolation (local_experts): a full layer has 128–256 local experts; interpreting each takes seconds, so the
per-expert cost is measured at the real H, I and T on 1- and 2-expert layers and extrapolated linearly per
component (engine cycles, DMA bytes and count, loop iterations, HBM bytes) — exact because the kernel's
instruction stream is affine in the number of experts L and of routed experts n (each expert body is the same
static code). The token counts between the measured ones (T = 1 and 128 by default) are interpolated per
component too: for T ≤ 128 (one row tile) the instruction stream is fixed and only the moving columns,
evacuated elements and DMA bytes grow, linearly in T; such rows are marked ``~`` in the table. ``--check``
runs a 4-expert layer and a T = 16 layer directly and prints both errors.

    .venv/bin/python bench/bench_nki_gemm.py [--models v4_flash,v3,qwen3_30b_a3b] [--tokens 1,4,16,64,128]
                                             [--measure 1,128] [--pairs bf16xbf16,...] [--check]
                                             [--json bench/results/nki_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from nki_kernels.expert_gemm import expert_gemm_kernel
from nki_kernels.local_experts import local_experts_kernel
from static_moe.formats import quantize_weight
from static_moe.nki import interpreter, shim
from static_moe.testing.generators import FORMAT_PAIRS, MODEL_SHAPES, make_activations, make_routing

TOKENS = (1, 4, 16, 64, 128)
GROUP = 128
FP8_MAX = 240.0  # trn2 on-chip fp8
LIMIT = 7.0
COMPONENTS = interpreter.cost.COMPONENTS  # tensor/vector/scalar/gpsimd/sync engines, dma, dge, loop
OLD = tuple(f"old_{c}" for c in COMPONENTS)  # the same components under the pre-issue-10 model


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


def _profile(kernel, *args, **kwargs) -> dict:
    """Run through the interpreter; the estimate's components (corrected model, and ``old_*`` under the
    legacy one, from the same record) plus HBM bytes and SBUF peak."""
    _, rep = interpreter.profile(kernel, *args, **kwargs)
    old = interpreter.LEGACY_TRN2.estimate(interpreter.last_run().cost)
    out = {c: rep.get(c, 0.0) for c in COMPONENTS}
    out.update({f"old_{c}": old.get(c, 0.0) for c in COMPONENTS})
    out.update(hbm_bytes=rep["hbm_bytes"], sbuf_peak_bytes=rep["sbuf_peak_bytes"])
    return out


def _combine(terms) -> dict:
    """Σ coeff · record over additive components (engine times are linear in cycles and instruction counts,
    DMA time in bytes and count, loop time in iterations)."""
    keys = COMPONENTS + OLD + ("hbm_bytes",)
    out = {k: sum(c * r[k] for c, r in terms) for k in keys}
    out["sbuf_peak_bytes"] = max(r["sbuf_peak_bytes"] for _, r in terms)
    return out


def _finish(rec: dict, ideal_bytes: int) -> dict:
    """Overlapped estimate (max of the components), serial bound (their sum) and binding component, under
    the corrected model and (``old_time_s``) the legacy one."""
    parts = {k: rec[k] for k in COMPONENTS}
    t = max(parts.values())
    old_t = max(rec[k] for k in OLD)
    ideal = interpreter.TRN2.hbm_roofline(ideal_bytes)
    return {**rec, "time_s": t, "serial_s": sum(parts.values()), "bound": max(parts, key=parts.get)[:-2],
            "old_time_s": old_t, "ideal_bytes": ideal_bytes, "ideal_s": ideal,
            "fraction": ideal / t if t else float("nan"), "old_fraction": ideal / old_t if old_t else float("nan")}


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
    return {(variant, routed): _profile(expert_gemm_kernel, a, a_s, b, b_s, msk, 0, skip)
            for variant, routed, msk, skip in (("skip", True, _gemm_mask(shape, tokens), True),
                                               ("static", False, none, False), ("skip", False, none, True))}


def rows_expert_gemm(shape, act, wfmt, tokens, which: str, recs: dict) -> list[dict]:
    k, n = _gemm_dims(shape, which)
    m = int(_gemm_mask(shape, tokens).sum())
    fixed = tokens + tokens * n * 2  # the mask in, every row of D out
    rows = []
    for (variant, routed), rec in recs.items():
        ideal = fixed + (_act_bytes(m, k, act) + _weight_bytes(n, k, wfmt) if routed else 0)
        rows.append({"kernel": f"expert_gemm[{which}]", "variant": variant, "routed": f"{m if routed else 0} rows",
                     "shape": f"K={k} N={n}", **_finish(rec, ideal)})
    return rows


# ------------------------------------------------------------------------------------------- local_experts
def _le_args(shape, act, wfmt, tokens, num_local, routed_local: list[int], seed=0):
    """Inputs of a ``num_local``-expert layer whose rows select exactly the local experts ``routed_local``."""
    h, i = shape.hidden, shape.intermediate
    w13, s13 = _weights(num_local, 2 * i, h, wfmt, seed)
    w2, s2 = _weights(num_local, h, i, wfmt, seed + 1)
    x, xs = make_activations(tokens, h, act, group=GROUP, seed=seed + 2)
    idx = torch.full((tokens, shape.topk), -1, dtype=torch.int32)
    for j, e in enumerate(routed_local):  # row j % T, slot j // T picks local expert e
        idx[j % tokens, (j // tokens) % shape.topk] = e
    tw = torch.full((tokens, shape.topk), 1.0 / shape.topk)
    return (x, xs, idx, tw, w13, s13, w2, s2, 0, LIMIT, FP8_MAX)


def _le_ideal(shape, act, wfmt, tokens, n_routed) -> int:
    h, i, k = shape.hidden, shape.intermediate, shape.topk
    per_expert = _weight_bytes(2 * i, h, wfmt) + _weight_bytes(h, i, wfmt)
    return n_routed * per_expert + _act_bytes(tokens, h, act) + tokens * k * 8 + tokens * h * 4


def measure_local_experts(shape, act, wfmt, tokens) -> dict:
    """Cost records of 1- and 2-expert layers at the real H, I, T (see the module docstring)."""
    run = lambda L, routed, skip: _profile(local_experts_kernel, *_le_args(shape, act, wfmt, tokens, L, routed),  # noqa: E731
                                           skip_unrouted=skip)
    return {"s1": run(1, [0], False), "s2": run(2, [0, 1], False), "k10": run(1, [], True),
            "k20": run(2, [], True), "k11": run(1, [0], True)}


def rows_local_experts(shape, act, wfmt, tokens, r: dict, seed=0) -> list[dict]:
    """Both variants at the full layer (L = E local experts, EP = 1), extrapolated from the 1-/2-expert records."""
    n_local = shape.num_experts
    idx, _ = make_routing(tokens, shape.topk, shape.num_experts, seed=seed)
    n_routed = int(torch.unique(idx[idx >= 0]).numel())
    static = _combine([(1, r["s1"]), (n_local - 1, r["s2"]), (-(n_local - 1), r["s1"])])
    skip = _combine([(1, r["k10"]), (n_local - 1, r["k20"]), (-(n_local - 1), r["k10"]), (n_routed, r["k11"]),
                     (-n_routed, r["k10"])])
    ideal = _le_ideal(shape, act, wfmt, tokens, n_routed)
    common = {"kernel": "local_experts", "shape": f"H={shape.hidden} I={shape.intermediate} L={n_local}"}
    return [{**common, "variant": "skip", "routed": f"{n_routed}/{n_local} experts", **_finish(skip, ideal)},
            {**common, "variant": "static", "routed": f"{n_routed}/{n_local} experts", **_finish(static, ideal)}]


def _interp(recs_lo: dict, recs_hi: dict, t_lo: int, t_hi: int, t: int) -> dict:
    """Per-component affine interpolation in T of two measured sets of records (same keys)."""
    f = (t - t_lo) / (t_hi - t_lo)
    return {key: _combine([(1 - f, recs_lo[key]), (f, recs_hi[key])]) for key in recs_lo}


def check_extrapolation(shape, act, wfmt) -> str:
    """Measured vs extrapolated: a 4-expert layer with 2 routed experts (from 1-/2-expert runs, T = 16), and
    T = 16 interpolated from T = 1 and T = 128 (1-expert static layer)."""
    run = lambda L, routed, skip, t=16: _profile(local_experts_kernel,  # noqa: E731
                                                 *_le_args(shape, act, wfmt, t, L, routed), skip_unrouted=skip)
    r = measure_local_experts(shape, act, wfmt, 16)
    pred = {"4 experts static": _combine([(1, r["s1"]), (3, r["s2"]), (-3, r["s1"])]),
            "4 experts skip": _combine([(1, r["k10"]), (3, r["k20"]), (-3, r["k10"]), (2, r["k11"]), (-2, r["k10"])]),
            "T=16 from 1, 128": _interp({"s1": run(1, [0], False, 1)}, {"s1": run(1, [0], False, 128)}, 1, 128,
                                        16)["s1"]}
    meas = {"4 experts static": run(4, [0, 1, 2, 3], False), "4 experts skip": run(4, [1, 3], True),
            "T=16 from 1, 128": r["s1"]}
    lines = []
    for v in pred:
        err = max(abs(pred[v][c] - meas[v][c]) / max(meas[v][c], 1e-12) for c in COMPONENTS + ("hbm_bytes",)
                  if meas[v][c] > 0)
        t_p, t_m = max(pred[v][c] for c in COMPONENTS), max(meas[v][c] for c in COMPONENTS)
        lines.append(f"  {v:<17}: measured {t_m * 1e6:9.2f} µs, extrapolated {t_p * 1e6:9.2f} µs "
                     f"({(t_p - t_m) / t_m:+.2%}), max component error {err:.2e}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def table(rows: list[dict]) -> str:
    head = (f"{'model':<14} {'kernel':<19} {'act×w':<10} {'T':>4} {'variant':<7} {'touched':<15} {'old µs':>9} "
            f"{'est µs':>9} {'serial µs':>9} {'bound':>6} {'ideal µs':>9} {'old frac':>8} {'fraction':>8} "
            f"{'HBM MiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = f"{'~' if r.get('interpolated') else ''}{r['tokens']}"
        lines.append(f"{r['model']:<14} {r['kernel']:<19} {r['pair']:<10} {t:>4} {r['variant']:<7} "
                     f"{r['routed']:<15} {r['old_time_s'] * 1e6:>9.1f} {r['time_s'] * 1e6:>9.1f} "
                     f"{r['serial_s'] * 1e6:>9.1f} {r['bound']:>6} {r['ideal_s'] * 1e6:>9.1f} "
                     f"{r['old_fraction']:>8.1%} {r['fraction']:>8.1%} {r['hbm_bytes'] / 2**20:>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="v4_flash,v3,qwen3_30b_a3b")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--measure", default="1,128", help="token counts run through the interpreter; others are "
                    "interpolated (exact within one 128-row tile)")
    ap.add_argument("--pairs", default=",".join(f"{a}x{w}" for a, w in FORMAT_PAIRS))
    ap.add_argument("--kernels", default="expert_gemm,local_experts")
    ap.add_argument("--check", action="store_true", help="verify the extrapolation on a 4-expert layer")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "nki_gemm.json")
    args = ap.parse_args(argv)
    if shim.real_nki_available():
        print("a real nki is importable: run with STATIC_MOE_NKI=interpreter (the estimates come from the "
              "interpreter's cost model)", file=sys.stderr)
        return 1
    models = args.models.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    measured = sorted(int(t) for t in args.measure.split(","))
    assert all(measured[0] <= t <= measured[-1] for t in tokens) and max(measured) <= 128, (
        "interpolate only inside the measured token counts, within one 128-row tile")
    pairs = [tuple(p.split("x")) for p in args.pairs.split(",")]
    kernels = args.kernels.split(",")
    m = interpreter.TRN2
    print(f"NKI expert GEMM / local experts — estimated trn2 time on one NeuronCore-v3 (interpreter cost model: "
          f"DMA {m.dma_bandwidth / 1e9:.0f} GB/s + {m.dma_fixed * 1e6:.1f} µs per DMA over {m.dma_queues} queues, "
          f"+{m.dge_fixed * 1e6:.1f} µs per runtime-descriptor (DGE) DMA over {m.dge_instances} DGEs; TensorE "
          f"max(N, 64) cycles per matmul at 2.4 GHz; VectorE 0.96 GHz (2N for two-input ops), ScalarE/GpSimd "
          f"1.2 GHz (GpSimd 32 bit/partition/cycle), {m.instr_fixed_cycles} cycles per instruction) vs the ideal "
          f"HBM time at {m.hbm_bandwidth_per_core / 1e9:.0f} GB/s per core. 'old' = the pre-issue-10 model on the "
          f"same run; 'est' = overlapped estimate (max of engines, DMA, DGE, loop), 'serial' = their sum, "
          f"'bound' = the binding one. EP = 1, fp8 activations with 1×{GROUP} scales, fp8_max {FP8_MAX:g}, "
          f"swiglu limit {LIMIT:g}.", flush=True)
    if args.check:
        print("extrapolation check (Qwen3-30B-A3B dims, fp8×fp4):")
        print(check_extrapolation(MODEL_SHAPES["qwen3_30b_a3b"], "fp8", "fp4"), flush=True)
    rows = []
    t0 = time.time()
    for key in models:
        shape = MODEL_SHAPES[key]
        for act, wfmt in pairs:
            meas = {}
            for t in measured:
                meas[t] = {}
                if "expert_gemm" in kernels:
                    for which in ("gemm1", "gemm2"):
                        meas[t][which] = measure_expert_gemm(shape, act, wfmt, t, which)
                if "local_experts" in kernels:
                    meas[t]["le"] = measure_local_experts(shape, act, wfmt, t)
            for t in tokens:
                if t in meas:
                    recs, mark = meas[t], ""
                else:
                    lo = max(m for m in measured if m < t)
                    hi = min(m for m in measured if m > t)
                    recs = {k: _interp(meas[lo][k], meas[hi][k], lo, hi, t) for k in meas[lo]}
                    mark = "~"
                new = []
                for which in ("gemm1", "gemm2"):
                    if which in recs:
                        new += rows_expert_gemm(shape, act, wfmt, t, which, recs[which])
                if "le" in recs:
                    new += rows_local_experts(shape, act, wfmt, t, recs["le"])
                for r in new:
                    r.update(model=shape.name.replace("DeepSeek-", ""), pair=f"{act}×{wfmt}", tokens=t,
                             interpolated=bool(mark))
                rows += new
                if new:
                    print(table(new).split("\n", 2)[2], f"   [{time.time() - t0:.0f}s]", flush=True)
    print()
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
