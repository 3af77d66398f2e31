"""Checkpoint input/output: PyTorch pickles (weights-only), safetensors and numpy ``.npz``.

A checkpoint is represented as a :class:`Checkpoint`: a flat, ordered ``name -> tensor`` dictionary plus
a JSON-serialisable *skeleton* describing the whole original object (nested containers, non-tensor
values, references to tensors by name) and the tensors that were tied to an earlier one.

Skeleton schema (``Checkpoint.skeleton``)::

    {"format": "deepcabac.skeleton", "version": 1, "root": NODE}

    NODE :=  null | true | false | "string"
           | integer                      (|i| <= 2**53; larger ones use {"$int": "0x..."} / "-0x...")
           | finite float                 (non-finite ones use {"$float": "nan" | "inf" | "-inf"})
           | [NODE, ...]                  list
           | {"$tuple": [NODE, ...]}
           | {"$dict" | "$odict" | "$counter": [[KEY_NODE, NODE], ...]}   dict / OrderedDict / Counter
           | {"$set" | "$frozenset": [NODE, ...]}                         (elements sorted by their JSON)
           | {"$complex": [FLOAT_NODE, FLOAT_NODE]}
           | {"$bytes" | "$bytearray": "<base64>"}
           | {"$dtype": "float32"}  | {"$size": [int, ...]} | {"$device": "cpu"}
           | {"$npscalar": ["<numpy dtype str>", "<base64 of the raw bytes>"]}
           | {"$tensor": "name"[, "parameter": true][, "requires_grad": bool]}

Every tagged node is a JSON object whose first key starts with ``$``. Tensor names are the key path joined
with ``"."`` (list items use their index); the root tensor of a bare-tensor checkpoint is called
``"tensor"``. A name that collides with another one gets a ``~1``, ``~2``, ... suffix (first occurrence in
traversal order keeps the plain name). Tensors may not appear as dict keys or set elements.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import zipfile
import zlib
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from tokenize import TokenError
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from .errors import CheckpointError
from .fileio import write_atomic

__all__ = [
    "Checkpoint",
    "DTYPE_NAMES",
    "KINDS",
    "SKELETON_FORMAT",
    "SKELETON_VERSION",
    "flatten",
    "unflatten",
    "load_checkpoint",
    "save_checkpoint",
    "checkpoint_writer",
    "is_plain",
    "plain_skeleton",
    "kind_from_suffix",
    "tensor_to_numpy",
    "numpy_to_tensor",
]

TensorLike = Union[torch.Tensor, np.ndarray]
PathLike = Union[str, "os.PathLike[str]"]

KINDS = ("torch", "safetensors", "npz")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SKELETON_FORMAT = "deepcabac.skeleton"
SKELETON_VERSION = 1

#: safetensors ``__metadata__`` keys (and npz member names) reserved for this library.
ST_SKELETON_KEY = "deepcabac.skeleton"
ST_ALIASES_KEY = "deepcabac.aliases"
NPZ_SKELETON_KEY = "__deepcabac_skeleton__"
NPZ_ALIASES_KEY = "__deepcabac_aliases__"
NPZ_METADATA_KEY = "__deepcabac_metadata__"
_NPZ_RESERVED = (NPZ_SKELETON_KEY, NPZ_ALIASES_KEY, NPZ_METADATA_KEY)

#: Largest safetensors header accepted (the reference implementation uses the same bound).
MAX_HEADER_BYTES = 100_000_000
_MAX_JSON_INT = 2**53

# --------------------------------------------------------------------------------------------------
# dtype tables
# --------------------------------------------------------------------------------------------------

DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
)

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "bool": torch.bool, "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_NAME_BY_TORCH = {v: k for k, v in _TORCH_BY_NAME.items()}

# numpy dtype carrying each dtype name (bfloat16 travels as its raw uint16 bits)
_NUMPY_BY_NAME: dict[str, np.dtype] = {
    name: np.dtype(name if name != "bfloat16" else "uint16") for name in DTYPE_NAMES
}
_NAME_BY_NUMPY = {v: k for k, v in _NUMPY_BY_NAME.items() if k != "bfloat16"}

# safetensors code -> (torch dtype, itemsize, numpy little-endian dtype used to read the raw bytes)
_ST_DTYPES: dict[str, tuple[torch.dtype, int, str]] = {
    "F64": (torch.float64, 8, "<f8"),
    "F32": (torch.float32, 4, "<f4"),
    "F16": (torch.float16, 2, "<f2"),
    "BF16": (torch.bfloat16, 2, "<u2"),
    "I64": (torch.int64, 8, "<i8"),
    "I32": (torch.int32, 4, "<i4"),
    "I16": (torch.int16, 2, "<i2"),
    "I8": (torch.int8, 1, "i1"),
    "U64": (torch.uint64, 8, "<u8"),
    "U32": (torch.uint32, 4, "<u4"),
    "U16": (torch.uint16, 2, "<u2"),
    "U8": (torch.uint8, 1, "u1"),
    "BOOL": (torch.bool, 1, "u1"),
    "C64": (torch.complex64, 8, "<c8"),
    "F8_E4M3": (torch.float8_e4m3fn, 1, "u1"),
    "F8_E5M2": (torch.float8_e5m2, 1, "u1"),
}
_ST_CODE_BY_TORCH = {v[0]: k for k, v in _ST_DTYPES.items()}
# torch dtypes read/written through an integer view of their bits
_BIT_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


# --------------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A flattened checkpoint.

    ``tensors``: insertion-ordered ``name -> tensor`` (torch tensors or numpy arrays), unique names.
    ``skeleton``: JSON-serialisable description of the whole object (see the module docstring).
    ``kind``: ``"torch"``, ``"safetensors"``, ``"npz"`` or ``"mapping"`` (built by :func:`flatten`).
    ``metadata``: safetensors ``__metadata__`` (``str -> str``) or ``None``.
    ``aliases``: ``name -> name of an earlier tensor`` it is tied to; alias names are not in ``tensors``.
    """

    tensors: dict[str, TensorLike]
    skeleton: dict
    kind: str = "mapping"
    metadata: Optional[dict[str, str]] = None
    aliases: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# tensor <-> numpy
