"""Independent substreams on a thread pool: the kernels release the GIL, so chunks of one model
encode and decode on every core."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor

Progress = Callable[[int], None]  # called with the number of elements just coded

# Elements of the tensors held at once while a model streams through the coder (loaded, planned,
# being coded or decoded): a 7B model's largest matrices are 45 M elements, so two of them (one
# coding while the next is read) fit, and memory stays a few hundred MB whatever the model's size.
ELEMENTS_IN_FLIGHT = 1 << 26

# A tensor smaller than this is coded on the calling thread even when a pool runs: its chunk is
# mostly Python, which holds the GIL, so handing it to a worker only adds the hand-off (a model of
# small tensors, such as EfficientNet-Lite0's, coded slower on two threads than on one).
POOL_MIN_ELEMENTS = 1 << 15


def pool_for(pool: Executor | None, numel: int) -> Executor | None:
    """``pool`` for a tensor of ``numel`` elements, or None: coded on the calling thread."""
    return pool if numel >= POOL_MIN_ELEMENTS else None


def resolve_threads(threads: int | None) -> int:
    """``threads``, or every core this process may run on for None."""
    if threads is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    return threads
