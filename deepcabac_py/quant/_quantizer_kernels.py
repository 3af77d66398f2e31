"""Numba kernels of the quantizers: nearest rounding, RDOQ and the 4-state trellis (dependent
quantization).

Private: call them through :mod:`deepcabac_py.quant.quantizers`. Both quantizers run the level coder's own
modelling (``_cabac_kernels``: the context estimators, the row and column scales, column
prediction) alongside their decisions, so the rate of a candidate level is what the coder would
spend on it there:

* RDOQ decides weight by weight with the live contexts, exactly: the modelling state after each
  decision is the state the encoder will reach.
* The trellis needs the rate of a level on each of its four survivor paths. NNCodec copies a whole
  context set per state per weight; here the paths share one snapshot of the context estimators,
  taken at the start of a block of rows and turned into per-bucket bit tables, while each path keeps
  its own row scale (which picks the bucket and the Rice parameter, and moves fastest). At the end
  of a block the best path is traced back and its levels are coded right away by the level coder
  (``_encode_span``), whose modelling state the next block is priced with: one pass both quantizes
  and codes, and the next block starts from the exact live state. The snapshot is at most a block
  old, and the estimators move slowly: the rates are near-exact (measured in
  ``benchmarks/bench_trellis.py``).

Distortion is ``importance * (x - r)**2`` with ``x`` the value in units of the (fine) step and ``r``
the reconstruction index; the cost is distortion + ``lam`` * bits.
"""

import numpy as np

from .._jit import helper, inline, kernel
from ..entropy._cabac_kernels import (
    COL_SHIFT,
    CTX_PER_BUCKET,
    ENC_COL,
    ENC_ROW,
    ENC_USE_PRED,
    N_BUCKETS,
    N_UNARY_CTX,
    PRED_SHIFT,
    PROB_ONE,
    Q_MAX,
    ROW_SHIFT,
    SCALE_FRAC,
    SEL_NUM,
    SEL_SHIFT,
    _adapt,
    _bitlen,
    _bucket_and_k_lut,
    _encode_span,
    _encoder_finish,
    _encoder_start,
    _fresh_contexts,
    _prob,
    _scale_lut,
)
from ._reconstruct_kernels import MAX_DQ_LEVEL, N_STATES

# -log2(p / PROB_ONE) for every 15-bit probability: the cost in bits of a bin whose coded value had
# probability p.
BIT_COST = np.concatenate(([0.0], -np.log2(np.arange(1, PROB_ONE + 1, dtype=np.float64) / PROB_ONE)))

DEAD = 1e300
# |x| / step is clamped here before any conversion to an integer: beyond it every quantizer
# saturates at its largest level anyway, and a NaN or a value past int64's range would otherwise
# turn into an arbitrary integer (and index tables with it).
A_MAX = 2.0**31

# A trellis block is a run of whole rows at least this long (or this many elements without the
# column model): long enough that the decision forced at its end costs nothing measurable, short
# enough that the context snapshot stays fresh.
BLOCK_MIN = 256


@helper
def _zigzag(x):
    return 2 * x - 1 if x > 0 else -2 * x


@kernel
def round_kernel(values, step, out):
    # Nearest level, ties away from zero (as NNC's URQ: floor(|x| + 0.5) with the sign restored).
    for i in range(values.shape[0]):
        x = np.float64(values[i])
        level = np.int64(abs(x) / step + 0.5)
        out[i] = -level if x < 0 else level


# --------------------------------------------------------------------------------------------------
# the coder's modelling, without the arithmetic coding
# --------------------------------------------------------------------------------------------------


@helper
def _escape_bits(q):
    # Exp-Golomb order 0 of q - Q_MAX + 1 in bypass bins
    return 2 * _bitlen(q - Q_MAX + 1) - 1


