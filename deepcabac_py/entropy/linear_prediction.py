"""Linear prediction across the columns of a tall matrix of levels (a transform before the level coder).

The columns of some weight matrices are correlated: in a word embedding (one row per token, one
column per model dimension) a third of the dimensions predict the others well. The encoder picks
``m`` pivot columns, predicts each pivot from the pivots chosen before it and every other column
from all pivots, with integer coefficients fitted by least squares on a sample of rows, and codes
the residuals (pivots first) instead of the levels. The decoder rebuilds a row's pivots in order,
then the other columns (``docs/format.md`` §4.2 specifies the bytes and the arithmetic; what it saves
and the variants measured: ``docs/design-notes.md``).

Only tall matrices qualify (the coefficients are side information and the fit needs samples), only
under nearest rounding and RDOQ (the trellis codes each block as it chooses its levels), and only
when the fit promises a clear gain. The predictions are BLAS matrix products over integer-valued
floats whose magnitudes are bounded so that every partial sum is exact: the same integers on every
machine, in any summation order.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptStreamError
from . import _linear_kernels, chunk_layout, levelcoder

FRAC_BITS = 6  # coefficients in units of 1/64: 1/32 loses 0.2% of MiniLM's stream, 1/128 costs more side information
BLOCK = 16  # pivots are chosen this many at a time, and rebuilt a block per BLAS product
MIN_COLUMNS = 3 * BLOCK
MAX_COLUMNS = 4096
MIN_ROWS_PER_COLUMN = 16  # fewer samples per coefficient and the side information eats the gain
MAX_PIVOTS = 512
MAX_FRAC_BITS = 16
# The fit samples every s-th row, about this many per column: on MiniLM's embedding 20 gives 0.1% of
# the whole stream more than 10 for twice the fitting time (the products dominate either way).
FIT_ROWS_PER_COLUMN = 20
RIDGE = 0.1  # the sample covariance's diagonal is raised by this share: noisy coefficients shrink
# The fit's Gaussian estimate of the saving must exceed the side information this many times: real
# coding realises 60-75% of that estimate, and the estimate is made on the rows the fit saw.
GAIN_MARGIN = 2.0
SIDE_BITS_PER_COEFFICIENT = 4.0  # measured on MiniLM's embedding: about 3.3 bits each, coded

_HEADER = struct.Struct("<HBBI")  # pivots, frac_bits, reserved, pivot_bound
_F32_EXACT = 1 << 24
_F64_EXACT = 1 << 53


def allowed_coefficients(m: int, t: int) -> int:
    """How many pivots the t-th predicted column (in ``order``) uses: the pivots before it."""
    return min(t, m)


def coefficient_count(ncols: int, m: int) -> int:
    """Intercepts plus coefficients: the length of the coded coefficient vector."""
    return ncols + m * (m - 1) // 2 + (ncols - m) * m


@dataclass(frozen=True)
class LinearPredictor:
    """Pivot columns and integer coefficients of one matrix's prediction.

    Row ``t`` of ``coef``/``intercepts`` predicts column ``order[t]``: the pivots first, then the
    other columns in ascending order. Pivot ``t`` uses only the pivots before it (``coef[t, t:]`` is
    zero), every other column all of them. The prediction is
    ``(coef[t] . pivot_levels + intercepts[t] + 2**(frac_bits - 1)) >> frac_bits``.
    """

    ncols: int
    pivots: np.ndarray  # int64 (m,)
    coef: np.ndarray  # int64 (ncols, m)
    intercepts: np.ndarray  # int64 (ncols,)
    pivot_bound: int  # every pivot level lies within +-pivot_bound
    frac_bits: int = FRAC_BITS
    order: np.ndarray = field(init=False, repr=False)
    _float: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", _order(self.ncols, self.pivots))
        dtype = self.float_dtype()
        object.__setattr__(self, "_float", None if dtype is None else self.coef.astype(dtype))

    @property
    def m(self) -> int:
        return self.pivots.shape[0]

    @property
    def sum_bound(self) -> int:
        """A bound on |sum of products| of any prediction (pivot levels within +-pivot_bound)."""
        return int(np.abs(self.coef).sum(axis=1).max(initial=0)) * self.pivot_bound

    def float_dtype(self):
        """float32 when every sum of products is exact in it, else float64; None: neither."""
        top = self.sum_bound
        if top < _F32_EXACT and self.pivot_bound < _F32_EXACT:
            return np.float32
        if top < _F64_EXACT:
            return np.float64
        return None

    def to_bytes(self) -> bytes:
        """The side information: header, pivots, then the intercepts and allowed coefficients of
        every row (in ``order``) through the level coder."""
        parts = []
        for t in range(self.ncols):
            parts.append(self.intercepts[t:t + 1])
            parts.append(self.coef[t, :allowed_coefficients(self.m, t)])
        vec = np.concatenate(parts).astype(np.int32)
        head = _HEADER.pack(self.m, self.frac_bits, 0, self.pivot_bound)
        return head + self.pivots.astype("<u2").tobytes() + levelcoder.encode_chunk(vec, _vector_layout(vec.size), 0)

    def residuals(self, levels: np.ndarray) -> np.ndarray:
        """The residuals (flat int32, each row in ``order``) of flat int32 ``levels`` (whole rows)."""
        x = self._rows(levels)
        xp = np.empty((x.shape[0], self.m), dtype=self._float.dtype)
        _linear_kernels.gather_columns(x, self.pivots, xp)
        acc = xp @ self._float.T
        out = np.empty(x.shape, dtype=np.int32)
        if _linear_kernels.residuals(x, self.order, acc, self.intercepts, self.frac_bits, out) != _linear_kernels.OK:
            # fit() refuses predictions that could get here; a hand-made predictor may not
            raise ValueError("linear prediction: a residual exceeds the 31-bit range")
        return out.reshape(-1)

    def rebuild(self, residuals: np.ndarray, out: np.ndarray) -> None:
        """The levels (into flat int32 ``out``) of :meth:`residuals`' output."""
        res, x = self._rows(residuals), self._rows(out)
        m, dtype = self.m, self._float.dtype
        xpt = np.zeros((m, res.shape[0]), dtype=dtype)  # pivot levels, pivot-major
        # Pivots a block at a time: the blocks before come in through one BLAS product, the pivots
        # before within the block through the kernel.
        for j0 in range(0, m, BLOCK):
            j1 = min(m, j0 + BLOCK)
            if j0:
                acc = self._float[j0:j1, :j0] @ xpt[:j0]
            else:
                acc = np.zeros((j1 - j0, res.shape[0]), dtype=dtype)
            status = _linear_kernels.rebuild_pivots(res, j0, j1, acc, self._float, self.intercepts, self.frac_bits,
                                                    self.pivots, self.pivot_bound, x, xpt)
            if status != _linear_kernels.OK:
                raise CorruptStreamError(
                    f"linear prediction: a pivot level exceeds the declared bound {self.pivot_bound}")
        acc = xpt.T @ self._float[m:].T
        status = _linear_kernels.rebuild_rest(res, m, acc, self.intercepts, self.frac_bits, self.order, x)
        if status != _linear_kernels.OK:
            raise CorruptStreamError("linear prediction: a decoded level exceeds the 31-bit range")

    def _rows(self, flat: np.ndarray) -> np.ndarray:
        if flat.dtype != np.int32 or flat.ndim != 1 or flat.size % self.ncols:
            raise ValueError("levels must be a flat int32 array of whole rows")
        return flat.reshape(-1, self.ncols)


