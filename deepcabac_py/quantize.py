"""Uniform scalar quantization: the step from (qp, qp_density) and the integer levels.

The step follows the NNC formula exactly, so a setting here compares one to one with NNCodec:
with k = 2**qp_density, ``step = (k + qp mod k) * 2**(floor(qp / k) - qp_density)``. Reconstruction
is ``level * step``, computed in float64 (exact: the mantissa of the step has at most 7 bits and
|level| < 2**31) and rounded once, to nearest even, to the tensor's dtype, so the encoder and the
decoder produce the same bits.

This module is the seam the rate-distortion quantizers (RDOQ, trellis) plug into: they produce
levels for a given step; everything downstream only sees levels and a step.
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import kernel

MAX_LEVEL = (1 << 31) - 1
QP_MIN, QP_MAX = -(1 << 12), (1 << 12) - 1
QP_DENSITY_MAX = 6
_STEP_MIN = 2.0**-1022  # smallest normal float64


def step_from_qp(qp: int, qp_density: int = 2) -> float:
    """The quantization step of ``qp`` at ``qp_density`` (NNC's formula; exact in float64)."""
    qp, qp_density = _check_qp(qp, qp_density)
    k = 1 << qp_density
    mul = k + (qp & (k - 1))
    shift = qp >> qp_density
    try:
        step = math.ldexp(float(mul), shift - qp_density)
    except OverflowError:
        step = math.inf
    # At the ends of the qp range with a small qp_density the step leaves float64 (0, subnormal or
    # infinite): such a qp cannot be used (it would divide by zero or overflow downstream).
    if not _STEP_MIN <= step < math.inf:
        raise ValueError(f"qp {qp} at qp_density {qp_density} gives a step outside the normal float64 range")
    return step


def qp_for_range(max_abs: float, qp: int, qp_density: int = 2) -> int:
    """The smallest qp >= ``qp`` whose levels for values up to ``max_abs`` fit in int32."""
    qp, qp_density = _check_qp(qp, qp_density)
    while max_abs / step_from_qp(qp, qp_density) + 0.5 >= MAX_LEVEL:
        if qp >= QP_MAX:
            raise ValueError(f"values up to {max_abs:g} cannot be quantized to 31-bit levels")
        # Jump a whole octave at a time while far away, then single steps. (In logarithms: the
        # ratio itself overflows to infinity for tiny steps.)
        octaves = math.log2(max_abs) - math.log2(step_from_qp(qp, qp_density)) - math.log2(MAX_LEVEL)
        qp = min(QP_MAX, qp + max(1, int(max(octaves, 0.0)) << qp_density))
    return qp


def _check_qp(qp, qp_density):
    if isinstance(qp, bool) or not isinstance(qp, (int, np.integer)):
        raise TypeError(f"qp must be an integer, got {type(qp).__name__}")
    if isinstance(qp_density, bool) or not isinstance(qp_density, (int, np.integer)):
        raise TypeError(f"qp_density must be an integer, got {type(qp_density).__name__}")
    qp, qp_density = int(qp), int(qp_density)
    if not QP_MIN <= qp <= QP_MAX:
        raise ValueError(f"qp must lie in [{QP_MIN}, {QP_MAX}], got {qp}")
    if not 0 <= qp_density <= QP_DENSITY_MAX:
        raise ValueError(f"qp_density must lie in [0, {QP_DENSITY_MAX}], got {qp_density}")
    return qp, qp_density


@kernel
def _round_kernel(values, step, out):
    # Nearest level, ties away from zero (as NNC's URQ: floor(|x| + 0.5) with the sign restored).
    for i in range(values.shape[0]):
        x = np.float64(values[i])
        level = np.int64(abs(x) / step + 0.5)
        out[i] = -level if x < 0 else level


@kernel
def _reconstruct_f32_kernel(levels, step, out):
    for i in range(levels.shape[0]):
        out[i] = np.float32(np.float64(levels[i]) * step)


@kernel
def _reconstruct_f32_inplace_kernel(levels, step):
    # Element i is read before it is written, and nothing else reads it: aliasing is harmless.
    values = levels.view(np.float32)
    for i in range(levels.shape[0]):
        values[i] = np.float32(np.float64(levels[i]) * step)


def reconstruct_f32_inplace(levels: np.ndarray, step: float) -> None:
    """Overwrite the flat int32 ``levels`` with their float32 values ``level * step``."""
    if levels.dtype != np.int32 or levels.ndim != 1 or not levels.flags.c_contiguous:
        raise ValueError("levels must be a flat contiguous int32 array")
    _reconstruct_f32_inplace_kernel(levels, float(step))


def reconstruct_bf16_bits(levels: np.ndarray, step: float) -> np.ndarray:
    """``levels * step`` rounded once to bfloat16, returned as its uint16 bit patterns.

    (torch's float64 -> bfloat16 conversion goes through float32 and can round twice.)
    """
    exact = levels.reshape(-1).astype(np.float64) * step
    bits = exact.view(np.uint64)
    # Round the float64 to 8 significant bits, ties to even, by integer arithmetic on its pattern;
    # the result converts to float32 exactly, whose top half is the bfloat16 pattern.
    lsb = (bits >> np.uint64(45)) & np.uint64(1)
    rounded = ((bits + np.uint64((1 << 44) - 1) + lsb) & ~np.uint64((1 << 45) - 1)).view(np.float64)
    finite = np.isfinite(exact)
    rounded = np.where(finite, rounded, exact)
    with np.errstate(over="ignore"):
        f32 = rounded.astype(np.float32)
    return (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16).reshape(levels.shape)


def quantize_nearest(values: np.ndarray, step: float) -> np.ndarray:
    """Levels of ``values`` (any float dtype, finite) at ``step``, rounded to nearest.

    The caller guarantees |values| / step < 2**31 - 1 (see :func:`qp_for_range`).
    """
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    out = np.empty(flat.shape[0], dtype=np.int32)
    _round_kernel(flat, float(step), out)
    return out.reshape(values.shape)


def reconstruct(levels: np.ndarray, step: float, dtype) -> np.ndarray:
    """``levels * step`` rounded once to ``dtype`` (a numpy float dtype)."""
    dtype = np.dtype(dtype)
    flat = np.ascontiguousarray(levels).reshape(-1)
    if dtype == np.float32:
        out = np.empty(flat.shape[0], dtype=np.float32)
        _reconstruct_f32_kernel(flat, float(step), out)
    else:
        out = (flat.astype(np.float64) * step).astype(dtype)
    return out.reshape(levels.shape)
