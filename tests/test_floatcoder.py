"""The lossless float coder: bit-exact round trips (NaN payloads, infinities, denormals, -0), the
kernels against the plain-Python reference, the dropped low bits, and damaged substreams."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from helpers import fix_checksums
from hypothesis import given, settings
from hypothesis import strategies as st
from llvmlite import ir
from reference_float_coder import decode as ref_decode
from reference_float_coder import encode as ref_encode
from reference_float_coder import encode_halves as ref_encode_halves
from reference_float_coder import encode_trailing as ref_encode_trailing
from reference_float_coder import encode_tz as ref_encode_tz
from reference_float_coder import encode_wide as ref_encode_wide

import deepcabac_py as dc
from deepcabac_py.entropy import _float_kernels, _tans_kernels, _trailing_kernels, _vector_kernels, floatcoder
from deepcabac_py.entropy import _wide_kernels as _w
from deepcabac_py.errors import CorruptStreamError
from deepcabac_py.model.container import Mode, read_header
from deepcabac_py.model.parallel import POOL_MIN_ELEMENTS

DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}
WORDS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}


def _weights(rng, dtype_name: str, shape, x: np.ndarray | None = None) -> np.ndarray:
    """Bell-shaped values whose scale varies by row (what the classes model), or the values ``x``,
    as the dtype's carrier."""
    if x is None:
        rows = shape[0] if len(shape) > 1 else 1
        scale = np.exp2(rng.integers(-8, 0, size=(rows, 1)))
        x = (rng.standard_normal((rows, int(np.prod(shape)) // rows)) * scale).reshape(shape)
    if dtype_name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(DTYPES[dtype_name])


def _with_specials(a: np.ndarray, dtype_name: str, rng) -> np.ndarray:
    w = a.reshape(-1).view(WORDS[dtype_name]).copy()
    W, M = floatcoder.FORMATS[dtype_name]
    e_all = ((1 << (W - 1 - M)) - 1) << M
    specials = [e_all | 1, e_all | ((1 << M) - 1), e_all, e_all | (1 << (W - 1)), 1 << (W - 1), 1, (1 << M) - 1,
                e_all | (1 << (M - 1)) | 5]  # NaN payloads, +-inf, -0, denormals, a quiet NaN with payload
    where = rng.choice(w.size, size=min(len(specials), w.size), replace=False)
    w[where] = np.array(specials[:where.size], dtype=np.uint64).astype(w.dtype)
    return w.view(a.dtype).reshape(a.shape)


def _roundtrip(a: np.ndarray, dtype_name: str) -> bytes:
    seg = floatcoder.segment_length(a.shape)
    flat = a.reshape(-1)
    data = floatcoder.encode_chunk(flat, dtype_name, seg)
    out = np.empty_like(flat)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert out.view(np.uint8).tobytes() == flat.view(np.uint8).tobytes()
    return data


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (7,), (300,), (33, 40), (5, 3, 3, 3), (2, 70000)])
def test_roundtrip_is_bit_exact(dtype_name, shape):
    rng = np.random.default_rng(len(shape) * 7 + shape[0])
    _roundtrip(_with_specials(_weights(rng, dtype_name, shape), dtype_name, rng), dtype_name)


@pytest.mark.parametrize("trailing", [False, True])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_a_substream_is_decoded_where_it_lies(dtype_name, trailing):
    # (the decoder reads the words in place: at any byte offset, in read-only and writable buffers,
    # followed by other bytes or by nothing)
    rng = np.random.default_rng(5)
    flat = _grid_weights(rng, dtype_name, (30, 50)).reshape(-1)
    seg = floatcoder.segment_length((30, 50))
    data = (floatcoder.encode_trailing if trailing else floatcoder.encode_chunk)(flat, dtype_name, seg)
    for offset in range(4):
        for after in (b"", b"\xff" * 7):
            buffer = b"\xee" * offset + data + after
            for source in (buffer, bytearray(buffer)):
                out = np.empty_like(flat)
                floatcoder.decode_chunk(memoryview(source)[offset:offset + len(data)], dtype_name, seg, out)
                assert out.view(np.uint8).tobytes() == flat.view(np.uint8).tobytes()


def _random_floats(rng, dtype_name: str, n: int, low_zero) -> np.ndarray:
    """Any bits of ``n`` floats (as the dtype's carrier), the ``low_zero`` (per element, or one
    count) lowest mantissa bits cleared."""
    W, M = floatcoder.FORMATS[dtype_name]
    bits = rng.integers(0, 2**63, size=n, dtype=np.uint64) ^ (rng.integers(0, 2, size=n, dtype=np.uint64) << 63)
    bits >>= np.uint64(64 - W)
    bits &= ~np.uint64(0) << np.minimum(np.asarray(low_zero, dtype=np.uint64), np.uint64(M))
    words = bits.astype(WORDS[dtype_name])
    return words.view(DTYPES[dtype_name]) if dtype_name != "bfloat16" else words


@settings(max_examples=60, deadline=None)
@given(dtype_name=st.sampled_from(sorted(DTYPES)), n=st.integers(1, 3000), seg=st.integers(1, 700),
       seed=st.integers(0, 2**32 - 1), low_zero=st.integers(0, 60))
def test_any_bits_roundtrip(dtype_name, n, seg, seed, low_zero):
    # (low bits zero in every element: what the segments drop)
    flat = _random_floats(np.random.default_rng(seed), dtype_name, n, low_zero)
    data = floatcoder.encode_chunk(flat, dtype_name, seg)
    out = np.empty_like(flat)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert out.view(np.uint8).tobytes() == flat.view(np.uint8).tobytes()


@settings(max_examples=40, deadline=None)
@given(dtype_name=st.sampled_from(["bfloat16", "float16"]), n=st.integers(1, 3000), seg=st.integers(1, 700),
       seed=st.integers(0, 2**32 - 1))
def test_the_16bit_split_gives_the_reference_bytes_whatever_the_segments_drop(dtype_name, n, seg, seed):
    """The vector split of 16-bit floats runs where the raw bits' position is a whole byte; the
    segments that drop low bits (about half here, 1 to 3 bits) move it off and back."""
    rng = np.random.default_rng(seed)
    drops = rng.integers(1, 4, size=-(-n // seg)) * (rng.random(-(-n // seg)) < 0.5)
    flat = _random_floats(rng, dtype_name, n, np.repeat(drops, seg)[:n])
    data = floatcoder.encode_chunk(flat, dtype_name, seg, wide=False)
    words = [int(v) for v in flat.view(np.uint16)]
    assert ref_encode(words, dtype_name, seg) == data
    out = np.empty_like(flat)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert out.view(np.uint16).tolist() == words


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_match_the_python_reference(dtype_name, seed):
    rng = np.random.default_rng(seed)
    shape = [(40, 30), (700,), (9, 4, 3, 3)][seed]
    a = _with_specials(_weights(rng, dtype_name, shape), dtype_name, rng)
    if seed == 1:  # some segments with zero low bits
        w = a.view(WORDS[dtype_name])
        w[:300] &= np.array(~((1 << 5) - 1) & ((1 << 64) - 1), dtype=np.uint64).astype(w.dtype)
    seg = floatcoder.segment_length(a.shape)
    words = [int(v) for v in a.reshape(-1).view(WORDS[dtype_name])]
    data = floatcoder.encode_chunk(a.reshape(-1), dtype_name, seg)
    # (seed 1 zeroes low bits in part of a segment: float32 codes them by mode 3, float64 by mode 2)
    trailing = {"float32": floatcoder.TZ_BYTE, "float64": 2}.get(dtype_name) if seed == 1 else None
    assert data[0] == trailing or trailing is None and data[0] & floatcoder.TANS_FLAG and data[0] & 0x7F in (0, 1)
    if data[0] == floatcoder.TZ_BYTE:
        assert ref_encode_tz(words, seg) == data
    else:
        assert (ref_encode_trailing if data[0] == 2 else ref_encode)(words, dtype_name, seg) == data
    assert ref_decode(data, dtype_name, seg, len(words)) == words


@settings(max_examples=20, deadline=None)
@given(dtype_name=st.sampled_from(sorted(DTYPES)), n=st.integers(1, 400), seg=st.integers(1, 300),
       seed=st.integers(0, 2**32 - 1), low_zero=st.integers(0, 12))
def test_rans_substreams_of_the_version_7_writer_still_decode(dtype_name, n, seg, seed, low_zero):
    # (the writer now codes the symbols by tANS; streams from before keep theirs by rANS)
    flat = _random_floats(np.random.default_rng(seed), dtype_name, n, low_zero)
    words = [int(v) for v in flat.view(WORDS[dtype_name])]
    data = ref_encode(words, dtype_name, seg, tans=False)
    assert data[0] in (0, 1)
    out = np.empty_like(flat)
    floatcoder.decode_chunk(data, dtype_name, seg, out, revision=0)
    assert out.view(np.uint8).tobytes() == flat.view(np.uint8).tobytes()


def _class_tables_layout(data: bytes, pos: int, nseg: int, at: dict[str, int]) -> int:
    """Where the class count, classes, table size and tables begin (into ``at``), from ``pos``;
    where they end."""
    at["class count and table precision"] = pos
    klog = data[pos]
    pos += 2
    if klog:
        at["classes"] = pos
        pos += -(-nseg // 2)
    at["table size"] = pos
    at["tables"] = pos + 4
    return pos + 4 + int.from_bytes(data[pos:pos + 4], "little")


def _tans_layout(data: bytes, nseg: int) -> dict[str, int]:
    """Where each field of a tANS substream begins (the fields as the decoder names them)."""
    at = {"low-bit count" if data[0] == floatcoder.TANS_FLAG else "low-bit counts": 1}
    pos = _class_tables_layout(data, 2 if data[0] == floatcoder.TANS_FLAG else 1 + nseg, nseg, at)
    at["coder states"] = pos
    at["coder size"] = pos + 9
    at["coder words"] = pos + 13
    at["raw bits"] = pos + 13 + 4 * int.from_bytes(data[pos + 9:pos + 13], "little")
    return at


def _tans_chunk(seed: int, dtype_name: str, shape) -> tuple[np.ndarray, int, bytes, dict[str, int]]:
    """Weights of ``shape`` (rows of different scales), their segment length, their substream
    and where its fields begin."""
    a = _weights(np.random.default_rng(seed), dtype_name, shape).reshape(-1)
    seg = floatcoder.segment_length(shape)
    data = floatcoder.encode_chunk(a, dtype_name, seg)
    return a, seg, data, _tans_layout(data, -(-a.size // seg))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_a_tans_substream_with_impossible_fields_is_refused(dtype_name):
    a, seg, data, fields = _tans_chunk(9, dtype_name, (20, 300))
    precision = data[fields["class count and table precision"] + 1]
    at, words_at = fields["coder states"], fields["coder words"]

    def refused(bad: bytes, what: str) -> None:
        _refused(bad, dtype_name, seg, a, what)

    # an initial state beyond the table, a first bit beyond its word, bits set before the first bit
    refused(data[:at + 1] + (1 << precision).to_bytes(2, "little") + data[at + 3:], "initial state")
    refused(bytes([*data[:at], 32]) + data[at + 1:], "first bit")
    refused(bytes([*data[:at], max(data[at], 1)]) + data[at + 1:words_at] + bytes([data[words_at] | 1])
            + data[words_at + 1:], "before the coder's first bit")
    out = np.empty_like(a)
    floatcoder.decode_chunk(data, dtype_name, seg, out)  # (the original decodes)
    assert out.view(np.uint8).tobytes() == a.view(np.uint8).tobytes()


def _refused(bad: bytes, dtype_name: str, seg: int, like: np.ndarray, what: str) -> None:
    with pytest.raises(CorruptStreamError, match=what):
        floatcoder.decode_chunk(bad, dtype_name, seg, np.empty_like(like))


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_a_tans_substream_cut_short_names_the_field_it_ends_in(dtype_name, mode):
    a, seg, data, at = _tans_chunk(11, dtype_name, (40, 300))
    if mode:  # (segments dropping different low bits)
        w = a.view(WORDS[dtype_name])
        w[:300] &= np.array(~7 & ((1 << 64) - 1), dtype=np.uint64).astype(w.dtype)
        data = floatcoder.encode_chunk(a, dtype_name, seg)
        at = _tans_layout(data, -(-a.size // seg))
    assert data[0] == floatcoder.TANS_FLAG | mode
    assert "classes" in at  # (the rows' scales differ: several classes)
    fields = sorted(at.items(), key=lambda kv: kv[1])
    for cut in range(1, len(data)):
        field = [name for name, start in fields if start <= cut][-1]
        _refused(data[:cut], dtype_name, seg, a, f"ends inside its {field}|tables do not fill")
    _refused(data + bytes(4), dtype_name, seg, a, "4 bytes after the raw bits")
    # (a message is worded for its own error only: fuzzing found 2**20000 being written for another)
    _refused(data + bytes(20000), dtype_name, seg, a, "20000 bytes after the raw bits")


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_a_tans_substream_with_impossible_tables_is_refused(dtype_name):
    a, seg, data, at = _tans_chunk(12, dtype_name, (40, 300))
    cc, classes = at["class count and table precision"], at["classes"]
    klog = data[cc]

    def refused(bad: bytes, what: str) -> None:
        _refused(bad, dtype_name, seg, a, what)

    W, M = floatcoder.FORMATS[dtype_name]
    refused(bytes([data[0], M + 1]) + data[2:], f"drops more low bits than a {dtype_name} mantissa has")
    refused(data[:cc] + bytes([5]) + data[cc + 1:], "32 classes")
    for precision in (7, 14):
        refused(data[:cc + 1] + bytes([precision]) + data[cc + 2:], f"tANS tables of {precision}-bit precision")
    if klog < 4:  # (a segment's class beyond the class count)
        refused(data[:classes] + bytes([data[classes] | 15]) + data[classes + 1:], f"of {1 << klog}")
    # (a table whose frequencies do not sum to the precision)
    other = data[cc + 1] + (1 if data[cc + 1] < 13 else -1)
    refused(data[:cc + 1] + bytes([other]) + data[cc + 2:], "frequency table is invalid")


def test_the_classes_and_frequencies_match_the_python_reference():
    from reference_float_coder import _classes16, _normalized

    from deepcabac_py.entropy import _float_kernels
    rng = np.random.default_rng(13)
    for _ in range(300):
        nu, bits = int(rng.integers(1, 200)), int(rng.choice([8, 10, 12, 13, 14]))
        counts = (rng.pareto(0.7, nu) * rng.choice([1, 10, 1000])).astype(np.int64) * rng.integers(0, 2, nu)
        counts[int(rng.integers(nu))] += 1
        if nu > 1 << bits:
            continue
        out = np.zeros(nu, dtype=np.int64)
        _float_kernels.normalize_row(counts, bits, out)
        assert out.tolist() == _normalized(counts.tolist(), bits)
        means = rng.integers(0, 6, size=int(rng.integers(1, 100))).astype(np.float64)  # (ties)
        classes16 = np.empty(means.size, dtype=np.uint8)
        _float_kernels.rank_classes(means, classes16, 1, means.size)  # (segments of one element)
        assert classes16.tolist() == _classes16(means.tolist())


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_a_chunk_past_the_small_histograms_matches_the_python_reference(dtype_name):
    # (from 2**16 elements the encoder counts its symbols over the whole alphabet, per class)
    rng = np.random.default_rng(14)
    a = _with_specials(_weights(rng, dtype_name, (80, 1000)), dtype_name, rng).reshape(-1)
    seg = floatcoder.segment_length((80, 1000))
    words = [int(v) for v in a.view(WORDS[dtype_name])]
    data = floatcoder.encode_chunk(a, dtype_name, seg)
    assert data[0] & floatcoder.TANS_FLAG and ref_encode(words, dtype_name, seg) == data


def _grid_weights(rng, dtype_name: str, shape) -> np.ndarray:
    """Bell-shaped values on one fine grid (integers times 2**-40): below the top bits, the trailing
    zeros grow as the exponent falls, as in weights made of products of rounded values."""
    x = np.ldexp(np.round(rng.standard_normal(shape) * 2.0 ** rng.integers(10, 18)), -40)
    if dtype_name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(DTYPES[dtype_name])


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32", "float32 by rANS", "float64"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trailing_mode_matches_the_python_reference(dtype_name, seed):
    # (float32's mode 3; its mode 2, which the version-8 writer took, as it still decodes it)
    rans = dtype_name == "float32 by rANS"
    dtype_name = dtype_name.split()[0]
    rng = np.random.default_rng(seed)
    shape = [(40, 30), (700,), (9, 4, 3, 3)][seed]
    a = _with_specials(_grid_weights(rng, dtype_name, shape), dtype_name, rng).reshape(-1)
    seg = floatcoder.segment_length(shape)
    words = [int(v) for v in a.view(WORDS[dtype_name])]
    data = floatcoder.encode_trailing(a, dtype_name, seg, rans=rans)
    if dtype_name == "float32" and not rans:
        assert data[0] == floatcoder.TZ_BYTE and ref_encode_tz(words, seg) == data
    else:
        assert data[0] == 2 and ref_encode_trailing(words, dtype_name, seg) == data
    assert ref_decode(data, dtype_name, seg, len(words)) == words
    out = np.empty_like(a)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert out.view(np.uint8).tobytes() == a.view(np.uint8).tobytes()


@settings(max_examples=40, deadline=None)
@given(dtype_name=st.sampled_from(sorted(DTYPES)), n=st.integers(1, 3000), seg=st.integers(1, 700),
       seed=st.integers(0, 2**32 - 1), low_zero=st.integers(0, 60), rans=st.booleans())
def test_any_bits_roundtrip_in_the_trailing_mode(dtype_name, n, seg, seed, low_zero, rans):
    rng = np.random.default_rng(seed)
    # (low bits zero in some elements, as many as each likes up to low_zero)
    flat = _random_floats(rng, dtype_name, n, rng.integers(0, low_zero + 1, size=n))
    data = floatcoder.encode_trailing(flat, dtype_name, seg, rans=rans)
    out = np.empty_like(flat)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert out.view(np.uint8).tobytes() == flat.view(np.uint8).tobytes()


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_the_trailing_mode_is_taken_where_it_pays(dtype_name):
    rng = np.random.default_rng(3)
    grid, plain = _grid_weights(rng, dtype_name, (16, 256)), _weights(rng, dtype_name, (16, 256))
    seg = floatcoder.segment_length(grid.shape)
    chosen = floatcoder.encode_chunk(grid.reshape(-1), dtype_name, seg)
    segments = floatcoder.encode_chunk(plain.reshape(-1), dtype_name, seg)
    bit, mode = (floatcoder.TZ_REVISION, 3) if dtype_name == "float32" else (floatcoder.TRAILING_REVISION, 2)
    assert chosen[0] == (floatcoder.TZ_BYTE if mode == 3 else 2)
    assert segments[0] in (floatcoder.TANS_FLAG, floatcoder.TANS_FLAG | 1)
    assert floatcoder.revision_of([segments, chosen], dtype_name) == floatcoder.TANS_REVISION | bit
    assert floatcoder.revision_of([segments], dtype_name) == floatcoder.TANS_REVISION
    assert floatcoder.revision_of([chosen], dtype_name) == bit
    # (the same grid by the segments' drop alone: the per-element counts save more than a tenth)
    words = [int(v) for v in grid.reshape(-1).view(WORDS[dtype_name])]
    assert len(chosen) < 0.9 * len(ref_encode(words, dtype_name, seg))
    out = np.empty_like(grid.reshape(-1))
    others = floatcoder.TRAILING_REVISION | floatcoder.TANS_REVISION | floatcoder.TZ_REVISION
    for revision in (0, others & ~bit):  # (an entry without the bit has no mode 2 or 3)
        with pytest.raises(CorruptStreamError, match=f"low-bit mode {mode}"):
            floatcoder.decode_chunk(chosen, dtype_name, seg, out, revision=revision)
    with pytest.raises(CorruptStreamError, match="symbols by tANS"):  # (nor tANS without its own)
        floatcoder.decode_chunk(segments, dtype_name, seg, out, revision=others & ~floatcoder.TANS_REVISION)


@settings(max_examples=40, deadline=None)
@given(dtype_name=st.sampled_from(["bfloat16", "float16", "float32"]),
       sizes=st.lists(st.integers(1, floatcoder.SMALL_TOGETHER), min_size=1, max_size=10),
       seed=st.integers(0, 2**32 - 1))
def test_small_chunks_coded_together_are_the_bytes_each_would_be_alone(dtype_name, sizes, seed):
    rng = np.random.default_rng(seed)
    W, M = floatcoder.FORMATS[dtype_name]
    # (any bits, low bits zero per chunk or per element, values on a grid: every mode a small chunk can take)
    chunks = []
    for n in sizes:
        kind = rng.integers(3)
        if kind == 2:
            chunks.append(_grid_weights(rng, dtype_name, (n,)))
        else:
            low = rng.integers(0, M + 1) if kind == 0 else rng.integers(0, M + 1, size=n)
            chunks.append(_random_floats(rng, dtype_name, n, low))
    segs = [int(rng.integers(1, 700)) for _ in sizes]
    together = floatcoder.encode_small_chunks(chunks, dtype_name, segs)
    assert [bytes(b) for b in together] == [floatcoder.encode_chunk(c, dtype_name, s) for c, s in zip(chunks, segs)]


def test_small_float32_chunks_choose_their_mode_as_each_would_alone():
    """Grid values, more and more of them replaced by plain ones: the trailing zeros' promise falls
    through the share that takes mode 3 untried and the share that codes a chunk both ways."""
    rng = np.random.default_rng(11)
    chunks = []
    for f in np.linspace(0.0, 1.0, 121):
        x = np.ldexp(np.round(rng.standard_normal(2048) * 2.0 ** 14), -40).astype(np.float32)
        plain = rng.random(2048) < (0.92 + 0.05 * f if f > 0.2 else f)
        x[plain] = (rng.standard_normal(int(plain.sum())) * 2.0 ** -26).astype(np.float32)
        chunks.append(x)
    promises = [_trailing_kernels.trailing_promise(c.view(np.uint32), 32, 23, 256,
                                                np.zeros(8, dtype=np.uint8)) for c in chunks]
    gain = floatcoder.TRAILING_GAIN
    assert any(p >= floatcoder.TRAILING_SURE * gain for p in promises)
    assert any(gain <= p < floatcoder.TRAILING_SURE * gain for p in promises)
    assert any(p < gain for p in promises)
    together = [bytes(b) for b in floatcoder.encode_small_chunks(chunks, "float32", [256] * len(chunks))]
    alone = [floatcoder.encode_chunk(c, "float32", 256) for c in chunks]
    assert together == alone
    assert {b[0] for b in alone} >= {floatcoder.TZ_BYTE, floatcoder.TANS_FLAG}


def test_only_small_chunks_are_coded_together():
    big = np.zeros(floatcoder.SMALL_TOGETHER + 1, dtype=np.float32)
    with pytest.raises(ValueError, match="at most"):
        floatcoder.encode_small_chunks([big], "float32", [256])
    with pytest.raises(ValueError, match="at most"):
        floatcoder.encode_small_chunks([np.zeros(8)], "float64", [256])
    with pytest.raises(ValueError, match="one segment length each"):
        floatcoder.encode_small_chunks([np.zeros(8, dtype=np.float32)], "float32", [])
    assert floatcoder.encode_small_chunks([], "float16", []) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_model_of_small_tensors_codes_them_together_in_the_bytes_of_one_by_one(dtype, monkeypatch):
    rng = np.random.default_rng(4)
    model = {f"layer{i}.{kind}": torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.1).to(dtype)
             for i in range(30) for kind, shape in (("weight", (int(rng.integers(1, 40)), 24)), ("bias", (24,)))}
    model["big"] = torch.from_numpy(rng.standard_normal((64, 100)).astype(np.float32)).to(dtype)  # (alone, between)
    model.update({f"tail{i}": torch.from_numpy(rng.standard_normal(300).astype(np.float32)).to(dtype)
                  for i in range(5)})
    calls = []
    together = floatcoder.encode_small_chunks
    monkeypatch.setattr(floatcoder, "encode_small_chunks", lambda *a: calls.append(len(a[0])) or together(*a))
    data = dc.encode_model(model, keep_exact=True, threads=1)
    assert sum(calls) == len(model) - 1 and len(calls) <= 2
    monkeypatch.setattr(floatcoder, "codes_together", lambda dtype_name, numel: False)
    assert dc.encode_model(model, keep_exact=True, threads=1) == data
    assert dc.encode_model(model, keep_exact=True, threads=2) == data
    out = dc.decode_model(data)
    assert all(torch.equal(out[k].view(torch.int8), v.view(torch.int8)) for k, v in model.items())


def test_mode_3_is_for_float32_only():
    grid = _grid_weights(np.random.default_rng(8), "float32", (16, 256)).reshape(-1)
    seg = floatcoder.segment_length((16, 256))
    data = floatcoder.encode_trailing(grid, "float32", seg)
    assert data[0] == floatcoder.TZ_BYTE
    with pytest.raises(CorruptStreamError, match="only float32"):
        floatcoder.decode_chunk(data, "float64", seg, np.empty(grid.shape[0], dtype=np.float64))


def test_float32_holding_bfloat16_drops_the_zero_half():
    x = torch.randn(256, 512).to(torch.bfloat16)
    as_bf16 = _roundtrip(x.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    as_f32 = _roundtrip(x.float().numpy(), "float32")
    assert abs(len(as_f32) - len(as_bf16)) < 0.01 * len(as_bf16)  # the 16 zero bits cost nothing
    assert x.numel() * 4 / len(as_f32) > 2.5


def test_classes_follow_the_row_scale():
    """Rows of different scales: the per-class tables beat one table for the whole chunk."""
    rng = np.random.default_rng(3)
    a = _weights(rng, "float32", (256, 512))
    data = _roundtrip(a, "float32")
    one_class = floatcoder.encode_chunk(a.reshape(-1), "float32", a.size)  # one segment, one class
    assert len(data) < 0.97 * len(one_class)


def test_encode_model_keeps_exact_floats_losslessly_and_small():
    rng = np.random.default_rng(4)
    model = {"w": torch.from_numpy(_weights(rng, "float32", (128, 300))).to(torch.bfloat16),  # (on the pool)
             "h": torch.from_numpy(_with_specials(_weights(rng, "float16", (2000,)), "float16", rng)),
             "tiny": np.array([np.nan, -0.0], dtype=np.float32)}
    data = dc.encode_model(model, keep_exact=True, threads=2)
    modes = {e.name: e.mode for e in read_header(data).tensors}
    assert modes == {"w": Mode.FLOAT, "h": Mode.FLOAT, "tiny": Mode.RAW}  # (two floats: raw is smaller)
    assert len(data) < 0.8 * (128 * 300 * 2 + 2000 * 2)
    back = dc.decode_model(data, threads=1)
    assert back["w"].view(torch.int16).equal(model["w"].view(torch.int16))
    assert back["h"].view(torch.int16).equal(model["h"].view(torch.int16))
    assert back["tiny"].tobytes() == model["tiny"].tobytes()
    assert dc.encode_model(model, keep_exact=True, threads=1) == data


@pytest.mark.parametrize("threads", [1, 2])
def test_small_float_tensors_decode_together_and_damage_names_its_tensor(monkeypatch, threads):
    # (the small float tensors of a dtype decode in one kernel call, across the large and integer
    # tensors between them)
    rng = np.random.default_rng(5)
    model: dict = {}
    for i in range(12):
        values = _weights(rng, "float32", (int(rng.integers(150, 400)),))
        model[f"s{i}"] = torch.from_numpy(values).to((torch.float32, torch.bfloat16, torch.float16)[i // 4])
        if i == 5:
            model["large"] = torch.from_numpy(_weights(rng, "float32", (80, 100)))
        if i == 6:
            model["ints"] = torch.arange(200, dtype=torch.int32)
    data = dc.encode_model(model, keep_exact=True, threads=1)
    modes = {e.name: e.mode for e in read_header(data).tensors}
    assert all(modes[f"s{i}"] == Mode.FLOAT for i in range(12))
    runs: list[int] = []
    together = floatcoder.decode_tans_chunks
    monkeypatch.setattr(floatcoder, "decode_tans_chunks", lambda *a: runs.append(len(a[2])) or together(*a))
    back = dc.decode_model(data, threads=threads)
    assert runs == [4, 4, 4]  # (s0-s3 | s4-s5, s6 after large, s7 after ints | s8-s11)
    for name, t in model.items():
        wide = torch.int32 if t.element_size() == 4 else torch.int16
        assert back[name].view(wide).equal(t.view(wide)), name
    assert len({back[name].untyped_storage().data_ptr() for name in model}) == len(model)  # (none shares)
    # damage inside one of them (checksums made to match) is reported as its own chunk's
    header = read_header(data)
    e = next(t for t in header.tensors if t.name == "s9")
    damaged = bytearray(data)
    damaged[header.header_size + e.offset + 1] = 0xFF  # (its low-bit count or class count: impossible)
    damaged = fix_checksums(bytes(damaged))
    substream = damaged[header.header_size + e.offset:][:e.size]
    with pytest.raises(CorruptStreamError) as alone:
        floatcoder.decode_chunk(substream, "float16", floatcoder.segment_length(e.shape),
                                np.empty(e.numel, dtype=np.float16), "tensor 's9', chunk 0", e.coder_param)
    with pytest.raises(CorruptStreamError) as together_exc:
        dc.decode_model(damaged, threads=threads)
    assert str(together_exc.value) == str(alone.value)


def _flipped(data: bytes, rng) -> list[bytes]:
    out = []
    for _ in range(40):
        b = bytearray(data)
        b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("mode, coder_param", [(3, 0), (3, 3), (3, 16), (5, 0), (5, 4), (5, 16)])
def test_a_float_entry_that_misstates_its_revision_is_refused(mode, coder_param):
    from deepcabac_py.model.container import pack_header
    rng = np.random.default_rng(4)
    rows = 32 if mode == 3 else 64  # (a chunk of 2**14 elements takes mode 3, of 2**15 mode 5)
    data = dc.encode_model({"w": _grid_weights(rng, "float32", (rows, 512))}, keep_exact=True, threads=1)
    h = read_header(data)
    version, bit = (9, floatcoder.TZ_REVISION) if mode == 3 else (12, floatcoder.TZ_WIDE_REVISION)
    assert h.version == version and h.tensors[0].coder_param == bit
    h.tensors[0].coder_param = coder_param  # (0, 3 and 4: the mode without its bit; 16: another mode's)
    bad = pack_header(h.qp, h.qp_1d, h.qp_density, h.metadata, h.tensors) + data[h.header_size:]
    with pytest.raises(CorruptStreamError, match="coder parameter 16" if coder_param == 16 else f"low-bit mode {mode}"):
        dc.decode_model(bad)


def test_a_mode_5_entry_in_an_older_stream_is_refused_and_reported_as_what_it_is():
    import struct

    from helpers import reseal_header

    from deepcabac_py.model.report import build_report
    grid = _grid_weights(np.random.default_rng(4), "float32", (64, 512))
    data = dc.encode_model({"w": grid}, keep_exact=True, threads=1)
    h = read_header(data)
    assert h.version == 12 and h.tensors[0].coder_param == floatcoder.TZ_WIDE_REVISION
    # (bit 5 of a FLOAT entry's coder parameter is mode 5's, not the linear prediction's)
    assert not h.tensors[0].is_linear and build_report(h).tensors[0].mode == "FLOAT+TZ"
    old = bytearray(data)
    struct.pack_into("<H", old, 8, 11)
    with pytest.raises(CorruptStreamError, match=r"coder parameter 32 \(the substreams' low-bit modes\) needs "
                                                  "format version 12, the stream says 11"):
        dc.decode_model(reseal_header(old))


@pytest.mark.parametrize("trailing", [False, True, "by rANS"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_damaged_substreams_are_refused_or_decode_within_bounds(dtype_name, trailing):
    rng = np.random.default_rng(5)
    a = (_grid_weights if trailing else _weights)(rng, dtype_name, (20, 64)).reshape(-1)
    seg = floatcoder.segment_length((20, 64))
    if trailing:
        data = floatcoder.encode_trailing(a, dtype_name, seg, rans=trailing == "by rANS")
    else:
        data = floatcoder.encode_chunk(a, dtype_name, seg)
    for bad in [data[:k] for k in (0, 1, 3, len(data) // 2, len(data) - 1)] + [data + b"\x00"]:
        with pytest.raises(CorruptStreamError):
            floatcoder.decode_chunk(bad, dtype_name, seg, np.empty_like(a))
    for bad in _flipped(data, rng):  # (a flipped raw bit is another value: the payload's CRC tells)
        try:
            floatcoder.decode_chunk(bad, dtype_name, seg, np.empty_like(a))
        except CorruptStreamError as exc:
            assert "substream" in str(exc)


# --- file-exact restore --------------------------------------------------------------------------

def _handwritten_safetensors(path, rng) -> None:
    """A safetensors file as another writer might lay it out: metadata last, keys unsorted, the data
    in another order than the header's, extra padding."""
    import json
    import struct
    w = torch.from_numpy(_weights(rng, "float32", (64, 300))).to(torch.bfloat16)
    h = _weights(rng, "float16", (40, 30))
    ids = np.arange(7, dtype=np.int64)
    blobs = {"ids": ids.tobytes(), "w": w.view(torch.int16).numpy().tobytes(), "h": h.tobytes()}
    offsets, pos = {}, 0
    for name in ("ids", "w", "h"):
        offsets[name] = [pos, pos + len(blobs[name])]
        pos += len(blobs[name])
    header = {"w": {"dtype": "BF16", "shape": [64, 300], "data_offsets": offsets["w"]},
              "h": {"dtype": "F16", "shape": [40, 30], "data_offsets": offsets["h"]},
              "ids": {"dtype": "I64", "shape": [7], "data_offsets": offsets["ids"]},
              "__metadata__": {"format": "pt", "note": "hand"}}
    text = json.dumps(header, indent=1).encode() + b"    "
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs[n] for n in ("ids", "w", "h")))


def test_lossless_safetensors_file_comes_back_byte_for_byte(tmp_path):
    src = tmp_path / "m.safetensors"
    _handwritten_safetensors(src, np.random.default_rng(6))
    dc.encode_file(src, tmp_path / "m.dcb", keep_exact=True)
    assert "safetensors_header" in read_header((tmp_path / "m.dcb").read_bytes()).metadata
    dc.decode_file(tmp_path / "m.dcb", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == src.read_bytes()
    # one in this library's own layout carries no copy of its header
    dc.decode_file(tmp_path / "m.dcb", tmp_path / "ours.safetensors", names="*")
    dc.encode_file(tmp_path / "ours.safetensors", tmp_path / "ours.dcb", keep_exact=True)
    assert "safetensors_header" not in read_header((tmp_path / "ours.dcb").read_bytes()).metadata


def test_a_kept_header_that_does_not_match_is_refused(tmp_path):
    from deepcabac_py.model.container import pack_header
    src = tmp_path / "m.safetensors"
    _handwritten_safetensors(src, np.random.default_rng(7))
    dc.encode_file(src, tmp_path / "m.dcb", keep_exact=True)
    data = (tmp_path / "m.dcb").read_bytes()
    h = read_header(data)
    meta = dict(h.metadata, safetensors_header=h.metadata["safetensors_header"].replace('"F16"', '"F32"'))
    (tmp_path / "bad.dcb").write_bytes(pack_header(h.qp, h.qp_1d, h.qp_density, meta, h.tensors)
                                       + data[h.header_size:])
    with pytest.raises(CorruptStreamError, match="safetensors header"):
        dc.decode_file(tmp_path / "bad.dcb", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_lossless_directory_round_trip_is_byte_for_byte(tmp_path):
    import json
    rng = np.random.default_rng(8)
    model = tmp_path / "hf"
    model.mkdir()
    _handwritten_safetensors(model / "model-00001-of-00002.safetensors", rng)
    from safetensors.numpy import save_file
    save_file({"lm_head": _weights(rng, "float32", (16, 300))}, str(model / "model-00002-of-00002.safetensors"),
              metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {"w": "model-00001-of-00002.safetensors",
             "h": "model-00001-of-00002.safetensors", "ids": "model-00001-of-00002.safetensors",
             "lm_head": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (model / "config.json").write_text('{"model_type": "toy"}\n')
    dc.encode_directory(model, tmp_path / "enc", keep_exact=True)
    dc.decode_directory(tmp_path / "enc", tmp_path / "back")
    files = sorted(p.name for p in model.iterdir())
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == files
    for name in files:
        assert (tmp_path / "back" / name).read_bytes() == (model / name).read_bytes(), name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nseg=st.integers(1, 40), alphabet=st.sampled_from([128, 1024]),
       spread=st.integers(1, 60))
def test_class_choice_matches_the_python_reference(seed, nseg, alphabet, spread):
    from reference_float_coder import choose_classes as ref_choose

    from deepcabac_py.entropy import _float_kernels
    rng = np.random.default_rng(seed)
    hist = np.zeros((16, alphabet), dtype=np.int64)
    for j in range(nseg):  # segments as the encoder ranks them into 16 classes
        centre = int(rng.integers(0, alphabet - spread))
        np.add.at(hist[j * 16 // nseg], rng.integers(centre, centre + spread, size=int(rng.integers(1, 400))), 1)
    freq = np.zeros((16, alphabet), dtype=np.int32)
    klog, precision = _float_kernels.choose_classes(hist, nseg, _float_kernels.cost_table(), 14, freq)
    assert (klog, precision) == ref_choose(hist, nseg)[:2]
    assert freq[:1 << klog].tolist() == ref_choose(hist, nseg)[2]
    assert (freq[:1 << klog].sum(axis=1) == 1 << precision).all()


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_lossless_pt_and_npz_keep_every_bit_and_the_structure(tmp_path, suffix):
    rng = np.random.default_rng(9)
    w = _with_specials(_weights(rng, "float32", (48, 100)), "float32", rng)
    h = _with_specials(_weights(rng, "float16", (30, 40)), "float16", rng)
    d = _with_specials(_weights(rng, "float64", (20, 30)), "float64", rng)
    if suffix == ".pt":
        obj = {"model": {"w": torch.from_numpy(w), "h": torch.from_numpy(h).to(torch.bfloat16),
                         "d": torch.from_numpy(d)}, "step": 7, "ids": torch.arange(5)}
        torch.save(obj, tmp_path / "m.pt")
    else:
        np.savez(tmp_path / "m.npz", w=w, h=h, d=d)
    dc.encode_file(tmp_path / f"m{suffix}", tmp_path / "m.dcb", keep_exact=True)
    assert {e.mode for e in read_header((tmp_path / "m.dcb").read_bytes()).tensors if e.dtype.is_float} == {Mode.FLOAT}
    dc.decode_file(tmp_path / "m.dcb", tmp_path / f"back{suffix}")
    if suffix == ".pt":
        back = torch.load(tmp_path / "back.pt", weights_only=True)
        assert back["step"] == 7 and back["ids"].equal(obj["ids"])
        for k, v in obj["model"].items():
            got = back["model"][k]
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.view(torch.uint8).equal(v.contiguous().view(torch.uint8)), k
    else:
        with np.load(tmp_path / "back.npz", allow_pickle=False) as z:
            for k, v in (("w", w), ("h", h), ("d", d)):
                assert z[k].dtype == v.dtype and z[k].tobytes() == v.tobytes(), k


# --- integers by magnitude class ----------------------------------------------------------------

INTS = ["int8", "int16", "int32", "int64"]


def _wide_ints(rng, dtype: str, n: int) -> np.ndarray:
    info = np.iinfo(dtype)
    scale = np.exp2(rng.integers(0, 8 * np.dtype(dtype).itemsize - 1, size=n)).astype(np.float64)
    v = np.clip(np.round(rng.laplace(size=n) * scale), info.min, info.max).astype(dtype)
    v[:4] = [info.min, info.max, 0, -1]
    return v


@pytest.mark.parametrize("dtype", INTS)
def test_magnitudes_match_the_python_reference(dtype):
    from reference_float_coder import encode_magnitudes as ref_encode_magnitudes
    rng = np.random.default_rng(10)
    v = _wide_ints(rng, dtype, 900)
    data = floatcoder.encode_magnitudes(v, 256)
    assert data == ref_encode_magnitudes([int(x) for x in v], 8 * v.itemsize, 256)
    out = np.empty_like(v)
    floatcoder.decode_magnitudes(data, 256, out)
    assert np.array_equal(out, v)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(INTS), n=st.integers(1, 3000), seg=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_any_integers_roundtrip_by_magnitude(dtype, n, seg, seed):
    v = _wide_ints(np.random.default_rng(seed), dtype, max(n, 4))[:n]
    out = np.empty_like(v)
    floatcoder.decode_magnitudes(floatcoder.encode_magnitudes(v, seg), seg, out)
    assert np.array_equal(out, v)


@pytest.mark.parametrize("dtype", INTS)
def test_damaged_magnitude_substreams_are_refused_or_decode_within_bounds(dtype):
    rng = np.random.default_rng(11)
    v = _wide_ints(rng, dtype, 2000)
    data = floatcoder.encode_magnitudes(v, 256)
    for bad in [data[:k] for k in (0, 1, 3, len(data) // 2, len(data) - 1)] + [data + b"\x00"]:
        with pytest.raises(CorruptStreamError):
            floatcoder.decode_magnitudes(bad, 256, np.empty_like(v))
    for bad in _flipped(data, rng):
        try:
            floatcoder.decode_magnitudes(bad, 256, np.empty_like(v))
        except CorruptStreamError as exc:
            assert "substream" in str(exc)


def test_wide_integers_go_to_the_magnitude_coder_and_narrow_ones_do_not():
    rng = np.random.default_rng(12)
    model = {"wide": _wide_ints(rng, "int32", 20000).reshape(100, 200), "ids": np.arange(5000),
             "huge": np.array([2**40, -2**62, 7] * 2000, dtype=np.int64),
             "small": (rng.laplace(size=100) * 1e5).astype(np.int32)}
    data = dc.encode_model(model)
    modes = {e.name: e.mode for e in read_header(data).tensors}
    assert modes == {"wide": Mode.MAGNITUDE, "ids": Mode.INTEGER, "huge": Mode.MAGNITUDE, "small": Mode.INTEGER}
    back = dc.decode_model(data)
    assert all(back[k].dtype == v.dtype and np.array_equal(back[k], v) for k, v in model.items())


@pytest.mark.parametrize("n", [1000, 70_000])  # (one histogram, then four partial ones)
def test_histogram_counts_each_symbol_in_its_segments_class(n):
    from deepcabac_py.entropy import _float_kernels

    assert 1000 < _float_kernels.PARTIAL_HISTOGRAMS_FROM <= 70_000
    rng = np.random.default_rng(n)
    seg = 300
    symbols = rng.integers(0, 40, n).astype(np.uint16)
    symbols[: n // 2] = 17  # (a long run of one symbol)
    classes = rng.integers(0, 16, -(-n // seg)).astype(np.uint8)
    hist = np.zeros((16, 64), dtype=np.int64)
    _float_kernels.histogram(symbols, seg, classes, hist)
    expected = np.zeros_like(hist)
    np.add.at(expected, (np.repeat(classes, seg)[:n], symbols), 1)
    np.testing.assert_array_equal(hist, expected)


@pytest.mark.parametrize("M", [7, 10])
@pytest.mark.parametrize("case", ["random", "largest exponents", "low bits zero"])
def test_segment_statistics_of_16_bit_floats_match_numpys(M, case):
    """Each segment's low bits zero in all its elements and mean exponent (read four elements to a
    64-bit word), against NumPy's, over segments whose lengths are not multiples of four and whose
    exponents' sums would overflow a 16-bit field without the blocks."""
    from deepcabac_py.entropy import _float_kernels

    rng = np.random.default_rng(M)
    n, seg = 70_003, 2_051
    words = rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
    if case == "largest exponents":
        words |= np.uint16(((1 << (15 - M)) - 1) << M)
    if case == "low bits zero":
        words &= np.uint16(~0b111 & 0xFFFF)
        words[rng.random(n) < 0.001] |= np.uint16(0b100)
    nseg = -(-n // seg)
    zeros, mean = np.empty(nseg, dtype=np.uint8), np.empty(nseg)
    _float_kernels.segment_stats(words, seg, 16, M, zeros, mean)
    for j in range(nseg):
        w = words[j * seg:(j + 1) * seg].astype(np.int64)
        low = int(np.bitwise_or.reduce(w & ((1 << M) - 1)))
        assert zeros[j] == (M if low == 0 else (low & -low).bit_length() - 1)
        assert mean[j] == ((w >> M) & ((1 << (15 - M)) - 1)).sum() / w.size


WIDE_DTYPES = ["bfloat16", "float16", "float32"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 900), seg=st.integers(256, 400), dtype_name=st.sampled_from(WIDE_DTYPES),
       seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 0.05, 3.0]), zeros=st.booleans())
def test_mode_4_matches_the_reference_and_round_trips(n, seg, dtype_name, seed, scale, zeros):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if zeros:  # (symbols from 0 up: bf16's and fp32's decoding tables then take 8-byte entries)
        x[::7] = 0
    # (no low bit dropped: mode 4 takes the chunk)
    words = {"bfloat16": lambda: ((x.view(np.uint32) >> 16) | 1).astype(np.uint16),
             "float16": lambda: x.astype(np.float16).view(np.uint16) | 1,
             "float32": lambda: x.view(np.uint32) | 1}[dtype_name]()
    values = words.view(np.float32) if dtype_name == "float32" else words
    data = floatcoder.encode_chunk(values, dtype_name, seg, wide=True)
    assert data == ref_encode_wide([int(w) for w in words], dtype_name, seg)
    out = np.zeros(n, dtype=words.dtype)
    floatcoder.decode_chunk(data, dtype_name, seg, out.view(np.float32) if dtype_name == "float32" else out)
    assert np.array_equal(out, words)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 900), seg=st.integers(256, 400), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 0.05, 3.0]), case=st.sampled_from(["weights", "zeros", "any bits", "odd segment"]))
def test_mode_6_matches_the_reference_and_round_trips(n, seg, seed, scale, case):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    words = x.view(np.uint32) & np.uint32(0xFFFF0000)  # (bfloat16 values)
    if case == "zeros":  # (a segment of zeros drops every bit: mode 4 refuses the halves, tANS takes them)
        words[:seg] = 0
    elif case == "any bits":  # (NaN payloads, infinities, negative zero, subnormals)
        words[:] = rng.integers(0, 2**16, size=n, dtype=np.uint32) << np.uint32(16)
        specials = np.array([0x7FC10000, 0xFF800000, 0x80000000, 0x00010000, 0xFFFF0000], dtype=np.uint32)
        words[:min(n, 5)] = specials[:min(n, 5)]
    elif case == "odd segment":  # (halves whose low bit is set everywhere but one segment: still bfloat16 values)
        words |= np.uint32(1 << 16)
        words[seg:2 * seg] &= np.uint32(0xFFFC0000)
    data = floatcoder.encode_chunk(words.view(np.float32), "float32", seg, wide=True)
    assert data[0] == floatcoder.HALVES_BYTE
    assert data == ref_encode_halves([int(w) for w in words], seg)
    if data[1] != floatcoder.WIDE_BYTE:  # (the reference decodes modes 0 to 3; mode 4 by the kernel's round trip)
        assert ref_decode(data, "float32", seg, n) == [int(w) for w in words]
    assert floatcoder.revision_of([data], "float32") & floatcoder.HALVES_REVISION
    out = np.full(n, 0x12345678, dtype=np.uint32)
    floatcoder.decode_chunk(data, "float32", seg, out.view(np.float32))
    assert np.array_equal(out, words)


def test_mode_6_takes_float32_chunks_of_bfloat16_values_only():
    rng = np.random.default_rng(3)
    seg = 384
    x = (rng.standard_normal(floatcoder.WIDE_FROM) * 0.02).astype(np.float32)
    halves = x.view(np.uint32) & np.uint32(0xFFFF0000)
    data = floatcoder.encode_chunk(halves.view(np.float32), "float32", seg)  # (large enough: untold)
    assert data[:2] == bytes([floatcoder.HALVES_BYTE, floatcoder.WIDE_BYTE])
    # (the same halves as a bfloat16 tensor: the same substream after the mode byte)
    assert data[1:] == floatcoder.encode_chunk((halves >> 16).astype(np.uint16), "bfloat16", seg)
    one_bit = halves.copy()
    one_bit[12345] |= 1 << 15  # (one element with a bit below bfloat16's: the segments drop 15 bits at most)
    assert floatcoder.encode_chunk(one_bit.view(np.float32), "float32", seg)[0] != floatcoder.HALVES_BYTE
    small = halves[:floatcoder.WIDE_FROM - 1]  # (below mode 4's size: mode 0 drops the 16 bits)
    assert floatcoder.encode_chunk(small.view(np.float32), "float32", seg)[0] == floatcoder.TANS_FLAG
    out = np.empty_like(halves)
    for revision in (floatcoder.REVISIONS[-1] & ~floatcoder.HALVES_REVISION, 0):
        with pytest.raises(CorruptStreamError, match="mode byte of 0x86"):
            floatcoder.decode_chunk(data, "float32", seg, out.view(np.float32), revision=revision)
    for dtype_name in ("bfloat16", "float16", "float64"):
        carrier = np.empty(halves.size, dtype=WORDS[dtype_name])
        with pytest.raises(CorruptStreamError, match="low-bit mode 6"):
            floatcoder.decode_chunk(data, dtype_name, seg, carrier.view(DTYPES[dtype_name])
                                    if dtype_name != "bfloat16" else carrier)
    for cut in (1, 2, 100, len(data) - 1):  # (the inner substream's own checks)
        with pytest.raises(CorruptStreamError):
            floatcoder.decode_chunk(data[:cut], "float32", seg, out.view(np.float32))


def test_a_model_of_bfloat16_values_in_float32_takes_mode_6_and_format_version_13():
    rng = np.random.default_rng(5)
    x = torch.from_numpy((rng.standard_normal((512, 384)) * 0.05).astype(np.float32))
    model = {"w": x.to(torch.bfloat16).float(), "b": x[0].to(torch.bfloat16).float(), "full": x[:8]}
    data = dc.encode_model(model, keep_exact=True)
    header = dc.read_stream_header(data)
    assert header.version == 13
    params = {e.name: e.coder_param for e in header.tensors}
    assert params["w"] == floatcoder.HALVES_REVISION | floatcoder.WIDE_REVISION
    assert not params["b"] & floatcoder.HALVES_REVISION and not params["full"] & floatcoder.HALVES_REVISION
    # (what `deepcabac info` and `report` say of it)
    from deepcabac_py.model.report import build_report, format_report, mode_words
    report = build_report(header)
    assert {t.name: t.mode for t in report.tensors} == {"w": "FLOAT+BF16", "b": "FLOAT", "full": "FLOAT"}
    assert "+bf16 = float32 chunks holding bfloat16 values" in format_report(report)
    assert mode_words("FLOAT+TZ+BF16") == "float-lossless+tz+bf16"
    out = dc.decode_model(data)
    assert all(torch.equal(out[k].view(torch.int32), v.view(torch.int32)) for k, v in model.items())
    import struct

    from helpers import reseal_header
    old = bytearray(data)
    struct.pack_into("<H", old, 8, 12)
    with pytest.raises(CorruptStreamError, match=r"needs format version 13, the stream says 12"):
        dc.decode_model(reseal_header(old))


def _wide_chunk(seed: int, dtype_name: str, shape) -> tuple[np.ndarray, int, bytes, dict[str, int]]:
    """A mode 4 substream of weights of ``shape`` (rows of different scales), their segment length
    and where its fields begin."""
    a = _weights(np.random.default_rng(seed), dtype_name, shape).reshape(-1)
    w = a.view(WORDS[dtype_name])
    w |= 1  # (no segment drops a low bit)
    seg = floatcoder.segment_length(shape)
    data = floatcoder.encode_chunk(a, dtype_name, seg, wide=True)
    assert data[0] == floatcoder.WIDE_BYTE
    return a, seg, data, _wide_layout(data, -(-a.size // seg))


def _wide_layout(data: bytes, nseg: int) -> dict[str, int]:
    """Where the fields of a mode 4 or 5 substream of ``nseg`` segments begin."""
    at: dict[str, int] = {}
    pos = _class_tables_layout(data, 1, nseg, at)
    at["coder states"] = pos
    at["coder size"] = pos + 256
    at["coder words"] = pos + 260
    at["raw bits"] = pos + 260 + 2 * int.from_bytes(data[pos + 256:pos + 260], "little")
    return at


def _mode_4_case(dtype_name: str, case: str) -> tuple[np.ndarray, int]:
    """A chunk mode 4 codes, and its segment length: weights, weights with zeros among them (symbols
    from 0 to the weights' exponents) or a value taking over half of a large chunk."""
    rng = np.random.default_rng(17)
    if case == "dominant":  # (one class of many symbols and a large chunk: tables of 2**13)
        shape = (2048, 256)
        x = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))
        x[rng.random(shape) < 0.55] = x[0, 0]
        a = _weights(rng, dtype_name, shape, x).reshape(-1)
    else:
        shape = (40, 300)
        a = _weights(rng, dtype_name, shape).reshape(-1)
        if case == "zeros":
            a[::9] = 0
    a.view(WORDS[dtype_name])[:] |= 1  # (no segment drops a low bit)
    return a, floatcoder.segment_length(shape)


@pytest.mark.parametrize("dtype_name, case, entry_bytes", [
    ("bfloat16", "weights", 4), ("float16", "weights", 4), ("float32", "weights", 4),
    ("bfloat16", "zeros", 8), ("float32", "zeros", 8), ("float16", "dominant", 8), ("bfloat16", "dominant", 8)])
def test_mode_4_decodes_through_entries_of_either_width(dtype_name, case, entry_bytes):
    # (4-byte entries hold a frequency of at most 2**12 and the symbol less the lowest used, which
    # 8 bits must hold; else the entries take 8 bytes)
    a, seg = _mode_4_case(dtype_name, case)
    data = floatcoder.encode_chunk(a, dtype_name, seg, wide=True)
    assert data[0] == floatcoder.WIDE_BYTE
    r = floatcoder._Reader(np.frombuffer(data, dtype=np.uint8), "substream")
    r.take(1, "low-bit mode")
    W, M = floatcoder.FORMATS[dtype_name]
    _, precision, freq, _ = r.frequencies(-(-a.size // seg), floatcoder._alphabet(W, M))
    # (the rule, from the tables the stream sends)
    f = freq >> (floatcoder.PROB_BITS - precision)
    used = np.flatnonzero(f.any(axis=0))
    narrow = f.max() <= _w.NARROW_FREQ and used[-1] - used[0] < 1 << _w.NARROW_DISTANCE_AT
    assert (4 if narrow else 8) == entry_bytes
    out = np.empty_like(a)
    detail = np.zeros(2, dtype=np.int64)
    assert _w.decode_wide_substream(np.frombuffer(data, dtype=np.uint8), a.size, seg, M, out.view(WORDS[dtype_name]),
                                    detail, False) == 0
    assert detail[0] == entry_bytes
    assert np.array_equal(out.view(WORDS[dtype_name]), a.view(WORDS[dtype_name]))
    out = np.empty_like(a)
    floatcoder.decode_chunk(data, dtype_name, seg, out)
    assert np.array_equal(out.view(WORDS[dtype_name]), a.view(WORDS[dtype_name]))


@pytest.mark.parametrize("dtype_name", WIDE_DTYPES)
def test_a_mode_4_substream_cut_short_or_with_impossible_fields_is_refused(dtype_name):
    a, seg, data, at = _wide_chunk(13, dtype_name, (40, 300))
    assert "classes" in at

    def refused(bad: bytes, what: str) -> None:
        _refused(bad, dtype_name, seg, a, what)

    fields = sorted(at.items(), key=lambda kv: kv[1])
    for cut in range(1, len(data), 7):
        field = [name for name, start in fields if start <= cut][-1]
        refused(data[:cut], f"ends inside its {field}|tables do not fill|raw bits of")
    refused(data + bytes(4), "4 bytes after the raw bits")
    states = at["coder states"]
    refused(data[:states + 8] + (0xFFFF).to_bytes(4, "little") + data[states + 12:], "initial coder state of 65535")
    refused(data[:2] + bytes([14]) + data[3:], "precision|frequency table")
    size = at["coder size"]
    count = int.from_bytes(data[size:size + 4], "little")
    refused(data[:size] + (count - 1).to_bytes(4, "little") + data[size + 4:], "substream")
    with pytest.raises(CorruptStreamError, match="only bf16, fp16 and fp32 take"):
        floatcoder.decode_chunk(data, "float64", seg, np.empty(a.size, dtype=np.float64))
    with pytest.raises(CorruptStreamError, match="mode byte of 0x84, unknown to an entry of coder parameter"):
        # (an entry that says it has no mode 4 of its width: a 16-bit one's bit for float32, and back)
        floatcoder.decode_chunk(data, dtype_name, seg, np.empty_like(a),
                                revision=floatcoder.REVISIONS[-1] & ~(floatcoder.WIDE32_REVISION if dtype_name
                                                                      == "float32" else floatcoder.WIDE_REVISION))
    out = np.empty_like(a)
    floatcoder.decode_chunk(data, dtype_name, seg, out)  # (the original decodes)
    assert out.view(np.uint8).tobytes() == a.view(np.uint8).tobytes()


@pytest.mark.parametrize("dtype_name", WIDE_DTYPES)
def test_damaged_mode_4_substreams_are_refused_or_decode_within_bounds(dtype_name):
    rng = np.random.default_rng(6)
    a, seg, data, _ = _wide_chunk(14, dtype_name, (30, 256))
    for bad in _flipped(data, rng) + [data[:-2] + data[-1:]]:
        try:
            floatcoder.decode_chunk(bad, dtype_name, seg, np.empty_like(a))
        except CorruptStreamError as exc:
            assert "substream" in str(exc)


@pytest.mark.parametrize("dtype_name", WIDE_DTYPES)
def test_mode_4_gives_the_same_substream_whatever_room_its_array_keeps(dtype_name):
    """The rANS words go straight into the substream's own array, in a room sized by the thread's
    last chunk (``hint``); where that is too short for this chunk, the chunk is coded again with
    room for any. Rooms from none to plenty give the reference's bytes, and the hint left behind
    is this chunk's rANS words per element."""
    rng = np.random.default_rng(17)
    n, seg = 4_099, 301  # (the last group short, groups across segment boundaries)
    # (segments of scales octaves apart: classes of their own)
    x = (rng.standard_normal(n) * np.repeat(2.0 ** -rng.integers(3, 12, -(-n // seg)), seg)[:n]).astype(np.float32)
    words = {"bfloat16": lambda: ((x.view(np.uint32) >> 16) | 1).astype(np.uint16),
             "float16": lambda: x.astype(np.float16).view(np.uint16) | 1,
             "float32": lambda: x.view(np.uint32) | 1}[dtype_name]()
    W, M = floatcoder.FORMATS[dtype_name]
    expected = ref_encode_wide([int(w) for w in words], dtype_name, seg)
    assert expected[1] > 0  # (klog)
    # the rANS words' count: after the class nibbles, the tables and the 64 states
    nibbles = (-(-n // seg) + 1) // 2
    table_bytes = int.from_bytes(expected[3 + nibbles:7 + nibbles], "little")
    at = 7 + nibbles + table_bytes + 4 * _w.WIDE_LANES
    count = int.from_bytes(expected[at:at + 4], "little")
    own = (count << 16) // n
    zeros, classes16 = np.empty(0, np.uint8), np.empty(0, np.uint8)
    if W == 32:
        zeros, classes16 = floatcoder._segment_classes(words, W, M, seg)
    work = np.empty(_tans_kernels.tans_work_bytes(n, seg, W, M), dtype=np.uint8)
    # (none yet: room for any; far too short; a little short; its own; plenty)
    for hint in [0, 1, own * 3 // 4, own, 1 << 16]:
        kept = np.array([hint], dtype=np.int64)
        data = _w.encode_wide_substream(words, seg, W, M, zeros, classes16, floatcoder._COSTS, True, work, kept)
        assert data.tobytes() == expected, hint
        assert kept[0] == own


def test_mode_4_is_taken_for_large_16_bit_chunks_that_drop_no_bit():
    rng = np.random.default_rng(15)
    a = _weights(rng, "float16", (512, 256)).reshape(-1)
    a.view(np.uint16)[:] |= 1
    seg = floatcoder.segment_length((512, 256))
    assert a.size >= floatcoder.WIDE_FROM
    assert floatcoder.encode_chunk(a, "float16", seg)[0] == floatcoder.WIDE_BYTE
    assert floatcoder.encode_chunk(a[:floatcoder.WIDE_FROM - seg], "float16", seg)[0] == floatcoder.TANS_FLAG
    a.view(np.uint16)[:seg] &= 0xFFFE  # (a segment dropping a bit: modes 0 and 1 drop it)
    assert floatcoder.encode_chunk(a, "float16", seg)[0] == floatcoder.TANS_FLAG | 1
    assert floatcoder.revision_of([floatcoder.encode_chunk(a, "float16", seg, wide=False),
                                   _wide_chunk(1, "float16", (4, 300))[2]], "float16") == (floatcoder.TANS_REVISION
                                                                                          | floatcoder.WIDE_REVISION)
    assert floatcoder.revision_of([_wide_chunk(1, "float32", (4, 300))[2]], "float32") == floatcoder.WIDE32_REVISION


def test_mode_4_is_taken_for_large_float32_chunks_unless_their_trailing_zeros_pay_more():
    rng = np.random.default_rng(16)
    a = _weights(rng, "float32", (512, 256)).reshape(-1)
    # (random low bits: no segment drops one, and the trailing zeros are not worth coding; every
    # element's lowest bit set would be: mode 3 leaves out the one above the trailing zeros)
    a.view(np.uint32)[:] ^= rng.integers(0, 1 << 16, size=a.size, dtype=np.uint32)
    seg = floatcoder.segment_length((512, 256))
    assert floatcoder.encode_chunk(a, "float32", seg)[0] == floatcoder.WIDE_BYTE
    assert floatcoder.encode_chunk(a[:floatcoder.WIDE_FROM - seg], "float32", seg)[0] == floatcoder.TANS_FLAG
    grid = _grid_weights(rng, "float32", (512, 256)).reshape(-1)  # (values on a grid: mode 5 saves more)
    assert floatcoder.encode_chunk(grid, "float32", seg)[0] == floatcoder.TZ_WIDE_BYTE
    assert floatcoder.encode_chunk(a.astype(np.float64), "float64", seg)[0] != floatcoder.WIDE_BYTE


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 1500), seg=st.integers(256, 400), seed=st.integers(0, 2**32 - 1),
       low_zero=st.integers(0, 23))
def test_mode_5_matches_the_reference_and_round_trips(n, seg, seed, low_zero):
    rng = np.random.default_rng(seed)
    # (each element's low bits zero up to low_zero of them: every capped count, and the cap)
    a = _random_floats(rng, "float32", n, rng.integers(0, low_zero + 1, size=n))
    words = [int(w) for w in a.view(np.uint32)]
    data = floatcoder.encode_trailing(a, "float32", seg, wide=True)
    assert data[0] == floatcoder.TZ_WIDE_BYTE and data == ref_encode_tz(words, seg, wide=True)
    out = np.zeros_like(a)
    floatcoder.decode_chunk(data, "float32", seg, out)
    assert np.array_equal(out.view(np.uint32), a.view(np.uint32))


def _mode_5_chunk(seed: int, shape) -> tuple[np.ndarray, int, bytes, dict[str, int]]:
    """A mode 5 substream of grid weights of ``shape``, their segment length and where its fields
    begin."""
    a = _grid_weights(np.random.default_rng(seed), "float32", shape).reshape(-1)
    seg = floatcoder.segment_length(shape)
    data = floatcoder.encode_trailing(a, "float32", seg, wide=True)
    assert data[0] == floatcoder.TZ_WIDE_BYTE
    return a, seg, data, _wide_layout(data, -(-a.size // seg))


def test_a_mode_5_substream_cut_short_or_with_impossible_fields_is_refused():
    a, seg, data, at = _mode_5_chunk(13, (40, 300))

    def refused(bad: bytes, what: str) -> None:
        _refused(bad, "float32", seg, a, what)

    fields = sorted(at.items(), key=lambda kv: kv[1])
    for cut in range(1, at["raw bits"], 7):
        field = [name for name, start in fields if start <= cut][-1]
        refused(data[:cut], f"ends inside its {field}|tables do not fill")
    # (the raw bits' count follows from the symbols: fewer words are read short, more are left over)
    for cut in (at["raw bits"] + 4, len(data) - 4):
        refused(data[:cut], "substream")
    refused(data + bytes(4), "bytes are left after the last element")
    refused(data + bytes(2), "2 bytes after the raw bits")
    refused(data[:-1] + bytes([data[-1] | 0x80]), "bytes are left after the last element|substream")
    states = at["coder states"]
    refused(data[:states + 8] + (0xFFFF).to_bytes(4, "little") + data[states + 12:], "initial coder state of 65535")
    refused(data[:2] + bytes([14]) + data[3:], "precision|frequency table")
    for dtype_name in ("float16", "float64"):
        with pytest.raises(CorruptStreamError, match="only float32 takes"):
            floatcoder.decode_chunk(data, dtype_name, seg, np.empty(a.size, dtype=DTYPES[dtype_name]))
    with pytest.raises(CorruptStreamError, match="mode byte of 0x85, unknown to an entry of coder parameter"):
        floatcoder.decode_chunk(data, "float32", seg, np.empty_like(a),
                                revision=floatcoder.REVISIONS[-1] & ~floatcoder.TZ_WIDE_REVISION)
    out = np.empty_like(a)
    floatcoder.decode_chunk(data, "float32", seg, out)  # (the original decodes)
    assert out.view(np.uint8).tobytes() == a.view(np.uint8).tobytes()


def test_damaged_mode_5_substreams_are_refused_or_decode_within_bounds():
    rng = np.random.default_rng(6)
    a, seg, data, _ = _mode_5_chunk(14, (30, 256))
    for bad in _flipped(data, rng) + [data[:-2] + data[-1:]]:
        try:
            floatcoder.decode_chunk(bad, "float32", seg, np.empty_like(a))
        except CorruptStreamError as exc:
            assert "substream" in str(exc)


def test_mode_5_takes_large_float32_chunks_whose_trailing_zeros_pay_and_mode_3_the_others():
    rng = np.random.default_rng(18)
    grid = _grid_weights(rng, "float32", (512, 256)).reshape(-1)
    seg = floatcoder.segment_length((512, 256))
    assert grid.size >= floatcoder.TZ_WIDE_FROM
    wide = floatcoder.encode_chunk(grid, "float32", seg)
    assert wide[0] == floatcoder.TZ_WIDE_BYTE
    assert floatcoder.encode_chunk(grid[:floatcoder.TZ_WIDE_FROM - seg], "float32", seg)[0] == floatcoder.TZ_BYTE
    # (the same symbols and tables: the 64 states cost a few hundred bytes)
    narrow = floatcoder.encode_trailing(grid, "float32", seg, wide=False)
    assert abs(len(wide) - len(narrow)) < 0.002 * len(narrow)
    assert floatcoder.revision_of([wide], "float32") == floatcoder.TZ_WIDE_REVISION
    assert floatcoder.revision_of([wide, narrow], "float32") == floatcoder.TZ_WIDE_REVISION | floatcoder.TZ_REVISION


# the vector tiers below this processor's: each forced in a subprocess (this process runs its own)
@numba.extending.intrinsic
def _quotients16(typingctx, x, f, precision, q, r):
    """The mode 4 encoder's quotient and remainder of sixteen x by sixteen f (uint32 arrays)."""
    def codegen(context, builder, signature, args):
        v = _vector_kernels.Step(context, builder, signature, args)
        first = ir.Constant(_vector_kernels.I64, 0)
        x_, f_ = (builder.load(v.at(k, first, _vector_kernels.I32), align=4) for k in (0, 1))
        quotient, remainder = _w._quotient(v, x_, f_, args[2])
        builder.store(quotient, v.at(3, first, _vector_kernels.I32), align=4)
        builder.store(remainder, v.at(4, first, _vector_kernels.I32), align=4)
        return context.get_dummy_value()

    return numba.core.types.none(x, f, precision, q, r), codegen


@numba.njit
def _quotients(x, f, precision, q, r):
    for i in range(0, x.shape[0], 16):
        _quotients16(x[i:i + 16], f[i:i + 16], precision, q[i:i + 16], r[i:i + 16])


@pytest.mark.parametrize("precision", range(1, _w.WIDE_MAX_BITS + 1))
def test_the_encoders_vector_quotient_is_exact_at_every_precision(precision):
    """The step's x div f (in single precision from a precision of 10 on, corrected by one step)
    against the integers', over the states the encoder divides: x below f << (32 -
    precision), the largest of them, exact multiples and their neighbours, f of 1 and 2**precision."""
    rng = np.random.default_rng(precision)
    n = 1 << 16
    f = rng.integers(1, (1 << precision) + 1, n, dtype=np.int64)
    f[: n // 8] = 1
    f[n // 8: n // 4] = 1 << precision
    top = f << (32 - precision)
    x = (rng.random(n) * top).astype(np.int64)
    x[::5] = top[::5] - 1 - rng.integers(0, 2, x[::5].size)
    multiple = rng.integers(1, top // f + 1) * f
    x[1::5] = np.minimum(multiple[1::5] - rng.integers(0, 2, x[1::5].size), top[1::5] - 1)
    q, r = np.empty(n, np.uint32), np.empty(n, np.uint32)
    _quotients(x.astype(np.uint32), f.astype(np.uint32), precision, q, r)
    np.testing.assert_array_equal(q, x // f)
    np.testing.assert_array_equal(r, x % f)


_LOWER_TIERS = {"avx512": ["avx2", None], "avx2": [None], None: []}[_vector_kernels.VECTOR_LEVEL]


@pytest.mark.parametrize("tier", _LOWER_TIERS or [pytest.param(None, marks=pytest.mark.skip(reason="no lower tier"))],
                         ids=lambda tier: tier or "scalar")
def test_the_lower_tiers_give_this_processors_bytes_and_values(tmp_path, tier):
    """Processors without AVX-512's VBMI and VBMI2 run modes 4 to 6 and the 16-bit split with
    AVX2's steps, and those without AVX2 one element at a time: their tests again (reference
    bytes, round trips, damage, golden substreams) with each lower tier forced, in a Numba cache
    of its own (a cached kernel keeps the steps it was compiled with)."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.update({"DEEPCABAC_AVX2_STEPS": "1"} if tier else {"DEEPCABAC_SCALAR_STEPS": "1"})
    env.pop("DEEPCABAC_REGEN_GOLDEN", None)
    check = f"from deepcabac_py.entropy import _vector_kernels as v; assert v.VECTOR_LEVEL == {tier!r}"
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=300)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "-k", "mode_4 or mode_5 or mode_6 or 16bit_split",
                           str(tests / "test_floatcoder.py"), str(tests / "test_golden.py")],
                          env=env, cwd=tests.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


@pytest.mark.parametrize("threads", [1, 2])
def test_a_damaged_payload_is_a_checksum_mismatch_at_any_thread_count(threads):
    # (at two threads the large float tensor's chunks run on the pool: the damage must still be
    # reported as the checksum's, not as what the kernel made of it)
    rng = np.random.default_rng(11)
    model = {"w": torch.from_numpy(_weights(rng, "float32", (256, 300))).to(torch.bfloat16)}
    data = dc.encode_model(model, keep_exact=True, threads=1)
    header = read_header(data)
    e = header.tensors[0]
    assert e.numel >= POOL_MIN_ELEMENTS
    damaged = bytearray(data)
    damaged[header.header_size + e.offset + 5] ^= 0xFF  # (inside the chunk's tables)
    with pytest.raises(CorruptStreamError, match="tensor 'w': payload checksum mismatch"):
        dc.decode_model(bytes(damaged), threads=threads)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_segments_are_ranked_as_a_stable_sort_of_their_means(data):
    # the kernel ranks full segments by their integer totals and slots a shorter last one in by its
    # mean: the classes of a stable sort of the means themselves, ties and all
    seg_len = data.draw(st.one_of(st.integers(1, 400), st.just(65536)), label="seg_len")
    nseg = data.draw(st.integers(0, 70), label="segments")
    last = data.draw(st.integers(1, seg_len), label="last segment's length")
    top = data.draw(st.sampled_from([1, 3, 64, 255, 2047]), label="largest statistic")  # (2047: float64's exponent)
    lengths = [seg_len] * nseg
    if nseg:
        lengths[-1] = last
    few = data.draw(st.booleans(), label="few distinct totals")
    totals = [data.draw(st.integers(0, top * length if not few else min(3, top * length))) for length in lengths]
    mean = np.array([t / length for t, length in zip(totals, lengths)], dtype=np.float64)
    n = sum(lengths)
    classes = np.full(nseg, 99, dtype=np.uint8)
    _float_kernels.rank_classes(mean, classes, seg_len, n)
    expect = np.empty(nseg, dtype=np.uint8)
    expect[np.argsort(mean, kind="stable")] = np.arange(nseg) * 16 // max(nseg, 1)
    assert np.array_equal(classes, expect)
