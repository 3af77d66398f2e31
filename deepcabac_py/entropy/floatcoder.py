"""Lossless coding of float tensors (bfloat16, float16, float32, float64), bit for bit.

Trained weights leave little to a lossless coder: sign and low mantissa bits are close to uniform,
and nearly all the redundancy is in the exponent. What is left after a byte-wise coder (ZipNN, at
the order-0 bound of each byte) is the exponent's dependence on its row's scale and the fall of the
density inside an octave. So the tensor is cut into *segments* (whole rows, at least
:data:`MIN_SEGMENT` elements), each segment gets one of up to 16 *classes* by its mean exponent, and
each class its own frequency table for the symbol (exponent, top mantissa bits). The rest of the
bits go out raw, less the low mantissa bits that are zero in every element of the segment (float32
tensors holding bfloat16 or float16 values). Tables are static per chunk, so decoding is a table
lookup per element (:mod:`._tans_kernels`); large chunks of bf16, fp16 and fp32 take sixteen
elements per vector step instead (low-bit mode 4, :mod:`._wide_kernels`).

Chunks of :func:`chunk_elements` elements are independent substreams, like the level coder's.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

from .._jit import not_yet_compiled
from ..errors import CorruptStreamError
from . import _float_kernels as _k
from . import _magnitude_kernels as _m
from . import _tans_kernels as _t
from . import _trailing_kernels as _z
from . import _wide_kernels as _w

Buffer = bytes | memoryview  # a substream: bytes, or a view of the array a kernel wrote it into
PROB_BITS = _k.PROB_BITS
MIN_SEGMENT = 256  # a segment's class costs 4 bits: no segment is shorter than this
MAX_SEGMENT = 1 << 16  # longer rows are split: the classes then follow the scale along the row
CHUNK_TARGET = 1 << 20
MAX_CLASSES = 1 << _k.MAX_CLASSES_LOG2
# A FLOAT entry's coder parameter says what its substreams use beyond format version 6
# (docs/format.md §4.4), bit by bit: TRAILING_REVISION where one of them takes low-bit mode 2
# (trailing zeros by exponent, version 7), TANS_REVISION where one codes its symbols by tANS
# (version 8), TZ_REVISION where one takes low-bit mode 3 (trailing zeros in the symbol, version 9),
# WIDE_REVISION where a 16-bit one takes low-bit mode 4 (64 rANS states, decoded sixteen at a time,
# version 10), WIDE32_REVISION where a float32 one does (version 11), TZ_WIDE_REVISION where a
# float32 one takes low-bit mode 5 (mode 3's symbols on mode 4's states, version 12),
# HALVES_REVISION where a float32 one takes low-bit mode 6 (bfloat16 values as their upper halves,
# version 13).
TRAILING_REVISION = 1
TANS_REVISION = 2
TZ_REVISION = 4
WIDE_REVISION = 8
WIDE32_REVISION = 16
TZ_WIDE_REVISION = 32
HALVES_REVISION = 64
REVISIONS = tuple(range(128))  # (any combination of the seven)
TRAILING_MODE = 2  # the substream's low-bit mode byte for the trailing zeros by exponent (rANS)
TANS_FLAG = 0x80  # in the mode byte of low-bit modes 0 and 1: the symbols by tANS, not rANS
TZ_BYTE = TANS_FLAG | _t.TZ_MODE  # low-bit mode 3's byte: the trailing zeros in the symbol, by tANS
WIDE_BYTE = _w.WIDE_BYTE  # low-bit mode 4's byte: bf16, fp16 or fp32 dropping no bit, 64 rANS states
TZ_WIDE_BYTE = _w.TZ_WIDE_BYTE  # low-bit mode 5's: float32's trailing zeros in the symbol, 64 rANS states
_TANS_BYTES = (TANS_FLAG, TANS_FLAG | 1)  # low-bit modes 0 and 1 by tANS
# Low-bit mode 6's byte: a float32 chunk whose every element is a bfloat16 value (its low 16 bits
# zero: a checkpoint of bf16 training saved in float32), coded as the bfloat16 substream of its
# upper halves, where mode 4 would take the chunk's size. Mode 0 or 1 would drop the same 16 bits
# and code the same symbols and raw bits, but through four tANS states: 1.98 ns per element to
# decode one of MiniLM's word-embedding chunks, against 0.59 for mode 4's sixteen-wide steps, which
# store each half widened into its float (0.92 with the widening in a pass of its own; scratch).
HALVES_BYTE = 0x86
HALF_BITS = 16
SMALL_TOGETHER = 1 << 12  # elements: float tensors this small are coded and decoded with their neighbours
# Mode 4 for chunks from this many elements: its 64 states cost about 128 bytes more than tANS's
# four (0.07% of a chunk of 2**17 bf16 elements), and its tables twice the cache
WIDE_FROM = 1 << 17
# Mode 5 in place of mode 3 from this many elements: its 64 states cost 247 bytes more than tANS's
# four (0.2% of a chunk of 2**15 float32 elements), and it decodes twice as fast (scratch,
# EfficientNet-Lite0 fp32: 0.014% more bytes, the whole model's decode 17.4 -> 13.0 ms; from 2**14
# elements 0.026% and 12.8 ms)
TZ_WIDE_FROM = 1 << 15
TRAILING_GAIN = 0.01  # mode 2 or 3 must save this share of the chunk (and a sample promise it first)
# A promise this many times the gain takes mode 2, 3 or 5 untried against the segments' drop: on
# EfficientNet-Lite0's float32 weights every chunk promising 2% or more saved at least 1% (2.3-3.4%
# from 3%), and coding both ways had cost the 1.5M elements between 2% and 4% a second encoding.
# From 1.2%: of its ten chunks promising 1.2-1.9% (819k elements, each coded twice), nine saved
# 1.0-4.7%, one (2,160 elements) 0.77%; the model encodes about 2 ms faster, 56 bytes smaller (scratch)
TRAILING_SURE = 1.2
# Mode 2 decodes two symbols per element: the trailing zeros' tables are kept at 2**10 slots, whose
# lookup table stays in the cache, for 0.01% more bytes than 2**14 (EfficientNet-Lite0 float32)
TRAILING_TABLE_BITS = 10

# (total bits, mantissa bits) of each float dtype the coder takes, by dtype name
FORMATS = {"bfloat16": (16, 7), "float16": (16, 10), "float32": (32, 23), "float64": (64, 52)}
_WORDS = {16: np.uint16, 32: np.uint32, 64: np.uint64}

_ERRORS = {
    _k.ERR_OVERRUN: "the substream is shorter than its elements need (truncated)",
    _k.ERR_BAD_END: "the coder does not end in its initial state (the substream is damaged)",
    _k.ERR_BAD_TABLE: "a frequency table is invalid",
    _k.ERR_TRAILING: "bytes are left after the last element",
    _m.ERR_BAD_INTEGER: "a decoded integer is outside its dtype (or a negative zero)",
}


def first_call_compiles(decoder: bool) -> bool:
    """Whether the first lossless decode (``decoder``) or encode of this process compiles the float
    coder's kernels (those of small and mid-sized chunks: every model has some)."""
    return not_yet_compiled(_t.decode_tans_substream if decoder else _t.encode_tans_substream)


