"""CER / CSER matrices: exact round trips, kernels against numpy and a plain-Python reference,
the torch modules, and decoding a stored model straight into the formats."""

from __future__ import annotations

import doctest
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import deepcabac_py as dc
from deepcabac_py.matrix import formats as mf
from deepcabac_py.matrix.formats import CERMatrix, CSERMatrix, csr_nbytes, from_stream, level_entropy, matrix_view
from deepcabac_py.matrix.torch_modules import CompressedConv2d, CompressedLinear, compress_module
from deepcabac_py.quant.reconstruct import reconstruct
from deepcabac_py.quant.steps import step_from_qp

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "models" / "digits_cnn.safetensors"
FORMATS = (CERMatrix, CSERMatrix)
CODINGS = ("absolute", "delta8", "delta4", "entries")
KINDS = {"absolute": 0, "flat": 1, "delta8": 2, "delta4": 3, "entries": 4, "entries by code": 5}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def random_levels(rng, m, n, *, zero_frac=0.7, spread=3, offset=0):
    """Levels with a Laplacian-like spread; ``offset`` shifts everything (nonzero most frequent)."""
    lv = np.rint(rng.laplace(0.0, spread, size=(m, n))).astype(np.int32)
    lv[rng.random((m, n)) < zero_frac] = 0
    return lv + np.int32(offset)


def assert_close_product(got, W, X):
    """|got - W X| <= 1e-5 * (|W| |X|) + 1e-6 elementwise (float32 sums in any order)."""
    W64 = np.asarray(W, dtype=np.float64)
    X64 = np.asarray(X, dtype=np.float64)
    ref = W64 @ X64
    scale = np.abs(W64) @ np.abs(X64)
    assert got.shape == ref.shape
    assert got.dtype == np.float32
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= 1e-5 * scale + 1e-6), float(np.max(err - 1e-5 * scale))


@pytest.fixture
def force(monkeypatch):
    """force(kind=..., parallel=...): pick the kernel family and the threaded path."""
    def apply(*, flat=None, parallel=None):
        if flat is not None:
            monkeypatch.setattr(mf, "FLAT_GROUPS_PER_ENTRY", -1.0 if flat else 1e30)
            monkeypatch.setattr(mf, "FLAT_GROUPS_PER_ROW", -1.0 if flat else 1e30)
        if parallel is not None:
            monkeypatch.setattr(mf, "PARALLEL_MIN_NS", 0.0 if parallel else float("inf"))
    return apply


# --------------------------------------------------------------------------------------------------
# plain-Python reference: reads the arrays as documented, one element at a time
# --------------------------------------------------------------------------------------------------


def reference_level_codes(levels):
    """The rank of every level code, by the rule the module docstring states: a level in [-128, 127]
    has its int8 byte as code; the others, in the order of ``levels``, take the unused codes from
    the smallest up."""
    levels = [int(v) for v in levels]
    rank_of_code = {}
    for rank, level in enumerate(levels):
        if -128 <= level <= 127:
            rank_of_code[level % 256] = rank
    free = [c for c in range(256) if c not in rank_of_code]
    for rank, level in enumerate(levels):
        if not -128 <= level <= 127:
            rank_of_code[free.pop(0)] = rank
    return rank_of_code


