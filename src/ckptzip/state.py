"""Training state <-> named tensor records plus an exact, pickle-free skeleton.

``flatten_state({"model": model.state_dict(), "optimizer": opt.state_dict(), ...})`` walks any
nesting of dicts/lists/tuples. Every tensor (and numpy array) becomes a named record carrying its
role (weight, buffer, exp_avg, exp_avg_sq, momentum_buffer, step, ...), layer type and link to the
parameter it belongs to; everything else (ints, floats, strings, None, bools, param_groups, RNG
states) stays in a JSON skeleton with tagged values for what JSON cannot hold (tuples, non-string
dict keys, non-finite floats, bytes). An optimizer's per-parameter ``step`` count held in a 0-d
tensor is a skeleton value too (``{"__t": "scalar", "dtype", "v"}``): a record each cost a
small GPT's save ~1.4 ms for its 52 steps (docs/BENCHMARKS.md). ``unflatten_state`` rebuilds the
same objects, dtypes and shapes, ready for ``load_state_dict``.
"""
from __future__ import annotations

import base64
import itertools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .errors import CorruptCheckpointError, UnsupportedStateError
from .tensorbytes import DTYPES, FLOAT_DTYPES, ITEMSIZE, dtype_name, host, host_copy

# Optimizer-state entries that are moments of a parameter (lossy codecs may compress these).
MOMENT_ROLES = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq", "square_avg",
                          "acc_delta", "sum", "exp_inf"})
LAYER_TYPES = ("embedding", "linear", "conv", "norm", "bias", "other")
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


@dataclass(frozen=True)
class TensorRecord:
    """What is known about one tensor of a training state (JSON-able via to_dict)."""

    name: str                      # path in the state, e.g. "model/fc1.weight", "optimizer/state/0/exp_avg"
    role: str                      # weight | buffer | exp_avg | exp_avg_sq | momentum_buffer | step | tensor
    dtype: str                     # torch dtype name
    shape: tuple[int, ...]
    layer_type: str = "other"      # embedding | linear | conv | norm | bias | other
    param: str | None = None       # model parameter this record is, or belongs to (for moments)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def nbytes(self) -> int:
        """The tensor's raw bytes (what a save's ratio is taken against)."""
        return self.numel * ITEMSIZE[self.dtype]

    def to_dict(self) -> dict:
        return {"role": self.role, "dtype": self.dtype, "shape": list(self.shape),
                "layer_type": self.layer_type, "param": self.param}

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "TensorRecord":
        return cls(name, d["role"], d["dtype"], tuple(d["shape"]), d.get("layer_type", "other"), d.get("param"))


@dataclass(frozen=True)
class OptimizerHParams:
    """The hyperparameters of a parameter's optimizer param_group that codecs read (None: absent)."""

    lr: float | None = None
    betas: tuple[float, float] | None = None   # Adam family
    eps: float | None = None
    momentum: float | None = None              # SGD
    weight_decay: float | None = None


@dataclass(frozen=True)
class ParamView:
    """One model parameter and its optimizer state, as record names of a FlatState.

    ``FlatState.params()`` builds these once from the records and the skeleton, so no method parses
    record names or skeleton tags to find a weight's moments or Adam's betas.
    """

    name: str                          # parameter name ("fc1.weight"); "optimizer/state/<i>" when unlinked
    weight: str | None                 # record of the weight ("model/fc1.weight"), None if not in the state
    moments: Mapping[str, str]         # role -> record (exp_avg, exp_avg_sq, momentum_buffer, ...)
    step: float | None = None          # the optimizer's step count for this parameter
    hparams: OptimizerHParams | None = None
    index: int | None = None           # the parameter's index in optimizer.state_dict()

    @property
    def adam(self) -> bool:
        """Adam-family state: m and v present, with betas, eps and a step count."""
        hp = self.hparams
        return ("exp_avg" in self.moments and "exp_avg_sq" in self.moments and hp is not None
                and hp.betas is not None and hp.eps is not None and self.step is not None)


