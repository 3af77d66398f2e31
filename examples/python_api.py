"""The Python API on the project's reference model: encode, inspect, decode, levels, rate control.

    .venv/bin/python examples/python_api.py

Every call here is a public name of ``deepcabac_py``; the model is ``models/digits_cnn.safetensors``
(a 15k-parameter CNN trained on scikit-learn's digits).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import deepcabac_py as dc
from deepcabac_py.tuning.rate_control import encode_to_size

MODEL = Path(__file__).resolve().parents[1] / "models" / "digits_cnn.safetensors"


def main() -> None:
    state = dc.load_checkpoint(MODEL).tensors  # name -> tensor, as the file holds them
    data = dc.encode_model(state, qp=-32)  # the defaults: trellis, structural importance
    header = dc.read_stream_header(data)  # no payload decoding
    print(f"{MODEL.name}: {len(header.tensors)} tensors, {header.total_size:,} bytes "
          f"(header {header.header_size:,}); format version {header.version}")

    restored = dc.decode_model(data)
    worst = max(float(np.abs(np.asarray(restored[k]) - np.asarray(v)).max()) for k, v in state.items())
    print(f"decoded: same names, shapes and dtypes; largest error {worst:.2e}")

    levels = dc.decode_levels(data)  # integer levels and steps, for integer inference
    name = max(levels, key=lambda n: levels[n].levels.size)
    q = levels[name]
    print(f"{name}: int32 levels {q.levels.shape}, step {q.step:g} (qp {q.qp}), "
          f"levels * step == decoded: {np.array_equal(q.dequantize(), np.asarray(restored[name]))}")

    same = dc.encode_model(state, qp=-32, threads=1) == data
    print(f"the same bytes on one thread: {same}")

    exact = dc.encode_model(state, keep_exact=True)  # every float tensor bit-exact
    back = dc.decode_model(exact)
    print(f"keep_exact: {len(exact):,} bytes, bit-exact: "
          f"{all(np.array_equal(np.asarray(back[k]), np.asarray(v)) for k, v in state.items())}")

    budget = len(data) * 3 // 4
    small = encode_to_size(state, target_bytes=budget)  # qp (then lambda) chosen for a byte budget
    print(f"encode_to_size({budget:,}): {len(small):,} bytes at qp {dc.read_stream_header(small).qp}")


if __name__ == "__main__":
    main()
