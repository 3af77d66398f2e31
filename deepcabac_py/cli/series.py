"""``deepcabac series``: the checkpoints of a training run in one file, each coded against the last."""

from __future__ import annotations

import os

import click

from deepcabac_py.io.kinds import KINDS

from .common import check_output, write_output


@click.group("series", context_settings={"help_option_names": ["-h", "--help"]})
def series_group():
    """Add training checkpoints to a series (.dcs), list it, extract any entry."""


@series_group.command("add")
@click.argument("series", metavar="RUN.dcs", type=click.Path(dir_okay=False))
@click.argument("checkpoints", metavar="CKPT...", nargs=-1, required=True, type=click.Path())
@click.option("--key-every", type=click.IntRange(min=1), default=None,
              help="Every K-th entry is coded on its own, the others against the entry before "
                   "[default: 10].")
@click.option("--qp", type=int, default=None,
              help="qp of the weights and of their residuals [default: the size of the optimizer's (Adam's, "
                   "SGD's) last step on each tensor, never finer than -52: about a bfloat16 copy's error].")
@click.option("--input-format", type=click.Choice(KINDS), default=None, help="The checkpoints' kind (default: "
              "from the suffix).")
@click.option("--lossless", is_flag=True, help="Keep every tensor bit for bit (residuals on the float bits).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def add_cmd(series, checkpoints, key_every, qp, input_format, lossless, quiet):
    """Append each CKPT to RUN.dcs (created on first use); a line per entry, with its ratio to the
    checkpoint's file. A CKPT that is a directory (a Trainer's checkpoint-N/) is one entry of all
    its files."""
    from deepcabac_py.io.directories import list_files, load_checkpoint_directory
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.series.checkpoint_series import DEFAULT_KEY_EVERY, CheckpointSeries

    if lossless and qp is not None:
        raise click.UsageError("--qp and --lossless exclude each other: a lossless series has no step")
    settings: dict = {} if qp is None else {"qp": qp}
    if lossless:
        settings["keep_exact"] = True
    s = CheckpointSeries(series, key_every=key_every or DEFAULT_KEY_EVERY, **settings)
    for path in checkpoints:
        if os.path.isdir(path):
            if input_format is not None:
                raise click.UsageError(f"--input-format names a file's kind; {path} is a directory")
            index = s.append(load_checkpoint_directory(path))
            size = sum(os.path.getsize(os.path.join(path, rel)) for rel in list_files(path))
        else:
            index = s.append(load_checkpoint(path, input_format))
            size = os.path.getsize(path)
        if not quiet:
            e = s.entries()[index]
            click.echo(f"{series}: entry {index} ({e.kind}) {e.bytes:,} bytes <- {path} "
                       f"({size:,} bytes, {size / max(e.bytes, 1):.1f}x)")


@series_group.command("list")
@click.argument("series", metavar="RUN.dcs", type=click.Path(dir_okay=False, exists=False))
def list_cmd(series):
    """One line per entry: index, step, bytes, key or residual."""
    entries = _existing(series).entries()
    click.echo(f"{'index':>5} {'step':>8} {'bytes':>12}  kind")
    for e in entries:
        step = "-" if e.step is None else str(e.step)
        kind = e.kind if e.parent is None else f"{e.kind} of {e.parent}"
        click.echo(f"{e.index:>5} {step:>8} {e.bytes:>12,}  {kind}")
    click.echo(f"{len(entries)} entries, {sum(e.bytes for e in entries):,} bytes")


@series_group.command("extract")
@click.argument("series", metavar="RUN.dcs", type=click.Path(dir_okay=False))
@click.argument("index", type=int)
@click.option("-o", "--output", required=True, type=click.Path(allow_dash=True),
              help="The checkpoint to write (.pt, .safetensors, .npz), or the directory of an entry that was one.")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file or directory.")
def extract_cmd(series, index, output, force):
    """Decode entry INDEX (negative: from the end) into a checkpoint file, or a directory where the
    entry was one, the chain verified."""
    from deepcabac_py.errors import InputError, OutputError, OutputExistsError
    from deepcabac_py.io.directories import DIRECTORY_KIND, save_checkpoint_directory
    from deepcabac_py.io.files import checkpoint_writer, kind_from_suffix

    existing = _existing(series)
    if os.path.lexists(output) and not force and output != "-":  # (refused before any decoding)
        raise OutputExistsError(f"output {output} already exists; use --force to replace it")
    try:
        ckpt = existing.checkpoint(index)
    except IndexError as exc:
        raise InputError(str(exc)) from None
    if ckpt.kind == DIRECTORY_KIND:
        if output == "-" or kind_from_suffix(output) is not None:
            raise OutputError(f"entry {index} is a directory: give one with -o DIR")
        save_checkpoint_directory(ckpt, output, force=force)
        return
    check_output(output, force)
    kind = kind_from_suffix(output) or "torch"
    write_output(output, checkpoint_writer(ckpt, kind), force)


def _existing(series: str):
    """The series at ``series``, refused when there is no file (a series to read is not created)."""
    from deepcabac_py.errors import InputError
    from deepcabac_py.series.checkpoint_series import CheckpointSeries

    if not os.path.exists(series):
        raise InputError(f"{series}: no such file")
    return CheckpointSeries(series)


__all__ = ["series_group"]
