"""Checkpoint directories as Hugging Face writes them: weight shards (``model-00001-of-00004.safetensors``,
``pytorch_model-00001-of-00002.bin``, or one unsharded ``model.safetensors``), the index that maps
every tensor to its shard (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``), and
everything else (config, tokenizer, generation settings) carried as it is. The Trainer's
``checkpoint-N/`` adds ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``
and ``training_args.bin``.

:func:`scan_directory` reads the layout and checks the index against the shards' own tensor tables
(headers only: nothing is loaded); :func:`replace_directory` puts a finished output directory in
place in one rename. :func:`load_checkpoint_directory` takes a whole directory as one
:class:`~.checkpoint.Checkpoint` (what a checkpoint series stores of a training run's
``checkpoint-N/``) and :func:`save_checkpoint_directory` writes it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, InputError, OutputError, OutputExistsError, PickleRefusedError
from .atomic import os_reason
from .checkpoint import Checkpoint, flatten, unflatten
from .files import checkpoint_writer, load_checkpoint, load_safetensors, read_safetensors_index
from .inputs import unreadable
from .kinds import kind_from_suffix

__all__ = ["CheckpointDirectory", "scan_directory", "list_files", "check_output_directory", "temporary_sibling",
           "replace_directory", "built_beside", "copy_file", "INDEX_SUFFIX", "DIRECTORY_KIND",
           "load_checkpoint_directory", "save_checkpoint_directory"]

INDEX_SUFFIX = ".index.json"
SHARD_NUMBER = re.compile(r"-\d+-of-\d+\.[^.]+$")  # model-00001-of-00004.safetensors
# an index bigger than this is no index (a 1,000-shard model with 100k tensors needs a few MB)
MAX_INDEX_BYTES = 64 << 20


@dataclass
class CheckpointDirectory:
    """A checkpoint directory: its shards (relative paths, sorted), its index files and the rest."""

    path: str
    shards: list[str]
    indexes: list[str]
    others: list[str]
    # tensor name -> shard, from the index (empty without one)
    weight_map: dict[str, str] = field(default_factory=dict)

    def full(self, relative: str) -> str:
        return os.path.join(self.path, relative)


def is_shard(name: str) -> bool:
    """A weight file: safetensors, or a torch pickle (``.bin``, ``.pt``, ``.pth``) that is no index."""
    return not name.endswith(INDEX_SUFFIX) and kind_from_suffix(name) in ("safetensors", "torch")


def scan_directory(path: str | os.PathLike, *, check_index: bool = True) -> CheckpointDirectory:
    """The layout of the checkpoint directory ``path``.

    Every regular file below it is a shard (by suffix), an index (``*.index.json``) or another
    file. With ``check_index``, every index must name shards that exist and must agree with the
    tensors the shards hold (each tensor in one shard, no tensor missing from the map); a shard's
    tensor table is read from its header alone for safetensors, by loading it for torch shards.
    """
    path = os.fspath(path)
    shards, indexes, others = [], [], []
    for rel in list_files(path):
        name = os.path.basename(rel)
        if name.endswith(INDEX_SUFFIX):
            indexes.append(rel)
        elif is_shard(name):
            shards.append(rel)
        else:
            others.append(rel)
    if not shards:
        raise CheckpointError(f"{path}: no checkpoint shard in the directory (.safetensors, .bin, .pt, .pth)")
    layout = CheckpointDirectory(path, shards, indexes, others)
    # (a Trainer's checkpoint-N/ holds model.safetensors, optimizer.pt, scheduler.pt and more
    # without an index: only a model cut into numbered shards needs one)
    numbered = [s for s in shards if SHARD_NUMBER.search(os.path.basename(s))]
    if check_index and len(numbered) > 1 and not indexes:
        raise CheckpointError(f"{path}: {len(numbered)} numbered shards and no index (*{INDEX_SUFFIX}) saying "
                              "which tensor is in which")
    for index in indexes:
        layout.weight_map.update(_read_index(layout, index))
    if check_index and layout.weight_map:
        _check_against_shards(layout)
    return layout


def list_files(path: str) -> list[str]:
    """Every file below the directory ``path``, relative to it, sorted. A link to a regular file
    counts as that file (a Hugging Face hub snapshot is a directory of links into its cache's
    blobs; what is written is a regular file); InputError for a link to a directory, a link that
    leads nowhere and special files."""
    if not os.path.isdir(path):
        raise InputError(f"{path}: not a directory")
    out = []
    for root, dirs, files in os.walk(path, onerror=_raise_unreadable):
        dirs.sort()
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                raise InputError(f"{os.path.join(root, name)}: a link to a directory (not followed)")
        for name in sorted(files):
            full = os.path.join(root, name)
            if not os.path.isfile(full):
                what = "a link that leads to no regular file" if os.path.islink(full) else "not a regular file"
                raise InputError(f"{full}: {what} (special files are not carried)")
            out.append(os.path.relpath(full, path))
    return out


def _raise_unreadable(exc: OSError) -> None:
    raise unreadable(exc.filename or "?", exc)


def _read_index(layout: CheckpointDirectory, index: str) -> dict[str, str]:
    full = layout.full(index)
    raw = _read_at_most(full, MAX_INDEX_BYTES, f"index larger than {MAX_INDEX_BYTES:,} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(f"{full}: the index is not valid JSON") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{full}: the index has no weight_map of tensor names to shard files")
    base = os.path.dirname(index)
    out = {}
    for tensor, shard in weight_map.items():
        rel = os.path.normpath(os.path.join(base, shard))
        if rel not in layout.shards:
            raise CheckpointError(f"{full}: tensor {tensor!r:.80} is in shard {shard!r:.80}, which the directory "
                                  "does not have")
        out[tensor] = rel
    return out


def shard_tensor_names(full: str) -> list[str]:
    """The tensor names a shard holds (a safetensors header alone; a torch shard is loaded)."""
    if kind_from_suffix(full) == "safetensors":
        try:
            with open(full, "rb") as f:
                return [e[0] for e in read_safetensors_index(f, full).entries]
        except OSError as exc:
            raise unreadable(full, exc) from None
    return list(load_checkpoint(full).tensors)


def _check_against_shards(layout: CheckpointDirectory) -> None:
    seen: dict[str, str] = {}
    indexed = set(layout.weight_map.values())
    for shard in layout.shards:
        if shard not in indexed:
            continue
        for name in shard_tensor_names(layout.full(shard)):
            if name in seen:
                raise CheckpointError(f"{layout.path}: tensor {name!r:.80} is in two shards, {seen[name]} and {shard}")
            seen[name] = shard
            mapped = layout.weight_map.get(name)
            if mapped is None:
                raise CheckpointError(f"{layout.path}: tensor {name!r:.80} of {shard} is not in the index")
            if mapped != shard:
                raise CheckpointError(f"{layout.path}: the index puts tensor {name!r:.80} in {mapped}, "
                                      f"but {shard} holds it")
    for name, shard in layout.weight_map.items():
        if name not in seen:
            raise CheckpointError(f"{layout.path}: the index puts tensor {name!r:.80} in {shard}, "
                                  "which does not hold it")


def temporary_sibling(target: str) -> str:
    """A fresh, empty directory beside ``target`` to build the output in (renamed into place by
    :func:`replace_directory`)."""
    parent = os.path.dirname(os.path.abspath(target))
    base = os.path.basename(os.path.abspath(target))
    for _ in range(100):
        tmp = os.path.join(parent, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot write {target}: {os_reason(exc)}") from None
    raise OutputError(f"cannot write {target}: no unique temporary directory beside it")


def check_output_directory(target: str, force: bool, inputs: str | None = None) -> None:
    """Refuse an output directory that exists (unless ``force``) or that is, or lies inside, the
    input directory ``inputs`` (if any)."""
    if inputs is not None:
        out, src = os.path.realpath(target), os.path.realpath(inputs)
        if out == src or out.startswith(src + os.sep):
            raise OutputError(f"cannot write {target}: it is inside the input directory {inputs}")
    if os.path.lexists(target):
        if not force:
            raise OutputExistsError(f"output directory {target} already exists; use --force to replace it")
        if not os.path.isdir(target) or os.path.islink(target):
            raise OutputError(f"cannot write {target}: it exists and is not a directory")


@contextlib.contextmanager
def built_beside(target: str, force: bool) -> Iterator[str]:
    """A temporary directory beside ``target`` to build an output directory in: renamed to
    ``target`` when the block ends (:func:`replace_directory`), removed if it fails."""
    tmp = temporary_sibling(target)
    try:
        yield tmp
        replace_directory(tmp, target, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(tmp: str, target: str, force: bool) -> None:
    """Move the finished directory ``tmp`` to ``target``: one rename when ``target`` does not
    exist; with ``force``, the old one is moved aside first and removed after."""
    old = None
    try:
        if os.path.lexists(target):
            if not force:
                raise OutputExistsError(f"output directory {target} already exists; use --force to replace it")
            old = tmp + ".old"
            os.rename(target, old)
        os.rename(tmp, target)
    except OSError as exc:
        if old is not None and not os.path.lexists(target):
            os.rename(old, target)
        raise OutputError(f"cannot write {target}: {os_reason(exc)}") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_file(src: str, dst: str) -> None:
    """Copy a carried file byte for byte (and its mode and times)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        shutil.copy2(src, dst)
    except OSError as exc:
        raise OutputError(f"cannot copy {src} to {dst}: {os_reason(exc)}") from None


