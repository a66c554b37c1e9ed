"""Collective error semantics of torch.ops.static_moe.forward (SPEC §5, docs/errors.md), on 2 and 3 gloo ranks.

Every fault is injected on one rank (or two) between good steps. For each, every rank must raise within
BOUND_S seconds — the failing rank its own error, the others RuntimeError naming it; configurations that
differ: ValueError on every rank — and the next good step must give, on every rank, bitwise the output of
the good step before. A rank killed between steps must make the survivors raise within the bound, not hang.

Workers return plain records (errors caught inside the rank, see _attempt) and the parent asserts on them, so a
wrong message fails with the message in view. The harness's process-group timeout (PG_TIMEOUT_S) is longer
than BOUND_S: a rank left waiting in a collective surfaces as a slow timeout, never as a pass. Shapes are tiny
(H = I = 128, two local experts, C = 4) so the suite runs in well under a minute on two busy cores.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from static_moe.testing.distributed import RankFailure, run_ranks
from static_moe.testing.generators import make_activations, make_routing, make_weights

H, I, L, K, C = 128, 128, 2, 2, 4
BOUND_S = 10.0  # every rank raises within this; generous for loaded CI machines, far below PG_TIMEOUT_S
PG_TIMEOUT_S = 30.0


def _case(
    rank: int,
    size: int,
    act: str = "bf16",
    wfmt: str = "bf16",
    tokens: int = 3,
    group: int = 128,
    hidden: int = H,
    num_local: int = L,
    topk: int = K,
    seed: int = 0,
) -> dict:
    e = num_local * size
    w = make_weights(num_local, hidden, I, wfmt, seed=100 * seed + rank)
    x, xs = make_activations(tokens, hidden, act, group=group, seed=100 * seed + 10 + rank)
    idx, tw = make_routing(tokens, topk, e, seed=100 * seed + 20 + rank, empty_frac=0.2)
    return dict(x=x, x_scale=xs, idx=idx, tw=tw, **w, shared=None, num_experts=e, capacity=C, limit=None, fp8_max=448.0)


def _call(case: dict, rank: int, size: int, group_name: str, fn=None) -> torch.Tensor:
    return (fn or torch.ops.static_moe.forward)(
        case["x"],
        case["x_scale"],
        case["idx"],
        case["tw"],
        case["w13"],
        case["w13_scale"],
        case["w2"],
        case["w2_scale"],
        case["shared"],
        case["num_experts"],
        case["capacity"],
        case["limit"],
        group_name,
        rank,
        size,
        case["fp8_max"],
    )


def _attempt(fn) -> dict:
    """Run one step; its outcome as data: the exception type and message (or "ok") and the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "msg": "", "s": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001  (the parent judges the type and message)
        return {"raised": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


# --- the faults: (name, ranks that fail, how the inputs of a failing rank are changed) ---------------------------
def _more_tokens(c):
    big = _case(0, 2, tokens=C + 1, seed=9)
    c.update(x=big["x"], idx=big["idx"] % c["num_experts"], tw=big["tw"])


def _id_too_big(c):
    c["idx"] = c["idx"].clone()
    c["idx"][0, 0] = c["num_experts"]


def _id_below_minus_one(c):
    c["idx"] = c["idx"].clone()
    c["idx"][1, 1] = -2


def _routing_shape(c):
    c["idx"] = torch.cat([c["idx"], c["idx"][:, :1]], dim=1)  # k + 1 ids, k weights


def _routing_dtype(c):
    c["idx"] = c["idx"].float()


def _activation_dtype(c):
    c["x"] = c["x"].float()


def _activation_shape(c):
    c["x"] = torch.cat([c["x"], c["x"]], dim=1)  # H doubled against this rank's weights


def _ue8m0_nan_byte(c):
    c["w13_scale"] = c["w13_scale"].clone()
    c["w13_scale"][1, 3, 2] = 255  # in expert 1, whether or not a row is routed to it


def _fp8_nan_weight_scale(c):
    c["w2_scale"] = c["w2_scale"].clone()
    c["w2_scale"][0, 5, 0] = float("nan")


def _nan_activation_scale(c):
    c["x_scale"] = c["x_scale"].clone()
    c["x_scale"][2, 0] = float("nan")


def _nan_activation_quantized(c):
    """A NaN in the bf16 activation, quantized on the device path (no check): the scale comes out −0.0."""
    from static_moe.formats import quantize_activation

    xf = c["x"].float() * c["x_scale"].repeat_interleave(H // c["x_scale"].shape[1], dim=1)
    xf[1, 7] = float("nan")
    c["x"], c["x_scale"] = quantize_activation(xf, H // c["x_scale"].shape[1], check_finite=False)


def _swiglu_limit_too_big(c):
    c["limit"] = 1e39


# (name, formats (act, weight), failing ranks, mutation, failing rank's exception, its message, others' message)
INPUT_FAULTS = [
    (
        "T > C",
        ("bf16", "bf16"),
        [1],
        _more_tokens,
        "ValueError",
        "5 tokens exceed the capacity of 4",
        "forward: rank 1 failed: 5 tokens exceed the capacity of 4",
    ),
    (
        "id = E",
        ("bf16", "fp8"),
        [1],
        _id_too_big,
        "ValueError",
        "topk_idx must hold global expert ids in [-1, 4)",
        "forward: rank 1 failed: topk_idx must hold global expert ids in [-1, 4)",
    ),
    (
        "id = -2",
        ("bf16", "bf16"),
        [0],
        _id_below_minus_one,
        "ValueError",
        "got values in [-2,",
        "forward: rank 0 failed: topk_idx must hold",
    ),
    (
        "routing shape",
        ("bf16", "bf16"),
        [1],
        _routing_shape,
        "ValueError",
        "topk_weights must have shape",
        "forward: rank 1 failed: topk_weights must have shape",
    ),
    (
        "routing dtype",
        ("bf16", "bf16"),
        [1],
        _routing_dtype,
        "TypeError",
        "topk_idx must have dtype",
        "forward: rank 1 failed: topk_idx must have dtype",
    ),
    (
        "activation dtype",
        ("bf16", "bf16"),
        [0],
        _activation_dtype,
        "TypeError",
        "x must have an activation dtype",
        "forward: rank 0 failed: x must have an activation dtype",
    ),
    (
        "activation shape",
        ("bf16", "bf16"),
        [1],
        _activation_shape,
        "ValueError",
        "w13 must have shape",
        "forward: rank 1 failed: w13 must have shape",
    ),
    (
        "UE8M0 byte 255",
        ("fp8", "fp4"),
        [1],
        _ue8m0_nan_byte,
        "ValueError",
        "w13_scale holds the UE8M0 NaN byte 255",
        "forward: rank 1 failed: w13_scale holds the UE8M0 NaN byte 255",
    ),
    (
        "NaN fp8 weight scale",
        ("bf16", "fp8"),
        [1],
        _fp8_nan_weight_scale,
        "ValueError",
        "w2_scale holds a NaN or Inf scale",
        "forward: rank 1 failed: w2_scale holds a NaN or Inf scale",
    ),
    (
        "NaN x_scale",
        ("fp8", "fp8"),
        [1],
        _nan_activation_scale,
        "ValueError",
        "x_scale[2, 0] is not",
        "forward: rank 1 failed: x_scale must hold positive finite scales",
    ),
    (
        "NaN activation",
        ("fp8", "fp4"),
        [0],
        _nan_activation_quantized,
        "ValueError",
        "x_scale[1, 0] is not",
        "forward: rank 0 failed: x_scale must hold positive finite scales",
    ),
    (
        "swiglu_limit 1e39",
        ("bf16", "bf16"),
        [1],
        _swiglu_limit_too_big,
        "ValueError",
        "swiglu_limit must be None or a positive finite number, got 1e+39",
        "forward: rank 1 failed: swiglu_limit",
    ),
    (
        "two ranks fail",
        ("bf16", "bf16"),
        [0, 1],
        _id_too_big,
        "ValueError",
        "topk_idx must hold",
        "forward: ranks [0, 1] failed",
    ),
]


# Configurations that differ on the last rank: (name, what changes, what the message must say on a later step,
# what it must say on the group's first step — then the workspace manifests differ)
def _config_faults(size: int):
    last, rest = size - 1, list(range(size - 1))

    def diff(field, ours, theirs):
        return f"{field}: {ours} on ranks {rest}; {theirs} on ranks [{last}]"

    return [
        ("capacity", dict(capacity=2 * C), diff("capacity", 4, 8), diff("capacity", 4, 8)),
        (
            "activation format",
            dict(act="fp8", wfmt="fp8"),
            diff("formats", "bf16 x bf16", "fp8 x fp8"),
            diff("act_format", "'bf16'", "'fp8'"),
        ),
        (
            "activation group",
            dict(act="fp8", wfmt="fp8", group=32),
            diff("act_group", 128, 32),
            diff("act_group", 128, 32),
        ),
        ("top-k", dict(topk=4), diff("topk", 2, 4), diff("topk", 2, 4)),
        ("num_experts", dict(num_local=3), diff("num_experts", L * size, 3 * size), None),
        ("H", dict(hidden=2 * H), diff("hidden", H, 2 * H), None),
        ("swiglu_limit", dict(limit=7.0), diff("swiglu_limit", None, 7.0), None),
        ("fp8_max", dict(act="fp8", wfmt="fp8", fp8_max=240.0), diff("fp8_max", 448.0, 240.0), None),
    ]


def _config_case(rank: int, size: int, base: tuple[str, str], change: dict, odd: bool) -> dict:
    kw = {k: v for k, v in change.items() if k in ("act", "wfmt", "group", "hidden", "num_local", "topk")}
    base_kw = {"act": base[0], "wfmt": base[1]}
    if "group" in change or "fp8_max" in change:
        base_kw = {"act": "fp8", "wfmt": "fp8"}
    case = _case(rank, size, **{**base_kw, **(kw if odd else {})})
    if odd:
        case.update({k: v for k, v in change.items() if k in ("capacity", "limit", "fp8_max")})
    return case


def _fault_worker(rank: int, size: int) -> list[dict]:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    records = []
    baselines: dict = {}

    def good(fmts) -> torch.Tensor:
        return _call(_case(rank, size, *fmts), rank, size, name)

    # A good step makes one all-gather and one reduce-scatter, nothing else; a failed one the all-gather only.
    fmts = ("bf16", "bf16")
    baselines[fmts] = good(fmts)
    counts = _count_collectives(lambda: [good(fmts) for _ in range(3)])
    bad = _case(rank, size)
    if rank == 1:
        _more_tokens(bad)
    counts_failed = _count_collectives(lambda: _attempt(lambda: _call(bad, rank, size, name)))
    records.append({"kind": "collectives", "good x3": counts, "failed": counts_failed})

    for label, fmts, failing, mutate, *_ in INPUT_FAULTS:
        if fmts not in baselines:
            baselines[fmts] = good(fmts)
        case = _case(rank, size, *fmts)
        if rank in failing:
            mutate(case)
        rec = _attempt(lambda: _call(case, rank, size, name))
        nxt = good(fmts)
        rec.update(kind="input", case=label, failing=failing, next_ok=bool(torch.equal(nxt, baselines[fmts])))
        records.append(rec)

    # Under torch.compile(fullgraph=True) too: the fake must not raise at trace time on the failing rank only
    # (the others would wait in their compiled all-gather); the kernel raises on every rank at run time.
    compiled = torch.compile(torch.ops.static_moe.forward, fullgraph=True, backend="eager")
    fmts = ("bf16", "bf16")
    case = _case(rank, size, *fmts)
    if rank == 1:
        _more_tokens(case)
    rec = _attempt(lambda: _call(case, rank, size, name, fn=compiled))
    nxt = _call(_case(rank, size, *fmts), rank, size, name, fn=compiled)
    rec.update(kind="input", case="T > C", compiled=True, next_ok=bool(torch.equal(nxt, baselines[fmts])))
    records.append(rec)

    # A kernel that fails after the all-gather anyway (not expected: every check runs before it): the failing rank
    # still joins the reduce-scatter, with NaN, then raises; the others' outputs are NaN, not silently wrong.
    import importlib
    import inspect

    fwd = importlib.import_module("static_moe.ops.forward")
    real_step = fwd._local_step

    def failing_step(*args, **kwargs):
        offset = inspect.signature(real_step).bind(*args, **kwargs).arguments["expert_offset"]
        if offset > 0:  # rank > 0 only
            raise RuntimeError("injected kernel failure")
        return real_step(*args, **kwargs)

    fwd._local_step = failing_step
    try:
        out = {}
        rec = _attempt(lambda: out.setdefault("y", good(fmts)))
    finally:
        fwd._local_step = real_step
    rec.update(
        kind="kernel",
        case="kernel fails after the all-gather",
        all_nan=bool(torch.isnan(out["y"]).all()) if "y" in out else None,
        next_ok=bool(torch.equal(good(fmts), baselines[fmts])),
    )
    records.append(rec)

    # Configurations that differ, after good steps (the group's workspace is agreed) ...
    for label, change, field, _ in _config_faults(size):
        fmts = ("bf16", "bf16")
        odd = rank == size - 1
        case = _config_case(rank, size, fmts, change, odd)
        rec = _attempt(lambda: _call(case, rank, size, name))
        nxt = good(fmts)
        rec.update(kind="config", case=label, field=field, next_ok=bool(torch.equal(nxt, baselines[fmts])))
        records.append(rec)

    # A layer's workspace: its manifest carries the settings that change the maths, so they must agree too.
    from static_moe import workspace

    last = size - 1
    for field, theirs in (("swiglu_limit", 7.0), ("fp8_max", 240.0)):
        kw = dict(
            capacity=C,
            hidden=H,
            intermediate=I,
            num_experts=L * size,
            topk=K,
            ep_size=size,
            act_format="fp8",
            weight_format="fp8",
        )
        if rank == last:
            kw[field] = theirs
        ours = None if field == "swiglu_limit" else 448.0
        rec = _attempt(lambda: workspace.acquire(workspace.WorkspaceSpec(**kw), dist.group.WORLD))
        rec.update(
            kind="manifest",
            case=field,
            field=f"{field}: {ours} on ranks {list(range(last))}; {theirs} on ranks [{last}]",
            next_ok=bool(torch.equal(good(("bf16", "bf16")), baselines[("bf16", "bf16")])),
        )
        records.append(rec)

    # ... and on a step that is the group's first (no workspace yet: agreed through the workspace's manifests).
    for label, change, _, field in _config_faults(size)[:4]:
        fresh = dist.new_group(list(range(size)))
        case = _config_case(rank, size, ("bf16", "bf16"), change, rank == size - 1)
        rec = _attempt(lambda: _call(case, rank, size, fresh.group_name))
        nxt = _call(_case(rank, size), rank, size, fresh.group_name)
        rec.update(
            kind="first-step config",
            case=label,
            field=field,
            next_ok=bool(torch.equal(nxt, baselines[("bf16", "bf16")])),
        )
        records.append(rec)
    return records


def _count_collectives(fn) -> dict:
    """Collectives the forward issues while fn runs: its functional all-gather / reduce-scatter, and any object
    collective (what a hidden extra exchange per step would use)."""
    import importlib

    import torch.distributed as dist

    fwd = importlib.import_module("static_moe.ops.forward")  # the module (static_moe.ops.forward is the wrapper)
    # The forward's collectives are issued by its dispatch and combine pieces (SPEC §7), next to it.
    mods = [fwd, importlib.import_module("static_moe.ops.dispatch"), importlib.import_module("static_moe.ops.combine")]

    counts = {"all_gather": 0, "reduce_scatter": 0, "object": 0}
    real_c10d, real_obj = fwd._c10d, dist.all_gather_object

    class Counting:
        def __getattr__(self, name):
            op = getattr(real_c10d, name)
            if name.startswith("all_gather"):
                counts["all_gather"] += 1
            elif name.startswith("reduce_scatter"):
                counts["reduce_scatter"] += 1
            return op

    def counting_obj(*a, **k):
        counts["object"] += 1
        return real_obj(*a, **k)

    dist.all_gather_object = counting_obj
    for m in mods:
        m._c10d = Counting()
    try:
        fn()
    finally:
        dist.all_gather_object = real_obj
        for m in mods:
            m._c10d = real_c10d
    return counts


def _check_records(records: list[list[dict]], size: int) -> None:
    problems = []
    faults = {f[0]: f for f in INPUT_FAULTS}
    for rank, recs in enumerate(records):
        counted = recs.pop(0)
        assert counted["good x3"] == {"all_gather": 3, "reduce_scatter": 3, "object": 0}, (rank, counted)
        assert counted["failed"] == {"all_gather": 1, "reduce_scatter": 0, "object": 0}, (rank, counted)
        for rec in recs:
            where = f"rank {rank}, {rec['kind']} fault {rec['case']!r}" + (" (compiled)" if rec.get("compiled") else "")
            if rec["s"] > BOUND_S:
                problems.append(f"{where}: took {rec['s']:.1f} s (bound {BOUND_S} s)")
            if not rec["next_ok"]:
                problems.append(f"{where}: the next good step differs from the good step before")
            if rec["kind"] == "kernel":
                want = ("RuntimeError", None) if rank > 0 else (None, True)
                if (rec["raised"], rec["all_nan"]) != want:
                    problems.append(f"{where}: expected {want}, got {rec['raised']}, all NaN: {rec['all_nan']}")
                continue
            if rec["kind"] == "input":
                _, _, failing, _, own_type, own_msg, others_msg = faults[rec["case"]]
                want_type, want_msg = (own_type, own_msg) if rank in failing else ("RuntimeError", others_msg)
            else:
                want_type, want_msg = "ValueError", rec["field"]
            if rec["raised"] != want_type or want_msg not in rec["msg"]:
                problems.append(
                    f"{where}: expected {want_type} containing {want_msg!r}, got {rec['raised']}: {rec['msg']!r}"
                )
    assert not problems, f"S={size}:\n" + "\n".join(problems)


def test_faults_on_two_ranks():
    records = run_ranks(_fault_worker, 2, timeout=240, pg_timeout=PG_TIMEOUT_S)
    _check_records(records, 2)


def _three_rank_worker(rank: int, size: int) -> list[dict]:
    """A few faults on the middle and the last of three ranks, and a configuration that differs on one of them."""
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    base = _call(_case(rank, size), rank, size, name)
    records = []
    for label, failing, mutate in (
        ("T > C", [2], _more_tokens),
        ("id = E", [1], _id_too_big),
        ("routing dtype", [1, 2], _routing_dtype),
    ):
        case = _case(rank, size)
        if rank in failing:
            mutate(case)
        rec = _attempt(lambda: _call(case, rank, size, name))
        rec.update(
            case=label, failing=failing, next_ok=bool(torch.equal(_call(_case(rank, size), rank, size, name), base))
        )
        records.append(rec)
    # An input fault on a group's very first step (no workspace yet): reported the same way.
    fresh = dist.new_group(list(range(size))).group_name
    case = _case(rank, size)
    if rank == 1:
        _more_tokens(case)
    rec = _attempt(lambda: _call(case, rank, size, fresh))
    rec.update(
        case="T > C on a first step",
        failing=[1],
        next_ok=bool(torch.equal(_call(_case(rank, size), rank, size, fresh), base)),
    )
    records.append(rec)
    case = _case(rank, size, topk=4 if rank == 1 else K)
    rec = _attempt(lambda: _call(case, rank, size, name))
    rec.update(
        case="top-k on rank 1", failing=[], next_ok=bool(torch.equal(_call(_case(rank, size), rank, size, name), base))
    )
    records.append(rec)
    return records


def test_faults_on_three_ranks():
    records = run_ranks(_three_rank_worker, 3, timeout=180, pg_timeout=PG_TIMEOUT_S)
    for rank, recs in enumerate(records):
        got = {r["case"]: r for r in recs}
        for r in recs:
            assert r["s"] < BOUND_S and r["next_ok"], (rank, r)
        t = got["T > C"]
        assert (t["raised"], "5 tokens exceed the capacity of 4" in t["msg"]) == (
            ("ValueError", True) if rank == 2 else ("RuntimeError", True)
        ), (rank, t)
        if rank != 2:
            assert t["msg"].startswith("forward: rank 2 failed: 5 tokens exceed"), t
        i = got["id = E"]
        assert i["raised"] == ("ValueError" if rank == 1 else "RuntimeError") and "[-1, 6)" in i["msg"], (rank, i)
        d = got["routing dtype"]
        assert d["raised"] == ("TypeError" if rank in (1, 2) else "RuntimeError"), (rank, d)
        if rank == 0:
            assert d["msg"].startswith("forward: ranks [1, 2] failed: rank 1: topk_idx must have dtype"), d
        f = got["T > C on a first step"]
        assert f["raised"] == ("ValueError" if rank == 1 else "RuntimeError"), (rank, f)
        assert "5 tokens exceed the capacity of 4" in f["msg"], (rank, f)
        if rank != 1:
            assert f["msg"].startswith("forward: rank 1 failed: 5 tokens exceed"), (rank, f)
        k = got["top-k on rank 1"]
        assert k["raised"] == "ValueError" and "topk: 2 on ranks [0, 2]; 4 on ranks [1]" in k["msg"], (rank, k)


# --- a rank that dies between steps -------------------------------------------------------------------------------
KILL_PG_TIMEOUT_S = 20.0  # the survivors must not need it: gloo sees the closed connection at once


def _killed_rank_worker(rank: int, size: int, out_dir: str) -> None:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    _call(_case(rank, size), rank, size, name)
    if rank == size - 1:
        os._exit(3)  # dies between steps, as a crashed or OOM-killed server process would
    rec = _attempt(lambda: _call(_case(rank, size), rank, size, name))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


@pytest.mark.parametrize("size", [2, 3])
def test_killed_rank_makes_survivors_raise(size, tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_rank_worker, size, str(tmp_path), timeout=120, pg_timeout=KILL_PG_TIMEOUT_S)
    assert "exited with code 3" in str(info.value)
    for rank in range(size - 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["raised"] is not None, rec
        assert rec["s"] < BOUND_S, f"survivor rank {rank} took {rec['s']:.1f} s to notice: {rec}"


# --- the layer: StaticMoE's own checks must fail collectively too ---------------------------------------------------
def _layer_worker(rank: int, size: int) -> list[dict]:
    """A StaticMoE layer on every rank; one rank's call is bad (too many tokens, routing of the wrong shape,
    hidden states of the wrong dtype or width): every rank must raise and the next step must work."""
    import torch.distributed as dist

    from static_moe import StaticMoE

    e = L * size
    layer = StaticMoE(H, I, e, K, C, ep_group=dist.group.WORLD)
    good = _case(rank, size)
    layer.set_expert_weights(good["w13"], good["w13_scale"], good["w2"], good["w2_scale"])

    def step(case):
        return layer(case["x"], case["idx"], case["tw"])

    base = step(good)
    records = []
    for label, mutate in (
        (
            "T > C",
            lambda c: c.update(
                x=torch.zeros(C + 1, H, dtype=torch.bfloat16),
                idx=torch.full((C + 1, K), -1, dtype=torch.int32),
                tw=torch.zeros(C + 1, K),
            ),
        ),
        ("routing shape", lambda c: c.update(idx=c["idx"][:, :1])),
        ("hidden dtype", lambda c: c.update(x=c["x"].to(torch.int32))),
        ("hidden width", lambda c: c.update(x=torch.zeros(c["x"].shape[0], 2 * H, dtype=torch.bfloat16))),
    ):
        case = dict(good)
        if rank == 1:
            mutate(case)
        rec = _attempt(lambda: step(case))
        rec.update(case=label, next_ok=bool(torch.equal(step(good), base)))
        records.append(rec)
    layer.close()
    return records


def test_layer_faults_on_two_ranks():
    records = run_ranks(_layer_worker, 2, timeout=180, pg_timeout=PG_TIMEOUT_S)
    for rank, recs in enumerate(records):
        for r in recs:
            assert r["s"] < BOUND_S and r["next_ok"], (rank, r)
            if rank == 1:
                assert r["raised"] in ("ValueError", "TypeError"), (rank, r)
            else:
                assert r["raised"] == "RuntimeError" and r["msg"].startswith("forward: rank 1 failed"), (rank, r)
