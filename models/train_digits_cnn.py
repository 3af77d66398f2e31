"""Train the reference DigitsCNN and write the files shipped in models/.

    python models/train_digits_cnn.py

Needs scikit-learn (for the data set and the split) and safetensors; nothing that
loads the results does. Writes digits_cnn.safetensors, digits_cnn.pt and
digits_eval.npz next to this file.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from digits_cnn import (
    CHECKPOINT_PATH,
    EVAL_SET_PATH,
    PIXEL_MAX,
    SAFETENSORS_PATH,
    DigitsCNN,
    accuracy,
)
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 0
EVAL_SIZE = 360  # 1797 images -> 1437 train / 360 eval
EPOCHS = 40
BATCH_SIZE = 64
LR = 3e-3
WEIGHT_DECAY = 1e-4
MIN_ACCURACY = 0.97


def split_digits() -> tuple[np.ndarray, ...]:
    """Stratified split; returns uint8 images [N, 8, 8], int64 labels and source indices."""
    digits = load_digits()
    images = digits.images.astype(np.uint8)  # exact: values are integers 0..16
    labels = digits.target.astype(np.int64)
    index = np.arange(len(labels), dtype=np.int64)
    tr_i, ev_i = train_test_split(
        index, test_size=EVAL_SIZE, stratify=labels, random_state=SEED
    )
    # Sorted so the eval file lists images in load_digits order.
    tr_i, ev_i = np.sort(tr_i), np.sort(ev_i)
    return images[tr_i], labels[tr_i], images[ev_i], labels[ev_i], ev_i


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images.astype(np.float32) / PIXEL_MAX).unsqueeze(1)


def random_shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift each image by up to one pixel; digits are roughly but not exactly centred."""
    n = x.shape[0]
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (n,), generator=gen)
    dx = torch.randint(0, 3, (n,), generator=gen)
    out = torch.empty_like(x)
    for i in range(n):
        out[i] = padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8]
    return out


def train(x_tr: torch.Tensor, y_tr: torch.Tensor, epochs: int) -> DigitsCNN:
    gen = torch.Generator().manual_seed(SEED)
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = -(-len(y_tr) // BATCH_SIZE)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, epochs=epochs, steps_per_epoch=steps_per_epoch
    )
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y_tr), generator=gen)
        total = 0.0
        for start in range(0, len(order), BATCH_SIZE):
            idx = order[start : start + BATCH_SIZE]
            xb = random_shift(x_tr[idx], gen)
            loss = F.cross_entropy(model(xb), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        if (epoch + 1) % 10 == 0 or epoch == 0:
            print(f"epoch {epoch + 1:3d}  train loss {total / len(y_tr):.4f}")
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args(argv)

    # One thread and deterministic kernels so reruns give bit-identical weights
    # (on the same CPU type; other SIMD paths may round differently).
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    img_tr, lab_tr, img_ev, lab_ev, ev_index = split_digits()
    model = train(to_tensor(img_tr), torch.from_numpy(lab_tr), args.epochs)

    # Contiguous fp32 clones: safetensors refuses shared or non-contiguous storage.
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    acc = accuracy(sd, to_tensor(img_ev), torch.from_numpy(lab_ev))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params}  eval accuracy {acc:.4f}  ({time.perf_counter() - t0:.1f}s)")
    if acc < MIN_ACCURACY:
        print(f"eval accuracy below {MIN_ACCURACY}; not writing files", file=sys.stderr)
        return 1

    save_file(
        sd,
        str(SAFETENSORS_PATH),
        metadata={
            "format": "pt",
            "model": "DigitsCNN",
            "dataset": "sklearn digits",
            "eval_accuracy": f"{acc:.4f}",
            "params": str(n_params),
            "epochs": str(args.epochs),
            "seed": str(SEED),
        },
    )
    torch.save({"state_dict": sd, "epoch": args.epochs, "eval_accuracy": acc}, CHECKPOINT_PATH)
    np.savez_compressed(EVAL_SET_PATH, images=img_ev, labels=lab_ev, index=ev_index)
    for path in (SAFETENSORS_PATH, CHECKPOINT_PATH, EVAL_SET_PATH):
        print(f"wrote {path.name} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
