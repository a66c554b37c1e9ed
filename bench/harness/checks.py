"""Correctness checks of the benchmarks: loose for baselines (a broken baseline must not be timed), SPEC §2 for the
op (reported in the table, not raised)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def check_baseline(name: str, out: torch.Tensor, ref: torch.Tensor, tolerance: float, what: str) -> float:
    """calc_diff of a baseline's output vs the reference's; raises when beyond ``tolerance`` (a broken baseline
    must not be timed)."""
    from static_moe.testing.numeric import calc_diff

    d = calc_diff(out.float(), ref.float())
    if not d <= tolerance:  # NaN fails too
        raise AssertionError(
            f"baseline {name} disagrees with static_moe.reference on {what}: calc_diff {d:.3e} > {tolerance:.0e}"
        )
    return d


def check_op(out: torch.Tensor | None, ref: torch.Tensor, check: Callable[..., None]) -> str:
    """'ok', or the first line of why the op's output fails ``check(out, ref)`` (SPEC §2). Reported, not
    raised: the table flags a timing of a wrong result."""
    if out is None:
        return "n/a"
    try:
        check(out, ref)
    except AssertionError as e:
        return "FAIL: " + str(e).splitlines()[0][:160]
    return "ok"


def check_point(tokens: list[int]) -> int:
    """The one token count at which outputs are checked against the reference (the first ≥ 4, else the first)."""
    return next((t for t in tokens if t >= 4), tokens[0])
