"""Update streams: sparse weight updates coded against their parent model.

One *message* carries the update of one round: which model it applies to (the parent's round index
and the SHA-256 of its state, checked by :func:`apply_update`), which coding session it continues,
and the sparse levels and step of every tensor that changed. Messages are self-delimiting, so a
stream of rounds is simply the messages one after the other, in a file or on a socket
(:class:`UpdateStreamWriter`, :func:`iter_messages`).

    data = encode_update(new, base, density=0.01)           # bytes (STC levels, our coder)
    new2 = apply_update(base, data)                          # refuses a base with another hash
    upd = decode_update(data, base)                          # levels, steps, header

A :class:`UpdateSession` holds what both ends learned from earlier messages of the same stream:
the adaptive contexts of every tensor, the co-located levels of the previous update (temporal
context) and per position how often and how long ago it was nonzero, with its last sign (history).
The encoder and the decoder each keep one; a message names the session and its position in it, and
decoding refuses a session that is not at that position. ``docs/format.md`` ("Update streams") is
the byte-level description.
"""

from __future__ import annotations

import enum
import hashlib
import io
import math
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..entropy.levelcoder import LEVEL_MAX
from ..errors import (
    CorruptStreamError,
    DeepCabacWarning,
    FormatError,
    LimitExceededError,
    TruncatedStreamError,
    UpdateMismatchError,
)
from ..io.checksum import crc32
from ..io.dtypes import DType
from ..io.inputs import read_exactly
from ..io.kinds import UPDATE_MAGIC
from ..model.container import check_preamble
from . import _update_kernels, golomb
from .sparsify import ErrorFeedback, SparseTensor, reconstruct, sparsify

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
_SESSION_FEATURES = _update_kernels.F_TEMPORAL | _update_kernels.F_HISTORY | _update_kernels.F_AREA


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


_FLOATS = ("float16", "float32", "float64")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


# --------------------------------------------------------------------------------------------------
# models: flat numpy views and the parent hash
# --------------------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    name: str
    array: np.ndarray  # C-contiguous carrier array
    dtype: str
    is_torch: bool


def _flat_model(model) -> dict[str, _Tensor]:
    """name -> tensor, sorted by name. Accepts flat mappings of tensors and Checkpoints."""
    from ..io.checkpoint import Checkpoint, tensor_to_numpy

    tensors = model.tensors if isinstance(model, Checkpoint) else model
    if not isinstance(tensors, Mapping):
        raise TypeError(f"expected a mapping of tensors or a Checkpoint, got {type(model).__name__}")
    if tensors and all(isinstance(v, _Tensor) for v in tensors.values()):
        return dict(sorted(tensors.items()))  # already flat
    out = {}
    for name in sorted(tensors):
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        arr, dtype, is_torch = tensor_to_numpy(tensors[name])
        out[name] = _Tensor(name, arr, dtype, is_torch)
    return out


def model_hash(model) -> bytes:
    """SHA-256 of a model state: every tensor's name, dtype, shape and bytes, in name order."""
    return _hash_flat(_flat_model(model))


def _hash_flat(flat: dict[str, _Tensor]) -> bytes:
    h = hashlib.sha256()
    for name, t in flat.items():
        h.update(name.encode("utf-8") + b"\0" + t.dtype.encode() + b"\0")
        h.update(struct.pack(f"<I{t.array.ndim}Q", t.array.ndim, *t.array.shape))
        arr = t.array
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        h.update(np.ascontiguousarray(arr).data.cast("B"))
    return h.digest()


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    numel = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 0 and numel > 0:
        return int(shape[0]), numel // int(shape[0])
    return 1, numel


# --------------------------------------------------------------------------------------------------
# session
# --------------------------------------------------------------------------------------------------


@dataclass
class _TensorState:
    ctx: np.ndarray  # int64 [N_CTX_U, 2]
    parent: np.ndarray  # int8 flat: the previous update's levels, clipped to [-2, 2]
    hist: np.ndarray  # uint16 flat: last sign (1 +, 2 -) | count of nonzeros (<= 15) << 2 | age (<= 63) << 6


def _next_hist(hist: np.ndarray, levels: np.ndarray | None) -> np.ndarray:
    """The history after one more message (``levels`` None: the tensor was not listed, all zero)."""
    h = hist.astype(np.int64)
    sign = h & 3
    count = (h >> _update_kernels.HIST_COUNT_SHIFT) & _update_kernels.HIST_COUNT_MAX
    age = (h >> _update_kernels.HIST_AGE_SHIFT) & _update_kernels.HIST_AGE_MAX
    age = np.where(age > 0, np.minimum(age + 1, _update_kernels.HIST_AGE_MAX), 0)
    if levels is not None:
        nz = levels != 0
        sign = np.where(levels > 0, 1, np.where(levels < 0, 2, sign))
        count = np.minimum(count + nz, _update_kernels.HIST_COUNT_MAX)
        age = np.where(nz, 1, age)
    packed = sign | (count << _update_kernels.HIST_COUNT_SHIFT) | (age << _update_kernels.HIST_AGE_SHIFT)
    return packed.astype(np.uint16)


