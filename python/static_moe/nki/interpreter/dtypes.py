"""NKI dtypes for the interpreter: numpy / ml_dtypes dtypes, so arrays store the exact bits the device would.

``float8_e4m3`` is Neuron's IEEE-style e4m3 (max 240, has inf) — ml_dtypes.float8_e4m3 has the same encoding;
``float8_e4m3fn`` is OCP e4m3 (max 448, no inf). Types that cannot be stored by the interpreter (tfloat32,
the packed x4 MX types) are sentinels that raise when a tensor is created with them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import NkiRuleError

bool_ = np.dtype(np.uint8)  # NKI stores bool as uint8
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)


class UnsupportedDtype:
    """A dtype name that exists in NKI but that this interpreter cannot hold (or that the target lacks)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def reject(self) -> None:
        raise NkiRuleError("dtype-unsupported", f"nl.{self.name}: {self.why}")


tfloat32 = UnsupportedDtype("tfloat32", "tf32 storage is not modelled by the interpreter; use float32")
float8_e5m2_x4 = UnsupportedDtype("float8_e5m2_x4", "packed MX type (trn3 nc_matmul_mx only), not modelled")
float8_e4m3fn_x4 = UnsupportedDtype("float8_e4m3fn_x4", "packed MX type (trn3 nc_matmul_mx only), not modelled")
float4_e2m1fn_x4 = UnsupportedDtype(
    "float4_e2m1fn_x4", "no FP4 datatype on trn2 (decode e2m1 nibbles with integer ops); trn3 MX is not modelled")

INT_DTYPES = (int8, int16, int32, uint8, uint16, uint32)
FLOAT_DTYPES = (float16, float32, bfloat16, float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu)
FP8_DTYPES = (float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu)
NAMES = {
    int8: "int8", int16: "int16", int32: "int32", uint8: "uint8", uint16: "uint16", uint32: "uint32",
    float16: "float16", float32: "float32", bfloat16: "bfloat16", float8_e4m3: "float8_e4m3",
    float8_e5m2: "float8_e5m2", float8_e4m3fn: "float8_e4m3fn", float8_e8m0fnu: "float8_e8m0fnu",
}


def as_dtype(dt) -> np.dtype:
    """Normalise a dtype argument (nl dtype, numpy dtype or type) or raise ``dtype-unsupported``."""
    if isinstance(dt, UnsupportedDtype):
        dt.reject()
    if isinstance(dt, str):
        raise NkiRuleError("dtype-unsupported", f"dtype given as the string {dt!r}; pass an nl dtype object")
    try:
        d = np.dtype(dt)
    except TypeError as e:
        raise NkiRuleError("dtype-unsupported", f"{dt!r} is not a dtype") from e
    if d not in NAMES:
        raise NkiRuleError("dtype-unsupported", f"{d} is not an NKI dtype")
    return d


def name(d) -> str:
    return NAMES.get(np.dtype(d), str(d)) if not isinstance(d, UnsupportedDtype) else d.name


def is_int(d) -> bool:
    return np.dtype(d) in INT_DTYPES


def is_float(d) -> bool:
    return np.dtype(d) in FLOAT_DTYPES


def max_finite(d) -> float:
    return float(ml_dtypes.finfo(d).max) if np.dtype(d) in FP8_DTYPES + (bfloat16,) else float(np.finfo(d).max)


def unsigned_of_size(itemsize: int) -> np.dtype:
    """The unsigned integer dtype of ``itemsize`` bytes (for bit-exact copies)."""
    return {1: uint8, 2: uint16, 4: uint32, 8: np.dtype(np.uint64)}[itemsize]