# --------------------------------------------------------------------------------------------------
# a whole directory as one checkpoint
# --------------------------------------------------------------------------------------------------

DIRECTORY_KIND = "directory"  # the Checkpoint.kind of a directory loaded whole
# A file carried as its bytes goes into the checkpoint's structure (a stream's deflated header):
# configs, tokenizers, RNG state and arguments are kilobytes to a few MB; more is no carried file
MAX_CARRIED_BYTES = 64 << 20
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)$")


def load_checkpoint_directory(path: str | os.PathLike) -> Checkpoint:
    """Every file of the directory ``path`` in one checkpoint (of kind :data:`DIRECTORY_KIND`), as
    a checkpoint series stores a training run's ``checkpoint-N/``.

    Its structure is ``{"files": {relative path: content}, "step": N}``: a safetensors file's
    content is ``{"safetensors": {name: tensor}, "metadata": ..., "header": ...}`` (its JSON header
    as spelled, so that it is written back byte for byte), a torch or ``.npz`` file's
    ``{"torch": object}`` or ``{"npz": object}`` as :func:`~.files.load_checkpoint` loads it, and
    any other file's ``{"bytes": ...}``: configs, indexes, and the torch files whose pickle
    weights-only loading refuses (the Trainer's ``training_args.bin`` and ``rng_state.pth``), which
    are never unpickled. ``step`` is the Trainer's ``global_step`` (``trainer_state.json``), else
    the N of a directory named ``checkpoint-N``, else absent.
    """
    path = os.fspath(path)
    files: dict[str, Any] = {}
    for rel in list_files(path):
        full = os.path.join(path, rel)
        kind = None if rel.endswith(INDEX_SUFFIX) else kind_from_suffix(rel)
        if kind == "safetensors":
            files[rel] = _safetensors_content(full)
            continue
        if kind is not None:
            try:
                files[rel] = {kind: unflatten(load_checkpoint(full, kind))}
                continue
            except PickleRefusedError:
                pass
        files[rel] = {"bytes": _read_at_most(full, MAX_CARRIED_BYTES, f"a file carried as it is may have "
                                             f"{MAX_CARRIED_BYTES:,} bytes at most (it is no checkpoint file "
                                             "this library reads)")}
    root: dict[str, Any] = {"files": files}
    step = _trainer_step(files.get("trainer_state.json"), path)
    if step is not None:
        root["step"] = step
    ckpt = flatten(root)
    ckpt.kind = DIRECTORY_KIND
    return ckpt


