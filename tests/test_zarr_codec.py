"""The numcodecs codec (deepcabac_py.integrations.zarr_codec): configuration, error bounds, zarr.

The round trips go through numcodecs' own check helpers (``numcodecs.tests.common``: every buffer
type in and out, decoding into ``out``) where they fit, as numcodecs' codec tests do.

Regenerate the committed chunk (only after an intended format change) with::

    DEEPCABAC_REGEN_GOLDEN=1 python -m pytest tests/test_zarr_codec.py
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

numcodecs = pytest.importorskip("numcodecs")

from numcodecs.registry import get_codec  # noqa: E402

from deepcabac_py.errors import DeepCabacError, FormatError  # noqa: E402
from deepcabac_py.integrations.zarr_codec import DeepCabac  # noqa: E402
from deepcabac_py.quant.steps import qp_at_most, step_from_qp  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"

CODECS = [
    DeepCabac(step=1e-3),
    DeepCabac(step=0.25, qp_density=0),
    DeepCabac(qp=-40),
    DeepCabac(qp=-20, qp_density=4),
    DeepCabac(keep_exact=True),
]


def _floats(dtype, shape, seed=0, scale=0.05):
    return np.random.default_rng(seed).normal(0.0, scale, size=shape).astype(dtype)


FLOAT_ARRAYS = [
    _floats("f4", (64, 48)),
    _floats("f8", (1000,)),
    _floats("f4", (8, 6, 5, 4), seed=1, scale=3.0),
    _floats("f2", (30, 20), seed=2),
    np.asfortranarray(_floats("f4", (40, 30), seed=3)),
    np.linspace(1000, 1001, 1000, dtype="f8"),
    np.zeros((17, 3), dtype="f4"),
]

INT_ARRAYS = [
    np.random.default_rng(4).integers(-(2**31) + 1, 2**31 - 1, size=(100, 10), dtype="i4"),
    np.random.default_rng(5).integers(-300, 300, size=(10, 10, 10)).astype("i2"),
    np.random.default_rng(6).integers(0, 256, size=1000).astype("u1"),
    np.array([2**40, -(2**62), 0, 7], dtype="i8"),  # beyond 31 bits: stored raw, still exact
    np.array([2**64 - 1, 5], dtype="u8"),
    np.random.default_rng(7).integers(0, 2, size=(33, 7)).astype(bool),
    np.arange(12, dtype="i8").reshape(3, 4).astype("M8[s]"),
]


def _bound(codec: DeepCabac, arr: np.ndarray) -> np.ndarray:
    """step / 2 plus the rounding of the reconstruction to the array's dtype."""
    return codec.effective_step / 2 + np.spacing(np.abs(arr).astype(arr.dtype)).astype(np.float64)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_config_round_trip_through_json_and_registry(codec):
    config = json.loads(json.dumps(codec.get_config()))
    assert config["id"] == "deepcabac"
    again = get_codec(config)  # the numcodecs.codecs entry point finds the class
    assert type(again) is DeepCabac and again == codec
    assert again.effective_step == codec.effective_step
    assert eval(repr(codec), {"DeepCabac": DeepCabac}) == codec


def test_core_import_needs_no_integration_packages():
    import subprocess
    import sys

    code = ("import sys, deepcabac_py, deepcabac_py.integrations, deepcabac_py.integrations.zarr_codec\n"
            "from deepcabac_py import encode_model, decode_model\n"
            "print(sorted(m for m in ('flwr', 'zarr', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # numcodecs only for the codec itself; zarr only for DeepCabacZarr3


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="numcodecs.codecs") if e.name == "deepcabac"]
    assert ep.load() is DeepCabac
    assert isinstance(numcodecs.get_codec({"id": "deepcabac", "qp": -32}), DeepCabac)


