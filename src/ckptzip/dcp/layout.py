"""Where a compressed DCP checkpoint lives, and how a step is committed.

Layout under one root (any fsspec URL)::

    <root>/step-000000000100/rank-00000.ckz   one container per rank (format.py): that rank's shards
    <root>/step-000000000100/rank-00001.ckz
    <root>/step-000000000100/shared.ckz         (several ranks) small replicated items, by the coordinator
    <root>/step-000000000100/metadata.json.zst  DCP metadata (zstd'd JSON, no pickle) + the rank file table
    <root>/step-000000000100/commit.json      written last, by the coordinator: the commit

A save writes every rank's file, then (coordinator, in ``StorageWriter.finish``, which DCP calls
only after every rank's ``write_data`` returned) the metadata, then commit.json, which names the
metadata's SHA-256. A step without a valid commit.json does not exist for readers: a rank
killed mid-save leaves at most files that no commit names, and the previous step stays the
latest. commit.json is small (it lists the steps a restore of this step replays, for retention)
so finding and judging steps costs one LIST plus one small GET per step, whatever the world size.
The metadata grows with the number of chunks (tensors x ranks) but is regular (FSDP's chunks
differ only in their offsets), so zstd keeps it small: 17.8 MB of JSON -> about 0.1 MB for a
7B-parameter AdamW state at 1,000 ranks (docs/DCP.md).

Retention deletes a step by removing its commit.json first, then its files: a crash in between
leaves an uncommitted folder (``orphans`` / ``gc``), never a committed step with missing files.

Call order (writer): ranks ``step_store(step).write_atomic(rank_file(r), ...)`` -> coordinator
``write_commit(...)`` -> ``delete_step`` for each of ``retention_drops(...)`` and ``orphans(...)``.
Reader: ``latest_step`` (or a given step) -> ``read_commit`` -> ``read_metadata``.
"""
from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass

import zstandard

from ..chain import RetentionPolicy
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError
from ..format import sha256
from ..storage import Storage

FORMAT = "ckptzip-dcp"
VERSION = 1
COMMIT = "commit.json"
SHARED = -1                  # the "rank" of shared.ckz: small replicated items, written by the coordinator
SHARED_FILE = "shared.ckz"
METADATA = "metadata.json.zst"
_MAX_METADATA = 1 << 32  # a decompressed metadata document larger than this is not ours
_STEP_RE = re.compile(r"^step-(\d{12})$")
_RAISE = object()


def step_dir(step: int) -> str:
    return f"step-{int(step):012d}"


def rank_file(rank: int) -> str:
    return SHARED_FILE if rank == SHARED else f"rank-{int(rank):05d}.ckz"


