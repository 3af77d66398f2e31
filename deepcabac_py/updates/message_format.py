"""The update message format (docs/format.md, "Update streams"): its constants and codes, the
header a writer and a reader describe alike (entries, the parent's table), writing a message and
reading its header without its payload."""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

import numpy as np

from ..entropy.levelcoder import LEVEL_MAX
from ..errors import CorruptStreamError, FormatError, TruncatedStreamError
from ..io.checksum import crc32
from ..io.dtypes import DType
from ..io.kinds import UPDATE_MAGIC
from ..model.container import check_preamble
from . import _update_kernels

MAGIC = UPDATE_MAGIC
# 2: the MIX feature (mixed context models); 3: the compact header (parent hash prefix, shared entry
# fields). Versions 1 and 2 stay readable and writable (compact=False).
FORMAT_VERSION = 3
COMPACT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PREAMBLE = struct.Struct("<8sHHI")  # magic, version, flags, header_size
FLAG_TABLE = 1  # the header lists the parent's tensors (names, dtypes, shapes)
_KNOWN_FLAGS = FLAG_TABLE
MAX_HEADER_SIZE = 1 << 28
MAX_NDIM = 32
HASH_SIZE = 32
# A version-3 header names its parent by the first 8 bytes of the SHA-256: enough to refuse a wrong
# base (the chance that another model matches is 2**-64), 24 bytes less in every message.
COMPACT_HASH_SIZE = 8
# Version-3 entry layout bits
LAYOUT_INDEXED = 1  # every entry carries its index gap; else the entries are all the parent's tensors
LAYOUT_SHARED = 2  # method, sign mode and features are given once for all entries

# Measured in benchmarks/bench_updates.py: row skipping pays only when whole rows are zeroed
# (structured sparsification, rows=...), so it is off by default and on with rows=.
DEFAULT_FEATURES = _update_kernels.F_ALL & ~_update_kernels.F_ROWSKIP
FEATURE_NAMES = {
    "temporal": _update_kernels.F_TEMPORAL, "history": _update_kernels.F_HISTORY, "column": _update_kernels.F_COLUMN,
    "row": _update_kernels.F_ROW, "rowskip": _update_kernels.F_ROWSKIP, "sign": _update_kernels.F_SIGNCTX,
    "area": _update_kernels.F_AREA, "mix": _update_kernels.F_MIX,
}
# the features that need an UpdateSession's memory
SESSION_FEATURES = _update_kernels.F_TEMPORAL | _update_kernels.F_HISTORY | _update_kernels.F_AREA


class UpdateCoder(enum.IntEnum):
    """Payload coder of a message; frozen codes."""

    CABAC = 1  # _update_kernels: one arithmetic-coded substream for all tensors
    GOLOMB = 2  # golomb: Golomb-Rice gaps + raw sign bits (levels in {-1, 0, 1} only)


class Method(enum.IntEnum):
    """How a tensor's levels were made (and how they are applied); frozen codes."""

    STC = 1  # ternary, values = level * step
    SBC = 2  # binary (one sign), values = level * step
    TOPK = 3  # top-k on a uniform grid, values = level * step
    INTEGER = 4  # exact integer difference (integer tensors); step is 0


class SignMode(enum.IntEnum):
    CODED = _update_kernels.SIGN_CODED
    ALL_POSITIVE = _update_kernels.SIGN_ALL_POSITIVE
    ALL_NEGATIVE = _update_kernels.SIGN_ALL_NEGATIVE


FLOATS = ("float16", "float32", "float64")
INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


# --------------------------------------------------------------------------------------------------
# header: one description used by writer and reader
# --------------------------------------------------------------------------------------------------


@dataclass
class UpdateEntry:
    """One coded tensor of a message."""

    index: int  # position of the tensor among the parent's tensors in name order
    method: Method
    step: float
    nnz: int
    maxabs: int
    sign_mode: SignMode
    features: int
    name: str | None = None


