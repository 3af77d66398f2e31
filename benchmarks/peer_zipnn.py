"""ZipNN 0.5.4 and zstd on the float tensors of an .npz, run inside the ZipNN venv (see setup.sh).

    $ZIPNN_VENV/bin/python benchmarks/peer_zipnn.py TENSORS.npz DTYPE

Answers commands on stdin, one JSON line per command line, so that bench_lossless.py can alternate
ZipNN's rounds with its own and both sides meet the machine in the same state:

- ``round THREADS``: ZipNN's compress, then decompress, of the whole set at THREADS threads, each
  timed: ``{"encode_s": ..., "decode_s": ...}``. ZipNN's compress overwrites its input (even a
  ``bytes`` object), so each round starts from fresh copies, made before its clock starts.
- ``sizes`` (after a round): compressed bytes of ZipNN's last round, of zstd-3 and of zstd-19.

bfloat16 arrays arrive as their uint16 bits.
"""
import json
import sys
import time

import numpy as np
import zstandard
from zipnn import ZipNN


def main() -> None:
    path, dtype = sys.argv[1], sys.argv[2]
    with np.load(path, allow_pickle=False) as z:
        blobs = [z[k].tobytes() for k in z.files]
    codecs: dict[int, ZipNN] = {}
    packed: list = []
    for line in sys.stdin:
        command, *args = line.split()
        if command == "round" and len(args) == 1:
            threads = int(args[0])
            codec = codecs.setdefault(threads, ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads))
            inputs = [bytearray(b) for b in blobs]
            t0 = time.perf_counter()
            packed = [codec.compress(b) for b in inputs]
            t1 = time.perf_counter()
            restored = [codec.decompress(p) for p in packed]
            t2 = time.perf_counter()
            if any(bytes(r) != b for r, b in zip(restored, blobs)):
                raise SystemExit("ZipNN did not restore its input")
            out = {"encode_s": t1 - t0, "decode_s": t2 - t1}
        elif command == "sizes" and packed:
            out = {"zipnn": sum(map(len, packed))}
            for level in (3, 19):
                c = zstandard.ZstdCompressor(level=level)
                out[f"zstd-{level}"] = sum(len(c.compress(b)) for b in blobs)
        else:
            raise SystemExit(f"unknown command {line.strip()!r}")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
