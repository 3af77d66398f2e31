"""The ``deepcabac`` command line: encode, decode, info, report and test model streams.

Habits of zstd/xz: ``-o`` names the output, ``-f`` allows overwriting, ``-`` is stdin/stdout (binary
is never written to a terminal), ``-q``/``-v`` set verbosity, progress goes to stderr. Exit status:
0 success, 1 an error about the data or files (one line on stderr, no traceback), 2 a usage error.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from contextlib import contextmanager

import click

from deepcabac_py import __version__
from deepcabac_py.errors import DeepCabacError, InputError
from deepcabac_py.io.kinds import KINDS, read_head
from deepcabac_py.model.container import is_model_stream, read_header, read_preamble
from deepcabac_py.model.report import build_report, format_report
from deepcabac_py.model.settings import DEFAULT_MOMENTS_QP, DEFAULT_QP, DEFAULT_QP_DENSITY, DEFAULT_QUANTIZER
from deepcabac_py.quant.quantizers import QUANTIZERS
from deepcabac_py.quant.steps import QP_MAX, QP_MIN, qp_range

from .common import (
    Input,
    Outputs,
    PipeClosed,
    abandon_stdout,
    about,
    check_output,
    each_input,
    echo_info,
    holds_lossless_floats,
    input_mode,
    progress_bar,
    ratio_words,
    same_file,
    write_output,
)
from .directories import (
    decode_directory_command,
    encode_directory_command,
    info_directory,
    report_directory,
    test_directory,
)
from .series import series_group
from .sweep import sweep
from .update import info_update, is_update_file, report_update, test_update_file, update_group

# Commands import the library's codec and checkpoint modules (torch, most of a second) when they
# need them, so that `info` stays fast.
STREAM_SUFFIX = ".dcb"


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
    """Turns library errors into one line on stderr and exit status 1, ^C into 130, SIGTERM into 143,
    a closed pipe downstream into a quiet 0."""

    def invoke(self, ctx):
        try:
            with _sigterm_unwinds():
                return super().invoke(ctx)
        except (PipeClosed, BrokenPipeError):  # stdout's reader is gone (| head): nothing more to say
            abandon_stdout()
            ctx.exit(0)
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


def _file_options(f):
    """zstd's: -c, -f, --rm, -k (applied bottom-up: listed in this order)."""
    f = click.option("-k", "--keep", is_flag=True, help="Keep the inputs (the default).")(f)
    f = click.option("--rm", "remove", is_flag=True,
                     help="Remove each input once its output is written and checked.")(f)
    f = click.option("-f", "--force", is_flag=True, help="Overwrite an existing output.")(f)
    f = click.option("-c", "--stdout", "to_stdout", is_flag=True, help="Write to stdout (as -o -); one INPUT only.")(f)
    return f


def _progress_option(f):
    return click.option("--no-progress", is_flag=True, help="Do not show progress bars.")(f)


