"""The one place kernels get ``nl`` / ``nisa`` from: the real NKI when it is importable, the repository's NKI
interpreter otherwise.

The interpreter (``nki_interpreter``) is a development tool that the wheel does not ship: it lives in the
repository's ``tools/`` and is importable where ``tools/`` is on ``sys.path`` (the tests and the NKI benchmarks
put it there). Where neither it nor a real NKI is importable, importing this module (hence any NKI kernel)
raises ImportError saying so. ``import static_moe`` never imports this module: ``static_moe.nki.dispatch``
loads it on first use.

Targeted NKI: the standalone ``nki`` package, API as of NKI 0.6 / Neuron SDK 2.32 (the NKI >= 0.3 programming
model; the ``.broadcast`` view needs >= 0.5, the skip-unrouted register loops >= 0.6; not checked at import):
``import nki``, ``nki.language as nl``, ``nki.isa as nisa``. The PyPI package named ``nki`` is an empty
placeholder, so "importable" means ``nki.language``, ``nki.isa`` and ``nki.jit`` all exist.

Set ``STATIC_MOE_NKI=interpreter`` to force the interpreter even where a real ``nki`` is installed (for
example to compare the two), or ``STATIC_MOE_NKI=nki`` to require the real one (ImportError otherwise); unset
or ``auto`` picks as above, and any other value is a ValueError at import.

Exports:
    nl, nisa            the language and ISA modules
    jit(fn)             real ``nki.jit`` / the interpreter's Kernel
    simulate(kernel)    real ``nki.simulate`` / the interpreter's simulate
    BACKEND             "nki" or "interpreter"
    REAL_NKI_VERSION    the real package's version string, or None
    interpreter         the ``nki_interpreter`` package when it backs ``nl`` / ``nisa``, else None
"""

from __future__ import annotations

import os


def _load_real():
    import nki as _nki  # noqa: F401
    import nki.isa as _nisa
    import nki.language as _nl

    if not hasattr(_nki, "jit"):
        raise ImportError("the installed 'nki' has no jit (the PyPI placeholder?)")
    if getattr(_nki, "__static_moe_interpreter__", False):
        raise ImportError("'nki' is the interpreter's own facade (nki_interpreter.as_nki), not a real NKI")
    version = getattr(_nki, "__version__", None)
    return _nki, _nl, _nisa, version


def _load_interpreter(real_error: ImportError | None):
    try:
        import nki_interpreter
    except ImportError as e:
        if e.name != "nki_interpreter":
            raise  # the interpreter is there but one of its own imports failed: show that, not the message below
        why = "STATIC_MOE_NKI=interpreter" if real_error is None else f"no real nki ({real_error})"
        raise ImportError(
            f"static_moe's NKI kernels need the Neuron SDK's nki (nki.language, nki.isa, nki.jit; Neuron's package "
            f"index), or, for development, the NKI interpreter of the static_moe repository: put the repository's "
            f"tools/ directory on sys.path (the tests and benchmarks do) so that `import nki_interpreter` works "
            f"({why})",
            name="nki_interpreter",
        ) from real_error
    return nki_interpreter


_CHOICES = ("auto", "interpreter", "nki")
_choice = os.environ.get("STATIC_MOE_NKI", "auto").lower()
if _choice not in _CHOICES:  # a typo must not silently mean "auto"
    raise ValueError(
        f"STATIC_MOE_NKI must be one of {_CHOICES} (unset means 'auto'), got {os.environ['STATIC_MOE_NKI']!r}"
    )
_real = None
_real_error = None
if _choice != "interpreter":
    try:
        _real = _load_real()
    except ImportError as e:
        if _choice == "nki":
            raise
        _real_error = e

if _real is not None:
    _nki, nl, nisa, REAL_NKI_VERSION = _real
    BACKEND = "nki"
    interpreter = None
    jit = _nki.jit

    def simulate(kernel):
        """The real NKI simulator (set NEURON_PLATFORM_TARGET_OVERRIDE=trn2; it defaults to trn3 off-device)."""
        return _nki.simulate(kernel)

else:
    interpreter = _load_interpreter(_real_error)
    nl, nisa = interpreter.language, interpreter.isa
    jit, simulate = interpreter.jit, interpreter.simulate

    BACKEND = "interpreter"
    REAL_NKI_VERSION = None


def real_nki_available() -> bool:
    """True when a real NKI (compiler + simulator) backs ``nl`` / ``nisa``."""
    return BACKEND == "nki"


_TORCH_TO_NL = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "bool": "bool_",
}


def nl_dtype(torch_dtype):
    """The ``nl`` dtype of a torch dtype (e.g. torch.float8_e4m3fn → nl.float8_e4m3fn); for kernel constants
    such as unpack_rows' dtype. Raises ValueError for dtypes NKI lacks (int64, float64)."""
    name = str(torch_dtype).replace("torch.", "")
    if name not in _TORCH_TO_NL:
        raise ValueError(f"{torch_dtype} has no NKI dtype")
    return getattr(nl, _TORCH_TO_NL[name])
