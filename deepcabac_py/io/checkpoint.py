"""What a checkpoint is, whatever file it came from: flat tensors plus the structure around them.

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
import functools
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ..errors import CheckpointError
from .dtypes import DTYPE_NAMES, carrier, name_of_carrier
from .lazy_torch import is_torch_tensor, loaded_torch, torch_module

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checkpoint",
    "RawTensor",
    "SKELETON_FORMAT",
    "SKELETON_VERSION",
    "flatten",
    "unflatten",
    "is_plain",
    "plain_skeleton",
    "skeleton_refs",
    "tensor_to_numpy",
    "numpy_to_tensor",
    "tensor_of_bits",
    "torch_dtype",
]


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bits in its carrier numpy dtype (``uint16`` for bfloat16) and its dtype name: what
    a safetensors file holds, read and written without building a torch tensor. It stands for a
    torch tensor (decoding rebuilds one where a torch object is wanted)."""

    bits: np.ndarray
    dtype_name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape


TensorLike = Union["torch.Tensor", np.ndarray, RawTensor]  # noqa: UP007 (a runtime alias)

SKELETON_FORMAT = "deepcabac.skeleton"
SKELETON_VERSION = 1

_MAX_JSON_INT = 2**53

# --------------------------------------------------------------------------------------------------
# dtype tables
# --------------------------------------------------------------------------------------------------

# (a library dtype name is the name of the torch dtype: "bfloat16" is torch.bfloat16; remembered per
# dtype, as it is asked for every tensor)
@functools.cache
def _name_of_torch_dtype(dtype: Any) -> str | None:
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPE_NAMES else None

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
    metadata: dict[str, str] | None = None
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Elements in all its tensors (an alias's are its target's, not counted twice)."""
        return sum(math.prod(t.shape) for t in self.tensors.values())


# --------------------------------------------------------------------------------------------------
# tensor <-> numpy
# --------------------------------------------------------------------------------------------------


def dtype_name_of(t: TensorLike) -> str | None:
    """This library's dtype name of a tensor or numpy array, None for a dtype it does not code."""
    if isinstance(t, RawTensor):
        return t.dtype_name if t.dtype_name in DTYPE_NAMES else None
    if is_torch_tensor(t):
        return _name_of_torch_dtype(t.dtype)
    dt = t.dtype
    if dt.fields or dt.subdtype:
        return None
    return name_of_carrier(dt.newbyteorder("=") if dt.byteorder not in ("|", "=") else dt)


def tensor_to_numpy(t: TensorLike) -> tuple[np.ndarray, str, bool]:
    """Return ``(array, dtype_name, is_torch)``: a C-contiguous, native-byte-order numpy array holding the
    tensor's values bit-exactly. ``bfloat16`` is returned as a ``uint16`` view of the raw bits.

    The array may share memory with ``t`` (non-contiguous inputs are copied). Raises ``TypeError`` for
    unsupported dtypes, layouts or object types.
    """
    if isinstance(t, RawTensor):
        if t.dtype_name not in DTYPE_NAMES:
            raise TypeError(f"unsupported tensor dtype torch.{t.dtype_name}; supported: {', '.join(DTYPE_NAMES)}")
        return t.bits, t.dtype_name, True
    if is_torch_tensor(t):
        # (the fewest calls into torch on the common path, a dense tensor in memory: each costs
        # about a microsecond, more between two kernels, and a model has hundreds of tensors)
        torch = torch_module()
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise TypeError(f"unsupported tensor layout {t.layout} (only dense, non-quantized tensors are supported)")
        if t.is_meta:
            raise TypeError("meta tensors have no data")
        name = _name_of_torch_dtype(t.dtype)
        if name is None:
            raise TypeError(
                f"unsupported tensor dtype {t.dtype}; supported: {', '.join(DTYPE_NAMES)}"
            )
        x = t.detach() if t.requires_grad else t
        if not x.is_cpu:
            x = x.cpu()
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        if not x.is_contiguous():
            x = x.contiguous()
        if name == "bfloat16":
            u16 = getattr(torch, "uint16", None)  # (torch 2.3 on: one view fewer)
            arr = x.view(u16).numpy() if u16 is not None else x.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = x.numpy()
        return arr, name, True
    if isinstance(t, np.ndarray):
        dt = t.dtype
        key = dt.newbyteorder("=") if dt.byteorder not in ("|", "=") else dt
        name = dtype_name_of(t)
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
    expected = carrier(dtype_name)
    if isinstance(arr, np.generic):  # (numpy's arithmetic on a 0-d array gives a scalar: a 0-d tensor's)
        arr = np.asarray(arr)
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"expected a numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != expected:  # (a decoder's output has the carrier dtype: one comparison per tensor)
        if arr.dtype.fields or arr.dtype.newbyteorder("=") != expected:
            raise TypeError(f"array dtype {arr.dtype} does not carry {dtype_name} data (expected {expected})")
        arr = arr.astype(expected)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if not is_torch:
        if dtype_name == "bfloat16":
            raise TypeError("bfloat16 data can only be rebuilt as a torch tensor (numpy has no bfloat16)")
        return arr
    if not arr.flags.writeable:
        arr = arr.copy()
    torch = torch_module()
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def tensor_of_bits(arr: np.ndarray, dtype_name: str, is_torch: bool) -> TensorLike:
    """What :func:`numpy_to_tensor` gives, without building a torch tensor: a :class:`RawTensor`
    stands for the torch one (for code that only hands it back to :func:`tensor_to_numpy`)."""
    if not is_torch:
        return numpy_to_tensor(arr, dtype_name, False)
    if arr.dtype != carrier(dtype_name):
        raise TypeError(f"array dtype {arr.dtype} does not carry {dtype_name} data (expected {carrier(dtype_name)})")
    return RawTensor(np.ascontiguousarray(arr), dtype_name)


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


