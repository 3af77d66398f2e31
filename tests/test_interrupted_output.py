"""Interrupted and failing output of the real ``deepcabac`` process: a signal that arrives while the
output is being written leaves nothing at the output path (and, unless the process is killed outright,
no temporary file either); a full disk gives a one-line error and exit status 1.

The window is made deterministic by running the CLI under a wrapper whose ``os.fsync`` (called by the
atomic writer once the temporary file is complete) announces itself and then sleeps, so the test can
send its signal exactly while a complete but unpublished temporary file exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

SUBPROCESS_TIMEOUT = 120  # cold numba caches on a loaded machine

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

WRAPPER = textwrap.dedent("""
    import os, sys, time
    flag, where = sys.argv.pop(1), sys.argv.pop(1)
    if where == "fsync":  # main thread, the temporary output complete
        def stalled_fsync(fd):
            open(flag, "w").close()
            time.sleep(60)
        os.fsync = stalled_fsync
    else:  # a worker thread of the decoder's pool, before its chunk
        from deepcabac_py.entropy import levelcoder
        decode_chunk = levelcoder.decode_chunk
        def stalled_decode_chunk(*args):
            open(flag, "w").close()
            time.sleep(2)
            return decode_chunk(*args)
        levelcoder.decode_chunk = stalled_decode_chunk
    from deepcabac_py.cli.main import main
    sys.argv[0] = "deepcabac"
    main()
""")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("interrupt")
    rng = np.random.default_rng(3)
    path = d / "model.npz"
    np.savez(path, **{"w": rng.standard_normal((64, 48)).astype(np.float32),
                      "b": rng.standard_normal(48).astype(np.float32)})
    return path


@pytest.fixture(scope="module")
def stream(model) -> Path:
    from deepcabac_py import encode_model
    from deepcabac_py.io.files import load_checkpoint

    path = model.with_suffix(".dcb")
    path.write_bytes(encode_model(load_checkpoint(model)))
    return path


def _start_stalled(tmp_path: Path, *args, where: str = "fsync") -> tuple[subprocess.Popen, Path]:
    flag = tmp_path / "fsync-reached"
    script = tmp_path / "stalled_cli.py"
    script.write_text(WRAPPER)
    proc = subprocess.Popen([sys.executable, str(script), str(flag), where, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the CLI never reached {where} (exit {proc.returncode}): {err.decode()[-2000:]}")
        time.sleep(0.02)
    return proc, flag


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n not in keep)


@pytest.mark.parametrize("signum, status, word", [(signal.SIGTERM, 143, "terminated"),
                                                   (signal.SIGINT, 130, "interrupted")])
@pytest.mark.parametrize("command", ["encode", "decode"])
def test_signal_during_write_leaves_no_output_and_no_temporary(tmp_path, model, stream, signum, status, word,
                                                               command):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    if command == "encode":
        src, out = model, out_dir / "model.dcb"
    else:
        src, out = stream, out_dir / "decoded.npz"
    proc, _ = _start_stalled(tmp_path, command, src, "-o", out, "-q")
    assert [n.endswith(".tmp") for n in os.listdir(out_dir)] == [True]  # the complete, unpublished file
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == status
    assert err.decode().strip().splitlines() == [f"deepcabac: {word}"]
    assert _leftovers(out_dir, set()) == []


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_threaded_decode(tmp_path, stream, signum, status):
    """The signal reaches the main thread while it waits for the pool: the chunks not started are
    cancelled, the running one finishes, and nothing is written."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc, _ = _start_stalled(tmp_path, "decode", stream, "-o", out_dir / "m.npz", "-T", "2", "-q", where="decode_chunk")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == status, err.decode()
    assert len(err.decode().strip().splitlines()) == 1
    assert _leftovers(out_dir, set()) == []


def test_signal_keeps_the_file_it_would_have_replaced(tmp_path, model):
    out = tmp_path / "model.dcb"
    out.write_bytes(b"the previous stream")
    proc, _ = _start_stalled(tmp_path, "encode", model, "-o", out, "-f", "-q")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 143
    assert out.read_bytes() == b"the previous stream"
    assert _leftovers(tmp_path, {"model.dcb", "stalled_cli.py", "fsync-reached"}) == []


def test_killed_outright_leaves_nothing_at_the_output_path(tmp_path, model):
    """SIGKILL cannot be caught: the hidden temporary file stays, the output name is never created."""
    out = tmp_path / "model.dcb"
    proc, _ = _start_stalled(tmp_path, "encode", model, "-o", out, "-q")
    proc.kill()
    proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert not out.exists()
    left = _leftovers(tmp_path, {"stalled_cli.py", "fsync-reached"})
    assert len(left) == 1 and left[0].startswith(".model.dcb.") and left[0].endswith(".tmp")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["encode", "decode"])
def test_full_disk_on_stdout_is_one_line_and_exit_1(model, stream, command):
    src = stream if command == "decode" else model
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", command, str(src), "-o", "-", "-q",
                               *(["--format", "npz"] if command == "decode" else [])],
                              stdout=full, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 1
    assert proc.stderr.decode().strip().splitlines() == [
        "deepcabac: error: cannot write to stdout: no space left on device"]
