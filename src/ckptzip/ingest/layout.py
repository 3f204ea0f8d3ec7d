"""A source layout: one versioned way a checkpoint sits on disk, and the registry of them.

A layout turns a source into the normalised training state

    {"model": state dict, "optimizer": optimizer state dict, "extra": everything else,
     "__layout__": {"format": "<name>/<version>", ...}}

and back. ``model`` and ``optimizer`` give :func:`ckptzip.state.flatten_state` the tensors' roles;
``__layout__`` is plain JSON saying how to put everything back, so a restore needs nothing but the
chain. An implementation can expect this order of calls (sources.py and restore.py make them)::

    L.detect(path)                      # cheap: does this path look like L? (names, a few bytes)
    step, how = L.check(path)           # validates the whole source, keeps nothing; its step if it names one
    state = L.load(path, step)          # the normalised state, ready for CheckpointChain.save
    ...                                 # later, from the chain alone:
    obj = L.rebuild(state, lay, step)   # what a .pt restore writes: the structure the source had
    L.write_folder(state, lay, folder)  # folder layouts only: the same files again

torchfile.py is the worked example. A descriptor keeps its meaning forever: a change of what a
layout stores gets a new version and the old one stays readable (``lightning/0`` is v0.1's
unversioned Lightning layout, read only). An unknown descriptor is a FormatVersionError.
"""
from __future__ import annotations

import pathlib
import re

import torch

from ..errors import ConfigError, FormatVersionError

LAYOUT_KEY = "__layout__"
LIGHTNING_V0 = "lightning/0"  # v0.1 wrote {"n_optimizers": N} with no "format"; read only
_DESCRIPTOR = re.compile(r"^[a-z][a-z0-9-]*/\d+$")


class SourceLayout:
    """Base of the layouts; see the module docstring for the order of calls."""

    descriptor = ""
    folder = False     # True: a restore can write the source's folder again (write_folder)

    def detect(self, path: pathlib.Path) -> bool:
        return False

    def check(self, path: pathlib.Path) -> tuple[int | None, str]:
        raise NotImplementedError

    def load(self, path: pathlib.Path, step: int) -> dict:
        raise NotImplementedError

    def rebuild(self, state: dict, lay: dict, step: int | None):
        raise NotImplementedError

    def write_folder(self, state: dict, lay: dict, folder: pathlib.Path) -> None:
        raise NotImplementedError

    def weights_metadata(self, lay: dict) -> dict | None:
        """safetensors metadata to write with the weights (the source's own, when it had one file)."""
        return None


LAYOUTS: dict[str, SourceLayout] = {}


def register(cls: type[SourceLayout]) -> type[SourceLayout]:
    LAYOUTS[cls.descriptor] = cls()
    return cls


def layout_of(state) -> tuple[SourceLayout, dict] | None:
    """(layout, its ``__layout__`` entry) of a restored state; None for a state saved as it is."""
    lay = state.get(LAYOUT_KEY) if isinstance(state, dict) else None
    if not isinstance(lay, dict):
        return None
    fmt = lay.get("format")
    if fmt is None and set(lay) == {"n_optimizers"}:
        fmt = LIGHTNING_V0
    if fmt in LAYOUTS:
        return LAYOUTS[fmt], lay
    if isinstance(fmt, str) and _DESCRIPTOR.match(fmt):
        raise FormatVersionError(f"this checkpoint was ingested with source layout {fmt}, which this ckptzip "
                                 f"does not know (it reads {', '.join(sorted(LAYOUTS))}); upgrade ckptzip")
    return None


def as_step(v) -> int | None:
    """A step number from a checkpoint entry: a non-negative int, integral float or 1-element tensor."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and v >= 0 else None


def has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(has_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(has_tensor(v) for v in obj)
    return False


def is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and \
        all(isinstance(v, torch.Tensor) for v in obj.values())


def is_optimizer(obj) -> bool:
    return isinstance(obj, dict) and "state" in obj and "param_groups" in obj


def check_storable(state: dict, where) -> None:
    """Refuse now what flatten_state would refuse halfway through a compress."""
    from ..state import flatten_state

    try:
        flatten_state(state)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
