"""A thread pool over independent pieces of work (tensors, chunks of tensors).

The element passes of the save path are numba kernels, torch ops and zstd calls, all of which
release the GIL, so threads over tensors use every core without processes or copies::

    results = thread_map(fn, items)              # fn(item) for each item, in order
    results = thread_map(fn, items, threads=1)   # inline, no pool

``threads`` defaults to ``torch.get_num_threads()``: the caller's intra-op budget is spent across
tensors instead of inside each small kernel. One pool per process, grown on demand; exceptions
propagate from the first failing item (in item order).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import torch

__all__ = ["thread_map", "default_threads"]

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_local = threading.local()  # marks pool workers: a nested thread_map runs inline (no deadlock)


def default_threads() -> int:
    return max(1, torch.get_num_threads())


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckptzip",
                                       initializer=lambda: setattr(_local, "worker", True))
            _pool_size = n
        return _pool


def thread_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> list[R]:
    """[fn(x) for x in items], spread over ``threads`` threads (default: torch's thread count)."""
    items = list(items)
    n = default_threads() if threads is None else max(1, int(threads))
    if n <= 1 or len(items) <= 1 or getattr(_local, "worker", False):
        return [fn(x) for x in items]
    futures = [_executor(n).submit(fn, x) for x in items]
    return [f.result() for f in futures]