def dumps(obj) -> bytes:
    """Canonical JSON (sorted keys, compact): what checksums are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Commit:
    """The commit record of one step (commit.json)."""

    step: int
    world_size: int
    metadata_sha256: str
    metadata_nbytes: int
    needs: tuple[int, ...]      # every step a restore of this one reads (its own included)
    created_unix: float

    def to_json(self) -> bytes:
        return dumps({"format": FORMAT, "version": VERSION, "step": self.step, "world_size": self.world_size,
                      "metadata_sha256": self.metadata_sha256, "metadata_nbytes": self.metadata_nbytes,
                      "needs": list(self.needs), "created_unix": self.created_unix})

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "Commit":
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                raise ValueError
            if int(d.get("version", 0)) > VERSION:
                raise CorruptCheckpointError(f"{where}: commit version {d['version']} is newer than this ckptzip "
                                             "reads; upgrade ckptzip")
            return cls(int(d["step"]), int(d["world_size"]), str(d["metadata_sha256"]), int(d["metadata_nbytes"]),
                       tuple(int(s) for s in d["needs"]), float(d["created_unix"]))
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError):
            raise CorruptCheckpointError(f"{where}: not a ckptzip DCP commit record (corrupt commit.json); "
                                         "the step is unusable, load an earlier one") from None


def parse_metadata(raw: bytes, where: str) -> dict:
    try:
        return json.loads(zstandard.ZstdDecompressor().decompress(raw, max_output_size=_MAX_METADATA))
    except (zstandard.ZstdError, ValueError):
        raise CorruptCheckpointError(f"{where}: metadata is not zstd-compressed JSON") from None


class Root:
    """One root of compressed DCP checkpoints: step folders, commits, retention."""

    def __init__(self, url, storage_options: dict | None = None):
        self.url = str(url).rstrip("/")
        self.storage_options = storage_options
        self.store = Storage(self.url, storage_options)

    def step_store(self, step: int) -> Storage:
        """The step folder as a Storage sharing the root's filesystem client and retry policy (one
        client per root: creating an object-store client costs far more than a request)."""
        st = copy.copy(self.store)
        st.root, st.url = f"{self.store.root}/{step_dir(step)}", f"{self.url}/{step_dir(step)}"
        return st

    def where(self, step: int, name: str = "") -> str:
        return f"{self.url}/{step_dir(step)}" + (f"/{name}" if name else "")

    # --- listing ---------------------------------------------------------------------------
    def step_folders(self) -> list[int]:
        """Every step folder, committed or not, ascending."""
        out = []
        for name in self.store.list():
            m = _STEP_RE.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def is_committed(self, step: int) -> bool:
        return self.step_store(step).exists(COMMIT)

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_folders() if self.is_committed(s)]

    def latest_step(self, default=_RAISE) -> int:
        """The newest committed step (one LIST, then one HEAD per folder from the newest down);
        ``default`` instead of raising when there is none."""
        for s in reversed(self.step_folders()):
            if self.is_committed(s):
                return s
        if default is not _RAISE:
            return default
        raise IncompleteCheckpointError(f"{self.url}: no committed DCP checkpoint (no step folder with a "
                                        f"{COMMIT}); save one first or check the root URL")

    # --- commit ----------------------------------------------------------------------------
    def read_commit(self, step: int) -> Commit:
        st = self.step_store(step)
        try:
            raw = st.read(COMMIT)
        except FileNotFoundError:
            committed = self.committed_steps()
            raise StepNotFoundError(f"step {step} is not committed under {self.url}; committed steps: "
                                    f"{committed or 'none'}") from None
        c = Commit.from_json(raw, self.where(step, COMMIT))
        if c.step != step:
            raise CorruptCheckpointError(f"{self.where(step, COMMIT)}: holds step {c.step}, folder says {step}")
        return c

    def read_metadata_bytes(self, step: int, commit: Commit | None = None) -> bytes:
        """The stored metadata of a committed step, checked against its commit record."""
        commit = commit or self.read_commit(step)
        where = self.where(step, METADATA)
        try:
            raw = self.step_store(step).read(METADATA)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: committed metadata is missing") from None
        if sha256(raw) != commit.metadata_sha256:
            raise CorruptCheckpointError(f"{where}: does not match the SHA-256 in its {COMMIT} (corrupt metadata)")
        return raw

    def read_metadata(self, step: int, commit: Commit | None = None) -> dict:
        return parse_metadata(self.read_metadata_bytes(step, commit), self.where(step, METADATA))

    def write_commit(self, step: int, world_size: int, metadata: dict, needs) -> Commit:
        """The coordinator's commit: the metadata, then commit.json (created exclusively, last)."""
        st = self.step_store(step)
        st.makedirs()
        doc = json.dumps(metadata, separators=(",", ":"), allow_nan=False).encode()  # keeps the state's key order
        raw = zstandard.ZstdCompressor(level=3).compress(doc)
        st.write_atomic(METADATA, raw)
        c = Commit(step, world_size, sha256(raw), len(raw), tuple(sorted(set(needs) | {step})), time.time())
        try:
            st.create(COMMIT, c.to_json())  # exclusive: two jobs committing one step cannot both win
        except FileExistsError:
            raise FileExistsError(f"{self.where(step, COMMIT)}: another writer committed step {step} "
                                  "first; two jobs are saving to one root") from None
        return c

    # --- retention and cleanup ---------------------------------------------------------------
    def retention_drops(self, policy: RetentionPolicy, latest: int) -> list[int]:
        """Committed steps that ``policy`` lets go: never the latest, nor any step a kept one needs."""
        if policy.keep_last is None and policy.keep_every is None:
            return []
        steps = sorted({s for s in self.committed_steps() if s <= latest} | {latest})
        wanted = {latest}
        if policy.keep_last is not None:
            wanted |= set(steps[-policy.keep_last:])
        if policy.keep_every is not None:
            wanted |= {s for s in steps if s % policy.keep_every == 0}
        needed: set[int] = set()
        for s in wanted:
            needed |= set(self.read_commit(s).needs)
        return [s for s in steps if s not in needed]

    def delete_step(self, step: int) -> None:
        """Uncommit first (delete commit.json), then remove the folder."""
        st = self.step_store(step)
        st.delete(COMMIT)
        try:
            st.fs.rm(st.root, recursive=True)
        except FileNotFoundError:
            pass

    def orphans(self, before: int | None = None, after: int | None = None) -> list[int]:
        """Step folders without a commit (crashed or in-flight saves), strictly between ``after``
        and ``before`` when given (a newer one may be a save in flight; a writer only looks above
        the step it last saw committed, so a save costs no request per older folder)."""
        return [s for s in self.step_folders() if (before is None or s < before)
                and (after is None or s > after) and not self.is_committed(s)]
