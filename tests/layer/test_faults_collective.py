"""Every exception on any rank, whatever its type or where it is raised, is a collective verdict (docs/errors.md).

Each scenario runs on 2 and 3 gloo ranks, with each dispatch + combine of SPEC §7 (the step headers and error
messages travel in the all-gather's rows or in the all-to-all's blocks): a good step, then a step (or a layer
construction) in which rank 1 fails in one way, then the good step again. Every rank must raise within BOUND_S seconds, and the next good
step must give, on every rank, bitwise the output of the first. The process-group timeout (PG_TIMEOUT_S) is
longer than BOUND_S, so a rank left waiting in a collective fails the bound instead of passing.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from static_moe.testing.distributed import run_ranks
from static_moe.testing.generators import make_activations, make_routing, make_weights

H, I, L, K, C = 128, 128, 2, 2, 4
BOUND_S = 10.0
PG_TIMEOUT_S = 30.0
FAILING = 1
# SPEC §7's combinations (dispatch, combine, dispatch_capacity); Cd = 2 < C, so an error message is cut to the
# two rows of one all-to-all block.
COMBOS = [("all_gather", "fp32", 0), ("all_gather", "bf16", 0), ("all_to_all", "bf16", 2)]
_COMBO_ARGS = ("dispatch", "combine", "dispatch_capacity")


def _case(
    rank: int, size: int, act: str = "bf16", wfmt: str = "bf16", index_dtype=torch.int32, combo=COMBOS[0]
) -> dict:
    e = L * size
    w = make_weights(L, H, I, wfmt, seed=rank)
    x, xs = make_activations(3, H, act, seed=10 + rank)
    idx, tw = make_routing(3, K, e, seed=20 + rank, empty_frac=0.2, index_dtype=index_dtype)
    return dict(
        x=x,
        x_scale=xs,
        topk_idx=idx,
        topk_weights=tw,
        **w,
        shared_output=None,
        num_experts=e,
        capacity=C,
        swiglu_limit=None,
        ep_rank=rank,
        ep_size=size,
        fp8_max=448.0,
        weight_layout="eoi",
        **dict(zip(_COMBO_ARGS, combo)),
    )


_ARGS = ("x", "x_scale", "topk_idx", "topk_weights", "w13", "w13_scale", "w2", "w2_scale", "shared_output")


def _op_call(case: dict, group_name: str, fn=None):
    fn = fn or torch.ops.static_moe.forward
    return fn(
        *[case[a] for a in _ARGS],
        case["num_experts"],
        case["capacity"],
        case["swiglu_limit"],
        group_name,
        case["ep_rank"],
        case["ep_size"],
        case["fp8_max"],
        case["weight_layout"],
        **{k: case[k] for k in _COMBO_ARGS},
    )


def _wrapper_call(case: dict, group_name: str):
    from static_moe.ops.forward import forward

    kw = {
        k: case[k]
        for k in ("num_experts", "capacity", "swiglu_limit", "ep_rank", "ep_size", "fp8_max", "weight_layout")
        + _COMBO_ARGS
    }
    return forward(*[case[a] for a in _ARGS], group_name=group_name, **kw)


def _set(**changes):
    def mutate(case):
        case.update(changes)

    return mutate


def _idx(value: int):
    def mutate(case):
        case["topk_idx"] = case["topk_idx"].to(torch.int64).clone()
        case["topk_idx"][0, 0] = value

    return mutate


def _on_meta(case):
    case["x"] = case["x"].to("meta")


def _three_d(case):
    case["x"] = case["x"].unsqueeze(0)


# The faulty calls of the op: (name, formats, mutation of the failing rank's case, caller, failing rank's type)
OP_FAULTS = [
    ("int64 id 2^32 + 1", ("bf16", "bf16"), _idx(2**32 + 1), "op", "ValueError"),
    ("int64 id 2^32 - 1", ("bf16", "bf16"), _idx(2**32 - 1), "op", "ValueError"),
    ("int64 id -2^32", ("bf16", "bf16"), _idx(-(2**32)), "op", "ValueError"),
    ("capacity 4.0", ("bf16", "bf16"), _set(capacity=4.0), "wrapper", "ValueError"),
    ("swiglu_limit 10**400", ("bf16", "bf16"), _set(swiglu_limit=10**400), "wrapper", "ValueError"),
    ("x None", ("bf16", "bf16"), _set(x=None), "wrapper", "TypeError"),
    ("x on meta", ("bf16", "bf16"), _on_meta, "op", "ValueError"),
    ("capacity 2^31", ("bf16", "bf16"), _set(capacity=2**31), "op", "ValueError"),
    ("ep_size 1", ("bf16", "bf16"), _set(ep_size=1, ep_rank=0), "op", "ValueError"),
    ("3-D x compiled", ("bf16", "bf16"), _three_d, "compiled", "ValueError"),
    ("NaN fp8 weight scale", ("bf16", "fp8"), None, "op", "ValueError"),
    # An exception of any type at each stage before the all-gather (the kernel stage, after it: test_faults.py).
    ("KeyError in the checks", ("bf16", "bf16"), "check_forward", "op", "KeyError"),
    ("KeyError in the weight-scale scan", ("bf16", "fp8"), "check_weight_scale_values", "op", "KeyError"),
    ("KeyError in the pack", ("bf16", "bf16"), "_packed_parts", "op", "KeyError"),
    ("KeyError in the header", ("bf16", "bf16"), "header", "op", "KeyError"),
]


def _nan_scale(case):
    case["w13_scale"] = case["w13_scale"].clone()
    case["w13_scale"][0, 0, 0] = float("inf")


def _injected(*args, **kwargs):
    raise KeyError("injected failure")


def _with_injection(stage: str, fn):
    """fn() with the forward's ``stage`` raising KeyError (the header: only when it would report an OK call)."""
    import importlib

    fwd = importlib.import_module("static_moe.ops.forward")
    target, attr = (fwd._status, "build_header") if stage == "header" else (fwd, stage)
    real = getattr(target, attr)

    def header(device, kind, *args):
        if kind == fwd._status.OK:
            raise KeyError("injected failure")
        return real(device, kind, *args)

    setattr(target, attr, header if stage == "header" else _injected)
    try:
        return fn()
    finally:
        setattr(target, attr, real)