def _data_place(t: TensorLike) -> Any:
    """Where a tensor's data starts: equal for every two tensors whose :func:`_alias_key` is equal."""
    if isinstance(t, RawTensor):
        t = t.bits
    if is_torch_tensor(t):
        try:
            return t.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # (no storage: a key of its own)
            return ("id", id(t))
    return t.__array_interface__["data"][0]


def _alias_key(t: TensorLike) -> Any:
    """Identity of the memory a tensor views: equal keys mean equal bits forever (tied tensors)."""
    if isinstance(t, RawTensor):
        t = t.bits
    if is_torch_tensor(t):
        torch = torch_module()
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
            return bytes_node(obj)
        if t is bytearray:
            return {"$bytearray": base64.b64encode(bytes(obj)).decode("ascii")}
        torch = loaded_torch()  # (None: no object can be a torch one)
        if isinstance(obj, (np.ndarray, RawTensor)) or (torch is not None and isinstance(obj, torch.Tensor)):
            if not tensors_ok:
                raise TypeError(f"tensors cannot be dict keys or set elements (at {'.'.join(path) or '<root>'})")
            node: dict[str, Any] = {"$tensor": None}
            if torch is not None and isinstance(obj, torch.nn.Parameter):
                node["parameter"] = True
                node["requires_grad"] = bool(obj.requires_grad)
            elif torch is not None and isinstance(obj, torch.Tensor) and obj.requires_grad:
                node["requires_grad"] = True
            self.leaves.append((path, obj, node))
            return node
        if torch is not None:
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
    # Only tensors that start at the same address can be tied: the full identity (a dozen calls into
    # torch per tensor, a tenth of a small model's encode) is asked of those alone.
    places = [_data_place(t) for _, t, _ in fl.leaves]
    shared = Counter(places)
    for place, base, (_, t, node) in zip(places, bases, fl.leaves):
        name = base
        if name in used:
            i = 1
            while f"{base}~{i}" in used or f"{base}~{i}" in reserved:
                i += 1
            name = f"{base}~{i}"
        used.add(name)
        node["$tensor"] = name
        if shared[place] > 1:
            key = _alias_key(t)
            target = first_by_key.get(key)
            if target is not None:  # keys embed "torch"/"numpy", so a tie never mixes the two
                aliases[name] = target
                continue
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


def bytes_node(data: bytes) -> dict:
    """The skeleton node of a ``bytes`` value."""
    return {"$bytes": base64.b64encode(data).decode("ascii")}


def node_bytes(node: Any) -> bytes:
    """The value of a skeleton's ``bytes`` node (:func:`bytes_node`); CheckpointError for any other."""
    return _b64(node.get("$bytes") if isinstance(node, dict) else None)


def skeleton_entries(node: Any) -> dict | None:
    """The entries of a skeleton's dict node (keys that are plain numbers or strings), or None."""
    if not isinstance(node, dict) or len(node) != 1:
        return None
    tag, pairs = next(iter(node.items()))
    if tag not in ("$dict", "$odict") or not isinstance(pairs, list):
        return None
    return {p[0]: p[1] for p in pairs if _is_entry(p)}


