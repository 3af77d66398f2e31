"""The model stream container: one description of the byte layout, used by writer and reader.

Layout (little-endian; ``docs/format.md`` is the normative description):

    magic(8) version:u16 flags:u16 header_size:u32
    header body:  settings, metadata JSON, tensor table
    header_crc:u32                      (CRC-32 of every byte before it)
    payload:      the tensors' substreams, in table order

The header parses without touching the payload. Every length is checked against the bytes that
are really there before anything is allocated from it.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..entropy import floatcoder
from ..entropy.chunk_layout import (
    LINEAR_BIT,
    MAX_K_OFFSET,
    NO_COLUMNS_BIT,
    PREDICT_BIT,
    SWITCH_BITS,
    layout_from_stream,
    row_length,
)
from ..entropy.levelcoder import max_elements_for_payload
from ..entropy.linear_prediction import MAX_COLUMNS, MIN_COLUMNS
from ..errors import CheckpointError, CorruptStreamError, FormatError, LimitExceededError, TruncatedStreamError
from ..io.checksum import crc32
from ..io.dtypes import DType
from ..io.inputs import read_exactly, unreadable
from ..io.kinds import HEAD_BYTES, STREAM_MAGIC, what_it_is
from ..io.shapes import MAX_NDIM, shape_problem
from ..quant.log_domain import LOG_DTYPES
from ..quant.steps import QP_DENSITY_MAX, QP_MAX, QP_MIN, step_from_qp

MAGIC = STREAM_MAGIC
# Version 2 added Mode.DEPENDENT, version 3 the linear prediction across columns (LINEAR_BIT) and
# the choice to switch the column model off (NO_COLUMNS_BIT), version 4 Mode.LOG. A writer stamps
# the lowest version that describes its stream, so streams without them stay readable by older
# readers; version 5 Mode.FLOAT (lossless float coding), version 6 Mode.MAGNITUDE, version 7 FLOAT
# substreams with the trailing zeros by exponent, version 8 FLOAT substreams with their symbols by
# tANS, version 9 float32 FLOAT substreams with their trailing zeros in the symbol (low-bit mode 3;
# each said by a bit of the entry's coder parameter), version 10 16-bit FLOAT substreams with 64
# rANS states (low-bit mode 4), version 11 float32 ones, version 12 float32 ones with their trailing
# zeros in the symbol (low-bit mode 5), version 13 float32 ones of bfloat16 values coded as their
# upper halves (low-bit mode 6), and metadata JSON of more than 2^23 bytes (up to 2^26: a
# directory's files kept as their bytes, a tokenizer's among them). This reader reads all thirteen.
FORMAT_VERSION = 13
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
REVISION_VERSIONS = ((floatcoder.HALVES_REVISION, 13), (floatcoder.TZ_WIDE_REVISION, 12),
                     (floatcoder.WIDE32_REVISION, 11),
                     (floatcoder.WIDE_REVISION, 10), (floatcoder.TZ_REVISION, 9),
                     (floatcoder.TANS_REVISION, 8), (floatcoder.TRAILING_REVISION, 7))  # FLOAT coder parameter bits
SWITCHES_VERSION = 3  # LINEAR_BIT and NO_COLUMNS_BIT
PREAMBLE = struct.Struct("<8sHHI")
HEADER_DEFLATE_LEVEL = 6  # (any level inflates; the writer's is fixed, for the same bytes from the same input)
MAX_HEADER_SIZE = 1 << 28  # (more than the limits below let a header need)
# What a header may hold (docs/format.md §6.5): the writer refuses more, the reader stops at the
# first part that exceeds its share, before inflating or parsing what the header merely declares.
MAX_TENSORS = 1 << 18
MAX_NAME_BYTES = 1 << 24  # all tensor names together (one name: 65,535 bytes)
MAX_METADATA_BYTES = 1 << 26
# Before format version 13 a stream held at most this much metadata JSON: a writer stamps version 13
# on a stream with more, and a reader refuses more in a stream of an earlier version. (A Trainer's
# checkpoint-N/ keeps its tokenizer's files, 7-9 MB of tokenizer.json for today's LLMs, a third
# more as base64: 2^23 refused them.)
OLD_METADATA_BYTES = 1 << 23
LARGE_METADATA_VERSION = 13
MAX_METADATA_CONTAINERS_BASE = 1 << 16  # JSON objects and arrays: this many plus 8 per tensor
MAX_CHUNKS = 1 << 22  # substreams of all tensors together (4 T elements in chunks of 1 Mi)
_ENTRY_MIN = 47  # bytes of an entry with a 0-byte name, no dimension and no chunk
NO_ALIAS = 0xFFFFFFFF
MIN_CHUNK_ELEMENTS = 1 << 16  # level-coded chunks hold at least this many elements (or the tensor)
LOG_OFFSET_BYTES = 8  # Mode.LOG: the first substream is the tensor's offset, an int64 (little-endian)


class Mode(enum.IntEnum):
    """How a tensor's payload is coded; frozen codes."""

    RAW = 0  # the little-endian bytes of the elements, unchanged
    UNIFORM = 1  # levels (level coder) times the step of (qp, qp_density)
    INTEGER = 2  # the integer values themselves through the level coder: lossless
    DEPENDENT = 3  # transmitted levels of the 4-state trellis (format version 2); see docs/format.md
    LOG = 4  # levels of log2|value| in steps of qp's step, in octaves (format version 4; quant.log_domain)
    FLOAT = 5  # the float bits themselves, losslessly (format version 5; entropy.floatcoder)
    MAGNITUDE = 6  # signed integers by magnitude class, losslessly (format version 6; entropy.floatcoder)

    # (each looked up in a set or dict of members made once: the header parser and the decoder ask
    # them per tensor)
    @property
    def is_quantized(self) -> bool:
        """Values are levels times the step (uniform or through the trellis's state machine)."""
        return self in _QUANTIZED

    @property
    def has_step(self) -> bool:
        return self in _WITH_STEP

    @property
    def is_class_coded(self) -> bool:
        """Coded by classes and rANS (entropy.floatcoder): the exact values, not levels."""
        return self in _CLASS_CODED

    @property
    def min_version(self) -> int:
        return _MODE_VERSIONS.get(self, 1)


