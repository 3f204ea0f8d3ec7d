"""``Compressor``: compressed checkpoints in a plain PyTorch loop, in a few lines.

    ck = ckptzip.Compressor(model, optimizer, "runs/ckpt", method="dynaquant",
                            threshold=0.01, eval_fn=evaluate, scheduler=scheduler)
    step = ck.restore() or 0          # resumes model, optimizer, scheduler, RNG; None if empty
    ...
    if step % 500 == 0: ck.save(step)

What a bit-exact resume needs besides the (possibly lossy) tensors is saved exactly: optimizer step
counts and param_groups, the scheduler, torch / numpy / python (and CUDA) RNG states, the step.
"""
from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch

from .chain import CheckpointChain, Entry, KeyframePolicy, RetentionPolicy
from .configcheck import OneOf, Range, check_arg, check_args
from .fitcheck import check_fits
from .format import CHECKSUMS, DEFAULT_CHECKSUM
from .methods.base import EncodeContext, searches


# the training-loop arguments of Compressor (and of the integrations that share them): annotation, rule
ARGS = {"threshold": (float, Range(ge=0, lt=1, note=" (a relative degradation)")),
        "eval_fn": (Callable | None, None), "higher_is_better": (bool, None),
        "keyframe": (KeyframePolicy | None, None), "retention": (RetentionPolicy | None, None),
        "extra_state": (Callable | None, None), "storage_options": (dict | None, None),
        "save_every": (int | None, Range(ge=1)), "grad_window": (int, Range(ge=1)),
        "async_save": (bool, None), "takeover": (bool, None), "restores": (int, Range(ge=0)),
        "checksum": (str, OneOf(tuple(CHECKSUMS)))}


def rng_state() -> dict:
    version, words, gauss = random.getstate()
    # Python's Mersenne Twister words as an array: a tensor record (``same/1`` while unused), not
    # 625 integers in every file's JSON skeleton
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "python": (version, np.asarray(words, dtype=np.uint32), gauss)}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    version, words, gauss = st["python"]
    random.setstate((version, tuple(int(w) for w in words), gauss))  # words: an array, or a list in older files
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# Share of a restore's degradation still present one restore interval later. Measured on the GPT-2
# demo (10 restores, docs/BENCHMARKS.md "The contract end to end"): checkpoints judged at 1 % ended
# +2.0 % end to end, at 0.5 % +0.8 %, at 0.25 % +0.4 %: accumulation factors 1.6-2.0.
RESTORE_RETENTION = 0.5


def checkpoint_budget(threshold: float, restores: int) -> float:
    """The quality budget of one checkpoint that keeps a run restored up to ``restores`` times
    within ``threshold`` end to end: each restore adds its checkpoint's degradation b, and what
    earlier restores added decays by RESTORE_RETENTION per restore, so the run ends at most
    b * (1 - h**R) / (1 - h) worse (h = RESTORE_RETENTION); with no restores, b = threshold."""
    check_args("checkpoint_budget", ARGS, threshold=threshold, restores=restores)
    h = RESTORE_RETENTION
    return threshold if restores <= 1 else threshold * (1 - h) / (1 - h ** restores)


