"""code_model: the stream of encode_model together with what it decodes to, made from the levels as
they were coded, and tensors coded before taken as they were (what a checkpoint series codes
against)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepcabac_py as dc
from deepcabac_py.io.checkpoint import tensor_to_numpy
from deepcabac_py.model.container import Mode
from deepcabac_py.model.decoder import decode_checkpoint, read_stream_header
from deepcabac_py.model.encoder import code_model
from deepcabac_py.model.settings import EncodeSettings


def bits(t):
    arr, name, is_torch = tensor_to_numpy(t)
    return name, is_torch, arr.shape, arr.tobytes()


def checkpoint(seed: int = 0) -> dict:
    """Every way a tensor is coded: trellis, RDOQ and nearest floats (float32, float64, bfloat16,
    float16), a tall matrix of correlated columns (the linear prediction), BatchNorm layers (their
    shifts and compensation), integers, booleans, NaN (stored raw), a tied tensor, a 0-d and an
    empty one, and Adam's state (moments in the log domain, the step kept exact)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    basis = torch.randn(8, 48, generator=g)
    tall = (torch.randn(1200, 8, generator=g) @ basis) * 0.02 + torch.randn(1200, 48, generator=g) * 0.002
    fc = torch.randn(10, 256, generator=g) * 0.05
    model = {
        "conv.weight": torch.randn(16, 8, 3, 3, generator=g) * 0.1, "conv.bias": torch.randn(16, generator=g) * 0.01,
        "bn.weight": torch.rand(16, generator=g) + 0.5, "bn.bias": torch.randn(16, generator=g) * 0.1,
        "bn.running_mean": torch.randn(16, generator=g) * 0.1, "bn.running_var": torch.rand(16, generator=g) + 0.1,
        "bn.num_batches_tracked": torch.tensor(7), "fc.weight": fc, "fc.bias": torch.zeros(10), "tall": tall,
        "emb": (torch.randn(600, 64, generator=g) * 0.02).to(torch.bfloat16),
        "half": torch.randn(50, 40, generator=g).half(), "ids": torch.arange(100),
        "mask": torch.rand(30, generator=g) > 0.5,
        "bad": torch.tensor([1.0, float("nan"), 2.0]), "scalar": torch.tensor(0.25), "empty": torch.zeros(0, 3),
        "np64": rng.normal(size=(20, 30)), "tied": fc,
    }
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 256, generator=g) * 1e-3,
                               "exp_avg_sq": torch.rand(10, 256, generator=g) * 1e-6}},
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0]}]}
    return {"model": model, "optimizer": optimizer}


SETTINGS = [{}, {"quantizer": "rdoq"}, {"quantizer": "nearest"}, {"keep_exact": True},
            {"keep_exact": ["model.fc.*", "model.half"]}, {"batchnorm_eps": 1e-5},
            {"importance": None, "bias_correction": False, "qp": -40}, {"quantizer": "rdoq", "qp": -20, "qp_1d": -30}]


@pytest.mark.filterwarnings("ignore::deepcabac_py.errors.DeepCabacWarning")
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_stream_of_encode_model_and_what_it_decodes_to(settings, threads):
    ckpt = checkpoint()
    data = dc.encode_model(ckpt, threads=threads, **settings)
    coded = code_model(ckpt, EncodeSettings(**settings), threads=threads)
    assert coded.data == data
    decoded = decode_checkpoint(data)
    assert list(coded.decoded.tensors) == list(decoded.tensors)
    for name, t in decoded.tensors.items():
        assert bits(coded.decoded.tensors[name]) == bits(t), name
    assert coded.decoded.skeleton == decoded.skeleton and coded.decoded.aliases == decoded.aliases
    assert coded.decoded.kind == decoded.kind
    # (the modes this covers, so that no path goes untested by a change of the planner)
    modes = {e.mode for e in read_stream_header(data).tensors}
    if not settings:
        assert {Mode.DEPENDENT, Mode.LOG, Mode.RAW} <= modes
    if settings.get("quantizer") == "rdoq" and "qp" not in settings:
        assert any(e.is_linear for e in read_stream_header(data).tensors)


@pytest.mark.filterwarnings("ignore::deepcabac_py.errors.DeepCabacWarning")
def test_the_decoded_values_are_the_coders_own():
    """Nothing the caller holds is handed back: changing the input afterwards changes nothing."""
    ckpt = checkpoint()
    coded = code_model(ckpt, EncodeSettings(keep_exact=True))
    before = bits(coded.decoded.tensors["model.fc.weight"])
    ckpt["model"]["fc.weight"].add_(1.0)
    assert bits(coded.decoded.tensors["model.fc.weight"]) == before


@pytest.mark.filterwarnings("ignore::deepcabac_py.errors.DeepCabacWarning")
@pytest.mark.parametrize("settings", [{}, {"quantizer": "rdoq"}, {"keep_exact": True}])
def test_tensors_coded_before_are_taken_as_they_were(settings):
    ckpt = checkpoint()
    first = code_model(ckpt, EncodeSettings(**settings))
    moments = {n: t for n, t in first.tensors.items() if n.startswith("optimizer.")}
    # (another model's values under those names: what is reused is the coding, not the values)
    other = checkpoint(seed=1)
    other["model"] = ckpt["model"]
    again = code_model(other, EncodeSettings(**settings), reuse=moments)
    assert again.data == dc.encode_model({"model": ckpt["model"], "optimizer": {
        **other["optimizer"], "state": ckpt["optimizer"]["state"]}}, **settings)
    for name in moments:
        assert bits(again.decoded.tensors[name]) == bits(first.decoded.tensors[name])


@pytest.mark.filterwarnings("ignore::deepcabac_py.errors.DeepCabacWarning")
def test_a_tensor_reused_under_another_name_is_refused():
    ckpt = checkpoint()
    first = code_model(ckpt, EncodeSettings())
    with pytest.raises(ValueError, match="reused as"):
        code_model(ckpt, EncodeSettings(), reuse={"model.conv.bias": first.tensors["model.fc.bias"]})
