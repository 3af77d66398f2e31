"""Checkpoint series: keys and residuals, no error along the chain, atomic appends, one writer,
clear errors for damage, and the CLI."""

from __future__ import annotations

import copy
import fcntl
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import coded_steps, series_header

import deepcabac_py as dc
from deepcabac_py.cli.main import main
from deepcabac_py.errors import CorruptStreamError, FormatError, InputError, OutputError
from deepcabac_py.model.decoder import read_stream_header
from deepcabac_py.model.settings import DEFAULT_MOMENTS_QP
from deepcabac_py.quant.steps import step_from_qp
from deepcabac_py.series.changes import LOG_RATIO_QP_OFFSET, RESIDUAL_SCALE_FLOOR
from deepcabac_py.series.checkpoint_series import DEFAULT_SERIES_QP as SERIES_QP
from deepcabac_py.series.records import SeriesFile


def _run(n: int, every: int = 15, seed: int = 0, sgd: bool = False) -> list[dict]:
    """``n`` checkpoints of a small Adam run (or SGD with momentum), ``every`` steps apart."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if sgd
           else torch.optim.Adam(model.parameters(), lr=2e-3))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(512, 32, generator=g)
    y = (x @ torch.randn(32, 4, generator=g)).argmax(1)
    out, step = [], 0
    for _ in range(n):
        for _ in range(every):
            i = step % 8
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[64 * i:64 * (i + 1)]), y[64 * i:64 * (i + 1)]).backward()
            opt.step()
            step += 1
        out.append({"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
                    "step": step})
    return out


@pytest.fixture(scope="module")
def run() -> list[dict]:
    return _run(6)


@pytest.fixture(scope="module")
def sgd_run() -> list[dict]:
    return _run(4, sgd=True)


def _max_weight_error(a: dict, b: dict, only: str | None = None) -> float:
    return max((a["model"][k].double() - b["model"][k].double()).abs().max().item() for k in a["model"]
               if only in (None, k))


def _residual_scale(v: np.ndarray, mean: float) -> np.ndarray:
    """What a predicted residual is multiplied by before it is coded (docs/format.md)."""
    return np.maximum(np.sqrt(np.abs(v) / mean), RESIDUAL_SCALE_FLOOR)


def _max_scaled_weight_error(got: dict, original: dict, only: str | None = None) -> float:
    """The largest error of a residual entry's weights in the units they are coded in: each
    weight's error times its residual's scale, from the entry's decoded second moment (the run's
    model numbers its parameters as the optimizer does)."""
    errors = []
    for i, k in enumerate(got["model"]):
        if only not in (None, k):
            continue
        v = got["optimizer"]["state"][i]["exp_avg_sq"].double().numpy()
        error = (got["model"][k].double() - original["model"][k].double()).abs().numpy()
        errors.append(float((error * _residual_scale(v, float(np.mean(np.abs(v))))).max()))
    return max(errors)


def _coded_steps(path, index: int) -> dict[str, float]:
    """The step each weight of entry ``index`` was quantized at, from its stream's header."""
    return {k[len("model."):]: step for k, step in coded_steps(path, index).items() if k.startswith("model.")}


def test_keys_and_residuals_without_error_along_the_chain(run, tmp_path):
    series = dc.CheckpointSeries(tmp_path / "run.dcs", key_every=4)
    assert [series.append(c) for c in run] == list(range(6))
    assert len(series) == 6
    kinds = [(e.kind, e.parent, e.step) for e in series.entries()]
    assert kinds == [("key", None, 15), ("residual", 0, 30), ("residual", 1, 45), ("residual", 2, 60),
                     ("key", None, 75), ("residual", 4, 90)]
    # every entry is as close to its checkpoint as a key would be: within the trellis's bound of
    # twice the step its stream names (for a residual's weights, in the units of its second
    # moment's scale), and so no growth along the chain
    for i, original in enumerate(run):
        got = series[i]
        assert got["step"] == original["step"]
        assert got["optimizer"]["param_groups"] == original["optimizer"]["param_groups"]
        for index, state in original["optimizer"]["state"].items():
            assert torch.equal(got["optimizer"]["state"][index]["step"], state["step"])
        steps = _coded_steps(tmp_path / "run.dcs", i)
        assert sorted(steps) == sorted(original["model"])
        for k, step in steps.items():
            if kinds[i][0] == "key":
                assert _max_weight_error(got, original, k) <= 2 * step, (i, k)
            else:
                assert _max_scaled_weight_error(got, original, k) <= 2 * step, (i, k)
                # (unscaled, at most the step over the scale's floor)
                assert _max_weight_error(got, original, k) <= 2 * step / RESIDUAL_SCALE_FLOOR, (i, k)
    # the same entries from a fresh object (the chain decoded from its key), and negative indices
    again = dc.CheckpointSeries(tmp_path / "run.dcs")
    assert _max_weight_error(again[3], series[3]) == 0.0
    assert _max_weight_error(again[-1], series[5]) == 0.0
    with pytest.raises(IndexError, match="no entry 6"):
        again[6]


def test_residuals_are_smaller_than_keys(run, tmp_path):
    series = dc.CheckpointSeries(tmp_path / "run.dcs", key_every=100)
    for c in run:
        series.append(c)
    own = [len(dc.encode_model(c, qp=SERIES_QP)) for c in run]
    sizes = [e.bytes for e in series.entries()]
    # the key is the checkpoint coded on its own but for its first moments, in the update domain
    assert sizes[0] < own[0]
    assert sum(sizes[1:]) < sum(own[1:])