def reference_groups(mat):
    """For every row, the list of (rank, [columns]) read from the stored arrays."""
    a = mat.arrays
    if mat.coding == "entries":  # no groups: each entry alone, with its column and rank (or code)
        tok, rowng, gval = a["tokens"], a["rowng"], a["gval"]
        assert "gcnt" not in a and "blk_grp" not in a
        lv = a.get("levels")
        by_code = lv is not None and 0 < lv.size <= 256 and lv[0] == 0
        assert ("outliers" in a) == by_code
        rank_of = reference_level_codes(lv) if by_code else None
        if by_code:  # the outliers are exactly the entries whose level is not their code read as int8
            int8 = lambda c: int(c) - 256 if c > 127 else int(c)  # noqa: E731
            want = [(k, int(lv[rank_of[int(c)]]) - int8(c))
                    for k, c in enumerate(gval) if int(lv[rank_of[int(c)]]) != int8(c)]
            assert [tuple(int(v) for v in o) for o in a["outliers"]] == want
        rows, t = [], 0
        for r in range(mat.shape[0]):
            rows.append([(rank_of[int(gval[k])] if by_code else int(gval[k]), [int(tok[k])])
                         for k in range(t, t + int(rowng[r]))])
            t += int(rowng[r])
        assert t == gval.size == mat.nnz
        return rows
    tok, gcnt, rowng = a["tokens"], a["gcnt"], a["rowng"]
    gval = a.get("gval")
    coding = mat.coding
    rows, t, g = [], 0, 0
    for r in range(mat.shape[0]):
        groups = []
        for i in range(int(rowng[r])):
            cnt = int(gcnt[g])
            rank = int(gval[g]) if gval is not None else i + 1
            cols = []
            if coding == "absolute":
                cols = [int(c) for c in tok[t:t + cnt]]
                t += cnt
            else:
                esc = 255 if coding == "delta8" else 15
                p = -1
                for k in range(cnt):
                    d = int(tok[t + k]) if coding == "delta8" else (int(tok[t + k // 2]) >> (4 * (k % 2))) & 15
                    if d == esc:
                        p += esc
                    else:
                        p += d + 1
                        cols.append(p)
                t += cnt if coding == "delta8" else (cnt + 1) // 2
            groups.append((rank, cols))
            g += 1
        rows.append(groups)
    assert g == gcnt.size
    return rows


def reference_dense(mat):
    m, n = mat.shape
    vals = [float(v) for v in mat.values]
    out = [[vals[0] if vals else 0.0] * n for _ in range(m)]
    for r, groups in enumerate(reference_groups(mat)):
        for rank, cols in groups:
            for c in cols:
                out[r][c] = vals[rank]
    return np.array(out, dtype=np.float32).reshape(m, n)


def reference_matmat(mat, X):
    """Distributive-law product in float64: v0 * sum(x) + sum over groups (v - v0) * sum(x[cols])."""
    vals = [float(v) for v in mat.values]
    v0 = vals[0] if vals else 0.0
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros((mat.shape[0], X.shape[1]))
    for r, groups in enumerate(reference_groups(mat)):
        out[r] = v0 * X.sum(axis=0)
        for rank, cols in groups:
            s = np.zeros(X.shape[1])
            for c in cols:
                s += X[c]
            out[r] += (vals[rank] - v0) * s
    return out


# --------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------


@st.composite
def level_matrices(draw):
    m = draw(st.integers(0, 24))
    n = draw(st.sampled_from([0, 1, 2, 7, 31, 200, 257, 300, 700]))
    kind = draw(st.sampled_from(["laplace", "all_zero", "single", "offset", "binary", "wide"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "all_zero":
        lv = np.zeros((m, n), np.int32)
    elif kind == "single":
        lv = np.full((m, n), draw(st.integers(-5, 5)), np.int32)
    elif kind == "offset":  # most frequent value is not zero
        lv = random_levels(rng, m, n, zero_frac=0.6, spread=2, offset=draw(st.sampled_from([-3, 1, 7])))
    elif kind == "binary":
        lv = (rng.random((m, n)) < 0.5).astype(np.int32)
    elif kind == "wide":  # many distinct values, tiny groups
        lv = random_levels(rng, m, n, zero_frac=0.9, spread=60)
    else:
        lv = random_levels(rng, m, n, zero_frac=draw(st.sampled_from([0.0, 0.5, 0.95])), spread=3)
    if m and n and draw(st.booleans()):  # empty rows and columns
        lv[rng.random(m) < 0.3, :] = lv.flat[0] if kind in ("single", "offset") else 0
        lv[:, rng.random(n) < 0.3] = lv.flat[0] if kind in ("single", "offset") else 0
    return lv


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lv=level_matrices(), qp=st.integers(-40, 4))
# levels 0..9 hold codes 0..9, so -246 takes the free code 10, its own byte: still an outlier
@example(lv=np.array([[0, 1, 2, 3, 4, 0], [5, 6, 7, 8, 9, 0], [-246, 0, 0, 0, 0, 0]], dtype=np.int32), qp=0)
def test_round_trip_exact(lv, qp):
    step = step_from_qp(qp)
    dense = reconstruct(lv, step, "float32")
    for cls in FORMATS:
        for coding in CODINGS + ("auto",):
            mat = cls.from_levels(lv, step, coding=coding)
            assert mat.shape == lv.shape
            assert np.array_equal(mat.to_dense(), dense)
            assert np.array_equal(mat.to_levels(), lv)
            expected_nnz = int(np.count_nonzero(lv != mat_most_frequent(lv))) if lv.size else 0
            assert mat.nnz == expected_nnz
            assert mat.nbytes == sum(a.nbytes for a in mat.arrays.values())
    # the arrays read as documented by a plain-Python reader give the same matrix
    for coding in ("delta4", "entries"):
        mat = CSERMatrix.from_levels(lv, step, coding=coding)
        assert np.array_equal(reference_dense(mat), dense)


def mat_most_frequent(lv):
    vals, counts = np.unique(lv, return_counts=True)
    best = counts.max()
    return vals[counts == best].min()  # ties go to the smaller value


@pytest.mark.parametrize("cls", FORMATS)
def test_from_dense_and_codebook(cls):
    rng = np.random.default_rng(1)
    book = np.array([0.0, 0.5, -0.25, 3.0, 0.5], dtype=np.float32)  # a duplicate value is merged
    idx = rng.choice(5, size=(13, 40), p=[0.6, 0.1, 0.1, 0.1, 0.1])
    expected = book[idx]
    for mat in (cls.from_codebook(idx, book), cls.from_dense(expected)):
        assert np.array_equal(mat.to_dense(), expected)
        assert mat.num_values == 4
        with pytest.raises(ValueError, match="not built from levels"):
            mat.to_levels()


def test_values_ranked_by_frequency():
    lv = np.array([[0, 0, 0, 5, 5, -1], [0, 5, 2, 2, 2, 0]], dtype=np.int32)
    mat = CERMatrix.from_levels(lv, 1.0)
    assert mat.values.tolist() == [0.0, 2.0, 5.0, -1.0]  # 2 and 5 tie (3 each): the smaller first
    assert mat.implicit_value == 0.0
    assert mat.nnz == 7


def test_index_dtypes_are_the_narrowest():
    rng = np.random.default_rng(2)
    small = CSERMatrix.from_levels(random_levels(rng, 8, 256), 1.0, coding="absolute")
    assert small.index_dtype == np.uint8 and small.meta_dtype == np.uint8
    wide = CSERMatrix.from_levels(random_levels(rng, 8, 257), 1.0, coding="absolute")
    assert wide.index_dtype == np.uint16
    huge_rows = CERMatrix.from_levels(np.tile(np.arange(140_000, dtype=np.int32) % 2, (2, 1)), 1.0,
                                      coding="absolute")  # 70,000 ones per row: one group > 65,535
    assert huge_rows.index_dtype == np.uint32 and huge_rows.meta_dtype == np.uint32
    for coding in ("delta8", "delta4"):
        assert CSERMatrix.from_levels(random_levels(rng, 8, 300), 1.0, coding=coding).index_dtype == np.uint8


def test_auto_coding_and_cer_vs_cser_sizes():
    rng = np.random.default_rng(3)
    dense_lv = rng.choice(np.array([-1, 0, 1, 2], np.int32), size=(64, 1000), p=[0.2, 0.5, 0.2, 0.1])
    assert CSERMatrix.from_levels(dense_lv, 1.0).coding in ("delta8", "delta4")  # big groups, short gaps
    high_entropy = random_levels(rng, 64, 1000, zero_frac=0.05, spread=40)  # long gaps in every group
    assert CSERMatrix.from_levels(high_entropy, 1.0).coding in ("absolute", "entries")  # no gap coding
    sparse_lv = random_levels(rng, 64, 1000, zero_frac=0.97, spread=80)  # tiny groups: no groups at all
    cer, cser = CERMatrix.from_levels(sparse_lv, 1.0), CSERMatrix.from_levels(sparse_lv, 1.0)
    assert cer.coding == cser.coding == "entries"
    assert cser.nbytes < CSERMatrix.from_levels(sparse_lv, 1.0, coding="absolute").nbytes
    # many values per matrix, few per row: grouped CER pays for empty groups
    assert (CSERMatrix.from_levels(sparse_lv, 1.0, coding="absolute").nbytes
            < CERMatrix.from_levels(sparse_lv, 1.0, coding="absolute").nbytes)
    # the switch follows the groups per entry (CER counting its empty ones)
    mid_lv = random_levels(np.random.default_rng(11), 64, 1000, zero_frac=0.7, spread=5)
    groups = {cls: cls.from_levels(mid_lv, 1.0, coding="absolute")._gcnt.size for cls in FORMATS}
    nnz = CSERMatrix.from_levels(mid_lv, 1.0).nnz
    assert groups[CSERMatrix] < mf.AUTO_ENTRIES_MIN_GROUPS * nnz <= groups[CERMatrix]
    assert CSERMatrix.from_levels(mid_lv, 1.0).coding == "absolute"
    assert CERMatrix.from_levels(mid_lv, 1.0).coding == "entries"
    for coding in CODINGS:
        chosen = CSERMatrix.from_levels(dense_lv, 1.0, coding=coding)
        assert chosen.coding == coding


def test_csr_nbytes_matches_scipy():
    sp = pytest.importorskip("scipy.sparse")
    lv = random_levels(np.random.default_rng(4), 30, 50)
    csr = sp.csr_matrix(lv.astype(np.float32))
    assert csr_nbytes(lv) == csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes


def test_level_entropy_and_matrix_view():
    assert level_entropy(np.array([0, 0, 1, 1])) == pytest.approx(1.0)
    assert level_entropy(np.zeros(0)) == 0.0
    assert matrix_view(np.zeros((4, 3, 2, 2))).shape == (4, 12)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        matrix_view(np.zeros(3))


# --------------------------------------------------------------------------------------------------
# products
# --------------------------------------------------------------------------------------------------


PRODUCT_CASES = [  # (m, n, zero_frac, spread, offset)
    (37, 300, 0.7, 3, 0),      # moderate groups, n > 256
    (50, 200, 0.95, 60, 0),    # tiny groups (flat path territory)
    (20, 1200, 0.5, 1, 0),     # large groups, long gaps for nibbles
    (33, 17, 0.6, 2, 4),       # most frequent value is not zero
    (5, 3, 0.0, 2, 0),         # tiny
    (60, 400, 0.5, 200, 0),    # over 256 distinct levels: entries by rank, not by code
]


@pytest.mark.parametrize("case", PRODUCT_CASES)
@pytest.mark.parametrize("cls", FORMATS)
@pytest.mark.parametrize("path", ["absolute", "flat", "delta8", "delta4", "entries", "entries from dense"])
@pytest.mark.parametrize("parallel", [False, True])
def test_products_match_numpy_and_reference(case, cls, path, parallel, force):
    m, n, zf, spread, offset = case
    rng = np.random.default_rng(hash(case) % 2**32)
    lv = random_levels(rng, m, n, zero_frac=zf, spread=spread, offset=offset)
    force(flat=(path == "flat"), parallel=parallel)
    if path == "entries from dense":  # not from levels: entries by rank
        mat = cls.from_dense(reconstruct(lv, 0.125, "float32"), coding="entries")
        assert mat._kind == KINDS["entries"]
    else:
        mat = cls.from_levels(lv, 0.125, coding="absolute" if path == "flat" else path)
        by_code = path == "entries" and offset == 0 and np.unique(lv).size <= 256
        assert mat._kind == KINDS["entries by code" if by_code else path]
    W = mat.to_dense()
    x = rng.standard_normal(n).astype(np.float32)
    X = rng.standard_normal((n, 5)).astype(np.float32)
    y = mat.matvec(x)
    assert_close_product(y[:, None], W, x[:, None])
    Y = mat.matmat(X)
    assert_close_product(Y, W, X)
    # the plain-Python reference reads the arrays independently of the kernels
    ref = reference_matmat(mat, X)
    assert np.allclose(Y, ref, rtol=1e-5, atol=1e-5 * (np.abs(W) @ np.abs(X)).max() + 1e-6)
    assert np.allclose(y, reference_matmat(mat, x[:, None])[:, 0], rtol=1e-5,
                       atol=1e-5 * (np.abs(W) @ np.abs(x)).max() + 1e-6)
    assert np.array_equal(mat @ x, y) and np.array_equal(mat @ X, Y)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lv=level_matrices(), batch=st.sampled_from([1, 2, 16]), seed=st.integers(0, 2**32 - 1))
def test_products_property(lv, batch, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lv.shape[1]).astype(np.float32)
    X = rng.standard_normal((lv.shape[1], batch)).astype(np.float32)
    for cls in FORMATS:
        mat = cls.from_levels(lv, 0.5)
        W = mat.to_dense()
        assert_close_product(mat.matvec(x)[:, None], W, x[:, None])
        assert_close_product(mat.matmat(X), W, X)


@pytest.mark.parametrize("offset", [0, 3])
def test_entries_split_at_rows_covers_every_row_once(offset):
    # The threaded entries matvec cuts between rows, not blocks: empty rows at the start, at the end
    # and in runs, and more chunks than rows, must still give every row exactly once.
    from deepcabac_py.matrix import _matrix_kernels as K

    rng = np.random.default_rng(11)
    lv = random_levels(rng, 41, 60, zero_frac=0.9, spread=40)
    lv[:5] = 0
    lv[17:30] = 0
    lv[-3:] = 0
    lv += np.int32(offset)
    mat = CSERMatrix.from_dense(reconstruct(lv, 0.5, "float32"), coding="entries")  # by rank
    assert mat._kind == KINDS["entries"]
    x = rng.standard_normal(60).astype(np.float32)
    serial = mat.matvec(x)
    a = mat.arrays
    offsets = mf._entries_offsets(mat._values)
    base = mat._values[0] * np.float32(x.sum(dtype=np.float64))
    no_outliers = np.zeros((0, 2), dtype=np.int64)
    for nchunks in (1, 2, 3, 7, 64):
        bounds = mf._entry_cuts(a["rowng"], no_outliers[:, 0], nchunks)
        rows = [int(r) for r in bounds[:, 0]]
        assert rows[0] == 0 and rows[-1] == 41 and rows == sorted(rows)
        starts = np.concatenate([[0], np.cumsum(a["rowng"].astype(np.int64))])
        assert all(int(t) == starts[r] for r, t in bounds[:, :2])  # each cut's token offset is its row's
        y = np.full(41, np.nan, dtype=np.float32)
        K._mv_entries_par(bounds, a["tokens"], a["rowng"], a["gval"], offsets, no_outliers, x, base,
                          np.float32(1.0), y)
        assert np.array_equal(y, serial)


def test_level_codes_split_at_rows_and_correct_outliers():
    # The level-coded matvec: chunk cuts at rows (with the token offset and first outlier of each),
    # every row once whatever the number of chunks, levels beyond int8 corrected from ``outliers``.
    from deepcabac_py.matrix import _matrix_kernels as K

    rng = np.random.default_rng(12)
    lv = random_levels(rng, 41, 60, zero_frac=0.85, spread=60)
    lv[:5] = 0
    lv[17:30] = 0
    lv[-3:] = 0
    lv[6, 7], lv[40 - 3 - 1, 59] = 100_000, -3_000  # far outside int8, in the first and last rows used
    assert np.unique(lv).size <= 256
    mat = CSERMatrix.from_levels(lv, 0.5, coding="entries")
    assert mat._kind == KINDS["entries by code"]
    outliers = mat.arrays["outliers"]
    assert outliers.shape[0] == int(np.count_nonzero(np.abs(lv) > 127)) > 2
    assert np.array_equal(mat.to_levels(), lv)
    x = rng.standard_normal(60).astype(np.float32)
    W = mat.to_dense()
    serial = mat.matvec(x)
    assert_close_product(serial[:, None], W, x[:, None])
    rowng = mat.arrays["rowng"]
    starts = np.concatenate([[0], np.cumsum(rowng.astype(np.int64))])
    codes = mat.arrays["gval"].view(np.int8)
    for nchunks in (1, 2, 3, 7, 64):
        cuts = mf._entry_cuts(rowng, outliers[:, 0], nchunks)
        rows = cuts[:, 0].tolist()
        assert rows[0] == 0 and rows[-1] == 41 and rows == sorted(rows) and len(rows) == nchunks + 1
        assert np.array_equal(cuts[:, 1], starts[cuts[:, 0]])
        assert all(int(np.count_nonzero(outliers[:, 0] < t)) == p for t, p in cuts[:, 1:])
        y = np.full(41, np.nan, dtype=np.float32)
        K._mv_entries_par(cuts, mat.arrays["tokens"], rowng, codes, None, outliers, x, np.float32(0.0),
                          np.float32(0.5), y)
        assert np.array_equal(y, serial)


def test_level_code_rule():
    # levels ranked 0, 1, -1, 300, 2, -200: the in-range ones keep their int8 byte, 300 and -200 take
    # the smallest unused codes (3 and 4)
    lv = np.array([[0] * 20 + [1] * 6 + [-1] * 5 + [300] * 4 + [2] * 3 + [-200] * 2], dtype=np.int32)
    mat = CERMatrix.from_levels(lv, 0.25, coding="entries")
    assert mat.arrays["levels"].tolist() == [0, 1, -1, 300, 2, -200]
    assert mat.arrays["gval"].tolist() == [1] * 6 + [255] * 5 + [3] * 4 + [2] * 3 + [4] * 2
    assert mat.arrays["outliers"].tolist() == [[k, 297] for k in range(11, 15)] + [[18, -204], [19, -204]]
    assert mat.nbytes == sum(a.nbytes for a in mat.arrays.values())
    x = np.arange(40, dtype=np.float32)
    assert_close_product(mat.matvec(x)[:, None], mat.to_dense(), x[:, None])


def test_results_do_not_depend_on_threads(force):
    rng = np.random.default_rng(5)
    lv = random_levels(rng, 300, 500, zero_frac=0.8)
    x = rng.standard_normal(500).astype(np.float32)
    X = rng.standard_normal((500, 4)).astype(np.float32)
    force(parallel=False)
    mat = CSERMatrix.from_levels(lv, 0.25)  # the serial/threaded choice is made once per matrix
    y1, Y1 = mat.matvec(x), mat.matmat(X)
    force(parallel=True)
    mat = CSERMatrix.from_levels(lv, 0.25)
    assert np.array_equal(mat.matvec(x), y1) and np.array_equal(mat.matmat(X), Y1)
    # numba.set_num_threads after the first product: the same chunks on fewer threads
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert np.array_equal(mat.matvec(x), y1) and np.array_equal(mat.matmat(X), Y1)
    finally:
        numba.set_num_threads(before)


def test_inputs_are_converted():
    lv = np.array([[1, 0, 2], [0, 0, 0]], dtype=np.int64)
    mat = CERMatrix.from_levels(lv, 0.5)
    assert mat.matvec([1, 2, 3]).tolist() == [3.5, 0.0]
    assert mat.matvec(np.array([1.0, 2.0, 3.0])).dtype == np.float32
    X = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(3, 2))
    assert mat.matmat(X).tolist() == [[4.0, 5.5], [0.0, 0.0]]
    assert mat.matmat(np.zeros((3, 0))).shape == (2, 0)


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (0, 0)])
def test_empty_matrices(shape):
    for cls in FORMATS:
        mat = cls.from_levels(np.zeros(shape, np.int32), 1.0)
        assert mat.to_dense().shape == shape
        assert mat.matvec(np.ones(shape[1], np.float32)).tolist() == [0.0] * shape[0]
        assert mat.matmat(np.ones((shape[1], 3), np.float32)).shape == (shape[0], 3)


def test_bad_arguments():
    ok = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="2-D"):
        CERMatrix.from_levels(np.zeros((2, 3, 4), np.int32), 1.0)
    with pytest.raises(ValueError, match="integers"):
        CERMatrix.from_levels(np.zeros((2, 3)), 1.0)
    with pytest.raises(ValueError, match="step"):
        CERMatrix.from_levels(ok, 0.0)
    with pytest.raises(ValueError, match="step"):
        CERMatrix.from_levels(ok, float("nan"))
    with pytest.raises(ValueError, match="int32"):
        CERMatrix.from_levels(np.array([[2**40]]), 1.0)
    with pytest.raises(ValueError, match="coding"):
        CERMatrix.from_levels(ok, 1.0, coding="huffman")
    with pytest.raises(ValueError, match="finite"):
        CSERMatrix.from_dense(np.array([[np.nan, 0.0]]))
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        CSERMatrix.from_codebook(np.array([[0, 2]]), np.array([0.0, 1.0]))
    mat = CERMatrix.from_levels(ok, 1.0)
    with pytest.raises(ValueError, match="length 3"):
        mat.matvec(np.zeros(4))
    with pytest.raises(ValueError, match=r"shape \(3, B\)"):
        mat.matmat(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="numbers"):
        mat.matvec(np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match="formats"):
        from_stream(b"", "csr")


