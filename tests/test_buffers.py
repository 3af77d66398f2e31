"""io.buffers: large bytes objects joined like ``b"".join``, in huge pages where the system allows."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from deepcabac_py.io import buffers


@pytest.mark.parametrize("sizes", [[], [0], [5, 0, 7], [buffers.HUGE_FROM // 3] * 3 + [1, 0, 12345]])
def test_joined_is_the_concatenation(sizes):
    rng = np.random.default_rng(len(sizes))
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    pieces[len(pieces) // 2:] = [memoryview(p) for p in pieces[len(pieces) // 2:]]
    out = buffers.joined(pieces)
    assert type(out) is bytes
    assert out == b"".join(pieces)
    assert hash(out) == hash(b"".join(pieces))  # (an ordinary, immutable bytes object)


@pytest.mark.skipif(sys.platform != "linux", reason="the huge-page path is Linux's")
def test_the_huge_page_path_is_there_on_linux():
    # (its setup failing would fall back to b"".join silently, three times slower on 74 MB)
    assert buffers._API is not None