# --------------------------------------------------------------------------------------------------


def tensor_to_numpy(t: TensorLike) -> tuple[np.ndarray, str, bool]:
    """Return ``(array, dtype_name, is_torch)``: a C-contiguous, native-byte-order numpy array holding the
    tensor's values bit-exactly. ``bfloat16`` is returned as a ``uint16`` view of the raw bits.

    The array may share memory with ``t`` (non-contiguous inputs are copied). Raises ``TypeError`` for
    unsupported dtypes, layouts or object types.
    """
    if isinstance(t, torch.Tensor):
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise TypeError(f"unsupported tensor layout {t.layout} (only dense, non-quantized tensors are supported)")
        if t.device.type == "meta":
            raise TypeError("meta tensors have no data")
        name = _NAME_BY_TORCH.get(t.dtype)
        if name is None:
            raise TypeError(
                f"unsupported tensor dtype {t.dtype}; supported: {', '.join(DTYPE_NAMES)}"
            )
        x = t.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.resolve_conj().resolve_neg()
        if not x.is_contiguous():
            x = x.contiguous()
        if name == "bfloat16":
            arr = x.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = x.numpy()
        return arr, name, True
    if isinstance(t, np.ndarray):
        dt = t.dtype
        key = dt.newbyteorder("=") if dt.byteorder not in ("|", "=") else dt
        name = _NAME_BY_NUMPY.get(key) if not dt.fields and not dt.subdtype else None
        if name is None:
            raise TypeError(
                f"unsupported array dtype {dt}; supported: {', '.join(n for n in DTYPE_NAMES if n != 'bfloat16')}"
            )
        arr = t
        if not dt.isnative:
            arr = arr.astype(key)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return arr, name, False
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")


def numpy_to_tensor(arr: np.ndarray, dtype_name: str, is_torch: bool) -> TensorLike:
    """Exact inverse of :func:`tensor_to_numpy`: rebuild a torch tensor (``is_torch``) or numpy array of
    ``dtype_name`` from ``arr`` (whose dtype must be the carrier dtype, ``uint16`` for ``bfloat16``).

    The result may share memory with ``arr`` (read-only arrays are copied for torch)."""
    if dtype_name not in _NUMPY_BY_NAME:
        raise TypeError(f"unsupported dtype name {dtype_name!r}; supported: {', '.join(DTYPE_NAMES)}")
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"expected a numpy.ndarray, got {type(arr).__name__}")
    expected = _NUMPY_BY_NAME[dtype_name]
    if arr.dtype.fields or arr.dtype.newbyteorder("=") != expected:
        raise TypeError(f"array dtype {arr.dtype} does not carry {dtype_name} data (expected {expected})")
    if not arr.dtype.isnative:
        arr = arr.astype(expected)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if not is_torch:
        if dtype_name == "bfloat16":
            raise TypeError("bfloat16 data can only be rebuilt as a torch tensor (numpy has no bfloat16)")
        return arr
    if not arr.flags.writeable:
        arr = arr.copy()
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


# --------------------------------------------------------------------------------------------------
# flatten / unflatten
# --------------------------------------------------------------------------------------------------


