"""Data-free structural importance (deepcabac_py/model/structural_importance.py) and its use as
encode_model's default."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepcabac_py import decode_model, encode_model, quantize_model, read_stream_header
from deepcabac_py.model.structural_importance import BN_EPS, output_shift, shift_absorbers, structural_importance
from deepcabac_py.quant.steps import step_from_qp


def _bn(prefix: str, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": rng.uniform(0.2, 2.0, n).astype(np.float32) * rng.choice([-1, 1], n),
            f"{prefix}.bias": rng.normal(0, 1, n).astype(np.float32),
            f"{prefix}.running_mean": rng.normal(0, 1, n).astype(np.float32),
            f"{prefix}.running_var": rng.uniform(0.01, 4.0, n).astype(np.float32)}


def _conv_bn_net(seed: int = 0) -> dict[str, np.ndarray]:
    """conv 3->4 -> BN -> 1x1 conv 4->5 -> BN -> depthwise 5 -> BN -> linear 5->2, in module order."""
    rng = np.random.default_rng(seed)
    sd = {"stem.conv.weight": rng.normal(0, 1, (4, 3, 3, 3)).astype(np.float32)}
    sd |= _bn("stem.bn", 4, rng)
    sd["block.expand.weight"] = rng.normal(0, 1, (5, 4, 1, 1)).astype(np.float32)
    sd |= _bn("block.bn0", 5, rng)
    sd["block.dw.weight"] = rng.normal(0, 1, (5, 1, 3, 3)).astype(np.float32)
    sd |= _bn("block.bn1", 5, rng)
    sd["head.weight"] = rng.normal(0, 1, (2, 5)).astype(np.float32)
    sd["head.bias"] = rng.normal(0, 1, 2).astype(np.float32)
    return sd


def _relu_energy_by_integration(beta: float, gamma: float) -> float:
    # E[relu(z)^2], z ~ N(beta, gamma^2), by the trapezoidal rule on a fine grid
    z = np.linspace(beta - 12 * abs(gamma), beta + 12 * abs(gamma), 200_001)
    pdf = np.exp(-0.5 * ((z - beta) / gamma) ** 2) / (abs(gamma) * math.sqrt(2 * math.pi))
    return float(np.trapezoid(np.maximum(z, 0.0) ** 2 * pdf, z))


def _expected(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rules of structural_importance.py written out by hand for _conv_bn_net, before normalisation."""
    def gain(p):
        return sd[f"{p}.weight"].astype(np.float64) ** 2 / (sd[f"{p}.running_var"].astype(np.float64) + BN_EPS)

    def energy(p):
        return np.array([_relu_energy_by_integration(b, g) for b, g in
                         zip(sd[f"{p}.bias"].astype(np.float64), sd[f"{p}.weight"].astype(np.float64))])

    out = {"stem.conv.weight": np.broadcast_to(gain("stem.bn")[:, None, None, None], (4, 3, 3, 3)),
           "block.expand.weight": np.broadcast_to((gain("block.bn0")[:, None] * energy("stem.bn")[None, :])
                                                  [:, :, None, None], (5, 4, 1, 1)),
           "block.dw.weight": np.broadcast_to((gain("block.bn1") * energy("block.bn0"))[:, None, None, None],
                                              (5, 1, 3, 3)),
           "head.weight": np.broadcast_to(energy("block.bn1")[None, :], (2, 5)),
           "head.bias": np.ones(2)}  # no BN after the head: its bias moves the output as it is
    for p in ("stem.bn", "block.bn0", "block.bn1"):
        g = sd[f"{p}.weight"].astype(np.float64)
        v = sd[f"{p}.running_var"].astype(np.float64)
        # y = g (x - m) / sqrt(v + eps) + b: error weights of b, g, m, v for unit-variance xhat
        out |= {f"{p}.bias": np.ones_like(g), f"{p}.weight": np.ones_like(g), f"{p}.running_mean": gain(p),
                f"{p}.running_var": g * g * v / (4 * (v + BN_EPS) ** 3)}
    return out