@dataclass
class UpdateHeader:
    """Everything in a message but the payload (:func:`read_update_header`)."""

    version: int
    round: int
    parent_round: int
    parent_hash: bytes
    session_id: int  # 0: no session (fresh contexts, no history)
    session_seq: int
    coder: UpdateCoder
    tensor_total: int
    table: list[tuple[str, str, tuple[int, ...]]] | None  # (name, dtype, shape) of the parent's tensors
    entries: list[UpdateEntry]
    header_size: int  # bytes before the payload
    payload_size: int

    @property
    def total_size(self) -> int:
        return self.header_size + self.payload_size + 4

    @property
    def nnz(self) -> int:
        return sum(e.nnz for e in self.entries)

    def parent_matches(self, digest: bytes) -> bool:
        """True if ``digest`` (a full SHA-256) is the parent this message names (version 3 stores
        its first 8 bytes)."""
        return len(digest) == HASH_SIZE and digest[:len(self.parent_hash)] == self.parent_hash


def _uvarint(x: int) -> bytes:
    if x < 0:
        raise ValueError("varints are unsigned")
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _Cursor:
    def __init__(self, data: bytes, pos: int, end: int):
        self.data, self.pos, self.end = data, pos, end

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise CorruptStreamError(f"update header field '{what}' runs past the end of the header")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def uvarint(self, what: str, limit: int = (1 << 63) - 1) -> int:
        x, shift = 0, 0
        while True:
            b = self.u8(what)
            x |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CorruptStreamError(f"update header field '{what}' is an overlong varint")
        if x > limit:
            raise CorruptStreamError(f"update header field '{what}' = {x} exceeds {limit}")
        return x


def write_message(*, round_index: int, parent_round: int, parent_hash: bytes, session_id: int, session_seq: int,
                   coder: UpdateCoder, tensor_total: int, table, entries: list[UpdateEntry], payload: bytes,
                   compact: bool = True) -> bytes:
    if compact:
        parent_hash = parent_hash[:COMPACT_HASH_SIZE]
    body = [_uvarint(round_index), _uvarint(parent_round), parent_hash, _uvarint(session_id), _uvarint(session_seq),
            bytes([coder]), _uvarint(tensor_total)]
    if table is not None:
        for name, dtype, shape in table:
            raw = name.encode("utf-8")
            body += [_uvarint(len(raw)), raw, bytes([DType.from_name(dtype), len(shape)])]
            body += [_uvarint(d) for d in shape]
    body.append(_uvarint(len(entries)))
    if compact:
        body += _compact_entries(entries, tensor_total)
    else:
        for e in entries:
            body += [_uvarint(e.index), bytes([e.method]), struct.pack("<f", e.step), _uvarint(e.nnz),
                     _uvarint(e.maxabs), bytes([e.sign_mode, e.features])]
    body.append(_uvarint(len(payload)))
    packed = b"".join(body)
    flags = FLAG_TABLE if table is not None else 0
    if compact:
        version = COMPACT_VERSION
    else:
        # A message that uses no format-2 feature is written as format 1 (readable by older decoders).
        version = 2 if any(e.features & ~_update_kernels.F_ALL_V1 for e in entries) else 1
    head = PREAMBLE.pack(MAGIC, version, flags, len(packed) + 4) + packed
    head += struct.pack("<I", crc32(head))
    return head + payload + struct.pack("<I", crc32(payload))


def _has_maxabs(method: Method) -> bool:
    # STC and SBC levels are ternary: their largest |level| is 1 and is not stored in version 3
    return method in (Method.TOPK, Method.INTEGER)


def _compact_entries(entries: list[UpdateEntry], tensor_total: int) -> list[bytes]:
    """Version-3 entries: a layout byte, the shared fields once, then per entry only what varies."""
    if not entries:
        return []
    indexed = [e.index for e in entries] != list(range(tensor_total))
    first = entries[0]
    shared = all((e.method, e.sign_mode, e.features) == (first.method, first.sign_mode, first.features)
                 for e in entries)
    out = [bytes([(LAYOUT_INDEXED if indexed else 0) | (LAYOUT_SHARED if shared else 0)])]
    if shared:
        out.append(bytes([first.method, first.sign_mode, first.features]))
    last = -1
    for e in entries:
        if indexed:
            out.append(_uvarint(e.index - last - 1))
            last = e.index
        if not shared:
            out.append(bytes([e.method, e.sign_mode, e.features]))
        out += [struct.pack("<f", e.step), _uvarint(e.nnz)]
        if _has_maxabs(e.method):
            out.append(_uvarint(e.maxabs))
    return out