def test_docstring_examples():
    result = doctest.testmod(mf, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0


# --------------------------------------------------------------------------------------------------
# torch modules
# --------------------------------------------------------------------------------------------------


def quantized(weight: torch.Tensor, step: float):
    lv = np.rint(weight.detach().numpy() / step).astype(np.int32)
    return lv, torch.from_numpy(reconstruct(lv, step, "float32"))


@pytest.mark.parametrize("batch_shape", [(1,), (4,), (2, 3)])
def test_compressed_linear_matches_nn_linear(batch_shape):
    torch.manual_seed(0)
    lin = nn.Linear(40, 12)
    lv, wq = quantized(lin.weight, 0.02)
    with torch.no_grad():
        lin.weight.copy_(wq)
    comp = CompressedLinear.from_linear(lin, CSERMatrix.from_levels(lv, 0.02))
    x = torch.randn(*batch_shape, 40)
    torch.testing.assert_close(comp(x), lin(x).detach(), rtol=1e-5, atol=1e-5)
    assert "CSER" in repr(comp)


@pytest.mark.parametrize("kw", [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, padding=1, bias=False),
                                dict(kernel_size=1), dict(kernel_size=(3, 1), dilation=2, padding="same"),
                                dict(kernel_size=2, padding="valid")])
@pytest.mark.parametrize("n", [1, 3])
def test_compressed_conv_matches_nn_conv(kw, n):
    torch.manual_seed(1)
    conv = nn.Conv2d(5, 7, **kw)
    lv, wq = quantized(conv.weight, 0.05)
    with torch.no_grad():
        conv.weight.copy_(wq)
    comp = CompressedConv2d.from_conv(conv, CERMatrix.from_levels(matrix_view(lv), 0.05))
    x = torch.randn(n, 5, 9, 8)
    torch.testing.assert_close(comp(x), conv(x).detach(), rtol=1e-5, atol=1e-5)


