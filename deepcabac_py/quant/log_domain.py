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
from . import portable

__all__ = ["LOG_DTYPES", "MAX_OFFSET", "log_levels", "log_values"]

LOG_DTYPES = ("float32", "float64")  # (half-precision moments are kept exact)
# |offset| bound: with the finest step of any qp an offset beyond it would not describe a float64
MAX_OFFSET = 1 << 40


def log_levels(values: np.ndarray, step: float) -> tuple[np.ndarray, int]:
    """``(levels, offset)`` of finite ``values`` at ``step`` octaves (int32 levels, flat)."""
    flat = np.ascontiguousarray(values).reshape(-1).astype(np.float64, copy=False)
    if not np.all(np.isfinite(flat)):
        raise ValueError("the log domain codes finite values only")
    nonzero = flat != 0
    levels = np.zeros(flat.shape[0], dtype=np.int32)
    if not nonzero.any():
        return levels, 0
    mag = np.abs(flat[nonzero])
    k = np.rint(portable.log2(mag) / step).astype(np.int64)
    offset = int(k.min()) - 1
    span = int(k.max()) - offset
    if span >= 2**31 - 1 or abs(offset) > MAX_OFFSET:
        raise ValueError(f"a step of {step} octaves is too fine for these magnitudes")
    mags = (k - offset).astype(np.int32)
    levels[nonzero] = np.where(flat[nonzero] < 0, -mags, mags)
    return levels, offset


def log_values(levels: np.ndarray, offset: int, step: float, dtype: str) -> np.ndarray:
    """The values of int32 ``levels`` (flat) in ``dtype``'s numpy carrier; nonzero levels stay
    nonzero and finite (clamped to the dtype's smallest and largest magnitudes)."""
    if dtype not in LOG_DTYPES:
        raise CorruptStreamError(f"the log domain holds float32 or float64 values, not {dtype}")
    if abs(offset) > MAX_OFFSET:
        raise CorruptStreamError(f"log-domain offset {offset} is out of range")
    out_type = carrier(dtype)
    lv = levels.astype(np.int64)
    mag = np.abs(lv)
    info = np.finfo(out_type)
    # ((|level| + offset) * step) is exact in float64: the step is dyadic with few significant bits
    x = portable.exp2((mag + offset).astype(np.float64) * step)
    x = np.clip(x, float(info.smallest_subnormal), float(info.max)).astype(out_type)
    x[lv == 0] = 0
    np.negative(x, out=x, where=lv < 0)
    return x
