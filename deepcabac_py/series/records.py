"""The ``.dcs`` file: a preamble, then records appended one after another (docs/format.md, "Checkpoint
series").

A record is ``b"DCSR"``, u32 index, u32 meta length, u64 payload length, u32 CRC-32 of meta and
payload, then the meta (UTF-8 JSON: kind, parent, step, settings) and the payload (a model stream).
Appending writes one record at the end and syncs it; a record cut short (a crash mid-append) is not
part of the series, and the next append writes over it. An exclusive lock on the file keeps a
second writer out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import CorruptStreamError, FormatError, InputError, OutputError
from ..io.checksum import crc32
from ..io.inputs import unreadable

__all__ = ["SERIES_MAGIC", "SERIES_VERSION", "Record", "SeriesFile"]

SERIES_MAGIC = b"\x89DCS\r\n\x1a\n"
SERIES_VERSION = 6  # 2: first moments in the update domain (``update_domain`` in a record's meta);
# 3: weights' predicted residuals in their second moment's scale (``v_scaled``); 4: SGD's momentum
# buffers in the update domain and predicting their weights' residuals; 5: moments named by the
# state dict's structure too (torch.distributed.checkpoint keys state by parameter name); 6: a
# directory entry's carried files coded against its parent's (``carried``)
_READABLE = (1, 2, 3, 4, 5, 6)
_PREAMBLE = struct.Struct("<8sHH")  # magic, version, flags (0)
_RECORD = struct.Struct("<4sIIQI")  # tag, index, meta length, payload length, crc32
_TAG = b"DCSR"
MAX_META_BYTES = 1 << 20


@dataclass(frozen=True)
class Record:
    """Where one record is, and its meta (the payload is read on demand)."""

    index: int
    meta: dict[str, Any]
    payload_offset: int
    payload_size: int
    crc32: int
    meta_bytes: bytes


class SeriesFile:
    """A series file opened for reading (``writer=False``) or appending (an exclusive lock)."""

    def __init__(self, path: str | os.PathLike, *, writer: bool = False):
        self.path = os.fspath(path)
        self.writer = writer
        self._created = False  # (a writer that made the file takes it away again if nothing goes in)
        try:
            if writer:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    self._created = True
                except FileExistsError:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                self._f: BinaryIO = os.fdopen(fd, "r+b")
            else:
                self._f = open(self.path, "rb")
        except IsADirectoryError:
            raise InputError(f"{self.path} is a directory, not a checkpoint series") from None
        except FileNotFoundError:
            raise InputError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise (OutputError(f"{self.path}: {exc.strerror}") if writer else unreadable(self.path, exc)) from None
        try:
            if writer:
                try:
                    fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OutputError(f"{self.path}: another writer is appending to this series") from None
            self.records, self.end = self._scan()
        except BaseException:
            self._f.close()
            raise

    def _scan(self) -> tuple[list[Record], int]:
        f = self._f
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = f.read(_PREAMBLE.size)
        if size == 0 and self.writer:  # a new series
            f.write(_PREAMBLE.pack(SERIES_MAGIC, SERIES_VERSION, 0))
            f.flush()
            os.fsync(f.fileno())
            self.version = SERIES_VERSION
            return [], _PREAMBLE.size
        if len(head) < _PREAMBLE.size or head[:8] != SERIES_MAGIC:
            raise FormatError(f"{self.path} is not a checkpoint series (no .dcs preamble)")
        _, version, flags = _PREAMBLE.unpack(head)
        if version not in _READABLE or flags:
            raise FormatError(f"{self.path}: checkpoint series version {version} (flags {flags}); this reader "
                              f"reads versions {', '.join(map(str, _READABLE))}")
        self.version = version
        records: list[Record] = []
        pos = _PREAMBLE.size
        while pos < size:
            if size - pos < _RECORD.size:
                break  # a record cut short: not part of the series
            f.seek(pos)
            tag, index, meta_len, payload_len, crc = _RECORD.unpack(f.read(_RECORD.size))
            if tag != _TAG or index != len(records) or meta_len > MAX_META_BYTES:
                raise CorruptStreamError(f"{self.path}: entry {len(records)}: damaged record header")
            body = pos + _RECORD.size
            if size - body < meta_len + payload_len:
                break
            meta_bytes = f.read(meta_len)
            try:
                meta = json.loads(meta_bytes.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                meta = {"damaged": True}
            if not isinstance(meta, dict):
                meta = {"damaged": True}
            records.append(Record(index, meta, body + meta_len, payload_len, crc, meta_bytes))
            pos = body + meta_len + payload_len
        return records, pos

    def payload(self, record: Record) -> bytes:
        """The record's payload, its checksum verified."""
        self._f.seek(record.payload_offset)
        data = self._f.read(record.payload_size)
        if len(data) != record.payload_size or crc32(data, crc32(record.meta_bytes)) != record.crc32:
            raise CorruptStreamError(f"{self.path}: entry {record.index} is damaged (checksum mismatch)")
        if record.meta.get("damaged"):
            raise CorruptStreamError(f"{self.path}: entry {record.index} has a damaged description")
        return data

    def append(self, meta: dict[str, Any], payload: bytes) -> Record:
        """Write one record at the end (over a record cut short by a crash) and sync it."""
        if not self.writer:
            raise RuntimeError("internal error: appending to a series opened for reading")
        meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode("utf-8")
        index = len(self.records)
        crc = crc32(payload, crc32(meta_bytes))
        f = self._f
        try:
            if self.version != SERIES_VERSION:
                # (an older series gets the version of what is appended: its records read as before)
                f.seek(len(SERIES_MAGIC))
                f.write(struct.pack("<H", SERIES_VERSION))
                self.version = SERIES_VERSION
            f.truncate(self.end)
            f.seek(self.end)
            f.write(_RECORD.pack(_TAG, index, len(meta_bytes), len(payload), crc))
            f.write(meta_bytes)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            try:
                f.truncate(self.end)  # (the series as it was)
            except OSError:
                pass
            raise OutputError(f"{self.path}: cannot append: {exc.strerror}") from None
        record = Record(index, meta, self.end + _RECORD.size + len(meta_bytes), len(payload), crc, meta_bytes)
        self.records.append(record)
        self.end = record.payload_offset + len(payload)
        return record

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SeriesFile:
        return self

    def __exit__(self, *exc) -> None:
        # (a first append that failed leaves no empty series behind; the lock is still held)
        if exc[0] is not None and self._created and not self.records:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.close()