def with_entries(node: dict, new: dict) -> dict:
    """A copy of a skeleton's dict node (one :func:`skeleton_entries` reads) with the values of the
    entries ``new`` names replaced; the other pairs are kept as they are."""
    ((tag, pairs),) = node.items()
    return {tag: [[p[0], new[p[0]]] if _is_entry(p) and p[0] in new else p for p in pairs]}


def _is_entry(pair: Any) -> bool:
    """A pair of a dict node whose key is a plain number or string."""
    return isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)


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
            out: dict = OrderedDict() if tag == "$odict" else Counter() if tag == "$counter" else {}
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
        if tag in ("$dtype", "$size", "$device"):
            return self._torch_object(tag, value)
        if tag == "$npscalar":
            if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
                raise _bad_skeleton("$npscalar needs [dtype, base64]")
            try:
                dt = np.dtype(value[0])
            except TypeError:
                raise _bad_skeleton(f"invalid numpy dtype {value[0]!r:.80}") from None
            raw = _b64(value[1])
            # (a zero itemsize, "V0" or "S0", has no scalar to read back)
            if dt.hasobject or dt.itemsize == 0 or dt.fields or dt.subdtype or len(raw) != dt.itemsize:
                raise _bad_skeleton(f"invalid $npscalar of dtype {value[0]!r:.40}")
            return np.frombuffer(raw, dtype=dt)[0]
        raise _bad_skeleton(f"unknown tag {tag!r:.80}")

    @staticmethod
    def _torch_object(tag: str, value: Any) -> Any:
        # (the only nodes that need torch imported: a stream without them decodes without it)
        torch = torch_module()
        if tag == "$dtype":
            dt = getattr(torch, value, None) if isinstance(value, str) else None
            if not isinstance(dt, torch.dtype):
                raise _bad_skeleton(f"unknown torch dtype {value!r:.80}")
            return dt
        if tag == "$size":
            if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
                raise _bad_skeleton("$size needs a list of non-negative integers")
            return torch.Size(value)
        try:
            return torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            raise _bad_skeleton(f"invalid device {value!r:.80}") from None


def _with_grad_flags(t: torch.Tensor, parameter: bool, requires_grad: bool) -> torch.Tensor:
    torch = torch_module()
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
            target = aliases.get(name)
            if target is None or target not in tensors:
                raise CheckpointError(f"checkpoint skeleton refers to unknown tensor {name!r}")
            base = target
        obj = tensors[base]
        parameter = node.get("parameter", False) is True
        requires_grad = node.get("requires_grad", parameter) is True
        if is_torch_tensor(obj) and (parameter or requires_grad):
            key = (base, parameter, requires_grad)
            if key not in cache:
                cache[key] = _with_grad_flags(obj, parameter, requires_grad)
            return cache[key]
        return obj

    try:
        return _Unflattener(resolve).decode(skeleton["root"])
    except RecursionError:
        raise _bad_skeleton("nested too deeply") from None


def skeleton_refs(node: Any, out: list[str]) -> None:
    """Collect tensor names referenced by a (well-formed) skeleton node, in traversal order."""
    if isinstance(node, list):
        for n in node:
            skeleton_refs(n, out)
    elif isinstance(node, dict):
        if "$tensor" in node:
            out.append(node["$tensor"])
        else:
            for v in node.values():
                skeleton_refs(v, out)


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
    return is_plain_structure(ckpt.skeleton, list(ckpt.tensors), ckpt.aliases, allow_ordered=allow_ordered)


def is_plain_structure(skeleton: Any, names: list[str], aliases: Mapping[str, str] | None, *,
                       allow_ordered: bool = True) -> bool:
    """:func:`is_plain` of a checkpoint with this skeleton, these tensor names and aliases."""
    if aliases:
        return False
    sk = skeleton
    if not isinstance(sk, dict) or sk.get("format") != SKELETON_FORMAT or sk.get("version") != SKELETON_VERSION:
        return False
    root = sk.get("root")
    if not isinstance(root, dict) or len(root) != 1:
        return False
    items = root.get("$dict", root.get("$odict") if allow_ordered else None)
    if not isinstance(items, list) or len(items) != len(names):
        return False
    for pair, name in zip(items, names):
        if pair != [name, {"$tensor": name}]:
            return False
    return True


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name (:data:`deepcabac_py.io.dtypes.DTYPE_NAMES`)."""
    if name not in DTYPE_NAMES:
        raise KeyError(name)
    return getattr(torch_module(), name)
