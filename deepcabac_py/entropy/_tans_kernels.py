"""Numba kernels of the lossless float coder's symbols by tANS: low-bit modes 0 and 1 (format
version 8) and mode 3, float32's trailing zeros in the symbol (private: :mod:`.floatcoder` is the
validated front; the rest of the coder in :mod:`._float_kernels`)."""

from __future__ import annotations

import numpy as np

from .._jit import copy_bytes, helper, inline, kernel, load_le64, store_le64, trailing_zeros
from ._float_kernels import (
    _U,
    ERR_BAD_END,
    ERR_OVERRUN,
    ERR_TRAILING,
    FAST,
    GENERAL,
    LOOKUP,
    MAX_CLASSES_LOG2,
    OK,
    PARTIAL_HISTOGRAMS_FROM,
    TOP_BITS,
    _choose_used,
    _emit,
    _fast_placed,
    _floor_log2,
    _histogram_into,
    _lane_state,
    _raw_at,
    _raw_near,
    _raw_words_status,
    _read_used_tables,
    _segment_bits,
    _used_of,
    _with_lane,
    _write_used_tables,
    encode_kernel,
    rank_classes,
    raw_bit_count,
    segment_classes,
)
from ._trailing_kernels import trailing_promise

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
_RAW_FIELD = TANS_FIELDS.index("raw bits")


@inline
def raw_field_status(size, at, nraw, short, detail):
    """The status of a substream's last field, its ``nraw`` raw words from byte ``at`` of ``size``
    (``short``: the substream ends inside them): OK, ERR_SHORT, or ERR_AFTER_RAW with the count of
    bytes after them in ``detail[0]``."""
    if short:
        detail[0] = _RAW_FIELD
        return ERR_SHORT
    if at + 4 * nraw != size:
        detail[0] = size - at - 4 * nraw
        return ERR_AFTER_RAW
    return OK


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
    status = raw_field_status(size, raw_at, nraw, short, detail)
    if status != OK:
        return status
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
