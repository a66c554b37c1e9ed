"""What a lifecycle step leaves behind, asserted on the state itself (docs/workspace.md), not only by behaviour:
after a lease closes, after a lease is dropped without close, after an allocation fails (its error still held),
after StaticMoE.close and after a StaticMoE step that fails — the lease count, the lease's finalizer, the
manager's registries, the current frame and whether the buffers are still alive (weak references)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from static_moe import StaticMoE
from static_moe import workspace as ws_mod
from static_moe.testing.distributed import run_ranks
from static_moe.testing.generators import make_routing
from static_moe.workspace import WorkspaceManager, WorkspaceSpec

BUFFERS = ("send", "gathered", "acc", "scattered")


def spec(**over) -> WorkspaceSpec:
    base = dict(
        capacity=4,
        hidden=128,
        intermediate=128,
        num_experts=4,
        topk=2,
        ep_size=2,
        act_format="bf16",
        weight_format="bf16",
    )
    return WorkspaceSpec(**{**base, **over})


def _buffer_refs(ws) -> list[weakref.ref]:
    return [weakref.ref(ws.buffer(n)) for n in BUFFERS]


def _assert_forgotten(mgr: WorkspaceManager, ws, refs) -> None:
    """``ws`` is closed, holds no buffer, no registry of ``mgr`` names it, and its buffers are freed."""
    gc.collect()
    assert ws.closed and ws.num_leases == 0
    assert ws._buffers == {}, "a closed workspace still holds its buffers"
    assert ws not in mgr._by_key.values() and ws not in mgr._by_name.values(), "the manager still names it"
    assert all(r() is None for r in refs), "a buffer outlived the workspace's last lease"
    for name in ws.group_names:
        assert mgr.current_frame(name) is not ws


def _close_state(group) -> None:
    mgr = WorkspaceManager()
    a, b = mgr.acquire(spec(), group), mgr.acquire(spec(), group)
    ws = a.workspace
    refs = _buffer_refs(ws)
    assert a._finalizer.alive and b._finalizer.alive and ws.num_leases == 2
    assert mgr.current_frame(group.group_name) is ws
    a.close()
    assert a.closed and not a._finalizer.alive, "a closed lease's finalizer would give its count back twice"
    assert b._finalizer.alive and ws.num_leases == 1 and not ws.closed
    assert mgr._by_key[ws.key] is ws and all(r() is not None for r in refs)
    a.close()  # idempotent: the count does not move again
    assert ws.num_leases == 1
    b.close()
    assert not b._finalizer.alive
    _assert_forgotten(mgr, ws, refs)
    assert mgr._by_key == {} and mgr._by_name == {} and mgr.current_frame(group.group_name) is None


def _dropped_lease_state(group) -> None:
    mgr = WorkspaceManager()
    keep = mgr.acquire(spec(), group)
    drop = mgr.acquire(spec(), group)
    ws = keep.workspace
    fin = drop._finalizer
    del drop
    gc.collect()
    assert not fin.alive and ws.num_leases == 1 and not ws.closed
    refs = _buffer_refs(ws)
    keep.close()
    _assert_forgotten(mgr, ws, refs)


def _failed_allocation_state(group, rank: int, failure: str) -> None:
    """A failed allocation (on rank 1) hands every buffer back at once on every rank, even while the caller keeps
    the error (whose traceback holds the allocating frame): nothing is registered and the next acquire works."""
    handed: list[weakref.ref] = []

    def alloc(name, shape, dtype, device):
        if rank == 1 and name == "acc" and failure == "raises":
            raise MemoryError("injected: no room for acc")
        if rank == 1 and name == "acc":
            shape = (1,)
        t = torch.empty(shape, dtype=dtype, device=device)
        handed.append(weakref.ref(t))
        return t

    mgr = WorkspaceManager(allocator=alloc)
    error = None
    try:
        mgr.acquire(spec(), group)
    except (MemoryError, RuntimeError) as e:
        error = e
    gc.collect()
    assert error is not None, "the failed allocation did not raise"
    assert handed and all(r() is None for r in handed), f"{failure}: a buffer of the failed allocation is alive"
    assert mgr._by_key == {} and mgr._by_name == {} and mgr.current_frame(group.group_name) is None
    ok = WorkspaceManager().acquire(spec(), group)
    assert not ok.workspace.closed
    ok.close()


def _manager_worker(rank: int, size: int) -> bool:
    import torch.distributed as dist

    group = dist.group.WORLD
    _close_state(group)
    _dropped_lease_state(group)
    for failure in ("raises", "wrong_shape"):
        _failed_allocation_state(group, rank, failure)
    return True


def test_workspace_state_after_close_drop_and_failed_allocation():
    assert run_ranks(_manager_worker, 2, timeout=90, pg_timeout=20) == [True, True]


def _layer(**over):
    return StaticMoE(128, 128, 4, 2, 4, **over)


def test_static_moe_close_state():
    """S = 1 (a workspace without buffers): the layer's lease, its finalizer and the registry entry."""
    mgr = ws_mod.default_manager()
    first, second = _layer(), _layer()
    ws = first.workspace
    assert second.workspace is ws and ws.num_leases >= 2
    leases = ws.num_leases
    first.close()
    assert first.closed and first._lease.closed and not first._lease._finalizer.alive
    assert ws.num_leases == leases - 1 and not ws.closed and second._lease._finalizer.alive
    with pytest.raises(RuntimeError, match="layer is closed"):
        first.workspace  # noqa: B018  (the property access is what raises)
    first.close()  # idempotent
    assert ws.num_leases == leases - 1
    second.close()
    assert not second._lease._finalizer.alive and ws.num_leases == leases - 2
    if ws.num_leases == 0:  # no other holder (an earlier test's layer) shares it
        _assert_forgotten(mgr, ws, [])


def test_static_moe_dropped_without_close_gives_its_lease_back():
    layer = StaticMoE(128, 128, 4, 2, 3)
    ws = layer.workspace
    leases = ws.num_leases
    fin = layer._lease._finalizer
    del layer
    gc.collect()
    assert not fin.alive and ws.num_leases == leases - 1


def test_failed_step_leaves_the_layer_and_its_workspace_as_they_were():
    layer = _layer()
    ws = layer.workspace
    ptrs, leases = ws.data_ptrs(), ws.num_leases
    lease, fin = layer._lease, layer._lease._finalizer
    holders = list(ws_mod.default_manager().workspaces())
    x = torch.randn(5, 128).to(torch.bfloat16)  # 5 tokens > capacity 4
    with pytest.raises(ValueError, match="5 tokens exceed the capacity of 4"):
        layer(x, *make_routing(5, 2, 4, seed=1))
    assert not layer.closed and layer._lease is lease and fin.alive
    assert layer.workspace is ws and ws.data_ptrs() == ptrs and ws.num_leases == leases
    assert ws_mod.default_manager().workspaces() == holders, "a failed step changed the registered workspaces"
    good = torch.randn(3, 128).to(torch.bfloat16)
    assert layer(good, *make_routing(3, 2, 4, seed=2)).shape == (3, 128)
    layer.close()