@functools.lru_cache(maxsize=1024)  # (asked for each entry and chunk, of a model's few dozen shapes)
def segment_length(shape: tuple[int, ...]) -> int:
    """Elements per segment of a tensor of this shape (format: docs/format.md §4.4)."""
    numel = math.prod(shape)
    row = numel // shape[0] if len(shape) >= 2 and shape[0] > 0 else numel
    row = min(max(row, 1), MAX_SEGMENT)
    return row * -(-MIN_SEGMENT // row)


@functools.lru_cache(maxsize=1024)
def chunk_elements(shape: tuple[int, ...]) -> int:
    """Elements per substream: whole segments, about :data:`CHUNK_TARGET`."""
    seg = segment_length(shape)
    return seg * max(1, CHUNK_TARGET // seg)


def max_elements_for_payload(nbytes: int) -> int:
    """At least one raw bit (the sign) per element."""
    return 8 * nbytes


def _alphabet(W: int, M: int) -> int:
    """Symbols of a float of W bits, M of them mantissa: the exponent and the top mantissa bits."""
    return 1 << (W - 1 - M + _k.TOP_BITS)


_COSTS = _k.cost_table()


def _words(values: np.ndarray, dtype_name: str) -> np.ndarray:
    W, _ = FORMATS[dtype_name]
    if values.ndim == 1 and values.flags.c_contiguous:  # (a chunk's output: no call more than needed)
        return values.view(_WORDS[W])
    return np.ascontiguousarray(values).reshape(-1).view(_WORDS[W])


class _Tables:
    """The class count, precision, tables and per-segment classes the encoder chose for a chunk."""

    def __init__(self, hist16: np.ndarray, classes16: np.ndarray, max_bits: int = PROB_BITS):
        alphabet = hist16.shape[1]
        freq16 = np.zeros((MAX_CLASSES, alphabet), dtype=np.int32)
        self.klog, self.precision = _k.choose_classes(hist16, classes16.shape[0], _COSTS, max_bits, freq16)
        self.classes = (classes16 >> (_k.MAX_CLASSES_LOG2 - self.klog)).astype(np.uint8)
        self.sent = freq16[:1 << self.klog]
        self.freq = self.sent << (PROB_BITS - self.precision)
        self.start = (np.cumsum(self.freq, axis=1) - self.freq).astype(np.int32)

    def header(self) -> list[bytes]:
        """The class count, precision, class nibbles and tables, as the substream holds them."""
        nseg = self.classes.shape[0]
        parts = [bytes([self.klog, self.precision])]
        if self.klog:
            padded = np.zeros(2 * (-(-nseg // 2)), dtype=np.uint8)
            padded[:nseg] = self.classes
            parts.append((padded[0::2] | (padded[1::2] << 4)).tobytes())
        tables = np.zeros(self.freq.shape[0] * (8 + self.freq.shape[1] * 8) + 8, dtype=np.uint8)  # (gamma <= 31 bits)
        tbytes = _k.write_tables(self.sent, tables)
        return parts + [struct.pack("<I", tbytes), tables[:tbytes].tobytes()]


def _coded(parts: list[bytes], classes16: np.ndarray, alphabet: int, seg_len: int, symbols: np.ndarray,
           raw: np.ndarray, nraw: int) -> bytes:
    """The substream: ``parts`` (what precedes the coder words), the tables the encoder chooses for
    ``symbols`` (``classes16``: each segment's of 16 classes), their rANS words and the raw bits."""
    t = _class_tables(symbols, seg_len, classes16, alphabet)
    rans = np.empty(symbols.shape[0] + 2 * _k.LANES + 2, dtype=np.uint16)
    begin = _k.rans_encode(symbols, seg_len, t.classes, t.freq, t.start, rans)
    return _joined([*parts, *t.header()], rans, begin, raw, nraw)


def _class_tables(symbols: np.ndarray, seg_len: int, classes16: np.ndarray, alphabet: int,
                  max_bits: int = PROB_BITS) -> _Tables:
    """The tables the encoder chooses for ``symbols`` (``classes16``: each segment's of 16 classes)."""
    hist16 = np.zeros((MAX_CLASSES, alphabet), dtype=np.int64)
    _k.histogram(symbols, seg_len, classes16, hist16)
    return _Tables(hist16, classes16, max_bits)


def _joined(head: list[bytes], coder: np.ndarray, begin: int, raw: np.ndarray, nraw: int) -> bytes:
    """The substream: ``head`` (everything before the coder words), the count and the coder's words
    from ``begin`` (u16 rANS or u32 tANS words, little-endian), the ``nraw`` raw words."""
    # (the words go into the join as views: each byte is copied once)
    pieces: list[bytes | memoryview] = [*head, struct.pack("<I", coder.shape[0] - begin),
                                        coder[begin:].astype(coder.dtype.newbyteorder("<"), copy=False).data,
                                        raw[:nraw].astype("<u4", copy=False).data]
    return b"".join(pieces)


class _Work(threading.local):
    """Each thread's work memory for :func:`_t.encode_tans_substream`, kept from chunk to chunk and
    grown when a chunk needs more (at most about 23 MB, float64 chunks of 2**20 elements). Buffers
    of megabytes allocated afresh for every chunk cost their first touch, page by page, every time:
    a scratch measurement put that at 15-25% of MiniLM bf16's encoding time."""

    def __init__(self):
        self.buffer = np.empty(0, dtype=np.uint8)
        self.hint = np.zeros(1, dtype=np.int64)  # (see _w.encode_wide_substream)

    def take(self, nbytes: int) -> np.ndarray:
        if self.buffer.size < nbytes:
            self.buffer = np.empty(nbytes, dtype=np.uint8)
        return self.buffer


_WORK = _Work()
_HALVES = _Work()  # (low-bit mode 6's upper halves, apart from the coder's work memory they are coded with)


def _tans_substream(words: np.ndarray, seg_len: int, W: int, M: int, zeros: np.ndarray,
                    classes16: np.ndarray, wide: bool = False) -> Buffer:
    """Low-bit mode 0 or 1 by tANS, or with ``wide`` mode 4 where no segment drops a low bit (16-bit
    floats find their segments' statistics as they split: ``zeros`` and ``classes16`` are empty
    then)."""
    work = _WORK.take(_t.tans_work_bytes(words.shape[0], seg_len, W, M))
    if W == 16 or wide:
        data = _w.encode_wide_substream(words, seg_len, W, M, zeros, classes16, _COSTS, wide, work, _WORK.hint)
        # (mode 4 comes in an array of its own, kept as it is; modes 0 and 1 in the work memory)
        return memoryview(data) if data[0] == WIDE_BYTE else data.tobytes()
    return _t.encode_tans_substream(words, seg_len, W, M, zeros, classes16, _COSTS, work).tobytes()


def encode_chunk(values: np.ndarray, dtype_name: str, seg_len: int, wide: bool | None = None) -> bytes:
    """The substream of ``values`` (a flat array of the dtype's bits or values: float16/32/64, or the
    uint16 bits of bfloat16), whose segments are ``seg_len`` long (the last may be shorter). bf16,
    fp16 and fp32 take low-bit mode 4 where no segment drops a low bit and ``wide`` says so (None:
    from :data:`WIDE_FROM` elements on, float32 unless a mode of trailing zeros saves more; True:
    float32 untried against those). A float32 chunk of bfloat16 values that ``wide`` would take
    goes as low-bit mode 6 instead: the bfloat16 substream of its upper halves."""
    data = encode_chunk_buffer(values, dtype_name, seg_len, wide)
    return data if isinstance(data, bytes) else data.tobytes()


def encode_chunk_buffer(values: np.ndarray, dtype_name: str, seg_len: int, wide: bool | None = None) -> Buffer:
    """:func:`encode_chunk`'s substream as bytes or as a view of the array of its own the kernel
    wrote it into (the model's encoder keeps either as it is)."""
    if dtype_name not in FORMATS:
        raise ValueError(f"the lossless float coder takes {', '.join(FORMATS)}, not {dtype_name}")
    W, M = FORMATS[dtype_name]
    words = _words(values, dtype_name)
    if W < 32:  # (no low-bit mode 2 to judge: the kernel finds each segment's statistics as it splits it)
        none = np.empty(0, dtype=np.uint8)
        wide = words.shape[0] >= WIDE_FROM if wide is None else wide
        return _tans_substream(words, seg_len, W, M, none, none, wide=wide)
    zeros, classes16 = _segment_classes(words, W, M, seg_len)
    wide_size = words.shape[0] >= WIDE_FROM if wide is None else wide
    if W == 32 and wide_size and zeros.shape[0] and int(zeros.min()) >= HALF_BITS:
        return _halves_substream(words, seg_len, wide)
    if W == 32 and wide:
        return _tans_substream(words, seg_len, W, M, zeros, classes16, wide=True)
    promise = _z.trailing_promise(words, W, M, seg_len, zeros)
    if promise >= TRAILING_SURE * TRAILING_GAIN:
        return _trailing_substream(words, W, M, seg_len, classes16)
    wide = W == 32 and wide is None and words.shape[0] >= WIDE_FROM
    data = _tans_substream(words, seg_len, W, M, zeros, classes16, wide=wide)
    if promise >= TRAILING_GAIN:
        # (mode 3 decodes at about half the speed of modes 0 and 1, mode 2 at a quarter: a small
        # saving does not pay for that)
        other = _trailing_substream(words, W, M, seg_len, classes16)
        if len(other) <= (1 - TRAILING_GAIN) * len(data):
            return other
    return data


def _halves_substream(words: np.ndarray, seg_len: int, wide: bool | None) -> Buffer:
    """Low-bit mode 6: float32 ``words`` whose low halves are all zero, as the mode byte and the
    bfloat16 substream of their upper halves (``wide`` as :func:`encode_chunk` takes it)."""
    n = words.shape[0]
    # (one pass, into memory kept from chunk to chunk: a uint32 temporary and a fresh array per
    # chunk were 23% of the chunk's encoding, scratch)
    halves = _HALVES.take(2 * n)[:2 * n].view(np.uint16)
    np.right_shift(words, HALF_BITS, out=halves, casting="unsafe")
    inner = encode_chunk_buffer(halves, "bfloat16", seg_len, wide)
    out = np.empty(1 + len(inner), dtype=np.uint8)
    out[0] = HALVES_BYTE
    out[1:] = np.frombuffer(inner, dtype=np.uint8)
    return out.data


def codes_together(dtype_name: str, numel: int) -> bool:
    """Whether a one-chunk tensor of ``numel`` elements of ``dtype_name`` is small enough to be
    coded with its neighbours in one call (:func:`encode_small_chunks`): a bfloat16, float16 or
    float32 one of at most :data:`SMALL_TOGETHER` elements."""
    return numel <= SMALL_TOGETHER and dtype_name in _TOGETHER


_TOGETHER = ("bfloat16", "float16", "float32")


def encode_small_chunks(chunks: Sequence[np.ndarray], dtype_name: str, seg_lens: Sequence[int]) -> list[Buffer]:
    """:func:`encode_chunk_buffer` of each of ``chunks`` (flat, of ``dtype_name``, as
    :func:`codes_together` takes them; chunk j's segments ``seg_lens[j]`` long) in one kernel call:
    the same bytes, as views of one array. EfficientNet-Lite0 has 203 tensors of at most 2,048
    elements: each cost more in the Python and the cold start around its kernel than in it."""
    if len(chunks) != len(seg_lens) or not all(codes_together(dtype_name, c.size) for c in chunks):
        raise ValueError("encode_small_chunks takes chunks of bfloat16, float16 or float32 of at most "
                         f"{SMALL_TOGETHER} elements, one segment length each")
    W, M = FORMATS[dtype_name]
    words = [_words(c, dtype_name) for c in chunks]
    starts = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum([w.shape[0] for w in words], out=starts[1:])
    lens = np.array(seg_lens, dtype=np.int64)
    flat = np.concatenate(words) if words else np.empty(0, _WORDS[W])
    ends = np.empty(len(words), dtype=np.int64)
    # (work memory grows with the elements and the segments: the most and the shortest bound every chunk's)
    shortest = min(seg_lens, default=MIN_SEGMENT)
    if W == 16:
        work = _WORK.take(_t.tans_work_bytes(SMALL_TOGETHER, shortest, W, M))
        out = _t.encode_tans_chunks(flat, starts, lens, W, M, _COSTS, work, ends)
    else:
        work = _WORK.take(max(_t.tans_work_bytes(SMALL_TOGETHER, shortest, W, M),
                              _t.tz_work_bytes(SMALL_TOGETHER, shortest)))
        out = _t.encode_float32_chunks(flat, starts, lens, _COSTS, work, ends, TRAILING_SURE * TRAILING_GAIN,
                                       TRAILING_GAIN)
    view = memoryview(out)
    begins = [0, *ends[:-1].tolist()]
    return [view[a:b] for a, b in zip(begins, ends.tolist())]


def _trailing_substream(words: np.ndarray, W: int, M: int, seg_len: int, classes16: np.ndarray,
                        rans: bool = False, wide: bool | None = None) -> bytes:
    """The trailing zeros coded: for float32 low-bit mode 5 from :data:`TZ_WIDE_FROM` elements on
    and mode 3 below (``wide`` True or False: the one said), mode 2 with ``rans``; mode 2 for
    float64."""
    if W == 32 and not rans:
        work = _WORK.take(_t.tz_work_bytes(words.shape[0], seg_len))
        if (words.shape[0] >= TZ_WIDE_FROM) if wide is None else wide:
            return _w.encode_tz_wide_substream(words, seg_len, classes16, _COSTS, work).tobytes()
        return _t.encode_tz_substream(words, seg_len, classes16, _COSTS, work).tobytes()
    return _encode_trailing(words, W, M, seg_len, classes16)


def encode_trailing(values: np.ndarray, dtype_name: str, seg_len: int, rans: bool = False,
                    wide: bool | None = None) -> bytes:
    """The substream of ``values`` (as :func:`encode_chunk` takes them) with their trailing zeros
    coded: for float32 low-bit mode 5 or 3 (by size, or as ``wide`` says), or with ``rans`` mode 2
    (as the version-8 writer wrote it); mode 2 for float64. encode_chunk takes it where it is
    smaller."""
    W, M = FORMATS[dtype_name]
    words = _words(values, dtype_name)
    return _trailing_substream(words, W, M, seg_len, _segment_classes(words, W, M, seg_len)[1], rans, wide)


def _segment_classes(words: np.ndarray, W: int, M: int, seg_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(the low bits zero in each segment, each segment's of 16 classes)."""
    nseg = -(-words.shape[0] // seg_len)
    zeros = np.empty(nseg, dtype=np.uint8)
    classes16 = np.empty(nseg, dtype=np.uint8)
    _k.segment_classes(words, seg_len, W, M, zeros, classes16)
    return zeros, classes16


def _encode_trailing(words: np.ndarray, W: int, M: int, seg_len: int, classes16: np.ndarray) -> bytes:
    L = M - _k.TOP_BITS
    n = words.shape[0]
    symbols = np.empty(n, dtype=np.uint16)
    tz = np.empty(n, dtype=np.uint8)
    raw = np.empty(2 * n + 2, dtype=np.uint32)
    nraw, e_top = _z.trailing_split(words, W, M, symbols, tz, raw)
    t = _class_tables(symbols, seg_len, classes16, _alphabet(W, M))
    tz_hist = np.zeros((_z.TRAILING_CONTEXTS, L + 1), dtype=np.int64)
    _z.trailing_histogram(symbols, tz, e_top, tz_hist)
    # (the contexts' tables, merged in pairs like the segments' classes; no nibbles: a context's
    # table is its number >> (4 - klog))
    for c in range(1, _z.TRAILING_CONTEXTS):  # (context 0 holds the top exponent)
        if not tz_hist[c].any():  # (an empty context borrows the counts above it: every class occupied)
            tz_hist[c] = tz_hist[c - 1]
    tzt = _Tables(tz_hist, np.zeros(0, dtype=np.uint8), TRAILING_TABLE_BITS)
    rans = np.empty(2 * n + 2 * _k.LANES + 2, dtype=np.uint16)
    begin = _z.rans_encode_trailing(symbols, tz, seg_len, t.classes, t.freq, t.start, e_top,
                                    _k.MAX_CLASSES_LOG2 - tzt.klog, tzt.freq, tzt.start, rans)
    return _joined([bytes([TRAILING_MODE]), struct.pack("<H", e_top), *t.header(), *tzt.header()], rans, begin, raw,
                   nraw)


def revision_of(substreams: Sequence[Buffer], dtype_name: str) -> int:
    """The coder parameter of a FLOAT entry of ``dtype_name`` with these substreams: what they use,
    bit by bit."""
    modes = frozenset([int(data[0]) for data in substreams if len(data)])
    # (mode 6's bfloat16 substream takes the bits a bfloat16 entry's would)
    inner = 0
    if HALVES_BYTE in modes:
        inner = revision_of([data[1:] for data in substreams if len(data) and data[0] == HALVES_BYTE],
                            "bfloat16") | HALVES_REVISION
    return _revision_of_modes(modes, FORMATS[dtype_name][0] == 32) | inner


@functools.lru_cache(maxsize=256)
def _revision_of_modes(modes: frozenset[int], wide32: bool) -> int:
    # (a few combinations in all, asked for once per tensor: a model has hundreds of small ones)
    return ((TRAILING_REVISION if TRAILING_MODE in modes else 0)
            | (TANS_REVISION if not modes.isdisjoint(_TANS_BYTES) else 0)
            | (TZ_REVISION if TZ_BYTE in modes else 0)
            | ((WIDE32_REVISION if wide32 else WIDE_REVISION) if WIDE_BYTE in modes else 0)
            | (TZ_WIDE_REVISION if TZ_WIDE_BYTE in modes else 0))


_LITTLE_ENDIAN = sys.byteorder == "little"  # (elsewhere the words are copied into the native order)


def _read_only(words: np.ndarray) -> np.ndarray:
    """``words`` marked read-only, as the substream's bytes may be: the kernels then see one array
    type whatever the source (each type is a compilation of its own). A view of the substream may
    be unaligned; Numba's loads are the plain ones, which x86-64 and AArch64 allow there."""
    words.flags.writeable = False
    return words


class _Reader:
    def __init__(self, data: np.ndarray, where: str):
        self.data, self.pos, self.where = data, 0, where

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or self.pos + n > self.data.shape[0]:
            raise CorruptStreamError(f"{self.where}: the substream ends inside its {what}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what).tobytes(), "little")

    def tables(self, nseg: int, alphabet: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """(classes, PROB_BITS - precision, the rANS decoder's two lookup tables) of a substream:
        class count, precision, class nibbles and tables, validated. The lookup tables have a slot
        per unit of the precision the tables were sent at: a coarser table is smaller, and faster."""
        classes, precision, freq, start = self.frequencies(nseg, alphabet)
        lut_step = np.empty((freq.shape[0], 1 << precision), dtype=np.uint32)
        lut_sym = np.empty((freq.shape[0], 1 << precision), dtype=np.uint16)
        _k.build_lut(freq, start, PROB_BITS - precision, lut_step, lut_sym)
        return classes, PROB_BITS - precision, lut_step, lut_sym

    def frequencies(self, nseg: int, alphabet: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """(classes, precision, frequencies and starts at PROB_BITS) of a substream: class count,
        precision, class nibbles and tables, validated."""
        where = self.where
        klog, precision = (int(v) for v in self.take(2, "class count and table precision"))
        if klog > _k.MAX_CLASSES_LOG2:
            raise CorruptStreamError(f"{where}: {1 << klog} classes (at most {MAX_CLASSES})")
        if not 1 <= precision <= PROB_BITS:
            raise CorruptStreamError(f"{where}: tables of {precision}-bit precision (1 to {PROB_BITS})")
        if klog:
            packed = self.take(-(-nseg // 2), "classes")
            classes = np.empty(2 * packed.shape[0], dtype=np.uint8)
            classes[0::2] = packed & 15
            classes[1::2] = packed >> 4
            classes = classes[:nseg]
            if nseg and int(classes.max()) >= 1 << klog:
                raise CorruptStreamError(f"{where}: a segment of class {int(classes.max())} of {1 << klog}")
        else:
            classes = np.zeros(nseg, dtype=np.uint8)
        tables = self.take(self.u32("table size"), "tables")
        freq = np.zeros((1 << klog, alphabet), dtype=np.int32)
        start = np.zeros_like(freq)
        got = _k.read_tables(tables, precision, freq, start)
        if got < 0 or got != tables.shape[0]:
            raise CorruptStreamError(f"{where}: {_ERRORS.get(got, 'the frequency tables do not fill their bytes')}")
        return classes, precision, freq, start

    def coder(self, n: int, seg_len: int, alphabet: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
        """The classes, tables and rANS words of a substream of ``n`` elements (see :meth:`tables`),
        the words with one of padding."""
        classes, up, lut_step, lut_sym = self.tables(-(-n // seg_len), alphabet)
        return classes, up, lut_step, lut_sym, self.rans_words()

    def rans_words(self, padding: int = 1) -> np.ndarray:
        """A count, then that many u16 rANS words, with ``padding`` words after them. Where the
        substream goes on that far (the raw bits follow) the padding is its next bytes, and the
        words are read where they are: the kernels read a padding word only to drop it. Else a
        padded copy."""
        count = self.u32("coder size")
        if _LITTLE_ENDIAN and self.pos + 2 * (count + padding) <= self.data.shape[0]:
            words = self.data[self.pos:self.pos + 2 * (count + padding)].view("<u2")
            self.pos += 2 * count
            return _read_only(words)
        out = np.zeros(count + padding, dtype=np.uint16)
        out[:count] = self.take(2 * count, "coder words").view("<u2")
        return _read_only(out)

    def symbols(self, n: int, seg_len: int, alphabet: int) -> np.ndarray:
        """The ``n`` symbols of a substream: its classes, tables and rANS words read and decoded."""
        classes, up, lut_step, lut_sym, rans = self.coder(n, seg_len, alphabet)
        symbols = np.empty(n, dtype=np.uint16)
        self.check(_k.rans_decode(rans, seg_len, classes, up, lut_step, lut_sym, symbols))
        return symbols

    def check(self, status: int) -> None:
        if status != _k.OK:
            raise CorruptStreamError(f"{self.where}: {_ERRORS[status]}")

    def raw(self, words: int | None, padding: int = 1) -> np.ndarray:
        """The raw bits to the end: ``words`` of them exactly (None: any whole number), with
        ``padding`` words after them (none: the words where they are)."""
        rest = self.data.shape[0] - self.pos
        if words is None:
            if rest % 4:
                raise CorruptStreamError(f"{self.where}: raw bits of {rest} bytes, not whole words")
            words = rest // 4
        taken = self.take(4 * words, "raw bits").view("<u4")
        if self.pos != self.data.shape[0]:
            raise CorruptStreamError(f"{self.where}: {self.data.shape[0] - self.pos} bytes after the raw bits")
        if not padding and _LITTLE_ENDIAN:
            return _read_only(taken)
        raw = np.zeros(words + padding, dtype=np.uint32)
        raw[:words] = taken
        return _read_only(raw)


def decode_chunk(data, dtype_name: str, seg_len: int, out: np.ndarray, where: str = "substream",
                 revision: int = REVISIONS[-1]) -> None:
    """Decode a substream of :func:`encode_chunk` into ``out`` (the flat carrier of ``len(out)``
    elements: float16/32/64, or uint16 for bfloat16) of an entry of ``revision``. CorruptStreamError
    says what is wrong."""
    W, M = FORMATS[dtype_name]
    words = _words(out, dtype_name)
    n = words.shape[0]
    nseg = -(-n // seg_len)
    buf = _read_only(np.frombuffer(data, dtype=np.uint8))
    byte = int(buf[0]) if buf.shape[0] else -1
    if byte == HALVES_BYTE and revision & HALVES_REVISION:
        if W != 32:
            raise CorruptStreamError(f"{where}: low-bit mode 6 (bfloat16 values) in a {dtype_name} tensor, which only "
                                     f"float32 takes")
        inner = buf[1:]
        if inner.shape[0] and inner[0] == WIDE_BYTE and revision & WIDE_REVISION:
            # (mode 4's kernel stores each bfloat16 word widened into its float32's: no pass of its own)
            detail = np.zeros(2, dtype=np.int64)
            _check_substream(_w.decode_wide_substream(inner, n, seg_len, FORMATS["bfloat16"][1], words, detail, False),
                             detail, where, "bfloat16")
            return
        halves = np.empty(n, dtype=np.uint16)
        decode_chunk(inner, "bfloat16", seg_len, halves, where, revision)
        np.left_shift(halves, HALF_BITS, out=words, dtype=np.uint32)
        return
    # (the whole-substream kernels read the bytes as they are: a chunk of a small tensor cost
    # twice its kernel's time in Python before them)
    if whole_tans(byte, revision, W):
        detail = np.zeros(2, dtype=np.int64)
        _check_substream(_t.decode_tans_substream(buf, n, seg_len, W, M, words, detail), detail, where, dtype_name)
        return
    # (modes 4 and 5, most of a large model's elements, read their mode byte in the kernel)
    wide = byte == WIDE_BYTE and bool(revision & (WIDE32_REVISION if W == 32 else WIDE_REVISION))
    tz_wide = byte == TZ_WIDE_BYTE and bool(revision & TZ_WIDE_REVISION)
    if wide or tz_wide:
        if wide and W == 64:
            raise CorruptStreamError(f"{where}: low-bit mode 4 (64 rANS states) in a {dtype_name} tensor, which only "
                                     f"bf16, fp16 and fp32 take")
        if tz_wide and W != 32:
            raise CorruptStreamError(f"{where}: low-bit mode 5 (trailing zeros on 64 rANS states) in a {dtype_name} "
                                     f"tensor, which only float32 takes")
        detail = np.zeros(2, dtype=np.int64)
        _check_substream(_w.decode_wide_substream(buf, n, seg_len, M, words, detail, tz_wide), detail, where,
                         dtype_name)
        return
    r = _Reader(buf, where)
    r.take(1, "low-bit mode")  # (``byte``: an empty substream is refused here)
    if byte == TRAILING_MODE and revision & TRAILING_REVISION:
        _decode_trailing(r, W, M, n, seg_len, words)
        return
    if byte == TZ_BYTE and revision & TZ_REVISION and W != 32:
        raise CorruptStreamError(f"{where}: low-bit mode 3 (trailing zeros in the symbol) in a {dtype_name} tensor, "
                                 f"which only float32 takes")
    tans = bool(byte & TANS_FLAG) and bool(revision & (TZ_REVISION if byte == TZ_BYTE else TANS_REVISION))
    mode = byte & ~TANS_FLAG if tans else byte
    if mode not in ((0, 1, _t.TZ_MODE) if tans else (0, 1)):
        raise CorruptStreamError(f"{where}: a mode byte of {byte:#04x}, unknown to an entry of coder parameter "
                                 f"{revision} (low-bit mode {byte & ~TANS_FLAG}"
                                 f"{', symbols by tANS' if byte & TANS_FLAG else ''})")
    if tans:
        detail = np.zeros(2, dtype=np.int64)
        _check_substream(_t.decode_tans_substream(r.data, n, seg_len, W, M, words, detail), detail, where,
                         dtype_name)
        return
    if mode == 0:
        zeros = np.full(nseg, r.take(1, "low-bit count")[0], dtype=np.uint8)
    else:
        zeros = r.take(nseg, "low-bit counts")
    if nseg and int(zeros.max()) > M:
        raise CorruptStreamError(f"{where}: {_SUBSTREAM_ERRORS[_t.ERR_DROPS](0, 0, dtype_name)}")
    classes, up, lut_step, lut_sym, rans = r.coder(n, seg_len, _alphabet(W, M))
    raw = r.raw(-(-_k.raw_bit_count(n, seg_len, M, zeros) // 32), padding=0)
    r.check(_k.decode_floats(rans, raw, seg_len, W, M, zeros, classes, up, lut_step, lut_sym, words))


def whole_tans(byte: int, revision: int, W: int) -> bool:
    """Whether a substream of mode byte ``byte`` in an entry of ``revision`` (floats of ``W`` bits)
    is one :func:`decode_tans_chunks` decodes: low-bit mode 0, 1 or 3 by tANS."""
    return (byte in _TANS_BYTES and bool(revision & TANS_REVISION)
            or byte == TZ_BYTE and W == 32 and bool(revision & TZ_REVISION))


def decode_tans_chunks(data: np.ndarray, starts: np.ndarray, counts: np.ndarray, seg_lens: np.ndarray,
                       dtype_name: str, out: np.ndarray, where: Callable[[int], str]) -> None:
    """Decode many substreams of :func:`whole_tans` in one call: substream j is
    ``data[starts[j]:starts[j + 1]]`` (uint8), its ``counts[j]`` elements of segments of
    ``seg_lens[j]`` go to ``out`` (the flat carrier) after those of the ones before it. The small
    tensors of a model cost more in the Python around each call than in their kernels.
    CorruptStreamError names the first damaged one by ``where(j)``."""
    W, M = FORMATS[dtype_name]
    detail = np.zeros(3, dtype=np.int64)
    failed = _t.decode_tans_chunks(_read_only(data), starts, counts, seg_lens, W, M, _words(out, dtype_name), detail)
    if failed >= 0:
        _check_substream(int(detail[2]), detail, where(failed), dtype_name)


# What the whole-substream kernels' errors say (tANS and mode 4), worded from their two details: a
# function each, so that only the error found is worded (another's detail may be a count of bytes,
# not a shift)
_SUBSTREAM_ERRORS = {
    _t.ERR_SHORT: lambda a, b, dtype: f"the substream ends inside its {_t.TANS_FIELDS[a]}",
    _t.ERR_DROPS: lambda a, b, dtype: f"drops more low bits than a {dtype} mantissa has",
    _t.ERR_CLASS_COUNT: lambda a, b, dtype: f"{1 << a} classes (at most {MAX_CLASSES})",
    _t.ERR_PRECISION: lambda a, b, dtype: (f"tANS tables of {a}-bit precision "
                                           f"({_t.TANS_MIN_BITS} to {_t.TANS_MAX_BITS})"),
    _t.ERR_CLASS: lambda a, b, dtype: f"a segment of class {a} of {b}",
    _t.ERR_TABLE_BYTES: lambda a, b, dtype: "the frequency tables do not fill their bytes",
    _t.ERR_STATE: lambda a, b, dtype: f"an initial state of {a} in a table of {b}",
    _t.ERR_FIRST_BIT: lambda a, b, dtype: f"the first bit at {a} of a 32-bit word",
    _t.ERR_BEFORE_FIRST: lambda a, b, dtype: "bits set before the coder's first bit, or no word to hold it",
    _t.ERR_AFTER_RAW: lambda a, b, dtype: f"{a} bytes after the raw bits",
    _w.ERR_WIDE_PRECISION: lambda a, b, dtype: f"mode 4 tables of {a}-bit precision (1 to {_w.WIDE_MAX_BITS})",
    _w.ERR_WIDE_STATE: lambda a, b, dtype: f"an initial coder state of {a}, below {_w.WIDE_L}",
}


def _check_substream(status: int, detail: np.ndarray, where: str, dtype_name: str) -> None:
    """CorruptStreamError, saying what is wrong, unless a whole-substream kernel returned OK."""
    if status != _k.OK:
        word = _SUBSTREAM_ERRORS.get(status)
        raise CorruptStreamError(f"{where}: " + (word(int(detail[0]), int(detail[1]), dtype_name) if word
                                                 else _ERRORS[status]))


def _decode_trailing(r: _Reader, W: int, M: int, n: int, seg_len: int, words: np.ndarray) -> None:
    """The rest of a low-bit mode 2 substream (after its mode byte) into ``words``."""
    e_top = int.from_bytes(r.take(2, "top exponent").tobytes(), "little")
    if e_top >= 1 << (W - 1 - M):
        raise CorruptStreamError(f"{r.where}: top exponent {e_top} beyond the dtype's")
    classes, up, lut_step, lut_sym = r.tables(-(-n // seg_len), _alphabet(W, M))
    _, tz_up, tz_step, tz_sym = r.tables(0, M - _k.TOP_BITS + 1)
    shift = _k.MAX_CLASSES_LOG2 - (tz_step.shape[0].bit_length() - 1)
    rans = r.rans_words(padding=2)
    raw = r.raw(None, padding=3)
    r.check(_z.decode_trailing(rans, raw, seg_len, W, M, classes, up, lut_step, lut_sym, e_top, shift, tz_up, tz_step,
                               tz_sym, words))


# --- integers by magnitude class ----------------------------------------------------------------

#: signed integer dtypes the magnitude coder takes, by name: their width
INTEGER_WIDTHS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}


def mean_bit_length(values: np.ndarray, out: np.ndarray) -> None:
    """out[0] = the mean bit length of |v| over the flat signed integers ``values``."""
    _m.int_stats(values, max(values.shape[0], 1), out)


def encode_magnitudes(values: np.ndarray, seg_len: int) -> bytes:
    """The substream of the flat signed integers ``values`` by magnitude class: each one's bit
    length and the two bits below its leading one through the classes' rANS tables, its sign and
    the rest raw."""
    width = INTEGER_WIDTHS.get(values.dtype.name)
    if width is None or values.ndim != 1:
        raise ValueError(f"the magnitude coder takes flat {', '.join(INTEGER_WIDTHS)} arrays, not {values.dtype}")
    values = np.ascontiguousarray(values)
    n = values.shape[0]
    nseg = -(-n // seg_len)
    mean = np.empty(nseg, dtype=np.float64)
    _m.int_stats(values, seg_len, mean)
    classes16 = np.empty(nseg, dtype=np.uint8)
    _k.rank_classes(mean, classes16, seg_len, n)
    symbols = np.empty(n, dtype=np.uint16)
    raw = np.empty(2 * n + 2, dtype=np.uint32)
    nraw = _m.int_encode_kernel(values, symbols, raw)
    return _coded([], classes16, (width + 1) << _k.TOP_BITS, seg_len, symbols, raw, nraw)


def decode_magnitudes(data, seg_len: int, out: np.ndarray, where: str = "substream") -> None:
    """Decode a substream of :func:`encode_magnitudes` into the flat signed integers ``out``."""
    width = INTEGER_WIDTHS[out.dtype.name]
    n = out.shape[0]
    r = _Reader(np.frombuffer(data, dtype=np.uint8), where)
    symbols = r.symbols(n, seg_len, (width + 1) << _k.TOP_BITS)
    raw = r.raw(None)
    info = np.iinfo(out.dtype)
    r.check(_m.int_decode_kernel(raw, symbols, int(info.min), int(info.max), out))
