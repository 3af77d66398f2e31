"""BatchNorm: coarse running statistics with compensating weight/bias, and recalibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import deepcabac_py as dc
from deepcabac_py.cli.main import main as cli
from deepcabac_py.errors import CheckpointError
from deepcabac_py.model import batchnorm
from deepcabac_py.quant.steps import QP_MAX
from deepcabac_py.tuning import recalibration

EPS = 1e-3


def _eval_map(state, module, eps=EPS):
    """(a, b) of the layer's eval-mode map y = a x + b, in float64."""
    g, b, m, v = (np.asarray(state[f"{module}.{s}"], dtype=np.float64)
                  for s in ("weight", "bias", "running_mean", "running_var"))
    a = g / np.sqrt(v + eps)
    return a, b - a * m


def _conv_bn_state(seed: int, channels: int = 24) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": (rng.standard_normal((channels, 8, 3, 3)) * 0.1).astype(np.float32),
        "bn.weight": rng.uniform(0.2, 3.0, channels).astype(np.float32),
        "bn.bias": rng.standard_normal(channels).astype(np.float32),
        "bn.running_mean": (rng.standard_normal(channels) * 2).astype(np.float32),
        "bn.running_var": np.exp(rng.uniform(-6, 3, channels)).astype(np.float32),
        "bn.num_batches_tracked": np.array(1000, dtype=np.int64),
        "fc.weight": (rng.standard_normal((10, channels)) * 0.2).astype(np.float32),
        "fc.bias": (rng.standard_normal(10) * 0.1).astype(np.float32),
    }


# --- the compensation itself ----------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), step=st.sampled_from([1e-3, 0.05, 0.5]),
       eps=st.sampled_from([1e-5, 1e-3, 0.1]))
def test_compensate_keeps_the_eval_map(seed, step, eps):
    rng = np.random.default_rng(seed)
    n = 16
    g, b, m = rng.standard_normal(n) * 2, rng.standard_normal(n), rng.standard_normal(n) * 3
    v = np.exp(rng.uniform(-8, 4, n))
    mc, vc = np.round(m / step) * step, np.round(v / step) * step  # may round a variance to 0
    new = batchnorm.compensate(g, b, m, v, mc, vc, eps)
    assert new is not None
    a0, b0 = g / np.sqrt(v + eps), b - g / np.sqrt(v + eps) * m
    a1 = new[0] / np.sqrt(vc + eps)
    b1 = new[1] - a1 * mc
    np.testing.assert_allclose(a1, a0, rtol=1e-12)
    np.testing.assert_allclose(b1, b0, rtol=1e-12, atol=1e-12 * (1 + np.abs(b0).max()))


@given(st.floats(1e-12, 1e12), st.integers(-120, 40), st.integers(0, 4))
def test_coarsest_qp_is_the_largest_qp_within_the_step(step, qp, density):
    got = batchnorm._coarsest_qp(step, qp, density)
    if dc.step_from_qp(qp, density) >= step:
        assert got == qp
    else:
        assert got >= qp and dc.step_from_qp(got, density) <= step
        assert got == QP_MAX or dc.step_from_qp(got + 1, density) > step


def test_statistics_qps_follow_the_layer_not_qp():
    rng = np.random.default_rng(7)
    mean = rng.standard_normal(64)
    var = np.exp(rng.uniform(-2, 2, 64))
    q_mean, q_var = batchnorm.statistics_qps(mean, var, EPS, -40)
    typical = float(np.median(var + EPS))
    for qp, target in ((q_mean, batchnorm.STAT_PRECISION * typical ** 0.5),
                       (q_var, 2 * batchnorm.STAT_PRECISION * typical)):
        assert dc.step_from_qp(qp, 2) <= target < dc.step_from_qp(qp + 1, 2)
    # the same statistics scaled by 16 (their standard deviation by 4): two octaves coarser means,
    # four octaves coarser variances
    assert batchnorm.statistics_qps(4 * mean, 16 * var, 16 * EPS, -40) == (q_mean + 8, q_var + 16)
    # never finer than qp, and qp for a layer with nothing finite to go by
    assert batchnorm.statistics_qps(mean, var, EPS, 0) == (0, 0)
    assert batchnorm.statistics_qps(mean, np.full(64, np.nan), EPS, -40) == (-40, -40)
    assert batchnorm.statistics_qps(np.full(64, np.inf), var, EPS, -40) == (-40, -40)


def test_compensate_refuses_impossible_variances():
    one = np.ones(3)
    assert batchnorm.compensate(one, one, one, np.array([1.0, -1.0, 1.0]), one, one, EPS) is None
    assert batchnorm.compensate(one, one, one, one, one, np.array([1.0, np.nan, 1.0]), EPS) is None


# --- encode_model(batchnorm_eps=...) ------------------------------------------------------------


