"""One rank's file: the method's encoding of its shards, in the chain's container format.

The container (format.py: safetensors header, a checksum per blob, SHA-256 of the manifest) holds the
method's blobs plus DCP's bytes items, and a manifest that says everything a reader needs without
the writer's config::

    {"kind": "dcp-rank", "step", "rank", "world_size", "layout", "keyframe",
     "parent_step", "parent_sha256",            # a delta names its parent file's digest
     "method", "config", "method_meta", "skeleton", "extra",
     "records": {name: TensorRecord fields + pipeline/meta/blobs},
     "chunks": {name: [fqn, offsets, sizes]},     # the DCP chunk each record (or alias) holds
     "aliases": {name: stored name}, "context": [names], "io": {fqn: {"blob", "codec"}},
     "chunk_sha256": {name: SHA-256 of the exact input bytes} (opt-in), "raw_bytes": int}

A file's *digest* (what the metadata table and a child name) is the SHA-256 of its header: the
header holds the manifest, which holds every blob's checksum, and every load checks the blobs, so
the digest pins every byte without a second hash pass over the data at save time.

Decode recipe (``replay``): follow ``parent_step`` links from the requested file back to a
keyframe (each parent must match the checksum its child recorded), then decode forward through
the method named in each file; ``RankFile.chunk_index()`` maps (fqn, offsets) to a record and
``RankFile.tensor(record)`` serves it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import zstandard

from .. import jitcache
from ..errors import CorruptCheckpointError, malformed
from ..format import decode_container, encode_container, header_sha256, sha256
from ..methods.base import DecodeContext, Encoded, Method, method_for_file
from ..state import TensorRecord, on_device
from ..tensorbytes import to_numpy_bits
from .layout import Root, rank_file
from .shardstate import ShardState

KIND = "dcp-rank"
_IO_PREFIX = "dcp-io."
_ZSTD_ABOVE = 256  # bytes items below this stay raw (a zstd frame would not pay for itself)
LOSSLESS_METHODS = frozenset({"lossless", "bitsnap-lossless"})  # decode must reproduce chunk_sha256


def digest(data: bytes | memoryview) -> str:
    """SHA-256 of the container's header (see the module docstring)."""
    return header_sha256(data)


def pack(shard: ShardState, enc: Encoded, method: Method, *, step: int, rank: int, world_size: int,
         layout: str, parent_step: int | None, parent_sha256: str | None) -> bytes:
    """Container bytes of one rank's save."""
    flat = shard.flat
    missing = set(flat.records) - set(enc.records)
    if missing:
        raise RuntimeError(f"method {method.name} left records unencoded: {sorted(missing)[:5]}")
    blobs = dict(enc.blobs)
    io_table = {}
    for i, (fqn, raw) in enumerate(sorted(shard.io_items.items())):
        key = f"{_IO_PREFIX}{i}"
        packed = len(raw) > _ZSTD_ABOVE
        blobs[key] = zstandard.ZstdCompressor(level=3).compress(raw) if packed else raw
        io_table[fqn] = {"blob": key, "codec": "zstd" if packed else "raw", "nbytes": len(raw)}
    records = {n: {**rec.to_dict(), **enc.records[n]} for n, rec in flat.records.items()}
    manifest = {
        "kind": KIND, "step": step, "rank": rank, "world_size": world_size, "layout": layout,
        "keyframe": bool(enc.keyframe), "parent_step": None if enc.keyframe else parent_step,
        "parent_sha256": None if enc.keyframe else parent_sha256,
        "method": method.descriptor, "config": method.config_dict(), "method_meta": enc.meta,
        "skeleton": flat.skeleton if enc.skeleton is None else enc.skeleton, "extra": flat.extra, "records": records,
        "chunks": {n: c.to_json() for n, c in shard.chunks.items()}, "aliases": shard.aliases,
        "context": shard.context, "io": io_table, "chunk_sha256": shard.chunk_sha256,
        "raw_bytes": shard.raw_bytes(),
    }
    if not enc.keyframe and parent_step is None:
        raise RuntimeError("a delta needs its parent step")
    return encode_container(manifest, blobs, digests=enc.digests)


@dataclass
class RankFile:
    """A decoded rank file: its manifest, tensors by record name, and DCP's bytes items."""

    manifest: dict
    tensors: dict[str, torch.Tensor]
    blobs: dict[str, bytes]
    where: str

    def chunk_index(self) -> dict[tuple[str, tuple[int, ...]], str]:
        return {(c[0], tuple(c[1])): name for name, c in self.manifest["chunks"].items()}

    def tensor(self, name: str) -> torch.Tensor:
        name = self.manifest["aliases"].get(name, name)
        try:
            return self.tensors[name]
        except KeyError:
            raise CorruptCheckpointError(f"{self.where}: record {name!r} is missing") from None

    def io_bytes(self, fqn: str) -> bytes:
        entry = self.manifest["io"].get(fqn)
        if entry is None:
            raise CorruptCheckpointError(f"{self.where}: holds no bytes item {fqn!r}")
        data = self.blobs[entry["blob"]]
        if entry["codec"] == "zstd":
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=int(entry["nbytes"]))
        return data

    def verify_exact(self) -> None:
        """For lossless methods: every decoded chunk must hash to what the writer hashed."""
        for name, want in self.manifest.get("chunk_sha256", {}).items():
            if name not in self.tensors:
                continue  # not decoded (a partial replay)
            got = sha256(to_numpy_bits(self.tensors[name]).data)
            if got != want:
                raise CorruptCheckpointError(f"{self.where}: record {name!r} decodes to bytes that differ from "
                                             "what was saved (checksum of the shard)")


