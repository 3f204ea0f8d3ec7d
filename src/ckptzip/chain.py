"""A chain of compressed checkpoints in one storage location.

Layout::

    <url>/index.json               the commit: every committed step, written last and atomically
    <url>/step-000000000100.ckz    one container per checkpoint (format.py)

A save writes its container first (a new name, never replacing one: ``Storage.create``), then
commits ``index.json`` by compare-and-swap against the index it started from
(``Storage.write_if``); only then is the step visible. A crash at any moment leaves the previous
index (and so the previous checkpoints) intact; at worst an orphan container that no index names,
which ``verify`` reports and ``gc`` removes. Retention commits the shorter index first and deletes
files after, so a crash mid-sweep leaves orphans, never a dangling entry. Keyframes are decoded
alone; a delta names its parent, and a restore replays the path from the nearest keyframe forward.
Retention never deletes a checkpoint that a kept one needs.

One writer per chain at a time, enforced (lease.py): the index names its owner; a second live
writer gets ChainBusyError at its first save, a writer taken over from (``takeover=True``) is
fenced at its next commit, and no commit based on a stale index lands. Readers may run
concurrently: a file that vanishes under a reader (retention after a newer commit) makes it re-read
the index and retry. Storage calls retry transient faults (retry.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
import warnings
from dataclasses import dataclass

import torch

from . import jitcache
from .codec.stages import check_pipeline
from .configcheck import OneOf, Range, check_args
from .errors import (ChainBusyError, CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError,
                     StepOrderError, StorageError, WriteConflictError, malformed)
from .format import CHECKSUMS, DEFAULT_CHECKSUM, container_payload, decode_container, header_sha256, read_manifest
from .gcpause import collector_paused
from .index import INDEX, Entry, Index, checkpoint_file, dumps, file_matches, parse, replay_path
from .lease import Lease
from .methods.base import DecodeContext, EncodeContext, Encoded, Method, Reference, get_method, method_for_file
from .payload import Payload
from .policy import KeyframePolicy, RetentionPolicy, keyframe_due, retention_split
from .retry import RetryPolicy
from .state import FlatState, TensorRecord, flatten_state, on_device, on_host, skeleton_refs, unflatten_state
from .verify import Problem, verify_chain

READ_ATTEMPTS = 4   # a reader re-reads the index this often when files vanish under it


@dataclass
class Restored:
    """A decoded checkpoint: the rebuilt state plus what the file said about it."""

    step: int
    state: dict
    flat: FlatState
    manifest: dict


CHAIN_ARGS = {"keyframe": (KeyframePolicy | None, None), "retention": (RetentionPolicy | None, None),
              "storage_options": (dict | None, None), "takeover": (bool, None), "lease_s": (float, Range(gt=0)),
              "retry": (RetryPolicy | None, None), "checksum": (str, OneOf(tuple(CHECKSUMS)))}


class CheckpointChain:
    """Save and restore a training state as a chain of compressed checkpoints.

    >>> chain = CheckpointChain("runs/ckpt", method="lossless")
    >>> chain.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=100)
    >>> state = chain.load()            # latest; chain.load(step=100) for a given one

    ``takeover=True`` lets this writer fence a live owner of the chain (a stuck or preempted job
    still running) instead of raising ChainBusyError; ``lease_s`` is how long after its last
    commit an owner on another machine counts as live; ``retry`` bounds retries of storage calls;
    ``checksum`` is each blob's checksum in the files written: ``"blake3"`` (default), ``"sha256"``
    or ``"crc32"`` (against accidental corruption only; docs/FORMAT.md section 1.4).
    """

    def __init__(self, url, method: str | Method = "lossless", config=None, *,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None, takeover: bool = False, lease_s: float = 600.0,
                 retry: RetryPolicy | None = None, base=None, checksum: str = DEFAULT_CHECKSUM):
        from .basestate import BaseWeights
        from .storage import Storage

        check_args("CheckpointChain", CHAIN_ARGS, keyframe=keyframe, retention=retention,
                   storage_options=storage_options, takeover=takeover, lease_s=lease_s, retry=retry,
                   checksum=checksum)
        self.storage = Storage(url, storage_options, retry=retry)
        self.url = str(url)
        self.method = method if isinstance(method, Method) else get_method(method, config)
        self.keyframe = keyframe or KeyframePolicy()
        self.retention = retention or RetentionPolicy()
        self.base = BaseWeights.of(base)  # keyframes coded against it, and restores need it (basestate.py)
        self.checksum = checksum          # of each blob in the files it writes (format.py; readers take all)
        self._lease = Lease(self.url, takeover=takeover, lease_s=lease_s)
        self._index: Index | None = None
        self._ref: Reference | None = None          # what the next save encodes against
        self._ref_version: str | None = None        # the index version the reference belongs to
        jitcache.prepare(self.method.name)          # numba's kernels compile in a child meanwhile

    # --- index ----------------------------------------------------------------------------
    def entries(self, *, refresh: bool = False) -> list[Entry]:
        if self._index is None or refresh:
            self._load_index()
        return list(self._index.entries)

    def steps(self) -> list[int]:
        return [e.step for e in self.entries(refresh=True)]

    def manifest(self, step: int | None = None) -> dict:
        """The manifest of ``step``'s file (latest when None): method, config, method_meta, records."""
        e = self.entry(step)
        return read_manifest(self.storage.read(e.file), name=self.storage.path(e.file))

    def entry(self, step: int | None = None) -> Entry:
        entries = self.entries()
        if not entries:
            raise IncompleteCheckpointError(f"{self.url}: no committed checkpoint (empty chain or no index.json)")
        if step is None:
            return entries[-1]
        for e in entries:
            if e.step == step:
                return e
        raise StepNotFoundError(f"step {step} is not in the chain at {self.url}; committed steps: "
                                f"{_short_list([e.step for e in entries])}")

    def _load_index(self) -> Index:
        raw, version = self.storage.read_versioned(INDEX)
        if raw is not None and self._index is not None and version == self._index.version:
            return self._index  # the index this chain object wrote or read last: nothing to parse
        self._index = Index([]) if raw is None else parse(raw, version, self.storage.path(INDEX))
        return self._index

    def _moved(self, base: Index) -> bool:
        """Whether a writer committed since ``base`` was read (a reader's cue to retry)."""
        return self.storage.read_versioned(INDEX)[1] != base.version

    def _commit(self, entries: list[Entry], base: Index, record: dict, what: str) -> None:
        """Write the index if it is still ``base`` (compare-and-swap); ChainBusyError if another writer won."""
        record = {**record, "renewed_unix": round(time.time(), 3)}  # the lease runs from the last commit
        try:
            version = self.storage.write_if(INDEX, dumps(entries, record), base.version)
        except WriteConflictError:
            try:
                owner = self._load_index().owner
            except Exception:
                owner = None
            raise self._lease.lost(owner, what) from None
        self._lease.held(record)
        self._index = Index(list(entries), record, version)

    def _claim(self) -> tuple[Index, dict]:
        """The current index and the owner record this writer commits with (ChainBusyError if not ours)."""
        base = self._load_index()
        return base, self._lease.claim(base.owner)

    def check_writer(self) -> None:
        """Raise ChainBusyError now if a save would (another live writer owns the chain)."""
        self._claim()

    # --- save -----------------------------------------------------------------------------
    @collector_paused()
    def save(self, state: dict | FlatState, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, ctx: EncodeContext | None = None) -> Entry:
        """Encode and commit one checkpoint. Returns its index entry."""
        step = int(step)
        jitcache.ready(self.method.name)
        flat = on_host(state if isinstance(state, FlatState) else
                       flatten_state(state, model, optimizer, step_records=self.method.step_records))
        failure = _StorageContext(f"saving step {step} to {self.url} failed")
        with failure:  # a StorageError says what it interrupted and what stays loadable
            base, record = self._claim()
            entries = failure.entries = base.entries
            if entries and step <= entries[-1].step:
                raise StepOrderError(f"step {step} is not after the chain's latest step {entries[-1].step}; "
                                 "save increasing steps (or start a new chain, or truncate this one)")
            ctx = ctx or EncodeContext(step=step, model=model)
            # the reference is replaced by the new one, or forgotten on failure: the method may reuse it
            ctx = dataclasses.replace(ctx, step=step, base=self.base, reference_spent=True, checksum=self.checksum,
                                      gradients=ctx.gradients and {n: g.cpu() for n, g in ctx.gradients.items()})
            if base.version != self._ref_version:
                self.forget_reference()  # another writer (or chain object) committed since: rebuild it
            fname = None
            try:
                ref = self._writer_reference(entries)
                if ctx.force_keyframe or self._keyframe_due(entries, ref):
                    ctx, ref = dataclasses.replace(ctx, recycle=ref), None  # its buffers may take the new copies
                t0 = time.perf_counter()
                enc, new_ref = self.method.encode(flat, ref, ctx=ctx)
                missing = set(flat.records) - set(enc.records)
                if missing:
                    raise RuntimeError(f"method {self.method.name} left records unencoded: {sorted(missing)[:5]}")
                parent = None if enc.keyframe else ref.step
                manifest = self._manifest(flat, enc, step, parent)
                data = container_payload(manifest, enc.blobs, checksum=self.checksum, digests=enc.digests)  # never joined
                self.storage.makedirs()
                fname = self._create_file(step, data)
                entry = Entry(step=step, file=fname, parent=parent, keyframe=enc.keyframe, method=self.method.descriptor,
                              nbytes=len(data), raw_bytes=manifest["raw_bytes"], sha256=None,
                              header_sha256=header_sha256(data), created_unix=time.time(),
                              bytes_by_role=_bytes_by_role(flat, enc),
                              summary={**enc.meta.get("summary", {}), "encode_s": round(time.perf_counter() - t0, 4)})
                keep, drop = retention_split(self.retention, entries + [entry], self.url)
                self._commit(keep, base, record, f"saving step {step}")
            except BaseException as e:
                self.forget_reference()  # the method may have moved on: the next save rebuilds from storage
                if fname is None or not self._settle_failed_commit(e, fname):
                    raise
        self._ref, self._ref_version = new_ref, self._index.version
        self._sweep(drop)
        return entry

    def _create_file(self, step: int, data: Payload) -> str:
        name = checkpoint_file(step)
        try:
            self.storage.create(name, data)
        except FileExistsError:  # an orphan, or another writer's save in flight: never replace it
            name = checkpoint_file(step, uuid.uuid4().hex[:8])
            self.storage.create(name, data)
        return name

    def _settle_failed_commit(self, err: BaseException, fname: str) -> bool:
        """After a failed save: True if its commit landed after all (a lost answer), else delete its file."""
        if not isinstance(err, ChainBusyError):  # a lost race is certain; anything else may have landed
            try:
                index = self._load_index()
            except Exception:
                return False  # unknown: keep the file (committed, or an orphan for gc)
            if any(e.file == fname for e in index.entries):
                self._lease.held(index.owner)
                return True
        try:
            self.storage.delete(fname)  # created by this save, named by no index
        except Exception:
            pass  # an orphan: gc removes it
        return False

    def _sweep(self, drop: list[Entry]) -> None:
        """Delete files the committed index no longer names; a failure leaves orphans, not damage."""
        failed = []
        for e in drop:
            try:
                self.storage.delete(e.file)
            except Exception as err:
                failed.append(f"{e.file} ({type(err).__name__}: {err})")
        if failed:
            warnings.warn(f"{self.url}: could not delete {len(failed)} file(s) retention dropped: {failed[0]}; "
                          "the chain is intact; CheckpointChain.gc() removes them later", stacklevel=3)

    def _manifest(self, flat: FlatState, enc: Encoded, step: int, parent: int | None) -> dict:
        records = {}
        for name, rec in flat.records.items():
            records[name] = {**rec.to_dict(), **enc.records[name]}
        return {
            "step": step, "parent_step": parent, "keyframe": enc.keyframe,
            "method": self.method.descriptor, "config": self.method.config_dict(),
            "method_meta": enc.meta, "skeleton": flat.skeleton if enc.skeleton is None else enc.skeleton,
            "extra": flat.extra,
            "records": records,
            "raw_bytes": sum(r.nbytes for r in flat.records.values()),
        }

    def _keyframe_due(self, entries: list[Entry], ref: Reference | None) -> bool:
        return ref is None or keyframe_due(self.keyframe, entries, ref.step, self.url)

    def _writer_reference(self, entries: list[Entry]) -> Reference | None:
        """The reference for the next save; after a restart, rebuilt by replaying the latest step."""
        if not entries:
            self._ref = None
            return None
        last = entries[-1]
        if last.method != self.method.descriptor:
            return None  # a method change starts with a keyframe
        if self._ref is None or self._ref.step != last.step:
            (_, manifest), self._ref = self._replay(last.step, entries)
            self.method.resume(manifest.get("method_meta", {}))
        return self._ref

    # --- load -----------------------------------------------------------------------------
    def load(self, step: int | None = None) -> dict:
        """The training state of ``step`` (latest when None), as the objects that were saved."""
        return self.restore(step).state

    @collector_paused()
    def restore(self, step: int | None = None, *, device: str | torch.device = "cpu") -> Restored:
        for attempt in range(READ_ATTEMPTS):
            base = self._load_index()
            entry = self.entry(step)
            jitcache.ready(entry.method)
            target = entry.step
            try:
                (flat, manifest), ref = self._replay(target, base.entries)
                break
            except CorruptCheckpointError:  # a file gone or replaced under us: fine if a writer moved on
                if attempt + 1 == READ_ATTEMPTS or not self._moved(base):
                    raise
        entries = base.entries
        held = set()
        if entries[-1].step == target and entries[-1].method == self.method.descriptor:
            self._ref, self._ref_version = ref, base.version  # a resumed run's next save is a delta again
            self.method.resume(manifest.get("method_meta", {}))
            # load_state_dict keeps the tensors it is given and training mutates them in place:
            # hand out copies of anything the writer's reference still holds
            held = {id(t) for t in ref.tensors()}
        moved = on_device(flat.tensors, device)
        if moved is flat.tensors and held:
            moved = {n: t.clone() if id(t) in held else t for n, t in flat.tensors.items()}
        flat.tensors = moved
        state = unflatten_state(flat.skeleton, flat.tensors, device)
        return Restored(target, state, flat, manifest)

    def reference(self, step: int):
        """The Reference a save after ``step`` is coded against (decodes the chain up to ``step``): for a
        search that runs apart from the writer (async saves) and must estimate as it does."""
        index = self._load_index()
        target = self.entry(step).step
        if self._ref is not None and self._ref_version == index.version and index.entries[-1].step == target:
            # this chain holds it (a restore or save of ``step``): handed over, not decoded again; a save
            # may reuse its own reference in place, so this chain's next save rebuilds one from storage
            ref, self._ref, self._ref_version = self._ref, None, None
            return ref
        return self._replay(target, index.entries)[1]

    def _path(self, step: int, entries: list[Entry]) -> list[int]:
        return replay_path(entries, step, self.url)

    def _replay(self, step: int, entries: list[Entry]):
        by_step = {e.step: e for e in entries}
        ref = None
        result = None
        methods: dict[str, Method] = {}
        for s in self._path(step, entries):
            e = by_step[s]
            try:
                data = self.storage.read(e.file)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: committed checkpoint file is missing") \
                    from None
            if not file_matches(e, data, blobs=False):  # the blobs: checked against the header next
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: file does not match its index checksum")
            c = decode_container(data, name=self.storage.path(e.file))
            m = c.manifest
            if m.get("step") != s:
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: holds step {m.get('step')}, index says {s}")
            with malformed(f"{self.storage.path(e.file)}: manifest"):
                key = m["method"] + json.dumps(m.get("config", {}), sort_keys=True)
                records = {n: TensorRecord.from_dict(n, r) for n, r in m["records"].items()}
                enc = Encoded(records={n: {"pipeline": r["pipeline"], "meta": r.get("meta", {}), "blobs": r["blobs"]}
                                       for n, r in m["records"].items()},
                              blobs=c.blobs, meta=m.get("method_meta", {}), keyframe=m["keyframe"])
            if key not in methods:
                methods[key] = method_for_file(m["method"], m.get("config"))
            known = set()  # records share a few pipelines: each checked once
            for n, r in enc.records.items():  # every stage known before the method reads a byte
                p = r["pipeline"]
                try:
                    seen = tuple(p) if type(p) is list else None
                    fresh = seen is None or seen not in known
                except TypeError:  # an unhashable descriptor: check_pipeline names it
                    seen, fresh = None, True
                if fresh:
                    check_pipeline(p, record=n, method=m["method"].partition("/")[0])
                    known.add(seen)
            tensors, ref = methods[key].decode(records, enc, ref, ctx=DecodeContext(step=s, base=self.base))
            if set(skeleton_refs(m["skeleton"])) - set(tensors):
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: skeleton names tensors the file lacks")
            result = (FlatState(tensors, records, m["skeleton"], m.get("extra", {})), m)
        return result, ref

    # --- maintenance ----------------------------------------------------------------------
    def verify(self, *, deep: bool = True, progress=None) -> list[Problem]:
        """Check every committed file; return the problems found (empty list: all good).

        ``deep`` also decodes every step through its method (catches any undecodable record);
        ``progress(step, done, total)`` is called before each step is decoded. A writer committing
        meanwhile (a file dropped by its retention) makes the check start over on the new index.
        """
        for attempt in range(READ_ATTEMPTS):
            try:
                base = self._load_index()
            except CorruptCheckpointError as e:  # a storage fault is raised: it says nothing of the chain
                return [Problem(str(e).removeprefix(self.storage.path(INDEX) + ": "), file=self.storage.path(INDEX))]
            problems = verify_chain(self, base.entries, deep=deep, progress=progress)
            if not problems or attempt + 1 == READ_ATTEMPTS or not self._moved(base):
                return problems
        raise AssertionError("unreachable")  # pragma: no cover

    def truncate(self, step: int) -> list[int]:
        """Roll the chain back to ``step``: drop every later checkpoint; returns the dropped steps.

        For a run resumed from an older step (after divergence, or when distributed ranks agree on
        the newest step all of them hold). The shorter index is committed first and the files are
        deleted after, so a crash in between leaves orphans (``gc``), never a dangling entry. Kept
        entries only name earlier steps as parents, so every kept one stays decodable.
        """
        base, record = self._claim()
        keep = [e for e in base.entries if e.step <= step]
        drop = [e for e in base.entries if e.step > step]
        if drop:
            self._commit(keep, base, record, f"rolling back to step {step}")  # the commit of the rollback
            self._sweep(drop)
            self.forget_reference()
        return [e.step for e in drop]

    def forget_reference(self) -> None:
        """Drop the in-memory reference: the next save rebuilds it from storage (slower, never wrong)."""
        self._ref, self._ref_version = None, None

    def reference_tensors(self) -> list[torch.Tensor]:
        """The tensors the writer's in-memory reference holds (empty when it has none)."""
        return list(self._ref.tensors()) if self._ref is not None else []

    def orphans(self) -> list[str]:
        """Files in the chain's folder that no committed entry names (leftovers of crashed saves)."""
        named = {e.file for e in self.entries(refresh=True)} | {INDEX}
        return [n for n in self.storage.list() if n not in named and (n.endswith(".ckz") or n.endswith(".tmp"))]

    def gc(self) -> list[str]:
        """Delete orphans; returns their names.

        A writer's operation: it claims the chain first (ChainBusyError while another writer owns
        it), so no save in flight elsewhere can lose its file and then commit.
        """
        gone = self.orphans()
        if gone:
            base, record = self._claim()
            if not self._lease.mine(base.owner):
                self._commit(base.entries, base, record, "collecting orphans")
            named = {e.file for e in self._index.entries}
            gone = [n for n in gone if n not in named]
            for n in gone:
                self.storage.delete(n)
        return gone

    def release(self) -> None:
        """Give up this process's claim on the chain, if it has one: the next writer (another
        process, an async engine's agent) takes over without waiting; a writer here that saves
        again after another took over is fenced."""
        base = self._load_index()
        if self._lease.mine(base.owner):
            self._commit(base.entries, base, self._lease.released(base.owner), "releasing the chain")

    def close(self) -> None:
        """Release the chain if this object wrote to it, and the method's resources."""
        try:
            if self._lease.generation is not None:
                self.release()
        except Exception as e:  # closing must not fail a finished run; the lease still ends
            warnings.warn(f"{self.url}: could not release the chain ({type(e).__name__}: {e}); another writer "
                          "takes over once this process exits (elsewhere: after lease_s)", stacklevel=2)
        finally:
            self.method.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _StorageContext:
    """Re-raise a StorageError with what it interrupted and what stays loadable (one line)."""

    def __init__(self, what: str):
        self.what, self.entries = what, None

    def __enter__(self):
        return self

    def __exit__(self, typ, err, tb):
        if isinstance(err, StorageError):
            kept = f" (step {self.entries[-1].step} stays loadable)" if self.entries else ""
            raise type(err)(f"{self.what}: {err}; the chain is unchanged{kept}", errno=err.errno) from err
        return False


