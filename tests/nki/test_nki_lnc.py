"""LNC = 2 for pack_rows, unpack_rows, swiglu_and_cast and expert_gemm (nki_kernels/lnc.py): each kernel launched
as ``kernel[1]`` and ``kernel[2]`` through the interpreter gives the same bits, equal to the reference, on
shapes whose extents split evenly, oddly, or not at all (one tile: core 1 idles).

The interpreter runs the two logical cores as two threads over the same HBM, each with its own cost record, so
the split itself is checked too: where the work splits both cores move bytes (and run matmuls), where it does
not core 1 moves nothing, and the cores' HBM bytes add up to the single core's (expert_gemm: plus the second
core's read of the activations) — no row, weight slab or output column moves twice. The
``local_experts`` split has its own test in test_nki_local_experts.py; the dispatch at the platform LNC is
checked here for all five kernels, and ``forward`` on the ``neuron`` test device in test_nki_neuron_device.py.
"""

from __future__ import annotations

import pytest
import torch

import nki_interpreter as interpreter
from static_moe import layouts, reference
from static_moe.formats import quantize_weight
from static_moe.nki import dispatch, shim
from static_moe.nki_kernels.expert_gemm import expert_gemm_kernel
from static_moe.nki_kernels.lnc import split
from static_moe.nki_kernels.pack_rows import pack_rows, unpack_rows
from static_moe.nki_kernels.swiglu_and_cast import swiglu_and_cast
from static_moe.reference.pack_rows import pack_layout, part_nbytes
from static_moe.testing.generators import as_padding, make_activations
from static_moe.testing.numeric import assert_equal, assert_gemm_bitwise, assert_swiglu_close

pytestmark = pytest.mark.skipif(
    shim.real_nki_available(), reason="reads the interpreter's per-core cost records and target switch"
)

TRN2_FP8_MAX = 240.0
P = 128


def _at_lnc(kernel, lnc: int, *args, target: str = "trn2", **kw):
    """``(result, per-core cost records)`` of ``kernel[lnc](*args, **kw)`` through the interpreter."""
    with interpreter.target(target):
        out = interpreter.jit(kernel)[lnc](*args, **kw)
        return out, interpreter.last_run().programs


def _both(kernel, *args, target: str = "trn2", **kw):
    """The kernel at LNC = 1 and 2: returns ``(LNC = 1 result, LNC = 2 result, its two cost records, the LNC = 1
    cost record)``, after asserting the two results are the same bits."""
    one, (rec1,) = _at_lnc(kernel, 1, *args, target=target, **kw)
    two, cores = _at_lnc(kernel, 2, *args, target=target, **kw)
    assert len(cores) == 2
    ones = one if isinstance(one, (tuple, list)) else (one,)
    twos = two if isinstance(two, (tuple, list)) else (two,)
    for i, (a, b) in enumerate(zip(ones, twos)):
        assert_equal(torch.as_tensor(b), torch.as_tensor(a), f"{kernel.__name__} output {i}: LNC = 2 vs LNC = 1")
    return one, two, cores, rec1


def _assert_split_hbm(cores, rec1, both_busy: bool, what: str):
    """Disjoint shares: the cores' HBM bytes add up to the single core's; both move bytes iff the work splits."""
    assert sum(c.hbm_bytes for c in cores) == rec1.hbm_bytes, f"{what}: HBM bytes moved twice or lost"
    assert cores[0].hbm_bytes > 0 and (cores[1].hbm_bytes > 0) == both_busy, (
        f"{what}: per-core HBM bytes {[c.hbm_bytes for c in cores]}, core 1 busy expected {both_busy}"
    )