def test_compressed_modules_reject_bad_layers():
    conv = nn.Conv2d(4, 4, 3, groups=2)
    mat = CERMatrix.from_levels(np.zeros((4, 18), np.int32), 1.0)
    with pytest.raises(ValueError, match="groups=1"):
        CompressedConv2d.from_conv(conv, mat)
    with pytest.raises(ValueError, match="does not match"):
        CompressedLinear.from_linear(nn.Linear(3, 4), mat)
    with pytest.raises(TypeError, match="CERMatrix or CSERMatrix"):
        CompressedLinear(np.zeros((2, 2)))


# --------------------------------------------------------------------------------------------------
# from a stored model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_stream():
    ckpt = dc.load_checkpoint(DIGITS)
    return ckpt, dc.encode_model(ckpt, qp=-24, threads=1)


@pytest.mark.parametrize("formats", ["cer", "cser"])
def test_from_stream_decodes_every_weight_matrix(digits_stream, formats):
    ckpt, data = digits_stream
    mats = from_stream(data, formats)
    decoded = dc.decode_checkpoint(data).tensors
    levels = dc.decode_levels(data)
    expected = {k for k, q in levels.items() if q.step is not None and q.levels.ndim >= 2}
    assert set(mats) == expected and expected
    for name, mat in mats.items():
        assert isinstance(mat, CERMatrix if formats == "cer" else CSERMatrix)
        assert tuple(mat.tensor_shape) == tuple(levels[name].levels.shape)
        want = np.asarray(decoded[name]).reshape(mat.shape)
        assert np.array_equal(mat.to_dense(), want)
    assert set(from_stream(data, formats, names=["classifier.weight"])) == {"classifier.weight"}


