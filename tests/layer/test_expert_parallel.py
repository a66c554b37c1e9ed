"""Expert-parallel dispatch and combine (SPEC §7): the traffic model, the slotting, the Cd helpers, and the three
combinations (all-gather + fp32, all-gather + bf16, all-to-all + bf16) on gloo ranks — bitwise against the
reference of their path, the collectives each step issues and the bytes they carry, overflow, errors and
configuration mismatches. One process group per rank count serves every case (spawning is the expensive part).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from static_moe import expert_parallel as ep
from static_moe import reference, workspace
from static_moe.ops import dispatch as dispatch_ops
from static_moe.testing.distributed import expect_raises, run_ranks
from static_moe.testing.generators import gen, make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close

H, I, K, C = 128, 128, 2, 6
COMBOS = [("all_gather", "fp32", 0), ("all_gather", "bf16", 0), ("all_to_all", "bf16", 4)]
V3 = dict(hidden=7168, topk=8, act_format="fp8", act_group=128)


# ----------------------------------------------------------------------------------------------------------------
# The model (no ranks)
# ----------------------------------------------------------------------------------------------------------------
def test_traffic_model_meets_the_targets():
    """docs/expert_parallel.md's table: bf16 combine = (W + 2H)/(W + 4H) of today's (60.4 % at V3, above 60 % because
    W = 7520 > H = 7168: structural); the all-to-all ≤ 40 % of today's at S ≥ 16, C ≥ 64 and ≤ 3× DeepEP-LL at
    S = 64, with Cd from the 1 % rule."""
    w = ep.row_width(**V3)
    assert w == 7168 + 224 + 32 + 32 + 64
    for s in (2, 8, 16, 64, 256):
        for c in (64, 128):
            today = ep.traffic_bytes("all_gather", "fp32", capacity=c, ep_size=s, **V3)
            bf16 = ep.traffic_bytes("all_gather", "bf16", capacity=c, ep_size=s, **V3)
            assert today == (s - 1) * c * (w + 4 * 7168)
            assert bf16 * (w + 4 * 7168) == today * (w + 2 * 7168)
            if s < 16:
                continue
            cd = ep.dispatch_capacity_for(c, num_experts=256, topk=8, ep_size=s)
            p = ep.step_overflow_probability(c, cd, num_experts=256, topk=8, ep_size=s)
            assert p <= 0.01 < ep.step_overflow_probability(c, cd - 1, num_experts=256, topk=8, ep_size=s)
            a2a = ep.traffic_bytes("all_to_all", "bf16", capacity=c, ep_size=s, dispatch_capacity=cd, **V3)
            assert a2a <= 0.40 * today, (s, c, cd, a2a / today)
            if s == 64:
                deepep = ep.deepep_low_latency_bytes(capacity=c, ep_size=s, **V3)
                assert a2a <= 3 * deepep, (s, c, a2a / deepep)
    assert abs(ep.rank_hit_probability(8, 2, 2) - (1 - 6 / 28)) < 1e-12  # C(4,2)/C(8,2) miss both of a rank's 4


def test_choose_dispatch_and_cd_from_trace():
    sizes = dict(capacity=128, num_experts=256, ep_size=64, **V3)
    assert ep.choose_dispatch("auto", "bf16", **sizes)[0] == "all_to_all"
    assert ep.choose_dispatch("auto", "fp32", **sizes) == ("all_gather", 0)  # the all-to-all needs bf16
    assert ep.choose_dispatch("auto", "bf16", **{**sizes, "ep_size": 2, "capacity": 8}) == ("all_gather", 0)
    with pytest.raises(ValueError, match="combine='bf16'"):
        ep.choose_dispatch("all_to_all", "fp32", **sizes)
    with pytest.raises(ValueError, match="dispatch must be"):
        ep.choose_dispatch("gather", "bf16", **sizes)
    # 10 batches of 4 tokens over S = 2 (experts 0–1 on rank 0): batch i sends i % 5 tokens to rank 0 only.
    trace = torch.full((10, 4, 2), 3)
    for i in range(10):
        trace[i, : i % 5, 0] = 0
        trace[i, : i % 5, 1] = -1
    loads = ep.rank_loads(trace, 4, 2)
    assert loads[:, 0].tolist() == [i % 5 for i in range(10)]
    assert loads[:, 1].tolist() == [4 - i % 5 for i in range(10)]  # the other tokens hold only id 3 (rank 1)
    # The busiest receiver per batch: 4 3 2 3 4 4 3 2 3 4 -> its 0.99 quantile 4, its median 3.
    assert ep.dispatch_capacity_from_trace(trace, num_experts=4, ep_size=2, capacity=8) == 4
    assert ep.dispatch_capacity_from_trace(trace, num_experts=4, ep_size=2, capacity=8, quantile=0.5) == 3
    skew = trace.clone()
    skew[:, :, 1] = 0  # every token also to rank 0
    assert ep.dispatch_capacity_from_trace(list(skew), num_experts=4, ep_size=2, capacity=3) == 3  # capped at C


def _slots_by_loop(idx: torch.Tensor, c: int, e: int, s: int, cd: int):
    loc = e // s
    source, dest, overflow = [-1] * (s * cd), [[s * cd] * s for _ in range(c)], 0
    fill = [0] * s
    for t in range(idx.shape[0]):
        for d in sorted({int(v) // loc for v in idx[t] if 0 <= int(v) < e}):
            if fill[d] < cd:
                source[d * cd + fill[d]], dest[t][d] = t, d * cd + fill[d]
            else:
                overflow += 1
            fill[d] += 1
    return source, dest, overflow


@pytest.mark.parametrize("s,e,t,cd", [(2, 8, 6, 4), (3, 6, 5, 2), (4, 16, 0, 3), (8, 16, 7, 1)])
def test_slot_rows_matches_a_loop(s, e, t, cd):
    idx, _ = make_routing(t, 3, e, seed=s + t, empty_frac=0.2, duplicate_frac=0.2)
    if t:
        idx[0, 0] = e + 5  # out of range: selects no rank (the step header reports it)
    got = dispatch_ops.slot_rows(idx, 8, e, s, cd)
    source, dest, overflow = _slots_by_loop(idx, 8, e, s, cd)
    assert got.source.tolist() == source and got.dest.tolist() == dest and got.overflow.tolist() == [overflow]


def test_workspace_spec_carries_dispatch_and_plans_its_buffers():
    base = dict(capacity=8, hidden=128, intermediate=128, num_experts=8, topk=2, ep_size=4)
    ag = workspace.WorkspaceSpec(**base)
    bf = workspace.WorkspaceSpec(**base, combine="bf16")
    a2a = workspace.WorkspaceSpec(**base, dispatch="all_to_all", combine="bf16", dispatch_capacity=3)
    assert workspace.WorkspaceSpec(**base, dispatch_capacity=0).dispatch_capacity == 0
    assert len({workspace.frame_key(x) for x in (ag, bf, a2a)}) == 3
    assert workspace.PROTOCOL_VERSION >= 3  # 3: the manifest carries dispatch, combine and Cd
    plan = workspace.memory_plan(a2a)
    assert plan.nbytes("blocks") == plan.nbytes("received") == 4 * 3 * (a2a.row_width + 16)
    assert plan.nbytes("partial") == plan.nbytes("returned") == 4 * 3 * 128 * 2
    assert plan.nbytes("overflow") == 4
    base_total = workspace.memory_plan(ag).total_bytes
    assert base_total == 5 * 8 * (ag.row_width + 4 * 128)  # (S + 1)·C·(W + 4H)
    assert workspace.memory_plan(bf).total_bytes == base_total + 2 * 4 * 8 * 128 * 2
    for bad, words in (
        (dict(dispatch="scatter"), "dispatch must be"),
        (dict(combine="fp16"), "combine must be"),
        (dict(dispatch="all_to_all", dispatch_capacity=3), "combine='bf16'"),
        (dict(dispatch="all_to_all", combine="bf16", dispatch_capacity=9), "dispatch_capacity must lie"),
        (dict(dispatch="all_to_all", combine="bf16"), "dispatch_capacity must lie"),
    ):
        with pytest.raises(ValueError, match=words):
            workspace.WorkspaceSpec(**base, **bad)


def test_bf16_combine_at_one_rank_is_the_reference():
    w = make_weights(4, H, I, "fp8", seed=1)
    x, xs = make_activations(5, H, "fp8", seed=2)
    idx, tw = make_routing(5, K, 4, seed=3)
    so = torch.randn(5, H, generator=gen(4))
    args = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], so)
    out = torch.ops.static_moe.forward(*args, 4, C, None, "", 0, 1, combine="bf16")
    ref = reference.forward(*args, 4, C, None, "", 0, 1, combine="bf16")
    assert_equal(out, ref, "S = 1, bf16 combine")
    fp32 = torch.ops.static_moe.forward(*args, 4, C, None, "", 0, 1)
    assert not torch.equal(out, fp32)  # the bf16 rounding of the partial is visible
    for kw, words in (
        (dict(dispatch="all_to_all", combine="fp32", dispatch_capacity=2), "combine='bf16'"),
        (dict(dispatch="all_to_all", combine="bf16", dispatch_capacity=C + 1), "dispatch_capacity must lie"),
        (dict(dispatch_capacity=2), "must be 0 with dispatch='all_gather'"),
        (dict(combine="int8"), "combine must be"),
    ):
        with pytest.raises(ValueError, match=words):
            torch.ops.static_moe.forward(*args, 4, C, None, "", 0, 1, **kw)


def test_bf16_combine_against_fp32_within_the_spec_bound():
    """SPEC §7.1: |out_bf16 − out_fp32| ≤ 2⁻⁸·Σ_d |acc_d| + 2⁻⁷·|out_fp32| (the partials' roundings, then one bf16
    step of the output; up to second-order terms), and calc_diff < 1e-5, with acc_d each rank's fp32 partial
    (simulated with the reference's own steps)."""
    s, e = 4, 16
    case = _case(s, e, "fp8", "fp8", [C] * s, seed=3)
    f, b = (torch.cat(_ref(case, combine)).float() for combine in ("fp32", "bf16"))
    parts = [[case["x"][r], case["xs"][r], case["idx"][r].to(torch.int32), case["tw"][r]] for r in range(s)]
    rows = torch.cat([reference.pack_rows(p, C) for p in parts])
    offsets, o = [], 0
    for p in parts[0]:
        offsets.append((o, p[0].numel() * p.element_size()))
        o += -(-offsets[-1][1] // 16) * 16
    g = [reference.unpack_rows(rows, off, n, p.dtype, list(p.shape[1:])) for (off, n), p in zip(offsets, parts[0])]
    acc_abs = sum(
        reference.local_experts(
            *g, case["w13"][r], case["w13s"][r], case["w2"][r], case["w2s"][r], r * (e // s), None
        ).abs()
        for r in range(s)
    )
    acc_abs = torch.cat([acc_abs[r * C : (r + 1) * C] for r in range(s)])  # every rank's C rows, as f and b
    assert acc_abs.sum() > 0 and not torch.equal(f, b)
    bound = (2.0**-8 * acc_abs + 2.0**-7 * f.abs()) * (1 + 2.0**-6)
    assert bool(((b - f).abs() <= bound).all())
    from static_moe.testing.numeric import calc_diff

    assert calc_diff(b, f) < 1e-5


# ----------------------------------------------------------------------------------------------------------------
# On gloo ranks
# ----------------------------------------------------------------------------------------------------------------
def _case(size: int, e: int, act: str, wfmt: str, tokens: list[int], seed: int, routing: str = "random") -> dict:
    loc = e // size
    w = [make_weights(loc, H, I, wfmt, seed=seed * 10 + r) for r in range(size)]
    xs = [make_activations(tokens[r], H, act, seed=seed * 10 + 3 + r) for r in range(size)]
    if routing == "random":
        rt = [make_routing(tokens[r], K, e, seed=seed * 10 + 5 + r, empty_frac=0.2) for r in range(size)]
    else:  # "one_rank": every token to the last rank's experts (the all-to-all's worst case)
        rt = [(torch.full((t, K), e - 1, dtype=torch.int32), torch.rand(t, K, generator=gen(seed))) for t in tokens]
    return dict(
        x=[a[0] for a in xs],
        xs=[a[1] for a in xs],
        idx=[a[0] for a in rt],
        tw=[a[1] for a in rt],
        w13=[a["w13"] for a in w],
        w13s=[a["w13_scale"] for a in w],
        w2=[a["w2"] for a in w],
        w2s=[a["w2_scale"] for a in w],
        so=[torch.randn(t, H, generator=gen(seed + t)) for t in tokens],
        e=e,
    )


def _run(case: dict, rank: int, size: int, dispatch: str, combine: str, cd: int, fn=None) -> torch.Tensor:
    import torch.distributed as dist

    fn = fn or torch.ops.static_moe.forward
    r = rank
    return fn(
        case["x"][r],
        case["xs"][r],
        case["idx"][r],
        case["tw"][r],
        case["w13"][r],
        case["w13s"][r],
        case["w2"][r],
        case["w2s"][r],
        case["so"][r],
        case["e"],
        C,
        None,
        dist.group.WORLD.group_name,
        r,
        size,
        dispatch=dispatch,
        combine=combine,
        dispatch_capacity=cd,
    )


def _ref(case: dict, combine: str) -> list[torch.Tensor]:
    return reference.forward_simulated(
        case["x"],
        case["xs"],
        case["idx"],
        case["tw"],
        case["w13"],
        case["w13s"],
        case["w2"],
        case["w2s"],
        case["so"],
        case["e"],
        C,
        None,
        combine=combine,
    )


def _expected_log(dispatch: str, combine: str, size: int, cd: int, act="bf16", wfmt="bf16", overflow=False) -> list:
    """The collectives of one step, (name, bytes sent to the other ranks), from the workspace's shapes."""
    spec = workspace.WorkspaceSpec(
        capacity=C,
        hidden=H,
        intermediate=I,
        num_experts=2 * size,
        topk=K,
        ep_size=size,
        act_format=act,
        weight_format=wfmt,
    )
    traffic = ep.traffic_bytes(
        dispatch, combine, capacity=C, hidden=H, topk=K, ep_size=size, act_format=act, dispatch_capacity=cd
    )
    s1 = size - 1
    if dispatch == "all_gather":
        first = [("all_gather", s1 * C * spec.row_width)]
        second = ("reduce_scatter", s1 * C * 4 * H) if combine == "fp32" else ("combine_all_to_all", s1 * C * 2 * H)
        log = first + [second]
    else:
        log = [("dispatch_all_to_all", s1 * cd * spec.block_width), ("combine_all_to_all", s1 * cd * 2 * H)]
        if overflow:
            log = [log[0], ("all_gather", s1 * C * spec.row_width), ("combine_all_to_all", s1 * C * 2 * H)]
    if not overflow:
        assert sum(b for _, b in log) == traffic  # the formula of static_moe.expert_parallel, from the payloads
    return log


def _worker(rank: int, size: int, full: bool) -> list[str]:
    import torch.distributed as dist

    done = []
    e = 2 * size
    scenarios = [("bf16", "bf16", [C, 0] + [3] * (size - 2), "random"), ("fp8", "fp4", [2] * size, "random")]
    if full:
        scenarios.append(("fp8", "fp8", [C] * size, "random"))
    elif size >= 8:
        scenarios = scenarios[:1]  # eight processes share the machine's cores: one scenario is enough there
    gathered_bf16 = {}  # scenario -> the all-gather + bf16 output, which the all-to-all must equal bit for bit
    for dispatch, combine, cd in COMBOS:
        for n, (act, wfmt, tokens, routing) in enumerate(scenarios):
            case = _case(size, e, act, wfmt, tokens, seed=n, routing=routing)
            with dispatch_ops.count_collectives() as log:
                out = _run(case, rank, size, dispatch, combine, cd)
            ref = _ref(case, combine)[rank]
            what = f"S={size} r{rank} {dispatch}+{combine} {act}x{wfmt}"
            if combine == "bf16":  # as bitwise as the CPU local_experts is against the reference (SPEC §2)
                assert_gemm_bitwise(out, ref, what)
            else:  # the reduce-scatter's summation order is gloo's
                assert_gemm_close(out, ref, what)
            if dispatch == "all_gather" and combine == "bf16":
                gathered_bf16[n] = out
            if dispatch == "all_to_all":
                assert_equal(out, gathered_bf16[n], what + " vs all_gather+bf16")
            # The step's collectives and their payloads; a step whose shapes differ from the group's current
            # workspace is preceded by one dispatch through the old one (every rank then switches, SPEC §3).
            overflow = dispatch == "all_to_all" and any(
                int(dispatch_ops.slot_rows(i, C, e, size, cd).overflow) for i in case["idx"]
            )  # some rank sends more than Cd rows to one rank: every rank recomputes with the all-gather
            expect = _expected_log(dispatch, combine, size, cd, act, wfmt, overflow)
            if dispatch == "all_to_all":
                assert workspace.current_frame(dist.group.WORLD.group_name).overflow.tolist() == [int(overflow)]
            assert log[-len(expect) :] == expect and len(log) - len(expect) in (0, 1), (log, expect)
            done.append(f"{dispatch}+{combine}:{act}x{wfmt}")

    # Overflow: every token of every rank goes to the last rank, far past Cd = 1. Every rank reads the same counts,
    # recomputes with the all-gather and gets the exact result (that of all-gather + bf16); the next step works.
    frame = lambda: workspace.current_frame(dist.group.WORLD.group_name)  # noqa: E731
    skew = _case(size, e, "bf16", "bf16", [C] * size, seed=7, routing="one_rank")
    exact = _run(skew, rank, size, "all_gather", "bf16", 0)
    with dispatch_ops.count_collectives() as log:
        out = _run(skew, rank, size, "all_to_all", "bf16", 1)
    assert_equal(out, exact, f"S={size} r{rank} overflow")
    assert_gemm_bitwise(out, _ref(skew, "bf16")[rank], f"S={size} r{rank} overflow vs reference")
    expect = _expected_log("all_to_all", "bf16", size, 1, "bf16", "bf16", True)
    assert log[-len(expect) :] == expect and len(log) - len(expect) in (0, 1), (log, expect)
    assert frame().overflow.tolist() == [1]
    ok = _case(size, e, "bf16", "bf16", [1] * size, seed=8)
    assert_gemm_bitwise(_run(ok, rank, size, "all_to_all", "bf16", 1), _ref(ok, "bf16")[rank], "after overflow")
    assert frame().overflow.tolist() == [0]
    done.append("overflow")
    if not full:
        return done

    # The CUDA graph capture path, forced on CPU by deferred_verdict(): the headers are never read on the host, so
    # an overflow is not recomputed — every rank gets NaN (never wrong numbers) and the workspace flag, eagerly
    # and through torch.compile; a step without overflow gives the eager bits; a bad id on rank 1 gives NaN on
    # every rank instead of raising. The workspace (all-to-all, Cd = 1) is the current one since the steps above.
    forward_ops = importlib.import_module("static_moe.ops.forward")  # the module; the attribute is the wrapper

    def host_read(*args):
        raise AssertionError("the step headers were read on the host under deferred_verdict()")

    compiled = torch.compile(torch.ops.static_moe.forward, fullgraph=True, backend="aot_eager")
    eager_ok = _run(ok, rank, size, "all_to_all", "bf16", 1)
    bad = _case(size, e, "bf16", "bf16", [1] * size, seed=12)
    if rank == 1:
        bad["idx"][1][0, 0] = e + 3
    decide, forward_ops._status.decide = forward_ops._status.decide, host_read
    try:
        with forward_ops.deferred_verdict(), dispatch_ops.count_collectives() as log:
            for fn in (None, compiled):
                out = _run(skew, rank, size, "all_to_all", "bf16", 1, fn=fn)
                assert out.shape == exact.shape and bool(out.isnan().all()), f"S={size} r{rank} deferred overflow"
                assert frame().overflow.tolist() == [1]
                assert_equal(_run(ok, rank, size, "all_to_all", "bf16", 1, fn=fn), eager_ok, "deferred, no overflow")
                assert frame().overflow.tolist() == [0]
            out = _run(bad, rank, size, "all_to_all", "bf16", 1)
            assert bool(out.isnan().all()) and frame().overflow.tolist() == [0], f"S={size} r{rank} deferred bad id"
    finally:
        forward_ops._status.decide = decide
    # Two collectives per step, never the recomputation's all-gather.
    assert [n for n, _ in log] == ["dispatch_all_to_all", "combine_all_to_all"] * 5, log
    assert_equal(_run(ok, rank, size, "all_to_all", "bf16", 1), eager_ok, "eager again after deferred steps")
    done.append("deferred verdict")

    # Errors stay collective through the all-to-all's headers: rank 1's bad id fails every rank, the next step works.
    bad = _case(size, e, "bf16", "bf16", [2] * size, seed=9)
    if rank == 1:
        bad["idx"][1][0, 0] = e + 3
    step = lambda: _run(bad, rank, size, "all_to_all", "bf16", 4)  # noqa: E731
    if rank == 1:
        expect_raises(ValueError, step, "topk_idx must hold global expert ids")
    else:
        expect_raises(RuntimeError, step, "rank 1 failed", "topk_idx")
    big = _case(size, e, "bf16", "bf16", [C + 1 if r == 1 else 2 for r in range(size)], seed=11)
    step = lambda: _run(big, rank, size, "all_to_all", "bf16", 4)  # noqa: E731
    if rank == 1:  # a failed check: its message travels in the rank's blocks
        expect_raises(ValueError, step, f"{C + 1} tokens exceed the capacity of {C}")
    else:
        expect_raises(RuntimeError, step, "rank 1 failed", "exceed the capacity")
    good = _case(size, e, "bf16", "bf16", [2] * size, seed=10)
    eager = _run(good, rank, size, "all_to_all", "bf16", 4)
    assert_gemm_bitwise(eager, _ref(good, "bf16")[rank], "after an error")
    done.append("errors")

    # Calls with different dispatch settings on different ranks fail on every rank with ValueError.
    mixed = ("all_to_all", "bf16", 4) if rank == 0 else ("all_gather", "bf16", 0)
    expect_raises(ValueError, lambda: _run(good, rank, size, *mixed), "differ")
    done.append("mixed calls")

    # torch.compile(fullgraph=True) keeps the forward one node with the new arguments (fake included).
    compiled = torch.compile(torch.ops.static_moe.forward, fullgraph=True, backend="aot_eager")
    assert_equal(_run(good, rank, size, "all_to_all", "bf16", 4, fn=compiled), eager, "compiled vs eager")
    done.append("compile")

    # Layers: "auto" and explicit settings; different Cd on different ranks fail at construction on every rank.
    from static_moe import StaticMoE

    kw = dict(ep_group=dist.group.WORLD, combine="bf16")
    layer = StaticMoE(H, I, e, K, C, dispatch="all_to_all", dispatch_capacity=2, **kw)
    assert (layer.dispatch, layer.dispatch_capacity) == ("all_to_all", 2)
    h = torch.randn(3, H, generator=gen(rank)).to(torch.bfloat16)
    idx, tw = make_routing(3, K, e, seed=rank)
    assert layer(h, idx, tw).shape == (3, H)
    layer.close()
    expect_raises(
        ValueError,
        lambda: StaticMoE(H, I, e, K, C, dispatch="all_to_all", dispatch_capacity=2 + rank, **kw),
        "dispatch_capacity",
    )
    auto = StaticMoE(H, I, e, K, C, dispatch="auto", **kw)
    assert auto.dispatch in ("all_gather", "all_to_all")
    auto.close()
    done.append("layers")
    return done


@pytest.mark.parametrize("size", [2, 3])
def test_three_combinations_on_gloo(size):
    results = run_ranks(_worker, size, True, timeout=240)
    assert all(len(r) == 3 * 3 + 6 for r in results), results


@pytest.mark.parametrize("size", [4, 8])
def test_combinations_and_overflow_at_larger_s(size):
    results = run_ranks(_worker, size, False, timeout=240)
    assert all(len(r) == 3 * (2 if size < 8 else 1) + 1 for r in results), results
