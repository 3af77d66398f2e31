"""Numba kernels of the lossless float coder (private: :mod:`.floatcoder` is the validated front).

A float's bits are cut into a *symbol*, its exponent and the top ``TOP_BITS`` of its mantissa, coded
with four interleaved tANS states (rANS in streams before format version 8, and in low-bit mode 2)
over static per-chunk frequency tables chosen by the segment's class, and *raw bits*, its sign and
the rest of its mantissa, packed LSB first into 32-bit words.
Each segment drops the low mantissa bits that are zero in all of its elements. The layout is in
docs/format.md §4.4.

Here: the split of a float into symbol and raw bits, the segments' classes, the frequency tables
(written, read, normalized, chosen) and the rANS coder; the symbols by tANS in
:mod:`._tans_kernels`, low-bit mode 2 in :mod:`._trailing_kernels`, integers in
:mod:`._magnitude_kernels`, the sixteen-lane modes 4 to 6 in :mod:`._wide_kernels`.

All arithmetic is on int64 (rANS states are below 2**32) or uint64 (float bits): mixing the two
would make Numba compute in float64.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from .._jit import helper, inline, kernel, load_le64
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


@helper
def _floor_log2(v):
    k = 0
    while (v >> (k + 1)) > 0:
        k += 1
    return k
