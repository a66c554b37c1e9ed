"""One MoE layer's routed experts from a safetensors checkpoint on disk, only this EP rank's, in SPEC §1.2 layouts.

``load_checkpoint_experts(path, family=..., layer=..., ep_rank=, ep_size=, weight_format=)`` reads the keys each
family ships (docs/checkpoints.md has the table), lazily (loaders/safetensors_sharded.py): each expert's tensors
are read one at a time, straight into preallocated outputs [L, …] (L = E / ep_size), so a rank's peak memory is its
own experts plus one tensor in flight, never the model's experts.

===========  ========================================================  ===============================================
family       keys under ``{prefix}`` (default prefix)                   stored formats
===========  ========================================================  ===============================================
deepseek_v3  ``{e}.{gate_proj|up_proj|down_proj}.weight`` [N, K],      float8_e4m3fn with float32 128×128 blocks
             ``….weight_scale_inv`` [⌈N/128⌉, ⌈K/128⌉]                  (expanded exactly to 1×128); bf16 / fp16 / fp32
             (``model.layers.{layer}.mlp.experts.``)
qwen3_moe    as deepseek_v3 (also Qwen2-MoE, DeepSeek-V2)               bf16 / fp16 / fp32
deepseek_v4  ``{e}.{w1|w3|w2}.weight``, ``….scale``                     fp4: int8 [N, K/2] + UE8M0 [N, K/32] (bit for
             (``layers.{layer}.ffn.experts.``)                          bit); fp8: float8_e4m3fn + UE8M0 or float32
                                                                        128×128 blocks (expanded); bf16
gpt_oss      ``{gate_up_proj|down_proj}_{blocks|scales|bias}``          MXFP4: uint8 blocks [E, N, K/32, 16] (e2m1,
             (``model.layers.{layer}.mlp.experts.``), gate/up rows      low nibble first) + E8M0 [E, N, K/32] (bit for
             interleaved (even rows gate, odd rows up)                  bit); biases [E, N] kept as given
===========  ========================================================  ===============================================

Conversions: ``weight_format=None`` keeps the stored format; float experts are quantized on load to "fp8" / "fp4"
by the C++ kernel (``torch.ops.static_moe.quantize_weight``, bitwise the Python quantizers); a quantized checkpoint
is never re-quantized to another format (ValueError). Errors name the tensor and its file: a missing one, one the
family does not know under the experts' prefix (extra), a shape or dtype other than the first expert's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time

import torch

from ..formats import WEIGHT_FP4_BLOCK, WEIGHT_FP8_BLOCK
from ..progress import progress_bar
from .safetensors_sharded import ShardedSafetensors

logger = logging.getLogger("static_moe")

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
_FP4_WEIGHT = (torch.int8, torch.uint8)
_UE8M0 = (torch.float8_e8m0fnu, torch.uint8)


@dataclasses.dataclass(frozen=True)
class _Family:
    prefix: str  # with {layer}
    fused_mxfp4: bool = False  # gpt_oss
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    scale_suffixes: tuple[str, ...] = ("weight_scale_inv",)


FAMILIES = {
    "deepseek_v3": _Family("model.layers.{layer}.mlp.experts."),
    "qwen3_moe": _Family("model.layers.{layer}.mlp.experts."),
    "deepseek_v4": _Family("layers.{layer}.ffn.experts.", names=("w1", "w3", "w2"), scale_suffixes=("scale",)),
    "gpt_oss": _Family("model.layers.{layer}.mlp.experts.", fused_mxfp4=True),
}


@dataclasses.dataclass
class CheckpointExperts:
    """This rank's experts of one layer, in the layer's format, EOI (SPEC §1.2), on the CPU.

    ``w13`` [L, 2I, H/p] (gate rows, then up rows), ``w2`` [L, H, I/p] (p = 2 for fp4, else 1); scales float32
    [L, N, K/128] (fp8), uint8 UE8M0 [L, N, K/32] (fp4), None (bf16). ``w13_bias`` [L, 2I] / ``w2_bias`` [L, H]
    when the checkpoint has biases (gpt_oss; SPEC §1.9). ``expert_offset`` is the global id of
    expert 0 here. ``StaticMoE.set_expert_weights(**experts.expert_weights())`` stores them in a layer built with
    the same (hidden_size, intermediate_size, num_experts, weight_format, ep_size); ``StaticMoE.from_checkpoint``
    does both."""

    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    weight_format: str
    num_experts: int
    expert_offset: int
    hidden_size: int
    intermediate_size: int
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def expert_weights(self) -> dict[str, torch.Tensor | None]:
        return {"w13": self.w13, "w13_scale": self.w13_scale, "w2": self.w2, "w2_scale": self.w2_scale}

    @property
    def nbytes(self) -> int:
        ts = (self.w13, self.w13_scale, self.w2, self.w2_scale, self.w13_bias, self.w2_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def load_checkpoint_experts(
    path: str | os.PathLike,
    *,
    family: str,
    layer: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    weight_format: str | None = None,
    prefix: str | None = None,
    progress: bool | None = None,
) -> CheckpointExperts:
    """Read layer ``layer``'s routed experts ``ep_rank·L … ep_rank·L+L−1`` (L = E / ep_size) from the checkpoint at
    ``path`` (a directory with ``model.safetensors.index.json`` + shards or ``model.safetensors``, an index, or a
    ``.safetensors`` file). ``family``: one of ``FAMILIES`` (the key layout); ``prefix`` overrides the family's
    experts prefix (``{layer}`` is filled in). ``weight_format``: None (as stored), "bf16" (float checkpoints),
    "fp8" / "fp4" (float checkpoints quantized on load, or the same quantized format). ``progress``: a tqdm bar
    (None: when stderr is a terminal and the load is large; static_moe.progress). Local to this process: each rank
    calls it for its own experts (no collective)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if weight_format not in (None, "bf16", "fp8", "fp4"):
        raise ValueError(f"weight_format must be None, 'bf16', 'fp8' or 'fp4', got {weight_format!r}")
    for name, v in (("layer", layer), ("ep_size", ep_size), ("ep_rank", ep_rank)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "ep_size" else 0):
            raise ValueError(f"{name} must be an int ≥ {1 if name == 'ep_size' else 0}, got {v!r}")
    if ep_rank >= ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
    fam = FAMILIES[family]
    base = (prefix if prefix is not None else fam.prefix).format(layer=layer)
    start = time.perf_counter()
    with ShardedSafetensors(path) as ck:
        if fam.fused_mxfp4:
            out = _load_mxfp4_fused(ck, base, ep_rank, ep_size, weight_format, progress)
        else:
            out = _load_per_expert(ck, base, fam, ep_rank, ep_size, weight_format, progress)
    dt = time.perf_counter() - start
    logger.info(
        "loaded experts %d…%d of %d (%s, layer %d) from %s: %.1f MB in %.2f s",
        out.expert_offset,
        out.expert_offset + out.w13.shape[0] - 1,
        out.num_experts,
        out.weight_format,
        layer,
        os.fspath(path),
        out.nbytes / 1e6,
        dt,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------------
def _local_range(num_experts: int, ep_rank: int, ep_size: int, where: str) -> tuple[int, int]:
    if num_experts % ep_size:
        raise ValueError(f"{where} holds {num_experts} experts, not divisible by ep_size={ep_size}")
    n = num_experts // ep_size
    return ep_rank * n, n


def _expect(ck: ShardedSafetensors, key: str, dtypes: tuple, shape: tuple | None, what: str) -> tuple:
    """(dtype, shape) of ``key``, checked: TypeError / ValueError naming the key and its file."""
    dtype, got, file = ck.info(key)
    if dtype not in dtypes:
        raise TypeError(f"{key} in {file}: {what} must have dtype {' or '.join(map(str, dtypes))}, got {dtype}")
    if shape is not None and got != tuple(shape):
        raise ValueError(f"{key} in {file}: {what} must have shape {list(shape)}, got {list(got)}")
    return dtype, got


def _ue8m0_bytes(key: str, ck: ShardedSafetensors, s: torch.Tensor) -> torch.Tensor:
    s = s.view(torch.uint8)
    if bool((s == 255).any()):
        raise ValueError(f"{key} in {ck.file_of(key)}: UE8M0 byte 255 (NaN) is not a scale")
    return s


def _quantize_into(w: torch.Tensor, fmt: str, q_out: torch.Tensor, s_out: torch.Tensor, key: str, file: str):
    from ..ops.quantize_weight import quantize_weight

    try:
        q, s = quantize_weight(w, fmt)
    except ValueError as e:  # NaN / Inf: name the checkpoint tensor, not the kernel's argument
        raise ValueError(f"{key} in {file}: {e}") from None
    q_out.copy_(q.view(q_out.dtype))
    s_out.copy_(s)


# ----------------------------------------------------------------------------------------------------------------
# Per-expert keys: deepseek_v3 / qwen3_moe / deepseek_v4
# ----------------------------------------------------------------------------------------------------------------
_EXPERT_KEY = re.compile(r"^(\d+)\.(.+)$")


def _load_per_expert(ck, base, fam: _Family, ep_rank, ep_size, weight_format, progress) -> CheckpointExperts:
    # Which experts and which tensors exist under the prefix: everything must be a weight or a scale we know.
    known_tails = {f"{n}.weight" for n in fam.names} | {f"{n}.{s}" for n in fam.names for s in fam.scale_suffixes}
    experts = set()
    for key in ck.keys():
        if not key.startswith(base):
            continue
        m = _EXPERT_KEY.match(key[len(base) :])
        if m is None or m.group(2) not in known_tails:
            raise ValueError(
                f"{key} in {ck.file_of(key)}: not an expert tensor this loader knows under {base!r} "
                f"(expected {base}{{e}}.{{{'|'.join(sorted(known_tails))}}})"
            )
        experts.add(int(m.group(1)))
    if not experts:
        raise KeyError(f"{base}{{e}}.{fam.names[0]}.weight: no such tensors in {ck.source}")
    num_experts = max(experts) + 1
    for e in range(num_experts):
        if e not in experts:
            raise KeyError(f"{base}{e}.{fam.names[0]}.weight: no such tensor in {ck.source} (expert {e} missing)")
    first, count = _local_range(num_experts, ep_rank, ep_size, f"{ck.source} under {base!r}")

    # The first expert fixes the stored format and the shapes.
    g0 = f"{base}0.{fam.names[0]}.weight"
    d0 = f"{base}0.{fam.names[2]}.weight"
    dtype, (i_rows, k_gate) = _expect(ck, g0, _FLOAT + (torch.float8_e4m3fn,) + _FP4_WEIGHT, None, "a gate weight")
    stored = "bf16" if dtype in _FLOAT else "fp8" if dtype == torch.float8_e4m3fn else "fp4"
    pack = 2 if stored == "fp4" else 1
    hidden, inter = k_gate * pack, i_rows
    target = weight_format or stored
    if stored != "bf16" and target != stored:
        raise ValueError(
            f"{g0} in {ck.file_of(g0)}: the checkpoint stores {stored} experts; converting them to {target} would "
            f"quantize twice. Load them as {stored} (weight_format=None)."
        )
    _expect(ck, d0, (dtype,), (hidden, inter // pack), "a down weight")
    out = _alloc(count, hidden, inter, target)
    shapes = {0: (inter, hidden // pack), 1: (inter, hidden // pack), 2: (hidden, inter // pack)}
    bar = progress_bar(
        total=out_bytes(out), desc=f"static_moe: experts {first}…{first + count - 1} of {base}", enable=progress
    )
    try:
        for local in range(count):
            e = first + local
            for part, name in enumerate(fam.names):
                key = f"{base}{e}.{name}.weight"
                if key not in ck:
                    raise KeyError(f"{key}: no such tensor in {ck.source}")
                n, kk = shapes[part]
                _expect(ck, key, (dtype,) if stored != "fp4" else _FP4_WEIGHT, (n, kk), f"expert {e}'s {name}")
                w_dst, s_dst = _destination(out, part, local, inter)
                scale_key = next(
                    (f"{base}{e}.{name}.{s}" for s in fam.scale_suffixes if f"{base}{e}.{name}.{s}" in ck), None
                )
                _convert_one(ck, key, scale_key, stored, target, n, kk * pack, w_dst, s_dst)
                bar.update(
                    w_dst.numel() * w_dst.element_size()
                    + (0 if s_dst is None else s_dst.numel() * s_dst.element_size())
                )
    finally:
        bar.close()
    return CheckpointExperts(
        **out,
        weight_format=target,
        num_experts=num_experts,
        expert_offset=first,
        hidden_size=hidden,
        intermediate_size=inter,
    )


def _alloc(count: int, hidden: int, inter: int, fmt: str) -> dict:
    from ..module import _SCALE_DTYPE, _WEIGHT_DTYPE, _weight_shapes

    shapes = _weight_shapes(count, hidden, inter, fmt)
    out = {}
    for name, shape in shapes.items():
        if shape is None:
            out[name] = None
        else:
            dtype = _SCALE_DTYPE[fmt] if name.endswith("_scale") else _WEIGHT_DTYPE[fmt]
            out[name] = torch.empty(shape, dtype=dtype)
    return out


def out_bytes(out: dict) -> int:
    return sum(t.numel() * t.element_size() for t in out.values() if t is not None)


def _destination(out: dict, part: int, local: int, inter: int):
    """(weight rows, scale rows) of ``out`` where part 0 (gate), 1 (up) or 2 (down) of expert ``local`` goes."""
    if part == 2:
        return out["w2"][local], None if out["w2_scale"] is None else out["w2_scale"][local]
    rows = slice(0, inter) if part == 0 else slice(inter, 2 * inter)
    return out["w13"][local, rows], None if out["w13_scale"] is None else out["w13_scale"][local, rows]


def _convert_one(ck, key, scale_key, stored, target, n, k, w_dst, s_dst) -> None:
    """One checkpoint linear [N, K] (K in elements) into ``w_dst`` / ``s_dst`` in ``target``."""
    file = ck.file_of(key)
    if stored == "bf16":
        if scale_key is not None:
            raise ValueError(f"{scale_key} in {ck.file_of(scale_key)}: a float weight ({key}) must not have a scale")
        w = ck.read(key)
        if target == "bf16":
            if w.is_floating_point() and not bool(torch.isfinite(w).all()):
                raise ValueError(f"{key} in {file}: NaN or Inf in a float weight")
            w_dst.copy_(w)
        else:
            _quantize_into(w, target, w_dst, s_dst, key, file)
        return
    if scale_key is None:
        raise KeyError(f"{key} in {file}: {stored} weights need a scale tensor; none of its scale names is present")
    s_dtype, s_shape, s_file = ck.info(scale_key)
    if stored == "fp4":
        _expect(ck, scale_key, _UE8M0, (n, k // WEIGHT_FP4_BLOCK), "an fp4 weight's UE8M0 scale (1×32)")
        w_dst.copy_(ck.read(key).view(torch.uint8))
        s_dst.copy_(_ue8m0_bytes(scale_key, ck, ck.read(scale_key)))
        return
    # fp8: 128×128 blocks [⌈N/128⌉, ⌈K/128⌉], float32 (DeepSeek-V3) or UE8M0 (DeepSeek-V4); to exact 1×128 float32
    if k % WEIGHT_FP8_BLOCK:
        raise ValueError(f"{key} in {file}: K={k} must be a multiple of {WEIGHT_FP8_BLOCK} for fp8 weights")
    blocks = (-(-n // WEIGHT_FP8_BLOCK), k // WEIGHT_FP8_BLOCK)
    _expect(ck, scale_key, (torch.float32,) + _UE8M0, blocks, "an fp8 weight's 128×128 block scale")
    w = ck.read(key)
    if bool(((w.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError(f"{key} in {file}: float8_e4m3fn bytes 0x7F/0xFF are NaN, not weights")
    s = ck.read(scale_key)
    if s.dtype == torch.float32:
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            raise ValueError(f"{scale_key} in {s_file}: fp8 block scales must be positive and finite")
        sf = s
    else:
        b = _ue8m0_bytes(scale_key, ck, s).to(torch.int32)
        sf = torch.ldexp(torch.ones(b.shape, dtype=torch.float32), b - 127)  # exact: 2^(b−127)
    w_dst.copy_(w)
    s_dst.copy_(sf.repeat_interleave(WEIGHT_FP8_BLOCK, dim=0)[:n])


# ----------------------------------------------------------------------------------------------------------------
# gpt-oss MXFP4: fused per layer, interleaved gate/up rows
# ----------------------------------------------------------------------------------------------------------------
_MXFP4_TAILS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


def _load_mxfp4_fused(ck, base, ep_rank, ep_size, weight_format, progress) -> CheckpointExperts:
    for key in ck.keys():
        if key.startswith(base) and key[len(base) :] not in _MXFP4_TAILS:
            raise ValueError(
                f"{key} in {ck.file_of(key)}: not an MXFP4 experts tensor under {base!r} "
                f"(expected {base}{{{'|'.join(_MXFP4_TAILS)}}})"
            )
    for tail in _MXFP4_TAILS[:2] + _MXFP4_TAILS[3:5]:
        if f"{base}{tail}" not in ck:
            raise KeyError(f"{base}{tail}: no such tensor in {ck.source}")
    gub, dnb = f"{base}gate_up_proj_blocks", f"{base}down_proj_blocks"
    _, (num_experts, two_i, h_blocks, sixteen) = _expect(ck, gub, (torch.uint8,), None, "MXFP4 blocks")
    if sixteen != 16 or two_i % 2:
        raise ValueError(f"{gub} in {ck.file_of(gub)}: must be [E, 2I, H/32, 16], got {list(ck.info(gub)[1])}")
    hidden, inter = h_blocks * 32, two_i // 2
    i_blocks = inter // 32
    _expect(ck, dnb, (torch.uint8,), (num_experts, hidden, i_blocks, 16), "MXFP4 blocks")
    if inter % 32:
        raise ValueError(f"{gub} in {ck.file_of(gub)}: I = {inter} must be a multiple of 32 for MXFP4")
    _expect(ck, f"{base}gate_up_proj_scales", _UE8M0, (num_experts, two_i, h_blocks), "E8M0 scales")
    _expect(ck, f"{base}down_proj_scales", _UE8M0, (num_experts, hidden, i_blocks), "E8M0 scales")
    has_bias = [f"{base}{t}" in ck for t in ("gate_up_proj_bias", "down_proj_bias")]
    bias_dtypes = (None, None)
    if any(has_bias):  # both or neither: a missing one is named
        bias_dtypes = (
            _expect(ck, f"{base}gate_up_proj_bias", _FLOAT, (num_experts, two_i), "a bias")[0],
            _expect(ck, f"{base}down_proj_bias", _FLOAT, (num_experts, hidden), "a bias")[0],
        )
    if weight_format not in (None, "fp4"):
        raise ValueError(
            f"{gub} in {ck.file_of(gub)}: the checkpoint stores fp4 (MXFP4) experts; converting them to "
            f"{weight_format} would quantize twice. Load them as fp4 (weight_format=None)."
        )
    first, count = _local_range(num_experts, ep_rank, ep_size, gub)
    out = _alloc(count, hidden, inter, "fp4")
    # biases keep their stored dtype (gpt-oss ships bf16)
    w13_bias = torch.empty(count, two_i, dtype=bias_dtypes[0]) if any(has_bias) else None
    w2_bias = torch.empty(count, hidden, dtype=bias_dtypes[1]) if any(has_bias) else None
    bar = progress_bar(
        total=out_bytes(out), desc=f"static_moe: experts {first}…{first + count - 1} of {base}", enable=progress
    )
    try:
        for local in range(count):
            e = first + local
            # Rows 2j are gate row j and 2j+1 up row j (gpt-oss's gate_up[..., ::2] / [..., 1::2]): de-interleave.
            gu = ck.read(gub, e, 1)[0].reshape(two_i, hidden // 2)
            gus = _ue8m0_bytes(f"{base}gate_up_proj_scales", ck, ck.read(f"{base}gate_up_proj_scales", e, 1)[0])
            out["w13"][local, :inter] = gu[0::2]
            out["w13"][local, inter:] = gu[1::2]
            out["w13_scale"][local, :inter] = gus[0::2]
            out["w13_scale"][local, inter:] = gus[1::2]
            out["w2"][local] = ck.read(dnb, e, 1)[0].reshape(hidden, inter // 2)
            out["w2_scale"][local] = _ue8m0_bytes(
                f"{base}down_proj_scales", ck, ck.read(f"{base}down_proj_scales", e, 1)[0]
            )
            if w13_bias is not None:
                b = ck.read(f"{base}gate_up_proj_bias", e, 1)[0]
                w13_bias[local, :inter] = b[0::2]
                w13_bias[local, inter:] = b[1::2]
                w2_bias[local] = ck.read(f"{base}down_proj_bias", e, 1)[0]
            bar.update(out_bytes(out) // count)
    finally:
        bar.close()
    return CheckpointExperts(
        **out,
        weight_format="fp4",
        num_experts=num_experts,
        expert_offset=first,
        hidden_size=hidden,
        intermediate_size=inter,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
    )


# What a family's experts compute besides their weights, as constructor options: fixed ones, and ones read from the
# checkpoint's config.json {argument: (config key, default)} (the defaults are transformers' config classes').
# gpt-oss: biases and the clamped alpha-GLU ("swiglu_oai", SPEC §1.9) with GptOssConfig's swiglu_alpha /
# swiglu_limit (what GptOssExperts reads); DeepSeek-V4: SiLU with DeepseekV4Config's swiglu_limit clamp.
_FAMILY_FIXED = {"gpt_oss": {"activation": "swiglu_oai", "expert_biases": True}}
_FAMILY_CONFIG = {
    "gpt_oss": {"alpha": ("swiglu_alpha", 1.702), "swiglu_limit": ("swiglu_limit", 7.0)},
    "deepseek_v4": {"swiglu_limit": ("swiglu_limit", 10.0)},
}


def checkpoint_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` beside the checkpoint at ``path`` (the directory itself, or the directory of the index or
    ``.safetensors`` file given) as a dict; {} when there is none. A text config nested under ``text_config`` (the
    multimodal layout) is merged over the top level."""
    import json

    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    file = os.path.join(directory, "config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: a model config must be a JSON object")
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def family_options(family: str, path, options: dict) -> dict:
    """The caller's constructor ``options`` completed with what the family's experts compute: gpt_oss
    ``activation="swiglu_oai"``, ``expert_biases=True``, ``alpha`` / ``swiglu_limit`` from the checkpoint's
    config.json (``swiglu_alpha`` / ``swiglu_limit``); deepseek_v4 ``swiglu_limit``. A value the config does not
    give is the caller's, else transformers' default for the family. A caller's value that contradicts the family
    or its config is a ValueError naming the argument: never a layer that computes something else."""
    out = dict(options)
    for arg, value in _FAMILY_FIXED.get(family, {}).items():
        if out.setdefault(arg, value) != value:
            raise ValueError(f"{arg}: {family} experts need {arg}={value!r} (SPEC §1.9), got {out[arg]!r}")
    read = _FAMILY_CONFIG.get(family, {})
    cfg = checkpoint_config(path) if read else {}
    for arg, (key, default) in read.items():
        if key in cfg:
            value, source = cfg[key], f"{key} in the checkpoint's config.json"
            if arg in out and out[arg] != value:
                raise ValueError(f"{arg}={out[arg]!r} contradicts {key}={value!r} in the checkpoint's config.json")
        elif arg in options:
            value, source = options[arg], "the argument"
        else:
            value, source = default, f"transformers' default {key} (no config.json value)"
        out[arg] = value
        logger.info("%s experts: %s = %s (%s)", family, arg, value, source)
    return out


def from_checkpoint(
    cls,
    path,
    *,
    family: str,
    layer: int,
    top_k: int,
    capacity: int,
    weight_format: str | None = None,
    prefix: str | None = None,
    ep_group=None,
    ep_size: int | None = None,
    progress: bool | None = None,
    **options,
):
    """``cls.from_checkpoint(...)`` (StaticMoE.from_checkpoint documents the arguments): a layer of class ``cls``
    holding this rank's experts of ``layer``, read with :func:`load_checkpoint_experts`, with the options its
    family needs (:func:`family_options`) and its biases when the checkpoint has them."""
    from ..module import _check_ep_size, ep_group_info
    from .collective import collectively

    size, rank, _ = ep_group_info(ep_group)
    stage = "StaticMoE.from_checkpoint"

    def read():
        _check_ep_size(ep_size, size)
        opts = family_options(family, path, options)
        got = load_checkpoint_experts(
            path,
            family=family,
            layer=layer,
            ep_rank=rank,
            ep_size=size,
            weight_format=weight_format,
            prefix=prefix,
            progress=progress,
        )
        if got.w13_bias is not None and not opts.get("expert_biases", False):  # never drop them silently
            raise ValueError(
                f"expert_biases: the {family} checkpoint has expert biases (gate_up_proj_bias / down_proj_bias); "
                "build the layer with expert_biases=True"
            )
        return got, opts

    got, opts = collectively(ep_group, size, stage, read)
    m = cls(
        got.hidden_size,
        got.intermediate_size,
        got.num_experts,
        top_k,
        capacity,
        weight_format=got.weight_format,
        ep_group=ep_group,
        ep_size=ep_size,
        **opts,
    )

    def store():
        m.set_expert_weights(**got.expert_weights())
        if got.w13_bias is not None:
            m.set_expert_biases(got.w13_bias, got.w2_bias)

    collectively(ep_group, size, stage, store, cleanup=m.close)
    return m
