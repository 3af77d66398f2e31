"""The Lightning CheckpointIO in a real Trainer.fit: checkpoints land in one series, resuming from
one of them works, the optimizer state is Lightning's own."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import coded_steps

pl = pytest.importorskip("lightning.pytorch")

import deepcabac_py as dc  # noqa: E402
from deepcabac_py.errors import CheckpointError  # noqa: E402
from deepcabac_py.integrations.lightning_io import SERIES_NAME, SeriesCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :3]).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def _trainer(tmp_path, epochs: int, io: SeriesCheckpointIO):
    return pl.Trainer(max_epochs=epochs, default_root_dir=tmp_path, plugins=[io], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                      callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1,
                                                              every_n_epochs=1)])


def test_checkpoints_go_into_one_series_and_resume(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    _trainer(tmp_path, 4, SeriesCheckpointIO(key_every=3)).fit(model, _loader())
    pointers = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(pointers) == 4
    series = dc.CheckpointSeries(tmp_path / "ckpt" / SERIES_NAME)
    assert [e.kind for e in series.entries()] == ["key", "residual", "residual", "key"]
    assert [json.loads(p.read_text())["entry"] for p in pointers] == [0, 1, 2, 3]
    # Lightning's own checkpoint: its keys, its optimizer state (steps exact), the weights close
    io = SeriesCheckpointIO()
    last = io.load_checkpoint(pointers[-1])
    assert {"state_dict", "optimizer_states", "epoch", "global_step"} <= set(last)
    assert last["epoch"] == 3 and last["global_step"] == 32
    state = last["optimizer_states"][0]["state"]
    assert all(torch.equal(s["step"], torch.tensor(32.0)) for s in state.values())
    steps = coded_steps(tmp_path / "ckpt" / SERIES_NAME, 3)  # (the steps the last entry's weights took)
    for name, w in model.state_dict().items():
        assert torch.allclose(last["state_dict"][name], w, atol=2 * steps[f"state_dict.{name}"])
    # resume from the second checkpoint and train on: Lightning reads it through the plugin
    resumed = Tiny()
    _trainer(tmp_path / "again", 3, SeriesCheckpointIO()).fit(resumed, _loader(), ckpt_path=pointers[1])
    assert resumed.trainer.global_step == 24
    # a removed checkpoint loses its pointer, not its entry (later entries are coded against it)
    io.remove_checkpoint(pointers[0])
    assert not pointers[0].exists() and len(series) == 4


def test_a_file_that_is_not_a_pointer(tmp_path):
    p = tmp_path / "x.ckpt"
    torch.save({"w": torch.ones(2)}, p)
    with pytest.raises(CheckpointError, match="not a pointer"):
        SeriesCheckpointIO().load_checkpoint(p)
