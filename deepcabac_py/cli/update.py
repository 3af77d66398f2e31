"""``deepcabac update``: sparse update messages between a base model and a new one.

    deepcabac update encode --base base.pt new.pt -o round7.dcu --density 0.01
    deepcabac update apply base.pt round7.dcu -o new.pt
    deepcabac info round7.dcu          # header: round, parent, tensors, nonzeros (no decoding)
    deepcabac report round7.dcu        # bits per nonzero, ratio vs dense fp32 and vs the Golomb code

Messages written here stand alone (no session: fresh contexts, a tensor table in the header); a
file may hold several messages (a stream of rounds), ``info`` lists them all.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

from deepcabac_py.errors import InputError
from deepcabac_py.io.kinds import UPDATE_MAGIC

from .common import Input, about, check_output, write_output

UPDATE_SUFFIX = ".dcu"


def is_update_file(head: bytes) -> bool:
    return head[:4] == UPDATE_MAGIC[:4]


@click.group("update", context_settings={"help_option_names": ["-h", "--help"]})
def update_group():
    """Encode and apply sparse weight updates (STC/SBC/top-k levels, coded against the parent)."""


@update_group.command("encode")
@click.argument("new", metavar="NEW", type=click.Path(dir_okay=False))
@click.option("--base", "base", required=True, type=click.Path(dir_okay=False), help="The parent model.")
@click.option("-o", "--output", type=click.Path(allow_dash=True, dir_okay=False),
              help=f"Output message (default: NEW{UPDATE_SUFFIX}).")
@click.option("--density", type=click.FloatRange(0, 1, min_open=True), default=0.01, show_default=True,
              help="Fraction of each tensor's elements sent.")
@click.option("--method", type=click.Choice(["stc", "sbc", "topk"]), default="stc", show_default=True,
              help="stc: ternary, sbc: binary (one sign), topk: kept values on a uniform grid.")
@click.option("--value-levels", type=click.IntRange(1, 1 << 20), default=7, show_default=True,
              help="Grid size of --method topk.")
@click.option("--rows", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Structured: keep only this fraction of the strongest rows (output channels) first.")
@click.option("--coder", type=click.Choice(["cabac", "golomb"]), default="cabac", show_default=True,
              help="cabac: ours; golomb: the STC/SBC papers' position code (ternary levels only).")
@click.option("--round", "round_index", type=click.IntRange(min=0), default=None, help="Round index of this update.")
@click.option("--parent-round", type=click.IntRange(min=0), default=None, help="Round index of the base.")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def encode_cmd(new, base, output, density, method, value_levels, rows, coder, round_index, parent_round, force, quiet):
    """Sparsify NEW - BASE and write it as one update message."""
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.updates.messages import encode_update

    output = output or new + UPDATE_SUFFIX
    check_output(output, force)
    with about(base), Input(base) as inp, inp.checkpoint_path(None) as path:
        b = load_checkpoint(path)
    with about(new):
        with Input(new) as inp, inp.checkpoint_path(None) as path:
            n = load_checkpoint(path)
        try:
            data = encode_update(n, b, density=density, method=method, value_levels=value_levels, rows=rows,
                                 coder=coder, round_index=round_index, parent_round=parent_round)
        except (ValueError, TypeError) as exc:
            raise InputError(str(exc)) from None
    write_output(output, data, force)
    if not quiet:
        rep = update_report_dict(data)
        click.echo(f"{new}: update of {rep['nnz']:,} nonzeros in {len(data):,} bytes, "
                   f"{rep['bits_per_nonzero']:.3f} bits/nonzero (payload), x{rep['ratio_vs_fp32']:,.0f} vs dense fp32"
                   + (f", {rep['ratio_vs_golomb']:.3f} of Golomb" if rep.get("ratio_vs_golomb") else ""), err=True)


@update_group.command("apply")
@click.argument("base", metavar="BASE", type=click.Path(dir_okay=False))
@click.argument("update", metavar="UPDATE", type=click.Path(allow_dash=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(allow_dash=True, dir_okay=False),
              help="The new model (kind from the suffix, else the base's).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def apply_cmd(base, update, output, force, quiet):
    """Apply UPDATE (every message in it, in order) to BASE; refuses a base that is not the parent."""
    from deepcabac_py.io.checkpoint import Checkpoint
    from deepcabac_py.io.files import checkpoint_writer, kind_from_suffix, load_checkpoint
    from deepcabac_py.updates.messages import iter_messages

    check_output(output, force)
    with about(base), Input(base) as inp, inp.checkpoint_path(None) as path:
        ckpt = load_checkpoint(path)
    tensors = ckpt.tensors
    with about(update), Input(update) as inp:
        tensors, count = apply_messages(tensors, iter_messages(inp))
        if not count:
            raise InputError("the update file holds no message")
    out = Checkpoint(tensors=tensors, skeleton=ckpt.skeleton, kind=ckpt.kind, metadata=ckpt.metadata,
                     aliases=ckpt.aliases)
    kind = (kind_from_suffix(output) if output != "-" else None) or (ckpt.kind if ckpt.kind in ("torch", "safetensors",
                                                                                                 "npz") else "torch")
    write_output(output, checkpoint_writer(out, kind), force)
    if not quiet:
        click.echo(f"{update}: {count} update(s) applied to {base} -> {output}", err=True)


def update_report_dict(message: bytes) -> dict:
    """Sizes and ratios of one message; decodes it when it stands alone (tensor table, no session)."""
    from deepcabac_py.updates import golomb
    from deepcabac_py.updates.message_format import UpdateCoder, read_update_header
    from deepcabac_py.updates.messages import decode_update

    h = read_update_header(message)
    rep: dict[str, Any] = {"round": h.round, "parent_round": h.parent_round, "parent_sha256": h.parent_hash.hex(),
           "session_id": h.session_id, "session_seq": h.session_seq, "coder": h.coder.name.lower(),
           "bytes": h.total_size, "header_bytes": h.header_size + 4, "payload_bytes": h.payload_size, "nnz": h.nnz,
           "bits_per_nonzero": 8 * h.payload_size / h.nnz if h.nnz else 0.0,
           "bits_per_nonzero_total": 8 * h.total_size / h.nnz if h.nnz else 0.0, "tensors": []}
    if h.table is not None:
        dense = sum(32 * (math.prod(shape)) for _, dtype, shape in h.table if dtype.startswith("float"))
        rep["ratio_vs_fp32"] = dense / (8 * h.total_size) if h.total_size else 0.0
    if h.table is not None and h.session_id == 0:
        upd = decode_update(message)
        gbits = 0
        ternary = True
        for e in h.entries:
            t = upd.tensors[e.name if e.name is not None else h.table[e.index][0]]
            levels = t.levels if hasattr(t, "levels") else t
            if e.maxabs != 1:
                ternary = False
            else:
                gbits += golomb.stc_bits(levels, sign_bits=e.sign_mode == 0, step_bits=0)
            rep["tensors"].append({"name": e.name, "method": e.method.name.lower(), "nnz": e.nnz,
                                   "step": e.step, "numel": int(levels.size)})
        if ternary and gbits:
            rep["golomb_payload_bits"] = gbits
            rep["ratio_vs_golomb"] = 8 * h.payload_size / gbits if h.coder == UpdateCoder.CABAC else 1.0
    else:
        for e in h.entries:
            rep["tensors"].append({"name": e.name, "index": e.index, "method": e.method.name.lower(), "nnz": e.nnz,
                                   "step": e.step})
    return rep


def info_update(inp: Input, as_json: bool) -> None:
    """``deepcabac info`` on an update file: every message's header."""
    from deepcabac_py.updates.message_format import read_update_header
    from deepcabac_py.updates.messages import iter_messages

    messages = list(iter_messages(inp))
    headers = [read_update_header(m) for m in messages]
    total = sum(len(m) for m in messages)
    if as_json:
        out = []
        for h in headers:
            out.append({"format_version": h.version, "round": h.round, "parent_round": h.parent_round,
                        "parent_sha256": h.parent_hash.hex(), "session_id": h.session_id,
                        "session_seq": h.session_seq, "coder": h.coder.name.lower(), "bytes": h.total_size,
                        "nnz": h.nnz, "tensors": [{"name": e.name, "index": e.index, "method": e.method.name.lower(),
                                                   "nnz": e.nnz, "step": e.step, "maxabs": e.maxabs}
                                                  for e in h.entries]})
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"deepcabac update stream: {total:,} bytes, {len(headers)} message(s)")
    for h in headers:
        click.echo(f"round {h.round} (parent round {h.parent_round}, parent SHA-256 {h.parent_hash.hex()[:16]}...), "
                   f"{h.coder.name.lower()} coder, {h.total_size:,} bytes, {h.nnz:,} nonzeros"
                   + (f", session {h.session_id} message {h.session_seq}" if h.session_id else ""))
        click.echo(f"  {'tensor':<32} {'method':>7} {'nnz':>9} {'step':>12}")
        for e in h.entries:
            name = e.name if e.name is not None else f"#{e.index}"
            click.echo(f"  {name:<32} {e.method.name.lower():>7} {e.nnz:>9,} {e.step:>12.6g}")


