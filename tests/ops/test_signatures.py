"""Each pure-torch reference op (static_moe.reference, the executable spec) has its op's signature: the same
parameter names, in the same order, with the same defaults as the ``torch.ops.static_moe.<op>`` schema (csrc/ops.cpp,
SPEC §4), so a call written against one runs unchanged against the other. Metadata only: nothing is computed."""

from __future__ import annotations

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
