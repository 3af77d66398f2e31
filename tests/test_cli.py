"""The ``deepcabac`` command line, in process through click's CliRunner and as real subprocesses.

Every test works on copies of the reference model in ``tmp_path`` (``models/`` is never written).
"""

from __future__ import annotations

import errno
import importlib.metadata
import io
import json
import os
import select
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepcabac_py import decode_model, read_stream_header
from deepcabac_py.cli.main import main
from deepcabac_py.io.checkpoint import flatten, tensor_to_numpy
from deepcabac_py.io.files import load_checkpoint
from deepcabac_py.model.allocation import allocate_qps
from deepcabac_py.model.container import Mode
from deepcabac_py.model.structural_importance import structural_importance

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
MAGIC = b"\x89DCB\r\n\x1a\n"
CONSOLE_SCRIPT = Path(sys.executable).with_name("deepcabac")
CLICK_VERSION = tuple(int(p) for p in importlib.metadata.version("click").split(".")[:2])
SUBPROCESS_TIMEOUT = 120


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _runner() -> CliRunner:
    # click < 8.2 mixes stderr into stdout unless told not to; 8.2+ always keeps them apart.
    if CLICK_VERSION < (8, 2):
        return CliRunner(mix_stderr=False)
    return CliRunner()


class _TtyStdoutRunner(CliRunner):
    """A CliRunner whose fake stdout claims to be a terminal."""

    def isolation(self, *args, **kwargs):
        from contextlib import contextmanager

        parent = super().isolation

        @contextmanager
        def wrapped():
            with parent(*args, **kwargs) as streams:
                sys.stdout.isatty = lambda: True
                yield streams

        return wrapped()


def run(args, input=None, runner=None):
    """Invoke the CLI in process; any exception other than SystemExit is a test failure."""
    runner = runner or _runner()
    result = runner.invoke(main, [str(a) for a in args], input=input, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(*result.exc_info))
        pytest.fail(f"deepcabac {' '.join(map(str, args))} raised:\n{tb}\nstderr: {result.stderr}")
    return result


def ok(args, input=None):
    result = run(args, input=input)
    assert result.exit_code == 0, (args, result.stdout, result.stderr)
    return result


