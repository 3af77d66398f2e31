"""Fuzz targets for the decoder entry points: one function per target, taking ``bytes``.

Contract enforced by every target: for any input the entry point returns normally or raises a
:class:`deepcabac_py.errors.DeepCabacError` subclass. Anything else (another exception type,
``MemoryError``, ``RecursionError``, a hang, a crash) is a finding: the target raises
:class:`Finding` (or lets the process die / time out under libFuzzer's ``-timeout``).

Targets (``TARGETS`` maps the CLI names to functions):

* ``model``          -- ``read_stream_header``, ``decode_model(threads=1)``, ``decode_levels`` on raw bytes.
* ``model_sealed``   -- the same after *sealing* the input: the input is an unpacked stream
                        (``version:u16 body_len:u32 body payload``); the target deflates the body, writes
                        the header CRC and recomputes every payload CRC, so mutations reach the header
                        parser and the CABAC level decoder instead of dying at a checksum.
* ``update``         -- ``read_update_header``, ``decode_update(data, BASE)`` (with a session at the
                        message's position when it names one), ``apply_delta``, ``iter_messages``.
* ``update_sealed``  -- the same after recomputing the header and payload CRCs of the first message.
* ``ckpt_safetensors``, ``ckpt_npz``, ``ckpt_pt`` -- ``load_checkpoint`` on the bytes written to a
                        temporary file with that suffix (``CheckpointError``/``DeepCabacError`` allowed).
"""

from __future__ import annotations

import os
import struct
import tempfile
import traceback
import zlib

import numpy as np

import deepcabac_py as dc
from deepcabac_py import updates as up
from deepcabac_py.checkpoint import load_checkpoint
from deepcabac_py.container import MAGIC, PREAMBLE, read_header, write_header
from deepcabac_py.errors import DeepCabacError, UpdateMismatchError


class Finding(Exception):
    """The contract was broken: an entry point raised something other than a DeepCabacError."""


def _check(fn, *args, **kwargs):
    """Call ``fn``; return its result or ``None`` if it raised a DeepCabacError; else raise Finding."""
    try:
        return fn(*args, **kwargs)
    except DeepCabacError:
        return None
    except BaseException as exc:  # noqa: BLE001 -- every other type is a finding (incl. MemoryError)
        if isinstance(exc, KeyboardInterrupt):
            raise
        where = "".join(traceback.format_tb(exc.__traceback__, limit=-4))
        raise Finding(f"{getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {str(exc)[:300]}\n"
                      f"innermost frames:\n{where}") from exc


# --------------------------------------------------------------------------------------------------
# a fixed small base model for update streams
# --------------------------------------------------------------------------------------------------


def base_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "a.weight": (rng.standard_normal((8, 6)) * 0.1).astype(np.float32),
        "a.bias": (rng.standard_normal(6) * 0.01).astype(np.float32),
        "b.weight": (rng.standard_normal((3, 2, 3, 3)) * 0.1).astype(np.float16),
        "count": np.array([5, 7, 9], dtype=np.int64),
    }


BASE = base_model()


# --------------------------------------------------------------------------------------------------
# sealing helpers (recompute checksums so that mutations reach the parsers behind them)
# --------------------------------------------------------------------------------------------------

_UNPACKED = struct.Struct("<HI")  # version, body length


def unpack_model_stream(data: bytes) -> bytes:
    """A valid .dcb stream in the unpacked form used by the ``model_sealed`` corpus."""
    (header_size,) = struct.unpack_from("<I", data, 12)
    (version,) = struct.unpack_from("<H", data, 8)
    body = zlib.decompress(data[PREAMBLE.size + 4:PREAMBLE.size + header_size - 4])
    return _UNPACKED.pack(version, len(body)) + body + data[PREAMBLE.size + header_size:]


def seal_model_stream(data: bytes) -> bytes:
    """Unpacked form -> stream with a valid deflated header, header CRC and (if parseable) payload CRCs."""
    if len(data) < _UNPACKED.size:
        return data
    version, body_len = _UNPACKED.unpack_from(data)
    body = data[_UNPACKED.size:_UNPACKED.size + body_len]
    payload = data[_UNPACKED.size + body_len:]
    packed = struct.pack("<I", body_len) + zlib.compress(body, 1)
    head = PREAMBLE.pack(MAGIC, version, 0, len(packed) + 4) + packed
    stream = head + struct.pack("<I", zlib.crc32(head)) + payload
    try:
        header = read_header(memoryview(stream), total_size=len(stream))
    except DeepCabacError:
        return stream
    pay = stream[header.header_size:]
    for e in header.tensors:
        if not e.is_alias:
            e.crc32 = zlib.crc32(pay[e.offset:e.offset + e.size])
    try:
        return write_header(header.qp, header.qp_1d, header.qp_density, header.metadata, header.tensors) + pay
    except Exception:  # noqa: BLE001 -- a writer limit is not the decoder's business
        return stream


def seal_update_message(data: bytes) -> bytes:
    """Recompute the header CRC and (if the header parses) the payload CRC of the first message."""
    if len(data) < PREAMBLE.size:
        return data
    (header_size,) = struct.unpack_from("<I", data, 12)
    end = PREAMBLE.size + header_size
    if header_size < 4 or end > len(data):
        return data
    buf = bytearray(data)
    struct.pack_into("<I", buf, end - 4, zlib.crc32(bytes(buf[:end - 4])))
    try:
        header = up.read_update_header(bytes(buf[:end]), total_size=1 << 62)
    except DeepCabacError:
        return bytes(buf)
    p0, p1 = header.header_size, header.header_size + header.payload_size
    if p1 + 4 <= len(buf):
        struct.pack_into("<I", buf, p1, zlib.crc32(bytes(buf[p0:p1])))
    return bytes(buf)


# --------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------


def target_model(data: bytes) -> None:
    _check(dc.read_stream_header, data)
    _check(dc.decode_model, data, threads=1)
    _check(dc.decode_levels, data, threads=1)


def target_model_sealed(data: bytes) -> None:
    target_model(seal_model_stream(data))


def _decode_update(data: bytes):
    header = up.read_update_header(data)
    session = None
    if header.session_id:
        session = up.UpdateSession(header.session_id)
        session.seq = header.session_seq
    try:
        return up.decode_update(data, BASE, session=session)
    except UpdateMismatchError:
        # a mutated parent hash would stop every input here: decode without the parent check too
        return up.decode_update(data, BASE, session=session, check_parent=False)


def _apply(data: bytes):
    upd = _decode_update(data)
    return up.apply_delta(BASE, upd)


def _iterate(data: bytes) -> int:
    return sum(1 for _ in up.iter_messages(data))


def target_update(data: bytes) -> None:
    _check(up.read_update_header, data)
    _check(_apply, data)
    _check(_iterate, data)


def target_update_sealed(data: bytes) -> None:
    target_update(seal_update_message(data))


def _load(data: bytes, suffix: str):
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="dcfuzz-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return _check(load_checkpoint, path)
    finally:
        os.unlink(path)


def target_ckpt_safetensors(data: bytes) -> None:
    _load(data, ".safetensors")


def target_ckpt_npz(data: bytes) -> None:
    _load(data, ".npz")


def target_ckpt_pt(data: bytes) -> None:
    _load(data, ".pt")


TARGETS = {
    "model": target_model,
    "model_sealed": target_model_sealed,
    "update": target_update,
    "update_sealed": target_update_sealed,
    "ckpt_safetensors": target_ckpt_safetensors,
    "ckpt_npz": target_ckpt_npz,
    "ckpt_pt": target_ckpt_pt,
}
