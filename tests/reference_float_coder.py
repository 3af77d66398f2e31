"""A slow plain-Python reference of the lossless float coder's kernels (entropy/_float_kernels.py),
written from docs/format.md §4.4: the tests compare the kernels' bytes and values with it on random
inputs. Python integers throughout, one element at a time."""

from __future__ import annotations

import struct

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


def choose_classes(hist: np.ndarray, nseg: int) -> tuple[int, int, list[list[int]]]:
    """The class count, table precision and tables (at that precision) of the encoder policy
    (docs/format.md §4.4), costs in integer units of 2**-16 bits."""
    costs = [int(c) for c in _COSTS]
    best = None
    for klog in range(5):
        per = 16 >> klog
        rows = [[int(v) for v in hist[c * per:(c + 1) * per].sum(axis=0)] for c in range(1 << klog)]
        if any(sum(r) == 0 for r in rows):
            break
        for bits in (14, 12, 10, 8):
            if max(sum(1 for v in r if v) for r in rows) > 1 << bits:
                continue
            cost = (4 * nseg if klog else 0) << 16
            tables = []
            for r in rows:
                f = _normalized(r, bits)
                used = [s for s in range(len(f)) if f[s]]
                cost += sum(r[s] * costs[f[s] << (PROB_BITS - bits)] for s in used)
                gaps = [b - a for a, b in zip([-1] + used, used)]
                cost += (_gamma_length(len(used)) + sum(map(_gamma_length, gaps))
                         + sum(_gamma_length(f[s]) for s in used)) << 16
                tables.append(f)
            if best is None or cost < best[0]:
                best = (cost, klog, bits, tables)
    assert best is not None
    return best[1], best[2], best[3]


def _gamma(bits: list[int], v: int) -> None:
    k = v.bit_length() - 1
    bits += [0] * k + [int(b) for b in bin(v)[2:]]


