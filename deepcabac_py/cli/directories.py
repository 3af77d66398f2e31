"""The commands on checkpoint directories: encode and decode a Hugging Face directory shard by shard,
and info, report and test on a directory of streams (per shard, then the totals)."""

from __future__ import annotations

import json
import os

import click

from deepcabac_py.model.report import build_report

from .common import echo_info, holds_lossless_floats, progress_bar, ratio_words


def encode_directory_command(src: str, dst: str, force: bool, threads, show_progress: bool, quiet: bool,
                             verbose: bool, settings: dict) -> None:
    from deepcabac_py.io.directories import scan_directory
    from deepcabac_py.io.kinds import kind_from_suffix
    from deepcabac_py.io.tensor_source import SafetensorsSource
    from deepcabac_py.model.files import encode_directory

    # The bar's total from the shards' headers (encode_directory checks the index); a torch shard
    # would have to be loaded to be counted, so with one the bar shows counts only.
    layout = scan_directory(src, check_index=False)
    total: int | None = None
    if all(kind_from_suffix(shard) == "safetensors" for shard in layout.shards):
        total = 0
        for shard in layout.shards:
            with SafetensorsSource(layout.full(shard)) as source:
                total += source.numel
    with progress_bar(total, "encode", show_progress, lossless=bool(settings.get("keep_exact"))) as update:
        result = encode_directory(src, dst, force=force, threads=threads, progress=update, **settings)
    for name, out, size_in, size_out in result.shards:
        echo_info(quiet, f"{os.path.join(src, name)}: {size_in:,} bytes -> {size_out:,} bytes "
                         f"({ratio_words(size_in / size_out if size_out else None)})"
                  + (f" -> {os.path.join(dst, out)}" if verbose else ""))
    size_in = sum(s[2] for s in result.shards)
    size_out = sum(s[3] for s in result.shards)
    echo_info(quiet, f"{src}: {len(result.shards)} shards, {size_in:,} bytes -> {size_out:,} bytes "
                     f"({ratio_words(size_in / size_out if size_out else None)}), "
                     f"{len(result.carried)} other files carried -> {dst}")


def decode_directory_command(src: str, dst: str, force: bool, threads, max_elements, show_progress: bool,
                             quiet: bool, verbose: bool) -> None:
    from deepcabac_py.model.container import read_header_file
    from deepcabac_py.model.files import decode_directory, stream_directory

    streams, _ = stream_directory(src)
    total, lossless = 0, False
    for rel in streams:
        header = read_header_file(os.path.join(src, rel))
        total += sum(e.numel for e in header.tensors if not e.is_alias)
        lossless = lossless or holds_lossless_floats(header.tensors)
    with progress_bar(total, "decode", show_progress, lossless=lossless) as update:
        result = decode_directory(src, dst, force=force, threads=threads, progress=update, max_elements=max_elements)
    for name, out, size_in, size_out in result.shards:
        echo_info(quiet, f"{os.path.join(src, name)}: {size_in:,} bytes -> {size_out:,} bytes"
                  + (f" -> {os.path.join(dst, out)}" if verbose else ""))
    echo_info(quiet, f"{src}: {len(result.shards)} streams decoded, {len(result.carried)} other files carried "
                     f"-> {dst}")


def directory_reports(src: str):
    """``(relative path, header, report)`` of every stream of a directory of streams."""
    from deepcabac_py.model.container import read_header_file
    from deepcabac_py.model.files import stream_directory

    streams, _ = stream_directory(src)
    out = []
    for rel in streams:
        header = read_header_file(os.path.join(src, rel))
        out.append((rel, header, build_report(header)))
    return out


def info_directory(src: str, as_json: bool) -> None:
    reports = directory_reports(src)
    params = sum(r.params for _, _, r in reports)
    stream_bytes = sum(h.total_size for _, h, _ in reports)
    original = sum(r.original_bytes or 0 for _, _, r in reports)
    if as_json:
        click.echo(json.dumps({"directory": src, "params": params, "stream_bytes": stream_bytes,
                               "original_bytes": original,
                               "shards": [{"file": rel, "format_version": h.version, "tensors": len(h.tensors),
                                           **{k: v for k, v in r.to_dict().items() if k in (
                                               "params", "stream_bytes", "original_bytes", "bits_per_param",
                                               "ratio_vs_original")}} for rel, h, r in reports]}, indent=1))
        return
    width = max(len(rel) for rel, _, _ in reports)
    click.echo(f"{src}: {len(reports)} streams, {params:,} params, {stream_bytes:,} bytes "
               f"({ratio_words(original / stream_bytes if stream_bytes else None)} than the original tensors)")
    for rel, h, r in reports:
        bits = f"{r.bits_per_param:6.3f} bits/param" if r.bits_per_param is not None else "no parameters"
        click.echo(f"  {rel:<{width}}  {len(h.tensors):5d} tensors  {r.params:>14,} params  "
                   f"{h.total_size:>14,} bytes  {bits}")


def report_directory(src: str, as_json: bool) -> None:
    reports = directory_reports(src)
    if as_json:
        click.echo(json.dumps({"directory": src, "shards": [{"file": rel, **r.to_dict()} for rel, _, r in reports]},
                              indent=1))
        return
    from deepcabac_py.model.report import format_report

    for rel, _, r in reports:
        click.echo(f"== {rel}")
        click.echo(format_report(r))
        click.echo("")
    info_directory(src, False)


def test_directory(src: str, threads) -> int:
    """Decode every stream of a directory and discard the result; returns the streams checked."""
    from deepcabac_py.model.decoder import iter_decoded
    from deepcabac_py.model.files import stream_directory

    streams, _ = stream_directory(src)
    for rel in streams:
        for _ in iter_decoded(os.path.join(src, rel), threads=threads, bits=True):
            pass
    return len(streams)
