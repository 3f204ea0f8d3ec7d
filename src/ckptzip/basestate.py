"""Base weights: the state a run started from (a fine-tuning run's pretrained weights), kept by the
user beside the chain, against which keyframes are coded as residuals.

A keyframe of a quantizing method normally quantizes the weights themselves (128 bins on MiniLM);
with a base it quantizes ``w - base`` instead, as a delta after a restore does against its parent
(methods/quantizing.py, stage ``residual/1``). The file records the base's digest, never its
bytes: a restore needs the same base and says so in one line when it is missing or differs.

    base = BaseWeights.from_model(pretrained.state_dict())        # before training
    Compressor(model, opt, url, "dynaquant", base=base)           # or base=state_dict
    # EncodeContext.base / DecodeContext.base carry it to the method (chain.py)

The digest is SHA-256 over the sorted record names, dtypes, shapes and exact bytes.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import BaseMismatchError, ConfigError
from .tensorbytes import dtype_name, tensor_to_bytes

MODEL_PREFIX = "model/"  # flatten_state names the model's tensors "model/<state_dict key>"


@dataclass(frozen=True)
class BaseWeights:
    tensors: Mapping[str, torch.Tensor]   # record name ("model/<key>") -> CPU copy
    digest: str

    @classmethod
    def from_model(cls, state_dict: Mapping[str, torch.Tensor]) -> "BaseWeights":
        """A model ``state_dict`` (or the part of it the run starts from) as base weights: float
        tensors are copied to the CPU (training must not move them), the rest is left out."""
        if not isinstance(state_dict, Mapping):
            raise ConfigError(f"base must be a model state_dict (a mapping of tensors), got {type(state_dict).__name__}")
        tensors = {MODEL_PREFIX + k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()
                   if isinstance(v, torch.Tensor) and v.is_floating_point()}
        if not tensors:
            raise ConfigError("base holds no float tensors; pass the model state_dict the run started from")
        return cls(tensors, digest_of(tensors))

    @classmethod
    def from_file(cls, path) -> "BaseWeights":
        """A model state_dict saved as ``.safetensors`` or with ``torch.save`` (loaded without unpickling
        code: ingest/safeload.py): ``ckptzip restore / verify --base FILE``."""
        import pathlib

        path = pathlib.Path(path)
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            try:
                return cls.from_model(load_file(str(path)))
            except (OSError, ValueError, RuntimeError) as e:  # safetensors' own errors subclass neither
                raise ConfigError(f"--base {path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
        from .ingest.safeload import torch_load

        return cls.from_model(torch_load(path, mmap=False))

    def to_file(self, path) -> None:
        """Save as ``.safetensors`` (the model's keys): ``from_file`` reads back the same digest."""
        from safetensors.torch import save_file

        save_file({n[len(MODEL_PREFIX):]: t.contiguous() for n, t in self.tensors.items()}, str(path))

    @classmethod
    def of(cls, base) -> "BaseWeights | None":
        """``base`` as given to Compressor / CheckpointChain: None, BaseWeights or a state_dict."""
        return base if base is None or isinstance(base, BaseWeights) else cls.from_model(base)

    def matching(self, state_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Record -> base tensor, for the records of the same shape and dtype in ``state_tensors``."""
        return {n: b for n, b in self.tensors.items()
                if n in state_tensors and state_tensors[n].shape == b.shape and state_tensors[n].dtype == b.dtype}


def digest_of(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        t = tensors[n]
        h.update(f"{n}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(tensor_to_bytes(t))
    return h.hexdigest()


def require(base: BaseWeights | None, digest: str, step: int) -> BaseWeights:
    """The base a file coded against base ``digest`` needs, or a one-line error naming the fix."""
    if base is None:
        raise BaseMismatchError(f"step {step} is coded against base weights {digest[:16]}; pass the state_dict the "
                                "run started from (e.g. the pretrained weights) as base= (Compressor, "
                                "CheckpointChain) or --base FILE (ckptzip restore, verify)")
    if base.digest != digest:
        raise BaseMismatchError(f"step {step} is coded against base weights {digest[:16]}, but the base given is "
                                f"{base.digest[:16]}; pass the state_dict the run started from (base= or --base FILE)")
    return base
