"""ZipNN 0.5.4 and zstd on the float tensors of an .npz, run inside the ZipNN venv (see setup.sh).

    $ZIPNN_VENV/bin/python benchmarks/peer_zipnn.py TENSORS.npz DTYPE THREADS REPEATS [WARMUP]

Prints one JSON object: compressed bytes per coder, and ZipNN's median encode and decode seconds
over the whole set at THREADS threads, after WARMUP untimed rounds (default 0). bfloat16 arrays arrive as their uint16 bits.
"""
import json
import statistics
import sys
import time

import numpy as np
import zstandard
from zipnn import ZipNN


def main() -> None:
    path, dtype, threads, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    with np.load(path, allow_pickle=False) as z:
        blobs = [z[k].tobytes() for k in z.files]
    codec = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads)
    enc, dec, packed = [], [], []
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        packed = [codec.compress(bytearray(b)) for b in blobs]  # (compress changes its input: a copy)
        t1 = time.perf_counter()
        restored = [codec.decompress(p) for p in packed]
        t2 = time.perf_counter()
        if r >= warmup:
            enc.append(t1 - t0)
            dec.append(t2 - t1)
    if any(bytes(r) != b for r, b in zip(restored, blobs)):
        raise SystemExit("ZipNN did not restore its input")
    out = {"zipnn": sum(map(len, packed)), "zipnn_encode_s": statistics.median(enc),
           "zipnn_decode_s": statistics.median(dec)}
    for level in (3, 19):
        c = zstandard.ZstdCompressor(level=level)
        out[f"zstd-{level}"] = sum(len(c.compress(b)) for b in blobs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