def _safetensors_content(full: str) -> dict[str, Any]:
    ckpt, header = load_safetensors(full)
    return {"safetensors": unflatten(ckpt), "metadata": ckpt.metadata, "header": header}


def _read_at_most(full: str, limit: int, too_large: str) -> bytes:
    """The bytes of the file ``full``; CheckpointError saying ``too_large`` beyond ``limit``."""
    try:
        with open(full, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise unreadable(full, exc) from None
    if len(data) > limit:
        raise CheckpointError(f"{full}: {too_large}")
    return data


def _trainer_step(state: Any, path: str) -> int | None:
    """The Trainer's ``global_step`` in ``trainer_state.json`` (carried as bytes), else the N of
    ``checkpoint-N``."""
    if isinstance(state, dict) and isinstance(state.get("bytes"), bytes):
        try:
            doc = json.loads(state["bytes"].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            doc = None
        step = doc.get("global_step") if isinstance(doc, dict) else None
        if type(step) is int and step >= 0:
            return step
    m = _CHECKPOINT_NAME.search(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def save_checkpoint_directory(ckpt: Checkpoint, path: str | os.PathLike, *, force: bool = False) -> None:
    """Write a checkpoint of :func:`load_checkpoint_directory`'s structure back as the directory
    ``path``: built beside it and renamed into place when complete (``force`` replaces an existing
    one). Files carried as bytes come back byte for byte, safetensors files with their header as it
    was (byte for byte where the tensors are too), torch and ``.npz`` files as their objects saved
    again. :class:`CheckpointError` for a checkpoint of another structure or an unsafe path."""
    path = os.fspath(path)
    files = directory_files(ckpt)
    check_output_directory(path, force)
    with built_beside(path, force) as tmp:
        for rel, content in files.items():
            full = os.path.join(tmp, rel)
            try:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "xb") as f:
                    _file_writer(rel, content)(f)
            except OSError as exc:
                raise OutputError(f"cannot write {os.path.join(path, rel)}: {os_reason(exc)}") from None


def directory_files(ckpt: Checkpoint) -> dict[str, dict[str, Any]]:
    """Relative path -> content of a checkpoint of :func:`load_checkpoint_directory`'s structure,
    every path checked to stay inside the directory."""
    root = unflatten(ckpt)
    files = root.get("files") if isinstance(root, dict) else None
    if ckpt.kind != DIRECTORY_KIND or not isinstance(files, dict):
        raise CheckpointError("the checkpoint is not a directory's (no files)")
    for rel, content in files.items():
        if not _safe_relative(rel):
            raise CheckpointError(f"a directory checkpoint names the file {rel!r:.80}, which is no relative path "
                                  "inside its directory")
        if not isinstance(content, dict) or len(set(content) & {"bytes", "safetensors", "torch", "npz"}) != 1:
            raise CheckpointError(f"a directory checkpoint's file {rel!r:.80} has no content of a known kind")
        if "bytes" in content and not isinstance(content["bytes"], bytes):
            raise CheckpointError(f"a directory checkpoint's file {rel!r:.80} carries no bytes")
    return files


def _safe_relative(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or "\x00" in rel or os.path.isabs(rel) or rel != os.path.normpath(rel):
        return False
    return not any(part in ("", ".", "..") for part in rel.split(os.sep))


def _file_writer(rel: str, content: dict[str, Any]):
    if "bytes" in content:
        return lambda f: f.write(content["bytes"])
    if "safetensors" in content:
        ckpt = flatten(content["safetensors"])
        metadata = content.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise CheckpointError(f"a directory checkpoint's file {rel!r:.80} has malformed metadata")
        ckpt.metadata = metadata
        header = content.get("header")
        return checkpoint_writer(ckpt, "safetensors", safetensors_header=header if isinstance(header, str) else None)
    kind = "torch" if "torch" in content else "npz"
    return checkpoint_writer(flatten(content[kind]), kind)
