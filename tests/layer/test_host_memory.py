"""static_moe.host_memory: CPU weights in mappings advised for huge pages (the advice moves bytes, never values),
and StaticMoE holding its large CPU weights there through loading, forward and state_dict."""

from __future__ import annotations

import gc
import io

import pytest
import torch

from static_moe import host_memory
from static_moe.module import StaticMoE
from static_moe.testing.generators import make_routing

MIN = host_memory.MIN_ADVISED_BYTES


needs_advice = pytest.mark.skipif(
    not host_memory.advice_available(), reason="no madvise(MADV_HUGEPAGE) here (not Linux, or a kernel without THP)"
)


def test_small_tensors_come_from_torch():
    t = host_memory.zeros((MIN // 2 - 1,), torch.uint8)
    assert t.dtype == torch.uint8 and t.shape == (MIN // 2 - 1,) and not t.any()
    assert not host_memory.is_advised(t)


def test_plain_memory_is_not_reported_advised():
    assert not host_memory.is_advised(torch.zeros(MIN, dtype=torch.uint8))


@needs_advice
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float32])
def test_large_cpu_tensors_are_advised_zeros(dtype):
    shape = (4, MIN // (4 * dtype.itemsize))
    t = host_memory.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert host_memory.is_advised(t)
    assert not t.view(torch.uint8).any()
    t.view(torch.uint8)[-1, -1] = 7  # writable to the last byte
    assert int(t.view(torch.uint8).sum()) == 7


@needs_advice
def test_the_tensor_keeps_its_mapping_alive():
    t = host_memory.zeros((MIN,), torch.uint8)
    t[::4096] = 1
    gc.collect()
    assert int(t.sum()) == MIN // 4096
    assert host_memory.is_advised(t[MIN // 2 :])


def _layer(h=2048, i=256, e=8, k=2):
    return StaticMoE(h, i, e, k, 4, weight_format="bf16")


@needs_advice
def test_static_moe_weights_are_advised_through_loading_and_forward(monkeypatch):
    h, i, e, k = 2048, 256, 8, 2
    moe = _layer(h, i, e, k)
    assert moe.w13.numel() * 2 >= MIN and host_memory.is_advised(moe.w13) and host_memory.is_advised(moe.w2)
    where = moe.w13.data_ptr(), moe.w2.data_ptr()
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).bfloat16()
    moe.set_expert_weights(w13, None, w2, None)
    assert (moe.w13.data_ptr(), moe.w2.data_ptr()) == where  # loaded in place: still in the advised mapping
    x = torch.randn(3, h, generator=g).bfloat16()
    ids, wts = make_routing(3, k, e, seed=3)
    out = moe(x, ids, wts)

    # The same layer in torch's memory: the same bits.
    monkeypatch.setattr(host_memory, "MIN_ADVISED_BYTES", 1 << 62)
    plain = _layer(h, i, e, k)
    assert not host_memory.is_advised(plain.w13)
    plain.set_expert_weights(w13, None, w2, None)
    assert torch.equal(plain(x, ids, wts), out)

    # state_dict round trip through torch.save into a fresh advised layer.
    buf = io.BytesIO()
    torch.save(moe.state_dict(), buf)
    monkeypatch.undo()
    again = _layer(h, i, e, k)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert host_memory.is_advised(again.w13) and torch.equal(again(x, ids, wts), out)
    for m in (moe, plain, again):
        m.close()
