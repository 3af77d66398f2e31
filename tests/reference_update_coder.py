"""A slow, plain-Python reference of the sparse-update coder in ``deepcabac_py/_update_kernels.py``.

Written from the algorithm the kernel module documents, with Python ints only; the range coder is
the level coder's reference (:mod:`reference_coder`). Only constants are imported from the kernel
module. Entry points take plain lists, one dict per tensor:

    {"levels": [...], "rows": R, "cols": C, "nnz": k, "maxabs": m, "sign_mode": s, "features": f,
     "parent": [...], "hist": [...], "ctx": [[p24, count], ...]}   (ctx is updated in place)

:func:`encode` returns what ``updates._cabac_encode`` returns (first byte dropped, trailing zeros
stripped as the level coder does); :func:`decode` returns the levels per tensor.
"""

from __future__ import annotations

from deepcabac_py import _update_kernels as K
from reference_coder import RangeDecoder, RangeEncoder, ReferenceDecodeError

MAX_STRIPPED = 4


def shift_for(count: int) -> int:
    return min(K.RATE_U, (count + 2).bit_length() - 1)


def p15(state: int) -> int:
    return min(max(state >> (K.EST_BITS - K.PROB_BITS), K.P_FLOOR), K.PROB_ONE - K.P_FLOOR)


def rate_for(nnz: int, numel: int) -> int:
    """Largest adaptation shift: the smallest r >= 4 with nnz * 2**r >= 4 * numel, in [RATE_MIN, RATE_U]."""
    r = 4
    while r < K.RATE_U and nnz * 2 ** r < 4 * numel:
        r += 1
    return max(K.RATE_MIN, r)


def adapt(ctx: list, c: int, bit: int, rate: int) -> None:
    p, n = ctx[c]
    p += ((bit << K.EST_BITS) - p) >> min(shift_for(n), rate)
    ctx[c] = [p, min(n + 1, K.COUNT_MAX)]


def hist_count(h: int) -> int:
    return (h >> K.HIST_COUNT_SHIFT) & K.HIST_COUNT_MAX


def hist_age(h: int) -> int:
    return (h >> K.HIST_AGE_SHIFT) & K.HIST_AGE_MAX


def area_classes(hist, rows, cols):
    rowsum = [sum(hist_count(hist[r * cols + c]) for c in range(cols)) for r in range(rows)]
    colsum = [sum(hist_count(hist[r * cols + c]) for r in range(rows)) for c in range(cols)]
    lt = sum(rowsum).bit_length()
    rc = [-100 if s == 0 else s.bit_length() + rows.bit_length() - lt for s in rowsum]
    cc = [-100 if s == 0 else s.bit_length() + cols.bit_length() - lt for s in colsum]
    return rc, cc


def area_of(rc: int, cc: int) -> int:
    if rc < -50:
        return 0 if cc < -50 else 1
    if cc < -50:
        return 1
    return 2 + min(6, max(0, rc + cc + 3))


def sig_context(f, parent, hist, colstate, rcount, prev_nz, area) -> int:
    t = 0
    age, count = hist_age(hist), hist_count(hist)
    if f & K.F_HISTORY:
        if age > 0:  # age classes 1, 2, 3-4, 5-8, 9+; count classes 1, 2-3, 4-7, 8+
            t = 1 + 4 * min((age - 1).bit_length(), 4) + min(count.bit_length() - 1, 3)
    elif f & K.F_TEMPORAL and parent != 0:
        t = 1
    cs = min(colstate & K.COL_COUNT_MAX, 2) if f & K.F_COLUMN else 0
    rs = (2 if prev_nz else 1) if (f & K.F_ROW and rcount > 0) else 0
    return K.CTX_SIG + ((t * K.N_COLCLS + cs) * K.N_ROWCLS + rs) * K.N_AREA + area


def sign_context(f, parent, hist, rsign, colstate) -> int | None:
    if not f & K.F_SIGNCTX:
        return None
    ps = 0
    if f & K.F_HISTORY:
        last = hist & 3
        if last:  # with the age class 1-2, 3-8, 9+
            a = (hist_age(hist) - 1).bit_length()
            ps = 1 + 3 * (last - 1) + (2 if a >= 4 else a >> 1)
    elif f & K.F_TEMPORAL:
        ps = 1 if parent > 0 else (4 if parent < 0 else 0)
    return K.CTX_SIGN + 9 * ps + 3 * rsign + (colstate >> K.COL_SIGN_SHIFT)


