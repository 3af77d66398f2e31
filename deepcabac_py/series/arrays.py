"""An entry's tensors as the series' kernels (:mod:`._series_kernels`) read and write them: flat
float32 or float64 in; out, the numpy carrier of the tensor's float dtype, rounded once."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..io.checkpoint import Checkpoint
from ..io.dtypes import bfloat16_to_float32, float64_to_bfloat16

FLOATS = ("float16", "bfloat16", "float32", "float64")


def with_tensors(ckpt: Checkpoint, tensors: dict[str, Any]) -> Checkpoint:
    """``ckpt`` with other tensors (the same structure, kind, metadata and aliases)."""
    return Checkpoint(tensors, ckpt.skeleton, ckpt.kind, ckpt.metadata, dict(ckpt.aliases))


def floats(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's values (numpy carrier of ``dtype``) as float64."""
    return (bfloat16_to_float32(arr) if dtype == "bfloat16" else arr).astype(np.float64)


def to_carrier(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded once to ``dtype``'s numpy carrier (docs/format.md: rounded once)."""
    return float64_to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype)


# The kernels (:mod:`._series_kernels`) read float32 or float64 and write the dtype of their
# output; half-precision values are widened exactly on the way in, and results meant for them are
# written in float64 and rounded once on the way out, as NumPy's expressions did.
_KERNEL_FLOATS = ("float32", "float64")


def flat(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's values (numpy carrier of ``dtype``) as a kernel reads them: flat, float32 or float64."""
    if dtype not in _KERNEL_FLOATS:
        arr = bfloat16_to_float32(arr) if dtype == "bfloat16" else arr.astype(np.float32 if dtype == "float16"
                                                                               else np.float64)
    return np.ascontiguousarray(arr).reshape(-1)


def output(size: int, dtype: str) -> np.ndarray:
    """Where a kernel writes values meant for ``dtype`` (float64 for any other than float32 and float64)."""
    return np.empty(size, dtype=dtype if dtype in _KERNEL_FLOATS else np.float64)


def carrier(out: np.ndarray, dtype: str) -> np.ndarray:
    """A kernel's output (:func:`output`) as ``dtype``'s numpy carrier, rounded once."""
    return out if dtype in _KERNEL_FLOATS else to_carrier(out, dtype)
