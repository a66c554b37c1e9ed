"""The gated activations and the expert-bias rule of SPEC §1.9, shared by the reference ops, the Python checks of
the module and the integrations.

``gated(g, u, activation, alpha)`` is the activation on float32 halves (after the §1.4 clamp); the kernels compute
the same functions (csrc/cpu/kernels/swiglu_and_cast.h, csrc/cuda/swiglu_and_cast.cuh)."""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")
DEFAULT_ALPHA = 1.702  # gpt-oss's swiglu_alpha
# gelu_tanh's constants as float32 scalars (the kernels' kGeluTanh = 2·sqrt(2/π) and kGeluCubic).
_GELU_TANH = torch.tensor(2.0 * math.sqrt(2.0 / math.pi), dtype=torch.float32)
_GELU_CUBIC = torch.tensor(0.044715, dtype=torch.float32)


def check_activation(activation, alpha, op: str) -> str:
    """``activation`` one of :data:`ACTIVATIONS` and ``alpha`` positive and finite in float32 (ValueError naming
    the argument otherwise, the messages of csrc/checks/activation.h); returns the activation."""
    if activation not in ACTIVATIONS:
        raise ValueError(f'{op}: activation must be "silu", "swiglu_oai" or "gelu_tanh", got "{activation}"')
    ok = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0
    if ok:
        f32 = torch.tensor(float(alpha), dtype=torch.float64).to(torch.float32).item()
        ok = math.isfinite(f32) and f32 > 0
    if not ok:
        raise ValueError(f"{op}: alpha must be a positive finite number (finite and positive in float32), got {alpha}")
    return activation


def check_bias(bias: torch.Tensor | None, op: str, name: str, shape: tuple[int, int], like: torch.Tensor) -> None:
    """None, or float32 / bf16 ``shape`` on ``like``'s device (TypeError for the dtype, ValueError otherwise)."""
    if bias is None:
        return
    if bias.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{op}: {name} must have dtype torch.float32 or torch.bfloat16, got {bias.dtype}")
    if tuple(bias.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(bias.shape)}")
    if bias.device != like.device:
        raise ValueError(f"{op}: {name} must be on the same device as x ({like.device}), got {bias.device}")


def gated(g: torch.Tensor, u: torch.Tensor, activation: str, alpha: float) -> torch.Tensor:
    """The activation of SPEC §1.9 on the (clamped) float32 gate and up halves, unweighted, in the spec's order:
    silu ``g·σ(g)·u``; swiglu_oai ``(u + 1)·(g·σ(α·g))``; gelu_tanh ``g·σ(2√(2/π)·(g + 0.044715·g³))·u``, which
    is torch's ``gelu(g, approximate="tanh")·u`` (``0.5·(1 + tanh y) = σ(2y)``) without its cancellation in
    ``1 + tanh`` for large negative g."""
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    if activation == "swiglu_oai":
        return (u + 1) * (g * torch.sigmoid(g * torch.tensor(alpha, dtype=torch.float32, device=g.device)))
    if activation == "gelu_tanh":
        c, c3 = _GELU_TANH.to(g.device), _GELU_CUBIC.to(g.device)
        y = c * (g + ((c3 * g) * g) * g)
        return (g * torch.sigmoid(y)) * u
    raise ValueError(f"unknown activation {activation!r}")
