"""Numba kernels of log2 and exp2 (private: :mod:`.portable` is the front) and of the log domain
(private: :mod:`.log_domain` is the front)."""

from __future__ import annotations

import numpy as np

from .._jit import float_kernel, kernel


@kernel
def log2_into(x, out):
    """out[i] = log2(x[i]), one element at a time (the C library's log2)."""
    for i in range(x.shape[0]):
        out[i] = np.log2(x[i])


@kernel
def exp2_into(x, out):
    """out[i] = 2 ** x[i], one element at a time (the C library's exp2)."""
    for i in range(x.shape[0]):
        out[i] = np.exp2(x[i])


@float_kernel
def log_exponents(x, step, k):
    """k[i] = rint(log2|x[i]| / step) (the C library's log2; half to even) for nonzero x[i], 0 for
    zero; returns (the smallest and largest k of the nonzero elements, whether there is one, and
    whether every x[i] is finite and every k fits an int64)."""
    lo, hi = np.int64(0), np.int64(0)
    seen = False
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        if not np.isfinite(xi):
            return lo, hi, seen, False
        if xi == 0:
            k[i] = 0
            continue
        e = np.rint(np.log2(np.abs(xi)) / step)
        if not abs(e) < 9.2e18:
            return lo, hi, seen, False
        ki = np.int64(e)
        k[i] = ki
        if not seen:
            lo, hi, seen = ki, ki, True
        elif ki < lo:
            lo = ki
        elif ki > hi:
            hi = ki
    return lo, hi, seen, True


@kernel
def signed_magnitudes(x, k, offset, levels):
    """levels[i] = sign(x[i]) * (k[i] - offset) for nonzero x[i], 0 for zero."""
    for i in range(x.shape[0]):
        if x[i] == 0:
            levels[i] = 0
        else:
            m = np.int32(k[i] - offset)
            levels[i] = -m if x[i] < 0 else m


@float_kernel
def log_values_into(levels, offset, step, lo, hi, out):
    """out[i] = sign(levels[i]) * clip(2 ** ((|levels[i]| + offset) * step), lo, hi) in float64
    (the C library's exp2), rounded once to ``out``'s dtype; 0 for a level 0."""
    for i in range(levels.shape[0]):
        lv = np.int64(levels[i])
        if lv == 0:
            out[i] = 0.0
            continue
        x = np.exp2(np.float64(abs(lv) + offset) * step)
        x = min(max(x, lo), hi)
        out[i] = -x if lv < 0 else x