def qualifies(rows: int, ncols: int) -> bool:
    """Whether a matrix of this shape is worth a fit (the fit may still decline)."""
    return MIN_COLUMNS <= ncols <= MAX_COLUMNS and rows >= MIN_ROWS_PER_COLUMN * ncols


def blas_threads(active: bool):
    """A context that keeps the BLAS to one thread while ``active``: the matrix products run inside
    the codec's own worker threads (``threads=``), and a BLAS that spawned its own pool would run a
    one-thread encode on every core."""
    if not active:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _order(ncols: int, pivots: np.ndarray) -> np.ndarray:
    """The pivots, then the other columns in ascending order."""
    mask = np.ones(ncols, dtype=bool)
    mask[pivots] = False
    return np.concatenate([pivots, np.flatnonzero(mask)]).astype(np.int64)


def _vector_layout(count: int) -> chunk_layout.ChunkLayout:
    return chunk_layout.ChunkLayout(numel=count, ncols=0, chunk_elements=max(1, count))


def from_bytes(data, ncols: int) -> LinearPredictor:
    """Parse and check side information written by :meth:`LinearPredictor.to_bytes`."""
    data = memoryview(data)
    if len(data) < _HEADER.size:
        raise CorruptStreamError("linear prediction: side information truncated")
    m, frac_bits, reserved, pivot_bound = _HEADER.unpack(bytes(data[:_HEADER.size]))
    if reserved:
        raise CorruptStreamError("linear prediction: unknown reserved byte")
    if not MIN_COLUMNS <= ncols <= MAX_COLUMNS or not 1 <= m < ncols or m > MAX_PIVOTS:
        raise CorruptStreamError(f"linear prediction: {m} pivots for {ncols} columns")
    if frac_bits > MAX_FRAC_BITS or pivot_bound > levelcoder.LEVEL_MAX:
        raise CorruptStreamError("linear prediction: precision or pivot bound out of range")
    end = _HEADER.size + 2 * m
    if len(data) < end:
        raise CorruptStreamError("linear prediction: side information truncated")
    pivots = np.frombuffer(data[_HEADER.size:end], dtype="<u2").astype(np.int64)
    if pivots.max() >= ncols or np.unique(pivots).size != m:
        raise CorruptStreamError("linear prediction: pivot columns out of range or repeated")
    count = coefficient_count(ncols, m)
    if count > levelcoder.max_elements_for_payload(len(data) - end):  # before allocating for it
        raise CorruptStreamError(f"linear prediction: {count} coefficients cannot fit in {len(data) - end} bytes")
    vec = np.empty(count, dtype=np.int32)
    levelcoder.decode_chunk(data[end:], _vector_layout(count), 0, vec)
    coef = np.zeros((ncols, m), dtype=np.int64)
    intercepts = np.empty(ncols, dtype=np.int64)
    pos = 0
    for t in range(ncols):
        k = allowed_coefficients(m, t)
        intercepts[t] = vec[pos]
        coef[t, :k] = vec[pos + 1:pos + 1 + k]
        pos += 1 + k
    pred = LinearPredictor(ncols, pivots, coef, intercepts, int(pivot_bound), int(frac_bits))
    if pred.float_dtype() is None:
        raise CorruptStreamError("linear prediction: coefficients too large for exact arithmetic")
    return pred


