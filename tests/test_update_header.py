"""The compact message header of update format 3 (docs/format.md, U2): layouts, equivalence with the
full header of formats 1/2, and damaged compact headers."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from deepcabac_py.errors import CorruptStreamError, FormatError, UpdateMismatchError
from deepcabac_py.updates import message_format as upf
from deepcabac_py.updates import messages as up
from deepcabac_py.updates import parent_model as upm


def _model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.normal(0, 1, (12, 10)).astype(np.float32),
            "a.bias": rng.normal(0, 1, 12).astype(np.float32),
            "b.weight": rng.normal(0, 1, (4, 12)).astype(np.float32),
            "count": np.array([3, 4], dtype=np.int64)}


def _changed(model: dict, seed: int, skip: tuple[str, ...] = ()) -> dict:
    rng = np.random.default_rng(seed)
    return {k: v if k in skip else (v + rng.normal(0, 0.1, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v + 1)
            for k, v in model.items()}


def _uv(x: int) -> bytes:
    return upf._uvarint(x)


def _message(body_after_count: bytes, *, count: int, total: int = 4, coder: int = 1) -> bytes:
    """A version-3 message around hand-written entry bytes (empty payload)."""
    body = _uv(1) + _uv(0) + bytes(8) + _uv(0) + _uv(0) + bytes([coder]) + _uv(total) + _uv(count)
    body += body_after_count + _uv(0)
    head = upf.PREAMBLE.pack(upf.MAGIC, 3, 0, len(body) + 4) + body
    head += struct.pack("<I", zlib.crc32(head))
    return head + struct.pack("<I", zlib.crc32(b""))


@pytest.mark.parametrize("coder", ["cabac", "golomb"])
def test_compact_and_full_headers_carry_the_same_update(coder):
    base = _model()
    new = _changed(base, 1)
    new["count"] = base["count"]  # Golomb carries ternary levels only: no integer difference
    kw = dict(density=0.2, coder=coder)
    compact, full = up.encode_update(new, base, **kw), up.encode_update(new, base, compact=False, **kw)
    hc, hf = upf.read_update_header(compact), upf.read_update_header(full)
    assert hc.version == 3 and hf.version in (1, 2)
    assert hc.payload_size == hf.payload_size and compact[-hc.payload_size - 4:] == full[-hf.payload_size - 4:]
    assert [(e.index, e.method, e.step, e.nnz, e.maxabs, e.sign_mode, e.features) for e in hc.entries] == \
        [(e.index, e.method, e.step, e.nnz, e.maxabs, e.sign_mode, e.features) for e in hf.entries]
    assert hc.parent_hash == hf.parent_hash[:8] and hc.parent_matches(upm.model_hash(base))
    # 24 bytes of hash, the indices and the fields all entries share
    assert len(full) - len(compact) >= 24 + 2 * len(hc.entries)
    a, b = up.apply_update(base, compact), up.apply_update(base, full)
    assert all(np.array_equal(a[k], b[k]) for k in base)


def test_layouts_follow_what_the_entries_share():
    base = _model()
    floats_only = _changed(base, 2)
    floats_only["count"] = base["count"]
    # not every tensor listed (count unchanged): indices; all STC with the same features: shared
    h = upf.read_update_header(up.encode_update(floats_only, base, density=0.2))
    assert [e.index for e in h.entries] == [0, 1, 2]
    # the integer difference has its own method: fields per entry, indices implied
    h = upf.read_update_header(up.encode_update(_changed(base, 3), base, density=0.2))
    assert [e.index for e in h.entries] == [0, 1, 2, 3] and h.entries[3].method == upf.Method.INTEGER
    assert h.entries[3].maxabs == 1 and h.entries[0].maxabs == 1
    # a skipped tensor in the middle
    h = upf.read_update_header(up.encode_update(_changed(base, 4, skip=("a.weight",)), base, density=0.2))
    assert [e.index for e in h.entries] == [0, 2, 3]


def test_wrong_parent_is_refused_by_its_hash_prefix():
    base = _model()
    data = up.encode_update(_changed(base, 5), base, density=0.2)
    other = dict(base)
    other["a.bias"] = base["a.bias"] + np.float32(1e-3)
    with pytest.raises(UpdateMismatchError, match="wrong parent"):
        up.apply_update(other, data)
    assert not upf.read_update_header(data).parent_matches(upm.model_hash(base)[:8])  # a prefix is not a digest


ENTRY = struct.pack("<f", 0.5) + _uv(1)  # step, nnz (an STC tensor with one nonzero)


def test_hand_written_compact_header_parses():
    shared = bytes([upf.LAYOUT_SHARED, upf.Method.STC, upf.SignMode.CODED, 0])
    h = upf.read_update_header(_message(shared + ENTRY * 4, count=4))
    assert [(e.index, e.method, e.step, e.nnz, e.maxabs) for e in h.entries] == \
        [(i, upf.Method.STC, 0.5, 1, 1) for i in range(4)]
    gaps = bytes([upf.LAYOUT_INDEXED | upf.LAYOUT_SHARED, upf.Method.TOPK, upf.SignMode.CODED, 0])
    h = upf.read_update_header(_message(gaps + _uv(1) + ENTRY + _uv(3) + _uv(0) + ENTRY + _uv(2), count=2))
    assert [(e.index, e.maxabs) for e in h.entries] == [(1, 3), (2, 2)]


@pytest.mark.parametrize("entries, count, error, match", [
    (bytes([0x04]) + ENTRY, 1, FormatError, "layout bits"),
    (bytes([0]) + bytes([upf.Method.STC, 0, 0]) + ENTRY, 1, CorruptStreamError, "without their indices"),
    (bytes([upf.LAYOUT_INDEXED | upf.LAYOUT_SHARED, upf.Method.STC, 0, 0]) + _uv(4) + ENTRY, 1, CorruptStreamError,
     "out of range"),
    (bytes([upf.LAYOUT_INDEXED | upf.LAYOUT_SHARED, 9, 0, 0]) + _uv(0) + ENTRY, 1, FormatError, "Method"),
    (bytes([upf.LAYOUT_INDEXED | upf.LAYOUT_SHARED, upf.Method.STC, 7, 0]) + _uv(0) + ENTRY, 1, FormatError,
     "SignMode"),
    (bytes([upf.LAYOUT_INDEXED | upf.LAYOUT_SHARED, upf.Method.STC, 0, 0]) + _uv(0) + ENTRY[:3], 1,
     CorruptStreamError, "past the end of the header"),
    (bytes([upf.LAYOUT_SHARED, upf.Method.STC, 0, 0]) + ENTRY * 4, 4, CorruptStreamError, "unexplained"),
])
def test_damaged_compact_headers_are_refused(entries, count, error, match):
    data = _message(entries + (_uv(5) if match == "unexplained" else b""), count=count)
    with pytest.raises(error, match=match):
        upf.read_update_header(data)
