"""The one measuring module of bench/ (docs BENCH.md): machine limits, the timer, bytes/FLOPs accounting,
roofline, the results table, JSON and PNG plots.

Every figure a benchmark prints is a ratio measured in the same run on the same pinned thread count:
against the machine's own limits (``static_moe.testing.machine.measure_machine``: a STREAM-style triad far
beyond the last-level cache for bandwidth, the best fp32 GFLOP/s of a large torch matmul for compute; the demo
measures with the same code), and against baselines run on the
same inputs in the same process (bench/baselines.py).

Roofline (BENCH.md): a call must move ``bytes`` (the weights of the experts it touches, scales included;
activations in; results out) and do ``flops`` (2·rows·N·K per GEMM, rows actually routed);
``roofline_s = max(bytes / bandwidth, flops / peak)`` and ``roofline_fraction = roofline_s / measured_s``.
Elementwise ops (pack, unpack, swiglu_and_cast) are counted by bytes only: their FLOPs are not matmul FLOPs
and the matmul peak is not their limit.

Everything runs on the CPU, in the calling process; tensors are torch CPU tensors.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from static_moe.testing.generators import MODEL_SHAPES, make_weights
from static_moe.testing.machine import MachineLimits, llc_bytes, measure_machine

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_TOKENS = (1, 4, 16, 64, 128)
QUICK_TOKENS = (1, 4)
MIN_REPEAT = 5  # BENCH.md: median of at least 5 timed runs

# Local experts kept per shape, so that the full `make bench` fits in memory and in 10 minutes on 2 threads
# (the seed baseline dequantizes every local expert on every call). H and I are never scaled. See
# ``static_moe.testing.generators.sliced_routing`` for how the kept experts are chosen so that rows per expert
# stay those of the real model.
LOCAL_EXPERTS = {"v4_flash": 4, "v3": 2, "qwen3_30b_a3b": 8}
QUICK_LOCAL_EXPERTS = 2


# ----------------------------------------------------------------------------------------------------------------
# Threads (the machine limits measured on them: static_moe.testing.machine)
# ----------------------------------------------------------------------------------------------------------------
def pin_threads(threads: int | None = None) -> int:
    """Pin torch's intra-op thread count (default: $OMP_NUM_THREADS, else 2) and return what torch reports."""
    n = threads or int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(n)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------------------------
