"""Test helper: run the prepared ("eio") layout through the ops on CPU tensors.

The CPU kernels take nn.Linear ("eoi") weights only and refuse ``weight_layout="eio"`` (SPEC §1.2). To exercise
the paths that hand prepared weights to the ops — ``StaticMoE(prepare_for="trn2")``'s forward, opcheck of the
"eio" schema — on a machine without a Neuron device, :func:`cpu_kernels` registers, for the CPU dispatch key and
for the duration of a ``with`` block, another implementation of ``static_moe::expert_gemm`` and
``static_moe::local_experts``: the reference ops (the executable spec, both layouts) or the NKI kernels through
``static_moe.nki.dispatch`` (interpreter). Leaving the block removes the registrations, and the C++ CPU kernels
are what the ops run again.
"""

from __future__ import annotations

import contextlib
import warnings

import torch


@contextlib.contextmanager
def cpu_kernels(kind: str = "reference"):
    """Within the block, the CPU implementations of expert_gemm / local_experts are ``kind``'s: "reference"
    (static_moe.reference) or "nki" (static_moe.nki.dispatch, the NKI kernels through the interpreter)."""
    if kind == "reference":
        from .. import reference as impl
    elif kind == "nki":
        from ..nki import dispatch as impl
    else:
        raise ValueError(f"cpu_kernels: kind must be 'reference' or 'nki', got {kind!r}")
    lib = torch.library.Library("static_moe", "IMPL")
    try:
        with warnings.catch_warnings():
            # torch warns once that a kernel registered for the same key is overridden: that is the point here.
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            lib.impl("expert_gemm", impl.expert_gemm, "CPU")
            lib.impl("local_experts", impl.local_experts, "CPU")
        yield
    finally:
        lib._destroy()
