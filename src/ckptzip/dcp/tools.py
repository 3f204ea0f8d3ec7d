"""A DCP root outside training: list, inspect, verify, and consolidate into one file.

    steps = list_steps(root)                         # committed steps, newest last, with sizes
    state = load_full(root, step=None)               # the whole (unsharded) state, nested as saved
    problems = verify(root, deep=True)               # verify.Problem list; [] when all is well
    restore_file(root, "model.pt", step=None)        # torch.save (or .safetensors) of load_full

``load_full`` is what ``dcp_to_torch_save`` does for plain DCP, through ``CompressedReader`` and a
planner that deserializes bytes items with ``torch.load(weights_only=True)``: a checkpoint from
elsewhere never runs code. The CLI (``ckptzip ls/inspect/verify/restore`` on a DCP root) prints
what these return.
"""
from __future__ import annotations

import io
import pathlib

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..errors import CkptzipError, ConfigError, UnsafeInputError
from ..verify import Problem, _damaged_records
from . import rankfile
from .layout import COMMIT, Root
from .reader import CompressedReader


FIX_STEP = "restore the file from a backup, or load an earlier step"


class _SafePlanner(_EmptyStateDictLoadPlanner):
    """DCP's empty-state planner, but bytes items are plain data only (no arbitrary unpickling)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # torch raises UnpicklingError (or others) for disallowed globals
            raise UnsafeInputError(f"bytes item {read_item.dest_index.fqn!r} is not plain data "
                                   f"({e.__class__.__name__}); refusing to unpickle it") from None
        super().load_bytes(read_item, _saved(obj))


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def load_full(url, step: int | None = None, *, storage_options: dict | None = None) -> dict:
    """The whole state of ``step`` (latest when None), every tensor whole, in one process."""
    root = Root(url, storage_options)
    step = root.latest_step() if step is None else step
    root.read_metadata(step)  # typed errors for a missing or corrupt step, before DCP wraps them
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=CompressedReader(url, step, storage_options=storage_options),
                         planner=_SafePlanner(), no_dist=True)
    except CheckpointException as e:  # DCP wraps every error; ours say what is wrong and where
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CkptzipError)]
        if ours:
            raise ours[0] from None
        raise
    return state


def list_steps(url, *, storage_options: dict | None = None) -> list[dict]:
    """One row per committed step: step, world size, bytes stored vs raw, keyframes, method."""
    root = Root(url, storage_options)
    rows = []
    for s in root.committed_steps():
        commit = root.read_commit(s)
        doc = root.read_metadata(s, commit)
        ranks = doc["ranks"]
        rows.append({"step": s, "world_size": commit.world_size, "nbytes": sum(f["nbytes"] for f in ranks),
                     "raw_bytes": sum(f["raw_bytes"] for f in ranks),
                     "keyframe_ranks": sum(bool(f["keyframe"]) for f in ranks if f["rank"] >= 0),
                     "method": ranks[0]["method"] if ranks else "", "needs": list(commit.needs),
                     "summary": ranks[0].get("summary", {}) if ranks else {}})
    return rows


def inspect_step(url, step: int | None = None, *, storage_options: dict | None = None) -> dict:
    """The commit, the rank table and per-tensor chunk layout of one step."""
    root = Root(url, storage_options)
    step = root.latest_step() if step is None else step
    commit = root.read_commit(step)
    doc = root.read_metadata(step, commit)
    return {"step": step, "commit": commit, "ranks": doc["ranks"],
            "tensors": {k: {"dtype": v["dtype"], "size": v["size"], "chunks": len(v["chunks"])}
                        for k, v in doc["tensors"].items()},
            "bytes_items": sorted(doc["bytes"])}


def verify(url, *, deep: bool = True, storage_options: dict | None = None) -> list[Problem]:
    """Every committed step: commit and metadata checksums, every rank file present and matching
    (a damaged file's damaged records named); ``deep`` also decodes each rank's file, replaying its
    deltas, and checks lossless chunks against the checksums of what was saved. [] when all is well."""
    root = Root(url, storage_options)
    problems: list[Problem] = []
    try:
        steps = root.committed_steps()
    except (CkptzipError, OSError) as e:
        return [Problem(str(e), file=root.url, fix="check the root URL and its permissions")]
    if not steps:
        return [Problem(f"no committed step (no {COMMIT} under any step folder)", file=root.url,
                        fix="check the root URL, or save a step first")]
    for s in steps:
        try:
            doc = root.read_metadata(s)
        except CkptzipError as e:
            problems.append(Problem(str(e), step=s, fix=FIX_STEP))
            continue
        for f in doc["ranks"]:
            rank, where = int(f["rank"]), root.where(s, f["file"])
            try:
                if deep:
                    rankfile.replay(root, s, rank, f["sha256"], verify_exact=True)
                else:
                    rankfile.check_file(root, s, rank, f["sha256"])
            except CkptzipError as e:
                problems.append(Problem(str(e), step=s, fix=FIX_STEP))
                if "fails its checksum" in str(e) and where in str(e):
                    problems += _damaged_records(root.step_store(s).read(f["file"]), s, where)
            except Exception as e:  # a decoder crash on valid checksums is still a problem to report
                problems.append(Problem(f"{where}: decode failed: {e.__class__.__name__}: {e}", step=s, fix=FIX_STEP))
    return problems


def committed(url, *, storage_options: dict | None = None) -> list[int]:
    """The committed steps, ascending."""
    return Root(url, storage_options).committed_steps()


def leftovers(url, *, storage_options: dict | None = None) -> list[str]:
    """Step folders below the latest committed step that hold no commit (crashed saves)."""
    root = Root(url, storage_options)
    latest = root.latest_step(default=None)
    return [] if latest is None else [root.where(s) for s in root.orphans(before=latest)]


def is_root(url, *, storage_options: dict | None = None) -> bool:
    """Whether ``url`` holds ckptzip DCP steps (and not a chain's index.json)."""
    from ..chain import INDEX

    root = Root(url, storage_options)
    return not root.store.exists(INDEX) and bool(root.step_folders())


def restore_file(url, out: str, step: int | None = None, *, storage_options: dict | None = None) -> dict:
    """Write the consolidated state of ``step`` (latest when None) as torch.save (``.pt``, ``.pth``,
    ``.bin``) or safetensors (``.safetensors``: tensors only, flattened to dotted keys).
    Returns {"step", "tensors", "bytes", "format"}."""
    suffix = pathlib.Path(out).suffix
    if suffix not in (".pt", ".pth", ".bin", ".safetensors"):
        raise ConfigError(f"cannot restore a DCP root to {out}: write a .pt (torch.save of the whole state) or a "
                          ".safetensors file (its tensors)")
    root = Root(url, storage_options)
    step = root.latest_step() if step is None else step
    state = load_full(url, step, storage_options=storage_options)
    flat = dict(flat_tensors(state))
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in flat.items()}, str(out))
    else:
        torch.save(state, str(out))
    return {"step": step, "tensors": len(flat), "bytes": sum(t.numel() * t.element_size() for t in flat.values()),
            "format": "safetensors" if suffix == ".safetensors" else "torch.save"}


def flat_tensors(obj, prefix: str = ""):
    """(dotted key, tensor) for every tensor in nested dicts / lists (DCP's FQNs for a state dict)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from flat_tensors(v, f"{prefix}.{i}" if prefix else str(i))


__all__ = ["load_full", "list_steps", "inspect_step", "verify", "committed", "leftovers", "is_root", "restore_file", "flat_tensors"]
