"""The ``deepcabac`` command line: encode, decode, info, report and test model streams.

Habits of zstd/xz: ``-o`` names the output, ``-f`` allows overwriting, ``-`` is stdin/stdout (binary
is never written to a terminal), ``-q``/``-v`` set verbosity, progress goes to stderr. Exit status:
0 success, 1 an error about the data or files (one line on stderr, no traceback), 2 a usage error.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import tempfile
from contextlib import contextmanager

import click

from deepcabac_py import __version__
from deepcabac_py.container import read_header_file
from deepcabac_py.errors import DeepCabacError, InputError, OutputError, OutputExistsError
from deepcabac_py.fileio import os_reason, write_atomic
from deepcabac_py.quantize import QP_MAX, QP_MIN, QUANTIZERS
from deepcabac_py.report import build_report, format_report

from ._io import read_input

# The library's codec and checkpoint modules import torch, which takes most of a second: commands
# import them when they need them, so that `info` stays fast. These mirror deepcabac_py.codec.
KINDS = ("torch", "safetensors", "npz")
DEFAULT_QP, DEFAULT_QP_DENSITY = -32, 2
DEFAULT_QUANTIZER = "trellis"
STREAM_SUFFIX = ".dcb"
_DEFAULT_SUFFIX = {"torch": ".pt", "safetensors": ".safetensors", "npz": ".npz"}


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup (temporary output files) runs as for ^C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


@contextmanager
def _sigterm_unwinds():
    """Python's default SIGTERM action kills the process without unwinding, which would leave the
    temporary file of an interrupted atomic write behind."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Group(click.Group):
    """Turns library errors into one line on stderr and exit status 1, ^C into 130, SIGTERM into 143."""

    def invoke(self, ctx):
        try:
            with _sigterm_unwinds():
                return super().invoke(ctx)
        except DeepCabacError as exc:
            click.echo(f"deepcabac: error: {exc}", err=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo("deepcabac: interrupted", err=True)
            ctx.exit(130)
        except _Terminated:
            click.echo("deepcabac: terminated", err=True)
            ctx.exit(128 + signal.SIGTERM)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="deepcabac")
def main():
    """Compress neural-network checkpoints with a quantizer and a context-adaptive arithmetic coder.

    \b
    deepcabac encode model.safetensors -o model.dcb --qp -32
    deepcabac info model.dcb
    deepcabac decode model.dcb -o model.decoded.safetensors
    deepcabac report model.pt
    """


# --- shared options ----------------------------------------------------------------------------

def _verbosity(f):
    f = click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")(f)
    f = click.option("-v", "--verbose", is_flag=True, help="Print more detail.")(f)
    return f


def _threads(f):
    return click.option("-T", "--threads", type=click.IntRange(min=0), default=0,
                        callback=lambda ctx, param, value: value or None,
                        help="Worker threads (default 0: all cores).")(f)


def _progress_option(f):
    return click.option("--no-progress", is_flag=True, help="Do not show progress bars.")(f)


