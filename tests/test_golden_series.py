"""Golden checkpoint series: files written by earlier and today's writers still extract to the
values they were written with, and today's writer reproduces today's file byte for byte.

``golden/series/v1.dcs`` was written by the version-1 writer (first moments in the log domain,
second moments as ratios), ``v2.dcs`` by the version-2 writer (first moments in the update domain,
second moments as log2 ratios, weights predicted from Adam's direction), ``v3.dcs`` and
``v3_adam.dcs`` by the version-3 writer (the weights' predicted residuals in their second moment's
scale), ``v4*.dcs`` by the version-4 writer (SGD's momentum buffers in the update domain as well);
``v5*.dcs`` by the version-5 writer (moments named by the state dict's structure); none is
regenerated. ``v6.dcs`` is today's format (a directory entry's carried files coded against its
parent's) with every weight at the series' qp, as the writer codes a series whose qp is given;
``v6_adam.dcs`` the same checkpoints at the writer's defaults (a weight with Adam state at Adam's
step size where that is coarser); ``v6_named.dcs`` the same with the state keyed by parameter
name, as torch.distributed.checkpoint keys it; ``v6_sgd.dcs`` checkpoints of SGD with momentum at
the defaults; ``v6_lossless.dcs`` the Adam checkpoints bit for bit (``v5_lossless.dcs``,
``v4_lossless.dcs``, ``v3_lossless.dcs``, ``v2_lossless.dcs``, ``v2_lossless_rans.dcs`` and
``v2_lossless_v8.dcs`` too, from earlier writers, the ``v2`` ones from before the float symbols
went by tANS and before float32's trailing zeros went into the symbol: never regenerated);
``v6_directory.dcs`` three checkpoint directories (a key and two residuals) whose tokenizer and
trainer state the residuals take from their parents. Each ``.npz`` holds every entry's extracted
tensors as ``"<entry>/<name>"``. Regenerate the ``v6`` files only for an intended change of the
format or of the writer's choices:

    DEEPCABAC_REGEN_GOLDEN=1 .venv/bin/python -m pytest -n 0 tests/test_golden_series.py
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import coded_steps, golden_floats

import deepcabac_py as dc
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint
from deepcabac_py.quant.steps import step_from_qp
from deepcabac_py.series.checkpoint_series import DEFAULT_SERIES_QP
from deepcabac_py.series.moments import UPDATE_QP

GOLDEN = Path(__file__).resolve().parent / "golden" / "series"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"
SETTINGS = {"key_every": 2}  # a key, a residual, a key
# today's writer's golden files and how it writes them
TODAYS: dict[str, dict] = {"v6": {"qp": DEFAULT_SERIES_QP}, "v6_adam": {}, "v6_named": {"named": True},
                           "v6_sgd": {"sgd": True}, "v6_lossless": {"keep_exact": True},
                           "v6_directory": {"directory": True, "key_every": 3}}


def series_checkpoints(sgd: bool = False, named: bool = False) -> list[dict]:
    """Three checkpoints of a two-parameter model with Adam's state (or SGD's), every value dyadic
    (the same bits on every machine): weights drifting, first moments fresh, second moments scaled;
    with ``named`` the state keyed by parameter name (torch.distributed.checkpoint's)."""
    out = []
    for i in range(3):
        w = golden_floats(40, (12, 10), -3) + golden_floats(41 + i, (12, 10), -9)
        b = golden_floats(50, (12,), -5) + golden_floats(51 + i, (12,), -10)
        state = {}
        for k, shape in enumerate(((12, 10), (12,))):
            m = golden_floats(60 + 10 * k + i, shape, -12)
            v = np.ldexp(np.abs(golden_floats(70 + 10 * k, shape, 0)) + 1.0, -30 + 2 * i)
            state[k] = ({"momentum_buffer": torch.from_numpy(np.ldexp(m, 6)).float()} if sgd else
                        {"step": torch.tensor(float(40 * (i + 1))), "exp_avg": torch.from_numpy(m).float(),
                         "exp_avg_sq": torch.from_numpy(v).float()})
        group = ({"lr": 0.05, "momentum": 0.9, "dampening": 0, "nesterov": False} if sgd
                 else {"lr": 0.002, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False})
        keys = ["0.weight", "0.bias"] if named else [0, 1]
        out.append({"model": {"0.weight": torch.from_numpy(w).float(), "0.bias": torch.from_numpy(b).float()},
                    "optimizer": {"state": {keys[k]: v for k, v in state.items()},
                                  "param_groups": [{**group, "weight_decay": 0, "params": keys}]},
                    "step": 40 * (i + 1)})
    return out


def series_directories(root: Path) -> list[Path]:
    """Three checkpoint-N/ directories as a Trainer writes them, small: weights drifting, the same
    tokenizer in each, a trainer state that grows by a log line, a config too short to share."""
    vocab = {f"piece{i:04d}": i for i in range(300)}
    out = []
    for i in range(3):
        d = root / f"checkpoint-{40 * (i + 1)}"
        d.mkdir(parents=True)
        w = golden_floats(40, (12, 10), -3) + golden_floats(41 + i, (12, 10), -9)
        save_checkpoint(flatten({"w": torch.from_numpy(w).float()}), d / "model.safetensors", kind="safetensors")
        (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "vocab": vocab}}, indent=2))
        log = [{"loss": 2.0 - k / 8, "step": 40 * (k + 1)} for k in range(i + 1)]
        (d / "trainer_state.json").write_text(json.dumps({"global_step": 40 * (i + 1), "log_history": log,
                                                          "max_steps": 120, "save_steps": 40}, indent=2))
        (d / "config.json").write_text(json.dumps({"layers": 1 + i}))
        out.append(d)
    return out


