"""Ranks agreeing on the step to resume from (BitSnap Fig. 4), over torch.distributed (gloo is enough)."""
from __future__ import annotations

from ..errors import ConfigError, StepNotFoundError
from .options import EngineOptions


def newest_common_step(per_rank: list[list[int]], step: int | None = None) -> int | None:
    """The step to resume from: ``step`` if every rank has it, else the newest step all ranks have.

    Fig. 4 of BitSnap: ranks hold {60, 80, 100} except rank 1, whose copy of 100 is torn: {60, 80}
    -> 80. None when no rank has anything; StepNotFoundError when ranks have steps but none in common.
    """
    sets = [set(s) for s in per_rank]
    if not any(sets):
        return None
    common = set.intersection(*sets)
    if step is not None:
        if step not in common:
            raise StepNotFoundError(f"step {step} is not available on every rank; per rank: {per_rank}")
        return step
    if not common:
        raise StepNotFoundError(f"no checkpoint step is available on every rank; per rank: {per_rank}")
    return max(common)


def rank_world(options: EngineOptions) -> tuple[int, int]:
    init = False
    try:
        import torch.distributed as dist

        init = dist.is_available() and dist.is_initialized()
    except ImportError:
        pass
    world = dist.get_world_size() if init else 1
    rank = options.rank if options.rank is not None else (dist.get_rank() if init else 0)
    return rank, world


def use_distributed(group) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ConfigError("restore(group=...) needs torch.distributed to be initialized")
        return False
    return group is not None or dist.get_world_size() > 1


def all_gather(steps: list[int], group) -> list[list[int]]:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(steps), group=group)
    return out
