"""Plain-Python reference of the rate-distortion quantizers (``deepcabac_py/quant/_quantizer_kernels.py``).

Slow and obvious, built from the reference coder's modelling pieces (contexts, scales, column
prediction). The kernels must choose exactly the same levels on random inputs. The bit-cost table
is shared with the kernels: it is a constant (-log2 of each 15-bit probability), and sharing it
keeps float sums identical so that near-ties resolve the same way.
"""

from __future__ import annotations

from reference_coder import (
    COL_SHIFT,
    N_UNARY_CTX,
    Q_MAX,
    ROW_SHIFT,
    SCALE_FRAC,
    ColumnPredictor,
    ContextSet,
    ScaleTracker,
    bucket_and_rice,
    zigzag,
)

from deepcabac_py.entropy._cabac_kernels import PROB_ONE
from deepcabac_py.quant._quantizer_kernels import BIT_COST, BLOCK_MIN, MAX_DQ_LEVEL
from deepcabac_py.quant._reconstruct_kernels import NEXT_STATE

LEVEL_MAX = (1 << 31) - 1


def _bit(ctx, bit: int) -> float:
    p = ctx.p_one()
    return float(BIT_COST[p] if bit else BIT_COST[PROB_ONE - p])


def _escape_bits(q: int) -> int:
    return 2 * (q - Q_MAX + 1).bit_length() - 1


def element_bits(contexts: ContextSet, u: int, bucket: int, k: int) -> float:
    """Bits the coder spends on ``u`` (summed in the kernel's order)."""
    q = u >> k
    bits = 0.0
    for j in range(min(q, Q_MAX) + 1):
        if j == Q_MAX:
            break
        bits += _bit(contexts.unary(bucket, j), 1 if j < q else 0)
    if q >= Q_MAX:
        bits += _escape_bits(q)
    if k >= 2:
        bits += _bit(contexts.suffix(bucket, q), (u >> (k - 1)) & 1)
        bits += k - 1
    else:
        bits += k
    return bits


def adapt(contexts: ContextSet, u: int, bucket: int, k: int) -> None:
    q = u >> k
    for j in range(min(q, Q_MAX) + 1):
        if j == Q_MAX:
            break
        contexts.unary(bucket, j).update(1 if j < q else 0)
    if k >= 2:
        contexts.suffix(bucket, q).update((u >> (k - 1)) & 1)


class _Model:
    """The coder's modelling state, advanced level by level."""

    def __init__(self, ncols: int, col0: int, k_offset: int, predict: bool):
        self.contexts = ContextSet()
        self.scale = ScaleTracker(ncols, col0)
        self.predictor = ColumnPredictor(ncols, col0, predict)
        self.k_offset = k_offset

    def where(self) -> tuple[int, int, int]:
        """(prediction, bucket, k) of the next element."""
        bucket, k = bucket_and_rice(self.scale.current(), self.k_offset)
        return self.predictor.prediction(), bucket, k

    def u_of(self, v: int, pred: int) -> int:
        return zigzag(v - pred if self.predictor.active else v)

    def commit(self, v: int) -> None:
        pred, bucket, k = self.where()
        u = self.u_of(v, pred)
        adapt(self.contexts, u, bucket, k)
        self.scale.update(u)
        self.predictor.update(v, pred)


def rdoq(values, importance, step: float, lam: float, ncols: int, col0: int, k_offset: int, predict: bool,
         max_level: int) -> list[int]:
    model = _Model(ncols, col0, k_offset, predict)
    out = []
    total = 0.0
    for i, value in enumerate(values):
        w = float(value) * (1.0 / step)
        a = abs(w)
        sign = -1 if w < 0 else 1
        imp = float(importance[i]) if len(importance) == len(values) else 1.0
        nearest = min(int(a + 0.5), max_level)
        pred, bucket, k = model.where()
        best_v, best_cost = 0, None
        candidates = [nearest] + ([nearest - 1] if nearest > 1 else []) + [0]
        for mag in candidates:
            d = a - mag
            cost = imp * d * d + lam * element_bits(model.contexts, model.u_of(sign * mag, pred), bucket, k)
            if best_cost is None or cost < best_cost:
                best_cost, best_v = cost, sign * mag
        out.append(best_v)
        model.commit(best_v)
        total += best_cost
    rounded = [(-1 if float(x) < 0 else 1) * min(int(abs(float(x) * (1.0 / step)) + 0.5), max_level)
               for x in values]
    if sequence_cost(rounded, values, importance, step, lam, ncols, col0, k_offset, predict) < total:
        return rounded
    return out