def _fresh_ctx() -> np.ndarray:
    return _update_kernels.fresh_contexts(1)


def _check_state_values(st: _TensorState, i: int) -> None:
    """Refuse session arrays no coder could have produced (the kernels index tables with them)."""
    p, n, w = st.ctx[:_update_kernels.CTX_WSIG, 0], st.ctx[:, 1], st.ctx[_update_kernels.CTX_WSIG:, 0]
    if p.size and (p.min() < 0 or p.max() > (1 << _update_kernels.EST_BITS)):
        raise ValueError(f"tensor {i}: a context probability out of range")
    if n.min() < 0 or n.max() > _update_kernels.COUNT_MAX:
        raise ValueError(f"tensor {i}: a context count out of range")
    if np.abs(w).max() > _update_kernels.MIX_W_MAX:
        raise ValueError(f"tensor {i}: a mixing weight out of range")
    if st.hist.size and (st.hist.max() >> 12 or ((st.hist & 3) == 3).any()):
        raise ValueError(f"tensor {i}: a history value out of range")
    if st.parent.size and np.abs(st.parent.astype(np.int64)).max() > _update_kernels.PARENT_MAX:
        raise ValueError(f"tensor {i}: a previous level out of range")


SNAPSHOT_MAX_BYTES = 1 << 30


def _inflate_snapshot(data, max_bytes: int) -> bytes:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise TypeError(f"max_bytes must be a non-negative int, not {max_bytes!r}")
    inflater = zlib.decompressobj()
    raw = inflater.decompress(bytes(data), max_bytes + 1)
    if len(raw) > max_bytes:
        raise LimitExceededError(f"the session snapshot inflates to more than max_bytes={max_bytes:,}")
    if not inflater.eof:
        raise ValueError("the compressed snapshot is truncated")
    return raw


class UpdateSession:
    """What one end remembers of a stream of updates: contexts, previous levels, history.

    Use one session per direction and per peer on each side (the encoder's and the decoder's stay
    equal as long as every message is decoded in order). ``session_id`` (1 .. 2**32 - 1) is written
    into every message so that a message is never decoded with another stream's state.
    """

    def __init__(self, session_id: int = 1):
        if not (isinstance(session_id, int) and 0 < session_id < (1 << 32)):
            raise ValueError(f"session_id must be an integer in [1, 2**32 - 1], got {session_id!r}")
        self.session_id = session_id
        self.seq = 0
        self.states: dict[str, _TensorState] = {}

    def _state(self, name: str, numel: int) -> _TensorState:
        st = self.states.get(name)
        if st is None:
            st = _TensorState(_fresh_ctx(), np.zeros(numel, np.int8), np.zeros(numel, np.uint16))
            self.states[name] = st
        elif st.parent.size != numel:
            raise UpdateMismatchError(f"tensor {name!r} has {numel} elements, the session knew {st.parent.size}")
        return st

    def _advance(self, coded: dict[str, np.ndarray], ctx: dict[str, np.ndarray]) -> None:
        # (_next_hist in one Numba pass: measured as slow as the coding itself at density 0.001)
        none = np.zeros(0, dtype=np.int32)
        for name, st in self.states.items():
            if name not in coded:
                _update_kernels.advance_session_kernel(st.hist, st.parent, none, False)
        for name, levels in coded.items():
            st = self._state(name, levels.size)
            _update_kernels.advance_session_kernel(st.hist, st.parent, np.ascontiguousarray(levels.reshape(-1)), True)
            if name in ctx:
                st.ctx[:] = ctx[name]
        self.seq += 1

    def copy(self) -> UpdateSession:
        s = UpdateSession(self.session_id)
        s.seq = self.seq
        s.states = {n: _TensorState(st.ctx.copy(), st.parent.copy(), st.hist.copy()) for n, st in self.states.items()}
        return s

    def snapshot(self) -> bytes:
        """The session as bytes (zlib-compressed), e.g. to hand a client that resyncs from a full model."""
        buf = io.BytesIO()
        arrays: dict[str, Any] = {"meta": np.array([self.session_id, self.seq], dtype=np.int64)}
        for i, (name, st) in enumerate(sorted(self.states.items())):
            arrays[f"n{i}"] = np.frombuffer(name.encode("utf-8"), dtype=np.uint8)
            arrays[f"c{i}"], arrays[f"p{i}"], arrays[f"h{i}"] = st.ctx, st.parent, st.hist
        np.savez(buf, **arrays)
        return zlib.compress(buf.getvalue(), 6)

    @classmethod
    def from_snapshot(cls, data: bytes, *, max_bytes: int = SNAPSHOT_MAX_BYTES) -> UpdateSession:
        """The session :meth:`snapshot` wrote. Snapshots travel (a server hands one to a client that
        resyncs), so one is read as hostile input: at most ``max_bytes`` are inflated
        (:class:`LimitExceededError` beyond), and every array must lie, uncompressed, inside them."""
        try:
            raw = _inflate_snapshot(data, max_bytes)
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                for info in zf.infolist():
                    # np.savez stores its members: a deflated one could expand again (a zip bomb)
                    if (info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size
                            or info.header_offset + info.compress_size > len(raw)):
                        raise ValueError(f"member {info.filename!r:.40} is compressed or reaches past the end")
            with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                sid, seq = (int(v) for v in z["meta"])
                s = cls(sid)
                s.seq = seq
                i = 0
                while f"n{i}" in z:
                    st = _TensorState(z[f"c{i}"].copy(), z[f"p{i}"].copy(), z[f"h{i}"].copy())
                    v1_shape = (_update_kernels.N_CTX_V1, _update_kernels.CTX_COLS)
                    if st.ctx.dtype == np.int64 and st.ctx.shape == v1_shape:
                        # a snapshot of update format 1: the contexts of the mixed models start fresh
                        st.ctx = np.concatenate([st.ctx, _fresh_ctx()[_update_kernels.N_CTX_V1:]])
                    if (st.ctx.dtype != np.int64 or st.ctx.shape != (_update_kernels.N_CTX_U, _update_kernels.CTX_COLS)
                            or st.parent.dtype != np.int8 or st.hist.dtype != np.uint16
                            or st.parent.shape != st.hist.shape or st.parent.ndim != 1):
                        raise ValueError(f"tensor {i}: arrays of the wrong type or shape")
                    _check_state_values(st, i)
                    s.states[bytes(z[f"n{i}"]).decode("utf-8")] = st
                    i += 1
        except (zlib.error, ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError,
                RuntimeError) as exc:
            raise CorruptStreamError(f"not a session snapshot: {str(exc)[:200]}") from None
        return s



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