def test_a_changed_structure_gets_a_key(run, tmp_path):
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    series.append(run[0])
    grown = copy.deepcopy(run[1])
    grown["model"]["extra"] = torch.ones(3)
    series.append(grown)
    reshaped = copy.deepcopy(run[2])
    reshaped["model"]["extra"] = torch.ones(4)
    series.append(reshaped)
    assert [e.kind for e in series.entries()] == ["key", "key", "key"]
    assert torch.allclose(series[2]["model"]["extra"], torch.ones(4), atol=1e-3)


def test_a_crash_mid_append_leaves_the_series_as_it_was(run, tmp_path):
    path = tmp_path / "run.dcs"
    series = dc.CheckpointSeries(path)
    series.append(run[0])
    series.append(run[1])
    complete = path.read_bytes()
    longer = tmp_path / "longer.dcs"
    longer.write_bytes(complete)
    dc.CheckpointSeries(longer).append(run[2])
    record = longer.read_bytes()[len(complete):]
    with open(path, "ab") as f:  # what a crash leaves: the first part of the next record
        f.write(record[:len(record) // 2])
    assert len(dc.CheckpointSeries(path)) == 2
    assert _max_weight_error(dc.CheckpointSeries(path)[1], series[1]) == 0.0
    dc.CheckpointSeries(path).append(run[2])  # written over the cut record
    assert len(dc.CheckpointSeries(path)) == 3
    assert path.read_bytes().startswith(complete)


def test_an_append_that_fails_leaves_the_series_as_it_was_and_a_first_one_no_file(run, tmp_path, monkeypatch):
    from deepcabac_py.errors import CheckpointError
    from deepcabac_py.model import container
    path = tmp_path / "run.dcs"
    monkeypatch.setattr(container, "MAX_METADATA_BYTES", 10)  # (every checkpoint is refused)
    with pytest.raises(CheckpointError, match="bytes of JSON"):
        dc.CheckpointSeries(path).append(run[0])
    assert not path.exists()
    r = CliRunner().invoke(main, ["series", "add", str(path), str(_saved(run[0], tmp_path / "c.pt"))])
    assert r.exit_code == 1 and "bytes of JSON" in r.output and "Traceback" not in r.output, r.output
    assert not path.exists()
    monkeypatch.undo()
    dc.CheckpointSeries(path).append(run[0])
    before = path.read_bytes()
    monkeypatch.setattr(container, "MAX_METADATA_BYTES", 10)
    with pytest.raises(CheckpointError):
        dc.CheckpointSeries(path).append(run[1])
    assert path.read_bytes() == before


def _saved(obj, path):
    torch.save(obj, path)
    return path


def test_a_second_writer_is_refused(run, tmp_path):
    path = tmp_path / "run.dcs"
    dc.CheckpointSeries(path).append(run[0])
    with open(path, "rb") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with pytest.raises(OutputError, match="another writer"):
            dc.CheckpointSeries(path).append(run[1])
    assert len(dc.CheckpointSeries(path)) == 1


def test_damage_is_named(run, tmp_path):
    path = tmp_path / "run.dcs"
    series = dc.CheckpointSeries(path)
    for c in run[:4]:
        series.append(c)
    with SeriesFile(path) as f:
        middle = f.records[2]
    data = bytearray(path.read_bytes())
    data[middle.payload_offset + middle.payload_size // 2] ^= 0x55
    path.write_bytes(bytes(data))
    fresh = dc.CheckpointSeries(path)
    assert len(fresh) == 4
    fresh[1]  # before the damage: fine
    for i in (2, 3):  # the damaged entry, and the one coded against it
        with pytest.raises(CorruptStreamError, match="entry 2 is damaged"):
            fresh[i]
    # a damaged record header
    data = bytearray(path.read_bytes())
    start = middle.payload_offset - len(middle.meta_bytes) - 24
    data[start:start + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStreamError, match="entry 2: damaged record header"):
        len(dc.CheckpointSeries(path))
    not_series = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, not_series)
    with pytest.raises(FormatError, match="not a checkpoint series"):
        len(dc.CheckpointSeries(not_series))
    with pytest.raises(FormatError, match="not a checkpoint series"):
        dc.CheckpointSeries(not_series).append(run[0])
    assert torch.load(not_series, weights_only=True)["w"].sum() == 2  # nothing written to it


def test_the_cli(run, tmp_path):
    paths = []
    for i, c in enumerate(run[:3]):
        paths.append(tmp_path / f"ckpt{i}.pt")
        torch.save(c, paths[-1])
    r = CliRunner()
    out = r.invoke(main, ["series", "add", str(tmp_path / "run.dcs"), *map(str, paths)])
    assert out.exit_code == 0, out.output
    assert out.output.count("entry") == 3 and "(residual)" in out.output
    size, coded = paths[1].stat().st_size, dc.CheckpointSeries(tmp_path / "run.dcs").entries()[1].bytes
    assert f"<- {paths[1]} ({size:,} bytes, {size / coded:.1f}x)" in out.output
    out = r.invoke(main, ["series", "list", str(tmp_path / "run.dcs")])
    assert out.exit_code == 0
    lines = out.output.splitlines()
    assert lines[1].split()[:2] == ["0", "15"] and lines[1].endswith("key")
    assert lines[2].endswith("residual of 0") and lines[-1].startswith("3 entries")
    dst = tmp_path / "back.pt"
    out = r.invoke(main, ["series", "extract", str(tmp_path / "run.dcs"), "2", "-o", str(dst)])
    assert out.exit_code == 0, out.output
    back = torch.load(dst, weights_only=True)
    assert back["step"] == 45
    for k, step in _coded_steps(tmp_path / "run.dcs", 2).items():
        assert _max_scaled_weight_error(back, run[2], k) <= 2 * step
    out = r.invoke(main, ["series", "extract", str(tmp_path / "run.dcs"), "2", "-o", str(dst)])
    assert out.exit_code == 1 and "exists" in out.output  # never overwritten without -f
    out = r.invoke(main, ["series", "extract", str(tmp_path / "run.dcs"), "7", "-o", str(tmp_path / "x.pt")])
    assert out.exit_code == 1 and "no entry 7 (the series has 3)" in out.output
    assert not (tmp_path / "x.pt").exists()
    out = r.invoke(main, ["series", "list", str(tmp_path / "nosuch.dcs")])
    assert out.exit_code == 1 and "no such file" in out.output
    assert not os.path.exists(tmp_path / "nosuch.dcs")


def test_numpy_checkpoints_and_bfloat16(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    series = dc.CheckpointSeries(tmp_path / "np.dcs")
    series.append({"w": w, "b": torch.from_numpy(w[0]).to(torch.bfloat16)})
    w2 = w + rng.normal(size=w.shape).astype(np.float32) * 1e-3
    series.append({"w": w2, "b": torch.from_numpy(w2[0]).to(torch.bfloat16)})
    got = series[1]
    assert isinstance(got["w"], np.ndarray) and got["b"].dtype == torch.bfloat16
    assert np.abs(got["w"] - w2).max() <= 2 * step_from_qp(SERIES_QP)
    with pytest.raises(InputError):
        len(dc.CheckpointSeries(tmp_path))  # a directory


def _bfloat16_run(n: int) -> list[dict]:
    """``n`` checkpoints of bfloat16 weights with Adam state in float32."""
    out = []
    for c in _run(n):
        c = copy.deepcopy(c)
        c["model"] = {k: v.to(torch.bfloat16) for k, v in c["model"].items()}
        out.append(c)
    return out


@pytest.mark.parametrize("kind", ["adam", "sgd", "bfloat16", "lossless", "qp"])
def test_the_writer_codes_against_what_a_reader_decodes(kind, run, sgd_run, tmp_path):
    """An object that appends codes each residual against its last entry as it coded it (the
    levels it quantized, never decoded); a new object for each append decodes the parent from the
    file. The two series are the same bytes: the writer's parent is the reader's, to the bit."""
    checkpoints = {"adam": run, "sgd": sgd_run, "bfloat16": _bfloat16_run(4), "lossless": run, "qp": run}[kind]
    settings = {"lossless": {"keep_exact": True}, "qp": {"qp": -40, "quantizer": "rdoq"}}.get(kind, {})
    settings = {"key_every": 4, **settings}
    one = dc.CheckpointSeries(tmp_path / "one.dcs", **settings)
    for c in checkpoints:
        one.append(c)
        dc.CheckpointSeries(tmp_path / "fresh.dcs", **settings).append(c)
    assert [e.kind for e in one.entries()][:4] == ["key", "residual", "residual", "residual"]
    assert (tmp_path / "one.dcs").read_bytes() == (tmp_path / "fresh.dcs").read_bytes()


def _next_step(ckpt: dict) -> torch.Tensor:
    ckpt = copy.deepcopy(ckpt)  # (the optimizer adopts the state's tensors and steps them in place)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4))
    model.load_state_dict(ckpt["model"])
    # (lr, momentum and betas come from the state's param groups)
    sgd = "momentum_buffer" in ckpt["optimizer"]["state"][0]
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5) if sgd else torch.optim.Adam(model.parameters())
    opt.load_state_dict(ckpt["optimizer"])
    before = torch.cat([p.detach().clone().reshape(-1) for p in model.parameters()])
    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before


def test_a_residual_entry_resumes_as_its_checkpoint(run, tmp_path):
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    for c in run:
        series.append(c)
    assert series.entries()[5].kind == "residual"
    with SeriesFile(tmp_path / "run.dcs") as f:
        assert f.records[5].meta["log_ratios"]  # second moments as log2 ratios to their parent's
    for i in (1, 5):
        got, original = series[i], run[i]
        for index, state in original["optimizer"]["state"].items():
            v, w = state["exp_avg_sq"], got["optimizer"]["state"][index]["exp_avg_sq"]
            assert not torch.any((v > 0) & (w == 0))
            nz = v != 0
            # (log2 of the ratio to the parent's quantized like a weight: within twice the step)
            octaves = 2 * step_from_qp(DEFAULT_MOMENTS_QP + LOG_RATIO_QP_OFFSET)
            assert ((w[nz] - v[nz]).abs() / v[nz]).max() <= 2 ** octaves - 1 + 1e-6
        a, b = _next_step(original), _next_step(got)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.99
        assert abs(b.norm().item() / a.norm().item() - 1) <= 0.05


def test_a_bfloat16_entry_is_its_parent_plus_its_residual(tmp_path):
    rng = np.random.default_rng(1)
    w = torch.from_numpy(rng.normal(size=(64, 48)).astype(np.float32))
    series = dc.CheckpointSeries(tmp_path / "bf16.dcs")
    series.append({"w": w.to(torch.bfloat16)})
    moved = w + 0.05
    series.append({"w": moved.to(torch.bfloat16)})
    assert [e.kind for e in series.entries()] == ["key", "residual"]
    got = series[1]["w"].float()
    # within bfloat16's half ulp (values below 8: 2**-5) and the trellis's error of the residual
    assert (got - moved).abs().max() <= 2.0**-5 + 2 * step_from_qp(SERIES_QP)


def _bits_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bits_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    return type(a) is type(b) and a == b


def _lossless_series(path, checkpoints: list[dict]) -> tuple[dc.CheckpointSeries, list[dict]]:
    """A lossless series of ``checkpoints``, every entry checked bit for bit from a fresh object;
    the series and its records' metas."""
    series = dc.CheckpointSeries(path, keep_exact=True)
    for c in checkpoints:
        series.append(c)
    fresh = dc.CheckpointSeries(path)
    assert all(_bits_equal(fresh[i], c) for i, c in enumerate(checkpoints))
    with SeriesFile(path) as f:
        return series, [r.meta for r in f.records]


def test_a_lossless_series_is_bit_exact_and_codes_bits_against_the_parent(run, tmp_path):
    series, metas = _lossless_series(tmp_path / "ll.dcs", run)
    coded = [set(m.get("bit_residuals", []) + m.get("xor_residuals", [])) for m in metas]
    predicted = [m.get("bit_predicted", {}) for m in metas]
    assert not coded[0] and all(names for names in coded[1:])
    sizes = [e.bytes for e in series.entries()]
    assert max(sizes[1:]) < sizes[0]  # (the second moments move slowly: their bits are close)
    # the weights' keys against the parent moved along Adam's direction: this run's steps follow it
    assert all(set(p) == {"model.0.weight", "model.0.bias", "model.2.weight"} for p in predicted[1:])
    assert all(m.endswith(".exp_avg") and c + c_parent < 0 for p in predicted[1:] for m, c, c_parent in p.values())
    # a prediction the entry cannot follow is refused
    with SeriesFile(tmp_path / "ll.dcs") as f:
        records = [(r.meta, f.payload(r)) for r in f.records]
    name = "model.0.weight"
    for bad in ({name: ["optimizer.state.7.exp_avg", -1.0, 0.0]}, {name: ["optimizer.state.0.exp_avg", None, 0.0]},
                {name: ["optimizer.state.0.exp_avg", -1.0]}, [2]):
        other = tmp_path / "bad.dcs"
        other.unlink(missing_ok=True)
        with SeriesFile(other, writer=True) as f:
            for i, (meta, payload) in enumerate(records[:2]):
                f.append({**meta, "bit_predicted": bad} if i == 1 else meta, payload)
        with pytest.raises(CorruptStreamError, match="prediction"):
            dc.CheckpointSeries(other)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_lossless_residual_survives_sign_changes_nan_and_inf(tmp_path, dtype):
    torch.manual_seed(1)
    a = torch.randn(64, 50).to(dtype)
    b = (a.double() * (1 + 1e-3 * torch.randn(64, 50, dtype=torch.float64))).to(dtype)
    b[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30]).to(dtype)
    b[1] = -b[1]  # sign changes: far apart as bits
    series = dc.CheckpointSeries(tmp_path / "s.dcs", keep_exact=True)
    series.append({"w": a})
    series.append({"w": b})
    assert _bits_equal(dc.CheckpointSeries(tmp_path / "s.dcs")[1], {"w": b})


def test_the_order_key_keeps_value_order_and_comes_back():
    from deepcabac_py.series.bit_residuals import from_order_key, order_key
    rng = np.random.default_rng(2)
    for words in (np.uint16, np.uint32, np.uint64):
        w = rng.integers(0, np.iinfo(words).max, size=5000, dtype=words, endpoint=True)
        assert np.array_equal(from_order_key(order_key(w)), w)
    x = np.sort((rng.standard_normal(3000) * 10.0 ** rng.integers(-30, 30, 3000)).astype(np.float32))
    keys = order_key(x.view(np.uint32))
    assert np.all(np.diff(keys.astype(np.int64)) >= 0)


def test_the_cli_adds_losslessly(run, tmp_path):
    paths = []
    for i, c in enumerate(run[:3]):
        torch.save(c, tmp_path / f"c{i}.pt")
        paths.append(str(tmp_path / f"c{i}.pt"))
    result = CliRunner().invoke(main, ["series", "add", str(tmp_path / "r.dcs"), *paths, "--lossless", "-q"])
    assert result.exit_code == 0, result.output
    assert _bits_equal(dc.CheckpointSeries(tmp_path / "r.dcs")[2], run[2])
    result = CliRunner().invoke(main, ["series", "add", str(tmp_path / "r.dcs"), paths[0], "--lossless", "--qp", "-30"])
    assert result.exit_code == 2 and "exclude" in result.output


def test_first_moments_are_coded_in_the_update_domain(run, tmp_path):
    from deepcabac_py.model.decoder import decode_checkpoint
    from deepcabac_py.series.moments import ADAM_EPS, UPDATE_QP, UPDATE_SUFFIX

    series = dc.CheckpointSeries(tmp_path / "run.dcs", key_every=3)
    for c in run[:4]:
        series.append(c)
    with SeriesFile(tmp_path / "run.dcs") as f:
        records = [(r.meta, f.payload(r)) for r in f.records]
    for i, (meta, payload) in enumerate(records):
        firsts = sorted(n for n in series.checkpoint(i).tensors if n.endswith(".exp_avg"))
        assert sorted(meta["update_domain"]) == firsts and firsts
        entries = {e.name: e for e in read_stream_header(payload).tensors}
        for name in firsts:
            assert name not in entries and entries[name + UPDATE_SUFFIX].qp == UPDATE_QP
        # what docs/format.md says the entry's first moments are: u * r * (sqrt(v) + eps), v as decoded
        coded = decode_checkpoint(payload).tensors
        got = series.checkpoint(i).tensors
        for name, r in meta["update_domain"].items():
            v = got[name[:-len("exp_avg")] + "exp_avg_sq"].double().numpy()
            scale = np.sqrt(v) + ADAM_EPS
            want = (coded[name + UPDATE_SUFFIX].double().numpy() * r * scale).astype(np.float32)
            assert np.array_equal(got[name].numpy(), want)
            # each element errs by at most about a step of the update domain, relative to its scale
            original = run[i]["optimizer"]["state"][int(name.split(".")[-2])]["exp_avg"].double().numpy()
            assert np.max(np.abs(got[name].double().numpy() - original) / (scale * r)) <= 2 * step_from_qp(UPDATE_QP)


def test_malformed_update_domain_scales_are_refused(run, tmp_path):
    path = tmp_path / "run.dcs"
    dc.CheckpointSeries(path).append(run[0])
    with SeriesFile(path) as f:
        meta, payload = dict(f.records[0].meta), f.payload(f.records[0])
    for bad in ({"optimizer.state.0.exp_avg": -1.0}, {"optimizer.state.0.exp_avg": "1"}, {"not.there": 1.0}, [1.0]):
        other = tmp_path / "bad.dcs"
        other.unlink(missing_ok=True)
        with SeriesFile(other, writer=True) as f:
            f.append({**meta, "update_domain": bad}, payload)
        with pytest.raises(CorruptStreamError, match="update-domain|no second moment"):
            dc.CheckpointSeries(other)[0]


def test_a_version_1_series_still_reads_and_takes_appends(run, tmp_path, monkeypatch):
    from deepcabac_py.series import moments, records

    path = tmp_path / "old.dcs"
    with monkeypatch.context() as m:  # a series as version 1 wrote it: first moments in the log domain
        m.setattr(records, "SERIES_VERSION", 1)
        m.setattr(moments, "update_partners", lambda tensors, skeleton: {})
        old = dc.CheckpointSeries(path)
        for c in run[:2]:
            old.append(c)
        written = [old[i] for i in range(2)]
    assert int.from_bytes(path.read_bytes()[8:10], "little") == 1
    series = dc.CheckpointSeries(path)
    for i in range(2):
        assert _max_weight_error(series[i], written[i]) == 0.0
        for k, state in written[i]["optimizer"]["state"].items():
            assert torch.equal(series[i]["optimizer"]["state"][k]["exp_avg"], state["exp_avg"])
    series.append(run[2])
    assert int.from_bytes(path.read_bytes()[8:10], "little") == records.SERIES_VERSION
    fresh = dc.CheckpointSeries(path)
    assert [e.kind for e in fresh.entries()] == ["key", "residual", "residual"]
    assert _max_weight_error(fresh[1], written[1]) == 0.0
    for k, step in _coded_steps(path, 2).items():
        assert _max_scaled_weight_error(fresh[2], run[2], k) <= 2 * step


def test_settings_that_name_weights_reach_only_the_weights(run, tmp_path):
    # the second moments are coded alone first (the update domain needs them as decoded): settings
    # that name weights must neither fail there nor change them
    names = [f"model.{k}" for k in run[0]["model"]]
    settings = {"importance": {n: np.ones(tuple(run[0]["model"][n[6:]].shape)) for n in names},
                "qp_overrides": {"model.0.*": -50}, "keep_exact": ["model.2.bias"]}
    series = dc.CheckpointSeries(tmp_path / "run.dcs", key_every=2, **settings)
    for c in run[:3]:
        series.append(c)
    got = series[1]
    assert torch.equal(got["model"]["2.bias"], run[1]["model"]["2.bias"])
    v = got["optimizer"]["state"][0]["exp_avg_sq"].double().numpy()  # (0.weight's: in its scale)
    error = (got["model"]["0.weight"] - run[1]["model"]["0.weight"]).abs().double().numpy()
    assert (error * _residual_scale(v, float(np.mean(v)))).max() <= 2 * step_from_qp(-50)


def test_residuals_are_predicted_from_the_adam_direction(run, tmp_path):
    from deepcabac_py.model.decoder import decode_checkpoint
    from deepcabac_py.series.moments import ADAM_EPS

    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    for c in run[:3]:
        series.append(c)
    with SeriesFile(tmp_path / "run.dcs") as f:
        meta, payload = f.records[2].meta, f.payload(f.records[2])
    assert meta["predicted"]  # (this run's steps follow its moments)
    coded = decode_checkpoint(payload).tensors
    parent, got = series.checkpoint(1).tensors, series.checkpoint(2).tensors
    def direction(tensors, moment):
        m, v = tensors[moment].double().numpy(), tensors[moment + "_sq"].double().numpy()
        return m / (np.sqrt(v) + ADAM_EPS)

    assert sorted(meta["v_scaled"]) == sorted(meta["predicted"])
    for name, (moment, c, c_parent) in meta["predicted"].items():
        assert name in meta["residuals"] and moment.endswith(".exp_avg")
        # what docs/format.md says: parent + residual / max(sqrt(v / mean), 1/16) + c m / (sqrt(v) + eps)
        # + the parent's such term
        second, mean = meta["v_scaled"][name]
        assert second == moment + "_sq"
        scale = np.maximum(np.sqrt(got[second].double().numpy() / mean), 1 / 16)
        want = (parent[name].double().numpy() + coded[name].double().numpy() / scale
                + (c * direction(got, moment) + c_parent * direction(parent, moment)))
        assert np.array_equal(got[name].numpy(), want.astype(np.float32))
    # a prediction the entry cannot follow is refused
    other = tmp_path / "bad.dcs"
    with SeriesFile(tmp_path / "run.dcs") as f:
        records = [(r.meta, f.payload(r)) for r in f.records]
    name = next(iter(meta["predicted"]))
    for bad in ({name: ["optimizer.state.9.exp_avg", 1.0, 0.0]}, {name: ["optimizer.state.0.exp_avg", "x", 0.0]},
                {"model.nothing": ["optimizer.state.0.exp_avg", 1.0, 0.0]},
                {name: ["optimizer.state.0.exp_avg", 1.0]}, [1]):
        other.unlink(missing_ok=True)
        with SeriesFile(other, writer=True) as f:
            for i, (m_, p_) in enumerate(records):
                f.append({**m_, "predicted": bad} if i == 2 else m_, p_)
        dc.CheckpointSeries(other)[1]
        with pytest.raises(CorruptStreamError, match="prediction"):
            dc.CheckpointSeries(other)[2]


def test_malformed_residual_scales_are_refused(run, tmp_path):
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    for c in run[:2]:
        series.append(c)
    with SeriesFile(tmp_path / "run.dcs") as f:
        records = [(r.meta, f.payload(r)) for r in f.records]
    name, (second, mean) = next(iter(records[1][0]["v_scaled"].items()))
    other = tmp_path / "bad.dcs"
    for bad in ({name: [second, -mean]}, {name: [second, "1"]}, {name: [second, float("inf")]}, {name: [second]},
                {name: ["optimizer.state.9.exp_avg_sq", mean]}, {name: [second.replace("_sq", ""), mean]},
                {"model.nothing": [second, mean]}, [1]):
        other.unlink(missing_ok=True)
        with SeriesFile(other, writer=True) as f:
            f.append(*records[0])
            f.append({**records[1][0], "v_scaled": bad}, records[1][1])
        dc.CheckpointSeries(other)[0]
        with pytest.raises(CorruptStreamError, match="residual scale"):
            dc.CheckpointSeries(other)[1]
    # a scale whose second moment has another shape
    wrong = next(n for n in records[1][0]["v_scaled"] if n != name
                 and records[1][0]["v_scaled"][n][0] != second)
    other.unlink(missing_ok=True)
    with SeriesFile(other, writer=True) as f:
        f.append(*records[0])
        f.append({**records[1][0], "v_scaled": {name: records[1][0]["v_scaled"][wrong]}}, records[1][1])
    with pytest.raises(CorruptStreamError, match="does not match its second moment"):
        dc.CheckpointSeries(other)[1]


def test_residuals_in_their_second_moments_scale_take_fewer_bytes(run, tmp_path, monkeypatch):
    from deepcabac_py.series import checkpoint_series

    scaled = dc.CheckpointSeries(tmp_path / "scaled.dcs", key_every=100)
    for c in run:
        scaled.append(c)
    # (the residuals as they are, unscaled)
    monkeypatch.setattr(checkpoint_series._k, "scaled_by_moment_into",
                        lambda rest, v, mean, floor, out: out.__setitem__(slice(None), rest))
    plain = dc.CheckpointSeries(tmp_path / "plain.dcs", key_every=100)
    for c in run:
        plain.append(c)
    sizes = [(a.bytes, b.bytes) for a, b in zip(scaled.entries(), plain.entries())]
    assert sizes[0][0] == sizes[0][1]  # (the key is coded alike)
    assert sum(a for a, _ in sizes[1:]) < sum(b for _, b in sizes[1:])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_step_size_is_the_size_of_the_optimizers_last_step(optimizer):
    from deepcabac_py.io.checkpoint import flatten
    from deepcabac_py.model.optimizer_state import adam_groups, momentum_groups
    from deepcabac_py.series.steps import step_size

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = (torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.85, 0.995)) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.07, momentum=0.8, dampening=0.1, weight_decay=1e-3))
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    for step in range(7):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[8 * step:8 * step + 8]), y[8 * step:8 * step + 8]).backward()
        opt.step()
    ckpt = flatten({"optimizer": opt.state_dict()})
    groups = {**adam_groups(ckpt.skeleton), **momentum_groups(ckpt.skeleton)}
    assert len(groups) == 4
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        moment = f"optimizer.state.{i}.{'exp_avg' if optimizer == 'adam' else 'momentum_buffer'}"
        taken = (p.detach() - b).double().pow(2).mean().sqrt().item()
        assert step_size(ckpt.tensors, moment, groups[moment]) == pytest.approx(taken, rel=1e-5)


