"""Numerics helpers shared by tests and benchmarks: the SPEC §2 tolerance checks in one place."""

from __future__ import annotations

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 − 2·Σxy / (Σx² + Σy²)`` in float64 (0 for identical tensors; 0 when both are all zero)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def assert_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bitwise equality, dtype and shape included (NaNs compare by bits)."""
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    a = out.contiguous().view(torch.uint8) if out.numel() else out
    b = ref.contiguous().view(torch.uint8) if ref.numel() else ref
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}")


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """SPEC §2 for expert GEMM, local experts and forward: calc_diff < 1e-5 and
    ``|out − ref| ≤ 2^-7·|ref| + 1e-3·max|ref|`` elementwise; no NaN anywhere."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double(), ref.double()
    assert not torch.isnan(o).any(), f"{what}: output has NaN"
    if r.numel() == 0:
        return
    d = calc_diff(o, r)
    assert d < 1e-5, f"{what}: calc_diff {d:.3e} ≥ 1e-5"
    bound = 2.0**-7 * r.abs() + 1e-3 * r.abs().max()
    err = (o - r).abs()
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: |out−ref| {err.flatten()[i]:.4g} > bound {bound.flatten()[i]:.4g} at flat index {i} "
            f"(out {o.flatten()[i]:.6g}, ref {r.flatten()[i]:.6g})"
        )


