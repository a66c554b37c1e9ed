"""Pure-torch reference ops: the executable spec (docs/spec.md). Each has the same signature as its op in
``torch.ops.static_moe``; every backend is tested against these."""

from .expert_gemm import expert_gemm
from .forward import forward, forward_simulated
from .local_experts import local_experts
from .pack_rows import pack_rows, unpack_rows
from .quantize_weight import quantize_weight
from .swiglu_and_cast import swiglu_and_cast

__all__ = [
    "pack_rows",
    "unpack_rows",
    "swiglu_and_cast",
    "expert_gemm",
    "local_experts",
    "forward",
    "forward_simulated",
    "quantize_weight",
]
