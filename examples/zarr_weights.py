"""A weight matrix in a zarr array whose chunks are deepcabac streams.

    .venv/bin/pip install -e '.[zarr]' && .venv/bin/python examples/zarr_weights.py [DIR]

``DeepCabacZarr3`` is a zarr 3 array-to-bytes codec (registered as ``"numcodecs.deepcabac"``, so the
array reopens from its ``zarr.json`` alone) and ``DeepCabac`` the numcodecs codec behind it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numcodecs
import numpy as np
import zarr

from deepcabac_py.integrations.zarr_codec import DeepCabac, DeepCabacZarr3


def main(where: Path) -> None:
    w = np.random.default_rng(0).normal(0, 0.02, size=(768, 3072)).astype(np.float32)  # a weight matrix
    path = where / "weights.zarr"
    z = zarr.create_array(str(path), shape=w.shape, chunks=(256, 3072), dtype="float32",
                          serializer=DeepCabacZarr3(step=2e-4), compressors=None, overwrite=True)
    z[:] = w
    back = zarr.open_array(str(path), mode="r")[:]  # the codec is found from zarr.json alone
    within = bool(np.abs(back - w).max() <= DeepCabac(step=2e-4).effective_step / 2)
    print(f"within step/2: {within}; {w.nbytes:,} bytes of float32 stored in {z.nbytes_stored():,}")

    codec = numcodecs.get_codec({"id": "deepcabac", "step": 2e-4})  # numcodecs alone
    ids = np.arange(1000, dtype=np.int64) % 7
    print(f"integers lossless: {np.array_equal(codec.decode(codec.encode(ids)), ids)}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
