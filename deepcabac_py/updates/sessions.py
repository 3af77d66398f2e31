"""What each end of a stream of updates remembers between messages (:class:`UpdateSession`): the
adaptive contexts of every tensor, the previous update's levels, and every position's history."""

from __future__ import annotations

import io
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    CorruptStreamError,
    LimitExceededError,
    UpdateMismatchError,
)
from . import _update_kernels


@dataclass
class _TensorState:
    ctx: np.ndarray  # int64 [N_CTX_U, 2]
    parent: np.ndarray  # int8 flat: the previous update's levels, clipped to [-2, 2]
    hist: np.ndarray  # uint16 flat: last sign (1 +, 2 -) | count of nonzeros (<= 15) << 2 | age (<= 63) << 6


def next_hist(hist: np.ndarray, levels: np.ndarray | None) -> np.ndarray:
    """The history after one more message (``levels`` None: the tensor was not listed, all zero)."""
    h = hist.astype(np.int64)
    sign = h & 3
    count = (h >> _update_kernels.HIST_COUNT_SHIFT) & _update_kernels.HIST_COUNT_MAX
    age = (h >> _update_kernels.HIST_AGE_SHIFT) & _update_kernels.HIST_AGE_MAX
    age = np.where(age > 0, np.minimum(age + 1, _update_kernels.HIST_AGE_MAX), 0)
    if levels is not None:
        nz = levels != 0
        sign = np.where(levels > 0, 1, np.where(levels < 0, 2, sign))
        count = np.minimum(count + nz, _update_kernels.HIST_COUNT_MAX)
        age = np.where(nz, 1, age)
    packed = sign | (count << _update_kernels.HIST_COUNT_SHIFT) | (age << _update_kernels.HIST_AGE_SHIFT)
    return packed.astype(np.uint16)


def fresh_ctx() -> np.ndarray:
    return _update_kernels.fresh_contexts(1)


def _check_state_values(st: _TensorState, i: int) -> None:
    """Refuse session arrays no coder could have produced (the kernels index tables with them)."""
    p, n, w = st.ctx[:_update_kernels.CTX_WSIG, 0], st.ctx[:, 1], st.ctx[_update_kernels.CTX_WSIG:, 0]
    if p.size and (p.min() < 0 or p.max() > (1 << _update_kernels.EST_BITS)):
        raise ValueError(f"tensor {i}: a context probability out of range")
    if n.min() < 0 or n.max() > _update_kernels.COUNT_MAX:
        raise ValueError(f"tensor {i}: a context count out of range")
    if np.abs(w).max() > _update_kernels.MIX_W_MAX:
        raise ValueError(f"tensor {i}: a mixing weight out of range")
    if st.hist.size and (st.hist.max() >> 12 or ((st.hist & 3) == 3).any()):
        raise ValueError(f"tensor {i}: a history value out of range")
    if st.parent.size and np.abs(st.parent.astype(np.int64)).max() > _update_kernels.PARENT_MAX:
        raise ValueError(f"tensor {i}: a previous level out of range")


SNAPSHOT_MAX_BYTES = 1 << 30


def _inflate_snapshot(data, max_bytes: int) -> bytes:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise TypeError(f"max_bytes must be a non-negative int, not {max_bytes!r}")
    inflater = zlib.decompressobj()
    raw = inflater.decompress(bytes(data), max_bytes + 1)
    if len(raw) > max_bytes:
        raise LimitExceededError(f"the session snapshot inflates to more than max_bytes={max_bytes:,}")
    if not inflater.eof:
        raise ValueError("the compressed snapshot is truncated")
    return raw