def _float_node(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _key_component(k: Any) -> str:
    if isinstance(k, (str, int, float)) or k is None:
        return str(k)
    return f"<{type(k).__name__}>"


def _alias_key(t: TensorLike) -> Any:
    """Identity of the memory a tensor views: equal keys mean equal bits forever (tied tensors)."""
    if isinstance(t, torch.Tensor):
        try:
            if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
                return ("id", id(t))
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                return ("id", id(t))
            return ("torch", str(t.device), storage.data_ptr(), t.storage_offset(), tuple(t.shape),
                    tuple(t.stride()), t.dtype, t.is_conj(), t.is_neg())
        except (RuntimeError, NotImplementedError, TypeError):
            return ("id", id(t))
    if t.nbytes == 0 or t.dtype.hasobject:
        return ("id", id(t))
    return ("numpy", t.__array_interface__["data"][0], t.shape, t.strides, t.dtype.str)


# A pickle can reference one container many times over (a list holding the same list twice, 40 levels
# deep, is 2 KB of pickle and 2**40 entries when expanded). Flattening copies every reference, so the
# copies made of containers already seen are bounded.
MAX_SHARED_ENTRIES = 100_000


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[tuple[list[str], TensorLike, dict]] = []
        self.active: set[int] = set()
        self.seen: set[int] = set()  # containers already flattened once (all alive: reachable from the root)
        self.inside_repeat = 0
        self.copied = 0

    def encode(self, obj: Any, path: list[str], tensors_ok: bool = True) -> Any:
        if self.inside_repeat:
            self.copied += 1
            if self.copied > MAX_SHARED_ENTRIES:
                raise TypeError(f"containers shared by reference expand to more than {MAX_SHARED_ENTRIES:,} "
                                f"copied entries (at {'.'.join(path[:8]) or '<root>'})")
        t = type(obj)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            return obj if abs(obj) <= _MAX_JSON_INT else {"$int": hex(obj)}
        if t is float:
            return _float_node(obj)
        if t is complex:
            return {"$complex": [_float_node(obj.real), _float_node(obj.imag)]}
        if t is bytes:
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if t is bytearray:
            return {"$bytearray": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            if not tensors_ok:
                raise TypeError(f"tensors cannot be dict keys or set elements (at {'.'.join(path) or '<root>'})")
            node: dict[str, Any] = {"$tensor": None}
            if isinstance(obj, torch.nn.Parameter):
                node["parameter"] = True
                node["requires_grad"] = bool(obj.requires_grad)
            elif isinstance(obj, torch.Tensor) and obj.requires_grad:
                node["requires_grad"] = True
            self.leaves.append((path, obj, node))
            return node
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.Size):
            return {"$size": [int(d) for d in obj]}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:
                raise TypeError(f"numpy object scalars are not supported (at {'.'.join(path) or '<root>'})")
            return {"$npscalar": [obj.dtype.str, base64.b64encode(obj.tobytes()).decode("ascii")]}
        # lossy fall-backs for subclasses of the plain scalar types (IntEnum, str subclasses, ...)
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return self.encode(int(obj), path, tensors_ok)
        if isinstance(obj, float):
            return _float_node(float(obj))
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray)):
            return self.encode(bytes(obj), path, tensors_ok)
        if isinstance(obj, (Mapping, list, tuple, set, frozenset)):
            oid = id(obj)
            if oid in self.active:
                raise TypeError(f"the structure contains a reference cycle (at {'.'.join(path) or '<root>'})")
            repeat = oid in self.seen
            self.seen.add(oid)
            self.active.add(oid)
            self.inside_repeat += repeat
            try:
                return self._encode_container(obj, path, tensors_ok)
            finally:
                self.active.discard(oid)
                self.inside_repeat -= repeat
        raise TypeError(f"unsupported object of type {t.__name__} at {'.'.join(path) or '<root>'}")

    def _encode_container(self, obj: Any, path: list[str], tensors_ok: bool) -> Any:
        if isinstance(obj, Mapping):
            tag = "$odict" if type(obj) is OrderedDict else "$counter" if type(obj) is Counter else "$dict"
            items = []
            for k, v in obj.items():
                key_node = self.encode(k, path, tensors_ok=False)
                items.append([key_node, self.encode(v, path + [_key_component(k)], tensors_ok)])
            return {tag: items}
        if isinstance(obj, list):
            return [self.encode(v, path + [str(i)], tensors_ok) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, path + [str(i)], tensors_ok) for i, v in enumerate(obj)]}
        tag = "$frozenset" if isinstance(obj, frozenset) else "$set"
        nodes = [self.encode(v, path, tensors_ok=False) for v in obj]
        nodes.sort(key=lambda n: json.dumps(n, sort_keys=True))
        return {tag: nodes}