def _quant_options(f):
    f = click.option("--qp", type=click.IntRange(QP_MIN, QP_MAX), default=DEFAULT_QP, show_default=True,
                     help="Quantization parameter: step = (4 + qp mod 4) * 2**(qp // 4 - 2) at density 2.")(f)
    f = click.option("--qp-density", type=click.IntRange(0, 6), default=DEFAULT_QP_DENSITY, show_default=True,
                     help="Steps per octave = 2**qp_density.")(f)
    f = click.option("--qp-1d", type=click.IntRange(QP_MIN, QP_MAX), default=None,
                     help="qp of tensors with at most one dimension (biases, norms) "
                          "[default: qp - 6 octaves, i.e. qp - 6 * 2**qp_density].")(f)
    f = click.option("--qp-tensor", "qp_tensor", multiple=True, metavar="NAME=QP",
                     help="Per-tensor qp; NAME may be a glob pattern. Repeatable.")(f)
    f = click.option("--exact", "exact", multiple=True, metavar="PATTERN",
                     help="Store float tensors matching PATTERN bit-exactly. Repeatable.")(f)
    f = click.option("--exact-all", is_flag=True, help="Store every float tensor bit-exactly (lossless).")(f)
    f = click.option("--quantizer", type=click.Choice(QUANTIZERS), default=DEFAULT_QUANTIZER, show_default=True,
                     help="trellis: dependent quantization (fewest bytes at a given fidelity; its effective "
                          "step is about twice qp's); rdoq: rate-distortion optimised rounding; nearest: "
                          "plain rounding.")(f)
    f = click.option("--lambda-scale", type=click.FloatRange(0.0, 1e6), default=1.0, show_default=True,
                     help="Scale of the rate-distortion trade-off of trellis and rdoq (larger: fewer bytes).")(f)
    f = click.option("--importance", type=click.Choice(("structural", "none")), default="structural",
                     show_default=True,
                     help="structural: steps and error weights from the model's own structure, without "
                          "data (embedding tables coarser, BatchNorm scales); none: every tensor at --qp "
                          "(--qp-1d for biases and norms), every weight alike.")(f)
    f = click.option("--bn-eps", type=click.FloatRange(0.0, 1.0, min_open=True), default=None, metavar="EPS",
                     help="The eps of the model's BatchNorm layers (e.g. 1e-5, PyTorch's default; 1e-3 for "
                          "TF-trained nets). Given, their running statistics are coded to about 1% of each "
                          "layer's typical channel (never finer than --qp) and weight/bias compensate "
                          "exactly (same eval-mode output, fewer bytes).")(f)
    f = click.option("--bias-correction/--no-bias-correction", default=True, show_default=True,
                     help="Take the mean output shift of each layer's quantization error out of the "
                          "BatchNorm after it (or its bias), estimated without data from the BatchNorm "
                          "before it.")(f)
    return f


def _parse_overrides(items) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        try:
            qp = int(value)
        except ValueError:
            qp = None
        if not sep or not name or qp is None or not QP_MIN <= qp <= QP_MAX:
            raise click.BadParameter(f"expected NAME=QP with QP in [{QP_MIN}, {QP_MAX}], got {item!r}",
                                     param_hint="--qp-tensor")
        out[name] = qp
    return out


def _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer, lambda_scale,
                     importance, bn_eps, bias_correction) -> dict:
    return dict(qp=qp, qp_density=qp_density, qp_1d=qp_1d, qp_overrides=_parse_overrides(qp_tensor),
                keep_exact=True if exact_all else list(exact), quantizer=quantizer, lambda_scale=lambda_scale,
                importance=None if importance == "none" else importance, batchnorm_eps=bn_eps,
                bias_correction=bias_correction)


@contextmanager
def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    # disable=None: shown only when stderr is a terminal.
    with tqdm(total=total, desc=desc, unit="w", unit_scale=True, file=sys.stderr, disable=None,
              leave=False, dynamic_ncols=True) as bar:
        yield bar.update


def _info(quiet: bool, message: str) -> None:
    if not quiet:
        click.echo(message, err=True)


# --- input and output --------------------------------------------------------------------------



@contextmanager
def _checkpoint_path(path: str, kind: str | None):
    """A file path for a checkpoint given as a path or as stdin (spooled to a temporary file)."""
    if path != "-":
        yield path
        return
    data = sys.stdin.buffer.read()
    suffix = _DEFAULT_SUFFIX.get(kind or "", "")
    with tempfile.TemporaryDirectory(prefix="deepcabac-") as tmp:
        spooled = os.path.join(tmp, "stdin" + suffix)
        with open(spooled, "wb") as f:
            f.write(data)
        yield spooled


