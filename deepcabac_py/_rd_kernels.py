"""Numba kernels of the rate-distortion quantizers: RDOQ and the 4-state trellis (dependent
quantization).

Private: call them through :mod:`deepcabac_py.quantize`. Both quantizers run the level coder's own
modelling (``_cabac_kernels``: the context estimators, the row and column scales, column
prediction) alongside their decisions, so the rate of a candidate level is what the coder would
spend on it there:

* RDOQ decides weight by weight with the live contexts, exactly: the modelling state after each
  decision is the state the encoder will reach.
* The trellis needs the rate of a level on each of its four survivor paths. NNCodec copies a whole
  context set per state per weight; here the paths share one snapshot of the context estimators,
  taken at the start of a block of rows and turned into per-bucket bit tables, while each path keeps
  its own row scale (which picks the bucket and the Rice parameter, and moves fastest). At the end
  of a block the best path is traced back, its levels are committed and the modelling state is
  advanced over them, so the next block starts from the exact live state. The snapshot is at most a
  block old, and the estimators move slowly: the rates are near-exact (measured in
  ``benchmarks/bench_rd.py``).

Distortion is ``importance * (x - r)**2`` with ``x`` the value in units of the (fine) step and ``r``
the reconstruction index; the cost is distortion + ``lam`` * bits.
"""

import numpy as np

from ._cabac_kernels import (
    COL_SHIFT,
    CTX_PER_BUCKET,
    N_BUCKETS,
    N_CTX,
    N_UNARY_CTX,
    PRED_SHIFT,
    PREDICT_MAX_LEVEL,
    PROB_ONE,
    Q_MAX,
    ROW_SHIFT,
    SCALE_FRAC,
    SEL_NUM,
    SEL_SHIFT,
    _adapt,
    _bitlen,
    _bucket_and_k,
    _prob,
)
from ._jit import inline_helper, kernel, scalar_helper

# -log2(p / PROB_ONE) for every 15-bit probability: the cost in bits of a bin whose coded value had
# probability p.
BIT_COST = np.concatenate(([0.0], -np.log2(np.arange(1, PROB_ONE + 1, dtype=np.float64) / PROB_ONE)))

# The 4-state machine of dependent quantization (as in VVC): the parity of each transmitted level
# moves the state; states 0 and 1 use the even grid Q0 = {2k}, states 2 and 3 the odd grid
# Q1 = {0, +-1, +-3, ...} (a level k != 0 is 2k - sgn(k)).
N_STATES = 4
NEXT_STATE = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], dtype=np.int64)
# The two ways into each state, as (state, parity, state, parity), in increasing state order.
PREDECESSORS = np.array([[0, 0, 1, 1], [2, 0, 3, 1], [0, 1, 1, 0], [2, 1, 3, 0]], dtype=np.int64)
DEAD = 1e300
MAX_DQ_LEVEL = PREDICT_MAX_LEVEL  # |k| <= 2**30 - 1, so |2k| fits in int32

# A trellis block is a run of whole rows at least this long (or this many elements without the
# column model): long enough that the decision forced at its end costs nothing measurable, short
# enough that the context snapshot stays fresh.
BLOCK_MIN = 256


@scalar_helper
def _zigzag(x):
    return 2 * x - 1 if x > 0 else -2 * x


@scalar_helper
def dq_value(k, state):
    """Reconstruction index of transmitted level ``k`` in ``state`` (branch-free: the state is
    unpredictable, so a branch here would be mispredicted half the time)."""
    sgn = np.int64(k > 0) - np.int64(k < 0)
    return 2 * k - (state >> 1) * sgn


@scalar_helper
def dq_next(state, k):
    """NEXT_STATE[state, k & 1] without the table: the high bit moves down, the low bit's parity
    with k's picks the new high bit."""
    return (state >> 1) | (((state & 1) ^ (k & 1)) << 1)


@kernel
def dq_reconstruct_kernel(levels, out):
    """Map transmitted levels to reconstruction indices through the state machine (state 0 at the
    start). ``out`` may alias ``levels``. Returns False if a level is too large for the grid."""
    state = np.int64(0)
    for i in range(levels.shape[0]):
        k = np.int64(levels[i])
        if abs(k) > MAX_DQ_LEVEL:
            return False
        out[i] = dq_value(k, state)
        state = dq_next(state, k)
    return True


@kernel
def dq_reconstruct_f32_kernel(levels, step):
    """In place: transmitted int32 levels to float32 values ``index * step`` (same buffer)."""
    values = levels.view(np.float32)
    state = np.int64(0)
    for i in range(levels.shape[0]):
        k = np.int64(levels[i])
        if abs(k) > MAX_DQ_LEVEL:
            return False
        values[i] = np.float32(np.float64(dq_value(k, state)) * step)
        state = dq_next(state, k)
    return True