def _parse(data: bytes, where: str, step: int, rank: int):
    c = decode_container(data, name=where)
    m = c.manifest
    if m.get("kind") != KIND or m.get("step") != step or m.get("rank") != rank:
        raise CorruptCheckpointError(f"{where}: holds {m.get('kind')} step {m.get('step')} rank {m.get('rank')}, "
                                     f"expected step {step} rank {rank}")
    return c


def _read(root: Root, step: int, rank: int, want_sha: str | None, why: str) -> bytes:
    where = root.where(step, rank_file(rank))
    try:
        data = root.step_store(step).read(rank_file(rank))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {why} shard file is missing") from None
    if want_sha is not None and digest(data) != want_sha:
        raise CorruptCheckpointError(f"{where}: {why} shard file fails its checksum (corrupt or replaced)")
    return data


def check_file(root: Root, step: int, rank: int, sha: str | None) -> dict:
    """Read one rank file, check its checksum and container; returns its manifest (no decode)."""
    return _parse(_read(root, step, rank, sha, "committed"), root.where(step, rank_file(rank)), step, rank).manifest


def replay(root: Root, step: int, rank: int, sha: str | None, *, device="cpu", methods: dict | None = None,
           only: set[tuple] | None = None, verify_exact: bool = False) -> tuple[RankFile, object]:
    """Decode rank ``rank``'s file of ``step`` (checksum ``sha``), replaying from its keyframe.
    Returns the file and the method's reference after it (what a delta on top would use).

    ``only``: the chunks the caller needs, as (fqn, offsets) (a loading rank that wants a few
    replicated tensors of another rank's file); methods decode records independently unless one
    depends on another (DynaQuant's m on its v), in which case the whole file is decoded after all. ``verify_exact``:
    for lossless methods, also check every decoded record against the checksum of what was saved.
    Every file's blobs are hashed once; its header digest must match what its commit or child recorded."""
    methods = {} if methods is None else methods
    if only is not None:
        try:
            return _replay(root, step, rank, sha, device, methods, only, verify_exact)
        except CorruptCheckpointError:
            pass  # a needed record depends on one outside ``only``: decode everything (re-raises real damage)
    return _replay(root, step, rank, sha, device, methods, None, verify_exact)


def _replay(root: Root, step: int, rank: int, sha, device, methods: dict, only, verify_exact: bool):
    path = []  # (step, container), newest first
    cur_step, cur_sha, why = step, sha, "committed"
    while True:
        where = root.where(cur_step, rank_file(rank))
        c = _parse(_read(root, cur_step, rank, cur_sha, why), where, cur_step, rank)
        path.append((cur_step, c))
        with malformed(f"{where}: the manifest"):
            if c.manifest["keyframe"]:
                break
            cur_step, cur_sha = int(c.manifest["parent_step"]), str(c.manifest["parent_sha256"])
        if len(path) > 10_000:
            raise CorruptCheckpointError(f"{root.url}: rank {rank} parent links do not reach a keyframe")
        why = f"step {step} needs this parent"
    if only is not None:  # chunk keys -> the records that hold them (an alias's stored record)
        newest = path[0][1].manifest
        with malformed(f"{root.where(step, rank_file(rank))}: the chunk table"):
            index = {(c[0], tuple(c[1])): n for n, c in newest["chunks"].items()}
            only = {newest["aliases"].get(index[k], index[k]) for k in only if k in index}
    ref = None
    for s, c in reversed(path):
        m = c.manifest
        where = root.where(s, rank_file(rank))
        with malformed(f"{where}: the manifest"):
            key = m["method"] + json.dumps(m.get("config", {}), sort_keys=True)
            if key not in methods:
                methods[key] = method_for_file(m["method"], m.get("config"))
            wanted = m["records"] if only is None else {n: r for n, r in m["records"].items() if n in only}
            records = {n: TensorRecord.from_dict(n, r) for n, r in wanted.items()}
            enc = Encoded(records={n: {"pipeline": r["pipeline"], "meta": r.get("meta", {}), "blobs": r["blobs"]}
                                   for n, r in m["records"].items()},
                          blobs=c.blobs, meta=m.get("method_meta", {}), keyframe=m["keyframe"])
        jitcache.ready(m["method"])  # outside malformed(): its faults are not the manifest's
        try:
            tensors, ref = methods[key].decode(records, enc, ref, ctx=DecodeContext(step=s))
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
    rf = RankFile(path[0][1].manifest, tensors, path[0][1].blobs, root.where(step, rank_file(rank)))
    if verify_exact and rf.manifest["method"].split("/")[0] in LOSSLESS_METHODS:
        rf.verify_exact()
    rf.tensors = on_device(rf.tensors, device)
    return rf, ref