def _abandon_stdout() -> None:
    """After a failed write, point stdout at /dev/null: the interpreter's final flush would otherwise
    fail again and print a traceback of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _write_output(path: str, data_or_writer, force: bool, mode: int | None = None) -> None:
    if path == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE or redirect stdout")
        if callable(data_or_writer):
            buf = io.BytesIO()
            data_or_writer(buf)
            data_or_writer = buf.getvalue()
        try:
            sys.stdout.buffer.write(data_or_writer)
            sys.stdout.buffer.flush()
        except OSError as exc:
            _abandon_stdout()
            if isinstance(exc, BrokenPipeError):
                raise OutputError("cannot write to stdout: the reading end of the pipe was closed") from None
            raise OutputError(f"cannot write to stdout: {os_reason(exc)}") from None
        return
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    write_atomic(path, data_or_writer, force=force, mode=mode)


def _check_output(path: str, force: bool) -> None:
    """Refuse early, before any work, what _write_output would refuse at the end."""
    if path == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE or redirect stdout")
    elif os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    elif os.path.lexists(path) and not force:
        raise OutputExistsError(f"output file {path} already exists; use --force to overwrite it")


@contextmanager
def _about(path: str):
    """Prefix library errors with the file they concern, as zstd and xz do."""
    try:
        yield
    except DeepCabacError as exc:
        name = "<stdin>" if path == "-" else path
        if name in str(exc):
            raise
        raise type(exc)(f"{name}: {exc}") from None


def _input_mode(path: str) -> int | None:
    # The output keeps the input's permission bits (a private checkpoint stays private).
    try:
        return None if path == "-" else os.stat(path).st_mode & 0o777
    except OSError:
        return None


def _same_file(a: str, b: str) -> bool:
    try:
        return a != "-" and b != "-" and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


# --- commands ----------------------------------------------------------------------------------

@main.command()
@click.argument("input", metavar="INPUT", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(allow_dash=True, dir_okay=False),
              help=f"Output stream (default: INPUT{STREAM_SUFFIX}; stdout when INPUT is -).")
@click.option("--input-format", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind when it cannot be told from the suffix (e.g. on stdin).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file.")
@_quant_options
@click.option("--target-bpw", type=click.FloatRange(0.0, 64.0, min_open=True), default=None,
              help="Rate control: choose qp (and lambda) for this many bits per parameter.")
@click.option("--target-size", type=click.IntRange(1), default=None, metavar="BYTES",
              help="Rate control: the largest stream that fits in BYTES.")
@_threads
@_progress_option
@_verbosity
@click.pass_context
def encode(ctx, input, output, input_format, force, qp, qp_density, qp_1d, qp_tensor, exact, exact_all,
           quantizer, lambda_scale, importance, bn_eps, bias_correction, target_bpw, target_size, threads,
           no_progress, quiet, verbose):
    """Compress a checkpoint (.pt/.pth/.bin, .safetensors, .npz) into a model stream."""
    from deepcabac_py.checkpoint import load_checkpoint
    from deepcabac_py.codec import encode_model, read_stream_header

    settings = _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer, lambda_scale,
                                importance, bn_eps, bias_correction)
    targeted = target_bpw is not None or target_size is not None
    if target_bpw is not None and target_size is not None:
        raise click.UsageError("give --target-bpw or --target-size, not both")
    if targeted and ctx.get_parameter_source("qp") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--qp cannot be combined with --target-bpw/--target-size (rate control picks it)")
    if output is None:
        output = "-" if input == "-" else input + STREAM_SUFFIX
    if _same_file(input, output):
        raise click.UsageError("the output would overwrite the input")
    _check_output(output, force)
    with _about(input):
        with _checkpoint_path(input, input_format) as path:
            ckpt = load_checkpoint(path, input_format)
        try:
            if targeted:
                from deepcabac_py.rd import encode_to_size

                del settings["qp"]
                try:
                    data = encode_to_size(ckpt, target_bytes=target_size, target_bpw=target_bpw,
                                          threads=threads, **settings)
                except ValueError as exc:  # the budget cannot be met
                    raise InputError(str(exc)) from None
            else:
                with _progress(_param_count(ckpt), "encode", not (quiet or no_progress)) as update:
                    data = encode_model(ckpt, threads=threads, progress=update, **settings)
        except TypeError as exc:  # an unsupported tensor type inside the checkpoint
            raise InputError(str(exc)) from None
    _write_output(output, data, force, _input_mode(input))
    rep = build_report(read_stream_header(data))
    _info(quiet, f"{input}: {rep.original_bytes:,} bytes of tensors -> {len(data):,} bytes "
                 f"({_ratio_words(rep.ratio_vs_original)}), {rep.bits_per_param:.3f} bits/param"
                 + (f" -> {output}" if verbose else ""))
    if verbose and not quiet:
        click.echo(format_report(rep), err=True)


@main.command()
@click.argument("input", metavar="INPUT", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(allow_dash=True, dir_okay=False),
              help=f"Output checkpoint (default: INPUT without {STREAM_SUFFIX}).")
@click.option("--format", "kind", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind to write (default: from the output suffix, else the original kind).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--max-elements", type=click.IntRange(min=0), default=None, metavar="N",
              help="Refuse a stream whose tensors hold more than N elements (for untrusted input; "
                   "without it, memory is bounded by what the payload can code).")
@_threads
@_progress_option
@_verbosity
def decode(input, output, kind, force, max_elements, threads, no_progress, quiet, verbose):
    """Decompress a model stream into a checkpoint."""
    from deepcabac_py.checkpoint import checkpoint_writer, kind_from_suffix
    from deepcabac_py.codec import decode_checkpoint, read_stream_header

    if output is None:
        if input == "-":
            output = "-"
        elif input.lower().endswith(STREAM_SUFFIX) and len(input) > len(STREAM_SUFFIX):
            output = input[: -len(STREAM_SUFFIX)]
        else:
            raise click.UsageError(f"cannot derive an output name from {input!r}: use -o")
    suffix_kind = kind_from_suffix(output) if output != "-" else None
    if kind and suffix_kind and kind != suffix_kind:
        raise click.UsageError(f"--format {kind} contradicts the output name {output!r}")
    if _same_file(input, output):
        raise click.UsageError("the output would overwrite the input")
    _check_output(output, force)
    with _about(input):
        data = read_input(input)
        header = read_stream_header(data)
        original_kind = header.metadata.get("kind")
        kind = kind or suffix_kind or (original_kind if original_kind in KINDS else "torch")
        params = sum(e.numel for e in header.tensors if not e.is_alias)
        with _progress(params, "decode", not (quiet or no_progress)) as update:
            ckpt = decode_checkpoint(data, threads=threads, progress=update, max_elements=max_elements)
    _write_output(output, checkpoint_writer(ckpt, kind), force, _input_mode(input))
    _info(quiet, f"{input}: {len(data):,} bytes -> {params:,} params ({kind})"
                 + (f" -> {output}" if verbose else ""))


@main.command()
@click.argument("input", metavar="INPUT", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(input, as_json):
    """Show a stream's header: tensors, shapes, dtypes, coding modes, qp and sizes (no decoding)."""
    from deepcabac_py.container import read_header

    if dispatch_if_update(input, as_json, "info"):  # an update stream (cli/update.py)
        return
    with _about(input):
        header = read_header(memoryview(read_input("-"))) if input == "-" else read_header_file(input)
    rep = build_report(header)
    if as_json:
        out = {"format_version": header.version, "qp": header.qp, "qp_1d": header.qp_1d,
               "qp_density": header.qp_density, "kind": header.metadata.get("kind"), **rep.to_dict()}
        for t in out["tensors"]:
            for k in ("snr_db", "max_abs_error"):
                t.pop(k, None)
        out.pop("snr_db"), out.pop("max_abs_error"), out.pop("fidelity")
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"deepcabac stream, format {header.version}: {header.total_size:,} bytes, "
               f"{len(header.tensors)} tensors, original kind {header.metadata.get('kind', '?')}")
    click.echo(f"settings: qp {header.qp}, qp_1d {header.qp_1d}, qp_density {header.qp_density}")
    # Drop the SNR and max-error columns (unknown without the original) from the header line *and*
    # the per-tensor rows: the table is fixed-width, so every row is cut where the header's SNR column starts.
    lines = format_report(rep).splitlines()
    cut = lines[0].rfind(" SNR dB") if lines else -1
    if cut >= 0:
        for i, line in enumerate(lines):
            if not line:  # the blank line that ends the table
                break
            lines[i] = line[:cut].rstrip()
    click.echo("\n".join(lines))


