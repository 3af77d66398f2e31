"""Name-preserving .npz exchange between the project's interpreter and the NNCodec peer's.

Imported by both sides, so it may use only the standard library and numpy (the peer runs numpy<2).
Nothing is pickled: the peer's inputs and outputs are plain arrays, and `allow_pickle` stays off.

An npz member is a zip entry named ``<key>.npy``; tensor names with ``/`` or other unusual characters
would turn into directories or clash, so such names are stored under positional keys with a JSON name
map beside them (as a uint8 array, to stay pickle-free). Ordinary dotted PyTorch names are kept as is
so the files remain readable with a plain ``np.load``.
"""
from __future__ import annotations

import json
import re

import numpy as np

NAME_MAP_KEY = "__names__"
_SAFE = re.compile(r"[A-Za-z0-9_.\-]+\Z")


def save(path, arrays: dict) -> None:
    names = list(arrays)
    if all(_SAFE.match(n) and n != NAME_MAP_KEY for n in names):
        np.savez(path, **arrays)
        return
    keys = [f"t{i}" for i in range(len(names))]
    members = {k: arrays[n] for k, n in zip(keys, names)}
    members[NAME_MAP_KEY] = np.frombuffer(json.dumps(dict(zip(keys, names))).encode(), dtype=np.uint8)
    np.savez(path, **members)


def load(path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    raw = members.pop(NAME_MAP_KEY, None)
    if raw is None:
        return members
    mapping = json.loads(raw.tobytes().decode())
    return {mapping[k]: v for k, v in members.items()}
