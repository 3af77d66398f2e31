"""Numba passes the encoder's planning makes over whole tensors: ranges, relative importance and
the row statistics behind the per-tensor column choices.

Private: call them through :mod:`deepcabac_py.model.tensor_plan`. Each is one pass without
temporaries the size of the tensor.
"""

import numpy as np

from .._jit import kernel


def float_range(values: np.ndarray) -> tuple[float, bool]:
    """max |x| over the finite values of a flat float array and whether all are finite. float32
    and float64 go by their bits (:func:`magnitude_range`, which vectorises: the loop over values
    took 4.7 ns per element on a series' moments, a third of a second per append of a 29M-parameter
    model's weights and moments), other dtypes one value at a time."""
    if values.dtype in _BITS and values.flags.c_contiguous:
        words, magnitude, infinity = _BITS[values.dtype]
        top, largest = magnitude_range(values.view(words), magnitude, infinity)
        return float(np.array([top], dtype=words).view(values.dtype)[0]), bool(largest < infinity)
    return _float_range_by_value(values)


# float dtype -> (its bit pattern's dtype, the mask of sign-less magnitude bits, infinity's pattern)
_BITS = {np.dtype(np.float32): (np.uint32, np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)),
         np.dtype(np.float64): (np.uint64, np.uint64(0x7FFFFFFFFFFFFFFF), np.uint64(0x7FF0000000000000))}


@kernel
def magnitude_range(bits, magnitude, infinity):
    """The largest magnitude pattern below ``infinity`` (0 if none) and the largest of all: a
    finite float's magnitude orders as its bits, infinity and NaN's above every finite one."""
    zero = magnitude ^ magnitude
    top = zero
    largest = zero  # (two plain maxima: the loop vectorises)
    for i in range(bits.shape[0]):
        m = bits[i] & magnitude
        largest = max(largest, m)
        top = max(top, m if m < infinity else zero)
    return top, largest


@kernel
def _float_range_by_value(values):
    top = 0.0
    finite = True
    for i in range(values.shape[0]):
        x = np.float64(values[i])
        if x != x or x == np.inf or x == -np.inf:
            finite = False
        elif abs(x) > top:
            top = abs(x)
    return top, finite


@kernel
def bfloat16_range(bits):
    """max |x| over the finite values and whether all are finite, of bfloat16 patterns: as
    :func:`float_range`, on the bits themselves (a finite pattern's magnitude orders as its value)."""
    top = np.int32(0)
    largest = np.int32(0)  # (two plain int32 maxima: the loop vectorizes, 0.15 ns per element)
    for i in range(bits.shape[0]):
        magnitude = np.int32(bits[i] & np.uint16(0x7FFF))
        largest = max(largest, magnitude)
        top = max(top, magnitude if magnitude < np.int32(0x7F80) else np.int32(0))
    wide = np.empty(1, dtype=np.uint32)
    wide[0] = np.uint32(top) << np.uint32(16)
    return np.float64(wide.view(np.float32)[0]), largest < np.int32(0x7F80)


@kernel
def bfloat16_to_float32(bits, out):
    """float32 values of bfloat16 patterns (exact: bfloat16 is float32's top half), in one pass."""
    wide = out.view(np.uint32)
    for i in range(bits.shape[0]):
        wide[i] = np.uint32(bits[i]) << np.uint32(16)


@kernel
def int_range(values):
    lo = np.int64(0)
    hi = np.int64(0)
    for i in range(values.shape[0]):
        x = np.int64(values[i])
        if x < lo:
            lo = x
        if x > hi:
            hi = x
    return lo, hi


@kernel
def relative_importance(part, mean, floor, out):
    # float32((x / mean + floor) / (1 + floor)) in float64, in one pass: as four numpy passes over
    # every chunk it cost 4% of a trellis encode of MiniLM.
    for i in range(part.shape[0]):
        out[i] = np.float32((np.float64(part[i]) / mean + floor) / (1.0 + floor))


@kernel
def row_statistics(rows, above, margin):
    """Over sampled rows (``rows[k]`` and the row above it in the tensor, ``above[k]``): the share
    clearly closer to the row above than to zero (sum |x_r - x_(r-1)| < margin * sum |x_r|), and the
    standard deviations of log(mean |x|) of those rows and of the columns over them."""
    count, ncols = rows.shape
    hits = 0
    row_mean = np.zeros(max(count, 1))
    col_mean = np.zeros(ncols)
    for k in range(count):
        near = 0.0
        far = 0.0
        for c in range(ncols):
            a = np.float64(rows[k, c])
            near += abs(a - np.float64(above[k, c]))
            far += abs(a)
            col_mean[c] += abs(a)
        if near < margin * far:
            hits += 1
        row_mean[k] = far / ncols
    total = 0.0
    for c in range(ncols):
        col_mean[c] /= max(count, 1)
        total += col_mean[c]
    floor = 1e-6 * total / ncols + 1e-300  # all-zero rows or columns count, without a log of zero
    return hits / max(count, 1), _log_spread(row_mean[:count], floor), _log_spread(col_mean, floor)


@kernel
def _log_spread(values, floor):
    n = values.shape[0]
    if n < 2:
        return 0.0
    mean = 0.0
    for v in values:
        mean += np.log(v + floor)
    mean /= n
    var = 0.0
    for v in values:
        d = np.log(v + floor) - mean
        var += d * d
    return np.sqrt(var / n)
