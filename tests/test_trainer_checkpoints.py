"""A Hugging Face Trainer's ``checkpoint-N/`` directories as users have them (weights in a
safetensors file sorted by name, optimizer.pt, scheduler.pt, and files only a full unpickle reads):
encoded as a directory, and as the entries of a checkpoint series that training resumes from."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import coded_steps

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (the Trainer's own requirement)

import deepcabac_py as dc  # noqa: E402
from deepcabac_py.cli.main import main  # noqa: E402
from deepcabac_py.errors import CheckpointError, OutputError, OutputExistsError  # noqa: E402
from deepcabac_py.io import directories  # noqa: E402
from deepcabac_py.io.checkpoint import flatten  # noqa: E402
from deepcabac_py.io.directories import (  # noqa: E402
    DIRECTORY_KIND,
    load_checkpoint_directory,
    save_checkpoint_directory,
)
from deepcabac_py.model.optimizer_state import adam_groups  # noqa: E402
from deepcabac_py.model.settings import EncodeSettings  # noqa: E402
from deepcabac_py.quant.steps import qp_at_most  # noqa: E402
from deepcabac_py.series import checkpoint_series as cs  # noqa: E402
from deepcabac_py.series import steps  # noqa: E402
from deepcabac_py.series.checkpoint_series import DEFAULT_SERIES_QP  # noqa: E402
from deepcabac_py.series.records import SeriesFile  # noqa: E402

STEPS, EVERY = 60, 20
DENSITY = EncodeSettings().qp_density
CARRIED = ("config.json", "rng_state.pth", "trainer_state.json", "training_args.bin")
PREFIX = "files.model.safetensors.safetensors."


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": int(ids[0] % 2)}


def _model():
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, num_labels=2)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _trainer(out, max_steps: int = STEPS, callbacks=None, **more):
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=16, max_steps=max_steps,
                                          save_steps=EVERY, save_strategy="steps", report_to=[], use_cpu=True,
                                          learning_rate=1e-3, disable_tqdm=True, logging_strategy="no", seed=0,
                                          **more)
    return transformers.Trainer(model=_model(), args=args, train_dataset=Tokens(), callbacks=callbacks)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the run's directory, weight name -> the index the optimizer numbers it by)."""
    out = tmp_path_factory.mktemp("trainer")
    trainer = _trainer(out)
    trainer.train()
    names = [n for n, _ in trainer.model.named_parameters()]
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    # the Trainer's two param groups: weights with decay, then the others (biases, LayerNorm)
    order = [n for n in names if n in decay] + [n for n in names if n not in decay]
    return out, {n: i for i, n in enumerate(order)}


def _checkpoints(out) -> list[str]:
    return [str(out / f"checkpoint-{s}") for s in range(EVERY, STEPS + 1, EVERY)]


