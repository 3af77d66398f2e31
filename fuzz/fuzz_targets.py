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
* ``ckpt_pt_pickle`` -- structure-aware ``.pt``: the input is the pickle (``data.pkl``) of a torch
                        archive whose other records (storages, version, byte order) are valid, so
                        mutations reach the weights-only unpickler and our flattening instead of
                        stopping at the zip framing.
* ``model_threads``  -- differential: a sealed stream decoded with 1 and with 2 threads must give the
                        same levels or the same error.
* ``matrix``         -- a sealed stream through ``matrix_formats.from_stream`` (CER and CSER); each
                        matrix must hold exactly the levels ``decode_levels`` gives.
* ``zarr``           -- the numcodecs codec's ``decode`` on the sealed input (an unpacked chunk
                        stream, as for ``model_sealed``) and on the raw bytes.
* ``info``           -- ``deepcabac info [--json] FILE`` through click's runner on the bytes as a file
                        (the header-only file reader, the report, the update-file dispatch): exit 0,
                        or exit 1 with one ``deepcabac: error:`` line; a traceback is a finding.
* ``session``        -- ``UpdateSession.from_snapshot`` (snapshots travel: catch-up, Flower; at most
                        64 MiB inflated), then the session decodes a fixed message of the ``BASE``
                        model. Seeds are real snapshots (zlib-compressed, so most mutations stop at
                        zlib's checksum; the arrays' values are checked by test_updates).
* ``encode``         -- the encoder: the input chooses a tensor (dtype, shape, raw values including
                        NaN/inf) and settings; the stream must be the same bytes with 1 and 2 threads
                        and decode to exactly ``quantize_model``'s levels.
* ``metadata``       -- the input is the metadata JSON of a sealed stream of one small tensor (nesting,
                        huge numbers, floods of containers, skeletons with odd nodes).
* ``header_sizes``   -- the input overwrites the size fields of a valid stream's header (the declared
                        body size, the tensor count, the metadata length) before it is resealed.
* ``update_sizes``   -- the input sets the payload length and the header size an update message
                        declares, read from a file object through ``iter_messages``.
* ``float_chunk``    -- the lossless float coder's ``decode_chunk`` and ``decode_magnitudes``: the input
                        is ``dtype:u8 count:u16 segment:u16`` and a substream (seeds: valid substreams
                        of each float and signed integer dtype); the output array is the count's, so
                        every allocation the payload can cause shows.
* ``output``         -- the input picks an output target (a new or existing file, a link, a directory,
                        a missing directory, a FIFO, a character device) and ``force``: ``write_atomic``
                        writes or raises OutputError/OutputExistsError, a device or FIFO stays one, a
                        refused file keeps its content, no temporary file is left.
