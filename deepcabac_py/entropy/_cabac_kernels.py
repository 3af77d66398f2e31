"""Numba kernels of the level coder: a binary arithmetic coder with adaptive contexts.

Private: call them through :mod:`deepcabac_py.entropy.levelcoder`, which validates every argument. The
bitstream they produce is specified in ``docs/format.md`` ("Level substreams"); the plain-Python
reference in ``tests/reference_coder.py`` must produce the same bytes.

Design, in short (the reasons are measured in ``benchmarks/bench_contexts.py``):

* Range coder with a 32-bit range and carry propagation through a cached byte (LZMA style). A bin
  costs one multiplication; probabilities have 15 bits, so the coding loss against the estimator is
  far below the 9-bit-range M-coder of NNC.
* Each context holds one probability estimator whose adaptation rate starts at 1/2 and slows as
  1/(n+2) with the bins seen, down to 2**-RATE: a context used a few times is not stuck near its
  initial 1/2 (this replaces NNC's per-tensor search over preset initial states), a mature one is
  nearly static, which suits the stationary statistics of a weight tensor.
* A signed level v is mapped to u = 2|v| - (v > 0) (0, +1, -1, +2, -2, ...). The coder keeps a local
  scale: an exponential moving average of u along the scan, and one per column of the 2-D view
  (dim0 x rest) across rows. The scale selects a context set ("bucket", half-octave steps) and a Rice
  parameter k. u >> k is sent in unary with context-coded bins, the top bit below it context-coded
  too, the remaining k - 1 bits (the last one carries the sign) as bypass bins. Large tensors spend
  about three context-coded bins per weight instead of NNC's eleven greater-than flags.
* Every loop is bounded, reads past the end of the buffer see zero bytes, and a decoding status
  reports corrupt input instead of trusting it.
"""

import numpy as np

from .._jit import helper, inline, kernel

# --- arithmetic coder ---------------------------------------------------------------------------
PROB_BITS = 15
PROB_ONE = 1 << PROB_BITS
P_MIN = 32  # the probability of a 1 is at least P_MIN / PROB_ONE (forced by OR-ing P_MIN in)
TOP = 1 << 24
RANGE_INIT = 0xFFFFFFFF
TERMINATE_P = 256  # probability of the terminate bin being 1: 1/128

# --- probability estimation ---------------------------------------------------------------------
# One estimator per context: a 16-bit probability of a 1, moved by (target - p) >> shift. A counter
# makes the shift grow as floor(log2(n + 2)) until RATE, so a young context learns at rate ~1/(n+2)
# (close to counting) and a mature one forgets with a window of ~2**RATE bins. Measured on
# all-MiniLM-L6-v2 (benchmarks/bench_contexts.py): as small as a two-rate mix of windows 2**6 and
# 2**9, and 10% faster.
# A context is one int64 word, probability << COUNT_BITS | bins seen: one load and one store per bin
# (a row of two columns cost a multiplication by the row stride on every access).
RATE = 8
WARMUP_MAX = (1 << RATE) - 1
COUNT_BITS = RATE  # the count stops at WARMUP_MAX
COUNT_MASK = (1 << COUNT_BITS) - 1
CONTEXT_INIT = (1 << 15) << COUNT_BITS
SHIFT_FOR_COUNT = np.array([min(RATE, int(np.log2(n + 2))) for n in range(WARMUP_MAX + 1)], dtype=np.uint8)

# --- binarization and context layout ------------------------------------------------------------
SCALE_FRAC = 4  # scales are kept in units of u / 16
ROW_SHIFT = 5  # row EMA rate 1/32
COL_SHIFT = 4  # column EMA rate 1/16
N_BUCKETS = 76  # half-octave buckets of the scale; enough for |u| < 2**33
N_UNARY_CTX = 8  # unary bins j >= 7 share the last context of their bucket
N_SUFFIX_CTX = 2
CTX_PER_BUCKET = N_UNARY_CTX + N_SUFFIX_CTX
N_CTX = N_BUCKETS * CTX_PER_BUCKET
# Column prediction (a per-tensor switch): the coder keeps a column EMA of the levels and, for a
# whole row, codes v - round(EMA) instead of v when running costs known to both sides say it is
# cheaper. It pays where rows share a mean (the unused-token rows of a word embedding, neighbouring
# position embeddings): -0.5% on all-MiniLM-L6-v2 for about 1.5 ns per weight.
PRED_SHIFT = 3  # rate of the column EMA of levels (units 1/256)
SEL_SHIFT = 7  # rate of the running costs of plain / predicted coding
SEL_NUM = 14  # a row is predicted when cost_pred * 16 < cost_plain * SEL_NUM
PREDICT_MAX_LEVEL = (1 << 30) - 1  # with prediction on, |level| <= this, so |v - pred| < 2**31 - 1
Q_MAX = 24  # unary length after which an Exp-Golomb escape in bypass bins follows
LEVEL_MAX = (1 << 31) - 1  # |level| <= LEVEL_MAX; int32's minimum has no zigzag code
U_MAX = 2 * LEVEL_MAX  # largest u
# Exp-Golomb prefixes (of escapes here, of large update levels in the update coder) are at most this
# long: every value they code is below 2**32.
MAX_EG_LENGTH = 32
MAX_BYPASS_GROUP = 16
DEFAULT_K_OFFSET = 0

