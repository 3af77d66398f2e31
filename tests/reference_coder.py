"""A slow, plain-Python reference of the level coder in ``deepcabac_py/entropy/_cabac_kernels.py``.

Written independently of the Numba kernels, from the algorithm they document, with Python ints
only (no numba, no numpy in the loops). Only the numeric constants are imported, so a change of a
constant propagates; a change of the *algorithm* must be made here too, in the one place that owns
the concept:

* :class:`RangeEncoder` / :class:`RangeDecoder` -- the binary arithmetic (range) coder: context bins
  with a probability, bypass bit groups, the terminate bin, the flush.
* :class:`Context` -- one adaptive probability estimator (a probability plus a warm-up counter).
* :class:`ScaleTracker` -- the local scale (row EMA along the scan, column EMA across rows).
* :func:`bucket_and_rice` -- scale -> (context bucket, Rice parameter k).
* :class:`LevelBinarizer` -- level <-> bins: zigzag map, unary prefix with Exp-Golomb escape,
  context-coded top suffix bit, bypass remainder.

Public entry points mirror :mod:`deepcabac_py.entropy.levelcoder`:

* :func:`encode_levels` returns exactly what ``levelcoder.encode_chunk`` returns (the range coder's
  always-zero first byte dropped, at most MAX_STRIPPED trailing zero bytes stripped);
* :func:`decode_levels` returns the levels, or raises :class:`ReferenceDecodeError` carrying the
  kernel status code the Numba decoder would report.
"""

from __future__ import annotations

from deepcabac_py.entropy import _cabac_kernels as _K
from deepcabac_py.entropy.chunk_layout import PREDICT_BIT

# --- constants (imported so that a change propagates) ----------------------------------------------
PROB_BITS = _K.PROB_BITS
PROB_ONE = _K.PROB_ONE
P_MIN = _K.P_MIN
TOP = _K.TOP
RANGE_INIT = _K.RANGE_INIT
TERMINATE_P = _K.TERMINATE_P
RATE = _K.RATE
WARMUP_MAX = _K.WARMUP_MAX
SCALE_FRAC = _K.SCALE_FRAC
ROW_SHIFT = _K.ROW_SHIFT
COL_SHIFT = _K.COL_SHIFT
N_BUCKETS = _K.N_BUCKETS
N_UNARY_CTX = _K.N_UNARY_CTX
N_SUFFIX_CTX = _K.N_SUFFIX_CTX
CTX_PER_BUCKET = _K.CTX_PER_BUCKET
Q_MAX = _K.Q_MAX
U_MAX = _K.U_MAX
MAX_BYPASS_GROUP = _K.MAX_BYPASS_GROUP
OVERRUN_SLACK = _K.OVERRUN_SLACK

OK = _K.OK
ERR_BAD_START = _K.ERR_BAD_START
ERR_BAD_ESCAPE = _K.ERR_BAD_ESCAPE
ERR_BAD_VALUE = _K.ERR_BAD_VALUE
ERR_BAD_TERMINATE = _K.ERR_BAD_TERMINATE
ERR_OVERRUN = _K.ERR_OVERRUN
ERR_BAD_BYPASS = _K.ERR_BAD_BYPASS

# Longest Exp-Golomb prefix (ones + the terminating zero) the decoder accepts.
MAX_ESCAPE_LENGTH = 34


class ReferenceDecodeError(Exception):
    """The substream is inconsistent; ``status`` is the kernel's status code for it."""

    def __init__(self, status: int):
        super().__init__(f"reference decoder status {status}")
        self.status = status


# ==================================================================================================
# Range coder
# ==================================================================================================


