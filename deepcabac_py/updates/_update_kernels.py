"""Numba kernels of the sparse-update coder: the levels of several tensors in one arithmetic-coded
substream, with contexts that use what both ends already know.

Private: call them through :mod:`deepcabac_py.updates.messages`, which validates every argument. The bytes
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
* **Mixing** (feature MIX, update format 2): the significance bin mixes, in the logistic domain
  with weights learned online, the context above with four more (two mixers, one with a weight set
  per history state, one per column x row density class, averaged): the
  history state x the density of this column and of this row so far against the tensor's known
  density, recency x the row and column classes of recent activity (nonzeros in the last 4
  messages), one context per column and one per row (adaptive across messages). The sign bin mixes
  its context with three more: last sign x column sign, the sign sums of the row and column so far,
  one context per row. On the MNIST benchmark (``benchmarks/bench_updates.py``) this took
  ours/Golomb from 0.715 / 0.699 / 0.692 to 0.664 / 0.649 / 0.635 at densities 0.1 / 0.01 / 0.001
  (with the unterminated flush of format-2 payloads).
"""

import math
import zlib

import numpy as np

from .._jit import helper, inline, kernel
from ..entropy._cabac_kernels import (
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
    _flush_substream,
    _shift_low,
)

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
F_MIX = 128  # significance and sign probabilities mix several context models (update format 2)
F_ALL = 255
F_ALL_V1 = 127  # the feature bits of update format 1

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
CTX_GT1 = CTX_SIGN + N_SIGN_CTX  # 3: min(|parent|, 2)
CTX_EG = CTX_GT1 + 3  # 16 Exp-Golomb prefix contexts of |v| - 2
N_EG_CTX = 16
N_CTX_V1 = CTX_EG + N_EG_CTX  # 1787: the contexts of update format 1
# With F_MIX, the significance bin mixes 5 models (the one above and 4 more) and the sign bin 4:
N_CREL = 7  # within-message density class of the column (and of the row), see _crel
CTX_M1 = N_CTX_V1  # 21 history states x 7 column x 7 row density classes = 1029
N_M1 = N_TSTATE * N_CREL * N_CREL
CTX_M2 = CTX_M1 + N_M1  # 4 ages x 8 row x 8 column recent-activity classes x previous position nonzero = 512
N_M2 = 4 * 8 * 8 * 2
CTX_COLID = CTX_M2 + N_M2  # one context per column (index mod 1024)
N_COLID = 1024
CTX_ROWID = CTX_COLID + N_COLID  # one per row (mod 512)
N_ROWID = 512
CTX_S1 = CTX_ROWID + N_ROWID  # sign: 7 last-sign states x column sign (3) = 21
CTX_S2 = CTX_S1 + 21  # sign: 7 row sign-sum classes x 3 column sign-sum classes = 21
CTX_SROW = CTX_S2 + 21  # sign: one per row (mod 256)
N_SROW = 256
N_SIG_MODELS = 5
N_SIGN_MODELS = 4
CTX_WSIG = CTX_SROW + N_SROW  # mixing weights of the significance bin: 21 sets (history state) x 6
CTX_WSIGN = CTX_WSIG + N_TSTATE * (N_SIG_MODELS + 1)  # of the sign bin: 7 sets (last sign state) x 5
# The significance bin has a second mixer of the same inputs, its weight set chosen by the column and
# row density classes (cr, rr) of M1; the bin is coded with the average of the two in the stretch domain.
CTX_WSIG2 = CTX_WSIGN + 7 * (N_SIGN_MODELS + 1)  # 49 sets x 6
N_CTX_U = CTX_WSIG2 + N_CREL * N_CREL * (N_SIG_MODELS + 1)
MAX_EG_LENGTH = 32

# --- logistic mixing (F_MIX) ----------------------------------------------------------------------
# Probabilities enter the mixer as stretch(p) = ln(p / (1 - p)) in units of 1/256 (a table over p15),
# are weighted (16.16 fixed point weights, one set per context class) and leave it through squash,
# the inverse (a table over [-ST_MAX, ST_MAX]). After the bin, each weight moves by
# (err * input + MIX_LR_ROUND) >> MIX_LR_SHIFT with err = (bin << 15) - p15, and every model's
# context adapts as a plain context does. The weights live in the context array (column 0), so they carry over with it.
ST_SCALE = 256
ST_MAX = 3071
MIX_W_MAX = 1 << 22  # weights are clamped to [-64, 64]
MIX_BIAS = 64  # the constant input (0.25)
MIX_LR_SHIFT = 15
# rounded: a floored step drifts the weights (measured 0.676 instead of 0.658 ours/Golomb at density 0.01)
MIX_LR_ROUND = 1 << (MIX_LR_SHIFT - 1)
W0_SIG = (19660, 13107, 13107, 9830, 9830, 0)  # 0.3, 0.2, 0.2, 0.15, 0.15; bias 0
W0_SIGN = (19660, 16384, 16384, 13107, 0)  # 0.3, 0.25, 0.25, 0.2; bias 0


