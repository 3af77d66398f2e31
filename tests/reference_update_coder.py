"""A slow, plain-Python reference of the sparse-update coder in ``deepcabac_py/updates/K.py``.

Written from the algorithm the kernel module documents, with Python ints only; the range coder is
the level coder's reference (:mod:`reference_coder`). Only constants are imported from the kernel
module. Entry points take plain lists, one dict per tensor:

    {"levels": [...], "rows": R, "cols": C, "nnz": k, "maxabs": m, "sign_mode": s, "features": f,
     "parent": [...], "hist": [...], "ctx": [[p24, count], ...]}   (ctx is updated in place)

:func:`encode` returns what ``updates._cabac_encode`` returns (first byte dropped, trailing zeros
stripped as the level coder does); :func:`decode` returns the levels per tensor.
"""

from __future__ import annotations

from reference_coder import OVERRUN_SLACK, RangeDecoder, RangeEncoder, ReferenceDecodeError

from deepcabac_py.updates import _update_kernels as K

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


def area_classes(hist, rows, cols, recent=False):
    """Row and column classes from the history counts, or (recent) from the positions nonzero in the
    last RECENT_AGE messages."""
    if recent:
        w = [1 if 0 < hist_age(h) <= K.RECENT_AGE else 0 for h in hist]
    else:
        w = [hist_count(h) for h in hist]
    rowsum = [sum(w[r * cols + c] for c in range(cols)) for r in range(rows)]
    colsum = [sum(w[r * cols + c] for r in range(rows)) for c in range(cols)]
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


def tstate(f, parent, hist) -> int:
    """History state 0..20 (HISTORY), else 1 for a nonzero parent level (TEMPORAL), else 0."""
    age, count = hist_age(hist), hist_count(hist)
    if f & K.F_HISTORY:
        if age > 0:  # age classes 1, 2, 3-4, 5-8, 9+; count classes 1, 2-3, 4-7, 8+
            return 1 + 4 * min((age - 1).bit_length(), 4) + min(count.bit_length() - 1, 3)
        return 0
    return 1 if f & K.F_TEMPORAL and parent != 0 else 0


def sig_context(f, t, colstate, rcount, prev_nz, area) -> int:
    cs = min(colstate & K.COL_COUNT_MAX, 2) if f & K.F_COLUMN else 0
    rs = (2 if prev_nz else 1) if (f & K.F_ROW and rcount > 0) else 0
    return K.CTX_SIG + ((t * K.N_COLCLS + cs) * K.N_ROWCLS + rs) * K.N_AREA + area


def density_q(nnz: int, numel: int) -> int:
    return (nnz << 20) // numel if nnz < (1 << 42) else nnz // (numel >> 20)


def crel(count: int, expected4: int) -> int:
    """Within-message density class: 0/1 nothing yet (fewer / at least one expected), 2..6 by octave."""
    if count == 0:
        return 0 if expected4 < 4 else 1
    return 2 + min(max((count * 4).bit_length() - (expected4 + 1).bit_length() + 2, 0), 4)


def m1_context(f, t, r, c, ccount, rcount, dq) -> int:
    cr = crel(ccount, (min(r, 1 << 40) * dq) >> 18) if f & K.F_COLUMN else 0
    rr = crel(rcount, (min(c, 1 << 40) * dq) >> 18) if f & K.F_ROW else 0
    return K.CTX_M1 + (t * K.N_CREL + cr) * K.N_CREL + rr, cr, rr


def hist_class(x: int) -> int:
    return 0 if x < -50 else 1 + min(max(x + 3, 0), 6)


def m2_context(f, hist, rc, cl, prev_nz) -> int:
    tc = 0
    age = hist_age(hist)
    if f & K.F_HISTORY and age > 0:
        tc = 1 if age == 1 else (2 if age <= 4 else 3)
    rcl, ccl = (hist_class(rc), hist_class(cl)) if f & K.F_AREA else (0, 0)
    pn = 1 if (f & K.F_ROW and prev_nz) else 0
    return K.CTX_M2 + ((tc * 8 + rcl) * 8 + ccl) * 2 + pn


def sign_state(f, parent, hist) -> int:
    if f & K.F_HISTORY:
        last = hist & 3
        if last:  # with the age class 1-2, 3-8, 9+
            a = (hist_age(hist) - 1).bit_length()
            return 1 + 3 * (last - 1) + (2 if a >= 4 else a >> 1)
        return 0
    if f & K.F_TEMPORAL:
        return 1 if parent > 0 else (4 if parent < 0 else 0)
    return 0


def sign_context(ps, rsign, colstate) -> int:
    return K.CTX_SIGN + 9 * ps + 3 * rsign + (colstate >> K.COL_SIGN_SHIFT)


