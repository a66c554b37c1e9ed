"""The interpreter under the public module names, so kernels written for the real NKI run unmodified:

    from nki_interpreter import as_nki
    with as_nki.installed():
        import nki, nki.language as nl, nki.isa as nisa
        ...  # @nki.jit kernels run through the interpreter

``installed()`` puts a ``nki`` package (``jit``, ``simulate``, ``language``, ``isa``, ``isa.constants``,
``dtype``) into ``sys.modules`` for the duration of the block and restores what was there before. It is a
test and porting aid: ``static_moe.nki.shim`` never mistakes it for a real NKI (the facade is marked).
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np

from . import isa, language
from .runtime import jit, simulate

_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants")


def build() -> types.ModuleType:
    """A fresh ``nki`` package object backed by the interpreter."""
    pkg = types.ModuleType("nki", "static_moe's NKI interpreter under the public name")
    pkg.__path__ = []  # a package, so `import nki.language` resolves through sys.modules
    pkg.__static_moe_interpreter__ = True
    pkg.__version__ = "0.6.0+static_moe.interpreter"
    pkg.jit, pkg.simulate, pkg.language, pkg.isa = jit, simulate, language, isa
    pkg.dtype = np.dtype  # `nki.dtype`: the type of nl.float32 & co. (used in annotations / isinstance)
    pkg.tensor = language.NkiTensor
    return pkg


@contextlib.contextmanager
def installed():
    saved = {n: sys.modules.get(n) for n in _NAMES}
    pkg = build()
    consts = types.ModuleType("nki.isa.constants")
    consts.__dict__.update(vars(isa.constants))
    sys.modules.update({"nki": pkg, "nki.language": language, "nki.isa": isa, "nki.isa.constants": consts})
    try:
        yield pkg
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
