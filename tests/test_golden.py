"""Golden streams: committed bytes that must keep decoding to the committed values, and that today's
encoder must reproduce exactly (an accidental format or coder change fails here).

The inputs are generated below from integer draws of numpy's legacy ``RandomState`` (its streams
are frozen) scaled by powers of two, so they are bit-identical on every platform.

Regenerate the files (only after an *intended* format change, and bump the format version if old
streams no longer decode) with::

    DEEPCABAC_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import golden_floats, golden_ints

import deepcabac_py as dc
from deepcabac_py.io.checkpoint import flatten, tensor_to_numpy

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"
DTYPES_KEY = "__dtypes__"  # in each .npz: "name=dtype" strings, in tensor-table order


def _importance(seed: int, shape) -> np.ndarray:
    return golden_ints(seed, shape, 1, 17).astype(np.float32)


def golden_cases() -> dict[str, tuple[object, dict]]:
    """name -> (input object, encode_model settings)."""
    weight = golden_floats(1, (16, 12), -3).astype(np.float32)
    state_dict = {
        "layer.weight": weight,
        "layer.bias": golden_floats(2, (12,), -6).astype(np.float32),
        "counts": golden_ints(3, (3, 5), -70000, 70000),
        "big": np.array([2**40, -3, 0], dtype=np.int64),  # beyond int32: stored raw
        "flags": golden_ints(4, (9,), 0, 2).astype(bool),
    }
    mixed = {
        "emb": torch.from_numpy(golden_floats(5, (10, 8), 0)).to(torch.bfloat16),
        "norm": torch.from_numpy(golden_floats(6, (8,), -2)).to(torch.float16),
        "proj": torch.from_numpy(golden_floats(7, (4, 6), -1)),  # float64
        "scalar": torch.tensor(0.75),
    }
    w = torch.from_numpy(golden_floats(8, (6, 5), -2).astype(np.float32))
    nested = {
        "model": {"w": w, "b": torch.from_numpy(golden_floats(9, (5,), -4).astype(np.float32))},
        "tied": w,
        "ids": torch.from_numpy(golden_ints(10, (4,), -9, 10).astype(np.int32)),
        "step": 123,
        "name": "golden",
        "lr": 0.001,
        "betas": (0.9, 0.999),
    }
    lossless = {
        "bf16": torch.from_numpy(golden_floats(12, (16, 40), -4)).to(torch.bfloat16),
        "half": torch.from_numpy(golden_floats(13, (500,), -2)).to(torch.float16),
        # float32 holding bfloat16 values in its first rows only: the low bits drop per segment
        "f32": torch.from_numpy(np.concatenate([
            torch.from_numpy(golden_floats(14, (6, 40), -3)).to(torch.bfloat16).float().numpy(),
            golden_floats(15, (6, 40), -3).astype(np.float32)])),
        "f64": golden_floats(16, (6, 40), 3),
        # format version 6: integers beyond the level coder's range, by magnitude class
        "wide": golden_ints(17, (60,), -1000, 1001).astype(np.int64) * 2**33 + golden_ints(18, (60,), 0, 2**20),
    }
    lossless["f64"][0, :4] = [np.nan, -np.inf, -0.0, 5e-324]
    lossless["f32"][3, :3] = torch.tensor([np.inf, -0.0, 1e-40])
    return {
        # format versions 5 to 9: lossless float coding, integers by magnitude; f32 and f64 (multiples
        # of 2**-k) take their trailing zeros in the symbol and by exponent, bf16 and half their
        # symbols by tANS
        "lossless": (lossless, {"keep_exact": True}),
        # format version 1 (plain rounding); qp_1d -75 was the default when they were written
        "state_dict": (state_dict, {"qp": -36, "qp_1d": -75, "quantizer": "nearest"}),
        "mixed_dtypes": (mixed, {"qp": -30, "qp_1d": -75, "qp_overrides": {"proj": -44}, "quantizer": "nearest"}),
        "nested": (nested, {"qp": -32, "qp_1d": -75, "qp_density": 3, "keep_exact": ["model.b"],
                            "quantizer": "nearest"}),
        # format version 2: trellis tensors (the default), and RDOQ with importance
        "trellis": (mixed, {"qp": -28, "qp_1d": -75, "qp_overrides": {"proj": -40}}),
        "rdoq": (state_dict, {"qp": -34, "qp_1d": -75, "quantizer": "rdoq", "lambda_scale": 2.0,
                              "importance": {"layer.weight": _importance(11, (16, 12))}}),
    }


CASES = sorted(golden_cases())


def linear_case() -> np.ndarray:
    """Format version 3: a matrix tall enough for the linear prediction across columns (768 x 48,
    the smallest that qualifies), made of three integer factors plus sparse +-1 noise. At qp -32
    (step 2**-8) its levels are these integers themselves, so they are the expected values and no
    .npz is needed."""
    f = golden_ints(20, (768, 3), -3, 4)
    g = golden_ints(21, (3, 48), -2, 3)
    u = golden_ints(22, (768, 48), 0, 8)
    return f @ g + (u == 0) - (u == 7)


LINEAR_SETTINGS = {"qp": -32, "qp_1d": -75, "quantizer": "nearest"}


def _linear_input() -> dict[str, np.ndarray]:
    return {"emb": np.ldexp(linear_case().astype(np.float64), -8).astype(np.float32)}


def _expected_arrays(data: bytes) -> dict[str, np.ndarray]:
    ckpt = dc.decode_checkpoint(data, threads=1)
    arrays, dtypes = {}, []
    for name, t in ckpt.tensors.items():
        arr, dtype, _ = tensor_to_numpy(t)
        arrays[name] = arr
        dtypes.append(f"{name}={dtype}")
    arrays[DTYPES_KEY] = np.array(dtypes)
    return arrays


def _regenerate() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, (obj, settings) in golden_cases().items():
        data = dc.encode_model(obj, threads=1, **settings)
        arrays = _expected_arrays(data)
        # the expected values are the quantizer's, not merely whatever the decoder returned
        for tname, qt in dc.quantize_model(obj, **settings).items():
            assert tensor_to_numpy(qt.dequantize())[0].tobytes() == arrays[tname].tobytes(), tname
        (GOLDEN / f"{name}.dcb").write_bytes(data)
        np.savez_compressed(GOLDEN / f"{name}.npz", **arrays)
    (GOLDEN / "linear.dcb").write_bytes(dc.encode_model(_linear_input(), threads=1, **LINEAR_SETTINGS))


@pytest.fixture(scope="module", autouse=True)
def golden_files():
    if REGEN:
        _regenerate()
    missing = [f"{n}{ext}" for n in CASES for ext in (".dcb", ".npz") if not (GOLDEN / f"{n}{ext}").exists()]
    missing += [] if (GOLDEN / "linear.dcb").exists() else ["linear.dcb"]
    if missing:
        pytest.fail(f"golden files missing: {missing}; run with DEEPCABAC_REGEN_GOLDEN=1 to create them")


def _committed(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    data = (GOLDEN / f"{name}.dcb").read_bytes()
    with np.load(GOLDEN / f"{name}.npz", allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    return data, arrays


def _non_tensor_skeleton(obj):
    return flatten(obj).skeleton


@pytest.mark.parametrize("name", CASES)
def test_committed_stream_decodes_exactly(name):
    data, expected = _committed(name)
    dtypes = dict(item.split("=") for item in expected.pop(DTYPES_KEY).tolist())
    ckpt = dc.decode_checkpoint(data, threads=1)
    assert list(ckpt.tensors) == list(dtypes)
    for tname, t in ckpt.tensors.items():
        arr, dtype, _ = tensor_to_numpy(t)
        assert dtype == dtypes[tname], tname
        assert arr.dtype == expected[tname].dtype and arr.shape == expected[tname].shape, tname
        assert arr.tobytes() == expected[tname].tobytes(), tname
    # the structure (containers, non-tensor values, tensor types, ties) is today's input's
    obj, _ = golden_cases()[name]
    decoded = dc.decode_model(data, threads=2)
    assert _non_tensor_skeleton(decoded) == _non_tensor_skeleton(obj)
    original, restored = flatten(obj), flatten(decoded)
    assert restored.aliases == original.aliases
    for tname, t in original.tensors.items():
        assert isinstance(restored.tensors[tname], torch.Tensor) == isinstance(t, torch.Tensor)


@pytest.mark.parametrize("name", CASES)
def test_encoder_reproduces_committed_bytes(name):
    data, _ = _committed(name)
    obj, settings = golden_cases()[name]
    assert dc.encode_model(obj, threads=1, **settings) == data
    assert dc.encode_model(obj, threads=2, **settings) == data


@pytest.mark.parametrize("name", CASES)
def test_committed_levels_match_values(name):
    data, expected = _committed(name)
    for tname, qt in dc.decode_levels(data).items():
        assert qt.levels.dtype == np.int32
        if qt.step is None:
            np.testing.assert_array_equal(qt.levels.astype(np.int64), expected[tname].astype(np.int64))
        else:
            assert tensor_to_numpy(qt.dequantize())[0].tobytes() == expected[tname].tobytes()


def test_linear_stream_decodes_and_reencodes_exactly():
    data = (GOLDEN / "linear.dcb").read_bytes()
    header = dc.read_stream_header(data)
    assert header.version == 3 and [e.is_linear for e in header.tensors] == [True]
    expected = linear_case()
    assert np.array_equal(dc.decode_levels(data)["emb"].levels, expected)
    for threads in (1, 2):
        values = dc.decode_model(data, threads=threads)["emb"]
        assert values.tobytes() == np.ldexp(expected.astype(np.float64), -8).astype(np.float32).tobytes()
        assert dc.encode_model(_linear_input(), threads=threads, **LINEAR_SETTINGS) == data


@pytest.mark.parametrize("version", [6, 7, 8])
def test_the_older_lossless_streams_still_decode(version):
    # (written before the trailing zeros by exponent, before the symbols by tANS, and before
    # float32's trailing zeros in the symbol: never regenerated)
    data = (GOLDEN / f"lossless_v{version}.dcb").read_bytes()
    assert dc.read_stream_header(data).version == version
    _, expected = _committed("lossless")
    dtypes = dict(item.split("=") for item in expected.pop(DTYPES_KEY).tolist())
    ckpt = dc.decode_checkpoint(data, threads=2)
    assert list(ckpt.tensors) == list(dtypes)
    for tname, t in ckpt.tensors.items():
        arr, dtype, _ = tensor_to_numpy(t)
        assert dtype == dtypes[tname] and arr.tobytes() == expected[tname].tobytes(), tname


def test_the_lossless_stream_takes_the_trailing_mode_and_tans():
    header = dc.read_stream_header((GOLDEN / "lossless.dcb").read_bytes())
    assert header.version == 9
    assert {e.name: e.coder_param for e in header.tensors} == {"bf16": 2, "half": 2, "f32": 4, "f64": 1, "wide": 0}


def test_golden_files_are_small():
    # about 11 KB of it is linear.dcb: the linear prediction needs 768 x 48 elements at least
    total = sum(p.stat().st_size for p in GOLDEN.iterdir() if p.suffix in (".dcb", ".npz"))
    assert total < 50_000  # (lossless_v6.dcb to lossless_v8.dcb: 5 KB each)


def _mode4_words(dtype_name: str) -> np.ndarray:
    """1,200 floats (bf16 and fp16 as uint16, fp32 as float32) from frozen draws, a low bit set in
    every one (so that no segment drops a bit and low-bit mode 4 takes them)."""
    x = torch.from_numpy(golden_floats(31, (4, 300), -3))
    if dtype_name == "float32":
        return (x.numpy().astype(np.float32).view(np.uint32).reshape(-1) | 1).view(np.float32)
    t = x.to(torch.bfloat16 if dtype_name == "bfloat16" else torch.float16)
    return t.view(torch.int16).numpy().view(np.uint16).reshape(-1) | 1


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_the_mode_4_golden_substreams_decode_and_are_reproduced(dtype_name):
    from deepcabac_py.entropy import floatcoder
    words = _mode4_words(dtype_name)
    seg = floatcoder.segment_length((4, 300))
    _golden_substream(f"mode4_{dtype_name}.bin", floatcoder.encode_chunk(words, dtype_name, seg, wide=True), words,
                      dtype_name, seg, bytes([floatcoder.WIDE_BYTE]))


def _golden_substream(name: str, data: bytes, words: np.ndarray, dtype_name: str, seg: int, head: bytes) -> None:
    """The lone substream committed as ``name`` begins with ``head``, decodes to ``words`` and is
    what today's writer made of them (``data``)."""
    from deepcabac_py.entropy import floatcoder
    path = GOLDEN / name
    if REGEN:
        path.write_bytes(data)
    committed = path.read_bytes()
    assert committed[:len(head)] == head
    out = np.empty_like(words)
    floatcoder.decode_chunk(committed, dtype_name, seg, out)
    assert out.tobytes() == words.tobytes()
    assert data == committed


