"""An entry coded by the model coder (:func:`~deepcabac_py.model.encoder.code_model`) with the
series' settings: the whole entry, or some of its tensors alone as the entry will code them."""

from __future__ import annotations

from typing import Any

from ..io.checkpoint import Checkpoint
from ..model.decoder import read_stream_header
from ..model.encoder import CodedModel, CodedTensor, code_model
from ..model.settings import EncodeSettings, is_glob, matches


def decoded_alone(coded: Checkpoint, names: list[str], settings: dict[str, Any], overrides: dict[str, int],
                  done: dict[str, CodedTensor]) -> dict[str, Any]:
    """The tensors ``names`` of an entry as it will decode them: coded alone, with the settings that
    reach them (:func:`_settings_of_part`), so that the entry takes them as they were coded (into
    ``done``)."""
    # (under the entry's structure, which the moments' roles come from: a state keyed by parameter
    # name has no other way to say which tensor is a second moment)
    alone = Checkpoint({n: coded.tensors[n] for n in names}, coded.skeleton)
    result = code_entry(alone, _settings_of_part(names, settings, overrides), {})
    done.update(result.tensors)
    return result.decoded.tensors


def code_entry(ckpt: Checkpoint, settings: dict[str, Any], done: dict[str, CodedTensor]) -> CodedModel:
    """``ckpt`` coded with the series' ``settings`` (:func:`encode_model`'s keywords), the tensors of
    ``done`` as they were coded alone."""
    threads = settings.get("threads")
    fields = {k: v for k, v in settings.items() if k not in ("threads", "progress")}
    return code_model(ckpt, EncodeSettings(**fields), reuse=done, threads=threads)


def _settings_of_part(names: list[str], settings: dict[str, Any], overrides: dict[str, int]) -> dict[str, Any]:
    """The settings that code the tensors ``names`` of an entry alone as the entry codes them: the
    qp overrides and exact patterns that reach them (in their order: the first match wins), no
    importance or BatchNorm shifts (they name the weights and touch no moment)."""
    every = set(names)

    def reaching(patterns):
        return [p for p in patterns if p in every or (is_glob(p) and any(matches(n, [p]) for n in names))]

    qps = {**overrides, **(settings.get("qp_overrides") or {})}
    part = {**settings, "importance": None, "bias_correction": False,
            "qp_overrides": {p: qps[p] for p in reaching(qps)}}
    if not isinstance(settings.get("keep_exact", False), bool):
        part["keep_exact"] = reaching(exact_patterns(settings))
    return part


def exact_patterns(settings: dict[str, Any]) -> list[str]:
    """The names or patterns ``keep_exact`` gives (none for True or False: all or nothing)."""
    exact = settings.get("keep_exact", False)
    return [] if isinstance(exact, bool) else [exact] if isinstance(exact, str) else list(exact)


def quantized_qps(payload: bytes) -> dict[str, int]:
    """The qp of every quantized tensor of an entry's stream ``payload``, by name."""
    return {e.name: e.qp for e in read_stream_header(payload).tensors if e.mode.is_quantized}
