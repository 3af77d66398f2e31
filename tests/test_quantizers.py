"""The quantizers (nearest, RDOQ, the trellis) against their plain-Python references, per-weight
importance, and what the codec makes of their levels."""

from __future__ import annotations

import numpy as np
import pytest
import reference_quantizers as reference_rd
import torch
from helpers import laplace_weights
from hypothesis import given, settings
from hypothesis import strategies as st

import deepcabac_py as dc
from deepcabac_py.entropy import chunk_layout, levelcoder
from deepcabac_py.entropy.levelcoder import LEVEL_MAX
from deepcabac_py.errors import CorruptStreamError
from deepcabac_py.model import tensor_plan
from deepcabac_py.model.container import Mode
from deepcabac_py.quant import _quantizer_kernels
from deepcabac_py.quant.quantizers import DEFAULT_LAMBDA, quantize_nearest, quantize_rd, trellis_encode_chunk
from deepcabac_py.quant.reconstruct import MAX_DQ_LEVEL, dq_indices, reconstruct_f32_inplace
from deepcabac_py.quant.steps import step_from_qp


def _layout_args(shape, max_level=1000):
    layout = chunk_layout.layout_for_shape(shape, max_abs_level=max_level)
    return dict(ncols=layout.ncols, col0=0, k_offset=layout.k_offset, predict=layout.predict)


# --- kernels against the plain-Python reference --------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 12), cols=st.integers(1, 70),
       lam_scale=st.sampled_from([0.0, 0.5, 1.0, 4.0]), weighted=st.booleans(), predict=st.booleans(),
       scale=st.sampled_from([0.002, 0.05, 3.0]))
def test_kernels_match_reference(seed, rows, cols, lam_scale, weighted, predict, scale):
    values = laplace_weights(seed, (rows * cols,), scale, sparse=0.3)
    rng = np.random.default_rng(seed + 1)
    imp = rng.gamma(0.5, 2.0, values.shape).astype(np.float32) if weighted else np.empty(0, np.float32)
    step = 2.0**-7
    ncols = cols if rows > 1 else 0
    for method in ("rdoq", "trellis"):
        lam = DEFAULT_LAMBDA[method] * lam_scale
        got = quantize_rd(values, step, method=method, lam=lam, ncols=ncols, col0=0, k_offset=0,
                                   predict=predict and ncols > 0, importance=imp if weighted else None)
        if method == "rdoq":
            want = reference_rd.rdoq(values, imp, step, lam, ncols, 0, 0, predict and ncols > 0,
                                     MAX_DQ_LEVEL if predict and ncols > 0 else reference_rd.LEVEL_MAX)
        else:
            want = reference_rd.trellis(values, imp, step, lam, ncols, 0, 0, predict and ncols > 0)
        assert got.tolist() == want, method


def test_trellis_reference_spans_several_blocks():
    # rows of 40: blocks of 7 rows (>= 256 elements), so the commit-and-snapshot path is exercised
    values = laplace_weights(3, (20 * 40,), 0.05)
    got = quantize_rd(values, 2.0**-6, method="trellis", lam=0.46, ncols=40, predict=True)
    want = reference_rd.trellis(values, np.empty(0), 2.0**-6, 0.46, 40, 0, 0, True)
    assert got.tolist() == want


def test_trellis_keeps_exact_zeros_zero():
    # Pruned weights stay pruned: the trellis may not spend an odd level on an exact zero to switch
    # its state (it did: a 90%-pruned layer came back with 89.5% zero levels), so the decoded model
    # keeps its sparsity pattern. Small nonzero weights may still go either way.
    values = laplace_weights(8, (300, 96), 0.05, sparse=0.9)
    values[:, :3] = 1e-6  # tiny but nonzero: free to become +-1
    zeros = values == 0
    for lam_scale in (0.0, 1.0):
        lam = DEFAULT_LAMBDA["trellis"] * lam_scale
        levels = quantize_rd(values.reshape(-1), 2.0**-7, method="trellis", lam=lam, ncols=96,
                                      predict=True).reshape(values.shape)
        assert not np.any(levels[zeros]), int(np.count_nonzero(levels[zeros]))
        assert np.count_nonzero(levels[~zeros]) > 0.5 * np.count_nonzero(~zeros)
    data = dc.encode_model({"w": torch.from_numpy(values)}, qp=-28)
    back = dc.decode_model(data)["w"].numpy()
    assert np.all(back[zeros] == 0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 40), cols=st.integers(1, 300),
       rows_per_chunk=st.integers(1, 40), weighted=st.booleans(), predict=st.booleans(),
       scale=st.sampled_from([0.002, 0.05, 3.0]))
