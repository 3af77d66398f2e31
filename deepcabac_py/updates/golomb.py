"""The Golomb position code of the STC/SBC papers: the baseline for sparse updates (and a coder option).

The nonzero positions of a tensor of ``n`` elements with ``k`` nonzeros are sent as the gaps
``d = pos[i] - pos[i-1]`` (``pos[-1] = -1``, so ``d >= 1``), each in a Golomb-Rice code of
parameter ``2**b``: the quotient ``(d - 1) >> b`` in unary (that many 1 bits, then a 0), then the
``b`` low bits of ``d - 1``. The parameter comes from the density alone (Sattler et al.):

    q  = (k + 1) / (n + 1)
    b* = 1 + floor(log2( ln(phi - 1) / ln(1 - q) )),   phi = (1 + sqrt 5) / 2

so one gap costs exactly ``ceil(d / 2**b) + b`` bits (:func:`position_bits` is that closed form;
the coder below writes exactly that many). The expected cost of a geometric gap is
``b + 1 / (1 - (1 - q)**(2**b))`` bits (:func:`expected_position_bits`). STC adds one sign bit per
nonzero, SBC none (one side, one sign per tensor); both add a 32-bit float per tensor.

(The simulator of the STC paper counts ``mean(ceil(d / 2**b)) + b + 1`` bits per position, one bit
more than a Golomb-Rice code needs; this module counts the bits a real coder writes.)
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import kernel
from ..errors import CorruptStreamError

PHI = (1.0 + math.sqrt(5.0)) / 2.0
MAX_B = 62


def golomb_parameter(k: int, n: int) -> int:
    """The Rice parameter ``b*`` for ``k`` nonzeros among ``n`` positions (0 when dense)."""
    if n <= 0 or k <= 0:
        return 0
    q = (k + 1) / (n + 1)
    if q >= 1.0:
        return 0
    b = 1 + math.floor(math.log2(math.log(PHI - 1.0) / math.log1p(-q)))
    return int(min(MAX_B, max(0, b)))


def expected_position_bits(k: int, n: int) -> float:
    """Expected bits per position for geometric gaps of density ``q = (k+1)/(n+1)``."""
    if k <= 0 or n <= 0:
        return 0.0
    q = min(1.0, (k + 1) / (n + 1))
    b = golomb_parameter(k, n)
    if q >= 1.0:
        return 1.0 + b
    return b + 1.0 / (1.0 - (1.0 - q) ** (2 ** b))


def gaps(positions: np.ndarray) -> np.ndarray:
    """Gaps ``d >= 1`` of sorted flat positions."""
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    return np.diff(np.concatenate([[-1], pos]))


def position_bits(positions: np.ndarray, n: int, b: int | None = None) -> int:
    """Exact bits of the Golomb-Rice position code: ``sum(ceil(d / 2**b)) + k * b``."""
    d = gaps(positions)
    if d.size == 0:
        return 0
    if b is None:
        b = golomb_parameter(d.size, n)
    return int(((d - 1) >> b).sum() + d.size * (1 + b))


def entropy_bits_per_position(k: int, n: int) -> float:
    """The iid bound: ``n * H2(k / n) / k`` bits per nonzero (positions drawn uniformly)."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return n * (-p * math.log2(p) - (1 - p) * math.log2(1 - p)) / k


def stc_bits(levels: np.ndarray, *, sign_bits: bool = True, step_bits: int = 32) -> int:
    """Bits STC (``sign_bits``) or SBC (no sign bits) needs for one tensor of ternary levels."""
    flat = np.asarray(levels).reshape(-1)
    pos = np.flatnonzero(flat)
    if pos.size == 0:
        return 0
    return position_bits(pos, flat.size) + (pos.size if sign_bits else 0) + step_bits


# --------------------------------------------------------------------------------------------------
# the coder (bit-exact with position_bits)
# --------------------------------------------------------------------------------------------------


@kernel
def _put_bits(out, bitpos, value, nbits):
    for j in range(nbits - 1, -1, -1):
        if (value >> j) & 1:
            out[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
        bitpos += 1
    return bitpos


@kernel
def encode_tensor_kernel(levels, b, signs, out, bitpos):
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
def decode_tensor_kernel(buf, bitpos, k, b, signs, side, out):
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


def encode_positions(levels: np.ndarray, *, signs: bool = True) -> bytes:
    """Golomb-code one tensor of levels in {-1, 0, +1} (zero-padded to whole bytes)."""
    flat = np.ascontiguousarray(np.asarray(levels).reshape(-1), dtype=np.int32)
    if flat.size and int(np.abs(flat).max()) > 1:
        raise ValueError("the Golomb code carries levels in {-1, 0, +1} only")
    k = int(np.count_nonzero(flat))
    b = golomb_parameter(k, flat.size)
    nbits = position_bits(np.flatnonzero(flat), flat.size, b) + (k if signs else 0)
    out = np.zeros((nbits + 7) // 8, dtype=np.uint8)
    end = encode_tensor_kernel(flat, b, signs, out, 0)
    assert end == nbits
    return out.tobytes()


def decode_positions(data, k: int, n: int, *, signs: bool = True, side: int = 1) -> np.ndarray:
    """Inverse of :func:`encode_positions` for ``k`` nonzeros among ``n`` positions (flat int32).

    Without signs every nonzero is ``side`` (+1 or -1). Raises :class:`CorruptStreamError`.
    """
    if not 0 <= k <= n:
        raise CorruptStreamError(f"{k} nonzeros cannot fit in {n} positions")
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    if k > buf.size * 8:
        raise CorruptStreamError(f"{k} positions cannot fit in {buf.size} bytes")
    out = np.zeros(n, dtype=np.int32)
    end = decode_tensor_kernel(buf, 0, k, golomb_parameter(k, n), signs, side, out)
    if end < 0:
        raise CorruptStreamError("Golomb position code is inconsistent")
    return out
