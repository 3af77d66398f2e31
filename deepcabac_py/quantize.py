"""Uniform scalar quantization: the step from (qp, qp_density) and the integer levels.

The step follows the NNC formula exactly, so a setting here compares one to one with NNCodec:
with k = 2**qp_density, ``step = (k + qp mod k) * 2**(floor(qp / k) - qp_density)``. Reconstruction
is ``level * step``, computed in float64 (exact: the mantissa of the step has at most 7 bits and
|level| < 2**31) and rounded once, to nearest even, to the tensor's dtype, so the encoder and the
decoder produce the same bits.

Three quantizers produce the levels of a chunk (the unit the level coder codes):

* ``nearest``: plain rounding, half away from zero (NNC's URQ).
* ``rdoq``: rate-distortion optimised rounding; each weight takes the nearest level, the next one
  towards zero or zero, whichever minimises importance * error**2 + lambda * bits, with the bits
  taken from the level coder's live contexts.
* ``trellis``: dependent quantization. Two interleaved grids at the fine step (even and odd
  multiples) selected by a 4-state machine driven by the parity of each transmitted level, chosen by
  a Viterbi search with the same cost. The stream marks such tensors ``Mode.DEPENDENT`` and the
  decoder runs the state machine (:func:`dq_indices`). The effective step is about twice the fine
  one, as in NNC (qp keeps NNC's meaning: the fine step).

Lambda is in units of step**2 per bit (of the fine step for the trellis); ``lambda_scale``
multiplies the default of each quantizer.
"""

from __future__ import annotations

import math

import numpy as np

from . import _rd_kernels, levelcoder
from ._jit import kernel
from .errors import CorruptStreamError

MAX_LEVEL = (1 << 31) - 1
QP_MIN, QP_MAX = -(1 << 12), (1 << 12) - 1
QP_DENSITY_MAX = 6
_STEP_MIN = 2.0**-1022  # smallest normal float64

QUANTIZERS = ("nearest", "rdoq", "trellis")
# Default lambdas (units: step**2 per bit), set by the rate-distortion sweeps of
# benchmarks/bench_rd.py. High-rate theory gives ln(2)/6 ~ 0.116 for a uniform quantizer; the
# trellis works on a grid half as fine, hence about four times that, as in NNC.
DEFAULT_LAMBDA = {"nearest": 0.0, "rdoq": 0.116, "trellis": 0.46}
MAX_DQ_LEVEL = _rd_kernels.MAX_DQ_LEVEL


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


def _check_importance(importance, n: int) -> np.ndarray:
    if importance is None:
        return np.empty(0, dtype=np.float32)
    imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if imp.shape[0] != n:
        raise ValueError(f"importance has {imp.shape[0]} values for {n} weights")
    return imp


def quantize_rd(values: np.ndarray, step: float, *, method: str, lam: float, ncols: int = 0, col0: int = 0,
                k_offset: int = 0, predict: bool = False, importance: np.ndarray | None = None) -> np.ndarray:
    """Levels of the flat float ``values`` (one chunk of the level coder) by ``method``.

    ``ncols``, ``col0``, ``k_offset`` and ``predict`` describe the chunk as the level coder will
    code it (:class:`deepcabac_py.levelcoder.ChunkLayout`), so the rates are the coder's own.
    ``importance`` (one non-negative float per value) weights the squared error. For ``trellis``
    the result are transmitted levels: their values are :func:`dq_indices` times ``step``. Every
    method gives level 0 to an exact zero (pruned weights stay pruned).
    """
    if method not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {method!r}")
    flat, imp = _rd_inputs(values, lam, importance)
    out = np.empty(flat.shape[0], dtype=np.int32)
    if method == "nearest":
        _round_kernel(flat, float(step), out)
    elif method == "rdoq":
        _rd_kernels.rdoq_kernel(flat, imp, float(step), float(lam), int(ncols), int(col0), int(k_offset),
                                bool(predict), MAX_LEVEL if not predict else MAX_DQ_LEVEL, out)
    else:
        # the trellis codes what it commits; with no room for bytes it only returns the levels
        _rd_kernels.trellis_kernel(flat, imp, float(step), float(lam), int(ncols), int(col0), int(k_offset),
                                   bool(predict), out, np.empty(0, dtype=np.uint8))
    return out


def trellis_encode_chunk(values: np.ndarray, step: float, *, lam: float, layout: levelcoder.ChunkLayout,
                         index: int, importance: np.ndarray | None = None,
                         levels: np.ndarray | None = None) -> bytes:
    """The level substream of chunk ``index`` of ``layout`` quantized by the trellis: the same bytes
    as ``levelcoder.encode_chunk(quantize_rd(values, step, method="trellis", ...), layout, index)``,
    in one pass (the trellis commits each block of levels straight into the coder, whose modelling
    state it prices the next block with). ``levels`` (flat int32 of the chunk's length), if given,
    receives the transmitted levels (:func:`dq_indices` gives their reconstruction indices)."""
    flat, imp = _rd_inputs(values, lam, importance)
    start, stop = layout.bounds(index)
    if flat.shape[0] != stop - start:
        raise ValueError(f"chunk {index} has {stop - start} values, got {flat.shape[0]}")
    if levels is None:
        levels = np.empty(flat.shape[0], dtype=np.int32)
    elif levels.dtype != np.int32 or levels.shape != (flat.shape[0],) or not levels.flags.c_contiguous:
        raise ValueError(f"levels must be a flat contiguous int32 array of {flat.shape[0]} values")
    return levelcoder.run_encoder(flat.shape[0], lambda out: _rd_kernels.trellis_kernel(
        flat, imp, float(step), float(lam), layout.ncols, layout.first_column(start), layout.k_offset,
        layout.predict, levels, out))


def _rd_inputs(values: np.ndarray, lam: float, importance) -> tuple[np.ndarray, np.ndarray]:
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    if not (lam >= 0.0 and math.isfinite(lam)):
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    return flat, _check_importance(importance, flat.shape[0])


def dq_indices(levels: np.ndarray) -> np.ndarray:
    """Reconstruction indices of a chunk of trellis-coded (transmitted) levels: value = index * step.

    Raises :class:`CorruptStreamError` if a level is outside the trellis range (a damaged stream).
    """
    flat = np.ascontiguousarray(levels, dtype=np.int32).reshape(-1)
    out = np.empty_like(flat)
    if not _rd_kernels.dq_reconstruct_kernel(flat, out):
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
    return out.reshape(np.shape(levels))


def dq_reconstruct_f32_inplace(levels: np.ndarray, step: float) -> None:
    """Overwrite a chunk of flat int32 transmitted trellis levels with their float32 values."""
    if levels.dtype != np.int32 or levels.ndim != 1 or not levels.flags.c_contiguous:
        raise ValueError("levels must be a flat contiguous int32 array")
    if not _rd_kernels.dq_reconstruct_f32_kernel(levels, float(step)):
        raise CorruptStreamError(f"a trellis level exceeds {MAX_DQ_LEVEL} in magnitude")