# --- decoding status codes ----------------------------------------------------------------------
OK = 0
ERR_BAD_START = 1
ERR_BAD_ESCAPE = 2
ERR_BAD_VALUE = 3
ERR_BAD_TERMINATE = 4
ERR_OVERRUN = 5
ERR_BAD_BYPASS = 6
OVERRUN_SLACK = 8  # bytes a valid decoder may read past the end (lookahead of the final flush)
MAX_STRIPPED = 4  # trailing zero bytes the encoder may drop (the decoder reads zeros there)

# Lower bound on the cost of one coded element, for bounding allocations by the payload size: every
# element ends with a context-coded 0 bin (or an escape whose prefix holds a bypass bin). The
# probability of a 1 is at least P_MIN / PROB_ONE, so a 0 bin keeps at most 1 - P_MIN / PROB_ONE of
# the range, plus P_MIN / TOP for the truncation of (range >> PROB_BITS).
MIN_BITS_PER_ELEMENT = -np.log2(1.0 - P_MIN / PROB_ONE + P_MIN / TOP)


@helper
def _bitlen(x):
    # A plain loop: the lengths it measures (escapes, large scales) are rare, and the unrolled
    # binary search, inlined wherever a rate or a bucket is computed, made the trellis compile
    # seconds longer for no measurable speed.
    n = 0
    while x > 0:
        x >>= 1
        n += 1
    return n


def _bucket_of(s):
    length = int(s).bit_length()
    bucket = 2 * length + ((s >> (length - 2)) & 1) if length >= 2 else 2 * length
    return bucket, length


# Buckets and bit lengths of small scales, packed as bucket << 8 | length: the common case costs a
# table look-up instead of a bit-length computation.
SMALL_SCALES = 1 << 12
BUCKET_LUT = np.array([(b << 8) | n for b, n in map(_bucket_of, range(SMALL_SCALES))], dtype=np.int64)

# The bucket and Rice parameter of every small scale, one row per k_offset (the offsets a stream can
# declare), packed as bucket << 8 | k: the coders' and the trellis's per-weight look-up.
K_OFFSETS = 8
BUCKET_AND_K_LUT = np.array([[(b << 8) | max(0, (b - 2 * SCALE_FRAC - k) >> 1) for b in (BUCKET_LUT >> 8).tolist()]
                             for k in range(K_OFFSETS)], dtype=np.int64)


@helper
def _bucket_and_k(s, k_offset):
    if s < SMALL_SCALES:
        packed = BUCKET_LUT[s]
        bucket = packed >> 8
        length = packed & 0xFF
    else:
        length = _bitlen(s)
        bucket = 2 * length + ((s >> (length - 2)) & 1)
    # k_offset counts half octaves: k = floor((log2 of the scale in u units) - k_offset / 2), about.
    k = (bucket - 2 * SCALE_FRAC - k_offset) >> 1
    if k < 0:
        k = 0
    return bucket, k


@inline
def _scale_lut(k_offset):
    """(row, bound) for :func:`_bucket_and_k_lut`: scales below ``bound`` take row ``row`` of the
    table; a k_offset outside it takes the computed path (bound 0)."""
    if 0 <= k_offset < K_OFFSETS:
        return k_offset, SMALL_SCALES
    return 0, 0


@inline
def _bucket_and_k_lut(s, k_offset, row, bound):
    """:func:`_bucket_and_k` by one table look-up for the common small scales."""
    if s < bound:
        packed = BUCKET_AND_K_LUT[np.uint64(row), np.uint64(s)]
        return packed >> 8, packed & 0xFF
    return _bucket_and_k(s, k_offset)