_QUANTIZED = frozenset((Mode.UNIFORM, Mode.DEPENDENT))
_WITH_STEP = _QUANTIZED | {Mode.LOG}
_CLASS_CODED = frozenset((Mode.FLOAT, Mode.MAGNITUDE))
_RAW, _LOG = Mode.RAW, Mode.LOG  # (an enum member looked up on its class costs 0.1 us, per entry of a header)
_MODE_VERSIONS = {Mode.DEPENDENT: 2, Mode.LOG: 4, Mode.FLOAT: 5, Mode.MAGNITUDE: 6}


class Coder(enum.IntEnum):
    """Which level coder produced the substreams; frozen codes."""

    NONE = 0  # RAW payloads
    ADAPTIVE_SCALE = 1  # levelcoder / _cabac_kernels, format version 1
    FLOAT_CLASSES = 2  # floatcoder / _float_kernels (Mode.FLOAT, Mode.MAGNITUDE), format version 5


FLAG_TORCH = 1  # the tensor was a torch.Tensor (decode returns one)
FLAG_ALIAS = 2  # the tensor shares storage with the tensor named by ``alias_of``
_KNOWN_FLAGS = FLAG_TORCH | FLAG_ALIAS


@dataclass
class TensorEntry:
    """One row of the tensor table."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    mode: Mode
    coder: Coder = Coder.NONE
    flags: int = 0
    qp: int = 0
    qp_density: int = 0
    alias_of: int = NO_ALIAS
    coder_param: int = 0  # the level coder's k offset | its switches (chunk_layout.ChunkLayout.coder_param)
    chunk_elements: int = 0
    chunk_sizes: list[int] = field(default_factory=list)
    offset: int = 0  # payload offset, relative to the first payload byte
    size: int = 0
    crc32: int = 0
    # (the shape's product, asked for many times per entry; an entry's shape is never reassigned:
    # dataclasses.replace makes a new one. Not a cached_property: before Python 3.12 its first read
    # takes a lock, which cost more than the product)
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.numel = math.prod(self.shape)

    @property
    def is_alias(self) -> bool:
        return bool(self.flags & FLAG_ALIAS)

    @property
    def even_chunk_count(self) -> int:
        """Chunks of a RAW or class-coded entry: ``chunk_elements`` each, the last one shorter."""
        return -(-self.numel // self.chunk_elements)

    def even_chunk_bounds(self, k: int) -> tuple[int, int]:
        """Flat element range of chunk ``k`` of a RAW or class-coded entry."""
        start = k * self.chunk_elements
        return start, min(self.numel, start + self.chunk_elements)

    @property
    def is_linear(self) -> bool:
        """The first substream is a linear predictor, the others code its residuals."""
        # (a FLOAT entry's coder parameter says which low-bit modes its substreams use: its bit 5 is
        # mode 5's, not this)
        return bool(self.coder_param & LINEAR_BIT) and not self.is_alias and not self.mode.is_class_coded

    @property
    def codes_halves(self) -> bool:
        """A FLOAT entry whose float32 substreams may hold bfloat16 values as their upper halves
        (low-bit mode 6)."""
        return self.mode == Mode.FLOAT and bool(self.coder_param & floatcoder.HALVES_REVISION)

    @property
    def codes_trailing_zeros(self) -> bool:
        """A FLOAT entry whose substreams may code their trailing zeros (low-bit modes 2, 3 and 5)."""
        return self.mode == Mode.FLOAT and bool(self.coder_param & (floatcoder.TRAILING_REVISION
                                                                    | floatcoder.TZ_REVISION
                                                                    | floatcoder.TZ_WIDE_REVISION))

    @property
    def min_version(self) -> int:
        return _min_version(self.mode, self.coder_param, self.is_alias)

    @property
    def step(self) -> float | None:
        """The (fine) quantization step of a quantized tensor (in octaves for Mode.LOG), else None."""
        if not self.mode.has_step:
            return None
        return step_from_qp(self.qp, self.qp_density)


@functools.lru_cache(maxsize=256)
def _min_version(mode: Mode, coder_param: int, is_alias: bool) -> int:
    """The format version an entry of this mode and coder parameter needs (few pairs: cached, as the
    header parser asks for each entry)."""
    if mode.is_class_coded:
        return max([mode.min_version] + [v for bit, v in REVISION_VERSIONS if coder_param & bit])
    new = coder_param & (LINEAR_BIT | NO_COLUMNS_BIT) and not is_alias
    return max(mode.min_version, SWITCHES_VERSION if new else 1)


@dataclass
class StreamHeader:
    """What :func:`read_header` returns: everything but the payload."""

    version: int
    qp: int
    qp_1d: int
    qp_density: int
    metadata: dict
    tensors: list[TensorEntry]
    header_size: int  # bytes before the payload
    payload_size: int

    @property
    def total_size(self) -> int:
        return self.header_size + self.payload_size


_SETTINGS = struct.Struct("<IhhBB")  # tensor_count, qp, qp_1d, qp_density, reserved
_ENTRY_FIXED = struct.Struct("<BBBBB")  # dtype, mode, coder, flags, ndim
_ENTRY_QUANT = struct.Struct("<hBBIQI")  # qp, qp_density, coder_param, alias_of, chunk_elements, chunk_count
_ENTRY_TAIL = struct.Struct("<QQI")  # offset, size, crc32
_NAME_LENGTH = struct.Struct("<H")
# an entry's shape of each dimension count, and its coding parameters after it
_SHAPE_AND_CODING = [struct.Struct(f"<{ndim}Q" + _ENTRY_QUANT.format[1:]) for ndim in range(MAX_NDIM + 1)]


@functools.lru_cache(maxsize=1024)
def _entry_struct(name_bytes: int, ndim: int, chunks: int) -> struct.Struct:
    """A whole table entry's layout (docs/format.md §1.2): the fields above, the name's bytes, the
    shape and the chunk sizes; one pack per entry (a model has hundreds)."""
    return struct.Struct(f"<H{name_bytes}s" + _ENTRY_FIXED.format[1:] + f"{ndim}Q" + _ENTRY_QUANT.format[1:]
                         + f"{chunks}I" + _ENTRY_TAIL.format[1:])


# (by value: a dict lookup, where calling the enum costs a microsecond per field and entry)
_DTYPES: dict[int, DType] = {m.value: m for m in DType}
_MODES: dict[int, Mode] = {m.value: m for m in Mode}
_CODERS: dict[int, Coder] = {m.value: m for m in Coder}


def metadata_bytes(metadata: dict, tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The metadata JSON as the header stores it, once a header is known to hold these ``(name,
    shape)`` tensors and this metadata (docs/format.md §6.5); CheckpointError says what exceeds
    which limit. The encoder calls it before any coding, so nothing is coded for a model the
    stream cannot hold."""
    if len(tensors) > MAX_TENSORS:
        raise CheckpointError(f"{len(tensors):,} tensors: a stream holds at most {MAX_TENSORS:,}")
    total = 0
    for name, shape in tensors:
        size = len(name.encode("utf-8"))
        total += size
        if size > 0xFFFF:
            raise CheckpointError(f"tensor name of {size:,} bytes (a stream holds names of up to 65,535): "
                                  f"{name[:40]}...")
        problem = shape_problem(shape)
        if problem is not None:
            raise CheckpointError(f"tensor {name[:80]!r}: {problem}")
    if total > MAX_NAME_BYTES:
        raise CheckpointError(f"tensor names of {total:,} bytes in all (a stream holds {MAX_NAME_BYTES:,})")
    meta = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    if len(meta) > MAX_METADATA_BYTES:
        raise CheckpointError(f"the checkpoint's structure and non-tensor values take {len(meta):,} bytes of "
                              f"JSON (a stream holds {MAX_METADATA_BYTES:,})")
    containers = meta.count(b"{") + meta.count(b"[")
    if containers > MAX_METADATA_CONTAINERS_BASE + 8 * len(tensors):
        raise CheckpointError(f"the checkpoint's structure has {containers:,} containers (a stream of "
                              f"{len(tensors)} tensors holds {MAX_METADATA_CONTAINERS_BASE + 8 * len(tensors):,})")
    return meta


