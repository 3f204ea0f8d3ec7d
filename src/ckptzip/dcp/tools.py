"""A DCP root outside training: list, inspect, verify, and consolidate into one file.

    steps = list_steps(root)                         # committed steps, newest last, with sizes
    state = load_full(root, step=None)               # the whole (unsharded) state, nested as saved
    problems = verify(root, deep=True)               # one line per problem; [] when all is well
    restore_file(root, "model.pt", step=None)        # torch.save (or .safetensors) of load_full

``load_full`` is what ``dcp_to_torch_save`` does for plain DCP, through ``CompressedReader`` and a
planner that deserializes bytes items with ``torch.load(weights_only=True)``: a checkpoint from
elsewhere never runs code. The CLI (``ckptzip ls/inspect/verify/restore`` on a DCP root) prints
what these return.
"""
from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..errors import CkptzipError, UnsafeInputError
from . import rankfile
from .layout import COMMIT, Root
from .reader import CompressedReader


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
                     "keyframe_ranks": sum(bool(f["keyframe"]) for f in ranks),
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


def verify(url, *, deep: bool = True, storage_options: dict | None = None) -> list[str]:
    """Every committed step: commit and metadata checksums, every rank file present and matching;
    ``deep`` also decodes each rank's file (replaying its deltas). Returns one line per problem."""
    root = Root(url, storage_options)
    problems: list[str] = []
    try:
        steps = root.committed_steps()
    except (CkptzipError, OSError) as e:
        return [f"{root.url}: {e}"]
    if not steps:
        return [f"{root.url}: no committed step (no {COMMIT} under any step folder)"]
    for s in steps:
        try:
            doc = root.read_metadata(s)
        except CkptzipError as e:
            problems.append(str(e))
            continue
        for f in doc["ranks"]:
            try:
                if deep:
                    rankfile.replay(root, s, int(f["rank"]), f["sha256"], verify_exact=True)
                else:
                    rankfile.check_file(root, s, int(f["rank"]), f["sha256"])
            except CkptzipError as e:
                problems.append(str(e))
            except Exception as e:  # a decoder crash on valid checksums is still a problem to report
                problems.append(f"{root.where(s, f['file'])}: decode failed: {e.__class__.__name__}: {e}")
    for s in root.orphans(before=steps[-1]):
        problems.append(f"{root.where(s)}: uncommitted step folder (a crashed save); remove it with gc")
    return problems


def restore_file(url, out: str, step: int | None = None, *, storage_options: dict | None = None) -> dict:
    """Write the consolidated state as torch.save (``.pt``/``.bin``/...) or safetensors
    (``.safetensors``: tensors only, flattened to dotted keys). Returns {"tensors", "bytes"}."""
    state = load_full(url, step, storage_options=storage_options)
    if str(out).endswith(".safetensors"):
        from safetensors.torch import save_file

        flat = dict(_tensors(state))
        save_file({k: v.contiguous() for k, v in flat.items()}, str(out))
    else:
        torch.save(state, str(out))
        flat = dict(_tensors(state))
    return {"tensors": len(flat), "bytes": sum(t.numel() * t.element_size() for t in flat.values())}


def _tensors(obj, prefix: str = ""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))


__all__ = ["load_full", "list_steps", "inspect_step", "verify", "restore_file"]