def test_weights_with_adam_state_take_adams_step_size_where_coarser(run, tmp_path):
    from deepcabac_py.io.checkpoint import flatten
    from deepcabac_py.model.optimizer_state import adam_groups
    from deepcabac_py.quant.steps import qp_at_most
    from deepcabac_py.series.steps import STEP_FRACTION, step_size

    series = dc.CheckpointSeries(tmp_path / "run.dcs", key_every=3)
    for c in run[:4]:
        series.append(c)
    assert [e.kind for e in series.entries()] == ["key", "residual", "residual", "key"]
    coarser = 0
    for i, c in enumerate(run[:4]):
        ckpt = flatten(c)
        groups = adam_groups(ckpt.skeleton)
        qps = {e.name: e.qp for e in series_header(tmp_path / "run.dcs", i).tensors}
        for k, (name, t) in enumerate(c["model"].items()):
            moment = f"optimizer.state.{k}.exp_avg"
            adam = qp_at_most(STEP_FRACTION * step_size(ckpt.tensors, moment, groups[moment]))
            series_qp = SERIES_QP if t.dim() >= 2 else SERIES_QP - 24
            if adam > series_qp:
                assert qps[f"model.{name}"] == adam, (i, name)
                coarser += 1
            else:
                assert qps[f"model.{name}"] <= series_qp, (i, name)
    assert coarser >= 8  # (this run's Adam steps are far above the series' qp)
    # a qp given is every weight's
    given = dc.CheckpointSeries(tmp_path / "given.dcs", key_every=3, qp=SERIES_QP)
    for c in run[:2]:
        given.append(c)
    for i in range(2):
        header = series_header(tmp_path / "given.dcs", i)
        assert {e.qp for e in header.tensors if e.name.endswith(".0.weight")} == {SERIES_QP}


