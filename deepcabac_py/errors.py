"""The library's exceptions.

Every failure caused by the *content* of an input (a bitstream, a checkpoint, a file on disk) raises a
subclass of :class:`DeepCabacError`; bad arguments from the caller raise ``ValueError``/``TypeError``.
The CLI prints a ``DeepCabacError`` as one line and exits with status 1. What changes the data
without failing is a :class:`DeepCabacWarning`.
"""


class DeepCabacError(Exception):
    """Base class of every error this library raises about its inputs or outputs."""


class FormatError(DeepCabacError):
    """The input is not a stream this library can read (wrong magic, unknown version or code)."""


class CorruptStreamError(FormatError):
    """The stream is damaged: a checksum, length or header field is inconsistent."""


class TruncatedStreamError(CorruptStreamError):
    """The stream ends before the data its header describes."""


class CheckpointError(DeepCabacError):
    """A checkpoint file cannot be read or written (unsupported kind, hostile or damaged content)."""


class PickleRefusedError(CheckpointError):
    """A torch file whose pickle needs code or objects that weights-only loading does not allow: it
    is never unpickled (a checkpoint directory carries such a file as its bytes)."""


class OutputExistsError(DeepCabacError):
    """The output file exists and overwriting was not allowed (pass ``force=True`` / ``--force``)."""


class OutputError(DeepCabacError):
    """An output file cannot be written (disk full, permission denied, missing directory, ...)."""


class InputError(DeepCabacError):
    """An input file cannot be read (missing, unreadable, a directory)."""


class UpdateMismatchError(DeepCabacError):
    """An update does not belong here: its parent model or its coding session is not the one given."""


class LimitExceededError(DeepCabacError):
    """The input asks for more memory than a limit the caller set (``max_elements``, ``max_bytes``)."""


class DeepCabacWarning(UserWarning):
    """Something the caller should know happened to the data: a tensor stored raw because it holds
    NaN or infinity, a step made coarser than asked so that the levels fit, values dropped from an
    update. The CLI prints each as one line ("deepcabac: warning: ...")."""
