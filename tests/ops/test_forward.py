"""torch.ops.static_moe.forward (SPEC §0, §3, §4): S = 1 in process; S = 2, 3 and 4 on gloo ranks, every rank's
output against reference.forward_simulated (SPEC §2 tolerance) for every format pair and the edge cases, with each
dispatch + combine of SPEC §7 where it matters (S > 1)."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

import static_moe
from static_moe import reference, workspace
from static_moe.formats import quantize_activation, quantize_weight
from static_moe.ops import dispatch as dispatch_ops
from static_moe.testing.distributed import RankFailure, run_ranks
from static_moe.testing.generators import (
    FORMAT_PAIRS,
    gen,
    make_activations,
    make_fp8_max_sensitive,
    make_routing,
    make_weights,
)
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close

H, I, K, C = 256, 128, 3, 8
LIMIT = 7.0
# SPEC §7's combinations: (dispatch, combine, dispatch_capacity). Cd = 6 < C: some scenarios below overflow a block
# (every rank then recomputes with the all-gather), others do not.
AG_FP32, AG_BF16, A2A_BF16 = ("all_gather", "fp32", 0), ("all_gather", "bf16", 0), ("all_to_all", "bf16", 6)
COMBOS = [AG_FP32, AG_BF16, A2A_BF16]


# ----------------------------------------------------------------------------------------------------------------
# Inputs for S ranks and their reference outputs
# ----------------------------------------------------------------------------------------------------------------
def make_case(
    size: int,
    num_experts: int,
    act: str,
    wfmt: str,
    tokens: list[int],
    seed: int,
    *,
    routing: str = "random",
    group: int = 128,
    shared: bool = False,
    limit=LIMIT,
    index_dtype=torch.int32,
) -> dict:
    """Every rank's inputs (lists indexed by EP rank), deterministic from ``seed``.

    routing: "random" (distinct ids with −1 slots and repeated ids mixed in), "one_expert" (every slot of every
    token names the last global expert, so its weight is the row's weight sum).
    """
    num_local = num_experts // size
    w = [make_weights(num_local, H, I, wfmt, seed=seed * 100 + r) for r in range(size)]
    xs = [make_activations(tokens[r], H, act, group=group, seed=seed * 100 + 10 + r) for r in range(size)]
    rts = []
    for r in range(size):
        if routing == "random":
            rts.append(
                make_routing(
                    tokens[r],
                    K,
                    num_experts,
                    seed=seed * 100 + 20 + r,
                    empty_frac=0.25,
                    duplicate_frac=0.2,
                    index_dtype=index_dtype,
                )
            )
        else:
            idx = torch.full((tokens[r], K), num_experts - 1, dtype=index_dtype)
            rts.append((idx, torch.softmax(torch.randn(tokens[r], K, generator=gen(seed + r)), -1)))
    so = [torch.randn(tokens[r], H, generator=gen(seed * 100 + 30 + r)) if shared else None for r in range(size)]
    return {
        "x": [a[0] for a in xs],
        "x_scale": [a[1] for a in xs],
        "idx": [a[0] for a in rts],
        "tw": [a[1] for a in rts],
        "w13": [a["w13"] for a in w],
        "w13_scale": [a["w13_scale"] for a in w],
        "w2": [a["w2"] for a in w],
        "w2_scale": [a["w2_scale"] for a in w],
        "shared": so,
        "num_experts": num_experts,
        "limit": limit,
    }


def reference_outputs(case: dict, combine: str = "fp32") -> list[torch.Tensor]:
    return reference.forward_simulated(
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
        C,
        case["limit"],
        combine=combine,
    )


def run_op(case: dict, rank: int, size: int, group_name: str = "", fn=None, combo=AG_FP32) -> torch.Tensor:
    fn = fn or torch.ops.static_moe.forward
    return fn(
        case["x"][rank],
        case["x_scale"][rank],
        case["idx"][rank],
        case["tw"][rank],
        case["w13"][rank],
        case["w13_scale"][rank],
        case["w2"][rank],
        case["w2_scale"][rank],
        case["shared"][rank],
        case["num_experts"],
        C,
        case["limit"],
        group_name,
        rank,
        size,
        dispatch=combo[0],
        combine=combo[1],
        dispatch_capacity=combo[2],
    )


def spec_of(case: dict, rank: int, size: int, act: str, wfmt: str) -> workspace.WorkspaceSpec:
    return workspace.WorkspaceSpec(
        capacity=C,
        hidden=H,
        intermediate=I,
        num_experts=case["num_experts"],
        topk=K,
        ep_size=size,
        act_format=act,
        weight_format=wfmt,
    )


# ----------------------------------------------------------------------------------------------------------------
# S = 1, in process
# ----------------------------------------------------------------------------------------------------------------
S1_CASES = [  # (tokens, routing, shared, index dtype, activation group)
    ([5], "random", False, torch.int32, 128),
    ([C], "random", True, torch.int64, 32),
    ([0], "random", True, torch.int32, 128),
    ([6], "one_expert", False, torch.int64, 128),
]


@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS, ids=[f"{a}x{w}" for a, w in FORMAT_PAIRS])
def test_forward_s1_matches_reference(act, wfmt):
    for i, (tokens, routing, shared, index_dtype, group) in enumerate(S1_CASES):
        case = make_case(
            1,
            4,
            act,
            wfmt,
            tokens,
            seed=i,
            routing=routing,
            shared=shared,
            group=group,
            index_dtype=index_dtype,
            limit=None if i % 2 else LIMIT,
        )
        out = run_op(case, 0, 1)
        ref = reference_outputs(case)[0]
        assert out.dtype == torch.bfloat16 and out.shape == (tokens[0], H)
        assert_gemm_bitwise(out, ref, f"S=1 {act}x{wfmt} case {i}")
        # The Python wrapper is the same op.
        wrapped = static_moe.forward(
            case["x"][0],
            case["x_scale"][0],
            case["idx"][0],
            case["tw"][0],
            case["w13"][0],
            case["w13_scale"][0],
            case["w2"][0],
            case["w2_scale"][0],
            case["shared"][0],
            num_experts=4,
            capacity=C,
            swiglu_limit=case["limit"],
        )
        assert_equal(wrapped, out, "wrapper vs op")


@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS, ids=[f"{a}x{w}" for a, w in FORMAT_PAIRS])
def test_forward_s1_on_cpu_has_the_packed_steps_bits(act, wfmt):
    """On CPU the S = 1 step hands the T rows to local_experts as given, without packing them into the capacity's
    buffer and unpacking them (there is no dispatch). Each row's bits are those of the packed step, whose
    capacity rows beyond T are padding (ids -1): held here for every format pair, with a shared expert, int64 ids,
    T from 0 to C, and the bf16 combine."""
    fwd = importlib.import_module("static_moe.ops.forward")
    for i, (tokens, routing, shared, index_dtype, group) in enumerate(S1_CASES):
        case = make_case(
            1, 4, act, wfmt, tokens, seed=20 + i, routing=routing, shared=shared, group=group, index_dtype=index_dtype
        )
        x, x_scale, idx, tw = (case[n][0] for n in ("x", "x_scale", "idx", "tw"))
        weights = [case[n][0] for n in ("w13", "w13_scale", "w2", "w2_scale")]
        for combine in ("fp32", "bf16"):
            config = fwd.ForwardConfig(448.0, "eoi", "silu", fwd.DEFAULT_ALPHA, None, None, "all_gather", combine, 0)
            parts = fwd._packed_parts(x, x_scale, idx, tw)
            packed = torch.ops.static_moe.pack_rows(parts, C)
            acc = fwd._local_step(packed, parts, x_scale is not None, *weights, 0, case["limit"], config)
            assert acc.shape[0] == C  # the capacity's rows: the step the CPU path no longer takes
            want = fwd._finish(acc, tokens[0], case["shared"][0], config)
            got = run_op(case, 0, 1, combo=("all_gather", combine, 0))
            assert_equal(got, want, f"{act}x{wfmt} case {i} combine {combine}")


def test_forward_s1_bf16_topk_weights_are_widened():
    """bf16 routing weights are widened to fp32, nothing else: the op gives bitwise what it gives on the fp32
    values of those bf16 weights, and matches the reference run on the bf16 weights."""
    case = make_case(1, 4, "bf16", "bf16", [5], seed=3)
    case["tw"] = [case["tw"][0].to(torch.bfloat16).float()]
    widened = run_op(case, 0, 1)
    case["tw"] = [case["tw"][0].to(torch.bfloat16)]
    ref_bf16 = reference_outputs(case)[0]
    out = run_op(case, 0, 1)
    assert_gemm_bitwise(out, ref_bf16, "bf16 routing weights")
    assert_equal(out, widened, "bf16 weights vs their fp32 values")


@pytest.mark.parametrize("wfmt,group", [("fp8", 128), ("fp4", 32)])
def test_forward_fp8_max_240_for_trn2(wfmt, group):
    """fp8_max (trn2 needs 240) reaches the re-quantization of the SwiGLU output: on an input where some re-quantized
    values exceed 240 at 448 (make_fp8_max_sensitive), the op with 240 matches the reference run with 240, which
    lies outside the SPEC §2 tolerance of the 448 run; 448 stays the default; the wrapper passes it on."""
    x, w13, w2, idx, tw = make_fp8_max_sensitive(5, 4, H, I, seed=5)
    x_q, x_s = quantize_activation(x, group)
    w = (*quantize_weight(w13, wfmt), *quantize_weight(w2, wfmt))
    args = (x_q, x_s, idx, tw, *w, None, 4, C, None, "", 0, 1)
    op = torch.ops.static_moe.forward
    out = {m: op(*args, m) for m in (240.0, 448.0)}
    ref = {m: reference.forward(*args, m) for m in (240.0, 448.0)}
    for m in out:
        assert_gemm_bitwise(out[m], ref[m], f"fp8x{wfmt} fp8_max={m}")
    with pytest.raises(AssertionError):  # the check above tells 240 from 448 apart on this input
        assert_gemm_close(ref[240.0], ref[448.0], "240 vs 448")
    assert_equal(op(*args), out[448.0], "448 is the default")
    wrapped = static_moe.forward(x_q, x_s, idx, tw, *w, None, num_experts=4, capacity=C, fp8_max=240.0)
    assert_equal(wrapped, out[240.0], "wrapper passes fp8_max")


def _args(case, **over):
    names = ["x", "x_scale", "idx", "tw", "w13", "w13_scale", "w2", "w2_scale", "shared"]
    a = {n: case[n][0] for n in names}
    a.update(num_experts=case["num_experts"], capacity=C, limit=case["limit"], group="", rank=0, size=1)
    a.update(over)
    return [a[n] for n in names] + [a["num_experts"], a["capacity"], a["limit"], a["group"], a["rank"], a["size"]]


def test_forward_errors_name_the_argument():
    bf = make_case(1, 4, "bf16", "bf16", [5], seed=1)
    f8 = make_case(1, 4, "fp8", "fp8", [5], seed=1)
    f4 = make_case(1, 4, "fp8", "fp4", [5], seed=1)
    op = torch.ops.static_moe.forward
    with pytest.raises(ValueError, match=r"9 tokens exceed the capacity of 8"):
        big = make_case(1, 4, "bf16", "bf16", [9], seed=1)
        op(*_args(big))
    cases = [
        (dict(idx=torch.tensor([[0, 1, 4]] * 5, dtype=torch.int32)), ValueError, r"topk_idx.*\[-1, 4\).*\[0, 4\]"),
        (dict(idx=torch.tensor([[0, 1, -2]] * 5, dtype=torch.int32)), ValueError, r"got values in \[-2, 1\]"),
        (dict(idx=bf["idx"][0].float()), TypeError, "topk_idx must have dtype torch.int32 or torch.int64"),
        (dict(idx=bf["idx"][0][:, :2]), ValueError, r"topk_weights must have shape \[R, k\] like topk_idx"),
        (dict(tw=bf["tw"][0].double()), TypeError, "topk_weights must have dtype torch.float32 or torch.bfloat16"),
        (
            dict(x=bf["x"][0].float()),
            TypeError,
            r"x must have an activation dtype: torch.bfloat16 \(bf16\) or "
            r"torch.float8_e4m3fn \(fp8\)",
        ),
        (dict(x=bf["x"][0][:, :128]), ValueError, r"w13 must have shape \[L, N, K\] = \[4, 256, 128\]"),
        (dict(x_scale=torch.ones(5, 2)), ValueError, "x_scale must be None when x is bf16"),
        (dict(num_experts=8), ValueError, r"num_experts=8 must equal local experts"),
        (dict(rank=1), ValueError, r"ep_rank must be in \[0, ep_size=1\)"),
        (dict(capacity=0), ValueError, "capacity must be a positive int"),
        (dict(shared=torch.zeros(5, 128)), ValueError, r"shared_output must be \[T=5, H=256\]"),
        (dict(w2=bf["w2"][0][:, :, :64]), ValueError, r"w2 must have shape \[L, N, K\] = \[4, 256, 128\]"),
        (dict(w13_scale=torch.ones(4, 256, 2)), ValueError, "w13_scale must be None for bf16 w13"),
        (dict(limit=-1.0), ValueError, "swiglu_limit must be None or a positive"),
        (
            dict(tw=bf["tw"][0].to("meta")),
            ValueError,
            r"topk_weights must be on the same device as x \(cpu\), got meta",
        ),
        (
            dict(shared=torch.zeros(5, 256, device="meta")),
            ValueError,
            r"shared_output must be on the same device as x \(cpu\), got meta",
        ),
    ]
    for over, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as info:
            op(*_args(bf, **over))
        assert str(info.value).startswith("forward: "), info.value  # the op the user called, not local_experts
    with pytest.raises(ValueError, match="x_scale is required when x is fp8"):
        op(*_args(f8, x_scale=None))
    with pytest.raises(
        ValueError,
        match=r"activation group x.size\(1\) / x_scale.size\(1\) must be 32 or 128, got "
        r"256 / 4 = 64",
    ):
        op(*_args(f8, x_scale=torch.ones(5, 4)))
    with pytest.raises(TypeError, match="w13_scale must have dtype torch.uint8 or torch.float8_e8m0fnu"):
        op(*_args(f4, w13_scale=f4["w13_scale"][0].float()))
    with pytest.raises(ValueError, match="w2_scale is required"):
        op(*_args(f8, w2_scale=None))
    with pytest.raises(ValueError, match="unsupported format pair: x is fp8 and w13 is bf16"):
        op(*_args(f8, w13=bf["w13"][0], w2=bf["w2"][0], w13_scale=None, w2_scale=None))
    with pytest.raises(ValueError, match=r"w2 must have the weight format of w13 \(fp8"):
        op(*_args(f8, w2=f4["w2"][0]))
    for fp8_max in (500.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"fp8_max must be in \[2, 448\]"):
            op(*_args(f8), fp8_max)
    # The fake (trace-time) path gives the same messages.
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in _args(big)]
        with pytest.raises(ValueError, match="9 tokens exceed the capacity of 8"):
            op(*fake)
        bad_pair = _args(f8, w13=bf["w13"][0], w2=bf["w2"][0], w13_scale=None, w2_scale=None)
        with pytest.raises(ValueError, match="forward: unsupported format pair"):
            op(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in bad_pair])


def test_forward_opcheck_and_export_s1():
    case = make_case(1, 4, "bf16", "bf16", [5], seed=2, shared=True)
    torch.library.opcheck(
        torch.ops.static_moe.forward.default, tuple(_args(case)), test_utils=("test_schema", "test_faketensor")
    )

    class Step(torch.nn.Module):
        def forward(self, x, x_scale, idx, tw, w13, w13_s, w2, w2_s):
            return torch.ops.static_moe.forward(x, x_scale, idx, tw, w13, w13_s, w2, w2_s, None, 4, C, LIMIT, "", 0, 1)

    for act, wfmt in (("bf16", "bf16"), ("fp8", "fp4")):
        case = make_case(1, 4, act, wfmt, [5], seed=4)
        inputs = tuple(case[n][0] for n in ("x", "x_scale", "idx", "tw", "w13", "w13_scale", "w2", "w2_scale"))
        ep = torch.export.export(Step(), inputs)
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert torch.ops.static_moe.forward.default in targets, targets
        assert_equal(ep.module()(*inputs), Step()(*inputs), f"export {act}x{wfmt}")


# ----------------------------------------------------------------------------------------------------------------
# S = 2 and S = 4 on gloo
# ----------------------------------------------------------------------------------------------------------------
def _scenarios(size: int):
    """(name, tokens per rank, routing, shared)."""
    if size == 2:
        return [
            ("T<C,T=C", [5, C], "random", True),
            ("T=0 on rank 0", [0, 6], "random", False),
            ("one expert", [4, 7], "one_expert", False),
            ("all ranks empty", [0, 0], "random", True),
        ]
    if size == 3:
        return [("mixed T incl. 0", [C, 0, 4], "random", True), ("one expert", [7, 2, 0], "one_expert", False)]
    return [("mixed T incl. 0", [3, 0, C, 1], "random", True), ("one expert", [2, 5, 0, 3], "one_expert", False)]


# (S, the combinations run there): every combination at S = 2 and 3; S = 4 the default only (the three at S = 4
# and 8: tests/layer/test_expert_parallel.py).
PARITY_RUNS = [(2, COMBOS), (3, COMBOS), (4, [AG_FP32])]


def _parity_worker(rank: int, size: int, combos: list) -> list[str]:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    num_experts = 4 * size if size == 2 else 2 * size
    done = []
    for combo, (p, (act, wfmt)) in itertools.product(combos, enumerate(FORMAT_PAIRS)):
        for s, (label, tokens, routing, shared) in enumerate(_scenarios(size)):
            case = make_case(
                size,
                num_experts,
                act,
                wfmt,
                tokens,
                seed=10 * p + s,
                routing=routing,
                shared=shared,
                index_dtype=torch.int64 if s % 2 else torch.int32,
            )
            out = run_op(case, rank, size, name, combo=combo)
            ref = reference_outputs(case, combo[1])[rank]
            assert out.shape == (tokens[rank], H), (label, out.shape)
            assert_gemm_bitwise(out, ref, f"S={size} rank {rank} {act}x{wfmt} {label} {combo}")
            done.append(f"{combo}:{act}x{wfmt}:{label}")
    return done


@pytest.mark.parametrize("size,combos", PARITY_RUNS, ids=[f"S{s}-{len(c)}combos" for s, c in PARITY_RUNS])
def test_forward_distributed_matches_reference(size, combos):
    results = run_ranks(_parity_worker, size, combos, timeout=150)
    assert all(len(r) == len(combos) * len(FORMAT_PAIRS) * len(_scenarios(size)) for r in results)


def _workspace_compile_independence_worker(rank: int, size: int) -> dict:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    report = {}
    act, wfmt = "fp8", "fp4"
    case = make_case(size, 8, act, wfmt, [5, C], seed=7, shared=True)
    ref = reference_outputs(case)[rank]
    plain = run_op(case, rank, size, name)

    # With a workspace open for this (group, spec) the op gathers and reduces into its buffers.
    lease = workspace.acquire(spec_of(case, rank, size, act, wfmt), dist.group.WORLD)
    ws = lease.workspace
    ptrs = ws.data_ptrs()
    with_ws = run_op(case, rank, size, name)
    assert_equal(with_ws, plain, "workspace path vs temporaries")
    assert_gemm_bitwise(with_ws, ref, "workspace path vs reference")
    packs = [reference.pack_rows(_parts(case, r), C) for r in range(size)]
    pw = ws.spec.parts_width  # then the step header (docs/errors.md)
    assert_equal(ws.send[:, :pw], packs[rank], "send buffer holds this rank's packed rows")
    assert_equal(ws.gathered[:, :pw], torch.cat(packs), "gathered buffer holds every rank's packed rows")
    tokens = case["x"][rank].shape[0]
    expect = (ws.scattered[:tokens] + case["shared"][rank]).to(torch.bfloat16)
    assert_equal(with_ws, expect, "output = scattered rows + shared")
    run_op(case, rank, size, name)
    assert ws.data_ptrs() == ptrs, "buffers moved between calls"

    # torch.compile(fullgraph=True) keeps the op whole: no graph break, same bits, same buffers.
    compiled = torch.compile(torch.ops.static_moe.forward, fullgraph=True, backend="inductor")
    assert_equal(run_op(case, rank, size, name, fn=compiled), with_ws, "compiled vs eager")
    assert ws.data_ptrs() == ptrs
    lease.close()
    report["compile"] = True

    # A token's output does not depend on the other tokens, on any rank (bitwise): token 0 of every rank is kept,
    # every other token (and each rank's T) changes — with each combination (with the all-to-all the second batch
    # overflows a block of Cd = 6 rows and the first does not).
    pairs = (("bf16", "bf16"), ("fp8", "fp4"), ("bf16", "fp8"))
    for combo, (act, wfmt) in itertools.product(COMBOS, pairs):
        a = make_case(size, 8, act, wfmt, [6, 3], seed=21)
        b = make_case(size, 8, act, wfmt, [2, C], seed=22)
        b["w13"], b["w13_scale"], b["w2"], b["w2_scale"] = a["w13"], a["w13_scale"], a["w2"], a["w2_scale"]
        for key in ("x", "x_scale", "idx", "tw"):
            for r in range(size):
                if a[key][r] is not None:
                    b[key][r][0] = a[key][r][0]
        if combo == A2A_BF16:
            assert [_overflows(a, size), _overflows(b, size)] == [False, True]
        out_a, out_b = run_op(a, rank, size, name, combo=combo), run_op(b, rank, size, name, combo=combo)
        assert_equal(out_b[0], out_a[0], f"token 0 of rank {rank} ({act}x{wfmt}, {combo}) changed with its neighbours")
    report["independence"] = True

    # A wrong group name fails on every rank before any collective.
    try:
        run_op(case, rank, size, "no-such-group")
    except ValueError as e:
        assert "no-such-group" in str(e)
        report["bad group"] = True
    return report


def _overflows(case: dict, size: int) -> bool:
    """Whether some rank has more than Cd rows for one rank with A2A_BF16 (the step then recomputes, SPEC §7)."""
    cd = A2A_BF16[2]
    return any(int(dispatch_ops.slot_rows(i, C, case["num_experts"], size, cd).overflow) for i in case["idx"])


def _parts(case: dict, r: int) -> list[torch.Tensor]:
    x, xs = case["x"][r], case["x_scale"][r]
    return ([x] if xs is None else [x, xs]) + [case["idx"][r].to(torch.int32), case["tw"][r].float()]


def test_forward_workspace_compile_and_token_independence_s2():
    reports = run_ranks(_workspace_compile_independence_worker, 2, timeout=150)
    for r in reports:
        assert r == {"compile": True, "independence": True, "bad group": True}, r


def _raises_on_rank_one(rank: int, size: int):
    if rank == 1:
        raise KeyError("boom")
    return rank


def test_harness_reports_a_failing_rank():
    """The harness itself: a failing rank surfaces with its traceback instead of passing silently."""
    with pytest.raises(RankFailure, match="boom"):
        run_ranks(_raises_on_rank_one, 2, timeout=60)
