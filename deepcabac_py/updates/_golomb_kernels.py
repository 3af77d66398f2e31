"""Numba kernels of the Golomb position code (private: call them through :mod:`.golomb`)."""

import numpy as np

from .._jit import kernel


@kernel
def _put_bits(out, bitpos, value, nbits):
    for j in range(nbits - 1, -1, -1):
        if (value >> j) & 1:
            out[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
        bitpos += 1
    return bitpos


@kernel
def encode_tensor(levels, b, signs, out, bitpos):
    """Append the Golomb-Rice gaps of the nonzeros of flat ``levels`` and, when ``signs``, one bit
    per nonzero (1 = negative) to the zeroed buffer ``out`` from bit ``bitpos``; returns the new
    bit position."""
    last = -1
    for i in range(levels.shape[0]):
        if levels[i] != 0:
            d = i - last
            last = i
            q = (d - 1) >> b
            for _ in range(q):
                out[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
                bitpos += 1
            bitpos += 1  # the terminating 0
            bitpos = _put_bits(out, bitpos, d - 1, b)
    if signs:
        for i in range(levels.shape[0]):
            if levels[i] != 0:
                if levels[i] < 0:
                    out[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
                bitpos += 1
    return bitpos


@kernel
def decode_tensor(buf, bitpos, k, b, signs, side, out):
    """Decode ``k`` positions (and signs) into the zeroed flat ``out``; returns the new bit position,
    or -1 if the data are inconsistent (a gap past the end, or bits past the buffer)."""
    nbits = buf.shape[0] * 8
    n = out.shape[0]
    last = -1
    for _ in range(k):
        q = 0
        while True:
            if bitpos >= nbits:
                return -1
            bit = (np.int64(buf[bitpos >> 3]) >> (7 - (bitpos & 7))) & 1
            bitpos += 1
            if bit == 0:
                break
            q += 1
            if q > n:
                return -1
        if bitpos + b > nbits:
            return -1
        r = 0
        for _ in range(b):
            r = (r << 1) | ((np.int64(buf[bitpos >> 3]) >> (7 - (bitpos & 7))) & 1)
            bitpos += 1
        d = (q << b) + r + 1
        pos = last + d
        if pos >= n:
            return -1
        out[pos] = side
        last = pos
    if signs:
        if bitpos + k > nbits:
            return -1
        for i in range(n):
            if out[i] != 0:
                if (np.int64(buf[bitpos >> 3]) >> (7 - (bitpos & 7))) & 1:
                    out[i] = -1
                else:
                    out[i] = 1
                bitpos += 1
    return bitpos