def test_trellis_codes_what_it_commits(seed, rows, cols, rows_per_chunk, weighted, predict, scale):
    # One pass (the trellis coding each block as it commits it) gives the bytes of the two passes
    # (trellis levels, then the level coder), chunk by chunk, across several blocks.
    shape = (rows, cols) if rows > 1 else (cols,)
    values = laplace_weights(seed, shape, scale, sparse=0.3).reshape(-1)
    imp = np.random.default_rng(seed + 1).gamma(0.5, 2.0, values.shape).astype(np.float32)
    layout = chunk_layout.layout_for_shape(shape, target=rows_per_chunk * cols,
                                         max_abs_level=1000 if predict else levelcoder.LEVEL_MAX)
    step, lam = 2.0**-7, 0.46
    for k in range(layout.count):
        a, b = layout.bounds(k)
        chunk_imp = imp[a:b] if weighted else None
        levels = quantize_rd(values[a:b], step, method="trellis", lam=lam, ncols=layout.ncols,
                                      col0=layout.first_column(a), k_offset=layout.k_offset,
                                      predict=layout.predict, importance=chunk_imp)
        want = levelcoder.encode_chunk(levels, layout, k)
        got = trellis_encode_chunk(values[a:b], step, lam=lam, layout=layout, index=k,
                                            importance=chunk_imp)
        assert got == want


def test_trellis_reports_a_full_buffer_and_is_given_a_larger_one():
    values = laplace_weights(4, (8, 64), 0.05).reshape(-1)
    layout = chunk_layout.layout_for_shape((8, 64))
    step, lam = 2.0**-7, 0.46
    want_levels = quantize_rd(values, step, method="trellis", lam=lam, ncols=64, predict=layout.predict)
    want = levelcoder.encode_chunk(want_levels, layout, 0)
    levels = np.zeros(values.size, dtype=np.int32)
    small = np.zeros(len(want) // 2, dtype=np.uint8)
    size = _quantizer_kernels.trellis_kernel(values, np.empty(0, np.float32), step, lam, 64, 0, layout.k_offset,
                                              layout.predict, levels, small)
    assert size == -1 and np.array_equal(levels, want_levels)  # the levels are whole even so
    # the Python side retries with room for any chunk
    calls = []

    def encode(out):
        calls.append(out.size)
        return -1 if len(calls) == 1 else _quantizer_kernels.trellis_kernel(
            values, np.empty(0, np.float32), step, lam, 64, 0, layout.k_offset, layout.predict, levels, out)

    assert levelcoder.run_encoder(values.size, encode) == want
    assert calls[1] >= 48 * values.size


def test_trellis_saturates_values_beyond_the_level_range():
    # |x| / step past int64 (or NaN) saturates at the largest level instead of wrapping around
    values = np.array([1e30, -1e30, 3.0, np.nan, -np.inf, 0.5] * 50, dtype=np.float64)
    layout = chunk_layout.layout_for_shape(values.shape)
    levels = quantize_rd(values, 2.0**-8, method="trellis", lam=0.46)
    assert np.abs(levels).max() == MAX_DQ_LEVEL
    assert levels[0] > 0 and levels[1] < 0
    assert trellis_encode_chunk(values, 2.0**-8, lam=0.46, layout=layout, index=0) == \
        levelcoder.encode_chunk(levels, layout, 0)
    rdoq = quantize_rd(values, 2.0**-8, method="rdoq", lam=0.116)
    assert rdoq[0] == LEVEL_MAX and rdoq[1] == -LEVEL_MAX


def test_dq_indices_follow_the_state_machine():
    levels = np.array([0, 1, -1, 2, 3, 0, -4, 5, 1, 1, 0, -2], dtype=np.int32)
    assert dq_indices(levels).tolist() == reference_rd.dq_indices(levels.tolist())
    # state 0 uses the even grid, the first odd level moves to an odd-grid state
    assert dq_indices(np.array([1, 1], dtype=np.int32)).tolist() == [2, 1]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 300), spread=st.sampled_from([1, 3, 1000]))
def test_dq_kernels_match_reference(seed, n, spread):
    # the kernels work 64 levels at a time and finish level by level: lengths around multiples of 64
    levels = np.random.default_rng(seed).integers(-spread, spread + 1, n).astype(np.int32)
    ref = reference_rd.dq_indices(levels.tolist())
    assert dq_indices(levels).tolist() == ref
    buf = levels.copy()
    reconstruct_f32_inplace(buf, 0.375, dependent=True)
    assert np.array_equal(buf.view(np.float32), (np.array(ref, dtype=np.float64) * 0.375).astype(np.float32))


