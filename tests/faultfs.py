"""A failing fsspec filesystem: wraps a real one (local or memory) and fails the Nth call.

Used by tests/test_storage_faults.py, tests/test_storage_s3.py and bench/faults.py::

    plan = FaultPlan()                                  # counts calls, fails none
    chain = CheckpointChain("faulty:///ckz/run", storage_options={"target_protocol": "memory", "plan": plan})
    plan.arm(at=3, error=TimeoutError("read timed out"), when="before", times=1)

``when``: "before" (the call does not happen), "after" (it happens, then the answer is lost: the
classic object-store fault), "kill" (SIGKILL of this process at that call, for crash tests).
``times``: how many consecutive calls fail from ``at`` on (1: a transient blip; a large number:
until ``plan.clear()``, e.g. a full disk).

The harness below runs an operation with a fault at its 1st call, then its 2nd, ... on a fresh
chain location each time (:func:`every_call`), and checks what a reader then finds
(:meth:`Location.check`); it drives this filesystem and the faulty S3 server (s3faults.py) alike.
"""
from __future__ import annotations

import errno
import os
import signal
import threading

import fsspec
import torch
from fsspec import AbstractFileSystem

from ckptzip.chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ckptzip.methods.lossless import LosslessMethod
from ckptzip.retry import RetryPolicy
from helpers import assert_same

FAST = RetryPolicy(first_delay_s=0.0)  # tests retry without waiting

TRANSIENT = {
    "timeout": lambda: TimeoutError("read timed out"),
    "reset": lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "throttle": lambda: OSError(errno.EBUSY, "SlowDown: Please reduce your request rate"),
}
PERMANENT = {
    "full": lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "read-only": lambda: OSError(errno.EROFS, os.strerror(errno.EROFS)),
    "denied": lambda: PermissionError(errno.EACCES, os.strerror(errno.EACCES)),
}


class FaultPlan:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []
        self.failed: list[tuple[int, str, str]] = []
        self.clear()

    def arm(self, at: int | None, error=None, *, when: str = "before", times: int = 1,
            ops: tuple[str, ...] | None = None):
        """Fail calls ``at`` .. ``at + times - 1`` (counted from now, 1-based; only ``ops`` if given)."""
        assert when in ("before", "after", "kill")
        with self.lock:
            self.calls.clear()
            self.failed.clear()
            self.at, self.error, self.when, self.times, self.ops = at, error, when, times, ops

    def clear(self) -> None:
        with self.lock:
            self.at, self.error, self.when, self.times, self.ops = None, None, "before", 0, None

    def hit(self, op: str, path: str) -> bool:
        """Whether this call fails."""
        with self.lock:
            if self.ops is not None and op not in self.ops:
                return False
            self.calls.append((op, path))
            n = len(self.calls)
            if self.at is None or not self.at <= n < self.at + self.times:
                return False
            self.failed.append((n, op, path))
            return True


class FaultyFileSystem(AbstractFileSystem):
    protocol = "faulty"
    cachable = False  # every chain gets the plan it was given

    def __init__(self, target_protocol: str = "memory", plan: FaultPlan | None = None,
                 target_options: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        opts = dict(target_options or {})
        if target_protocol in ("file", "local"):
            opts.setdefault("auto_mkdir", True)
        self.target = fsspec.filesystem(target_protocol, **opts)
        self.plan = plan if plan is not None else FaultPlan()

    def _do(self, op: str, path: str, fn, *args, **kwargs):
        if not self.plan.hit(op, path):
            return fn(path, *args, **kwargs)
        if self.plan.when == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.plan.when == "after":
            fn(path, *args, **kwargs)
        raise self.plan.error()

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self._do("cat_file", path, self.target.cat_file, start=start, end=end, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        return self._do("pipe_file", path, self.target.pipe_file, value, **kwargs)

    def exists(self, path, **kwargs):
        return self._do("exists", path, self.target.exists, **kwargs)

    def info(self, path, **kwargs):
        return self._do("info", path, self.target.info, **kwargs)

    def size(self, path):
        return self._do("size", path, self.target.size)

    def ls(self, path, detail=True, **kwargs):
        return self._do("ls", path, self.target.ls, detail=detail, **kwargs)

    def rm_file(self, path):
        return self._do("rm_file", path, self.target.rm_file)

    def makedirs(self, path, exist_ok=False):
        return self._do("makedirs", path, self.target.makedirs, exist_ok=exist_ok)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# --- the harness --------------------------------------------------------------------------------

def states(n, start=1):
    """``n`` small training-like states (weights drifting by small steps), as (step, state)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, generator=g)
    out = []
    for i in range(n):
        w = w - 1e-2 * torch.randn(300, generator=g)
        out.append((start + i, {"model": {"w": w.clone(), "b": w[:7].clone()}, "step": start + i}))
    return out


class Location:
    """One chain location (on a faulty filesystem or S3 server), and the states saved into it."""

    def __init__(self, url: str, opts: dict):
        self.url, self.opts, self.saved = url, opts, {}

    def make(self, **kw) -> CheckpointChain:
        kw.setdefault("keyframe", KeyframePolicy(every=2))
        kw.setdefault("retention", RetentionPolicy(keep_last=2))
        kw.setdefault("retry", FAST)
        return CheckpointChain(self.url, "lossless", storage_options=self.opts, **kw)

    def save(self, step: int, state: dict, chain: CheckpointChain | None = None):
        e = (chain or self.make()).save(state, step=step)
        self.saved[step] = state
        return e

    def seed(self, seq) -> "Location":
        chain = self.make()
        for step, state in seq:
            self.save(step, state, chain)
        return self

    def check(self) -> list[int]:
        """A fresh reader: verifies clean, the newest saved step is committed, the last two load exactly."""
        reader = self.make()
        assert reader.verify() == []
        steps = reader.steps()
        assert steps and set(steps) <= set(self.saved) and steps[-1] == max(self.saved), (steps, sorted(self.saved))
        for s in steps[-2:]:
            assert_same(self.saved[s], reader.load(s))
        return steps


def every_call(plan, new, op, arm):
    """``op(location)`` on a new location with a fault at its 1st call, then its 2nd, ... until it
    makes fewer calls than that; yields (location, result, whether the fault happened)."""
    at = 0
    while True:
        at += 1
        loc = new()
        arm(at)
        try:
            result = op(loc)
            hit = bool(plan.failed)
        finally:
            plan.clear()
        yield loc, result, hit
        if not hit:
            return


class HookedLossless(LosslessMethod):
    """Lossless, running ``hook`` once in the middle of its encode: between a save's read of the
    index and its commit, where another writer's commit makes the two race."""

    name = "lossless"
    hook = None

    def encode(self, state, reference, *, ctx):
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return super().encode(state, reference, ctx=ctx)
