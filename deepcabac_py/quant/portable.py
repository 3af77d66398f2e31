"""Arithmetic whose last bits do not depend on the processor, where written bytes depend on them.

NumPy's ``log2`` and ``exp2`` take Intel's SVML on processors with AVX-512 and the C library's
elsewhere, and BLAS's dot products sum in an order of the processor's kernel: their last bits
differ. A checkpoint series wrote different bytes on a Zen 4 and on a Zen 3 (its second moments'
log2 ratios, the decoded moments, and the prediction coefficients fitted from them and stored in
its entries), and log-domain levels could fall on the other side of a tie. Here log2 and exp2 are
the C library's, one element at a time on every processor (Numba would vectorise the loops with
SVML only where ``intel-cmplr-lib-rt`` is installed; ``NUMBA_DISABLE_INTEL_SVML=1`` keeps them
scalar there), and sums run in NumPy's pairwise order, which no processor changes.
"""

from __future__ import annotations

import numpy as np

from . import _math_kernels as _k

__all__ = ["dot", "exp2", "log2"]


def _each(kernel, values) -> np.ndarray:
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    kernel(flat, out)
    return out.reshape(np.shape(values))


def log2(values) -> np.ndarray:
    """log2 of each element (float64, ``values``' shape)."""
    return _each(_k.log2_into, values)


def exp2(values) -> np.ndarray:
    """2 to the power of each element (float64, ``values``' shape)."""
    return _each(_k.exp2_into, values)


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """The dot product of two float64 vectors, products rounded one by one and summed pairwise."""
    return float(np.sum(np.multiply(a, b, dtype=np.float64)))
