"""Damaged and hostile streams: decode_model raises a DeepCabacError (or, where the damage does not
matter, decodes identically); it never raises anything else, never hangs and never allocates from an
unchecked header field."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    BODY_COUNT,
    BODY_META_LEN,
    craft,
    decode_outcome,
    edit_header_body,
    first_entry_offset,
    fix_checksums,
    header_body,
    no_hang,
    reseal_header,
    uniform,
)

import deepcabac_py as dc
from deepcabac_py.entropy import chunk_layout
from deepcabac_py.entropy.levelcoder import max_elements_for_payload
from deepcabac_py.errors import CorruptStreamError, DeepCabacError, FormatError, TruncatedStreamError
from deepcabac_py.model.container import (
    FLAG_ALIAS,
    FORMAT_VERSION,
    NO_ALIAS,
    PREAMBLE,
    Coder,
    DType,
    Mode,
    raw_chunk_elements,
)

ROOT = Path(__file__).resolve().parent.parent
PEAK_LIMIT = 50 * 2**20


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------




def small_model():
    rng = np.random.default_rng(123)
    w = torch.from_numpy((rng.standard_normal((6, 5)) * 0.2).astype(np.float32))
    return {
        "model": {
            "conv.weight": torch.from_numpy((rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(np.float32)),
            "fc.weight": w,
            "fc.bias": torch.from_numpy((rng.standard_normal(5) * 0.01).astype(np.float32)),
            "steps": torch.tensor(1234),
            "mask": np.array([True, False, True]),
            "head.weight": w,  # tied
            "raw": np.array([1.0, np.nan], dtype=np.float32),
        },
        "epoch": 3,
    }


@pytest.fixture(scope="module")
def small_stream():
    with pytest.warns(UserWarning):  # the NaN tensor is stored raw
        return dc.encode_model(small_model(), qp=-32, threads=1)


@pytest.fixture(scope="module")
def digits_stream():
    ckpt = dc.load_checkpoint(ROOT / "models" / "digits_cnn.pt")
    return dc.encode_model(ckpt, qp=-32, threads=1)


def check_flips(data: bytes, positions, masks=(0xFF,)) -> tuple[int, int]:
    """Flip ``mask`` at every position: each decode raises a DeepCabacError or decodes identically."""
    reference = decode_outcome(data)
    assert not isinstance(reference, Exception)
    raised = identical = 0
    with no_hang():
        for pos in positions:
            for mask in masks:
                damaged = bytearray(data)
                damaged[pos] ^= mask
                outcome = decode_outcome(bytes(damaged))
                if isinstance(outcome, DeepCabacError):
                    raised += 1
                else:
                    assert outcome == reference, f"byte {pos} ^ {mask:#x} decoded to something else"
                    identical += 1
    return raised, identical


# --------------------------------------------------------------------------------------------------
# damaged real streams
# --------------------------------------------------------------------------------------------------


def test_digits_every_byte_flipped(digits_stream):
    raised, identical = check_flips(digits_stream, range(len(digits_stream)))
    assert raised + identical == len(digits_stream)
    assert raised >= len(digits_stream) * 0.99  # checksums cover (nearly) every byte


def test_digits_single_bit_flips(digits_stream):
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.integers(0, len(digits_stream), 48).tolist()) | {0, 8, 12, 16, len(digits_stream) - 1})
    check_flips(digits_stream, positions, masks=(1, 2, 4, 8, 16, 32, 64, 128))


def test_digits_every_truncation(digits_stream):
    with no_hang():
        for length in range(len(digits_stream)):
            with pytest.raises(DeepCabacError):
                dc.decode_model(digits_stream[:length], threads=1)
    with pytest.raises(CorruptStreamError):
        dc.decode_model(digits_stream + b"\x00", threads=1)


def test_small_every_byte_and_truncation(small_stream):
    raised, _ = check_flips(small_stream, range(len(small_stream)), masks=(0xFF, 0x01, 0x80))
    assert raised >= len(small_stream)
    for length in range(len(small_stream)):
        with pytest.raises(DeepCabacError):
            dc.decode_model(small_stream[:length], threads=1)


def test_container_header_round_trips(small_stream, digits_stream):
    for data in (small_stream, digits_stream):
        assert fix_checksums(data) == data


def test_payload_damage_behind_valid_checksums(small_stream):
    """With the CRCs recomputed the damage reaches the level decoder itself."""
    header = dc.read_stream_header(small_stream)
    reference = decode_outcome(small_stream)
    shapes = {name: (t[0], t[2]) for name, t in reference[1].items()}
    outcomes = {"raised": 0, "decoded": 0}
    with no_hang():
        for pos in range(header.header_size, len(small_stream)):
            for mask in (0xFF, 0x10):
                damaged = bytearray(small_stream)
                damaged[pos] ^= mask
                outcome = decode_outcome(fix_checksums(bytes(damaged)))
                if isinstance(outcome, DeepCabacError):
                    outcomes["raised"] += 1
                else:
                    # undetectable damage changes values, never the structure, dtypes or shapes
                    assert outcome[0] == reference[0]
                    assert {n: (t[0], t[2]) for n, t in outcome[1].items()} == shapes
                    outcomes["decoded"] += 1
    assert outcomes["raised"] > 0


def test_header_damage_behind_valid_checksum(small_stream):
    """Every header byte flipped with the header CRC recomputed: inflating and parsing hold. (A flip
    in a deflate code that inflates to the very same body is harmless: it must decode identically.)"""
    header_size = dc.read_stream_header(small_stream).header_size
    body = header_body(small_stream)
    reference = decode_outcome(small_stream)
    with no_hang():
        for pos in range(PREAMBLE.size, header_size - 4):
            for mask in (0xFF, 0x01):
                damaged = bytearray(small_stream)
                damaged[pos] ^= mask
                damaged = reseal_header(damaged)
                outcome = decode_outcome(damaged)
                if not isinstance(outcome, DeepCabacError):
                    assert header_body(damaged) == body and outcome == reference, pos


def test_header_body_damage_behind_valid_deflate_and_checksum(small_stream):
    """Every byte of the inflated header body flipped (then deflated and sealed again): the parser's
    own checks hold; a damaged name or metadata string may decode to another valid structure."""
    body_size = len(header_body(small_stream))
    with no_hang():
        for pos in range(body_size):
            for mask in (0xFF, 0x01, 0x40):
                def flip(body, pos=pos, mask=mask):
                    body[pos] ^= mask
                decode_outcome(edit_header_body(small_stream, flip))  # raises only DeepCabacError
        for cut in range(body_size):
            def truncate(body, cut=cut):
                del body[cut:]
            assert isinstance(decode_outcome(edit_header_body(small_stream, truncate)), DeepCabacError)


# --------------------------------------------------------------------------------------------------
# preamble
# --------------------------------------------------------------------------------------------------


def test_wrong_magic(small_stream):
    for data in (b"PK\x03\x04" + small_stream[4:], b"x" + small_stream[1:], b"hello", b"\x00" * 40):
        with pytest.raises(FormatError) as info:
            dc.decode_model(data)
        assert not isinstance(info.value, CorruptStreamError)
    with pytest.raises(FormatError):
        dc.read_stream_header(b"not a stream at all, but long enough")


def test_empty_and_short_inputs(small_stream):
    for data in (b"", small_stream[:3], small_stream[:PREAMBLE.size - 1], small_stream[:PREAMBLE.size]):
        with pytest.raises(DeepCabacError):
            dc.decode_model(data)
    with pytest.raises(TruncatedStreamError):
        dc.decode_model(small_stream[:PREAMBLE.size + 5])


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_unsupported_version(small_stream, version):
    data = bytearray(small_stream)
    struct.pack_into("<H", data, 8, version)
    with pytest.raises(FormatError, match="version"):
        dc.decode_model(bytes(data))
    with pytest.raises(FormatError, match="version"):
        dc.read_stream_header(reseal_header(data))


def test_unknown_flags_and_header_size(small_stream):
    data = bytearray(small_stream)
    struct.pack_into("<H", data, 10, 1)
    with pytest.raises(FormatError):
        dc.decode_model(bytes(data))
    for size in (0, 3, 2**30 + 1, 2**32 - 1):
        data = bytearray(small_stream)
        struct.pack_into("<I", data, 12, size)
        with pytest.raises(CorruptStreamError):
            dc.decode_model(bytes(data))


# --------------------------------------------------------------------------------------------------
# hand-built hostile headers
# --------------------------------------------------------------------------------------------------


def assert_refused(data: bytes, error=CorruptStreamError):
    """``data`` is refused with ``error``, and refusing it allocates little."""
    tracemalloc.start()
    try:
        with pytest.raises(error):
            dc.decode_model(data, threads=1)
        with pytest.raises(error):
            dc.decode_levels(data, threads=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.1f} MB"


def test_crafted_valid_stream_decodes():
    # the crafting helpers themselves produce a decodable stream
    from deepcabac_py.entropy import chunk_layout, levelcoder

    levels = np.arange(-8, 8, dtype=np.int32)
    layout = chunk_layout.layout_for_shape((4, 4))
    chunk = levelcoder.encode_chunk(levels, layout, 0)
    data = craft([uniform(chunk_elements=layout.chunk_elements, chunk_sizes=[len(chunk)],
                          coder_param=layout.coder_param)], chunk)
    out = dc.decode_model(data)["w"]
    np.testing.assert_array_equal(out, (levels * 2.0**-8).reshape(4, 4).astype(np.float32))


def test_huge_shape_tiny_payload():
    assert_refused(craft([uniform(shape=(2**40,), chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(2**20, 2**20), chunk_elements=2**20, chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(2**40,), mode=Mode.RAW, coder=Coder.NONE, chunk_sizes=[10],
                                  qp=0, qp_density=0, chunk_elements=0)], bytes(10)))
    assert_refused(craft([uniform(shape=(2**40,), dtype=DType.INT64, mode=Mode.INTEGER, chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(2**60, 1), chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(2**30, 2**30), chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(2,) * 32 + (2**20,), chunk_sizes=[10])], bytes(10)))


def test_largest_allowed_claim_stays_proportional_to_the_payload():
    n = max_elements_for_payload(40)
    payload = bytes(np.random.default_rng(1).integers(0, 256, 40, dtype=np.uint8))
    tracemalloc.start()
    try:
        outcome = decode_outcome(craft([uniform(shape=(n,), chunk_sizes=[40])], payload))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT
    assert isinstance(outcome, CorruptStreamError) or outcome[1]["w"][2] == (n,)


def test_an_entry_sharing_an_earlier_entrys_layout_has_its_own_payload_checked():
    """The header checks a layout once: a later entry of the same layout must still have its own
    chunk sizes checked against the elements they claim."""
    n = 2 * max_elements_for_payload(10)
    good, bad = uniform("a", shape=(n,), chunk_sizes=[40]), uniform("b", shape=(n,), chunk_sizes=[10], offset=40)
    with pytest.raises(CorruptStreamError, match=r"tensor 1 \('b'\): chunk 0 claims \d+ levels in 10 bytes"):
        dc.read_stream_header(craft([good, bad], bytes(50)))
    a = uniform("a", dtype=DType.INT64, mode=Mode.RAW, coder=Coder.NONE, qp=0, qp_density=0, coder_param=0,
                chunk_sizes=[128], chunk_elements=raw_chunk_elements(DType.INT64))
    b = uniform("b", dtype=DType.INT64, mode=Mode.RAW, coder=Coder.NONE, qp=0, qp_density=0, coder_param=0,
                chunk_sizes=[120], chunk_elements=raw_chunk_elements(DType.INT64), offset=128)
    with pytest.raises(CorruptStreamError, match=r"tensor 1 \('b'\): raw payload of 120 bytes"):
        dc.read_stream_header(craft([a, b], bytes(248)))


def test_chunk_sizes_that_do_not_add_up():
    assert_refused(craft([uniform(chunk_sizes=[3, 4], size=10)], bytes(10)))
    assert_refused(craft([uniform(shape=(8, 4), chunk_elements=16, chunk_sizes=[10])], bytes(10)))
    assert_refused(craft([uniform(shape=(8, 4), chunk_elements=16, chunk_sizes=[4, 3, 3])], bytes(10)))
    assert_refused(craft([uniform(chunk_elements=0)], bytes(10)))
    assert_refused(craft([uniform(shape=(0,), chunk_sizes=[10])], bytes(10)))


def test_offsets_that_lie():
    a = uniform("a", chunk_sizes=[10])
    b = uniform("b", chunk_sizes=[10], offset=5)
    assert_refused(craft([a, b], bytes(20)))
    a = uniform("a", chunk_sizes=[10], offset=3)
    assert_refused(craft([a], bytes(13)))


def test_payload_sizes_that_lie():
    # more payload declared than present (no allocation of the declared size)
    assert_refused(craft([uniform(chunk_sizes=[2**32 - 1])], bytes(10)), TruncatedStreamError)
    assert_refused(craft([uniform(shape=(2**20, 1024), chunk_elements=2**20,
                                  chunk_sizes=[2**32 - 1] * 1024)], bytes(10)), TruncatedStreamError)
    # less payload declared than present
    assert_refused(craft([uniform(chunk_sizes=[10])], bytes(30)))


def test_tensor_and_chunk_counts_larger_than_the_header():
    base = craft([uniform(chunk_sizes=[10])], bytes(10))
    assert struct.unpack_from("<I", header_body(base), BODY_COUNT)[0] == 1
    for count in (0, 2, 1000, 2**32 - 1):
        assert_refused(edit_header_body(base, lambda b, c=count: struct.pack_into("<I", b, BODY_COUNT, c)))
    # chunk count field: after name length, name, fixed fields, shape and the other quant fields
    pos = first_entry_offset(header_body(base)) + 2 + 1 + 5 + 8 * 2 + 16
    assert struct.unpack_from("<I", header_body(base), pos)[0] == 1
    for count in (0, 2, 2**20, 2**32 - 1):
        assert_refused(edit_header_body(base, lambda b, c=count: struct.pack_into("<I", b, pos, c)))


def test_header_body_sizes_that_lie():
    base = craft([uniform(chunk_sizes=[10])], bytes(10))
    raw_size = len(header_body(base))
    for claimed in (0, raw_size - 1, raw_size + 1, 2**29, 2**32 - 1):
        data = bytearray(base)
        struct.pack_into("<I", data, PREAMBLE.size, claimed)
        assert_refused(reseal_header(data))
    # a body followed by junk
    assert_refused(edit_header_body(base, lambda b: b.extend(b"\x00" * 7)))


def test_hostile_entry_fields():
    cases = [
        uniform(qp=4095, qp_density=0),  # step beyond float64
        uniform(qp=-4096, qp_density=1),  # step of zero
        uniform(qp=5000),
        uniform(qp_density=7),
        uniform(dtype=DType.INT32),  # uniform quantization of integers
        uniform(mode=Mode.INTEGER),  # integer coding of floats
        uniform(mode=Mode.RAW),  # raw with a level coder
        uniform(alias_of=0),  # alias index without the flag
        uniform(flags=FLAG_ALIAS, alias_of=0, chunk_sizes=[], chunk_elements=0),  # aliases itself
    ]
    for entry in cases:
        assert_refused(craft([entry], bytes(10) if entry.size else b""))
    assert_refused(craft([uniform(coder=Coder.NONE)], bytes(10)), FormatError)  # no level coder
    from deepcabac_py.entropy.chunk_layout import MAX_K_OFFSET

    assert_refused(craft([uniform(coder_param=MAX_K_OFFSET + 1)], bytes(10)))
    # an alias of a tensor of another shape / an alias of an alias
    a = uniform("a", chunk_sizes=[10])
    b = uniform("b", shape=(2, 2), flags=FLAG_ALIAS, alias_of=0, chunk_sizes=[], chunk_elements=0)
    assert_refused(craft([a, b], bytes(10)))
    b = uniform("b", flags=FLAG_ALIAS, alias_of=0, chunk_sizes=[], chunk_elements=0)
    c = uniform("c", flags=FLAG_ALIAS, alias_of=1, chunk_sizes=[], chunk_elements=0)
    assert_refused(craft([a, b, c], bytes(10)))
    assert NO_ALIAS == 0xFFFFFFFF


def test_unknown_codes_are_format_errors():
    base = craft([uniform(chunk_sizes=[10])], bytes(10))
    fixed = first_entry_offset(header_body(base)) + 2 + 1  # dtype, mode, coder, flags, ndim
    assert header_body(base)[fixed:fixed + 5] == bytes([DType.FLOAT32, Mode.UNIFORM, Coder.ADAPTIVE_SCALE, 0, 2])

    def setter(offset, value):
        def edit(body):
            body[fixed + offset] = value
        return edit

    for offset, value in ((0, 99), (1, 7), (2, 200), (3, 0x80)):
        assert_refused(edit_header_body(base, setter(offset, value)), FormatError)
    assert_refused(edit_header_body(base, setter(4, 200)))  # ndim
    assert_refused(edit_header_body(base, setter(4, 1)))  # fewer dimensions: fields shift


def test_bad_metadata_and_skeleton():
    payload = bytes(10)
    for meta in ([1, 2], {"kind": "mapping", "skeleton": [1]},
                 {"kind": "mapping", "skeleton": {"format": "deepcabac.skeleton", "version": 1,
                                                  "root": {"$tensor": "missing"}}},
                 {"kind": "mapping", "skeleton": {"format": "other", "root": None}}):
        from deepcabac_py.entropy import levelcoder

        chunk = levelcoder.encode_chunk(np.zeros(16, np.int32), chunk_layout.layout_for_shape((4, 4)), 0)
        data = craft([uniform(chunk_sizes=[len(chunk)])], chunk, metadata=meta)
        with pytest.raises(DeepCabacError):
            dc.decode_model(data)
    # metadata that is not UTF-8 / not JSON, or a metadata size beyond the body
    base = craft([uniform(chunk_sizes=[10])], payload)
    meta_len = struct.unpack_from("<I", header_body(base), BODY_META_LEN)[0]

    def garble(body, fill):
        body[BODY_META_LEN + 4:BODY_META_LEN + 4 + meta_len] = fill * meta_len

    assert_refused(edit_header_body(base, lambda b: garble(b, b"\xff")))
    assert_refused(edit_header_body(base, lambda b: garble(b, b"{")))
    for size in (meta_len + 1, 2**32 - 1):
        assert_refused(edit_header_body(base, lambda b, n=size: struct.pack_into("<I", b, BODY_META_LEN, n)))


def test_decoded_integers_outside_their_dtype():
    from deepcabac_py.entropy import levelcoder

    for dtype, values in ((DType.UINT8, [3, 300]), (DType.UINT8, [-1, 0]), (DType.INT8, [-129, 5]),
                          (DType.UINT64, [-5, 1])):
        levels = np.array(values, dtype=np.int32)
        chunk = levelcoder.encode_chunk(levels, chunk_layout.layout_for_shape((2,)), 0)
        entry = uniform(shape=(2,), dtype=dtype, mode=Mode.INTEGER, chunk_sizes=[len(chunk)], qp=0, qp_density=0)
        with pytest.raises(CorruptStreamError, match="out of its dtype's range"):
            dc.decode_model(craft([entry], chunk))
        # decode_levels hands out the levels as they are
        np.testing.assert_array_equal(dc.decode_levels(craft([entry], chunk))["w"].levels, levels)


def test_trellis_entry_in_a_version_1_stream_is_refused(small_stream):
    assert dc.read_stream_header(small_stream).version == 2  # the default quantizer is the trellis
    data = bytearray(small_stream)
    struct.pack_into("<H", data, 8, 1)
    with pytest.raises(CorruptStreamError, match="needs format version 2"):
        dc.read_stream_header(reseal_header(data))


def test_max_elements_is_the_callers_own_bound():
    model = {"a": np.ones((30, 40), np.float32), "b": np.arange(7, dtype=np.int64), "tied": None}
    model["tied"] = model["a"]
    data = dc.encode_model(model, qp=-20)
    total = 30 * 40 + 7  # an alias adds nothing
    for decode in (dc.decode_model, dc.decode_checkpoint, dc.decode_levels):
        decode(data, max_elements=total)
        with pytest.raises(dc.LimitExceededError, match=f"1,207 elements, more than max_elements={total - 1:,}"):
            decode(data, max_elements=total - 1)
    with pytest.raises(ValueError):
        dc.decode_model(data, max_elements=-1)


def test_column_model_switched_off():
    from deepcabac_py.entropy import levelcoder

    levels = np.arange(-8, 8, dtype=np.int32)
    layout = chunk_layout.layout_for_shape((4, 4), columns=False)
    assert layout.ncols == 0 and layout.coder_param == chunk_layout.NO_COLUMNS_BIT
    chunk = levelcoder.encode_chunk(levels, layout, 0)
    data = craft([uniform(chunk_elements=layout.chunk_elements, chunk_sizes=[len(chunk)],
                          coder_param=layout.coder_param)], chunk)
    assert dc.read_stream_header(data).version == 3
    np.testing.assert_array_equal(dc.decode_model(data)["w"], (levels * 2.0**-8).reshape(4, 4).astype(np.float32))
    # a column model that is off cannot predict columns
    both = chunk_layout.NO_COLUMNS_BIT | chunk_layout.PREDICT_BIT
    assert_refused(craft([uniform(chunk_elements=16, chunk_sizes=[len(chunk)], coder_param=both)], chunk))
    # and the switch needs version 3
    old = bytearray(data)
    struct.pack_into("<H", old, 8, 2)
    with pytest.raises(CorruptStreamError, match="needs format version 3"):
        dc.decode_model(reseal_header(old))


def test_the_streams_checksum_is_zlibs_crc32():
    """The checksum module may take a faster implementation, never a different checksum: the
    formats are specified with zlib's CRC-32."""
    import zlib

    from deepcabac_py.io.checksum import crc32

    rng = np.random.default_rng(11)
    for n in (0, 1, 7, 4096, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        start = int(rng.integers(0, 2**32))
        assert crc32(data) == zlib.crc32(data)
        assert crc32(memoryview(data)[n // 3:], start) == zlib.crc32(memoryview(data)[n // 3:], start)
