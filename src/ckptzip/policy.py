"""When a chain writes a keyframe, and which checkpoints it keeps.

``keyframe_due`` decides before each save whether it is encoded alone (a keyframe) or against the
writer's reference; ``retention_split`` decides after it which entries the committed index keeps
and which files are deleted after the commit. Retention never drops a step a kept one replays.
"""
from __future__ import annotations

from dataclasses import dataclass

from .configcheck import Range, check_fields
from .index import Entry, replay_path


@dataclass(frozen=True)
class KeyframePolicy:
    every: int = 10                   # a keyframe at least every `every` saves
    max_replay: int | None = None     # bound on deltas decoded by one restore (None: every - 1)
    max_replay_bytes_ratio: float | None = None  # also start a keyframe when the deltas since the last
                                                 # one exceed this multiple of its size

    def __post_init__(self):
        check_fields(self, every=Range(ge=1), max_replay=Range(ge=0), max_replay_bytes_ratio=Range(ge=0))


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None      # keep the newest N steps (None: keep all)
    keep_every: int | None = None     # also keep every step divisible by this

    def __post_init__(self):
        check_fields(self, keep_last=Range(ge=1), keep_every=Range(ge=1))


def keyframe_due(policy: KeyframePolicy, entries: list[Entry], ref_step: int, url: str) -> bool:
    """Whether the next save (after ``entries``, against the reference of ``ref_step``) is a keyframe."""
    if not entries:
        return True
    since = 0
    for e in reversed(entries):
        if e.keyframe:
            break
        since += 1
    if since + 1 >= policy.every:
        return True
    path = replay_path(entries, ref_step, url)
    max_replay = policy.max_replay if policy.max_replay is not None else policy.every - 1
    if len(path) > max_replay:  # the new delta would need len(path) files replayed before it
        return True
    r = policy.max_replay_bytes_ratio
    if r is not None:
        kf = next(e for e in entries if e.step == path[0])
        deltas = sum(e.nbytes for e in entries if e.step in set(path[1:]))
        return deltas > r * kf.nbytes
    return False


def retention_split(policy: RetentionPolicy, entries: list[Entry], url: str) -> tuple[list[Entry], list[Entry]]:
    """(kept, dropped) entries: the newest, ``keep_last``, ``keep_every`` and all they replay from."""
    if policy.keep_last is None and policy.keep_every is None:
        return entries, []
    wanted = {entries[-1].step}
    if policy.keep_last is not None:
        wanted |= {e.step for e in entries[-policy.keep_last:]}
    if policy.keep_every is not None:
        wanted |= {e.step for e in entries if e.step % policy.keep_every == 0}
    needed = set()
    for s in wanted:
        needed |= set(replay_path(entries, s, url))
    return [e for e in entries if e.step in needed], [e for e in entries if e.step not in needed]