def _write_message(*, round_index: int, parent_round: int, parent_hash: bytes, session_id: int, session_seq: int,
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


def _check_preamble(data) -> tuple[int, int, int]:
    version, flags, header_size = check_preamble(data, magic=MAGIC, versions=READABLE_VERSIONS,
                                                 known_flags=_KNOWN_FLAGS, kind="update", noun="update",
                                                 label="update ", max_header_size=MAX_HEADER_SIZE)
    return version, flags, header_size


def read_update_header(data, *, total_size: int | None = None) -> UpdateHeader:
    """Parse and validate the header of the message at the start of ``data`` (bytes-like).

    ``data`` may hold just the header (pass the message's ``total_size`` then), or more than one
    message (only the first is parsed).
    """
    version, flags, header_size = _check_preamble(data)
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
        _check_method_dtype(e.method, dtype, where)


def _check_method_dtype(method: Method, dtype: str, where: str) -> None:
    if method == Method.INTEGER:
        if dtype not in _INTS:
            raise CorruptStreamError(f"{where}: integer difference of a {dtype} tensor")
    elif dtype not in _FLOATS:
        raise CorruptStreamError(f"{where}: float update of a {dtype} tensor")


# --------------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------------


def _tinfo_and_arrays(items, session: UpdateSession | None):
    """items: list of (name, levels int32 flat, rows, cols, nnz, maxabs, sign_mode, features)."""
    total = sum(it[2] * it[3] for it in items)
    tinfo = np.zeros((len(items), 9), dtype=np.int64)
    levels = np.empty(total, dtype=np.int32)
    parent = np.zeros(total, dtype=np.int8)
    hist = np.zeros(total, dtype=np.uint16)
    ctx = np.empty((len(items) * _update_kernels.N_CTX_U, _update_kernels.CTX_COLS), dtype=np.int64)
    off = 0
    for t, (name, flat, rows, cols, nnz, maxabs, sign_mode, features) in enumerate(items):
        tinfo[t] = (off, rows, cols, nnz, maxabs, sign_mode, features, t * _update_kernels.N_CTX_U,
                    _update_kernels.rate_for(nnz, rows * cols))
        if flat is not None:
            levels[off:off + flat.size] = flat
        c0 = t * _update_kernels.N_CTX_U
        if session is not None:
            st = session._state(name, rows * cols)
            parent[off:off + rows * cols] = st.parent
            hist[off:off + rows * cols] = st.hist
            ctx[c0:c0 + _update_kernels.N_CTX_U] = st.ctx
        else:
            ctx[c0:c0 + _update_kernels.N_CTX_U] = _fresh_ctx()
        off += rows * cols
    return tinfo, levels, parent, hist, ctx


def _cabac_encode(items, session) -> tuple[bytes, dict[str, np.ndarray]]:
    tinfo, levels, parent, hist, ctx = _tinfo_and_arrays(items, session)
    capacity = int(tinfo[:, 3].sum()) * 16 + levels.size // 4 + 64
    while True:
        out = np.empty(capacity, dtype=np.uint8)
        size = _update_kernels.encode_update_kernel(levels, tinfo, parent, hist, ctx, out)
        if size >= 0:
            break
        capacity *= 4
    n_ctx = _update_kernels.N_CTX_U
    ctx_by_name = {it[0]: ctx[t * n_ctx:(t + 1) * n_ctx].copy() for t, it in enumerate(items)}
    return out[1:size].tobytes(), ctx_by_name


def _golomb_encode(items) -> bytes:
    return golomb.encode_tensors([(flat, sign_mode == SignMode.CODED) for _, flat, _, _, _, _, sign_mode, _ in items])


def encode_sparse(
    sparse: Mapping[str, SparseTensor | np.ndarray],
    base,
    *,
    round_index: int | None = None,
    parent_round: int | None = None,
    session: UpdateSession | None = None,
    coder: str = "cabac",
    features: int | None = None,
    table: bool | None = None,
    parent_hash: bytes | None = None,
    compact: bool = True,
) -> bytes:
    """Code already-sparsified levels as one update message against ``base``.

    ``sparse`` maps tensor names of ``base`` to :class:`SparseTensor` (float tensors) or to integer
    arrays (exact differences of integer tensors). Tensors that are missing or all zero are not
    sent. ``session`` continues a stream (contexts, temporal levels, history) and is advanced;
    without one the message stands alone. ``table`` (default: on without a session) lists the
    parent's tensor names and shapes in the header, so the message can be inspected without the
    base; with a session the base supplies them and the header stays small. ``compact`` (default)
    writes update format 3 (``docs/format.md``, U2); ``False`` writes formats 1/2 for older readers.
    """
    flat_base = _flat_model(base)
    ph = _hash_flat(flat_base) if parent_hash is None else parent_hash
    return _encode(sparse, flat_base, ph, round_index=round_index, parent_round=parent_round, session=session,
                   coder=coder, features=features, table=table, compact=compact)


def _encode(sparse, flat_base, parent_hash, *, round_index, parent_round, session, coder, features, table,
            compact=True) -> bytes:
    try:
        coder_code = {"cabac": UpdateCoder.CABAC, "golomb": UpdateCoder.GOLOMB}[coder]
    except KeyError:
        raise ValueError(f"coder must be 'cabac' or 'golomb', got {coder!r}") from None
    if features is None:
        features = DEFAULT_FEATURES
    if not (isinstance(features, int) and 0 <= features <= _update_kernels.F_ALL):
        raise ValueError(f"features must be a bit set in [0, {_update_kernels.F_ALL}], got {features!r}")
    if coder_code == UpdateCoder.GOLOMB:
        features = 0
    if session is not None and not isinstance(session, UpdateSession):
        raise TypeError("session must be an UpdateSession")
    seq = session.seq if session is not None else 0
    parent_round = (seq if session is not None else 0) if parent_round is None else parent_round
    round_index = parent_round + 1 if round_index is None else round_index
    for v, what in ((round_index, "round_index"), (parent_round, "parent_round")):
        if not (isinstance(v, int) and v >= 0):
            raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    names = list(flat_base)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in sparse if n not in index]
    if unknown:
        raise ValueError(f"update names tensors the base does not have: {unknown[:5]}")
    items, entries, coded = [], [], {}
    for name in names:
        if name not in sparse:
            continue
        t = flat_base[name]
        s = sparse[name]
        if isinstance(s, SparseTensor):
            if t.dtype not in _FLOATS:
                raise ValueError(f"{name}: a {t.dtype} tensor takes an integer difference, not a SparseTensor")
            levels, step, method = np.asarray(s.levels), float(np.float32(s.step)), Method[s.method.upper()]
        else:
            if t.dtype not in _INTS:
                raise ValueError(f"{name}: a {t.dtype} tensor needs a SparseTensor")
            levels, step, method = np.asarray(s), 0.0, Method.INTEGER
        if levels.shape != t.array.shape:
            raise ValueError(f"{name}: levels of shape {levels.shape}, the base tensor has {t.array.shape}")
        if levels.dtype.kind not in "iu":
            raise ValueError(f"{name}: levels must be integers")
        flat = np.ascontiguousarray(levels.reshape(-1)).astype(np.int64)
        nz = np.flatnonzero(flat)
        if nz.size == 0:
            continue
        if method != Method.INTEGER and (not np.isfinite(step) or step <= 0):
            raise ValueError(f"{name}: step must be positive and finite, got {step}")
        lo, hi = int(flat[nz].min()), int(flat[nz].max())
        maxabs = max(-lo, hi)
        if maxabs > LEVEL_MAX:
            raise ValueError(f"{name}: levels must lie in [-(2**31 - 1), 2**31 - 1]")
        if method in (Method.STC, Method.SBC) and maxabs != 1:
            raise ValueError(f"{name}: {method.name} levels must be in {{-1, 0, 1}}")
        sign_mode = SignMode.ALL_POSITIVE if lo > 0 else SignMode.ALL_NEGATIVE if hi < 0 else SignMode.CODED
        if method == Method.SBC and sign_mode == SignMode.CODED:
            raise ValueError(f"{name}: SBC levels must all have one sign")
        if method == Method.STC:
            sign_mode = SignMode.CODED  # STC always sends signs (the receiver cannot know the side)
        if coder_code == UpdateCoder.GOLOMB and maxabs != 1:
            raise ValueError(f"{name}: the Golomb coder carries levels in {{-1, 0, 1}} only (use coder='cabac')")
        rows, cols = _rows_cols(t.array.shape)
        f = features if session is not None else features & ~_SESSION_FEATURES
        items.append((name, flat.astype(np.int32), rows, cols, int(nz.size), maxabs, int(sign_mode), f))
        entries.append(UpdateEntry(index[name], method, step, int(nz.size), maxabs, sign_mode, f, name))
        coded[name] = flat.astype(np.int32)
    if coder_code == UpdateCoder.CABAC:
        payload, ctx = _cabac_encode(items, session) if items else (b"", {})
    else:
        payload, ctx = (_golomb_encode(items) if items else b""), {}
    if table is None:
        table = session is None
    tab = [(n, flat_base[n].dtype, tuple(int(d) for d in flat_base[n].array.shape)) for n in names] if table else None
    data = _write_message(round_index=round_index, parent_round=parent_round, parent_hash=parent_hash,
                          session_id=session.session_id if session is not None else 0, session_seq=seq,
                          coder=coder_code, tensor_total=len(names), table=tab, entries=entries, payload=payload,
                          compact=compact)
    if session is not None:
        session._advance(coded, ctx)
    return data


