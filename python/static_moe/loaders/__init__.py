"""Loaders of a StaticMoE's weights, one module per source, each behind a public classmethod of the layer.

================  ======================================  ======================================================
module            classmethod                             source
================  ======================================  ======================================================
torch_modules     ``StaticMoE.from_module``               an nn.Module's float experts: transformers 5.x fused
                                                          ``gate_up_proj`` / ``down_proj``, grouped ``w1`` /
                                                          ``w3`` / ``w2`` tensors (DTensor shards included), or a
                                                          list of SwiGLU MLPs; a shared expert and its gate
deepseek          ``StaticMoE.from_deepseek_state_dict``  a checkpoint's MoE block: per-expert or fused keys,
                                                          bf16 / fp8 with 128×128 block scales / fp4 + UE8M0
checkpoint_       ``StaticMoE.from_checkpoint``           a safetensors checkpoint on disk (index + shards), this
experts           (and ``load_checkpoint_experts``)       rank's experts only, read lazily through
                                                          safetensors_sharded (docs/checkpoints.md)
================  ======================================  ======================================================

Every loader works in two collective steps (collective.py): read this rank's experts into checked EOI weights
(static_moe.module's checks, SPEC §1.2), then build the layer with ``cls(...)`` and store them through the
layer's own path; an error on any rank raises on every rank before any rank returns a layer. The loaders import
static_moe.module; the classmethods import their loader when called, so neither module imports the other at
load time.
"""