def test_the_mode_6_golden_substream_decodes_and_is_reproduced():
    from deepcabac_py.entropy import floatcoder
    # (mode 4's bfloat16 draws as float32 values: the upper halves of 1,200 floats, the lower zero)
    words = (_mode4_words("bfloat16").astype(np.uint32) << 16).view(np.float32)
    seg = floatcoder.segment_length((4, 300))
    _golden_substream("mode6_float32.bin", floatcoder.encode_chunk(words, "float32", seg, wide=True), words,
                      "float32", seg, bytes([floatcoder.HALVES_BYTE, floatcoder.WIDE_BYTE]))


def test_the_mode_5_golden_substream_decodes_and_is_reproduced():
    from deepcabac_py.entropy import floatcoder
    # (1,200 exact float32s from frozen draws: multiples of 2**-13, every other one plus a multiple of
    # 2**-24: trailing-zero counts from 1 to the cap)
    x = golden_floats(37, (4, 300), -3)
    x[:, ::2] += golden_floats(38, (4, 300), -14)[:, ::2]
    words = x.astype(np.float32).reshape(-1)
    seg = floatcoder.segment_length((4, 300))
    _golden_substream("mode5_float32.bin", floatcoder.encode_trailing(words, "float32", seg, wide=True), words,
                      "float32", seg, bytes([floatcoder.TZ_WIDE_BYTE]))
