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

from ..errors import CorruptStreamError
from . import _golomb_kernels

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


def encode_tensors(parts: list[tuple[np.ndarray, bool]]) -> bytes:
    """The Golomb code of several tensors of levels in {-1, 0, +1}, one after the other in one bit
    string (zero-padded to whole bytes): per tensor, the gaps of its nonzeros and, when its flag
    says so, one sign bit per nonzero (1 = negative)."""
    plans, nbits = [], 0
    for levels, signs in parts:
        flat = np.ascontiguousarray(np.asarray(levels).reshape(-1), dtype=np.int32)
        if flat.size and int(np.abs(flat).max()) > 1:
            raise ValueError("the Golomb code carries levels in {-1, 0, +1} only")
        positions = np.flatnonzero(flat)
        b = golomb_parameter(positions.size, flat.size)
        nbits += position_bits(positions, flat.size, b) + (positions.size if signs else 0)
        plans.append((flat, b, bool(signs)))
    out = np.zeros((nbits + 7) // 8, dtype=np.uint8)
    pos = 0
    for flat, b, signs in plans:
        pos = _golomb_kernels.encode_tensor(flat, b, signs, out, pos)
    if pos != nbits:
        raise RuntimeError(f"internal error: the Golomb coder wrote {pos} bits, its closed form says {nbits}")
    return out.tobytes()


def encode_positions(levels: np.ndarray, *, signs: bool = True) -> bytes:
    """Golomb-code one tensor of levels in {-1, 0, +1} (zero-padded to whole bytes)."""
    return encode_tensors([(levels, signs)])


def decode_tensor(buf: np.ndarray, bitpos: int, k: int, out: np.ndarray, *, signs: bool, side: int = 1) -> int:
    """Decode ``k`` nonzeros from bit ``bitpos`` of ``buf`` (uint8) into the zeroed flat int32
    ``out``; returns the bit position after them. Without signs every nonzero is ``side``.
    Raises :class:`CorruptStreamError` where the code is inconsistent."""
    if not 0 <= k <= out.shape[0]:
        raise CorruptStreamError(f"{k} nonzeros cannot fit in {out.shape[0]} positions")
    end = _golomb_kernels.decode_tensor(buf, bitpos, k, golomb_parameter(k, out.shape[0]), signs, side, out)
    if end < 0:
        raise CorruptStreamError("Golomb position code is inconsistent")
    return end


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
    decode_tensor(buf, 0, k, out, signs=signs, side=side)
    return out
