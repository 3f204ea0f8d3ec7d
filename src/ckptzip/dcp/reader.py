"""``CompressedReader``: a torch.distributed.checkpoint StorageReader for ckptzip DCP roots.

    dcp.load(state_dict, storage_reader=CompressedReader(root))            # latest committed step
    dcp.load(state_dict, storage_reader=CompressedReader(root, step=100))

Works at any world size, and without a process group (plain tensors): DCP's planner turns the
stored chunk layout (metadata.json) into read items -- which slice of which saved chunk goes where
-- and ``read_data`` serves them. DCP calls ``reset`` -> ``read_metadata`` (all ranks) ->
``set_up_storage_reader`` -> ``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator) ->
``read_data``. Per source rank whose chunks this rank needs, ``read_data`` decodes that rank's
file (replaying its deltas from their keyframe, each file checked against the checksum its commit
or child names) and copies the requested slices; a missing or corrupt file raises
``CorruptCheckpointError`` naming it. Bytes items go to the planner verbatim (DCP's own planner
deserializes them; ``ckptzip restore`` uses a planner that refuses anything but plain data).
"""
from __future__ import annotations

import io
import struct
import uuid

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..configcheck import Range, check_args
from ..errors import CorruptCheckpointError
from . import meta, merge, rankfile
from .layout import METADATA, Root, parse_metadata


class CompressedReader(StorageReader):
    """See the module docstring. ``step=None``: the latest step committed when the load starts.
    With a process group, rank 0 reads the commit and metadata and broadcasts them (one object-store
    read per load, not one per rank)."""

    def __init__(self, root, step: int | None = None, *, storage_options: dict | None = None,
                 device: str = "cpu", process_group=None):
        super().__init__()
        check_args("CompressedReader", {"step": (int | None, Range(ge=0)), "storage_options": (dict | None, None)},
                   step=step, storage_options=storage_options)
        self.root = Root(root, storage_options)
        self.step = step
        self.device = device
        self.process_group = process_group
        self.load_id = uuid.uuid4().hex
        self._ranks: dict[MetadataIndex, int] = {}
        self._files: dict[int, str] = {}
        self.loaded_step: int | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.root = Root(checkpoint_id, self.root.storage_options)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata, which we never write
            raise FileNotFoundError(f"{self.root.url}: ckptzip writes one metadata per step, none per rank")
        group = merge.default_group(self.process_group)
        payload = merge.from_first_rank(self._read_step, group, "reading the checkpoint metadata")
        step, raw = struct.unpack("<q", payload[:8])[0], payload[8:]
        where = self.root.where(step, METADATA)
        doc = parse_metadata(raw, where)
        md, self._ranks = meta.to_metadata(doc, where)
        self._files = {int(f["rank"]): f["sha256"] for f in doc["ranks"]}
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        self.loaded_step = step
        return md

    def _read_step(self) -> bytes:
        """(rank 0) The step to load and its verified metadata bytes."""
        step = self.step if self.step is not None else self.root.latest_step()
        return struct.pack("<q", step) + self.root.read_metadata_bytes(step)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if not self._ranks:
            raise RuntimeError("CompressedReader.set_up_storage_reader before read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_rank: dict[int, list] = {}
        for req in plan.items:
            rank = self._ranks.get(req.storage_index)
            if rank is None:
                raise CorruptCheckpointError(f"{self.root.where(self.loaded_step)}: metadata lists no file for "
                                             f"{req.storage_index.fqn} at {list(req.storage_index.offset or [])}")
            by_rank.setdefault(rank, []).append(req)
        methods: dict = {}
        for rank in sorted(by_rank):  # one source file decoded at a time bounds memory
            if rank not in self._files:
                raise CorruptCheckpointError(f"{self.root.where(self.loaded_step)}: metadata names rank {rank} "
                                             "but has no file entry for it")
            wanted = {(r.storage_index.fqn, tuple(int(o) for o in r.storage_index.offset)) for r in by_rank[rank]
                      if r.type != LoadItemType.BYTE_IO}
            rf, _ = rankfile.replay(self.root, self.loaded_step, rank, self._files[rank], device=self.device,
                                    methods=methods, only=wanted)
            index = rf.chunk_index()
            for req in by_rank[rank]:
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(rf.io_bytes(fqn)))
                    continue
                name = index.get((fqn, tuple(int(o) for o in req.storage_index.offset)))
                if name is None:
                    raise CorruptCheckpointError(f"{rf.where}: holds no chunk of {fqn} at "
                                                 f"{list(req.storage_index.offset)}")
                src = narrow_tensor_by_index(rf.tensor(name), req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(f"{rf.where}: chunk {name!r} gives {list(src.size())} for a "
                                                 f"request of {list(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
            del rf
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self.root.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