def _choose_pivots(cov: np.ndarray, m: int, block: int) -> np.ndarray | None:
    """Greedy, a block at a time: the columns whose regressions explain most of the other columns'
    variance (sum of squared correlations), then the covariance conditioned on them."""
    s = cov.copy()
    chosen: list[int] = []
    scale = max(float(np.diag(cov).max(initial=0.0)), 1e-300)
    while len(chosen) < m:
        diag = np.diag(s).copy()
        ok = diag > 1e-9 * scale
        ok[chosen] = False
        if int(ok.sum()) < block:
            return None
        inv = np.where(ok, 1.0 / np.where(ok, diag, 1.0), 0.0)
        score = ((s * s) @ inv) * inv  # sum over j of s_jc^2 / (s_jj s_cc), j and c still free
        score[~ok] = -np.inf
        pick = [int(c) for c in np.argsort(-score, kind="stable")[:block]]
        chosen += pick
        sub = s[np.ix_(pick, pick)]
        try:
            s = s - s[:, pick] @ np.linalg.solve(sub, s[pick, :])
        except np.linalg.LinAlgError:
            return None
    return np.array(chosen, dtype=np.int64)


def fit(levels: np.ndarray, ncols: int, level_bound: int | None = None) -> LinearPredictor | None:
    """A predictor for the row-major matrix of flat int32 ``levels`` with ``ncols`` columns, or None
    when the matrix does not qualify or prediction would not pay. ``level_bound``, if known, bounds
    every |level| (it saves a pass over the matrix)."""
    if levels.dtype != np.int32 or levels.ndim != 1 or not ncols or levels.size % ncols:
        raise ValueError("levels must be a flat int32 array of whole rows")
    rows = levels.size // ncols
    m = min(ncols // 3, MAX_PIVOTS) // BLOCK * BLOCK
    if not qualifies(rows, ncols) or m < BLOCK:
        return None
    x = levels.reshape(rows, ncols)
    stride = max(1, rows // (FIT_ROWS_PER_COLUMN * ncols))
    sample = x[::stride].astype(np.float64)
    n = sample.shape[0]
    # Sums of integer products, exact in float64 (whatever the BLAS's summation order) while
    # rows * max|level|**2 < 2**53: levels up to 2**20 for 8,000 rows. Beyond that the fit is a
    # little less precise, never wrong: the coefficients travel with the stream.
    mean = sample.sum(axis=0) / n
    cov = (sample.T @ sample) / n - np.outer(mean, mean)
    pivots = _choose_pivots(cov, m, BLOCK)
    if pivots is None:
        return None
    order = _order(ncols, pivots)
    fit_cov = cov + RIDGE * np.diag(np.diag(cov))
    beta = np.zeros((ncols, m))
    spp = fit_cov[np.ix_(pivots, pivots)]
    try:
        low = np.linalg.cholesky(spp)
        # spp = U D U^T with U unit lower triangular: row t of -inv(U) regresses pivot t on pivots < t.
        beta[:m] = np.tril(-np.linalg.inv(low / np.diag(low)[None, :]), -1)
        beta[m:] = np.linalg.solve(spp, fit_cov[np.ix_(pivots, order[m:])]).T
    except np.linalg.LinAlgError:
        return None

    # Gaussian estimate of the saving (on the sampled rows) against the side information.
    var = np.diag(cov)[order]
    explained = np.einsum("tj,jt->t", beta, cov[np.ix_(pivots, order)])
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = 0.5 * np.log2(var / np.maximum(var - explained, 1e-12 * var)).sum()
    side = coefficient_count(ncols, m) * SIDE_BITS_PER_COEFFICIENT
    if not np.isfinite(gain) or gain * rows < GAIN_MARGIN * side:
        return None

    unit = float(1 << FRAC_BITS)
    coef = np.rint(beta * unit)
    intercepts = np.rint((mean[order] - beta @ mean[pivots]) * unit)
    if max(np.abs(coef).max(), np.abs(intercepts).max()) > levelcoder.LEVEL_MAX:
        return None
    bound = int(np.abs(levels).max()) if level_bound is None else int(level_bound)
    pred = LinearPredictor(ncols, pivots, coef.astype(np.int64), intercepts.astype(np.int64), bound, FRAC_BITS)
    if pred.float_dtype() is None:
        return None
    # every residual must fit the level coder: |level| + |prediction| < 2**31 - 1
    top = (pred.sum_bound + int(np.abs(pred.intercepts).max())) >> FRAC_BITS
    return pred if bound + top + 1 < levelcoder.LEVEL_MAX else None