def _tail(symbols: list[int], seg: int, klog: int, precision: int, sent: list[list[int]], classes: list[int],
          raw: list[int]) -> bytes:
    """The substream from its class count on: classes, tables, rANS words of ``symbols``, raw words."""
    n, nseg = len(symbols), len(classes)
    freq = [[f << (PROB_BITS - precision) for f in row] for row in sent]
    starts = [[sum(row[:s]) for s in range(len(row))] for row in freq]
    x = [RANS_L] * LANES
    pushed: list[int] = []
    seg_of = [j for j, idx in _segments(n, seg) for _ in idx]
    for i in range(n - 1, -1, -1):  # last element first
        c = classes[seg_of[i]]
        f, b = freq[c][symbols[i]], starts[c][symbols[i]]
        s = x[i % LANES]
        if s >= ((RANS_L >> PROB_BITS) << 16) * f:
            pushed.append(s & 0xFFFF)
            s >>= 16
        x[i % LANES] = (s // f) * (1 << PROB_BITS) + s % f + b
    for lane in range(LANES - 1, -1, -1):
        pushed += [x[lane] >> 16, x[lane] & 0xFFFF]
    rans = pushed[::-1]
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
    if klog:
        padded = classes + [0] * (nseg % 2)
        out += bytes(padded[k] | (padded[k + 1] << 4) for k in range(0, len(padded), 2))
    out += struct.pack("<I", len(tables)) + tables + struct.pack("<I", len(rans))
    return out + struct.pack(f"<{len(rans)}H", *rans) + struct.pack(f"<{len(raw)}I", *raw)


def encode(words: list[int], dtype_name: str, seg: int) -> bytes:
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
    order = sorted(range(nseg), key=lambda j: (means[j], j))
    rank = [0] * nseg
    for r, j in enumerate(order):
        rank[j] = r
    classes16 = [r * 16 // nseg for r in rank]
    alphabet = 1 << (W - 1 - M + TOP)
    hist = np.zeros((16, alphabet), dtype=np.int64)
    for j, idx in _segments(n, seg):
        for i in idx:
            hist[classes16[j], _split(words[i], W, M, zeros[j])[0]] += 1
    klog, precision, sent = choose_classes(hist, nseg)
    classes = [c >> (4 - klog) for c in classes16]
    # raw bits, LSB first
    acc, nacc, raw = 0, 0, []
    for j, idx in _segments(n, seg):
        for i in idx:
            _, r, k = _split(words[i], W, M, zeros[j])
            acc |= r << nacc
            nacc += k
            while nacc >= 32:
                raw.append(acc & 0xFFFFFFFF)
                acc >>= 32
                nacc -= 32
    if nacc:
        raw.append(acc)
    symbols = [_split(words[i], W, M, zeros[j])[0] for j, idx in _segments(n, seg) for i in idx]
    head = bytes([0, zeros[0]]) if nseg and len(set(zeros)) == 1 else b"\x01" + bytes(zeros)
    return head + _tail(symbols, seg, klog, precision, sent, classes, raw)


def decode(data: bytes, dtype_name: str, seg: int, n: int) -> list[int]:
    """The float bits of a valid substream (no validation: the reference of the kernel's arithmetic)."""
    W, M = floatcoder.FORMATS[dtype_name]
    nseg = -(-n // seg)
    pos = 0
    if data[0] == 0:
        zeros, pos = [data[1]] * nseg, 2
    else:
        zeros, pos = list(data[1:1 + nseg]), 1 + nseg
    klog, precision = data[pos], data[pos + 1]
    pos += 2
    classes = [0] * nseg
    if klog:
        packed = data[pos:pos + -(-nseg // 2)]
        pos += len(packed)
        classes = [(packed[j >> 1] >> (4 * (j & 1))) & 15 for j in range(nseg)]
    (tbytes,) = struct.unpack_from("<I", data, pos)
    bits = "".join(f"{b:08b}" for b in data[pos + 4:pos + 4 + tbytes])
    pos += 4 + tbytes
    bp = 0

    def gamma() -> int:
        nonlocal bp
        k = 0
        while bits[bp] == "0":
            k += 1
            bp += 1
        v = int(bits[bp:bp + k + 1], 2)
        bp += k + 1
        return v

    alphabet = 1 << (W - 1 - M + TOP)
    tables = []
    for _ in range(1 << klog):
        sym, total, table = -1, 0, {}
        for _ in range(gamma()):
            sym += gamma()
            f = gamma() << (PROB_BITS - precision)
            table[sym] = (f, total)
            total += f
        tables.append(table)
    assert all(s < alphabet for t in tables for s in t)
    (nr,) = struct.unpack_from("<I", data, pos)
    rans = struct.unpack_from(f"<{nr}H", data, pos + 4)
    pos += 4 + 2 * nr
    raw = struct.unpack_from(f"<{(len(data) - pos) // 4}I", data, pos)
    x = [rans[2 * k] | (rans[2 * k + 1] << 16) for k in range(LANES)]
    p = 2 * LANES
    rawbits = sum(r << (32 * k) for k, r in enumerate(raw))
    rp = 0
    out = []
    for j, idx in _segments(n, seg):
        z = zeros[j]
        mr = M - z
        t = min(TOP, mr)
        low_bits = mr - t
        table = tables[classes[j]]
        for i in idx:
            s = x[i % LANES]
            slot = s & ((1 << PROB_BITS) - 1)
            sym = next(k for k, (f, b) in table.items() if b <= slot < b + f)
            f, b = table[sym]
            s = f * (s >> PROB_BITS) + slot - b
            if s < RANS_L:
                s = (s << 16) | rans[p]
                p += 1
            x[i % LANES] = s
            value = (rawbits >> rp) & ((1 << (low_bits + 1)) - 1)
            rp += low_bits + 1
            top = (sym & ((1 << TOP) - 1)) >> (TOP - t)
            out.append(((value >> low_bits) << (W - 1)) | ((sym >> TOP) << M) | (top << (M - t))
                       | ((value & ((1 << low_bits) - 1)) << z))
    assert x == [RANS_L] * LANES and p == len(rans)
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