class Compressor:
    """Save/restore a training run's full state into a compressed chain.

    ``threshold`` is the run's end-to-end quality budget: a run restored from the chain up to
    ``restores`` times (default 10, the paper's fault-tolerance experiment) should end within it of
    the same run without failures. Each checkpoint's config search is judged against the smaller
    ``checkpoint_budget(threshold, restores)`` (about threshold / 2 for 4 or more restores);
    ``restores=1`` judges each checkpoint against the whole threshold, as ckptzip 0.1 did.
    ``base``: the model state_dict the run started from (a fine-tuning run's pretrained weights) or
    a ``basestate.BaseWeights``; a quantizing method then codes keyframes as residuals against it,
    and a restore needs the same base (``BaseMismatchError`` names the fix).
    Methods without a config search accept and ignore ``threshold`` and ``eval_fn``. ``eval_fn``
    returns a float score (relative ``threshold`` on it), or the model's outputs on a fixed batch
    as a tensor: then ``threshold`` bounds their relative error (search/quality.py), the signal to
    use when fine-tuning, where the task loss cannot yet see damage to pretrained weights.
    Gradient capture for DynaQuant's sensitivity metric installs itself: hooks record a gradient
    EMA only in the ``grad_window`` backward passes before a save (the save interval is learned
    from the first saves, or given as ``save_every``); outside that window they cost nothing.
    ``checksum``: each blob's checksum in the files written, ``"blake3"`` (default), ``"sha256"`` or
    ``"crc32"`` (against accidental corruption only): CheckpointChain says more.

    ``async_save=True`` keeps the config search; ``save`` copies the state and returns. Where the
    search runs:

    - ``engine_options=EngineOptions(agent_eval="mypkg.evals:make")``: in the agent process, which
      builds (model, eval_fn) from that function once (as ``ckptzip compress --eval`` does) and
      searches against its own reference: nothing of the search runs in the trainer's process.
      ``eval_fn`` here may be None.
    - else, with ``eval_fn``: on a background thread of the trainer, on a scratch copy of the model;
      the agent encodes with the chosen knobs (asyncsearch.py says what ``eval_fn`` must then
      respect: no global RNG, only the model it is given). Its Python shares the trainer's GIL.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, url,
                 method: str = "lossless", *, config=None, threshold: float = 0.01,
                 eval_fn: Callable[[torch.nn.Module], float | torch.Tensor] | None = None,
                 higher_is_better: bool = False,
                 scheduler=None, extra_state: Callable[[], dict] | None = None,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None, save_every: int | None = None, grad_window: int = 50,
                 async_save: bool = False, engine_options=None, takeover: bool = False, restores: int = 10,
                 base=None, checksum: str = DEFAULT_CHECKSUM):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_args("Compressor", ARGS, threshold=threshold, eval_fn=eval_fn, higher_is_better=higher_is_better,
                   keyframe=keyframe, retention=retention, extra_state=extra_state, storage_options=storage_options,
                   save_every=save_every, grad_window=grad_window, async_save=async_save, takeover=takeover,
                   restores=restores, checksum=checksum)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.eval_fn, self.threshold, self.higher_is_better = eval_fn, threshold, higher_is_better
        self.budget = checkpoint_budget(threshold, restores)
        self.extra_state = extra_state
        self.chain = CheckpointChain(url, method, config, keyframe=keyframe, retention=retention,
                                     storage_options=storage_options, takeover=takeover, base=base,
                                     checksum=checksum)
        self._recorder = None
        if _wants_gradients(self.chain.method):
            self._recorder = SaveWindowRecorder(model, window=grad_window, save_every=save_every)
        self._engine = self._searcher = None
        if async_save:
            from .engine import AsyncCheckpointEngine, EngineOptions
            from .engine.options import warn_if_oversubscribed

            check_arg("Compressor engine_options", engine_options, EngineOptions | None)
            self._engine = AsyncCheckpointEngine(url, method, config, options=engine_options,
                                                 keyframe=keyframe, retention=retention,
                                                 storage_options=storage_options, takeover=takeover,
                                                 checksum=checksum, base=self.chain.base)
            warn_if_oversubscribed(model, self._engine.options)
            if eval_fn is not None and searches(self.chain.method) and not self._engine.options.agent_eval:
                from .asyncsearch import SearchingSaver

                # the search runs on a background thread here; the agent encodes with its knobs
                self._searcher = SearchingSaver(self._engine, self.chain.method, model, eval_fn,
                                                threshold=self.budget, higher_is_better=higher_is_better)

    # --------------------------------------------------------------------------------------
    def state(self, step: int) -> dict:
        st = {"model": self.model.state_dict(), "step": int(step), "rng": rng_state()}
        if self.optimizer is not None:
            st["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            st["scheduler"] = self.scheduler.state_dict()
        if self.extra_state is not None:
            st["extra"] = self.extra_state()
        return st

    def save(self, step: int) -> Entry | object:
        """Checkpoint the run at ``step``. Returns the committed entry (or an async handle)."""
        grads = self._recorder.on_save(step) if self._recorder is not None else None
        ctx = EncodeContext(step=int(step), model=self.model, eval_fn=self.eval_fn, threshold=self.budget,
                            higher_is_better=self.higher_is_better, gradients=grads)
        if self._searcher is not None:
            return self._searcher.save(self.state(step), step, model=self.model, optimizer=self.optimizer,
                                       gradients=grads)
        if self._engine is not None:
            return self._engine.save(self.state(step), step, model=self.model, optimizer=self.optimizer, ctx=ctx)
        return self.chain.save(self.state(step), step, model=self.model, optimizer=self.optimizer, ctx=ctx)

    def restore(self, step: int | None = None, *, strict: bool = True) -> int | None:
        """Load ``step`` (latest when None) into model, optimizer, scheduler and RNG; None if empty.

        A checkpoint that does not fit the model or optimizer raises StateMismatchError naming the
        first differing tensor, before anything is loaded; ``strict`` as in ``load_state_dict``.
        """
        if self._engine is not None:
            found = self._engine.restore(step)
            if found is None:
                return None
            state, step = found
            if self._searcher is not None and step in self.chain.steps():
                # the search runs here, not in the agent: resume its steady state and its reference
                # (the decoded weights a residual is taken against) from the file, as a synchronous
                # writer does when it rebuilds its reference
                self.chain.method.resume(self.chain.manifest(step).get("method_meta", {}))
                decoded = self._engine.chain if self._engine.last_restore == (step, "storage") else self.chain
                self._searcher.resume(decoded.reference(step))
        else:
            if not self.chain.steps():
                return None
            state = self.chain.load(step)
        check_fits(state, self.model, self.optimizer, strict=strict, step=state.get("step", step))
        self.model.load_state_dict(state["model"], strict=strict)
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            set_rng_state(state["rng"])
        self.restored_extra = state.get("extra")
        if self._recorder is not None:
            self._recorder.on_restore(int(state["step"]))
        return int(state["step"])

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed (re-raises agent errors)."""
        if self._searcher is not None:
            self._searcher.wait()
        if self._engine is not None:
            self._engine.wait()

    def close(self) -> None:
        """Flush pending work; release hooks, processes and the method's resources."""
        try:
            if self._searcher is not None:
                self._searcher.close()
            if self._engine is not None:
                self._engine.close()
        finally:
            if self._recorder is not None:
                self._recorder.close()
            self.chain.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SaveWindowRecorder:
    """Arms a GradientRecorder for the ``window`` training forward passes before each expected save.

    The loop never tells us its step, so a forward pre-hook on the model counts training passes
    (``model.training`` with grad enabled: evaluation passes do not count). The save interval is
    ``save_every`` when given, else learned from the passes between the last two saves; before it
    is known (the first save) nothing is recorded and sensitivity falls back to magnitude.
    """

    def __init__(self, model: torch.nn.Module, *, window: int = 50, save_every: int | None = None,
                 beta: float = 0.9):
        from .sensitivity import GradientRecorder

        self.rec = GradientRecorder(model, beta=beta, window=window)
        self.window, self.interval, self.count = window, save_every, 0
        self._hook = model.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.count += 1
        if self.interval is not None and not self.rec.armed and self.interval - self.count < self.window:
            self.rec.arm()

    def on_save(self, step: int) -> dict[str, torch.Tensor] | None:
        """Gradient EMAs recorded in this window (None if none), then reset for the next window."""
        grads = self.rec.gradients() if self.rec.steps > 0 else None
        self.rec.disarm()
        if self.count > 0:
            self.interval = self.interval or self.count
        self.count = 0
        return grads or None

    def on_restore(self, step: int) -> None:
        self.rec.disarm()
        self.count = 0

    def close(self) -> None:
        self._hook.remove()
        self.rec.close()


def _wants_gradients(method) -> bool:
    cfg = getattr(method, "config", None)
    return bool(getattr(method, "uses_gradients", False) or getattr(cfg, "prune_metric", None) == "sensitivity")