def write_header(qp: int, qp_1d: int, qp_density: int, metadata_json: bytes, tensors: list[TensorEntry]) -> bytes:
    """Serialize the header; ``tensors`` must carry final offsets, sizes and checksums, and
    ``metadata_json`` is what :func:`metadata_bytes` gave for the metadata and these tensors' names
    and shapes. Refuses (CheckpointError) what the format's limits do not hold."""
    chunks = sum(len(t.chunk_sizes) for t in tensors)
    if chunks > MAX_CHUNKS:
        raise CheckpointError(f"{chunks:,} substreams: a stream holds at most {MAX_CHUNKS:,}")
    return pack_header(qp, qp_1d, qp_density, metadata_json, tensors)


def pack_header(qp: int, qp_1d: int, qp_density: int, meta: Any, tensors: list[TensorEntry]) -> bytes:
    """The header's bytes as they are, limits unchecked (``meta``: the metadata JSON as bytes, or any
    value to dump as JSON): what :func:`write_header` writes, and what tests of hostile headers
    build with."""
    if not isinstance(meta, bytes):
        meta = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    body = [_SETTINGS.pack(len(tensors), qp, qp_1d, qp_density, 0), struct.pack("<I", len(meta)), meta]
    for t in tensors:
        name = t.name.encode("utf-8")
        body.append(_entry_struct(len(name), len(t.shape), len(t.chunk_sizes)).pack(
            len(name), name, t.dtype, t.mode, t.coder, t.flags, len(t.shape), *t.shape,
            t.qp, t.qp_density, t.coder_param, t.alias_of, t.chunk_elements, len(t.chunk_sizes), *t.chunk_sizes,
            t.offset, t.size, t.crc32))
    raw = b"".join(body)
    # The body is deflated: names and the skeleton repeat themselves, and for small models the
    # header would otherwise be a large share of the stream. Level 6, not 9: a tenth of the time
    # (0.4 against 3.2 ms for EfficientNet-Lite0's 22 KB) for 0.5% more header bytes.
    packed = struct.pack("<I", len(raw)) + zlib.compress(raw, HEADER_DEFLATE_LEVEL)
    version = max([1 if len(meta) <= OLD_METADATA_BYTES else LARGE_METADATA_VERSION]
                  + [t.min_version for t in tensors])
    head = PREAMBLE.pack(MAGIC, version, 0, len(packed) + 4) + packed
    return head + struct.pack("<I", crc32(head))


