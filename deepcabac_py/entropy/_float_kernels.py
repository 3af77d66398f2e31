"""Numba kernels of the lossless float coder (private: :mod:`.floatcoder` is the validated front).

A float's bits are cut into a *symbol*, its exponent and the top ``TOP_BITS`` of its mantissa, coded
with four interleaved tANS states (rANS in streams before format version 8, and in low-bit mode 2)
over static per-chunk frequency tables chosen by the segment's class, and *raw bits*, its sign and
the rest of its mantissa, packed LSB first into 32-bit words.
Each segment drops the low mantissa bits that are zero in all of its elements. The layout is in
docs/format.md §4.4.

All arithmetic is on int64 (rANS states are below 2**32) or uint64 (float bits): mixing the two
would make Numba compute in float64.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from .._jit import copy_bytes, helper, inline, kernel, load_le64, store_le64, trailing_zeros
from ._vector_kernels import GROUP, VECTOR_STEPS, split_step, window

PROB_BITS = 14  # frequencies of a table sum to 2**PROB_BITS
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16  # states stay in [RANS_L, 2**32); renormalisation moves 16 bits
LANES = 4  # interleaved states: element i uses state i % LANES
PARTIAL_HISTOGRAMS_FROM = 1 << 16  # elements: below, clearing and adding up the partial histograms costs more
TOP_BITS = 2  # mantissa bits coded with the exponent (they depend on it: the density falls inside an octave)
MAX_CLASSES_LOG2 = 4
_U = np.uint64  # (indices: see rans_decode)

OK = 0
ERR_OVERRUN = -1  # a stream is shorter than its elements need
ERR_BAD_END = -2  # the rANS states do not end where they began: damaged
ERR_BAD_TABLE = -3  # a frequency table does not sum to its scale, or names a symbol twice
ERR_TRAILING = -4  # bytes left after the last element


@helper
def _segment_bits(M, z):
    """(mantissa bits in the symbol, mantissa bits left raw, raw bits with the sign) of an element
    of a segment that drops ``z`` low mantissa bits of ``M``."""
    t = min(TOP_BITS, M - z)
    return t, M - z - t, M - z - t + 1


@helper
def _parts(w, W, M, z):
    """(symbol, raw bits, raw bit count) of the float bits ``w`` (uint64) in a segment dropping ``z``."""
    t, low_bits, k = _segment_bits(M, z)
    s = np.int64((w >> np.uint64(W - 1)) & np.uint64(1))
    e = np.int64((w >> np.uint64(M)) & np.uint64((1 << (W - 1 - M)) - 1))
    m = w & np.uint64((1 << M) - 1)
    m = m >> np.uint64(z)
    top = np.int64(m >> np.uint64(low_bits))
    low = m & np.uint64((1 << low_bits) - 1)
    sym = (e << TOP_BITS) | (top << (TOP_BITS - t))
    raw = (np.uint64(s) << np.uint64(low_bits)) | low
    return sym, raw, k


@inline
def _segment_stat(words, start, stop, W, M):
    """(the low mantissa bits zero in every element of words[start:stop], capped at M; their mean
    exponent)."""
    mmask = np.uint64((1 << M) - 1)
    acc = np.uint64(0)
    total = 0
    tail = start
    if W == 16 and stop - start >= 4:
        # four elements to a 64-bit word, their exponents summed in its four 16-bit fields (256
        # words at most before a field could overflow): one element at a time, in Numba's 64-bit
        # integers, took 0.175 ns per element of MiniLM bf16's chunks, this 0.12 (scratch)
        rep = np.uint64(0x0001000100010001)
        fields_mask = mmask * rep
        exponents = np.uint64((1 << (W - 1 - M)) - 1) * rep
        quads = (stop - start) >> 2
        acc4 = np.uint64(0)
        for block in range(0, quads, 256):
            packed = np.uint64(0)
            for j in range(block, min(quads, block + 256)):
                w = load_le64(words, 2 * (start + 4 * j))
                acc4 |= w & fields_mask
                packed += (w >> np.uint64(M)) & exponents
            for f in range(4):
                total += np.int64((packed >> np.uint64(16 * f)) & np.uint64(0xFFFF))
        for f in range(4):
            acc |= (acc4 >> np.uint64(16 * f)) & mmask
        tail = start + 4 * quads
    for i in range(tail, stop):
        w = np.uint64(words[_U(i)])
        acc |= w & mmask
        total += np.int64(w >> np.uint64(M)) & ((1 << (W - 1 - M)) - 1)
    z = 0
    while z < M and not (acc >> np.uint64(z)) & np.uint64(1):
        z += 1
    return z, total / max(stop - start, 1)


@kernel
def segment_stats(words, seg_len, W, M, zeros, mean_exponent):
    """Per segment: the low mantissa bits zero in every element (capped at M) and the mean exponent."""
    n = words.shape[0]
    for j in range(zeros.shape[0]):
        zeros[j], mean_exponent[j] = _segment_stat(words, j * seg_len, min(n, (j + 1) * seg_len), W, M)


@inline
def _order_of_totals(keys):
    """``np.argsort(keys, kind="stable")`` of nonnegative int64 ``keys``: a radix sort, a byte a
    pass, least significant first, only the bytes in which the keys differ."""
    n = keys.shape[0]
    order = np.arange(n)
    spare = np.empty(n, dtype=np.int64)
    if n == 0:
        return order
    ones = np.int64(0)
    common = np.int64(-1)
    for i in range(n):
        ones |= keys[i]
        common &= keys[i]
    differ = ones ^ common
    count = np.empty(256, dtype=np.int64)
    shift = 0
    while (differ >> shift) != 0:
        if (differ >> shift) & 255:
            count[:] = 0
            for i in range(n):
                count[(keys[i] >> shift) & 255] += 1
            at = 0
            for d in range(256):
                at, count[d] = at + count[d], at
            for i in range(n):
                j = order[i]
                d = (keys[j] >> shift) & 255
                spare[count[d]] = j
                count[d] += 1
            order, spare = spare, order
        shift += 8
    return order


@kernel
def rank_classes(mean, classes16, seg_len, n):
    """16 classes of (nearly) equal size by the segments' ``mean`` statistics (ties: the earlier
    segment lower); fewer classes are their unions. Each mean is an integer total over its segment
    (``seg_len`` elements of ``n``, the last maybe fewer), so the full segments are ranked by their
    totals, recovered exactly (below 2**27, the product's error is far below one half; distinct
    totals over one length give distinct means, in the same order), and a shorter last segment goes
    after every full one whose mean is at most its own. (The means' 64 bits, 11 a pass, had taken
    13.6 us of a 147,456-element chunk's coding, 62 of a 1M one's and 1.7 for a single segment;
    the totals take 4.8, 30 and 0.7: scratch, medians of 300 calls.)"""
    nseg = mean.shape[0]
    full = nseg if nseg == 0 or n - (nseg - 1) * seg_len >= seg_len else nseg - 1
    keys = np.empty(full, dtype=np.int64)
    for j in range(full):
        keys[j] = np.int64(mean[j] * seg_len + 0.5)
    order = _order_of_totals(keys)
    if full < nseg:
        last = mean[nseg - 1]
        at = 0
        for j in range(full):
            at += mean[j] <= last
        # (the full segments at or below the last one's mean are the first ``at`` in the order)
        order = np.concatenate((order[:at], np.full(1, nseg - 1), order[at:]))
    for r in range(nseg):
        classes16[order[r]] = r * (1 << MAX_CLASSES_LOG2) // nseg


@kernel
def segment_classes(words, seg_len, W, M, zeros, classes16):
    """Per segment: the low mantissa bits zero in every element, and its class of 16 by its mean
    exponent."""
    mean_exponent = np.empty(zeros.shape[0], dtype=np.float64)
    segment_stats(words, seg_len, W, M, zeros, mean_exponent)
    rank_classes(mean_exponent, classes16, seg_len, words.shape[0])


@kernel
def histogram(symbols, seg_len, classes, hist):
    """hist[class, symbol] += 1 for every symbol (``classes``: the class of each segment)."""
    part = np.zeros(4 * hist.shape[0] * hist.shape[1] if symbols.shape[0] >= PARTIAL_HISTOGRAMS_FROM else 0,
                    dtype=np.uint32)
    _histogram_into(symbols, seg_len, classes, hist, part)


@inline
def _histogram_into(symbols, seg_len, classes, hist, part):
    """:func:`histogram` with its partial histograms in ``part`` (uint32, 4 * hist.size zeros, or
    empty below PARTIAL_HISTOGRAMS_FROM elements). The partials are 32-bit (a chunk holds a few
    million elements at most) so that the counters a chunk's classes use stay in the L1 cache: with
    64-bit ones, bf16's 147,456-element chunks took 82 us to count against 67."""
    n = symbols.shape[0]
    alphabet = hist.shape[1]
    flat = hist.ravel()
    if n < PARTIAL_HISTOGRAMS_FROM:
        for j in range(classes.shape[0]):
            base = _U(np.int64(classes[j]) * alphabet)
            for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
                flat[base + _U(symbols[_U(i)])] += 1
        return
    # four partial histograms, one per element mod 4: runs of one symbol (the common exponent)
    # would otherwise wait on their own counter's store
    for j in range(classes.shape[0]):
        base = _U(4 * np.int64(classes[j]) * alphabet)
        lo = j * seg_len
        stop = min(n, lo + seg_len)
        for i in range(lo, stop):
            part[base + _U((i & 3) * alphabet) + _U(symbols[_U(i)])] += np.uint32(1)
    for c in range(hist.shape[0]):
        for q in range(4):
            for s in range(alphabet):
                hist[c, s] += part[(4 * c + q) * alphabet + s]


@kernel
def raw_bit_count(n, seg_len, M, zeros):
    total = 0
    for j in range(zeros.shape[0]):
        total += (min(n, (j + 1) * seg_len) - j * seg_len) * _segment_bits(M, np.int64(zeros[j]))[2]
    return total


@inline
def _append_raw(bits, k, acc, nacc, nraw, raw_out):
    """Put ``k`` <= 32 raw bits after the pending ``nacc`` < 32 of ``acc``: the low word is stored
    every time and kept when full (no branch to mispredict). Returns (acc, nacc, nraw)."""
    acc |= bits << np.uint64(nacc)
    nacc += k
    raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
    full = np.int64(nacc >= 32)
    return acc >> np.uint64(32 * full), nacc - 32 * full, nraw + full


@inline
def _last_raw_word(acc, nacc, nraw, raw_out):
    """Store the pending ``nacc`` bits of ``acc``, if any, as the last raw word: the raw word count."""
    if nacc > 0:
        raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
        nraw += 1
    return nraw


@inline
def _encode_grouped(words, lo, stop, W, M, z, k, symbols, raw_out, acc, nacc, nraw):
    """encode_kernel's segment [lo, stop) of k <= 16 raw bits an element: those of two or four
    elements are put together before they join the words, so the accumulator's chain, the limit
    here, is walked half or a quarter as often. (It takes the segment's last elements too: handed
    back to encode_kernel's loop, they cost 3-6%, bf16 1.22 -> 1.27 ns per element.) Returns (acc,
    nacc, nraw)."""
    i = lo
    if k <= 8:
        while i + 4 <= stop:
            s0, r0, _ = _parts(np.uint64(words[_U(i)]), W, M, z)
            s1, r1, _ = _parts(np.uint64(words[_U(i + 1)]), W, M, z)
            s2, r2, _ = _parts(np.uint64(words[_U(i + 2)]), W, M, z)
            s3, r3, _ = _parts(np.uint64(words[_U(i + 3)]), W, M, z)
            symbols[_U(i)], symbols[_U(i + 1)], symbols[_U(i + 2)], symbols[_U(i + 3)] = s0, s1, s2, s3
            piece = r0 | (r1 << np.uint64(k)) | (r2 << np.uint64(2 * k)) | (r3 << np.uint64(3 * k))
            acc, nacc, nraw = _append_raw(piece, 4 * k, acc, nacc, nraw, raw_out)
            i += 4
    else:
        while i + 2 <= stop:
            s0, r0, _ = _parts(np.uint64(words[_U(i)]), W, M, z)
            s1, r1, _ = _parts(np.uint64(words[_U(i + 1)]), W, M, z)
            symbols[_U(i)], symbols[_U(i + 1)] = s0, s1
            acc, nacc, nraw = _append_raw(r0 | (r1 << np.uint64(k)), 2 * k, acc, nacc, nraw, raw_out)
            i += 2
    for t in range(i, stop):
        sym, raw, _ = _parts(np.uint64(words[_U(t)]), W, M, z)
        symbols[_U(t)] = sym
        acc, nacc, nraw = _append_raw(raw, k, acc, nacc, nraw, raw_out)
    return acc, nacc, nraw


@inline
def _encode_each(words, lo, stop, W, M, z, k, symbols, raw_out, acc, nacc, nraw):
    """encode_kernel's segment [lo, stop) of 16 < k <= 32 raw bits an element."""
    for i in range(lo, stop):
        sym, raw, _ = _parts(np.uint64(words[_U(i)]), W, M, z)
        symbols[_U(i)] = sym
        acc, nacc, nraw = _append_raw(raw, k, acc, nacc, nraw, raw_out)
    return acc, nacc, nraw


if VECTOR_STEPS:
    _split_bf16 = split_step(16, 7 - TOP_BITS)
    _split_fp16 = split_step(16, 10 - TOP_BITS)
    _split_fp32 = split_step(32, 23 - TOP_BITS)


