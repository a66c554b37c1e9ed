"""The six ops on a ``neuron`` device: the Neuron dispatch of static_moe.nki.dispatch, end to end.

tools/neuron_test_device.py makes PyTorch's PrivateUse1 backend a ``neuron`` device on CPU memory and registers
the ops' Neuron implementations for it, exactly as ``register_neuron_kernels`` does for a Trainium device; the
kernels then run through the shim's ``jit`` (the interpreter here). So ``torch.ops.static_moe.*`` on ``neuron``
tensors runs the dispatch code a Trainium user runs, and ``forward`` at S = 1 runs pack → unpack → local_experts
through the NKI kernels. S > 1 is not routable here: gloo reads host storage, which the wrapper device lacks
(docs/backends/nki.md).
"""

from __future__ import annotations

import pytest
import torch

from static_moe import reference
from static_moe.nki import dispatch, shim
from static_moe.testing.generators import make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_gemm_close

pytestmark = pytest.mark.skipif(shim.real_nki_available(), reason="the test device launches through the interpreter")

# The interpreter gives the reference's bits but for rare last-bit differences (test_nki_local_experts.py).
assert_kernel_close = assert_gemm_close if shim.real_nki_available() else assert_gemm_bitwise
OPS = ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts", "forward")
H, I, E, K, C = 128, 128, 4, 2, 4
TRN2_FP8_MAX = 240.0


@pytest.fixture(scope="module")
def neuron():
    import neuron_test_device

    return neuron_test_device


def _to(dev, t):
    return dev.to_device(t)


def test_all_six_ops_have_neuron_kernels(neuron):
    """Each op has a kernel of its own for PrivateUse1 (not the CompositeExplicitAutograd fallback that refuses
    other devices), and the XLA key gets the same six."""
    neuron.install()
    assert dispatch.register_neuron_kernels(keys=["XLA"]) == ["PrivateUse1", "XLA"]
    for op in OPS:
        for key in ("PrivateUse1", "XLA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"static_moe::{op}", key), (op, key)
    with pytest.raises(ValueError, match="keys"):
        dispatch.register_neuron_kernels(keys=["CUDA"])


def test_tensors_live_on_neuron(neuron):
    dev = neuron.install()
    a = _to(neuron, torch.arange(6.0).reshape(2, 3))
    b = (a[1:] + 1).to(torch.bfloat16)
    assert a.device == b.device == dev and b.device.type == "neuron"
    assert torch.empty(3, device=dev).device == dev
    assert_equal(b.cpu(), torch.tensor([[4.0, 5.0, 6.0]], dtype=torch.bfloat16))


def test_pack_unpack_swiglu_on_neuron_match_cpu(neuron):
    """pack_rows / unpack_rows (bitwise, int64 and T = 0 included) and swiglu_and_cast (both formats) through the
    Neuron kernels equal the CPU kernels."""
    neuron.install()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (3, 2), generator=g, dtype=torch.int64)
    w = torch.rand(3, 2, generator=g)
    for parts in ([x, ids, w], [x[:0], ids[:0], w[:0]]):
        cpu = torch.ops.static_moe.pack_rows(parts, 5)
        dev = torch.ops.static_moe.pack_rows([_to(neuron, p) for p in parts], 5)
        assert dev.device.type == "neuron"
        assert_equal(dev.cpu(), cpu, f"pack_rows T={parts[0].shape[0]}")
    packed = torch.ops.static_moe.pack_rows([x, ids, w], 5)
    for off, n, dt, shape in ((0, 80, torch.bfloat16, [40]), (80, 16, torch.int64, [2]), (96, 8, torch.float32, [2])):
        cpu = torch.ops.static_moe.unpack_rows(packed, off, n, dt, shape)
        dev = torch.ops.static_moe.unpack_rows(_to(neuron, packed), off, n, dt, shape)
        assert dev.device.type == "neuron" and dev.dtype == dt
        assert_equal(dev.cpu(), cpu, f"unpack_rows {dt}")
    gate_up = (torch.randn(5, 2 * I, generator=g) * 3).to(torch.bfloat16)
    rw = torch.rand(5, generator=g)
    for fmt in ("fp8", "bf16"):
        cpu = torch.ops.static_moe.swiglu_and_cast(gate_up, rw, 7.0, fmt, 128, TRN2_FP8_MAX, True)
        dev = torch.ops.static_moe.swiglu_and_cast(
            _to(neuron, gate_up), _to(neuron, rw), 7.0, fmt, 128, TRN2_FP8_MAX, True
        )
        assert [t.shape for t in dev] == [t.shape for t in cpu] and dev[0].device.type == "neuron"
        ref = reference.swiglu_and_cast(gate_up, rw, 7.0, fmt, 128, TRN2_FP8_MAX, True)
        if fmt == "bf16":  # hardware silu is a table: the SPEC §2 tolerance, as in test_nki_swiglu_and_cast.py
            assert_gemm_close(dev[0].cpu().float(), ref[0].float(), "swiglu bf16")
        else:
            assert_equal(dev[1].cpu(), ref[1], "swiglu fp8 scales")
    with pytest.raises(ValueError, match="fp8_max"):
        torch.ops.static_moe.swiglu_and_cast(_to(neuron, gate_up), None, None, "fp8", 128, 448.0, True)


@pytest.mark.parametrize("lnc", [1, 2], ids=["lnc1", "lnc2"])
@pytest.mark.parametrize("act,wfmt", [("bf16", "bf16"), ("fp8", "fp8")])
def test_forward_on_neuron_s1(neuron, act, wfmt, lnc, monkeypatch):
    """``torch.ops.static_moe.forward`` at S = 1 on neuron tensors: pack_rows, unpack_rows and local_experts run
    through their NKI kernels (each is seen on the device), every one launched at the platform LNC (set through
    ``NEURON_LOGICAL_NC_CONFIG``, which ``dispatch.platform_lnc`` reads), and the result matches the reference."""
    import nki_interpreter

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    neuron.install()
    t = 3
    w = make_weights(E, H, I, wfmt, seed=7)
    x, xs = make_activations(t, H, act, group=128, seed=8, scale=2.0)
    idx, tw = make_routing(t, K, E, seed=9)
    shared = torch.randn(t, H, generator=torch.Generator().manual_seed(10))
    args = (x, xs, idx, tw, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], shared, E, C, 7.0, "", 0, 1)
    ref = reference.forward(*args, TRN2_FP8_MAX)
    seen = []
    launch = dispatch._launch

    def spy(name, kargs, device, **flags):
        out = launch(name, kargs, device, **flags)
        seen.append((name, device, len(nki_interpreter.last_run().programs)))
        return out

    dargs = tuple(_to(neuron, a) for a in args)
    try:
        dispatch._launch = spy
        out = torch.ops.static_moe.forward(*dargs, TRN2_FP8_MAX)
    finally:
        dispatch._launch = launch
    assert out.device.type == "neuron" and out.dtype == torch.bfloat16 and out.shape == (t, H)
    assert {n for n, _, _ in seen} == {"pack_rows", "unpack_rows", "local_experts"} and all(d for _, d, _ in seen)
    assert all(cores == lnc for _, _, cores in seen), f"launched at {seen}, LNC = {lnc} wanted"
    assert_kernel_close(out.cpu(), ref, f"forward on neuron {act}x{wfmt}")
