"""Checkpoints (and session snapshots) built to hurt the loader: zip bombs, zip members that lie about
their size, and pickles whose shared references expand exponentially. Each is refused with a
CheckpointError, quickly and without allocating what it claims. (Pickles with code, lying safetensors
headers and npz object arrays are in test_checkpoint.py.)"""

from __future__ import annotations

import contextlib
import io
import struct
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest
import torch
from helpers import no_hang

from deepcabac_py.errors import CheckpointError
from deepcabac_py.io.checkpoint import MAX_SHARED_ENTRIES, flatten
from deepcabac_py.io.files import ZIP_SLACK, load_checkpoint

BOMB_BYTES = ZIP_SLACK + (32 << 20)  # deflates to about 100 KB: far more than 100x


def refused_within(limit: int, error, match: str, fn, *args, **kwargs):
    """Assert ``fn(*args, **kwargs)`` raises ``error`` (matching ``match``) with a peak of traced
    memory below ``limit`` bytes; return the exception."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match) as ei:
            fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak:,} bytes"
    return ei.value


def _npy_header(shape, descr="<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _write_zeros_member(zf: zipfile.ZipFile, name: str, head: bytes, nbytes: int) -> None:
    with zf.open(name, "w", force_zip64=True) as m:
        m.write(head)
        block = bytes(1 << 22)
        for start in range(0, nbytes, len(block)):
            m.write(block[:min(len(block), nbytes - start)])


@pytest.fixture(scope="module")
def npz_bomb(tmp_path_factory):
    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        _write_zeros_member(zf, "w.npy", _npy_header((BOMB_BYTES // 4,)), BOMB_BYTES)
    return path


def test_npz_zip_bomb_is_refused_before_extraction(npz_bomb):
    assert npz_bomb.stat().st_size * 100 < BOMB_BYTES - ZIP_SLACK
    exc = refused_within(4 << 20, CheckpointError, "zip bomb", load_checkpoint, npz_bomb)
    assert f"{BOMB_BYTES + 128:,} bytes" in str(exc)


def test_max_bytes_lets_the_user_choose_the_bound(tmp_path, npz_bomb):
    small = tmp_path / "small.npz"
    np.savez(small, w=np.arange(1000, dtype=np.float32))
    assert load_checkpoint(small, max_bytes=10_000).tensors["w"].shape == (1000,)
    with pytest.raises(CheckpointError, match="max_bytes=1,000"):
        load_checkpoint(small, max_bytes=1000)
    with pytest.raises(CheckpointError, match="max_bytes=1,000"):
        load_checkpoint(npz_bomb, max_bytes=1000)
    with pytest.raises(ValueError):
        load_checkpoint(small, max_bytes=-1)


def _patch_sizes(data: bytes, compressed: int, uncompressed: int) -> bytes:
    """Overwrite the 32-bit sizes of the (only) local header and central directory entry."""
    buf = bytearray(data)
    local = buf.index(b"PK\x03\x04")
    struct.pack_into("<II", buf, local + 18, compressed, uncompressed)
    central = buf.index(b"PK\x01\x02")
    struct.pack_into("<II", buf, central + 20, compressed, uncompressed)
    return bytes(buf)


def test_npz_member_claiming_bytes_past_the_end_is_refused(tmp_path):
    """A stored member whose directory entry and .npy header agree on 1 GiB, in a file of 200 bytes:
    numpy would allocate the GiB before finding the data missing."""
    shape = (1 << 28,)
    head = _npy_header(shape)
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("w.npy", head + bytes(16))
    claimed = len(head) + (1 << 30)
    path = tmp_path / "lie.npz"
    path.write_bytes(_patch_sizes(raw.getvalue(), claimed, claimed))
    refused_within(4 << 20, CheckpointError, "past the end", load_checkpoint, path)


def test_npz_stored_member_with_two_sizes_is_refused(tmp_path):
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("w.npy", _npy_header((4,)) + bytes(16))
    entry = len(_npy_header((4,))) + 16
    path = tmp_path / "two.npz"
    path.write_bytes(_patch_sizes(raw.getvalue(), entry, entry * 1000))
    with pytest.raises(CheckpointError, match="declares"):
        load_checkpoint(path)


@contextlib.contextmanager
def _repacked_torch_file(path, obj, compression: int, data_pkl: bytes | None = None):
    """``torch.save(obj)`` re-packed member by member into ``path`` with ``compression`` (and
    ``data_pkl`` as its pickle, if given); yields the archive open for writing extra members."""
    plain = io.BytesIO()
    torch.save(obj, plain)
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, \
            zipfile.ZipFile(path, "w", compression=compression) as dst:
        for info in src.infolist():
            body = data_pkl if data_pkl is not None and info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info.filename, body)
        yield src.namelist()[0].split("/")[0], dst


def test_torch_zip_bomb_is_refused_before_torch_reads_it(tmp_path):
    """torch's own zip format, re-packed with deflate around a storage of zeros: its reader would
    allocate the record's declared size."""
    path = tmp_path / "bomb.pt"
    with _repacked_torch_file(path, {"w": torch.zeros(4)}, zipfile.ZIP_DEFLATED) as (root, dst):
        _write_zeros_member(dst, root + "/data/99", b"", BOMB_BYTES)
    with pytest.raises(CheckpointError, match="zip bomb"):
        load_checkpoint(path)


