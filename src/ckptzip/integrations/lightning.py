"""Lightning integration: every ``ModelCheckpoint`` save goes into a compressed chain.

    from ckptzip.integrations.lightning import CompressedCheckpointIO, SensitivityCallback
    trainer = L.Trainer(plugins=[CompressedCheckpointIO("dynaquant")], callbacks=[SensitivityCallback()])
    trainer.fit(model, ckpt_path="checkpoints/epoch=1-step=100.ckpt")   # resumes from the chain

Lightning names a ``.ckpt`` path per save. The chain lives beside those paths (folder
``<dirpath>/ckptzip-chain``); each ``.ckpt`` path becomes a small JSON pointer
``{"ckptzip": 1, "chain": ..., "step": N}``, so Lightning's own bookkeeping (top-k, last.ckpt,
removal) keeps working, and loading a pointer restores that step from the chain. The checkpoint
dict is stored in source layout ``lightning/1`` (ckptzip/ingest/lightning.py), so
``ckptzip restore <dirpath>/ckptzip-chain --out x.ckpt`` writes a file plain Lightning loads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from ..api import ARGS, checkpoint_budget
from ..chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ..configcheck import Range, check_arg, check_args
from ..errors import StepOrderError
from ..ingest import lightning as layout
from ..methods.base import EncodeContext, get_method
from ..sensitivity import GradientRecorder, should_arm

CHAIN_DIR = "ckptzip-chain"


class CompressedCheckpointIO(CheckpointIO):
    def __init__(self, method: str = "lossless", config=None, *, threshold: float = 0.01, eval_fn=None,
                 higher_is_better: bool = False, keyframe: KeyframePolicy | None = None,
                 retention: RetentionPolicy | None = None, restores: int = 10):
        check_args("CompressedCheckpointIO", ARGS, threshold=threshold, eval_fn=eval_fn,
                   higher_is_better=higher_is_better, keyframe=keyframe, retention=retention, restores=restores)
        get_method(method, config).close()  # a bad method or config is refused now, not at the first save
        self.method, self.config = method, config
        self.threshold, self.eval_fn, self.higher_is_better = threshold, eval_fn, higher_is_better
        self.budget = checkpoint_budget(threshold, restores)  # api.Compressor explains
        self.keyframe, self.retention = keyframe, retention
        self._chains: dict[str, CheckpointChain] = {}
        self.model = None          # set by SensitivityCallback (for config searches and sensitivity)
        self.gradients = None

    def _chain(self, folder: Path, name: str = CHAIN_DIR) -> CheckpointChain:
        key = str(folder / name)
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
            ctx = EncodeContext(step=step, model=self.model, eval_fn=self.eval_fn, threshold=self.budget,
                                higher_is_better=self.higher_is_better, gradients=self.gradients)
            chain.save(layout.normalise(checkpoint, path.name), step, model=self.model, ctx=ctx)
        elif step not in steps:
            raise StepOrderError(f"Lightning saved step {step}, older than the chain's latest {steps[-1]} in "
                              f"{chain.url}; use a fresh checkpoint folder for a new run")
        # else: same step saved under another name (e.g. last.ckpt): only the pointer is new
        layout.write_pointer(path, CHAIN_DIR, step)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        path = Path(path)
        ptr = layout.read_pointer(path)
        ckpt = layout.to_checkpoint(self._chain(path.parent, ptr.chain).load(ptr.step), path)
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


class SensitivityCallback(Callback):
    """Gives the checkpoint plugin the live model, and records gradient EMAs before each save
    (DynaQuant's sensitivity metric), active only in the ``window`` training steps before a save.

    The window is placed on Lightning's own step counter (``trainer.global_step``, which
    ModelCheckpoint's ``every_n_train_steps`` counts too), so it does not matter which submodules
    ``training_step`` calls. The save interval is ``every_n_train_steps`` when given (pass your
    ModelCheckpoint's so the first save has gradients too), else learned from the steps between
    saves: Lightning exposes no public save interval, and until one save is seen nothing is
    recorded and sensitivity falls back to magnitude.
    """

    def __init__(self, window: int = 50, every_n_train_steps: int | None = None):
        check_arg("SensitivityCallback window", window, int, Range(ge=1))
        check_arg("SensitivityCallback every_n_train_steps", every_n_train_steps, int | None,
                  Range(ge=1, note=" (None: learned from the saves)"))
        self.window, self.every = window, every_n_train_steps
        self._rec: GradientRecorder | None = None
        self._learned: int | None = None   # steps between the last two saves
        self._last: int | None = None      # global_step of the last save (or where this fit started)

    def _plugin(self, trainer) -> CompressedCheckpointIO | None:
        io = trainer.strategy.checkpoint_io
        return io if isinstance(io, CompressedCheckpointIO) else None

    def on_fit_start(self, trainer, pl_module):
        io = self._plugin(trainer)
        if io is None:
            return
        io.model = pl_module
        self._rec = GradientRecorder(pl_module, window=self.window)
        self._last = self._learned = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._rec is None:
            return
        if self._last is None:
            self._last = trainer.global_step  # the first batch of this fit (after a resume: the restored step)
        every = self.every or self._learned
        if every and should_arm(trainer.global_step + 1, every, self.window):
            self._rec.arm()  # no-op while armed

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        io = self._plugin(trainer)
        if io is None or self._rec is None:
            return
        io.gradients = (self._rec.gradients() or None) if self._rec.steps > 0 else None
        self._rec.disarm()
        step = trainer.global_step
        if self._last is not None and step > self._last:  # a second save of the same step teaches nothing
            self._learned = step - self._last
        self._last = step

    def on_fit_end(self, trainer, pl_module):
        if self._rec is not None:
            self._rec.close()
            self._rec = None