@pytest.mark.parametrize("pos", [0, 63, 64, 100, 129])
@pytest.mark.parametrize("bad", [(1 << 30), -(1 << 30), -(1 << 31), (1 << 31) - 1])
def test_dq_indices_refuse_levels_beyond_the_grid(pos, bad):
    levels = np.zeros(130, dtype=np.int32)
    levels[pos] = bad
    with pytest.raises(CorruptStreamError, match="trellis level"):
        dq_indices(levels)
    with pytest.raises(CorruptStreamError, match="trellis level"):
        reconstruct_f32_inplace(levels.copy(), 1.0, dependent=True)
    levels[pos] = MAX_DQ_LEVEL if bad > 0 else -MAX_DQ_LEVEL
    dq_indices(levels)  # the largest level the grid takes is accepted


# --- properties of the quantizers ------------------------------------------------------------


def _chunk_bits(levels: np.ndarray, layout_kw) -> int:
    layout = chunk_layout.ChunkLayout(numel=levels.size, ncols=layout_kw["ncols"], chunk_elements=max(1, levels.size),
                                    k_offset=layout_kw["k_offset"], predict=layout_kw["predict"])
    return 8 * len(levelcoder.encode_chunk(levels, layout, 0))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), lam_scale=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
       scale=st.sampled_from([0.01, 0.05, 0.3]))
def test_rdoq_never_costs_more_than_rounding(seed, lam_scale, scale):
    shape = (24, 48)
    values = laplace_weights(seed, shape, scale).reshape(-1)
    step = 2.0**-6
    kw = _layout_args(shape)
    lam = DEFAULT_LAMBDA["rdoq"] * lam_scale
    nearest = quantize_nearest(values, step)
    chosen = quantize_rd(values, step, method="rdoq", lam=lam, **kw)

    def cost(levels):
        err = values / step - levels
        return float(np.sum(err.astype(np.float64) ** 2)) + lam * _chunk_bits(levels, kw)

    # The real coded size is the rate. RDOQ guarantees its cost with the coder's ideal code length;
    # the range coder adds at most a few bytes to either (terminate bin, flush).
    assert cost(chosen) <= cost(nearest) + lam * 32
    exact = _quantizer_kernels.sequence_cost
    args = (values, np.empty(0, np.float32), step, lam, kw["ncols"], 0, kw["k_offset"], kw["predict"])
    assert exact(chosen, *args) <= exact(nearest, *args)


def test_trellis_beats_rounding_at_equal_error():
    # at the same squared error, the trellis needs fewer bits than plain rounding
    shape = (64, 256)
    values = laplace_weights(5, shape, 0.05).reshape(-1)
    kw = _layout_args(shape)
    points = []
    for method, qps in (("nearest", range(-36, -19, 2)), ("trellis", range(-32, -15, 2))):
        curve = []
        for qp in qps:
            step = step_from_qp(qp)
            if method == "nearest":
                levels = quantize_nearest(values, step)
                recon = levels
            else:
                levels = quantize_rd(values, step, method="trellis", lam=0.46, **kw)
                recon = dq_indices(levels)
            sse = float(np.sum((values - recon * step).astype(np.float64) ** 2))
            curve.append((np.log(sse), np.log(_chunk_bits(levels, kw))))
        points.append(sorted(curve))
    (x0, y0), (x1, y1) = (np.array(c).T for c in points)
    grid = np.linspace(max(x0[0], x1[0]), min(x0[-1], x1[-1]), 5)
    saving = np.exp(np.interp(grid, x1, y1) - np.interp(grid, x0, y0))
    assert np.all(saving < 0.985), saving


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.bool_])
def test_relative_importance_kernel_matches_the_numpy_expression(dtype):
    # tensor_plan.Importance.chunk makes the float32 weights the trellis sees in one Numba pass (integer and
    # boolean importance converted to float64 first); it must give exactly the float32 values of the
    # plain numpy expression (bytes depend on it).
    rng = np.random.default_rng(7)
    raw = rng.lognormal(0.0, 3.0, size=(37, 29)) * (rng.random((37, 29)) > 0.1)
    if dtype is np.bool_:
        arr = raw > 1.0
    elif dtype is np.int64:
        arr = np.round(raw * 5).astype(dtype)
    else:
        arr = raw.astype(dtype)
    imp = tensor_plan.relative_importance("t", arr, arr.shape)
    views = [imp, tensor_plan.Importance(np.broadcast_to(arr[:, :1], arr.shape), imp.mean)]
    for im in views:
        for start, stop in [(0, arr.size), (29, 29 * 5), (3, 500), (100, 100)]:
            part = np.asarray(im.array).reshape(-1)[start:stop].astype(np.float64)
            floor = tensor_plan.IMPORTANCE_FLOOR
            want = ((part / im.mean + floor) / (1.0 + floor)).astype(np.float32)
            got = im.chunk(start, stop)
            assert got.dtype == np.float32 and np.array_equal(got, want)


