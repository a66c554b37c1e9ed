"""The reference ops (the executable spec) vs an independent float64 computation of the same maths (SPEC §2, last
line). The float64 side is written here with numpy and ml_dtypes — decoding formats, rounding at the same points
(bf16 h, fp8/bf16 z, bf16 d) — and never calls static_moe's reference or formats code.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from static_moe import reference
from static_moe.testing.generators import FORMAT_PAIRS, make_activations, make_routing, make_weights
from static_moe.testing.numeric import assert_equal, assert_gemm_close

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


# ---------------------------------------------------------------------------------------------------------------
# float64 building blocks
# ---------------------------------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def act64(x: torch.Tensor, x_scale: torch.Tensor | None) -> np.ndarray:
    """Activations [R, K] (bf16, or e4m3fn with float32 [R, K/g]) → float64."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16).astype(np.float64)
    vals = _bytes(x).view(E4M3).astype(np.float64)
    g = x.shape[1] // x_scale.shape[1]
    return vals * np.repeat(x_scale.numpy().astype(np.float64), g, axis=1)


def weight64(w: torch.Tensor, s: torch.Tensor | None) -> np.ndarray:
    """Weights [L, N, K] in any format → float64 [L, N, K] (fp4: byte k//2, low nibble for even k)."""
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(ml_dtypes.bfloat16).astype(np.float64)
    if w.dtype == torch.float8_e4m3fn:
        return _bytes(w).view(E4M3).astype(np.float64) * np.repeat(s.numpy().astype(np.float64), 128, axis=-1)
    b = _bytes(w)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1]).astype(np.uint8)
    vals = codes.view(E2M1).astype(np.float64)
    return vals * np.repeat(np.ldexp(1.0, _bytes(s).astype(np.int64) - 127), 32, axis=-1)


def bf16_round(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def swiglu64(h: np.ndarray, w: np.ndarray | None, limit: float | None) -> np.ndarray:
    i = h.shape[1] // 2
    g, u = h[:, :i], h[:, i:]
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    v = g / (1.0 + np.exp(-g)) * u
    return v if w is None else v * w[:, None]


def quant64(v: np.ndarray, g: int, fp8_max: float, pow2: bool):
    """SPEC §1.1 in float64: returns (fp8 codes [R, K], scales [R, K/g], dequantized values)."""
    r, k = v.shape
    vb = v.reshape(r, k // g, g)
    amax = np.maximum(np.abs(vb).max(axis=-1), 1e-4)
    s = amax / fp8_max
    if pow2:
        s = np.ldexp(1.0, np.ceil(np.log2(s)).astype(np.int64))
    q = np.clip(vb / s[..., None], -fp8_max, fp8_max).astype(E4M3)
    deq = (q.astype(np.float64) * s[..., None]).reshape(r, k)
    return q.view(np.uint8).reshape(r, k), s, deq


def expert_mlp64(x64, w13_64, w2_64, w_rows, limit, fp8_act, group, fp8_max=448.0):
    """One expert over its rows, rounding where the SPEC's reference order does (§1.7)."""
    h = bf16_round(x64 @ w13_64.T)
    v = swiglu64(h, w_rows, limit)
    z = quant64(v, group, fp8_max, True)[2] if fp8_act else bf16_round(v)
    return bf16_round(z @ w2_64.T)


# ---------------------------------------------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------------------------------------------
def test_pack_rows_layout_vs_numpy(rng):
    parts = [
        torch.randn(3, 5, generator=rng).to(torch.bfloat16),
        torch.randint(-1, 9, (3, 2), dtype=torch.int32),
        torch.rand(3, 7, generator=rng),
        torch.randint(0, 256, (3, 16), dtype=torch.uint8),
    ]
    cap = 5
    packed = reference.pack_rows(parts, cap)
    # numpy: 10 bytes → 16, 8 → 16, 28 → 32, 16 → 16; W = 80
    expect = np.full((cap, 80), 0xFF, dtype=np.uint8)
    col = 0
    for p in parts:
        b = _bytes(p).reshape(3, -1)
        expect[:3, col : col + b.shape[1]] = b
        col += -(-b.shape[1] // 16) * 16
    assert np.array_equal(packed.numpy(), expect)
    assert np.array_equal(reference.unpack_rows(packed, 32, 28, torch.float32, [7]).numpy()[:3], parts[2].numpy())
    pad = reference.unpack_rows(packed, 16, 8, torch.int32, [2])[3:]
    assert bool((pad == -1).all())  # padded ids read −1
    assert bool(torch.isnan(reference.unpack_rows(packed, 32, 28, torch.float32, [7])[3:]).all())  # weights NaN


# ---------------------------------------------------------------------------------------------------------------
# swiglu_and_cast
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [None, 1.5])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_swiglu_and_cast_fp8_vs_float64(limit, group, fp8_max, rng):
    gate_up = (torch.randn(24, 512, generator=rng) * 3).to(torch.bfloat16)
    w = torch.rand(24, generator=rng)
    w[3] = 0.0
    q, s = reference.swiglu_and_cast(gate_up, w, limit, "fp8", group, fp8_max, True)
    v = swiglu64(act64(gate_up, None), w.numpy().astype(np.float64), limit)
    eq, es, _ = quant64(v, group, fp8_max, True)
    assert np.array_equal(s.numpy().astype(np.float64), es), "pow2 scales must be exact"
    same = (_bytes(q) == eq).mean()
    assert same >= 0.999, f"only {same:.4%} of fp8 bytes equal to the float64 quantization"
    step = np.exp2(np.floor(np.log2(np.maximum(np.abs(eq.view(E4M3).astype(np.float64)), 2.0**-6))) - 3)
    assert np.all(np.abs(_bytes(q).view(E4M3).astype(np.float64) - eq.view(E4M3).astype(np.float64)) <= step)


def test_swiglu_and_cast_no_pow2_and_bf16_vs_float64(rng):
    gate_up = torch.randn(16, 256, generator=rng) * 5
    v = swiglu64(gate_up.numpy().astype(np.float64), None, 4.0)
    _, s = reference.swiglu_and_cast(gate_up, None, 4.0, "fp8", 128, 448.0, False)
    _, es, _ = quant64(v, 128, 448.0, False)
    assert np.all(np.abs(s.numpy() - es) <= 2.0**-20 * es)  # amax/448 carries fp32 silu rounding
    b, empty = reference.swiglu_and_cast(gate_up, None, 4.0, "bf16")
    assert empty.shape == (16, 0)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126))) - 7)
    assert np.all(np.abs(b.float().numpy().astype(np.float64) - v) <= ulp)


