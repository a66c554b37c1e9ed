"""A CPU interpreter of the documented NKI language (NKI 0.3 – 0.6), faithful to the public docs' rules —
no stricter, no looser (what is modelled and refused, with sources: docs/backends/nki_interpreter.md).

``language`` and ``isa`` mirror ``nki.language`` / ``nki.isa``; ``simulate(kernel)`` runs a kernel on numpy
arrays or torch tensors (``simulate(k[2])`` / ``jit(f)[2]``: LNC = 2). Beyond the arithmetic it enforces NKI's
rules (each violation raises :class:`NkiRuleError` naming the rule) and records a cost trace
(:func:`last_run`, :mod:`.cost`). Kernels should import ``nl`` / ``nisa`` through :mod:`static_moe.nki.shim`,
which prefers a real ``nki``; kernels written as ``import nki`` run unmodified inside
``as_nki.installed()``.
"""

from . import as_nki, cost, isa, language  # noqa: F401
from .cost import LEGACY_TRN2, TRN2, CostModel, CostRecord, estimate  # noqa: F401
from .errors import NkiRuleError  # noqa: F401
from .runtime import Kernel, jit, last_run, profile, simulate  # noqa: F401
from .state import get_target, set_target, target  # noqa: F401
