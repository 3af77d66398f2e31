"""A name or pattern that matches no tensor is an error, never a silent no-op: qp overrides and
exact patterns when encoding (ValueError in Python, exit 2 naming the option and the pattern in the
CLI), tensor selections when decoding."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from deepcabac_py import decode_model, encode_model, quantize_model
from deepcabac_py.cli.main import main
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint

MODEL = {"enc.0.weight": np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16),
         "enc.0.bias": np.linspace(-0.1, 0.1, 16, dtype=np.float32)}


@pytest.mark.parametrize("settings, words", [
    ({"qp_overrides": {"nosuch": -20}}, ["qp_overrides", "'nosuch'"]),
    ({"qp_overrides": {"enc.*": -20, "dec.*": -30}}, ["qp_overrides", "'dec.*'"]),
    ({"keep_exact": "nosuch*"}, ["keep_exact", "'nosuch*'"]),
    ({"keep_exact": ["enc.0.bias", "enc.1.*"]}, ["keep_exact", "'enc.1.*'"]),
])
def test_python_refuses_a_pattern_that_matches_nothing(settings, words):
    for call in (encode_model, quantize_model):
        with pytest.raises(ValueError) as info:
            call(MODEL, **settings)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_patterns_that_match_are_used():
    plain = encode_model(MODEL)
    assert encode_model(MODEL, qp_overrides={"enc.*.weight": -20}) != plain
    assert encode_model(MODEL, keep_exact="enc.0.bias") != plain
    exact = decode_model(encode_model(MODEL, keep_exact=["enc.0.*"]))
    assert all(np.array_equal(exact[n], MODEL[n]) for n in MODEL)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(flatten(MODEL), path)
    return path


@pytest.mark.parametrize("args, words", [
    (["--qp-tensor", "nosuch=-20"], ["--qp-tensor", "'nosuch'"]),
    (["--exact", "nosuch*"], ["--exact", "'nosuch*'"]),
])
@pytest.mark.parametrize("command", ["encode", "report"])
def test_the_cli_refuses_a_pattern_that_matches_nothing(model_file, tmp_path, command, args, words):
    out = ["-o", str(tmp_path / "x.dcb")] if command == "encode" else []
    result = CliRunner().invoke(main, [command, str(model_file), *out, *args])
    assert result.exit_code == 2, result.output
    assert all(w in result.output for w in words), result.output
    assert not (tmp_path / "x.dcb").exists()


def test_the_cli_refuses_it_in_a_subprocess_too(model_file, tmp_path):
    done = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "encode", str(model_file),
                           "-o", str(tmp_path / "x.dcb"), "--qp-tensor", "nosuch=-20"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--qp-tensor: 'nosuch' matches no tensor" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.dcb").exists()
