"""``deepcabac sweep``: the model coded at a range of qps, for picking one by looking: size, bits
per parameter, weight SNR and largest error per qp, and the user's own fidelity function on each
decoded model."""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os

import click

from deepcabac_py.errors import InputError
from deepcabac_py.io.kinds import KINDS
from deepcabac_py.model.settings import DEFAULT_QP_DENSITY, DEFAULT_QUANTIZER
from deepcabac_py.quant.quantizers import QUANTIZERS
from deepcabac_py.quant.steps import qp_range

from .common import Input, about, progress_bar

# the most qps one sweep runs (each is a full encode and decode)
MAX_POINTS = 64


def parse_qps(text: str, qp_density: int) -> list[int]:
    """``A:B:S`` (A to B inclusive, in steps of S) or ``q1,q2,...``; every qp must have a step."""
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) == 2:
                parts.append(1 if parts[1] >= parts[0] else -1)
            start, stop, step = parts
            if step == 0 or (stop - start) * step < 0:
                raise ValueError
            qps = list(range(start, stop + (1 if step > 0 else -1), step))
        else:
            qps = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither A:B:S nor a list of qps", param_hint="--qp") from None
    if not qps or len(qps) > MAX_POINTS:
        raise click.BadParameter(f"between 1 and {MAX_POINTS} qps, not {len(qps)}", param_hint="--qp")
    lo, hi = qp_range(qp_density)
    bad = [q for q in qps if not lo <= q <= hi]
    if bad:
        raise click.BadParameter(f"qp {bad[0]} has no step at density {qp_density} ({lo}..{hi})", param_hint="--qp")
    return qps


def load_function(spec: str):
    """The function ``FILE.py:NAME`` names (the file is run as a module of its own)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise click.BadParameter(f"{spec!r} is not FILE.py:FUNCTION", param_hint="--eval")
    if not os.path.isfile(path):
        raise click.BadParameter(f"no file {path}", param_hint="--eval")
    module_spec = importlib.util.spec_from_file_location("deepcabac_user_eval", path)
    if module_spec is None or module_spec.loader is None:
        raise click.BadParameter(f"cannot load {path}", param_hint="--eval")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise click.BadParameter(f"{path} has no function {name}", param_hint="--eval")
    return fn


def _figures(value) -> dict[str, float]:
    """The user's function's result as ``{name: number}`` (a bare number is ``{"eval": x}``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return {"eval": float(value)}
    if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, numbers.Real)
                                                 and not isinstance(v, bool) for k, v in value.items()):
        return {k: float(v) for k, v in value.items()}
    raise InputError(f"the --eval function must return a number or a dict of names to numbers, not {value!r:.80}")


@click.command()
@click.argument("input", metavar="MODEL", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("--qp", "qp_text", default="-40:-20:4", show_default=True, metavar="A:B:S|Q,Q,...",
              help="The qps to try: A to B in steps of S, or a list. Lower is finer: more bytes, less error.")
@click.option("--quantizer", type=click.Choice(QUANTIZERS), default=DEFAULT_QUANTIZER, show_default=True)
@click.option("--eval", "evaluate", metavar="FILE.py:FUNCTION", default=None,
              help="Call FUNCTION(model) on each decoded model (the checkpoint's own structure, e.g. a state "
                   "dict); it returns a number or a dict of names to numbers (accuracy, loss...).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Draw weight SNR (and the first --eval figure) against bits per parameter.")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing picture.")
@click.option("--qp-density", type=click.IntRange(0, 6), default=DEFAULT_QP_DENSITY, show_default=True)
@click.option("--importance", type=click.Choice(("structural", "none")), default="structural", show_default=True)
@click.option("--input-format", type=click.Choice(KINDS), default=None)
@click.option("-T", "--threads", type=click.IntRange(min=0), default=0,
              callback=lambda ctx, param, value: value or None, help="Worker threads (default 0: all cores).")
@click.option("--no-progress", is_flag=True, help="Do not show progress bars.")
def sweep(input, qp_text, quantizer, evaluate, as_json, plot, force, qp_density, importance, input_format, threads,
          no_progress):
    """Code MODEL at each qp and show what each costs and keeps: stream bytes, bits per parameter,
    weight SNR, largest error, and your own fidelity figure with --eval."""
    from deepcabac_py.io.checkpoint import unflatten
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.model.decoder import decode_checkpoint, read_stream_header
    from deepcabac_py.model.encoder import encode_model
    from deepcabac_py.model.report import build_report

    qps = parse_qps(qp_text, qp_density)
    fn = load_function(evaluate) if evaluate else None
    if plot is not None and os.path.lexists(plot) and not force:
        raise click.UsageError(f"{plot} already exists; use --force to overwrite it")
    rows = []
    with about(input):
        with Input(input) as inp, inp.checkpoint_path(input_format) as path:
            original = load_checkpoint(path, input_format)
        with progress_bar(2 * original.numel * len(qps), "sweep", not no_progress) as update:
            for qp in qps:
                try:
                    data = encode_model(original, qp=qp, qp_density=qp_density, quantizer=quantizer,
                                        importance=None if importance == "none" else importance, threads=threads,
                                        progress=update)
                except TypeError as exc:
                    raise InputError(str(exc)) from None
                decoded = decode_checkpoint(data, threads=threads, progress=update)
                rep = build_report(read_stream_header(data), original, decoded)
                row = {"qp": qp, "bytes": len(data), "bits_per_param": rep.bits_per_param,
                       "ratio": rep.ratio_vs_original, "snr_db": rep.snr_db, "max_abs_error": rep.max_abs_error}
                if fn is not None:
                    row["eval"] = _figures(fn(unflatten(decoded)))
                rows.append(row)
    metric = next(iter(rows[0]["eval"])) if fn is not None else None
    if plot is not None:
        from .plots import plot_sweep

        plot_sweep(rows, plot, metric=metric, force=True)
    if as_json:
        click.echo(json.dumps([{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in r.items()} for r in rows], indent=1))
        return
    names = list(rows[0]["eval"]) if fn is not None else []
    click.echo(f"{'qp':>5} {'bytes':>12} {'bits/param':>10} {'ratio':>8} {'SNR dB':>7} {'max err':>9}"
               + "".join(f" {n[:12]:>12}" for n in names))
    for r in rows:
        snr = "exact" if r["snr_db"] == math.inf else _num(r["snr_db"], ".2f")
        click.echo(f"{r['qp']:>5} {r['bytes']:>12,} {_num(r['bits_per_param'], '.3f'):>10} "
                   f"{_num(r['ratio'], '.2f'):>7}x {snr:>7} {_num(r['max_abs_error'], '.2e'):>9}"
                   + "".join(f" {r['eval'][n]:>12.4g}" for n in names))


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)
