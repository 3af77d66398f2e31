"""Numba kernels of the lossless float coder (private: :mod:`.floatcoder` is the validated front).

A float's bits are cut into a *symbol*, its exponent and the top ``TOP_BITS`` of its mantissa, coded
with four interleaved rANS states over static per-chunk frequency tables chosen by the segment's
class, and *raw bits*, its sign and the rest of its mantissa, packed LSB first into 32-bit words.
Each segment drops the low mantissa bits that are zero in all of its elements. The layout is in
docs/format.md §4.4.

All arithmetic is on int64 (rANS states are below 2**32) or uint64 (float bits): mixing the two
would make Numba compute in float64.
"""

from __future__ import annotations

import numpy as np

from .._jit import inline, kernel

PROB_BITS = 14  # frequencies of a table sum to 2**PROB_BITS
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16  # states stay in [RANS_L, 2**32); renormalisation moves 16 bits
LANES = 4  # interleaved states: element i uses state i % LANES
TOP_BITS = 2  # mantissa bits coded with the exponent (they depend on it: the density falls inside an octave)
MAX_CLASSES_LOG2 = 4

OK = 0
ERR_OVERRUN = -1  # a stream is shorter than its elements need
ERR_BAD_END = -2  # the rANS states do not end where they began: damaged
ERR_BAD_TABLE = -3  # a frequency table does not sum to its scale, or names a symbol twice
ERR_TRAILING = -4  # bytes left after the last element


@inline
def _parts(w, W, M, z):
    """(symbol, raw bits, raw bit count) of the float bits ``w`` (uint64) in a segment dropping ``z``."""
    mr = M - z
    t = min(TOP_BITS, mr)
    low_bits = mr - t
    s = np.int64((w >> np.uint64(W - 1)) & np.uint64(1))
    e = np.int64((w >> np.uint64(M)) & np.uint64((1 << (W - 1 - M)) - 1))
    m = w & np.uint64((1 << M) - 1)
    m = m >> np.uint64(z)
    top = np.int64(m >> np.uint64(low_bits))
    low = m & np.uint64((1 << low_bits) - 1)
    sym = (e << TOP_BITS) | (top << (TOP_BITS - t))
    raw = (np.uint64(s) << np.uint64(low_bits)) | low
    return sym, raw, low_bits + 1


@kernel
def segment_stats(words, seg_len, W, M, zeros, mean_exponent):
    """Per segment: the low mantissa bits zero in every element (capped at M) and the mean exponent."""
    n = words.shape[0]
    mmask = np.uint64((1 << M) - 1)
    for j in range(zeros.shape[0]):
        start = j * seg_len
        stop = min(n, start + seg_len)
        acc = np.uint64(0)
        total = 0
        for i in range(start, stop):
            w = np.uint64(words[i])
            acc |= w & mmask
            total += np.int64(w >> np.uint64(M)) & ((1 << (W - 1 - M)) - 1)
        z = 0
        while z < M and not (acc >> np.uint64(z)) & np.uint64(1):
            z += 1
        zeros[j] = z
        mean_exponent[j] = total / max(stop - start, 1)


@kernel
def histogram(words, seg_len, W, M, zeros, classes, hist):
    """hist[class, symbol] += 1 for every element (``classes``: the class of each segment)."""
    n = words.shape[0]
    for j in range(zeros.shape[0]):
        z = np.int64(zeros[j])
        c = np.int64(classes[j])
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            sym, _, _ = _parts(np.uint64(words[i]), W, M, z)
            hist[c, sym] += 1


@kernel
def raw_bit_count(n, seg_len, M, zeros):
    total = 0
    for j in range(zeros.shape[0]):
        count = min(n, (j + 1) * seg_len) - j * seg_len
        mr = M - np.int64(zeros[j])
        total += count * (mr - min(TOP_BITS, mr) + 1)
    return total