@main.command()
@click.argument("input", metavar="INPUT", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--input-format", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind when it cannot be told from the suffix.")
@click.option("--formats", "show_formats", is_flag=True,
              help="Also show each weight matrix's size as dense fp32, CSR, CER, CSER and in the stream.")
@_quant_options
@_threads
@_progress_option
@_verbosity
def report(input, as_json, input_format, show_formats, qp, qp_density, qp_1d, qp_tensor, exact, exact_all,
           quantizer, lambda_scale, importance, bn_eps, bias_correction, threads, no_progress, quiet, verbose):
    """Per-tensor and total figures: params, bits/param, ratio vs fp32, SNR and max error.

    INPUT is a checkpoint (encoded in memory with the given settings, then decoded to measure the
    error) or a model stream (sizes only: the original is not known). --formats adds, for every
    quantized tensor with two or more dimensions (conv weights as out x in*kh*kw), its bytes as dense
    fp32, scipy-style CSR, CER and CSER built from the decoded levels, and in the stream.
    """
    from deepcabac_py.checkpoint import load_checkpoint
    from deepcabac_py.codec import decode_checkpoint, encode_model, read_stream_header

    if dispatch_if_update(input, as_json, "report"):  # an update stream (cli/update.py)
        return
    with _about(input):
        raw = read_input(input) if input == "-" else None
        is_stream = (raw[:4] if raw is not None else _peek(input)) == b"\x89DCB"
        if is_stream:
            data = raw if raw is not None else read_input(input)
            header = read_stream_header(data)
            rep = build_report(header)
        else:
            settings = _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer,
                                        lambda_scale, importance, bn_eps, bias_correction)
            if raw is not None:
                with tempfile.TemporaryDirectory(prefix="deepcabac-") as tmp:
                    spooled = os.path.join(tmp, "stdin" + _DEFAULT_SUFFIX.get(input_format or "", ""))
                    with open(spooled, "wb") as f:
                        f.write(raw)
                    original = load_checkpoint(spooled, input_format)
            else:
                original = load_checkpoint(input, input_format)
            params = _param_count(original)
            with _progress(2 * params, "report", not (quiet or no_progress)) as update:
                try:
                    data = encode_model(original, threads=threads, progress=update, **settings)
                except TypeError as exc:
                    raise InputError(str(exc)) from None
                decoded = decode_checkpoint(data, threads=threads, progress=update)
            rep = build_report(read_stream_header(data), original, decoded)
        sizes = None
        if show_formats:
            from deepcabac_py.matrix_formats import stream_format_sizes

            sizes = stream_format_sizes(data, threads=threads)
    if as_json:
        out = rep.to_dict()
        if sizes is not None:
            out["formats"] = sizes
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(format_report(rep))
        if sizes is not None:
            from deepcabac_py.report import format_matrix_sizes

            click.echo("")
            click.echo(format_matrix_sizes(sizes))


