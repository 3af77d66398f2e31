"""Numba passes of the linear prediction across columns (see :mod:`.linear_prediction`).

Private: call them through ``linear_prediction``, which validates every argument. The sums of
products themselves are BLAS matrix products over integer-valued floats, exact because the caller
has checked that the magnitudes stay below 2**24 (float32) or 2**53 (float64); these passes gather,
add the products within a block of pivots (in the same exact float arithmetic) and round.
``docs/format.md`` ("Linear prediction") specifies the arithmetic; ``tests/test_linear_prediction.py``
holds a plain-Python reference.
"""

import numpy as np

from .._jit import kernel
from ._cabac_kernels import LEVEL_MAX

OK = 0
ERR_PIVOT_BOUND = 1  # a pivot level beyond the bound the stream declares
ERR_LEVEL_RANGE = 2  # a level or residual beyond the 31-bit range



@kernel
def gather_columns(x, cols, out):
    """out[r, j] = x[r, cols[j]] (levels to the float matrix of the BLAS product)."""
    for r in range(x.shape[0]):
        for j in range(cols.shape[0]):
            out[r, j] = x[r, cols[j]]


@kernel
def residuals(x, order, acc, intercepts, frac_bits, out):
    """out[r, t] = x[r, order[t]] - prediction, the prediction being
    ``(acc[r, t] + intercepts[t] + 2**(frac_bits - 1)) >> frac_bits`` (``acc`` holds exact integers)."""
    half = np.int64(1) << (frac_bits - 1) if frac_bits > 0 else np.int64(0)
    for r in range(x.shape[0]):
        for t in range(order.shape[0]):
            pred = (np.int64(acc[r, t]) + intercepts[t] + half) >> frac_bits
            v = np.int64(x[r, order[t]]) - pred
            if v > LEVEL_MAX or v < -LEVEL_MAX:
                return ERR_LEVEL_RANGE
            out[r, t] = v
    return OK


@kernel
def rebuild_pivots(res, j0, j1, acc, coef, intercepts, frac_bits, pivots, bound, out, xpt):
    """Levels of pivots ``j0 .. j1-1`` of every row: the residual plus the prediction. ``acc[t - j0]``
    holds, for every row, the sum of products over the pivots before ``j0`` (a BLAS product); the
    pivots from ``j0`` before ``t`` are added here, in the same exact float arithmetic. A level beyond
    ``bound`` is an error. Each level also goes into ``xpt`` (pivot-major), the next products' input."""
    half = np.int64(1) << (frac_bits - 1) if frac_bits > 0 else np.int64(0)
    rows = res.shape[0]
    for t in range(j0, j1):
        a = acc[t - j0]
        # over rows, contiguous: these loops vectorize (a row-by-row sum waits on every product)
        for i in range(j0, t):
            c = coef[t, i]
            x = xpt[i]
            for r in range(rows):
                a[r] += c * x[r]
        col = pivots[t]
        for r in range(rows):
            v = np.int64(res[r, t]) + ((np.int64(a[r]) + intercepts[t] + half) >> frac_bits)
            if v > bound or v < -bound:
                return ERR_PIVOT_BOUND
            out[r, col] = v
            xpt[t, r] = v
    return OK


@kernel
def rebuild_rest(res, m, acc, intercepts, frac_bits, order, out):
    """Levels of the other columns: out[r, order[t]] = res[r, t] + prediction, for t >= m."""
    half = np.int64(1) << (frac_bits - 1) if frac_bits > 0 else np.int64(0)
    for r in range(res.shape[0]):
        for t in range(m, order.shape[0]):
            v = np.int64(res[r, t]) + ((np.int64(acc[r, t - m]) + intercepts[t] + half) >> frac_bits)
            if v > LEVEL_MAX or v < -LEVEL_MAX:
                return ERR_LEVEL_RANGE
            out[r, order[t]] = v
    return OK
