"""torch.distributed helpers: parallel config-search trials across data-parallel ranks.

Data-parallel replicas hold identical models, so m ranks can evaluate m search candidates at once
(Inshrinkerator section 5.3). The pattern is one collective per round::

    rows = gather_round(items, fn, width=k, group=group)   # rank r computes fn(items[r])
    # every rank now holds the same k-float row of every item, in item order

and every rank then takes the same decision from the same rows, so control flow never diverges
and no rank waits on a collective the others skip. A rank whose ``fn`` raises still joins the
collective (with an error flag); then every rank raises, the failing one with its own traceback.

``group=None`` means "not distributed": ``gather_round`` just computes every item in this
process. The search never joins the default group on its own (a loop in which only rank 0 saves
would hang); pass ``torch.distributed.group.WORLD`` or a subgroup to opt in. Backends: gloo (CPU
tensors) and nccl (the rows travel on this rank's current CUDA device).

**Shared sketches** (sharded saves, ckptzip.dcp): when each rank holds shards of the same tensors,
a quantizer's statistics must come from every shard. Quantizers pass each LogSketch they build
through ``shared_sketch(key, local)``: outside a sharing session it returns ``local`` unchanged;
inside one (``sharing_sketches(session)``) the session records it and answers with the merge of
every rank's sketch under the same key (dcp/merge.py runs the passes and the collectives, so no
collective ever happens inside a quantizer's data-dependent control flow). ``all_reduce_sketches``
is that merge: one dense all-reduce of bucket counts, independent of the number of ranks.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections.abc import Callable, Sequence

import torch

from .errors import ConfigError


def world(group=None) -> tuple[int, int]:
    """(rank, size) of this process in ``group``; (0, 1) when group is None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("a process group was given but torch.distributed is not initialized; "
                          "call torch.distributed.init_process_group first or pass group=None")
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(row: Sequence[float], group) -> list[list[float]]:
    """Every rank's ``row`` (same length everywhere), as float64, in rank order."""
    import torch.distributed as dist

    t = torch.tensor(list(row), dtype=torch.float64, device=_device(group))
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu().tolist() for o in out]


def broadcast_floats(values: Sequence[float], group, src: int = 0) -> list[float]:
    """Group rank ``src``'s values on every rank (so all ranks decide from the same numbers)."""
    if group is None:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t.cpu().tolist()


def gather_round(items: Sequence, fn: Callable[[object], Sequence[float]], *, width: int,
                 group=None) -> list[list[float]]:
    """One round of parallel trials: rank r computes ``fn(items[r])`` (a list of ``width`` floats).

    Returns the rows of all items in order, identical on every rank. ``len(items)`` must not
    exceed the group size (callers chunk); ranks without an item only join the collective.
    """
    rank, size = world(group)
    if size == 1:
        return [list(map(float, fn(it))) for it in items]
    if len(items) > size:
        raise ValueError(f"gather_round got {len(items)} items for {size} ranks; chunk them first")
    err = None
    row = [0.0] * (width + 1)
    if rank < len(items):
        try:
            vals = [float(v) for v in fn(items[rank])]
            if len(vals) != width:
                raise ValueError(f"gather_round: fn returned {len(vals)} values, expected {width}")
            row = [1.0] + vals
        except Exception as e:  # noqa: BLE001 - re-raised below, after the collective
            err = e
            row = [-1.0] + [0.0] * width
    rows = all_gather_rows(row, group)
    failed = [r for r, x in enumerate(rows[:len(items)]) if x[0] < 0]
    if err is not None:
        raise err
    if failed:
        raise RuntimeError(f"config-search trial failed on rank(s) {failed}; see their tracebacks")
    return [x[1:] for x in rows[:len(items)]]


def broadcast_bytes(data: bytes, nbytes: int, group, src: int = 0) -> bytes:
    """Group rank ``src``'s ``data`` on every rank (the others pass b"" and the length they were told)."""
    import torch.distributed as dist

    dev = _device(group)
    if dist.get_rank(group) == src:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if nbytes else torch.empty(0, dtype=torch.uint8)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    if nbytes:
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
    return t.cpu().numpy().tobytes()


