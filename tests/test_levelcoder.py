"""The level coder: Numba kernels against the plain-Python reference, round trips, hostile input."""

from __future__ import annotations

import numpy as np
import pytest
import reference_coder as ref
from helpers import no_hang
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from deepcabac_py.entropy import _cabac_kernels
from deepcabac_py.entropy import chunk_layout as cl
from deepcabac_py.entropy import levelcoder as lc
from deepcabac_py.errors import CorruptStreamError

LEVEL_MAX = 2**31 - 1
# coder_param values: every k offset, and a few with column prediction on
K_OFFSETS = tuple(range(cl.MAX_K_OFFSET + 1)) + (cl.PREDICT_BIT, cl.PREDICT_BIT | 2, cl.PREDICT_BIT | 7)
PREDICT_MAX = lc.PREDICT_MAX_LEVEL
# (ncols, col0): no column model; narrow and wide 2-D views; first element not in column 0
COLUMN_SETUPS = ((0, 0), (1, 0), (13, 0), (13, 5), (64, 63))


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def fit_levels(levels: np.ndarray, coder_param: int) -> np.ndarray:
    """Column prediction needs |level| <= PREDICT_MAX_LEVEL: clip test inputs when it is on."""
    return np.clip(levels, -PREDICT_MAX, PREDICT_MAX).astype(np.int32) if coder_param & cl.PREDICT_BIT else levels


