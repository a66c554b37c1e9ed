"""swiglu_and_cast's contract for non-finite inputs (SPEC §1.5) on the CUDA kernel's row code, run on the CPU by
the emulator of tests/cuda/host (see test_cuda_host.py): a NaN / inf v dequantizes to NaN, the rest of its group
to NaN or ±0, every other group bitwise as without it — the same check as the CPU, reference and NKI tests."""

from __future__ import annotations

import pytest
import torch

from static_moe.reference.swiglu_and_cast import swiglu
from static_moe.testing.cuda_emulation import fromfile, run, tofile, write_meta
from static_moe.testing.generators import poisoned_swiglu_input
from static_moe.testing.numeric import assert_nonfinite_confined
from static_moe.testing.toolchain import find_nvcc

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH)")

NONFINITE = [
    ("gate", float("nan")),
    ("up", float("nan")),
    ("weight", float("nan")),
    ("gate", -float("inf")),
    ("gate", float("inf")),
    ("up", float("inf")),
]


def _swiglu(emulator, d, gu, w, limit, out_format, group, pow2):
    rows, inter = gu.shape[0], gu.shape[1] // 2
    write_meta(
        d,
        rows=rows,
        inter=inter,
        out_fp8=int(out_format == "fp8"),
        has_limit=int(limit is not None),
        limit=limit or 0.0,
        has_weight=1,
        pow2=int(pow2),
        group=group,
        fp8_max=448.0,
    )
    tofile(d, "gate_up.bin", gu)
    tofile(d, "weight.bin", w)
    run(emulator, "swiglu", d)
    if out_format == "fp8":
        return (
            fromfile(d, "q.bin", torch.float8_e4m3fn, (rows, inter)),
            fromfile(d, "s.bin", torch.float32, (rows, inter // group)),
        )
    return fromfile(d, "q.bin", torch.bfloat16, (rows, inter)), torch.empty(rows, 0)


@pytest.mark.parametrize("where,value", NONFINITE, ids=[f"{w}={v}" for w, v in NONFINITE])
def test_nonfinite_values_stay_in_their_group(emulator, tmp_path, where, value):  # noqa: F811
    bad_gu, bad_w, gu, w = poisoned_swiglu_input(where, value)
    for limit in (None, 7.0):
        nonfinite = ~torch.isfinite(swiglu(bad_gu, bad_w, limit))
        touched = swiglu(bad_gu, bad_w, limit) != swiglu(gu, w, limit)
        for out_format, group, pow2 in (("fp8", 32, True), ("fp8", 128, False), ("bf16", 128, True)):
            args = (limit, out_format, group, pow2)
            assert_nonfinite_confined(
                _swiglu(emulator, tmp_path, bad_gu, bad_w, *args),
                _swiglu(emulator, tmp_path, gu, w, *args),
                touched,
                nonfinite,
                f"cuda {where}={value} limit={limit} {out_format} g={group} pow2={pow2}",
            )
