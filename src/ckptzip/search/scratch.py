"""The config search's scratch copies of the model: made by deep copy, kept between saves.

A search evaluates its trials on a private copy of the live model (search/quality.py). A deep copy
of a model is mostly Python objects, not tensors: ~3.4 ms for a small GPT-2 of 60 modules, a sixth
of a searched save's own cost (docs/BENCHMARKS.md). So a copy is kept between saves, per live
model, and handed to the next search of that model when a new copy would be the same::

    scratch = take(model)     # the kept copy if still the same, else a fresh deep copy
    ...                       # the judge loads the state into it and evaluates
    give(model, scratch)      # kept for the next search; its parameters' memory freed meanwhile

"The same" (``_same``): module by module, the same names and types, the same hook keys, the same
parameters and buffers (names, types, dtypes, devices, shapes, requires_grad, persistence) and the
same plain attributes (numbers, strings, None and tuples of them, also one level into an attribute
object such as a transformers config, and plain tensor attributes by value). Anything else (an
attribute whose equality cannot be told) makes a fresh copy, as does a difference eval_fn made
to the kept copy. The train/eval flags are taken from the live model. The values need nothing:
the judge loads every parameter and persistent buffer from the state before any evaluation, and
non-persistent buffers are copied from the live model at ``take``.

Between saves a kept copy holds no parameter memory (each parameter's storage is dropped at
``give`` and allocated again at ``take``): what stays is the module objects and the buffers, for
the ``KEEP_MODELS`` models searched last. One search at a time has a model's kept copy; a
concurrent one deep-copies its own.
"""
from __future__ import annotations

import copy
import inspect
import threading
import weakref

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["scratch_copy", "take", "give", "unwrap"]

HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
              "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
              "_load_state_dict_post_hooks")
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)
_INTERNAL = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                       *HOOK_DICTS})

_lock = threading.Lock()
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # live model -> its idle scratch
# models whose copies are kept at once, the least recently searched dropped first: a copy whose hook
# or attribute refers to its live model keeps that model alive, so the cache must not grow unbounded
KEEP_MODELS = 4


def unwrap(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module to copy, the state_dict key prefix its wrapper adds): DDP adds "module."."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module, "module."
    return model, ""


def _noop_hook(*args, **kwargs):
    return None