def report_update(inp: Input, as_json: bool) -> None:
    """``deepcabac report`` on an update file: bits per nonzero, ratios vs dense fp32 and Golomb."""
    from deepcabac_py.updates.messages import iter_messages

    reps = [update_report_dict(m) for m in iter_messages(inp)]
    if as_json:
        click.echo(json.dumps(reps, indent=1))
        return
    click.echo(f"{'round':>6} {'bytes':>9} {'nnz':>9} {'bits/nz':>8} {'bits/nz all':>11} {'vs fp32':>10} "
               f"{'vs Golomb':>10}")
    for r in reps:
        fp = f"x{r['ratio_vs_fp32']:,.0f}" if r.get("ratio_vs_fp32") else "-"
        gb = f"{r['ratio_vs_golomb']:.3f}" if r.get("ratio_vs_golomb") else "-"
        click.echo(f"{r['round']:>6} {r['bytes']:>9,} {r['nnz']:>9,} {r['bits_per_nonzero']:>8.3f} "
                   f"{r['bits_per_nonzero_total']:>11.3f} {fp:>10} {gb:>10}")
    click.echo("bits/nz: payload bits per nonzero; all: with the header; vs fp32: dense float32 size / message size; "
               "vs Golomb: payload / (Golomb positions + sign bits) for the same levels.")