def _stretch_table() -> np.ndarray:
    t = np.zeros(PROB_ONE, dtype=np.int32)
    for p in range(1, PROB_ONE):
        t[p] = math.floor(ST_SCALE * math.log(p / (PROB_ONE - p)) + 0.5)
    return t


def _squash_table() -> np.ndarray:
    return np.array([math.floor(PROB_ONE / (1.0 + math.exp(-d / ST_SCALE)) + 0.5) for d in range(-ST_MAX, ST_MAX + 1)],
                    dtype=np.int32)


STRETCH = _stretch_table()
SQUASH = _squash_table()
# The tables come from the platform's libm; the bytes depend on every entry, so check them once.
# No entry is near a rounding boundary (the closest value before flooring is 1.6e-7 from one, about
# 10^9 ulps), so any libm accurate to a few ulps builds the same tables and this check does not fire.
_TABLES_CRC = 0xC83BD98F
if zlib.crc32(STRETCH.tobytes() + SQUASH.tobytes()) != _TABLES_CRC:  # pragma: no cover
    raise ImportError("the mixing tables of the update coder differ from the specified ones on this platform")


def _hist_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Over the 12 bits of a hist value: the history state (t of the significance contexts, with
    # HISTORY), the recency class of M2 and the last-sign state (ps, with HISTORY); the kernels look
    # them up instead of taking the fields apart at every position.
    t = np.zeros(1 << 12, dtype=np.int64)
    tc = np.zeros(1 << 12, dtype=np.int64)
    ps = np.zeros(1 << 12, dtype=np.int64)
    for h in range(1 << 12):
        age = (h >> HIST_AGE_SHIFT) & HIST_AGE_MAX
        count = (h >> HIST_COUNT_SHIFT) & HIST_COUNT_MAX
        last = h & 3
        if age > 0:
            t[h] = 1 + 4 * min((age - 1).bit_length(), 4) + min(count.bit_length() - 1, 3)
            tc[h] = 1 if age == 1 else (2 if age <= 4 else 3)
        if last:
            a = (age - 1).bit_length() if age > 0 else 0
            ps[h] = 1 + 3 * (last - 1) + (2 if a >= 4 else a >> 1)
    return t, tc, ps


def fresh_contexts(n_tensors: int = 1) -> np.ndarray:
    """The contexts (int64 [n_tensors * N_CTX_U, 2]) of tensors never coded: p = 1/2, count 0,
    initial mixing weights."""
    block = np.zeros((N_CTX_U, CTX_COLS), dtype=np.int64)
    block[:CTX_WSIG, 0] = EST_HALF
    for k in range(N_TSTATE):
        block[CTX_WSIG + k * (N_SIG_MODELS + 1):CTX_WSIG + (k + 1) * (N_SIG_MODELS + 1), 0] = W0_SIG
    for k in range(7):
        block[CTX_WSIGN + k * (N_SIGN_MODELS + 1):CTX_WSIGN + (k + 1) * (N_SIGN_MODELS + 1), 0] = W0_SIGN
    for k in range(N_CREL * N_CREL):
        block[CTX_WSIG2 + k * (N_SIG_MODELS + 1):CTX_WSIG2 + (k + 1) * (N_SIG_MODELS + 1), 0] = W0_SIG
    return np.tile(block, (n_tensors, 1))


PARENT_MAX = 2  # parent levels are stored clipped to [-2, 2]
# hist (uint16 per position): last sign (bits 0-1: 0 never, 1 +, 2 -) | count of earlier nonzeros
# (bits 2-5, saturating at 15) << 2 | age (bits 6-11: messages since the last nonzero, 1 = the
# previous message, saturating at 63; 0 = never) << 6
HIST_COUNT_SHIFT = 2
HIST_COUNT_MAX = 15
HIST_AGE_SHIFT = 6
HIST_AGE_MAX = 63
RECENT_AGE = 4  # M2's row and column classes count the positions nonzero in the last 4 messages
HIST_T, HIST_TC, HIST_PS = _hist_tables()
HIST_MASK = (1 << 12) - 1
BITLEN8 = np.array([n.bit_length() for n in range(256)], dtype=np.int64)

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


@helper
def _p15(state):
    p = state >> (EST_BITS - PROB_BITS)
    if p < P_FLOOR:
        p = P_FLOOR
    elif p > PROB_ONE - P_FLOOR:
        p = PROB_ONE - P_FLOOR
    return p


@helper
def _bitlen_u(x):
    n = 0
    while x > 0:
        x >>= 1
        n += 1
    return n


@kernel
def _area_classes(hist, off, rows, cols, rowcls, colcls, recent):
    # A rank-1 model of where nonzeros fall: history sums of the position's row and column
    # (per-position counts of earlier nonzeros; with ``recent``, whether the position was nonzero
    # in the last RECENT_AGE messages), each relative to the tensor's average, in octaves.
    # rowcls/colcls hold bitlen(sum) - bitlen(total) + bitlen(count) (or -100 for a zero sum);
    # the class of a position is derived from their sum (see _area_of, _hist_class).
    rowsum = np.zeros(rows, dtype=np.int64)
    colsum = np.zeros(cols, dtype=np.int64)
    total = 0
    for r in range(rows):
        base = off + r * cols
        for c in range(cols):
            if recent:
                a = (np.int64(hist[base + c]) >> HIST_AGE_SHIFT) & HIST_AGE_MAX
                h = 1 if 0 < a <= RECENT_AGE else 0
            else:
                h = (np.int64(hist[base + c]) >> HIST_COUNT_SHIFT) & HIST_COUNT_MAX
            rowsum[r] += h
            colsum[c] += h
            total += h
    lt = _bitlen_u(total)
    for r in range(rows):
        rowcls[r] = -100 if rowsum[r] == 0 else _bitlen_u(rowsum[r]) + _bitlen_u(rows) - lt
    for c in range(cols):
        colcls[c] = -100 if colsum[c] == 0 else _bitlen_u(colsum[c]) + _bitlen_u(cols) - lt


@inline
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


@inline
def _tstate(features, parent, hist):
    # The position's history state (0..20): with HISTORY, 0 if never nonzero, else 5 age classes
    # (1, 2, 3-4, 5-8, 9+) x 4 count classes (1, 2-3, 4-7, 8+); else 1 if TEMPORAL and the parent
    # level is nonzero, 0 otherwise.
    if features & F_HISTORY:
        return HIST_T[np.int64(hist) & HIST_MASK]
    if features & F_TEMPORAL and parent != 0:
        return 1
    return 0


@inline
def _sig_context(features, t, colstate, rcount, prev_nz, area):
    if not (features & F_AREA):
        area = 0
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


@inline
def _expect(k, dq):
    # 4x the nonzeros expected in the first k positions of a row or column, e = (k * dq) >> 18, as
    # bitlen(e + 1) * 2 + (e >= 4): what _crel compares a count with
    kq = k if k < (1 << 40) else (1 << 40)
    e = (kq * dq) >> 18
    return _bitlen_u(e + 1) * 2 + (1 if e >= 4 else 0)


@inline
def _crel(count, ex):
    # Nonzeros seen so far in this column (row) of this message against 4x the expected number e
    # (ex from _expect): 0/1 none (e < 4 / e >= 4), else 2 + clamp(bitlen(4 count) - bitlen(e + 1) + 2, 0, 4).
    if count == 0:
        return ex & 1
    k = (BITLEN8[count] if count < 256 else _bitlen_u(count)) + 4 - (ex >> 1)
    if k < 0:
        k = 0
    elif k > 4:
        k = 4
    return 2 + k


@inline
def _hist_class(x):
    # a row or column history class of _area_classes: 0 never nonzero, else 1..7 by octave
    if x < -50:
        return 0
    k = x + 3
    if k < 0:
        k = 0
    elif k > 6:
        k = 6
    return 1 + k


@inline
def _m2_context(features, hist, hr, hc, prev_nz):
    # recency (never / 1 / 2-4 / 5+ messages ago) x row x column classes of recent activity
    # (_hist_class of _area_classes(recent), 0 without AREA) x previous position nonzero
    tc = HIST_TC[np.int64(hist) & HIST_MASK] if features & F_HISTORY else 0
    pn = 1 if (features & F_ROW) and prev_nz else 0
    return CTX_M2 + ((tc * 8 + hr) * 8 + hc) * 2 + pn


@inline
def _sign_state(features, parent, hist):
    # 0..6: with HISTORY, 0 if never nonzero, else 1 + 3 * (last sign - 1) + age class (1-2, 3-8,
    # 9+); without, 1 / 4 / 0 if TEMPORAL and the parent is positive / negative / zero
    if features & F_HISTORY:
        return HIST_PS[np.int64(hist) & HIST_MASK]
    if features & F_TEMPORAL:
        return 1 if parent > 0 else (4 if parent < 0 else 0)
    return 0


@inline
def _sign_context(ps, rsign, colstate):
    return CTX_SIGN + 9 * ps + 3 * rsign + (colstate >> COL_SIGN_SHIFT)


@inline
def _s2_context(rsum, csum):
    # the sum of the signs (+1 / -1) so far in this row: 0, +-1, +-2..3, +-4.. (7 classes) x that
    # of this column (0, >0, <0)
    m = rsum if rsum >= 0 else -rsum
    v = 0
    if m > 0:
        v = 1 if m == 1 else (2 if m < 4 else 3)
        if rsum < 0:
            v += 3
    return CTX_S2 + 3 * v + (0 if csum == 0 else (1 if csum > 0 else 2))


@inline
def _mix_prob(ctx, cs, nm, wb, st):
    dot = 0
    for j in range(nm):
        x = np.int64(STRETCH[_p15(ctx[2 * cs[j]])])
        st[j] = x
        dot += ctx[2 * (wb + j)] * x
    st[nm] = MIX_BIAS
    dot += ctx[2 * (wb + nm)] * MIX_BIAS
    smax = MIX_BIAS
    for j in range(nm):
        a = st[j] if st[j] >= 0 else -st[j]
        if a > smax:
            smax = a
    d = dot >> 16
    if d < -ST_MAX:
        d = -ST_MAX
    elif d > ST_MAX:
        d = ST_MAX
    p = np.int64(SQUASH[d + ST_MAX])
    if p < P_FLOOR:
        p = P_FLOOR
    elif p > PROB_ONE - P_FLOOR:
        p = PROB_ONE - P_FLOOR
    return p, smax


@inline
def _mix_update(ctx, cs, nm, wb, st, smax, bit, p, rate):
    err = (bit << PROB_BITS) - p
    # every weight step is (err * x + 2**14) >> 15: all are zero while |err * x| < 2**14
    ae = err if err >= 0 else -err
    for j in range(nm + 1 if ae * smax >= MIX_LR_ROUND else 0):
        w = ctx[2 * (wb + j)] + ((err * st[j] + MIX_LR_ROUND) >> MIX_LR_SHIFT)
        if w > MIX_W_MAX:
            w = MIX_W_MAX
        elif w < -MIX_W_MAX:
            w = -MIX_W_MAX
        ctx[2 * (wb + j)] = w
    for j in range(nm):
        c = cs[j]
        _adapt(ctx, c, bit, rate)


@inline
def _adapt(ctx, c, bit, rate):
    ctx[2 * c] += ((bit << EST_BITS) - ctx[2 * c]) >> min(SHIFT_U[ctx[2 * c + 1]], rate)
    if ctx[2 * c + 1] < COUNT_MAX:
        ctx[2 * c + 1] += 1


@inline
def _wstep(ctx, k, err, x):
    w = ctx[2 * k] + ((err * x + MIX_LR_ROUND) >> MIX_LR_SHIFT)
    if w > MIX_W_MAX:
        w = MIX_W_MAX
    elif w < -MIX_W_MAX:
        w = -MIX_W_MAX
    ctx[2 * k] = w


@helper
def _abs_max(smax, x):
    a = x if x >= 0 else -x
    return a if a > smax else smax


@inline
def _dot_stretch(ctx, wb, x0, x1, x2, x3, x4):
    d = (ctx[2 * wb] * x0 + ctx[2 * (wb + 1)] * x1 + ctx[2 * (wb + 2)] * x2 + ctx[2 * (wb + 3)] * x3
         + ctx[2 * (wb + 4)] * x4 + ctx[2 * (wb + 5)] * MIX_BIAS) >> 16
    if d < -ST_MAX:
        d = -ST_MAX
    elif d > ST_MAX:
        d = ST_MAX
    return d


@inline
def _mix5_prob(ctx, c0, c1, c2, c3, c4, wb, wb2):
    # The five significance models through two mixers (weight sets wb, wb2), unrolled into scalars
    # (measured ~2x faster than a loop over small arrays, which LLVM cannot keep in registers).
    # Returns the coding probability, each mixer's own probability and the inputs.
    x0 = np.int64(STRETCH[_p15(ctx[2 * c0])])
    x1 = np.int64(STRETCH[_p15(ctx[2 * c1])])
    x2 = np.int64(STRETCH[_p15(ctx[2 * c2])])
    x3 = np.int64(STRETCH[_p15(ctx[2 * c3])])
    x4 = np.int64(STRETCH[_p15(ctx[2 * c4])])
    d1 = _dot_stretch(ctx, wb, x0, x1, x2, x3, x4)
    d2 = _dot_stretch(ctx, wb2, x0, x1, x2, x3, x4)
    p = np.int64(SQUASH[((d1 + d2) >> 1) + ST_MAX])
    if p < P_FLOOR:
        p = P_FLOOR
    elif p > PROB_ONE - P_FLOOR:
        p = PROB_ONE - P_FLOOR
    p1 = np.int64(SQUASH[d1 + ST_MAX])
    p2 = np.int64(SQUASH[d2 + ST_MAX])
    smax = _abs_max(_abs_max(_abs_max(_abs_max(_abs_max(MIX_BIAS, x0), x1), x2), x3), x4)
    return p, p1, p2, x0, x1, x2, x3, x4, smax


@inline
def _wsteps(ctx, wb, err, smax, x0, x1, x2, x3, x4):
    ae = err if err >= 0 else -err
    if ae * smax >= MIX_LR_ROUND:  # else every weight step is zero
        # (loops of constant length over scalars rather than calls written out: one inlined copy
        # of the step instead of six compiles faster, and LLVM unrolls it to the same code)
        for j in range(6):
            x = x0 if j == 0 else x1 if j == 1 else x2 if j == 2 else x3 if j == 3 else x4 if j == 4 else MIX_BIAS
            _wstep(ctx, wb + j, err, x)


@inline
def _mix5_update(ctx, c0, c1, c2, c3, c4, x0, x1, x2, x3, x4, smax, wb, wb2, bit, p1, p2, rate):
    # each mixer learns from its own error
    for m in range(2):
        _wsteps(ctx, wb if m == 0 else wb2, (bit << PROB_BITS) - (p1 if m == 0 else p2), smax, x0, x1, x2, x3, x4)
    for j in range(5):
        _adapt(ctx, c0 if j == 0 else c1 if j == 1 else c2 if j == 2 else c3 if j == 3 else c4, bit, rate)


# The context indices of the two mixtures (MIX), in one place for the encoder and the decoder.
@inline
def _sig_mix_contexts(features, cbase, ts, colcnt, cex, rcount, rex, hist, hr, hc, prev_nz, cc, r):
    cr = _crel(colcnt, cex) if features & F_COLUMN else 0
    rr = _crel(rcount, rex) if features & F_ROW else 0
    c1 = cbase + CTX_M1 + (ts * N_CREL + cr) * N_CREL + rr
    c2 = cbase + _m2_context(features, hist, hr, hc, prev_nz)
    c3 = cbase + CTX_COLID + (cc & (N_COLID - 1))
    c4 = cbase + CTX_ROWID + (r & (N_ROWID - 1))
    wb = cbase + CTX_WSIG + ts * (N_SIG_MODELS + 1)
    wb2 = cbase + CTX_WSIG2 + (cr * N_CREL + rr) * (N_SIG_MODELS + 1)
    return c1, c2, c3, c4, wb, wb2


@inline
def _sign_mix_contexts(cs, c, cbase, ps, colstate, rsum, csum, r):
    """Fills ``cs`` with the sign mixture's contexts; returns its weight base."""
    cs[0] = c
    cs[1] = cbase + CTX_S1 + 3 * (ps if ps < 7 else 6) + (colstate >> COL_SIGN_SHIFT)
    cs[2] = cbase + _s2_context(rsum, csum)
    cs[3] = cbase + CTX_SROW + (r & (N_SROW - 1))
    return cbase + CTX_WSIGN + (ps if ps < 7 else 6) * (N_SIGN_MODELS + 1)


@inline
def _density_q(nnz, numel):
    # nnz / numel in units of 2**-20 (without overflow for any nnz <= numel < 2**63)
    if nnz < (1 << 42):
        return (nnz << 20) // numel
    return nnz // (numel >> 20)


@kernel
def _row_parent_nonzero(parent, start, cols):
    for j in range(start, start + cols):
        if parent[j] != 0:
            return 1
    return 0


@kernel
def advance_session_kernel(hist, parent, levels, listed):
    """One more message in a tensor's session memory, in place: ``hist`` (uint16) ages and, where
    ``levels`` (listed tensors only) is nonzero, takes the sign, one more count and age 1; ``parent``
    (int8) becomes the levels clipped to [-PARENT_MAX, PARENT_MAX] (0 if not listed). One pass; the
    plain-numpy statement of the same is :func:`.sessions.next_hist`."""
    for i in range(hist.shape[0]):
        h = np.int64(hist[i])
        sign = h & 3
        count = (h >> HIST_COUNT_SHIFT) & HIST_COUNT_MAX
        age = (h >> HIST_AGE_SHIFT) & HIST_AGE_MAX
        if age > 0 and age < HIST_AGE_MAX:
            age += 1
        pv = 0
        if listed:
            v = np.int64(levels[i])
            if v != 0:
                sign = 1 if v > 0 else 2
                if count < HIST_COUNT_MAX:
                    count += 1
                age = 1
                pv = v if -PARENT_MAX <= v <= PARENT_MAX else (PARENT_MAX if v > 0 else -PARENT_MAX)
        parent[i] = pv
        hist[i] = sign | (count << HIST_COUNT_SHIFT) | (age << HIST_AGE_SHIFT)


@kernel
def _tensor_setup(hist, off, rows, cols, features, dq):
    """What encoder and decoder derive, once per tensor, from the session history before coding it:
    the AREA row/column classes, and with MIX, M2's row/column history classes and the expected row
    count at each column (``_expect``); and the per-column state they keep while coding it, zeroed
    (column context state, nonzeros so far, the sum of their signs)."""
    rowcls = np.zeros(rows, dtype=np.int64)
    colcls = np.zeros(cols, dtype=np.int64)
    if features & F_AREA:
        _area_classes(hist, off, rows, cols, rowcls, colcls, np.bool_(False))  # (one compiled version for both)
    mix = (features & F_MIX) != 0
    hr = np.zeros(rows if mix else 0, dtype=np.int64)
    hc = np.zeros(cols if mix else 0, dtype=np.int64)
    rex = np.zeros(cols if mix else 0, dtype=np.int64)
    if mix:
        if features & F_AREA:
            _area_classes(hist, off, rows, cols, hr, hc, np.bool_(True))
            for j in range(rows):
                hr[j] = _hist_class(hr[j])
            for j in range(cols):
                hc[j] = _hist_class(hc[j])
        for j in range(cols):
            rex[j] = _expect(j, dq)
    col = np.zeros(cols, dtype=np.int64)
    colcnt = np.zeros(cols, dtype=np.int64)
    csum = np.zeros(cols, dtype=np.int64)
    return rowcls, colcls, hr, hc, rex, col, colcnt, csum


@inline
def _any_mix(tinfo):
    for t in range(tinfo.shape[0]):
        if tinfo[t, 6] & F_MIX:
            return True
    return False


@kernel
def encode_update_kernel(levels, tinfo, parent, hist, ctx, out):
    """Encode the tensors described by ``tinfo`` (int64 [T, 9]: offset, rows, cols, nnz, maxabs,
    sign_mode, features, context offset, adaptation rate from :func:`rate_for`) whose flat int32
    levels are concatenated in ``levels``.

    ``parent`` (int8) and ``hist`` (uint16) are co-located with ``levels``; ``ctx`` (int64 [C, 2]:
    24-bit probability, count) is updated in place. Returns the byte count (the first, always-zero
    byte included), or -1 if ``out`` is too small.
    """
    # ctx as one flat array: context c at [2c] (probability) and [2c + 1] (count); a constant stride
    # (measured 5-10% faster than the 2-d view)
    ctx = ctx.reshape(ctx.shape[0] * CTX_COLS)
    # (int64 from the start, not literals: Numba types the calls below while it still sees the
    # literals, and would compile _finish_substream once more for them)
    low = np.int64(0)
    rng = np.int64(RANGE_INIT)
    cache = np.int64(0)
    cache_size = np.int64(1)
    pos = np.int64(0)
    cs = np.zeros(8, dtype=np.int64)  # context indices of the mixed models
    st = np.zeros(8, dtype=np.int64)  # their stretched probabilities
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
        mix = (features & F_MIX) != 0
        dq = _density_q(nnz, rows * cols)
        rowcls, colcls, hr, hc, rex, col, colcnt, csum = _tensor_setup(hist, off, rows, cols, features, dq)
        wb = 0
        smax = 0
        c1 = c2 = c3 = c4 = wb2 = 0
        x0 = x1 = x2 = x3 = x4 = p1 = p2 = 0
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
                p = _p15(ctx[2 * c])
                bound = (rng >> PROB_BITS) * p
                if row_nz:
                    rng = bound
                else:
                    low += bound
                    rng -= bound
                _adapt(ctx, c, row_nz, rate)
                while rng < TOP:
                    rng <<= 8
                    low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                prev_row_nz = row_nz
                if not row_nz:
                    continue
            rcount = 0
            prev_nz = 0
            rsign = 0
            rsum = 0
            cex = _expect(r, dq) if mix else 0  # of the column counts in this row
            for cc in range(cols):
                if coded == nnz:
                    break
                i = start + cc
                v = np.int64(levels[i])
                nz = 1 if v != 0 else 0
                forced = (features & F_ROWSKIP) != 0 and cc == cols - 1 and rcount == 0
                if not forced:
                    ts = _tstate(features, parent[i], hist[i])
                    c = cbase + _sig_context(features, ts, col[cc], rcount, prev_nz, _area_of(rowcls[r], colcls[cc]))
                    if mix:
                        c1, c2, c3, c4, wb, wb2 = _sig_mix_contexts(
                            features, cbase, ts, colcnt[cc], cex, rcount, rex[cc], hist[i], hr[r], hc[cc],
                            prev_nz, cc, r)
                        p, p1, p2, x0, x1, x2, x3, x4, smax = _mix5_prob(ctx, c, c1, c2, c3, c4, wb, wb2)
                    else:
                        p = _p15(ctx[2 * c])
                    bound = (rng >> PROB_BITS) * p
                    if nz:
                        rng = bound
                    else:
                        low += bound
                        rng -= bound
                    if mix:
                        _mix5_update(ctx, c, c1, c2, c3, c4, x0, x1, x2, x3, x4, smax, wb, wb2, nz, p1, p2, rate)
                    else:
                        _adapt(ctx, c, nz, rate)
                    while rng < TOP:
                        rng <<= 8
                        low, cache, cache_size, pos = _shift_low(low, cache, cache_size, out, pos)
                prev_nz = nz
                if not nz:
                    continue
                neg = 1 if v < 0 else 0
                if sign_mode == SIGN_CODED:
                    if not (features & F_SIGNCTX):
                        low, rng = _encode_bypass(low, rng, neg, 1)
                    else:
                        ps = _sign_state(features, parent[i], np.int64(hist[i]))
                        c = cbase + _sign_context(ps, rsign, col[cc])
                        if mix:
                            wb = _sign_mix_contexts(cs, c, cbase, ps, col[cc], rsum, csum[cc], r)
                            p, smax = _mix_prob(ctx, cs, N_SIGN_MODELS, wb, st)
                        else:
                            p = _p15(ctx[2 * c])
                        bound = (rng >> PROB_BITS) * p
                        if neg:
                            rng = bound
                        else:
                            low += bound
                            rng -= bound
                        if mix:
                            _mix_update(ctx, cs, N_SIGN_MODELS, wb, st, smax, neg, p, rate)
                        else:
                            _adapt(ctx, c, neg, rate)
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
                    p = _p15(ctx[2 * c])
                    bound = (rng >> PROB_BITS) * p
                    if gt1:
                        rng = bound
                    else:
                        low += bound
                        rng -= bound
                    _adapt(ctx, c, gt1, rate)
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
                            p = _p15(ctx[2 * c])
                            bound = (rng >> PROB_BITS) * p
                            if bit:
                                rng = bound
                            else:
                                low += bound
                                rng -= bound
                            _adapt(ctx, c, bit, rate)
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
                colcnt[cc] += 1
                rsum += -1 if neg else 1
                csum[cc] += -1 if neg else 1

    if _any_mix(tinfo):
        # format 2 (some entry has MIX) ends without the terminate bin: it cost 7 bits a message
        # (0.08 bits per nonzero at density 0.001 on the MNIST benchmark), and the payload CRC-32
        # already catches damage
        return _flush_substream(low, rng, cache, cache_size, out, pos)
    # Terminate bin (1), then the level coder's flush.
    return _finish_substream(low, rng, cache, cache_size, out, pos)


@kernel
def decode_update_kernel(buf, tinfo, parent, hist, ctx, out):
    """Decode into the zeroed flat int32 ``out`` (same layout as the encoder's ``levels``); ``buf``
    starts at the encoder's second byte. ``ctx`` is updated in place. Returns a status code."""
    ctx = ctx.reshape(ctx.shape[0] * CTX_COLS)  # flat, as in the encoder
    size = buf.shape[0]
    rng = RANGE_INIT
    code = 0
    pos = 0
    for _ in range(4):
        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
        pos += 1
    if code >= rng:
        return ERR_BAD_START
    cs = np.zeros(8, dtype=np.int64)
    st = np.zeros(8, dtype=np.int64)
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
        mix = (features & F_MIX) != 0
        dq = _density_q(nnz, rows * cols)
        rowcls, colcls, hr, hc, rex, col, colcnt, csum = _tensor_setup(hist, off, rows, cols, features, dq)
        wb = 0
        smax = 0
        c1 = c2 = c3 = c4 = wb2 = 0
        x0 = x1 = x2 = x3 = x4 = p1 = p2 = 0
        coded = 0
        prev_row_nz = 0
        for r in range(rows):
            if coded == nnz:
                break
            start = off + r * cols
            if features & F_ROWSKIP:
                pr = _row_parent_nonzero(parent, start, cols) if features & F_TEMPORAL else 0
                c = cbase + CTX_ROW + 2 * pr + prev_row_nz
                p = _p15(ctx[2 * c])
                bound = (rng >> PROB_BITS) * p
                if code < bound:
                    row_nz = 1
                    rng = bound
                else:
                    row_nz = 0
                    code -= bound
                    rng -= bound
                _adapt(ctx, c, row_nz, rate)
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
            rsum = 0
            cex = _expect(r, dq) if mix else 0  # of the column counts in this row
            for cc in range(cols):
                if coded == nnz:
                    break
                i = start + cc
                forced = (features & F_ROWSKIP) != 0 and cc == cols - 1 and rcount == 0
                if forced:
                    nz = 1
                else:
                    ts = _tstate(features, parent[i], hist[i])
                    c = cbase + _sig_context(features, ts, col[cc], rcount, prev_nz, _area_of(rowcls[r], colcls[cc]))
                    if mix:
                        c1, c2, c3, c4, wb, wb2 = _sig_mix_contexts(
                            features, cbase, ts, colcnt[cc], cex, rcount, rex[cc], hist[i], hr[r], hc[cc],
                            prev_nz, cc, r)
                        p, p1, p2, x0, x1, x2, x3, x4, smax = _mix5_prob(ctx, c, c1, c2, c3, c4, wb, wb2)
                    else:
                        p = _p15(ctx[2 * c])
                    bound = (rng >> PROB_BITS) * p
                    if code < bound:
                        nz = 1
                        rng = bound
                    else:
                        nz = 0
                        code -= bound
                        rng -= bound
                    if mix:
                        _mix5_update(ctx, c, c1, c2, c3, c4, x0, x1, x2, x3, x4, smax, wb, wb2, nz, p1, p2, rate)
                    else:
                        _adapt(ctx, c, nz, rate)
                    while rng < TOP:
                        rng <<= 8
                        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                        pos += 1
                prev_nz = nz
                if not nz:
                    continue
                neg = 0
                if sign_mode == SIGN_CODED:
                    if not (features & F_SIGNCTX):
                        code, rng, neg = _decode_bypass(code, rng, 1)
                        if code >= rng:
                            return ERR_BAD_BYPASS
                    else:
                        ps = _sign_state(features, parent[i], np.int64(hist[i]))
                        c = cbase + _sign_context(ps, rsign, col[cc])
                        if mix:
                            wb = _sign_mix_contexts(cs, c, cbase, ps, col[cc], rsum, csum[cc], r)
                            p, smax = _mix_prob(ctx, cs, N_SIGN_MODELS, wb, st)
                        else:
                            p = _p15(ctx[2 * c])
                        bound = (rng >> PROB_BITS) * p
                        if code < bound:
                            neg = 1
                            rng = bound
                        else:
                            neg = 0
                            code -= bound
                            rng -= bound
                        if mix:
                            _mix_update(ctx, cs, N_SIGN_MODELS, wb, st, smax, neg, p, rate)
                        else:
                            _adapt(ctx, c, neg, rate)
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
                    p = _p15(ctx[2 * c])
                    bound = (rng >> PROB_BITS) * p
                    if code < bound:
                        gt1 = 1
                        rng = bound
                    else:
                        gt1 = 0
                        code -= bound
                        rng -= bound
                    _adapt(ctx, c, gt1, rate)
                    while rng < TOP:
                        rng <<= 8
                        code = (code << 8) | (np.int64(buf[pos]) if pos < size else 0)
                        pos += 1
                    if gt1:
                        length = 1
                        while True:
                            j = length - 1
                            c = cbase + CTX_EG + (j if j < N_EG_CTX else N_EG_CTX - 1)
                            p = _p15(ctx[2 * c])
                            bound = (rng >> PROB_BITS) * p
                            if code < bound:
                                bit = 1
                                rng = bound
                            else:
                                bit = 0
                                code -= bound
                                rng -= bound
                            _adapt(ctx, c, bit, rate)
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
                colcnt[cc] += 1
                rsum += -1 if neg else 1
                csum[cc] += -1 if neg else 1
        if coded != nnz:
            return ERR_BAD_COUNT

    if _any_mix(tinfo):  # no terminate bin (see the end of encode_update_kernel)
        if pos > size + OVERRUN_SLACK:
            return ERR_OVERRUN
        return OK
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