def test_a_weight_whose_group_is_not_adams_keeps_the_series_qp(tmp_path):
    # two layers of one shape, the first in a group whose lr is a tensor (not read): its weights
    # keep the series' qp, and the second layer's Adam state is not taken for the first's
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": torch.tensor(0.05)},
                            {"params": model[2].parameters(), "lr": 0.05}])
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    series = dc.CheckpointSeries(tmp_path / "run.dcs")
    series.append({"model": model.state_dict(), "optimizer": opt.state_dict()})
    qps = {e.name: e.qp for e in series_header(tmp_path / "run.dcs", 0).tensors}
    assert qps["model.0.weight"] <= SERIES_QP and qps["model.0.bias"] <= SERIES_QP - 24
    assert qps["model.2.weight"] > SERIES_QP + 20 and qps["model.2.bias"] > SERIES_QP + 20


def test_an_sgd_series_codes_by_the_size_and_direction_of_sgds_step(sgd_run, tmp_path):
    # SGD's step is lr times its momentum buffer: each buffer is coded in the update domain as
    # buffer / r, each weight at the size of its last step where that is coarser than the series'
    # qp, and each weight's residual predicted from its buffers (docs/format.md)
    from deepcabac_py.model.decoder import decode_checkpoint
    from deepcabac_py.quant.steps import qp_at_most
    from deepcabac_py.series.moments import UPDATE_QP, UPDATE_SUFFIX

    path = tmp_path / "run.dcs"
    series = dc.CheckpointSeries(path, key_every=3)
    for c in sgd_run:
        series.append(c)
    with SeriesFile(path) as f:
        records = [(r.meta, f.payload(r)) for r in f.records]
    assert [meta["kind"] for meta, _ in records] == ["key", "residual", "residual", "key"]
    for i, (meta, payload) in enumerate(records):
        got, original = series[i], sgd_run[i]
        states = original["optimizer"]["state"]
        assert sorted(meta["update_domain"]) == sorted(f"optimizer.state.{k}.momentum_buffer" for k in states)
        entries = {e.name: e for e in read_stream_header(payload).tensors}
        coded = decode_checkpoint(payload).tensors
        for name, r in meta["update_domain"].items():
            k = int(name.split(".")[-2])
            buffer, decoded = states[k]["momentum_buffer"].double(), got["optimizer"]["state"][k]["momentum_buffer"]
            assert entries[name + UPDATE_SUFFIX].qp == UPDATE_QP
            assert r == pytest.approx(buffer.pow(2).mean().sqrt().item(), rel=1e-6)
            want = (coded[name + UPDATE_SUFFIX].double().numpy() * r).astype(np.float32)
            assert np.array_equal(decoded.numpy(), want)
            assert (decoded.double() - buffer).abs().max().item() <= 2 * step_from_qp(UPDATE_QP) * r
        for k, name in enumerate(original["model"]):  # (this run's steps are far above the series' qp)
            size = 0.1 * states[k]["momentum_buffer"].double().pow(2).mean().sqrt().item()
            assert entries[f"model.{name}"].qp == qp_at_most(size) > SERIES_QP, (i, name)
        if meta["kind"] == "residual":
            assert meta["predicted"] and not meta["v_scaled"]
            parent = series[i - 1]
            for weight, (moment, c, c_parent) in meta["predicted"].items():
                k, name = int(moment.split(".")[-2]), weight[len("model."):]
                assert moment.endswith(".momentum_buffer") and list(original["model"]).index(name) == k
                now = got["optimizer"]["state"][k]["momentum_buffer"].double().numpy()
                before = parent["optimizer"]["state"][k]["momentum_buffer"].double().numpy()
                want = (parent["model"][name].double().numpy() + coded[weight].double().numpy()
                        + (c * now + c_parent * before))
                assert np.array_equal(got["model"][name].numpy(), want.astype(np.float32))
        a, b = _next_step(original), _next_step(got)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.99
        assert abs(b.norm().item() / a.norm().item() - 1) <= 0.05


