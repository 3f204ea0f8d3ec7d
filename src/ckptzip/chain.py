"""A chain of compressed checkpoints in one storage location.

Layout::

    <url>/index.json               the commit: every committed step, written last and atomically
    <url>/step-000000000100.ckz    one container per checkpoint (format.py)

A save writes its container first, then rewrites ``index.json`` atomically; only then is the step
visible. A crash at any moment leaves the previous index (and so the previous checkpoints)
intact; at worst an orphan container that no index names, which ``verify`` reports and ``gc``
removes. Keyframes are decoded alone; a delta names its parent, and a restore replays the path
from the nearest keyframe forward. Retention never deletes a checkpoint that a kept one needs.

One writer per chain at a time (readers may run concurrently).
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from .codec.stages import check_pipeline
from .errors import CkptzipError, CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError
from .format import decode_container, encode_container, sha256
from .methods.base import DecodeContext, EncodeContext, Encoded, Method, Reference, get_method, method_for_file
from .state import FlatState, TensorRecord, flatten_state, skeleton_refs, unflatten_state

INDEX = "index.json"
INDEX_FORMAT = "ckptzip-chain"
INDEX_VERSION = 1


@dataclass(frozen=True)
class KeyframePolicy:
    every: int = 10                   # a keyframe at least every `every` saves
    max_replay: int | None = None     # bound on deltas decoded by one restore (None: every - 1)
    max_replay_bytes_ratio: float | None = None  # also start a keyframe when the deltas since the last
                                                 # one exceed this multiple of its size

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"KeyframePolicy.every must be >= 1, got {self.every}")
        if self.max_replay is not None and self.max_replay < 0:
            raise ValueError(f"KeyframePolicy.max_replay must be >= 0, got {self.max_replay}")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None      # keep the newest N steps (None: keep all)
    keep_every: int | None = None     # also keep every step divisible by this

    def __post_init__(self):
        for f in ("keep_last", "keep_every"):
            v = getattr(self, f)
            if v is not None and v < 1:
                raise ValueError(f"RetentionPolicy.{f} must be >= 1 or None, got {v}")


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
    sha256: str
    created_unix: float
    bytes_by_role: dict = field(default_factory=dict)  # role -> [raw, stored]
    summary: dict = field(default_factory=dict)        # method facts worth listing (config chosen, ...)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.nbytes if self.nbytes else float("inf")


@dataclass
class Restored:
    """A decoded checkpoint: the rebuilt state plus what the file said about it."""

    step: int
    state: dict
    flat: FlatState
    manifest: dict


def checkpoint_file(step: int) -> str:
    return f"step-{step:012d}.ckz"


class CheckpointChain:
    """Save and restore a training state as a chain of compressed checkpoints.

    >>> chain = CheckpointChain("runs/ckpt", method="lossless")
    >>> chain.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=100)
    >>> state = chain.load()            # latest; chain.load(step=100) for a given one
    """

    def __init__(self, url, method: str | Method = "lossless", config=None, *,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None):
        from .storage import Storage

        self.storage = Storage(url, storage_options)
        self.url = str(url)
        self.method = method if isinstance(method, Method) else get_method(method, config)
        self.keyframe = keyframe or KeyframePolicy()
        self.retention = retention or RetentionPolicy()
        self._entries: list[Entry] | None = None
        self._ref: Reference | None = None          # what the next save encodes against
        self._ref_checked = False                   # rebuilt from the chain after a restart?

    # --- index ----------------------------------------------------------------------------
    def entries(self, *, refresh: bool = False) -> list[Entry]:
        if self._entries is None or refresh:
            self._entries = self._read_index()
        return list(self._entries)

    def steps(self) -> list[int]:
        return [e.step for e in self.entries(refresh=True)]

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

    def _read_index(self) -> list[Entry]:
        if not self.storage.exists(INDEX):
            return []
        raw = self.storage.read(INDEX)
        try:
            doc = json.loads(raw)
            body = doc["entries"]
            ok = doc.get("format") == INDEX_FORMAT and doc.get("sha256") == sha256(_dumps(body).encode())
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorruptCheckpointError(f"{self.storage.path(INDEX)}: chain index is corrupt or not a ckptzip "
                                         "index; run `ckptzip verify` and restore it from a backup")
        if int(doc.get("version", 0)) > INDEX_VERSION:
            raise CorruptCheckpointError(f"{self.storage.path(INDEX)}: index version {doc['version']} is newer "
                                         "than this ckptzip; upgrade ckptzip")
        return [Entry(**e) for e in body]

    def _write_index(self, entries: list[Entry]) -> None:
        body = [dataclasses.asdict(e) for e in entries]
        doc = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "entries": body, "sha256": sha256(_dumps(body).encode())}
        self.storage.write_atomic(INDEX, json.dumps(doc, indent=1).encode())
        self._entries = list(entries)

    # --- save -----------------------------------------------------------------------------
    def save(self, state: dict | FlatState, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, ctx: EncodeContext | None = None) -> Entry:
        """Encode and commit one checkpoint. Returns its index entry."""
        step = int(step)
        flat = state if isinstance(state, FlatState) else flatten_state(state, model, optimizer)
        entries = self.entries(refresh=True)
        if entries and step <= entries[-1].step:
            raise ValueError(f"step {step} is not after the chain's latest step {entries[-1].step}; "
                             "save increasing steps (or start a new chain)")
        ctx = ctx or EncodeContext(step=step, model=model)
        if ctx.step != step:
            ctx = dataclasses.replace(ctx, step=step)
        ref = self._writer_reference(entries)
        if ctx.force_keyframe or self._keyframe_due(entries, ref):
            ref = None
        t0 = time.perf_counter()
        enc, new_ref = self.method.encode(flat, ref, ctx=ctx)
        missing = set(flat.records) - set(enc.records)
        if missing:
            raise RuntimeError(f"method {self.method.name} left records unencoded: {sorted(missing)[:5]}")
        parent = None if enc.keyframe else ref.step
        manifest = self._manifest(flat, enc, step, parent)
        data = encode_container(manifest, enc.blobs)
        fname = checkpoint_file(step)
        self.storage.makedirs()
        self.storage.write_atomic(fname, data)
        entry = Entry(step=step, file=fname, parent=parent, keyframe=enc.keyframe, method=self.method.descriptor,
                      nbytes=len(data), raw_bytes=manifest["raw_bytes"], sha256=sha256(data),
                      created_unix=time.time(), bytes_by_role=_bytes_by_role(flat, enc),
                      summary={**enc.meta.get("summary", {}), "encode_s": round(time.perf_counter() - t0, 4)})
        keep, drop = self._apply_retention(entries + [entry])
        self._write_index(keep)  # the commit
        for e in drop:
            self.storage.delete(e.file)
        self._ref = new_ref
        return entry

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
            "raw_bytes": sum(t.numel() * t.element_size() for t in flat.tensors.values()),
        }

    def _keyframe_due(self, entries: list[Entry], ref: Reference | None) -> bool:
        if ref is None or not entries:
            return True
        since = 0
        for e in reversed(entries):
            if e.keyframe:
                break
            since += 1
        if since + 1 >= self.keyframe.every:
            return True
        path = self._path(ref.step, entries)
        max_replay = self.keyframe.max_replay if self.keyframe.max_replay is not None else self.keyframe.every - 1
        if len(path) > max_replay:  # the new delta would need len(path) files replayed before it
            return True
        r = self.keyframe.max_replay_bytes_ratio
        if r is not None:
            kf = next(e for e in entries if e.step == path[0])
            deltas = sum(e.nbytes for e in entries if e.step in set(path[1:]))
            return deltas > r * kf.nbytes
        return False

    def _writer_reference(self, entries: list[Entry]) -> Reference | None:
        """The reference for the next save; after a restart, rebuilt by replaying the latest step."""
        if not entries:
            self._ref = None
            return None
        last = entries[-1]
        if last.method != self.method.descriptor:
            return None  # a method change starts with a keyframe
        if self._ref is not None and self._ref_checked:
            return self._ref
        if not self._ref_step_in_chain(entries):
            (_, manifest), self._ref = self._replay(last.step, entries)
            self.method.resume(manifest.get("method_meta", {}))
        self._ref_checked = True
        return self._ref

    def _ref_step_in_chain(self, entries: list[Entry]) -> bool:
        return self._ref is not None and any(e.step == self._ref.step for e in entries)

    # --- load -----------------------------------------------------------------------------
    def load(self, step: int | None = None) -> dict:
        """The training state of ``step`` (latest when None), as the objects that were saved."""
        return self.restore(step).state

    def restore(self, step: int | None = None, *, device: str | torch.device = "cpu") -> Restored:
        entries = self.entries(refresh=True)
        target = self.entry(step).step
        (flat, manifest), ref = self._replay(target, entries, device=device)
        if entries[-1].step == target and entries[-1].method == self.method.descriptor:
            self._ref, self._ref_checked = ref, True  # a resumed run's next save is a delta again
            self.method.resume(manifest.get("method_meta", {}))
            # load_state_dict keeps the tensors it is given and training mutates them in place:
            # hand out copies of anything the writer's reference still holds
            held = {id(t) for t in ref.tensors()}
            flat.tensors = {n: t.clone() if id(t) in held else t for n, t in flat.tensors.items()}
        state = unflatten_state(flat.skeleton, flat.tensors)
        return Restored(target, state, flat, manifest)

    def _path(self, step: int, entries: list[Entry]) -> list[int]:
        by_step = {e.step: e for e in entries}
        path = []
        cur = step
        while True:
            e = by_step.get(cur)
            if e is None:
                raise CorruptCheckpointError(f"{self.url}: step {path[-1] if path else step} needs parent step {cur}, "
                                             "which is not in the chain")
            path.append(cur)
            if e.keyframe:
                return path[::-1]
            if len(path) > len(entries):
                raise CorruptCheckpointError(f"{self.url}: parent links form a cycle at step {cur}")
            cur = e.parent

    def _replay(self, step: int, entries: list[Entry], *, device="cpu"):
        by_step = {e.step: e for e in entries}
        ref = None
        result = None
        methods: dict[str, Method] = {}
        for s in self._path(step, entries):
            e = by_step[s]
            data = self.storage.read(e.file) if self.storage.exists(e.file) else None
            if data is None:
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: committed checkpoint file is missing")
            if sha256(data) != e.sha256:
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: file does not match its index checksum")
            c = decode_container(data, name=self.storage.path(e.file))
            m = c.manifest
            if m.get("step") != s:
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: holds step {m.get('step')}, index says {s}")
            key = m["method"] + json.dumps(m.get("config", {}), sort_keys=True)
            if key not in methods:
                methods[key] = method_for_file(m["method"], m.get("config"))
            records = {n: TensorRecord.from_dict(n, r) for n, r in m["records"].items()}
            enc = Encoded(records={n: {"pipeline": r["pipeline"], "meta": r.get("meta", {}), "blobs": r["blobs"]}
                                   for n, r in m["records"].items()},
                          blobs=c.blobs, meta=m.get("method_meta", {}), keyframe=m["keyframe"])
            for n, r in enc.records.items():  # every stage known before the method reads a byte
                check_pipeline(r["pipeline"], record=n, method=m["method"].partition("/")[0])
            tensors, ref = methods[key].decode(records, enc, ref, ctx=DecodeContext(step=s, device=device))
            if set(skeleton_refs(m["skeleton"])) - set(tensors):
                raise CorruptCheckpointError(f"{self.storage.path(e.file)}: skeleton names tensors the file lacks")
            result = (FlatState(tensors, records, m["skeleton"], m.get("extra", {})), m)
        return result, ref

    # --- maintenance ----------------------------------------------------------------------
    def _apply_retention(self, entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
        rp = self.retention
        if rp.keep_last is None and rp.keep_every is None:
            return entries, []
        wanted = {entries[-1].step}
        if rp.keep_last is not None:
            wanted |= {e.step for e in entries[-rp.keep_last:]}
        if rp.keep_every is not None:
            wanted |= {e.step for e in entries if e.step % rp.keep_every == 0}
        needed = set()
        for s in wanted:
            needed |= set(self._path(s, entries))
        return [e for e in entries if e.step in needed], [e for e in entries if e.step not in needed]

    def verify(self, *, deep: bool = True) -> list[str]:
        """Check every committed file; return one line per problem (empty list: all good).

        ``deep`` also decodes every step through its method (catches any undecodable record).
        """
        problems: list[str] = []
        try:
            entries = self.entries(refresh=True)
        except CkptzipError as e:
            return [str(e)]
        steps = {e.step for e in entries}
        for e in entries:
            where = self.storage.path(e.file)
            if not e.keyframe and e.parent not in steps:
                problems.append(f"{where}: needs parent step {e.parent}, which is not in the chain")
            try:
                data = self.storage.read(e.file)
            except FileNotFoundError:
                problems.append(f"{where}: committed checkpoint file is missing")
                continue
            if sha256(data) != e.sha256:
                problems.append(f"{where}: file does not match its index checksum")
            try:
                m = decode_container(data, name=where).manifest
                if m.get("step") != e.step:
                    problems.append(f"{where}: holds step {m.get('step')}, index says {e.step}")
            except CkptzipError as err:
                problems.append(str(err))
        if deep and not problems:
            for e in entries:
                try:
                    self._replay(e.step, entries)
                except CkptzipError as err:
                    problems.append(f"step {e.step}: {err}")
                except Exception as err:  # a decoder crash on valid checksums is still a problem to report
                    problems.append(f"step {e.step}: decode failed: {err.__class__.__name__}: {err}")
        return problems

    def truncate(self, step: int) -> list[int]:
        """Roll the chain back to ``step``: drop every later checkpoint; returns the dropped steps.

        For a run resumed from an older step (after divergence, or when distributed ranks agree on
        the newest step all of them hold). The shorter index is committed first and the files are
        deleted after, so a crash in between leaves orphans (``gc``), never a dangling entry. Kept
        entries only name earlier steps as parents, so every kept one stays decodable.
        """
        entries = self.entries(refresh=True)
        keep = [e for e in entries if e.step <= step]
        drop = [e for e in entries if e.step > step]
        if drop:
            self._write_index(keep)  # the commit of the rollback
            for e in drop:
                self.storage.delete(e.file)
            self.forget_reference()
        return [e.step for e in drop]

    def forget_reference(self) -> None:
        """Drop the in-memory reference: the next save rebuilds it from storage (slower, never wrong)."""
        self._ref, self._ref_checked = None, False

    def reference_tensors(self) -> list[torch.Tensor]:
        """The tensors the writer's in-memory reference holds (empty when it has none)."""
        return list(self._ref.tensors()) if self._ref is not None else []

    def orphans(self) -> list[str]:
        """Files in the chain's folder that no committed entry names (leftovers of crashed saves)."""
        named = {e.file for e in self.entries(refresh=True)} | {INDEX}
        return [n for n in self.storage.list() if n not in named and (n.endswith(".ckz") or n.endswith(".tmp"))]

    def gc(self) -> list[str]:
        """Delete orphans; returns their names."""
        gone = self.orphans()
        for n in gone:
            self.storage.delete(n)
        return gone

    def close(self) -> None:
        self.method.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _short_list(xs: list[int], n: int = 8) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= n else ", ".join(map(str, xs[:3])) + ", ..., " + \
        ", ".join(map(str, xs[-3:]))


