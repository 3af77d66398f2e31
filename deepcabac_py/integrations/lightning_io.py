"""PyTorch Lightning: a ``CheckpointIO`` that writes a run's checkpoints into one checkpoint series.

    trainer = Trainer(plugins=[SeriesCheckpointIO()], callbacks=[ModelCheckpoint(save_top_k=-1)])

Every checkpoint Lightning saves becomes an entry of ``checkpoints.dcs`` beside it (or the series
given), coded against the entry before (:class:`~deepcabac_py.series.checkpoint_series.CheckpointSeries`);
the file at the path Lightning asked for is a small pointer to its entry, so that Lightning's own
bookkeeping (the best and last checkpoints, ``ckpt_path=`` to resume) works unchanged. Removing a
checkpoint removes its pointer; the entry stays in the series (the entries after it are coded
against it).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins.io import CheckpointIO

from ..errors import CheckpointError, InputError
from ..io.atomic import write_atomic
from ..series.checkpoint_series import DEFAULT_KEY_EVERY, CheckpointSeries

__all__ = ["SeriesCheckpointIO", "SERIES_NAME"]

SERIES_NAME = "checkpoints.dcs"
_POINTER_KEY = "deepcabac.series"


class SeriesCheckpointIO(CheckpointIO):
    """Lightning checkpoints as entries of a checkpoint series.

    Parameters
    ----------
    series : str, PathLike or None
        The series file; None: ``checkpoints.dcs`` in the directory of each checkpoint.
    key_every : int
        As for :class:`~deepcabac_py.series.checkpoint_series.CheckpointSeries`.
    **settings
        Settings of :func:`~deepcabac_py.model.encoder.encode_model` (``qp``, ``moments_qp``...).
    """

    def __init__(self, series: str | os.PathLike | None = None, *, key_every: int = DEFAULT_KEY_EVERY,
                 **settings: Any):
        self.series = None if series is None else os.fspath(series)
        self.key_every = key_every
        self.settings = settings
        self._open: dict[str, CheckpointSeries] = {}

    def _series_for(self, path: str) -> str:
        return self.series or os.path.join(os.path.dirname(os.path.abspath(path)), SERIES_NAME)

    def _handle(self, series_path: str) -> CheckpointSeries:
        if series_path not in self._open:  # (one object per file: it keeps the newest entry decoded)
            self._open[series_path] = CheckpointSeries(series_path, key_every=self.key_every, **self.settings)
        return self._open[series_path]

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        series_path = self._series_for(path)
        index = self._handle(series_path).append(checkpoint)
        pointer = {_POINTER_KEY: os.path.relpath(series_path, os.path.dirname(os.path.abspath(path))),
                   "entry": index}
        write_atomic(path, json.dumps(pointer).encode("utf-8") + b"\n", force=True)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                pointer = json.loads(f.read(4096).decode("utf-8"))
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except (UnicodeDecodeError, ValueError):
            raise CheckpointError(f"{path} is not a pointer into a checkpoint series") from None
        if not isinstance(pointer, dict) or not isinstance(pointer.get(_POINTER_KEY), str) \
                or type(pointer.get("entry")) is not int:
            raise CheckpointError(f"{path} is not a pointer into a checkpoint series")
        series_path = os.path.join(os.path.dirname(os.path.abspath(path)), pointer[_POINTER_KEY])
        checkpoint = self._handle(series_path)[pointer["entry"]]
        return checkpoint if map_location is None else move_data_to_device(checkpoint, map_location)

    def remove_checkpoint(self, path) -> None:
        path = os.fspath(path)
        if os.path.exists(path):
            os.remove(path)