@inline
def _live_bits(state, base, u, k):
    """Bits the coder spends on ``u`` in bucket ``base`` with Rice parameter ``k``, from the live
    estimators."""
    q = u >> k
    bits = 0.0
    steps = q if q < Q_MAX else Q_MAX
    for j in range(steps + 1):
        if j == Q_MAX:
            break
        c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
        p = _prob(state[c])
        bits += BIT_COST[p] if j < q else BIT_COST[PROB_ONE - p]
    if q >= Q_MAX:
        bits += _escape_bits(q)
    if k >= 2:
        c = base + N_UNARY_CTX + (1 if q > 0 else 0)
        p = _prob(state[c])
        bits += BIT_COST[p] if (u >> (k - 1)) & 1 else BIT_COST[PROB_ONE - p]
        bits += k - 1
    else:
        bits += k
    return bits


# The scale and prediction bookkeeping after each level (row_scale, col_scale, col_pred, the
# prediction switch) is written out in each kernel below, as in _cabac_kernels: moved into one
# inlined helper returning the five scalars, the trellis ran 57 -> 68 ns per weight and RDOQ
# 46 -> 62 (measured on 2M MiniLM-like weights), so the copies stay.


@inline
def _adapt_element(state, base, u, k):
    """Move the estimators exactly as coding ``u`` would."""
    q = u >> k
    steps = q if q < Q_MAX else Q_MAX
    for j in range(steps + 1):
        if j == Q_MAX:
            break
        bit = 1 if j < q else 0
        c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
        state[c] = _adapt(state[c], bit)
    if k >= 2:
        c = base + N_UNARY_CTX + (1 if q > 0 else 0)
        state[c] = _adapt(state[c], (u >> (k - 1)) & 1)


# --------------------------------------------------------------------------------------------------
# RDOQ
# --------------------------------------------------------------------------------------------------


@kernel
def rdoq_kernel(values, importance, step, lam, ncols, col0, k_offset, predict, max_level, out):
    """Levels of ``values`` at ``step`` minimising importance * (x - level)**2 + lam * bits, one
    weight at a time among the nearest level, the next one towards zero, and zero.

    ``importance`` is empty (all ones) or one float per value; |level| <= ``max_level``. ``out``
    receives int32 levels.
    """
    total = _rd_pass(values, importance, step, lam, ncols, col0, k_offset, predict, max_level, 3, out)
    # Greedy decisions move the adaptive contexts for the weights after them, so in rare cases the
    # whole chunk costs more than plain rounding would: then rounding it is.
    rounded = np.empty(values.shape[0], dtype=np.int32)
    if _rd_pass(values, importance, step, lam, ncols, col0, k_offset, predict, max_level, 1, rounded) < total:
        out[:] = rounded


@kernel
def sequence_cost(levels, values, importance, step, lam, ncols, col0, k_offset, predict):
    """importance * (x - level)**2 + lam * bits summed over a chunk of plain levels, with the bits of
    the live contexts (the coder's code length, without its final flush)."""
    return _rd_pass(values, importance, step, lam, ncols, col0, k_offset, predict, 0, 0, levels)


