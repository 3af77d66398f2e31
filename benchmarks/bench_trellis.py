"""How near-exact and how fast the trellis is, on the 2-D tensors of all-MiniLM-L6-v2.

1. Context staleness: the trellis prices its candidates with one snapshot of the coder's contexts per
   block of rows (shared by its four paths) instead of a context copy per path per weight, as
   NNCodec does. Rebuilding the kernel with other minimum block sizes shows what the staleness
   costs: bytes and squared error of the coded tensors at qp -32 per block size.
2. Speed: ns per weight of nearest rounding, RDOQ and the trellis (levels only), of the level coder
   on the trellis levels, of the one pass encode_model runs (the trellis coding each block as it
   commits it), and of the decoder's last pass (levels to float32: plain levels times the step,
   trellis levels through the state machine), on the same tensors (one thread).

    .venv/bin/python benchmarks/bench_trellis.py [--tensors 10] [--blocks 64,256,1024,8192]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_minilm as bm  # noqa: E402

from deepcabac_py.entropy import chunk_layout, levelcoder
from deepcabac_py.quant.quantizers import DEFAULT_LAMBDA, quantize_nearest, quantize_rd, trellis_encode_chunk  # noqa: E402
from deepcabac_py.quant.reconstruct import dq_indices, reconstruct_f32_inplace  # noqa: E402
from deepcabac_py.quant.steps import step_from_qp  # noqa: E402

KERNEL = HERE.parent / "deepcabac_py" / "quant" / "_quantizer_kernels.py"


def kernel_with_block(block_min: int):
    """The trellis kernels compiled with another BLOCK_MIN (no cache: a private copy)."""
    src = KERNEL.read_text()
    src = ("import numba\nkernel = numba.njit(nogil=True)\ninline = numba.njit(inline='always')\n"
           + src.replace("from .._jit import inline, kernel", "")
           .replace("from ..entropy._cabac_kernels import", "from deepcabac_py.entropy._cabac_kernels import")
           .replace("from ._reconstruct_kernels import", "from deepcabac_py.quant._reconstruct_kernels import"))
    assert "BLOCK_MIN = 256" in src, "the kernel's BLOCK_MIN line changed"
    mod = types.ModuleType(f"trellis_block_{block_min}")
    exec(compile(src.replace("BLOCK_MIN = 256", f"BLOCK_MIN = {block_min}"), mod.__name__, "exec"), mod.__dict__)
    return mod


def staleness(weights, names, blocks, qp=-32) -> None:
    step = step_from_qp(qp)
    lam = DEFAULT_LAMBDA["trellis"]
    print(f"1. context staleness: trellis at qp {qp}, {len(names)} tensors "
          f"({sum(weights[n].size for n in names):,} weights)")
    print(f"{'BLOCK_MIN':>9} {'rows/block (384 cols)':>22} {'bytes':>12} {'vs 256':>8} {'squared error':>14}")
    rows = []
    for block_min in blocks:
        mod = kernel_with_block(block_min)
        nbytes, sse = 0, 0.0
        for name in names:
            x = weights[name].reshape(-1)
            layout = chunk_layout.layout_for_shape(weights[name].shape, max_abs_level=1 << 20)
            for k in range(layout.count):
                a, b = layout.bounds(k)
                out = np.empty(b - a, np.int32)
                mod.trellis_kernel(x[a:b], np.empty(0, np.float32), step, lam, layout.ncols,
                                   layout.first_column(a), layout.k_offset, layout.predict, out,
                                   np.empty(0, np.uint8))
                nbytes += len(levelcoder.encode_chunk(out, layout, k))
                err = x[a:b].astype(np.float64) - dq_indices(out) * step
                sse += float(err @ err)
        rows.append((block_min, nbytes, sse))
    ref = dict((b, n) for b, n, _ in rows).get(256, rows[0][1])
    for block_min, nbytes, sse in rows:
        print(f"{block_min:>9} {max(1, -(-block_min // 384)):>22} {nbytes:>12,} {nbytes / ref:>8.4f} {sse:>14.4f}")


def speed(weights, names, repeats=3, qp=-32) -> None:
    step = step_from_qp(qp)
    print("\n2. speed, one thread (best of", repeats, "runs)")
    totals = {}
    n = 0
    for name in names:
        x = weights[name].reshape(-1)
        layout = chunk_layout.layout_for_shape(weights[name].shape, max_abs_level=1 << 20)
        for k in range(layout.count):
            a, b = layout.bounds(k)
            part = x[a:b]
            n += part.size
            kw = dict(ncols=layout.ncols, col0=layout.first_column(a), k_offset=layout.k_offset,
                      predict=layout.predict)
            lam = DEFAULT_LAMBDA["trellis"]
            for method in ("nearest", "rdoq", "trellis"):
                add(totals, f"{method} (levels only)", min(
                    _timed(lambda: quantize_rd(part, step, method=method,
                                                        lam=DEFAULT_LAMBDA[method], **kw))
                    for _ in range(repeats)))
            levels = quantize_rd(part, step, method="trellis", lam=lam, **kw)
            add(totals, "level coder on trellis levels", min(
                _timed(lambda: levelcoder.encode_chunk(levels, layout, k)) for _ in range(repeats)))
            # what encode_model runs: the trellis codes each block as it commits it
            add(totals, "trellis + coding, one pass", min(
                _timed(lambda: trellis_encode_chunk(part, step, lam=lam, layout=layout, index=k))
                for _ in range(repeats)))
            # the decoder's last pass, levels to float32 in place: plain levels times the step, or
            # the trellis' levels through the state machine
            plain = quantize_nearest(part, step)
            for what, src, dependent in (("decode: plain levels -> float32", plain, False),
                                         ("decode: trellis levels -> float32", levels, True)):
                best = math.inf
                for _ in range(repeats):
                    buf = src.copy()
                    best = min(best, _timed(lambda: reconstruct_f32_inplace(buf, step, dependent=dependent)))
                add(totals, what, best)
    for what, seconds in totals.items():
        print(f"{what:>34}: {seconds / n * 1e9:7.2f} ns/weight")


def add(totals: dict, what: str, seconds: float) -> None:
    totals[what] = totals.get(what, 0.0) + seconds


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=10, help="how many 2-D tensors (in file order)")
    ap.add_argument("--blocks", default="64,256,1024,8192")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    weights = bm.load_weights()
    names = [k for k in weights if weights[k].ndim == 2 and weights[k].dtype == np.float32][:args.tensors]
    # compile once before timing
    quantize_rd(weights[names[0]].reshape(-1)[:4096], 2.0**-8, method="trellis", lam=0.46)
    staleness(weights, names, [int(b) for b in args.blocks.split(",")])
    speed(weights, names, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
