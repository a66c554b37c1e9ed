"""The operator objects of ``nl`` (``nl.add``, ``nl.silu``, ``nl.bitwise_and``, …).

Each is both a value passed as ``op=`` to ``nisa.*`` instructions and, called directly, the ``nl`` wrapper of
the same name (which allocates a new SBUF tile and runs the matching instruction), as in NKI.

Kinds: ``bitvec`` (integer dtypes, raw bits), ``arith`` (binary, fp32 math), ``unary`` (arithmetic unary
usable as a tensor_scalar op0 with operand None), ``act`` (ScalarE activation functions).
"""

from __future__ import annotations

import numpy as np

from .errors import NkiRuleError

_TRN3_ONLY = {"abs_max", "abs_min"}


def _erf(x):
    from math import erf

    return np.vectorize(erf, otypes=[np.float64])(x)


class Op:
    __slots__ = ("name", "kinds", "fn", "identity", "act_range", "wrapper")

    def __init__(self, name, kinds, fn, identity=None, act_range=None):
        self.name, self.kinds, self.fn, self.identity, self.act_range = name, set(kinds), fn, identity, act_range
        self.wrapper = None

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    @property
    def is_bitvec(self) -> bool:
        return "bitvec" in self.kinds

    @property
    def is_reduce(self) -> bool:
        return self.identity is not None

    def __call__(self, *args, **kwargs):
        if self.wrapper is None:
            raise NkiRuleError(
                "nl-wrapper",
                f"nl.{self.name} has no tile-returning wrapper in the interpreter; use the nisa instruction",
            )
        return self.wrapper(self, *args, **kwargs)


def _b(name, fn, identity=None, kinds=("arith",)):
    return Op(name, kinds, fn, identity)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


# binary arithmetic (fp32 math)
add = _b("add", np.add, 0.0)
subtract = _b("subtract", np.subtract, 0.0)
multiply = _b("multiply", np.multiply, 1.0)
maximum = _b("maximum", np.maximum, -np.inf)
minimum = _b("minimum", np.minimum, np.inf)
divide = _b("divide", np.divide)
power = _b("power", np.power)
equal = _b("equal", lambda a, b: (a == b).astype(np.float64))
not_equal = _b("not_equal", lambda a, b: (a != b).astype(np.float64))
greater = _b("greater", lambda a, b: (a > b).astype(np.float64))
greater_equal = _b("greater_equal", lambda a, b: (a >= b).astype(np.float64))
less = _b("less", lambda a, b: (a < b).astype(np.float64))
less_equal = _b("less_equal", lambda a, b: (a <= b).astype(np.float64))
logical_and = _b("logical_and", lambda a, b: ((a != 0) & (b != 0)).astype(np.float64), 1.0)
logical_or = _b("logical_or", lambda a, b: ((a != 0) | (b != 0)).astype(np.float64), 0.0)
logical_xor = _b("logical_xor", lambda a, b: ((a != 0) ^ (b != 0)).astype(np.float64), 0.0)
abs_max = _b("abs_max", lambda a, b: np.maximum(np.abs(a), np.abs(b)))
abs_min = _b("abs_min", lambda a, b: np.minimum(np.abs(a), np.abs(b)))

# bitvec (raw integer bits); right_shift is logical
bitwise_and = Op("bitwise_and", ("bitvec",), np.bitwise_and, identity=-1)
bitwise_or = Op("bitwise_or", ("bitvec",), np.bitwise_or, identity=0)
bitwise_xor = Op("bitwise_xor", ("bitvec",), np.bitwise_xor, identity=0)
left_shift = Op("left_shift", ("bitvec",), np.left_shift)
right_shift = Op("right_shift", ("bitvec",), np.right_shift)
invert = Op("invert", ("bitvec", "bitvec_unary"), np.invert)

# unary: usable as activation functions (ScalarE) and, the arithmetic ones, as tensor_scalar op0
copy = Op("copy", ("act",), lambda x: x)
abs = Op("abs", ("act", "unary"), np.abs)
square = Op("square", ("act", "unary"), np.square)
relu = Op("relu", ("act", "unary"), lambda x: np.maximum(x, 0.0))
rsqrt = Op("rsqrt", ("act", "unary"), lambda x: 1.0 / np.sqrt(x), act_range=(2.0**-87, 2.0**97))
reciprocal = Op("reciprocal", ("act", "unary"), lambda x: 1.0 / x, act_range=(2.0**-42, 2.0**42))
sigmoid = Op("sigmoid", ("act",), _sigmoid)
silu = Op("silu", ("act",), lambda x: x * _sigmoid(x))
silu_dx = Op("silu_dx", ("act",), lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))))
exp = Op("exp", ("act",), np.exp)
tanh = Op("tanh", ("act",), np.tanh)
softplus = Op("softplus", ("act",), _softplus)
mish = Op("mish", ("act",), lambda x: x * np.tanh(_softplus(x)))
gelu = Op("gelu", ("act",), lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))))
gelu_apprx_tanh = Op("gelu_apprx_tanh", ("act",), _gelu_tanh)
gelu_apprx_sigmoid = Op("gelu_apprx_sigmoid", ("act",), lambda x: x * _sigmoid(1.702 * x))
erf = Op("erf", ("act",), _erf)
sign = Op("sign", ("act",), np.sign)
log = Op("log", ("act",), np.log, act_range=(2.0**-64, 2.0**64))
sqrt = Op("sqrt", ("act",), np.sqrt, act_range=(2.0**-116, 2.0**118))
sin = Op("sin", ("act",), np.sin, act_range=(-np.pi, np.pi))
arctan = Op("arctan", ("act",), np.arctan, act_range=(-np.pi / 2, np.pi / 2))

ALL = {o.name: o for o in list(globals().values()) if isinstance(o, Op)}