def _shared_nesting(depth: int):
    node = [torch.zeros(1)]
    for _ in range(depth):
        node = [node, node]  # one list, referenced twice: 2**depth paths to the tensor
    return {"a": node}


def test_pickle_of_exponentially_shared_containers_is_refused_quickly(tmp_path):
    path = tmp_path / "laughs.pt"
    torch.save(_shared_nesting(48), path)
    assert path.stat().st_size < 4096
    with no_hang(60), pytest.raises(CheckpointError, match="shared by reference"):
        load_checkpoint(path)


def test_modest_sharing_is_still_flattened(tmp_path):
    config = {"lr": 0.1, "layers": list(range(10))}
    path = tmp_path / "shared.pt"
    torch.save({"args": config, "hparams": config, "w": torch.ones(2), "deep": _shared_nesting(8)}, path)
    ckpt = load_checkpoint(path)
    assert len(ckpt.tensors) + len(ckpt.aliases) == 1 + 2 ** 8  # every path to the tensor is a name
    assert len(ckpt.tensors) == 2  # ... and the copies of the shared one are aliases of it
    assert (2 ** 9) * 3 < MAX_SHARED_ENTRIES


def test_flatten_bound_is_on_copies_not_on_size():
    """A large structure without sharing is not limited by the sharing bound."""
    big = {f"k{i}": i for i in range(MAX_SHARED_ENTRIES + 10)}
    assert flatten({"vocab": big}).skeleton["root"]["$dict"][0][0] == "vocab"
    with pytest.raises(TypeError, match="shared by reference"):
        flatten({"a": big, "b": big})


def test_deeply_nested_pickle_is_refused(tmp_path):
    """Nesting deeper than the interpreter's recursion limit, written as raw pickle opcodes."""
    depth = 100_000
    body = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."  # EMPTY_LIST x depth, APPEND x depth-1
    path = tmp_path / "deep.pt"
    with _repacked_torch_file(path, {"w": torch.ones(1)}, zipfile.ZIP_STORED, data_pkl=body):
        pass
    with no_hang(60), pytest.raises(CheckpointError) as ei:
        load_checkpoint(path)
    assert "\n" not in str(ei.value)


# --------------------------------------------------------------------------------------------------
# session snapshots travel too (a server hands one to a client that resyncs; Flower carries them)
# --------------------------------------------------------------------------------------------------


def _snapshot_of(npz_bytes: bytes) -> bytes:
    return zlib.compress(npz_bytes, 6)


def test_snapshot_zlib_bomb_stops_at_max_bytes():
    from deepcabac_py.errors import LimitExceededError
    from deepcabac_py.updates.sessions import UpdateSession

    bomb = zlib.compressobj(9)
    blob = b"".join(bomb.compress(bytes(1 << 22)) for _ in range(16)) + bomb.flush()  # 64 MiB of zeros
    assert len(blob) < 100_000
    refused_within(4 << 20, LimitExceededError, "max_bytes=1,048,576", UpdateSession.from_snapshot, blob,
                   max_bytes=1 << 20)


def test_snapshot_with_a_deflated_member_or_damage_is_refused():
    from deepcabac_py.errors import CorruptStreamError
    from deepcabac_py.updates.sessions import UpdateSession

    good = UpdateSession(3)
    assert UpdateSession.from_snapshot(good.snapshot()).session_id == 3
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array([3, 0], dtype=np.int64))
    with pytest.raises(CorruptStreamError, match="compressed"):
        UpdateSession.from_snapshot(_snapshot_of(buf.getvalue()))
    with pytest.raises(CorruptStreamError, match="truncated"):
        UpdateSession.from_snapshot(good.snapshot()[:-3])
    for junk in (b"", b"\x00" * 10, _snapshot_of(b"PK\x05\x06" + bytes(18)), _snapshot_of(b"not a zip")):
        with pytest.raises(CorruptStreamError):
            UpdateSession.from_snapshot(junk)
