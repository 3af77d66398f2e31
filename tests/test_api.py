"""The public surface: exported names, the exception hierarchy and the quantization step."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import deepcabac_py as dc
from deepcabac_py.quant.steps import QP_DENSITY_MAX, QP_MAX, QP_MIN

EXPECTED_ALL = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointSeries",
    "CorruptStreamError",
    "DeepCabacError",
    "ErrorFeedback",
    "FormatError",
    "InputError",
    "LimitExceededError",
    "OutputError",
    "OutputExistsError",
    "QuantizedTensor",
    "SparseTensor",
    "TruncatedStreamError",
    "UpdateMismatchError",
    "UpdateSession",
    "UpdateStreamWriter",
    "apply_update",
    "decode_checkpoint",
    "decode_directory",
    "decode_file",
    "decode_levels",
    "decode_model",
    "decode_update",
    "encode_directory",
    "encode_file",
    "encode_model",
    "encode_sparse",
    "encode_update",
    "iter_messages",
    "load_checkpoint",
    "model_hash",
    "quantize_model",
    "read_stream_header",
    "read_update_header",
    "save_checkpoint",
    "sparsify",
    "step_from_qp",
]


def test_all_is_pinned():
    assert dc.__all__ == EXPECTED_ALL
    for name in dc.__all__:
        assert getattr(dc, name) is not None
    assert isinstance(dc.__version__, str)


def test_star_import_exports_exactly_all():
    namespace: dict = {}
    exec("from deepcabac_py import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(EXPECTED_ALL)


def test_exception_hierarchy():
    assert issubclass(dc.DeepCabacError, Exception)
    for cls in (dc.FormatError, dc.CheckpointError, dc.InputError, dc.OutputError, dc.OutputExistsError,
                dc.LimitExceededError):
        assert issubclass(cls, dc.DeepCabacError)
    assert issubclass(dc.CorruptStreamError, dc.FormatError)
    assert issubclass(dc.TruncatedStreamError, dc.CorruptStreamError)
    assert not issubclass(dc.DeepCabacError, (ValueError, TypeError))


# step = (k + qp mod k) * 2**(floor(qp / k) - qp_density), k = 2**qp_density (NNC)
STEP_TABLE = [
    (-32, 2, 2.0**-8),
    (-38, 2, 6 * 2.0**-12),
    (-75, 2, 5 * 2.0**-21),
    (0, 2, 1.0),
    (1, 2, 1.25),
    (-1, 2, 0.875),
    (4, 2, 2.0),
    (-4, 2, 0.5),
    (0, 0, 1.0),
    (1, 0, 2.0),
    (-1, 0, 0.5),
    (-20, 0, 2.0**-20),
    (0, 1, 1.0),
    (1, 1, 1.5),
    (-1, 1, 0.75),
    (-3, 1, 0.375),
    (0, 3, 1.0),
    (5, 3, 1.625),
    (-1, 3, 0.9375),
    (-32, 3, 0.0625),
    (-33, 3, 15 * 2.0**-8),
    (7, 6, 71 / 64),
]


@pytest.mark.parametrize("qp,density,step", STEP_TABLE)
def test_step_table(qp, density, step):
    assert dc.step_from_qp(qp, density) == step


def test_default_density_is_two():
    assert dc.step_from_qp(-38) == 6 * 2.0**-12


def _nnc_step(qp: int, density: int) -> Fraction:
    k = 2**density
    return (k + qp % k) * Fraction(2) ** (qp // k - density)


@pytest.mark.parametrize("density", range(QP_DENSITY_MAX + 1))
def test_step_formula_and_monotonicity(density):
    k = 2**density
    previous = 0.0
    for qp in range(-200, 201):
        step = dc.step_from_qp(qp, density)
        assert Fraction(step) == _nnc_step(qp, density), (qp, density)
        assert step > previous
        previous = step
        assert dc.step_from_qp(qp + k, density) == 2 * step  # k steps per octave
    assert dc.step_from_qp(np.int64(-32), np.int32(density)) == dc.step_from_qp(-32, density)


@pytest.mark.parametrize("qp", [1.0, 2.5, "3", None, True, np.float32(2)])
def test_step_rejects_non_integer_qp(qp):
    with pytest.raises(TypeError):
        dc.step_from_qp(qp)


@pytest.mark.parametrize("density", [1.0, "2", None, False])
def test_step_rejects_non_integer_density(density):
    with pytest.raises(TypeError):
        dc.step_from_qp(0, density)


@pytest.mark.parametrize("qp,density", [(QP_MAX + 1, 2), (QP_MIN - 1, 2), (10**9, 2), (0, -1),
                                        (0, QP_DENSITY_MAX + 1), (0, 100)])
def test_step_rejects_out_of_range(qp, density):
    with pytest.raises(ValueError):
        dc.step_from_qp(qp, density)


@pytest.mark.parametrize("density", range(QP_DENSITY_MAX + 1))
def test_step_is_finite_normal_or_refused_at_the_range_ends(density):
    for qp in (QP_MIN, QP_MAX):
        try:
            step = dc.step_from_qp(qp, density)
        except ValueError:
            continue
        assert math.isfinite(step) and step >= 2.0**-1022


def test_header_only_work_does_not_import_torch(tmp_path):
    # `deepcabac info` and the CLI's option defaults read the settings and the container, which must
    # not pay for torch (most of a second); the model commands import it when they run.
    import subprocess
    import sys

    stream = tmp_path / "m.dcb"
    stream.write_bytes(dc.encode_model({"w": np.ones((4, 4), np.float32)}))
    code = ("import sys; from deepcabac_py.cli.main import main; "
            f"sys.argv = ['deepcabac', 'info', {str(stream)!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
