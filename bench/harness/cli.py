"""The command line shared by every benchmark script, and the start and end of a run (machine limits measured
before and after, the table printed, JSON and plots written)."""

from __future__ import annotations

from pathlib import Path

from static_moe.testing.generators import MODEL_SHAPES
from static_moe.testing.machine import measure_machine

from .report import Report, machine_meta
from .timing import pin_threads
from .workload import QUICK_LOCAL_EXPERTS

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
DEFAULT_TOKENS = (1, 4, 16, 64, 128)
QUICK_TOKENS = (1, 4)


def add_common_args(p) -> None:
    """--shape, --tokens, --quick, --threads, --out, --no-plots."""
    p.add_argument(
        "--shape",
        nargs="+",
        choices=[*MODEL_SHAPES, "all"],
        default=None,
        help="model shapes (default: all; with --quick: qwen3_30b_a3b)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help=f"tokens per rank (default: {' '.join(map(str, DEFAULT_TOKENS))}; with --quick: "
        f"{' '.join(map(str, QUICK_TOKENS))})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny run for development: {QUICK_LOCAL_EXPERTS} local experts, few tokens, one shape",
    )
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
