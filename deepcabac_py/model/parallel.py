"""Independent substreams on a thread pool: the kernels release the GIL, so chunks of one model
encode and decode on every core."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Progress = Callable[[int], None]  # called with the number of elements just coded

J = TypeVar("J")
R = TypeVar("R")


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


def run_largest_first(jobs: Sequence[J], size: Callable[[J], int], run: Callable[[J], R],
                      threads: int) -> list[R]:
    """``[run(job) for job in jobs]``, in that order, computed largest job first on ``threads``
    threads (the largest first keeps every core busy to the end)."""
    order = sorted(range(len(jobs)), key=lambda i: -size(jobs[i]))
    results: list = [None] * len(jobs)
    if threads == 1 or len(jobs) <= 1:
        for i in order:
            results[i] = run(jobs[i])
        return results
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for i, result in zip(order, pool.map(lambda i: run(jobs[i]), order)):
            results[i] = result
    return results
