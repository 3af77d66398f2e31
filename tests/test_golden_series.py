"""Golden checkpoint series: files written by earlier and today's writers still extract to the
values they were written with, and today's writer reproduces today's file byte for byte.

``golden/series/v1.dcs`` was written by the version-1 writer (first moments in the log domain,
second moments as ratios), ``v2.dcs`` by the version-2 writer (first moments in the update domain,
second moments as log2 ratios, weights predicted from Adam's direction); neither is regenerated.
``v3.dcs`` is today's (the weights' predicted residuals in their second moment's scale), and
``v3_lossless.dcs`` the same checkpoints bit for bit (``v2_lossless.dcs``, ``v2_lossless_rans.dcs`` and
``v2_lossless_v8.dcs`` too, from the version-2 writer, before the float symbols went by tANS and before
float32's trailing zeros went into the symbol: never regenerated). Each ``.npz`` holds every entry's extracted tensors
as ``"<entry>/<name>"``. Regenerate ``v3`` only for an intended format change:

    DEEPCABAC_REGEN_GOLDEN=1 .venv/bin/python -m pytest -n 0 tests/test_golden_series.py
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import golden_floats

import deepcabac_py as dc

GOLDEN = Path(__file__).resolve().parent / "golden" / "series"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"
SETTINGS = {"key_every": 2}  # a key, a residual, a key


def series_checkpoints() -> list[dict]:
    """Three checkpoints of a two-parameter model with Adam's state, every value dyadic (the same
    bits on every machine): weights drifting, first moments fresh, second moments scaled."""
    out = []
    for i in range(3):
        w = golden_floats(40, (12, 10), -3) + golden_floats(41 + i, (12, 10), -9)
        b = golden_floats(50, (12,), -5) + golden_floats(51 + i, (12,), -10)
        state = {}
        for k, shape in enumerate(((12, 10), (12,))):
            m = golden_floats(60 + 10 * k + i, shape, -12)
            v = np.ldexp(np.abs(golden_floats(70 + 10 * k, shape, 0)) + 1.0, -30 + 2 * i)
            state[k] = {"step": torch.tensor(float(40 * (i + 1))), "exp_avg": torch.from_numpy(m).float(),
                        "exp_avg_sq": torch.from_numpy(v).float()}
        out.append({"model": {"0.weight": torch.from_numpy(w).float(), "0.bias": torch.from_numpy(b).float()},
                    "optimizer": {"state": state, "param_groups": [{"lr": 0.002, "betas": (0.9, 0.999), "eps": 1e-8,
                                                                    "weight_decay": 0, "params": [0, 1]}]},
                    "step": 40 * (i + 1)})
    return out


def extracted(path: Path) -> dict[str, np.ndarray]:
    series = dc.CheckpointSeries(path)
    arrays = {}
    for i in range(len(series)):
        for name, t in series.checkpoint(i).tensors.items():
            arrays[f"{i}/{name}"] = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return arrays


def write(path: Path, **settings) -> None:
    path.unlink(missing_ok=True)
    series = dc.CheckpointSeries(path, **SETTINGS, **settings)
    for c in series_checkpoints():
        series.append(c)


@pytest.fixture(scope="module", autouse=True)
def golden_files():
    if REGEN:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        write(GOLDEN / "v3.dcs")
        np.savez_compressed(GOLDEN / "v3.npz", **extracted(GOLDEN / "v3.dcs"))
        write(GOLDEN / "v3_lossless.dcs", keep_exact=True)
    names = ("v1.dcs", "v1.npz", "v2.dcs", "v2.npz", "v3.dcs", "v3.npz", "v2_lossless.dcs", "v2_lossless_rans.dcs",
             "v2_lossless_v8.dcs", "v3_lossless.dcs")
    missing = [n for n in names if not (GOLDEN / n).exists()]
    if missing:
        pytest.fail(f"golden series files missing: {missing}")


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_golden_series_extracts_to_its_values(version):
    path = GOLDEN / f"v{version}.dcs"
    assert int.from_bytes(path.read_bytes()[8:10], "little") == version
    with np.load(GOLDEN / f"v{version}.npz", allow_pickle=False) as want:
        got = extracted(path)
        assert sorted(got) == sorted(want.files)
        for key in want.files:
            assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
            assert got[key].tobytes() == want[key].tobytes(), key  # (bit for bit)


def test_todays_writer_reproduces_the_golden_series(tmp_path):
    write(tmp_path / "again.dcs")
    assert (tmp_path / "again.dcs").read_bytes() == (GOLDEN / "v3.dcs").read_bytes()


def test_the_golden_series_stays_close_to_its_checkpoints():
    # (the values are what the writer meant: the weights within the trellis's step of the originals;
    # the golden second moments vary less than twofold, so their scale keeps the residuals within it)
    from deepcabac_py.quant.steps import step_from_qp
    from deepcabac_py.series.checkpoint_series import DEFAULT_SERIES_QP

    series = dc.CheckpointSeries(GOLDEN / "v3.dcs")
    for i, original in enumerate(series_checkpoints()):
        got = series[i]
        for name, t in original["model"].items():
            assert (got["model"][name].double() - t.double()).abs().max() <= 2 * step_from_qp(DEFAULT_SERIES_QP)
        for k, state in original["optimizer"]["state"].items():
            v, w = state["exp_avg_sq"].double(), got["optimizer"]["state"][k]["exp_avg_sq"].double()
            assert ((w - v).abs() / v).max() <= 0.2


@pytest.mark.parametrize("name", ["v2_lossless_rans.dcs", "v2_lossless_v8.dcs", "v2_lossless.dcs",
                                  "v3_lossless.dcs"])
def test_a_golden_lossless_series_is_its_checkpoints_bit_for_bit(name):
    series = dc.CheckpointSeries(GOLDEN / name)
    for i, original in enumerate(series_checkpoints()):
        got = series[i]
        for name, t in original["model"].items():
            assert got["model"][name].numpy().tobytes() == t.numpy().tobytes()
        for k, state in original["optimizer"]["state"].items():
            for key, t in state.items():
                assert got["optimizer"]["state"][k][key].numpy().tobytes() == t.numpy().tobytes()


def test_todays_writer_reproduces_the_golden_lossless_series(tmp_path):
    write(tmp_path / "again.dcs", keep_exact=True)
    assert (tmp_path / "again.dcs").read_bytes() == (GOLDEN / "v3_lossless.dcs").read_bytes()
