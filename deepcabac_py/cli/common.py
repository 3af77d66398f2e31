"""What the CLI's commands share: reading inputs, writing outputs, and wording errors."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import struct
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import click

from deepcabac_py.errors import CheckpointError, DeepCabacError, OutputError, OutputExistsError
from deepcabac_py.io.atomic import is_special_file, os_reason, write_atomic
from deepcabac_py.io.inputs import read_exactly, unreadable
from deepcabac_py.io.kinds import MAX_SAFETENSORS_HEADER_BYTES, SUFFIX_OF_KIND
from deepcabac_py.model.container import read_header, read_preamble, read_stream


class Input:
    """A command's input, a path or ``-`` (stdin), opened once: its first bytes are peeked without
    being consumed (a pipe is read once) and everything is read in bounded pieces, never further
    than the format justifies (a device like /dev/zero is not read to exhaustion)."""

    def __init__(self, path: str):
        self.path = path
        self.name = "<stdin>" if path == "-" else path
        try:
            self._f = sys.stdin.buffer if path == "-" else open(path, "rb")
            self.regular = path != "-" and stat.S_ISREG(os.fstat(self._f.fileno()).st_mode)
        except OSError as exc:
            raise unreadable(path, exc) from None
        self._prefix = b""

    def __enter__(self) -> Input:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.path != "-":
            self._f.close()

    def head(self, n: int = 8) -> bytes:
        """The first ``n`` bytes (fewer at the end of the input), not consumed."""
        while len(self._prefix) < n:
            part = self._read_raw(n - len(self._prefix))
            if not part:
                break
            self._prefix += part
        return self._prefix[:n]

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (``n`` >= 0: an endless input is never read to its end at once)."""
        if self._prefix:
            out, self._prefix = self._prefix[:n], self._prefix[n:]
            return out
        return self._read_raw(n)

    def _read_raw(self, n: int) -> bytes:
        try:
            return self._f.read(n)
        except OSError as exc:
            raise unreadable(self.name, exc) from None

    def model_stream(self, max_elements: int | None = None) -> bytes:
        """The whole model stream: a regular file as it is (its size is known), anything else as far
        as its header says (:func:`deepcabac_py.model.container.read_stream`)."""
        if self.regular:
            return self.head(0) + self._rest()
        return read_stream(self, max_elements=max_elements)

    def open_stream(self, stack: contextlib.ExitStack, max_elements: int | None = None):
        """The model stream to decode: a regular file read a tensor's payload at a time (closed with
        ``stack``), anything else read whole (:meth:`model_stream`)."""
        # (the decoder imports torch: only the commands that decode pay for it)
        from deepcabac_py.model.decoder import StreamBytes, StreamFile

        if self.regular:
            return stack.enter_context(StreamFile(self.path))
        return StreamBytes(self.model_stream(max_elements))

    def _rest(self) -> bytes:
        parts = [self._prefix] if self._prefix else []
        self._prefix = b""
        while True:
            part = self._read_raw(_PIECE)
            if not part:
                return b"".join(parts)
            parts.append(part)

    def stream_header(self):
        """The model stream's header, reading nothing of the payload of a regular file."""
        if self.regular:
            head = self.head(16)
            _, header_size = read_preamble(head)
            return read_header(self.head(16 + header_size), total_size=os.fstat(self._f.fileno()).st_size)
        return read_header(memoryview(self.model_stream()))

    @contextmanager
    def checkpoint_path(self, kind: str | None):
        """A path to the checkpoint: a regular file's own, else a temporary copy of what the input
        holds, read as far as its format says where it can (safetensors), and refused at once where
        its first bytes are no checkpoint at all."""
        if self.regular:
            yield self.path
            return
        head = self.head(16)
        if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # a zip (torch, npz) or a legacy pickle
            data = self._rest()
        elif len(head) > 8 and head[8:9] == b"{":  # safetensors: its header says where the data ends
            data = read_exactly(self, 8, "safetensors header length")
            (size,) = struct.unpack("<Q", data)
            if size > MAX_SAFETENSORS_HEADER_BYTES:
                raise CheckpointError(f"{self.name}: invalid safetensors file: header of {size:,} bytes")
            header = read_exactly(self, size, "safetensors header")
            data += header + read_exactly(self, _safetensors_data_size(header, self.name), "safetensors data")
            if self.read(1):
                raise CheckpointError(f"{self.name}: invalid safetensors file: bytes after its data")
        else:
            raise CheckpointError(f"{self.name}: not a checkpoint (it starts with neither a zip archive, a "
                                  "safetensors header nor a pickle)")
        suffix = SUFFIX_OF_KIND.get(kind or "", "")
        with tempfile.TemporaryDirectory(prefix="deepcabac-") as tmp:
            spooled = os.path.join(tmp, "input" + suffix)
            with open(spooled, "wb") as f:
                f.write(data)
            yield spooled


