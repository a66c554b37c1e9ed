"""swiglu_and_cast NKI kernel vs the reference at SPEC §2 tolerances (reference run with the same fp8_max).

Runs through ``static_moe.nki.shim.simulate`` (real NKI simulator when importable, our interpreter
otherwise). Hypothesis draws ragged row counts (not multiples of 128), I from one group to several, both
group sizes, bf16 and fp32 inputs, with and without clamp and routing weights, and rows of weight 0 (the
padding rows of a gathered batch).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from static_moe.nki import shim
from static_moe.nki_kernels.swiglu_and_cast import swiglu_and_cast
from static_moe.reference.swiglu_and_cast import floor_scale
from static_moe.reference.swiglu_and_cast import swiglu_and_cast as ref_swiglu_and_cast
from static_moe.testing.numeric import assert_swiglu_close

TRN2_FP8_MAX = 240.0


def _inputs(rows, inter, in_dtype, weighted, zero_frac, scale, seed):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * scale).to(in_dtype)
    if not weighted:
        return gate_up, None
    w = torch.rand(rows, generator=g)
    w[torch.rand(rows, generator=g) < zero_frac] = 0.0
    return gate_up, w


def _run(gate_up, w, limit, out_format, group, fp8_max=TRN2_FP8_MAX):
    out = shim.simulate(swiglu_and_cast)(
        gate_up, w, swiglu_limit=limit, out_format=out_format, group_size=group, fp8_max=fp8_max, pow2_scale=True
    )
    if out_format == "bf16":
        out = (out, torch.empty(gate_up.shape[0], 0))
    ref = ref_swiglu_and_cast(gate_up, w, limit, out_format, group, fp8_max, True)
    return out, ref


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 300),
    groups=st.integers(1, 5),
    group=st.sampled_from([32, 128]),
    in_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    limit=st.sampled_from([None, 7.0, 0.5]),
    weighted=st.booleans(),
    zero_frac=st.sampled_from([0.0, 0.3, 1.0]),
    out_format=st.sampled_from(["fp8", "bf16"]),
    seed=st.integers(0, 2**16),
)
# Edge cases by name, outside the random budget: one row; a ragged tile of weight-0 rows (padding) under each clamp
# value; I = 640 (five 128-groups) in bf16 out. Non-finite inputs: test_nonfinite_values_stay_in_their_group.
@example(
    rows=1,
    groups=1,
    group=32,
    in_dtype=torch.float32,
    limit=None,
    weighted=False,
    zero_frac=0.0,
    out_format="fp8",
    seed=1,
)
@example(
    rows=130,
    groups=2,
    group=128,
    in_dtype=torch.bfloat16,
    limit=0.5,
    weighted=True,
    zero_frac=1.0,
    out_format="fp8",
    seed=2,
)
@example(
    rows=77,
    groups=3,
    group=32,
    in_dtype=torch.bfloat16,
    limit=7.0,
    weighted=True,
    zero_frac=0.3,
    out_format="fp8",
    seed=3,
)
@example(
    rows=129,
    groups=5,
    group=128,
    in_dtype=torch.float32,
    limit=7.0,
    weighted=True,
    zero_frac=0.3,
    out_format="bf16",
    seed=4,
)
def test_matches_reference(rows, groups, group, in_dtype, limit, weighted, zero_frac, out_format, seed):
    gate_up, w = _inputs(rows, groups * group, in_dtype, weighted, zero_frac, 3.0, seed)
    out, ref = _run(gate_up, w, limit, out_format, group)
    assert_swiglu_close(out, ref, f"rows={rows} I={groups * group} g={group} {out_format}")


def test_weight_zero_rows_give_zeros_and_floor_scale():
    gate_up, w = _inputs(130, 256, torch.bfloat16, True, 0.0, 2.0, 7)
    w[100:] = 0.0  # the padding rows of a gathered batch: ragged tail of the second 128-row tile
    (q, s), ref = _run(gate_up, w, 7.0, "fp8", 128)
    assert_swiglu_close((q, s), ref)
    assert bool((q[100:].float() == 0).all())
    assert bool((s[100:] == floor_scale(TRN2_FP8_MAX, True)).all())


def test_v4_flash_decode_shape_and_extreme_magnitudes():
    """I = 2048 (DeepSeek-V4-Flash), 1×32 and 1×128 groups, values spanning many binades: stresses the exact
    power-of-two scale built from the bits of amax."""
    g = torch.Generator().manual_seed(11)
    rows, inter = 40, 2048
    mags = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * mags).bfloat16()
    w = torch.rand(rows, generator=g)
    for group in (32, 128):
        out, ref = _run(gate_up, w, None, "fp8", group)
        assert_swiglu_close(out, ref, f"g={group}")


def test_amax_exactly_at_power_of_two_boundary():
    """amax = fp8_max · 2^e exactly must give s = 2^e (not 2^(e+1)): the kernel's bit-level rule vs the
    reference's fp32 division."""
    rows, inter = 4, 128
    gate_up = torch.zeros(rows, 2 * inter)
    gate_up[:, :inter] = 30.0  # silu(30) = 30 (to fp32 precision)
    gate_up[:, inter:] = 1.0
    w = torch.tensor([240.0 / 30.0 * 2.0**-3, 240.0 / 30.0, 240.0 / 30.0 * 0.999, 240.0 / 30.0 * 1.001])
    out, ref = _run(gate_up, w, None, "fp8", 128)
    assert_swiglu_close(out, ref)


