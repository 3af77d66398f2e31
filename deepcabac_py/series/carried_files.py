"""Files a directory entry carries as bytes (configs, tokenizers, ``trainer_state.json``), coded
against the parent entry's file of the same path (series format version 6).

A Trainer writes the same tokenizer (up to 10 MB for today's LLMs) into every ``checkpoint-N/``, and
a ``trainer_state.json`` that only grows by its newest log lines. A residual entry keeps of such a
file only what differs from its parent's: the parent's first ``P`` and last ``S`` bytes are taken
as they are and the entry's stream holds the bytes between them. The record's meta names each such
file with ``[P, S, CRC-32 of the whole file]`` (docs/format.md, "Carried files").
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..errors import CorruptStreamError
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
        head = _common_prefix(data, before)
        tail = _common_prefix(data[head:][::-1], before[head:][::-1])
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
    files = _item(_root(skeleton), "files")
    listed = files.get("$dict") if isinstance(files, dict) else None
    out = {}
    for pair in listed if isinstance(listed, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
            node = _item(pair[1], "bytes")
            if isinstance(node, dict) and isinstance(node.get("$bytes"), str) and len(pair[1]["$dict"]) == 1:
                out[pair[0]] = node
    return out


def _root(skeleton: Any) -> Any:
    return skeleton.get("root") if isinstance(skeleton, dict) else None


def _item(node: Any, key: str) -> Any:
    """The value of ``key`` in a skeleton's ``$dict`` node, None without one."""
    items = node.get("$dict") if isinstance(node, dict) else None
    for pair in items if isinstance(items, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and pair[0] == key:
            return pair[1]
    return None


def _bytes_of(node: dict) -> bytes:
    try:
        return base64.b64decode(node["$bytes"], validate=True)
    except ValueError:
        raise CorruptStreamError("a carried file's bytes are not base64") from None


def _with_carried(skeleton: Any, data: dict[str, bytes]) -> Any:
    """A copy of ``skeleton`` whose carried files ``data`` names hold those bytes; only the
    containers on their way are copied."""
    def content(path: str, node: Any) -> Any:
        if path not in data:
            return node
        return {"$dict": [["bytes", {"$bytes": base64.b64encode(data[path]).decode("ascii")}]]}

    root = skeleton["root"]
    items = []
    for key, value in root["$dict"]:
        if key == "files":
            value = {"$dict": [[path, content(path, node)] for path, node in value["$dict"]]}
        items.append([key, value])
    return {**skeleton, "root": {**root, "$dict": items}}


def _common_prefix(a: bytes, b: bytes) -> int:
    """The bytes ``a`` and ``b`` begin with alike."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.frombuffer(a, np.uint8, n), np.frombuffer(b, np.uint8, n)
    step = 1 << 20  # (a mismatch is usually early: compare a megabyte at a time)
    for start in range(0, n, step):
        differ = np.flatnonzero(x[start:start + step] != y[start:start + step])
        if differ.size:
            return start + int(differ[0])
    return n
