"""Python's cyclic garbage collector paused over a save or a restore.

A save allocates thousands of short-lived containers (records, manifest dicts, per-blob lists) that
reference counting frees. With the collector on they still trigger several young-generation
collections per save, and now and then a full collection over every object the process holds (a
training script holds hundreds of thousands: torch, transformers, its data): 4-15 % of a small
model's save on two days measured (docs/BENCHMARKS.md, "The collector paused over a save"). So the
collector is paused for the duration and the one deferred young collection runs at the end, inside
the save: whatever cyclic garbage the save made is freed there, before it returns.

Process-wide, as ``gc`` is: while a thread is inside a paused region no thread's cyclic garbage is
collected (reference counting still frees everything acyclic). Concurrent and nested regions share
one pause, lifted when the last ends; a collector the caller disabled stays disabled.

A config search's ``eval_fn`` runs inside the pause too, and its cyclic garbage (rare: a forward
pass frees by reference counting) waits for the end of the save. Resuming the collector around it
cost more: the save's live objects, young when the evaluation begins, were promoted and brought on
full collections (a 256 ms one inside a searched save of the small chain, docs/BENCHMARKS.md).
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0           # regions open now, across threads
_resume = False      # whether the collector was on when the first of them began


@contextlib.contextmanager
def collector_paused():
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            resume = _depth == 0 and _resume
            if resume:
                gc.enable()
        if resume:
            gc.collect(0)  # the young collection the region deferred, paid by the region
