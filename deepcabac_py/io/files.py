"""Checkpoint files: PyTorch pickles (weights-only), safetensors and numpy ``.npz``, read into and
written from a :class:`~deepcabac_py.io.checkpoint.Checkpoint`.

Every problem with a file's content raises :class:`CheckpointError`; a file that cannot be opened at
all raises :class:`InputError`. Writers produce their bytes into a file object handed to them by
:func:`~deepcabac_py.io.atomic.write_atomic`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from tokenize import TokenError
from typing import TYPE_CHECKING, Any, Union, cast

import numpy as np

from ..errors import CheckpointError, PickleRefusedError
from .atomic import write_atomic
from .checkpoint import (
    Checkpoint,
    RawTensor,
    TensorLike,
    dtype_name_of,
    flatten,
    is_plain,
    numpy_to_tensor,
    plain_skeleton,
    skeleton_refs,
    tensor_to_numpy,
    unflatten,
)
from .dtypes import DTYPE_NAMES, carrier
from .inputs import check_readable_file, unreadable
from .kinds import (
    HEAD_BYTES,
    KINDS,
    MAX_SAFETENSORS_HEADER_BYTES,
    check_kind,
    kind_from_suffix,
    read_head,
    sniff_kind,
    what_it_is,
)
from .lazy_torch import is_torch_tensor, torch_module
from .shapes import shape_problem

if TYPE_CHECKING:
    import torch

__all__ = ["KINDS", "load_checkpoint", "load_safetensors", "save_checkpoint", "checkpoint_writer", "kind_from_suffix"]

PathLike = Union[str, "os.PathLike[str]"]

SKELETON_FORMAT = "deepcabac.skeleton"
SKELETON_VERSION = 1

#: safetensors ``__metadata__`` keys (and npz member names) reserved for this library.
ST_SKELETON_KEY = "deepcabac.skeleton"
ST_ALIASES_KEY = "deepcabac.aliases"
NPZ_SKELETON_KEY = "__deepcabac_skeleton__"
NPZ_ALIASES_KEY = "__deepcabac_aliases__"
NPZ_METADATA_KEY = "__deepcabac_metadata__"
_NPZ_RESERVED = (NPZ_SKELETON_KEY, NPZ_ALIASES_KEY, NPZ_METADATA_KEY)

# safetensors code -> (torch dtype name, itemsize, numpy little-endian dtype used to read the raw
# bytes); the float8 types are read and written but not coded (no library dtype name)
_ST_DTYPES: dict[str, tuple[str, int, str]] = {
    "F64": ("float64", 8, "<f8"),
    "F32": ("float32", 4, "<f4"),
    "F16": ("float16", 2, "<f2"),
    "BF16": ("bfloat16", 2, "<u2"),
    "I64": ("int64", 8, "<i8"),
    "I32": ("int32", 4, "<i4"),
    "I16": ("int16", 2, "<i2"),
    "I8": ("int8", 1, "i1"),
    "U64": ("uint64", 8, "<u8"),
    "U32": ("uint32", 4, "<u4"),
    "U16": ("uint16", 2, "<u2"),
    "U8": ("uint8", 1, "u1"),
    "BOOL": ("bool", 1, "u1"),
    "C64": ("complex64", 8, "<c8"),
    "F8_E4M3": ("float8_e4m3fn", 1, "u1"),
    "F8_E5M2": ("float8_e5m2", 1, "u1"),
}
_ST_CODE_BY_NAME = {v[0]: k for k, v in _ST_DTYPES.items()}
# torch dtypes read/written through an integer view of their bits (numpy has no such type)
_BIT_VIEW = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def load_checkpoint(path: PathLike, kind: str | None = None, *, max_bytes: int | None = None) -> Checkpoint:
    """Load a checkpoint file: torch (weights-only), safetensors or ``.npz`` (without pickle).

    Parameters
    ----------
    path : str or PathLike
        The file.
    kind : {"torch", "safetensors", "npz"} or None
        None: from the suffix (``.pt``, ``.pth``, ``.bin``, ``.ckpt`` are torch), else sniffed from
        the content.
    max_bytes : int or None
        Zip-based files (``.npz`` and torch's own format) may not expand to more than this many
        bytes of uncompressed members. The default, ``64 MiB + 100 x the file size``, refuses zip
        bombs while no checkpoint of real weights comes near it (weights hardly compress). Formats
        without compression are bounded by the file size itself.

    Returns
    -------
    Checkpoint
        The tensors and the structure around them.

    Raises
    ------
    InputError
        The file cannot be read.
    CheckpointError
        Its content is not a checkpoint this library reads (with a one-line reason).
    """
    check_kind(kind)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int or None, not {max_bytes!r}")
    path = os.fspath(path)
    check_readable_file(path)
    if kind is None:
        kind = kind_from_suffix(path) or sniff_kind(path)
    if kind == "torch":
        return _load_torch(path, max_bytes)
    if kind == "safetensors":
        return load_safetensors(path)[0]
    return _load_npz(path, max_bytes)


ZIP_EXPANSION = 100
ZIP_SLACK = 64 << 20


def _check_zip_sizes(path: str, zf: zipfile.ZipFile, max_bytes: int | None) -> None:
    """Refuse, before anything is extracted, members that reach past the end of the file and archives
    that would expand beyond ``max_bytes`` (see :func:`load_checkpoint`). Readers allocate what a
    member's directory entry declares, so these numbers are what bounds their memory."""
    try:
        file_size = os.path.getsize(path)
    except OSError as exc:
        raise unreadable(path, exc) from None
    total = 0
    for info in zf.infolist():
        name = f"{info.filename!r:.80}"
        if info.header_offset + info.compress_size > file_size:
            raise CheckpointError(f"{path}: zip member {name} claims {info.compress_size:,} bytes that "
                                  f"reach past the end of the {file_size:,}-byte file")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise CheckpointError(f"{path}: stored zip member {name} declares {info.file_size:,} bytes but "
                                  f"holds {info.compress_size:,}")
        total += info.file_size
    if total > _expansion_limit(file_size, max_bytes):
        raise CheckpointError(f"{path}: the {file_size:,}-byte archive expands to {total:,} bytes "
                              f"({_expansion_why(max_bytes)})")


def _expansion_limit(file_size: int, max_bytes: int | None) -> int:
    """What a file of ``file_size`` bytes may expand to in memory (see :func:`load_checkpoint`)."""
    return ZIP_SLACK + ZIP_EXPANSION * file_size if max_bytes is None else max_bytes


def _expansion_why(max_bytes: int | None) -> str:
    return (f"more than {ZIP_EXPANSION}x its size: a zip bomb? pass a larger max_bytes to load it anyway"
            if max_bytes is None else f"more than max_bytes={max_bytes:,}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _load_torch(path: str, max_bytes: int | None = None) -> Checkpoint:
    head = read_head(path)
    if head[:4] != b"PK\x03\x04" and head[:1] != b"\x80":  # neither torch's zip nor its legacy pickle
        raise CheckpointError(f"{path} is not a torch checkpoint: it is {what_it_is(head)}")
    try:
        with zipfile.ZipFile(path) as zf:
            _check_zip_sizes(path, zf, max_bytes)
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError, ValueError, EOFError):
        # Not a zip (torch's legacy pickle format), or a damaged one: torch's reader says what it finds.
        # (zipfile.is_zipfile is no shortcut: it raises BadZipFile itself for some damaged archives.)
        pass
    except OSError as exc:
        raise unreadable(path, exc) from None
    try:
        obj = torch_module().load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = _first_line(exc)
        marker = "WeightsUnpickler error:"
        if marker in text:
            reason = text.split(marker, 1)[1].strip().splitlines()[0]
            reason = reason.split(". Please", 1)[0].strip()
            raise PickleRefusedError(
                f"refused to load {path}: the pickle needs code or objects that weights-only loading "
                f"does not allow ({reason})"
            ) from None
        raise CheckpointError(f"cannot load {path} as a torch checkpoint: {reason}") from None
    except OSError as exc:
        raise unreadable(path, exc) from None
    except Exception as exc:  # torch raises many types (RuntimeError, EOFError, ValueError, ...)
        raise CheckpointError(f"cannot load {path} as a torch checkpoint: {_first_line(exc)}") from None
    try:
        ckpt = flatten(obj)
    except TypeError as exc:
        raise CheckpointError(f"cannot use {path}: {exc}") from None
    materialised = 0
    torch = torch_module()
    for name, t in ckpt.tensors.items():
        if isinstance(t, torch.Tensor) and (
            t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta"
        ):
            raise CheckpointError(f"{path}: tensor {name!r} has an unsupported layout ({t.layout})")
        problem = shape_problem(tuple(t.shape))
        if problem is not None:
            raise CheckpointError(f"{path}: tensor {name!r:.80} has {problem}")
        # A view may be far larger than its storage (``expand``: stride 0): what bounds memory is
        # what every tensor will be once made contiguous, not the bytes of the file.
        materialised += math.prod(t.shape) * (t.element_size() if is_torch_tensor(t) else _itemsize(t))
    file_size = os.path.getsize(path)
    if materialised > _expansion_limit(file_size, max_bytes):
        raise CheckpointError(f"{path}: the {file_size:,}-byte file holds tensors of {materialised:,} bytes "
                              f"({_expansion_why(max_bytes)})")
    ckpt.kind = "torch"
    return ckpt


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.80}")
        out[k] = v
    return out


