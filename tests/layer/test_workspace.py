"""The workspace manager (SPEC §3): memory plan, leases and sharing, collective creation with manifest checks,
rollback of failed allocations, close / use-after-close."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from static_moe.reference.pack_rows import pack_rows
from static_moe.testing.distributed import expect_raises, run_ranks
from static_moe.workspace import STEP_HEADER_NBYTES, WorkspaceManager, WorkspaceSpec, memory_plan


def spec(**over) -> WorkspaceSpec:
    base = dict(
        capacity=16,
        hidden=256,
        intermediate=128,
        num_experts=8,
        topk=3,
        ep_size=2,
        act_format="fp8",
        act_group=128,
        weight_format="fp4",
    )
    base.update(over)
    return WorkspaceSpec(**base)


# ----------------------------------------------------------------------------------------------------------------
# In process
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,group,topk", [("bf16", 128, 3), ("fp8", 128, 6), ("fp8", 32, 8)])
def test_row_width_matches_pack_rows(act, group, topk):
    s = spec(act_format=act, act_group=group, topk=topk, weight_format="fp8")
    h = s.hidden
    x = torch.zeros(2, h, dtype=torch.bfloat16 if act == "bf16" else torch.float8_e4m3fn)
    parts = (
        [x]
        + ([] if act == "bf16" else [torch.zeros(2, h // group)])
        + [torch.zeros(2, topk, dtype=torch.int32), torch.zeros(2, topk)]
    )
    assert pack_rows(parts, 4).shape[1] == s.parts_width
    assert s.row_width == s.parts_width + STEP_HEADER_NBYTES  # the forward's step header (docs/errors.md)


def test_memory_plan_formula_and_worked_example():
    # The README's example: DeepSeek-V4-Flash shapes, fp8 activations (g = 128), S = 8, C = 128.
    s = WorkspaceSpec(
        capacity=128,
        hidden=4096,
        intermediate=2048,
        num_experts=256,
        topk=6,
        ep_size=8,
        act_format="fp8",
        act_group=128,
        weight_format="fp4",
    )
    # x, scales (32 × fp32), ids (6 × int32 → 24 → 32), weights, the 64-byte step header
    assert s.row_width == 4096 + 128 + 32 + 32 + 64
    plan = memory_plan(s)
    assert {b.name: b.shape for b in plan.buffers} == {
        "send": (128, 4352),
        "gathered": (1024, 4352),
        "acc": (1024, 4096),
        "scattered": (128, 4096),
    }
    assert plan.total_bytes == (8 + 1) * 128 * (4352 + 4 * 4096) == 23_887_872
    assert plan.nbytes("acc") == 1024 * 4096 * 4
    assert "send" in str(plan)
    # Nothing is allocated to make a plan, however large.
    huge = WorkspaceSpec(capacity=1 << 20, hidden=1 << 16, intermediate=128, num_experts=1024, topk=8, ep_size=64)
    assert memory_plan(huge).total_bytes > 1 << 40
    # S = 1 runs no collective and owns nothing.
    assert memory_plan(spec(ep_size=1)).total_bytes == 0


def test_spec_validation():
    bad = [
        (dict(hidden=200), "hidden must be a multiple of 128"),
        (dict(intermediate=100), "intermediate must be a multiple of 128"),
        (dict(num_experts=7), r"num_experts \(7\) must be divisible by ep_size \(2\)"),
        (dict(topk=9), r"topk \(9\) cannot exceed num_experts \(8\)"),
        (dict(capacity=0), "capacity must be a positive integer"),
        (dict(capacity=True), "capacity must be a positive integer"),
        (dict(act_format="fp4"), "act_format must be one of"),
        (dict(weight_format="int4"), "weight_format must be one of"),
        (dict(act_format="fp8", weight_format="bf16"), "'fp8' with weight format 'bf16' is not supported"),
        (dict(act_group=64), "act_group must be one of"),
        (dict(device="meta"), "not 'meta'"),
        (dict(device="nonsense"), "device must name a torch device"),
    ]
    for over, msg in bad:
        with pytest.raises(ValueError, match=msg):
            spec(**over)
    assert spec(act_format="bf16", act_group=64).act_group == 0  # the group means nothing for bf16 activations
    assert spec(device=torch.device("cpu")) == spec()


def test_single_rank_leases_share_and_close():
    mgr = WorkspaceManager()
    s = spec(ep_size=1)
    a, b = mgr.acquire(s), mgr.acquire(s)
    assert a.workspace is b.workspace and a.workspace.num_leases == 2
    other = mgr.acquire(spec(ep_size=1, capacity=8))
    assert other.workspace is not a.workspace
    ws = a.workspace
    a.close()
    a.close()  # idempotent
    assert not ws.closed and ws.num_leases == 1
    with pytest.raises(RuntimeError, match="lease is closed"):
        a.workspace  # noqa: B018  (the property access is what raises)
    b.close()
    assert ws.closed and mgr.workspaces() == [other.workspace]
    with pytest.raises(RuntimeError, match="is closed"):
        ws.data_ptrs()
    # A lease dropped without close() still gives its count back.
    with mgr.acquire(s) as c:
        fresh = c.workspace
    assert fresh.closed
    d = mgr.acquire(s)
    ws_d = d.workspace
    del d
    gc.collect()
    assert ws_d.closed
    other.close()
    assert mgr.workspaces() == []


def test_acquire_rejects_wrong_arguments_locally():
    mgr = WorkspaceManager()
    with pytest.raises(TypeError, match="WorkspaceSpec"):
        mgr.acquire({"capacity": 4})
    with pytest.raises(ValueError, match="needs an initialised process group"):
        mgr.acquire(spec(ep_size=2))


# ----------------------------------------------------------------------------------------------------------------
# On two gloo ranks
# ----------------------------------------------------------------------------------------------------------------
class _FailOnce:
    """Allocator that fails at one buffer on one rank, once, and remembers what it had handed out."""

    def __init__(self, rank: int, fail_rank: int, fail_buffer: str):
        self.rank, self.fail_rank, self.fail_buffer = rank, fail_rank, fail_buffer
        self.armed = True
        self.handed_out: list[weakref.ref] = []

    def __call__(self, name, shape, dtype, device):
        if self.armed and self.rank == self.fail_rank and name == self.fail_buffer:
            self.armed = False
            raise MemoryError(f"injected: no room for {name}")
        t = torch.empty(shape, dtype=dtype, device=device)
        self.handed_out.append(weakref.ref(t))
        return t


def _lifecycle_worker(rank: int, size: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    seen = {}

    # 1. Differing manifests raise ValueError on every rank, naming the fields and ranks, within bounded time.
    t0 = time.monotonic()
    mgr = WorkspaceManager()
    msg = expect_raises(
        ValueError,
        lambda: mgr.acquire(spec(capacity=16 if rank == 0 else 32), group),
        "capacity: 16 on ranks [0]; 32 on ranks [1]",
    )
    msg2 = expect_raises(
        ValueError,
        lambda: mgr.acquire(spec(weight_format="fp8" if rank else "fp4", topk=2 + rank), group),
        "weight_format",
        "topk: 2 on ranks [0]; 3 on ranks [1]",
    )
    seen["mismatch"] = (msg, msg2, time.monotonic() - t0)
    assert mgr.workspaces() == []

    # 2. An allocation failure on rank 1 (third buffer) rolls back every rank; the manager stays usable.
    alloc = _FailOnce(rank, fail_rank=1, fail_buffer="acc")
    mgr = WorkspaceManager(allocator=alloc)
    if rank == 1:
        expect_raises(MemoryError, lambda: mgr.acquire(spec(), group), "injected: no room for acc")
    else:
        expect_raises(
            RuntimeError, lambda: mgr.acquire(spec(), group), "allocation failed on group rank(s) [1]", "injected"
        )
    gc.collect()
    assert mgr.workspaces() == [] and all(r() is None for r in alloc.handed_out), "partial allocation kept"
    lease = mgr.acquire(spec(), group)
    ws = lease.workspace
    assert set(ws.data_ptrs()) == {"send", "gathered", "acc", "scattered"}
    assert ws.nbytes() == memory_plan(spec()).total_bytes
    assert ws.gathered.shape == (2 * 16, spec().row_width) and ws.acc.dtype == torch.float32
    seen["rollback"] = True

    # 3. Same spec on the same membership shares the workspace (another group object with the same ranks too);
    #    a different spec gets its own.
    same = mgr.acquire(spec(), group)
    assert same.workspace is ws and ws.num_leases == 2
    twin_group = dist.new_group([0, 1])
    twin = mgr.acquire(spec(), twin_group)
    assert twin.workspace is ws and mgr.find(twin_group.group_name, spec()) is ws
    assert mgr.find(group.group_name, spec()) is ws and mgr.find(group.group_name, spec(capacity=8)) is None
    other = mgr.acquire(spec(capacity=8), group)
    assert other.workspace is not ws
    refs = [weakref.ref(ws.buffer(n)) for n in ("send", "gathered", "acc", "scattered")]
    ptrs = ws.data_ptrs()

    # 4. Closing: idempotent; buffers live until the last lease; then freed, and any use raises RuntimeError.
    lease.close()
    lease.close()
    same.close()
    assert not ws.closed and ws.data_ptrs() == ptrs
    expect_raises(RuntimeError, lambda: lease.workspace, "lease is closed")
    twin.close()
    gc.collect()
    assert ws.closed and all(r() is None for r in refs), "buffers outlived the last lease"
    expect_raises(RuntimeError, lambda: ws.send, "closed")
    assert mgr.find(group.group_name, spec()) is None
    seen["close"] = True

    # 5. Lifecycle mismatch: rank 0 still holds a workspace the other rank closed → ValueError on both.
    keep = mgr.acquire(spec(capacity=4), group)
    if rank == 1:
        keep.close()
    expect_raises(
        ValueError,
        lambda: mgr.acquire(spec(capacity=4), group),
        "holds workspace: True on ranks [0]; False on ranks [1]",
    )
    keep.close()
    other.close()
    assert mgr.workspaces() == []
    seen["lifecycle"] = True
    return seen


def test_workspace_lifecycle_on_two_ranks():
    t0 = time.monotonic()
    reports = run_ranks(_lifecycle_worker, 2, timeout=90, pg_timeout=20)
    for r in reports:
        assert r["rollback"] and r["close"] and r["lifecycle"]
        msg, msg2, elapsed = r["mismatch"]
        assert "group ranks [0, 1]" in msg
        assert elapsed < 15, f"mismatch detection took {elapsed:.1f} s"
    # Both ranks report the very same diagnosis.
    assert reports[0]["mismatch"][:2] == reports[1]["mismatch"][:2]
    assert time.monotonic() - t0 < 90


# ----------------------------------------------------------------------------------------------------------------
# Manifest mismatch where only a middle rank differs, for every manifest field
# ----------------------------------------------------------------------------------------------------------------
def _spec3(**over) -> WorkspaceSpec:
    return spec(**{"ep_size": 3, "num_experts": 12, **over})


def _other_value(name: str, value):
    """A value for spec field ``name`` that differs from ``value`` and still makes a valid WorkspaceSpec (so the
    difference reaches the manifest comparison). Derived from the value's type, so fields added to the spec
    later are covered without editing this test; fails loudly for a type it cannot vary."""
    import static_moe.workspace as ws_mod

    if value is None:  # an optional field (e.g. swiglu_limit): a set value, small and large
        candidates = [7.0, 1, "bf16", 1e30]
    elif isinstance(value, bool):
        candidates = [not value]
    elif isinstance(value, int):
        candidates = [2 * value, value // 2, value // 4, value + 1, value - 1, 4 * value]
    elif isinstance(value, float):
        candidates = [2 * value, value / 2, value + 1]
    elif isinstance(value, str):
        import static_moe.activations as act_mod

        choices = [
            c
            for mod in (ws_mod, act_mod)
            for v in vars(mod).values()
            if isinstance(v, tuple) and all(isinstance(c, str) for c in v)
            for c in v
        ]
        candidates = choices + ["cuda:0", "cpu"]
    else:
        candidates = []
    for c in candidates:
        if c == value:
            continue
        try:
            varied = _spec3(**{**_COMPANIONS.get(name, {}), name: c})
        except (ValueError, TypeError):
            continue
        if getattr(varied, name) != value:
            return c
    raise AssertionError(f"no alternative value for WorkspaceSpec.{name} = {value!r}: teach _other_value its type")


# Fields that only take another value together with others (SPEC §7: the all-to-all needs the bf16 combine and a Cd).
_COMPANIONS = {
    "dispatch": dict(combine="bf16", dispatch_capacity=2),
    "dispatch_capacity": dict(dispatch="all_to_all", combine="bf16"),
    "alpha": dict(activation="swiglu_oai"),  # the only activation that reads alpha (normalised otherwise)
}


def _middle_rank_worker(rank: int, size: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    import static_moe.workspace as ws_mod

    group = dist.group.WORLD
    messages = {}
    mgr = WorkspaceManager()
    for f in dataclasses.fields(WorkspaceSpec):
        base = getattr(_spec3(), f.name)
        other = _spec3(**{**_COMPANIONS.get(f.name, {}), f.name: _other_value(f.name, base)})
        mine = other if rank == 1 else _spec3()
        want = f"{f.name}: {base!r} on ranks [0, 2]; {getattr(other, f.name)!r} on ranks [1]"
        messages[f.name] = expect_raises(ValueError, lambda: mgr.acquire(mine, group), want, "group ranks [0, 1, 2]")
    # The protocol version (not a spec field): only rank 1 speaks another one.
    saved = ws_mod.PROTOCOL_VERSION
    ws_mod.PROTOCOL_VERSION = saved + 1 if rank == 1 else saved
    try:
        messages["protocol"] = expect_raises(
            ValueError,
            lambda: mgr.acquire(_spec3(), group),
            f"protocol: {saved} on ranks [0, 2]; {saved + 1} on ranks [1]",
        )
    finally:
        ws_mod.PROTOCOL_VERSION = saved
    # Whether the workspace is already held: only rank 1 kept its lease.
    lease = mgr.acquire(_spec3(), group)
    if rank != 1:
        lease.close()
    messages["holds workspace"] = expect_raises(
        ValueError, lambda: mgr.acquire(_spec3(), group), "holds workspace: False on ranks [0, 2]; True on ranks [1]"
    )
    lease.close()
    assert mgr.workspaces() == []
    return messages


def test_manifest_mismatch_on_a_middle_rank_for_every_field():
    """Three ranks, only rank 1 differs, one manifest field at a time (every WorkspaceSpec field, found by
    introspection, plus the protocol version and whether the workspace is held; the group membership cannot
    differ inside one group): every rank raises ValueError naming the field and the ranks on each side, and
    all ranks report the same message. A comparison that skips any rank (or compares only neighbours of rank 0)
    misses rank 1 here."""
    import dataclasses

    reports = run_ranks(_middle_rank_worker, 3, timeout=120, pg_timeout=20)
    names = [f.name for f in dataclasses.fields(WorkspaceSpec)] + ["protocol", "holds workspace"]
    for r in reports:
        assert sorted(r) == sorted(names)
    assert reports[0] == reports[1] == reports[2]
