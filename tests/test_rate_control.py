"""Bit allocation across tensors, Fisher importance and rate control (a byte budget, a fidelity)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import laplace_weights

import deepcabac_py as dc
from deepcabac_py.model import allocation
from deepcabac_py.quant.steps import step_from_qp
from deepcabac_py.tuning.fisher import diagonal_fisher
from deepcabac_py.tuning.rate_control import encode_for_fidelity, encode_to_size


def test_allocation_follows_the_importance(monkeypatch):
    imp = {"a": np.full((8, 8), 1.0), "b": np.full((8, 8), 4.0), "c": np.full((8, 8), 0.25)}
    shapes = {k: v.shape for k, v in imp.items()}
    # the high-rate optimum: four times the importance, half the step (4 qp at density 2)
    monkeypatch.setattr(allocation, "ALLOCATION_EXPONENT", 0.5)
    qps = allocation.allocate_qps(imp, shapes, -30)
    # reference: geometric mean of the means (1): a keeps qp, b one octave finer, c one coarser
    assert qps == {"a": -30, "b": -34, "c": -26}
    steps = {k: step_from_qp(q) for k, q in qps.items()}
    assert steps["b"] == steps["a"] / 2 and steps["c"] == steps["a"] * 2
    # the default exponent is milder (measured on real models: noisy importance, low rates)
    monkeypatch.undo()
    qps = allocation.allocate_qps(imp, shapes, -30)
    offset = round(4 * allocation.ALLOCATION_EXPONENT * 2)
    assert qps == {"a": -30, "b": -30 - offset, "c": -30 + offset}


def test_allocation_is_bounded():
    imp = {"a": np.full((4, 4), 1.0), "huge": np.full((4, 4), 1e12), "bias": np.full((4,), 1e-12)}
    qps = allocation.allocate_qps(imp, {k: v.shape for k, v in imp.items()}, -30, qp_1d=-40)
    assert qps["huge"] >= -30 - 4 * allocation.MAX_OCTAVES
    assert qps["bias"] <= -30 + 4 * allocation.MAX_OCTAVES


def test_a_tensor_of_zero_importance_gets_the_coarsest_step():
    # e.g. a pooler that the calibration loss never reads: as coarse as the cap allows, not ignored
    imp = {"a": np.full((4, 4), 1.0), "unused": np.zeros((4, 4)), "unused_bias": np.zeros(4)}
    qps = allocation.allocate_qps(imp, {k: v.shape for k, v in imp.items()}, -30, qp_1d=-40)
    coarsest = -30 + 4 * allocation.MAX_OCTAVES
    assert qps == {"a": -30, "unused": coarsest, "unused_bias": coarsest}
    # negative or non-finite importance is no statement: such tensors keep their qp
    assert "bad" not in allocation.allocate_qps({"a": np.ones(3), "bad": np.array([np.nan, 1, 1])}, {}, -30)


def test_diagonal_fisher_is_the_mean_squared_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    batches = [torch.randn(6, 5) for _ in range(3)]

    def loss_fn(m, x):
        return (m(x) ** 2).sum()

    fisher = diagonal_fisher(model, batches, loss_fn)
    assert set(fisher) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        want = torch.zeros_like(p)
        for x in batches:
            g, = torch.autograd.grad(loss_fn(model, x), [p])
            want += g**2
        np.testing.assert_allclose(fisher[name], (want / 3).numpy(), rtol=1e-5)
    with pytest.raises(ValueError, match="no calibration"):
        diagonal_fisher(model, [], loss_fn)


@pytest.mark.parametrize("quantizer", ["trellis", "nearest"])
def test_rate_control_hits_the_budget(quantizer):
    model = {"a": laplace_weights(16, (96, 128), 0.05), "b": laplace_weights(17, (64, 64), 0.02)}
    reference = len(dc.encode_model(model, qp=-28, quantizer=quantizer))
    target = int(reference * 0.9)
    data = encode_to_size(model, target_bytes=target, quantizer=quantizer)
    assert len(data) <= target
    header = dc.read_stream_header(data)
    qp = header.qp
    if quantizer == "nearest":
        # within one qp step: the next finer qp would not fit
        assert len(dc.encode_model(model, qp=qp - 1, quantizer=quantizer)) > target
    else:
        assert len(data) >= 0.99 * target
    n = sum(v.size for v in model.values())
    bpw = 3.0
    data = encode_to_size(model, target_bpw=bpw, quantizer=quantizer)
    assert 8 * len(data) / n <= bpw


def test_rate_control_refuses_impossible_budgets():
    model = {"a": laplace_weights(18, (16, 16))}
    with pytest.raises(ValueError, match="budget"):
        encode_to_size(model, target_bytes=10)
    with pytest.raises(ValueError, match="exactly one"):
        encode_to_size(model)


def test_fidelity_search_finds_the_coarsest_qp_that_keeps_it():
    w = laplace_weights(19, (64, 64), 0.05)

    def snr(decoded):
        err = decoded["w"] - w
        return float(10 * np.log10(np.sum(w.astype(np.float64) ** 2) / np.sum(err.astype(np.float64) ** 2)))

    data = encode_for_fidelity({"w": w}, snr, 30.0)
    qp = dc.read_stream_header(data).qp
    assert snr(dc.decode_model(data)) >= 30.0
    assert snr(dc.decode_model(dc.encode_model({"w": w}, qp=qp + 1))) < 30.0
    with pytest.raises(ValueError, match="threshold"):
        encode_for_fidelity({"w": w}, snr, 1e9)