# ------------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("extent,tile", [(0, 1), (1, 1), (1, 128), (128, 128), (129, 128), (300, 128), (7, 2)])
def test_split_is_disjoint_covering_and_front_loaded(extent, tile):
    assert split(extent, tile, 1, 0) == (0, extent)
    (s0, n0), (s1, n1) = split(extent, tile, 2, 0), split(extent, tile, 2, 1)
    tiles = -(-extent // tile)
    assert s0 == 0 and s1 == s0 + n0 and s1 + n1 == extent, "the two shares tile [0, extent) in order"
    assert n0 == min(extent, -(-tiles // 2) * tile), "core 0 takes ⌈tiles / 2⌉ whole tiles"
    assert s1 % tile == 0 or n1 == 0


# ------------------------------------------------------------------------------------------ pack / unpack
# (valid rows T, capacity C): one tile (core 1 idles); two tiles, the second all padding; three (odd split)
PACK_CASES = [(1, 1), (5, 130), (130, 300), (256, 256)]


@pytest.mark.parametrize("rows,capacity", PACK_CASES, ids=[f"T{t}-C{c}" for t, c in PACK_CASES])
def test_pack_and_unpack_rows_lnc2_bitwise(rows, capacity):
    g = torch.Generator().manual_seed(rows + capacity)
    parts = (
        (torch.randn(rows, 40, generator=g) * 4).to(torch.float8_e4m3fn),
        torch.rand(rows, 3, generator=g),
        torch.randint(-1, 1000, (rows, 6), generator=g, dtype=torch.int32),
    )
    packed, _, cores, rec1 = _both(pack_rows, parts, capacity)
    assert_equal(torch.as_tensor(packed), reference.pack_rows(list(parts), capacity), "pack_rows vs reference")
    _assert_split_hbm(cores, rec1, capacity > P, f"pack_rows T={rows} C={capacity}")

    packed = torch.as_tensor(packed)
    spans, _ = pack_layout([part_nbytes(p) for p in parts])
    for p, (off, n) in zip(parts, spans):
        out, _, cores, rec1 = _both(unpack_rows, packed, off, n, shim.nl_dtype(p.dtype), tuple(p.shape[1:]))
        assert_equal(torch.as_tensor(out), reference.unpack_rows(packed, off, n, p.dtype, list(p.shape[1:])))
        _assert_split_hbm(cores, rec1, capacity > 1, f"unpack_rows R={capacity} span {off}")


def test_profile_reports_the_whole_launch_at_lnc2():
    """interpreter.profile of kernel[2]: HBM bytes, DMAs and instructions are both cores' (here those of the
    single-core run, the shares being disjoint), and the roofline moves them at two cores' HBM share."""
    parts = (torch.arange(300 * 64, dtype=torch.int32).reshape(300, 64),)
    with interpreter.target("trn2"):
        _, one = interpreter.profile(interpreter.jit(pack_rows)[1], parts, 384)
        _, two = interpreter.profile(interpreter.jit(pack_rows)[2], parts, 384)
    assert two["programs"] == 2 and one["programs"] == 1
    assert (two["hbm_bytes"], two["dma_count"]) == (one["hbm_bytes"], one["dma_count"]) and one["hbm_bytes"] > 0
    assert two["instructions"] == one["instructions"]
    assert two["hbm_roofline_s"] == pytest.approx(one["hbm_roofline_s"] / 2)


# ----------------------------------------------------------------------------------------------- swiglu
# (R, I, out format, group, activation): one tile, two partitions per row (core 1 idles); two tiles; three (odd
# split); two. Several partitions per row only ever come with one tile (the layout keeps ⌈R / 128⌉ tiles)
SWIGLU_CASES = [
    (1, 256, "fp8", 128, "silu"),
    (130, 128, "fp8", 32, "silu"),
    (300, 256, "bf16", 128, "swiglu_oai"),
    (200, 384, "fp8", 128, "gelu_tanh"),
]


@pytest.mark.parametrize("rows,inter,fmt,group,activation", SWIGLU_CASES, ids=[str(c) for c in SWIGLU_CASES])
def test_swiglu_and_cast_lnc2_bitwise(rows, inter, fmt, group, activation):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(torch.bfloat16)
    w = torch.rand(rows, generator=g)
    kw = dict(swiglu_limit=7.0, out_format=fmt, group_size=group, fp8_max=TRN2_FP8_MAX, activation=activation)
    _, two, cores, rec1 = _both(swiglu_and_cast, gate_up, w, **kw)
    ref = reference.swiglu_and_cast(gate_up, w, 7.0, fmt, group, TRN2_FP8_MAX, True, activation)
    got = (two, torch.empty(rows, 0)) if fmt == "bf16" else tuple(two)
    assert_swiglu_close(tuple(torch.as_tensor(t) for t in got), ref, f"swiglu {fmt} {activation} LNC = 2")
    _assert_split_hbm(cores, rec1, rows > P, f"swiglu R={rows} I={inter}")


# ------------------------------------------------------------------------------------------ expert_gemm
def _gemm_inputs(rows, k, n, act, wfmt, seed, num_local=2):
    g = torch.Generator().manual_seed(seed)
    b, b_s = quantize_weight(torch.randn(num_local, n, k, generator=g) / k**0.5, wfmt)
    a, a_s = make_activations(rows, k, act, group=128, seed=seed + 1, scale=2.0)
    mask = torch.rand(rows, generator=g) < 0.6
    mask[0] = True
    a, a_s = as_padding(a, a_s, ~mask)
    return a, a_s, b, b_s, mask


# (layout, target, act, weight, R, K, N, slabs): EOI groups of one 128-row block at K = 1024 bf16 / fp8 — three
# (odd split) or one (core 1 idles); EIO slabs: fp4 (decode bound, 512 columns) three, trn3 MX fp8 two
GEMM_CASES = [
    ("eoi", "trn2", "bf16", "bf16", 5, 1024, 384, 3),
    ("eoi", "trn2", "fp8", "fp8", 9, 1024, 384, 3),
    ("eoi", "trn2", "bf16", "bf16", 5, 1024, 128, 1),
    ("eio", "trn2", "bf16", "fp4", 3, 512, 1536, 3),
    ("eio", "trn2", "fp8", "fp4", 9, 512, 1536, 3),
    ("eio", "trn3", "fp8", "fp8", 6, 4096, 1024, 2),
]


@pytest.mark.parametrize("skip", [True, False], ids=["runtime", "static"])
@pytest.mark.parametrize("layout,target,act,wfmt,rows,k,n,slabs", GEMM_CASES, ids=[str(c[:7]) for c in GEMM_CASES])
def test_expert_gemm_lnc2_bitwise(layout, target, act, wfmt, rows, k, n, slabs, skip):
    a, a_s, b, b_s, mask = _gemm_inputs(rows, k, n, act, wfmt, seed=rows + k + n, num_local=2 if k < 4096 else 1)
    e = b.shape[0] - 1
    if layout == "eio":
        b, b_s, lay = layouts.prepare_weight(b, b_s, target)
        assert lay == "eio"
    args = dispatch.expert_gemm_args(a, a_s, b, b_s, mask, e)
    _, two, cores, rec1 = _both(expert_gemm_kernel, *args, target=target, skip_unrouted=skip, weight_layout=layout)
    ref = reference.expert_gemm(a, a_s, b, b_s, mask, e, weight_layout=layout)
    assert_gemm_bitwise(torch.as_tensor(two), ref, f"expert_gemm {layout} {target} {act}x{wfmt} LNC = 2")
    # both cores read the activation side (A, its scales — twice on the MX path: operand and pow2 check — and the
    # row mask); a weight slab (≥ 64 KiB at these shapes) or an output column moved twice would exceed that
    act_bytes = a.numel() * a.element_size() + (0 if a_s is None else 2 * a_s.numel() * 4) + rows
    extra = sum(c.hbm_bytes for c in cores) - rec1.hbm_bytes
    assert 0 <= extra <= (act_bytes if slabs > 1 else 0), f"LNC = 2 moved {extra} HBM bytes more than one core"
    assert (cores[1].matmul_flops > 0) == (slabs > 1), f"core 1 runs matmuls iff there are {slabs} > 1 slabs"


# ---------------------------------------------------------------------------------------------- dispatch
def _dispatch_calls():
    """One call of each of the four ops through ``static_moe.nki.dispatch`` on CPU tensors, with shapes whose
    work splits over two cores (two row tiles; three EOI weight groups)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (200, 2), generator=g, dtype=torch.int32)
    packed = dispatch.pack_rows([x, ids], 256)
    gate_up = (torch.randn(200, 256, generator=g) * 3).to(torch.bfloat16)
    a, a_s, b, b_s, mask = _gemm_inputs(5, 1024, 384, "bf16", "bf16", seed=12)
    return {
        "pack_rows": lambda: dispatch.pack_rows([x, ids], 256),
        "unpack_rows": lambda: dispatch.unpack_rows(packed, 128, 8, torch.int32, [2]),
        "swiglu_and_cast": lambda: dispatch.swiglu_and_cast(gate_up, None, 7.0, "fp8", 128, TRN2_FP8_MAX),
        "expert_gemm": lambda: dispatch.expert_gemm(a, a_s, b, b_s, mask, 1),
    }


def test_dispatch_launches_every_kernel_at_the_platform_lnc(monkeypatch):
    """``dispatch._LNC_KERNELS`` holds all five kernels: each op launches at ``platform_lnc()`` (2 on the
    interpreter's trn2 by default, ``NEURON_LOGICAL_NC_CONFIG`` when set) and gives the same bits at 1 and 2."""
    assert set(dispatch._LNC_KERNELS) == {"pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts"}
    results = {}
    for lnc in (None, "1"):
        if lnc is None:
            monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
        else:
            monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
        want = dispatch.platform_lnc()
        assert want == (2 if lnc is None else 1)
        for name, call in _dispatch_calls().items():
            out = call()
            assert len(interpreter.last_run().programs) == want, f"{name} launched at LNC != {want}"
            results.setdefault(name, []).append(out)
    for name, (two, one) in results.items():
        for i, (t, o) in enumerate(zip(*(r if isinstance(r, tuple) else (r,) for r in (two, one)))):
            assert_equal(t, o, f"dispatch {name} output {i}: LNC = 2 vs 1")