def _bytes_by_role(flat: FlatState, enc: Encoded) -> dict:
    out: dict[str, list[int]] = {}
    for name, rec in flat.records.items():
        t = flat.tensors[name]
        stored = sum(len(enc.blobs[k]) for k in enc.records[name]["blobs"].values())
        role = rec.role if rec.role in ("weight", "exp_avg", "exp_avg_sq", "momentum_buffer") else "other"
        acc = out.setdefault(role, [0, 0])
        acc[0] += t.numel() * t.element_size()
        acc[1] += stored
    shared = sum(len(b) for k, b in enc.blobs.items() if not k[:1].isdigit())
    if shared:
        out.setdefault("shared", [0, 0])[1] += shared
    return out


def open_chain(url, *, read_index: bool = True, storage_options: dict | None = None) -> CheckpointChain:
    """An existing, committed chain to read, or a one-line error saying what ``url`` is instead."""
    chain = CheckpointChain(url, storage_options=storage_options)
    st = chain.storage
    if not st.fs.exists(st.root):
        raise FileNotFoundError(f"{url}: no such chain; check the path (create one with `ckptzip compress`)")
    if not st.exists(INDEX):
        raise IncompleteCheckpointError(f"{url}: not a ckptzip chain (no index.json); pass a folder written by "
                                        "`ckptzip compress` or CheckpointChain")
    if read_index:
        chain.entries(refresh=True)  # a corrupt index raises CorruptCheckpointError here
    return chain
