"""Lightning integration: every ``ModelCheckpoint`` save goes into a compressed chain.

    from ckptzip.integrations.lightning import CompressedCheckpointIO, SensitivityCallback
    trainer = L.Trainer(plugins=[CompressedCheckpointIO("dynaquant")], callbacks=[SensitivityCallback()])
    trainer.fit(model, ckpt_path="checkpoints/epoch=1-step=100.ckpt")   # resumes from the chain

Lightning names a ``.ckpt`` path per save. The chain lives beside those paths (folder
``<dirpath>/ckptzip-chain``); each ``.ckpt`` path becomes a small JSON pointer
``{"ckptzip": 1, "chain": ..., "step": N}``, so Lightning's own bookkeeping (top-k, last.ckpt,
removal) keeps working, and loading a pointer restores that step from the chain.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from ..chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ..errors import CorruptCheckpointError
from ..methods.base import EncodeContext

CHAIN_DIR = "ckptzip-chain"


class CompressedCheckpointIO(CheckpointIO):
    def __init__(self, method: str = "lossless", config=None, *, threshold: float = 0.01, eval_fn=None,
                 higher_is_better: bool = False, keyframe: KeyframePolicy | None = None,
                 retention: RetentionPolicy | None = None):
        self.method, self.config = method, config
        self.threshold, self.eval_fn, self.higher_is_better = threshold, eval_fn, higher_is_better
        self.keyframe, self.retention = keyframe, retention
        self._chains: dict[str, CheckpointChain] = {}
        self.model = None          # set by SensitivityCallback (for config searches and sensitivity)
        self.gradients = None

    def _chain(self, folder: Path) -> CheckpointChain:
        key = str(folder / CHAIN_DIR)
        if key not in self._chains:
            self._chains[key] = CheckpointChain(key, self.method, self.config, keyframe=self.keyframe,
                                                retention=self.retention)
        return self._chains[key]

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)  # Lightning leaves this to the plugin
        chain = self._chain(path.parent)
        step = int(checkpoint.get("global_step", 0))
        steps = chain.steps()
        if not steps or step > steps[-1]:
            state, layout = _normalize(checkpoint)
            state["__layout__"] = layout
            ctx = EncodeContext(step=step, model=self.model, eval_fn=self.eval_fn, threshold=self.threshold,
                                higher_is_better=self.higher_is_better, gradients=self.gradients)
            chain.save(state, step, model=self.model, ctx=ctx)
        elif step not in steps:
            raise ValueError(f"Lightning saved step {step}, older than the chain's latest {steps[-1]}; "
                             "use a fresh checkpoint folder for a new run")
        # else: same step saved under another name (e.g. last.ckpt): only the pointer is new
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"ckptzip": 1, "chain": CHAIN_DIR, "step": step}))
        os.replace(tmp, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        path = Path(path)
        try:
            ptr = json.loads(path.read_text())
            step = int(ptr["step"])
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CorruptCheckpointError(f"{path}: not a ckptzip pointer file; was it saved with "
                                         "CompressedCheckpointIO?") from None
        state = self._chain(path.parent).load(step)
        ckpt = _denormalize(state)
        if map_location is not None:
            ckpt["state_dict"] = {k: v.to(map_location) if isinstance(v, torch.Tensor) else v
                                  for k, v in ckpt["state_dict"].items()}
        return ckpt

    def remove_checkpoint(self, path) -> None:
        # only the pointer goes: the chain's own retention decides which checkpoints are dropped
        try:
            Path(path).unlink()
        except FileNotFoundError:
            pass

    def teardown(self) -> None:
        for c in self._chains.values():
            c.close()


def _normalize(ckpt: dict) -> tuple[dict, dict]:
    """Lightning's checkpoint dict -> {"model", "optimizer", ...} so records get their roles."""
    rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    state = {"model": ckpt.get("state_dict", {})}
    opts = ckpt.get("optimizer_states", [])
    layout = {"n_optimizers": len(opts)}
    if len(opts) == 1:
        state["optimizer"] = opts[0]
    else:
        state["optimizers"] = list(opts)
    state["lightning"] = rest
    return state, layout


def _denormalize(state: dict) -> dict:
    layout = state.get("__layout__", {})
    ckpt = dict(state.get("lightning", {}))
    ckpt["state_dict"] = state["model"]
    ckpt["optimizer_states"] = [state["optimizer"]] if layout.get("n_optimizers") == 1 else state.get("optimizers", [])
    return ckpt


class SensitivityCallback(Callback):
    """Gives the checkpoint plugin the live model, and records gradient EMAs before each save
    (DynaQuant's sensitivity metric), active only in the ``window`` steps before a save."""

    def __init__(self, window: int = 50, every_n_train_steps: int | None = None):
        self.window, self.every = window, every_n_train_steps
        self._rec = None

    def _plugin(self, trainer) -> CompressedCheckpointIO | None:
        io = trainer.strategy.checkpoint_io
        return io if isinstance(io, CompressedCheckpointIO) else None

    def on_fit_start(self, trainer, pl_module):
        io = self._plugin(trainer)
        if io is None:
            return
        io.model = pl_module
        every = self.every
        if every is None:
            from lightning.pytorch.callbacks import ModelCheckpoint

            mc = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
            every = getattr(mc, "_every_n_train_steps", None) or None
        from ..api import SaveWindowRecorder

        self._rec = SaveWindowRecorder(pl_module, window=self.window, save_every=every)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        io = self._plugin(trainer)
        if io is not None and self._rec is not None:
            io.gradients = self._rec.on_save(trainer.global_step)

    def on_fit_end(self, trainer, pl_module):
        if self._rec is not None:
            self._rec.close()
            self._rec = None
