"""Where a CPU op's time goes: one benchmark point run under ``perf record``, sampled only inside the op's calls.

A missed performance target is explained by its binding resource, with a profile and a number. This
script gives the profile: it runs one ``expert_gemm`` or ``local_experts`` point of the benchmarks (same shapes,
weights and routing as bench_expert_gemm / bench_local_experts) under ``perf record -e cpu-clock`` and keeps the
samples, of every thread, that fall inside a call (each process logs its calls' starts and ends on the clock perf
stamps the samples with), so the cache flush between cold calls, the set-up and the idle time between calls are
not in it. It prints

- each process's median call time under the profiler;
- the samples by place, as a share and in thread-milliseconds per call on the main thread + the others: the
  expert-GEMM kernels, the rest of static_moe (SwiGLU, routing, activation prep), the OpenMP runtime (a thread
  waiting at a barrier or for work), torch, Python, the OS;
- in the hottest kernel symbol, the samples by instruction class: ``vdpbf16ps`` or ``tdpbf16ps`` (the
  multiply-adds), the weight decode (table permutes and shifts), loads (tile loads included), stores (the decoded
  panel or A tile, parked accumulators), the fp8 fold
  (``vfmadd``), prefetches, the rest. perf annotates the symbol over the whole recording; a kernel symbol runs
  only inside the calls.

The event is the OS timer (``cpu-clock``), which every host has: a VM often exposes no hardware counters (``perf
stat -e cycles`` says ``<not supported>``), and then there are no cache-miss counts. A timer sample lands on the
instruction the core was retiring at the interrupt, which for a stall is at or just after the instruction waited
for (a load's consumer); compare the classes of two runs of the same kernel (weights cold from DRAM against hot in
the L3, say) rather than read one class on its own. ``--copies 2 --threads 1`` runs two processes at once, as
forward's two gloo ranks share one host at S = 2.

    .venv/bin/python bench/bench_profile.py expert_gemm --shape v4_flash --pair bf16xfp4 --tokens 16
    .venv/bin/python bench/bench_profile.py expert_gemm --shape v4_flash --pair bf16xfp4 --tokens 16 --hot
    .venv/bin/python bench/bench_profile.py local_experts --pair fp8xfp4 --tokens 1 --threads 1 --copies 2

Needs the ``perf`` tool and ``kernel.perf_event_paranoid`` <= 2 (its own processes); says why and exits 2 without.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLE_HZ = 4000

# ---------------------------------------------------------------------------------------------------------------
# Reading perf's output (pure functions: tests/project/test_bench_smoke.py holds them to canned perf text).

PLACES = ("expert-GEMM kernels", "static_moe, other", "OpenMP runtime", "torch", "Python", "OS", "other")
_KERNEL_SYMBOL = re.compile(r"dot_|panel|expert_gemm_rows|slow_fp4|fp8_|fp4_|tile_")  # tile_*: the amx kernel


def place_of(dso: str, symbol: str) -> str:
    """Where a sample's code lives: one of PLACES, from perf's shared object and symbol."""
    if dso.startswith("_C") or "static_moe" in dso:
        return PLACES[0] if _KERNEL_SYMBOL.search(symbol) else PLACES[1]
    if dso.startswith(("libgomp", "libomp", "libiomp")):
        return PLACES[2]
    if dso.startswith(("libtorch", "libc10")):
        return PLACES[3]
    if dso.startswith(("python", "libpython")):
        return PLACES[4]
    if dso.startswith("[kernel"):
        return PLACES[5]
    return PLACES[6]


_SCRIPT_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([0-9.]+):\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


Sample = tuple[int, bool, float, str, str]  # pid, on the process's main thread, time in s, dso file name, symbol


def parse_script(text: str) -> list[Sample]:
    """``perf script -F pid,tid,time,ip,sym,dso`` → one Sample per line."""
    rows = []
    for line in text.splitlines():
        m = _SCRIPT_LINE.match(line)
        if m:
            rows.append((int(m[1]), m[1] == m[2], float(m[3]), os.path.basename(m[5]), m[4]))
    return rows


def in_windows(samples: list[Sample], windows: dict[int, list[tuple[float, float]]]) -> list[Sample]:
    """The samples that fall in one of their process's (start, end) windows (seconds, sorted, disjoint)."""
    import bisect

    starts = {pid: [w[0] for w in ws] for pid, ws in windows.items()}
    out = []
    for smp in samples:
        pid, t = smp[0], smp[2]
        if pid not in windows:
            continue
        i = bisect.bisect_right(starts[pid], t) - 1
        if i >= 0 and t <= windows[pid][i][1]:
            out.append(smp)
    return out