# The timer
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Median of ``len(samples_s)`` timed samples; each sample is the mean of ``inner`` back-to-back calls
    (more than one only for calls shorter than ``min_sample_s``, where the clock's overhead would show)."""

    median_s: float
    samples_s: list[float]
    inner: int
    warmup: int


_FLUSH: list[torch.Tensor] = []


def flush_caches() -> None:
    """Evict the caches: read and write a float32 buffer of 2× the LLC (untimed, before a cold call)."""
    if not _FLUSH:
        _FLUSH.append(torch.zeros(2 * llc_bytes() // 4))
    _FLUSH[0].add_(1.0)


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = MIN_REPEAT, cold: bool = False,
            min_sample_s: float = 2e-3, before: Callable[[], None] | None = None,
            reduce: Callable[[list[float]], list[float]] | None = None) -> tuple[Timing, Any]:
    """Time ``fn()`` on the calling thread: ``warmup`` untimed calls (at least 1; the first one's result is
    returned, for correctness checks at no extra cost), then ``max(repeat, 5)`` samples, median taken.

    cold: flush the caches before every timed call (one call per sample), as weights stream from DRAM in a real
    decode step (the other layers evict them); otherwise a sample averages back-to-back calls until it lasts
    ``min_sample_s``. before: an untimed hook run right before each timed call (after the flush), e.g. a
    barrier. reduce: maps the per-sample times before the median (e.g. max over EP ranks), called once."""
    warmup = max(1, warmup)
    repeat = max(MIN_REPEAT, repeat)
    result = fn()
    last = 0.0
    # Further warm-ups; a warm call's time sets the calls per sample (cold samples are single calls: no need).
    for _ in range(max(warmup - 1, 0 if cold else 1)):
        t0 = time.perf_counter()
        fn()
        last = time.perf_counter() - t0
    inner = 1 if (cold or last >= min_sample_s) else min(1000, math.ceil(min_sample_s / max(last, 1e-7)))
    if reduce is not None:  # every rank must take the same number of calls per sample
        inner = int(max(reduce([float(inner)])))
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        samples = []
        for _ in range(repeat):
            if cold:
                flush_caches()
            if before is not None:
                before()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    finally:
        if was_enabled:
            gc.enable()
    if reduce is not None:
        samples = reduce(samples)
    return Timing(statistics.median(samples), samples, inner, warmup), result


def measure(fn: Callable[[], Any], **timer_kw) -> tuple[dict, Any]:
    """``time_fn`` for the op under test: a failure (op not implemented yet, an error) is recorded as
    ``{"available": False, "reason": ...}`` instead of stopping the run."""
    try:
        timing, out = time_fn(fn, **timer_kw)
    except Exception as e:  # noqa: BLE001  the table says why the op has no number
        return {"available": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    return {"available": True, **timing_dict(timing)}, out


def timing_dict(t: Timing) -> dict:
    return {"median_s": t.median_s, "samples_s": t.samples_s, "inner": t.inner}


def time_fastest_variant(variants: dict, call: Callable[[Any], Any], **timer) -> tuple[dict, Any]:
    """Time ``call(v)`` for every value of ``variants`` (keyed by dtype, e.g. torch_cached's fp32 and bf16
    weight caches) with :func:`time_fn` and keep the fastest, as BENCH.md asks of torch_cached.

    Returns (the fastest's timing dict with its ``variant`` name and every variant's median, its output)."""
    timed = {}
    for key, v in variants.items():
        timing, out = time_fn(lambda v=v: call(v), **timer)
        timed[str(key).replace("torch.", "")] = (timing, out)
    best = min(timed, key=lambda name: timed[name][0].median_s)
    entry = {**timing_dict(timed[best][0]), "variant": best,
             **{f"{name}_median_s": t.median_s for name, (t, _) in timed.items()}}
    return entry, timed[best][1]


# ----------------------------------------------------------------------------------------------------------------
# Bytes and FLOPs (BENCH.md roofline rules)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Cost:
    """Bytes a call must move and FLOPs it must do (matmul FLOPs only)."""

    bytes: float
    flops: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes + other.bytes, self.flops + other.flops)


def weight_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of one expert's [N, K] weight in ``fmt``, scales included (SPEC §1.2)."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "fp8":
        return n * k + 4 * n * (k // 128)  # e4m3fn + float32 1×128 scales
    if fmt == "fp4":
        return n * k // 2 + n * (k // 32)  # e2m1 two per byte + UE8M0 1×32 scales
    raise ValueError(f"unknown weight format {fmt!r}")


def act_bytes(fmt: str, rows: int, k: int, group: int = 128) -> int:
    """Bytes of ``rows`` activation rows of width K: bf16, or fp8 with float32 1×group scales (SPEC §1.1)."""
    if fmt == "bf16":
        return 2 * rows * k
    if fmt == "fp8":
        return rows * k + 4 * rows * (k // group)
    raise ValueError(f"unknown activation format {fmt!r}")


def cost_expert_gemm(act_fmt: str, w_fmt: str, rows_total: int, rows_active: int, n: int, k: int,
                     group: int = 128) -> Cost:
    """One expert's weight, the active rows of A, the mask, and the whole bf16 [R, N] output (zeros too)."""
    moved = weight_bytes(w_fmt, n, k) + act_bytes(act_fmt, rows_active, k, group) + rows_total + 2 * rows_total * n
    return Cost(moved, 2.0 * rows_active * n * k)


def cost_local_experts(act_fmt: str, w_fmt: str, rows_total: int, rows_active: int, topk: int, hidden: int,
                       inter: int, experts_touched: int, pairs: int, group: int = 128) -> Cost:
    """Weights (w13 and w2, scales included) of the touched experts; the routed rows of x; the routing of every
    row; the fp32 [R, H] result. FLOPs: each (row, expert) pair does GEMM1 (2I×H) and GEMM2 (H×I)."""
    w = experts_touched * (weight_bytes(w_fmt, 2 * inter, hidden) + weight_bytes(w_fmt, hidden, inter))
    moved = w + act_bytes(act_fmt, rows_active, hidden, group) + rows_total * topk * 8 + 4 * rows_total * hidden
    return Cost(moved, 2.0 * pairs * (2 * inter * hidden + hidden * inter))


def cost_swiglu_and_cast(rows: int, inter: int, in_bytes: int, out_fmt: str, group: int) -> Cost:
    """gate_up [R, 2I] in, row weights in, the [R, I] result (and its scales) out. Bytes only."""
    out = act_bytes(out_fmt, rows, inter, group) if out_fmt == "fp8" else 2 * rows * inter
    return Cost(rows * 2 * inter * in_bytes + 4 * rows + out)


def cost_pack_rows(row_bytes: int, tokens: int, capacity: int, width: int) -> Cost:
    """The parts' bytes in, the whole [C, W] buffer out (padding included). Bytes only."""
    return Cost(tokens * row_bytes + capacity * width)


def cost_unpack_rows(rows: int, nbytes: int) -> Cost:
    """One span of every row in, the same bytes out. Bytes only."""
    return Cost(2 * rows * nbytes)


@dataclass
class RoutingStats:
    """What a routing asks of one rank's local experts [offset, offset + L)."""

    rows_active: int  # rows routed to at least one local expert
    experts_touched: int  # local experts at least one row selects
    pairs: int  # distinct (row, local expert) pairs = GEMM rows summed over experts


def routing_stats(topk_idx: torch.Tensor, expert_offset: int, num_local: int) -> RoutingStats:
    """Count rows, touched experts and (row, expert) pairs of ``topk_idx`` [R, k] for one rank."""
    local = topk_idx.long() - expert_offset
    ok = (local >= 0) & (local < num_local)
    onehot = torch.zeros(topk_idx.shape[0], num_local + 1, dtype=torch.bool)
    onehot.scatter_(1, torch.where(ok, local, torch.full_like(local, num_local)), True)
    hit = onehot[:, :num_local]
    return RoutingStats(int(hit.any(1).sum()), int(hit.any(0).sum()), int(hit.sum()))


# ----------------------------------------------------------------------------------------------------------------
# Scaled-down shapes: keep H, I, k and the real rows per expert; keep fewer local experts
# ----------------------------------------------------------------------------------------------------------------
def local_experts_for(shape_key: str, quick: bool) -> int:
    """Local experts kept per rank for a shape (``LOCAL_EXPERTS``; 2 with --quick)."""
    return QUICK_LOCAL_EXPERTS if quick else LOCAL_EXPERTS[shape_key]


# ----------------------------------------------------------------------------------------------------------------
# Results: roofline, table, JSON, plots
# ----------------------------------------------------------------------------------------------------------------
def roofline(cost: Cost, limits: MachineLimits, measured_s: float | None) -> dict:
    """Both roofline terms, the bound that applies, and the fraction of the roofline ``measured_s`` reaches."""
    t_mem = cost.bytes / limits.bandwidth
    t_flop = cost.flops / limits.flops
    t_roof = max(t_mem, t_flop)
    # The same roofline with the bf16 matmul rate as the compute limit: kernels that decode weights exactly to
    # bf16 and use bf16 dot-product instructions can beat the fp32 limit (roofline_fraction > 1).
    t_roof16 = max(t_mem, cost.flops / max(limits.bf16_flops, limits.flops))
    return {
        "bytes": cost.bytes,
        "flops": cost.flops,
        "t_mem_s": t_mem,
        "t_compute_s": t_flop,
        "roofline_s": t_roof,
        "bound": "compute" if t_flop > t_mem else "memory",
        "roofline_fraction": (t_roof / measured_s) if measured_s else None,
        "roofline_fraction_bf16_peak": (t_roof16 / measured_s) if measured_s else None,
    }


BASELINES = ("seed_dense", "torch_cached", "torch_scaled_mm", "torch_ref")


@dataclass
class Report:
    """Collects records of one run; prints the table, writes JSON and plots."""

    limits: MachineLimits
    meta: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> dict:
        """Fill speed-ups (baseline median / op median) and keep the record."""
        op = record.get("op", {})
        t = op.get("median_s") if op.get("available", True) else None
        record["speedup"] = {
            name: (b["median_s"] / t if t and b.get("median_s") else None)
            for name, b in record.get("baselines", {}).items()
        }
        self.records.append(record)
        return record

    def refresh_limits(self, again: MachineLimits) -> None:
        """Keep the best of the run's measurements of the machine and recompute every record's roofline."""
        self.limits = self.limits.best(again)
        for r in self.records:
            op = r.get("op", {})
            t = op.get("median_s") if op.get("available", True) else None
            r.update(roofline(Cost(r["bytes"], r["flops"]), self.limits, t))

    def header(self) -> str:
        m = self.limits
        cpu = f"{self.meta.get('cpu', '?')} ({self.meta.get('cpu_capability', '?')})  " if self.meta else ""
        return (f"{cpu}threads={m.threads}  bandwidth={m.bandwidth / 1e9:.1f} GB/s (triad, 3×{m.triad_array_bytes >> 20} "
                f"MiB arrays, LLC {m.llc_bytes >> 20} MiB)  fp32 peak={m.flops / 1e9:.1f} GFLOP/s "
                f"(matmul n={m.matmul_n}; bf16 matmul {m.bf16_flops / 1e9:.0f} GFLOP/s)")

    def table(self, records: list[dict] | None = None) -> str:
        recs = self.records if records is None else records
        cols = ["bench", "shape", "fmt", "T", "rows/e", "experts", "median", "coll", "MB", "GFLOP", "t_mem", "t_flop",
                "bound", "roof%", "roof%bf16", "×seed", "×cached", "×scaled", "×ref"]
        rows = [cols]
        for r in recs:
            op = r.get("op", {})
            ok = op.get("available", True)
            sp = r.get("speedup", {})
            rows.append([
                r["bench"] + (f" S={r['ep_size']}" if "ep_size" in r else ""),
                r.get("shape", ""),
                r.get("fmt", ""),
                str(r.get("tokens", "")),
                _fmt_num(r.get("rows_per_expert"), "{:.1f}"),
                r.get("experts", ""),
                _fmt_time(op.get("median_s")) if ok else "n/a",
                _fmt_time(r.get("collective_s")),
                f"{r['bytes'] / 1e6:.2f}",
                f"{r['flops'] / 1e9:.3f}" if r["flops"] else "—",
                _fmt_time(r["t_mem_s"]),
                _fmt_time(r["t_compute_s"]) if r["flops"] else "—",
                r["bound"][:3],
                _fmt_num(r.get("roofline_fraction") and 100 * r["roofline_fraction"], "{:.0f}%"),
                _fmt_num(r.get("roofline_fraction_bf16_peak") and 100 * r["roofline_fraction_bf16_peak"], "{:.0f}%")
                if r["flops"] else "—",
                *(_fmt_speedup(sp, r, name) for name in BASELINES),
            ])
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(cols))]
        lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def notes(self) -> str:
        """Baselines that could not run, and why (once each)."""
        seen = {}
        for r in self.records:
            for name, b in r.get("baselines", {}).items():
                if not b.get("available", True):
                    seen.setdefault(name, b.get("reason", ""))
            op = r.get("op", {})
            if not op.get("available", True):
                seen.setdefault(f"op {r['bench']}", op.get("reason", ""))
        return "\n".join(f"  {k}: unavailable — {v}" for k, v in seen.items())

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"machine": asdict(self.limits), "meta": self.meta, "records": self.records}
        path.write_text(json.dumps(doc, indent=1, default=_json_default))
        return path

    def plot(self, out_dir: Path, bench: str) -> list[Path]:
        """Two PNGs for one bench: roofline fraction and speed-ups, each against tokens per rank, one panel per
        shape (and per baseline for speed-ups), one line per format (and EP size)."""
        recs = [r for r in self.records if r["bench"] == bench and r.get("op", {}).get("available", True)]
        if not recs:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from matplotlib.ticker import FuncFormatter, NullFormatter

        out_dir.mkdir(parents=True, exist_ok=True)
        shapes = list(dict.fromkeys(r["shape"] for r in recs))
        label = lambda r: r["fmt"] + (f" S={r['ep_size']}" if "ep_size" in r else "")  # noqa: E731
        series = lambda rs: _group(rs, label)  # noqa: E731
        colors = {lab: f"C{i}" for i, lab in enumerate(dict.fromkeys(label(r) for r in recs))}
        xticks = sorted({r["tokens"] for r in recs})
        plain = FuncFormatter(lambda v, _: f"{v:g}")

        def style(ax, log_y: bool) -> None:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xticks)
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            if log_y:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plain)
                lo, hi = ax.get_ylim()
                few = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")  # wide ranges: 2s, 5s
                ax.yaxis.set_minor_formatter(plain if hi < 10 * lo else few)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7)

        paths = []

        fig, axes = plt.subplots(1, len(shapes), figsize=(max(6.0, 5 * len(shapes)), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            for lab, rs in series([r for r in recs if r["shape"] == shape]).items():
                pts = [(r["tokens"], r["roofline_fraction"]) for r in rs if r.get("roofline_fraction")]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=lab, color=colors[lab])
            ax.set(xlabel="tokens per rank", ylabel="fraction of roofline", title=f"{bench} — {MODEL_SHAPES[shape].name}")
            ax.axhline(1.0, color="grey", lw=0.5)
            style(ax, log_y=False)
            ax.set_ylim(0, max(1.05, ax.get_ylim()[1]))
        fig.suptitle(f"{bench}: roofline fraction, fp32 compute limit ({self.limits.threads} threads)", fontsize=10)
        fig.tight_layout()
        paths.append(out_dir / f"{bench}_roofline.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)

        names = [n for n in BASELINES if any((r.get("speedup") or {}).get(n) for r in recs)]
        if names:
            fig, axes = plt.subplots(len(shapes), len(names), figsize=(max(6.0, 4.5 * len(names)), 3.5 * len(shapes)),
                                     squeeze=False)
            for i, shape in enumerate(shapes):
                for j, name in enumerate(names):
                    ax = axes[i][j]
                    for lab, rs in series([r for r in recs if r["shape"] == shape]).items():
                        pts = [(r["tokens"], r["speedup"][name]) for r in rs if r["speedup"].get(name)]
                        if pts:
                            ax.plot(*zip(*pts), marker="o", label=lab, color=colors[lab])
                    ax.axhline(1.0, color="grey", lw=0.5)
                    ax.set(xlabel="tokens per rank", ylabel=f"speed-up vs {name}", title=MODEL_SHAPES[shape].name)
                    style(ax, log_y=True)
            fig.suptitle(f"{bench}: speed-up of static_moe over the baselines ({self.limits.threads} threads)", fontsize=10)
            fig.tight_layout()
            paths.append(out_dir / f"{bench}_speedup.png")
            fig.savefig(paths[-1], dpi=90)
            plt.close(fig)
        return paths


def machine_meta(threads: int) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _group(records: list[dict], key) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["tokens"])
    return out


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 1.0:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f}ms"
    return f"{s * 1e6:.1f}µs"


