"""Compile the Numba kernels the tests use most, on every core at once, before the tests start.

With an empty cache every pytest-xdist worker would compile the same kernels for itself, one core
each; run from ``conftest.py`` in the controlling process, the two parts below compile side by side
in processes of their own and the workers then load them from the cache. With a warm cache this
takes a few seconds.

    python tests/warm_kernels.py PART        PART: 0 (float32 and 16-bit streams) or 1 (float64
                                             streams, updates, matrix formats)
"""

from __future__ import annotations

import sys

import numpy as np


def _models(dtype) -> list:
    import torch

    rng = np.random.default_rng(0)
    m = {"w": rng.normal(0, 0.1, (64, 64)).astype(dtype), "b": rng.normal(0, 0.01, 64).astype(dtype),
         "emb.weight": rng.normal(0, 0.1, (256, 64)).astype(dtype), "i": np.arange(16)}
    if dtype == np.float64:
        return [m]
    return [m, {"w": torch.from_numpy(m["w"]).to(torch.bfloat16), "h": torch.from_numpy(m["w"]).half()}]


def _code(models) -> None:
    from deepcabac_py import decode_levels, decode_model, encode_model

    for quantizer in ("trellis", "rdoq", "nearest"):
        for model in models:
            data = encode_model(model, quantizer=quantizer)
            decode_model(data)
            decode_levels(data)


def float32_streams() -> None:
    _code(_models(np.float32))


def float64_streams_updates_and_matrices() -> None:
    from deepcabac_py import apply_update, encode_model, encode_update
    from deepcabac_py.matrix.formats import from_stream

    _code(_models(np.float64))

    rng = np.random.default_rng(1)
    base = {"w": rng.normal(0, 0.1, (64, 64)).astype(np.float32), "b": np.zeros(64, np.float32)}
    new = {k: v + rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in base.items()}
    for method in ("stc", "sbc", "topk"):
        for coder in ("cabac", "golomb") if method != "topk" else ("cabac",):  # (Golomb: ternary levels only)
            apply_update(base, encode_update(new, base, density=0.1, method=method, coder=coder))
    data = encode_model(base, quantizer="nearest")
    x = rng.normal(0, 1, (64, 8)).astype(np.float32)
    for formats in ("cer", "cser"):
        for mat in from_stream(data, formats).values():
            mat @ x


PARTS = (float32_streams, float64_streams_updates_and_matrices)

if __name__ == "__main__":
    PARTS[int(sys.argv[1])]()