def places(samples: list[Sample]) -> dict[str, tuple[int, int]]:
    """Samples per place (PLACES order): (on a main thread, on the others)."""
    out = {p: [0, 0] for p in PLACES}
    for _, main, _, dso, sym in samples:
        out[place_of(dso, sym)][0 if main else 1] += 1
    return {p: (a, b) for p, (a, b) in out.items()}


CLASSES = ("vdpbf16ps / tdpbf16ps", "decode", "load", "store", "fold (vfmadd)", "prefetch", "other")
_DECODE = (
    "vpermw",
    "vpermb",
    "vpermi2b",
    "vpermt2b",
    "vpmultishiftqb",
    "vpsrlvw",
    "vpternlogd",
    "vpunpcklbw",
    "vpunpckhbw",
)
_MOVES = ("vmov", "vbroadcast", "vpbroadcast")
_ANNOTATE_LINE = re.compile(r"^\s*([0-9.]+)\s*:\s*[0-9a-f]+:\s+(\S+)\s*(.*)$")


def instruction_class(mnemonic: str, operands: str) -> str:
    """One of CLASSES for an x86 instruction in AT&T syntax (perf annotate: sources first, destination last): the
    weight decode's permutes and shifts; a vector move or broadcast from memory (weight bytes, activation units,
    the decoded panel) is a load, one to memory (the panel, parked accumulators) a store."""
    ops = [o.strip() for o in re.split(r",(?![^(]*\))", operands)] if operands else []
    if mnemonic.startswith(("vdpbf16ps", "tdpbf16ps")):
        return CLASSES[0]
    if mnemonic.startswith("tileload"):  # the amx kernel's A and B tiles
        return CLASSES[2]
    if mnemonic.startswith("tilestore"):
        return CLASSES[3]
    if mnemonic.startswith(_DECODE):
        return CLASSES[1]
    if mnemonic.startswith(_MOVES) and ops:
        if "(" in ops[0]:
            return CLASSES[2]
        if "(" in ops[-1]:
            return CLASSES[3]
    if mnemonic.startswith("vfmadd"):
        return CLASSES[4]
    if mnemonic.startswith("prefetch"):
        return CLASSES[5]
    return CLASSES[6]


def parse_annotate(text: str) -> list[tuple[float, str, str]]:
    """``perf annotate --stdio -s SYMBOL`` → [(percent, mnemonic, operands)] for the lines that hold samples."""
    rows = []
    for line in text.splitlines():
        m = _ANNOTATE_LINE.match(line)
        if m and float(m[1]) > 0:
            rows.append((float(m[1]), m[2], m[3]))
    return rows


def classes(rows: list[tuple[float, str, str]]) -> dict[str, float]:
    """Percent of a symbol's samples per instruction class (CLASSES order)."""
    out = dict.fromkeys(CLASSES, 0.0)
    for pct, mnem, ops in rows:
        out[instruction_class(mnem, ops)] += pct
    return out


# ---------------------------------------------------------------------------------------------------------------
# The profiled process: one benchmark point, its calls logged on the clock of the samples.


