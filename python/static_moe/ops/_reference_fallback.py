"""TEMPORARY (bootstrap only, to be deleted once every C++ CPU kernel exists): registers the pure-torch reference
as the CPU kernel of any static_moe op that has no CPU kernel yet, so work on the forward can start before the
C++ kernels land. An op whose C++ CPU kernel is registered is left alone."""

import torch

from .. import reference

for _name in ("pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts"):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"static_moe::{_name}", "CPU"):
        torch.library.impl(f"static_moe::{_name}", "CPU")(getattr(reference, _name))
