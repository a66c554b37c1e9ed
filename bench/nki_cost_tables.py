"""The MBU tables of docs/backends/nki.md ("Estimated time"), rendered from bench_nki_gemm.py's JSON, and their
parser (tests/nki/test_nki_cost_tables.py reads the doc with it).

A table has one row per model, format pair, target and LNC, and one cell per (EP, T) point: the MBU in % of the
launch's HBM share (``fraction`` of the JSON, rounded down to a whole per cent), **bold** where that figure is ≥ 60,
then the binding component; ``--doc`` carries each cell's ``(old NN)`` annotation over from the doc's current
tables (figures of the pre-correction cost model, which the bench no longer computes).

    .venv/bin/python bench/nki_cost_tables.py [--json bench/results/nki_gemm.json] [--doc docs/backends/nki.md]
                                              [--lnc 1] [--pairs bf16xbf16:trn2,fp8xfp8:trn2,fp8xfp8:trn3]
                                              [--misses]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

POINTS = ((1, 1), (1, 16), (1, 128), (8, 1), (8, 16), (8, 128))  # (EP, T) per column
MODELS = ("V4-Flash", "V3", "Qwen3-30B-A3B")
GOAL = 60  # per cent: bold at or above
BOUNDS = ("tensor", "vector", "scalar", "gpsimd", "sync", "dma", "hbm", "dge", "loop")  # the cost components
HEAD = "| model | act×w | target | LNC | " + " | ".join(f"EP {ep}, T={t}" for ep, t in POINTS) + " |"
CELL = re.compile(r"^(?:\*\*(?P<bold>\d+)\*\*|(?P<plain>\d+)) (?P<bound>[a-z]+)(?: \(old (?P<old>\d+)\))?$")


def figure(fraction: float) -> int:
    """The whole per cent a cell shows, rounded down: a figure of 60 is an MBU of at least 60 %, so bold (and the
    count of points meeting the goal) agrees with the unrounded value, and no figure rounds up past a ceiling."""
    return math.floor(100 * fraction)


def cell(fraction: float, bound: str, old: int | None = None) -> str:
    f = figure(fraction)
    text = f"**{f}**" if f >= GOAL else str(f)
    return f"{text} {bound}" + (f" (old {old})" if old is not None else "")


def parse_tables(markdown: str) -> list[dict]:
    """Every row of every MBU table in ``markdown``: ``{"model", "pair", "target", "lnc", "cells": {(EP, T):
    {"figure", "bold", "bound", "old"}}}``; a cell that does not parse raises ValueError."""
    rows, in_table = [], False
    for line in markdown.splitlines():
        if line.strip() == HEAD:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            in_table = False
            continue
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if set(parts[0]) <= {"-"}:  # the separator row
            continue
        model, pair, target, lnc, *cells = parts
        if len(cells) != len(POINTS):
            raise ValueError(f"row {line!r}: {len(cells)} cells, want {len(POINTS)}")
        parsed = {}
        for point, text in zip(POINTS, cells):
            m = CELL.match(text)
            if m is None:
                raise ValueError(f"cell {text!r} of row {line!r}")
            parsed[point] = {
                "figure": int(m["bold"] or m["plain"]),
                "bold": m["bold"] is not None,
                "bound": m["bound"],
                "old": int(m["old"]) if m["old"] else None,
            }
        rows.append({"model": model, "pair": pair, "target": target, "lnc": int(lnc), "cells": parsed})
    return rows


def render(results: list[dict], lnc: int, pairs: list[tuple[str, str]], old: list[dict] = ()) -> str:
    """The markdown table of ``lnc`` for the ``(pair "a×w", target)`` rows, models in :data:`MODELS` order."""
    olds = {(r["model"], r["pair"], r["target"], r["lnc"]): r["cells"] for r in old}
    by_key = {
        (r["model"], r["pair"], r["target"], r["lnc"], r["ep"], r["tokens"]): r
        for r in results
        if r["kernel"] == "local_experts"
    }
    lines = [HEAD, "|" + "---|" * (4 + len(POINTS))]
    for model in MODELS:
        for pair, target in pairs:
            if not any((model, pair, target, lnc, ep, t) in by_key for ep, t in POINTS):
                continue
            cells = []
            for ep, t in POINTS:
                r = by_key.get((model, pair, target, lnc, ep, t))
                prev = olds.get((model, pair, target, lnc), {}).get((ep, t), {}).get("old")
                cells.append("—" if r is None else cell(r["fraction"], r["bound"], prev))
            lines.append(f"| {model} | {pair} | {target} | {lnc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MISS_HEAD = "| model | act×w | target | LNC | EP, T | MBU % | est µs | binds, µs | next, µs | ideal µs | items | after barrier µs |"


def render_misses(results: list[dict], lnc: int, pairs: list[tuple[str, str]]) -> str:
    """One row per point below :data:`GOAL`: the estimate, the binding and the next component (µs; at LNC = 2
    those of the slower core before the barrier), the ideal HBM time, the work items (per core) and, at
    LNC = 2, core 1's staged adds after the barrier."""
    lines = [MISS_HEAD, "|" + "---|" * 12]
    order = {(m, p, t): i for i, (m, (p, t)) in enumerate((m, pt) for m in MODELS for pt in pairs)}
    sel = [
        r
        for r in results
        if r["kernel"] == "local_experts" and r["lnc"] == lnc and (r["model"], r["pair"], r["target"]) in order
    ]
    sel.sort(key=lambda r: (order[(r["model"], r["pair"], r["target"])], POINTS.index((r["ep"], r["tokens"]))))
    for r in sel:
        if figure(r["fraction"]) >= GOAL:
            continue
        comps = sorted(((r[k], k[:-2]) for k in r if k.endswith("_s") and k[:-2] in BOUNDS), reverse=True)
        (t1, c1), (t2, c2) = comps[0], comps[1]
        after = "—" if lnc == 1 else f"{1e6 * max(r['segments_s'][-1]):.0f}"
        items = "/".join(map(str, r["items_per_core"]))
        lines.append(
            f"| {r['model']} | {r['pair']} | {r['target']} | {lnc} | {r['ep']}, {r['tokens']} | "
            f"{100 * r['fraction']:.1f} | {1e6 * r['time_s']:.0f} | {c1} {1e6 * t1:.0f} | {c2} {1e6 * t2:.0f} | "
            f"{1e6 * r['ideal_s']:.0f} | {items} | {after} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=here / "results" / "nki_gemm.json")
    ap.add_argument("--doc", type=Path, help="carry the (old NN) figures over from this doc's tables")
    ap.add_argument("--lnc", type=int, default=1)
    ap.add_argument("--misses", action="store_true", help="the points below 60 %% with their component times")
    ap.add_argument("--pairs", default="bf16xbf16:trn2,fp8xfp8:trn2,fp8xfp8:trn3", help="pair:target, …")
    args = ap.parse_args(argv)
    results = json.loads(args.json.read_text())
    pairs = [(p.replace("x", "×"), t) for p, t in (s.split(":") for s in args.pairs.split(","))]
    old = parse_tables(args.doc.read_text()) if args.doc else []
    print(render_misses(results, args.lnc, pairs) if args.misses else render(results, args.lnc, pairs, old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