def assert_error(result, words=(), code=1):
    """Exit ``code``, exactly one line on stderr (``deepcabac: error: ...``), nothing on stdout."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("deepcabac: error: "), lines[0]
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])
    assert result.stdout_bytes == b""
    return lines[0]


def assert_usage_error(result, words=()):
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert "Usage:" in result.stderr
    assert result.stdout_bytes == b""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:"), result.stderr
    for w in words:
        assert w.lower() in last.lower(), (w, last)


def no_temp_files(directory: Path) -> None:
    leftovers = [p.name for p in directory.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    assert leftovers == [], leftovers


def flat_tensors(obj) -> dict:
    return flatten(obj).tensors


def assert_tensors_identical(got: dict, want: dict) -> None:
    """Same names, dtype names, shapes and bits (torch tensors and numpy arrays compare alike)."""
    assert sorted(got) == sorted(want)
    for name in want:
        a, da, _ = tensor_to_numpy(got[name])
        b, db, _ = tensor_to_numpy(want[name])
        assert da == db, name
        assert a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


def make_npz(path: Path) -> None:
    rng = np.random.default_rng(7)
    np.savez(
        path,
        conv=rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
        fc=rng.standard_normal((10, 32)).astype(np.float32),
        bias=rng.standard_normal(10).astype(np.float32),
        half=rng.standard_normal((6, 5)).astype(np.float16),
        steps=np.array(1234, dtype=np.int64),
        mask=rng.random(20) > 0.5,
    )


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    shutil.copy(MODELS / "digits_cnn.safetensors", d / "model.safetensors")
    shutil.copy(MODELS / "digits_cnn.pt", d / "model.pt")
    make_npz(d / "model.npz")
    return d


def _read_pty(master: int, timeout: float = 2.0) -> bytes:
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            return out
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the slave side is closed
            return out
        if not chunk:
            return out
        out += chunk


def _pty(columns: int = 100):
    pty = pytest.importorskip("pty")
    fcntl = pytest.importorskip("fcntl")
    termios = pytest.importorskip("termios")
    try:
        master, slave = pty.openpty()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal available: {exc}")
    # A pty starts at 0x0; tqdm draws nothing on a zero-width terminal.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, slave


def _module_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "deepcabac_py.cli.main", *map(str, args)]


def _script_cmd(*args) -> list[str]:
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    return [str(CONSOLE_SCRIPT), *map(str, args)]


# --------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, name",
                         [("safetensors", "model.safetensors"), ("torch", "model.pt"), ("npz", "model.npz")])
def test_encode_info_decode_round_trip(model_dir, kind, name):
    src = model_dir / name
    original = load_checkpoint(src)

    result = ok(["encode", src])
    stream_path = model_dir / (name + ".dcb")  # default output: INPUT.dcb
    assert stream_path.is_file()
    assert result.stdout_bytes == b""
    assert "bits/param" in result.stderr  # the one-line summary goes to stderr
    data = stream_path.read_bytes()
    assert data.startswith(MAGIC)
    header = read_stream_header(data)
    assert header.metadata.get("kind") == kind
    assert header.total_size == len(data)

    info = ok(["info", stream_path])
    assert f"original kind {kind}" in info.stdout
    assert f"{len(data):,} bytes" in info.stdout
    for tensor_name in original.tensors:
        assert tensor_name in info.stdout

    ok(["test", stream_path])

    # decode strips .dcb: move the original away first (the decoded name is the input's name).
    src.rename(model_dir / ("orig-" + name))
    ok(["decode", stream_path])
    assert src.is_file()
    expected = decode_model(data)
    assert load_checkpoint(src).kind == kind
    assert_tensors_identical(load_checkpoint(src).tensors, flat_tensors(expected))
    if kind == "torch":
        restored = torch.load(src, weights_only=True)
        assert restored["epoch"] == 40 == expected["epoch"]
        assert restored["eval_accuracy"] == expected["eval_accuracy"]
        assert set(restored) == {"state_dict", "epoch", "eval_accuracy"}
        for k, t in expected["state_dict"].items():
            assert isinstance(restored["state_dict"][k], torch.Tensor)
            assert restored["state_dict"][k].dtype == t.dtype
            assert torch.equal(restored["state_dict"][k], t), k
    no_temp_files(model_dir)


def test_decode_to_another_kind_by_suffix_and_by_format(model_dir):
    stream = model_dir / "m.dcb"
    ok(["encode", model_dir / "model.pt", "-o", stream, "-q"])
    data = stream.read_bytes()
    expected = flat_tensors(decode_model(data))

    # by the output suffix
    st = model_dir / "out.safetensors"
    ok(["decode", stream, "-o", st])
    raw = st.read_bytes()
    assert raw[8:9] == b"{"  # a safetensors file: u64 header length, then JSON
    ckpt = load_checkpoint(st)
    assert ckpt.kind == "safetensors"
    assert_tensors_identical(ckpt.tensors, expected)

    npz = model_dir / "out.npz"
    ok(["decode", stream, "-o", npz])
    with np.load(npz) as z:
        assert len(z.files) > 0
    assert_tensors_identical(load_checkpoint(npz).tensors, expected)

    # by --format, whatever the suffix says (or does not say)
    weights = model_dir / "out.weights"
    ok(["decode", stream, "-o", weights, "--format", "npz"])
    assert weights.read_bytes()[:4] == b"PK\x03\x04"
    assert_tensors_identical(load_checkpoint(weights, "npz").tensors, expected)

    stream_st = model_dir / "s.dcb"
    ok(["encode", model_dir / "model.safetensors", "-o", stream_st, "-q"])
    as_torch = model_dir / "from_st.model"
    ok(["decode", stream_st, "-o", as_torch, "--format", "torch"])
    obj = torch.load(as_torch, weights_only=True)
    assert_tensors_identical(flat_tensors(obj), flat_tensors(decode_model(stream_st.read_bytes())))

    # a derived name is used as it is (as zstd does), in the original kind
    bare = model_dir / "bare.dcb"
    shutil.copy(stream_st, bare)
    ok(["decode", bare])
    assert not (model_dir / "bare.safetensors").exists()
    assert load_checkpoint(model_dir / "bare", "safetensors").tensors.keys() == decode_model(
        stream_st.read_bytes()).keys()
    no_temp_files(model_dir)


# --------------------------------------------------------------------------------------------------
# output names, --force, output == input
# --------------------------------------------------------------------------------------------------


def test_refuses_to_overwrite_without_force(model_dir):
    src = model_dir / "model.safetensors"
    out = model_dir / "model.safetensors.dcb"
    ok(["encode", src, "-q"])
    before = out.read_bytes()
    mtime = out.stat().st_mtime_ns

    # different settings would give different bytes: the refusal must leave the old file alone
    line = assert_error(run(["encode", src, "--qp", "-20"]), ["--force", str(out)])
    assert "already exists" in line
    assert out.read_bytes() == before and out.stat().st_mtime_ns == mtime

    ok(["encode", src, "--qp", "-20", "-f", "-q"])
    after = out.read_bytes()
    assert after != before and read_stream_header(after).qp == -20

    # decode: the derived name (the input without .dcb) is the original checkpoint itself
    original = src.read_bytes()
    assert_error(run(["decode", out]), ["--force", str(src)])
    assert src.read_bytes() == original
    ok(["decode", out, "--force"])
    assert src.read_bytes() != original  # lossy at qp -20
    assert_tensors_identical(load_checkpoint(src).tensors, flat_tensors(decode_model(after)))
    no_temp_files(model_dir)


def test_decode_needs_a_name_it_can_derive(model_dir):
    stream = model_dir / "stream.bin"
    ok(["encode", model_dir / "model.npz", "-o", stream, "-q"])
    assert_usage_error(run(["decode", stream]), ["-o"])


@pytest.mark.parametrize("name", ["model.pt", "model.npz"])
def test_decode_of_a_checkpoint_says_what_it_is_not_that_a_name_is_missing(model_dir, name):
    before = sorted(p.name for p in model_dir.iterdir())
    assert_error(run(["decode", model_dir / name]), [name, "not a deepcabac model stream", "deepcabac encode"])
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_output_equal_to_input_is_a_usage_error(model_dir, monkeypatch):
    src = model_dir / "model.pt"
    before = src.read_bytes()
    for spelling in (src, model_dir / "." / "model.pt"):
        assert_usage_error(run(["encode", src, "-o", spelling]), ["overwrite the input"])
        assert_usage_error(run(["encode", src, "-o", spelling, "-f"]), ["overwrite the input"])
    monkeypatch.chdir(model_dir)
    assert_usage_error(run(["encode", "model.pt", "-o", src, "-f"]), ["overwrite the input"])
    assert src.read_bytes() == before

    stream = model_dir / "model.pt.dcb"
    ok(["encode", src, "-q"])
    data = stream.read_bytes()
    assert_usage_error(run(["decode", stream, "-o", stream, "-f"]), ["overwrite the input"])
    assert stream.read_bytes() == data
    no_temp_files(model_dir)


# --------------------------------------------------------------------------------------------------
# stdin / stdout
# --------------------------------------------------------------------------------------------------


def test_encode_stdin_to_stdout(model_dir):
    src = model_dir / "model.pt"
    ok(["encode", src, "-o", model_dir / "file.dcb", "-q"])
    from_file = (model_dir / "file.dcb").read_bytes()

    result = ok(["encode", "-", "--input-format", "torch"], input=src.read_bytes())
    assert result.stdout_bytes == from_file  # deterministic: same bytes as the file path
    assert "Traceback" not in result.stderr

    # without --input-format the kind is sniffed; -o - is explicit stdout
    result = ok(["encode", "-", "-o", "-", "-q"], input=src.read_bytes())
    assert result.stdout_bytes == from_file
    assert result.stderr == ""


def test_decode_stdin_to_stdout(model_dir):
    ok(["encode", model_dir / "model.pt", "-o", model_dir / "s.dcb", "-q"])
    data = (model_dir / "s.dcb").read_bytes()
    expected = decode_model(data)
    for args in (["decode", "-", "-o", "-"], ["decode", "-"]):
        result = ok(args, input=data)
        obj = torch.load(io.BytesIO(result.stdout_bytes), weights_only=True)  # the original kind: torch
        assert obj["epoch"] == 40
        assert_tensors_identical(flat_tensors(obj), flat_tensors(expected))

    result = ok(["decode", "-", "--format", "safetensors"], input=data)
    assert result.stdout_bytes[8:9] == b"{"

    # info and test read stdin too
    assert "original kind torch" in ok(["info", "-"], input=data).stdout
    ok(["test", "-"], input=data)


def test_refuses_binary_to_a_terminal(model_dir):
    src = model_dir / "model.pt"
    tty = _TtyStdoutRunner(**({"mix_stderr": False} if CLICK_VERSION < (8, 2) else {}))
    assert_error(run(["encode", src, "-o", "-"], runner=tty), ["terminal"])
    assert_error(run(["encode", "-"], input=src.read_bytes(), runner=tty), ["terminal"])
    ok(["encode", src, "-o", model_dir / "s.dcb", "-q"])
    data = (model_dir / "s.dcb").read_bytes()
    assert_error(run(["decode", "-", "-o", "-"], input=data, runner=tty), ["terminal"])
    # text commands still print to a terminal
    assert "original kind torch" in run(["info", "-"], input=data, runner=tty).stdout


def test_refuses_binary_to_a_real_terminal_subprocess(model_dir):
    master, slave = _pty()
    try:
        proc = subprocess.run(_module_cmd("encode", model_dir / "model.pt", "-o", "-"), stdout=slave,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=SUBPROCESS_TIMEOUT)
        os.close(slave)
        slave = None
        on_terminal = _read_pty(master, timeout=0.5)
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 1
    assert on_terminal == b""
    err = proc.stderr.decode()
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "terminal" in err


def test_progress_goes_to_stderr_never_stdout_subprocess(model_dir):
    """stderr is a terminal (so tqdm draws), stdout a pipe: stdout holds exactly the stream."""
    src = model_dir / "model.pt"
    ok(["encode", src, "-o", model_dir / "ref.dcb", "-q"])
    reference = (model_dir / "ref.dcb").read_bytes()

    def encode_with_tty_stderr(*extra):
        master, slave = _pty()
        try:
            proc = subprocess.run(_module_cmd("encode", src, "-o", "-", *extra), stdout=subprocess.PIPE,
                                  stderr=slave, stdin=subprocess.DEVNULL, timeout=SUBPROCESS_TIMEOUT)
            os.close(slave)
            slave = None
            err = _read_pty(master, timeout=0.5)
        finally:
            if slave is not None:
                os.close(slave)
            os.close(master)
        return proc, err

    proc, err = encode_with_tty_stderr()
    assert proc.returncode == 0, err
    assert proc.stdout == reference
    assert read_stream_header(proc.stdout).total_size == len(proc.stdout)
    assert b"encode" in err and b"%" in err  # the bar was drawn, on stderr
    assert b"bits/param" in err

    proc, err = encode_with_tty_stderr("-q")
    assert proc.returncode == 0
    assert proc.stdout == reference
    assert err == b""  # -q: no bar, no summary


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["encode", "decode", "info", "test", "report"])
def test_missing_input(tmp_path, command):
    missing = tmp_path / "nope.dcb"
    result = run([command, missing])
    assert result.exit_code in (1, 2)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    if result.exit_code == 1:
        assert len(lines) == 1, result.stderr
    assert str(missing) in lines[-1] or "nope.dcb" in lines[-1]
    assert "no such file" in lines[-1].lower()
    assert list(tmp_path.iterdir()) == []


def test_truncated_stream(model_dir):
    ok(["encode", model_dir / "model.safetensors", "-o", model_dir / "full.dcb", "-q"])
    data = (model_dir / "full.dcb").read_bytes()
    header_size = read_stream_header(data).header_size
    for keep in (len(data) - 1, len(data) // 2, header_size, header_size - 1, 30, 5, 0):
        cut = model_dir / f"cut{keep}.dcb"
        cut.write_bytes(data[:keep])
        out = model_dir / f"cut{keep}.npz"
        for args in (["test", cut], ["decode", cut, "-o", out], ["info", cut]):
            assert_error(run(args))
        assert not out.exists()
    line = assert_error(run(["decode", model_dir / f"cut{len(data) - 1}.dcb", "-o", model_dir / "x.pt"]))
    assert str(len(data) - header_size - 1) in line  # says how short the payload is
    no_temp_files(model_dir)


def test_corrupted_payload(model_dir):
    ok(["encode", model_dir / "model.pt", "-o", model_dir / "good.dcb", "-q"])
    data = bytearray((model_dir / "good.dcb").read_bytes())
    header = read_stream_header(bytes(data))
    biggest = max(header.tensors, key=lambda e: e.size)
    data[header.header_size + biggest.offset + biggest.size // 2] ^= 0x10
    bad = model_dir / "bad.dcb"
    bad.write_bytes(bytes(data))
    out = model_dir / "bad.pt"
    for args in (["test", bad], ["decode", bad, "-o", out]):
        line = assert_error(run(args))
        assert "checksum" in line or "corrupt" in line or "damaged" in line
        assert biggest.name in line  # names the damaged tensor
    assert not out.exists()
    # the header is intact: info does not look at the payload
    assert ok(["info", bad]).stdout.count(biggest.name) == 1

    # a damaged header byte is caught by the header checksum, also by info
    data = bytearray((model_dir / "good.dcb").read_bytes())
    data[header.header_size - 6] ^= 0x01
    bad.write_bytes(bytes(data))
    for args in (["info", bad], ["test", bad], ["decode", bad, "-o", out]):
        line = assert_error(run(args))
        assert "checksum" in line or "corrupt" in line or "damaged" in line
    no_temp_files(model_dir)


def test_not_a_stream(model_dir):
    text = model_dir / "notes.txt"
    text.write_text("hello, this is not a model stream\n")
    for path in (model_dir / "model.pt", text):
        for command in ("info", "test"):
            assert_error(run([command, path]), ["not a deepcabac model stream"])
        assert_error(run(["decode", path, "-o", model_dir / "x.pt"]), ["not a deepcabac model stream"])
    assert not (model_dir / "x.pt").exists()


def test_not_a_checkpoint(model_dir):
    junk = model_dir / "junk.pt"
    junk.write_bytes(b"\x00garbage" * 10)
    assert_error(run(["encode", junk]), [str(junk)])
    assert not (model_dir / "junk.pt.dcb").exists()
    no_temp_files(model_dir)


@pytest.mark.parametrize("args, words", [
    (["--qp", "abc"], ["--qp"]),
    (["--qp", "100000"], ["--qp"]),
    (["--qp-tensor", "foo"], ["--qp-tensor"]),
    (["--qp-tensor", "classifier.weight=abc"], ["--qp-tensor"]),
    (["--qp-tensor", "=-20"], ["--qp-tensor"]),
    (["--qp-density", "9"], ["--qp-density"]),
    (["-T", "-1"], ["--threads"]),
    (["--input-format", "onnx"], ["--input-format"]),
    (["--no-such-option"], ["no such option"]),
    (["--quantizer", "fancy"], ["--quantizer"]),
    (["--lambda-scale", "-1"], ["--lambda-scale"]),
    (["--target-bpw", "0"], ["--target-bpw"]),
    (["--target-size", "0"], ["--target-size"]),
    (["--target-bpw", "3", "--target-size", "1000"], ["not both"]),
    (["--target-bpw", "3", "--qp", "-30"], ["--qp"]),
])
def test_bad_encode_options(model_dir, args, words):
    assert_usage_error(run(["encode", model_dir / "model.safetensors", *args]), words)
    assert not (model_dir / "model.safetensors.dcb").exists()


def test_bad_decode_options_and_commands(model_dir):
    ok(["encode", model_dir / "model.npz", "-q"])
    assert_usage_error(run(["decode", model_dir / "model.npz.dcb", "--format", "onnx"]), ["--format"])
    assert_usage_error(run(["decode", model_dir / "model.npz.dcb", "--qp", "-20"]), ["no such option"])
    assert_usage_error(run(["frobnicate"]))
    assert_usage_error(run(["test"]))  # at least one INPUT


# --------------------------------------------------------------------------------------------------
# info reads only the header
# --------------------------------------------------------------------------------------------------


def test_info_reads_only_the_header(model_dir, monkeypatch):
    stream = model_dir / "model.dcb"
    ok(["encode", model_dir / "model.safetensors", "-o", stream, "-q"])
    data = stream.read_bytes()
    header = read_stream_header(data)

    import deepcabac_py.cli.common as cli_common
    import deepcabac_py.cli.main as cli_main

    def forbidden(*a, **k):
        raise AssertionError("info must not read or decode the payload")

    with monkeypatch.context() as m:
        m.setattr(cli_common.Input, "model_stream", forbidden)
        for name in ("decode_checkpoint", "decode_model"):
            if hasattr(cli_main, name):
                m.setattr(cli_main, name, forbidden)
        m.setattr("deepcabac_py.model.decoder.decode_checkpoint", forbidden)
        result = ok(["info", stream])
        js = json.loads(ok(["info", "--json", stream]).stdout)
    assert f"{len(data):,} bytes" in result.stdout
    assert js["stream_bytes"] == len(data) and js["header_bytes"] == header.header_size

    # Truncating the last byte leaves the header itself intact, but the file is shorter than the
    # tensor table says. info compares the table with the file size (without reading the payload)
    # and reports the mismatch as an error, like `xz -l` on a truncated file.
    stream.write_bytes(data[:-1])
    line = assert_error(run(["info", stream]))
    assert str(header.payload_size - 1) in line and str(header.payload_size) in line
    assert "payload" in line


@pytest.mark.parametrize("rows, version", [(32, 9), (64, 12)])
def test_info_names_the_trailing_zero_mode_and_keeps_its_columns(tmp_path, rows, version):
    rng = np.random.default_rng(6)
    grid = np.ldexp(np.round(rng.standard_normal((rows, 512)) * 2.0**14), -40).astype(np.float32)
    src, stream = tmp_path / "grid.npz", tmp_path / "grid.dcb"
    np.savez(src, grid=grid, plain=rng.standard_normal(512).astype(np.float32))
    ok(["encode", src, "-o", stream, "--lossless", "-q"])
    header = read_stream_header(stream.read_bytes())
    # (tANS symbols in "plain", version 8; trailing zeros in "grid": mode 3, version 9, below 2**15
    # elements, mode 5, version 12, from there)
    assert header.version == version
    rows = {line.split()[0]: line.split() for line in ok(["info", stream]).stdout.splitlines()[3:5]}
    for name, e in ((e.name, e) for e in header.tensors):
        assert rows[name][3] == ("float-lossless+tz" if name == "grid" else "float-lossless")
        assert float(rows[name][-1]) == pytest.approx(4 * e.numel / e.size, abs=0.005)  # (x fp32, whole)
    assert "+tz = " in ok(["info", stream]).stdout
    assert {t["name"]: t["mode"] for t in json.loads(ok(["info", "--json", stream]).stdout)["tensors"]} == {
        "grid": "FLOAT+TZ", "plain": "FLOAT"}


# --------------------------------------------------------------------------------------------------
# report, info --json
# --------------------------------------------------------------------------------------------------


def test_report_on_a_checkpoint(model_dir):
    src = model_dir / "model.pt"
    names = list(load_checkpoint(src).tensors)
    result = ok(["report", src])
    lines = result.stdout.splitlines()
    for name in names:
        rows = [line for line in lines if line.startswith(name + " ")]
        assert len(rows) == 1, name
    total = [line for line in lines if line.startswith("total:")]
    assert len(total) == 1 and "bits/param" in total[0]
    fidelity = [line for line in lines if line.startswith("fidelity:")]
    assert len(fidelity) == 1 and "SNR" in fidelity[0] and " dB" in fidelity[0]
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    assert list(model_dir.glob("*.dcb")) == []  # report writes nothing

    js = json.loads(ok(["report", "--json", src]).stdout)
    assert [t["name"] for t in js["tensors"]] == names
    for t in js["tensors"]:
        assert isinstance(t["bits_per_param"], float) and t["bits_per_param"] > 0
        if t["dtype"] == "float32":
            assert isinstance(t["snr_db"], float) and t["snr_db"] > 10 and t["exact"] is False, t
        else:  # integer tensors are lossless; JSON has no infinity: null and "exact": true
            assert t["snr_db"] is None and t["exact"] is True
    assert isinstance(js["snr_db"], float) and js["snr_db"] > 10
    assert js["params"] == sum(t["params"] for t in js["tensors"] if t["alias_of"] is None)

    # the quantization options apply: a coarser qp costs fewer bits and more noise
    coarse = json.loads(ok(["report", "--json", src, "--qp", "-16", "--qp-1d", "-40"]).stdout)
    assert coarse["bits_per_param"] < js["bits_per_param"] and coarse["snr_db"] < js["snr_db"]
    exact = json.loads(ok(["report", "--json", src, "--exact-all"]).stdout)
    assert exact["snr_db"] is None and exact["exact"] is True and exact["max_abs_error"] == 0.0


def test_report_and_info_on_a_stream(model_dir):
    stream = model_dir / "m.dcb"
    ok(["encode", model_dir / "model.safetensors", "-o", stream, "-q"])
    data = stream.read_bytes()
    header = read_stream_header(data)

    result = ok(["report", stream])
    assert "total:" in result.stdout and f"{len(data):,} bytes" in result.stdout
    assert "fidelity:" not in result.stdout  # sizes only: the original is not known
    js = json.loads(ok(["report", "--json", stream]).stdout)
    assert js["stream_bytes"] == len(data) and js["snr_db"] is None
    assert all(t["snr_db"] is None for t in js["tensors"])
    assert ok(["report", "-"], input=data).stdout == result.stdout

    info = json.loads(ok(["info", "--json", stream]).stdout)
    assert info["kind"] == "safetensors"
    assert info["qp"] == header.qp and info["qp_1d"] == header.qp_1d and info["qp_density"] == header.qp_density
    assert info["stream_bytes"] == len(data)
    assert [t["name"] for t in info["tensors"]] == [e.name for e in header.tensors]
    for t, e in zip(info["tensors"], header.tensors):
        assert t["shape"] == list(e.shape) and t["mode"] == e.mode.name and t["bytes"] == e.size
        assert "snr_db" not in t
    # info's text table has no SNR / max error columns
    text = ok(["info", stream]).stdout
    assert "SNR" not in text and "max err" not in text
    rows = [line for line in text.splitlines() if line.split(" ", 1)[0] in {e.name for e in header.tensors}]
    assert len(rows) == len(header.tensors)
    for row in rows:  # name shape dtype mode qp params bytes bits/p x-fp32: no empty error columns
        assert len(row.split()) == 9, row
        float(row.split()[-1])
    assert json.loads(ok(["info", "--json", "-"], input=data).stdout) == info


# --------------------------------------------------------------------------------------------------
# verbosity
# --------------------------------------------------------------------------------------------------


def test_quiet_and_verbose(model_dir):
    src = model_dir / "model.safetensors"
    result = ok(["encode", src, "-o", model_dir / "q.dcb", "-q"])
    assert result.stderr == "" and result.stdout_bytes == b""
    result = ok(["encode", src, "-o", model_dir / "v.dcb", "-v"])
    assert result.stdout_bytes == b""
    assert str(model_dir / "v.dcb") in result.stderr and "total:" in result.stderr
    result = ok(["decode", model_dir / "q.dcb", "-o", model_dir / "q.npz", "-q"])
    assert result.stderr == "" and result.stdout_bytes == b""
    result = ok(["test", model_dir / "q.dcb", model_dir / "v.dcb"])
    assert result.stderr.count(": OK") == 2
    assert ok(["test", "-q", model_dir / "q.dcb"]).stderr == ""
    # -q does not silence errors
    assert_error(run(["encode", src, "-o", model_dir / "q.dcb", "-q"]), ["--force"])


def test_encode_to_stdout_is_exactly_a_stream(model_dir):
    src = model_dir / "model.safetensors"
    result = ok(["encode", src, "-o", "-"])  # not quiet: the summary must still go to stderr
    data = result.stdout_bytes
    assert data.startswith(MAGIC)
    assert read_stream_header(data).total_size == len(data)
    assert "bits/param" in result.stderr
    ok(["encode", src, "-o", model_dir / "f.dcb", "-q"])
    assert (model_dir / "f.dcb").read_bytes() == data


# --------------------------------------------------------------------------------------------------
# quantization options reach the stream
# --------------------------------------------------------------------------------------------------


def _header_of(path: Path):
    return {e.name: e for e in read_stream_header(path.read_bytes()).tensors}


def test_qp_tensor_and_exact_options(model_dir):
    src = model_dir / "model.safetensors"
    original = load_checkpoint(src).tensors

    out = model_dir / "a.dcb"
    ok(["encode", src, "-o", out, "-q", "--qp", "-30", "--qp-1d", "-70", "--importance", "none",
        "--qp-tensor", "classifier.weight=-20", "--qp-tensor", "features.1.*.weight=-24"])
    h = _header_of(out)
    assert read_stream_header(out.read_bytes()).qp == -30
    # the default quantizer is the trellis
    assert h["classifier.weight"].mode == Mode.DEPENDENT and h["classifier.weight"].qp == -20
    assert h["features.1.0.weight"].qp == -24
    assert h["features.1.1.weight"].qp == -24  # the glob also matches the 1-D BatchNorm weight
    assert h["features.0.0.weight"].qp == -30
    assert h["features.0.1.bias"].qp == -70

    # by default the steps follow the model's structure (BatchNorm scales); --qp-tensor still wins
    out = model_dir / "s.dcb"
    ok(["encode", src, "-o", out, "-q", "--qp", "-30", "--qp-tensor", "classifier.weight=-20"])
    h = _header_of(out)
    expected = allocate_qps(structural_importance(load_checkpoint(src)), {n: e.shape for n, e in h.items()},
                            -30, qp_1d=-30 - 24, reference=0.0)
    assert h["classifier.weight"].qp == -20
    assert {n: h[n].qp for n in expected if n != "classifier.weight"} == {
        n: q for n, q in expected.items() if n != "classifier.weight"}
    assert len({h[n].qp for n in expected}) > 1

    out = model_dir / "b.dcb"
    ok(["encode", src, "-o", out, "-q", "--exact", "*.bias", "--exact", "classifier.weight"])
    h = _header_of(out)
    raw = {n for n, e in h.items() if e.mode in (Mode.RAW, Mode.FLOAT)}
    assert raw == {n for n in h if n.endswith(".bias")} | {"classifier.weight"}
    assert h["classifier.weight"].mode == Mode.FLOAT  # (the smallest biases are cheaper raw)
    decoded = flat_tensors(decode_model(out.read_bytes()))
    assert_tensors_identical({n: decoded[n] for n in raw}, {n: original[n] for n in raw})

    out = model_dir / "c.dcb"
    ok(["encode", src, "-o", out, "-q", "--exact-all"])
    h = _header_of(out)
    assert all(e.mode in (Mode.RAW, Mode.FLOAT) for e in h.values() if e.dtype.is_float)
    assert {e.mode for e in h.values() if e.dtype.is_float and e.numel > 1000} == {Mode.FLOAT}
    ok(["encode", src, "-o", model_dir / "c2.dcb", "-q", "--lossless"])
    assert (model_dir / "c2.dcb").read_bytes() == out.read_bytes()
    assert all(e.mode == Mode.INTEGER for e in h.values() if not e.dtype.is_float)
    ok(["decode", out, "-o", model_dir / "lossless.safetensors"])
    assert_tensors_identical(load_checkpoint(model_dir / "lossless.safetensors").tensors, original)


def test_bias_correction_option(model_dir):
    from deepcabac_py import encode_model
    from deepcabac_py.model.structural_importance import shift_absorbers

    src = model_dir / "model.safetensors"
    ckpt = load_checkpoint(src)
    assert shift_absorbers(ckpt)  # the digits CNN has layers between BatchNorms
    for flag, on in (([], True), (["--no-bias-correction"], False), (["--bias-correction"], True)):
        out = model_dir / f"bc{len(flag)}{on}.dcb"
        ok(["encode", src, "-o", out, "-q", "--qp", "-24", *flag])
        assert out.read_bytes() == encode_model(ckpt, qp=-24, bias_correction=on), flag
    assert (model_dir / "bc0True.dcb").read_bytes() != (model_dir / "bc1False.dcb").read_bytes()


# --------------------------------------------------------------------------------------------------
# atomic output
# --------------------------------------------------------------------------------------------------


def test_no_temporary_files_after_success(model_dir):
    out_dir = model_dir / "out"
    out_dir.mkdir()
    ok(["encode", model_dir / "model.pt", "-o", out_dir / "m.dcb", "-q"])
    ok(["decode", out_dir / "m.dcb", "-o", out_dir / "m.safetensors"])
    ok(["decode", out_dir / "m.dcb", "-o", out_dir / "m.safetensors", "-f"])
    assert sorted(p.name for p in out_dir.iterdir()) == ["m.dcb", "m.safetensors"]


def test_failed_write_leaves_nothing(model_dir):
    src = model_dir / "model.pt"
    # The parent of the output is a regular file (works as root, unlike a read-only directory).
    blocker = model_dir / "blocker"
    blocker.write_text("x")
    line = assert_error(run(["encode", src, "-o", blocker / "m.dcb"]), ["cannot write"])
    assert str(blocker / "m.dcb") in line
    assert blocker.read_text() == "x"
    assert_error(run(["encode", src, "-o", model_dir / "missing-dir" / "m.dcb"]), ["cannot write"])
    no_temp_files(model_dir)
    assert sorted(p.name for p in model_dir.iterdir()) == ["blocker", "model.npz", "model.pt", "model.safetensors"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_read_only_output_directory(model_dir):
    ro = model_dir / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert_error(run(["encode", model_dir / "model.pt", "-o", ro / "m.dcb"]), ["cannot write", "permission"])
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_disk_full_during_write_leaves_old_file_and_no_temp(model_dir, monkeypatch):
    src = model_dir / "model.pt"
    out = model_dir / "m.dcb"
    ok(["encode", src, "-o", out, "-q"])
    before = out.read_bytes()

    def full_disk(fd):  # the data fsync fails as on a full disk (the directory fsync is best effort)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    assert_error(run(["encode", src, "-o", out, "-f", "--qp", "-20"]), ["no space left", str(out)])
    assert_error(run(["decode", out, "-o", model_dir / "d.safetensors"]), ["no space left"])
    monkeypatch.undo()
    assert out.read_bytes() == before
    assert not (model_dir / "d.safetensors").exists()
    no_temp_files(model_dir)


# --------------------------------------------------------------------------------------------------
# real processes: console script and python -m
# --------------------------------------------------------------------------------------------------


def test_version_and_help():
    result = ok(["--version"])
    assert "deepcabac" in result.stdout and "0." in result.stdout
    for args in (["--help"], ["-h"], ["encode", "--help"], ["decode", "--help"], ["info", "--help"],
                 ["report", "--help"], ["test", "--help"]):
        assert "Usage:" in ok(args).stdout
    # no command: help (click exits 0 or 2 here depending on its version), never a traceback
    result = run([])
    assert result.exit_code in (0, 2) and "Usage:" in result.stdout + result.stderr


def test_subprocess_version_and_help():
    proc = subprocess.run(_script_cmd("--version"), capture_output=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0 and b"deepcabac" in proc.stdout
    proc = subprocess.run(_module_cmd("--help"), capture_output=True, timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0 and b"Usage:" in proc.stdout and b"encode" in proc.stdout


def test_subprocess_round_trip_and_errors(model_dir):
    src = model_dir / "model.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run_kw = dict(capture_output=True, timeout=SUBPROCESS_TIMEOUT, env=env, cwd=model_dir)

    # stdin -> stdout pipeline through the console script
    proc = subprocess.run(_script_cmd("encode", "-", "--input-format", "torch"), input=src.read_bytes(), **run_kw)
    assert proc.returncode == 0, proc.stderr
    stream = proc.stdout
    assert read_stream_header(stream).total_size == len(stream)
    proc = subprocess.run(_module_cmd("decode", "-", "-o", "-"), input=stream, **run_kw)
    assert proc.returncode == 0, proc.stderr
    obj = torch.load(io.BytesIO(proc.stdout), weights_only=True)
    assert obj["epoch"] == 40
    assert_tensors_identical(flat_tensors(obj), flat_tensors(decode_model(stream)))

    # files, default names, relative paths
    proc = subprocess.run(_script_cmd("encode", "model.pt", "-q"), **run_kw)
    assert proc.returncode == 0 and proc.stderr == b"" and proc.stdout == b""
    assert (model_dir / "model.pt.dcb").read_bytes() == stream
    proc = subprocess.run(_script_cmd("decode", "model.pt.dcb"), **run_kw)  # model.pt exists
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert len(err.strip().splitlines()) == 1 and "--force" in err and "Traceback" not in err

    # a truncated stream and a missing file, as real processes
    (model_dir / "cut.dcb").write_bytes(stream[: len(stream) // 2])
    proc = subprocess.run(_module_cmd("test", "cut.dcb", "missing.dcb"), **run_kw)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    # every input is checked, one line each, each naming its file
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert "cut.dcb" in lines[0] and "truncated" in lines[0] and "missing.dcb" in lines[1]
    no_temp_files(model_dir)


def test_quantizer_and_lambda_options(model_dir):
    src = model_dir / "model.safetensors"
    sizes = {}
    for name, args in {"nearest": ["--quantizer", "nearest"], "rdoq": ["--quantizer", "rdoq"],
                       "trellis": [], "coarse": ["--lambda-scale", "8"]}.items():
        out = model_dir / f"{name}.dcb"
        ok(["encode", src, "-o", out, "-q", *args])
        modes = {e.mode for e in _header_of(out).values() if e.mode.is_quantized}
        assert modes == {Mode.UNIFORM if name in ("nearest", "rdoq") else Mode.DEPENDENT}, name
        sizes[name] = out.stat().st_size
        decoded = ok(["decode", out, "-o", model_dir / f"{name}.safetensors", "-q"])
        assert decoded.exit_code == 0
    assert sizes["coarse"] < sizes["trellis"]


@pytest.mark.parametrize("option, value", [("--target-size", 8000), ("--target-bpw", 3.0)])
def test_rate_control_options(model_dir, option, value):
    src = model_dir / "model.safetensors"
    out = model_dir / "rc.dcb"
    ok(["encode", src, "-o", out, "-q", option, str(value)])
    params = sum(int(np.prod(t.shape)) for t in load_checkpoint(src).tensors.values())
    budget = value if option == "--target-size" else value * params / 8
    assert 0.9 * budget <= out.stat().st_size <= budget


def test_rate_control_that_cannot_be_met_is_an_error(model_dir):
    out = model_dir / "rc.dcb"
    assert_error(run(["encode", model_dir / "model.safetensors", "-o", out, "--target-size", "100"]),
                 ["budget"])
    assert not out.exists()


def test_decode_max_elements(model_dir):
    r = _runner().invoke(main, ["encode", str(model_dir / "model.npz"), "-o", str(model_dir / "m.dcb"), "-q"])
    assert r.exit_code == 0, r.output
    params = read_stream_header((model_dir / "m.dcb").read_bytes())
    total = sum(e.numel for e in params.tensors if not e.is_alias)
    r = _runner().invoke(main, ["decode", str(model_dir / "m.dcb"), "-o", str(model_dir / "a.npz"),
                                "--max-elements", str(total - 1)])
    assert r.exit_code == 1 and "max_elements" in r.stderr and not (model_dir / "a.npz").exists()
    r = _runner().invoke(main, ["decode", str(model_dir / "m.dcb"), "-o", str(model_dir / "a.npz"),
                                "--max-elements", str(total), "-q"])
    assert r.exit_code == 0 and (model_dir / "a.npz").exists()
