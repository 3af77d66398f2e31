"""Entropy-bounded matrix formats: compute directly on quantized weights (CER and CSER).

A quantized weight matrix has few distinct values and a skewed value distribution. Both formats
(Wiedemann et al., "Compact and Computationally Efficient Representation of Deep Neural Networks")
rank the distinct values once for the whole matrix by frequency; the most frequent value (usually 0)
is implicit. Each row stores its other entries grouped by value, so a dot product adds the inputs of
a group first and multiplies once per group (distributive law)::

    y[r] = v0 * sum(x) + sum over groups g of row r: (value(g) - v0) * sum(x[j] for j in g)

* **CER** (compressed entropy row): group i of a row holds the value of rank i + 1; a row lists
  groups up to the highest rank it contains, empty ones included, and stores no value per group.
* **CSER** (compressed shared elements row): each group also stores the rank of its value (an index
  into the shared value list), so a row pays nothing for the values it lacks.

Arrays held (``.arrays``; ``.nbytes`` is the sum of their sizes, nothing else is kept):

=========== ============================================================================
``values``  float32 [K] the distinct values, most frequent first (``levels`` int32 [K] as well
            when built from integer levels, for :meth:`to_levels`)
``tokens``  the columns of every row, group after group, ascending inside a group, in one of
            three codings picked per matrix (``coding``): ``"absolute"`` column indices in the
            narrowest of uint8/16/32 that holds n - 1; ``"delta8"`` gaps to the previous column
            of the group in bytes; ``"delta4"`` gaps in nibbles, two per byte, each group starting
            on a byte. A gap token of all ones (255 or 15) means "skip that many columns" and holds
            no element. Padded by 4 zero bytes so kernels can read past a group without a branch.
``gcnt``    tokens per group          (narrowest of uint8/16/32 holding the largest of these three)
``rowng``   groups per row
``gval``    rank of each group's value (CSER only)
``blk_tok`` token and group offsets of every 16th row (uint32): the only absolute pointers,
``blk_grp`` and the unit of work the threads split
=========== ============================================================================

The ``"entries"`` coding has no groups: ``tokens`` holds every stored entry's absolute column
(ascending along the row), ``gval`` its rank (CER too), ``rowng`` the entries per row; there is no
``gcnt`` and no ``blk_grp``. It suits rows whose groups would hold one to a few entries. Matrices built
from levels whose implicit level is 0, with at most 256 distinct levels, store a *level code* in
``gval`` instead of the rank (uint8): a level L in [-128, 127] has code ``L & 0xFF`` (its int8 byte),
and the levels outside that range, taken in the order of ``levels``, get the codes no level inside
it uses, smallest first. The matvec then reads the coefficient from the entry itself (the code as
int8) instead of looking it up, and corrects the entries with reassigned codes from ``outliers``
(int64 [k, 2]: an entry's position in ``tokens`` and its level minus its code read as int8, by
position).

``coding="auto"`` (the default) trades bytes for speed. On large groups the codings decode at about
1 : 1.6 : 3 the time per entry (absolute, delta8, delta4); on small groups, and wherever gaps are long
(escapes), the delta codings fall much further behind while saving little. So it keeps "absolute"
unless the non-empty groups hold at least :data:`AUTO_DELTA_MIN_GROUP` entries on average, and then
moves to the next, slower coding only when that saves at least :data:`AUTO_DELTA_MIN_SAVING` of the
bytes and stays cheap to decode: delta8 with at most :data:`AUTO_DELTA8_MAX_ESCAPES` escapes per
stored entry (an escape costs a mispredicted branch), delta4 with at most :data:`AUTO_DELTA4_MAX_TOKENS`
nibbles per entry. Before all that, it drops the groups ("entries") where there are at least
:data:`AUTO_ENTRIES_MIN_GROUPS` of them per stored entry. Each coding can also be asked for
explicitly.

Products run in Numba, multi-threaded across rows for large enough inputs, in float32 with a fixed
summation order (results do not depend on the thread count). Implicit entries are skipped, so
non-finite inputs where the weight is the implicit value do not propagate as they would in a dense
product. Construction and products are for inference: there is no gradient.

Convolution weights are used through their 2-D view ``(out_channels, in_channels * kh * kw)``
(:func:`matrix_view`).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ..quant.reconstruct import reconstruct
from . import _matrix_kernels

__all__ = [
    "AUTO_DELTA4_MAX_TOKENS",
    "AUTO_DELTA8_MAX_ESCAPES",
    "AUTO_DELTA_MIN_GROUP",
    "AUTO_DELTA_MIN_SAVING",
    "AUTO_ENTRIES_MIN_GROUPS",
    "CERMatrix",
    "CSERMatrix",
    "csr_nbytes",
    "from_stream",
    "level_entropy",
    "matrix_view",
    "stream_format_sizes",
]

CODINGS = ("absolute", "delta8", "delta4", "entries")
_CODING_CODE = {"absolute": _matrix_kernels.CODING_ABSOLUTE, "delta8": _matrix_kernels.CODING_DELTA8,
                "delta4": _matrix_kernels.CODING_DELTA4, "entries": _matrix_kernels.CODING_ENTRIES}
# "auto" drops the groups ("entries") when there are at least this many per stored entry (groups of
# five entries or fewer on average; CER counts its empty groups). Measured on the benchmark layers
# (benchmarks/bench_matrix_formats.py): from about 0.2 up, matvec runs 1.2-2.5x faster that way;
# below 0.1, grouping wins by up to 1.4x.
AUTO_ENTRIES_MIN_GROUPS = 0.2
AUTO_DELTA_MIN_SAVING = 0.2
AUTO_DELTA_MIN_GROUP = 16
AUTO_DELTA8_MAX_ESCAPES = 0.02  # per stored entry: an escape costs a mispredicted branch, ~15 entries
AUTO_DELTA4_MAX_TOKENS = 1.5
# Products estimated to take less than this (ns, one thread) run serially: waking the other threads
# costs 1-2 us. Measured on random matrices of every coding (2 cores): threads win from an estimate
# of about 4,000 ns (4.7 us serial, 4.4 threaded) and by 20% at 6,000. The others split their rows
# into as many chunks as numba's pool has threads (numba.get_num_threads, which set_num_threads
# lowers, costs 0.5 us a call: a product of a small matrix takes a few); the threads numba runs them
# on are still capped by set_num_threads.
PARALLEL_MIN_NS = 4_000.0
# matvec on one thread, by kernel family (fitted on the benchmark layers; delta4 per nibble)
_NS_PER_TOKEN = (0.23, 0.31, 0.28, 0.39, 0.35, 0.28)
_NS_PER_GROUP = (3.0, 0.6, 2.5, 6.0, 0.0, 0.0)
# Absolute-coded matrices with more groups than this per stored entry (groups of fewer than ten
# entries) and per row use the flat matvec kernel (see _matrix_kernels). Measured with both kernels
# on the benchmark layers (benchmarks/bench_matrix_formats.py --kernels, one thread, each product
# after two other layers' as in a forward pass): flat wins by 1.2-1.4x on rows of 39-57 groups of
# 4-9 entries (unpruned layers at qp -24/-28); grouped is as fast or up to 1.9x faster on larger
# groups (rows of 1,152 to 1,536 columns) and on pruned rows of 5-10 groups. The rule misses the
# expand conv at qp -20 (14 groups a row of 11 entries: flat 0.78x). Smaller groups go to the
# entries coding.
FLAT_GROUPS_PER_ENTRY = 0.1
FLAT_GROUPS_PER_ROW = 16
# (the entries kernels take row cuts)
_MV_SERIAL = (_matrix_kernels._mv_abs, _matrix_kernels._mv_abs_flat, _matrix_kernels._mv_d8, _matrix_kernels._mv_d4)
_NO_OUTLIERS = np.zeros((0, 2), dtype=np.int64)
_MAX_LEVEL_SPAN = 1 << 26  # level ranges up to this are counted with bincount, wider ones sorted
_ZERO = np.float32(0.0)


def _uint_for(max_value: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def matrix_view(tensor) -> np.ndarray:
    """The 2-D view of a weight tensor: ``(shape[0], prod(shape[1:]))`` (conv: out x in*kh*kw)."""
    arr = np.asarray(tensor)
    if arr.ndim < 2:
        raise ValueError(f"a weight matrix needs at least 2 dimensions, got shape {arr.shape}")
    return arr.reshape(arr.shape[0], -1)


def level_entropy(levels) -> float:
    """Entropy in bits per element of the distribution of values in ``levels`` (0 for empty input)."""
    arr = np.asarray(levels).reshape(-1)
    if arr.size == 0:
        return 0.0
    _, counts = np.unique(arr, return_counts=True)
    p = counts / arr.size
    return float(-(p * np.log2(p)).sum())


def csr_nbytes(levels, *, value_itemsize: int = 4, index_itemsize: int = 4, pointer_itemsize: int = 4) -> int:
    """Bytes of a CSR matrix holding the nonzeros of ``levels`` (a 2-D array, any dtype).

    The defaults are scipy.sparse's ``csr_matrix`` of float32 data: float32 values, int32 column
    indices and int32 row pointers (scipy's smallest index type).
    """
    arr = np.asarray(levels)
    if arr.ndim != 2:
        raise ValueError(f"levels must be a 2-D array, got shape {arr.shape}")
    nnz = int(np.count_nonzero(arr))
    return nnz * (value_itemsize + index_itemsize) + (arr.shape[0] + 1) * pointer_itemsize


# --------------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------------


def _float32_operand(a, ndim: int, n: int, name: str, expected: str) -> np.ndarray:
    """A product's operand as a C-contiguous float32 array with ``ndim`` dimensions, the first of
    length ``n``: as given when it already is one (a product costs microseconds), else converted."""
    if type(a) is np.ndarray and a.dtype == np.float32 and a.ndim == ndim and a.shape[0] == n and a.flags.c_contiguous:
        return a
    v = np.asarray(a)
    if v.ndim != ndim or v.shape[0] != n:
        raise ValueError(f"{name} must be {expected}, got shape {v.shape}")
    if not (np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer)):
        raise ValueError(f"{name} must hold numbers, got dtype {v.dtype}")
    return np.ascontiguousarray(v, dtype=np.float32)


def _entries_offsets(values: np.ndarray) -> np.ndarray:
    """What the entries matvec kernel takes for ``values``: v0 taken off every other value once, so
    that the kernel does not subtract it per entry (rank 0, never stored per entry, keeps v0)."""
    offsets = values.copy()
    offsets[1:] -= offsets[0]
    return offsets


def _level_codes(levels) -> np.ndarray | None:
    """The uint8 code of every ranked level in the entries coding (module docstring), or None where
    level codes do not apply: not built from levels, implicit level not 0, over 256 distinct levels."""
    if levels is None or levels.size == 0 or levels.size > 256 or levels[0] != 0:
        return None
    lv = levels.astype(np.int64)
    inside = (lv >= -128) & (lv <= 127)
    codes = np.zeros(lv.size, dtype=np.uint8)
    codes[inside] = (lv[inside] & 0xFF).astype(np.uint8)
    taken = np.zeros(256, dtype=bool)
    taken[codes[inside]] = True
    codes[~inside] = np.flatnonzero(~taken)[:int((~inside).sum())]  # (never short: distinct levels)
    return codes


def _entry_cuts(rowng: np.ndarray, outlier_pos: np.ndarray, nchunks: int) -> np.ndarray:
    """Where the entries matvec's chunks start (int64 [nchunks + 1, 3]: row, its token offset and its
    first outlier): at rows, about equal numbers of entries apart (a 384-row matrix has only 24
    blocks of 16 rows: block-sized chunks could differ by 12%)."""
    m = rowng.size
    ends = np.cumsum(rowng, dtype=np.int64)
    total = int(ends[-1]) if m else 0
    rows = [0]
    for c in range(1, nchunks):
        rows.append(max(rows[-1], int(np.searchsorted(ends, total * c // nchunks, side="right"))))
    rows.append(m)
    row_cuts = np.array(rows, dtype=np.int64)
    starts = np.concatenate([[0], ends])[row_cuts]
    cuts = np.stack([row_cuts, starts, np.searchsorted(outlier_pos, starts)], axis=1)
    return np.ascontiguousarray(cuts, dtype=np.int64)


def _integer_matrix(arr, what: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != 2:
        raise ValueError(f"{what} must be a 2-D array (use matrix_view for conv weights), got shape {a.shape}")
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got dtype {a.dtype}")
    return a


def _check_step(step) -> float:
    try:
        s = float(step)
    except (TypeError, ValueError):
        raise ValueError(f"step must be a positive finite number, got {step!r}") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"step must be a positive finite number, got {step!r}")
    return s


def _check_coding(coding: str) -> str:
    if coding != "auto" and coding not in CODINGS:
        raise ValueError(f"coding must be 'auto' or one of {CODINGS}, got {coding!r}")
    return coding


def _ranks_from_codes(codes: np.ndarray, ncodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (int32, 0 = most frequent) of the codes 0..ncodes-1 in ``codes`` and, for every rank,
    the code it stands for. Ties go to the smaller code (codes ascend with the values)."""
    counts = np.bincount(codes.reshape(-1), minlength=ncodes)
    present = np.flatnonzero(counts)
    order = present[np.lexsort((present, -counts[present]))]
    rank_of = np.zeros(ncodes, dtype=np.int32)
    rank_of[order] = np.arange(order.size, dtype=np.int32)
    return rank_of[codes], order