# --------------------------------------------------------------------------------------------------
# the coder's modelling, without the arithmetic coding
# --------------------------------------------------------------------------------------------------


@scalar_helper
def _escape_bits(q):
    # Exp-Golomb order 0 of q - Q_MAX + 1 in bypass bins
    return 2 * _bitlen(q - Q_MAX + 1) - 1


@inline_helper
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
        p = _prob(state[c, 0])
        bits += BIT_COST[p] if j < q else BIT_COST[PROB_ONE - p]
    if q >= Q_MAX:
        bits += _escape_bits(q)
    if k >= 2:
        c = base + N_UNARY_CTX + (1 if q > 0 else 0)
        p = _prob(state[c, 0])
        bits += BIT_COST[p] if (u >> (k - 1)) & 1 else BIT_COST[PROB_ONE - p]
        bits += k - 1
    else:
        bits += k
    return bits


# The scale and prediction bookkeeping after each level (row_scale, col_scale, col_pred, the
# prediction switch) is written out in each kernel below, as in _cabac_kernels: moved into one
# inlined helper returning the five scalars, the trellis ran 57 -> 68 ns per weight and RDOQ
# 46 -> 62 (measured on 2M MiniLM-like weights), so the copies stay.


@inline_helper
def _adapt_element(state, base, u, k):
    """Move the estimators exactly as coding ``u`` would."""
    q = u >> k
    steps = q if q < Q_MAX else Q_MAX
    for j in range(steps + 1):
        if j == Q_MAX:
            break
        bit = 1 if j < q else 0
        c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)
        state[c, 0], state[c, 1] = _adapt(state[c, 0], state[c, 1], bit)
    if k >= 2:
        c = base + N_UNARY_CTX + (1 if q > 0 else 0)
        state[c, 0], state[c, 1] = _adapt(state[c, 0], state[c, 1], (u >> (k - 1)) & 1)


@kernel
def _fresh_state():
    state = np.empty((N_CTX, 2), dtype=np.int64)
    for c in range(N_CTX):
        state[c, 0] = 1 << 15
        state[c, 1] = 0
    return state


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
    state = _fresh_state()
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
        bucket, k = _bucket_and_k(s, k_offset)
        base = bucket * CTX_PER_BUCKET

        if candidates == 0:
            v = np.int64(levels[i])
            d = w - v
            x = v - pred if use_pred else v
            total += imp * d * d + lam * _live_bits(state, base, _zigzag(x), k)
        else:
            a = abs(w)
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


@inline_helper
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
        p = _prob(state[c, 0])
        unary[bucket, q] = ones + BIT_COST[PROB_ONE - p]
        ones += BIT_COST[p]
    for j in range(2):
        p = _prob(state[base + N_UNARY_CTX + j, 0])
        suffix[bucket, j, 0] = BIT_COST[PROB_ONE - p]
        suffix[bucket, j, 1] = BIT_COST[p]


@scalar_helper
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


