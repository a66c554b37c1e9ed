"""quantize_weight: wrapper and fake kernel (SPEC §1.10).

The fake kernel runs the same C++ argument checks as the CPU kernel (csrc/checks/quantize_weight.h, through
``static_moe._C``), so a traced graph rejects bad inputs with the eager messages; under dynamic shapes (symbolic
sizes) it computes the output shapes only. The kernel is CPU-only: weights are quantized once, offline (on load);
the reference (static_moe.reference.quantize_weight, i.e. static_moe.formats) runs on any device.
"""

from __future__ import annotations

import time

import torch

from .. import _C


def quantize_weight(w, weight_format):
    """Quantize expert weights ``w`` bf16 / float16 / float32 [..., N, K] (CPU) per SPEC §1.2.

    "fp8": returns (float8_e4m3fn [..., N, K], float32 scales [..., N, K/128]), power-of-two scales, fp8_max 448.
    "fp4": returns (uint8 [..., N, K/2] packed e2m1, element k in byte k//2 low nibble for even k; uint8 UE8M0
    scales [..., N, K/32]). Bitwise equal to ``static_moe.formats.quantize_weight_fp8`` / ``quantize_weight_fp4``;
    a block holding NaN or ±Inf raises ValueError naming ``w`` and the first such block, as they do. Same device
    as ``w`` (CPU); float16 input is widened to a float32 copy first, bf16 / float32 are read in place.
    """
    return torch.ops.static_moe.quantize_weight(w, weight_format)


@torch.library.register_fake("static_moe::quantize_weight")
def _quantize_weight_fake(w, weight_format):
    if not any(isinstance(s, torch.SymInt) for s in w.shape):
        _C.check_quantize_weight(w, weight_format)
    k = w.shape[-1]
    lead = tuple(w.shape[:-1])
    if weight_format == "fp4":
        return w.new_empty(lead + (k // 2,), dtype=torch.uint8), w.new_empty(lead + (k // 32,), dtype=torch.uint8)
    return w.new_empty(w.shape, dtype=torch.float8_e4m3fn), w.new_empty(lead + (k // 128,), dtype=torch.float32)


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_weight_fast(w: torch.Tensor, fmt: str, *, name: str = "w", progress: bool | None = None):
    """``static_moe.formats.quantize_weight(w, fmt, name=name)``'s contract and bits (bf16: a cast; fp8 / fp4: the
    SPEC §1.2 quantizers, NaN / Inf refused naming ``name``), by the C++ kernel where it runs — plain CPU tensors
    [..., N, K] of bf16 / float16 / float32 — and by the Python quantizers elsewhere (other devices, DTensors,
    traced tensors) or on an error (so messages are the reference's). Experts (dim 0 of a 3-D ``w``) are quantized
    one at a time into the outputs, with a progress bar for large conversions (static_moe.progress) and an INFO
    record on ``logging.getLogger("static_moe")``."""
    from .. import formats
    from ..progress import logger, progress_bar

    block = {"fp8": formats.WEIGHT_FP8_BLOCK, "fp4": formats.WEIGHT_FP4_BLOCK}.get(fmt)
    plain = type(w) is torch.Tensor or type(w) is torch.nn.Parameter
    if (
        block is None
        or not plain
        or w.device.type != "cpu"
        or w.dtype not in _KERNEL_DTYPES
        or w.dim() < 2
        or w.numel() == 0
        or w.shape[-1] % block
        or torch.compiler.is_compiling()
    ):
        return formats.quantize_weight(w, fmt, name=name)
    w = w.detach()
    start = time.perf_counter()
    experts = w.unsqueeze(0) if w.dim() == 2 else w.reshape(-1, *w.shape[-2:])
    nbytes = w.numel() * w.element_size()
    bar = progress_bar(total=nbytes, desc=f"static_moe: quantizing {name} to {fmt}", enable=progress)
    k, lead = w.shape[-1], w.shape[:-1]
    if fmt == "fp8":
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty((*lead, k // block), dtype=torch.float32)
    else:
        q = torch.empty((*lead, k // 2), dtype=torch.uint8)
        s = torch.empty((*lead, k // block), dtype=torch.uint8)
    qe_all, se_all = q.reshape(experts.shape[0], -1, q.shape[-1]), s.reshape(experts.shape[0], -1, s.shape[-1])
    try:
        for e in range(experts.shape[0]):
            qe, se = torch.ops.static_moe.quantize_weight(experts[e], fmt)
            qe_all[e], se_all[e] = qe, se
            bar.update(nbytes // experts.shape[0])
    except ValueError:  # NaN / Inf: the reference raises with its message (name, first block over all dims)
        return formats.quantize_weight(w, fmt, name=name)
    finally:
        bar.close()
    dt = time.perf_counter() - start
    logger.log(
        20 if nbytes >= 64 << 20 else 10,
        "quantized %s %s to %s: %.1f MB in %.2f s",
        name,
        list(w.shape),
        fmt,
        nbytes / 1e6,
        dt,
    )
    return q, s