def test_pow2_scale_false_is_rejected_by_the_kernel():
    gate_up, w = _inputs(3, 128, torch.bfloat16, True, 0.0, 1.0, 0)
    with pytest.raises(AssertionError, match="pow2_scale"):
        shim.simulate(swiglu_and_cast)(gate_up, w, out_format="fp8", pow2_scale=False)


@pytest.mark.skipif(shim.real_nki_available(), reason="interpreter target switch (trn2 vs trn3)")
def test_fp8_max_448_needs_trn3():
    import nki_interpreter as interpreter

    gate_up, w = _inputs(70, 256, torch.bfloat16, True, 0.2, 40.0, 5)
    with pytest.raises(AssertionError, match="trn3"):
        _run(gate_up, w, None, "fp8", 128, fp8_max=448.0)
    with interpreter.target("trn3"):
        out, ref = _run(gate_up, w, None, "fp8", 128, fp8_max=448.0)
    assert_swiglu_close(out, ref)
    assert float(out[0].float().abs().max()) > 240.0  # the e4m3fn range is used


@pytest.mark.skipif(
    not shim.real_nki_available(),
    reason="real nki (Neuron SDK >= 2.29) is not importable here; the interpreter runs this kernel in the tests above",
)
def test_real_nki_simulator_runs_swiglu(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    gate_up, w = _inputs(130, 256, torch.bfloat16, True, 0.2, 3.0, 1)
    for fmt in ("fp8", "bf16"):
        out, ref = _run(gate_up, w, 7.0, fmt, 128)
        assert_swiglu_close(out, ref)


NONFINITE = [
    ("gate", float("nan")),
    ("up", float("nan")),
    ("weight", float("nan")),
    ("gate", -float("inf")),
    ("gate", float("inf")),
    ("up", -float("inf")),
]


@pytest.mark.parametrize("where,value", NONFINITE, ids=[f"{w}={v}" for w, v in NONFINITE])
@pytest.mark.parametrize("out_format,group", [("fp8", 32), ("fp8", 128), ("bf16", 128)])
def test_nonfinite_values_stay_in_their_group(where, value, out_format, group):
    """SPEC §1.5 on non-finite inputs, as the CPU kernel and the reference (test_swiglu_and_cast): a NaN / inf
    v never dequantizes to a number, its group holds only NaN or ±0, other groups are untouched."""
    from static_moe.reference.swiglu_and_cast import swiglu
    from static_moe.testing.generators import poisoned_swiglu_input
    from static_moe.testing.numeric import assert_nonfinite_confined

    bad_gu, bad_w, gu, w = poisoned_swiglu_input(where, value)
    for limit in (None, 7.0):
        nonfinite = ~torch.isfinite(swiglu(bad_gu, bad_w, limit))
        touched = swiglu(bad_gu, bad_w, limit) != swiglu(gu, w, limit)
        out, _ = _run(bad_gu, bad_w, limit, out_format, group)
        clean, _ = _run(gu, w, limit, out_format, group)
        assert_nonfinite_confined(out, clean, touched, nonfinite, f"{where}={value} limit={limit} {out_format}")