def _fmt_num(v, spec: str) -> str:
    return "—" if v is None else spec.format(v)


def _fmt_speedup(sp: dict, record: dict, name: str) -> str:
    b = record.get("baselines", {}).get(name)
    if b is None:
        return "—"
    if not b.get("available", True):
        return "n/a"
    v = sp.get(name)
    return "—" if v is None else f"{v:.2f}"


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


# ----------------------------------------------------------------------------------------------------------------
# Correctness checks (loose for baselines, SPEC §2 for the op) and the command line shared by every script
# ----------------------------------------------------------------------------------------------------------------
def check_baseline(name: str, out: torch.Tensor, ref: torch.Tensor, tolerance: float, what: str) -> float:
    """calc_diff of a baseline's output vs the reference's; raises when beyond ``tolerance`` (a broken baseline
    must not be timed)."""
    from static_moe.testing.numeric import calc_diff

    d = calc_diff(out.float(), ref.float())
    if not d <= tolerance:  # NaN fails too
        raise AssertionError(f"baseline {name} disagrees with static_moe.reference on {what}: calc_diff {d:.3e} "
                             f"> {tolerance:.0e}")
    return d


def check_op(out: torch.Tensor | None, ref: torch.Tensor, check: Callable[..., None]) -> str:
    """'ok', or the first line of why the op's output fails ``check(out, ref)`` (SPEC §2). Reported, not
    raised: the table flags a timing of a wrong result."""
    if out is None:
        return "n/a"
    try:
        check(out, ref)
    except AssertionError as e:
        return "FAIL: " + str(e).splitlines()[0][:160]
    return "ok"


