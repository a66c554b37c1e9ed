"""Values the op and the layer must refuse on one process (docs/errors.md): ids checked in their own dtype before any
narrowing (the reference too), the S = 1 step's weight-scale checks, load_state_dict's validation of every key it
copies (and no copy when it raises), and the smaller definitions: unpack_rows dtypes, copies of a layer, an
oversized capacity, an unknown STATIC_MOE_NKI."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

from static_moe import reference
from static_moe.module import StaticMoE
from static_moe.testing.generators import make_activations, make_routing, make_weights

H, I, L, K, C = 128, 128, 2, 2, 4


def _op_args(wfmt: str = "bf16", index_dtype=torch.int32) -> dict:
    w = make_weights(L, H, I, wfmt, seed=1)
    x, xs = make_activations(3, H, "bf16", seed=2)
    idx, tw = make_routing(3, K, L, seed=3, index_dtype=index_dtype)
    return dict(x=x, x_scale=xs, topk_idx=idx, topk_weights=tw, **w, shared_output=None)


def _call(args: dict, fn=torch.ops.static_moe.forward, capacity=C):
    return fn(
        args["x"],
        args["x_scale"],
        args["topk_idx"],
        args["topk_weights"],
        args["w13"],
        args["w13_scale"],
        args["w2"],
        args["w2_scale"],
        args["shared_output"],
        L,
        capacity,
        None,
        "",
        0,
        1,
    )


# --- ids in their own dtype -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_id", [2**32 + 1, 2**32 - 1, -(2**32), 2**31])
def test_reference_forward_checks_int64_ids_before_narrowing(bad_id):
    args = _op_args(index_dtype=torch.int64)
    args["topk_idx"][0, 0] = bad_id
    with pytest.raises(ValueError, match=r"topk_idx must hold global expert ids in \[-1, 2\)"):
        _call(args, fn=reference.forward)


def test_reference_local_experts_offset_does_not_wrap():
    """ids 0 are not expert 2^32's: an int32 tensor compared with the Python offset must not wrap it."""
    args = _op_args()
    idx = torch.zeros_like(args["topk_idx"])
    out = reference.local_experts(
        args["x"], None, idx, args["topk_weights"], args["w13"], None, args["w2"], None, 2**32, None
    )
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("bad_id", [2**32 + 1, -(2**32)])
def test_op_s1_checks_int64_ids(bad_id):
    args = _op_args(index_dtype=torch.int64)
    args["topk_idx"][1, 1] = bad_id
    with pytest.raises(ValueError, match="topk_idx must hold global expert ids"):
        _call(args)


# --- the S = 1 step's value checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["w13_scale", "w2_scale"])
def test_op_s1_rejects_nonfinite_fp8_weight_scale(name, bad):
    args = _op_args("fp8")
    args[name] = args[name].clone()
    args[name][1, 0, 0] = bad
    with pytest.raises(ValueError, match=f"{name} holds a NaN or Inf scale"):
        _call(args)


def test_op_capacity_beyond_int32_names_capacity():
    with pytest.raises(ValueError, match="capacity must be a positive int, at most 2\\^31"):
        _call(_op_args(), capacity=2**40)


# --- load_state_dict ---------------------------------------------------------------------------------------------
def _layer(wfmt: str, **kw) -> StaticMoE:
    layer = StaticMoE(H, I, L, K, C, weight_format=wfmt, **kw)
    w = make_weights(L, H, I, wfmt, seed=5)
    layer.set_expert_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    return layer


def _snapshot(layer) -> dict:
    return {k: v.clone() for k, v in layer.state_dict().items()}


def _unchanged(layer, before: dict) -> bool:
    after = layer.state_dict()
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


PARTIAL_BAD = [
    ("fp4", "w13", lambda s: s["w13"].float(), TypeError, "must be torch.uint8"),
    ("fp8", "w2", lambda s: s["w2"].float().to(torch.bfloat16), TypeError, "must be torch.float8_e4m3fn"),
    ("fp8", "w13_scale", lambda s: torch.full_like(s["w13_scale"], float("nan")), ValueError, "must be finite"),
    ("fp4", "w2_scale", lambda s: torch.full_like(s["w2_scale"], 255), ValueError, "UE8M0 byte 255"),
    ("fp8", "w2", lambda s: s["w2"][:, :, :64], ValueError, "must have shape"),
]


@pytest.mark.parametrize(
    "wfmt,key,bad,exc,needle", PARTIAL_BAD, ids=[f"{p[0]}-{p[1]}-{p[3].__name__}" for p in PARTIAL_BAD]
)
def test_partial_load_state_dict_validates_each_key(wfmt, key, bad, exc, needle):
    layer = _layer(wfmt)
    before = _snapshot(layer)
    with pytest.raises(exc, match=needle):
        layer.load_state_dict({key: bad(before)}, strict=False)
    assert _unchanged(layer, before)