def _point(args):
    """(the call to profile, a label) for the point the arguments name, built as the benchmarks build it."""
    import bench_expert_gemm as EG
    import bench_local_experts as LE
    import torch
    from harness.workload import bench_weights, local_experts_for

    from static_moe.testing.generators import MODEL_SHAPES, make_activations, sliced_routing

    act_fmt, w_fmt = args.pair.split("x")
    shape = MODEL_SHAPES[args.shape]
    t = args.tokens
    if args.op == "expert_gemm":
        n, k = EG.GEMMS[args.gemm](shape)
        b, b_s = EG.expert_weight(n, k, w_fmt, seed=2, fp8_scales=args.fp8_scales)
        a, a_s = make_activations(t, k, act_fmt, EG.GROUP, seed=t)
        mask = torch.ones(t, dtype=torch.bool)
        return (lambda: torch.ops.static_moe.expert_gemm(a, a_s, b, b_s, mask, 0)), f"{args.gemm} N={n} K={k}"
    num_local = local_experts_for(args.shape, False)
    w = bench_weights(num_local, shape.hidden, shape.intermediate, w_fmt, seed=1)
    routing = sliced_routing(shape, [t], num_local, seed=t)
    x, xs = make_activations(t, shape.hidden, act_fmt, LE.GROUP, seed=t)
    op_args = (
        x,
        xs,
        routing.topk_idx[0],
        routing.topk_weights[0],
        w["w13"],
        w["w13_scale"],
        w["w2"],
        w["w2_scale"],
        0,
        None,
        448.0,
    )
    return (lambda: torch.ops.static_moe.local_experts(*op_args)), f"{num_local} local experts"


def child(args) -> None:
    """Call the point's op for ``args.seconds`` (cold: caches flushed before each call), writing each call's
    (start, end) on CLOCK_MONOTONIC, the clock perf stamps the samples with (``-k``), to ``<args.windows>/<pid>``.
    With copies, all start calling once every copy is set up and warm."""
    import torch
    from harness.timing import flush_caches, pin_threads

    import static_moe  # noqa: F401  registers the ops

    pin_threads(args.threads)
    call, label = _point(args)
    call()  # warm-up: first-call costs (tables, thread pool) stay out of the profile
    folder = Path(args.windows)
    (folder / f"ready.{os.getpid()}").touch()
    give_up = time.monotonic() + 300
    while len(list(folder.glob("ready.*"))) < args.copies:
        if time.monotonic() > give_up:
            raise SystemExit("bench_profile: the other copies never got ready")
        time.sleep(0.01)
    clock = lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # noqa: E731
    windows = []
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline or len(windows) < 5:
        if not args.hot:
            flush_caches()
        t0 = clock()
        call()
        windows.append((t0, clock()))
    (folder / str(os.getpid())).write_text("".join(f"{t0} {t1}\n" for t0, t1 in windows))
    times = [(t1 - t0) / 1e6 for t0, t1 in windows]
    print(
        f"{label}, pid {os.getpid()}, threads {torch.get_num_threads()}: {len(times)} calls, median "
        f"{statistics.median(times):.3f} ms under the profiler",
        flush=True,
    )


def launch(args, argv: list[str]) -> None:
    """Start ``args.copies`` profiled processes at once and wait for them (perf follows them all)."""
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--child", "--windows", args.windows], cwd=HERE)
        for _ in range(args.copies)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("bench_profile: a profiled process failed")


