"""Hugging Face Trainer: a callback that adds every ``checkpoint-N/`` the Trainer saves to one
checkpoint series.

    args = TrainingArguments(..., save_steps=500, save_total_limit=1)
    trainer = Trainer(..., args=args, callbacks=[SeriesCallback()])

The Trainer writes its directories as always (and, with ``save_total_limit``, removes the old
ones); each, once saved, becomes an entry of ``checkpoints.dcs`` in the output directory (or the
series given), coded against the entry before
(:class:`~deepcabac_py.series.checkpoint_series.CheckpointSeries`): the run's history in a
fraction of its bytes, every entry a directory the Trainer resumes from once extracted
(``CheckpointSeries(path).extract(i, "checkpoint-N")``, ``deepcabac series extract``). Only the
main process appends.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import DeepCabacWarning
from ..series.checkpoint_series import DEFAULT_KEY_EVERY, CheckpointSeries

__all__ = ["SeriesCallback", "SERIES_NAME"]

SERIES_NAME = "checkpoints.dcs"


class SeriesCallback(TrainerCallback):
    """Every checkpoint the Trainer saves, appended to a checkpoint series.

    Parameters
    ----------
    series : str, PathLike or None
        The series file; None: ``checkpoints.dcs`` in the Trainer's ``output_dir``.
    key_every : int
        As for :class:`~deepcabac_py.series.checkpoint_series.CheckpointSeries`.
    **settings
        Settings of :func:`~deepcabac_py.model.encoder.encode_model` (``qp``, ``keep_exact``...).
    """

    def __init__(self, series: str | os.PathLike | None = None, *, key_every: int = DEFAULT_KEY_EVERY,
                 **settings: Any):
        self.series = None if series is None else os.fspath(series)
        self.key_every = key_every
        self.settings = settings
        self._open: CheckpointSeries | None = None  # (one object: it keeps the newest entry decoded)

    def path(self, args) -> str:
        """The series file of a run with these ``TrainingArguments``."""
        return self.series or os.path.join(args.output_dir, SERIES_NAME)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        saved = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(saved):
            # (a hyperparameter search saves into a directory per trial: not this run's; training goes on)
            warnings.warn(f"{saved}: no such checkpoint directory; not added to the series", DeepCabacWarning,
                          stacklevel=2)
            return
        path = self.path(args)
        if self._open is None or self._open.path != path:
            self._open = CheckpointSeries(path, key_every=self.key_every, **self.settings)
        self._open.append(saved)