@pytest.mark.parametrize("arr", FLOAT_ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
@pytest.mark.parametrize("codec", CODECS[:4], ids=repr)
def test_floats_decode_within_half_a_step(codec, arr):
    enc = codec.encode(arr)
    order = "C" if arr.flags.c_contiguous else "F"  # a Fortran array decodes flat, in memory order
    dec = np.asarray(codec.decode(enc)).reshape(-1).view(arr.dtype).reshape(arr.shape, order=order)
    err = np.abs(dec.astype(np.float64) - arr.astype(np.float64))
    assert np.all(err <= _bound(codec, arr))
    if np.abs(arr).max() > 4 * codec.effective_step:
        assert err.max() > 0  # it really is lossy (a no-op would pass the bound too)
        assert len(enc) < arr.nbytes


@pytest.mark.parametrize("arr", FLOAT_ARRAYS[:5], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_numcodecs_buffer_contract_for_floats(arr):
    check_encode_decode = pytest.importorskip("numcodecs.tests.common").check_encode_decode

    codec = DeepCabac(step=2.0**-12, dtype=arr.dtype.str)  # raw byte buffers need the dtype
    digits = int(-np.log10(codec.effective_step)) - 1
    check_encode_decode(arr, codec, precision=digits)


@pytest.mark.parametrize("arr", INT_ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_integers_are_lossless_whatever_the_setting(arr):
    for codec in (DeepCabac(), DeepCabac(step=10.0), DeepCabac(dtype=arr.dtype.str)):
        dec = np.asarray(codec.decode(codec.encode(arr)))
        assert dec.tobytes() == np.ascontiguousarray(arr).tobytes()
    pytest.importorskip("numcodecs.tests.common").check_encode_decode(arr, DeepCabac(dtype=arr.dtype.str))


def test_keep_exact_and_non_finite_values_are_bit_exact():
    arr = _floats("f4", (20, 30))
    codec = DeepCabac(keep_exact=True)
    assert codec.decode(codec.encode(arr)).tobytes() == arr.tobytes()
    arr[3, 4], arr[5, 6] = np.nan, -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the library notes that the tensor is stored raw
        dec = DeepCabac(step=0.1).decode(DeepCabac(step=0.1).encode(arr))
    assert dec.tobytes() == arr.tobytes()


def test_values_too_large_for_31_bit_levels_are_stored_exactly_not_coarsened():
    codec = DeepCabac(step=1e-9)
    arr = np.array([[1e4, -3.0], [2.5, 0.0]], dtype=np.float64)  # 1e4 / 1e-9 does not fit 31 bits
    assert codec.decode(codec.encode(arr)).tobytes() == arr.tobytes()


def test_step_selection_is_the_largest_nnc_step_not_above_the_request():
    for density in range(5):
        for step in (1e-6, 3e-3, 0.1, 1.0, 7.0, 1234.5):
            qp = qp_at_most(step, density)
            assert step_from_qp(qp, density) <= step < step_from_qp(qp + 1, density)
    assert DeepCabac(step=2.0**-10).effective_step == 2.0**-10


def test_decode_into_out_and_foreign_data():
    arr = _floats("f4", (16, 16))
    codec = DeepCabac(step=1e-3)
    enc = codec.encode(arr)
    out = np.empty_like(arr)
    assert codec.decode(enc, out=out) is out
    assert np.abs(out - arr).max() <= codec.effective_step / 2 + 1e-7
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(enc, out=np.empty(10, dtype=np.float32))
    with pytest.raises(TypeError):
        codec.decode(enc, out=np.empty(256, dtype=object))
    with pytest.raises(FormatError):
        codec.decode(b"certainly not a deepcabac stream")
    damaged = bytearray(enc)
    damaged[-3] ^= 0x40
    with pytest.raises(DeepCabacError):
        codec.decode(bytes(damaged))
    from deepcabac_py import encode_model

    two = encode_model({"a": np.zeros(3, np.int32), "b": np.ones(3, np.int32)})
    with pytest.raises(FormatError, match="not a deepcabac array chunk"):
        codec.decode(two)


def test_bad_settings_and_inputs_are_refused():
    with pytest.raises(ValueError):
        DeepCabac(step=1e-3, qp=-32)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            DeepCabac(step=bad)
    with pytest.raises(ValueError):
        DeepCabac(qp_density=9)
    with pytest.raises(TypeError):
        DeepCabac(dtype="U4")
    with pytest.raises(ValueError, match="precision"):
        DeepCabac().encode(np.ones(4, np.float32))  # floats need a step, a qp or keep_exact
    with pytest.raises(TypeError):
        DeepCabac().encode(np.array(["a", "b"], dtype=object))


def test_golden_chunk():
    """The codec's own choices (qp from step, nearest levels, one tensor) reach the same bytes."""
    x = np.random.RandomState(11).randint(-1000, 1001, size=(12, 10)).astype(np.float32) / 256
    codec = DeepCabac(step=2.0**-6)
    path = GOLDEN / "zarr_codec_step2-6.dcb"
    enc = codec.encode(x)
    if REGEN:
        path.write_bytes(enc)
    assert enc == path.read_bytes()
    assert np.abs(DeepCabac().decode(path.read_bytes()) - x).max() <= 2.0**-7


def test_zarr3_array_round_trip(tmp_path):
    zarr = pytest.importorskip("zarr")
    from deepcabac_py.integrations.zarr_codec import DeepCabacZarr3

    weights = _floats("f4", (300, 200))
    counts = np.random.default_rng(1).integers(-5000, 5000, size=(100, 70)).astype(np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: numcodecs codecs are outside the v3 specification
        z = zarr.create_array(str(tmp_path / "w.zarr"), shape=weights.shape, chunks=(128, 128), dtype="float32",
                              serializer=DeepCabacZarr3(step=1e-3), compressors=None)
        z[:] = weights
        c = zarr.create_array(str(tmp_path / "c.zarr"), shape=counts.shape, chunks=(64, 64), dtype="int32",
                              serializer=DeepCabacZarr3(), compressors=None)
        c[:] = counts
        # reopened from the metadata alone: the zarr.codecs entry point resolves the codec
        back = zarr.open_array(str(tmp_path / "w.zarr"), mode="r")
        got = back[:]
        got_counts = zarr.open_array(str(tmp_path / "c.zarr"), mode="r")[:]
    meta = json.loads((tmp_path / "w.zarr" / "zarr.json").read_text())
    assert meta["codecs"] == [{"name": "numcodecs.deepcabac", "configuration": {"step": 1e-3}}]
    assert np.abs(got - weights).max() <= DeepCabac(step=1e-3).effective_step / 2 + 1e-7
    assert np.array_equal(got_counts, counts)
    assert back.nbytes_stored() < weights.nbytes / 2


def test_zarr2_format_takes_the_numcodecs_codec_as_compressor(tmp_path):
    zarr = pytest.importorskip("zarr")
    weights = _floats("f8", (90, 70), seed=9)
    z = zarr.create_array(str(tmp_path / "v2.zarr"), shape=weights.shape, chunks=(32, 70), dtype="float64",
                          zarr_format=2, compressors=DeepCabac(step=1e-4), filters=None)
    z[:] = weights
    got = zarr.open_array(str(tmp_path / "v2.zarr"), mode="r")[:]
    assert np.abs(got - weights).max() <= DeepCabac(step=1e-4).effective_step / 2
