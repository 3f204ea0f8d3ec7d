"""What one rank keeps between saves to one root: the reference its next delta is taken against.

    mem = recall(root, rank, layout, method)   # None: the next save is a keyframe
    ... encode against mem.reference ...
    remember(root, rank, RankMemory(...))      # after the rank's file is written (not yet committed)

References live in this process, keyed by (root URL, rank), so the usual DCP pattern -- a new
``CompressedWriter`` per save -- still writes deltas. ``recall`` hands one out only if a delta
against it is valid now: the rank's layout (world size, chunks) and the method are unchanged and
that save committed (a rank whose previous save died with its job starts a keyframe). After a
restart (nothing in memory) the rank rebuilds it by replaying its own file of the latest committed
step, if that file has the same layout; any failure there just means a keyframe. ``forget`` drops
them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import CkptzipError
from ..methods.base import Method, Reference
from . import rankfile
from .layout import Root


@dataclass
class RankMemory:
    step: int
    sha256: str                  # the file's digest (rankfile.digest): a delta names its parent by it
    layout: str
    method: str                  # descriptor: a method change starts with a keyframe
    chain: tuple[int, ...]       # steps a restore of ``step`` replays, keyframe first
    reference: Reference
    search_state: dict | None = None


_MEMORY: dict[tuple[str, int], RankMemory] = {}
_LOCK = threading.Lock()


def remember(root: Root, rank: int, mem: RankMemory) -> None:
    with _LOCK:
        _MEMORY[(root.url, rank)] = mem


def last(root: Root, rank: int) -> RankMemory | None:
    """Whatever this rank kept for ``root`` (valid or not)."""
    with _LOCK:
        return _MEMORY.get((root.url, rank))


def forget(root: str | None = None) -> None:
    """Drop the references kept for ``root`` (every root when None); the next save is a keyframe
    or replays the rank's files."""
    with _LOCK:
        for key in [k for k in _MEMORY if root is None or k[0] == str(root).rstrip("/")]:
            del _MEMORY[key]


def recall(root: Root, rank: int, layout: str, method: Method) -> RankMemory | None:
    """The rank's previous save, if a delta against it is valid now (see the module docstring)."""
    mem = last(root, rank)
    if mem is None:
        mem = _replay_own_file(root, rank, layout, method)
        if mem is not None:
            remember(root, rank, mem)
    if mem is None or mem.layout != layout or mem.method != method.descriptor:
        return None
    if not root.is_committed(mem.step):
        return None  # that save never committed (a rank died): this one starts a keyframe
    return mem


def _replay_own_file(root: Root, rank: int, layout: str, method: Method) -> RankMemory | None:
    step = root.latest_step(default=None)
    if step is None:
        return None
    try:
        entry = next((f for f in root.read_metadata(step)["ranks"] if f["rank"] == rank), None)
        if entry is None or entry["layout"] != layout or entry["method"] != method.descriptor:
            return None
        rf, ref = rankfile.replay(root, step, rank, entry["sha256"])
    except CkptzipError:
        return None  # unreadable history: a keyframe is always correct
    method.resume(rf.manifest.get("method_meta", {}))  # e.g. the config search's previous best
    state = (entry.get("summary") or {}).get("search_state")
    return RankMemory(step, entry["sha256"], layout, entry["method"], tuple(entry["chain"]), ref, state)
