"""Hugging Face ``transformers.Trainer``: each save goes into a compressed chain; resume from any step.

    from ckptzip.integrations.hf import CkptzipCallback, restore_checkpoint
    trainer = Trainer(..., callbacks=[CkptzipCallback("runs/chain", method="dynaquant")])
    trainer.train()
    # later, in a new process:
    folder = restore_checkpoint("runs/chain", step=200, out_dir="runs/resume")
    trainer.train(resume_from_checkpoint=folder)

The callback ingests the ``checkpoint-N/`` folder the Trainer has just written (weights,
optimizer, scheduler, RNG, trainer state: every file, the non-tensor ones byte for byte) into the
chain, in source layout ``hf-trainer/1`` (ckptzip/ingest/trainer.py); ``delete_folders=True``
then removes the uncompressed folder, so only the chain stays on disk. ``restore_checkpoint``
rebuilds the folder in the same layout for ``resume_from_checkpoint``.

A run resumed from a step older than the chain's latest would save a second trajectory into a
chain that already holds the first one's later steps. ``rewind="error"`` (default) refuses at
the first such save with a StepOrderError and keeps the chain as it is; ``rewind="truncate"``
drops the chain's steps after the resumed step when training begins, so the new run continues
the chain from there.
"""
from __future__ import annotations

import pathlib
import shutil

from transformers import TrainerCallback

from ..api import ARGS, checkpoint_budget
from ..chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ..configcheck import OneOf, check_arg, check_args
from ..errors import StepOrderError
from ..ingest import LAYOUTS, TRAINER_LAYOUT, write_restored
from ..methods.base import EncodeContext


class CkptzipCallback(TrainerCallback):
    def __init__(self, chain_url, method: str = "lossless", config=None, *, delete_folders: bool = False,
                 threshold: float = 0.01, eval_fn=None, higher_is_better: bool = False,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 rewind: str = "error", restores: int = 10):
        check_args("CkptzipCallback", ARGS, threshold=threshold, eval_fn=eval_fn, higher_is_better=higher_is_better,
                   keyframe=keyframe, retention=retention, restores=restores)
        check_arg("CkptzipCallback delete_folders", delete_folders, bool)
        check_arg("CkptzipCallback rewind", rewind, str, OneOf(("error", "truncate")))
        self.rewind = rewind
        self.chain = CheckpointChain(chain_url, method, config, keyframe=keyframe, retention=retention)
        self.delete_folders = delete_folders
        self.threshold, self.eval_fn, self.higher_is_better = threshold, eval_fn, higher_is_better
        self.budget = checkpoint_budget(threshold, restores)  # api.Compressor explains
        self.saved: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if self.rewind == "truncate" and state.is_world_process_zero:
            steps = self.chain.steps()
            if steps and steps[-1] > state.global_step:
                self.chain.truncate(int(state.global_step))

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        folder = pathlib.Path(args.output_dir) / f"checkpoint-{step}"
        if not folder.is_dir():
            return
        steps = self.chain.steps()
        if steps and step == steps[-1]:
            return  # already in the chain (a save repeated at the same step)
        if steps and step < steps[-1]:
            raise StepOrderError(f"CkptzipCallback: step {step} is older than the chain's latest step {steps[-1]} "
                                 "(a run resumed from an earlier step); pass rewind='truncate' to continue the "
                                 "chain from the resumed step, or use a new chain")
        st = LAYOUTS[TRAINER_LAYOUT].load(folder, step)
        ctx = EncodeContext(step=step, model=model, eval_fn=self.eval_fn, threshold=self.budget,
                            higher_is_better=self.higher_is_better)
        self.chain.save(st, step, model=model, ctx=ctx)
        self.saved.append(step)
        if self.delete_folders:
            shutil.rmtree(folder, ignore_errors=True)


def restore_checkpoint(chain_url, step: int | None = None, out_dir=".", *, force: bool = False) -> str:
    """Rebuild the Trainer's ``checkpoint-N/`` folder of ``step`` (latest if None) under ``out_dir``.

    An existing non-empty folder of that name is an error unless ``force`` (then it is replaced).
    """
    chain = CheckpointChain(chain_url)
    restored = chain.restore(step)
    folder = pathlib.Path(out_dir) / f"checkpoint-{restored.step}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    write_restored(restored.state, folder, step=restored.step, force=force)
    return str(folder)
