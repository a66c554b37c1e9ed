"""``torch.library.opcheck`` on every op of the library, from one table of sample inputs per op and device
(the pattern of PyTorch's custom-op tutorial: ``sample_inputs(device)`` + one check over all of them).

opcheck runs the op's schema check (inputs not mutated, outputs not aliased), its autograd registration, its fake
kernel against the real one, and AOT dispatch with dynamic shapes. The per-op test files hold the numerics; this
file holds the registration contract, for all seven ops at once, on every device this machine has.
"""

from __future__ import annotations

import pytest
import torch

import static_moe  # noqa: F401  (registers the ops)
from static_moe.testing.generators import make_activations, make_routing, make_weights

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sample_inputs(device: str) -> list[tuple[str, str, tuple]]:
    """(op name, case id, positional args) for every op: bf16 and fp8 activations, fp8 and fp4 weights, an empty
    batch, empty routing slots."""
    w8 = {k: v.to(device) for k, v in make_weights(2, 128, 128, "fp8", seed=1).items()}
    w4 = {k: v.to(device) for k, v in make_weights(2, 256, 128, "fp4", seed=2).items()}
    x8, x8_s = make_activations(5, 128, "fp8", 128, seed=3, device=device)
    xb, _ = make_activations(3, 256, "bf16", seed=4, device=device)
    idx, tw = make_routing(5, 2, 2, seed=5, empty_frac=0.2, device=device)
    idx3, tw3 = make_routing(3, 2, 2, seed=6, device=device)
    gate_up = torch.randn(4, 256, device=device)
    row_w = torch.rand(4, device=device)
    mask = torch.tensor([True, False, True, True, False], device=device)
    ints = torch.arange(15, dtype=torch.int32, device=device).reshape(5, 3)
    packed = torch.ops.static_moe.pack_rows([xb, ints[:3]], 4)

    def experts(x, x_s, i, t, w, *rest):
        return (x, x_s, i, t, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], *rest)

    return (
        [
            ("pack_rows", "bf16_and_int32", ([xb, ints[:3]], 4)),
            ("pack_rows", "empty_batch", ([ints[:0]], 2)),
            ("unpack_rows", "bf16", (packed[:3], 0, 512, torch.bfloat16, [256])),  # real rows: padding is NaN
            ("unpack_rows", "int32_rows", (packed, 512, 12, torch.int32, [3])),
            ("swiglu_and_cast", "fp8_out", (gate_up, row_w, 7.0)),
            ("swiglu_and_cast", "bf16_out", (gate_up.to(torch.bfloat16), None, None, "bf16")),
            ("expert_gemm", "fp8xfp8", (x8, x8_s, w8["w13"], w8["w13_scale"], mask, 1)),
            ("expert_gemm", "bf16xfp4", (xb, None, w4["w13"], w4["w13_scale"], mask[:3], 0)),
            ("local_experts", "fp8xfp8", experts(x8, x8_s, idx, tw, w8, 0, 7.0)),
            ("local_experts", "bf16xfp4", experts(xb, None, idx3, tw3, w4, 0, None)),
            ("forward", "fp8xfp8_s1", experts(x8, x8_s, idx, tw, w8, None, 2, 8, None, "", 0, 1)),
            ("forward", "bf16xfp4_s1", experts(xb, None, idx3, tw3, w4, None, 2, 4, 7.0, "", 0, 1)),
        ]
        + (
            [  # quantize_weight has a CPU kernel only (weights are quantized once, on load)
                ("quantize_weight", "bf16_to_fp8", (xb.reshape(3, 2, 128), "fp8")),
                ("quantize_weight", "fp32_to_fp4", (gate_up.reshape(2, 2, 256), "fp4")),
            ]
            if device == "cpu"
            else []
        )
    )


def _cases():
    for device in DEVICES:
        for name, case, args in sample_inputs(device):
            yield pytest.param(name, args, id=f"{name}-{case}-{device}")


def test_every_op_has_samples():
    assert {name for name, _, _ in sample_inputs("cpu")} == {
        "pack_rows",
        "unpack_rows",
        "swiglu_and_cast",
        "expert_gemm",
        "local_experts",
        "forward",
        "quantize_weight",
    }


@pytest.mark.parametrize("name, args", list(_cases()))
def test_opcheck(name, args):
    utils = ALL_UTILS
    flat = [a for x in args for a in (x if isinstance(x, list) else [x])]
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in flat):
        # torch's schema checker compares inputs with allclose, which float8 lacks on the CPU; the other checks
        # run, and each op's test_rejects / inputs-unchanged tests cover mutation.
        utils = utils[1:]
    torch.library.opcheck(getattr(torch.ops.static_moe, name).default, args, test_utils=utils)
