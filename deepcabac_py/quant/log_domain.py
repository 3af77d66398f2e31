"""The log domain: values coded by the logarithm of their magnitude, for tensors whose every element
matters relative to its own size (an optimizer's moments: Adam's step is m / (sqrt(v) + eps), so a
small v is as important as a large one, and a v rounded to 0 makes the step explode).

A nonzero value ``x`` becomes the level ``sign(x) * (k - offset)`` with ``k = round(log2|x| / step)``
(``step`` in octaves, from qp as any step) and ``offset`` one below the smallest ``k`` of the tensor,
so every nonzero level has magnitude >= 1; zero stays the level 0. Decoding gives
``sign * 2**((|level| + offset) * step)``: a relative error of at most ``2**(step / 2) - 1``, never 0
for a nonzero value, never beyond the dtype's range. The offset travels with the levels
(``docs/format.md``, mode LOG).
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptStreamError
from ..io.dtypes import carrier
from . import _math_kernels as _k

__all__ = ["LOG_DTYPES", "MAX_OFFSET", "log_levels", "log_values"]

LOG_DTYPES = ("float32", "float64")  # (half-precision moments are kept exact)
# |offset| bound: with the finest step of any qp an offset beyond it would not describe a float64
MAX_OFFSET = 1 << 40


def log_levels(values: np.ndarray, step: float) -> tuple[np.ndarray, int]:
    """``(levels, offset)`` of finite ``values`` at ``step`` octaves (int32 levels, flat)."""
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    k = np.empty(flat.shape[0], dtype=np.int64)
    lo, hi, seen, ok = _k.log_exponents(flat, float(step), k)
    if not ok:
        raise ValueError("the log domain codes finite values only (and a step that holds their exponents)")
    levels = np.zeros(flat.shape[0], dtype=np.int32)
    if not seen:
        return levels, 0
    offset = int(lo) - 1
    span = int(hi) - offset
    if span >= 2**31 - 1 or abs(offset) > MAX_OFFSET:
        raise ValueError(f"a step of {step} octaves is too fine for these magnitudes")
    _k.signed_magnitudes(flat, k, offset, levels)
    return levels, offset


def log_values(levels: np.ndarray, offset: int, step: float, dtype: str) -> np.ndarray:
    """The values of int32 ``levels`` (flat) in ``dtype``'s numpy carrier; nonzero levels stay
    nonzero and finite (clamped to the dtype's smallest and largest magnitudes)."""
    if dtype not in LOG_DTYPES:
        raise CorruptStreamError(f"the log domain holds float32 or float64 values, not {dtype}")
    if abs(offset) > MAX_OFFSET:
        raise CorruptStreamError(f"log-domain offset {offset} is out of range")
    out_type = carrier(dtype)
    info = np.finfo(out_type)
    out = np.empty(levels.shape[0], dtype=out_type)
    # ((|level| + offset) * step) is exact in float64: the step is dyadic with few significant bits
    _k.log_values_into(np.ascontiguousarray(levels), int(offset), float(step), float(info.smallest_subnormal),
                       float(info.max), out)
    return out
