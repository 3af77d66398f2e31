"""How fast a checkpoint series takes and gives back the checkpoints of a larger model: a GPT-2 with
AdamW (29M parameters and 354 MB per checkpoint at the defaults), a few steps between checkpoints,
against writing the same checkpoint with ``torch.save`` to memory (what saving it costs anyway).

For every append: its time and MB/s of the checkpoint (model and optimizer state in float32); then
the time to extract the newest entry from a new object (the chain from its key decoded). The bytes
of the series do not depend on the threads: one figure, whatever the machine.

    .venv/bin/python benchmarks/bench_series_append.py [--checkpoints 4] [--layers 8] [--width 512]

Needs transformers (the test extra has it).
"""
from __future__ import annotations

import argparse
import copy
import io
import os
import statistics
import tempfile
import time

import torch
import transformers

from deepcabac_py import CheckpointSeries


def checkpoints(count: int, layers: int, width: int, steps: int) -> list[dict]:
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=128, n_embd=width, n_layer=layers, n_head=8,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(count):
        for _ in range(steps):
            x = torch.randint(0, cfg.vocab_size, (4, 128), generator=g)
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        out.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps * (k + 1)}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="training steps between checkpoints")
    args = ap.parse_args()
    ckpts = checkpoints(args.checkpoints, args.layers, args.width, args.steps)
    # (the output layer shares the input embedding's storage: counted once)
    params = sum({t.data_ptr(): t.numel() for t in ckpts[0]["model"].values()}.values())
    saved = []
    for c in ckpts:
        t = time.perf_counter()
        buf = io.BytesIO()
        torch.save(c, buf)
        saved.append(time.perf_counter() - t)
    mb = buf.tell() / 1e6
    print(f"GPT-2, {params:,} params, AdamW: {args.checkpoints} checkpoints of {mb:.1f} MB, "
          f"{args.steps} steps apart")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.dcs")
        series = CheckpointSeries(path)
        print(f"{'entry':>5} {'kind':>9} {'append s':>9} {'MB/s':>7} {'torch.save s':>13} {'ratio':>6}")
        for i, c in enumerate(ckpts):
            t = time.perf_counter()
            series.append(c)
            took = time.perf_counter() - t
            kind = series.entries()[-1].kind
            print(f"{i:5d} {kind:>9} {took:9.2f} {mb / took:7.1f} {saved[i]:13.2f} {took / saved[i]:5.1f}x")
        t = time.perf_counter()
        CheckpointSeries(path).checkpoint(len(ckpts) - 1)
        extract = time.perf_counter() - t
        size = os.path.getsize(path)
    print(f"extract entry {len(ckpts) - 1} (its chain from the key): {extract:.2f} s, {mb / extract:.1f} MB/s")
    print(f"series: {size:,} bytes, {len(ckpts) * buf.tell() / size:.1f}x the torch.save bytes; "
          f"torch.save median {statistics.median(saved):.2f} s")


if __name__ == "__main__":
    main()
