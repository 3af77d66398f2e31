"""Run NNCodec 2.1.3 (the MPEG NNC reference software) on a set of arrays and time it.

Runs under the NNCodec venv's interpreter (it pins numpy<2 and must stay out of the project's env):

    NNC_VENV/bin/python benchmarks/peer_nncodec.py IN.npz OUT.npz --qp -32 --qp-density 2 \
        --use-dq 0 --lambda-scale 0 --nonweight-qp -75 --repeats 3

IN.npz holds float32/int32 arrays (see npz_names.py for names that need escaping). OUT.npz receives
NNCodec's decoded arrays under the same names. The last line on stdout is one JSON object with the
bytes, the encode/decode times (median and every run) and how NNCodec classified each tensor.
"""
from __future__ import annotations

import os

# Single thread for a like-for-like comparison with our single-thread figures. These must be set
# before numpy/torch load their thread pools; the caller sets them too, this is the fallback.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import contextlib
import json
import statistics
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import npz_names  # noqa: E402


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


class _Stub(metaclass=_StubMeta):
    """Stands for any torchvision class, function or constant: constructible, callable, subclassable."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if args else None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


def _stub_class(name):
    return _StubMeta(name, (_Stub,), {})


def _stub_torchvision() -> None:
    """nncodec imports torchvision at import time, but its compress/decompress path never uses it.

    The only torchvision wheel that pip can fetch here is a CUDA build that fails against the CPU torch
    (``operator torchvision::nms does not exist``), so a stand-in package is registered instead. An
    empty module is not enough for 2.1.3: its dataset helpers build ``transforms.Compose([...])`` at
    import time, so every attribute of the stand-in resolves to an inert placeholder class. It is
    installed unconditionally so the peer's behaviour does not depend on whatever torchvision is around.
    """
    def module_getattr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)

    def make(name):
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so `import torchvision.x.y` resolves through sys.modules
        mod.__getattr__ = module_getattr  # PEP 562 module-level fallback
        sys.modules[name] = mod
        return mod

    root = make("torchvision")
    root.__version__ = "0.0+stub"
    for sub in ("datasets", "transforms", "models", "ops", "io", "utils",
                "transforms.functional", "models.detection", "datasets.folder"):
        mod = make(f"torchvision.{sub}")
        parent, _, leaf = mod.__name__.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Keep anything NNCodec prints (Python or C++) off stdout, whose last line is our JSON result."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _step(qp: int, qp_density: int) -> float:
    """NNC's quantisation step for a given qp (exact power-of-two arithmetic in float64)."""
    k = 1 << qp_density
    return float((k + qp % k) * 2.0 ** (qp // k - qp_density))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--qp", type=int, default=-32)
    ap.add_argument("--qp-density", type=int, default=2)
    ap.add_argument("--use-dq", type=int, choices=(0, 1), default=0)
    ap.add_argument("--lambda-scale", type=float, default=0.0)
    ap.add_argument("--nonweight-qp", type=int, default=-75)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bitstream", help="also write the NNC bitstream here")
    args = ap.parse_args(argv)
    if args.nonweight_qp == 0:
        # compress() tests `nonweight_qp if nonweight_qp else qp - 8`, so 0 would silently become qp-8.
        ap.error("--nonweight-qp 0 is not expressible through nnc.compress")

    _stub_torchvision()
    import torch

    torch.set_num_threads(1)
    import nncodec
    from nncodec import nnc
    from nncodec.nnc_core import nnr_model

    params = npz_names.load(args.input)
    bad = {n: str(a.dtype) for n, a in params.items() if a.dtype not in (np.float32, np.int32)}
    if bad:
        raise SystemExit(f"NNCodec takes float32/int32 only; convert these first: {bad}")
    params = {n: np.ascontiguousarray(a) for n, a in params.items()}

    # How NNCodec will treat each tensor, from its own classifier (outside the timed region): tensors
    # of more than one dimension are "weight" and get qp; all others "unspecified" and get nonweight_qp;
    # integer tensors are passed through losslessly whatever their type.
    info = nnr_model.NNRModel(params).model_info
    ptype = dict(info["parameter_type"])

    comp_kwargs = dict(bitstream_path=None, return_bitstream=True, qp=args.qp,
                       qp_density=args.qp_density, nonweight_qp=args.nonweight_qp,
                       use_dq=bool(args.use_dq), lambda_scale=args.lambda_scale, verbose=False)

    enc_times, dec_times, streams = [], [], []
    decoded = None
    for _ in range(args.repeats):
        with _stdout_to_stderr():
            t0 = time.perf_counter()
            bs = nnc.compress(params, **comp_kwargs)
            enc_times.append(time.perf_counter() - t0)
        streams.append(bytes(bs))
        # decompress() is given a fresh bytearray (a `bytes` argument is taken as a file path).
        buf = bytearray(streams[-1])
        with _stdout_to_stderr():
            t0 = time.perf_counter()
            decoded = nnc.decompress(buf)
            dec_times.append(time.perf_counter() - t0)

    stream = streams[0]
    if args.bitstream:
        with open(args.bitstream, "wb") as f:
            f.write(stream)

    missing = set(params) - set(decoded)
    extra = set(decoded) - set(params)
    out = {}
    for name, src in params.items():
        if name not in decoded:
            continue
        # Shapes are restored by decompress(); the reshape only guards the 0-d case, which NNC stores
        # as shape (1,). Integer tensors come back as int32 (checked bit-exact via "lossless").
        out[name] = np.asarray(decoded[name]).reshape(src.shape)
    npz_names.save(args.output, out)

    returned_dtypes = sorted({str(np.asarray(a).dtype) for a in decoded.values()})
    per_tensor = {}
    for name, src in params.items():
        integer = src.dtype.kind == "i"
        qp = None if integer else (args.qp if ptype[name] == "weight" else args.nonweight_qp)
        dec = out.get(name)
        per_tensor[name] = {
            "shape": list(src.shape), "dtype": str(src.dtype), "nnc_type": ptype[name],
            "qp": qp, "step": None if integer else _step(qp, args.qp_density),
            "lossless": bool(dec is not None and np.array_equal(dec, src)),
        }

    result = {
        "codec": "NNCodec", "version": getattr(nncodec, "__version__", None) or _dist_version(),
        "numpy": np.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "settings": {"qp": args.qp, "qp_density": args.qp_density, "use_dq": bool(args.use_dq),
                     "lambda_scale": args.lambda_scale, "nonweight_qp": args.nonweight_qp},
        "bytes": len(stream),
        "deterministic": all(s == stream for s in streams),
        "encode_s": statistics.median(enc_times), "encode_s_all": enc_times,
        "decode_s": statistics.median(dec_times), "decode_s_all": dec_times,
        "n_tensors": len(params), "n_params": int(sum(a.size for a in params.values())),
        "decoded_dtypes": returned_dtypes,
        "missing_in_decoded": sorted(missing), "extra_in_decoded": sorted(extra),
        "tensors": per_tensor,
    }
    print(json.dumps(result))
    return 0


def _dist_version():
    from importlib.metadata import version
    return version("nncodec")


if __name__ == "__main__":
    sys.exit(main())
