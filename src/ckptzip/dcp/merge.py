"""Sharded statistics: every shard of a tensor gets the thresholds and codebook of the whole tensor.

A lossy method quantizes each rank's shards, but its statistics (DynaQuant's pruning and
protection thresholds per layer type, each tensor's k-means codebook) must describe whole tensors:
that is what a single process computes, and shards of one tensor must decode with one codebook.
Quantizers pass every LogSketch through ``dist.shared_sketch(key, local)``; ``converge`` runs the
method in *passes* inside a sharing session:

    pass 1   every sketch is local; the session records each (key -> sketch)
    merge    dist.all_reduce_sketches: every rank gets the exact merge per key (one dense all-reduce)
    pass n   shared_sketch answers with the merge from pass n-1; sketches computed from shared
             results (values left after shared thresholds, Adam's m normalized by a shared-codebook v)
             change, so they are recorded and merged again
    stop     when no rank's recorded sketches changed: the last pass used merges of exactly the
             sketches it computed, i.e. the single-process statistics; its output is the result

Weights converge in 3 passes (thresholds, then codebooks), Adam moments in 5 (v, then m normalized
by the decoded v). Collectives happen only between passes and their number depends only on
all-reduced flags, so ranks never diverge in their collective calls whatever their data (a rank
with an empty shard, or one whose method raised, still joins; errors are re-raised on every rank).
Without a process group ``converge`` just calls the function once.
"""
from __future__ import annotations

import json
from collections.abc import Callable

from .. import dist

MAX_PASSES = 8


def default_group(process_group=None):
    """The group a sharded save or load runs its collectives on: ``process_group``, else the
    default group when torch.distributed is initialized with more than one rank, else None."""
    import torch.distributed as tdist

    if process_group is not None:
        return process_group
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        return tdist.group.WORLD
    return None


class SketchSession:
    """Answers ``dist.shared_sketch`` from the previous pass's merge; records this pass's sketches."""

    def __init__(self):
        self.merged: dict[str, object] = {}
        self.recorded: dict[str, object] = {}

    def resolve(self, key: tuple, local):
        k = json.dumps([list(key), local.alpha, local.min_value])  # sketches merge only at equal accuracy
        prev = self.recorded.get(k)
        if prev is not None and prev != local:
            raise RuntimeError(f"sketch key {key} was used twice in one pass for different data; "
                               "a quantizer must key each statistic uniquely")
        self.recorded[k] = local.copy()
        m = self.merged.get(k)
        return m.copy() if m is not None else local


def guarded(fn: Callable[[], object], group, what: str):
    """Run ``fn`` on every rank, then agree on whether any failed (so no rank waits in a later
    collective for one that raised): the failing rank re-raises its error, the others name it."""
    if group is None:
        return fn()
    err, out = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the collective
        err = e
    failed = dist.all_reduce_max([float(err is not None)], group)[0] > 0
    if err is not None:
        raise err
    if failed:
        raise RuntimeError(f"{what} failed on another rank; see its traceback")
    return out


def from_first_rank(fn: Callable[[], bytes], group, what: str) -> bytes:
    """``fn()`` run by group rank 0 only, its bytes broadcast to every rank (one object-store read
    instead of one per rank); rank 0's error is raised on every rank."""
    if group is None:
        return fn()
    err, data = None, b""
    if group.rank() == 0:
        try:
            data = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            err = e
    n = dist.broadcast_floats([-1.0 if err is not None else float(len(data))], group)[0]
    if err is not None:
        raise err
    if n < 0:
        raise RuntimeError(f"{what} failed on rank 0; see its traceback")
    return dist.broadcast_bytes(data, int(n), group)


def converge(fn: Callable[[], object], group, *, what: str = "sharded encode"):
    """``fn()`` with every shared sketch merged over ``group`` (see the module docstring).
    Returns (fn's result of the last pass, number of passes)."""
    if group is None:
        return fn(), 1
    session = SketchSession()
    prev: dict | None = None
    for n in range(1, MAX_PASSES + 1):
        session.recorded = {}
        err, out = None, None
        try:
            with dist.sharing_sketches(session):
                out = fn()
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
            err = e
        rec = session.recorded
        changed = prev is None or rec.keys() != prev.keys() or any(rec[k] != prev[k] for k in rec)
        failed, any_changed, any_keys = dist.all_reduce_max([float(err is not None), float(changed),
                                                             float(bool(rec))], group)
        if err is not None:
            raise err
        if failed:
            raise RuntimeError(f"{what} failed on another rank; see its traceback")
        if not any_keys or (n > 1 and not any_changed):
            return out, n
        session.merged = dist.all_reduce_sketches(rec, group)
        prev = rec
    raise RuntimeError(f"{what}: shared sketches did not settle in {MAX_PASSES} passes; the method's "
                       "statistics depend on each other in a cycle")
