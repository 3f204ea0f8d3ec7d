"""``CompressedWriter``: a torch.distributed.checkpoint StorageWriter that writes ckptzip files.

    dcp.save(state_dict, storage_writer=CompressedWriter(root, step=100, method="dynaquant"))
    dcp.async_save(state_dict, storage_writer=CompressedWriter(root, step=200), process_group=pg)

DCP calls, in order (storage.py): ``reset`` -> ``set_up_storage_writer`` (all ranks) ->
``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator: refuses a step that is not after
the latest committed one) -> ``write_data`` (all ranks) -> ``finish`` (coordinator). In
``write_data`` each rank

1. turns its write items into a FlatState (shardstate.py: roles, parameter links, Adam facts);
2. picks its reference (memory.py): the state it wrote at its previous save, if that step is
   committed, the rank's layout (world size, chunks) is unchanged and the keyframe policy allows a
   delta; after a restart, rebuilt by replaying its own files; otherwise a keyframe;
3. with ``eval_fn`` (and a synchronous save): runs the config search collectively (search.py);
4. encodes through the method, with shared sketches merged across ranks (merge.py);
5. writes ``step-N/rank-R.ckz`` (rankfile.py) and keeps the new reference for the next save.

``finish`` writes the metadata and commit.json (layout.py), then applies retention. With several
ranks the small replicated items (step counters, bytes items) go to one ``shared.ckz`` written by
the coordinator. One save in flight per root (wait for an async save's future before
the next). The collectives of steps 3-4 run on ``process_group`` (default: the default group);
with ``dcp.async_save`` pass the same group you give async_save, as DCP needs for its own.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import jitcache
from ..chain import KeyframePolicy, RetentionPolicy
from ..configcheck import Range, check_args
from ..errors import ConfigError, StepOrderError
from ..format import DEFAULT_CHECKSUM
from ..methods.base import EncodeContext, Method, get_method
from ..methods.quantizing import QuantizingMethod
from . import memory, meta, merge, rankfile
from .layout import SHARED, Root, rank_file
from .shardstate import ShardState, build_shard_state


WRITER_ARGS = {"step": (int, Range(ge=0)), "keyframe": (KeyframePolicy | None, None),
               "retention": (RetentionPolicy | None, None), "storage_options": (dict | None, None),
               "threshold": (float, Range(ge=0)), "higher_is_better": (bool, None), "chunk_checksums": (bool, None)}


class CompressedWriter(StorageWriter):
    """See the module docstring. ``config``: the method's config (dataclass or dict); ``model``:
    the live (FSDP) model, for layer types and, with ``eval_fn``, the collective config search;
    ``chunk_checksums``: also hash each chunk's exact input bytes, which ``verify`` checks lossless
    decodes against (one more pass over the data per save)."""

    def __init__(self, root, step: int, method: str | Method = "lossless", config=None, *,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None, model: torch.nn.Module | None = None,
                 eval_fn=None, threshold: float = 0.01, higher_is_better: bool = False,
                 process_group=None, chunk_checksums: bool = False):
        super().__init__()
        check_args("CompressedWriter", WRITER_ARGS, step=step, keyframe=keyframe, retention=retention,
                   storage_options=storage_options, threshold=threshold, higher_is_better=higher_is_better,
                   chunk_checksums=chunk_checksums)
        if eval_fn is not None and not callable(eval_fn):
            raise ConfigError("CompressedWriter eval_fn must be a callable eval_fn(model) -> float score")
        self.root = Root(root, storage_options)
        self.step = step
        self.method = method if isinstance(method, Method) else get_method(method, config)
        jitcache.prepare(self.method.name)  # numba's kernels compile in a child meanwhile
        self.keyframe = keyframe or KeyframePolicy()
        self.retention = retention or RetentionPolicy()
        self.model, self.eval_fn = model, eval_fn
        self.threshold, self.higher_is_better = float(threshold), bool(higher_is_better)
        self.process_group = process_group
        self.chunk_checksums = bool(chunk_checksums)
        self.rank, self.is_coordinator = 0, True
        self._previous: int | None = None  # the latest committed step when this save was planned
        self.save_id = uuid.uuid4().hex

    # --- DCP protocol --------------------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.root = Root(checkpoint_id, self.root.storage_options)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._previous = latest = self.root.latest_step(default=None)
        if latest is not None and self.step <= latest:
            raise StepOrderError(f"step {self.step} is not after the latest committed step {latest} under "
                                 f"{self.root.url}; save increasing steps (or use a new root)")
        return _gather_replicated(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        group = merge.default_group(self.process_group)
        world = group.size() if group is not None else 1
        shared = set(plan.storage_data.get("shared", [])) if isinstance(plan.storage_data, dict) else set()
        items = [it for it in plan.items if it.index not in shared]
        jitcache.ready(self.method.name)
        shard, ref, mem = merge.guarded(lambda: self._prepare(items, planner, world), group, "preparing the save")
        method, search_info = self._search(shard, ref, group)
        ctx = EncodeContext(step=self.step, checksum=DEFAULT_CHECKSUM)  # rankfile.pack's containers
        t0 = time.perf_counter()
        (enc, new_ref), passes = merge.converge(lambda: method.encode(shard.flat, ref, ctx=ctx), group)
        encode_s = time.perf_counter() - t0
        layout = shard.layout(world)
        parent = mem.step if (mem is not None and not enc.keyframe) else None
        data = rankfile.pack(shard, enc, method, step=self.step, rank=self.rank, world_size=world, layout=layout,
                             parent_step=parent, parent_sha256=mem.sha256 if parent is not None else None)
        self._write(self.rank, data)
        chain = (mem.chain if parent is not None else ()) + (self.step,)
        digest = rankfile.digest(data)
        memory.remember(self.root, self.rank, memory.RankMemory(self.step, digest, layout, method.descriptor, chain,
                                                                new_ref, getattr(method, "search_state", None)))
        info = {"rank": self.rank, "file": rank_file(self.rank), "sha256": digest, "nbytes": len(data),
                "keyframe": bool(enc.keyframe), "parent": parent, "chain": list(chain), "layout": layout,
                "raw_bytes": shard.raw_bytes(), "method": method.descriptor, "passes": passes,
                "encode_s": round(encode_s, 3),
                "reference_bytes": sum(t.numel() * t.element_size() for t in new_ref.tensors()),
                "summary": {**enc.meta.get("summary", {}), **search_info}}
        results = _results(items, self.rank, info)
        if shared:
            results += self._write_shared([it for it in plan.items if it.index in shared], planner, method, world)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write(self, rank: int, data: bytes) -> None:
        st = self.root.step_store(self.step)
        st.makedirs()
        st.write_atomic(rank_file(rank), data)

    def _write_shared(self, items, planner, method: Method, world: int) -> list[WriteResult]:
        """(coordinator) The small replicated items every loading rank needs, as one keyframe of their own."""
        shard = build_shard_state(items, planner, model=self.model, checksums=self.chunk_checksums)
        enc, _ = method.encode(shard.flat, None, ctx=EncodeContext(step=self.step))
        data = rankfile.pack(shard, enc, method, step=self.step, rank=SHARED, world_size=world,
                             layout=shard.layout(world), parent_step=None, parent_sha256=None)
        self._write(SHARED, data)
        info = {"rank": SHARED, "file": rank_file(SHARED), "sha256": rankfile.digest(data), "nbytes": len(data),
                "keyframe": True, "parent": None, "chain": [self.step], "layout": shard.layout(world),
                "raw_bytes": shard.raw_bytes(), "method": method.descriptor, "passes": 1, "summary": {}}
        return _results(items, SHARED, info)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        chunk_ranks, bytes_ranks, files = {}, {}, {}
        for per_rank in results:
            for wr in per_rank:
                sd = wr.storage_data
                if wr.index.offset is None:
                    bytes_ranks[wr.index.fqn] = sd["rank"]
                else:
                    chunk_ranks[(wr.index.fqn, tuple(int(o) for o in wr.index.offset))] = sd["rank"]
                if "file" in sd:
                    files[sd["rank"]] = sd["file"]
        order = sorted(files, key=lambda r: (r < 0, r))  # rank 0 first, shared.ckz last
        doc = {"format": "ckptzip-dcp-metadata", "step": self.step, "world_size": len(results),
               "ranks": [files[r] for r in order], **meta.from_metadata(metadata, chunk_ranks, bytes_ranks)}
        needs = {s for f in files.values() for s in f["chain"]}
        self.root.write_commit(self.step, len(results), doc, needs)  # the commit
        stale = self.root.orphans(before=self.step, after=self._previous)
        for s in self.root.retention_drops(self.retention, self.step) + stale:
            self.root.delete_step(s)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.root.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.root.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen automatically: pass a CompressedWriter explicitly

    # --- one rank's save ---------------------------------------------------------------------
    def _prepare(self, items: list, planner: SavePlanner, world: int):
        shard = build_shard_state(items, planner, model=self.model, checksums=self.chunk_checksums)
        mem = memory.recall(self.root, self.rank, shard.layout(world), self.method)
        if mem is None:
            return shard, None, None
        if len(mem.chain) >= self.keyframe.every or len(mem.chain) > self._max_replay():
            return shard, None, None
        return shard, mem.reference, mem

    def _max_replay(self) -> int:
        return self.keyframe.max_replay if self.keyframe.max_replay is not None else self.keyframe.every - 1

    def _search(self, shard: ShardState, ref, group) -> tuple[Method, dict]:
        """The method for this save: the configured one, or with the knobs a collective search chose."""
        method = self.method
        if not (isinstance(method, QuantizingMethod) and self.eval_fn is not None and self.model is not None
                and method.config.search.enabled):
            return method, {}
        if threading.current_thread() is not threading.main_thread():
            return method, {"search": "off", "reason": "asynchronous save: the live model keeps training"}
        from .search import search_knobs

        mem = memory.last(self.root, self.rank)
        prior = mem.search_state if mem is not None else None
        t0 = time.perf_counter()
        knobs, info, state = search_knobs(method, shard, ref, model=self.model, eval_fn=self.eval_fn,
                                          threshold=self.threshold, higher_is_better=self.higher_is_better,
                                          step=self.step, search_state=prior, group=group)
        cfg = method.config  # the knobs chosen, the search off: this save's fixed config
        chosen = get_method(method.descriptor, dataclasses.replace(
            cfg, quantizer=dataclasses.replace(cfg.quantizer, **knobs),
            search=dataclasses.replace(cfg.search, enabled=False)))
        chosen.search_state = state
        return chosen, {**info, "search_state": state, "search_s": round(time.perf_counter() - t0, 3)}


SHARED_MAX_BYTES = 64 * 1024  # replicated items up to this size go to step-N/shared.ckz


def _gather_replicated(plans: list[SavePlan]) -> list[SavePlan]:
    """With several ranks: the small replicated items (whole tensors that DCP's dedup spread over
    the ranks -- step counters, small buffers -- and bytes items) move to the coordinator's plan,
    listed in its storage_data; it writes them to ``shared.ckz``. Every loading rank needs them, and
    one small file costs it one read instead of one read (and decode) of every rank's file."""
    if len(plans) < 2:
        return plans
    moved, out = [], []
    for p in plans:
        keep = []
        for it in p.items:
            small = it.type == WriteItemType.BYTE_IO or (
                it.type == WriteItemType.TENSOR and (it.tensor_storage_size() or 0) <= SHARED_MAX_BYTES)
            (moved if small else keep).append(it)
        out.append(dataclasses.replace(p, items=keep))
    out[0] = dataclasses.replace(out[0], items=out[0].items + moved, storage_data={"shared": [it.index for it in moved]})
    return out


def _results(items, rank: int, info: dict) -> list[WriteResult]:
    """One WriteResult per item, naming the file that holds it; the first carries the file's facts."""
    return [WriteResult(index=item.index, size_in_bytes=item.tensor_storage_size() or 0,
                        storage_data={"rank": rank, **({"file": info} if i == 0 else {})})
            for i, item in enumerate(items)]
