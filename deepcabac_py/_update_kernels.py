"""Numba kernels of the sparse-update coder: the levels of several tensors in one arithmetic-coded
substream, with contexts that use what both ends already know.

Private: call them through :mod:`deepcabac_py.updates`, which validates every argument. The bytes
are specified in ``docs/format.md`` ("Update streams"); the plain-Python reference in
``tests/reference_update_coder.py`` must produce the same bytes.

The range coder (``_shift_low``, bypass bins, terminate bin, flush) is the level coder's, from
:mod:`deepcabac_py._cabac_kernels`. What differs:

* **Estimator.** Sparse significance flags have probabilities down to 1e-3 and below; the level
  coder's 16-bit state with a 1/1024 floor cannot represent them. Here a context keeps a 24-bit
  probability of a 1 and a bin counter; the adaptation shift is ``floor(log2(count + 2))`` up to
  ``RATE_U`` (fast learning while young, a ~2**RATE_U window when mature), and the coder uses
  ``p15 = clamp(p24 >> 9, P_FLOOR, 2**15 - P_FLOOR)``. Contexts live in a session and carry over
  from one round to the next.
* **Binarization** of the levels of a tensor viewed as rows x cols (dim 0 x the rest):
  optional row flag (row has a nonzero), significance flag per position, sign flag (unless the
  tensor's sign is fixed), ``|v| > 1`` flag and an Exp-Golomb remainder (only when the tensor's
  largest magnitude exceeds 1). Coding of a tensor stops once its ``nnz`` nonzeros are out; in a
  row whose flag says "nonzero", a last position reached with no nonzero yet is not coded.
* **Contexts** (each family can be switched off per tensor by a feature bit):
  temporal (the co-located level of the previous update of the session) and history (messages
  since the position was last nonzero, 1 / 2 / 3-4 / 5-8 / 9+, and how often it was, 1 / 2-3 /
  4-7 / 8+, or never) for significance; column activity (nonzeros in the
  same column in earlier rows of this tensor, 0 / 1 / 2+); row activity (none yet
  in this row / some, previous position zero / previous position nonzero); sign contexts from the co-located
  last sign at the position (with its age, 1-2 / 3-8 / 9+), the last sign in the row and the last
  sign in the column.
"""

import numpy as np

from ._cabac_kernels import (
    MAX_BYPASS_GROUP,
    OVERRUN_SLACK,
    PROB_BITS,
    PROB_ONE,
    RANGE_INIT,
    TERMINATE_P,
    TOP,
    _decode_bypass,
    _encode_bypass,
    _finish_substream,
    _shift_low,
)
from ._jit import kernel, scalar_helper

# --- estimator ----------------------------------------------------------------------------------
EST_BITS = 24
EST_HALF = 1 << (EST_BITS - 1)
RATE_U = 10
RATE_MIN = 6
COUNT_MAX = (1 << RATE_U) - 1
SHIFT_U = np.array([min(RATE_U, int(np.log2(n + 2))) for n in range(COUNT_MAX + 1)], dtype=np.int64)
CTX_COLS = 2  # estimate, bins seen
P_FLOOR = 2  # p15 in [P_FLOOR, PROB_ONE - P_FLOOR]

# --- feature bits (per tensor, in the stream) ----------------------------------------------------
F_TEMPORAL = 1
F_HISTORY = 2
F_COLUMN = 4
F_ROW = 8
F_ROWSKIP = 16
F_SIGNCTX = 32
F_AREA = 64
F_ALL = 127

# --- sign modes ---------------------------------------------------------------------------------
SIGN_CODED = 0
SIGN_ALL_POSITIVE = 1
SIGN_ALL_NEGATIVE = 2

# --- context layout (per tensor) ----------------------------------------------------------------
CTX_ROW = 0  # 4: 2 * (parent row had a nonzero) + (previous row had a nonzero)
N_AREA = 9  # 3 row history classes x 3 column history classes
N_TSTATE = 21  # history states: never nonzero, or 5 age classes x 4 count classes
N_COLCLS = 3  # nonzeros in the same column in earlier rows of this message: 0, 1, 2+
N_ROWCLS = 3  # none earlier in this row / some, previous position zero / previous position nonzero
CTX_SIG = 4  # 21 history states x 3 column x 3 row states x 9 areas = 1701
N_SIG_CTX = N_TSTATE * N_COLCLS * N_ROWCLS * N_AREA
CTX_SIGN = CTX_SIG + N_SIG_CTX  # 63: 9 * (last sign x age class, 7) + 3 * row sign + column sign (0 none, 1 +, 2 -)
N_SIGN_CTX = 63
CTX_SIGN_BYPASS = -1
CTX_GT1 = CTX_SIGN + N_SIGN_CTX  # 3: min(|parent|, 2)
CTX_EG = CTX_GT1 + 3  # 16 Exp-Golomb prefix contexts of |v| - 2
N_EG_CTX = 16
N_CTX_U = CTX_EG + N_EG_CTX
MAX_EG_LENGTH = 32