@inline
def _prob(context):
    # OR instead of a clamp: cheaper, and it keeps p in [P_MIN, PROB_ONE - 1].
    return (context >> (COUNT_BITS + 1)) | P_MIN


@inline
def _adapt(context, bit):
    p = context >> COUNT_BITS
    count = context & COUNT_MASK
    p += ((bit << 16) - p) >> SHIFT_FOR_COUNT[count]
    return (p << COUNT_BITS) | (count + np.int64(count < WARMUP_MAX))


@inline
def _encode_bin(low, rng, p, bit):
    """One context-coded bin of probability ``p`` (of a 1): the new low and range, by arithmetic
    (a branch on the bin's value would be mispredicted about as often as not)."""
    bound = (rng >> PROB_BITS) * p
    one = -bit  # all ones for a 1
    return low + (bound & ~one), (bound & one) | ((rng - bound) & ~one)


@inline
def _encode_bypass(low, rng, bits, g):
    # Bit by bit, halving the range: no division is needed to decode (see _decode_bypass).
    for j in range(g - 1, -1, -1):
        rng >>= 1
        low += rng * ((bits >> j) & 1)
    return low, rng


@inline
def _decode_bypass(code, rng, g):
    """``g`` bypass bins (the inverse of :func:`_encode_bypass`), two at a time: with r1 = rng >> 1
    and r2 = rng >> 2 a pair of bins is the number of the thresholds r2 <= r1 <= r1 + r2 that
    ``code`` reaches, three independent comparisons. Bin by bin, the compiler unrolled the loop and
    turned its selects into branches, mispredicted about every other bin (all-MiniLM-L6-v2 at qp
    -32, whose Rice parameters run higher than a bf16 LLM's: 34 -> 22.5 ns per weight to decode)."""
    bits = 0
    while g >= 2:
        r1 = rng >> 1
        r2 = rng >> 2
        pair = np.int64(code >= r2) + np.int64(code >= r1) + np.int64(code >= r1 + r2)
        code -= (r1 & -(pair >> 1)) + (r2 & -(pair & 1))
        rng = r2
        bits = (bits << 2) | pair
        g -= 2
    if g:
        rng >>= 1
        bit = np.int64(code >= rng)
        code -= rng & -bit
        bits = (bits << 1) | bit
    return code, rng, bits


@inline
def _shift_low(low, cache, cache_size, out, pos):
    # Emits the byte above the 24-bit window once it can no longer change by a carry. Inlined: as a
    # called kernel, the array argument was reference-counted on every output byte (measured on
    # all-MiniLM-L6-v2: 1.5 ns per weight, 6% of the encoder's time).
    if low < 0xFF000000 or low >= (1 << 32):
        carry = low >> 32
        byte = cache
        while cache_size > 0:
            if pos < out.shape[0]:
                out[pos] = (byte + carry) & 0xFF
            pos += 1
            byte = 0xFF
            cache_size -= 1
        cache = (low >> 24) & 0xFF
    cache_size += 1
    low = (low & 0x00FFFFFF) << 8
    return low, cache, cache_size, pos


@kernel
def _flush_substream(low, rng, cache, cache_size, out, pos):
    """Flush and trailing-zero stripping. Returns the byte count, or -1 if ``out`` was too small."""
    # Pick the value in [low, low + rng) with the most trailing zero bits, so that the trailing zero
    # bytes can be dropped (the decoder reads zeros past the end).
    for z in range(32, -1, -1):
        m = (1 << z) - 1
        val = (low + m) & ~m
        if val < low + rng:
            low = val
            break
    for _ in range(5):
        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
    if pos > out.shape[0]:
        return -1
    # At most MAX_STRIPPED zero bytes go, so a decoder never needs to read more than
    # OVERRUN_SLACK bytes past the end of a valid substream.
    stripped = 0
    while pos > 1 and out[pos - 1] == 0 and stripped < MAX_STRIPPED:
        pos -= 1
        stripped += 1
    return pos


@kernel
def _finish_substream(low, rng, cache, cache_size, out, pos):
    """Terminate bin, then :func:`_flush_substream`: the end of every level substream and of
    format-1 update payloads. Returns the byte count, or -1 if ``out`` was too small."""
    # Terminate bin (1): lets the decoder check that it ends where the encoder ended.
    bound = (rng >> PROB_BITS) * TERMINATE_P
    rng = bound
    while rng < TOP:
        rng <<= 8
        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
    return _flush_substream(low, rng, cache, cache_size, out, pos)


