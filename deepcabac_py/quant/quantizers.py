"""The three quantizers: integer levels of a chunk of float values at a step.

* ``nearest``: plain rounding, half away from zero (NNC's URQ).
* ``rdoq``: rate-distortion optimised rounding; each weight takes the nearest level, the next one
  towards zero or zero, whichever minimises importance * error**2 + lambda * bits, with the bits
  taken from the level coder's live contexts.
* ``trellis``: dependent quantization. Two interleaved grids at the fine step (even and odd
  multiples) selected by a 4-state machine driven by the parity of each transmitted level, chosen by
  a Viterbi search with the same cost. The stream marks such tensors ``Mode.DEPENDENT`` and the
  decoder runs the state machine (:func:`deepcabac_py.quant.reconstruct.dq_indices`). The effective
  step is about twice the fine one, as in NNC (qp keeps NNC's meaning: the fine step).

A chunk is the unit the level coder codes (:class:`deepcabac_py.entropy.levelcoder.ChunkLayout`):
the RD quantizers price levels with the coder's modelling state at that place of the chunk.
Lambda is in units of step**2 per bit (of the fine step for the trellis); ``lambda_scale``
multiplies the default of each quantizer.
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import not_yet_compiled
from ..entropy import chunk_layout, levelcoder
from ..entropy.levelcoder import LEVEL_MAX
from . import _quantizer_kernels
from ._reconstruct_kernels import MAX_DQ_LEVEL

QUANTIZERS = ("nearest", "rdoq", "trellis")
# Default lambdas (units: step**2 per bit), set by the rate-distortion sweeps of
# benchmarks/bench_rd.py. High-rate theory gives ln(2)/6 ~ 0.116 for a uniform quantizer; the
# trellis works on a grid half as fine, hence about four times that, as in NNC.
DEFAULT_LAMBDA = {"nearest": 0.0, "rdoq": 0.116, "trellis": 0.46}


def first_call_compiles(quantizer: str) -> bool:
    """Whether the first use of ``quantizer`` in this process compiles its kernels."""
    kernels = {"trellis": _quantizer_kernels.trellis_kernel, "rdoq": _quantizer_kernels.rdoq_kernel,
               "nearest": _quantizer_kernels.round_kernel}
    return not_yet_compiled(kernels[quantizer]) if quantizer in kernels else False


def check_quantizer(quantizer: str) -> str:
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {quantizer!r}")
    return quantizer


def quantize_nearest(values: np.ndarray, step: float) -> np.ndarray:
    """Levels of ``values`` (any float dtype, finite) at ``step``, rounded to nearest.

    The caller guarantees |values| / step < 2**31 - 1
    (:func:`deepcabac_py.quant.steps.qp_for_range`).
    """
    flat = _float_flat(values)
    out = np.empty(flat.shape[0], dtype=np.int32)
    _quantizer_kernels.round_kernel(flat, float(step), out)
    return out.reshape(np.shape(values))


def quantize_rd(values: np.ndarray, step: float, *, method: str, lam: float, ncols: int = 0, col0: int = 0,
                k_offset: int = 0, predict: bool = False, importance: np.ndarray | None = None) -> np.ndarray:
    """Levels of the flat float ``values`` (one chunk of the level coder) by ``method``.

    ``ncols``, ``col0``, ``k_offset`` and ``predict`` describe the chunk as the level coder will
    code it, so the rates are the coder's own. ``importance`` (one non-negative float per value)
    weights the squared error. For ``trellis`` the result are transmitted levels: their values are
    :func:`~deepcabac_py.quant.reconstruct.dq_indices` times ``step``. Every method gives level 0
    to an exact zero (pruned weights stay pruned).
    """
    check_quantizer(method)
    flat, imp = _rd_inputs(values, lam, importance)
    out = np.empty(flat.shape[0], dtype=np.int32)
    if method == "nearest":
        _quantizer_kernels.round_kernel(flat, float(step), out)
    elif method == "rdoq":
        _quantizer_kernels.rdoq_kernel(flat, imp, float(step), float(lam), int(ncols), int(col0), int(k_offset),
                                       bool(predict), LEVEL_MAX if not predict else MAX_DQ_LEVEL, out)
    else:
        # the trellis codes what it commits; with no room for bytes it only returns the levels
        _quantizer_kernels.trellis_kernel(flat, imp, float(step), float(lam), int(ncols), int(col0), int(k_offset),
                                          bool(predict), out, np.empty(0, dtype=np.uint8))
    return out


def trellis_encode_chunk(values: np.ndarray, step: float, *, lam: float, layout: chunk_layout.ChunkLayout,
                         index: int, importance: np.ndarray | None = None,
                         levels: np.ndarray | None = None) -> bytes:
    """The level substream of chunk ``index`` of ``layout`` quantized by the trellis: the same bytes
    as ``levelcoder.encode_chunk(quantize_rd(values, step, method="trellis", ...), layout, index)``,
    in one pass (the trellis commits each block of levels straight into the coder, whose modelling
    state it prices the next block with). ``levels`` (flat int32 of the chunk's length), if given,
    receives the transmitted levels."""
    flat, imp = _rd_inputs(values, lam, importance)
    start, stop = layout.bounds(index)
    if flat.shape[0] != stop - start:
        raise ValueError(f"chunk {index} has {stop - start} values, got {flat.shape[0]}")
    if levels is None:
        levels = np.empty(flat.shape[0], dtype=np.int32)
    elif levels.dtype != np.int32 or levels.shape != (flat.shape[0],) or not levels.flags.c_contiguous:
        raise ValueError(f"levels must be a flat contiguous int32 array of {flat.shape[0]} values")
    return levelcoder.run_encoder(flat.shape[0], lambda out: _quantizer_kernels.trellis_kernel(
        flat, imp, float(step), float(lam), layout.ncols, layout.first_column(start), layout.k_offset,
        layout.predict, levels, out))


def _float_flat(values: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    return flat


def _rd_inputs(values: np.ndarray, lam: float, importance) -> tuple[np.ndarray, np.ndarray]:
    flat = _float_flat(values)
    if not (lam >= 0.0 and math.isfinite(lam)):
        raise ValueError(f"lambda must be finite and >= 0, got {lam}")
    if importance is None:
        return flat, np.empty(0, dtype=np.float32)
    imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if imp.shape[0] != flat.shape[0]:
        raise ValueError(f"importance has {imp.shape[0]} values for {flat.shape[0]} weights")
    return flat, imp
