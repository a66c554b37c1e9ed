"""Each pure-torch reference op (static_moe.reference, the executable spec) has its op's signature: the same
parameter names, in the same order, with the same defaults as the ``torch.ops.static_moe.<op>`` schema (csrc/ops.cpp,
SPEC §4), so a call written against one runs unchanged against the other; and forward's settings tuple
(``ForwardConfig``) is its schema's tail. Metadata only: nothing is computed."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import static_moe  # noqa: F401  (registers the schemas)
from static_moe import reference

OPS = ["pack_rows", "unpack_rows", "swiglu_and_cast", "expert_gemm", "local_experts", "forward", "quantize_weight"]
NO_DEFAULT = "<no default>"


def schema_params(op: str) -> list[tuple[str, object, bool]]:
    """(name, default or NO_DEFAULT, keyword-only) of every argument of the op's schema, in order."""
    schema = getattr(torch.ops.static_moe, op).default._schema
    return [(a.name, a.default_value if a.has_default_value() else NO_DEFAULT, a.kwarg_only) for a in schema.arguments]


def reference_params(op: str) -> list[tuple[str, object, bool]]:
    """The same triple for every parameter of the reference function, in order."""
    out = []
    for p in inspect.signature(getattr(reference, op)).parameters.values():
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), f"reference.{op}: {p.name} is {p.kind.name}"
        out.append((p.name, NO_DEFAULT if p.default is p.empty else p.default, p.kind == p.KEYWORD_ONLY))
    return out


def test_every_reference_op_is_checked():
    """A new reference op (other than the S-rank simulation helper) must join OPS, and every op has a schema."""
    assert sorted(set(reference.__all__) - {"forward_simulated"}) == sorted(OPS)
    for op in OPS:
        assert hasattr(torch.ops.static_moe, op), f"no schema static_moe::{op}"


@pytest.mark.parametrize("op", OPS)
def test_reference_signature_matches_schema(op):
    want, got = schema_params(op), reference_params(op)
    assert [n for n, _, _ in got] == [n for n, _, _ in want], f"{op}: parameter names or order differ"
    for (name, d_want, kw_want), (_, d_got, kw_got) in zip(want, got):
        assert kw_got == kw_want, f"{op}({name}): keyword-only {kw_got} in the reference, {kw_want} in the schema"
        # 448 vs 448.0 would compare equal: the type must agree too (the schema's float default is a float).
        assert d_got == d_want and type(d_got) is type(d_want), (
            f"{op}({name}): default {d_got!r} in the reference, {d_want!r} in the schema"
        )


def test_forward_config_is_the_schema_tail():
    """ops.forward hands ``*ForwardConfig`` to the op positionally after ``ep_size``: its fields must be the schema's
    arguments from there on, in order, with the schema's defaults, or a call would pass a setting in another's slot."""
    fwd = importlib.import_module("static_moe.ops.forward")
    want = schema_params("forward")
    tail = want[[n for n, _, _ in want].index("ep_size") + 1 :]
    assert list(fwd.ForwardConfig._fields) == [n for n, _, _ in tail]
    for (name, default, _), got in zip(tail, fwd.DEFAULT_CONFIG):
        assert got == default and type(got) is type(default), f"ForwardConfig.{name}: {got!r}, schema {default!r}"


def test_forward_config_compares_by_identity():
    """A tuple's == would compare the bias tensors elementwise (and raise on their truth value)."""
    fwd = importlib.import_module("static_moe.ops.forward")
    bias = torch.zeros(2, 4)
    a, b = fwd.ForwardConfig(w13_bias=bias), fwd.ForwardConfig(w13_bias=bias)
    assert a == a and a != b and len({a, b}) == 2
