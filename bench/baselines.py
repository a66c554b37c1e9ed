"""Baselines of docs/benchmarks.md: the same maths as the static_moe ops, on the same inputs, written the ways a user
would without static_moe. Everything on the CPU, in the calling process.

- ``seed_dense``: the seed's host path — every local expert over every gathered row, weights dequantized to fp32
  on every call, ``a.float() @ b.float().T``. Rows not routed to an expert carry weight 0, so they add exact
  zeros: the same result, at dense cost.
- ``torch_cached``: what a PyTorch user writes — weights dequantized once at load (fp32 or bf16; the benchmarks
  time both and keep the faster), per expert the routed rows gathered with index_select, ``F.linear``,
  silu·up, ``F.linear``, ``index_add_``. Intermediates stay in the compute dtype (no re-quantization of the
  SwiGLU output to fp8), which only makes this baseline cheaper than the op's maths.
- ``torch_scaled_mm`` (fp8 weights only): ``torch._scaled_mm`` with row-wise scales. The weights are
  re-quantized once at load to one float32 scale per output row (coarser than the format's 1×128 blocks);
  activations are quantized per row on every call. The weight is passed as the first operand ([N, K]
  row-major) and the activations as the second (column-major): the faster orientation on the CPU.
- ``torch_int4pack`` (fp4 weights only): PyTorch's own 4-bit CPU GEMM, ``torch.ops.aten._weight_int4pack_mm_for_cpu``
  (bf16 activations, uint4 weights with a bf16 scale and zero per 32 along K: the byte count of fp4's). The
  weights are re-quantized once at load to that format (asymmetric min/max per group of 32, from the dequantized
  fp4 values: e2m1 levels are not uniform, so this is close, not exact) and packed with
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``; fp8 activations are dequantized to bf16 on every call.

Each baseline is checked once against ``static_moe.reference`` by the benchmarks (loose tolerances in
``CHECK_TOLERANCE``), so a broken baseline is caught rather than timed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from static_moe.formats import FP8_E4M3FN_MAX, dequantize_activation, dequantize_weight
from static_moe.reference.swiglu_and_cast import swiglu_and_cast as ref_swiglu_and_cast

# calc_diff bound of a baseline vs the reference: loose (baselines are not held to SPEC §2), tight enough to catch
# wrong maths (a wrong expert, a lost routing weight, a transposed weight: calc_diff ≳ 0.1).
CHECK_TOLERANCE = {"seed_dense": 1e-4, "torch_cached": 5e-3, "torch_scaled_mm": 2e-2, "torch_int4pack": 3e-2}


def _dequantize_a(a: torch.Tensor, a_scale: torch.Tensor | None) -> torch.Tensor:
    """Activations [R, K] (bf16, or fp8 + float32 [R, K/g]) → float32 [R, K]."""
    return dequantize_activation(a, a_scale) if a.dtype == torch.float8_e4m3fn else a.float()


def local_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_offset: int, num_local: int):
    """The usual PyTorch routing loop's bookkeeping: for each local expert with rows, ``(e, rows, weights)`` —
    rows int64 [n_e] of ``topk_idx`` [R, k] naming global id ``expert_offset + e``, one entry per slot (a row
    naming the expert twice appears twice), weights float32 [n_e]. One host sync (the per-expert counts)."""
    local = topk_idx.long() - expert_offset
    ok = (local >= 0) & (local < num_local)
    counts = torch.bincount(local[ok], minlength=num_local).tolist()
    out = []
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows, slots = torch.nonzero(local == e, as_tuple=True)
        out.append((e, rows, topk_weights[rows, slots].float()))
    return out


# ----------------------------------------------------------------------------------------------------------------
# seed_dense
# ----------------------------------------------------------------------------------------------------------------
def seed_dense_expert_gemm(a, a_scale, b, b_scale, row_mask, expert: int) -> torch.Tensor:
    """bf16 [R, N]: expert ``expert``'s weight dequantized to fp32 on this call, every row multiplied, masked rows
    set to zero afterwards."""
    w = dequantize_weight(b[expert], None if b_scale is None else b_scale[expert])
    d = _dequantize_a(a, a_scale) @ w.T
    return torch.where(row_mask[:, None], d, torch.zeros((), dtype=d.dtype)).to(torch.bfloat16)


def seed_dense_local_experts(
    x,
    x_scale,
    topk_idx,
    topk_weights,
    w13,
    w13_scale,
    w2,
    w2_scale,
    expert_offset: int,
    swiglu_limit=None,
    fp8_max: float = FP8_E4M3FN_MAX,
) -> torch.Tensor:
    """float32 [R, H]: every local expert over every row (the SPEC §1.7 maths with weight 0 on unrouted rows),
    weights dequantized to fp32 on every call."""
    fp8_act = x.dtype == torch.float8_e4m3fn
    group = x.shape[1] // x_scale.shape[1] if fp8_act else 128
    xf = _dequantize_a(x, x_scale)
    hit = topk_idx.long()
    w = topk_weights.float()
    acc = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32)
    for e in range(w13.shape[0]):
        w_e = torch.where(hit == expert_offset + e, w, torch.zeros((), dtype=w.dtype)).sum(1)
        w13_e = dequantize_weight(w13[e], None if w13_scale is None else w13_scale[e])
        h = (xf @ w13_e.T).to(torch.bfloat16)
        z, z_s = ref_swiglu_and_cast(h, w_e, swiglu_limit, "fp8" if fp8_act else "bf16", group, fp8_max, True)
        zf = dequantize_activation(z, z_s) if fp8_act else z.float()
        w2_e = dequantize_weight(w2[e], None if w2_scale is None else w2_scale[e])
        acc += (zf @ w2_e.T).to(torch.bfloat16).float()
    return acc


# ----------------------------------------------------------------------------------------------------------------
# torch_cached
# ----------------------------------------------------------------------------------------------------------------
class TorchCached:
    """Weights dequantized once, at construction, to ``dtype`` (float32 or bfloat16).

    w13 [L, 2I, H], w2 [L, H, I] in any SPEC weight format (+ scales); held as ``dtype`` [L, N, K]."""

    def __init__(self, w13, w13_scale, w2=None, w2_scale=None, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.w13 = dequantize_weight(w13, w13_scale).to(dtype)
        self.w2 = None if w2 is None else dequantize_weight(w2, w2_scale).to(dtype)

    def expert_gemm(self, a, a_scale, row_mask, expert: int) -> torch.Tensor:
        """bf16 [R, N] = rows of A where ``row_mask`` · cached ``w13[expert]``ᵀ, zeros elsewhere."""
        rows = row_mask.nonzero().squeeze(1)
        a_rows = a.index_select(0, rows)
        a_rows = _dequantize_a(a_rows, None if a_scale is None else a_scale.index_select(0, rows)).to(self.dtype)
        out = torch.zeros((a.shape[0], self.w13.shape[1]), dtype=torch.bfloat16)
        out.index_copy_(0, rows, F.linear(a_rows, self.w13[expert]).to(torch.bfloat16))
        return out

    def local_experts(self, x, x_scale, topk_idx, topk_weights, expert_offset: int, swiglu_limit=None) -> torch.Tensor:
        """float32 [R, H]: Σ over routed (row, expert) of w · F.linear(silu(g)·u, W2_e), g|u = F.linear(x, W13_e)."""
        xc = _dequantize_a(x, x_scale).to(self.dtype)
        inter = self.w13.shape[1] // 2
        acc = torch.zeros((x.shape[0], self.w2.shape[1]), dtype=torch.float32)
        for e, rows, w in local_routing(topk_idx, topk_weights, expert_offset, self.w13.shape[0]):
            gu = F.linear(xc.index_select(0, rows), self.w13[e])
            g, u = gu[:, :inter], gu[:, inter:]
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            z = F.silu(g) * u * w.to(self.dtype)[:, None]
            acc.index_add_(0, rows, F.linear(z, self.w2[e]).float())
        return acc


# ----------------------------------------------------------------------------------------------------------------
# torch_scaled_mm
# ----------------------------------------------------------------------------------------------------------------
def scaled_mm_unavailable_reason() -> str | None:
    """None when ``torch._scaled_mm`` with row-wise scales runs on the CPU here; otherwise why not."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    try:
        w = torch.ones(16, 32).to(torch.float8_e4m3fn)
        a = torch.ones(2, 32).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(w, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 2), out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"torch._scaled_mm with row-wise scales fails on the CPU in torch {torch.__version__}: {e}"
    if not torch.equal(out.float(), torch.full((16, 2), 32.0)):
        return "torch._scaled_mm with row-wise scales gives wrong results on the CPU"
    return None