def test_importance_moves_the_error_to_unimportantlaplace_weights():
    shape = (32, 128)
    w = laplace_weights(7, shape, 0.05)
    imp = np.ones(shape, dtype=np.float32)
    imp[:16] = 50.0  # the first half of the rows matters far more
    for method, gain in (("rdoq", 0.99), ("trellis", 0.9)):
        kw = dict(qp=-28, quantizer=method, lambda_scale=4.0)
        plain = dc.quantize_model({"w": w}, **kw)["w"].dequantize()
        # the same step for both (no allocation), so only the weighting differs
        weighted = dc.quantize_model({"w": w}, importance={"w": imp}, qp_overrides={"w": -28},
                                     **kw)["w"].dequantize()
        err_plain = (plain - w) ** 2
        err_weighted = (weighted - w) ** 2
        # (RDOQ cannot go below the rounding error, so the important half gains less there)
        assert err_weighted[:16].mean() < gain * err_plain[:16].mean(), method
        assert err_weighted[16:].mean() > 1.1 * err_plain[16:].mean(), method


# --- the codec with the RD quantizers -------------------------------------------------------------


@pytest.mark.parametrize("quantizer", ["nearest", "rdoq", "trellis"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_decoder_reconstructs_what_the_quantizer_chose(quantizer, dtype):
    model = {"w": torch.from_numpy(laplace_weights(11, (40, 33), 0.1)).to(dtype),
             "b": torch.from_numpy(laplace_weights(12, (33,), 0.01)).to(dtype)}
    data = dc.encode_model(model, qp=-30, quantizer=quantizer)
    decoded = dc.decode_model(data, threads=2)
    quantized = dc.quantize_model(model, qp=-30, quantizer=quantizer)
    levels = dc.decode_levels(data)
    for name in model:
        assert decoded[name].dtype == dtype
        expected = quantized[name].dequantize()
        expected = expected if isinstance(expected, torch.Tensor) else torch.from_numpy(expected)
        assert torch.equal(decoded[name], expected), name
        np.testing.assert_array_equal(levels[name].levels, quantized[name].levels)
    header = dc.read_stream_header(data)
    mode = Mode.DEPENDENT if quantizer == "trellis" else Mode.UNIFORM
    assert {e.mode for e in header.tensors} == {mode}
    assert header.version == (2 if quantizer == "trellis" else 1)


def test_trellis_over_several_chunks_and_threads():
    shape = (1100, 1000)  # two substreams, each with its own trellis
    assert chunk_layout.layout_for_shape(shape).count == 2
    w = laplace_weights(13, shape, 0.05)
    one = dc.encode_model({"w": w}, qp=-28, threads=1)
    assert dc.encode_model({"w": w}, qp=-28, threads=2) == one
    expected = dc.quantize_model({"w": w}, qp=-28)["w"].dequantize()
    np.testing.assert_array_equal(dc.decode_model(one)["w"], expected)


def test_default_is_the_trellis_and_rd_settings_are_validated():
    w = {"w": laplace_weights(14, (16, 16))}
    assert dc.encode_model(w) == dc.encode_model(w, quantizer="trellis")
    with pytest.raises(ValueError, match="quantizer"):
        dc.encode_model(w, quantizer="fancy")
    with pytest.raises(ValueError, match="lambda_scale"):
        dc.encode_model(w, lambda_scale=-1.0)
    with pytest.raises(ValueError, match="importance"):
        dc.encode_model(w, importance={"w": np.ones((3, 3))})
    with pytest.raises(ValueError, match="does not have"):
        dc.encode_model(w, importance={"v": np.ones((16, 16))})
    with pytest.raises(ValueError, match="non-negative"):
        dc.encode_model(w, importance={"w": -np.ones((16, 16))})


def test_larger_lambda_gives_fewer_bytes():
    w = {"w": laplace_weights(15, (64, 64))}
    sizes = [len(dc.encode_model(w, qp=-30, lambda_scale=s)) for s in (0.0, 1.0, 8.0)]
    assert sizes[0] >= sizes[1] > sizes[2]


# --- bit allocation, importance, rate control -------------------------------------------------------