def is_update_stream(data) -> bool:
    """True if ``data`` starts like an update message (magic bytes)."""
    return bytes(data[:len(MAGIC)]) == MAGIC


def check_update_preamble(data) -> tuple[int, int, int]:
    version, flags, header_size = check_preamble(data, magic=MAGIC, versions=READABLE_VERSIONS,
                                                 known_flags=_KNOWN_FLAGS, kind="update", noun="update",
                                                 label="update ", max_header_size=MAX_HEADER_SIZE)
    return version, flags, header_size


def read_update_header(data, *, total_size: int | None = None) -> UpdateHeader:
    """Parse and validate the header of the message at the start of ``data`` (bytes-like).

    ``data`` may hold just the header (pass the message's ``total_size`` then), or more than one
    message (only the first is parsed).
    """
    version, flags, header_size = check_update_preamble(data)
    end = PREAMBLE.size + header_size
    if len(data) < end:
        raise TruncatedStreamError(f"update ends inside its header ({len(data)} of {end} bytes)")
    head = bytes(data[:end])
    if crc32(head[:-4]) != struct.unpack("<I", head[-4:])[0]:
        raise CorruptStreamError("update header checksum mismatch: the header is damaged")
    r = _Cursor(head, PREAMBLE.size, end - 4)
    round_index = r.uvarint("round")
    parent_round = r.uvarint("parent round")
    parent_hash = r.take(COMPACT_HASH_SIZE if version >= COMPACT_VERSION else HASH_SIZE, "parent hash")
    session_id = r.uvarint("session id", (1 << 32) - 1)
    session_seq = r.uvarint("session position")
    try:
        coder = UpdateCoder(r.u8("coder"))
    except ValueError as exc:
        raise FormatError(f"update: {exc}") from None
    # Every listed tensor takes at least 3 bytes: refuse counts the header cannot hold.
    tensor_total = r.uvarint("tensor count", max(0, (r.end - r.pos)) if flags & FLAG_TABLE else (1 << 32))
    table: list[tuple[str, str, tuple[int, ...]]] | None = None
    if flags & FLAG_TABLE:
        table = []
        names = set()
        for i in range(tensor_total):
            raw = r.take(r.uvarint("name length", 1 << 16), "name")
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptStreamError(f"update tensor {i}: name is not UTF-8") from None
            code, ndim = r.u8("dtype"), r.u8("ndim")
            try:
                dtype = DType(code).dtype_name
            except ValueError:
                raise FormatError(f"update tensor {i} ({name!r}): unknown dtype code {code}") from None
            if ndim > MAX_NDIM:
                raise CorruptStreamError(f"update tensor {i} ({name!r}): {ndim} dimensions")
            shape = tuple(r.uvarint("dimension", 1 << 48) for _ in range(ndim))
            if name in names or (table and name <= table[-1][0]):
                raise CorruptStreamError(f"update tensor table is not sorted by unique name at {name!r}")
            names.add(name)
            table.append((name, dtype, shape))
    count = r.uvarint("entry count", min(tensor_total, r.end - r.pos))
    if version >= COMPACT_VERSION:
        entries = _read_compact_entries(r, count, tensor_total, coder, table, version)
    else:
        entries = []
        last = -1
        for j in range(count):
            index = r.uvarint("tensor index", (1 << 32))
            if index <= last or index >= tensor_total:
                raise CorruptStreamError(f"update entry {j}: tensor index {index} out of order or range")
            last = index
            method = _method(r.u8("method"), j)
            (step,) = struct.unpack("<f", r.take(4, "step"))
            nnz = r.uvarint("nnz", 1 << 48)
            maxabs = r.uvarint("largest level", LEVEL_MAX)
            sign_mode = _sign_mode(r.u8("sign mode"), j)
            features = r.u8("features")
            e = UpdateEntry(index, method, step, nnz, maxabs, sign_mode, features)
            _validate_entry(e, j, coder, table, version)
            entries.append(e)
    payload_size = r.uvarint("payload size", 1 << 48)
    if r.pos != r.end:
        raise CorruptStreamError(f"{r.end - r.pos} unexplained bytes at the end of the update header")
    header = UpdateHeader(version, round_index, parent_round, parent_hash, session_id, session_seq, coder, tensor_total,
                          table, entries, end, payload_size)
    available = len(data) if total_size is None else total_size
    if available < header.total_size:
        raise TruncatedStreamError(f"truncated update: {available} bytes, the header describes {header.total_size}")
    return header