@dataclass
class FlatState:
    """A training state as records + tensors + skeleton. ``tensors`` and ``records`` share keys."""

    tensors: dict[str, torch.Tensor]
    records: dict[str, TensorRecord]
    skeleton: object                       # JSON-able tree with {"__t": "tensor", "ref": name} leaves
    extra: dict = field(default_factory=dict)  # flatten-time facts (e.g. how params were linked)
    copied: frozenset[str] = frozenset()   # names whose tensor on_host copied off a device: the save's own
    _params: dict | None = field(default=None, init=False, repr=False, compare=False)

    def by_role(self, *roles: str) -> list[TensorRecord]:
        return [r for r in self.records.values() if r.role in roles]

    def own(self, name: str) -> torch.Tensor:
        """``tensors[name]`` as a host tensor no training step writes: on_host's copy, else a fresh one."""
        t = self.tensors[name]
        return t if name in self.copied else host_copy(t)

    def params(self) -> dict[str, ParamView]:
        """Every parameter with a weight or optimizer state, in record order (see ParamView)."""
        if self._params is None:
            self._params = _param_views(self)
        return self._params


def on_host(flat: FlatState) -> FlatState:
    """``flat`` with every tensor in host memory: device tensors copied once, host ones as they are.
    Saves encode host memory, as the async engine (shared memory) and DCP (its shards) do, so a state
    on a GPU gives the CPU's files: encoding on the GPU wrote other bytes for ExCP, BitSnap, QD and
    CNR and mixed devices in other methods (docs/BENCHMARKS.md, "CUDA"). The copies are pageable and
    freed after the save: torch's page-locked host cache copied GPT-2 124M's state 35x faster but kept
    1.66x its size locked between saves (blocks rounded up to powers of two); the async engine stages
    through page-locked memory of its exact size."""
    copied = frozenset(n for n, t in flat.tensors.items() if not t.is_cpu)  # is_cpu, not .device: no object
    if not copied:
        return flat
    return FlatState({n: host(t) for n, t in flat.tensors.items()}, flat.records, flat.skeleton, flat.extra, copied)


def on_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Decoded host tensors moved to ``device`` (``tensors`` itself for the CPU). Restores decode on
    the host, on_host's twin, so a GPU restore holds the CPU's values."""
    if torch.device(device).type == "cpu":
        return tensors
    return {n: t.to(device) for n, t in tensors.items()}


# ---------------------------------------------------------------------------------------------
# layer types from the module tree

def layer_types(model: nn.Module) -> dict[str, str]:
    """state_dict key -> layer type, from each tensor's owning module."""
    out: dict[str, str] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag):
            kind = "embedding"
        elif isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D":  # HF GPT-2 uses Conv1D as linear
            kind = "linear"
        elif isinstance(mod, nn.modules.conv._ConvNd):
            kind = "conv"
        elif isinstance(mod, _NORMS) or "norm" in type(mod).__name__.lower():
            kind = "norm"
        else:
            kind = "other"
        prefix = f"{mod_name}." if mod_name else ""
        for pname, _ in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            key = prefix + pname
            out[key] = "bias" if pname == "bias" and kind != "norm" else kind
    return out