# The encoder's scalar state between spans (see _encode_span): range coder, row scale, the
# prediction switch and its running costs, the current column.
ENC_LOW, ENC_RNG, ENC_CACHE, ENC_CACHE_SIZE, ENC_POS, ENC_ROW, ENC_COST_PLAIN, ENC_COST_PRED, ENC_USE_PRED, \
    ENC_COL = range(10)
ENC_FIELDS = 10


@kernel
def _fresh_contexts():
    state = np.empty(N_CTX, dtype=np.int64)
    for c in range(N_CTX):
        state[c] = CONTEXT_INIT
    return state


@kernel
def _encoder_start(ncols, col0, predict):
    """A fresh encoder for a chunk: contexts, column scales, column predictions, scalar state."""
    es = np.zeros(ENC_FIELDS, dtype=np.int64)
    es[ENC_RNG] = RANGE_INIT
    es[ENC_CACHE_SIZE] = 1
    es[ENC_COL] = col0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    col_pred = np.zeros(max(ncols, 1) if ncols > 0 and predict else 1, dtype=np.int64)
    return _fresh_contexts(), col_scale, col_pred, es


@kernel
def _encode_span(levels, start, stop, ncols, k_offset, predict, state, col_scale, col_pred, es, out):
    """Encode ``levels[start:stop]`` of a chunk, continuing from the encoder state (``state``,
    ``col_scale``, ``col_pred``, ``es``) and leaving it there. Spans let the trellis commit each
    block of levels straight into the stream, with the coder's modelling kept in one place.

    As in the decoder, the bucket and Rice parameter come from the look-up table, indices are
    unsigned, and a bin's value moves the range by arithmetic instead of a branch (the unary bins
    follow one another unpredictably): 0.83x the time of the plain version."""
    use_cols = ncols > 0
    pred_on = use_cols and predict
    low = es[ENC_LOW]
    rng = es[ENC_RNG]
    cache = es[ENC_CACHE]
    cache_size = es[ENC_CACHE_SIZE]
    pos = es[ENC_POS]
    row_scale = es[ENC_ROW]
    cost_plain = es[ENC_COST_PLAIN]
    cost_pred = es[ENC_COST_PRED]
    use_pred = es[ENC_USE_PRED] != 0
    col = es[ENC_COL]
    lut_row, lut_bound = _scale_lut(k_offset)

    for i in range(start, stop):
        v = np.int64(levels[i])
        x = v
        pred = 0
        if pred_on:
            pred = (col_pred[np.uint64(col)] + 128) >> 8
            if use_pred:
                x = v - pred
        u = 2 * x - 1 if x > 0 else -2 * x
        if use_cols and i >= ncols:
            s = (row_scale + col_scale[np.uint64(col)]) >> 1
        else:
            s = row_scale
        bucket, k = _bucket_and_k_lut(s, k_offset, lut_row, lut_bound)
        base = bucket * CTX_PER_BUCKET
        q = u >> k

        # Unary part of q: context-coded bins, escape to Exp-Golomb after Q_MAX ones.
        steps = q if q < Q_MAX else Q_MAX
        for j in range(steps + 1):
            if j == Q_MAX:
                break
            bit = np.int64(j < q)
            c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
            context = state[np.uint64(c)]
            low, rng = _encode_bin(low, rng, _prob(context), bit)
            state[np.uint64(c)] = _adapt(context, bit)
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
        if q >= Q_MAX:
            # Exp-Golomb order 0 of x = q - Q_MAX + 1: (len-1) ones, a zero, then len-1 bits.
            e = q - Q_MAX + 1
            length = _bitlen(e)
            for j in range(length):
                low, rng = _encode_bypass(low, rng, 1 if j < length - 1 else 0, 1)
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
            remaining = length - 1
            while remaining > 0:
                g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                remaining -= g
                low, rng = _encode_bypass(low, rng, (e >> remaining) & ((1 << g) - 1), g)
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)

        # Suffix: the top bit context-coded (the shape inside a Rice bin), the rest bypass.
        remaining = k
        if k >= 2:
            bit = (u >> (k - 1)) & 1
            c = base + N_UNARY_CTX + np.int64(q > 0)
            context = state[np.uint64(c)]
            low, rng = _encode_bin(low, rng, _prob(context), bit)
            state[np.uint64(c)] = _adapt(context, bit)
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
            remaining = k - 1
        while remaining > 0:
            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
            remaining -= g
            low, rng = _encode_bypass(low, rng, (u >> remaining) & ((1 << g) - 1), g)
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)

        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT
        if use_cols:
            col_scale[np.uint64(col)] += ((u << SCALE_FRAC) - col_scale[np.uint64(col)]) >> COL_SHIFT
            if pred_on:
                r = v - pred
                up = 2 * r - 1 if r > 0 else -2 * r
                uv = 2 * v - 1 if v > 0 else -2 * v
                cost_plain += ((uv << SCALE_FRAC) - cost_plain) >> SEL_SHIFT
                cost_pred += ((up << SCALE_FRAC) - cost_pred) >> SEL_SHIFT
                col_pred[np.uint64(col)] += ((v << 8) - col_pred[np.uint64(col)]) >> PRED_SHIFT
            col += 1
            if col == ncols and pred_on:
                use_pred = cost_pred * 16 < cost_plain * SEL_NUM
            if col == ncols:
                col = 0

    es[ENC_LOW] = low
    es[ENC_RNG] = rng
    es[ENC_CACHE] = cache
    es[ENC_CACHE_SIZE] = cache_size
    es[ENC_POS] = pos
    es[ENC_ROW] = row_scale
    es[ENC_COST_PLAIN] = cost_plain
    es[ENC_COST_PRED] = cost_pred
    es[ENC_USE_PRED] = use_pred
    es[ENC_COL] = col


