"""Writing a restored state back to disk: the structure it was ingested from, atomically.

    check_output(out, force=...)             # before decoding anything: can we write there?
    write_restored(chain.load(step), out)    # x.pt | x.safetensors | a folder, by the suffix of out

``.pt`` (any ``TORCH_SUFFIXES``) gets the full state in its source layout's structure
(:func:`rebuild`); ``.safetensors`` the model weights only; a folder the source folder again (for
layouts that had one). The write goes to a temporary folder beside ``out`` and is renamed into
place, so a failure never leaves a half-written checkpoint.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import uuid

import torch

from ..errors import ConfigError
from .layout import layout_of

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def rebuild(state: dict, step: int | None = None):
    """The object to torch.save for ``state``: the structure it was ingested from.

    A torch-file or Lightning source comes back exactly as it was (model and optimizer at their
    original keys); a Trainer folder as ``{"model", "optimizer", "step", "files"}``; a state saved
    through the API (no layout) as it is.
    """
    found = layout_of(state)
    return state if found is None else found[0].rebuild(state, found[1], step)


def model_weights(state: dict) -> dict[str, torch.Tensor]:
    """The model state dict of a restored state (for a .safetensors export)."""
    sd = state.get("model") if isinstance(state, dict) else None
    if sd is None and isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        sd = state
    if not isinstance(sd, dict) or not sd:
        raise ConfigError("this checkpoint holds no model state dict; restore it to a .pt path instead")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(f"model entry {bad[0]!r} is not a tensor, which safetensors cannot hold; restore to .pt")
    return {k: v.contiguous() for k, v in sd.items()}


def output_kind(out: str | os.PathLike) -> str:
    """"pt" | "safetensors" | "folder", from the output path's suffix."""
    suffix = pathlib.Path(out).suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "pt"
    return "folder"


def check_output(out: str | os.PathLike, *, force: bool = False) -> pathlib.Path:
    """Refuse an output path we could not (or should not) write, before decoding anything."""
    out = pathlib.Path(out)
    parent = out.parent if str(out.parent) else pathlib.Path(".")
    if not parent.exists():
        raise FileNotFoundError(f"cannot write {out}: folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {out}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {out}: no write permission on {parent}; choose a writable path")
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            return out
        raise FileExistsError(f"{out} already exists; pass --force (force=True) to replace it or choose a new path")
    return out


def write_restored(state: dict, out: str | os.PathLike, *, step: int | None = None, force: bool = False) -> str:
    """Write a restored state to ``out`` (.pt: full state, .safetensors: weights, else a folder).

    Returns the kind written (:func:`output_kind`).
    """
    out = check_output(out, force=force)
    kind = output_kind(out)
    found = layout_of(state)
    if kind == "folder" and (found is None or not found[0].folder):
        raise ConfigError(f"{out}: this checkpoint was not ingested from a Trainer folder; restore it to a "
                          ".pt or .safetensors path")
    # write under the final name inside a temporary folder (torch.save names its archive after the
    # file), then rename into place
    tmp_dir = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp_dir.mkdir()
    tmp = tmp_dir / out.name
    try:
        if kind == "pt":
            torch.save(rebuild(state, step), tmp)
        elif kind == "safetensors":
            from safetensors.torch import save_file

            meta = found[0].weights_metadata(found[1]) if found is not None else None
            save_file(model_weights(state), str(tmp), metadata=meta or {"format": "pt"})
        else:
            found[0].write_folder(state, found[1], tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return kind