PARENT_MAX = 2  # parent levels are stored clipped to [-2, 2]
# hist (uint16 per position): last sign (bits 0-1: 0 never, 1 +, 2 -) | count of earlier nonzeros
# (bits 2-5, saturating at 15) << 2 | age (bits 6-11: messages since the last nonzero, 1 = the
# previous message, saturating at 63; 0 = never) << 6
HIST_COUNT_SHIFT = 2
HIST_COUNT_MAX = 15
HIST_AGE_SHIFT = 6
HIST_AGE_MAX = 63

# --- column state bits (scratch per tensor) -----------------------------------------------------
# col[c] = count (0..2, saturating) | last sign << 2 (0 none, 1 +, 2 -)
COL_COUNT_MAX = 3  # mask; the count saturates at 2
COL_SIGN_SHIFT = 2

# --- status codes (shared meaning with the level coder where they overlap) -----------------------
OK = 0
ERR_BAD_START = 1
ERR_BAD_ESCAPE = 2
ERR_BAD_VALUE = 3
ERR_BAD_TERMINATE = 4
ERR_OVERRUN = 5
ERR_BAD_BYPASS = 6
ERR_BAD_COUNT = 7


def rate_for(nnz: int, numel: int) -> int:
    """The largest adaptation shift of a tensor's contexts: windows of about 16 / density bins, so
    that a context sees enough nonzeros to follow drifting statistics (RATE_MIN .. RATE_U)."""
    r = 4
    while r < RATE_U and (nnz << r) < (numel << 2):
        r += 1
    return max(RATE_MIN, r)


@scalar_helper
def _p15(state):
    p = state >> (EST_BITS - PROB_BITS)
    if p < P_FLOOR:
        p = P_FLOOR
    elif p > PROB_ONE - P_FLOOR:
        p = PROB_ONE - P_FLOOR
    return p


@scalar_helper
def _bitlen_u(x):
    n = 0
    while x > 0:
        x >>= 1
        n += 1
    return n


@kernel
def _area_classes(hist, off, rows, cols, rowcls, colcls):
    # A rank-1 model of where nonzeros fall: history sums of the position's row and column
    # (per-position counts of earlier nonzeros), each relative to the tensor's average, in octaves.
    # rowcls/colcls hold bitlen(sum) - bitlen(total) + bitlen(count) (or -100 for a zero sum);
    # the class of a position is derived from their sum (see _area_of).
    rowsum = np.zeros(rows, dtype=np.int64)
    colsum = np.zeros(cols, dtype=np.int64)
    total = 0
    for r in range(rows):
        base = off + r * cols
        for c in range(cols):
            h = (np.int64(hist[base + c]) >> HIST_COUNT_SHIFT) & HIST_COUNT_MAX
            rowsum[r] += h
            colsum[c] += h
            total += h
    lt = _bitlen_u(total)
    for r in range(rows):
        rowcls[r] = -100 if rowsum[r] == 0 else _bitlen_u(rowsum[r]) + _bitlen_u(rows) - lt
    for c in range(cols):
        colcls[c] = -100 if colsum[c] == 0 else _bitlen_u(colsum[c]) + _bitlen_u(cols) - lt


@scalar_helper
def _area_of(rc, cc):
    # 0: neither the row nor the column was ever nonzero; 1: one of them never;
    # 2..8: the product of their relative densities, by octave.
    if rc < -50:
        return 0 if cc < -50 else 1
    if cc < -50:
        return 1
    s = rc + cc + 3
    if s < 0:
        s = 0
    elif s > 6:
        s = 6
    return 2 + s