def _short_list(xs: list[int], n: int = 8) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= n else ", ".join(map(str, xs[:3])) + ", ..., " + \
        ", ".join(map(str, xs[-3:]))


_ROLES = frozenset(("weight", "exp_avg", "exp_avg_sq", "momentum_buffer"))


def _bytes_by_role(flat: FlatState, enc: Encoded) -> dict:
    # a group blob (small records, ``meta.group``) is split over its records by their words, the shared
    # batch blob (``meta.batch``) by their spans; a blob no record claims (ExCP's payload) is "shared"
    blobs, out, words, members, spanned = enc.blobs, {}, {}, {}, set()
    for name, rec in flat.records.items():
        r = enc.records[name]
        role = rec.role if rec.role in _ROLES else "other"
        acc = out.get(role)
        if acc is None:
            acc = out[role] = [0, 0.0]
        acc[0] += rec.nbytes
        for k in r["blobs"].values():
            acc[1] += len(blobs[k])
        meta = r["meta"]
        if not meta:
            continue
        g = meta.get("group")
        if isinstance(g, list) and len(g) == 3 and g[0] in blobs:
            words[g[0]] = words.get(g[0], 0) + int(g[2])
            members.setdefault(g[0], []).append((acc, int(g[2])))
        b = meta.get("batch")
        if b is not None:  # our own meta: qrecord.RecordBatch wrote it
            acc[1] += b[2]
            spanned.add(b[0])
    for key, ms in members.items():
        for acc, n in ms:
            acc[1] += len(blobs[key]) * n / (words[key] or 1)
    for acc in out.values():
        acc[1] = round(acc[1])
    shared = sum(len(b) for k, b in blobs.items() if not k[:1].isdigit() and k not in members and k not in spanned)
    if shared:
        out.setdefault("shared", [0, 0])[1] += shared
    return out


def open_chain(url, *, read_index: bool = True, storage_options: dict | None = None, base=None) -> CheckpointChain:
    """An existing, committed chain to read, or a one-line error saying what ``url`` is instead.
    ``base``: the base weights its keyframes were coded against, if any (basestate.py)."""
    chain = CheckpointChain(url, storage_options=storage_options, base=base)
    st = chain.storage
    if not st.fs.exists(st.root):
        raise FileNotFoundError(f"{url}: no such chain; check the path (create one with `ckptzip compress`)")
    if not st.exists(INDEX):
        raise IncompleteCheckpointError(f"{url}: not a ckptzip chain (no index.json); pass a folder written by "
                                        "`ckptzip compress` or CheckpointChain")
    if read_index:
        chain.entries(refresh=True)  # a corrupt index raises CorruptCheckpointError here
    return chain