@kernel
def _rd_pass(values, importance, step, lam, ncols, col0, k_offset, predict, max_level, candidates, levels):
    """One pass of the coder's modelling over a chunk; returns the RD cost of its levels.

    ``candidates`` 0: the levels are given in ``levels``; 1: plain rounding; 3: RDOQ's choice among
    the nearest level, the next one towards zero and zero. Chosen levels (|level| <= ``max_level``)
    are written to ``levels``.
    """
    n = values.shape[0]
    weighted = importance.shape[0] == n
    state = _fresh_contexts()
    use_cols = ncols > 0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    col = col0
    pred_on = use_cols and predict
    col_pred = np.zeros(max(ncols, 1) if pred_on else 1, dtype=np.int64)
    cost_plain = 0
    cost_pred = 0
    use_pred = False
    row_scale = 0
    inv_step = 1.0 / step
    total = 0.0
    lut_row, lut_bound = _scale_lut(k_offset)

    for i in range(n):
        w = np.float64(values[i]) * inv_step
        imp = np.float64(importance[i]) if weighted else 1.0
        pred = 0
        if pred_on:
            pred = (col_pred[col] + 128) >> 8
        if use_cols and i >= ncols:
            s = (row_scale + col_scale[col]) >> 1
        else:
            s = row_scale
        bucket, k = _bucket_and_k_lut(s, k_offset, lut_row, lut_bound)
        base = bucket * CTX_PER_BUCKET

        if candidates == 0:
            v = np.int64(levels[i])
            d = w - v
            x = v - pred if use_pred else v
            total += imp * d * d + lam * _live_bits(state, base, _zigzag(x), k)
        else:
            a = abs(w)
            if not a <= A_MAX:
                a = A_MAX
            sign = -1 if w < 0 else 1
            nearest = np.int64(a + 0.5)
            if nearest > max_level:
                nearest = max_level
            best_v = 0
            best_cost = 1e300
            # nearest, one towards zero, zero (the last two may coincide)
            for m in range(candidates):
                if m == 0:
                    mag = nearest
                elif m == 1:
                    mag = nearest - 1
                    if mag <= 0:
                        continue
                else:
                    mag = 0
                v = sign * mag
                d = a - mag
                x = v - pred if use_pred else v
                cost = imp * d * d + lam * _live_bits(state, base, _zigzag(x), k)
                if cost < best_cost:
                    best_cost = cost
                    best_v = v
            v = best_v
            levels[i] = v
            total += best_cost

        x = v - pred if use_pred else v
        u = _zigzag(x)
        _adapt_element(state, base, u, k)
        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT
        if use_cols:
            col_scale[col] += ((u << SCALE_FRAC) - col_scale[col]) >> COL_SHIFT
            if pred_on:
                up = _zigzag(v - pred)
                uv = _zigzag(v)
                cost_plain += ((uv << SCALE_FRAC) - cost_plain) >> SEL_SHIFT
                cost_pred += ((up << SCALE_FRAC) - cost_pred) >> SEL_SHIFT
                col_pred[col] += ((v << 8) - col_pred[col]) >> PRED_SHIFT
            col += 1
            if col == ncols and pred_on:
                use_pred = cost_pred * 16 < cost_plain * SEL_NUM
            if col == ncols:
                col = 0
    return total


# --------------------------------------------------------------------------------------------------
# trellis (dependent quantization)
# --------------------------------------------------------------------------------------------------