@scalar_helper
def _sig_context(features, parent, hist, colstate, rcount, prev_nz, area):
    if not (features & F_AREA):
        area = 0
    t = 0
    age = (np.int64(hist) >> HIST_AGE_SHIFT) & HIST_AGE_MAX
    if features & F_HISTORY:
        if age > 0:
            # 5 age classes (1, 2, 3-4, 5-8, 9+) x 4 count classes (1, 2-3, 4-7, 8+)
            a = _bitlen_u(age - 1)
            n = _bitlen_u((np.int64(hist) >> HIST_COUNT_SHIFT) & HIST_COUNT_MAX) - 1
            t = 1 + 4 * (a if a < 4 else 4) + (n if n < 3 else 3)
    elif features & F_TEMPORAL:
        if parent != 0:
            t = 1
    cs = 0
    if features & F_COLUMN:
        cs = colstate & COL_COUNT_MAX
        if cs > N_COLCLS - 1:
            cs = N_COLCLS - 1
    rs = 0
    if features & F_ROW:
        if rcount > 0:
            rs = 2 if prev_nz else 1
    return CTX_SIG + ((t * N_COLCLS + cs) * N_ROWCLS + rs) * N_AREA + area


@scalar_helper
def _sign_context(features, parent, hist, rsign, colstate):
    if not (features & F_SIGNCTX):
        return CTX_SIGN_BYPASS
    ps = 0
    if features & F_HISTORY:
        last = hist & 3  # the sign of the last nonzero at this position (sticky)
        if last:
            a = _bitlen_u(((hist >> HIST_AGE_SHIFT) & HIST_AGE_MAX) - 1)  # 0-1: age 1-2, 2-3: 3-8, 4+: 9+
            ps = 1 + 3 * (last - 1) + (2 if a >= 4 else a >> 1)
    elif features & F_TEMPORAL:
        ps = 1 if parent > 0 else (4 if parent < 0 else 0)
    return CTX_SIGN + 9 * ps + 3 * rsign + (colstate >> COL_SIGN_SHIFT)


@kernel
def _row_parent_nonzero(parent, start, cols):
    for j in range(start, start + cols):
        if parent[j] != 0:
            return 1
    return 0