def test_batchnorm_rule_matches_a_hand_computation():
    sd = _conv_bn_net()
    got = structural_importance(sd)
    want = _expected(sd)
    assert set(got) == set(want)
    # one common scale (the geometric mean over the ruled tensors is normalised to 1); a dead channel
    # (relu(z) ~ 0) may differ in its last digits, far below anything that moves a quantizer
    flat_got = np.concatenate([got[n].ravel() for n in want]).astype(np.float64)
    flat_want = np.concatenate([want[n].ravel() for n in want])
    scale = flat_got[np.argmax(flat_want)] / flat_want.max()
    np.testing.assert_allclose(flat_got, flat_want * scale, rtol=1e-4, atol=1e-9 * flat_got.max())
    layers = [n for n in want if want[n].ndim >= 2]  # the normalisation is over the layers
    sizes = np.array([want[n].size for n in layers], dtype=np.float64)
    logs = np.array([math.log2(float(np.mean(got[n]))) for n in layers])
    assert abs(float(np.sum(sizes * logs) / sizes.sum())) < 1e-6  # float32 output
    assert all(got[n].dtype == np.float32 and got[n].shape == sd[n].shape for n in want)


def test_batchnorm_must_follow_its_layer_in_the_same_module():
    sd = _conv_bn_net()
    # BN listed before its convolution (as in a name-sorted file): no rule can pair them
    reordered = {k: sd[k] for k in sorted(sd)}
    imp = structural_importance(reordered)
    assert imp["stem.conv.weight"] == 1.0
    assert "stem.bn.running_var" in imp  # the BN's own parameters still have their weights
    # a BN of another module with the right width is not taken for the layer's own
    other = {"a.conv.weight": sd["stem.conv.weight"]} | {k.replace("stem.bn", "b.bn"): v for k, v in sd.items()
                                                         if k.startswith("stem.bn")}
    assert structural_importance(other)["a.conv.weight"] == 1.0


def test_odd_models_get_no_rule_instead_of_an_error():
    sd = _conv_bn_net()
    # a BN of another width right after a layer (the layer is not what it normalises)
    odd = {"m.conv.weight": sd["block.expand.weight"]} | {k.replace("stem.bn", "m.bn"): v for k, v in sd.items()
                                                          if k.startswith("stem.bn")}
    imp = structural_importance(odd)
    assert imp["m.conv.weight"] == 1.0
    encode_model(odd)  # and the default encode goes through
    # statistics that are not finite, or far beyond float32's range
    nan_var = dict(sd, **{"block.bn0.running_var": np.full(5, np.nan, np.float32)})
    huge = dict(sd, **{"stem.bn.weight": np.full(4, 3e38, np.float32), "stem.bn.running_var": np.zeros(4, np.float32)})
    for model in (nan_var, huge):
        imp = structural_importance(model)
        for name, value in imp.items():
            assert np.all(np.isfinite(np.asarray(value))) and np.all(np.asarray(value) >= 0), name
    assert "block.bn0.running_var" not in structural_importance(nan_var)  # that BN gives no rule
    with pytest.warns(UserWarning, match="NaN"):
        encode_model(nan_var)
    encode_model(huge)
    # bfloat16 BN statistics are read as values, not as their 16-bit patterns
    t = {k: torch.from_numpy(v) for k, v in sd.items()}
    as_bf16 = structural_importance({k: v.to(torch.bfloat16) for k, v in t.items()})
    as_f32 = structural_importance({k: v.to(torch.bfloat16).to(torch.float32) for k, v in t.items()})
    assert set(as_bf16) == set(as_f32)
    for k in as_f32:
        np.testing.assert_allclose(np.asarray(as_bf16[k]), np.asarray(as_f32[k]), rtol=1e-6)


