"""A thread pool over independent pieces of work (tensors, chunks of tensors).

The element passes of the save path are numba kernels, torch ops and zstd calls, all of which
release the GIL, so threads over tensors use every core without processes or copies::

    results = thread_map(fn, items)              # fn(item) for each item, in order
    results = thread_map(fn, items, threads=1)   # inline, no pool

``threads`` defaults to ``torch.get_num_threads()``: the caller's intra-op budget is spent across
tensors instead of inside each small kernel. One pool per process, grown on demand; exceptions
propagate from the first failing item (in item order).

Each worker runs its torch kernels on its own thread (``serial_kernels``): a worker that opened an
OpenMP team of its own would leave the process with more OpenMP threads than cores, and libgomp
then stops spinning at barriers -- every parallel region of the *trainer* gets slower, for as long
as the process lives (a digits MLP step: 0.9 ms before one lossless save, 2.4 ms after).
``torch.set_num_threads(1)`` would do it too, but it also changes the count that threads started
later inherit; OpenMP's own setter changes the calling thread's value only.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import torch

__all__ = ["thread_map", "default_threads", "serial_kernels"]

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_local = threading.local()  # marks pool workers: a nested thread_map runs inline (no deadlock)


def default_threads() -> int:
    return max(1, torch.get_num_threads())


def _openmp_runtime() -> str | None:
    """The path of the OpenMP runtime torch runs on: the one in torch's own folder when it ships one
    (other packages map theirs too, e.g. scikit-learn's libgomp), else the first one mapped."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux
        return None
    found = [p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp5", "libomp"))]
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    return min(found, key=lambda p: (not p.startswith(torch_dir), p), default=None)


@functools.lru_cache(maxsize=None)
def _openmp_team_setter():
    """``omp_set_num_threads`` of torch's OpenMP runtime: it sets the calling thread's value only.
    None where there is none to find (a torch without OpenMP, not Linux): helper threads then keep
    torch's count."""
    path = _openmp_runtime()
    try:
        return ctypes.CDLL(path).omp_set_num_threads if path else None
    except (OSError, AttributeError):
        return None


def serial_kernels() -> None:
    """Run the calling thread's torch CPU kernels on that thread alone, leaving every other thread's
    count (and the count new threads inherit) as it is. For helper threads beside a trainer."""
    torch.get_num_threads()  # torch sets each thread's OpenMP count on first use: let it, then override
    setter = _openmp_team_setter()
    if setter is not None:
        setter(1)


def _worker_init() -> None:
    _local.worker = True
    serial_kernels()


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckptzip",
                                       initializer=_worker_init)
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
