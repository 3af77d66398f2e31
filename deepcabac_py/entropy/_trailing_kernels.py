"""Numba kernels of the lossless float coder's low-bit mode 2: trailing zeros by exponent, a second
symbol per element on the rANS states (private: :mod:`.floatcoder` is the validated front)."""

from __future__ import annotations

import numpy as np

from .._jit import helper, inline, kernel, trailing_zeros
from ._float_kernels import (
    _U,
    ERR_OVERRUN,
    ERR_TRAILING,
    LANES,
    RANS_L,
    TOP_BITS,
    _encoder_tables,
    _final_status,
    _flat_tables,
    _flush_states,
    _initial_states,
    _lane_state,
    _last_raw_word,
    _rans_put,
    _rans_step,
    _raw_at,
    _with_lane,
)

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
