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

import numpy as np

from ..errors import CorruptStreamError
from ..io.dtypes import carrier
from . import _reconstruct_kernels
from ._reconstruct_kernels import MAX_DQ_LEVEL


def reconstruct(indices: np.ndarray, step: float, dtype: str) -> np.ndarray:
    """``indices * step`` rounded once to ``dtype`` (a float dtype name), in its numpy carrier."""
    flat = np.ascontiguousarray(indices).reshape(-1)
    if dtype == "bfloat16":
        out = _bf16_bits(flat, step)
    elif dtype == "float32":
        out = np.empty(flat.shape[0], dtype=np.float32)
        _reconstruct_kernels.uniform_f32_kernel(flat, float(step), out)
    else:
        out = (flat.astype(np.float64) * step).astype(carrier(dtype))
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
        _reconstruct_kernels.uniform_f32_inplace_kernel(levels, float(step))
    elif not _reconstruct_kernels.dq_reconstruct_f32_kernel(levels, float(step)):
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")


def dq_indices(levels: np.ndarray) -> np.ndarray:
    """Reconstruction indices of a chunk of trellis-coded (transmitted) levels: value = index * step.

    Raises :class:`CorruptStreamError` if a level is outside the trellis range (a damaged stream).
    """
    flat = np.ascontiguousarray(levels, dtype=np.int32).reshape(-1)
    out = np.empty_like(flat)
    if not _reconstruct_kernels.dq_reconstruct_kernel(flat, out):
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
    return out.reshape(np.shape(levels))


def _bf16_bits(flat: np.ndarray, step: float) -> np.ndarray:
    # torch's float64 -> bfloat16 conversion goes through float32 and can round twice: round the
    # float64 to 8 significant bits, ties to even, by integer arithmetic on its pattern; the result
    # converts to float32 exactly, whose top half is the bfloat16 pattern.
    exact = flat.astype(np.float64) * step
    bits = exact.view(np.uint64)
    lsb = (bits >> np.uint64(45)) & np.uint64(1)
    rounded = ((bits + np.uint64((1 << 44) - 1) + lsb) & ~np.uint64((1 << 45) - 1)).view(np.float64)
    finite = np.isfinite(exact)
    rounded = np.where(finite, rounded, exact)
    with np.errstate(over="ignore"):
        f32 = rounded.astype(np.float32)
    return (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