def _quant_options(f):
    """The quantizer's options, listed in this order (most used first)."""
    options = [
        click.option("--qp", type=click.IntRange(QP_MIN, QP_MAX), default=DEFAULT_QP, show_default=True,
                     help="Quantization parameter: the step of the weights. Lower is finer: more bytes, less "
                          "error; 4 steps of qp are an octave (step = (4 + qp mod 4) * 2**(qp // 4 - 2) at density "
                          "2)."),
        click.option("--quantizer", type=click.Choice(QUANTIZERS), default=DEFAULT_QUANTIZER, show_default=True,
                     help="trellis: dependent quantization (fewest bytes at a given fidelity; its effective "
                          "step is about twice qp's); rdoq: rate-distortion optimised rounding; nearest: "
                          "plain rounding."),
        click.option("--qp-1d", type=click.IntRange(QP_MIN, QP_MAX), default=None,
                     help="qp of tensors with at most one dimension (biases, norms) "
                          "[default: qp - 6 octaves, i.e. qp - 6 * 2**qp_density]."),
        click.option("--exact", "exact", multiple=True, metavar="PATTERN",
                     help="Code float tensors matching PATTERN losslessly (bit for bit). Repeatable."),
        click.option("--lossless", "--exact-all", "exact_all", is_flag=True,
                     help="Code every tensor losslessly: floats bit for bit with the lossless float coder."),
        click.option("--qp-tensor", "qp_tensor", multiple=True, metavar="NAME=QP",
                     help="Per-tensor qp; NAME may be a glob pattern. Repeatable."),
        click.option("--importance", type=click.Choice(("structural", "none")), default="structural",
                     show_default=True,
                     help="structural: steps and error weights from the model's own structure, without "
                          "data (embedding tables coarser, BatchNorm scales); none: every tensor at --qp "
                          "(--qp-1d for biases and norms), every weight alike."),
        click.option("--lambda-scale", type=click.FloatRange(0.0, 1e6), default=1.0, show_default=True,
                     help="Scale of the rate-distortion trade-off of trellis and rdoq (larger: fewer bytes)."),
        click.option("--bn-eps", type=click.FloatRange(0.0, 1.0, min_open=True), default=None, metavar="EPS",
                     help="The eps of the model's BatchNorm layers (e.g. 1e-5, PyTorch's default; 1e-3 for "
                          "TF-trained nets). Given, their running statistics are coded to about 1% of each "
                          "layer's typical channel (never finer than --qp) and weight/bias compensate "
                          "exactly (same eval-mode output, fewer bytes)."),
        click.option("--bias-correction/--no-bias-correction", default=True, show_default=True,
                     help="Take the mean output shift of each layer's quantization error out of the "
                          "BatchNorm after it (or its bias), estimated without data from the BatchNorm "
                          "before it."),
        click.option("--moments-qp", type=click.IntRange(QP_MIN, QP_MAX), default=DEFAULT_MOMENTS_QP,
                     show_default=True,
                     help="qp of an optimizer's moments (Adam's exp_avg and exp_avg_sq, SGD's momentum, "
                          "Adagrad's sum...), coded by the log2 of each magnitude: the step of this qp, in "
                          "octaves, is their precision (-8: a quarter octave, at most 9% off). Optimizer steps "
                          "and what no rounding may touch are kept exact."),
        click.option("--qp-density", type=click.IntRange(0, 6), default=DEFAULT_QP_DENSITY, show_default=True,
                     help="Steps per octave = 2**qp_density."),
    ]
    for option in reversed(options):  # (click lists the last one applied first)
        f = option(f)
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


def _check_qps(qp_density: int, **qps: int | None) -> None:
    """Refuse, naming the option, a qp without a step at this density (the usable range depends on
    it, so click's own range cannot say)."""
    lo, hi = qp_range(qp_density)
    for option, value in qps.items():
        if value is not None and not lo <= value <= hi:
            raise click.BadParameter(f"{value} has no step at --qp-density {qp_density} (its qps run from "
                                     f"{lo} to {hi})", param_hint=option)


_OPTION_OF_SETTING = {"qp_overrides": "--qp-tensor", "keep_exact": "--exact"}


def _option_words(exc: ValueError) -> str:
    """A settings error in the words of the command line (the option, not the keyword)."""
    text = str(exc)
    for setting, option in _OPTION_OF_SETTING.items():
        if text.startswith(setting + ":"):
            return option + text[len(setting):]
    return text


def _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer, lambda_scale,
                     importance, bn_eps, bias_correction, moments_qp) -> dict:
    overrides = _parse_overrides(qp_tensor)
    _check_qps(qp_density, **{"--qp": qp, "--qp-1d": qp_1d})
    _check_qps(qp_density, **{f"--qp-tensor {name}": value for name, value in overrides.items()})
    return dict(qp=qp, qp_density=qp_density, qp_1d=qp_1d, qp_overrides=overrides,
                keep_exact=True if exact_all else list(exact), quantizer=quantizer, lambda_scale=lambda_scale,
                importance=None if importance == "none" else importance, batchnorm_eps=bn_eps,
                bias_correction=bias_correction, moments_qp=moments_qp)


# --- commands ----------------------------------------------------------------------------------

@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("-o", "--output", type=click.Path(allow_dash=True),
              help=f"Output stream (default: INPUT{STREAM_SUFFIX}; stdout when INPUT is -); one INPUT only. For a "
                   "checkpoint directory, the output directory.")