"""

from __future__ import annotations

import os
import struct
import tempfile
import traceback
import warnings
import zlib

import numpy as np

import deepcabac_py as dc
from deepcabac_py.entropy import floatcoder
from deepcabac_py.errors import DeepCabacError, UpdateMismatchError
from deepcabac_py.io.files import load_checkpoint
from deepcabac_py.model.container import MAGIC, PREAMBLE, pack_header, read_header
from deepcabac_py.updates import message_format as upf
from deepcabac_py.updates import messages as up
from deepcabac_py.updates import sessions as ups


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
        return pack_header(header.qp, header.qp_1d, header.qp_density, header.metadata, header.tensors) + pay
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
        header = upf.read_update_header(bytes(buf[:end]), total_size=1 << 62)
    except DeepCabacError:
        return bytes(buf)
    p0, p1 = header.header_size, header.header_size + header.payload_size
    if p1 + 4 <= len(buf):
        struct.pack_into("<I", buf, p1, zlib.crc32(bytes(buf[p0:p1])))
    return bytes(buf)


# --------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------


# With NUMBA_DISABLE_JIT=1 the kernels run as (instrumented) Python at ~10-100 µs per element: inputs
# whose tensors hold more than this many elements are skipped, or libFuzzer's timeout would fire on
# honest, linear-time work. The compiled runs take every input.
SLOW_KERNEL_LIMIT = 20_000 if os.environ.get("NUMBA_DISABLE_JIT") == "1" else None


def _too_slow(stream: bytes) -> bool:
    if SLOW_KERNEL_LIMIT is None:
        return False
    try:
        header = dc.read_stream_header(stream)
    except DeepCabacError:
        return False
    return sum(e.numel for e in header.tensors if not e.is_alias) > SLOW_KERNEL_LIMIT


def target_model(data: bytes) -> None:
    _check(dc.read_stream_header, data)
    if _too_slow(data):
        return
    _check(dc.decode_model, data, threads=1)
    _check(dc.decode_levels, data, threads=1)


def target_model_sealed(data: bytes) -> None:
    target_model(seal_model_stream(data))


def _decode_update(data: bytes):
    header = upf.read_update_header(data)
    session = None
    if header.session_id:
        session = ups.UpdateSession(header.session_id)
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
    _check(upf.read_update_header, data)
    _check(_apply, data)
    _check(_iterate, data)


def target_update_sealed(data: bytes) -> None:
    target_update(seal_update_message(data))


def _outcome(fn, *args, **kwargs):
    """``("ok", result)`` or ``("error", type name, message)`` for a DeepCabacError; else Finding."""
    try:
        return ("ok", fn(*args, **kwargs))
    except DeepCabacError as exc:
        return ("error", type(exc).__name__, str(exc))
    except BaseException:  # noqa: BLE001 -- let _check describe it
        _check(fn, *args, **kwargs)
        raise


def _same_levels(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        x.dtype == y.dtype and x.step == y.step and x.levels.dtype == y.levels.dtype
        and np.array_equal(x.levels, y.levels) for x, y in zip(a.values(), b.values()))


def target_model_threads(data: bytes) -> None:
    stream = seal_model_stream(data)
    if _too_slow(stream):
        return
    one = _outcome(dc.decode_levels, stream, threads=1)
    two = _outcome(dc.decode_levels, stream, threads=2)
    if one[0] != two[0] or (one[0] == "error" and one != two) or (one[0] == "ok" and not _same_levels(one[1], two[1])):
        raise Finding(f"1 and 2 threads disagree: {str(one)[:200]} vs {str(two)[:200]}")


def target_matrix(data: bytes) -> None:
    from deepcabac_py.matrix.formats import from_stream, matrix_view

    stream = seal_model_stream(data)
    if _too_slow(stream):
        return
    levels = _outcome(dc.decode_levels, stream, threads=1)
    for fmt in ("cer", "cser"):
        mats = _outcome(from_stream, stream, fmt, threads=1)
        if mats[0] != levels[0]:
            raise Finding(f"from_stream({fmt}) and decode_levels disagree: {str(mats)[:200]} vs {str(levels)[:200]}")
        if mats[0] == "ok":
            for name, mat in mats[1].items():
                if not np.array_equal(mat.to_levels(), matrix_view(levels[1][name].levels)):
                    raise Finding(f"{fmt} matrix {name!r} does not hold the stream's levels")


def target_zarr(data: bytes) -> None:
    from deepcabac_py.integrations.zarr_codec import DeepCabac

    codec = DeepCabac()
    for stream in (data, seal_model_stream(data)):
        if not _too_slow(stream):
            _check(codec.decode, stream)


_ENCODE_DTYPES = ("float32", "float16", "float64", "int8", "int32", "uint8", "bool", "bfloat16")


def target_encode(data: bytes) -> None:
    """Layout of the input: dtype, ndim, quantizer, qp offset, flags, up to 4 dims, then the raw values."""
    import torch

    if len(data) < 5:
        return
    dtype = _ENCODE_DTYPES[data[0] % len(_ENCODE_DTYPES)]
    ndim = data[1] % 5
    quantizer = ("nearest", "rdoq", "trellis")[data[2] % 3]
    qp = -48 + data[3] % 40
    flags = data[4]
    dims = [1 + b % 24 for b in data[5:5 + ndim]]
    if len(dims) < ndim:
        return
    raw = data[5 + ndim:]
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    count = int(np.prod(dims)) if ndim else 1
    if SLOW_KERNEL_LIMIT is not None and count > SLOW_KERNEL_LIMIT // 4:
        return
    raw = (raw * (1 + (count * itemsize) // max(len(raw), 1)))[:count * itemsize] if raw else bytes(count * itemsize)
    if dtype == "bfloat16":
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(dims)
    elif dtype == "bool":
        tensor = (np.frombuffer(raw, dtype=np.uint8) & 1).astype(bool).reshape(dims)
    else:
        tensor = np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
    model = {"t": tensor, "u": tensor} if flags & 1 else {"t": tensor}
    settings = dict(qp=qp, quantizer=quantizer, keep_exact=bool(flags & 2), lambda_scale=(flags >> 2) % 4 * 0.5)
    with warnings.catch_warnings():  # "stored exactly (raw)" for NaN/inf input
        warnings.simplefilter("ignore")
        one = _outcome(dc.encode_model, model, threads=1, **settings)
        two = _outcome(dc.encode_model, model, threads=2, **settings)
    if one != two:
        raise Finding(f"encode differs between 1 and 2 threads: {str(one)[:200]} vs {str(two)[:200]}")
    if one[0] == "error":
        return
    decoded = _check(dc.decode_levels, one[1], threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _check(dc.quantize_model, model, **settings)
    if decoded is None or expected is None or not _same_levels(decoded, expected):
        raise Finding("the decoded levels differ from quantize_model's")


def _load(data: bytes, suffix: str):
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="dcfuzz-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with warnings.catch_warnings():  # torch warns about odd pickle protocols before refusing them
            warnings.simplefilter("ignore")
            return _check(load_checkpoint, path)
    finally:
        os.unlink(path)


def target_ckpt_safetensors(data: bytes) -> None:
    _load(data, ".safetensors")


def target_ckpt_npz(data: bytes) -> None:
    _load(data, ".npz")


def target_ckpt_pt(data: bytes) -> None:
    _load(data, ".pt")


def target_info(data: bytes) -> None:
    from click.testing import CliRunner

    from deepcabac_py.cli.main import main

    fd, path = tempfile.mkstemp(suffix=".dcb", prefix="dcfuzz-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        for args in (["info", path], ["info", "--json", path]):
            result = CliRunner().invoke(main, args)
            if result.exit_code == 1:
                lines = result.stderr.strip().splitlines()
                if len(lines) != 1 or not lines[0].startswith("deepcabac: error: "):
                    raise Finding(f"info exit 1 without a one-line error: {result.stderr[-500:]!r}")
            elif result.exit_code != 0 or (result.exception and not isinstance(result.exception, SystemExit)):
                exc = result.exception
                where = "".join(traceback.format_tb(exc.__traceback__, limit=-4)) if exc else ""
                raise Finding(f"info exit {result.exit_code}: {type(exc).__name__}: {exc}\n{where}")
    finally:
        os.unlink(path)


def _session_then_decode(data: bytes):
    session = ups.UpdateSession.from_snapshot(data, max_bytes=64 << 20)
    session.seq = 0  # the message below is its session's first
    return up.decode_update(_SESSION_MESSAGE, BASE, session=session, check_parent=False)


def target_session(data: bytes) -> None:
    _check(_session_then_decode, data)


def _torch_archive(pickle_bytes: bytes) -> bytes:
    """The template archive of ``ckpt_pt_pickle`` with ``pickle_bytes`` as its data.pkl."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_PT_TEMPLATE)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pickle_bytes if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def pt_template() -> bytes:
    """A torch archive with two storages (float32 of 6 and int64 of 3 elements) the pickles can use."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(3)}, buf)
    return buf.getvalue()


_PT_TEMPLATE = pt_template()


def target_ckpt_pt_pickle(data: bytes) -> None:
    _load(_torch_archive(data), ".pt")


def _session_message() -> bytes:
    rng = np.random.default_rng(1)
    new = {k: (v + (rng.standard_normal(v.shape) * 0.05).astype(v.dtype)) if v.dtype.kind == "f" else v + 1
           for k, v in BASE.items()}
    return up.encode_update(new, BASE, density=0.3, session=ups.UpdateSession(9))


_SESSION_MESSAGE = _session_message()


# --- sizes and metadata ------------------------------------------------------------------------

_META_LEVELS = np.arange(-8, 8, dtype=np.int32)


def _metadata_stream(metadata: bytes) -> bytes:
    from deepcabac_py.entropy.chunk_layout import layout_for_shape
    from deepcabac_py.entropy.levelcoder import encode_chunk
    from deepcabac_py.io.dtypes import DType
    from deepcabac_py.model.container import Coder, Mode, TensorEntry

    chunk = encode_chunk(_META_LEVELS, layout_for_shape((4, 4)), 0)
    layout = layout_for_shape((4, 4))
    entry = TensorEntry(name="w", dtype=DType.FLOAT32, shape=(4, 4), mode=Mode.UNIFORM, coder=Coder.ADAPTIVE_SCALE,
                        qp=-32, qp_density=2, coder_param=layout.coder_param, chunk_elements=layout.chunk_elements,
                        chunk_sizes=[len(chunk)], size=len(chunk), crc32=zlib.crc32(chunk))
    return pack_header(-32, -75, 2, metadata, [entry]) + chunk


def target_metadata(data: bytes) -> None:
    stream = _metadata_stream(bytes(data))
    _check(dc.read_stream_header, stream)
    _check(dc.decode_model, stream, threads=1)


def target_header_sizes(data: bytes) -> None:
    """Layout of the input: a u32 selector of which fields to set, the values (u32 each), then the
    unpacked stream (``model_sealed``'s form) they are written into."""
    if len(data) < 16 + _UNPACKED.size:
        return
    which, raw_size, count, meta_len = struct.unpack_from("<IIII", data)
    inner = bytearray(data[16:])
    version, body_len = _UNPACKED.unpack_from(inner)
    body = bytearray(inner[_UNPACKED.size:_UNPACKED.size + body_len])
    payload = bytes(inner[_UNPACKED.size + body_len:])
    if which & 2 and len(body) >= 4:
        struct.pack_into("<I", body, 0, count)
    if which & 4 and len(body) >= 14:
        struct.pack_into("<I", body, 10, meta_len)
    packed = struct.pack("<I", raw_size if which & 1 else len(body)) + zlib.compress(bytes(body), 1)
    head = PREAMBLE.pack(MAGIC, version, 0, len(packed) + 4) + packed
    stream = head + struct.pack("<I", zlib.crc32(head)) + payload
    _check(dc.read_stream_header, stream)
    if not _too_slow(stream):
        _check(dc.decode_model, stream, threads=1)


def _uvarint(x: int) -> bytes:
    out = bytearray()
    while True:
        out.append((x & 0x7F) | (0x80 if x >> 7 else 0))
        x >>= 7
        if not x:
            return bytes(out)


def target_update_sizes(data: bytes) -> None:
    """Layout of the input: the payload length to declare (u64), a change of the header size (i16),
    then a valid message whose header is rewritten with them and resealed."""
    import io

    if len(data) < 10 + PREAMBLE.size:
        return
    claim, delta = struct.unpack_from("<Qh", data)
    msg = bytes(data[10:])
    try:
        header = upf.read_update_header(msg)
    except DeepCabacError:
        return
    body = msg[PREAMBLE.size:header.header_size]
    start = len(body) - 1  # the body's last field: the payload length, a LEB128 varint
    while start > 0 and body[start - 1] & 0x80:
        start -= 1
    body = body[:start] + _uvarint(claim)
    size = max(4, len(body) + 4 + delta)
    head = msg[:8] + msg[8:12] + struct.pack("<I", size) + body
    head += struct.pack("<I", zlib.crc32(head))
    stream = head + msg[header.header_size + 4:]
    _check(lambda: sum(1 for _ in up.iter_messages(io.BytesIO(stream))))


_KINDS = ("new", "file", "link", "dangling", "dir", "missing-dir", "fifo", "device")


def target_output(data: bytes) -> None:
    import stat
    import threading

    from deepcabac_py.errors import OutputError, OutputExistsError
    from deepcabac_py.io.atomic import write_atomic

    if not data:
        return
    kind, force, content = _KINDS[data[0] % len(_KINDS)], bool(data[0] & 0x80), bytes(data[1:])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out")
        before = b"old content"
        reader = None
        if kind in ("file", "link"):
            with open(os.path.join(tmp, "target"), "wb") as f:
                f.write(before)
            if kind == "file":
                os.rename(os.path.join(tmp, "target"), path)
            else:
                os.symlink(os.path.join(tmp, "target"), path)
        elif kind == "dangling":
            os.symlink(os.path.join(tmp, "nowhere"), path)
        elif kind == "dir":
            os.mkdir(path)
        elif kind == "missing-dir":
            path = os.path.join(tmp, "missing", "out")
        elif kind == "fifo":
            os.mkfifo(path)
            got: list = []
            reader = threading.Thread(target=lambda: got.append(open(path, "rb").read()), daemon=True)
            reader.start()
        elif kind == "device":
            try:
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            except PermissionError:
                return
        try:
            write_atomic(path, content, force=force)
            written = True
        except (OutputError, OutputExistsError):
            written = False
        except BaseException as exc:
            raise Finding(f"write_atomic onto a {kind} raised {type(exc).__name__}: {exc}") from exc
        finally:
            if reader is not None:
                reader.join(10)
        if kind == "fifo" and not (stat.S_ISFIFO(os.lstat(path).st_mode) and written and got == [content]):
            raise Finding("a FIFO target was replaced, or did not get the bytes")
        if kind == "device" and not (stat.S_ISCHR(os.lstat(path).st_mode) and written):
            raise Finding("a device target was replaced")
        if kind in ("file", "link") and not written:
            with open(path, "rb") as f:
                if f.read() != before:
                    raise Finding("a refused write changed the file")
        leftovers = [n for n in os.listdir(tmp) if n.endswith(".tmp")]
        if leftovers:
            raise Finding(f"temporary files left behind: {leftovers}")


_FLOAT_CARRIERS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}
FLOAT_DTYPES = sorted(_FLOAT_CARRIERS) + sorted(floatcoder.INTEGER_WIDTHS)  # (codes 0-3: floats, 4-7: by magnitude)


