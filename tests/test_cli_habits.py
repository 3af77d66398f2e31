"""zstd's habits: several inputs (each beside itself, a line each, the others go on when one fails),
-c/--stdout, --rm, -k, the input's mode and time kept, -o refused with several inputs, the most
used options first in --help."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepcabac_py import decode_model
from deepcabac_py.cli.main import main
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint

MTIME = 1_600_000_000


def _model(seed):
    return {"w": np.random.default_rng(seed).normal(0, 0.1, (16, 16)).astype(np.float32)}


@pytest.fixture
def two(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.safetensors"
    torch.save({k: torch.from_numpy(v) for k, v in _model(1).items()}, a)
    save_checkpoint(flatten(_model(2)), b)
    for p in (a, b):
        os.utime(p, (MTIME, MTIME))
        os.chmod(p, 0o640)
    return a, b


def _runner():
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()


def test_several_inputs_each_beside_itself_a_line_each(two):
    a, b = two
    r = _runner().invoke(main, ["encode", str(a), str(b)])
    assert r.exit_code == 0, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(str(a)) and lines[1].startswith(str(b))
    for p in (a, b):
        out = p.with_name(p.name + ".dcb")
        assert out.exists() and p.exists()  # -k is the default
        assert os.stat(out).st_mtime == MTIME and os.stat(out).st_mode & 0o777 == 0o640
    os.remove(a)
    os.remove(b)
    r = _runner().invoke(main, ["decode", str(a) + ".dcb", str(b) + ".dcb", "-q"])
    assert r.exit_code == 0, r.output
    assert a.exists() and b.exists() and os.stat(a).st_mtime == MTIME
    info = _runner().invoke(main, ["info", str(a) + ".dcb", str(b) + ".dcb"])
    assert info.exit_code == 0 and info.stdout.count("== ") == 2


def test_one_failing_input_does_not_stop_the_others(two, tmp_path):
    a, b = two
    bad = tmp_path / "bad.pt"
    bad.write_text("not a checkpoint")
    r = _runner().invoke(main, ["encode", str(a), str(bad), str(b), "-q"])
    assert r.exit_code == 1
    errors = r.stderr.strip().splitlines()
    assert len(errors) == 1 and "bad.pt" in errors[0] and errors[0].startswith("deepcabac: error: ")
    assert (tmp_path / "a.pt.dcb").exists() and (tmp_path / "b.safetensors.dcb").exists()
    assert not (tmp_path / "bad.pt.dcb").exists()


@pytest.mark.parametrize("args", [["-o", "x.dcb"], ["-c"]])
def test_one_output_for_several_inputs_is_a_usage_error(two, args):
    a, b = two
    r = _runner().invoke(main, ["encode", str(a), str(b), *args])
    assert r.exit_code == 2 and "several inputs" in r.output


def test_stdout_is_the_file_the_output_would_be(two, tmp_path):
    a, _ = two
    r = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "encode", str(a), "-c", "-q"],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _runner().invoke(main, ["encode", str(a), "-q"]).exit_code == 0
    assert r.stdout == (tmp_path / "a.pt.dcb").read_bytes()


def test_rm_removes_the_input_after_a_checked_write(two, tmp_path):
    a, b = two
    r = _runner().invoke(main, ["encode", str(a), "--rm", "-q"])
    assert r.exit_code == 0, r.output
    assert not a.exists() and (tmp_path / "a.pt.dcb").exists()
    r = _runner().invoke(main, ["decode", str(tmp_path / "a.pt.dcb"), "--rm", "-q"])
    assert r.exit_code == 0, r.output
    assert a.exists() and not (tmp_path / "a.pt.dcb").exists()
    assert np.allclose(decode_model(_runner().invoke(main, ["encode", str(b), "-c", "-q"]).stdout_bytes)["w"],
                       _model(2)["w"], atol=0.01)
    for args in (["--rm", "-k"], ["--rm", "-c"]):
        r = _runner().invoke(main, ["encode", str(b), *args])
        assert r.exit_code == 2 and b.exists(), r.output


def test_rm_keeps_the_input_when_the_output_fails(two, tmp_path):
    a, _ = two
    (tmp_path / "a.pt.dcb").write_bytes(b"in the way")
    r = _runner().invoke(main, ["encode", str(a), "--rm"])
    assert r.exit_code == 1 and a.exists()


def test_the_most_used_options_come_first_and_qp_is_explained():
    text = _runner().invoke(main, ["encode", "--help"]).output
    order = [text.index(opt) for opt in ("-o, --output", "--qp INTEGER", "--quantizer", "-c, --stdout",
                                         "--input-format", "--target-bpw")]
    assert order == sorted(order), text
    assert "Lower is finer: more bytes, less error" in " ".join(text.split())