class _Bins:
    """Bin I/O on top of the reference range coder, shared by encoder and decoder."""

    def __init__(self, ctx, rate: int, enc: RangeEncoder | None = None, dec: RangeDecoder | None = None):
        self.ctx, self.rate, self.enc, self.dec = ctx, rate, enc, dec

    def bin(self, c: int, bit: int | None = None) -> int:
        p = p15(self.ctx[c][0])
        if self.enc is not None:
            self.enc.encode_bit(bit, p)
        else:
            bit = self.dec.decode_bit(p)
        adapt(self.ctx, c, bit, self.rate)
        return bit

    def bypass(self, value: int | None, nbits: int) -> int:
        if self.enc is not None:
            self.enc.encode_bypass(value, nbits)
            return value
        return self.dec.decode_bypass(nbits)


def _code_tensor(t: dict, io: _Bins, decode: bool) -> list:
    rows, cols, nnz, maxabs = t["rows"], t["cols"], t["nnz"], t["maxabs"]
    f, mode, parent, hist = t["features"], t["sign_mode"], t["parent"], t["hist"]
    levels = [0] * (rows * cols) if decode else t["levels"]
    col = [0] * cols
    if f & K.F_AREA:
        rowcls, colcls = area_classes(hist, rows, cols)
    else:
        rowcls, colcls = [0] * rows, [0] * cols
    coded = 0
    prev_row_nz = 0
    for r in range(rows):
        if coded == nnz:
            break
        start = r * cols
        if f & K.F_ROWSKIP:
            pr = int(any(parent[start:start + cols])) if f & K.F_TEMPORAL else 0
            want = None if decode else int(any(levels[start:start + cols]))
            row_nz = io.bin(K.CTX_ROW + 2 * pr + prev_row_nz, want)
            prev_row_nz = row_nz
            if not row_nz:
                continue
        rcount = prev_nz = rsign = 0
        for c in range(cols):
            if coded == nnz:
                break
            i = start + c
            v = None if decode else levels[i]
            forced = bool(f & K.F_ROWSKIP) and c == cols - 1 and rcount == 0
            if forced:
                nz = 1
            else:
                area = area_of(rowcls[r], colcls[c]) if f & K.F_AREA else 0
                ctxi = sig_context(f, parent[i], hist[i], col[c], rcount, prev_nz, area)
                nz = io.bin(ctxi, None if decode else int(v != 0))
            prev_nz = nz
            if not nz:
                continue
            neg = 0 if decode else int(v < 0)
            if mode == K.SIGN_CODED:
                sc = sign_context(f, parent[i], hist[i], rsign, col[c])
                if sc is None:
                    neg = io.bypass(None if decode else neg, 1)
                else:
                    neg = io.bin(sc, None if decode else neg)
            elif mode == K.SIGN_ALL_NEGATIVE:
                neg = 1
            a = 1 if decode else abs(v)
            if maxabs > 1:
                pa = min(abs(parent[i]), 2) if f & K.F_TEMPORAL else 0
                gt1 = io.bin(K.CTX_GT1 + pa, None if decode else int(a > 1))
                if gt1:
                    if decode:
                        length = 1
                        while io.bin(K.CTX_EG + min(length - 1, K.N_EG_CTX - 1)):
                            length += 1
                            if length > K.MAX_EG_LENGTH:
                                raise ReferenceDecodeError(K.ERR_BAD_ESCAPE)
                        x = (1 << (length - 1)) | io.bypass(None, length - 1)
                        a = x + 1
                        if a > maxabs:
                            raise ReferenceDecodeError(K.ERR_BAD_VALUE)
                    else:
                        x = a - 1
                        length = x.bit_length()
                        for j in range(length):
                            io.bin(K.CTX_EG + min(j, K.N_EG_CTX - 1), 1 if j < length - 1 else 0)
                        io.bypass(x & ((1 << (length - 1)) - 1), length - 1)
            if decode:
                levels[i] = -a if neg else a
            coded += 1
            rcount += 1
            s = 2 if neg else 1
            rsign = s
            col[c] = min((col[c] & K.COL_COUNT_MAX) + 1, 2) | (s << K.COL_SIGN_SHIFT)
    if decode and coded != nnz:
        raise ReferenceDecodeError(K.ERR_BAD_COUNT)
    return levels


def encode(tensors: list[dict]) -> bytes:
    enc = RangeEncoder()
    for t in tensors:
        _code_tensor(t, _Bins(t["ctx"], rate_for(t["nnz"], t["rows"] * t["cols"]), enc=enc), decode=False)
    enc.encode_terminate()
    out = enc.finish()
    assert out[0] == 0
    out = out[1:]
    stripped = 0
    while len(out) > 0 and out[-1] == 0 and stripped < MAX_STRIPPED:
        out = out[:-1]
        stripped += 1
    return bytes(out)


def decode(data: bytes, tensors: list[dict]) -> list[list]:
    dec = RangeDecoder(data)
    out = [_code_tensor(t, _Bins(t["ctx"], rate_for(t["nnz"], t["rows"] * t["cols"]), dec=dec), decode=True)
           for t in tensors]
    dec.decode_terminate()
    return out
