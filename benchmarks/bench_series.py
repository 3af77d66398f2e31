"""Training checkpoints with Adam, stored as a checkpoint series, against the raw .pt files, xz of
them, each checkpoint coded on its own, and ExCP's pipeline reproduced from the paper's
description (Li et al., ICML 2024: residual against the previous reconstruction, weight residuals
pruned by the second moment, moments pruned, 4-bit k-means codebooks, a general-purpose compressor:
LZMA here, as 7-Zip uses), with the fidelity of each for resumption.

Two real runs on data at hand: the project's DigitsCNN on scikit-learn's digits, and a character-level
LSTM on the source of a few standard-library modules. For each stored checkpoint: the decoded weights' held-out
loss against the original's, the next Adam step on a fixed batch (cosine and norm against the
original's), and training resumed from the middle checkpoint (the held-out loss every 20 steps,
each the mean over three batch orders: the resumed-loss curve, against resuming from the original).

    .venv/bin/python benchmarks/bench_series.py [--checkpoints 12] [--every 40] [--key-every 10]
    .venv/bin/python benchmarks/bench_series.py --optimizer sgd
    .venv/bin/python benchmarks/bench_series.py --sweep-key-every 1,5,10,20 [--checkpoints 20]
    .venv/bin/python benchmarks/bench_series.py --floor

The second form trains both runs with SGD (momentum 0.9) instead of Adam, without ExCP (whose
pruning follows Adam's second moments): the series codes SGD's buffers and weights by SGD's step
as it codes Adam's by Adam's.
The third form measures the choice of ``key_every`` on the char-LSTM run: the series' bytes, and
the mean and worst time to extract one entry from a fresh object (the chain from its key decoded).
The fourth prints what Adam's first moments alone cost at the goal's next-step cosine, rounded in
the update domain and counted by their order-0 entropy: a floor on the bits of any coder that does
not predict them, beside the raw files' bits per parameter.

Goals (the checkpoint issue): the series at least 50x smaller than the raw files at this fidelity
(held-out loss within 0.5%, next-step cosine >= 0.99, norm within 5%), at most 0.5x ExCP's bytes at
equal or better resumed loss; the lossless series (``keep_exact=True``, bit for bit) at least 1.3x.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import io
import lzma
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

import deepcabac_py as dc  # noqa: E402

# --- the two runs ---------------------------------------------------------------------------------

_TEXT_MODULES = ("argparse", "pathlib", "dataclasses", "textwrap")


def source_text() -> str:
    """A text that does not change with this project's files (its documentation did, and with it
    the run): the source of a few standard-library modules, fixed for a Python version."""
    return "".join(inspect.getsource(importlib.import_module(m)) for m in _TEXT_MODULES)


class CharLSTM(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 48)
        self.lstm = torch.nn.LSTM(48, 160, batch_first=True)
        self.out = torch.nn.Linear(160, vocab)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


RESUMED_EVERY = 20  # steps between the points of a resumed-loss curve


class Run:
    """A model, its data and its loss: batches by index, a held-out set."""

    def __init__(self, name: str, optimizer: str = "adam"):
        self.name, self.kind = name, optimizer
        g = torch.Generator().manual_seed(0)
        if name == "digits-cnn":
            from digits_cnn import DigitsCNN
            from sklearn.datasets import load_digits
            d = load_digits()
            x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
            y = torch.from_numpy(d.target.astype(np.int64))
            perm = torch.randperm(len(y), generator=g)
            self.x, self.y = x[perm[:1437]], y[perm[:1437]]
            self.hx, self.hy = x[perm[1437:]], y[perm[1437:]]
            self.make = DigitsCNN
        else:
            text = source_text()
            chars = sorted(set(text))
            ids = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
            n = (len(ids) - 1) // 65 * 65
            seqs = ids[:n + 1]
            x = seqs[:n].reshape(-1, 65)[:, :64]
            y = seqs[1:n + 1].reshape(-1, 65)[:, :64]
            perm = torch.randperm(len(x), generator=g)
            cut = int(len(x) * 0.9)
            self.x, self.y, self.hx, self.hy = x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]
            vocab = len(chars)
            self.make = lambda: CharLSTM(vocab)

    def loss(self, model, x, y):
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def batch(self, i: int, order: int = 0):
        g = torch.Generator().manual_seed(1000 * order + i)
        idx = torch.randint(0, len(self.y), (64,), generator=g)
        return self.x[idx], self.y[idx]

    def optimizer(self, model):
        if self.kind == "sgd":  # (learning rates tuned by hand for each run: held-out loss 0.013 and 1.19)
            return torch.optim.SGD(model.parameters(), lr=0.05 if self.name == "digits-cnn" else 1.0, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=2e-3)

    def train(self, checkpoints: int, every: int) -> list[dict]:
        torch.manual_seed(0)
        model = self.make()
        opt = self.optimizer(model)
        out, step = [], 0
        for _ in range(checkpoints):
            model.train()
            for _ in range(every):
                x, y = self.batch(step)
                opt.zero_grad()
                self.loss(model, x, y).backward()
                opt.step()
                step += 1
            out.append({"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
                        "step": step})
        return out

    def restored(self, ckpt):
        ckpt = copy.deepcopy(ckpt)
        model = self.make()
        model.load_state_dict(ckpt["model"])
        opt = self.optimizer(model)
        opt.load_state_dict(ckpt["optimizer"])
        return model, opt

    def held_out(self, ckpt) -> float:
        model, _ = self.restored(ckpt)
        model.eval()
        with torch.no_grad():
            return self.loss(model, self.hx, self.hy).item()

    def next_step(self, ckpt) -> torch.Tensor:
        model, opt = self.restored(ckpt)
        model.train()
        before = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
        x, y = self.batch(10**6)
        opt.zero_grad()
        self.loss(model, x, y).backward()
        opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before

    def resumed(self, ckpt, steps: int, orders: int = 3, every: int = RESUMED_EVERY) -> list[float]:
        """The held-out loss along ``steps`` more steps (at 0, ``every``, 2 * ``every``... and
        ``steps``), each the mean over ``orders`` batch orders: the resumed-loss curve."""
        marks = sorted({*range(0, steps, every), steps})
        curves = []
        for order in range(1, orders + 1):
            model, opt = self.restored(ckpt)
            curve = []
            for i in range(steps + 1):
                if i in marks:
                    model.eval()
                    with torch.no_grad():
                        curve.append(self.loss(model, self.hx, self.hy).item())
                if i < steps:
                    model.train()
                    x, y = self.batch(i, order)
                    opt.zero_grad()
                    self.loss(model, x, y).backward()
                    opt.step()
            curves.append(curve)
        return [float(v) for v in np.mean(curves, axis=0)]


# --- ExCP, reproduced -----------------------------------------------------------------------------

EXCP_ALPHA = 5e-5


def _kmeans_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """4-bit indices (0: zero) and a 15-centre fp16 codebook of the nonzero ``values`` (1-D k-means)."""
    idx = np.zeros(values.shape, dtype=np.uint8)
    nz = values != 0
    if not nz.any():
        return idx, np.zeros(15, np.float16)
    v = values[nz].astype(np.float64)
    centres = np.quantile(v, np.linspace(0, 1, 15))
    for _ in range(20):
        assign = np.abs(v[:, None] - centres[None, :]).argmin(1)
        for k in range(15):
            if np.any(assign == k):
                centres[k] = v[assign == k].mean()
    book = centres.astype(np.float16)
    idx[nz] = np.abs(v[:, None] - book.astype(np.float64)[None, :]).argmin(1).astype(np.uint8) + 1
    return idx, book


def _decode_codes(idx: np.ndarray, book: np.ndarray) -> np.ndarray:
    table = np.concatenate(([0.0], book.astype(np.float64)))
    return table[idx]


def excp(checkpoints: list[dict]) -> tuple[list[int], list[dict]]:
    """Bytes and reconstructions of each checkpoint under ExCP (each against the previous
    reconstruction; the first against zero)."""
    sizes, recons = [], []
    prev: dict | None = None
    for ck in checkpoints:
        out = copy.deepcopy(ck)
        blob = io.BytesIO()
        states = ck["optimizer"]["state"]
        # which optimizer state belongs to which weight (the order of the parameters)
        params = list(ck["model"].items())
        float_params = [(n, t) for n, t in params if t.is_floating_point() and not n.endswith(("running_mean", "running_var"))]
        pidx = {name: i for i, (name, _) in enumerate(float_params)}
        for name, t in params:
            w = t.double().numpy()
            base = prev["model"][name].double().numpy() if prev is not None else np.zeros_like(w)
            if not t.is_floating_point():
                blob.write(t.numpy().tobytes())
                continue
            d = w - base
            i = pidx.get(name)
            st = states.get(i) if i is not None else None
            if st is not None:
                v = st["exp_avg_sq"].double().numpy()
                scale = min(2.5, EXCP_ALPHA / max(np.sqrt(v.mean()), 1e-30))
                keep = np.abs(d) > np.median(np.abs(d)) * scale
                d = np.where(keep, d, 0.0)
                m = st["exp_avg"].double().numpy()
                mk = (np.abs(m) > 2 * np.abs(m).mean()) & keep
                for key, arr in (("exp_avg", m), ("exp_avg_sq", v)):
                    codes, book = _kmeans_codes(np.where(mk, arr, 0.0))
                    blob.write(np.packbits(np.unpackbits(codes[..., None], axis=-1)[..., 4:]).tobytes())
                    blob.write(book.tobytes())
                    out["optimizer"]["state"][i][key] = torch.from_numpy(_decode_codes(codes, book)).to(st[key].dtype)
            codes, book = _kmeans_codes(d)
            blob.write(np.packbits(np.unpackbits(codes[..., None], axis=-1)[..., 4:]).tobytes())
            blob.write(book.tobytes())
            out["model"][name] = torch.from_numpy(base + _decode_codes(codes, book)).to(t.dtype)
        for st in states.values():
            blob.write(st["step"].numpy().tobytes())
        sizes.append(len(lzma.compress(blob.getvalue(), preset=9)))
        recons.append(out)
        prev = out
    return sizes, recons


# --- the table --------------------------------------------------------------------------------------


def pt_bytes(ck) -> bytes:
    buf = io.BytesIO()
    torch.save(ck, buf)
    return buf.getvalue()


def fidelity(run: Run, originals: list[dict], decoded: list[dict], middle: int, resume_steps: int) -> dict:
    rel = max(abs(run.held_out(d) / run.held_out(o) - 1) for o, d in zip(originals, decoded))
    cos, norm = 1.0, 0.0
    for o, d in zip(originals, decoded):
        a, b = run.next_step(o), run.next_step(d)
        cos = min(cos, F.cosine_similarity(a, b, dim=0).item())
        norm = max(norm, abs(b.norm().item() / a.norm().item() - 1))
    return {"held-out loss, max rel. diff": rel, "next step cosine, min": cos, "next step norm, max diff": norm,
            "resumed loss": run.resumed(decoded[middle], resume_steps)}


def sweep_key_every(values: list[int], checkpoints: int, every: int) -> None:
    cks = Run("char-lstm").train(checkpoints, every)
    print(f"char-lstm, {checkpoints} checkpoints every {every} steps: key_every against bytes and extraction time")
    print(f"{'key_every':>9} {'bytes':>12} {'vs key_every 1':>15} {'extract mean s':>15} {'worst s':>8}")
    first = None
    for k in values:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run.dcs"
            series = dc.CheckpointSeries(path, key_every=k)
            for c in cks:
                series.append(c)
            size = sum(e.bytes for e in series.entries())
            times = []
            for i in range(len(cks)):
                t0 = time.perf_counter()
                dc.CheckpointSeries(path)[i]
                times.append(time.perf_counter() - t0)
        first = first or size
        print(f"{k:>9} {size:>12,} {size / first:>14.3f}x {np.mean(times):>15.3f} {max(times):>8.3f}")


def _entropy_bits(q: np.ndarray) -> float:
    """Order-0 entropy of integer levels, in bits (all of them)."""
    _, counts = np.unique(q, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum()) * q.size


def floor(run: Run, cks: list[dict], fractions=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)) -> None:
    """What Adam's first moments alone cost at the fidelity of the goal: each exp_avg rounded in the
    update domain (m / sqrt(v), v exact, a step of ``f`` times its root mean square per tensor), the
    next step's cosine against the original's (smallest over checkpoints 1, middle and last), and
    the order-0 entropy of those levels: a floor for any scalar coder of m that does not predict it
    (m is its gradients of the last ~10 steps: beta1^40 leaves nothing of the parent)."""
    params = sum(t.numel() for t in cks[0]["model"].values())
    picks = [1, len(cks) // 2, len(cks) - 1]
    print(f"{'step / rms(u)':>14} {'next-step cosine, min':>22} {'m bits/param':>13} {'ratio bound if m were all':>26}")
    for f in fractions:
        cosines, bits = [], []
        for i in picks:
            d = copy.deepcopy(cks[i])
            total = 0.0
            for st in d["optimizer"]["state"].values():
                m, v = st["exp_avg"].double().numpy(), st["exp_avg_sq"].double().numpy()
                scale = np.sqrt(v) + 1e-8
                u = m / scale
                step = f * np.sqrt(np.mean(u * u)) + 1e-300
                q = np.rint(u / step)
                total += _entropy_bits(q)
                st["exp_avg"] = torch.from_numpy(q * step * scale).to(st["exp_avg"].dtype)
            a, b = run.next_step(cks[i]), run.next_step(d)
            cosines.append(F.cosine_similarity(a, b, dim=0).item())
            bits.append(total / params)
        raw_bits = 8 * sum(len(pt_bytes(c)) for c in cks) / len(cks) / params
        print(f"{f:>14.2f} {min(cosines):>22.4f} {np.mean(bits):>13.2f} {raw_bits / np.mean(bits):>25.1f}x")


def bits_equal(a, b) -> bool:
    """Whether two checkpoints hold the same structure and every tensor bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=12)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--key-every", type=int, default=10)
    ap.add_argument("--resume-steps", type=int, default=80)
    ap.add_argument("--sweep-key-every", default=None, help="comma-separated key_every values to compare")
    ap.add_argument("--floor", action="store_true", help="only what the first moments cost at the goal's fidelity")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                    help="train with Adam (the goals' runs) or SGD with momentum 0.9 (no ExCP: it prunes by Adam's v)")
    args = ap.parse_args()
    if args.floor:
        for name in ("digits-cnn", "char-lstm"):
            run = Run(name)
            print(f"\n{name}: Adam's first moments alone, rounded in the update domain")
            floor(run, run.train(args.checkpoints, args.every))
        return
    if args.sweep_key_every:
        sweep_key_every([int(v) for v in args.sweep_key_every.split(",")], args.checkpoints, args.every)
        return
    for name in ("digits-cnn", "char-lstm"):
        run = Run(name, args.optimizer)
        cks = run.train(args.checkpoints, args.every)
        raw = sum(len(pt_bytes(c)) for c in cks)
        xz = sum(len(lzma.compress(pt_bytes(c), preset=9)) for c in cks)
        own = [dc.encode_model(c) for c in cks]
        own_decoded = [dc.decode_model(o) for o in own]
        with tempfile.TemporaryDirectory() as tmp:
            series = dc.CheckpointSeries(Path(tmp) / "run.dcs", key_every=args.key_every)
            appends, extracts = [], []
            for c in cks:
                t0 = time.perf_counter()
                series.append(c)
                appends.append(time.perf_counter() - t0)
            series_bytes = sum(e.bytes for e in series.entries())
            series_decoded = []
            for i in range(len(cks)):  # (each from a fresh object: the chain from its key decoded)
                t0 = time.perf_counter()
                series_decoded.append(dc.CheckpointSeries(Path(tmp) / "run.dcs")[i])
                extracts.append(time.perf_counter() - t0)
            lossless = dc.CheckpointSeries(Path(tmp) / "lossless.dcs", key_every=args.key_every, keep_exact=True)
            for c in cks:
                lossless.append(c)
            lossless_bytes = sum(e.bytes for e in lossless.entries())
            exact = all(bits_equal(lossless[i], c) for i, c in enumerate(cks))
        adam = args.optimizer == "adam"
        excp_sizes, excp_decoded = excp(cks) if adam else ([], None)
        middle = len(cks) // 2
        params = sum(t.numel() for t in cks[0]["model"].values())
        print(f"\n{name}: {params:,} params, {'Adam' if adam else 'SGD (momentum 0.9)'}, {len(cks)} checkpoints every {args.every} steps "
              f"(model + optimizer state); resumed loss after {args.resume_steps} steps from checkpoint {middle}")
        rows = {"original": (raw, None), "xz -9 of the .pt files": (xz, None),
                "each coded on its own": (sum(len(o) for o in own), own_decoded),
                "series (ours)": (series_bytes, series_decoded)}
        if adam:
            rows["ExCP (reproduced)"] = (sum(excp_sizes), excp_decoded)
        cols = ["bytes", "ratio", "held-out loss, max rel. diff", "next step cosine, min", "next step norm, max diff",
                "resumed loss"]
        print(f"{'':<24}" + "".join(f"{c[:18]:>20}" for c in cols))
        reference = run.resumed(cks[middle], args.resume_steps)
        curves = {}
        for label, (size, decoded) in rows.items():
            f = fidelity(run, cks, decoded, middle, args.resume_steps) if decoded is not None else \
                {"held-out loss, max rel. diff": 0.0, "next step cosine, min": 1.0, "next step norm, max diff": 0.0,
                 "resumed loss": reference}
            if decoded is not None or label == "original":
                curves[label] = f["resumed loss"]
            f["resumed loss"] = f["resumed loss"][-1]
            print(f"{label:<24}{size:>20,}{raw / size:>19.1f}x" + "".join(
                f"{f[c]:>20.4f}" for c in cols[2:]))
        marks = sorted({*range(0, args.resume_steps, RESUMED_EVERY), args.resume_steps})
        print(f"resumed from checkpoint {middle}: held-out loss after this many steps (mean of 3 batch orders)")
        print(f"{'':<24}" + "".join(f"{m:>10}" for m in marks))
        for label, curve in curves.items():
            print(f"{label:<24}" + "".join(f"{v:>10.4f}" for v in curve))
        print(f"series: append median {np.median(appends):.3f} s, extract median {np.median(extracts):.3f} s "
              f"(worst {max(extracts):.3f} s) per checkpoint of {raw / len(cks) / 1e6:.2f} MB")
        versus = f"series / ExCP bytes: {series_bytes / sum(excp_sizes):.2f}x; " if adam else ""
        print(f"{versus}series vs raw: {raw / series_bytes:.1f}x (goals: >= 50x, <= 0.5x ExCP)")
        print(f"lossless series (--lossless): {lossless_bytes:,} bytes, {raw / lossless_bytes:.3f}x the raw files "
              f"(goal >= 1.3x), every entry bit for bit: {exact}; each coded on its own losslessly: "
              f"{raw / sum(len(dc.encode_model(c, keep_exact=True)) for c in cks):.3f}x")


if __name__ == "__main__":
    main()