def chunk_setup(n: int, ncols: int, col0: int, k_offset: int) -> tuple[cl.ChunkLayout, int]:
    """A layout and chunk index whose chunk has ``n`` levels starting in column ``col0``;
    ``k_offset`` is a coder_param (k offset | PREDICT_BIT)."""
    param = k_offset
    k_offset, predict = param & ~cl.PREDICT_BIT, bool(param & cl.PREDICT_BIT)
    if ncols == 0:
        return cl.ChunkLayout(numel=n, ncols=0, chunk_elements=max(n, 1), k_offset=k_offset, predict=predict), 0
    # chunk 1 starts at chunk_elements, which is == col0 (mod ncols) and >= n
    size = ncols * -(-n // ncols) + col0
    size = max(size, ncols) if size == 0 else size
    layout = cl.ChunkLayout(numel=size + n, ncols=ncols, chunk_elements=size, k_offset=k_offset, predict=predict)
    assert layout.first_column(layout.bounds(1)[0]) == col0 and layout.bounds(1)[1] - layout.bounds(1)[0] == n
    return layout, 1


def numba_encode(levels, ncols=0, col0=0, k_offset=cl.DEFAULT_K_OFFSET) -> bytes:
    levels = np.asarray(levels, dtype=np.int32)
    layout, index = chunk_setup(levels.shape[0], ncols, col0, k_offset)
    return lc.encode_chunk(levels, layout, index)


def numba_decode(data: bytes, n, ncols=0, col0=0, k_offset=cl.DEFAULT_K_OFFSET) -> np.ndarray:
    layout, index = chunk_setup(n, ncols, col0, k_offset)
    out = np.empty(n, dtype=np.int32)
    lc.decode_chunk(data, layout, index, out)
    return out


def kernel_status(data: bytes, n, ncols, col0, k_offset, *, python=False) -> tuple[int, np.ndarray]:
    """The raw decoder status (compiled, or the kernel's pure-Python ``py_func``)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    out = np.zeros(n, dtype=np.int32)
    fn = _cabac_kernels.decode_levels_kernel.py_func if python else _cabac_kernels.decode_levels_kernel
    return int(fn(buf, ncols, col0, k_offset & ~cl.PREDICT_BIT, bool(k_offset & cl.PREDICT_BIT), out)), out


def _clip(x) -> np.ndarray:
    return np.clip(np.round(x), -LEVEL_MAX, LEVEL_MAX).astype(np.int32)


def make_levels(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return np.zeros(n, dtype=np.int32)
    if kind == "sparse_pm1":
        return (rng.choice([-1, 1], n) * (rng.random(n) < 0.05)).astype(np.int32)
    if kind.startswith("laplace_"):
        return _clip(rng.laplace(0.0, float(kind.split("_")[1]), n))
    if kind == "huge_uniform":
        return rng.integers(-LEVEL_MAX, LEVEL_MAX, n, endpoint=True).astype(np.int32)
    if kind == "huge_extremes":
        return rng.choice(np.array([LEVEL_MAX, -LEVEL_MAX, 0, 1, -1, LEVEL_MAX - 1], dtype=np.int32), n)
    if kind == "log_uniform":
        mag = np.floor(2.0 ** rng.uniform(0, 31, n)).astype(np.int64)
        return (np.minimum(mag, LEVEL_MAX) * rng.choice([-1, 1], n)).astype(np.int32)
    if kind == "constant_large":
        return np.full(n, 1000, dtype=np.int32)
    if kind == "constant_max":
        return np.full(n, -LEVEL_MAX, dtype=np.int32)
    if kind == "mixed":
        parts = [make_levels(k, n // 6 + 1, seed + i) for i, k in
                 enumerate(["zeros", "laplace_10000", "sparse_pm1", "huge_uniform", "laplace_0.5", "log_uniform"])]
        return np.concatenate(parts)[:n]
    if kind == "columns":
        # 2-D structure: each column has its own magnitude, so the column model matters
        cols = 13
        scales = 10.0 ** rng.uniform(-1, 5, cols)
        return _clip(rng.laplace(0.0, 1.0, (n // cols + 1, cols)) * scales).reshape(-1)[:n]
    raise ValueError(kind)


DISTRIBUTIONS = [
    "zeros", "sparse_pm1", "laplace_0.5", "laplace_2", "laplace_10", "laplace_100", "laplace_1000",
    "laplace_10000", "huge_uniform", "huge_extremes", "log_uniform", "constant_large", "constant_max",
    "mixed", "columns",
]


# --------------------------------------------------------------------------------------------------
# reference equality and round trips
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_reference_bytes_equal_numba(kind):
    for i, (ncols, col0) in enumerate(COLUMN_SETUPS):
        for k_offset in K_OFFSETS:
            levels = fit_levels(make_levels(kind, 400 + 37 * i, seed=100 * i + k_offset), k_offset)
            expected = ref.encode_levels(levels.tolist(), ncols, col0, k_offset)
            data = numba_encode(levels, ncols, col0, k_offset)
            assert data == expected, (kind, ncols, col0, k_offset)
            np.testing.assert_array_equal(numba_decode(data, levels.shape[0], ncols, col0, k_offset), levels)
            assert ref.decode_levels(data, levels.shape[0], ncols, col0, k_offset) == levels.tolist()


@pytest.mark.parametrize("kind", ["laplace_3", "huge_uniform", "mixed", "columns", "sparse_pm1"])
def test_numba_round_trip_larger(kind):
    levels = make_levels(kind, 60_000, seed=7)
    for ncols, col0 in ((0, 0), (300, 0), (300, 17)):
        data = numba_encode(levels, ncols, col0)
        np.testing.assert_array_equal(numba_decode(data, levels.shape[0], ncols, col0), levels)


def test_column_model_changes_the_stream():
    levels = make_levels("columns", 500, seed=3)
    assert numba_encode(levels, 13, 0) != numba_encode(levels, 0, 0)


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("ncols,col0", [(0, 0), (1, 0), (4, 3)])
def test_tiny_inputs(n, ncols, col0):
    values = [0] if n == 0 else [0, 1, -1, 2, 1000, LEVEL_MAX, -LEVEL_MAX]
    for v in values:
        for k_offset in K_OFFSETS:
            levels = fit_levels(np.array([v] * n, dtype=np.int32), k_offset)
            data = numba_encode(levels, ncols, col0, k_offset)
            assert data == ref.encode_levels(levels.tolist(), ncols, col0, k_offset)
            np.testing.assert_array_equal(numba_decode(data, n, ncols, col0, k_offset), levels)
            assert ref.decode_levels(data, n, ncols, col0, k_offset) == levels.tolist()


def test_kernel_py_func_encoder_agrees():
    levels = make_levels("mixed", 150, seed=11)
    for ncols, col0, k_offset in ((0, 0, 0), (7, 3, 2)):
        out = np.zeros(levels.shape[0] * 48 + 256, dtype=np.uint8)
        size = _cabac_kernels.encode_levels_kernel.py_func(levels, ncols, col0, k_offset & ~cl.PREDICT_BIT,
                                               bool(k_offset & cl.PREDICT_BIT), out)
        assert out[1:size].tobytes() == numba_encode(levels, ncols, col0, k_offset)


_level = st.one_of(st.integers(-3, 3), st.integers(-300, 300), st.integers(-LEVEL_MAX, LEVEL_MAX))


@settings(max_examples=60, deadline=None)
@given(
    arr=hnp.arrays(np.int32, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9), elements=_level),
    target=st.sampled_from([1, 3, 8, 50, cl.CHUNK_ELEMENTS]),
    k_offset=st.integers(0, cl.MAX_K_OFFSET),
)
def test_property_round_trip_and_reference(arr, target, k_offset):
    flat = arr.reshape(-1)
    top = int(np.abs(flat.astype(np.int64)).max()) if flat.size else 0
    layout = cl.layout_for_shape(arr.shape, target=target, k_offset=k_offset, max_abs_level=top)
    assert layout.predict == (layout.ncols > 0 and top <= PREDICT_MAX)
    decoded = np.empty_like(flat)
    assert layout.count == (-(-flat.size // layout.chunk_elements) if flat.size else 0)
    for index in range(layout.count):
        start, stop = layout.bounds(index)
        part = np.ascontiguousarray(flat[start:stop])
        data = lc.encode_chunk(part, layout, index)
        col0 = layout.first_column(start)
        assert data == ref.encode_levels(part.tolist(), layout.ncols, col0, layout.coder_param)
        lc.decode_chunk(data, layout, index, decoded[start:stop])
    np.testing.assert_array_equal(decoded, flat)


def test_all_zero_chunk_of_max_size_decodes():
    # Regression: the worst case of max_elements_for_payload (one near-certain bin per level)
    # used to be rejected as corrupt.
    n = cl.CHUNK_ELEMENTS
    data = numba_encode(np.zeros(n, dtype=np.int32))
    assert n <= lc.max_elements_for_payload(len(data))
    assert not numba_decode(data, n).any()


# --------------------------------------------------------------------------------------------------
# argument validation
# --------------------------------------------------------------------------------------------------


def test_int32_min_is_rejected():
    levels = np.array([0, 5, -(2**31), 3], dtype=np.int32)
    with pytest.raises(ValueError):
        numba_encode(levels)
    with pytest.raises(ValueError):
        lc.check_levels(levels)
    with pytest.raises(ValueError):
        ref.encode_levels(levels.tolist(), 0, 0, 1)
    lc.check_levels(np.array([-LEVEL_MAX, LEVEL_MAX], dtype=np.int32))


def test_encode_decode_chunk_validate_arrays():
    layout = cl.layout_for_shape((10,))
    with pytest.raises(ValueError):
        lc.encode_chunk(np.zeros(10, dtype=np.int64), layout, 0)
    with pytest.raises(ValueError):
        lc.encode_chunk(np.zeros(9, dtype=np.int32), layout, 0)
    data = lc.encode_chunk(np.zeros(10, dtype=np.int32), layout, 0)
    with pytest.raises(ValueError):
        lc.decode_chunk(data, layout, 0, np.empty(10, dtype=np.int64))
    with pytest.raises(ValueError):
        lc.decode_chunk(data, layout, 0, np.empty(11, dtype=np.int32))


# --------------------------------------------------------------------------------------------------
# hostile input
# --------------------------------------------------------------------------------------------------


def _check_hostile(data: bytes, n: int, ncols: int, col0: int, k_offset: int, *, python=False):
    """decode_chunk raises CorruptStreamError exactly when the kernel reports a status; the reference
    agrees on the status and on the levels."""
    status, levels = kernel_status(data, n, ncols, col0, k_offset)
    layout, index = chunk_setup(n, ncols, col0, k_offset)
    out = np.empty(n, dtype=np.int32)
    if n > lc.max_elements_for_payload(len(data)):
        with pytest.raises(CorruptStreamError):
            lc.decode_chunk(data, layout, index, out)
        return status
    if status == _cabac_kernels.OK:
        lc.decode_chunk(data, layout, index, out)
        np.testing.assert_array_equal(out, levels)
        assert np.all(out != -(2**31))
    else:
        with pytest.raises(CorruptStreamError):
            lc.decode_chunk(data, layout, index, out)
    ref_status, ref_levels = ref.decode_status(data, n, ncols, col0, k_offset)
    assert ref_status == status
    if status == _cabac_kernels.OK:
        assert ref_levels == levels.tolist()
    if python:
        py_status, py_levels = kernel_status(data, n, ncols, col0, k_offset, python=True)
        assert py_status == status
        np.testing.assert_array_equal(py_levels, levels)
    return status


def test_garbage_bytes_never_crash():
    rng = np.random.default_rng(2024)
    statuses = set()
    with no_hang(20):
        for trial in range(300):
            data = rng.integers(0, 256, int(rng.integers(0, 48)), dtype=np.uint8).tobytes()
            if trial % 5 == 0:
                data = bytes(rng.choice([0, 0xFF], len(data)).astype(np.uint8))
            n = int(rng.integers(1, 120))
            ncols, col0 = COLUMN_SETUPS[trial % len(COLUMN_SETUPS)]
            statuses.add(_check_hostile(data, n, ncols, col0, trial % len(K_OFFSETS), python=trial < 6))
    assert len(statuses - {_cabac_kernels.OK}) >= 2  # several distinct failure kinds were exercised


def test_bad_start_is_detected():
    for data in (b"\xff\xff\xff\xff", b"\xff\xff\xff\xff\x00\x12"):
        assert kernel_status(data, 3, 0, 0, 1)[0] == _cabac_kernels.ERR_BAD_START
        with pytest.raises(CorruptStreamError):
            numba_decode(data, 3)


def test_truncated_and_flipped_streams():
    rng = np.random.default_rng(5)
    levels = make_levels("mixed", 150, seed=9)
    ncols, col0, k_offset = 20, 7, 1
    data = numba_encode(levels, ncols, col0, k_offset)
    n = levels.shape[0]
    failures = 0
    with no_hang(20):
        for length in range(len(data)):
            python = length in (0, len(data) // 2, len(data) - 1)
            failures += _check_hostile(data[:length], n, ncols, col0, k_offset, python=python) != _cabac_kernels.OK
        for pos in range(len(data)):
            flipped = bytearray(data)
            flipped[pos] ^= 0xFF
            _check_hostile(bytes(flipped), n, ncols, col0, k_offset, python=pos == len(data) // 3)
            flipped = bytearray(data)
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
            _check_hostile(bytes(flipped), n, ncols, col0, k_offset)
        # appended junk
        _check_hostile(data + b"\x5a" * 20, n, ncols, col0, k_offset)
    assert failures >= len(data) // 2  # most truncations are detected


def test_declared_count_beyond_payload_is_refused_before_decoding(monkeypatch):
    data = numba_encode(np.zeros(1000, dtype=np.int32))
    bound = lc.max_elements_for_payload(len(data))
    assert bound >= 1000

    def fail(*args):
        raise AssertionError("the kernel must not run")

    monkeypatch.setattr(_cabac_kernels, "decode_levels_kernel", fail)
    for claimed in (bound + 1, 10 * bound):
        layout = cl.ChunkLayout(numel=claimed, ncols=0, chunk_elements=claimed)
        with pytest.raises(CorruptStreamError):
            lc.decode_chunk(data, layout, 0, np.empty(claimed, dtype=np.int32))


@pytest.mark.parametrize("n", [1, 10, 1000, 100_000])
def test_max_elements_for_payload_bounds_valid_streams(n):
    # zeros are the cheapest levels there are: every valid stream stays within the bound
    for levels in (np.zeros(n, dtype=np.int32), np.ones(n, dtype=np.int32)):
        data = numba_encode(levels)
        assert n <= lc.max_elements_for_payload(len(data))
    assert lc.max_elements_for_payload(0) >= 1
    sizes = [lc.max_elements_for_payload(b) for b in range(0, 200, 7)]
    assert sizes == sorted(sizes)