# --- shared sketches ---------------------------------------------------------------------------

_SHARING: contextvars.ContextVar = contextvars.ContextVar("ckptzip_sketch_sharing", default=None)


def shared_sketch(key: tuple, local):
    """The sketch a quantizer should use for the statistic ``key`` (a tuple of str/int naming what
    was sketched, the same on every rank that holds part of it): ``local`` outside a sharing session,
    else the session's merge over all ranks (see the module docstring). Treat the result as read-only."""
    session = _SHARING.get()
    return local if session is None else session.resolve(key, local)


def sharing() -> bool:
    """Whether quantizers run inside a sharing session (their data is one shard of each tensor)."""
    return _SHARING.get() is not None


@contextlib.contextmanager
def sharing_sketches(session):
    """Route ``shared_sketch`` calls in this thread to ``session.resolve(key, local)``."""
    token = _SHARING.set(session)
    try:
        yield session
    finally:
        _SHARING.reset(token)


def all_reduce_max(values: Sequence[float], group) -> list[float]:
    """Element-wise max over the group's ranks (float64)."""
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def _agree_on_keys(keys: list[str], group) -> list[str]:
    """The sorted union of every rank's keys: one all-reduce when all ranks hold the same keys
    (the usual case), an all-gather of the key lists otherwise."""
    import torch.distributed as dist

    digest = int.from_bytes(hashlib.sha256(json.dumps(keys).encode()).digest()[:6], "little")
    lo_hi = all_reduce_max([-digest, digest], group)
    if -lo_hi[0] == lo_hi[1]:
        return keys
    lists: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, keys, group=group)
    return sorted(set().union(*lists))


def all_reduce_sketches(sketches: dict[str, object], group) -> dict:
    """Merge LogSketches by key across ``group``: every rank gets, for every key any rank holds,
    the sketch of all ranks' values under that key (exact, as LogSketch.merge).

    Collectives (the same on every rank, whatever it holds): key agreement, one MAX all-reduce of
    the ordinal ranges, one SUM all-reduce of dense int64 counts over those ranges. The bytes moved
    per rank depend on the number of keys and buckets, not on the number of ranks (ring all-reduce).
    """
    import torch.distributed as dist

    from .sketch import LogSketch

    keys = _agree_on_keys(sorted(sketches), group)
    big = float(2 ** 52)
    local = {k: sketches[k].ordinal_counts() for k in keys if k in sketches}
    ranges = []
    for k in keys:  # per key: max of (-min ordinal, max ordinal, alpha, min_value); absent/empty: neutral
        o = local[k][0] if k in local else torch.zeros(0, dtype=torch.int64)
        p = sketches.get(k)
        ranges += [-float(o.min()) if o.numel() else -big, float(o.max()) if o.numel() else -big,
                   p.alpha if p is not None else -1.0, p.min_value if p is not None else -1.0]
    g = all_reduce_max(ranges, group)
    spans, total = [], 0
    for i, k in enumerate(keys):
        lo, hi = -g[4 * i], g[4 * i + 1]
        n = int(hi - lo) + 1 if hi >= lo else 0
        spans.append((int(lo) if n else 0, total, n))
        total += n
    dense = torch.zeros(total, dtype=torch.int64, device=_device(group))
    for k, (lo, off, n) in zip(keys, spans):
        if k in local and local[k][0].numel():
            o, c = local[k]
            dense.index_add_(0, (o - lo + off).to(dense.device), c.to(dense.device))
    dist.all_reduce(dense, op=dist.ReduceOp.SUM, group=group)
    dense = dense.cpu()
    out = {}
    for i, (k, (lo, off, n)) in enumerate(zip(keys, spans)):
        alpha, min_value = g[4 * i + 2], g[4 * i + 3]  # a key's sketches share them (callers key by alpha)
        c = dense[off:off + n]
        out[k] = LogSketch.from_ordinal_counts(alpha, torch.arange(lo, lo + n, dtype=torch.int64), c,
                                               min_value=min_value)
    return out
