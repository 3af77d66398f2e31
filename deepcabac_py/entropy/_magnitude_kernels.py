"""Numba kernels of integers coded by magnitude class (Mode.MAGNITUDE): the float coder's symbol
and raw bits for integers (private: :mod:`.floatcoder` is the validated front)."""

from __future__ import annotations

import numpy as np

from .._jit import helper, kernel
from ._float_kernels import (
    ERR_OVERRUN,
    ERR_TRAILING,
    OK,
    TOP_BITS,
    _last_raw_word,
)

# --- integers by magnitude class (Mode.MAGNITUDE) ------------------------------------------------
# The symbol is the bit length b of |v| (0 to the width) and the TOP_BITS bits below its leading
# one (the density falls inside an octave, as a float's mantissa), coded like the float symbol; the
# raw bits are the sign and the rest of |v|: wide integers (differences of float bits) cost their
# length's entropy plus their own bits, nothing per bit of the length.

ERR_BAD_INTEGER = -6  # a decoded integer outside its dtype, or a negative zero


@helper
def _magnitude(v):
    """(bit length, |v| as uint64) of an int64."""
    m = np.uint64(v) if v >= 0 else np.uint64(-(v + 1)) + np.uint64(1)
    b = 0
    while b < 64 and (m >> np.uint64(b)) > np.uint64(0):
        b += 1
    return b, m


@helper
def _magnitude_parts(v):
    """(symbol, the bits of |v| below the symbol's, their count) of an int64."""
    b, m = _magnitude(v)
    k = max(b - 1, 0)
    t = min(TOP_BITS, k)
    low_bits = k - t
    top = np.int64((m >> np.uint64(low_bits)) & np.uint64((1 << t) - 1))
    return b * (1 << TOP_BITS) + (top << (TOP_BITS - t)), m & ((np.uint64(1) << np.uint64(low_bits)) - np.uint64(1)), \
        low_bits


@kernel
def int_stats(values, seg_len, mean_length):
    n = values.shape[0]
    for j in range(mean_length.shape[0]):
        start = j * seg_len
        stop = min(n, start + seg_len)
        total = 0
        for i in range(start, stop):
            b, _ = _magnitude(np.int64(values[i]))
            total += b
        mean_length[j] = total / max(stop - start, 1)


@kernel
def int_encode_kernel(values, symbols, raw_out):
    """As :func:`encode_kernel`, for integers by magnitude class; ``raw_out`` holds 2 words per
    element and one more."""
    n = values.shape[0]
    acc = np.uint64(0)
    nacc = 0
    nraw = 0
    for i in range(n):
        v = np.int64(values[i])
        sym, rest, left = _magnitude_parts(v)
        symbols[i] = sym
        # the sign, then the bits below the symbol's (at most 61), in pieces of at most 32
        acc |= np.uint64(v < 0) << np.uint64(nacc)
        nacc += 1
        while True:
            if nacc >= 32:
                raw_out[nraw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                nraw += 1
                acc >>= np.uint64(32)
                nacc -= 32
            if left == 0:
                break
            piece = min(left, 32)
            acc |= (rest & ((np.uint64(1) << np.uint64(piece)) - np.uint64(1))) << np.uint64(nacc)
            nacc += piece
            rest >>= np.uint64(piece)
            left -= piece
    return _last_raw_word(acc, nacc, nraw, raw_out)


@kernel
def int_decode_kernel(raw, symbols, lo_value, hi_value, out):
    """Rebuild the integers ``out`` (each in [lo_value, hi_value]) from the decoded ``symbols`` and
    the raw bits; OK or an error code. As :func:`decode_kernel`: ``raw`` ends with one word of
    padding."""
    n = out.shape[0]
    nw = raw.shape[0] - 1
    acc = np.uint64(0)
    nacc = 0
    q = 0
    for i in range(n):
        sym = np.int64(symbols[i])
        # the sign, then the bits below the symbol's
        if nacc < 1:
            if q >= nw:
                return ERR_OVERRUN
            acc |= np.uint64(raw[q]) << np.uint64(nacc)
            q += 1
            nacc += 32
        negative = (acc & np.uint64(1)) != np.uint64(0)
        acc >>= np.uint64(1)
        nacc -= 1
        b = sym >> TOP_BITS
        k = max(b - 1, 0)
        t = min(TOP_BITS, k)
        if sym & ((1 << (TOP_BITS - t)) - 1):  # (bits below the value's own: not canonical)
            return ERR_BAD_INTEGER
        left = k - t
        m = np.uint64(0)
        got = 0
        while left > 0:
            piece = min(left, 32)
            if nacc < piece:
                if q >= nw:
                    return ERR_OVERRUN
                acc |= np.uint64(raw[q]) << np.uint64(nacc)
                q += 1
                nacc += 32
            m |= (acc & ((np.uint64(1) << np.uint64(piece)) - np.uint64(1))) << np.uint64(got)
            acc >>= np.uint64(piece)
            nacc -= piece
            got += piece
            left -= piece
        if b == 0:
            if negative:
                return ERR_BAD_INTEGER
            value = np.int64(0)
        else:
            top = np.uint64((sym & ((1 << TOP_BITS) - 1)) >> (TOP_BITS - t))
            m |= (np.uint64(1) << np.uint64(b - 1)) | (top << np.uint64(k - t))
            if negative:  # (-2**63 included: -(m - 1) - 1)
                if m - np.uint64(1) > np.uint64(-(lo_value + 1)):
                    return ERR_BAD_INTEGER
                value = -np.int64(m - np.uint64(1)) - 1
            else:
                if m > np.uint64(hi_value):
                    return ERR_BAD_INTEGER
                value = np.int64(m)
        out[i] = value
    if q != nw or acc != np.uint64(0):
        return ERR_TRAILING
    return OK