@inline
def _fill_bucket_table(state, bucket, unary, suffix):
    # unary[bucket, q]: bits of the unary part for q < Q_MAX (ones then the closing zero), and of
    # Q_MAX ones for q = Q_MAX (the escape is added separately). suffix[bucket, j, bit]: the
    # context-coded suffix bin after q == 0 (j = 0) or q > 0 (j = 1).
    base = bucket * CTX_PER_BUCKET
    ones = 0.0
    for q in range(Q_MAX + 1):
        if q == Q_MAX:
            unary[bucket, q] = ones
            break
        c = base + (q if q < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
        p = _prob(state[c])
        unary[bucket, q] = ones + BIT_COST[PROB_ONE - p]
        ones += BIT_COST[p]
    for j in range(2):
        p = _prob(state[base + N_UNARY_CTX + j])
        suffix[bucket, j, 0] = BIT_COST[PROB_ONE - p]
        suffix[bucket, j, 1] = BIT_COST[p]


@inline
def _table_bits(unary, suffix, bucket, u, k):
    q = u >> k
    if q >= Q_MAX:
        bits = unary[bucket, Q_MAX] + _escape_bits(q)
    else:
        bits = unary[bucket, q]
    if k >= 2:
        bits += suffix[bucket, 1 if q > 0 else 0, (u >> (k - 1)) & 1] + (k - 1)
    else:
        bits += k
    return bits


@inline
def _grid_options(a, g, sign, imp, pred, use_pred):
    """The candidates of one weight on grid ``g`` (0: even multiples, 1: odd ones): the magnitude of
    each parity around ``a`` and zero. Returns the weighted squared errors, the signed levels and the
    coded zigzag values of (even, odd, zero), and whether zero is a distinct candidate."""
    kb = np.int64((a + g) * 0.5)  # g = 0: 2k <= a; g = 1: 2k - 1 <= a (k = 0: r = 0)
    if kb > MAX_DQ_LEVEL - 1:
        kb = MAX_DQ_LEVEL - 1
    odd = kb & 1
    m_even = kb + odd
    m_odd = kb + 1 - odd
    r_even = 2 * m_even - g if m_even > 0 else np.int64(0)
    r_odd = 2 * m_odd - g
    d_even = a - r_even
    d_odd = a - r_odd
    v_even = sign * m_even
    v_odd = sign * m_odd
    if use_pred:
        u_even = _zigzag(v_even - pred)
        u_odd = _zigzag(v_odd - pred)
        u_zero = _zigzag(-pred)
    else:
        u_even = _zigzag(v_even)
        u_odd = _zigzag(v_odd)
        u_zero = np.int64(0)
    return (imp * d_even * d_even, imp * d_odd * d_odd, imp * a * a, v_even, v_odd,
            u_even, u_odd, u_zero, kb != 0)


# The trellis prices candidates from a flat table per bucket: entry j = u >> max(k - 1, 0) holds
# lam * bits of the unary part, the context-coded suffix bin and the bypass bins together, so a rate
# is one load instead of the unary, suffix and bypass look-ups (the trellis prices 12 candidates
# per weight). Escapes (q >= Q_MAX) fall back to the unary and suffix tables.
RATE_SPAN = 2 * Q_MAX


@inline
def _fill_rate_table(state, bucket, k, lam, unary, suffix, rates):
    _fill_bucket_table(state, bucket, unary, suffix)
    sh = k - 1 if k >= 1 else 0
    span = Q_MAX << (1 if k >= 1 else 0)
    base = bucket * RATE_SPAN
    for j in range(span):
        rates[base + j] = lam * _table_bits(unary, suffix, bucket, j << sh, k)


@inline
def _option_rate(rates, unary, suffix, bucket, k, lam, u):
    """lam * bits of ``u`` in ``bucket`` with Rice parameter ``k`` (the table must be filled)."""
    j = u >> (k - 1 if k >= 1 else 0)
    if j < (Q_MAX << (1 if k >= 1 else 0)):
        return rates[np.uint64(bucket * RATE_SPAN + j)]
    return lam * _table_bits(unary, suffix, bucket, u, k)


@inline
def _option_rates(rates, unary, suffix, bucket, k, lam, u_even, u_odd, u_zero):
    # A loop of three rather than three calls: one inlined copy of the rate instead of three (the
    # trellis prices four states), which compiles faster and runs the same (LLVM unrolls it).
    r_even = r_odd = r_zero = 0.0
    for i in range(3):
        u = u_even if i == 0 else (u_odd if i == 1 else u_zero)
        r = _option_rate(rates, unary, suffix, bucket, k, lam, u)
        if i == 0:
            r_even = r
        elif i == 1:
            r_odd = r
        else:
            r_zero = r
    return r_even, r_odd, r_zero


@inline
def _best_parity0(cost, d_even, r_even, d_zero, r_zero, has_zero, v_even, u_even, u_zero):
    """The best way out of a state with an even level: the even magnitude, or zero when distinct.
    Branch-free: which one wins is unpredictable."""
    c = cost + d_even + r_even
    cz = cost + d_zero + r_zero
    zero = has_zero & (cz < c)
    m = -np.int64(zero)
    return (cz if zero else c), v_even & ~m, u_even ^ ((u_even ^ u_zero) & m)


@inline
def _pick(c_a, rs_a, packed_a, c_b, rs_b, packed_b):
    """The cheaper of two ways into a state, the first on ties (branch-free)."""
    m = -np.int64(c_b < c_a)
    return min(c_a, c_b), rs_a ^ ((rs_a ^ rs_b) & m), packed_a ^ ((packed_a ^ packed_b) & m)


@helper
def _rs_after(rs, u):
    return rs + (((u << SCALE_FRAC) - rs) >> ROW_SHIFT)


@kernel
def trellis_kernel(values, importance, step, lam, ncols, col0, k_offset, predict, levels, out):
    """Transmitted levels of ``values`` for dependent quantization with fine step ``step``
    (reconstruction ``dq_value(level, state) * step``), by a Viterbi search over the 4-state machine
    minimising importance * (x - r)**2 + lam * bits, coded as they are committed.

    ``levels`` receives the int32 levels, ``out`` the level substream (what
    ``encode_levels_kernel`` makes of them); returns its byte count, or -1 if ``out`` is too small
    (an empty ``out`` when only the levels are wanted).
    """
    n = values.shape[0]
    weighted = importance.shape[0] == n
    # The block commits are coded at once: the coder's state is the live modelling state the next
    # block is priced with (contexts, row and column scales, column prediction).
    state, col_scale, col_pred, es = _encoder_start(ncols, col0, predict)
    use_cols = ncols > 0
    pred_on = use_cols and predict
    inv_step = 1.0 / step
    lut_row, lut_bound = _scale_lut(k_offset)

    if use_cols:
        rows_per_block = max(1, -(-BLOCK_MIN // ncols))
        # the first block ends at the end of a row
        block = ncols * rows_per_block
    else:
        block = BLOCK_MIN * 4
    first_len = block - col0 if use_cols else block
    max_len = max(block, first_len)

    unary = np.zeros((N_BUCKETS, Q_MAX + 1), dtype=np.float64)
    suffix = np.zeros((N_BUCKETS, 2, 2), dtype=np.float64)
    stamp = np.full(N_BUCKETS, -1, dtype=np.int64)
    rates = np.zeros(N_BUCKETS * RATE_SPAN, dtype=np.float64)
    # the way into each state at each step: level << 2 | previous state
    back = np.zeros((max_len, N_STATES), dtype=np.int64)

    # The four paths' costs and row scales live in scalars (0..3 = the state): as small arrays
    # they went through memory on every weight.
    # The two ways into each state, as (state, parity): 0 <- (0, 0) or (1, 1); 1 <- (2, 0) or (3, 1);
    # 2 <- (0, 1) or (1, 0); 3 <- (2, 1) or (3, 0). The survivors below are tried in this order.
    dq_state = 0
    col_start = col0
    start = np.int64(0)  # (not the literal 0: _encode_span is compiled once for both callers)
    block_id = 0
    while start < n:
        length = first_len if start == 0 else block
        if start + length > n:
            length = n - start
        # a dead state carries an enormous cost, so it never wins against a live one
        cost0 = 0.0 if dq_state == 0 else DEAD
        cost1 = 0.0 if dq_state == 1 else DEAD
        cost2 = 0.0 if dq_state == 2 else DEAD
        cost3 = 0.0 if dq_state == 3 else DEAD
        row_scale = es[ENC_ROW]
        use_pred = es[ENC_USE_PRED] != 0
        rs0 = rs1 = rs2 = rs3 = row_scale

        col = col_start
        for t in range(length):
            i = start + t
            w = np.float64(values[np.uint64(i)]) * inv_step
            a = abs(w)
            if not a <= A_MAX:
                a = A_MAX
            sign = np.int64(-1) if w < 0 else np.int64(1)
            imp = np.float64(importance[np.uint64(i)]) if weighted else 1.0
            pred = 0
            if pred_on:
                pred = (col_pred[np.uint64(col)] + 128) >> 8
            cs = 0
            two = use_cols and i >= ncols
            if two:
                cs = col_scale[np.uint64(col)]
            # Distortion and zigzag value do not depend on the state; the bits depend on it only
            # through the bucket of its row scale, so states that share a grid and a bucket share
            # the rates.
            de0, do0, dz0, ve0, vo0, ue0, uo0, uz0, hz0 = _grid_options(a, 0, sign, imp, pred, use_pred)
            de1, do1, dz1, ve1, vo1, ue1, uo1, uz1, hz1 = _grid_options(a, 1, sign, imp, pred, use_pred)

            b0, k0 = _bucket_and_k_lut((rs0 + cs) >> 1 if two else rs0, k_offset, lut_row, lut_bound)
            b1, k1 = _bucket_and_k_lut((rs1 + cs) >> 1 if two else rs1, k_offset, lut_row, lut_bound)
            b2, k2 = _bucket_and_k_lut((rs2 + cs) >> 1 if two else rs2, k_offset, lut_row, lut_bound)
            b3, k3 = _bucket_and_k_lut((rs3 + cs) >> 1 if two else rs3, k_offset, lut_row, lut_bound)
            if (stamp[np.uint64(b0)] != block_id or stamp[np.uint64(b1)] != block_id
                    or stamp[np.uint64(b2)] != block_id or stamp[np.uint64(b3)] != block_id):
                for bb in (b0, b1, b2, b3):
                    if stamp[bb] != block_id:
                        kk = (bb - 2 * SCALE_FRAC - k_offset) >> 1
                        _fill_rate_table(state, bb, kk if kk > 0 else 0, lam, unary, suffix, rates)
                        stamp[bb] = block_id
            re0, ro0, rz0 = _option_rates(rates, unary, suffix, b0, k0, lam, ue0, uo0, uz0)
            if b1 == b0:
                re1, ro1, rz1 = re0, ro0, rz0
            else:
                re1, ro1, rz1 = _option_rates(rates, unary, suffix, b1, k1, lam, ue0, uo0, uz0)
            re2, ro2, rz2 = _option_rates(rates, unary, suffix, b2, k2, lam, ue1, uo1, uz1)
            if b3 == b2:
                re3, ro3, rz3 = re2, ro2, rz2
            else:
                re3, ro3, rz3 = _option_rates(rates, unary, suffix, b3, k3, lam, ue1, uo1, uz1)

            # leaving each state s with parity p: cost, level and zigzag value (cSP, vSP, uSP)
            c00, v00, u00 = _best_parity0(cost0, de0, re0, dz0, rz0, hz0, ve0, ue0, uz0)
            c10, v10, u10 = _best_parity0(cost1, de0, re1, dz0, rz1, hz0, ve0, ue0, uz0)
            c20, v20, u20 = _best_parity0(cost2, de1, re2, dz1, rz2, hz1, ve1, ue1, uz1)
            c30, v30, u30 = _best_parity0(cost3, de1, re3, dz1, rz3, hz1, ve1, ue1, uz1)
            if a == 0.0:
                # An exact zero stays zero (pruned weights stay pruned): no odd level, which the
                # search would otherwise spend on it to switch state where that shortens the path.
                do0 = DEAD
                do1 = DEAD
            c01 = cost0 + do0 + ro0
            c11 = cost1 + do0 + ro1
            c21 = cost2 + do1 + ro2
            c31 = cost3 + do1 + ro3

            # the two ways into each state, in the order above; the first wins ties
            n_cost0, n_rs0, back[np.uint64(t), 0] = _pick(c00, _rs_after(rs0, u00), (v00 << 2) | 0,
                                               c11, _rs_after(rs1, uo0), (vo0 << 2) | 1)
            n_cost1, n_rs1, back[np.uint64(t), 1] = _pick(c20, _rs_after(rs2, u20), (v20 << 2) | 2,
                                               c31, _rs_after(rs3, uo1), (vo1 << 2) | 3)
            n_cost2, n_rs2, back[np.uint64(t), 2] = _pick(c01, _rs_after(rs0, uo0), (vo0 << 2) | 0,
                                               c10, _rs_after(rs1, u10), (v10 << 2) | 1)
            n_cost3, n_rs3, back[np.uint64(t), 3] = _pick(c21, _rs_after(rs2, uo1), (vo1 << 2) | 2,
                                               c30, _rs_after(rs3, u30), (v30 << 2) | 3)
            cost0, cost1, cost2, cost3 = n_cost0, n_cost1, n_cost2, n_cost3
            rs0, rs1, rs2, rs3 = n_rs0, n_rs1, n_rs2, n_rs3
            if use_cols:
                col += 1
                if col == ncols:
                    col = 0

        # trace back the best path of the block and commit it
        best = 0
        best_cost = cost0
        if cost1 < best_cost:
            best, best_cost = 1, cost1
        if cost2 < best_cost:
            best, best_cost = 2, cost2
        if cost3 < best_cost:
            best, best_cost = 3, cost3
        dq_state = best
        s = best
        for t in range(length - 1, -1, -1):
            packed = back[t, s]
            levels[start + t] = packed >> 2
            s = packed & 3
        _encode_span(levels, start, start + length, ncols, k_offset, predict, state, col_scale, col_pred, es, out)
        col_start = es[ENC_COL]
        start += length
        block_id += 1
    return _encoder_finish(es, out)