def _parse_json(text: str, what: str, path: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: invalid {what} JSON ({_first_line(exc)})") from None


def _is_nonneg_int(x: Any) -> bool:
    return type(x) is int and x >= 0


@dataclass(frozen=True)
class SafetensorsIndex:
    """A safetensors file's header, validated: where each tensor's bytes are, nothing read yet."""

    path: str
    entries: list[tuple[str, str, list[int], int, int]]  # (name, dtype code, shape, begin, end), header order
    metadata: dict[str, str] | None  # ``__metadata__`` as stored (reserved keys included)
    data_start: int
    header_text: str = ""  # the JSON header as the file spells it (padding included)

    def read_tensor(self, f, i: int) -> torch.Tensor:
        """Tensor ``i`` of :attr:`entries`, read from the open file ``f``."""
        return _torch_of(self.read_raw(f, i))

    def read_raw(self, f, i: int) -> RawTensor:
        """Tensor ``i`` of :attr:`entries` as its bits, read from the open file ``f`` (no torch)."""
        name, code, shape, begin, end = self.entries[i]
        return _read_st_raw(f, self.data_start + begin, end - begin, code, shape, self.bad, name)

    def bad(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: invalid safetensors file: {msg}")


def read_safetensors_index(f, path: str) -> SafetensorsIndex:
    """The validated header of the safetensors file open as ``f`` (every offset inside the file,
    no overlaps, sizes that match the shapes)."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: invalid safetensors file: {msg}")

    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise bad(f"file is only {size} bytes long")
    f.seek(0)
    head = f.read(HEAD_BYTES)
    if len(head) > 8 and head[8:9] != b"{":  # (shorter files get the reader's own reason below)
        raise CheckpointError(f"{path} is not a safetensors file: it is {what_it_is(head)}")
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    if n > size - 8:
        raise bad(f"header length {n} exceeds the file size ({size} bytes)")
    if n > MAX_SAFETENSORS_HEADER_BYTES:
        raise bad(f"header length {n} exceeds the {MAX_SAFETENSORS_HEADER_BYTES}-byte limit")
    if n < 2:
        raise bad(f"header length {n} is too small")
    raw = f.read(n)
    if len(raw) != n:
        raise bad("file truncated inside the header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("header is not UTF-8") from None
    header = _parse_json(text, "safetensors header", path)
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_start = 8 + n
    data_len = size - data_start

    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise bad("__metadata__ must map strings to strings")

    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"entry {name!r:.80} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(code, str) or code not in _ST_DTYPES:
            raise bad(f"tensor {name!r:.80} has unknown dtype {code!r:.40}")
        if not isinstance(shape, list) or not all(_is_nonneg_int(d) and d < 2**63 for d in shape):
            raise bad(f"tensor {name!r:.80} has an invalid shape {shape!r:.80}")
        problem = shape_problem(tuple(shape))
        if problem is not None:
            raise bad(f"tensor {name!r:.80} has {problem}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_nonneg_int(o) for o in offsets)):
            raise bad(f"tensor {name!r:.80} has invalid data_offsets {offsets!r:.80}")
        begin, end = offsets
        if begin > end or end > data_len:
            raise bad(f"tensor {name!r:.80} data_offsets [{begin}, {end}] are outside the "
                      f"{data_len}-byte data section")
        numel = math.prod(shape)
        itemsize = _ST_DTYPES[code][1]
        if numel * itemsize != end - begin:
            raise bad(f"tensor {name!r:.80}: shape {shape} x {code} needs {numel * itemsize} bytes "
                      f"but data_offsets span {end - begin}")
        entries.append((name, code, shape, begin, end))

    spans = sorted((b, e, nm) for nm, _, _, b, e in entries if e > b)
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise bad(f"tensors {n0!r:.80} and {n1!r:.80} overlap")
    return SafetensorsIndex(path, entries, metadata, data_start, text)


def safetensors_dtype(code: str) -> tuple[str, int]:
    """(this library's dtype name, item size) of a safetensors dtype code."""
    name, itemsize, _ = _ST_DTYPES[code]
    return name, itemsize


def load_safetensors(path: str) -> tuple[Checkpoint, str]:
    """A safetensors file's checkpoint (as :func:`load_checkpoint` gives it) and its JSON header as
    the file spells it, read once."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise unreadable(path, exc) from None
    with f:
        try:
            index = read_safetensors_index(f, path)
            tensors: dict[str, Any] = {}
            for i, entry in enumerate(index.entries):
                tensors[entry[0]] = index.read_tensor(f, i)
        except OSError as exc:
            raise unreadable(path, exc) from None
    return _finish_safetensors(path, tensors, index.metadata), index.header_text


def _finish_safetensors(path: str, tensors: dict[str, Any], metadata: dict[str, str] | None) -> Checkpoint:
    """The checkpoint of a safetensors file: the skeleton and aliases this library stores in its
    ``__metadata__`` taken out and applied."""
    metadata = dict(metadata) if metadata is not None else None
    skeleton_json = aliases_json = None
    if metadata is not None:
        skeleton_json = metadata.pop(ST_SKELETON_KEY, None)
        aliases_json = metadata.pop(ST_ALIASES_KEY, None)
        if not metadata and (skeleton_json is not None or aliases_json is not None):
            metadata = None
    return _finish_loaded(path, "safetensors", tensors, skeleton_json, aliases_json, metadata)


def _read_st_raw(f, offset: int, nbytes: int, code: str, shape: list[int],
                 bad: Callable[[str], CheckpointError], name: str) -> RawTensor:
    dtype_name, _, np_code = _ST_DTYPES[code]
    # (this library's carrier; the float8 types, which it does not code, as uint8)
    native = carrier(dtype_name) if dtype_name in DTYPE_NAMES else np.dtype(np.uint8)
    if nbytes == 0:
        try:
            return RawTensor(np.empty(shape, dtype=native), dtype_name)
        except (ValueError, OverflowError, MemoryError):
            raise bad(f"tensor {name!r:.80} has an invalid shape {shape}") from None
    buf = bytearray(nbytes)
    f.seek(offset)
    if f.readinto(buf) != nbytes:
        raise bad(f"file truncated inside tensor {name!r:.80}")
    arr = np.frombuffer(buf, dtype=np.dtype(np_code))
    if code == "BOOL":
        if arr.max() > 1:
            raise bad(f"bool tensor {name!r:.80} holds values other than 0 and 1")
        arr = arr.view(np.bool_)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return RawTensor(arr.reshape(shape), dtype_name)


def _torch_of(raw: RawTensor) -> torch.Tensor:
    """The torch tensor of a :class:`RawTensor` (sharing its memory)."""
    if raw.dtype_name in DTYPE_NAMES:
        return cast("torch.Tensor", numpy_to_tensor(raw.bits, raw.dtype_name, True))
    torch = torch_module()  # (a float8 type: its uint8 bits viewed as it)
    return torch.from_numpy(raw.bits).view(getattr(torch, raw.dtype_name))


def _itemsize(t: np.ndarray | RawTensor) -> int:
    return t.bits.itemsize if isinstance(t, RawTensor) else t.itemsize


def _raw_equal(a: TensorLike, b: TensorLike) -> bool:
    if isinstance(a, RawTensor) or isinstance(b, RawTensor):
        return (isinstance(a, RawTensor) and isinstance(b, RawTensor) and a.dtype_name == b.dtype_name
                and a.shape == b.shape and a.bits.tobytes() == b.bits.tobytes())
    if is_torch_tensor(a) != is_torch_tensor(b):
        return False
    if is_torch_tensor(a) and is_torch_tensor(b):
        torch = torch_module()
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.numel() == 0:
            return True
        return bool(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _finish_loaded(path: str, kind: str, tensors: dict[str, Any], skeleton_json: str | None,
                   aliases_json: str | None, metadata: dict[str, str] | None) -> Checkpoint:
    """Restore aliases and the skeleton stored by :func:`save_checkpoint` (safetensors / npz)."""
    header_order = list(tensors)
    aliases: dict[str, str] = {}
    if aliases_json is not None:
        parsed = _parse_json(aliases_json, "alias table", path)
        if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
            raise CheckpointError(f"{path}: the alias table must map tensor names to tensor names")
        for name, target in parsed.items():
            if name == target or name not in tensors or target not in tensors or target in parsed:
                raise CheckpointError(f"{path}: invalid alias {name!r:.80} -> {target!r:.80}")
        for name, target in parsed.items():
            if _raw_equal(tensors[name], tensors[target]):  # a tie whose copies differ is not restored
                aliases[name] = target
                del tensors[name]
    if skeleton_json is not None:
        skeleton = _parse_json(skeleton_json, "skeleton", path)
    else:
        skeleton = plain_skeleton(header_order)
    ckpt = Checkpoint(tensors=tensors, skeleton=skeleton, kind=kind, metadata=metadata, aliases=aliases)
    if skeleton_json is not None:
        try:
            unflatten(ckpt)  # full validation of the stored skeleton
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        refs: list[str] = []
        skeleton_refs(skeleton["root"], refs)
        missing = set(tensors) - set(refs)
        if missing:
            raise CheckpointError(
                f"{path}: the stored skeleton does not refer to tensor {sorted(missing)[0]!r:.80}"
            )
    return ckpt


def _npy_header(m) -> tuple[tuple, bool, np.dtype] | None:
    fmt = np.lib.format
    version = fmt.read_magic(m)
    if version == (1, 0):
        return fmt.read_array_header_1_0(m)
    if version == (2, 0):
        return fmt.read_array_header_2_0(m)
    return None  # version 3.0: left to np.load


def _load_npz(path: str, max_bytes: int | None = None) -> Checkpoint:
    head = read_head(path)
    if head[:4] != b"PK\x03\x04" and len(head) >= 4:
        raise CheckpointError(f"{path} is not an npz file: it is {what_it_is(head)}")
    # Pre-flight with zipfile: refuse object arrays and sizes that disagree with the member sizes before
    # numpy allocates anything.
    try:
        with zipfile.ZipFile(path) as zf:
            _check_zip_sizes(path, zf, max_bytes)
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                key = info.filename[:-4]
                with zf.open(info) as m:
                    try:
                        hdr = _npy_header(m)
                    except (ValueError, EOFError, SyntaxError, TokenError) as exc:
                        # numpy tokenizes the header dict: an unbalanced one raises tokenize.TokenError
                        raise CheckpointError(f"{path}: array {key!r:.80} has an invalid header "
                                              f"({_first_line(exc)})") from None
                    if hdr is None:
                        continue
                    shape, _fortran, dtype = hdr
                    if dtype.hasobject:
                        raise CheckpointError(f"{path}: array {key!r:.80} is an object array; refused "
                                              f"(it would need pickle)")
                    need = math.prod(shape) * dtype.itemsize
                    have = info.file_size - m.tell()
                    if need != have:
                        raise CheckpointError(f"{path}: array {key!r:.80} declares {need} bytes of data "
                                              f"but holds {have}")
    except OSError as exc:
        raise unreadable(path, exc) from None
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError, zlib.error, EOFError, ValueError) as exc:
        # zipfile raises NotImplementedError for an unknown zip version or compression method and
        # RuntimeError for an encrypted member; a damaged deflate stream raises zlib.error
        raise CheckpointError(f"{path}: not a valid npz archive ({_first_line(exc)})") from None

    arrays: dict[str, np.ndarray] = {}
    try:
        res = np.load(path, allow_pickle=False)
        if not isinstance(res, np.lib.npyio.NpzFile):
            raise CheckpointError(f"{path}: not an npz archive")
        with res:
            for key in res.files:
                try:
                    arrays[key] = res[key]
                except ValueError as exc:
                    if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                        raise CheckpointError(f"{path}: array {key!r:.80} is an object array; refused "
                                              f"(it would need pickle)") from None
                    raise
    except CheckpointError:
        raise
    except OSError as exc:
        raise unreadable(path, exc) from None
    except Exception as exc:
        raise CheckpointError(f"cannot load {path} as npz: {_first_line(exc)}") from None

    extras: dict[str, str | None] = {}
    for key in _NPZ_RESERVED:
        arr = arrays.pop(key, None)
        if arr is None:
            extras[key] = None
            continue
        if arr.shape != () or arr.dtype.kind != "U":
            raise CheckpointError(f"{path}: reserved entry {key} must be a string scalar")
        extras[key] = str(arr[()])
    for key, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise CheckpointError(f"{path}: member {key!r:.80} is not a .npy array")
        try:
            tensor_to_numpy(arr)
        except TypeError:
            raise CheckpointError(f"{path}: array {key!r:.80} has unsupported dtype {arr.dtype}") from None

    metadata = None
    stored = extras[NPZ_METADATA_KEY]
    if stored is not None:
        metadata = _parse_json(stored, "metadata", path)
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{path}: stored metadata must map strings to strings")
    return _finish_loaded(path, "npz", arrays, extras[NPZ_SKELETON_KEY], extras[NPZ_ALIASES_KEY], metadata)


# --------------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------------


def _validate_for_save(ckpt: Checkpoint) -> None:
    if not isinstance(ckpt, Checkpoint):
        raise TypeError(f"expected a Checkpoint, got {type(ckpt).__name__}")
    for name, t in ckpt.tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"tensor names must be strings, got {name!r:.80}")
        if not isinstance(t, (np.ndarray, RawTensor)) and not is_torch_tensor(t):
            raise CheckpointError(f"tensor {name!r:.80} is a {type(t).__name__}, not a tensor")
    for name, target in (ckpt.aliases or {}).items():
        if name in ckpt.tensors:
            raise CheckpointError(f"alias {name!r:.80} is also a tensor name")
        if target not in ckpt.tensors:
            raise CheckpointError(f"alias {name!r:.80} points to unknown tensor {target!r:.80}")
    if ckpt.metadata is not None and (
        not isinstance(ckpt.metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in ckpt.metadata.items())
    ):
        raise CheckpointError("checkpoint metadata must map strings to strings")


def _skeleton_json(ckpt: Checkpoint) -> str:
    try:
        return json.dumps(ckpt.skeleton, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint skeleton is not JSON-serialisable ({exc})") from None


def save_checkpoint(ckpt: Checkpoint, path: PathLike, *, kind: str | None = None, force: bool = False) -> None:
    """Write ``ckpt`` to ``path`` atomically.

    Parameters
    ----------
    ckpt : Checkpoint
        What to write.
    path : str or PathLike
        The output file.
    kind : {"torch", "safetensors", "npz"} or None
        None: from the suffix of ``path``, else ``ckpt.kind``.
    force : bool
        Overwrite an existing file (else :class:`OutputExistsError`).
    """
    check_kind(kind)
    path = os.fspath(path)
    kind = kind or kind_from_suffix(path) or (ckpt.kind if ckpt.kind in KINDS else None)
    if kind is None:
        raise CheckpointError(
            f"cannot tell the checkpoint format of {path} from its suffix; use .pt/.pth/.bin/.ckpt, "
            f".safetensors or .npz"
        )
    write_atomic(path, checkpoint_writer(ckpt, kind), force=force)


def checkpoint_writer(ckpt: Checkpoint, kind: str, *, safetensors_header: str | None = None) -> Callable:
    """A callable that writes ``ckpt`` as a ``kind`` checkpoint to a binary file object (for streams
    such as stdout; :func:`save_checkpoint` is the file-path front). ``safetensors_header``: the
    JSON header a safetensors file had, written as it was where it still describes the tensors (a
    file restored byte for byte)."""
    check_kind(kind)
    if kind is None:
        raise ValueError("checkpoint_writer needs a kind")
    _validate_for_save(ckpt)
    if kind == "torch":
        return _torch_writer(ckpt)
    if kind == "safetensors":
        return _safetensors_writer(ckpt, safetensors_header)
    return _npz_writer(ckpt)


def _torch_writer(ckpt: Checkpoint) -> Callable:
    # numpy arrays (e.g. from .npz) become torch tensors: a pickled ndarray is not weights-only loadable.
    if any(not is_torch_tensor(t) for t in ckpt.tensors.values()):
        tensors: dict[str, TensorLike] = {}
        for name, t in ckpt.tensors.items():
            if isinstance(t, RawTensor):
                t = _torch_of(t)
            elif isinstance(t, np.ndarray):
                try:
                    arr, dname, _ = tensor_to_numpy(t)
                except TypeError as exc:
                    raise CheckpointError(
                        f"array {name!r:.80} cannot be stored in a torch checkpoint ({exc})") from None
                t = numpy_to_tensor(arr, dname, True)
            tensors[name] = t
        ckpt = Checkpoint(tensors, ckpt.skeleton, ckpt.kind, ckpt.metadata, dict(ckpt.aliases or {}))
    obj = unflatten(ckpt)

    def write(f) -> None:
        out = _WriteErrors(f)
        try:
            torch_module().save(obj, out)
        except (pickle.PicklingError, RuntimeError, TypeError, OSError) as exc:
            # torch reports a failed write (disk full) in words of its own: the OSError underneath
            # is what the caller reports (write_atomic words it as the output's error)
            if out.error is not None:
                raise out.error from None
            raise CheckpointError(f"cannot save the checkpoint with torch: {_first_line(exc)}") from None

    return write


class _WriteErrors:
    """A binary file that remembers the OSError of a failed write (torch's writer wraps it)."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def _st_raw(name: str, t: TensorLike) -> tuple[str, list[int], np.ndarray]:
    """(safetensors dtype code, shape, little-endian contiguous uint8 bytes) of one tensor."""
    if isinstance(t, RawTensor):
        code = _ST_CODE_BY_NAME[t.dtype_name]
        arr = t.bits
        shape = list(arr.shape)
    elif is_torch_tensor(t):
        torch = torch_module()
        dname = str(t.dtype).removeprefix("torch.")
        known = _ST_CODE_BY_NAME.get(dname)
        if known is None or t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            what = t.dtype if known is None else t.layout
            raise CheckpointError(f"tensor {name!r:.80} ({what}) cannot be stored in safetensors; use .pt")
        code = known
        x = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        shape = list(x.shape)
        if dname in _BIT_VIEW:
            x = x.view(getattr(torch, _BIT_VIEW[dname]))
        arr = x.numpy()
    else:
        try:
            arr, dname, _ = tensor_to_numpy(t)
        except TypeError:
            raise CheckpointError(f"array {name!r:.80} ({t.dtype}) cannot be stored in safetensors") from None
        known = _ST_CODE_BY_NAME.get(dname)
        if known is None:
            raise CheckpointError(f"array {name!r:.80} ({t.dtype}) cannot be stored in safetensors; use .npz")
        code = known
        shape = list(arr.shape)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return code, shape, np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _safetensors_writer(ckpt: Checkpoint, header: str | None = None) -> Callable:
    entries = [(name, *_st_raw(name, t)) for name, t in ckpt.tensors.items()]
    # Tied tensors are written as separate copies (safetensors forbids shared storage).
    entries += [(name, *_st_raw(name, ckpt.tensors[target])) for name, target in (ckpt.aliases or {}).items()]
    specs = [(name, code, shape) for name, code, shape, _ in entries]
    layout = None
    if header is not None and is_plain(ckpt) and not ckpt.aliases:
        layout = SafetensorsLayout.verbatim(header, specs, ckpt.metadata)
    if layout is None:
        layout = SafetensorsLayout.of(specs, ckpt.skeleton, ckpt.metadata, ckpt.aliases, is_plain(ckpt))
    raw = {name: data for name, _, _, data in entries}

    def write(f) -> None:
        layout.write(f, ((name, raw[name]) for name in layout.data_order))

    return write


@dataclass(frozen=True)
class SafetensorsLayout:
    """The bytes of a safetensors file before its data, and the order its tensors' data follow in:
    what the whole-checkpoint writer and a writer fed one tensor at a time share."""

    header: bytes  # the length prefix and the space-padded JSON header
    data_order: list[str]
    sizes: dict[str, int]

    @classmethod
    def of(cls, tensors: list[tuple[str, str, list[int]]], skeleton: Any, metadata: dict[str, str] | None,
           aliases: dict[str, str] | None, plain: bool) -> SafetensorsLayout:
        """The layout of ``(name, dtype code, shape)`` tensors (aliases as copies of their own), with
        the skeleton stored unless ``plain`` and the alias table stored when there are aliases."""
        if any(name == "__metadata__" for name, _, _ in tensors):
            raise CheckpointError("a tensor named '__metadata__' cannot be stored in safetensors")
        metadata = dict(metadata) if metadata is not None else None
        if not plain:
            metadata = metadata or {}
            try:
                metadata[ST_SKELETON_KEY] = json.dumps(skeleton, separators=(",", ":"), ensure_ascii=False,
                                                       allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"checkpoint skeleton is not JSON-serialisable ({exc})") from None
        if aliases:
            metadata = metadata if metadata is not None else {}
            metadata[ST_ALIASES_KEY] = json.dumps(aliases, separators=(",", ":"), ensure_ascii=False)
        sizes = {name: math.prod(shape) * _ST_DTYPES[code][1] for name, code, shape in tensors}
        # Data layout: largest element size first (stable), so every tensor starts at a multiple of
        # its own element size without holes (the format forbids gaps); the header is space-padded
        # to 8 bytes.
        order = sorted(range(len(tensors)), key=lambda i: -_ST_DTYPES[tensors[i][1]][1])
        offsets: dict[int, tuple[int, int]] = {}
        pos = 0
        for i in order:
            n = sizes[tensors[i][0]]
            offsets[i] = (pos, pos + n)
            pos += n
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = metadata
        for i, (name, code, shape) in enumerate(tensors):  # the header lists tensors in checkpoint order
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": list(offsets[i])}
        try:
            hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError("tensor names and metadata must be valid Unicode") from None
        hbytes += b" " * (-len(hbytes) % 8)
        return cls(len(hbytes).to_bytes(8, "little") + hbytes, [tensors[i][0] for i in order], sizes)

    @classmethod
    def verbatim(cls, text: str, tensors: list[tuple[str, str, list[int]]],
                 metadata: dict[str, str] | None) -> SafetensorsLayout | None:
        """The layout of a safetensors file whose JSON header is ``text`` exactly (its key order,
        spacing and padding: a file restored byte for byte), or None where ``text`` does not
        describe these ``(name, dtype code, shape)`` tensors and this metadata in one gapless data
        section."""
        try:
            header = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(header, dict) or header.pop("__metadata__", None) != metadata:
            return None
        wanted = {name: (code, list(shape)) for name, code, shape in tensors}
        if set(header) != set(wanted):
            return None
        spans = []
        for name, info in header.items():
            code, shape = wanted[name]
            kept = info.get("dtype") if isinstance(info, dict) else None
            if kept not in _ST_DTYPES or _ST_DTYPES[kept][:2] != _ST_DTYPES[code][:2] or info.get("shape") != shape:
                return None
            offsets = info.get("data_offsets")
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_nonneg_int(o) for o in offsets):
                return None
            spans.append((offsets[0], offsets[1], name))
        spans.sort()
        pos = 0
        sizes = {}
        for begin, end, name in spans:
            code, shape = wanted[name]
            if begin != pos or end - begin != math.prod(shape) * _ST_DTYPES[code][1]:
                return None
            sizes[name] = end - begin
            pos = end
        raw = text.encode("utf-8")
        return cls(len(raw).to_bytes(8, "little") + raw, [name for _, _, name in spans], sizes)

    @property
    def file_size(self) -> int:
        return len(self.header) + sum(self.sizes.values())

    def write(self, f, data: Iterable[tuple[str, np.ndarray]]) -> None:
        """Write the file to ``f``: the header, then ``(name, raw bytes)`` (see
        :func:`safetensors_bytes`) in :attr:`data_order`, each produced when it is written."""
        f.write(self.header)
        expected = iter(self.data_order)
        for name, raw in data:
            if name != next(expected, None):
                raise RuntimeError(f"internal error: safetensors data out of order at {name!r}")
            if raw.nbytes != self.sizes[name]:
                raise RuntimeError(f"internal error: {name!r} has {raw.nbytes} bytes, not {self.sizes[name]}")
            if raw.nbytes:
                f.write(raw.data)
        if next(expected, None) is not None:
            raise RuntimeError("internal error: safetensors data ended early")


def safetensors_bytes(name: str, t: TensorLike) -> np.ndarray:
    """A tensor's data as a safetensors file stores it (little-endian, C order, uint8)."""
    return _st_raw(name, t)[2]


def safetensors_code(dtype_name: str) -> str:
    """The safetensors dtype code of one of this library's dtype names."""
    code = _ST_CODE_BY_NAME.get(dtype_name)
    if code is None:
        raise CheckpointError(f"{dtype_name} cannot be stored in safetensors; use .pt")
    return code


def _npz_writer(ckpt: Checkpoint) -> Callable:
    items: list[tuple[str, np.ndarray]] = []

    def to_np(name: str, t: TensorLike) -> np.ndarray:
        if name in _NPZ_RESERVED:
            raise CheckpointError(f"tensor name {name!r} is reserved in .npz output")
        if "\x00" in name:
            raise CheckpointError(f"tensor name {name!r:.80} contains a NUL character")
        if len((name + ".npy").encode("utf-8")) > 0xFFFF:  # a zip member's name holds 65,535 bytes
            raise CheckpointError(f"tensor name {name[:40]!r}... is too long for .npz (a member name holds "
                                  "65,535 bytes with its .npy); save as .safetensors or .pt instead")
        if dtype_name_of(t) == "bfloat16":
            raise CheckpointError(f"tensor {name!r:.80} is bfloat16, which .npz cannot hold; "
                                  f"save as .safetensors or .pt instead")
        try:
            arr, _, _ = tensor_to_numpy(t)
        except TypeError as exc:
            raise CheckpointError(f"tensor {name!r:.80} cannot be stored in .npz ({exc}); "
                                  f"save as .safetensors or .pt instead") from None
        return arr

    for name, t in ckpt.tensors.items():
        items.append((name, to_np(name, t)))
    for name, target in (ckpt.aliases or {}).items():
        items.append((name, to_np(name, ckpt.tensors[target])))
    if not is_plain(ckpt):
        items.append((NPZ_SKELETON_KEY, np.array(_skeleton_json(ckpt))))
    if ckpt.aliases:
        items.append((NPZ_ALIASES_KEY, np.array(json.dumps(ckpt.aliases, separators=(",", ":"), ensure_ascii=False))))
    if ckpt.metadata is not None:
        items.append((NPZ_METADATA_KEY, np.array(json.dumps(ckpt.metadata, separators=(",", ":"), ensure_ascii=False))))

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in items:
                info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))  # deterministic
                info.compress_type = zipfile.ZIP_STORED
                info.external_attr = 0o644 << 16
                with zf.open(info, "w", force_zip64=True) as m:
                    np.lib.format.write_array(m, arr, allow_pickle=False)

    return write
