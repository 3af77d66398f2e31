"""io.checksum: zlib's CRC-32 from every path (the folding kernel and the library's)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepcabac_py.io import _checksum_kernels as kernels
from deepcabac_py.io import checksum

folding = pytest.mark.skipif(not checksum.CAN_FOLD, reason="the processor has no VPCLMULQDQ and AVX2")


def _folded(data: bytes, value: int) -> int:
    view = np.frombuffer(data, dtype=np.uint8)
    return int(kernels.crc32_folded(view, value, kernels.fold_constants(), kernels.byte_table()))


@folding
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5 * kernels.BLOCK + 17), st.integers(0, 2**32 - 1))
def test_the_folding_kernel_computes_zlibs_crc(data, value):
    # (sizes below two blocks go byte by byte; from two on, whole blocks fold and a tail follows)
    assert _folded(data, value) == zlib.crc32(data, value)


@folding
@pytest.mark.parametrize("size", [2 * kernels.BLOCK, 2 * kernels.BLOCK + 1, 3 * kernels.BLOCK - 1, 1 << 20])
def test_the_folding_kernel_at_block_boundaries(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for value in (0, 1, 0xFFFFFFFF):
        assert _folded(data, value) == zlib.crc32(data, value)


@pytest.mark.parametrize("size", [0, 1, checksum.FOLD_FROM - 1, checksum.FOLD_FROM, 3 * checksum.FOLD_FROM + 5])
def test_crc32_is_zlibs_for_every_buffer_type(size):
    data = np.random.default_rng(size).integers(0, 256, size + 3, dtype=np.uint8).tobytes()
    for buffer in (data, bytearray(data), memoryview(data)[3:], np.frombuffer(data, dtype=np.uint8)):
        assert checksum.crc32(buffer) == zlib.crc32(buffer)
    # (a checksum carried from one piece to the next, as the encoder's over its substreams)
    half = len(data) // 2
    assert checksum.crc32(data[half:], checksum.crc32(data[:half])) == zlib.crc32(data)


@pytest.mark.parametrize("folding", [pytest.param(True, marks=folding), False])
def test_only_large_buffers_go_to_the_kernel_and_only_where_it_can_run(monkeypatch, folding):
    calls = []

    def counted(path, fn):
        def call(*args):
            calls.append(path)
            return fn(*args)
        return call

    monkeypatch.setattr(checksum, "FOLDING", folding)
    monkeypatch.setattr(checksum._k, "crc32_folded", counted("kernel", kernels.crc32_folded))
    monkeypatch.setattr(checksum, "_library_crc32", counted("library", checksum._library_crc32))
    data = bytes(range(256)) * (checksum.FOLD_FROM // 256 + 1)
    for size in (checksum.FOLD_FROM - 1, checksum.FOLD_FROM):
        assert checksum.crc32(data[:size], 7) == zlib.crc32(data[:size], 7)
    assert calls == (["library", "kernel"] if folding else ["library", "library"])