def update_difference(new, base) -> dict[str, np.ndarray]:
    """``new - base`` per tensor: float64 for float tensors, int64 for integer tensors (others must
    be equal)."""
    fn, fb = _flat_model(new), _flat_model(base)
    if list(fn) != list(fb):
        missing = sorted(set(fb) ^ set(fn))
        raise ValueError(f"new and base hold different tensors: {missing[:5]}")
    out = {}
    for name, t in fn.items():
        b = fb[name]
        if t.dtype != b.dtype or t.array.shape != b.array.shape:
            raise ValueError(f"{name}: {t.dtype}{list(t.array.shape)} vs base {b.dtype}{list(b.array.shape)}")
        if t.dtype in _FLOATS:
            # (arithmetic on 0-d arrays gives numpy scalars: keep them arrays)
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.asarray(t.array.astype(np.float64) - b.array.astype(np.float64))
            bad = ~np.isfinite(d)
            if bad.any():
                warnings.warn(f"{name}: {int(bad.sum()):,} values of the update are NaN or infinite; they are "
                              "not sent (taken as no change)", DeepCabacWarning, stacklevel=3)
                d[bad] = 0.0
            out[name] = d
        elif t.dtype in _INTS:
            out[name] = np.asarray(t.array.astype(np.int64) - b.array.astype(np.int64))
        elif not np.array_equal(t.array, b.array):
            raise ValueError(f"{name}: {t.dtype} tensors cannot be updated (they must not change)")
    return out


