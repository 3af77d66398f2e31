"""A slow plain-Python reference of the lossless float coder's kernels (entropy/_float_kernels.py),
written from docs/format.md §4.4: the tests compare the kernels' bytes and values with it on random
inputs. Python integers throughout, one element at a time."""

from __future__ import annotations

import struct
from itertools import accumulate

import numpy as np

from deepcabac_py.entropy import floatcoder
from deepcabac_py.entropy._float_kernels import cost_table

_COSTS = cost_table()

PROB_BITS = 14
RANS_L = 1 << 16
LANES = 4
TOP = 2


def _split(w: int, W: int, M: int, z: int) -> tuple[int, int, int]:
    mr = M - z
    t = min(TOP, mr)
    low_bits = mr - t
    s = w >> (W - 1)
    e = (w >> M) & ((1 << (W - 1 - M)) - 1)
    m = (w & ((1 << M) - 1)) >> z
    top, low = m >> low_bits, m & ((1 << low_bits) - 1)
    return (e << TOP) | (top << (TOP - t)), (s << low_bits) | low, low_bits + 1


def _segments(n: int, seg: int):
    for j in range(-(-n // seg)):
        yield j, range(j * seg, min(n, (j + 1) * seg))


def _normalized(counts: list[int], bits: int) -> list[int]:
    total = sum(counts)
    best = max(range(len(counts)), key=lambda i: (counts[i], -i))
    freq = [max(1, c * (1 << bits) // total) if c else 0 for c in counts]
    excess = sum(freq) - (1 << bits)
    if excess < 0:
        freq[best] -= excess
    for i in sorted(range(len(freq)), key=lambda i: (-freq[i], i)):
        if excess <= 0:
            break
        take = min(excess, freq[i] - 1)
        freq[i] -= take
        excess -= take
    return freq


def _gamma_length(v: int) -> int:
    return 2 * (v.bit_length() - 1) + 1


def choose_classes(hist: np.ndarray, nseg: int, max_bits: int = 14) -> tuple[int, int, list[list[int]]]:
    """The class count, table precision and tables (at that precision) of the encoder policy
    (docs/format.md §4.4), costs in integer units of 2**-16 bits."""
    costs = [int(c) for c in _COSTS]
    best = None
    for klog in range(5):
        if best is not None and klog - best[1] > 2:  # (two class counts in a row not the best: stop)
            break
        per = 16 >> klog
        rows = [[int(v) for v in hist[c * per:(c + 1) * per].sum(axis=0)] for c in range(1 << klog)]
        if any(sum(r) == 0 for r in rows):
            break
        before = None
        for bits in (14, 13, 12, 10, 8):
            if max(sum(1 for v in r if v) for r in rows) > 1 << bits or bits > max_bits:
                continue
            cost = (4 * nseg if klog else 0) << 16
            cost += (int(hist.sum()) * (klog + bits)) << 8
            tables = []
            for r in rows:
                f = _normalized(r, bits)
                used = [s for s in range(len(f)) if f[s]]
                cost += sum(r[s] * costs[f[s] << (PROB_BITS - bits)] for s in used)
                gaps = [b - a for a, b in zip([-1] + used, used)]
                cost += (_gamma_length(len(used)) + sum(map(_gamma_length, gaps))
                         + sum(_gamma_length(f[s]) for s in used)) << 16
                tables.append(f)
            if before is not None and cost > before:  # (the precisions, finest first, until one costs more)
                break
            before = cost
            if best is None or cost < best[0]:
                best = (cost, klog, bits, tables)
    assert best is not None
    return best[1], best[2], best[3]


def _gamma(bits: list[int], v: int) -> None:
    k = v.bit_length() - 1
    bits += [0] * k + [int(b) for b in bin(v)[2:]]


def _rans(steps: list[tuple[int, int, int]]) -> list[int]:
    """The rANS words of ``steps`` (lane, freq, start), given in the decoder's order."""
    x = [RANS_L] * LANES
    pushed: list[int] = []
    for lane, f, b in reversed(steps):  # last first
        s = x[lane]
        if s >= ((RANS_L >> PROB_BITS) << 16) * f:
            pushed.append(s & 0xFFFF)
            s >>= 16
        x[lane] = (s // f) * (1 << PROB_BITS) + s % f + b
    for lane in range(LANES - 1, -1, -1):
        pushed += [x[lane] >> 16, x[lane] & 0xFFFF]
    return pushed[::-1]


def _starts(row: list[int]) -> list[int]:
    """Each symbol's start: the sum of the frequencies before it."""
    return list(accumulate(row[:-1], initial=0)) if row else []


def _scaled(sent: list[list[int]], precision: int) -> tuple[list[list[int]], list[list[int]]]:
    freq = [[f << (PROB_BITS - precision) for f in row] for row in sent]
    return freq, [_starts(row) for row in freq]


def _tables(klog: int, precision: int, sent: list[list[int]], classes: list[int]) -> bytes:
    """Class count, precision, class nibbles, table size and tables."""
    bits: list[int] = []
    for row in sent:
        used = [s for s in range(len(row)) if row[s]]
        _gamma(bits, len(used))
        prev = -1
        for s in used:
            _gamma(bits, s - prev)
            _gamma(bits, int(row[s]))
            prev = s
    bits += [0] * (-len(bits) % 8)
    tables = bytes(int("".join(map(str, bits[k:k + 8])), 2) for k in range(0, len(bits), 8))
    out = bytes([klog, precision])
    if klog and classes:
        padded = classes + [0] * (len(classes) % 2)
        out += bytes(padded[k] | (padded[k + 1] << 4) for k in range(0, len(padded), 2))
    return out + struct.pack("<I", len(tables)) + tables


def _words(rans: list[int], raw: list[int]) -> bytes:
    return struct.pack("<I", len(rans)) + struct.pack(f"<{len(rans)}H", *rans) + struct.pack(f"<{len(raw)}I", *raw)


def _tail(symbols: list[int], seg: int, klog: int, precision: int, sent: list[list[int]], classes: list[int],
          raw: list[int]) -> bytes:
    """The substream from its class count on: classes, tables, rANS words of ``symbols``, raw words."""
    freq, starts = _scaled(sent, precision)
    seg_of = [j for j, idx in _segments(len(symbols), seg) for _ in idx]
    steps = [(i % LANES, freq[classes[seg_of[i]]][sym], starts[classes[seg_of[i]]][sym])
             for i, sym in enumerate(symbols)]
    return _tables(klog, precision, sent, classes) + _words(_rans(steps), raw)


def _classes16(means: list[float]) -> list[int]:
    nseg = len(means)
    order = sorted(range(nseg), key=lambda j: (means[j], j))
    rank = [0] * nseg
    for r, j in enumerate(order):
        rank[j] = r
    return [r * 16 // nseg for r in rank]


def _packed(pieces: list[tuple[int, int]]) -> list[int]:
    """(value, bit count) pieces LSB first into u32 words."""
    acc, nacc = 0, 0
    for v, k in pieces:
        acc |= v << nacc
        nacc += k
    return [(acc >> (32 * k)) & 0xFFFFFFFF for k in range(-(-nacc // 32))]


TANS_FLAG = 0x80
TANS_MAX_BITS = 13


def _tans_tables(rows: list[list[int]], precision: int) -> tuple[list[list[tuple[int, int, int]]],
                                                                 list[dict[tuple[int, int], int]]]:
    """Per class: the decoder's (symbol, bit count, next base) of each state, and the encoder's
    state of each (symbol, y), y from freq to 2 freq - 1."""
    R = 1 << precision
    step = (R >> 1) + (R >> 3) + 3
    dec, enc = [], []
    for freq in rows:
        spread, pos = [0] * R, 0
        for s, f in enumerate(freq):
            for _ in range(f):
                spread[pos] = s
                pos = (pos + step) & (R - 1)
        nxt, d, e = list(freq), [], {}
        for x in range(R):
            s = spread[x]
            y = nxt[s]
            nxt[s] += 1
            nb = precision - (y.bit_length() - 1)
            d.append((s, nb, (y << nb) - R))
            e[(s, y)] = x + R
        dec.append(d)
        enc.append(e)
    return dec, enc


def _tans(symbols: list[int], seg: int, precision: int, sent: list[list[int]], classes: list[int]) -> bytes:
    """The first bit, the decoder's initial states and the words of ``symbols`` by tANS."""
    R = 1 << precision
    _, enc = _tans_tables(sent, precision)
    x = [R] * LANES
    pieces = []
    for i in reversed(range(len(symbols))):
        c, s = classes[i // seg], symbols[i]
        f, state = sent[c][s], x[i % LANES]
        nb = 0
        while state >> nb >= 2 * f:
            nb += 1
        pieces.append((state & ((1 << nb) - 1), nb))
        x[i % LANES] = enc[c][(s, state >> nb)]
    total = sum(nb for _, nb in pieces)
    first_bit = -total % 32
    acc, pos = 0, first_bit
    for v, nb in reversed(pieces):  # (the decoder's order)
        acc |= v << pos
        pos += nb
    words = [(acc >> (32 * k)) & 0xFFFFFFFF for k in range(pos // 32)]
    return struct.pack("<B4H", first_bit, *(v - R for v in x)) + struct.pack(f"<I{len(words)}I", len(words), *words)


def encode(words: list[int], dtype_name: str, seg: int, tans: bool = True) -> bytes:
    """Low-bit modes 0 and 1 (the segments' common zero bits dropped), the symbols by tANS (by rANS
    without ``tans``: what the version-7 writer wrote, which the decoder still reads)."""
    W, M = floatcoder.FORMATS[dtype_name]
    n = len(words)
    zeros, means = [], []
    for _, idx in _segments(n, seg):
        acc = 0
        for i in idx:
            acc |= words[i] & ((1 << M) - 1)
        z = 0
        while z < M and not (acc >> z) & 1:
            z += 1
        zeros.append(z)
        means.append(sum((words[i] >> M) & ((1 << (W - 1 - M)) - 1) for i in idx) / len(idx))
    nseg = len(zeros)
    classes16 = _classes16(means)
    alphabet = 1 << (W - 1 - M + TOP)
    hist = np.zeros((16, alphabet), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], _split(words[i], W, M, zeros[j])[0]] += 1
    klog, precision, sent = choose_classes(hist, nseg, TANS_MAX_BITS if tans else PROB_BITS)
    classes = [c >> (4 - klog) for c in classes16]
    raw = _packed([_split(words[i], W, M, zeros[j])[1:] for j, idx in _segments(n, seg) for i in idx])
    symbols = [_split(words[i], W, M, zeros[j])[0] for j, idx in _segments(n, seg) for i in idx]
    flag = TANS_FLAG if tans else 0
    head = bytes([flag, zeros[0]]) if nseg and len(set(zeros)) == 1 else bytes([flag | 1, *zeros])
    if not tans:
        return head + _tail(symbols, seg, klog, precision, sent, classes, raw)
    return (head + _tables(klog, precision, sent, classes) + _tans(symbols, seg, precision, sent, classes)
            + struct.pack(f"<{len(raw)}I", *raw))


def _trailing_split(w: int, W: int, M: int) -> tuple[int, int, int, int]:
    """(symbol, trailing zeros t, raw bits, raw bit count) in low-bit mode 2."""
    L = M - TOP
    s, e, m = w >> (W - 1), (w >> M) & ((1 << (W - 1 - M)) - 1), w & ((1 << M) - 1)
    low = m & ((1 << L) - 1)
    t = (low & -low).bit_length() - 1 if low else L
    raw = s | ((low >> (t + 1)) << 1) if low else s
    return (e << TOP) | (m >> L), t, raw, L - t if low else 1


def _context(sym: int, e_top: int) -> int:
    return min(15, max(0, e_top - (sym >> TOP)))


def encode_trailing(words: list[int], dtype_name: str, seg: int) -> bytes:
    """Low-bit mode 2: each element's trailing zeros coded by its exponent's context."""
    W, M = floatcoder.FORMATS[dtype_name]
    L = M - TOP
    n = len(words)
    parts = [_trailing_split(w, W, M) for w in words]
    means = [sum((words[i] >> M) & ((1 << (W - 1 - M)) - 1) for i in idx) / len(idx) for _, idx in _segments(n, seg)]
    classes16 = _classes16(means)
    hist = np.zeros((16, 1 << (W - 1 - M + TOP)), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], parts[i][0]] += 1
    klog, precision, sent = choose_classes(hist, len(means))
    classes = [c >> (4 - klog) for c in classes16]
    e_top = max(sym >> TOP for sym, _, _, _ in parts)
    tz_hist = np.zeros((16, L + 1), dtype=np.int64)
    for sym, t, _, _ in parts:
        tz_hist[_context(sym, e_top), t] += 1
    for c in range(1, 16):
        if not tz_hist[c].any():
            tz_hist[c] = tz_hist[c - 1]
    tklog, tprecision, tsent = choose_classes(tz_hist, 0, 10)
    freq, starts = _scaled(sent, precision)
    tfreq, tstarts = _scaled(tsent, tprecision)
    steps = []
    for lo in range(0, n, 4):  # per group of four: the symbols, then the trailing zeros
        group = range(lo, min(n, lo + 4))
        for i in group:
            sym, c = parts[i][0], classes[i // seg]
            steps.append((i % LANES, freq[c][sym], starts[c][sym]))
        for i in group:
            (sym, t, _, _), tc = parts[i], _context(parts[i][0], e_top) >> (4 - tklog)
            steps.append((i % LANES, tfreq[tc][t], tstarts[tc][t]))
    raw = _packed([(r, k) for _, _, r, k in parts])
    return (bytes([2]) + struct.pack("<H", e_top) + _tables(klog, precision, sent, classes)
            + _tables(tklog, tprecision, tsent, []) + _words(_rans(steps), raw))


TZ_BYTE = 0x83
TZ_WIDE_BYTE = 0x85
HALVES_BYTE = 0x86
TZ_BITS = 4
TZ_CAP = 15


def _tz_split(w: int) -> tuple[int, int, int]:
    """(symbol with its capped trailing zeros, raw bits, raw bit count) of float32 bits in low-bit
    mode 3."""
    L = 23 - TOP
    s, sym, low = w >> 31, (w >> L) & ((1 << (8 + TOP)) - 1), w & ((1 << L) - 1)
    t = (low & -low).bit_length() - 1 if low else L
    if t >= TZ_CAP:
        return (sym << TZ_BITS) | TZ_CAP, s | ((low >> TZ_CAP) << 1), 1 + L - TZ_CAP
    return (sym << TZ_BITS) | t, s | ((low >> (t + 1)) << 1), L - t


def encode_tz(words: list[int], seg: int, wide: bool = False) -> bytes:
    """Low-bit mode 3 of float32 bits: the trailing zeros, capped, in the tANS symbol; with ``wide``
    mode 5, the same symbols and raw bits on mode 4's 64 rANS states."""
    n = len(words)
    parts = [_tz_split(w) for w in words]
    means = [sum((words[i] >> 23) & 255 for i in idx) / len(idx) for _, idx in _segments(n, seg)]
    classes16 = _classes16(means)
    hist = np.zeros((16, 1 << (8 + TOP + TZ_BITS)), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], parts[i][0]] += 1
    klog, precision, sent = choose_classes(hist, len(means), TANS_MAX_BITS)
    classes = [c >> (4 - klog) for c in classes16]
    raw = _packed([(r, k) for _, r, k in parts])
    if wide:
        return _wide(TZ_WIDE_BYTE, [sym for sym, _, _ in parts], seg, klog, precision, sent, classes, raw)
    return (bytes([TZ_BYTE]) + _tables(klog, precision, sent, classes)
            + _tans([sym for sym, _, _ in parts], seg, precision, sent, classes) + struct.pack(f"<{len(raw)}I", *raw))


class _Parse:
    """Reads a valid substream field by field (no validation)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def bytes(self, k: int) -> bytes:
        self.pos += k
        return self.data[self.pos - k:self.pos]

    def tables(self, nseg: int) -> tuple[list[int], list[dict[int, tuple[int, int]]]]:
        """(segment classes, per class {symbol: (freq, start)} at PROB_BITS)."""
        klog, precision = self.bytes(2)
        self.precision = precision
        classes = [0] * nseg
        if klog and nseg:
            packed = self.bytes(-(-nseg // 2))
            classes = [(packed[j >> 1] >> (4 * (j & 1))) & 15 for j in range(nseg)]
        (tbytes,) = struct.unpack("<I", self.bytes(4))
        bits = "".join(f"{b:08b}" for b in self.bytes(tbytes))
        bp = 0

        def gamma() -> int:
            nonlocal bp
            k = bits.index("1", bp) - bp
            v = int(bits[bp + k:bp + 2 * k + 1], 2)
            bp += 2 * k + 1
            return v

        tables = []
        for _ in range(1 << klog):
            sym, total, table = -1, 0, {}
            for _ in range(gamma()):
                sym += gamma()
                f = gamma() << (PROB_BITS - precision)
                table[sym] = (f, total)
                total += f
            tables.append(table)
        return classes, tables

    def tans(self, precision: int, sent: list[list[int]]) -> _TansCoder:
        first_bit, *x = struct.unpack("<B4H", self.bytes(9))
        (nw,) = struct.unpack("<I", self.bytes(4))
        words = struct.unpack(f"<{nw}I", self.bytes(4 * nw))
        rest = self.data[self.pos:]
        bits = sum(w << (32 * k) for k, w in enumerate(words))
        rawbits = sum(r << (32 * k) for k, r in enumerate(struct.unpack(f"<{len(rest) // 4}I", rest)))
        return _TansCoder(_tans_tables(sent, precision)[0], first_bit, x, bits, 32 * nw, rawbits)

    def coder(self) -> _Coder:
        (nr,) = struct.unpack("<I", self.bytes(4))
        rans = struct.unpack(f"<{nr}H", self.bytes(2 * nr))
        rest = self.data[self.pos:]
        return _Coder(rans, sum(r << (32 * k) for k, r in enumerate(struct.unpack(f"<{len(rest) // 4}I", rest))))


class _Coder:
    def __init__(self, rans, rawbits: int):
        self.rans, self.rawbits, self.rp = rans, rawbits, 0
        self.x = [rans[2 * k] | (rans[2 * k + 1] << 16) for k in range(LANES)]
        self.p = 2 * LANES

    def symbol(self, lane: int, table: dict[int, tuple[int, int]]) -> int:
        s = self.x[lane]
        slot = s & ((1 << PROB_BITS) - 1)
        sym = next(k for k, (f, b) in table.items() if b <= slot < b + f)
        f, b = table[sym]
        s = f * (s >> PROB_BITS) + slot - b
        if s < RANS_L:
            s = (s << 16) | self.rans[self.p]
            self.p += 1
        self.x[lane] = s
        return sym

    def raw(self, k: int) -> int:
        self.rp += k
        return (self.rawbits >> (self.rp - k)) & ((1 << k) - 1)

    def done(self) -> bool:
        return self.x == [RANS_L] * LANES and self.p == len(self.rans)


class _TansCoder:
    def __init__(self, dec, first_bit: int, x: list[int], bits: int, total: int, rawbits: int):
        self.dec, self.pos, self.x, self.bits, self.total = dec, first_bit, list(x), bits, total
        self.rawbits, self.rp = rawbits, 0

    def symbol(self, lane: int, cls: int) -> int:
        s, nb, base = self.dec[cls][self.x[lane]]
        self.x[lane] = base + ((self.bits >> self.pos) & ((1 << nb) - 1))
        self.pos += nb
        return s

    raw = _Coder.raw

    def done(self) -> bool:
        return self.x == [0] * LANES and self.pos == self.total


def decode(data: bytes, dtype_name: str, seg: int, n: int) -> list[int]:
    """The float bits of a valid substream (no validation: the reference of the kernel's arithmetic)."""
    W, M = floatcoder.FORMATS[dtype_name]
    nseg = -(-n // seg)
    r = _Parse(data)
    (mode,) = r.bytes(1)
    if mode == HALVES_BYTE:
        assert W == 32
        return [h << 16 for h in decode(data[1:], "bfloat16", seg, n)]
    if mode == 2:
        return _decode_trailing(r, W, M, seg, n)
    if mode == TZ_BYTE:
        return _decode_tz(r, seg, n)
    tans = bool(mode & TANS_FLAG)
    mode &= ~TANS_FLAG
    zeros = list(r.bytes(1)) * nseg if mode == 0 else list(r.bytes(nseg))
    classes, tables = r.tables(nseg)
    if tans:  # (the tables as sent)
        precision = r.precision
        sent = [[0] * (1 << (W - 1 - M + TOP)) for _ in tables]
        for row, table in zip(sent, tables):
            for sym, (f, _) in table.items():
                row[sym] = f >> (PROB_BITS - precision)
        c = r.tans(precision, sent)
    else:
        c = r.coder()
    out = []
    for j, idx in _segments(n, seg):
        z = zeros[j]
        mr = M - z
        t = min(TOP, mr)
        low_bits = mr - t
        for i in idx:
            sym = c.symbol(i % LANES, classes[j] if tans else tables[classes[j]])
            value = c.raw(low_bits + 1)
            top = (sym & ((1 << TOP) - 1)) >> (TOP - t)
            out.append(((value >> low_bits) << (W - 1)) | ((sym >> TOP) << M) | (top << (M - t))
                       | ((value & ((1 << low_bits) - 1)) << z))
    assert c.done()
    return out


def _decode_trailing(r: _Parse, W: int, M: int, seg: int, n: int) -> list[int]:
    L = M - TOP
    (e_top,) = struct.unpack("<H", r.bytes(2))
    classes, tables = r.tables(-(-n // seg))
    _, tz_tables = r.tables(0)
    shift = 4 - (len(tz_tables).bit_length() - 1)
    c = r.coder()
    out = []
    for lo in range(0, n, 4):
        group = range(lo, min(n, lo + 4))
        syms = [c.symbol(i % LANES, tables[classes[i // seg]]) for i in group]
        for i, sym in zip(group, syms):
            t = c.symbol(i % LANES, tz_tables[_context(sym, e_top) >> shift])
            raw = c.raw(L - t if t < L else 1)
            low = (((raw >> 1) << 1) | 1) << t if t < L else 0
            out.append(((raw & 1) << (W - 1)) | ((sym >> TOP) << M) | ((sym & ((1 << TOP) - 1)) << L) | low)
    assert c.done()
    return out


def _decode_tz(r: _Parse, seg: int, n: int) -> list[int]:
    L = 23 - TOP
    classes, tables = r.tables(-(-n // seg))
    sent = [[0] * (1 << (8 + TOP + TZ_BITS)) for _ in tables]
    for row, table in zip(sent, tables):
        for sym, (f, _) in table.items():
            row[sym] = f >> (PROB_BITS - r.precision)
    c = r.tans(r.precision, sent)
    out = []
    for i in range(n):
        sym = c.symbol(i % LANES, classes[i // seg])
        t = sym & TZ_CAP
        raw = c.raw(L - t if t < TZ_CAP else 1 + L - TZ_CAP)
        low = (raw >> 1) << TZ_CAP if t == TZ_CAP else ((raw >> 1) << (t + 1)) | (1 << t)
        out.append(((raw & 1) << 31) | ((sym >> TZ_BITS) << L) | low)
    assert c.done()
    return out


# --- integers by magnitude class ----------------------------------------------------------------

def encode_magnitudes(values: list[int], width: int, seg: int) -> bytes:
    n = len(values)
    lengths = [abs(v).bit_length() for v in values]
    means = [sum(lengths[i] for i in idx) / len(idx) for _, idx in _segments(n, seg)]
    nseg = len(means)
    order = sorted(range(nseg), key=lambda j: (means[j], j))
    classes16 = [0] * nseg
    for r, j in enumerate(order):
        classes16[j] = r * 16 // nseg
    def split(v: int) -> tuple[int, int, int]:
        b = abs(v).bit_length()
        k = max(b - 1, 0)
        t = min(TOP, k)
        top = (abs(v) >> (k - t)) & ((1 << t) - 1)
        return b * (1 << TOP) + (top << (TOP - t)), abs(v) & ((1 << (k - t)) - 1), k - t

    symbols = [split(v) for v in values]
    hist = np.zeros((16, (width + 1) << TOP), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], symbols[i][0]] += 1
    klog, precision, sent = choose_classes(hist, nseg)
    classes = [c >> (4 - klog) for c in classes16]
    bits = 0
    nbits = 0
    for v, (_, low, count) in zip(values, symbols):  # the sign, then the bits below the symbol's
        bits |= ((low << 1) | (v < 0)) << nbits
        nbits += 1 + count
    raw = [(bits >> (32 * k)) & 0xFFFFFFFF for k in range(-(-nbits // 32))]
    return _tail([sym for sym, _, _ in symbols], seg, klog, precision, sent, classes, raw)


WIDE_LANES = 64
WIDE_L = 1 << 16


def encode_wide(words: list[int], dtype_name: str, seg: int) -> bytes | None:
    """Low-bit mode 4 (docs/format.md §4.4): bf16, fp16 or fp32 dropping no low bit, the symbols by
    64 rANS states, element i on state i % 64; None where a segment has low bits zero throughout."""
    W, M = floatcoder.FORMATS[dtype_name]
    assert W in (16, 32)
    n = len(words)
    means = []
    for _, idx in _segments(n, seg):
        acc = 0
        for i in idx:
            acc |= words[i] & ((1 << M) - 1)
        if not acc & 1:
            return None
        means.append(sum((words[i] >> M) & ((1 << (W - 1 - M)) - 1) for i in idx) / len(idx))
    classes16 = _classes16(means)
    alphabet = 1 << (W - 1 - M + TOP)
    hist = np.zeros((16, alphabet), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], _split(words[i], W, M, 0)[0]] += 1
    klog, precision, sent = choose_classes(hist, len(means), TANS_MAX_BITS)
    classes = [c >> (4 - klog) for c in classes16]
    raw = _packed([_split(w, W, M, 0)[1:] for w in words])
    return _wide(TANS_FLAG | 4, [_split(w, W, M, 0)[0] for w in words], seg, klog, precision, sent, classes, raw)


def encode_halves(words: list[int], seg: int) -> bytes:
    """Low-bit mode 6 (docs/format.md §4.4): float32 words whose low 16 bits are all zero, as the
    mode byte and the bfloat16 substream of their upper halves (mode 4 where it takes them, else
    tANS)."""
    assert all(w & 0xFFFF == 0 for w in words)
    halves = [w >> 16 for w in words]
    inner = encode_wide(halves, "bfloat16", seg)
    return bytes([HALVES_BYTE]) + (inner if inner is not None else encode(halves, "bfloat16", seg))


def _wide(mode_byte: int, symbols: list[int], seg: int, klog: int, precision: int, sent: list[list[int]],
          classes: list[int], raw: list[int]) -> bytes:
    """A mode 4 or 5 substream: the symbols by 64 rANS states, element i on state i % 64."""
    starts = [_starts(row) for row in sent]
    x = [WIDE_L] * WIDE_LANES
    pushed = []
    for i in reversed(range(len(symbols))):
        c, s = classes[i // seg], symbols[i]
        f, state = sent[c][s], x[i % WIDE_LANES]
        if state >= f << (32 - precision):
            pushed.append(state & 0xFFFF)
            state >>= 16
        x[i % WIDE_LANES] = (state // f << precision) + state % f + starts[c][s]
    coder = pushed[::-1]
    return (bytes([mode_byte]) + _tables(klog, precision, sent, classes) + struct.pack("<64I", *x)
            + struct.pack(f"<I{len(coder)}H", len(coder), *coder) + struct.pack(f"<{len(raw)}I", *raw))