# --------------------------------------------------------------------------------------------------
# the formats
# --------------------------------------------------------------------------------------------------


class _RowGroupedMatrix:
    """Shared machinery of :class:`CERMatrix` and :class:`CSERMatrix` (see the module docstring)."""

    _cser = False
    format_name = ""

    def __init__(self, *, shape, values, levels, step, coding, tokens, gcnt, rowng, gval, blk_tok,
                 blk_grp, nnz, outliers=None, tensor_shape=None):
        # Private: use from_levels / from_codebook / from_dense.
        self._shape = (int(shape[0]), int(shape[1]))
        self._values = values
        self._levels = levels
        self._step = step
        self._coding = coding
        self._tokens = tokens
        self._gcnt = gcnt
        self._rowng = rowng
        self._gval = gval
        self._blk_tok = blk_tok
        self._blk_grp = blk_grp
        self._nnz = int(nnz)
        # The value and level tables the kernels index with ``gval``: by rank, or by level code
        # (``outliers`` is only set for level-coded entries).
        self._outliers = outliers
        self._value_book, self._level_book = values, levels
        if outliers is not None:
            codes = _level_codes(levels)
            self._value_book = np.zeros(256, dtype=np.float32)
            self._value_book[codes] = values
            self._level_book = np.zeros(256, dtype=np.int32)
            self._level_book[codes] = levels
        self.tensor_shape = tuple(tensor_shape) if tensor_shape is not None else self._shape

    # -- constructors ------------------------------------------------------------------------------

    @classmethod
    def from_levels(cls, levels, step, *, coding: str = "auto"):
        """From integer quantization levels (2-D) and the step: the values are ``level * step``
        rounded once to float32 (as the codec reconstructs them)."""
        lv = _integer_matrix(levels, "levels")
        step = _check_step(step)
        _check_coding(coding)
        if lv.size:
            lo, hi = int(lv.min()), int(lv.max())
            if lo < np.iinfo(np.int32).min or hi > np.iinfo(np.int32).max:
                raise ValueError("levels must fit in int32")
            if hi - lo < _MAX_LEVEL_SPAN:
                ranks, order = _ranks_from_codes((lv.astype(np.int64) - lo).astype(np.int32), hi - lo + 1)
                level_book = (order + lo).astype(np.int32)
            else:
                uniq, inv = np.unique(lv.astype(np.int32), return_inverse=True)
                ranks, order = _ranks_from_codes(inv.reshape(lv.shape).astype(np.int32), uniq.size)
                level_book = uniq[order].astype(np.int32)
        else:
            ranks = np.zeros(lv.shape, dtype=np.int32)
            level_book = np.zeros(0, dtype=np.int32)
        values = reconstruct(level_book, step, "float32")
        return cls._build(ranks, values, level_book, step, coding)

    @classmethod
    def from_codebook(cls, indices, codebook, *, coding: str = "auto"):
        """From a matrix of indices into a small codebook of values (rounded to float32)."""
        idx = _integer_matrix(indices, "indices")
        book = np.asarray(codebook)
        if book.ndim != 1 or not (np.issubdtype(book.dtype, np.floating) or np.issubdtype(book.dtype, np.integer)):
            raise ValueError(f"codebook must be a 1-D array of numbers, got shape {book.shape} dtype {book.dtype}")
        book = book.astype(np.float32)
        if not np.all(np.isfinite(book)):
            raise ValueError("codebook values must be finite (after rounding to float32)")
        _check_coding(coding)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= book.size):
            raise ValueError(f"indices must lie in [0, {book.size}) for a codebook of {book.size} values")
        uniq, merge = np.unique(book, return_inverse=True)  # equal values share one group
        codes = merge.reshape(-1)[idx].astype(np.int32) if idx.size else np.zeros(idx.shape, np.int32)
        ranks, order = _ranks_from_codes(codes, uniq.size) if idx.size else (codes, np.zeros(0, np.int64))
        return cls._build(ranks, uniq[order].astype(np.float32), None, None, coding)

    @classmethod
    def from_dense(cls, matrix, *, coding: str = "auto"):
        """From a dense 2-D matrix with few distinct values (stored as float32: exact for float32
        and float16 input). Cost and size grow with the number of distinct values."""
        a = np.asarray(matrix)
        if a.ndim != 2:
            raise ValueError(f"matrix must be a 2-D array (use matrix_view for conv weights), got shape {a.shape}")
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)) or a.dtype == np.bool_:
            raise ValueError(f"matrix must hold numbers, got dtype {a.dtype}")
        a = a.astype(np.float32)
        if not np.all(np.isfinite(a)):
            raise ValueError("matrix values must be finite (after rounding to float32)")
        _check_coding(coding)
        uniq, inv = np.unique(a, return_inverse=True)
        codes = inv.reshape(a.shape).astype(np.int32)
        ranks, order = _ranks_from_codes(codes, uniq.size) if a.size else (codes, np.zeros(0, np.int64))
        return cls._build(ranks, uniq[order].astype(np.float32), None, None, coding)

    @classmethod
    def _build(cls, ranks: np.ndarray, values: np.ndarray, levels, step, coding: str):
        ranks = np.ascontiguousarray(ranks, dtype=np.int32)
        m, n = ranks.shape
        nranks = int(values.size)
        stats = np.zeros((m, 9), dtype=np.int64)
        if m and n and nranks > 1:
            _matrix_kernels._build_stats(ranks, nranks, _build_chunks(m * n), stats)
        ng = stats[:, 4] if cls._cser else stats[:, 3]
        ngroups = int(ng.sum())
        abs_dtype = _uint_for(max(n - 1, 0))
        entries = int(stats[:, 0].sum())
        if coding == "auto" and entries and ngroups >= AUTO_ENTRIES_MIN_GROUPS * entries:
            coding = "entries"
        if coding == "entries":
            return cls._build_entries(ranks, values, levels, step, stats[:, 0], abs_dtype)
        row_max = int(ng.max()) if m else 0
        gval_max = nranks - 1 if cls._cser else 0
        meta_arrays = ngroups * (2 if cls._cser else 1) + m

        per_row = {"absolute": stats[:, 0], "delta8": stats[:, 1], "delta4": stats[:, 2]}
        biggest = {"absolute": stats[:, 5], "delta8": stats[:, 6], "delta4": stats[:, 7]}
        sizes = {}
        for c in ("absolute", "delta8", "delta4"):
            total = int(per_row[c].sum())
            itemsize = abs_dtype.itemsize if c == "absolute" else 1
            tok_bytes = (total + _matrix_kernels.PAD_TOKENS) * itemsize
            big = int(biggest[c].max()) if m else 0
            meta = _uint_for(max(big, row_max, gval_max))
            sizes[c] = (tok_bytes + meta.itemsize * meta_arrays, meta)
        if coding == "auto":
            groups = max(int(stats[:, 4].sum()), 1)
            usable = {
                "delta8": int(stats[:, 1].sum()) - entries <= AUTO_DELTA8_MAX_ESCAPES * entries,
                "delta4": int(stats[:, 8].sum()) <= AUTO_DELTA4_MAX_TOKENS * entries,
            }
            coding = "absolute"
            if entries >= AUTO_DELTA_MIN_GROUP * groups:
                for c in ("delta8", "delta4"):
                    if usable[c] and sizes[c][0] <= (1.0 - AUTO_DELTA_MIN_SAVING) * sizes[coding][0]:
                        coding = c
        meta_dtype = sizes[coding][1]

        tok_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(per_row[coding], out=tok_off[1:])
        grp_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(ng, out=grp_off[1:])
        ntok = int(tok_off[-1])
        tok = np.zeros(ntok + _matrix_kernels.PAD_TOKENS, dtype=abs_dtype if coding == "absolute" else np.uint8)
        gcnt = np.zeros(ngroups, dtype=meta_dtype)
        rowng = np.zeros(m, dtype=meta_dtype)
        gval = np.zeros(ngroups, dtype=meta_dtype) if cls._cser else None
        if m and n and nranks > 1:
            _matrix_kernels._build_fill(ranks, nranks, _build_chunks(m * n), _CODING_CODE[coding], tok_off, grp_off,
                                        tok, gcnt, rowng, gval)

        return cls(shape=(m, n), values=values, levels=levels, step=step, coding=coding, tokens=tok,
                   gcnt=gcnt, rowng=rowng, gval=gval, blk_tok=_block_offsets(tok_off, "tokens"),
                   blk_grp=_block_offsets(grp_off, "groups"), nnz=entries)

    @classmethod
    def _build_entries(cls, ranks, values, levels, step, row_entries: np.ndarray, abs_dtype):
        m, n = ranks.shape
        tok_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(row_entries, out=tok_off[1:])
        entries = int(tok_off[-1])
        blk_tok = _block_offsets(tok_off, "entries")
        meta_dtype = _uint_for(int(row_entries.max()) if m else 0)
        tok = np.zeros(entries + _matrix_kernels.PAD_TOKENS, dtype=abs_dtype)
        rowng = np.zeros(m, dtype=meta_dtype)
        gval = np.zeros(entries, dtype=_uint_for(max(values.size - 1, 0)))
        if entries:
            _matrix_kernels._build_fill_entries(ranks, _build_chunks(m * n), tok_off, tok, rowng, gval)
        outliers = None
        codes = _level_codes(levels)
        if codes is not None:  # ranks -> level codes (the ranks fit uint8 here)
            gval = codes[gval]
            reassigned = codes[(levels < -128) | (levels > 127)]
            pos = np.flatnonzero(np.isin(gval, reassigned))
            book = np.zeros(256, dtype=np.int64)
            book[codes] = levels
            outliers = np.empty((pos.size, 2), dtype=np.int64)
            outliers[:, 0] = pos
            outliers[:, 1] = book[gval[pos]] - gval[pos].view(np.int8)
        return cls(shape=(m, n), values=values, levels=levels, step=step, coding="entries", tokens=tok,
                   gcnt=np.zeros(0, dtype=meta_dtype), rowng=rowng, gval=gval, blk_tok=blk_tok,
                   blk_grp=blk_tok, nnz=entries, outliers=outliers)

    # -- description -------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def coding(self) -> str:
        """How rows are stored: groups with ``"absolute"``, ``"delta8"`` or ``"delta4"`` column
        tokens, or ``"entries"`` (no groups: every entry with its column and rank)."""
        return self._coding

    @property
    def index_dtype(self) -> np.dtype:
        """dtype of the token array (nibble tokens are packed two per uint8)."""
        return self._tokens.dtype

    @property
    def meta_dtype(self) -> np.dtype:
        return self._rowng.dtype

    @property
    def nnz(self) -> int:
        """Stored entries: those not equal to the implicit (most frequent) value."""
        return self._nnz

    @property
    def num_values(self) -> int:
        return int(self._values.size)

    @property
    def values(self) -> np.ndarray:
        """The distinct values, most frequent (implicit) first (a read-only view)."""
        v = self._values.view()
        v.flags.writeable = False
        return v

    @property
    def implicit_value(self) -> float:
        return float(self._values[0]) if self._values.size else 0.0

    @property
    def step(self) -> float | None:
        return self._step

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every array the matrix holds, by name (shared, not copies: do not modify)."""
        out = {"values": self._values, "tokens": self._tokens}
        if self._coding != "entries":
            out["gcnt"] = self._gcnt
        out["rowng"] = self._rowng
        if self._gval is not None:
            out["gval"] = self._gval
        out["blk_tok"] = self._blk_tok
        if self._coding != "entries":  # (the same offsets as blk_tok there)
            out["blk_grp"] = self._blk_grp
        if self._levels is not None:
            out["levels"] = self._levels
        if self._outliers is not None:
            out["outliers"] = self._outliers
        return out

    @property
    def nbytes(self) -> int:
        """Storage in bytes: the sum of :attr:`arrays` (shape and scalars are not counted)."""
        return sum(int(a.nbytes) for a in self.arrays.values())

    @property
    def bits_per_weight(self) -> float:
        size = self._shape[0] * self._shape[1]
        return 8.0 * self.nbytes / size if size else 0.0

    def __repr__(self) -> str:
        m, n = self._shape
        return (f"{type(self).__name__}(shape=({m}, {n}), values={self.num_values}, nnz={self._nnz}, "
                f"coding={self._coding!r}, nbytes={self.nbytes}, bits/weight={self.bits_per_weight:.3f})")

    # -- kernels -----------------------------------------------------------------------------------

    def _args(self):
        return (self._tokens, self._gcnt, self._rowng, self._gval, self._blk_tok, self._blk_grp)

    def _chunks(self, batch: int) -> int:
        """1 (run serially) when the product would take less than about PARALLEL_MIN_NS ns on one
        thread, else the number of threads (rough per-token costs measured on the kernels)."""
        tokens = self._tokens.size * (2 if self._coding == "delta4" else 1)
        per_token, per_group = _NS_PER_TOKEN[self._kind], _NS_PER_GROUP[self._kind]
        if batch > 1:
            per_token, per_group = 0.1 * batch + 0.2, 3.0 + 0.1 * batch
        est = tokens * per_token + self._gcnt.size * per_group + self._shape[0] * 2.0
        if est < PARALLEL_MIN_NS:
            return 1
        threads = numba.get_num_threads()
        return threads if threads > 1 else 1

    @property
    def _kind(self) -> int:
        """Which kernel family runs matvec: 0 absolute, 1 absolute flat, 2 delta8, 3 delta4, 4 entries
        by rank, 5 entries by level code."""
        kind = self.__dict__.get("_kind_cache")
        if kind is None:
            if self._coding == "entries":
                kind = 4 if self._outliers is None else 5
            elif self._coding == "absolute":
                groups = self._gcnt.size
                flat = (groups > FLAT_GROUPS_PER_ENTRY * max(self._nnz, 1)
                        and groups > FLAT_GROUPS_PER_ROW * self._shape[0])
                kind = 1 if flat else 0
            else:
                kind = 2 if self._coding == "delta8" else 3
            self.__dict__["_kind_cache"] = kind
        return kind

    def _expand_into(self, book: np.ndarray, out: np.ndarray) -> np.ndarray:
        m, n = self._shape
        if m == 0 or n == 0:
            return out
        nblk = self._blk_tok.size - 1
        nch = self._chunks(max(1, n // 64))
        code = _CODING_CODE[self._coding]
        if nch > 1:
            _matrix_kernels._expand_par(nch, code, *self._args(), book, out)
        else:
            _matrix_kernels._expand(0, nblk, code, *self._args(), book, out)
        return out

    def to_dense(self) -> np.ndarray:
        """The dense float32 matrix, exactly (the values as stored)."""
        return self._expand_into(self._value_book, np.empty(self._shape, dtype=np.float32))

    def to_levels(self) -> np.ndarray:
        """The int32 level matrix (only for matrices built with :meth:`from_levels`)."""
        if self._levels is None:
            raise ValueError("this matrix was not built from levels; use to_dense()")
        return self._expand_into(self._level_book, np.empty(self._shape, dtype=np.int32))

    def matvec(self, x) -> np.ndarray:
        """``W @ x`` for a vector of length n, in float32."""
        m, n = self._shape
        x = _float32_operand(x, 1, n, "x", f"a vector of length {n}")
        y = np.empty(m, dtype=np.float32)
        if m == 0 or n == 0:
            y[:] = 0.0
            return y
        plan = self.__dict__.get("_mv_plan")
        if plan is None:  # what every call needs, worked out once (a call costs microseconds)
            plan = self.__dict__["_mv_plan"] = self._matvec_plan()
        kernel, head, scale, v0 = plan
        xsum = _ZERO if v0 is None else np.float32(x.sum(dtype=np.float64))
        if scale is None:
            kernel(*head, x, xsum, y)
        else:  # the entries kernels: row r = base + scale * (its sum)
            kernel(*head, x, v0 * xsum if v0 is not None else _ZERO, scale, y)
        return y

    def _matvec_plan(self):
        """(kernel, its leading arguments, the entries kernels' scale or None, v0 as float32 or None
        where it is 0): the entries kernels end with ``(x, v0 * xsum, scale, y)``, the others with
        ``(x, xsum, y)``."""
        kind = self._kind
        nchunks = numba.config.NUMBA_NUM_THREADS if self._chunks(1) > 1 else 1
        v0 = None if self._values[0] == 0 else np.float32(self._values[0])
        if kind in (4, 5):
            outliers = self._outliers if kind == 5 else _NO_OUTLIERS
            cuts = _entry_cuts(self._rowng, outliers[:, 0], nchunks)
            if kind == 5:  # level codes: the coefficient is the code, times the step per row
                gval, offsets, scale = self._gval.view(np.int8), None, np.float32(self._step)
            else:
                gval, offsets, scale = self._gval, _entries_offsets(self._values), np.float32(1.0)
            head = (cuts, self._tokens, self._rowng, gval, offsets, outliers)
            return (_matrix_kernels._mv_entries_par if nchunks > 1 else _matrix_kernels._mv_entries), head, scale, v0
        arrays = self._args() + (self._values,)
        if nchunks > 1:
            return _matrix_kernels._mv_par, (kind, nchunks) + arrays, None, v0
        return _MV_SERIAL[kind], (0, self._blk_tok.size - 1) + arrays, None, v0

    def matmat(self, X) -> np.ndarray:
        """``W @ X`` for a matrix X of shape (n, B) (B inputs as columns), in float32: (m, B).

        X is used C-contiguous (copied if it is not), so the B inputs of one column are adjacent.
        """
        m, n = self._shape
        Xa = _float32_operand(X, 2, n, "X", f"of shape ({n}, B)")
        nb = Xa.shape[1]
        Y = np.empty((m, nb), dtype=np.float32)
        if m == 0 or nb == 0:
            return Y
        if n == 0:
            Y[:] = 0.0
            return Y
        v0 = self._values[0]
        xsum = Xa.sum(axis=0, dtype=np.float64).astype(np.float32) if v0 != 0 else np.zeros(nb, np.float32)
        parallel = self.__dict__.setdefault("_mm_parallel", {})  # per batch size (a call costs microseconds)
        if nb not in parallel:
            parallel[nb] = self._chunks(nb) > 1
        nch = numba.config.NUMBA_NUM_THREADS if parallel[nb] else 1
        code = _CODING_CODE[self._coding]
        if nch > 1:
            _matrix_kernels._mm_par(nch, code, *self._args(), self._value_book, Xa, xsum, Y)
        else:
            _matrix_kernels._mm(0, self._blk_tok.size - 1, code, *self._args(), self._value_book, Xa, xsum, Y)
        return Y

    def __matmul__(self, other):
        a = np.asarray(other)
        return self.matvec(a) if a.ndim == 1 else self.matmat(a)


class CERMatrix(_RowGroupedMatrix):
    """Compressed Entropy Row: per row, groups of columns by value rank, no per-group value index.

    >>> W = CERMatrix.from_levels(np.array([[0, 2, 0, -1], [1, 0, 0, 0]], dtype=np.int32), 0.5)
    >>> W.to_dense().tolist()
    [[0.0, 1.0, 0.0, -0.5], [0.5, 0.0, 0.0, 0.0]]
    >>> W.matvec(np.array([1, 2, 3, 4], dtype=np.float32)).tolist()
    [0.0, 0.5]
    """

    _cser = False
    format_name = "CER"


class CSERMatrix(_RowGroupedMatrix):
    """Compressed Shared Elements Row: like CER, but every group stores the index of its value in
    the shared value list, so rows only list the values they contain.

    >>> W = CSERMatrix.from_codebook(np.array([[0, 1, 1], [2, 0, 0]]), np.array([0.0, 0.25, -1.0]))
    >>> (W @ np.ones((3, 2), dtype=np.float32)).tolist()
    [[0.5, 0.5], [-1.0, -1.0]]
    """

    _cser = True
    format_name = "CSER"


_FORMATS = {"cer": CERMatrix, "cser": CSERMatrix}


def _block_offsets(row_offsets: np.ndarray, what: str) -> np.ndarray:
    """The offsets (m + 1 of them, int64) at every ROWS_PER_BLOCK-th row and at the end, as uint32."""
    if int(row_offsets[-1]) > np.iinfo(np.uint32).max:
        raise ValueError(f"matrix too large: more than 2**32 - 1 {what}")
    m = row_offsets.size - 1
    nblk = (m + _matrix_kernels.ROWS_PER_BLOCK - 1) // _matrix_kernels.ROWS_PER_BLOCK
    return row_offsets[np.minimum(np.arange(nblk + 1) * _matrix_kernels.ROWS_PER_BLOCK, m)].astype(np.uint32)


def _build_chunks(size: int) -> int:
    threads = numba.get_num_threads()
    return threads if threads > 1 and size >= 200_000 else 1


def from_stream(data, formats: str = "cser", *, coding: str = "auto", names=None,
                threads: int | None = None) -> dict[str, _RowGroupedMatrix]:
    """Decode a model stream straight into CER or CSER matrices.

    Every quantized float tensor with at least two dimensions becomes a matrix of its 2-D view
    (``tensor_shape`` keeps the original shape); other tensors are left out. ``formats`` is
    ``"cer"`` or ``"cser"``; ``names`` optionally restricts the tensors (an iterable of names).
    Values are ``level * step`` in float32, which is what ``decode_model`` returns for float32
    tensors (float16/bfloat16 tensors decode to those values rounded once more).
    """
    from ..model.decoder import decode_levels

    cls = _FORMATS.get(formats)
    if cls is None:
        raise ValueError(f"formats must be one of {sorted(_FORMATS)}, got {formats!r}")
    _check_coding(coding)
    wanted = None if names is None else set(names)
    levels = decode_levels(data, threads=threads)
    out: dict[str, _RowGroupedMatrix] = {}
    for name, q in levels.items():
        if wanted is not None and name not in wanted:
            continue
        if q.step is None or q.levels.ndim < 2 or q.dtype not in ("float32", "float16", "bfloat16", "float64"):
            continue
        mat = cls.from_levels(matrix_view(q.levels), q.step, coding=coding)
        mat.tensor_shape = tuple(q.levels.shape)
        out[name] = mat
    return out


def stream_format_sizes(data, *, threads: int | None = None) -> list[dict]:
    """Per quantized tensor with two or more dimensions of a model stream: its 2-D view's bytes as
    dense float32 (``dense``), scipy-style CSR (``csr``), CER (``cer``), CSER (``cser``) and in the
    stream (``stream``: the tensor's payload), the entropy of its levels and the CER/CSER codings."""
    from ..model.decoder import decode_levels, read_stream_header

    header = read_stream_header(data)
    payload = {e.name: e.size for e in header.tensors if not e.is_alias}
    rows = []
    for name, q in decode_levels(data, threads=threads).items():
        if q.step is None or q.levels.ndim < 2:
            continue
        lv = matrix_view(q.levels)
        cer = CERMatrix.from_levels(lv, q.step)
        cser = CSERMatrix.from_levels(lv, q.step)
        rows.append({
            "name": name, "shape": list(q.levels.shape), "matrix_shape": list(lv.shape),
            "entropy_bits": level_entropy(lv), "dense": 4 * lv.size, "csr": csr_nbytes(lv),
            "cer": cer.nbytes, "cser": cser.nbytes, "stream": int(payload[name]),
            "cer_coding": cer.coding, "cser_coding": cser.coding,
        })
    return rows