class UpdateSession:
    """What one end remembers of a stream of updates: contexts, previous levels, history.

    Use one session per direction and per peer on each side (the encoder's and the decoder's stay
    equal as long as every message is decoded in order). ``session_id`` (1 .. 2**32 - 1) is written
    into every message so that a message is never decoded with another stream's state.
    """

    def __init__(self, session_id: int = 1):
        if not (isinstance(session_id, int) and 0 < session_id < (1 << 32)):
            raise ValueError(f"session_id must be an integer in [1, 2**32 - 1], got {session_id!r}")
        self.session_id = session_id
        self.seq = 0
        self.states: dict[str, _TensorState] = {}

    def _state(self, name: str, numel: int) -> _TensorState:
        st = self.states.get(name)
        if st is None:
            st = _TensorState(fresh_ctx(), np.zeros(numel, np.int8), np.zeros(numel, np.uint16))
            self.states[name] = st
        elif st.parent.size != numel:
            raise UpdateMismatchError(f"tensor {name!r} has {numel} elements, the session knew {st.parent.size}")
        return st

    def _advance(self, coded: dict[str, np.ndarray], ctx: dict[str, np.ndarray]) -> None:
        # (next_hist in one Numba pass: measured as slow as the coding itself at density 0.001)
        none = np.zeros(0, dtype=np.int32)
        for name, st in self.states.items():
            if name not in coded:
                _update_kernels.advance_session_kernel(st.hist, st.parent, none, False)
        for name, levels in coded.items():
            st = self._state(name, levels.size)
            _update_kernels.advance_session_kernel(st.hist, st.parent, np.ascontiguousarray(levels.reshape(-1)), True)
            if name in ctx:
                st.ctx[:] = ctx[name]
        self.seq += 1

    def copy(self) -> UpdateSession:
        s = UpdateSession(self.session_id)
        s.seq = self.seq
        s.states = {n: _TensorState(st.ctx.copy(), st.parent.copy(), st.hist.copy()) for n, st in self.states.items()}
        return s

    def snapshot(self) -> bytes:
        """The session as bytes (zlib-compressed), e.g. to hand a client that resyncs from a full model."""
        buf = io.BytesIO()
        arrays: dict[str, Any] = {"meta": np.array([self.session_id, self.seq], dtype=np.int64)}
        for i, (name, st) in enumerate(sorted(self.states.items())):
            arrays[f"n{i}"] = np.frombuffer(name.encode("utf-8"), dtype=np.uint8)
            arrays[f"c{i}"], arrays[f"p{i}"], arrays[f"h{i}"] = st.ctx, st.parent, st.hist
        np.savez(buf, **arrays)
        return zlib.compress(buf.getvalue(), 6)

    @classmethod
    def from_snapshot(cls, data: bytes, *, max_bytes: int = SNAPSHOT_MAX_BYTES) -> UpdateSession:
        """The session :meth:`snapshot` wrote. Snapshots travel (a server hands one to a client that
        resyncs), so one is read as hostile input: at most ``max_bytes`` are inflated
        (:class:`LimitExceededError` beyond), and every array must lie, uncompressed, inside them."""
        try:
            raw = _inflate_snapshot(data, max_bytes)
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                for info in zf.infolist():
                    # np.savez stores its members: a deflated one could expand again (a zip bomb)
                    if (info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size
                            or info.header_offset + info.compress_size > len(raw)):
                        raise ValueError(f"member {info.filename!r:.40} is compressed or reaches past the end")
            with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                sid, seq = (int(v) for v in z["meta"])
                s = cls(sid)
                s.seq = seq
                i = 0
                while f"n{i}" in z:
                    st = _TensorState(z[f"c{i}"].copy(), z[f"p{i}"].copy(), z[f"h{i}"].copy())
                    v1_shape = (_update_kernels.N_CTX_V1, _update_kernels.CTX_COLS)
                    if st.ctx.dtype == np.int64 and st.ctx.shape == v1_shape:
                        # a snapshot of update format 1: the contexts of the mixed models start fresh
                        st.ctx = np.concatenate([st.ctx, fresh_ctx()[_update_kernels.N_CTX_V1:]])
                    if (st.ctx.dtype != np.int64 or st.ctx.shape != (_update_kernels.N_CTX_U, _update_kernels.CTX_COLS)
                            or st.parent.dtype != np.int8 or st.hist.dtype != np.uint16
                            or st.parent.shape != st.hist.shape or st.parent.ndim != 1):
                        raise ValueError(f"tensor {i}: arrays of the wrong type or shape")
                    _check_state_values(st, i)
                    s.states[bytes(z[f"n{i}"]).decode("utf-8")] = st
                    i += 1
        except (zlib.error, ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError,
                RuntimeError) as exc:
            raise CorruptStreamError(f"not a session snapshot: {str(exc)[:200]}") from None
        return s