def assert_gemm_bitwise(
    out: torch.Tensor, ref: torch.Tensor, what: str = "", min_equal_fraction: float = 0.99, max_bias: float = 2.0**-12
) -> None:
    """For backends that claim bitwise agreement with the reference (the CPU kernels, on every ISA): the SPEC §2
    bound of :func:`assert_gemm_close`, and on top at least ``min_equal_fraction`` of the outputs bitwise equal
    and a near-zero signed error, ``|Σ (out − ref)·sign(ref)| ≤ max_bias · Σ|ref|``.

    Why both: the loose bound lets through a kernel that rounds bf16 toward zero (half the outputs move by up to
    one ulp, 2^-8 relative, always toward zero); the equal fraction catches that, and the signed-error bound
    catches a systematic drift hidden in few elements (truncation shifts the mean by about 2^-9 relative, 8× the
    bound; honest kernels differ from the reference only in the last bit of ≤ 1 % of outputs, in both
    directions). Two differing outputs are always allowed, so tiny outputs are not held to more than 99 %.

    Only the loose bound (assert_gemm_close) holds for the CUDA kernels (MMA accumulation order), the NKI kernels on
    the real simulator / hardware (PE-array order, activation tables), and bf16 inputs with subnormal values on
    avx512bf16 (vdpbf16ps reads them as zero)."""
    assert_gemm_close(out, ref, what)
    if ref.numel() == 0:
        return
    o, r = out.contiguous(), ref.contiguous()
    bits = {2: torch.int16, 4: torch.int32}[o.element_size()]
    differ = int((o.view(bits) != r.view(bits)).sum())
    allowed = int((1 - min_equal_fraction) * r.numel()) + 2  # + 2: tiny outputs may still differ in a last bit
    assert differ <= allowed, (
        f"{what}: {differ} of {r.numel()} outputs differ in their bits (allowed {allowed}: "
        f"at least {min_equal_fraction:.0%} must be bitwise equal)"
    )
    od, rd = o.double(), r.double()
    total = rd.abs().sum().item()
    bias = ((od - rd) * rd.sign()).sum().item()
    assert abs(bias) <= max_bias * total, (
        f"{what}: signed error {bias:.4g} = {bias / max(total, 1e-300):.3g} of Σ|ref| (bound {max_bias:.3g}): "
        "outputs drift in one direction"
    )


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Size of one bf16 ulp at each |x| (float32)."""
    a = x.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    e = torch.floor(torch.log2(a))
    return torch.exp2(e - 7)


def assert_swiglu_close(
    out: tuple[torch.Tensor, torch.Tensor],
    ref: tuple[torch.Tensor, torch.Tensor],
    what: str = "",
    min_equal_fraction: float = 0.999,
    float_scales: bool = False,
) -> None:
    """SPEC §2 for swiglu_and_cast. bf16 out: within 1 bf16 ulp. fp8 out: scales bitwise equal, dequantized
    values within one fp8 step, and at least 99.9 % of bytes equal. ``float_scales`` (``pow2_scale=False`` on a
    backend whose sigmoid is not torch's): scales within 2^-20 relative instead (SPEC §6.2: amax / fp8_max keeps
    the last bits of the fp32 sigmoid, and torch's CPU sigmoid changes them with the tensor's length), each
    value dequantized with its own scale."""
    q, s = out
    rq, rs = ref
    assert q.dtype == rq.dtype and q.shape == rq.shape, (
        f"{what}: {q.dtype}{tuple(q.shape)} vs {rq.dtype}{tuple(rq.shape)}"
    )
    assert s.shape == rs.shape, f"{what}: scale shape {tuple(s.shape)} != {tuple(rs.shape)}"
    if q.dtype == torch.bfloat16:
        err = (q.float() - rq.float()).abs()
        ok = err <= bf16_ulp(rq)
        assert bool(ok.all()), f"{what}: {int((~ok).sum())} bf16 values beyond 1 ulp"
        return
    if float_scales:
        assert bool(((s - rs).abs() <= 2.0**-20 * rs.abs()).all()), f"{what}: scales differ beyond 2^-20 relative"
    else:
        assert_equal(s, rs, f"{what} scales")
    if q.numel() == 0:
        return
    g = q.shape[1] // s.shape[1]
    scale, rscale = s.repeat_interleave(g, dim=1), rs.repeat_interleave(g, dim=1)
    # float scales: a value one step off is dequantized with a scale up to 2^-20 off, hence the 2^-19 margin
    step = fp8_step(rq.float()) * rscale * (1 + 2.0**-19 if float_scales else 1.0)
    err = (q.float() * scale - rq.float() * rscale).abs()
    assert bool((err <= step).all()), f"{what}: fp8 values more than one step apart"
    same = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
    assert same >= min_equal_fraction, f"{what}: only {same:.4%} of fp8 bytes equal"


def fp8_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the e4m3fn grid around each value (subnormal spacing 2^-9 below 2^-6)."""
    a = v.abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def assert_rejected_untouched(op, args, exc: type, match: str) -> None:
    """``op(*args)`` must raise ``exc`` whose message matches the regex ``match``, leaving every CPU tensor
    argument bitwise as it was (SPEC §5: checks run before any buffer is touched)."""
    import pytest

    before = [t.clone() for t in args if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    with pytest.raises(exc, match=match):
        op(*args)
    after = [t for t in args if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    for t0, t1 in zip(before, after):
        assert_equal(t1, t0, "inputs untouched")


def assert_nonfinite_confined(
    out: tuple[torch.Tensor, torch.Tensor],
    clean: tuple[torch.Tensor, torch.Tensor],
    touched: torch.Tensor,
    nonfinite: torch.Tensor,
    what: str = "",
) -> None:
    """The swiglu_and_cast contract for non-finite values (NaN, ±inf in gate_up or row_weight; SPEC §1.5).

    ``out`` is the op on the poisoned input, ``clean`` the same op on the input with those values replaced by
    finite ones; ``touched`` bool [R, I] marks the outputs whose inputs were replaced, ``nonfinite`` bool [R, I]
    those whose fp32 SwiGLU value v is not finite (a clamp may have made a poisoned input finite).
    bf16 out: a non-finite v stays non-finite. fp8 out: a non-finite v dequantizes (``q.float() · s``) to NaN,
    and the other values of its group to NaN or ±0 — never to finite non-zero garbage. Everything outside the
    touched positions (bf16) or the groups holding them (fp8) is bitwise what the clean input gives: a
    non-finite value never leaks beyond its group."""
    q, s = out
    cq, cs = clean
    if q.dtype == torch.bfloat16:
        assert bool((~torch.isfinite(q.float()[nonfinite])).all()), f"{what}: a non-finite v came out finite"
        assert torch.equal(q.view(torch.int16)[~touched], cq.view(torch.int16)[~touched]), (
            f"{what}: outputs of untouched inputs changed"
        )
        return
    g = q.shape[1] // s.shape[1]
    groups = lambda m: m.reshape(q.shape[0], s.shape[1], g).any(dim=-1)  # noqa: E731  [R, I] -> [R, I/g]
    deq = q.float() * s.repeat_interleave(g, dim=1)
    assert bool(torch.isnan(deq[nonfinite]).all()), f"{what}: a non-finite v dequantizes to a number"
    in_bad_group = groups(nonfinite).repeat_interleave(g, dim=1)
    rest = deq[in_bad_group & ~nonfinite]
    garbage = ~(torch.isnan(rest) | (rest == 0))
    assert not bool(garbage.any()), (
        f"{what}: {int(garbage.sum())} values next to a non-finite v dequantize to finite non-zero garbage"
    )
    tg = groups(touched)
    t = tg.repeat_interleave(g, dim=1)
    assert torch.equal(q.view(torch.uint8)[~t], cq.view(torch.uint8)[~t]), f"{what}: q of untouched groups changed"
    assert torch.equal(s[~tg].view(torch.int32), cs[~tg].view(torch.int32)), f"{what}: untouched scales changed"