def _method(code: int, j: int) -> Method:
    try:
        return Method(code)
    except ValueError as exc:
        raise FormatError(f"update entry {j}: {exc}") from None


def _sign_mode(code: int, j: int) -> SignMode:
    try:
        return SignMode(code)
    except ValueError as exc:
        raise FormatError(f"update entry {j}: {exc}") from None


def _read_compact_entries(r: _Cursor, count: int, tensor_total: int, coder: UpdateCoder, table,
                          version: int) -> list[UpdateEntry]:
    if count == 0:
        return []
    layout = r.u8("entry layout")
    if layout & ~(LAYOUT_INDEXED | LAYOUT_SHARED):
        raise FormatError(f"update: unknown entry layout bits 0x{layout:02x}")
    indexed = bool(layout & LAYOUT_INDEXED)
    if not indexed and count != tensor_total:
        raise CorruptStreamError(f"update lists {count} of {tensor_total} tensors without their indices")
    if layout & LAYOUT_SHARED:
        shared = (_method(r.u8("method"), 0), _sign_mode(r.u8("sign mode"), 0), r.u8("features"))
    entries = []
    last = -1
    for j in range(count):
        if indexed:
            index = last + 1 + r.uvarint("tensor index gap", 1 << 32)
            if index >= tensor_total:
                raise CorruptStreamError(f"update entry {j}: tensor index {index} out of range")
        else:
            index = j
        last = index
        if layout & LAYOUT_SHARED:
            method, sign_mode, features = shared
        else:
            method, sign_mode, features = _method(r.u8("method"), j), _sign_mode(r.u8("sign mode"), j), r.u8("features")
        (step,) = struct.unpack("<f", r.take(4, "step"))
        nnz = r.uvarint("nnz", 1 << 48)
        maxabs = r.uvarint("largest level", LEVEL_MAX) if _has_maxabs(method) else 1
        e = UpdateEntry(index, method, step, nnz, maxabs, sign_mode, features)
        _validate_entry(e, j, coder, table, version)
        entries.append(e)
    return entries


def _validate_entry(e: UpdateEntry, j: int, coder: UpdateCoder, table, version: int = FORMAT_VERSION) -> None:
    where = f"update entry {j}"
    if e.features & ~(_update_kernels.F_ALL if version >= 2 else _update_kernels.F_ALL_V1):
        raise FormatError(f"{where}: unknown feature bits 0x{e.features:02x}")
    if e.nnz < 1 or e.maxabs < 1:
        raise CorruptStreamError(f"{where}: a listed tensor has nonzeros")
    if e.method == Method.INTEGER:
        if e.step != 0.0:
            raise CorruptStreamError(f"{where}: an integer difference has no step")
    elif not (np.isfinite(e.step) and e.step > 0):
        raise CorruptStreamError(f"{where}: step {e.step} is not a positive finite number")
    if e.method in (Method.STC, Method.SBC) and e.maxabs != 1:
        raise CorruptStreamError(f"{where}: {e.method.name} levels are ternary")
    if e.method == Method.SBC and e.sign_mode == SignMode.CODED:
        raise CorruptStreamError(f"{where}: SBC sends no signs")
    if coder == UpdateCoder.GOLOMB and (e.maxabs != 1 or e.features):
        raise CorruptStreamError(f"{where}: the Golomb coder carries ternary levels without features")
    if table is not None:
        name, dtype, shape = table[e.index]
        e.name = name
        numel = math.prod(shape)
        if e.nnz > numel:
            raise CorruptStreamError(f"{where} ({name!r}): {e.nnz} nonzeros in {numel} elements")
        check_method_dtype(e.method, dtype, where)


def check_method_dtype(method: Method, dtype: str, where: str) -> None:
    if method == Method.INTEGER:
        if dtype not in INTS:
            raise CorruptStreamError(f"{where}: integer difference of a {dtype} tensor")
    elif dtype not in FLOATS:
        raise CorruptStreamError(f"{where}: float update of a {dtype} tensor")