@kernel
def encode_update_kernel(levels, tinfo, parent, hist, ctx, out):
    """Encode the tensors described by ``tinfo`` (int64 [T, 9]: offset, rows, cols, nnz, maxabs,
    sign_mode, features, context offset, adaptation rate from :func:`rate_for`) whose flat int32 levels are concatenated in ``levels``.

    ``parent`` (int8) and ``hist`` (uint16) are co-located with ``levels``; ``ctx`` (int64 [C, 2]:
    24-bit probability, count) is updated in place. Returns the byte count (the first, always-zero
    byte included), or -1 if ``out`` is too small.
    """
    low = 0
    rng = RANGE_INIT
    cache = 0
    cache_size = 1
    pos = 0
    for t in range(tinfo.shape[0]):
        off = tinfo[t, 0]
        rows = tinfo[t, 1]
        cols = tinfo[t, 2]
        nnz = tinfo[t, 3]
        maxabs = tinfo[t, 4]
        sign_mode = tinfo[t, 5]
        features = tinfo[t, 6]
        cbase = tinfo[t, 7]
        rate = tinfo[t, 8]
        col = np.zeros(cols, dtype=np.int64)
        rowcls = np.zeros(rows, dtype=np.int64)
        colcls = np.zeros(cols, dtype=np.int64)
        if features & F_AREA:
            _area_classes(hist, off, rows, cols, rowcls, colcls)
        coded = 0
        prev_row_nz = 0
        for r in range(rows):
            if coded == nnz:
                break
            start = off + r * cols
            row_nz = 1
            if features & F_ROWSKIP:
                row_nz = 0
                for j in range(start, start + cols):
                    if levels[j] != 0:
                        row_nz = 1
                        break
                pr = _row_parent_nonzero(parent, start, cols) if features & F_TEMPORAL else 0
                c = cbase + CTX_ROW + 2 * pr + prev_row_nz
                p = _p15(ctx[c, 0])
                bound = (rng >> PROB_BITS) * p
                if row_nz:
                    rng = bound
                else:
                    low += bound
                    rng -= bound
                ctx[c, 0] += ((row_nz << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                if ctx[c, 1] < COUNT_MAX:
                    ctx[c, 1] += 1
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                prev_row_nz = row_nz
                if not row_nz:
                    continue
            rcount = 0
            prev_nz = 0
            rsign = 0
            for cc in range(cols):
                if coded == nnz:
                    break
                i = start + cc
                v = np.int64(levels[i])
                nz = 1 if v != 0 else 0
                forced = (features & F_ROWSKIP) != 0 and cc == cols - 1 and rcount == 0
                if not forced:
                    c = cbase + _sig_context(features, parent[i], hist[i], col[cc], rcount, prev_nz, _area_of(rowcls[r], colcls[cc]))
                    p = _p15(ctx[c, 0])
                    bound = (rng >> PROB_BITS) * p
                    if nz:
                        rng = bound
                    else:
                        low += bound
                        rng -= bound
                    ctx[c, 0] += ((nz << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                    if ctx[c, 1] < COUNT_MAX:
                        ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                prev_nz = nz
                if not nz:
                    continue
                neg = 1 if v < 0 else 0
                if sign_mode == SIGN_CODED:
                    sc = _sign_context(features, parent[i], np.int64(hist[i]), rsign, col[cc])
                    if sc == CTX_SIGN_BYPASS:
                        low, rng = _encode_bypass(low, rng, neg, 1)
                    else:
                        c = cbase + sc
                        p = _p15(ctx[c, 0])
                        bound = (rng >> PROB_BITS) * p
                        if neg:
                            rng = bound
                        else:
                            low += bound
                            rng -= bound
                        ctx[c, 0] += ((neg << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                        if ctx[c, 1] < COUNT_MAX:
                            ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                a = -v if neg else v
                if maxabs > 1:
                    pa = np.int64(parent[i])
                    if pa < 0:
                        pa = -pa
                    if not (features & F_TEMPORAL):
                        pa = 0
                    gt1 = 1 if a > 1 else 0
                    c = cbase + CTX_GT1 + pa
                    p = _p15(ctx[c, 0])
                    bound = (rng >> PROB_BITS) * p
                    if gt1:
                        rng = bound
                    else:
                        low += bound
                        rng -= bound
                    ctx[c, 0] += ((gt1 << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                    if ctx[c, 1] < COUNT_MAX:
                        ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                    if gt1:
                        x = a - 1  # Exp-Golomb order 0 of a - 2, as x = a - 2 + 1 >= 1
                        length = 0
                        y = x
                        while y > 0:
                            y >>= 1
                            length += 1
                        for j in range(length):
                            bit = 1 if j < length - 1 else 0
                            c = cbase + CTX_EG + (j if j < N_EG_CTX else N_EG_CTX - 1)
                            p = _p15(ctx[c, 0])
                            bound = (rng >> PROB_BITS) * p
                            if bit:
                                rng = bound
                            else:
                                low += bound
                                rng -= bound
                            ctx[c, 0] += ((bit << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                            if ctx[c, 1] < COUNT_MAX:
                                ctx[c, 1] += 1
                            while rng < TOP:
                                rng <<= 8
                                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                        remaining = length - 1
                        while remaining > 0:
                            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                            remaining -= g
                            low, rng = _encode_bypass(low, rng, (x >> remaining) & ((1 << g) - 1), g)
                            while rng < TOP:
                                rng <<= 8
                                low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                coded += 1
                rcount += 1
                s = 2 if neg else 1
                rsign = s
                cnt = col[cc] & COL_COUNT_MAX
                col[cc] = (cnt + 1 if cnt < 2 else 2) | (s << COL_SIGN_SHIFT)

    # Terminate bin (1), then the level coder's flush.
    return _finish_substream(low, rng, cache, cache_size, out, pos)


@kernel
def decode_update_kernel(buf, tinfo, parent, hist, ctx, out):
    """Decode into the zeroed flat int32 ``out`` (same layout as the encoder's ``levels``); ``buf``
    starts at the encoder's second byte. ``ctx`` is updated in place. Returns a status code."""
    size = buf.shape[0]
    rng = RANGE_INIT
    code = 0
    pos = 0
    for _ in range(4):
        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
        pos += 1
    if code >= rng:
        return ERR_BAD_START
    for t in range(tinfo.shape[0]):
        off = tinfo[t, 0]
        rows = tinfo[t, 1]
        cols = tinfo[t, 2]
        nnz = tinfo[t, 3]
        maxabs = tinfo[t, 4]
        sign_mode = tinfo[t, 5]
        features = tinfo[t, 6]
        cbase = tinfo[t, 7]
        rate = tinfo[t, 8]
        col = np.zeros(cols, dtype=np.int64)
        rowcls = np.zeros(rows, dtype=np.int64)
        colcls = np.zeros(cols, dtype=np.int64)
        if features & F_AREA:
            _area_classes(hist, off, rows, cols, rowcls, colcls)
        coded = 0
        prev_row_nz = 0
        for r in range(rows):
            if coded == nnz:
                break
            start = off + r * cols
            if features & F_ROWSKIP:
                pr = _row_parent_nonzero(parent, start, cols) if features & F_TEMPORAL else 0
                c = cbase + CTX_ROW + 2 * pr + prev_row_nz
                p = _p15(ctx[c, 0])
                bound = (rng >> PROB_BITS) * p
                if code < bound:
                    row_nz = 1
                    rng = bound
                else:
                    row_nz = 0
                    code -= bound
                    rng -= bound
                ctx[c, 0] += ((row_nz << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                if ctx[c, 1] < COUNT_MAX:
                    ctx[c, 1] += 1
                while rng < TOP:
                    rng <<= 8
                    code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                    pos += 1
                prev_row_nz = row_nz
                if not row_nz:
                    continue
            rcount = 0
            prev_nz = 0
            rsign = 0
            for cc in range(cols):
                if coded == nnz:
                    break
                i = start + cc
                forced = (features & F_ROWSKIP) != 0 and cc == cols - 1 and rcount == 0
                if forced:
                    nz = 1
                else:
                    c = cbase + _sig_context(features, parent[i], hist[i], col[cc], rcount, prev_nz, _area_of(rowcls[r], colcls[cc]))
                    p = _p15(ctx[c, 0])
                    bound = (rng >> PROB_BITS) * p
                    if code < bound:
                        nz = 1
                        rng = bound
                    else:
                        nz = 0
                        code -= bound
                        rng -= bound
                    ctx[c, 0] += ((nz << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                    if ctx[c, 1] < COUNT_MAX:
                        ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                        pos += 1
                prev_nz = nz
                if not nz:
                    continue
                neg = 0
                if sign_mode == SIGN_CODED:
                    sc = _sign_context(features, parent[i], np.int64(hist[i]), rsign, col[cc])
                    if sc == CTX_SIGN_BYPASS:
                        code, rng, neg = _decode_bypass(code, rng, 1)
                        if code >= rng:
                            return ERR_BAD_BYPASS
                    else:
                        c = cbase + sc
                        p = _p15(ctx[c, 0])
                        bound = (rng >> PROB_BITS) * p
                        if code < bound:
                            neg = 1
                            rng = bound
                        else:
                            neg = 0
                            code -= bound
                            rng -= bound
                        ctx[c, 0] += ((neg << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                        if ctx[c, 1] < COUNT_MAX:
                            ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                        pos += 1
                elif sign_mode == SIGN_ALL_NEGATIVE:
                    neg = 1
                a = 1
                if maxabs > 1:
                    pa = np.int64(parent[i])
                    if pa < 0:
                        pa = -pa
                    if not (features & F_TEMPORAL):
                        pa = 0
                    c = cbase + CTX_GT1 + pa
                    p = _p15(ctx[c, 0])
                    bound = (rng >> PROB_BITS) * p
                    if code < bound:
                        gt1 = 1
                        rng = bound
                    else:
                        gt1 = 0
                        code -= bound
                        rng -= bound
                    ctx[c, 0] += ((gt1 << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                    if ctx[c, 1] < COUNT_MAX:
                        ctx[c, 1] += 1
                    while rng < TOP:
                        rng <<= 8
                        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                        pos += 1
                    if gt1:
                        length = 1
                        while True:
                            j = length - 1
                            c = cbase + CTX_EG + (j if j < N_EG_CTX else N_EG_CTX - 1)
                            p = _p15(ctx[c, 0])
                            bound = (rng >> PROB_BITS) * p
                            if code < bound:
                                bit = 1
                                rng = bound
                            else:
                                bit = 0
                                code -= bound
                                rng -= bound
                            ctx[c, 0] += ((bit << EST_BITS) - ctx[c, 0]) >> min(SHIFT_U[ctx[c, 1]], rate)
                            if ctx[c, 1] < COUNT_MAX:
                                ctx[c, 1] += 1
                            while rng < TOP:
                                rng <<= 8
                                code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                                pos += 1
                            if bit == 0:
                                break
                            length += 1
                            if length > MAX_EG_LENGTH:
                                return ERR_BAD_ESCAPE
                        x = 1
                        remaining = length - 1
                        while remaining > 0:
                            g = remaining if remaining < MAX_BYPASS_GROUP else MAX_BYPASS_GROUP
                            remaining -= g
                            code, rng, bits = _decode_bypass(code, rng, g)
                            if code >= rng:
                                return ERR_BAD_BYPASS
                            x = (x << g) | bits
                            while rng < TOP:
                                rng <<= 8
                                code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                                pos += 1
                        a = x + 1
                        if a > maxabs:
                            return ERR_BAD_VALUE
                out[i] = -a if neg else a
                coded += 1
                rcount += 1
                s = 2 if neg else 1
                rsign = s
                cnt = col[cc] & COL_COUNT_MAX
                col[cc] = (cnt + 1 if cnt < 2 else 2) | (s << COL_SIGN_SHIFT)
        if coded != nnz:
            return ERR_BAD_COUNT

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
