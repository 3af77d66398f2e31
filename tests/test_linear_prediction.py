"""Linear prediction across columns: the arithmetic against a plain-Python reference, the side
information, the fit, the codec path and hostile input."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import deepcabac_py as dc
from deepcabac_py.entropy import chunk_layout, levelcoder
from deepcabac_py.entropy import linear_prediction as lp
from deepcabac_py.entropy.levelcoder import LEVEL_MAX
from deepcabac_py.errors import CorruptStreamError, DeepCabacError
from deepcabac_py.model.container import Mode, read_header


def reference_residuals(levels, ncols, pivots, coef, intercepts, frac_bits):
    """docs/format.md, "Linear prediction", in Python integers: row by row, column by column."""
    order = list(pivots) + [c for c in range(ncols) if c not in set(pivots)]
    m = len(pivots)
    out = []
    for row in np.asarray(levels, dtype=np.int64).reshape(-1, ncols).tolist():
        piv = [row[p] for p in pivots]
        for t, col in enumerate(order):
            used = min(t, m)
            s = sum(int(coef[t][i]) * piv[i] for i in range(used)) + int(intercepts[t])
            out.append(row[col] - ((s + ((1 << frac_bits) >> 1)) >> frac_bits))
    return np.array(out, dtype=np.int64)


def predictor(rng, ncols, m, frac_bits, coef_max, pivot_bound):
    pivots = rng.permutation(ncols)[:m].astype(np.int64)
    coef = rng.integers(-coef_max, coef_max + 1, size=(ncols, m)).astype(np.int64)
    coef[:m] = np.tril(coef[:m], -1)  # a pivot uses only the pivots before it
    intercepts = rng.integers(-1000, 1001, size=ncols).astype(np.int64)
    return lp.LinearPredictor(ncols, pivots, coef, intercepts, pivot_bound, frac_bits)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ncols=st.integers(2, 40), rows=st.integers(1, 40),
       frac_bits=st.integers(0, 10), coef_max=st.sampled_from([0, 1, 7, 300]),
       level_max=st.sampled_from([1, 50, 3000, 2**20]))
@example(seed=25733057, ncols=35, rows=38, frac_bits=0, coef_max=300, level_max=2**20)  # overshoots 31 bits
def test_residuals_and_rebuild_match_the_reference(seed, ncols, rows, frac_bits, coef_max, level_max):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, ncols))
    levels = rng.integers(-level_max, level_max + 1, size=rows * ncols).astype(np.int32)
    pred = predictor(rng, ncols, m, frac_bits, coef_max, level_max)
    assert pred.float_dtype() is not None
    ref = reference_residuals(levels, ncols, pred.pivots, pred.coef, pred.intercepts, frac_bits)
    if np.abs(ref).max() > LEVEL_MAX:
        # a hand-made predictor can overshoot what fit() would allow: refused, not wrapped
        with pytest.raises(ValueError, match="31-bit range"):
            pred.residuals(levels)
        return
    res = pred.residuals(levels)
    assert np.array_equal(res.astype(np.int64), ref)
    back = np.empty_like(levels)
    pred.rebuild(res, back)
    assert np.array_equal(back, levels)


def test_float64_path_where_float32_would_round():
    rng = np.random.default_rng(1)
    ncols, rows = 24, 50
    levels = rng.integers(-(2**22), 2**22, size=rows * ncols).astype(np.int32)
    pred = predictor(rng, ncols, 8, 6, 200, 2**22)
    assert pred.float_dtype() is np.float64  # 200 * 8 * 2**22 > 2**24
    res = pred.residuals(levels)
    assert np.array_equal(res.astype(np.int64), reference_residuals(levels, ncols, pred.pivots, pred.coef,
                                                                     pred.intercepts, 6))
    back = np.empty_like(levels)
    pred.rebuild(res, back)
    assert np.array_equal(back, levels)


def correlated(rows, ncols, seed=0, factors=6, noise=3.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, factors)) @ rng.standard_normal((factors, ncols)) * 12
    return np.rint(x + noise * rng.standard_normal((rows, ncols))).astype(np.int32)


def test_side_information_round_trip():
    x = correlated(1000, 48)
    pred = lp.fit(x.reshape(-1), 48)
    assert pred is not None and pred.m == 16
    back = lp.from_bytes(pred.to_bytes(), 48)
    for f in ("pivots", "coef", "intercepts"):
        assert np.array_equal(getattr(back, f), getattr(pred, f)), f
    assert (back.pivot_bound, back.frac_bits) == (pred.pivot_bound, pred.frac_bits)
    assert back.pivot_bound == int(np.abs(x).max())


def test_fit_declines_what_does_not_pay():
    rng = np.random.default_rng(2)
    noise = rng.integers(-40, 41, size=(1000, 48)).astype(np.int32)
    assert lp.fit(noise.reshape(-1), 48) is None  # independent columns
    assert lp.fit(correlated(700, 48).reshape(-1), 48) is None  # too few rows per column
    assert lp.fit(correlated(1000, 47).reshape(-1), 47) is None  # too few columns
    assert lp.fit(np.zeros(48 * 1000, np.int32), 48) is None  # nothing to predict
    with pytest.raises(ValueError):
        lp.fit(np.zeros(10, np.int64), 5)


def test_prediction_saves_bytes_on_correlated_columns():
    x = correlated(1200, 64)
    pred = lp.fit(x.reshape(-1), 64)
    assert pred is not None
    layout = chunk_layout.layout_for_shape(x.shape)
    plain = len(levelcoder.encode_chunk(x.reshape(-1), layout, 0))
    linear = chunk_layout.ChunkLayout(x.size, 0, layout.chunk_elements, linear=True)
    coded = len(levelcoder.encode_chunk(pred.residuals(x.reshape(-1)), linear, 0)) + len(pred.to_bytes())
    assert coded < 0.8 * plain


def model(rows=1024, ncols=48, seed=3):
    w = correlated(rows, ncols, seed).astype(np.float32) * np.float32(2.0**-8)
    return {"emb": w, "small": w[:8, :8].copy(), "bias": w[0].copy()}


@pytest.mark.parametrize("threads", [1, 2])
def test_codec_round_trip(threads):
    m = model()
    data = dc.encode_model(m, qp=-32, quantizer="nearest", threads=threads)
    header = read_header(data)
    entry = {e.name: e for e in header.tensors}["emb"]
    assert entry.is_linear and entry.mode == Mode.UNIFORM and header.version == 3
    assert not {e.name: e for e in header.tensors}["small"].is_linear
    assert data == dc.encode_model(m, qp=-32, quantizer="nearest", threads=3 - threads)
    q = dc.quantize_model(m, qp=-32, quantizer="nearest")
    back = dc.decode_model(data, threads=threads)
    levels = dc.decode_levels(data, threads=threads)
    for name in m:
        assert np.array_equal(levels[name].levels, q[name].levels), name
        assert back[name].tobytes() == np.asarray(q[name].dequantize()).tobytes(), name


def test_rdoq_uses_it_and_the_trellis_does_not():
    m = model()
    imp = {"emb": np.random.default_rng(6).random(m["emb"].shape) + 0.5}
    data = dc.encode_model(m, qp=-32, quantizer="rdoq", importance=imp, threads=2)
    assert {e.name for e in read_header(data).tensors if e.is_linear} == {"emb"}
    assert data == dc.encode_model(m, qp=-32, quantizer="rdoq", importance=imp, threads=1)
    q = dc.quantize_model(m, qp=-32, quantizer="rdoq", importance=imp)
    assert np.array_equal(dc.decode_levels(data)["emb"].levels, q["emb"].levels)
    data = dc.encode_model(m, qp=-32, importance=None)  # the trellis, the default
    assert not any(e.is_linear for e in read_header(data).tensors)


def test_streams_without_it_keep_their_version():
    data = dc.encode_model({"w": np.ones((4, 4), np.float32)}, qp=-32, quantizer="nearest")
    assert read_header(data).version == 1


# --- hostile side information --------------------------------------------------------------------

def side(m, frac_bits, bound, pivots, coefs, reserved=0):
    vec = np.asarray(coefs, dtype=np.int32)
    body = levelcoder.encode_chunk(vec, chunk_layout.ChunkLayout(vec.size, 0, max(1, vec.size)), 0)
    return struct.pack("<HBBI", m, frac_bits, reserved, bound) + np.asarray(pivots, "<u2").tobytes() + body


def valid_coefs(ncols, m, value=1):
    return [value] * lp.coefficient_count(ncols, m)


@pytest.mark.parametrize("data, match", [
    (b"\x01\x00", "truncated"),
    (side(16, 6, 100, range(16), valid_coefs(48, 16))[:10], "truncated"),
    (side(48, 6, 100, range(48), valid_coefs(48, 47)), "pivots"),
    (side(0, 6, 100, [], []), "pivots"),
    (side(16, 6, 100, list(range(15)) + [3], valid_coefs(48, 16)), "repeated"),
    (side(16, 6, 100, list(range(15)) + [48], valid_coefs(48, 16)), "out of range"),
    (side(16, 17, 100, range(16), valid_coefs(48, 16)), "precision"),
    (side(16, 6, 2**31, range(16), valid_coefs(48, 16)), "bound"),
    (side(16, 6, 100, range(16), valid_coefs(48, 16), reserved=1), "reserved"),
    (side(16, 6, 2**30, range(16), valid_coefs(48, 16, 2**20)), "exact arithmetic"),
    (side(16, 6, 100, range(16), valid_coefs(48, 16)[:-5]), "chunk"),
])
def test_hostile_side_information(data, match):
    with pytest.raises(CorruptStreamError, match=match):
        lp.from_bytes(data, 48)


def test_coefficients_the_payload_cannot_hold_are_refused_before_allocation():
    # 4096 columns and 512 pivots claim about 2 million coefficients; 10 bytes cannot code them
    data = struct.pack("<HBBI", 512, 6, 0, 100) + np.arange(512, dtype="<u2").tobytes() + bytes(10)
    with pytest.raises(CorruptStreamError, match="cannot fit"):
        lp.from_bytes(data, 4096)


def test_rebuild_refuses_pivots_beyond_the_bound():
    pred = lp.from_bytes(side(16, 6, 10, range(16), valid_coefs(48, 16, 0)), 48)
    res = np.zeros(48 * 3, np.int32)
    res[5] = 11  # pivot 5 of row 0: level 11 > 10
    with pytest.raises(CorruptStreamError, match="bound"):
        pred.rebuild(res, np.empty_like(res))


def test_damaged_streams_raise_library_errors():
    data = bytearray(dc.encode_model(model(), qp=-32, quantizer="nearest"))
    header = read_header(bytes(data))
    entry = {e.name: e for e in header.tensors}["emb"]
    start = header.header_size + entry.offset
    rng = np.random.default_rng(4)
    # every byte of the predictor, and a sample of the residual chunks
    positions = list(range(start, start + entry.chunk_sizes[0])) + list(
        rng.integers(start + entry.chunk_sizes[0], start + entry.size, size=40))
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 0x40
        with pytest.raises(DeepCabacError):
            dc.decode_model(bytes(damaged))
    with pytest.raises(DeepCabacError):
        dc.decode_model(bytes(data[: start + entry.chunk_sizes[0] // 2]))


def test_every_damaged_byte_of_the_side_information():
    pred = lp.fit(correlated(1000, 48).reshape(-1), 48)
    good = pred.to_bytes()
    res = pred.residuals(correlated(20, 48, seed=9).reshape(-1))
    for pos in range(len(good)):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= bit
            try:
                other = lp.from_bytes(bytes(bad), 48)
            except CorruptStreamError:
                continue
            try:  # a predictor that parses rebuilds or refuses, nothing else
                other.rebuild(res, np.empty_like(res))
            except CorruptStreamError:
                pass


# --- hostile tensor tables -----------------------------------------------------------------------

def crafted(shape=(1024, 48), *, mode=Mode.UNIFORM, coder_param=chunk_layout.LINEAR_BIT, chunk_elements=None,
            with_predictor=True, version=None):
    from helpers import craft, reseal_header, uniform

    numel = shape[0] * shape[1]
    pred = side(16, 6, 100, range(16), valid_coefs(shape[1], 16, 0))
    levels = levelcoder.encode_chunk(np.zeros(numel, np.int32), chunk_layout.ChunkLayout(numel, 0, numel), 0)
    chunks = ([pred] if with_predictor else []) + [levels]
    data = bytearray(craft([uniform(shape=shape, mode=mode, coder_param=coder_param, chunk_elements=chunk_elements,
                                    chunk_sizes=[len(c) for c in chunks])], b"".join(chunks)))
    if version is not None:
        struct.pack_into("<H", data, 8, version)
        return reseal_header(data)
    return bytes(data)


def test_crafted_linear_stream_decodes():
    out = dc.decode_model(crafted())["w"]
    assert out.shape == (1024, 48) and not out.any()


@pytest.mark.parametrize("kw, match", [
    (dict(mode=Mode.DEPENDENT), "linear prediction with mode"),
    (dict(coder_param=chunk_layout.LINEAR_BIT | chunk_layout.PREDICT_BIT), "column prediction"),
    (dict(shape=(4096, 12)), "rows of 12"),
    (dict(chunk_elements=1000 * 48 + 7), "rows of 48"),
    (dict(with_predictor=False), "level chunks"),
    (dict(version=2), "needs format version 3"),
])
def test_hostile_linear_entries(kw, match):
    with pytest.raises(CorruptStreamError, match=match):
        dc.decode_model(crafted(**kw))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_other_float_dtypes(dtype):
    import torch

    w = torch.from_numpy(model()["emb"]).to(getattr(torch, dtype))
    data = dc.encode_model({"emb": w}, qp=-32, quantizer="nearest")
    assert read_header(data).tensors[0].is_linear
    back = dc.decode_model(data)["emb"]
    q = dc.quantize_model({"emb": w}, qp=-32, quantizer="nearest")["emb"].dequantize()
    q = q if isinstance(q, torch.Tensor) else torch.from_numpy(q)  # numpy, except for bfloat16
    assert back.dtype == w.dtype and torch.equal(back, q)


def test_the_blas_is_held_to_one_thread_only_where_a_predictor_may_run(monkeypatch):
    # (held where a linear predictor may be fitted or rebuilt; not for exact tensors, nor for a
    # stream without a predictor, where setting and restoring the limit cost a millisecond a call)
    asked: list[bool] = []
    limit = lp.blas_threads
    monkeypatch.setattr(lp, "blas_threads", lambda active: asked.append(active) or limit(active))
    m = model()
    lossless = dc.encode_model(m, keep_exact=True, quantizer="nearest", threads=2)
    dc.decode_model(lossless, threads=2)
    assert asked == [False, False]
    asked.clear()
    predicted = dc.encode_model(m, qp=-32, quantizer="nearest", threads=2)
    dc.decode_model(predicted, threads=2)
    assert any(e.is_linear for e in read_header(predicted).tensors)
    assert asked[0] and asked[-1] and all(asked)  # (the encoder's, its fit's, the decoder's)
