"""encode_model / decode_model / decode_levels / quantize_model: exact round trips and policy."""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import deepcabac_py as dc
from deepcabac_py.entropy import chunk_layout
from deepcabac_py.errors import CorruptStreamError
from deepcabac_py.io.checkpoint import tensor_to_numpy
from deepcabac_py.model.container import FLAG_ALIAS, FLAG_TORCH, DType, Mode
from deepcabac_py.model.parallel import POOL_MIN_ELEMENTS
from deepcabac_py.quant.steps import step_from_qp

decode_model, encode_model = dc.decode_model, dc.encode_model

ROOT = Path(__file__).resolve().parent.parent
DIGITS_PT = ROOT / "models" / "digits_cnn.pt"
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def bits(t):
    """(dtype name, is torch, shape, raw bytes): an exact, NaN-safe identity of a tensor."""
    arr, name, is_torch = tensor_to_numpy(t)
    return name, is_torch, arr.shape, arr.tobytes()


def assert_identical(a, b):
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    assert bits(a) == bits(b)


def entries(data) -> dict:
    return {e.name: e for e in dc.read_stream_header(data).tensors}


def encode(model, **kw):
    kw.setdefault("threads", 1)
    return dc.encode_model(model, **kw)


def check_against_quantizer(model: dict, decoded: dict, **kw):
    """Every level-coded tensor decodes to quantize_model's dequantize(), bit for bit; every other
    tensor decodes to its input."""
    q = dc.quantize_model(model, **{k: v for k, v in kw.items() if k != "threads"})
    assert list(decoded) == list(model)
    for name, original in model.items():
        got = decoded[name]
        assert isinstance(got, torch.Tensor) == isinstance(original, torch.Tensor), name
        o_name, o_torch, o_shape, o_bytes = bits(original)
        g_name, g_torch, g_shape, g_bytes = bits(got)
        assert (g_name, g_shape) == (o_name, o_shape), name
        if name in q:
            expected = q[name].dequantize()
            assert bits(expected)[::2] == (g_name, g_shape), name
            assert bits(expected)[3] == g_bytes, name
        else:
            assert g_bytes == o_bytes, name


def rand(shape, scale=0.1, seed=0, dtype=np.float32):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------


def test_quantized_floats_numpy():
    model = {"conv.weight": rand((8, 3, 3, 3), seed=1), "fc.weight": rand((20, 30), seed=2),
             "fc.bias": rand((30,), 0.01, seed=3), "scalar": np.array(np.float32(0.37)),
             "one": np.array([1.25], dtype=np.float32), "row": rand((1, 17), seed=4)}
    # nearest rounding: every error is at most half a step
    data = encode(model, quantizer="nearest")
    out = dc.decode_model(data)
    check_against_quantizer(model, out, quantizer="nearest")
    ent = entries(data)
    assert all(e.mode == Mode.UNIFORM for e in ent.values())
    for name, x in model.items():
        step = ent[name].step
        err = np.abs(out[name].astype(np.float64) - x.astype(np.float64))
        assert err.max() <= step / 2 * (1 + 1e-6) + 1e-12, name


def test_quantized_floats_torch_come_back_as_torch():
    model = {"w": torch.from_numpy(rand((12, 9), seed=5)), "b": torch.from_numpy(rand((9,), seed=6))}
    out = dc.decode_model(encode(model))
    assert all(isinstance(t, torch.Tensor) for t in out.values())
    check_against_quantizer(model, out)


@pytest.mark.parametrize("dtype,kind", [("float16", "numpy"), ("float16", "torch"), ("float64", "numpy"),
                                        ("float64", "torch"), ("bfloat16", "torch")])
