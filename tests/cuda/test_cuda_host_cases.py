"""The shared edge cases (static_moe.testing.cases) on the CPU emulation of the CUDA per-thread code
(tests/cuda/host/emulate.cu), against the reference at the SPEC §2 tolerances and the cases' exact results: the
same inputs the CPU kernels and the NKI kernels get, so a change in how the CUDA path orders a row's expert
sum, reads a block's first element or decodes an extreme UE8M0 byte shows here too. Small cases only (the
emulator runs every thread of every block one after the other)."""

from __future__ import annotations

import pytest
import torch

from static_moe import formats, reference
from static_moe.testing import cases
from static_moe.testing.cuda_emulation import fromfile, run, tofile, write_meta
from static_moe.testing.generators import FORMAT_PAIRS
from static_moe.testing.numeric import assert_equal, assert_gemm_close, assert_swiglu_close
from static_moe.testing.toolchain import find_nvcc

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")

WFMT = {"bf16": 0, "fp8": 1, "fp4": 2}
# (act, weight, group, fp8_mma): fp8 activations on both MMA paths (e4m3 mma.sync, or decoded to bf16)
CONFIGS = [
    (a, w, g, m)
    for a, w in FORMAT_PAIRS
    for g in ((128, 32) if a == "fp8" else (0,))
    for m in ((True, False) if a == "fp8" else (False,))
]
IDS = [f"{a}x{w}-g{g}-{'e4m3mma' if m else 'bf16mma'}" for a, w, g, m in CONFIGS]


def _bytes(t):
    return None if t is None else formats.as_uint8(t) if t.element_size() == 1 else t


def _gemm(emulator, d, c, wf, group, fp8_mma):
    a, a_s, b, b_s, mask, e = c.args
    rows, k = a.shape
    write_meta(
        d, rows=rows, k=k, n=b.shape[1], experts=b.shape[0], expert=e, group=group, wfmt=WFMT[wf], fp8_mma=int(fp8_mma)
    )
    for name, t in (("a", a), ("a_scale", a_s), ("b", b), ("b_scale", b_s), ("mask", mask.to(torch.uint8))):
        tofile(d, f"{name}.bin", _bytes(t))
    run(emulator, "gemm", d)
    return fromfile(d, "d.bin", torch.bfloat16, (rows, b.shape[1]))


@pytest.mark.parametrize("act,wf,group,fp8_mma", CONFIGS, ids=IDS)
def test_expert_gemm_cases(emulator, tmp_path, act, wf, group, fp8_mma):
    for c in cases.select(cases.expert_gemm_cases(act, wf, group or 128), cases.SMALL):
        out = _gemm(emulator, tmp_path, c, wf, group, fp8_mma)
        mask = c.args[4]
        assert_gemm_close(out, reference.expert_gemm(*c.args), f"{act}x{wf} g{group} {c.id}")
        assert_equal(out[~mask], torch.zeros_like(out[~mask]), f"{c.id}: masked rows are exact zeros")


@pytest.mark.parametrize(
    "out_format,group,pow2",
    [
        ("fp8", 128, True),
        ("fp8", 32, False),
        ("bf16", 128, True),
    ],
)
def test_swiglu_cases(emulator, tmp_path, out_format, group, pow2):
    for c in cases.swiglu_cases(out_format, group, pow2=pow2):
        gu, w, limit, _, _, fp8_max, _ = c.args
        rows, inter = gu.shape[0], gu.shape[1] // 2
        write_meta(
            tmp_path,
            rows=rows,
            inter=inter,
            out_fp8=int(out_format == "fp8"),
            has_limit=int(limit is not None),
            limit=limit or 0.0,
            has_weight=1,
            pow2=int(pow2),
            group=group,
            fp8_max=fp8_max,
        )
        tofile(tmp_path, "gate_up.bin", gu.float())
        tofile(tmp_path, "weight.bin", w.float())
        run(emulator, "swiglu", tmp_path)
        if out_format == "fp8":
            q = fromfile(tmp_path, "q.bin", torch.float8_e4m3fn, (rows, inter))
            s = fromfile(tmp_path, "s.bin", torch.float32, (rows, inter // group))
        else:
            q, s = fromfile(tmp_path, "q.bin", torch.bfloat16, (rows, inter)), torch.empty(rows, 0)
        ref = reference.swiglu_and_cast(*c.args)
        # float scales: the emulator's expf sigmoid is not torch's (whose bits change with the tensor's length),
        # so the SPEC §6.2 bound; power-of-two scales bitwise
        assert_swiglu_close((q, s), ref, f"{out_format} g{group} {c.id}", float_scales=not pow2)


LE_CONFIGS = [c for c in CONFIGS if c[3] or c[0] == "bf16"] + [("fp8", "fp4", 128, False)]


@pytest.mark.parametrize(
    "act,wf,group,fp8_mma",
    LE_CONFIGS,
    ids=[f"{a}x{w}-g{g}-{'e4m3mma' if m else 'bf16mma'}" for a, w, g, m in LE_CONFIGS],
)
def test_local_experts_cases(emulator, tmp_path, act, wf, group, fp8_mma):
    for c in cases.local_experts_cases(act, wf, group or 128):
        x, x_s, idx, wts, w13, w13_s, w2, w2_s, offset, limit, fp8_max = c.args
        rows, hidden = x.shape
        write_meta(
            tmp_path,
            rows=rows,
            topk=idx.shape[1],
            offset=offset,
            num_local=w13.shape[0],
            hidden=hidden,
            inter=w13.shape[1] // 2,  # w2 [L, H, I] holds I / 2 bytes per row for fp4
            group=group,
            wfmt=WFMT[wf],
            idx_int64=int(idx.dtype == torch.int64),
            weights_bf16=int(wts.dtype == torch.bfloat16),
            has_limit=int(limit is not None),
            limit=limit or 0.0,
            fp8_max=fp8_max,
            fp8_mma=int(fp8_mma),
        )
        for name, t in (("x", x), ("x_scale", x_s), ("idx", idx), ("weights", wts)):
            tofile(tmp_path, f"{name}.bin", t)
        for name, t in (("w13", w13), ("w13_scale", w13_s), ("w2", w2), ("w2_scale", w2_s)):
            tofile(tmp_path, f"{name}.bin", _bytes(t))
        run(emulator, "local_experts", tmp_path)
        out = fromfile(tmp_path, "out.bin", torch.float32, (rows, hidden))
        what = f"{act}x{wf} g{group} {c.id}"
        if c.exact is not None:
            assert_equal(out, c.exact, what)
        else:
            assert_gemm_close(out, reference.local_experts(*c.args), what)