def _param_names(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    """Optimizer state index -> model parameter name (the order optimizer.state_dict() numbers them)."""
    if model is None or optimizer is None:
        return {}
    by_id = {id(p): n for n, p in model.named_parameters()}
    out, idx = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in by_id:
                out[idx] = by_id[id(p)]
            idx += 1
    return out


def _infer_param_names(model_sd: dict, opt_sd: dict) -> dict[int, str]:
    """Without the live objects, link optimizer indices to state_dict keys by order and shape.

    Parameters appear in state_dict order for the usual ``Optimizer(model.parameters())``; buffers
    are skipped by requiring every shape to match. Returns {} when the match is not exact.
    """
    groups = opt_sd.get("param_groups") or []
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", [])]
    state = opt_sd.get("state") or {}
    keys, ptrs = [], set()
    for k, v in model_sd.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not k.endswith(("running_mean", "running_var")):
            if v.numel() and v.data_ptr() in ptrs:
                continue  # a tied parameter (e.g. GPT-2's lm_head = wte) is one optimizer entry
            ptrs.add(v.data_ptr())
            keys.append(k)
    if len(keys) != len(ids):
        return {}
    out = {}
    for i, k in zip(ids, keys):
        st = state.get(i, {})
        shapes = {v.shape for n, v in st.items() if n in MOMENT_ROLES and isinstance(v, torch.Tensor)}
        if shapes and shapes != {model_sd[k].shape}:
            return {}
        out[i] = k
    return out


# ---------------------------------------------------------------------------------------------
# parameter views

def _param_views(flat: FlatState) -> dict[str, ParamView]:
    """FlatState.params(): weights by their ``param`` link, optimizer entries by the skeleton."""
    fields: dict[str, dict] = {}
    for n, r in flat.records.items():
        if r.role == "weight" and r.param is not None:
            fields.setdefault(r.param, {"weight": n, "moments": {}})
    opt = flat.skeleton.get("optimizer") if isinstance(flat.skeleton, dict) else None
    if not isinstance(opt, dict):
        return {k: ParamView(k, **v) for k, v in fields.items()}
    hparams = _group_hparams(opt.get("param_groups"), flat.tensors)
    for key, entry in _entries(opt.get("state")):
        if not isinstance(entry, dict):
            continue
        moments, step = {}, None
        for role, leaf in entry.items():
            ref = leaf.get("ref") if isinstance(leaf, dict) and leaf.get("__t") in ("tensor", "alias") else None
            if role == "step":
                step = _number(flat.tensors[ref] if ref is not None else scalar_value(leaf))
            elif ref is not None and ref in flat.records:
                moments[role] = ref
        links = {flat.records[m].param for m in moments.values()} - {None}
        param = links.pop() if len(links) == 1 else key if isinstance(key, str) and key in fields else None
        name = param if param is not None else f"optimizer/state/{key}"
        v = fields.setdefault(name, {"weight": None, "moments": {}})
        v.update(moments=moments, step=step, hparams=hparams.get(key), index=key if isinstance(key, int) else None)
    return {k: ParamView(k, **v) for k, v in fields.items()}


def _entries(state_sk) -> list[tuple[object, object]]:
    """(key, entry skeleton) of optimizer.state_dict()["state"] (int keys are tagged, str keys plain)."""
    if isinstance(state_sk, dict) and state_sk.get("__t") == "dict":
        return [tuple(kv) for kv in state_sk.get("items", [])]
    return list(state_sk.items()) if isinstance(state_sk, dict) else []


def _number(x) -> float | None:
    if isinstance(x, torch.Tensor):
        return float(x.item()) if x.numel() == 1 else None
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _group_hparams(groups_sk, tensors: dict[str, torch.Tensor]) -> dict[object, OptimizerHParams]:
    """param key -> its param_group's hyperparameters (tags and tensor values resolved)."""
    out = {}
    for g in unflatten_state(groups_sk, tensors) if isinstance(groups_sk, list) else []:
        if not isinstance(g, dict):
            continue
        betas = g.get("betas")
        betas = tuple(_number(b) for b in betas) if isinstance(betas, list | tuple) and len(betas) == 2 else None
        hp = OptimizerHParams(lr=_number(g.get("lr")), betas=betas if betas and None not in betas else None,
                              eps=_number(g.get("eps")), momentum=_number(g.get("momentum")),
                              weight_decay=_number(g.get("weight_decay")))
        for key in g.get("params", []):
            out[key] = hp
    return out


# ---------------------------------------------------------------------------------------------
# flatten / unflatten

def flatten_state(state: dict, model: nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None, *, step_records: bool = False) -> FlatState:
    """Split a training state into tensor records and an exact JSON skeleton (no pickle).
    ``step_records``: an optimizer's 0-d ``step`` tensors as records too (module docstring)."""
    if not isinstance(state, dict):
        raise TypeError(f"training state must be a dict, got {type(state).__name__}")
    model_sd = state.get("model") if isinstance(state.get("model"), dict) else None
    opt_sd = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else None
    ltypes = layer_types(model) if model is not None else {}  # filled in by guesses as records come
    pnames = _param_names(model, optimizer)
    link = "live" if pnames else ""
    if not pnames and model_sd is not None and opt_sd is not None:
        pnames = _infer_param_names(model_sd, opt_sd)
        link = "inferred" if pnames else "none"
    params = set(dict(model.named_parameters()).keys()) if model is not None else None

    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, TensorRecord] = {}
    seen: dict[tuple, str] = {}  # tied tensors (same storage, offset, shape, strides) are stored once

    def layer(key: str, t: torch.Tensor) -> str:  # a weight's moments and step ask for its layer type again
        lt = ltypes.get(key)
        if lt is None:
            lt = ltypes[key] = _guess_layer(key, t)
        return lt

    def record(path: list, name: str, t: torch.Tensor) -> dict:
        optimizer_entry = len(path) == 4 and path[0] == "optimizer" and path[1] == "state"
        if optimizer_entry and path[3] == "step" and not step_records and t.dim() == 0 and not t.requires_grad:
            # torch.optim's steps (never shared: no alias is lost); on a GPU (fused or capturable
            # Adam) each costs a sync here, and the file is the CPU state's
            return scalar_leaf(t)
        shape, dtype = t.shape, t.dtype
        # data_ptr() is the storage's address plus the offset: with shape, strides and dtype, one view
        key = (t.data_ptr(), shape, t.stride(), dtype) if t.numel() else None
        if key is not None:
            first = seen.setdefault(key, name)
            if first is not name:
                return {"__t": "alias", "ref": first}
        if name in tensors:
            raise UnsupportedStateError(f"two tensors map to the record name {name!r}; rename one of the keys")
        role, ltype, param = "tensor", "other", None
        if len(path) == 2 and path[0] == "model" and model_sd is not None:
            key = str(path[1])
            param = key
            is_param = key in params if params is not None else t.is_floating_point() and not key.endswith(
                ("running_mean", "running_var"))
            role = "weight" if is_param else "buffer"
            ltype = layer(key, t)
        elif optimizer_entry:
            role = "step" if path[3] == "step" else str(path[3])
            param = pnames.get(path[2]) if isinstance(path[2], int) else None
            if param is not None:
                ltype = layer(param, model_sd[param]) if model_sd and param in model_sd else ltypes.get(param, "other")
        records[name] = TensorRecord(name, role, dtype_name(dtype), tuple(shape), ltype, param)
        tensors[name] = t.detach() if t.requires_grad else t  # state_dict()s hand out detached tensors
        return {"__t": "tensor", "ref": name}

    def walk(obj, path: list, name: str):
        """``obj`` at ``path`` -> its skeleton; ``name``: the path's record name ("/".join(map(str, path)))."""
        if isinstance(obj, torch.Tensor):
            return record(path, name, obj)
        if isinstance(obj, np.ndarray):
            # carry the exact bits in a same-width torch dtype; the numpy dtype goes in the skeleton
            arr = np.ascontiguousarray(obj)
            carrier = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}.get(arr.dtype.itemsize)
            if arr.dtype.kind not in "biuf" or carrier is None:
                raise UnsupportedStateError(f"numpy array of dtype {arr.dtype} at {name} is not "
                                            "supported; convert it to a bool, int or float array")
            ref = record(path, name, torch.from_numpy(arr.view(carrier).copy()))
            return {"__t": "ndarray", "ref": ref["ref"], "np": arr.dtype.str}
        if isinstance(obj, np.generic):
            return walk(obj.item(), path, name)
        at = name + "/" if path else ""  # a child's record name is this one's, "/", its key
        if isinstance(obj, dict):
            if all(map(isinstance, obj, _STR)) and not any(map(_TAGGED, obj)):  # C loops: a state has many dicts
                return {k: walk(v, path + [k], at + k) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, str | int | float | bool | type(None)):
                    raise UnsupportedStateError(f"dict key {k!r} at {name} must be "
                                                "str/int/float/bool; convert it to a string")
                items.append([k, walk(v, path + [k], at + str(k))])
            return {"__t": "dict", "items": items}
        if isinstance(obj, list):
            return [walk(v, path + [i], at + str(i)) for i, v in enumerate(obj)]
        if isinstance(obj, torch.Size):  # before tuple: Size subclasses it
            return {"__t": "size", "v": list(obj)}
        if isinstance(obj, tuple):
            return {"__t": "tuple", "v": [walk(v, path + [i], at + str(i)) for i, v in enumerate(obj)]}
        if isinstance(obj, bool) or obj is None or isinstance(obj, str):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__t": "float", "v": repr(obj)}
        if isinstance(obj, bytes | bytearray):
            return {"__t": "bytes", "v": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, torch.dtype):
            return {"__t": "dtype", "v": str(obj).removeprefix("torch.")}
        raise UnsupportedStateError(
            f"cannot store {type(obj).__name__} at {name or '<root>'} without pickle; "
            "convert it to tensors, numbers, strings, lists or dicts")

    try:
        skeleton = walk(state, [], "")
    finally:
        del walk  # a recursive closure is a reference cycle: it would hold the records until a gc pass
    return FlatState(tensors, records, skeleton, {"param_link": link})


