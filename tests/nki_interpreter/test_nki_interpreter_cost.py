"""The interpreter's cost model: each constant against the architecture guides' figure, the overlapped estimate
vs the serial bound, and the binding engine. Model numbers only — no timing of this machine.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import nki_interpreter as interpreter
from nki_interpreter import TRN2, TRN3, simulate
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
    # four dependent activations: ~100 fixed cycles each (TA2 Vector Engine cost model)
    assert rep["bound"] == "scalar" and rep["scalar_s"] == pytest.approx(4 * (4096 + 100) / 1.2e9)


def test_vector_time_is_its_cycles_plus_100_per_instruction_at_0_96_ghz():
    """Two memsets (N cycles each) and a two-input tensor_tensor (2N), 100 fixed cycles per instruction (the
    TA2 cost model's figure for dependent instructions)."""

    def k(x):
        a, b = sbuf((128, 1000)), sbuf((128, 1000))
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.multiply)

    simulate(k)(np.ones(1, F32))
    rec = interpreter.last_run().cost
    new = TRN2.estimate(rec)["vector_s"]
    assert new == pytest.approx((2 * 1000 + 2000 + 3 * 100) / 0.96e9)


def test_dma_transpose_throughput_factors():
    def k(x):
        d = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x)

    x = np.zeros((128, 128), ml_dtypes.bfloat16)
    simulate(k)(x)
    rec = interpreter.last_run().cost
    assert rec.dmas[0].efficiency == 0.9
    t = TRN2.dma_time(rec) - TRN2.dma_fixed
    run = TRN2.run_efficiency(TRN2.payload_bytes(rec.dmas[0]))
    assert t == pytest.approx(128 * 128 * 2 / (0.9 * run * TRN2.dma_bandwidth))


# ------------------------------------------------------------------------------- the corrected DMA / HBM model
def test_per_core_hbm_and_dma_peaks_per_target():
    """T2 / T3: 2.9 and 4.7 TB/s per device over 8 cores; DMA bandwidth guide: 16 engines × 23 / 33 B/ns."""
    assert TRN2.hbm_bandwidth_per_core == pytest.approx(362.5e9)
    assert TRN3.hbm_bandwidth_per_core == pytest.approx(587.5e9)
    assert TRN2.dma_bandwidth == pytest.approx(368e9) and TRN3.dma_bandwidth == pytest.approx(528e9)
    assert interpreter.model_for("trn3") is TRN3


def _copy_rows(rows, cols, dtype=F32):
    def k(x):
        t = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)

    simulate(k)(np.zeros((rows, cols), dtype))
    return interpreter.last_run().cost


def test_a_dma_runs_on_one_engine_per_8_partitions():
    """Same bytes, fewer partitions, fewer engines: 8 rows of 2 KiB take 16× the data time of 128 rows of 128 B
    would at equal run efficiency; checked directly against engines_for."""
    few, full = _copy_rows(8, 4096), _copy_rows(128, 256)
    assert TRN2.engines_for(few.dmas[0]) == 1 and TRN2.engines_for(full.dmas[0]) == 16
    assert TRN2.engines_for(_copy_rows(9, 16).dmas[0]) == 2
    t_few = TRN2.dma_time(few) - TRN2.dma_fixed
    assert t_few == pytest.approx(8 * 4096 * 4 / (TRN2.run_efficiency(16384) * TRN2.dma_engine_bandwidth))


def test_short_runs_are_below_peak_per_the_dma_bandwidth_guide():
    """< 256 B: at most half of peak; 256 B – 2 KiB: below peak; ≥ 2 KiB: close; 4 KiB: closer still."""
    e = TRN2.run_efficiency
    assert e(128) < 0.5 and e(256) == pytest.approx(0.5) and e(512) < e(2048) < e(4096) < 1.0
    assert e(2048) > 0.85 and e(4096) > 0.9
    short, long_ = _copy_rows(128, 128), _copy_rows(128, 1024)  # 512 B vs 4 KiB per partition
    per_byte = [(TRN2.dma_time(r) - TRN2.dma_fixed) / r.dma_bytes for r in (short, long_)]
    assert per_byte[0] == pytest.approx(per_byte[1] * e(4096) / e(512))


def test_accumulate_reads_its_hbm_destination_and_runs_at_half_rate_before_v4():
    """dma_compute scatter-add into HBM: the HBM read of the destination is counted, and on trn2 (two passes)
    the data phase takes twice a plain copy's; trn3's near-memory accumulation runs at full rate."""

    def k(acc, idx, add, rmw):
        i = nl.load(idx)
        src = nl.load(add)
        view = acc.ap([[4, 4], [1, 4]], offset=0, vector_offset=i, indirect_dim=0)
        if rmw:
            nisa.dma_compute(dst=view, srcs=[view, src], reduce_op=nl.add)
        else:
            nisa.dma_copy(dst=view, src=src)

    acc = np.zeros((8, 4), F32)
    idx = np.array([[1], [3], [5], [7]], np.int32)
    add = np.ones((4, 4), F32)
    recs = {}
    for rmw in (False, True):
        simulate(k)(acc, idx, add, rmw)
        recs[rmw] = interpreter.last_run().cost
    plain, acc_dma = recs[False].dmas[-1], recs[True].dmas[-1]
    assert acc_dma.rmw and not plain.rmw and acc_dma.rmw_hbm_read == 4 * 4 * 4
    assert recs[True].hbm_bytes == recs[False].hbm_bytes + 64
    assert TRN2.dma_data_time(acc_dma) == pytest.approx(2 * TRN2.dma_data_time(plain))
    assert TRN3.dma_data_time(acc_dma) == pytest.approx(TRN3.dma_data_time(plain))


def test_trn2_indirect_dmas_are_software_dge_on_gpsimd():
    """COPY / DGE reference: gather and scatter are software DGE, generated by GpSimd: trn2 charges their
    descriptor time to GpSimd, not to the hardware DGE; trn3 (ASSUMPTION) to the hardware DGE."""

    def k(table, idx):
        i = nl.load(idx)
        rows = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        for _ in range(3):
            nisa.dma_copy(dst=rows, src=table.ap([[4, 4], [1, 4]], offset=0, vector_offset=i, indirect_dim=0))

    simulate(k)(np.zeros((6, 4), F32), np.array([[4], [0], [1], [2]], np.int32))
    rec = interpreter.last_run().cost
    t2, t3 = TRN2.estimate(rec), TRN3.estimate(rec)
    assert t2["dge_s"] == 0.0 and t2["gpsimd_s"] == pytest.approx(3 * 0.6e-6)
    assert t3["dge_s"] == pytest.approx(math.ceil(3 / 2) * 0.6e-6) and t3.get("gpsimd_s", 0.0) == 0.0


@pytest.mark.parametrize("model,ceiling", [(TRN2, 1.0), (TRN3, 528 / 587.5)])
def test_a_dma_bound_copy_cannot_pass_the_documented_ceiling(model, ceiling):
    """The largest, best-shaped HBM→SBUF copy: its MBU stays under min(1, DMA peak / HBM share) — 89.9 % on
    trn3, where the DMA engines (528 GB/s) are slower than the core's HBM share (587.5 GB/s)."""
    rec = _copy_rows(128, 16384)
    est = model.estimate(rec)
    mbu = model.mbu(rec.hbm_bytes, est["time_s"])
    assert mbu <= ceiling and mbu > 0.9 * ceiling
    if model is TRN3:
        assert est["bound"] == "dma"
