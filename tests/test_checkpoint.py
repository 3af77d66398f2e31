"""Checkpoint I/O (torch / safetensors / npz), flatten/unflatten and atomic writes."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import struct
import tracemalloc
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepcabac_py.errors import CheckpointError, DeepCabacError, InputError, OutputError, OutputExistsError
from deepcabac_py.io import atomic
from deepcabac_py.io.atomic import UNCACHED_MIN, AppendingWriter, write_atomic
from deepcabac_py.io.checkpoint import DTYPE_NAMES, Checkpoint, flatten, numpy_to_tensor, tensor_to_numpy, unflatten
from deepcabac_py.io.files import kind_from_suffix, load_checkpoint, save_checkpoint

SUFFIX = {"torch": ".pt", "safetensors": ".safetensors", "npz": ".npz"}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _bits(t):
    """Raw bytes of a tensor/array (bit-exact comparison, NaN-safe)."""
    arr, _, _ = tensor_to_numpy(t)
    return arr.tobytes()


def assert_tensor_identical(a, b, same_type=True):
    """Same dtype, shape and bits; with ``same_type=False`` a torch tensor may come back as a numpy array
    (npz) or vice versa (safetensors) as long as the dtype name matches."""
    if same_type:
        assert isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor)
    arr_a, name_a, _ = tensor_to_numpy(a)
    arr_b, name_b, _ = tensor_to_numpy(b)
    assert name_a == name_b
    assert arr_a.shape == arr_b.shape
    assert arr_a.tobytes() == arr_b.tobytes()


def assert_same_structure(a, b, same_type=True):
    """Exact structural equality: container types, key types/order, scalar types and values, tensors
    bit-exact."""
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert_tensor_identical(a, b, same_type)
        return
    assert type(a) is type(b), (type(a), type(b), a, b)
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_same_structure(a[k], b[k], same_type)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_structure(x, y, same_type)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    else:
        assert a == b


def dtype_zoo(kind):
    g = torch.Generator().manual_seed(0)
    sd = {
        "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "f32": torch.randn(4, 3, 2, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 9, generator=g).to(torch.bfloat16),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0, 5], dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (6,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (3, 3), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "empty3": torch.empty(2, 0, 3, dtype=torch.float16),
        "specials": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
        "noncontig": torch.randn(4, 6, generator=g).t()[1:, ::2],
    }
    if kind == "npz":
        del sd["bf16"]
    if kind in ("torch",):
        sd["c128"] = torch.randn(2, generator=g, dtype=torch.complex128)
        sd["u16"] = torch.tensor([0, 65535, 7], dtype=torch.uint16)
        sd["u32"] = torch.tensor([0, 2**32 - 1], dtype=torch.uint32)
        sd["u64"] = torch.tensor([0, 2**64 - 1], dtype=torch.uint64)
    return sd


# --------------------------------------------------------------------------------------------------
# tensor_to_numpy / numpy_to_tensor
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_tensor_numpy_helpers_roundtrip_torch(name):
    dt = getattr(torch, name)
    if dt.is_floating_point or dt.is_complex:
        t = torch.randn(3, 4, dtype=torch.float64).to(dt)
        if not dt.is_complex:
            t[0, 0] = float("nan")
    elif dt == torch.bool:
        t = torch.tensor([[True, False, True]])
    else:
        t = torch.arange(12, dtype=torch.int64).reshape(3, 4).to(dt)
    for x in (t, t.t(), t.reshape(-1)[0]):  # contiguous, non-contiguous, 0-d
        arr, dname, is_torch = tensor_to_numpy(x)
        assert dname == name and is_torch
        assert arr.flags.c_contiguous
        if name == "bfloat16":
            assert arr.dtype == np.uint16
        back = numpy_to_tensor(arr, dname, True)
        assert back.dtype == dt and back.shape == x.shape
        assert back.contiguous().view(-1).view(torch.uint8).tolist() == \
            x.contiguous().view(-1).view(torch.uint8).tolist()


def test_bf16_bits_exact_from_uint16():
    bits = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0x0001], dtype=np.uint16)
    t = numpy_to_tensor(bits, "bfloat16", True)
    assert t.dtype == torch.bfloat16
    arr, name, _ = tensor_to_numpy(t)
    assert name == "bfloat16" and arr.tolist() == bits.tolist()


def test_numpy_helpers_roundtrip_numpy():
    for dt in ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
               "uint32", "uint64", "bool", "complex64", "complex128"]:
        a = (np.arange(12) % 2).astype(dt).reshape(3, 4)
        for x in (a, a.T, a.astype(a.dtype.newbyteorder(">")), np.array(a[0, 0])):
            arr, name, is_torch = tensor_to_numpy(x)
            assert name == dt and not is_torch and arr.dtype.isnative and arr.flags.c_contiguous
            back = numpy_to_tensor(arr, name, False)
            assert isinstance(back, np.ndarray) and back.dtype == np.dtype(dt)
            np.testing.assert_array_equal(back, x)


def test_helpers_reject_unsupported():
    with pytest.raises(TypeError, match="unsupported"):
        tensor_to_numpy(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="unsupported"):
        tensor_to_numpy(np.array(["a"]))
    with pytest.raises(TypeError):
        tensor_to_numpy([1, 2])
    with pytest.raises(TypeError, match="unsupported"):
        numpy_to_tensor(np.zeros(2, np.float32), "float8", True)
    with pytest.raises(TypeError, match="does not carry"):
        numpy_to_tensor(np.zeros(2, np.float32), "float64", True)
    with pytest.raises(TypeError):
        numpy_to_tensor(np.zeros(2, np.uint16), "bfloat16", False)


# --------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch", "safetensors", "npz"])
def test_flat_roundtrip_all_kinds(tmp_path, kind):
    sd = dtype_zoo(kind)
    if kind == "npz":
        sd = {k: v.numpy() for k, v in sd.items()}
    path = tmp_path / f"m{SUFFIX[kind]}"
    save_checkpoint(flatten(sd), path)
    ck = load_checkpoint(path)
    assert ck.kind == kind
    assert list(ck.tensors) == list(sd)
    assert ck.aliases == {}
    for name, t in sd.items():
        assert_tensor_identical(t, ck.tensors[name])
    out = unflatten(ck)
    assert list(out) == list(sd)
    # re-saving the loaded checkpoint is byte-identical (deterministic writers; torch zips differ in name)
    if kind != "torch":
        path2 = tmp_path / f"m2{SUFFIX[kind]}"
        save_checkpoint(ck, path2)
        assert path.read_bytes() == path2.read_bytes()


def test_safetensors_plain_file_has_no_skeleton(tmp_path):
    sd = OrderedDict([("b.weight", torch.ones(3)), ("a.bias", torch.zeros(2, dtype=torch.float64))])
    path = tmp_path / "m.safetensors"
    save_checkpoint(flatten(sd), path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert "__metadata__" not in header
    assert list(header) == ["b.weight", "a.bias"]
    # larger elements first, no holes, every offset aligned to its element size
    assert header["a.bias"]["data_offsets"] == [0, 16]
    assert header["b.weight"]["data_offsets"] == [16, 28]
    assert len(raw) == 8 + n + 28


def test_safetensors_metadata_roundtrip(tmp_path):
    ck = flatten({"w": torch.arange(4, dtype=torch.float32)})
    ck.metadata = {"format": "pt", "note": "héllo"}
    path = tmp_path / "m.safetensors"
    save_checkpoint(ck, path)
    back = load_checkpoint(path)
    assert back.metadata == {"format": "pt", "note": "héllo"}
    save_checkpoint(back, tmp_path / "m.npz")
    assert load_checkpoint(tmp_path / "m.npz").metadata == {"format": "pt", "note": "héllo"}


NESTED_KEYS = ["state_dict", "epoch", "opt", "names", 1]


def nested_obj():
    sd = OrderedDict(
        [("fc.weight", torch.randn(3, 4)), ("fc.bias", torch.randn(3).to(torch.bfloat16)),
         ("steps", torch.tensor(10, dtype=torch.int64)), ("mask", torch.tensor([True, False]))]
    )
    return {"state_dict": sd, "epoch": 3, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "names": ["a", "b"], 1: None}


@pytest.mark.parametrize("kind", ["torch", "safetensors", "npz"])
def test_nested_roundtrip(tmp_path, kind):
    obj = nested_obj()
    obj["extra"] = {"nan": float("nan"), "inf": -float("inf"), "big": 2**80, "neg": -(2**70), "b": b"\x00\xff",
                    "dt": torch.bfloat16, "size": torch.Size([2, 3]), "flag": True, "c": 1 + 2j,
                    2.5: "float key", (1, "x"): "tuple key", None: "none key"}
    if kind == "npz":
        obj["state_dict"]["fc.bias"] = obj["state_dict"]["fc.bias"].float()
    ck = flatten(obj)
    assert list(ck.tensors) == ["state_dict.fc.weight", "state_dict.fc.bias", "state_dict.steps", "state_dict.mask"]
    json.dumps(ck.skeleton, allow_nan=False)  # strictly JSON-serialisable
    path = tmp_path / f"n{SUFFIX[kind]}"
    save_checkpoint(ck, path)
    back = load_checkpoint(path)
    assert list(back.tensors) == list(ck.tensors)
    assert back.skeleton == ck.skeleton
    out = unflatten(back)
    assert_same_structure(obj, out, same_type=kind == "torch")
    if kind == "npz":
        assert isinstance(out["state_dict"]["fc.weight"], np.ndarray)


def test_top_level_state_dict_keeps_keys_and_collisions_are_unique():
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    ck = flatten({"a.b": a, "a": {"b": b}, "a.b~1": c})
    assert list(ck.tensors) == ["a.b", "a.b~2", "a.b~1"]
    out = unflatten(ck)
    assert out["a.b"] is a and out["a"]["b"] is b and out["a.b~1"] is c
    ck2 = flatten({1: a, "1": b})
    assert sorted(ck2.tensors) == ["1", "1~1"]
    assert flatten(torch.ones(2)).tensors.keys() == {"tensor"}


def test_tied_tensors_shared_after_torch_roundtrip(tmp_path):
    w = torch.randn(5, 3)
    emb = torch.nn.Embedding(5, 3)
    sd = OrderedDict([("emb.weight", w), ("head.weight", w), ("view", w.detach()), ("other", w.clone())])
    ck = flatten({"model": sd})
    assert ck.aliases == {"model.head.weight": "model.emb.weight", "model.view": "model.emb.weight"}
    assert list(ck.tensors) == ["model.emb.weight", "model.other"]
    path = tmp_path / "tied.pt"
    save_checkpoint(ck, path)
    back = load_checkpoint(path)
    assert back.aliases == ck.aliases
    out = unflatten(back)["model"]
    assert out["emb.weight"] is out["head.weight"] is out["view"]
    assert out["other"] is not out["emb.weight"]

    # codec-like replacement of every tensor by a decoded copy keeps the tie
    decoded = {n: numpy_to_tensor(tensor_to_numpy(t)[0].copy(), *tensor_to_numpy(t)[1:])
               for n, t in back.tensors.items()}
    ck2 = Checkpoint(decoded, back.skeleton, back.kind, back.metadata, dict(back.aliases))
    path2 = tmp_path / "tied2.pt"
    save_checkpoint(ck2, path2)
    raw = torch.load(path2, weights_only=True)["model"]
    assert raw["emb.weight"].data_ptr() == raw["head.weight"].data_ptr()
    del emb


def test_only_the_same_view_of_the_same_memory_is_tied():
    # Tensors that begin at one address are told apart by the rest of what they view.
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = np.arange(6, dtype=np.float32)
    views = {"w": w, "same": w.view(3, 4), "t": w.t(), "flat": w.view(-1), "row": w[0], "ints": w.view(torch.int32),
             "neg": torch._neg_view(w), "np": w.numpy(),
             "a": a, "a_again": a[:], "a_head": a[:3], "a_ints": a.view(np.int32)}
    ck = flatten(views)
    assert ck.aliases == {"same": "w", "a_again": "a"}
    out = unflatten(ck)
    for name, t in views.items():
        back = out[name]
        if isinstance(t, torch.Tensor):
            assert torch.equal(back.resolve_neg(), t.resolve_neg()) and back.shape == t.shape and back.dtype == t.dtype
        else:
            assert np.array_equal(back, t) and back.dtype == t.dtype


@pytest.mark.parametrize("kind", ["safetensors", "npz"])
def test_tied_tensors_restored_from_copies(tmp_path, kind):
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ck = flatten({"a": w, "b": w})
    path = tmp_path / f"t{SUFFIX[kind]}"
    save_checkpoint(ck, path)
    back = load_checkpoint(path)
    assert back.aliases == {"b": "a"} and list(back.tensors) == ["a"]
    out = unflatten(back)
    assert out["a"] is out["b"]


def test_parameters_and_grad_flags_survive(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    obj = {"params": [p, q]}
    path = tmp_path / "p.pt"
    save_checkpoint(flatten(obj), path)
    ck = load_checkpoint(path)
    decoded = {n: numpy_to_tensor(*tensor_to_numpy(t)) for n, t in ck.tensors.items()}
    out = unflatten(Checkpoint(decoded, ck.skeleton, "torch"))
    assert isinstance(out["params"][0], torch.nn.Parameter) and out["params"][0].requires_grad
    assert isinstance(out["params"][1], torch.nn.Parameter) and not out["params"][1].requires_grad


# --------------------------------------------------------------------------------------------------
# hostile inputs
# --------------------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_code_executing_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned.txt"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Evil(marker)}, path)
    with pytest.raises(CheckpointError, match="refused") as ei:
        load_checkpoint(path)
    assert "\n" not in str(ei.value)
    assert not marker.exists()
    # legacy (non-zip) pickle file with the same payload
    legacy = tmp_path / "evil_legacy.bin"
    legacy.write_bytes(pickle.dumps({"x": _Evil(marker)}, protocol=2))
    with pytest.raises(CheckpointError):
        load_checkpoint(legacy)
    assert not marker.exists()


def test_garbage_torch_file(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    with pytest.raises(InputError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")


def test_npz_object_array_refused(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, a=np.arange(3), b=np.array([1, "x", None], dtype=object))
    with pytest.raises(CheckpointError, match="object array"):
        load_checkpoint(path)


def test_npz_lying_npy_header_refused(tmp_path):
    path = tmp_path / "lie.npz"
    np.savez(path, a=np.arange(4, dtype=np.int64))
    import zipfile
    with zipfile.ZipFile(path) as zf:
        data = zf.read("a.npy")
    assert b"(4,)" in data
    data = data.replace(b"(4,)", b"(8,)")  # header claims 8 elements, member holds 4
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a.npy", data)
    with pytest.raises(CheckpointError, match="declares"):
        load_checkpoint(path)


def _st_file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


BAD_SAFETENSORS = {
    "offset_past_end": _st_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    "overlap": _st_file(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    "span_mismatch": _st_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "header_len_too_big": _st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4,
                                   length=10**9),
    "absurd_shape": _st_file({"a": {"dtype": "F32", "shape": [2**30, 2**30], "data_offsets": [0, 8]}}, b"\0" * 8),
    "absurd_single_dim": _st_file({"a": {"dtype": "U8", "shape": [2**60], "data_offsets": [0, 8]}}, b"\0" * 8),
    "invalid_json": _st_file(b'{"a": {"dtype": "F32",', b"\0" * 8),
    "unknown_dtype": _st_file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
    "negative_dim": _st_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "bool_dim": _st_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
    "float_offset": _st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}}, b"\0" * 4),
    "reversed_offsets": _st_file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4),
    "duplicate_key": _st_file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                              b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
    "not_object": _st_file(b"[1, 2, 3]"),
    "bad_metadata": _st_file({"__metadata__": {"k": 1}}),
    "bad_bool": _st_file({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x07"),
    "too_short": b"\x01\x00",
    "not_utf8": _st_file(b'{"\xff": 1}'),
    "bad_skeleton": _st_file({"__metadata__": {"deepcabac.skeleton": '{"format": "deepcabac.skeleton", '
                                                                      '"version": 1, "root": {"$bogus": 1}}'}}),
    "skeleton_unknown_tensor": _st_file({"__metadata__": {"deepcabac.skeleton": json.dumps(
        {"format": "deepcabac.skeleton", "version": 1, "root": {"$dict": [["x", {"$tensor": "nope"}]]}})}}),
}


@pytest.mark.parametrize("case", sorted(BAD_SAFETENSORS))
def test_lying_safetensors_refused_cheaply(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(BAD_SAFETENSORS[case])
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as ei:
            load_checkpoint(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{case}: peak {peak} bytes"
    assert "\n" not in str(ei.value)


def test_unknown_suffix_is_sniffed_and_kind_override(tmp_path):
    sd = {"w": torch.arange(3, dtype=torch.int32)}
    for kind in ("torch", "safetensors", "npz"):
        path = tmp_path / f"model_{kind}.weights"
        save_checkpoint(flatten(sd), path, kind=kind)
        ck = load_checkpoint(path)
        assert ck.kind == kind
        assert _bits(ck.tensors["w"]) == _bits(sd["w"])
    with pytest.raises(CheckpointError, match="suffix"):
        save_checkpoint(flatten(sd), tmp_path / "x.unknown")
    with pytest.raises(ValueError):
        load_checkpoint(tmp_path / "model_torch.weights", kind="onnx")
    assert kind_from_suffix("A.PTH") == "torch" and kind_from_suffix("x.tar") is None


def test_cross_kind_conversion(tmp_path):
    sd = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array([True]), "z": np.zeros((0,), np.int8)}
    save_checkpoint(flatten(sd), tmp_path / "a.npz")
    ck = load_checkpoint(tmp_path / "a.npz")
    save_checkpoint(ck, tmp_path / "a.pt")  # numpy arrays are stored as torch tensors
    pt = load_checkpoint(tmp_path / "a.pt")
    assert all(isinstance(t, torch.Tensor) for t in pt.tensors.values())
    save_checkpoint(pt, tmp_path / "a.safetensors")
    st_ck = load_checkpoint(tmp_path / "a.safetensors")
    save_checkpoint(st_ck, tmp_path / "b.npz")
    back = load_checkpoint(tmp_path / "b.npz")
    for k, v in sd.items():
        assert_tensor_identical(v, back.tensors[k])
        assert_tensor_identical(v, st_ck.tensors[k], same_type=False)


def test_npz_refuses_bf16_and_safetensors_refuses_complex128(tmp_path):
    with pytest.raises(CheckpointError, match="safetensors"):
        save_checkpoint(flatten({"w": torch.ones(2, dtype=torch.bfloat16)}), tmp_path / "x.npz")
    with pytest.raises(CheckpointError, match=r"\.pt"):
        save_checkpoint(flatten({"w": torch.ones(2, dtype=torch.complex128)}), tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------------


def test_write_atomic_refuses_existing_and_force_overwrites(tmp_path):
    path = tmp_path / "out.bin"
    write_atomic(path, b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(OutputExistsError) as ei:
        write_atomic(path, b"second")
    assert str(path) in str(ei.value) and "--force" in str(ei.value)
    assert path.read_bytes() == b"first"
    write_atomic(path, lambda f: f.write(b"second"), force=True)
    assert path.read_bytes() == b"second"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]
    with pytest.raises(OutputExistsError):
        save_checkpoint(flatten({"w": torch.ones(1)}), path, kind="torch")


def test_write_atomic_failure_leaves_nothing(tmp_path):
    path = tmp_path / "out.bin"

    def boom(f):
        f.write(b"partial data" * 1000)
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        write_atomic(path, boom)
    assert os.listdir(tmp_path) == []

    path.write_bytes(b"keep me")
    with pytest.raises(RuntimeError):
        write_atomic(path, boom, force=True)
    assert path.read_bytes() == b"keep me"
    assert os.listdir(tmp_path) == ["out.bin"]

    def disk_full(f):
        f.write(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match="no space left") as ei:
        write_atomic(tmp_path / "full.bin", disk_full)
    assert isinstance(ei.value, DeepCabacError)
    assert os.listdir(tmp_path) == ["out.bin"]

    with pytest.raises(OutputError):
        write_atomic(tmp_path / "no" / "such" / "dir.bin", b"x")


@pytest.mark.parametrize("pieces", [[0], [5], [4096], [1 << 24], [(1 << 24) + 1, 7], [3, (1 << 25) + 4093, 1 << 12]])
def test_large_appending_output_keeps_every_byte(tmp_path, pieces):
    # large outputs go around the page cache (O_DIRECT where the file system allows it) through
    # a 16 MiB aligned staging buffer: whole blocks, a padded last block, the file cut back
    rng = np.random.default_rng(len(pieces) + sum(pieces))
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in pieces]
    path = tmp_path / "big.bin"
    writer = AppendingWriter(lambda f: [f.write(p.data) for p in parts], UNCACHED_MIN)
    write_atomic(path, writer)
    assert path.read_bytes() == b"".join(p.tobytes() for p in parts)
    assert os.listdir(tmp_path) == ["big.bin"]


def test_large_appending_output_falls_back_where_direct_writes_are_refused(tmp_path, monkeypatch):
    # a file system may take O_DIRECT at open and refuse it on the first write (EINVAL)
    real_write, refused = os.write, []

    def refuse_first(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_write(fd, data)

    monkeypatch.setattr(atomic.os, "write", refuse_first)
    data = np.arange(3 * (1 << 22) + 11, dtype=np.uint32).view(np.uint8)
    write_atomic(tmp_path / "big.bin", AppendingWriter(lambda f: f.write(data.data), UNCACHED_MIN))
    assert refused and (tmp_path / "big.bin").read_bytes() == data.tobytes()


def test_large_appending_output_that_fails_leaves_nothing(tmp_path):
    def boom(f):
        f.write(bytes(1 << 25))
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        write_atomic(tmp_path / "big.bin", AppendingWriter(boom, UNCACHED_MIN))
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# property test
# --------------------------------------------------------------------------------------------------

_tensors = st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "uint8"]).flatmap(
    lambda dt: st.lists(st.integers(0, 3), max_size=3).map(
        lambda shape: (torch.arange(math.prod(shape)) % 3).to(getattr(torch, dt)).reshape(shape)
    )
)
_arrays = st.lists(st.integers(0, 3), max_size=2).map(lambda s: np.arange(math.prod(s), dtype=np.int16).reshape(s))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**60), st.floats(allow_nan=True),
    st.text(max_size=5), st.binary(max_size=5), st.sampled_from([torch.float32, torch.int8]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size), _tensors, _arrays,
)
_keys = st.one_of(st.text(alphabet="ab.~1", max_size=3), st.integers(-2, 2))


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
        st.dictionaries(_keys, children, max_size=4).map(OrderedDict),
    )


_structures = st.recursive(_leaves, _containers, max_leaves=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_structures, tie=st.booleans())
def test_flatten_unflatten_property(obj, tie):
    if tie and isinstance(obj, dict):
        shared = torch.ones(2)
        obj = dict(obj)
        obj["tie_x"] = shared
        obj["tie_y"] = {"inner": shared}
    ck = flatten(obj)
    names = list(ck.tensors) + list(ck.aliases)
    assert len(names) == len(set(names))
    assert all(t in ck.tensors for t in ck.aliases.values())
    # the skeleton survives a strict JSON round trip
    ck2 = Checkpoint(ck.tensors, json.loads(json.dumps(ck.skeleton, allow_nan=False)), ck.kind, None, ck.aliases)
    for c in (ck, ck2):
        out = unflatten(c)
        assert_same_structure(obj, out)
    if tie and isinstance(obj, dict):
        out = unflatten(ck2)
        assert out["tie_x"] is out["tie_y"]["inner"]


def test_flatten_rejects_unsupported_and_cycles():
    with pytest.raises(TypeError):
        flatten({"x": object()})
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match="cycle"):
        flatten(loop)
    with pytest.raises(TypeError):
        flatten({torch.ones(1): 1})
    obj = {"c": Counter(a=2), "s": {1, 2}, "fs": frozenset({"x"}), "np": np.float32(1.5), "ba": bytearray(b"z"),
           "dev": torch.device("cpu")}
    assert_same_structure(obj, unflatten(flatten(obj)))
