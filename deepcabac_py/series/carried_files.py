"""Files a directory entry carries as bytes (configs, tokenizers, ``trainer_state.json``), coded
against the parent entry's file of the same path (series format version 6).

A Trainer writes the same tokenizer (megabytes for today's LLMs) into every ``checkpoint-N/``, and
a ``trainer_state.json`` that only grows by its newest log lines. A residual entry keeps of such a
file only what differs from its parent's: the parent's first ``P`` and last ``S`` bytes are taken
as they are and the entry's stream holds the bytes between them. The record's meta names each such
file with ``[P, S, CRC-32 of the whole file]`` (docs/format.md, "Carried files").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError, CorruptStreamError
from ..io.checkpoint import bytes_node, node_bytes, skeleton_entries, with_entries
from ..io.checksum import crc32

__all__ = ["referenced", "restored"]

# Shared bytes below this stay in the entry: the reference costs about as much meta
MIN_SHARED = 64


def referenced(skeleton: Any, parent: Any) -> tuple[Any, dict[str, list[int]]]:
    """(``skeleton`` with each carried file that shares at least :data:`MIN_SHARED` leading and
    trailing bytes with ``parent``'s file of its path cut to the bytes between them, and the meta
    that names them): both skeletons are of directory checkpoints. ``skeleton`` is not changed."""
    mine, theirs = _carried(skeleton), _carried(parent)
    refs: dict[str, list[int]] = {}
    cut: dict[str, bytes] = {}
    for path, node in mine.items():
        if path not in theirs:
            continue
        data, before = _bytes_of(node), _bytes_of(theirs[path])
        x, y = np.frombuffer(data, np.uint8), np.frombuffer(before, np.uint8)
        head = _common_prefix(x, y)
        tail = _common_prefix(x[head:][::-1], y[head:][::-1])  # (views: no copy of either file)
        if head + tail >= MIN_SHARED:
            refs[path] = [head, tail, crc32(data)]
            cut[path] = data[head:len(data) - tail]
    return (_with_carried(skeleton, cut) if cut else skeleton), refs


def restored(where: str, skeleton: Any, refs: Any, parent: Any) -> Any:
    """``skeleton`` with the files ``refs`` names (a residual's ``carried`` meta) made whole again
    from ``parent``'s (the parent entry's skeleton, itself restored); CorruptStreamError where the
    meta, the entry or its parent do not match."""
    if not isinstance(refs, dict):
        raise CorruptStreamError(f"{where}: malformed carried files")
    mine, theirs = _carried(skeleton), _carried(parent)
    whole: dict[str, bytes] = {}
    for path, ref in refs.items():
        if not (isinstance(ref, list) and len(ref) == 3 and all(type(v) is int and v >= 0 for v in ref)):
            raise CorruptStreamError(f"{where}: malformed carried file {path!r:.80}")
        if path not in mine or path not in theirs:
            raise CorruptStreamError(f"{where}: carried file {path!r:.80} is missing from the entry or its parent")
        head, tail, crc = ref
        before = _bytes_of(theirs[path])
        if head + tail > len(before):
            raise CorruptStreamError(f"{where}: carried file {path!r:.80} takes {head + tail:,} bytes of its "
                                     f"parent's {len(before):,}")
        data = before[:head] + _bytes_of(mine[path]) + before[len(before) - tail:]
        if crc32(data) != crc:
            raise CorruptStreamError(f"{where}: carried file {path!r:.80} does not match its checksum")
        whole[path] = data
    return _with_carried(skeleton, whole) if whole else skeleton


def _carried(skeleton: Any) -> dict[str, dict]:
    """Path -> the ``{"$bytes": ...}`` node of every file of a directory skeleton kept as its
    bytes (not a safetensors, torch or npz file read as tensors)."""
    root = skeleton.get("root") if isinstance(skeleton, dict) else None
    files = skeleton_entries((skeleton_entries(root) or {}).get("files")) or {}
    out = {}
    for path, content in files.items():
        entries = skeleton_entries(content)
        if isinstance(path, str) and entries is not None and list(entries) == ["bytes"] \
                and isinstance(entries["bytes"], dict) and isinstance(entries["bytes"].get("$bytes"), str):
            out[path] = entries["bytes"]
    return out


def _bytes_of(node: dict) -> bytes:
    try:
        return node_bytes(node)
    except CheckpointError:
        raise CorruptStreamError("a carried file's bytes are not base64") from None


def _with_carried(skeleton: Any, data: dict[str, bytes]) -> Any:
    """A copy of ``skeleton`` (one :func:`_carried` found files in) whose carried files ``data``
    names hold those bytes; only the containers on their way are copied."""
    root = skeleton["root"]
    files = with_entries((skeleton_entries(root) or {})["files"],
                         {path: {"$dict": [["bytes", bytes_node(b)]]} for path, b in data.items()})
    return {**skeleton, "root": with_entries(root, {"files": files})}


def _common_prefix(x: np.ndarray, y: np.ndarray) -> int:
    """The bytes the uint8 arrays ``x`` and ``y`` begin with alike."""
    n = min(x.shape[0], y.shape[0])
    x, y = x[:n], y[:n]
    step = 1 << 20  # (a mismatch is usually early: compare a megabyte at a time)
    for start in range(0, n, step):
        differ = np.flatnonzero(x[start:start + step] != y[start:start + step])
        if differ.size:
            return start + int(differ[0])
    return n
