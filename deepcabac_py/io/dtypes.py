"""Element types: their names, their frozen codes in the bitstreams, and their numpy carriers.

A dtype is named as torch and numpy name it (``"float32"``, ``"bfloat16"``, ...). Its numpy
*carrier* holds its values bit for bit; numpy has no bfloat16, so bfloat16 travels as the uint16 bit
patterns. The integer codes of :class:`DType` are in the bytes of both stream formats (model streams
and update streams) and never change. No torch here: header-only work must not import it.
"""

from __future__ import annotations

import enum

import numpy as np

DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
)
FLOAT_NAMES = ("float32", "float16", "bfloat16", "float64")

_CARRIER = {name: np.dtype(name if name != "bfloat16" else "uint16") for name in DTYPE_NAMES}


def carrier(name: str) -> np.dtype:
    """The numpy dtype that carries ``name``'s values bit for bit (uint16 for bfloat16)."""
    try:
        return _CARRIER[name]
    except KeyError:
        raise TypeError(f"unsupported dtype name {name!r}; supported: {', '.join(DTYPE_NAMES)}") from None


def name_of_carrier(dtype: np.dtype) -> str | None:
    """The dtype name a numpy array of ``dtype`` (native byte order) carries, None if unsupported."""
    return _NAME_BY_CARRIER.get(dtype)


_NAME_BY_CARRIER = {v: k for k, v in _CARRIER.items() if k != "bfloat16"}


class DType(enum.IntEnum):
    """Element types; the integer codes are frozen (they are in the bytes)."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT8 = 5
    INT16 = 6
    INT32 = 7
    INT64 = 8
    UINT8 = 9
    UINT16 = 10
    UINT32 = 11
    UINT64 = 12
    BOOL = 13
    COMPLEX64 = 14
    COMPLEX128 = 15

    @classmethod
    def from_name(cls, name: str) -> DType:
        return cls[name.upper()]

    # (looked up per member: the header parser and the decoder ask them per tensor, and working them
    # out from the member's name cost a microsecond each time)
    @property
    def dtype_name(self) -> str:
        """The name torch and numpy give it (``"bfloat16"``)."""
        return _MEMBER_NAMES[self]

    @property
    def carrier(self) -> np.dtype:
        return _CARRIER[_MEMBER_NAMES[self]]

    @property
    def itemsize(self) -> int:
        return _CARRIER[_MEMBER_NAMES[self]].itemsize

    @property
    def is_float(self) -> bool:
        return _MEMBER_NAMES[self] in FLOAT_NAMES

    @property
    def is_complex(self) -> bool:
        return self in (DType.COMPLEX64, DType.COMPLEX128)


_MEMBER_NAMES = {m: m.name.lower() for m in DType}


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (uint16): exact, bfloat16 is float32's top half."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float64_to_bfloat16(exact: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float64 values, rounded once to nearest even.

    torch's float64 -> bfloat16 conversion goes through float32 and can round twice: the float64 is
    rounded to 8 significant bits by integer arithmetic on its pattern, which then converts to
    float32 exactly, whose top half is the bfloat16 pattern (non-finite values pass unchanged)."""
    exact = np.ascontiguousarray(exact, dtype=np.float64)
    bits = exact.view(np.uint64)
    lsb = (bits >> np.uint64(45)) & np.uint64(1)
    rounded = ((bits + np.uint64((1 << 44) - 1) + lsb) & ~np.uint64((1 << 45) - 1)).view(np.float64)
    rounded = np.where(np.isfinite(exact), rounded, exact)
    with np.errstate(over="ignore"):
        f32 = rounded.astype(np.float32)
    return (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
