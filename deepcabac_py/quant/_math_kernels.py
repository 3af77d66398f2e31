"""Numba kernels of log2 and exp2 (private: :mod:`.portable` is the front)."""

from __future__ import annotations

import numpy as np

from .._jit import kernel


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
