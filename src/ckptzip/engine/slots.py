"""The slot pool: the R shared-memory slots of one chain and rank, which is free, which holds what.

A slot is rewritten only after the agent has settled the commit reading it (``busy`` is that
commit's seq until then), so the agent reads slots in place. ``acquire`` takes a free slot (new
ones first, else the one holding the oldest step), growing it when the state outgrew it; with none
free it waits for the agent (a BackpressureWarning, once per save). All calls are made under the
engine's condition, which ``acquire`` waits on.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from . import staging
from .options import BackpressureWarning, EngineOptions

_MiB = 1 << 20


@dataclass
class Slot:
    seg: staging.Segment
    step: int = -1            # step it holds (-1: nothing restorable: new, torn, discarded, corrupt)
    seq: int = -1
    busy: int | None = None   # seq of the unsettled commit reading it


class SlotPool:
    def __init__(self, key: str, rank: int, ctl: staging.Control, options: EngineOptions,
                 cond: threading.Condition):
        self.key, self.rank, self.ctl, self.options, self.cond = key, rank, ctl, options, cond
        self.slots: dict[int, Slot] = {}
        self._budget_warned = False

    def scan(self) -> int:
        """Map the slots a previous trainer left (they are what restore() reads first); the next seq."""
        top, next_seq = 0, 0
        for i in range(max(self.ctl.n_slots, self.options.redundancy)):
            try:
                seg = staging.Segment(staging.slot_name(self.key, self.rank, i), populate=True)
            except FileNotFoundError:
                continue
            info = staging.read_header(seg)
            ok = info.usable and staging.verify_slot(seg, info)
            self.slots[i] = Slot(seg, info.step if ok else -1, info.seq if ok else -1)
            next_seq = max(next_seq, info.seq + 1)
            top = i + 1
        self.ctl.n_slots = max(self.ctl.n_slots, top)
        return next_seq

    def in_memory(self) -> dict[int, int]:
        """step -> slot of every complete slot whose checksum verifies now (re-checked: memory may rot)."""
        for s in self.slots.values():
            if s.step >= 0 and s.busy is None and not staging.verify_slot(s.seg, staging.read_header(s.seg)):
                s.step = -1
        return {s.step: i for i, s in self.slots.items() if s.step >= 0}

    def discard_newer(self, step: int) -> None:
        """Mark every settled slot newer than ``step`` discarded (other ranks lack it)."""
        for s in self.slots.values():
            if s.step > step and s.busy is None:
                staging.set_discarded(s.seg)
                s.step = -1

    def release(self, i: int | None, seq: int) -> None:
        if i is not None and i in self.slots and self.slots[i].busy == seq:
            self.slots[i].busy = None

    def acquire(self, total: int, step: int, waiting: Callable[[], list[int]]) -> int:
        """A free slot of at least ``total`` bytes; ``waiting()`` (steps still committing) while none is."""
        cap = -(-total // _MiB) * _MiB
        n = self._slot_count(cap)
        for i in [i for i in self.slots if i >= n and self.slots[i].busy is None]:
            self._drop(i)  # a budget that now fits fewer slots: free the extra ones
        warned = False
        while True:
            free = [i for i in range(n) if i not in self.slots or self.slots[i].busy is None]
            if free:
                i = min(free, key=lambda j: (0, 0) if j not in self.slots else (1, self.slots[j].step))
                self._ensure_capacity(i, total, cap)
                return i
            behind = waiting()
            if not warned and self.options.warn_on_backpressure:
                warned = True
                warnings.warn(BackpressureWarning(
                    f"async save of step {step} waits for the agent, which is still committing steps {behind}; "
                    "save less often, raise EngineOptions.redundancy (memory), or use a faster method"),
                    stacklevel=3)
            self.cond.wait(0.05)

    def _slot_count(self, cap: int) -> int:
        r, budget = self.options.redundancy, self.options.memory_budget_bytes
        n = slots_for_budget(cap, r, budget)
        if n < r and not self._budget_warned:
            self._budget_warned = True
            warnings.warn(f"memory_budget_bytes={budget} holds {n} of the {r} redundant in-memory checkpoints "
                          f"({cap} bytes each); raise it to keep {r}", stacklevel=4)
        return n

    def _ensure_capacity(self, i: int, total: int, cap: int) -> None:
        s = self.slots.get(i)
        if s is not None and s.seg.size >= total and not s.seg.stale():
            return
        grow = cap - (s.seg.size if s is not None else 0)
        free = staging.shm_free_bytes()
        if free is not None and grow > free:
            raise ConfigError(f"shared memory ({staging.SHM_DIR}) has {free} bytes free, an async save needs {grow} "
                              "more; lower EngineOptions.redundancy, enlarge /dev/shm (docker: --shm-size) "
                              "or use async_save=False")
        if s is not None:
            s.seg.close()
        seg = staging.Segment(staging.slot_name(self.key, self.rank, i), size=cap, create=True, populate=True)
        self.slots[i] = Slot(seg)
        self.ctl.n_slots = max(self.ctl.n_slots, i + 1)

    def _drop(self, i: int) -> None:
        s = self.slots.pop(i)
        s.seg.close()
        staging.unlink(s.seg.name)

    def close(self) -> None:
        """Unmap every slot and unlink the chain's segments (control block included)."""
        for s in self.slots.values():
            s.seg.close()
        staging.unlink_chain(self.key, self.rank, max(self.ctl.n_slots, self.options.redundancy))


def slots_for_budget(slot_bytes: int, redundancy: int, budget_bytes: int | None) -> int:
    """How many slots of ``slot_bytes`` to keep: ``redundancy``, fewer if the budget holds fewer."""
    if budget_bytes is None:
        return redundancy
    n = budget_bytes // slot_bytes
    if n < 1:
        raise ConfigError(f"a staged checkpoint needs {slot_bytes} bytes of shared memory, over "
                          f"memory_budget_bytes={budget_bytes}; raise the budget or use async_save=False")
    return min(n, redundancy)