@kernel
def encode_kernel(words, seg_len, W, M, zeros, symbols, raw_out):
    """The symbols of the floats ``words`` into ``symbols`` and their raw bits into ``raw_out``;
    returns how many raw words."""
    n = words.shape[0]
    acc = np.uint64(0)
    nacc = 0
    nraw = 0
    for j in range(zeros.shape[0]):
        z = np.int64(zeros[j])
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            sym, raw, k = _parts(np.uint64(words[i]), W, M, z)
            symbols[i] = sym
            if k > 32:
                acc |= (raw & np.uint64(0xFFFFFFFF)) << np.uint64(nacc)
                nacc += 32
                raw >>= np.uint64(32)
                k -= 32
                raw_out[nraw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                nraw += 1
                acc >>= np.uint64(32)
                nacc -= 32
            acc |= raw << np.uint64(nacc)
            nacc += k
            if nacc >= 32:
                raw_out[nraw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                nraw += 1
                acc >>= np.uint64(32)
                nacc -= 32
    if nacc > 0:
        raw_out[nraw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        nraw += 1
    return nraw


@kernel
def rans_encode(symbols, seg_len, classes, freq, start, inverse, rans_out):
    """The rANS words of ``symbols`` (each segment with its class's table) into the end of
    ``rans_out``, which holds at least n + 2 * LANES + 2 words; returns where they begin.
    ``inverse`` is 1 / freq as float64 (where freq > 0). Backward: the decoder reads forward what
    is pushed here last."""
    n = symbols.shape[0]
    x = np.full(LANES, RANS_L, dtype=np.int64)
    pos = rans_out.shape[0]
    nseg = classes.shape[0]
    for jj in range(nseg):
        j = nseg - 1 - jj
        c = np.int64(classes[j])
        lo = j * seg_len
        for i in range(min(n, lo + seg_len) - 1, lo - 1, -1):
            sym = np.int64(symbols[i])
            f = np.int64(freq[c, sym])
            lane = i & (LANES - 1)
            s = x[lane]
            # renormalise without a branch: the word goes below the pushed ones and stays there
            # only when pushed (the buffer's slack keeps pos - 1 in bounds)
            push = np.int64(s >= ((RANS_L >> PROB_BITS) << 16) * f)
            rans_out[pos - 1] = np.uint16(s & 0xFFFF)
            pos -= push
            s >>= 16 * push
            # s // f by a float reciprocal, corrected to the exact quotient: integer division
            # would take most of the encoder's time
            q = np.int64(s * inverse[c, sym])
            r = s - q * f
            if r < 0:
                q -= 1
                r += f
            elif r >= f:
                q += 1
                r -= f
            x[lane] = q * PROB_SCALE + r + np.int64(start[c, sym])
    for lane in range(LANES - 1, -1, -1):
        pos -= 1
        rans_out[pos] = np.uint16(x[lane] >> 16)
        pos -= 1
        rans_out[pos] = np.uint16(x[lane] & 0xFFFF)
    return pos


@kernel
def rans_decode(rans, seg_len, classes, freq, lut, symbols):
    """The symbols of a substream (each segment with its class's table); OK or an error code.
    ``lut[c, slot]`` = symbol | (slot - start) << 16; ``rans`` ends with one word of padding. Reads
    only inside it; ends with the states where the encoder began and every word consumed."""
    n = symbols.shape[0]
    nr = rans.shape[0] - 1  # (the last word is the caller's padding)
    if nr < 2 * LANES:
        return ERR_OVERRUN
    x0 = np.int64(rans[0]) | (np.int64(rans[1]) << 16)
    x1 = np.int64(rans[2]) | (np.int64(rans[3]) << 16)
    x2 = np.int64(rans[4]) | (np.int64(rans[5]) << 16)
    x3 = np.int64(rans[6]) | (np.int64(rans[7]) << 16)
    p = 2 * LANES
    mask = PROB_SCALE - 1
    for j in range(classes.shape[0]):
        c = np.int64(classes[j])
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            lane = i & 3
            s = x0 if lane == 0 else (x1 if lane == 1 else (x2 if lane == 2 else x3))
            entry = np.int64(lut[c, s & mask])
            sym = entry & 0xFFFF
            s = np.int64(freq[c, sym]) * (s >> PROB_BITS) + (entry >> 16)
            # renormalise without a branch (taken for about one symbol in six: unpredictable); the
            # extra word past the end keeps the read in bounds, the check stops after it
            if p > nr:
                return ERR_OVERRUN
            need = np.int64(s < RANS_L)
            s = (s << (16 * need)) | (np.int64(rans[p]) & -need)
            p += need
            if lane == 0:
                x0 = s
            elif lane == 1:
                x1 = s
            elif lane == 2:
                x2 = s
            else:
                x3 = s
            symbols[i] = sym
    if p > nr:
        return ERR_OVERRUN
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
        return ERR_BAD_END
    if p != nr:
        return ERR_TRAILING
    return OK


@kernel
def decode_kernel(raw, seg_len, W, M, zeros, symbols, out):
    """Rebuild ``out`` (the float bits) from the decoded ``symbols`` and the raw bits; OK or an
    error code. ``raw`` ends with one word of padding; every other word is read, none beyond."""
    n = out.shape[0]
    nw = raw.shape[0] - 1
    acc = np.uint64(0)
    nacc = 0
    q = 0
    for j in range(zeros.shape[0]):
        z = np.int64(zeros[j])
        mr = M - z
        t = min(TOP_BITS, mr)
        low_bits = mr - t
        k_all = low_bits + 1
        top_shift = np.uint64(M - t)
        top_drop = TOP_BITS - t
        low_mask = np.uint64((1 << low_bits) - 1)
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            sym = np.int64(symbols[i])
            k = k_all
            value = np.uint64(0)
            got = 0
            if k > 32:  # (float64 only)
                if nacc < 32:
                    if q >= nw:
                        return ERR_OVERRUN
                    acc |= np.uint64(raw[q]) << np.uint64(nacc)
                    q += 1
                    nacc += 32
                value = acc & np.uint64(0xFFFFFFFF)
                acc >>= np.uint64(32)
                nacc -= 32
                got = 32
                k -= 32
            # refill without a branch, as in rans_decode (the shift is exact whenever the word is taken)
            if q > nw:
                return ERR_OVERRUN
            take = np.uint64(nacc < k)
            acc |= (np.uint64(raw[q]) << np.uint64(nacc & 31)) & (np.uint64(0) - take)
            q += np.int64(take)
            nacc += 32 * np.int64(take)
            value |= (acc & np.uint64((1 << k) - 1)) << np.uint64(got)
            acc >>= np.uint64(k)
            nacc -= k
            e = np.uint64(sym >> TOP_BITS)
            top = np.uint64((sym & ((1 << TOP_BITS) - 1)) >> top_drop)
            sign = value >> np.uint64(low_bits)
            out[i] = ((sign << np.uint64(W - 1)) | (e << np.uint64(M)) | (top << top_shift)
                      | ((value & low_mask) << np.uint64(z)))
    if q > nw:
        return ERR_OVERRUN
    if q != nw or acc != np.uint64(0):
        return ERR_TRAILING
    return OK


@kernel
def build_lut(freq, start, lut):
    """lut[c, slot] = sym | (slot - start) << 16 for the symbol whose range [start, start + freq)
    holds slot."""
    for c in range(freq.shape[0]):
        for sym in range(freq.shape[1]):
            f = freq[c, sym]
            b = start[c, sym]
            for slot in range(b, b + f):
                lut[c, slot] = np.uint32(sym | ((slot - b) << 16))


# Tables: per class, the used symbols in increasing order, each as gamma(gap) gamma(freq), where gap
# is the distance from the previous used symbol (+1 for the first) and gamma the Elias gamma code.

@inline
def _put_bits(buf, state, value, k):
    """Append the ``k`` low bits of ``value`` (k <= 32) MSB first; state = [bit position]."""
    for b in range(k - 1, -1, -1):
        if (value >> b) & 1:
            pos = state[0]
            buf[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
        state[0] += 1


@inline
def _put_gamma(buf, state, v):
    k = 0
    while (v >> (k + 1)) > 0:
        k += 1
    state[0] += k  # k zeros
    _put_bits(buf, state, v, k + 1)


@kernel
def write_tables(freq, buf):
    """The tables' bits into the zeroed ``buf``; returns the byte count."""
    state = np.zeros(1, dtype=np.int64)
    for c in range(freq.shape[0]):
        prev = -1
        used = 0
        for sym in range(freq.shape[1]):
            if freq[c, sym] > 0:
                used += 1
        _put_gamma(buf, state, used)
        for sym in range(freq.shape[1]):
            f = np.int64(freq[c, sym])
            if f > 0:
                _put_gamma(buf, state, sym - prev)
                _put_gamma(buf, state, f)
                prev = sym
    return (state[0] + 7) >> 3


@inline
def _get_gamma(buf, state, limit_bits):
    """Elias gamma at the bit position state[0]; -1 past ``limit_bits`` or beyond 31 bits."""
    k = 0
    while True:
        pos = state[0]
        if pos >= limit_bits:
            return -1
        bit = (buf[pos >> 3] >> (7 - (pos & 7))) & 1
        state[0] += 1
        if bit:
            break
        k += 1
        if k > 31:
            return -1
    v = 1
    for _ in range(k):
        pos = state[0]
        if pos >= limit_bits:
            return -1
        v = (v << 1) | ((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
        state[0] += 1
    return v


@kernel
def read_tables(buf, precision, freq, start):
    """Parse tables written by :func:`write_tables` (frequencies summing to 2**precision) into
    ``freq`` and ``start`` (zeroed, shape (classes, alphabet)) at PROB_BITS; returns the byte count
    read, or an error code."""
    scale = np.int64(1) << precision
    up = PROB_BITS - precision
    state = np.zeros(1, dtype=np.int64)
    limit = buf.shape[0] * 8
    alphabet = freq.shape[1]
    for c in range(freq.shape[0]):
        used = _get_gamma(buf, state, limit)
        if used < 1 or used > alphabet:
            return ERR_BAD_TABLE
        sym = -1
        total = 0
        for _ in range(used):
            gap = _get_gamma(buf, state, limit)
            f = _get_gamma(buf, state, limit)
            if gap < 1 or f < 1:
                return ERR_BAD_TABLE
            sym += gap
            if sym >= alphabet or total + f > scale:
                return ERR_BAD_TABLE
            freq[c, sym] = f << up
            start[c, sym] = total << up
            total += f
        if total != scale:
            return ERR_BAD_TABLE
    return (state[0] + 7) >> 3


COST_FRACTION_BITS = 16  # the class choice counts bits in units of 2**-16, in integers: deterministic


def cost_table() -> np.ndarray:
    """cost[f] = the bits of a symbol of frequency f (of 2**PROB_BITS), (PROB_BITS - log2 f) in
    units of 2**-16."""
    f = np.arange(PROB_SCALE + 1, dtype=np.float64)
    f[0] = 1.0
    return np.round((PROB_BITS - np.log2(f)) * (1 << COST_FRACTION_BITS)).astype(np.int64)


@inline
def _gamma_length(v):
    k = 0
    while (v >> (k + 1)) > 0:
        k += 1
    return 2 * k + 1


@kernel
def normalize_row(counts, scale_bits, out):
    """Frequencies summing to 2**scale_bits, at least 1 where a count is: floor(count * scale /
    total), the rare ones raised to 1, the excess taken from the largest (ties: the lower symbol
    first) or a shortfall given to the most frequent symbol."""
    scale = np.int64(1) << scale_bits
    total = 0
    best = 0
    for i in range(counts.shape[0]):
        total += counts[i]
        if counts[i] > counts[best]:
            best = i
    s = 0
    for i in range(counts.shape[0]):
        f = counts[i] * scale // total
        if counts[i] > 0 and f == 0:
            f = 1
        out[i] = f
        s += f
    excess = s - scale
    if excess < 0:
        out[best] -= excess
    elif excess > 0:
        order = np.argsort(-out, kind="mergesort")
        for idx in order:
            if excess == 0:
                break
            take = min(excess, np.int64(out[idx]) - 1)
            out[idx] -= take
            excess -= take


TABLE_PRECISIONS = (14, 12, 10, 8)  # what the encoder tries: coarser tables cost fewer bits to send


@kernel
def choose_classes(hist16, nseg, costs, freq):
    """The class count 2**klog (every class occupied) and the table precision (frequencies summing
    to 2**precision, used as multiples of 2**(PROB_BITS - precision)) that make the chunk smallest,
    frequency tables, class nibbles and gamma-coded tables included. The tables, at that precision,
    go into ``freq`` (zeroed, 16 x alphabet). Returns (klog, precision)."""
    groups = hist16.shape[0]
    alphabet = hist16.shape[1]
    rows = np.zeros((groups, alphabet), dtype=np.int64)
    tmp = np.zeros(alphabet, dtype=np.int64)
    best_cost = np.int64(-1)
    best = 0
    best_bits = PROB_BITS
    for klog in range(MAX_CLASSES_LOG2 + 1):
        K = 1 << klog
        per = groups // K
        complete = True
        rows[:K] = 0
        for c in range(K):
            for g in range(c * per, (c + 1) * per):
                for s in range(alphabet):
                    rows[c, s] += hist16[g, s]
            if rows[c].sum() == 0:
                complete = False
        if not complete:
            break
        most = 0  # (symbols of the fullest class: a table of 2**bits holds at most 2**bits)
        for c in range(K):
            most = max(most, np.count_nonzero(rows[c]))
        for bits in TABLE_PRECISIONS:
            if most > (1 << bits):
                continue
            cost = np.int64(4 * nseg if klog else 0) << COST_FRACTION_BITS
            for c in range(K):
                normalize_row(rows[c], bits, tmp)
                used = 0
                prev = -1
                table = 0
                for s in range(alphabet):
                    if tmp[s] > 0:
                        cost += rows[c, s] * costs[tmp[s] << (PROB_BITS - bits)]
                        used += 1
                        table += _gamma_length(s - prev) + _gamma_length(tmp[s])
                        prev = s
                cost += np.int64(table + _gamma_length(used)) << COST_FRACTION_BITS
            if best_cost < 0 or cost < best_cost:
                best_cost = cost
                best = klog
                best_bits = bits
    K = 1 << best
    per = groups // K
    for c in range(K):
        rows[c] = 0
        for g in range(c * per, (c + 1) * per):
            for s in range(alphabet):
                rows[c, s] += hist16[g, s]
        normalize_row(rows[c], best_bits, tmp)
        for s in range(alphabet):
            freq[c, s] = tmp[s]
    return best, best_bits


# --- integers by magnitude class (Mode.MAGNITUDE) ------------------------------------------------
# The symbol is the bit length b of |v| (0 to the width) and the TOP_BITS bits below its leading
# one (the density falls inside an octave, as a float's mantissa), coded like the float symbol; the
# raw bits are the sign and the rest of |v|: wide integers (differences of float bits) cost their
# length's entropy plus their own bits, nothing per bit of the length.

ERR_BAD_INTEGER = -6  # a decoded integer outside its dtype, or a negative zero


@inline
def _magnitude(v):
    """(bit length, |v| as uint64) of an int64."""
    m = np.uint64(v) if v >= 0 else np.uint64(-(v + 1)) + np.uint64(1)
    b = 0
    while b < 64 and (m >> np.uint64(b)) > np.uint64(0):
        b += 1
    return b, m


@inline
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
def int_histogram(values, seg_len, classes, hist):
    n = values.shape[0]
    for j in range(classes.shape[0]):
        c = np.int64(classes[j])
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            sym, _, _ = _magnitude_parts(np.int64(values[i]))
            hist[c, sym] += 1


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
    if nacc > 0:
        raw_out[nraw] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        nraw += 1
    return nraw


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
