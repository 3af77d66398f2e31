"""A closed pipe downstream (``deepcabac info x.dcb | head -1``) ends the command quietly with
status 0, wherever the output is written: text on stdout or a stream, a checkpoint, to ``-o -``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deepcabac_py import encode_model
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint

CLI = [sys.executable, "-m", "deepcabac_py.cli.main"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    where = tmp_path_factory.mktemp("pipe")
    # a line per tensor: info and report print more than a pipe's buffer (64 KiB) holds, so the
    # writer is still writing when the reader goes
    model = {f"layer{i}.weight": np.random.default_rng(i).normal(0, 0.05, (8, 8)).astype(np.float32)
             for i in range(1500)}
    save_checkpoint(flatten(model), where / "m.safetensors")
    (where / "m.dcb").write_bytes(encode_model(model))
    return where


def _first_line_then_close(args, stdin=None):
    """Run the command, read one line of its stdout, close the pipe; (status, stderr)."""
    proc = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=stdin if stdin is not None else subprocess.DEVNULL)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err


@pytest.mark.parametrize("args", [["info", "{d}/m.dcb"], ["report", "{d}/m.dcb"], ["info", "-"]])
def test_text_output_into_a_closed_pipe_exits_0_quietly(files, args):
    for _ in range(3):  # the reader may go before or after the first write
        with open(files / "m.dcb", "rb") as stdin:
            status, err = _first_line_then_close([a.format(d=files) for a in args], stdin=stdin)
        assert (status, err) == (0, "")


@pytest.mark.parametrize("args", [["encode", "{d}/m.safetensors", "-o", "-"],
                                  ["decode", "{d}/m.dcb", "-o", "-", "--format", "npz"]])
def test_binary_output_into_a_closed_pipe_exits_0_quietly(files, args):
    proc = subprocess.Popen(CLI + [a.format(d=files) for a in args] + ["-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    proc.stdout.close()  # gone before the first byte
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=120), err) == (0, "")