def test_embedding_tables_are_discounted_by_their_rows():
    rng = np.random.default_rng(1)
    sd = {"bert.embeddings.word_embeddings.weight": rng.normal(0, 1, (300, 8)).astype(np.float32),
          "bert.embeddings.position_embeddings.weight": rng.normal(0, 1, (16, 8)).astype(np.float32),
          "model.embed_tokens.weight": rng.normal(0, 1, (50, 8)).astype(np.float32),
          "transformer.wte.weight": rng.normal(0, 1, (40, 8)).astype(np.float32),
          "encoder.dense.weight": rng.normal(0, 1, (8, 8)).astype(np.float32),
          "encoder.dense.bias": rng.normal(0, 1, 8).astype(np.float32),
          "ids": np.arange(8, dtype=np.int64)}
    assert structural_importance(sd) == {"bert.embeddings.word_embeddings.weight": 1 / 300,
                                         "bert.embeddings.position_embeddings.weight": 1 / 16,
                                         "model.embed_tokens.weight": 1 / 50,
                                         "transformer.wte.weight": 1 / 40,
                                         "encoder.dense.weight": 1.0}


def test_a_tied_embedding_is_used_densely():
    emb = torch.nn.Parameter(torch.randn(64, 8))
    sd = {"embed_tokens.weight": emb, "lm_head.weight": emb, "proj.weight": torch.randn(8, 8)}
    assert structural_importance(sd) == {"embed_tokens.weight": 1.0, "proj.weight": 1.0}


def test_encode_model_default_is_structural_and_none_turns_it_off():
    rng = np.random.default_rng(2)
    sd = {"embeddings.word_embeddings.weight": rng.normal(0, 0.05, (512, 4)).astype(np.float32),
          "dense.weight": rng.normal(0, 0.05, (16, 16)).astype(np.float32),
          "dense.bias": rng.normal(0, 0.05, 16).astype(np.float32)}
    default = encode_model(sd, qp=-30)
    assert default == encode_model(sd, qp=-30, importance="structural")
    qps = {e.name: e.qp for e in read_stream_header(default).tensors}
    # 0.35 * log2(512) = 3.15 octaves, capped at 3: 12 qp steps at density 2; the dense layer keeps qp
    assert qps == {"embeddings.word_embeddings.weight": -30 + 12, "dense.weight": -30, "dense.bias": -30 - 24}
    plain = {e.name: e.qp for e in read_stream_header(encode_model(sd, qp=-30, importance=None)).tensors}
    assert plain == {"embeddings.word_embeddings.weight": -30, "dense.weight": -30, "dense.bias": -54}
    decoded = decode_model(default)
    assert set(decoded) == set(sd)


def test_one_number_per_tensor_only_moves_its_step():
    rng = np.random.default_rng(3)
    sd = {"a": rng.normal(0, 0.05, (32, 32)).astype(np.float32),
          "b": rng.normal(0, 0.05, (32, 32)).astype(np.float32)}
    data = encode_model(sd, qp=-30, importance={"a": 16.0, "b": 1.0})
    qps = {e.name: e.qp for e in read_stream_header(data).tensors}
    assert qps["a"] < qps["b"]  # more important: finer step
    # a number behaves as a uniform array of the tensor's shape
    assert data == encode_model(sd, qp=-30, importance={"a": np.full((32, 32), 16.0), "b": np.ones((32, 32))})
    with pytest.raises(ValueError, match="finite and non-negative"):
        encode_model(sd, importance={"a": -1.0})
    with pytest.raises(ValueError, match="structural"):
        encode_model(sd, importance="fisher")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dead=st.booleans())
def test_importance_is_finite_and_positive_for_any_statistics(seed, dead):
    sd = _conv_bn_net(seed % 1000)
    rng = np.random.default_rng(seed)
    for k in [k for k in sd if k.endswith(".running_var")]:
        sd[k] = (rng.uniform(0, 1e3, sd[k].shape) * (0 if dead else 1)).astype(np.float32)
    for k in [k for k in sd if k.endswith("bn0.weight") or k.endswith("bn1.weight")]:
        sd[k] = (rng.normal(0, 10, sd[k].shape) * (1e-30 if dead else 1)).astype(np.float32)
    for name, imp in structural_importance(sd).items():
        arr = np.asarray(imp)
        assert np.all(np.isfinite(arr)) and np.all(arr >= 0), name