@inline
def _encode_by_groups(words, lo, stop, W, M, symbols, raw_out, acc, nacc, nraw):
    """encode_kernel's segment [lo, stop) of bf16, fp16 or fp32 floats dropping no low bit: sixteen
    elements at a time by the vector split while the raw bits' position is a whole byte and the
    split's store fits (the whole split of MiniLM's word embeddings, scratch: bf16 1.08 -> 0.25-0.31
    ns per element, fp16 1.24 -> 0.25, fp32 1.68 -> 0.31); the rest one or a few at a time. Returns (acc,
    nacc, nraw)."""
    k = M - TOP_BITS + 1
    i = lo
    if VECTOR_STEPS:
        # (one element at a time until the position is a whole byte: a segment's first few, where
        # the segments before it left one inside a byte)
        while i < stop and (nacc & 7) != 0 and i < lo + 8:
            sym, raw, _ = _parts(np.uint64(words[_U(i)]), W, M, 0)
            symbols[_U(i)] = sym
            acc, nacc, nraw = _append_raw(raw, k, acc, nacc, nraw, raw_out)
            i += 1
        if (nacc & 7) == 0:
            at = 4 * nraw + (nacc >> 3)
            groups = min((stop - i) // GROUP, (4 * raw_out.shape[0] - window(k) - at) // (2 * k) + 1)
            if groups > 0:
                if numba.config.BOUNDSCHECK and (i < 0 or i + GROUP * groups > min(words.shape[0], symbols.shape[0])
                                                 or at < 0):
                    raise IndexError("a vector split outside its arrays")
                # (the pending bits: _append_raw stores them only with the next element's)
                raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                for _ in range(groups):
                    if M == 7:
                        _split_bf16(words, i, symbols, raw_out, at)
                    elif M == 10:
                        _split_fp16(words, i, symbols, raw_out, at)
                    else:
                        _split_fp32(words, i, symbols, raw_out, at)
                    i += GROUP
                    at += 2 * k
                # (the accumulator again from the word the last group ended in: the bytes after
                # it are zero)
                nraw = at >> 2
                nacc = 8 * (at & 3)
                acc = np.uint64(raw_out[_U(nraw)]) & ((np.uint64(1) << np.uint64(nacc)) - np.uint64(1))
    if W == 16:
        return _encode_grouped(words, i, stop, 16, M, 0, k, symbols, raw_out, acc, nacc, nraw)
    return _encode_each(words, i, stop, 32, 23, 0, k, symbols, raw_out, acc, nacc, nraw)


def _split_at_constant_widths(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw):
    """:func:`_encode_by_groups` of a bf16, fp16 or fp32 segment dropping no bit, its widths as
    constants. (What runs with the JIT off: compiled, the overload below stands in for it.)"""
    return _encode_by_groups(words, lo, stop, 8 * words.dtype.itemsize, M, symbols, raw_out, acc, nacc, nraw)


@overload(_split_at_constant_widths)
def _split_at_constant_widths_of(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw):
    # Chosen by the floats' type as the kernel compiles: Numba compiles every branch of a kernel,
    # even one on a constant argument, so the three formats' loops in encode_kernel's branches were
    # each inlined into every specialisation. A float32 front now compiles one, a 16-bit front two,
    # each in a small function of its own (a first lossless encode of the demo model: 30.5 -> 25.9
    # s; the same choice inlined into encode_kernel saved nothing; the decoder's like choice cost
    # EfficientNet-Lite0 bf16 2-7% of its decode in five pairs of runs, and is not taken).
    if words.dtype.bitwidth == 16:
        def sixteen(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw):
            if M == 7:
                return _encode_by_groups(words, lo, stop, 16, 7, symbols, raw_out, acc, nacc, nraw)
            return _encode_by_groups(words, lo, stop, 16, 10, symbols, raw_out, acc, nacc, nraw)
        return sixteen
    if words.dtype.bitwidth == 32:
        def thirty_two(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw):
            return _encode_by_groups(words, lo, stop, 32, 23, symbols, raw_out, acc, nacc, nraw)
        return thirty_two

    def wider(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw):
        return acc, nacc, nraw  # (float64: its caller never comes here)
    return wider


@kernel
def encode_kernel(words, seg_len, W, M, zeros, symbols, raw_out, mean_exponent):
    """The symbols of the floats ``words`` into ``symbols`` and their raw bits into ``raw_out``
    (one word more than they fill); returns how many raw words. ``zeros`` holds each segment's low
    bits zero; with ``mean_exponent`` not empty, they are found here with the segments' mean
    exponents, each segment's just before its split reads its elements again from the cache."""
    n = words.shape[0]
    acc = np.uint64(0)
    nacc = 0
    nraw = 0
    find = mean_exponent.shape[0] > 0
    for j in range(zeros.shape[0]):
        lo = j * seg_len
        stop = min(n, lo + seg_len)
        if find:
            zeros[j], mean_exponent[j] = _segment_stat(words, lo, stop, W, M)
        z = np.int64(zeros[j])
        k = _segment_bits(M, z)[2]
        # the common formats with no low bit dropped get loops of their own, with the widths as
        # constants: the registers they free keep the loop's values out of memory (bf16 1.24 ->
        # 0.73 ns per element, fp16 1.37 -> 0.82, fp32 1.50 -> 1.36)
        if z == 0 and W <= 32:
            acc, nacc, nraw = _split_at_constant_widths(words, lo, stop, M, symbols, raw_out, acc, nacc, nraw)
        elif k <= 16:
            acc, nacc, nraw = _encode_grouped(words, lo, stop, W, M, z, k, symbols, raw_out, acc, nacc, nraw)
        elif k <= 32:
            acc, nacc, nraw = _encode_each(words, lo, stop, W, M, z, k, symbols, raw_out, acc, nacc, nraw)
        else:  # (float64: up to 51 raw bits, in two pieces)
            for i in range(lo, stop):
                sym, raw, k = _parts(np.uint64(words[_U(i)]), W, M, z)
                symbols[_U(i)] = sym
                acc |= (raw & np.uint64(0xFFFFFFFF)) << np.uint64(nacc)
                raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                nraw += 1
                acc >>= np.uint64(32)
                raw >>= np.uint64(32)
                k -= 32
                acc |= raw << np.uint64(nacc)
                nacc += k
                if nacc >= 32:
                    raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                    nraw += 1
                    acc >>= np.uint64(32)
                    nacc -= 32
    return _last_raw_word(acc, nacc, nraw, raw_out)


@helper
def _lane_state(lane, x0, x1, x2, x3):
    """The state of ``lane`` (element i uses lane i % LANES), for the elements outside whole groups."""
    return x0 if lane == 0 else (x1 if lane == 1 else (x2 if lane == 2 else x3))


@helper
def _with_lane(lane, x, x0, x1, x2, x3):
    """The four states with ``lane``'s replaced by ``x``."""
    return (x if lane == 0 else x0, x if lane == 1 else x1, x if lane == 2 else x2, x if lane == 3 else x3)


@inline
def _rans_put(x, sym, tables, inverse, base, rans_out, pos):
    """Push ``sym`` onto the state ``x``: (new state, new position). ``tables`` holds per class
    and symbol (freq, start), ``inverse`` 1 / freq."""
    at = base + _U(sym)
    f = tables[_U(2) * at]
    # renormalise without a branch: the word goes below the pushed ones and stays there only when
    # pushed (the buffer's slack keeps pos - 1 in bounds)
    push = np.int64(x >= ((RANS_L >> PROB_BITS) << 16) * f)
    rans_out[_U(pos - 1)] = np.uint16(x & 0xFFFF)
    pos -= push
    x >>= 16 * push
    # x // f by a float reciprocal, corrected to the exact quotient: integer division would take
    # most of the encoder's time
    q = np.int64(x * inverse[at])
    r = x - q * f
    if r < 0:
        q -= 1
        r += f
    elif r >= f:
        q += 1
        r -= f
    return q * PROB_SCALE + r + tables[_U(2) * at + _U(1)], pos


@inline
def _encoder_tables(freq, start):
    """(freq, start) per class and symbol, flat, and 1 / freq: what :func:`_rans_put` looks up."""
    alphabet = freq.shape[1]
    tables = np.zeros(2 * freq.shape[0] * alphabet, dtype=np.int64)
    inverse = np.zeros(freq.shape[0] * alphabet, dtype=np.float64)
    for c in range(freq.shape[0]):
        for s in range(alphabet):
            f = np.int64(freq[c, s])
            at = c * alphabet + s
            tables[2 * at] = f
            tables[2 * at + 1] = start[c, s]
            inverse[at] = 1.0 / max(f, 1)
    return tables, inverse


@inline
def _flush_states(x0, x1, x2, x3, rans_out, pos):
    """Push the final states (the decoder's initial ones, lane 0 first): where the words begin."""
    for x in (x3, x2, x1, x0):
        pos -= 1
        rans_out[pos] = np.uint16(x >> 16)
        pos -= 1
        rans_out[pos] = np.uint16(x & 0xFFFF)
    return pos


@kernel
def rans_encode(symbols, seg_len, classes, freq, start, rans_out):
    """The rANS words of ``symbols`` (each segment with its class's table) into the end of
    ``rans_out``, which holds at least n + 2 * LANES + 2 words; returns where they begin.
    Backward: the decoder reads forward what is pushed here last."""
    n = symbols.shape[0]
    alphabet = freq.shape[1]
    tables, inverse = _encoder_tables(freq, start)
    x0 = x1 = x2 = x3 = np.int64(RANS_L)
    pos = rans_out.shape[0]
    nseg = classes.shape[0]
    for jj in range(nseg):
        j = nseg - 1 - jj
        base = _U(np.int64(classes[j]) * alphabet)
        lo = j * seg_len
        i = min(n, lo + seg_len) - 1
        while i >= lo:
            if (i & 3) == 3 and i - 3 >= lo:  # (a whole group of lanes: see rans_decode)
                x3, pos = _rans_put(x3, np.int64(symbols[_U(i)]), tables, inverse, base, rans_out, pos)
                x2, pos = _rans_put(x2, np.int64(symbols[_U(i - 1)]), tables, inverse, base, rans_out, pos)
                x1, pos = _rans_put(x1, np.int64(symbols[_U(i - 2)]), tables, inverse, base, rans_out, pos)
                x0, pos = _rans_put(x0, np.int64(symbols[_U(i - 3)]), tables, inverse, base, rans_out, pos)
                i -= 4
                continue
            lane = i & 3
            x, pos = _rans_put(_lane_state(lane, x0, x1, x2, x3), np.int64(symbols[_U(i)]), tables, inverse, base,
                               rans_out, pos)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
            i -= 1
    return _flush_states(x0, x1, x2, x3, rans_out, pos)


@inline
def _rans_step(s, lut_step, lut_sym, base, up, up_mask, rans, p):
    """One symbol of the state ``s``: (new state, symbol, new read position). The table holds
    2**precision slots per class (``up`` = PROB_BITS - precision): the slot's frequency and its
    distance from the symbol's start in the step table (both at PROB_BITS), its symbol apart, so
    the state's chain waits for one load only."""
    slot = s & (PROB_SCALE - 1)
    at = base + (_U(slot) >> _U(up))
    entry = np.int64(lut_step[at])
    s = (entry & 0xFFFF) * (s >> PROB_BITS) + (entry >> 16) + (slot & up_mask)
    # renormalise without a branch (taken for about one symbol in six: unpredictable); the word
    # past the end keeps the read in bounds, the caller checks p before it
    need = np.int64(s < RANS_L)
    s = (s << (16 * need)) | (np.int64(rans[p]) & -need)
    return s, lut_sym[at], p + _U(need)


@inline
def _flat_tables(lut_step, lut_sym, up):
    """The lookup tables of :func:`build_lut` flat, their slots per class and the mask of the
    slot's bits below the precision (``up`` = PROB_BITS - precision)."""
    return lut_step.ravel(), lut_sym.ravel(), _U(lut_step.shape[1]), (1 << up) - 1


@inline
def _initial_states(rans):
    return (np.int64(rans[0]) | (np.int64(rans[1]) << 16), np.int64(rans[2]) | (np.int64(rans[3]) << 16),
            np.int64(rans[4]) | (np.int64(rans[5]) << 16), np.int64(rans[6]) | (np.int64(rans[7]) << 16))


@helper
def _final_status(x0, x1, x2, x3, p, end):
    if p > end:
        return ERR_OVERRUN
    if x0 != RANS_L or x1 != RANS_L or x2 != RANS_L or x3 != RANS_L:
        return ERR_BAD_END
    if p != end:
        return ERR_TRAILING
    return OK


@inline
def _raw_near(raw, p, k):
    """:func:`_raw_at` where the eight bytes from the one holding bit ``p`` are known to lie in
    ``raw`` (``k`` <= 56 here)."""
    return np.int64(load_le64(raw, _U(p) >> _U(3)) >> _U(p & 7)) & ((np.int64(1) << k) - 1)


@helper
def _raw_at(raw, p, k):
    """The ``k`` (<= 32) raw bits at bit position ``p`` (the word holding bit p must exist)."""
    # the next word is read whether or not the bits reach into it (no branch); past the last word
    # it is the last again, whose bits the mask then drops: the words need no padding (a copy)
    w = _U(p) >> _U(5)
    after = min(w + _U(1), _U(max(raw.shape[0] - 1, 0)))
    pair = np.uint64(raw[w]) | (np.uint64(raw[after]) << np.uint64(32))
    return np.int64(pair >> _U(p & 31)) & ((np.int64(1) << k) - 1)


# What _decode_segment writes for each element: the symbol, or the float rebuilt from the symbol
# and its raw bits (FAST where the symbol holds TOP_BITS mantissa bits and the raw bits fit 32;
# LOOKUP, the tANS decoder's FAST for 16-bit floats that drop no bit, turns the raw bits into the
# float's by a table of 2**k: a load for five shifts and masks; scratch, a 1M-element chunk of
# MiniLM's word embeddings: bf16 1.60 -> 1.46 ns per element, fp16 1.51 -> 1.34)
SYMBOLS, FAST, GENERAL, LOOKUP = 0, 1, 2, 3


@helper
def _fast_placed(v, placed, W, M, z, low_bits):
    """The float bits of a FAST element: its raw bits ``v`` (sign above the low mantissa bits) and
    its symbol already in place (shifted up by M - TOP_BITS)."""
    return ((v >> low_bits) << (W - 1)) | placed | ((v & ((np.int64(1) << low_bits) - 1)) << z)


@helper
def _fast_value(v, sym, W, M, z, low_bits):
    """:func:`_fast_placed` of the symbol itself."""
    return _fast_placed(v, np.int64(sym) << (M - TOP_BITS), W, M, z, low_bits)


@inline
def _emit(form, out, i, sym, raw, at, W, M, z, low_bits, k):
    if form == SYMBOLS:
        out[_U(i)] = sym
        return
    low_mask = (np.int64(1) << low_bits) - 1
    if form == FAST:
        out[_U(i)] = _fast_value(_raw_at(raw, at, k), sym, W, M, z, low_bits)
        return
    if k > 32:  # (float64)
        v = _raw_at(raw, at, 32) | (_raw_at(raw, at + 32, k - 32) << 32)
    else:
        v = _raw_at(raw, at, k)
    t = _segment_bits(M, z)[0]  # (fewer than TOP_BITS here, or k > 32)
    value = (((v >> low_bits) << (W - 1)) | ((np.int64(sym) >> TOP_BITS) << M)
             | (((np.int64(sym) & ((1 << TOP_BITS) - 1)) >> (TOP_BITS - t)) << (M - t)) | ((v & low_mask) << z))
    out[_U(i)] = value


@helper
def _decode_segment(form, x0, x1, x2, x3, p, end, lo, stop, base, step, sym, up, up_mask, rans, out, raw, bit0,
                    W, M, z, low_bits, k):
    """The elements [lo, stop) of one segment: (states, read position, OK or an error code). The
    element at i has its raw bits at bit0 + (i - lo) * k: every element of a segment has as many."""
    i = lo
    while i < stop:
        # four lanes at once where a whole group lies in the segment: the states' chains then
        # overlap, and the floats are put together while the states wait (p moves at most one word
        # per symbol)
        if (i & 3) == 0 and i + 4 <= stop and p + _U(3) <= end:
            x0, s0, p = _rans_step(x0, step, sym, base, up, up_mask, rans, p)
            x1, s1, p = _rans_step(x1, step, sym, base, up, up_mask, rans, p)
            x2, s2, p = _rans_step(x2, step, sym, base, up, up_mask, rans, p)
            x3, s3, p = _rans_step(x3, step, sym, base, up, up_mask, rans, p)
            at = bit0 + (i - lo) * k
            _emit(form, out, i, s0, raw, at, W, M, z, low_bits, k)
            _emit(form, out, i + 1, s1, raw, at + k, W, M, z, low_bits, k)
            _emit(form, out, i + 2, s2, raw, at + 2 * k, W, M, z, low_bits, k)
            _emit(form, out, i + 3, s3, raw, at + 3 * k, W, M, z, low_bits, k)
            i += 4
            continue
        if p > end:
            return x0, x1, x2, x3, p, ERR_OVERRUN
        lane = i & 3
        x, s, p = _rans_step(_lane_state(lane, x0, x1, x2, x3), step, sym, base, up, up_mask, rans, p)
        x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
        _emit(form, out, i, s, raw, bit0 + (i - lo) * k, W, M, z, low_bits, k)
        i += 1
    return x0, x1, x2, x3, p, OK


@kernel
def rans_decode(rans, seg_len, classes, up, lut_step, lut_sym, symbols):
    """The symbols of a substream (each segment with its class's table); OK or an error code.
    ``lut_step``/``lut_sym`` come from :func:`build_lut` at 2**(PROB_BITS - up) slots per class;
    ``rans`` ends with one word of padding. Reads only inside it; ends with the states where the
    encoder began and every word consumed."""
    n = symbols.shape[0]
    nr = rans.shape[0] - 1  # (the last word is the caller's padding)
    if nr < 2 * LANES:
        return ERR_OVERRUN
    # indices are unsigned from here on: Numba then drops its negative-index wraparound, which
    # costs as much as the arithmetic (the values stay far below 2**63)
    step, sym, slots, up_mask = _flat_tables(lut_step, lut_sym, up)
    no_raw = np.zeros(0, dtype=np.uint32)
    x0, x1, x2, x3 = _initial_states(rans)
    p = _U(2 * LANES)
    end = _U(nr)
    for j in range(classes.shape[0]):
        lo = j * seg_len
        x0, x1, x2, x3, p, err = _decode_segment(SYMBOLS, x0, x1, x2, x3, p, end, lo, min(n, lo + seg_len),
                                                 _U(classes[j]) * slots, step, sym, up, up_mask, rans, symbols,
                                                 no_raw, 0, 16, 7, 0, 0, 0)  # (no floats: W, M, z, ... unused)
        if err != OK:
            return err
    return _final_status(x0, x1, x2, x3, p, end)


@inline
def _raw_words_status(raw, n, seg_len, M, zeros):
    """OK where the raw words of modes 0 and 1 are exactly what the elements' raw bits fill, the
    unused high bits of the last one 0; else an error code."""
    nw = raw.shape[0]
    total = raw_bit_count(n, seg_len, M, zeros)
    if total > 32 * nw:
        return ERR_OVERRUN
    if (total + 31) >> 5 != nw or (total & 31 and raw[nw - 1] >> np.uint32(total & 31)):
        return ERR_TRAILING
    return OK


@kernel
def decode_floats(rans, raw, seg_len, W, M, zeros, classes, up, lut_step, lut_sym, out):
    """Rebuild ``out`` (the float bits) from a substream's rANS words (as :func:`rans_decode`
    takes them) and raw bits (``raw``, no padding: every word is used); OK or an error code."""
    n = out.shape[0]
    nr = rans.shape[0] - 1
    if nr < 2 * LANES:
        return ERR_OVERRUN
    err = _raw_words_status(raw, n, seg_len, M, zeros)
    if err != OK:
        return err
    step, sym, slots, up_mask = _flat_tables(lut_step, lut_sym, up)
    x0, x1, x2, x3 = _initial_states(rans)
    p = _U(2 * LANES)
    end = _U(nr)
    bit0 = np.int64(0)  # (a literal 0 would type the first call of the segment loop apart, and compile it twice)
    for j in range(classes.shape[0]):
        z = np.int64(zeros[j])
        t, low_bits, k = _segment_bits(M, z)
        lo = j * seg_len
        stop = min(n, lo + seg_len)
        base = _U(classes[j]) * slots
        if t == TOP_BITS and k <= 32:  # (all but float64 and segments keeping < 2 mantissa bits)
            x0, x1, x2, x3, p, err = _decode_segment(FAST, x0, x1, x2, x3, p, end, lo, stop, base, step, sym, up,
                                                     up_mask, rans, out, raw, bit0, W, M, z, low_bits, k)
        else:
            x0, x1, x2, x3, p, err = _decode_segment(GENERAL, x0, x1, x2, x3, p, end, lo, stop, base, step, sym, up,
                                                     up_mask, rans, out, raw, bit0, W, M, z, low_bits, k)
        if err != OK:
            return err
        bit0 += (stop - lo) * k
    return _final_status(x0, x1, x2, x3, p, end)


@kernel
def build_lut(freq, start, up, lut_step, lut_sym):
    """The decoder's tables at 2**(PROB_BITS - up) slots per class (``freq`` and ``start`` at
    PROB_BITS, multiples of 2**up): lut_step = freq | (distance from the symbol's start) << 16,
    lut_sym = the symbol."""
    for c in range(freq.shape[0]):
        for sym in range(freq.shape[1]):
            f = np.int64(freq[c, sym])
            b = np.int64(start[c, sym]) >> up
            for slot in range(b, b + (f >> up)):
                lut_step[c, slot] = np.uint32(f | ((slot - b) << (16 + up)))
                lut_sym[c, slot] = sym


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


@inline
def _write_used_tables(syms, freq, buf):
    """The tables' bits into the zeroed ``buf`` (``freq[c, u]``: class c's frequency of symbol
    ``syms[u]``, the symbols increasing; a zero is a symbol the class does not use); returns the
    byte count."""
    state = np.zeros(1, dtype=np.int64)
    for c in range(freq.shape[0]):
        prev = -1
        used = 0
        for u in range(freq.shape[1]):
            if freq[c, u] > 0:
                used += 1
        _put_gamma(buf, state, used)
        for u in range(freq.shape[1]):
            f = np.int64(freq[c, u])
            if f > 0:
                sym = np.int64(syms[u])
                _put_gamma(buf, state, sym - prev)
                _put_gamma(buf, state, f)
                prev = sym
    return (state[0] + 7) >> 3


@kernel
def write_tables(freq, buf):
    """The tables' bits (``freq``: classes x alphabet) into the zeroed ``buf``; returns the byte
    count."""
    return _write_used_tables(np.arange(freq.shape[1]), freq, buf)


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


@inline
def _read_table_row(buf, state, limit, alphabet, scale, syms, freqs):
    """One class's table of :func:`write_tables` at the bit position state[0]: its symbols in
    increasing order into ``syms`` and their frequencies (summing to ``scale``) into ``freqs``;
    returns how many, or ERR_BAD_TABLE. More symbols than ``syms`` holds cannot sum to ``scale``."""
    used = _get_gamma(buf, state, limit)
    if used < 1 or used > alphabet or used > syms.shape[0]:
        return ERR_BAD_TABLE
    sym = -1
    total = 0
    for u in range(used):
        gap = _get_gamma(buf, state, limit)
        f = _get_gamma(buf, state, limit)
        if gap < 1 or f < 1:
            return ERR_BAD_TABLE
        sym += gap
        if sym >= alphabet or total + f > scale:
            return ERR_BAD_TABLE
        syms[u] = sym
        freqs[u] = f
        total += f
    if total != scale:
        return ERR_BAD_TABLE
    return used


@inline
def _read_used_tables(buf, precision, alphabet, syms, freqs, used):
    """Parse tables written by :func:`write_tables` as tANS takes them: each class's symbols in use
    (``syms[c, :used[c]]``, increasing) and their frequencies at ``precision``; returns the byte
    count read, or an error code. Nothing is spent on the symbols a table does not use: mode 3's
    alphabet of 2**14 would cost a small chunk more than its decoding."""
    state = np.zeros(1, dtype=np.int64)
    for c in range(syms.shape[0]):
        got = _read_table_row(buf, state, buf.shape[0] * 8, alphabet, np.int64(1) << precision, syms[c], freqs[c])
        if got < 0:
            return got
        used[c] = got
    return (state[0] + 7) >> 3


@kernel
def read_tables(buf, precision, freq, start):
    """Parse tables written by :func:`write_tables` (frequencies summing to 2**precision) into
    ``freq`` and ``start`` (zeroed, shape (classes, alphabet)) at PROB_BITS, as rANS takes them;
    returns the byte count read, or an error code."""
    K, alphabet = freq.shape[0], freq.shape[1]
    syms = np.empty((K, min(alphabet, np.int64(1) << precision)), dtype=np.int32)
    freqs = np.empty_like(syms)
    used = np.empty(K, dtype=np.int64)
    got = _read_used_tables(buf, precision, alphabet, syms, freqs, used)
    if got < 0:
        return got
    up = PROB_BITS - precision
    for c in range(K):
        total = 0
        for u in range(used[c]):
            freq[c, syms[c, u]] = freqs[c, u] << up
            start[c, syms[c, u]] = total << up
            total += freqs[c, u]
    return got


COST_FRACTION_BITS = 16  # the class choice counts bits in units of 2**-16, in integers: deterministic


def cost_table() -> np.ndarray:
    """cost[f] = the bits of a symbol of frequency f (of 2**PROB_BITS), (PROB_BITS - log2 f) in
    units of 2**-16."""
    f = np.arange(PROB_SCALE + 1, dtype=np.float64)
    f[0] = 1.0
    return np.round((PROB_BITS - np.log2(f)) * (1 << COST_FRACTION_BITS)).astype(np.int64)


@helper
def _gamma_length(v):
    return 2 * _floor_log2(v) + 1


# The gamma code's length of each frequency (1 to PROB_SCALE), looked up: the class choice prices
# every frequency of every class at every precision (scratch: a 3,456-element mode-3 chunk's class
# choice 34 -> 29 us against the loop above).
_FREQ_GAMMA = np.zeros(PROB_SCALE + 1, dtype=np.int64)
for _f in range(1, PROB_SCALE + 1):
    _FREQ_GAMMA[_f] = 2 * (_f.bit_length() - 1) + 1


@kernel
def normalize_row(counts, scale_bits, out):
    """Frequencies summing to 2**scale_bits, at least 1 where a count is: floor(count * scale /
    total), the rare ones raised to 1, the excess taken from the largest (ties: the lower symbol
    first) or a shortfall given to the most frequent symbol."""
    total, best = _sum_and_largest(counts)
    _normalized(counts, total, best, scale_bits, out)


@inline
def _sum_and_largest(counts):
    """(the sum of ``counts``, the index of the first largest)."""
    total = 0
    best = 0
    for i in range(counts.shape[0]):
        total += counts[i]
        if counts[i] > counts[best]:
            best = i
    return total, best


@inline
def _normalized(counts, total, best, scale_bits, out):
    """:func:`normalize_row` of ``counts``, whose sum and first largest :func:`_sum_and_largest`
    found (the class choice normalises each class's row at up to five precisions: found once)."""
    scale = np.int64(1) << scale_bits
    s = 0
    inv = 1.0 / total
    for i in range(counts.shape[0]):
        # floor(count * scale / total) by a multiplication, set right by at most one (count *
        # scale < 2**53: the product is exact, its error below one): a division per symbol was
        # most of the class choice's time
        a = counts[i] * scale
        f = np.int64(a * inv)
        f += np.int64((f + 1) * total <= a) - np.int64(f * total > a)
        if counts[i] > 0 and f == 0:
            f = 1
        out[i] = f
        s += f
    excess = s - scale
    if excess < 0:
        out[best] -= excess
    # The excess comes off the largest first (ties: the lower symbol), down to 1 each. Only a
    # frequency brought down to 1 makes way for the next, so the next is the largest above 1:
    # picked by a scan, not a sort, as the first one nearly always covers the excess and the class
    # choice normalises a hundred rows per chunk.
    while excess > 0:
        idx = -1
        for i in range(out.shape[0]):
            if out[i] > 1 and (idx < 0 or out[i] > out[idx]):
                idx = i
        if idx < 0:
            break
        take = min(excess, np.int64(out[idx]) - 1)
        out[idx] -= take
        excess -= take


TABLE_PRECISIONS = (14, 13, 12, 10, 8)  # what the encoder tries, in order: coarser tables cost fewer bits to send
# Each doubling of the decoder's tables (classes x states) is charged 2**-8 bit per element: the
# larger they are, the farther from the core their lookups go. MiniLM's largest bf16 chunks go from
# 16 x 2**13 to 8 x 2**12 states: in a scratch A/B the model decoded 13% faster for 0.025% more
# bytes (at 2**-6 bit: 0.18%); bench_lossless put its ratio at 1.0114x ZipNN's, from 1.0117x.
TABLE_SIZE_CHARGE_SHIFT = 8


@kernel
def choose_classes(hist16, nseg, costs, max_bits, freq):
    """The class count 2**klog (every class occupied) and the table precision (frequencies summing
    to 2**precision, used as multiples of 2**(PROB_BITS - precision)) that make the chunk smallest,
    frequency tables, class nibbles and gamma-coded tables included, with the tables' size charged
    as ``TABLE_SIZE_CHARGE_SHIFT`` says. The tables, at that precision, go into ``freq`` (zeroed,
    16 x alphabet). Returns (klog, precision)."""
    hist, used_syms = _used_of(hist16)
    klog, precision, chosen = _choose_used(hist, used_syms, nseg, costs, max_bits)
    for c in range(chosen.shape[0]):
        for u in range(used_syms.shape[0]):
            freq[c, used_syms[u]] = chosen[c, u]
    return klog, precision


@kernel
def _used_of(hist16):
    """(the histograms of the used symbols alone, those symbols in increasing order). Only they take
    part in the class choice (a few dozen of an alphabet of up to 8192): an unused symbol gets no
    frequency and no table entry, and dropping it moves no tie."""
    used_syms = np.nonzero(hist16.sum(axis=0))[0]
    hist = np.empty((hist16.shape[0], used_syms.shape[0]), dtype=np.int64)
    for g in range(hist16.shape[0]):
        for u in range(used_syms.shape[0]):
            hist[g, u] = hist16[g, used_syms[u]]
    return hist, used_syms


@kernel
def _choose_used(hist, used_syms, nseg, costs, max_bits):
    """:func:`choose_classes` on the histograms of the used symbols ``used_syms`` alone: (klog,
    precision, the 2**klog tables: each class's frequencies of the used symbols)."""
    groups = hist.shape[0]
    nu = used_syms.shape[0]
    rows = np.zeros((groups, nu), dtype=np.int64)
    tmp = np.zeros(nu, dtype=np.int64)
    counted = np.empty((groups, nu), dtype=np.int64)
    used = np.empty(groups, dtype=np.int64)
    totals = np.empty(groups, dtype=np.int64)
    largest = np.empty(groups, dtype=np.int64)
    best_cost = np.int64(-1)
    best = 0
    best_bits = PROB_BITS
    elements = hist.sum()
    # The search stops where the costs turn up: the precisions from the finest down at the first that
    # costs more than the one before, the class counts once two in a row have not been the best.
    # Over every chunk of EfficientNet-Lite0 and all-MiniLM-L6-v2 in bf16, fp16 and fp32 it chose
    # as the whole search did (1,270 chunks), in less than half the time (the choice of mode 3 and
    # 5's 2**14 symbols took as long as their coding)
    for klog in range(MAX_CLASSES_LOG2 + 1):
        if klog >= 3 and best < klog - 2:
            break
        K = 1 << klog
        per = groups // K
        complete = True
        rows[:K] = 0
        for c in range(K):
            for g in range(c * per, (c + 1) * per):
                for u in range(nu):
                    rows[c, u] += hist[g, u]
            if rows[c].sum() == 0:
                complete = False
        if not complete:
            break
        # Each class's counted symbols alone (``counted[c, :used[c]]``): with many classes a class
        # counts a fraction of the chunk's symbols, and normalize_row, which never gives a symbol
        # without a count a frequency, picks the same ones in the same order from them. A class's
        # table names those symbols at every precision: its count and gaps cost the same bits at
        # each, priced once here.
        most = 0  # (symbols of the fullest class: a table of 2**bits holds at most 2**bits)
        names = 0
        for c in range(K):
            m = 0
            prev = -1
            for u in range(nu):
                if rows[c, u] > 0:
                    counted[c, m] = rows[c, u]
                    m += 1
                    names += _gamma_length(used_syms[u] - prev)
                    prev = used_syms[u]
            used[c] = m
            totals[c], largest[c] = _sum_and_largest(counted[c, :m])
            names += _gamma_length(m)
            most = max(most, m)
        before = np.int64(-1)
        for bits in TABLE_PRECISIONS:
            if most > (1 << bits) or bits > max_bits:
                continue
            cost = np.int64(4 * nseg if klog else 0) << COST_FRACTION_BITS
            cost += (elements * (klog + bits)) << (COST_FRACTION_BITS - TABLE_SIZE_CHARGE_SHIFT)
            table = names
            for c in range(K):
                row = counted[c, :used[c]]
                _normalized(row, totals[c], largest[c], bits, tmp[:row.shape[0]])
                for i in range(row.shape[0]):
                    cost += row[i] * costs[tmp[i] << (PROB_BITS - bits)]
                    table += _FREQ_GAMMA[tmp[i]]
            cost += np.int64(table) << COST_FRACTION_BITS
            if before >= 0 and cost > before:
                break
            before = cost
            if best_cost < 0 or cost < best_cost:
                best_cost = cost
                best = klog
                best_bits = bits
    K = 1 << best
    per = groups // K
    freq = np.zeros((K, nu), dtype=np.int32)
    for c in range(K):
        rows[c] = 0
        for g in range(c * per, (c + 1) * per):
            for u in range(nu):
                rows[c, u] += hist[g, u]
        normalize_row(rows[c], best_bits, tmp)
        for u in range(nu):
            freq[c, u] = tmp[u]
    return best, best_bits, freq


# --- the symbols by tANS (low-bit modes 0 and 1, format version 8) ----------------------------------
# A table-driven ANS: the decoder's state x (0 to R - 1, R = 2**precision) looks up its symbol, a
# bit count and the base of its next state, which that many bits complete. No multiplication sits
# on a state's chain, as it does in rANS, whose four chains bound its decoding: the symbols decode
# about twice as fast, at the same frequency tables (as sent, at most TANS_MAX_BITS of precision).
# Element i is on state i % 4 like the rANS lanes; one bit stream serves the four, element after
# element, each element's bits LSB first. The states are spread over the table by a fixed odd step
# (docs/format.md §4.4), symbol by symbol in increasing order.

TANS_MAX_BITS = 13  # (8 classes of 2**13 states: 256 KB of decoding table, in the L2 cache)
TANS_MIN_BITS = 8
# A decoding entry (uint32): the bit count in bits 0-3, the symbol from bit _tans_symbol_shift(W, M)
# on, the next state's base from bit 19. For 16-bit floats the symbol sits where the float's bits
# hold it, so that masking the entry rebuilds them: a shift fewer per element and the count taken
# by a mask (scratch, a 1M-element chunk of MiniLM's word embeddings, minimum of 41 decodes: bf16
# 1.80 -> 1.60 ns per element, fp16 1.72 -> 1.51; with the unclamped reads of float32's raw bits in
# _tans_segment, fp32 2.27 -> 1.96).
_TANS_BASE_SHIFT = 19


@helper
def _tans_symbol_shift(W, M):
    """Where a decoding entry holds its symbol: in place for 16-bit floats (their symbol's bits end
    at bit 14), else from bit 4 (float64's 13 bits end at 16)."""
    return M - TOP_BITS if W == 16 else 4


@inline
def _tans_spread(freq_row, R, spread):
    """Each state's symbol: the symbols in increasing order, each on freq states, a fixed odd
    step apart (odd, so every state is visited once)."""
    step = (R >> 1) + (R >> 3) + 3
    pos = 0
    for s in range(freq_row.shape[0]):
        for _ in range(freq_row[s]):
            spread[pos] = s
            pos = (pos + step) & (R - 1)


@helper
def _floor_log2(v):
    k = 0
    while (v >> (k + 1)) > 0:
        k += 1
    return k


@inline
def _tans_states(freq_row, R, spread, ys):
    """Each state's symbol (``spread``) and its number ``ys`` among that symbol's states: freq to
    2 freq - 1, in the order of the states. What both coders' tables are made of."""
    _tans_spread(freq_row, R, spread)
    nxt = np.empty(freq_row.shape[0], dtype=np.int64)
    for s in range(freq_row.shape[0]):
        nxt[s] = freq_row[s]
    for x in range(R):
        s = spread[x]
        ys[x] = nxt[s]
        nxt[s] += 1


@kernel
def tans_decode_table(syms, freqs, used, precision, shift, table):
    """table[c, x], the decoder's entry of state x in class c: bit count | symbol << ``shift`` |
    the next state's base << _TANS_BASE_SHIFT (the tables as :func:`_read_used_tables` gives them,
    each class's summing to 2**precision; ``shift``: _tans_symbol_shift of the float format). The
    states are spread over the symbols in use in the order of the encoder's dense tables, so the
    entries are the same."""
    R = 1 << precision
    spread = np.empty(R, dtype=np.int64)  # (a state's symbol: its place among the class's symbols)
    ys = np.empty(R, dtype=np.int64)
    high = np.empty(syms.shape[1], dtype=np.int64)
    for c in range(syms.shape[0]):
        row = freqs[c, :used[c]]
        _tans_states(row, R, spread, ys)
        for u in range(row.shape[0]):
            high[u] = _floor_log2(np.int64(row[u]))
        for x in range(R):
            u, y = spread[x], ys[x]
            nb = precision - high[u] - np.int64(y >> (high[u] + 1) > 0)  # (precision - floor(log2 y))
            table[c, x] = np.uint32(nb | (np.int64(syms[c, u]) << shift) | (((y << nb) - R) << _TANS_BASE_SHIFT))


@kernel
def tans_encode_tables(syms, freq, precision, delta_bits, delta_find, states):
    """The encoder's tables: per class and symbol, what finds the bit count of a state x (R to
    2R - 1): (x + delta_bits) >> 16, and where its next state is: states[c, (x >> bits) + delta_find]
    (``freq[c, u]``: class c's frequency of symbol ``syms[u]`` as sent, the symbols increasing, each
    class's summing to 2**precision; ``states``: R to 2R - 1). Only the symbols a class uses get
    their entries: no other is looked up."""
    R = 1 << precision
    spread = np.empty(R, dtype=np.int64)  # (a state's symbol: its place in ``syms``)
    ys = np.empty(R, dtype=np.int64)
    start = np.empty(freq.shape[1], dtype=np.int64)
    for c in range(freq.shape[0]):
        _tans_states(freq[c], R, spread, ys)
        total = 0
        for u in range(freq.shape[1]):
            f = np.int64(freq[c, u])
            start[u] = total
            total += f
            if f:
                most = precision - _floor_log2(f)  # (bits of a state from f << most on: most, else one fewer)
                delta_bits[c, syms[u]] = (most << 16) - (f << most)
                delta_find[c, syms[u]] = start[u] - f
        for x in range(R):
            u = spread[x]
            states[c, start[u] + ys[x] - freq[c, u]] = x + R


@inline
def _tans_put(x, s, delta_bits, delta_find, states):
    """Push the symbol ``s`` onto the state ``x`` (one class's tables): (new state, the bits given
    off, their count)."""
    nb = (x + np.int64(delta_bits[_U(s)])) >> 16
    return (np.int64(states[_U((x >> nb) + np.int64(delta_find[_U(s)]))]), np.uint64(x & ((np.int64(1) << nb) - 1)),
            nb)


@inline
def _prepend(bits, nb, acc, nacc, wi, out):
    """Put ``nb`` bits before the pending ones (the top ``nacc`` of ``acc``); a full word goes to
    out[wi - 1], stored every time and kept when full (no branch to mispredict)."""
    acc |= (bits << np.uint64(63 - nacc - nb)) << np.uint64(1)  # (two shifts: never one of 64)
    nacc += nb
    out[_U(wi - 1)] = np.uint32(acc >> np.uint64(32))
    full = np.int64(nacc >= 32)
    wi -= full
    acc <<= np.uint64(32 * full)
    nacc -= 32 * full
    return acc, nacc, wi


@kernel
def tans_encode(symbols, seg_len, classes, precision, delta_bits, delta_find, states, out):
    """The bit stream of ``symbols`` (each segment with its class's tables, from
    :func:`tans_encode_tables`) into the end of ``out``, which holds n * precision / 32 + 3 words
    at least. Backward: each element's bits go before the next one's, so the decoder reads forward.
    Returns (the first word, the first bit in it, the four final states)."""
    R = np.int64(1) << precision
    n = symbols.shape[0]
    x0 = x1 = x2 = x3 = R
    acc = np.uint64(0)
    nacc = 0
    wi = out.shape[0]
    nseg = classes.shape[0]
    for jj in range(nseg):
        j = nseg - 1 - jj
        # (the class's rows, not offsets into the whole tables: two registers fewer in the loop)
        db, df, st = delta_bits[classes[j]], delta_find[classes[j]], states[classes[j]]
        lo = j * seg_len
        i = min(n, lo + seg_len) - 1
        while i >= lo:
            if (i & 3) == 3 and i - 3 >= lo:  # (a whole group: see rans_decode)
                x3, v3, n3 = _tans_put(x3, symbols[_U(i)], db, df, st)
                x2, v2, n2 = _tans_put(x2, symbols[_U(i - 1)], db, df, st)
                x1, v1, n1 = _tans_put(x1, symbols[_U(i - 2)], db, df, st)
                x0, v0, n0 = _tans_put(x0, symbols[_U(i - 3)], db, df, st)
                # two elements' bits put together first: the accumulator's chain, the limit, is
                # walked twice a group instead of four times
                acc, nacc, wi = _prepend(v2 | (v3 << np.uint64(n2)), n2 + n3, acc, nacc, wi, out)
                acc, nacc, wi = _prepend(v0 | (v1 << np.uint64(n0)), n0 + n1, acc, nacc, wi, out)
                i -= 4
                continue
            lane = i & 3
            x, v, nb = _tans_put(_lane_state(lane, x0, x1, x2, x3), symbols[_U(i)], db, df, st)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
            acc, nacc, wi = _prepend(v, nb, acc, nacc, wi, out)
            i -= 1
    first_bit = 0
    if nacc:
        wi -= 1
        out[wi] = np.uint32(acc >> np.uint64(32))
        first_bit = 32 - nacc
    return wi, first_bit, x0, x1, x2, x3


@inline
def _tans_entry(flat, base, x):
    """(the entry of state ``x``, its bit count)."""
    e = flat[base + _U(x)]
    return e, np.int64(e & np.uint32(15))


@helper
def _tans_next(entry, bits):
    """The next state: the entry's base completed by its bits."""
    return np.int64(entry >> np.uint32(_TANS_BASE_SHIFT)) + bits


@helper
def _tans_symbol(entry, W, M):
    """The entry's symbol."""
    return np.int64(entry >> np.uint32(_tans_symbol_shift(W, M))) & ((np.int64(1) << (W - 1 - M + TOP_BITS)) - 1)


@helper
def _tans_placed(entry, W, M):
    """The entry's symbol where a FAST element's bits hold it (at M - TOP_BITS): for 16-bit floats
    the entry masked."""
    sh = _tans_symbol_shift(W, M)
    field = ((np.int64(1) << (W - 1 - M + TOP_BITS)) - 1) << sh
    return (np.int64(entry) & field) << (M - TOP_BITS - sh)


@inline
def _peek64(words, pos):
    """The stream's bits from bit ``pos`` on (57 of them at least; the eight bytes from the one
    holding bit pos must lie in the words)."""
    return load_le64(words, _U(pos) >> _U(3)) >> _U(pos & 7)


@helper
def _groups_before_end(pos, total):
    """How many whole groups can be read from bit ``pos`` (``pos + 64 <= total``) before one could
    reach the last eight bytes: each reads at most 4 * TANS_MAX_BITS bits. The group loops check
    their bounds once for that many, not once per group (a register freed: scratch, MiniLM's bf16
    word embeddings 1.43 -> 1.30-1.32 ns per element, with the eight-byte reads)."""
    return (total - 64 - pos) // (4 * TANS_MAX_BITS) + 1


@inline
def _tans_group(flat, base, x0, x1, x2, x3, words, pos):
    """The four states' next symbols (a whole group: eight bytes from the one holding bit ``pos``
    must exist): (their entries, the new states, the new bit position)."""
    e0, n0 = _tans_entry(flat, base, x0)
    e1, n1 = _tans_entry(flat, base, x1)
    e2, n2 = _tans_entry(flat, base, x2)
    e3, n3 = _tans_entry(flat, base, x3)
    v = _peek64(words, pos)
    x0 = _tans_next(e0, np.int64(v & _U((1 << n0) - 1)))
    v >>= _U(n0)
    x1 = _tans_next(e1, np.int64(v & _U((1 << n1) - 1)))
    v >>= _U(n1)
    x2 = _tans_next(e2, np.int64(v & _U((1 << n2) - 1)))
    v >>= _U(n2)
    x3 = _tans_next(e3, np.int64(v & _U((1 << n3) - 1)))
    return e0, e1, e2, e3, x0, x1, x2, x3, pos + n0 + n1 + n2 + n3


@inline
def _tans_one(form, i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw, at, W, M, z, low_bits, k):
    """Element i alone: (states, bit position, OK or an error code)."""
    lane = i & 3
    e, nb = _tans_entry(flat, base, _lane_state(lane, x0, x1, x2, x3))
    if pos + nb > total:
        return x0, x1, x2, x3, pos, ERR_OVERRUN
    x = _tans_next(e, _raw_at(words, pos, nb))
    x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
    _emit(form, out, i, _tans_symbol(e, W, M), raw, at, W, M, z, low_bits, k)
    return x0, x1, x2, x3, pos + nb, OK


@helper
def _tans_segment(form, x0, x1, x2, x3, pos, total, lo, stop, base, flat, words, out, raw, bit0, W, M, z, lut):
    """The elements [lo, stop) of one segment: (states, bit position, OK or an error code); ``lut``:
    the float bits of each element's raw bits, for form LOOKUP."""
    t, low_bits, k = _segment_bits(M, z)
    one = FAST if form == LOOKUP else form  # (the elements outside whole groups)
    i = lo
    while i < stop and i & 3:  # (up to the first whole group)
        x0, x1, x2, x3, pos, err = _tans_one(one, i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw,
                                             bit0 + (i - lo) * k, W, M, z, low_bits, k)
        if err != OK:
            return x0, x1, x2, x3, pos, err
        i += 1
    groups_end = i + ((stop - i) & ~3)
    # whole groups while eight bytes are left to read (at most 52 bits a group) and the group's raw
    # bits and eight bytes from the last one's are there (they start below raw_limit: a bound on i,
    # worked out once)
    raw_limit = 32 * (raw.shape[0] - 2) - 4 * k
    groups_end = min(groups_end, lo + max(0, (raw_limit - bit0 + k - 1) // k))
    while i < groups_end and pos + 64 <= total:
        run_end = min(groups_end, i + 4 * _groups_before_end(pos, total))
        while i < run_end:
            e0, e1, e2, e3, x0, x1, x2, x3, pos = _tans_group(flat, base, x0, x1, x2, x3, words, pos)
            at = bit0 + (i - lo) * k
            if form == FAST or form == LOOKUP:  # (k <= 32: float32's FAST; 16 at most for LOOKUP)
                # the raw bits of four elements in one read while they fit (of two up to 28 bits
                # each): the reads, not the states, are the limit here
                mask = (np.int64(1) << k) - 1
                if k <= 8:
                    r = _raw_near(raw, at, 4 * k)
                    r01, r23 = r & ((np.int64(1) << (2 * k)) - 1), r >> (2 * k)
                    r0, r1, r2, r3 = r01 & mask, r01 >> k, r23 & mask, r23 >> k
                elif k <= 28:
                    r01, r23 = _raw_near(raw, at, 2 * k), _raw_near(raw, at + 2 * k, 2 * k)
                    r0, r1, r2, r3 = r01 & mask, r01 >> k, r23 & mask, r23 >> k
                else:
                    r0, r1 = _raw_near(raw, at, k), _raw_near(raw, at + k, k)
                    r2, r3 = _raw_near(raw, at + 2 * k, k), _raw_near(raw, at + 3 * k, k)
                if form == LOOKUP:
                    out[_U(i)] = np.int64(lut[_U(r0)]) | _tans_placed(e0, W, M)
                    out[_U(i + 1)] = np.int64(lut[_U(r1)]) | _tans_placed(e1, W, M)
                    out[_U(i + 2)] = np.int64(lut[_U(r2)]) | _tans_placed(e2, W, M)
                    out[_U(i + 3)] = np.int64(lut[_U(r3)]) | _tans_placed(e3, W, M)
                else:
                    out[_U(i)] = _fast_placed(r0, _tans_placed(e0, W, M), W, M, z, low_bits)
                    out[_U(i + 1)] = _fast_placed(r1, _tans_placed(e1, W, M), W, M, z, low_bits)
                    out[_U(i + 2)] = _fast_placed(r2, _tans_placed(e2, W, M), W, M, z, low_bits)
                    out[_U(i + 3)] = _fast_placed(r3, _tans_placed(e3, W, M), W, M, z, low_bits)
            else:
                _emit(form, out, i, _tans_symbol(e0, W, M), raw, at, W, M, z, low_bits, k)
                _emit(form, out, i + 1, _tans_symbol(e1, W, M), raw, at + k, W, M, z, low_bits, k)
                _emit(form, out, i + 2, _tans_symbol(e2, W, M), raw, at + 2 * k, W, M, z, low_bits, k)
                _emit(form, out, i + 3, _tans_symbol(e3, W, M), raw, at + 3 * k, W, M, z, low_bits, k)
            i += 4
    while i < stop:  # (the segment's last elements, or the stream's last bits)
        x0, x1, x2, x3, pos, err = _tans_one(one, i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw,
                                             bit0 + (i - lo) * k, W, M, z, low_bits, k)
        if err != OK:
            return x0, x1, x2, x3, pos, err
        i += 1
    return x0, x1, x2, x3, pos, OK


@kernel
def decode_floats_tans(words, first_bit, x0, x1, x2, x3, raw, seg_len, W, M, zeros, classes, precision, table,
                       out):
    """Rebuild ``out`` (the float bits) from a substream's tANS bits (``words`` with one word of
    padding, the first ``first_bit`` < 32 bits of the first word unused; x0..x3 the decoder's
    initial states, each below 2**precision: the front checks both) and raw bits (as
    :func:`decode_floats` takes them); OK or an error code. Reads only inside the words: a read
    waits until its bits are known to be there."""
    n = out.shape[0]
    R = np.int64(1) << precision
    total = 32 * (words.shape[0] - 1)
    err = _raw_words_status(raw, n, seg_len, M, zeros)
    if err != OK:
        return err
    flat = table.ravel()
    pos = np.int64(first_bit)
    bit0 = np.int64(0)  # (a literal 0 would type the first call of the segment loop apart, and compile it twice)
    # LOOKUP's table for 16-bit floats dropping no bit: the sign and low mantissa bits of each k raw bits
    lut = np.empty((np.int64(1) << (M - TOP_BITS + 1)) if W == 16 else 0, dtype=np.uint16)
    for v in range(lut.shape[0]):
        lut[v] = _fast_placed(np.int64(v), 0, 16, M, 0, M - TOP_BITS)
    for j in range(classes.shape[0]):
        z = np.int64(zeros[j])
        t, low_bits, k = _segment_bits(M, z)
        lo = j * seg_len
        stop = min(n, lo + seg_len)
        base = _U(classes[j]) * _U(R)
        # (constant widths where they are common, as in encode_kernel: 10-15% faster)
        if z == 0 and W == 16 and M == 7:
            x0, x1, x2, x3, pos, err = _tans_segment(LOOKUP, x0, x1, x2, x3, pos, total, lo, stop, base, flat, words,
                                                     out, raw, bit0, 16, 7, 0, lut)
        elif z == 0 and W == 16 and M == 10:
            x0, x1, x2, x3, pos, err = _tans_segment(LOOKUP, x0, x1, x2, x3, pos, total, lo, stop, base, flat, words,
                                                     out, raw, bit0, 16, 10, 0, lut)
        elif z == 0 and W == 32 and M == 23:
            x0, x1, x2, x3, pos, err = _tans_segment(FAST, x0, x1, x2, x3, pos, total, lo, stop, base, flat, words,
                                                     out, raw, bit0, 32, 23, 0, lut)
        elif t == TOP_BITS and k <= 32:  # (as in decode_floats)
            x0, x1, x2, x3, pos, err = _tans_segment(FAST, x0, x1, x2, x3, pos, total, lo, stop, base, flat, words,
                                                     out, raw, bit0, W, M, z, lut)
        else:
            x0, x1, x2, x3, pos, err = _tans_segment(GENERAL, x0, x1, x2, x3, pos, total, lo, stop, base, flat,
                                                     words, out, raw, bit0, W, M, z, lut)
        if err != OK:
            return err
        bit0 += (stop - lo) * k
    if x0 or x1 or x2 or x3:
        return ERR_BAD_END
    if pos != total:
        return ERR_TRAILING
    return OK


# The whole tANS substream in one call: the front of small tensors' chunks, parsed field by field
# in Python, cost as much as decoding them. Its errors come back as a code and two details.
ERR_SHORT = -7  # the substream ends inside a field: detail[0] is its index in TANS_FIELDS
ERR_DROPS = -8  # a segment drops more low bits than the mantissa has
ERR_CLASS_COUNT = -9  # detail[0]: the class count's log2, beyond MAX_CLASSES_LOG2
ERR_PRECISION = -10  # detail[0]: the tables' precision, outside TANS_MIN_BITS to TANS_MAX_BITS
ERR_CLASS = -11  # detail: a segment's class, the class count
ERR_TABLE_BYTES = -12  # the tables end before their declared size
ERR_STATE = -13  # detail: an initial state, the table's size
ERR_FIRST_BIT = -14  # detail[0]: the first bit's place, beyond a word
ERR_BEFORE_FIRST = -15  # bits set before the first bit, or no word to hold it
ERR_AFTER_RAW = -16  # detail[0]: bytes after the raw bits
TANS_FIELDS = ("low-bit count", "low-bit counts", "class count and table precision", "classes", "table size",
               "tables", "coder states", "coder size", "coder words", "raw bits")


@helper
def class_tables_at(data, pos, alphabet, min_bits, max_bits, classes, detail):
    """A substream's class count and precision, its segments' classes (into ``classes``) and
    its tables from byte ``pos`` of ``data``, each field checked against the bytes before it is
    read: (the byte after the tables, or an error code with its details in ``detail``; klog,
    precision, each class's used symbols, their frequencies and count as
    :func:`_read_used_tables` gives them)."""
    size = data.shape[0]
    nseg = classes.shape[0]
    none, nothing = np.empty((0, 0), dtype=np.int32), np.empty(0, dtype=np.int64)  # (what an error returns)
    if pos + 2 > size:
        detail[0] = 2
        return ERR_SHORT, 0, 0, none, none, nothing
    klog, precision = np.int64(data[pos]), np.int64(data[pos + 1])
    pos += 2
    if klog > MAX_CLASSES_LOG2:
        detail[0] = klog
        return ERR_CLASS_COUNT, 0, 0, none, none, nothing
    if precision < min_bits or precision > max_bits:
        detail[0] = precision
        return ERR_PRECISION, 0, 0, none, none, nothing
    if klog:
        packed = (nseg + 1) >> 1
        if pos + packed > size:
            detail[0] = 3
            return ERR_SHORT, 0, 0, none, none, nothing
        for j in range(nseg):
            c = (data[pos + (j >> 1)] >> (4 * (j & 1))) & 15
            if c >= 1 << klog:
                detail[0], detail[1] = c, 1 << klog
                return ERR_CLASS, 0, 0, none, none, nothing
            classes[j] = c
        pos += packed
    if pos + 4 > size:
        detail[0] = 4
        return ERR_SHORT, 0, 0, none, none, nothing
    table_bytes = _u32_at(data, pos)
    pos += 4
    if pos + table_bytes > size:
        detail[0] = 5
        return ERR_SHORT, 0, 0, none, none, nothing
    syms = np.empty((np.int64(1) << klog, min(alphabet, np.int64(1) << precision)), dtype=np.int32)
    freqs = np.empty_like(syms)
    used = np.empty(np.int64(1) << klog, dtype=np.int64)
    got = _read_used_tables(data[pos:pos + table_bytes], precision, alphabet, syms, freqs, used)
    if got < 0:
        return got, 0, 0, none, none, nothing
    if got != table_bytes:
        return ERR_TABLE_BYTES, 0, 0, none, none, nothing
    return pos + table_bytes, klog, precision, syms, freqs, used


@inline
def counted_at(data, pos, unit, detail):
    """The coder's word count at byte ``pos`` and its words of ``unit`` bytes after it (fields 7
    and 8 of TANS_FIELDS), checked against the bytes: (the count, the first word's byte), or
    (ERR_SHORT, pos) with the field in ``detail``."""
    if pos + 4 > data.shape[0]:
        detail[0] = 7
        return ERR_SHORT, pos
    count = _u32_at(data, pos)
    if pos + 4 + unit * count > data.shape[0]:
        detail[0] = 8
        return ERR_SHORT, pos
    return count, pos + 4


@inline
def _u32_at(data, pos):
    return (np.int64(data[pos]) | (np.int64(data[pos + 1]) << 8) | (np.int64(data[pos + 2]) << 16)
            | (np.int64(data[pos + 3]) << 24))


@kernel
def decode_tans_substream(data, n, seg_len, W, M, out, detail):
    """Decode a whole substream of low-bit mode 0 or 1 with its symbols by tANS (``data``: its
    bytes, the mode byte first) into ``out`` (n float bits); OK or an error code, with its details
    in ``detail``. Every field is checked against the bytes before it is read or allocated."""
    size = data.shape[0]
    nseg = (n + seg_len - 1) // seg_len
    mode = data[0] & 0x7F
    pos = 1
    zeros = np.empty(nseg, dtype=np.uint8)
    tz = mode == TZ_MODE  # (float32 only: the front checks)
    if tz:
        zeros[:] = 0
    elif mode == 0:
        if pos + 1 > size:
            detail[0] = 0
            return ERR_SHORT
        zeros[:] = data[pos]
        pos += 1
    else:
        if pos + nseg > size:
            detail[0] = 1
            return ERR_SHORT
        zeros[:] = data[pos:pos + nseg]
        pos += nseg
    for j in range(nseg):
        if zeros[j] > M:
            return ERR_DROPS
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS + (TZ_BITS if tz else 0))
    classes = np.zeros(nseg, dtype=np.uint8)
    pos, klog, precision, syms, freqs, used = class_tables_at(data, pos, alphabet, TANS_MIN_BITS, TANS_MAX_BITS,
                                                              classes, detail)
    if pos < 0:
        return pos
    R = np.int64(1) << precision
    if pos + 9 > size:
        detail[0] = 6
        return ERR_SHORT
    first_bit = np.int64(data[pos])
    x = np.empty(4, dtype=np.int64)
    for lane in range(4):
        x[lane] = np.int64(data[pos + 1 + 2 * lane]) | (np.int64(data[pos + 2 + 2 * lane]) << 8)
        if x[lane] >= R:
            detail[0], detail[1] = x[lane], R
            return ERR_STATE
    pos += 9
    if first_bit >= 32:
        detail[0] = first_bit
        return ERR_FIRST_BIT
    count, pos = counted_at(data, pos, 4, detail)
    if count < 0:
        return count
    raw_at = pos + 4 * count
    if tz:
        nraw, short = tz_raw_words(size, raw_at, n)
    else:
        nraw = (raw_bit_count(n, seg_len, M, zeros) + 31) >> 5
        short = raw_at + 4 * nraw > size
    if short:
        detail[0] = 9
        return ERR_SHORT
    if raw_at + 4 * nraw != size:
        detail[0] = size - raw_at - 4 * nraw
        return ERR_AFTER_RAW
    if n == 0:  # (no element: no bits, and the states where the encoder starts)
        return ERR_TRAILING if count else (ERR_BAD_END if x.any() or first_bit else OK)
    # the decoder reads one word past its bits, to drop it: the raw words' first (there is one, as
    # every element has its sign), so the words are read where they are
    words = data[pos:raw_at + 4].view(np.uint32)
    if first_bit and (count < 1 or words[0] & np.uint32((1 << first_bit) - 1)):
        return ERR_BEFORE_FIRST
    raw = data[raw_at:size].view(np.uint32)
    table = np.empty((np.int64(1) << klog, R), dtype=np.uint32)
    tans_decode_table(syms, freqs, used, precision, _tans_symbol_shift(W, M), table)
    if tz:
        return decode_tz(words, first_bit, x[0], x[1], x[2], x[3], raw, seg_len, classes, precision, table, out)
    return decode_floats_tans(words, first_bit, x[0], x[1], x[2], x[3], raw, seg_len, W, M, zeros, classes, precision,
                              table, out)


@kernel
def decode_tans_chunks(data, starts, counts, seg_lens, W, M, out, detail):
    """Substreams of :func:`decode_tans_substream` one after another: substream j is
    ``data[starts[j]:starts[j + 1]]``, its ``counts[j]`` floats go to ``out`` after the ones
    before. Returns -1, or the first that fails, its error code in ``detail[2]`` (the others as
    that kernel sets them). (``starts``, ``counts`` and ``seg_lens``: int64; the caller sizes ``out``.)"""
    at = 0
    for j in range(counts.shape[0]):
        n = counts[j]
        status = decode_tans_substream(data[starts[j]:starts[j + 1]], n, seg_lens[j], W, M, out[at:at + n], detail)
        if status != OK:
            detail[2] = status
            return j
        at += n
    return -1


@inline
def put_u32(out, pos, v):
    for b in range(4):
        out[pos + b] = np.uint8((v >> (8 * b)) & 0xFF)
    return pos + 4


@kernel
def _used_histogram(symbols, seg_len, classes16, alphabet):
    """(each class's counts of the used symbols, the used symbols in increasing order): for a chunk
    too small to pay for clearing and adding up the 16 whole-alphabet histograms."""
    n = symbols.shape[0]
    # The symbols in use, increasing, from a byte per symbol, scanned eight at a time (a bit per
    # symbol chained each element's update to the last one's in the same word: 1.19 -> 0.76 ns per
    # element, with the places below in uint16). Only the used symbols' places are written and read.
    seen = np.zeros(max(alphabet, 8), dtype=np.uint8)
    for i in range(n):
        seen[symbols[_U(i)]] = 1
    found = np.empty(min(n, alphabet), dtype=np.int64)
    slot = np.empty(alphabet, dtype=np.uint16)  # (the used symbols' places: in L1 for 2**14 symbols)
    u = 0
    eights = seen.view(np.uint64)
    for w in range(eights.shape[0]):
        if eights[w]:
            for sym in range(8 * w, 8 * w + 8):
                if seen[sym]:
                    found[u] = sym
                    slot[sym] = u
                    u += 1
    used_syms = found[:u]
    hist = np.zeros((np.int64(1) << MAX_CLASSES_LOG2, used_syms.shape[0]), dtype=np.int64)
    for j in range(classes16.shape[0]):
        c = np.int64(classes16[j])
        for i in range(j * seg_len, min(n, (j + 1) * seg_len)):
            hist[c, np.int64(slot[symbols[_U(i)]])] += 1
    return hist, used_syms


@helper
def table_bytes_most(classes, used):
    """The most bytes :func:`classes_and_tables` writes for ``classes`` tables over ``used`` (class,
    symbol) pairs: gamma codes, a count per class, then a gap and a frequency per pair."""
    return 8 + 4 * classes + 7 * used


@helper
def raw_words_most(n, M):
    """The raw words of ``n`` floats of ``M`` mantissa bits split with no low bit dropped (the most
    any split keeps), and a word more for the split's last store."""
    return ((n * (M - TOP_BITS + 1) + 31) >> 5) + 1


@helper
def _tans_work_parts(n, seg_len, W, M):
    """The bytes of each array :func:`encode_tans_substream` carves from its work memory, in order:
    symbols, raw words (for no low bit dropped: the most), histograms, partial histograms, coded
    words (at the largest precision) and the substream (bounded: every segment's low-bit count, the
    largest tables)."""
    nseg = (n + seg_len - 1) // seg_len
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS)
    classes = np.int64(1) << MAX_CLASSES_LOG2
    raw_words = raw_words_most(n, M)
    # (tANS words at the largest precision; mode 4 codes its words into its substream's own array)
    coded_words = n * TANS_MAX_BITS // 32 + 3
    tables = table_bytes_most(classes, classes * alphabet)
    out = 1 + nseg + 2 + ((nseg + 1) >> 1) + 4 + tables + 4 * 64 + 4 + 4 * coded_words + 4 * raw_words  # (64 states)
    return 2 * n, 4 * raw_words, 8 * classes * alphabet, 16 * classes * alphabet, 4 * coded_words, out


@helper
def _work_total(parts):
    """The bytes of work memory that holds ``parts``, each carved at an 8-byte boundary."""
    total = 0
    for nbytes in parts:
        total += (nbytes + 7) & ~7
    return total


@kernel
def tans_work_bytes(n, seg_len, W, M):
    """The bytes of work memory :func:`encode_tans_substream` takes for ``n`` elements."""
    return _work_total(_tans_work_parts(n, seg_len, W, M))


@inline
def _carve(work, at, nbytes):
    """(work[at:at + nbytes], the next place: 8-byte aligned)."""
    return work[at:at + nbytes], at + ((nbytes + 7) & ~7)


@inline
def classes_and_tables(classes16, klog, used_syms, sent):
    """(each segment's class of the 2**klog, the tables' bytes, their count) of the chosen tables
    ``sent`` over ``used_syms``."""
    nseg = classes16.shape[0]
    K = sent.shape[0]
    classes = np.empty(nseg, dtype=np.uint8)
    for j in range(nseg):
        classes[j] = classes16[j] >> (MAX_CLASSES_LOG2 - klog)
    used = 0
    for c in range(K):
        for u in range(sent.shape[1]):
            used += sent[c, u] > 0
    tables = np.zeros(table_bytes_most(K, used), dtype=np.uint8)
    table_bytes = _write_used_tables(used_syms, sent, tables)
    return classes, tables, table_bytes


@inline
def _tans_code(symbols, seg_len, classes16, klog, precision, used_syms, sent, alphabet, work):
    """The symbols (of ``alphabet``) by tANS with the chosen tables ``sent`` (2**klog classes at
    ``precision``, over the symbols ``used_syms``, as :func:`_choose_used` gives them): (segment
    classes, table bytes, their count, the first coded word, the first bit, the four final states,
    the coded words, carved from ``work``)."""
    K = sent.shape[0]
    classes, tables, table_bytes = classes_and_tables(classes16, klog, used_syms, sent)
    R = np.int64(1) << precision
    # (narrow tables: a class's states, at 2**13, then take 16 KB and stay in the L1 cache; by
    # symbol, but only the symbols each class uses are written and read: mode 3's alphabet of 2**14
    # would cost a small chunk more to clear than to code)
    delta_bits = np.empty((K, alphabet), dtype=np.int32)
    delta_find = np.empty((K, alphabet), dtype=np.int32)
    states = np.zeros((K, R), dtype=np.uint16)
    tans_encode_tables(used_syms, sent, precision, delta_bits, delta_find, states)
    coded = work.view(np.uint32)[:symbols.shape[0] * precision // 32 + 3]
    begin, first_bit, x0, x1, x2, x3 = tans_encode(symbols, seg_len, classes, precision, delta_bits, delta_find,
                                                   states, coded)
    return classes, tables, table_bytes, begin, first_bit, (x0 - R, x1 - R, x2 - R, x3 - R), coded


@helper
def _tans_fields_size(klog, nseg, table_bytes, count, nraw):
    """The bytes of a tANS substream after its head (see :func:`_put_tans_fields`)."""
    return 2 + (((nseg + 1) >> 1) if klog else 0) + 4 + table_bytes + 9 + 4 + 4 * count + 4 * nraw


@inline
def put_class_tables(out, pos, klog, precision, classes, tables, table_bytes):
    """The class count, precision, class nibbles, table size and tables from ``out[pos]`` on; the
    next place."""
    nseg = classes.shape[0]
    out[pos] = klog
    out[pos + 1] = precision
    pos += 2
    if klog:
        for j in range(0, nseg, 2):
            hi = classes[j + 1] if j + 1 < nseg else 0
            out[pos + (j >> 1)] = classes[j] | (hi << 4)
        pos += (nseg + 1) >> 1
    pos = put_u32(out, pos, table_bytes)
    out[pos:pos + table_bytes] = tables[:table_bytes]
    return pos + table_bytes


@inline
def _put_tans_fields(out, pos, klog, precision, classes, tables, table_bytes, first_bit, xs, coded, begin, raw, nraw):
    """Everything of a tANS substream after its head, from ``out[pos]`` to its end: class count,
    precision, class nibbles, tables, first bit, the decoder's initial states ``xs``, the coded words
    from ``begin`` and the ``nraw`` raw words."""
    pos = put_class_tables(out, pos, klog, precision, classes, tables, table_bytes)
    out[pos] = first_bit
    pos += 1
    for x in xs:
        out[pos] = x & 0xFF
        out[pos + 1] = x >> 8
        pos += 2
    count = coded.shape[0] - begin
    pos = put_u32(out, pos, count)
    # (the words little-endian as they are in memory: Numba runs on little-endian machines only)
    copy_bytes(out, pos, coded, 4 * begin, 4 * count)
    pos += 4 * count
    copy_bytes(out, pos, raw, 0, 4 * nraw)


@inline
def split_and_choose(words, seg_len, W, M, zeros, classes16, costs, max_bits, work, raw_into):
    """The front of a substream's encoding: the split into symbols and raw bits, the histograms and
    the tables' choice (``zeros``, ``classes16``: as :func:`encode_tans_substream` takes them).
    Returns (zeros, classes16, symbols, raw words, their count, klog, precision, the used symbols,
    the chosen tables, the coded words' bytes, the next free byte of ``work``), all carved from
    ``work`` (:func:`tans_work_bytes` of it) but the raw words, which go into ``raw_into`` (uint32,
    room for :func:`raw_words_most` of them) unless it is empty."""
    n = words.shape[0]
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS)
    nclasses = np.int64(1) << MAX_CLASSES_LOG2
    parts = _tans_work_parts(n, seg_len, W, M)
    b, at = _carve(work, 0, parts[0])
    symbols = b.view(np.uint16)
    if zeros.shape[0] == 0:
        nseg = (n + seg_len - 1) // seg_len
        zeros = np.zeros(nseg, dtype=np.uint8)  # (until the split finds them: raw sized for no bit dropped)
        mean_exponent = np.empty(nseg, dtype=np.float64)
        classes16 = np.empty(nseg, dtype=np.uint8)
    else:
        nseg = zeros.shape[0]
        mean_exponent = np.empty(0, dtype=np.float64)
    b, at = _carve(work, at, parts[1])
    raw = raw_into if raw_into.shape[0] else b.view(np.uint32)
    raw = raw[:((raw_bit_count(n, seg_len, M, zeros) + 31) >> 5) + 1]
    nraw = encode_kernel(words, seg_len, W, M, zeros, symbols, raw, mean_exponent)
    if mean_exponent.shape[0]:
        rank_classes(mean_exponent, classes16, seg_len, n)
    b, at = _carve(work, at, parts[2])
    hist16 = b.view(np.int64).reshape((nclasses, alphabet))
    b, at = _carve(work, at, parts[3])
    part = b.view(np.uint32)
    if n < PARTIAL_HISTOGRAMS_FROM:
        hist, used_syms = _used_histogram(symbols, seg_len, classes16, alphabet)
    else:
        hist16[:] = 0
        part[:] = 0
        _histogram_into(symbols, seg_len, classes16, hist16, part)
        hist, used_syms = _used_of(hist16)
    klog, precision, sent = _choose_used(hist, used_syms, nseg, costs, max_bits)
    b, at = _carve(work, at, parts[4])
    return zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent, b, at


@kernel
def encode_tans_substream(words, seg_len, W, M, zeros, classes16, costs, work):
    """The whole substream of low-bit mode 0 or 1 (mode 0 where every segment drops as many low
    bits) with its symbols by tANS, as bytes (``zeros``: each segment's low bits zero,
    ``classes16``: its class of 16, both as :func:`segment_classes` finds them, or both empty:
    found here, during the split): what :func:`decode_tans_substream` reads. Its large arrays are
    carved from ``work`` (uint8, :func:`tans_work_bytes` of them), which the caller keeps from chunk
    to chunk: buffers of megabytes allocated for every chunk cost their first touch, page by page,
    every time. Returns the substream, a view into ``work``."""
    zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent, b, at = split_and_choose(
        words, seg_len, W, M, zeros, classes16, costs, TANS_MAX_BITS, work, np.empty(0, dtype=np.uint32))
    return tans_substream(W, M, seg_len, zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent, b, at,
                          work)


@inline
def _appended(out, pos, sub):
    """``sub`` written into ``out`` at ``pos`` (grown if it must be): (out, the next place)."""
    end = pos + sub.shape[0]
    if end > out.shape[0]:  # (the tables of a chunk of a few elements outweigh its values)
        grown = np.empty(max(end, 2 * out.shape[0]), dtype=np.uint8)
        copy_bytes(grown, 0, out, 0, pos)
        out = grown
    copy_bytes(out, pos, sub, 0, sub.shape[0])
    return out, end


@kernel
def encode_tans_chunks(words, starts, seg_lens, W, M, costs, work, ends):
    """:func:`encode_tans_substream` of many chunks of 16-bit floats (their segments' statistics
    found as they split) in one call: chunk j is ``words[starts[j]:starts[j + 1]]``, of segments of
    ``seg_lens[j]``, and its substream ends at ``ends[j]`` of the bytes returned, after the one
    before it. ``work`` holds the largest chunk's :func:`tans_work_bytes`. (A model's small tensors
    cost more in the Python around each call than in their kernels.)"""
    none = np.empty(0, dtype=np.uint8)
    out = np.empty(max(np.int64(64), 3 * (starts[-1] - starts[0])), dtype=np.uint8)
    pos = 0
    for j in range(seg_lens.shape[0]):
        sub = encode_tans_substream(words[starts[j]:starts[j + 1]], seg_lens[j], W, M, none, none, costs, work)
        out, pos = _appended(out, pos, sub)
        ends[j] = pos
    return out[:pos]


@inline
def tans_substream(W, M, seg_len, zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent, coded_bytes,
                   at, work):
    """The substream of modes 0 and 1 from what :func:`split_and_choose` returns, carved from
    ``work`` at ``at``."""
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS)
    nseg = zeros.shape[0]
    classes, tables, table_bytes, begin, first_bit, xs, coded = _tans_code(symbols, seg_len, classes16, klog, precision,
                                                                           used_syms, sent, alphabet, coded_bytes)
    same = True
    for j in range(1, nseg):
        same = same and zeros[j] == zeros[0]
    head = 2 if nseg and same else 1 + nseg
    out, at = _carve(work, at, head + _tans_fields_size(klog, nseg, table_bytes, coded.shape[0] - begin, nraw))
    out[0] = 0x80 | (0 if head == 2 else 1)
    if head == 2:
        out[1] = zeros[0]
    else:
        out[1:head] = zeros
    _put_tans_fields(out, head, klog, precision, classes, tables, table_bytes, first_bit, xs, coded, begin, raw, nraw)
    return out


