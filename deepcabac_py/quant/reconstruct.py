"""Reconstruction: quantization levels back to values, the decoder's half of the quantizer.

A value is ``index * step``, computed in float64 (exact: the step has at most seven significant
bits and |index| < 2**31) and rounded once, to nearest even, to the tensor's dtype, so the encoder
and the decoder produce the same bits. For uniform quantization the index is the level itself; for
dependent quantization (the trellis) the decoder first runs the 4-state machine over each chunk's
transmitted levels (:func:`dq_indices`: the state restarts with every chunk).

Dtypes are named as in :mod:`deepcabac_py.io.dtypes`; bfloat16 values come back as their uint16 bit
patterns (the numpy carrier of bfloat16).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import CorruptStreamError
from ..io.dtypes import carrier, float64_to_bfloat16
from . import _reconstruct_kernels
from ._reconstruct_kernels import MAX_DQ_LEVEL

# bfloat16 chunks of at least _BF16_TABLE_MIN elements are reconstructed through a table of the
# patterns of every index up to _BF16_TABLE_HALF in magnitude (made per chunk: the step is the chunk's)
_BF16_TABLE_HALF = 2047
_BF16_TABLE_MIN = 1 << 14


def reconstruct(indices: np.ndarray, step: float, dtype: str) -> np.ndarray:
    """``indices * step`` rounded once to ``dtype`` (a float dtype name), in its numpy carrier.

    Raises :class:`CorruptStreamError` if a value would round beyond the dtype's largest (a finite
    weight never decodes as infinity: the encoder chooses steps for which :func:`fits` holds).
    """
    flat = np.ascontiguousarray(indices).reshape(-1)
    if dtype == "float32":
        out = np.empty(flat.shape[0], dtype=np.float32)
        top = int(_reconstruct_kernels.uniform_f32_kernel(flat, float(step), out))
    else:
        top = int(np.abs(flat.astype(np.int64)).max()) if flat.size else 0
        if dtype == "bfloat16":
            out = _bf16_bits(flat, step)
        else:
            with np.errstate(over="ignore"):
                out = (flat.astype(np.float64) * step).astype(carrier(dtype))
    _check_fits(top, step, dtype)
    return out.reshape(np.shape(indices))


def reconstruct_chunk(levels: np.ndarray, step: float, dtype: str, *, dependent: bool) -> np.ndarray:
    """The values of one chunk's decoded levels (transmitted levels when ``dependent``)."""
    return reconstruct(dq_indices(levels) if dependent else levels, step, dtype)


def reconstruct_f32_inplace(levels: np.ndarray, step: float, *, dependent: bool) -> None:
    """Overwrite one chunk's flat int32 ``levels`` with their float32 values (levels and float32
    values have the same size: the decoder decodes into the output and converts in place)."""
    if levels.dtype != np.int32 or levels.ndim != 1 or not levels.flags.c_contiguous:
        raise ValueError("levels must be a flat contiguous int32 array")
    if not dependent:
        top = int(_reconstruct_kernels.uniform_f32_inplace_kernel(levels, float(step)))
    else:
        top_level = int(_reconstruct_kernels.dq_reconstruct_f32_kernel(levels, float(step)))
        if top_level > MAX_DQ_LEVEL:
            raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
        top = 2 * top_level  # a bound on the reconstruction indices (2k - sgn(k) or 2k)
    _check_fits(top, step, "float32")


def reconstruct_bf16_into(levels: np.ndarray, step: float, out: np.ndarray, *, dependent: bool) -> None:
    """One chunk's bfloat16 values (uint16 patterns) into ``out``, from its flat int32 levels
    (transmitted levels when ``dependent``; overwritten with the reconstruction indices then): the
    bits of :func:`reconstruct`."""
    if levels.dtype != np.int32 or levels.ndim != 1 or not levels.flags.c_contiguous:
        raise ValueError("levels must be a flat contiguous int32 array")
    if out.dtype != np.uint16 or out.shape != levels.shape:
        raise ValueError("out must be a uint16 array of the levels' shape")
    if dependent and _reconstruct_kernels.dq_reconstruct_kernel(levels, levels) > MAX_DQ_LEVEL:
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
    if levels.shape[0] < _BF16_TABLE_MIN:
        top = int(_reconstruct_kernels.uniform_bf16_kernel(levels, float(step), out))
    else:
        # Most indices are small: their patterns come from a table made with the same exact
        # rounding (with the state machine's pass 2.5 -> 1.7 ns per element), the rest one by one
        table = np.empty(2 * _BF16_TABLE_HALF + 1, dtype=np.uint16)
        _reconstruct_kernels.uniform_bf16_kernel(np.arange(-_BF16_TABLE_HALF, _BF16_TABLE_HALF + 1, dtype=np.int32),
                                                 float(step), table)
        top, outside = _reconstruct_kernels.table_bf16_kernel(levels, table, out)
        if outside:
            where = np.flatnonzero(np.abs(levels.astype(np.int64)) > _BF16_TABLE_HALF)
            rest = np.empty(where.size, dtype=np.uint16)
            _reconstruct_kernels.uniform_bf16_kernel(levels[where], float(step), rest)
            out[where] = rest
    _check_fits(int(top), step, "bfloat16")


def fits(index: int, step: float, dtype: str) -> bool:
    """Whether ``index * step`` (|index| < 2**32) rounds to a finite value of ``dtype``."""
    value = float(index) * step  # exact while finite: the step has at most 7 significant bits
    if not math.isfinite(value):
        return False
    if dtype == "bfloat16":
        return int(_bf16_bits(np.array([index], dtype=np.int64), step)[0]) & 0x7F80 != 0x7F80
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(value).astype(carrier(dtype))))


def _check_fits(top: int, step: float, dtype: str) -> None:
    if not fits(top, step, dtype):
        raise CorruptStreamError(f"levels up to {top:,} at step {step:g} reconstruct beyond the largest {dtype}")


def dq_indices(levels: np.ndarray) -> np.ndarray:
    """Reconstruction indices of a chunk of trellis-coded (transmitted) levels: value = index * step.

    Raises :class:`CorruptStreamError` if a level is outside the trellis range (a damaged stream).
    """
    flat = np.ascontiguousarray(levels, dtype=np.int32).reshape(-1)
    out = np.empty_like(flat)
    if _reconstruct_kernels.dq_reconstruct_kernel(flat, out) > MAX_DQ_LEVEL:
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
    return out.reshape(np.shape(levels))


def _bf16_bits(flat: np.ndarray, step: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        exact = flat.astype(np.float64) * step  # (exact: the step has at most 7 significant bits)
    return float64_to_bfloat16(exact)