def check_point(tokens: list[int]) -> int:
    """The one token count at which outputs are checked against the reference (the first ≥ 4, else the first)."""
    return next((t for t in tokens if t >= 4), tokens[0])


def add_common_args(p) -> None:
    """--shape, --tokens, --quick, --threads, --out, --no-plots."""
    p.add_argument("--shape", nargs="+", choices=[*MODEL_SHAPES, "all"], default=None,
                   help="model shapes (default: all; with --quick: qwen3_30b_a3b)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"tokens per rank (default: {' '.join(map(str, DEFAULT_TOKENS))}; with --quick: "
                        f"{' '.join(map(str, QUICK_TOKENS))})")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny run for development: {QUICK_LOCAL_EXPERTS} local experts, few tokens, one shape")
    p.add_argument("--threads", type=int, default=None, help="threads to pin (default: $OMP_NUM_THREADS or 2)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for JSON and PNGs")
    p.add_argument("--no-plots", action="store_true")


def resolve_args(args) -> tuple[list[str], list[int]]:
    """Shapes and token counts the arguments ask for."""
    if args.shape is None or "all" in args.shape:
        shapes = ["qwen3_30b_a3b"] if (args.quick and args.shape is None) else list(MODEL_SHAPES)
    else:
        shapes = list(dict.fromkeys(args.shape))
    tokens = args.tokens or list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    return shapes, tokens


def start(args, name: str) -> Report:
    """Pin the threads, measure the machine's limits, print them; a Report to fill."""
    threads = pin_threads(args.threads)
    print(f"[{name}] measuring machine limits on {threads} threads …", flush=True)
    limits = measure_machine(threads, quick=args.quick)
    report = Report(limits, meta={**machine_meta(threads), "quick": bool(args.quick), "script": name})
    print(report.header(), flush=True)
    return report


def finish(report: Report, args, name: str, benches: list[str]) -> None:
    """Measure the machine again (the best of both counts), print the table (and what was unavailable), write
    ``<out>/<name>.json`` and the plots."""
    report.refresh_limits(measure_machine(report.limits.threads, quick=args.quick))
    print()
    print(report.header())
    print(report.table())
    notes = report.notes()
    if notes:
        print("unavailable:\n" + notes)
    path = report.write_json(Path(args.out) / f"{name}.json")
    print(f"wrote {path}")
    if not args.no_plots:
        for bench in benches:
            for p in report.plot(Path(args.out), bench):
                print(f"wrote {p}")


def bench_weights(num_local: int, hidden: int, inter: int, fmt: str, seed: int = 0, distinct: int = 2) -> dict:
    """``generators.make_weights`` for ``num_local`` experts, built from ``distinct`` drawn experts tiled along
    the expert dim (separate memory, repeated values) — drawing and quantizing hundreds of millions of weights
    would take most of the time budget. Timings are unaffected: every expert's bytes are still read from DRAM
    (cold calls), and kernels do not look at values."""
    w = make_weights(min(distinct, num_local), hidden, inter, fmt, seed=seed)
    reps = -(-num_local // w["w13"].shape[0])
    tile = lambda t: None if t is None else t.repeat(reps, *([1] * (t.dim() - 1)))[:num_local].contiguous()  # noqa: E731
    return {k: tile(v) for k, v in w.items()}


def parse_pairs(spec: list[str] | None, default: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``["fp8xfp4", ...]`` → (act, weight) pairs; ``["all"]`` → every SPEC pair; None → ``default``."""
    from static_moe.testing.generators import FORMAT_PAIRS

    if not spec:
        return list(default)
    if "all" in spec:
        return list(FORMAT_PAIRS)
    pairs = [tuple(s.split("x")) for s in spec]
    bad = [p for p in pairs if p not in FORMAT_PAIRS]
    if bad:
        raise SystemExit(f"unsupported format pair(s) {bad}; supported: {['x'.join(p) for p in FORMAT_PAIRS]}")
    return pairs


def progress(rec: dict) -> None:
    """One line per measured point, while the run goes."""
    op = rec["op"]
    t = _fmt_time(op.get("median_s")) if op.get("available", True) else "n/a"
    sp = " ".join(f"×{k}={v:.2f}" for k, v in rec["speedup"].items() if v)
    frac = rec.get("roofline_fraction")
    print(f"  {rec['bench']} {rec.get('shape', '')} {rec.get('fmt', '')} T={rec['tokens']}: op {t} roof "
          f"{_fmt_num(frac and 100 * frac, '{:.0f}%')} {sp}" + (f" parity {op['parity']}" if "parity" in op else ""),
          flush=True)


def cost_forward(act_fmt: str, w_fmt: str, tokens: int, capacity: int, ep_size: int, row_bytes: int, width: int,
                 hidden: int, inter: int, topk: int, rank_stats: list[RoutingStats], group: int = 128,
                 shared: bool = True) -> Cost:
    """The whole step summed over the S ranks sharing this machine (SPEC §0): per rank, pack (parts in, [C, W]
    out), the gathered [S·C, W] written, local experts over the S·C gathered rows (its touched experts'
    weights, routed rows, routing, fp32 acc out), the reduce-scatter's [S·C, H] fp32 in and [C, H] out, and the
    combine (scattered rows and shared output in, bf16 [T, H] out). Collective traffic between processes is not
    counted: it is timed on its own."""
    total = Cost(0.0)
    rows = ep_size * capacity
    for st in rank_stats:
        total += cost_pack_rows(row_bytes, tokens, capacity, width)
        total += Cost(rows * width)
        total += cost_local_experts(act_fmt, w_fmt, rows, st.rows_active, topk, hidden, inter, st.experts_touched,
                                    st.pairs, group)
        total += Cost(4 * rows * hidden + 4 * capacity * hidden)
        total += Cost(4 * tokens * hidden + (2 * tokens * hidden if shared else 0) + 2 * tokens * hidden)
    return total
