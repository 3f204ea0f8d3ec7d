"""Layout ``hf-trainer/1``: a Hugging Face Trainer ``checkpoint-N/`` folder.

The weights (``model.safetensors``, its ``-0000k-of-0000n`` shards, ``adapter_model.safetensors``
or ``pytorch_model.bin``) become ``model``, ``optimizer.pt`` becomes ``optimizer``; every other
file (``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ``training_args.bin``, ...) is
kept byte for byte in ``extra["files"]`` and never unpickled (they hold numpy arrays and custom
classes). ``__layout__`` records (all JSON)::

    {"format": "hf-trainer/1", "name": folder name,
     "weight_files": [{"file": name, "keys": [tensor names] | None (one file: all), "metadata": {...}}],
     "optimizer_file": "optimizer.pt" | None, "dirs": [sub-folders, empty ones too], "step": N}

A restore writes the same files again (the safetensors files with their metadata and key split).
"""
from __future__ import annotations

import json
import pathlib
import re

import torch

from ..errors import CorruptCheckpointError
from .layout import LAYOUT_KEY, SourceLayout, as_step, check_storable, is_state_dict, register
from .safeload import torch_load, verify_archive

TRAINER_LAYOUT = "hf-trainer/1"
# files up to this size are kept as bytes in the skeleton; larger ones as uint8 tensors, which the
# chain compresses (and XORs against the previous checkpoint's copy) and counts in raw bytes
INLINE_MAX_BYTES = 1024

_TRAINER_STATE = "trainer_state.json"
_SHARD_RE = re.compile(r"^(model|adapter_model)(-\d+-of-\d+)?\.safetensors$")
_TORCH_WEIGHTS = "pytorch_model.bin"
_OPTIMIZER_FILE = "optimizer.pt"


@register
class TrainerLayout(SourceLayout):
    descriptor = TRAINER_LAYOUT
    folder = True

    def detect(self, path: pathlib.Path) -> bool:
        return path.is_dir() and bool(_weight_files(path))

    def check(self, path: pathlib.Path) -> tuple[int | None, str]:
        keys: set[str] = set()
        for name in _weight_files(path):
            names = list(_read_weights(path / name, tensors=False)[0])
            dup = keys.intersection(names)
            if dup:
                raise CorruptCheckpointError(f"{path}: tensor {sorted(dup)[0]!r} is in two weight files; "
                                             "keep one copy")
            keys.update(names)
        opt = path / _OPTIMIZER_FILE
        if opt.is_file():
            check_storable({"optimizer": torch_load(opt)}, opt)
            verify_archive(opt)
        return _step(path)

    def load(self, path: pathlib.Path, step: int) -> dict:
        model: dict[str, torch.Tensor] = {}
        wfiles = []
        for name in _weight_files(path):
            sd, meta = _read_weights(path / name, tensors=True)
            model.update(sd)
            wfiles.append({"file": name, "keys": list(sd), "metadata": meta})
        if len(wfiles) == 1:
            wfiles[0]["keys"] = None  # one file holds every tensor: no need to list the names again
        state: dict = {"model": model}
        has_opt = (path / _OPTIMIZER_FILE).is_file()
        if has_opt:
            state["optimizer"] = torch_load(path / _OPTIMIZER_FILE)

        skip = {w["file"] for w in wfiles} | ({_OPTIMIZER_FILE} if has_opt else set())
        files: dict[str, bytes | torch.Tensor] = {}
        dirs: list[str] = []
        for p in sorted(path.rglob("*")):
            rel = p.relative_to(path).as_posix()
            if p.is_dir():
                dirs.append(rel)
            elif p.is_file() and rel not in skip:
                data = p.read_bytes()
                files[rel] = data if len(data) <= INLINE_MAX_BYTES else torch.frombuffer(bytearray(data),
                                                                                         dtype=torch.uint8)
        state["extra"] = {"files": files}
        state[LAYOUT_KEY] = {"format": TRAINER_LAYOUT, "name": path.name, "weight_files": wfiles,
                             "optimizer_file": _OPTIMIZER_FILE if has_opt else None, "dirs": dirs, "step": step}
        return state

    def rebuild(self, state: dict, lay: dict, step: int | None):
        """A .pt restore of a folder: ``{"model", "optimizer", "step", "files"}``."""
        out = {"model": state.get("model", {})}
        if "optimizer" in state:
            out["optimizer"] = state["optimizer"]
        out["step"] = lay.get("step", step)
        out["files"] = {k: file_bytes(v) for k, v in state.get("extra", {}).get("files", {}).items()}
        return out

    def write_folder(self, state: dict, lay: dict, folder: pathlib.Path) -> None:
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
            target.write_bytes(file_bytes(data))

    def weights_metadata(self, lay: dict) -> dict | None:
        return lay["weight_files"][0].get("metadata") if len(lay["weight_files"]) == 1 else None


def _weight_files(path: pathlib.Path) -> list[str]:
    shards = sorted(p.name for p in path.iterdir() if p.is_file() and _SHARD_RE.match(p.name))
    if shards:
        return shards
    return [_TORCH_WEIGHTS] if (path / _TORCH_WEIGHTS).is_file() else []


def _read_weights(f: pathlib.Path, *, tensors: bool) -> tuple[dict, dict | None]:
    """({name: tensor, or None without ``tensors``}, safetensors metadata) of one weight file."""
    if f.suffix != ".safetensors":
        sd = torch_load(f)
        if not tensors:
            verify_archive(f)
        if not is_state_dict(sd):
            raise CorruptCheckpointError(f"{f}: not a state dict of tensors; re-save with model.save_pretrained")
        return sd, None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as st:
            return {k: st.get_tensor(k) if tensors else None for k in st.keys()}, st.metadata()
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{f}: not a readable safetensors file ({e}); re-save the model") from None


def _step(path: pathlib.Path) -> tuple[int | None, str]:
    f = path / _TRAINER_STATE
    if not f.is_file():
        return None, ""
    try:
        doc = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpointError(f"{f}: not valid JSON; repair or delete the file") from None
    step = as_step(doc.get("global_step")) if isinstance(doc, dict) else None
    return (step, "entry:global_step") if step is not None else (None, "")


def file_bytes(v) -> bytes:
    """A kept file's bytes, whether the skeleton held them inline or as a uint8 tensor."""
    if isinstance(v, torch.Tensor):
        return v.contiguous().numpy().tobytes()
    return bytes(v)