@kernel
def trellis_kernel(values, importance, step, lam, ncols, col0, k_offset, predict, out):
    """Transmitted levels of ``values`` for dependent quantization with fine step ``step``
    (reconstruction ``dq_value(level, state) * step``), by a Viterbi search over the 4-state machine
    minimising importance * (x - r)**2 + lam * bits. ``out`` receives int32 levels."""
    n = values.shape[0]
    weighted = importance.shape[0] == n
    state = _fresh_state()
    use_cols = ncols > 0
    col_scale = np.zeros(max(ncols, 1), dtype=np.int64)
    pred_on = use_cols and predict
    col_pred = np.zeros(max(ncols, 1) if pred_on else 1, dtype=np.int64)
    cost_plain = 0
    cost_pred = 0
    use_pred = False
    row_scale = 0
    inv_step = 1.0 / step

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
    back_state = np.zeros((max_len, N_STATES), dtype=np.int8)
    back_level = np.zeros((max_len, N_STATES), dtype=np.int32)
    cost = np.zeros(N_STATES, dtype=np.float64)
    rs = np.zeros(N_STATES, dtype=np.int64)
    path = np.zeros(max_len, dtype=np.int64)
    # per grid g and option o (0: the even magnitude, 1: the odd one, 2: zero when distinct)
    opt_dist = np.zeros((2, 3), dtype=np.float64)
    opt_rate = np.zeros((2, 3), dtype=np.float64)
    opt_level = np.zeros((2, 3), dtype=np.int64)
    opt_u = np.zeros((2, 3), dtype=np.int64)
    has_zero = np.zeros(2, dtype=np.bool_)
    cached_bucket = np.zeros(2, dtype=np.int64)
    # best way into each next state from each state: by parity p of the level
    via_cost = np.zeros((N_STATES, 2), dtype=np.float64)
    via_level = np.zeros((N_STATES, 2), dtype=np.int64)
    via_rs = np.zeros((N_STATES, 2), dtype=np.int64)

    dq_state = 0
    col_start = col0
    start = 0
    block_id = 0
    while start < n:
        length = first_len if start == 0 else block
        if start + length > n:
            length = n - start
        for s in range(N_STATES):
            # a dead state carries an enormous cost, so it never wins against a live one
            cost[s] = 0.0 if s == dq_state else DEAD
            rs[s] = row_scale

        col = col_start
        for t in range(length):
            i = start + t
            w = np.float64(values[i]) * inv_step
            a = abs(w)
            sign = -1 if w < 0 else 1
            imp = np.float64(importance[i]) if weighted else 1.0
            pred = 0
            if pred_on:
                pred = (col_pred[col] + 128) >> 8
            cs = 0
            two = use_cols and i >= ncols
            if two:
                cs = col_scale[col]
            # Options on each grid g (0: even multiples, 1: odd ones): the two magnitudes around a,
            # one of each parity, and zero. Distortion and zigzag value do not depend on the state;
            # the bits depend on it only through the bucket of its row scale.
            for g in range(2):
                kb = np.int64((a + g) * 0.5)  # g = 0: 2k <= a; g = 1: 2k - 1 <= a (k = 0: r = 0)
                if kb > MAX_DQ_LEVEL - 1:
                    kb = MAX_DQ_LEVEL - 1
                has_zero[g] = kb != 0
                for o in range(3):
                    if o == 2:
                        mag = np.int64(0)
                    else:
                        mag = kb if (kb & 1) == o else kb + 1
                    r = (2 * mag - g) if mag > 0 else np.int64(0)
                    d = a - r
                    v = sign * mag
                    opt_dist[g, o] = imp * d * d
                    opt_level[g, o] = v
                    opt_u[g, o] = _zigzag(v - pred if use_pred else v)
                cached_bucket[g] = -1
            for s in range(N_STATES):
                g = s >> 1
                sc = (rs[s] + cs) >> 1 if two else rs[s]
                bucket, kr = _bucket_and_k(sc, k_offset)
                if cached_bucket[g] != bucket:
                    if stamp[bucket] != block_id:
                        _fill_bucket_table(state, bucket, unary, suffix)
                        stamp[bucket] = block_id
                    for o in range(3):
                        opt_rate[g, o] = lam * _table_bits(unary, suffix, bucket, opt_u[g, o], kr)
                    cached_bucket[g] = bucket
                base = cost[s]
                for p in range(2):
                    o = p
                    c = base + opt_dist[g, p] + opt_rate[g, p]
                    if p == 0 and has_zero[g]:
                        cz = base + opt_dist[g, 2] + opt_rate[g, 2]
                        if cz < c:
                            c = cz
                            o = 2
                    via_cost[s, p] = c
                    via_level[s, p] = opt_level[g, o]
                    via_rs[s, p] = rs[s] + (((opt_u[g, o] << SCALE_FRAC) - rs[s]) >> ROW_SHIFT)
            for ns in range(N_STATES):
                # the two ways into ns, in the order (state, parity) of PREDECESSORS
                s0 = PREDECESSORS[ns, 0]
                p0 = PREDECESSORS[ns, 1]
                s1 = PREDECESSORS[ns, 2]
                p1 = PREDECESSORS[ns, 3]
                if via_cost[s1, p1] < via_cost[s0, p0]:
                    s0 = s1
                    p0 = p1
                cost[ns] = via_cost[s0, p0]
                rs[ns] = via_rs[s0, p0]
                back_state[t, ns] = s0
                back_level[t, ns] = via_level[s0, p0]
            if use_cols:
                col += 1
                if col == ncols:
                    col = 0

        # trace back the best path of the block and commit it
        best = 0
        for s in range(1, N_STATES):
            if cost[s] < cost[best]:
                best = s
        dq_state = best
        s = best
        for t in range(length - 1, -1, -1):
            path[t] = back_level[t, s]
            s = back_state[t, s]
        col = col_start
        for t in range(length):
            i = start + t
            v = path[t]
            out[i] = v
            pred = 0
            if pred_on:
                pred = (col_pred[col] + 128) >> 8
            if use_cols and i >= ncols:
                sc = (row_scale + col_scale[col]) >> 1
            else:
                sc = row_scale
            bucket, kr = _bucket_and_k(sc, k_offset)
            x = v - pred if use_pred else v
            u = _zigzag(x)
            _adapt_element(state, bucket * CTX_PER_BUCKET, u, kr)
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
        col_start = col
        start += length
        block_id += 1
