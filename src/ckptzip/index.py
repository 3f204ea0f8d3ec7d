"""The chain's index (``index.json``): the commit of a chain, and who may write it next.

Layout (JSON)::

    {"format": "ckptzip-chain", "version": 1,
     "entries": [Entry, ...],              # committed checkpoints, oldest first
     "sha256": sha256 of the canonical JSON of "entries",
     "owner": {...}}                       # the writer's lease record (lease.py); absent in 0.1 chains

The checksum covers the entries only, so 0.1 readers (which ignore unknown fields) still read an
index written with an owner. ``parse`` rejects a damaged or newer index with a one-line
CorruptCheckpointError; ``dumps`` writes one.

An entry pins its file by ``header_sha256`` (version 2: the container's digest, format.py; with the
blobs' own checksums, checked on every load, it covers every byte in one hash pass) or, in entries
written before, ``sha256`` of the whole file; ``file_matches`` checks whichever it has.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field

from .errors import CkptzipError, CorruptCheckpointError
from .format import decode_container, header_sha256, sha256

INDEX = "index.json"
INDEX_FORMAT = "ckptzip-chain"
INDEX_VERSION = 2   # 2: entries pin files by header_sha256 ("owner" was added to 1 without a bump)


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint as listed in the index."""

    step: int
    file: str
    parent: int | None
    keyframe: bool
    method: str
    nbytes: int
    raw_bytes: int
    sha256: str | None                                 # of the whole file (entries of index version 1)
    created_unix: float
    bytes_by_role: dict = field(default_factory=dict)  # role -> [raw, stored]
    summary: dict = field(default_factory=dict)        # method facts worth listing (config chosen, ...)
    header_sha256: str | None = None                   # the container's digest (index version 2)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.nbytes if self.nbytes else float("inf")

    @functools.cached_property
    def _json(self) -> tuple[str, str]:
        """(canonical JSON, JSON as ``dumps`` indents it in the index): each save rewrites the whole
        index, so an entry is serialized once, not once per later save."""
        d = dataclasses.asdict(self)
        return _canonical(d).decode(), json.dumps(d, indent=1).replace("\n", "\n  ")


@dataclass(frozen=True)
class Index:
    """One read of the index: its entries, owner record and storage version (None: no index yet)."""

    entries: list[Entry]
    owner: dict | None = None
    version: str | None = None


def file_matches(entry: Entry, data: bytes | memoryview, *, blobs: bool = True) -> bool:
    """Whether ``data`` is the file ``entry`` committed: its whole-file SHA-256, or its digest and
    (with ``blobs``) every blob against the checksum its header lists."""
    if entry.sha256 is not None and sha256(data) != entry.sha256:
        return False
    if entry.header_sha256 is None:
        return entry.sha256 is not None
    if header_sha256(data) != entry.header_sha256:
        return False
    if blobs:
        try:
            decode_container(data)
        except CkptzipError:
            return False
    return True


def checkpoint_file(step: int, tag: str | None = None) -> str:
    """A step's file name; ``tag`` makes it unique when the plain name is taken (by an orphan)."""
    return f"step-{step:012d}.ckz" if tag is None else f"step-{step:012d}.{tag}.ckz"


def parse(raw: bytes, version: str | None, where: str) -> Index:
    try:
        doc = json.loads(raw)
        body = doc["entries"]
        ok = doc.get("format") == INDEX_FORMAT and doc.get("sha256") == sha256(_canonical(body))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{where}: chain index is corrupt or not a ckptzip index; run `ckptzip verify` "
                                     "and restore it from a backup")
    if int(doc.get("version", 0)) > INDEX_VERSION:
        raise CorruptCheckpointError(f"{where}: index version {doc['version']} is newer than this ckptzip; "
                                     "upgrade ckptzip")
    return Index([Entry(**e) for e in body], doc.get("owner"), version)


def dumps(entries: list[Entry], owner: dict | None) -> bytes:
    """The index JSON (``json.dumps(doc, indent=1)``, built from each entry's cached serialization)."""
    canonical = "[" + ",".join(e._json[0] for e in entries) + "]"
    doc = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "entries": _SLOT, "sha256": sha256(canonical.encode()),
           "owner": owner}
    body = "[\n  " + ",\n  ".join(e._json[1] for e in entries) + "\n ]" if entries else "[]"
    return json.dumps(doc, indent=1).replace(json.dumps(_SLOT), body, 1).encode()


_SLOT = "\u0000entries\u0000"  # where dumps puts the entries (no JSON string of ours contains a NUL)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def replay_path(entries: list[Entry], step: int, url: str) -> list[int]:
    """The steps a restore of ``step`` decodes, keyframe first (CorruptCheckpointError on a broken link)."""
    by_step = {e.step: e for e in entries}
    path = []
    cur = step
    while True:
        e = by_step.get(cur)
        if e is None:
            raise CorruptCheckpointError(f"{url}: step {path[-1] if path else step} needs parent step {cur}, "
                                         "which is not in the chain")
        path.append(cur)
        if e.keyframe:
            return path[::-1]
        if len(path) > len(entries):
            raise CorruptCheckpointError(f"{url}: parent links form a cycle at step {cur}")
        cur = e.parent