def rowwise_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [R, K] → (float8_e4m3fn [R, K], float32 [R, 1]) with one scale per row: amax / 448."""
    s = v.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_E4M3FN_MAX
    return (v / s).clamp(-FP8_E4M3FN_MAX, FP8_E4M3FN_MAX).to(torch.float8_e4m3fn), s


class TorchScaledMM:
    """fp8 weights re-quantized once with one scale per output row: ``w13`` [L, 2I, H] fp8 [+ float32
    [L, 2I, 1]], ``w2`` likewise. Activations are quantized per row on every call."""

    def __init__(self, w13, w13_scale, w2=None, w2_scale=None):
        if w13.dtype != torch.float8_e4m3fn:
            raise TypeError(f"torch_scaled_mm baseline takes fp8 weights only, got {w13.dtype}")
        self.w13, self.s13 = self._requantize(w13, w13_scale)
        self.w2, self.s2 = (None, None) if w2 is None else self._requantize(w2, w2_scale)

    @staticmethod
    def _requantize(w, s):
        wf = dequantize_weight(w, s)
        q, sc = rowwise_fp8(wf.reshape(-1, wf.shape[-1]))
        return q.reshape(wf.shape), sc.reshape(*wf.shape[:-1], 1)

    @staticmethod
    def _mm(w_q, w_s, a_f32) -> torch.Tensor:
        """bf16 [R, N] = a [R, K] · w [N, K]ᵀ, computed as (w · aᵀ)ᵀ on row-wise scaled fp8."""
        a_q, a_s = rowwise_fp8(a_f32)
        return torch._scaled_mm(w_q, a_q.t(), scale_a=w_s, scale_b=a_s.t(), out_dtype=torch.bfloat16).t()

    def expert_gemm(self, a, a_scale, row_mask, expert: int) -> torch.Tensor:
        rows = row_mask.nonzero().squeeze(1)
        a_rows = _dequantize_a(a.index_select(0, rows), None if a_scale is None else a_scale.index_select(0, rows))
        out = torch.zeros((a.shape[0], self.w13.shape[1]), dtype=torch.bfloat16)
        out.index_copy_(0, rows, self._mm(self.w13[expert], self.s13[expert], a_rows))
        return out

    def local_experts(self, x, x_scale, topk_idx, topk_weights, expert_offset: int, swiglu_limit=None) -> torch.Tensor:
        xf = _dequantize_a(x, x_scale)
        inter = self.w13.shape[1] // 2
        acc = torch.zeros((x.shape[0], self.w2.shape[1]), dtype=torch.float32)
        for e, rows, w in local_routing(topk_idx, topk_weights, expert_offset, self.w13.shape[0]):
            gu = self._mm(self.w13[e], self.s13[e], xf.index_select(0, rows)).float()
            g, u = gu[:, :inter], gu[:, inter:]
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            z = F.silu(g) * u * w[:, None]
            acc.index_add_(0, rows, self._mm(self.w2[e], self.s2[e], z).float())
        return acc


# ----------------------------------------------------------------------------------------------------------------
# torch_int4pack
# ----------------------------------------------------------------------------------------------------------------
INT4_GROUP = 32  # K per bf16 scale/zero pair of the int4 weights (the fp4 format's scale block)


def int4pack_unavailable_reason() -> str | None:
    """None when torch's 4-bit CPU GEMM runs here; otherwise why not."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu"
    return None


