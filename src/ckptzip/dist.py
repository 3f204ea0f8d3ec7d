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
"""
from __future__ import annotations

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