def test_partial_load_state_dict_copies_a_valid_key():
    layer = _layer("fp8")
    new = make_weights(L, H, I, "fp8", seed=9)
    layer.load_state_dict({"w2_scale": new["w2_scale"]}, strict=False)
    assert torch.equal(layer.w2_scale, new["w2_scale"])


def test_strict_load_state_dict_with_missing_keys_copies_nothing():
    layer = _layer("fp8")
    before = _snapshot(layer)
    new = make_weights(L, H, I, "fp8", seed=9)
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict({"w13": new["w13"], "w13_scale": new["w13_scale"]})
    assert _unchanged(layer, before)


def test_load_state_dict_through_a_parent_validates_a_partial_set():
    parent = torch.nn.ModuleDict({"moe": _layer("fp4")})
    before = _snapshot(parent["moe"])
    with pytest.raises(TypeError, match="must be torch.uint8"):
        parent.load_state_dict({"moe.w13": before["w13"].float()}, strict=False)
    assert _unchanged(parent["moe"], before)


def test_load_state_dict_with_a_bad_shared_expert_copies_nothing():
    layer = _layer("fp8", shared_intermediate_size=I)
    before = _snapshot(layer)
    sd = {k: v.clone() for k, v in before.items()}
    sd["w13"] = make_weights(L, H, I, "fp8", seed=9)["w13"]
    sd["shared.w2_scale"] = torch.full_like(sd["shared.w2_scale"], float("inf"))
    with pytest.raises(ValueError, match="shared. w2_scale: fp8 weight scales must be finite"):
        layer.load_state_dict(sd)
    assert _unchanged(layer, before)


# --- the smaller definitions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8, torch.bool])
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_unpack_rows_refuses_dtypes_raw_bytes_cannot_hold(impl, dtype):
    packed = torch.full((2, 16), 0xFF, dtype=torch.uint8)
    fn = torch.ops.static_moe.unpack_rows if impl == "op" else reference.unpack_rows
    with pytest.raises(TypeError, match="unpack_rows: dtype .* cannot be unpacked from raw bytes"):
        fn(packed, 0, 4, dtype, [4])


def test_raw_pack_rows_of_no_parts_says_what_is_wrong():
    with pytest.raises(ValueError, match="pack_rows: parts must hold at least one tensor"):
        torch.ops.static_moe.pack_rows([], 4)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_layer_is_not_copied(how):
    layer = _layer("bf16")
    fn = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match="cannot be .* it holds a workspace lease"):
        fn(layer)
    assert not layer.closed
    layer.close()


def test_unknown_static_moe_nki_value_is_refused():
    env = {**os.environ, "STATIC_MOE_NKI": "interpeter"}
    run = subprocess.run(
        [sys.executable, "-c", "import static_moe.nki.shim"], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    assert "STATIC_MOE_NKI must be one of" in run.stderr


def _transposed_checkpoint(hidden: int, inter: int, num_experts: int) -> dict:
    """A bf16 per-expert checkpoint whose every expert weight is transposed ([in, out]), with its router."""
    g = torch.Generator().manual_seed(0)
    sd = {"gate.weight": torch.randn(num_experts, hidden, generator=g)}
    for e in range(num_experts):
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            sd[f"experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16).t().contiguous()
    return sd


def test_deepseek_loader_refuses_transposed_weights_by_the_router():
    sd = _transposed_checkpoint(2 * H, I, L)
    with pytest.raises(ValueError, match="gate.weight .* gives H = 256, but the experts' down_proj gives H = 128"):
        StaticMoE.from_deepseek_state_dict(sd, top_k=K, capacity=C, num_experts=L)


def test_deepseek_loader_refuses_transposed_weights_by_hidden_size():
    sd = _transposed_checkpoint(2 * H, I, L)
    del sd["gate.weight"]
    with pytest.raises(ValueError, match="hidden_size gives H = 256"):
        StaticMoE.from_deepseek_state_dict(sd, top_k=K, capacity=C, num_experts=L, hidden_size=2 * H)


def test_deepseek_loader_accepts_a_matching_hidden_size_and_router():
    sd = {
        k: v.t().contiguous() if k.startswith("experts.") else v for k, v in _transposed_checkpoint(2 * H, I, L).items()
    }
    layer = StaticMoE.from_deepseek_state_dict(sd, top_k=K, capacity=C, num_experts=L, hidden_size=2 * H)
    assert layer.hidden_size == 2 * H and layer.intermediate_size == I
    layer.close()
