"""Where the level decoder's time goes, on one matrix of the scale benchmark's kind (a 4096 x 11008
bf16 matrix of hf_synthetic.py, made on the spot, coded at qp -32 with the default trellis).

    .venv/bin/python benchmarks/bench_level_decoder.py [--qp -32] [--repeats 5]

Prints, side by side with what the scale issue's decode goal (80 M params/s on 2 threads) leaves per
level and thread: the level kernel alone (every substream in turn, one thread), decode_levels at 1
and 2 threads, and the bins the coder spends per level (context-coded and bypass, counted on the
first levels of one substream with the kernel's own scale and Rice rules), so that the time per
context-coded bin can be read off. Medians of the repeats.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_synthetic  # noqa: E402

from deepcabac_py import decode_levels, encode_model  # noqa: E402
from deepcabac_py.entropy import _cabac_kernels as K  # noqa: E402
from deepcabac_py.entropy import chunk_layout, levelcoder  # noqa: E402
from deepcabac_py.model import decoder  # noqa: E402

GOAL_PARAMS_PER_S = 80e6  # on 2 threads
COUNTED = 300_000  # levels whose bins are counted (a Python loop: the scale recursion is serial)


def median_time(fn, repeats: int) -> float:
    fn()  # (warm: compiled, caches filled)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def count_bins(levels: np.ndarray, layout: chunk_layout.ChunkLayout) -> tuple[float, float, np.ndarray]:
    """Context-coded and bypass bins per level, and the histogram of the Rice parameter, for a
    substream's first levels (no column prediction: the benchmark's matrix does not switch it on)."""
    ncols, k_offset = layout.ncols, layout.k_offset
    row, col, c = 0, np.zeros(max(ncols, 1), dtype=np.int64), layout.first_column(0)
    context = bypass = 0
    ks = np.zeros(len(levels), dtype=np.int64)
    for i, v in enumerate(levels.tolist()):
        u = 2 * abs(v) - (v > 0)
        s = (row + int(col[c])) >> 1 if ncols and i >= ncols else row
        bucket = int(K.BUCKET_LUT[s]) >> 8 if s < K.SMALL_SCALES else 2 * s.bit_length() + ((s >> (s.bit_length() - 2)) & 1)
        k = max(0, (bucket - 2 * K.SCALE_FRAC - k_offset) >> 1)
        context += min((u >> k) + 1, K.Q_MAX) + (k >= 2)
        bypass += k - 1 if k >= 2 else k
        ks[i] = k
        row += ((u << K.SCALE_FRAC) - row) >> K.ROW_SHIFT
        if ncols:
            col[c] += ((u << K.SCALE_FRAC) - int(col[c])) >> K.COL_SHIFT
            c = (c + 1) % ncols
    return context / len(levels), bypass / len(levels), np.bincount(ks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qp", type=int, default=-32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch

    bits = hf_synthetic.synthetic_tensor(np.random.default_rng(0), (4096, 11008))  # bf16 as uint16
    weight = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    data = encode_model({"w": weight}, qp=args.qp)
    stream, _ = decoder._open(data)
    e = stream.header.tensors[0]
    views = decoder._payload_views(stream, e)
    layout = chunk_layout.layout_from_stream(e.shape, e.chunk_elements, e.coder_param)
    outs = [np.empty(layout.size(k), dtype=np.int32) for k in range(layout.count)]

    def kernel_only() -> None:
        for k, out in enumerate(outs):
            levelcoder.decode_chunk(views[k], layout, k, out)

    n = e.numel
    kernel_s = median_time(kernel_only, args.repeats)
    whole = {t: median_time(lambda t=t: decode_levels(data, threads=t), args.repeats) for t in (1, 2)}
    probe = min(3, layout.count - 1)
    context, bypass, ks = count_bins(outs[probe][:COUNTED], layout)
    ns_level = kernel_s / n * 1e9
    budget = 2 / GOAL_PARAMS_PER_S * 1e9  # ns per level and thread that the goal allows

    print(f"{e.name}: {e.shape}, mode {e.mode.name}, {n:,} levels in {layout.count} substreams, "
          f"{len(data) * 8 / n:.3f} bits per level")
    print(f"{'':34}{'ns/level':>10}{'M levels/s':>12}{'/ goal':>8}")
    print(f"{'goal (80 M/s on 2 threads)':34}{budget:10.2f}{GOAL_PARAMS_PER_S / 2e6:12.1f}{'':>8}  (per thread)")
    print(f"{'level kernel, 1 thread':34}{ns_level:10.2f}{n / kernel_s / 1e6:12.1f}{budget / ns_level:8.3f}")
    for t, s in whole.items():
        rate = n / s / 1e6
        print(f"{f'decode_levels, {t} thread(s)':34}{s / n * 1e9:10.2f}{rate:12.1f}{rate / (40 * t):8.3f}")
    print(f"bins per level (first {COUNTED:,} of substream {probe}): {context:.3f} context-coded, {bypass:.3f} "
          f"bypass; Rice parameter histogram {ks.tolist()}")
    print(f"kernel time per context-coded bin, bypass bins counted free: {ns_level / context:.2f} ns")


if __name__ == "__main__":
    main()