def check_preamble(data, *, magic: bytes, versions: tuple[int, ...], known_flags: int, kind: str, noun: str,
                   label: str, max_header_size: int = MAX_HEADER_SIZE) -> tuple[int, int, int]:
    """Check the 16-byte preamble shared by the model and update formats (magic, version, flags,
    header size); return (version, flags, header_size). ``kind``, ``noun`` and ``label`` word the
    errors."""
    if len(data) == 0:
        raise TruncatedStreamError(f"not a deepcabac {kind} stream: it is an empty file")
    if len(data) < PREAMBLE.size:
        if bytes(data[: len(magic)]) != magic[: len(data)]:
            raise FormatError(f"not a deepcabac {kind} stream: it is {what_it_is(bytes(data[:HEAD_BYTES]))}")
        raise TruncatedStreamError(f"{noun} is {len(data)} bytes, shorter than the {PREAMBLE.size}-byte preamble")
    found, found_version, flags, header_size = PREAMBLE.unpack(bytes(data[: PREAMBLE.size]))
    if found != magic:
        raise FormatError(f"not a deepcabac {kind} stream: it is {_other_kind(bytes(data[:HEAD_BYTES]))}")
    if found_version not in versions:
        readable = " and ".join(map(str, versions))
        raise FormatError(f"unsupported {label}format version {found_version} (this library reads version {readable})")
    if flags & ~known_flags:
        raise FormatError(f"unknown {label}header flags 0x{flags:04x}")
    if not 4 <= header_size <= max_header_size:
        raise CorruptStreamError(f"implausible {label}header size {header_size}")
    return found_version, flags, header_size


def _other_kind(head: bytes) -> str:
    what = what_it_is(head)
    if what in ("a safetensors file", "a zip archive", "a pickle"):  # (a checkpoint, most likely)
        return f"{what} (a checkpoint? encode it with `deepcabac encode`)"
    return what


def is_model_stream(head: bytes) -> bool:
    """Whether bytes that begin a file are those of a model stream (its magic's first four bytes)."""
    return bytes(head[:4]) == MAGIC[:4]


def read_preamble(data) -> tuple[int, int]:
    """Check magic and version; return (version, header_size including the CRC)."""
    version, _, header_size = check_preamble(data, magic=MAGIC, versions=READABLE_VERSIONS, known_flags=0,
                                             kind="model", noun="stream", label="")
    return version, header_size