@kernel
def _encoder_finish(es, out):
    """Terminate and flush the substream of an encoder state; the byte count, or -1."""
    return _finish_substream(es[ENC_LOW], es[ENC_RNG], es[ENC_CACHE], es[ENC_CACHE_SIZE], out, es[ENC_POS])


@kernel
def encode_levels_kernel(levels, ncols, col0, k_offset, predict, out):
    """Encode int32 ``levels`` into ``out``; returns the byte count, or -1 if ``out`` is too small.

    ``ncols`` > 0 enables the per-column scale over a row-major 2-D view with ``ncols`` columns,
    the first element sitting in column ``col0``.
    """
    state, col_scale, col_pred, es = _encoder_start(ncols, col0, predict)
    # (start as an int64, not the literal 0: one compiled _encode_span serves this kernel and the trellis)
    _encode_span(levels, np.int64(0), levels.shape[0], ncols, k_offset, predict, state, col_scale, col_pred, es, out)
    return _encoder_finish(es, out)


@inline
def _refill(code, rng, buf, pos, last):
    """Renormalisation after a bin or a bypass group, which leave the range at 2**8 or more: one or
    two bytes shifted in. ``buf`` is zero from ``last`` on and readable at ``last + 1``: past the
    end of the substream the decoder reads zeros, as the encoder's flush assumes."""
    j = np.uint64(min(pos, last))
    two = (np.int64(buf[j]) << 8) | np.int64(buf[j + np.uint64(1)])
    if rng < (1 << 16):
        return (code << 16) | two, rng << 16, pos + 2
    return (code << 8) | (two >> 8), rng << 8, pos + 1