def flatten(obj: Any) -> Checkpoint:
    """Flatten any nested structure of containers, tensors/arrays and plain values into a
    :class:`Checkpoint` of kind ``"mapping"``. Raises ``TypeError`` for unsupported objects."""
    fl = _Flattener()
    try:
        root = fl.encode(obj, [])
    except RecursionError:
        raise TypeError("the structure is nested too deeply to flatten") from None

    bases = [".".join(path) if path else "tensor" for path, _, _ in fl.leaves]
    reserved = set(bases)
    used: set[str] = set()
    tensors: dict[str, TensorLike] = {}
    aliases: dict[str, str] = {}
    first_by_key: dict[Any, str] = {}
    for base, (_, t, node) in zip(bases, fl.leaves):
        name = base
        if name in used:
            i = 1
            while f"{base}~{i}" in used or f"{base}~{i}" in reserved:
                i += 1
            name = f"{base}~{i}"
        used.add(name)
        node["$tensor"] = name
        key = _alias_key(t)
        target = first_by_key.get(key)
        if target is not None:  # keys embed "torch"/"numpy", so a tie never mixes the two
            aliases[name] = target
        else:
            first_by_key[key] = name
            tensors[name] = t
    skeleton = {"format": SKELETON_FORMAT, "version": SKELETON_VERSION, "root": root}
    return Checkpoint(tensors=tensors, skeleton=skeleton, kind="mapping", metadata=None, aliases=aliases)


def _bad_skeleton(msg: str) -> CheckpointError:
    return CheckpointError(f"malformed checkpoint skeleton: {msg}")


def _decode_float(node: Any) -> float:
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if isinstance(node, dict) and set(node) == {"$float"}:
        v = node["$float"]
        if v in ("nan", "inf", "-inf"):
            return float(v)
    raise _bad_skeleton(f"expected a float, got {node!r:.80}")


