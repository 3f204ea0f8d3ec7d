"""Existing checkpoints on disk <-> ckptzip training states, and back to the same files.

Two kinds of source are understood:

* a ``torch.save`` file holding state dicts in any dict structure, read with
  ``torch.load(weights_only=True)`` so loading never runs code from the file;
* a Hugging Face Trainer ``checkpoint-N/`` folder (``model.safetensors`` or its shards,
  ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ...).

Each is normalised into ``{"model": ..., "optimizer": ..., "extra": ..., "__layout__": ...}`` so
that :func:`ckptzip.state.flatten_state` gives the model and optimizer tensors their roles. The
``__layout__`` entry is plain JSON-able data saying how to put everything back (where the model
and optimizer sat in the original dict, which files a folder held), so a restore needs nothing
but the chain. Call order::

    sources = find_sources(paths)             # validates every path and orders them by step
    for src in sources:
        state = load_source(src)              # the normalised state, ready for CheckpointChain.save
    ...
    write_restored(chain.load(step), out)     # .pt / .safetensors / a Trainer folder again

Files of a Trainer folder other than the weights and the optimizer are kept byte for byte and never
unpickled (``rng_state.pth`` and ``training_args.bin`` hold numpy arrays and custom classes).
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import pickle
import re
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from .errors import ConfigError, CorruptCheckpointError, UnsafeInputError

LAYOUT_KEY = "__layout__"
TORCH_LAYOUT = "torch-file/1"
TRAINER_LAYOUT = "hf-trainer/1"

# keys under which a torch.save dict usually holds the model / optimizer state dict, by priority
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_states")
STEP_KEYS = ("step", "global_step", "iteration")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
# Trainer files up to this size are kept as bytes in the skeleton; larger ones as uint8 tensors,
# which the chain compresses (and XORs against the previous checkpoint's copy) and counts in raw bytes.
INLINE_MAX_BYTES = 1024

_TRAINER_STATE = "trainer_state.json"
_SHARD_RE = re.compile(r"^(model|adapter_model)(-\d+-of-\d+)?\.safetensors$")
_TORCH_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER_FILE = "optimizer.pt"


@dataclass(frozen=True)
class Source:
    """One checkpoint to ingest, validated, with the step it will be stored under."""

    path: pathlib.Path
    kind: str          # "torch" (a torch.save file) | "trainer" (a Trainer checkpoint folder)
    step: int
    step_from: str     # where the step came from: "entry:<key>" | "name" | "order"


# ---------------------------------------------------------------------------------------------
# finding and ordering sources

def find_sources(paths: Sequence[str | os.PathLike]) -> list[Source]:
    """Validate every path (loading each, without keeping tensors) and return them in step order.

    A folder that is not itself a Trainer checkpoint but holds ``checkpoint-*`` folders stands for
    all of them. Raises FileNotFoundError / UnsafeInputError / CorruptCheckpointError / ConfigError
    naming the path and the fix; nothing is written.
    """
    found: list[tuple[pathlib.Path, str]] = []
    for p in paths:
        path = pathlib.Path(p)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder; check the path")
        if path.is_dir() and not _is_trainer_folder(path):
            subs = sorted((d for d in path.glob("checkpoint-*") if d.is_dir() and _is_trainer_folder(d)),
                          key=lambda d: _name_number(d.name) or 0)
            if not subs:
                raise CorruptCheckpointError(
                    f"{path}: not a checkpoint (a folder without model.safetensors, pytorch_model.bin or "
                    "checkpoint-* folders); pass torch.save files or Trainer checkpoint-N folders")
            found += [(d, "trainer") for d in subs]
        else:
            found.append((path, "trainer" if path.is_dir() else "torch"))

    sources: list[Source] = []
    for order, (path, kind) in enumerate(found):
        if kind == "torch":
            obj = _torch_load(path, mmap=True)
            if not isinstance(obj, dict):
                raise CorruptCheckpointError(
                    f"{path}: not a checkpoint (holds a {type(obj).__name__}, expected a dict of state dicts); "
                    "save {'model': model.state_dict(), ...}")
            if not _has_tensor(obj):
                raise CorruptCheckpointError(f"{path}: not a checkpoint (no tensors in it); pass a file saved "
                                             "from model.state_dict()")
            _check_storable(_normalise(obj, path.name)[0], path)
            step, how = _entry_step(obj)
        else:
            _check_trainer_loadable(path)
            step, how = _trainer_step(path)
        if step is None:
            n = _name_number(path.name if kind == "trainer" else path.stem)
            step, how = (n, "name") if n is not None else (order, "order")
        sources.append(Source(path, kind, step, how))

    sources.sort(key=lambda s: s.step)
    for a, b in zip(sources, sources[1:]):
        if a.step == b.step:
            raise ConfigError(f"{a.path} and {b.path} both have step {a.step}; pass each step once")
    return sources


def _name_number(name: str) -> int | None:
    nums = re.findall(r"\d+", name)
    return int(nums[-1]) if nums else None


def _as_step(v) -> int | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and v >= 0 else None


def _entry_step(obj: dict) -> tuple[int | None, str]:
    for k in STEP_KEYS:
        if k in obj and _as_step(obj[k]) is not None:
            return _as_step(obj[k]), f"entry:{k}"
    return None, ""


# ---------------------------------------------------------------------------------------------
# torch.save files

def _numpy_safe_globals() -> list:
    """numpy arrays of plain numbers rebuild without running code; allow them (RNG states use them)."""
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # plain numeric dtype classes only (no object, string or void arrays)
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")
                and not n.startswith(("Object", "Str", "Bytes", "Void", "DateTime", "TimeDelta"))]
    return out


def _torch_load(path: pathlib.Path, *, mmap: bool):
    """torch.load(weights_only=True) with our errors; mmap when the file allows (cheap validation)."""
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise UnsafeInputError(f"{path} needs arbitrary code to load (a pickle with custom classes); "
                                   "re-save it with plain tensors and dicts") from None
        raise _not_torch(path) from None
    except RuntimeError as e:
        if mmap and "mmap can only be used" in str(e):
            return _torch_load(path, mmap=False)  # an old (pre-zipfile) torch.save file
        raise _not_torch(path) from None
    except (EOFError, KeyError, ValueError, IndexError, TypeError, zipfile.BadZipFile, UnicodeDecodeError):
        raise _not_torch(path) from None
    except IsADirectoryError:
        raise _not_torch(path) from None


def _not_torch(path) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: not a checkpoint (not a torch.save file or Trainer checkpoint folder); "
                                  "pass files written by torch.save or checkpoint-N folders")


def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_tensor(v) for v in obj)
    return False


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) for k in obj) and \
        all(isinstance(v, torch.Tensor) for v in obj.values())


def _is_optimizer(obj) -> bool:
    return isinstance(obj, dict) and "state" in obj and "param_groups" in obj


def _find(obj: dict, keys: Iterable[str], accept) -> list | None:
    """Path (list of keys/indices) to the first entry named by ``keys`` that ``accept`` takes."""
    for k in keys:
        if k not in obj:
            continue
        v = obj[k]
        if accept(v):
            return [k]
        # Lightning keeps a list of optimizer states; take a single one
        if isinstance(v, list) and len(v) == 1 and accept(v[0]):
            return [k, 0]
    return None


def _normalise(obj: dict, name: str) -> tuple[dict, dict]:
    """(normalised state, layout) for a torch.save dict."""
    if _is_state_dict(obj) and not any(k in obj for k in MODEL_KEYS + OPTIMIZER_KEYS):
        mpath, opath = [], None                       # a bare model state dict
    else:
        mpath = _find(obj, MODEL_KEYS, _is_state_dict)
        opath = _find(obj, OPTIMIZER_KEYS, _is_optimizer)
    layout = {"format": TORCH_LAYOUT, "name": name, "model_path": mpath, "optimizer_path": opath,
              "top_type": _type_tag(obj)}
    state: dict = {}
    if mpath is not None:
        sd = _get(obj, mpath)
        state["model"] = sd
        layout["model_type"] = _type_tag(sd)
        meta = getattr(sd, "_metadata", None)  # module versions that load_state_dict consults
        if isinstance(meta, dict):
            layout["model_metadata"] = {k: dict(v) for k, v in meta.items()}
    if opath is not None:
        state["optimizer"] = _get(obj, opath)
    if mpath != []:
        # the rest of the original object, with the model/optimizer slots held by None (keeps key order)
        extra = _replace(obj, [p for p in (mpath, opath) if p is not None])
        state["extra"] = extra
    state[LAYOUT_KEY] = layout
    return state, layout


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
    if isinstance(obj, dict):
        out = dict(obj)
    else:
        out = list(obj)
    for k, rest in heads.items():
        out[k] = _replace(obj[k], rest)
    return out


def _check_storable(state: dict, path: pathlib.Path) -> None:
    """Refuse now what flatten_state would refuse halfway through a compress."""
    from .state import flatten_state

    try:
        flatten_state(state)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Trainer checkpoint folders

def _is_trainer_folder(path: pathlib.Path) -> bool:
    return (path / _TORCH_WEIGHTS).is_file() or any(_SHARD_RE.match(p.name) for p in path.iterdir() if p.is_file())


def _weight_files(path: pathlib.Path) -> list[str]:
    shards = sorted(p.name for p in path.iterdir() if p.is_file() and _SHARD_RE.match(p.name))
    if shards:
        return shards
    return [_TORCH_WEIGHTS] if (path / _TORCH_WEIGHTS).is_file() else []


def _trainer_step(path: pathlib.Path) -> tuple[int | None, str]:
    f = path / _TRAINER_STATE
    if not f.is_file():
        return None, ""
    try:
        doc = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpointError(f"{f}: not valid JSON; repair or delete the file") from None
    step = _as_step(doc.get("global_step")) if isinstance(doc, dict) else None
    return (step, "entry:global_step") if step is not None else (None, "")


def _check_trainer_loadable(path: pathlib.Path) -> None:
    from safetensors import SafetensorError, safe_open

    keys: set[str] = set()
    for name in _weight_files(path):
        f = path / name
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(f), framework="pt") as st:
                    names = list(st.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CorruptCheckpointError(f"{f}: not a readable safetensors file ({e}); re-save the model") from None
        else:
            sd = _torch_load(f, mmap=True)
            if not _is_state_dict(sd):
                raise CorruptCheckpointError(f"{f}: not a state dict of tensors; re-save with model.save_pretrained")
            names = list(sd)
        dup = keys.intersection(names)
        if dup:
            raise CorruptCheckpointError(f"{path}: tensor {sorted(dup)[0]!r} is in two weight files; keep one copy")
        keys.update(names)
    opt = path / _OPTIMIZER_FILE
    if opt.is_file():
        o = _torch_load(opt, mmap=True)
        _check_storable({"optimizer": o}, opt)


def _load_trainer(path: pathlib.Path, step: int) -> dict:
    from safetensors import safe_open

    model: dict[str, torch.Tensor] = {}
    wfiles = []
    for name in _weight_files(path):
        f = path / name
        if name.endswith(".safetensors"):
            with safe_open(str(f), framework="pt") as st:
                names = list(st.keys())
                model.update({k: st.get_tensor(k) for k in names})
                meta = st.metadata()
        else:
            sd = _torch_load(f, mmap=True)
            names, meta = list(sd), None
            model.update(sd)
        wfiles.append({"file": name, "keys": names, "metadata": meta})
    if len(wfiles) == 1:
        wfiles[0]["keys"] = None  # one file holds every tensor: no need to list the names again
    state: dict = {"model": model}
    opt = path / _OPTIMIZER_FILE
    has_opt = opt.is_file()
    if has_opt:
        state["optimizer"] = _torch_load(opt, mmap=True)

    skip = {w["file"] for w in wfiles} | ({_OPTIMIZER_FILE} if has_opt else set())
    files: dict[str, bytes | torch.Tensor] = {}
    dirs: list[str] = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_dir():
            dirs.append(rel)
        elif p.is_file() and rel not in skip:
            data = p.read_bytes()
            files[rel] = data if len(data) <= INLINE_MAX_BYTES else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    state["extra"] = {"files": files}
    state[LAYOUT_KEY] = {"format": TRAINER_LAYOUT, "name": path.name, "weight_files": wfiles,
                         "optimizer_file": _OPTIMIZER_FILE if has_opt else None, "dirs": dirs, "step": step}
    return state


# ---------------------------------------------------------------------------------------------
# loading one source

def load_source(src: Source) -> dict:
    """The normalised training state of ``src`` (with its ``__layout__``), for CheckpointChain.save."""
    if src.kind == "trainer":
        return _load_trainer(src.path, src.step)
    obj = _torch_load(src.path, mmap=True)
    state, _ = _normalise(obj, src.path.name)
    return state


# ---------------------------------------------------------------------------------------------
# restoring

def layout_of(state) -> dict | None:
    lay = state.get(LAYOUT_KEY) if isinstance(state, dict) else None
    return lay if isinstance(lay, dict) and lay.get("format") in (TORCH_LAYOUT, TRAINER_LAYOUT) else None


def rebuild(state: dict, step: int | None = None):
    """The object to torch.save for ``state``: the structure it was ingested from.

    A torch-file source comes back exactly as it was (model and optimizer at their original keys);
    a Trainer folder as ``{"model", "optimizer", "step", "files"}``; a state saved through the API
    (no layout) as it is.
    """
    lay = layout_of(state)
    if lay is None:
        return state
    if lay["format"] == TRAINER_LAYOUT:
        out = {"model": state.get("model", {})}
        if "optimizer" in state:
            out["optimizer"] = state["optimizer"]
        out["step"] = lay.get("step", step)
        out["files"] = {k: _file_bytes(v) for k, v in state.get("extra", {}).get("files", {}).items()}
        return out
    model = state.get("model")
    if model is not None:
        model = _model_dict(model, lay)
    if lay["model_path"] == []:
        return model
    obj = state.get("extra")
    if lay.get("top_type") == "OrderedDict":
        obj = collections.OrderedDict(obj)
    for path, value in ((lay["model_path"], model), (lay["optimizer_path"], state.get("optimizer"))):
        if path is None:
            continue
        parent = _get(obj, path[:-1])
        parent[path[-1]] = value
    return obj


def _model_dict(model: dict, lay: dict) -> dict:
    if lay.get("model_type") != "OrderedDict":
        return model
    out = collections.OrderedDict(model)
    if "model_metadata" in lay:
        out._metadata = collections.OrderedDict(lay["model_metadata"])  # type: ignore[attr-defined]
    return out


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


def _file_bytes(v) -> bytes:
    if isinstance(v, torch.Tensor):
        return v.contiguous().numpy().tobytes()
    return bytes(v)


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
        raise FileExistsError(f"{out} already exists; pass --force to replace it or choose a new path")
    return out


def write_restored(state: dict, out: str | os.PathLike, *, step: int | None = None, force: bool = False) -> str:
    """Write a restored state to ``out``: ``.pt`` (full state), ``.safetensors`` (weights) or a folder.

    The write goes to a temporary name beside ``out`` and is renamed into place, so a failure never
    leaves a half-written checkpoint. Returns the kind written.
    """
    out = check_output(out, force=force)
    kind = output_kind(out)
    lay = layout_of(state)
    if kind == "folder" and (lay is None or lay["format"] != TRAINER_LAYOUT):
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

            meta = None
            if lay is not None and lay["format"] == TRAINER_LAYOUT and len(lay["weight_files"]) == 1:
                meta = lay["weight_files"][0].get("metadata")
            save_file(model_weights(state), str(tmp), metadata=meta or {"format": "pt"})
        else:
            _write_trainer_folder(state, lay, tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return kind


def _write_trainer_folder(state: dict, lay: dict, folder: pathlib.Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    for d in lay.get("dirs", []):
        (folder / d).mkdir(parents=True, exist_ok=True)
    model = state.get("model", {})
    for w in lay["weight_files"]:
        part = {k: model[k].contiguous() for k in (w["keys"] if w["keys"] is not None else model)}
        if w["file"].endswith(".safetensors"):
            save_file(part, str(folder / w["file"]), metadata=w.get("metadata"))
        else:
            torch.save(part, folder / w["file"])
    if lay.get("optimizer_file"):
        torch.save(state["optimizer"], folder / lay["optimizer_file"])
    for rel, data in state.get("extra", {}).get("files", {}).items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_file_bytes(data))