@_quant_options
@_file_options
@click.option("--input-format", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind when it cannot be told from the suffix (e.g. on stdin).")
@click.option("--target-bpw", type=click.FloatRange(0.0, 64.0, min_open=True), default=None,
              help="Rate control: choose qp (and lambda) for this many bits per parameter.")
@click.option("--target-size", type=click.IntRange(1), default=None, metavar="BYTES",
              help="Rate control: the largest stream that fits in BYTES.")
@_threads
@_progress_option
@_verbosity
@click.pass_context
def encode(ctx, inputs, output, to_stdout, force, remove, keep, input_format, qp, qp_density, qp_1d, qp_tensor,
           exact, exact_all, quantizer, lambda_scale, importance, bn_eps, bias_correction, moments_qp, target_bpw,
           target_size, threads, no_progress, quiet, verbose):
    """Compress checkpoints (.pt/.pth/.bin, .safetensors, .npz) into model streams, each INPUT to
    INPUT.dcb.

    INPUT may be a checkpoint directory (Hugging Face shards and their index): every shard becomes
    SHARD.dcb in the output directory and every other file is carried as it is.
    """
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.io.tensor_source import open_source
    from deepcabac_py.model.decoder import check_stream_file
    from deepcabac_py.model.files import stream_writer
    from deepcabac_py.model.settings import EncodeSettings

    settings = _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer, lambda_scale,
                                importance, bn_eps, bias_correction, moments_qp)
    targeted = target_bpw is not None or target_size is not None
    if target_bpw is not None and target_size is not None:
        raise click.UsageError("give --target-bpw or --target-size, not both")
    if targeted and ctx.get_parameter_source("qp") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--qp cannot be combined with --target-bpw/--target-size (rate control picks it)")
    outputs = Outputs.of(inputs, output, to_stdout, force, remove, keep)

    def one(input: str) -> None:
        output = outputs.target(input, lambda name: name.rstrip("/") + STREAM_SUFFIX)
        if input != "-" and os.path.isdir(input):
            if targeted:
                raise click.UsageError("--target-bpw/--target-size work on one checkpoint file, not a directory")
            if remove:
                raise click.UsageError("--rm works on files, not directories")
            with about(input):
                try:
                    encode_directory_command(input, output, force, threads, not (quiet or no_progress), quiet,
                                             verbose, settings)
                except ValueError as exc:
                    raise click.UsageError(_option_words(exc)) from None
            return
        if same_file(input, output):
            raise click.UsageError("the output would overwrite the input")
        check_output(output, force)
        with about(input), Input(input) as inp, inp.checkpoint_path(input_format) as path:
            try:
                if targeted:
                    from deepcabac_py.tuning.rate_control import encode_to_size

                    kw = {k: v for k, v in settings.items() if k != "qp"}
                    try:
                        data = encode_to_size(load_checkpoint(path, input_format), target_bytes=target_size,
                                              target_bpw=target_bpw, threads=threads, **kw)
                    except ValueError as exc:  # the budget cannot be met
                        raise InputError(str(exc)) from None
                    write_output(output, data, force, input_mode(input))
                    header = read_header(data)
                else:
                    # a safetensors file is read a tensor at a time and the stream written as it is coded
                    enc = EncodeSettings(**settings)
                    written: list = []
                    with open_source(path, input_format) as source, \
                            progress_bar(source.numel, "encode", not (quiet or no_progress),
                                         enc.quantizer, lossless=bool(enc.keep_exact)) as update:
                        write_output(output, stream_writer(source, enc, written, threads=threads, progress=update),
                                     force, input_mode(input))
                    header = written[0]
            except TypeError as exc:  # an unsupported tensor type inside the checkpoint
                raise InputError(str(exc)) from None
            except ValueError as exc:  # settings the model contradicts (a --qp-tensor that names no tensor)
                raise click.UsageError(_option_words(exc)) from None
            outputs.finish(input, output, verify=check_stream_file)
        rep = build_report(header)
        bits = f"{rep.bits_per_param:.3f} bits/param" if rep.bits_per_param is not None else "no parameters"
        echo_info(quiet, f"{input}: {rep.original_bytes:,} bytes of tensors -> {header.total_size:,} bytes "
                         f"({ratio_words(rep.ratio_vs_original)}), {bits}" + (f" -> {output}" if verbose else ""))
        if verbose and not quiet:
            click.echo(format_report(rep), err=True)

    each_input(inputs, one)


def _decoded_name(input: str) -> str:
    name = input.rstrip("/")
    if name.lower().endswith(STREAM_SUFFIX) and len(name) > len(STREAM_SUFFIX):
        return name[: -len(STREAM_SUFFIX)]
    # (a checkpoint given to decode by mistake: what it is says more than the name it lacks)
    if os.path.isfile(input):
        with about(input):
            head = read_head(input)
            if not is_model_stream(head):
                read_preamble(head)
    raise click.UsageError(f"cannot derive an output name from {input!r}: use -o")