@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True,
                type=click.Path(allow_dash=True, dir_okay=False))
@click.option("--base", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For update files: the parent model, to apply every message in order.")
@_threads
@_verbosity
def test(inputs, base, threads, quiet, verbose):
    """Decode streams and discard the result: checks that they are intact (all are checked).

    Update files are checked message by message: decoded in full with --base (or when a message
    carries its tensor table), else by their checksums.
    """
    from deepcabac_py.codec import decode_checkpoint

    failed = 0
    for path in inputs:
        summary = ""
        try:
            with _about(path):
                if path != "-" and is_update_file(_peek(path)):
                    summary = " (" + test_update_file(path, base) + ")"
                else:
                    decode_checkpoint(read_input(path), threads=threads)
        except DeepCabacError as exc:
            click.echo(f"deepcabac: error: {exc}", err=True)
            failed += 1
            continue
        _info(quiet, f"{path}: OK{summary}")
    if failed:
        raise SystemExit(1)


def _ratio_words(ratio: float | None) -> str:
    if not ratio:
        return "-"
    return f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"


def _param_count(ckpt) -> int:
    total = 0
    for t in ckpt.tensors.values():
        n = 1
        for d in t.shape:
            n *= int(d)
        total += n
    return total


def _peek(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None


from .update import dispatch_if_update, is_update_file, test_update_file, update_group  # noqa: E402
main.add_command(update_group, "update")

if __name__ == "__main__":
    main()