def encode_update(
    new,
    base,
    *,
    density: float = 0.01,
    method: str = "stc",
    coder: str = "cabac",
    rows: float | None = None,
    value_levels: int = 7,
    feedback: ErrorFeedback | None = None,
    session: UpdateSession | None = None,
    round_index: int | None = None,
    parent_round: int | None = None,
    features: int | None = None,
    table: bool | None = None,
    compact: bool = True,
) -> bytes:
    """Sparsify ``new - base`` and code it as one update message.

    Parameters
    ----------
    new, base : mapping of str to tensor, or Checkpoint
        The model after and before the round (same names, dtypes and shapes).
    density : float
        Fraction of each tensor's elements sent, in (0, 1].
    method : {"stc", "sbc", "topk"}
        Sparse ternary (signs and one magnitude per tensor), sparse binary (one side), or the
        kept values on a uniform grid of ``value_levels`` steps.
    coder : {"cabac", "golomb"}
        Our arithmetic coder, or the STC/SBC papers' position code (ternary levels only).
    rows : float or None
        Keep only this fraction of the strongest rows (output channels) first.
    value_levels : int
        Grid size of ``"topk"``.
    feedback : ErrorFeedback or None
        Add the residual of earlier rounds before sparsifying, and store the new one.
    session : UpdateSession or None
        Continue a stream (contexts, temporal levels, history); it is advanced.
    round_index, parent_round : int or None
        The rounds of this update and of ``base``.
    features, table, compact
        As for :func:`encode_sparse`.

    Returns
    -------
    bytes
        One message. Integer tensors are sent exactly.
    """
    flat_base = _flat_model(base)
    diff = update_difference(new, flat_base)
    floats = {n: d for n, d in diff.items() if flat_base[n].dtype in _FLOATS}

    def compress(name: str, acc: np.ndarray) -> SparseTensor:
        return sparsify(acc, method, density, rows=rows, value_levels=value_levels)

    if feedback is not None:
        sent = feedback.step(floats, compress)
    else:
        sent = {n: compress(n, d) for n, d in floats.items()}
    sparse: dict[str, Any] = dict(sent)
    sparse.update({n: d for n, d in diff.items() if flat_base[n].dtype in _INTS})
    if features is None and rows is not None:
        features = DEFAULT_FEATURES | _update_kernels.F_ROWSKIP
    return _encode(sparse, flat_base, _hash_flat(flat_base), round_index=round_index, parent_round=parent_round,
                   session=session, coder=coder, features=features, table=table, compact=compact)