def read_header(data, *, total_size: int | None = None, payload_known: bool = True) -> StreamHeader:
    """Parse and validate the header of a stream (``data`` may hold just the header).

    ``total_size`` is the length of the whole stream when ``data`` holds only its beginning. Without
    ``payload_known`` (a stream read from a pipe: its length is what the header says) the tensor
    table is not checked against the payload's length.
    """
    version, header_size = read_preamble(data)
    end = PREAMBLE.size + header_size
    if len(data) < end:
        raise TruncatedStreamError(f"stream ends inside its header ({len(data)} of {end} bytes)")
    stored_crc = struct.unpack("<I", bytes(data[end - 4:end]))[0]
    if crc32(bytes(data[: end - 4])) != stored_crc:
        raise CorruptStreamError("header checksum mismatch: the header is damaged")
    total = len(data) if total_size is None else total_size
    payload_size = total - end

    r = _BodyReader(data, end)
    count, qp, qp_1d, qp_density, reserved = r.unpack(_SETTINGS, "settings")
    if reserved:
        raise FormatError(f"unknown settings byte 0x{reserved:02x}")
    _check_qp_pair(qp, qp_density, "model qp")
    _check_qp_pair(qp_1d, qp_density, "model qp_1d")
    if count > MAX_TENSORS or count > r.remaining // _ENTRY_MIN:
        raise CorruptStreamError(f"tensor count {count} does not fit in a {header_size}-byte header")
    # What a header of ``count`` tensors can need at most: refuse a larger declared body before
    # inflating it (every chunk of a tensor holds at least one payload byte or element).
    chunks_bound = min(max(payload_size, 0), MAX_CHUNKS) if payload_known else MAX_CHUNKS
    meta_limit = MAX_METADATA_BYTES if version >= LARGE_METADATA_VERSION else OLD_METADATA_BYTES
    need = (_SETTINGS.size + 4 + meta_limit + MAX_NAME_BYTES
            + count * (_ENTRY_MIN + 8 * MAX_NDIM) + 4 * (chunks_bound + 2 * count))
    if r.raw_size > need:
        raise CorruptStreamError(f"a header body of {r.raw_size:,} bytes is more than {count} tensors can need")
    (meta_len,) = r.unpack(struct.Struct("<I"), "metadata size")
    if meta_len > meta_limit:
        raise CorruptStreamError(f"metadata of {meta_len:,} bytes is more than a header of format version {version} "
                                 f"holds ({meta_limit:,})")
    metadata = parse_metadata(r.take(meta_len, "metadata"), count)
    if count > r.remaining // _ENTRY_MIN:
        raise CorruptStreamError(f"tensor count {count} does not fit in a {header_size}-byte header")
    tensors: list[TensorEntry] = []
    names: set[str] = set()
    next_offset = name_bytes = chunks = 0
    layouts: dict[tuple, tuple[int, int, int]] = {}
    # The entries' fields are read in place from the rest of the body, inflated at once (the
    # bound above holds its size): a take per field cost about as much as the rest of an entry.
    body, first = r.rest()
    at = first
    declared = first + r.remaining  # (the declared end; the inflated one may come before it)
    got = min(len(body), declared)
    for i in range(count):
        if at + 2 > got:
            r.missing(at - first, 2, "name length")
        (name_len,) = _NAME_LENGTH.unpack_from(body, at)
        at += 2
        name_bytes += name_len
        if name_bytes > MAX_NAME_BYTES:
            raise CorruptStreamError(f"tensor names of more than {MAX_NAME_BYTES:,} bytes in all")
        if at + name_len + _ENTRY_FIXED.size > got:
            r.missing(at - first, name_len + _ENTRY_FIXED.size, (name_len, "name", "tensor type"))
        try:
            name = body[at:at + name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptStreamError(f"tensor {i}: name is not UTF-8") from None
        dtype, mode, coder, flags, ndim = _ENTRY_FIXED.unpack_from(body, at + name_len)
        at += name_len + _ENTRY_FIXED.size
        where = f"tensor {i} ({name!r})"
        if name in names:
            raise CorruptStreamError(f"{where}: a second tensor of the same name")
        names.add(name)
        try:
            dtype, mode, coder = _DTYPES[dtype], _MODES[mode], _CODERS[coder]
        except KeyError:
            kinds = ((dtype, DType, _DTYPES), (mode, Mode, _MODES), (coder, Coder, _CODERS))
            value, kind = next((v, k) for v, k, by_value in kinds if v not in by_value)
            raise FormatError(f"{where}: {value} is not a valid {kind.__name__}") from None
        if flags & ~_KNOWN_FLAGS:
            raise FormatError(f"{where}: unknown flags 0x{flags:02x}")
        if ndim > MAX_NDIM:
            raise CorruptStreamError(f"{where}: {ndim} dimensions")
        shaped = _SHAPE_AND_CODING[ndim]
        if at + shaped.size > got:
            r.missing(at - first, shaped.size, (8 * ndim, "shape", "coding parameters"))
        *shape, t_qp, t_density, coder_param, alias_of, chunk_elements, chunk_count = shaped.unpack_from(body, at)
        at += shaped.size
        chunks += chunk_count
        if chunk_count > (declared - at) // 4 or chunks > MAX_CHUNKS:
            raise CorruptStreamError(f"{where}: chunk count {chunk_count} does not fit in the header")
        sizes = 4 * chunk_count
        if at + sizes + _ENTRY_TAIL.size > got:
            r.missing(at - first, sizes + _ENTRY_TAIL.size, (sizes, "chunk sizes", "payload location"))
        chunk_sizes = list(struct.unpack_from(f"<{chunk_count}I", body, at))
        offset, size, crc = _ENTRY_TAIL.unpack_from(body, at + sizes)
        at += sizes + _ENTRY_TAIL.size
        entry = TensorEntry(name, dtype, tuple(shape), mode, coder, flags, t_qp, t_density, alias_of,
                            coder_param, chunk_elements, chunk_sizes, offset, size, crc)
        if entry.min_version > version:
            if mode.min_version > version:
                what = "coding mode " + mode.name
            elif mode.is_class_coded:
                what = f"coder parameter {coder_param} (the substreams' low-bit modes)"
            else:
                what = "linear prediction" if entry.is_linear else "switching the column model off"
            raise CorruptStreamError(f"{where}: {what} needs format version {entry.min_version}, "
                                     f"the stream says {version}")
        _validate_entry(entry, i, where, tensors, next_offset, layouts)
        next_offset += entry.size
        tensors.append(entry)
    r.skip(at - first)
    r.finish()
    if payload_known and next_offset != payload_size:
        if next_offset > payload_size:
            raise TruncatedStreamError(f"truncated stream: the payload has {payload_size} bytes but the tensor "
                                       f"table needs {next_offset}")
        raise CorruptStreamError(f"{payload_size - next_offset} unexplained bytes after the last tensor")
    return StreamHeader(version, qp, qp_1d, qp_density, metadata, tensors, end, next_offset)


_SIZE_MISMATCH = "header body size does not match its declared size"


def _past_end(what: str | tuple[int, str, str], left: int) -> CorruptStreamError:
    """The error of field ``what`` (or fields ``(size of the first, its name, the next one's
    name)`` read together) where only ``left`` bytes of the declared body remain."""
    if not isinstance(what, str):
        first, first_name, next_name = what
        what = first_name if left < first else next_name
    return CorruptStreamError(f"header field '{what}' runs past the end of the header")


class _BodyReader:
    """The header body, inflated as it is read: a hostile header is refused at its first
    inconsistency, never after inflating (or allocating) what it merely declares."""

    def __init__(self, data, end: int):
        if end - 4 < PREAMBLE.size + 4:
            raise CorruptStreamError("header too short for its body")
        (self.raw_size,) = struct.unpack("<I", bytes(data[PREAMBLE.size:PREAMBLE.size + 4]))
        if self.raw_size > MAX_HEADER_SIZE:
            raise CorruptStreamError(f"implausible header body size {self.raw_size}")
        self._inflater = zlib.decompressobj()
        self._input = bytes(data[PREAMBLE.size + 4:end - 4])
        self._buf = b""
        self._pos = 0
        self.consumed = 0
        self._failure: CorruptStreamError | None = None  # (why rest() gave less than declared)

    @property
    def remaining(self) -> int:
        """Bytes of the declared body not read yet."""
        return self.raw_size - self.consumed

    def take(self, n: int, what: str | tuple[int, str, str]) -> bytes:
        """The next ``n`` bytes of the body: field ``what``, or fields ``(size of the first, its
        name, the next one's name)`` read together."""
        if n < 0 or n > self.remaining:
            raise _past_end(what, self.remaining)
        pos = self._pos
        while len(self._buf) - pos < n:
            self._inflate(n - (len(self._buf) - pos))
            pos = self._pos
        self._pos = pos + n
        self.consumed += n
        return self._buf[pos:pos + n]

    def unpack(self, st: struct.Struct, what: str):
        return st.unpack(self.take(st.size, what))

    def rest(self) -> tuple[bytes, int]:
        """(the inflated body, where its unread part begins): as much of the declared rest as the
        deflate stream gives, inflated at once (the caller has bounded its size). A field past
        what it gave is :meth:`missing`; :meth:`skip` then moves past what was read in place."""
        try:
            while len(self._buf) - self._pos < self.remaining:
                self._inflate(self.remaining - (len(self._buf) - self._pos))
        except CorruptStreamError as exc:  # (raised where a field needs the bytes, as take raises it)
            self._failure = exc
        return self._buf, self._pos

    def missing(self, offset: int, n: int, what: str | tuple[int, str, str]) -> NoReturn:
        """The error of a field of ``n`` bytes at ``offset`` past :meth:`rest`'s start that its
        bytes do not hold: the one :meth:`take` raises."""
        if n > self.remaining - offset:
            raise _past_end(what, self.remaining - offset)
        raise self._failure or CorruptStreamError(_SIZE_MISMATCH)

    def skip(self, n: int) -> None:
        """Move past ``n`` bytes read in place from :meth:`rest`'s buffer."""
        self._pos += n
        self.consumed += n

    def _inflate(self, need: int) -> None:
        try:
            more = self._inflater.decompress(self._input, max(need, 1 << 16))
        except zlib.error as exc:
            raise CorruptStreamError(f"header body does not inflate: {exc}") from None
        self._input = self._inflater.unconsumed_tail
        if not more:
            raise CorruptStreamError(_SIZE_MISMATCH)
        self._buf = self._buf[self._pos:] + more
        self._pos = 0

    def finish(self) -> None:
        """Refuse bytes after the last entry, in the body or in its deflate stream."""
        if self.remaining:
            raise CorruptStreamError(f"{self.remaining} unexplained bytes at the end of the header")
        try:
            extra = self._inflater.decompress(self._input, 1)
        except zlib.error as exc:
            raise CorruptStreamError(f"header body does not inflate: {exc}") from None
        if extra or len(self._buf) > self._pos or self._inflater.unconsumed_tail or not self._inflater.eof \
                or self._inflater.unused_data:
            raise CorruptStreamError(_SIZE_MISMATCH)


def parse_metadata(raw: bytes, count: int) -> dict:
    """The metadata JSON object, refused (CorruptStreamError) when it is not one, nests too deep, holds
    more containers than ``count`` tensors can need, or numbers Python will not parse."""
    containers = raw.count(b"{") + raw.count(b"[")  # (an upper bound: brackets inside strings count too)
    if containers > MAX_METADATA_CONTAINERS_BASE + 8 * count:
        raise CorruptStreamError(f"metadata with {containers:,} JSON objects and arrays is more than "
                                 f"{count} tensors can need")
    try:
        metadata = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptStreamError(f"metadata is not valid JSON: {exc}") from None
    except RecursionError:
        raise CorruptStreamError("metadata JSON nests deeper than Python can parse") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise CorruptStreamError(f"metadata JSON holds a value Python cannot read: {exc}") from None
    if not isinstance(metadata, dict):
        raise CorruptStreamError("metadata must be a JSON object")
    return metadata


def raw_chunk_elements(dtype: DType) -> int:
    """Elements per chunk of a RAW tensor: chunk sizes are u32, so chunks stay below 1 GiB."""
    return (1 << 30) // dtype.itemsize


def _check_qp_pair(qp: int, qp_density: int, what: str) -> None:
    if not (QP_MIN <= qp <= QP_MAX and 0 <= qp_density <= QP_DENSITY_MAX):
        raise CorruptStreamError(f"{what} {qp} / qp_density {qp_density} out of range")
    try:
        step_from_qp(qp, qp_density)
    except ValueError:
        raise CorruptStreamError(f"{what} {qp} at qp_density {qp_density} has no usable step") from None


def read_stream(f, *, max_elements: int | None = None) -> bytes:
    """The whole model stream at the start of the binary file object ``f`` (a pipe, a device, a
    file), read in bounded pieces: the preamble, the header, then exactly the payload its table
    declares; bytes after it are refused. Nothing is read beyond what the format justifies, and
    ``max_elements`` refuses (LimitExceededError) a table of more elements before its payload is read.
    """
    head = read_exactly(f, PREAMBLE.size, "preamble")
    _, header_size = read_preamble(head)
    head += read_exactly(f, header_size, "header")
    header = read_header(head, payload_known=False)
    check_max_elements(header, max_elements)
    payload = read_exactly(f, sum(e.size for e in header.tensors), "payload")
    if f.read(1):
        raise CorruptStreamError("bytes after the end of the stream (its tensor table ends before them)")
    return head + payload


def check_max_elements(header: StreamHeader, max_elements: int | None) -> None:
    """The caller's own bound on what one stream may make the decoder allocate (the header parser
    already bounds every tensor by its payload)."""
    if max_elements is None:
        return
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 0:
        raise ValueError(f"max_elements must be a non-negative int or None, not {max_elements!r}")
    claimed = sum(e.numel for e in header.tensors if not e.is_alias)
    if claimed > max_elements:
        raise LimitExceededError(f"the stream holds {claimed:,} elements, more than max_elements={max_elements:,}")


def read_header_file(path) -> StreamHeader:
    """Read and parse only the header of a stream file (the payload is not read)."""
    try:
        with open(path, "rb") as f:
            total = os.fstat(f.fileno()).st_size
            head = f.read(PREAMBLE.size)
            _, header_size = read_preamble(head)
            head += f.read(header_size)
    except OSError as exc:
        raise unreadable(path, exc) from None
    return read_header(head, total_size=total)


def _validate_entry(e: TensorEntry, index: int, where: str, earlier: list[TensorEntry], expected_offset: int,
                    layouts: dict[tuple, tuple[int, int, int]]) -> None:
    """Refuse an entry that no writer makes. Its layout (everything but where its payload lies and
    how its bytes fall into chunks) is checked once per distinct layout of the header, kept in
    ``layouts``: a model repeats a few layouts (MiniLM's 103 entries have 13), and checking each
    entry's in full took half of the header's parsing."""
    if e.is_alias:
        _validate_alias(e, index, where, earlier)
        return
    key = (e.dtype, e.mode, e.coder, e.flags, e.shape, e.qp, e.qp_density, e.coder_param, e.alias_of,
           e.chunk_elements, len(e.chunk_sizes))
    chunking = layouts.get(key)
    if chunking is None:
        chunking = layouts[key] = _validate_layout(e, where)
    if e.offset != expected_offset:
        raise CorruptStreamError(f"{where}: payload offset {e.offset}, expected {expected_offset}")
    if sum(e.chunk_sizes) != e.size:
        raise CorruptStreamError(f"{where}: chunk sizes do not add up to the payload size")
    mode = e.mode
    if mode == _RAW:
        itemsize = e.dtype.itemsize
        if e.size != e.numel * itemsize:
            raise CorruptStreamError(f"{where}: raw payload of {e.size} bytes does not match its shape and dtype")
        if any(size != (stop - start) * itemsize
               for size, (start, stop) in zip(e.chunk_sizes, map(e.even_chunk_bounds, range(e.even_chunk_count)))):
            raise CorruptStreamError(f"{where}: raw chunk sizes do not match its shape and dtype")
        return
    sizes = e.chunk_sizes
    if mode == _LOG and sizes[0] != LOG_OFFSET_BYTES:
        raise CorruptStreamError(f"{where}: the log domain without its {LOG_OFFSET_BYTES}-byte offset")
    first, ce, numel = chunking  # (the first substream of elements, their chunks' size, their count)
    bound = floatcoder.max_elements_for_payload if mode in _CLASS_CODED else max_elements_for_payload
    # (every chunk holds ce elements but the last: the smallest of the others answers for them)
    if len(sizes) > first and (bound(min(sizes[first:-1], default=ce)) < ce
                               or bound(sizes[-1]) < numel - (len(sizes) - first - 1) * ce):
        for k, size in enumerate(sizes[first:]):
            count = min(ce, numel - k * ce)
            if count > bound(size):
                what = "elements" if mode in _CLASS_CODED else "levels"
                raise CorruptStreamError(f"{where}: chunk {k} claims {count} {what} in {size} bytes")


def _validate_holdable(e: TensorEntry, where: str) -> None:
    """What every entry, alias or not, must be: a shape numpy can hold, bfloat16 only for torch."""
    problem = shape_problem(e.shape)
    if problem is not None:
        raise CorruptStreamError(f"{where}: {problem}")
    if e.dtype == DType.BFLOAT16 and not e.flags & FLAG_TORCH:  # (numpy has no bfloat16)
        raise CorruptStreamError(f"{where}: a bfloat16 tensor that is not a torch tensor")


def _validate_alias(e: TensorEntry, index: int, where: str, earlier: list[TensorEntry]) -> None:
    _validate_holdable(e, where)
    if e.alias_of >= index:
        raise CorruptStreamError(f"{where}: aliases tensor {e.alias_of}, which does not precede it")
    target = earlier[e.alias_of]
    if target.is_alias or target.shape != e.shape or target.dtype != e.dtype:
        raise CorruptStreamError(f"{where}: alias target {e.alias_of} does not match it")
    if (e.size or e.chunk_sizes or e.coder_param or e.offset or e.crc32 or e.qp or e.qp_density
            or e.chunk_elements or e.coder != Coder.NONE or e.mode != target.mode):
        raise CorruptStreamError(f"{where}: an alias carries no payload and no coding parameters")


def _validate_layout(e: TensorEntry, where: str) -> tuple[int, int, int]:
    """The checks of an entry that hold for every entry of its layout (not an alias); returns how
    its payload falls into chunks: (the index of the first substream of elements, elements per
    chunk, elements)."""
    _validate_holdable(e, where)
    numel = e.numel
    if e.alias_of != NO_ALIAS:
        raise CorruptStreamError(f"{where}: alias index without the alias flag")
    if e.mode == Mode.RAW:
        if (e.coder != Coder.NONE or e.qp or e.qp_density or e.coder_param
                or e.chunk_elements != raw_chunk_elements(e.dtype)):
            raise CorruptStreamError(f"{where}: raw payload of {e.size} bytes does not match its shape and dtype")
        if len(e.chunk_sizes) != e.even_chunk_count:
            raise CorruptStreamError(f"{where}: raw chunk sizes do not match its shape and dtype")
        return 0, e.chunk_elements, numel
    if e.mode.is_class_coded:
        return _validate_class_coded_layout(e, where)
    if e.coder != Coder.ADAPTIVE_SCALE:
        raise FormatError(f"{where}: coding mode {e.mode.name} needs a level coder")
    if e.mode.has_step:
        if not e.dtype.is_float:
            raise CorruptStreamError(f"{where}: quantization of a {e.dtype.name} tensor")
        if e.mode == Mode.LOG and e.dtype.dtype_name not in LOG_DTYPES:
            raise CorruptStreamError(f"{where}: the log domain of a {e.dtype.name} tensor")
        _check_qp_pair(e.qp, e.qp_density, f"{where}: qp")
    elif e.dtype.is_float or e.dtype.is_complex:
        raise CorruptStreamError(f"{where}: integer coding of a {e.dtype.name} tensor")
    elif e.qp or e.qp_density:
        raise CorruptStreamError(f"{where}: an integer tensor has no qp")
    if (e.coder_param & ~SWITCH_BITS) > MAX_K_OFFSET:
        raise CorruptStreamError(f"{where}: coder parameter 0x{e.coder_param:02x} out of range")
    if e.coder_param & NO_COLUMNS_BIT and e.coder_param & (PREDICT_BIT | LINEAR_BIT):
        raise CorruptStreamError(f"{where}: column model off, but column or linear prediction on")
    first = 0
    if e.is_linear:
        row = row_length(e.shape)
        if e.mode != Mode.UNIFORM or e.coder_param & PREDICT_BIT:
            raise CorruptStreamError(f"{where}: linear prediction with mode {e.mode.name} or column prediction")
        if not MIN_COLUMNS <= row <= MAX_COLUMNS or e.chunk_elements % row:
            raise CorruptStreamError(f"{where}: linear prediction over rows of {row} in chunks of {e.chunk_elements}")
        if not e.chunk_sizes:
            raise CorruptStreamError(f"{where}: linear prediction without its predictor")
        first = 1
    if e.mode == Mode.LOG:
        if e.coder_param & (PREDICT_BIT | LINEAR_BIT):
            raise CorruptStreamError(f"{where}: the log domain with column or linear prediction")
        if not e.chunk_sizes:
            raise CorruptStreamError(f"{where}: the log domain without its {LOG_OFFSET_BYTES}-byte offset")
        first = 1
    # Small chunks would multiply the per-chunk slack of the allocation bound; writers use >= 2**19.
    if e.chunk_elements < min(e.numel, MIN_CHUNK_ELEMENTS) or e.chunk_elements < 1:
        raise CorruptStreamError(f"{where}: chunk size {e.chunk_elements} is below the minimum")
    layout = layout_from_stream(e.shape, e.chunk_elements, e.coder_param)
    if len(e.chunk_sizes) - first != layout.count:
        raise CorruptStreamError(f"{where}: {len(e.chunk_sizes) - first} level chunks, but the shape needs "
                                 f"{layout.count}")
    return first, e.chunk_elements, layout.numel


def _validate_class_coded_layout(e: TensorEntry, where: str) -> tuple[int, int, int]:
    """A FLOAT or MAGNITUDE entry (the classes-and-rANS coder; at least one raw bit per element)."""
    takes = floatcoder.FORMATS if e.mode == Mode.FLOAT else floatcoder.INTEGER_WIDTHS
    if e.dtype.dtype_name not in takes:
        raise CorruptStreamError(f"{where}: coding mode {e.mode.name} of a {e.dtype.name} tensor")
    if e.coder != Coder.FLOAT_CLASSES:
        raise FormatError(f"{where}: coding mode {e.mode.name} needs the classes-and-rANS coder")
    if e.qp or e.qp_density:
        raise CorruptStreamError(f"{where}: a losslessly coded tensor has no qp")
    if e.coder_param not in (floatcoder.REVISIONS if e.mode == Mode.FLOAT else (0,)):
        raise CorruptStreamError(f"{where}: coder parameter {e.coder_param} of a {e.mode.name} entry")
    ce = floatcoder.chunk_elements(e.shape)
    if e.chunk_elements != ce:
        raise CorruptStreamError(f"{where}: chunks of {e.chunk_elements} elements, the shape needs {ce}")
    numel = e.numel
    if len(e.chunk_sizes) != -(-numel // ce):
        raise CorruptStreamError(f"{where}: {len(e.chunk_sizes)} chunks, but the shape needs {-(-numel // ce)}")
    return 0, ce, numel
