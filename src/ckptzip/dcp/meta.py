"""DCP ``Metadata`` <-> JSON, so loading never unpickles (DCP's own ``.metadata`` is a pickle).

The JSON keeps everything a load at any world size needs to reshard: per tensor its dtype, global
size and the chunks (offsets, sizes) with the rank whose file holds each; per bytes item the rank;
the planner's data (DefaultSavePlanner: the flatten mapping, tuples of str/int) in a tagged form::

    {"tensors": {fqn: {"dtype": "float32", "size": [64, 32], "chunks": [[[0, 0], [32, 32], 0], ...]}},
     "bytes": {fqn: rank}, "planner_data": <tagged JSON>, "storage_meta": {...}, "dcp_version": "..."}

``to_metadata`` rebuilds the ``Metadata`` plus the lookup (fqn, chunk offsets) -> rank.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import CorruptCheckpointError, malformed
from ..tensorbytes import dtype_name, torch_dtype


def encode_value(obj, where: str = "planner_data"):
    """Tagged JSON for the plain values planners keep (dict/list/tuple/str/int/float/bool/None)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | int | float):
        return obj
    if isinstance(obj, tuple):
        return {"__t": "tuple", "v": [encode_value(v, where) for v in obj]}
    if isinstance(obj, list):
        return [encode_value(v, where) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__t": "dict", "items": {k: encode_value(v, where) for k, v in obj.items()}}
        return {"__t": "pairs", "items": [[encode_value(k, where), encode_value(v, where)] for k, v in obj.items()]}
    raise TypeError(f"{where}: cannot store {type(obj).__name__} without pickle; a custom planner must keep "
                    "its planner_data to dicts, lists, tuples, strings and numbers")


def decode_value(obj):
    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if isinstance(obj, dict):
        tag = obj.get("__t")
        if tag == "tuple":
            return tuple(decode_value(v) for v in obj["v"])
        if tag == "dict":
            return {k: decode_value(v) for k, v in obj["items"].items()}
        if tag == "pairs":
            return {decode_value(k): decode_value(v) for k, v in obj["items"]}
        raise CorruptCheckpointError(f"metadata: unknown value tag {tag!r}")
    return obj


def from_metadata(md: Metadata, chunk_ranks: dict[tuple[str, tuple[int, ...]], int],
                  bytes_ranks: dict[str, int]) -> dict:
    """JSON form of DCP's global metadata; ``chunk_ranks`` / ``bytes_ranks`` say which rank wrote what."""
    tensors, nbytes = {}, {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            chunks = []
            for c in sm.chunks:
                key = (fqn, tuple(int(o) for o in c.offsets))
                if key not in chunk_ranks:
                    raise RuntimeError(f"DCP planned chunk {key} but no rank reported writing it")
                chunks.append([list(key[1]), [int(s) for s in c.sizes], chunk_ranks[key]])
            tensors[fqn] = {"dtype": dtype_name(sm.properties.dtype), "size": [int(s) for s in sm.size],
                            "chunks": chunks}
        elif isinstance(sm, BytesStorageMetadata):
            if fqn not in bytes_ranks:
                raise RuntimeError(f"DCP planned bytes item {fqn!r} but no rank reported writing it")
            nbytes[fqn] = bytes_ranks[fqn]
        else:
            raise TypeError(f"{fqn}: unknown DCP storage metadata {type(sm).__name__}")
    sm = md.storage_meta
    return {"tensors": tensors, "bytes": nbytes,
            "planner_data": encode_value(md.planner_data),
            "storage_meta": None if sm is None else {"checkpoint_id": None if sm.checkpoint_id is None
                                                     else str(sm.checkpoint_id), "save_id": sm.save_id,
                                                     "modules": list(sm.modules)},
            "dcp_version": md.version}


def to_metadata(doc: dict, where: str) -> tuple[Metadata, dict[MetadataIndex, int]]:
    """(DCP Metadata, storage index -> rank) from the JSON form."""
    with malformed(f"{where}: the DCP metadata"):
        sdm: dict = {}
        ranks: dict[MetadataIndex, int] = {}
        for fqn, t in doc["tensors"].items():
            chunks = []
            for offsets, sizes, rank in t["chunks"]:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                ranks[MetadataIndex(fqn, offsets)] = int(rank)
            sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch_dtype(t["dtype"])),
                                             size=torch.Size(t["size"]), chunks=chunks)
        for fqn, rank in doc["bytes"].items():
            sdm[fqn] = BytesStorageMetadata()
            ranks[MetadataIndex(fqn)] = int(rank)
        smd = doc.get("storage_meta")
        storage_meta = StorageMeta(**smd) if isinstance(smd, dict) else StorageMeta()
        md = Metadata(state_dict_metadata=sdm, planner_data=decode_value(doc.get("planner_data")),
                      storage_data=dict(ranks), storage_meta=storage_meta, version=doc.get("dcp_version"))
    return md, ranks