@pytest.mark.parametrize("importance", ["structural", None])
@pytest.mark.parametrize("quantizer", ["trellis", "nearest"])
def test_exact_weight_and_bias_keep_the_function(importance, quantizer):
    # weight and bias stored exactly: the layer's function survives to float32 rounding while its
    # statistics are coded at the step of qp (structural importance makes the statistics' levels
    # depend on weight: they must be the levels the compensation used)
    state = _conv_bn_state(0)
    kw = dict(qp=-20, quantizer=quantizer, importance=importance, keep_exact=["bn.weight", "bn.bias"])
    data = dc.encode_model(state, batchnorm_eps=EPS, **kw)
    out = dc.decode_model(data)
    a0, b0 = _eval_map(state, "bn")
    a1, b1 = _eval_map(out, "bn")
    np.testing.assert_allclose(a1, a0, rtol=2e-6)
    np.testing.assert_allclose(b1, b0, rtol=2e-6, atol=2e-6 * np.abs(b0).max())
    qps = batchnorm.statistics_qps(state["bn.running_mean"], state["bn.running_var"], EPS, -20)
    for stat, qp in zip(("running_mean", "running_var"), qps):
        err = np.abs(out[f"bn.{stat}"].astype(np.float64) - state[f"bn.{stat}"])
        assert err.max() > 0  # coarse ...
        assert err.max() <= 2 * dc.step_from_qp(qp, 2)  # ... but within the trellis' effective step
    assert len(data) < len(dc.encode_model(state, **kw))


def test_only_the_batchnorm_tensors_change():
    state = _conv_bn_state(1)
    plain = dc.quantize_model(state, qp=-24)
    comp = dc.quantize_model(state, qp=-24, batchnorm_eps=EPS)
    for name in ("conv.weight", "fc.weight", "fc.bias", "bn.num_batches_tracked"):
        assert np.array_equal(plain[name].levels, comp[name].levels), name
        assert plain[name].step == comp[name].step
    qps = batchnorm.statistics_qps(state["bn.running_mean"], state["bn.running_var"], EPS, -24)
    assert comp["bn.running_mean"].step == dc.step_from_qp(qps[0], 2)
    assert comp["bn.running_var"].step == dc.step_from_qp(qps[1], 2)
    # what quantize_model reports is what the stream decodes to
    out = dc.decode_model(dc.encode_model(state, qp=-24, batchnorm_eps=EPS))
    for name, q in comp.items():
        assert np.array_equal(np.asarray(q.dequantize()), out[name]), name


def test_function_error_is_that_of_weight_and_bias():
    # quantized weight/bias: the function's error comes from their steps alone, so it is no larger
    # than with the statistics coded finely (qp_1d)
    state = _conv_bn_state(2)
    a0, b0 = _eval_map(state, "bn")
    comp = dc.decode_model(dc.encode_model(state, qp=-24, importance=None, batchnorm_eps=EPS))
    fine = dc.decode_model(dc.encode_model(state, qp=-24, importance=None))
    err = lambda out: np.abs(_eval_map(out, "bn")[0] / a0 - 1).max()  # noqa: E731
    assert err(comp) <= 2 * err(fine) + 1e-6


def test_mapping_of_epsilons_and_torch_tensors():
    state = {k: torch.from_numpy(v.copy()) for k, v in _conv_bn_state(3).items()}
    out = dc.decode_model(dc.encode_model(state, qp=-24, batchnorm_eps={"bn": 1e-5},
                                          keep_exact=["bn.weight", "bn.bias"]))
    assert isinstance(out["bn.weight"], torch.Tensor)
    a0, _ = _eval_map({k: v.numpy() for k, v in state.items()}, "bn", 1e-5)
    a1, _ = _eval_map({k: v.numpy() for k, v in out.items()}, "bn", 1e-5)
    np.testing.assert_allclose(a1, a0, rtol=2e-6)


def test_bad_arguments_and_bad_statistics():
    state = _conv_bn_state(4)
    for bad in (0.0, -1e-5, float("nan"), float("inf"), True, "1e-5"):
        with pytest.raises(ValueError, match="batchnorm_eps"):
            dc.encode_model(state, batchnorm_eps=bad)
    with pytest.raises(ValueError, match="no BatchNorm layer.*nope"):
        dc.encode_model(state, batchnorm_eps={"nope": 1e-5})
    state["bn.running_var"][3] = -1.0
    with pytest.raises(CheckpointError, match="bn: running_var"):
        dc.encode_model(state, batchnorm_eps=EPS)
    # a model without BatchNorm layers is coded as without the option
    plain = {k: v for k, v in state.items() if not k.startswith("bn.")}
    assert dc.encode_model(plain, qp=-24, batchnorm_eps=EPS) == dc.encode_model(plain, qp=-24)