def _params(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def test_a_trainer_checkpoint_directory_encodes_and_decodes(run, tmp_path):
    # (refused before: five torch and safetensors files "and no index saying which tensor is in which")
    src = _checkpoints(run[0])[0]
    r = CliRunner().invoke(main, ["encode", src, "-o", str(tmp_path / "enc"), "-q"])
    assert r.exit_code == 0, r.output
    # training_args.bin and rng_state.pth need a full unpickle: carried as they are, never loaded
    assert sorted(os.listdir(tmp_path / "enc")) == sorted(
        ["config.json", "model.safetensors.dcb", "optimizer.pt.dcb", "rng_state.pth", "scheduler.pt.dcb",
         "trainer_state.json", "training_args.bin"])
    r = CliRunner().invoke(main, ["decode", str(tmp_path / "enc"), "-o", str(tmp_path / "dec"), "-q"])
    assert r.exit_code == 0, r.output
    for name in CARRIED:
        assert (tmp_path / "dec" / name).read_bytes() == open(os.path.join(src, name), "rb").read()
    a = torch.load(os.path.join(src, "optimizer.pt"), weights_only=True)
    b = torch.load(tmp_path / "dec" / "optimizer.pt", weights_only=True)
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    transformers.BertForSequenceClassification.from_pretrained(tmp_path / "dec")


def test_a_series_of_trainer_checkpoints_resumes_as_the_original(run, tmp_path):
    out, _ = run
    series = tmp_path / "run.dcs"
    r = CliRunner().invoke(main, ["series", "add", str(series), *_checkpoints(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["series", "list", str(series)])
    assert [line.split()[:2] for line in r.output.splitlines()[1:4]] == [["0", "20"], ["1", "40"], ["2", "60"]]
    raw = sum(os.path.getsize(os.path.join(d, f)) for d in _checkpoints(out) for f in os.listdir(d))
    assert os.path.getsize(series) * 4 < raw

    got = tmp_path / "checkpoint-40"
    r = CliRunner().invoke(main, ["series", "extract", str(series), "1", "-o", str(got)])
    assert r.exit_code == 0, r.output
    original = out / "checkpoint-40"
    assert sorted(os.listdir(got)) == sorted(os.listdir(original))
    for name in CARRIED:
        assert (got / name).read_bytes() == (original / name).read_bytes()
    head = 8 + int.from_bytes((original / "model.safetensors").read_bytes()[:8], "little")
    assert (got / "model.safetensors").read_bytes()[:head] == (original / "model.safetensors").read_bytes()[:head]

    # the fidelity: held-out loss, and the next step resumed from either
    held_out = Tokens()
    batch = {k: torch.stack([torch.as_tensor(held_out[len(held_out) - 1 - i][k]) for i in range(64)])
             for k in ("input_ids", "labels")}
    losses = {}
    for name, start in (("original", original), ("extracted", got)):
        model = transformers.BertForSequenceClassification.from_pretrained(start).eval()
        with torch.no_grad():
            losses[name] = float(model(**batch).loss)
    assert abs(losses["extracted"] / losses["original"] - 1) < 0.005, losses
    steps = {}
    for name, start in (("original", original), ("extracted", got)):
        trainer = _trainer(tmp_path / f"resumed-{name}", max_steps=2 * EVERY + 1)
        trainer.train(resume_from_checkpoint=str(start))
        begin = _params(start)
        steps[name] = torch.cat([(p.detach() - begin[n]).flatten() for n, p in trainer.model.named_parameters()])
    cos = float(torch.nn.functional.cosine_similarity(steps["extracted"], steps["original"], dim=0))
    norm = float(steps["extracted"].norm() / steps["original"].norm())
    assert cos >= 0.99 and abs(norm - 1) < 0.05, (cos, norm)


def test_the_callback_adds_every_checkpoint_the_trainer_saves(run, tmp_path):
    from deepcabac_py.integrations.hf_trainer import SERIES_NAME, SeriesCallback

    _trainer(tmp_path, callbacks=[SeriesCallback()], save_total_limit=1).train()
    # (the Trainer removed the older directories: the series holds them)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-60"]
    series = dc.CheckpointSeries(tmp_path / SERIES_NAME)
    assert [(e.step, e.kind) for e in series.entries()] == [(20, "key"), (40, "residual"), (60, "residual")]
    series.extract(1, tmp_path / "checkpoint-40")
    original = run[0] / "checkpoint-40"  # (the same seed: the same run)
    assert sorted(os.listdir(tmp_path / "checkpoint-40")) == sorted(os.listdir(original))
    a, b = _params(tmp_path / "checkpoint-40"), _params(original)
    error = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) / sum(float(b[n].pow(2).sum()) for n in b)
    assert error < 1e-4, error


def test_weights_pair_with_their_own_moments_whatever_the_files_order(run, tmp_path):
    # model.safetensors lists the weights by name, the optimizer numbers them by its two groups:
    # in order, a weight met its own first moment only by chance (1 pair of 45 in the first entry)
    out, truth = run
    s = dc.CheckpointSeries(tmp_path / "run.dcs")
    for d in _checkpoints(out):
        s.append(d)
    with SeriesFile(tmp_path / "run.dcs") as f:
        predicted = [r.meta["predicted"] for r in f.records if r.meta["kind"] == "residual"]
    assert len(predicted) == 2
    matrices = {PREFIX + n for n in truth if n.endswith("weight") and "LayerNorm" not in n}
    for pairs in predicted:
        assert matrices <= set(pairs)  # (every matrix predicted from the step directions of its own moment)
        for weight in matrices:
            assert int(pairs[weight][0].split(".")[-2]) == truth[weight.removeprefix(PREFIX)], weight
        # (LayerNorm's vectors of 64 elements may take a sibling's: their steps are alike)
        right = [int(m.split(".")[-2]) == truth[w.removeprefix(PREFIX)] for w, (m, *_) in pairs.items()]
        assert sum(right) >= 0.8 * len(truth), (sum(right), len(truth))


def test_a_first_key_in_another_order_takes_the_smallest_step_of_its_shape(run, tmp_path):
    out, _ = run
    s = dc.CheckpointSeries(tmp_path / "run.dcs")
    s.append(_checkpoints(out)[0])
    steps = coded_steps(tmp_path / "run.dcs", 0)
    finest = 2.0 ** (DEFAULT_SERIES_QP / 4)
    matrices = [n for n in steps if n.startswith(PREFIX) and ("self." in n or "dense." in n) and n.endswith("weight")]
    assert len(matrices) == 13 and all(steps[n] > finest for n in matrices), steps


def test_correlated_pairs_follow_the_changes_not_the_order():
    rng = np.random.default_rng(0)
    firsts = [f"opt.state.{i}.exp_avg" for i in range(5)]
    before, now = {}, {}
    for i, m in enumerate(firsts):
        for t in (before, now):
            t[m] = rng.standard_normal((40, 30)).astype(np.float32)
            t[f"opt.state.{i}.exp_avg_sq"] = (rng.random((40, 30)) + 0.5).astype(np.float32)
    weights = [f"w{k}" for k in range(5)]
    owner = [3, 0, 4, 1, 2]  # weight k's moment, in no order
    for k, w in enumerate(weights):
        before[w] = rng.standard_normal((40, 30)).astype(np.float32)
        m = owner[k]
        step = now[firsts[m]] / np.sqrt(now[f"opt.state.{m}.exp_avg_sq"])
        now[w] = before[w] - 1e-3 * step + (1e-3 * rng.standard_normal((40, 30)) if k < 4 else 0)
    now["w4"] = before["w4"] + 1e-3 * rng.standard_normal((40, 30)).astype(np.float32)  # (unrelated)
    pairs = steps.correlated_pairs(weights, now, firsts, before)
    assert pairs == {f"w{k}": firsts[owner[k]] for k in range(4)}


def test_unpaired_weights_take_a_step_only_where_no_buffer_can_be_among_them():
    # BatchNorm's running statistics share its weight's shape but have no optimizer state: of four
    # unpaired vectors and two moments none takes a step; of two vectors and two, both the smaller
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(32, 8)).pow(2).mean().backward()
    opt.step()
    ckpt = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
    settings = {"qp": DEFAULT_SERIES_QP, "qp_1d": DEFAULT_SERIES_QP}
    sizes = {i: steps.step_size(ckpt.tensors, f"optimizer.state.{i}.exp_avg",
                                adam_groups(ckpt.skeleton)[f"optimizer.state.{i}.exp_avg"]) for i in range(4)}
    qps = steps.step_qps(ckpt, settings, replace(steps.weight_pairs(ckpt), pairs={}))
    assert set(qps) == {"model.0.weight"}  # (the one of its shape: its own step)
    assert qps["model.0.weight"][0] == qp_at_most(sizes[0], DENSITY)
    del ckpt.tensors["model.1.running_mean"], ckpt.tensors["model.1.running_var"]
    qps = steps.step_qps(ckpt, settings, replace(steps.weight_pairs(ckpt), pairs={}))
    smallest = qp_at_most(min(sizes[1], sizes[2], sizes[3]), DENSITY)
    assert {n: q for n, (q, _) in qps.items() if n != "model.0.weight"} == {
        "model.0.bias": smallest, "model.1.weight": smallest, "model.1.bias": smallest}


def _directory(path) -> None:
    os.makedirs(path / "sub")
    torch.save({"w": torch.arange(6.0)}, path / "weights.pt")
    torch.save({"f": np.float64}, path / "refused.bin")  # (a numpy type: weights-only loading refuses it)
    np.savez(path / "arrays.npz", a=np.arange(5, dtype=np.int16))
    (path / "sub" / "notes.txt").write_bytes(b"\x00not a checkpoint\xff")
    from safetensors.torch import save_file
    save_file({"b": torch.ones(3, 2), "a": torch.zeros(4)}, path / "model.safetensors", metadata={"format": "pt"})


def test_a_directory_round_trips_as_one_checkpoint(tmp_path):
    _directory(tmp_path / "d")
    ckpt = load_checkpoint_directory(tmp_path / "d")
    assert ckpt.kind == DIRECTORY_KIND
    back = dc.decode_checkpoint(dc.encode_model(ckpt, keep_exact=True))
    save_checkpoint_directory(back, tmp_path / "e")
    for rel in ("refused.bin", "sub/notes.txt", "model.safetensors"):
        assert (tmp_path / "e" / rel).read_bytes() == (tmp_path / "d" / rel).read_bytes(), rel
    assert torch.equal(torch.load(tmp_path / "e" / "weights.pt", weights_only=True)["w"], torch.arange(6.0))
    with np.load(tmp_path / "e" / "arrays.npz", allow_pickle=False) as z:
        assert z["a"].dtype == np.int16 and z["a"].tolist() == list(range(5))
    with pytest.raises(OutputExistsError):
        save_checkpoint_directory(back, tmp_path / "e")
    save_checkpoint_directory(back, tmp_path / "e", force=True)


def test_a_directory_with_a_tokenizer_of_megabytes_goes_into_a_series(tmp_path):
    # (a Trainer given a tokenizer saves its files in every checkpoint-N/: tokenizer.json is 7-9 MB
    # for today's LLMs, more than the 2^23 bytes of metadata JSON a stream of format version 12 held)
    import struct

    from helpers import reseal_header

    from deepcabac_py.errors import CorruptStreamError
    d = tmp_path / "checkpoint-7"
    _directory(d)
    rng = np.random.default_rng(0)
    vocab = {f"tok{i}_{w}": i for i, w in enumerate(rng.integers(0, 2**40, 450_000).tolist())}
    (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    assert 8 << 20 < (d / "tokenizer.json").stat().st_size
    data = dc.encode_model(load_checkpoint_directory(d), keep_exact=True)
    assert dc.read_stream_header(data).version == 13
    save_checkpoint_directory(dc.decode_checkpoint(data), tmp_path / "back")
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    old = bytearray(data)  # (a reader of version 12 held 2^23 bytes of metadata at most)
    struct.pack_into("<H", old, 8, 12)
    with pytest.raises(CorruptStreamError, match="more than a header of format version 12 holds"):
        dc.read_stream_header(reseal_header(old))
    s = dc.CheckpointSeries(tmp_path / "s.dcs")
    s.append(d)
    s.append(d)
    s.extract(1, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()


def test_the_series_api_takes_and_gives_paths(tmp_path):
    _directory(tmp_path / "checkpoint-7")
    torch.save({"w": torch.ones(4)}, tmp_path / "one.pt")
    s = dc.CheckpointSeries(tmp_path / "s.dcs")
    assert s.append(str(tmp_path / "checkpoint-7")) == 0 and s.append(tmp_path / "one.pt") == 1
    assert s.entries()[0].step == 7  # (no trainer_state.json: the directory's name)
    s.extract(0, tmp_path / "out")
    assert (tmp_path / "out" / "refused.bin").read_bytes() == (tmp_path / "checkpoint-7" / "refused.bin").read_bytes()
    s.extract(1, tmp_path / "one.safetensors")
    assert dc.load_checkpoint(tmp_path / "one.safetensors").kind == "safetensors"


@pytest.mark.parametrize("rel", ["../evil", "/etc/evil", "a/../../evil", "", ".", "a//b", "a/./b"])
def test_a_directory_checkpoint_naming_a_path_outside_is_refused(tmp_path, rel):
    ckpt = flatten({"files": {rel: {"bytes": b"x"}}})
    ckpt.kind = DIRECTORY_KIND
    with pytest.raises(CheckpointError, match="no relative path"):
        save_checkpoint_directory(ckpt, tmp_path / "out")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("files", [None, {"a": {"bytes": "text"}}, {"a": {"json": 1}}, {"a": b"x"}])
def test_a_directory_checkpoint_of_another_shape_is_refused(tmp_path, files):
    ckpt = flatten({"files": files})
    ckpt.kind = DIRECTORY_KIND
    with pytest.raises(CheckpointError):
        save_checkpoint_directory(ckpt, tmp_path / "out")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_checkpoint_directory(flatten({"files": {}}), tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_a_series_entry_naming_a_path_outside_is_refused_by_the_cli(tmp_path):
    # (a hostile series: its directory entry names ../escaped; extract writes nothing anywhere)
    ckpt = flatten({"files": {"../escaped": {"bytes": b"x"}, "ok.txt": {"bytes": b"y"}}})
    ckpt.kind = DIRECTORY_KIND
    (tmp_path / "work").mkdir()
    dc.CheckpointSeries(tmp_path / "work" / "s.dcs").append(ckpt)
    r = CliRunner().invoke(main, ["series", "extract", str(tmp_path / "work" / "s.dcs"), "0",
                                  "-o", str(tmp_path / "work" / "out")])
    assert r.exit_code == 1 and "no relative path" in r.output and "Traceback" not in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == ["work"] and os.listdir(tmp_path / "work") == ["s.dcs"]


def test_a_file_too_large_to_carry_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(directories, "MAX_CARRIED_BYTES", 10)
    os.makedirs(tmp_path / "d")
    (tmp_path / "d" / "big.txt").write_bytes(b"x" * 11)
    with pytest.raises(CheckpointError, match="at most"):
        load_checkpoint_directory(tmp_path / "d")


def test_extracting_a_directory_entry_to_stdout_or_a_file_is_refused(tmp_path):
    _directory(tmp_path / "d")
    dc.CheckpointSeries(tmp_path / "s.dcs").append(tmp_path / "d")
    for out in ("-", str(tmp_path / "entry.pt")):
        r = CliRunner().invoke(main, ["series", "extract", str(tmp_path / "s.dcs"), "0", "-o", out])
        assert r.exit_code == 1 and "is a directory" in r.output and "Traceback" not in r.output
    with pytest.raises(OutputError, match="is a directory"):
        dc.CheckpointSeries(tmp_path / "s.dcs").extract(0, tmp_path / "entry.safetensors")
    assert not (tmp_path / "entry.pt").exists() and not (tmp_path / "entry.safetensors").exists()
    r = CliRunner().invoke(main, ["series", "add", str(tmp_path / "s.dcs"), str(tmp_path / "d"),
                                  "--input-format", "torch"])
    assert r.exit_code == 2 and "is a directory" in r.output


def test_the_step_comes_from_trainer_state(tmp_path):
    os.makedirs(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 120}))
    torch.save({"w": torch.ones(2)}, tmp_path / "checkpoint-3" / "w.pt")
    assert cs._step_of(load_checkpoint_directory(tmp_path / "checkpoint-3")) == 120
