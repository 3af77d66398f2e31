"""Decode time and memory against the payload, for the densest streams the format allows.

The header parser refuses a tensor that claims more levels than its payload can code
(``levelcoder.max_elements_for_payload``), so the worst a stream can ask for per payload byte is
what an all-zero tensor really achieves. This prints, for growing all-zero tensors and for the same
streams with their payload replaced by random bytes (checksums recomputed, so the level decoder runs
on garbage), the decode time and peak memory per payload byte: both stay flat as the payload grows,
i.e. decoding is linear in the payload, and memory is the output array the header's claim bounds.

    .venv/bin/python benchmarks/bench_decode_bounds.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
import zlib

import numpy as np

import deepcabac_py as dc
from deepcabac_py.entropy.levelcoder import max_elements_for_payload
from deepcabac_py.errors import DeepCabacError
from deepcabac_py.model.container import pack_header, read_header

SIZES = (1 << 20, 1 << 22, 1 << 24)


def with_random_payload(data: bytes, seed: int) -> bytes:
    header = read_header(memoryview(data), total_size=len(data))
    rng = np.random.default_rng(seed)
    payload = bytearray(rng.integers(0, 256, len(data) - header.header_size, dtype=np.uint8).tobytes())
    for e in header.tensors:
        e.crc32 = zlib.crc32(payload[e.offset:e.offset + e.size])
    return pack_header(header.qp, header.qp_1d, header.qp_density, header.metadata, header.tensors) + bytes(payload)


def measure(data: bytes, repeats: int) -> tuple[float, int, str]:
    times, outcome = [], "ok"
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            dc.decode_levels(data, threads=1)
        except DeepCabacError as exc:
            outcome = type(exc).__name__
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        dc.decode_levels(data, threads=1)
    except DeepCabacError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak, outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dc.decode_levels(dc.encode_model({"w": np.zeros((64, 64), np.float32)}, quantizer="nearest"))  # compile

    print("| payload | elements | elements / payload byte (bound) | decode | ns / element | µs / payload byte "
          "| peak memory / payload byte | outcome |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label in ("all-zero tensor", "same header, random payload"):
        for n in SIZES:
            data = dc.encode_model({"w": np.zeros((n // 1024, 1024), np.float32)}, quantizer="nearest", threads=1)
            if label != "all-zero tensor":
                data = with_random_payload(data, n)
            header = dc.read_stream_header(data)
            payload = len(data) - header.header_size
            chunks = header.tensors[0].chunk_sizes
            bound = sum(max_elements_for_payload(c) for c in chunks)
            seconds, peak, outcome = measure(data, args.repeats)
            print(f"| {label}, {payload:,} B | {n:,} | {n / payload:,.0f} ({bound / payload:,.0f}) "
                  f"| {seconds * 1e3:.1f} ms | {seconds / n * 1e9:.2f} | {seconds / payload * 1e6:.2f} "
                  f"| {peak / payload:,.0f} B | {outcome} |")


if __name__ == "__main__":
    main()