def s2_context(rsum: int, csum: int) -> int:
    m = abs(rsum)
    v = 0 if m == 0 else (1 if m == 1 else (2 if m < 4 else 3)) + (3 if rsum < 0 else 0)
    return K.CTX_S2 + 3 * v + (0 if csum == 0 else (1 if csum > 0 else 2))


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

    def mixbin(self, cs: list[int], wb: int, bit: int | None = None, wb2: int | None = None) -> int:
        """One bin whose probability mixes the contexts ``cs`` with the weights at ``wb`` (and, given
        ``wb2``, with a second weight set: the bin takes the average of the two in the stretch
        domain, each set learns from its own error)."""
        ctx = self.ctx
        st = [int(K.STRETCH[p15(ctx[c][0])]) for c in cs] + [K.MIX_BIAS]
        sets = [wb] if wb2 is None else [wb, wb2]
        ds = [min(max(sum(ctx[w + j][0] * x for j, x in enumerate(st)) >> 16, -K.ST_MAX), K.ST_MAX) for w in sets]
        d = ds[0] if wb2 is None else (ds[0] + ds[1]) >> 1
        p = min(max(int(K.SQUASH[d + K.ST_MAX]), K.P_FLOOR), K.PROB_ONE - K.P_FLOOR)
        if self.enc is not None:
            self.enc.encode_bit(bit, p)
        else:
            bit = self.dec.decode_bit(p)
        for w, dw in zip(sets, ds):
            own = p if wb2 is None else int(K.SQUASH[dw + K.ST_MAX])
            err = (bit << K.PROB_BITS) - own
            for j, x in enumerate(st):
                v = ctx[w + j][0] + ((err * x + K.MIX_LR_ROUND) >> K.MIX_LR_SHIFT)
                ctx[w + j] = [min(max(v, -K.MIX_W_MAX), K.MIX_W_MAX), ctx[w + j][1]]
        for c in cs:
            adapt(ctx, c, bit, self.rate)
        return bit


def _code_tensor(t: dict, io: _Bins, decode: bool) -> list:
    rows, cols, nnz, maxabs = t["rows"], t["cols"], t["nnz"], t["maxabs"]
    f, mode, parent, hist = t["features"], t["sign_mode"], t["parent"], t["hist"]
    levels = [0] * (rows * cols) if decode else t["levels"]
    col = [0] * cols
    if f & K.F_AREA:
        rowcls, colcls = area_classes(hist, rows, cols)
    else:
        rowcls, colcls = [0] * rows, [0] * cols
    mix = bool(f & K.F_MIX)
    if mix and f & K.F_AREA:
        rrec, crec = area_classes(hist, rows, cols, recent=True)
    else:
        rrec, crec = [0] * rows, [0] * cols
    colcnt = [0] * cols
    csum = [0] * cols
    dq = density_q(nnz, rows * cols)
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
        rcount = prev_nz = rsign = rsum = 0
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
                t_ = tstate(f, parent[i], hist[i])
                ctxi = sig_context(f, t_, col[c], rcount, prev_nz, area)
                want = None if decode else int(v != 0)
                if mix:
                    m1, cr, rr = m1_context(f, t_, r, c, colcnt[c], rcount, dq)
                    cs = [ctxi, m1, m2_context(f, hist[i], rrec[r], crec[c], prev_nz),
                          K.CTX_COLID + (c & (K.N_COLID - 1)), K.CTX_ROWID + (r & (K.N_ROWID - 1))]
                    nz = io.mixbin(cs, K.CTX_WSIG + t_ * (K.N_SIG_MODELS + 1), want,
                                   K.CTX_WSIG2 + (cr * K.N_CREL + rr) * (K.N_SIG_MODELS + 1))
                else:
                    nz = io.bin(ctxi, want)
            prev_nz = nz
            if not nz:
                continue
            neg = 0 if decode else int(v < 0)
            if mode == K.SIGN_CODED:
                if not f & K.F_SIGNCTX:
                    neg = io.bypass(None if decode else neg, 1)
                else:
                    ps = sign_state(f, parent[i], hist[i])
                    sc = sign_context(ps, rsign, col[c])
                    if mix:
                        pm = min(ps, 6)  # (a last-sign field of 3, which no session holds, stays in range)
                        cs = [sc, K.CTX_S1 + 3 * pm + (col[c] >> K.COL_SIGN_SHIFT), s2_context(rsum, csum[c]),
                              K.CTX_SROW + (r & (K.N_SROW - 1))]
                        neg = io.mixbin(cs, K.CTX_WSIGN + pm * (K.N_SIGN_MODELS + 1), None if decode else neg)
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
            colcnt[c] += 1
            rsum += -1 if neg else 1
            csum[c] += -1 if neg else 1
    if decode and coded != nnz:
        raise ReferenceDecodeError(K.ERR_BAD_COUNT)
    return levels


def encode(tensors: list[dict]) -> bytes:
    enc = RangeEncoder()
    for t in tensors:
        _code_tensor(t, _Bins(t["ctx"], rate_for(t["nnz"], t["rows"] * t["cols"]), enc=enc), decode=False)
    if not any(t["features"] & K.F_MIX for t in tensors):  # format 2 payloads have no terminate bin
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
    if any(t["features"] & K.F_MIX for t in tensors):
        if dec.pos > len(data) + OVERRUN_SLACK:
            raise ReferenceDecodeError(K.ERR_OVERRUN)
    else:
        dec.decode_terminate()
    return out
