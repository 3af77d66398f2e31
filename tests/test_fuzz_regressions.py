"""Regression tests for the findings of the fuzz harness (fuzz/, docs/reliability.md).

Every file under tests/fuzz_regressions/ is named ``<target>-<id>``: the input that broke the
contract of that fuzz target (fuzz/fuzz_targets.py), replayed through the same target. The tests
below rebuild each finding as a minimal, readable input as well.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import fuzz_targets
import numpy as np
import pytest
from helpers import no_hang

import deepcabac_py as dc
from deepcabac_py.errors import CheckpointError

HERE = Path(__file__).resolve().parent


REGRESSIONS = sorted((HERE / "fuzz_regressions").glob("*-*"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_fuzz_artifact(path):
    target = path.name.rsplit("-", 1)[0]
    with no_hang(30):
        fuzz_targets.TARGETS[target](path.read_bytes())  # raises fuzz_targets.Finding on a regression


def _npz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _npy(header: str, data: bytes = b"") -> bytes:
    text = header.encode("latin1")
    pad = (-(10 + len(text) + 1)) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


def _load(tmp_path, data: bytes, suffix: str = ".npz"):
    path = tmp_path / f"x{suffix}"
    path.write_bytes(data)
    return dc.load_checkpoint(path)


def test_npz_with_unsupported_zip_version(tmp_path):
    """Finding 1 (ckpt_npz): zipfile raises NotImplementedError for a member whose 'version needed to
    extract' is above 6.3; load_checkpoint let it escape instead of raising CheckpointError."""
    good = _npz({"w.npy": _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", b"\0\0\x80?")})
    assert _load(tmp_path, good).tensors["w"].tolist() == [1.0]
    data = bytearray(good)
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<H", data, central + 6, 218)  # version needed to extract: 21.8
    with pytest.raises(CheckpointError, match="not a valid npz"):
        _load(tmp_path, bytes(data))
    # sniffing an unknown suffix must not raise either (it falls back to torch, which refuses it)
    with pytest.raises(CheckpointError):
        _load(tmp_path, bytes(data), suffix=".weights")


def test_npz_with_unsupported_compression(tmp_path):
    """Same family: an unknown compression method (NotImplementedError when the member is opened)."""
    data = bytearray(_npz({"w.npy": _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", b"\0\0\x80?")}))
    struct.pack_into("<H", data, 8, 99)  # local header compression method
    central = data.index(b"PK\x01\x02")
    struct.pack_into("<H", data, central + 10, 99)  # central directory compression method
    with pytest.raises(CheckpointError):
        _load(tmp_path, bytes(data))


def test_npz_with_unbalanced_npy_header(tmp_path):
    """Finding 2 (ckpt_npz): an .npy header dict with an unclosed bracket makes numpy's header filter
    raise tokenize.TokenError (not a ValueError); load_checkpoint let it escape."""
    data = _npz({"w.npy": _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,")})
    with pytest.raises(CheckpointError, match="invalid header"):
        _load(tmp_path, data)


def test_npz_with_damaged_deflate_member(tmp_path):
    """A deflated member whose data is damaged (zlib.error while reading the .npy header)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (64,), }", bytes(256)))
    data = bytearray(buf.getvalue())
    start = 30 + len("w.npy")
    for i in range(start, start + 12):
        data[i] ^= 0x5A
    with pytest.raises(CheckpointError):
        _load(tmp_path, bytes(data))


def test_valid_seed_npz_still_loads(tmp_path):
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = io.BytesIO()
    np.savez(buf, w=arr)
    assert np.array_equal(_load(tmp_path, buf.getvalue()).tensors["w"], arr)


def test_update_table_without_base_claims_a_huge_tensor():
    """Finding 3 (by review while writing the update target): with no base, the shapes come from the
    message's tensor table, unchecked against anything; a 2**40-element claim raised MemoryError (a
    smaller one, e.g. 2**33, allocated tens of GB). Now bounded by decode_update's max_elements."""
    from deepcabac_py.updates import message_format as upf
    from deepcabac_py.updates import messages as up

    data = (HERE.parent / "fuzz" / "corpus" / "update" / "stc_table.dcu").read_bytes()
    h = upf.read_update_header(data)
    table = [(n, d, (1 << 40,) if n == "a.weight" else s) for n, d, s in h.table]
    msg = upf.write_message(round_index=h.round, parent_round=h.parent_round, parent_hash=h.parent_hash,
                            session_id=h.session_id, session_seq=h.session_seq, coder=h.coder,
                            tensor_total=h.tensor_total, table=table, entries=h.entries,
                            payload=data[h.header_size:h.header_size + h.payload_size])
    with pytest.raises(dc.LimitExceededError, match="max_elements"):
        up.decode_update(msg)
    # a caller who expects such a tensor raises the limit (here: still refused, as the claim is
    # larger; the point is that the limit, not the allocator, decides)
    with pytest.raises(dc.LimitExceededError, match="max_elements"):
        up.decode_update(msg, max_elements=1 << 30)


def test_pt_whose_zip64_locator_claims_several_disks(tmp_path):
    """Found by the fuzzer (ckpt_pt, after the zip pre-flight was added): zipfile.is_zipfile raises
    BadZipFile ("span multiple disks") instead of returning False. The pre-flight now opens the
    archive itself and leaves a damaged one to torch's reader, which refuses it."""
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    data = bytearray(buf.getvalue())
    locator = data.rindex(b"PK\x06\x07")
    struct.pack_into("<I", data, locator + 16, 2)  # total number of disks
    with pytest.raises(CheckpointError):
        _load(tmp_path, bytes(data), ".pt")
