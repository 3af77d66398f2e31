"""What several test files share: a guard against hangs, the exact random arrays of the golden
streams, and the means to craft and damage model streams behind valid checksums."""

from __future__ import annotations

import contextlib
import signal
import struct
import zlib

import numpy as np
from numba.core.event import Listener, install_listener

import deepcabac_py as dc
from deepcabac_py.entropy.chunk_layout import DEFAULT_K_OFFSET
from deepcabac_py.errors import DeepCabacError
from deepcabac_py.io.checkpoint import flatten, tensor_to_numpy
from deepcabac_py.model.container import (
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE,
    Coder,
    DType,
    Mode,
    TensorEntry,
    pack_header,
    read_header,
)
from deepcabac_py.model.decoder import read_stream_header
from deepcabac_py.quant.steps import step_from_qp
from deepcabac_py.series.records import SeriesFile

# --- guards ----------------------------------------------------------------------------------------


class _CompileTimeOff(Listener):
    """Stops the hang clock while Numba holds its compiler lock: compiling a kernel on a cold cache is
    not a hang, and on a slow machine it alone can outlast the budget (a CI run once failed so)."""

    def __init__(self) -> None:
        self.depth = 0
        self.left = 0.0

    def on_start(self, event) -> None:
        if self.depth == 0:
            self.left = signal.setitimer(signal.ITIMER_REAL, 0)[0]
        self.depth += 1

    def on_end(self, event) -> None:
        self.depth -= 1
        if self.depth == 0 and self.left > 0:
            signal.setitimer(signal.ITIMER_REAL, self.left)


@contextlib.contextmanager
def no_hang(seconds: float = 60):
    """Fail instead of hanging forever: the block gets `seconds` of running time, compilation aside."""
    def boom(signum, frame):
        raise TimeoutError(f"did not terminate within {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    paused = _CompileTimeOff()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with install_listener("numba:compiler_lock", paused):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --- inputs: the golden streams' (exact in every float dtype), weights like trained ones -----------


def golden_ints(seed: int, shape, low: int, high: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(low, high, size=shape).astype(np.int64)


def golden_floats(seed: int, shape, scale_log2: int) -> np.ndarray:
    """Roughly bell-shaped values (a sum of three uniform integers), exact multiples of 2**-k."""
    x = golden_ints(seed, (3,) + tuple(shape), -1000, 1001).sum(axis=0)
    return np.ldexp(x.astype(np.float64), scale_log2 - 10)


def laplace_weights(seed: int, shape, scale: float = 0.05, sparse: float = 0.0) -> np.ndarray:
    """float32 weights with a Laplace distribution (as trained weights have), a share of them zero."""
    rng = np.random.default_rng(seed)
    w = (rng.laplace(size=shape) * scale).astype(np.float32)
    if sparse:
        w[rng.random(shape) < sparse] = 0.0
    return w


# --- model streams crafted or damaged behind valid checksums ---------------------------------------

# The header body (settings, metadata, tensor table) is stored deflated after its raw size:
#   preamble(16) raw_size:u32 deflate(body) crc:u32
# Offsets into the *raw* body:
BODY_COUNT = 0  # tensor_count:u32, then qp, qp_1d (i16), qp_density, reserved (u8)
BODY_META_LEN = 10  # u32, then the metadata JSON


def series_header(path, index: int):
    """The stream header of entry ``index`` of the checkpoint series at ``path``."""
    with SeriesFile(path) as f:
        return read_stream_header(f.payload(f.records[index]))


def coded_steps(path, index: int) -> dict[str, float]:
    """The step each quantized tensor of series entry ``index`` was coded at, by its name."""
    return {e.name: step_from_qp(e.qp, e.qp_density) for e in series_header(path, index).tensors
            if e.mode.is_quantized}


def fingerprint(obj):
    """Skeleton plus the exact bits of every tensor: equal fingerprints = identical decodes."""
    ckpt = flatten(obj)
    tensors = {}
    for name, t in ckpt.tensors.items():
        arr, dtype, is_torch = tensor_to_numpy(t)
        tensors[name] = (dtype, is_torch, arr.shape, arr.tobytes())
    return ckpt.skeleton, tensors, ckpt.aliases


def decode_outcome(data):
    """The decoded object's fingerprint, or the DeepCabacError raised; anything else propagates."""
    try:
        return fingerprint(dc.decode_model(data, threads=1))
    except DeepCabacError as exc:
        return exc


def fix_checksums(data: bytes) -> bytes:
    """Recompute every payload CRC (and so the header CRC) so that damage reaches the level decoder."""
    header = read_header(memoryview(data), total_size=len(data))
    payload = data[header.header_size:]
    for e in header.tensors:
        if not e.is_alias:
            e.crc32 = zlib.crc32(payload[e.offset:e.offset + e.size])
    return pack_header(header.qp, header.qp_1d, header.qp_density, header.metadata, header.tensors) + payload


def reseal_header(data: bytearray) -> bytes:
    """Recompute the header CRC after editing header bytes in place."""
    (header_size,) = struct.unpack_from("<I", data, 12)
    end = PREAMBLE.size + header_size
    struct.pack_into("<I", data, end - 4, zlib.crc32(bytes(data[:end - 4])))
    return bytes(data)


def header_body(data: bytes) -> bytes:
    (header_size,) = struct.unpack_from("<I", data, 12)
    return zlib.decompress(data[PREAMBLE.size + 4:PREAMBLE.size + header_size - 4])


def edit_header_body(data: bytes, edit) -> bytes:
    """Inflate the header body, let ``edit`` change it (a bytearray), deflate it and reseal the CRC."""
    (header_size,) = struct.unpack_from("<I", data, 12)
    body = bytearray(header_body(data))
    edit(body)
    packed = struct.pack("<I", len(body)) + zlib.compress(bytes(body), 9)
    head = PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(packed) + 4) + packed
    return head + struct.pack("<I", zlib.crc32(head)) + data[PREAMBLE.size + header_size:]


def first_entry_offset(body: bytes) -> int:
    """Offset of the first tensor entry (its name length) in a raw header body."""
    (meta_len,) = struct.unpack_from("<I", body, BODY_META_LEN)
    return BODY_META_LEN + 4 + meta_len


def craft(entries: list[TensorEntry], payload: bytes, metadata=None) -> bytes:
    for e in entries:
        if not e.is_alias:
            e.crc32 = zlib.crc32(payload[e.offset:e.offset + e.size])
    return pack_header(-32, -75, 2, {"kind": "mapping"} if metadata is None else metadata, entries) + payload


def uniform(name="w", shape=(4, 4), *, chunk_elements=None, chunk_sizes=(10,), offset=0, size=None, **kw):
    numel = int(np.prod(shape, dtype=object))
    sizes = list(chunk_sizes)
    return TensorEntry(name=name, dtype=kw.pop("dtype", DType.FLOAT32), shape=tuple(shape),
                       mode=kw.pop("mode", Mode.UNIFORM), coder=kw.pop("coder", Coder.ADAPTIVE_SCALE),
                       qp=kw.pop("qp", -32), qp_density=kw.pop("qp_density", 2),
                       coder_param=kw.pop("coder_param", DEFAULT_K_OFFSET),
                       chunk_elements=chunk_elements or max(numel, 1), chunk_sizes=sizes, offset=offset,
                       size=sum(sizes) if size is None else size, **kw)
