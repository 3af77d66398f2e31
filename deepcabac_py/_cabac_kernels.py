"""Numba kernels of the level coder: a binary arithmetic coder with adaptive contexts.

Private: call them through :mod:`deepcabac_py.levelcoder`, which validates every argument. The
bitstream they produce is specified in ``docs/format.md`` ("Level substreams"); the plain-Python
reference in ``tests/reference_coder.py`` must produce the same bytes.

Design, in short (the reasons are measured in ``benchmarks/bench_contexts.py``):

* Range coder with a 32-bit range and carry propagation through a cached byte (LZMA style). A bin
  costs one multiplication; probabilities have 15 bits, so the coding loss against the estimator is
  far below the 9-bit-range M-coder of NNC.
* Each context holds two probability estimators with windows of 2**RATE_FAST and 2**RATE_SLOW bins,
  averaged. A per-context counter makes both adapt at rate 1/(n+2) for the first bins, so a context
  that is used a few times is not stuck near its initial 1/2 (this replaces NNC's per-tensor search
  over preset initial states).
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

from ._jit import kernel, scalar_helper

# --- arithmetic coder ---------------------------------------------------------------------------
PROB_BITS = 15
PROB_ONE = 1 << PROB_BITS
P_MIN = 32  # probabilities are clamped to [P_MIN, PROB_ONE - P_MIN] / PROB_ONE
TOP = 1 << 24
RANGE_INIT = 0xFFFFFFFF
TERMINATE_P = 256  # probability of the terminate bin being 1: 1/128

# --- probability estimation ---------------------------------------------------------------------
RATE_FAST = 6
RATE_SLOW = 9
WARMUP_MAX = (1 << RATE_SLOW) - 1
# Adaptation shift for a context that has seen n bins: floor(log2(n + 2)), i.e. rate ~ 1/(n + 2).
WARMUP_SHIFT = np.array([int(np.log2(n + 2)) for n in range(WARMUP_MAX + 1)], dtype=np.int64)

# --- binarization and context layout ------------------------------------------------------------
SCALE_FRAC = 4  # scales are kept in units of u / 16
ROW_SHIFT = 5  # row EMA rate 1/32
COL_SHIFT = 4  # column EMA rate 1/16
N_BUCKETS = 76  # half-octave buckets of the scale; enough for |u| < 2**33
N_UNARY_CTX = 8  # unary bins j >= 7 share the last context of their bucket
N_SUFFIX_CTX = 2
CTX_PER_BUCKET = N_UNARY_CTX + N_SUFFIX_CTX
N_CTX = N_BUCKETS * CTX_PER_BUCKET
Q_MAX = 24  # unary length after which an Exp-Golomb escape in bypass bins follows
U_MAX = (1 << 32) - 2  # largest u: |v| <= 2**31 - 1
MAX_BYPASS_GROUP = 16
DEFAULT_K_OFFSET = 1

# --- decoding status codes ----------------------------------------------------------------------
OK = 0
ERR_BAD_START = 1
ERR_BAD_ESCAPE = 2
ERR_BAD_VALUE = 3
ERR_BAD_TERMINATE = 4
ERR_OVERRUN = 5
ERR_BAD_BYPASS = 6
OVERRUN_SLACK = 8  # bytes a valid decoder may read past the end (lookahead of the final flush)

# Lower bound on the cost of one coded element, for bounding allocations by the payload size: an
# element costs at least one context-coded bin, whose probability is at most 1 - P_MIN / PROB_ONE.
# With the integer bound (rng >> PROB_BITS) * p, a 0-bin keeps at most rng * (1 - P_MIN / PROB_ONE)
# + P_MIN of a range rng >= TOP, hence the P_MIN / TOP term.
MIN_BITS_PER_ELEMENT = -np.log2(1.0 - P_MIN / PROB_ONE + P_MIN / TOP)


@scalar_helper
def _bitlen(x):
    n = 0
    if x >= 1 << 32:
        x >>= 32
        n += 32
    if x >= 1 << 16:
        x >>= 16
        n += 16
    if x >= 1 << 8:
        x >>= 8
        n += 8
    if x >= 1 << 4:
        x >>= 4
        n += 4
    if x >= 1 << 2:
        x >>= 2
        n += 2
    if x >= 1 << 1:
        x >>= 1
        n += 1
    return n + x


@scalar_helper
def _bucket_and_k(s, k_offset):
    length = _bitlen(s)
    if length >= 2:
        bucket = 2 * length + ((s >> (length - 2)) & 1)
    else:
        bucket = 2 * length
    k = length - SCALE_FRAC - k_offset
    if k < 0:
        k = 0
    return bucket, k


@scalar_helper
def _prob(a, b):
    p = (a + b) >> 2
    if p < P_MIN:
        p = P_MIN
    elif p > PROB_ONE - P_MIN:
        p = PROB_ONE - P_MIN
    return p


@scalar_helper
def _adapt(a, b, n, bit, shift_fast, shift_slow):
    target = bit << 16
    a += (target - a) >> shift_fast
    b += (target - b) >> shift_slow
    if n < WARMUP_MAX:
        n += 1
    return a, b, n


@kernel
def _shift_low(low, cache, cache_size, out, pos):
    # Emits the byte above the 24-bit window once it can no longer change by a carry.
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
def encode_levels_kernel(levels, ncols, col0, k_offset, out):
    """Encode int32 ``levels`` into ``out``; returns the byte count, or -1 if ``out`` is too small.

    ``ncols`` > 0 enables the per-column scale over a row-major 2-D view with ``ncols`` columns,
    the first element sitting in column ``col0``.
    """
    n = levels.shape[0]
    state = np.empty((N_CTX, 3), dtype=np.int64)
    for c in range(N_CTX):
        state[c, 0] = 1 << 15
        state[c, 1] = 1 << 15
        state[c, 2] = 0
    use_cols = ncols > 0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    col = col0

    low = 0
    rng = RANGE_INIT
    cache = 0
    cache_size = 1
    pos = 0
    row_scale = 0

    for i in range(n):
        v = np.int64(levels[i])
        u = 2 * v - 1 if v > 0 else -2 * v
        if use_cols and i >= ncols:
            s = (row_scale + col_scale[col]) >> 1
        else:
            s = row_scale
        bucket, k = _bucket_and_k(s, k_offset)
        base = bucket * CTX_PER_BUCKET
        q = u >> k

        # Unary part of q: context-coded bins, escape to Exp-Golomb after Q_MAX ones.
        steps = q if q < Q_MAX else Q_MAX
        for j in range(steps + 1):
            if j == Q_MAX:
                break
            bit = 1 if j < q else 0
            c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
            sf = WARMUP_SHIFT[state[c, 2]]
            ss = sf
            if sf > RATE_FAST:
                sf = RATE_FAST
            if ss > RATE_SLOW:
                ss = RATE_SLOW
            p = _prob(state[c, 0], state[c, 1])
            bound = (rng >> PROB_BITS) * p
            if bit:
                rng = bound
            else:
                low += bound
                rng -= bound
            state[c, 0], state[c, 1], state[c, 2] = _adapt(state[c, 0], state[c, 1], state[c, 2], bit, sf, ss)
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
        if q >= Q_MAX:
            # Exp-Golomb order 0 of x = q - Q_MAX + 1: (len-1) ones, a zero, then len-1 bits.
            x = q - Q_MAX + 1
            length = _bitlen(x)
            for j in range(length):
                bit = 1 if j < length - 1 else 0
                rng >>= 1
                if bit:
                    low += rng
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
            remaining = length - 1
            while remaining > 0:
                g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                remaining -= g
                bits = (x >> remaining) & ((1 << g) - 1)
                rng >>= g
                low += bits * rng
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)

        # Suffix: the top bit context-coded (the shape inside a Rice bin), the rest bypass.
        remaining = k
        if k >= 2:
            bit = (u >> (k - 1)) & 1
            c = base + N_UNARY_CTX + (1 if q > 0 else 0)
            sf = WARMUP_SHIFT[state[c, 2]]
            ss = sf
            if sf > RATE_FAST:
                sf = RATE_FAST
            if ss > RATE_SLOW:
                ss = RATE_SLOW
            p = _prob(state[c, 0], state[c, 1])
            bound = (rng >> PROB_BITS) * p
            if bit:
                rng = bound
            else:
                low += bound
                rng -= bound
            state[c, 0], state[c, 1], state[c, 2] = _adapt(state[c, 0], state[c, 1], state[c, 2], bit, sf, ss)
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
            remaining = k - 1
        while remaining > 0:
            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
            remaining -= g
            bits = (u >> remaining) & ((1 << g) - 1)
            rng >>= g
            low += bits * rng
            while rng < TOP:
                rng <<= 8
                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)

        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT
        if use_cols:
            col_scale[col] += ((u << SCALE_FRAC) - col_scale[col]) >> COL_SHIFT
            col += 1
            if col == ncols:
                col = 0

    # Terminate bin (1): lets the decoder check that it ends where the encoder ended.
    bound = (rng >> PROB_BITS) * TERMINATE_P
    rng = bound
    while rng < TOP:
        rng <<= 8
        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)

    # Flush: pick the value in [low, low + rng) with the most trailing zero bits, so that the
    # trailing zero bytes can be dropped (the decoder reads zeros past the end).
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
    while pos > 1 and out[pos - 1] == 0:
        pos -= 1
    return pos


@kernel
def decode_levels_kernel(buf, ncols, col0, k_offset, out):
    """Decode ``out.shape[0]`` levels from ``buf`` (whose first byte is the stream's second: the
    encoder's first byte is always 0 and is not stored). Returns a status code (``OK`` = 0)."""
    n = out.shape[0]
    size = buf.shape[0]
    state = np.empty((N_CTX, 3), dtype=np.int64)
    for c in range(N_CTX):
        state[c, 0] = 1 << 15
        state[c, 1] = 1 << 15
        state[c, 2] = 0
    use_cols = ncols > 0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    col = col0

    rng = RANGE_INIT
    code = 0
    pos = 0
    for _ in range(4):
        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
        pos += 1
    if code >= rng:
        return ERR_BAD_START
    row_scale = 0

    for i in range(n):
        if use_cols and i >= ncols:
            s = (row_scale + col_scale[col]) >> 1
        else:
            s = row_scale
        bucket, k = _bucket_and_k(s, k_offset)
        base = bucket * CTX_PER_BUCKET

        q = 0
        while q < Q_MAX:
            c = base + (q if q < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
            sf = WARMUP_SHIFT[state[c, 2]]
            ss = sf
            if sf > RATE_FAST:
                sf = RATE_FAST
            if ss > RATE_SLOW:
                ss = RATE_SLOW
            p = _prob(state[c, 0], state[c, 1])
            bound = (rng >> PROB_BITS) * p
            if code < bound:
                bit = 1
                rng = bound
            else:
                bit = 0
                code -= bound
                rng -= bound
            state[c, 0], state[c, 1], state[c, 2] = _adapt(state[c, 0], state[c, 1], state[c, 2], bit, sf, ss)
            while rng < TOP:
                rng <<= 8
                code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                pos += 1
            if bit == 0:
                break
            q += 1
        if q == Q_MAX:
            length = 1
            while True:
                rng >>= 1
                if code >= rng:
                    code -= rng
                    bit = 1
                else:
                    bit = 0
                while rng < TOP:
                    rng <<= 8
                    code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                    pos += 1
                if bit == 0:
                    break
                length += 1
                if length > 34:
                    return ERR_BAD_ESCAPE
            x = 1
            remaining = length - 1
            while remaining > 0:
                g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                remaining -= g
                rng >>= g
                bits = code // rng
                if bits >> g:
                    return ERR_BAD_BYPASS
                code -= bits * rng
                x = (x << g) | bits
                while rng < TOP:
                    rng <<= 8
                    code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                    pos += 1
            q = Q_MAX + x - 1
        if q > (U_MAX >> k):
            return ERR_BAD_VALUE

        u = q
        remaining = k
        if k >= 2:
            c = base + N_UNARY_CTX + (1 if q > 0 else 0)
            sf = WARMUP_SHIFT[state[c, 2]]
            ss = sf
            if sf > RATE_FAST:
                sf = RATE_FAST
            if ss > RATE_SLOW:
                ss = RATE_SLOW
            p = _prob(state[c, 0], state[c, 1])
            bound = (rng >> PROB_BITS) * p
            if code < bound:
                bit = 1
                rng = bound
            else:
                bit = 0
                code -= bound
                rng -= bound
            state[c, 0], state[c, 1], state[c, 2] = _adapt(state[c, 0], state[c, 1], state[c, 2], bit, sf, ss)
            while rng < TOP:
                rng <<= 8
                code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                pos += 1
            u = (u << 1) | bit
            remaining = k - 1
        while remaining > 0:
            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
            remaining -= g
            rng >>= g
            bits = code // rng
            if bits >> g:
                return ERR_BAD_BYPASS
            code -= bits * rng
            u = (u << g) | bits
            while rng < TOP:
                rng <<= 8
                code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                pos += 1
        if u > U_MAX:
            return ERR_BAD_VALUE
        if u & 1:
            out[i] = (u + 1) >> 1
        else:
            out[i] = -(u >> 1)

        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT
        if use_cols:
            col_scale[col] += ((u << SCALE_FRAC) - col_scale[col]) >> COL_SHIFT
            col += 1
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
