"""The interpreter's cost model: each constant against the architecture guides' figure, the overlapped estimate
vs the serial bound, and the binding engine. Model numbers only — no timing of this machine.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import TRN2, simulate
from nki_interpreter import isa as nisa
from nki_interpreter import language as nl

F32 = np.float32


def cycles(kernel, *args, engine="vector"):
    simulate(kernel)(*args)
    return interpreter.last_run().cost.instr_cycles[engine]


def sbuf(shape, dtype=nl.float32, fill=1.0):
    t = nl.ndarray(shape, dtype, buffer=nl.sbuf)
    nisa.memset(t, fill)
    return t


def test_two_input_tensor_tensor_costs_2n_one_input_n():
    """TA2 Vector Engine cost model: ~N cycles for one input tile, ~2N for two (example: tensor_tensor)."""
    n = 1024

    def tt(x):
        a, b, d = sbuf((128, n)), sbuf((128, n)), nl.ndarray((128, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=d, data1=a, data2=b, op=nl.add)

    def ts(x):
        a, d = sbuf((128, n)), nl.ndarray((128, n), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=d, data=a, op0=nl.add, operand0=1.0)

    memsets = 2 * n
    assert cycles(tt, np.ones(1, F32)) - memsets == 2 * n
    assert cycles(ts, np.ones(1, F32)) - n == n


@pytest.mark.parametrize("dtype, per_elem", [(nl.float32, 1.0), (nl.bfloat16, 0.5), (nl.uint8, 0.25)])
def test_gpsimd_moves_32_bits_per_partition_per_cycle(dtype, per_elem):
    """TA2 GpSimd connectivity: up to 32 bits per partition per cycle → N·itemsize/4 cycles."""

    def k(x):
        d = nl.ndarray((128, 4096), dtype, buffer=nl.sbuf)
        nisa.iota(d, [[1, 4096]], offset=0)

    assert cycles(k, np.ones(1, F32), engine="gpsimd") == 4096 * per_elem


def test_vector_fast_modes_only_where_the_trn2_guide_grants_them():
    n = 1024

    def copy(src_buf, dtype, strided=False):
        def k(x):
            s = nl.ndarray((128, 2 * n), dtype, buffer=src_buf)
            nisa.memset(s, 1.0)
            d = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=d, src=s[:, 0 : 2 * n : 2] if strided else s[:, 0:n])

        return k

    base = {}
    for key, (buf, dtype, strided) in {
        "bf16 sbuf": (nl.sbuf, nl.bfloat16, False),
        "bf16 strided": (nl.sbuf, nl.bfloat16, True),
        "bf16 psum": (nl.psum, nl.bfloat16, False),
        "fp32 sbuf": (nl.sbuf, nl.float32, False),
    }.items():
        simulate(copy(buf, dtype, strided))(np.ones(1, F32))
        rec = interpreter.last_run().cost
        base[key] = rec.instr_cycles["vector"]
    # 2n: the memset of the [128, 2n] source (memset is not among the guide's fast-mode instructions), then
    # the copy: bf16 SBUF contiguous 4×, strided 2×, one side in PSUM 2×, fp32 1×
    assert base["bf16 sbuf"] == 2 * n + n / 4
    assert base["bf16 strided"] == 2 * n + n / 2
    assert base["bf16 psum"] == 2 * n + n / 2
    assert base["fp32 sbuf"] == 2 * n + n


def test_tensor_engine_issue_interval_is_max_n_64_and_fp32_is_4x():
    """TA2 Tensor Engine: initiation interval max(N, MM_INIT_LATENCY = 64); fp32 ~4×."""

    def mm(n, dtype):
        def k(x):
            st, mv = sbuf((128, 128), dtype), sbuf((128, n), dtype)
            d = nl.ndarray((128, n), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=d, stationary=st, moving=mv)

        return k

    assert cycles(mm(8, nl.bfloat16), np.ones(1, F32), engine="tensor") == 64
    assert cycles(mm(512, nl.bfloat16), np.ones(1, F32), engine="tensor") == 512
    assert cycles(mm(512, nl.float32), np.ones(1, F32), engine="tensor") == 4 * 512
    est = TRN2.estimate(interpreter.last_run().cost)
    assert est["tensor_s"] == pytest.approx(4 * 512 / 2.4e9)  # no extra per-instruction constant on TensorE


def test_transpose_mode_fp32_is_twice_as_fast_as_an_fp32_matmul():
    """trn2 guide, Built-in Transpose Support: 2× speedup in FP32 transpose."""

    def k(x):
        t = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        d = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=d, data=t, engine=nisa.engine.tensor)

    assert cycles(k, np.ones((128, 128), F32), engine="tensor") == 2 * 128


def test_dynamic_dmas_pay_the_dge_cost():
    """trn2 guide, DGE: each DGE-based DMA instruction takes about 600 ns; two DGE instances per core."""

    def k(x, dynamic):
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        for e in range(4):
            src = (
                x.ap(pattern=[[8, 1], [1, 8]], offset=0, scalar_offset=nisa.register_alloc(e), indirect_dim=0)
                if dynamic
                else x[e : e + 1, :]
            )
            nisa.dma_copy(dst=t, src=src)

    x = np.ones((4, 8), F32)
    simulate(k)(x, False)
    static = TRN2.estimate(interpreter.last_run().cost)
    simulate(k)(x, True)
    dyn = TRN2.estimate(interpreter.last_run().cost)
    assert static["dge_s"] == 0.0
    assert dyn["dge_s"] == pytest.approx(math.ceil(4 / 2) * 0.6e-6)
    assert dyn["dma_s"] == pytest.approx(static["dma_s"])


def test_estimate_reports_the_overlap_the_serial_bound_and_the_binding_engine():
    def k(x):
        t = nl.ndarray((128, 4096), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        for _ in range(4):
            nisa.activation(dst=t, op=nl.exp, data=t)
        o = nl.ndarray((128, 4096), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    _, rep = interpreter.profile(k, np.zeros((128, 4096), F32))
    parts = {c: rep[c] for c in interpreter.cost.COMPONENTS if c in rep}
    assert rep["time_s"] == max(parts.values())
    assert rep["serial_s"] == pytest.approx(sum(parts.values()))
    assert rep["bound"] == "scalar" and rep["scalar_s"] == pytest.approx(4 * (4096 + 60) / 1.2e9)


def test_vector_time_is_its_cycles_plus_60_per_instruction_at_0_96_ghz():
    """Two memsets (N cycles each) and a two-input tensor_tensor (2N), 60 fixed cycles per instruction."""

    def k(x):
        a, b = sbuf((128, 1000)), sbuf((128, 1000))
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.multiply)

    simulate(k)(np.ones(1, F32))
    rec = interpreter.last_run().cost
    new = TRN2.estimate(rec)["vector_s"]
    assert new == pytest.approx((2 * 1000 + 2000 + 3 * 60) / 0.96e9)


def test_dma_transpose_throughput_factors():
    def k(x):
        d = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x)

    x = np.zeros((128, 128), ml_dtypes.bfloat16)
    simulate(k)(x)
    rec = interpreter.last_run().cost
    assert rec.dmas[0].efficiency == 0.9
    t = TRN2.dma_time(rec) - TRN2.dma_fixed
    assert t == pytest.approx(128 * 128 * 2 / 0.9 / TRN2.dma_bandwidth)