def test_a_lossless_sgd_series_is_bit_exact_and_predicted_from_the_buffers(sgd_run, tmp_path):
    _, metas = _lossless_series(tmp_path / "ll.dcs", sgd_run)
    predicted = [m.get("bit_predicted", {}) for m in metas]
    assert any(predicted[1:]) and all(m.endswith(".momentum_buffer") for p in predicted for m, _, _ in p.values())


def test_two_optimizers_pair_each_weight_with_its_own_state(tmp_path):
    # a GAN's checkpoint (Lightning's layout): two models of one architecture, each with its own
    # Adam, at learning rates 1000 times apart; each weight takes its own optimizer's step size
    from deepcabac_py.io.checkpoint import flatten
    from deepcabac_py.model.optimizer_state import adam_groups
    from deepcabac_py.quant.steps import qp_at_most
    from deepcabac_py.series.steps import STEP_FRACTION, step_size

    torch.manual_seed(7)
    nets = [torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16)) for _ in range(2)]
    opts = [torch.optim.Adam(nets[0].parameters(), lr=1e-2), torch.optim.Adam(nets[1].parameters(), lr=1e-5)]
    for _ in range(5):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(torch.randn(32, 16)).pow(2).mean().backward()
            opt.step()
    ckpt = {"state_dict": {f"{p}.{k}": v for p, net in zip("gd", nets) for k, v in net.state_dict().items()},
            "optimizer_states": [opt.state_dict() for opt in opts]}
    dc.CheckpointSeries(tmp_path / "gan.dcs").append(ckpt)
    qps = {e.name: e.qp for e in series_header(tmp_path / "gan.dcs", 0).tensors}
    flat = flatten(ckpt)
    groups = adam_groups(flat.skeleton)
    for j, prefix in enumerate("gd"):
        for i, (name, t) in enumerate(nets[j].state_dict().items()):
            moment = f"optimizer_states.{j}.state.{i}.exp_avg"
            own = qp_at_most(STEP_FRACTION * step_size(flat.tensors, moment, groups[moment]))
            base = SERIES_QP if t.dim() >= 2 else SERIES_QP - 24
            assert qps[f"state_dict.{prefix}.{name}"] == max(own, base), (prefix, name)