# --------------------------------------------------------------------------------------------------
# decode and apply
# --------------------------------------------------------------------------------------------------


@dataclass
class Update:
    """A decoded update message: the header and the levels and step of every coded tensor."""

    header: UpdateHeader
    tensors: dict[str, SparseTensor | np.ndarray] = field(default_factory=dict)

    def delta(self) -> dict[str, np.ndarray]:
        """The dense update per coded tensor (float32 for float tensors, int64 differences otherwise)."""
        return {n: (t.values() if isinstance(t, SparseTensor) else t.astype(np.int64)) for n, t in self.tensors.items()}


def _shapes(header: UpdateHeader, flat_base: dict[str, _Tensor] | None) -> list[tuple[str, str, tuple[int, ...]]]:
    base_table = None
    if flat_base is not None:
        base_table = [(n, t.dtype, tuple(int(d) for d in t.array.shape)) for n, t in flat_base.items()]
        if len(base_table) != header.tensor_total:
            raise UpdateMismatchError(f"the update is for a model of {header.tensor_total} tensors, the base has "
                                      f"{len(base_table)}")
        if header.table is not None and header.table != base_table:
            raise UpdateMismatchError("the update's tensor table does not match the base model")
        return base_table
    if header.table is None:
        raise ValueError("this update lists no tensor table: pass the base model to decode it")
    return header.table


# Without the base model, the shapes come from the message's own tensor table, and a sparse update
# of a huge tensor is legitimately tiny: the payload cannot bound the allocation, so a limit does.
DEFAULT_MAX_ELEMENTS = 1 << 28  # 1 GiB of int32 levels


def checked_payload(data, header: UpdateHeader) -> memoryview:
    """The payload of the message at the start of ``data`` (whose header is ``header``), after
    checking its CRC: this and :func:`read_update_header` verify a message without decoding it."""
    view = memoryview(data)  # read_update_header has checked that it holds the whole message
    end = header.header_size + header.payload_size
    (crc,) = struct.unpack("<I", bytes(view[end:header.total_size]))
    if crc32(view[header.header_size:end]) != crc:
        raise CorruptStreamError("update payload checksum mismatch (the update is damaged)")
    return view[header.header_size:end]