class RangeEncoder:
    """32-bit range coder, LZMA-style carry handling through one cached byte plus a count of
    pending 0xFF bytes."""

    def __init__(self) -> None:
        self.low = 0  # may temporarily reach 2**32 and above: that is the carry
        self.range = RANGE_INIT
        self.cache = 0
        self.pending = 1  # the cached byte plus the 0xFF bytes waiting behind it
        self.out = bytearray()

    def _shift_low(self) -> None:
        """Move the top byte of the 32-bit window out, once no carry can change it any more."""
        if self.low < 0xFF000000 or self.low >= 1 << 32:
            carry = self.low >> 32
            byte = self.cache
            for _ in range(self.pending):
                self.out.append((byte + carry) & 0xFF)
                byte = 0xFF
            self.pending = 0
            self.cache = (self.low >> 24) & 0xFF
        self.pending += 1
        self.low = (self.low & 0x00FFFFFF) << 8

    def _renormalize(self) -> None:
        while self.range < TOP:
            self.range <<= 8
            self._shift_low()

    def encode_bit(self, bit: int, p_one: int) -> None:
        """One bin; ``p_one / PROB_ONE`` is the probability of a 1 (which takes the low part)."""
        bound = (self.range >> PROB_BITS) * p_one
        if bit:
            self.range = bound
        else:
            self.low += bound
            self.range -= bound
        self._renormalize()

    def encode_bypass(self, value: int, nbits: int) -> None:
        """The low ``nbits`` bits of ``value``, most significant first, at probability 1/2 each.

        They are sent in groups of at most MAX_BYPASS_GROUP bits; inside a group every bit halves
        the range (a 1 takes the upper half), and the coder renormalizes only after the group. The
        grouping is part of the bitstream.
        """
        remaining = nbits
        while remaining > 0:
            g = min(remaining, MAX_BYPASS_GROUP)
            remaining -= g
            for j in range(remaining + g - 1, remaining - 1, -1):
                self.range >>= 1
                if (value >> j) & 1:
                    self.low += self.range
            self._renormalize()

    def encode_terminate(self) -> None:
        """The final bin, always 1, with probability TERMINATE_P / PROB_ONE."""
        self.encode_bit(1, TERMINATE_P)

    def finish(self) -> bytes:
        """Flush; returns every byte the coder produced (the first one is always 0)."""
        # The value in [low, low + range) with the most trailing zero bits: the zero bytes it ends
        # with can be dropped, the decoder reads zeros past the end.
        for z in range(32, -1, -1):
            mask = (1 << z) - 1
            value = (self.low + mask) & ~mask
            if value < self.low + self.range:
                self.low = value
                break
        for _ in range(5):
            self._shift_low()
        return bytes(self.out)