def target_float_chunk(data: bytes) -> None:
    if len(data) < 5:
        return
    dtype = FLOAT_DTYPES[data[0] % len(FLOAT_DTYPES)]
    count, segment = struct.unpack_from("<HH", data, 1)
    if dtype in floatcoder.INTEGER_WIDTHS:
        _check(floatcoder.decode_magnitudes, data[5:], max(segment, 1), np.empty(count, dtype=dtype))
        return
    out = np.empty(count, dtype=_FLOAT_CARRIERS[dtype])
    _check(floatcoder.decode_chunk, data[5:], dtype, max(segment, 1), out)


TARGETS = {
    "model": target_model,
    "model_sealed": target_model_sealed,
    "update": target_update,
    "update_sealed": target_update_sealed,
    "ckpt_safetensors": target_ckpt_safetensors,
    "ckpt_npz": target_ckpt_npz,
    "ckpt_pt": target_ckpt_pt,
    "ckpt_pt_pickle": target_ckpt_pt_pickle,
    "model_threads": target_model_threads,
    "matrix": target_matrix,
    "zarr": target_zarr,
    "encode": target_encode,
    "info": target_info,
    "session": target_session,
    "metadata": target_metadata,
    "header_sizes": target_header_sizes,
    "update_sizes": target_update_sizes,
    "output": target_output,
    "float_chunk": target_float_chunk,
}