_STR = itertools.repeat(str)
_TAGGED = operator.methodcaller("startswith", "__t")  # a key the skeleton's own tags could be read as


def _guess_layer(key: str, t: torch.Tensor) -> str:
    """Layer type from a state_dict key and shape when no model is at hand."""
    low = key.lower()
    if key.endswith("bias"):
        return "bias"
    if "emb" in low or "wte" in low or "wpe" in low:
        return "embedding"
    if "norm" in low or low.split(".")[-2:-1] in (["ln"], ["bn"]) or ".ln_" in low or "layernorm" in low:
        return "norm"
    if t.dim() >= 3:
        return "conv"
    if t.dim() == 2:
        return "linear"
    return "other"


def scalar_leaf(t: torch.Tensor) -> dict:
    """The skeleton value of a 0-d tensor: its dtype and its value, exactly (a float widened to a
    Python float, non-finite as its repr; an integer or bool as itself)."""
    v = t.item()
    if isinstance(v, float) and not math.isfinite(v):
        v = repr(v)
    return {"__t": "scalar", "dtype": dtype_name(t.dtype), "v": v}


def scalar_value(leaf):
    """A skeleton leaf's number: a scalar leaf's value (CorruptCheckpointError for a malformed one),
    anything else itself."""
    if not (isinstance(leaf, dict) and leaf.get("__t") == "scalar"):
        return leaf
    v = leaf.get("v")
    if leaf.get("dtype") not in DTYPES or not isinstance(v, bool | int | float | str) or \
            (isinstance(v, str) and v not in ("inf", "-inf", "nan")):
        raise CorruptCheckpointError(f"skeleton scalar {leaf!r} is malformed (a corrupt file)")
    return float(v) if isinstance(v, str) else v


