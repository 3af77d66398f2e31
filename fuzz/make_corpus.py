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

import deepcabac_py as dc  # noqa: E402
from deepcabac_py import updates as up  # noqa: E402
from deepcabac_py.checkpoint import checkpoint_writer, flatten  # noqa: E402
from fuzz_targets import BASE, unpack_model_stream  # noqa: E402

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
    }
    session = up.UpdateSession(3)
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


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main() -> None:
    for name, data in model_streams().items():
        write("model", f"{name}.dcb", data)
        write("model_sealed", f"{name}.bin", unpack_model_stream(data))
    for name, data in update_messages().items():
        write("update", f"{name}.dcu", data)
        write("update_sealed", f"{name}.dcu", data)
    suffix = {"safetensors": "ckpt_safetensors", "npz": "ckpt_npz", "torch": "ckpt_pt"}
    for name, data in checkpoints().items():
        kind = name.split("_")[0]
        write(suffix[kind], f"{name}", data)
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"corpus: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total} bytes")


if __name__ == "__main__":
    main()
