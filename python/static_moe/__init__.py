"""static_moe: static-shape expert-parallel MoE decode ops for NKI (Trainium), CUDA and CPU.

``import static_moe`` loads the C++ extension (which registers every ``torch.ops.static_moe.*`` schema and its
CPU/CUDA kernels) and the Python side of each op (fake kernels for tracing, the forward's composite body).
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import (
    _C,  # noqa: F401  (loads the library: schemas + backend kernels)
    ops,  # noqa: F401  (fake kernels, Python-side op bodies)
    workspace,
)
from ._version import __version__
from .formats import (
    dequantize_activation,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
    quantize_weight_fp4,
    quantize_weight_fp8,
)
from .module import SharedExpert, StaticMoE
from .nki import dispatch as _nki_dispatch
from .ops import expert_gemm, forward, local_experts, pack_rows, swiglu_and_cast, unpack_rows
from .workspace import WorkspaceSpec, memory_plan

_nki_dispatch.register_neuron_kernels()  # NKI kernels as the Neuron-device impls; a no-op without torch-neuronx

__all__ = [
    "__version__",
    "pack_rows",
    "unpack_rows",
    "swiglu_and_cast",
    "expert_gemm",
    "local_experts",
    "forward",
    "StaticMoE",
    "SharedExpert",
    "WorkspaceSpec",
    "memory_plan",
    "workspace",
    "quantize_activation",
    "dequantize_activation",
    "quantize_weight",
    "quantize_weight_fp8",
    "quantize_weight_fp4",
    "dequantize_weight",
]