def decode_update(data, base=None, *, session: UpdateSession | None = None, check_parent: bool = True,
                  max_elements: int = DEFAULT_MAX_ELEMENTS) -> Update:
    """Decode one update message (the first in ``data``) without applying it.

    Parameters
    ----------
    data : bytes-like
        The message.
    base : mapping of str to tensor, Checkpoint or None
        The parent model: it supplies names and shapes when the message has no tensor table, and
        is checked against the message's parent hash (``UpdateMismatchError`` if it differs).
    session : UpdateSession or None
        A message that continues a session needs it, at the message's position; it is advanced.
    check_parent : bool
        Check ``base`` against the parent hash.
    max_elements : int
        Without ``base``, the tensors the message codes may hold at most this many elements in
        all (their shapes come from the message itself).

    Returns
    -------
    Update
        The header and every coded tensor's levels and step.
    """
    header = read_update_header(data)
    flat_base = _flat_model(base) if base is not None else None
    if flat_base is None and header.table is not None:
        claimed = 0
        for e in header.entries:
            if 0 <= e.index < len(header.table):
                rows, cols = _rows_cols(header.table[e.index][2])
                claimed += rows * cols
        if claimed > max_elements:
            raise LimitExceededError(
                f"the update's own tensor table claims {claimed:,} elements, more than max_elements="
                f"{max_elements:,}: pass the base model (or a larger max_elements) to decode it")
    if flat_base is not None and check_parent:
        h = _hash_flat(flat_base)
        if not header.parent_matches(h):
            raise UpdateMismatchError(
                f"wrong parent: the update (round {header.round}) applies to the model of round {header.parent_round} "
                f"with SHA-256 {header.parent_hash.hex()[:16]}..., the base given hashes to {h.hex()[:16]}...")
    return _decode(data, header, flat_base, session)


def _decode(data, header: UpdateHeader, flat_base, session: UpdateSession | None) -> Update:
    if header.session_id == 0:
        if header.session_seq != 0:
            raise CorruptStreamError("a message without a session has a session position")
        if any(e.features & _SESSION_FEATURES for e in header.entries):
            raise CorruptStreamError("a message without a session uses temporal or history contexts")
        if session is not None:
            raise UpdateMismatchError("this update was coded without a session; decode it without one")
    else:
        if session is None:
            raise UpdateMismatchError(f"this update continues session {header.session_id} at message "
                                      f"{header.session_seq}: decode it with that session")
        if session.session_id != header.session_id or session.seq != header.session_seq:
            raise UpdateMismatchError(
                f"this update continues session {header.session_id} at message {header.session_seq}; the session "
                f"given is {session.session_id} at message {session.seq} (were messages skipped or reordered?)")
    shapes = _shapes(header, flat_base)
    payload = checked_payload(data, header)
    items = []
    for j, e in enumerate(header.entries):
        name, dtype, shape = shapes[e.index]
        e.name = name
        _check_method_dtype(e.method, dtype, f"update entry {j} ({name!r})")
        rows, cols = _rows_cols(shape)
        if e.nnz > rows * cols:
            raise CorruptStreamError(f"update entry {j} ({name!r}): {e.nnz} nonzeros in {rows * cols} elements")
        items.append((name, None, rows, cols, e.nnz, e.maxabs, int(e.sign_mode), e.features))
    tinfo, _, parent, hist, ctx = _tinfo_and_arrays(items, session)
    out = np.zeros(int(sum(r * c for _, _, r, c, *_ in items)), dtype=np.int32)
    buf = np.frombuffer(payload, dtype=np.uint8)
    if header.coder == UpdateCoder.CABAC:
        if items:
            status = _update_kernels.decode_update_kernel(buf, tinfo, parent, hist, ctx, out)
            if status != _update_kernels.OK:
                raise CorruptStreamError(f"update payload is corrupt (decoder status {status}: "
                                         f"{_STATUS.get(status, 'inconsistent data')})")
        elif buf.size:
            raise CorruptStreamError("an update with no tensors has a payload")
    else:
        pos = 0
        for t, (name, _, rows, cols, nnz, _maxabs, sign_mode, _f) in enumerate(items):
            off = int(tinfo[t, 0])
            side = -1 if sign_mode == SignMode.ALL_NEGATIVE else 1
            try:
                pos = golomb.decode_tensor(buf, pos, nnz, out[off:off + rows * cols],
                                           signs=sign_mode == SignMode.CODED, side=side)
            except CorruptStreamError as exc:
                raise CorruptStreamError(f"update tensor {name!r}: {exc}") from None
        if (pos + 7) // 8 != buf.size:
            raise CorruptStreamError("the Golomb payload does not end where its positions end")
    result = Update(header)
    coded, ctx_by_name = {}, {}
    for t, (e, item) in enumerate(zip(header.entries, items)):
        name, _, rows, cols = item[:4]
        _, dtype, shape = shapes[e.index]
        off = int(tinfo[t, 0])
        levels = out[off:off + rows * cols]
        if e.sign_mode != SignMode.CODED:
            nzv = levels[levels != 0]
            if (e.sign_mode == SignMode.ALL_POSITIVE and (nzv < 0).any()) or \
                    (e.sign_mode == SignMode.ALL_NEGATIVE and (nzv > 0).any()):
                raise CorruptStreamError(f"update tensor {name!r}: a level has the wrong sign")
        coded[name] = levels
        ctx_by_name[name] = ctx[t * _update_kernels.N_CTX_U:(t + 1) * _update_kernels.N_CTX_U].copy()
        arr = levels.reshape(shape).copy()
        if e.method == Method.INTEGER:
            result.tensors[name] = arr
        else:
            result.tensors[name] = SparseTensor(arr, e.step, e.method.name.lower())
    if session is not None:
        session._advance(coded, ctx_by_name)
    return result