@kernel
def decode_levels_kernel(payload, ncols, col0, k_offset, predict, out):
    """Decode ``out.shape[0]`` levels from ``payload`` (whose first byte is the stream's second: the
    encoder's first byte is always 0 and is not stored). Returns a status code (``OK`` = 0).

    The decoder follows the encoder's modelling exactly; for speed (it is the decode path's
    bottleneck) contexts are one word each, the scale's bucket and Rice parameter come from one table
    look-up, indices are unsigned (no negative-index wrap-around), and bytes are read two at a time
    from a zero-padded copy, with one bound per renormalisation instead of one per byte.
    """
    n = out.shape[0]
    size = payload.shape[0]
    buf = np.zeros(size + 2, dtype=np.uint8)
    buf[:size] = payload
    state = _fresh_contexts()
    use_cols = ncols > 0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    col = col0
    pred_on = use_cols and predict
    col_pred = np.zeros(max(ncols, 1) if pred_on else 1, dtype=np.int64)
    cost_plain = 0
    cost_pred = 0
    use_pred = False
    lut_row, lut_bound = _scale_lut(k_offset)

    rng = RANGE_INIT
    code = 0
    for j in range(4):
        code = (code << 8) | np.int64(buf[min(j, size)])
    pos = 4
    if code >= rng:
        return ERR_BAD_START
    row_scale = 0

    for i in range(n):
        if use_cols and i >= ncols:
            s = (row_scale + col_scale[np.uint64(col)]) >> 1
        else:
            s = row_scale
        bucket, k = _bucket_and_k_lut(s, k_offset, lut_row, lut_bound)
        base = bucket * CTX_PER_BUCKET

        q = 0
        c = base
        while True:
            context = state[np.uint64(c)]
            bound = (rng >> PROB_BITS) * _prob(context)
            if code < bound:
                bit = 1
                rng = bound
            else:
                bit = 0
                code -= bound
                rng -= bound
            state[np.uint64(c)] = _adapt(context, bit)
            if rng < TOP:
                code, rng, pos = _refill(code, rng, buf, pos, size)
            if bit == 0:
                break
            q += 1
            if q == Q_MAX:
                break
            if q < N_UNARY_CTX:
                c += 1
        if q == Q_MAX:
            length = 1
            while True:
                code, rng, bit = _decode_bypass(code, rng, 1)
                if code >= rng:
                    return ERR_BAD_BYPASS
                if rng < TOP:
                    code, rng, pos = _refill(code, rng, buf, pos, size)
                if bit == 0:
                    break
                length += 1
                if length > MAX_EG_LENGTH:
                    return ERR_BAD_ESCAPE
            x = 1
            remaining = length - 1
            while remaining > 0:
                g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                remaining -= g
                code, rng, bits = _decode_bypass(code, rng, g)
                if code >= rng:
                    return ERR_BAD_BYPASS
                x = (x << g) | bits
                if rng < TOP:
                    code, rng, pos = _refill(code, rng, buf, pos, size)
            q = Q_MAX + x - 1
        if q > (U_MAX >> k):
            return ERR_BAD_VALUE

        u = q
        remaining = k
        if k >= 2:
            c = base + N_UNARY_CTX + np.int64(q > 0)
            context = state[np.uint64(c)]
            bound = (rng >> PROB_BITS) * _prob(context)
            bit = np.int64(code < bound)
            keep = -bit  # all ones for a 1: the suffix bin is not worth a mispredicted branch
            rng = (bound & keep) | ((rng - bound) & ~keep)
            code -= bound & ~keep
            state[np.uint64(c)] = _adapt(context, bit)
            if rng < TOP:
                code, rng, pos = _refill(code, rng, buf, pos, size)
            u = (u << 1) | bit
            remaining = k - 1
        while remaining > 0:
            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
            remaining -= g
            code, rng, bits = _decode_bypass(code, rng, g)
            u = (u << g) | bits
            if code >= rng:
                return ERR_BAD_BYPASS
            if rng < TOP:
                code, rng, pos = _refill(code, rng, buf, pos, size)
        if u > U_MAX:
            return ERR_BAD_VALUE
        half = (u + 1) >> 1
        negative = (u & 1) - 1  # all ones for an even u (a level <= 0)
        x = (half ^ negative) - negative
        v = x
        pred = 0
        if pred_on:
            pred = (col_pred[np.uint64(col)] + 128) >> 8
            if use_pred:
                v = x + pred
                if v > 0x7FFFFFFF or v < -0x7FFFFFFF:
                    return ERR_BAD_VALUE
        out[np.uint64(i)] = v

        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT
        if use_cols:
            col_scale[np.uint64(col)] += ((u << SCALE_FRAC) - col_scale[np.uint64(col)]) >> COL_SHIFT
            if pred_on:
                r = v - pred
                up = 2 * r - 1 if r > 0 else -2 * r
                uv = 2 * v - 1 if v > 0 else -2 * v
                cost_plain += ((uv << SCALE_FRAC) - cost_plain) >> SEL_SHIFT
                cost_pred += ((up << SCALE_FRAC) - cost_pred) >> SEL_SHIFT
                col_pred[np.uint64(col)] += ((v << 8) - col_pred[np.uint64(col)]) >> PRED_SHIFT
            col += 1
            if col == ncols and pred_on:
                use_pred = cost_pred * 16 < cost_plain * SEL_NUM
            if col == ncols:
                col = 0

    bound = (rng >> PROB_BITS) * TERMINATE_P
    if code >= bound:
        return ERR_BAD_TERMINATE
    rng = bound
    while rng < TOP:
        rng <<= 8
        pos += 1
    if pos > size + OVERRUN_SLACK:
        return ERR_OVERRUN
    return OK