def test_cli_bn_eps(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, **_conv_bn_state(5))
    runner = CliRunner()
    for extra, name in (([], "plain.dcb"), (["--bn-eps", "1e-3"], "bn.dcb")):
        r = runner.invoke(cli, ["encode", str(path), "-o", str(tmp_path / name), "--qp", "-24", "-q", *extra])
        assert r.exit_code == 0, r.output
    out = dc.decode_model((tmp_path / "bn.dcb").read_bytes())
    state = _conv_bn_state(5)
    qp_var = batchnorm.statistics_qps(state["bn.running_mean"], state["bn.running_var"], 1e-3, -24)[1]
    assert np.abs(out["bn.running_var"] - state["bn.running_var"]).max() <= 2 * dc.step_from_qp(qp_var, 2)
    r = runner.invoke(cli, ["encode", str(path), "-o", str(tmp_path / "x.dcb"), "--bn-eps", "0"])
    assert r.exit_code == 2


# --- recalibration ----------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8, eps=1e-3)
        self.conv2 = torch.nn.Conv2d(8, 12, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(12)
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _trained_net(seed=0):
    torch.manual_seed(seed)
    net = _Net()
    net.train()
    with torch.no_grad():
        for _ in range(20):  # running statistics of some data
            net(torch.randn(16, 3, 8, 8) * 2 + 0.5)
    return net.eval()


def _numpy_state(net):
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def test_recalibrate_matches_input_moments():
    net = _trained_net()
    original = _numpy_state(net)
    x = torch.randn(32, 3, 8, 8) * 2 + 0.5
    # unchanged weights: nothing to correct
    same = recalibration.recalibrate(net, original, original, x)
    for k, v in same.items():
        np.testing.assert_allclose(v, original[k], rtol=1e-5, atol=1e-6)
    # perturbed first convolution: bn1's statistics follow its input's moments (computed here
    # independently from the convolution's outputs)
    quantized = dict(original)
    rng = np.random.default_rng(0)
    quantized["conv1.weight"] = (original["conv1.weight"] * 1.3
                                 + rng.standard_normal(original["conv1.weight"].shape) * 0.05).astype(np.float32)
    new = recalibration.recalibrate(net, original, quantized, [x[:16], x[16:]])
    conv = lambda w: torch.nn.functional.conv2d(x.double(), torch.from_numpy(w).double(), padding=1)  # noqa: E731
    zo, zq = conv(original["conv1.weight"]), conv(quantized["conv1.weight"])
    mo, mq = zo.mean((0, 2, 3)).numpy(), zq.mean((0, 2, 3)).numpy()
    vo, vq = zo.var((0, 2, 3), unbiased=False).numpy(), zq.var((0, 2, 3), unbiased=False).numpy()
    rv = original["bn1.running_var"].astype(np.float64)
    floor = recalibration.VAR_FLOOR * rv + 1e-12
    shifted = original["bn1.running_mean"] + recalibration.MEAN_SHIFT * (mq - mo)
    np.testing.assert_allclose(new["bn1.running_mean"], shifted, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new["bn1.running_var"], rv * (vq + floor) / (vo + floor), rtol=1e-5)
    assert not net.training


def test_encode_recalibrated_moves_only_statistics():
    net = _trained_net(1)
    state = _numpy_state(net)
    x = torch.randn(24, 3, 8, 8) * 2 + 0.5
    data = recalibration.encode_recalibrated(net, x, qp=-18, importance=None)
    plain = dc.encode_model(state, qp=-18, importance=None, batchnorm_eps=batchnorm.epsilons(net))
    q_new, q_plain = dc.decode_levels(data), dc.decode_levels(plain)
    for name in ("conv1.weight", "conv2.weight", "fc.weight"):
        assert np.array_equal(q_new[name].levels, q_plain[name].levels), name
    assert any(not np.array_equal(q_new[n].levels, q_plain[n].levels)
               for n in ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"))
    # the model is given back with its own weights
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), state[k])
    assert batchnorm.epsilons(net) == {"bn1": 1e-3, "bn2": 1e-5}
    # a state of torch tensors gives the same stream and decodes to torch tensors
    as_torch = recalibration.encode_recalibrated(net, x, state=dict(net.state_dict()), qp=-18, importance=None)
    out = dc.decode_model(as_torch)
    assert isinstance(out["bn1.running_var"], torch.Tensor)
    np.testing.assert_array_equal(out["conv1.weight"].numpy(), dc.decode_model(data)["conv1.weight"])


def test_recalibrate_needs_batchnorm_and_inputs():
    lin = torch.nn.Linear(3, 2)
    st_ = _numpy_state(lin)
    with pytest.raises(ValueError, match="no BatchNorm"):
        recalibration.recalibrate(lin, st_, st_, torch.zeros(1, 3))
    stateless = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4, track_running_stats=False))
    assert batchnorm.epsilons(stateless) == {}
    with pytest.raises(ValueError, match="no BatchNorm"):
        recalibration.recalibrate(stateless, _numpy_state(stateless), _numpy_state(stateless), torch.zeros(1, 3, 2, 2))
    net = _trained_net()
    with pytest.raises(ValueError, match="no calibration inputs"):
        recalibration.recalibrate(net, _numpy_state(net), _numpy_state(net), [])