_PIECE = 1 << 24


def compile_notice(task: str, quantizer: str | None, lossless: bool = False) -> None:
    """One line on stderr before a first run waits for Numba to compile what ``task`` (encode,
    decode, report) needs, the lossless float coder's kernels too with ``lossless``: without it the
    bar would sit at 0% with a wrong estimate."""
    from deepcabac_py.entropy import floatcoder, levelcoder
    from deepcabac_py.model.settings import DEFAULT_QUANTIZER
    from deepcabac_py.quant import quantizers

    cold = levelcoder.first_call_compiles(decoder=task != "encode")
    if task != "decode":
        cold = cold or quantizers.first_call_compiles(quantizer or DEFAULT_QUANTIZER)
    if lossless:
        cold = cold or floatcoder.first_call_compiles(decoder=task != "encode")
    if cold:
        click.echo("deepcabac: compiling kernels (first run only, 10 s to a minute)", err=True)


def holds_lossless_floats(entries) -> bool:
    """Whether any of these stream entries is a float tensor coded bit-exactly (its decoder's
    kernels are the float coder's)."""
    from deepcabac_py.model.container import Mode

    return any(e.mode == Mode.FLOAT for e in entries)


@contextmanager
def progress_bar(total: int | None, desc: str, enabled: bool, quantizer: str | None = None, lossless: bool = False):
    """A progress callback (None when not ``enabled``): a bar on stderr when it is a terminal (counts
    only when ``total`` is unknown), after a notice when the kernels are still to be compiled
    (``quantizer``: the encoder's, None for the default; ``lossless``: floats are coded exactly)."""
    if not enabled:
        yield None
        return
    if sys.stderr.isatty():
        compile_notice(desc, quantizer, lossless)
    from tqdm import tqdm

    # disable=None: shown only when stderr is a terminal.
    with tqdm(total=total, desc=desc, unit="w", unit_scale=True, file=sys.stderr, disable=None,
              leave=False, dynamic_ncols=True) as bar:
        yield bar.update


