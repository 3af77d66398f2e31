"""A ``DistributedDataParallel`` communication hook that sends sparse ternary or binary gradients.

::

    from deepcabac_py.integrations.ddp import DeepCabacState, deepcabac_hook

    state = DeepCabacState(density=0.01, method="stc", coder="cabac", warmup_steps=2)
    ddp_model.register_comm_hook(state, deepcabac_hook)
    ...                                   # train as usual
    state.stats()                         # bytes this rank handed to the collectives, totals and per step
    state.close()                         # before dist.destroy_process_group()

For every gradient bucket of a step, each rank

1. adds its error-feedback residual to its local gradient, parameter by parameter (the residual is
   kept per parameter, so it survives DDP rebuilding its buckets after the first iteration);
2. sparsifies each parameter's slice with :func:`~deepcabac_py.updates.sparsify.sparsify` (``"stc"``: top-k,
   ternary; ``"sbc"``: binary, one sign per tensor) at ``density``;
3. codes the bucket as one table-less update message (:func:`~deepcabac_py.updates.encode_sparse`;
   the bucket's layout plays the parent model) with our arithmetic coder (``"cabac"``, contexts and
   history carried from step to step in one session per rank and bucket) or the STC/SBC papers'
   Golomb position code (``"golomb"``);
4. all-gathers the int64 message lengths, then the messages zero-padded to the longest;
5. decodes every other rank's message, adds its own sent values, divides by the world size in rank
   order (so every rank ends with bit-identical gradients) and writes the mean into the bucket.

The first ``warmup_steps`` steps do what PyTorch's own ``allreduce_hook`` does (dense, bit-identical to DDP
without a hook).

What :meth:`DeepCabacState.stats` calls *bytes sent* is what this rank passes to collectives: per
compressed bucket 8 bytes of length plus the padded message, per warm-up bucket the bucket itself.
An all-gather delivers ``world_size - 1`` copies of that to each rank where a ring all-reduce moves
about ``2 (world_size - 1) / world_size`` times the dense bucket, so with more than two ranks the
traffic a rank *receives* grows faster than with all-reduce; on two ranks the two measures agree.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations
# with the real objects (dist.GradBucket, torch.futures.Future[torch.Tensor]) and refuses strings.
import hashlib
import math
import struct
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CorruptStreamError, UpdateMismatchError
from ..updates.message_format import read_update_header
from ..updates.messages import decode_update, encode_sparse
from ..updates.parent_model import ParentTensor
from ..updates.sessions import UpdateSession
from ..updates.sparsify import ErrorFeedback, SparseTensor, reconstruct, sparsify

METHODS = ("stc", "sbc")
CODERS = ("cabac", "golomb")
LENGTH_BYTES = 8  # one int64 per rank and bucket

# A valid message never comes near this (the worst case is a few bytes per element); it only stops a
# nonsensical length from a peer from allocating the padded receive buffers.
_MAX_MESSAGE_BYTES_PER_ELEMENT = 32
_MAX_MESSAGE_OVERHEAD = 4096


# --------------------------------------------------------------------------------------------------
# one bucket: layout, sparsify, encode, decode
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BucketLayout:
    """Where each gradient of a bucket lies in its flat buffer.

    DDP builds the same buckets on every rank, so the layout is common knowledge: it serves as the
    update message's parent "model" (segment names ``000``, ``001``, ... in bucket order, float32, the
    gradients' shapes) and its digest as the parent hash, so a message is never decoded against
    another layout.
    """

    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    def __post_init__(self):
        if len(self.shapes) != len(self.offsets) or not self.shapes:
            raise ValueError("a bucket layout needs one offset per shape and at least one shape")
        for shape, off in zip(self.shapes, self.offsets):
            if off < 0 or off + math.prod(shape) > self.numel:
                raise ValueError(f"a gradient of shape {shape} at offset {off} does not fit a bucket of {self.numel}")

    @classmethod
    def contiguous(cls, shapes: Sequence[Sequence[int]]) -> "BucketLayout":
        """The layout of gradients packed one after the other."""
        exact = tuple(tuple(int(d) for d in s) for s in shapes)
        offsets, off = [], 0
        for s in exact:
            offsets.append(off)
            off += math.prod(s)
        return cls(exact, tuple(offsets), off)

    @classmethod
    def of(cls, bucket) -> "BucketLayout":
        """The layout of a ``torch.distributed.GradBucket`` (its gradients are views of its buffer)."""
        buffer = bucket.buffer()
        grads = bucket.gradients()
        shapes = tuple(tuple(g.shape) for g in grads)
        storage = buffer.untyped_storage().data_ptr()
        if all(g.untyped_storage().data_ptr() == storage for g in grads):
            offsets = tuple(int(g.storage_offset() - buffer.storage_offset()) for g in grads)
            return cls(shapes, offsets, buffer.numel())
        # Not views (never seen with the CPU or CUDA reducer): DDP packs them in order.
        layout = cls.contiguous(shapes)
        if layout.numel != buffer.numel():
            raise ValueError(f"bucket {bucket.index()}: its gradients hold {layout.numel} elements, its buffer "
                             f"{buffer.numel()}")
        return layout

    @cached_property
    def names(self) -> tuple[str, ...]:
        # Zero-padded to one width: the update format orders tensors by name.
        width = max(3, len(str(len(self.shapes) - 1)))
        return tuple(f"{i:0{width}d}" for i in range(len(self.shapes)))

    @cached_property
    def digest(self) -> bytes:
        h = hashlib.sha256(b"deepcabac-ddp-bucket\0")
        h.update(struct.pack("<QQ", self.numel, len(self.shapes)))
        for shape, off in zip(self.shapes, self.offsets):
            h.update(struct.pack(f"<QB{len(shape)}Q", off, len(shape), *shape))
        return h.digest()

    @cached_property
    def base(self) -> dict[str, ParentTensor]:
        # Only the shapes are read (the parent hash is given): zero-strided arrays cost nothing.
        zero = np.zeros((), dtype=np.float32)
        return {n: ParentTensor(n, np.broadcast_to(zero, s), "float32", False) for n, s in zip(self.names, self.shapes)}

    def segments(self, flat: np.ndarray) -> list[np.ndarray]:
        """Views of each gradient in the flat bucket ``flat``, shaped."""
        return [flat[o:o + math.prod(s)].reshape(s) for s, o in zip(self.shapes, self.offsets)]


def _check_sparse(sparse: Sequence[SparseTensor], layout: BucketLayout) -> None:
    if len(sparse) != len(layout.shapes):
        raise ValueError(f"{len(sparse)} sparse tensors for a bucket of {len(layout.shapes)} gradients")
    for i, (s, shape) in enumerate(zip(sparse, layout.shapes)):
        if not isinstance(s, SparseTensor):
            raise TypeError(f"gradient {i}: expected a SparseTensor, got {type(s).__name__}")
        if s.levels.shape != shape:
            raise ValueError(f"gradient {i}: levels of shape {s.levels.shape}, the layout says {shape}")


def sparsify_bucket(flat, layout: BucketLayout, *, method: str = "stc", density: float = 0.01) -> list[SparseTensor]:
    """Sparsify each gradient of the flat bucket ``flat`` on its own (``method`` at ``density``)."""
    arr = np.asarray(flat)
    if arr.shape != (layout.numel,):
        raise ValueError(f"expected a flat bucket of {layout.numel} elements, got shape {arr.shape}")
    return [sparsify(seg, method, density) for seg in layout.segments(arr)]


def bucket_values(sparse: Sequence[SparseTensor], layout: BucketLayout) -> np.ndarray:
    """The flat float32 bucket the sparse tensors stand for (zeros between gradients)."""
    _check_sparse(sparse, layout)
    out = np.zeros(layout.numel, dtype=np.float32)
    for s, seg in zip(sparse, layout.segments(out)):
        seg[...] = reconstruct(s.levels, s.step)
    return out


def encode_bucket(sparse: Sequence[SparseTensor], layout: BucketLayout, *, coder: str = "cabac",
                  session: UpdateSession | None = None, step: int = 0) -> bytes:
    """Code one bucket's sparse gradients (in layout order) as one update message.

    ``session`` (CABAC only) carries contexts and history from one step to the next and is advanced;
    ``step`` is written as the message's parent round so that the receiver can check that all
    ranks are at the same step.
    """
    _check_sparse(sparse, layout)
    if not (isinstance(step, int) and step >= 0):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return encode_sparse(dict(zip(layout.names, sparse)), layout.base, round_index=step + 1, parent_round=step,
                         session=session, coder=coder, table=False, parent_hash=layout.digest)


def decode_bucket(data, layout: BucketLayout, *, session: UpdateSession | None = None,
                  step: int | None = None) -> np.ndarray:
    """Inverse of :func:`encode_bucket`: the flat float32 bucket (values exactly as the sender's
    :func:`bucket_values`). ``step``, when given, must be the sender's.

    Raises :class:`~deepcabac_py.errors.CorruptStreamError` for damaged data and
    :class:`~deepcabac_py.errors.UpdateMismatchError` for a message of another layout, step or session.
    """
    header = read_update_header(data)
    if header.total_size != len(data):
        raise CorruptStreamError(f"bucket message of {header.total_size} bytes followed by "
                                 f"{len(data) - header.total_size} more")
    if not header.parent_matches(layout.digest):
        raise UpdateMismatchError("the bucket message was coded for another bucket layout")
    if step is not None and header.parent_round != step:
        raise UpdateMismatchError(f"the bucket message is from step {header.parent_round}, this rank is at step {step}")
    update = decode_update(data, layout.base, session=session, check_parent=False)
    out = np.zeros(layout.numel, dtype=np.float32)
    segments = dict(zip(layout.names, layout.segments(out)))
    for name, tensor in update.tensors.items():
        segments[name][...] = tensor.values() if isinstance(tensor, SparseTensor) else tensor
    return out


# --------------------------------------------------------------------------------------------------
# state and hook
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """One training step as this rank saw it."""

    step: int
    sent: int  # bytes passed to collectives: lengths and padded messages, or dense buckets in warm-up
    payload: int  # the messages themselves (no padding, no lengths); the buckets' bytes in warm-up
    dense_fp32: int  # what a dense float32 all-reduce would have passed: 4 bytes per element
    dense: int  # what a dense all-reduce in the gradients' own dtype passes (2 bytes per element in bf16)
    compressed: bool


@dataclass
class _BucketCoding:
    layout: BucketLayout
    encoder: UpdateSession | None
    decoders: list[UpdateSession | None]  # one per rank (None at this rank's own position)


class DeepCabacState:
    """Options and memory of :func:`deepcabac_hook` (one instance per DDP model, as ``PowerSGDState``).

    * ``density``: fraction of each gradient's elements sent, in (0, 1].
    * ``method``: ``"stc"`` (ternary: signs and one magnitude per tensor) or ``"sbc"`` (binary: one
      side and one magnitude per tensor, no signs).
    * ``coder``: ``"cabac"`` (our arithmetic coder, with sessions) or ``"golomb"`` (the papers' code).
    * ``warmup_steps``: steps at the start that use a plain dense all-reduce.
    * ``error_feedback``: keep what was not sent and add it to the next gradient (on by default;
      without it top-k gradients lose most of their mass).
    * ``log_size``: how many :class:`StepBytes` records :attr:`log` keeps (totals count every step).

    Error feedback is kept per parameter, so when DDP rebuilds its buckets (after the first
    iteration, in the order gradients became ready) no residual is lost or misplaced; the coding
    sessions of a bucket whose layout changed start afresh on every rank alike.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, density: float = 0.01,
                 method: str = "stc", coder: str = "cabac", warmup_steps: int = 2, error_feedback: bool = True,
                 log_size: int = 10_000):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < float(density) <= 1.0:
            raise ValueError(f"density must be a number in (0, 1], e.g. 0.01 to send 1% of each gradient; "
                             f"got {density!r}")
        if method not in METHODS:
            raise ValueError(f"method must be 'stc' (sparse ternary) or 'sbc' (sparse binary), got {method!r}")
        if coder not in CODERS:
            raise ValueError(f"coder must be 'cabac' (ours) or 'golomb' (the STC/SBC papers' code), got {coder!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer (0 compresses from the first step), "
                             f"got {warmup_steps!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if isinstance(log_size, bool) or not isinstance(log_size, int) or log_size < 1:
            raise ValueError(f"log_size must be a positive integer, got {log_size!r}")
        self.process_group = process_group
        self.density = float(density)
        self.method = method
        self.coder = coder
        self.warmup_steps = warmup_steps
        self.feedback = ErrorFeedback() if error_feedback else None
        self.iter = 0
        self.layout_changes = 0  # buckets whose layout differed from the previous step's (DDP rebuilds)
        self.log: deque[StepBytes] = deque(maxlen=log_size)
        self._codings: dict[int, _BucketCoding] = {}
        # One thread (started on the first compressed bucket): messages are decoded in step order,
        # each in its sender's session.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepcabac-ddp")
        self._exchanges: dict[int, tuple] = {}  # the last collective of each bucket, see deepcabac_hook
        # Gloo's work objects must not outlive the interpreter's healthy part: an exchange left for
        # finalization to destroy can abort the process on its way out (finalize also runs at exit).
        self._release = weakref.finalize(self, _release, self._finisher, self._exchanges)
        self._param_keys: dict[int, str] = {}
        self._params: dict[int, torch.Tensor] = {}  # keeps each id() above bound to its parameter
        # of the step in progress: bytes sent, payload, dense fp32, dense in the gradients' dtype; whether a
        # bucket was coded
        self._step_bytes = [0, 0, 0, 0]
        self._step_compressed = False
        self._totals = {"steps": 0, "compressed_steps": 0, "bytes_sent": 0, "payload_bytes": 0, "dense_fp32_bytes": 0,
                        "dense_bytes": 0}

    def close(self) -> None:
        """Release what the hook holds between steps (its thread, the last collective of each
        bucket) while the process group is still there: call it before
        ``dist.destroy_process_group()``; it also runs when the interpreter exits. The state cannot
        be used afterwards."""
        self._release()

    # -- reports ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Totals over every finished step, and bytes per step: ``ratio`` is dense fp32 over sent."""
        t: dict[str, float | int] = dict(self._totals)
        steps = t["steps"]
        t["bytes_per_step"] = t["bytes_sent"] / steps if steps else 0.0
        t["dense_fp32_bytes_per_step"] = t["dense_fp32_bytes"] / steps if steps else 0.0
        t["ratio"] = t["dense_fp32_bytes"] / t["bytes_sent"] if t["bytes_sent"] else 0.0
        t["dense_bytes_per_step"] = t["dense_bytes"] / steps if steps else 0.0
        t["ratio_vs_dense"] = t["dense_bytes"] / t["bytes_sent"] if t["bytes_sent"] else 0.0
        return t

    @property
    def residual_norm(self) -> float:
        """L2 norm of the error-feedback residual (0 without error feedback)."""
        return self.feedback.norm() if self.feedback is not None else 0.0

    # -- internals ----------------------------------------------------------------------------------

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _keys(self, params) -> list[str]:
        keys = []
        for p in params:
            key = self._param_keys.get(id(p))
            if key is None:
                key = f"param{len(self._param_keys)}"
                self._param_keys[id(p)] = key
                self._params[id(p)] = p
            keys.append(key)
        return keys

    def _coding(self, index: int, layout: BucketLayout, rank: int, world: int) -> _BucketCoding:
        coding = self._codings.get(index)
        if coding is not None and coding.layout == layout and len(coding.decoders) == world:
            return coding
        if coding is not None:
            self.layout_changes += 1
        sessions = self.coder == "cabac"
        # The session id names the sending rank, so a message is never decoded in another rank's session.
        coding = _BucketCoding(
            layout,
            UpdateSession(rank + 1) if sessions else None,
            [UpdateSession(r + 1) if sessions and r != rank else None for r in range(world)],
        )
        self._codings[index] = coding
        return coding

    def _record(self, bucket, sent: int, payload: int, compressed: bool) -> None:
        buffer = bucket.buffer()
        for i, n in enumerate((sent, payload, 4 * buffer.numel(), buffer.element_size() * buffer.numel())):
            self._step_bytes[i] += n
        self._step_compressed = self._step_compressed or compressed
        if bucket.is_last():  # DDP's last bucket of the step (PowerSGD counts iterations the same way)
            (sent, payload, dense_fp32, dense), compressed = self._step_bytes, self._step_compressed
            self.log.append(StepBytes(self.iter, sent, payload, dense_fp32, dense, compressed))
            t = self._totals
            t["steps"] += 1
            t["compressed_steps"] += int(compressed)
            t["bytes_sent"] += sent
            t["payload_bytes"] += payload
            t["dense_fp32_bytes"] += dense_fp32
            t["dense_bytes"] += dense
            self._step_bytes, self._step_compressed = [0, 0, 0, 0], False
            self.iter += 1


def _release(finisher: ThreadPoolExecutor, exchanges: dict) -> None:
    finisher.shutdown(wait=True)
    exchanges.clear()


def deepcabac_hook(state: DeepCabacState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Communication hook for ``DistributedDataParallel.register_comm_hook(state, deepcabac_hook)``."""
    buffer = bucket.buffer()
    if not buffer.dtype.is_floating_point:
        raise TypeError(f"deepcabac_hook compresses floating-point gradients; bucket {bucket.index()} holds "
                        f"{buffer.dtype}")
    group = state._group()
    if state.iter < state.warmup_steps:
        nbytes = buffer.numel() * buffer.element_size()
        # (what PyTorch's allreduce_hook does, the mean of the buckets, but finished on our thread:
        # see below)
        world = dist.get_world_size(group)
        dense = dist.all_reduce(buffer.div_(world), group=group, async_op=True)
        state._record(bucket, nbytes, nbytes, compressed=False)
        return _finished_on_our_thread(state, bucket, dense, lambda: buffer, (dense, buffer))

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    coding = state._coding(bucket.index(), BucketLayout.of(bucket), rank, world)
    layout = coding.layout  # the stored one: its names, digest and base are computed once
    step = state.iter
    local = buffer.detach().to("cpu", torch.float32).numpy()
    grads = dict(zip(state._keys(bucket.parameters()), layout.segments(local)))
    if state.feedback is not None:
        accumulated = state.feedback.accumulate(grads)
        sent = [sparsify(a, state.method, state.density) for a in accumulated.values()]
        state.feedback.commit(accumulated, {k: s.values() for k, s in zip(accumulated, sent)})
    else:
        sent = [sparsify(g, state.method, state.density) for g in grads.values()]
    message = encode_bucket(sent, layout, coder=state.coder, session=coding.encoder, step=step)
    own = bucket_values(sent, layout)

    device = buffer.device
    announced = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(announced, torch.tensor([len(message)], dtype=torch.int64, device=device), group=group)
    lengths = [int(n.item()) for n in announced]
    limit = _MAX_MESSAGE_BYTES_PER_ELEMENT * layout.numel + _MAX_MESSAGE_OVERHEAD
    for r, n in enumerate(lengths):
        if not 0 < n <= limit:
            raise CorruptStreamError(f"rank {r} announces a {n}-byte message for a bucket of {layout.numel} elements")
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    sending = padded.to(device)
    work = dist.all_gather(received, sending, group=group, async_op=True)
    state._record(bucket, LENGTH_BYTES + longest, len(message), compressed=True)

    def average() -> torch.Tensor:
        total = np.zeros(layout.numel, dtype=np.float32)
        # Rank order on every rank: the same float32 sums everywhere, so replicas stay identical.
        for r in range(world):
            if r == rank:
                total += own
            else:
                data = received[r][:lengths[r]].cpu().numpy().tobytes()
                total += decode_bucket(data, layout, session=coding.decoders[r], step=step)
        total /= np.float32(world)
        buffer.copy_(torch.from_numpy(total))
        return buffer

    return _finished_on_our_thread(state, bucket, work, average, (work, sending, received))


def _finished_on_our_thread(state: DeepCabacState, bucket: dist.GradBucket, work, value, keep: tuple
                            ) -> torch.futures.Future[torch.Tensor]:
    """The future DDP waits for: completed with ``value()`` by the hook's own thread once ``work``
    is done.

    Not ``work.get_future().then(...)``: a gloo thread would own the Python callback and drop it
    after running it, which needs the GIL; when the training script ends in that instant, the
    interpreter is already finalizing and the process aborts ("terminate called without an active
    exception"). Our own thread waits instead, and the interpreter joins it before it finalizes. For
    the same reason the exchange (``keep``: the work and its tensors) stays referenced until the
    bucket's next step or :meth:`DeepCabacState.close`, so that a gloo thread never holds the last
    reference to a Python tensor."""
    device = bucket.buffer().device
    devices: list[int | str | torch.device] | None = [device] if device.type == "cuda" else None
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    index = bucket.index()

    def finish() -> None:
        error: BaseException | None = None
        try:
            work.wait()
            out = value()
        except BaseException as exc:  # the reducer raises it where DDP waits for the bucket
            error = exc
        # (recorded before the result is set: once DDP has it, nothing of this step runs on our
        # thread any more, and close() finds every exchange)
        state._exchanges[index] = keep
        if error is not None:
            result.set_exception(error)  # type: ignore[arg-type]  # (torch types it as the result)
        else:
            result.set_result(out)

    state._finisher.submit(finish)
    return result


__all__ = [
    "BucketLayout",
    "DeepCabacState",
    "StepBytes",
    "bucket_values",
    "decode_bucket",
    "deepcabac_hook",
    "encode_bucket",
    "sparsify_bucket",
]
