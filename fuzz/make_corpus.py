"""Write the small valid seed inputs of every fuzz target under fuzz/corpus/<target>/.

    .venv/bin/python fuzz/make_corpus.py

Deterministic (fixed seeds); the whole corpus stays well under 200 KB.
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fuzz_targets import BASE, unpack_model_stream  # noqa: E402

import deepcabac_py as dc  # noqa: E402
from deepcabac_py.io.checkpoint import flatten  # noqa: E402
from deepcabac_py.io.files import checkpoint_writer
from deepcabac_py.updates import message_format as upf  # noqa: E402
from deepcabac_py.updates import messages as up  # noqa: E402
from deepcabac_py.updates import sessions as ups  # noqa: E402

CORPUS = HERE / "corpus"


def small_model(seed: int = 0):
    rng = np.random.default_rng(seed)
    w = torch.from_numpy((rng.standard_normal((6, 5)) * 0.2).astype(np.float32))
    return {
        "conv.weight": torch.from_numpy((rng.standard_normal((4, 2, 3, 3)) * 0.3).astype(np.float32)),
        "fc.weight": w,
        "fc.bias": torch.from_numpy((rng.standard_normal(5) * 0.01).astype(np.float32)),
        "half": torch.from_numpy((rng.standard_normal(7) * 0.5).astype(np.float16)),
        "steps": torch.tensor(1234),
        "mask": torch.tensor([True, False, True]),
        "head.weight": w,  # tied
    }


def model_streams() -> dict[str, bytes]:
    m = small_model()
    out = {
        "trellis": dc.encode_model(m, qp=-32, quantizer="trellis", threads=1),
        "nearest": dc.encode_model(m, qp=-28, quantizer="nearest", threads=1),
        "rdoq": dc.encode_model(m, qp=-36, quantizer="rdoq", threads=1),
        "exact": dc.encode_model(m, keep_exact=True, threads=1),
        "numpy": dc.encode_model({"x": np.arange(12, dtype=np.int16).reshape(3, 4),
                                  "y": np.linspace(-1, 1, 20, dtype=np.float32)}, qp=-30, threads=1),
        "empty": dc.encode_model({}, threads=1),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["raw_nan"] = dc.encode_model({"r": np.array([1.0, np.nan], dtype=np.float32), "e": 3}, threads=1)
    return out


def update_messages() -> dict[str, bytes]:
    rng = np.random.default_rng(11)
    new = {k: (v + (rng.standard_normal(v.shape) * 0.05).astype(v.dtype)) if v.dtype.kind == "f" else v + 1
           for k, v in BASE.items()}
    out = {
        "stc_cabac": up.encode_update(new, BASE, density=0.2),
        "stc_table": up.encode_update(new, BASE, density=0.3, table=True),
        "sbc": up.encode_update(new, BASE, density=0.2, method="sbc"),
        "topk": up.encode_update(new, BASE, density=0.2, method="topk", value_levels=5),
        "golomb": up.encode_update(new, BASE, density=0.2, coder="golomb"),
        # the full headers of update formats 1 and 2 (compact=False) are still read
        "stc_cabac_v2": up.encode_update(new, BASE, density=0.2, compact=False),
        "golomb_v1": up.encode_update(new, BASE, density=0.2, coder="golomb", compact=False),
    }
    session = ups.UpdateSession(3)
    out["session0"] = up.encode_update(new, BASE, density=0.2, session=session)
    out["session1"] = up.encode_update(new, BASE, density=0.25, session=session, round_index=2, parent_round=1)
    out["stream2"] = out["stc_cabac"] + out["golomb"]
    return out


def checkpoints() -> dict[str, bytes]:
    m = small_model(1)
    nested = {"model": {k: v for k, v in m.items() if k != "head.weight"}, "epoch": 3, "lr": 0.1,
              "names": ["a", "b"]}
    out = {}
    for kind in ("safetensors", "npz", "torch"):
        for label, obj in (("flat", m), ("nested", nested)):
            ckpt = flatten(obj)
            buf = io.BytesIO()
            checkpoint_writer(ckpt, kind)(buf)
            out[f"{kind}_{label}"] = buf.getvalue()
    return out


def pt_pickles() -> dict[str, bytes]:
    """data.pkl of structures over the template's two tensors (first seen: the float one), so the
    storages they name exist in the ckpt_pt_pickle template archive."""
    import zipfile
    from collections import OrderedDict

    a, b = torch.arange(6, dtype=torch.float32), torch.arange(3)
    structures = {
        "flat": {"a": a, "b": b},
        "views": {"w": a.view(2, 3), "row": a[3:], "t": a.view(3, 2).t(), "b": b},
        "nested": {"model": OrderedDict(fc=torch.nn.Parameter(a, requires_grad=False), n=b), "epoch": 3,
                   "lr": 1e-3, "names": ["x", "y"], "shape": torch.Size([2, 3]), "dt": torch.float16,
                   "pair": (1, "two", None, True), "big": 2 ** 70, "nan": float("nan")},
        "list": [a, [b, {"k": a}], (a, b)],
        "tied": {"x": a, "y": a, "z": b},
    }
    out = {}
    for name, obj in structures.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
            out[name] = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    return out


def zarr_chunks() -> dict[str, bytes]:
    from deepcabac_py.integrations.zarr_codec import DeepCabac

    rng = np.random.default_rng(5)
    return {
        "float": DeepCabac(step=0.01).encode(rng.standard_normal((8, 9)).astype(np.float32)),
        "int": DeepCabac().encode(np.arange(-20, 20, dtype=np.int16)),
        "exact": DeepCabac(keep_exact=True).encode(rng.standard_normal(11)),
    }


def encode_inputs() -> dict[str, bytes]:
    """Inputs of the encode target: dtype, ndim, quantizer, qp offset, flags, dims, raw values."""
    rng = np.random.default_rng(9)
    normal = (rng.standard_normal(96) * 0.3).astype(np.float32).tobytes()
    return {
        "f32_trellis": bytes([0, 2, 2, 8, 0, 8, 12]) + normal,
        "f16_rdoq_tied": bytes([1, 3, 1, 12, 1, 2, 4, 6]) + (rng.standard_normal(48) * 2).astype(np.float16).tobytes(),
        "f64_nearest": bytes([2, 1, 0, 20, 0, 40]) + rng.standard_normal(40).tobytes(),
        "int8": bytes([3, 2, 0, 0, 0, 5, 7]) + rng.integers(-128, 128, 35, dtype=np.int8).tobytes(),
        "bool": bytes([6, 1, 0, 0, 0, 17]) + rng.integers(0, 2, 17, dtype=np.uint8).tobytes(),
        "bf16_exact": bytes([7, 2, 2, 4, 2, 3, 3]) + normal[:18],
        "nan_inf": bytes([0, 1, 2, 8, 4, 6]) + np.array([np.nan, np.inf, -np.inf, 1e30, -0.0, 1.5],
                                                         dtype=np.float32).tobytes(),
        "scalar": bytes([0, 0, 1, 8, 0]) + np.float32(0.7).tobytes(),
    }


def session_snapshots() -> dict[str, bytes]:
    rng = np.random.default_rng(13)
    out = {"fresh": ups.UpdateSession(9).snapshot()}
    session, model = ups.UpdateSession(9), BASE
    for r in range(3):
        new = {k: (v + (rng.standard_normal(v.shape) * 0.05).astype(v.dtype)) if v.dtype.kind == "f" else v + 1
               for k, v in model.items()}
        up.encode_update(new, model, density=0.3, session=session)
        model = new
        out[f"after{r + 1}"] = session.snapshot()
    return out


def size_and_output_seeds() -> dict[str, bytes]:
    """Seeds of the metadata, header_sizes, update_sizes and output targets ("target/file")."""
    import json
    import struct

    from deepcabac_py.io.checkpoint import flatten

    out = {}
    nested = flatten({"model": small_model(), "epoch": 3, "names": ["a", "b"], "lr": 0.1})
    skeleton = {"kind": "torch", "skeleton": nested.skeleton}
    out["metadata/plain.json"] = b'{"kind":"mapping"}'
    out["metadata/skeleton.json"] = json.dumps(skeleton, separators=(",", ":")).encode()
    streams = model_streams()
    for name in ("trellis", "numpy", "empty"):
        unpacked = unpack_model_stream(streams[name])
        for which in (0, 1, 2, 4, 7):
            out[f"header_sizes/{name}-{which}.bin"] = struct.pack("<IIII", which, 1 << 20, 3, 12) + unpacked
    for name, data in update_messages().items():
        out[f"update_sizes/{name}.bin"] = struct.pack("<Qh", upf.read_update_header(data).payload_size, 0) + data
    for i, kind in enumerate(("new", "file", "link", "dangling", "dir", "missing-dir", "fifo", "device")):
        out[f"output/{kind}.bin"] = bytes([i]) + b"stream bytes"
        out[f"output/{kind}-force.bin"] = bytes([i | 0x80]) + b"stream bytes"
    return out


def float_model() -> dict:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((24, 40)) * np.exp2(rng.integers(-6, -1, (24, 1)))
    return {"bf16": torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16), "f16": w[:, :20].astype(np.float16),
            "f32": w.astype(np.float32), "f64": w[:8], "wide": (w[:4] * 2.0**45).astype(np.int64).reshape(-1)}


def float_chunks() -> dict[str, bytes]:
    """Seeds of float_chunk: dtype:u8 count:u16 segment:u16, then a valid substream. (The corpus
    also keeps ``*_rans.bin``, the same chunks from the version-7 writer, whose symbols went by rANS,
    and ``float32_trailing_rans.bin``, float32's low-bit mode 2 from the version-8 writer; they are
    not rewritten here, and model_sealed's ``lossless_v7.bin`` likewise.)"""
    import struct

    from deepcabac_py.entropy import floatcoder
    out = {}
    for code, name in enumerate(sorted(floatcoder.FORMATS)):
        t = float_model()[{"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}[name]]
        a = t.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else np.asarray(t)
        flat = a.reshape(-1)
        seg = floatcoder.segment_length(a.shape)
        out[f"{name}.bin"] = struct.pack("<BHH", code, flat.size, seg) + floatcoder.encode_chunk(flat, name, seg)
        if name != "float64":  # low-bit mode 4 (64 rANS states): no segment may drop a bit
            words = flat.view(np.uint32 if name == "float32" else np.uint16)
            odd = (words | 1).view(flat.dtype)
            out[f"{name}_mode4.bin"] = (struct.pack("<BHH", code, flat.size, seg)
                                        + floatcoder.encode_chunk(odd, name, seg, wide=True))
        if name == "float32":  # low-bit mode 6: bfloat16 values (a low bit of each upper half set: mode 4 inside)
            halves = (flat.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(1 << 16)
            out[f"{name}_mode6.bin"] = (struct.pack("<BHH", code, flat.size, seg)
                                        + floatcoder.encode_chunk(halves.view(np.float32), name, seg, wide=True))
        # low-bit mode 3 (float32) or 2 (trailing zeros), of the values rounded to one grid
        grid = np.ldexp(np.round(np.ldexp(torch.as_tensor(t).double().numpy(), 30)), -30)
        g = torch.from_numpy(grid).to(t.dtype if name == "bfloat16" else torch.float64)
        flat = g.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else grid.astype(a.dtype)
        flat = flat.reshape(-1)
        out[f"{name}_trailing.bin"] = (struct.pack("<BHH", code, flat.size, seg)
                                       + floatcoder.encode_trailing(flat, name, seg))
        if name == "float32":  # low-bit mode 5 (mode 3 on 64 rANS states)
            out[f"{name}_mode5.bin"] = (struct.pack("<BHH", code, flat.size, seg)
                                        + floatcoder.encode_trailing(flat, name, seg, wide=True))
    rng = np.random.default_rng(8)
    for code, name in enumerate(sorted(floatcoder.INTEGER_WIDTHS), start=4):
        info = np.iinfo(name)
        v = np.clip(rng.laplace(size=700) * np.exp2(rng.integers(0, info.bits - 1, 700)), info.min // 2, info.max // 2)
        out[f"{name}.bin"] = struct.pack("<BHH", code, 700, 256) + floatcoder.encode_magnitudes(v.astype(name), 256)
    return out


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main() -> None:
    for name, data in model_streams().items():
        write("model", f"{name}.dcb", data)
        write("model_sealed", f"{name}.bin", unpack_model_stream(data))
    for name, data in model_streams().items():
        write("info", f"{name}.dcb", data)
    for name, data in update_messages().items():
        write("info", f"{name}.dcu", data)
        write("update", f"{name}.dcu", data)
        write("update_sealed", f"{name}.dcu", data)
    for name, data in model_streams().items():
        for target in ("model_threads", "matrix"):
            write(target, f"{name}.bin", unpack_model_stream(data))
    # the linear prediction across columns (format version 3) needs 768 x 48 at least; sealed only
    # (its mutations get past the checksums), which keeps the corpus small
    rng = np.random.default_rng(5)
    tall = rng.integers(-3, 4, (768, 3)) @ rng.integers(-2, 3, (3, 48)) + rng.integers(-1, 2, (768, 48))
    linear = dc.encode_model({"emb": np.ldexp(tall, -8).astype(np.float32)}, qp=-32, quantizer="nearest", threads=1)
    assert dc.read_stream_header(linear).tensors[0].is_linear
    write("model_sealed", "linear.bin", unpack_model_stream(linear))
    sparse = np.zeros((1100, 2000), np.float32)  # three chunks of rows, a small payload
    sparse[::97, ::89] = np.random.default_rng(2).standard_normal(sparse[::97, ::89].shape)
    big = dc.encode_model({"w": sparse}, qp=-30, threads=1)
    write("model_threads", "chunks.bin", unpack_model_stream(big))
    for name, data in pt_pickles().items():
        write("ckpt_pt_pickle", f"{name}.pkl", data)
    for name, data in zarr_chunks().items():  # unpacked: the target seals them (and tries them raw)
        write("zarr", f"{name}.bin", unpack_model_stream(data))
    for name, data in session_snapshots().items():
        write("session", name, data)
    for name, data in encode_inputs().items():
        write("encode", name, data)
    suffix = {"safetensors": "ckpt_safetensors", "npz": "ckpt_npz", "torch": "ckpt_pt"}
    for name, data in checkpoints().items():
        kind = name.split("_")[0]
        write(suffix[kind], f"{name}", data)
    for name, data in size_and_output_seeds().items():
        target, file = name.split("/")
        write(target, file, data)
    for name, data in float_chunks().items():
        write("float_chunk", name, data)
    lossless = dc.encode_model(float_model(), keep_exact=True, threads=1)
    write("model_sealed", "lossless.bin", unpack_model_stream(lossless))
    grid = {k: np.ldexp(np.round(np.ldexp(v.astype(np.float64), 30)), -30).astype(v.dtype)
            for k, v in float_model().items() if k in ("f32", "f64")}
    trailing = dc.encode_model(grid, keep_exact=True, threads=1)
    assert any(e.codes_trailing_zeros for e in dc.read_stream_header(trailing).tensors)  # (low-bit modes 2 and 3)
    write("model_sealed", "lossless_trailing.bin", unpack_model_stream(trailing))
    rng = np.random.default_rng(9)  # (float32 on a grid finer than an octave: low-bit mode 3)
    tz = dc.encode_model({"g": np.ldexp(np.round(rng.standard_normal((8, 256)) * 2.0**14), -40).astype(np.float32)},
                         keep_exact=True, threads=1)
    assert dc.read_stream_header(tz).version == 9
    write("model_sealed", "lossless_tz.bin", unpack_model_stream(tz))
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"corpus: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total} bytes")


if __name__ == "__main__":
    main()