@dataclass
class Outputs:
    """Where each input's output goes, as zstd does it: ``-o`` (one input only), ``-c`` (stdout,
    one input only), else a name derived from the input; the output keeps the input's mode and
    modification time, and ``--rm`` removes the input once its output is written and checked."""

    output: str | None
    remove: bool

    @classmethod
    def of(cls, inputs, output: str | None, to_stdout: bool, force: bool, remove: bool, keep: bool) -> Outputs:
        if len(inputs) > 1 and (output is not None or to_stdout):
            raise click.UsageError("-o and -c name one output: with several inputs each goes beside its input")
        if to_stdout and output not in (None, "-"):
            raise click.UsageError("give -c or -o FILE, not both")
        if remove and keep:
            raise click.UsageError("give --rm or -k, not both")
        if remove and (to_stdout or output == "-" or "-" in inputs):
            raise click.UsageError("--rm removes input files once their output files are written: not with stdin "
                                   "or stdout")
        if len(set(inputs)) != len(inputs):
            raise click.UsageError("an input is named twice")
        return cls("-" if to_stdout else output, remove)

    def target(self, input: str, derive: Callable[[str], str]) -> str:
        if self.output is not None:
            return self.output
        return "-" if input == "-" else derive(input)

    def finish(self, input: str, output: str, verify: Callable[[str], None] | None = None) -> None:
        """After a successful write: the input's times on the output, then (``--rm``) the output
        checked and the input removed."""
        if input == "-" or output == "-" or is_special_file(output):
            return
        try:
            st = os.stat(input)
            os.utime(output, ns=(st.st_atime_ns, st.st_mtime_ns))
        except OSError:
            pass  # (times are a courtesy)
        if self.remove:
            if verify is not None:
                verify(output)
            try:
                os.remove(input)
            except OSError as exc:
                raise OutputError(f"cannot remove {input}: {os_reason(exc)}") from None


def each_input(inputs, run: Callable[[str], None]) -> None:
    """``run`` on every input; with several, an error ends that input only (one line on stderr) and
    the command exits 1 at the end, as zstd does."""
    if len(inputs) == 1:
        run(inputs[0])
        return
    failed = 0
    for input in inputs:
        try:
            run(input)
        except DeepCabacError as exc:
            click.echo(f"deepcabac: error: {exc}", err=True)
            failed += 1
    if failed:
        raise SystemExit(1)


def echo_info(quiet: bool, message: str) -> None:
    if not quiet:
        click.echo(message, err=True)


def _safetensors_data_size(header: bytes, name: str) -> int:
    """The data bytes a safetensors header describes (the end of its last tensor)."""
    try:
        table = json.loads(header)
        ends = [int(v["data_offsets"][1]) for k, v in table.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        raise CheckpointError(f"{name}: invalid safetensors file: unreadable header") from None
    return max(ends, default=0)


class PipeClosed(Exception):
    """The reader of stdout went away (``| head``): the command ends quietly with status 0, as cat
    and zstd do when they are killed by SIGPIPE without a word."""


def abandon_stdout() -> None:
    """After a failed write, point stdout at /dev/null: the interpreter's final flush would otherwise
    fail again and print a traceback of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def write_output(path: str, data_or_writer, force: bool, mode: int | None = None) -> None:
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
            abandon_stdout()
            if isinstance(exc, BrokenPipeError):
                raise PipeClosed() from None
            raise OutputError(f"cannot write to stdout: {os_reason(exc)}") from None
        return
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    write_atomic(path, data_or_writer, force=force, mode=mode)


def check_output(path: str, force: bool) -> None:
    """Refuse early, before any work, what write_output would refuse at the end."""
    if path == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE or redirect stdout")
        return
    if is_special_file(path):  # a device or a pipe: written in place, as zstd does
        return
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    if os.path.lexists(path) and not force:
        raise OutputExistsError(f"output file {path} already exists; use --force to overwrite it")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OutputError(f"cannot write {path}: no such directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: permission denied")


@contextmanager
def about(path: str):
    """Prefix library errors with the file they concern, as zstd and xz do (an error writing the
    output names the output, or stdout, itself)."""
    try:
        yield
    except DeepCabacError as exc:
        name = "<stdin>" if path == "-" else path
        if name in str(exc) or isinstance(exc, OutputError):
            raise
        raise type(exc)(f"{name}: {exc}") from None


def input_mode(path: str) -> int | None:
    # The output keeps the input's permission bits (a private checkpoint stays private).
    try:
        return None if path == "-" else os.stat(path).st_mode & 0o777
    except OSError:
        return None


def same_file(a: str, b: str) -> bool:
    try:
        return a != "-" and b != "-" and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def ratio_words(ratio: float | None) -> str:
    if not ratio:
        return "-"
    return f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
