"""What a failed collective step leaves behind, asserted on the state (docs/errors.md, docs/workspace.md), on 2
gloo ranks: after a step that one rank's bad input fails, and after a step whose configurations differ across the
ranks, every rank still holds the same current workspace at the same addresses with the same leases, no
workspace was acquired or dropped, the forward's own (implicit) leases did not grow, and the next good step is
bitwise the step before. Releasing the implicit leases then frees the buffers and empties the registries."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from static_moe import workspace as ws_mod
from static_moe.ops import step_status as ss
from static_moe.testing.distributed import run_ranks
from static_moe.testing.generators import make_activations, make_routing, make_weights

H, I, L, K, C = 128, 128, 2, 2, 4


def _step(rank, size, gname, tokens=3, capacity=C):
    w = make_weights(L, H, I, "bf16", seed=rank)
    x, _ = make_activations(tokens, H, "bf16", seed=10 + rank)
    idx, tw = make_routing(tokens, K, L * size, seed=20 + rank)
    return torch.ops.static_moe.forward(
        x, None, idx, tw, w["w13"], None, w["w2"], None, None, L * size, capacity, None, gname, rank, size
    )


def _state(gname):
    mgr = ws_mod.default_manager()
    ws = mgr.current_frame(gname)
    return {
        "current": ws,
        "ptrs": ws.data_ptrs(),
        "leases": ws.num_leases,
        "closed": ws.closed,
        "workspaces": list(mgr.workspaces()),
        "implicit": list(ws_mod._IMPLICIT),
        "implicit_finalizers": [lease._finalizer.alive for lease in ws_mod._IMPLICIT],
    }


def _worker(rank: int, size: int) -> dict:
    import torch.distributed as dist

    gname = dist.group.WORLD.group_name
    before = _step(rank, size, gname)
    state = _state(gname)
    assert state["current"].implicit and len(state["implicit"]) == 1 and state["leases"] == 1
    seen = {}
    for name, kw in (
        ("bad input on rank 1", {"tokens": 5} if rank == 1 else {}),
        ("configurations differ", {"capacity": 2 * C} if rank == 0 else {}),
    ):
        try:
            _step(rank, size, gname, **kw)
            seen[name] = "no error"
        except (ValueError, RuntimeError) as e:
            seen[name] = type(e).__name__
        after = _state(gname)
        for key in state:
            assert after[key] == state[key], f"{name}: {key} changed from {state[key]} to {after[key]}"
    assert torch.equal(_step(rank, size, gname), before), "the next good step differs from the one before"

    ws = state["current"]
    refs = [weakref.ref(ws.buffer(n)) for n in ("send", "gathered", "acc", "scattered")]
    del state
    ws_mod.release_implicit()
    gc.collect()
    mgr = ws_mod.default_manager()
    assert ws.closed and ws.num_leases == 0 and ws_mod._IMPLICIT == []
    assert mgr.workspaces() == [] and mgr.current_frame(gname) is None
    assert all(r() is None for r in refs), "a buffer outlived the release of the forward's own lease"
    return seen


def test_failed_steps_leave_the_workspace_state_unchanged():
    rank0, rank1 = run_ranks(_worker, 2, timeout=120, pg_timeout=30)
    assert rank0 == {"bad input on rank 1": "RuntimeError", "configurations differ": "ValueError"}
    assert rank1 == {"bad input on rank 1": "ValueError", "configurations differ": "ValueError"}


# ---------------------------------------------------------------------------------------------------------------
# The verdict itself, in process: the same S headers give the same decision, whichever rank is the odd one
# ---------------------------------------------------------------------------------------------------------------
S, E = 3, 6
CFG = dict(
    capacity=C,
    hidden=H,
    intermediate=I,
    num_experts=E,
    topk=K,
    ep_size=S,
    act_format="fp8",
    weight_format="fp4",
    act_group=32,
    swiglu_limit=7.0,
    fp8_max=448.0,
)


def _header(idx=None, x_scale=None, kind=ss.OK, **over) -> list[int]:
    idx = torch.tensor([[0, E - 1], [-1, 2]], dtype=torch.int32) if idx is None else idx
    x_scale = torch.ones(2, H // 32) if x_scale is None else x_scale
    words = ss.config_words(**{**CFG, **over})
    return ss.build_header(torch.device("cpu"), kind, 0, words, idx, x_scale).tolist()


def _verdict(headers, messages=None):
    v = ss.decide(headers, messages or {})
    device_bad = bool(ss.device_verdict(torch.tensor(headers, dtype=torch.int32)))
    assert device_bad == bool(v.config_diffs or v.failures or v.bad_magic), "device and host verdicts disagree"
    return v


def test_good_headers_pass():
    v = _verdict([_header() for _ in range(S)])
    assert not (v.config_diffs or v.failures or v.need_frame or v.bad_magic)


@pytest.mark.parametrize("odd", range(S))
@pytest.mark.parametrize(
    "field,value",
    [
        ("capacity", 2 * C),
        ("hidden", 2 * H),
        ("intermediate", 2 * I),
        ("num_experts", 2 * E),
        ("topk", K + 1),
        ("act_format", "bf16"),
        ("weight_format", "fp8"),
        ("act_group", 128),
        ("swiglu_limit", None),
        ("fp8_max", 240.0),
    ],
)
def test_one_differing_rank_is_named_in_every_field(field, value, odd):
    headers = [_header(**({field: value} if r == odd else {})) for r in range(S)]
    v = _verdict(headers)
    name = "formats" if field.endswith("_format") else field
    assert len(v.config_diffs) == 1 and v.config_diffs[0].startswith(f"{name}: "), v.config_diffs
    assert f"on ranks [{odd}]" in v.config_diffs[0], v.config_diffs
    with pytest.raises(ValueError, match="configurations differ"):
        ss.raise_verdict(v, 0, S, None)


@pytest.mark.parametrize("odd", range(S))
@pytest.mark.parametrize(
    "where,bad",
    [((0, 0), E), ((1, K - 1), E), ((0, 0), -2), ((1, K - 1), -(2**31))],
    ids=["first_E", "last_E", "first_-2", "last_int32_min"],
)
def test_an_id_out_of_range_anywhere_fails_its_rank(where, bad, odd):
    idx = torch.tensor([[0, E - 1], [-1, 2]], dtype=torch.int32)
    idx[where] = bad
    headers = [_header(idx=idx if r == odd else None) for r in range(S)]
    v = _verdict(headers)
    assert list(v.failures) == [odd] and "topk_idx must hold global expert ids in [-1, 6)" in v.failures[odd][1]
    own = ValueError("own")
    with pytest.raises(ValueError, match="own"):
        ss.raise_verdict(v, odd, S, own)
    with pytest.raises(RuntimeError, match=f"forward: rank {odd} failed: topk_idx"):
        ss.raise_verdict(v, (odd + 1) % S, S, None)


@pytest.mark.parametrize("odd", range(S))
@pytest.mark.parametrize("flat", [0, 2 * (H // 32) - 1, H // 32], ids=["first", "last", "second_row"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_activation_scale_anywhere_fails_its_rank(flat, value, odd):
    xs = torch.ones(2, H // 32)
    xs.view(-1)[flat] = value
    xs.view(-1)[-1 if flat == 0 else 0] = 0.5  # another good value where the bad one is not
    v = _verdict([_header(x_scale=xs if r == odd else None) for r in range(S)])
    groups = H // 32
    assert list(v.failures) == [odd] and f"x_scale[{flat // groups}, {flat % groups}] is not" in v.failures[odd][1]


@pytest.mark.parametrize("odd", range(S))
def test_failed_call_message_travels_in_the_frame(odd):
    pw = 96  # parts width of the frame
    frames = []
    for r in range(S):
        send = torch.zeros(C, pw + ss.WORDS * 4, dtype=torch.uint8)
        if r == odd:
            msg = ss.message_bytes("forward: bad things on this rank", C * pw)
            words = ss.call_config_words(CFG, call_ok=False)
            ss.write_frame(
                send, pw, ss.build_header(send.device, ss.VALUE_ERROR, len(msg), words, None, None), None, msg
            )
        else:
            packed = torch.randint(0, 255, (C, pw), dtype=torch.uint8)
            ss.write_frame(send, pw, torch.tensor(_header(), dtype=torch.int32), packed)
        assert bool((send[1:, pw:] == 0xFF).all()), "header columns below row 0 must be padding"
        frames.append(send)
    gathered = torch.cat(frames)
    headers = ss.gathered_headers(gathered, C, pw).tolist()
    v = _verdict(headers, ss.read_messages(gathered, headers, C, pw))
    assert not v.config_diffs, "a failed call's unknown configuration is not compared"
    assert v.failures == {odd: ("ValueError", "forward: bad things on this rank")}


def test_padding_header_is_a_missing_rank():
    headers = [_header() for _ in range(S)]
    headers[-1] = [-1] * ss.WORDS  # 0xFF bytes: a rank that sent padding
    v = _verdict(headers)
    assert v.bad_magic == [S - 1]
    with pytest.raises(RuntimeError, match=r"ranks \[2\] sent no step header"):
        ss.raise_verdict(v, 0, S, None)
