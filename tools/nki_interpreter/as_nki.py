"""The interpreter under the public module names, so kernels written for the real NKI run unmodified:

    from nki_interpreter import as_nki
    with as_nki.installed():
        import nki, nki.language as nl, nki.isa as nisa
        ...  # @nki.jit kernels run through the interpreter

``installed()`` puts a ``nki`` package (``jit``, ``simulate``, ``language``, ``isa``, ``isa.constants``,
``dtype``) into ``sys.modules`` for the duration of the block and restores what was there before, and the
legacy ``neuronxcc.nki`` names public kernels still import (``neuronxcc.nki``, ``.language``, ``.isa``,
``.typing``). ``nki.dtype`` is a module, as released kernels use it: ``from nki.dtype import float8_e4m3fn_x4``
(nki-library ``experimental/matmul_mxfp8`` tests) and ``dtype: nki.dtype = nl.bfloat16`` in signatures.
``neuronxcc.nki.typing`` gives the annotation types ``tensor`` and ``mutable_tensor`` (``nt.tensor[...]``,
``recv_buffer: nt.mutable_tensor``), which carry nothing at run time. It is a test and porting aid:
``static_moe.nki.shim`` never mistakes it for a real NKI (the facade is marked).
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np

from . import isa, language
from .runtime import jit, simulate

_NAMES = (
    "nki",
    "nki.language",
    "nki.isa",
    "nki.isa.constants",
    "nki.dtype",
    "neuronxcc",
    "neuronxcc.nki",
    "neuronxcc.nki.language",
    "neuronxcc.nki.isa",
    "neuronxcc.nki.typing",
)


class _Annotation:
    """``nt.tensor`` / ``nt.mutable_tensor``: annotation-only types; ``nt.tensor[shape, dtype]`` is itself."""

    def __class_getitem__(cls, item):
        return cls


class tensor(_Annotation):  # noqa: N801  (the public name)
    pass


class mutable_tensor(_Annotation):  # noqa: N801  (the public name)
    pass


def _dtype_module(name: str) -> types.ModuleType:
    """``nki.dtype``: the dtype objects of ``nki.language`` (``nl.bfloat16``, ``float8_e4m3fn_x4``, …)."""
    mod = types.ModuleType(name, "NKI dtypes")
    for k, v in vars(language).items():
        if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
            setattr(mod, k, v)
    mod.dtype = np.dtype
    return mod


def build() -> types.ModuleType:
    """A fresh ``nki`` package object backed by the interpreter."""
    pkg = types.ModuleType("nki", "static_moe's NKI interpreter under the public name")
    pkg.__path__ = []  # a package, so `import nki.language` resolves through sys.modules
    pkg.__static_moe_interpreter__ = True
    pkg.__version__ = "0.6.0+static_moe.interpreter"
    pkg.jit, pkg.simulate, pkg.language, pkg.isa = jit, simulate, language, isa
    pkg.dtype = _dtype_module("nki.dtype")  # a module: `from nki.dtype import …`, `x: nki.dtype` annotations
    pkg.tensor = language.NkiTensor
    return pkg


def _legacy(pkg: types.ModuleType) -> dict:
    """The ``neuronxcc.nki`` names of NKI before its standalone package, over the same interpreter."""
    root = types.ModuleType("neuronxcc", "static_moe's NKI interpreter under the legacy name")
    root.__path__ = []
    sub = types.ModuleType("neuronxcc.nki", "static_moe's NKI interpreter under the legacy name")
    sub.__path__ = []
    sub.__static_moe_interpreter__ = True
    sub.jit, sub.simulate, sub.language, sub.isa = jit, simulate, language, isa
    typing = types.ModuleType("neuronxcc.nki.typing", "NKI annotation types")
    typing.tensor, typing.mutable_tensor = tensor, mutable_tensor
    sub.typing = typing
    root.nki = sub
    return {
        "neuronxcc": root,
        "neuronxcc.nki": sub,
        "neuronxcc.nki.language": language,
        "neuronxcc.nki.isa": isa,
        "neuronxcc.nki.typing": typing,
    }


@contextlib.contextmanager
def installed():
    saved = {n: sys.modules.get(n) for n in _NAMES}
    pkg = build()
    consts = types.ModuleType("nki.isa.constants")
    consts.__dict__.update(vars(isa.constants))
    sys.modules.update(
        {"nki": pkg, "nki.language": language, "nki.isa": isa, "nki.isa.constants": consts, "nki.dtype": pkg.dtype}
    )
    sys.modules.update(_legacy(pkg))
    try:
        yield pkg
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