def sequence_cost(levels, values, importance, step, lam, ncols, col0, k_offset, predict) -> float:
    """RD cost of plain levels with the live contexts' bits."""
    model = _Model(ncols, col0, k_offset, predict)
    total = 0.0
    for i, v in enumerate(levels):
        d = float(values[i]) * (1.0 / step) - v
        imp = float(importance[i]) if len(importance) == len(values) else 1.0
        pred, bucket, k = model.where()
        total += imp * d * d + lam * element_bits(model.contexts, model.u_of(v, pred), bucket, k)
        model.commit(v)
    return total


def dq_value(k: int, state: int) -> int:
    if state < 2 or k == 0:
        return 2 * k
    return 2 * k - 1 if k > 0 else 2 * k + 1


def dq_indices(levels) -> list[int]:
    state, out = 0, []
    for k in levels:
        k = int(k)
        out.append(dq_value(k, state))
        state = int(NEXT_STATE[state, k & 1])
    return out


def trellis(values, importance, step: float, lam: float, ncols: int, col0: int, k_offset: int,
            predict: bool) -> list[int]:
    """Viterbi over the 4 states in blocks of whole rows: rates from the contexts as they are at the
    block start, the row scale tracked per path, the best path committed at each block end."""
    n = len(values)
    model = _Model(ncols, col0, k_offset, predict)
    if ncols > 0:
        block = ncols * max(1, -(-BLOCK_MIN // ncols))
        first = block - col0
    else:
        block = first = 4 * BLOCK_MIN
    out: list[int] = []
    dq_state, start = 0, 0
    while start < n:
        length = min(first if start == 0 else block, n - start)
        snapshot = model.contexts  # not advanced inside the block
        use_pred = model.predictor.active
        # per state: (cost, row scale, levels so far)
        paths = {dq_state: (0.0, model.scale.row, [])}
        col = model.scale.col
        for t in range(length):
            i = start + t
            w = float(values[i]) * (1.0 / step)
            a = abs(w)
            sign = -1 if w < 0 else 1
            imp = float(importance[i]) if len(importance) == n else 1.0
            pred = model.predictor.average[col] if model.predictor.on else 0
            pred = (pred + 128) >> 8 if model.predictor.on else 0
            two = ncols > 0 and i >= ncols
            k0 = min(int(a * 0.5), MAX_DQ_LEVEL - 1)
            k1 = min(int((a + 1.0) * 0.5), MAX_DQ_LEVEL - 1)
            new: dict[int, tuple[float, int, list[int]]] = {}
            for s in sorted(paths):
                cost, rs, levels = paths[s]
                sc = (rs + model.scale.cols[col]) >> 1 if two else rs
                bucket, kr = bucket_and_rice(sc, k_offset)
                odd = s >= 2
                kb = k1 if odd else k0
                mags = [kb, kb + 1] + ([0] if kb != 0 else []) if a > 0 else [0]  # exact zeros stay zero
                for mag in mags:
                    r = (2 * mag - 1 if odd else 2 * mag) if mag > 0 else 0
                    d = a - r
                    v = sign * mag
                    u = zigzag(v - pred if use_pred else v)
                    c = cost + imp * d * d + lam * _table_bits(snapshot, u, bucket, kr)
                    ns = int(NEXT_STATE[s, mag & 1])
                    if ns not in new or c < new[ns][0]:
                        new[ns] = (c, rs + (((u << SCALE_FRAC) - rs) >> ROW_SHIFT), levels + [v])
            paths = new
            if ncols > 0:
                col = (col + 1) % ncols
        best = min(sorted(paths), key=lambda s: paths[s][0])
        dq_state = best
        for v in paths[best][2]:
            out.append(v)
            model.commit(v)
        start += length
    return out


def _table_bits(contexts: ContextSet, u: int, bucket: int, k: int) -> float:
    # the kernel's table: unary ones summed first, then the closing zero; suffix after
    q = u >> k
    ones = 0.0
    if q >= Q_MAX:
        for j in range(Q_MAX):
            ones += _bit(contexts.unary(bucket, j), 1)
        bits = ones + _escape_bits(q)
    else:
        for j in range(q):
            ones += _bit(contexts.unary(bucket, j), 1)
        bits = ones + _bit(contexts.unary(bucket, q), 0)
    if k >= 2:
        bits += _bit(contexts.suffix(bucket, q), (u >> (k - 1)) & 1) + (k - 1)
    else:
        bits += k
    return bits


__all__ = ["rdoq", "trellis", "dq_indices", "element_bits", "N_UNARY_CTX", "COL_SHIFT", "LEVEL_MAX"]
