"""A corpus of damaged and hostile inputs for every command of the CLI.

    .venv/bin/python tests/damaged_inputs.py OUT_DIR      # writes the corpus (tests build it in a tmp dir)

Each file is one kind of damage a user or an attacker hands the CLI: empty, text, zeros, a stream
truncated or with a flipped byte, a header that claims what it does not hold, an update message
that lies about its payload, checkpoints whose contents lie. Every command must refuse each with
exit status 1 (2 for a usage error), one line on stderr, no traceback and no output left behind.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

import deepcabac_py as dc
from deepcabac_py.model.container import MAGIC, PREAMBLE

SUFFIXES = (".dcb", ".dcu", ".pt", ".safetensors", ".npz")


def _with_body(body: bytes, raw_size: int | None = None) -> bytes:
    packed = struct.pack("<I", len(body) if raw_size is None else raw_size) + zlib.compress(body, 9)
    head = PREAMBLE.pack(MAGIC, 3, 0, len(packed) + 4) + packed
    return head + struct.pack("<I", zlib.crc32(head))


def corpus() -> dict[str, bytes]:
    """File name -> content."""
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((40, 30)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}
    stream = dc.encode_model(model)
    header = dc.read_stream_header(stream)
    message = dc.encode_update({"w": model["w"] + 0.1, "b": model["b"]}, model, density=0.1)
    out: dict[str, bytes] = {}
    for suffix in SUFFIXES:
        out[f"empty{suffix}"] = b""
        out[f"text{suffix}"] = b"this is not what the name says\n" * 4
        out[f"zeros{suffix}"] = bytes(4096)
    out["truncated.dcb"] = stream[: len(stream) // 2]
    out["header-only.dcb"] = stream[: header.header_size]
    flipped = bytearray(stream)
    flipped[header.header_size + 3] ^= 0x40  # a payload byte: its checksum no longer matches
    out["payload-flipped.dcb"] = bytes(flipped)
    flipped = bytearray(stream)
    flipped[20] ^= 0x01  # a header byte: the header checksum no longer matches
    out["header-flipped.dcb"] = bytes(flipped)
    settings = struct.pack("<IhhBB", 0, -32, -56, 2, 0)
    deep = b"[" * 2000 + b"]" * 2000
    out["deep-metadata.dcb"] = _with_body(settings + struct.pack("<I", len(deep)) + deep)
    out["inflating-body.dcb"] = _with_body(settings + struct.pack("<I", 2) + b"{}", raw_size=400 << 20)
    out["truncated.dcu"] = message[: len(message) - 7]
    out["trailing-junk.dcu"] = message + b"\x89DCU junk"
    st_header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    out["lying-offsets.safetensors"] = struct.pack("<Q", len(st_header)) + st_header + bytes(16)
    out["lying-length.safetensors"] = struct.pack("<Q", 1 << 40) + b"{}"
    return out


def expand_checkpoint(path: Path) -> None:
    """A .pt of 1.5 KB that holds a 1 GiB view (stride 0)."""
    torch.save({"w": torch.zeros(1).expand(1 << 28)}, path)


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in corpus().items():
        (directory / name).write_bytes(data)
        paths.append(directory / name)
    expand_checkpoint(directory / "expand.pt")
    paths.append(directory / "expand.pt")
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1])):
        print(p)