def _attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "msg": "", "s": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001  (the parent judges the type and message)
        return {"raised": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


def _op_fault_worker(rank: int, size: int) -> list[dict]:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    compiled = torch.compile(torch.ops.static_moe.forward, fullgraph=True, backend="eager")
    calls = {"op": _op_call, "wrapper": _wrapper_call, "compiled": lambda c, n: _op_call(c, n, fn=compiled)}
    records = []
    for combo, (label, fmts, mutate, caller, _) in itertools.product(COMBOS, OP_FAULTS):
        call = calls[caller]
        base = call(_case(rank, size, *fmts, combo=combo), name)
        case = _case(rank, size, *fmts, combo=combo)
        if rank == FAILING and isinstance(mutate, str):
            rec = _attempt(lambda: _with_injection(mutate, lambda: call(case, name)))
        else:
            if rank == FAILING:
                (mutate or _nan_scale)(case)
            rec = _attempt(lambda: call(case, name))
        again = call(_case(rank, size, *fmts, combo=combo), name)
        rec.update(case=label, combo=combo, next_ok=bool(torch.equal(again, base)))
        records.append(rec)
    return records


def _check_every_rank_raised(records: list[dict], failing_type: str) -> None:
    for r, rec in enumerate(records):
        assert rec["raised"] is not None, f"rank {r} returned normally"
        if r == FAILING:
            assert rec["raised"] == failing_type, (r, rec)
        else:
            assert rec["raised"] in ("RuntimeError", "ValueError"), (r, rec)
            assert "rank 1" in rec["msg"] or "differ" in rec["msg"], (r, rec)
        assert rec["s"] < BOUND_S, (r, rec)
        assert rec["next_ok"], (r, rec)


@pytest.mark.parametrize("size", [2, 3])
def test_op_faults_reach_every_rank(size):
    per_rank = run_ranks(_op_fault_worker, size, timeout=300.0, pg_timeout=PG_TIMEOUT_S)
    cases = list(itertools.product(COMBOS, OP_FAULTS))
    assert all(len(recs) == len(cases) for recs in per_rank)
    for i, (combo, (label, _, _, _, failing_type)) in enumerate(cases):
        records = [recs[i] for recs in per_rank]
        assert all(rec["case"] == label and rec["combo"] == combo for rec in records)
        _check_every_rank_raised(records, failing_type)
        if label.startswith("int64 id"):
            assert "topk_idx must hold global expert ids" in records[FAILING]["msg"], records


# --- StaticMoE: construction and forward ------------------------------------------------------------------------
def _layer_kwargs(size, combo=COMBOS[0]):
    return dict(
        hidden_size=H, intermediate_size=I, num_experts=L * size, top_k=K, capacity=C, **dict(zip(_COMBO_ARGS, combo))
    )


def _failing_alloc(*args, **kwargs):
    raise MemoryError("injected allocation failure")


# (name, the failing rank's constructor keywords or a fault in its call, its exception type, what every rank's
# message says)
LAYER_FAULTS = [
    ("device gpu", dict(device="gpu"), "RuntimeError", "gpu"),
    ("swiglu_limit 10**400", dict(swiglu_limit=10**400), "ValueError", "swiglu_limit must be None or a positive"),
    ("allocation fails", "alloc", "MemoryError", "injected allocation failure"),
    *(
        [("device cuda on a CPU build", dict(device="cuda"), "AssertionError", "CUDA")]
        if not torch.cuda.is_available()
        else []
    ),
    ("hidden on meta", "forward meta hidden", "ValueError", "hidden is on meta"),
    ("weights moved to meta", "forward meta weights", "RuntimeError", "weights are now on meta"),
    ("NaN hidden, fp8 layer", "forward nan fp8", "ValueError", "NaN"),
]


def _layer_fault_worker(rank: int, size: int) -> list[dict]:
    records = []
    for combo in COMBOS:
        records += [dict(rec, combo=combo) for rec in _layer_faults(rank, size, combo)]
    return records


def _layer_faults(rank: int, size: int, combo) -> list[dict]:
    import torch.distributed as dist

    import static_moe.module as module
    from static_moe import StaticMoE

    group = dist.group.WORLD
    layer = StaticMoE(**_layer_kwargs(size, combo), ep_group=group)
    x, _ = make_activations(3, H, "bf16", seed=rank)
    idx, tw = make_routing(3, K, L * size, seed=20 + rank)
    base = layer(x, idx, tw)
    records = []
    for label, change, _, _ in LAYER_FAULTS:
        if isinstance(change, dict):
            kw = change if rank == FAILING else {}
            rec = _attempt(lambda: StaticMoE(**_layer_kwargs(size, combo), ep_group=group, **kw).close())
        elif change == "alloc":
            real = module._init_weights
            if rank == FAILING:
                module._init_weights = _failing_alloc
            try:
                rec = _attempt(lambda: StaticMoE(**_layer_kwargs(size, combo), ep_group=group).close())
            finally:
                module._init_weights = real
        elif change == "forward meta hidden":
            rec = _attempt(lambda: layer(x.to("meta") if rank == FAILING else x, idx, tw))
        elif change == "forward nan fp8":
            fp8 = StaticMoE(**_layer_kwargs(size, combo), ep_group=group, act_format="fp8", weight_format="fp8")
            bad = x.clone()
            if rank == FAILING:
                bad[1, 3] = float("nan")
            rec = _attempt(lambda: fp8(bad, idx, tw))
            fp8.close()
        else:
            saved = layer.w13
            if rank == FAILING:
                layer._parameters["w13"] = torch.nn.Parameter(saved.to("meta"), requires_grad=False)
            rec = _attempt(lambda: layer(x, idx, tw))
            layer._parameters["w13"] = saved
        rec.update(case=label, next_ok=bool(torch.equal(layer(x, idx, tw), base)))
        records.append(rec)
    layer.close()
    return records


@pytest.mark.parametrize("size", [2, 3])
def test_layer_faults_reach_every_rank(size):
    per_rank = run_ranks(_layer_fault_worker, size, timeout=300.0, pg_timeout=PG_TIMEOUT_S)
    cases = list(itertools.product(COMBOS, LAYER_FAULTS))
    assert all(len(recs) == len(cases) for recs in per_rank)
    for i, (combo, (label, _, failing_type, needle)) in enumerate(cases):
        records = [recs[i] for recs in per_rank]
        for r, rec in enumerate(records):
            assert rec["case"] == label and rec["combo"] == combo
            assert rec["raised"] is not None, f"{label}: rank {r} returned normally"
            if r == FAILING:
                assert rec["raised"] == failing_type, (label, r, rec)
            else:
                assert "rank(s) [1]" in rec["msg"] or "rank 1 failed" in rec["msg"], (label, r, rec)
            assert needle in rec["msg"], (label, r, rec)
            assert rec["s"] < BOUND_S, (label, r, rec)
            assert rec["next_ok"], (label, r, rec)
