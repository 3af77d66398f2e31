"""Checkpoints at the scale people have them: synthetic Hugging Face bf16 directories (made on the
spot by hf_synthetic.py: no weights are committed or downloaded), encoded and decoded by the CLI as a
user runs it, at 1 and 2 threads, with zstd -3 on the same files for reference.

    .venv/bin/python benchmarks/bench_scale.py [--sizes 1.1GB,2.2GB] [--work /tmp/deepcabac-scale] [--keep]

For each size it prints wall time, params/s and the peak RSS of each command (its own process, from
wait4: the models are made in a subprocess too, since a child's peak starts at its parent's size),
the bytes, and the time to decode one large tensor (the embedding, 65 M params at 2.2 GB) from the
stream of the same model written as one file, by the CLI and in process (decode_model with names). The goals of the scale issue are checked at
the end: peak RSS <= 1.2 GB at 2.2 GB and flat in size (<= 1.25x from 1.1 to 2.2 GB), encode 2
threads >= 1.7x 1 thread, >= 30 M params/s encode and >= 80 M params/s decode on 2 threads, one
tensor in <= 2 s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_synthetic  # noqa: E402  (its sizes; the models are made by running it)

CLI = [sys.executable, "-m", "deepcabac_py.cli.main"]


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one command in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return wall, usage.ru_maxrss * 1024


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def make(path: Path, size: str, *flags: str) -> None:
    subprocess.run([sys.executable, str(HERE / "hf_synthetic.py"), str(path), "--size", size, *flags], check=True,
                   stdout=subprocess.DEVNULL)


def params_of(index: dict) -> int:
    return index["metadata"]["total_size"] // 2


def zstd_reference(src: Path, work: Path) -> dict:
    shards = sorted(src.glob("*.safetensors"))
    out = {"bytes": 0, "encode_s": 0.0, "decode_s": 0.0}
    for shard in shards:
        z = work / (shard.name + ".zst")
        wall, _ = run(["zstd", "-3", "-T1", "-q", "-f", str(shard), "-o", str(z)])
        out["encode_s"] += wall
        out["bytes"] += z.stat().st_size
        wall, _ = run(["zstd", "-d", "-T1", "-q", "-f", str(z), "-o", str(work / "zstd.out")])
        out["decode_s"] += wall
        z.unlink()
        (work / "zstd.out").unlink()
    return out


def bench_size(name: str, work: Path, env: dict) -> dict:
    src = work / f"model-{name}"
    if not src.exists():
        make(src, name)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    params = params_of(index)
    row: dict = {"size": name, "params": params, "bf16_bytes": index["metadata"]["total_size"]}
    for threads in (1, 2):
        enc, dec = work / f"enc-{name}", work / f"dec-{name}"
        wall, rss = run(CLI + ["encode", str(src), "-o", str(enc), "-f", "-q", "--threads", str(threads)], env)
        row[f"encode_{threads}t"] = {"s": wall, "params_per_s": params / wall, "rss": rss}
        row["stream_bytes"] = du(enc)
        wall, rss = run(CLI + ["decode", str(enc), "-o", str(dec), "-f", "-q", "--threads", str(threads)], env)
        row[f"decode_{threads}t"] = {"s": wall, "params_per_s": params / wall, "rss": rss}
        shutil.rmtree(dec)
    shutil.rmtree(work / f"enc-{name}")
    row["zstd3"] = zstd_reference(src, work)
    return row


def one_tensor(name: str, work: Path, env: dict) -> dict:
    """The stream of the model as one file, and one large tensor decoded out of it."""
    hidden = hf_synthetic.SIZES[name][0]
    single = work / f"single-{name}"
    if not single.exists():
        make(single, name, "--one-file")
    src = single / "model-00001-of-00001.safetensors"
    stream = work / "single.dcb"
    wall, rss = run(CLI + ["encode", str(src), "-o", str(stream), "-f", "-q"], env)
    out = {"file_bytes": src.stat().st_size, "encode_s": wall, "encode_rss": rss, "stream_bytes": stream.stat().st_size}
    tensor = "model.embed_tokens.weight"
    wall, rss = run(CLI + ["decode", str(stream), "-o", str(work / "one.safetensors"), "-f", "-q",
                           "--tensor", tensor], env)
    out.update({"tensor": tensor, "tensor_params": 32000 * hidden, "one_tensor_s": wall, "one_tensor_rss": rss})
    code = ("import sys, time\nfrom deepcabac_py import decode_model\nt = time.perf_counter()\n"
            f"decode_model({str(stream)!r}, names=[{tensor!r}])\nprint(time.perf_counter() - t)\n")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    out["one_tensor_in_process_s"] = float(done.stdout.split()[-1])
    wall, rss = run(CLI + ["decode", str(stream), "-o", str(work / "all.safetensors"), "-f", "-q"], env)
    out.update({"decode_s": wall, "decode_rss": rss})
    for p in (stream, work / "one.safetensors", work / "all.safetensors"):
        p.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.1GB,2.2GB")
    ap.add_argument("--work", default="/tmp/deepcabac-scale")
    ap.add_argument("--single", default="2.2GB", help="size of the one-file model for the one-tensor figure")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic models for the next run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    subprocess.run(CLI + ["--version"], check=True, capture_output=True, env=env)  # (kernels compiled, cached)
    rows = [bench_size(s, work, env) for s in args.sizes.split(",")]
    single = one_tensor(args.single, work, env) if args.single else None
    if not args.keep:
        for p in work.glob("model-*"):
            shutil.rmtree(p)
        for p in work.glob("single-*"):
            shutil.rmtree(p)
    result = {"rows": rows, "single": single}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    gb = 1e9
    print(f"{'size':>7} {'params':>14} {'bf16 bytes':>15} {'stream bytes':>15} {'ratio':>6} {'zstd-3 ratio':>12}")
    for r in rows:
        print(f"{r['size']:>7} {r['params']:>14,} {r['bf16_bytes']:>15,} {r['stream_bytes']:>15,} "
              f"{r['bf16_bytes'] / r['stream_bytes']:6.2f} {r['bf16_bytes'] / r['zstd3']['bytes']:12.3f}")
    print()
    print(f"{'size':>7} {'command':>10} {'wall s':>8} {'M params/s':>11} {'peak RSS GB':>12}")
    for r in rows:
        for key in ("encode_1t", "encode_2t", "decode_1t", "decode_2t"):
            m = r[key]
            print(f"{r['size']:>7} {key:>10} {m['s']:8.1f} {m['params_per_s'] / 1e6:11.1f} {m['rss'] / gb:12.2f}")
        z = r["zstd3"]
        print(f"{r['size']:>7} {'zstd-3 enc':>10} {z['encode_s']:8.1f} {r['params'] / z['encode_s'] / 1e6:11.1f}")
        print(f"{r['size']:>7} {'zstd-3 dec':>10} {z['decode_s']:8.1f} {r['params'] / z['decode_s'] / 1e6:11.1f}")
    if single:
        print()
        print(f"one file of {single['file_bytes']:,} bytes -> stream of {single['stream_bytes']:,} bytes: encode "
              f"{single['encode_s']:.1f} s ({single['encode_rss'] / gb:.2f} GB), decode {single['decode_s']:.1f} s "
              f"({single['decode_rss'] / gb:.2f} GB)")
        print(f"one tensor ({single['tensor']}, {single['tensor_params']:,} params): {single['one_tensor_s']:.2f} s, "
              f"{single['one_tensor_rss'] / gb:.2f} GB (the CLI, start-up included); "
              f"{single['one_tensor_in_process_s']:.2f} s in process")
    print()
    last, first = rows[-1], rows[0]
    peak = max(last[k]["rss"] for k in ("encode_1t", "encode_2t", "decode_1t", "decode_2t"))
    peak0 = max(first[k]["rss"] for k in ("encode_1t", "encode_2t", "decode_1t", "decode_2t"))
    goals = [
        (f"peak RSS at {last['size']} <= 1.2 GB", peak / gb, peak <= 1.2 * gb),
        (f"peak RSS {first['size']} -> {last['size']} <= 1.25x", peak / peak0, peak <= 1.25 * peak0),
        ("encode 2 threads / 1 thread >= 1.7x", last["encode_1t"]["s"] / last["encode_2t"]["s"],
         last["encode_1t"]["s"] / last["encode_2t"]["s"] >= 1.7),
        ("encode >= 30 M params/s (2 threads)", last["encode_2t"]["params_per_s"] / 1e6,
         last["encode_2t"]["params_per_s"] >= 30e6),
        ("decode >= 80 M params/s (2 threads)", last["decode_2t"]["params_per_s"] / 1e6,
         last["decode_2t"]["params_per_s"] >= 80e6),
    ]
    if single:
        goals.append(("one tensor <= 2 s (CLI)", single["one_tensor_s"], single["one_tensor_s"] <= 2.0))
    for what, value, ok in goals:
        print(f"{'met ' if ok else 'MISS'} {what}: {value:.2f}")


if __name__ == "__main__":
    main()