def extracted(path: Path) -> dict[str, np.ndarray]:
    series = dc.CheckpointSeries(path)
    arrays = {}
    for i in range(len(series)):
        for name, t in series.checkpoint(i).tensors.items():
            arrays[f"{i}/{name}"] = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return arrays


def write(path: Path, sgd: bool = False, named: bool = False, directory: bool = False, **settings) -> None:
    path.unlink(missing_ok=True)
    series = dc.CheckpointSeries(path, **{**SETTINGS, **settings})
    if directory:
        with tempfile.TemporaryDirectory() as tmp:
            for d in series_directories(Path(tmp)):
                series.append(d)
        return
    for c in series_checkpoints(sgd, named):
        series.append(c)


@pytest.fixture(scope="module", autouse=True)
def golden_files():
    if REGEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, settings in TODAYS.items():
            write(GOLDEN / f"{name}.dcs", **settings)
            if name != "v6_lossless":
                np.savez_compressed(GOLDEN / f"{name}.npz", **extracted(GOLDEN / f"{name}.dcs"))
    names = ("v1.dcs", "v1.npz", "v2.dcs", "v2.npz", "v3.dcs", "v3.npz", "v3_adam.dcs", "v3_adam.npz",
             "v4.dcs", "v4.npz", "v4_adam.dcs", "v4_adam.npz", "v4_sgd.dcs", "v4_sgd.npz",
             "v5.dcs", "v5.npz", "v5_adam.dcs", "v5_adam.npz", "v5_named.dcs", "v5_named.npz", "v5_sgd.dcs",
             "v5_sgd.npz", "v6.dcs", "v6.npz", "v6_adam.dcs", "v6_adam.npz", "v6_named.dcs", "v6_named.npz",
             "v6_sgd.dcs", "v6_sgd.npz", "v6_directory.dcs", "v6_directory.npz",
             "v2_lossless.dcs", "v2_lossless_rans.dcs", "v2_lossless_v8.dcs", "v3_lossless.dcs", "v4_lossless.dcs",
             "v5_lossless.dcs", "v6_lossless.dcs")
    missing = [n for n in names if not (GOLDEN / n).exists()]
    if missing:
        pytest.fail(f"golden series files missing: {missing}")


@pytest.mark.parametrize("name", ["v1", "v2", "v3", "v3_adam", "v4", "v4_adam", "v4_sgd", "v5", "v5_adam", "v5_named",
                                  "v5_sgd", "v6", "v6_adam", "v6_named", "v6_sgd", "v6_directory"])
def test_a_golden_series_extracts_to_its_values(name):
    path = GOLDEN / f"{name}.dcs"
    assert int.from_bytes(path.read_bytes()[8:10], "little") == int(name[1])
    with np.load(GOLDEN / f"{name}.npz", allow_pickle=False) as want:
        got = extracted(path)
        assert sorted(got) == sorted(want.files)
        for key in want.files:
            assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
            assert got[key].tobytes() == want[key].tobytes(), key  # (bit for bit)


@pytest.mark.parametrize("name", list(TODAYS))
def test_todays_writer_reproduces_the_golden_series(tmp_path, name):
    write(tmp_path / "again.dcs", **TODAYS[name])
    assert (tmp_path / "again.dcs").read_bytes() == (GOLDEN / f"{name}.dcs").read_bytes()