# ---------------------------------------------------------------------------------------------------------------
# expert_gemm
# ---------------------------------------------------------------------------------------------------------------
GEMM_CASES = [(a, w, g) for a, w in FORMAT_PAIRS for g in ([32, 128] if a == "fp8" else [128])]


@pytest.mark.parametrize("act,wfmt,group", GEMM_CASES)
def test_expert_gemm_vs_float64(act, wfmt, group, rng):
    rows, hidden, n = 12, 256, 256
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    wts = make_weights(3, hidden, n // 2, wfmt, seed=seed)  # w13: [3, n, hidden]
    a, a_s = make_activations(rows, hidden, act, group, seed=seed + 1)
    mask = torch.rand(rows, generator=rng) < 0.6
    mask[0], mask[1] = True, False
    # masked rows hold garbage that must not leak: NaN in bf16, 0xFF (NaN) bytes and NaN scales in fp8
    a = a.clone()
    if act == "bf16":
        a[~mask] = float("nan")
    else:
        a.view(torch.uint8)[~mask] = 0xFF
        a_s = a_s.clone()
        a_s[~mask] = float("nan")
    out = reference.expert_gemm(a, a_s, wts["w13"], wts["w13_scale"], mask, 2)
    d64 = np.zeros((rows, n))
    m = mask.numpy()
    d64[m] = act64(a[mask], None if a_s is None else a_s[mask]) @ weight64(wts["w13"], wts["w13_scale"])[2].T
    assert out.dtype == torch.bfloat16
    assert bool((out[~mask].view(torch.int16) == 0).all()), "masked rows must be exact +0"
    assert_gemm_close(out, torch.from_numpy(d64), f"{act}x{wfmt} g={group}")


# ---------------------------------------------------------------------------------------------------------------
# local_experts
# ---------------------------------------------------------------------------------------------------------------
def local_experts64(x, x_scale, idx, wts, topk_w, w13, w13_s, w2, w2_s, offset, limit):
    x64 = act64(x, x_scale)
    fp8_act = x.dtype == torch.float8_e4m3fn
    group = x.shape[1] // x_scale.shape[1] if fp8_act else 128
    w13_64, w2_64 = weight64(w13, w13_s), weight64(w2, w2_s)
    ids = idx.numpy().astype(np.int64)
    tw = topk_w.numpy().astype(np.float64)
    acc = np.zeros((x.shape[0], w2.shape[1]))
    for e in range(w13.shape[0]):
        hit = ids == offset + e
        rows = hit.any(axis=1)
        if not rows.any():
            continue
        w_rows = np.where(hit, tw, 0.0).sum(axis=1)[rows]  # NaN weights in slots of other experts never count
        acc[rows] += expert_mlp64(x64[rows], w13_64[e], w2_64[e], w_rows, limit, fp8_act, group)
    return acc


@pytest.mark.parametrize("act,wfmt", FORMAT_PAIRS)
@pytest.mark.parametrize("limit", [None, 2.0])
def test_local_experts_vs_float64(act, wfmt, limit, rng):
    rows, hidden, inter, num_local, offset, num_experts, k = 14, 128, 128, 4, 4, 12, 3
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    wts = make_weights(num_local, hidden, inter, wfmt, seed=seed)
    x, x_s = make_activations(rows, hidden, act, 32 if act == "fp8" else 128, seed=seed + 1)
    idx, tw = make_routing(rows, k, num_experts, seed=seed + 2, empty_frac=0.2, duplicate_frac=0.2, skew=0.2)
    idx[:, 0] = torch.where(torch.arange(rows) % 3 == 0, torch.full_like(idx[:, 0], offset), idx[:, 0])  # hot
    idx[-2:] = -1  # padded rows: no expert, NaN weights
    tw[-2:] = float("nan")
    out = reference.local_experts(
        x, x_s, idx, tw, wts["w13"], wts["w13_scale"], wts["w2"], wts["w2_scale"], offset, limit
    )
    exp = local_experts64(x, x_s, idx, tw, tw, wts["w13"], wts["w13_scale"], wts["w2"], wts["w2_scale"], offset, limit)
    assert out.dtype == torch.float32 and out.shape == (rows, hidden)
    assert bool((out[-2:] == 0).all()), "rows routed nowhere contribute exactly 0"
    assert_gemm_close(out, torch.from_numpy(exp), f"{act}x{wfmt} limit={limit}")


# ---------------------------------------------------------------------------------------------------------------
# forward_simulated (S ranks in one process) vs a per-token float64 formula (no packing, no gather)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize("act,wfmt", [("bf16", "fp4"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_forward_simulated_vs_float64(ep_size, act, wfmt, rng):
    hidden, inter, num_experts, k, cap, limit = 128, 128, 8, 3, 6, 3.0
    num_local = num_experts // ep_size
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    tokens = [cap if r == 0 else (0 if r == 1 else 1 + (seed + r) % cap) for r in range(ep_size)]
    xs, x_scales, idxs, tws, shared, weights = [], [], [], [], [], []
    for r in range(ep_size):
        x, x_s = make_activations(tokens[r], hidden, act, 128, seed=seed + 10 * r)
        idx, tw = make_routing(tokens[r], k, num_experts, seed=seed + 10 * r + 1, empty_frac=0.15, duplicate_frac=0.2)
        xs.append(x), x_scales.append(x_s), idxs.append(idx), tws.append(tw)
        shared.append(torch.randn(tokens[r], hidden).to(torch.bfloat16) if r % 2 == 0 else None)
        weights.append(make_weights(num_local, hidden, inter, wfmt, seed=seed + 10 * r + 2))
    outs = reference.forward_simulated(
        xs,
        x_scales,
        idxs,
        tws,
        [w["w13"] for w in weights],
        [w["w13_scale"] for w in weights],
        [w["w2"] for w in weights],
        [w["w2_scale"] for w in weights],
        shared,
        num_experts,
        cap,
        limit,
    )
    w13_64 = np.concatenate([weight64(w["w13"], w["w13_scale"]) for w in weights])  # global expert order
    w2_64 = np.concatenate([weight64(w["w2"], w["w2_scale"]) for w in weights])
    for r in range(ep_size):
        assert outs[r].dtype == torch.bfloat16 and outs[r].shape == (tokens[r], hidden)
        if tokens[r] == 0:
            continue
        x64 = act64(xs[r], x_scales[r])
        ids, tw = idxs[r].numpy().astype(np.int64), tws[r].numpy().astype(np.float64)
        expect = np.zeros((tokens[r], hidden))
        for t in range(tokens[r]):
            for e in sorted(set(ids[t].tolist()) - {-1}):
                w = tw[t][ids[t] == e].sum()
                expect[t] += expert_mlp64(x64[t : t + 1], w13_64[e], w2_64[e], np.array([w]), limit, act == "fp8", 128)[
                    0
                ]
        if shared[r] is not None:
            expect += shared[r].float().numpy()
        assert_gemm_close(outs[r], torch.from_numpy(bf16_round(expect)), f"rank {r} of {ep_size}")


def test_forward_s1_matches_forward_simulated(rng):
    wts = make_weights(4, 128, 128, "fp8", seed=3)
    x, x_s = make_activations(5, 128, "fp8", 128, seed=4)
    idx, tw = make_routing(5, 2, 4, seed=5)
    args = (x, x_s, idx, tw, wts["w13"], wts["w13_scale"], wts["w2"], wts["w2_scale"])
    one = reference.forward(*args, None, 4, 8, None, "", 0, 1)
    sim = reference.forward_simulated(*[[a] for a in args], None, 4, 8, None)[0]
    assert_equal(one, sim)
    assert math.isfinite(float(one.float().abs().sum()))