class RangeDecoder:
    """Mirror of :class:`RangeEncoder`. ``data`` starts at the encoder's *second* byte; reads past
    the end see zero bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.range = RANGE_INIT
        self.code = 0
        for _ in range(4):
            self.code = (self.code << 8) | self._next_byte()
        if self.code >= self.range:
            raise ReferenceDecodeError(ERR_BAD_START)

    def _next_byte(self) -> int:
        byte = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return byte

    def _renormalize(self) -> None:
        while self.range < TOP:
            self.range <<= 8
            self.code = (self.code << 8) | self._next_byte()

    def decode_bit(self, p_one: int) -> int:
        bound = (self.range >> PROB_BITS) * p_one
        if self.code < bound:
            bit = 1
            self.range = bound
        else:
            bit = 0
            self.code -= bound
            self.range -= bound
        self._renormalize()
        return bit

    def decode_bypass(self, nbits: int) -> int:
        """``nbits`` bits in groups, as :meth:`RangeEncoder.encode_bypass` wrote them; after each
        group the code value must lie inside the range again."""
        value = 0
        remaining = nbits
        while remaining > 0:
            g = min(remaining, MAX_BYPASS_GROUP)
            remaining -= g
            for _ in range(g):
                self.range >>= 1
                bit = 1 if self.code >= self.range else 0
                if bit:
                    self.code -= self.range
                value = (value << 1) | bit
            if self.code >= self.range:
                raise ReferenceDecodeError(ERR_BAD_BYPASS)
            self._renormalize()
        return value

    def decode_terminate(self) -> None:
        """Check the final 1-bin and that the decoder did not read too far past the end."""
        bound = (self.range >> PROB_BITS) * TERMINATE_P
        if self.code >= bound:
            raise ReferenceDecodeError(ERR_BAD_TERMINATE)
        self.range = bound
        while self.range < TOP:  # count the bytes the renormalization would read
            self.range <<= 8
            self.pos += 1
        if self.pos > len(self.data) + OVERRUN_SLACK:
            raise ReferenceDecodeError(ERR_OVERRUN)


# ==================================================================================================
# Probability estimation
# ==================================================================================================


def adaptation_shift(count: int) -> int:
    """Adaptation shift of a context that has seen ``count`` bins: floor(log2(count + 2)), at
    most RATE."""
    return min(RATE, (count + 2).bit_length() - 1)


class Context:
    """One estimator of P(bin = 1) in units of 2**-16, starting at 1/2; the first bins adapt at
    rate ~1/(count + 2), later ones at 2**-RATE."""

    __slots__ = ("p16", "count")

    def __init__(self) -> None:
        self.p16 = 1 << 15
        self.count = 0

    def p_one(self) -> int:
        """The coder's PROB_BITS probability: the top bits, with the P_MIN bit forced on (not a
        clamp: it also raises probabilities above P_MIN whose P_MIN bit is clear)."""
        return (self.p16 >> (16 - PROB_BITS)) | P_MIN

    def update(self, bit: int) -> None:
        self.p16 += ((bit << 16) - self.p16) >> adaptation_shift(self.count)
        if self.count < WARMUP_MAX:
            self.count += 1


class ContextSet:
    """All contexts: N_BUCKETS buckets of N_UNARY_CTX unary contexts then N_SUFFIX_CTX suffix ones."""

    def __init__(self) -> None:
        self.contexts = [Context() for _ in range(N_BUCKETS * CTX_PER_BUCKET)]

    def unary(self, bucket: int, j: int) -> Context:
        return self.contexts[bucket * CTX_PER_BUCKET + min(j, N_UNARY_CTX - 1)]

    def suffix(self, bucket: int, q: int) -> Context:
        return self.contexts[bucket * CTX_PER_BUCKET + N_UNARY_CTX + (1 if q > 0 else 0)]


# ==================================================================================================
# Local scale and binarization
# ==================================================================================================


def zigzag(v: int) -> int:
    """Signed level -> u: 0, +1, -1, +2, -2, ... -> 0, 1, 2, 3, 4, ..."""
    return 2 * v - 1 if v > 0 else -2 * v


def unzigzag(u: int) -> int:
    return (u + 1) >> 1 if u & 1 else -(u >> 1)


def bucket_and_rice(scale: int, k_offset: int) -> tuple[int, int]:
    """Half-octave bucket of ``scale`` (units of u / 2**SCALE_FRAC) and the Rice parameter k, which
    is the bucket in octaves of u, lowered by ``k_offset`` half octaves."""
    length = scale.bit_length()
    if length >= 2:
        bucket = 2 * length + ((scale >> (length - 2)) & 1)
    else:
        bucket = 2 * length
    return bucket, max(0, (bucket - 2 * SCALE_FRAC - k_offset) >> 1)


class ScaleTracker:
    """Exponential moving averages of u: along the scan (row) and per column of the 2-D view.

    The column average is used from the second row of the chunk on (chunk-local element index
    >= ncols); the first element of the chunk sits in column ``col0``.
    """

    def __init__(self, ncols: int, col0: int) -> None:
        self.ncols = ncols
        self.row = 0
        self.cols = [0] * ncols
        self.col = col0 if ncols > 0 else 0
        self.index = 0

    def current(self) -> int:
        if self.ncols > 0 and self.index >= self.ncols:
            return (self.row + self.cols[self.col]) >> 1
        return self.row

    def update(self, u: int) -> None:
        x = u << SCALE_FRAC
        self.row += (x - self.row) >> ROW_SHIFT
        if self.ncols > 0:
            self.cols[self.col] += (x - self.cols[self.col]) >> COL_SHIFT
            self.col = (self.col + 1) % self.ncols
        self.index += 1


class ColumnPredictor:
    """Per-column moving average of the levels. A whole row is coded as v - round(average) instead
    of v when the running cost of doing so (a moving average of the zigzag magnitude, both kept for
    every element) is below SEL_NUM/16 of coding v plainly; the choice is made at each row end from
    values the decoder has too, so no side information is sent. Off without the column model."""

    def __init__(self, ncols: int, col0: int, enabled: bool) -> None:
        self.on = enabled and ncols > 0
        self.ncols = ncols
        self.col = col0 if ncols > 0 else 0
        self.average = [0] * ncols if self.on else []
        self.cost_plain = 0
        self.cost_predicted = 0
        self.active = False

    def prediction(self) -> int:
        return (self.average[self.col] + 128) >> 8 if self.on else 0

    def update(self, v: int, pred: int) -> None:
        if not self.on:
            return
        self.cost_plain += ((zigzag(v) << SCALE_FRAC) - self.cost_plain) >> _K.SEL_SHIFT
        self.cost_predicted += ((zigzag(v - pred) << SCALE_FRAC) - self.cost_predicted) >> _K.SEL_SHIFT
        self.average[self.col] += ((v << 8) - self.average[self.col]) >> _K.PRED_SHIFT
        self.col += 1
        if self.col == self.ncols:
            self.active = self.cost_predicted * 16 < self.cost_plain * _K.SEL_NUM
            self.col = 0


def split_coder_param(coder_param: int) -> tuple[int, bool]:
    """(k_offset, column prediction) from the tensor table's coder_param byte."""
    return coder_param & ~PREDICT_BIT, bool(coder_param & PREDICT_BIT)