@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("-o", "--output", type=click.Path(allow_dash=True),
              help=f"Output checkpoint (default: INPUT without {STREAM_SUFFIX}); one INPUT only. For a directory "
                   "of streams, the output directory.")
@click.option("-t", "--tensor", "tensors", multiple=True, metavar="PATTERN",
              help="Decode only the tensors of this name or glob pattern (repeatable); the others are not "
                   "read. The output is a flat checkpoint of those tensors.")
@_file_options
@click.option("--format", "kind", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind to write (default: from the output suffix, else the original kind).")
@click.option("--max-elements", type=click.IntRange(min=0), default=None, metavar="N",
              help="Refuse a stream whose tensors hold more than N elements (for untrusted input; "
                   "without it, memory is bounded by what the payload can code).")
@_threads
@_progress_option
@_verbosity
def decode(inputs, output, tensors, to_stdout, force, remove, keep, kind, max_elements, threads, no_progress,
           quiet, verbose):
    """Decompress model streams into checkpoints (each INPUT.dcb to INPUT), or a directory of streams
    into a checkpoint directory."""
    from deepcabac_py.io.files import kind_from_suffix
    from deepcabac_py.model.decoder import select
    from deepcabac_py.model.files import decoded_writer, output_kind

    outputs = Outputs.of(inputs, output, to_stdout, force, remove, keep)
    names = list(tensors) or None

    def one(input: str) -> None:
        output = outputs.target(input, _decoded_name)
        if input != "-" and os.path.isdir(input):
            if tensors or kind or remove:
                raise click.UsageError("--tensor, --format and --rm work on stream files, not directories")
            with about(input):
                decode_directory_command(input, output, force, threads, max_elements, not (quiet or no_progress),
                                         quiet, verbose)
            return
        suffix_kind = kind_from_suffix(output) if output != "-" else None
        if kind and suffix_kind and kind != suffix_kind:
            raise click.UsageError(f"--format {kind} contradicts the output name {output!r}")
        if same_file(input, output):
            raise click.UsageError("the output would overwrite the input")
        check_output(output, force)
        with about(input), contextlib.ExitStack() as stack:
            stream = stack.enter_context(Input(input)).open_stream(stack, max_elements)
            header = stream.header
            try:
                chosen = select(header, names)
            except ValueError as exc:
                raise click.UsageError(f"--tensor: {exc}") from None
            out_kind = output_kind(header, kind or suffix_kind)
            params = sum(e.numel for e in chosen if not e.is_alias)
            with progress_bar(params, "decode", not (quiet or no_progress),
                              lossless=holds_lossless_floats(chosen)) as update:
                writer = decoded_writer(stream, out_kind, names=names, threads=threads, progress=update,
                                        max_elements=max_elements)
                write_output(output, writer, force, input_mode(input))
            outputs.finish(input, output)
        echo_info(quiet, f"{input}: {header.total_size:,} bytes -> {params:,} params ({out_kind})"
                         + (f" -> {output}" if verbose else ""))

    each_input(inputs, one)


@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one document per INPUT).")
def info(inputs, as_json):
    """Show a stream's header: tensors, shapes, dtypes, coding modes, qp and sizes (no decoding).
    For a directory of streams, a line per stream and the totals."""

    def one(input: str) -> None:
        if len(inputs) > 1 and not as_json:
            click.echo(f"== {input}")
        _info(input, as_json)

    each_input(inputs, one)


