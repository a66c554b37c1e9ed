"""NKI dtypes for the interpreter: numpy / ml_dtypes dtypes, so arrays store the exact bits the device would.

``float8_e4m3`` is Neuron's IEEE-style e4m3 (max 240, has inf) — ml_dtypes.float8_e4m3 has the same encoding;
``float8_e4m3fn`` is OCP e4m3 (max 448, no inf). ``tfloat32`` cannot be stored by the interpreter: it is a
sentinel that raises when a tensor is created with it.

The packed MX types (isa stub, nc_matmul_mx / quantize_mx; NeuronCore-v4) are opaque containers:
``float8_e4m3fn_x4`` / ``float8_e5m2_x4`` hold four fp8 values in 32 bits (value j in byte j, little end
first), ``float4_e2m1fn_x4`` four e2m1 values in 16 bits (value j in bits 4j … 4j+3). They are one-field
structured numpy dtypes, so they are distinct from uint32/uint16 while moving byte-exactly (DMA, tensor_copy,
``view``); arithmetic on them is refused (``dtype-x4``), ``memset`` takes only 0 (isa stub).
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
float8_e5m2_x4 = np.dtype([("float8_e5m2_x4", "<u4")])
float8_e4m3fn_x4 = np.dtype([("float8_e4m3fn_x4", "<u4")])
float4_e2m1fn_x4 = np.dtype([("float4_e2m1fn_x4", "<u2")])
X4_DTYPES = (float8_e5m2_x4, float8_e4m3fn_x4, float4_e2m1fn_x4)
# the element type packed in each x4 container
X4_ELEMENT = {float8_e5m2_x4: float8_e5m2, float8_e4m3fn_x4: float8_e4m3fn, float4_e2m1fn_x4: None}

INT_DTYPES = (int8, int16, int32, uint8, uint16, uint32)
FLOAT_DTYPES = (float16, float32, bfloat16, float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu)
FP8_DTYPES = (float8_e4m3, float8_e5m2, float8_e4m3fn, float8_e8m0fnu)
NAMES = {
    int8: "int8",
    int16: "int16",
    int32: "int32",
    uint8: "uint8",
    uint16: "uint16",
    uint32: "uint32",
    float16: "float16",
    float32: "float32",
    bfloat16: "bfloat16",
    float8_e4m3: "float8_e4m3",
    float8_e5m2: "float8_e5m2",
    float8_e4m3fn: "float8_e4m3fn",
    float8_e8m0fnu: "float8_e8m0fnu",
    float8_e5m2_x4: "float8_e5m2_x4",
    float8_e4m3fn_x4: "float8_e4m3fn_x4",
    float4_e2m1fn_x4: "float4_e2m1fn_x4",
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


def is_x4(d) -> bool:
    return np.dtype(d) in X4_DTYPES


def is_int(d) -> bool:
    return np.dtype(d) in INT_DTYPES


def is_float(d) -> bool:
    return np.dtype(d) in FLOAT_DTYPES


def max_finite(d) -> float:
    return float(ml_dtypes.finfo(d).max) if np.dtype(d) in FP8_DTYPES + (bfloat16,) else float(np.finfo(d).max)


def unsigned_of_size(itemsize: int) -> np.dtype:
    """The unsigned integer dtype of ``itemsize`` bytes (for bit-exact copies)."""
    return {1: uint8, 2: uint16, 4: uint32, 8: np.dtype(np.uint64)}[itemsize]