def test_structural_importance_costs_at_most_one_float32_copy_of_the_layers():
    # 1x1 convolutions and a linear head: their (out, in) importance is as large as the weights;
    # no float64 products or per-tensor copies beyond that one float32 array may be kept
    import tracemalloc

    rng = np.random.default_rng(4)
    sd = {}
    width = 256
    for i in range(6):
        sd[f"b{i}.conv.weight"] = rng.normal(0, 0.05, (width, width, 1, 1)).astype(np.float32)
        sd |= _bn(f"b{i}.bn", width, rng)
    sd["head.weight"] = rng.normal(0, 0.05, (64, width)).astype(np.float32)
    layer_bytes = sum(v.nbytes for k, v in sd.items() if v.ndim >= 2)
    encode_model(sd, qp=-30, threads=1)  # compile outside the measurement
    peaks = {}
    for imp in ("structural", None):
        tracemalloc.start()
        try:
            encode_model(sd, qp=-30, threads=1, importance=imp)
            peaks[imp] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks["structural"] - peaks[None] < 1.5 * layer_bytes, (peaks, layer_bytes)


# --- bias correction: the mean output shift of the quantization error, taken out without data --------


def _relu_mean_by_integration(beta: float, gamma: float) -> float:
    z = np.linspace(beta - 12 * abs(gamma), beta + 12 * abs(gamma), 200_001)
    pdf = np.exp(-0.5 * ((z - beta) / gamma) ** 2) / (abs(gamma) * math.sqrt(2 * math.pi))
    return float(np.trapezoid(np.maximum(z, 0.0) * pdf, z))


def test_shift_absorbers_match_a_hand_computation():
    sd = _conv_bn_net(3)

    def mean_in(p):
        return np.array([_relu_mean_by_integration(b, g) for b, g in
                         zip(sd[f"{p}.bias"].astype(np.float64), sd[f"{p}.weight"].astype(np.float64))])

    want = {"block.expand.weight": (mean_in("stem.bn"), "block.bn0.running_mean"),
            "block.dw.weight": (mean_in("block.bn0"), "block.bn1.running_mean"),
            "head.weight": (mean_in("block.bn1"), "head.bias")}  # no BN after the head: its own bias
    got = shift_absorbers(sd)
    assert set(got) == set(want)  # the stem reads the input: nothing known about it
    for name, (m, target) in want.items():
        assert got[name][1] == target
        np.testing.assert_allclose(got[name][0], m, rtol=1e-6, atol=1e-12)


@given(seed=st.integers(0, 2**32 - 1), depthwise=st.booleans())
@settings(max_examples=30, deadline=None)
def test_output_shift_matches_a_loop(seed, depthwise):
    rng = np.random.default_rng(seed)
    out_c, in_c = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    kh, kw = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    shape = (out_c, 1, kh, kw) if depthwise else (out_c, in_c, kh, kw)
    w = rng.normal(0, 1, shape).astype(np.float32)
    dec = w + rng.normal(0, 0.1, shape)
    mean_in = rng.uniform(0, 2, out_c if depthwise else in_c)
    want = np.zeros(out_c)
    for c in range(out_c):
        for j in range(shape[1]):
            for a in range(kh):
                for b in range(kw):
                    want[c] += (float(dec[c, j, a, b]) - float(w[c, j, a, b])) * mean_in[c if depthwise else j]
    np.testing.assert_allclose(output_shift(w, dec, mean_in), want, rtol=1e-9, atol=1e-12)


def _step_of(data: bytes, name: str) -> float:
    e = next(e for e in read_stream_header(data).tensors if e.name == name)
    return step_from_qp(e.qp, e.qp_density)