def test_other_float_dtypes_restored(dtype, kind):
    base = torch.from_numpy(rand((10, 7), 1.0, seed=7, dtype=np.float64))
    t = base.to(getattr(torch, dtype))
    model = {"w": t if kind == "torch" else t.numpy(), "v": (t[0] if kind == "torch" else t[0].numpy())}
    data = encode(model, qp=-38)
    assert entries(data)["w"].dtype == DType[dtype.upper()]
    out = dc.decode_model(data)
    check_against_quantizer(model, out, qp=-38)
    assert bits(out["w"])[0] == dtype


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"])
def test_integer_tensors_bit_exact(dtype):
    rng = np.random.default_rng(8)
    if dtype == "bool":
        arr = rng.random((13, 5)) < 0.3
    else:
        info = np.iinfo(dtype)
        lo, hi = max(int(info.min), -INT32_MAX), min(int(info.max), INT32_MAX)
        arr = rng.integers(lo, hi, (13, 5), endpoint=True).astype(dtype)
        arr[0, :2] = [lo, hi]
    for model in ({"x": arr, "s": arr[:1, :1].reshape(())}, {"x": torch.from_numpy(arr.copy())}):
        data = encode(model)
        assert all(e.mode == Mode.INTEGER for e in entries(data).values())
        out = dc.decode_model(data)
        for name in model:
            assert_identical(model[name], out[name])
        levels = dc.decode_levels(data)
        assert levels["x"].step is None and levels["x"].levels.dtype == np.int32
        np.testing.assert_array_equal(levels["x"].levels, arr.astype(np.int64))


def test_int64_beyond_int32_stored_raw():
    arr = np.array([[0, 1, -5], [2**40, -(2**31), 7]], dtype=np.int64)
    big_u = np.array([0, 2**63 + 5], dtype=np.uint64)
    model = {"a": arr, "b": torch.from_numpy(arr.copy()), "c": big_u, "ok": np.array([-INT32_MAX, INT32_MAX])}
    data = encode(model)
    ent = entries(data)
    assert ent["a"].mode == ent["b"].mode == ent["c"].mode == Mode.RAW
    assert ent["ok"].mode == Mode.INTEGER
    out = dc.decode_model(data)
    for name in model:
        assert_identical(model[name], out[name])


def test_complex_stored_raw():
    z = (rand((3, 4), seed=70) + 1j * rand((3, 4), seed=71)).astype(np.complex64)
    model = {"z": z, "zt": torch.from_numpy(z.astype(np.complex128))}
    data = encode(model)
    assert all(e.mode == Mode.RAW for e in entries(data).values())
    out = dc.decode_model(data)
    for name in model:
        assert_identical(model[name], out[name])


def test_keep_exact_true_and_patterns():
    model = {"enc.weight": rand((6, 6), seed=9), "enc.bias": rand((6,), seed=10),
             "dec.weight": torch.from_numpy(rand((6, 4), seed=11)), "steps": np.arange(4)}
    data = encode(model, keep_exact=True)
    ent = entries(data)
    assert [ent[n].mode for n in model] == [Mode.RAW, Mode.RAW, Mode.RAW, Mode.INTEGER]
    out = dc.decode_model(data)
    for name in model:
        assert_identical(model[name], out[name])

    for patterns in (["*.bias", "dec.*"], "*.bias"):
        data = encode(model, keep_exact=patterns)
        ent = entries(data)
        assert ent["enc.bias"].mode == Mode.RAW and ent["enc.weight"].mode == Mode.DEPENDENT
        assert ent["dec.weight"].mode == (Mode.RAW if isinstance(patterns, list) else Mode.DEPENDENT)
        out = dc.decode_model(data)
        assert_identical(out["enc.bias"], model["enc.bias"])
        check_against_quantizer(model, out, keep_exact=patterns)


