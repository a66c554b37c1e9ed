"""Exact extrapolation of an interpreted NKI launch's cost estimate to more experts and work items.

The NKI interpreter's cost model (``nki_interpreter.cost.CostModel``) times a run from its ``CostRecord``; an
LNC = 2 launch has one record per logical core, cut into stretches at each ``core_barrier``
(``CostRecord.segments``). Here a record is reduced to its **features**, the quantities the model's estimate is
built from that add across runs:

- ``<engine>_s``: each engine's seconds (``CostModel.engine_times``: cycles, per-instruction fixed cost, software
  DGE descriptors charged to GpSimd), linear in the instructions;
- ``dma_data_s``: Σ of the DMAs' data phases (``CostModel.dma_data_time``);
- ``dma_count`` and ``hw_dge_count`` (DMAs whose descriptors a hardware DGE generates), integers;
- ``hbm_bytes`` (an accumulate's read included) and ``loop_iterations``, integers.

Records of the same kernel at 1 and 2 experts, with 0 and 1 item per core, combine linearly into any layer's
features (:func:`combine`); the model's two non-linear terms — the DMA fixed cost per 16 queued DMAs and the DGE
cost per 2 DGE instances — are applied only to the combined counts (:func:`components`). Combining component
*times* instead would round those terms per record (an error up to 1.3 µs per work item); combining features
is exact wherever the records are affine in what is combined, and ``tests/nki/test_nki_bench_extrapolation.py``
checks :func:`estimate` against ``CostModel.estimate_programs`` on real runs.
"""

from __future__ import annotations

import math

from nki_interpreter.cost import COMPONENTS, ENGINES  # noqa: F401  (COMPONENTS: the names estimate() returns)

FEATURES = tuple(f"{e}_s" for e in ENGINES) + (
    "dma_data_s",
    "dma_count",
    "hw_dge_count",
    "hbm_bytes",
    "loop_iterations",
)
COUNTS = ("dma_count", "hw_dge_count", "hbm_bytes", "loop_iterations")  # integers


def features(model, rec) -> dict:
    """The additive features of one ``CostRecord`` (one core, one stretch between barriers) under ``model``."""
    eng = model.engine_times(rec)
    out = {f"{e}_s": eng.get(e, 0.0) for e in ENGINES}
    out["dma_data_s"] = sum(model.dma_data_time(d) for d in rec.dmas)
    out["dma_count"] = len(rec.dmas)
    # as CostModel.dge_time: runtime-descriptor DMAs, except the indirect ones a software DGE (GpSimd) generates
    out["hw_dge_count"] = sum(
        1 for d in rec.dmas if (d.dge or d.indirect) and not (d.indirect and model.indirect_on_gpsimd)
    )
    out["hbm_bytes"] = rec.hbm_bytes
    out["loop_iterations"] = rec.loop_iterations
    return out


def launch_features(model, records: list) -> list[list[dict]]:
    """Features of a launch: ``[core][segment]`` from the records of ``nki_interpreter.last_run().programs``."""
    return [[features(model, seg) for seg in rec.segments()] for rec in records]


def combine(terms) -> list[list[dict]]:
    """Σ coeff · launch over ``(coeff, launch features)`` pairs of the same shape (cores × segments). With whole
    coefficients (extrapolation) the counts stay integers; fractional ones (an interpolation) keep them
    fractional, so the non-linear terms of :func:`components` are then approximate."""
    first = terms[0][1]
    whole = all(float(coeff).is_integer() for coeff, _ in terms)
    out = []
    for c in range(len(first)):
        core = []
        for s in range(len(first[c])):
            f = {k: sum(coeff * launch[c][s][k] for coeff, launch in terms) for k in FEATURES}
            if whole:
                for k in COUNTS:
                    f[k] = round(f[k])
            core.append(f)
        out.append(core)
    return out


def components(model, f: dict) -> dict:
    """The estimate's component times (``CostModel.estimate``) of one core's stretch from its features."""
    parts = {f"{e}_s": f[f"{e}_s"] for e in ENGINES}
    fixed = math.ceil(f["dma_count"] / model.dma_queues) * model.dma_fixed
    parts["dma_s"] = f["dma_data_s"] + fixed if f["dma_count"] else 0.0
    parts["hbm_s"] = f["hbm_bytes"] / model.hbm_bandwidth_per_core
    parts["dge_s"] = math.ceil(f["hw_dge_count"] / model.dge_instances) * model.dge_fixed
    parts["loop_s"] = f["loop_iterations"] * model.loop_iteration_s
    return parts


def estimate(model, launch: list[list[dict]]) -> dict:
    """``CostModel.estimate_programs`` from features: ``time_s`` = Σ over segments of the slowest core's max
    component; ``serial_s`` the same cores' component sums; the components and ``bound`` of the slowest core in
    the longest segment; ``hbm_bytes`` over every core and segment; ``programs`` = cores; ``segments_s`` each
    core's time per segment."""
    total, serial, worst, seg_times = 0.0, 0.0, None, []
    for s in range(len(launch[0])):
        per_core = [components(model, core[s]) for core in launch]
        slow = max(per_core, key=lambda p: max(p.values()))
        t = max(slow.values())
        seg_times.append([max(p.values()) for p in per_core])
        total += t
        serial += sum(slow.values())
        if worst is None or t > max(worst.values()):
            worst = slow
    return {
        **worst,
        "time_s": total,
        "serial_s": serial,
        "bound": max(worst, key=worst.get)[:-2] if total > 0 else "none",
        "hbm_bytes": sum(f["hbm_bytes"] for core in launch for f in core),
        "programs": len(launch),
        "segments_s": seg_times,  # [segment][core]: each core's overlapped estimate of the stretch
    }