@pytest.mark.parametrize("bn_eps", [None, 1e-3])
def test_encode_takes_the_estimated_shift_out(bn_eps):
    sd = _conv_bn_net(4)
    # (fine steps for the targets)
    kw = dict(qp=-14, qp_1d=-60, importance=None, quantizer="nearest", batchnorm_eps=bn_eps)
    on, off = encode_model(sd, **kw), encode_model(sd, bias_correction=False, **kw)
    assert encode_model(sd, threads=2, **kw) == on
    dec_on, dec_off = decode_model(on), decode_model(off)
    absorbers = shift_absorbers(sd)
    for name in ("block.expand.weight", "block.dw.weight", "head.weight", "stem.conv.weight"):
        np.testing.assert_array_equal(dec_on[name], dec_off[name])  # the layers are coded alike
    for layer, (mean_in, target) in absorbers.items():
        shift = output_shift(sd[layer], dec_on[layer], mean_in)
        if target.endswith(".bias"):
            moved, want = dec_on[target] - dec_off[target], -shift
        elif bn_eps is None:
            moved, want = dec_on[target] - dec_off[target], shift
        else:  # coarse statistics: the BN's bias takes it, scaled by the BN's gain
            module = target.rsplit(".", 1)[0]
            gain = sd[f"{module}.weight"] / np.sqrt(sd[f"{module}.running_var"].astype(np.float64) + bn_eps)
            target = f"{module}.bias"
            moved, want = dec_on[target] - dec_off[target], -gain * shift
        assert np.abs(want).max() > 10 * _step_of(on, target)  # (a shift worth taking out)
        # both streams round the target to its step
        assert np.all(np.abs(moved - want) <= 1.01 * _step_of(on, target)), target
    # quantize_model gives the levels encode_model codes
    q = quantize_model(sd, **kw)
    for name, qt in q.items():
        np.testing.assert_array_equal(np.asarray(qt.dequantize()), dec_on[name])


def test_bias_correction_shrinks_the_measured_mean_error():
    # conv -> BN -> relu -> conv -> BN: inputs as the first BN's statistics describe them; the mean
    # error of the second BN's output, with and without the correction (measured on samples)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(6, 16, 1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 24, 1, bias=False), torch.nn.BatchNorm2d(24))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.normal_(0, 1)
        net[4].weight.uniform_(0.5, 1.5)
    net.train()
    with torch.no_grad():
        for _ in range(200):  # statistics of the data the test uses
            net(torch.randn(64, 6, 1, 1) * 1.5 + 0.3)
    net.eval()
    sd = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    x = torch.randn(20_000, 6, 1, 1) * 1.5 + 0.3
    with torch.no_grad():
        ref = net(x)
    errors = {}
    for on in (True, False):
        dec = decode_model(encode_model(sd, qp=-16, qp_1d=-60, importance=None, bias_correction=on))
        net.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in dec.items()})
        with torch.no_grad():
            errors[on] = np.abs((net(x) - ref).mean((0, 2, 3)).numpy()).mean()
        net.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    assert errors[True] < 0.4 * errors[False], errors  # (0.043 against 0.176 when written)


def test_bias_correction_is_validated():
    with pytest.raises(TypeError, match="bias_correction"):
        encode_model(_conv_bn_net(), bias_correction="yes")
    with pytest.raises(TypeError, match="bias_correction"):
        quantize_model(_conv_bn_net(), bias_correction=1)


def test_running_variances_above_eps_never_decode_to_zero():
    # coarse qps give BatchNorm statistics coarse steps; a variance above the eps it is added to must
    # still decode above 0 (the channel's scale would jump), unless the user set the tensor's qp
    sd = _conv_bn_net(5)
    sd["block.bn0.running_var"] = np.array([0.004, 3.0, 0.5, 2e-4, 0.0], np.float32)
    for qp in (-16, -8, 0):
        for quantizer in ("trellis", "nearest"):
            var = np.asarray(decode_model(encode_model(sd, qp=qp, quantizer=quantizer))["block.bn0.running_var"])
            assert np.all(var[:3] > 0), (qp, quantizer, var)
    coarse = decode_model(encode_model(sd, qp=0, qp_overrides={"*.running_var": 0}))["block.bn0.running_var"]
    assert np.asarray(coarse)[0] == 0.0  # (the user's step wins)