def test_non_finite_tensors_stored_raw_with_warning():
    a = rand((4, 5), seed=12)
    a[1, 2] = np.nan
    b = torch.from_numpy(rand((7,), seed=13))
    b[3] = -math.inf
    c = np.array([np.inf], dtype=np.float16)
    model = {"a": a, "b": b, "c": c, "fine": rand((3, 3), seed=14)}
    with pytest.warns(UserWarning) as record:
        data = encode(model)
    messages = " ".join(str(w.message) for w in record)
    assert "a:" in messages and "b:" in messages and "c:" in messages and "fine" not in messages
    ent = entries(data)
    assert [ent[n].mode for n in model] == [Mode.RAW, Mode.RAW, Mode.RAW, Mode.DEPENDENT]
    out = dc.decode_model(data)
    for name in ("a", "b", "c"):
        assert_identical(model[name], out[name])
    with pytest.warns(UserWarning):
        assert "a" not in dc.quantize_model(model)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 4, 2), (1,), (1, 1), (1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "bfloat16"])
def test_scalars_empty_and_single_element(shape, dtype):
    rng = np.random.default_rng(15)
    t = torch.from_numpy(np.asarray(rng.standard_normal(shape) * 3)).to(getattr(torch, dtype))
    model = {"t": t, "n": t.numpy() if dtype != "bfloat16" else t.float().numpy()}
    data = encode(model)
    out = dc.decode_model(data)
    check_against_quantizer(model, out)
    for name in model:
        assert bits(out[name])[:3] == bits(model[name])[:3]
    if math.prod(shape) == 0:
        assert all(e.mode == Mode.RAW and e.size == 0 for e in entries(data).values())


def test_numpy_and_torch_types_preserved_and_flagged():
    model = {"np": np.ones((2, 3), np.float32), "pt": torch.ones(2, 3), "npi": np.ones(3, np.int16),
             "pti": torch.ones(3, dtype=torch.int16)}
    data = encode(model)
    ent = entries(data)
    assert [bool(ent[n].flags & FLAG_TORCH) for n in model] == [False, True, False, True]
    out = dc.decode_model(data)
    assert [isinstance(out[n], torch.Tensor) for n in model] == [False, True, False, True]
    assert all(isinstance(out[n], np.ndarray) for n in ("np", "npi"))