# ---------------------------------------------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why ``perf record`` cannot run here, or None."""
    if shutil.which("perf") is None:
        return "no perf tool on PATH"
    try:
        level = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except (OSError, ValueError):
        return None
    return None if level <= 2 else f"kernel.perf_event_paranoid is {level} (needs <= 2)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("op", choices=("expert_gemm", "local_experts"))
    p.add_argument("--shape", default="v4_flash", choices=("v4_flash", "v3", "qwen3_30b_a3b"))
    p.add_argument("--pair", default="bf16xfp4", help="activation × weight formats, e.g. fp8xfp4")
    p.add_argument("--tokens", type=int, default=16, help="rows (tokens per rank)")
    p.add_argument("--gemm", default="w13", choices=("w13", "w2"), help="expert_gemm: gate/up or down")
    p.add_argument("--fp8-scales", default="pow2", choices=("pow2", "float"), help="fp8 weights' scales")
    p.add_argument("--hot", action="store_true", help="no cache flush between calls (weights that fit stay in L3)")
    p.add_argument("--threads", type=int, default=None, help="threads to pin (default: $OMP_NUM_THREADS or 2)")
    p.add_argument("--seconds", type=float, default=4.0, help="how long to call the op")
    p.add_argument("--top", type=int, default=8, help="symbols and instructions to list")
    p.add_argument("--perf-data", help="keep perf's recording here (for perf report / annotate of your own)")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="processes running the point at once (forward at S = 2: two ranks of --threads 1 each)",
    )
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--windows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    raw = list(argv if argv is not None else sys.argv[1:])
    if args.launch:  # the point's own arguments, for the copies
        return launch(args, raw[: raw.index("--launch")])
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_profile: cannot profile: {reason}", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory() as tmp:
        data, wins = os.path.join(tmp, "perf.data"), os.path.join(tmp, "windows")
        os.mkdir(wins)
        cmd = [
            "perf",
            "record",
            "-q",
            "-e",
            "cpu-clock",
            "-F",
            str(SAMPLE_HZ),
            "-k",
            "CLOCK_MONOTONIC",
            "-o",
            data,
            "--",
            sys.executable,
            __file__,
            *raw,
            "--launch",
            "--windows",
            wins,
        ]
        fp8_w = args.pair.split("x")[-1] == "fp8"
        print(
            f"{args.op} {args.shape} {args.pair} T={args.tokens}{f' ({args.fp8_scales} scales)' if fp8_w else ''}"
            f", weights {'hot' if args.hot else 'cold (caches flushed before each call)'}"
            f"{f', {args.copies} processes at once' if args.copies > 1 else ''}",
            flush=True,
        )
        subprocess.run(cmd, check=True, cwd=HERE)
        if args.perf_data:
            shutil.copyfile(data, args.perf_data)
        windows = {
            int(f.name): [(int(a) / 1e9, int(b) / 1e9) for a, b in (ln.split() for ln in f.read_text().splitlines())]
            for f in Path(wins).iterdir()
            if f.name.isdigit()
        }
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "pid,tid,time,ip,sym,dso", "--ns"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        samples = in_windows(parse_script(script), windows)
        if not samples:
            raise SystemExit("bench_profile: no samples inside the calls")
        calls = sum(len(ws) for ws in windows.values())
        per_call_ms = 1e3 / SAMPLE_HZ / calls  # thread-milliseconds of one sample, per call
        shares = places(samples)
        print(
            f"samples inside the calls: {len(samples)} ({len(samples) * per_call_ms:.3f} thread-ms per call); by "
            f"place, thread-ms per call on the main thread + the others:"
        )
        for name, (main, other) in shares.items():
            if main + other:
                print(
                    f"  {name:<22} {100 * (main + other) / len(samples):5.1f} %  {main * per_call_ms:7.3f} + "
                    f"{other * per_call_ms:.3f}"
                )
        symbols: dict[tuple[str, str], int] = {}
        for _, _, _, dso, sym in samples:
            symbols[(dso, sym)] = symbols.get((dso, sym), 0) + 1
        top = sorted(symbols.items(), key=lambda kv: -kv[1])
        print("hottest symbols:")
        for (dso, sym), n in top[: args.top]:
            print(f"  {100 * n / len(samples):5.1f} %  {dso[:24]:<24} {sym[:100]}")
        kernels = [(key, n) for key, n in top if place_of(*key) == PLACES[0]]
        if not kernels:
            return
        (_, sym), n = kernels[0]
        ann = subprocess.run(
            ["perf", "annotate", "-i", data, "--stdio", "-s", sym], capture_output=True, text=True
        ).stdout
        ins = parse_annotate(ann)
        by_class = classes(ins)
        total = sum(by_class.values()) or 1.0
        print(f"in {sym[:100]} ({100 * n / len(samples):.1f} % of the samples), by instruction class:")
        for name, v in by_class.items():
            if v:
                print(f"  {name:<22} {100 * v / total:5.1f} %")
        print("  hottest instructions:")
        for ipct, mnem, ops in sorted(ins, reverse=True)[: args.top]:
            print(f"    {ipct:5.1f} %  {mnem} {ops[:70]}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
