"""Checkpoints as people have them: Hugging Face directories of bf16 shards, streamed tensor by
tensor, one tensor without the rest, and the bad directories."""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from deepcabac_py.cli.main import main
from deepcabac_py.errors import CheckpointError, DeepCabacError, OutputExistsError
from deepcabac_py.io.files import load_checkpoint, save_checkpoint
from deepcabac_py.io.tensor_source import SafetensorsSource, open_source
from deepcabac_py.model.decoder import StreamFile, decode_checkpoint, decode_model, iter_decoded
from deepcabac_py.model.encoder import encode_model, write_stream
from deepcabac_py.model.files import decode_directory, decode_file, encode_directory, encode_file
from deepcabac_py.model.settings import EncodeSettings

CARRIED = {"config.json": b'{"model_type": "llama"}\n', "tokenizer.json": b'{"version": "1.0"}\n',
           "sub/notes.txt": b"not a checkpoint\x00\xff"}


def _tensors(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        rows = 48 + 8 * i
        out[f"layers.{i}.proj.weight"] = (torch.randn(rows, 64, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layers.{i}.norm.weight"] = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    return out


def make_hf_directory(path, shards: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sharded bf16 directory as ``save_pretrained`` writes it; returns every tensor."""
    path.mkdir(parents=True)
    tensors = _tensors(seed, 2 * shards)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
        save_checkpoint(load_from(part), path / shard)
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for rel, data in CARRIED.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return tensors


def load_from(tensors):
    from deepcabac_py.io.checkpoint import flatten

    ckpt = flatten(tensors)
    ckpt.kind = "safetensors"
    return ckpt


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- streaming: the same bytes as in memory ----------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_streamed_tensor_by_tensor_gives_the_bytes_of_the_in_memory_encoder(tmp_path, threads):
    path = tmp_path / "m.safetensors"
    save_checkpoint(load_from(_tensors(1)), path)
    expected = encode_model(load_checkpoint(path), threads=1)
    with SafetensorsSource(path) as source, open(tmp_path / "s.dcb", "wb") as f:
        # one tensor at a time: the smallest window there is
        write_stream(f, source, EncodeSettings(), threads=threads, max_elements_in_flight=1)
    assert (tmp_path / "s.dcb").read_bytes() == expected
    encode_file(path, tmp_path / "e.dcb", threads=threads)
    assert (tmp_path / "e.dcb").read_bytes() == expected


def test_a_model_with_batchnorm_shifts_streams_to_the_same_bytes(tmp_path):
    # BatchNorm statistics, compensation and the bias correction look across tensors
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 4, 1))
    with torch.no_grad():
        for m in net:
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    sd = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "bn.safetensors"
    save_checkpoint(load_from(sd), path)
    for settings in ({}, {"batchnorm_eps": 1e-5}, {"quantizer": "rdoq"}):
        expected = encode_model(load_checkpoint(path), **settings)
        with SafetensorsSource(path) as source, open(tmp_path / "s.dcb", "wb") as f:
            write_stream(f, source, EncodeSettings(**settings), threads=2, max_elements_in_flight=1)
        assert (tmp_path / "s.dcb").read_bytes() == expected, settings


def test_a_streamed_decode_writes_the_file_the_in_memory_decoder_writes(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(load_from(_tensors(2)), path)
    encode_file(path, tmp_path / "m.dcb")
    decode_file(tmp_path / "m.dcb", tmp_path / "a.safetensors", threads=2)
    save_checkpoint(decode_checkpoint((tmp_path / "m.dcb").read_bytes()), tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    decode_file(tmp_path / "m.dcb", tmp_path / "a.pt")
    restored = torch.load(tmp_path / "a.pt", weights_only=True)
    original = load_checkpoint(tmp_path / "b.safetensors").tensors
    assert list(restored) == list(original)
    assert all(torch.equal(restored[n], original[n]) for n in original)


def _traced_peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_flat_in_the_model_size(tmp_path):
    # models of 8 and 24 tensors of 4 MB, a window of one tensor: the traced peaks of encoding and
    # decoding are those of a few tensors, the same for both models
    peaks = {}
    encode_model({"w": np.ones((64, 64), np.float32)}, quantizer="nearest")  # (compiled before tracing)
    for count in (8, 24):
        path = tmp_path / f"m{count}.safetensors"
        save_checkpoint(load_from({f"w{i}": torch.randn(1024, 1024) for i in range(count)}), path)
        stream = tmp_path / f"m{count}.dcb"

        def encode():
            with SafetensorsSource(path) as source, open(stream, "wb") as f:
                write_stream(f, source, EncodeSettings(quantizer="nearest"), threads=2,
                             max_elements_in_flight=1 << 20)

        def decode():
            assert sum(t.numel() for _, t in iter_decoded(stream, threads=2, max_elements_in_flight=1 << 20)) \
                == count << 20

        peaks[count] = (_traced_peak(encode), _traced_peak(decode))
    size = (tmp_path / "m24.safetensors").stat().st_size
    for small, large, what in zip(peaks[8], peaks[24], ("encode", "decode")):
        assert large < size / 3, f"{what}: traced peak {large:,} bytes for a {size:,}-byte model"
        assert large < 1.25 * small, f"{what}: traced peak {small:,} bytes at 8 tensors, {large:,} at 24"


# --- one tensor without the rest ---------------------------------------------------------------------


class _CountingStream(StreamFile):
    def __init__(self, path):
        super().__init__(path)
        self.read_bytes = 0

    def read(self, start, size):
        self.read_bytes += size
        return super().read(start, size)


def test_one_tensor_reads_only_its_own_payload(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(load_from(_tensors(4)), path)
    encode_file(path, tmp_path / "m.dcb")
    everything = decode_model((tmp_path / "m.dcb").read_bytes())
    with _CountingStream(tmp_path / "m.dcb") as stream:
        got = decode_model(stream, names=["layers.3.proj.weight", "*.5.norm.*"])
        entry = {e.name: e for e in stream.header.tensors}
        assert stream.read_bytes == entry["layers.3.proj.weight"].size + entry["layers.5.norm.weight"].size
    assert list(got) == ["layers.3.proj.weight", "layers.5.norm.weight"]
    assert all(torch.equal(got[n], everything[n]) for n in got)
    with pytest.raises(ValueError, match="nosuch"):
        decode_model(tmp_path / "m.dcb", names="nosuch*")


def test_cli_decode_tensor_writes_only_those(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(load_from(_tensors(5)), path)
    runner = CliRunner()
    assert runner.invoke(main, ["encode", str(path), "-q"]).exit_code == 0
    out = tmp_path / "one.safetensors"
    result = runner.invoke(main, ["decode", str(tmp_path / "m.safetensors.dcb"), "-o", str(out),
                                  "--tensor", "layers.2.*", "-q"])
    assert result.exit_code == 0, result.output
    assert list(load_checkpoint(out).tensors) == ["layers.2.proj.weight", "layers.2.norm.weight"]
    bad = runner.invoke(main, ["decode", str(tmp_path / "m.safetensors.dcb"), "-o", str(tmp_path / "x.pt"),
                               "--tensor", "nosuch"])
    assert bad.exit_code == 2 and "nosuch" in bad.output
    assert not (tmp_path / "x.pt").exists()


# --- directories -------------------------------------------------------------------------------------


def test_a_directory_round_trip_keeps_names_index_and_carried_files(tmp_path):
    src = tmp_path / "model"
    original = make_hf_directory(src)
    encode_directory(src, tmp_path / "enc", threads=2)
    enc_files = _files(tmp_path / "enc")
    shards = sorted(n for n in _files(src) if n.endswith(".safetensors"))
    assert sorted(n for n in enc_files if n.endswith(".dcb")) == [s + ".dcb" for s in shards]
    decode_directory(tmp_path / "enc", tmp_path / "dec", threads=2)
    before, after = _files(src), _files(tmp_path / "dec")
    assert sorted(before) == sorted(after)
    for rel in [*CARRIED, "model.safetensors.index.json"]:
        assert after[rel] == before[rel], rel
    restored = {}
    for shard in shards:
        part = load_checkpoint(tmp_path / "dec" / shard).tensors
        # exactly what the in-memory codec makes of the shard
        expected = decode_model(encode_model(load_checkpoint(src / shard)))
        assert list(part) == list(expected)
        assert all(torch.equal(part[n], expected[n]) for n in part)
        restored.update(part)
    assert sorted(restored) == sorted(original)
    assert all(restored[n].dtype == torch.bfloat16 and restored[n].shape == t.shape for n, t in original.items())


def test_the_cli_does_directories_and_reports_them(tmp_path):
    src = tmp_path / "model"
    make_hf_directory(src, shards=2)
    runner = CliRunner()
    r = runner.invoke(main, ["encode", str(src), "-o", str(tmp_path / "enc")])
    assert r.exit_code == 0, r.output
    assert "2 shards" in r.output
    info = runner.invoke(main, ["info", str(tmp_path / "enc"), "--json"])
    assert info.exit_code == 0, info.output
    doc = json.loads(info.stdout)
    assert len(doc["shards"]) == 2 and doc["params"] == sum(s["params"] for s in doc["shards"])
    assert runner.invoke(main, ["report", str(tmp_path / "enc")]).exit_code == 0
    t = runner.invoke(main, ["test", str(tmp_path / "enc")])
    assert t.exit_code == 0 and "2 streams" in t.output
    r = runner.invoke(main, ["decode", str(tmp_path / "enc"), "-o", str(tmp_path / "dec"), "-q"])
    assert r.exit_code == 0, r.output
    assert sorted(_files(tmp_path / "dec")) == sorted(_files(src))
    again = runner.invoke(main, ["decode", str(tmp_path / "enc"), "-o", str(tmp_path / "dec")])
    assert again.exit_code == 1 and "already exists" in again.output
    forced = runner.invoke(main, ["decode", str(tmp_path / "enc"), "-o", str(tmp_path / "dec"), "-f", "-q"])
    assert forced.exit_code == 0


def test_transformers_loads_the_restored_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "orig", max_shard_size="40KB")
    assert len(list((tmp_path / "orig").glob("model-*.safetensors"))) > 1
    encode_directory(tmp_path / "orig", tmp_path / "enc", qp=-48)
    decode_directory(tmp_path / "enc", tmp_path / "dec")
    restored = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dec", dtype=torch.bfloat16).eval()
    ids = torch.arange(24).reshape(2, 12) % 96
    with torch.no_grad():
        a, b = model(ids).logits.float(), restored(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.99, float(cos)


# --- bad directories ---------------------------------------------------------------------------------


def _damage(src, how):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    if how == "no index":
        index_path.unlink()
    elif how == "missing shard":
        (src / shards[1]).unlink()
    elif how == "index disagrees":
        name = next(n for n, s in index["weight_map"].items() if s == shards[0])
        index["weight_map"][name] = shards[1]
        index_path.write_text(json.dumps(index))
    elif how == "tensor in two shards":
        a = load_checkpoint(src / shards[0])
        b = load_checkpoint(src / shards[1])
        b.tensors.update({n: t for n, t in list(a.tensors.items())[:1]})
        b.skeleton = load_from(b.tensors).skeleton
        save_checkpoint(b, src / shards[1], force=True)
    elif how == "not in the index":
        del index["weight_map"][next(iter(index["weight_map"]))]
        index_path.write_text(json.dumps(index))
    elif how == "index not json":
        index_path.write_text("{")


@pytest.mark.parametrize("how", ["no index", "missing shard", "index disagrees", "tensor in two shards",
                                 "not in the index", "index not json"])
def test_a_bad_directory_is_refused_and_nothing_is_written(tmp_path, how):
    src = tmp_path / "model"
    make_hf_directory(src)
    _damage(src, how)
    with pytest.raises(CheckpointError):
        encode_directory(src, tmp_path / "enc")
    assert sorted(os.listdir(tmp_path)) == ["model"]
    r = CliRunner().invoke(main, ["encode", str(src), "-o", str(tmp_path / "enc")])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_outputs_that_exist_or_lie_inside_the_input_are_refused(tmp_path):
    src = tmp_path / "model"
    make_hf_directory(src, shards=2)
    (tmp_path / "enc").mkdir()
    with pytest.raises(OutputExistsError):
        encode_directory(src, tmp_path / "enc")
    with pytest.raises(DeepCabacError, match="inside the input"):
        encode_directory(src, src / "out")
    with pytest.raises(DeepCabacError, match="inside the input"):
        encode_directory(src, src, force=True)
    encode_directory(src, tmp_path / "enc", force=True)
    assert len(list((tmp_path / "enc").glob("*.dcb"))) == 2


def test_a_decode_that_fails_half_way_leaves_nothing(tmp_path):
    src = tmp_path / "model"
    make_hf_directory(src, shards=3)
    encode_directory(src, tmp_path / "enc")
    last = sorted((tmp_path / "enc").glob("*.dcb"))[-1]
    data = bytearray(last.read_bytes())
    data[-3] ^= 0x40  # the last shard's payload is damaged: found after the first two are written
    last.write_bytes(bytes(data))
    (tmp_path / "dec").mkdir()
    (tmp_path / "dec" / "keep.txt").write_text("the old output")
    with pytest.raises(DeepCabacError, match="checksum"):
        decode_directory(tmp_path / "enc", tmp_path / "dec", force=True)
    assert sorted(os.listdir(tmp_path)) == ["dec", "enc", "model"]
    assert os.listdir(tmp_path / "dec") == ["keep.txt"]


def test_open_source_reads_other_kinds_whole(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "m.pt")
    with open_source(tmp_path / "m.pt") as source:
        assert source.names == ["a"] and source.spec("a").shape == (3,)
    assert np.array_equal(decode_model(encode_model({"a": np.arange(4, dtype=np.int64)}))["a"], np.arange(4))


@pytest.mark.parametrize("link", ["nowhere", "directory", "device"])
def test_links_to_anything_but_a_regular_file_are_refused(tmp_path, link):
    src = tmp_path / "model"
    make_hf_directory(src, shards=2)
    target = {"nowhere": tmp_path / "elsewhere.txt", "directory": tmp_path, "device": "/dev/null"}[link]
    (src / "link").symlink_to(target)
    with pytest.raises(DeepCabacError, match="link"):
        encode_directory(src, tmp_path / "enc")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_a_hub_snapshot_of_links_into_blobs_is_read_through_them(tmp_path):
    # (the Hugging Face hub cache: snapshots/<commit>/ holds relative links to ../../blobs/<hash>)
    plain = tmp_path / "plain"
    make_hf_directory(plain, shards=2)
    snapshot = tmp_path / "hub" / "snapshots" / "abc123"
    (tmp_path / "hub" / "blobs").mkdir(parents=True)
    for k, rel in enumerate(sorted(str(p.relative_to(plain)) for p in plain.rglob("*") if p.is_file())):
        blob = tmp_path / "hub" / "blobs" / f"blob{k}"
        blob.write_bytes((plain / rel).read_bytes())
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(os.path.relpath(blob, (snapshot / rel).parent))
    encode_directory(snapshot, tmp_path / "enc", keep_exact=True)
    decode_directory(tmp_path / "enc", tmp_path / "dec")
    for p in plain.rglob("*"):
        if p.is_file():
            out = tmp_path / "dec" / p.relative_to(plain)
            assert not out.is_symlink() and out.read_bytes() == p.read_bytes(), p