_STATUS = {
    _update_kernels.ERR_BAD_START: "bad start", _update_kernels.ERR_BAD_ESCAPE: "escape code too long",
    _update_kernels.ERR_BAD_VALUE: "level out of range", _update_kernels.ERR_BAD_TERMINATE: "bad terminate bin",
    _update_kernels.ERR_OVERRUN: "truncated", _update_kernels.ERR_BAD_BYPASS: "bypass out of range",
    _update_kernels.ERR_BAD_COUNT: "fewer nonzeros than the header says",
}


def apply_delta(base, update: Update) -> dict[str, Any]:
    """``base`` plus the update's values, tensor by tensor (same types and dtypes as ``base``).

    Float tensors: ``base + levels * step`` with the product in float32 and the sum in the base's
    dtype (float16 sums in float32). Integer tensors: the exact sum (refused if it overflows).
    """
    from ..io.checkpoint import numpy_to_tensor

    flat = _flat_model(base)
    out = {}
    for name, t in flat.items():
        u = update.tensors.get(name)
        arr = t.array
        if u is not None:
            if isinstance(u, SparseTensor):
                rec = reconstruct(u.levels, u.step)
                if t.dtype == "float16":
                    arr = (arr.astype(np.float32) + rec).astype(np.float16)
                else:
                    arr = arr + rec.astype(arr.dtype)
            else:
                wide = arr.astype(np.int64) + u.astype(np.int64)
                info = np.iinfo(arr.dtype)
                if wide.size and (wide.min() < info.min or wide.max() > info.max):
                    raise CorruptStreamError(f"tensor {name!r}: the update overflows its {t.dtype} values")
                arr = wide.astype(arr.dtype)
        else:
            arr = arr.copy()
        # (np.ascontiguousarray would turn a 0-d tensor, e.g. a step counter, into a 1-d one)
        out[name] = numpy_to_tensor(np.require(arr, requirements="C"), t.dtype, t.is_torch)
    return out


def apply_update(base, data, *, session: UpdateSession | None = None) -> dict[str, Any]:
    """The new model: the update message ``data`` applied to ``base``.

    Parameters
    ----------
    base : mapping of str to tensor, or Checkpoint
        The parent model.
    data : bytes-like
        One message (the first in ``data``).
    session : UpdateSession or None
        The receiver's session, for a message that continues one; it is advanced.

    Returns
    -------
    dict of str to tensor
        Flat, in ``base``'s tensor types and dtypes.

    Raises
    ------
    UpdateMismatchError
        ``base`` is not the message's parent (its SHA-256 differs), or ``session`` is not at the
        message's position.
    """
    upd = decode_update(data, base, session=session)
    return apply_delta(base, upd)


# --------------------------------------------------------------------------------------------------
# streams of messages
# --------------------------------------------------------------------------------------------------


class UpdateStreamWriter:
    """Append update messages to a binary file object (a stream of rounds is the messages in order)."""

    def __init__(self, f):
        self.f = f
        self.count = 0
        self.bytes = 0

    def write(self, message: bytes) -> None:
        read_update_header(message)  # refuse anything that is not one whole message
        self.f.write(message)
        self.count += 1
        self.bytes += len(message)


def read_message(f) -> bytes | None:
    """Read one whole message from a binary file object; ``None`` at a clean end of file."""
    pre = f.read(PREAMBLE.size)
    if not pre:
        return None
    if len(pre) < PREAMBLE.size:
        pre += read_exactly(f, PREAMBLE.size - len(pre), "update message preamble")
    _, _, header_size = _check_preamble(pre)
    head = pre + read_exactly(f, header_size, "update message header")
    header = read_update_header(head, total_size=1 << 62)
    # (read in pieces: a header may declare far more payload than the input holds)
    return head + read_exactly(f, header.total_size - len(head), "update message")


def iter_messages(source) -> Iterator[bytes]:
    """The messages of a stream: ``source`` is bytes-like or a binary file object."""
    if hasattr(source, "read"):
        while True:
            m = read_message(source)
            if m is None:
                return
            yield m
    else:
        view = memoryview(source)
        pos = 0
        while pos < len(view):
            header = read_update_header(view[pos:])
            yield bytes(view[pos:pos + header.total_size])
            pos += header.total_size