class LevelBinarizer:
    """Codes one u with Rice parameter k: q = u >> k in unary (context bins, escape to Exp-Golomb
    order 0 in bypass bits after Q_MAX ones), then the k low bits of u: the top one context-coded
    when k >= 2, the rest bypass."""

    def __init__(self) -> None:
        self.contexts = ContextSet()

    def _bin(self, coder: RangeEncoder, ctx: Context, bit: int) -> None:
        coder.encode_bit(bit, ctx.p_one())
        ctx.update(bit)

    def _read_bin(self, coder: RangeDecoder, ctx: Context) -> int:
        bit = coder.decode_bit(ctx.p_one())
        ctx.update(bit)
        return bit

    def encode(self, coder: RangeEncoder, u: int, bucket: int, k: int) -> None:
        q = u >> k
        for j in range(min(q, Q_MAX)):
            self._bin(coder, self.contexts.unary(bucket, j), 1)
        if q < Q_MAX:
            self._bin(coder, self.contexts.unary(bucket, q), 0)
        else:
            x = q - Q_MAX + 1
            length = x.bit_length()
            for _ in range(length - 1):
                coder.encode_bypass(1, 1)
            coder.encode_bypass(0, 1)
            coder.encode_bypass(x, length - 1)
        if k >= 2:
            self._bin(coder, self.contexts.suffix(bucket, q), (u >> (k - 1)) & 1)
            coder.encode_bypass(u, k - 1)
        else:
            coder.encode_bypass(u, k)

    def decode(self, coder: RangeDecoder, bucket: int, k: int) -> int:
        q = 0
        while q < Q_MAX and self._read_bin(coder, self.contexts.unary(bucket, q)):
            q += 1
        if q == Q_MAX:
            length = 1
            while coder.decode_bypass(1):
                length += 1
                if length > MAX_ESCAPE_LENGTH:
                    raise ReferenceDecodeError(ERR_BAD_ESCAPE)
            x = (1 << (length - 1)) | coder.decode_bypass(length - 1)
            q = Q_MAX + x - 1
        if q > (U_MAX >> k):
            raise ReferenceDecodeError(ERR_BAD_VALUE)
        if k >= 2:
            top = self._read_bin(coder, self.contexts.suffix(bucket, q))
            u = (((q << 1) | top) << (k - 1)) | coder.decode_bypass(k - 1)
        else:
            u = (q << k) | coder.decode_bypass(k)
        if u > U_MAX:
            raise ReferenceDecodeError(ERR_BAD_VALUE)
        return u


# ==================================================================================================
# Entry points
# ==================================================================================================


def encode_levels(levels, ncols: int, col0: int, coder_param: int) -> bytes:
    """The substream of ``levels`` (ints with |v| <= 2**31 - 1), as ``levelcoder.encode_chunk``
    returns it; ``coder_param`` is k_offset, plus PREDICT_BIT for column prediction."""
    k_offset, predict = split_coder_param(coder_param)
    coder = RangeEncoder()
    scale = ScaleTracker(ncols, col0)
    predictor = ColumnPredictor(ncols, col0, predict)
    binarizer = LevelBinarizer()
    for v in levels:
        v = int(v)
        if not -(2**31 - 1) <= v <= 2**31 - 1:
            raise ValueError(f"level {v} out of range")
        pred = predictor.prediction()
        u = zigzag(v - pred if predictor.active else v)
        bucket, k = bucket_and_rice(scale.current(), k_offset)
        binarizer.encode(coder, u, bucket, k)
        scale.update(u)
        predictor.update(v, pred)
    coder.encode_terminate()
    data = coder.finish()
    assert data[0] == 0, "the range coder's first byte must be zero"
    # Drop the always-zero first byte and at most MAX_STRIPPED trailing zero bytes.
    body = data[1:]
    keep = len(body)
    while keep > 0 and body[keep - 1] == 0 and len(body) - keep < _K.MAX_STRIPPED:
        keep -= 1
    return body[:keep]


def decode_levels(data: bytes, n: int, ncols: int, col0: int, coder_param: int) -> list[int]:
    """Decode ``n`` levels; raises :class:`ReferenceDecodeError` on an inconsistent substream."""
    k_offset, predict = split_coder_param(coder_param)
    coder = RangeDecoder(bytes(data))
    scale = ScaleTracker(ncols, col0)
    predictor = ColumnPredictor(ncols, col0, predict)
    binarizer = LevelBinarizer()
    out = []
    for _ in range(n):
        bucket, k = bucket_and_rice(scale.current(), k_offset)
        u = binarizer.decode(coder, bucket, k)
        pred = predictor.prediction()
        v = unzigzag(u)
        if predictor.active:
            v += pred
            if not -(2**31 - 1) <= v <= 2**31 - 1:
                raise ReferenceDecodeError(ERR_BAD_VALUE)
        out.append(v)
        scale.update(u)
        predictor.update(v, pred)
    coder.decode_terminate()
    return out


def decode_status(data: bytes, n: int, ncols: int, col0: int, coder_param: int) -> tuple[int, list[int]]:
    """``(status, levels)`` instead of raising, to compare with the kernel's status code; the
    levels are empty unless the status is OK."""
    try:
        return OK, decode_levels(data, n, ncols, col0, coder_param)
    except ReferenceDecodeError as exc:
        return exc.status, []
