"""A CPU interpreter of the documented NKI language (NKI 0.3 – 0.6), faithful to the public docs' rules —
no stricter, no looser (what is modelled and refused, with sources: docs/backends/nki_interpreter.md).

A development tool of the static_moe repository, not part of the installed package: it lives in the
repository's ``tools/`` (``import nki_interpreter`` with ``tools/`` on ``sys.path``; the tests and the NKI
benchmarks put it there). The wheel ships the kernels, which need a real ``nki`` where the interpreter is absent.

``language`` and ``isa`` mirror ``nki.language`` / ``nki.isa``; ``simulate(kernel)`` runs a kernel on numpy
arrays or torch tensors (``simulate(k[2])`` / ``jit(f)[2]``: LNC = 2). Beyond the arithmetic it enforces NKI's
rules (each violation raises :class:`NkiRuleError` naming the rule) and records a cost trace
(:func:`last_run`, :mod:`.cost`). static_moe's kernels import ``nl`` / ``nisa`` through
``static_moe.nki.shim``, which prefers a real ``nki`` and falls back to this package; kernels written as
``import nki`` run unmodified inside ``as_nki.installed()``.
"""

from . import as_nki, cost, isa, language  # noqa: F401
from .cost import TRN2, TRN3, CostModel, CostRecord, estimate, model_for  # noqa: F401
from .errors import NkiRuleError  # noqa: F401
from .runtime import Kernel, jit, last_run, profile, simulate  # noqa: F401
from .state import get_target, set_target, target  # noqa: F401
