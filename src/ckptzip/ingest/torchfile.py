"""Layout ``torch-file/1``: a ``torch.save`` file holding state dicts in any dict structure.

The model and optimizer state dicts are found by their usual keys (``MODEL_KEYS``,
``OPTIMIZER_KEYS``; a list holding one optimizer state counts, as Lightning writes) or the whole
file is a bare model state dict. ``__layout__`` records (all JSON)::

    {"format": "torch-file/1", "name": file name, "model_path": [keys] | None,
     "optimizer_path": [keys] | None, "top_type": "dict" | "OrderedDict",
     "model_type": ..., "model_metadata": {module: {"version": n}}}   # the last two when there is a model

``extra`` is the rest of the file with the model and optimizer slots set to None (key order kept),
so :func:`rebuild_dict` puts back exactly the object torch.save wrote. The dict half of this
module (:func:`split_dict`, :func:`rebuild_dict`) is shared with the Lightning layout.
"""
from __future__ import annotations

import collections
import pathlib
from typing import Iterable

from ..errors import CorruptCheckpointError
from .layout import (LAYOUT_KEY, SourceLayout, as_step, check_storable, has_tensor, is_optimizer, is_state_dict,
                     register)
from .safeload import torch_load, verify_archive

TORCH_LAYOUT = "torch-file/1"
# keys under which a torch.save dict usually holds the model / optimizer state dict, by priority
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_states")
STEP_KEYS = ("step", "global_step", "iteration")


@register
class TorchFileLayout(SourceLayout):
    descriptor = TORCH_LAYOUT

    def detect(self, path: pathlib.Path) -> bool:
        return path.is_file()

    def check(self, path: pathlib.Path) -> tuple[int | None, str]:
        obj = torch_load(path)
        verify_archive(path)
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(
                f"{path}: not a checkpoint (holds a {type(obj).__name__}, expected a dict of state dicts); "
                "save {'model': model.state_dict(), ...}")
        if not has_tensor(obj):
            raise CorruptCheckpointError(f"{path}: not a checkpoint (no tensors in it); pass a file saved "
                                         "from model.state_dict()")
        check_storable(normalise(obj, path.name), path)
        for k in STEP_KEYS:
            if k in obj and as_step(obj[k]) is not None:
                return as_step(obj[k]), f"entry:{k}"
        return None, ""

    def load(self, path: pathlib.Path, step: int) -> dict:
        return normalise(torch_load(path), path.name)

    def rebuild(self, state: dict, lay: dict, step: int | None):
        return rebuild_dict(state, lay)


def normalise(obj: dict, name: str) -> dict:
    """The normalised state of a torch.save dict, its model and optimizer found by their keys."""
    if is_state_dict(obj) and not any(k in obj for k in MODEL_KEYS + OPTIMIZER_KEYS):
        mpath, opath = [], None                       # a bare model state dict
    else:
        mpath = _find(obj, MODEL_KEYS, is_state_dict)
        opath = _find(obj, OPTIMIZER_KEYS, is_optimizer)
    return split_dict(obj, TORCH_LAYOUT, name, mpath, opath)


def _find(obj: dict, keys: Iterable[str], accept) -> list | None:
    """Path (list of keys/indices) to the first entry named by ``keys`` that ``accept`` takes."""
    for k in keys:
        if k not in obj:
            continue
        v = obj[k]
        if accept(v):
            return [k]
        if isinstance(v, list) and len(v) == 1 and accept(v[0]):  # one optimizer in a list
            return [k, 0]
    return None


def split_dict(obj: dict, descriptor: str, name: str, mpath: list | None, opath: list | None) -> dict:
    """``obj`` with the model at ``mpath`` and the optimizer at ``opath`` as a normalised state."""
    lay = {"format": descriptor, "name": name, "model_path": mpath, "optimizer_path": opath,
           "top_type": _type_tag(obj)}
    state: dict = {}
    if mpath is not None:
        sd = _get(obj, mpath)
        state["model"] = sd
        lay["model_type"] = _type_tag(sd)
        meta = getattr(sd, "_metadata", None)  # module versions that load_state_dict consults
        if isinstance(meta, dict):
            lay["model_metadata"] = {k: dict(v) for k, v in meta.items()}
    if opath is not None:
        state["optimizer"] = _get(obj, opath)
    if mpath != []:
        # the rest of the original object, with the model/optimizer slots held by None (keeps key order)
        state["extra"] = _replace(obj, [p for p in (mpath, opath) if p is not None])
    state[LAYOUT_KEY] = lay
    return state


def rebuild_dict(state: dict, lay: dict):
    """Inverse of :func:`split_dict`: the original object, model and optimizer at their keys."""
    model = state.get("model")
    if model is not None and lay.get("model_type") == "OrderedDict":
        model = collections.OrderedDict(model)
        if "model_metadata" in lay:
            model._metadata = collections.OrderedDict(lay["model_metadata"])  # type: ignore[attr-defined]
    if lay["model_path"] == []:
        return model
    obj = state.get("extra")
    if lay.get("top_type") == "OrderedDict":
        obj = collections.OrderedDict(obj)
    for path, value in ((lay["model_path"], model), (lay["optimizer_path"], state.get("optimizer"))):
        if path is not None:
            _get(obj, path[:-1])[path[-1]] = value
    return obj


def _type_tag(d) -> str:
    return "OrderedDict" if isinstance(d, collections.OrderedDict) else "dict"


def _get(obj, path: list):
    for k in path:
        obj = obj[k]
    return obj


def _replace(obj, paths: list[list]):
    """Shallow copies along ``paths`` with the leaves set to None; the rest shared, not copied."""
    if not paths:
        return obj
    if any(p == [] for p in paths):
        return None
    heads: dict = {}
    for p in paths:
        heads.setdefault(p[0], []).append(p[1:])
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    for k, rest in heads.items():
        out[k] = _replace(obj[k], rest)
    return out
