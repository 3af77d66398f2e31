"""A file that is not what the command expects is named for what it is, never a bare number or a
temporary path; one wording per kind of error."""

from __future__ import annotations

import gzip
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from deepcabac_py import encode_model
from deepcabac_py.cli.main import main
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.files import save_checkpoint
from deepcabac_py.io.kinds import what_it_is

MODEL = {"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kinds")
    stream = encode_model(MODEL)
    (d / "m.dcb").write_bytes(stream)
    save_checkpoint(flatten(MODEL), d / "m.safetensors")
    for name, data in {"stream.pt": stream, "stream.safetensors": stream, "stream.npz": stream,
                       "text.pt": b"hello world\n", "text.safetensors": b"hello world, again\n",
                       "empty.pt": b"", "gz.pt": gzip.compress(b"x" * 100)}.items():
        (d / name).write_bytes(data)
    return d


@pytest.mark.parametrize("command, name, words", [
    (["encode"], "stream.pt", "is not a torch checkpoint: it is a deepcabac model stream (decode it"),
    (["encode"], "stream.safetensors", "is not a safetensors file: it is a deepcabac model stream"),
    (["encode"], "stream.npz", "is not an npz file: it is a deepcabac model stream"),
    (["encode"], "text.pt", "is not a torch checkpoint: it is text ('hello world')"),
    (["encode"], "text.safetensors", "is not a safetensors file: it is text ('hello world, again')"),
    (["encode"], "empty.pt", "is not a torch checkpoint: it is an empty file"),
    (["encode"], "gz.pt", "is not a torch checkpoint: it is gzip-compressed data (decompress it first)"),
    (["decode"], "m.safetensors", "not a deepcabac model stream: it is a safetensors file (a checkpoint? encode"),
    (["test"], "text.pt", "not a deepcabac model stream: it is text ('hello world')"),
    (["info"], "empty.pt", "not a deepcabac model stream: it is an empty file"),
])
def test_a_file_of_the_wrong_kind_is_named_for_what_it_is(files, tmp_path, command, name, words):
    out = ["-o", str(tmp_path / "out.x")] if command[0] in ("encode", "decode") else []
    args = [*command, str(files / name), *out]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepcabac: error: "), result.output
    assert words in lines[0], lines[0]
    assert "/tmp/deepcabac-" not in lines[0] and "Traceback" not in result.output


def test_stdin_errors_name_stdin_not_a_temporary_file(files):
    for data in (b"", (files / "text.pt").read_bytes()):
        done = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "encode", "-", "-o", "-"],
                              input=data, capture_output=True, timeout=120)
        err = done.stderr.decode()
        assert done.returncode == 1 and "<stdin>" in err and "deepcabac-" not in err, err


def test_a_missing_file_is_worded_alike_everywhere(tmp_path):
    missing = str(tmp_path / "nosuch.pt")
    for args in (["encode", missing], ["decode", missing + ".dcb", "-o", str(tmp_path / "x.pt")], ["info", missing],
                 ["report", missing], ["test", missing], ["update", "apply", missing, missing, "-o",
                                                          str(tmp_path / "y.pt")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert "no such file" in result.output and "No such file or directory" not in result.output, result.output


@pytest.mark.parametrize("head, words", [(b"", "an empty file"), (b"\x89DCU\r\n\x1a\n" + bytes(8), "update file"),
                                         (b"\x28\xb5\x2f\xfd" + bytes(8), "zstd-compressed"),
                                         (b"\x00\x01\x02\x03\xff\xfe" * 4, "no known kind")])
def test_what_it_is_names_the_common_kinds(head, words):
    assert words in what_it_is(head)