def _receiver_session(sessions: dict, header):
    """The session a receiver keeps for the message's session id (None for a sessionless one)."""
    from deepcabac_py.updates.sessions import UpdateSession

    if not header.session_id:
        return None
    return sessions.setdefault(header.session_id, UpdateSession(header.session_id))


def apply_messages(tensors, messages):
    """Apply update messages in order, following their sessions as a receiver would; returns the
    model and the number of messages."""
    from deepcabac_py.updates.message_format import read_update_header
    from deepcabac_py.updates.messages import apply_update

    sessions: dict = {}
    count = 0
    for msg in messages:
        tensors = apply_update(tensors, msg, session=_receiver_session(sessions, read_update_header(msg)))
        count += 1
    return tensors, count


def test_update_file(inp: Input, base_path: str | None = None) -> str:
    """Check every message of an update file; returns a one-line summary.

    With the base model, the messages are applied in order (parents checked, sessions followed).
    Without it, messages that carry their tensor table are decoded in full; the others need the base
    for their shapes, so only their header and payload checksums are checked.
    """
    from deepcabac_py.io.files import load_checkpoint
    from deepcabac_py.updates.message_format import read_update_header
    from deepcabac_py.updates.messages import checked_payload, decode_update, iter_messages

    if base_path is not None:
        with about(base_path):
            tensors = load_checkpoint(base_path).tensors
        _, count = apply_messages(tensors, iter_messages(inp))
        return f"{count} update message(s) applied to {base_path}"
    sessions: dict = {}
    decoded = checked = 0
    for msg in iter_messages(inp):
        header = read_update_header(msg)
        if header.table is not None:
            decode_update(msg, None, session=_receiver_session(sessions, header))
            decoded += 1
        else:
            checked_payload(msg, header)
            checked += 1
    parts = [f"{decoded + checked} update message(s)"]
    if checked:
        parts.append(f"{checked} checked by checksum only (no tensor table: decode them with --base)")
    return ", ".join(parts)


__all__ = ["update_group", "info_update", "is_update_file", "report_update", "test_update_file"]
