"""Pictures for choosing settings: a report's bits and error per tensor, a sweep's rate against
fidelity. matplotlib is an extra (``pip install 'deepcabac-py[plot]'``); without it ``--plot`` says
so in one line."""

from __future__ import annotations

import io
import math

from deepcabac_py.errors import OutputError
from deepcabac_py.io.atomic import write_atomic
from deepcabac_py.model.report import ModelReport, mode_words


def _pyplot(path: str):
    try:
        import matplotlib
    except ImportError:
        raise OutputError(f"cannot write {path}: --plot needs matplotlib "
                          "(pip install 'deepcabac-py[plot]')") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: str, force: bool) -> None:
    buf = io.BytesIO()
    fmt = path.rsplit(".", 1)[-1].lower() if "." in path else "png"
    try:
        fig.savefig(buf, format=fmt, dpi=120, bbox_inches="tight")
    except ValueError as exc:  # an unknown picture format
        raise OutputError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue(), force=force)


def plot_report(rep: ModelReport, path: str, *, force: bool = False) -> None:
    """Bits per parameter and, when known, SNR per tensor, one bar each."""
    plt = _pyplot(path)
    tensors = [t for t in rep.tensors if t.bits_per_param is not None]
    with_errors = any(t.snr_db is not None for t in tensors)
    rows = 2 if with_errors else 1
    fig, axes = plt.subplots(rows, 1, figsize=(max(6.0, 0.25 * len(tensors) + 2), 3.2 * rows), squeeze=False)
    names = [t.name for t in tensors]
    x = range(len(tensors))
    ax = axes[0][0]
    ax.bar(x, [t.bits_per_param for t in tensors], color=["#4472c4" if mode_words(t.mode).startswith(("trellis",
           "uniform")) else "#a5a5a5" for t in tensors])
    ax.set_ylabel("bits per parameter")
    ax.set_title(f"{rep.params:,} params in {rep.stream_bytes:,} bytes ({rep.bits_per_param or 0:.3f} bits/param)")
    if with_errors:
        snr = [t.snr_db if t.snr_db is not None and math.isfinite(t.snr_db) else 0.0 for t in tensors]
        axes[1][0].bar(x, snr, color="#ed7d31")
        axes[1][0].set_ylabel("weight SNR, dB (exact: 0)")
    for row in axes:
        row[0].set_xticks(list(x))
        row[0].set_xticklabels(names, rotation=90, fontsize=6)
    _save(fig, plt, path, force)


def plot_sweep(rows: list[dict], path: str, *, metric: str | None = None, force: bool = False) -> None:
    """Weight SNR (and the user's metric) against bits per parameter, one point per qp."""
    plt = _pyplot(path)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    bits = [r["bits_per_param"] for r in rows]
    ax.plot(bits, [r["snr_db"] for r in rows], "o-", color="#4472c4", label="weight SNR (dB)")
    for r in rows:
        ax.annotate(f"qp {r['qp']}", (r["bits_per_param"], r["snr_db"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("bits per parameter")
    ax.set_ylabel("weight SNR, dB")
    if metric is not None:
        other = ax.twinx()
        other.plot(bits, [r["eval"][metric] for r in rows], "s--", color="#ed7d31", label=metric)
        other.set_ylabel(metric)
        other.legend(loc="lower right")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    _save(fig, plt, path, force)