def scratch_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` for trial evaluations, without observer hooks.

    Hooks that are bound methods of non-module objects (gradient recorders, profilers) would
    otherwise deep-copy their owner, or count the scratch's forward passes as training: they are
    replaced by no-ops in the copy. Callable objects and plain functions (weight_norm's and
    spectral_norm's pre-hooks) are copied, since the forward pass depends on them.
    """
    inner, _ = unwrap(model)
    memo: dict[int, object] = {}
    for mod in inner.modules():
        for attr in HOOK_DICTS:
            for h in getattr(mod, attr, {}).values():
                if inspect.ismethod(h) and not isinstance(h.__self__, nn.Module):
                    memo[id(h)] = _noop_hook
    try:
        scratch = copy.deepcopy(inner, memo)
    except Exception as e:  # noqa: BLE001 - any failure means the same fix
        raise ConfigError(f"the config search evaluates a deep copy of the model, but it cannot be copied "
                          f"({type(e).__name__}: {e}); pass the unwrapped nn.Module as the model") from e
    for p in scratch.parameters():
        p.grad = None
    return scratch


def take(model: nn.Module) -> nn.Module:
    """A scratch copy of ``model`` for one search: the one kept since the last search of this
    model where a deep copy now would be the same (module docstring), else a fresh one."""
    with _lock:
        kept = _kept.pop(model, None)
    if kept is None:
        return scratch_copy(model)
    inner, _ = unwrap(model)
    (names, mods), (kept_names, kept_mods) = _modules(inner), _modules(kept)
    pairs = list(zip(mods, kept_mods))
    if names != kept_names or not _same(pairs):
        return scratch_copy(model)
    with torch.no_grad():
        for m, k in pairs:
            k.training = m.training
            for name, p in m._parameters.items():
                q = k._parameters[name]
                if p is not None and q.shape != p.shape:  # freed at give (a tied one: at its first module)
                    q.data = torch.empty_like(p)  # its strides, as a deep copy's clone keeps them
            for name in m._non_persistent_buffers_set:  # the state does not hold them
                if m._buffers.get(name) is not None:
                    k._buffers[name].copy_(m._buffers[name])
    return kept


def give(model: nn.Module, scratch: nn.Module) -> None:
    """Keep ``scratch`` (from ``take(model)``, its search done) for the model's next search, its
    parameters' memory freed."""
    with torch.no_grad():
        for p in scratch.parameters():
            p.data = p.data.new_empty(0)
            p.grad = None
    with _lock:
        while len(_kept) >= KEEP_MODELS:
            del _kept[next(iter(_kept))]
        _kept[model] = scratch


def _modules(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """(names, modules) in named_modules order, a shared module at each of its names."""
    named = list(model.named_modules(remove_duplicate=False))
    return [n for n, _ in named], [m for _, m in named]


def _same(pairs: list) -> bool:
    """Whether a deep copy of the live model now would be the kept one but for its values (module
    docstring); ``pairs``: (live module, kept module) at the same names."""
    seen: dict = {}
    for m, k in pairs:
        dm, dk = m.__dict__, k.__dict__
        if type(m) is not type(k) or dm.keys() != dk.keys():
            return False
        for h in HOOK_DICTS:
            hm, hk = dm.get(h), dk.get(h)
            if (hm or hk) and hm.keys() != hk.keys():
                return False
        if dm["_non_persistent_buffers_set"] != dk["_non_persistent_buffers_set"] or \
                not _same_tensors(dm["_parameters"], dk["_parameters"], released=True) or \
                not _same_tensors(dm["_buffers"], dk["_buffers"]):
            return False
        for n, v in dm.items():
            if n in _INTERNAL:
                continue
            w = dk[n]
            if type(v) in _PLAIN:
                if type(w) is not type(v) or v != w:
                    return False
            elif not _same_attr(v, w, seen):
                return False
    return True


def _same_attr(x, y, seen: dict) -> bool:
    """_same_value of a module attribute, once per pair of objects (a config most modules share)."""
    key = (id(x), id(y))
    if key not in seen:
        seen[key] = _same_value(x, y)
    return seen[key]


def _same_tensors(a: dict, b: dict, *, released: bool = False) -> bool:
    """Same names, types, dtypes, devices, requires_grad and shapes (a freed parameter: any shape)."""
    if a.keys() != b.keys():
        return False
    for n, x in a.items():
        y = b[n]
        if (x is None) != (y is None):
            return False
        if x is not None and (type(x) is not type(y) or x.dtype != y.dtype or x.device != y.device or
                              x.requires_grad != y.requires_grad or (x.shape != y.shape and not released)):
            return False
    return True


def _same_value(x, y, depth: int = 0) -> bool:
    """A plain attribute equal in both (see the module docstring); False where it cannot be told."""
    if isinstance(x, _PLAIN):
        return type(x) is type(y) and x == y
    if isinstance(x, set | frozenset):
        return type(x) is type(y) and x == y
    if isinstance(x, tuple | list):
        return type(x) is type(y) and len(x) == len(y) and all(_same_value(u, v, depth) for u, v in zip(x, y))
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and type(x) is type(y) and x.dtype == y.dtype and \
            x.device == y.device and x.shape == y.shape and bool(torch.equal(x, y))
    if depth > 2 or isinstance(x, nn.Module):  # a module held outside _modules: not compared here
        return False
    if isinstance(x, dict):
        return type(x) is type(y) and x.keys() == y.keys() and \
            all(_same_value(v, y[n], depth + 1) for n, v in x.items())
    if depth == 0 and type(x) is type(y) and hasattr(x, "__dict__") and not callable(x):  # e.g. a config
        return _same_value(vars(x), vars(y), 1)
    return False