@pytest.mark.parametrize("name", ["v3", "v3_adam", "v4", "v4_adam", "v4_sgd", "v5", "v5_adam", "v5_named", "v5_sgd",
                                  "v6", "v6_adam", "v6_named", "v6_sgd"])
def test_the_golden_series_stays_close_to_its_checkpoints(name):
    # (the values are what the writer meant: the weights within the trellis's bound of twice the
    # step their stream names; the golden second moments vary less than twofold, so their scale
    # keeps the residuals within it)
    series = dc.CheckpointSeries(GOLDEN / f"{name}.dcs")
    steps = [coded_steps(GOLDEN / f"{name}.dcs", i) for i in range(len(series))]
    if name in ("v3", "v4", "v5", "v6"):  # (a qp given: every weight at it)
        assert all(steps[i][f"model.{k}"] == step_from_qp(DEFAULT_SERIES_QP) for i in range(3) for k in ("0.weight",))
    else:  # (these golden moments make the optimizer's steps far coarser than the series' qp)
        assert all(steps[i][f"model.{k}"] > step_from_qp(DEFAULT_SERIES_QP) for i in range(3)
                   for k in ("0.weight", "0.bias"))
    named = name in ("v5_named", "v6_named")
    for i, original in enumerate(series_checkpoints(sgd=name in ("v4_sgd", "v5_sgd", "v6_sgd"), named=named)):
        got = series[i]
        for name, t in original["model"].items():
            assert (got["model"][name].double() - t.double()).abs().max() <= 2 * steps[i][f"model.{name}"]
        for k, state in original["optimizer"]["state"].items():
            if "momentum_buffer" in state:  # (in the update domain: within twice its step times the rms)
                m, w = state["momentum_buffer"].double(), got["optimizer"]["state"][k]["momentum_buffer"].double()
                assert (w - m).abs().max() <= 2 * step_from_qp(UPDATE_QP) * m.pow(2).mean().sqrt()
                continue
            v, w = state["exp_avg_sq"].double(), got["optimizer"]["state"][k]["exp_avg_sq"].double()
            assert ((w - v).abs() / v).max() <= 0.2


def test_moments_keyed_by_parameter_name_are_coded_in_the_update_domain():
    # (before version 5 the series knew moments by the "state.<i>." of their names alone: state keyed
    # by parameter name, as torch.distributed.checkpoint keys it, was coded as ever, never in the
    # update domain and its weights at the series' qp)
    from deepcabac_py.series.records import SeriesFile

    with SeriesFile(GOLDEN / "v5_named.dcs") as f:
        domains = [sorted(r.meta["update_domain"]) for r in f.records]
    assert domains == [["optimizer.state.0.bias.exp_avg", "optimizer.state.0.weight.exp_avg"]] * 3


@pytest.mark.parametrize("name", ["v2_lossless_rans.dcs", "v2_lossless_v8.dcs", "v2_lossless.dcs",
                                  "v3_lossless.dcs", "v4_lossless.dcs", "v5_lossless.dcs", "v6_lossless.dcs"])
def test_a_golden_lossless_series_is_its_checkpoints_bit_for_bit(name):
    series = dc.CheckpointSeries(GOLDEN / name)
    for i, original in enumerate(series_checkpoints()):
        got = series[i]
        for name, t in original["model"].items():
            assert got["model"][name].numpy().tobytes() == t.numpy().tobytes()
        for k, state in original["optimizer"]["state"].items():
            for key, t in state.items():
                assert got["optimizer"]["state"][k][key].numpy().tobytes() == t.numpy().tobytes()



def test_a_golden_directory_series_restores_its_files_and_takes_the_carried_ones_from_parents(tmp_path):
    from deepcabac_py.series.records import SeriesFile

    series = dc.CheckpointSeries(GOLDEN / "v6_directory.dcs")
    for i, original in enumerate(series_directories(tmp_path / "in")):
        series.extract(i, tmp_path / f"out{i}")
        for name in ("tokenizer.json", "trainer_state.json", "config.json"):
            assert (tmp_path / f"out{i}" / name).read_bytes() == (original / name).read_bytes(), (i, name)
    with SeriesFile(GOLDEN / "v6_directory.dcs") as f:
        carried = [sorted(r.meta.get("carried", {})) for r in f.records]
    assert carried == [[], ["tokenizer.json", "trainer_state.json"], ["tokenizer.json", "trainer_state.json"]]