def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] → (int32 [N, K] codes 0..15, bf16 [K/group, N, 2] scale and zero) in the layout
    ``_weight_int4pack_mm_for_cpu`` reads: w ≈ (q − 8)·scale + zero per group of ``group`` along K. Scale and zero
    are rounded to bf16 before the codes are chosen, so the codes fit the values the kernel will use."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-20).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]) + 8
    q = q.clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], -1).transpose(0, 1).contiguous()


class TorchInt4Pack:
    """fp4 weights re-quantized once to torch's int4 format (see the module docstring): per expert a packed uint8
    [N, K/2] weight and bf16 [K/32, N, 2] scales and zeros, for w13 [L, 2I, H] and w2 [L, H, I]."""

    def __init__(self, w13, w13_scale, w2=None, w2_scale=None):
        if w13.dtype != torch.uint8:
            raise TypeError(f"torch_int4pack baseline takes fp4 weights (uint8 packed e2m1) only, got {w13.dtype}")
        self.w13 = self._pack(w13, w13_scale)
        self.w2 = None if w2 is None else self._pack(w2, w2_scale)
        self.n13, self.hidden = w13.shape[1], 2 * w13.shape[2]  # fp4 rows hold K/2 bytes

    @staticmethod
    def _pack(w, s):
        out = []
        for e in range(w.shape[0]):
            q, sz = quantize_int4_groups(dequantize_weight(w[e], s[e]))
            out.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz))
        return out

    @staticmethod
    def _mm(packed, a_bf16: torch.Tensor) -> torch.Tensor:
        """bf16 [R, N] = a [R, K] (bf16) · w [N, K]ᵀ on the int4 weights."""
        w, sz = packed
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a_bf16, w, INT4_GROUP, sz)

    def expert_gemm(self, a, a_scale, row_mask, expert: int) -> torch.Tensor:
        rows = row_mask.nonzero().squeeze(1)
        a_rows = a.index_select(0, rows)
        if a.dtype == torch.float8_e4m3fn:
            a_rows = _dequantize_a(a_rows, a_scale.index_select(0, rows)).to(torch.bfloat16)
        out = torch.zeros((a.shape[0], self.n13), dtype=torch.bfloat16)
        out.index_copy_(0, rows, self._mm(self.w13[expert], a_rows))
        return out

    def local_experts(self, x, x_scale, topk_idx, topk_weights, expert_offset: int, swiglu_limit=None) -> torch.Tensor:
        xb = _dequantize_a(x, x_scale).to(torch.bfloat16) if x.dtype == torch.float8_e4m3fn else x
        inter = self.n13 // 2
        acc = torch.zeros((x.shape[0], self.hidden), dtype=torch.float32)
        for e, rows, w in local_routing(topk_idx, topk_weights, expert_offset, len(self.w13)):
            gu = self._mm(self.w13[e], xb.index_select(0, rows))
            g, u = gu[:, :inter], gu[:, inter:]
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            z = F.silu(g) * u * w.to(torch.bfloat16)[:, None]
            acc.index_add_(0, rows, self._mm(self.w2[e], z).float())
        return acc
