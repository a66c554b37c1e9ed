"""Python side of the ``torch.ops.static_moe`` ops: one module per op with its wrapper and fake kernel."""

from .expert_gemm import expert_gemm
from .forward import forward
from .local_experts import local_experts
from .pack_rows import pack_rows, unpack_rows
from .quantize_weight import quantize_weight
from .swiglu_and_cast import swiglu_and_cast

__all__ = ["pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts", "forward", "quantize_weight"]
