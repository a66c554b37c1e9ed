"""Runtime control: 32-bit virtual registers and device loops (``nl.fori_loop``, ``nl.dynamic_range``,
``nl.while_loop``).

The interpreter runs eagerly, so a device loop simply calls its body once per iteration with a read-only
register holding the index; the cost record counts the iterations (a runtime loop costs sequencer work per
iteration, an unrolled Python loop costs instruction-stream size instead).
"""

from __future__ import annotations

import numpy as np

from .errors import NkiRuleError, check
from .state import current


class VirtualRegister:
    """A 32-bit device register. Not an int at trace time: read it only through instructions or as an
    ``.ap(scalar_offset=...)`` / loop bound."""

    __slots__ = ("_value", "readonly", "name")

    def __init__(self, value=None, readonly: bool = False, name: str = ""):
        self._value = None if value is None else _int32(value)
        self.readonly, self.name = readonly, name

    def __repr__(self) -> str:
        return f"VirtualRegister({self.name or '?'}={self._value})"

    @property
    def value(self) -> int:
        check(self._value is not None, "uninitialized-register", f"register {self.name or '?'} read before any write")
        return self._value

    def set(self, v: int) -> None:
        check(not self.readonly, "register-readonly", "a loop index register is read-only")
        self._value = _int32(v)

    def __bool__(self):
        raise NkiRuleError("python-on-tensor", "a register has no truth value at trace time; use nl.while_loop")

    def __index__(self):
        raise NkiRuleError(
            "python-on-tensor",
            "a register is a device value, not a Python int; use it as a loop bound or as .ap(scalar_offset=...)",
        )


def _int32(v) -> int:
    v = int(v)
    check(-(2**31) <= v < 2**32, "register-range", f"{v} does not fit a 32-bit register")
    return v


def scalar_value(x) -> int:
    """The integer held by a register or a one-element on-chip/HBM tensor (a runtime scalar)."""
    from .tensor import NkiTensor

    if isinstance(x, VirtualRegister):
        return x.value
    if isinstance(x, NkiTensor):
        check(x.size == 1, "scalar-offset", f"a runtime scalar must be a one-element tensor, got {list(x.shape)}")
        check(x.buffer.name == "sbuf" or x.buffer.is_hbm, "scalar-offset", "runtime scalars come from SBUF or HBM")
        v = x._np().reshape(-1)[0]
        check(
            np.isfinite(v) if np.issubdtype(np.dtype(type(v)), np.floating) or x.dtype.kind == "V" else True,
            "scalar-offset",
            f"runtime scalar is not finite: {v}",
        )
        return int(np.asarray(v).astype(np.int64))
    if isinstance(x, (int, np.integer)):
        return int(x)
    raise NkiRuleError("scalar-offset", f"expected a register, a one-element tensor or an int, got {x!r}")


def _bound(x) -> int:
    return x.value if isinstance(x, VirtualRegister) else int(x)


# --------------------------------------------------------------------------------------------- nisa registers
def register_alloc(x=None, name: str = "") -> VirtualRegister:
    current().cost.instr("sync", "register_alloc", 0, 0)
    return VirtualRegister(x, name=name)


def register_move(dst: VirtualRegister, src, name=None) -> None:
    check(isinstance(dst, VirtualRegister), "register", "register_move dst must be a register")
    dst.set(src.value if isinstance(src, VirtualRegister) else int(src))
    current().cost.instr("sync", "register_move", 0, 0)


def register_load(dst: VirtualRegister, src, name=None) -> None:
    from .tensor import NkiTensor

    check(isinstance(dst, VirtualRegister), "register", "register_load dst must be a register")
    check(
        isinstance(src, NkiTensor) and src.size == 1 and src.buffer.name != "psum",
        "register",
        "register_load src must be a one-element SBUF or HBM tensor ([1] or [1, 1])",
    )
    check(
        not (src.dynamic and src._on_chip),
        "sbuf-indirect-operand",
        "register_load src is an SBUF view with a runtime offset (.ap(scalar_offset=...)); the isa page takes a "
        "one-element tensor and documents no indirection for it (engine-side SBUF indirection is a "
        "NeuronCore-v4 feature without an NKI API, trn3 architecture guide). Load from a static tile",
    )
    dst.set(scalar_value(src))
    current().cost.instr("sync", "register_load", 1, 1)


def register_store(dst, src: VirtualRegister, name=None) -> None:
    from .tensor import NkiTensor

    check(isinstance(src, VirtualRegister), "register", "register_store src must be a register")
    check(
        isinstance(dst, NkiTensor) and dst.size == 1 and dst.buffer.name != "psum",
        "register",
        "register_store dst must be a one-element SBUF or HBM tensor",
    )
    from .isa import _store_values

    _store_values(dst, np.array([[float(src.value)]], np.float64).reshape(dst.shape), exact_int=src.value)
    current().cost.instr("sync", "register_store", 1, 1)


# ------------------------------------------------------------------------------------------------ loops
def fori_loop(lower, upper, body_fun, step: int = 1) -> None:
    """``for i in range(lower, upper, step)`` on the device; ``body_fun(i)`` gets a read-only register."""
    check(
        isinstance(step, int) and step > 0, "loop", f"fori_loop step must be a positive compile-time int, got {step!r}"
    )
    lo, hi = _bound(lower), _bound(upper)
    ctx = current()
    ctx.loop_depth += 1
    _enter_runtime_loop(ctx)
    try:
        for i in range(lo, hi, step):
            ctx.cost.loop_iteration()
            r = body_fun(VirtualRegister(i, readonly=True, name="i"))
            check(r is None, "loop", "a fori_loop body returns nothing (carry state in SBUF/HBM)")
    finally:
        ctx.loop_depth -= 1
        ctx.runtime_loops -= 1


def _enter_runtime_loop(ctx) -> None:
    ctx.runtime_loops += 1
    ctx.runtime_loop_depth_max = max(ctx.runtime_loop_depth_max, ctx.runtime_loops)


def dynamic_range(start, stop=None, step: int = 1):
    """Deprecated (0.3–0.5) runtime loop: ``for i in nl.dynamic_range(...)`` yields read-only registers."""
    if stop is None:
        start, stop = 0, start
    lo, hi = _bound(start), _bound(stop)
    ctx = current()
    for i in range(lo, hi, step):
        ctx.cost.loop_iteration()
        yield VirtualRegister(i, readonly=True, name="i")


def while_loop(init: VirtualRegister, body_fun) -> None:
    """Run ``body_fun(r)`` while register ``r`` is non-zero (checked first); the body returns the next one."""
    r = init
    ctx = current()
    n = 0
    _enter_runtime_loop(ctx)
    try:
        while r.value != 0:
            ctx.cost.loop_iteration()
            r = body_fun(r)
            check(isinstance(r, VirtualRegister), "loop", "a while_loop body must return the condition register")
            n += 1
            check(n < 10_000_000, "loop", "while_loop did not terminate after 10^7 iterations")
    finally:
        ctx.runtime_loops -= 1
