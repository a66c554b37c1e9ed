"""A strict CPU interpreter for the subset of NKI (>= 0.3) that static_moe's kernels use.

``language`` and ``isa`` mirror ``nki.language`` / ``nki.isa``; ``simulate(kernel)`` runs a kernel on numpy
arrays or torch tensors. Beyond the arithmetic it enforces NKI's rules (each violation raises
:class:`NkiRuleError` naming the rule) and records a cost trace (:func:`last_run`, :mod:`.cost`).
Kernels should import ``nl`` / ``nisa`` through :mod:`static_moe.nki.shim`, which prefers a real ``nki``.
"""

from . import cost, isa, language  # noqa: F401
from .cost import LEGACY_TRN2, TRN2, CostModel, CostRecord, estimate  # noqa: F401
from .errors import NkiRuleError  # noqa: F401
from .runtime import Kernel, jit, last_run, profile, simulate  # noqa: F401
from .state import get_target, set_target, target  # noqa: F401
