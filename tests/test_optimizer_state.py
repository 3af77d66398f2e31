"""Optimizer state: steps and param_groups exact, moments in the log domain, and a decoded
checkpoint that resumes training as the original would (the next Adam step)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import deepcabac_py as dc
from deepcabac_py.errors import CorruptStreamError
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.model.container import LOG_OFFSET_BYTES, Mode
from deepcabac_py.model.optimizer_state import (
    EXACT,
    FIRST_MOMENT,
    SECOND_MOMENT,
    AdamGroup,
    MomentumGroup,
    adam_groups,
    momentum_groups,
    role_of,
    roles,
)
from deepcabac_py.model.settings import DEFAULT_MOMENTS_QP
from deepcabac_py.quant import portable
from deepcabac_py.quant.log_domain import log_levels, log_values
from deepcabac_py.quant.steps import step_from_qp
from deepcabac_py.series.records import SeriesFile

GOLDEN = Path(__file__).resolve().parent / "golden" / "optimizer_state.dcb"
REGEN = os.environ.get("DEEPCABAC_REGEN_GOLDEN") == "1"


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(512, 20, generator=g), torch.randint(0, 5, (512,), generator=g)


def _batch(i: int):
    x, y = _data()
    j = i % 8
    return x[64 * j:64 * (j + 1)], y[64 * j:64 * (j + 1)]


def _trained(make_opt, steps: int = 60) -> dict:
    return _checkpoints(make_opt, 1, steps)[0]


def _checkpoints(make_opt, count: int, every: int, state_of=lambda model, opt: opt.state_dict()) -> list[dict]:
    """``count`` checkpoints of one run, ``every`` steps apart, the optimizer's state as ``state_of``
    gives it."""
    torch.manual_seed(0)
    model = _net()
    opt = make_opt(model.parameters())
    out = []
    for i in range(count * every):
        x, y = _batch(i)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if (i + 1) % every == 0:
            out.append(copy.deepcopy({"model": model.state_dict(), "optimizer": state_of(model, opt), "epoch": 3,
                                      "step": i + 1}))
    return out


def _next_step(ckpt: dict, make_opt, load=lambda model, opt, state: opt.load_state_dict(state)) -> torch.Tensor:
    """The parameter change of one more step on a fixed batch, resumed from ``ckpt`` (its optimizer
    state loaded by ``load``)."""
    ckpt = copy.deepcopy(ckpt)  # (the optimizer adopts the state's tensors and steps them in place)
    model = _net()
    model.load_state_dict(ckpt["model"])
    opt = make_opt(model.parameters())
    load(model, opt, ckpt["optimizer"])
    before = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
    x, y = _batch(100)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, amsgrad=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=2e-3),
    "nadam": lambda p: torch.optim.NAdam(p, lr=2e-3),
    "radam": lambda p: torch.optim.RAdam(p, lr=2e-3),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=10),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-3),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
}


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_a_decoded_checkpoint_resumes_as_the_original(which):
    make = OPTIMIZERS[which]
    ckpt = _trained(make)
    data = dc.encode_model(ckpt)
    back = dc.decode_model(data)
    kinds = roles((e.name for e in dc.read_stream_header(data).tensors), flatten(ckpt).skeleton)
    # everything that is not a moment comes back exactly
    assert back["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    assert back["epoch"] == 3 and back["step"] == 60
    for index, state in ckpt["optimizer"]["state"].items():
        got = back["optimizer"]["state"][index]
        assert set(got) == set(state)
        for key, value in state.items():
            role = kinds.get(f"optimizer.state.{index}.{key}")
            if role == EXACT:
                assert torch.equal(got[key], value) and got[key].dtype == value.dtype
                continue
            # the log domain: zeros stay zeros, nothing positive becomes 0, the relative error is
            # within half a step (a quarter octave) plus float32 rounding
            zero = value == 0
            assert torch.equal(got[key][zero], value[zero])
            assert not torch.any((value != 0) & (got[key] == 0))
            assert torch.equal(torch.sign(got[key]), torch.sign(value))
            rel = ((got[key][~zero] - value[~zero]).abs() / value[~zero].abs()).max().item()
            assert rel <= 2 ** (step_from_qp(DEFAULT_MOMENTS_QP) / 2) - 1 + 1e-6
    modes = {e.name: e.mode for e in dc.read_stream_header(data).tensors}
    for name, mode in modes.items():
        role = kinds.get(name)
        if role in (FIRST_MOMENT, SECOND_MOMENT):
            assert mode == Mode.LOG, name
        elif role == EXACT:  # (0-d tensors stored as they are, others by the lossless float coder)
            assert mode in (Mode.RAW, Mode.FLOAT), name
    # resumption: the next step from the decoded checkpoint is the original's, to within the goals
    a, b = _next_step(ckpt, make), _next_step(back, make)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.99
    assert abs(b.norm().item() / a.norm().item() - 1) <= 0.05


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_a_series_of_checkpoints_resumes_as_the_original(which, tmp_path):
    # a key and two residuals: second moments as log2 ratios to their parent's, 0-d state (NAdam's
    # mu_product) and what is kept exact as itself
    make = OPTIMIZERS[which]
    originals = _checkpoints(make, 3, 20)
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    for c in originals:
        series.append(c)
    assert [e.kind for e in series.entries()] == ["key", "residual", "residual"]
    for original, got in zip(originals, series):
        flat = flatten(original)
        kinds = roles(flat.tensors, flat.skeleton)
        for index, state in original["optimizer"]["state"].items():
            for key, value in state.items():
                if kinds[f"optimizer.state.{index}.{key}"] == EXACT:
                    assert torch.equal(got["optimizer"]["state"][index][key], value), key
        a, b = _next_step(original, make), _next_step(got, make)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.99
        assert abs(b.norm().item() / a.norm().item() - 1) <= 0.05


def test_a_distributed_checkpoints_state_keyed_by_parameter_name(tmp_path):
    # (torch.distributed.checkpoint keys an optimizer's state by each parameter's name, not its
    # index: "optimizer.state.0.weight.exp_avg"; the roles come from the state dict's keys)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    make = OPTIMIZERS["adam"]
    originals = _checkpoints(make, 3, 20, state_of=get_optimizer_state_dict)

    def next_step(ckpt):
        return _next_step(ckpt, make, load=lambda model, opt, state: set_optimizer_state_dict(
            model, opt, optim_state_dict=state))

    data = dc.encode_model(originals[-1])
    modes = {e.name: e.mode for e in dc.read_stream_header(data).tensors}
    assert modes["optimizer.state.0.weight.exp_avg_sq"] == Mode.LOG
    assert modes["optimizer.state.0.weight.step"] in (Mode.RAW, Mode.FLOAT)
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    for c in originals:
        series.append(c)
    # (as a state dict keyed by index: first moments in the update domain, weights predicted and at
    # Adam's step; before series version 5 none of it, and the series was 1.11x the bytes)
    by_index = dc.CheckpointSeries(tmp_path / "by_index.dcs")
    for c in _checkpoints(make, 3, 20):
        by_index.append(c)
    with SeriesFile(tmp_path / "run.dcs") as f:
        assert all(len(r.meta["update_domain"]) == 4 for r in f.records)
        assert all(r.meta["predicted"] for r in f.records[1:])
    assert os.path.getsize(tmp_path / "run.dcs") < 1.05 * os.path.getsize(tmp_path / "by_index.dcs")
    # (every entry: a key's first moments were once divided by second moments coded without
    # their roles, and came back 10^5 times too large)
    for original, got in [(originals[-1], dc.decode_model(data))] + [(c, series[i]) for i, c in enumerate(originals)]:
        step = original["optimizer"]["state"]["0.weight"]["step"]
        assert torch.equal(got["optimizer"]["state"]["0.weight"]["step"], step)
        a, b = next_step(original), next_step(got)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.99
        assert abs(b.norm().item() / a.norm().item() - 1) <= 0.05


def test_another_librarys_optimizer_state_is_kept_exact(tmp_path):
    # (state that no torch optimizer writes, in a torch state dict: bitsandbytes' 8-bit Adam keeps
    # uint8 codes, a float scale per block and a float code book; a rounded scale or book would
    # change every code's value)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 32, generator=g)
    state = {"state1": torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=g),
             "absmax1": torch.rand(8, generator=g) * 1e-3, "qmap1": torch.linspace(-1, 1, 256)}
    ckpt = {"model": {"w": weight},
            "optimizer": {"state": {0: state}, "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    back = dc.decode_model(dc.encode_model(ckpt))
    for key, value in state.items():
        assert torch.equal(back["optimizer"]["state"][0][key], value), key
    assert not torch.equal(back["model"]["w"], weight)  # (the weights are quantized as ever)
    # the same names outside an optimizer's state dict are weights
    loose = {"enc.state.0.absmax1": state["absmax1"].clone() * 1e3, "w": weight}
    assert not torch.equal(dc.decode_model(dc.encode_model(loose))["enc.state.0.absmax1"], loose["enc.state.0.absmax1"])
    # and a series keeps them exact in residual entries too
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    later = {**ckpt, "model": {"w": weight + 0.01}}
    series.append(ckpt)
    series.append(later)
    assert [e.kind for e in series.entries()] == ["key", "residual"]
    for key, value in state.items():
        assert torch.equal(series[1]["optimizer"]["state"][0][key], value), key


def test_moments_take_their_qp_from_overrides_and_moments_qp():
    ckpt = _trained(OPTIMIZERS["adam"], steps=5)
    # (why not the weights' uniform step: most of v lies below half of it and would decode as 0)
    v = ckpt["optimizer"]["state"][0]["exp_avg_sq"]
    assert (v < step_from_qp(dc.encode_model.__kwdefaults__["qp"]) / 2).float().mean() > 0.5
    data = dc.encode_model(ckpt, moments_qp=-12, qp_overrides={"optimizer.state.0.exp_avg_sq": -4})
    qps = {e.name: e.qp for e in dc.read_stream_header(data).tensors if e.mode == Mode.LOG}
    assert qps.pop("optimizer.state.0.exp_avg_sq") == -4
    assert set(qps.values()) == {-12}
    finer, coarser = (len(dc.encode_model(ckpt, moments_qp=qp)) for qp in (-12, -4))
    assert finer > coarser


def test_an_optimizer_checkpoint_through_the_cli(tmp_path):
    make = OPTIMIZERS["adam"]
    ckpt = _trained(make, steps=20)
    src, stream, out = tmp_path / "ckpt.pt", tmp_path / "ckpt.dcb", tmp_path / "back.pt"
    torch.save(ckpt, src)
    for args in (["encode", str(src), "-o", str(stream), "-q"], ["decode", str(stream), "-o", str(out), "-q"]):
        r = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    back = torch.load(out, weights_only=True)
    model = _net()
    model.load_state_dict(back["model"])
    opt = make(model.parameters())
    opt.load_state_dict(back["optimizer"])  # a state torch accepts as its own
    assert back["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    r = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "info", str(stream)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "LOG" in r.stdout.upper()
    # --moments-qp sets their precision
    coarse = tmp_path / "coarse.dcb"
    r = subprocess.run([sys.executable, "-m", "deepcabac_py.cli.main", "encode", str(src), "-o", str(coarse), "-q",
                        "--moments-qp", "-4"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    header = dc.read_stream_header(coarse.read_bytes())
    assert {e.qp for e in header.tensors if e.mode == Mode.LOG} == {-4}
    assert coarse.stat().st_size < stream.stat().st_size


@pytest.mark.parametrize("name, role", [
    ("optimizer.state.0.exp_avg", FIRST_MOMENT), ("opt.state.12.exp_avg_sq", SECOND_MOMENT),
    ("state.3.max_exp_avg_sq", SECOND_MOMENT), ("optimizer.state.1.momentum_buffer", FIRST_MOMENT),
    ("optimizer.state.0.step", EXACT), ("model.exp_avg", None), ("optimizer.state.x.exp_avg", None),
    ("optimizer.param_groups.0.lr", None), ("layer.state.0.weight", None), ("o.state.2.sum", SECOND_MOMENT),
    ("o.state.2.square_avg", SECOND_MOMENT), ("o.state.0.exp_inf", SECOND_MOMENT), ("o.state.0.row_var", EXACT),
    ("o.state.0.step_size", EXACT), ("o.state.0.prev", FIRST_MOMENT), ("o.state.0.mu_product", EXACT),
    ("o.state.0.grad_avg", EXACT), ("o.state.0.old_dirs.3", EXACT), ("o.state.0.ax", None),
    ("o.state.0.exp_avg.x", None)])
def test_roles_by_name(name, role):
    assert role_of(name) == role


def test_centered_rmsprops_square_avg_is_kept_exact():
    # (its step divides by sqrt(square_avg - grad_avg**2): a rounded square_avg can make it negative)
    names = ["o.state.0.square_avg", "o.state.0.grad_avg", "o.state.1.square_avg", "model.w"]
    assert roles(names) == {"o.state.0.square_avg": EXACT, "o.state.0.grad_avg": EXACT,
                            "o.state.1.square_avg": SECOND_MOMENT}


def test_adam_groups_name_each_first_moments_param_group():
    net = _net()
    opt = torch.optim.AdamW([{"params": net[0].parameters(), "lr": 3e-4},
                             {"params": net[2].parameters(), "betas": (0.8, 0.99), "eps": 1e-6}], lr=1e-3)
    x, y = _data()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    # (Lightning keeps its optimizers' states in a list, beside other entries)
    ckpt = flatten({"model": net.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1})
    groups = adam_groups(ckpt.skeleton)
    assert sorted(groups) == [f"optimizer_states.0.state.{i}.exp_avg" for i in range(4)]
    assert groups["optimizer_states.0.state.1.exp_avg"] == AdamGroup(3e-4, 0.9, 0.999, 1e-8,
                                                                     "optimizer_states.0.state.1.step")
    assert groups["optimizer_states.0.state.3.exp_avg"] == AdamGroup(1e-3, 0.8, 0.99, 1e-6,
                                                                     "optimizer_states.0.state.3.step")


def test_adam_groups_leave_out_what_is_not_adam():
    net = _net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    sgd.step()
    assert adam_groups(flatten({"optimizer": sgd.state_dict()}).skeleton) == {}
    for other in (torch.optim.RAdam, torch.optim.NAdam, torch.optim.Adamax):  # (their steps are not Adam's)
        opt = other(net.parameters(), lr=0.01)
        opt.step()
        assert adam_groups(flatten({"optimizer": opt.state_dict()}).skeleton) == {}
    adam = torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01))  # (an lr held as a tensor)
    adam.step()
    assert adam_groups(flatten({"optimizer": adam.state_dict()}).skeleton) == {}
    state = torch.optim.Adam(net.parameters(), lr=0.01)
    state.step()
    good = flatten({"optimizer": state.state_dict()}).skeleton
    assert len(adam_groups(good)) == 4
    # malformed skeletons and groups: nothing found, nothing raised
    text = json.dumps(good)
    for bad in (None, [], {"root": 5}, {"root": {"$dict": "x"}},
                json.loads(text.replace('["betas", {"$tuple": [0.9, 0.999]}]', '["betas", {"$tuple": [0.9, 1.5]}]')),
                json.loads(text.replace('["lr", 0.01]', '["lr", -0.01]')),
                json.loads(text.replace('["params", [0, 1, 2, 3]]', '["params", ["0", true, 7.0]]'))):
        assert adam_groups(bad) == {}


def test_momentum_groups_name_each_momentum_buffers_param_group():
    net = _net()
    sgd = torch.optim.SGD([{"params": net[0].parameters(), "lr": 0.3},
                           {"params": net[2].parameters(), "momentum": 0.0}], lr=0.1, momentum=0.9)
    x, y = _data()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    sgd.step()
    # (without momentum a group keeps no buffer: nothing of it is found)
    ckpt = flatten({"optimizer_states": [sgd.state_dict()]})
    assert momentum_groups(ckpt.skeleton) == {f"optimizer_states.0.state.{i}.momentum_buffer": MomentumGroup(0.3)
                                         for i in (0, 1)}
    adam = torch.optim.Adam(net.parameters())
    adam.step()
    assert momentum_groups(flatten({"optimizer": adam.state_dict()}).skeleton) == {}
    rmsprop = torch.optim.RMSprop(net.parameters(), lr=0.01, momentum=0.5)
    rmsprop.step()
    assert set(momentum_groups(flatten({"optimizer": rmsprop.state_dict()}).skeleton).values()) == {MomentumGroup(0.01)}
    muon = torch.optim.Muon([p for p in net.parameters() if p.dim() == 2], lr=0.02)  # (its step is not lr * buffer)
    muon.step()
    assert muon.state_dict()["state"] and momentum_groups(flatten({"optimizer": muon.state_dict()}).skeleton) == {}
    text = json.dumps(flatten({"optimizer": sgd.state_dict()}).skeleton)
    for bad in (None, {"root": 5}, json.loads(text.replace('["momentum", 0.9]', '["momentum", 1.0]')),
                json.loads(text.replace('["lr", 0.3]', '["lr", "0.3"]'))):
        assert not any(n.endswith((".0.momentum_buffer", ".1.momentum_buffer")) for n in momentum_groups(bad))


def _reference_levels(values, step):
    """Plain Python: the log-domain levels and offset of a list of floats."""
    ks = [round(math.log2(abs(x)) / step) for x in values if x != 0]
    if not ks:
        return [0] * len(values), 0
    offset = min(ks) - 1
    out = []
    for x in values:
        if x == 0:
            out.append(0)
        else:
            m = round(math.log2(abs(x)) / step) - offset
            out.append(m if x > 0 else -m)
    return out, offset


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(values=hnp.arrays(np.float32, st.integers(1, 64), elements=finite32),
       qp=st.integers(-24, 4))
def test_log_levels_match_a_plain_python_reference(values, qp):
    step = step_from_qp(qp)
    levels, offset = log_levels(values, step)
    ref, ref_offset = _reference_levels([float(x) for x in values], step)
    assert levels.tolist() == ref and offset == ref_offset
    back = log_values(levels, offset, step, "float32")
    nonzero = values != 0
    assert np.array_equal(back == 0, ~nonzero)
    assert np.array_equal(np.sign(back), np.sign(values))
    if nonzero.any():
        rel = np.abs(back[nonzero].astype(np.float64) / values[nonzero].astype(np.float64) - 1)
        # half a step, plus the float32 rounding (and the clamp at the smallest subnormal)
        tiny = np.abs(values[nonzero]) < np.finfo(np.float32).tiny
        assert np.all((rel <= 2 ** (step / 2) - 1 + 1e-6) | tiny)


def _reference_values(levels: np.ndarray, offset: int, step: float, dtype) -> np.ndarray:
    """NumPy, element by element as the format says: sign * clip(2 ** ((|level| + offset) * step))
    rounded once to the dtype, 0 for a level 0."""
    info = np.finfo(dtype)
    lv = levels.astype(np.int64)
    x = portable.exp2((np.abs(lv) + offset).astype(np.float64) * step)
    x = np.clip(x, float(info.smallest_subnormal), float(info.max)).astype(dtype)
    x[lv == 0] = 0
    return np.where(lv < 0, -x, x)


@settings(max_examples=200, deadline=None)
@given(levels=hnp.arrays(np.int32, st.integers(0, 64), elements=st.integers(-2**31 + 1, 2**31 - 1)),
       offset=st.integers(-2**20, 2**20), qp=st.integers(-24, 4), dtype=st.sampled_from([np.float32, np.float64]))
def test_log_values_are_the_formats_arithmetic(levels, offset, qp, dtype):
    step = step_from_qp(qp)
    got = log_values(levels, offset, step, np.dtype(dtype).name)
    want = _reference_values(levels, offset, step, dtype)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def _golden_input() -> dict:
    # moments that are signed powers of two: at a step of one octave (qp 0) they decode exactly, so
    # the expected values need no file of their own
    rng = np.random.RandomState(7)
    k = rng.randint(-30, 3, size=(12, 10))
    sign = np.where(rng.randint(0, 2, size=k.shape) == 1, 1.0, -1.0)
    m = (sign * np.ldexp(1.0, k)).astype(np.float32)
    m[rng.randint(0, 2, size=k.shape) == 0] = 0.0
    v = np.ldexp(1.0, rng.randint(-40, -10, size=(12, 10))).astype(np.float32)
    return {"state": {0: {"step": np.float32(17.0).reshape(()), "exp_avg": m, "exp_avg_sq": v}}}


def test_the_golden_log_domain_stream_decodes_and_is_reproduced():
    obj = _golden_input()
    data = dc.encode_model(obj, moments_qp=0, threads=1)
    if REGEN or not GOLDEN.exists():
        if not REGEN:
            pytest.fail(f"{GOLDEN} missing; run with DEEPCABAC_REGEN_GOLDEN=1 to create it")
        GOLDEN.write_bytes(data)
    committed = GOLDEN.read_bytes()
    assert data == committed
    header = dc.read_stream_header(committed)
    assert header.version == 4
    back = dc.decode_model(committed)
    for key in ("exp_avg", "exp_avg_sq"):
        assert np.array_equal(back["state"][0][key], obj["state"][0][key])
    assert back["state"][0]["step"] == 17.0


def _log_entry_stream() -> tuple[bytes, int]:
    data = dc.encode_model({"state": {0: {"exp_avg_sq": np.full((4, 4), 1e-8, np.float32)}}})
    header = dc.read_stream_header(data)
    (e,) = [e for e in header.tensors if e.mode == Mode.LOG]
    return data, header.header_size + e.offset


def test_a_damaged_log_domain_offset_is_refused():
    data, at = _log_entry_stream()
    bad = bytearray(data)
    bad[at:at + LOG_OFFSET_BYTES] = (1 << 50).to_bytes(LOG_OFFSET_BYTES, "little", signed=True)
    from helpers import fix_checksums
    with pytest.raises(CorruptStreamError, match="offset"):
        dc.decode_model(fix_checksums(bytes(bad)))