# --- low-bit mode 2: trailing zeros by exponent ---------------------------------------------------
# Some float32 weights sit on a grid finer than any one octave (products and sums of values rounded
# elsewhere): below the top bits, the mantissa's trailing zeros then grow as the exponent falls, one
# per octave, element by element, where no whole segment has a zero bit to drop. Each element's
# count of trailing zeros in its L = M - TOP_BITS low bits (L for none set) is a second symbol, coded
# on the element's state right after its first with the table of its exponent's context: the
# distance below the chunk's top exponent, 0 to 15. Its raw bits are the sign, then the bits above
# the lowest set one (that one is implied).

TRAILING_CONTEXTS = 16

@helper
def _ctz(x):
    """Trailing zero bits of the nonzero uint64 ``x``."""
    return np.int64(trailing_zeros(x))


@helper
def _trailing_parts(w, W, M):
    """(symbol, trailing zeros t, raw bits, raw bit count) of the float bits ``w`` (uint64)."""
    L = M - TOP_BITS
    s = (w >> np.uint64(W - 1)) & np.uint64(1)
    e = np.int64((w >> np.uint64(M)) & np.uint64((1 << (W - 1 - M)) - 1))
    m = w & np.uint64((1 << M) - 1)
    low = m & np.uint64((1 << L) - 1)
    sym = (e << TOP_BITS) | np.int64(m >> np.uint64(L))
    t = _ctz(low | np.uint64(1 << L))  # (L where no bit is set: no branch, as common as not in some tensors)
    return sym, t, s | ((low >> np.uint64(t + 1)) << np.uint64(1)), max(L - t, 1)