def _scalar_tensor(leaf: dict, device) -> torch.Tensor:
    """scalar_leaf's tensor again; CorruptCheckpointError for a malformed leaf."""
    v = scalar_value(leaf)
    try:
        return torch.tensor(v, dtype=DTYPES[leaf["dtype"]][0], device=device)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise CorruptCheckpointError(f"skeleton scalar {leaf!r} does not fit its dtype (a corrupt file)") from None


def unflatten_state(skeleton, tensors: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
    """Inverse of flatten_state: rebuild the original objects from the skeleton and tensors
    (``device``: where a skeleton scalar's tensor goes, as the records' tensors went)."""

    def walk(obj):
        if isinstance(obj, dict):
            tag = obj.get("__t")
            if tag is None:
                return {k: walk(v) for k, v in obj.items()}
            if tag in ("tensor", "alias"):
                return tensors[obj["ref"]]
            if tag == "scalar":
                return _scalar_tensor(obj, device)
            if tag == "ndarray":
                return tensors[obj["ref"]].cpu().contiguous().numpy().view(np.dtype(obj["np"])).copy()
            if tag == "dict":
                return {k: walk(v) for k, v in obj["items"]}
            if tag == "tuple":
                return tuple(walk(v) for v in obj["v"])
            if tag == "float":
                return float(obj["v"])
            if tag == "bytes":
                return base64.b64decode(obj["v"])
            if tag == "dtype":
                return getattr(torch, obj["v"])
            if tag == "size":
                return torch.Size(obj["v"])
            raise CorruptCheckpointError(f"unknown skeleton tag {tag!r}: a corrupt file, or one written by a newer "
                                         "ckptzip (upgrade ckptzip)")
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    try:
        return walk(skeleton)
    finally:
        del walk  # a recursive closure is a reference cycle: it would hold the tensors until a gc pass


def skeleton_refs(skeleton) -> list[str]:
    """Every tensor record name the skeleton refers to (for validating a manifest)."""
    out: list[str] = []

    def walk(obj):
        if isinstance(obj, dict):
            if obj.get("__t") in ("tensor", "ndarray", "alias"):
                out.append(obj["ref"])
            else:
                for v in obj.values():
                    walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    try:
        walk(skeleton)
    finally:
        del walk  # a recursive closure is a reference cycle
    return out
