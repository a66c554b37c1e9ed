"""The timer of bench/: pinned threads, cache flushes, the median of timed samples (docs/benchmarks.md).

Everything runs on the CPU, in the calling process; tensors are torch CPU tensors.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from static_moe.testing.machine import llc_bytes

MIN_REPEAT = 5  # docs/benchmarks.md: median of at least 5 timed runs


def pin_threads(threads: int | None = None) -> int:
    """Pin torch's intra-op thread count (default: $OMP_NUM_THREADS, else 2) and return what torch reports."""
    n = threads or int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(n)
    return torch.get_num_threads()


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


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 1,
    repeat: int = MIN_REPEAT,
    cold: bool = False,
    min_sample_s: float = 2e-3,
    before: Callable[[], None] | None = None,
    reduce: Callable[[list[float]], list[float]] | None = None,
) -> tuple[Timing, Any]:
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


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, repeat: int = MIN_REPEAT, warm: dict[str, Any] | None = None
) -> tuple[dict[str, Timing], dict]:
    """Time several cold calls in the same rounds: one warm-up each (its output returned, for the checks; a name in
    ``warm`` has had it, and that is its output), then ``max(repeat, 5)`` rounds, each flushing the caches before
    every call and timing each of ``fns`` once, in order. On a shared host the load comes and goes; timed in
    blocks, two calls can see different machines, and their ratio drifts with the load between the blocks (±30 %
    between runs here). Timed in the same rounds, they see the same moments. Returns each name's Timing (median
    over the rounds) and first output."""
    repeat = max(MIN_REPEAT, repeat)
    warm = warm or {}
    outs = {name: warm[name] if name in warm else fn() for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for name, fn in fns.items():
                flush_caches()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return {name: Timing(statistics.median(s), s, 1, 1) for name, s in samples.items()}, outs


def weight_stream(tensors: list[torch.Tensor | None]) -> Callable[[], Any]:
    """A read-only stream over exactly the bytes of ``tensors`` (an expert's weights and scales, in place): the
    roof for a call that only reads them, measured on the same pages. A wrapping int64 sum (as fast as a float32
    sum; torch's int32 and uint8 sums are many times slower) over the 8-byte-aligned body; the under 8 bytes before
    it (a view into a tensor at an odd offset) and after it are summed as uint8."""
    parts = []
    for t in tensors:
        if t is None:
            continue
        f = t.contiguous().view(-1).view(torch.uint8)
        head = min((-f.data_ptr()) % 8, f.numel())
        body = (f.numel() - head) // 8 * 8
        parts.append((f[:head], f[head : head + body].view(torch.int64), f[head + body :]))

    def stream():
        total = 0
        for head, body, tail in parts:
            total += int(body.sum())
            for rest in (head, tail):
                if rest.numel():
                    total += int(rest.sum())
        return total

    return stream


_MATMUL: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def bf16_matmul(n: int = 2048) -> tuple[Callable[[], Any], float]:
    """A bf16 n×n×n torch matmul (the shape of the machine limit's own measurement, static_moe.testing.machine) as
    a call to time in the same rounds as a compute-bound op, and its FLOPs: the bf16 rate at the op's moments. Timed
    so, each call follows a cache flush and the median is kept (the machine limit: the best of hot calls). Operands
    made once per n."""
    if n not in _MATMUL:
        g = torch.Generator().manual_seed(n)
        x, y = (torch.rand(n, n, generator=g).to(torch.bfloat16) for _ in range(2))
        _MATMUL[n] = (x, y, torch.empty(n, n, dtype=torch.bfloat16))
    x, y, out = _MATMUL[n]
    return (lambda: torch.mm(x, y, out=out)), 2.0 * n**3


def measure(fn: Callable[[], Any], **timer_kw) -> tuple[dict, Any]:
    """``time_fn`` for the op under test: a failure (op not implemented yet, an error) is recorded as
    ``{"available": False, "reason": ...}`` instead of stopping the run."""
    try:
        timing, out = time_fn(fn, **timer_kw)
    except Exception as e:  # noqa: BLE001  the table says why the op has no number
        return {"available": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    return {"available": True, **timing_dict(timing)}, out


def measure_with(fn: Callable[[], Any], companions: dict[str, Callable[[], Any]]) -> tuple[dict, Any, dict, dict]:
    """``measure`` for a cold op timed in the same rounds as ``companions`` (a weight stream, the baseline a target
    compares it with: :func:`time_interleaved`). Returns (the op's record, its output, each companion's timing
    dict, each companion's output); an op that fails is recorded as unavailable and the companions are timed
    without it."""
    try:
        warm = {"op": fn()}  # the op's warm-up call
        calls = {"op": fn, **companions}
    except Exception as e:  # noqa: BLE001  the table says why the op has no number
        op = {"available": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        calls, fn, warm = dict(companions), None, {}
    timed, outs = time_interleaved(calls, warm=warm)
    if fn is not None:
        op = {"available": True, **timing_dict(timed.pop("op"))}
    return op, outs.pop("op", None), {k: timing_dict(t) for k, t in timed.items()}, outs


def stream_fraction(stream: dict, op: dict) -> float | None:
    """The weight stream's median over the op's (same rounds): the fraction of the read-only stream over its own
    weight bytes that the op reaches (its other bytes, activations and output, are left out: a lower bound)."""
    if not op.get("available", True) or not op.get("median_s") or not stream.get("median_s"):
        return None
    return stream["median_s"] / op["median_s"]


def timing_dict(t: Timing) -> dict:
    return {"median_s": t.median_s, "samples_s": t.samples_s, "inner": t.inner}


def time_baseline(
    base: dict, outs: dict, name: str, impl, reason: str | None, call: Callable[[Any], Any], **timer
) -> None:
    """Time an optional baseline: ``call(impl)`` with :func:`time_fn` into ``base[name]`` (timing dict) and
    ``outs[name]`` (its output, for the parity check), or, where ``impl`` is None (the baseline cannot run here),
    ``base[name] = {"available": False, "reason": reason}`` and no output."""
    if impl is None:
        base[name] = {"available": False, "reason": reason}
        return
    timing, outs[name] = time_fn(lambda: call(impl), **timer)
    base[name] = timing_dict(timing)


def time_fastest_variant(variants: dict, call: Callable[[Any], Any], **timer) -> tuple[dict, Any]:
    """Time ``call(v)`` for every value of ``variants`` (keyed by dtype, e.g. torch_cached's fp32 and bf16
    weight caches) with :func:`time_fn` and keep the fastest, as docs/benchmarks.md asks of torch_cached.

    Returns (the fastest's timing dict with its ``variant`` name and every variant's median, its output)."""
    timed = {}
    for key, v in variants.items():
        timing, out = time_fn(lambda v=v: call(v), **timer)
        timed[str(key).replace("torch.", "")] = (timing, out)
    best = min(timed, key=lambda name: timed[name][0].median_s)
    entry = {
        **timing_dict(timed[best][0]),
        "variant": best,
        **{f"{name}_median_s": t.median_s for name, (t, _) in timed.items()},
    }
    return entry, timed[best][1]
