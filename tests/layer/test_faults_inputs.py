"""One-rank faults that used to crash or give silent results (docs/errors.md): size / offset overflow in the checks,
non-finite values given to the quantizers, and the swiglu_limit / fp8_max rules, the same at every entry point."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import static_moe
from static_moe import reference
from static_moe.formats import (
    FLOAT32_MAX,
    quantize_activation,
    quantize_weight,
    quantize_weight_fp4,
    quantize_weight_fp8,
    round_up_pow2,
)
from static_moe.testing.generators import make_activations, make_routing, make_weights
from static_moe.workspace import WorkspaceSpec

# --------------------------------------------------------------------------------------------------------------
# Size and offset arithmetic
# --------------------------------------------------------------------------------------------------------------
# Run in a child process: before the fix the first call segfaulted, which would have taken pytest down with it.
_OVERFLOW_SCRIPT = textwrap.dedent("""
    import torch, static_moe
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    calls = [
        lambda: static_moe.unpack_rows(packed, 2**63 - 8, 16, torch.uint8, [16]),   # offset + nbytes wraps
        lambda: static_moe.unpack_rows(packed, 8, 2**63 - 1, torch.uint8, [1]),    # so does this one
        lambda: static_moe.unpack_rows(packed, 0, 16, torch.float32, [2**62, 4]),  # prod(row_shape) * 4 wraps
    ]
    for call in calls:
        try:
            call()
            print("accepted")
        except ValueError as e:
            print("ValueError:", e)
""")


def test_unpack_rows_span_overflow_is_an_error_not_a_crash():
    run = subprocess.run([sys.executable, "-c", _OVERFLOW_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died with {run.returncode}: {run.stderr[-2000:]}"
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 3, run.stdout
    assert (
        "span [offset, offset + nbytes) = [9223372036854775800, (overflows int64)) must lie inside the packed "
        "row width W = packed.size(1) = 32" in lines[0]
    )
    assert "must lie inside" in lines[1]
    assert "nbytes must equal prod(row_shape) * itemsize" in lines[2] and "overflows int64" in lines[2]


def test_overflowing_sizes_rejected_by_the_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        packed = torch.empty(4, 32, dtype=torch.uint8)
        with pytest.raises(ValueError, match="must lie inside the packed row width"):
            torch.ops.static_moe.unpack_rows(packed, 2**63 - 8, 16, torch.uint8, [16])
        huge = torch.empty(1, 1, dtype=torch.int32).expand(1, 2**61)  # 2^63 bytes per row (a view: no storage)
        with pytest.raises(ValueError, match=r"parts\[1\] row bytes overflows int64"):
            torch.ops.static_moe.pack_rows([torch.empty(1, 16, dtype=torch.uint8), huge], 4)
        wide = torch.empty(1, 1, dtype=torch.uint8).expand(1, 2**59)
        with pytest.raises(ValueError, match=r"capacity \* W \(bytes of the packed buffer\) overflows int64"):
            torch.ops.static_moe.pack_rows([wide], 2**5)


def test_reference_unpack_rows_checks_the_span():
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must lie inside the packed row width"):
        reference.unpack_rows(packed, 2**63 - 8, 16, torch.uint8, [16])
    with pytest.raises(ValueError, match="nbytes must equal prod"):
        reference.unpack_rows(packed, 0, 16, torch.float32, [2**62, 4])


# --------------------------------------------------------------------------------------------------------------
# Quantizers given NaN / Inf
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_weight_quantizers_reject_non_finite(bad):
    w = torch.randn(3, 64, 256)
    w[2, 17, 200] = bad
    with pytest.raises(
        ValueError,
        match=r"quantize_weight_fp4: w13 holds NaN or Inf in 1 block\(s\); the first is "
        r"block \[d0, n, k/32\] = \[2, 17, 6\]",
    ):
        quantize_weight_fp4(w, name="w13")
    with pytest.raises(
        ValueError,
        match=r"quantize_weight_fp8: w2 holds NaN or Inf in 1 block\(s\); the first is "
        r"block \[d0, n, k/128\] = \[2, 17, 1\]",
    ):
        quantize_weight_fp8(w, name="w2")
    with pytest.raises(ValueError, match=r"quantize_weight_fp8: w holds NaN"):
        quantize_weight(w, "fp8")
    quantize_weight(w, "bf16")  # bf16 is a cast, not a quantization: NaN stays NaN, no error


def test_activation_quantizer_non_finite_semantics():
    """The decision of docs/errors.md: CPU / eager raises; without the check the result is the kernels' bits."""
    x = torch.randn(4, 256)
    x[1, 40] = float("nan")
    x[3, 200] = float("inf")
    with pytest.raises(
        ValueError,
        match=r"quantize_activation: hidden holds NaN or Inf in 2 block\(s\); the first "
        r"is block \[row, group\] = \[1, 1\]",
    ):
        quantize_activation(x, 32, name="hidden")
    q, s = quantize_activation(x, 32, check_finite=False)
    # NaN: the exponent carry of the power-of-two round-up lands in the sign bit -> scale -0.0 (what the C++
    # kernels give too); +Inf: scale +Inf. Neither is a positive finite scale, which forward rejects.
    assert s[1, 1].item() == 0.0 and math.copysign(1.0, s[1, 1].item()) == -1.0
    assert s[3, 6].item() == math.inf
    finite_rows = torch.tensor([0, 2])
    assert torch.isfinite(s[finite_rows]).all() and (s[finite_rows] > 0).all()
    # The swiglu_and_cast kernel agrees with the reference on those bits.
    gu = torch.zeros(2, 256)
    gu[0, 3] = float("nan")
    q_op, s_op = static_moe.swiglu_and_cast(gu, None, None, "fp8", 32, 448.0, True)
    q_ref, s_ref = reference.swiglu_and_cast(gu, None, None, "fp8", 32, 448.0, True)
    assert torch.equal(s_op.view(torch.int32), s_ref.view(torch.int32))
    assert s_op[0, 0].view(torch.int32).item() == -(2**31)  # -0.0


