"""Layout ``lightning/1``: the checkpoint dict Lightning hands to a ``CheckpointIO``, and its pointer file.

Lightning names a ``.ckpt`` path per save; :class:`ckptzip.integrations.lightning.CompressedCheckpointIO`
stores the dict in a chain beside it and writes, at that path, a pointer (``POINTER_VERSION``)::

    {"ckptzip": 1, "chain": "ckptzip-chain", "step": N}

The dict is normalised like a torch.save dict (torchfile.split_dict) at fixed places:
``state_dict`` is the model, ``optimizer_states[0]`` the optimizer when there is exactly one
(several stay in ``extra``); ``__layout__`` is torch-file/1's with ``"format": "lightning/1"``.
A restore gives back the same dict, so ``ckptzip restore CHAIN --out x.ckpt`` writes a file plain
Lightning loads. ``lightning/0`` reads chains written by v0.1, whose states were
``{"model", "optimizer" | "optimizers", "lightning": rest}`` with ``__layout__ = {"n_optimizers": N}``.

Call order (the CheckpointIO's)::

    state = normalise(ckpt, path.name); chain.save(state, step); write_pointer(path, chain_dir, step)
    ptr = read_pointer(path); ckpt = to_checkpoint(chain.load(ptr.step), path)
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

from ..errors import ConfigError, CorruptCheckpointError, FormatVersionError
from .layout import LIGHTNING_V0, SourceLayout, layout_of, register
from .torchfile import rebuild_dict, split_dict

LIGHTNING_LAYOUT = "lightning/1"
POINTER_VERSION = 1
_POINTER_MAX_BYTES = 4096  # a pointer is a few dozen bytes; anything larger is a real checkpoint


@dataclass(frozen=True)
class Pointer:
    chain: str  # the chain folder, relative to the pointer's folder
    step: int


@register
class LightningLayout(SourceLayout):
    descriptor = LIGHTNING_LAYOUT

    def detect(self, path: pathlib.Path) -> bool:
        if not path.is_file() or path.stat().st_size > _POINTER_MAX_BYTES:
            return False
        try:
            return "ckptzip" in json.loads(path.read_bytes())
        except (ValueError, TypeError):
            return False

    def check(self, path: pathlib.Path) -> tuple[int | None, str]:
        ptr = read_pointer(path)  # a pointer's checkpoint is already in its chain: nothing to compress
        raise ConfigError(f"{path} is a ckptzip pointer to step {ptr.step} of the chain "
                          f"{path.parent / ptr.chain}, already compressed; restore it with "
                          f"`ckptzip restore {path.parent / ptr.chain} --step {ptr.step} --out x.ckpt`")

    def rebuild(self, state: dict, lay: dict, step: int | None):
        return rebuild_dict(state, lay)


@register
class LightningV0Layout(SourceLayout):
    descriptor = LIGHTNING_V0

    def rebuild(self, state: dict, lay: dict, step: int | None):
        ckpt = dict(state.get("lightning", {}))
        ckpt["state_dict"] = state["model"]
        ckpt["optimizer_states"] = [state["optimizer"]] if lay["n_optimizers"] == 1 else state.get("optimizers", [])
        return ckpt


def normalise(ckpt: dict, name: str) -> dict:
    """Lightning's checkpoint dict as a normalised state (``name``: the .ckpt file it was saved as)."""
    mpath = ["state_dict"] if isinstance(ckpt.get("state_dict"), dict) else None
    opts = ckpt.get("optimizer_states")
    opath = ["optimizer_states", 0] if isinstance(opts, list) and len(opts) == 1 else None
    return split_dict(ckpt, LIGHTNING_LAYOUT, name, mpath, opath)


def to_checkpoint(state: dict, where) -> dict:
    """The Lightning checkpoint dict of a restored state (``lightning/1``, or v0.1's ``lightning/0``)."""
    found = layout_of(state)
    if found is None or found[0].descriptor not in (LIGHTNING_LAYOUT, LIGHTNING_V0):
        raise CorruptCheckpointError(f"{where}: points to a chain step not saved by CompressedCheckpointIO; "
                                     "restore that step with `ckptzip restore` instead")
    return found[0].rebuild(state, found[1], None)


def write_pointer(path: pathlib.Path, chain: str, step: int) -> None:
    """The pointer file at ``path``, written to a temporary name and renamed (never half-written)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"ckptzip": POINTER_VERSION, "chain": chain, "step": step}))
    os.replace(tmp, path)


def read_pointer(path: pathlib.Path) -> Pointer:
    try:
        ptr = json.loads(path.read_bytes())
        version, chain, step = ptr["ckptzip"], ptr.get("chain", ""), ptr["step"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{path}: not a ckptzip pointer file; was it saved with "
                                     "CompressedCheckpointIO?") from None
    if version != POINTER_VERSION:
        raise FormatVersionError(f"{path}: ckptzip pointer version {version!r}, this ckptzip reads "
                                 f"{POINTER_VERSION}; upgrade ckptzip")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(chain, str) or "/" in chain \
            or "\\" in chain or chain in ("", ".", ".."):
        raise CorruptCheckpointError(f"{path}: damaged ckptzip pointer (step {step!r}, chain {chain!r}); "
                                     "delete it and resume from another checkpoint")
    return Pointer(chain, step)