@pytest.mark.parametrize("exact", [False, True])
def test_a_zero_dimensional_parameter_with_adam_state(tmp_path, exact):
    # (CLIP's logit_scale: a 0-d weight, its 0-d moments, residuals of 0-d arrays)
    torch.manual_seed(2)
    lin, scale = torch.nn.Linear(8, 4), torch.nn.Parameter(torch.tensor(2.6))
    opt = torch.optim.Adam([*lin.parameters(), scale], lr=1e-2)
    written = []
    for _ in range(3):
        for _ in range(5):
            opt.zero_grad()
            (lin(torch.randn(16, 8)) * scale.exp()).pow(2).mean().backward()
            opt.step()
        written.append(copy.deepcopy({"model": {**lin.state_dict(), "logit_scale": scale.detach()},
                                      "optimizer": opt.state_dict()}))
    series = dc.CheckpointSeries(tmp_path / "run.dcs", keep_exact=exact)
    for c in written:
        series.append(c)
    assert [e.kind for e in series.entries()] == ["key", "residual", "residual"]
    for i, c in enumerate(written):
        got = series[i]
        assert got["model"]["logit_scale"].shape == () and got["optimizer"]["state"][2]["exp_avg"].shape == ()
        error = (got["model"]["logit_scale"] - c["model"]["logit_scale"]).abs().item()
        assert error == 0.0 if exact else error <= 2 * _coded_steps(tmp_path / "run.dcs", i)["logit_scale"]


def test_a_second_moment_that_falls_to_zero_comes_back_zero(tmp_path):
    # (its log2 ratio to the parent is not defined: the moment is coded on its own; it once came
    # back as 1.0, the parent times 2 ** -log2(parent))
    torch.manual_seed(0)
    checkpoints = []
    for i in range(2):
        v = torch.rand(64, 32) * 1e-6 + 1e-8
        m = torch.randn(64, 32) * 1e-4
        if i:
            v[3, 5] = v[7, 1] = m[3, 5] = 0.0
        checkpoints.append({
            "model": {"w": torch.randn(64, 32) * 0.1},
            "optimizer": {"state": {0: {"step": torch.tensor(10.0 + i), "exp_avg": m, "exp_avg_sq": v}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                                            "params": [0]}]}})
    series = dc.CheckpointSeries(tmp_path / "zero.dcs")
    for c in checkpoints:
        series.append(c)
    assert series.entries()[1].kind == "residual"
    got = series[1]["optimizer"]["state"][0]["exp_avg_sq"]
    assert got[3, 5].item() == 0.0 and got[7, 1].item() == 0.0
    assert bool((got > 0).sum() == got.numel() - 2)