@helper
def _trailing_context(sym, e_top, shift):
    """The tz table of an element: its exponent's distance below ``e_top``, 0 to 15, >> shift."""
    return min(TRAILING_CONTEXTS - 1, max(0, e_top - (np.int64(sym) >> TOP_BITS))) >> shift


@kernel
def trailing_promise(words, W, M, seg_len, zeros):
    """The share of the chunk low-bit mode 2 or 3 promises to save, judged on a sample of ``words``
    (blocks of 256, one in 16): by the trailing zeros' entropy per context (counted from the
    sample's top exponent) and their tables, the chunk as the low bits the segments' ``zeros`` leave
    and six bits for sign and symbol. What the writer judges the modes' worth by before it codes a
    chunk both ways (one kernel: in numpy, its dozen small steps cost more than the sample, chunk
    after chunk of a model's small tensors)."""
    n = words.shape[0]
    L = M - TOP_BITS
    e_top = 0
    for b in range(0, n, 4096):
        for i in range(b, min(n, b + 256)):
            e_top = max(e_top, np.int64((np.uint64(words[_U(i)]) >> np.uint64(M)) & np.uint64((1 << (W - 1 - M)) - 1)))
    hist = np.zeros((TRAILING_CONTEXTS, L + 1), dtype=np.int64)
    dropped = 0
    for b in range(0, n, 4096):
        for i in range(b, min(n, b + 256)):
            sym, t, _, _ = _trailing_parts(np.uint64(words[_U(i)]), W, M)
            hist[_trailing_context(sym, e_top, 0), t] += 1
            dropped += min(L, np.int64(zeros[i // seg_len]))
    count = 0
    explicit = 0.0
    entropy = 0.0
    cells = 0  # (about 12 bits each for the tables: a per-chunk cost, scaled to the sample)
    for c in range(TRAILING_CONTEXTS):
        row = 0
        for t in range(L + 1):
            row += hist[c, t]
        count += row
        for t in range(L + 1):
            h = hist[c, t]
            if h:
                cells += 1
                explicit += h * max(L - t - 1, 0)
                entropy -= h * np.log2(h / row)
    if count == 0:
        return 0.0
    left = count * L - dropped
    return (left - (explicit + entropy) - 12 * cells * count / n) / (left + 6 * count)


@kernel
def trailing_split(words, W, M, symbols, tz, raw_out):
    """Each element's symbol, trailing zeros and raw bits (packed LSB first into ``raw_out``, two
    words per element and one more); returns (raw words, top exponent)."""
    n = words.shape[0]
    acc = np.uint64(0)
    nacc = 0
    nraw = 0
    e_top = 0
    for i in range(n):
        sym, t, raw, k = _trailing_parts(np.uint64(words[_U(i)]), W, M)
        symbols[_U(i)] = sym
        tz[_U(i)] = t
        e_top = max(e_top, sym >> TOP_BITS)
        # (written out as in encode_kernel: the same lines as an inline helper returning (acc, nacc,
        # nraw) made this loop 3.4 times slower, 44 -> 146 ms in five EfficientNet fp32 encodes)
        if k > 32:  # (float64: up to 50 raw bits, in two pieces)
            acc |= (raw & np.uint64(0xFFFFFFFF)) << np.uint64(nacc)
            raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            nraw += 1
            acc >>= np.uint64(32)
            raw >>= np.uint64(32)
            k -= 32
        acc |= raw << np.uint64(nacc)
        nacc += k
        if nacc >= 32:
            raw_out[_U(nraw)] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            nraw += 1
            acc >>= np.uint64(32)
            nacc -= 32
    return _last_raw_word(acc, nacc, nraw, raw_out), e_top


@kernel
def trailing_histogram(symbols, tz, e_top, hist):
    """hist[context, tz] += 1 for every element."""
    for i in range(symbols.shape[0]):
        hist[_trailing_context(symbols[_U(i)], e_top, 0), tz[_U(i)]] += 1


@kernel
def rans_encode_trailing(symbols, tz, seg_len, classes, freq, start, e_top, shift, tz_freq, tz_start, rans_out):
    """As :func:`rans_encode`, in groups of four elements (chunk positions 4g to 4g + 3): the
    group's symbols, then its trailing zeros (each with the table of its context, ``>> shift``),
    each on the element's state; ``rans_out`` holds 2 n + 2 * LANES + 2 words."""
    n = symbols.shape[0]
    alphabet = freq.shape[1]
    tz_alphabet = tz_freq.shape[1]
    tables, inverse = _encoder_tables(freq, start)
    tz_tables, tz_inverse = _encoder_tables(tz_freq, tz_start)
    x0 = x1 = x2 = x3 = np.int64(RANS_L)
    pos = rans_out.shape[0]
    j = classes.shape[0] - 1  # the segment of the group's last element (followed: see decode_trailing)
    for gg in range((n + 3) // 4):
        lo = 4 * ((n + 3) // 4 - 1 - gg)
        stop = min(n, lo + 4)
        while stop - 1 < j * seg_len:
            j -= 1
        if stop == lo + 4 and lo >= j * seg_len:  # (a whole group in one segment: the states in registers)
            s0, s1, s2, s3 = (np.int64(symbols[_U(lo)]), np.int64(symbols[_U(lo + 1)]), np.int64(symbols[_U(lo + 2)]),
                              np.int64(symbols[_U(lo + 3)]))
            x3, pos = _rans_put(x3, np.int64(tz[_U(lo + 3)]), tz_tables, tz_inverse,
                                _U(_trailing_context(s3, e_top, shift) * tz_alphabet), rans_out, pos)
            x2, pos = _rans_put(x2, np.int64(tz[_U(lo + 2)]), tz_tables, tz_inverse,
                                _U(_trailing_context(s2, e_top, shift) * tz_alphabet), rans_out, pos)
            x1, pos = _rans_put(x1, np.int64(tz[_U(lo + 1)]), tz_tables, tz_inverse,
                                _U(_trailing_context(s1, e_top, shift) * tz_alphabet), rans_out, pos)
            x0, pos = _rans_put(x0, np.int64(tz[_U(lo)]), tz_tables, tz_inverse,
                                _U(_trailing_context(s0, e_top, shift) * tz_alphabet), rans_out, pos)
            base = _U(np.int64(classes[j]) * alphabet)
            x3, pos = _rans_put(x3, s3, tables, inverse, base, rans_out, pos)
            x2, pos = _rans_put(x2, s2, tables, inverse, base, rans_out, pos)
            x1, pos = _rans_put(x1, s1, tables, inverse, base, rans_out, pos)
            x0, pos = _rans_put(x0, s0, tables, inverse, base, rans_out, pos)
            continue
        for i in range(stop - 1, lo - 1, -1):  # (backward: the trailing zeros were read last)
            lane = i & 3
            sym = np.int64(symbols[_U(i)])
            x, pos = _rans_put(_lane_state(lane, x0, x1, x2, x3), np.int64(tz[_U(i)]), tz_tables, tz_inverse,
                               _U(_trailing_context(sym, e_top, shift) * tz_alphabet), rans_out, pos)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
        jj = j
        for i in range(stop - 1, lo - 1, -1):
            lane = i & 3
            while i < jj * seg_len:
                jj -= 1
            x, pos = _rans_put(_lane_state(lane, x0, x1, x2, x3), np.int64(symbols[_U(i)]), tables, inverse,
                               _U(np.int64(classes[jj]) * alphabet), rans_out, pos)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
    return _flush_states(x0, x1, x2, x3, rans_out, pos)


@inline
def _trailing_bits(sym, t, at, raw, W, M):
    """(the float bits, the next raw bit position) of an element of low-bit mode 2 whose symbol and
    trailing zeros are decoded and whose raw bits begin at ``at``."""
    L = M - TOP_BITS
    t = np.int64(t)
    # (no branch on t = L, no bit set in the low part: as common as not in some tensors)
    some = np.int64(t < L)
    k = 1 + some * (L - t - 1)
    if k > 32:
        v = np.uint64(_raw_at(raw, at, 32)) | (np.uint64(_raw_at(raw, at + 32, k - 32)) << np.uint64(32))
    else:
        v = np.uint64(_raw_at(raw, at, k))
    low = (((v >> np.uint64(1)) << np.uint64(1)) | np.uint64(1)) << np.uint64(t)
    bits = (((v & np.uint64(1)) << np.uint64(W - 1)) | (np.uint64(np.int64(sym)) << np.uint64(L))
            | (low & np.uint64(-some)))
    return bits, at + k


@kernel
def decode_trailing(rans, raw, seg_len, W, M, classes, up, lut_step, lut_sym, e_top, shift, tz_up, tz_step, tz_sym,
                    out):
    """Rebuild ``out`` (the float bits) from a low-bit mode 2 substream's rANS words and raw bits
    (``rans`` with two words of padding, ``raw`` with three); OK or an error code. The raw bit count
    follows from the decoded trailing zeros, so the reads are checked against the words there are."""
    n = out.shape[0]
    nr = rans.shape[0] - 2
    if nr < 2 * LANES:
        return ERR_OVERRUN
    nw = raw.shape[0] - 3
    step, sym_of, slots, up_mask = _flat_tables(lut_step, lut_sym, up)
    t_step, t_sym, t_slots, t_mask = _flat_tables(tz_step, tz_sym, tz_up)
    x0, x1, x2, x3 = _initial_states(rans)
    p = _U(2 * LANES)
    end = _U(nr)
    at = 0
    syms = np.zeros(LANES, dtype=np.uint16)
    j = 0  # the segment of the group's first element (followed, not divided out: a division per
    seg_end = seg_len  # group would cost as much as the group's arithmetic)
    for g in range((n + 3) // 4):
        lo = 4 * g
        stop = min(n, lo + 4)
        while lo >= seg_end:
            j += 1
            seg_end += seg_len
        # each step reads one word at most, a group eight; the raw words' three of padding keep an
        # element begun at their end in bounds
        if stop == lo + 4 and stop <= seg_end and p + _U(7) <= end and at + 3 * 64 <= 32 * nw:
            base = _U(classes[j]) * slots
            x0, s0, p = _rans_step(x0, step, sym_of, base, up, up_mask, rans, p)
            x1, s1, p = _rans_step(x1, step, sym_of, base, up, up_mask, rans, p)
            x2, s2, p = _rans_step(x2, step, sym_of, base, up, up_mask, rans, p)
            x3, s3, p = _rans_step(x3, step, sym_of, base, up, up_mask, rans, p)
            x0, t0, p = _rans_step(x0, t_step, t_sym, _U(_trailing_context(s0, e_top, shift)) * t_slots, tz_up,
                                   t_mask, rans, p)
            x1, t1, p = _rans_step(x1, t_step, t_sym, _U(_trailing_context(s1, e_top, shift)) * t_slots, tz_up,
                                   t_mask, rans, p)
            x2, t2, p = _rans_step(x2, t_step, t_sym, _U(_trailing_context(s2, e_top, shift)) * t_slots, tz_up,
                                   t_mask, rans, p)
            x3, t3, p = _rans_step(x3, t_step, t_sym, _U(_trailing_context(s3, e_top, shift)) * t_slots, tz_up,
                                   t_mask, rans, p)
            out[_U(lo)], at = _trailing_bits(s0, t0, at, raw, W, M)
            out[_U(lo + 1)], at = _trailing_bits(s1, t1, at, raw, W, M)
            out[_U(lo + 2)], at = _trailing_bits(s2, t2, at, raw, W, M)
            out[_U(lo + 3)], at = _trailing_bits(s3, t3, at, raw, W, M)
            continue
        # a group across segments, the last one, or near the end of the words: element by element
        for i in range(lo, stop):
            if p > end:
                return ERR_OVERRUN
            lane = i & 3
            c = classes[j] if i < seg_end else classes[i // seg_len]  # (the next segment, or short ones)
            x, s, p = _rans_step(_lane_state(lane, x0, x1, x2, x3), step, sym_of, _U(c) * slots, up, up_mask, rans, p)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
            syms[lane] = s
        for i in range(lo, stop):
            if p > end:
                return ERR_OVERRUN
            lane = i & 3
            x, t, p = _rans_step(_lane_state(lane, x0, x1, x2, x3), t_step, t_sym,
                                 _U(_trailing_context(syms[lane], e_top, shift)) * t_slots, tz_up, t_mask, rans, p)
            x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
            if at > 32 * nw:
                return ERR_OVERRUN
            out[_U(i)], at = _trailing_bits(syms[lane], t, at, raw, W, M)
    if at > 32 * nw:
        return ERR_OVERRUN
    if (at + 31) >> 5 != nw or (at & 31 and raw[nw - 1] >> np.uint32(at & 31)):
        return ERR_TRAILING
    return _final_status(x0, x1, x2, x3, p, end)


# --- low-bit mode 3: trailing zeros in the symbol, by tANS (float32) ------------------------------
# Mode 2's two symbols per element on four rANS states decode at about 8 ns per element: each
# state's chain runs through two table loads and two multiplications an element. Mode 3 puts the
# trailing zeros, capped at TZ_CAP, below the symbol (alphabet 2**14 for float32): one tANS symbol
# per element, whose table also learns how the zeros depend on the exponent's top mantissa bits and
# the segment's class. Its raw bits are the sign, then the low bits above the lowest set one (that
# one implied), or, from TZ_CAP zeros on, the low bits from bit TZ_CAP up. Float64's symbol would not
# fit a decoding entry with its trailing zeros: it keeps mode 2.

TZ_MODE = 3
TZ_BITS = 4
TZ_CAP = (1 << TZ_BITS) - 1
TZ_ALPHABET = 1 << (8 + TOP_BITS + TZ_BITS)
_TZ_L = 23 - TOP_BITS  # (float32's low bits)


@helper
def tz_layout(c):
    """The raw bits of an element of modes 3 and 5 whose capped trailing-zero count is ``c``: (their
    count with the sign, the shift of those above the sign, the implied lowest set bit). Below the
    cap the lowest set bit is implied and the bits above it are sent; at the cap the low bits from
    TZ_CAP up are sent, zeros among them as they come."""
    some = np.int64(c < TZ_CAP)
    return _TZ_L - c + 1 - some, c + some, some << c


@helper
def tz_raw_words(size, raw_at, n):
    """The raw words of a mode 3 or 5 substream of ``n`` elements, ``size`` bytes, whose raw words
    start at byte ``raw_at``: all the words left (their count follows from the symbols, each read
    checked against it), and whether they are too few (an element has at least 1 + TZ_L - TZ_CAP
    bits)."""
    nraw = (size - raw_at) >> 2
    return nraw, 32 * nraw < (1 + _TZ_L - TZ_CAP) * n


@inline
def tz_raw_left(raw, at):
    """Whether raw bits remain past bit ``at`` where a mode 3 or 5 decoder stopped: a word it did not
    reach, or a set bit above its last one."""
    nw = raw.shape[0]
    return (at + 31) >> 5 != nw or ((at & 31) != 0 and (raw[nw - 1] >> np.uint32(at & 31)) != 0)


@helper
def tz_value(top, v, shift, implied):
    """The float32 bits (uint64; bits past 31 to be dropped by the uint32 store) of an element of
    modes 3 and 5 from ``top``, its symbol's bits above the count, and its raw bits ``v`` laid out as
    :func:`tz_layout` says (``shift``, ``implied``)."""
    v = np.uint64(v)
    return (((v & np.uint64(1)) << np.uint64(31)) | (np.uint64(top) << np.uint64(_TZ_L))
            | ((v >> np.uint64(1)) << np.uint64(shift)) | np.uint64(implied))


@inline
def _tz_tables():
    """Per capped count c (0 to TZ_CAP), what the decoder looks up instead of working it out per
    element (scratch: 3.46 -> 2.98 ns per element on EfficientNet's conv_head): the raw bit count,
    the shift of the raw bits above the sign, and the implied lowest set bit (none at the cap)."""
    count = np.empty(TZ_CAP + 1, dtype=np.int64)
    shift = np.empty(TZ_CAP + 1, dtype=np.uint64)
    implied = np.empty(TZ_CAP + 1, dtype=np.uint64)
    for c in range(TZ_CAP + 1):
        count[c], shift[c], implied[c] = tz_layout(c)
    return count, shift, implied


@helper
def _tz_count(entry):
    """The capped trailing-zero count of a mode 3 decoding entry (its symbol from bit 4, as
    _tans_symbol_shift places float32's)."""
    return (entry >> np.uint32(4)) & np.uint32(TZ_CAP)


@inline
def _tz_float(entry, c, v, shift, implied):
    """The float32 bits of a mode 3 element from its decoding entry, its count ``c`` and its raw
    bits ``v``. (The entry's next-state base, shifted past bit 31, is dropped by the uint32 store.)"""
    return tz_value(np.uint64(entry) >> np.uint64(4 + TZ_BITS), v, shift[c], implied[c])


_TZ_BLOCK = 256  # elements whose raw bits a split computes before it packs them (a few KB: in L1)


@kernel
def tz_split(words, symbols, raw_out):
    """Each float32 element's mode 3 symbol and raw bits (packed LSB first into ``raw_out``, one
    word per element and three more); returns the raw words."""
    n = words.shape[0]
    # A block's symbols, raw bits and their counts first, in 32-bit lanes the compiler vectorises,
    # then its raw bits packed: the pack alone carries the bit position from element to element
    # (scratch, EfficientNet-Lite0's _fc: 2.0 -> 1.1 ns per element against one loop doing both)
    rr = np.empty(_TZ_BLOCK, dtype=np.uint32)
    kk = np.empty(_TZ_BLOCK, dtype=np.uint32)
    acc = np.uint64(0)
    nacc = 0
    byte = 0
    i0 = 0
    while i0 < n:
        m = min(_TZ_BLOCK, n - i0)
        _tz_block(words, i0, m, symbols, rr, kk)
        # Two elements' raw bits (at most 2 TZ_L) join the fewer than 8 pending ones, and the eight
        # bytes from the first pending one are stored whole: the bytes filled are kept
        j = 0
        while j < m:
            k0 = np.int64(kk[_U(j)])
            pair = np.uint64(rr[_U(j)])
            k = k0
            if j + 1 < m:
                pair |= np.uint64(rr[_U(j + 1)]) << np.uint64(k0)
                k += np.int64(kk[_U(j + 1)])
            acc |= pair << np.uint64(nacc)
            nacc += k
            store_le64(raw_out, byte, acc)
            byte += nacc >> 3
            acc >>= np.uint64(nacc & ~7)
            nacc &= 7
            j += 2
        i0 += m
    store_le64(raw_out, byte, acc)  # (the last word's bits past the last pair's store: zeros above them)
    bits = 8 * byte + nacc
    return (bits + 31) >> 5


@inline
def _tz_block(words, i0, m, symbols, rr, kk):
    """Elements ``i0`` to ``i0 + m`` of :func:`tz_split`: their symbols into ``symbols``, their raw
    bits and counts into ``rr`` and ``kk`` from 0 (as :func:`tz_layout` lays them out), in 32-bit
    arithmetic throughout so that the loop runs sixteen elements at a time."""
    for j in range(m):
        w = np.uint32(words[_U(i0 + j)])
        low = w & np.uint32((1 << _TZ_L) - 1)
        c = min(np.int64(trailing_zeros(low | np.uint32(1 << _TZ_L))), TZ_CAP)
        count, shift, _ = tz_layout(c)
        symbols[_U(i0 + j)] = np.uint16((((w >> np.uint32(_TZ_L)) & np.uint32((1 << (8 + TOP_BITS)) - 1))
                                         << np.uint32(TZ_BITS)) | np.uint32(c))
        rr[_U(j)] = (w >> np.uint32(31)) | ((low >> np.uint32(shift)) << np.uint32(1))
        kk[_U(j)] = np.uint32(count)


@helper
def _tz_work_parts(n, seg_len):
    """The bytes of each array :func:`encode_tz_substream` carves from its work memory: symbols, raw
    words, coded words (at the largest precision) and the substream (bounded by the largest tables)."""
    nseg = (n + seg_len - 1) // seg_len
    raw_words = ((n * (_TZ_L + 1) + 31) >> 5) + 3  # (tz_split stores eight bytes from the last one it fills)
    # (tANS words at the largest precision; mode 5 codes its words into its substream's own array)
    coded_words = n * TANS_MAX_BITS // 32 + 3
    used = min(n, np.int64(1) << (8 + TOP_BITS + TZ_BITS))
    classes = np.int64(1) << MAX_CLASSES_LOG2
    tables = table_bytes_most(classes, classes * used)
    return 2 * n, 4 * raw_words, 4 * coded_words, 1 + _tans_fields_size(1, nseg, tables, coded_words, raw_words)


@kernel
def tz_work_bytes(n, seg_len):
    """The bytes of work memory :func:`encode_tz_substream` takes for ``n`` elements."""
    return _work_total(_tz_work_parts(n, seg_len))


@inline
def tz_front(words, seg_len, classes16, costs, work):
    """What modes 3 and 5 share of a substream's coding: the float32 bits ``words`` split into their
    mode 3 symbols and raw bits, the symbols' classes and tables chosen (``classes16``: each
    segment's class of 16, as :func:`segment_classes` finds them). Returns (symbols, raw words,
    their count, klog, precision, the used symbols, their tables, the work memory left: ``work``
    holds :func:`tz_work_bytes`)."""
    n = words.shape[0]
    parts = _tz_work_parts(n, seg_len)
    b, at = _carve(work, 0, parts[0])
    symbols = b.view(np.uint16)
    b, at = _carve(work, at, parts[1])
    raw = b.view(np.uint32)
    nraw = tz_split(words, symbols, raw)
    # (the used symbols' counts only: whole-alphabet histograms of 2**14 symbols cost more to clear
    # and add up than a chunk's elements)
    hist, used_syms = _used_histogram(symbols, seg_len, classes16, TZ_ALPHABET)
    klog, precision, sent = _choose_used(hist, used_syms, classes16.shape[0], costs, TANS_MAX_BITS)
    return symbols, raw, nraw, klog, precision, used_syms, sent, work[at:]


@kernel
def encode_tz_substream(words, seg_len, classes16, costs, work):
    """The whole substream of low-bit mode 3 of the float32 bits ``words`` (``classes16``: each
    segment's class of 16, as :func:`segment_classes` finds them), as bytes, a view into ``work``
    (uint8, :func:`tz_work_bytes` of them): what :func:`decode_tans_substream` reads."""
    nseg = classes16.shape[0]
    symbols, raw, nraw, klog, precision, used_syms, sent, rest = tz_front(words, seg_len, classes16, costs, work)
    b, at = _carve(rest, 0, _tz_work_parts(words.shape[0], seg_len)[2])
    classes, tables, table_bytes, begin, first_bit, xs, coded = _tans_code(symbols, seg_len, classes16, klog, precision,
                                                                           used_syms, sent, TZ_ALPHABET, b)
    out, at = _carve(rest, at, 1 + _tans_fields_size(klog, nseg, table_bytes, coded.shape[0] - begin, nraw))
    out[0] = 0x80 | TZ_MODE
    _put_tans_fields(out, 1, klog, precision, classes, tables, table_bytes, first_bit, xs, coded, begin, raw, nraw)
    return out


@kernel
def encode_float32_chunks(words, starts, seg_lens, costs, work, ends, sure, gain):
    """Many chunks of float32 bits in one call, as :func:`encode_tans_chunks` takes 16-bit ones
    (``work``: the largest of :func:`tans_work_bytes` and :func:`tz_work_bytes` of the largest
    chunk), each coded as the writer codes a chunk below mode 5's size: low-bit mode 3 where the
    sampled :func:`trailing_promise` is at least ``sure``; else modes 0 and 1 by tANS, and mode 3
    in its place where the promise is at least ``gain`` and mode 3 is at least that share
    smaller. (floatcoder.encode_chunk_buffer makes the same choice for every size, in Python,
    where the large chunks' modes 4 and 5 come in arrays of their own and float64's mode 2 is put
    together; the tests hold the two to the same bytes.)"""
    out = np.empty(max(np.int64(64), 5 * (starts[-1] - starts[0])), dtype=np.uint8)
    pos = 0
    for j in range(seg_lens.shape[0]):
        w = words[starts[j]:starts[j + 1]]
        seg_len = seg_lens[j]
        nseg = (w.shape[0] + seg_len - 1) // seg_len
        zeros = np.empty(nseg, dtype=np.uint8)
        classes16 = np.empty(nseg, dtype=np.uint8)
        segment_classes(w, seg_len, 32, 23, zeros, classes16)
        promise = trailing_promise(w, 32, 23, seg_len, zeros)
        at = pos
        if promise >= sure:
            out, pos = _appended(out, at, encode_tz_substream(w, seg_len, classes16, costs, work))
        else:
            out, pos = _appended(out, at, encode_tans_substream(w, seg_len, 32, 23, zeros, classes16, costs, work))
            if promise >= gain:
                other = encode_tz_substream(w, seg_len, classes16, costs, work)
                if other.shape[0] <= (1 - gain) * (pos - at):
                    out, pos = _appended(out, at, other)
        ends[j] = pos
    return out[:pos]


@inline
def _tz_one(i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw, at, nw, tz):
    """Element i of mode 3 alone (``tz``: :func:`_tz_tables`): (states, bit position, raw bit
    position, OK or an error code)."""
    lane = i & 3
    e, nb = _tans_entry(flat, base, _lane_state(lane, x0, x1, x2, x3))
    if pos + nb > total:
        return x0, x1, x2, x3, pos, at, ERR_OVERRUN
    x = _tans_next(e, _raw_at(words, pos, nb))
    x0, x1, x2, x3 = _with_lane(lane, x, x0, x1, x2, x3)
    c = _tz_count(e)
    k = tz[0][c]
    if at + k > 32 * nw:
        return x0, x1, x2, x3, pos, at, ERR_OVERRUN
    out[_U(i)] = _tz_float(e, c, _raw_at(raw, at, k), tz[1], tz[2])
    return x0, x1, x2, x3, pos + nb, at + k, OK


@kernel
def decode_tz(words, first_bit, x0, x1, x2, x3, raw, seg_len, classes, precision, table, out):
    """Rebuild ``out`` (the float32 bits) from a mode 3 substream's tANS bits (as
    :func:`decode_floats_tans` takes them) and raw words (all of them: their count follows from the
    decoded symbols, so every read is checked against it); OK or an error code."""
    n = out.shape[0]
    R = np.int64(1) << precision
    total = 32 * (words.shape[0] - 1)
    nw = raw.shape[0]
    flat = table.ravel()
    pos = np.int64(first_bit)
    at = 0
    tz = _tz_tables()
    count, shift, implied = tz
    for j in range(classes.shape[0]):
        lo = j * seg_len
        stop = min(n, lo + seg_len)
        base = _U(classes[j]) * _U(R)
        i = lo
        while i < stop and i & 3:  # (up to the first whole group)
            x0, x1, x2, x3, pos, at, err = _tz_one(i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw, at, nw,
                                                   tz)
            if err != OK:
                return err
            i += 1
        # whole groups while eight bytes are left to read (at most 52 bits a group) and the group's
        # raw bits (at most 88) and eight bytes from the last one's are there
        while i + 4 <= stop and pos + 64 <= total and at + 160 <= 32 * nw:
            # (nor can the raw bits run out before that many, at most 88 bits a group)
            runs = min(_groups_before_end(pos, total), (32 * nw - 160 - at) // 88 + 1)
            run_end = min(stop - 3, i + 4 * runs)
            while i < run_end:
                e0, e1, e2, e3, x0, x1, x2, x3, pos = _tans_group(flat, base, x0, x1, x2, x3, words, pos)
                c0, c1, c2, c3 = _tz_count(e0), _tz_count(e1), _tz_count(e2), _tz_count(e3)
                k0, k1, k2, k3 = count[c0], count[c1], count[c2], count[c3]
                # two elements' raw bits to a read (at most 44 of its 57 bits)
                r01 = _raw_near(raw, at, k0 + k1)
                r23 = _raw_near(raw, at + k0 + k1, k2 + k3)
                out[_U(i)] = _tz_float(e0, c0, r01 & ((np.int64(1) << k0) - 1), shift, implied)
                out[_U(i + 1)] = _tz_float(e1, c1, r01 >> k0, shift, implied)
                out[_U(i + 2)] = _tz_float(e2, c2, r23 & ((np.int64(1) << k2) - 1), shift, implied)
                out[_U(i + 3)] = _tz_float(e3, c3, r23 >> k2, shift, implied)
                at += k0 + k1 + k2 + k3
                i += 4
        while i < stop:  # (the segment's last elements, or the streams' last bits)
            x0, x1, x2, x3, pos, at, err = _tz_one(i, x0, x1, x2, x3, pos, total, base, flat, words, out, raw, at, nw,
                                                   tz)
            if err != OK:
                return err
            i += 1
    if x0 or x1 or x2 or x3:
        return ERR_BAD_END
    if pos != total:
        return ERR_TRAILING
    if tz_raw_left(raw, at):
        return ERR_TRAILING
    return OK


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
