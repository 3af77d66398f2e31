"""A directory entry's carried files coded against its parent's (series format version 6)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deepcabac_py as dc
from deepcabac_py.errors import CorruptStreamError
from deepcabac_py.io.checkpoint import flatten
from deepcabac_py.io.directories import DIRECTORY_KIND
from deepcabac_py.io.files import save_checkpoint
from deepcabac_py.series import carried_files
from deepcabac_py.series.records import SeriesFile


def _skeleton(files: dict[str, bytes], extra: dict | None = None) -> dict:
    content = {path: {"bytes": data} for path, data in files.items()}
    content.update(extra or {})
    ckpt = flatten({"files": content, "step": 1})
    ckpt.kind = DIRECTORY_KIND
    return ckpt.skeleton


def _files(skeleton: dict) -> dict[str, bytes]:
    from deepcabac_py.io.checkpoint import Checkpoint
    from deepcabac_py.io.directories import directory_files

    return {path: c["bytes"] for path, c in directory_files(Checkpoint({}, skeleton, DIRECTORY_KIND)).items()
            if "bytes" in c}


_chunks = st.binary(max_size=300)


@settings(max_examples=200, deadline=None)
@given(head=_chunks, tail=_chunks, old=_chunks, new=_chunks, other=_chunks)
def test_a_carried_file_comes_back_from_its_parent_byte_for_byte(head, tail, old, new, other):
    parent = _skeleton({"tok.json": head + old + tail, "gone.txt": other})
    mine = _skeleton({"tok.json": head + new + tail, "new.txt": other})
    before = copy.deepcopy(mine)
    cut, refs = carried_files.referenced(mine, parent)
    assert mine == before  # (the entry's own skeleton is not changed)
    assert set(refs) <= {"tok.json"}  # (a file only the entry has goes whole)
    if refs:
        shared = refs["tok.json"][0] + refs["tok.json"][1]
        assert shared >= carried_files.MIN_SHARED and shared >= len(head) + len(tail)
        assert len(_files(cut)["tok.json"]) == len(head + new + tail) - shared
    assert _files(carried_files.restored("x", cut, refs, parent)) == _files(mine)


def _refs_case():
    parent = _skeleton({"tok.json": b"a" * 100 + b"old" + b"z" * 100})
    mine = _skeleton({"tok.json": b"a" * 100 + b"new!" + b"z" * 100})
    cut, refs = carried_files.referenced(mine, parent)
    assert refs["tok.json"][:2] == [100, 100] and _files(cut)["tok.json"] == b"new!"
    return parent, cut, refs


@pytest.mark.parametrize("bad, message", [
    ({"tok.json": [100, 100, 0]}, "does not match its checksum"),
    ({"tok.json": [150, 100, 0]}, "takes 250 bytes of its parent's 203"),
    ({"tok.json": [100, -1, 0]}, "malformed carried file"),
    ({"tok.json": [100, 100]}, "malformed carried file"),
    ({"tok.json": [True, 100, 0]}, "malformed carried file"),
    ({"other.json": [1, 1, 0]}, "missing from the entry or its parent"),
    ([["tok.json", 1, 1, 0]], "malformed carried files"),
])
def test_carried_files_that_do_not_match_their_parent_are_refused(bad, message):
    parent, cut, refs = _refs_case()
    if isinstance(bad, dict) and bad.get("tok.json") == [100, 100, 0]:
        bad = {"tok.json": [100, 100, refs["tok.json"][2] ^ 1]}
    with pytest.raises(CorruptStreamError, match=message):
        carried_files.restored("entry 1", cut, bad, parent)


def _directories(root, lossless_weights: bool = False):
    vocab = json.dumps({f"w{i}": i for i in range(2000)}).encode()
    out = []
    for i in range(3):
        d = root / f"checkpoint-{i + 1}"
        d.mkdir(parents=True)
        torch.manual_seed(i)
        save_checkpoint(flatten({"w": torch.randn(8, 8)}), d / "model.safetensors", kind="safetensors")
        (d / "tokenizer.json").write_bytes(vocab)
        (d / "notes.txt").write_bytes(bytes(range(256)) * (i + 1))  # (changed at its end: shares a prefix)
        (d / "rng.dat").write_bytes(torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(i),
                                                  dtype=torch.uint8).numpy().tobytes())  # (shares nothing)
        out.append(d)
    return out


@pytest.mark.parametrize("keep_exact", [False, True])
def test_a_series_of_directories_takes_what_did_not_change_from_the_parent(tmp_path, keep_exact):
    dirs = _directories(tmp_path / "in")
    series = dc.CheckpointSeries(tmp_path / "run.dcs", keep_exact=keep_exact)
    for d in dirs:
        series.append(d)
    with SeriesFile(tmp_path / "run.dcs") as f:
        assert f.version == 6
        metas = [r.meta for r in f.records]
    assert [sorted(m.get("carried", {})) for m in metas] == [[]] + [["notes.txt", "tokenizer.json"]] * 2
    assert metas[1]["carried"]["notes.txt"][:2] == [256, 0]
    # a new object (the parents decoded from the file) restores every file byte for byte
    again = dc.CheckpointSeries(tmp_path / "run.dcs")
    for i, d in enumerate(dirs):
        again.extract(i, tmp_path / f"out{i}")
        for name in ("tokenizer.json", "notes.txt", "rng.dat"):
            assert (tmp_path / f"out{i}" / name).read_bytes() == (d / name).read_bytes(), (i, name)
    # the residuals hold no tokenizer: a series without references is larger by about its size twice
    plain = tmp_path / "plain.dcs"
    for d in dirs:
        dc.CheckpointSeries(plain, keep_exact=keep_exact, key_every=1).append(d)
    sizes = [e.bytes for e in dc.CheckpointSeries(tmp_path / "run.dcs").entries()]
    keys = [e.bytes for e in dc.CheckpointSeries(plain).entries()]
    assert all(s < k - 4000 for s, k in zip(sizes[1:], keys[1:]))
