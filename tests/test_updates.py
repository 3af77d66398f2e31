"""Update streams: sparsifiers, error feedback, the Golomb baseline, our coder against its plain-Python
reference, the message format, parent and session checks, corruption."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import reference_update_coder as ref
import torch

from deepcabac_py.errors import (
    CorruptStreamError,
    DeepCabacError,
    FormatError,
    TruncatedStreamError,
    UpdateMismatchError,
)
from deepcabac_py.updates import _update_kernels as K
from deepcabac_py.updates import golomb
from deepcabac_py.updates.message_format import read_update_header
from deepcabac_py.updates.messages import (
    UpdateStreamWriter,
    apply_update,
    decode_update,
    encode_sparse,
    encode_update,
    iter_messages,
)
from deepcabac_py.updates.parent_model import model_hash
from deepcabac_py.updates.sessions import UpdateSession
from deepcabac_py.updates.sparsify import (
    ErrorFeedback,
    SparseTensor,
    keep_count,
    sbc,
    sparsify,
    stc,
    structured_rows,
    topk_mask,
)


def _model(seed=0, torch_tensors=True):
    g = np.random.default_rng(seed)
    m = {"conv.weight": g.normal(size=(8, 3, 3, 3)), "conv.bias": g.normal(size=8),
         "fc.weight": g.normal(size=(10, 40)), "fc.bias": g.normal(size=10)}
    m = {k: v.astype(np.float32) for k, v in m.items()}
    m["steps"] = np.array(3, dtype=np.int64)
    return {k: torch.from_numpy(v) for k, v in m.items()} if torch_tensors else m


def _step(model, seed, scale=0.01):
    g = np.random.default_rng(seed)
    out = {}
    for k, v in model.items():
        a = v.numpy() if isinstance(v, torch.Tensor) else v
        if a.dtype.kind == "f":
            a = (a + scale * g.normal(size=a.shape) * (1 + np.arange(a.size).reshape(a.shape) % 3)).astype(np.float32)
        else:
            a = np.asarray(a + 1, dtype=a.dtype)
        out[k] = torch.from_numpy(a) if isinstance(v, torch.Tensor) else a
    return out


# --- sparsifiers and error feedback -----------------------------------------------------------------

def test_topk_exact_count_and_ties():
    x = np.array([0.0, 3, -3, 1, 3, -0.5, 0, 2], dtype=np.float32)
    m = topk_mask(x, 3 / 8)
    assert m.sum() == 3 and list(np.flatnonzero(m)) == [1, 2, 4]
    assert not topk_mask(np.zeros(5, np.float32), 1.0).any()  # zeros are never kept
    assert keep_count(1000, 0.001) == 1 and keep_count(7, 0.5) == 4


def test_topk_sampled_close_to_k():
    x = np.random.default_rng(1).normal(size=200_000).astype(np.float32)
    m = topk_mask(x, 0.01, sampled=True)
    assert 1000 <= m.sum() <= 4000
    exact = topk_mask(x, 0.01, sampled=False)
    assert exact.sum() == 2000 and (m & exact).sum() >= 0.5 * exact.sum()


def test_stc_sbc_and_structured():
    x = torch.tensor([[0.1, -4.0, 2.0, 0.0], [1.0, 0.2, -0.3, 5.0]])
    s = stc(x, 0.5)
    assert s.nnz == 4 and set(np.unique(s.levels)) <= {-1, 0, 1}
    assert np.isclose(s.step, (4 + 2 + 1 + 5) / 4)
    b = sbc(x, 0.25)  # positives {5, 2}: mean 3.5; negatives {4, 0.3}: mean 2.15
    assert np.isclose(b.step, 3.5) and set(np.unique(b.levels)) == {0, 1} and b.nnz == 2
    rows = structured_rows(x, 0.5)
    assert rows[1].all() and not rows[0].any()
    r = sparsify(x, "stc", 0.25, rows=0.5)
    assert r.levels[0].sum() == 0 and r.nnz == 2
    q = sparsify(x.numpy(), "topk", 0.5, value_levels=4)
    assert np.abs(q.levels).max() == 4 and np.isclose(q.step, 5 / 4)


def test_error_feedback_invariant():
    g = np.random.default_rng(3)
    ef = ErrorFeedback()
    total_in = {"w": np.zeros((20, 30))}
    total_sent = {"w": np.zeros((20, 30))}
    for _ in range(6):
        upd = {"w": g.normal(size=(20, 30)).astype(np.float32)}
        acc = ef.accumulate(upd)
        sent = {"w": stc(acc["w"], 0.05)}
        ef.commit(acc, {"w": sent["w"].values()})
        s = sent["w"].values().astype(np.float64)
        # residual + sent == accumulated input, bit for bit
        np.testing.assert_array_equal(ef.residual["w"] + s, acc["w"])
        total_in["w"] += upd["w"]
        total_sent["w"] += s
    np.testing.assert_allclose(total_sent["w"] + ef.residual["w"], total_in["w"], rtol=0, atol=1e-9)


# --- Golomb -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p,b,bits", [(0.1, 3, 4.76), (0.04, 4, 6.09), (0.01, 6, 8.11), (1 / 400, 8, 10.11),
                                      (0.001, 9, 11.49)])
def test_golomb_parameter_worked_values(p, b, bits):
    n = 1_000_000
    k = int(p * n)
    assert golomb.golomb_parameter(k, n) == b
    assert abs(golomb.expected_position_bits(k, n) - bits) < 0.01


def test_golomb_bits_match_closed_form_and_round_trip():
    g = np.random.default_rng(5)
    for n, k in [(1, 1), (10, 1), (1000, 10), (5000, 700), (64, 64), (300, 0)]:
        levels = np.zeros(n, np.int32)
        pos = np.sort(g.choice(n, size=k, replace=False))
        levels[pos] = g.choice([-1, 1], size=k)
        b = golomb.golomb_parameter(k, n)
        d = golomb.gaps(pos)
        closed = int(np.sum(np.ceil(d / 2 ** b)) + k * b)
        assert golomb.position_bits(pos, n) == closed
        data = golomb.encode_positions(levels)
        assert len(data) == (closed + k + 7) // 8
        np.testing.assert_array_equal(golomb.decode_positions(data, k, n), levels)
        assert golomb.stc_bits(levels, step_bits=32) == (closed + k + 32 if k else 0)
    with pytest.raises(CorruptStreamError):
        golomb.decode_positions(b"\xff\xff", 3, 10)


# --- our coder against the plain-Python reference -----------------------------------------------------

def _random_tensor(g, rows, cols, density, maxabs, sign_mode, features, history=True):
    n = rows * cols
    levels = np.zeros(n, np.int64)
    k = max(1, int(density * n))
    pos = g.choice(n, size=k, replace=False)
    mags = g.integers(1, maxabs + 1, size=k) if maxabs > 1 else np.ones(k, np.int64)
    mags[0] = maxabs
    signs = {K.SIGN_CODED: g.choice([-1, 1], size=k), K.SIGN_ALL_POSITIVE: np.ones(k, np.int64),
             K.SIGN_ALL_NEGATIVE: -np.ones(k, np.int64)}[sign_mode]
    levels[pos] = mags * signs
    parent = g.integers(-2, 3, size=n) * (g.random(n) < 0.1) if history else np.zeros(n, np.int64)
    # last sign | count << 2 | age << 6 (all zero where the position was never nonzero)
    hist = (g.integers(1, 3, size=n) | (g.integers(1, K.HIST_COUNT_MAX + 1, size=n) << K.HIST_COUNT_SHIFT)
            | (g.integers(1, K.HIST_AGE_MAX + 1, size=n) << K.HIST_AGE_SHIFT)) * (g.random(n) < 0.3) if history \
        else np.zeros(n, np.int64)
    return dict(levels=[int(v) for v in levels], rows=rows, cols=cols, nnz=k, maxabs=int(maxabs),
                sign_mode=sign_mode, features=features, parent=[int(v) for v in parent], hist=[int(v) for v in hist])


def _kernel_encode(tensors, ctx):
    off, tinfo, lv, pa, hi = 0, [], [], [], []
    for t, d in enumerate(tensors):
        tinfo.append((off, d["rows"], d["cols"], d["nnz"], d["maxabs"], d["sign_mode"], d["features"], t * K.N_CTX_U,
                      K.rate_for(d["nnz"], d["rows"] * d["cols"])))
        lv += d["levels"]
        pa += d["parent"]
        hi += d["hist"]
        off += d["rows"] * d["cols"]
    args = (np.array(tinfo, np.int64).reshape(-1, 9), np.array(pa, np.int8), np.array(hi, np.uint16), ctx)
    out = np.empty(off * 8 + 64, np.uint8)
    size = K.encode_update_kernel(np.array(lv, np.int32), *args[:3], ctx, out)
    return out[1:size].tobytes(), args


@pytest.mark.parametrize("seed", range(11))
def test_kernel_matches_reference_byte_for_byte(seed):
    g = np.random.default_rng(seed)
    feats = [K.F_ALL, 0, K.F_ALL & ~K.F_ROWSKIP, K.F_ROWSKIP | K.F_COLUMN, K.F_SIGNCTX | K.F_TEMPORAL,
             K.F_AREA | K.F_HISTORY | K.F_ROW, K.F_ALL_V1, K.F_MIX, K.F_MIX | K.F_SIGNCTX | K.F_TEMPORAL,
             K.F_MIX | K.F_AREA | K.F_HISTORY | K.F_ROW | K.F_SIGNCTX, K.F_MIX | K.F_COLUMN | K.F_ROWSKIP][seed]
    ctx = K.fresh_contexts(3)
    ref_ctx = [[[int(p), int(c)] for p, c in ctx[t * K.N_CTX_U:(t + 1) * K.N_CTX_U]] for t in range(3)]
    dctx = ctx.copy()  # the decoder's contexts, carried like the encoder's
    ref_dctx = [[list(r) for r in rc] for rc in ref_ctx]
    for rnd in range(3):  # contexts carried from round to round on both sides
        # (the second and third shapes of the first tensor wrap the per-column and per-row contexts)
        tensors = [_random_tensor(g, *[(6, 17), (2, 1100), (520, 3)][rnd], [0.15, 0.01, 0.5][rnd], 1, K.SIGN_CODED,
                                  feats),
                   _random_tensor(g, 1, 40, 0.05, 1, [K.SIGN_ALL_POSITIVE, K.SIGN_ALL_NEGATIVE][rnd % 2], feats),
                   _random_tensor(g, 9, 5, 0.4, [3, 70000, 1][rnd], K.SIGN_CODED, feats)]
        data, (tinfo, pa, hi, _) = _kernel_encode(tensors, ctx)
        for t, d in enumerate(tensors):
            d["ctx"] = ref_ctx[t]
        assert ref.encode(tensors) == data
        for t in range(3):
            assert [list(map(int, r)) for r in ctx[t * K.N_CTX_U:(t + 1) * K.N_CTX_U]] == ref_ctx[t]
        # the Numba decoder and the reference decoder agree with the levels
        out = np.zeros(sum(d["rows"] * d["cols"] for d in tensors), np.int32)
        assert K.decode_update_kernel(np.frombuffer(data, np.uint8), tinfo, pa, hi, dctx, out) == K.OK
        assert list(out) == sum((d["levels"] for d in tensors), [])
        for t, d in enumerate(tensors):
            d["ctx"] = ref_dctx[t]
        assert ref.decode(data, tensors) == [d["levels"] for d in tensors]
        assert ref_dctx == ref_ctx and np.array_equal(dctx, ctx)


# --- the message format and the API --------------------------------------------------------------------

@pytest.mark.parametrize("method,coder", [("stc", "cabac"), ("sbc", "cabac"), ("topk", "cabac"), ("stc", "golomb"),
                                          ("sbc", "golomb")])
def test_round_trip_levels_and_applied_model(method, coder):
    base = _model()
    new = _step(base, 1)
    data = encode_update(new, base, density=0.1, method=method, coder=coder)
    upd = decode_update(data, base)
    expect = {n: sparsify(new[n].numpy().astype(np.float64) - base[n].numpy(), method, 0.1)
              for n in base if base[n].is_floating_point()}
    for n, s in expect.items():
        np.testing.assert_array_equal(upd.tensors[n].levels, s.levels)
        assert upd.tensors[n].step == s.step
    assert int(upd.tensors["steps"]) == 1
    applied = apply_update(base, data)
    for n in base:
        assert isinstance(applied[n], torch.Tensor) and applied[n].dtype == base[n].dtype
        if n in expect:
            np.testing.assert_array_equal(applied[n].numpy(), base[n].numpy() + expect[n].values())
    assert int(applied["steps"]) == 4
    assert read_update_header(data).table is not None  # standalone messages list their tensors


def test_numpy_models_and_all_zero_tensors_skipped():
    base = _model(torch_tensors=False)
    new = dict(base)
    new["fc.weight"] = base["fc.weight"] + np.float32(0.5) * (np.arange(400).reshape(10, 40) == 7)
    data = encode_update(new, base, density=0.01)
    h = read_update_header(data)
    assert [e.name for e in h.entries] == ["fc.weight"]
    out = apply_update(base, data)
    assert isinstance(out["fc.weight"], np.ndarray)
    assert out["fc.weight"][0, 7] == np.float32(base["fc.weight"][0, 7] + np.float32(0.5))
    np.testing.assert_array_equal(out["conv.weight"], base["conv.weight"])


def test_wrong_parent_is_refused():
    base = _model()
    new = _step(base, 1)
    data = encode_update(new, base, density=0.1, round_index=7, parent_round=6)
    with pytest.raises(UpdateMismatchError, match="round 6"):
        apply_update(new, data)
    other = dict(base)
    other["fc.bias"] = base["fc.bias"].clone()
    other["fc.bias"][0] += 1e-6
    with pytest.raises(UpdateMismatchError, match="wrong parent"):
        apply_update(other, data)
    assert read_update_header(data).parent_matches(model_hash(base))


def test_sessions_carry_contexts_and_refuse_skips():
    base = _model()
    enc, dec = UpdateSession(11), UpdateSession(11)
    ef = ErrorFeedback()
    cur = base
    messages = []
    for r in range(4):
        new = _step(cur, 10 + r)
        data = encode_update(new, cur, density=0.05, session=enc, feedback=ef, round_index=r + 1, parent_round=r)
        messages.append(data)
        cur = apply_update(cur, data, session=dec)
    assert enc.seq == dec.seq == 4
    for name, st in enc.states.items():
        np.testing.assert_array_equal(st.ctx, dec.states[name].ctx)
        np.testing.assert_array_equal(st.hist, dec.states[name].hist)
    assert read_update_header(messages[-1]).table is None  # session messages are compact
    fresh = UpdateSession(11)
    with pytest.raises(UpdateMismatchError, match="message 3"):
        decode_update(messages[-1], None, session=fresh)
    with pytest.raises(UpdateMismatchError):
        decode_update(messages[0], base)  # needs its session
    snap = UpdateSession.from_snapshot(dec.snapshot())
    assert snap.seq == 4 and snap.session_id == 11
    np.testing.assert_array_equal(snap.states["fc.weight"].hist, dec.states["fc.weight"].hist)


def test_stream_file_of_rounds(tmp_path):
    base = _model()
    enc = UpdateSession(5)
    path = tmp_path / "rounds.dcu"
    models = [base]
    follower = UpdateSession(5)
    with open(path, "wb") as f:
        w = UpdateStreamWriter(f)
        for r in range(3):
            new = _step(models[-1], 20 + r)
            data = encode_update(new, models[-1], density=0.1, session=enc, round_index=r + 1, parent_round=r)
            w.write(data)
            models.append(apply_update(models[-1], data, session=follower))
    dec = UpdateSession(5)
    cur = base
    with open(path, "rb") as f:
        msgs = list(iter_messages(f))
    assert msgs == list(iter_messages(path.read_bytes()))
    for r, m in enumerate(msgs):
        assert read_update_header(m).round == r + 1
        cur = apply_update(cur, m, session=dec)
    for n in base:
        np.testing.assert_array_equal(cur[n].numpy(), models[-1][n].numpy())
    with pytest.raises(TruncatedStreamError):
        list(iter_messages(io.BytesIO(path.read_bytes()[:-3])))


def test_corrupted_updates_raise_library_errors():
    base = _model()
    data = encode_update(_step(base, 2), base, density=0.1)
    h = read_update_header(data)
    assert h.payload_size > 8
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        with pytest.raises(DeepCabacError):
            apply_update(base, bytes(bad))
    for cut in range(len(data)):
        with pytest.raises(DeepCabacError):
            apply_update(base, data[:cut])
    with pytest.raises(FormatError):
        read_update_header(b"\x89DCB\r\n\x1a\n" + bytes(20))


def test_golomb_rejects_multilevel_and_reports_bits():
    base = _model()
    with pytest.raises(ValueError, match="Golomb"):
        encode_update(_step(base, 3), base, method="topk", coder="golomb")
    sp = {"fc.weight": SparseTensor(np.eye(10, 40, dtype=np.int32), 0.5, "stc")}
    g = encode_sparse(sp, base, coder="golomb")
    assert read_update_header(g).payload_size == (golomb.stc_bits(sp["fc.weight"].levels, step_bits=0) + 7) // 8


def test_more_rounds_cost_fewer_bits_with_contexts():
    # Positions that persist across rounds: the session's contexts learn them.
    g = np.random.default_rng(9)
    base = {"w": np.zeros((64, 64), np.float32)}
    hot = g.choice(64 * 64, size=200, replace=False)
    with_session, alone = [], []
    s = UpdateSession(1)
    for _ in range(6):
        lv = np.zeros(64 * 64, np.int32)
        lv[g.choice(hot, size=40, replace=False)] = g.choice([-1, 1], size=40)
        sp = {"w": SparseTensor(lv.reshape(64, 64), 0.1, "stc")}
        with_session.append(read_update_header(encode_sparse(sp, base, session=s)).payload_size)
        alone.append(read_update_header(encode_sparse(sp, base)).payload_size)
    assert sum(with_session[3:]) < 0.9 * sum(alone[3:])
    assert math.isfinite(sum(with_session))


def test_session_history_tracks_age_count_and_sign():
    from deepcabac_py.updates.sessions import next_hist

    h = np.zeros(4, np.uint16)
    for levels in ([1, 0, 0, 0], [-1, 0, 0, 0], None, [0, 1, 0, 0]):
        h = next_hist(h, None if levels is None else np.array(levels))
    sign, count, age = h & 3, (h >> K.HIST_COUNT_SHIFT) & K.HIST_COUNT_MAX, (h >> K.HIST_AGE_SHIFT) & K.HIST_AGE_MAX
    assert sign.tolist() == [2, 1, 0, 0] and count.tolist() == [2, 1, 0, 0] and age.tolist() == [3, 1, 0, 0]
    h = np.full(1, 2 | (K.HIST_COUNT_MAX << K.HIST_COUNT_SHIFT) | (K.HIST_AGE_MAX << K.HIST_AGE_SHIFT), np.uint16)
    assert next_hist(h, None)[0] == h[0]  # both saturate
    assert next_hist(h, np.array([3]))[0] == 1 | (K.HIST_COUNT_MAX << K.HIST_COUNT_SHIFT) | (1 << K.HIST_AGE_SHIFT)


def test_session_advance_kernel_matches_next_hist():
    from deepcabac_py.updates.sessions import next_hist

    g = np.random.default_rng(5)
    for listed in (True, False):
        hist = g.integers(0, 1 << 12, size=500).astype(np.uint16)
        hist[:3] = [0, K.HIST_AGE_MAX << K.HIST_AGE_SHIFT, (1 << 12) - 1]
        levels = (g.integers(-4, 5, size=500) * (g.random(500) < 0.3)).astype(np.int32)
        parent = g.integers(-2, 3, size=500).astype(np.int8)
        want_h = next_hist(hist, levels if listed else None)
        want_p = np.clip(levels, -K.PARENT_MAX, K.PARENT_MAX) if listed else np.zeros(500, np.int8)
        K.advance_session_kernel(hist, parent, levels if listed else np.zeros(0, np.int32), listed)
        assert np.array_equal(hist, want_h) and np.array_equal(parent, want_p)


def test_session_snapshot_round_trip_format1_upgrade_and_hostile_values():
    base, new = _model(0), _step(_model(0), 1)
    enc = UpdateSession(4)
    encode_update(new, base, density=0.2, session=enc)
    snap = UpdateSession.from_snapshot(enc.snapshot())
    assert snap.seq == 1
    assert all(np.array_equal(snap.states[n].ctx, st.ctx) and np.array_equal(snap.states[n].hist, st.hist)
               for n, st in enc.states.items())
    # a format-1 snapshot (contexts without the mixed models) continues with fresh mixed models
    old = enc.copy()
    for st in old.states.values():
        st.ctx = st.ctx[:K.N_CTX_V1].copy()
    up = UpdateSession.from_snapshot(old.snapshot())
    for n, st in up.states.items():
        assert np.array_equal(st.ctx[:K.N_CTX_V1], enc.states[n].ctx[:K.N_CTX_V1])
        assert np.array_equal(st.ctx[K.N_CTX_V1:], K.fresh_contexts(1)[K.N_CTX_V1:])
    name = sorted(enc.states)[0]
    hostile = (("ctx", (0, 1), K.COUNT_MAX + 1), ("ctx", (5, 0), -1), ("ctx", (K.CTX_WSIG, 0), 1 << 40),
               ("hist", 0, 3), ("hist", 0, 1 << 12), ("parent", 0, 3))
    for field, index, value in hostile:
        bad = enc.copy()
        getattr(bad.states[name], field)[index] = value
        with pytest.raises(CorruptStreamError):
            UpdateSession.from_snapshot(bad.snapshot())