def _info(input: str, as_json: bool) -> None:
    if input != "-" and os.path.isdir(input):
        with about(input):
            info_directory(input, as_json)
        return
    with about(input), Input(input) as inp:
        if is_update_file(inp.head(8)):
            info_update(inp, as_json)
            return
        header = inp.stream_header()
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
@click.argument("input", metavar="INPUT", type=click.Path(allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--input-format", type=click.Choice(KINDS), default=None,
              help="Checkpoint kind when it cannot be told from the suffix.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Also draw bits per parameter and weight SNR per tensor (needs deepcabac-py[plot]).")
@click.option("--formats", "show_formats", is_flag=True,
              help="Also show each weight matrix's size as dense fp32, CSR, CER, CSER and in the stream.")
@_quant_options
@_threads
@_progress_option
@_verbosity
def report(input, as_json, input_format, plot, show_formats, qp, qp_density, qp_1d, qp_tensor, exact, exact_all,
           quantizer, lambda_scale, importance, bn_eps, bias_correction, moments_qp, threads, no_progress, quiet,
           verbose):
    """Per-tensor and total figures: params, bits/param, ratio vs fp32, SNR and max error.

    INPUT is a checkpoint (encoded in memory with the given settings, then decoded to measure the
    error), a model stream (sizes only: the original is not known) or a directory of streams (each,
    then the totals). --formats adds, for every
    quantized tensor with two or more dimensions (conv weights as out x in*kh*kw), its bytes as dense
    fp32, scipy-style CSR, CER and CSER built from the decoded levels, and in the stream.
    """
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.model.decoder import decode_checkpoint, read_stream_header
    from deepcabac_py.model.encoder import encode_model

    if input != "-" and os.path.isdir(input):
        if show_formats:
            raise click.UsageError("--formats works on one stream or checkpoint file, not a directory")
        with about(input):
            report_directory(input, as_json)
        return
    with about(input), Input(input) as inp:
        if is_update_file(inp.head(8)):
            report_update(inp, as_json)
            return
        if is_model_stream(inp.head(8)):
            data = inp.model_stream()
            header = read_stream_header(data)
            rep = build_report(header)
        else:
            settings = _encode_settings(qp, qp_density, qp_1d, qp_tensor, exact, exact_all, quantizer,
                                        lambda_scale, importance, bn_eps, bias_correction, moments_qp)
            with inp.checkpoint_path(input_format) as path:
                original = load_checkpoint(path, input_format)
            params = original.numel
            with progress_bar(2 * params, "report", not (quiet or no_progress),
                              lossless=bool(settings.get("keep_exact"))) as update:
                try:
                    data = encode_model(original, threads=threads, progress=update, **settings)
                except TypeError as exc:
                    raise InputError(str(exc)) from None
                except ValueError as exc:
                    raise click.UsageError(_option_words(exc)) from None
                decoded = decode_checkpoint(data, threads=threads, progress=update)
            rep = build_report(read_stream_header(data), original, decoded)
        sizes = None
        if show_formats:
            from deepcabac_py.matrix.formats import stream_format_sizes

            sizes = stream_format_sizes(data, threads=threads)
    if as_json:
        out = rep.to_dict()
        if sizes is not None:
            out["formats"] = sizes
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(format_report(rep, internals=verbose))
        if sizes is not None:
            from deepcabac_py.model.report import format_matrix_sizes

            click.echo("")
            click.echo(format_matrix_sizes(sizes))
    if plot is not None:
        from .plots import plot_report

        plot_report(rep, plot, force=True)


@main.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=click.Path(allow_dash=True))
@click.option("--base", type=click.Path(exists=True, dir_okay=False), default=None,
              help="For update files: the parent model, to apply every message in order.")
@_threads
@_verbosity
def test(inputs, base, threads, quiet, verbose):
    """Decode streams and discard the result: checks that they are intact (all are checked).

    Update files are checked message by message: decoded in full with --base (or when a message
    carries its tensor table), else by their checksums. A directory: every stream in it.
    """
    from deepcabac_py.model.decoder import iter_decoded

    failed = 0
    for path in inputs:
        summary = ""
        try:
            if path != "-" and os.path.isdir(path):
                with about(path):
                    summary = f" ({test_directory(path, threads)} streams)"
                echo_info(quiet, f"{path}: OK{summary}")
                continue
            with about(path), Input(path) as inp:
                if is_update_file(inp.head(8)):
                    summary = " (" + test_update_file(inp, base) + ")"
                else:  # a tensor at a time: memory stays bounded whatever the stream's size
                    with contextlib.ExitStack() as stack:
                        for _ in iter_decoded(inp.open_stream(stack), threads=threads, bits=True):
                            pass
        except DeepCabacError as exc:
            click.echo(f"deepcabac: error: {exc}", err=True)
            failed += 1
            continue
        echo_info(quiet, f"{path}: OK{summary}")
    if failed:
        raise SystemExit(1)


main.add_command(update_group, "update")
main.add_command(series_group, "series")
main.add_command(sweep)

if __name__ == "__main__":
    main()
