"""Update streams: sparse weight updates coded against their parent model.

One *message* carries the update of one round: which model it applies to (the parent's round index
and the SHA-256 of its state, checked by :func:`apply_update`), which coding session it continues,
and the sparse levels and step of every tensor that changed. Messages are self-delimiting, so a
stream of rounds is simply the messages one after the other, in a file or on a socket
(:class:`UpdateStreamWriter`, :func:`iter_messages`).

    data = encode_update(new, base, density=0.01)           # bytes (STC levels, our coder)
    new2 = apply_update(base, data)                          # refuses a base with another hash
    upd = decode_update(data, base)                          # levels, steps, header

A :class:`UpdateSession` holds what both ends learned from earlier messages of the same stream:
the adaptive contexts of every tensor, the co-located levels of the previous update (temporal
context) and per position how often and how long ago it was nonzero, with its last sign (history).
The encoder and the decoder each keep one; a message names the session and its position in it, and
decoding refuses a session that is not at that position. ``docs/format.md`` ("Update streams") is
the byte-level description.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..entropy.levelcoder import LEVEL_MAX
from ..errors import (
    CorruptStreamError,
    DeepCabacWarning,
    LimitExceededError,
    UpdateMismatchError,
)
from ..io.checksum import crc32
from ..io.inputs import read_exactly
from . import _update_kernels, golomb
from .message_format import (
    DEFAULT_FEATURES,
    FLOATS,
    INTS,
    PREAMBLE,
    SESSION_FEATURES,
    Method,
    SignMode,
    UpdateCoder,
    UpdateEntry,
    UpdateHeader,
    check_method_dtype,
    check_update_preamble,
    read_update_header,
    write_message,
)
from .parent_model import (
    ParentTensor,
    flat_model,
    hash_flat,
    rows_cols,
)
from .sessions import (
    UpdateSession,
    fresh_ctx,
)
from .sparsify import ErrorFeedback, SparseTensor, reconstruct, sparsify

# --------------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------------


def _tinfo_and_arrays(items, session: UpdateSession | None):
    """items: list of (name, levels int32 flat, rows, cols, nnz, maxabs, sign_mode, features)."""
    total = sum(it[2] * it[3] for it in items)
    tinfo = np.zeros((len(items), 9), dtype=np.int64)
    levels = np.empty(total, dtype=np.int32)
    parent = np.zeros(total, dtype=np.int8)
    hist = np.zeros(total, dtype=np.uint16)
    ctx = np.empty((len(items) * _update_kernels.N_CTX_U, _update_kernels.CTX_COLS), dtype=np.int64)
    off = 0
    for t, (name, flat, rows, cols, nnz, maxabs, sign_mode, features) in enumerate(items):
        tinfo[t] = (off, rows, cols, nnz, maxabs, sign_mode, features, t * _update_kernels.N_CTX_U,
                    _update_kernels.rate_for(nnz, rows * cols))
        if flat is not None:
            levels[off:off + flat.size] = flat
        c0 = t * _update_kernels.N_CTX_U
        if session is not None:
            st = session._state(name, rows * cols)
            parent[off:off + rows * cols] = st.parent
            hist[off:off + rows * cols] = st.hist
            ctx[c0:c0 + _update_kernels.N_CTX_U] = st.ctx
        else:
            ctx[c0:c0 + _update_kernels.N_CTX_U] = fresh_ctx()
        off += rows * cols
    return tinfo, levels, parent, hist, ctx


def _cabac_encode(items, session) -> tuple[bytes, dict[str, np.ndarray]]:
    tinfo, levels, parent, hist, ctx = _tinfo_and_arrays(items, session)
    capacity = int(tinfo[:, 3].sum()) * 16 + levels.size // 4 + 64
    while True:
        out = np.empty(capacity, dtype=np.uint8)
        size = _update_kernels.encode_update_kernel(levels, tinfo, parent, hist, ctx, out)
        if size >= 0:
            break
        capacity *= 4
    n_ctx = _update_kernels.N_CTX_U
    ctx_by_name = {it[0]: ctx[t * n_ctx:(t + 1) * n_ctx].copy() for t, it in enumerate(items)}
    return out[1:size].tobytes(), ctx_by_name


def _golomb_encode(items) -> bytes:
    return golomb.encode_tensors([(flat, sign_mode == SignMode.CODED) for _, flat, _, _, _, _, sign_mode, _ in items])


def encode_sparse(
    sparse: Mapping[str, SparseTensor | np.ndarray],
    base,
    *,
    round_index: int | None = None,
    parent_round: int | None = None,
    session: UpdateSession | None = None,
    coder: str = "cabac",
    features: int | None = None,
    table: bool | None = None,
    parent_hash: bytes | None = None,
    compact: bool = True,
) -> bytes:
    """Code already-sparsified levels as one update message against ``base``.

    ``sparse`` maps tensor names of ``base`` to :class:`SparseTensor` (float tensors) or to integer
    arrays (exact differences of integer tensors). Tensors that are missing or all zero are not
    sent. ``session`` continues a stream (contexts, temporal levels, history) and is advanced;
    without one the message stands alone. ``table`` (default: on without a session) lists the
    parent's tensor names and shapes in the header, so the message can be inspected without the
    base; with a session the base supplies them and the header stays small. ``compact`` (default)
    writes update format 3 (``docs/format.md``, U2); ``False`` writes formats 1/2 for older readers.
    """
    flat_base = flat_model(base)
    ph = hash_flat(flat_base) if parent_hash is None else parent_hash
    return _encode(sparse, flat_base, ph, round_index=round_index, parent_round=parent_round, session=session,
                   coder=coder, features=features, table=table, compact=compact)


def _encode(sparse, flat_base, parent_hash, *, round_index, parent_round, session, coder, features, table,
            compact=True) -> bytes:
    try:
        coder_code = {"cabac": UpdateCoder.CABAC, "golomb": UpdateCoder.GOLOMB}[coder]
    except KeyError:
        raise ValueError(f"coder must be 'cabac' or 'golomb', got {coder!r}") from None
    if features is None:
        features = DEFAULT_FEATURES
    if not (isinstance(features, int) and 0 <= features <= _update_kernels.F_ALL):
        raise ValueError(f"features must be a bit set in [0, {_update_kernels.F_ALL}], got {features!r}")
    if coder_code == UpdateCoder.GOLOMB:
        features = 0
    if session is not None and not isinstance(session, UpdateSession):
        raise TypeError("session must be an UpdateSession")
    seq = session.seq if session is not None else 0
    parent_round = (seq if session is not None else 0) if parent_round is None else parent_round
    round_index = parent_round + 1 if round_index is None else round_index
    for v, what in ((round_index, "round_index"), (parent_round, "parent_round")):
        if not (isinstance(v, int) and v >= 0):
            raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    names = list(flat_base)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in sparse if n not in index]
    if unknown:
        raise ValueError(f"update names tensors the base does not have: {unknown[:5]}")
    items, entries, coded = [], [], {}
    for name in names:
        if name not in sparse:
            continue
        t = flat_base[name]
        s = sparse[name]
        if isinstance(s, SparseTensor):
            if t.dtype not in FLOATS:
                raise ValueError(f"{name}: a {t.dtype} tensor takes an integer difference, not a SparseTensor")
            levels, step, method = np.asarray(s.levels), float(np.float32(s.step)), Method[s.method.upper()]
        else:
            if t.dtype not in INTS:
                raise ValueError(f"{name}: a {t.dtype} tensor needs a SparseTensor")
            levels, step, method = np.asarray(s), 0.0, Method.INTEGER
        if levels.shape != t.array.shape:
            raise ValueError(f"{name}: levels of shape {levels.shape}, the base tensor has {t.array.shape}")
        if levels.dtype.kind not in "iu":
            raise ValueError(f"{name}: levels must be integers")
        flat = np.ascontiguousarray(levels.reshape(-1)).astype(np.int64)
        nz = np.flatnonzero(flat)
        if nz.size == 0:
            continue
        if method != Method.INTEGER and (not np.isfinite(step) or step <= 0):
            raise ValueError(f"{name}: step must be positive and finite, got {step}")
        lo, hi = int(flat[nz].min()), int(flat[nz].max())
        maxabs = max(-lo, hi)
        if maxabs > LEVEL_MAX:
            raise ValueError(f"{name}: levels must lie in [-(2**31 - 1), 2**31 - 1]")
        if method in (Method.STC, Method.SBC) and maxabs != 1:
            raise ValueError(f"{name}: {method.name} levels must be in {{-1, 0, 1}}")
        sign_mode = SignMode.ALL_POSITIVE if lo > 0 else SignMode.ALL_NEGATIVE if hi < 0 else SignMode.CODED
        if method == Method.SBC and sign_mode == SignMode.CODED:
            raise ValueError(f"{name}: SBC levels must all have one sign")
        if method == Method.STC:
            sign_mode = SignMode.CODED  # STC always sends signs (the receiver cannot know the side)
        if coder_code == UpdateCoder.GOLOMB and maxabs != 1:
            raise ValueError(f"{name}: the Golomb coder carries levels in {{-1, 0, 1}} only (use coder='cabac')")
        rows, cols = rows_cols(t.array.shape)
        f = features if session is not None else features & ~SESSION_FEATURES
        items.append((name, flat.astype(np.int32), rows, cols, int(nz.size), maxabs, int(sign_mode), f))
        entries.append(UpdateEntry(index[name], method, step, int(nz.size), maxabs, sign_mode, f, name))
        coded[name] = flat.astype(np.int32)
    if coder_code == UpdateCoder.CABAC:
        payload, ctx = _cabac_encode(items, session) if items else (b"", {})
    else:
        payload, ctx = (_golomb_encode(items) if items else b""), {}
    if table is None:
        table = session is None
    tab = [(n, flat_base[n].dtype, tuple(int(d) for d in flat_base[n].array.shape)) for n in names] if table else None
    data = write_message(round_index=round_index, parent_round=parent_round, parent_hash=parent_hash,
                          session_id=session.session_id if session is not None else 0, session_seq=seq,
                          coder=coder_code, tensor_total=len(names), table=tab, entries=entries, payload=payload,
                          compact=compact)
    if session is not None:
        session._advance(coded, ctx)
    return data


def update_difference(new, base) -> dict[str, np.ndarray]:
    """``new - base`` per tensor: float64 for float tensors, int64 for integer tensors (others must
    be equal)."""
    fn, fb = flat_model(new), flat_model(base)
    if list(fn) != list(fb):
        missing = sorted(set(fb) ^ set(fn))
        raise ValueError(f"new and base hold different tensors: {missing[:5]}")
    out = {}
    for name, t in fn.items():
        b = fb[name]
        if t.dtype != b.dtype or t.array.shape != b.array.shape:
            raise ValueError(f"{name}: {t.dtype}{list(t.array.shape)} vs base {b.dtype}{list(b.array.shape)}")
        if t.dtype in FLOATS:
            # (arithmetic on 0-d arrays gives numpy scalars: keep them arrays)
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.asarray(t.array.astype(np.float64) - b.array.astype(np.float64))
            bad = ~np.isfinite(d)
            if bad.any():
                warnings.warn(f"{name}: {int(bad.sum()):,} values of the update are NaN or infinite; they are "
                              "not sent (taken as no change)", DeepCabacWarning, stacklevel=3)
                d[bad] = 0.0
            out[name] = d
        elif t.dtype in INTS:
            out[name] = np.asarray(t.array.astype(np.int64) - b.array.astype(np.int64))
        elif not np.array_equal(t.array, b.array):
            raise ValueError(f"{name}: {t.dtype} tensors cannot be updated (they must not change)")
    return out


def encode_update(
    new,
    base,
    *,
    density: float = 0.01,
    method: str = "stc",
    coder: str = "cabac",
    rows: float | None = None,
    value_levels: int = 7,
    feedback: ErrorFeedback | None = None,
    session: UpdateSession | None = None,
    round_index: int | None = None,
    parent_round: int | None = None,
    features: int | None = None,
    table: bool | None = None,
    compact: bool = True,
) -> bytes:
    """Sparsify ``new - base`` and code it as one update message.

    Parameters
    ----------
    new, base : mapping of str to tensor, or Checkpoint
        The model after and before the round (same names, dtypes and shapes).
    density : float
        Fraction of each tensor's elements sent, in (0, 1].
    method : {"stc", "sbc", "topk"}
        Sparse ternary (signs and one magnitude per tensor), sparse binary (one side), or the
        kept values on a uniform grid of ``value_levels`` steps.
    coder : {"cabac", "golomb"}
        Our arithmetic coder, or the STC/SBC papers' position code (ternary levels only).
    rows : float or None
        Keep only this fraction of the strongest rows (output channels) first.
    value_levels : int
        Grid size of ``"topk"``.
    feedback : ErrorFeedback or None
        Add the residual of earlier rounds before sparsifying, and store the new one.
    session : UpdateSession or None
        Continue a stream (contexts, temporal levels, history); it is advanced.
    round_index, parent_round : int or None
        The rounds of this update and of ``base``.
    features, table, compact
        As for :func:`encode_sparse`.

    Returns
    -------
    bytes
        One message. Integer tensors are sent exactly.
    """
    flat_base = flat_model(base)
    diff = update_difference(new, flat_base)
    floats = {n: d for n, d in diff.items() if flat_base[n].dtype in FLOATS}

    def compress(name: str, acc: np.ndarray) -> SparseTensor:
        return sparsify(acc, method, density, rows=rows, value_levels=value_levels)

    if feedback is not None:
        sent = feedback.step(floats, compress)
    else:
        sent = {n: compress(n, d) for n, d in floats.items()}
    sparse: dict[str, Any] = dict(sent)
    sparse.update({n: d for n, d in diff.items() if flat_base[n].dtype in INTS})
    if features is None and rows is not None:
        features = DEFAULT_FEATURES | _update_kernels.F_ROWSKIP
    return _encode(sparse, flat_base, hash_flat(flat_base), round_index=round_index, parent_round=parent_round,
                   session=session, coder=coder, features=features, table=table, compact=compact)


# --------------------------------------------------------------------------------------------------
# decode and apply
# --------------------------------------------------------------------------------------------------


@dataclass
class Update:
    """A decoded update message: the header and the levels and step of every coded tensor."""

    header: UpdateHeader
    tensors: dict[str, SparseTensor | np.ndarray] = field(default_factory=dict)

    def delta(self) -> dict[str, np.ndarray]:
        """The dense update per coded tensor (float32 for float tensors, int64 differences otherwise)."""
        return {n: (t.values() if isinstance(t, SparseTensor) else t.astype(np.int64)) for n, t in self.tensors.items()}


def _shapes(header: UpdateHeader, flat_base: dict[str, ParentTensor] | None) -> list[tuple[str, str, tuple[int, ...]]]:
    base_table = None
    if flat_base is not None:
        base_table = [(n, t.dtype, tuple(int(d) for d in t.array.shape)) for n, t in flat_base.items()]
        if len(base_table) != header.tensor_total:
            raise UpdateMismatchError(f"the update is for a model of {header.tensor_total} tensors, the base has "
                                      f"{len(base_table)}")
        if header.table is not None and header.table != base_table:
            raise UpdateMismatchError("the update's tensor table does not match the base model")
        return base_table
    if header.table is None:
        raise ValueError("this update lists no tensor table: pass the base model to decode it")
    return header.table


# Without the base model, the shapes come from the message's own tensor table, and a sparse update
# of a huge tensor is legitimately tiny: the payload cannot bound the allocation, so a limit does.
DEFAULT_MAX_ELEMENTS = 1 << 28  # 1 GiB of int32 levels


def checked_payload(data, header: UpdateHeader) -> memoryview:
    """The payload of the message at the start of ``data`` (whose header is ``header``), after
    checking its CRC: this and :func:`read_update_header` verify a message without decoding it."""
    view = memoryview(data)  # read_update_header has checked that it holds the whole message
    end = header.header_size + header.payload_size
    (crc,) = struct.unpack("<I", bytes(view[end:header.total_size]))
    if crc32(view[header.header_size:end]) != crc:
        raise CorruptStreamError("update payload checksum mismatch (the update is damaged)")
    return view[header.header_size:end]


def decode_update(data, base=None, *, session: UpdateSession | None = None, check_parent: bool = True,
                  max_elements: int = DEFAULT_MAX_ELEMENTS) -> Update:
    """Decode one update message (the first in ``data``) without applying it.

    Parameters
    ----------
    data : bytes-like
        The message.
    base : mapping of str to tensor, Checkpoint or None
        The parent model: it supplies names and shapes when the message has no tensor table, and
        is checked against the message's parent hash (``UpdateMismatchError`` if it differs).
    session : UpdateSession or None
        A message that continues a session needs it, at the message's position; it is advanced.
    check_parent : bool
        Check ``base`` against the parent hash.
    max_elements : int
        Without ``base``, the tensors the message codes may hold at most this many elements in
        all (their shapes come from the message itself).

    Returns
    -------
    Update
        The header and every coded tensor's levels and step.
    """
    header = read_update_header(data)
    flat_base = flat_model(base) if base is not None else None
    if flat_base is None and header.table is not None:
        claimed = 0
        for e in header.entries:
            if 0 <= e.index < len(header.table):
                rows, cols = rows_cols(header.table[e.index][2])
                claimed += rows * cols
        if claimed > max_elements:
            raise LimitExceededError(
                f"the update's own tensor table claims {claimed:,} elements, more than max_elements="
                f"{max_elements:,}: pass the base model (or a larger max_elements) to decode it")
    if flat_base is not None and check_parent:
        h = hash_flat(flat_base)
        if not header.parent_matches(h):
            raise UpdateMismatchError(
                f"wrong parent: the update (round {header.round}) applies to the model of round {header.parent_round} "
                f"with SHA-256 {header.parent_hash.hex()[:16]}..., the base given hashes to {h.hex()[:16]}...")
    return _decode(data, header, flat_base, session)


def _decode(data, header: UpdateHeader, flat_base, session: UpdateSession | None) -> Update:
    if header.session_id == 0:
        if header.session_seq != 0:
            raise CorruptStreamError("a message without a session has a session position")
        if any(e.features & SESSION_FEATURES for e in header.entries):
            raise CorruptStreamError("a message without a session uses temporal or history contexts")
        if session is not None:
            raise UpdateMismatchError("this update was coded without a session; decode it without one")
    else:
        if session is None:
            raise UpdateMismatchError(f"this update continues session {header.session_id} at message "
                                      f"{header.session_seq}: decode it with that session")
        if session.session_id != header.session_id or session.seq != header.session_seq:
            raise UpdateMismatchError(
                f"this update continues session {header.session_id} at message {header.session_seq}; the session "
                f"given is {session.session_id} at message {session.seq} (were messages skipped or reordered?)")
    shapes = _shapes(header, flat_base)
    payload = checked_payload(data, header)
    items = []
    for j, e in enumerate(header.entries):
        name, dtype, shape = shapes[e.index]
        e.name = name
        check_method_dtype(e.method, dtype, f"update entry {j} ({name!r})")
        rows, cols = rows_cols(shape)
        if e.nnz > rows * cols:
            raise CorruptStreamError(f"update entry {j} ({name!r}): {e.nnz} nonzeros in {rows * cols} elements")
        items.append((name, None, rows, cols, e.nnz, e.maxabs, int(e.sign_mode), e.features))
    tinfo, _, parent, hist, ctx = _tinfo_and_arrays(items, session)
    out = np.zeros(int(sum(r * c for _, _, r, c, *_ in items)), dtype=np.int32)
    buf = np.frombuffer(payload, dtype=np.uint8)
    if header.coder == UpdateCoder.CABAC:
        if items:
            status = _update_kernels.decode_update_kernel(buf, tinfo, parent, hist, ctx, out)
            if status != _update_kernels.OK:
                raise CorruptStreamError(f"update payload is corrupt (decoder status {status}: "
                                         f"{_STATUS.get(status, 'inconsistent data')})")
        elif buf.size:
            raise CorruptStreamError("an update with no tensors has a payload")
    else:
        pos = 0
        for t, (name, _, rows, cols, nnz, _maxabs, sign_mode, _f) in enumerate(items):
            off = int(tinfo[t, 0])
            side = -1 if sign_mode == SignMode.ALL_NEGATIVE else 1
            try:
                pos = golomb.decode_tensor(buf, pos, nnz, out[off:off + rows * cols],
                                           signs=sign_mode == SignMode.CODED, side=side)
            except CorruptStreamError as exc:
                raise CorruptStreamError(f"update tensor {name!r}: {exc}") from None
        if (pos + 7) // 8 != buf.size:
            raise CorruptStreamError("the Golomb payload does not end where its positions end")
    result = Update(header)
    coded, ctx_by_name = {}, {}
    for t, (e, item) in enumerate(zip(header.entries, items)):
        name, _, rows, cols = item[:4]
        _, dtype, shape = shapes[e.index]
        off = int(tinfo[t, 0])
        levels = out[off:off + rows * cols]
        if e.sign_mode != SignMode.CODED:
            nzv = levels[levels != 0]
            if (e.sign_mode == SignMode.ALL_POSITIVE and (nzv < 0).any()) or \
                    (e.sign_mode == SignMode.ALL_NEGATIVE and (nzv > 0).any()):
                raise CorruptStreamError(f"update tensor {name!r}: a level has the wrong sign")
        coded[name] = levels
        ctx_by_name[name] = ctx[t * _update_kernels.N_CTX_U:(t + 1) * _update_kernels.N_CTX_U].copy()
        arr = levels.reshape(shape).copy()
        if e.method == Method.INTEGER:
            result.tensors[name] = arr
        else:
            result.tensors[name] = SparseTensor(arr, e.step, e.method.name.lower())
    if session is not None:
        session._advance(coded, ctx_by_name)
    return result


_STATUS = {
    _update_kernels.ERR_BAD_START: "bad start", _update_kernels.ERR_BAD_ESCAPE: "escape code too long",
    _update_kernels.ERR_BAD_VALUE: "level out of range", _update_kernels.ERR_BAD_TERMINATE: "bad terminate bin",
    _update_kernels.ERR_OVERRUN: "truncated", _update_kernels.ERR_BAD_BYPASS: "bypass out of range",
    _update_kernels.ERR_BAD_COUNT: "fewer nonzeros than the header says",
}


def apply_delta(base, update: Update) -> dict[str, Any]:
    """``base`` plus the update's values, tensor by tensor (same types and dtypes as ``base``).

    Float tensors: ``base + levels * step`` with the product in float32 and the sum in the base's
    dtype (float16 sums in float32). Integer tensors: the exact sum (refused if it overflows).
    """
    from ..io.checkpoint import numpy_to_tensor

    flat = flat_model(base)
    out = {}
    for name, t in flat.items():
        u = update.tensors.get(name)
        arr = t.array
        if u is not None:
            if isinstance(u, SparseTensor):
                rec = reconstruct(u.levels, u.step)
                if t.dtype == "float16":
                    arr = (arr.astype(np.float32) + rec).astype(np.float16)
                else:
                    arr = arr + rec.astype(arr.dtype)
            else:
                wide = arr.astype(np.int64) + u.astype(np.int64)
                info = np.iinfo(arr.dtype)
                if wide.size and (wide.min() < info.min or wide.max() > info.max):
                    raise CorruptStreamError(f"tensor {name!r}: the update overflows its {t.dtype} values")
                arr = wide.astype(arr.dtype)
        else:
            arr = arr.copy()
        # (np.ascontiguousarray would turn a 0-d tensor, e.g. a step counter, into a 1-d one)
        out[name] = numpy_to_tensor(np.require(arr, requirements="C"), t.dtype, t.is_torch)
    return out


def apply_update(base, data, *, session: UpdateSession | None = None) -> dict[str, Any]:
    """The new model: the update message ``data`` applied to ``base``.

    Parameters
    ----------
    base : mapping of str to tensor, or Checkpoint
        The parent model.
    data : bytes-like
        One message (the first in ``data``).
    session : UpdateSession or None
        The receiver's session, for a message that continues one; it is advanced.

    Returns
    -------
    dict of str to tensor
        Flat, in ``base``'s tensor types and dtypes.

    Raises
    ------
    UpdateMismatchError
        ``base`` is not the message's parent (its SHA-256 differs), or ``session`` is not at the
        message's position.
    """
    upd = decode_update(data, base, session=session)
    return apply_delta(base, upd)


# --------------------------------------------------------------------------------------------------
# streams of messages
# --------------------------------------------------------------------------------------------------


class UpdateStreamWriter:
    """Append update messages to a binary file object (a stream of rounds is the messages in order)."""

    def __init__(self, f):
        self.f = f
        self.count = 0
        self.bytes = 0

    def write(self, message: bytes) -> None:
        read_update_header(message)  # refuse anything that is not one whole message
        self.f.write(message)
        self.count += 1
        self.bytes += len(message)


def read_message(f) -> bytes | None:
    """Read one whole message from a binary file object; ``None`` at a clean end of file."""
    pre = f.read(PREAMBLE.size)
    if not pre:
        return None
    if len(pre) < PREAMBLE.size:
        pre += read_exactly(f, PREAMBLE.size - len(pre), "update message preamble")
    _, _, header_size = check_update_preamble(pre)
    head = pre + read_exactly(f, header_size, "update message header")
    header = read_update_header(head, total_size=1 << 62)
    # (read in pieces: a header may declare far more payload than the input holds)
    return head + read_exactly(f, header.total_size - len(head), "update message")


def iter_messages(source) -> Iterator[bytes]:
    """The messages of a stream: ``source`` is bytes-like or a binary file object."""
    if hasattr(source, "read"):
        while True:
            m = read_message(source)
            if m is None:
                return
            yield m
    else:
        view = memoryview(source)
        pos = 0
        while pos < len(view):
            header = read_update_header(view[pos:])
            yield bytes(view[pos:pos + header.total_size])
            pos += header.total_size