def _b64(value: Any) -> bytes:
    if not isinstance(value, str):
        raise _bad_skeleton("expected a base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise _bad_skeleton(f"invalid base64 ({exc})") from None


class _Unflattener:
    def __init__(self, resolve: Callable[[dict], Any]) -> None:
        self.resolve = resolve

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            return node
        if isinstance(node, float):
            return node
        if isinstance(node, list):
            return [self.decode(n) for n in node]
        if not isinstance(node, dict) or not node:
            raise _bad_skeleton(f"unexpected node {node!r:.80}")
        tag = "$tensor" if "$tensor" in node else next(iter(node))
        if tag == "$tensor":
            if not set(node) <= {"$tensor", "parameter", "requires_grad"}:
                raise _bad_skeleton(f"unexpected keys in tensor reference {sorted(node)}")
            return self.resolve(node)
        if len(node) != 1:
            raise _bad_skeleton(f"tagged node with several keys {sorted(node)[:5]}")
        value = node[tag]
        if tag in ("$dict", "$odict", "$counter"):
            if not isinstance(value, list):
                raise _bad_skeleton(f"{tag} needs a list of [key, value] pairs")
            out = OrderedDict() if tag == "$odict" else Counter() if tag == "$counter" else {}
            for pair in value:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _bad_skeleton(f"{tag} needs a list of [key, value] pairs")
                key = self.decode(pair[0])
                value_obj = self.decode(pair[1])
                try:
                    out[key] = value_obj
                except TypeError:
                    raise _bad_skeleton(f"unhashable dict key {key!r:.80}") from None
            return out
        if tag == "$tuple":
            if not isinstance(value, list):
                raise _bad_skeleton("$tuple needs a list")
            return tuple(self.decode(n) for n in value)
        if tag in ("$set", "$frozenset"):
            if not isinstance(value, list):
                raise _bad_skeleton(f"{tag} needs a list")
            try:
                items = [self.decode(n) for n in value]
                return frozenset(items) if tag == "$frozenset" else set(items)
            except TypeError:
                raise _bad_skeleton("unhashable set element") from None
        if tag == "$int":
            if isinstance(value, str):
                try:
                    return int(value, 16)
                except ValueError:
                    pass
            raise _bad_skeleton(f"invalid $int {value!r:.80}")
        if tag == "$float":
            return _decode_float(node)
        if tag == "$complex":
            if not isinstance(value, list) or len(value) != 2:
                raise _bad_skeleton("$complex needs [real, imag]")
            return complex(_decode_float(value[0]), _decode_float(value[1]))
        if tag == "$bytes":
            return _b64(value)
        if tag == "$bytearray":
            return bytearray(_b64(value))
        if tag == "$dtype":
            dt = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(dt, torch.dtype):
                raise _bad_skeleton(f"unknown torch dtype {value!r:.80}")
            return dt
        if tag == "$size":
            if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
                raise _bad_skeleton("$size needs a list of non-negative integers")
            return torch.Size(value)
        if tag == "$device":
            try:
                return torch.device(value)
            except (RuntimeError, TypeError, ValueError):
                raise _bad_skeleton(f"invalid device {value!r:.80}") from None
        if tag == "$npscalar":
            if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
                raise _bad_skeleton("$npscalar needs [dtype, base64]")
            try:
                dt = np.dtype(value[0])
            except TypeError:
                raise _bad_skeleton(f"invalid numpy dtype {value[0]!r:.80}") from None
            raw = _b64(value[1])
            if dt.hasobject or len(raw) != dt.itemsize:
                raise _bad_skeleton("invalid $npscalar")
            return np.frombuffer(raw, dtype=dt)[0]
        raise _bad_skeleton(f"unknown tag {tag!r:.80}")


def _with_grad_flags(t: torch.Tensor, parameter: bool, requires_grad: bool) -> torch.Tensor:
    can_grad = t.is_floating_point() or t.is_complex()
    if parameter:
        if isinstance(t, torch.nn.Parameter) and t.requires_grad == requires_grad:
            return t
        return torch.nn.Parameter(t.detach(), requires_grad=requires_grad and can_grad)
    if not requires_grad or t.requires_grad or not can_grad:
        return t
    return t.detach().requires_grad_(True)


def unflatten(ckpt: Checkpoint) -> Any:
    """Rebuild the original object from a :class:`Checkpoint` (containers, key types and values exactly
    as flattened; tied tensors become the same tensor object again)."""
    skeleton = ckpt.skeleton
    if not isinstance(skeleton, dict) or skeleton.get("format") != SKELETON_FORMAT or "root" not in skeleton:
        raise _bad_skeleton("missing format/root")
    if skeleton.get("version") != SKELETON_VERSION:
        raise _bad_skeleton(f"unsupported skeleton version {skeleton.get('version')!r:.40}")
    tensors, aliases = ckpt.tensors, ckpt.aliases or {}
    cache: dict[tuple, Any] = {}

    def resolve(node: dict) -> Any:
        name = node["$tensor"]
        if not isinstance(name, str):
            raise _bad_skeleton("tensor reference must be a string")
        base = name
        if base not in tensors:
            base = aliases.get(name)
            if base is None or base not in tensors:
                raise CheckpointError(f"checkpoint skeleton refers to unknown tensor {name!r}")
        obj = tensors[base]
        parameter = node.get("parameter", False) is True
        requires_grad = node.get("requires_grad", parameter) is True
        if isinstance(obj, torch.Tensor) and (parameter or requires_grad):
            key = (base, parameter, requires_grad)
            if key not in cache:
                cache[key] = _with_grad_flags(obj, parameter, requires_grad)
            return cache[key]
        return obj

    try:
        return _Unflattener(resolve).decode(skeleton["root"])
    except RecursionError:
        raise _bad_skeleton("nested too deeply") from None


def _skeleton_refs(node: Any, out: list[str]) -> None:
    """Collect tensor names referenced by a (well-formed) skeleton node, in traversal order."""
    if isinstance(node, list):
        for n in node:
            _skeleton_refs(n, out)
    elif isinstance(node, dict):
        if "$tensor" in node:
            out.append(node["$tensor"])
        else:
            for v in node.values():
                _skeleton_refs(v, out)


def plain_skeleton(names: list[str]) -> dict:
    return {
        "format": SKELETON_FORMAT,
        "version": SKELETON_VERSION,
        "root": {"$dict": [[n, {"$tensor": n}] for n in names]},
    }


def is_plain(ckpt: Checkpoint, *, allow_ordered: bool = True) -> bool:
    """True when the skeleton is just ``{name: tensor}`` for every tensor in order (no aliases), i.e. a
    file without a stored skeleton reloads to the same checkpoint. With ``allow_ordered`` an
    OrderedDict root counts as plain too (it then comes back as a dict: fine for safetensors files,
    not for the codec's streams)."""
    if ckpt.aliases:
        return False
    sk = ckpt.skeleton
    if not isinstance(sk, dict) or sk.get("format") != SKELETON_FORMAT or sk.get("version") != SKELETON_VERSION:
        return False
    root = sk.get("root")
    if not isinstance(root, dict) or len(root) != 1:
        return False
    items = root.get("$dict", root.get("$odict") if allow_ordered else None)
    if not isinstance(items, list) or len(items) != len(ckpt.tensors):
        return False
    for pair, name in zip(items, ckpt.tensors):
        if pair != [name, {"$tensor": name}]:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# kinds
# --------------------------------------------------------------------------------------------------


def kind_from_suffix(path: PathLike) -> Optional[str]:
    """``"torch"``, ``"safetensors"`` or ``"npz"`` from the file suffix (case-insensitive), else ``None``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in TORCH_SUFFIXES:
        return "torch"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix == ".npz":
        return "npz"
    return None


def _sniff_kind(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError):
            return "torch"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"


def _check_kind(kind: Optional[str]) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {', '.join(KINDS)}")


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def load_checkpoint(path: PathLike, kind: Optional[str] = None, *, max_bytes: Optional[int] = None) -> Checkpoint:
    """Load a checkpoint file. ``kind`` defaults to the one implied by the suffix (``.pt``, ``.pth``,
    ``.bin``, ``.ckpt`` → torch; ``.safetensors``; ``.npz``); unknown suffixes are sniffed from content.
    Every problem with the file raises :class:`CheckpointError` with a one-line reason.

    Zip-based files (``.npz`` and torch's own format) may not expand to more than ``max_bytes`` of
    uncompressed members; the default, ``64 MiB + 100 x the file size``, refuses zip bombs while no
    checkpoint of real weights comes near it (weights hardly compress). Formats without compression
    are bounded by the file size itself."""
    _check_kind(kind)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int or None, not {max_bytes!r}")
    path = os.fspath(path)
    if kind is None:
        kind = kind_from_suffix(path) or _sniff_kind(path)
    if not os.path.exists(path):
        raise CheckpointError(f"cannot read {path}: no such file")
    if os.path.isdir(path):
        raise CheckpointError(f"cannot read {path}: it is a directory")
    if kind == "torch":
        return _load_torch(path, max_bytes)
    if kind == "safetensors":
        return _load_safetensors(path)
    return _load_npz(path, max_bytes)


ZIP_EXPANSION = 100
ZIP_SLACK = 64 << 20


def _check_zip_sizes(path: str, zf: zipfile.ZipFile, max_bytes: Optional[int]) -> None:
    """Refuse, before anything is extracted, members that reach past the end of the file and archives
    that would expand beyond ``max_bytes`` (see :func:`load_checkpoint`). Readers allocate what a
    member's directory entry declares, so these numbers are what bounds their memory."""
    try:
        file_size = os.path.getsize(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
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
    limit = ZIP_SLACK + ZIP_EXPANSION * file_size if max_bytes is None else max_bytes
    if total > limit:
        why = (f"more than {ZIP_EXPANSION}x its size: a zip bomb? pass a larger max_bytes to load it anyway"
               if max_bytes is None else f"more than max_bytes={max_bytes:,}")
        raise CheckpointError(f"{path}: the {file_size:,}-byte archive expands to {total:,} bytes ({why})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _load_torch(path: str, max_bytes: Optional[int] = None) -> Checkpoint:
    try:
        with zipfile.ZipFile(path) as zf:
            _check_zip_sizes(path, zf, max_bytes)
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError, ValueError, EOFError):
        # Not a zip (torch's legacy pickle format), or a damaged one: torch's reader says what it finds.
        # (zipfile.is_zipfile is no shortcut: it raises BadZipFile itself for some damaged archives.)
        pass
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or _first_line(exc)}") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        reason = _first_line(exc)
        marker = "WeightsUnpickler error:"
        if marker in text:
            reason = text.split(marker, 1)[1].strip().splitlines()[0]
            reason = reason.split(". Please", 1)[0].strip()
            raise CheckpointError(
                f"refused to load {path}: the pickle needs code or objects that weights-only loading "
                f"does not allow ({reason})"
            ) from None
        raise CheckpointError(f"cannot load {path} as a torch checkpoint: {reason}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or _first_line(exc)}") from None
    except Exception as exc:  # torch raises many types (RuntimeError, EOFError, ValueError, ...)
        raise CheckpointError(f"cannot load {path} as a torch checkpoint: {_first_line(exc)}") from None
    try:
        ckpt = flatten(obj)
    except TypeError as exc:
        raise CheckpointError(f"cannot use {path}: {exc}") from None
    for name, t in ckpt.tensors.items():
        if isinstance(t, torch.Tensor) and (
            t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta"
        ):
            raise CheckpointError(f"{path}: tensor {name!r} has an unsupported layout ({t.layout})")
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


def _load_safetensors(path: str) -> Checkpoint:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: invalid safetensors file: {msg}")

    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise bad(f"file is only {size} bytes long")
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise bad(f"header length {n} exceeds the file size ({size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise bad(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
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
            for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
                if b1 < e0:
                    raise bad(f"tensors {n0!r:.80} and {n1!r:.80} overlap")

            tensors: dict[str, torch.Tensor] = {}
            for name, code, shape, begin, end in entries:
                tensors[name] = _read_st_tensor(f, data_start + begin, end - begin, code, shape, bad, name)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None

    metadata = dict(metadata) if metadata is not None else None
    skeleton_json = aliases_json = None
    if metadata is not None:
        skeleton_json = metadata.pop(ST_SKELETON_KEY, None)
        aliases_json = metadata.pop(ST_ALIASES_KEY, None)
        if not metadata and (skeleton_json is not None or aliases_json is not None):
            metadata = None
    return _finish_loaded(path, "safetensors", tensors, skeleton_json, aliases_json, metadata)


def _read_st_tensor(f, offset: int, nbytes: int, code: str, shape: list[int],
                    bad: Callable[[str], CheckpointError], name: str) -> torch.Tensor:
    tdtype, _, np_code = _ST_DTYPES[code]
    if nbytes == 0:
        try:
            return torch.empty(shape, dtype=tdtype)
        except (RuntimeError, ValueError, OverflowError):
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
    arr = arr.reshape(shape)
    if tdtype in _BIT_VIEW:
        carrier = _BIT_VIEW[tdtype]
        np_carrier = np.int16 if carrier == torch.int16 else np.uint8
        return torch.from_numpy(arr.view(np_carrier)).view(tdtype)
    return torch.from_numpy(arr)


def _raw_equal(a: TensorLike, b: TensorLike) -> bool:
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.numel() == 0:
            return True
        return bool(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _finish_loaded(path: str, kind: str, tensors: dict[str, TensorLike], skeleton_json: Optional[str],
                   aliases_json: Optional[str], metadata: Optional[dict[str, str]]) -> Checkpoint:
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
        _skeleton_refs(skeleton["root"], refs)
        missing = set(tensors) - set(refs)
        if missing:
            raise CheckpointError(
                f"{path}: the stored skeleton does not refer to tensor {sorted(missing)[0]!r:.80}"
            )
    return ckpt


def _npy_header(m) -> Optional[tuple[tuple, bool, np.dtype]]:
    fmt = np.lib.format
    version = fmt.read_magic(m)
    if version == (1, 0):
        return fmt.read_array_header_1_0(m)
    if version == (2, 0):
        return fmt.read_array_header_2_0(m)
    return None  # version 3.0: left to np.load


def _load_npz(path: str, max_bytes: Optional[int] = None) -> Checkpoint:
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
        raise CheckpointError(f"cannot read {path}: {exc.strerror or _first_line(exc)}") from None
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
        raise CheckpointError(f"cannot read {path}: {exc.strerror or _first_line(exc)}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot load {path} as npz: {_first_line(exc)}") from None

    extras: dict[str, Optional[str]] = {}
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
    if extras[NPZ_METADATA_KEY] is not None:
        metadata = _parse_json(extras[NPZ_METADATA_KEY], "metadata", path)
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
        if not isinstance(t, (torch.Tensor, np.ndarray)):
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


def save_checkpoint(ckpt: Checkpoint, path: PathLike, *, kind: Optional[str] = None, force: bool = False) -> None:
    """Write ``ckpt`` atomically. ``kind`` defaults to the output suffix, else ``ckpt.kind``. Refuses to
    overwrite an existing file unless ``force`` (:class:`OutputExistsError`)."""
    _check_kind(kind)
    path = os.fspath(path)
    kind = kind or kind_from_suffix(path) or (ckpt.kind if ckpt.kind in KINDS else None)
    if kind is None:
        raise CheckpointError(
            f"cannot tell the checkpoint format of {path} from its suffix; use .pt/.pth/.bin/.ckpt, "
            f".safetensors or .npz"
        )
    write_atomic(path, checkpoint_writer(ckpt, kind), force=force)


def checkpoint_writer(ckpt: Checkpoint, kind: str) -> Callable:
    """A callable that writes ``ckpt`` as a ``kind`` checkpoint to a binary file object (for streams
    such as stdout; :func:`save_checkpoint` is the file-path front)."""
    _check_kind(kind)
    if kind is None:
        raise ValueError("checkpoint_writer needs a kind")
    _validate_for_save(ckpt)
    if kind == "torch":
        return _torch_writer(ckpt)
    if kind == "safetensors":
        return _safetensors_writer(ckpt)
    return _npz_writer(ckpt)


def _torch_writer(ckpt: Checkpoint) -> Callable:
    # numpy arrays (e.g. from .npz) become torch tensors: a pickled ndarray is not weights-only loadable.
    if any(isinstance(t, np.ndarray) for t in ckpt.tensors.values()):
        tensors: dict[str, TensorLike] = {}
        for name, t in ckpt.tensors.items():
            if isinstance(t, np.ndarray):
                try:
                    arr, dname, _ = tensor_to_numpy(t)
                except TypeError as exc:
                    raise CheckpointError(f"array {name!r:.80} cannot be stored in a torch checkpoint ({exc})") from None
                t = numpy_to_tensor(arr, dname, True)
            tensors[name] = t
        ckpt = Checkpoint(tensors, ckpt.skeleton, ckpt.kind, ckpt.metadata, dict(ckpt.aliases or {}))
    obj = unflatten(ckpt)

    def write(f) -> None:
        try:
            torch.save(obj, f)
        except (pickle.PicklingError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"cannot save the checkpoint with torch: {_first_line(exc)}") from None

    return write


def _st_raw(name: str, t: TensorLike) -> tuple[str, list[int], np.ndarray]:
    """(safetensors dtype code, shape, little-endian contiguous uint8 bytes) of one tensor."""
    if isinstance(t, torch.Tensor):
        code = _ST_CODE_BY_TORCH.get(t.dtype)
        if code is None or t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            what = t.dtype if code is None else t.layout
            raise CheckpointError(f"tensor {name!r:.80} ({what}) cannot be stored in safetensors; use .pt")
        x = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        shape = list(x.shape)
        if x.dtype in _BIT_VIEW:
            x = x.view(_BIT_VIEW[x.dtype])
        arr = x.numpy()
    else:
        try:
            arr, dname, _ = tensor_to_numpy(t)
        except TypeError:
            raise CheckpointError(f"array {name!r:.80} ({t.dtype}) cannot be stored in safetensors") from None
        code = _ST_CODE_BY_TORCH.get(_TORCH_BY_NAME[dname])
        if code is None:
            raise CheckpointError(f"array {name!r:.80} ({t.dtype}) cannot be stored in safetensors; use .npz")
        shape = list(arr.shape)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return code, shape, np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _safetensors_writer(ckpt: Checkpoint) -> Callable:
    if "__metadata__" in ckpt.tensors or "__metadata__" in (ckpt.aliases or {}):
        raise CheckpointError("a tensor named '__metadata__' cannot be stored in safetensors")
    entries = [(name, *_st_raw(name, t)) for name, t in ckpt.tensors.items()]
    # Tied tensors are written as separate copies (safetensors forbids shared storage).
    entries += [(name, *_st_raw(name, ckpt.tensors[target])) for name, target in (ckpt.aliases or {}).items()]

    metadata = dict(ckpt.metadata) if ckpt.metadata is not None else None
    if not is_plain(ckpt):
        metadata = metadata or {}
        metadata[ST_SKELETON_KEY] = _skeleton_json(ckpt)
    if ckpt.aliases:
        metadata = metadata if metadata is not None else {}
        metadata[ST_ALIASES_KEY] = json.dumps(ckpt.aliases, separators=(",", ":"), ensure_ascii=False)

    # Data layout: largest element size first (stable), so every tensor starts at a multiple of its own
    # element size without holes (the format forbids gaps); the header is space-padded to 8 bytes.
    order = sorted(range(len(entries)), key=lambda i: -_ST_DTYPES[entries[i][1]][1])
    offsets: dict[int, tuple[int, int]] = {}
    pos = 0
    for i in order:
        n = entries[i][3].nbytes
        offsets[i] = (pos, pos + n)
        pos += n
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for i, (name, code, shape, _raw) in enumerate(entries):  # header lists tensors in checkpoint order
        header[name] = {"dtype": code, "shape": shape, "data_offsets": list(offsets[i])}
    try:
        hbytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError("tensor names and metadata must be valid Unicode") from None
    hbytes += b" " * (-len(hbytes) % 8)

    def write(f) -> None:
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        for i in order:
            raw = entries[i][3]
            if raw.nbytes:
                f.write(memoryview(raw))

    return write


def _npz_writer(ckpt: Checkpoint) -> Callable:
    items: list[tuple[str, np.ndarray]] = []

    def to_np(name: str, t: TensorLike) -> np.ndarray:
        if name in _NPZ_RESERVED:
            raise CheckpointError(f"tensor name {name!r} is reserved in .npz output")
        if "\x00" in name:
            raise CheckpointError(f"tensor name {name!r:.80} contains a NUL character")
        if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
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
