"""The pure-Python path (``NUMBA_DISABLE_JIT=1``: every kernel runs as the Python it is written in)
must produce the same bytes and the same values as the compiled kernels.

The golden tests hold the compiled path's bytes (model streams of format versions 1 and 2, with
rounding, RDOQ and the trellis; update streams with both coders and a session): running them again
with the JIT off checks the encoders and decoders of both paths against the same committed bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _pytest_without_jit(*args: str) -> str:
    """Run pytest on ``args`` with NUMBA_DISABLE_JIT=1; its output, once it has passed."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    env.pop("DEEPCABAC_REGEN_GOLDEN", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_pure_python_kernels_reproduce_the_golden_streams():
    out = _pytest_without_jit(str(TESTS / "test_golden.py"), str(TESTS / "test_golden_updates.py"))
    assert " passed" in out and "skipped" not in out


def test_the_pure_python_byte_copy_moves_the_same_bytes():
    # (the compiled kernels copy by memcpy; with the JIT off, by a slice of bytes)
    assert "1 passed" in _pytest_without_jit(str(TESTS / "test_jit.py"), "-k", "byte_copy_moves")