def _digits_module():
    spec = importlib.util.spec_from_file_location("digits_cnn", ROOT / "models" / "digits_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_checkpoint_nested_round_trip():
    digits = _digits_module()

    ckpt = dc.load_checkpoint(DIGITS_PT)
    original = torch.load(DIGITS_PT, weights_only=True)
    data = encode(ckpt, qp=-32)
    out = dc.decode_model(data)
    assert set(out) == set(original) and list(out["state_dict"]) == list(original["state_dict"])
    assert out["epoch"] == original["epoch"] and out["eval_accuracy"] == original["eval_accuracy"]
    q = dc.quantize_model(ckpt, qp=-32)
    for key, t in original["state_dict"].items():
        name = f"state_dict.{key}"
        got = out["state_dict"][key]
        assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and got.shape == t.shape
        if name in q:
            assert bits(got) == bits(torch.from_numpy(q[name].dequantize()))
        else:
            assert bits(got) == bits(t)
    # the same through a plain nested dict, and the model still works
    out2 = dc.decode_model(encode(original, qp=-32))
    assert all(bits(out2["state_dict"][k]) == bits(out["state_dict"][k]) for k in original["state_dict"])
    x, y = digits.load_eval_set()
    assert digits.accuracy(out["state_dict"], x, y) >= 0.98


def test_nested_structures_with_non_tensor_entries():
    w = torch.from_numpy(rand((5, 4), seed=16))
    model = {"model": OrderedDict(w=w, b=torch.zeros(4)), "opt": {"lr": 1e-3, "betas": (0.9, 0.999), "step": 12},
             "name": "run-7", "layers": [np.arange(3), None, True], "nan": float("nan")}
    out = dc.decode_model(encode(model))
    assert type(out["model"]) is OrderedDict and list(out["model"]) == ["w", "b"]
    assert out["opt"] == {"lr": 1e-3, "betas": (0.9, 0.999), "step": 12}
    assert out["name"] == "run-7" and out["layers"][1:] == [None, True] and math.isnan(out["nan"])
    assert_identical(out["layers"][0], model["layers"][0])
    q = dc.quantize_model(model)
    assert bits(out["model"]["w"]) == bits(torch.from_numpy(q["model.w"].dequantize()))


def test_tied_tensors_stay_tied():
    w = torch.from_numpy(rand((6, 5), seed=17))
    a = rand((4, 4), seed=18)
    model = {"emb.weight": w, "head.weight": w, "a": a, "a_again": a, "other": w.clone()}
    data = encode(model)
    ent = entries(data)
    assert ent["head.weight"].flags & FLAG_ALIAS and ent["a_again"].flags & FLAG_ALIAS
    assert not ent["other"].flags & FLAG_ALIAS
    assert ent["head.weight"].size == 0
    out = dc.decode_model(data)
    assert out["emb.weight"] is out["head.weight"]
    assert out["a"] is out["a_again"]
    assert out["other"] is not out["emb.weight"]
    assert bits(out["other"]) == bits(out["emb.weight"])
    assert set(dc.decode_levels(data)) == {"emb.weight", "a", "other"}


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------


def test_qp_overrides_exact_and_glob():
    model = {"enc.0.weight": rand((8, 8), seed=19), "enc.1.weight": rand((8, 8), seed=20),
             "dec.weight": rand((8, 8), seed=21), "enc.0.bias": rand((8,), seed=22),
             "dec.bias": rand((8,), seed=23)}
    overrides = {"enc.0.weight": -20, "enc.*": -44, "dec.bias": -40}
    data = encode(model, qp=-30, qp_1d=-70, qp_overrides=overrides)
    ent = entries(data)
    assert ent["enc.0.weight"].qp == -20  # the exact name wins over the pattern
    assert ent["enc.1.weight"].qp == -44
    assert ent["enc.0.bias"].qp == -44  # a pattern also applies to 1-D tensors
    assert ent["dec.weight"].qp == -30
    assert ent["dec.bias"].qp == -40
    assert all(e.qp_density == 2 for e in ent.values())
    out = dc.decode_model(data)
    check_against_quantizer(model, out, qp=-30, qp_1d=-70, qp_overrides=overrides)
    q = dc.quantize_model(model, qp=-30, qp_1d=-70, qp_overrides=overrides)
    assert q["enc.1.weight"].step == step_from_qp(-44) == ent["enc.1.weight"].step


def test_a_name_with_brackets_matches_itself_and_a_glob_its_kind():
    from deepcabac_py.model.settings import lookup_qp, matches
    # (a flattened name can hold "[": without wildcards a pattern is the name it spells)
    assert matches("layers[0].weight", ["layers[0].weight"])  # (fnmatch alone: no)
    assert matches("layers0.weight", ["layers[0-9].weight"]) and matches("a.b", ["a.?"])
    assert lookup_qp("layers[0].weight", {"layers[0].weight": -20, "*": -30}) == -20
    assert lookup_qp("x", {"layers[0].weight": -20, "*": -30}) == -30
    assert lookup_qp("x", {"y": -20}) is None


def test_qp_1d_applies_to_ndim_le_1():
    model = {"scalar": np.array(np.float32(0.3)), "vec": rand((16,), seed=24), "mat": rand((4, 4), seed=25),
             "col": rand((16, 1), seed=26)}
    for density in (0, 2, 3):
        ent = entries(encode(model, qp=-9, qp_1d=-21, qp_density=density))
        assert ent["scalar"].qp == ent["vec"].qp == -21
        assert ent["mat"].qp == ent["col"].qp == -9
        assert ent["vec"].step == step_from_qp(-21, density)
        header = dc.read_stream_header(encode(model, qp=-9, qp_1d=-21, qp_density=density))
        assert (header.qp, header.qp_1d, header.qp_density) == (-9, -21, density)


def test_deterministic_across_threads_and_calls():
    model = {f"layer{i}.weight": rand((40, 25), seed=30 + i) for i in range(6)}
    model["ids"] = np.arange(100, dtype=np.int64).reshape(10, 10)
    model["big.weight"] = rand((200, 200), seed=29)  # (large enough for the pool; the others are not)
    assert model["big.weight"].size >= POOL_MIN_ELEMENTS > model["layer0.weight"].size
    one = dc.encode_model(model, threads=1)
    assert dc.encode_model(model, threads=2) == one
    assert dc.encode_model(model, threads=2) == one
    assert dc.encode_model(model) == one
    on_two, on_one = dc.decode_model(one, threads=2), dc.decode_model(one, threads=1)
    assert bits(on_two["layer3.weight"]) == bits(on_one["layer3.weight"])
    assert bits(on_two["big.weight"]) == bits(on_one["big.weight"])


def test_decode_levels_gives_levels_and_step():
    model = {"w": rand((9, 11), seed=40), "b": torch.from_numpy(rand((11,), seed=41)),
             "h": torch.from_numpy(rand((5, 5), seed=42)).to(torch.float16), "i": np.arange(-3, 3)}
    data = encode(model)
    levels = dc.decode_levels(data)
    decoded = dc.decode_model(data)
    ent = entries(data)
    for name in ("w", "b", "h"):
        qt = levels[name]
        assert qt.levels.dtype == np.int32 and qt.levels.shape == tuple(ent[name].shape)
        assert qt.step == ent[name].step and qt.qp == ent[name].qp and qt.qp_density == 2
        values = tensor_to_numpy(decoded[name])[0]
        np.testing.assert_array_equal((qt.levels.astype(np.float64) * qt.step).astype(values.dtype), values)
        assert bits(qt.dequantize()) [3] == bits(decoded[name])[3]
        np.testing.assert_array_equal(qt.levels, dc.quantize_model(model)[name].levels)
    assert levels["i"].step is None and levels["i"].qp is None
    np.testing.assert_array_equal(levels["i"].levels, np.arange(-3, 3))


def test_multi_chunk_tensor():
    rng = np.random.default_rng(50)
    w = (rng.standard_normal((1100, 1000), dtype=np.float32) * 0.05)
    data = dc.encode_model({"w": w}, threads=2)
    e = entries(data)["w"]
    assert e.numel > chunk_layout.CHUNK_ELEMENTS
    assert len(e.chunk_sizes) == 2 and e.chunk_elements % 1000 == 0
    out = dc.decode_model(data, threads=2)["w"]
    expected = dc.quantize_model({"w": w})["w"]
    np.testing.assert_array_equal(out, expected.dequantize())
    np.testing.assert_array_equal(dc.decode_levels(data, threads=1)["w"].levels, expected.levels)


def test_overflowing_values_get_a_coarser_qp():
    w = rand((8, 8), seed=60)
    w[3, 3] = 3.0e6
    b = rand((8,), seed=61)
    b[0] = -1.0e7
    data = encode({"w": w, "b": b}, qp=-40, qp_1d=-75)
    ent = entries(data)
    assert ent["w"].qp > -40 and ent["b"].qp > -75
    for name, x in (("w", w), ("b", b)):
        step = ent[name].step
        assert np.abs(x).max() / step < INT32_MAX
        # the coarsest qp that was needed, not more: one finer step would overflow
        assert np.abs(x).max() / step_from_qp(ent[name].qp - 1) + 0.5 >= INT32_MAX
    levels = dc.decode_levels(data)
    assert np.abs(levels["w"].levels.astype(np.int64)).max() <= INT32_MAX
    out = dc.decode_model(data)
    assert abs(out["w"][3, 3] - 3.0e6) <= ent["w"].step
    check_against_quantizer({"w": w, "b": b}, out, qp=-40, qp_1d=-75)


def test_huge_float64_values():
    x = np.array([[1.0e300, -2.0e300], [0.0, 1.5]], dtype=np.float64)
    data = encode({"x": x}, qp=-32)
    out = dc.decode_model(data)["x"]
    assert np.all(np.isfinite(out)) and abs(out[0, 1] + 2.0e300) <= entries(data)["x"].step


def test_argument_validation():
    model = {"w": rand((3, 3))}
    with pytest.raises(ValueError):
        dc.encode_model(model, qp=10**6)
    with pytest.raises(TypeError):
        dc.encode_model(model, qp=1.5)
    with pytest.raises(ValueError):
        dc.encode_model(model, qp_overrides={"w": 10**6})
    with pytest.raises(ValueError):
        dc.encode_model(model, threads=0)
    with pytest.raises(TypeError):
        dc.encode_model({"x": object()})
    with pytest.raises(TypeError):
        dc.encode_model({"x": torch.ones(2, dtype=torch.float8_e4m3fn)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dc.encode_model(model)  # a finite model warns about nothing


# --------------------------------------------------------------------------------------------------
# rules added after the format review
# --------------------------------------------------------------------------------------------------


def test_ordered_dict_comes_back_ordered():
    from collections import OrderedDict

    sd = OrderedDict([("b", np.ones(3, np.float32)), ("a", np.zeros((2, 2), np.float32))])
    out = decode_model(encode_model(sd))
    assert type(out) is OrderedDict and list(out) == ["b", "a"]


def test_bfloat16_is_rounded_once():
    # 2**30 + 2**22 + 1 at qp -120 (step 2**-30): the exact value is 1 + 2**-8 + 2**-30, whose nearest
    # bfloat16 is 1 + 2**-7; rounding through float32 first would give a tie and round to 1.0.
    import torch

    from deepcabac_py.quant.reconstruct import reconstruct
    from deepcabac_py.quant.steps import step_from_qp

    bits = reconstruct(np.array([2**30 + 2**22 + 1], np.int32), step_from_qp(-120), "bfloat16")
    value = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().item()
    assert value == 1.0078125
    # and it agrees with float32 -> bfloat16 wherever float32 holds the value exactly
    levels = np.random.default_rng(3).integers(-(2**20), 2**20, 5000).astype(np.int32)
    step = step_from_qp(-40)
    expect = torch.from_numpy(levels.astype(np.float64) * step).float().to(torch.bfloat16)
    assert np.array_equal(reconstruct(levels, step, "bfloat16"), expect.view(torch.int16).numpy().view(np.uint16))


def _entries_of(data):
    from deepcabac_py.model.container import read_header

    return read_header(memoryview(data))


def _rewrite(data, mutate):
    """Re-serialize a stream's header after ``mutate(header)``, keeping the payload."""
    from deepcabac_py.model.container import pack_header

    h = _entries_of(data)
    mutate(h)
    return pack_header(h.qp, h.qp_1d, h.qp_density, h.metadata, h.tensors) + bytes(data[h.header_size:])


def test_duplicate_names_are_corrupt():
    data = encode_model({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)})

    def rename(h):
        h.tensors[1].name = "a"

    with pytest.raises(CorruptStreamError, match="same name"):
        decode_model(_rewrite(data, rename))


def test_boolean_levels_must_be_zero_or_one():
    data = encode_model({"mask": np.array([0, 5, 1], np.int64)})

    def as_bool(h):
        from deepcabac_py.model.container import DType

        h.tensors[0].dtype = DType.BOOL

    with pytest.raises(CorruptStreamError, match="boolean"):
        decode_model(_rewrite(data, as_bool))


def test_alias_entries_carry_no_coding_parameters():
    import torch

    t = torch.ones(3)
    data = encode_model({"a": t, "b": t})

    def give_qp(h):
        h.tensors[1].qp = -20

    with pytest.raises(CorruptStreamError, match="alias"):
        decode_model(_rewrite(data, give_qp))


def test_column_model_needs_a_whole_row_per_chunk():
    from deepcabac_py.entropy.chunk_layout import layout_for_shape, layout_from_stream

    assert layout_from_stream((4, 1000), 500, 0).ncols == 0
    assert layout_from_stream((4, 1000), 2000, 0).ncols == 1000
    assert layout_for_shape((2, 3 << 20)).ncols == 0  # rows longer than a chunk


def test_raw_tensors_are_cut_into_chunks():
    from deepcabac_py.model.container import raw_chunk_elements

    h = _entries_of(encode_model({"x": np.arange(10, dtype=np.complex64)}))
    e = h.tensors[0]
    assert e.chunk_elements == raw_chunk_elements(e.dtype) and e.chunk_sizes == [80]


def test_tiny_chunks_are_refused():
    # Many tiny chunks would each get the allocation bound's slack: the reader wants >= 2**16.
    data = encode_model({"w": np.zeros((100, 1000), np.float32)})

    def shrink(h):
        h.tensors[0].chunk_elements = 1000
        h.tensors[0].chunk_sizes = [0] * 99 + [h.tensors[0].size]

    with pytest.raises(CorruptStreamError, match="chunk size"):
        decode_model(_rewrite(data, shrink))


def test_column_model_and_prediction_only_where_they_pay():
    from deepcabac_py.entropy.chunk_layout import NO_COLUMNS_BIT, PREDICT_BIT
    from deepcabac_py.model.container import read_header

    rng = np.random.default_rng(50)
    iid = rng.standard_normal((300, 256)).astype(np.float32) * 0.05
    smooth = np.cumsum(rng.standard_normal((300, 256)), axis=0).astype(np.float32) * 0.01  # position-like
    small = iid[:100, :100].copy()  # below the size worth testing: keeps both
    rows_vary = iid * np.exp(rng.standard_normal((300, 1))).astype(np.float32)  # row scales spread
    model = {"iid": iid, "smooth": smooth, "small": small, "rows_vary": rows_vary}
    for quantizer in ("nearest", "rdoq", "trellis"):
        data = dc.encode_model(model, qp=-32, quantizer=quantizer, importance=None)
        header = read_header(data)
        param = {e.name: e.coder_param for e in header.tensors}
        assert param["iid"] & (PREDICT_BIT | NO_COLUMNS_BIT) == 0
        assert param["smooth"] & PREDICT_BIT and param["small"] & PREDICT_BIT
        assert param["rows_vary"] & NO_COLUMNS_BIT and header.version == 3
        q = dc.quantize_model(model, qp=-32, quantizer=quantizer, importance=None)
        back = dc.decode_levels(data)
        for name in model:
            assert np.array_equal(back[name].levels, q[name].levels), (quantizer, name)


@pytest.mark.parametrize("rows, cols, dtype", [(2, 5, np.float32), (300, 7, np.float64), (1000, 3, np.float32)])
def test_row_statistics_match_numpy(rows, cols, dtype):
    from deepcabac_py.model._planning_kernels import row_statistics

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    x[rng.random(rows) < 0.3] *= 0.01  # some rows close to the one above... or not
    x[1::7] = x[0:-1:7] + 0.01 * x[1::7]  # and some clearly close
    x[min(5, rows - 1)] = 0  # an all-zero row
    count = min(128, rows - 1)
    r = 1 + (np.arange(count) * (rows - 1)) // count
    xd = x.astype(np.float64)
    near = np.abs(xd[r] - xd[r - 1]).sum(axis=1)
    far = np.abs(xd[r]).sum(axis=1)
    col = np.abs(xd[r]).mean(axis=0)
    floor = 1e-6 * col.mean() + 1e-300
    share, row_spread, col_spread = row_statistics(x[r], x[r - 1], 0.875)
    assert share == float(np.mean(near < 0.875 * far))
    assert row_spread == pytest.approx(np.std(np.log(far / cols + floor)) if count > 1 else 0.0, rel=1e-12)
    assert col_spread == pytest.approx(np.std(np.log(col + floor)), rel=1e-12)
