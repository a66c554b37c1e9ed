"""The SPEC §1.9 settings in the workspace manifest (SPEC §3): StaticMoE ranks built with a different activation,
alpha or bias presence fail at construction with a ValueError on every rank naming the field; ranks that agree
build; the raw op's first step on a group checks the same manifest (gloo, S = 2, bounded)."""

from __future__ import annotations

import pytest

from static_moe import workspace
from static_moe.testing.distributed import expect_raises, run_ranks

H, I, E, K, C = 128, 128, 4, 2, 4


def _worker(rank: int, size: int) -> list[str]:
    import torch.distributed as dist

    from static_moe import StaticMoE

    kw = dict(ep_group=dist.group.WORLD)
    done = []
    same = StaticMoE(H, I, E, K, C, activation="swiglu_oai", alpha=1.5, expert_biases=True, **kw)
    assert (same.workspace_spec.activation, same.workspace_spec.alpha) == ("swiglu_oai", 1.5)
    assert same.workspace_spec.expert_biases
    same.close()
    done.append("agree")
    odd = rank == size - 1
    cases = [
        ("activation", dict(activation="gelu_tanh" if odd else "silu"), "activation: 'silu' on ranks"),
        ("alpha", dict(activation="swiglu_oai", alpha=2.0 if odd else 1.702), "alpha: 1.702 on ranks"),
        ("expert_biases", dict(expert_biases=odd), "expert_biases: False on ranks"),
    ]
    for field, change, needle in cases:
        expect_raises(ValueError, lambda change=change: StaticMoE(H, I, E, K, C, **change, **kw), "differ", needle)
        done.append(field)
    # the group still works after the failed constructions
    after = StaticMoE(H, I, E, K, C, **kw)
    after.close()
    done.append("after")
    # The raw op's first step on a group acquires its own workspace under the call's spec: ranks calling with
    # different activations fail there, on every rank, before any buffer reaches a collective.
    done.append(_raw_op_disagrees(rank, size))
    return done


def _raw_op_disagrees(rank: int, size: int) -> str:
    import torch
    import torch.distributed as dist

    local = E // size
    x = torch.randn(2, H).bfloat16()
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    w = torch.full((2, K), 0.5)
    w13, w2 = torch.randn(local, 2 * I, H).bfloat16(), torch.randn(local, H, I).bfloat16()
    kw = dict(
        num_experts=E,
        capacity=C,
        swiglu_limit=None,
        group_name=dist.group.WORLD.group_name,
        ep_rank=rank,
        ep_size=size,
        activation="gelu_tanh" if rank == size - 1 else "silu",
    )
    args = (x, None, idx, w, w13, None, w2, None, None)
    try:
        expect_raises(ValueError, lambda: torch.ops.static_moe.forward(*args, **kw), "differ", "activation")
    finally:
        workspace.release_implicit()
    return "raw op"


def test_ranks_that_disagree_on_the_variant_fail_at_construction():
    results = run_ranks(_worker, 2, timeout=120)
    assert all(r == ["agree", "activation", "alpha", "expert_biases", "after", "raw op"] for r in results), results


def test_workspace_spec_checks_and_normalises_the_variant():
    base = dict(capacity=C, hidden=H, intermediate=I, num_experts=E, topk=K, ep_size=1)
    spec = workspace.WorkspaceSpec(**base, activation="gelu_tanh", alpha=3.0)
    assert spec.alpha == workspace.WorkspaceSpec(**base).alpha  # only swiglu_oai reads alpha
    assert workspace.WorkspaceSpec(**base, activation="swiglu_oai", alpha=3.0).alpha == 3.0
    with pytest.raises(ValueError, match="activation must be"):
        workspace.WorkspaceSpec(**base, activation="relu")
    with pytest.raises(ValueError, match="alpha must be"):
        workspace.WorkspaceSpec(**base, activation="swiglu_oai", alpha=float("inf"))
    with pytest.raises(ValueError, match="expert_biases must be a bool"):
        workspace.WorkspaceSpec(**base, expert_biases=1)


def test_a_hidden_size_off_the_128_grid_is_refused_with_how_to_pad():
    """gpt-oss's H = 2880: refused for every format (SPEC §1.2 'Sizes'), the message giving the padded size."""
    base = dict(capacity=C, intermediate=I, num_experts=E, topk=K, ep_size=1)
    for wfmt in ("bf16", "fp4"):
        with pytest.raises(ValueError, match="hidden must be a multiple of 128, got 2880: pad it with zeros to 2944"):
            workspace.WorkspaceSpec(**base, hidden=2880, weight_format=wfmt)
