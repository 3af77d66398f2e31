"""Pictures and choices: ``sweep`` (size, bits, SNR, largest error and the user's own figure per
qp), ``report --plot``, and the report's words (one ratio where the two agree, modes and qps
explained, the stream's own names with -v)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepcabac_py import encode_model, load_checkpoint
from deepcabac_py.cli.main import main
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint

EVAL = '''
import numpy as np
def closeness(model):
    return {"mean_abs": float(np.abs(np.asarray(model["w"], dtype=np.float64)).mean()), "one": 1}
def words(model):
    return "good"
'''


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.safetensors"
    save_checkpoint(flatten({"w": rng.normal(0, 0.1, (32, 32)).astype(np.float32),
                             "b": rng.normal(0, 0.01, 32).astype(np.float32)}), path)
    (tmp_path / "ev.py").write_text(EVAL)
    return path


def test_sweep_gives_each_qp_what_encode_gives(model, tmp_path):
    r = CliRunner().invoke(main, ["sweep", str(model), "--qp", "-36:-20:8", "--json", "--eval",
                                  f"{tmp_path / 'ev.py'}:closeness", "--no-progress"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [row["qp"] for row in rows] == [-36, -28, -20]
    ckpt = load_checkpoint(model)
    for row in rows:
        assert row["bytes"] == len(encode_model(ckpt, qp=row["qp"]))
        assert set(row["eval"]) == {"mean_abs", "one"} and row["eval"]["one"] == 1.0
    assert rows[0]["bytes"] > rows[1]["bytes"] > rows[2]["bytes"]
    assert rows[0]["snr_db"] > rows[1]["snr_db"] > rows[2]["snr_db"]
    table = CliRunner().invoke(main, ["sweep", str(model), "--qp", "-30,-26", "--no-progress"])
    assert table.exit_code == 0 and len(table.output.strip().splitlines()) == 3


@pytest.mark.parametrize("args, code, words", [
    (["--qp", "-20:-30:4"], 2, "--qp"),
    (["--qp", "x"], 2, "--qp"),
    (["--eval", "nosuch.py:f"], 2, "--eval"),
    (["--eval", "{ev}:missing"], 2, "no function missing"),
    (["--eval", "{ev}:words"], 1, "must return a number or a dict"),
])
def test_sweep_refuses_what_it_cannot_run(model, tmp_path, args, code, words):
    args = [a.format(ev=tmp_path / "ev.py") for a in args]
    r = CliRunner().invoke(main, ["sweep", str(model), *args, "--no-progress"])
    assert r.exit_code == code and words in r.output, r.output
    assert "Traceback" not in r.output


def test_plots_are_pictures(model, tmp_path):
    r = CliRunner().invoke(main, ["sweep", str(model), "--qp", "-32:-24:4", "--plot", str(tmp_path / "rd.png"),
                                  "--eval", f"{tmp_path / 'ev.py'}:closeness", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = CliRunner().invoke(main, ["sweep", str(model), "--plot", str(tmp_path / "rd.png"), "--no-progress"])
    assert again.exit_code == 2 and "--force" in again.output
    r = CliRunner().invoke(main, ["report", str(model), "--plot", str(tmp_path / "rep.png"), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_plot_says_what_to_install(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = CliRunner().invoke(main, ["report", str(model), "--plot", str(tmp_path / "rep.png"), "--no-progress"])
    assert r.exit_code == 1
    assert "deepcabac-py[plot]" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "rep.png").exists()


def test_the_report_says_one_ratio_for_fp32_and_two_otherwise(model, tmp_path):
    text = CliRunner().invoke(main, ["report", str(model), "--no-progress"]).output
    total = [line for line in text.splitlines() if line.startswith("total:")][0]
    assert total.count("smaller") == 1 and "than the tensors in fp32" in total
    assert "modes: trellis = dependent quantization" in text and "qp per tensor: lower is a finer step" in text
    assert "DEPENDENT" not in text
    assert "DEPENDENT" in CliRunner().invoke(main, ["report", str(model), "-v", "--no-progress"]).output
    bf16 = tmp_path / "bf16.safetensors"
    save_checkpoint(flatten({"w": torch.randn(32, 32).to(torch.bfloat16)}), bf16)
    text = CliRunner().invoke(main, ["report", str(bf16), "--no-progress"]).output
    total = [line for line in text.splitlines() if line.startswith("total:")][0]
    assert "than the tensors in their own dtypes" in total and "than fp32" in total


def test_sweep_in_a_subprocess(model):
    done = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "sweep", str(model), "--qp", "-28",
                           "--no-progress"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].split()[0] == "-28"
