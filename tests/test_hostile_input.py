"""Hostile and extreme input, second campaign: one test (or a few) per class of input, each failing
without its fix. Every failure is one of the library's own errors, bounded in time and memory, and
every output lands where it belongs."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import tracemalloc
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import craft, no_hang, uniform

import deepcabac_py as dc
from deepcabac_py.cli.main import main
from deepcabac_py.entropy import chunk_layout, levelcoder
from deepcabac_py.errors import (
    CheckpointError,
    CorruptStreamError,
    DeepCabacError,
    DeepCabacWarning,
    FormatError,
    TruncatedStreamError,
)
from deepcabac_py.io.dtypes import DType
from deepcabac_py.model.container import (
    FLAG_TORCH,
    MAGIC,
    MAX_METADATA_BYTES,
    PREAMBLE,
    Coder,
    Mode,
    TensorEntry,
    pack_header,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "digits_cnn.safetensors"
CLI = [sys.executable, "-m", "deepcabac_py.cli.main"]
PEAK = 64 << 20  # what refusing a hostile input may allocate at most (traced)


def cli(*args, stdin=None, timeout=120):
    return subprocess.run([*CLI, *map(str, args)], stdin=stdin, capture_output=True, timeout=timeout)


def one_error_line(done) -> str:
    """The one line a failed command prints: no traceback, status 1."""
    err = done.stderr.decode() if isinstance(done.stderr, bytes) else done.stderr
    assert done.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepcabac: error: "), err
    assert "Traceback" not in err
    return lines[0]


def refused_cheaply(fn, error=DeepCabacError):
    """``fn()`` raises ``error`` within bounded time, having allocated little."""
    tracemalloc.start()
    try:
        with no_hang(60), pytest.raises(error) as info:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK, f"peak {peak / 2**20:.1f} MiB"
    return info.value


def stream_with_body(body: bytes, *, raw_size: int | None = None, payload: bytes = b"") -> bytes:
    """A model stream whose header body is ``body`` (deflated, checksummed as the format says)."""
    packed = struct.pack("<I", len(body) if raw_size is None else raw_size) + zlib.compress(body, 9)
    head = PREAMBLE.pack(MAGIC, 3, 0, len(packed) + 4) + packed
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def settings_body(count: int, metadata: bytes) -> bytes:
    return struct.pack("<IhhBB", count, -32, -56, 2, 0) + struct.pack("<I", len(metadata)) + metadata


# --- 1. outputs onto devices and pipes ---------------------------------------------------------


def _drain(path: Path, sink: list) -> threading.Thread:
    t = threading.Thread(target=lambda: sink.append(path.read_bytes()), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("force", [False, True])
def test_output_onto_a_fifo_is_written_into_it(tmp_path, force):
    expected = tmp_path / "ref.dcb"
    assert cli("encode", MODEL, "-o", expected, "-q").returncode == 0
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list = []
    reader = _drain(fifo, got)
    done = cli("encode", MODEL, "-o", fifo, "-q", *(["-f"] if force else []))
    reader.join(30)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the pipe, not a file renamed over it
    assert got == [expected.read_bytes()]


def test_output_onto_a_character_device_stays_a_device(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    except PermissionError:
        pytest.skip("no permission to make device nodes here")
    for extra in ([], ["-f"]):
        done = cli("encode", MODEL, "-o", node, "-q", *extra)
        assert done.returncode == 0, done.stderr
        assert stat.S_ISCHR(os.lstat(node).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


# --- 2, 3. header bodies that inflate, metadata JSON that hurts --------------------------------


def test_metadata_larger_than_a_header_holds_is_refused_before_inflating():
    huge = b"[" + b"0," * (MAX_METADATA_BYTES // 2) + b"0]"
    data = stream_with_body(settings_body(0, huge))
    assert len(data) < 100_000  # deflated 2,000x: the header only claims
    refused_cheaply(lambda: dc.read_stream_header(data), CorruptStreamError)


def test_a_body_larger_than_its_tensors_can_need_is_refused():
    data = stream_with_body(settings_body(1, b"{}"), raw_size=400 << 20)
    exc = refused_cheaply(lambda: dc.read_stream_header(data), CorruptStreamError)
    assert "can need" in str(exc) or "implausible" in str(exc)


@pytest.mark.parametrize("metadata", [
    b"[" * 2000 + b"]" * 2000,  # deeper than Python's recursion limit
    b'{"kind": ' + b"9" * 5001 + b"}",  # more digits than int() converts
    b"[" + b"[]," * 500_000 + b"[]]",  # more containers than a header of no tensor can need
], ids=["deep", "long-integer", "containers"])
def test_hostile_metadata_json_is_a_corrupt_stream(tmp_path, metadata):
    data = stream_with_body(settings_body(0, metadata))
    refused_cheaply(lambda: dc.read_stream_header(data), CorruptStreamError)
    path = tmp_path / "m.dcb"
    path.write_bytes(data)
    for command in ("info", "decode", "test"):
        args = [command, path] + (["-o", tmp_path / "out.npz"] if command == "decode" else [])
        one_error_line(cli(*args))


def test_a_zero_itemsize_scalar_in_a_skeleton_is_refused(tmp_path):
    root = {"$dict": [["x", {"$npscalar": ["|V0", ""]}]]}
    skeleton = {"format": "deepcabac.skeleton", "version": 1, "root": root}
    data = stream_with_body(settings_body(0, json.dumps({"kind": "mapping", "skeleton": skeleton}).encode()))
    with pytest.raises(DeepCabacError, match="npscalar"):
        dc.decode_model(data)
    # the same in a safetensors file's metadata
    header = json.dumps({"__metadata__": {"deepcabac.skeleton": json.dumps(skeleton)}}).encode()
    path = tmp_path / "s.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="npscalar"):
        dc.load_checkpoint(path)


# --- 4. finite values decode as finite values --------------------------------------------------


@pytest.mark.parametrize("values, settings", [
    (torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16), {"qp": 21, "quantizer": "nearest"}),
    (torch.tensor([3.3895314e38, -3.3895314e38], dtype=torch.bfloat16), {"qp": 450, "quantizer": "nearest"}),
    (np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32), {"qp": 412, "quantizer": "nearest"}),
    (np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32), {"qp": 420}),
    (np.array([1.7976931348623157e308, -1.7976931348623157e308, 1.0]), {}),
], ids=["float16", "bfloat16", "float32-nearest", "float32-trellis", "float64"])
def test_the_largest_finite_values_never_decode_as_infinity(values, settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepCabacWarning)  # (float64's maximum is stored raw)
        back = dc.decode_model(dc.encode_model({"w": values}, importance=None, **settings))["w"]
    got = back.float().numpy() if isinstance(back, torch.Tensor) else np.asarray(back, dtype=np.float64)
    want = values.float().numpy() if isinstance(values, torch.Tensor) else values
    assert np.isfinite(got).all()
    assert np.array_equal(np.sign(got[:2]), np.sign(want[:2]))  # (1.0 may well round to 0 at these steps)


@pytest.mark.parametrize("dtype, qp", [(DType.FLOAT16, 200), (DType.FLOAT32, 4000), (DType.BFLOAT16, 4000)])
def test_a_stream_whose_values_overflow_their_dtype_is_refused(dtype, qp):
    levels = np.array([1000, -3] + [0] * 14, np.int32)
    chunk = levelcoder.encode_chunk(levels, chunk_layout.layout_for_shape((16,)), 0)
    entry = uniform(shape=(16,), dtype=dtype, qp=qp, chunk_sizes=[len(chunk)],
                    flags=FLAG_TORCH if dtype == DType.BFLOAT16 else 0)
    data = craft([entry], chunk)
    with pytest.raises(CorruptStreamError, match="beyond the largest"):
        dc.decode_model(data)
    with pytest.raises(CorruptStreamError, match="beyond the largest"):
        dc.decode_levels(data)[entry.name].dequantize()


# --- 5, 6, 11. endless, lying and piped inputs ---------------------------------------------------


@pytest.mark.parametrize("args", [
    ["decode", "/dev/zero", "-o", "{tmp}/x.pt"], ["test", "/dev/zero"], ["info", "/dev/zero"],
    ["encode", "/dev/zero", "-o", "{tmp}/x.dcb"], ["report", "/dev/zero"],
    ["update", "apply", "{base}", "/dev/zero", "-o", "{tmp}/y.pt"],
], ids=lambda a: " ".join(a[:2]))
def test_endless_inputs_are_refused_from_their_first_bytes(tmp_path, args):
    base = tmp_path / "base.pt"
    torch.save({"w": torch.ones(3)}, base)
    args = [a.format(tmp=tmp_path, base=base) for a in args]
    one_error_line(cli(*args, timeout=60))
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.dcb").exists()


@pytest.mark.parametrize("command", ["decode", "test", "info", "encode"])
def test_endless_stdin_is_refused(tmp_path, command):
    args = [command, "-"] + (["-o", tmp_path / "out"] if command in ("decode", "encode") else [])
    with open("/dev/zero", "rb") as zero:
        one_error_line(cli(*args, stdin=zero, timeout=60))


def test_a_stream_read_from_a_pipe_stops_where_its_table_ends():
    r, w = os.pipe()
    data = dc.encode_model({"w": np.arange(300, dtype=np.float32)})

    def feed():  # the stream, then more bytes than anyone should read
        with os.fdopen(w, "wb") as f:
            f.write(data)
            try:
                f.write(bytes(1 << 20))
            except BrokenPipeError:
                pass

    threading.Thread(target=feed, daemon=True).start()
    with os.fdopen(r, "rb") as f, pytest.raises(CorruptStreamError, match="after the end"):
        dc.model.container.read_stream(f)


def _lying_update(claim: int) -> bytes:
    """An update message whose header declares ``claim`` payload bytes (its real payload follows)."""
    base = {"w": np.zeros((8, 8), np.float32)}
    msg = dc.encode_update({"w": np.eye(8, dtype=np.float32)}, base, density=0.2)
    (header_size,) = struct.unpack_from("<I", msg, 12)
    body = msg[PREAMBLE.size:PREAMBLE.size + header_size - 4]
    start = len(body) - 1  # the last field of the body is the payload's length, a LEB128 varint
    while start > 0 and body[start - 1] & 0x80:
        start -= 1
    varint, x = bytearray(), claim
    while True:
        varint.append((x & 0x7F) | (0x80 if x >> 7 else 0))
        x >>= 7
        if not x:
            break
    body = body[:start] + bytes(varint)
    head = PREAMBLE.pack(msg[:8], *struct.unpack_from("<HH", msg, 8), len(body) + 4) + body
    return head + struct.pack("<I", zlib.crc32(head)) + msg[PREAMBLE.size + header_size:]


def test_an_update_header_declaring_a_huge_payload_allocates_nothing(tmp_path):
    from deepcabac_py.updates.messages import iter_messages

    data = _lying_update(1 << 34)
    path = tmp_path / "lie.dcu"
    path.write_bytes(data)
    with open(path, "rb") as f:
        refused_cheaply(lambda: list(iter_messages(f)), TruncatedStreamError)
    one_error_line(cli("test", path))


@pytest.mark.parametrize("command", ["info", "test", "report"])
def test_a_fifo_input_is_opened_once(tmp_path, command):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    data = dc.encode_model({"w": np.arange(300, dtype=np.float32)})

    def feed():
        with open(fifo, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    done = cli(command, fifo, timeout=60)
    writer.join(10)
    assert done.returncode == 0, done.stderr


# --- 7, 8, 9. checkpoints and streams whose shapes lie ----------------------------------------


@pytest.mark.parametrize("n", [1 << 28, 1 << 40])
def test_stride_zero_views_are_bounded_by_what_they_would_become(tmp_path, n):
    path = tmp_path / "expand.pt"
    torch.save({"w": torch.zeros(1).expand(n)}, path)
    assert path.stat().st_size < 4096
    exc = refused_cheaply(lambda: dc.load_checkpoint(path), CheckpointError)
    assert "holds tensors of" in str(exc)


def test_shapes_numpy_cannot_hold(tmp_path):
    entry = TensorEntry(name="w", dtype=DType.FLOAT32, shape=(0, 1 << 48, 1 << 48), mode=Mode.RAW,
                        coder=Coder.NONE, chunk_elements=(1 << 30) // 4)
    refused_cheaply(lambda: dc.decode_model(pack_header(-32, -75, 2, {"kind": "mapping"}, [entry])),
                    CorruptStreamError)
    # a safetensors shape of 70 dimensions
    header = json.dumps({"w": {"dtype": "F32", "shape": [1] * 70, "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(CheckpointError, match="dimensions"):
        dc.load_checkpoint(path)
    # a tensor the stream could not hold is refused before anything is written
    empty = tmp_path / "wide.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [0, 1 << 49], "data_offsets": [0, 0]}}).encode()
    empty.write_bytes(struct.pack("<Q", len(header)) + header)
    out = tmp_path / "wide.dcb"
    one_error_line(cli("encode", empty, "-o", out))
    assert not out.exists()


def test_a_bfloat16_entry_must_be_a_torch_tensor():
    entry = TensorEntry(name="w", dtype=DType.BFLOAT16, shape=(2,), mode=Mode.RAW, coder=Coder.NONE,
                        chunk_elements=(1 << 30) // 2, chunk_sizes=[4], size=4)
    with pytest.raises(CorruptStreamError, match="bfloat16"):
        dc.decode_model(craft([entry], bytes(4)))


# --- 10. nothing fails after the work is done --------------------------------------------------


def test_a_checkpoint_of_empty_tensors_encodes(tmp_path):
    path = tmp_path / "empty.pt"
    torch.save({"a": torch.zeros(0), "b": torch.zeros(0, 3)}, path)
    for quiet in ([], ["-q"]):
        done = cli("encode", path, "-o", tmp_path / "empty.dcb", "-f", *quiet)
        assert done.returncode == 0, done.stderr


def test_names_too_long_are_refused_before_the_work(tmp_path):
    path = tmp_path / "long.pt"
    torch.save({"x" * 70_000: torch.ones(2)}, path)
    out = tmp_path / "long.dcb"
    line = one_error_line(cli("encode", path, "-o", out))
    assert "65,535" in line and not out.exists()
    # the longest name a stream holds is too long for a .npz member (with its ".npy")
    stream = tmp_path / "max.dcb"
    stream.write_bytes(dc.encode_model({"y" * 65_535: np.ones(2, np.float32)}))
    line = one_error_line(cli("decode", stream, "-o", tmp_path / "max.npz"))
    assert ".npz" in line and not (tmp_path / "max.npz").exists()


# --- 12, 13, 14, 15. options, caches, warnings, messages ---------------------------------------


@pytest.mark.parametrize("args", [["--qp", "-4096"], ["--qp", "4095", "--qp-density", "0"],
                                  ["--qp-1d", "-4096"], ["--qp-tensor", "w=-4096"]])
def test_qps_without_a_step_are_usage_errors_naming_the_option(tmp_path, args):
    done = CliRunner().invoke(main, ["encode", str(MODEL), "-o", str(tmp_path / "x.dcb"), *args])
    assert done.exit_code == 2 and "--qp" in done.output and "no step" in done.output
    assert not isinstance(done.exception, ValueError)


def test_without_a_writable_numba_cache_the_cli_still_runs(tmp_path):
    # decoding compiles (into the temporary cache) in a few seconds; encoding would take a minute
    golden = ROOT / "tests" / "golden" / "state_dict.dcb"
    code = (
        "import numba.core.caching as c\n"
        "def deny(self):\n    raise PermissionError(13, 'read-only file system')\n"
        "c.InTreeCacheLocator.ensure_cache_path = deny\nc.UserWideCacheLocator.ensure_cache_path = deny\n"
        "import sys\nfrom deepcabac_py.cli.main import main\n"
        f"sys.argv = ['deepcabac', 'decode', {str(golden)!r}, '-o', {str(tmp_path / 'x.npz')!r}, '-q']\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "Numba cache" in line]
    assert len(warned) == 1 and warned[0].startswith("deepcabac: warning: ")
    assert (tmp_path / "x.npz").exists()


def test_silent_changes_are_said_once_in_the_clis_voice(tmp_path):
    model = tmp_path / "odd.pt"
    torch.save({"nan": torch.tensor([1.0, float("nan")]), "outlier": torch.tensor([1e38] + [0.01] * 63)}, model)
    done = cli("encode", model, "-o", tmp_path / "odd.dcb", "-q")
    assert done.returncode == 0
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("deepcabac: warning: ") for line in lines), lines
    assert "NaN" in lines[0] and "coded as 0" in lines[1]
    # an update whose new model holds NaN
    base, new = tmp_path / "base.pt", tmp_path / "new.pt"
    torch.save({"w": torch.zeros(8, 8)}, base)
    torch.save({"w": torch.eye(8).masked_fill(torch.eye(8) == 0, float("nan"))}, new)
    done = cli("update", "encode", new, "--base", base, "-o", tmp_path / "u.dcu", "-q")
    assert done.returncode == 0
    assert "deepcabac: warning: w: 56 values of the update are NaN" in done.stderr.decode()
    # and in Python, the library's own category
    with pytest.warns(DeepCabacWarning, match="NaN"):
        dc.encode_model({"w": np.array([np.nan, 1.0], np.float32)})


def test_a_failed_write_inside_torch_is_reported_as_the_os_error():
    from deepcabac_py.io.files import checkpoint_writer

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    ckpt = dc.load_checkpoint(MODEL)
    with pytest.raises(OSError) as info:
        checkpoint_writer(ckpt, "torch")(Full())
    assert info.value.errno == errno.ENOSPC


def test_an_output_directory_that_does_not_exist_is_refused_before_the_work(tmp_path):
    line = one_error_line(cli("encode", MODEL, "-o", tmp_path / "missing" / "x.dcb"))
    assert "no such directory" in line


def test_format_errors_are_the_librarys_own():
    assert issubclass(CorruptStreamError, FormatError) and issubclass(FormatError, DeepCabacError)