def test_forward_s1_rejects_a_poisoned_activation_scale():
    """S = 1 too: an x_scale that is not positive and finite (here the −0.0 a NaN quantizes to) is an error."""
    w = make_weights(2, 256, 128, "fp8", seed=1)
    x = torch.randn(3, 256)
    x[1, 5] = float("nan")
    x_q, x_s = quantize_activation(x, 128, check_finite=False)
    idx, tw = make_routing(3, 2, 2, seed=2)
    with pytest.raises(ValueError, match=r"forward: x_scale must hold positive finite scales, but x_scale\[1, 0\]"):
        static_moe.forward(
            x_q, x_s, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], num_experts=2, capacity=4
        )


# --------------------------------------------------------------------------------------------------------------
# swiglu_limit and fp8_max: one rule, one error type, one message, everywhere
# --------------------------------------------------------------------------------------------------------------
def _entry_points(limit=None, fp8_max=448.0):
    """Every place that takes swiglu_limit / fp8_max, as callables."""
    gu = torch.randn(3, 256)
    w = make_weights(2, 256, 128, "fp8", seed=3)
    x, xs = make_activations(3, 256, "fp8", group=128, seed=4)
    idx, tw = make_routing(3, 2, 2, seed=5)
    le = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], 0, limit, fp8_max)
    fw = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], None, 2, 4, limit, "", 0, 1, fp8_max)
    spec = dict(
        capacity=4,
        hidden=256,
        intermediate=128,
        num_experts=2,
        topk=2,
        ep_size=1,
        act_format="fp8",
        weight_format="fp8",
    )
    return {
        "op swiglu_and_cast": lambda: static_moe.swiglu_and_cast(gu, None, limit, "fp8", 128, fp8_max, True),
        "reference swiglu_and_cast": lambda: reference.swiglu_and_cast(gu, None, limit, "fp8", 128, fp8_max, True),
        "op local_experts": lambda: torch.ops.static_moe.local_experts(*le),
        "reference local_experts": lambda: reference.local_experts(*le),
        "op forward": lambda: torch.ops.static_moe.forward(*fw),
        "reference forward": lambda: reference.forward(*fw),
        "StaticMoE": lambda: static_moe.StaticMoE(
            256, 128, 2, 2, 4, weight_format="fp8", act_format="fp8", swiglu_limit=limit, fp8_max=fp8_max
        ),
        "WorkspaceSpec": lambda: WorkspaceSpec(**spec, swiglu_limit=limit, fp8_max=fp8_max),
        "quantize_activation": lambda: quantize_activation(gu, 128, fp8_max),
    }


@pytest.mark.parametrize("limit", [1e39, 1e-50, -1.0, float("nan"), float("inf")])
def test_swiglu_limit_one_rule_everywhere(limit):
    rule = "swiglu_limit must be None or a positive finite number, got "
    for name, call in _entry_points(limit=limit).items():
        if name == "quantize_activation":
            continue  # takes no limit
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert rule in msg and "finite and positive in float32" in msg and "3.4028235e+38" in msg, (name, msg)


def test_swiglu_limit_largest_float32_accepted():
    for _name, call in _entry_points(limit=3.4e38).items():
        call()  # no error


@pytest.mark.parametrize("fp8_max", [1.99, 1e-38, 0.0, -1.0, 448.5, float("nan")])
def test_fp8_max_one_rule_everywhere(fp8_max):
    for name, call in _entry_points(fp8_max=fp8_max).items():
        with pytest.raises(ValueError) as info:
            call()
        assert "fp8_max must be in [2, 448]" in str(info.value), (name, str(info.value))


def test_fp8_max_bound_is_where_the_scales_stay_finite():
    """Both sides of the bound: with fp8_max = 2 the largest finite amax still gets a finite power-of-two scale;
    just below, the round-up would reach 2^128 = inf (what fp8_max = 1e-38 did to every group)."""
    assert math.isinf(round_up_pow2(torch.tensor([FLOAT32_MAX / 1.99])).item())
    assert round_up_pow2(torch.tensor([FLOAT32_MAX / 2.0])).item() == 2.0**127
    x = torch.full((2, 128), FLOAT32_MAX)
    x[1] = 1e-30
    q, s = quantize_activation(x, 128, fp8_max=2.0)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= 2.0
    for _name, call in _entry_points(fp8_max=2.0).items():
        call()  # 2 itself is accepted everywhere