def test_compress_module_runs_the_digits_model(digits_stream):
    from models.digits_cnn import DigitsCNN, load_eval_set

    _, data = digits_stream
    decoded = {k: torch.as_tensor(np.asarray(v)) for k, v in dc.decode_checkpoint(data).tensors.items()}
    reference = DigitsCNN()
    reference.load_state_dict(decoded)
    reference.eval()
    model = DigitsCNN().eval()
    replaced = compress_module(model, data, formats="cser")
    assert sorted(replaced) == ["classifier", "features.0.0", "features.1.0", "features.3.0"]
    x, y = load_eval_set()
    with torch.no_grad():
        want = reference(x[:64])
        got = model(x[:64])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(1), want.argmax(1))


def test_cli_report_formats(digits_stream, tmp_path):
    import json

    from click.testing import CliRunner

    from deepcabac_py.cli.main import main

    _, data = digits_stream
    stream = tmp_path / "digits.dcb"
    stream.write_bytes(data)
    runner = CliRunner()
    plain = runner.invoke(main, ["report", str(stream)])
    with_formats = runner.invoke(main, ["report", str(stream), "--formats"])
    assert plain.exit_code == 0 and with_formats.exit_code == 0, with_formats.output
    assert with_formats.output.startswith(plain.output)  # the usual report is unchanged
    extra = with_formats.output[len(plain.output):]
    assert "CSER B" in extra and "classifier.weight" in extra and "features.3.0.weight" in extra
    assert "CER" not in plain.output
    out = json.loads(runner.invoke(main, ["report", str(stream), "--formats", "--json"]).output)
    rows = {r["name"]: r for r in out["formats"]}
    lv = dc.decode_levels(data)["features.3.0.weight"]
    row = rows["features.3.0.weight"]
    assert row["matrix_shape"] == [32, 288] and row["dense"] == 4 * 32 * 288
    assert row["cser"] == CSERMatrix.from_levels(matrix_view(lv.levels), lv.step).nbytes
    assert row["csr"] == csr_nbytes(matrix_view(lv.levels))
