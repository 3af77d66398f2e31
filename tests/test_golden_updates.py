"""Golden update streams: committed messages (update format versions 1, 2 and 3) that must keep decoding to
the committed deltas, applied to the committed base, and that today's encoder must reproduce exactly
(version 1 with the format-1 features named explicitly).

Inputs are built like the model goldens (``test_golden._floats``: dyadic values, so every sum and mean
the sparsifiers take is exact on any platform). Regenerate only after an intended change of the update
format, and bump its version if these streams no longer decode::

    DEEPCABAC_REGEN_GOLDEN=1 python -m pytest tests/test_golden_updates.py
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import golden_floats, golden_ints

from deepcabac_py.updates import _update_kernels
from deepcabac_py.updates import message_format as upf
from deepcabac_py.updates import messages as up
from deepcabac_py.updates import sessions as ups

GOLDEN = Path(__file__).resolve().parent / "golden" / "updates"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"


def base_model() -> dict[str, np.ndarray]:
    return {
        "conv.weight": golden_floats(21, (6, 3, 3, 3), -3).astype(np.float32),
        "fc.weight": golden_floats(22, (20, 24), -4).astype(np.float32),
        "fc.bias": golden_floats(23, (24,), -6).astype(np.float32),
        "half": golden_floats(24, (5, 7), -2).astype(np.float16),
        "steps": golden_ints(25, (2,), 0, 1000),
    }


def rounds(n: int) -> list[dict[str, np.ndarray]]:
    """n successive models: each is the previous plus a dyadic step (integers count up)."""
    models, model = [], base_model()
    for r in range(n):
        model = {k: (v + golden_floats(100 + 10 * r + i, v.shape, -9).astype(v.dtype)) if v.dtype.kind == "f"
                 else v + r + 1 for i, (k, v) in enumerate(model.items())}
        models.append(model)
    return models


# The default features of update format 1 (today's default adds MIX, a format-2 feature).
V1 = upf.DEFAULT_FEATURES & _update_kernels.F_ALL_V1


def golden_cases() -> dict[str, list[dict]]:
    """name -> the encode_update settings of each message of the stream (one per round). The
    version-1 streams name format-1 features explicitly; the ``*_v2`` streams use the defaults."""
    v3 = {
        "stc_v3": [dict(density=0.2)],
        "golomb_v3": [dict(density=0.15, coder="golomb")],
        "topk_table_v3": [dict(density=0.3, method="topk", value_levels=5, table=True)],
        "rows_v3": [dict(density=0.25, rows=0.5)],
        "session_v3": [dict(density=0.2, session=True), dict(density=0.1, session=True),
                       dict(density=0.3, method="sbc", session=True)],
    }
    # versions 1 and 2: the full header (compact=False); version 2 differs from 1 by its features
    v12 = {
        "stc": [dict(density=0.2, features=V1)],
        "sbc": [dict(density=0.2, method="sbc", features=V1)],
        "golomb": [dict(density=0.15, coder="golomb")],
        "topk_table": [dict(density=0.3, method="topk", value_levels=5, table=True, features=V1)],
        "rows": [dict(density=0.25, rows=0.5, features=V1 | _update_kernels.F_ROWSKIP)],
        "session": [dict(density=0.2, session=True, features=V1), dict(density=0.1, session=True, features=V1),
                    dict(density=0.3, method="sbc", session=True, features=V1)],
        "stc_v2": [dict(density=0.2)],
        "topk_table_v2": [dict(density=0.3, method="topk", value_levels=5, table=True)],
        "rows_v2": [dict(density=0.25, rows=0.5)],
        "session_v2": [dict(density=0.2, session=True), dict(density=0.1, session=True),
                       dict(density=0.3, method="sbc", session=True)],
    }
    return {**{n: [dict(m, compact=False) for m in ms] for n, ms in v12.items()}, **v3}


def format_version(name: str) -> int:
    return 3 if name.endswith("_v3") else 2 if name.endswith("_v2") else 1


def npz_name(name: str) -> str:
    """A ``*_v2``/``*_v3`` stream codes the same levels as its version-1 twin: it shares its deltas."""
    return name.removesuffix("_v2").removesuffix("_v3")


CASES = sorted(golden_cases())


def encode_stream(name: str) -> bytes:
    models = rounds(len(golden_cases()[name]))
    parent, sender, receiver, out = base_model(), ups.UpdateSession(7), ups.UpdateSession(7), []
    for r, (settings, new) in enumerate(zip(golden_cases()[name], models)):
        settings = dict(settings)
        in_session = settings.pop("session", False)
        if in_session:
            settings.update(session=sender, round_index=r + 1, parent_round=r)
        msg = up.encode_update(new, parent, **settings)
        out.append(msg)
        parent = up.apply_update(parent, msg, session=receiver if in_session else None)
    return b"".join(out)


def decode_stream(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every message's delta (keys ``"<message>/<tensor>"``) and the final model, decoded in order."""
    model, session, deltas = base_model(), None, {}
    for i, msg in enumerate(up.iter_messages(data)):
        header = upf.read_update_header(msg)
        if header.session_id and session is None:
            session = ups.UpdateSession(header.session_id)
        upd = up.decode_update(msg, model, session=session if header.session_id else None)
        for name, delta in upd.delta().items():
            deltas[f"{i}/{name}"] = delta
        model = up.apply_delta(model, upd)
    return deltas, model


def _regenerate() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        data = encode_stream(name)
        deltas, model = decode_stream(data)
        (GOLDEN / f"{name}.dcu").write_bytes(data)
        if npz_name(name) == name:
            np.savez_compressed(GOLDEN / f"{name}.npz", **deltas, **{f"model/{k}": v for k, v in model.items()})


@pytest.fixture(scope="module", autouse=True)
def golden_files():
    if REGEN:
        _regenerate()
    missing = [f for n in CASES for f in (f"{n}.dcu", f"{npz_name(n)}.npz") if not (GOLDEN / f).exists()]
    if missing:
        pytest.fail(f"golden files missing: {missing}; run with DEEPCABAC_REGEN_GOLDEN=1 to create them")


def _committed(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    with np.load(GOLDEN / f"{npz_name(name)}.npz", allow_pickle=False) as npz:
        return (GOLDEN / f"{name}.dcu").read_bytes(), {k: npz[k] for k in npz.files}


@pytest.mark.parametrize("name", CASES)
def test_committed_update_stream_decodes_exactly(name):
    data, expected = _committed(name)
    assert {upf.read_update_header(m).version for m in up.iter_messages(data)} == {format_version(name)}
    deltas, model = decode_stream(data)
    got = {**deltas, **{f"model/{k}": v for k, v in model.items()}}
    assert sorted(got) == sorted(expected)
    for key, arr in got.items():
        assert arr.dtype == expected[key].dtype and arr.shape == expected[key].shape, key
        assert arr.tobytes() == expected[key].tobytes(), key


@pytest.mark.parametrize("name", CASES)
def test_encoder_reproduces_committed_update_bytes(name):
    data, _ = _committed(name)
    assert encode_stream(name) == data


def test_golden_update_files_are_small():
    assert sum(p.stat().st_size for p in GOLDEN.iterdir()) < 40_000
